"""`HeadConfig`: everything needed to rebuild a draft head and check it against a target."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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
    ) -> HeadConfig:
        """A head config sized from a `aerie.target.Target` (its text config)."""
        cfg = target.config
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
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
            kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
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
