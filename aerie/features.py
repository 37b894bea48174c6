"""Offline target features: the target's tapped hidden states stored next to the tokens.

Training a draft head needs, for every token, the target's features at that position (EAGLE-3 /
P-EAGLE: the fused low/mid/high taps, ``[3H]``; EAGLE / EAGLE-2: the last hidden state, ``[H]``).
They can be computed online (the frozen target runs on every training batch) or once, offline,
by ``pipelines/featurize.py``, which writes them in this layout::

    <out>/features/index.json                       what is where (read it first)
    <out>/features/<split>/shard-00000.safetensors  one shard: rows packed end to end
    ...

A shard is a safetensors file (never pickle) with four flat tensors and JSON metadata:

- ``input_ids`` int32 ``[T]`` and ``loss_mask`` int8 ``[T]``: the rows' tokens, concatenated;
- ``features`` ``[T, D]`` in the storage dtype (bfloat16 by default, float16 or float32);
- ``offsets`` int64 ``[R + 1]``: row ``r`` is ``[offsets[r], offsets[r + 1])`` of the above;
- metadata ``ids``: the JSON list of the rows' record ids; ``method``, ``feature_kind``, ``dtype``.

Why this layout: one sequential read per shard (a local file or one S3 GET), zero-copy slices per
row, no per-row files, no pickle, and shards are the unit a data-parallel trainer splits
(:func:`iter_features` with ``rank``/``world_size``). Shards hold ~``shard_mb`` of features;
positions are the row's own (0, 1, ...), features come from one forward over the whole row with
a right-padded batch and a 2-D attention mask, exactly as the online path computes them.

This module has no Ray imports: :func:`compute_features` is also the online path's helper.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from aerie import storage

__all__ = [
    "FORMAT",
    "FEATURE_KINDS",
    "DTYPES",
    "FeatureRow",
    "Shard",
    "feature_kind",
    "compute_features",
    "pack_shard",
    "unpack_shard",
    "features_root",
    "read_index",
    "read_shard",
    "iter_features",
]

FORMAT = "aerie-features/1"
FEATURE_KINDS = {"eagle3": "eagle3", "peagle": "eagle3", "eagle": "last"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INDEX = "index.json"


class FeatureRow(NamedTuple):
    """One training sequence: token ids ``[n]``, loss mask ``[n]`` and the target's features ``[n, D]``."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor


def feature_kind(method: str) -> str:
    """``eagle3`` and ``peagle`` heads read the fused EAGLE-3 taps; ``eagle`` the last hidden state."""
    try:
        return FEATURE_KINDS[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}: expected one of {', '.join(FEATURE_KINDS)}") from None


@torch.no_grad()
def compute_features(
    target: Any,
    sequences: Sequence[Sequence[int]],
    kind: str,
    *,
    max_batch_tokens: int = 16384,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """The target's ``kind`` features (``"eagle3"`` or ``"last"``) for each sequence, on the CPU.

    Sequences are sorted by length and packed into right-padded batches of at most
    ``max_batch_tokens`` padded tokens (a longer sequence runs alone); positions are
    ``0..n-1``, the attention mask 2-D. Returns ``[len(seq), D]`` tensors in input order, cast to
    ``dtype`` (default: the target's dtype).
    """
    if kind not in ("eagle3", "last"):
        raise ValueError(f"feature kind must be 'eagle3' or 'last', got {kind!r}")
    device = target.device
    out: list[torch.Tensor | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]), reverse=True)
    pad = getattr(target.tokenizer, "pad_token_id", None) or 0
    start = 0
    while start < len(order):
        longest = len(sequences[order[start]])
        if longest == 0:
            break
        count = max(1, max_batch_tokens // longest)
        rows = order[start : start + count]
        start += len(rows)
        ids = torch.full((len(rows), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for b, i in enumerate(rows):
            n = len(sequences[i])
            ids[b, :n] = torch.as_tensor(list(sequences[i]), dtype=torch.long)
            mask[b, :n] = 1
        positions = torch.arange(longest, device=device).expand(len(rows), longest)
        feats = target.forward(
            ids.to(device), positions, attention_mask=mask.to(device), features=kind
        ).features
        for b, i in enumerate(rows):
            out[i] = feats[b, : len(sequences[i])].to(device="cpu", dtype=dtype or feats.dtype).contiguous()
    width = next((t.shape[-1] for t in out if t is not None), 0)
    for i, t in enumerate(out):  # empty sequences
        if t is None:
            out[i] = torch.zeros((0, width), dtype=dtype or target.dtype)
    return out  # type: ignore[return-value]


def pack_shard(
    ids: Sequence[str],
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    features: Sequence[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> bytes:
    """Rows -> the bytes of one safetensors shard (see the module docstring)."""
    from safetensors.torch import save

    lengths = [len(x) for x in input_ids]
    if [len(m) for m in loss_masks] != lengths or [int(f.shape[0]) for f in features] != lengths:
        raise ValueError("input_ids, loss_masks and features must have the same length per row")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    flat_ids = [t for row in input_ids for t in row]
    flat_mask = [m for row in loss_masks for m in row]
    tensors = {
        "input_ids": torch.tensor(flat_ids, dtype=torch.int32),
        "loss_mask": torch.tensor(flat_mask, dtype=torch.int8),
        "features": torch.cat(list(features), dim=0).contiguous() if features else torch.zeros((0, 0)),
        "offsets": offsets,
    }
    meta = {"format": FORMAT, "ids": json.dumps(list(ids)), **(metadata or {})}
    return save(tensors, metadata=meta)


def _header(data: bytes) -> dict[str, Any]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])


@dataclass
class Shard:
    """One shard in memory: flat tensors, row offsets and the rows' record ids."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor
    offsets: torch.Tensor
    ids: list[str]
    metadata: dict[str, str]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, r: int) -> FeatureRow:
        """Row ``r`` as views into the shard's tensors (no copy)."""
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return FeatureRow(self.input_ids[a:b], self.loss_mask[a:b], self.features[a:b])

    def __iter__(self) -> Iterator[FeatureRow]:
        return (self.row(r) for r in range(len(self)))


def unpack_shard(data: bytes) -> Shard:
    from safetensors.torch import load

    tensors = load(data)
    meta = dict(_header(data).get("__metadata__") or {})
    if meta.get("format") != FORMAT:
        raise ValueError(f"not an {FORMAT} shard (format {meta.get('format')!r})")
    return Shard(
        input_ids=tensors["input_ids"],
        loss_mask=tensors["loss_mask"],
        features=tensors["features"],
        offsets=tensors["offsets"],
        ids=json.loads(meta.pop("ids", "[]")),
        metadata=meta,
    )


def features_root(uri: str) -> str:
    """The folder holding ``index.json``: ``uri`` itself or ``uri/features``."""
    if storage.exists(storage.join(uri, INDEX)):
        return str(uri)
    nested = storage.join(uri, "features")
    if storage.exists(storage.join(nested, INDEX)):
        return nested
    raise FileNotFoundError(f"no features index under {uri} (run pipelines.featurize first)")


def read_index(uri: str) -> dict[str, Any]:
    """The features index (``uri`` may be the featurize ``--out`` or its ``features/`` folder)."""
    root = features_root(uri)
    index = json.loads(storage.read_text(storage.join(root, INDEX)))
    if index.get("format") != FORMAT:
        raise ValueError(f"{root}: not an {FORMAT} index")
    index["root"] = root
    return index


def read_shard(uri: str) -> Shard:
    """One shard, local or ``s3://`` (a single read)."""
    return unpack_shard(storage.read_bytes(uri))


def iter_features(
    uri: str,
    split: str = "train",
    *,
    rank: int = 0,
    world_size: int = 1,
    dtype: torch.dtype | None = None,
) -> Iterator[FeatureRow]:
    """Yield ``(input_ids, loss_mask, features)`` per row of ``split``, shard by shard.

    With ``world_size > 1`` each rank reads every ``world_size``-th shard (starting at ``rank``),
    so data-parallel workers see disjoint rows. ``dtype`` casts the features (e.g. bf16 storage
    to float32 for a CPU trainer).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    index = read_index(uri)
    if split not in index["splits"]:
        raise KeyError(f"no split {split!r} in {index['root']} (have {', '.join(index['splits'])})")
    for shard_info in index["splits"][split]["shards"][rank::world_size]:
        shard = read_shard(storage.join(index["root"], shard_info["path"]))
        for row in shard:
            yield row if dtype is None else row._replace(features=row.features.to(dtype))
