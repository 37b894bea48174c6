"""Adaptive speculation: the engine picks K (0 = off) every step from live load and live acceptance.

For the rows decoding this step, the predicted goodput of drafting K tokens is

    G(K) = rows x E(K) / (t_verify(rows, tokens(K)) + t_draft(rows, K)),
    E(K) = 1 + m x sum_{i<=K} prod_{j<=i} a_j,

with a_j the acceptance of draft position j given j-1 accepted, and m the share of rows that draft
at all (1 for heads; prompt lookup drafts only where it finds a match). Costs come from a short
calibration when the engine starts (`calibrate`: real target forwards and real proposals over a
grid of batch sizes and draft lengths, cached per target, head and device); acceptance from
exponentially decayed live counters, seeded with the head's own evaluation when its file has one.

K = 0 unless the best K's predicted gain beats K = 0 by `margin`; the current K is kept unless
another beats it by `hysteresis`, so a constant load does not flip K every step. K = 0 is the
baseline's own step (the target forward and verification of `none`; the only extra is keeping the
target features the head will need when speculation resumes). While K = 0 wins, one step in
`probe_every` drafts anyway so the acceptance estimate cannot go stale, as long as drafting could
pay at that load at all (a perfect draft beating K = 0): otherwise K = 0 costs what `none` costs.
K is chosen for the whole batch (per-request K would split the verify forward's shape and save
little: rows that accept little cost little extra in a batched verify).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from aerie.engine.request import Request, SamplingParams

if TYPE_CHECKING:
    from aerie.engine.engine import Engine


@dataclass
class Acceptance:
    """Decayed counts of how far drafts get. `reached[i]`: drafts that offered position i+1 with
    every earlier position accepted; `accepted[i]`: of those, the ones whose position i+1 was
    accepted. `offered` / `drafted`: rows asked for a draft / rows that produced one."""

    depth: int
    decay: float = 0.995
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    offered: float = 0.0
    drafted: float = 0.0

    @classmethod
    def seeded(cls, depth: int, chain_rates: list[float], weight: float = 20.0) -> Acceptance:
        """A prior worth `weight` drafts: `chain_rates[i]` is the share of drafts with positions
        1..i+1 all accepted (a head's evaluation `chain_d`), else 0.5 per position."""
        rates = list(chain_rates[:depth]) + [0.5 ** (i + 1) for i in range(len(chain_rates), depth)]
        reached = [weight] + [weight * r for r in rates[:-1]]
        return cls(depth, reached=reached, accepted=[weight * r for r in rates], offered=weight, drafted=weight)

    def update(self, drafted: list[int], accepted: list[int]) -> None:
        """One step: per row, the draft length it was given (0: no draft) and its accepted count."""
        keep = self.decay ** len(drafted)
        self.reached = [c * keep for c in self.reached]
        self.accepted = [c * keep for c in self.accepted]
        self.offered = self.offered * keep + len(drafted)
        self.drafted = self.drafted * keep + sum(1 for n in drafted if n)
        for n, a in zip(drafted, accepted, strict=True):
            for position in range(min(n, a + 1)):
                self.reached[position] += 1
                self.accepted[position] += position < a

    def expected_tokens(self, k: int) -> float:
        """E(K): mean tokens a row gains from one step that drafts K."""
        match = self.drafted / self.offered if self.offered else 1.0
        total, chain = 1.0, 1.0
        for position in range(min(k, self.depth)):
            chain *= self.accepted[position] / self.reached[position] if self.reached[position] else 0.0
            total += match * chain
        return total


@dataclass
class StepCosts:
    """Seconds of one decoding step's target forward (`verify[(rows, tokens per row)]`) and draft
    (`draft[(rows, K)]`), measured at a grid of batch sizes; linear in rows between grid points."""

    rows: list[int]
    verify: dict[tuple[int, int], float]
    draft: dict[tuple[int, int], float]

    def _at(self, table: dict[tuple[int, int], float], rows: int, key: int) -> float:
        grid = self.rows
        if rows <= grid[0]:
            return table[grid[0], key]
        for low, high in zip(grid, grid[1:], strict=False):
            if rows <= high:
                share = (rows - low) / (high - low)
                return table[low, key] * (1 - share) + table[high, key] * share
        return table[grid[-1], key] * rows / grid[-1]

    def step(self, rows: int, k: int, tokens: int) -> float:
        return self._at(self.verify, rows, tokens) + (self._at(self.draft, rows, k) if k else 0.0)

    def to_json(self) -> dict:
        return {"rows": self.rows, "verify": [[*k, v] for k, v in self.verify.items()],
                "draft": [[*k, v] for k, v in self.draft.items()]}

    @classmethod
    def from_json(cls, data: dict) -> StepCosts:
        return cls(data["rows"], {(a, b): v for a, b, v in data["verify"]}, {(a, b): v for a, b, v in data["draft"]})


class AdaptivePolicy:
    def __init__(
        self,
        depths: list[int],
        tokens_for: dict[int, int],
        costs: StepCosts,
        acceptance: Acceptance,
        margin: float = 0.03,
        hysteresis: float = 0.02,
        probe_every: int = 32,
    ) -> None:
        self.depths = depths
        self.tokens_for = tokens_for
        self.costs = costs
        self.acceptance = acceptance
        self.margin = margin
        self.hysteresis = hysteresis
        self.probe_every = probe_every
        self.current = 0
        self.calibration_seconds = 0.0
        self._off_steps = 0

    def goodput(self, rows: int, k: int) -> float:
        """Predicted tokens per second of a step drafting `k` for `rows` decoding rows."""
        return rows * self.acceptance.expected_tokens(k) / self.costs.step(rows, k, self.tokens_for[k])

    def choose(self, rows: int) -> int:
        scores = {k: self.goodput(rows, k) for k in [0, *self.depths]}
        best = max(self.depths, key=scores.__getitem__)
        if scores[best] < scores[0] * (1 + self.margin):
            best = 0
        if best != self.current and scores[best] < scores[self.current] * (1 + self.hysteresis):
            best = self.current
        self.current = best
        if best == 0:
            self._off_steps += 1
            if self._off_steps % self.probe_every == 0 and self.could_pay(rows):
                return max(self.depths, key=scores.__getitem__)
        else:
            self._off_steps = 0
        return best

    def could_pay(self, rows: int) -> bool:
        """Whether drafting could beat K = 0 at this load even if every draft token were accepted.
        Where it could not (e.g. verification too dear at a high batch size), probing only costs:
        a probe's head catch-up over every token since the last draft is the dearest step there is."""
        baseline = rows / self.costs.step(rows, 0, self.tokens_for[0])
        return any(
            rows * (1 + k) / self.costs.step(rows, k, self.tokens_for[k]) > baseline * (1 + self.margin)
            for k in self.depths
        )

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        if any(drafted):
            self.acceptance.update(drafted, accepted)


# ---- calibration ----------------------------------------------------------------------------------



def _timed(engine: Engine, run, repeats: int = 3) -> float:
    """Fastest wall time of `run()` over `repeats` (after one warm-up), synchronised on
    accelerators: on a shared machine the minimum is the cost, the rest is waiting."""

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def _dummy_rows(count: int, context: int) -> list[Request]:
    rows = []
    for slot in range(count):
        request = Request(prompt_ids=[1] * context, params=SamplingParams(max_tokens=1), output_ids=[1])
        request.slot = slot
        rows.append(request)
    return rows


@torch.inference_mode()
def measure_costs(engine: Engine, depths: list[int], tokens_for: dict[int, int]) -> StepCosts:
    """Time the real target forward and the real proposer at each grid point. Runs on an idle
    engine (no request holds a slot): dummy rows use slots 0..rows-1 and leave nothing behind.
    Drafting costs are measured at the shortest, middle and longest K and interpolated between
    (every proposer's cost grows step by step with K); both tables are made non-decreasing in
    tokens and K, so one noisy measurement cannot make more work look cheaper."""
    slots = engine.config.max_slots
    context = max(2, min(64, engine.config.max_len - 12))  # committed tokens per dummy row
    grid = sorted({1, slots} | {2**i for i in range(1, slots.bit_length()) if 2**i < slots})
    proposer, features = engine.proposer, engine.proposer.features
    verify, draft = {}, {}
    for rows in grid:
        requests = _dummy_rows(rows, context)
        starts = [context] * rows
        prefill = engine._forward(
            requests,
            torch.ones(rows, context, dtype=torch.long, device=engine.device),
            [0] * rows,
            [context] * rows,
            features=features,
        )
        for tokens in sorted(set(tokens_for.values())):
            ids = torch.ones(rows, tokens, dtype=torch.long, device=engine.device)

            def forward(ids=ids, tokens=tokens, requests=requests, starts=starts, rows=rows):
                out = engine._forward(requests, ids, starts, [tokens] * rows, features=features)
                out.logits.argmax(-1).tolist()

            verify[rows, tokens] = _timed(engine, forward)
        timed_depths = sorted({depths[0], depths[len(depths) // 2], depths[-1]})
        for k in timed_depths:
            for request in requests:
                request.output_ids = [1]
                proposer.reset(request.slot)
                proposer.observe(request.slot, prefill.features[request.slot] if features else None)

            def propose(k=k, requests=requests, prefill=prefill):
                proposer.propose(requests, k).tokens.tolist()
                for request in requests:  # one draft accepted + the bonus: the head catches up on 2
                    request.output_ids += [1, 1]
                    if features:
                        proposer.observe(request.slot, prefill.features[request.slot, :2])

            draft[rows, k] = _timed(engine, propose)
        for request in requests:
            proposer.reset(request.slot)
        _fill_between(draft, rows, depths, timed_depths)
        _non_decreasing(verify, rows, sorted(set(tokens_for.values())))
        _non_decreasing(draft, rows, depths)
    return StepCosts(grid, verify, draft)


def _fill_between(table: dict[tuple[int, int], float], rows: int, keys: list[int], known: list[int]) -> None:
    """Linear interpolation of `table[rows, k]` for the keys between the `known` ones."""
    for low, high in zip(known, known[1:], strict=False):
        for k in keys:
            if low < k < high:
                share = (k - low) / (high - low)
                table[rows, k] = table[rows, low] * (1 - share) + table[rows, high] * share


def _non_decreasing(table: dict[tuple[int, int], float], rows: int, keys: list[int]) -> None:
    for previous, k in zip(keys, keys[1:], strict=False):
        table[rows, k] = max(table[rows, k], table[rows, previous])


def _cache_key(engine: Engine, depths: list[int], tokens_for: dict[int, int]) -> str:
    proposer = engine.proposer
    head = getattr(proposer, "head", None)
    parts = {
        "target": engine.target.config.to_json_string(use_diff=False),
        "head": None if head is None else head.config.model_dump_json(),
        "proposer": type(proposer).__name__,
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else engine.device.type,
        "dtype": str(engine.target.dtype),
        "slots": engine.config.max_slots,
        "depths": depths,
        "tokens": sorted(tokens_for.items()),
        "threads": torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def calibrate(engine: Engine, depths: list[int], tokens_for: dict[int, int], cache: bool = True) -> StepCosts:
    """`measure_costs`, cached under the storage cache directory per target, head, device, dtype,
    slots and thread count."""
    from aerie.storage import cache_dir

    path = cache_dir() / "calibration" / f"{_cache_key(engine, depths, tokens_for)}.json"
    if cache and path.is_file():
        return StepCosts.from_json(json.loads(path.read_text()))
    costs = measure_costs(engine, depths, tokens_for)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs.to_json()))
    return costs


def adaptive_policy(engine: Engine, cache: bool = True, **options) -> AdaptivePolicy:
    """The policy for an engine whose proposer drafts up to `proposer.k` tokens (a tree: depth)."""
    proposer = engine.proposer
    depths = list(range(1, proposer.k + 1))
    tree_size = getattr(proposer, "tree_size", None)
    tokens_for = {0: 1} | {k: 1 + (tree_size(k) if tree_size else k) for k in depths}
    started = time.perf_counter()
    costs = calibrate(engine, depths, tokens_for, cache)
    head = getattr(proposer, "head", None)
    metrics = getattr(head, "eval_metrics", None) or {}
    chain = [metrics[f"chain_{d}"] for d in depths if f"chain_{d}" in metrics]
    policy = AdaptivePolicy(depths, tokens_for, costs, Acceptance.seeded(proposer.k, chain), **options)
    policy.calibration_seconds = time.perf_counter() - started
    return policy
