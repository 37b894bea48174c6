"""Exact-duplicate detection over parsed records, decided on the driver from a thin projection."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["SCAN_COLUMNS", "scan_parsed"]

SCAN_COLUMNS = ["ok", "reason", "content_key", "source", "line"]


def scan_parsed(batches: Iterable[pa.Table]) -> tuple[dict[str, int], dict[str, set[int]], int]:
    """One pass over a thin projection of the parsed rows (``ok``, ``reason``, ``content_key``,
    ``source``, ``line``: ~50 bytes a row), on the driver.

    Returns the quarantine counts by reason, the duplicates to drop (``{source: {line, ...}}``:
    every row whose content key was seen before, in (source, line) order) and the number of
    duplicates.
    """
    reasons: dict[str, int] = {}
    parts = []
    for batch in batches:
        for item in pc.value_counts(batch.column("reason")).to_pylist():
            if item["values"] is not None:
                reasons[item["values"]] = reasons.get(item["values"], 0) + int(item["counts"])
        ok = batch.filter(pc.fill_null(batch.column("ok"), False))
        parts.append(ok.select(["content_key", "source", "line"]))
    drop: dict[str, set[int]] = {}
    if not parts:
        return reasons, drop, 0
    thin = pa.concat_tables(parts)
    counts = thin.group_by("content_key").aggregate([("line", "count")])
    dup_keys = counts.filter(pc.greater(counts.column("line_count"), 1)).column("content_key")
    if len(dup_keys) == 0:
        return reasons, drop, 0
    dups = thin.filter(pc.is_in(thin.column("content_key"), value_set=dup_keys))
    dups = dups.sort_by([("content_key", "ascending"), ("source", "ascending"), ("line", "ascending")])
    keys = dups.column("content_key").to_pylist()
    sources = dups.column("source").to_pylist()
    lines = dups.column("line").to_pylist()
    n = 0
    for i in range(1, len(keys)):
        if keys[i] == keys[i - 1]:
            drop.setdefault(sources[i], set()).add(lines[i])
            n += 1
    return reasons, drop, n
