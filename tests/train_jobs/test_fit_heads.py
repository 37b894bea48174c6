"""Ray Train runs with 2 CPU workers (0.5 CPU each): training and export, a worker failure restored
from the last checkpoint, a stopped run resumed by rerunning it, warm start, S3 storage."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.heads.io import load_head
from aerie.target import load_target
from train_jobs.checkpoints import read_checkpoint, validate_checkpoint
from train_jobs.config import load_config
from train_jobs.fit_heads import run_fit

K = 3
STEPS_PER_EPOCH = (14, 15)  # 120 replies / 2 workers / batch 4, less what evening out the ranks drops
EPOCHS = 3


def eventually(check, timeout=20.0):
    """Ray deletes checkpoints beyond num_to_keep asynchronously, after `fit` may have returned."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def config(fit_target, fit_data, **overrides):
    values = dict(
        data=str(fit_data), target=str(fit_target), method="eagle3", draft_vocab_size=512, k=K, epochs=EPOCHS,
        batch_size=4, lr=1e-2, ttt_steps=2, checkpoint_every=10, num_to_keep=2, report_every=5,
        report_min_seconds=0.0, workers=2, cpus_per_worker=0.5, threads_per_worker=1, seed=7, progress=False,
        eval_every=0, record_rows=True,
    )
    values.update(overrides)
    return load_config(**values)


@pytest.fixture(scope="session")
def baseline(ray_local, fit_target, fit_data, tmp_path_factory):
    """An uninterrupted 2-worker EAGLE-3 run (local storage and output)."""
    root = tmp_path_factory.mktemp("baseline")
    cfg = config(fit_target, fit_data, out=str(root / "head"), storage=str(root / "runs"), name="baseline")
    return cfg, run_fit(cfg)


@pytest.fixture(scope="session")
def target(fit_target):
    return load_target(str(fit_target), device="cpu")


def test_two_workers_train_and_export_a_lossless_head(baseline, target):
    cfg, summary = baseline
    metrics = summary["metrics"]
    assert summary["budget"]["steps_per_epoch"] in STEPS_PER_EPOCH and summary["rows"] == 120  # input-only skipped
    assert summary["steps"] == summary["budget"]["steps_per_epoch"] * EPOCHS
    assert metrics["workers"] == 2 and metrics["resumes"] == 0 and metrics["tokens_per_s"] > 0
    assert all(f"eval_acc_{d}" in metrics and f"eval_chain_{d}" in metrics for d in range(1, K + 1))
    assert metrics["eval_step"] == summary["steps"] and 1.0 <= metrics["eval_tau"] <= 1.0 + K
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["eval_loss"])
    # num_to_keep checkpoints in storage, every one complete, the last one final
    def kept():
        return sorted(p for p in Path(summary["storage"]).glob("checkpoint_*") if p.is_dir())

    assert eventually(lambda: len(kept()) in (cfg.num_to_keep, cfg.num_to_keep + 1)), kept()  # best + latest
    assert all(validate_checkpoint(p) for p in kept())
    best = read_checkpoint(summary["checkpoint"]).trainer  # the exported head is the best eval's
    assert best.step == summary["best_step"] and best.best_eval_acc_1 == summary["best_metrics"]["eval_acc_1"]

    head = load_head(cfg.out, target)
    assert head.method == "eagle3" and head.config.speculative_tokens == K
    assert head.eval_metrics["acc_1"] == summary["best_metrics"]["eval_acc_1"]  # the file carries its eval
    assert int(head.t2d.sum()) == 512
    prompts = torch.randint(3, target.vocab_size, (4, 8), generator=torch.Generator().manual_seed(99)).tolist()
    params = SamplingParams(max_tokens=24)
    engine_config = EngineConfig(max_slots=4, max_len=64)
    plain = build_engine(target, engine_config, "none").generate(prompts, params)
    drafted = build_engine(target, engine_config, "eagle3", head, K).generate(prompts, params)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain]


def test_worker_failure_restores_from_checkpoint_on_s3(baseline, ray_local, s3_bucket, fit_target, fit_data, target):
    """Rank 1 raises at step 23; the group restarts from the step-20 checkpoint (in the moto S3 server),
    finishes, and lands within noise of the uninterrupted run with the same seed."""
    from aerie import storage

    _, base = baseline
    out = f"{s3_bucket}/heads/fault"
    cfg = config(
        fit_target, fit_data, out=out, storage=f"{s3_bucket}/runs", name="fault", fail_at_step=23, fail_rank=1,
        max_failures=1,
    )
    summary = run_fit(cfg)
    metrics = summary["metrics"]
    print({k: (round(base["metrics"][k], 4), round(metrics[k], 4)) for k in ("eval_acc_1", "eval_tau", "eval_loss")})
    assert metrics["resumes"] == 1 and metrics["attempt_start_step"] == 20
    assert summary["steps"] == base["steps"]
    # every step trained on exactly the rows of the uninterrupted run, rank by rank
    assert len(summary["trained_rows"]) == base["steps"] and summary["trained_rows"] == base["trained_rows"]
    assert abs(metrics["eval_acc_1"] - base["metrics"]["eval_acc_1"]) <= 0.05
    assert abs(metrics["eval_loss"] - base["metrics"]["eval_loss"]) <= 0.05 * abs(base["metrics"]["eval_loss"])
    # checkpoints and the head are in S3, complete
    def markers():
        return [f for f in storage.list_files(f"{s3_bucket}/runs/fault") if f.endswith("/checkpoint.json")]

    assert eventually(lambda: len(markers()) in (cfg.num_to_keep, cfg.num_to_keep + 1)), markers()
    assert summary["checkpoint"].startswith(f"{s3_bucket}/runs/fault/checkpoint_")
    names = {f.rsplit("/", 1)[1] for f in storage.list_files(out)}
    assert names == {"config.json", "model.safetensors", "train_result.json"}
    head = load_head(out, target)
    assert head.method == "eagle3"


def test_rerun_with_the_same_name_resumes_a_stopped_run(baseline, ray_local, fit_target, fit_data, tmp_path):
    """A run that starts from the baseline head (warm start), then dies at step 7 without retries; a
    rerun with the same name and storage resumes from its step-5 checkpoint."""
    from ray.train import TrainingFailedError

    base_cfg, _ = baseline
    common = dict(
        out=str(tmp_path / "head"), storage=str(tmp_path / "runs"), name="stopped", warm_start=base_cfg.out,
        lr=1e-7, epochs=1, checkpoint_every=5,
    )
    with pytest.raises(TrainingFailedError, match="injected failure"):
        run_fit(config(fit_target, fit_data, fail_at_step=7, max_failures=0, **common))
    left = sorted(p for p in (tmp_path / "runs" / "stopped").glob("checkpoint_*") if p.is_dir())
    assert len(left) == 1 and read_checkpoint(left[0]).trainer.step == 5
    # the warm start took: with a tiny learning rate the head is still the baseline's
    target = load_target(str(fit_target), device="cpu")
    warm = load_head(base_cfg.out, target)
    resumed_head = load_head(left[0] / "head", target)
    for (name, a), (_, b) in zip(warm.state_dict().items(), resumed_head.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-4), name

    summary = run_fit(config(fit_target, fit_data, **common))
    assert summary["metrics"]["attempt_start_step"] == 5 and summary["metrics"]["resumes"] == 1
    assert summary["steps"] in STEPS_PER_EPOCH
    assert load_head(tmp_path / "head", target).method == "eagle3"


def test_train_refuses_data_it_cannot_trust(ray_local, fit_target, fit_data, tokenizer_dir, tmp_path):
    """Another tokenizer's data, a half-written split, no manifest: refused with the reason."""
    import json
    import shutil

    from aerie.data.ingest_output import DataMismatch

    def attempt(data):
        return run_fit(config(fit_target, data, out=str(tmp_path / "h"), storage=str(tmp_path / "r")))

    other = tmp_path / "other"
    shutil.copytree(fit_data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataMismatch, match="another vocabulary"):
        attempt(other)
    manifest["tokenizer"]["vocab_sha256"] = json.loads((fit_data / "manifest.json").read_text())["tokenizer"][
        "vocab_sha256"]
    manifest["tokenizer"]["chat_template_sha256"] = "1" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataMismatch, match="chat template"):
        attempt(other)
    half = tmp_path / "half"
    shutil.copytree(fit_data, half)
    (half / "train" / "part-003.parquet").unlink()
    with pytest.raises(DataMismatch, match="train holds 96 rows, the manifest counts 128"):
        attempt(half)
    (half / "manifest.json").unlink()
    with pytest.raises(DataMismatch, match="no manifest.json"):
        attempt(half)


def test_default_budget_stops_early_and_exports_the_best_head(ray_local, fit_target, fit_data, tmp_path, target):
    """No epochs, no max_steps: at least min_steps, evals every eval_every steps, stop when eval
    depth-1 agreement has not gained min_delta for `patience` evals; the exported head is the best one."""
    cfg = config(fit_target, fit_data, out=str(tmp_path / "head"), storage=str(tmp_path / "runs"), name="auto",
                 epochs=None, min_steps=10, patience=2, min_delta=0.5, eval_every=5, record_rows=False)
    summary = run_fit(cfg)
    assert summary["budget"]["total_steps"] >= 10 and summary["early_stopped"]
    # evals at steps 5, 10 and the epoch end: no gain of 0.5 after the first, so it stops at the third
    evals = {h["step"]: h["eval_acc_1"] for h in summary["history"] if h.get("eval_step") == h["step"]}
    assert sorted(evals) == [5, 10, summary["budget"]["steps_per_epoch"]] and summary["steps"] == max(evals)
    best_acc, best_step = max((acc, step) for step, acc in evals.items())
    assert summary["best_step"] == summary["best_metrics"]["step"] == best_step  # the best eval's checkpoint
    assert summary["metrics"]["best_step"] == best_step and summary["best_metrics"]["eval_acc_1"] == best_acc
    exported = json.loads((tmp_path / "head" / "train_result.json").read_text())
    assert exported["best_step"] == best_step and load_head(cfg.out, target).method == "eagle3"


def test_an_epoch_end_right_after_a_checkpoint_writes_no_second_one(ray_local, fit_target, fit_data, tmp_path):
    """A checkpoint every step: each epoch ends at one. The checkpoint at that step already resumes
    at the next epoch, so there is no second report (an empty window: loss NaN) nor checkpoint."""
    cfg = config(fit_target, fit_data, out=str(tmp_path / "head"), storage=str(tmp_path / "runs"), name="each",
                 epochs=2, checkpoint_every=1, num_to_keep=1, record_rows=False)
    summary = run_fit(cfg)
    steps = [h["step"] for h in summary["history"]]
    assert steps == list(range(1, summary["steps"] + 1)), steps
    assert all(math.isfinite(h["loss"]) for h in summary["history"])
