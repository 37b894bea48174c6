"""The speculative decoding engine: one `step()` that admits, prefills, drafts, verifies, streams.

A fixed pool of slots shares the KV cache (`cache.py`). Each step:
1. admits waiting requests into free slots;
2. runs one target forward over every slot still prefilling (one chunk of its prompt each);
3. asks the proposer for K draft tokens per decoding slot and runs ONE target forward over all of
   them, each slot at its own positions, with a 4-D mask (`masks.py`);
4. verifies (`verify.py`), advances each slot by its own accepted count plus one, and streams.
Rejected positions are simply not counted: the next step overwrites those cache columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from aerie.engine.cache import SlotKVCache
from aerie.engine.detokenizer import TextStream
from aerie.engine.layout import BlockLayout, pad_rows
from aerie.engine.masks import to_additive
from aerie.engine.metrics import SpecCounters, StepStats
from aerie.engine.proposers import Draft, NoProposer
from aerie.engine.request import Request, RequestOutput, SamplingParams, Status
from aerie.engine.sampling import adjusted_probs, draw_uniforms
from aerie.engine.scheduler import Scheduler
from aerie.engine.verify import tree_ancestors, verify_greedy, verify_sampled, verify_tree
from aerie.target.model import FeatureKind, Target, TargetOutput


@dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8
    max_len: int = 2048
    prefill_chunk: int = 512

    def __post_init__(self) -> None:
        for name in ("max_slots", "max_len", "prefill_chunk"):
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


class Engine:
    def __init__(self, target: Target, config: EngineConfig | None = None, proposer=None) -> None:
        self.target = target
        self.config = config or EngineConfig()
        self.proposer = proposer or NoProposer()
        self.cache = SlotKVCache.for_config(
            target.config,
            slots=self.config.max_slots,
            capacity=self.config.max_len + self.proposer.max_draft_tokens,
            dtype=target.dtype,
            device=target.device,
        )
        self.scheduler = Scheduler(self.config.max_slots)
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, TextStream] = {}
        self._stop_ids = set(target.stop_token_ids)
        self.spec = SpecCounters()
        self.stats = StepStats()

    # ---- requests in and out -------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; it joins the running batch at the next step with a free slot."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.target.tokenizer is None:
                raise ValueError("a text prompt needs a target with a tokenizer")
            prompt = self.target.tokenizer.encode(prompt, add_special_tokens=False)
        prompt_ids = list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        needed = len(prompt_ids) + params.max_tokens
        if needed > self.config.max_len:
            raise ValueError(
                f"request needs {needed} tokens (prompt {len(prompt_ids)} + max_tokens {params.max_tokens}) "
                f"but the engine's max_len is {self.config.max_len}"
            )
        request = Request(prompt_ids=prompt_ids, params=params)
        if request_id is not None:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            request.request_id = request_id
        self.requests[request.request_id] = request
        self._streams[request.request_id] = TextStream(self.target.tokenizer, params.stop)
        self.scheduler.add(request)
        return request.request_id

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
        outputs: list[RequestOutput] = []
        prefilling = self.scheduler.in_status(Status.PREFILLING)
        if prefilling:
            outputs += self._prefill(prefilling)
        if decoding:
            outputs += self._decode(decoding)
        return outputs

    def _prefill(self, rows: list[Request]) -> list[RequestOutput]:
        """Feed each row the next chunk of its prompt; rows whose prompt is done get a first token."""
        chunk = self.config.prefill_chunk
        blocks = [r.prompt_ids[r.prefilled : r.prefilled + chunk] for r in rows]
        starts = [r.prefilled for r in rows]
        last = torch.zeros(len(rows), max(map(len, blocks)), dtype=torch.bool)
        done = [r.prefilled + len(b) == len(r.prompt_ids) for r, b in zip(rows, blocks, strict=True)]
        for i, (block, is_done) in enumerate(zip(blocks, done, strict=True)):
            last[i, len(block) - 1] = is_done
        for request in rows:
            if request.prefilled == 0:
                self.proposer.reset(request.slot)
        out = self._forward(
            rows, blocks, starts, logits_at=last.to(self.target.device), features=self.proposer.features
        )
        for row, (request, block) in enumerate(zip(rows, blocks, strict=True)):
            request.prefilled += len(block)
            if out.features is not None:
                self.proposer.observe(request.slot, out.features[row, : len(block)])
        finishing = [r for r, is_done in zip(rows, done, strict=True) if is_done]
        if not finishing:
            return []
        _, first = self._verify(finishing, out.logits[:, None], self._empty_draft(len(finishing)))
        outputs = []
        for request, token in zip(finishing, first.tolist(), strict=True):
            request.status = Status.DECODING
            outputs.append(self._append(request, [token]))
        return outputs

    def _decode(self, rows: list[Request]) -> list[RequestOutput]:
        """Draft, verify all rows in one target forward, keep each row's accepted path + one token."""
        device = self.target.device
        draft: Draft = self.proposer.propose(rows)
        draft.tokens = draft.tokens.to(device)
        blocks = [[r.all_ids[-1], *tokens] for r, tokens in zip(rows, draft.tokens.tolist(), strict=True)]
        starts = [r.length - 1 for r in rows]
        features = self.proposer.features
        if draft.parents is None:
            out = self._forward(rows, blocks, starts, logits_at=None, features=features)
            accepted, bonus = self._verify(rows, out.logits.view(len(rows), draft.k + 1, -1), draft)
            verdicts = [(list(range(n)), token) for n, token in zip(accepted.tolist(), bonus.tolist(), strict=True)]
            depth = draft.k
        else:
            parents = draft.parents.to(device)
            depths = torch.cat([torch.zeros_like(draft.depths[:, :1]), draft.depths], dim=1).to(device)
            out = self._forward(
                rows, blocks, starts, None, features, depths=depths, block=tree_ancestors(parents)
            )
            verdicts = verify_tree(
                out.logits.view(len(rows), draft.k + 1, -1),
                draft.tokens,
                parents,
                [r.params.temperature for r in rows],
                [r.params.top_p for r in rows],
                [r.generator for r in rows],
            )
            depth = int(draft.depths.max())
        self.stats.record_decode(draft.k, len(rows), sum(len(path) + 1 for path, _ in verdicts))
        outputs = []
        for row, (request, block, start, (path, token)) in enumerate(zip(rows, blocks, starts, verdicts, strict=True)):
            kept_columns = [0] + [node + 1 for node in path]
            if kept_columns != list(range(len(kept_columns))):
                self.cache.copy_columns(
                    request.slot,
                    src=torch.tensor(kept_columns, device=device) + start,
                    dst=torch.arange(len(kept_columns), device=device) + start,
                )
            if depth:
                request.spec.record(depth, len(path))
                self.spec.record(depth, len(path))
            if out.features is not None:
                self.proposer.observe(request.slot, out.features[row, kept_columns])
            outputs.append(self._append(request, [block[c] for c in kept_columns[1:]] + [token]))
        return outputs

    def _empty_draft(self, batch: int) -> Draft:
        return Draft(tokens=torch.zeros(batch, 0, dtype=torch.long, device=self.target.device))

    def _verify(self, rows: list[Request], logits: torch.Tensor, draft: Draft) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` [B, K+1, V] -> (accepted drafts [B], next token [B])."""
        if all(r.params.temperature == 0 for r in rows):
            return verify_greedy(logits, draft.tokens)
        temperature = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device)
        probs = adjusted_probs(logits, temperature[:, None], top_p[:, None])
        uniforms = draw_uniforms([r.generator for r in rows], draft.k + 1).to(logits.device)
        return verify_sampled(probs, draft.tokens, draft.probs, uniforms)

    def _forward(
        self,
        rows: list[Request],
        blocks: list[list[int]],
        starts: list[int],
        logits_at: torch.Tensor | None,
        features: FeatureKind | None = None,
        depths: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
    ) -> TargetOutput:
        """One target forward: row b appends `blocks[b]` after its `starts[b]` cached tokens
        (a chain, or a tree with node `depths` and ancestor `block` mask)."""
        device = self.target.device
        layout = BlockLayout.build(
            starts, [len(b) for b in blocks], self.cache.scratch, device, depths=depths, block=block
        )
        input_ids = pad_rows(blocks, layout.valid.shape[1], device)
        self.cache.bind([r.slot for r in rows], layout.write_pos, layout.kv_len)
        return self.target.forward(
            input_ids,
            layout.positions,
            self._attention_mask(layout),
            self.cache,
            logits_at=logits_at,
            features=features,
        )

    def _attention_mask(self, layout: BlockLayout) -> torch.Tensor | dict[str, torch.Tensor]:
        """The mask the target's attention expects: boolean for SDPA, additive for eager; one per
        layer type when the architecture mixes full and sliding-window layers."""

        def prepared(window: int | None) -> torch.Tensor:
            mask = layout.mask(window)
            return to_additive(mask, self.target.dtype) if self.target.uses_eager_mask else mask

        layer_types = self.target.layer_types or []
        if "sliding_attention" not in layer_types:
            return prepared(None)
        return {"full_attention": prepared(None), "sliding_attention": prepared(self.target.sliding_window)}

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
        try:
            for prompt, sampling in zip(prompts, params, strict=True):
                requests.append(self.requests[self.add_request(prompt, sampling)])
                texts[requests[-1].request_id] = ""
            pending = set(texts)
            while pending:
                for output in self.step():
                    if output.request_id in texts:
                        texts[output.request_id] += output.new_text
                    if output.finished:
                        pending.discard(output.request_id)
        except BaseException:
            for request in requests:
                self.cancel(request.request_id)
            raise
        results = []
        for request in requests:
            results.append(
                Completion(
                    request_id=request.request_id,
                    prompt_ids=request.prompt_ids,
                    token_ids=request.output_ids,
                    text=texts[request.request_id],
                    finish_reason=request.finish_reason or "",
                    spec=request.spec,
                )
            )
        return results
