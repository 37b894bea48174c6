"""The one validated configuration of a head-training run (`aerie train`, `python -m train_jobs.fit_heads`).

Values come from a YAML file (`--config FILE`, local or s3://) and from flags; a flag given on the
command line wins over the file. Every problem is reported with the field's name, e.g.
``batch_size (--batch-size): Input should be greater than or equal to 1``. No Ray here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Method = Literal["eagle3", "peagle", "eagle"]


class ConfigError(ValueError):
    """A bad configuration; the message names every bad field."""


def _check_uri(value: str) -> str:
    if "://" in value and not value.startswith(("s3://", "file://")):
        raise ValueError("must be a local path or an s3:// URI")
    if value.startswith("s3://") and len(value.rstrip("/")) <= len("s3://"):
        raise ValueError("s3:// URI needs a bucket")
    return value


class FitConfig(BaseModel):
    """Everything a head-training run needs. Paths may be local or ``s3://``; on a multi-node
    cluster use ``s3://`` (or a shared file system) for `data`, `target`, `storage` and `out`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # what to train, from what, to where
    data: str = Field(min_length=1, description="Ingest output (its manifest.json names the train and eval splits).")
    target: str = Field(min_length=1, description="Target model directory (local or s3://).")
    method: Method = Field(description="Head family: eagle3 | peagle | eagle.")
    out: str = Field(min_length=1, description="Where the final head is exported (local dir or s3://).")
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        max_length=128,
        description="Run name; rerunning with the same name and storage resumes (default: derived from "
        "method, data, target and out, so the same command resumes).",
    )
    storage: str = Field(".aerie/train_runs", min_length=1, description="Run storage: checkpoints, results.")
    warm_start: str | None = Field(None, description="Start from this head directory instead of a new head.")

    # the head
    draft_vocab_size: int = Field(32000, ge=2, description="Reduced draft vocabulary (EAGLE-3 / P-EAGLE).")
    num_layers: int | None = Field(None, ge=1, le=16, description="Decoder layers (default: the method's).")
    num_heads: int | None = Field(None, ge=1, le=256, description="Query heads of the head's attention, each as wide "
                                  "as the target's (default: the target's; a multiple of its key/value heads).")
    k: int = Field(5, ge=1, le=16, description="Depth K of the eval agreement, stored as the head's K.")

    # optimisation (aerie.heads.fit.TrainConfig)
    epochs: int | None = Field(
        None, ge=1, le=10_000, description="Passes over the data (default: the automatic budget: at least "
        "min_steps, up to max_epochs, stopping when eval depth-1 agreement stops improving)."
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimiser steps.")
    min_steps: int = Field(120, ge=1, description="Automatic budget: steps trained before early stopping may stop.")
    max_epochs: int = Field(100, ge=1, description="Automatic budget: the most passes over the data.")
    patience: int = Field(4, ge=1, description="Automatic budget: evals without a gain of min_delta in eval_acc_1 "
                          "before stopping.")
    min_delta: float = Field(0.002, ge=0, description="The least eval_acc_1 gain that counts as improvement.")
    batch_size: int = Field(8, ge=1, le=4096, description="Sequences per worker and step.")
    batch_tokens: int | None = Field(
        None, ge=16, description="Token budget per worker and step (padded); replaces batch_size when set."
    )
    max_length: int = Field(2048, ge=8, description="Longer sequences are cut (from the right).")
    lr: float = Field(1e-3, gt=0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.05, ge=0, le=1)
    min_lr_ratio: float = Field(0.05, ge=0, le=1)
    grad_clip: float = Field(0.5, gt=0)
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: the head's forward and loss under bf16 autocast (weights, optimiser state and "
        "the target's labels stay fp32); far cheaper steps on GPUs and on CPUs with bf16 matmuls."
    )
    top1_weight: float = Field(0.3, ge=0, le=1, description="The target's top-1 token's share of the label "
                               "where the head has seen every earlier token (EAGLE-3's steps, P-EAGLE's depth 0; "
                               "the rest: the target's distribution).")
    ttt_steps: int = Field(3, ge=1, le=16, description="EAGLE-3 training-time-test unroll.")
    ttt_decay: float = Field(0.8, gt=0, le=1)
    peagle_depths: int = Field(8, ge=1, le=32, description="The tokens P-EAGLE drafts per forward in "
                               "training: the K to serve it at (on the tiny target a head trained at 5 beat "
                               "one trained at 8 served at 5 or 8, benchmarks/PEAGLE.md).")
    peagle_ratio: float = Field(0.7, gt=0, le=1)
    peagle_ratio_min: float = Field(0.2, gt=0, le=1)
    peagle_top1_weight: float = Field(0.5, ge=0, le=1, description="The target's top-1 token's share of the "
                                      "label at P-EAGLE's blind depths (the rest: the target's distribution).")
    peagle_depth0_weight: float = Field(3.0, gt=0, description="A depth-0 element's weight in P-EAGLE's loss "
                                        "(a blind depth's: 1).")
    peagle_passes: int = Field(1, ge=1, le=8, description="P-EAGLE's forwards per draft, recorded in the head: "
                               "1 blind one, then refining ones whose placeholders read the drafts before them.")
    peagle_fed_ratio: float = Field(0.0, ge=0, le=1, description="The share of P-EAGLE's training anchors whose "
                                    "placeholders read the reply's tokens (what a refining pass reads); "
                                    "needed for peagle_passes > 1.")
    eagle_steps: int = Field(1, ge=1, le=16)
    feature_weight: float = Field(1.0, ge=0)
    token_weight: float = Field(0.1, ge=0)
    seed: int = Field(0, ge=0)

    # cadence
    report_every: int = Field(10, ge=1, description="Steps between metric reports.")
    report_min_seconds: float = Field(
        5.0, ge=0, description="Metric-only reports closer together than this are skipped (Ray's controller "
        "takes one report per RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default; more often stalls training)."
    )
    eval_every: int | None = Field(
        None, ge=0, description="Steps between evals (default: about 20 over the run, at least 10 steps apart; "
        "0: at epoch ends and the end only). Every eval is checkpointed, so the best head can be exported."
    )
    checkpoint_every: int = Field(100, ge=1, description="Steps between checkpoints (also at every epoch end).")
    num_to_keep: int = Field(2, ge=1, description="Checkpoints kept in storage besides the latest (the best by "
                             "eval_acc_1 when there is an eval split).")
    eval_max_examples: int = Field(256, ge=0, description="Eval examples used (the first of the eval split).")
    eval_batch_size: int = Field(8, ge=1)

    # data
    shuffle_buffer: int = Field(256, ge=0, description="Streamed data: each rank's rows are shuffled within "
                                "windows of this many rows (0: none; data held in memory is shuffled whole).")
    cache_data_mb: int = Field(
        256, ge=0, description="Training Parquet up to this size is read once and kept in the object store "
        "(epochs then skip the read); larger data is streamed every epoch. 0: always stream."
    )

    # scaling and fault tolerance
    workers: int = Field(2, ge=1, le=4096)
    use_gpu: bool = False
    cpus_per_worker: float = Field(0.5, gt=0, description="Leave CPU for Ray Data on small machines.")
    gpus_per_worker: float = Field(1.0, gt=0)
    threads_per_worker: int | None = Field(None, ge=1, description="torch CPU threads in each worker.")
    max_failures: int = Field(3, ge=-1, description="Worker-group restarts from the last checkpoint.")
    find_unused_parameters: bool = False
    progress: bool = True

    record_rows: bool = Field(False, description="Audit: keep the row ids of every step in the checkpoints.")

    # tests only: raise in one worker when it reaches this step in an attempt that did not resume
    fail_at_step: int | None = Field(None, ge=1, description="Testing: inject a worker failure at this step.")
    fail_rank: int = Field(0, ge=0, description="Testing: the rank that fails.")

    @field_validator("data", "target", "out", "storage", "warm_start")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        return None if value is None else _check_uri(value)

    @model_validator(mode="after")
    def _consistent(self) -> FitConfig:
        if self.peagle_ratio_min > self.peagle_ratio:
            raise ValueError("peagle_ratio_min must not exceed peagle_ratio")
        if self.peagle_passes > 1 and self.peagle_fed_ratio <= 0:
            raise ValueError("peagle_passes > 1 needs peagle_fed_ratio > 0: a refining pass reads drafted tokens")
        if self.batch_tokens is not None and self.batch_tokens < 3:
            raise ValueError("batch_tokens is too small")
        return self

    # ------------------------------------------------------------------ derived values

    @property
    def early_stopping(self) -> bool:
        """The automatic budget: neither epochs nor max_steps given."""
        return self.epochs is None and self.max_steps is None

    @property
    def run_name(self) -> str:
        """The explicit name, or one derived from what is trained (so the same command resumes)."""
        if self.name:
            return self.name
        key = json.dumps([self.method, self.data, self.target, self.out, self.warm_start])
        return f"{self.method}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    def train_config(self):
        """The `aerie.heads.fit.TrainConfig` of this run."""
        from aerie.heads.fit import TrainConfig

        return TrainConfig(
            epochs=self.epochs or 1,
            batch_size=self.batch_size,
            max_length=self.max_length,
            lr=self.lr,
            betas=tuple(self.betas),
            weight_decay=self.weight_decay,
            warmup_ratio=self.warmup_ratio,
            min_lr_ratio=self.min_lr_ratio,
            grad_clip=self.grad_clip,
            precision=self.precision,
            max_steps=self.max_steps,
            top1_weight=self.top1_weight,
            ttt_steps=self.ttt_steps,
            ttt_decay=self.ttt_decay,
            peagle_depths=self.peagle_depths,
            peagle_ratio=self.peagle_ratio,
            peagle_ratio_min=self.peagle_ratio_min,
            peagle_top1_weight=self.peagle_top1_weight,
            peagle_depth0_weight=self.peagle_depth0_weight,
            peagle_passes=self.peagle_passes,
            peagle_fed_ratio=self.peagle_fed_ratio,
            eagle_steps=self.eagle_steps,
            feature_weight=self.feature_weight,
            token_weight=self.token_weight,
            eval_depth=self.k,
            eval_batch_size=self.eval_batch_size,
            seed=self.seed,
        )

    def with_absolute_paths(self) -> FitConfig:
        """Local paths made absolute (Ray workers do not share the driver's working directory)."""
        updates = {}
        for name in ("data", "target", "out", "storage", "warm_start"):
            value = getattr(self, name)
            if value and not value.startswith("s3://"):
                plain = value[len("file://") :] if value.startswith("file://") else value
                updates[name] = str(Path(plain).expanduser().resolve())
        return self.model_copy(update=updates)


FIELDS = tuple(FitConfig.model_fields)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def format_errors(err: ValidationError) -> str:
    """One line per problem: ``field (--flag): message``."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        if not loc:
            lines.append(f"config: {e['msg']}")
            continue
        field = loc[0]
        where = ".".join(loc)
        hint = f" ({flag(field)})" if field in FitConfig.model_fields else ""
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown field (known: {', '.join(FIELDS)})")
        else:
            lines.append(f"{where}{hint}: {e['msg']}")
    return "\n".join(lines)


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML (or JSON) mapping from a local path or s3:// URI; keys may be spelled like flags."""
    from aerie.config_io import read_mapping

    try:
        data = read_mapping(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_config(config_file: str | None = None, **overrides: Any) -> FitConfig:
    """File values, then every override that is not None; raises ConfigError naming bad fields."""
    values: dict[str, Any] = read_config_file(config_file) if config_file else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return FitConfig.model_validate(values)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from None


STRING_FIELDS = frozenset({"data", "target", "method", "out", "name", "storage", "warm_start"})


def parse_value(text: str, field: str | None = None) -> Any:
    """A flag value as YAML: `3` -> 3, `true` -> True, `[0.9, 0.95]` -> list; paths and names stay
    strings."""
    import yaml

    if field in STRING_FIELDS:
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(value, (dict, type(None))) else value


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """`key=value` pairs (--set) into overrides."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        out[key] = parse_value(value, key)
    return out
