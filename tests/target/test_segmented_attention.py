"""Attention over runs of rows, each reading its own longest context: the cheapest cut, and
outputs identical to one SDPA call over the padded batch."""

from __future__ import annotations

import itertools
import random

import torch
from random_models import random_model

from aerie.engine.cache import pool_runs
from aerie.target import Target
from aerie.target.segmented_attention import NAME, segmented_sdpa, segments


def cut_cost(kv_lens: list[int], runs: list[tuple[int, int, int]] | None, call_cost: int) -> int:
    runs = runs or [(0, len(kv_lens), max(kv_lens))]
    return sum(call_cost + (b - a) * max(kv_lens[a:b]) for a, b, _ in runs)


def brute_force(kv_lens: list[int], call_cost: int) -> int:
    n = len(kv_lens)
    best = cut_cost(kv_lens, None, call_cost)
    for k in range(1, n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = (0, *cuts, n)
            runs = [(a, b, max(kv_lens[a:b])) for a, b in itertools.pairwise(bounds)]
            best = min(best, cut_cost(kv_lens, runs, call_cost))
    return best


def test_the_cut_is_the_cheapest_and_every_run_reads_its_longest_row() -> None:
    rng = random.Random(0)
    for _ in range(200):
        kv_lens = [rng.choice([rng.randint(10, 60), rng.randint(200, 800)]) for _ in range(rng.randint(1, 7))]
        call_cost = rng.choice([0, 64, 256, 1024])
        runs = segments(kv_lens, call_cost)
        assert cut_cost(kv_lens, runs, call_cost) == brute_force(kv_lens, call_cost)
        if runs is not None:
            assert [a for a, _, _ in runs[1:]] == [b for _, b, _ in runs[:-1]] and runs[-1][1] == len(kv_lens)
            assert all(n == max(kv_lens[a:b]) for a, b, n in runs)


def test_one_run_when_cutting_does_not_pay() -> None:
    assert segments([700, 20, 30], call_cost=10_000) is None
    assert segments([100, 100, 100], call_cost=0) is None
    assert segments([700, 20, 30], call_cost=20) == [(0, 1, 700), (1, 3, 30)]


def test_runs_give_the_padded_batch_attention_exactly() -> None:
    torch.manual_seed(0)
    model = random_model("llama")
    target = Target(model)
    assert model.config._attn_implementation == NAME
    module = model.model.layers[0].self_attn
    kv_lens = [37, 5, 12, 40, 3]
    rows, heads, kv_heads, dim = len(kv_lens), 4, 2, 16
    query = torch.randn(rows, heads, 1, dim)
    key, value = torch.randn(rows, kv_heads, max(kv_lens), dim), torch.randn(rows, kv_heads, max(kv_lens), dim)
    mask = torch.arange(max(kv_lens))[None, None, None, :] < torch.tensor(kv_lens)[:, None, None, None]
    whole, _ = segmented_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
    runs = segments(kv_lens, call_cost=0)
    assert runs is not None and len(runs) > 1
    cut, _ = segmented_sdpa(
        module, query, key, value, mask, aerie_segments=[(a, b, n, a) for a, b, n in runs], scaling=dim**-0.5
    )
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-6)
    assert target.segmented_attention
    # The same rows spread over a pool of 9 slots (1, 2, 5, 6, 7): each run reads its own slots.
    slots = [1, 2, 5, 6, 7]
    pool_key, pool_value = torch.randn(9, *key.shape[1:]), torch.randn(9, *value.shape[1:])
    pool_key[slots], pool_value[slots] = key, value
    pooled = pool_runs(slots, [(0, rows, max(kv_lens))])
    assert pooled == [(0, 2, 40, 1), (2, 5, 40, 5)]
    spread, _ = segmented_sdpa(module, query, pool_key, pool_value, mask, aerie_segments=pooled, scaling=dim**-0.5)
    torch.testing.assert_close(spread, whole, rtol=1e-5, atol=1e-6)


def test_other_attention_implementations_are_left_alone() -> None:
    model = random_model("llama")
    model.set_attn_implementation("eager")
    assert not Target(model).segmented_attention
