"""Speculative decoding vs the baseline on the tiny target: greedy, concurrency 1, same prompts.

    python benchmarks/speculation.py --target .aerie/targets/tiny-llama \
        --head eagle3=.aerie/bench/head_training/eagle3 --head peagle=.aerie/bench/head_training/peagle \
        --head eagle=.aerie/bench/head_training/eagle [--k 3,4,5] [--prompts 12] [--max-tokens 128]

For every variant (method x K) it prints tokens/s relative to the baseline, tau (mean acceptance length, bonus
token counted), per-position acceptance, the measured forward costs, and the ideal speedup those
imply: tau x t_target(1) / (t_target(K+1) + t_draft). measured/ideal below 1 is overhead outside
the two forwards (sampling, verification, bookkeeping). Variants run interleaved, round after
round, and each figure is the median over rounds. It also checks that every variant's tokens
equal the baseline's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from head_training import stdlib_prompts

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.heads.io import load_head
from aerie.target import load_target


@dataclass
class Timings:
    """Wall time of every target forward (by number of new tokens) and every draft proposal."""

    target: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    draft: list[float] = field(default_factory=list)

    def wrap(self, engine) -> None:
        forward, propose = engine.target.forward, engine.proposer.propose

        def timed_forward(input_ids, *args, **kwargs):
            start = time.perf_counter()
            out = forward(input_ids, *args, **kwargs)
            self.target[input_ids.shape[1]].append(time.perf_counter() - start)
            return out

        def timed_propose(rows, k):
            start = time.perf_counter()
            out = propose(rows, k)
            self.draft.append(time.perf_counter() - start)
            return out

        engine.target.forward, engine.proposer.propose = timed_forward, timed_propose


def run_variant(target, method, head, k, prompts, max_tokens, tree_tokens):
    engine = build_engine(
        target, EngineConfig(max_slots=1, max_len=2048), method, head, k, tree_tokens=tree_tokens
    )
    timings = Timings()
    timings.wrap(engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = [engine.generate([p], params)[0].token_ids for p in prompts]
    seconds = time.perf_counter() - start
    del engine.target.forward  # drop the instance attribute: the shared target is unwrapped
    verify_width = 1 if method == "none" else (tree_tokens if method == "eagle" else k + 1)
    return {
        "tokens_per_s": sum(map(len, outputs)) / seconds,
        "tau": engine.spec.acceptance_length or 1.0,
        "per_position": engine.spec.per_position_acceptance,
        "t_verify": statistics.median(timings.target[verify_width]),
        "t_draft": statistics.median(timings.draft) if method != "none" else 0.0,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=".aerie/targets/tiny-llama")
    parser.add_argument("--head", action="append", default=[], help="METHOD=DIR, repeatable")
    parser.add_argument("--k", default="5", help="chain lengths (and tree depths) to compare, e.g. 3,4,5")
    parser.add_argument("--tree-tokens", type=int, default=12, help="EAGLE-2 tree size with the root")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    target = load_target(args.target)
    heads = {}
    for spec in args.head:
        method, _, path = spec.partition("=")
        heads[method] = load_head(path, target)
    _, prompts = stdlib_prompts(0, args.prompts, seed=0)
    depths = [int(k) for k in args.k.split(",")]
    variants = [("none", 0)] + [(method, k) for method in heads for k in depths]
    rounds = defaultdict(list)
    for _ in range(args.rounds):
        for method, k in variants:
            rounds[method, k].append(
                run_variant(target, method, heads.get(method), k, prompts, args.max_tokens, args.tree_tokens)
            )

    def median(variant, key):
        return statistics.median(r[key] for r in rounds[variant])

    baseline_rate, t_target_1 = median(("none", 0), "tokens_per_s"), median(("none", 0), "t_verify")
    print(f"target {args.target}, greedy, concurrency 1, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"median of {args.rounds} interleaved rounds")
    print(f"baseline: {baseline_rate:.1f} tok/s, t_target(1) = {t_target_1 * 1e3:.2f} ms")
    print(f"{'method':8} {'K':>2} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'t_verify':>9} {'t_draft':>8} "
          f"{'ideal':>6} {'meas/ideal':>10}  lossless  per-position acceptance")
    speedups = {}
    for variant in variants[1:]:
        rate, tau = median(variant, "tokens_per_s"), median(variant, "tau")
        t_verify, t_draft = median(variant, "t_verify"), median(variant, "t_draft")
        ideal = tau * t_target_1 / (t_verify + t_draft)
        speedups[variant] = rate / baseline_rate
        lossless = all(r["outputs"] == b["outputs"] for r, b in zip(rounds[variant], rounds["none", 0], strict=True))
        per_position = " ".join(f"{a:.2f}" for a in rounds[variant][-1]["per_position"])
        print(
            f"{variant[0]:8} {variant[1]:2} {rate:8.1f} {speedups[variant]:7.2f}x {tau:6.2f} {t_verify * 1e3:7.2f}ms "
            f"{t_draft * 1e3:6.2f}ms {ideal:5.2f}x {speedups[variant] / ideal:10.2f}  {str(lossless):8}  {per_position}"
        )
    best = {m: max((v for v in speedups if v[0] == m), key=speedups.get) for m in heads}
    print("best K: " + ", ".join(f"{m} K={v[1]} {speedups[v]:.2f}x" for m, v in best.items()))
    if "eagle3" in best and "peagle" in best:
        print(f"P-EAGLE over EAGLE-3 (each at its best K): {speedups[best['peagle']] / speedups[best['eagle3']]:.2f}x")

if __name__ == "__main__":
    main()
