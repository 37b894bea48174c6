"""The benchmark DAG: baseline vs prompt lookup vs EAGLE-3 vs P-EAGLE (vs EAGLE trees, adaptive K,
the serving deployment, Hugging Face peers), over concurrency and K, lossless, with a winner.

    aerie bench --target DIR --head eagle3=DIR --head peagle=DIR --prompts DATA --out REPORT
    ray job submit --working-dir . -- python -m pipelines.benchmark --target ... (the same flags)

One Ray DAG, composed with `.bind()` and executed once::

    load_prompts ─▶ one engine actor per variant ─▶ ready barrier
      ─▶ cell ─▶ cell ─▶ ... (chained: one at a time, round by round, every variant per level)
      ─▶ aggregate ─▶ lossless check ─▶ winner ─▶ report ─▶ winner.json (last: the stage is complete)

Every actor holds one engine (`aerie.engine.loop.EngineLoop`) and answers each cell with the
closed-loop streaming client of `aerie.bench.load`. Cells are chained (each takes the previous
cell's result) so no two run at once, and the chain starts only when every actor has loaded its
target, head and calibration, so nothing else competes for the machine while a cell is measured.
The peers (Hugging Face `generate`) run in the baseline's actor, on the model it has loaded.
All actors live on one node (a STRICT_PACK placement group): interleaved variants must share the
hardware they are compared on. The Ray-free logic (metrics, lossless check, selection, report)
is in `aerie/bench/`.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import asdict
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from aerie import storage
from aerie.bench.config import BenchConfig
from aerie.bench.variants import BASELINE, Cell, Variant, eagle_drafts_tree, plan_cells, plan_variants
from aerie.winner import Winner

OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}  # idle OpenMP threads sleep


def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from ray.experimental.tqdm_ray import tqdm

    return tqdm(total=total, desc=desc)


def _threads(threads: int) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def _cell_label(cell: dict, settings: dict) -> str:
    return (f"[{cell['index'] + 1}/{settings['cells']}] {cell['variant']} c={cell['concurrency']} "
            f"round {cell['round'] + 1}")


@ray.remote
class EngineActor:
    """One variant's engine, stepped on its own thread; cells stream requests into it. The target
    loads when the actor starts, while the prompts are still being read; the engine is built once
    they are (its longest request sets the cache length)."""

    def __init__(self, variant: dict, target: str, threads: int) -> None:
        from aerie.target import load_target

        _threads(threads)
        started = time.perf_counter()
        self.variant = Variant(**variant)
        self.target = load_target(target)
        self.load_seconds = time.perf_counter() - started

    def ready(self, prompts: list[list[int]], slots: int, max_tokens: int) -> dict:
        from aerie.engine import EngineConfig
        from aerie.engine.build import build_engine
        from aerie.engine.loop import EngineLoop

        started = time.perf_counter()
        self.prompts = prompts
        config = EngineConfig(max_slots=slots, max_len=max(map(len, prompts)) + max_tokens)
        engine = build_engine(self.target, config, self.variant.method, self.variant.head, self.variant.k,
                              tree=self.variant.tree or None, lookup=self.variant.lookup)
        self.loop = EngineLoop(engine)
        policy = engine.policy
        return {"variant": self.variant.label, "load_seconds": self.load_seconds,
                "build_seconds": time.perf_counter() - started,
                "calibration_seconds": policy.calibration_seconds if policy is not None else None,
                "device": str(self.target.device)}

    async def cell(self, cell: dict, settings: dict, after: Any) -> dict:
        from aerie.bench.aggregate import cell_result
        from aerie.bench.load import run_cell
        from aerie.engine import SamplingParams

        params = SamplingParams(max_tokens=settings["max_tokens"], temperature=0.0, ignore_eos=settings["ignore_eos"])
        bar = _bar(settings["progress"], settings["requests"], _cell_label(cell, settings))
        run = await run_cell(self.loop, self.prompts, cell["concurrency"], settings["requests"],
                             settings["warmup"][str(cell["concurrency"])], params,
                             on_done=(lambda _: bar.update(1)) if bar else None,
                             offset=cell["round"] * settings["requests"])
        if bar:
            bar.close()
        return cell_result(Cell(**cell), self.variant, run)

    def peer_cell(self, cell: dict, settings: dict, after: Any) -> dict:
        """A Hugging Face `generate` peer (greedy, prompt lookup) on this actor's loaded model."""
        from aerie.bench.aggregate import cell_result
        from aerie.bench.peers import run_peer_cell

        bar = _bar(settings["progress"], settings["requests"], _cell_label(cell, settings))
        run = run_peer_cell(self.target, cell["variant"], self.prompts, settings["requests"], settings["warmup"]["1"],
                            settings["max_tokens"], settings["lookup_tokens"], settings["ignore_eos"],
                            on_done=(lambda _: bar.update(1)) if bar else None,
                            offset=cell["round"] * settings["requests"])
        if bar:
            bar.close()
        return cell_result(Cell(**cell), Variant(cell["variant"], cell["variant"]), run)


@ray.remote(num_cpus=0)
def load_prompts(target: str, source: str, max_prompts: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from aerie.bench.prompts import load_prompts as load
    from aerie.target.model import resolve_model_dir

    return load(source, AutoTokenizer.from_pretrained(resolve_model_dir(target)), max_prompts)


@ray.remote(num_cpus=0)
def barrier(*builds: dict) -> dict:
    """Every actor has loaded its target and head (and calibrated): measuring may start."""
    return {"builds": list(builds), "ready_at": time.time()}


@ray.remote(num_cpus=0)
def aggregate(order: list[str], *cells: dict) -> dict:
    from aerie.bench.aggregate import aggregate as rows_of

    return {"rows": rows_of(list(cells), order, BASELINE), "cells": list(cells)}


@ray.remote(num_cpus=0)
def check_lossless(data: dict) -> dict:
    from aerie.bench.lossless import check_lossless as check

    verdicts = check(data["cells"], BASELINE)
    for row in data["rows"]:
        row["lossless"] = verdicts[row["variant"]].lossless
    return data | {"verdicts": {label: v.to_dict() for label, v in verdicts.items()}}


@ray.remote(num_cpus=0)
def choose(cfg: dict, data: dict) -> dict:
    from aerie.bench.selection import choose_winner

    config = BenchConfig(**cfg)
    return choose_winner(data["rows"], config, report=storage.join(config.out, "report.md")).model_dump(mode="json")


@ray.remote(num_cpus=0)
def write_report(cfg: dict, facts: dict, prompts: list[list[int]], ready: dict, data: dict, winner: dict) -> dict:
    """Every file but winner.json: results.json/.parquet, cells.json, lossless.json, report.md, PNGs."""
    from pathlib import PurePosixPath

    from aerie.bench.lossless import Mismatch, Verdict
    from aerie.bench.plots import render_plots
    from aerie.bench.report import render_report
    from aerie.bench.results import write_results

    out = cfg["out"]
    verdicts = {label: Verdict(**(v | {"mismatches": [Mismatch(**m) for m in v["mismatches"]]}))
                for label, v in data["verdicts"].items()}
    paths = write_results(data["rows"], out)
    for name, body in (("cells.json", data["cells"]), ("lossless.json", data["verdicts"])):
        paths[name] = storage.join(out, name)
        storage.write_text(paths[name], json.dumps(body) + "\n")
    for name, png in render_plots(data["rows"], PurePosixPath(cfg["target"].rstrip("/")).name).items():
        paths[name] = storage.join(out, name)
        storage.write_bytes(paths[name], png)
    builds = ready["builds"]
    facts = facts | {"wall_seconds": time.time() - facts["started_at"], "builds": builds, "prompts": len(prompts),
                     "startup_seconds": ready["ready_at"] - facts["started_at"],
                     "measuring_seconds": sum(c["wall_seconds"] for c in data["cells"]),
                     "device": builds[0]["device"] if builds else "?"}
    paths["report.md"] = storage.join(out, "report.md")
    storage.write_text(paths["report.md"], render_report(data["rows"], verdicts, Winner(**winner), facts))
    return {"paths": paths, "wall_seconds": facts["wall_seconds"],
            "lossless": {label: v.lossless for label, v in verdicts.items()},
            "failures": [v.summary() for v in verdicts.values() if not v.lossless]}


@ray.remote(num_cpus=0)
def publish_winner(out: str, winner: dict, written: dict) -> dict:
    path = storage.join(out, "winner.json")
    Winner(**winner).save(path)
    return written | {"winner": winner, "winner_path": path}


def _actor_options(cfg: BenchConfig, pg, bundle: int) -> dict:
    env = dict(cfg.runtime_env or {})
    env["env_vars"] = {**OMP_ENV, **storage.worker_env(), **env.get("env_vars", {})}
    return {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus, "runtime_env": env,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}


def build_dag(cfg: BenchConfig, variants: list[Variant], cells: list[Cell], pg, started_at: float):
    env = storage.worker_env()  # the driver's S3 settings, for the tasks that read and write storage
    task_env = {"runtime_env": {"env_vars": env}} if env else {}
    prompts = load_prompts.options(**task_env).bind(cfg.target, cfg.prompts, cfg.max_prompts)
    slots = max(cfg.concurrency)
    engines = [v for v in variants if not v.is_peer]
    actors = {v.label: EngineActor.options(**_actor_options(cfg, pg, i)).bind(v.to_dict(), cfg.target, cfg.threads)
              for i, v in enumerate(engines)}
    ready = barrier.bind(*[actor.ready.bind(prompts, slots, cfg.max_tokens) for actor in actors.values()])
    settings = {"requests": cfg.requests, "warmup": {str(c): cfg.warmup_for(c) for c in cfg.concurrency},
                "max_tokens": cfg.max_tokens, "ignore_eos": cfg.ignore_eos, "lookup_tokens": cfg.lookup_tokens,
                "progress": cfg.progress, "cells": len(cells)}
    previous, chain = ready, []
    for cell in cells:
        if cell.variant in actors:
            previous = actors[cell.variant].cell.bind(asdict(cell), settings, previous)
        else:
            previous = actors[BASELINE].peer_cell.bind(asdict(cell), settings, previous)
        chain.append(previous)
    checked = check_lossless.bind(aggregate.bind([v.label for v in variants], *chain))
    cfg_dict = cfg.model_dump(mode="json")
    winner = choose.bind(cfg_dict, checked)
    facts = {"target": cfg.target, "prompt_source": cfg.prompts, "variants": len(variants), "repeats": cfg.repeats,
             "cells": len(cells), "requests": cfg.requests, "warmup": cfg.warmup if cfg.warmup is not None
             else "one per client", "max_tokens": cfg.max_tokens, "started_at": started_at}
    written = write_report.options(**task_env).bind(cfg_dict, facts, prompts, ready, checked, winner)
    return publish_winner.options(**task_env).bind(cfg.out, winner, written)


def _log(message: str) -> None:
    print(f"aerie bench: {message}", file=sys.stderr, flush=True)


def run_benchmark(cfg: BenchConfig) -> dict:
    """The whole DAG in the current Ray (started if needed); returns the summary (paths, winner,
    lossless verdicts, wall time). winner.json is written last."""
    if not ray.is_initialized():
        ray.init()
    incumbent = Winner.load(cfg.incumbent) if cfg.incumbent else None
    target_config = json.loads(storage.read_text(storage.join(cfg.target, "config.json")))
    variants = plan_variants(cfg, incumbent, eagle_drafts_tree(target_config))
    cells = plan_cells(variants, cfg.concurrency, cfg.repeats)
    actors = sum(not v.is_peer for v in variants)
    bundle = {k: v for k, v in (("CPU", cfg.num_cpus), ("GPU", cfg.num_gpus)) if v}
    _log(f"{len(variants)} variants x {len(cfg.concurrency)} concurrency levels x {cfg.repeats} rounds = "
         f"{len(cells)} cells; {actors} actors ({bundle} each) on one node")
    started_at = time.time()
    pg = placement_group([bundle] * actors, strategy="STRICT_PACK")
    try:
        ready, _ = ray.wait([pg.ready()], timeout=cfg.placement_timeout_s)
        if not ready:
            raise RuntimeError(
                f"the cluster could not place {actors} engine actors with {bundle} each on one node within "
                f"{cfg.placement_timeout_s:.0f} s: lower num_cpus / num_gpus (a share per actor) or add a bigger node"
            )
        dag = build_dag(cfg, variants, cells, pg, started_at)
        with warnings.catch_warnings():
            # Ray 2.6x marks DAGNode.execute() deprecated in favour of compiled graphs, which need
            # pre-started actors and cannot run tasks; this DAG runs once, as the classic API does.
            warnings.filterwarnings("ignore", message=r"DAGNode\.execute\(\) is deprecated")
            summary = ray.get(dag.execute())
    finally:
        remove_placement_group(pg)
    for failure in summary["failures"]:
        _log(f"LOSSLESS CHECK FAILED, disqualified: {failure}")
    winner = summary["winner"]
    _log(f"winner: {winner['metrics']['variant']} ({winner['policy']['reason']}); "
         f"report {summary['paths']['report.md']}")
    return {"report": summary["paths"]["report.md"], "winner_path": summary["winner_path"], "winner": winner,
            "files": summary["paths"], "lossless": summary["lossless"],
            "disqualified": sorted(label for label, ok in summary["lossless"].items() if not ok),
            "wall_seconds": round(summary["wall_seconds"], 1), "cells": len(cells)}


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.benchmark`: the flags of `aerie bench`."""
    from aerie.cli import app

    app(["bench", *(sys.argv[1:] if argv is None else argv)], prog_name="python -m pipelines.benchmark")


if __name__ == "__main__":
    main()
