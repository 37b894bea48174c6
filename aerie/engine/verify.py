"""Lossless verification of a draft chain against the target's distributions.

Greedy (every row at temperature 0): accept the longest prefix where the draft equals the
target's argmax, then append the target's own token at the first mismatch (the bonus token).

Sampled (Leviathan et al. 2023; Chen et al. 2023): accept draft x ~ q with probability
min(1, p(x) / q(x)); at the first rejection draw from normalise(max(0, p - q)); if every draft is
accepted draw the bonus from p. Greedy rows in a sampled batch carry one-hot p and so follow the
greedy rule exactly. A draft proposed greedily has a one-hot q.
"""

from __future__ import annotations

import torch

from aerie.engine.sampling import sample_from


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of `accept` [B, K]."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_logits` [B, K+1, V], `drafts` [B, K] -> (accepted count [B], next token [B])."""
    choice = target_logits.argmax(dim=-1)
    accepted = accepted_prefix(drafts == choice[:, :-1])
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for chains.

    `target_probs` [B, K+1, V]; `drafts` [B, K]; `draft_probs` [B, K, V] or None for greedy drafts;
    `uniforms` [B, K+1]: one per acceptance test, the last for the final draw.
    """
    batch, k = drafts.shape
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        draft_probs = torch.zeros_like(target_probs[:, :k]).scatter_(-1, drafts[..., None], 1.0)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accepted = accepted_prefix(uniforms[:, :k].to(p_draft.dtype) * q_draft < p_draft)
    rows = torch.arange(batch, device=drafts.device)
    final = target_probs[rows, accepted]
    rejected = accepted < k
    if bool(rejected.any()):
        q_at = torch.cat([draft_probs, torch.zeros_like(final[:, None])], dim=1)[rows, accepted]
        residual = (final - q_at).clamp_(min=0)
        has_mass = residual.sum(-1, keepdim=True) > 0
        final = torch.where(rejected[:, None] & has_mass, residual, final)
    return accepted, sample_from(final, uniforms[:, k])
