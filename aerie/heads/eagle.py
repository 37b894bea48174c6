"""EAGLE (EAGLE-1 / EAGLE-2) draft head: for targets EAGLE-3 does not cover.

Feature = the target's LAST hidden state (after its final norm: what its lm_head reads).
  x = fc(cat(embed(token), feature))     2H -> H (embedding first, as EAGLE and vLLM's loader)
  one Llama decoder layer without input norm (as EAGLE's layer 0)
  hidden = the predicted feature of the next position; logits = the TARGET's lm_head(hidden).
At drafting steps > 0 the predicted feature stands in for the target's: `hidden` takes the same
path as `features` (fc with the token embedding). The draft vocabulary is the target's.
The lm_head is a frozen copy of the target's; head files never store it (loading copies it).
"""

from __future__ import annotations

import torch
from torch import nn

from aerie.heads.base import DraftHead, HeadOutput
from aerie.heads.config import HeadConfig


class EagleHead(DraftHead):
    method = "eagle"
    feature_kind = "last"

    def __init__(self, config: HeadConfig) -> None:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError("an EAGLE head drafts over the target's whole vocabulary")
        super().__init__(config)
        c = config
        self.fc = nn.Linear(c.hidden_size + c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            [self._make_layer(skip_input_norm=True)] + [self._make_layer() for _ in range(c.num_layers - 1)]
        )
        self.lm_head = nn.Linear(c.target_hidden_size, c.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        features: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        logits_at: torch.Tensor | None = None,
    ) -> HeadOutput:
        self._one_of(features, hidden)
        feature = (features if features is not None else hidden).to(self.fc.weight.dtype)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        h = self.fc(torch.cat([embeds, feature], dim=-1))
        cos, sin = self._rope(position_ids, h.dtype)
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attention_mask, cache, index)
        return HeadOutput(hidden=h, logits=self.lm_head(self._at(h, logits_at)))

    @torch.no_grad()
    def load_target_weights(self, target) -> None:
        super().load_target_weights(target)
        weight = target.lm_head.weight
        if tuple(weight.shape) != tuple(self.lm_head.weight.shape):
            raise ValueError(
                f"target lm_head is {tuple(weight.shape)}, head expects {tuple(self.lm_head.weight.shape)}"
            )
        self.lm_head.weight.copy_(weight.to(self.lm_head.weight.dtype))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        state = dict(self.state_dict())
        state.pop("lm_head.weight")
        if not self.config.embed_trainable:
            state.pop("embed_tokens.weight")
        return state
