"""The tiny default target: a small Llama (or Qwen3) trained for a few minutes on CPU.

The project needs a target it can build itself, offline, on a laptop: the standard library's
Python source (`aerie.target.corpus`) as text, a byte-level BPE tokenizer trained on it, and an
8-layer model (EAGLE-3 taps layers {1, L/2-1, L-4}, and speculation only pays off when the
target is much deeper than the one-layer draft).

Special tokens and stopping: the tokenizer's ``eos_token`` is ``<|endoftext|>``, the separator
between packed documents, so plain code completion (a prompt with no chat template) can end.
Chats use ChatML and a reply ends with ``<|im_end|>``, so ``generation_config.json`` lists both
as ``eos_token_id`` and generation stops on either. ``pad_token`` is ``<|endoftext|>``; there is
no BOS (training chunks start mid-document, so the model needs none).

Budget: ``minutes`` becomes a fixed number of optimizer steps through ``STEPS_PER_MINUTE``
(measured on a 2-core AMD EPYC, bf16 autocast), so a build depends on its parameters and not on
how busy the machine is. Same parameters on the same machine give a byte-identical
``model.safetensors`` (2 threads, seeded init and data order). Training runs under bf16 autocast
only where the CPU computes bf16 natively (AVX512-BF16 / AMX); elsewhere bf16 is emulated and a
step is ~20x slower than float32, so those CPUs train in float32.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from aerie.target.corpus import Source, completion_chats, corpus_paths, read_sources

VERSION = 2
ARCHS = ("llama", "qwen3")
VOCAB_SIZE = 4096
HIDDEN_SIZE = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SEQ_LEN = 256
BATCH_SIZE = 8  # best tokens/s on 2 cores (4: -7 %, 16: -25 %)
# The budget's unit: 0.26 s per step of 8 x 256 tokens in the sweep that chose these settings. A
# whole default build (1,100 steps) measured 0.43 s per step (4,810 tok/s) on an idle 2-core EPYC:
# `--minutes 5` takes about 8 minutes there, tokenizer and evaluation included.
STEPS_PER_MINUTE = 220
LR = 2e-3  # 1e-3..3e-3 within 0.02 nats at 300 steps; 2000 x 4 at 3e-3 was 0.1 bits/byte worse
MIN_LR_RATIO = 0.1
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
THREADS = 2
CHATS = 512  # "complete this function" chats mixed into the documents, so the model knows ChatML
EVAL_CHUNKS = 64
SAMPLE_PROMPT = "def"  # not "def ": a trailing space is a token the text never has before a name
SAMPLE_TOKENS = 60

OUTPUT_FILES = frozenset(
    {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
        "build.json",
    }
)


# GPT-4 style pre-tokenization: a line break never merges with the indentation after it, so a
# prompt that ends in "\n" (a chat generation prompt, a signature line) is cut at the same token
# boundary as the training text (GPT-2's regex would have made "\n    " one token).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text round-trips) with the ChatML special tokens at ids 0, 1, 2.
    Training is deterministic for the same texts."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def model_config(arch: str, tokenizer: PreTrainedTokenizerFast, hidden_size: int = HIDDEN_SIZE) -> PretrainedConfig:
    """8 layers, heads of 32 dims (hidden / 32 query heads, half as many key-value heads), MLP 3 x
    hidden, untied embeddings; hidden 256 by default."""
    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64, got {hidden_size}")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=8,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=hidden_size // 64,
        head_dim=32,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(**common)
    raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")


def build_tiny_target(
    out: Path,
    arch: str = "llama",
    minutes: float = 5.0,
    seed: int = 0,
    steps: int | None = None,
    *,
    max_files: int | None = None,
    corpus: list[str | Path] | None = None,
    hidden_size: int = HIDDEN_SIZE,
    vocab_size: int = VOCAB_SIZE,
) -> Path:
    """Build (or find cached) the tiny target in ``out``; returns ``out``.

    ``steps`` overrides ``minutes``; ``max_files`` caps the corpus (tests). ``corpus`` are folders of
    Python source to train on instead of the standard library (e.g. installed packages: a target
    built on other code than the traffic it will serve). A complete build with the same parameters
    is reused; anything else in ``out`` (a partial or different build) is replaced, through a
    temporary directory renamed into place at the end.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    out = Path(out)
    steps = steps if steps is not None else max(1, round(minutes * STEPS_PER_MINUTE))
    train_paths, heldout_paths = corpus_paths(max_files, corpus)
    params = {
        "version": VERSION,
        "arch": arch,
        "steps": steps,
        "seed": seed,
        "vocab_size": vocab_size,
        "seq_len": SEQ_LEN,
        "batch_size": BATCH_SIZE,
        "lr": LR,
        "max_files": max_files,
        "corpus_files": {"train": len(train_paths), "heldout": len(heldout_paths)},
    }
    if corpus is not None:
        params["corpus"] = [Path(c).name for c in corpus]
    if hidden_size != HIDDEN_SIZE:
        params["hidden_size"] = hidden_size
    if _cached(out, params):
        print(f"tiny-target: cached at {out}", file=sys.stderr)
        return out
    if out.exists() and not set(p.name for p in out.iterdir()) <= OUTPUT_FILES:
        raise FileExistsError(f"{out} holds files that are not a tiny-target build; not replacing it")

    _remove_orphans(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir(parents=True)
    try:
        train_src, heldout_src = read_sources(train_paths, corpus), read_sources(heldout_paths, corpus)
        results = _build(tmp, arch, steps, seed, train_src, heldout_src, hidden_size, vocab_size)
        (tmp / "build.json").write_text(json.dumps({"params": params, "results": results}, indent=2) + "\n")
        if _cached(out, params):  # a concurrent build of the same parameters finished first
            shutil.rmtree(tmp)
            return out
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _remove_orphans(out: Path) -> None:
    """Delete temporary dirs left by killed builds (their process is gone); a running build's stays."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            os.kill(int(tmp.name.rsplit("-", 2)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def _cached(out: Path, params: dict) -> bool:
    try:
        return json.loads((out / "build.json").read_text())["params"] == params
    except (OSError, ValueError, KeyError):
        return False


def _build(
    out: Path,
    arch: str,
    steps: int,
    seed: int,
    train_src: list[Source],
    heldout_src: list[Source],
    hidden_size: int,
    vocab_size: int,
) -> dict:
    """Tokenizer, data, init, training, evaluation, samples; writes the HF files into ``out``."""
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tokenizer = train_tokenizer([s.text for s in train_src], vocab_size)
            chats = [tokenizer.apply_chat_template(c, tokenize=False) for c in completion_chats(train_src, CHATS)]
            gen = torch.Generator().manual_seed(seed)
            docs = [s.text for s in train_src] + chats
            order = torch.randperm(len(docs), generator=gen).tolist()
            train = _chunks(tokenizer, [docs[i] for i in order])
            heldout = _chunks(tokenizer, [s.text for s in heldout_src])

            model = AutoModelForCausalLM.from_config(
                model_config(arch, tokenizer, hidden_size), attn_implementation="sdpa"
            )
            eot, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
            model.generation_config = GenerationConfig(eos_token_id=[eot, im_end], pad_token_id=eot)
            train_seconds = _train(model, train, steps, gen)
            model.eval()
            seen = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:EVAL_CHUNKS]]
            results = {
                "heldout_loss": round(_mean_loss(model, heldout[:EVAL_CHUNKS]), 4),
                "train_loss": round(_mean_loss(model, seen), 4),
                "tokens_per_s": round(steps * BATCH_SIZE * SEQ_LEN / train_seconds, 1),
                "precision": "bf16 autocast" if cpu_has_native_bf16() else "float32",
                "train_seconds": round(train_seconds, 1),
                "vocab": len(tokenizer),
                "parameters": model.num_parameters(),
                "train_tokens": train.numel(),
                "samples": _samples(model, tokenizer, seed),
            }
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    finally:
        torch.set_num_threads(threads)
    results["seconds"] = round(time.perf_counter() - started, 1)
    return results


def _chunks(tokenizer: PreTrainedTokenizerFast, docs: list[str]) -> torch.Tensor:
    """Documents joined with ``<|endoftext|>``, cut into ``[n, SEQ_LEN]`` (one shorter row if
    there is less than one chunk: tiny test corpora)."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids
        ids.append(eot)
    if len(ids) < SEQ_LEN:
        return torch.tensor([ids])
    n = len(ids) // SEQ_LEN
    return torch.tensor(ids[: n * SEQ_LEN]).view(n, SEQ_LEN)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (oneDNN's own test)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _train(model: PreTrainedModel, chunks: torch.Tensor, steps: int, gen: torch.Generator) -> float:
    """AdamW, linear warmup then cosine decay to ``MIN_LR_RATIO``; chunks in a fresh random
    order each epoch. Returns the seconds spent."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        fused=True,
    )
    warmup = max(1, round(steps * WARMUP_FRACTION))

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    native_bf16 = cpu_has_native_bf16()
    order = torch.empty(0, dtype=torch.long)
    model.train()
    started = time.perf_counter()
    with tqdm(range(steps), desc="tiny-target", unit="step", file=sys.stderr) as bar:
        for _ in bar:
            if len(order) < BATCH_SIZE:
                order = torch.cat([order, torch.randperm(len(chunks), generator=gen)])
            batch, order = chunks[order[:BATCH_SIZE]], order[BATCH_SIZE:]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return time.perf_counter() - started


@torch.no_grad()
def _mean_loss(model: PreTrainedModel, chunks: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) in float32, as the model is served."""
    losses = [model(input_ids=b, labels=b).loss.item() * len(b) for b in chunks.split(BATCH_SIZE)]
    return sum(losses) / len(chunks)


@torch.no_grad()
def _samples(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, seed: int) -> dict[str, str]:
    """A greedy and a sampled (temperature 0.8, top-p 0.95) continuation of ``SAMPLE_PROMPT``."""
    ids = tokenizer(SAMPLE_PROMPT, return_tensors="pt").input_ids
    torch.manual_seed(seed)
    greedy = model.generate(ids, max_new_tokens=SAMPLE_TOKENS, do_sample=False)
    sampled = model.generate(ids, max_new_tokens=SAMPLE_TOKENS, do_sample=True, temperature=0.8, top_p=0.95)
    return {"prompt": SAMPLE_PROMPT, "greedy": tokenizer.decode(greedy[0]), "sampled": tokenizer.decode(sampled[0])}
