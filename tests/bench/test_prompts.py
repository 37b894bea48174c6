"""Prompts from a prompts file, rendered as a server would see them; clear errors otherwise."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from aerie.bench.prompts import load_prompts
from aerie.formats.chat import ChatEncoder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_jsonl_records_go_through_the_chat_template(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is bisect?"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"messages": chat}, {"prompt": "def read(path):"},
                                                       {"prompt": "third"})) + "\n")
    prompts = load_prompts(str(path), tokenizer, max_prompts=2)
    encoder = ChatEncoder(tokenizer)
    expected = [encoder.render(chat, True), encoder.render([{"role": "user", "content": "def read(path):"}], True)]
    assert prompts == [tokenizer.encode(text, add_special_tokens=False) for text in expected]
    assert tokenizer.decode(prompts[1]).endswith("<|im_start|>assistant\n")


def test_bad_sources_are_named(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="prompts: .*missing.jsonl does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), tokenizer, 4)
    with pytest.raises(ValueError, match="not an `aerie ingest` output"):
        load_prompts(str(tmp_path), tokenizer, 4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(empty), tokenizer, 4)
