"""A single-process trainer for any draft head, free of Ray.

The frozen target runs on every batch to produce its features and logits (online features); the
head trains on them with its method's objective. Ray Train wraps the same pieces later:
`train_step` (one optimiser step on one batch) and `evaluate` (agreement at depths 1..K) work
from any loop; `fit` is the plain loop with epochs and a tqdm bar.

Data are `Example`s: token ids of a whole conversation and a loss mask that is True on reply
tokens. Batches are right-padded; the target sees a 2-D attention mask.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from aerie.heads import new_head
from aerie.heads.base import DraftHead
from aerie.heads.config import Method
from aerie.heads.losses import (
    HeadBatch,
    LossOutput,
    eagle_loss,
    peagle_loss,
    prepare_batch,
    ttt_loss,
)
from aerie.heads.vocab import build_draft_vocab, token_counts


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[bool]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"input_ids ({len(self.input_ids)}) and loss_mask ({len(self.loss_mask)}) differ")


@dataclass
class TrainConfig:
    epochs: int = 1
    batch_size: int = 8
    max_length: int = 1024  # longer examples are cut (from the right)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    warmup_steps: int | None = None  # overrides warmup_ratio
    min_lr_ratio: float = 0.05
    grad_clip: float = 0.5
    max_steps: int | None = None  # stop early (the cosine schedule still spans max_steps)
    max_seconds: float | None = None  # time budget; the cosine follows it (not deterministic)
    clock: str = "wall"  # what max_seconds counts: "wall" or "cpu" (this process's CPU time)
    cache_target: bool = False  # keep the target's outputs of every batch in memory across epochs
    # "bf16": the head's forward and loss under bf16 autocast (weights, optimiser state and the
    # target's labels stay fp32); where the hardware has bf16 matmuls (CUDA, AVX512-BF16/AMX CPUs)
    # a step costs far less
    precision: str = "fp32"
    # the target's top-1 token's share of the label where the head has seen every token before the
    # one it predicts (EAGLE-3's steps, P-EAGLE's depth 0); the rest is the target's distribution.
    # Its argmax is the target's either way, but a head too small to match the whole distribution
    # spends less of itself on the tail: tiny protocol, tau 4.65 -> 4.82 (EAGLE-3 K=5), P-EAGLE
    # depth 1 0.82 -> 0.86 (benchmarks/PEAGLE.md, "The top-1 token at depth 0 as well")
    top1_weight: float = 0.3
    # EAGLE-3 training-time test (SpecForge / EAGLE-3 unroll 7, speculators 3)
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    # P-EAGLE depth sampling
    peagle_depths: int = 8
    peagle_ratio: float = 0.7
    peagle_ratio_min: float = 0.2
    peagle_top1_weight: float = 0.5  # the top-1 token's share of a blind depth's label
    peagle_depth0_weight: float = 3.0  # a depth-0 element's weight in the loss (a blind depth's: 1)
    # P-EAGLE's forwards per draft (the head's draft_passes): 1 blind one, then refining ones whose
    # placeholders read the drafts before them, which a peagle_fed_ratio share of the anchors trains
    peagle_passes: int = 1
    peagle_fed_ratio: float = 0.0
    # EAGLE (EAGLE-1 weights)
    eagle_steps: int = 1
    feature_weight: float = 1.0
    token_weight: float = 0.1
    # evaluation
    eval_depth: int = 5
    eval_batch_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {self.clock!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.peagle_passes > 1 and self.peagle_fed_ratio <= 0:
            raise ValueError("peagle_passes > 1 needs peagle_fed_ratio > 0: a refining pass reads drafted tokens")


def collate(examples: Sequence[Example], max_length: int | None = None, pad_id: int = 0):
    """(input_ids [B, N], attention_mask [B, N] long, loss_mask [B, N] bool), right-padded, on the
    host (`losses.prepare_batch` moves them to the target's device)."""
    rows = [(e.input_ids[:max_length], e.loss_mask[:max_length]) for e in examples]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device="cpu")
    attn = torch.zeros(len(rows), width, dtype=torch.long, device="cpu")
    loss = torch.zeros(len(rows), width, dtype=torch.bool, device="cpu")
    for b, (row_ids, row_mask) in enumerate(rows):
        ids[b, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long, device="cpu")
        attn[b, : len(row_ids)] = 1
        loss[b, : len(row_mask)] = torch.tensor(row_mask, dtype=torch.bool, device="cpu")
    return ids, attn, loss


def iterate_batches(
    examples: Sequence[Example],
    batch_size: int,
    generator: torch.Generator | None = None,
    bucket: int = 16,
) -> Iterator[list[Example]]:
    """Batches of examples (those shorter than 3 tokens skipped). With a `generator`: shuffled,
    then within windows of `bucket` batches sorted by length (less padding), batches in random
    order. Without: in order."""
    usable = [e for e in examples if len(e.input_ids) >= 3]
    if generator is None:
        for start in range(0, len(usable), batch_size):
            yield usable[start : start + batch_size]
        return
    order = torch.randperm(len(usable), generator=generator, device="cpu").tolist()
    window = batch_size * max(1, bucket)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(usable[i].input_ids))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    for index in torch.randperm(len(batches), generator=generator, device="cpu").tolist():
        yield [usable[i] for i in batches[index]]


def draft_vocab_from_examples(
    examples: Iterable[Example], vocab_size: int, draft_vocab_size: int, always_include: Iterable[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the most frequent reply tokens of the training data."""
    examples = list(examples)
    counts = token_counts([e.input_ids for e in examples], [e.loss_mask for e in examples], vocab_size)
    return build_draft_vocab(counts, draft_vocab_size, always_include)


def make_optimizer(
    head: DraftHead,
    config: TrainConfig,
    total_steps: int,
    time_used: Callable[[], float] | None = None,
):
    """AdamW over the trainable parameters, linear warmup then cosine decay to min_lr_ratio.
    `time_used` (the fraction of a wall-clock budget spent) makes the cosine follow whichever of
    steps and time runs out first."""
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    warmup = config.warmup_steps or max(1, int(round(config.warmup_ratio * total_steps)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if time_used is not None:
            progress = max(progress, min(1.0, time_used()))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def compute_loss(head: DraftHead, hb, config: TrainConfig, generator: torch.Generator | None = None) -> LossOutput:
    """The method's training objective on a prepared batch."""
    if head.method == "eagle3":
        return ttt_loss(head, hb, config.ttt_steps, config.ttt_decay, config.top1_weight)
    if head.method == "peagle":
        return peagle_loss(
            head, hb, config.peagle_depths, config.peagle_ratio, config.peagle_ratio_min, generator,
            config.peagle_top1_weight, config.peagle_depth0_weight, config.top1_weight, config.peagle_fed_ratio,
        )
    if head.method == "eagle":
        return eagle_loss(head, hb, config.eagle_steps, config.ttt_decay, config.feature_weight, config.token_weight)
    raise ValueError(f"unknown head method {head.method!r}")


class Objective(torch.nn.Module):
    """A head's whole training objective as ONE module call, so a data-parallel wrapper
    (DistributedDataParallel under Ray Train) sees one forward per step even though the
    training-time test runs the head several times."""

    def __init__(self, head: DraftHead, config: TrainConfig) -> None:
        super().__init__()
        self.head = head
        self.config = config

    def forward(self, hb, generator: torch.Generator | None = None) -> LossOutput:
        return compute_loss(self.head, hb, self.config, generator)


def unwrap_head(model: torch.nn.Module) -> DraftHead:
    """The DraftHead inside a head, an Objective, or a DDP-wrapped Objective."""
    inner = getattr(model, "module", model)
    return inner.head if isinstance(inner, Objective) else inner


def train_step(
    model: torch.nn.Module,
    target,
    batch: Sequence[Example] | HeadBatch,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    config: TrainConfig | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """One optimiser step on one batch (examples, or a HeadBatch already prepared by
    `prepare_examples`). `model` is a DraftHead, or an `Objective` (possibly wrapped by
    DistributedDataParallel). Returns plain-float metrics (loss, per-depth loss/acc, grad_norm,
    lr, tokens)."""
    config = config or TrainConfig()
    head = unwrap_head(model)
    objective = Objective(head, config) if model is head else model
    objective.train()
    hb = batch if isinstance(batch, HeadBatch) else prepare_examples(target, head, batch, config.max_length)
    with torch.autocast(hb.input_ids.device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
        out = objective(hb, generator)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    params = [p for p in head.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    metrics = {
        "loss": float(out.loss.detach()),
        "grad_norm": float(grad_norm),
        "lr": optimizer.param_groups[0]["lr"],
    }
    metrics["tokens"] = float(hb.loss_mask.sum())
    metrics.update(out.metrics)
    return metrics


def prepare_examples(target, head: DraftHead, batch: Sequence[Example], max_length: int | None = None) -> HeadBatch:
    """Pad a batch and run the frozen target over it (`losses.prepare_batch`)."""
    ids, attn, loss_mask = collate(batch, max_length)
    return prepare_batch(target, head, ids, attn, loss_mask)


def evaluate(
    head: DraftHead,
    target,
    examples: Sequence[Example],
    depth: int = 5,
    batch_size: int = 4,
    max_length: int | None = None,
) -> dict[str, float]:
    """Agreement over a data set: `acc_d`, `chain_d` (per-position acceptance of greedy chain
    verification) for d = 1..depth, `tau` (mean acceptance length at K = depth, bonus counted) and
    `eval_tokens` (`aerie.heads.evaluation.eval_totals`, the job's evaluation, without the loss)."""
    from aerie.heads.evaluation import eval_totals  # it builds on this module

    return eval_totals(unwrap_head(head), target, examples, depth, batch_size, max_length).summary()


@dataclass
class FitResult:
    history: list[dict[str, float]] = field(default_factory=list)
    eval: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def fit(
    head: DraftHead,
    target,
    train: Sequence[Example],
    eval_examples: Sequence[Example] | None = None,
    config: TrainConfig | None = None,
    progress: bool = True,
    callback: Callable[[int, dict[str, float]], None] | None = None,
) -> FitResult:
    """Train `head` for `config.epochs` epochs (or `max_steps` / `max_seconds`), then evaluate on
    `eval_examples`. Deterministic for a given seed (data order and P-EAGLE sampling)."""
    config = config or TrainConfig()
    head.check_span(config.max_length + config.ttt_steps, f"training with max_length {config.max_length}")
    generator = torch.Generator(device="cpu").manual_seed(config.seed)
    usable = sum(1 for e in train if len(e.input_ids) >= 3)
    steps_per_epoch = math.ceil(usable / config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    clock = time.monotonic if config.clock == "wall" else time.process_time
    start, cpu_start = time.monotonic(), time.process_time()
    budget_start = clock()
    time_used = None
    if config.max_seconds:
        budget = config.max_seconds

        def time_used() -> float:
            return (clock() - budget_start) / budget

    optimizer, scheduler = make_optimizer(head, config, total_steps, time_used)
    result = FitResult()
    bar = tqdm(total=total_steps, disable=not progress, desc=f"fit {head.method}")
    step = 0
    done = False
    fixed: list[list[Example]] = []
    prepared: dict[int, HeadBatch] = {}

    def epoch_batches(epoch: int) -> Iterator[list[Example] | HeadBatch]:
        if not config.cache_target:
            yield from iterate_batches(train, config.batch_size, generator)
            return
        if epoch == 0:
            fixed.extend(iterate_batches(train, config.batch_size, generator))
            order = range(len(fixed))
        else:
            order = torch.randperm(len(fixed), generator=generator, device="cpu").tolist()
        for index in order:
            if index not in prepared:
                prepared[index] = prepare_examples(target, head, fixed[index], config.max_length)
            yield prepared[index]

    for epoch in range(config.epochs):
        for batch in epoch_batches(epoch):
            metrics = train_step(head, target, batch, optimizer, scheduler, config, generator)
            step += 1
            metrics["step"] = step
            result.history.append(metrics)
            if callback is not None:
                callback(step, metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc1=f"{metrics.get('acc_1', 0.0):.3f}")
            elapsed = clock() - budget_start
            if step >= total_steps or (config.max_seconds is not None and elapsed >= config.max_seconds):
                done = True
                break
        if done:
            break
    bar.close()
    result.steps = step
    result.seconds = time.monotonic() - start
    result.cpu_seconds = time.process_time() - cpu_start
    if eval_examples:
        result.eval = evaluate(
            head, target, eval_examples, config.eval_depth, config.eval_batch_size, config.max_length
        )
    return result


def train_head(
    target,
    method: Method,
    train: Sequence[Example],
    eval_examples: Sequence[Example] | None = None,
    config: TrainConfig | None = None,
    draft_vocab_size: int = 32000,
    num_layers: int | None = None,
    speculative_tokens: int | None = None,
    progress: bool = True,
    num_heads: int | None = None,
) -> tuple[DraftHead, FitResult]:
    """Build a head for `target` (draft vocabulary from the training replies, stop tokens always
    in it; `num_heads` query heads, default the target's), train it, and return it with the fit
    result."""
    config = config or TrainConfig()
    draft_vocab = None
    if method != "eagle":
        draft_vocab = draft_vocab_from_examples(train, target.vocab_size, draft_vocab_size, target.stop_token_ids)
    k = speculative_tokens or (config.peagle_depths if method == "peagle" else config.ttt_steps)
    head = new_head(
        target, method, draft_vocab=draft_vocab, num_layers=num_layers, speculative_tokens=k, seed=config.seed,
        num_heads=num_heads, draft_passes=config.peagle_passes if method == "peagle" else 1,
    )
    result = fit(head, target, train, eval_examples, config, progress)
    return head, result


def mask_token_from_counts(default: int, counts) -> int:
    """The P-EAGLE placeholder: `default` unless the data use it (`counts`: per-token counts over
    the vocabulary), then the token the data use least (the highest such id)."""
    counts = torch.as_tensor(counts)
    if int(counts[default]) == 0:
        return int(default)
    return int(torch.nonzero(counts == counts.min()).flatten()[-1])
