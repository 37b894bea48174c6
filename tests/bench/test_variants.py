"""The variants of a run and the interleaved order of its cells."""

from __future__ import annotations

from collections import Counter

from aerie.bench.config import BenchConfig
from aerie.bench.variants import eagle_drafts_tree, plan_cells, plan_variants
from aerie.winner import Winner


def test_every_head_at_every_k_plus_baseline_ngram_incumbent_and_peers():
    cfg = BenchConfig(target="t", prompts="p", out="o", heads={"eagle3": "e3", "peagle": "pe", "eagle": "e"},
                      k=[2, "auto"], k_per_method={"peagle": [4]}, peers=True)
    serving = Winner(target="t", method="eagle3", head="old", k=3, lookup=True)
    variants = plan_variants(cfg, serving)
    assert [v.label for v in variants] == [
        "none", "ngram K=4", "eagle3 K=2", "eagle3 K=auto", "eagle3+lookup K=2", "eagle3+lookup K=auto",
        "peagle K=4", "peagle+lookup K=4", "eagle tree K=2", "eagle tree K=auto", "incumbent", "hf_greedy",
        "hf_prompt_lookup"]
    assert [v.lookup for v in variants[4:8]] == [True, True, False, True]
    incumbent = variants[10]
    assert (incumbent.method, incumbent.head, incumbent.k, incumbent.tree, incumbent.lookup) == (
        "eagle3", "old", 3, False, True)
    chains = plan_variants(cfg, None, eagle_tree=False)
    assert [v.label for v in chains[8:12]] == ["eagle K=2", "eagle K=auto", "eagle+lookup K=2", "eagle+lookup K=auto"]
    assert "eagle3+lookup K=2" not in {v.label for v in plan_variants(cfg.model_copy(update={"lookup_first": False}))}


def test_eagle_drafts_a_chain_on_hybrid_targets():
    assert eagle_drafts_tree({"model_type": "llama"})
    assert not eagle_drafts_tree({"layer_types": ["linear_attention", "full_attention"]})


def test_cells_interleave_every_variant_each_round_with_a_rotated_order():
    cfg = BenchConfig(target="t", prompts="p", out="o", heads={"eagle3": "e3"}, k=[2], concurrency=[1, 4],
                      ngram=False, lookup_first=False, peers=True)
    variants = plan_variants(cfg)
    cells = plan_cells(variants, cfg.concurrency, repeats=2)
    assert [c.index for c in cells] == list(range(len(cells)))
    counts = Counter((c.variant, c.concurrency) for c in cells)
    assert counts[("none", 1)] == counts[("none", 4)] == counts[("hf_greedy", 1)] == 2
    assert ("hf_greedy", 4) not in counts
    first = [c.variant for c in cells if c.round == 0 and c.concurrency == 1]
    second = [c.variant for c in cells if c.round == 1 and c.concurrency == 1]
    assert first == ["none", "eagle3 K=2", "hf_greedy", "hf_prompt_lookup"]
    assert second == first[1:] + first[:1]
    assert [c.round for c in cells] == sorted(c.round for c in cells)
