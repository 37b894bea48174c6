"""Prompt lookup first, the head elsewhere: a row whose last `min_match` tokens occurred before
drafts what followed them (no head forward), every other row drafts with the head.

Code and edits repeat their own context: there a long n-gram match is an almost free draft that
the head, which only sees the target's features, guesses no better. The head stays the row's
proposer of record: rows that drafted by lookup leave it behind by the tokens they committed, and
its next draft for them catches up on those first (one wider head block, as after any step the
head sat out). Greedy drafts from lookup are point masses, so sampled rows stay lossless under
rejection sampling next to the head's sampled drafts.
"""

from __future__ import annotations

import torch

from aerie.engine.ngram import NgramProposer
from aerie.engine.proposers import Draft, HeadProposer, Proposer
from aerie.engine.request import Request

LOOKUP_MIN_MATCH = 3
"""Tokens a suffix must match to draft by lookup: a one- or two-token match in code is most often a
keyword or a bracket, whose continuation the head guesses better."""

LOOKUP_TOKENS = 10
"""The longest draft by lookup, whatever the head's K (Hugging Face's `prompt_lookup_num_tokens`):
a matched continuation is most often right for many tokens, and at low load a wider verification
costs little. On the tiny target's held-out chat prompts (concurrency 1, the demo's EAGLE-3 head
at K = 4) lookup drafts of 10 reached tau 4.41 and 1.88x plain where drafts of K reached 3.44
and 1.69x."""


class LookupFirstProposer(Proposer):
    """`drafter`: the head's chain proposer (EAGLE-3, EAGLE or P-EAGLE); `head` is its head.
    Lookup drafts up to max(K, `lookup_tokens`) tokens (0: K, for a policy that prices K columns)."""

    def __init__(
        self, drafter: HeadProposer, slots: int, min_match: int = LOOKUP_MIN_MATCH, lookup_tokens: int = LOOKUP_TOKENS
    ) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.lookup = NgramProposer(drafter.k, slots, drafter.device, min_n=min_match, max_n=min_match)
        self.name = f"{drafter.name}+lookup"
        self.features = drafter.features
        self.k = drafter.k
        self.lookup_tokens = lookup_tokens
        self.max_draft_tokens = max(drafter.max_draft_tokens, lookup_tokens)
        self.device = drafter.device

    def reset(self, slot: int) -> None:
        self.drafter.reset(slot)
        self.lookup.reset(slot)

    def observe(self, slot: int, features: torch.Tensor) -> None:
        self.drafter.observe(slot, features)

    def catch_up_width(self, rows: list[Request]) -> int:
        return self.drafter.catch_up_width(rows)

    def prefill(self, rows: list[Request]) -> None:
        self.drafter.prefill(rows)

    def propose(self, rows: list[Request], k: int) -> Draft:
        found = [self.lookup.lookup(r.slot, r.all_ids, max(k, self.lookup_tokens)) for r in rows]
        by_head = [i for i, f in enumerate(found) if not f]
        if not by_head:
            return self._assemble(rows, found, k, None, by_head)
        return self._assemble(rows, found, k, self.drafter.propose([rows[i] for i in by_head], k), by_head)

    def _assemble(
        self, rows: list[Request], found: list[list[int]], k: int, drafted: Draft | None, by_head: list[int]
    ) -> Draft:
        """One chain per row: the lookup's (padded) or the head's, with the head's draft
        distributions where it sampled and point masses on the lookup's tokens beside them."""
        width = max([k if by_head else 0, *map(len, found)])  # a block only as wide as its longest draft
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in found], dtype=torch.long, device=self.device)
        lengths = [len(f) for f in found]
        if drafted is None:
            return Draft(tokens=tokens, lengths=lengths)
        index = torch.tensor(by_head, device=self.device)
        tokens[index, :k] = drafted.tokens
        for i in by_head:
            lengths[i] = k
        probs = None
        if drafted.probs is not None:
            shape = (len(rows), width, drafted.probs.shape[-1])
            probs = torch.zeros(shape, dtype=drafted.probs.dtype, device=self.device)
            probs.scatter_(-1, tokens[..., None], 1.0)
            probs[index, :k] = drafted.probs
        return Draft(tokens=tokens, lengths=lengths, probs=probs)
