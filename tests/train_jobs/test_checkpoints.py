"""Checkpoints: a full round trip, refusal of partial or damaged ones, fallback to the last complete
one, and the head export (no Ray cluster needed)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from aerie.heads import new_head
from aerie.heads.fit import Example, TrainConfig, make_optimizer, train_step
from aerie.heads.io import load_head, save_head
from tests.heads.conftest import VOCAB, make_target
from train_jobs.checkpoints import (
    MARKER,
    IncompleteCheckpoint,
    TrainerState,
    join_tensors,
    read_checkpoint,
    split_tensors,
    validate_checkpoint,
    write_checkpoint,
)
from train_jobs.config import FitConfig
from train_jobs.fit_heads import RESULT_NAME, export_head
from train_jobs.worker import _build_head, _restore


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A P-EAGLE head after 3 optimiser steps, and its checkpoint."""
    torch.manual_seed(0)
    target = make_target()
    g = torch.Generator().manual_seed(0)
    data = [Example(torch.randint(3, VOCAB, (20,), generator=g).tolist(), [False] * 8 + [True] * 12) for _ in range(6)]
    config = TrainConfig(batch_size=3, peagle_depths=3, seed=1)
    head = new_head(target, "peagle", speculative_tokens=3, seed=0)
    optimizer, scheduler = make_optimizer(head, config, total_steps=10)
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        train_step(head, target, data[(i % 2) * 3 : (i % 2) * 3 + 3], optimizer, scheduler, config, gen)
    state = TrainerState(step=3, epoch=1, batch_in_epoch=1, world_size=2, total_steps=10, metrics={"loss": 1.5})
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint_000000003"
    write_checkpoint(path, head, optimizer, scheduler, state, [gen.get_state(), gen.get_state()], speculative_tokens=3)
    return target, head, optimizer, scheduler, path


def test_round_trip(trained):
    target, head, optimizer, scheduler, path = trained
    marker = validate_checkpoint(path)
    assert marker["step"] == 3 and set(marker["files"]) >= {"state.json", "head/model.safetensors"}
    loaded = read_checkpoint(path)
    assert (loaded.trainer.step, loaded.trainer.epoch, loaded.trainer.batch_in_epoch) == (3, 1, 1)
    assert loaded.trainer.metrics == {"loss": 1.5} and len(loaded.rng) == 2
    # the optimizer state comes back exactly and loads into a fresh optimizer
    fresh_head = load_head(loaded.head_dir, target).float().train()
    for (name, a), (_, b) in zip(head.state_dict().items(), fresh_head.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    opt2, sched2 = make_optimizer(fresh_head, TrainConfig(), total_steps=10)
    opt2.load_state_dict(loaded.optimizer)
    sched2.load_state_dict(loaded.scheduler)
    saved = optimizer.state_dict()
    again = opt2.state_dict()
    assert saved["param_groups"][0]["lr"] == again["param_groups"][0]["lr"]
    for key, st in saved["state"].items():
        for name, value in st.items():
            assert torch.equal(value, again["state"][key][name]), (key, name)
    assert sched2.last_epoch == scheduler.last_epoch == 3
    # no pickle anywhere
    assert not [p for p in path.rglob("*") if p.suffix in {".pt", ".pkl", ".bin"}]
    json.loads((path / "state.json").read_text())


def test_split_join_keeps_int_keys_and_tuples():
    obj = {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"betas": (0.9, 0.95), "params": [0]}]}
    tensors: dict = {}
    back = join_tensors(json.loads(json.dumps(split_tensors(obj, tensors))), tensors)
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["step"], torch.tensor(3.0))
    assert back["groups"][0]["betas"] == [0.9, 0.95]
    with pytest.raises(TypeError, match="no pickle"):
        split_tensors({"x": object()}, {})


def test_partial_or_damaged_checkpoints_are_refused(trained, tmp_path):
    path = trained[-1]
    no_marker = tmp_path / "no_marker"
    shutil.copytree(path, no_marker)
    (no_marker / MARKER).unlink()
    with pytest.raises(IncompleteCheckpoint, match="no checkpoint.json marker"):
        read_checkpoint(no_marker)
    missing = tmp_path / "missing"
    shutil.copytree(path, missing)
    (missing / "state.safetensors").unlink()
    with pytest.raises(IncompleteCheckpoint, match="state.safetensors is missing"):
        validate_checkpoint(missing)
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    weights = truncated / "head" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(IncompleteCheckpoint, match="bytes, the marker says"):
        validate_checkpoint(truncated)
    flipped = tmp_path / "flipped"
    shutil.copytree(path, flipped)
    raw = bytearray((flipped / "state.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (flipped / "state.safetensors").write_bytes(bytes(raw))
    with pytest.raises(IncompleteCheckpoint, match="sha256"):
        validate_checkpoint(flipped)


def test_restore_falls_back_to_the_last_complete_checkpoint(trained, tmp_path):
    from ray.train import Checkpoint

    target, _, _, _, path = trained
    run = tmp_path / "run"
    good = run / "checkpoint_000000003_aaaaaa"
    shutil.copytree(path, good)
    bad = run / "checkpoint_000000006_bbbbbb"  # newer, but its upload never finished
    shutil.copytree(path, bad)
    (bad / MARKER).unlink()
    head, loaded = _restore(Checkpoint(str(bad)), target, rank=0)
    assert loaded.trainer.step == 3 and str(loaded.path) == str(good)
    assert head.method == "peagle"
    (good / MARKER).unlink()
    with pytest.raises(IncompleteCheckpoint, match="no complete checkpoint"):
        _restore(Checkpoint(str(bad)), target, rank=0)


def test_export_head_replaces_atomically(trained, tmp_path):
    target, head, _, _, path = trained
    out = tmp_path / "heads" / "peagle"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("from an older export")
    export_head(path, str(out), {"run": "x", "steps": 3})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", RESULT_NAME]
    assert json.loads((out / RESULT_NAME).read_text())["steps"] == 3
    exported = load_head(out, target)
    assert torch.equal(exported.mask_hidden, head.mask_hidden.to(exported.dtype))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / MARKER).unlink()
    with pytest.raises(IncompleteCheckpoint):
        export_head(broken, str(tmp_path / "never"), {})
    assert not (tmp_path / "never").exists()


def test_new_and_warm_started_heads_record_the_jobs_peagle_passes(trained, tmp_path):
    target, head, *_ = trained
    save_head(head, tmp_path / "earlier")
    job = dict(data="d", target="t", method="peagle", out="o", peagle_passes=3, peagle_fed_ratio=0.5, k=3)
    fresh = _build_head(FitConfig.model_validate(job), {}, target)
    warm = _build_head(FitConfig.model_validate({**job, "warm_start": str(tmp_path / "earlier")}), {}, target)
    assert head.config.draft_passes == 1
    assert fresh.config.draft_passes == warm.config.draft_passes == 3
