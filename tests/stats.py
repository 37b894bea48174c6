"""Goodness-of-fit helpers for the sampling tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi_square_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square, pooling bins with fewer than 5 expected counts into one."""
    expected = expected_probs * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
