"""Shared, session-scoped: a random target and draft heads trained on its own greedy replies
(a few seconds each), so speculative tests see real, varying acceptance."""

from __future__ import annotations

import pytest
from random_models import random_model, trained_heads

from aerie.target import Target


@pytest.fixture(scope="session")
def llama_with_heads():
    target = Target(random_model("llama"))
    return target, trained_heads(target, ("eagle3", "peagle", "eagle"))
