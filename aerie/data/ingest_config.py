"""The validated settings of an ingest run (``aerie ingest``, ``python -m pipelines.ingest``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["IngestConfig", "format_validation_error"]


class IngestConfig(BaseModel):
    """Validated ingest settings; a bad value raises ``ValidationError`` naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str = Field(min_length=1, description="Captured traffic: a local folder/file or s3:// prefix.")
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

    @field_validator("input", "out", "target")
    @classmethod
    def _uri(cls, v: str) -> str:
        if "://" in v and not v.startswith(("s3://", "file://")):
            raise ValueError("must be a local path or an s3:// URI")
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
