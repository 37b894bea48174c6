"""Turning logits into the distribution a request samples from, and drawing from it.

Every request owns a `torch.Generator`: its draws depend on its own seed only, never on which
other requests share the batch. Temperature 0 is greedy, expressed as a one-hot distribution so
that verification (`verify.py`) treats greedy and sampled requests with the same rule.
"""

from __future__ import annotations

import torch


def adjusted_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax(logits / T) restricted to the top-p nucleus; one-hot argmax where T == 0.

    `logits` [..., V]; `temperature` and `top_p` broadcast over the leading dims. The nucleus is the
    smallest set of most-likely tokens whose mass reaches top_p (always at least one token).
    """
    temperature = temperature.to(logits.dtype)
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[..., None]
    probs = torch.softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = mass_before >= top_p.to(probs.dtype)[..., None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[..., None], one_hot, probs)
    return probs


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one token per row of `probs` [N, V] given uniforms [N] in [0, 1)."""
    cdf = probs.cumsum(-1)
    threshold = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def draw_uniforms(generators: list[torch.Generator], count: int) -> torch.Tensor:
    """[len(generators), count] uniforms, each row from its own request's generator."""
    return torch.stack([torch.rand(count, generator=g, dtype=torch.float64) for g in generators])
