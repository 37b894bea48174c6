"""A generation request: what it asks for, and what it has produced so far."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from aerie.engine.metrics import SpecCounters


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, named as in OpenAI's and vLLM's APIs. Invalid settings raise
    ValueError naming the field, before any request is made of them."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        stop_token_ids = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)


class Status(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    slot: int | None = None
    prefilled: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device="cpu")
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def tokens_from(self, start: int) -> list[int]:
        """The tokens at positions `start` and after (prompt, then output)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt :]
        return self.prompt_ids[start:] + self.output_ids


@dataclass
class RequestOutput:
    """What one step produced for one request (streamed to the caller)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    """"stop", "length", "abort", or "error" (then `error` says why; other requests go on)."""
    error: str | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the request's next one, as one."""
        return RequestOutput(
            self.request_id, self.new_token_ids + later.new_token_ids, self.new_text + later.new_text,
            later.finished, later.finish_reason, later.error,
        )
