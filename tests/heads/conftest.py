"""Tiny random-config targets for head tests (no downloads, no tokenizer)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.target.model import Target

VOCAB = 512


def make_target(
    hidden: int = 64,
    layers: int = 4,
    vocab: int = VOCAB,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    sharpen: float = 1.0,
) -> Target:
    """A random LlamaForCausalLM; `sharpen` scales its lm_head so its next-token distributions are
    peaked like a trained model's (a random one is nearly uniform: nothing for a head to learn)."""
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
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return Target(model)


@pytest.fixture(scope="session")
def target() -> Target:
    return make_target()


@pytest.fixture(scope="session")
def sharp_target() -> Target:
    return make_target(seed=2, sharpen=40.0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread is fastest, and the box is shared."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


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
