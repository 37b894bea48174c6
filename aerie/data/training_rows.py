"""Which rows each training worker sees at each step: a pure function of the data and the seed.

Exact resume needs the row order to be a function of (data, seed, epoch, rank, world size), not of
how a streaming reader happened to hand out blocks. So the rows are indexed once, on the driver:

- the trainable rows of the ingest Parquet (``has_reply`` true when the column is there, at least
  one loss token, at least 3 tokens), in file-name and row order, each with its record ``id``
  (the ingest id; ``<file>:<row>`` for Parquet without one) and length: a :class:`RowIndex`;
- each epoch, :func:`epoch_plan` cuts the rows into chunks (consecutive rows, never across
  files), permutes the chunks with a seed of (seed, epoch), deals them round-robin to the ranks,
  shuffles each rank's rows within windows of ``shuffle_window`` rows (seed, epoch, rank), evens
  the ranks out (each gets as many rows as the smallest) and batches them (``batch_size`` rows,
  or as many as fit ``batch_tokens`` padded tokens); every rank stops at the smallest batch count.

A worker that restarts from a checkpoint taken after batch ``b`` of epoch ``e`` recomputes the
same plan and continues at batch ``b``: no row skipped, none repeated. :class:`RowReader` fetches
a batch's rows: from one Arrow table of every trainable row (small data, shared through the
object store) or straight from the Parquet files (large data: whole-file chunks, so a rank reads
only its own files, a window at a time). Nothing here imports Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from aerie.heads.fit import Example

__all__ = [
    "MIN_TOKENS",
    "RowIndex",
    "PlanSettings",
    "trainable_mask",
    "scan_file",
    "build_index",
    "epoch_plan",
    "RowReader",
    "examples_from_table",
    "plan_budget",
]

MIN_TOKENS = 3  # the head frame needs 3 tokens (aerie.heads.losses.prepare_batch)
COLUMNS = ["input_ids", "loss_mask"]


def _list_values(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, row lengths) of a list column."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
    return values, lengths


def trainable_mask(batch: pa.Table) -> np.ndarray:
    """bool [rows]: at least MIN_TOKENS tokens, at least one loss token, a reply (when recorded)."""
    _, lengths = _list_values(batch.column("input_ids"))
    mask, mask_lengths = _list_values(batch.column("loss_mask"))
    if not np.array_equal(lengths, mask_lengths):
        raise ValueError("input_ids and loss_mask lengths differ in some rows")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    loss_tokens = np.add.reduceat(mask.astype(np.int64), starts) if mask.size else np.zeros(len(lengths), np.int64)
    keep = (lengths >= MIN_TOKENS) & (np.where(lengths > 0, loss_tokens, 0) > 0)
    if "has_reply" in batch.column_names:
        keep &= batch.column("has_reply").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    return keep


def examples_from_table(batch: pa.Table) -> list[Example]:
    ids, lengths = _list_values(batch.column("input_ids"))
    mask, _ = _list_values(batch.column("loss_mask"))
    bounds = np.cumsum(lengths)[:-1]
    return [
        Example(i.tolist(), m.astype(bool).tolist())
        for i, m in zip(np.split(ids, bounds), np.split(mask, bounds), strict=True)
    ]


def scan_file(filesystem: Any, path: str, vocab_size: int) -> dict[str, Any]:
    """One Parquet file: its trainable rows (positions, ids, lengths), their token and reply-token
    counts over the vocabulary (the draft vocabulary and the P-EAGLE placeholder come from them)."""
    schema = pq.read_schema(path, filesystem=filesystem)
    missing = [c for c in COLUMNS if c not in schema.names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; is this the output of `aerie ingest`?")
    columns = COLUMNS + [c for c in ("has_reply", "id") if c in schema.names]
    table = pq.read_table(path, filesystem=filesystem, columns=columns)
    keep = trainable_mask(table)
    positions = np.flatnonzero(keep)
    kept = table.filter(pa.array(keep))
    ids = kept.column("id").to_pylist() if "id" in columns else [f"{path.rsplit('/', 1)[-1]}:{p}" for p in positions]
    tokens, lengths = _list_values(kept.column("input_ids"))
    mask, _ = _list_values(kept.column("loss_mask"))
    tokens = tokens.astype(np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token ids outside the target vocabulary (0..{vocab_size - 1})")
    reply = tokens[mask.astype(bool)]
    return {
        "positions": positions.astype(np.int64),
        "ids": ids,
        "lengths": lengths.astype(np.int32),
        "tokens": int(tokens.size),
        "loss_tokens": int(reply.size),
        "counts": np.bincount(reply, minlength=vocab_size),
        "all_counts": np.bincount(tokens, minlength=vocab_size),
    }


@dataclass
class RowIndex:
    """Every trainable row, in (file, row) order: where it is, its id and its length."""

    files: list[str]
    file_of: np.ndarray  # int32 [N]
    row_in_file: np.ndarray  # int64 [N]
    ids: list[str]
    lengths: np.ndarray  # int32 [N]

    def __len__(self) -> int:
        return len(self.ids)


def build_index(files: list[str], scans: list[dict[str, Any]]) -> RowIndex:
    """The :class:`RowIndex` of ``files`` from their :func:`scan_file` results (same order)."""
    return RowIndex(
        files=list(files),
        file_of=np.concatenate([np.full(len(s["positions"]), f, np.int32) for f, s in enumerate(scans)] or [[]])
        .astype(np.int32),
        row_in_file=np.concatenate([s["positions"] for s in scans] or [[]]).astype(np.int64),
        ids=[i for s in scans for i in s["ids"]],
        lengths=np.concatenate([s["lengths"] for s in scans] or [[]]).astype(np.int32),
    )


@dataclass(frozen=True)
class PlanSettings:
    """How rows become steps. ``chunk_rows`` None: whole files (streamed data); ``shuffle_window``
    None: each rank's rows shuffled as a whole (data held in memory)."""

    seed: int
    world_size: int
    batch_size: int
    batch_tokens: int | None = None
    max_length: int = 2048
    chunk_rows: int | None = None
    shuffle_window: int | None = None


def _chunks(index: RowIndex, chunk_rows: int | None) -> list[tuple[int, int]]:
    bounds = np.flatnonzero(np.diff(index.file_of)) + 1 if len(index) else np.zeros(0, np.int64)
    edges = [0, *bounds.tolist(), len(index)]
    out = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        step = chunk_rows or max(b - a, 1)
        out += [(s, min(s + step, b)) for s in range(a, b, step)]
    return out


def _batches(rows: np.ndarray, lengths: np.ndarray, settings: PlanSettings) -> list[np.ndarray]:
    if settings.batch_tokens is None:
        return [rows[i : i + settings.batch_size] for i in range(0, len(rows), settings.batch_size)]
    out, start, longest = [], 0, 0
    for i, n in enumerate(np.minimum(lengths[rows], settings.max_length)):
        if i > start and max(longest, n) * (i - start + 1) > settings.batch_tokens:
            out.append(rows[start:i])
            start, longest = i, 0
        longest = max(longest, int(n))
    if start < len(rows):
        out.append(rows[start:])
    return out


def epoch_plan(index: RowIndex, epoch: int, settings: PlanSettings) -> list[list[np.ndarray]]:
    """``plan[rank][step]``: the global row numbers of every rank's batches in ``epoch``; every rank
    has the same number of steps (see the module docstring)."""
    world = settings.world_size
    chunks = _chunks(index, settings.chunk_rows)
    if len(chunks) < world:
        raise ValueError(f"{len(index)} trainable rows in {len(chunks)} chunk(s) cannot feed {world} workers")
    order = np.random.default_rng([settings.seed, epoch]).permutation(len(chunks))
    per_rank: list[np.ndarray] = []
    for rank in range(world):
        mine = [chunks[j] for j in order[rank::world]]
        rows = np.concatenate([np.arange(a, b) for a, b in mine]) if mine else np.zeros(0, np.int64)
        rng = np.random.default_rng([settings.seed, epoch, rank])
        window = settings.shuffle_window or max(len(rows), 1)
        per_rank.append(np.concatenate([rng.permutation(rows[i : i + window]) for i in range(0, len(rows), window)]
                                       or [rows]))
    even = min(len(r) for r in per_rank)
    if even == 0:
        raise ValueError(f"{len(index)} trainable rows cannot feed {world} workers")
    batches = [_batches(rows[:even], index.lengths, settings) for rows in per_rank]
    steps = min(len(b) for b in batches)
    return [b[:steps] for b in batches]


class RowReader:
    """The examples of a batch of global row numbers: from ``table`` (every trainable row, in index
    order) when given, else read from the Parquet files through ``filesystem`` (the last
    ``keep_files`` files stay in memory)."""

    def __init__(self, index: RowIndex, table: pa.Table | None = None, filesystem: Any = None,
                 keep_files: int = 4) -> None:
        if table is None and filesystem is None:
            raise ValueError("RowReader needs the rows table or a file system to read the files")
        self.index, self.table, self.filesystem, self.keep_files = index, table, filesystem, keep_files
        self._files: OrderedDict[int, pa.Table] = OrderedDict()

    def _file(self, f: int) -> pa.Table:
        if f not in self._files:
            self._files[f] = pq.read_table(self.index.files[f], filesystem=self.filesystem, columns=COLUMNS)
            while len(self._files) > self.keep_files:
                self._files.popitem(last=False)
        self._files.move_to_end(f)
        return self._files[f]

    def examples(self, rows: np.ndarray) -> list[Example]:
        if self.table is not None:
            return examples_from_table(self.table.take(pa.array(rows)))
        parts = [self._file(int(self.index.file_of[r])).slice(int(self.index.row_in_file[r]), 1) for r in rows]
        return examples_from_table(pa.concat_tables(parts))

    def ids(self, rows: np.ndarray) -> list[str]:
        return [self.index.ids[r] for r in rows]


AUTO_EPOCHS = 3  # the automatic budget's length on data large enough that min_steps is less


def plan_budget(steps_per_epoch: int, *, epochs: int | None, max_steps: int | None, min_steps: int,
                max_epochs: int, eval_every: int | None) -> dict[str, int]:
    """Total steps (the length of the LR schedule), passes over the data and eval cadence.

    Given ``epochs`` and/or ``max_steps``, exactly that. Otherwise the automatic budget: at least
    ``min_steps`` (small data: many passes), else ``AUTO_EPOCHS`` passes, never more than
    ``max_epochs``; the loop stops earlier when eval agreement stops improving. ``eval_every``
    None: about 20 evals over the run, at least 10 steps apart.
    """
    if epochs is not None or max_steps is not None:
        passes = epochs if epochs is not None else -(-max_steps // steps_per_epoch)
        total = steps_per_epoch * passes if max_steps is None else min(max_steps, steps_per_epoch * passes)
    else:
        passes = min(max_epochs, max(AUTO_EPOCHS, -(-min_steps // steps_per_epoch)))
        total = steps_per_epoch * passes
    every = max(10, total // 20) if eval_every is None else eval_every
    return {"steps_per_epoch": steps_per_epoch, "epochs": passes, "total_steps": total, "eval_every": every}
