"""The ingest manifest's counts (aerie.data.ingest_output.ingest_counts): every record accounted for."""

from __future__ import annotations

import pytest

from aerie.data.ingest_output import ingest_counts


def test_counts_add_up_and_name_the_template_failures():
    encoded = {("ok", "train", True): 7, ("ok", "eval", False): 2, ("too_long", "train", True): 1,
               ("template_error", "train", True): 3}
    counts, template = ingest_counts(16, {"bad_json": 2}, 1, encoded, {"regenerated": 9, "regeneration_failed": 0})
    assert counts["written"] == {"train": 7, "eval": 2, "total": 9} and counts["input_only"] == 2
    assert counts["quarantined_by_reason"] == {"bad_json": 2, "template_error": 3} and counts["too_long"] == 1
    assert template == {"template_error"} and counts["regenerated"] == 9


def test_a_lost_record_fails_the_accounting():
    with pytest.raises(RuntimeError, match="does not add up"):
        ingest_counts(17, {"bad_json": 2}, 1, {("ok", "train", True): 7}, None)
