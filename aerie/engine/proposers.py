"""Proposers: where draft tokens come from.

- `Proposer`: the interface, and as such plain decoding with zero draft tokens (the baseline).
- `Eagle3Proposer`: a chain of K batched head steps (an EAGLE-3 head, or an EAGLE head where a
  tree cannot be verified).
- `PEagleProposer`: P-EAGLE, all K tokens from one head forward.
- `TreeProposer` (`tree.py`): an EAGLE or EAGLE-3 head drafting an EAGLE-2 dynamic tree.
- `NgramProposer` (`ngram.py`): prompt lookup, no head at all.

The engine asks for `k` tokens each step (at most the proposer's `k`; adaptive speculation picks
fewer, or none). A head keeps its own slot KV cache. Its input at position p pairs token t_p with
the target's feature from position p-1, so after every target forward the engine hands the
proposer the new features of the committed positions (`observe`), and the next `propose` first
catches the head up on every position the target has verified since, then drafts. While the engine
drafts, the head also passes over each prefill chunk right after the target (`prefill`), so a new
row's first draft does not start with its whole prompt, padded to the longest catch-up in the
batch. Draft-time cache columns past the verified positions are overwritten by the next catch-up:
rolling the head back is free, as it is for the target. Head position p lives in cache column p - 1 (position 0
has no preceding feature). A catch-up only counts once its step succeeds (`observe`), so a step
that fails can be run again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from aerie.engine.cache import SlotKVCache
from aerie.engine.layout import BlockLayout, pad_rows
from aerie.engine.request import Request
from aerie.engine.sampling import adjusted_probs, draw_uniforms, request_settings, sample_from
from aerie.heads import DraftHead, PEagleHead
from aerie.heads.base import HeadOutput, at_positions
from aerie.target.model import FeatureKind
from aerie.target.segmented_attention import Segment, segments_on


@dataclass
class Draft:
    """Draft tokens for a batch of decoding slots, `k` target-vocabulary ids per row.

    A chain unless `parents` is given. `lengths` (host ints) are the real drafts per row when rows
    differ (the rest is padding, never accepted). For chains, `probs` holds the distributions sampled
    rows drew from (None: every draft is greedy). For trees, `parents[b, i]` is the index of node
    i's parent (-1: the last committed token), `depths[b, i]` its depth (1 for the root's children),
    nodes sorted so that parents come first, `max_depth` the deepest level; tree drafts are
    deterministic candidates.
    """

    tokens: torch.Tensor
    lengths: list[int] | None = None
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    max_depth: int = 0

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    def row_lengths(self) -> list[int]:
        return self.lengths if self.lengths is not None else [self.k] * self.tokens.shape[0]


class Proposer:
    """The interface the engine drives; as such, plain autoregressive decoding (no drafts)."""

    name = "none"
    features: FeatureKind | None = None
    k = 0
    """The configured draft length (a tree's depth)."""
    max_draft_tokens = 0
    """The most cache columns one step drafts past the committed tokens."""
    drafts_tree = False

    def reset(self, slot: int) -> None:
        """A new request starts in `slot`."""

    def observe(self, slot: int, features: torch.Tensor) -> None:
        """The target's features at the positions the last step committed in `slot`."""

    def propose(self, rows: list[Request], k: int) -> Draft:
        raise NotImplementedError(f"{type(self).__name__} drafts nothing")

    def catch_up_width(self, rows: list[Request]) -> int:
        """The most positions a row's next draft must first catch up on (0: nothing to catch up)."""
        return 0

    def prefill(self, rows: list[Request]) -> None:
        """Catch up on the prompt tokens the target has just prefilled in `rows` (observed)."""


class HeadProposer(Proposer):
    """What the head-based proposers share: per-slot catch-up state, the head's slot cache, and
    turning draft logits into draft tokens (greedy or sampled with the request's settings)."""

    def __init__(self, head: DraftHead, k: int, slots: int, capacity: int, draft_columns: int | None = None) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1 for method {self.name}, got {k}")
        head.check_span(capacity + (draft_columns or k), f"an engine of max_len {capacity} drafting {k} tokens")
        self.head = head.eval()
        self.k = k
        self.features = head.feature_kind
        self.max_draft_tokens = k
        self.device = head.device
        self.cache = SlotKVCache(
            head.num_layers,
            slots,
            head.kv_heads,
            head.head_dim,
            capacity + (draft_columns or k),
            head.dtype,
            head.device,
        )
        self._draft_vocab_ids = head.draft_to_target(torch.arange(head.draft_vocab_size, device=self.device))
        self._seen = [1] * slots
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(slots)]
        self._staged: dict[int, int] = {}

    def reset(self, slot: int) -> None:
        self._seen[slot] = 1
        self._pending[slot] = []
        self._staged.pop(slot, None)

    def observe(self, slot: int, features: torch.Tensor) -> None:
        caught_up = self._staged.pop(slot, None)
        if caught_up is not None:
            self._pending[slot] = []
            self._seen[slot] = caught_up
        self._pending[slot].append(features)

    def catch_up_width(self, rows: list[Request]) -> int:
        return max(request.length - self._seen[request.slot] for request in rows)

    @torch.inference_mode()
    def prefill(self, rows: list[Request]) -> None:
        """One head forward over the prompt positions each row's prefill has given features for:
        the same rows and block widths as the target's prefill, so a draft that follows starts a
        step or two behind instead of catching up on a whole prompt padded to the longest one."""
        batch: list[tuple[Request, torch.Tensor]] = []
        for request in rows:
            features = self._pending_features(request.slot)
            if features.shape[0] > 1:  # the newest feature pairs with a token still to come
                batch.append((request, features))
        if not batch:
            return
        ready = [request for request, _ in batch]
        starts = [self._seen[request.slot] for request in ready]
        tokens = [r.prompt_ids[start : start + f.shape[0] - 1] for start, (r, f) in zip(starts, batch, strict=True)]
        self._forward_blocks(
            ready, tokens, [f[:-1] for _, f in batch], [start - 1 for start in starts],
            last_positions([len(t) for t in tokens], self.device),
        )
        for (request, features), block in zip(batch, tokens, strict=True):
            self._seen[request.slot] += len(block)
            self._pending[request.slot] = [features[-1:]]

    def _pending_features(self, slot: int) -> torch.Tensor:
        """The target features observed in `slot` since the head's last pass, as one tensor."""
        pending = self._pending[slot]
        return pending[0] if len(pending) == 1 else torch.cat(pending)

    def _catch_up_inputs(self, rows: list[Request]) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
        """Per row: the tokens at the positions the head has not seen, their preceding target
        features, and the committed head columns before them. Staged until the step succeeds."""
        tokens, features, prefix = [], [], []
        for request in rows:
            slot, start = request.slot, self._seen[request.slot]
            tokens.append(request.tokens_from(start))
            features.append(self._pending_features(slot))
            prefix.append(start - 1)
            if features[-1].shape[0] != len(tokens[-1]):
                raise RuntimeError(f"slot {slot}: {features[-1].shape[0]} features for {len(tokens[-1])} tokens")
        self._staged = {request.slot: request.length for request in rows}
        return tokens, features, prefix

    def _forward_blocks(
        self,
        rows: list[Request],
        tokens: list[list[int]] | torch.Tensor,
        features: list[torch.Tensor] | torch.Tensor,
        prefix: list[int],
        logits_at: torch.Tensor,
    ) -> HeadOutput:
        """One head forward over a block of new positions per row (target features as input), with
        logits at the block positions `logits_at` [B, n] only. A block given as tensors ([B, n]
        ids, [B, n, 3H] features) is as wide in every row."""
        lengths = [len(t) for t in tokens] if isinstance(tokens, list) else [tokens.shape[1]] * len(rows)
        layout = BlockLayout.build(prefix, lengths, self.cache.scratch, self.device, position_offset=1)
        width = layout.valid.shape[1]
        segments = segments_on(self.device, [p + n for p, n in zip(prefix, lengths, strict=True)])
        self.cache.bind([r.slot for r in rows], layout.write_pos, layout.kv_len, segments=segments, by_runs=True)
        return self.head(
            pad_rows(tokens, width, self.device) if isinstance(tokens, list) else tokens,
            layout.positions,
            features=pad_sequence(features, batch_first=True) if isinstance(features, list) else features,
            attention_mask=layout.mask(),
            cache=self.cache,
            logits_at=logits_at,
        )

    def _chain_step(
        self,
        slot_ids: list[int],
        slot_index: torch.Tensor,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        columns: torch.Tensor,
        kv_len: int,
        segments: list[Segment] | None,
    ) -> HeadOutput:
        """One drafting step past the catch-up: one token per row ([B, 1] target ids) with the head's
        previous hidden state, written at head cache `columns` [B], seeing every column up to its own
        (`kv_len` columns in all, or each run of `segments` its own)."""
        write = columns[:, None]
        mask = torch.arange(kv_len, device=self.device)[None, None, None, :] <= write[:, None, :, None]
        self.cache.bind(slot_ids, write, kv_len, slot_index, segments=segments, by_runs=True)
        return self.head(tokens, write + 1, hidden=hidden, attention_mask=mask, cache=self.cache)

    def _choose(self, rows: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [B, n, V_draft] -> target ids [B, n] and, unless all rows are greedy, the
        draft distributions over the target vocabulary [B, n, V]."""
        if all(r.params.temperature == 0 for r in rows):
            return self.head.draft_to_target(logits.argmax(-1)), None
        temperature, top_p = request_settings(
            [r.params.temperature for r in rows], [r.params.top_p for r in rows], logits.device
        )
        batch, n, vocab = logits.shape
        probs = adjusted_probs(logits.float(), temperature[:, None], top_p[:, None])
        uniforms = draw_uniforms([r.generator for r in rows], n, logits.device)
        draft_ids = sample_from(probs.reshape(batch * n, vocab), uniforms.reshape(-1)).view(batch, n)
        target_probs = probs.new_zeros(batch, n, self.head.config.vocab_size)
        target_probs[..., self._draft_vocab_ids] = probs
        return self.head.draft_to_target(draft_ids), target_probs


def last_positions(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[B, 1]: each row's last real position in a block, as `logits_at`."""
    return torch.tensor(lengths, device=device)[:, None] - 1


class Eagle3Proposer(HeadProposer):
    """K sequential head steps batched over slots; each feeds its output hidden state to the next.
    Any head drafts a chain this way (EAGLE-3's, or EAGLE's: `name` is the head's method)."""

    def __init__(self, head: DraftHead, k: int, slots: int, capacity: int) -> None:
        self.name = head.method
        super().__init__(head, k, slots, capacity)

    @torch.inference_mode()
    def propose(self, rows: list[Request], k: int) -> Draft:
        tokens, features, prefix = self._catch_up_inputs(rows)
        lengths = [len(t) for t in tokens]
        last = last_positions(lengths, self.device)
        out = self._forward_blocks(rows, tokens, features, prefix, last)
        hidden = at_positions(out.hidden, last)
        chosen, probs = self._choose(rows, out.logits)
        drafts, draft_probs = [chosen], [probs]
        if k > 1:
            slot_ids = [r.slot for r in rows]
            slot_index = self.cache.slot_index(slot_ids)
            columns = torch.tensor([r.length - 1 for r in rows], device=self.device)
            longest = max(r.length for r in rows)
            # Every row reads one more column each step, which leaves the cheapest cut as it is.
            runs = segments_on(self.device, [r.length for r in rows]) or []
            for step in range(1, k):
                segments = [(a, b, n + step - 1) for a, b, n in runs] or None
                out = self._chain_step(
                    slot_ids, slot_index, chosen, hidden, columns + step - 1, longest + step - 1, segments
                )
                hidden = out.hidden
                chosen, probs = self._choose(rows, out.logits)
                drafts.append(chosen)
                draft_probs.append(probs)
        return Draft(
            tokens=torch.cat(drafts, dim=1),
            probs=None if draft_probs[0] is None else torch.cat(draft_probs, dim=1),
        )


class PEagleProposer(HeadProposer):
    """P-EAGLE: the catch-up positions plus K-1 placeholders in one forward give all K drafts.

    With `passes` > 1, each further pass runs the placeholders again, each reading the token the
    pass before drafted at the position before it instead of the mask token (a head trained with
    fed chains, `peagle_fed_ratio`): after P passes the first P drafts are a chain, and pass P
    runs only the K-P+1 placeholders whose input a pass before it changed. A sampled row's draft i
    comes from the last distribution it was drawn from, which is what verification divides by."""

    name = "peagle"

    def __init__(self, head: PEagleHead, k: int, slots: int, capacity: int, passes: int = 1) -> None:
        if passes < 1:
            raise ValueError(f"P-EAGLE drafts in at least one pass, got passes={passes}")
        super().__init__(head, k, slots, capacity)
        self.head: PEagleHead = head
        self.passes = passes

    @torch.inference_mode()
    def propose(self, rows: list[Request], k: int) -> Draft:
        tokens, features, prefix = self._catch_up_inputs(rows)
        real = [len(t) for t in tokens]
        placeholders = k - 1
        mask_feature = self.head.mask_hidden.to(features[0].dtype).expand(placeholders, -1)
        tokens = [t + [self.head.mask_token_id] * placeholders for t in tokens]
        features = [torch.cat([f, mask_feature]) for f in features]
        index = torch.tensor(real, device=self.device)[:, None] - 1 + torch.arange(k, device=self.device)
        out = self._forward_blocks(rows, tokens, features, prefix, index)
        chosen, probs = self._choose(rows, out.logits)
        for fixed in range(1, min(self.passes, k)):
            # Drafts 1..fixed are final, and the placeholders reading drafts 1..fixed-1 read the
            # same in the pass before: only the later ones (and their cache columns) run again.
            width = k - fixed
            out = self._forward_blocks(
                rows, chosen[:, fixed - 1 : -1], mask_feature[:width].expand(len(rows), -1, -1),
                [p + n + fixed - 1 for p, n in zip(prefix, real, strict=True)],
                torch.arange(width, device=self.device).expand(len(rows), -1),
            )
            refined, refined_probs = self._choose(rows, out.logits)
            chosen = torch.cat([chosen[:, :fixed], refined], dim=1)
            probs = None if probs is None else torch.cat([probs[:, :fixed], refined_probs], dim=1)
        return Draft(tokens=chosen, probs=probs)
