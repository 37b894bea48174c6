"""The engine's greedy output equals transformers' own greedy decoding, token for token."""

from __future__ import annotations

import pytest
from random_models import ARCHITECTURES, hf_greedy, random_model, random_prompts

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.target import Target
from aerie.target.segmented_attention import CALL_COST_COLUMNS

LENGTHS = [5, 23, 9, 41, 3, 17]
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_model(request):
    model = random_model(request.param)
    prompts = random_prompts(LENGTHS)
    return model, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_batched_chunked_greedy_matches_hf(arch_model):
    """Fewer slots than prompts (requests join as others leave) and chunked prefill."""
    model, prompts, expected = arch_model
    engine = Engine(Target(model), EngineConfig(max_slots=3, max_len=128, prefill_tokens=8))
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)


def test_attention_cut_into_runs_of_rows_matches_hf(arch_model, monkeypatch):
    """Every forward's attention cut into runs that read only their longest row's columns (free
    calls: the most runs), prefill and decode."""
    model, prompts, expected = arch_model
    monkeypatch.setitem(CALL_COST_COLUMNS, "cpu", 0)
    engine = Engine(Target(model), EngineConfig(max_slots=6, max_len=128, prefill_tokens=64))
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == expected


def test_requests_joining_mid_flight_match_hf(arch_model):
    """Requests added while others are decoding, with different max_tokens, leave at different steps."""
    model, prompts, expected = arch_model
    engine = Engine(Target(model), EngineConfig(max_slots=4, max_len=128, prefill_tokens=16))
    budgets = [NEW_TOKENS - 2 * (i % 3) for i in range(len(prompts))]
    produced: dict[str, list[int]] = {}
    order = []
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        order.append(engine.add_request(prompt, SamplingParams(max_tokens=budget)))
        for _ in range(i + 1):
            for out in engine.step():
                produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    for request_id, want, budget in zip(order, expected, budgets, strict=True):
        assert produced[request_id] == want[:budget]
