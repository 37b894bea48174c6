"""EAGLE speculation on a random-config Qwen3-Next (Gated DeltaNet + gated attention + MoE) against
plain decoding: output tokens/s, acceptance, and what the recurrent-state rollback costs.

    python benchmarks/qwen3_next.py [--out .aerie/bench/qwen3_next] [--concurrency 1,8] [--k 1,3,5]

The target is built in-process (transformers' own `Qwen3NextForCausalLM`, random weights, lm_head
scaled so its choices are peaked), an EAGLE head is trained on its own greedy replies
(`aerie.heads.fit.train_head`), then each arm (plain, then an EAGLE chain of each K) decodes the same
held-out prompts greedily; outputs must equal the plain arm's. Reported per arm: tokens/s, the ratio
to plain, tau, the share of the wall time spent committing linear-attention states (the replay of
rows that rejected drafts), and the per-slot memory of those states. Writes `<out>/qwen3_next.json`
and `<out>/qwen3_next.png`. On CPU the figures include transformers' torch fallback kernels: a verify
block of K + 1 tokens runs the chunked Gated DeltaNet kernel, padded to its chunk of 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

from aerie.engine import EngineConfig, SamplingParams  # noqa: E402
from aerie.engine.build import build_engine  # noqa: E402
from aerie.heads.fit import Example, TrainConfig, train_head  # noqa: E402
from aerie.target import Target  # noqa: E402

VOCAB = 512


def random_qwen3_next(seed: int) -> Qwen3NextForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        eos_token_id=None, bos_token_id=None,
    )
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.generation_config.eos_token_id = None
    return model


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (length,), generator=generator).tolist() for _ in range(count)]


def trained_head(target: Target, seed: int):
    train = prompts(96, 8, seed + 1)
    engine = build_engine(target, EngineConfig(max_slots=32, max_len=64))
    replies = engine.generate(train, SamplingParams(max_tokens=48))
    examples = [
        Example(p + r.token_ids, [False] * len(p) + [True] * len(r.token_ids))
        for p, r in zip(train, replies, strict=True)
    ]
    config = TrainConfig(epochs=8, batch_size=8, lr=3e-3, eval_depth=5, seed=seed)
    head, _ = train_head(target, "eagle", examples, config=config, speculative_tokens=5, progress=True)
    return head


def run_arm(target, head, k, batch, concurrency, max_tokens) -> dict:
    config = EngineConfig(max_slots=concurrency, max_len=max(map(len, batch)) + max_tokens + 8)
    engine = build_engine(target, config, "eagle" if k else "none", head if k else None, k)
    commit = engine.cache.commit_states
    committing = [0.0]

    def timed_commit(starts, kept):
        started = time.perf_counter()
        commit(starts, kept)
        committing[0] += time.perf_counter() - started

    engine.cache.commit_states = timed_commit
    started = time.perf_counter()
    outputs = engine.generate(batch, SamplingParams(max_tokens=max_tokens))
    seconds = time.perf_counter() - started
    return {
        "k": k, "concurrency": concurrency, "seconds": seconds,
        "tokens_per_s": sum(len(o.token_ids) for o in outputs) / seconds,
        "tau": engine.spec.acceptance_length, "commit_share": committing[0] / seconds,
        "state_bytes_per_slot": engine.cache.state_nbytes_per_slot(), "outputs": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".aerie/bench/qwen3_next")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--k", default="1,3,5")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    target = Target(random_qwen3_next(args.seed))
    head = trained_head(target, args.seed)
    batch = prompts(args.requests, 12, args.seed + 2)
    arms = [(c, k) for c in map(int, args.concurrency.split(",")) for k in [0, *map(int, args.k.split(","))]]
    for k in (0, 3):  # warm-up: first calls of every kernel, the fallback warnings
        run_arm(target, head, k, batch[:2], 2, 4)
    results = [run_arm(target, head, k, batch, c, args.max_tokens) for c, k in tqdm(arms, desc="arms")]
    plain = {r["concurrency"]: r for r in results if r["k"] == 0}
    for result in results:
        result["speedup"] = result["tokens_per_s"] / plain[result["concurrency"]]["tokens_per_s"]
        result["lossless"] = result["outputs"] == plain[result["concurrency"]]["outputs"]
    for result in results:
        del result["outputs"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"torch_threads": torch.get_num_threads(), "arms": results}
    (out / "qwen3_next.json").write_text(json.dumps(report, indent=2))
    print(f"{'c':>3} {'K':>2} {'tok/s':>8} {'x plain':>8} {'tau':>5} {'commit':>7} lossless")
    for r in results:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        print(f"{r['concurrency']:>3} {r['k']:>2} {r['tokens_per_s']:>8.1f} {r['speedup']:>8.2f} {tau:>5} "
              f"{r['commit_share']:>7.1%} {r['lossless']}")
    print(f"linear-attention state per slot: {results[0]['state_bytes_per_slot']} bytes")
    figure, axis = plt.subplots(figsize=(6, 4))
    for concurrency in sorted({r["concurrency"] for r in results}):
        rows = [r for r in results if r["concurrency"] == concurrency]
        axis.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o", label=f"concurrency {concurrency}")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("K (0: plain decoding)")
    axis.set_ylabel("output tokens/s / plain")
    axis.set_title("EAGLE chain on a random Qwen3-Next (CPU)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "qwen3_next.png", dpi=120)


if __name__ == "__main__":
    main()
