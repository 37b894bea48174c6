"""aerie.storage: local paths and s3:// URIs through one API (S3 = a local moto server)."""

from __future__ import annotations

import gzip
import json
import os

import pyarrow.fs as pafs
import pytest

from aerie import storage


def _tree(root):
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "one.jsonl").write_text("1\n")
    (root / "a" / "b" / "two.jsonl.gz").write_bytes(gzip.compress(b"2\n"))
    (root / "a" / "b" / "three.txt").write_text("3\n")
    (root / "a" / "_SUCCESS").write_text("")
    (root / "a" / ".tmp-x.jsonl").write_text("partial")
    return root / "a"


def test_join_and_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # else the bucket's region is looked up online
    assert storage.join("s3://b/p/", "x", "/y") == "s3://b/p/x/y"
    assert storage.join(str(tmp_path), "x", "y") == str(tmp_path / "x" / "y")
    fs, path = storage.resolve("s3://bucket/key/a")
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/key/a"
    fs, path = storage.resolve(f"file://{tmp_path}")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path)
    with pytest.raises(ValueError):
        storage.resolve("gs://bucket/x")
    with pytest.raises(ValueError):
        storage.resolve("s3://")


def test_list_files_local(tmp_path):
    root = _tree(tmp_path)
    files = storage.list_files(str(root), (".jsonl", ".jsonl.gz"))
    assert [os.path.relpath(f, root) for f in files] == ["b/two.jsonl.gz", "one.jsonl"]
    assert len(storage.list_files(str(root))) == 3  # hidden and _-prefixed files are skipped
    assert storage.list_files(str(root / "one.jsonl")) == [str(root / "one.jsonl")]
    with pytest.raises(FileNotFoundError):
        storage.list_files(str(tmp_path / "missing"))


def test_read_gz_transparently(tmp_path):
    root = _tree(tmp_path)
    assert storage.read_text(str(root / "b" / "two.jsonl.gz")) == "2\n"
    assert storage.read_bytes(str(root / "one.jsonl")) == b"1\n"


def test_atomic_write_local(tmp_path):
    target = tmp_path / "deep" / "file.json"
    storage.write_json(str(target), {"a": 1})
    assert target.read_text().strip() == '{\n  "a": 1\n}'
    with pytest.raises(RuntimeError), storage.atomic_write(str(target)) as f:
        f.write(b"half")
        raise RuntimeError("boom")
    assert '"a": 1' in target.read_text()  # the old content survives a failed write
    assert [p.name for p in target.parent.iterdir()] == ["file.json"]  # no temp file left
    storage.write_bytes(str(tmp_path / "x.jsonl.gz"), b"raw")  # bytes as given: no implicit gzip
    assert (tmp_path / "x.jsonl.gz").read_bytes() == b"raw"
    with storage.atomic_write(str(tmp_path / "y.jsonl.gz"), compress=True) as f:
        f.write(b"z\n")
    assert storage.read_text(str(tmp_path / "y.jsonl.gz")) == "z\n"


def test_delete_exists_download_local(tmp_path):
    root = _tree(tmp_path)
    assert storage.exists(str(root)) and storage.is_dir(str(root))
    assert storage.download(str(root)) == root  # local paths are used in place
    storage.delete(str(root / "one.jsonl"))
    assert not storage.exists(str(root / "one.jsonl"))
    storage.delete(str(root))
    storage.delete(str(root))  # missing: no error
    assert not storage.exists(str(root))
    with pytest.raises(FileNotFoundError):
        storage.download(str(tmp_path / "nope"))


def test_s3_round_trip(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("AERIE_CACHE", str(tmp_path / "cache"))
    root = _tree(tmp_path / "src")
    written = storage.upload(str(root), f"{s3_bucket}/tree")
    assert len(written) == 5 and all(u.startswith(f"{s3_bucket}/tree/") for u in written)
    files = storage.list_files(f"{s3_bucket}/tree", (".jsonl", ".jsonl.gz"))
    assert files == [f"{s3_bucket}/tree/b/two.jsonl.gz", f"{s3_bucket}/tree/one.jsonl"]
    assert storage.read_text(f"{s3_bucket}/tree/b/two.jsonl.gz") == "2\n"  # bytes kept, gunzipped on read
    storage.write_json(f"{s3_bucket}/tree/manifest.json", {"ok": True})
    assert storage.exists(f"{s3_bucket}/tree/manifest.json") and storage.is_dir(f"{s3_bucket}/tree")

    local = storage.download(f"{s3_bucket}/tree")
    assert local == tmp_path / "cache" / "s3" / s3_bucket[5:] / "tree"
    assert (local / "b" / "two.jsonl.gz").read_bytes() == (root / "b" / "two.jsonl.gz").read_bytes()
    stamp = (local / "one.jsonl").stat().st_mtime_ns
    assert storage.download(f"{s3_bucket}/tree") == local
    assert (local / "one.jsonl").stat().st_mtime_ns == stamp  # cached: not fetched again
    one = storage.download(f"{s3_bucket}/tree/one.jsonl", tmp_path / "single")
    assert one.read_text() == "1\n"
    light = storage.download(f"{s3_bucket}/tree", tmp_path / "light", skip_suffixes=(".gz",))
    assert (light / "one.jsonl").is_file() and not (light / "b" / "two.jsonl.gz").exists()

    with pytest.raises(RuntimeError), storage.atomic_write(f"{s3_bucket}/tree/never.json") as f:
        f.write(b"x")
        raise RuntimeError("boom")
    assert not storage.exists(f"{s3_bucket}/tree/never.json")
    storage.delete(f"{s3_bucket}/tree")
    assert not storage.exists(f"{s3_bucket}/tree/one.jsonl")


def test_s3_endpoint_comes_from_the_environment(s3_server):
    fs = storage.s3_filesystem("any")
    assert isinstance(fs, pafs.S3FileSystem)
    # the same configuration each time (cached), and picklable for Ray workers
    import pickle

    assert storage.s3_filesystem("any") is fs
    assert isinstance(pickle.loads(pickle.dumps(fs)), pafs.S3FileSystem)


def _publish_files(folder, weights: bytes, config: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text(config)
    return folder


def test_s3_download_is_never_stale(s3_bucket, tmp_path, monkeypatch):
    """Re-exported to the same URI with the same sizes but other bytes: the next download has the
    new bytes (a size-keyed cache kept the old ones)."""
    monkeypatch.setenv("AERIE_CACHE", str(tmp_path / "cache"))
    uri = f"{s3_bucket}/stale/head"
    storage.upload(str(_publish_files(tmp_path / "v1", b"\x01" * 64, '{"v": 1}')), uri)
    first = storage.download(uri)
    assert (first / "model.safetensors").read_bytes() == b"\x01" * 64
    storage.upload(str(_publish_files(tmp_path / "v2", b"\x02" * 64, '{"v": 2}')), uri)
    second = storage.download(uri)
    assert second == first
    assert (second / "model.safetensors").read_bytes() == b"\x02" * 64
    assert (second / "config.json").read_text() == '{"v": 2}'
    single = storage.download(f"{uri}/config.json")
    assert single.read_text() == '{"v": 2}'


def test_publish_dir_replaces_a_local_folder_whole(tmp_path):
    dest = tmp_path / "out" / "head"
    storage.publish_dir(_publish_files(tmp_path / "v1", b"a", "1"), str(dest))
    (tmp_path / "v1" / "extra.txt").write_text("only in v1")
    storage.publish_dir(tmp_path / "v1", str(dest))
    storage.publish_dir(_publish_files(tmp_path / "v2", b"b", "2"), str(dest))
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == b"b"
    assert [p.name for p in dest.parent.iterdir()] == ["head"]  # no staging or old copy left


def test_publish_dir_on_s3_survives_a_writer_killed_mid_write(s3_bucket, tmp_path, monkeypatch):
    """A publish that dies while uploading leaves the previous version whole and readable; one that
    dies while swapping is refused by readers instead of read as a mix; publishing again heals it."""
    monkeypatch.setenv("AERIE_CACHE", str(tmp_path / "cache"))
    uri = f"{s3_bucket}/published/head"
    storage.publish_dir(_publish_files(tmp_path / "v1", b"\x01" * 32, '{"v": 1}'), uri)
    client = storage._s3_client()
    real_upload, real_copy = client.upload_file, client.copy
    calls = []

    def dying_upload(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-write")
        return real_upload(*args, **kwargs)

    v2 = _publish_files(tmp_path / "v2", b"\x02" * 32, '{"v": 2}')
    monkeypatch.setattr(client, "upload_file", dying_upload)
    with pytest.raises(KeyboardInterrupt):
        storage.publish_dir(v2, uri)
    monkeypatch.setattr(client, "upload_file", real_upload)
    local = storage.download(uri)
    assert (local / "model.safetensors").read_bytes() == b"\x01" * 32
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["config.json",
                                                                                      "model.safetensors"]

    def dying_copy(source, bucket, key, *args, **kwargs):
        raise KeyboardInterrupt("killed while swapping")

    monkeypatch.setattr(client, "copy", dying_copy)
    with pytest.raises(KeyboardInterrupt):
        storage.publish_dir(v2, uri)
    monkeypatch.setattr(client, "copy", real_copy)
    with pytest.raises(storage.PublishInProgress, match="publish it again"):
        storage.download(uri, wait_s=0.5)
    storage.publish_dir(v2, uri)
    local = storage.download(uri)
    assert (local / "model.safetensors").read_bytes() == b"\x02" * 32
    assert not [f for f in storage.list_files(uri) if "_staging" in f]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket[5:], Prefix="published/")["Contents"]}
    assert not any("_staging-" in k for k in keys)  # the failed attempts' staging copies are gone too


def test_publishing_a_generation_keeps_it_and_the_previous_one(tmp_path):
    names = [storage.new_generation() for _ in range(3)]
    assert len(set(names)) == 3 and all(n.startswith("gen-") for n in names)
    (tmp_path / "train").mkdir()  # a layout before versions
    for name in names:
        (tmp_path / name).mkdir()
        deleted = storage.publish_generation(str(tmp_path), "index.json", {"generation": name}, legacy=("train",))
    assert deleted == [str(tmp_path / names[0])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[1], names[2], "index.json"])
    assert json.loads((tmp_path / "index.json").read_text()) == {"generation": names[2]}


def test_worker_env_carries_the_s3_settings_and_only_a_custom_servers_keys(monkeypatch):
    for name in (*storage.WORKER_SETTINGS, *storage.S3_CREDENTIALS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert storage.worker_env() == {"AWS_REGION": "eu-west-1"}  # on AWS, workers use their own role
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert storage.worker_env() == {"AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                                    "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret"}
