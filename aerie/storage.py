"""One way to address local paths and ``s3://`` URIs (through ``pyarrow.fs``).

Every path Aerie reads or writes goes through :func:`resolve`, which turns a URI into a
``(pyarrow FileSystem, path)`` pair. S3 is configured from the standard AWS environment
variables, ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` included, so an S3-compatible
server (moto, MinIO) works exactly like AWS. Pass the file system to Ray Data
(``filesystem=``) so Ray workers use the same configuration as the driver.

Writes are atomic: a local file is written to a temporary name next to it and renamed;
an S3 object is uploaded in one put/multipart upload, which S3 makes visible atomically.
A whole folder is replaced with :func:`publish_dir` (a head, whose layout other engines read
as is) or through a generation folder and a pointer written last (:func:`new_generation`,
:func:`publish_generation`; the ingest output and the features index), so a reader sees the
old complete folder or the new one.

:func:`download` caches ``s3://`` files locally, keyed on what S3 says about each object (its
ETag and size): a prefix re-exported with other bytes is fetched again even if the size is the
same. Local paths are read in place and never cached, so they cannot be stale.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

__all__ = [
    "is_s3",
    "join",
    "resolve",
    "s3_filesystem",
    "worker_env",
    "exists",
    "is_dir",
    "list_files",
    "open_read",
    "read_bytes",
    "read_text",
    "atomic_write",
    "write_bytes",
    "write_text",
    "write_json",
    "delete",
    "download",
    "upload",
    "publish_dir",
    "new_generation",
    "publish_generation",
    "PublishInProgress",
    "cache_dir",
]

_S3_LOCK = threading.Lock()
_S3_CACHE: dict[tuple, pafs.S3FileSystem] = {}
_CLIENTS: dict[tuple, Any] = {}
PUBLISH_MARKER = "_publish.json"  # in a folder that publish_dir replaced on S3
DOWNLOAD_INDEX = ".aerie-download.json"  # in a download cache folder: the ETag of every file fetched
GENERATION_PREFIX = "gen-"


class PublishInProgress(RuntimeError):
    """An S3 folder is being replaced by :func:`publish_dir` (or a replacement was interrupted)."""


def is_s3(uri: str | os.PathLike[str]) -> bool:
    """True for ``s3://bucket/key`` URIs."""
    return str(uri).startswith("s3://")


def join(uri: str | os.PathLike[str], *parts: str) -> str:
    """Join path parts onto a local path or an ``s3://`` URI (always with ``/`` for S3)."""
    base = str(uri)
    if is_s3(base):
        out = base.rstrip("/")
        for part in parts:
            out = f"{out}/{part.strip('/')}"
        return out
    return str(Path(base, *parts))


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


WORKER_SETTINGS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_SAGEMAKER", "AWS_REGION",
                   "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED", "AERIE_CACHE")
S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def worker_env() -> dict[str, str]:
    """What another process (a Ray worker) needs to address storage as this one does: the S3 (and
    SageMaker, for ``sagemaker://`` inputs) endpoint and region, the download cache, and the keys of
    an S3-compatible server (MinIO, moto) when one is set (on AWS, workers use their own role). Ray
    workers keep the environment of the instance they belong to, which may predate these settings or
    run on another node: the Ray folders pass this as ``runtime_env={"env_vars": worker_env()}``."""
    env = {name: os.environ[name] for name in WORKER_SETTINGS if os.environ.get(name)}
    if _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SAGEMAKER"):
        env.update({name: os.environ[name] for name in S3_CREDENTIALS if os.environ.get(name)})
    return env


def s3_filesystem(bucket: str | None = None) -> pafs.S3FileSystem:
    """An ``S3FileSystem`` configured from the AWS environment variables.

    Endpoint: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (``http://`` selects plain HTTP).
    Region: ``AWS_REGION`` or ``AWS_DEFAULT_REGION``; otherwise the bucket's region is looked up.
    Credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` when set
    (passed explicitly, so a pickled file system works on Ray workers started before they were
    set); otherwise the AWS SDK's default chain (config files, instance profile).
    """
    endpoint = _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    region = _env("AWS_REGION", "AWS_DEFAULT_REGION")
    access_key = _env("AWS_ACCESS_KEY_ID")
    secret_key = _env("AWS_SECRET_ACCESS_KEY")
    token = _env("AWS_SESSION_TOKEN")
    if region is None and endpoint is None and bucket:
        try:
            region = pafs.resolve_s3_region(bucket)
        except OSError:
            region = None
    key = (endpoint, region, access_key, secret_key, token)
    with _S3_LOCK:
        fs = _S3_CACHE.get(key)
        if fs is None:
            kwargs: dict[str, Any] = {"region": region}
            if endpoint:
                parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
                kwargs["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
                kwargs["scheme"] = parsed.scheme or "https"
            if access_key and secret_key:
                kwargs.update(access_key=access_key, secret_key=secret_key, session_token=token)
            fs = pafs.S3FileSystem(**kwargs)
            _S3_CACHE[key] = fs
        return fs


def resolve(uri: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """``(file system, path inside it)`` for a local path or an ``s3://`` URI.

    Local paths come back absolute. S3 paths come back as ``bucket/key`` (no scheme), the form
    ``pyarrow.fs`` and Ray Data's ``filesystem=`` argument expect.
    """
    text = str(uri)
    if is_s3(text):
        path = text[len("s3://") :].strip("/")
        if not path:
            raise ValueError(f"S3 URI without a bucket: {text!r}")
        return s3_filesystem(path.split("/", 1)[0]), path
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"unsupported URI scheme (use a local path or s3://): {text!r}")
    if text.startswith("file://"):
        text = text[len("file://") :]
    return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())


def to_uri(uri: str | os.PathLike[str], path: str) -> str:
    """A path of `resolve(uri)`'s file system back as a URI of the same kind (`s3://` or local)."""
    return f"s3://{path}" if is_s3(uri) else path


def exists(uri: str | os.PathLike[str]) -> bool:
    """True if a file or directory (or, on S3, any object under the prefix) exists."""
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(uri: str | os.PathLike[str]) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def list_files(uri: str | os.PathLike[str], suffixes: tuple[str, ...] | None = None) -> list[str]:
    """Every file under ``uri`` (recursively), sorted, as URIs of the same kind as ``uri``.

    ``uri`` may also name a single file. ``suffixes`` keeps only names ending with one of them
    (case-insensitive, e.g. ``(".jsonl", ".jsonl.gz")``). Hidden files and folders (``.``/``_``
    prefixed, such as ``_SUCCESS`` or ``.tmp-*``) are skipped. A missing ``uri`` raises
    ``FileNotFoundError``.
    """
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(str(uri))
    if info.type == pafs.FileType.File:
        infos = [info]
        base = path.rsplit("/", 1)[0]
    else:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        base = path
    wanted = tuple(s.lower() for s in suffixes) if suffixes else None
    out: list[str] = []
    for item in infos:
        if item.type != pafs.FileType.File:
            continue
        rel = item.path[len(base) :].lstrip("/")
        if any(part.startswith((".", "_")) for part in rel.split("/")):
            continue
        if wanted and not item.path.lower().endswith(wanted):
            continue
        out.append(to_uri(uri, item.path))
    return sorted(out)


@contextmanager
def open_read(uri: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """Open a file for binary reading; ``.gz`` files are decompressed transparently."""
    fs, path = resolve(uri)
    with fs.open_input_stream(path, compression=None) as raw:
        if path.lower().endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz  # type: ignore[misc]
        else:
            yield raw  # type: ignore[misc]


def read_bytes(uri: str | os.PathLike[str]) -> bytes:
    with open_read(uri) as f:
        return f.read()


def read_text(uri: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    return read_bytes(uri).decode(encoding)


@contextmanager
def atomic_write(uri: str | os.PathLike[str], compress: bool = False) -> Iterator[IO[bytes]]:
    """Open ``uri`` for binary writing; readers see the old file or the whole new one, never a part.

    Local: a temporary file in the same folder, fsynced and renamed over the target.
    S3: the bytes are spooled locally and uploaded in one go on success; nothing is written
    if the block raises. ``compress=True`` gzips what is written (name the file ``*.gz``).
    """
    fs, path = resolve(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.path.basename(path)}-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as raw:
                if compress:
                    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                        yield gz  # type: ignore[misc]
                else:
                    yield raw
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return
    with tempfile.SpooledTemporaryFile(max_size=64 * 1024 * 1024) as spool:
        if compress:
            with gzip.GzipFile(fileobj=spool, mode="wb", mtime=0) as gz:
                yield gz  # type: ignore[misc]
        else:
            yield spool  # type: ignore[misc]
        spool.seek(0)
        with fs.open_output_stream(path, compression=None) as out:
            shutil.copyfileobj(spool, out, length=8 * 1024 * 1024)


def write_bytes(uri: str | os.PathLike[str], data: bytes) -> None:
    with atomic_write(uri) as f:
        f.write(data)


def write_text(uri: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    write_bytes(uri, text.encode(encoding))


def write_json(uri: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    write_text(uri, json.dumps(obj, indent=indent, sort_keys=False, ensure_ascii=False) + "\n")


def delete(uri: str | os.PathLike[str]) -> None:
    """Remove a file or a whole directory / prefix; a missing path is not an error."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif info.type == pafs.FileType.File:
        fs.delete_file(path)


def cache_dir() -> Path:
    """Local cache for downloaded prefixes: ``$AERIE_CACHE`` or ``~/.cache/aerie``."""
    return Path(os.environ.get("AERIE_CACHE", Path.home() / ".cache" / "aerie")).expanduser()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".h5", ".msgpack")


def download_model_files(uri: str | os.PathLike[str]) -> Path:
    """A model directory's config, tokenizer and generation config, without its weight files."""
    return download(uri, skip_suffixes=WEIGHT_SUFFIXES)


def download(
    uri: str | os.PathLike[str],
    local_dir: str | os.PathLike[str] | None = None,
    *,
    skip_suffixes: tuple[str, ...] = (),
    wait_s: float = 60.0,
) -> Path:
    """Make ``uri`` available on the local disk and return the local path.

    A local path is returned as is. An ``s3://`` file or prefix is copied to ``local_dir``
    (default: ``cache_dir()/s3/<bucket>/<key>``). A file already there is reused only if its
    ETag and size, recorded when it was fetched, are what S3 lists now; each file is fetched with
    ``If-Match`` on the listed ETag and written atomically, files that disappeared from S3 are
    removed, so the folder is one consistent version. A folder that :func:`publish_dir` is
    replacing is waited for (up to ``wait_s``), then refused with :class:`PublishInProgress`.
    ``skip_suffixes`` leaves matching files out (e.g. model weights when only the tokenizer is
    needed; a later call without it completes the same cache folder).
    """
    if not is_s3(uri):
        fs, path = resolve(uri)
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            raise FileNotFoundError(str(uri))
        return Path(path)
    _, path = resolve(uri)
    bucket, key = path.split("/", 1) if "/" in path else (path, "")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _download_once(bucket, key, local_dir, skip_suffixes)
        except (_ChangedWhileReading, PublishInProgress):
            if time.monotonic() > deadline:
                raise PublishInProgress(
                    f"{uri} is being replaced (or its last replacement was interrupted: publish it again)"
                ) from None
            time.sleep(0.5)


class _ChangedWhileReading(RuntimeError):
    pass


def _s3_client() -> Any:
    """A boto3 S3 client configured like :func:`s3_filesystem` (for ETags and conditional reads)."""
    import boto3

    key = tuple(_env(n) for n in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
                                  "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
    with _S3_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            endpoint = key[0] or key[1]
            client = _CLIENTS[key] = boto3.client("s3", endpoint_url=endpoint, region_name=key[2] or key[3])
        return client


def _list_objects(bucket: str, prefix: str) -> dict[str, dict[str, Any]]:
    """``{key: {"etag", "size"}}`` of every object under ``prefix`` (a folder, ``/`` added)."""
    pages = _s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
    return {
        obj["Key"]: {"etag": obj["ETag"], "size": obj["Size"]}
        for page in pages
        for obj in page.get("Contents", [])
    }


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def _read_json_object(bucket: str, key: str) -> dict[str, Any]:
    return json.loads(_s3_client().get_object(Bucket=bucket, Key=key)["Body"].read())


def _remote_files(bucket: str, key: str) -> tuple[dict[str, dict[str, Any]], str, bool]:
    """(``{relative name: {"etag", "size"}}``, the key they are relative to, single file?) of
    ``key``: an object, or every visible object under it, checked against its publish marker."""
    from botocore.exceptions import ClientError

    listed = _list_objects(bucket, key) if key else _list_objects(bucket, "")
    base = key.rstrip("/")
    if not listed:
        try:
            head = _s3_client().head_object(Bucket=bucket, Key=key)
        except ClientError:
            raise FileNotFoundError(f"s3://{bucket}/{key}") from None
        name = base.rsplit("/", 1)[-1]
        return {name: {"etag": head["ETag"], "size": head["ContentLength"]}}, base.rsplit("/", 1)[0], True
    files = {k[len(base) :].lstrip("/"): v for k, v in listed.items()}
    marker = files.get(PUBLISH_MARKER)
    visible = {rel: info for rel, info in files.items() if not _hidden(rel)}
    if marker is not None:
        state = _read_json_object(bucket, f"{base}/{PUBLISH_MARKER}")
        if state.get("state") != "complete":
            raise PublishInProgress(f"s3://{bucket}/{base}")
        if {rel: info["etag"] for rel, info in visible.items()} != state["files"]:
            raise _ChangedWhileReading(f"s3://{bucket}/{base}")
    return visible, base, False


def _download_once(bucket: str, key: str, local_dir: str | os.PathLike[str] | None,
                   skip_suffixes: tuple[str, ...]) -> Path:
    from botocore.exceptions import ClientError

    files, base, single = _remote_files(bucket, key)
    dest = Path(local_dir) if local_dir is not None else cache_dir() / "s3" / bucket / base
    dest.mkdir(parents=True, exist_ok=True)
    index_path = dest / DOWNLOAD_INDEX
    try:
        fetched: dict[str, str] = json.loads(index_path.read_text())
    except (OSError, ValueError):
        fetched = {}
    client = _s3_client()
    for rel, info in sorted(files.items()):
        if skip_suffixes and rel.lower().endswith(skip_suffixes):
            continue
        target = dest / rel
        if fetched.get(rel) == info["etag"] and target.is_file() and target.stat().st_size == info["size"]:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
        object_key = f"{base}/{rel}" if base else rel
        try:
            body = client.get_object(Bucket=bucket, Key=object_key, IfMatch=info["etag"])["Body"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "NoSuchKey"):
                raise _ChangedWhileReading(object_key) from None
            raise
        with open(tmp, "wb") as out:
            shutil.copyfileobj(body, out, length=8 * 1024 * 1024)
        os.replace(tmp, target)
        fetched[rel] = info["etag"]
    if not single:
        for rel in sorted(set(fetched) - set(files)):  # gone from S3: a newer version does not have it
            (dest / rel).unlink(missing_ok=True)
            del fetched[rel]
    with atomic_write(index_path) as f:
        f.write(json.dumps(fetched, indent=1, sort_keys=True).encode())
    return dest / next(iter(files)) if single else dest


def upload(local_dir: str | os.PathLike[str], uri: str | os.PathLike[str]) -> list[str]:
    """Copy every file under ``local_dir`` to ``uri`` (local or S3), keeping the layout.

    Bytes are copied as they are (no compression added or removed); each file is written
    atomically. Returns the destination URIs.
    """
    src = Path(local_dir)
    if not src.is_dir():
        raise NotADirectoryError(str(src))
    written = []
    for file in sorted(p for p in src.rglob("*") if p.is_file()):
        target = join(uri, *file.relative_to(src).parts)
        with open(file, "rb") as f, atomic_write(target) as out:
            shutil.copyfileobj(f, out, length=8 * 1024 * 1024)
        written.append(target)
    return written


def publish_dir(local_dir: str | os.PathLike[str], uri: str | os.PathLike[str]) -> str:
    """Replace the folder ``uri`` (local or S3) with the files of ``local_dir``: readers see the old
    complete folder or the new complete one, never a mix. Returns ``uri``.

    Local: the files are copied to a hidden sibling, then swapped in with two renames (the old
    folder moved aside, then deleted). A reader at that instant finds no folder, never a mix.

    S3 has no rename, so: (1) every file is uploaded under ``<uri>/_staging-<id>/`` (hidden);
    a failure here leaves the old folder untouched; (2) the marker ``<uri>/_publish.json`` says
    ``swapping``; (3) each file is copied server-side into place and files the new version lacks
    are deleted; (4) the marker is rewritten ``complete`` with every file's ETag; (5) the staging
    copy is deleted. :func:`download` (how Aerie reads S3 folders) waits while the marker is not
    ``complete`` and checks the ETags against it, so a reader never loads a mix; if the writer
    dies during (3), readers refuse the folder until it is published again.
    """
    src = Path(local_dir)
    if not src.is_dir():
        raise NotADirectoryError(str(src))
    rels = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    if not is_s3(uri):
        _, path = resolve(uri)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex[:8]
        staging = dest.parent / f".{dest.name}.staging-{token}"
        shutil.copytree(src, staging)
        old = dest.parent / f".{dest.name}.old-{token}"
        if dest.exists():
            dest.rename(old)
        staging.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
        return str(uri)
    _, path = resolve(uri)
    bucket, base = path.split("/", 1)
    base = base.rstrip("/")
    client = _s3_client()
    staging = f"{base}/_staging-{uuid.uuid4().hex[:12]}"
    for rel in rels:
        client.upload_file(str(src / rel), bucket, f"{staging}/{rel}")
    marker_key = f"{base}/{PUBLISH_MARKER}"

    def put_marker(state: dict[str, Any]) -> None:
        client.put_object(Bucket=bucket, Key=marker_key, Body=json.dumps(state, indent=1).encode())

    put_marker({"state": "swapping", "staging": staging})
    for rel in rels:
        client.copy({"Bucket": bucket, "Key": f"{staging}/{rel}"}, bucket, f"{base}/{rel}")
    listed = _list_objects(bucket, base)
    for key in sorted(listed):
        rel = key[len(base) + 1 :]
        if not _hidden(rel) and rel not in rels:
            client.delete_object(Bucket=bucket, Key=key)
    etags = {rel: listed[f"{base}/{rel}"]["etag"] for rel in rels}
    put_marker({"state": "complete", "files": etags})
    for key in sorted(listed):
        if key[len(base) + 1 :].startswith("_staging-"):  # this one, and any an earlier failure left
            client.delete_object(Bucket=bucket, Key=key)
    return str(uri)


def new_generation() -> str:
    """A fresh folder name for one version of an output that a pointer file (written last) names:
    ``gen-<UTC time>-<random>``, sortable by time."""
    return f"{GENERATION_PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def publish_generation(root: str | os.PathLike[str], pointer: str, document: dict[str, Any],
                       legacy: tuple[str, ...] = ()) -> list[str]:
    """Make the version ``document["generation"]`` (a :func:`new_generation` folder under ``root``,
    complete) the current one: write ``root/<pointer>`` (one atomic write: the swap), then delete
    every other ``gen-*`` folder but the previous pointer's (a reader may still be in it) and the
    ``legacy`` folders of a layout before versions. Returns the deleted URIs."""
    pointer_uri = join(root, pointer)
    try:
        previous = json.loads(read_text(pointer_uri)).get("generation")
    except (FileNotFoundError, ValueError, AttributeError):
        previous = None
    write_json(pointer_uri, document)
    current = document["generation"]
    deleted = _prune_generations(root, keep={current, previous or current})
    for name in legacy:
        folder = join(root, name)
        if exists(folder):
            delete(folder)
            deleted.append(folder)
    return deleted


def _prune_generations(root: str | os.PathLike[str], keep: set[str]) -> list[str]:
    """Delete every ``gen-*`` folder directly under ``root`` whose name is not in ``keep``."""
    fs, path = resolve(root)
    deleted = []
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.base_name.startswith(GENERATION_PREFIX) \
                and info.base_name not in keep:
            fs.delete_dir(info.path)
            deleted.append(to_uri(root, info.path))
    return deleted
