"""The per-worker loop of `train_jobs.fit_heads` (see its docstring): restore or build the head,
train on this rank's batches of the epoch plan, evaluate, checkpoint, stop early."""

from __future__ import annotations

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
    IncompleteCheckpoint,
    LoadedCheckpoint,
    TrainerState,
    read_checkpoint,
    write_checkpoint,
)
from train_jobs.config import FitConfig

SCORE = "eval_acc_1"


class InjectedFailure(RuntimeError):
    """The test-only failure `fail_at_step` raises."""


class _Comm:
    """The few collectives the loop needs, no-ops on one worker."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        nccl = self.on and dist.get_backend() == "nccl"
        self.device = device if nccl else torch.device("cpu")

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


@contextmanager
def checkpoint_dir(checkpoint):
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
            with checkpoint_dir(candidate) as path:
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


def _build_head(cfg: FitConfig, loop_config: dict[str, Any], target):
    """The head to train: restored (by `_restore`), from `--warm-start`, or new."""
    from aerie.heads import new_head
    from aerie.heads.io import load_head

    if cfg.warm_start:
        head = load_head(str(storage.download(cfg.warm_start)), target)
        if head.method != cfg.method:
            raise ValueError(f"--warm-start {cfg.warm_start} is a {head.method} head, not {cfg.method}")
        if cfg.method == "peagle":
            head.config = head.config.model_copy(update={"draft_passes": cfg.peagle_passes})
        return head
    vocab = None
    if loop_config.get("draft_vocab") is not None:
        d2t, t2d = loop_config["draft_vocab"]
        vocab = (torch.as_tensor(d2t), torch.as_tensor(t2d))
    return new_head(
        target, cfg.method, draft_vocab=vocab, num_layers=cfg.num_layers, speculative_tokens=cfg.k, seed=cfg.seed,
        mask_token_id=loop_config.get("mask_token_id") if cfg.method == "peagle" else None, num_heads=cfg.num_heads,
        draft_passes=cfg.peagle_passes if cfg.method == "peagle" else 1,
    )


def train_loop(loop_config: dict[str, Any]) -> None:
    """The per-worker training function of the TorchTrainer."""
    import ray
    import ray.train
    import ray.train.torch

    from aerie.data.training_rows import RowReader, epoch_plan
    from aerie.heads.evaluation import EvalTotals, eval_totals
    from aerie.heads.fit import Objective, make_optimizer, train_step
    from aerie.target import load_target

    cfg = FitConfig.model_validate(loop_config["config"])
    tc, budget, settings = cfg.train_config(), loop_config["budget"], loop_config["plan"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if cfg.threads_per_worker:
        torch.set_num_threads(cfg.threads_per_worker)
    device = ray.train.torch.get_device()
    comm = _Comm(device)
    target = load_target(str(storage.download(cfg.target)), device=device)

    head, loaded = _restore(ray.train.get_checkpoint(), target, rank)
    state = loaded.trainer if loaded else TrainerState(world_size=world, config=cfg.model_dump(mode="json"))
    if loaded:
        print(f"[rank {rank}] resuming from {loaded.path} at step {state.step} (epoch {state.epoch}, "
              f"batch {state.batch_in_epoch})", file=sys.stderr)
        if state.finished:
            return
        if head.method != cfg.method:
            raise ValueError(f"run {cfg.run_name} holds a {head.method} head, the config asks for {cfg.method}")
        state.metrics["resumes"] = state.metrics.get("resumes", 0) + 1
    else:
        head = _build_head(cfg, loop_config, target)
    head = head.to(device=device, dtype=torch.float32).train()
    model = ray.train.torch.prepare_model(
        Objective(head, tc),
        parallel_strategy_kwargs={"find_unused_parameters": cfg.find_unused_parameters, "broadcast_buffers": False},
    )
    total_steps = budget["total_steps"]
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
    index = ray.get(loop_config["index_ref"])
    table = ray.get(loop_config["table_ref"]) if loop_config.get("table_ref") is not None else None
    reader = RowReader(index, table, filesystem=None if table is not None else storage.resolve(cfg.data)[0])
    eval_examples = ray.get(loop_config["eval_ref"]) if loop_config.get("eval_ref") is not None else []
    start_step, attempt_started, wall_before = state.step, time.monotonic(), state.wall_seconds
    bar = None
    if rank == 0 and cfg.progress:
        from ray.experimental.tqdm_ray import tqdm as ray_tqdm

        bar = ray_tqdm(total=total_steps, desc=f"train {cfg.method}", unit="step")
        bar.update(state.step)
    window = {"loss": 0.0, "steps": 0.0, "tokens": 0.0, "loss_tokens": 0.0, "seconds": 0.0, "data_seconds": 0.0}
    last = {"grad_norm": 0.0, "lr": 0.0, "report_time": time.monotonic(), "checkpoint_step": -1}
    last_eval: dict[str, float] = {}
    last_summary: dict[str, float] = {}

    def evaluate() -> None:
        """Every rank evaluates its share; updates the best score and the early-stopping count."""
        nonlocal last_eval, last_summary
        part = eval_totals(head, target, eval_examples[rank::world], tc.eval_depth, tc.eval_batch_size,
                           tc.max_length, loss_config=tc)
        totals = EvalTotals.from_vector(comm.sum(part.vector(tc.eval_depth)), tc.eval_depth)
        last_eval, last_summary = {**totals.metrics(), "eval_step": state.step}, totals.summary()
        score, best = last_eval.get(SCORE), state.best_eval_acc_1
        if score is None:
            return
        # patience counts evals without a gain of min_delta; the best (what is exported) is the plain
        # maximum, the latest among equals, as Ray ranks the kept checkpoints
        state.evals_without_gain = 0 if best is None or score > best + cfg.min_delta else state.evals_without_gain + 1
        if best is None or score >= best:
            state.best_eval_acc_1, state.best_step = score, state.step

    def report(checkpoint_due: bool) -> None:
        """Every rank calls this at the same steps; a checkpoint comes with a fresh eval, and rank 0
        attaches it."""
        summed = comm.sum([window["loss"], window["steps"], window["tokens"], window["loss_tokens"]])
        seconds = window["seconds"]
        state.tokens += summed[2]
        state.wall_seconds = wall_before + time.monotonic() - attempt_started
        if checkpoint_due and eval_examples and last_eval.get("eval_step") != state.step:
            evaluate()
        metrics: dict[str, float] = {
            "step": state.step, "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
            "loss": summed[0] / summed[1] if summed[1] else float("nan"), "lr": last["lr"],
            "grad_norm": last["grad_norm"], "tokens_per_s": summed[2] / seconds if seconds > 0 else 0.0,
            "loss_tokens_per_s": summed[3] / seconds if seconds > 0 else 0.0,
            "data_wait_fraction": window["data_seconds"] / seconds if seconds > 0 else 0.0,
            "tokens": state.tokens, "train_seconds": state.seconds, "wall_seconds": state.wall_seconds,
            "workers": world, "attempt_start_step": start_step, "resumes": state.metrics.get("resumes", 0),
            "best_step": state.best_step, **last_eval,
        }
        for key in window:
            window[key] = 0.0
        state.metrics = dict(metrics)
        state.history.append(dict(metrics))
        checkpoint, tmp = None, None
        if checkpoint_due:
            last["checkpoint_step"] = state.step
            rng = comm.gather(generator.get_state())
            if rank == 0:
                # the head file carries the evaluation of these weights (adaptive k starts from it)
                head.eval_metrics = last_summary if last_eval.get("eval_step") == state.step else {}
                tmp = tempfile.mkdtemp(prefix="aerie-ckpt-")
                write_checkpoint(tmp, head, optimizer, scheduler, state, rng, speculative_tokens=cfg.k)
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
        # a fresh suffix per report: a restarted attempt never writes into an earlier attempt's folder
        name = f"checkpoint_{state.step:09d}_{uuid.uuid4().hex[:6]}" if checkpoint is not None else None
        try:
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        last["report_time"] = time.monotonic()
        if bar is not None:
            acc = f" eval acc1 {last_eval[SCORE]:.3f}" if SCORE in last_eval else ""
            bar.set_description(f"train {cfg.method} loss {metrics['loss']:.3f}{acc}")

    def stop_early() -> bool:
        return cfg.early_stopping and state.step >= cfg.min_steps and state.evals_without_gain >= cfg.patience

    done = state.step >= total_steps or stop_early()
    while not done and state.epoch < budget["epochs"]:
        plan = epoch_plan(index, state.epoch, settings)[rank]
        for rows in plan[state.batch_in_epoch :]:  # the data position: the same plan, where the checkpoint was
            started = time.perf_counter()
            batch = reader.examples(rows)
            fetched = time.perf_counter()
            if cfg.fail_at_step is not None and state.step + 1 == cfg.fail_at_step and not loaded \
                    and rank == cfg.fail_rank % world:
                raise InjectedFailure(f"injected failure on rank {rank} at step {cfg.fail_at_step}")
            if cfg.record_rows:
                state.trained_rows.append(comm.gather(reader.ids(rows)))
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
            eval_due = budget["eval_every"] > 0 and state.step % budget["eval_every"] == 0
            checkpoint_due = eval_due or state.step % cfg.checkpoint_every == 0
            # may metrics be reported (rank 0's clock: Ray's controller takes one report per health check)
            may_report = rank == 0 and time.monotonic() - last["report_time"] >= cfg.report_min_seconds
            report_ok = comm.sum([float(may_report)])
            if checkpoint_due or (state.step % cfg.report_every == 0 and report_ok[0] > 0):
                report(checkpoint_due)
                done = stop_early()
                if done:
                    break
        if done:
            break
        state.epoch += 1  # epoch end: the next position is the start of the next epoch
        state.batch_in_epoch = 0
        if state.epoch >= budget["epochs"]:
            break
        if last["checkpoint_step"] != state.step:  # else that checkpoint resumes here already
            report(checkpoint_due=True)
            done = stop_early()
    state.finished = True
    report(checkpoint_due=True)
    if bar is not None:
        bar.close()
