"""One way to build an engine for a method: the baseline, prompt lookup, or a target plus a draft head."""

from __future__ import annotations

from pathlib import Path

from aerie.engine.adaptive import adaptive_policy
from aerie.engine.engine import TREE_ON_RECURRENT_TARGET, Engine, EngineConfig
from aerie.engine.hybrid import LOOKUP_TOKENS, LookupFirstProposer
from aerie.engine.ngram import NgramProposer
from aerie.engine.proposers import Eagle3Proposer, PEagleProposer, Proposer
from aerie.engine.tree import TreeProposer
from aerie.heads import DraftHead
from aerie.heads.io import load_head
from aerie.target import Target

METHODS = ("none", "ngram", "eagle3", "peagle", "eagle")
HEAD_METHODS = ("eagle3", "peagle", "eagle")
NGRAM_K = 4
AUTO = "auto"


def check_method(method: str, head: object | None, tree: bool | None = None, lookup: bool = False) -> None:
    """Fail fast, before any model is loaded, on a method the engine does not know, a head-based
    method without a head, a tree for a head that cannot draft one, or prompt lookup first for
    anything but a head's chain."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: expected one of {', '.join(METHODS)}")
    if method in HEAD_METHODS and head is None:
        raise ValueError(f"method {method} needs a draft head (--head DIR)")
    if tree and method not in ("eagle3", "eagle"):
        raise ValueError(f"method {method} cannot draft a tree (eagle3 and eagle can)")
    if lookup and (method not in HEAD_METHODS or tree):
        raise ValueError(f"prompt lookup first (--lookup) goes before a head drafting a chain, not method {method}"
                         + (" drafting a tree" if tree else ""))


def build_proposer(
    target: Target,
    config: EngineConfig,
    method: str = "none",
    head: DraftHead | str | Path | None = None,
    k: int = 0,
    tree: bool | None = None,
    tree_top_k: int = 4,
    tree_tokens: int = 16,
    lookup: bool = False,
    lookup_tokens: int = LOOKUP_TOKENS,
) -> Proposer:
    check_method(method, head, tree, lookup)
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
    recurrent = bool(target.recurrent_mixers)
    if tree and recurrent:
        raise ValueError(TREE_ON_RECURRENT_TARGET)
    if tree if tree is not None else (method == "eagle" and not recurrent):
        return TreeProposer(head, k, slots, capacity, top_k=tree_top_k, total_tokens=tree_tokens)
    if method == "peagle":
        drafter: Proposer = PEagleProposer(head, k, slots, capacity, head.config.draft_passes)
    else:
        drafter = Eagle3Proposer(head, k, slots, capacity)
    return LookupFirstProposer(drafter, slots, lookup_tokens=lookup_tokens) if lookup else drafter


def build_engine(
    target: Target,
    config: EngineConfig,
    method: str = "none",
    head: DraftHead | str | Path | None = None,
    k: int | str = 0,
    tree: bool | None = None,
    tree_top_k: int = 4,
    tree_tokens: int = 16,
    max_k: int = 0,
    calibration_cache: bool = True,
    lookup: bool = False,
) -> Engine:
    """`head` is a loaded head or a head directory (local or s3://); `k` draft tokens per step
    (0: the head's own default; for a tree, its depth), or "auto": adaptive speculation picks K
    from 0..`max_k` (0: the head's default; `NGRAM_K` for prompt lookup) every step
    (`adaptive.py`; calibrates at start, cached unless `calibration_cache` is False). `tree`
    drafts an EAGLE-2 dynamic tree (default for `eagle`; `eagle3` heads can too) of at most
    `tree_tokens` tokens with the root. `lookup`: rows whose context repeats draft by prompt
    lookup, the others with the head (`hybrid.py`). On targets with linear-attention layers (Qwen3-Next) the
    default is a chain and a tree is refused (`TREE_ON_RECURRENT_TARGET` says why)."""
    if k != AUTO and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise ValueError(f"k must be an integer >= 0 or {AUTO!r}, got {k!r}")
    adaptive = k == AUTO
    proposer = build_proposer(
        target, config, method, head, max_k if adaptive else k, tree, tree_top_k, tree_tokens, lookup,
        lookup_tokens=0 if adaptive else LOOKUP_TOKENS,  # the policy prices drafts of K columns
    )
    engine = Engine(target, config, proposer)
    if adaptive and proposer.k:
        engine.policy = adaptive_policy(engine, cache=calibration_cache)
    return engine
