"""4-D attention masks for a batch of slots that each append a block of new tokens.

Row b has `prefix_len[b]` committed tokens in the cache (columns 0..prefix_len-1) and a block of w
columns after them, of which the q queries are the newest. Inside the block, `block_mask[b, i, m]`
says whether query i sees block column m: lower-triangular for prompts and draft chains, the
ancestor relation for draft trees (w > q when a head expands a tree one depth at a time on top of
the columns it wrote for earlier depths). Every query sees the whole committed prefix. Every mask
is made on the device of its inputs.
"""

from __future__ import annotations

import torch


def causal_block(q: int, valid: torch.Tensor) -> torch.Tensor:
    """[B, q, q] causal block mask on `valid`'s device; columns of padded tokens (valid [B, q]
    False) are hidden."""
    tri = torch.ones(q, q, dtype=torch.bool, device=valid.device).tril_()
    return tri[None] & valid[:, None, :]


def build_attention_mask(
    prefix_len: torch.Tensor,
    block_mask: torch.Tensor,
    kv_len: int,
    query_pos: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean [B, 1, q, kv_len] mask (True = attend).

    `query_pos` [B, q] are the RoPE positions of the new tokens (equal to their columns for chains,
    prefix_len + depth for tree nodes); with a square block they are also the key positions of the
    block columns, which the sliding window needs.
    """
    batch, q, width = block_mask.shape
    device = block_mask.device
    columns = torch.arange(kv_len + width, device=device)
    mask = (columns[None, None, :] < prefix_len[:, None, None]).expand(batch, q, kv_len + width).clone()
    block_columns = prefix_len[:, None] + torch.arange(width, device=device)
    mask.scatter_(2, block_columns[:, None, :].expand(batch, q, width), block_mask)
    if sliding_window is not None:
        if width != q:
            raise ValueError("a sliding window needs the block's columns to be its queries")
        key_pos = columns.expand(batch, kv_len + width).clone()
        key_pos.scatter_(1, block_columns, query_pos)
        mask &= (query_pos[:, :, None] - key_pos[:, None, :]) < sliding_window
    mask = mask[:, :, :kv_len]
    # A padded query that sees nothing would give NaNs in softmax; let it see column 0.
    mask[:, :, 0] |= ~mask.any(dim=-1)
    return mask[:, None]


def to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eager attention adds its mask to the scores: 0 where visible, the dtype's min elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )
