"""Ray Train head training on the demo data: tokens/s with 1 and 2 workers, time to the learning bar.

    .venv/bin/python benchmarks/train_scaling.py --target .aerie/targets/tiny-llama \\
        [--data DIR] [--out .aerie/bench/train_scaling] [--requests 1200] [--steps 150] [--bar 0.6]

1. Demo data, unless `--data` already holds an ingest output: `aerie traffic` requests (stdlib source),
   then `aerie ingest --regenerate`, so every reply is the target's own greedy reply (the data the
   learning bar of benchmarks/head_training.py is defined on).
2. Throughput: EAGLE-3 for `--steps` steps with 1 worker (2 torch threads) and with 2 workers
   (1 thread each, 0.5 CPU each), `--batch-size` sequences per worker and step. tokens/s counts the
   non-padding tokens of every worker's batches per second of training steps (data wait included;
   start-up, evals, checkpoints not); `wall_s` is the whole `run_fit` call.
3. Time to the learning bar: EAGLE-3 and P-EAGLE with 2 workers and EAGLE-3 with 1 (twice the steps,
   so the same number of examples), evaluated every `--eval-every` steps on the held-out split; the
   first eval whose depth-1 agreement (`eval_acc_1`) reaches `--bar`: its step, seconds of training
   steps and seconds in the training loop.
4. Every exported head passes the engine's greedy losslessness check (equal to `--method none`).

Writes `<out>/results.json`. The machine is shared: the 1-minute load average is recorded per run.
Runs are named by their tag, so an interrupted benchmark resumes its runs (`--fresh` starts over).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def build_demo_data(target: str, out: Path, requests: int) -> Path:
    from aerie.traffic import generate_traffic
    from pipelines.ingest import IngestConfig, run_ingest

    capture, data = out / "capture", out / "data"
    if not capture.exists():
        print(generate_traffic(target, str(capture), requests=requests, fmt="sagemaker", seed=0, max_tokens=512))
    cfg = IngestConfig(input=str(capture), target=target, out=str(data), max_tokens=512, regenerate=True,
                       regenerate_max_tokens=128, progress=False)
    print(json.dumps(run_ingest(cfg)["counts"]))
    return data


def lossless(target_dir: str, data: str, head_dir: str, method: str, k: int, prompts: int = 8) -> bool:
    """Greedy with the head equals greedy without it, on held-out prompts."""
    from aerie.engine import EngineConfig, SamplingParams
    from aerie.engine.build import build_engine
    from aerie.target import load_target
    from train_jobs.data import read_eval_examples

    target = load_target(target_dir, device="cpu")
    rows = read_eval_examples(data, prompts)
    cut = [e.input_ids[: e.loss_mask.index(True)] for e in rows]
    params = SamplingParams(max_tokens=48)
    config = EngineConfig(max_slots=len(cut), max_len=max(map(len, cut)) + 64)
    plain = build_engine(target, config, "none").generate(cut, params)
    drafted = build_engine(target, config, method, head_dir, k).generate(cut, params)
    return [c.token_ids for c in plain] == [c.token_ids for c in drafted]


def run(args, data: Path, method: str, workers: int, steps: int, eval_every: int, tag: str) -> dict:
    from train_jobs.config import load_config
    from train_jobs.fit_heads import run_fit

    root = Path(args.out) / "runs"
    if args.fresh and (root / tag).exists():
        shutil.rmtree(root / tag)
    cfg = load_config(
        data=str(data), target=args.target, method=method, out=str(Path(args.out) / "heads" / tag),
        storage=str(root), name=tag, draft_vocab_size=args.draft_vocab, k=args.k,
        epochs=1000, max_steps=steps, batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps,
        peagle_depths=args.k, num_layers=2 if method == "peagle" else None, eval_every=eval_every,
        checkpoint_every=max(eval_every, 32), eval_max_examples=args.eval_examples, report_every=10,
        workers=workers, threads_per_worker=2 // workers, cpus_per_worker=0.5, seed=args.seed, progress=False,
    )
    load = os.getloadavg()[0]
    started = time.monotonic()
    summary = run_fit(cfg)
    wall = time.monotonic() - started
    m = summary["metrics"]
    history = summary.pop("history")
    reached = next(
        (h for h in history if h.get("eval_step") == h["step"] and h.get("eval_acc_1", 0) >= args.bar), None
    )
    result = {
        "method": method, "workers": workers, "steps": summary["steps"], "batch_size": args.batch_size,
        "tokens": m["tokens"], "train_s": round(m["train_seconds"], 2), "loop_s": round(m["wall_seconds"], 2),
        "wall_s": round(wall, 2), "scan_s": summary["scan_seconds"],
        "tokens_per_s": round(m["tokens"] / m["train_seconds"], 1),
        "steps_per_s": round(summary["steps"] / m["train_seconds"], 2),
        "final_eval": {k: round(v, 4) for k, v in m.items() if k.startswith("eval_") and k != "eval_step"},
        "evals": [
            {"step": h["step"], "acc_1": round(h["eval_acc_1"], 4), "tau": round(h["eval_tau"], 3),
             "train_s": round(h["train_seconds"], 1), "loop_s": round(h["wall_seconds"], 1)}
            for h in history if h.get("eval_step") == h["step"]
        ],
        "bar": args.bar,
        "bar_reached": None if reached is None else {
            "step": reached["step"], "train_s": round(reached["train_seconds"], 1),
            "loop_s": round(reached["wall_seconds"], 1),
        },
        "load_avg_1m_at_start": load,
        "head": summary["out"],
    }
    result["lossless"] = lossless(args.target, str(data), summary["out"], method, args.k)
    print(json.dumps({k: v for k, v in result.items() if k != "evals"}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=".aerie/targets/tiny-llama")
    parser.add_argument("--data", default=None, help="an ingest output (default: build <out>/data)")
    parser.add_argument("--out", default=".aerie/bench/train_scaling")
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=150, help="steps of each throughput run")
    parser.add_argument("--bar-steps", type=int, default=128, help="steps of the 2-worker learning runs (x2 for 1)")
    parser.add_argument("--eval-every", type=int, default=16, help="(x2 for 1 worker: the same examples per eval)")
    parser.add_argument("--eval-examples", type=int, default=64)
    parser.add_argument("--bar", type=float, default=0.6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: throughput,bar")
    parser.add_argument("--fresh", action="store_true", help="start every run over (default: an interrupted "
                        "run resumes from its checkpoint, a finished one is reported again)")
    args = parser.parse_args()
    os.environ.update(ENV)
    args.target = str(Path(args.target).resolve())
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)

    import ray

    ray.init(num_cpus=2, object_store_memory=1024**3, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    data = Path(args.data).resolve() if args.data else out / "data"
    if not (data / "manifest.json").is_file():  # an ingest output is found through its manifest
        data = build_demo_data(args.target, out, args.requests)
    path = out / "results.json"
    results: dict = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    results.update(settings=vars(args), cpus=os.cpu_count())  # runs of other tags from earlier calls stay
    skip = set(filter(None, args.skip.split(",")))
    plan = []
    if "throughput" not in skip:
        plan += [("eagle3", 1, args.steps, 0, "tput-eagle3-w1"), ("eagle3", 2, args.steps, 0, "tput-eagle3-w2")]
    if "bar" not in skip:
        plan += [
            ("eagle3", 2, args.bar_steps, args.eval_every, "bar-eagle3-w2"),
            ("peagle", 2, args.bar_steps, args.eval_every, "bar-peagle-w2"),
            ("eagle3", 1, 2 * args.bar_steps, 2 * args.eval_every, "bar-eagle3-w1"),  # same examples per eval
        ]
    done = {r["tag"] for r in results["runs"]}
    for method, workers, steps, eval_every, tag in plan:
        if tag in done and not args.fresh:
            print(f"{tag}: in {path} already (--fresh to run it again)")
            continue
        result = {"tag": tag, **run(args, data, method, workers, steps, eval_every, tag)}
        results["runs"] = [r for r in results["runs"] if r["tag"] != tag] + [result]
        path.write_text(json.dumps(results, indent=2))
    ray.shutdown()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
