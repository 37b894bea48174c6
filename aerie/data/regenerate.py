"""Regeneration of one table of encoded rows: every written reply replaced by the target's own.

Ray-free: :func:`regenerate_table` is the body of the ingest job's actor
(``pipelines/regenerate.py``) and works with any ``generate(prompts, params)`` callable.

- every written row (``status == "ok"``), with or without a captured reply, is regenerated from
  its prompt tokens: ``input_ids[:prompt_tokens]``, which :class:`aerie.formats.ChatEncoder`
  rendered with the chat template and the generation prompt, exactly what a server feeds the model;
- the row is rebuilt as ``prompt tokens + generated tokens``, the loss mask 1 on exactly the
  generated tokens (the end-of-turn token included when the reply stopped on it); ``reply`` is
  the generated text, ``original_reply`` the captured one (null for input-only records),
  ``has_reply`` true, ``regenerated`` true, ``finish_reason`` ``stop`` or ``length``;
- the length filter holds: a reply gets at most ``min(max_new_tokens, max_tokens - prompt)``
  tokens; a prompt that leaves no room for a reply becomes ``too_long``;
- a row the engine fails on keeps its captured reply and encoding, with ``regenerated`` false
  and the error in ``detail`` (counted as ``regeneration_failed``); :func:`check_failures` fails
  the job when more than ``max_failure_rate`` of the rows failed, so a broken engine (a device
  mismatch on every forward, say) never passes for a successful ingest;
- the sampling seed of each record is a hash of its id and ``seed``, so a rerun writes the same rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from aerie.formats.chat import STATUS_OK, STATUS_TOO_LONG

__all__ = [
    "RegenerateConfig",
    "RegenerationFailed",
    "record_seed",
    "regenerate_table",
    "count_table",
    "merge_counts",
    "check_failures",
]

REGEN_FIELDS = [
    ("original_reply", pa.string()),
    ("regenerated", pa.bool_()),
    ("finish_reason", pa.string()),
]
NO_ROOM = "no room for a reply within max_tokens"


@dataclass(frozen=True)
class RegenerateConfig:
    """How replies are regenerated. ``max_tokens`` is the row limit (the ingest length filter);
    ``max_new_tokens`` the longest reply."""

    target: str
    max_tokens: int
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    actors: int = 1
    num_gpus: float = 0.0
    max_slots: int = 16
    max_failure_rate: float = 0.01

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.max_tokens < 1 or self.actors < 1 or self.max_slots < 1:
            raise ValueError(f"max_tokens, max_new_tokens, actors and max_slots must be >= 1: {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.num_gpus < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, num_gpus >= 0: {self}")
        if not 0 <= self.max_failure_rate <= 1:
            raise ValueError(f"max_failure_rate must be in [0, 1]: {self}")


class RegenerationFailed(RuntimeError):
    """More rows failed to regenerate than the configured rate allows."""


def record_seed(record_id: str, seed: int) -> int:
    """The sampling seed of one record: independent of batch, block and actor."""
    digest = hashlib.blake2b(f"{seed}:{record_id}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def regenerate_table(batch: pa.Table, generate: Any, cfg: RegenerateConfig) -> pa.Table:
    """Encoded rows -> the same rows with regenerated replies.

    ``generate(prompts, params) -> completions`` is :meth:`aerie.engine.Engine.generate` or a
    stand-in; it is called once for the whole batch and, if that raises, once per row, so one bad
    row fails alone. Rows whose status is not ``ok`` pass through unchanged.
    """
    from aerie.engine import SamplingParams

    cols = {name: batch.column(name).to_pylist() for name in
            ("id", "reply", "input_ids", "loss_mask", "num_tokens", "num_loss_tokens", "prompt_tokens",
             "status", "detail", "has_reply")}
    n = batch.num_rows
    regenerated = [False] * n
    finish: list[str | None] = [None] * n
    original = list(cols["reply"])
    todo, prompts, params = [], [], []
    for i in range(n):
        if cols["status"][i] != STATUS_OK:
            continue
        n_prompt = cols["prompt_tokens"][i]
        budget = min(cfg.max_new_tokens, cfg.max_tokens - n_prompt)
        if budget < 1:
            cols["status"][i], cols["detail"][i] = STATUS_TOO_LONG, NO_ROOM
            cols["input_ids"][i], cols["loss_mask"][i], cols["num_loss_tokens"][i] = [], [], 0
            continue
        if n_prompt < 1:
            cols["detail"][i] = "regeneration failed: empty prompt"
            continue
        todo.append(i)
        prompts.append(cols["input_ids"][i][:n_prompt])
        params.append(SamplingParams(max_tokens=budget, temperature=cfg.temperature, top_p=cfg.top_p,
                                     seed=record_seed(cols["id"][i], cfg.seed)))

    results: list[Any] = [None] * len(todo)
    try:
        results = list(generate(prompts, params)) if todo else []
    except Exception:  # noqa: BLE001 - isolate the failing row(s) below
        for k in range(len(todo)):
            try:
                results[k] = generate([prompts[k]], [params[k]])[0]
            except Exception as e:  # noqa: BLE001 - the row keeps its captured reply
                results[k] = e
    for k, i in enumerate(todo):
        out = results[k]
        if isinstance(out, BaseException):
            cols["detail"][i] = f"regeneration failed: {type(out).__name__}: {out}"[:300]
            continue
        prompt, tokens = prompts[k], list(out.token_ids)
        cols["input_ids"][i] = prompt + tokens
        cols["loss_mask"][i] = [0] * len(prompt) + [1] * len(tokens)
        cols["num_tokens"][i] = len(prompt) + len(tokens)
        cols["num_loss_tokens"][i] = len(tokens)
        cols["reply"][i] = out.text
        cols["has_reply"][i] = True
        regenerated[i] = True
        finish[i] = out.finish_reason

    out_table = batch
    for name, values in cols.items():
        if name == "id":
            continue
        idx = out_table.schema.get_field_index(name)
        field = out_table.schema.field(idx)
        out_table = out_table.set_column(idx, field, pa.array(values, type=field.type))
    for (name, typ), values in zip(REGEN_FIELDS, (original, regenerated, finish), strict=True):
        out_table = out_table.append_column(pa.field(name, typ), pa.array(values, type=typ))
    return out_table


COUNT_KEYS = ("regenerated", "regeneration_failed", "no_room", "generated_tokens", "stopped", "input_only")
MAX_ERRORS = 5


def count_table(batch: pa.Table) -> dict[str, Any]:
    """Counts over regenerated rows: regenerated, regeneration_failed (with the first few errors),
    no_room (moved to too_long), generated_tokens, stopped (on the end-of-turn token), input_only
    (regenerated rows that had no captured reply)."""
    if batch.num_rows == 0:
        return {**{k: 0 for k in COUNT_KEYS}, "errors": []}
    ok = pc.fill_null(pc.equal(batch.column("status"), STATUS_OK), False)
    done = pc.fill_null(batch.column("regenerated"), False)
    fails = batch.filter(pc.and_(ok, pc.invert(done)))
    return {
        "regenerated": pc.sum(done).as_py() or 0,
        "regeneration_failed": fails.num_rows,
        "no_room": pc.sum(pc.fill_null(pc.equal(batch.column("detail"), NO_ROOM), False)).as_py() or 0,
        "generated_tokens": pc.sum(pc.if_else(done, batch.column("num_loss_tokens"), 0)).as_py() or 0,
        "stopped": pc.sum(pc.fill_null(pc.equal(batch.column("finish_reason"), "stop"), False)).as_py() or 0,
        "input_only": pc.sum(pc.and_(done, pc.is_null(batch.column("original_reply")))).as_py() or 0,
        "errors": fails.column("detail").to_pylist()[:MAX_ERRORS],
    }


def merge_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of :func:`count_table` results, with ``truncated`` (replies cut at the length cap)."""
    total: dict[str, Any] = {k: sum(p[k] for p in parts) for k in COUNT_KEYS}
    total["truncated"] = total["regenerated"] - total["stopped"]
    total["errors"] = [e for p in parts for e in p["errors"]][:MAX_ERRORS]
    return total


def check_failures(counts: dict[str, Any], max_failure_rate: float) -> None:
    """Raise :class:`RegenerationFailed` (the count and the first error) when more than
    ``max_failure_rate`` of the rows sent to the engine failed."""
    failed = counts["regeneration_failed"]
    attempted = failed + counts["regenerated"]
    if failed and failed > max_failure_rate * attempted:
        first = counts["errors"][0] if counts["errors"] else "no message"
        raise RegenerationFailed(
            f"regeneration failed for {failed} of {attempted} rows ({failed / attempted:.1%}, more than the "
            f"allowed {max_failure_rate:.1%}); first error: {first}"
        )
