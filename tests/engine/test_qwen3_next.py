"""Qwen3-Next targets (Gated DeltaNet linear attention + gated full attention + MoE, transformers'
own `Qwen3NextForCausalLM` on its torch fallback kernels): EAGLE speculation stays lossless because
every slot's recurrent states are rolled back to the states after exactly its kept tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_models import hf_greedy, random_model, random_prompts, trained_heads
from stats import chi_square_pvalue
from transformers import DynamicCache

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.engine.cache import HybridSlotCache
from aerie.engine.request import Status
from aerie.engine.sampling import adjusted_probs
from aerie.heads.io import load_head, save_head
from aerie.target import Target

LENGTHS = [5, 23, 9, 41, 3, 17, 30, 11]
NEW_TOKENS = 24
CONFIG = EngineConfig(max_slots=3, max_len=128, prefill_tokens=16)
PEAKED = 12.0


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """The random Qwen3-Next, its lm_head scaled so its next-token choices are peaked like a trained
    model's, and an EAGLE head trained on its own greedy replies, saved and loaded back."""
    model = random_model("qwen3_next", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(PEAKED)
    target = Target(model)
    head = trained_heads(target, ("eagle",), epochs=6)["eagle"]
    folder = tmp_path_factory.mktemp("qwen3-next-head")
    save_head(head, folder, speculative_tokens=3)
    return target, load_head(folder, target)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=8)


@pytest.fixture(scope="module")
def baseline(qwen3_next, prompts):
    target, _ = qwen3_next
    return [hf_greedy(target.model, p, NEW_TOKENS) for p in prompts]


def test_the_cache_holds_kv_for_full_attention_and_states_for_linear_attention(qwen3_next):
    target, head = qwen3_next
    engine = build_engine(target, CONFIG, "eagle", head, 3)
    cache = engine.cache
    assert isinstance(cache, HybridSlotCache) and sorted(cache.keys) == [1] and sorted(cache.recurrent) == [0, 2, 3]
    assert cache.recurrent[0].dtype == torch.float32 and cache.conv[0].dtype == target.dtype
    assert all(t.device == target.device for t in [*cache.conv.values(), *cache.recurrent.values()])
    # per slot and layer: conv (2 * 32 key + 64 value channels) x kernel 4, recurrent 4 heads x 16 x 16
    assert cache.state_nbytes_per_slot() == 3 * (128 * 4 * 4 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_hf_generate(qwen3_next, prompts, baseline, k):
    """Eight prompts of mixed lengths through three slots (requests join as others leave), chunked
    prefill, an EAGLE chain of K: the output is transformers' own greedy decoding."""
    target, head = qwen3_next
    engine = build_engine(target, CONFIG, "eagle", head, k)
    assert not engine.proposer.drafts_tree  # EAGLE drafts a chain on a linear-attention target
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == baseline
    per_request = {r.spec.accepted_tokens / max(r.spec.drafts, 1) for r in results}
    assert engine.spec.accepted_tokens > 0 and len(per_request) > 1, "slots should accept different counts"
    if k > 1:
        assert engine.spec.accepted_tokens < engine.spec.draft_tokens, "some drafts should be rejected"


def _hf_states(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' own (conv, recurrent) state of every linear-attention layer after `tokens`."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    linear = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    return [(cache.get_conv_state(i)[0], cache.get_recurrent_state(i)[0]) for i in linear]


def test_after_every_step_each_slot_holds_the_states_of_its_kept_tokens(qwen3_next, prompts):
    """Step by step, with rows rejecting different numbers of drafts: each slot's conv and recurrent
    states equal the ones transformers' own cache holds after the slot's committed tokens."""
    target, head = qwen3_next
    engine = build_engine(target, EngineConfig(max_slots=3, max_len=96, prefill_tokens=8), "eagle", head, 4)
    for prompt in prompts[:4]:
        engine.add_request(prompt, SamplingParams(max_tokens=14))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for slot, request in engine.scheduler.running.items():
            covered = request.length - 1 if request.status is Status.DECODING else request.prefilled
            if covered == 0:
                continue
            expected = _hf_states(target.model, request.all_ids[:covered])
            for layer, (conv, recurrent) in zip(sorted(engine.cache.conv), expected, strict=True):
                assert torch.allclose(engine.cache.conv[layer][slot], conv, atol=1e-6), (slot, layer, covered)
                assert torch.allclose(engine.cache.recurrent[layer][slot], recurrent, atol=1e-4), (slot, layer)
            checked += 1
    assert checked > 20 and 0 < engine.spec.accepted_tokens < engine.spec.draft_tokens


def test_states_and_replays_make_their_tensors_on_the_target_device(qwen3_next, prompts, baseline):
    """As `test_device_discipline`: with "meta" the default device, any tensor made without an
    explicit device (a state, a replay index) would be a meta tensor and fail next to real ones."""
    target, head = qwen3_next
    engine = build_engine(target, CONFIG, "eagle", head, 3)
    sampled = [SamplingParams(max_tokens=8, temperature=0.8, seed=i) for i in range(3)]
    with torch.device("meta"):
        greedy = engine.generate(prompts[:3], SamplingParams(max_tokens=NEW_TOKENS))
        engine.generate(prompts[:3], sampled)
    assert [r.token_ids for r in greedy] == baseline[:3]
    assert 0 < engine.spec.accepted_tokens < engine.spec.draft_tokens


def test_a_tree_is_refused_with_the_reason(qwen3_next):
    target, head = qwen3_next
    with pytest.raises(ValueError, match="linear-attention layers: their recurrent state"):
        build_engine(target, CONFIG, "eagle", head, 3, tree=True)


def test_first_two_speculated_tokens_are_distributed_as_target(qwen3_next):
    """Output tokens 2 and 3 come from speculative steps (token 1 from the prefill). Token 2's
    marginal over token 1, and token 3's over token 2 given the likeliest token 1, must be the
    target's own distributions (computed with transformers' own cache, not the engine's)."""
    target, head = qwen3_next
    samples, temperature = 1200, 0.8
    prompt = random_prompts([6], seed=21)[0]
    engine = build_engine(target, EngineConfig(max_slots=128, max_len=16), "eagle", head, 3)
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=s) for s in range(samples)]
    outputs = np.array([r.token_ids for r in engine.generate([prompt] * samples, params)])
    assert engine.spec.accepted_tokens > 0

    vocab = target.vocab_size
    t, top_p = torch.tensor([temperature]).expand(vocab), torch.tensor([1.0]).expand(vocab)

    def after(context: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """p(next | context) [V], and p(next | context + [x]) for every x [V, V]."""
        cache = DynamicCache(config=target.model.config)
        with torch.no_grad():
            logits = target.model(torch.tensor([context]), cache=cache, use_cache=True).logits[:, -1]
            cache.reorder_cache(torch.zeros(vocab, dtype=torch.long))
            following = target.model(torch.arange(vocab)[:, None], cache=cache, use_cache=True).logits[:, -1]
        return adjusted_probs(logits, t[:1], top_p[:1])[0].double(), adjusted_probs(following, t, top_p).double()

    p_first, p_next = after(prompt)
    p_second = (p_first[:, None] * p_next).sum(0)
    assert chi_square_pvalue(np.bincount(outputs[:, 1], minlength=vocab), p_second.numpy()) > 1e-3

    first = int(p_first.argmax())
    p_second_given, p_next = after(prompt + [first])
    p_third = (p_second_given[:, None] * p_next).sum(0)
    thirds = outputs[outputs[:, 0] == first, 2]
    assert len(thirds) > 200
    assert chi_square_pvalue(np.bincount(thirds, minlength=vocab), p_third.numpy()) > 1e-3
