"""`aerie train --method eagle` on a Qwen3-Next target (linear attention + MoE): the worker takes the
features from the same target forward as the logits, the exported head drafts a lossless chain."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from random_models import random_model, random_prompts
from transformers import AutoTokenizer, GenerationConfig

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.heads.io import load_head
from aerie.target import load_target
from train_jobs.config import load_config
from train_jobs.fit_heads import run_fit


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """The random Qwen3-Next over the ChatML test tokenizer, saved as a Hugging Face directory."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = random_model("qwen3_next", seed=3, vocab_size=len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=tok.pad_token_id)
    out = tmp_path_factory.mktemp("qwen3-next-target")
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out / f.name)
    return out


def test_train_an_eagle_head_on_qwen3_next_and_speculate_with_it(ray_local, qwen3_next_dir, fit_data, tmp_path):
    cfg = load_config(
        data=str(fit_data), target=str(qwen3_next_dir), method="eagle", out=str(tmp_path / "head"),
        storage=str(tmp_path / "runs"), name="qwen3-next", k=3, epochs=1, max_steps=6, batch_size=4, lr=1e-2,
        workers=1, cpus_per_worker=0.5, threads_per_worker=1, eval_every=0, eval_max_examples=8,
        report_every=3, report_min_seconds=0.0, progress=False,
    )
    summary = run_fit(cfg)
    assert summary["steps"] == 6 and math.isfinite(summary["metrics"]["loss"])
    assert 1.0 <= summary["metrics"]["eval_tau"] <= 1.0 + cfg.k

    target = load_target(str(qwen3_next_dir), device="cpu")
    head = load_head(cfg.out, target)
    assert head.method == "eagle" and head.config.speculative_tokens == cfg.k
    config = EngineConfig(max_slots=3, max_len=48, prefill_tokens=8)
    prompts = [[t + 3 for t in p] for p in random_prompts([6, 13, 9, 4], seed=2)]
    params = SamplingParams(max_tokens=12)
    expected = [r.token_ids for r in build_engine(target, config).generate(prompts, params)]
    engine = build_engine(target, config, "eagle", head)
    assert not engine.proposer.drafts_tree
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert engine.spec.drafts > 0
