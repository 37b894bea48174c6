"""A Hugging Face causal LM wrapped for speculative decoding.

The model itself is unmodified `transformers` code. `Target.forward` drives it through its
`cache`, `position_ids` and 4-D `attention_mask` arguments and returns, from the same forward
that produces logits, the hidden states a draft head needs:

- EAGLE-3 / P-EAGLE: the residual stream leaving decoder layers {1, L/2-1, L-4} (the states
  entering layers {2, L/2, L-3}, as vLLM and SpecForge tap them), concatenated to 3H.
- EAGLE / EAGLE-2: the last hidden state (after the final norm, what `lm_head` reads).

Hybrid targets (Qwen3-Next) interleave linear-attention layers, whose token mixer keeps a recurrent
state per sequence instead of a KV cache. `Target.recurrent_mixers` names those mixers; a forward
pre-hook hands each mixer's input to the cache of the forward (when the cache records them), so a
slot cache can roll a state back by replaying the mixer on the accepted tokens alone
(`aerie.engine.cache.HybridSlotCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from aerie.target import segmented_attention

FeatureKind = Literal["eagle3", "last"]
RECURRENT_LAYER_TYPE = "linear_attention"


def eagle3_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """Indices of the decoder layers whose outputs EAGLE-3 fuses (low, mid, high)."""
    return tuple(max(0, i) for i in (1, num_layers // 2 - 1, num_layers - 4))  # type: ignore[return-value]


def recurrent_mixers(layers: nn.ModuleList, layer_types: list[str] | None) -> dict[int, nn.Module]:
    """The linear-attention token mixers of a hybrid model (Qwen3-Next's Gated DeltaNet, the
    `linear_attn` of each `linear_attention` layer), by layer index; empty for attention-only models."""
    mixers = {}
    for index, kind in enumerate(layer_types or []):
        if kind != RECURRENT_LAYER_TYPE:
            continue
        mixer = getattr(layers[index], "linear_attn", None)
        if mixer is None:
            raise ValueError(
                f"layer {index} is {kind} but has no `linear_attn` module: this hybrid architecture is not supported"
            )
        mixers[index] = mixer
    return mixers


def _hand_input_to_cache(index: int):
    """A forward pre-hook for mixer `index`: give its input hidden states to the forward's cache
    when that cache records mixer inputs (`record_mixer_input`)."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        record = getattr(kwargs.get("cache"), "record_mixer_input", None)
        if record is not None:
            record(index, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    return hook


@dataclass
class TargetOutput:
    """Logits at the selected positions, and the requested features at every position."""

    logits: torch.Tensor
    features: torch.Tensor | None


class Target:
    """A frozen causal LM plus its tokenizer, with hooks that capture the tapped layers."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config()
        self.decoder: nn.Module = model.get_decoder()
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.embed_tokens: nn.Module = model.get_input_embeddings()
        self.num_layers: int = self.config.num_hidden_layers
        self.hidden_size: int = self.config.hidden_size
        self.vocab_size: int = self.lm_head.weight.shape[0]
        self.tap_layers = eagle3_tap_layers(self.num_layers)
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(segmented_attention.NAME)
        self.segmented_attention = model.config._attn_implementation == segmented_attention.NAME
        """Attention reads each run of rows' own longest context (`segmented_attention`)."""
        self.uses_eager_mask = model.config._attn_implementation == "eager"
        self.sliding_window: int | None = getattr(self.config, "sliding_window", None)
        self.layer_types: list[str] | None = getattr(self.config, "layer_types", None)
        self._captured: dict[int, torch.Tensor] | None = None
        layers = self.decoder.layers
        for index in sorted(set(self.tap_layers)):
            layers[index].register_forward_hook(self._make_hook(index))
        self.recurrent_mixers = recurrent_mixers(layers, self.layer_types)
        for index, mixer in self.recurrent_mixers.items():
            mixer.register_forward_pre_hook(_hand_input_to_cache(index), with_kwargs=True)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def stop_token_ids(self) -> list[int]:
        """End-of-sequence ids from the generation config and the tokenizer."""
        ids: set[int] = set()
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def _make_hook(self, index: int):
        def hook(_module: nn.Module, _args: tuple, output: torch.Tensor | tuple) -> None:
            if self._captured is not None:
                self._captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        cache: object | None = None,
        logits_at: torch.Tensor | None = None,
        features: FeatureKind | None = None,
        segments: list[segmented_attention.Run] | None = None,
    ) -> TargetOutput:
        """One forward over `input_ids` [B, q] (no grad: the target is frozen; features may feed a
        head being trained, which inference-mode tensors could not).

        `logits_at` is a boolean [B, q] mask or None (all positions); logits come back flattened
        to [N, V] in row-major order when it is given, else as [B, q, V]. `features` asks for the
        EAGLE-3 fused taps ([B, q, 3H]) or the last hidden state ([B, q, H]). `segments` are runs
        of rows whose attention reads only their own columns of their own key rows (with
        `segmented_attention`; the slot cache's `segments` after its `bind`).
        """
        extra = {segmented_attention.SEGMENTS: segments} if segments and self.segmented_attention else {}
        self._captured = {} if features == "eagle3" else None
        try:
            hidden = self.decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                cache=cache,
                use_cache=cache is not None,
                **extra,
            ).last_hidden_state
            if features == "eagle3":
                feats = torch.cat([self._captured[i] for i in self.tap_layers], dim=-1)
            elif features == "last":
                feats = hidden
            else:
                feats = None
        finally:
            self._captured = None
        selected = hidden if logits_at is None else hidden[logits_at]
        return TargetOutput(logits=self.lm_head(selected).float(), features=feats)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (fast enough and exact), bf16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_model_dir(path: str | Path) -> Path:
    """A local directory for `path`; `s3://` prefixes are downloaded to a local cache first."""
    from aerie.storage import download

    local = download(path)
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in target directory {local}")
    return local


def load_target(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> Target:
    """Load a Hugging Face causal LM directory (local or `s3://`) and its tokenizer."""
    local = resolve_model_dir(path)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    # transformers picks SDPA where the architecture supports it, else eager (GPT-OSS's sinks).
    model = AutoModelForCausalLM.from_pretrained(
        local, dtype=dtype, trust_remote_code=trust_remote_code
    ).to(device)
    tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)
    return Target(model, tokenizer)
