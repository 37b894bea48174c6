"""The one validated configuration of a benchmark run (`aerie bench`, `python -m pipelines.benchmark`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

HeadMethod = Literal["eagle3", "peagle", "eagle"]
KValue = int | Literal["auto"]
AUTO = "auto"
NGRAM_K = 4


def _check_uri(value: str) -> str:
    if "://" in value and not value.startswith(("s3://", "file://")):
        raise ValueError("must be a local path or an s3:// URI")
    return value


class WinnerPolicy(BaseModel):
    """How the winner is chosen: the highest output throughput at `expected_concurrency` among the
    lossless variants that meet the SLA (a p99 TPOT and/or p99 TTFT bound, in ms)."""

    model_config = ConfigDict(extra="forbid")

    expected_concurrency: int | None = Field(
        None, ge=1, description="The load to optimise for (default: the highest concurrency measured)."
    )
    sla_p99_tpot_ms: float | None = Field(None, gt=0, description="Variants above this p99 TPOT (ms) cannot win.")
    sla_p99_ttft_ms: float | None = Field(None, gt=0, description="Variants above this p99 TTFT (ms) cannot win.")


class BenchConfig(BaseModel):
    """Everything a benchmark run needs. Paths may be local or s3://."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1, description="Target model directory (local or s3://).")
    heads: dict[HeadMethod, str] = Field(
        default_factory=dict, description="Draft heads to measure: method (eagle3 | peagle | eagle) -> head directory."
    )
    prompts: str = Field(
        min_length=1, description="An `aerie ingest` output (its eval split is used: the user's own traffic) "
        "or a .jsonl prompts file ({\"messages\"} or {\"prompt\"} records).",
    )
    out: str = Field(min_length=1, description="Report folder (local or s3://).")
    concurrency: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8], min_length=1, description="Closed-loop client counts (max_concurrency)."
    )
    k: list[KValue] = Field(
        default_factory=lambda: [2, 3, 5], min_length=1,
        description="Draft tokens per step for every head (a tree's depth for eagle); 'auto': adaptive speculation.",
    )
    k_per_method: dict[Literal["ngram", "eagle3", "peagle", "eagle"], list[KValue]] = Field(
        default_factory=dict, description=f"K for one method instead of `k` (ngram default: [{NGRAM_K}]).",
    )
    ngram: bool = Field(True, description="Measure prompt lookup (n-gram drafts, no head): the training-free bar.")
    lookup_first: bool = Field(
        True, description="Also measure each head drafting a chain after prompt lookup (`eagle3+lookup`): rows "
        "whose last tokens occurred before draft what followed them, the others with the head.",
    )
    requests: int = Field(16, ge=1, description="Measured requests per cell (variant x K x concurrency x round).")
    warmup: int | None = Field(
        None, ge=0, description="Requests per cell before the measured ones, not measured (default: one per client)."
    )
    repeats: int = Field(3, ge=1, description="Rounds; every variant runs once per round, interleaved.")
    max_tokens: int = Field(64, ge=1, description="New tokens per request (greedy, temperature 0).")
    max_prompts: int = Field(64, ge=1, description="Prompts read (the first of the eval split or file); round r "
                             "measures prompts r x requests onwards, wrapping around.")
    ignore_eos: bool = Field(False, description="Generate max_tokens even past the end-of-turn token.")
    peers: bool = Field(False, description="Also measure Hugging Face generate: greedy, and prompt lookup.")
    lookup_tokens: int = Field(10, ge=1, description="prompt_lookup_num_tokens of the HF prompt-lookup peer.")
    incumbent: str | None = Field(
        None, description="winner.json of the serving deployment: measured as the variant 'incumbent'."
    )
    expected_concurrency: int | None = Field(
        None, ge=1, description="Winner policy: the load to optimise for (default: the highest concurrency)."
    )
    sla_p99_tpot_ms: float | None = Field(None, gt=0, description="Winner policy: the most p99 TPOT (ms) it may have.")
    sla_p99_ttft_ms: float | None = Field(None, gt=0, description="Winner policy: the most p99 TTFT (ms) it may have.")
    num_cpus: float = Field(
        0.1, ge=0, description="CPUs reserved per engine actor (cells run one at a time, so a share is enough).",
    )
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs per engine actor (every actor lives on one node; 1/actors to share one GPU).",
    )
    threads: int = Field(1, ge=0, description="torch CPU threads per engine actor (0: torch's default).")
    runtime_env: dict[str, Any] | None = Field(
        None, description="Extra Ray runtime_env for the engine actors (its env_vars join the driver's S3 settings).",
    )
    placement_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for the cluster to fit every engine actor on one node.",
    )
    progress: bool = Field(True, description="Progress bars (Ray's tqdm) while cells run.")

    @field_validator("target", "prompts", "out", "incumbent")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        return None if value is None else _check_uri(value)

    @field_validator("heads")
    @classmethod
    def _head_dirs(cls, heads: dict[str, str]) -> dict[str, str]:
        for method, path in heads.items():
            if not path:
                raise ValueError(f"{method}: empty head directory")
            _check_uri(path)
        return heads

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, levels: list[int]) -> list[int]:
        if any(c < 1 for c in levels):
            raise ValueError("every concurrency must be >= 1")
        if len(set(levels)) != len(levels):
            raise ValueError("concurrency levels must be distinct")
        return sorted(levels)

    @field_validator("k")
    @classmethod
    def _k(cls, ks: list[KValue]) -> list[KValue]:
        return _check_ks(ks)

    @field_validator("k_per_method")
    @classmethod
    def _k_per_method(cls, table: dict[str, list[KValue]]) -> dict[str, list[KValue]]:
        for method, ks in table.items():
            if not ks:
                raise ValueError(f"{method}: give at least one K")
            try:
                _check_ks(ks)
            except ValueError as e:
                raise ValueError(f"{method}: {e}") from None
        return table

    @model_validator(mode="after")
    def _policy(self) -> BenchConfig:
        if self.expected_concurrency is not None and self.expected_concurrency not in self.concurrency:
            raise ValueError(
                f"expected_concurrency {self.expected_concurrency} is not one of the measured concurrency levels "
                f"{self.concurrency}"
            )
        if self.peers and 1 not in self.concurrency:
            raise ValueError("peers run at concurrency 1: add 1 to concurrency")
        if self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError("num_cpus and num_gpus are both 0: an engine actor must reserve some CPU or GPU")
        return self

    def ks_for(self, method: str) -> list[KValue]:
        if method in self.k_per_method:
            return self.k_per_method[method]
        return [NGRAM_K] if method == "ngram" else self.k

    def policy(self) -> WinnerPolicy:
        return WinnerPolicy(
            expected_concurrency=self.expected_concurrency or max(self.concurrency),
            sla_p99_tpot_ms=self.sla_p99_tpot_ms,
            sla_p99_ttft_ms=self.sla_p99_ttft_ms,
        )

    def warmup_for(self, concurrency: int) -> int:
        return concurrency if self.warmup is None else self.warmup


def _check_ks(ks: list[KValue]) -> list[KValue]:
    for k in ks:
        if k != AUTO and k < 1:
            raise ValueError(f"K must be >= 1 or 'auto', got {k}")
    if len(set(ks)) != len(ks):
        raise ValueError("K values must be distinct")
    return ks
