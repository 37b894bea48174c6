"""Device discipline, checked on a CPU-only machine.

1. Every tensor the engine, the proposers and the training losses make is made on an explicit
   device: they run with the default device set to "meta", so a factory call without a device
   makes a meta tensor, and mixing it with the target's real tensors fails (as a CPU tensor next
   to CUDA tensors would on a GPU).
2. A decoding step of a chain method reads the device back once (`.item()`, `.tolist()`,
   `.cpu()`, `bool(tensor)`, ...), whatever the batch size: each is a host sync on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from random_models import random_prompts
from torch.overrides import TorchFunctionMode

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.heads.fit import Example, TrainConfig, compute_loss, evaluate, prepare_examples

VARIANTS = [("none", False), ("ngram", False), ("eagle3", False), ("peagle", False), ("eagle", True), ("eagle3", True)]
CONFIG = EngineConfig(max_slots=3, max_len=96, prefill_tokens=16)


@pytest.fixture(scope="module")
def prompts():
    prompts = random_prompts([7, 19, 4, 12], seed=3)
    return [p + p[:6] for p in prompts]  # repeats give prompt lookup something to find


@pytest.fixture(scope="module")
def baseline(llama_with_heads, prompts):
    target, _ = llama_with_heads
    return [r.token_ids for r in build_engine(target, CONFIG).generate(prompts, SamplingParams(max_tokens=12))]


@pytest.mark.parametrize(("method", "tree"), VARIANTS)
def test_every_method_makes_its_tensors_on_the_target_device(llama_with_heads, prompts, baseline, method, tree):
    target, heads = llama_with_heads
    engine = build_engine(target, CONFIG, method, heads.get(method), 3, tree=tree)
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i) for i in range(len(prompts))]
    with torch.device("meta"):
        greedy = engine.generate(prompts, SamplingParams(max_tokens=12))
        engine.generate(prompts, sampled)
    assert [r.token_ids for r in greedy] == baseline


@pytest.mark.parametrize("method", ["eagle3", "peagle", "eagle"])
def test_training_losses_make_their_tensors_on_the_head_device(llama_with_heads, method):
    target, heads = llama_with_heads
    head = heads[method]
    examples = [Example(list(range(1, 20)), [False] * 8 + [True] * 11), Example(list(range(5, 17)), [True] * 12)]
    with torch.device("meta"):
        batch = prepare_examples(target, head, examples)
        out = compute_loss(head, batch, TrainConfig(), torch.Generator(device="cpu").manual_seed(0))
        out.loss.backward()
        metrics = evaluate(head, target, examples, depth=3)
    head.zero_grad(set_to_none=True)
    assert out.loss.device == target.device and metrics["eval_tokens"] > 0


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value back to the host."""

    READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["none", "ngram", "eagle3", "peagle"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_chain_decoding_step_reads_the_device_back_once(llama_with_heads, method, temperature):
    target, heads = llama_with_heads
    prompts = [p + p[:6] for p in random_prompts([9, 5, 14, 7, 11, 6], seed=4)]
    for batch in (1, 6):
        engine = build_engine(target, EngineConfig(max_slots=batch, max_len=96), method, heads.get(method), 3)
        reads_per_step = []
        decode = engine._decode

        def counted(rows, decode=decode, reads_per_step=reads_per_step):
            with HostReads() as reads:
                outputs = decode(rows)
            reads_per_step.append(reads.count)
            return outputs

        engine._decode = counted
        params = [SamplingParams(max_tokens=16, temperature=temperature, seed=i) for i in range(len(prompts))]
        engine.generate(prompts, params)
        assert reads_per_step and max(reads_per_step) == 1, (method, batch, reads_per_step)
