"""`ServeConfig`: one validated configuration of the OpenAI-compatible endpoint (`aerie serve`,
`serve deploy`, the optimize job's deploy stage), and `CaptureConfig` for the endpoint's own
Data Capture.

The model is given one of two ways: a benchmark's `winner.json` (`winner`), or explicitly
(`target` with `method`, `head`, `k`, `tree`, `lookup`). `resolved()` turns either into a `ServedModel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from aerie import storage
from aerie.winner import Winner

Method = Literal["none", "ngram", "eagle3", "peagle", "eagle"]
"""The engine's methods (`aerie.engine.build.METHODS`; a test keeps the two equal)."""
HEAD_METHODS = ("eagle3", "peagle", "eagle")
TREE_METHODS = ("eagle3", "eagle")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def _storage_uri(value: str) -> str:
    if "://" in value and not value.startswith("s3://"):
        raise ValueError("must be a local path or an s3:// URI")
    return value


class CaptureConfig(BaseModel):
    """Where and how the endpoint captures its traffic, in SageMaker Data Capture layout:
    ``<destination>/<endpoint>/<variant>/yyyy/mm/dd/hh/<uuid>.jsonl``."""

    model_config = ConfigDict(extra="forbid")

    destination: str = Field(min_length=1, description="Root folder or s3:// prefix of the capture files.")
    endpoint: str = Field("aerie", pattern=NAME_PATTERN, description="Endpoint name in the layout "
                          "(default: the Serve application's name).")
    variant: str = Field("AllTraffic", pattern=NAME_PATTERN, description="Variant name in the layout.")
    sampling_percentage: float = Field(100.0, ge=0, le=100, description="Share of requests captured, in %.")
    encoding: Literal["JSON", "BASE64"] = Field("JSON", description="How payloads are stored in `data`.")
    flush_seconds: float = Field(5.0, gt=0, description="Buffered events are written at least this often.")
    flush_records: int = Field(1000, ge=1, description="Write as soon as this many events are buffered.")
    max_buffered: int = Field(100_000, ge=1, description="Events held while storage fails; beyond it the "
                              "oldest are dropped (and counted).")

    @field_validator("destination")
    @classmethod
    def _destination(cls, value: str) -> str:
        return _storage_uri(value)

    @property
    def uri(self) -> str:
        """The folder this endpoint's files land in (what `aerie ingest --input` reads)."""
        return storage.join(self.destination, self.endpoint, self.variant)


class AutoscalingConfig(BaseModel):
    """Ray Serve autoscaling, in Serve's own field names."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0, description="Per replica; a replica batches "
                                           "max_slots sequences, so about that many.")
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


@dataclass(frozen=True)
class ServedModel:
    """What a replica serves, however it was configured."""

    target: str
    method: str
    head: str | None
    k: int | str
    tree: bool | None
    lookup: bool
    """Prompt lookup first, the head for the other rows."""
    served_model: str
    """The id clients send as `model` and `/v1/models` lists."""
    k_by_concurrency: dict[int, int] = field(default_factory=dict)


class ServeConfig(BaseModel):
    """The endpoint: which model, where it listens, its limits, replicas and capture."""

    model_config = ConfigDict(extra="forbid")

    winner: str | None = Field(None, description="A benchmark's winner.json (local or s3://): target, "
                               "method, head and K come from it.")
    target: str | None = Field(None, description="Target model directory (local or s3://), without a winner.")
    method: Method | None = Field(None, description="none | ngram | eagle3 | peagle | eagle (default none).")
    head: str | None = Field(None, description="Draft head directory for eagle3 / peagle / eagle.")
    k: int | Literal["auto"] | None = Field(None, description="Draft tokens per step (0: the head's "
                                            "default), or 'auto' (adaptive speculation).")
    tree: bool | None = Field(None, description="Draft a dynamic tree (default: only for eagle).")
    lookup: bool | None = Field(None, description="Prompt lookup first: rows whose context repeats draft by "
                                "lookup, the others with the head (a head's chain only).")

    name: str = Field("aerie", pattern=NAME_PATTERN, description="The Ray Serve application name.")
    model_name: str | None = Field(None, min_length=1, description="The model id clients use "
                                   "(default: the target directory's name).")
    host: str = Field("127.0.0.1", min_length=1, description="HTTP host of Serve's proxy.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of Serve's proxy.")
    route_prefix: str = Field("/", pattern=r"^/", description="Where the application is mounted.")

    max_slots: int = Field(8, ge=1, description="Sequences each replica decodes together (one batch).")
    max_len: int = Field(2048, ge=2, description="Prompt + completion tokens per sequence.")
    max_waiting: int = Field(32, ge=0, description="Requests a replica queues for a slot; beyond it 429.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Longest prompt (default: max_len - 1).")
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest request body (413 beyond it).")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429.")
    api_key: str | None = Field(None, min_length=1, repr=False, description="Require "
                                "`Authorization: Bearer <key>` on /v1/* and /stats.")

    num_replicas: int = Field(1, ge=1, description="Replicas, each with its own engine (without autoscaling).")
    autoscaling: AutoscalingConfig | None = Field(None, description="Ray Serve autoscaling instead of "
                                                  "a fixed num_replicas.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica.")
    capture: CaptureConfig | None = Field(None, description="Data Capture of the endpoint's own traffic.")

    @model_validator(mode="before")
    @classmethod
    def _capture_endpoint(cls, data: Any) -> Any:
        """A capture without an endpoint name is named after the application."""
        if isinstance(data, dict) and isinstance(data.get("capture"), dict) and "endpoint" not in data["capture"]:
            data = {**data, "capture": {**data["capture"], "endpoint": data.get("name", "aerie")}}
        return data

    @field_validator("winner", "target", "head")
    @classmethod
    def _uris(cls, value: str | None) -> str | None:
        return None if value is None else _storage_uri(value)

    @field_validator("k")
    @classmethod
    def _k(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be >= 0 or 'auto'")
        return value

    @model_validator(mode="after")
    def _one_model(self) -> ServeConfig:
        explicit = {"method": self.method, "head": self.head, "k": self.k, "tree": self.tree, "lookup": self.lookup}
        if self.winner is not None:
            if self.target is not None:
                raise ValueError("give winner or target, not both")
            given = [name for name, value in explicit.items() if value is not None]
            if given:
                raise ValueError(
                    f"{given[0]}: comes from the winner file; give winner or target/method/head/k/tree/lookup"
                )
        elif self.target is None:
            raise ValueError("give winner (a winner.json) or target (a model directory)")
        else:
            _check_method(self.method or "none", self.head, self.k, self.tree, bool(self.lookup))
        max_prompt = self.max_prompt_tokens
        if max_prompt is not None and max_prompt >= self.max_len:
            raise ValueError(f"max_prompt_tokens ({max_prompt}) must be < max_len ({self.max_len})")
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas: give num_replicas or autoscaling, not both")
        return self

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else self.max_len - 1

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's per-replica bound: every slot, every waiting place, and room for the quick routes
        and the 429s, so the replica's own queue answers load before Serve queues anything."""
        return self.max_slots + self.max_waiting + 16

    def resolved(self) -> ServedModel:
        """The model to serve, read from the winner file when there is one."""
        if self.winner is not None:
            winner = Winner.load(self.winner)
            _check_method(winner.method, winner.head, winner.k, winner.tree, winner.lookup, where=f"{self.winner}: ")
            target, method, head, k, tree = winner.target, winner.method, winner.head, winner.k, winner.tree
            lookup, table = winner.lookup, dict(winner.k_by_concurrency)
        else:
            target, method, head, k, tree = self.target, self.method or "none", self.head, self.k, self.tree
            lookup, table = bool(self.lookup), {}
        return ServedModel(
            target=target,
            method=method,
            head=head,
            k=0 if k is None else k,
            tree=tree,
            lookup=lookup,
            served_model=self.model_name or model_id(target),
            k_by_concurrency=table,
        )


def model_id(target: str) -> str:
    """A target directory's name: ``.aerie/targets/tiny-llama`` and ``s3://b/m/tiny-llama/`` give
    ``tiny-llama``."""
    return str(target).rstrip("/").rsplit("/", 1)[-1] or str(target)


def _check_method(
    method: str, head: str | None, k: int | str | None, tree: bool | None, lookup: bool = False, where: str = ""
) -> None:
    if method not in HEAD_METHODS + ("none", "ngram"):
        raise ValueError(f"{where}method: unknown method {method!r}")
    if method in HEAD_METHODS and head is None:
        raise ValueError(f"{where}head: method {method} needs a draft head directory")
    if method not in HEAD_METHODS and head is not None:
        raise ValueError(f"{where}head: method {method} takes no head")
    if method == "none" and k not in (None, 0):
        raise ValueError(f"{where}k: method none drafts nothing (k must be 0 or unset)")
    if tree and method not in TREE_METHODS:
        raise ValueError(f"{where}tree: method {method} cannot draft a tree (eagle3 and eagle can)")
    if lookup and (method not in HEAD_METHODS or tree):
        raise ValueError(f"{where}lookup: prompt lookup first goes before a head drafting a chain, not method {method}"
                         + (" drafting a tree" if tree else ""))
