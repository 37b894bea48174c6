"""Ingest's Arrow transforms without Ray: every input line comes out as a parsed row or a
quarantine row that keeps its raw bytes."""

from __future__ import annotations

import base64
import gzip
import json

import pyarrow.compute as pc
import pyarrow.fs as pafs
from transformers import AutoTokenizer

from aerie.formats import ChatEncoder
from aerie.formats.tables import (
    BAD_GZIP,
    QUARANTINE_SCHEMA,
    encode_rows,
    parse_files,
    quarantine_from_encode,
    quarantine_from_parse,
    split_of,
)

GOOD = [
    {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}]},
    {"prompt": "Explain heapq", "completion": "A heap queue."},
]
NOT_JSON = b"{not json"
NOT_UTF8 = b'{"prompt": "\xff\xfe"}'


def _inputs(tmp_path):
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(b"\n".join([json.dumps(GOOD[0]).encode(), b"", NOT_JSON, NOT_UTF8, json.dumps(GOOD[1]).encode()]))
    broken = tmp_path / "b.jsonl.gz"
    broken.write_bytes(gzip.compress(b"{}")[:-6])
    return [(str(plain), "file://a.jsonl"), (str(broken), "file://b.jsonl.gz")]


def test_every_line_is_a_row_and_rejects_keep_their_bytes(tmp_path):
    parsed = parse_files(_inputs(tmp_path), pafs.LocalFileSystem(), max_line_bytes=1 << 20)
    rows = parsed.to_pylist()
    assert [(r["source"], r["line"], r["ok"]) for r in rows] == [
        ("file://a.jsonl", 1, True),
        ("file://a.jsonl", 3, False),
        ("file://a.jsonl", 4, False),
        ("file://a.jsonl", 5, True),
        ("file://b.jsonl.gz", 0, False),
    ]
    assert rows[0]["reply"] == "return a + b" and rows[3]["messages"][-1]["content"] == "Explain heapq"
    assert rows[4]["reason"] == BAD_GZIP

    quarantine = quarantine_from_parse(parsed.filter(pc.invert(parsed.column("ok"))))
    assert quarantine.schema == QUARANTINE_SCHEMA
    q = quarantine.to_pylist()
    assert [r["reason"] for r in q] == ["bad_json", "not_utf8", BAD_GZIP]
    assert q[0]["raw"] == NOT_JSON.decode() and q[0]["raw_base64"] is None
    assert q[1]["raw"] is None and base64.b64decode(q[1]["raw_base64"]) == NOT_UTF8
    assert all(r["stage"] == "parse" for r in q)


def test_encode_drops_failures_and_duplicates_and_splits_by_id(tmp_path, tokenizer_dir):
    parsed = parse_files(_inputs(tmp_path), pafs.LocalFileSystem(), max_line_bytes=1 << 20)
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(str(tokenizer_dir)), max_tokens=512)
    encoded = encode_rows(parsed, encoder, eval_fraction=0.5, drop={"file://a.jsonl": {5}}).to_pylist()
    assert [r["line"] for r in encoded] == [1]
    row = encoded[0]
    assert row["status"] == "ok" and row["num_tokens"] == len(row["input_ids"]) == len(row["loss_mask"])
    assert row["num_loss_tokens"] == sum(row["loss_mask"]) > 0
    assert row["split"] == split_of(row["id"], 0.5)
    assert split_of(row["id"], 0.0) == "train"

    refusing = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    refusing.chat_template = "{{ raise_exception('no chats today') }}"
    rejected = encode_rows(parsed, ChatEncoder(refusing), eval_fraction=0.0)
    assert rejected.column("status").to_pylist() == ["template_error", "template_error"]
    quarantine = quarantine_from_encode(rejected).to_pylist()
    assert [(r["stage"], r["line"]) for r in quarantine] == [("template", 1), ("template", 5)]
    assert "no chats today" in quarantine[0]["detail"]
    assert json.loads(quarantine[0]["raw"])["reply"] == "return a + b"
