"""The prompts a benchmark sends, as token ids: the user's own traffic by default.

- An `aerie ingest` output (a folder with `manifest.json`): its eval split, found through the
  manifest, each row's prompt exactly as ingest tokenized it (`input_ids[:prompt_tokens]`: the
  chat template with the generation prompt, what a server sees). Rows are taken in file order.
- A prompts file (`.jsonl` records as `aerie generate --prompts` reads them, or one prompt per
  line): chat records through the target's chat template with the generation prompt; a plain
  prompt as one user message, as ingest encodes it (raw text when the tokenizer has no template).
"""

from __future__ import annotations

import tempfile
from pathlib import Path, PurePosixPath

import pyarrow.parquet as pq

from aerie import storage
from aerie.data.ingest_output import MANIFEST, split_uri
from aerie.formats.chat import ChatEncoder
from aerie.generate import read_prompt_file


def _from_ingest_output(data: str, max_prompts: int) -> list[list[int]]:
    eval_dir = split_uri(data, "eval")
    files = sorted(storage.list_files(eval_dir, (".parquet",))) if storage.exists(eval_dir) else []
    prompts: list[list[int]] = []
    for uri in files:
        fs, path = storage.resolve(uri)
        table = pq.read_table(path, filesystem=fs, columns=["input_ids", "prompt_tokens"])
        for ids, n in zip(table["input_ids"].to_pylist(), table["prompt_tokens"].to_pylist(), strict=True):
            if n:
                prompts.append(ids[:n])
            if len(prompts) == max_prompts:
                return prompts
    if not prompts:
        raise ValueError(f"prompts: {data} is an ingest output with no eval rows under {eval_dir}")
    return prompts


def _from_file(uri: str, tokenizer, max_prompts: int) -> list[list[int]]:
    if storage.is_s3(uri):
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / PurePosixPath(uri).name
            local.write_bytes(storage.read_bytes(uri))
            records = read_prompt_file(local)
    else:
        records = read_prompt_file(uri)
    if not records:
        raise ValueError(f"prompts: {uri} holds no prompts")
    encoder = ChatEncoder(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    prompts = []
    for record in records[:max_prompts]:
        messages = [{"role": "user", "content": record}] if isinstance(record, str) else record
        text = encoder.render(messages, add_generation_prompt=True) if encoder is not None else str(record)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def load_prompts(source: str, tokenizer, max_prompts: int) -> list[list[int]]:
    """Token ids of up to `max_prompts` prompts from an ingest output or a prompts file."""
    if storage.exists(storage.join(source, MANIFEST)):
        return _from_ingest_output(source, max_prompts)
    if not storage.exists(source):
        raise FileNotFoundError(f"prompts: {source} does not exist")
    if storage.is_dir(source):
        raise ValueError(f"prompts: {source} is a folder without {MANIFEST}: not an `aerie ingest` output")
    return _from_file(source, tokenizer, max_prompts)
