"""The ingest output: one complete version at a time, found through its manifest.

Layout (``aerie ingest --out OUT``)::

    OUT/manifest.json                 the pointer, written last: counts, tokenizer facts, and
                                      ``outputs`` naming the folders of the current version
    OUT/gen-<time>-<id>/train/        Parquet
    OUT/gen-<time>-<id>/eval/         Parquet
    OUT/gen-<time>-<id>/quarantine/   JSONL

A run writes a new ``gen-*`` folder next to the current one and then replaces ``manifest.json``
(one atomic write, local or S3), so a reader that follows the manifest sees the previous
complete version or the new complete one, never a mix; a run killed before that leaves the
previous version in place. The previous generation is kept (a reader may still be reading it),
older ones are deleted. Readers resolve split folders with :func:`split_uri`; an output of the
earlier layout (``OUT/train/`` and no generation in the manifest) still reads.

:func:`check_training_data` is what ``aerie train`` asks before it trusts a data folder.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow.dataset as pads

from aerie import storage
from aerie.formats.chat import STATUS_OK, STATUS_TOO_LONG

__all__ = [
    "FORMAT",
    "MANIFEST",
    "SPLITS",
    "DataMismatch",
    "tokenizer_facts",
    "read_manifest",
    "split_uri",
    "parquet_rows",
    "check_training_data",
    "definitions",
    "ingest_counts",
    "load_tokenizer",
]

FORMAT = "aerie-ingest/2"
MANIFEST = "manifest.json"
SPLITS = ("train", "eval", "quarantine")


class DataMismatch(ValueError):
    """A data folder that cannot be trusted for this job; the message names what does not match."""


def tokenizer_facts(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer for training data: its size, a hash of its vocabulary (token ->
    id) and of its chat template."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False, separators=(",", ":"))
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "vocab_sha256": hashlib.sha256(vocab.encode("utf-8", "surrogatepass")).hexdigest(),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
    }


def read_manifest(data: str) -> dict[str, Any]:
    """``DATA/manifest.json``; raises :class:`DataMismatch` when there is none or it is unreadable."""
    uri = storage.join(data, MANIFEST)
    try:
        manifest = json.loads(storage.read_text(uri))
    except FileNotFoundError:
        raise DataMismatch(
            f"{data}: no {MANIFEST}: not a complete `aerie ingest` output (still running, killed, or written "
            "by something else)"
        ) from None
    except ValueError as e:
        raise DataMismatch(f"{uri}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("stage") != "ingest":
        raise DataMismatch(f"{uri}: not an ingest manifest")
    return manifest


def split_uri(data: str, split: str, manifest: dict[str, Any] | None = None) -> str:
    """The folder of ``split`` (``train``, ``eval``, ``quarantine``) in the version the manifest
    names; ``DATA/<split>`` for the earlier layout or a folder without a manifest."""
    if manifest is None and storage.exists(storage.join(data, MANIFEST)):
        manifest = read_manifest(data)
    if manifest is not None and manifest.get("generation"):
        return storage.join(data, manifest["outputs"][split])
    return storage.join(data, split)


def parquet_rows(uri: str) -> int:
    """Rows in the Parquet files under ``uri`` (from their footers); 0 when there is none."""
    if not storage.exists(uri):
        return 0
    fs, path = storage.resolve(uri)
    return sum(f.count_rows() for f in pads.dataset(path, filesystem=fs, format="parquet").get_fragments())


def ingest_counts(read: int, parse_reasons: dict[str, int], duplicates: int,
                  encoded: dict[tuple[str, str, bool], int], regeneration: dict[str, Any] | None
                  ) -> tuple[dict[str, Any], set[str]]:
    """The manifest's ``counts`` from the stages' tallies: lines read, parse failures by reason,
    duplicates dropped, encoded rows by ``(status, split, has_reply)`` and the regeneration summary;
    and the template-failure reasons among the encoded statuses (their rows go to quarantine).
    Raises ``RuntimeError`` when the records do not add up (see :func:`definitions`)."""
    status: dict[str, int] = {}
    written = {"train": 0, "eval": 0}
    input_only = 0
    for (st, split, has_reply), n in encoded.items():
        status[st] = status.get(st, 0) + n
        if st == STATUS_OK:
            written[split] += n
            input_only += 0 if has_reply else n
    too_long = status.pop(STATUS_TOO_LONG, 0)
    kept = status.pop(STATUS_OK, 0)
    quarantined_by_reason = dict(parse_reasons)
    for reason, n in status.items():  # whatever is left is a template failure
        quarantined_by_reason[reason] = quarantined_by_reason.get(reason, 0) + n
    counts: dict[str, Any] = {
        "read": read,
        "parsed": kept,
        "quarantined": sum(quarantined_by_reason.values()),
        "quarantined_by_reason": dict(sorted(quarantined_by_reason.items())),
        "duplicates": duplicates,
        "too_long": too_long,
        "written": {**written, "total": written["train"] + written["eval"]},
        "input_only": input_only,
    }
    if regeneration is not None:
        counts["regenerated"] = regeneration["regenerated"]
        counts["regeneration_failed"] = regeneration["regeneration_failed"]
    if kept + counts["quarantined"] + duplicates + too_long != read or kept != counts["written"]["total"]:
        raise RuntimeError(f"ingest accounting does not add up: {counts}")
    return counts, set(status)


def check_training_data(data: str, tokenizer: Any) -> dict[str, Any]:
    """The manifest of ``data`` if training on it with ``tokenizer``'s target is sound: a complete
    ingest output, tokenized with the same vocabulary and chat template, whose Parquet holds the
    rows the manifest counts. Raises :class:`DataMismatch` naming the first mismatch."""
    manifest = read_manifest(data)
    recorded = manifest.get("tokenizer") or {}
    actual = tokenizer_facts(tokenizer)
    for key, what in (("vocab_size", "vocabulary size"), ("vocab_sha256", "vocabulary"),
                      ("chat_template_sha256", "chat template")):
        if key not in recorded:
            if key == "vocab_sha256":  # manifests before aerie-ingest/2 do not record it
                continue
            raise DataMismatch(f"{data}: the manifest does not record the tokenizer's {what} ({key})")
        if recorded[key] != actual[key]:
            raise DataMismatch(
                f"{data} was tokenized with another {what} than the target's ({key}: data {recorded[key]!r}, "
                f"target {actual[key]!r}; data from {recorded.get('name_or_path')!r}): re-ingest it with this target"
            )
    written = (manifest.get("counts") or {}).get("written") or {}
    for split in ("train", "eval"):
        if split not in written:
            raise DataMismatch(f"{data}: the manifest does not count the {split} rows (counts.written.{split})")
        found = parquet_rows(split_uri(data, split, manifest))
        if found != written[split]:
            raise DataMismatch(
                f"{data}: {split} holds {found} rows, the manifest counts {written[split]} "
                "(files added, removed or half-written after the ingest)"
            )
    return manifest


def load_tokenizer(target: str) -> Any:
    """The target's tokenizer (local or s3://, without its weights); it must have a chat template."""
    from transformers import AutoTokenizer

    local = storage.download_model_files(target)
    tok = AutoTokenizer.from_pretrained(str(local))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {target} has no chat template")
    return tok


def definitions(max_tokens: int, regenerated: bool) -> dict[str, str]:
    """What each count of the manifest means."""
    return {
        "read": "non-blank input lines, plus one per unreadable (corrupt .gz) file",
        "quarantined": "records rejected by the parser or the chat template; one row each in quarantine/",
        "duplicates": "exact duplicates of (kind, messages, reply) dropped; the first by (source, line) stays",
        "too_long": f"records whose tokens exceed max_tokens ({max_tokens})",
        "parsed": "records that came through every stage: the written ones (train + eval)",
        "input_only": "written records without a captured reply (has_reply = false, no loss tokens)",
        **({
            "regenerated": "written records whose reply the target regenerated (regenerated = true)",
            "regeneration_failed": "written records the engine failed on: captured reply kept",
        } if regenerated else {}),
    }
