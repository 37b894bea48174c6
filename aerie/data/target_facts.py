"""What training needs to know about a target without loading its weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aerie import storage

__all__ = ["TargetFacts", "target_facts"]


@dataclass(frozen=True)
class TargetFacts:
    vocab_size: int
    stop_token_ids: list[int]
    mask_token_id: int  # the default P-EAGLE placeholder
    tokenizer: Any


def target_facts(target: str) -> TargetFacts:
    """Vocabulary size, stop tokens, the default P-EAGLE placeholder and the tokenizer of a target
    (local or s3://), from :class:`aerie.target.Target` built on the meta device: config,
    generation config and tokenizer are read, the weights are not."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from aerie.heads.config import default_mask_token_id
    from aerie.target.model import Target

    local = storage.download_model_files(target)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(local))
    try:
        model.generation_config = GenerationConfig.from_pretrained(local)
    except OSError:
        pass
    meta = Target(model, AutoTokenizer.from_pretrained(local))
    return TargetFacts(meta.vocab_size, meta.stop_token_ids, default_mask_token_id(meta), meta.tokenizer)
