"""Heads trained by vllm-project/speculators: their `config.json` (an `Eagle3SpeculatorConfig` or
`PEagleSpeculatorConfig`) read into a `HeadConfig`, their `model.safetensors` into the state dict
Aerie's heads load, so such a head drafts exactly as speculators' own model code computes it.

What speculators' model code applies (speculators/models/eagle3/core.py `Eagle3DraftModel`,
eagle3/model_definitions.py `Eagle3FirstLayerMixin`, peagle/core.py `PEagleDraftModel`) and where
it goes here: the decoder layers of `transformer_layer_config` (Llama, or Qwen3 with its q_norm /
k_norm; biases; rms_norm_eps; head_dim; the RoPE of its `rope_parameters`), `norm_before_residual`,
`norm_before_fc` (`input_norm`), `fc_norm` (one norm per tapped layer), `norm_output`,
`draft_vocab_size` with `d2t` / `t2d` (absent when the draft vocabulary is the target's),
`eagle_aux_hidden_state_layer_ids` (vLLM's numbering: the layer whose input is tapped),
`target_hidden_size`, `embed_requires_grad`, and for P-EAGLE `mask_token_id` and `mask_hidden`.
Anything Aerie's heads cannot represent raises `UnsupportedHead` naming the option: another
layer architecture or activation, partial or length-dependent RoPE, other than three tapped layers,
a P-EAGLE head without its mask token, a key whose default speculators and vLLM read differently.
Sliding-window layers load, and are exact for sequences that fit the window (`check_span`).
"""

from __future__ import annotations

from typing import Any

import torch

from aerie.heads.config import HeadConfig
from aerie.heads.layers import STATIC_ROPE_TYPES

LAYER_TYPES = ("llama", "qwen3")
# speculators' Eagle3SpeculatorConfig builds a Qwen3Config when `model_type` is absent
DEFAULT_LAYER_TYPE = "qwen3"
ACTIVATIONS = ("silu", "swish")
TRAINING_ONLY_WEIGHTS = ("verifier_norm.weight", "verifier_lm_head.weight")  # targets for the loss, not drafting
# Keys whose absence speculators and vLLM read differently (vLLM: True, the target vocabulary).
AMBIGUOUS_WHEN_ABSENT = {
    "norm_before_residual": "speculators reads a missing norm_before_residual as false, vLLM as true",
    "draft_vocab_size": "speculators reads a missing draft_vocab_size as 32000, vLLM as the target vocabulary",
}


class UnsupportedHead(ValueError):
    """A speculators head uses an option Aerie's heads cannot represent."""


def is_speculators_file(data: dict[str, Any]) -> bool:
    return "speculators_model_type" in data and "aerie_head_config" not in data


def _layer_config(data: dict[str, Any], where: str):
    """The transformers config of the decoder layers, built as speculators builds it (its class from
    `model_type`, every default of that class filled in)."""
    from transformers import CONFIG_MAPPING

    raw = data.get("transformer_layer_config")
    if not isinstance(raw, dict):
        raise UnsupportedHead(f"{where}: config.json has no transformer_layer_config object")
    model_type = raw.get("model_type", DEFAULT_LAYER_TYPE)
    if model_type not in LAYER_TYPES:
        raise UnsupportedHead(
            f"{where}: transformer_layer_config.model_type {model_type!r} is not supported (Aerie's heads have "
            f"{' or '.join(LAYER_TYPES)} decoder layers)"
        )
    return CONFIG_MAPPING[model_type](**{k: v for k, v in raw.items() if k != "model_type"}), model_type


def _rope(layer, where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the scaled-RoPE parameters or None) as the head's rotary embedding uses them."""
    params = dict(getattr(layer, "rope_parameters", None) or {})
    if "sliding_attention" in params:  # per-layer-type RoPE: speculators' rotary takes the sliding one
        params = dict(params["sliding_attention"])
    name = "transformer_layer_config.rope_parameters"
    partial = params.get("partial_rotary_factor", getattr(layer, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedHead(f"{where}: {name}.partial_rotary_factor={partial} (partial RoPE) is not supported")
    if "mrope_section" in params:
        raise UnsupportedHead(f"{where}: {name}.mrope_section (multimodal RoPE) is not supported")
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedHead(
            f"{where}: {name}.rope_type={rope_type!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})"
        )
    theta = float(params.pop("rope_theta", getattr(layer, "rope_theta", None) or 10000.0))
    params.pop("partial_rotary_factor", None)
    return theta, (params if rope_type != "default" else None)


def _sliding(layer, num_layers: int, where: str) -> tuple[int | None, tuple[int, ...]]:
    layer_types = getattr(layer, "layer_types", None) or ["full_attention"] * num_layers
    if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise UnsupportedHead(
            f"{where}: transformer_layer_config.layer_types {layer_types} must give full_attention or "
            f"sliding_attention for each of the {num_layers} layers"
        )
    window = getattr(layer, "sliding_window", None)
    sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if window is None or not sliding:  # speculators' mask without a window is plain causal
        return None, ()
    return int(window), sliding


def head_config(data: dict[str, Any], target_num_layers: int, where: str = "head") -> HeadConfig:
    """A `HeadConfig` from a speculators config.json, for a target of `target_num_layers` layers
    (what speculators resolves from the verifier: the default tapped layers)."""
    method = data.get("speculators_model_type")
    if method not in ("eagle3", "peagle"):
        raise UnsupportedHead(
            f"{where}: speculators_model_type {method!r} is not supported (Aerie loads eagle3 and peagle heads)"
        )
    for key, why in AMBIGUOUS_WHEN_ABSENT.items():
        if key not in data:
            raise UnsupportedHead(f"{where}: config.json has no {key}: {why}; set it explicitly")
    layer, layer_type = _layer_config(data, where)
    act = getattr(layer, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedHead(f"{where}: transformer_layer_config.hidden_act={act!r} is not supported (silu only)")
    num_layers = int(layer.num_hidden_layers)
    aux_ids = data.get("eagle_aux_hidden_state_layer_ids")
    if aux_ids is None:  # what speculators resolves from the verifier
        n = target_num_layers
        aux_ids = [2, n // 2, n - 3]
    if len(aux_ids) != 3 or min(aux_ids) < 1:
        raise UnsupportedHead(
            f"{where}: eagle_aux_hidden_state_layer_ids={aux_ids}: Aerie's heads fuse three tapped target layers, "
            "each after layer 0"
        )
    mask_token_id = data.get("mask_token_id")
    if method == "peagle" and mask_token_id is None:
        raise UnsupportedHead(f"{where}: a peagle head needs mask_token_id (its placeholder), config.json has none")
    theta, rope_scaling = _rope(layer, where)
    window, sliding = _sliding(layer, num_layers, where)
    spec = data.get("speculators_config") or {}
    proposals = spec.get("proposal_methods") or [{}]
    verifier = spec.get("verifier") or {}
    hidden = int(layer.hidden_size)
    return HeadConfig(
        method=method,
        hidden_size=hidden,
        intermediate_size=int(layer.intermediate_size),
        num_layers=num_layers,
        num_heads=int(layer.num_attention_heads),
        kv_heads=int(getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads),
        head_dim=int(getattr(layer, "head_dim", None) or hidden // layer.num_attention_heads),
        rms_norm_eps=float(layer.rms_norm_eps),
        rope_theta=theta,
        max_position_embeddings=int(layer.max_position_embeddings),
        vocab_size=int(layer.vocab_size),
        draft_vocab_size=int(data["draft_vocab_size"]),
        target_hidden_size=int(data.get("target_hidden_size") or hidden),
        target_num_layers=target_num_layers,
        tap_layers=tuple(int(i) - 1 for i in aux_ids),
        target_architectures=list(verifier.get("architectures") or []),
        target_name_or_path=verifier.get("name_or_path"),
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
        embed_trainable=bool(data.get("embed_requires_grad", method == "peagle")),
        speculative_tokens=int(proposals[0].get("speculative_tokens") or 3),
        layer_type=layer_type,
        attention_bias=bool(getattr(layer, "attention_bias", False)),
        mlp_bias=layer_type == "llama" and bool(getattr(layer, "mlp_bias", False)),
        norm_before_residual=bool(data["norm_before_residual"]),
        norm_before_fc=bool(data.get("norm_before_fc", False)),
        fc_norm=bool(data.get("fc_norm", False)),
        norm_output=bool(data.get("norm_output", False)),
        rope_scaling=rope_scaling,
        sliding_window=window,
        sliding_layers=sliding,
    )


def state_dict(weights: dict[str, torch.Tensor], config: HeadConfig, where: str = "head") -> dict[str, torch.Tensor]:
    """speculators' tensors under the names and shapes Aerie's head has: `midlayer.*` (EAGLE-3's
    original naming) as `layers.0.*`, the training-only verifier tensors left out, `mask_hidden`
    [1, 1, 3H] as [3H], and the identity `d2t` / `t2d` a file without a reduced vocabulary omits."""
    state = {}
    for name, tensor in weights.items():
        if name in TRAINING_ONLY_WEIGHTS:
            continue
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        state[name] = tensor
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if "d2t" not in state and "t2d" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise UnsupportedHead(
                f"{where}: draft_vocab_size {config.draft_vocab_size} is below the target vocabulary "
                f"{config.vocab_size} but model.safetensors has no d2t / t2d"
            )
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return state
