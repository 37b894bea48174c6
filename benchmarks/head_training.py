"""Learning check: train EAGLE-3 and P-EAGLE heads on replies the target wrote itself.

    .venv/bin/python benchmarks/head_training.py --target .aerie/targets/tiny-llama \
        [--out .aerie/bench/head_training] [--minutes 4] [--methods eagle3,peagle]

1. Prompts: windows of Python standard-library source (`sysconfig`), split by file into a
   training set and a held-out set (no file contributes to both).
2. Replies: the target generates them through the engine (`aerie.engine.Engine`): training
   replies at each `--train-temperatures` (sampled replies add variety; greedy ones are what
   the engine will verify against), held-out replies greedily, so the held-out chain rates are
   exactly the per-position acceptance of greedy chain verification.
3. Each head trains for `--minutes` of this process's CPU time (`--clock cpu`: fair when other
   jobs share the box; one torch thread, which is fastest at these sizes when cores are busy),
   with the target's outputs cached after the first epoch (`aerie.heads.fit`), then reports on
   the held-out set the top-1 agreement with the target at depths 1..5 (`acc_d`), the chain acceptance rates
   (`chain_d`: depths 1..d all accepted) and tau at K = 5 (1 + sum chain_d).

Writes `<out>/data.json` (the generated token ids, reused on a rerun with the same settings),
`<out>/<method>/` (the head files) and `<out>/results.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
import time
from pathlib import Path

import torch

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.heads.fit import Example, TrainConfig, evaluate, train_head
from aerie.heads.io import save_head
from aerie.target import load_target


def stdlib_prompts(count: int, held_out: int, seed: int, min_lines: int = 4, max_lines: int = 16):
    """(train, held-out) prompt strings: windows of standard-library source that start at a
    `def` / `class` line; held-out prompts come from files the training prompts never use."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    rng.shuffle(files)
    split = max(1, len(files) // 6)
    pools = {"eval": files[:split], "train": files[split:]}
    out: dict[str, list[str]] = {}
    for name, want in (("train", count), ("eval", held_out)):
        prompts: list[str] = []
        for path in pools[name]:
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (UnicodeDecodeError, OSError):
                continue
            starts = [
                i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))
            ]
            rng.shuffle(starts)
            for i in starts[:3]:
                window = "\n".join(lines[i : i + rng.randint(min_lines, max_lines)]) + "\n"
                if 40 <= len(window) <= 1200:
                    prompts.append(window)
            if len(prompts) >= want:
                break
        out[name] = prompts[:want]
    return out["train"], out["eval"]


def generate_examples(
    target, prompts: list[str], max_tokens: int, temperature: float, seed: int, slots: int
):
    engine = Engine(target, EngineConfig(max_slots=slots, max_len=2048))
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        for i in range(len(prompts))
    ]
    examples = []
    for completion in engine.generate(prompts, params):
        ids = list(completion.prompt_ids) + list(completion.token_ids)
        mask = [False] * len(completion.prompt_ids) + [True] * len(completion.token_ids)
        examples.append(Example(ids, mask))
    return examples


def load_or_generate(args, target) -> tuple[list[Example], list[Example], dict]:
    settings = {
        "target": str(Path(args.target).resolve()),
        "train_prompts": args.train_prompts,
        "eval_prompts": args.eval_prompts,
        "max_tokens": args.max_tokens,
        "train_temperatures": args.train_temperatures,
        "seed": args.seed,
    }
    cache = Path(args.out) / "data.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("settings") == settings:
            print(f"reusing generated data from {cache}")
            to_examples = lambda rows: [Example(r["ids"], r["mask"]) for r in rows]  # noqa: E731
            return to_examples(data["train"]), to_examples(data["eval"]), data["timing"]
    train_prompts, eval_prompts = stdlib_prompts(args.train_prompts, args.eval_prompts, args.seed)
    timing = {}
    start = time.monotonic()
    train: list[Example] = []
    for t_index, temperature in enumerate(float(t) for t in args.train_temperatures.split(",")):
        train += generate_examples(
            target,
            train_prompts,
            args.max_tokens,
            temperature,
            args.seed + 100_000 * t_index,
            args.slots,
        )
    timing["generate_train_s"] = time.monotonic() - start
    start = time.monotonic()
    held_out = generate_examples(target, eval_prompts, args.max_tokens, 0.0, args.seed, args.slots)
    timing["generate_eval_s"] = time.monotonic() - start
    cache.parent.mkdir(parents=True, exist_ok=True)
    rows = lambda exs: [{"ids": e.input_ids, "mask": e.loss_mask} for e in exs]  # noqa: E731
    cache.write_text(
        json.dumps(
            {"settings": settings, "timing": timing, "train": rows(train), "eval": rows(held_out)}
        )
    )
    return train, held_out, timing


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=".aerie/targets/tiny-llama")
    parser.add_argument("--out", default=".aerie/bench/head_training")
    parser.add_argument("--methods", default="eagle3,peagle")
    parser.add_argument("--minutes", type=float, default=4.0, help="training wall-clock per head")
    parser.add_argument("--train-prompts", type=int, default=400)
    parser.add_argument("--eval-prompts", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--train-temperatures", default="0.0,0.8")
    parser.add_argument(
        "--draft-vocab", type=int, default=1024, help="draft vocabulary size (0: half the target's)"
    )
    parser.add_argument(
        "--epochs", type=int, default=1000, help="upper bound; --minutes usually stops first"
    )
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument(
        "--clock",
        default="cpu",
        choices=["cpu", "wall"],
        help="what --minutes counts: this process's CPU time (fair on a shared box) or wall time",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--peagle-depths", type=int, default=5)
    parser.add_argument("--peagle-layers", type=int, default=2)
    parser.add_argument("--depth", type=int, default=5, help="evaluation depth K")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default); 1 is fastest for these sizes on a busy box",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target, device="cpu")
    train, held_out, timing = load_or_generate(args, target)
    reply_tokens = sum(sum(e.loss_mask) for e in train)
    print(
        f"target: {args.target} (vocab {target.vocab_size}, hidden {target.hidden_size}, "
        f"layers {target.num_layers}, "
        f"taps {target.tap_layers}); train {len(train)} examples / {reply_tokens} reply tokens; "
        f"held-out {len(held_out)} examples / {sum(sum(e.loss_mask) for e in held_out)} reply "
        f"tokens; {timing}"
    )
    draft_vocab = args.draft_vocab or max(1, target.vocab_size // 2)
    results = {"settings": vars(args), "timing": timing, "heads": {}}
    for method in args.methods.split(","):
        config = TrainConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            max_seconds=args.minutes * 60,  # the cosine schedule follows the time budget
            warmup_steps=args.warmup_steps,
            cache_target=True,
            clock=args.clock,
            ttt_steps=args.ttt_steps,
            peagle_depths=args.peagle_depths,
            eval_depth=args.depth,
            seed=args.seed,
        )
        layers = args.peagle_layers if method == "peagle" else None
        head, result = train_head(
            target,
            method,
            train,
            None,
            config,
            draft_vocab_size=draft_vocab,
            num_layers=layers,
            speculative_tokens=args.depth,
        )
        start = time.monotonic()
        metrics = evaluate(
            head, target, held_out, args.depth, config.eval_batch_size, config.max_length
        )
        eval_s = time.monotonic() - start
        train_metrics = evaluate(
            head, target, train[: len(held_out)], args.depth, config.eval_batch_size
        )
        save_head(head, Path(args.out) / method, speculative_tokens=args.depth)
        results["heads"][method] = {
            "train_seconds": result.seconds,
            "train_cpu_seconds": result.cpu_seconds,
            "steps": result.steps,
            "epochs": result.steps * config.batch_size / max(1, len(train)),
            "mask_token_id": getattr(head, "mask_token_id", None),
            "final_loss": sum(h["loss"] for h in result.history[-20:])
            / max(1, len(result.history[-20:])),
            "held_out": metrics,
            "train_subset": {
                k: v for k, v in train_metrics.items() if k.startswith(("acc_", "tau"))
            },
            "eval_seconds": eval_s,
            "draft_vocab": draft_vocab,
            "layers": head.num_layers,
        }
        row = " ".join(f"{metrics[f'acc_{d}']:.3f}" for d in range(1, args.depth + 1))
        chain = " ".join(f"{metrics[f'chain_{d}']:.3f}" for d in range(1, args.depth + 1))
        print(
            f"{method:7s} {result.steps} steps in {result.seconds:.0f}s wall / "
            f"{result.cpu_seconds:.0f}s CPU | "
            f"held-out acc@1..{args.depth}: {row} | "
            f"chain: {chain} | tau@K={args.depth}: {metrics['tau']:.2f}"
        )
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {Path(args.out) / 'results.json'}")


if __name__ == "__main__":
    main()
