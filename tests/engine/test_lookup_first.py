"""Prompt lookup first, the head elsewhere (`--lookup`): lossless, and each row drafts by the one
its context calls for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_models import hf_greedy, random_prompts
from stats import chi_square_pvalue

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine, check_method
from aerie.engine.hybrid import LOOKUP_TOKENS
from aerie.engine.sampling import adjusted_probs

CONFIG = EngineConfig(max_slots=3, max_len=160, prefill_tokens=16)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def repeating_prompts():
    """Prompts that end by repeating their start, so a lookup matches from the first draft on."""
    return [p + p[:6] for p in random_prompts([5, 23, 9, 41, 17, 30], seed=8)]


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
@pytest.mark.parametrize("k", ["auto", 3])
def test_greedy_lookup_first_equals_baseline_and_uses_both(llama_with_heads, repeating_prompts, method, k):
    target, heads = llama_with_heads
    engine = build_engine(target, CONFIG, method, heads[method], k, lookup=True)
    rows, by_head, widths = [], [], []
    lookup_rows, head_propose = engine.proposer.propose, engine.proposer.drafter.propose

    def counting_propose(batch, k):
        rows.append(len(batch))
        draft = lookup_rows(batch, k)
        widths.append((draft.tokens.shape[1], k))
        return draft

    def counting_head(batch, k):
        by_head.append(len(batch))
        return head_propose(batch, k)

    engine.proposer.propose, engine.proposer.drafter.propose = counting_propose, counting_head
    results = engine.generate(repeating_prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == [hf_greedy(target.model, p, NEW_TOKENS) for p in repeating_prompts]
    if k != "auto":  # (adaptive K may find drafting too dear on this random model and draft nothing)
        assert engine.spec.accepted_tokens > 0
        assert 0 < sum(by_head) < sum(rows), (sum(by_head), sum(rows))  # some rows by lookup, some by the head
        assert max(width for width, _ in widths) == LOOKUP_TOKENS  # a matched continuation drafts past K
    else:
        assert all(width <= k for width, k in widths)  # the policy prices K columns


def test_sampled_lookup_first_is_distributed_as_target(llama_with_heads):
    """The first speculative step of rows that sampled different first tokens: the prompt ends on
    (a, b) after (a, b, t) for the target's 12 likeliest first tokens t, so rows that sampled
    one of them draft by lookup and the others by the head, in one verify; the second token's
    marginal must still be the target's."""
    target, heads = llama_with_heads
    samples, temperature, matches = 2500, 0.5, 12
    vocab, t, top_p = target.vocab_size, torch.tensor([temperature]), torch.tensor([1.0])

    def first_probs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return adjusted_probs(target.model(torch.tensor([prompt])).logits[0, -1:], t, top_p)[0]

    a, b = random_prompts([2], seed=21)[0]
    likeliest = list(range(1, matches + 1))
    for _ in range(3):  # the likeliest first tokens of the prompt they are part of
        prompt = [token for x in likeliest for token in (a, b, x)] + [a, b]
        p_first = first_probs(prompt)
        likeliest = p_first.topk(matches).indices.tolist()
    matched = {prompt[i + 2] for i in range(0, len(prompt) - 2, 3)}
    assert 0.05 < float(p_first[list(matched)].sum()) < 0.95, "the test needs rows on both paths"

    engine = build_engine(target, EngineConfig(max_slots=64, max_len=48), "eagle3", heads["eagle3"], 3, lookup=True)
    params = [SamplingParams(max_tokens=2, temperature=temperature, seed=s) for s in range(samples)]
    seconds = np.array([r.token_ids[1] for r in engine.generate([prompt] * samples, params)])
    with torch.no_grad():
        second_logits = target.model(torch.tensor([prompt + [tok] for tok in range(vocab)])).logits[:, -1]
        p_second = (p_first[:, None] * adjusted_probs(second_logits, t.expand(vocab), top_p.expand(vocab))).sum(0)
    assert chi_square_pvalue(np.bincount(seconds, minlength=vocab), p_second.double().numpy()) > 1e-3


@pytest.mark.parametrize(("method", "tree"), [("ngram", None), ("none", None), ("eagle3", True)])
def test_lookup_first_goes_before_a_heads_chain_only(method, tree):
    with pytest.raises(ValueError, match="--lookup"):
        check_method(method, object(), tree, lookup=True)
