"""Training data for the heads: the ingest Parquet (`<data>/train/`, `<data>/eval/`) through Ray Data.

Rows kept for training: `has_reply` true (when the column is there), at least one loss token and at
least 3 tokens. Only `input_ids` and `loss_mask` travel to the workers. The training split reaches
each worker as its own Ray Data shard (`ray.train.get_dataset_shard("train")`), streamed, with a
local shuffle buffer; the eval split is small and read once on the driver, in file order (the same
examples for every run), capped at `eval_max_examples`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from aerie import storage
from aerie.heads.fit import Example

COLUMNS = ["input_ids", "loss_mask"]
MIN_TOKENS = 3  # the head frame needs 3 tokens (aerie.heads.losses.prepare_batch)


def split_uri(data: str, split: str) -> str:
    return storage.join(data, split)


def parquet_dataset(uri: str) -> pads.Dataset:
    fs, path = storage.resolve(uri)
    if not storage.exists(uri):
        raise FileNotFoundError(f"no Parquet data at {uri} (expected the ingest output: <data>/train/, <data>/eval/)")
    return pads.dataset(path, filesystem=fs, format="parquet", exclude_invalid_files=False)


def data_bytes(data: str) -> int:
    """Bytes of Parquet under `<data>/train/`."""
    import pyarrow.fs as pafs

    fs, path = storage.resolve(split_uri(data, "train"))
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)


def read_columns(uri: str) -> list[str]:
    """The columns to read from a split; raises ValueError naming a missing required column."""
    names = set(parquet_dataset(uri).schema.names)
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{uri}: missing column(s) {missing}; is this the output of `aerie ingest`?")
    return COLUMNS + (["has_reply"] if "has_reply" in names else [])


def _list_values(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, row lengths) of a list column."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
    return values, lengths


def select_rows(batch: pa.Table) -> pa.Table:
    """Ray Data UDF: the trainable rows, as (input_ids, loss_mask)."""
    ids, lengths = _list_values(batch.column("input_ids"))
    mask, mask_lengths = _list_values(batch.column("loss_mask"))
    if not np.array_equal(lengths, mask_lengths):
        raise ValueError("input_ids and loss_mask lengths differ in some rows")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    loss_tokens = (
        np.add.reduceat(mask.astype(np.int64), starts) if mask.size else np.zeros(len(lengths), np.int64)
    )
    loss_tokens = np.where(lengths > 0, loss_tokens, 0)
    keep = (lengths >= MIN_TOKENS) & (loss_tokens > 0)
    if "has_reply" in batch.column_names:
        keep &= batch.column("has_reply").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    return batch.select(COLUMNS).filter(pa.array(keep))


def examples_from_table(batch: pa.Table) -> list[Example]:
    ids, lengths = _list_values(batch.column("input_ids"))
    mask, _ = _list_values(batch.column("loss_mask"))
    bounds = np.cumsum(lengths)[:-1]
    return [
        Example(i.tolist(), m.astype(bool).tolist())
        for i, m in zip(np.split(ids, bounds), np.split(mask, bounds), strict=True)
    ]


def count_tokens(batch: pa.Table, vocab_size: int) -> pa.Table:
    """Ray Data UDF: per block, rows, tokens, loss tokens, the count of every reply token
    (`counts`) and of every token (`all_counts`), and the row lengths."""
    ids, lengths = _list_values(batch.column("input_ids"))
    mask, _ = _list_values(batch.column("loss_mask"))
    reply = ids[mask.astype(bool)].astype(np.int64)
    if reply.size and (reply.min() < 0 or reply.max() >= vocab_size):
        raise ValueError(f"token ids outside the target vocabulary (0..{vocab_size - 1})")
    return pa.table(
        {
            "rows": [batch.num_rows],
            "tokens": [int(ids.size)],
            "loss_tokens": [int(reply.size)],
            "counts": pa.array([np.bincount(reply, minlength=vocab_size)], type=pa.list_(pa.int64())),
            "all_counts": pa.array(
                [np.bincount(ids.astype(np.int64), minlength=vocab_size)], type=pa.list_(pa.int64())
            ),
            "lengths": pa.array([lengths.astype(np.int32)], type=pa.list_(pa.int32())),
        }
    )


def train_dataset(data: str, seed: int = 0):
    """The trainable rows of `<data>/train/` as a Ray Dataset (lazy, blocks in a seeded order)."""
    import ray

    uri = split_uri(data, "train")
    columns = read_columns(uri)
    fs, path = storage.resolve(uri)
    ds = ray.data.read_parquet(path, filesystem=fs).select_columns(columns)
    ds = ds.map_batches(select_rows, batch_format="pyarrow", batch_size=None)
    return ds.randomize_block_order(seed=seed)


def scan_dataset(ds, vocab_size: int) -> dict[str, Any]:
    """One pass: rows, tokens, loss tokens, reply-token counts (for the draft vocabulary) and
    all-token counts (for the P-EAGLE placeholder), row lengths (to plan token-budget batches)."""
    totals = {"rows": 0, "tokens": 0, "loss_tokens": 0}
    counts = np.zeros(vocab_size, dtype=np.int64)
    all_counts = np.zeros(vocab_size, dtype=np.int64)
    lengths: list[np.ndarray] = []
    scanned = ds.map_batches(
        count_tokens, fn_kwargs={"vocab_size": vocab_size}, batch_format="pyarrow", batch_size=None
    )
    for part in scanned.iter_batches(batch_format="pyarrow", batch_size=None):
        for key in totals:
            totals[key] += int(pc.sum(part.column(key)).as_py() or 0)
        for row in part.column("counts").to_pylist():
            counts += np.asarray(row, dtype=np.int64)
        for row in part.column("all_counts").to_pylist():
            all_counts += np.asarray(row, dtype=np.int64)
        lengths.extend(np.asarray(row, dtype=np.int32) for row in part.column("lengths").to_pylist())
    lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    return {**totals, "counts": counts, "all_counts": all_counts, "lengths": lengths_all}


def read_eval_examples(data: str, limit: int) -> list[Example]:
    """The first `limit` trainable rows of `<data>/eval/` in file order; [] when there is no eval split."""
    uri = split_uri(data, "eval")
    if limit <= 0 or not storage.exists(uri):
        return []
    try:
        columns = read_columns(uri)
    except FileNotFoundError:
        return []
    dataset = parquet_dataset(uri)
    out: list[Example] = []
    for fragment in sorted(dataset.get_fragments(), key=lambda f: f.path):
        for record_batch in fragment.to_batches(columns=columns):
            out.extend(examples_from_table(select_rows(pa.Table.from_batches([record_batch]))))
            if len(out) >= limit:
                return out[:limit]
    return out


def count_batches(lengths: np.ndarray, batch_size: int, batch_tokens: int | None, max_length: int) -> int:
    """How many batches `batched` makes of rows with these lengths (in this order)."""
    if batch_tokens is None:
        return -(-len(lengths) // batch_size)
    count, rows, longest = 0, 0, 0
    for n in np.minimum(lengths, max_length):
        if rows and max(longest, n) * (rows + 1) > batch_tokens:
            count, rows, longest = count + 1, 0, 0
        rows, longest = rows + 1, max(longest, int(n))
    return count + (1 if rows else 0)


def batched(
    examples: Iterable[Example], batch_size: int, batch_tokens: int | None = None, max_length: int | None = None
) -> Iterator[list[Example]]:
    """Groups of `batch_size` examples, or, with `batch_tokens`, as many as fit in that many padded
    tokens (at least one)."""
    batch: list[Example] = []
    longest = 0
    for ex in examples:
        n = min(len(ex.input_ids), max_length or len(ex.input_ids))
        if batch_tokens is not None:
            if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(ex)
            longest = max(longest, n)
        else:
            batch.append(ex)
            if len(batch) == batch_size:
                yield batch
                batch = []
    if batch:
        yield batch


def shard_examples(shard, epoch: int, rank: int, seed: int, shuffle_buffer: int, fetch_rows: int = 64):
    """The examples of one worker's shard for one epoch, locally shuffled with a seed per (epoch, rank)."""
    kwargs: dict[str, Any] = {"batch_size": fetch_rows, "batch_format": "pyarrow"}
    if shuffle_buffer > 0:
        kwargs["local_shuffle_buffer_size"] = shuffle_buffer
        kwargs["local_shuffle_seed"] = seed * 1_000_003 + epoch * 7919 + rank
    for table in shard.iter_batches(**kwargs):
        yield from examples_from_table(table)
