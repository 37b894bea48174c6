"""The winner, and whether it should replace the serving deployment.

Policy: at the expected concurrency, the highest output throughput among engine variants (peers
cannot be deployed) that passed the lossless check and meet the SLA (p99 TPOT, p99 TTFT). When
none meets it, the baseline is chosen (it is lossless by definition) and the policy says so.
`k_by_concurrency` is the per-load table adaptive serving reads: at each level, the K of the
winner's method (same head, same drafting shape, with or without lookup first) with the highest throughput, 0 where the
baseline beats every K or no K of that method is lossless and within the SLA.
"""

from __future__ import annotations

from typing import Any

from aerie.bench.config import BenchConfig, WinnerPolicy
from aerie.bench.variants import BASELINE, INCUMBENT, PEER_METHODS
from aerie.winner import Winner

METRICS = ("output_throughput", "request_throughput", "speedup", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "spec_decode_acceptance_length",
           "spec_decode_acceptance_rate", "output_throughput_spread")


def sla_failures(row: dict, policy: WinnerPolicy) -> list[str]:
    """Why a row breaks the SLA (empty: it meets it)."""
    problems = []
    for key, bound in (("p99_tpot_ms", policy.sla_p99_tpot_ms), ("p99_ttft_ms", policy.sla_p99_ttft_ms)):
        value = row.get(key)
        if bound is not None and (value is None or value > bound):
            problems.append(f"{key} {value if value is None else round(value, 2)} > {bound}")
    return problems


def eligible(row: dict, policy: WinnerPolicy) -> bool:
    return (row["method"] not in PEER_METHODS and row.get("lossless") is True and row.get("output_throughput")
            is not None and not sla_failures(row, policy))


def _as_policy(cfg_or_policy: BenchConfig | WinnerPolicy) -> WinnerPolicy:
    return cfg_or_policy.policy() if isinstance(cfg_or_policy, BenchConfig) else cfg_or_policy


def k_table(rows: list[dict], winner: dict, policy: WinnerPolicy) -> dict[int, int]:
    """At each concurrency: the best static K of the winner's method and head, or 0."""
    table = {}
    for c in sorted({r["max_concurrency"] for r in rows}):
        here = [r for r in rows if r["max_concurrency"] == c and eligible(r, policy)]
        family = [r for r in here if r["method"] == winner["method"] and r["head"] == winner["head"]
                  and r["tree"] == winner["tree"] and r["lookup"] == winner["lookup"]
                  and isinstance(r["k"], int) and r["k"] > 0]
        baseline = [r for r in here if r["method"] == "none"]
        best = max(family + baseline, key=lambda r: r["output_throughput"], default=None)
        table[c] = best["k"] if best is not None and best["method"] != "none" else 0
    return table


def choose_winner(rows: list[dict], cfg_or_policy: BenchConfig | WinnerPolicy, target: str | None = None,
                  report: str | None = None) -> Winner:
    """The winner under the policy (a BenchConfig's, or a WinnerPolicy with `target` given)."""
    policy = _as_policy(cfg_or_policy)
    if target is None:
        if not isinstance(cfg_or_policy, BenchConfig):
            raise ValueError("target: give the target when passing a WinnerPolicy")
        target = cfg_or_policy.target
    levels = sorted({r["max_concurrency"] for r in rows})
    if not levels:
        raise ValueError("no measured rows to choose from")
    expected = policy.expected_concurrency or max(levels)
    if expected not in levels:
        raise ValueError(f"expected_concurrency {expected} was not measured (levels: {levels})")
    at_load = [r for r in rows if r["max_concurrency"] == expected]
    candidates = [r for r in at_load if eligible(r, policy)]
    disqualified = sorted({r["variant"] for r in rows if r.get("lossless") is False})
    excluded = {r["variant"]: sla_failures(r, policy) for r in at_load if r.get("lossless") and sla_failures(r, policy)}
    if candidates:
        best = max(candidates, key=lambda r: r["output_throughput"])
        speedup = f", {best['speedup']:.2f}x the baseline" if best.get("speedup") else ""
        reason = (f"highest output throughput at concurrency {expected} ({best['output_throughput']:.1f} tok/s"
                  f"{speedup}) among {len(candidates)} lossless variant(s) within the SLA")
    else:
        best = next(r for r in at_load if r["variant"] == BASELINE)
        reason = f"no lossless variant meets the SLA at concurrency {expected}: the baseline is kept"
    return Winner(
        target=target,
        method=best["method"],
        head=best["head"],
        k=best["k"],
        tree=best["tree"],
        lookup=best["lookup"],
        k_by_concurrency=k_table(rows, best, policy),
        expected_concurrency=expected,
        policy={"rule": "max output_throughput at expected_concurrency, lossless, within the SLA",
                **policy.model_dump(exclude={"expected_concurrency"}), "reason": reason,
                "disqualified": disqualified, "sla_excluded": excluded},
        metrics={"variant": best["variant"], "max_concurrency": expected}
        | {key: best.get(key) for key in METRICS},
        report=report,
    )


def incumbent_decision(rows: list[dict], winner: Winner, margin: float) -> dict[str, Any]:
    """Promote the new winner only when, measured in the same run, it beats the serving
    deployment ('incumbent') by more than `margin` (a share) in output throughput at the
    expected concurrency. An incumbent that fails the lossless check is always replaced."""
    concurrency = winner.expected_concurrency or max(r["max_concurrency"] for r in rows)
    at_load = {r["variant"]: r for r in rows if r["max_concurrency"] == concurrency}
    new_label = winner.metrics.get("variant")
    new, serving = at_load.get(new_label), at_load.get(INCUMBENT)
    numbers = {
        "concurrency": concurrency,
        "new_variant": new_label,
        "new_output_throughput": new["output_throughput"] if new else None,
        "serving_output_throughput": serving["output_throughput"] if serving else None,
        "margin": margin,
    }
    numbers["gain"] = (numbers["new_output_throughput"] / numbers["serving_output_throughput"] - 1
                       if new and serving and serving["output_throughput"] else None)
    if new_label == INCUMBENT:
        return {"decision": "keep", "reason": "the serving deployment won the benchmark", **numbers}
    if serving is None:
        return {"decision": "promote", "reason": f"no incumbent was measured at concurrency {concurrency}", **numbers}
    if serving.get("lossless") is False:
        return {"decision": "promote", "reason": "the serving deployment failed the lossless check", **numbers}
    if new is None:
        return {"decision": "keep", "reason": f"the winner {new_label!r} has no row at concurrency {concurrency}",
                **numbers}
    gain = numbers["gain"]
    if gain is not None and gain > margin:
        return {"decision": "promote", "reason": f"{new_label} beats the serving deployment by {gain:+.1%} "
                f"(> {margin:.1%}) at concurrency {concurrency}", **numbers}
    shown = "n/a" if gain is None else f"{gain:+.1%}"
    return {"decision": "keep", "reason": f"{new_label} is {shown} against the serving deployment at concurrency "
            f"{concurrency}, within the margin of {margin:.1%}", **numbers}
