"""winner.json round-trips locally and on S3, and refuses what Serve could not act on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aerie.winner import Winner


@pytest.mark.parametrize("where", ["local", "s3"])
def test_winner_round_trips(where, tmp_path, request):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_bucket") + "/winner-test"
    winner = Winner(target="t", method="eagle3", head="h", k="auto", k_by_concurrency={1: 3, 16: 0})
    winner.save(f"{root}/winner.json")
    assert Winner.load(f"{root}/winner.json") == winner


def test_winner_names_the_bad_field():
    with pytest.raises(ValidationError, match="k must be >= 0"):
        Winner(target="t", method="eagle3", k=-1)
    with pytest.raises(ValidationError, match="surprise"):
        Winner(target="t", method="none", surprise=1)
