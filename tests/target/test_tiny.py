"""The tiny target builder, on a capped corpus and a handful of steps (a few seconds a build)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import aerie.target.tiny as tiny

QUICK = {"steps": 3, "max_files": 8}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return tiny.build_tiny_target(tmp_path_factory.mktemp("tiny") / "llama", seed=1, **QUICK)


def test_loads_offline_as_a_normal_hf_dir(built: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 256, 8, 4)
    assert cfg.intermediate_size == 768 and not cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok) == model.get_output_embeddings().weight.shape[0]
    assert tok.eos_token == "<|endoftext|>"
    stops = set(model.generation_config.eos_token_id)
    assert stops == {tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")}
    ids = tok("def add(a, b):\n    return a + b\n", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "def add(a, b):\n    return a + b\n"
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))

    build = json.loads((built / "build.json").read_text())
    assert build["params"]["steps"] == 3 and build["params"]["arch"] == "llama"
    assert build["results"]["samples"]["greedy"].startswith("def")
    assert build["results"]["heldout_loss"] > 0


def test_chat_template_is_chatml(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # one token each, not split into bytes
    assert tok.apply_chat_template(messages[1:], tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_prompt_ending_in_newline_splits_like_training_text(built: Path) -> None:
    """The reply after a generation prompt (or a signature line) is tokenized on its own at serving
    time; the token boundary must be the one the model saw in training, where both were one text."""
    tok = AutoTokenizer.from_pretrained(built)
    chat = [{"role": "user", "content": "Complete this function:\ndef inc(x):"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for head, tail in ((prompt, "    return x + 1<|im_end|>\n"), ("def inc(x):\n", "    return x + 1\n")):
        assert tok(head).input_ids + tok(tail).input_ids == tok(head + tail).input_ids


def test_same_seed_same_bytes(built: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny_target(tmp_path / "again", seed=1, **QUICK)
    assert (again / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()


def test_cache_hit_does_not_retrain(built: Path, monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("retrained a cached build")

    monkeypatch.setattr(tiny, "_build", fail)
    assert tiny.build_tiny_target(built, seed=1, **QUICK) == built
    with pytest.raises(AssertionError, match="retrained"):  # different parameters are not a hit
        tiny.build_tiny_target(built, seed=2, **QUICK)


def test_partial_build_is_rebuilt(built: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(built, partial)
    (partial / "build.json").unlink()
    (partial / "model.safetensors").write_bytes(b"truncated")
    tiny.build_tiny_target(partial, seed=1, **QUICK)
    assert (partial / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert not list(tmp_path.glob(".partial.tmp-*"))


def test_killed_builds_leave_no_orphans(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tiny, "_build", lambda *args: {})
    out = tmp_path / "t"
    dead, alive = tmp_path / ".t.tmp-999999999-1", tmp_path / f".t.tmp-{os.getpid()}-1"
    dead.mkdir()
    alive.mkdir()
    tiny.build_tiny_target(out, seed=1, **QUICK)
    assert not dead.exists() and alive.exists()


def test_refuses_to_replace_a_foreign_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        tiny.build_tiny_target(tmp_path, **QUICK)


def test_qwen3_arch(tmp_path: Path) -> None:
    out = tiny.build_tiny_target(tmp_path / "qwen3", arch="qwen3", **QUICK)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.head_dim == 32 and model.config.num_hidden_layers == 8


def test_minutes_become_a_fixed_step_count(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tiny, "STEPS_PER_MINUTE", 60)
    monkeypatch.setattr(tiny, "_build", lambda *args: {})
    out = tiny.build_tiny_target(tmp_path / "m", minutes=0.05, max_files=QUICK["max_files"])
    assert json.loads((out / "build.json").read_text())["params"]["steps"] == 3
