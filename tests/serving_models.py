"""A small served model for the endpoint tests: a random 4-layer Llama whose next-token choice is
sharpened (so greedy replies are deterministic and a draft head can learn them), saved with the
ChatML test tokenizer as a Hugging Face directory, and an EAGLE-3 head trained on its own greedy
replies to chat prompts in seconds. Built in seconds (the tiny-target build takes minutes
on a busy 2-core box)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.heads.fit import Example, TrainConfig, train_head
from aerie.heads.io import save_head
from aerie.target import load_target

CHAT_PROMPTS = [f"Explain what f{i}(x) returns for x = {i}." for i in range(32)]


def build_served_target(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        model.lm_head.weight[tokenizer.eos_token_id].mul_(0.1)  # replies run to max_tokens
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def train_served_head(target_dir: Path, out: Path, epochs: int = 3) -> Path:
    """An EAGLE-3 head fitted on the target's greedy replies to chat-templated prompts (one torch
    thread: on a shared 2-core box two threads made this 40 s instead of 1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_head(target_dir, out, epochs)
    finally:
        torch.set_num_threads(threads)


def _train_head(target_dir: Path, out: Path, epochs: int) -> Path:
    target = load_target(str(target_dir), device="cpu")
    tokenizer = target.tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for p in CHAT_PROMPTS
    ]
    replies = Engine(target, EngineConfig(max_slots=32, max_len=96)).generate(prompts, SamplingParams(max_tokens=32))
    examples = [
        Example(p + r.token_ids, [False] * len(p) + [True] * len(r.token_ids))
        for p, r in zip(prompts, replies, strict=True)
    ]
    config = TrainConfig(epochs=epochs, batch_size=8, lr=3e-3, eval_depth=3)
    head, _ = train_head(target, "eagle3", examples, config=config, draft_vocab_size=512, progress=False)
    save_head(head, out)
    return out
