"""Regeneration as a Ray Data actor pool: replace captured replies with what the target itself says.

A draft head learns to predict the target's next tokens; captured replies come from whatever
served the traffic, so training on them teaches the head a distribution the target does not
produce. ``pipelines/ingest.py --regenerate`` sends the encoded rows through :func:`regenerate`:
an actor pool (``ActorPoolStrategy(size=actors)``, ``num_gpus`` per actor) where each actor loads
the target once and sends a whole block of prompts through :meth:`aerie.engine.Engine.generate`
(continuous batching over ``max_slots`` slots). What happens to a row is
:func:`aerie.data.regenerate.regenerate_table`; blocks are cut the same way on every run, so a
rerun writes the same rows. More failed rows than ``max_failure_rate`` fail the job
(:class:`aerie.data.regenerate.RegenerationFailed`) with the count and the first error.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from typing import Any

import pyarrow as pa
import ray

from aerie import storage
from aerie.data.regenerate import RegenerateConfig, check_failures, count_table, merge_counts, regenerate_table

BLOCK_ROWS = 256  # prompts per actor call: enough to keep the engine's slots full between blocks


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
    with regenerated replies, and its summary (counts, seconds, records/s) for the manifest.
    Raises :class:`aerie.data.regenerate.RegenerationFailed` above the failure rate."""
    t0 = time.monotonic()
    settings = {k: v for k, v in asdict(cfg).items() if k != "target"}
    rows = ds.count()
    if rows == 0:
        return ds, {**merge_counts([]), "seconds": 0.0, "records_per_s": None, "generated_tokens_per_s": None,
                    "settings": settings}
    blocks = max(2 * cfg.actors, math.ceil(rows / BLOCK_ROWS), 1)
    # Cut the blocks first, in their own execution: split tasks need CPUs that the actors would
    # otherwise hold (on a 2-CPU machine that deadlocks).
    ds = ds.repartition(blocks).materialize()
    out = ds.map_batches(
        Regenerator,
        fn_constructor_kwargs={"cfg": cfg},
        compute=ray.data.ActorPoolStrategy(size=cfg.actors),
        num_gpus=cfg.num_gpus or None,
        batch_size=None,  # one whole block per call: the engine batches it
        batch_format="pyarrow",
        runtime_env={"env_vars": storage.worker_env()},  # the driver's S3, whenever Ray started
    ).materialize()
    seconds = time.monotonic() - t0
    summary = summarize(out)
    check_failures(summary, cfg.max_failure_rate)
    summary.update(
        seconds=round(seconds, 3),
        records_per_s=round(summary["regenerated"] / seconds, 2) if seconds else None,
        generated_tokens_per_s=round(summary["generated_tokens"] / seconds, 1) if seconds else None,
        settings=settings,
    )
    return out, summary


def summarize(ds: ray.data.Dataset) -> dict[str, Any]:
    """:func:`aerie.data.regenerate.count_table` over every block, merged (on the driver)."""
    columns = ["status", "detail", "regenerated", "finish_reason", "num_loss_tokens", "original_reply"]
    batches = ds.select_columns(columns).iter_batches(batch_format="pyarrow", batch_size=None)
    return merge_counts([count_table(batch) for batch in batches])
