"""The report's PNG plots (matplotlib, Agg): throughput and TPOT over concurrency, per-user vs
total throughput (the Pareto view), and acceptance per draft position. Variants that failed the
lossless check are drawn dotted and labelled so."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOTS = {
    "throughput.png": "Output throughput vs concurrency",
    "tpot.png": "TPOT p50 / p99 vs concurrency",
    "pareto.png": "Per-user vs total output throughput",
    "acceptance.png": "Acceptance rate per draft position",
}


def _variants(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["variant"] for r in rows))


def _name(rows: list[dict], variant: str) -> str:
    return variant + ("" if all(r.get("lossless") is not False for r in rows if r["variant"] == variant)
                      else " (NOT lossless)")


def _series(rows: list[dict], variant: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted((r["max_concurrency"], r[key]) for r in rows if r["variant"] == variant and r.get(key) is not None)
    return [c for c, _ in points], [v for _, v in points]


def _colors(n: int) -> list:
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _concurrency_axis(axis, levels: list[int]) -> None:
    axis.set_xscale("log", base=2)
    axis.set_xticks(levels, [str(c) for c in levels])
    axis.set_xlabel("concurrency (max_concurrency clients, closed loop)")
    axis.grid(alpha=0.3)


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def throughput_plot(rows: list[dict], title: str) -> bytes:
    figure, axis = plt.subplots(figsize=(8, 5))
    variants = _variants(rows)
    for variant, color in zip(variants, _colors(len(variants)), strict=True):
        x, y = _series(rows, variant, "output_throughput")
        style = ":" if "NOT" in _name(rows, variant) else "-"
        axis.plot(x, y, style, marker="o", color=color, label=_name(rows, variant))
    _concurrency_axis(axis, sorted({r["max_concurrency"] for r in rows}))
    axis.set(ylabel="output tokens / s (all clients)", title=title)
    axis.legend(fontsize=8, ncol=2)
    return _png(figure)


def tpot_plot(rows: list[dict], title: str) -> bytes:
    figure, axis = plt.subplots(figsize=(8, 5))
    variants = [v for v in _variants(rows) if any(r["variant"] == v and r.get("median_tpot_ms") for r in rows)]
    for variant, color in zip(variants, _colors(len(variants)), strict=True):
        x, p50 = _series(rows, variant, "median_tpot_ms")
        _, p99 = _series(rows, variant, "p99_tpot_ms")
        axis.plot(x, p50, "-", marker="o", color=color, label=f"{_name(rows, variant)} p50")
        axis.plot(x, p99, "--", marker="^", color=color, alpha=0.7, label=f"{variant} p99")
    _concurrency_axis(axis, sorted({r["max_concurrency"] for r in rows}))
    axis.set(ylabel="time per output token (ms)", title=title)
    axis.legend(fontsize=7, ncol=2)
    return _png(figure)


def pareto_plot(rows: list[dict], title: str) -> bytes:
    figure, axis = plt.subplots(figsize=(8, 5))
    variants = _variants(rows)
    points = []
    for variant, color in zip(variants, _colors(len(variants)), strict=True):
        here = sorted((r for r in rows if r["variant"] == variant and r.get("output_throughput")
                       and r.get("output_throughput_per_request")), key=lambda r: r["max_concurrency"])
        x = [r["output_throughput"] for r in here]
        y = [r["output_throughput_per_request"] for r in here]
        axis.plot(x, y, ":" if "NOT" in _name(rows, variant) else "-", marker="o", color=color,
                  label=_name(rows, variant))
        for r, xi, yi in zip(here, x, y, strict=True):
            axis.annotate(f"c={r['max_concurrency']}", (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
            if r.get("lossless") is not False:
                points.append((xi, yi))
    frontier, best_y = [], float("-inf")
    for xi, yi in sorted(points, key=lambda p: -p[0]):
        if yi > best_y:
            frontier.append((xi, yi))
            best_y = yi
    if frontier:
        fx, fy = zip(*sorted(frontier), strict=True)
        axis.plot(fx, fy, color="black", alpha=0.25, linewidth=6, marker="s", markersize=12,
                  label="Pareto frontier (lossless)")
    axis.set(xlabel="total output tokens / s", ylabel="output tokens / s per request (one user)", title=title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    return _png(figure)


def acceptance_plot(rows: list[dict], title: str) -> bytes:
    """Per-position acceptance at the lowest concurrency measured for each speculative variant."""
    figure, axis = plt.subplots(figsize=(8, 5))
    speculative = [v for v in _variants(rows)
                   if any(r["variant"] == v and r.get("spec_decode_per_position_acceptance_rates") for r in rows)]
    for variant, color in zip(speculative, _colors(len(speculative)), strict=True):
        row = min((r for r in rows if r["variant"] == variant and r["spec_decode_per_position_acceptance_rates"]),
                  key=lambda r: r["max_concurrency"])
        rates = row["spec_decode_per_position_acceptance_rates"]
        tau = row.get("spec_decode_acceptance_length")
        axis.plot(range(1, len(rates) + 1), rates, ":" if "NOT" in _name(rows, variant) else "-", marker="o",
                  color=color, label=f"{_name(rows, variant)} (tau {tau:.2f}, c={row['max_concurrency']})")
    if not speculative:
        axis.text(0.5, 0.5, "no speculative variant measured", ha="center", va="center", transform=axis.transAxes)
    axis.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1.05), title=title)
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    return _png(figure)


def render_plots(rows: list[dict], target_name: str) -> dict[str, bytes]:
    """File name -> PNG bytes."""
    engine_and_peers = [r for r in rows if r.get("output_throughput") is not None]
    draw = {"throughput.png": throughput_plot, "tpot.png": tpot_plot, "pareto.png": pareto_plot,
            "acceptance.png": acceptance_plot}
    return {name: draw[name](engine_and_peers, f"{PLOTS[name]} ({target_name})") for name in PLOTS}
