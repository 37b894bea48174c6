"""The eval split of ingest: a share of the records, never a handful (aerie.data.eval_split)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from aerie.data.eval_split import eval_threshold, split_points
from aerie.formats.tables import split_of, split_point


def _ids(n: int) -> list[str]:
    return [f"record-{i}" for i in range(n)]


def test_small_data_gets_at_least_the_minimum_up_to_a_quarter():
    for n, want in ((64, 16), (40, 10), (3, 0)):
        ids = _ids(n)
        cut = eval_threshold(np.array([split_point(i) for i in ids]), 0.05, 16)
        assert sum(split_of(i, cut) == "eval" for i in ids) == max(want, sum(split_of(i, 0.05) == "eval" for i in ids))
        assert cut >= 0.05


def test_large_data_keeps_the_fraction_and_zero_means_no_eval():
    points = np.array([split_point(i) for i in _ids(2000)])
    assert eval_threshold(points, 0.05, 16) == 0.05
    assert eval_threshold(points[:64], 0.0, 16) == 0.0


def test_split_points_skip_failed_parses_and_dropped_duplicates():
    batch = pa.table({"ok": [True, False, True, True], "id": ["a", None, "b", "c"],
                      "source": ["f", "f", "f", "g"], "line": [1, 2, 3, 1]})
    points = split_points([batch], drop={"f": {3}})
    assert points.tolist() == [split_point("a"), split_point("c")]
