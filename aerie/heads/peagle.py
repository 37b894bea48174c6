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

    def parallel_inputs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        features: torch.Tensor,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append K-1 placeholder slots after the last column of a block of real inputs.

        `input_ids`/`position_ids` [B, r] and `features` [B, r, 3H] are the real tokens (the last
        column is each row's last real position p; rows with fewer real tokens are padded on the
        left by the caller). Returns (ids, positions, features) of width r + K - 1; placeholder j
        sits at position p + j. The K draft logits of a forward on these are `logits[:, -k:]`.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        batch = input_ids.shape[0]
        extra = k - 1
        ids = torch.full((batch, extra), self.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        steps = torch.arange(1, k, device=position_ids.device, dtype=position_ids.dtype)
        pos = position_ids[:, -1:] + steps
        feats = self.mask_hidden.to(features.dtype).expand(batch, extra, -1)
        return (
            torch.cat([input_ids, ids], dim=1),
            torch.cat([position_ids, pos], dim=1),
            torch.cat([features, feats], dim=1),
        )

    def parallel_inputs_last(
        self, last_token: torch.Tensor, last_feature: torch.Tensor, last_position: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`parallel_inputs` for one real token per row: last_token [B], last_feature [B, 3H],
        last_position [B] -> ids/positions [B, K], features [B, K, 3H]."""
        return self.parallel_inputs(last_token[:, None], last_position[:, None], last_feature[:, None], k)
