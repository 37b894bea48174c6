"""Fit a draft head across Ray Train workers: `aerie train ...` or, for `ray job submit`,

    python -m train_jobs.fit_heads --data DATA --target DIR --method eagle3 --out OUT \\
        [--workers N] [--epochs E] [--warm-start DIR] [--config FILE] [--name RUN] [--storage URI] \\
        [--any-config-field VALUE ...]

The driver (`run_fit`): validates the config; refuses data it cannot trust
(`aerie.data.ingest_output.check_training_data`: a complete ingest output, same vocabulary and
chat template as the target, counts that match the files); scans the training split in Ray tasks
(`train_jobs.data`) into a row index, the budget and the draft vocabulary; runs a `TorchTrainer`
(DDP; `FailureConfig(max_failures)`, checkpoints kept by eval depth-1 agreement); exports the best
checkpoint's head to `--out` with `aerie.storage.publish_dir` (old head or new head, never a mix).

Each worker (`train_loop`) loads the target frozen on its device, builds or restores the head,
and trains on the batches `aerie.data.training_rows.epoch_plan` assigns to its rank (a pure
function of the data, seed, epoch, rank and world size), evaluating with
`aerie.heads.evaluation` (each rank a share, the totals all-reduced) and checkpointing at every
eval. Resume (a worker-group restart, or a rerun with the same name and storage) continues at
the checkpoint's epoch and batch of the same plan: no row skipped, none repeated. With the
automatic budget the loop stops once eval agreement has not improved for `patience` evals after
`min_steps`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from aerie import storage
from train_jobs.checkpoints import HEAD_DIR, IncompleteCheckpoint, read_checkpoint, validate_checkpoint
from train_jobs.config import FIELDS, ConfigError, FitConfig, flag, load_config, parse_sets, parse_value
from train_jobs.worker import SCORE, checkpoint_dir, train_loop

RESULT_NAME = "train_result.json"


# ============================================================================ the driver


def _run_config(cfg: FitConfig, name: str, scored: bool):
    """Ray's run settings: storage, retries, the worker environment, and checkpoints kept by eval
    depth-1 agreement when there is an eval split (Ray always keeps the latest too)."""
    import ray.train

    env = storage.worker_env()
    if storage.is_s3(cfg.storage):
        fs, path = storage.resolve(cfg.storage)
        storage_kwargs: dict[str, Any] = {"storage_path": path, "storage_filesystem": fs}
    else:
        storage_kwargs = {"storage_path": cfg.storage}
    return ray.train.RunConfig(
        name=name,
        failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=cfg.num_to_keep, checkpoint_score_attribute=SCORE if scored else None
        ),
        worker_runtime_env={"env_vars": env} if env else None,
        **storage_kwargs,
    )


def export_head(checkpoint_dir: Path, out: str, extra: dict[str, Any]) -> str:
    """Publish the head of a validated checkpoint to `out` (local or s3://) with a train_result.json:
    `aerie.storage.publish_dir`, so readers get the old head or the new one, never a mix."""
    validate_checkpoint(checkpoint_dir)
    with tempfile.TemporaryDirectory(prefix="aerie-export-") as tmp:
        staged = Path(tmp) / "head"
        shutil.copytree(checkpoint_dir / HEAD_DIR, staged)
        (staged / RESULT_NAME).write_text(json.dumps(extra, indent=2, default=str) + "\n")
        return storage.publish_dir(staged, out)


def _best(result) -> tuple[Any, dict[str, Any]]:
    """The kept checkpoint with the best eval depth-1 agreement (the latest among equals), or the
    latest when there was no eval."""
    scored = [(c, m) for c, m in (result.best_checkpoints or []) if m.get(SCORE) is not None]
    if not scored:
        return result.checkpoint, result.metrics or {}
    return max(scored, key=lambda cm: (cm[1][SCORE], cm[1].get("step", 0)))


def check_warm_start(cfg: FitConfig) -> None:
    """Refuse, before any worker starts, a warm-start head this run cannot train exactly (a
    sliding-window head, as speculators trains them, over longer sequences than its window)."""
    from transformers import AutoConfig

    from aerie.heads.base import check_span
    from aerie.heads.io import CONFIG_NAME, read_head_config

    target_config = AutoConfig.from_pretrained(storage.download_model_files(cfg.target)).get_text_config()
    head_dir = storage.download(storage.join(cfg.warm_start, CONFIG_NAME)).parent
    config = read_head_config(head_dir, target_config.num_hidden_layers)
    check_span(config, cfg.max_length + cfg.ttt_steps,
               f"--warm-start {cfg.warm_start}: training with max_length {cfg.max_length}")


def run_fit(cfg: FitConfig) -> dict[str, Any]:
    """Train (or resume) the run and export its best head; returns a summary. Uses the connected Ray
    instance, or starts a local one."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from aerie.data.ingest_output import check_training_data
    from aerie.data.target_facts import target_facts
    from aerie.data.training_rows import PlanSettings, epoch_plan, plan_budget
    from aerie.heads.fit import mask_token_from_counts
    from aerie.heads.vocab import build_draft_vocab
    from train_jobs.data import data_bytes, read_eval_examples, rows_table, scan, split_files

    started = time.monotonic()
    cfg = cfg.with_absolute_paths()
    name = cfg.run_name
    if not ray.is_initialized():
        ray.init()
    facts = target_facts(cfg.target)
    check_training_data(cfg.data, facts.tokenizer)
    if cfg.warm_start:
        check_warm_start(cfg)
    fs, files = split_files(cfg.data, "train")
    index, totals = scan(fs, files, facts.vocab_size)
    cached = cfg.cache_data_mb > 0 and data_bytes(fs, files) <= cfg.cache_data_mb * 1024**2
    settings = PlanSettings(
        seed=cfg.seed, world_size=cfg.workers, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens,
        max_length=cfg.max_length, chunk_rows=max(1, min(4096, len(index) // (8 * cfg.workers))) if cached else None,
        shuffle_window=None if cached else max(cfg.shuffle_buffer, 1),
    )
    budget = plan_budget(len(epoch_plan(index, 0, settings)[0]), epochs=cfg.epochs, max_steps=cfg.max_steps,
                         min_steps=cfg.min_steps, max_epochs=cfg.max_epochs, eval_every=cfg.eval_every)
    draft_vocab = mask_token_id = None
    if cfg.method == "peagle":
        mask_token_id = mask_token_from_counts(facts.mask_token_id, totals["all_counts"])
    if cfg.method != "eagle" and not cfg.warm_start:
        draft_vocab = build_draft_vocab(torch.from_numpy(totals["counts"]), cfg.draft_vocab_size, facts.stop_token_ids)
    eval_examples = read_eval_examples(cfg.data, cfg.eval_max_examples)
    scan_s = time.monotonic() - started
    print(
        f"aerie train: run {name} | {totals['rows']} rows, {totals['tokens']} tokens ({totals['loss_tokens']} reply) "
        f"| {cfg.workers} workers x {budget['steps_per_epoch']} steps/epoch, {budget['total_steps']} steps "
        f"({'early stopping after ' + str(cfg.min_steps) if cfg.early_stopping else 'fixed'}) | "
        f"{len(eval_examples)} eval examples every {budget['eval_every']} steps | "
        f"storage {storage.join(cfg.storage, name)}",
        file=sys.stderr,
    )
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": cfg.gpus_per_worker} if cfg.use_gpu else {})}
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": cfg.model_dump(mode="json"), "budget": budget, "plan": settings, "draft_vocab": draft_vocab,
            "mask_token_id": mask_token_id, "index_ref": ray.put(index),
            "table_ref": ray.put(rows_table(fs, index)) if cached else None,
            "eval_ref": ray.put(eval_examples) if eval_examples else None,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.use_gpu,
                                               resources_per_worker=resources),
        run_config=_run_config(cfg, name, scored=bool(eval_examples)),
    )
    fit_started = time.monotonic()
    result = trainer.fit()
    fit_s = time.monotonic() - fit_started
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"run {name} finished without a checkpoint")
    with checkpoint_dir(result.checkpoint) as path:
        final = read_checkpoint(path).trainer
    if not final.finished:
        raise IncompleteCheckpoint(f"the last checkpoint of run {name} ({result.checkpoint.path}) is not final")
    best, best_metrics = _best(result)
    with checkpoint_dir(best) as path:
        summary = {
            "run": name, "method": cfg.method, "storage": storage.join(cfg.storage, name),
            "checkpoint": storage.to_uri(cfg.storage, best.path), "steps": final.step,
            "best_step": best_metrics.get("step", final.step), "early_stopped": final.step < budget["total_steps"],
            "workers": cfg.workers, "rows": totals["rows"], "data_cached": cached, "budget": budget,
            "metrics": final.metrics, "best_metrics": best_metrics, "history": final.history,
            "trained_rows": final.trained_rows, "scan_seconds": round(scan_s, 2), "fit_seconds": round(fit_s, 2),
        }
        extra = {k: v for k, v in summary.items() if k not in ("history", "trained_rows")}
        summary["out"] = export_head(path, cfg.out, extra)
    summary["seconds"] = round(time.monotonic() - started, 2)
    return summary


# ============================================================================ command lines


def cli_run(config_file: str | None, overrides: dict[str, Any]) -> int:
    """Validate, train, export, print the summary as JSON; 2 on a configuration error."""
    try:
        cfg = load_config(config_file, **overrides)
    except ConfigError as e:
        print(f"error: invalid training config:\n{e}", file=sys.stderr)
        return 2
    summary = run_fit(cfg)
    summary.pop("history", None)  # in the run's checkpoints (state.json) for whoever wants it
    print(json.dumps(summary, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train_jobs.fit_heads",
        description="Fit a draft head with Ray Train (see `aerie train --help`). Every config field is a flag.",
    )
    parser.add_argument("--config", help="YAML config file (local or s3://); flags override it.")
    parser.add_argument("--set", action="append", metavar="FIELD=VALUE", help="Any config field.")
    for field in FIELDS:
        info = FitConfig.model_fields[field]
        parser.add_argument(flag(field), dest=field, nargs="?", const="true", default=None,
                            help=info.description)
        if info.annotation is bool:
            parser.add_argument("--no-" + flag(field)[2:], dest=field, action="store_const", const="false")
    args = parser.parse_args(argv)
    overrides = {f: parse_value(getattr(args, f), f) for f in FIELDS if getattr(args, f) is not None}
    try:
        overrides = {**parse_sets(args.set), **overrides}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return cli_run(args.config, overrides)


if __name__ == "__main__":
    sys.exit(main())
