"""`HeadConfig`: everything needed to rebuild a draft head and check it against a target."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Method = Literal["eagle3", "peagle", "eagle"]

DEFAULT_LAYERS = {"eagle3": 1, "peagle": 2, "eagle": 1}


class HeadConfig(BaseModel):
    """Shape of a draft head and the target it was built for. Saved in `config.json` under the
    key `aerie_head_config` (next to the speculators fields, see `io.py`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Method
    # the head's decoder (same widths as the target, as EAGLE heads use)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # vocabularies
    vocab_size: int = Field(description="target vocabulary size (embedding rows)")
    draft_vocab_size: int
    # the target it was trained against
    target_hidden_size: int
    target_num_layers: int
    tap_layers: tuple[int, ...] = Field(
        default=(), description="target decoder layers whose outputs are fused (EAGLE-3 / P-EAGLE)"
    )
    target_architectures: list[str] = Field(default_factory=list)
    target_name_or_path: str | None = None
    # method specifics
    mask_token_id: int | None = Field(default=None, description="P-EAGLE placeholder token")
    embed_trainable: bool = False
    speculative_tokens: int = 3
    draft_passes: int = Field(default=1, ge=1, description="P-EAGLE's forwards per draft: 1 blind one, then "
                              "refining ones whose placeholders read the drafts before them (`peagle_fed_ratio`)")
    # Architecture options of heads trained elsewhere (vllm-project/speculators' Eagle3 config and
    # its decoder-layer config). The defaults are the layout Aerie's own heads use.
    layer_type: Literal["llama", "qwen3"] = Field(
        default="llama", description="decoder layers: qwen3 adds an RMSNorm per head on q and k (q_norm, k_norm)"
    )
    attention_bias: bool = Field(default=False, description="bias on q, k, v and o projections")
    mlp_bias: bool = Field(default=False, description="bias on the MLP projections")
    norm_before_residual: bool = Field(default=False, description="layer 0's residual is hidden_norm(fc output)")
    norm_before_fc: bool = Field(default=False, description="one RMSNorm over the fused features before fc")
    fc_norm: bool = Field(default=False, description="an RMSNorm per tapped layer's features before fc")
    norm_output: bool = Field(default=False, description="the hidden state fed back to the next step is norm(h)")
    rope_scaling: dict[str, str | int | float | bool | None] | None = Field(
        default=None, description="Hugging Face rope_parameters (without rope_theta) for a scaled RoPE: llama3, "
        "linear, yarn"
    )
    sliding_window: int | None = Field(
        default=None, ge=1, description="window of the sliding-window layers (the head's attention is full: "
        "exact while every sequence fits in it, see DraftHead.check_span)"
    )
    sliding_layers: tuple[int, ...] = Field(default=(), description="layers that use the sliding window")

    @model_validator(mode="after")
    def _options_agree(self) -> HeadConfig:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other")
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ValueError("sliding_window and sliding_layers go together")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of the target's {self.kv_heads} key/value heads"
            )
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers}: the head has layers 0..{self.num_layers - 1}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") in (None, "default"):
            raise ValueError("rope_scaling needs a rope_type other than default")
        return self

    @property
    def rope_scaling_items(self) -> tuple[tuple[str, object], ...]:
        """`rope_scaling` as the hashable form `layers.rope_cos_sin` takes (empty: plain RoPE)."""
        return tuple(sorted((self.rope_scaling or {}).items()))

    @property
    def feature_kind(self) -> str:
        return "last" if self.method == "eagle" else "eagle3"

    @property
    def feature_size(self) -> int:
        """Width of the target features the head's `features` argument takes."""
        return self.target_hidden_size * (1 if self.method == "eagle" else 3)

    @classmethod
    def for_target(
        cls,
        target,
        method: Method,
        draft_vocab_size: int | None = None,
        num_layers: int | None = None,
        mask_token_id: int | None = None,
        speculative_tokens: int = 3,
        target_name_or_path: str | None = None,
        num_heads: int | None = None,
        draft_passes: int = 1,
    ) -> HeadConfig:
        """A head config sized from a `aerie.target.Target` (its text config). `num_heads`: the
        head's query heads (default the target's), each of the target's head width."""
        cfg = target.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        num_heads = num_heads or cfg.num_attention_heads
        vocab = target.vocab_size
        if method == "eagle":
            draft_vocab_size = vocab
        if method == "peagle" and mask_token_id is None:
            mask_token_id = default_mask_token_id(target)
        rope_theta = getattr(cfg, "rope_theta", None)
        if rope_theta is None:
            rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        name = target_name_or_path or getattr(target.model.config, "_name_or_path", None) or None
        return cls(
            method=method,
            hidden_size=cfg.hidden_size,
            intermediate_size=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
            num_layers=num_layers or DEFAULT_LAYERS[method],
            num_heads=num_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            vocab_size=vocab,
            draft_vocab_size=min(draft_vocab_size or vocab, vocab),
            target_hidden_size=target.hidden_size,
            target_num_layers=target.num_layers,
            tap_layers=tuple(target.tap_layers) if method != "eagle" else (),
            target_architectures=list(getattr(target.model.config, "architectures", None) or []),
            target_name_or_path=str(name) if name else None,
            mask_token_id=mask_token_id,
            embed_trainable=method == "peagle",
            speculative_tokens=speculative_tokens,
            draft_passes=draft_passes,
        )


def default_mask_token_id(target) -> int:
    """The P-EAGLE placeholder when none is given: an embedding row the tokenizer never produces
    (models often pad their vocabulary), else the pad token when it is not also a stop token, else
    the last row. `fit.train_head` replaces a choice that occurs in the training data by the
    rarest token there."""
    tok = getattr(target, "tokenizer", None)
    if tok is not None and len(tok) < target.vocab_size:
        return int(len(tok))
    if tok is not None and tok.pad_token_id is not None and tok.pad_token_id not in set(target.stop_token_ids):
        return int(tok.pad_token_id)
    return int(target.vocab_size - 1)
