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

from aerie.engine.sampling import adjusted_probs, sample_from


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


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, n+1, n+1] ancestor-or-self relation of a tree block: column 0 is the last committed
    token (everyone's ancestor), column i+1 is node i with parent `parents[:, i]` (-1: column 0)."""
    batch, n = parents.shape
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    rows = torch.arange(batch, device=parents.device)
    for node in range(n):
        ancestors[:, node + 1] |= ancestors[rows, parents[:, node] + 1]
    return ancestors


def verify_tree(
    target_logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    temperature: list[float],
    top_p: list[float],
    generators: list[torch.Generator],
) -> list[tuple[list[int], int]]:
    """Walk each row's draft tree from the root; returns (accepted node indices, next token) per row.

    `target_logits` [B, n+1, V] (column 0: the last committed token; column i+1: node i).
    """
    results = []
    for row, (row_tokens, row_parents) in enumerate(zip(tokens.tolist(), parents.tolist(), strict=True)):
        children: list[list[int]] = [[] for _ in range(len(row_tokens) + 1)]
        for node, parent in enumerate(row_parents):
            children[parent + 1].append(node)
        if temperature[row] == 0:
            results.append(_walk_greedy(target_logits[row].argmax(-1).tolist(), row_tokens, children))
        else:
            probs = adjusted_probs(
                target_logits[row], torch.tensor(temperature[row]), torch.tensor(top_p[row])
            ).double()
            results.append(_walk_sampled(probs, row_tokens, children, generators[row]))
    return results


def _walk_greedy(choice: list[int], tokens: list[int], children: list[list[int]]) -> tuple[list[int], int]:
    """Follow the target's argmax while some child carries it."""
    path, column = [], 0
    while match := [c for c in children[column] if tokens[c] == choice[column]]:
        path.append(match[0])
        column = match[0] + 1
    return path, choice[column]


def _walk_sampled(
    probs: torch.Tensor, tokens: list[int], children: list[list[int]], generator: torch.Generator
) -> tuple[list[int], int]:
    """Try the children of the current node in turn, each a deterministic candidate x accepted with
    probability p(x); a rejected candidate's mass is removed from p and p renormalised. When no
    child is accepted, the next token is drawn from what is left of p: the output stays distributed
    exactly as the target's."""
    path, column = [], 0
    while True:
        p = probs[column].clone()
        accepted = None
        for child in children[column]:
            x = tokens[child]
            if float(torch.rand(1, generator=generator, dtype=torch.float64)) < float(p[x]):
                accepted = child
                break
            p[x] = 0.0
            p /= p.sum()
        if accepted is None:
            uniform = torch.rand(1, generator=generator, dtype=torch.float64)
            return path, int(sample_from(p[None], uniform))
        path.append(accepted)
        column = accepted + 1
