"""The engine on an accelerator: every method, greedy equality with `generate`, a sampled tree, tok/s.

    python benchmarks/cuda_check.py                       # on a GPU machine: cuda, bf16 and fp32
    python benchmarks/cuda_check.py --device cpu --dtypes fp32 --prompts 4 --max-tokens 16

For each dtype it loads the target (`--target`, default the tiny target) and the heads (`--head
METHOD=DIR`, repeatable; without any, untrained heads of every method are made on the spot:
their drafts are rarely accepted, but every code path runs), then for every method (plain,
n-gram, EAGLE-3 chain and tree, P-EAGLE, EAGLE-2 tree) generates greedily with 4 slots and
compares the tokens with Hugging Face `generate` (greedy, the same dtype). In fp32 they must be
equal. In bf16 two numerically different but equally correct computations may pick different
tokens where the target's top two logits nearly tie, so each mismatch is reported with the top-2
logit gap at the first differing position: a gap within bf16's noise is a tie, a large gap a bug.
Then one sampled run of the EAGLE-3 tree (temperature 0.8), and tokens/s per method at
concurrency 1 and 4. Exit status 1 when an fp32 mismatch or a large-gap bf16 mismatch is found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.heads import new_head
from aerie.heads.io import load_head
from aerie.target import load_target
from aerie.traffic import synthesize

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VARIANTS = [  # (method, K, tree)
    ("none", 0, False),
    ("ngram", 4, False),
    ("eagle3", 3, False),
    ("eagle3", 4, True),
    ("peagle", 5, False),
    ("eagle", 4, True),
]
TIE_GAP = {"bf16": 0.25, "fp32": 0.0}  # logit gaps up to this are near-ties in that dtype


def make_heads(target, specs: list[str]) -> dict:
    if specs:
        return {m: load_head(d, target) for m, _, d in (s.partition("=") for s in specs)}
    return {m: new_head(target, m, seed=0).to(target.dtype).eval() for m in ("eagle3", "peagle", "eagle")}


@torch.no_grad()
def hf_greedy(target, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def top2_gap(target, prefix: list[int]) -> float:
    """Target's top-1 minus top-2 logit for the token after `prefix`."""
    logits = target.model(torch.tensor([prefix], device=target.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def divergence(target, prompt: list[int], got: list[int], want: list[int]) -> dict | None:
    """None when `got` is `want`; else the position where it first leaves it, and the target's top-2
    logit gap there (a near-tie, or a bug)."""
    if got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return {"position": at, "top2_gap": top2_gap(target, prompt + want[:at])}


def run(engine, prompts, params) -> tuple[list[list[int]], float]:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = [c.token_ids for c in engine.generate(prompts, params)]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, sum(map(len, outputs)) / (time.perf_counter() - start)


def check_dtype(args, dtype_name: str, prompts: list[list[int]]) -> tuple[list[dict], bool]:
    target = load_target(args.target, device=args.device, dtype=DTYPES[dtype_name])
    heads = make_heads(target, args.head)
    reference = [hf_greedy(target, p, args.max_tokens) for p in prompts]
    greedy = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows, ok = [], True
    for method, k, tree in VARIANTS:
        if method not in ("none", "ngram") and method not in heads:
            continue
        label = f"{method}{' tree' if tree else ''} K={k}"
        config = EngineConfig(max_slots=4, max_len=max(map(len, prompts)) + args.max_tokens + 8)
        engine = build_engine(target, config, method, heads.get(method), k, tree=tree)
        run(engine, prompts[:1], greedy)  # warm-up (kernels, allocator)
        outputs, batched_rate = run(engine, prompts, greedy)
        single = [run(engine, [p], greedy)[1] for p in prompts[: args.single]]
        mismatches = [d for d in map(partial(divergence, target), prompts, outputs, reference) if d is not None]
        bugs = [m for m in mismatches if m["top2_gap"] > TIE_GAP[dtype_name]]
        ok &= not bugs
        rows.append({
            "dtype": dtype_name, "variant": label, "tok_s_c1": sum(single) / max(1, len(single)),
            "tok_s_c4": batched_rate, "tau": engine.spec.acceptance_length, "mismatches": mismatches,
            "suspect": len(bugs),
        })
        gaps = " ".join(f"{m['top2_gap']:.3f}@{m['position']}" for m in mismatches) or "-"
        print(f"{dtype_name:5} {label:16} c1 {rows[-1]['tok_s_c1']:7.1f} tok/s  c4 {batched_rate:7.1f} tok/s  "
              f"tau {engine.spec.acceptance_length or 1.0:4.2f}  "
              f"equal {len(prompts) - len(mismatches)}/{len(prompts)}  "
              f"gaps {gaps}{'  SUSPECT' if bugs else ''}", flush=True)
    if "eagle3" in heads:
        engine = build_engine(target, EngineConfig(max_slots=4, max_len=512), "eagle3", heads["eagle3"], 4, tree=True)
        sampled = [SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i) for i in range(len(prompts))]
        outputs, rate = run(engine, prompts, sampled)
        print(f"{dtype_name:5} eagle3 tree sampled T=0.8: {sum(map(len, outputs))} tokens, {rate:.1f} tok/s, "
              f"tau {engine.spec.acceptance_length or 1.0:.2f}", flush=True)
        rows.append({"dtype": dtype_name, "variant": "eagle3 tree sampled", "tok_s_c4": rate,
                     "tau": engine.spec.acceptance_length})
    return rows, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=".aerie/targets/tiny-llama")
    parser.add_argument("--head", action="append", default=[], help="METHOD=DIR (repeatable)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--single", type=int, default=2, help="prompts also timed alone (concurrency 1)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --device cpu")
    tokenizer_target = load_target(args.target, device="cpu")
    exchanges = synthesize(args.prompts, seed=5, tokenizer=tokenizer_target.tokenizer, max_tokens=512)
    prompts = [tokenizer_target.tokenizer.encode(e.prompt, add_special_tokens=False)[-200:] for e in exchanges]
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}), "
          f"target {args.target}, {len(prompts)} prompts x {args.max_tokens} tokens", flush=True)
    rows, ok = [], True
    for dtype_name in args.dtypes.split(","):
        dtype_rows, dtype_ok = check_dtype(args, dtype_name, prompts)
        rows += dtype_rows
        ok &= dtype_ok
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    print("OK" if ok else "MISMATCHES beyond near-ties: see SUSPECT rows")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
