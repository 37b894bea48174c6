"""Draft heads (EAGLE-3, P-EAGLE, EAGLE), their training objectives, trainer and head files."""

from __future__ import annotations

import torch

from aerie.heads.base import DraftHead, HeadOutput
from aerie.heads.config import HeadConfig, Method
from aerie.heads.eagle import EagleHead
from aerie.heads.eagle3 import Eagle3Head
from aerie.heads.peagle import PEagleHead

HEAD_CLASSES: dict[str, type[DraftHead]] = {"eagle3": Eagle3Head, "peagle": PEagleHead, "eagle": EagleHead}


def build_head(config: HeadConfig) -> DraftHead:
    """An untrained head of the config's method (random weights, placeholder vocabulary)."""
    return HEAD_CLASSES[config.method](config)


def new_head(
    target,
    method: Method,
    *,
    draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_layers: int | None = None,
    mask_token_id: int | None = None,
    speculative_tokens: int = 3,
    seed: int | None = None,
    num_heads: int | None = None,
    draft_passes: int = 1,
) -> DraftHead:
    """A fresh head for `target`: sized from its config, the target's embedding (and, for EAGLE,
    its lm_head) copied in, on the target's device, in float32. `draft_vocab` is (d2t, t2d) from
    `vocab.build_draft_vocab` (EAGLE-3 / P-EAGLE; the EAGLE head always uses the full vocabulary)."""
    draft_size = None if draft_vocab is None else int(draft_vocab[0].numel())
    config = HeadConfig.for_target(
        target,
        method,
        draft_vocab_size=draft_size,
        num_layers=num_layers,
        mask_token_id=mask_token_id,
        speculative_tokens=speculative_tokens,
        num_heads=num_heads,
        draft_passes=draft_passes,
    )
    if seed is not None:
        torch.manual_seed(seed)
    head = build_head(config)
    head.load_target_weights(target)
    if draft_vocab is not None and method != "eagle":
        head.set_vocab(*draft_vocab)
    return head.to(target.device)


__all__ = [
    "DraftHead",
    "Eagle3Head",
    "EagleHead",
    "HeadConfig",
    "HeadOutput",
    "PEagleHead",
    "build_head",
    "new_head",
]
