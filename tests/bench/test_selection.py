"""Winner selection and the promote/keep decision on hand-made rows."""

from __future__ import annotations

import pytest

from aerie.bench.config import WinnerPolicy
from aerie.bench.selection import choose_winner, incumbent_decision


def row(variant, method, k, c, tput, lossless=True, tpot=5.0, ttft=20.0, head=None, tree=False, lookup=False):
    return {"variant": variant, "method": method, "k": k, "tree": tree, "head": head, "lookup": lookup,
            "max_concurrency": c,
            "output_throughput": tput, "lossless": lossless, "p99_tpot_ms": tpot, "p99_ttft_ms": ttft,
            "speedup": None}


def sweep() -> list[dict]:
    rows = []
    for c, base, k2, k4, pe in ((1, 100, 150, 170, 200), (8, 400, 440, 380, 900)):
        rows += [row("none", "none", 0, c, base), row("eagle3 K=2", "eagle3", 2, c, k2, head="e3"),
                 row("eagle3 K=4", "eagle3", 4, c, k4, head="e3", tpot=9.0),
                 row("peagle K=4", "peagle", 4, c, pe, lossless=False, head="pe"),
                 row("hf_greedy", "hf_greedy", 0, 1, 999)][: 5 if c == 1 else 4]
    for r in rows:
        base = next(b for b in rows if b["variant"] == "none" and b["max_concurrency"] == r["max_concurrency"])
        r["speedup"] = r["output_throughput"] / base["output_throughput"]
    return rows


def test_the_fastest_lossless_variant_at_the_expected_load_wins_peers_and_failures_never_do():
    winner = choose_winner(sweep(), WinnerPolicy(expected_concurrency=1), target="t", report="r.md")
    assert (winner.method, winner.k, winner.head, winner.target) == ("eagle3", 4, "e3", "t")
    assert winner.metrics["variant"] == "eagle3 K=4" and winner.report == "r.md"
    assert winner.policy["disqualified"] == ["peagle K=4"]
    assert winner.k_by_concurrency == {1: 4, 8: 2}


def test_the_sla_excludes_and_the_default_load_is_the_highest():
    winner = choose_winner(sweep(), WinnerPolicy(expected_concurrency=1, sla_p99_tpot_ms=8.0), target="t")
    assert winner.metrics["variant"] == "eagle3 K=2"
    assert "eagle3 K=4" in winner.policy["sla_excluded"] and winner.k_by_concurrency == {1: 2, 8: 2}
    assert choose_winner(sweep(), WinnerPolicy(), target="t").expected_concurrency == 8


def test_k_zero_where_the_baseline_beats_every_k():
    rows = [r for r in sweep() if r["variant"] != "eagle3 K=2"]
    winner = choose_winner(rows, WinnerPolicy(expected_concurrency=1), target="t")
    assert winner.k_by_concurrency == {1: 4, 8: 0}


def test_a_head_after_prompt_lookup_wins_as_its_own_family():
    rows = sweep() + [row("eagle3+lookup K=2", "eagle3", 2, 1, 190, head="e3", lookup=True),
                      row("eagle3+lookup K=2", "eagle3", 2, 8, 350, head="e3", lookup=True),
                      row("eagle3+lookup K=4", "eagle3", 4, 1, 250, head="e3", lookup=True)]
    winner = choose_winner(rows, WinnerPolicy(expected_concurrency=1), target="t")
    assert (winner.method, winner.k, winner.lookup) == ("eagle3", 4, True)
    assert winner.k_by_concurrency == {1: 4, 8: 0}  # the lookup family's, not eagle3 K=2's 440 at 8


def test_when_nothing_meets_the_sla_the_baseline_is_kept_and_says_why():
    winner = choose_winner(sweep(), WinnerPolicy(expected_concurrency=1, sla_p99_ttft_ms=1.0), target="t")
    assert winner.method == "none" and winner.k == 0 and "no lossless variant meets the SLA" in winner.policy["reason"]


def with_incumbent(tput: float, lossless: bool = True) -> list[dict]:
    return sweep() + [row("incumbent", "eagle3", 3, 8, tput, lossless=lossless, head="old")]


@pytest.mark.parametrize(("serving", "lossless", "decision"), [
    (430.0, True, "promote"),  # the new winner (440 tok/s) gains 2.3 % > the 2 % margin
    (435.0, True, "keep"),  # 1.1 %
    (440.0, True, "keep"),  # a tie
    (900.0, False, "promote"),
])
def test_promote_only_beyond_the_margin_and_never_keep_a_lossy_incumbent(serving, lossless, decision):
    rows = with_incumbent(serving, lossless)
    winner = choose_winner(rows, WinnerPolicy(expected_concurrency=8), target="t")
    assert winner.metrics["variant"] == "eagle3 K=2"
    result = incumbent_decision(rows, winner, margin=0.02)
    assert result["decision"] == decision, result
    assert result["new_output_throughput"] == 440 and result["serving_output_throughput"] == serving
    if lossless:
        assert result["gain"] == pytest.approx(440 / serving - 1)


def test_an_incumbent_that_wins_is_kept():
    rows = with_incumbent(1000.0)
    winner = choose_winner(rows, WinnerPolicy(expected_concurrency=8), target="t")
    assert winner.metrics["variant"] == "incumbent" and winner.head == "old" and winner.k == 3
    assert incumbent_decision(rows, winner, 0.03)["decision"] == "keep"
