"""Proposers: where draft tokens come from. The baseline proposes nothing (K = 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aerie.target.model import FeatureKind


@dataclass
class Draft:
    """Draft tokens for a batch of running slots, as a chain of `k` tokens per row."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


class NoProposer:
    """Plain autoregressive decoding: the same engine step with zero draft tokens."""

    name = "none"
    features: FeatureKind | None = None
    max_draft_tokens = 0

    def propose(self, slots: list[int], device: torch.device) -> Draft:
        return Draft(tokens=torch.zeros(len(slots), 0, dtype=torch.long, device=device))
