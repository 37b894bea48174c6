"""Offline features: the target's tapped hidden states for every ingested sequence (Ray Data).

    python -m pipelines.featurize --data s3://bucket/data/ --target DIR --out s3://bucket/data/ \\
        [--method eagle3|peagle|eagle] [--dtype bfloat16|float16|float32]

For users who train several heads on the same data: the frozen target runs once over the ingest
Parquet (``<data>/train/``, ``<data>/eval/``; or any Parquet folder with ``input_ids`` and
``loss_mask``) and its features are written next to the tokens, in the layout that
:mod:`aerie.features` documents and reads::

    <out>/features/index.json                                the pointer, written last
    <out>/features/gen-<time>-<id>/<split>/shard-00000.safetensors   input_ids, loss_mask, features, offsets

``--method eagle3`` (and ``peagle``) stores the fused EAGLE-3 taps ``[T, 3H]``, ``--method eagle``
the last hidden state ``[T, H]``; ``--dtype bfloat16`` (the default) or ``float16`` halves the size
of ``float32``. ``--out`` may be the ingest folder itself: only ``<out>/features/`` is replaced.

How: the driver reads the row lengths (one small column) and plans shards of ~``--shard-mb``
each, in file and row order (so names and contents are the same on every run); an actor pool
(``--actors``, ``--num-gpus`` per actor; one GPU each on a cluster) loads the target once per
actor, reads its shard's rows straight from Parquet, runs them through the target in right-padded
batches of at most ``--batch-tokens`` tokens with a 2-D attention mask, and writes the shard.
Each run writes a new ``gen-*`` version and then replaces ``index.json`` (whose shard paths name
it), so a reader sees the previous complete features or the new ones, never a mix; the previous
version is kept for readers already in it, older ones are deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from aerie import storage
from aerie.data.ingest_output import split_uri
from aerie.features import DTYPES, FORMAT, INDEX, compute_features, feature_kind, pack_shard
from pipelines.ingest import data_context, format_validation_error

SPLITS = ("train", "eval")
TOKEN_COLUMNS = ["id", "input_ids", "loss_mask"]


class FeaturizeConfig(BaseModel):
    """Validated featurize settings; a bad value raises ``ValidationError`` naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str = Field(min_length=1, description="Ingest output (train/, eval/) or a Parquet folder; local or s3://.")
    target: str = Field(min_length=1, description="Target model directory, local or s3://.")
    out: str = Field(min_length=1, description="Output folder or s3:// prefix; features/ is written under it.")
    method: Literal["eagle3", "peagle", "eagle"] = Field("eagle3", description="Which head the features are for.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Storage dtype.")
    shard_mb: float = Field(256.0, gt=0, description="Features per shard, in MB (approximate).")
    batch_tokens: int = Field(8192, ge=1, description="Padded tokens per target forward.")
    actors: int = Field(1, ge=1, description="Target actors in the pool.")
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs per actor (1 on a GPU cluster).")
    progress: bool = Field(True, description="Show Ray Data progress bars.")

    @field_validator("data", "out", "target")
    @classmethod
    def _uri(cls, v: str) -> str:
        if "://" in v and not v.startswith(("s3://", "file://")):
            raise ValueError("must be a local path or an s3:// URI")
        return v


# ----------------------------------------------------------------------------- planning (driver)


def input_splits(data: str) -> dict[str, list[str]]:
    """``{split: [parquet URIs]}``: ``train``/``eval`` subfolders of an ingest output, else every
    Parquet file under ``data`` as ``train``."""
    found = {}
    for split in SPLITS:
        uri = split_uri(data, split)
        if storage.is_dir(uri):
            files = storage.list_files(uri, (".parquet",))
            if files:
                found[split] = files
    if not found:
        files = storage.list_files(data, (".parquet",))
        if not files:
            raise FileNotFoundError(f"no .parquet files under {data}")
        found["train"] = files
    return found


def _row_lengths(fs: pafs.FileSystem, path: str) -> list[int]:
    schema = pq.read_schema(path, filesystem=fs)
    if "num_tokens" in schema.names:
        return pq.read_table(path, filesystem=fs, columns=["num_tokens"]).column("num_tokens").to_pylist()
    ids = pq.read_table(path, filesystem=fs, columns=["input_ids"]).column("input_ids")
    return pc.list_value_length(ids).to_pylist()


def plan_shards(splits: dict[str, list[str]], shard_tokens: int, folder: str = "") -> list[dict[str, Any]]:
    """Cut each split's rows, in file and row order, into shards of about ``shard_tokens`` tokens,
    named ``<folder>/<split>/shard-NNNNN.safetensors``. A shard is a list of ``[file path, first
    row, end row]`` segments (it may span files)."""
    plan: list[dict[str, Any]] = []
    for split, files in splits.items():
        shard: dict[str, Any] = {"segments": [], "rows": 0, "tokens": 0}
        first = len(plan)

        def close(split: str = split, first: int = first) -> None:
            nonlocal shard
            if shard["rows"]:
                n = len(plan) - first
                path = f"{folder}/{split}/shard-{n:05d}.safetensors".lstrip("/")
                plan.append({"split": split, "shard": n, "path": path, **shard,
                             "segments": json.dumps(shard["segments"])})
            shard = {"segments": [], "rows": 0, "tokens": 0}

        for uri in files:
            fs, path = storage.resolve(uri)
            lengths = _row_lengths(fs, path)
            start = 0
            for r, n in enumerate(lengths):
                shard["rows"] += 1
                shard["tokens"] += n
                if shard["tokens"] >= shard_tokens:
                    shard["segments"].append([path, start, r + 1])
                    start = r + 1
                    close()
            if start < len(lengths):
                shard["segments"].append([path, start, len(lengths)])
        close()
    return plan


# ----------------------------------------------------------------------------- the actor


def _read_rows(fs: pafs.FileSystem, path: str, start: int, end: int) -> pa.Table:
    """Rows ``[start, end)`` of one Parquet file, reading only the row groups that hold them."""
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        groups, first, pos = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if pos < end and pos + n > start:
                groups.append(g)
                first = pos if first is None else first
            pos += n
        table = pf.read_row_groups(groups, columns=TOKEN_COLUMNS)
    return table.slice(start - (first or 0), end - start)


class Featurizer:
    """One actor of the pool: loads the target once, then computes and writes whole shards."""

    def __init__(self, cfg: dict[str, Any], in_fs: pafs.FileSystem, root_uri: str) -> None:
        import torch

        from aerie.target import load_target

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        device = "cuda" if cfg["num_gpus"] > 0 and torch.cuda.is_available() else "cpu"
        self.cfg = cfg
        self.kind = feature_kind(cfg["method"])
        self.dtype = DTYPES[cfg["dtype"]]
        self.in_fs, self.root_uri = in_fs, root_uri
        self.target = load_target(str(storage.download(cfg["target"])), device=device)

    def __call__(self, batch: pa.Table) -> pa.Table:
        stats: dict[str, list[Any]] = {k: [] for k in ("split", "shard", "path", "rows", "tokens", "bytes", "seconds")}
        for item in batch.to_pylist():
            t0 = time.monotonic()
            parts = [_read_rows(self.in_fs, p, a, b) for p, a, b in json.loads(item["segments"])]
            table = pa.concat_tables(parts)
            input_ids = table.column("input_ids").to_pylist()
            masks = table.column("loss_mask").to_pylist()
            feats = compute_features(self.target, input_ids, self.kind, max_batch_tokens=self.cfg["batch_tokens"],
                                     dtype=self.dtype)
            data = pack_shard(table.column("id").to_pylist(), input_ids, masks, feats,
                              {"method": self.cfg["method"], "feature_kind": self.kind, "dtype": self.cfg["dtype"]})
            storage.write_bytes(storage.join(self.root_uri, item["path"]), data)
            for key, value in (("split", item["split"]), ("shard", item["shard"]), ("path", item["path"]),
                               ("rows", table.num_rows), ("tokens", sum(map(len, input_ids))),
                               ("bytes", len(data)), ("seconds", round(time.monotonic() - t0, 3))):
                stats[key].append(value)
        return pa.table(stats)


# ----------------------------------------------------------------------------- the stage


def run_featurize(cfg: FeaturizeConfig) -> dict[str, Any]:
    """Featurize ``cfg.data``; uses the connected Ray instance or starts a local one. Returns the
    index (also written to ``<out>/features/index.json``)."""
    if not ray.is_initialized():
        ray.init()
    with data_context(cfg.progress):
        return _run(cfg)


def _target_shape(target: str) -> tuple[int, int, str]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(storage.download_model_files(target)))
    text = config.get_text_config()
    return int(text.hidden_size), int(text.num_hidden_layers), str(config.model_type)


def _manifest_created(data: str) -> str | None:
    """When the ingest that wrote ``data`` ran (its manifest's ``created``), so a reader can tell
    features computed from an older ingest into the same folder."""
    uri = storage.join(data, "manifest.json")
    if not storage.exists(uri):
        return None
    return json.loads(storage.read_text(uri)).get("created")


def _run(cfg: FeaturizeConfig) -> dict[str, Any]:
    from aerie.target import eagle3_tap_layers

    t0 = time.monotonic()
    kind = feature_kind(cfg.method)
    hidden, layers, model_type = _target_shape(cfg.target)
    dim = 3 * hidden if kind == "eagle3" else hidden
    splits = input_splits(cfg.data)
    root_uri = storage.join(cfg.out, "features")
    if any(f.startswith(root_uri.rstrip("/") + "/") for files in splits.values() for f in files):
        raise ValueError(f"--data must not be inside {root_uri}, which is replaced")
    bytes_per_token = dim * DTYPES[cfg.dtype].itemsize
    generation = storage.new_generation()
    plan = plan_shards(splits, max(1, int(cfg.shard_mb * 1e6 / bytes_per_token)), generation)
    t_plan = time.monotonic() - t0

    in_fs, _ = storage.resolve(next(iter(splits.values()))[0])
    stats: list[dict[str, Any]] = []
    if plan:
        ds = ray.data.from_items(plan, override_num_blocks=len(plan))
        ds = ds.map_batches(
            Featurizer,
            fn_constructor_kwargs={"cfg": cfg.model_dump(), "in_fs": in_fs, "root_uri": root_uri},
            compute=ray.data.ActorPoolStrategy(size=min(cfg.actors, len(plan))),
            num_gpus=cfg.num_gpus or None,
            batch_size=1,  # one shard per call
            batch_format="pyarrow",
            runtime_env={"env_vars": storage.worker_env()},  # the driver's S3, whenever Ray started
        )
        stats = sorted(ds.take_all(), key=lambda s: (SPLITS.index(s["split"]) if s["split"] in SPLITS else 9,
                                                     s["shard"]))
    if len(stats) != len(plan):
        raise RuntimeError(f"featurize wrote {len(stats)} shards, planned {len(plan)}")
    planned = {(p["split"], p["shard"]): p for p in plan}
    for s in stats:
        p = planned[(s["split"], s["shard"])]
        if (s["rows"], s["tokens"]) != (p["rows"], p["tokens"]):
            raise RuntimeError(f"shard {s['path']}: wrote {s['rows']} rows / {s['tokens']} tokens, "
                               f"planned {p['rows']} / {p['tokens']}")
    seconds = time.monotonic() - t0 - t_plan
    index_splits: dict[str, Any] = {}
    for split in splits:
        shards = [{k: s[k] for k in ("path", "rows", "tokens", "bytes")} for s in stats if s["split"] == split]
        index_splits[split] = {"rows": sum(s["rows"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                               "shards": shards}
    tokens = sum(s["tokens"] for s in stats)
    index = {
        "format": FORMAT,
        "generation": generation,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "method": cfg.method,
        "feature_kind": kind,
        "feature_dim": dim,
        "hidden_size": hidden,
        "tap_layers": list(eagle3_tap_layers(layers)) if kind == "eagle3" else [layers - 1],
        "dtype": cfg.dtype,
        "target": {"path": cfg.target, "model_type": model_type, "num_hidden_layers": layers},
        "data": cfg.data,
        "data_manifest_created": _manifest_created(cfg.data),
        "config": cfg.model_dump(),
        "layout": "each shard: input_ids int32 [T], loss_mask int8 [T], features [T, feature_dim], "
        "offsets int64 [rows + 1] (row r = [offsets[r], offsets[r+1])), metadata 'ids' (JSON list); "
        "read with aerie.features.iter_features",
        "splits": index_splits,
        "counts": {"rows": sum(s["rows"] for s in stats), "tokens": tokens, "shards": len(stats),
                   "bytes": sum(s["bytes"] for s in stats)},
        "timings_s": {"plan": round(t_plan, 3), "featurize": round(seconds, 3),
                      "tokens_per_s": round(tokens / seconds, 1) if seconds else None},
    }
    storage.publish_generation(root_uri, INDEX, index, legacy=SPLITS)
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.featurize", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--method", default="eagle3")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shard-mb", type=float, default=256.0)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--actors", type=int, default=1)
    p.add_argument("--num-gpus", type=float, default=0.0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        cfg = FeaturizeConfig(
            data=args.data, target=args.target, out=args.out, method=args.method, dtype=args.dtype,
            shard_mb=args.shard_mb, batch_tokens=args.batch_tokens, actors=args.actors, num_gpus=args.num_gpus,
            progress=not args.no_progress,
        )
    except ValidationError as e:
        print(format_validation_error(e), file=sys.stderr)
        return 2
    index = run_featurize(cfg)
    print(json.dumps({"out": storage.join(cfg.out, "features"), **index["counts"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
