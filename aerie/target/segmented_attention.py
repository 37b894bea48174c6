"""SDPA over row segments, each reading only as many cache columns as its longest row.

A batched forward through the slot cache reads `kv_len` = the longest row's context for EVERY row:
with one 700-token conversation among 32 rows of ~150 tokens, attention reads 4-5x the columns it
needs, and on a CPU (or a GPU at long contexts) reading the KV cache is most of a decoding step.
`segments` cuts the batch (rows in their batch order, so every segment stays a view of the cache)
into runs that each read their own longest context, where the columns saved pay for another
attention call; `segmented_sdpa` is transformers' SDPA attention run once per run. The slot cache
also cuts a run where the batch's slots are not adjacent (`Run`): gathering a batch's rows out of
the pool copies every key and value column they read, in every layer (2.3x a 29-row decoding step
of 32 slots on a CPU), where a view per run of adjacent slots copies nothing.

The target's model is switched to this implementation (`NAME`) when it uses SDPA; without
segments (one run, or a caller that passes none) it is exactly transformers' SDPA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "aerie_segmented_sdpa"
SEGMENTS = "aerie_segments"
"""The forward keyword that carries the runs: [(first row, end row, columns read)]."""

CALL_COST_COLUMNS = {"cpu": 256, "cuda": 8192}
"""What one more attention call costs, in row x column reads: on a CPU a call's overhead is worth
~256 cache columns of one row; on a GPU a launch is worth thousands."""

Segment = tuple[int, int, int]
"""A run of batch rows [first, end) and the cache columns it reads."""

Run = tuple[int, int, int, int]
"""What attention is handed: rows [a, b) of the batch read the first n columns of key rows
[s, s + b - a) (the batch's own rows, or the slot cache's whole pool where the batch's slots are
not adjacent: each run then reads its own slots as a view instead of the cache gathering them)."""


def segments(kv_lens: Sequence[int], call_cost: int) -> list[Segment] | None:
    """The cheapest cut of rows into contiguous runs (cost: rows x longest context + `call_cost`
    a run), or None when one run is cheapest. Exact, by dynamic programming over the cut points."""
    longest, rows = max(kv_lens), len(kv_lens)
    if rows < 2 or longest * rows - sum(kv_lens) <= call_cost:
        return None
    cost = [0.0] + [float("inf")] * rows
    cut = [0] * (rows + 1)
    for end in range(1, rows + 1):
        widest = 0
        for start in range(end - 1, -1, -1):
            widest = max(widest, kv_lens[start])
            candidate = cost[start] + call_cost + (end - start) * widest
            if candidate < cost[end]:
                cost[end], cut[end] = candidate, start
    runs: list[Segment] = []
    end = rows
    while end:
        start = cut[end]
        runs.append((start, end, max(kv_lens[start:end])))
        end = start
    return runs[::-1] if len(runs) > 1 else None


def segments_on(device: torch.device, kv_lens: Sequence[int]) -> list[Segment] | None:
    """`segments` at the call cost of `device`'s kind (CUDA's for other accelerators)."""
    return segments(kv_lens, CALL_COST_COLUMNS.get(device.type, CALL_COST_COLUMNS["cuda"]))


def segmented_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aerie_segments: list[Run] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if aerie_segments is None or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = [
        sdpa_attention_forward(
            module, query[a:b], key[s : s + b - a, :, :n], value[s : s + b - a, :, :n],
            attention_mask[a:b, :, :, :n], **kwargs,
        )[0]
        for a, b, n, s in aerie_segments
    ]
    return torch.cat(outputs, dim=0), None


AttentionInterface.register(NAME, segmented_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # `generate` builds the masks it builds for SDPA
