"""Evaluation of a draft head on held-out examples: agreement at depths 1..K, and the loss.

One implementation for every caller: :func:`aerie.heads.fit.evaluate` (the single-process trainer,
agreement only) and the data-parallel job, where each worker calls :func:`eval_totals` on its share
of the examples with its training settings (so the loss is counted too); the totals are plain sums
(:meth:`EvalTotals.vector` for one all-reduce), and :meth:`EvalTotals.metrics` turns the summed
totals into ``eval_loss``, ``eval_acc_d``, ``eval_chain_d``, ``eval_tau``, ``eval_walk_chain_d``,
``eval_walk_tau`` (the engine's own anchors, `Agreement`) and ``eval_tokens``
(:meth:`EvalTotals.summary`: the same without prefix and loss, as head files keep it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aerie.heads.base import DraftHead
from aerie.heads.fit import Example, TrainConfig, collate, compute_loss, iterate_batches
from aerie.heads.losses import Agreement, agreement, prepare_batch

__all__ = ["EvalTotals", "eval_totals"]

EVAL_SEED_OFFSET = 12345  # P-EAGLE's depth sampling uses the same generator state at every eval


@dataclass
class EvalTotals:
    """Token-weighted loss sum, token count and agreement counts per depth: add to merge."""

    loss_sum: float
    tokens: float
    agreement: Agreement

    def vector(self, depth: int) -> list[float]:
        a = self.agreement
        pad = [0.0] * depth
        return [
            self.loss_sum, self.tokens, *(a.correct or pad), *(a.chain or pad), *(a.count or pad),
            *(a.visited or pad), a.visits,
        ]

    @classmethod
    def from_vector(cls, values: Sequence[float], depth: int) -> EvalTotals:
        values = list(values)
        per_depth = [values[2 + i * depth : 2 + (i + 1) * depth] for i in range(4)]
        return cls(values[0], values[1], Agreement(*per_depth, visits=values[2 + 4 * depth]))

    def summary(self) -> dict[str, float]:
        """``acc_d``, ``chain_d``, ``tau`` and ``eval_tokens`` (reply positions counted at depth 1):
        what :func:`aerie.heads.fit.evaluate` returns and a head file keeps (``eval_metrics``)."""
        return {**self.agreement.summary(), "eval_tokens": self.agreement.count[0] if self.agreement.count else 0.0}

    def metrics(self) -> dict[str, float]:
        """The summary as the training job reports it (``eval_`` prefixed), with ``eval_loss``."""
        out = {k if k.startswith("eval_") else f"eval_{k}": v for k, v in self.summary().items()}
        out["eval_loss"] = self.loss_sum / self.tokens if self.tokens else float("nan")
        return out


@torch.no_grad()
def eval_totals(
    head: DraftHead,
    target,
    examples: Sequence[Example],
    depth: int,
    batch_size: int,
    max_length: int | None = None,
    loss_config: TrainConfig | None = None,
) -> EvalTotals:
    """Agreement at depths 1..``depth`` of ``head`` over ``examples`` (in order, ``batch_size`` at a
    time, cut at ``max_length``), drafted the way the engine drafts (a chain for EAGLE-3 / EAGLE,
    one forward for P-EAGLE); with ``loss_config`` also the method's training objective under those
    settings (its loss sum and token count stay 0 without). The head's train/eval mode is restored."""
    was_training = head.training
    head.eval()
    total = Agreement(*([0.0] * depth for _ in range(4)))
    loss_sum = tokens = 0.0
    generator = None
    if loss_config is not None:
        generator = torch.Generator(device="cpu").manual_seed(loss_config.seed + EVAL_SEED_OFFSET)
    for batch in iterate_batches(examples, batch_size):
        ids, attn, loss_mask = collate(batch, max_length)
        hb = prepare_batch(target, head, ids, attn, loss_mask)
        if loss_config is not None:
            n = float(hb.loss_mask.sum())
            loss_sum += float(compute_loss(head, hb, loss_config, generator).loss) * n
            tokens += n
        total = total.merge(agreement(head, hb, depth))
    head.train(was_training)
    return EvalTotals(loss_sum, tokens, total)
