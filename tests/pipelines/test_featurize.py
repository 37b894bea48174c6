"""Offline features (pipelines/featurize.py + aerie/features.py): what is read back is what the
target computes on the same tokens, locally and on S3, in every storage dtype and feature kind."""

from __future__ import annotations

import json

import pyarrow.dataset as pads
import pytest
import torch
from pydantic import ValidationError

from aerie import storage
from aerie.data.ingest_output import split_uri
from aerie.features import compute_features, iter_features, read_index, read_shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SHARD_MB = 0.03  # ~40 rows of the tiny target's 3H = 192 float32 features: several shards per split


@pytest.fixture(scope="module")
def ingested(regenerated):
    """The output of ingest --regenerate (the usual way in: regenerate, then featurize)."""
    return regenerated[0]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from aerie.target import load_target

    return load_target(str(tiny_target_dir))


def _parquet_rows(uri: str) -> dict[str, dict]:
    fs, path = storage.resolve(uri)
    return {r["id"]: r for r in pads.dataset(path, filesystem=fs, format="parquet").to_table().to_pylist()}


def _config(**kw):
    from pipelines.featurize import FeaturizeConfig

    kw.setdefault("progress", False)
    kw.setdefault("shard_mb", SHARD_MB)
    return FeaturizeConfig(**kw)


def _check_against_target(out: str, data: str, target, kind: str, atol: float) -> int:
    """Every row read back equals the parquet row's tokens and target.forward's features on them."""
    index = read_index(out)
    checked = 0
    for split, info in index["splits"].items():
        source = _parquet_rows(split_uri(data, split))
        assert info["rows"] == len(source) and len(info["shards"]) >= 1
        ids = [i for s in info["shards"] for i in read_shard(storage.join(index["root"], s["path"])).ids]
        assert sorted(ids) == sorted(source)  # every row once
        for rid, row in zip(ids, iter_features(out, split), strict=True):
            want = source[rid]
            assert row.input_ids.tolist() == want["input_ids"] and row.loss_mask.tolist() == want["loss_mask"]
            n = len(want["input_ids"])
            ref = target.forward(torch.tensor([want["input_ids"]]), torch.arange(n)[None], features=kind).features[0]
            assert row.features.shape == ref.shape == (n, index["feature_dim"])
            torch.testing.assert_close(row.features.float(), ref.float(), atol=atol, rtol=atol)
            checked += 1
    return checked


def test_local_eagle3_float32_round_trip(ingested, tiny_target_dir, target, tmp_path):
    from pipelines.featurize import main

    out = tmp_path / "feat"
    stale = out / "features" / "train" / "shard-99999.safetensors"  # left by an earlier, larger run
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    assert main(["--data", str(ingested), "--target", str(tiny_target_dir), "--out", str(out), "--method", "eagle3",
                 "--dtype", "float32", "--shard-mb", str(SHARD_MB), "--no-progress"]) == 0
    index = json.loads((out / "features" / "index.json").read_text())
    assert index["feature_kind"] == "eagle3" and index["feature_dim"] == 3 * 64 and index["dtype"] == "float32"
    assert index["tap_layers"] == list(target.tap_layers) and set(index["splits"]) == {"train", "eval"}
    assert len(index["splits"]["train"]["shards"]) >= 2
    shards = out / "features" / index["generation"] / "train"
    assert index["splits"]["train"]["shards"][0]["path"] == f"{index['generation']}/train/shard-00000.safetensors"
    shard = read_shard(str(shards / "shard-00000.safetensors"))
    assert shard.input_ids.dtype == torch.int32 and shard.features.dtype == torch.float32
    assert shard.offsets[-1] == shard.input_ids.numel() == shard.features.shape[0]
    n = _check_against_target(str(out), str(ingested), target, "eagle3", atol=1e-5)
    assert n == index["counts"]["rows"] == sum(s["rows"] for s in index["splits"].values())

    # data-parallel readers see disjoint shards that together cover the split
    per_rank = [list(iter_features(str(out), "train", rank=r, world_size=2)) for r in range(2)]
    assert sum(map(len, per_rank)) == index["splits"]["train"]["rows"] and all(per_rank)
    assert not stale.exists()  # features/ is replaced, never appended to
    assert sorted(p.name for p in shards.iterdir()) == [
        f"shard-{i:05d}.safetensors" for i in range(len(index["splits"]["train"]["shards"]))
    ]


def test_s3_eagle_last_hidden_bf16_round_trip(ingested, s3_bucket, tiny_target_dir, target):
    """Data on S3, features to S3 (next to the tokens), the EAGLE last hidden state in bf16."""
    from pipelines.featurize import run_featurize

    data = f"{s3_bucket}/featurize/data"
    storage.upload(str(ingested), data)
    index = run_featurize(_config(data=data, target=str(tiny_target_dir), out=data, method="eagle",
                                  dtype="bfloat16"))
    assert index["feature_kind"] == "last" and index["feature_dim"] == 64 and index["dtype"] == "bfloat16"
    assert storage.exists(f"{data}/features/index.json")
    assert storage.exists(split_uri(data, "train"))  # tokens untouched
    first = index["splits"]["train"]["shards"][0]["path"]
    assert read_shard(f"{data}/features/{first}").features.dtype == torch.bfloat16
    assert _check_against_target(data, data, target, "last", atol=2e-2) == index["counts"]["rows"]
    as_float = next(iter_features(f"{data}/features", "eval", dtype=torch.float32))
    assert as_float.features.dtype == torch.float32


def test_compute_features_batches_like_single_rows(target):
    """Right-padded batches (and a batch-token budget that splits them) give each row's own features."""
    seqs = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [], [14, 15, 16, 17]]
    whole = compute_features(target, seqs, "eagle3", max_batch_tokens=1024)
    split = compute_features(target, seqs, "eagle3", max_batch_tokens=7, dtype=torch.float16)
    for seq, a, b in zip(seqs, whole, split, strict=True):
        assert a.shape == (len(seq), 192) and b.dtype == torch.float16
        if seq:
            ref = target.forward(torch.tensor([seq]), torch.arange(len(seq))[None], features="eagle3").features[0]
            torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.float(), ref, atol=1e-2, rtol=1e-2)


def test_config_errors(tmp_path):
    from pipelines.featurize import main

    with pytest.raises(ValidationError):
        _config(data="x", target="y", out="z", method="medusa")
    assert main(["--data", "x", "--target", "y", "--out", "gs://z", "--dtype", "int8"]) == 2
    with pytest.raises(FileNotFoundError):
        read_index(str(tmp_path))
