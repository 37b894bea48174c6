"""Tiny random-config targets for head tests (no downloads, no tokenizer)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.target.model import Target

VOCAB = 512


def make_target(hidden: int = 64, layers: int = 4, vocab: int = VOCAB, heads: int = 4, kv_heads: int = 2,
                seed: int = 0) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return Target(LlamaForCausalLM(config).eval())


@pytest.fixture(scope="session")
def target() -> Target:
    return make_target()


@pytest.fixture(scope="session")
def target8() -> Target:
    return make_target(layers=8, seed=1)


def random_batch(batch: int = 3, length: int = 24, vocab: int = VOCAB, seed: int = 0):
    """Right-padded token ids, 0/1 attention mask and a reply loss mask (second half of each row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (batch, length), generator=g)
    lengths = [length - 3 * b for b in range(batch)]
    attn = torch.zeros(batch, length, dtype=torch.long)
    loss = torch.zeros(batch, length, dtype=torch.bool)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
        ids[b, n:] = 0
        loss[b, n // 2 : n] = True
    return ids, attn, loss
