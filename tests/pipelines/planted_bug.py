"""A verification bug planted in ONE proposer class, for the benchmark's lossless test.

The benchmark test gives every engine actor this module as its worker setup hook (through the
actors' runtime_env); every engine then runs with it, but only engines drafting with P-EAGLE are
affected. The bug is a classic off-by-one of greedy
verification: the first rejected draft token is kept as if it had been accepted."""

from __future__ import annotations

import torch

from aerie.engine.engine import Engine
from aerie.engine.proposers import PEagleProposer


def accept_one_draft_too_many() -> None:
    verify = Engine._verify_chain

    def buggy(self, rows, logits, draft):
        accepted, emitted = verify(self, rows, logits, draft)
        drafter = getattr(self.proposer, "drafter", self.proposer)  # P-EAGLE after prompt lookup too
        if draft is None or not isinstance(drafter, PEagleProposer):
            return accepted, emitted
        rejected = accepted < draft.tokens.shape[1]
        index = torch.arange(len(rows), device=emitted.device)[rejected]
        position = accepted[rejected]
        emitted = emitted.clone()
        emitted[index, position] = draft.tokens[index, position]
        return accepted + rejected.long(), emitted

    Engine._verify_chain = buggy
