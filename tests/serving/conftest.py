"""A small served model (see tests/serving_models.py) for the Ray-free serving tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from serving_models import build_served_target


@pytest.fixture(scope="session")
def served_target_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_served_target(tmp_path_factory.mktemp("served-target") / "tiny-served", tokenizer_dir)
