"""`winner.json`: the benchmark's decision, and everything Ray Serve needs to act on it.

The benchmark (`pipelines/benchmark.py`) writes it; `aerie serve --winner FILE` and the optimize
job read it. `k` is what a single static deployment uses (an int, or "auto" for the adaptive
policy); `k_by_concurrency` is the per-load table behind it: the best K measured at each
concurrency level (0: speculation did not pay at that load), which adaptive serving and vLLM's
K-by-batch-size table read.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from aerie import storage


class Winner(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="target model directory (local or s3://)")
    method: str = Field(description="none | ngram | eagle3 | peagle | eagle")
    head: str | None = Field(default=None, description="head directory for head-based methods")
    k: int | Literal["auto"] = Field(default=0, description="draft tokens per step, or 'auto'")
    tree: bool = Field(default=False, description="draft a dynamic tree instead of a chain")
    lookup: bool = Field(default=False, description="prompt lookup first: rows whose context repeats draft by "
                         "lookup, the others with the head")
    k_by_concurrency: dict[int, int] = Field(
        default_factory=dict, description="best K measured at each concurrency (0: no speculation)"
    )
    expected_concurrency: int | None = Field(default=None, description="the load the policy optimised for")
    policy: dict[str, Any] = Field(default_factory=dict, description="the selection rule and its SLA")
    metrics: dict[str, Any] = Field(default_factory=dict, description="the winning cell's measurements")
    report: str | None = Field(default=None, description="where the full report lives")

    @field_validator("k")
    @classmethod
    def _k_non_negative(cls, k: int | str) -> int | str:
        if isinstance(k, int) and k < 0:
            raise ValueError("k must be >= 0 or 'auto'")
        return k

    def save(self, uri: str | os.PathLike[str]) -> None:
        storage.write_text(uri, self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, uri: str | os.PathLike[str]) -> Winner:
        return cls.model_validate_json(storage.read_text(uri))
