"""`aerie train --warm-start` from a head trained by vllm-project/speculators (the layout of
tests/heads/test_speculators.py, which also trains one with `aerie.heads.fit`, the worker's path):
the Ray job refuses, before any worker starts, sequences longer than the head's sliding window."""

from __future__ import annotations

import pytest

from aerie.target import load_target
from tests.heads.test_speculators import VARIANTS, write_head
from train_jobs.config import load_config
from train_jobs.fit_heads import check_warm_start, run_fit


def test_warm_start_longer_than_the_heads_window_is_refused_up_front(ray_local, fit_target, fit_data, tmp_path):
    target = load_target(str(fit_target), device="cpu")
    theirs = tmp_path / "theirs"
    write_head(theirs, VARIANTS["eagle3-recipe"](vocab=target.vocab_size), target)
    common = dict(data=str(fit_data), target=str(fit_target), method="eagle3", warm_start=str(theirs),
                  out=str(tmp_path / "head"), storage=str(tmp_path / "runs"), ttt_steps=2, workers=1,
                  cpus_per_worker=0.5, progress=False)
    with pytest.raises(ValueError, match=r"max_length 2048 spans up to 2050 positions.*sliding_window=2048"):
        run_fit(load_config(**common))
    assert not (tmp_path / "runs").exists()
    check_warm_start(load_config(**common, max_length=2046))  # 2046 + 2 fits in the window
