"""What one run measures: the variants (engine configurations and peers) and the order of the cells.

A variant is one engine configuration: the baseline (`none`), prompt lookup (`ngram`), each head
at each K (EAGLE heads draft a tree of that depth), each chain head after prompt lookup
(`eagle3+lookup`: rows whose context repeats draft by lookup, `aerie.engine.hybrid`), adaptive K
(`auto`), and the serving deployment (`incumbent`). Peers are Hugging Face `generate` (greedy, and prompt lookup) at
concurrency 1. A cell is one variant at one concurrency in one round; rounds interleave every
variant (the order rotated each round) so machine drift hits all alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aerie.bench.config import BenchConfig, KValue
from aerie.winner import Winner

BASELINE = "none"
INCUMBENT = "incumbent"
PEER_METHODS = ("hf_greedy", "hf_prompt_lookup")


@dataclass(frozen=True)
class Variant:
    label: str
    """Unique in a run: "none", "ngram K=4", "eagle3 K=3", "eagle3+lookup K=3", "peagle K=auto",
    "eagle tree K=4", "incumbent"."""
    method: str
    k: KValue = 0
    tree: bool = False
    head: str | None = None
    lookup: bool = False
    """Prompt lookup first, the head for the other rows (chains only)."""

    @property
    def is_peer(self) -> bool:
        return self.method in PEER_METHODS

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Cell:
    index: int
    round: int
    concurrency: int
    variant: str


def label(method: str, k: KValue, tree: bool, lookup: bool = False) -> str:
    return f"{method}{'+lookup' if lookup else ''}{' tree' if tree else ''} K={k}"


def eagle_drafts_tree(target_config: dict) -> bool:
    """EAGLE heads draft a tree, except on hybrid targets with linear-attention layers (Qwen3-Next),
    where a tree cannot be verified and the engine drafts a chain."""
    config = target_config.get("text_config") or target_config
    return "linear_attention" not in (config.get("layer_types") or [])


def plan_variants(cfg: BenchConfig, incumbent: Winner | None = None, eagle_tree: bool = True) -> list[Variant]:
    """The engine variants of a run, baseline first; then the peers when `cfg.peers`."""
    variants = [Variant(BASELINE, "none")]
    if cfg.ngram:
        variants += [Variant(label("ngram", k, False), "ngram", k) for k in cfg.ks_for("ngram")]
    for method in ("eagle3", "peagle", "eagle"):
        if method in cfg.heads:
            tree = method == "eagle" and eagle_tree
            variants += [
                Variant(label(method, k, tree), method, k, tree, cfg.heads[method]) for k in cfg.ks_for(method)
            ]
            if cfg.lookup_first and not tree:
                variants += [Variant(label(method, k, False, True), method, k, False, cfg.heads[method], True)
                             for k in cfg.ks_for(method)]
    if incumbent is not None:
        variants.append(
            Variant(INCUMBENT, incumbent.method, incumbent.k, incumbent.tree, incumbent.head, incumbent.lookup)
        )
    if cfg.peers:
        variants += [Variant(method, method) for method in PEER_METHODS]
    return variants


def plan_cells(variants: list[Variant], concurrency: list[int], repeats: int) -> list[Cell]:
    """Round by round, level by level, every variant once (peers only at concurrency 1), the
    variant order rotated by one each round."""
    cells: list[Cell] = []
    for round_ in range(repeats):
        for c in concurrency:
            here = [v for v in variants if c == 1 or not v.is_peer]
            shift = round_ % len(here)
            for variant in here[shift:] + here[:shift]:
                cells.append(Cell(len(cells), round_, c, variant.label))
    return cells
