"""The validated settings of an ingest run (``aerie ingest``, ``python -m pipelines.ingest``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from aerie import sagemaker

__all__ = ["IngestConfig", "format_validation_error"]


class IngestConfig(BaseModel):
    """Validated ingest settings; a bad value raises ``ValidationError`` naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str | list[str] = Field(
        description="Captured traffic: a local folder/file, an s3:// prefix or "
        "sagemaker://ENDPOINT[/VARIANT] (its Data Capture files); or a list of them, read together."
    )
    since: str | None = Field(
        None, description="sagemaker:// inputs: only the hours from this ISO time or duration back (24h, 7d) on."
    )
    target: str = Field(min_length=1, description="Target model directory (its tokenizer and chat template).")
    out: str = Field(min_length=1, description="Output folder or s3:// prefix.")
    max_tokens: int = Field(2048, ge=8, le=1_048_576, description="Longest example kept, in tokens.")
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of records (by id hash) for eval; 0: none.")
    eval_min_records: int = Field(
        16, ge=0, description="Eval holds at least this many records, up to a quarter of them (a figure "
        "over a handful of rows is noise)."
    )
    max_line_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Longer raw lines are quarantined.")
    batch_size: int = Field(1024, ge=1, le=65536, description="Rows per encode batch.")
    progress: bool = Field(True, description="Show Ray Data progress bars.")
    regenerate: bool = Field(False, description="Replace every reply with the target's own (recommended).")
    regenerate_max_tokens: int = Field(512, ge=1, description="Longest regenerated reply, in tokens.")
    regenerate_temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    regenerate_seed: int = Field(0, description="Per-record seeds are hashed from this and the record id.")
    regenerate_actors: int = Field(1, ge=1, description="Engine actors in the regeneration pool.")
    regenerate_num_gpus: float = Field(0.0, ge=0.0, description="GPUs per regeneration actor (1 on a GPU cluster).")
    regenerate_max_slots: int = Field(16, ge=1, description="Concurrent sequences per engine.")
    regenerate_max_failure_rate: float = Field(
        0.01, ge=0.0, le=1.0, description="Share of rows the engine may fail on before the job fails."
    )

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: str | list[str]) -> str | list[str]:
        if not v:
            raise ValueError("needs at least one input")
        for uri in [v] if isinstance(v, str) else v:
            if sagemaker.is_sagemaker(uri):
                sagemaker.parse_uri(uri)
            else:
                _check_uri(uri, "a local path, an s3:// URI or sagemaker://ENDPOINT[/VARIANT]")
        return v

    @field_validator("out", "target")
    @classmethod
    def _uri(cls, v: str) -> str:
        return _check_uri(v, "a local path or an s3:// URI")

    @field_validator("since")
    @classmethod
    def _since(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        sagemaker.parse_since(v)
        inputs = info.data.get("input")
        if inputs is not None and not any(sagemaker.is_sagemaker(u) for u in ([inputs] if isinstance(inputs, str)
                                                                              else inputs)):
            raise ValueError("applies to sagemaker:// inputs only")
        return v

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def _check_uri(v: str, expected: str) -> str:
    if not v:
        raise ValueError("must not be empty")
    if "://" in v and not v.startswith(("s3://", "file://")):
        raise ValueError(f"must be {expected}")
    if v.startswith("s3://") and len(v.rstrip("/")) <= len("s3://"):
        raise ValueError("s3:// URI needs a bucket")
    return v


def format_validation_error(err: ValidationError) -> str:
    """``--max-tokens: Input should be greater than or equal to 8`` style lines."""
    lines = []
    for e in err.errors():
        name = ".".join(str(p) for p in e["loc"]) or "config"
        lines.append(f"--{name.replace('_', '-')}: {e['msg']}")
    return "\n".join(lines)
