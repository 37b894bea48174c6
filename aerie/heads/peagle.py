"""P-EAGLE draft head: K draft tokens from ONE forward.

The EAGLE-3 front end (fc over the fused 3H features, layer 0 with the 2H attention input) plus
further plain layers. After the last real position p (token t_p with the feature of p-1) come
K-1 placeholder slots at positions p+1 .. p+K-1; each reads the embedding of `mask_token_id` and the
learned feature `mask_hidden` [3H] (through `fc`, like a real feature). All K logits come from one
causal pass. The token embedding is trainable so the placeholder's embedding can be learned.
"""

from __future__ import annotations

import torch
from torch import nn

from aerie.heads.config import HeadConfig
from aerie.heads.eagle3 import Eagle3Head


class PEagleHead(Eagle3Head):
    method = "peagle"
    feature_kind = "eagle3"

    def __init__(self, config: HeadConfig) -> None:
        if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
            raise ValueError(f"P-EAGLE needs a mask_token_id inside the vocabulary, got {config.mask_token_id}")
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.randn(3 * config.target_hidden_size))

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)
