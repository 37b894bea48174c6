"""Laying out a batch of per-slot blocks for one forward through a slot cache.

Row b has `prefix[b]` committed cache columns and appends `lengths[b]` new tokens at the next
columns. Rows are right-padded to the widest block; padding writes to the cache's scratch column
and nobody attends to it. The same layout serves the target (position = column) and the draft
heads (position = column + 1: a head's first input is the target's second token).

Everything is built from host integers the engine already holds, so laying out a batch never
reads a value back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aerie.engine.masks import build_attention_mask, causal_block


@dataclass
class BlockLayout:
    valid: torch.Tensor
    """[B, q] True for real tokens."""
    positions: torch.Tensor
    """[B, q] RoPE positions."""
    write_pos: torch.Tensor
    """[B, q] cache column each token is written to (the scratch column for padding)."""
    prefix: torch.Tensor
    """[B] committed columns before the block."""
    block: torch.Tensor
    """[B, q, q] which new tokens each new token sees."""
    kv_len: int
    """Columns the attention reads."""

    @classmethod
    def build(
        cls,
        prefix: Sequence[int],
        lengths: Sequence[int],
        scratch: int,
        device: torch.device,
        position_offset: int = 0,
        depths: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
    ) -> BlockLayout:
        """`depths` [B, q] replace the column offsets in the positions (tree nodes share a
        position per depth); `block` replaces the causal block (a tree's ancestor relation)."""
        width = max(lengths)
        prefix_t = torch.tensor(prefix, device=device)
        lengths_t = torch.tensor(lengths, device=device)
        offsets = torch.arange(width, device=device)
        valid = offsets[None, :] < lengths_t[:, None]
        columns = prefix_t[:, None] + offsets
        positions = prefix_t[:, None] + (offsets if depths is None else depths) + position_offset
        block = causal_block(width, valid) if block is None else block & valid[:, None, :]
        return cls(
            valid=valid,
            positions=positions,
            write_pos=torch.where(valid, columns, scratch),
            prefix=prefix_t,
            block=block,
            kv_len=max(p + n for p, n in zip(prefix, lengths, strict=True)),
        )

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        return build_attention_mask(self.prefix, self.block, self.kv_len, self.positions, sliding_window)


def pad_rows(rows: Sequence[Sequence[int]], width: int, device: torch.device, fill: int = 0) -> torch.Tensor:
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
