"""Captured records as Arrow tables: the row schemas of ingest and the per-batch transforms.

Plain pyarrow, no Ray: `pipelines/ingest.py` maps these over Ray Data blocks.

- `parse_files`: input files -> one `PARSED_SCHEMA` row per non-blank line (`ok` false and a
  reason code for a line the parsers reject, or for a corrupt `.gz` file).
- `encode_rows`: parsed rows -> `RECORD_COLUMNS` + `TOKEN_FIELDS` (chat template, token ids, loss
  mask, length status, train/eval split).
- `quarantine_from_parse` / `quarantine_from_encode`: rejected rows -> `QUARANTINE_SCHEMA`, with the
  raw line (or its base64 when it is not UTF-8) so nothing is lost.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import zlib
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from aerie.formats.chat import STATUS_OK, ChatEncoder
from aerie.formats.parse import parse_line
from aerie.formats.record import RecordError

BAD_GZIP = "bad_gzip"

PARSED_SCHEMA = pa.schema(
    [
        ("ok", pa.bool_()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("raw", pa.binary()),
        ("source", pa.string()),
        ("line", pa.int64()),
        ("id", pa.string()),
        ("timestamp", pa.string()),
        ("format", pa.string()),
        ("kind", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("reply", pa.string()),
        ("has_reply", pa.bool_()),
        ("params", pa.string()),
        ("content_key", pa.string()),
    ]
)
RECORD_COLUMNS = ["id", "source", "line", "timestamp", "format", "kind", "messages", "reply", "has_reply",
                  "params", "content_key"]
TOKEN_FIELDS = [
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()),
    ("prompt_tokens", pa.int32()),
    ("status", pa.string()),
    ("detail", pa.string()),
    ("split", pa.string()),
]
QUARANTINE_SCHEMA = pa.schema(
    [
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("stage", pa.string()),
        ("source", pa.string()),
        ("line", pa.int64()),
        ("id", pa.string()),
        ("raw", pa.string()),
        ("raw_base64", pa.string()),
    ]
)


def split_point(record_id: str) -> float:
    """Where a record falls in [0, 1): a hash of its id (stable across runs and machines)."""
    digest = hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_of(record_id: str, eval_fraction: float) -> str:
    """"eval" for the records whose split point is below ``eval_fraction``, else "train"."""
    return "eval" if eval_fraction > 0 and split_point(record_id) < eval_fraction else "train"


def parse_files(files: Iterable[tuple[str, str]], filesystem: Any, max_line_bytes: int) -> pa.Table:
    """`(path, source uri)` pairs -> one parsed row per non-blank line.

    Files are read as raw bytes (`compression=None`) and `.gz` ones decompressed here, so a corrupt
    archive becomes one rejected row instead of failing the read.
    """
    cols: dict[str, list[Any]] = {name: [] for name in PARSED_SCHEMA.names}

    def bad(reason: str, detail: str, raw: bytes | None, source: str, line: int) -> None:
        row = dict.fromkeys(PARSED_SCHEMA.names)
        row.update(ok=False, reason=reason, detail=detail, raw=raw, source=source, line=line)
        for name, value in row.items():
            cols[name].append(value)

    for path, source in files:
        with filesystem.open_input_stream(path, compression=None) as f:
            data = f.readall()
        if path.lower().endswith(".gz"):
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError, zlib.error) as e:
                bad(BAD_GZIP, str(e)[:200], None, source, 0)
                continue
        for lineno, raw in enumerate(data.split(b"\n"), start=1):
            if not raw.strip():
                continue
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            try:
                rec = parse_line(raw, source, lineno, max_bytes=max_line_bytes)
            except RecordError as e:
                bad(e.reason, e.detail, raw, source, lineno)
                continue
            row = {
                "ok": True,
                "source": source,
                "line": lineno,
                "id": rec.id,
                "timestamp": rec.timestamp,
                "format": rec.format,
                "kind": rec.kind,
                "messages": [{"role": m.role, "content": m.content} for m in rec.messages],
                "reply": rec.reply,
                "has_reply": rec.has_reply,
                "params": json.dumps(rec.params, sort_keys=True) if rec.params else None,
                "content_key": rec.content_key(),
            }
            for name in PARSED_SCHEMA.names:
                cols[name].append(row.get(name))
    return pa.table(cols, schema=PARSED_SCHEMA)


def encode_rows(
    batch: pa.Table, encoder: ChatEncoder, eval_fraction: float, drop: dict[str, set[int]] | None = None
) -> pa.Table:
    """Parsed rows -> encoded rows: failed parses and the `drop` lines (`{source: {line, ...}}`,
    duplicates) are left out; the rest get the chat template, token ids, loss mask, length status
    and split."""
    keep = pc.fill_null(batch.column("ok"), False)
    if drop:
        sources, lines = batch.column("source").to_pylist(), batch.column("line").to_pylist()
        flags = [not (src in drop and line in drop[src]) for src, line in zip(sources, lines, strict=True)]
        keep = pc.and_(keep, pa.array(flags))
    batch = batch.filter(keep)
    messages = batch.column("messages").to_pylist()
    replies = batch.column("reply").to_pylist()
    encoded = encoder.encode_batch(list(zip(messages, replies, strict=True)))
    columns: dict[str, list[Any]] = {name: [] for name, _ in TOKEN_FIELDS}
    for record_id, enc in zip(batch.column("id").to_pylist(), encoded, strict=True):
        ok = enc.status == STATUS_OK
        columns["input_ids"].append(enc.input_ids if ok else [])
        columns["loss_mask"].append(enc.loss_mask if ok else [])
        columns["num_tokens"].append(len(enc.input_ids))
        columns["num_loss_tokens"].append(sum(enc.loss_mask) if ok else 0)
        columns["prompt_tokens"].append(enc.prompt_tokens)
        columns["status"].append(enc.status)
        columns["detail"].append(enc.detail or None)
        columns["split"].append(split_of(record_id, eval_fraction))
    out = batch.select(RECORD_COLUMNS)
    for name, typ in TOKEN_FIELDS:
        out = out.append_column(pa.field(name, typ), pa.array(columns[name], type=typ))
    return out


def quarantine_from_parse(batch: pa.Table) -> pa.Table:
    """Rows the parsers rejected -> quarantine rows (stage "parse")."""
    text, b64 = [], []
    for raw in batch.column("raw").to_pylist():
        try:
            text.append(None if raw is None else raw.decode("utf-8"))
            b64.append(None)
        except UnicodeDecodeError:
            text.append(None)
            b64.append(base64.b64encode(raw).decode("ascii"))
    n = batch.num_rows
    return pa.table(
        {
            "reason": batch.column("reason"),
            "detail": batch.column("detail"),
            "stage": pa.array(["parse"] * n, pa.string()),
            "source": batch.column("source"),
            "line": batch.column("line"),
            "id": pa.nulls(n, pa.string()),
            "raw": pa.array(text, pa.string()),
            "raw_base64": pa.array(b64, pa.string()),
        },
        schema=QUARANTINE_SCHEMA,
    )


def quarantine_from_encode(batch: pa.Table) -> pa.Table:
    """Encoded rows whose chat template failed -> quarantine rows (stage "template")."""
    n = batch.num_rows
    raw = [
        json.dumps({"messages": m, "reply": r}, ensure_ascii=False)
        for m, r in zip(batch.column("messages").to_pylist(), batch.column("reply").to_pylist(), strict=True)
    ]
    return pa.table(
        {
            "reason": batch.column("status"),
            "detail": batch.column("detail"),
            "stage": pa.array(["template"] * n, pa.string()),
            "source": batch.column("source"),
            "line": batch.column("line"),
            "id": batch.column("id"),
            "raw": pa.array(raw, pa.string()),
            "raw_base64": pa.nulls(n, pa.string()),
        },
        schema=QUARANTINE_SCHEMA,
    )
