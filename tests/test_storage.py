"""aerie.storage: local paths and s3:// URIs through one API (S3 = a local moto server)."""

from __future__ import annotations

import gzip
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
