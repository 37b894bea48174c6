"""Regeneration: replace captured replies with what the target itself says (Ray Data actor pool).

A draft head learns to predict the target's next tokens. Captured replies come from whatever
served the traffic (another model, another version, a sampler with other settings), so training
on them teaches the head a distribution the target does not produce, and acceptance suffers.
Regenerating every reply with the target closes that gap: the head is trained on exactly the
tokens it will be asked to guess.

Used by ``pipelines/ingest.py --regenerate`` on the encoded rows (before the write):

- every written row (``status == "ok"``), with or without a captured reply, is regenerated from
  its prompt tokens: ``input_ids[:prompt_tokens]``, which :class:`aerie.formats.ChatEncoder`
  rendered with the chat template and the generation prompt, exactly what a server feeds the model;
- an actor pool (``ActorPoolStrategy(size=actors)``, ``num_gpus`` per actor) runs the engine:
  each actor loads the target once and sends a whole block of prompts through
  :meth:`aerie.engine.Engine.generate` (continuous batching over ``max_slots`` slots);
- the row is rebuilt as ``prompt tokens + generated tokens``, the loss mask 1 on exactly the
  generated tokens (the end-of-turn token included when the reply stopped on it); ``reply`` is
  the generated text, ``original_reply`` the captured one (null for input-only records),
  ``has_reply`` true, ``regenerated`` true, ``finish_reason`` ``stop`` or ``length``;
- the length filter holds: a reply gets at most ``min(max_new_tokens, max_tokens - prompt)``
  tokens; a prompt that leaves no room for a reply becomes ``too_long``;
- a row the engine fails on keeps its captured reply and encoding, with ``regenerated`` false
  and the error in ``detail`` (counted as ``regeneration_failed``);
- the sampling seed of each record is a hash of its id and ``seed``, and blocks are cut the same
  way on every run, so a rerun writes the same rows (greedy by default).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from aerie import storage
from aerie.formats.chat import STATUS_OK, STATUS_TOO_LONG

REGEN_FIELDS = [
    ("original_reply", pa.string()),
    ("regenerated", pa.bool_()),
    ("finish_reason", pa.string()),
]
BLOCK_ROWS = 256  # prompts per actor call: enough to keep the engine's slots full between blocks
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

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.max_tokens < 1 or self.actors < 1 or self.max_slots < 1:
            raise ValueError(f"max_tokens, max_new_tokens, actors and max_slots must be >= 1: {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.num_gpus < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, num_gpus >= 0: {self}")


def record_seed(record_id: str, seed: int) -> int:
    """The sampling seed of one record: independent of batch, block and actor."""
    digest = hashlib.blake2b(f"{seed}:{record_id}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def regenerate_table(batch: pa.Table, generate: Any, cfg: RegenerateConfig) -> pa.Table:
    """Encoded rows -> the same rows with regenerated replies (Ray-free; the actor's body).

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


class Regenerator:
    """One actor of the pool: loads the target once, then regenerates whole blocks."""

    def __init__(self, cfg: RegenerateConfig) -> None:
        import torch

        from aerie.engine import Engine, EngineConfig
        from aerie.target import load_target

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        device = "cuda" if cfg.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.cfg = cfg
        self.target = load_target(str(storage.download(cfg.target)), device=device)
        self._config = EngineConfig(max_slots=cfg.max_slots, max_len=cfg.max_tokens)
        self._engine_cls = Engine
        self.engine = Engine(self.target, self._config)

    def _generate(self, prompts: list[list[int]], params: list[Any]) -> list[Any]:
        try:
            return self.engine.generate(prompts, params)
        except Exception:
            self.engine = self._engine_cls(self.target, self._config)  # a fresh cache and scheduler
            raise

    def __call__(self, batch: pa.Table) -> pa.Table:
        return regenerate_table(batch, self._generate, self.cfg)


def regenerate(ds: ray.data.Dataset, cfg: RegenerateConfig) -> tuple[ray.data.Dataset, dict[str, Any]]:
    """Encoded rows (as :func:`pipelines.ingest.encode` makes them) -> the materialised data set
    with regenerated replies, and its summary (counts, seconds, records/s) for the manifest."""
    t0 = time.monotonic()
    rows = ds.count()
    if rows == 0:
        zero = {"regenerated": 0, "regeneration_failed": 0, "no_room": 0, "generated_tokens": 0, "stopped": 0,
                "truncated": 0, "input_only": 0, "errors": []}
        return ds, {**zero, "seconds": 0.0, "records_per_s": None, "generated_tokens_per_s": None,
                    "settings": {k: v for k, v in asdict(cfg).items() if k != "target"}}
    blocks = max(2 * cfg.actors, math.ceil(rows / BLOCK_ROWS), 1)
    # Cut the blocks first, in their own execution: split tasks need CPUs that the actors would
    # otherwise hold (on a 2-CPU machine that deadlocks).
    ds = ds.repartition(blocks).materialize()
    out = (
        ds.map_batches(
            Regenerator,
            fn_constructor_kwargs={"cfg": cfg},
            compute=ray.data.ActorPoolStrategy(size=cfg.actors),
            num_gpus=cfg.num_gpus or None,
            batch_size=None,  # one whole block per call: the engine batches it
            batch_format="pyarrow",
        )
        .materialize()
    )
    seconds = time.monotonic() - t0
    summary = summarize(out)
    summary.update(
        seconds=round(seconds, 3),
        records_per_s=round(summary["regenerated"] / seconds, 2) if seconds else None,
        generated_tokens_per_s=round(summary["generated_tokens"] / seconds, 1) if seconds else None,
        settings={k: v for k, v in asdict(cfg).items() if k != "target"},
    )
    return out, summary


def summarize(ds: ray.data.Dataset) -> dict[str, Any]:
    """Counts over regenerated rows: regenerated, regeneration_failed (with a few of the errors),
    no_room (moved to too_long), generated_tokens, stopped / truncated (on the end-of-turn token or
    at the length cap), input_only (regenerated rows that had no captured reply)."""
    regenerated = failed = no_room = tokens = stopped = input_only = 0
    errors: list[str] = []
    columns = ["status", "detail", "regenerated", "finish_reason", "num_loss_tokens", "original_reply"]
    for batch in ds.select_columns(columns).iter_batches(batch_format="pyarrow", batch_size=None):
        if batch.num_rows == 0:
            continue
        ok = pc.fill_null(pc.equal(batch.column("status"), STATUS_OK), False)
        done = pc.fill_null(batch.column("regenerated"), False)
        regenerated += pc.sum(done).as_py() or 0
        input_only += pc.sum(pc.and_(done, pc.is_null(batch.column("original_reply")))).as_py() or 0
        tokens += pc.sum(pc.if_else(done, batch.column("num_loss_tokens"), 0)).as_py() or 0
        stopped += pc.sum(pc.fill_null(pc.equal(batch.column("finish_reason"), "stop"), False)).as_py() or 0
        no_room += pc.sum(pc.fill_null(pc.equal(batch.column("detail"), NO_ROOM), False)).as_py() or 0
        fails = batch.filter(pc.and_(ok, pc.invert(done)))
        failed += fails.num_rows
        errors += fails.column("detail").to_pylist()[: max(0, 5 - len(errors))]
    return {
        "regenerated": regenerated,
        "regeneration_failed": failed,
        "no_room": no_room,
        "generated_tokens": tokens,
        "stopped": stopped,
        "truncated": regenerated - stopped,
        "input_only": input_only,
        "errors": errors,
    }
