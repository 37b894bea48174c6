"""`aerie generate` as users and outside checks call it: the console script and its --json contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aerie.heads import new_head
from aerie.heads.io import save_head
from aerie.target import load_target

PROMPTS = ["def read_config(path):", "class LRUCache:"]


def run_cli(*args: str) -> list[dict]:
    aerie = Path(sys.executable).with_name("aerie")
    done = subprocess.run([str(aerie), "generate", *args, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def eagle3_head_dir(tiny_target_dir, tmp_path_factory) -> Path:
    target = load_target(tiny_target_dir)
    return Path(save_head(new_head(target, "eagle3", seed=0), tmp_path_factory.mktemp("heads") / "eagle3"))


def test_json_lines_match_the_contract_and_hf_greedy(tiny_target_dir):
    prompt_flags = [flag for prompt in PROMPTS for flag in ("--prompt", prompt)]
    lines = run_cli("--target", str(tiny_target_dir), *prompt_flags, "--max-tokens", "12")
    assert [line["prompt"] for line in lines] == PROMPTS
    target = load_target(tiny_target_dir)
    for line in lines:
        assert set(line) == {"prompt", "text", "token_ids", "acceptance_length"}
        assert line["acceptance_length"] is None
        ids = torch.tensor([target.tokenizer.encode(line["prompt"], add_special_tokens=False)])
        expected = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert line["token_ids"] == expected[0, ids.shape[1] :].tolist()
        assert line["text"] == target.tokenizer.decode(line["token_ids"], skip_special_tokens=True)


def test_speculative_method_from_a_head_dir_is_lossless(tiny_target_dir, eagle3_head_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--max-tokens", "12"]
    baseline = run_cli(*common)
    speculative = run_cli(*common, "--method", "eagle3", "--head", str(eagle3_head_dir), "--k", "3")
    assert [s["token_ids"] for s in speculative] == [b["token_ids"] for b in baseline]
    assert all(isinstance(s["acceptance_length"], float) for s in speculative)


def test_bad_method_and_missing_head_fail_clearly(tiny_target_dir):
    aerie = Path(sys.executable).with_name("aerie")
    done = subprocess.run(
        [str(aerie), "generate", "--target", str(tiny_target_dir), "--prompt", "x", "--method", "eagle3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "needs a draft head" in done.stderr


def test_prompts_file_reads_jsonl_records_and_names_a_broken_line(tmp_path):
    """Multi-line prompts in .jsonl records (the ingest parsers), one per line in .txt; a broken
    line is reported with its number."""
    from typer.testing import CliRunner

    from aerie.cli import app
    from aerie.generate import read_prompt_file

    code = "def add(a, b):\n    return a + b\n"
    good = tmp_path / "prompts.jsonl"
    good.write_text(json.dumps({"prompt": code}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Explain:\n" + code}]}) + "\n")
    assert read_prompt_file(good) == [code, [{"role": "user", "content": "Explain:\n" + code}]]
    plain = tmp_path / "prompts.txt"
    plain.write_text("one\n\ntwo\n")
    assert read_prompt_file(plain) == ["one", "two"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": "fine"}) + "\n{\"prompt\": \"cut off\n")
    result = CliRunner().invoke(app, ["generate", "--target", "unused", "--prompts", str(broken)])
    assert result.exit_code != 0 and "line 2" in result.output


def test_generate_json_from_a_jsonl_file(tiny_target_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):\n    return"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = run_cli("--target", str(tiny_target_dir), "--prompts", str(path), "--max-tokens", "4")
    assert len(out) == 2 and out[0]["prompt"] == "def f(x):\n    return" and out[1]["prompt"][0]["content"] == "hi"
    assert all(len(o["token_ids"]) <= 4 for o in out)
