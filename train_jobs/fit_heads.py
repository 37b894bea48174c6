"""Fit a draft head across Ray Train workers: `aerie train ...` or, for `ray job submit`,

    python -m train_jobs.fit_heads --data DATA --target DIR --method eagle3 --out OUT \\
        [--workers N] [--epochs E] [--warm-start DIR] [--config FILE] [--name RUN] [--storage URI] \\
        [--any-config-field VALUE ...]

The driver (`run_fit`):
1. validates the config (`train_jobs.config.FitConfig`; errors name the field);
2. reads `<data>/train/` as a Ray Dataset of trainable rows and scans it once: row and token counts
   (the length of the cosine schedule) and the reply-token counts, from which it builds the draft
   vocabulary (`aerie.heads.vocab.build_draft_vocab`, the target's stop tokens always in) that every
   worker receives; reads the first `eval_max_examples` rows of `<data>/eval/`;
3. runs a `TorchTrainer` (DDP: gloo on CPU, NCCL on GPU) with `FailureConfig(max_failures)` and
   `CheckpointConfig(num_to_keep)`, run storage `<storage>/<name>` (local or s3://);
4. exports the head of the final checkpoint to `--out` (local or s3://).

Each worker (`train_loop`) loads the target frozen on its device, builds the head (new, from the
`--warm-start` head, or from the last checkpoint when the run resumes), wraps
`aerie.heads.fit.Objective` with `ray.train.torch.prepare_model`, streams its shard of the training
data (`ray.train.get_dataset_shard("train")`) and calls `aerie.heads.fit.train_step` per batch.
Every `report_every` steps it reports loss, lr and tokens/s (summed over the workers); every
`eval_every` steps and at each epoch end the eval loss and agreement at depths 1..K (`eval_acc_d`,
`eval_chain_d`, `eval_tau`), each worker taking every world_size-th eval example and the counts
summed; every `checkpoint_every` steps and at each epoch end a checkpoint (`train_jobs.checkpoints`)
is attached by rank 0. All ranks report at the same steps.

Resume: a worker-group restart after a failure, and a rerun with the same `name` and `storage`,
both start from the last complete checkpoint: head, optimizer, scheduler, step, per-rank RNG state
and data position (epoch and batches consumed in it; those batches are skipped). A run whose last
checkpoint is final just exports again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from aerie import storage
from train_jobs.checkpoints import (
    HEAD_DIR,
    IncompleteCheckpoint,
    LoadedCheckpoint,
    TrainerState,
    read_checkpoint,
    validate_checkpoint,
    write_checkpoint,
)
from train_jobs.config import FIELDS, ConfigError, FitConfig, flag, load_config, parse_sets, parse_value

FORWARDED_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
    "AERIE_CACHE",
)
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
RESULT_NAME = "train_result.json"


class InjectedFailure(RuntimeError):
    """The test-only failure `fail_at_step` raises."""


# ============================================================================ shared helpers


def target_info(target: str) -> dict[str, Any]:
    """Vocabulary size, stop tokens and the default P-EAGLE placeholder of a target, from its config
    and tokenizer only (no weights)."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from aerie.heads.config import default_mask_token_id

    local = storage.download_model_files(target)
    vocab_size = int(AutoConfig.from_pretrained(local).get_text_config().vocab_size)
    stops: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(local).eos_token_id
        stops.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:
        pass
    try:
        tok = AutoTokenizer.from_pretrained(local)
    except (OSError, ValueError):
        tok = None
    if tok is not None and tok.eos_token_id is not None:
        stops.add(int(tok.eos_token_id))
    like = SimpleNamespace(tokenizer=tok, vocab_size=vocab_size, stop_token_ids=sorted(stops))
    return {"vocab_size": vocab_size, "stop_token_ids": sorted(stops), "mask_token_id": default_mask_token_id(like)}


# ============================================================================ the worker loop


class _Comm:
    """The few collectives the loop needs, no-ops on one worker."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        nccl = self.on and dist.get_backend() == "nccl"
        self.device = device if nccl else torch.device("cpu")

    def all_true(self, flag_value: bool) -> bool:
        if not self.on:
            return flag_value
        t = torch.tensor([1 if flag_value else 0], device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return bool(t.item())

    def sum(self, values: list[float]) -> list[float]:
        if not self.on:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(out, obj)
        return out


def _sharded_eval(head, target, examples, tc, rank: int, world: int, comm: _Comm) -> dict[str, float]:
    """Eval loss and agreement at depths 1..K over `examples`, each rank taking every world-th one."""
    from aerie.heads.fit import collate, compute_loss, iterate_batches
    from aerie.heads.losses import Agreement, chain_agreement, peagle_agreement, prepare_batch

    depth = tc.eval_depth
    was_training = head.training
    head.eval()
    total = Agreement(correct=[0.0] * depth, chain=[0.0] * depth, count=[0.0] * depth)
    loss_sum = weight = 0.0
    generator = torch.Generator().manual_seed(tc.seed + 12345)  # P-EAGLE's depth sampling, same every eval
    with torch.no_grad():
        for batch in iterate_batches(examples[rank::world], tc.eval_batch_size):
            ids, attn, loss_mask = collate(batch, tc.max_length)
            hb = prepare_batch(target, head, ids, attn, loss_mask)
            out = compute_loss(head, hb, tc, generator)
            tokens = float(hb.loss_mask.sum())
            loss_sum += float(out.loss) * tokens
            weight += tokens
            part = peagle_agreement(head, hb, depth) if head.method == "peagle" else chain_agreement(head, hb, depth)
            total = total.merge(part)
    head.train(was_training)
    summed = comm.sum([loss_sum, weight, *total.correct, *total.chain, *total.count])
    merged = Agreement(
        correct=summed[2 : 2 + depth], chain=summed[2 + depth : 2 + 2 * depth], count=summed[2 + 2 * depth :]
    )
    out_metrics = {f"eval_{k}": v for k, v in merged.summary().items()}
    out_metrics["eval_loss"] = summed[0] / summed[1] if summed[1] else float("nan")
    out_metrics["eval_tokens"] = merged.count[0] if merged.count else 0.0
    return out_metrics


@contextmanager
def _checkpoint_dir(checkpoint):
    with checkpoint.as_directory() as path:
        yield Path(path)


def _restore(checkpoint, target, rank: int):
    """(head, LoadedCheckpoint) from the latest complete checkpoint: Ray's latest, or, when that one
    is damaged, the newest complete one next to it. (None, None) when there is none."""
    from ray.train import Checkpoint

    from aerie.heads.io import load_head

    if checkpoint is None:
        return None, None
    candidates = [checkpoint]
    try:
        import pyarrow.fs as pafs

        parent = checkpoint.path.rstrip("/").rsplit("/", 1)[0]
        infos = checkpoint.filesystem.get_file_info(pafs.FileSelector(parent))
        others = sorted(
            (i.path for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")),
            reverse=True,
        )
        candidates += [Checkpoint(path=p, filesystem=checkpoint.filesystem) for p in others if p != checkpoint.path]
    except Exception as e:  # noqa: BLE001 - listing is a fallback only
        print(f"[rank {rank}] could not list older checkpoints: {e}", file=sys.stderr)
    for candidate in candidates:
        try:
            with _checkpoint_dir(candidate) as path:
                loaded = read_checkpoint(path)
                head = load_head(loaded.head_dir, target)
                # keep what we need once the directory is gone
                loaded = LoadedCheckpoint(
                    path=Path(candidate.path), trainer=loaded.trainer, optimizer=loaded.optimizer,
                    scheduler=loaded.scheduler, rng=loaded.rng,
                )
                return head, loaded
        except IncompleteCheckpoint as e:
            print(f"[rank {rank}] skipping incomplete checkpoint: {e}", file=sys.stderr)
    raise IncompleteCheckpoint(f"no complete checkpoint among {[c.path for c in candidates]}")


def train_loop(loop_config: dict[str, Any]) -> None:
    """The per-worker training function of the TorchTrainer."""
    import ray
    import ray.train
    import ray.train.torch

    from aerie.heads import new_head
    from aerie.heads.fit import Objective, make_optimizer, train_step
    from aerie.heads.io import load_head
    from aerie.target import load_target
    from train_jobs.data import batched, shard_examples

    cfg = FitConfig.model_validate(loop_config["config"])
    tc = cfg.train_config()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if cfg.threads_per_worker:
        torch.set_num_threads(cfg.threads_per_worker)
    device = ray.train.torch.get_device()
    comm = _Comm(device)
    target = load_target(str(storage.download(cfg.target)), device=device)

    # ---- the head: from the last checkpoint, the warm-start head, or new
    head, loaded = _restore(ray.train.get_checkpoint(), target, rank)
    state = loaded.trainer if loaded else TrainerState(world_size=world, config=cfg.model_dump(mode="json"))
    resumed = loaded is not None
    if resumed:
        print(f"[rank {rank}] resuming from {loaded.path} at step {state.step} (epoch {state.epoch}, "
              f"batch {state.batch_in_epoch})", file=sys.stderr)
        if state.finished:
            return
        if head.method != cfg.method:
            raise ValueError(f"run {cfg.run_name} holds a {head.method} head, the config asks for {cfg.method}")
        state.metrics["resumes"] = state.metrics.get("resumes", 0) + 1
    elif cfg.warm_start:
        head = load_head(str(storage.download(cfg.warm_start)), target)
        if head.method != cfg.method:
            raise ValueError(f"--warm-start {cfg.warm_start} is a {head.method} head, not {cfg.method}")
    else:
        vocab = None
        if loop_config.get("draft_vocab") is not None:
            d2t, t2d = loop_config["draft_vocab"]
            vocab = (torch.as_tensor(d2t), torch.as_tensor(t2d))
            if vocab[1].numel() != target.vocab_size:
                raise ValueError(
                    f"the draft vocabulary covers {vocab[1].numel()} tokens, the target has {target.vocab_size}"
                )
        head = new_head(
            target, cfg.method, draft_vocab=vocab, num_layers=cfg.num_layers, speculative_tokens=cfg.k,
            seed=cfg.seed, mask_token_id=loop_config.get("mask_token_id") if cfg.method == "peagle" else None,
        )
    head = head.to(device=device, dtype=torch.float32).train()
    model = ray.train.torch.prepare_model(
        Objective(head, tc),
        parallel_strategy_kwargs={"find_unused_parameters": cfg.find_unused_parameters, "broadcast_buffers": False},
    )

    # ---- optimiser, schedule, RNG, data position
    total_steps = int(loop_config["total_steps"])
    state.total_steps, state.world_size = total_steps, world
    optimizer, scheduler = make_optimizer(head, tc, total_steps)
    generator = torch.Generator()
    if loaded:
        optimizer.load_state_dict(loaded.optimizer)
        if loaded.scheduler:
            scheduler.load_state_dict(loaded.scheduler)
    if loaded and len(loaded.rng) == world:
        generator.set_state(loaded.rng[rank])
    else:
        generator.manual_seed(cfg.seed * 1_000_003 + 7919 * state.step + rank)
    eval_examples = ray.get(loop_config["eval_ref"]) if loop_config.get("eval_ref") is not None else []
    shard = ray.train.get_dataset_shard("train")
    start_step = state.step
    attempt_started, wall_before = time.monotonic(), state.wall_seconds

    bar = None
    if rank == 0 and cfg.progress:
        from ray.experimental.tqdm_ray import tqdm as ray_tqdm

        bar = ray_tqdm(total=total_steps, desc=f"train {cfg.method}", unit="step")
        bar.update(state.step)

    window = {"loss": 0.0, "steps": 0.0, "tokens": 0.0, "loss_tokens": 0.0, "seconds": 0.0, "data_seconds": 0.0}
    last = {"grad_norm": 0.0, "lr": 0.0, "report_time": time.monotonic()}
    last_eval: dict[str, float] = {}
    last_checkpoint_step = state.step if resumed else -1

    def report(checkpoint_due: bool, eval_due: bool) -> None:
        """Every rank calls this at the same steps; rank 0 attaches the checkpoint."""
        nonlocal last_eval, last_checkpoint_step
        summed = comm.sum([window["loss"], window["steps"], window["tokens"], window["loss_tokens"]])
        seconds = window["seconds"]
        state.tokens += summed[2]
        state.wall_seconds = wall_before + time.monotonic() - attempt_started
        metrics: dict[str, float] = {
            "step": state.step,
            "epoch": state.epoch,
            "batch_in_epoch": state.batch_in_epoch,
            "loss": summed[0] / summed[1] if summed[1] else float("nan"),
            "lr": last["lr"],
            "grad_norm": last["grad_norm"],
            "tokens_per_s": summed[2] / seconds if seconds > 0 else 0.0,
            "loss_tokens_per_s": summed[3] / seconds if seconds > 0 else 0.0,
            "data_wait_fraction": window["data_seconds"] / seconds if seconds > 0 else 0.0,
            "tokens": state.tokens,
            "train_seconds": state.seconds,
            "wall_seconds": state.wall_seconds,
            "workers": world,
            "attempt_start_step": start_step,
            "resumes": state.metrics.get("resumes", 0),
        }
        if eval_due and eval_examples and last_eval.get("eval_step") != state.step:
            last_eval = _sharded_eval(head, target, eval_examples, tc, rank, world, comm)
            last_eval["eval_step"] = state.step
        metrics.update(last_eval)
        for key in window:
            window[key] = 0.0
        state.metrics = dict(metrics)
        state.history.append(dict(metrics))
        checkpoint, tmp = None, None
        if checkpoint_due:
            rng = comm.gather(generator.get_state())
            if rank == 0:
                tmp = tempfile.mkdtemp(prefix="aerie-ckpt-")
                write_checkpoint(tmp, head, optimizer, scheduler, state, rng, speculative_tokens=cfg.k)
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            last_checkpoint_step = state.step
        # a fresh suffix per report: a restarted attempt never writes into an earlier attempt's folder
        name = f"checkpoint_{state.step:09d}_{uuid.uuid4().hex[:6]}" if checkpoint is not None else None
        try:
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        last["report_time"] = time.monotonic()
        if bar is not None:
            acc = f" eval acc1 {last_eval['eval_acc_1']:.3f}" if "eval_acc_1" in last_eval else ""
            bar.set_description(f"train {cfg.method} loss {metrics['loss']:.3f}{acc}")

    # ---- the loop
    done = state.step >= total_steps
    while not done and state.epoch < cfg.epochs:
        examples = shard_examples(shard, state.epoch, rank, cfg.seed, cfg.shuffle_buffer)
        batches = batched(examples, cfg.batch_size, cfg.batch_tokens, cfg.max_length)
        for _ in range(state.batch_in_epoch):  # the data position: skip what the checkpoint trained on
            if next(batches, None) is None:
                break
        while True:
            started = time.perf_counter()
            batch = next(batches, None)
            fetched = time.perf_counter()
            # one collective per step: does every rank have a batch, and may metrics be reported
            # (rank 0's clock; Ray's controller takes one report per health-check interval)
            may_report = rank == 0 and time.monotonic() - last["report_time"] >= cfg.report_min_seconds
            have, report_ok = comm.sum([float(batch is not None), float(may_report)])
            if have < world:
                break
            if cfg.fail_at_step is not None and state.step + 1 == cfg.fail_at_step and not resumed \
                    and rank == cfg.fail_rank % world:
                raise InjectedFailure(f"injected failure on rank {rank} at step {cfg.fail_at_step}")
            metrics = train_step(model, target, batch, optimizer, scheduler, tc, generator)
            seconds = time.perf_counter() - started
            state.step += 1
            state.batch_in_epoch += 1
            state.seconds += seconds
            window["loss"] += metrics["loss"]
            window["steps"] += 1
            window["tokens"] += float(sum(min(len(e.input_ids), tc.max_length) for e in batch))
            window["loss_tokens"] += metrics.get("tokens", 0.0)
            window["seconds"] += seconds
            window["data_seconds"] += fetched - started
            last["grad_norm"], last["lr"] = metrics["grad_norm"], metrics["lr"]
            if bar is not None:
                bar.update(1)
            done = state.step >= total_steps
            if done:
                break
            checkpoint_due = state.step % cfg.checkpoint_every == 0
            eval_due = cfg.eval_every > 0 and state.step % cfg.eval_every == 0
            if checkpoint_due or eval_due or (state.step % cfg.report_every == 0 and report_ok > 0):
                report(checkpoint_due, eval_due)
        if done:
            break
        # epoch end: the next position is the start of the next epoch
        state.epoch += 1
        state.batch_in_epoch = 0
        if state.epoch >= cfg.epochs:
            break
        fresh_checkpoint = state.step != last_checkpoint_step
        if fresh_checkpoint or last_eval.get("eval_step") != state.step:
            report(checkpoint_due=fresh_checkpoint, eval_due=True)
    state.finished = True
    report(checkpoint_due=True, eval_due=True)
    if bar is not None:
        bar.close()


# ============================================================================ the driver


def _run_config(cfg: FitConfig, name: str):
    import ray.train

    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
        # an S3-compatible server (MinIO, moto): its keys go along; on AWS, workers use their own role
        env.update({k: os.environ[k] for k in CREDENTIAL_ENV if os.environ.get(k)})
    if storage.is_s3(cfg.storage):
        fs, path = storage.resolve(cfg.storage)
        storage_kwargs: dict[str, Any] = {"storage_path": path, "storage_filesystem": fs}
    else:
        storage_kwargs = {"storage_path": cfg.storage}
    return ray.train.RunConfig(
        name=name,
        failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.num_to_keep),
        worker_runtime_env={"env_vars": env} if env else None,
        **storage_kwargs,
    )


def plan_steps(cfg: FitConfig, lengths) -> dict[str, int]:
    """Steps per epoch and in total. Each worker gets rows // workers rows (Ray's equal split); with
    a token budget the batch count is simulated on a seeded shuffle of the real row lengths (every
    worker stops when the first runs out, so the smallest count)."""
    import numpy as np

    rows = len(lengths)
    per_worker = rows // cfg.workers
    if per_worker == 0:
        raise ValueError(f"{rows} trainable rows cannot feed {cfg.workers} workers")
    from train_jobs.data import count_batches

    order = np.random.default_rng(cfg.seed).permutation(rows)
    steps_per_epoch = min(
        count_batches(np.asarray(lengths)[order[w * per_worker : (w + 1) * per_worker]], cfg.batch_size,
                      cfg.batch_tokens, cfg.max_length)
        for w in range(cfg.workers)
    )
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return {"rows_per_worker": per_worker, "steps_per_epoch": steps_per_epoch, "total_steps": total}


def export_head(checkpoint_dir: Path, out: str, extra: dict[str, Any]) -> str:
    """Copy the head of a validated checkpoint to `out` (local or s3://) with a train_result.json.

    Local: written to a temporary sibling and renamed into place. S3: the weights first and
    config.json (what a loader opens first) last."""
    validate_checkpoint(checkpoint_dir)
    src = checkpoint_dir / HEAD_DIR
    if storage.is_s3(out):
        for name in sorted(p.name for p in src.iterdir() if p.is_file() and p.name != "config.json"):
            storage.write_bytes(storage.join(out, name), (src / name).read_bytes())
        storage.write_json(storage.join(out, RESULT_NAME), extra)
        storage.write_bytes(storage.join(out, "config.json"), (src / "config.json").read_bytes())
        return out
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    shutil.copytree(src, tmp)
    (tmp / RESULT_NAME).write_text(json.dumps(extra, indent=2) + "\n")
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        dest.rename(old)
    tmp.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return str(dest)


def run_fit(cfg: FitConfig) -> dict[str, Any]:
    """Train (or resume) the run and export its head; returns a summary. Uses the connected Ray
    instance, or starts a local one."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from aerie.heads.fit import mask_token_from_counts
    from aerie.heads.vocab import build_draft_vocab
    from train_jobs.data import data_bytes, read_eval_examples, scan_dataset, train_dataset

    started = time.monotonic()
    cfg = cfg.with_absolute_paths()
    name = cfg.run_name
    if not ray.is_initialized():
        ray.init()
    info = target_info(cfg.target)
    ds = train_dataset(cfg.data, seed=cfg.seed)
    cached = cfg.cache_data_mb > 0 and data_bytes(cfg.data) <= cfg.cache_data_mb * 1024**2
    if cached:  # small enough: read once, every epoch then splits blocks already in the object store
        ds = ds.materialize()
    scan = scan_dataset(ds, info["vocab_size"])
    plan = plan_steps(cfg, scan["lengths"])
    draft_vocab = None
    mask_token_id = None
    if cfg.method == "peagle":
        mask_token_id = mask_token_from_counts(info["mask_token_id"], scan["all_counts"])
    if cfg.method != "eagle" and not cfg.warm_start:
        d2t, t2d = build_draft_vocab(torch.from_numpy(scan["counts"]), cfg.draft_vocab_size, info["stop_token_ids"])
        draft_vocab = (d2t, t2d)
    eval_examples = read_eval_examples(cfg.data, cfg.eval_max_examples)
    scan_s = time.monotonic() - started
    print(
        f"aerie train: run {name} | {scan['rows']} rows, {scan['tokens']} tokens ({scan['loss_tokens']} reply) | "
        f"{cfg.workers} workers x {plan['steps_per_epoch']} steps/epoch, {plan['total_steps']} steps | "
        f"{len(eval_examples)} eval examples | storage {storage.join(cfg.storage, name)}",
        file=sys.stderr,
    )
    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": cfg.model_dump(mode="json"),
            "draft_vocab": draft_vocab,
            "mask_token_id": mask_token_id,
            "total_steps": plan["total_steps"],
            "eval_ref": ray.put(eval_examples) if eval_examples else None,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.workers, use_gpu=cfg.use_gpu, resources_per_worker=resources
        ),
        run_config=_run_config(cfg, name),
        datasets={"train": ds},
        dataset_config=ray.train.DataConfig(datasets_to_split=["train"]),
    )
    fit_started = time.monotonic()
    result = trainer.fit()
    fit_s = time.monotonic() - fit_started
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"run {name} finished without a checkpoint")
    with _checkpoint_dir(result.checkpoint) as path:
        loaded = read_checkpoint(path)
        if not loaded.trainer.finished:
            raise IncompleteCheckpoint(f"the last checkpoint of run {name} ({result.checkpoint.path}) is not final")
        summary = {
            "run": name,
            "method": cfg.method,
            "storage": storage.join(cfg.storage, name),
            "checkpoint": storage.to_uri(cfg.storage, result.checkpoint.path),
            "steps": loaded.trainer.step,
            "workers": cfg.workers,
            "rows": scan["rows"],
            "data_cached": cached,
            "metrics": loaded.trainer.metrics,
            "history": loaded.trainer.history,
            "scan_seconds": round(scan_s, 2),
            "fit_seconds": round(fit_s, 2),
        }
        summary["out"] = export_head(path, cfg.out, {k: v for k, v in summary.items() if k != "history"})
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
