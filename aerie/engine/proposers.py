"""Proposers: where draft tokens come from.

- `NoProposer`: plain decoding, zero draft tokens (the baseline).
- `Eagle3Proposer`: an EAGLE-3 chain, K batched head steps.
- `PEagleProposer`: P-EAGLE, all K tokens from one head forward.
- `EagleTreeProposer` (`eagle_tree.py`): EAGLE with an EAGLE-2 dynamic draft tree.

A head keeps its own slot KV cache. Its input at position p pairs token t_p with the target's
feature from position p-1, so after every target forward the engine hands the proposer the new
features (`observe`), and the next `propose` first catches the head up on every position the
target has verified since, then drafts. Draft-time cache columns past the verified positions are
overwritten by the next catch-up: rolling the head back is free, as it is for the target. Head
position p lives in cache column p - 1 (position 0 has no preceding feature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aerie.engine.cache import SlotKVCache
from aerie.engine.layout import BlockLayout, pad_rows
from aerie.engine.request import Request
from aerie.engine.sampling import adjusted_probs, draw_uniforms, sample_from
from aerie.heads import DraftHead, PEagleHead
from aerie.target.model import FeatureKind


@dataclass
class Draft:
    """Draft tokens for a batch of decoding slots, `k` target-vocabulary ids per row.

    A chain unless `parents` is given. For chains, `probs` holds the distributions sampled rows drew
    from (None: every draft is greedy). For trees, `parents[b, i]` is the index of node i's parent
    (-1: the last committed token), `depths[b, i]` its depth (1 for the root's children), nodes
    sorted so that parents come first; tree drafts are deterministic candidates.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


class NoProposer:
    """Plain autoregressive decoding: the same engine step with zero draft tokens."""

    name = "none"
    features: FeatureKind | None = None
    max_draft_tokens = 0

    def reset(self, slot: int) -> None:
        pass

    def observe(self, slot: int, features: torch.Tensor | None) -> None:
        pass

    def propose(self, rows: list[Request]) -> Draft:
        return Draft(tokens=torch.zeros(len(rows), 0, dtype=torch.long))


class HeadProposer:
    """What the head-based proposers share: per-slot catch-up state, the head's slot cache, and
    turning draft logits into draft tokens (greedy or sampled with the request's settings)."""

    name = ""

    def __init__(self, head: DraftHead, k: int, slots: int, capacity: int, draft_columns: int | None = None) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1 for method {self.name}, got {k}")
        self.head = head.eval()
        self.k = k
        self.features: FeatureKind = head.feature_kind
        self.max_draft_tokens = k
        self.cache = SlotKVCache(
            head.num_layers,
            slots,
            head.kv_heads,
            head.head_dim,
            capacity + (draft_columns or k),
            head.dtype,
            head.device,
        )
        self._next_position = [1] * slots
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(slots)]

    def reset(self, slot: int) -> None:
        self._next_position[slot] = 1
        self._pending[slot] = []

    def observe(self, slot: int, features: torch.Tensor) -> None:
        self._pending[slot].append(features)

    def _catch_up_inputs(self, rows: list[Request]) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
        """Per row: the tokens at the positions the head has not seen, their preceding target
        features, and the committed head columns before them."""
        tokens, features, prefix = [], [], []
        for request in rows:
            slot, start = request.slot, self._next_position[request.slot]
            tokens.append(request.all_ids[start:])
            features.append(torch.cat(self._pending[slot]))
            prefix.append(start - 1)
            if features[-1].shape[0] != len(tokens[-1]):
                raise RuntimeError(f"slot {slot}: {features[-1].shape[0]} features for {len(tokens[-1])} tokens")
            self._pending[slot] = []
            self._next_position[slot] = request.length
        return tokens, features, prefix

    def _forward(
        self,
        rows: list[Request],
        tokens: list[list[int]],
        prefix: list[int],
        features: list[torch.Tensor] | None = None,
        hidden: torch.Tensor | None = None,
    ):
        device = self.head.device
        layout = BlockLayout.build(prefix, [len(t) for t in tokens], self.cache.scratch, device, position_offset=1)
        width = layout.valid.shape[1]
        if features is not None:
            padded = features[0].new_zeros(len(rows), width, features[0].shape[-1])
            for row, feats in enumerate(features):
                padded[row, : feats.shape[0]] = feats
            features = padded
        self.cache.bind([r.slot for r in rows], layout.write_pos, layout.kv_len)
        return self.head(
            pad_rows(tokens, width, device),
            layout.positions,
            features=features,
            hidden=hidden,
            attention_mask=layout.mask(),
            cache=self.cache,
        )

    def _choose(self, rows: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [B, n, V_draft] -> target ids [B, n] and, unless all rows are greedy, the
        draft distributions over the target vocabulary [B, n, V]."""
        if all(r.params.temperature == 0 for r in rows):
            return self.head.draft_to_target(logits.argmax(-1)), None
        temperature = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device)
        batch, n, vocab = logits.shape
        probs = adjusted_probs(logits.float(), temperature[:, None], top_p[:, None])
        uniforms = draw_uniforms([r.generator for r in rows], n).to(logits.device)
        draft_ids = sample_from(probs.reshape(batch * n, vocab), uniforms.reshape(-1)).view(batch, n)
        target_ids = self.head.draft_to_target(torch.arange(vocab, device=logits.device))
        target_probs = probs.new_zeros(batch, n, self.head.config.vocab_size)
        target_probs[..., target_ids] = probs
        return self.head.draft_to_target(draft_ids), target_probs


def _last_valid(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """values [B, q, ...] -> the entry at each row's last real position [B, ...]."""
    index = torch.tensor(lengths, device=values.device) - 1
    return values[torch.arange(values.shape[0], device=values.device), index]


class Eagle3Proposer(HeadProposer):
    """K sequential head steps batched over slots; each feeds its output hidden state to the next."""

    name = "eagle3"

    @torch.inference_mode()
    def propose(self, rows: list[Request]) -> Draft:
        tokens, features, prefix = self._catch_up_inputs(rows)
        out = self._forward(rows, tokens, prefix, features=features)
        lengths = [len(t) for t in tokens]
        hidden = _last_valid(out.hidden, lengths)[:, None]
        chosen, probs = self._choose(rows, _last_valid(out.logits, lengths)[:, None])
        drafts, draft_probs = [chosen], [probs]
        for step in range(1, self.k):
            step_prefix = [r.length - 1 + step - 1 for r in rows]
            out = self._forward(rows, drafts[-1].tolist(), step_prefix, hidden=hidden)
            hidden = out.hidden
            chosen, probs = self._choose(rows, out.logits)
            drafts.append(chosen)
            draft_probs.append(probs)
        return Draft(
            tokens=torch.cat(drafts, dim=1),
            probs=None if draft_probs[0] is None else torch.cat(draft_probs, dim=1),
        )


class PEagleProposer(HeadProposer):
    """P-EAGLE: the catch-up positions plus K-1 placeholders in one forward give all K drafts."""

    name = "peagle"

    def __init__(self, head: PEagleHead, k: int, slots: int, capacity: int) -> None:
        super().__init__(head, k, slots, capacity)
        self.head: PEagleHead = head

    @torch.inference_mode()
    def propose(self, rows: list[Request]) -> Draft:
        tokens, features, prefix = self._catch_up_inputs(rows)
        real = [len(t) for t in tokens]
        placeholders = self.k - 1
        mask_feature = self.head.mask_hidden.to(features[0].dtype).expand(placeholders, -1)
        tokens = [t + [self.head.mask_token_id] * placeholders for t in tokens]
        features = [torch.cat([f, mask_feature]) for f in features]
        out = self._forward(rows, tokens, prefix, features=features)
        device = out.logits.device
        index = torch.tensor(real, device=device)[:, None] - 1 + torch.arange(self.k, device=device)
        logits = out.logits.gather(1, index[..., None].expand(-1, -1, out.logits.shape[-1]))
        chosen, probs = self._choose(rows, logits)
        return Draft(tokens=chosen, probs=probs)
