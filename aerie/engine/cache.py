"""The slot KV cache: one fixed pool of sequence slots shared by every request.

Each layer holds keys and values as `[slots, kv_heads, capacity + 1, head_dim]`. The extra last
column is a scratch column: padded query positions write there and no mask ever shows it, so
rows of different lengths can share one forward. Memory is fixed at construction:
slots x (capacity + 1) x layers, whatever the traffic.

The object is handed to the unmodified `transformers` model as its `cache`; the model calls
`update()` once per layer with the new keys and values. Before each forward the engine `bind()`s
which slots the batch rows are and where each new token is written.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (slots, kv_heads, capacity + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = torch.device(device)
        self.slots = slots
        self.capacity = capacity
        self.scratch = capacity
        self._rows: torch.Tensor | slice = slice(0, 0)
        self._row_index = torch.zeros(0, 1, dtype=torch.long, device=device)
        self._write_pos = torch.zeros(0, 1, dtype=torch.long, device=device)
        self._kv_len = 0

    @classmethod
    def for_config(
        cls, config, slots: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> SlotKVCache:
        """Size the pool from a `transformers` text config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, slots, kv_heads, head_dim, capacity, dtype, device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def slot_index(self, slot_ids: list[int]) -> torch.Tensor:
        """[B, 1] slot ids on the cache's device (what `bind` and `keep_columns` index with)."""
        return torch.tensor(slot_ids, dtype=torch.long, device=self.device)[:, None]

    def bind(
        self, slot_ids: list[int], write_pos: torch.Tensor, kv_len: int, slot_index: torch.Tensor | None = None
    ) -> None:
        """Route the next forward: batch row b is slot `slot_ids[b]`; its new token i is written at
        column `write_pos[b, i]` (the scratch column for padding); attention reads `kv_len` columns.
        `slot_index` is `slot_index(slot_ids)` when the caller already has it."""
        first = slot_ids[0]
        contiguous = slot_ids == list(range(first, first + len(slot_ids)))
        self._row_index = self.slot_index(slot_ids) if slot_index is None else slot_index
        self._rows = slice(first, first + len(slot_ids)) if contiguous else self._row_index[:, 0]
        self._write_pos = write_pos
        self._kv_len = kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_: object):
        """Write the new keys/values ([B, kv_heads, q, head_dim]) and return the batch's view of
        the first `kv_len` columns, as `transformers` attention expects."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self._row_index, :, self._write_pos] = key_states.transpose(1, 2)
        values[self._row_index, :, self._write_pos] = value_states.transpose(1, 2)
        return keys[self._rows, :, : self._kv_len], values[self._rows, :, : self._kv_len]

    def keep_columns(self, slot_ids: list[int], starts: list[int], kept: torch.Tensor) -> None:
        """After tree verification: in each slot b, move block column `kept[b, j]` (relative to
        `starts[b]`) to column j, for every layer with one gather. Columns past a row's path get
        whatever `kept` points to: they are uncommitted and the next step overwrites them."""
        rows = self.slot_index(slot_ids)
        base = torch.tensor(starts, dtype=torch.long, device=self.device)[:, None]
        src = base + kept
        dst = base + torch.arange(kept.shape[1], device=self.device)
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[rows, :, dst] = keys[rows, :, src]
            values[rows, :, dst] = values[rows, :, src]
