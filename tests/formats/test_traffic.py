"""Demo traffic (aerie.traffic / `aerie traffic`): realistic mixes, every line parses, reproducible."""

from __future__ import annotations

import base64
import json
import re
from collections import Counter

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from aerie import storage
from aerie.cli import app
from aerie.formats import ChatEncoder, parse_line
from aerie.traffic import generate_traffic, source_functions, synthesize

LAYOUT = re.compile(r"/aerie-demo/AllTraffic/\d{4}/\d{2}/\d{2}/\d{2}/[0-9a-f-]{36}\.jsonl$")


def _lines(root: str) -> list[str]:
    return [ln for f in storage.list_files(root) for ln in storage.read_text(f).splitlines() if ln.strip()]


def _payload(side: dict) -> dict | list:
    data = side["data"]
    return json.loads(base64.b64decode(data) if side["encoding"] == "BASE64" else data)


@pytest.fixture(scope="module")
def sagemaker_dir(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("traffic") / "sm"
    generate_traffic(str(tokenizer_dir), str(out), requests=400, seed=3, max_tokens=512)
    return out


def test_sagemaker_traffic_layout_and_mix(sagemaker_dir):
    files = storage.list_files(str(sagemaker_dir))
    assert files and all(LAYOUT.search(f) for f in files)
    lines = _lines(str(sagemaker_dir))
    assert len(lines) == 400
    events = [json.loads(ln) for ln in lines]
    encodings = Counter(e["captureData"]["endpointInput"]["encoding"] for e in events)
    assert encodings["JSON"] > 150 and encodings["BASE64"] > 100
    input_only = sum("endpointOutput" not in e["captureData"] for e in events)
    assert 15 <= input_only <= 70
    styles = Counter()
    for e in events:
        req = _payload(e["captureData"]["endpointInput"])
        styles["tgi" if "inputs" in req else "chat" if "messages" in req else "completions"] += 1
    assert min(styles.values()) > 20 and len(styles) == 3
    records = [parse_line(ln) for ln in lines]  # every synthetic line parses
    assert {r.format for r in records} == {"sagemaker"}
    assert sum(r.has_reply for r in records) == 400 - input_only


def test_traffic_fits_the_target_and_replies_are_real_source(sagemaker_dir, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    encoder = ChatEncoder(tok, max_tokens=512)
    records = [parse_line(ln) for ln in _lines(str(sagemaker_dir))]
    encoded = encoder.encode_batch([(r.conversation(with_reply=False), r.reply) for r in records])
    assert all(e.status == "ok" for e in encoded)
    bodies = {f.body for f in source_functions(1000, 3)}  # the pool synthesize(400, seed=3) draws from
    completions = [r for r in records if r.has_reply and not r.reply.startswith("`")]
    assert completions and sum(r.reply in bodies for r in completions) == len(completions)


def test_same_seed_same_files(tmp_path, tokenizer_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    generate_traffic(str(tokenizer_dir), str(a), requests=50, seed=9)
    generate_traffic(str(tokenizer_dir), str(b), requests=50, seed=9)
    fa, fb = storage.list_files(str(a)), storage.list_files(str(b))
    assert [f[len(str(a)) :] for f in fa] == [f[len(str(b)) :] for f in fb]
    assert [storage.read_bytes(f) for f in fa] == [storage.read_bytes(f) for f in fb]


@pytest.mark.parametrize("fmt", ["openai", "sharegpt"])
def test_other_formats(tmp_path, fmt):
    generate_traffic(str(tmp_path / "no-target-yet"), str(tmp_path / fmt), requests=120, fmt=fmt, seed=1)
    records = [parse_line(ln) for ln in _lines(str(tmp_path / fmt))]
    assert len(records) == 120 and {r.format for r in records} == {fmt}
    assert 0 < sum(not r.has_reply for r in records) < 40


def test_synthesize_tasks():
    exchanges = synthesize(200, seed=0)
    tasks = Counter(e.task for e in exchanges)
    assert tasks["complete"] > 80 and tasks["explain"] > 30
    for e in exchanges:
        assert e.messages[-1]["role"] == "user" and e.reply.strip()


def test_cli_traffic(tmp_path, tokenizer_dir):
    runner = CliRunner()
    out = tmp_path / "cli"
    result = runner.invoke(app, ["traffic", "--target", str(tokenizer_dir), "--out", str(out),
                                 "--requests", "30", "--seed", "2"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["requests"] == 30 and summary["tokenizer"] is True
    assert len(_lines(str(out))) == 30
    bad = runner.invoke(app, ["traffic", "--target", "x", "--out", str(out), "--format", "csv"])
    assert bad.exit_code != 0
