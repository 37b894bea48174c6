"""`report.md`: what a user reads before deploying. Lossless failures first, then the winner and
why, speedup and throughput per concurrency with the spread over repeats, latencies,
acceptance (tau, per position, K histogram), the peers, and how the run was measured."""

from __future__ import annotations

from aerie.bench.lossless import Verdict
from aerie.bench.plots import PLOTS
from aerie.bench.variants import BASELINE, PEER_METHODS
from aerie.winner import Winner


def _f(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(x) + " |" for x in lines]


def _by_variant(rows: list[dict]) -> dict[str, dict[int, dict]]:
    table: dict[str, dict[int, dict]] = {}
    for row in rows:
        table.setdefault(row["variant"], {})[row["max_concurrency"]] = row
    return table


def lossless_section(verdicts: dict[str, Verdict], baseline: str = BASELINE) -> list[str]:
    failed = [v for v in verdicts.values() if not v.lossless]
    if not failed:
        checked = sum(v.checked for v in verdicts.values())
        return ["## Lossless check: passed", "",
                f"Every variant's output ids equal the baseline's on every prompt ({checked} outputs compared, "
                "temperature 0).", ""]
    lines = ["## LOSSLESS CHECK FAILED", "",
             "These variants produced different tokens than the baseline on the same prompts at temperature 0. "
             "They are disqualified: they can never win, whatever their speed.", ""]
    if baseline in {v.variant for v in failed}:
        lines += [f"The baseline (`{baseline}`) disagrees with its own first outputs in other cells: the engine's "
                  "numerics are not batch-invariant on this device, so every comparison below is suspect.", ""]
    for verdict in failed:
        lines.append(f"- **{verdict.summary()}**")
        for m in verdict.mismatches:
            detail = m.error or f"first difference at token {m.position}: got {m.got}, baseline {m.expected}"
            lines.append(f"  - prompt {m.prompt}, round {m.round}, concurrency {m.concurrency}: {detail}")
    return lines + [""]


def winner_section(winner: Winner, rows: list[dict]) -> list[str]:
    policy = winner.policy
    sla = ", ".join(f"{k.removeprefix('sla_')} <= {policy[k]}" for k in ("sla_p99_tpot_ms", "sla_p99_ttft_ms")
                    if policy.get(k) is not None) or "none"
    lines = ["## Winner", "",
             f"**{winner.metrics.get('variant')}** (method `{winner.method}`, K `{winner.k}`"
             + (", tree" if winner.tree else "") + (", prompt lookup first" if winner.lookup else "")
             + (f", head `{winner.head}`" if winner.head else "") + ")", "",
             f"Why: {policy.get('reason')}. Policy: {policy.get('rule')}; expected concurrency "
             f"{winner.expected_concurrency}; SLA: {sla}.", ""]
    notes = [f"- excluded by the SLA: {variant}: {'; '.join(problems)}"
             for variant, problems in policy.get("sla_excluded", {}).items()]
    if policy.get("disqualified"):
        notes.append(f"- disqualified (not lossless): {', '.join(policy['disqualified'])}")
    lines += (notes + [""] if notes else []) + [
        "Best K per load (`k_by_concurrency`, 0 = no speculation): "
        + ", ".join(f"c={c}: {k}" for c, k in sorted(winner.k_by_concurrency.items())), ""]
    return lines


def speed_section(rows: list[dict], levels: list[int]) -> list[str]:
    table = _by_variant(rows)
    header = ["variant"] + [f"c={c}" for c in levels]
    speed, rate = [], []
    for variant, cells in table.items():
        mark = "" if all(r.get("lossless") is not False for r in cells.values()) else " ✗"
        speed.append([variant + mark] + [_f(cells[c]["speedup"], 2, "x") if c in cells else "" for c in levels])
        rate.append([variant + mark] + [
            f"{_f(cells[c]['output_throughput'])} ±{_f((cells[c]['output_throughput_spread'] or 0) * 50, 0, '%')}"
            if c in cells else "" for c in levels])
    return (["## Speedup over the baseline (output throughput, same concurrency)", ""] + _table(header, speed)
            + ["", "✗: not lossless (disqualified).", "",
               "## Output throughput (tok/s, all clients): median over repeats ± half the spread (max-min)", ""]
            + _table(header, rate) + [""])


def latency_section(rows: list[dict]) -> list[str]:
    header = ["variant", "c", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "E2EL p50",
              "tok/s per user", "req/s"]
    lines = [[r["variant"], str(r["max_concurrency"]), _f(r["median_ttft_ms"]), _f(r["p99_ttft_ms"]),
              _f(r["median_tpot_ms"], 2), _f(r["p99_tpot_ms"], 2), _f(r["median_itl_ms"], 2), _f(r["p99_itl_ms"], 2),
              _f(r["median_e2el_ms"]), _f(r["output_throughput_per_request"]), _f(r["request_throughput"], 2)]
             for r in rows]
    return ["## Latency (ms; medians over repeats)", ""] + _table(header, lines) + [""]


def acceptance_section(rows: list[dict]) -> list[str]:
    spec = [r for r in rows if r.get("spec_decode_num_drafts") or r["k"] == "auto"]
    if not spec:
        return []
    header = ["variant", "c", "tau", "acceptance rate", "per position", "tokens / step", "K per step (histogram)"]
    lines = [[r["variant"], str(r["max_concurrency"]), _f(r["spec_decode_acceptance_length"], 2),
              _f(r["spec_decode_acceptance_rate"], 3),
              " ".join(f"{a:.2f}" for a in r["spec_decode_per_position_acceptance_rates"]),
              _f(r["tokens_per_step"], 2),
              ", ".join(f"{k}: {n}" for k, n in sorted((int(k), n) for k, n in r["k_histogram"].items()))]
             for r in spec]
    return (["## Acceptance over the measured window",
             "", "tau = 1 + accepted / drafts (the bonus token counted); per position = accepted at position i / "
             "drafts; tokens / step = tokens a decoding request gains per engine step.", ""]
            + _table(header, lines) + [""])


def peers_section(rows: list[dict]) -> list[str]:
    peers = {r["method"]: r for r in rows if r["method"] in PEER_METHODS}
    if not peers:
        return []
    engine = [r for r in rows if r["max_concurrency"] == 1 and r["method"] not in PEER_METHODS
              and r.get("lossless") is not False and r.get("output_throughput")]
    best = max(engine, key=lambda r: r["output_throughput"], default=None)
    lines = ["## Peers (Hugging Face `generate`, concurrency 1)", ""]
    header = ["peer", "tok/s", "TTFT p50", "TPOT p50", "lossless"]
    lines += _table(header, [[m, _f(r["output_throughput"]), _f(r["median_ttft_ms"]), _f(r["median_tpot_ms"], 2),
                              str(r.get("lossless"))] for m, r in peers.items()])
    if best is not None:
        lines += [""] + [f"- Aerie's best at concurrency 1 ({best['variant']}, {best['output_throughput']:.1f} tok/s) "
                         f"is {best['output_throughput'] / r['output_throughput']:.2f}x {m}"
                         for m, r in peers.items() if r.get("output_throughput")]
    return lines + [""]


def render_report(rows: list[dict], verdicts: dict[str, Verdict], winner: Winner, facts: dict) -> str:
    """`facts`: what the run measured and how (target, prompts, settings, device, timings)."""
    levels = sorted({r["max_concurrency"] for r in rows})
    lines = [f"# Benchmark: {facts['target']}", "",
             f"{facts['variants']} variants x {len(levels)} concurrency levels x {facts['repeats']} rounds "
             f"({facts['cells']} cells) in {facts['wall_seconds']:.0f} s: {facts['startup_seconds']:.0f} s to start "
             f"the actors (target, heads, calibration), {facts['measuring_seconds']:.0f} s in measured windows. "
             f"{facts['prompts']} prompts from "
             f"`{facts['prompt_source']}`; {facts['requests']} measured requests per cell after "
             f"{facts['warmup']} warm-up; {facts['max_tokens']} new tokens per request, greedy; device "
             f"{facts['device']}.", ""]
    lines += lossless_section(verdicts)
    lines += winner_section(winner, rows)
    lines += speed_section(rows, levels)
    lines += acceptance_section(rows)
    lines += peers_section(rows)
    lines += latency_section(rows)
    lines += ["## Noise", "",
              "Variants run interleaved: every round runs each variant once per concurrency, the order rotated "
              "by one each round, so drift of the machine hits all alike; all variants measure the same prompts "
              "within a round, and each round moves on to the next prompts. The ± column above is half the "
              "spread (max - min) of output throughput over the rounds (machine noise and prompt mix), as a "
              "share of the median; "
              "`output_throughput_repeats` in results.json lists every round. A difference smaller than the "
              "spread is not a result.", ""]
    if facts.get("builds"):
        lines += ["## Engines", ""] + _table(
            ["variant", "target load (s)", "engine build (s)", "of which calibration (s)"],
            [[b["variant"], _f(b.get("load_seconds"), 1), _f(b["build_seconds"], 1),
              _f(b.get("calibration_seconds"), 1)] for b in facts["builds"]],
        ) + [""]
    lines += ["## Plots", ""] + [f"- [{title}]({name})" for name, title in PLOTS.items()]
    lines += ["", "Raw data: `results.json` / `results.parquet` (one row per variant x K x concurrency), "
              "`cells.json` (every request of every cell), `lossless.json`, `winner.json`.", ""]
    return "\n".join(lines)
