"""BenchConfig: defaults, and errors that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aerie.bench.config import BenchConfig
from aerie.config_io import format_errors

BASE = {"target": "t", "prompts": "p", "out": "o"}


def errors(**values) -> str:
    with pytest.raises(ValidationError) as caught:
        BenchConfig(**(BASE | values))
    return format_errors(caught.value)


def test_defaults_are_the_documented_sweep():
    cfg = BenchConfig(**BASE, heads={"peagle": "h"}, k_per_method={"peagle": [4, 6]})
    assert cfg.concurrency == [1, 2, 4, 8] and cfg.k == [2, 3, 5]
    assert cfg.ks_for("eagle3") == [2, 3, 5] and cfg.ks_for("peagle") == [4, 6] and cfg.ks_for("ngram") == [4]
    assert cfg.policy().expected_concurrency == 8
    assert cfg.warmup_for(4) == 4 and BenchConfig(**BASE, warmup=0).warmup_for(4) == 0


def test_k_takes_auto_and_concurrency_is_sorted():
    cfg = BenchConfig(**BASE, k=[3, "auto"], concurrency=[8, 1])
    assert cfg.k == [3, "auto"] and cfg.concurrency == [1, 8]


@pytest.mark.parametrize(("values", "message"), [
    ({"k": [0]}, "k: K must be >= 1 or 'auto', got 0"),
    ({"k": [3, 3]}, "k: K values must be distinct"),
    ({"concurrency": [0]}, "concurrency: every concurrency must be >= 1"),
    ({"concurrency": [1, 4], "expected_concurrency": 2}, "expected_concurrency 2 is not one of"),
    ({"concurrency": [2, 4], "peers": True}, "peers run at concurrency 1"),
    ({"heads": {"medusa": "h"}}, "heads.medusa.[key]"),
    ({"k_per_method": {"peagle": []}}, "k_per_method: peagle: give at least one K"),
    ({"out": "gs://bucket/x"}, "out: must be a local path or an s3:// URI"),
    ({"requests": 0}, "requests: Input should be greater than or equal to 1"),
    ({"repeat": 2}, "repeat: Extra inputs are not permitted"),
    ({"num_cpus": 0}, "num_cpus and num_gpus are both 0"),
])
def test_bad_values_are_named(values, message):
    assert message in errors(**values)
