"""EAGLE-3 draft head.

features [B, q, 3H] (target layers {low, mid, high} fused) -> fc -> g [B, q, H]
layer 0: attention over cat(input_layernorm(embed(token)), hidden_norm(g)) (2H), residual g,
         then post-attention norm + SwiGLU MLP + residual          (vLLM's norm_before_residual=False)
layers 1..: plain Llama layers (EAGLE-3 uses one layer; P-EAGLE several)
hidden = output of the last layer (fed back as `hidden` at the next drafting step)
logits = lm_head(norm(hidden)) over the reduced draft vocabulary; `draft_to_target` maps ids back.

Options of heads trained by vllm-project/speculators (`HeadConfig`, all off for Aerie's own):
`norm_before_fc` (one RMSNorm `input_norm` over the 3H features before fc), `fc_norm` (one RMSNorm
per tapped layer, `fc_norm.i`), `norm_before_residual` (layer 0's residual is hidden_norm(g)),
`norm_output` (hidden = norm(last layer output), so the fed-back state is normalised too), Qwen3
layers (q_norm / k_norm), biases, a scaled RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from aerie.heads.base import DraftHead, HeadOutput
from aerie.heads.config import HeadConfig
from aerie.heads.layers import RMSNorm
from aerie.heads.vocab import target_to_draft_index


class Eagle3Head(DraftHead):
    method = "eagle3"
    feature_kind = "eagle3"

    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        c = config
        self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = nn.ModuleList(
            [RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(3)]
        ) if c.fc_norm else None
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            [self._make_layer(fused_input=True)] + [self._make_layer() for _ in range(c.num_layers - 1)]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d)

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary (`vocab.build_draft_vocab`)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab maps are d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; head expects "
                f"{tuple(self.d2t.shape)}, {tuple(self.t2d.shape)}"
            )
        ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
        if not bool(t2d[ids].all()) or int(t2d.sum()) != d2t.numel():
            raise ValueError("d2t and t2d describe different draft vocabularies")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (-1 for tokens outside the draft vocabulary)."""
        return target_to_draft_index(self.t2d)[ids]

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3H] (or P-EAGLE's `mask_hidden`) -> the head's input state [..., H]."""
        features = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

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
        h = self.project(features) if features is not None else hidden.to(self.fc.weight.dtype)
        embeds = self.embed_tokens(input_ids).to(h.dtype)
        cos, sin = self._rope(position_ids, h.dtype)
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attention_mask, cache, index, embeds=embeds if index == 0 else None)
        if self.config.norm_output:
            h = self.norm(h)
            return HeadOutput(hidden=h, logits=self.lm_head(self._at(h, logits_at)))
        return HeadOutput(hidden=h, logits=self.lm_head(self.norm(self._at(h, logits_at))))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        state = dict(self.state_dict())
        if not self.config.embed_trainable:
            state.pop("embed_tokens.weight")
        return state
