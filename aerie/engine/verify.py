"""Lossless verification of draft chains and trees against the target's distributions.

Greedy (every row at temperature 0): accept the longest prefix where the draft equals the
target's argmax, then append the target's own token at the first mismatch (the bonus token).

Sampled (Leviathan et al. 2023; Chen et al. 2023): accept draft x ~ q with probability
min(1, p(x) / q(x)); at the first rejection draw from normalise(max(0, p - q)); if every draft is
accepted draw the bonus from p. Greedy rows in a sampled batch carry one-hot p and so follow the
greedy rule exactly. A draft proposed greedily has a one-hot q.

Chains may carry per-row draft lengths (a row with fewer drafts is padded; its padding is never
accepted). Every verifier returns the emitted tokens of each row as one tensor, accepted drafts
then the bonus, so the engine reads a whole step's verdict back from the device in one transfer.
"""

from __future__ import annotations

import torch

from aerie.engine.sampling import adjusted_probs, sample_from


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of `accept` [B, K]."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _within(lengths: torch.Tensor | None, k: int, device: torch.device) -> torch.Tensor | bool:
    """[B, K] True for each row's real draft positions (True everywhere without lengths)."""
    if lengths is None:
        return True
    return torch.arange(k, device=device)[None, :] < lengths[:, None]


def verify_greedy(
    target_logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_logits` [B, K+1, V], `drafts` [B, K], `lengths` [B] real drafts per row (None: K)
    -> (accepted count [B], emitted tokens [B, K+1]: the first accepted + 1 are real)."""
    choice = target_logits.argmax(dim=-1)
    accepted = accepted_prefix((drafts == choice[:, :-1]) & _within(lengths, drafts.shape[1], drafts.device))
    return accepted, choice


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for chains -> (accepted count [B], emitted tokens [B, K+1]).

    `target_probs` [B, K+1, V]; `drafts` [B, K]; `draft_probs` [B, K, V] or None for greedy drafts;
    `uniforms` [B, K+1]: one per acceptance test, the last for the final draw; `lengths` as for
    `verify_greedy`.
    """
    batch, k = drafts.shape
    device = drafts.device
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        draft_probs = torch.zeros_like(target_probs[:, :k]).scatter_(-1, drafts[..., None], 1.0)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accept = uniforms[:, :k].to(p_draft.dtype) * q_draft < p_draft
    accepted = accepted_prefix(accept & _within(lengths, k, device))
    rows = torch.arange(batch, device=device)
    final = target_probs[rows, accepted]
    rejected = accepted < (k if lengths is None else lengths)
    q_at = torch.cat([draft_probs, torch.zeros_like(final[:, None])], dim=1)[rows, accepted]
    residual = (final - q_at).clamp_(min=0)
    has_mass = residual.sum(-1, keepdim=True) > 0
    final = torch.where(rejected[:, None] & has_mass, residual, final)
    token = sample_from(final, uniforms[:, k])
    emitted = torch.cat([drafts, token[:, None]], dim=1).scatter_(1, accepted[:, None], token[:, None])
    return accepted, emitted


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, n+1, n+1] ancestor-or-self relation of a tree block: column 0 is the last committed
    token (everyone's ancestor), column i+1 is node i with parent `parents[:, i]` (-1: column 0)."""
    batch, n = parents.shape
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    rows = torch.arange(batch, device=parents.device)
    for node in range(n):
        ancestors[:, node + 1] |= ancestors[rows, parents[:, node] + 1]
    return ancestors


def verify_tree_greedy(
    target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification for every row at once.

    `target_logits` [B, n+1, V] (column 0: the last committed token; column i+1: node i), `tokens`,
    `parents`, `depths` [B, n] as in `Draft`. A node is accepted when its token is the target's
    argmax after its parent and its parent is accepted. Siblings carry distinct tokens, so the
    accepted nodes form one path. Returns (path [B, max_depth]: the accepted node at each depth,
    -1 past the path; path length [B]; emitted tokens [B, max_depth + 1]: the path's tokens then
    the target's own next token).
    """
    batch, n = tokens.shape
    device = tokens.device
    choice = target_logits.argmax(dim=-1)
    match = tokens == choice.gather(1, parents + 1)
    is_root_child = parents < 0
    accepted = match & is_root_child
    for _ in range(max_depth - 1):
        accepted = match & (is_root_child | accepted.gather(1, parents.clamp(min=0)))
    slot = torch.where(accepted, depths - 1, max_depth)
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    path.scatter_(1, slot, torch.arange(n, device=device).expand(batch, n))
    path = path[:, :max_depth]
    length = (path >= 0).sum(dim=1)
    last = torch.where(length > 0, path.gather(1, (length - 1).clamp(min=0)[:, None]).squeeze(1) + 1, 0)
    bonus = choice.gather(1, last[:, None])
    emitted = torch.cat([tokens.gather(1, path.clamp(min=0)), bonus], dim=1)
    emitted.scatter_(1, length[:, None], bonus)
    return path, length, emitted


def verify_tree_sampled(
    target_logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator],
) -> list[tuple[list[int], int]]:
    """Walk each row's draft tree from the root, sibling by sibling (rows at temperature 0 follow
    the greedy rule); returns (accepted node indices, next token) per row. `temperature`, `top_p`
    [B] on the logits' device."""
    probs = adjusted_probs(target_logits, temperature[:, None], top_p[:, None]).double()
    results = []
    for row, (row_tokens, row_parents) in enumerate(zip(tokens.tolist(), parents.tolist(), strict=True)):
        children: list[list[int]] = [[] for _ in range(len(row_tokens) + 1)]
        for node, parent in enumerate(row_parents):
            children[parent + 1].append(node)
        results.append(_walk_sampled(probs[row], row_tokens, children, generators[row]))
    return results


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
            if float(torch.rand(1, generator=generator, dtype=torch.float64, device="cpu")) < float(p[x]):
                accepted = child
                break
            p[x] = 0.0
            p /= p.sum()
        if accepted is None:
            uniform = torch.rand(1, generator=generator, dtype=torch.float64, device="cpu").to(p.device)
            return path, int(sample_from(p[None], uniform))
        path.append(accepted)
        column = accepted + 1
