"""Engine vs transformers `generate`, greedy, on the same prompts, measured side by side.

    python benchmarks/engine_vs_hf.py --target .aerie/targets/tiny-llama

Prints tokens/s at concurrency 1 (engine vs HF generate, one prompt at a time) and the aggregate
tokens/s at concurrency 8 (the engine batching 8 requests vs 8 sequential HF generates), each the
median of interleaved rounds. Absolute numbers mean little on a shared machine; the ratios do.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.target import load_target


def stdlib_prompts(count: int, tokenizer, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of `count` standard-library modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]
    return [tokenizer.encode(f.read_text(errors="replace"), add_special_tokens=False)[:tokens] for f in files]


def hf_generate_seconds(model, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def engine_seconds(target, prompts: list[list[int]], new_tokens: int, slots: int) -> float:
    engine = Engine(target, EngineConfig(max_slots=slots, max_len=max(map(len, prompts)) + new_tokens))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    if slots == 1:
        for prompt in prompts:
            engine.generate([prompt], params)
    else:
        engine.generate(prompts, params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=".aerie/targets/tiny-llama")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    target = load_target(args.target)
    prompts = stdlib_prompts(8, target.tokenizer, args.prompt_tokens)
    tokens_1 = args.new_tokens * 2
    tokens_8 = args.new_tokens * len(prompts)
    engine_seconds(target, prompts[:1], 8, 1)  # warm up both paths
    hf_generate_seconds(target.model, prompts[:1], 8)

    rounds: dict[str, list[float]] = {"hf_c1": [], "engine_c1": [], "hf_c8": [], "engine_c8": []}
    for _ in range(args.rounds):
        rounds["hf_c1"].append(tokens_1 / hf_generate_seconds(target.model, prompts[:2], args.new_tokens))
        rounds["engine_c1"].append(tokens_1 / engine_seconds(target, prompts[:2], args.new_tokens, 1))
        rounds["hf_c8"].append(tokens_8 / hf_generate_seconds(target.model, prompts, args.new_tokens))
        rounds["engine_c8"].append(tokens_8 / engine_seconds(target, prompts, args.new_tokens, 8))
    rate = {name: statistics.median(values) for name, values in rounds.items()}

    print(f"target {args.target}: {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, greedy")
    print(f"concurrency 1: engine {rate['engine_c1']:8.1f} tok/s   HF generate {rate['hf_c1']:8.1f} tok/s"
          f"   ratio {rate['engine_c1'] / rate['hf_c1']:.2f}x (goal >= 1.0x)")
    print(f"concurrency 8: engine {rate['engine_c8']:8.1f} tok/s   8 x HF generate {rate['hf_c8']:8.1f} tok/s"
          f"   ratio {rate['engine_c8'] / rate['hf_c8']:.2f}x (goal >= 4.0x)")


if __name__ == "__main__":
    main()
