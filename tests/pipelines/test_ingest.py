"""Ray Data ingest end to end: 10,000 captured records (every format, ~10% broken), local and S3.

Acceptance (issue 4): parsed + quarantined + duplicates + too_long == read, every quarantined row
carries its reason, no crash, the same from the local S3 server, reruns do not append, and the
loss mask covers exactly the reply tokens.
"""

from __future__ import annotations

import base64
import gzip
import json
import random
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from aerie import storage
from aerie.data.ingest_output import split_uri
from aerie.formats import RecordError, capture_event, parse_line
from aerie.traffic import openai_line, sagemaker_event, sharegpt_line, synthesize

N_RECORDS = 10_000
MAX_TOKENS = 1024
EVAL_FRACTION = 0.1
# broken records by the reason the quarantine must give (bad_gzip: one corrupt .jsonl.gz file)
BROKEN = {
    "bad_json": 150,
    "bad_base64": 120,
    "missing_capture_data": 110,
    "not_utf8": 110,
    "empty_prompt": 110,
    "wrong_type": 150,
    "missing_input": 50,
    "unknown_format": 40,
    "bad_role": 39,
    "bad_gzip": 1,
}
ABSURD = 60  # valid but absurdly long: counted as too_long
COPIES = 100  # exact re-deliveries of valid lines


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def _broken_line(reason: str, rng: random.Random, valid: list[bytes]) -> bytes:
    k = rng.randrange(4)
    if reason == "bad_json":
        good = rng.choice(valid)
        return good[: rng.randrange(1, len(good) - 1)] if k else b"{'python': 'repr', }"
    if reason == "bad_base64":
        ev = capture_event({"inputs": "def f():"}, encoding="BASE64")
        data = ev["captureData"]["endpointInput"]["data"]
        ev["captureData"]["endpointInput"]["data"] = ("!!" + data[2:]) if k % 2 else data[:-1]
        return _dumps(ev)
    if reason == "missing_capture_data":
        meta = {"eventId": str(uuid.UUID(int=rng.getrandbits(128))), "inferenceTime": "2026-04-29T00:00:00Z"}
        if k == 0:
            return _dumps({"eventMetadata": meta, "eventVersion": "0"})
        if k == 1:
            return _dumps({"captureData": {}, "eventMetadata": meta, "eventVersion": "0"})
        ev = capture_event({"inputs": "x"})
        ev["captureData"]["endpointInput"]["data"] = ""
        return _dumps(ev)
    if reason == "not_utf8":
        if k % 2:
            return b'{"prompt": "caf\xe9 latin-1 ' + str(rng.random()).encode() + b'"}'
        return _dumps(capture_event(b"\xff\xfe{\"inputs\": 1}", encoding="BASE64"))
    if reason == "empty_prompt":
        return [
            _dumps({"prompt": "   "}),
            _dumps(capture_event({"inputs": ""}, [{"generated_text": "x"}])),
            _dumps({"messages": [{"role": "user", "content": ""}]}),
            _dumps({"conversations": [{"from": "gpt", "value": "an answer to nothing"}]}),
        ][k]
    if reason == "wrong_type":
        return [
            _dumps({"prompt": rng.randrange(1000)}),
            _dumps(capture_event({"inputs": {"text": "x"}})),
            _dumps(capture_event({"inputs": "def f():"}, {"generated_text": 42})),
            _dumps([{"prompt": "a list, not an object"}]),
        ][k]
    if reason == "missing_input":
        if k % 2:
            return _dumps({"response": {"choices": [{"message": {"role": "assistant", "content": "hi"}}]}})
        ev = capture_event({"inputs": "x"}, [{"generated_text": "y"}])
        del ev["captureData"]["endpointInput"]
        return _dumps(ev)
    if reason == "unknown_format":
        return _dumps({"foo": "bar", "n": rng.random()})
    if reason == "bad_role":
        return _dumps({"messages": [{"role": "wizard", "content": "abracadabra"}]})
    raise AssertionError(reason)


def _absurd_line(rng: random.Random) -> bytes:
    text = "".join(rng.choice("abcdefghij ") for _ in range(250_000))
    return _dumps(capture_event({"inputs": text}, [{"generated_text": "ok"}], encoding=rng.choice(["JSON", "BASE64"])))


def write_capture_fixture(root: Path, tokenizer, seed: int = 0) -> dict:
    """10,000 records in the Data Capture layout: Data Capture events (TGI, OpenAI chat and
    completions payloads, JSON and BASE64, input-only), OpenAI logs, ShareGPT and prompt lines
    mixed in the same files, ~10% broken, some exact duplicates, some .jsonl.gz, a corrupt .gz."""
    rng = random.Random(seed)
    n_valid = N_RECORDS - sum(BROKEN.values()) - ABSURD - COPIES
    exchanges = synthesize(n_valid, seed=seed, tokenizer=tokenizer, max_tokens=MAX_TOKENS // 2)
    when = datetime(2026, 4, 29, tzinfo=timezone.utc)
    valid: list[bytes] = []
    for ex in exchanges:
        when += timedelta(seconds=rng.expovariate(1 / 3.0))
        roll = rng.random()
        if roll < 0.75:
            obj = sagemaker_event(ex, rng, when)
        elif roll < 0.85:
            obj = openai_line(ex, rng, when)
        elif roll < 0.93:
            obj = sharegpt_line(ex, rng, when)
        else:
            obj = {"prompt": ex.prompt, **({"completion": ex.reply} if rng.random() < 0.8 else {})}
        valid.append(_dumps(obj))
    lines = list(valid)
    lines += [rng.choice(valid) for _ in range(COPIES)]
    lines += [_absurd_line(rng) for _ in range(ABSURD)]
    for reason, n in BROKEN.items():
        if reason != "bad_gzip":
            lines += [_broken_line(reason, rng, valid) for _ in range(n)]
    rng.shuffle(lines)

    files = 24
    hours = [when - timedelta(hours=h) for h in range(6)]
    for i in range(files):
        chunk = lines[i::files]
        for _ in range(3):  # blank lines are not records
            chunk.insert(rng.randrange(len(chunk)), b"   ")
        t = hours[i % len(hours)]
        folder = root / "aerie-demo" / "AllTraffic" / t.strftime("%Y/%m/%d/%H")
        folder.mkdir(parents=True, exist_ok=True)
        data = b"\n".join(chunk) + b"\n"
        name = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if i % 6 == 0:
            (folder / f"{name}.jsonl.gz").write_bytes(gzip.compress(data))
        else:
            (folder / f"{name}.jsonl").write_bytes(data.replace(b"\n", b"\r\n") if i == 1 else data)
    corrupt = root / "aerie-demo" / "AllTraffic" / "2026" / "04" / "28" / "23"
    corrupt.mkdir(parents=True)
    (corrupt / "truncated.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "x"}\n' * 50)[:40])
    (root / "aerie-demo" / "README.txt").write_text("not an input file")

    # reference: what a correct ingest must report for these lines
    keys = Counter()
    for raw in lines:
        try:
            keys[parse_line(raw).content_key()] += 1
        except RecordError:
            pass
    duplicates = sum(n - 1 for n in keys.values())
    return {
        "read": N_RECORDS,
        "quarantined_by_reason": dict(sorted(BROKEN.items())),
        "too_long": ABSURD,
        "duplicates": duplicates,
        "written": N_RECORDS - sum(BROKEN.values()) - ABSURD - duplicates,
    }


@pytest.fixture(scope="module")
def capture(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("capture")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    expected = write_capture_fixture(root, tok)
    return root, expected


def _config(**kw):
    from pipelines.ingest import IngestConfig

    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("eval_fraction", EVAL_FRACTION)
    kw.setdefault("progress", False)
    return IngestConfig(**kw)


def _quarantine_rows(uri: str) -> list[dict]:
    if not storage.exists(uri):
        return []
    return [json.loads(ln) for f in storage.list_files(uri, (".jsonl",)) for ln in storage.read_text(f).splitlines()]


def _parquet(uri: str):
    fs, path = storage.resolve(uri)
    return pads.dataset(path, filesystem=fs, format="parquet").to_table()


def _check_accounting(counts: dict, expected: dict) -> None:
    assert counts["parsed"] + counts["quarantined"] + counts["duplicates"] + counts["too_long"] == counts["read"]
    assert counts["read"] == expected["read"]
    assert counts["quarantined_by_reason"] == expected["quarantined_by_reason"]
    assert counts["quarantined"] == sum(expected["quarantined_by_reason"].values())
    assert counts["too_long"] == expected["too_long"]
    assert counts["duplicates"] == expected["duplicates"]
    assert counts["parsed"] == counts["written"]["total"] == expected["written"]
    assert counts["written"]["train"] + counts["written"]["eval"] == counts["written"]["total"]


@pytest.fixture(scope="module")
def local_run(ray_local, capture, tokenizer_dir, tmp_path_factory):
    from pipelines.ingest import run_ingest

    root, expected = capture
    out = tmp_path_factory.mktemp("ingest-out")
    manifest = run_ingest(_config(input=str(root), target=str(tokenizer_dir), out=str(out)))
    return out, manifest, expected


def test_local_ingest_accounts_for_every_record(local_run):
    out, manifest, expected = local_run
    _check_accounting(manifest["counts"], expected)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["counts"] == manifest["counts"]
    assert on_disk["invariant"] == "parsed + quarantined + duplicates + too_long == read"
    assert on_disk["input_files"] == 25
    assert 0 < manifest["counts"]["input_only"] < manifest["counts"]["written"]["total"] // 4


def test_every_quarantined_row_has_its_reason_and_raw_line(local_run):
    out, manifest, _ = local_run
    rows = _quarantine_rows(split_uri(str(out), "quarantine"))
    assert len(rows) == manifest["counts"]["quarantined"]
    assert Counter(r["reason"] for r in rows) == Counter(manifest["counts"]["quarantined_by_reason"])
    for r in rows:
        assert r["reason"] and r["stage"] == "parse" and r["source"].startswith(str(out.parent.parent))
        if r["reason"] == "bad_gzip":
            assert r["source"].endswith("truncated.jsonl.gz") and r["line"] == 0
        else:
            assert r["line"] >= 1 and (r["raw"] or r["raw_base64"])
    latin1 = [r for r in rows if r["reason"] == "not_utf8" and r["raw_base64"]]
    assert latin1 and all(b"caf\xe9" in base64.b64decode(r["raw_base64"]) for r in latin1)


def test_written_rows_are_tokenized_masked_and_split(local_run, tokenizer_dir):
    from aerie.formats.tables import split_of

    out, manifest, _ = local_run
    train, evals = _parquet(split_uri(str(out), "train")), _parquet(split_uri(str(out), "eval"))
    assert (train.num_rows, evals.num_rows) == (manifest["counts"]["written"]["train"],
                                                manifest["counts"]["written"]["eval"])
    rows = train.to_pylist() + evals.to_pylist()
    assert len({r["content_key"] for r in rows}) == len(rows)  # no duplicates left
    assert {r["format"] for r in rows} == {"sagemaker", "openai", "sharegpt", "prompt"}
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) == r["num_tokens"] <= MAX_TOKENS
        assert sum(r["loss_mask"]) == r["num_loss_tokens"]
        assert (r["num_loss_tokens"] > 0) == r["has_reply"] == (r["reply"] is not None)
    assert manifest["eval_threshold"] == EVAL_FRACTION  # enough records: the fraction alone decides
    assert all(split_of(r["id"], EVAL_FRACTION) == "eval" for r in evals.to_pylist())
    assert all(split_of(r["id"], EVAL_FRACTION) == "train" for r in train.to_pylist())
    assert 0.05 < evals.num_rows / len(rows) < 0.15

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for r in [r for r in rows if r["has_reply"]][:300]:
        masked = [t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m]
        assert tok.decode(masked) == r["reply"] + "<|im_end|>"


def test_rerun_overwrites_instead_of_appending(local_run, capture, tokenizer_dir):
    from pipelines.ingest import run_ingest

    out, first, _ = local_run
    rows_before = _parquet(split_uri(str(out), "train")).num_rows + _parquet(split_uri(str(out), "eval")).num_rows
    again = run_ingest(_config(input=str(capture[0]), target=str(tokenizer_dir), out=str(out)))
    assert again["counts"] == first["counts"]
    rows_after = _parquet(split_uri(str(out), "train")).num_rows + _parquet(split_uri(str(out), "eval")).num_rows
    assert rows_after == rows_before == first["counts"]["written"]["total"]
    assert len(_quarantine_rows(split_uri(str(out), "quarantine"))) == first["counts"]["quarantined"]


def test_s3_ingest_matches_local(ray_local, s3_bucket, capture, tokenizer_dir, local_run):
    from pipelines.ingest import run_ingest

    root, expected = capture
    src, out, target = f"{s3_bucket}/capture", f"{s3_bucket}/datasets/v1", f"{s3_bucket}/targets/tiny"
    storage.upload(str(root), src)
    storage.upload(str(tokenizer_dir), target)  # the target is read from s3:// too
    manifest = run_ingest(_config(input=src, target=target, out=out))
    _check_accounting(manifest["counts"], expected)
    assert manifest["counts"] == local_run[1]["counts"]
    assert json.loads(storage.read_text(f"{out}/manifest.json"))["counts"] == manifest["counts"]
    assert _parquet(split_uri(out, "train")).num_rows == manifest["counts"]["written"]["train"]
    rows = _quarantine_rows(split_uri(out, "quarantine"))
    assert len(rows) == manifest["counts"]["quarantined"]
    assert all(r["source"].startswith(f"{src}/aerie-demo/") for r in rows)


def test_cli_ingest_and_config_errors(ray_local, tmp_path, tokenizer_dir):
    from typer.testing import CliRunner

    from aerie.cli import app
    from aerie.traffic import generate_traffic
    from pipelines.ingest import main

    generate_traffic(str(tokenizer_dir), str(tmp_path / "cap"), requests=60, seed=5)
    runner = CliRunner()
    result = runner.invoke(app, ["ingest", "--input", str(tmp_path / "cap"), "--target", str(tokenizer_dir),
                                 "--out", str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 0, result.output
    counts = json.loads(result.output.strip().splitlines()[-1])
    assert counts["read"] == 60 and counts["parsed"] + counts["duplicates"] == 60
    # 5 % of 60 records would be ~3 eval rows, a noisy figure: at least 16, up to a quarter, are held out
    assert counts["too_long"] == 0 and counts["written"]["eval"] == min(16, counts["parsed"] // 4)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["eval_threshold"] > 0.05

    missing = runner.invoke(app, ["ingest", "--input", str(tmp_path / "nothing-here"), "--target",
                                  str(tokenizer_dir), "--out", str(tmp_path / "out2"), "--no-progress"])
    assert missing.exit_code == 1 and "not found" in missing.output
    bad = runner.invoke(app, ["ingest", "--input", "x", "--target", "y", "--out", "gs://z", "--max-tokens", "0"])
    assert bad.exit_code != 0 and "--max-tokens" in bad.output and "--out" in bad.output
    with pytest.raises(ValidationError) as e:
        _config(input="x", target="y", out="z", eval_fraction=1.0)
    assert e.value.errors()[0]["loc"] == ("eval_fraction",)
    assert main(["--input", "x", "--target", "y", "--out", "z", "--eval-fraction", "-1"]) == 2


def test_template_failures_are_quarantined_in_the_pipeline(ray_local, tmp_path, tokenizer_dir):
    from aerie.traffic import generate_traffic
    from pipelines.ingest import run_ingest

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.chat_template = (  # a target that refuses system prompts
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok.save_pretrained(str(tmp_path / "strict-target"))
    generate_traffic(str(tokenizer_dir), str(tmp_path / "cap"), requests=80, seed=11)
    manifest = run_ingest(_config(input=str(tmp_path / "cap"), target=str(tmp_path / "strict-target"),
                                  out=str(tmp_path / "out")))
    counts = manifest["counts"]
    assert counts["parsed"] + counts["quarantined"] + counts["duplicates"] + counts["too_long"] == counts["read"] == 80
    assert counts["quarantined_by_reason"].get("template_error", 0) == counts["quarantined"] > 0
    rows = _quarantine_rows(split_uri(str(tmp_path / "out"), "quarantine"))
    assert len(rows) == counts["quarantined"]
    assert all(r["stage"] == "template" and r["id"] and '"system"' in r["raw"] for r in rows)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_killed_mid_write_leaves_the_previous_output_whole(where, ray_local, request, tmp_path,
                                                                   tokenizer_dir, monkeypatch):
    """The second run dies after writing its train split: the manifest still names the first run's
    complete version, whose files are all there. A third run replaces it and prunes the debris."""
    import ray

    from aerie.data.ingest_output import read_manifest
    from aerie.traffic import generate_traffic
    from pipelines.ingest import run_ingest

    out = f"{request.getfixturevalue('s3_bucket')}/killed" if where == "s3" else str(tmp_path / "out")
    generate_traffic(str(tokenizer_dir), str(tmp_path / "cap"), requests=40, seed=3)
    first = run_ingest(_config(input=str(tmp_path / "cap"), target=str(tokenizer_dir), out=out))
    generate_traffic(str(tokenizer_dir), str(tmp_path / "cap2"), requests=60, seed=4)
    real_write = ray.data.Dataset.write_parquet
    writes = []

    def killed_after_one_split(self, path, **kwargs):
        real_write(self, path, **kwargs)
        writes.append(path)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ray.data.Dataset, "write_parquet", killed_after_one_split)
    with pytest.raises(KeyboardInterrupt):
        run_ingest(_config(input=str(tmp_path / "cap2"), target=str(tokenizer_dir), out=out))
    monkeypatch.setattr(ray.data.Dataset, "write_parquet", real_write)
    assert len(writes) == 1 and first["generation"] not in writes[0]  # the new version's train split
    assert read_manifest(out) == json.loads(storage.read_text(storage.join(out, "manifest.json"))) == first
    for split in ("train", "eval"):
        assert _parquet(split_uri(out, split)).num_rows == first["counts"]["written"][split]
    assert len(_quarantine_rows(split_uri(out, "quarantine"))) == first["counts"]["quarantined"]

    third = run_ingest(_config(input=str(tmp_path / "cap2"), target=str(tokenizer_dir), out=out))
    assert third["counts"]["read"] == 60
    assert _parquet(split_uri(out, "train")).num_rows == third["counts"]["written"]["train"]
    fs, path = storage.resolve(out)
    import pyarrow.fs as pafs

    kept = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(path)) if i.base_name.startswith("gen-"))
    assert kept == sorted([first["generation"], third["generation"]])  # the killed run's folder is gone
