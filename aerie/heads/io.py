"""Head files: a directory with `config.json` (speculators layout) and `model.safetensors`.

config.json holds the fields vllm-project/speculators writes and vLLM's speculators config reader
consumes (`speculators_model_type`, `architectures`, `transformer_layer_config`,
`draft_vocab_size`, `target_hidden_size`, `norm_before_residual`,
`eagle_aux_hidden_state_layer_ids`, `mask_token_id` for P-EAGLE, and `speculators_config` with
`proposal_methods[0].speculative_tokens` and the `verifier`), plus `aerie_head_config`: the full
`HeadConfig` this package rebuilds the head from.

model.safetensors uses the names vLLM's EAGLE loaders read: `fc.weight`, `layers.N.*` (files with
EAGLE-3's original `midlayer.*` load too), `norm.weight`, `lm_head.weight`, `d2t`, `t2d`,
`mask_hidden` (P-EAGLE), and `embed_tokens.weight` only where the method trains it. An EAGLE
head's lm_head is the target's and is never stored. Never pickle.

A directory whose config.json has no `aerie_head_config` is a head trained by vllm-project/speculators
(EAGLE-3 or P-EAGLE): `speculators.py` reads it, refusing what Aerie's heads cannot represent. Saved
again (after warm-started training), it keeps its architecture options in both configs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from aerie.heads import build_head, speculators
from aerie.heads.base import DraftHead
from aerie.heads.config import HeadConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator", "eagle": "EagleSpeculator"}
LAYER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class HeadMismatchError(ValueError):
    """A head file does not fit the target it is loaded for."""


def speculators_config(config: HeadConfig, speculative_tokens: int | None = None) -> dict:
    """The config.json dictionary for a head."""
    k = int(speculative_tokens or config.speculative_tokens)
    aux_ids = [t + 1 for t in config.tap_layers]  # vLLM names the layer whose input is captured
    proposal: dict = {"proposal_type": "greedy", "speculative_tokens": k}
    if config.method == "peagle":
        proposal["parallel_drafting"] = True
    layer_config = {
        "model_type": config.layer_type,
        "architectures": [LAYER_ARCHITECTURES[config.layer_type]],
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "tie_word_embeddings": False,
    }
    if config.rope_scaling is not None:
        layer_config["rope_scaling"] = {**config.rope_scaling, "rope_theta": config.rope_theta}
    if config.sliding_window is not None:
        layer_config["sliding_window"] = config.sliding_window
        layer_config["layer_types"] = [
            "sliding_attention" if i in config.sliding_layers else "full_attention" for i in range(config.num_layers)
        ]
    out: dict = {
        "speculators_model_type": config.method,
        "architectures": [ARCHITECTURES[config.method]],
        "transformer_layer_config": layer_config,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "embed_requires_grad": config.embed_trainable,
    }
    if config.method == "eagle":
        out.update(layernorms=False, fusion_bias=False)
    else:
        out["eagle_aux_hidden_state_layer_ids"] = aux_ids
    if config.method == "peagle":
        out["mask_token_id"] = config.mask_token_id
    out["speculators_config"] = {
        "algorithm": config.method,
        "proposal_methods": [proposal],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": config.target_name_or_path,
            "architectures": list(config.target_architectures),
            "hidden_size": config.target_hidden_size,
            "vocab_size": config.vocab_size,
            "num_hidden_layers": config.target_num_layers,
            "tap_layers": list(config.tap_layers),
        },
    }
    out["aerie_head_config"] = config.model_dump(mode="json")
    return out


def save_head(
    head: DraftHead, path: str | Path, speculative_tokens: int | None = None, eval_metrics: dict | None = None
) -> str:
    """Write `config.json` + `model.safetensors` to a directory (local or `s3://`). `eval_metrics`
    (an evaluation summary: `acc_d`, `chain_d`, `tau`) go into config.json as `aerie_eval`; the
    head's own are kept otherwise. Adaptive speculation starts from them."""
    path = str(path)
    if path.startswith("s3://"):
        from aerie import storage

        with tempfile.TemporaryDirectory() as tmp:
            save_head(head, tmp, speculative_tokens, eval_metrics)
            storage.upload(tmp, path)
        return path
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous().clone() for name, t in head.trainable_state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt", "method": head.method})
    config = speculators_config(head.config, speculative_tokens)
    metrics = eval_metrics if eval_metrics is not None else head.eval_metrics
    if metrics:
        config["aerie_eval"] = {k: float(v) for k, v in metrics.items()}
    text = json.dumps(config, indent=2) + "\n"
    (out / CONFIG_NAME).write_text(text)
    return str(out)


def read_head_config(path: str | Path, target_num_layers: int | None = None) -> HeadConfig:
    """The `HeadConfig` of a head directory: Aerie's own `aerie_head_config`, or, for a head trained
    by speculators, one read from its speculators fields (which needs the target's layer count)."""
    data = json.loads((Path(path) / CONFIG_NAME).read_text())
    if speculators.is_speculators_file(data):
        if target_num_layers is None:
            raise ValueError(f"{path}: a speculators head, read against its target (target_num_layers)")
        return speculators.head_config(data, target_num_layers, where=f"head {path}")
    if "aerie_head_config" not in data:
        raise ValueError(
            f"{path}/{CONFIG_NAME} has neither aerie_head_config nor speculators_model_type: not a head file "
            "(an EAGLE-3 checkpoint in its original layout converts with `speculators convert`)"
        )
    config = HeadConfig.model_validate(data["aerie_head_config"])
    if data.get("speculators_model_type") != config.method:
        raise ValueError(
            f"{path}/{CONFIG_NAME}: speculators_model_type {data.get('speculators_model_type')!r} "
            f"disagrees with aerie_head_config.method {config.method!r}"
        )
    return config


def check_target(config: HeadConfig, target, where: str = "head") -> None:
    """Raise HeadMismatchError naming every field where the head and the target disagree."""
    problems = []
    checks = [
        ("hidden_size", config.target_hidden_size, target.hidden_size),
        ("vocab_size", config.vocab_size, target.vocab_size),
        ("num_hidden_layers", config.target_num_layers, target.num_layers),
    ]
    if config.method != "eagle":
        checks.append(("tap_layers", tuple(config.tap_layers), tuple(target.tap_layers)))
    embed = tuple(target.embed_tokens.weight.shape)
    checks.append(("embedding shape", (config.vocab_size, config.hidden_size), embed))
    for name, mine, theirs in checks:
        if mine != theirs:
            if name == "tap_layers":  # also in the numbering of speculators' and vLLM's configs
                name = f"tap_layers (eagle_aux_hidden_state_layer_ids {[t + 1 for t in mine]})"
            problems.append(f"{name}: the head was trained for {mine}, the target has {theirs}")
    if problems:
        verifier = config.target_name_or_path or "another target"
        raise HeadMismatchError(
            f"{where} does not fit this target (it was trained for {verifier}): " + "; ".join(problems)
        )


def _rename(name: str) -> str:
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def load_head(
    path: str | Path,
    target,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> DraftHead:
    """Load a head directory (local or `s3://`) for `target`, Aerie's or one speculators trained;
    refuses a head built for another target (HeadMismatchError naming the field) or using an option
    Aerie cannot represent (speculators.UnsupportedHead). Embeddings (and EAGLE's lm_head) not in
    the file come from the target. Returns the head in eval mode on the target's device and dtype unless
    `device` / `dtype` say otherwise."""
    local = str(path)
    if local.startswith("s3://"):
        from aerie import storage

        local = str(storage.download(local))
    config = read_head_config(local, target.num_layers)
    check_target(config, target, where=f"head {path}")
    head = build_head(config)
    head.load_target_weights(target)
    data = json.loads((Path(local) / CONFIG_NAME).read_text())
    weights = load_file(str(Path(local) / WEIGHTS_NAME))
    if speculators.is_speculators_file(data):
        state = speculators.state_dict(weights, config, where=f"head {path}")
    else:
        state = {_rename(k): v for k, v in weights.items()}
    expected = dict(head.state_dict())
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(head.trainable_state_dict()) - set(state))
    if unexpected or missing:
        raise ValueError(
            f"head {path}: weights do not match a {config.method} head (unexpected {unexpected}, missing {missing})"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise HeadMismatchError(
                f"head {path}: {name} is {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    head.load_state_dict(state, strict=False)
    head.eval_metrics = data.get("aerie_eval", {})
    device = device if device is not None else target.device
    head = head.to(device=device)
    if dtype is not None or target.dtype != torch.float32:
        head = head.to(dtype=dtype or target.dtype)
    return head.eval()
