"""Turning logits into the distribution a request samples from, and drawing from it.

Every request owns a `torch.Generator` (on the CPU, so seeded draws are the same on every device):
its draws depend on its own seed only, never on which other requests share the batch. Temperature
0 is greedy, expressed as a one-hot distribution so that verification (`verify.py`) treats greedy
and sampled requests with the same rule. Nothing here reads a device value back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def adjusted_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax(logits / T) restricted to the top-p nucleus; one-hot argmax where T == 0.

    `logits` [..., V]; `temperature` and `top_p` broadcast over the leading dims. The nucleus is the
    smallest set of most-likely tokens whose mass reaches top_p (always at least one token); top_p
    1 keeps every token. Branch-free, so a batch mixing settings costs no host sync.
    """
    temperature = temperature.to(logits.dtype)
    top_p = top_p.to(logits.dtype)
    greedy = temperature <= 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[..., None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = (mass_before >= top_p[..., None]) & (top_p < 1)[..., None]
    nucleus = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    nucleus = nucleus / nucleus.sum(-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[..., None], one_hot, nucleus)


def request_settings(
    temperatures: Sequence[float], top_ps: Sequence[float], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row temperature and top_p as [B] tensors on `device`."""
    return (
        torch.tensor(temperatures, dtype=torch.float32, device=device),
        torch.tensor(top_ps, dtype=torch.float32, device=device),
    )


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one token per row of `probs` [N, V] given uniforms [N] in [0, 1)."""
    cdf = probs.cumsum(-1)
    threshold = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def draw_uniforms(generators: list[torch.Generator], count: int, device: torch.device) -> torch.Tensor:
    """[len(generators), count] uniforms on `device`, each row from its own request's generator."""
    rows = [torch.rand(count, generator=g, dtype=torch.float64, device="cpu") for g in generators]
    return torch.stack(rows).to(device)
