"""Session fixtures for the Ray Train head jobs: a small random-config target saved with a tokenizer,
and ingest-layout Parquet data made of the target's own greedy replies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

# Ray Train's controller takes one `ray.train.report` per health-check interval (2 s by default):
# poll faster so the tests' checkpoints do not wait on it. Set before any Ray process starts.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

PROMPT_LEN = 8
REPLY_LEN = 32


@pytest.fixture(scope="session")
def fit_target(tmp_path_factory, tokenizer_dir) -> Path:
    """A random Llama (4 layers, hidden 64) over the ChatML test tokenizer, its lm_head scaled so its
    next-token choices are peaked like a trained model's; saved as a Hugging Face directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=tok.pad_token_id)
    out = tmp_path_factory.mktemp("fit-target")
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out / f.name)
    return out


def _write_split(folder: Path, rows: list[tuple[list[int], list[int], bool]], files: int) -> None:
    folder.mkdir(parents=True)
    per = -(-len(rows) // files)
    for i in range(files):
        part = rows[i * per : (i + 1) * per]
        table = pa.table(
            {
                "id": [f"r{i}-{j}" for j in range(len(part))],
                "input_ids": pa.array([r[0] for r in part], type=pa.list_(pa.int32())),
                "loss_mask": pa.array([r[1] for r in part], type=pa.list_(pa.int8())),
                "has_reply": pa.array([r[2] for r in part], type=pa.bool_()),
            }
        )
        pq.write_table(table, folder / f"part-{i:03d}.parquet")


@pytest.fixture(scope="session")
def fit_data(tmp_path_factory, fit_target) -> Path:
    """`<data>/train/` (120 replies + 8 input-only rows, 4 files) and `<data>/eval/` (24 replies):
    random prompts, greedy replies written by the target itself."""
    from aerie.engine import Engine, EngineConfig, SamplingParams
    from aerie.target import load_target

    target = load_target(str(fit_target), device="cpu")
    g = torch.Generator().manual_seed(11)
    # prompt ids avoid the special tokens (0..2)
    prompts = torch.randint(3, target.vocab_size, (144, PROMPT_LEN), generator=g).tolist()
    engine = Engine(target, EngineConfig(max_slots=48, max_len=PROMPT_LEN + REPLY_LEN + 8))
    replies = engine.generate(prompts, SamplingParams(max_tokens=REPLY_LEN))
    rows = [
        (p + r.token_ids, [0] * len(p) + [1] * len(r.token_ids), True)
        for p, r in zip(prompts, replies, strict=True)
    ]
    input_only = [(p, [0] * len(p), False) for p in prompts[:8]]
    out = tmp_path_factory.mktemp("fit-data")
    _write_split(out / "train", rows[:120] + input_only, files=4)
    _write_split(out / "eval", rows[120:], files=1)
    write_manifest(out, target.tokenizer, train=128, eval=24)
    return out


def write_manifest(out: Path, tokenizer, **written: int) -> None:
    """An ingest manifest for hand-made data in the split-folders layout: what `aerie train` checks."""
    import json

    from aerie.data.ingest_output import FORMAT, tokenizer_facts

    manifest = {"stage": "ingest", "format": FORMAT, "counts": {"written": written},
                "tokenizer": tokenizer_facts(tokenizer)}
    (out / "manifest.json").write_text(json.dumps(manifest))
