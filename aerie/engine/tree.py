"""EAGLE-2's dynamic, context-aware draft tree, drafted by an EAGLE or an EAGLE-3 head.

Each depth expands the `top_k` best nodes so far (by cumulative draft log-probability) into their
`top_k` most likely children, one batched head forward per depth; the tree sent to the target is
the `total_tokens - 1` best nodes of all depths. Nodes are ranked by score, then by depth (a parent
before its children), then by pool index. A child's score is its parent's plus a log-probability <= 0,
so it never ranks above its parent, and the chosen set is ancestor-closed by construction, exactly,
at any magnitude of the scores. Nodes of one depth share a RoPE position but each gets its own
head cache column, and attends to the committed prefix plus its own ancestors.
"""

from __future__ import annotations

import torch

from aerie.engine.masks import build_attention_mask
from aerie.engine.proposers import Draft, HeadProposer, last_positions
from aerie.engine.request import Request
from aerie.heads import DraftHead
from aerie.heads.base import at_positions


class TreeProposer(HeadProposer):
    """`k` is the tree's depth."""

    drafts_tree = True

    def __init__(
        self, head: DraftHead, k: int, slots: int, capacity: int, top_k: int = 4, total_tokens: int = 16
    ) -> None:
        if top_k < 1 or total_tokens < 2:
            raise ValueError(f"need top_k >= 1 and total_tokens >= 2, got {top_k}, {total_tokens}")
        self.name = head.method
        super().__init__(head, k, slots, capacity, draft_columns=k * top_k)
        self.top_k = top_k
        self.total_tokens = total_tokens
        self.max_draft_tokens = self.tree_size(k)

    def tree_size(self, depth: int) -> int:
        """Nodes a tree of `depth` levels sends to the target."""
        return min(self.total_tokens - 1, self.top_k + (depth - 1) * self.top_k * self.top_k)

    @torch.inference_mode()
    def propose(self, rows: list[Request], k: int) -> Draft:
        tokens, features, prefix = self._catch_up_inputs(rows)
        lengths = [len(t) for t in tokens]
        last = last_positions(lengths, self.device)
        out = self._forward_blocks(rows, tokens, features, prefix, last)
        batch, top_k, device = len(rows), self.top_k, self.device
        scores, beam_draft_ids = torch.log_softmax(out.logits[:, 0].float(), -1).topk(top_k)
        beam_tokens = self.head.draft_to_target(beam_draft_ids)
        beam_hidden = at_positions(out.hidden, last).expand(-1, top_k, -1)
        beam_ids = torch.arange(top_k, device=device).expand(batch, -1)
        pool_tokens, pool_scores = [beam_tokens], [scores]
        pool_parents = [torch.full((batch, top_k), -1, dtype=torch.long, device=device)]
        pool_depths = [torch.ones(batch, top_k, dtype=torch.long, device=device)]
        visible = torch.eye(top_k, dtype=torch.bool, device=device).expand(batch, -1, -1)
        slot_ids = [r.slot for r in rows]
        slot_index = self.cache.slot_index(slot_ids)
        committed_list = [r.length - 1 for r in rows]
        committed = torch.tensor(committed_list, device=device)
        parent_rank = torch.arange(top_k, device=device).repeat_interleave(top_k).expand(batch, -1)
        own = torch.eye(top_k, dtype=torch.bool, device=device).expand(batch, -1, -1)
        for depth in range(1, k):
            columns = committed[:, None] + (depth - 1) * top_k + torch.arange(top_k, device=device)
            kv_len = max(committed_list) + depth * top_k
            positions = (committed + depth)[:, None].expand(-1, top_k)
            mask = build_attention_mask(committed, visible, kv_len, positions)
            self.cache.bind(slot_ids, columns, kv_len, slot_index)
            out = self.head(beam_tokens, positions, hidden=beam_hidden, attention_mask=mask, cache=self.cache)
            child_scores, child_draft_ids = torch.log_softmax(out.logits.float(), -1).topk(top_k)
            child_scores = (scores[..., None] + child_scores).flatten(1)
            child_tokens = self.head.draft_to_target(child_draft_ids).flatten(1)
            pool_tokens.append(child_tokens)
            pool_scores.append(child_scores)
            pool_parents.append(beam_ids.gather(1, parent_rank))
            pool_depths.append(torch.full_like(child_tokens, depth + 1))
            scores, best = child_scores.topk(top_k)
            first_id = sum(t.shape[1] for t in pool_tokens[:-1])
            beam_ids = first_id + best
            beam_tokens = child_tokens.gather(1, best)
            parents = parent_rank.gather(1, best)
            beam_hidden = out.hidden.gather(1, parents[..., None].expand(-1, -1, out.hidden.shape[-1]))
            visible = torch.cat([visible.gather(1, parents[..., None].expand(-1, -1, visible.shape[-1])), own], -1)
        return self._select(pool_tokens, pool_scores, pool_parents, pool_depths, self.tree_size(k), k)

    @staticmethod
    def _select(tokens, scores, parents, depths, size: int, max_depth: int) -> Draft:
        """Keep the best `size` nodes, in pool order (parents before children)."""
        tokens, scores = torch.cat(tokens, 1), torch.nan_to_num(torch.cat(scores, 1), nan=-torch.inf)
        parents, depths = torch.cat(parents, 1), torch.cat(depths, 1)
        # The pool is in depth order, so a stable sort by score breaks ties towards shallower nodes.
        keep = scores.argsort(dim=1, descending=True, stable=True)[:, :size].sort(dim=1).values
        new_index = torch.full_like(tokens, -1)
        new_index.scatter_(1, keep, torch.arange(keep.shape[1], device=keep.device).expand_as(keep))
        old_parents = parents.gather(1, keep)
        new_parents = torch.where(old_parents < 0, -1, new_index.gather(1, old_parents.clamp(min=0)))
        return Draft(
            tokens=tokens.gather(1, keep), parents=new_parents, depths=depths.gather(1, keep), max_depth=max_depth
        )
