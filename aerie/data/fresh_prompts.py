"""The held-out slice of fresh traffic: eval-split rows an endpoint captured since a given time.

Continuous optimization benchmarks a new head against the serving one on prompts the live
endpoint saw after it was deployed and that no head trained on (the eval split of the new
ingest). A row's ``source`` is the capture file it came from, whose path carries the hour
(``.../yyyy/mm/dd/hh/<uuid>.jsonl``).
"""

from __future__ import annotations

import os
from datetime import datetime

import pyarrow.dataset as pads

from aerie import storage
from aerie.data.ingest_output import split_uri
from aerie.sagemaker import hour_of


def _normalised(uri: str) -> str:
    return uri.rstrip("/") if storage.is_s3(uri) else os.path.abspath(uri)


def captured_eval_prompts(data: str, capture: str, since: datetime) -> list[list[dict[str, str]]]:
    """The chat prompts (messages without the final reply) of the eval rows of ingest output
    `data` that came from files under `capture` in the hour of `since` or later."""
    folder = split_uri(data, "eval")
    if not storage.exists(folder):
        return []
    root = _normalised(capture)
    first_hour = since.replace(minute=0, second=0, microsecond=0)
    fs, path = storage.resolve(folder)
    table = pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=["source", "messages"])
    prompts = []
    for source, messages in zip(table["source"].to_pylist(), table["messages"].to_pylist(), strict=True):
        hour = hour_of(source)
        if hour is None or hour < first_hour or not _normalised(source).startswith(root + "/"):
            continue
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if messages:
            prompts.append([{"role": m["role"], "content": m["content"]} for m in messages])
    return prompts
