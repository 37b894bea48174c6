"""Captured traffic -> tokenized training data, with every record accounted for (Ray Data).

    python -m pipelines.ingest --input s3://bucket/capture/ --target DIR --out s3://bucket/data/

Stages (Ray Data; the parsed and the encoded data sets are materialised so each stage is counted):

1. read: every ``*.jsonl`` / ``*.jsonl.gz`` under ``--input`` (local or ``s3://``, recursive), one
   file per row; lines keep their raw bytes, source file and line number. A ``.gz`` file is
   decompressed in the parse task, so a corrupt one becomes a quarantine row, not a crash.
2. parse (parallel tasks): :func:`aerie.formats.parse_line`, the format auto-detected per line.
   Failures become quarantine rows with the reason code.
3. dedupe: exact duplicates of (kind, messages, reply) are dropped; the first by (source, line)
   stays. The decision is taken on the driver from a three-column projection (content key,
   source, line: ~60 bytes a record) and applied inside the encode tasks. (Ray's hash-shuffle
   ``repartition(keys=...)`` works too, but starts aggregator actors: seconds per run on 2 cores.)
4. encode (parallel tasks, one cached tokenizer per worker process): the target's chat template,
   token ids, the loss mask (1 on the reply tokens and the end-of-turn token only), the length
   filter (``--max-tokens``) and a deterministic train/eval split from a hash of the record id.
   Template failures are quarantined.
4b. regenerate (``--regenerate``, optional, recommended): every written row's reply is replaced by
   what the target itself generates for the prompt, in an actor pool (see ``pipelines/regenerate.py``).
5. write: Parquet ``<out>/train/`` and ``<out>/eval/`` and JSONL ``<out>/quarantine/`` (replaced on
   every run, never appended to), then ``<out>/manifest.json`` with the counts per stage.

Accounting (checked before the manifest is written)::

    parsed + quarantined + duplicates + too_long == read

``read`` counts non-blank input lines (plus one per unreadable file); ``quarantined`` every record
rejected by the parser or the chat template; ``duplicates`` the exact duplicates dropped;
``too_long`` records over ``--max-tokens``; ``parsed`` the records that came through every stage,
i.e. those written (``parsed == written.train + written.eval``). Input-only records (no captured
reply) are written with ``has_reply = false`` and an all-zero loss mask, for regeneration later.
With ``--regenerate`` every written row carries the target's own reply (``regenerated`` true,
``original_reply`` the captured one); a row the engine fails on keeps its captured reply and is
counted in ``regeneration_failed``; a prompt that leaves no room for a reply counts as too long.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from aerie import storage
from aerie.formats import ChatEncoder
from aerie.formats.chat import STATUS_OK, STATUS_TOO_LONG
from aerie.formats.tables import (
    encode_rows,
    parse_files,
    quarantine_from_encode,
    quarantine_from_parse,
)
from pipelines.regenerate import RegenerateConfig, regenerate

INPUT_SUFFIXES = (".jsonl", ".jsonl.gz")


class IngestConfig(BaseModel):
    """Validated ingest settings; a bad value raises ``ValidationError`` naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str = Field(min_length=1, description="Captured traffic: a local folder/file or s3:// prefix.")
    target: str = Field(min_length=1, description="Target model directory (its tokenizer and chat template).")
    out: str = Field(min_length=1, description="Output folder or s3:// prefix.")
    max_tokens: int = Field(2048, ge=8, le=1_048_576, description="Longest example kept, in tokens.")
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of records (by id hash) for eval.")
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


# ----------------------------------------------------------------------------- stage UDFs


def read_and_parse_files(batch: pa.Table, *, filesystem: Any, max_line_bytes: int) -> pa.Table:
    """``{path, uri}`` rows (one per input file) -> one parsed row per non-blank line."""
    files = zip(batch.column("path").to_pylist(), batch.column("uri").to_pylist(), strict=True)
    return parse_files(files, filesystem, max_line_bytes)


_ENCODERS: dict[str, ChatEncoder] = {}
_DROPS: dict[str, dict[str, set[int]]] = {}


def _cached_encoder(tokenizer_ref: Any, max_tokens: int) -> ChatEncoder:
    """One ChatEncoder per worker process and tokenizer (Ray reuses warm workers between tasks)."""
    key = f"{tokenizer_ref.hex() if hasattr(tokenizer_ref, 'hex') else id(tokenizer_ref)}:{max_tokens}"
    enc = _ENCODERS.get(key)
    if enc is None:
        _ENCODERS.clear()  # one run at a time: keep only the latest tokenizer
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tok = ray.get(tokenizer_ref) if isinstance(tokenizer_ref, ray.ObjectRef) else tokenizer_ref
        enc = _ENCODERS[key] = ChatEncoder(tok, max_tokens=max_tokens)
    return enc


def _cached_drop(drop_ref: Any) -> dict[str, set[int]]:
    if not isinstance(drop_ref, ray.ObjectRef):
        return drop_ref or {}
    key = drop_ref.hex()
    if key not in _DROPS:
        _DROPS.clear()
        _DROPS[key] = ray.get(drop_ref)
    return _DROPS[key]


def encode_batch(
    batch: pa.Table, *, tokenizer_ref: Any, max_tokens: int, eval_fraction: float, drop_ref: Any = None
) -> pa.Table:
    """Parsed rows -> encoded rows (:func:`aerie.formats.tables.encode_rows`), with the tokenizer
    and the duplicate list fetched once per worker process."""
    return encode_rows(batch, _cached_encoder(tokenizer_ref, max_tokens), eval_fraction, _cached_drop(drop_ref))


def _where(column: str, value: Any, *, negate: bool = False):
    def fn(batch: pa.Table) -> pa.Table:
        mask = pc.equal(batch.column(column), pa.scalar(value))
        mask = pc.fill_null(mask, False)
        return batch.filter(pc.invert(mask) if negate else mask)

    fn.__name__ = f"where_{column}_{'not_' if negate else ''}{value}"
    return fn


def _where_status_in(values: set[str]):
    def fn(batch: pa.Table) -> pa.Table:
        mask = pc.fill_null(pc.is_in(batch.column("status"), value_set=pa.array(sorted(values))), False)
        return batch.filter(mask)

    return fn


def _tally(ds: ray.data.Dataset, columns: list[str]) -> dict[tuple, int]:
    """Counts of each combination of ``columns`` values, on the driver (small columns only)."""
    out: dict[tuple, int] = {}
    for batch in ds.select_columns(columns).iter_batches(batch_format="pyarrow", batch_size=None):
        if batch.num_rows == 0:
            continue
        grouped = batch.group_by(columns).aggregate([([], "count_all")])
        for row in grouped.to_pylist():
            key = tuple(row[c] for c in columns)
            out[key] = out.get(key, 0) + int(row["count_all"])
    return out


# ----------------------------------------------------------------------------- building blocks


def list_inputs(uri: str) -> list[str]:
    files = storage.list_files(uri, INPUT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no {' or '.join(INPUT_SUFFIXES)} files under {uri}")
    return files


def read_and_parse(files: list[str], max_line_bytes: int = 16 * 1024 * 1024) -> ray.data.Dataset:
    """Files (URIs from :func:`list_inputs`, all on one file system) -> the parsed data set (ok and
    failed rows). One task per file; the driver's file system object (S3 endpoint, credentials)
    travels with the tasks, so workers read exactly what the driver listed."""
    fs, _ = storage.resolve(files[0])
    items = [{"path": storage.resolve(f)[1], "uri": f} for f in files]
    ds = ray.data.from_items(items, override_num_blocks=min(len(items), 4096))
    return ds.map_batches(
        read_and_parse_files,
        batch_format="pyarrow",
        batch_size=None,
        fn_kwargs={"filesystem": fs, "max_line_bytes": max_line_bytes},
    )


def scan_parsed(ds: ray.data.Dataset) -> tuple[dict[str, int], dict[str, set[int]], int]:
    """One pass over a thin projection of the parsed rows (on the driver, ~50 bytes a row).

    Returns the quarantine counts by reason, the duplicates to drop (``{source: {line, ...}}``:
    every row whose content key was seen before, in (source, line) order) and the number of
    duplicates.
    """
    reasons: dict[str, int] = {}
    parts = []
    for batch in ds.select_columns(["ok", "reason", "content_key", "source", "line"]).iter_batches(
        batch_format="pyarrow", batch_size=None
    ):
        for item in pc.value_counts(batch.column("reason")).to_pylist():
            if item["values"] is not None:
                reasons[item["values"]] = reasons.get(item["values"], 0) + int(item["counts"])
        ok = batch.filter(pc.fill_null(batch.column("ok"), False))
        parts.append(ok.select(["content_key", "source", "line"]))
    drop: dict[str, set[int]] = {}
    if not parts:
        return reasons, drop, 0
    thin = pa.concat_tables(parts)
    counts = thin.group_by("content_key").aggregate([("line", "count")])
    dup_keys = counts.filter(pc.greater(counts.column("line_count"), 1)).column("content_key")
    if len(dup_keys) == 0:
        return reasons, drop, 0
    dups = thin.filter(pc.is_in(thin.column("content_key"), value_set=dup_keys))
    dups = dups.sort_by([("content_key", "ascending"), ("source", "ascending"), ("line", "ascending")])
    keys = dups.column("content_key").to_pylist()
    sources = dups.column("source").to_pylist()
    lines = dups.column("line").to_pylist()
    n = 0
    for i in range(1, len(keys)):
        if keys[i] == keys[i - 1]:
            drop.setdefault(sources[i], set()).add(lines[i])
            n += 1
    return reasons, drop, n


def encode(
    ds: ray.data.Dataset,
    tokenizer: Any,
    *,
    max_tokens: int,
    eval_fraction: float = 0.0,
    batch_size: int | None = 1024,
    drop: dict[str, set[int]] | None = None,
) -> ray.data.Dataset:
    """Parsed rows -> encoded rows, in parallel tasks (the tokenizer travels once, by reference).

    ``batch_size=None`` encodes whole blocks; use it right after :func:`read_and_parse` so Ray fuses
    read, parse and encode into one task per file instead of bundling files to fill a batch.
    """
    return ds.map_batches(
        encode_batch,
        fn_kwargs={
            "tokenizer_ref": ray.put(tokenizer),
            "max_tokens": max_tokens,
            "eval_fraction": eval_fraction,
            "drop_ref": ray.put(drop or {}),
        },
        batch_format="pyarrow",
        batch_size=batch_size,
    )


@contextmanager
def data_context(progress: bool = True) -> Iterator[ray.data.DataContext]:
    """Ray Data settings for the ingest stages, restored afterwards.

    Every execution here is one map stage over materialised input (or read -> map fused), so
    Ray Data's per-operator resource reservation (50% by default) only holds the stage back: on
    2 CPUs it ran ~1.1 tasks at a time instead of ~1.9 (measured), for ~30% less throughput.
    """
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.enable_progress_bars, ctx.op_resource_reservation_enabled)
    ctx.enable_progress_bars = progress
    ctx.op_resource_reservation_enabled = False
    try:
        yield ctx
    finally:
        ctx.enable_progress_bars, ctx.op_resource_reservation_enabled = saved


def load_tokenizer(target: str) -> Any:
    from transformers import AutoTokenizer

    local = storage.download_model_files(target)
    tok = AutoTokenizer.from_pretrained(str(local))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {target} has no chat template")
    return tok


# ----------------------------------------------------------------------------- the stage


def run_ingest(cfg: IngestConfig) -> dict[str, Any]:
    """Run the whole ingest; uses the connected Ray instance or starts a local one. Returns the
    manifest (also written to ``<out>/manifest.json``)."""
    if not ray.is_initialized():
        ray.init()
    with data_context(cfg.progress):
        return _run(cfg)


def _run(cfg: IngestConfig) -> dict[str, Any]:
    t0 = time.monotonic()
    tokenizer = load_tokenizer(cfg.target)
    files = list_inputs(cfg.input)

    out_fs, _ = storage.resolve(cfg.out)
    train_uri, eval_uri = storage.join(cfg.out, "train"), storage.join(cfg.out, "eval")
    quarantine_uri = storage.join(cfg.out, "quarantine")
    manifest_uri = storage.join(cfg.out, "manifest.json")

    # 1-2. read + parse
    timings: dict[str, float] = {}
    t_stage = time.monotonic()
    parsed = read_and_parse(files, cfg.max_line_bytes).materialize()
    read = parsed.count()
    parse_reasons, drop, duplicates = scan_parsed(parsed)
    timings["read_parse"] = round(time.monotonic() - t_stage, 3)

    # 3-4. dedupe + encode
    t_stage = time.monotonic()
    encoded = encode(
        parsed,
        tokenizer,
        max_tokens=cfg.max_tokens,
        eval_fraction=cfg.eval_fraction,
        batch_size=cfg.batch_size,
        drop=drop,
    ).materialize()
    timings["dedupe_encode"] = round(time.monotonic() - t_stage, 3)
    regeneration = None
    if cfg.regenerate:  # 4b.
        encoded, regeneration = regenerate(encoded, RegenerateConfig(
            target=cfg.target, max_tokens=cfg.max_tokens, max_new_tokens=cfg.regenerate_max_tokens,
            temperature=cfg.regenerate_temperature, seed=cfg.regenerate_seed, actors=cfg.regenerate_actors,
            num_gpus=cfg.regenerate_num_gpus, max_slots=cfg.regenerate_max_slots,
        ))
        timings["regenerate"] = regeneration["seconds"]
    tally = _tally(encoded, ["status", "split", "has_reply"])
    status: dict[str, int] = {}
    written = {"train": 0, "eval": 0}
    input_only = 0
    for (st, split, has_reply), n in tally.items():
        status[st] = status.get(st, 0) + n
        if st == STATUS_OK:
            written[split] += n
            input_only += 0 if has_reply else n
    too_long = status.pop(STATUS_TOO_LONG, 0)
    kept = status.pop(STATUS_OK, 0)
    template_reasons = status  # whatever is left is a quarantine reason

    # 5. write (replace, never append)
    t_stage = time.monotonic()
    for uri in (train_uri, eval_uri, quarantine_uri, manifest_uri):
        storage.delete(uri)
    quarantine = parsed.map_batches(_where("ok", True, negate=True), batch_format="pyarrow", batch_size=None)
    quarantine = quarantine.map_batches(quarantine_from_parse, batch_format="pyarrow", batch_size=None)
    if template_reasons:
        rejected = encoded.map_batches(_where_status_in(set(template_reasons)), batch_format="pyarrow",
                                       batch_size=None)
        quarantine = quarantine.union(
            rejected.map_batches(quarantine_from_encode, batch_format="pyarrow", batch_size=None)
        )
    if parse_reasons or template_reasons:
        quarantine.write_json(
            storage.resolve(quarantine_uri)[1],
            filesystem=out_fs,
            filename_provider=ray.data.datasource.FilenameProvider(file_format="jsonl"),
            mode="overwrite",
            force_ascii=False,
        )
    kept_ds = encoded.map_batches(_where("status", STATUS_OK), batch_format="pyarrow", batch_size=None)
    for split, uri in (("train", train_uri), ("eval", eval_uri)):
        part = kept_ds.map_batches(_where("split", split), batch_format="pyarrow", batch_size=None)
        part.drop_columns(["status", "detail", "split"]).write_parquet(
            storage.resolve(uri)[1], filesystem=out_fs, mode="overwrite"
        )
    timings["write"] = round(time.monotonic() - t_stage, 3)

    quarantined_by_reason = dict(parse_reasons)
    for reason, n in template_reasons.items():
        quarantined_by_reason[reason] = quarantined_by_reason.get(reason, 0) + n
    quarantined = sum(quarantined_by_reason.values())
    counts = {
        "read": read,
        "parsed": kept,
        "quarantined": quarantined,
        "quarantined_by_reason": dict(sorted(quarantined_by_reason.items())),
        "duplicates": duplicates,
        "too_long": too_long,
        "written": {**written, "total": written["train"] + written["eval"]},
        "input_only": input_only,
    }
    if regeneration is not None:
        counts["regenerated"] = regeneration["regenerated"]
        counts["regeneration_failed"] = regeneration["regeneration_failed"]
    if kept + quarantined + duplicates + too_long != read or kept != counts["written"]["total"]:
        raise RuntimeError(f"ingest accounting does not add up: {counts}")
    manifest = {
        "stage": "ingest",
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": cfg.model_dump(),
        "input_files": len(files),
        "counts": counts,
        "invariant": "parsed + quarantined + duplicates + too_long == read",
        "definitions": {
            "read": "non-blank input lines, plus one per unreadable (corrupt .gz) file",
            "quarantined": "records rejected by the parser or the chat template; one row each in quarantine/",
            "duplicates": "exact duplicates of (kind, messages, reply) dropped; the first by (source, line) "
            "stays",
            "too_long": f"records whose tokens exceed max_tokens ({cfg.max_tokens})",
            "parsed": "records that came through every stage: the written ones (train + eval)",
            "input_only": "written records without a captured reply (has_reply = false, no loss tokens)",
            **({
                "regenerated": "written records whose reply the target regenerated (regenerated = true)",
                "regeneration_failed": "written records the engine failed on: captured reply kept",
            } if regeneration is not None else {}),
        },
        "outputs": {"train": train_uri, "eval": eval_uri, "quarantine": quarantine_uri},
        "tokenizer": {
            "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(tokenizer),
            "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
        },
        **({"regeneration": regeneration} if regeneration is not None else {}),
        "timings_s": timings,
        "elapsed_s": round(time.monotonic() - t0, 3),
    }
    storage.write_json(manifest_uri, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--max-line-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--regenerate", action="store_true", help="replace replies with the target's own")
    p.add_argument("--regenerate-max-tokens", type=int, default=512)
    p.add_argument("--regenerate-temperature", type=float, default=0.0)
    p.add_argument("--regenerate-seed", type=int, default=0)
    p.add_argument("--regenerate-actors", type=int, default=1)
    p.add_argument("--regenerate-num-gpus", type=float, default=0.0)
    p.add_argument("--regenerate-max-slots", type=int, default=16)
    args = p.parse_args(argv)
    try:
        cfg = IngestConfig(
            input=args.input, target=args.target, out=args.out, max_tokens=args.max_tokens,
            eval_fraction=args.eval_fraction, max_line_bytes=args.max_line_bytes,
            batch_size=args.batch_size, progress=not args.no_progress, regenerate=args.regenerate,
            regenerate_max_tokens=args.regenerate_max_tokens, regenerate_temperature=args.regenerate_temperature,
            regenerate_seed=args.regenerate_seed, regenerate_actors=args.regenerate_actors,
            regenerate_num_gpus=args.regenerate_num_gpus, regenerate_max_slots=args.regenerate_max_slots,
        )
    except ValidationError as e:
        print(format_validation_error(e), file=sys.stderr)
        return 2
    manifest = run_ingest(cfg)
    print(json.dumps(manifest["counts"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
