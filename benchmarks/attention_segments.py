"""Decoding steps with attention cut into runs of rows vs one call over the padded batch.

    python benchmarks/attention_segments.py --target .aerie/targets/tiny-demo [--rows 4,8,16,32]

For each batch size, two sets of held-out chat prompts of the target's traffic are prefilled into
one plain engine, then decoding steps alternate between the two attentions (paired, so the box's
drift hits both alike); prints the median step time of each and their ratio, with the longest and
mean context of the batch (what the cut saves is the gap between them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from protocol import chat_prompts

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.engine.request import Status
from aerie.target import load_target
from aerie.traffic import synthesize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=".aerie/targets/tiny-demo")
    parser.add_argument("--rows", default="4,8,16,32")
    parser.add_argument("--steps", type=int, default=30, help="decoding steps per attention and batch")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(Path(args.target))
    if not target.segmented_attention:
        raise SystemExit(f"{args.target} does not use SDPA attention: nothing to compare")
    sizes = [int(n) for n in args.rows.split(",")]
    prompts = chat_prompts(
        target, synthesize(2 * max(sizes), seed=23, tokenizer=target.tokenizer, max_tokens=768, part="eval")
    )
    print(f"{'rows':>4} {'longest':>7} {'mean':>5} {'one call ms':>11} {'runs ms':>8} {'runs / one':>10}")
    for rows in sizes:
        for batch in (prompts[:rows], prompts[max(sizes):max(sizes) + rows]):
            tokens = 2 * args.steps + 8
            engine = build_engine(target, EngineConfig(max_slots=rows, max_len=max(map(len, batch)) + tokens), "none")
            for prompt in batch:
                engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
            while engine.scheduler.waiting or engine.scheduler.in_status(Status.PREFILLING):
                engine.step()
            times: dict[bool, list[float]] = {False: [], True: []}
            for step in range(2 * args.steps):
                target.segmented_attention = bool(step % 2)
                start = time.perf_counter()
                engine.step()
                times[target.segmented_attention].append(time.perf_counter() - start)
            target.segmented_attention = True
            lengths = [r.length for r in engine.scheduler.in_status(Status.DECODING)]
            one, runs = (statistics.median(times[flag]) for flag in (False, True))
            print(f"{rows:4d} {max(lengths):7d} {sum(lengths) / len(lengths):5.0f} {1e3 * one:11.1f} {1e3 * runs:8.1f} "
                  f"{runs / one:9.2f}x", flush=True)


if __name__ == "__main__":
    main()
