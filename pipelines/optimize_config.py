"""The one validated configuration of an optimize run (`aerie optimize`, `python -m pipelines.optimize`).

Each stage keeps its own config model (ingest: `IngestConfig`, train: `FitConfig`, bench:
`BenchConfig`, serve: `ServeConfig`); this file names the run and gives each stage's settings as a
section, minus the paths the run derives (where data, heads, report and winner live). A bad value
is reported with its section: ``train.lr: Input should be greater than 0``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from aerie import storage
from aerie.bench.config import BenchConfig
from aerie.config_io import read_mapping
from aerie.data.ingest_config import IngestConfig
from aerie.serving.config import ServeConfig
from train_jobs.config import FitConfig

Method = Literal["eagle3", "peagle", "eagle"]

# Fields each section may not set: the run derives them.
DERIVED = {
    "ingest": {"input", "target", "out"},
    "train": {"data", "target", "method", "out", "storage", "name", "warm_start"},
    "bench": {"target", "heads", "prompts", "out"},
    "serve": {"winner", "target", "method", "head", "k", "tree", "lookup"},
}
SECTION_MODELS: dict[str, type[BaseModel]] = {
    "ingest": IngestConfig, "train": FitConfig, "bench": BenchConfig, "serve": ServeConfig,
}
PLACEHOLDERS: dict[str, dict[str, Any]] = {
    "ingest": {"input": "in", "target": "t", "out": "o"},
    "train": {"data": "d", "target": "t", "method": "eagle3", "out": "o"},
    "bench": {"target": "t", "prompts": "p", "out": "o"},
    "serve": {"target": "t"},
}


class ContinuousConfig(BaseModel):
    """The next cycle: train on what the live endpoint captured, promote only a measurable gain."""

    model_config = ConfigDict(extra="forbid")

    previous_run: str = Field(min_length=1, description="The run whose endpoint is serving (its folder).")
    margin: float = Field(0.03, ge=0, description="Promote when the new winner's output throughput beats the "
                          "serving head's by more than this share, at the expected concurrency.")
    every_records: int | None = Field(None, ge=1, description="Loop mode: start a cycle whenever this many "
                                      "new records have been captured since the last one.")
    poll_seconds: float = Field(60.0, gt=0, description="Loop mode: how often the capture folder is counted.")
    max_cycles: int | None = Field(None, ge=1, description="Loop mode: stop after this many cycles.")


class OptimizeConfig(BaseModel):
    """Captured traffic -> ingest (regenerated replies) -> heads -> benchmark -> the winner on Ray Serve."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128,
                      description="Run name; its outputs live under <storage>/<name>/ and a rerun resumes it.")
    input: str = Field(min_length=1, description="Captured traffic: folder, s3:// prefix or sagemaker://ENDPOINT.")
    target: str = Field(min_length=1, description="Target model directory (local or s3://).")
    storage: str = Field(".aerie/runs", min_length=1, description="Where runs live (local or s3://).")
    methods: list[Method] | None = Field(
        None, min_length=1, description="Heads to train (default: eagle3 and peagle; eagle for targets "
        "EAGLE-3 does not fit, e.g. Qwen3-Next)."
    )
    deploy: bool = Field(True, description="Deploy the winner on Ray Serve at the end.")
    ingest: dict[str, Any] = Field(default_factory=dict, description="IngestConfig fields (not input/target/out).")
    train: dict[str, Any] = Field(default_factory=dict, description="FitConfig fields for every head.")
    train_per_method: dict[Method, dict[str, Any]] = Field(
        default_factory=dict, description="FitConfig fields for one method, over `train`."
    )
    bench: dict[str, Any] = Field(
        default_factory=dict, description="BenchConfig fields (not target/heads/prompts/out)."
    )
    serve: dict[str, Any] = Field(default_factory=dict, description="ServeConfig fields (not the model fields).")
    continuous: ContinuousConfig | None = Field(None, description="Make this run the next cycle of a serving run.")

    @field_validator("input", "target", "storage")
    @classmethod
    def _uri(cls, value: str) -> str:
        if "://" in value and not value.startswith(("s3://", "file://", "sagemaker://")):
            raise ValueError("must be a local path, an s3:// URI or (input only) sagemaker://ENDPOINT")
        return value

    @model_validator(mode="after")
    def _sections(self) -> OptimizeConfig:
        problems = []
        sections = {"ingest": self.ingest, "train": self.train, "bench": self.bench, "serve": self.serve}
        sections |= {f"train_per_method.{m}": v for m, v in self.train_per_method.items()}
        for label, values in sections.items():
            kind = label.split(".")[0].replace("train_per_method", "train")
            derived = sorted(DERIVED[kind] & set(values))
            if derived:
                problems.append(f"{label}.{derived[0]}: set by the run, not in the config")
                continue
            try:
                placeholders = PLACEHOLDERS[kind] | ({"input": self.input} if kind == "ingest" else {})
                SECTION_MODELS[kind].model_validate({**placeholders, **values})
            except ValidationError as error:
                problems += [
                    f"{label}.{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in error.errors()
                ]
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def root(self) -> str:
        return storage.join(self.storage, self.name)


def load_optimize_config(path: str | None = None, **overrides: Any) -> OptimizeConfig:
    """A YAML file (local or s3://) and flag overrides (not None) -> the validated config."""
    values = read_mapping(path) if path else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return OptimizeConfig.model_validate(values)
