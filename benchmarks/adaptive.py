"""Adaptive speculation against plain decoding and every static K, over concurrency.

    python benchmarks/adaptive.py --head eagle3=.aerie/demo/heads/eagle3 [--head peagle=DIR]
        [--target .aerie/targets/tiny-llama] [--concurrency 1,2,4,8,16,32] [--repeats 3]

Three arms on the same prompts (held-out chat prompts of the target's traffic, greedy): plain
decoding, each static K (the best per concurrency is reported), and k="auto". Closed loop: at
concurrency c each arm's engine has c slots and `--requests-per-slot` x c requests (at least
`--min-requests`), so c requests are in flight until the last wave drains.

This box's speed drifts by tens of percent within seconds (plain decoding at 16 slots, in
back-to-back runs of 2.3 s: CV 0.09-0.12, lag-1 autocorrelation 0.5-0.8; process CPU time swings
with it, so it is the CPU's speed, not waiting), and arms run one after another, even each between
two plain runs, read ratios 10-15 % apart from one round to the next. So the arms run
interleaved step by step: every arm's engine holds the same requests and takes one timed step in
turn (`run_interleaved`), and an arm's tokens/s is its tokens over its own steps' seconds. Ratios
are medians over `--repeats` rounds of one round's ratio, after an untimed warm-up of every arm;
the best static K is the one with the highest ratio to plain. Prints a table per head (output
tok/s, best static / plain, adaptive / plain, adaptive / best static), the K histogram of the
adaptive arm at concurrency 1 and 16, the calibration time, and writes `<out>/adaptive.json` and
`<out>/adaptive_<method>.png`.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from protocol import chat_prompts  # noqa: E402

from aerie.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from aerie.engine.build import build_engine  # noqa: E402
from aerie.heads.io import load_head  # noqa: E402
from aerie.target import load_target  # noqa: E402
from aerie.traffic import synthesize  # noqa: E402

Arm = tuple[str, str, int | str]  # name, method, K


def build_arms(target, head, arms: list[Arm], prompts, concurrency: int, max_tokens: int) -> dict[str, Engine]:
    config = EngineConfig(max_slots=concurrency, max_len=max(map(len, prompts)) + max_tokens + 8)
    return {name: build_engine(target, config, method, head, k) for name, method, k in arms}


def run_interleaved(engines: dict[str, Engine], batch: list, max_tokens: int) -> dict[str, dict]:
    """Every engine serves the same requests (closed loop: all queued, the engine's slots
    admitting them), one step each in turn, the order rotating every step, every step timed: an
    arm's tokens/s is its tokens over the sum of its own steps' seconds. Arms run milliseconds
    apart, so a drift in the machine's speed reaches them all alike (garbage is collected before,
    not during)."""
    params = SamplingParams(max_tokens=max_tokens)
    requests = {name: [e.requests[e.add_request(p, params)] for p in batch] for name, e in engines.items()}
    pending = {name: {r.request_id for r in rs} for name, rs in requests.items()}
    seconds = dict.fromkeys(engines, 0.0)
    names = list(engines)
    gc.collect()
    gc.disable()
    try:
        for turn in itertools.count():
            order = [n for n in names[turn % len(names):] + names[:turn % len(names)] if pending[n]]
            if not order:
                break
            for name in order:
                start = time.perf_counter()
                outputs = engines[name].step()
                seconds[name] += time.perf_counter() - start
                pending[name].difference_update(o.request_id for o in outputs if o.finished)
    finally:
        gc.enable()
    results = {}
    for name, engine in engines.items():
        results[name] = {
            "tokens_per_s": sum(len(r.output_ids) for r in requests[name]) / seconds[name],
            "outputs": [r.output_ids for r in requests[name]],
            "k_histogram": dict(engine.stats.k_histogram),
            "tau": engine.spec.acceptance_length,
            "calibration_seconds": getattr(engine.policy, "calibration_seconds", None),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=".aerie/targets/tiny-llama")
    parser.add_argument("--head", action="append", required=True, help="METHOD=DIR (repeatable)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--k", default="1,2,3,4,5", help="static K arms")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=".aerie/bench/adaptive")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, device="cpu")
    exchanges = synthesize(args.prompts, seed=11, tokenizer=target.tokenizer, max_tokens=768, part="eval")
    prompts = chat_prompts(target, exchanges)
    levels = [int(c) for c in args.concurrency.split(",")]

    def requests(concurrency: int) -> int:
        return max(args.min_requests, args.requests_per_slot * concurrency)

    statics = [int(k) for k in args.k.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for spec in args.head:
        method, _, path = spec.partition("=")
        head = load_head(path, target)
        arms = [("plain", "none", 0)] + [(f"K={k}", method, k) for k in statics] + [("auto", method, "auto")]
        warm = build_arms(target, head, arms, prompts, levels[-1], 8)  # untimed: first runs are ~20 % slow
        run_interleaved(warm, prompts[: levels[-1]], 8)
        cells: dict[tuple[int, str], list[dict]] = defaultdict(list)
        for repeat in range(args.repeats):
            for c in levels:
                engines = build_arms(target, head, arms, prompts, c, args.max_tokens)
                batch = [prompts[i % len(prompts)] for i in range(requests(c))]
                results = run_interleaved(engines, batch, args.max_tokens)
                for name, result in results.items():
                    cells[c, name].append(result)
                plain = results["plain"]["tokens_per_s"]
                print(f"{method} round {repeat + 1}/{args.repeats} concurrency {c}: plain {plain:.0f} tok/s, "
                      + " ".join(f"{n} {r['tokens_per_s'] / plain:.2f}" for n, r in results.items() if n != "plain"),
                      flush=True)
        ratios = {
            (c, name): [r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(runs, cells[c, "plain"], strict=True)]
            for (c, name), runs in cells.items()
        }
        rows = []
        print(f"\n{method} ({path}), target {args.target}, {args.max_tokens} tokens per request, greedy, "
              f"median of {args.repeats} rounds")
        print(f"{'c':>3} {'plain':>8} {'best static':>14} {'best/plain':>10} {'auto':>8} {'auto/plain':>10} "
              f"{'auto/best':>9}  lossless")
        for c in levels:
            rate = {name: statistics.median(r["tokens_per_s"] for r in cells[c, name]) for name, _, _ in arms}
            over_plain = {name: statistics.median(ratios[c, name]) for name, _, _ in arms[1:]}
            best = max((name for name, _, _ in arms[1:-1]), key=over_plain.__getitem__)
            auto_over_best = statistics.median(a / b for a, b in zip(ratios[c, "auto"], ratios[c, best], strict=True))
            plain_out = cells[c, "plain"][0]["outputs"]
            lossless = all(r["outputs"] == plain_out for name, _, _ in arms for r in cells[c, name])
            histogram = sum((Counter(r["k_histogram"]) for r in cells[c, "auto"]), Counter())
            rows.append({
                "concurrency": c, "plain": rate["plain"], "best_static": best, "best_static_rate": rate[best],
                "best_static_over_plain": over_plain[best], "auto": rate["auto"], "auto_over_plain": over_plain["auto"],
                "auto_over_best": auto_over_best, "static": {n: rate[n] for n, _, _ in arms[1:-1]},
                "ratios_by_round": {n: ratios[c, n] for n, _, _ in arms[1:]},
                "k_histogram": {int(k): v for k, v in sorted(histogram.items())}, "lossless": lossless,
            })
            print(f"{c:3d} {rate['plain']:8.1f} {best:>5} {rate[best]:8.1f} {over_plain[best]:9.2f}x "
                  f"{rate['auto']:8.1f} {over_plain['auto']:9.2f}x {auto_over_best:8.2f}x  {lossless}")
        first = {c: cells[c, "auto"][0]["calibration_seconds"] for c in levels}
        cached = [r["calibration_seconds"] for c in levels for r in cells[c, "auto"][1:]]
        for row in rows:
            if row["concurrency"] in (1, 16):
                print(f"K histogram of auto at concurrency {row['concurrency']}: {row['k_histogram']}")
        print("calibration (s), first run per engine shape: "
              + ", ".join(f"{first[c]:.2f} at {c} slots" for c in levels)
              + (f"; cached: median {statistics.median(cached):.3f}" if cached else ""))
        report[method] = {"rows": rows, "calibration_seconds": first}
        figure, axis = plt.subplots(figsize=(7, 4.5))
        axis.plot(levels, [r["plain"] for r in rows], "o-", label="plain decoding")
        axis.plot(levels, [r["best_static_rate"] for r in rows], "s--", label="best static K (per concurrency)")
        axis.plot(levels, [r["auto"] for r in rows], "^-", label='adaptive (k="auto")')
        axis.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="output tokens / s",
                 title=f"{method}: adaptive speculation vs plain and the best static K")
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.grid(alpha=0.3)
        axis.legend()
        figure.tight_layout()
        figure.savefig(out / f"adaptive_{method}.png", dpi=120)
    (out / "adaptive.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'adaptive.json'} and the plots")


if __name__ == "__main__":
    main()
