"""Captured traffic -> tokenized training data, with every record accounted for (Ray Data).

    python -m pipelines.ingest --input s3://bucket/capture/ --target DIR --out s3://bucket/data/

Stages (Ray Data; the parsed and the encoded data sets are materialised so each stage is counted):

1. read: every ``*.jsonl`` / ``*.jsonl.gz`` under ``--input`` (local or ``s3://``, recursive; a
   ``sagemaker://ENDPOINT[/VARIANT]`` input is its endpoint's Data Capture files, ``--since`` a time
   window on them; several inputs are read together), one file per row; lines keep their raw bytes,
   source file and line number. A ``.gz`` file is decompressed in the parse task, so a corrupt one
   becomes a quarantine row, not a crash.
2. parse (parallel tasks): :func:`aerie.formats.parse_line`, the format auto-detected per line.
   Failures become quarantine rows with the reason code.
3. dedupe: exact duplicates of (kind, messages, reply) are dropped; the first by (source, line)
   stays. The decision is taken on the driver from a three-column projection (content key,
   source, line: ~60 bytes a record) and applied inside the encode tasks. (Ray's hash-shuffle
   ``repartition(keys=...)`` works too, but starts aggregator actors: seconds per run on 2 cores.)
4. encode (parallel tasks, one cached tokenizer per worker process): the target's chat template,
   token ids, the loss mask (1 on the reply tokens and the end-of-turn token only), the length
   filter (``--max-tokens``) and a deterministic train/eval split from a hash of the record id:
   ``--eval-fraction`` of the records, at least ``--eval-min-records`` (up to a quarter of them;
   :mod:`aerie.data.eval_split`), the threshold recorded in the manifest as ``eval_threshold``.
   Template failures are quarantined.
4b. regenerate (``--regenerate``, optional, recommended): every written row's reply is replaced by
   what the target itself generates for the prompt, in an actor pool (see ``pipelines/regenerate.py``).
5. write: a new version ``<out>/gen-<time>-<id>/`` with Parquet ``train/`` and ``eval/`` and JSONL
   ``quarantine/``, then ``<out>/manifest.json`` (the counts per stage, the tokenizer's facts and
   the version's folders), written last: the swap. Readers follow the manifest
   (:mod:`aerie.data.ingest_output`), so they see the previous complete output or the new one; a
   run that fails or is killed before the swap leaves the previous output as it was.

Accounting (checked before the manifest is written)::

    parsed + quarantined + duplicates + too_long == read

``read`` counts non-blank input lines (plus one per unreadable file); ``quarantined`` every record
rejected by the parser or the chat template; ``duplicates`` the exact duplicates dropped;
``too_long`` records over ``--max-tokens``; ``parsed`` the records that came through every stage,
i.e. those written (``parsed == written.train + written.eval``). Input-only records (no captured
reply) are written with ``has_reply = false`` and an all-zero loss mask, for regeneration later.
With ``--regenerate`` every written row carries the target's own reply (``regenerated`` true,
``original_reply`` the captured one); a row the engine fails on keeps its captured reply and is
counted in ``regeneration_failed``, and more than ``--regenerate-max-failure-rate`` (1 %) of such
rows fail the job, publishing nothing; a prompt that leaves no room for a reply counts as too long.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import ray
from pydantic import ValidationError

from aerie import sagemaker, storage
from aerie.data.dedupe import SCAN_COLUMNS, scan_parsed
from aerie.data.eval_split import POINT_COLUMNS, eval_threshold, split_points
from aerie.data.filters import where, where_status_in
from aerie.data.ingest_config import IngestConfig, format_validation_error
from aerie.data.ingest_output import (
    FORMAT,
    MANIFEST,
    SPLITS,
    definitions,
    ingest_counts,
    load_tokenizer,
    tokenizer_facts,
)
from aerie.data.regenerate import RegenerateConfig
from aerie.formats import ChatEncoder
from aerie.formats.chat import STATUS_OK
from aerie.formats.tables import (
    encode_rows,
    parse_files,
    quarantine_from_encode,
    quarantine_from_parse,
)
from pipelines.regenerate import regenerate

INPUT_SUFFIXES = (".jsonl", ".jsonl.gz")


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


def list_inputs(uri: str | list[str], since: datetime | None = None) -> list[str]:
    """The input files of one input or several, each file once, in input order. A
    ``sagemaker://`` input resolves to its endpoint's Data Capture files (from ``since`` on, see
    :mod:`aerie.sagemaker`); anything else is a local or ``s3://`` file or folder."""
    files: dict[str, None] = {}
    for one in [uri] if isinstance(uri, str) else uri:
        if sagemaker.is_sagemaker(one):
            found = sagemaker.capture_files(one, since)
        else:
            found = storage.list_files(one, INPUT_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"no {' or '.join(INPUT_SUFFIXES)} files under {one}")
        files.update(dict.fromkeys(found))
    return list(files)


def read_and_parse(files: list[str], max_line_bytes: int = 16 * 1024 * 1024) -> ray.data.Dataset:
    """Files (URIs from :func:`list_inputs`) -> the parsed data set (ok and failed rows). One task
    per file; the driver's file system objects (S3 endpoint, credentials) travel with the tasks, so
    workers read exactly what the driver listed. Files on different file systems (local and
    ``s3://`` inputs together) are read as one data set per file system, then joined."""
    groups: dict[str | int, tuple[Any, list[dict[str, str]]]] = {}
    for uri in files:
        fs, path = storage.resolve(uri)
        key = "local" if isinstance(fs, pafs.LocalFileSystem) else id(fs)  # S3 file systems are shared objects
        groups.setdefault(key, (fs, []))[1].append({"path": path, "uri": uri})
    parts = [
        ray.data.from_items(items, override_num_blocks=min(len(items), 4096)).map_batches(
            read_and_parse_files,
            batch_format="pyarrow",
            batch_size=None,
            fn_kwargs={"filesystem": fs, "max_line_bytes": max_line_bytes},
        )
        for fs, items in groups.values()
    ]
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


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
    since = None if cfg.since is None else sagemaker.parse_since(cfg.since)
    files = list_inputs(cfg.input, since)

    # 1-2. read + parse
    timings: dict[str, float] = {}
    t_stage = time.monotonic()
    parsed = read_and_parse(files, cfg.max_line_bytes).materialize()
    read = parsed.count()
    parse_reasons, drop, duplicates = scan_parsed(
        parsed.select_columns(SCAN_COLUMNS).iter_batches(batch_format="pyarrow", batch_size=None)
    )
    points = split_points(parsed.select_columns(POINT_COLUMNS).iter_batches(batch_format="pyarrow", batch_size=None),
                          drop)
    eval_cut = eval_threshold(points, cfg.eval_fraction, cfg.eval_min_records)
    timings["read_parse"] = round(time.monotonic() - t_stage, 3)

    # 3-4. dedupe + encode
    t_stage = time.monotonic()
    encoded = encode(
        parsed, tokenizer, max_tokens=cfg.max_tokens, eval_fraction=eval_cut, batch_size=cfg.batch_size,
        drop=drop,
    ).materialize()
    timings["dedupe_encode"] = round(time.monotonic() - t_stage, 3)
    regeneration = None
    if cfg.regenerate:  # 4b.
        encoded, regeneration = regenerate(encoded, RegenerateConfig(
            target=cfg.target, max_tokens=cfg.max_tokens, max_new_tokens=cfg.regenerate_max_tokens,
            temperature=cfg.regenerate_temperature, seed=cfg.regenerate_seed, actors=cfg.regenerate_actors,
            num_gpus=cfg.regenerate_num_gpus, max_slots=cfg.regenerate_max_slots,
            max_failure_rate=cfg.regenerate_max_failure_rate,
        ))
        timings["regenerate"] = regeneration["seconds"]
    counts, template_reasons = ingest_counts(read, parse_reasons, duplicates,
                                             _tally(encoded, ["status", "split", "has_reply"]), regeneration)

    # 5. write a new version, then swap the manifest in
    t_stage = time.monotonic()
    generation = storage.new_generation()
    outputs = {split: f"{generation}/{split}" for split in SPLITS}
    _write_outputs(cfg.out, outputs, parsed, encoded, quarantine=counts["quarantined"] > 0,
                   template_reasons=template_reasons)
    timings["write"] = round(time.monotonic() - t_stage, 3)

    manifest = {
        "stage": "ingest",
        "format": FORMAT,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": cfg.model_dump(),
        "input_files": len(files),
        **({"since": since.strftime("%Y-%m-%dT%H:%M:%SZ")} if since is not None else {}),
        "counts": counts,
        "invariant": "parsed + quarantined + duplicates + too_long == read",
        "definitions": definitions(cfg.max_tokens, regeneration is not None),
        "eval_threshold": eval_cut,
        "generation": generation,
        "outputs": outputs,
        "tokenizer": tokenizer_facts(tokenizer),
        **({"regeneration": regeneration} if regeneration is not None else {}),
        "timings_s": timings,
        "elapsed_s": round(time.monotonic() - t0, 3),
    }
    storage.publish_generation(cfg.out, MANIFEST, manifest, legacy=SPLITS)  # the swap
    return manifest


def _write_outputs(out: str, outputs: dict[str, str], parsed: ray.data.Dataset, encoded: ray.data.Dataset, *,
                   quarantine: bool, template_reasons: set[str]) -> None:
    """Write the quarantine JSONL and the train / eval Parquet under the new version's folders."""
    out_fs, _ = storage.resolve(out)
    folder = {split: storage.resolve(storage.join(out, rel))[1] for split, rel in outputs.items()}
    if quarantine:
        rejected = parsed.map_batches(where("ok", True, negate=True), batch_format="pyarrow", batch_size=None)
        rejected = rejected.map_batches(quarantine_from_parse, batch_format="pyarrow", batch_size=None)
        if template_reasons:
            failed = encoded.map_batches(where_status_in(template_reasons), batch_format="pyarrow", batch_size=None)
            rejected = rejected.union(
                failed.map_batches(quarantine_from_encode, batch_format="pyarrow", batch_size=None)
            )
        rejected.write_json(
            folder["quarantine"], filesystem=out_fs, force_ascii=False, mode="overwrite",
            filename_provider=ray.data.datasource.FilenameProvider(file_format="jsonl"),
        )
    kept = encoded.map_batches(where("status", STATUS_OK), batch_format="pyarrow", batch_size=None)
    for split in ("train", "eval"):
        part = kept.map_batches(where("split", split), batch_format="pyarrow", batch_size=None)
        part.drop_columns(["status", "detail", "split"]).write_parquet(
            folder[split], filesystem=out_fs, mode="overwrite"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.ingest", description=__doc__.split("\n\n")[0])
    for name, field in IngestConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=field.description)
        elif name == "input":
            p.add_argument(flag, dest=name, required=True, nargs="+", help=field.description)
        else:
            p.add_argument(flag, dest=name, required=field.is_required(), default=None, help=field.description)
    args = p.parse_args(argv)
    try:
        values = {k: v for k, v in vars(args).items() if v is not None}
        values["input"] = values["input"][0] if len(values["input"]) == 1 else values["input"]
        cfg = IngestConfig(**values)
    except ValidationError as e:
        print(format_validation_error(e), file=sys.stderr)
        return 2
    try:
        manifest = run_ingest(cfg)
    except (FileNotFoundError, ValueError) as e:  # no input files, an endpoint without capture
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(manifest["counts"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
