"""Llama-style building blocks for draft heads, in plain PyTorch.

Parameter names follow the Hugging Face / vLLM Llama layout (`self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, ...) so a head's state dict is what vLLM's EAGLE loaders read.

Attention takes an optional `cache` with the slot-cache protocol of `aerie.engine.cache.SlotKVCache`:
`update(key_states [B, kv_heads, q, D], value_states, layer_idx) -> (keys [B, kv_heads, kv, D], values)`.
Keys are stored after RoPE. The mask is boolean, `[B, 1, q, kv]`, True = attend. A cache whose
`segments` are set (`aerie.target.segmented_attention.Run`) has each run of rows read only its own
columns of its own key rows (the keys `update` returned may then be the whole slot pool's).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One fused kernel (a drafting step runs several norms: their op count is its cost)."""
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose frequencies do not depend on the sequence length (a head can run them exactly)."""

RopeScaling = tuple[tuple[str, object], ...]
"""A non-default `rope_parameters` dict (Hugging Face's, `rope_theta` left out) as sorted items."""


@lru_cache(maxsize=8)
def _inv_freq(
    head_dim: int, theta: float, device: torch.device, scaling: RopeScaling = (), max_positions: int = 4096
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], factor on cos and sin). The default RoPE here; a scaled
    one (`scaling`: llama3, linear, yarn) through transformers' own init function, as a Hugging
    Face or speculators model computes it."""
    with torch.inference_mode(False):  # a cached inference tensor would be off limits to training
        if not scaling:
            return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)), 1.0
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = {**dict(scaling), "rope_theta": theta}
        config = LlamaConfig(
            hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, rope_parameters=params,
            max_position_embeddings=max_positions,
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, device)
        return inv_freq.to(device=device, dtype=torch.float32), float(factor)


def rope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: RopeScaling = (),
    max_positions: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for `position_ids` [B, q]: cos, sin of shape [B, q, head_dim] (the
    half-rotation layout Llama uses in Hugging Face and vLLM's neox style). `max_positions` is the
    model's `max_position_embeddings`, which only scaled variants (yarn) read."""
    inv_freq, factor = _inv_freq(head_dim, theta, position_ids.device, scaling, max_positions)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    if factor != 1.0:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, q, D]; cos/sin [B, q, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def causal_mask(q: int, kv: int, device: torch.device) -> torch.Tensor:
    """[q, kv] bool: the q new tokens are the last q of kv keys; each sees keys up to itself."""
    rows = torch.arange(q, device=device)[:, None] + (kv - q)
    return torch.arange(kv, device=device)[None, :] <= rows


class Attention(nn.Module):
    """GQA attention. `bias`: on q, k, v and o (Hugging Face's `attention_bias`). `qk_norm`: an
    RMSNorm over each head's query and key before RoPE (Qwen3's `q_norm` / `k_norm`)."""

    def __init__(
        self,
        in_dim: int,
        hidden_size: int,
        num_heads: int,
        kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm: nn.Module = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache,
        layer_idx: int,
    ) -> torch.Tensor:
        batch, q, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(batch, q, self.num_heads, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(x).view(batch, q, self.kv_heads, self.head_dim)).transpose(1, 2)
        value = self.v_proj(x).view(batch, q, self.kv_heads, self.head_dim).transpose(1, 2)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, layer_idx)
        kv = key.shape[2]
        if attention_mask is None:
            mask = causal_mask(q, kv, x.device)[None, None]
        else:
            mask = attention_mask
            if mask.shape[-2:] != (q, kv):
                raise ValueError(f"attention_mask is {tuple(mask.shape)}, expected [B, 1, {q}, {kv}]")
            # A query that sees nothing (padding) would give NaN; let it see everything instead.
            mask = mask | ~mask.any(dim=-1, keepdim=True)
        key, value = key.to(query.dtype), value.to(query.dtype)
        gqa = self.kv_heads != self.num_heads
        segments = getattr(cache, "segments", None) if mask.shape[0] == batch else None
        if segments:  # runs of rows, each reading its own columns of its own key rows (the slot cache's)
            out = torch.cat([
                F.scaled_dot_product_attention(
                    query[a:b], key[s : s + b - a, :, :n], value[s : s + b - a, :, :n],
                    attn_mask=mask[a:b, :, :, :n], enable_gqa=gqa,
                )
                for a, b, n, s in segments
            ])
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer. Three flavours:

    - `fused_input=True` (EAGLE-3 / P-EAGLE layer 0): attention reads
      `cat(input_layernorm(embedding), hidden_norm(hidden))` (2H wide); the residual is `hidden`,
      or `hidden_norm(hidden)` with `norm_before_residual` (vLLM's and speculators' option).
    - `skip_input_norm=True` (EAGLE-1 layer 0): no input norm (the fc output goes straight in).
    - otherwise a plain pre-norm layer.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        fused_input: bool = False,
        skip_input_norm: bool = False,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        qk_norm: bool = False,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        self.fused_input = fused_input
        self.norm_before_residual = norm_before_residual and fused_input
        in_dim = 2 * hidden_size if fused_input else hidden_size
        self.input_layernorm: nn.Module = nn.Identity() if skip_input_norm else RMSNorm(hidden_size, eps)
        if fused_input:
            self.hidden_norm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(
            in_dim, hidden_size, num_heads, kv_heads, head_dim, bias=attention_bias, qk_norm=qk_norm, eps=eps
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size, bias=mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache,
        layer_idx: int,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = hidden
        if self.fused_input:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            x = self.input_layernorm(hidden)
        hidden = residual + self.self_attn(x, cos, sin, attention_mask, cache, layer_idx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class ListCache:
    """The simplest object with the slot-cache protocol: per layer, new keys/values are appended
    along the sequence and the whole history is returned. Used for training-time test (each unrolled
    step appends one block) and in tests as a reference cache."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_: object):
        self.keys[layer_idx].append(key_states)
        self.values[layer_idx].append(value_states)
        return torch.cat(self.keys[layer_idx], dim=2), torch.cat(self.values[layer_idx], dim=2)

    def __len__(self) -> int:
        return sum(k.shape[2] for k in self.keys[0])
