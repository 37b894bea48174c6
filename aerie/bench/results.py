"""`results.json` (a list: one object per variant x K x concurrency) and `results.parquet` (the same
rows; `k` as text since it may be "auto", the K histogram as a map)."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from aerie import storage


def rows_table(rows: list[dict]) -> pa.Table:
    columns: dict[str, list] = {key: [] for key in dict.fromkeys(k for row in rows for k in row)}
    for row in rows:
        for key in columns:
            value = row.get(key)
            if key == "k":
                value = str(value)
            elif key == "k_histogram":
                value = [(int(k), int(n)) for k, n in (value or {}).items()]
            columns[key].append(value)
    arrays = {}
    for key, values in columns.items():
        if key == "k_histogram":
            arrays[key] = pa.array(values, type=pa.map_(pa.int64(), pa.int64()))
        elif key.endswith("_rates") or key.endswith("_repeats") or key == "wall_seconds":
            arrays[key] = pa.array(values, type=pa.list_(pa.float64()))
        else:
            arrays[key] = pa.array(values)
    return pa.table(arrays)


def write_results(rows: list[dict], out: str) -> dict[str, str]:
    paths = {"results.json": storage.join(out, "results.json"), "results.parquet": storage.join(out, "results.parquet")}
    storage.write_text(paths["results.json"], json.dumps(rows, indent=2) + "\n")
    buffer = io.BytesIO()
    pq.write_table(rows_table(rows), buffer)
    storage.write_bytes(paths["results.parquet"], buffer.getvalue())
    return paths
