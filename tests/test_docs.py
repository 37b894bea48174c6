"""The README's configuration reference is what the models validate, and every shipped config
file validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines import config_reference
from pipelines.optimize_config import load_optimize_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_readme_configuration_reference_is_current():
    assert config_reference.main(["--check"]) == 0, "run: python -m pipelines.config_reference"


def test_the_reference_drifts_when_a_model_changes():
    readme = config_reference.README.read_text(encoding="utf-8")
    stale = readme.replace("| `margin` | float | `0.03` |", "| `margin` | float | `0.05` |")
    assert stale != readme and config_reference.with_reference(stale) == readme


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("optimize_*.yaml")), ids=lambda p: p.name)
def test_shipped_optimize_configs_validate(path):
    assert load_optimize_config(str(path)).name


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("train_*.yaml")), ids=lambda p: p.name)
def test_shipped_train_configs_validate(path):
    from train_jobs.config import load_config

    overrides = {} if "cluster" in path.name else {"data": "d", "target": "t", "out": "o"}
    assert load_config(str(path), **overrides).method
