"""Heads trained by vllm-project/speculators load exactly: a head written in their layout (config.json
as `Eagle3SpeculatorConfig` / `PEagleSpeculatorConfig` serialise it, model.safetensors with their
module names) drafts what speculators' model code computes, options Aerie cannot represent are
refused by name, and `--warm-start` trains from it.

The reference below rebuilds speculators' model from the same transformers modules it uses
(`LlamaDecoderLayer` / `Qwen3DecoderLayer`, their RMSNorm and rotary embedding), following
speculators/models/eagle3/model_definitions.py `Eagle3FirstLayerMixin.forward`,
speculators/models/eagle3/core.py `Eagle3DraftModel.__init__` / `.forward` (one TTT step's body),
speculators/models/peagle/core.py `PEagleDraftModel.forward` (the parallel group) and
speculators/model.py `DraftVocabMixin._init_vocab`. Eager attention with explicit masks replaces
their flex-attention masks (same pattern: causal, `kv > q - sliding_window`).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import CONFIG_MAPPING, DynamicCache, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.heads.fit import Example, TrainConfig, fit
from aerie.heads.io import HeadMismatchError, load_head, save_head
from aerie.heads.layers import ListCache
from aerie.heads.speculators import UnsupportedHead
from aerie.heads.vocab import build_draft_vocab
from aerie.target import Target
from tests.random_models import VOCAB, hf_greedy, random_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
COMPONENTS = {"llama": (LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding),
              "qwen3": (Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding)}


class Eagle3FirstLayer:
    """speculators' `Eagle3FirstLayerMixin`: q/k/v read cat(embeds, hidden) (2H), the residual is the
    hidden half (normalised with norm_before_residual)."""

    def patch(self, config, norm_class, norm_before_residual: bool) -> None:
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads),
                            ("v_proj", config.num_key_value_heads)):
            setattr(self.self_attn, name, nn.Linear(2 * config.hidden_size, heads * config.head_dim,
                                                    bias=config.attention_bias))

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, position_embeddings=None,
                **kwargs):
        mid = hidden_states.shape[2] // 2
        embeds, hidden = hidden_states.split(mid, dim=-1)
        residual = hidden
        embeds = self.input_layernorm(embeds)
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        hidden_states = torch.cat([embeds, hidden], dim=-1)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, cache=cache,
                                          position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaFirstLayer(Eagle3FirstLayer, LlamaDecoderLayer):
    pass


class Qwen3FirstLayer(Eagle3FirstLayer, Qwen3DecoderLayer):
    pass


class SpeculatorsReference(nn.Module):
    """speculators' Eagle3DraftModel / PEagleDraftModel built from a config.json dictionary."""

    def __init__(self, data: dict):
        super().__init__()
        raw = data["transformer_layer_config"]
        tl = CONFIG_MAPPING[raw.get("model_type", "qwen3")](**{k: v for k, v in raw.items() if k != "model_type"})
        tl._attn_implementation = "eager"
        layer_class, norm_class, rotary_class = COMPONENTS[tl.model_type]
        self.data, self.tl = data, tl
        hidden, vocab, draft = tl.hidden_size, tl.vocab_size, data["draft_vocab_size"]
        if draft != vocab:
            self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(draft, dtype=torch.long))
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, draft, bias=False)
        num_aux = len(data["eagle_aux_hidden_state_layer_ids"])
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        first = (LlamaFirstLayer if tl.model_type == "llama" else Qwen3FirstLayer)(tl, 0)
        first.patch(tl, norm_class, data["norm_before_residual"])
        self.layers = nn.ModuleList([first] + [layer_class(tl, i) for i in range(1, tl.num_hidden_layers)])
        self.sliding_window = getattr(tl, "sliding_window", None)
        self.sliding = [i for i, t in enumerate(getattr(tl, "layer_types", None) or []) if t == "sliding_attention"]
        doubled = copy.copy(tl)
        doubled.hidden_size *= 2
        self.rotary_emb = rotary_class(doubled)
        self.norm = norm_class(hidden, eps=tl.rms_norm_eps)
        self.input_norm = norm_class(num_aux * hidden, eps=tl.rms_norm_eps) if data.get("norm_before_fc") else None
        self.fc_norm = nn.ModuleList([norm_class(hidden, eps=tl.rms_norm_eps) for _ in range(num_aux)]) \
            if data.get("fc_norm") else None
        if data["speculators_model_type"] == "peagle":
            self.mask_hidden = nn.Parameter(torch.randn(1, 1, num_aux * hidden))

    def project(self, hidden_states):
        if self.input_norm is not None:
            hidden_states = self.input_norm(hidden_states)
        if self.fc_norm is not None:
            chunks = hidden_states.chunk(len(self.fc_norm), dim=-1)
            hidden_states = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(hidden_states)

    def mask(self, q_pos, kv_pos, window):
        """Additive [1, 1, q, kv] mask: causal over positions, within the window where one applies."""
        seen = kv_pos[None, :] <= q_pos[:, None]
        if window is not None:
            seen &= kv_pos[None, :] > q_pos[:, None] - window
        return torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]

    def step(self, input_ids, hidden_states, position_ids, cache, kv_positions):
        """One drafting step (the body of Eagle3DraftModel.forward's TTT loop, or PEagleDraftModel's
        single pass): (the state fed to the next step, draft logits)."""
        embeds = self.embed_tokens(input_ids)
        hidden_states = torch.cat([embeds, hidden_states], dim=-1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        q_pos = position_ids[0]
        full, windowed = self.mask(q_pos, kv_positions, None), self.mask(q_pos, kv_positions, self.sliding_window)
        for index, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, attention_mask=windowed if index in self.sliding else full,
                                  position_ids=position_ids, cache=cache, position_embeddings=position_embeddings)
        if self.data.get("norm_output"):
            hidden_states = self.norm(hidden_states)
            return hidden_states, self.lm_head(hidden_states)
        return hidden_states, self.lm_head(self.norm(hidden_states))

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids] if hasattr(self, "d2t") else draft_ids


def layer_config(kind: str, vocab: int, **kwargs) -> dict:
    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    return (LlamaConfig if kind == "llama" else Qwen3Config)(**{**common, **kwargs}).to_diff_dict()


def speculators_json(method: str, layers: dict, draft_vocab: int, **fields) -> dict:
    """config.json as speculators writes it (`SpeculatorModelConfig.save_pretrained`)."""
    return {
        "architectures": ["Eagle3Speculator" if method == "eagle3" else "PEagleSpeculator"],
        "speculators_model_type": method,
        "speculators_version": "0.3.0",
        "transformer_layer_config": layers,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [2, 2, 1],  # vLLM's default [2, L//2, L-3] for the 4-layer target
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": method == "peagle",
        "speculators_config": {
            "algorithm": method,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tests/random-llama", "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
        "transformers_version": "5.24.0",
        **fields,
    }


VARIANTS = {
    # speculators' current EAGLE-3 recipe: norms before the residual and fc, normalised output,
    # every layer on a sliding window; reduced draft vocabulary
    "eagle3-recipe": lambda vocab=VOCAB: speculators_json(
        "eagle3", layer_config("llama", vocab, num_hidden_layers=1, sliding_window=2048,
                               layer_types=["sliding_attention"]),
        128, norm_before_residual=True, norm_before_fc=True, norm_output=True),
    # per-layer fc norms, Llama-3 RoPE scaling, biases, two layers, the full vocabulary (no d2t / t2d),
    # EAGLE-3's original `midlayer.` names
    "eagle3-fc-norm": lambda vocab=VOCAB: speculators_json(
        "eagle3", layer_config("llama", vocab, num_hidden_layers=2, attention_bias=True, mlp_bias=True,
                               rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                                                "rope_theta": 500000.0}),
        vocab, fc_norm=True),
    # P-EAGLE on Qwen3 layers (q_norm / k_norm), attention bias, YaRN RoPE, its own trained embedding
    "peagle-qwen3": lambda vocab=VOCAB: speculators_json(
        "peagle", layer_config("qwen3", vocab, num_hidden_layers=2, attention_bias=True,
                               rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 256, "rope_theta": 10000.0}),
        256, norm_before_residual=True, mask_token_id=vocab - 1),
}


def write_head(path, data: dict, target: Target, seed: int = 0, midlayer: bool = False) -> SpeculatorsReference:
    """A speculators head of random weights (norms around 1, the target's embedding unless the head
    trains its own), saved as speculators saves it: its state dict in model.safetensors."""
    torch.manual_seed(seed)
    reference = SpeculatorsReference(data)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        if not data["embed_requires_grad"]:
            reference.embed_tokens.weight.copy_(target.embed_tokens.weight)
        if hasattr(reference, "d2t"):
            counts = torch.randint(0, 1000, (reference.tl.vocab_size,), generator=torch.Generator().manual_seed(seed))
            d2t, t2d = build_draft_vocab(counts, data["draft_vocab_size"])
            reference.d2t.copy_(d2t)
            reference.t2d.copy_(t2d)
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    if midlayer:
        state = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in state.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(data, indent=2))
    return reference.eval()


@pytest.fixture(scope="module")
def llama_target() -> Target:
    return Target(random_model("llama", seed=3))


def target_inputs(target: Target, n: int = 12, seed: int = 0):
    """Tokens t_0..t_n and the target's fused features of t_0..t_{n-1}: head row i pairs t_{i+1}
    at position i+1 with the feature of position i."""
    tokens = torch.randint(1, VOCAB, (1, n + 1), generator=torch.Generator().manual_seed(seed))
    features = target.forward(tokens[:, :n], torch.arange(n)[None], features="eagle3").features
    return tokens[:, 1:], features, torch.arange(1, n + 1)[None]


@pytest.mark.parametrize("variant", ["eagle3-recipe", "eagle3-fc-norm"])
def test_eagle3_chain_drafts_as_speculators_computes(llama_target, tmp_path, variant):
    data = VARIANTS[variant]()
    reference = write_head(tmp_path, data, llama_target, midlayer=variant == "eagle3-fc-norm")
    head = load_head(tmp_path, llama_target)
    ids, features, positions = target_inputs(llama_target)
    n = ids.shape[1]
    with torch.no_grad():
        ref_cache, ref_keys = DynamicCache(), positions[0]
        ref_h, ref_logits = reference.step(ids, reference.project(features), positions, ref_cache, ref_keys)
        cache = ListCache(head.num_layers)
        out = head(ids, positions, features=features, cache=cache)
        torch.testing.assert_close(out.logits, ref_logits, atol=2e-5, rtol=1e-4)
        mine, theirs = out, (ref_h, ref_logits)
        for step in range(1, 4):  # chain drafting: each step feeds its hidden state and draft to the next
            token = head.draft_to_target(mine.logits[:, -1:].argmax(-1))
            assert torch.equal(token, reference.to_target(theirs[1][:, -1:].argmax(-1)))
            pos = torch.tensor([[n + step]])
            ref_keys = torch.cat([ref_keys, pos[0]])
            theirs = reference.step(token, theirs[0][:, -1:], pos, ref_cache, ref_keys)
            mine = head(token, pos, hidden=mine.hidden[:, -1:], cache=cache)
            torch.testing.assert_close(mine.logits, theirs[1], atol=2e-5, rtol=1e-4)
    assert head.config.norm_output == data["norm_output"] and head.config.fc_norm == data["fc_norm"]


def test_peagle_parallel_drafts_as_speculators_computes(llama_target, tmp_path):
    data = VARIANTS["peagle-qwen3"]()
    reference = write_head(tmp_path, data, llama_target, seed=1)
    head = load_head(tmp_path, llama_target)
    assert head.config.layer_type == "qwen3" and head.mask_token_id == VOCAB - 1
    ids, features, positions = target_inputs(llama_target, seed=1)
    k, n = 4, ids.shape[1]
    # the last real position, then K-1 placeholders: the mask token with mask_hidden (PEagleProposer's layout)
    ids = torch.cat([ids, torch.full((1, k - 1), head.mask_token_id)], dim=1)
    positions = torch.arange(1, n + k)[None]
    with torch.no_grad():
        ref_in = torch.cat([features, reference.mask_hidden.expand(1, k - 1, -1)], dim=1)
        _, ref_logits = reference.step(ids, reference.project(ref_in), positions, None, positions[0])
        feats = torch.cat([features, head.mask_hidden.expand(1, k - 1, -1)], dim=1)
        out = head(ids, positions, features=feats)
    torch.testing.assert_close(out.logits, ref_logits, atol=2e-5, rtol=1e-4)
    assert torch.equal(head.draft_to_target(out.logits[:, -k:].argmax(-1)),
                       reference.to_target(ref_logits[:, -k:].argmax(-1)))
    assert not torch.equal(head.embed_tokens.weight, llama_target.embed_tokens.weight)  # the head's own


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_the_engine_drafts_with_a_speculators_head_losslessly(llama_target, tmp_path, method):
    data = VARIANTS["eagle3-recipe" if method == "eagle3" else "peagle-qwen3"]()
    write_head(tmp_path, data, llama_target)
    engine = build_engine(llama_target, EngineConfig(max_slots=2, max_len=64), method, head=tmp_path, k=3)
    prompts = [[5, 17, 42, 7, 99, 3], [11, 12, 13]]
    got = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert [r.token_ids for r in got] == [hf_greedy(llama_target.model, p, 10) for p in prompts]


def _edit(data: dict, path: str, value) -> dict:
    data = copy.deepcopy(data)
    *parents, key = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    return data


DELETE = object()


@pytest.mark.parametrize(
    ("variant", "edit", "value", "message"),
    [
        ("eagle3-recipe", "transformer_layer_config.hidden_act", "gelu", "hidden_act='gelu'"),
        ("eagle3-recipe", "transformer_layer_config.model_type", "mistral", "model_type 'mistral'"),
        ("eagle3-recipe", "transformer_layer_config.rope_parameters",
         {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "rope_type='dynamic'"),
        ("eagle3-recipe", "transformer_layer_config.rope_parameters",
         {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("eagle3-recipe", "norm_before_residual", DELETE, "no norm_before_residual"),
        ("eagle3-recipe", "eagle_aux_hidden_state_layer_ids", [1, 2, 2, 1], "eagle_aux_hidden_state_layer_ids"),
        ("eagle3-recipe", "speculators_model_type", "dflash", "speculators_model_type 'dflash'"),
        ("peagle-qwen3", "mask_token_id", None, "mask_token_id"),
    ],
)
def test_what_cannot_be_represented_is_refused_by_name(llama_target, tmp_path, variant, edit, value, message):
    write_head(tmp_path, VARIANTS[variant](), llama_target)
    data = _edit(json.loads((tmp_path / "config.json").read_text()), edit, value)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedHead, match=message):
        load_head(tmp_path, llama_target)


def test_other_taps_a_lost_vocabulary_and_a_short_window_are_refused(llama_target, tmp_path):
    data = VARIANTS["eagle3-recipe"]()
    write_head(tmp_path / "taps", {**data, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}, llama_target)
    with pytest.raises(HeadMismatchError, match=r"eagle_aux_hidden_state_layer_ids \[1, 2, 3\]"):
        load_head(tmp_path / "taps", llama_target)
    write_head(tmp_path / "vocab", data, llama_target)
    from safetensors.torch import load_file

    weights = {k: v for k, v in load_file(str(tmp_path / "vocab" / "model.safetensors")).items() if k != "d2t"}
    weights.pop("t2d")
    save_file(weights, str(tmp_path / "vocab" / "model.safetensors"))
    with pytest.raises(UnsupportedHead, match="no d2t / t2d"):
        load_head(tmp_path / "vocab", llama_target)
    narrow = _edit(data, "transformer_layer_config.sliding_window", 32)
    write_head(tmp_path / "window", narrow, llama_target)
    head = load_head(tmp_path / "window", llama_target)
    build_engine(llama_target, EngineConfig(max_slots=1, max_len=29), "eagle3", head=head, k=3)  # 32 positions fit
    with pytest.raises(ValueError, match="sliding_window=32"):
        build_engine(llama_target, EngineConfig(max_slots=1, max_len=64), "eagle3", head=head, k=3)


def test_warm_start_trains_from_a_speculators_head(llama_target, tmp_path):
    data = VARIANTS["eagle3-recipe"]()
    write_head(tmp_path / "theirs", data, llama_target)
    head = load_head(tmp_path / "theirs", llama_target)
    start = {k: v.clone() for k, v in head.trainable_state_dict().items()}
    generator = torch.Generator().manual_seed(4)
    examples = [Example(torch.randint(1, VOCAB, (24,), generator=generator).tolist(), [False] * 8 + [True] * 16)
                for _ in range(8)]
    result = fit(head.train(), llama_target, examples, config=TrainConfig(epochs=2, batch_size=4, max_length=32,
                                                                          lr=1e-2), progress=False)
    assert result.steps == 4 and all(torch.isfinite(torch.tensor(m["loss"])) for m in result.history)
    trained = head.trainable_state_dict()
    assert not torch.equal(trained["layers.0.self_attn.q_proj.weight"], start["layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(trained["input_norm.weight"], start["input_norm.weight"])
    assert torch.equal(trained["d2t"], start["d2t"])  # the draft vocabulary is kept
    # saved again it keeps every option, in Aerie's config and in the speculators fields vLLM reads
    save_head(head, tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    for key in ("norm_before_residual", "norm_before_fc", "norm_output"):
        assert saved[key] is True and saved["aerie_head_config"][key] is True
    assert saved["transformer_layer_config"]["layer_types"] == ["sliding_attention"]
    again = load_head(tmp_path / "ours", llama_target)
    ids, features, positions = target_inputs(llama_target)
    with torch.no_grad():
        torch.testing.assert_close(again(ids, positions, features=features).logits,
                                   head.eval()(ids, positions, features=features).logits)
    with pytest.raises(ValueError, match="sliding_window=2048"):
        fit(head, llama_target, examples, config=TrainConfig(max_steps=1, max_length=2048), progress=False)


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_aerie_heads_read_as_speculators_files_are_the_same_head(llama_target, tmp_path, method):
    """Aerie's own speculators fields are complete: without aerie_head_config the file loads as the same head."""
    from aerie.heads import new_head

    head = new_head(llama_target, method, draft_vocab=build_draft_vocab(torch.arange(VOCAB), 128), seed=0)
    save_head(head, tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["aerie_head_config"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    again = load_head(tmp_path, llama_target)
    ids, features, positions = target_inputs(llama_target)
    with torch.no_grad():
        assert torch.equal(again(ids, positions, features=features).logits,
                           head.eval()(ids, positions, features=features).logits)
