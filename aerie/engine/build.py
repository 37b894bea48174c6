"""One way to build an engine for a method: the baseline, prompt lookup, or a target plus a draft head."""

from __future__ import annotations

from pathlib import Path

from aerie.engine.engine import Engine, EngineConfig
from aerie.engine.ngram import NgramProposer
from aerie.engine.proposers import Eagle3Proposer, PEagleProposer, Proposer
from aerie.engine.tree import TreeProposer
from aerie.heads import DraftHead
from aerie.heads.io import load_head
from aerie.target import Target

METHODS = ("none", "ngram", "eagle3", "peagle", "eagle")
HEAD_METHODS = ("eagle3", "peagle", "eagle")
NGRAM_K = 4


def check_method(method: str, head: object | None, tree: bool | None = None) -> None:
    """Fail fast, before any model is loaded, on a method the engine does not know, a head-based
    method without a head, or a tree for a head that cannot draft one."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: expected one of {', '.join(METHODS)}")
    if method in HEAD_METHODS and head is None:
        raise ValueError(f"method {method} needs a draft head (--head DIR)")
    if tree and method not in ("eagle3", "eagle"):
        raise ValueError(f"method {method} cannot draft a tree (eagle3 and eagle can)")


def build_proposer(
    target: Target,
    config: EngineConfig,
    method: str = "none",
    head: DraftHead | str | Path | None = None,
    k: int = 0,
    tree: bool | None = None,
    tree_top_k: int = 4,
    tree_tokens: int = 16,
) -> Proposer:
    check_method(method, head, tree)
    slots, capacity = config.max_slots, config.max_len
    if method == "none":
        return Proposer()
    if method == "ngram":
        return NgramProposer(k or NGRAM_K, slots, target.device)
    if not isinstance(head, DraftHead):
        head = load_head(head, target)
    if head.method != method:
        raise ValueError(f"the head is a {head.method} head, not {method}")
    k = k or head.config.speculative_tokens
    if tree if tree is not None else method == "eagle":
        return TreeProposer(head, k, slots, capacity, top_k=tree_top_k, total_tokens=tree_tokens)
    if method == "peagle":
        return PEagleProposer(head, k, slots, capacity)
    if method == "eagle3":
        return Eagle3Proposer(head, k, slots, capacity)
    raise ValueError("an EAGLE head drafts a tree (tree=True)")


def build_engine(
    target: Target,
    config: EngineConfig,
    method: str = "none",
    head: DraftHead | str | Path | None = None,
    k: int = 0,
    tree: bool | None = None,
    tree_top_k: int = 4,
    tree_tokens: int = 16,
) -> Engine:
    """`head` is a loaded head or a head directory (local or s3://); `k` draft tokens per step
    (0: the head's own default; for a tree, its depth). `tree` drafts an EAGLE-2 dynamic tree
    (default for `eagle`; `eagle3` heads can too) of at most `tree_tokens` tokens with the root."""
    proposer = build_proposer(target, config, method, head, k, tree, tree_top_k, tree_tokens)
    return Engine(target, config, proposer)
