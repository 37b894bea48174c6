"""Fixtures for the regeneration and featurize pipelines: a tiny random target (built in well under
a second) and a small capture with every case those stages treat differently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

MAX_TOKENS = 64  # the ingest length filter in these tests: tight, so the filter matters
REPLY_TOKENS = 20  # longest regenerated reply
EOS_SCALE = 24.0  # makes the end-of-turn token the greedy choice now and then (see tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A random 4-layer Llama (hidden 64) with the ChatML test tokenizer, saved as a HF model dir.

    Its end-of-turn row of ``lm_head`` is scaled up so some greedy replies stop on ``<|im_end|>``
    within a few tokens and others run to the length limit: both endings get tested.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tok.eos_token_id, bos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= EOS_SCALE
    out = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine two spinning OpenMP
    threads made a 26-prompt greedy run take 18 s instead of 0.15 s. Restored afterwards."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _prompt_of_exactly(tokenizer, n_tokens: int) -> str:
    """A user message whose prompt render (ChatML + generation prompt) is exactly ``n_tokens`` long."""
    from aerie.formats import ChatEncoder

    enc = ChatEncoder(tokenizer)
    for words in range(1, 4 * n_tokens):
        for tail in ("", ".", "?"):
            text = " ".join(["a"] * words) + tail
            if len(enc.encode([{"role": "user", "content": text}], None).input_ids) == n_tokens:
                return text
    raise AssertionError(f"no prompt of exactly {n_tokens} tokens")


@pytest.fixture(scope="session")
def small_capture(tmp_path_factory, tokenizer_dir) -> tuple[Path, dict]:
    """30 lines: 18 ShareGPT exchanges with replies, 8 input-only prompts, 1 exact duplicate, 1 broken
    line, 1 exchange whose captured reply is too long, and 1 input-only prompt of exactly
    MAX_TOKENS tokens (fits as captured, leaves no room for a regenerated reply)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    lines, replies = [], {}
    for i in range(18):
        q, a = f"What does f{i}(x) return for x = {i}?", f"It returns {i * i}."
        lines.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        replies[q] = a
    for i in range(8):
        lines.append({"prompt": f"Explain def g{i}(a, b): return a * {i} + b"})
    lines.append(lines[0])  # an exact re-delivery
    lines.append({"conversations": [{"from": "human", "value": "Say a lot."},
                                    {"from": "gpt", "value": " ".join(["word"] * 200)}]})
    lines.append({"prompt": _prompt_of_exactly(tok, MAX_TOKENS)})
    root = tmp_path_factory.mktemp("small-capture")
    text = "\n".join(json.dumps(line) for line in lines) + "\n{not json\n"
    (root / "capture.jsonl").write_text(text)
    expected = {"max_tokens": MAX_TOKENS, "read": 30, "duplicates": 1, "quarantined": 1, "too_long_captured": 1,
                "no_room": 1, "written_plain": 27, "replies": replies}
    return root, expected


@pytest.fixture(scope="session")
def regenerated(ray_local, small_capture, tiny_target_dir, tmp_path_factory) -> tuple[Path, dict, dict]:
    """``ingest --regenerate`` of ``small_capture`` with the tiny target (2 actors): the output folder,
    the manifest, and what ``small_capture`` expects. Featurize tests read it too."""
    from pipelines.ingest import IngestConfig, run_ingest

    root, expected = small_capture
    out = tmp_path_factory.mktemp("regenerated")
    manifest = run_ingest(IngestConfig(
        input=str(root), target=str(tiny_target_dir), out=str(out), max_tokens=MAX_TOKENS, eval_fraction=0.2,
        progress=False, regenerate=True, regenerate_max_tokens=REPLY_TOKENS, regenerate_actors=2,
    ))
    return out, manifest, {**expected, "reply_tokens": REPLY_TOKENS}
