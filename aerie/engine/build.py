"""One way to build an engine for a method: the baseline, or a target plus a draft head."""

from __future__ import annotations

from pathlib import Path

from aerie.engine.eagle_tree import EagleTreeProposer
from aerie.engine.engine import Engine, EngineConfig
from aerie.engine.proposers import Eagle3Proposer, NoProposer, PEagleProposer
from aerie.heads import DraftHead
from aerie.heads.io import load_head
from aerie.target import Target

METHODS = ("none", "eagle3", "peagle", "eagle")


def check_method(method: str, head: object | None) -> None:
    """Fail fast, before any model is loaded, on a method the engine does not know or lacks a head for."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: expected one of {', '.join(METHODS)}")
    if method != "none" and head is None:
        raise ValueError(f"method {method} needs a draft head (--head DIR)")


def build_engine(
    target: Target,
    config: EngineConfig,
    method: str = "none",
    head: DraftHead | str | Path | None = None,
    k: int = 0,
    tree_top_k: int = 4,
    tree_tokens: int = 16,
) -> Engine:
    """`head` is a loaded head or a head directory (local or s3://); `k` draft tokens per step
    (the tree depth for `eagle`, whose tree holds at most `tree_tokens` tokens with the root)."""
    check_method(method, head)
    if method == "none":
        return Engine(target, config, NoProposer())
    if not isinstance(head, DraftHead):
        head = load_head(head, target)
    if head.method != method:
        raise ValueError(f"the head is a {head.method} head, not {method}")
    k = k or head.config.speculative_tokens
    slots, capacity = config.max_slots, config.max_len
    if method == "eagle3":
        proposer = Eagle3Proposer(head, k, slots, capacity)
    elif method == "peagle":
        proposer = PEagleProposer(head, k, slots, capacity)
    else:
        proposer = EagleTreeProposer(head, k, slots, capacity, top_k=tree_top_k, total_tokens=tree_tokens)
    return Engine(target, config, proposer)
