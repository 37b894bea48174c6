"""Tiny random-config targets for every supported architecture (no downloads, built in ms), and
draft heads trained on their own greedy replies in seconds."""

from __future__ import annotations

import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.heads.fit import Example, TrainConfig, train_head
from aerie.target import Target

VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=None,
    bos_token_id=None,
)

ARCHITECTURES = ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_next"]
QWEN3_NEXT_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def random_model(arch: str, seed: int = 0, vocab_size: int = VOCAB) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = {**_COMMON, "vocab_size": vocab_size}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    elif arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        )
    elif arch == "gpt_oss":
        config = GptOssConfig(
            **{**common, "intermediate_size": 64},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = GptOssForCausalLM(config)
    elif arch == "qwen3_next":
        # Gated DeltaNet layers around one gated full-attention layer, every layer an MoE block.
        config = Qwen3NextConfig(
            **common,
            head_dim=16,
            layer_types=QWEN3_NEXT_LAYERS,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        )
        model = Qwen3NextForCausalLM(config)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy decoding."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def trained_heads(target: Target, methods: tuple[str, ...], epochs: int = 8) -> dict:
    prompts = random_prompts([8] * 64, seed=5)
    replies = Engine(target, EngineConfig(max_slots=16, max_len=64)).generate(prompts, SamplingParams(max_tokens=40))
    examples = [
        Example(p + r.token_ids, [False] * len(p) + [True] * len(r.token_ids))
        for p, r in zip(prompts, replies, strict=True)
    ]
    config = TrainConfig(epochs=epochs, batch_size=8, lr=3e-3, eval_depth=3)
    return {
        method: train_head(target, method, examples, config=config, draft_vocab_size=256, progress=False)[0]
        for method in methods
    }
