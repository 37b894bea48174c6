"""Training checkpoints: a directory that is complete or is not taken at all. No pickle, no Ray.

Layout (what rank 0 writes into a local temporary directory, which `ray.train.report` then copies
to the run's storage)::

    head/config.json, head/model.safetensors   the head, in the head-file format (aerie.heads.io)
    state.safetensors                          every tensor of the optimizer state + RNG states
    state.json                                 the rest: optimizer param groups and non-tensor state,
                                               scheduler state, step, epoch, data position, config
    checkpoint.json                            the marker, written last: every file with its size
                                               and sha256

A checkpoint counts only if `checkpoint.json` is there and every file it lists has the stated size
and hash, so an upload cut short, a copy in progress or a truncated file is refused, whatever order
the files were copied in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "aerie-train-checkpoint"
VERSION = 1
MARKER = "checkpoint.json"
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
HEAD_DIR = "head"


class IncompleteCheckpoint(ValueError):
    """The directory is not a complete checkpoint (missing marker, missing or damaged file)."""


@dataclass
class TrainerState:
    """Where training stands: the next batch to train is batch `batch_in_epoch` of epoch `epoch`."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    finished: bool = False
    world_size: int = 1
    total_steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0  # in train steps (data wait included), summed over attempts
    wall_seconds: float = 0.0  # in the training loop (evals, checkpoints, reports included)
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)  # every report's metrics
    config: dict[str, Any] = field(default_factory=dict)
    best_eval_acc_1: float | None = None  # the best eval depth-1 agreement so far, and its step
    best_step: int = 0
    evals_without_gain: int = 0  # early stopping: evals since the last gain of min_delta
    trained_rows: list[list[list[str]]] = field(default_factory=list)  # record_rows: [step][rank] -> row ids


@dataclass
class LoadedCheckpoint:
    path: Path
    trainer: TrainerState
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: list[torch.Tensor]

    @property
    def head_dir(self) -> Path:
        return self.path / HEAD_DIR


# ----------------------------------------------------------------------------- tensors <-> JSON


def split_tensors(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """A JSON-able copy of `obj` with every tensor moved to `tensors` (under a path-like key)."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: split_tensors(v, tensors, f"{prefix}.{k}" if prefix else k) for k, v in obj.items()}
        return {
            "__items__": [
                [k, split_tensors(v, tensors, f"{prefix}.{k}" if prefix else str(k))] for k, v in obj.items()
            ]
        }
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, tensors, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix!r} in a checkpoint (no pickle)")


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `split_tensors`."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__items__"}:
            return {k: join_tensors(v, tensors) for k, v in obj["__items__"]}
        return {k: join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- write / read


def write_checkpoint(
    path: str | Path,
    head,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trainer: TrainerState,
    rng: list[torch.Tensor] | None = None,
    speculative_tokens: int | None = None,
) -> Path:
    """Write a complete checkpoint into the (empty or new) local directory `path`; the marker last."""
    from aerie.heads.io import save_head

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MARKER).exists():
        (out / MARKER).unlink()
    save_head(head, out / HEAD_DIR, speculative_tokens=speculative_tokens)
    tensors: dict[str, torch.Tensor] = {}
    opt_json = split_tensors(optimizer.state_dict(), tensors, "optimizer")
    for i, state in enumerate(rng or []):
        tensors[f"rng.{i}"] = state.detach().to("cpu").contiguous().clone()
    save_file(tensors, str(out / STATE_TENSORS), metadata={"format": FORMAT})
    state = {
        "trainer": trainer.__dict__,
        "optimizer": opt_json,
        "scheduler": split_tensors(scheduler.state_dict() if scheduler is not None else {}, {}, "scheduler"),
        "rng_count": len(rng or []),
    }
    (out / STATE_JSON).write_text(json.dumps(state, indent=1) + "\n")
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MARKER)
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "step": trainer.step,
        "epoch": trainer.epoch,
        "finished": trainer.finished,
        "files": {
            str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files
        },
    }
    tmp = out / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    tmp.replace(out / MARKER)
    return out


def validate_checkpoint(path: str | Path) -> dict[str, Any]:
    """The marker of a complete checkpoint; raises IncompleteCheckpoint saying what is wrong."""
    root = Path(path)
    marker_path = root / MARKER
    if not marker_path.is_file():
        raise IncompleteCheckpoint(f"{root}: no {MARKER} marker (an unfinished or foreign checkpoint)")
    try:
        marker = json.loads(marker_path.read_text())
    except ValueError as e:
        raise IncompleteCheckpoint(f"{root}/{MARKER}: unreadable ({e})") from None
    if marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        raise IncompleteCheckpoint(f"{root}/{MARKER}: not an {FORMAT} marker")
    if marker.get("version", 0) > VERSION:
        raise IncompleteCheckpoint(f"{root}: checkpoint version {marker['version']} is newer than {VERSION}")
    for rel, info in marker["files"].items():
        file = root / rel
        if not file.is_file():
            raise IncompleteCheckpoint(f"{root}: {rel} is missing")
        if file.stat().st_size != info["bytes"]:
            raise IncompleteCheckpoint(
                f"{root}: {rel} has {file.stat().st_size} bytes, the marker says {info['bytes']}"
            )
        if _sha256(file) != info["sha256"]:
            raise IncompleteCheckpoint(f"{root}: {rel} does not match its sha256")
    for needed in (STATE_JSON, STATE_TENSORS, f"{HEAD_DIR}/config.json", f"{HEAD_DIR}/model.safetensors"):
        if needed not in marker["files"]:
            raise IncompleteCheckpoint(f"{root}: the marker does not list {needed}")
    return marker


def read_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Validate and read a checkpoint directory (local). The head itself is loaded with
    `aerie.heads.io.load_head(loaded.head_dir, target)`."""
    root = Path(path)
    validate_checkpoint(root)
    state = json.loads((root / STATE_JSON).read_text())
    tensors = load_file(str(root / STATE_TENSORS))
    known = set(TrainerState.__dataclass_fields__)
    trainer = TrainerState(**{k: v for k, v in state["trainer"].items() if k in known})
    return LoadedCheckpoint(
        path=root,
        trainer=trainer,
        optimizer=join_tensors(state["optimizer"], tensors),
        scheduler=join_tensors(state["scheduler"], {}),
        rng=[tensors[f"rng.{i}"] for i in range(int(state.get("rng_count", 0)))],
    )
