"""Sampled decoding: reproducible per seed, and distributed as the target's adjusted softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_models import random_model, random_prompts
from stats import chi_square_pvalue

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.engine.sampling import adjusted_probs
from aerie.target import Target

SAMPLES = 3000


@pytest.fixture(scope="module")
def target():
    return Target(random_model("llama", seed=3))


def test_seeded_sampling_is_reproducible_whatever_the_batch(target):
    prompts = random_prompts([7, 12, 4, 20])
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(4)]
    alone = [
        Engine(target, EngineConfig(max_slots=1, max_len=64)).generate([p], [sp])[0]
        for p, sp in zip(prompts, params, strict=True)
    ]
    together = Engine(target, EngineConfig(max_slots=4, max_len=64)).generate(prompts, params)
    again = Engine(target, EngineConfig(max_slots=2, max_len=64)).generate(prompts, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone] == [r.token_ids for r in again]
    other_seed = Engine(target, EngineConfig(max_slots=4, max_len=64)).generate(
        prompts, [SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i) for i in range(4)]
    )
    assert [r.token_ids for r in other_seed] != [r.token_ids for r in together]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_first_and_second_token_distributions_match_target(target, temperature, top_p):
    """First token (prefill path) and second token (decode path, marginalised over the first)."""
    prompt = random_prompts([6], seed=11)[0]
    engine = Engine(target, EngineConfig(max_slots=64, max_len=16))
    params = [SamplingParams(max_tokens=2, temperature=temperature, top_p=top_p, seed=s) for s in range(SAMPLES)]
    results = engine.generate([prompt] * SAMPLES, params)
    firsts = np.array([r.token_ids[0] for r in results])
    seconds = np.array([r.token_ids[1] for r in results])

    vocab = target.vocab_size
    t, p = torch.tensor([temperature]), torch.tensor([top_p])
    with torch.no_grad():
        first_logits = target.model(torch.tensor([prompt])).logits[0, -1]
        p_first = adjusted_probs(first_logits[None], t, p)[0]
        continuations = torch.tensor([prompt + [tok] for tok in range(vocab)])
        second_logits = target.model(continuations).logits[:, -1]
        p_second = (p_first[:, None] * adjusted_probs(second_logits, t.expand(vocab), p.expand(vocab))).sum(0)

    assert chi_square_pvalue(np.bincount(firsts, minlength=vocab), p_first.double().numpy()) > 1e-3
    assert chi_square_pvalue(np.bincount(seconds, minlength=vocab), p_second.double().numpy()) > 1e-3
    if top_p < 1:
        assert p_first[firsts].min() > 0, "sampled a token outside the top-p nucleus"


def test_adjusted_probs_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = adjusted_probs(logits, torch.tensor([1.0]), torch.tensor([0.8]))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    greedy = adjusted_probs(logits, torch.tensor([0.0]), torch.tensor([1.0]))
    torch.testing.assert_close(greedy, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
