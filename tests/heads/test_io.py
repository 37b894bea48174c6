"""Head files: speculators layout, vLLM weight names, round trip, refusing the wrong target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from aerie.heads import new_head
from aerie.heads.io import HeadMismatchError, load_head, save_head
from tests.heads.conftest import make_target
from tests.heads.test_heads import inputs, make_head


@pytest.mark.parametrize("method", ["eagle3", "peagle", "eagle"])
def test_round_trip_identical_outputs(target, method, tmp_path):
    head = make_head(target, method)
    save_head(head, tmp_path / "h", speculative_tokens=5)
    again = load_head(tmp_path / "h", target)
    ids, pos, feats = inputs(target, head)
    with torch.no_grad():
        a, b = head(ids, pos, features=feats), again(ids, pos, features=feats)
        a2, b2 = head(ids, pos, hidden=a.hidden), again(ids, pos, hidden=b.hidden)
    assert torch.equal(a.logits, b.logits) and torch.equal(a2.logits, b2.logits)
    if method != "eagle":
        assert torch.equal(head.d2t, again.d2t) and torch.equal(head.t2d, again.t2d)


def test_more_query_heads_than_the_target(target, tmp_path):
    """A head may have more query heads than its target (the protocol's P-EAGLE has twice as many),
    each of the target's width: its file says so where vLLM reads it, and it loads back the same."""
    heads = 2 * target.config.num_attention_heads
    head = new_head(target, "peagle", num_heads=heads, seed=0).eval()
    save_head(head, tmp_path / "h", speculative_tokens=5)
    layer = json.loads((tmp_path / "h" / "config.json").read_text())["transformer_layer_config"]
    assert (layer["num_attention_heads"], layer["head_dim"]) == (heads, head.config.head_dim)
    again = load_head(tmp_path / "h", target)
    ids, pos, feats = inputs(target, head)
    with torch.no_grad():
        assert torch.equal(head(ids, pos, features=feats).logits, again(ids, pos, features=feats).logits)
    with pytest.raises(ValueError, match="multiple of the target's"):
        new_head(target, "peagle", num_heads=target.config.num_key_value_heads + 1)


@pytest.mark.parametrize("method", ["eagle3", "peagle", "eagle"])
def test_file_layout(target, method, tmp_path):
    head = make_head(target, method)
    save_head(head, tmp_path, speculative_tokens=4)
    config = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert config["speculators_model_type"] == method
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"]["hidden_size"] == 64 and spec["verifier"]["vocab_size"] == 512
    assert spec["verifier"]["num_hidden_layers"] == 4
    assert config["norm_before_residual"] is False  # vLLM defaults this to True for eagle3 when absent
    assert "fc.weight" in weights and "layers.0.self_attn.q_proj.weight" in weights
    assert "layers.0.mlp.down_proj.weight" in weights
    if method == "eagle":
        assert "lm_head.weight" not in weights and "embed_tokens.weight" not in weights
        assert weights["fc.weight"].shape == (64, 128)
        return
    assert config["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in target.tap_layers]
    assert config["draft_vocab_size"] == 128
    assert weights["fc.weight"].shape == (64, 192)
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (64, 128)  # 2H input
    assert weights["layers.0.hidden_norm.weight"].shape == (64,)
    assert weights["lm_head.weight"].shape == (128, 64) and "norm.weight" in weights
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    if method == "peagle":
        assert spec["proposal_methods"][0]["parallel_drafting"] is True
        assert config["mask_token_id"] == head.mask_token_id
        assert weights["mask_hidden"].shape == (192,) and "embed_tokens.weight" in weights
        assert "layers.1.self_attn.q_proj.weight" in weights
        assert weights["layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    else:
        assert "embed_tokens.weight" not in weights and "mask_hidden" not in weights


def test_midlayer_names_load(target, tmp_path):
    head = make_head(target, "eagle3")
    save_head(head, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    again = load_head(tmp_path, target)
    assert torch.equal(again.layers[0].self_attn.q_proj.weight, head.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"hidden": 32}, "hidden_size"), ({"vocab": 256}, "vocab_size"), ({"layers": 8}, "num_hidden_layers")],
)
def test_wrong_target_refused(target, tmp_path, kwargs, field):
    save_head(make_head(target, "eagle3"), tmp_path)
    other = make_target(**kwargs)
    with pytest.raises(HeadMismatchError, match=field):
        load_head(tmp_path, other)
