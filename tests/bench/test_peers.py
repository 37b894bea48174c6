"""The Hugging Face peers: streamed, timed per chunk, and the target's greedy tokens."""

from __future__ import annotations

import pytest
from random_models import hf_greedy, random_model, random_prompts

from aerie.bench.peers import run_peer_cell
from aerie.target import Target


@pytest.fixture(scope="module")
def model():
    return random_model("llama", seed=7)


@pytest.mark.parametrize("method", ["hf_greedy", "hf_prompt_lookup"])
def test_peer_cells_stream_the_greedy_tokens(model, method):
    prompts = [p * 3 for p in random_prompts([4, 5, 6], seed=2)]  # repeats for prompt lookup to find
    run = run_peer_cell(Target(model), method, prompts, requests=3, warmup=1, max_tokens=12, lookup_tokens=4,
                        ignore_eos=False)
    assert [r.measured for r in run.records] == [False, True, True, True]
    for record in run.records:
        assert record.token_ids == hf_greedy(model, prompts[record.prompt], 12)
        assert sum(n for _, n in record.chunks) == 12
        assert record.submitted < record.chunks[0][0] <= record.finished
    if method == "hf_greedy":
        assert all(n == 1 for r in run.records for _, n in r.chunks)
    assert run.wall_seconds > 0 and run.counters is None
