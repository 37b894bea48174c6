"""The benchmark's Ray-free tests run tiny models: one torch thread (two spinning OpenMP threads on a
busy 2-core machine make them many times slower)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
