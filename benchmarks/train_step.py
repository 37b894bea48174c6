"""CPU milliseconds per training step of each head, on the tiny protocol's batches and recipe.

    python benchmarks/train_step.py [--data .aerie/bench/protocol/tiny/data.json] [--steps 20]

The protocol's own data (`benchmarks/protocol.py --setting tiny` writes it) and recipe: one thread,
bf16 autocast, batch 8 for EAGLE-3 (3 TTT steps, one layer) and 4 for P-EAGLE (depth 8, one layer),
the target's outputs prepared before timing. To compare two versions of the training code, run
it from a git worktree of each, taking turns (`PYTHONPATH=<worktree>`); the figures in benchmarks/PEAGLE.md ran
with the allocator settings `protocol.py` names.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from protocol import examples

from aerie.heads import new_head
from aerie.heads.fit import (
    TrainConfig,
    draft_vocab_from_examples,
    iterate_batches,
    make_optimizer,
    prepare_examples,
    train_step,
)
from aerie.target import load_target


def step_ms(target, train, method: str, steps: int, warmup: int = 4) -> float:
    depth = 8 if method == "peagle" else 5
    config = TrainConfig(
        batch_size=4 if method == "peagle" else 8, lr=2e-3, precision="bf16", peagle_depths=depth, warmup_steps=20
    )
    draft_vocab = draft_vocab_from_examples(train, target.vocab_size, 2048, target.stop_token_ids)
    head = new_head(target, method, draft_vocab=draft_vocab, num_layers=1, speculative_tokens=depth, seed=0)
    generator = torch.Generator(device="cpu").manual_seed(0)
    batches = [
        prepare_examples(target, head, batch, config.max_length)
        for batch in itertools.islice(iterate_batches(train, config.batch_size, generator), warmup + steps)
    ]
    optimizer, scheduler = make_optimizer(head, config, 10_000)
    for hb in batches[:warmup]:
        train_step(head, target, hb, optimizer, scheduler, config, generator)
    start = time.process_time()
    for hb in batches[warmup:]:
        train_step(head, target, hb, optimizer, scheduler, config, generator)
    return (time.process_time() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=".aerie/bench/protocol/tiny/data.json")
    parser.add_argument("--target", default=".aerie/targets/tiny-demo")
    parser.add_argument("--methods", default="peagle,eagle3")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_target(Path(args.target), device="cpu")
    train = examples(json.loads(Path(args.data).read_text())["train"])
    for method in args.methods.split(","):
        print(f"{method}: {step_ms(target, train, method, args.steps):.1f} ms per step (CPU time, one thread)")


if __name__ == "__main__":
    main()
