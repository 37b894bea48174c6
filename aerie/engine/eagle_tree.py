"""EAGLE-2: an EAGLE head drafting a dynamic, context-aware tree.

Each depth expands the `top_k` best nodes so far (by cumulative draft log-probability) into their
`top_k` most likely children, one batched head forward per depth; the tree sent to the target is
the `total_tokens - 1` best nodes of all depths (an ancestor-closed set, since a child never
scores above its parent). Nodes of one depth share a RoPE position but each gets its own head cache
column, and attends to the committed prefix plus its own ancestors.
"""

from __future__ import annotations

import torch

from aerie.engine.masks import build_attention_mask
from aerie.engine.proposers import Draft, HeadProposer, _last_valid
from aerie.engine.request import Request
from aerie.heads import EagleHead

# Breaks score ties towards shallower nodes so the chosen set stays ancestor-closed.
_DEPTH_TIE_BREAK = 1e-6


class EagleTreeProposer(HeadProposer):
    name = "eagle"

    def __init__(
        self, head: EagleHead, k: int, slots: int, capacity: int, top_k: int = 4, total_tokens: int = 16
    ) -> None:
        if top_k < 1 or total_tokens < 2:
            raise ValueError(f"need top_k >= 1 and total_tokens >= 2, got {top_k}, {total_tokens}")
        super().__init__(head, k, slots, capacity, draft_columns=k * top_k)
        self.top_k = top_k
        self.max_draft_tokens = min(total_tokens - 1, top_k + (k - 1) * top_k * top_k)

    @torch.inference_mode()
    def propose(self, rows: list[Request]) -> Draft:
        tokens, features, prefix = self._catch_up_inputs(rows)
        out = self._forward(rows, tokens, prefix, features=features)
        lengths = [len(t) for t in tokens]
        batch, top_k, device = len(rows), self.top_k, self.head.device
        scores, beam_tokens = torch.log_softmax(_last_valid(out.logits, lengths).float(), -1).topk(top_k)
        beam_hidden = _last_valid(out.hidden, lengths)[:, None].expand(-1, top_k, -1)
        beam_ids = torch.arange(top_k, device=device).expand(batch, -1)
        pool_tokens, pool_scores = [beam_tokens], [scores]
        pool_parents = [torch.full((batch, top_k), -1, device=device)]
        pool_depths = [torch.ones(batch, top_k, dtype=torch.long, device=device)]
        visible = torch.eye(top_k, dtype=torch.bool, device=device).expand(batch, -1, -1)
        committed = torch.tensor([r.length - 1 for r in rows], device=device)
        for depth in range(1, self.k):
            out = self._expand(rows, committed, depth, beam_tokens, beam_hidden, visible)
            child_scores, child_tokens = torch.log_softmax(out.logits.float(), -1).topk(top_k)
            child_scores = (scores[..., None] + child_scores).flatten(1)
            parent_rank = torch.arange(top_k, device=device).repeat_interleave(top_k).expand(batch, -1)
            pool_tokens.append(child_tokens.flatten(1))
            pool_scores.append(child_scores)
            pool_parents.append(beam_ids.gather(1, parent_rank))
            pool_depths.append(torch.full_like(child_scores, depth + 1, dtype=torch.long))
            scores, best = child_scores.topk(top_k)
            first_id = sum(t.shape[1] for t in pool_tokens[:-1])
            beam_ids = first_id + best
            beam_tokens = child_tokens.flatten(1).gather(1, best)
            parents = parent_rank.gather(1, best)
            beam_hidden = out.hidden.gather(1, parents[..., None].expand(-1, -1, out.hidden.shape[-1]))
            own = torch.eye(top_k, dtype=torch.bool, device=device).expand(batch, -1, -1)
            visible = torch.cat([visible.gather(1, parents[..., None].expand(-1, -1, visible.shape[-1])), own], -1)
        return self._select(pool_tokens, pool_scores, pool_parents, pool_depths)

    def _expand(self, rows, committed, depth, beam_tokens, beam_hidden, visible):
        """Run the head on this depth's beams (positions committed + depth, fresh columns)."""
        top_k = self.top_k
        columns = committed[:, None] + (depth - 1) * top_k + torch.arange(top_k, device=committed.device)
        kv_len = int(committed.max()) + depth * top_k
        positions = (committed + depth)[:, None].expand(-1, top_k)
        mask = build_attention_mask(committed, visible, kv_len, positions)
        self.cache.bind([r.slot for r in rows], columns, kv_len)
        return self.head(beam_tokens, positions, hidden=beam_hidden, attention_mask=mask, cache=self.cache)

    def _select(self, tokens, scores, parents, depths) -> Draft:
        """Keep the best `max_draft_tokens` nodes, in pool order (parents before children)."""
        tokens, scores = torch.cat(tokens, 1), torch.cat(scores, 1)
        parents, depths = torch.cat(parents, 1), torch.cat(depths, 1)
        keep = (scores - _DEPTH_TIE_BREAK * depths).topk(self.max_draft_tokens).indices.sort(dim=1).values
        new_index = torch.full_like(tokens, -1)
        new_index.scatter_(1, keep, torch.arange(keep.shape[1], device=keep.device).expand_as(keep))
        old_parents = parents.gather(1, keep)
        new_parents = torch.where(old_parents < 0, -1, new_index.gather(1, old_parents.clamp(min=0)))
        if bool(((old_parents >= 0) & (new_parents < 0)).any()):
            raise RuntimeError("draft tree selection dropped a parent")
        return Draft(tokens=tokens.gather(1, keep), parents=new_parents, depths=depths.gather(1, keep))
