"""What every draft head shares: the call signature the engine's proposers use, the frozen copy of
the target's token embedding, RoPE, and the decoder-layer loop.

`forward(input_ids [B, q], position_ids [B, q], *, features=None, hidden=None,
attention_mask=None, cache=None) -> HeadOutput(hidden [B, q, H], logits [B, q, V_draft])`

Exactly one of `features` (target features, through the head's `fc`) or `hidden` (the head's own
previous output `HeadOutput.hidden`, fed back at drafting steps > 0) is given. Row i of the inputs
pairs token t_p at position p with the feature of position p-1 (the target state that produced
t_p); its logits predict the token at p+1. `cache` follows the slot-cache protocol (see `layers.py`);
without one, attention covers the q tokens alone, causally, or as `attention_mask` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aerie.heads.config import HeadConfig
from aerie.heads.layers import DecoderLayer, rope_cos_sin


def check_span(config: HeadConfig, positions: int, where: str) -> None:
    """Refuse to run a head over sequences spanning more than `positions` positions when it has
    sliding-window layers (speculators trains them so): its attention is full, which is the window's
    only while every key is inside it."""
    window = config.sliding_window
    if window is not None and positions > window:
        raise ValueError(
            f"{where} spans up to {positions} positions, but the head's layers {list(config.sliding_layers)} use "
            f"sliding_window={window}, which Aerie's head attention is exactly only up to {window} positions: "
            "use at most that many"
        )


def at_positions(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values [B, q, H] -> values [B, n, H] at each row's `positions` [B, n]."""
    return values.gather(1, positions[..., None].expand(-1, -1, values.shape[-1]))


@dataclass
class HeadOutput:
    hidden: torch.Tensor
    logits: torch.Tensor


class DraftHead(nn.Module):
    method: str = ""
    feature_kind: str = ""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        if config.method != self.method:
            raise ValueError(f"{type(self).__name__} needs method={self.method!r}, config says {config.method!r}")
        self.config = config
        self.eval_metrics: dict[str, float] = {}
        """How the head drafted on held-out data (`fit.evaluate`'s summary), when known."""
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(config.embed_trainable)

    # ---- what the engine sizes the head's own KV cache with ----------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def kv_heads(self) -> int:
        return self.config.kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    # ---- shared pieces -----------------------------------------------------------------------

    def _make_layer(self, fused_input: bool = False, skip_input_norm: bool = False) -> DecoderLayer:
        c = self.config
        return DecoderLayer(
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.kv_heads,
            c.head_dim,
            c.rms_norm_eps,
            fused_input=fused_input,
            skip_input_norm=skip_input_norm,
            attention_bias=c.attention_bias,
            mlp_bias=c.mlp_bias,
            qk_norm=c.layer_type == "qwen3",
            norm_before_residual=c.norm_before_residual,
        )

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return rope_cos_sin(
            position_ids, c.head_dim, c.rope_theta, dtype, c.rope_scaling_items, c.max_position_embeddings
        )

    def check_span(self, positions: int, where: str) -> None:
        check_span(self.config, positions, where)

    @staticmethod
    def _at(h: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor:
        """`h` at the positions `logits_at` (all of them when None): drafting reads the logits of a
        row's last position only, so the vocabulary projection of a catch-up block is spent on that
        position alone."""
        return h if logits_at is None else at_positions(h, logits_at)

    @staticmethod
    def _one_of(features: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        if (features is None) == (hidden is None):
            raise ValueError("give exactly one of `features` (target features) or `hidden` (head output)")

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids."""
        return ids

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors a head file stores (see `io.py`)."""
        return dict(self.state_dict())

    @torch.no_grad()
    def load_target_weights(self, target) -> None:
        """Copy the target's token embedding into the head (frozen unless the method trains it)."""
        weight = target.embed_tokens.weight
        mine = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != mine:
            raise ValueError(f"target embedding is {tuple(weight.shape)}, head expects {mine}")
        self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))
