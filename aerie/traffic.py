"""Demo traffic: captured requests synthesised from Python source: the standard library's by
default, or any folders of it (installed packages: traffic about code a target never saw).

Two tasks, both answered with real source so a model trained on that code can serve them:
- ``complete``: the function's signature and docstring; the reply is the rest of the function.
- ``explain``: the whole function; the reply is built from its docstring.

Written as SageMaker Data Capture (a mix of JSON and BASE64 encodings, TGI-style, OpenAI-chat
and OpenAI-completions payloads, some input-only events), OpenAI request/response logs, or
ShareGPT conversations. No Ray here; ``aerie traffic`` calls :func:`generate_traffic`.
"""

from __future__ import annotations

import ast
import json
import os
import random
import textwrap
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

from aerie import storage
from aerie.formats.capture import DataCaptureWriter, capture_event, format_time
from aerie.target.corpus import is_heldout, python_files

__all__ = [
    "Exchange",
    "source_files",
    "source_functions",
    "synthesize",
    "sagemaker_event",
    "openai_line",
    "sharegpt_line",
    "generate_traffic",
    "FORMATS",
]

FORMATS = ("sagemaker", "openai", "sharegpt")
MODEL_NAME = "aerie-target"
SYSTEM_PROMPT = "You are a concise Python assistant."
_COMPLETE_ASKS = (
    "Complete this Python function:\n```python\n{code}\n```",
    "Finish the implementation:\n\n{code}",
    "Write the body of this function.\n```python\n{code}\n```",
    "{code}",
)
_EXPLAIN_ASKS = (
    "Explain what this function does:\n```python\n{code}\n```",
    "What does `{name}` do?\n\n{code}",
    "Summarise this code in a sentence or two.\n```python\n{code}\n```",
)


@dataclass(frozen=True, slots=True)
class Function:
    module: str
    name: str
    head: str  # signature (+ docstring), dedented
    body: str  # the rest, dedented the same way
    doc: str | None

    @property
    def source(self) -> str:
        return self.head + self.body


@dataclass(slots=True)
class Exchange:
    """One synthetic request and its reply, in both chat and raw-prompt views."""

    task: str  # "complete" | "explain"
    messages: list[dict[str, str]]
    prompt: str  # raw prompt for TGI / completions-style requests
    reply: str
    params: dict[str, Any] = field(default_factory=dict)


def _functions_in(path: str | Path, max_chars: int) -> list[Function]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    module = os.path.splitext(os.path.basename(path))[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        end = node.end_lineno or node.lineno
        doc = ast.get_docstring(node)
        body_nodes = node.body[1:] if doc is not None else node.body
        if not body_nodes:
            continue
        split = body_nodes[0].lineno
        src = lines[node.lineno - 1 : end]
        if sum(len(s) for s in src) > max_chars or split <= node.lineno:
            continue
        whole_lines = textwrap.dedent("".join(src)).splitlines(keepends=True)
        n_head = split - node.lineno  # the signature (and docstring) lines
        head, body = "".join(whole_lines[:n_head]), "".join(whole_lines[n_head:])
        if not body.strip() or not head.strip():
            continue
        out.append(Function(module, node.name, head, body, doc))
    return out


PARTS = ("all", "train", "eval")
EVAL_FILES_ONE_IN = 5


def source_files(sources: tuple[str, ...] | None = None, part: str = "all") -> list[Path]:
    """The Python files traffic is drawn from (`aerie.target.corpus.python_files`; default the
    standard library), optionally one `part` of them: `eval` is about one file in five (by a hash
    of its path), `train` the rest, so prompts for evaluation never share a file with training."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, not {part!r}")
    files = python_files(list(sources) if sources else None)
    if part == "all":
        return list(files.values())
    return [path for key, path in files.items() if is_heldout(key, EVAL_FILES_ONE_IN) == (part == "eval")]


@lru_cache(maxsize=4)
def source_functions(
    min_count: int = 2000,
    seed: int = 0,
    max_chars: int = 3000,
    sources: tuple[str, ...] | None = None,
    part: str = "all",
) -> tuple[Function, ...]:
    """Functions from the source files (visited in a seeded order), at least ``min_count`` when
    there are that many."""
    files = source_files(sources, part)
    random.Random(seed).shuffle(files)
    found: list[Function] = []
    for path in files:
        found += _functions_in(path, max_chars)
        if len(found) >= min_count:
            break
    return tuple(found)


def _explanation(fn: Function) -> str:
    doc = (fn.doc or "").strip()
    first = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    return f"`{fn.name}` (in `{fn.module}`): {first}"


def _count_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    if tokenizer is None:
        return [len(t) // 3 for t in texts]  # rough: ~3 characters per token for code
    enc = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [len(e.ids) for e in enc]


def synthesize(
    n: int,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    max_tokens: int = 1024,
    sources: tuple[str, ...] | None = None,
    part: str = "all",
) -> list[Exchange]:
    """``n`` exchanges drawn from functions of the source files (default the standard library),
    each fitting ``max_tokens`` (prompt + reply)."""
    rng = random.Random(seed)
    pool = source_functions(min(max(n, 1000), 8000), seed, sources=sources, part=part)
    counts = _count_tokens(tokenizer, [f.source for f in pool])
    # complete: the function's source split between prompt and reply; explain: the whole source in
    # the prompt and the explanation as the reply. 96 tokens for the template and the asks.
    fits = [f for f, c in zip(pool, counts, strict=True) if c + 96 <= max_tokens]
    if not fits:
        raise ValueError(f"no function of the sources fits in {max_tokens} tokens")
    documented = [f for f in fits if f.doc and f.doc.strip()]
    explained = _count_tokens(tokenizer, [f.source + _explanation(f) for f in documented])
    explainable = [f for f, c in zip(documented, explained, strict=True) if c + 96 <= max_tokens]
    out = []
    for _ in range(n):
        if explainable and rng.random() < 0.35:
            fn = rng.choice(explainable)
            ask = rng.choice(_EXPLAIN_ASKS).format(code=fn.source.rstrip("\n"), name=fn.name)
            task, reply, prompt = "explain", _explanation(fn), ask
        else:
            fn = rng.choice(fits)
            ask = rng.choice(_COMPLETE_ASKS).format(code=fn.head.rstrip("\n"))
            task, reply, prompt = "complete", fn.body, fn.head
        messages = [{"role": "user", "content": ask}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        params = {"max_tokens": int(min(max_tokens, 512)), "temperature": rng.choice([0.0, 0.2, 0.7])}
        out.append(Exchange(task, messages, prompt, reply, params))
    return out


# ----------------------------------------------------------------------------- payloads


def _tgi(ex: Exchange, rng: random.Random) -> tuple[dict, Any]:
    req = {
        "inputs": ex.prompt,
        "parameters": {"max_new_tokens": ex.params["max_tokens"], "temperature": ex.params["temperature"],
                       "do_sample": ex.params["temperature"] > 0},
    }
    resp: Any = [{"generated_text": ex.reply}] if rng.random() < 0.6 else {"generated_text": ex.reply}
    return req, resp


def _usage(ex: Exchange) -> dict[str, int]:
    p, c = len(ex.prompt) // 4 + 1, len(ex.reply) // 4 + 1
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _openai_chat(ex: Exchange, created: int) -> tuple[dict, dict]:
    req = {"model": MODEL_NAME, "messages": ex.messages, "max_tokens": ex.params["max_tokens"],
           "temperature": ex.params["temperature"]}
    resp = {
        "id": f"chatcmpl-{uuid.UUID(int=created * 7919 + len(ex.reply)).hex[:24]}",
        "object": "chat.completion",
        "created": created,
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ex.reply}, "finish_reason": "stop"}],
        "usage": _usage(ex),
    }
    return req, resp


def _openai_completion(ex: Exchange, created: int) -> tuple[dict, dict]:
    req = {"model": MODEL_NAME, "prompt": ex.prompt, "max_tokens": ex.params["max_tokens"],
           "temperature": ex.params["temperature"]}
    resp = {
        "id": f"cmpl-{uuid.UUID(int=created * 104729 + len(ex.reply)).hex[:24]}",
        "object": "text_completion",
        "created": created,
        "model": MODEL_NAME,
        "choices": [{"index": 0, "text": ex.reply, "finish_reason": "stop", "logprobs": None}],
        "usage": _usage(ex),
    }
    return req, resp


def sagemaker_event(
    ex: Exchange,
    rng: random.Random,
    when: datetime,
    *,
    base64_fraction: float = 0.4,
    input_only_fraction: float = 0.1,
) -> dict[str, Any]:
    """A Data Capture event: TGI (50%), OpenAI chat (35%) or completions (15%) payload."""
    created = int(when.timestamp())
    roll = rng.random()
    if roll < 0.5:
        req, resp = _tgi(ex, rng)
    elif roll < 0.85:
        req, resp = _openai_chat(ex, created)
    else:
        req, resp = _openai_completion(ex, created)
    encoding = "BASE64" if rng.random() < base64_fraction else "JSON"
    input_only = rng.random() < input_only_fraction
    return capture_event(
        req,
        None if input_only else resp,
        encoding=encoding,
        event_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        inference_time=when,
    )


def openai_line(ex: Exchange, rng: random.Random, when: datetime, *, input_only_fraction: float = 0.1) -> dict:
    """An OpenAI request/response log line (chat 75%, completions 25%)."""
    created = int(when.timestamp())
    req, resp = _openai_chat(ex, created) if rng.random() < 0.75 else _openai_completion(ex, created)
    line: dict[str, Any] = {"id": resp["id"], "timestamp": format_time(when), "request": req}
    if rng.random() >= input_only_fraction:
        line["response"] = resp
    return line


def sharegpt_line(ex: Exchange, rng: random.Random, when: datetime, *, input_only_fraction: float = 0.1) -> dict:
    """A ShareGPT conversation (system/human/gpt turns)."""
    turns = [{"from": "system" if m["role"] == "system" else "human", "value": m["content"]} for m in ex.messages]
    if rng.random() >= input_only_fraction:
        turns.append({"from": "gpt", "value": ex.reply})
    return {"id": str(uuid.UUID(int=rng.getrandbits(128), version=4)), "conversations": turns}


def _load_tokenizer(target: str | None) -> Any:
    if not target or not storage.exists(target):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(storage.download_model_files(target)))
    except (OSError, ValueError):
        return None


def generate_traffic(
    target: str | None,
    out: str,
    *,
    requests: int = 1000,
    fmt: str = "sagemaker",
    seed: int = 0,
    max_tokens: int = 1024,
    endpoint: str = "aerie-demo",
    variant: str = "AllTraffic",
    records_per_file: int = 500,
    input_only_fraction: float = 0.1,
    base64_fraction: float = 0.4,
    start: datetime | None = None,
    sources: tuple[str, ...] | None = None,
    part: str = "all",
) -> dict[str, Any]:
    """Write ``requests`` synthetic captured requests under ``out``; returns a summary. ``sources``
    and ``part`` choose the source files (see :func:`source_files`).

    ``sagemaker`` files land in the Data Capture layout ``out/endpoint/variant/yyyy/mm/dd/hh/``;
    ``openai`` and ``sharegpt`` as ``out/<fmt>-NNNNN.jsonl``. Same seed, same files.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if requests < 1:
        raise ValueError("requests must be at least 1")
    tokenizer = _load_tokenizer(target)
    exchanges = synthesize(
        requests, seed=seed, tokenizer=tokenizer, max_tokens=max_tokens, sources=sources, part=part
    )
    rng = random.Random(seed + 1)
    when = start or datetime(2026, 4, 29, tzinfo=timezone.utc)
    files: list[str]
    if fmt == "sagemaker":
        names = random.Random(seed + 2)
        writer = DataCaptureWriter(
            out, endpoint, variant, max_records=records_per_file,
            name_factory=lambda: str(uuid.UUID(int=names.getrandbits(128), version=4)),
        )
        for ex in exchanges:
            when += timedelta(seconds=rng.expovariate(1 / 4.0))
            writer.add(sagemaker_event(ex, rng, when, base64_fraction=base64_fraction,
                                       input_only_fraction=input_only_fraction))
        writer.close()
        files = writer.written
    else:
        make = openai_line if fmt == "openai" else sharegpt_line
        lines = []
        for ex in exchanges:
            when += timedelta(seconds=rng.expovariate(1 / 4.0))
            lines.append(json.dumps(make(ex, rng, when, input_only_fraction=input_only_fraction),
                                    ensure_ascii=False))
        files = []
        for k in range(0, len(lines), records_per_file):
            uri = storage.join(out, f"{fmt}-{k // records_per_file:05d}.jsonl")
            storage.write_text(uri, "\n".join(lines[k : k + records_per_file]) + "\n")
            files.append(uri)
    return {
        "out": str(out),
        "format": fmt,
        "requests": requests,
        "files": len(files),
        "tasks": {t: sum(1 for e in exchanges if e.task == t) for t in ("complete", "explain")},
        "tokenizer": bool(tokenizer),
    }
