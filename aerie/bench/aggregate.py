"""Cells -> rows: one row per variant x K x concurrency, over the run's repeats.

Every latency and throughput figure of a row is the median over its repeats (one cell each);
`output_throughput_repeats` lists them and `output_throughput_spread` is (max - min) / median,
the noise the report shows. Speculation counters are pooled over the repeats before the rates
are taken (more drafts, a steadier rate). `speedup` is output throughput over the baseline's at
the same concurrency.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import asdict

from aerie.bench.load import CellRun, WindowCounters
from aerie.bench.metrics import cell_metrics, spec_metrics
from aerie.bench.variants import Cell, Variant

IDENTITY = ("variant", "method", "k", "tree", "head", "lookup")
POOLED = {"spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
          "spec_decode_acceptance_length", "spec_decode_acceptance_rate", "spec_decode_per_position_acceptance_rates",
          "spec_decode_accepted_per_position", "tokens_per_step", "decode_steps", "k_histogram"}


def cell_result(cell: Cell, variant: Variant, run: CellRun) -> dict:
    """What an actor returns for one cell: identity, metrics, counters and every request."""
    return asdict(cell) | {
        "variant": variant.label, "method": variant.method, "k": variant.k, "tree": variant.tree, "head": variant.head,
        "lookup": variant.lookup,
        "wall_seconds": run.wall_seconds,
        "metrics": cell_metrics(run.records, run.counters),
        "counters": None if run.counters is None else asdict(run.counters),
        "requests": [asdict(r) for r in run.records],
    }


def pooled_counters(counters: list[dict]) -> WindowCounters | None:
    if not counters:
        return None
    depth = max(len(c["accepted_per_position"]) for c in counters)
    histogram: Counter[int] = Counter()
    for c in counters:
        histogram.update({int(k): n for k, n in c["k_histogram"].items()})
    return WindowCounters(
        steps=sum(c["steps"] for c in counters),
        decode_steps=sum(c["decode_steps"] for c in counters),
        decode_rows=sum(c["decode_rows"] for c in counters),
        decode_tokens=sum(c["decode_tokens"] for c in counters),
        k_histogram=dict(sorted(histogram.items())),
        drafts=sum(c["drafts"] for c in counters),
        draft_tokens=sum(c["draft_tokens"] for c in counters),
        accepted_tokens=sum(c["accepted_tokens"] for c in counters),
        accepted_per_position=[sum(c["accepted_per_position"][i] for c in counters
                                   if i < len(c["accepted_per_position"])) for i in range(depth)],
    )


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def aggregate(cells: list[dict], order: list[str], baseline: str) -> list[dict]:
    """`cells`: what the engine and peer actors return (identity, round, concurrency, metrics,
    counters, wall_seconds); `order`: variant labels in report order."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for cell in cells:
        groups[cell["variant"], cell["concurrency"]].append(cell)
    rows = []
    for (_, concurrency), group in sorted(groups.items(), key=lambda g: (order.index(g[0][0]), g[0][1])):
        group.sort(key=lambda c: c["round"])
        row = {key: group[0][key] for key in IDENTITY} | {"max_concurrency": concurrency, "repeats": len(group)}
        row["requests"] = sum(1 for r in group[0]["requests"] if r["measured"])
        scalar_keys = [k for k, v in group[0]["metrics"].items() if k not in POOLED and not isinstance(v, list | dict)]
        for key in scalar_keys:
            row[key] = _median([c["metrics"][key] for c in group])
        for key in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
            row[key] = int(row[key]) if row[key] is not None else None
        row |= spec_metrics(pooled_counters([c["counters"] for c in group if c["counters"] is not None]))
        repeats = [c["metrics"]["output_throughput"] for c in group]
        row["output_throughput_repeats"] = repeats
        present = [v for v in repeats if v is not None]
        median = row["output_throughput"]
        row["output_throughput_spread"] = (max(present) - min(present)) / median if present and median else None
        row["wall_seconds"] = [c["wall_seconds"] for c in group]
        rows.append(row)
    base = {r["max_concurrency"]: r["output_throughput"] for r in rows if r["variant"] == baseline}
    for row in rows:
        reference = base.get(row["max_concurrency"])
        row["speedup"] = row["output_throughput"] / reference if reference and row["output_throughput"] else None
    return rows
