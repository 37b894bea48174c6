"""The speculative decoding engine: one `step()` that admits, prefills, drafts, verifies, streams.

A fixed pool of slots shares the KV cache (`cache.py`). Each step:
1. admits waiting requests into free slots;
2. runs one target forward over every slot still prefilling (one chunk of its prompt each);
3. asks the proposer for K draft tokens per decoding slot and runs ONE target forward over all of
   them, each slot at its own positions, with a 4-D mask (`masks.py`);
4. verifies (`verify.py`), advances each slot by its own accepted count plus one, and streams.
Rejected positions are simply not counted: the next step overwrites those cache columns. On hybrid
targets (linear-attention layers, `cache.HybridSlotCache`) each forward is followed by a commit of
every row's recurrent states to the states after exactly its kept tokens; trees are refused there.

A decoding step reads the device back once: the verdict (accepted counts and emitted tokens of
every row) in one transfer. A step that raises is retried row by row, so the request that caused
the failure finishes with an error and every other request goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from aerie.engine.adaptive import AdaptivePolicy, FixedK
from aerie.engine.cache import slot_cache
from aerie.engine.detokenizer import TextStream
from aerie.engine.layout import BlockLayout, pad_rows
from aerie.engine.masks import to_additive
from aerie.engine.metrics import SpecCounters, StepStats
from aerie.engine.proposers import Draft, Proposer
from aerie.engine.request import Request, RequestOutput, SamplingParams, Status
from aerie.engine.sampling import adjusted_probs, draw_uniforms, request_settings
from aerie.engine.scheduler import Scheduler
from aerie.engine.verify import (
    tree_ancestors,
    verify_greedy,
    verify_sampled,
    verify_tree_greedy,
    verify_tree_sampled,
)
from aerie.target.model import RECURRENT_LAYER_TYPE, FeatureKind, Target, TargetOutput
from aerie.target.segmented_attention import Segment, segments_on

log = logging.getLogger(__name__)

TREE_ON_RECURRENT_TARGET = (
    "a draft tree cannot be verified on a target with linear-attention layers: their recurrent state "
    "reads the block as one sequence, so sibling nodes would leak into each other's state and logits "
    "(a tree would need one row per root-to-leaf path); draft a chain (--chain)"
)


@dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8
    max_len: int = 2048
    prefill_tokens: int = 512
    """Prompt tokens one step prefills, padding included (vLLM's max_num_batched_tokens for prompts)."""

    def __post_init__(self) -> None:
        for name in ("max_slots", "max_len", "prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    spec: SpecCounters
    error: str | None = None


class Engine:
    """`policy` chooses K every step (adaptive speculation, `adaptive.py`); without one every step
    drafts the proposer's K."""

    def __init__(
        self,
        target: Target,
        config: EngineConfig | None = None,
        proposer: Proposer | None = None,
        policy: AdaptivePolicy | FixedK | None = None,
    ) -> None:
        self.target = target
        self.policy = policy
        self.config = config or EngineConfig()
        self.proposer = proposer or Proposer()
        self.device = target.device
        self.cache = slot_cache(target, self.config.max_slots, self.config.max_len + self.proposer.max_draft_tokens)
        if self.cache.has_states and self.proposer.drafts_tree:
            raise ValueError(TREE_ON_RECURRENT_TARGET)
        self._layer_kinds = frozenset(target.layer_types or [])
        self.vocab_size = target.embed_tokens.weight.shape[0]
        self.scheduler = Scheduler(self.config.max_slots)
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, TextStream] = {}
        self._stop_ids = set(target.stop_token_ids)
        self._last_cut: tuple[tuple[int, ...], list[Segment] | None] = ((), None)
        self.spec = SpecCounters()
        self.stats = StepStats()

    # ---- requests in and out -------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; it joins the running batch at the next step with a free slot. A request
        the engine cannot serve raises ValueError naming the field, and nothing is registered."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_ids = self._prompt_ids(prompt)
        needed = len(prompt_ids) + params.max_tokens
        if needed > self.config.max_len:
            raise ValueError(
                f"max_tokens: request needs {needed} tokens (prompt {len(prompt_ids)} + max_tokens "
                f"{params.max_tokens}) but the engine's max_len is {self.config.max_len}"
            )
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        stream = TextStream(self.target.tokenizer, params.stop)
        request = Request(prompt_ids=prompt_ids, params=params)
        if request_id is not None:
            request.request_id = request_id
        self.requests[request.request_id] = request
        self._streams[request.request_id] = stream
        self.scheduler.add(request)
        return request.request_id

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.target.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a target with a tokenizer")
            prompt_ids = self.target.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ValueError("prompt: the prompt is empty")
        for index, token in enumerate(prompt_ids):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"prompt: token {token!r} at index {index} is not a token id in [0, {self.vocab_size})"
                )
        return prompt_ids

    def cancel(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its slot; returns its final (empty) output."""
        request = self.requests.get(request_id)
        if request is None or request.status is Status.FINISHED:
            return None
        self.scheduler.finish(request, "abort")
        return self._release(request, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self.scheduler.admit()
        self.stats.steps += 1
        decoding = self.scheduler.in_status(Status.DECODING)
        prefilling = self.scheduler.prefill_batch(self.config.prefill_tokens)
        if not decoding and self.policy is not None:
            self.policy.lull()
        outputs: list[RequestOutput] = []
        if prefilling:
            outputs += self._isolated(partial(self._prefill, tokens=prefilling), list(prefilling))
        if decoding:
            outputs += self._isolated(self._decode, decoding)
        return outputs

    def _isolated(
        self, run: Callable[[list[Request]], list[RequestOutput]], rows: list[Request]
    ) -> list[RequestOutput]:
        """Run a batch; if it raises, run each row alone and finish the rows that still fail with
        an error. Steps change no request state before their forwards and verification succeed."""
        try:
            return run(rows)
        except Exception as error:
            if len(rows) == 1:
                log.exception("request %s failed", rows[0].request_id)
                return [self._fail(rows[0], error)]
        outputs = []
        for row in rows:
            outputs += self._isolated(run, [row])
        return outputs

    def _prefill(self, rows: list[Request], tokens: dict[Request, int]) -> list[RequestOutput]:
        """Feed each row its next `tokens[row]` prompt tokens; rows whose prompt is done get a first token."""
        blocks = [r.prompt_ids[r.prefilled : r.prefilled + tokens[r]] for r in rows]
        done = [r.prefilled + len(b) == len(r.prompt_ids) for r, b in zip(rows, blocks, strict=True)]
        width = max(map(len, blocks))
        last = torch.tensor(
            [[is_done and i == len(b) - 1 for i in range(width)] for b, is_done in zip(blocks, done, strict=True)],
            device=self.device,
        )
        for request in rows:
            if request.prefilled == 0:
                self.proposer.reset(request.slot)
                self.cache.reset(request.slot)
        out = self._forward(
            rows,
            pad_rows(blocks, width, self.device),
            [r.prefilled for r in rows],
            [len(b) for b in blocks],
            features=self.proposer.features,
            logits_at=last,
        )
        finishing = [r for r, is_done in zip(rows, done, strict=True) if is_done]
        first: list[int] = []
        if finishing:
            _, emitted = self._verify_chain(finishing, out.logits[:, None], None)
            first = emitted[:, 0].tolist()
        if self.cache.has_states:
            self.cache.commit_states([r.prefilled for r in rows], [len(b) for b in blocks])
        for row, (request, block) in enumerate(zip(rows, blocks, strict=True)):
            request.prefilled += len(block)
            if out.features is not None:
                self.proposer.observe(request.slot, out.features[row, : len(block)])
        if out.features is not None and self._head_passes_prompts(sum(map(len, blocks))):
            self.proposer.prefill(rows)
        if self.policy is not None:
            self.policy.observe_prefill(len(rows) * width)
        outputs = []
        for request, token in zip(finishing, first, strict=True):
            request.status = Status.DECODING
            outputs.append(self._append(request, [token]))
        return outputs

    def _head_passes_prompts(self, fed: int) -> bool:
        """Whether the head passes over the `fed` prompt tokens just prefilled: always without a
        policy, else while drafting or where drafting would pay at the batch the running rows make
        (the head's pass over every prompt token still to come, these included, counted in)."""
        if self.policy is None or self.policy.drafting:
            return True
        running = self.scheduler.running.values()
        return self.policy.drafts_when_caught_up(
            len(running), max(r.length for r in running), fed + self._prompt_backlog()
        )

    def _prompt_backlog(self) -> int:
        """Prompt tokens the running rows still have to prefill."""
        return sum(len(r.prompt_ids) - r.prefilled for r in self.scheduler.running.values())

    def _decode(self, rows: list[Request]) -> list[RequestOutput]:
        """Draft, verify all rows in one target forward, keep each row's accepted path + one token.
        K is the policy's for this many rows and the context attention reads per row, else the
        proposer's; the policy learns what the step took (the step ends reading the verdicts back,
        so the host clock needs no extra sync)."""
        started = time.perf_counter()
        if self.policy is None:
            k = self.proposer.k
        else:
            context = self._attended_context(rows)
            # rows that finished prefilling this step decode next: the head's lag on them counts
            catch_up = self.proposer.catch_up_width(self.scheduler.in_status(Status.DECODING))
            tokens_left = [r.params.max_tokens - len(r.output_ids) for r in rows]
            joining = len(self.scheduler.running) - len(rows)  # prefilling, or done with it this step
            k = self.policy.choose(len(rows), context, catch_up, tokens_left, joining, self._prompt_backlog())
        draft = self.proposer.propose(rows, k) if k else None
        if draft is not None and draft.parents is not None:
            outputs = self._decode_tree(rows, draft)
        else:
            outputs = self._decode_chain(rows, draft if draft is not None and draft.k else None)
        if self.policy is not None:
            self.policy.observe_time(len(rows), k, context, catch_up, time.perf_counter() - started)
        return outputs

    def _decode_chain(self, rows: list[Request], draft: Draft | None) -> list[RequestOutput]:
        last = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=self.device)
        tokens = last if draft is None else torch.cat([last, draft.tokens], dim=1)
        drafted = [0] * len(rows) if draft is None else draft.row_lengths()
        starts = [r.length - 1 for r in rows]
        out = self._forward(rows, tokens, starts, [n + 1 for n in drafted], features=self.proposer.features)
        accepted, emitted = self._verify_chain(rows, out.logits, draft)
        verdicts = torch.cat([accepted[:, None], emitted], dim=1).tolist()
        if self.cache.has_states:
            self.cache.commit_states(starts, [v[0] + 1 for v in verdicts])
        return self._commit(rows, drafted, out, [(list(range(v[0])), v[1 : v[0] + 2]) for v in verdicts])

    def _decode_tree(self, rows: list[Request], draft: Draft) -> list[RequestOutput]:
        last = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=self.device)
        starts = [r.length - 1 for r in rows]
        depths = torch.cat([torch.zeros_like(draft.depths[:, :1]), draft.depths], dim=1)
        out = self._forward(
            rows,
            torch.cat([last, draft.tokens], dim=1),
            starts,
            [draft.k + 1] * len(rows),
            features=self.proposer.features,
            depths=depths,
            block=tree_ancestors(draft.parents),
        )
        logits = out.logits.view(len(rows), draft.k + 1, -1)
        if all(r.params.temperature == 0 for r in rows):
            path, length, emitted = verify_tree_greedy(
                logits, draft.tokens, draft.parents, draft.depths, draft.max_depth
            )
            verdicts = torch.cat([length[:, None], path, emitted], dim=1).tolist()
            depth = draft.max_depth
            paths = [(v[1 : 1 + v[0]], v[1 + depth : 2 + depth + v[0]]) for v in verdicts]
        else:
            temperature, top_p = self._settings(rows)
            walks = verify_tree_sampled(
                logits, draft.tokens, draft.parents, temperature, top_p, [r.generator for r in rows]
            )
            tokens = draft.tokens.tolist()
            paths = [(path, [tokens[b][n] for n in path] + [token]) for b, (path, token) in enumerate(walks)]
            path = torch.tensor([p + [-1] * (draft.max_depth - len(p)) for p, _ in paths], device=self.device)
        self.cache.keep_columns(
            [r.slot for r in rows], starts, torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1).clamp(min=0)
        )
        return self._commit(rows, [draft.max_depth] * len(rows), out, paths)

    def _commit(
        self, rows: list[Request], drafted: list[int], out: TargetOutput, paths: list[tuple[list[int], list[int]]]
    ) -> list[RequestOutput]:
        """Record each row's verdict: (accepted draft nodes, emitted tokens) after a decode forward.
        The features of the kept positions (the last committed token, then the accepted nodes)
        go to the proposer."""
        self.stats.record_decode(max(drafted), len(rows), sum(len(tokens) for _, tokens in paths))
        if self.policy is not None:
            self.policy.observe(drafted, [len(path) for path, _ in paths])
        outputs = []
        for row, (request, proposed, (path, tokens)) in enumerate(zip(rows, drafted, paths, strict=True)):
            if proposed:
                request.spec.record(proposed, len(path))
                self.spec.record(proposed, len(path))
            if out.features is not None:
                kept = [0] + [node + 1 for node in path]
                features = out.features[row, : len(kept)] if kept[-1] == len(path) else out.features[row, kept]
                self.proposer.observe(request.slot, features)
            outputs.append(self._append(request, tokens))
        return outputs

    def _settings(self, rows: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        return request_settings([r.params.temperature for r in rows], [r.params.top_p for r in rows], self.device)

    def _verify_chain(
        self, rows: list[Request], logits: torch.Tensor, draft: Draft | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` [B, K+1, V] -> (accepted drafts [B], emitted tokens [B, K+1])."""
        drafts = draft.tokens if draft is not None else logits.new_zeros(len(rows), 0, dtype=torch.long)
        lengths = None
        if draft is not None and draft.lengths is not None:
            lengths = torch.tensor(draft.lengths, device=self.device)
        if all(r.params.temperature == 0 for r in rows):
            return verify_greedy(logits, drafts, lengths)
        temperature, top_p = self._settings(rows)
        probs = adjusted_probs(logits, temperature[:, None], top_p[:, None])
        uniforms = draw_uniforms([r.generator for r in rows], drafts.shape[1] + 1, self.device)
        return verify_sampled(probs, drafts, None if draft is None else draft.probs, uniforms, lengths)

    def _forward(
        self,
        rows: list[Request],
        input_ids: torch.Tensor,
        starts: list[int],
        lengths: list[int],
        features: FeatureKind | None = None,
        logits_at: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
    ) -> TargetOutput:
        """One target forward: row b appends its first `lengths[b]` of `input_ids` [B, W] after its
        `starts[b]` cached tokens (a chain, or a tree with node `depths` and ancestor `block` mask)."""
        layout = BlockLayout.build(starts, lengths, self.cache.scratch, self.device, depths=depths, block=block)
        self.cache.bind(
            [r.slot for r in rows],
            layout.write_pos,
            layout.kv_len,
            segments=self._segments(starts, lengths),
            by_runs=self.target.segmented_attention,
        )
        return self.target.forward(
            input_ids,
            layout.positions,
            self._attention_mask(layout),
            self.cache,
            logits_at=logits_at,
            features=features,
            segments=self.cache.segments,
        )

    def _segments(self, starts: list[int], lengths: list[int]) -> list[Segment] | None:
        if not self.target.segmented_attention:
            return None
        kv_lens = tuple(p + n for p, n in zip(starts, lengths, strict=True))
        if kv_lens != self._last_cut[0]:  # a plain step after the policy's look: cut once
            self._last_cut = (kv_lens, segments_on(self.device, kv_lens))
        return self._last_cut[1]

    def _attended_context(self, rows: list[Request]) -> int:
        """Columns a decode step's attention reads per row: the longest row's for one call over
        the batch; with attention cut into runs of rows, each run reads its own longest. (The
        calibration's rows are all equally long, where both are the same.)"""
        lengths = [r.length for r in rows]
        runs = self._segments([n - 1 for n in lengths], [1] * len(rows))
        if runs is None:
            return max(lengths)
        return round(sum((end - start) * columns for start, end, columns in runs) / len(rows))

    def _attention_mask(self, layout: BlockLayout) -> torch.Tensor | dict[str, torch.Tensor]:
        """The mask the target's attention expects: boolean for SDPA, additive for eager; one per
        layer type when the architecture mixes full and sliding-window or linear-attention layers
        (linear attention takes none: padding sits after a row's real tokens, and the states after
        a row's real tokens are what the cache commits)."""

        def prepared(window: int | None) -> torch.Tensor:
            mask = layout.mask(window)
            return to_additive(mask, self.target.dtype) if self.target.uses_eager_mask else mask

        if not self._layer_kinds & {"sliding_attention", RECURRENT_LAYER_TYPE}:
            return prepared(None)
        masks: dict[str, torch.Tensor | None] = {"full_attention": prepared(None)}
        if "sliding_attention" in self._layer_kinds:
            masks["sliding_attention"] = prepared(self.target.sliding_window)
        if RECURRENT_LAYER_TYPE in self._layer_kinds:
            masks[RECURRENT_LAYER_TYPE] = None
        return masks

    # ---- bookkeeping ---------------------------------------------------------------------

    def _append(self, request: Request, tokens: list[int]) -> RequestOutput:
        """Add accepted tokens to a request, cut at its stop conditions, and stream the delta."""
        params = request.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._stop_ids)
        reason = None
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            if token in stop_ids:
                reason = "stop"
                break
            if len(request.output_ids) + len(kept) >= params.max_tokens:
                reason = "length"
                break
        request.output_ids += kept
        new_text, hit_stop_string = self._streams[request.request_id].update(
            request.output_ids, final=reason is not None
        )
        if hit_stop_string:
            reason = "stop"
        if reason is None:
            return RequestOutput(request.request_id, kept, new_text, finished=False)
        self.scheduler.finish(request, reason)
        return self._release(request, kept, new_text)

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """Finish a request whose step raised; its slot is freed for the next one."""
        self.scheduler.finish(request, "error")
        output = self._release(request, [], "")
        output.error = f"{type(error).__name__}: {error}"
        return output

    def _release(self, request: Request, tokens: list[int], new_text: str) -> RequestOutput:
        """A finished request leaves the engine: its final output is all that remains of it."""
        del self._streams[request.request_id]
        del self.requests[request.request_id]
        return RequestOutput(request.request_id, tokens, new_text, finished=True, finish_reason=request.finish_reason)

    # ---- convenience -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion through continuous batching; results in prompt order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        requests: list[Request] = []
        texts: dict[str, str] = {}
        errors: dict[str, str] = {}
        try:
            for prompt, sampling in zip(prompts, params, strict=True):
                requests.append(self.requests[self.add_request(prompt, sampling)])
                texts[requests[-1].request_id] = ""
            pending = set(texts)
            while pending:
                for output in self.step():
                    if output.request_id in texts:
                        texts[output.request_id] += output.new_text
                    if output.error is not None:
                        errors[output.request_id] = output.error
                    if output.finished:
                        pending.discard(output.request_id)
        except BaseException:
            for request in requests:
                self.cancel(request.request_id)
            raise
        return [
            Completion(
                request_id=request.request_id,
                prompt_ids=request.prompt_ids,
                token_ids=request.output_ids,
                text=texts[request.request_id],
                finish_reason=request.finish_reason or "",
                spec=request.spec,
                error=errors.get(request.request_id),
            )
            for request in requests
        ]
