"""The reduced draft vocabulary of EAGLE-3 / P-EAGLE heads.

The draft vocabulary is the `draft_vocab_size` target tokens seen most often in the training
replies, kept in ascending target-id order. Two buffers describe it, as EAGLE-3, SpecForge,
speculators and vLLM store them:

- `d2t` [draft_vocab] long: `target_id = draft_id + d2t[draft_id]` (an offset, not the id).
- `t2d` [target_vocab] bool: True where the target token is in the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def token_counts(
    sequences: Iterable[Sequence[int]],
    loss_masks: Iterable[Sequence[bool]] | None,
    vocab_size: int,
) -> torch.Tensor:
    """How often each target token occurs at loss-masked (reply) positions: long [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long, device="cpu")
    sequences = list(sequences)
    masks = list(loss_masks) if loss_masks is not None else [None] * len(sequences)
    for ids, mask in zip(sequences, masks, strict=True):
        ids_t = torch.as_tensor(list(ids), dtype=torch.long, device="cpu")
        if mask is not None:
            ids_t = ids_t[torch.as_tensor(list(mask), dtype=torch.bool, device="cpu")]
        if ids_t.numel():
            counts += torch.bincount(ids_t, minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int, always_include: Iterable[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent tokens (ties broken by lower id).

    `always_include` (e.g. the stop tokens) is kept whatever its count, so the draft can end a
    reply. With `draft_vocab_size >= len(counts)` the draft vocabulary is the whole target one.
    """
    vocab_size = counts.numel()
    draft_vocab_size = min(draft_vocab_size, vocab_size)
    score = counts.double().clone()
    forced = sorted({int(t) for t in always_include if 0 <= int(t) < vocab_size})
    if forced:
        score[forced] = float("inf")
    # stable sort on (-score, id): most frequent first, lower id first among equals
    order = torch.sort(-score, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")
    t2d[chosen] = True
    d2t = chosen - torch.arange(draft_vocab_size, device="cpu")
    return d2t, t2d


def target_to_draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """long [target_vocab]: the draft id of each target token, -1 where it is not in the draft vocab."""
    index = torch.cumsum(t2d.long(), dim=0) - 1
    return torch.where(t2d, index, torch.full_like(index, -1))
