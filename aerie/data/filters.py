"""Row filters for ``map_batches`` over pyarrow tables (picklable closures, named for Ray's progress bars)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["where", "where_status_in"]


def where(column: str, value: Any, *, negate: bool = False) -> Callable[[pa.Table], pa.Table]:
    """Rows whose ``column`` equals ``value`` (or, with ``negate``, does not; nulls never match)."""
    def fn(batch: pa.Table) -> pa.Table:
        mask = pc.equal(batch.column(column), pa.scalar(value))
        mask = pc.fill_null(mask, False)
        return batch.filter(pc.invert(mask) if negate else mask)

    fn.__name__ = f"where_{column}_{'not_' if negate else ''}{value}"
    return fn


def where_status_in(values: set[str]) -> Callable[[pa.Table], pa.Table]:
    """Rows whose ``status`` is one of ``values``."""
    def fn(batch: pa.Table) -> pa.Table:
        mask = pc.fill_null(pc.is_in(batch.column("status"), value_set=pa.array(sorted(values))), False)
        return batch.filter(mask)

    fn.__name__ = "where_status_in"
    return fn
