"""Regeneration (ingest --regenerate): every written reply is what the target itself says.

The replies equal the engine's own greedy output for the same prompt tokens, the loss mask covers
exactly the generated tokens (end-of-turn included), the captured reply is kept, the length filter
and the accounting invariant hold, and a rerun writes the same rows.
"""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from aerie import storage
from aerie.data.ingest_output import split_uri

MAX_TOKENS = 64  # as the shared fixture ran ingest (checked in regen_run)
REPLY_TOKENS = 20
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(out) -> list[dict]:
    rows = []
    for split in ("train", "eval"):
        fs, path = storage.resolve(split_uri(str(out), split))
        rows += pads.dataset(path, filesystem=fs, format="parquet").to_table().to_pylist()
    return sorted(rows, key=lambda r: r["id"])


@pytest.fixture(scope="module")
def regen_run(regenerated):
    out, manifest, expected = regenerated  # ingest --regenerate, 2 actors (tests/pipelines/conftest.py)
    assert (expected["max_tokens"], expected["reply_tokens"]) == (MAX_TOKENS, REPLY_TOKENS)
    return out, manifest, expected


def test_replies_are_the_targets_own_greedy_replies(regen_run, tiny_target_dir):
    from aerie.engine import Engine, EngineConfig, SamplingParams
    from aerie.formats import ChatEncoder
    from aerie.target import load_target

    out, manifest, expected = regen_run
    rows = _rows(out)
    assert len(rows) == manifest["counts"]["written"]["total"] == expected["written_plain"] - expected["no_room"]
    target = load_target(str(tiny_target_dir))
    prompts = [r["input_ids"][: r["prompt_tokens"]] for r in rows]
    params = [SamplingParams(max_tokens=min(REPLY_TOKENS, MAX_TOKENS - len(p))) for p in prompts]
    completions = Engine(target, EngineConfig(max_slots=16, max_len=MAX_TOKENS)).generate(prompts, params)
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    encoder = ChatEncoder(target.tokenizer)
    for row, prompt, done in zip(rows, prompts, completions, strict=True):
        assert row["regenerated"] and row["has_reply"]
        assert prompt == encoder.encode(row["messages"], None).input_ids  # chat template + generation prompt
        assert row["input_ids"] == prompt + done.token_ids  # the prompt is untouched, the reply is the engine's
        assert row["reply"] == done.text and row["finish_reason"] == done.finish_reason
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert masked == done.token_ids and row["loss_mask"] == [0] * len(prompt) + [1] * len(done.token_ids)
        assert row["num_loss_tokens"] == len(done.token_ids) and row["num_tokens"] == len(row["input_ids"])
        assert row["num_tokens"] <= MAX_TOKENS
        if done.finish_reason == "stop":
            assert masked[-1] == eos  # the end-of-turn token is learned too
        # the captured reply is kept for reference (None for input-only records)
        question = row["messages"][-1]["content"]
        assert row["original_reply"] == expected["replies"].get(question)
    endings = Counter(r["finish_reason"] for r in rows)
    assert endings["stop"] > 0 and endings["length"] > 0
    assert sum(r["original_reply"] is None for r in rows) == 8  # input-only records got a reply too


def test_accounting_holds_with_regeneration(regen_run):
    out, manifest, expected = regen_run
    counts = manifest["counts"]
    assert counts["parsed"] + counts["quarantined"] + counts["duplicates"] + counts["too_long"] == counts["read"]
    assert counts["read"] == expected["read"] and counts["duplicates"] == expected["duplicates"]
    assert counts["quarantined"] == expected["quarantined"]
    # the exactly-max_tokens prompt fits as captured but leaves no room for a reply: too long
    assert counts["too_long"] == expected["too_long_captured"] + expected["no_room"]
    assert counts["regenerated"] == counts["written"]["total"] == counts["parsed"]
    assert counts["regeneration_failed"] == 0 and counts["input_only"] == 0
    regen = manifest["regeneration"]
    assert regen["no_room"] == expected["no_room"] and regen["errors"] == []
    assert regen["stopped"] + regen["truncated"] == regen["regenerated"]
    assert regen["input_only"] == 8  # the prompt-only records, replied to by the target
    assert regen["generated_tokens"] == sum(r["num_loss_tokens"] for r in _rows(out))
    assert regen["seconds"] > 0 and regen["records_per_s"] > 0 and manifest["timings_s"]["regenerate"] > 0
    assert regen["settings"]["actors"] == 2 and regen["settings"]["temperature"] == 0.0
    assert json.loads((out / "manifest.json").read_text())["counts"] == counts


def test_rerun_from_the_cli_writes_the_same_rows(regen_run, small_capture, tiny_target_dir):
    from typer.testing import CliRunner

    from aerie.cli import app

    out, manifest, _ = regen_run
    before = _rows(out)
    result = CliRunner().invoke(app, [
        "ingest", "--input", str(small_capture[0]), "--target", str(tiny_target_dir), "--out", str(out),
        "--max-tokens", str(MAX_TOKENS), "--eval-fraction", "0.2", "--no-progress", "--regenerate",
        "--regenerate-max-tokens", str(REPLY_TOKENS),  # one actor this time: the same rows anyway
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1]) == manifest["counts"]
    assert _rows(out) == before


def _table(rows: list[dict]) -> pa.Table:
    """Rows back in the encoded form the regeneration stage receives."""
    from aerie.formats.tables import PARSED_SCHEMA, RECORD_COLUMNS, TOKEN_FIELDS

    schema = pa.schema([PARSED_SCHEMA.field(k) for k in RECORD_COLUMNS] + [pa.field(k, t) for k, t in TOKEN_FIELDS])
    return pa.Table.from_pylist([{**r, "status": "ok", "detail": None, "split": "train"} for r in rows], schema=schema)


def test_sampled_regeneration_depends_on_record_and_seed_only(regen_run, tiny_target_dir):
    """Per-record seeds: the same record samples the same reply whatever else shares its block."""
    from aerie.data.regenerate import RegenerateConfig, regenerate_table
    from aerie.engine import Engine, EngineConfig
    from aerie.target import load_target

    rows = _rows(regen_run[0])[:10]
    for r in rows:  # back to the encoded form: prompt only
        r["input_ids"], r["loss_mask"] = r["input_ids"][: r["prompt_tokens"]], [0] * r["prompt_tokens"]
    engine = Engine(load_target(str(tiny_target_dir)), EngineConfig(max_slots=4, max_len=MAX_TOKENS))
    cfg = RegenerateConfig(target="unused", max_tokens=MAX_TOKENS, max_new_tokens=REPLY_TOKENS, temperature=1.0,
                           seed=7)
    whole = regenerate_table(_table(rows), engine.generate, cfg).to_pylist()
    alone = regenerate_table(_table(rows[::-1][:4]), engine.generate, cfg).to_pylist()[::-1]
    other_seed = regenerate_table(_table(rows), engine.generate,
                                  RegenerateConfig(**{**cfg.__dict__, "seed": 8})).to_pylist()
    assert [r["input_ids"] for r in alone] == [r["input_ids"] for r in whole[-4:]]
    assert [r["input_ids"] for r in other_seed] != [r["input_ids"] for r in whole]


def test_a_failing_row_keeps_its_captured_reply(regen_run):
    from aerie.data.regenerate import RegenerateConfig, regenerate_table
    from pipelines.regenerate import summarize

    rows = [r for r in _rows(regen_run[0]) if r["original_reply"] is not None][:3]
    for r in rows:  # as encoded from a captured reply of two tokens
        n = r["prompt_tokens"]
        r["input_ids"], r["loss_mask"] = r["input_ids"][:n] + [5, 6], [0] * n + [1, 1]
    bad = rows[1]["input_ids"][: rows[1]["prompt_tokens"]]

    class Done:
        def __init__(self, n):
            self.token_ids, self.text, self.finish_reason = [9] * n, "x" * n, "length"

    def generate(prompts, params):
        if bad in prompts:
            raise RuntimeError("device fell over")
        return [Done(p.max_tokens) for p in params]

    cfg = RegenerateConfig(target="unused", max_tokens=MAX_TOKENS, max_new_tokens=3)
    out = regenerate_table(_table(rows), generate, cfg).to_pylist()
    assert [r["regenerated"] for r in out] == [True, False, True]
    assert out[1]["input_ids"] == rows[1]["input_ids"] and out[1]["loss_mask"] == rows[1]["loss_mask"]
    assert out[1]["reply"] == rows[1]["reply"] and "device fell over" in out[1]["detail"]
    assert out[0]["input_ids"][-3:] == [9, 9, 9] and out[0]["loss_mask"][-4:] == [0, 1, 1, 1]

    import ray

    summary = summarize(ray.data.from_arrow(regenerate_table(_table(rows), generate, cfg)))
    assert (summary["regenerated"], summary["regeneration_failed"]) == (2, 1)
    assert "device fell over" in summary["errors"][0]


def test_regeneration_that_fails_too_often_fails_the_job(regen_run, ray_local, tiny_target_dir):
    """Prompts the target cannot take (token ids from another tokenizer, outside its vocabulary):
    every row fails in the real engine actor. The job fails with the count and the first error
    instead of keeping the captured replies and reporting success; within the rate it passes."""
    import ray

    from aerie.data.regenerate import RegenerateConfig, RegenerationFailed
    from pipelines.regenerate import regenerate

    rows = [r for r in _rows(regen_run[0]) if r["original_reply"] is not None][:4]
    for r in rows:
        n = r["prompt_tokens"]
        r["input_ids"], r["loss_mask"] = [10**6] * n + [5, 6], [0] * n + [1, 1]
    cfg = RegenerateConfig(target=str(tiny_target_dir), max_tokens=MAX_TOKENS, max_new_tokens=3)
    with pytest.raises(RegenerationFailed, match=r"failed for 4 of 4 rows .* first error: regeneration failed: "):
        regenerate(ray.data.from_arrow(_table(rows)), cfg)
    lenient = RegenerateConfig(**{**cfg.__dict__, "max_failure_rate": 1.0})
    _, summary = regenerate(ray.data.from_arrow(_table(rows)), lenient)
    assert (summary["regenerated"], summary["regeneration_failed"]) == (0, 4)
