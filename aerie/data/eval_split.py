"""How many records ingest holds out for eval: a share of them, but never so few that the eval
figure (what early stopping and the best checkpoint go by) is noise.

A record is in eval when its split point (:func:`aerie.formats.tables.split_point`, a hash of its
id) is below a threshold. The threshold is ``eval_fraction``, raised when that would hold out fewer
than ``eval_min_records`` records, to the point that holds out exactly that many; never more than a
quarter of the records, so a tiny data set keeps most of its rows for training.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from aerie.formats.tables import split_point

__all__ = ["POINT_COLUMNS", "split_points", "eval_threshold"]

POINT_COLUMNS = ["ok", "id", "source", "line"]


def split_points(batches: Iterable[pa.Table], drop: dict[str, set[int]]) -> np.ndarray:
    """The split point of every record the encode stage will see: parsed (``ok``) and not one of
    the ``drop`` duplicates (``{source: {line, ...}}``). ``batches`` hold :data:`POINT_COLUMNS`."""
    points = []
    for batch in batches:
        ok = batch.filter(pc.fill_null(batch.column("ok"), False))
        for record_id, source, line in zip(ok.column("id").to_pylist(), ok.column("source").to_pylist(),
                                           ok.column("line").to_pylist(), strict=True):
            if line not in drop.get(source, ()):
                points.append(split_point(record_id))
    return np.asarray(points, dtype=np.float64)


def eval_threshold(points: np.ndarray, fraction: float, min_records: int) -> float:
    """The threshold for :func:`aerie.formats.tables.split_of`: ``fraction``, or higher so that at
    least ``min(min_records, len(points) // 4)`` of the records fall below it. ``fraction`` 0 means
    no eval split at all."""
    want = min(min_records, len(points) // 4)
    if fraction <= 0 or int(np.count_nonzero(points < fraction)) >= want:
        return fraction
    ordered = np.sort(points)
    return float((ordered[want - 1] + ordered[want]) / 2)
