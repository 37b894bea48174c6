"""Training data for the heads, on the driver: the ingest output's files, scanned in Ray tasks.

The split folders come from the ingest manifest (:func:`aerie.data.ingest_output.split_uri`). One
Ray Data task per Parquet file scans it (:func:`aerie.data.training_rows.scan_file`): the driver
gets the row index (which rows each worker trains on is then a pure function of it, see
:mod:`aerie.data.training_rows`) and the token counts. Small data (up to ``cache_data_mb``) is
read once into one Arrow table that the workers share through the object store; larger data the
workers read from the files themselves. The eval split is read once on the driver, in file
order, capped at ``eval_max_examples``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from aerie import storage
from aerie.data.ingest_output import split_uri
from aerie.data.training_rows import (
    COLUMNS,
    RowIndex,
    build_index,
    examples_from_table,
    scan_file,
    trainable_mask,
)
from aerie.heads.fit import Example


def split_files(data: str, split: str) -> tuple[pafs.FileSystem, list[str]]:
    """(file system, sorted Parquet paths) of a split of the ingest output ``data``."""
    uri = split_uri(data, split)
    if not storage.exists(uri):
        raise FileNotFoundError(f"no Parquet data at {uri} (expected the output of `aerie ingest`)")
    fs, _ = storage.resolve(uri)
    return fs, [storage.resolve(f)[1] for f in storage.list_files(uri, (".parquet",))]


def data_bytes(fs: pafs.FileSystem, files: list[str]) -> int:
    return sum(info.size or 0 for info in fs.get_file_info(files))


def _scan_files(batch: pa.Table, *, filesystem: Any, vocab_size: int) -> pa.Table:
    """Ray Data UDF: ``{file, path}`` rows -> one row of :func:`scan_file` results per file."""
    scans = [scan_file(filesystem, path, vocab_size) for path in batch.column("path").to_pylist()]
    return pa.table({
        "file": batch.column("file"),
        "positions": pa.array([s["positions"] for s in scans], type=pa.list_(pa.int64())),
        "ids": pa.array([s["ids"] for s in scans], type=pa.list_(pa.string())),
        "lengths": pa.array([s["lengths"] for s in scans], type=pa.list_(pa.int32())),
        "counts": pa.array([s["counts"] for s in scans], type=pa.list_(pa.int64())),
        "all_counts": pa.array([s["all_counts"] for s in scans], type=pa.list_(pa.int64())),
        "tokens": [s["tokens"] for s in scans],
        "loss_tokens": [s["loss_tokens"] for s in scans],
    })


def scan(fs: pafs.FileSystem, files: list[str], vocab_size: int) -> tuple[RowIndex, dict[str, Any]]:
    """The row index of ``files`` and their totals: rows, tokens, loss tokens, the count of every
    reply token (``counts``) and of every token (``all_counts``). One Ray task per file."""
    import ray

    if not files:
        raise FileNotFoundError("no Parquet files in the training split")
    ds = ray.data.from_items([{"file": i, "path": p} for i, p in enumerate(files)],
                             override_num_blocks=min(len(files), 1024))
    scanned = ds.map_batches(_scan_files, fn_kwargs={"filesystem": fs, "vocab_size": vocab_size},
                             batch_format="pyarrow", batch_size=1)
    parts = pa.concat_tables(scanned.iter_batches(batch_format="pyarrow", batch_size=None)).sort_by("file")
    scans = [
        {"positions": np.asarray(p, np.int64), "ids": i, "lengths": np.asarray(n, np.int32)}
        for p, i, n in zip(parts.column("positions").to_pylist(), parts.column("ids").to_pylist(),
                           parts.column("lengths").to_pylist(), strict=True)
    ]
    index = build_index(files, scans)
    totals = {
        "rows": len(index),
        "tokens": int(pc.sum(parts.column("tokens")).as_py()),
        "loss_tokens": int(pc.sum(parts.column("loss_tokens")).as_py()),
        "counts": np.sum([np.asarray(c, np.int64) for c in parts.column("counts").to_pylist()], axis=0),
        "all_counts": np.sum([np.asarray(c, np.int64) for c in parts.column("all_counts").to_pylist()], axis=0),
    }
    return index, totals


def rows_table(fs: pafs.FileSystem, index: RowIndex) -> pa.Table:
    """Every trainable row's ``input_ids`` and ``loss_mask``, in index order (for small data)."""
    parts = []
    for f, path in enumerate(index.files):
        rows = index.row_in_file[index.file_of == f]
        if len(rows):
            parts.append(pq.read_table(path, filesystem=fs, columns=COLUMNS).take(pa.array(rows)))
    return pa.concat_tables(parts).combine_chunks()


def read_eval_examples(data: str, limit: int) -> list[Example]:
    """The first ``limit`` trainable rows of the eval split in file order; [] when there is none."""
    if limit <= 0:
        return []
    try:
        fs, files = split_files(data, "eval")
    except FileNotFoundError:
        return []
    out: list[Example] = []
    for path in files:
        table = pq.read_table(path, filesystem=fs, columns=[c for c in (*COLUMNS, "has_reply")
                                                             if c in pq.read_schema(path, filesystem=fs).names])
        out.extend(examples_from_table(table.filter(pa.array(trainable_mask(table))).select(COLUMNS)))
        if len(out) >= limit:
            return out[:limit]
    return out
