"""The slot caches: one fixed pool of sequence slots shared by every request.

`SlotKVCache`: each attention layer holds keys and values as `[slots, kv_heads, capacity + 1,
head_dim]`. The extra last column is a scratch column: padded query positions write there and no
mask ever shows it, so rows of different lengths can share one forward. Rejected draft columns are
simply overwritten by the next step. Memory is fixed at construction: slots x (capacity + 1) x layers,
whatever the traffic.

`HybridSlotCache`: for targets that interleave linear-attention layers (Qwen3-Next's Gated
DeltaNet), which keep per sequence a convolution state (the last `kernel` mixer inputs) and a
recurrent state instead of KV columns. Those states cannot be overwritten later: after a forward
over K + 1 tokens of which a row keeps k, the row's states must be the states after exactly its k
kept tokens. The forward's own final states are staged, not committed; `commit_states` then takes
them for the rows that kept their whole block and, for the others, replays each linear-attention
mixer (transformers' own module, on the hidden states it received in the forward, captured by the
target's pre-hook) over the kept tokens alone, from the committed states. Only the mixers run
again, never attention, MoE or the LM head, and only for rows that rejected a draft (or were padded
in a prefill batch). Why not per-position snapshots as vLLM keeps them: transformers' kernels return
only a block's final state, so snapshots would mean a second implementation of the Gated DeltaNet
recurrence; the replay is the model's code, exact by construction, and costs no extra state memory.

Both are handed to the unmodified `transformers` model as its `cache`: attention layers call
`update()` with their new keys and values, linear-attention layers call the state methods
(`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`). Before
each forward the engine `bind()`s which slots the batch rows are and where each new token is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aerie.target.model import RECURRENT_LAYER_TYPE, Target
from aerie.target.segmented_attention import Run, Segment


class SlotKVCache:
    has_states = False
    """True for caches holding per-slot recurrent states (the engine then commits them after each
    forward, `HybridSlotCache.commit_states`)."""

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        layers: Sequence[int] | None = None,
    ) -> None:
        """`layers`: the attention layers that get KV columns (default: all `num_layers`)."""
        shape = (slots, kv_heads, capacity + 1, head_dim)
        indices = range(num_layers) if layers is None else layers
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in indices}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in indices}
        self.device = torch.device(device)
        self.slots = slots
        self.capacity = capacity
        self.scratch = capacity
        self._rows: torch.Tensor | slice = slice(0, 0)
        self._row_index = torch.zeros(0, 1, dtype=torch.long, device=device)
        self._write_pos = torch.zeros(0, 1, dtype=torch.long, device=device)
        self._kv_len = 0
        self.segments: list[Run] | None = None
        """Runs of batch rows, each reading its own columns of its own key rows (set by `bind`)."""

    @classmethod
    def for_config(
        cls, config, slots: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> SlotKVCache:
        """Size the pool from a `transformers` text config."""
        kv_heads, head_dim = attention_shape(config)
        return cls(config.num_hidden_layers, slots, kv_heads, head_dim, capacity, dtype, device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys.values(), *self.values.values()])

    def slot_index(self, slot_ids: list[int]) -> torch.Tensor:
        """[B, 1] slot ids on the cache's device (what `bind` and `keep_columns` index with)."""
        return torch.tensor(slot_ids, dtype=torch.long, device=self.device)[:, None]

    def reset(self, slot: int) -> None:
        """A new sequence starts in `slot`: KV columns need no clearing (they are written before
        any mask shows them)."""

    def bind(
        self,
        slot_ids: list[int],
        write_pos: torch.Tensor,
        kv_len: int,
        slot_index: torch.Tensor | None = None,
        segments: list[Segment] | None = None,
        by_runs: bool = False,
    ) -> None:
        """Route the next forward: batch row b is slot `slot_ids[b]`; its new token i is written at
        column `write_pos[b, i]` (the scratch column for padding); attention reads `kv_len` columns
        (or each run of `segments` its own). `slot_index` is `slot_index(slot_ids)` when the caller
        already has it. `by_runs`: the caller's attention reads `self.segments`, so where the slots
        are not adjacent `update` returns the whole pool's columns and each run reads its own slots
        (no gather); otherwise it returns the batch's rows, gathered if need be."""
        first = slot_ids[0]
        contiguous = slot_ids == list(range(first, first + len(slot_ids)))
        pooled = by_runs and not contiguous
        self._row_index = self.slot_index(slot_ids) if slot_index is None else slot_index
        if contiguous:
            self._rows = slice(first, first + len(slot_ids))
        else:
            self._rows = slice(None) if pooled else self._row_index[:, 0]
        if pooled:
            self.segments = pool_runs(slot_ids, segments or [(0, len(slot_ids), kv_len)])
        else:
            self.segments = [(a, b, n, a) for a, b, n in segments] if segments else None
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
        for keys, values in zip(self.keys.values(), self.values.values(), strict=True):
            keys[rows, :, dst] = keys[rows, :, src]
            values[rows, :, dst] = values[rows, :, src]


def pool_runs(slot_ids: list[int], segments: list[Segment]) -> list[Run]:
    """`segments` cut again wherever the next row's slot is not the one after: each run then reads
    its key rows straight from the pool, starting at its first row's slot."""
    runs: list[Run] = []
    for a, b, n in segments:
        start = a
        for row in range(a + 1, b + 1):
            if row == b or slot_ids[row] != slot_ids[row - 1] + 1:
                runs.append((start, row, n, slot_ids[start]))
                start = row
    return runs


def attention_shape(config) -> tuple[int, int]:
    """(kv_heads, head_dim) of a `transformers` text config's attention layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return kv_heads, head_dim


def _linear_attention_shapes(config) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per-slot (conv state, recurrent state) shapes of a Gated DeltaNet layer, from the config."""
    names = ("linear_key_head_dim", "linear_num_key_heads", "linear_value_head_dim", "linear_num_value_heads",
             "linear_conv_kernel_dim")
    missing = [name for name in names if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"linear-attention layers without {', '.join(missing)} in the config are not supported")
    key_dim = config.linear_key_head_dim * config.linear_num_key_heads
    value_dim = config.linear_value_head_dim * config.linear_num_value_heads
    conv = (2 * key_dim + value_dim, config.linear_conv_kernel_dim)
    recurrent = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    return conv, recurrent


STEPWISE_REPLAY_TOKENS = 8
"""Replays of at most this many tokens (what a decoding row keeps: accepted drafts + 1) run one
token at a time, through the layer's single-token path (the one transformers' own decoding takes;
no padding to the block kernel's chunk size); longer ones (a prefill row shorter than the widest
of its batch) run grouped by length through the block path."""


class HybridSlotCache(SlotKVCache):
    """KV columns for the full-attention layers, and per slot the conv state (target dtype) and the
    recurrent state (float32: transformers' Gated DeltaNet kernels compute and return it in float32,
    and its own cache keeps it so; rounding it to bf16 every step would drift from the target's own
    decoding) of every linear-attention layer.

    A state may only advance through `commit_states`, which checks that the step continued where
    the slot's states stand: a step retried after its states were committed fails loudly instead
    of decoding from the wrong state."""

    has_states = True

    def __init__(
        self,
        config,
        slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        mixers: dict[int, nn.Module],
    ) -> None:
        kinds = list(config.layer_types)
        unknown = sorted(set(kinds) - {"full_attention", RECURRENT_LAYER_TYPE})
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported next to linear attention")
        linear = [i for i, kind in enumerate(kinds) if kind == RECURRENT_LAYER_TYPE]
        if sorted(mixers) != linear:
            raise ValueError(f"mixers for layers {sorted(mixers)}, but the linear-attention layers are {linear}")
        kv_heads, head_dim = attention_shape(config)
        attention = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
        super().__init__(len(kinds), slots, kv_heads, head_dim, capacity, dtype, device, layers=attention)
        conv_shape, recurrent_shape = _linear_attention_shapes(config)
        self.kernel = conv_shape[-1]
        self.conv = {i: torch.zeros(slots, *conv_shape, dtype=dtype, device=device) for i in linear}
        self.recurrent = {i: torch.zeros(slots, *recurrent_shape, dtype=torch.float32, device=device) for i in linear}
        self.mixers = mixers
        self._covered = [0] * slots
        self._slot_ids: list[int] = []
        self._inputs: dict[int, torch.Tensor] = {}
        self._staged_conv: dict[int, torch.Tensor] = {}
        self._staged_recurrent: dict[int, torch.Tensor] = {}
        self._replaying = False

    def nbytes(self) -> int:
        states = [*self.conv.values(), *self.recurrent.values()]
        return super().nbytes() + sum(t.numel() * t.element_size() for t in states)

    def state_nbytes_per_slot(self) -> int:
        """Bytes of linear-attention state one sequence holds (all layers)."""
        return sum(t[0].numel() * t.element_size() for t in [*self.conv.values(), *self.recurrent.values()])

    def reset(self, slot: int) -> None:
        """A new sequence starts in `slot`: zero states (what the model starts from with no cache)."""
        for state in [*self.conv.values(), *self.recurrent.values()]:
            state[slot].zero_()
        self._covered[slot] = 0

    def bind(
        self,
        slot_ids: list[int],
        write_pos: torch.Tensor,
        kv_len: int,
        slot_index: torch.Tensor | None = None,
        segments: list[Segment] | None = None,
        by_runs: bool = False,
    ) -> None:
        super().bind(slot_ids, write_pos, kv_len, slot_index, segments, by_runs)
        self._slot_ids = list(slot_ids)
        self._inputs, self._staged_conv, self._staged_recurrent = {}, {}, {}

    # ---- what transformers' linear-attention layers call ----------------------------------

    def is_recording_past(self, layer_idx: int) -> bool:
        """Always: the layer then hands every new conv input to `update_conv_state`, even for a
        single token, instead of updating the returned state in place."""
        return True

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv[layer_idx][self._rows]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.recurrent[layer_idx][self._rows]

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_: object):
        """`conv_states` [B, channels, q]: the new mixer inputs. Returns them after the slot's
        previous `kernel` inputs (the left context the causal convolution needs)."""
        full = torch.cat([self.conv[layer_idx][self._rows], conv_states.to(self.conv[layer_idx].dtype)], dim=-1)
        self._store(self.conv, self._staged_conv, layer_idx, full[..., -self.kernel :])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_: object):
        self._store(self.recurrent, self._staged_recurrent, layer_idx, recurrent_states)
        return recurrent_states

    def record_mixer_input(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """The target's pre-hook: the hidden states entering mixer `layer_idx` in this forward."""
        if not self._replaying:
            self._inputs[layer_idx] = hidden_states

    def _store(self, committed: dict, staged: dict, layer_idx: int, state: torch.Tensor) -> None:
        if self._replaying:
            committed[layer_idx][self._rows] = state.to(committed[layer_idx].dtype)
        else:
            staged[layer_idx] = state

    # ---- rollback ---------------------------------------------------------------------------

    def commit_states(self, starts: list[int], kept: list[int]) -> None:
        """After a forward over the bound rows, where row b continued after `starts[b]` tokens:
        row b keeps the states after its first `kept[b]` tokens of the block (host ints)."""
        for slot, start in zip(self._slot_ids, starts, strict=True):
            if self._covered[slot] != start:
                raise RuntimeError(
                    f"slot {slot}: its linear-attention states cover {self._covered[slot]} tokens "
                    f"(-1: a failed commit left them half written), but the step continued after {start}"
                )
        width = next(iter(self._inputs.values())).shape[1]
        for b, n in enumerate(kept):
            if not 0 < n <= width:
                raise ValueError(f"row {b} keeps {n} tokens of a block of {width}")
        whole = [b for b, n in enumerate(kept) if n == width]
        partial = {b: n for b, n in enumerate(kept) if n < width}
        for slot in self._slot_ids:
            self._covered[slot] = -1
        if len(whole) == len(kept):
            self._take_staged(self._rows, slice(None))
        elif whole:
            self._take_staged(
                self.slot_index([self._slot_ids[b] for b in whole])[:, 0],
                torch.tensor(whole, device=self.device),
            )
        if partial and max(partial.values()) <= STEPWISE_REPLAY_TOKENS:
            for step in range(max(partial.values())):
                self._replay([b for b, n in partial.items() if n > step], step, step + 1)
        else:
            for length in sorted(set(partial.values())):
                self._replay([b for b, n in partial.items() if n == length], 0, length)
        for slot, start, n in zip(self._slot_ids, starts, kept, strict=True):
            self._covered[slot] = start + n
        self._inputs, self._staged_conv, self._staged_recurrent = {}, {}, {}

    def _take_staged(self, slots: torch.Tensor | slice, rows: torch.Tensor | slice) -> None:
        for index in self.mixers:
            self.conv[index][slots] = self._staged_conv[index][rows]
            self.recurrent[index][slots] = self._staged_recurrent[index][rows].to(torch.float32)

    def _replay(self, rows: list[int], begin: int, end: int) -> None:
        """Run every linear-attention mixer over captured inputs `begin:end` of batch `rows`, from
        their committed states, writing the states it ends in (its output is not needed)."""
        bound = self._rows
        batch = torch.tensor(rows, device=self.device)
        self._rows = self.slot_index([self._slot_ids[b] for b in rows])[:, 0]
        self._replaying = True
        try:
            for index, mixer in self.mixers.items():
                mixer(hidden_states=self._inputs[index][batch, begin:end], cache=self, attention_mask=None)
        finally:
            self._rows, self._replaying = bound, False


def slot_cache(target: Target, slots: int, capacity: int) -> SlotKVCache:
    """The slot cache `target` needs: KV columns only, or with linear-attention states (hybrid)."""
    if target.recurrent_mixers:
        return HybridSlotCache(target.config, slots, capacity, target.dtype, target.device, target.recurrent_mixers)
    return SlotKVCache.for_config(target.config, slots, capacity, target.dtype, target.device)
