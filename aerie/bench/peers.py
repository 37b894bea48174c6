"""Peers: what a user already has. Hugging Face `generate`, greedy, and its assisted generation
with prompt lookup (`prompt_lookup_num_tokens`), one request at a time (concurrency 1), each
streamed through a `BaseStreamer` that timestamps every chunk, so TTFT / TPOT / ITL mean the same
as for the engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from aerie.bench.load import CellRun, RequestRecord, measured_prompts, warmup_prompts
from aerie.target import Target

LOOKUP = "hf_prompt_lookup"


class TimedStreamer(BaseStreamer):
    """Records (arrival time, tokens) of every chunk `generate` streams; the first put is the prompt."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        tokens = value.reshape(-1).tolist()
        if tokens:
            self.record.chunks.append((now, len(tokens)))
            self.record.token_ids += tokens

    def end(self) -> None:
        self.record.finished = time.perf_counter()


@torch.inference_mode()
def hf_request(target: Target, prompts: Sequence[Sequence[int]], index: int, max_tokens: int,
               lookup_tokens: int | None, ignore_eos: bool, measured: bool) -> RequestRecord:
    model, stop = target.model, target.stop_token_ids
    ids = torch.tensor([list(prompts[index])], dtype=torch.long, device=target.device)
    record = RequestRecord(index, ids.shape[1], time.perf_counter(), measured=measured)
    extra = {"prompt_lookup_num_tokens": lookup_tokens} if lookup_tokens else {}
    eos = None if ignore_eos or not stop else stop
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
        eos_token_id=eos, pad_token_id=stop[0] if stop else 0, streamer=TimedStreamer(record), **extra,
    )
    return record


def run_peer_cell(target: Target, method: str, prompts: Sequence[Sequence[int]], requests: int, warmup: int,
                  max_tokens: int, lookup_tokens: int, ignore_eos: bool,
                  on_done: Callable[[RequestRecord], None] | None = None, offset: int = 0) -> CellRun:
    """Warm-up then measured requests, one after another, with the engine cells' prompt order."""
    n = len(prompts)
    lookup = lookup_tokens if method == LOOKUP else None
    warm = [hf_request(target, prompts, i, max_tokens, lookup, ignore_eos, False) for i in warmup_prompts(n, warmup)]
    start = time.perf_counter()
    records = []
    for i in measured_prompts(n, requests, offset):
        records.append(hf_request(target, prompts, i, max_tokens, lookup, ignore_eos, True))
        if on_done is not None:
            on_done(records[-1])
    return CellRun(warm + records, time.perf_counter() - start)
