"""Adaptive speculation: the engine picks K (0 = off) every step from live load and live acceptance.

For the rows decoding this step, the predicted goodput of drafting K tokens is

    G(K) = rows x E(K) / t_step(rows, context, K),
    E(K) = 1 + m x sum_{i<=K} prod_{j<=i} a_j,

with a_j the acceptance of draft position j given j-1 accepted, and m the share of rows that draft
at all (1 for heads; prompt lookup drafts only where it finds a match). t_step is the wall time of
a WHOLE engine step (draft, target forward, verification, bookkeeping: at low load the step's fixed
overhead is what speculation amortises, so leaving it out undervalues drafting), measured by a short
calibration when the engine starts (`calibrate`: real engine steps over a grid of batch sizes, draft
lengths and two context lengths, cached per target, head and device); acceptance comes from
exponentially decayed live counters, seeded with the head's own evaluation when its file has one.
Drafting first needs the head caught up on every token it has not seen (every token since
speculation went off, a new row's whole prompt unless the head passed over it as it was prefilled,
which it does while off too where drafting would pay with the head caught up); calibration prices
that per row and column, and live switches refine it, so turning speculation on must pay the
catch-up back within `horizon` steps.
Calibration runs on an idle engine; under real load (an HTTP server's threads, a busy host) steps
cost more, and not by the same factor for every K, so each prediction is scaled by what live steps
of that kind (K = 0, drafting) cost against their calibration at that batch size (`LiveCosts`).

K = 0 unless the best K's predicted gain beats K = 0 by `margin`; the current K is kept unless
another beats it by `hysteresis`, so a constant load does not flip K every step, and drafting is
turned off only when K = 0 beats it by `off_hysteresis` (turning it back on costs a catch-up on
every row prefilled meanwhile: flipping at a marginal load costs more than either choice). K = 0
is the baseline's own step (the target forward and verification of `none`; the only extra is keeping the
target features the head will need when speculation resumes). While K = 0 wins, a probe drafts
anyway now and then so the acceptance estimate cannot go stale: after `probe_every` steps off, and,
once `confident_drafts` live drafts outweigh the seed, twice as long after each probe that did not
turn speculation back on (up to `max_probe_every`); only where drafting could pay at that load at
all (a perfect draft beating K = 0), and only once the probe's predicted extra cost, its catch-up
included, is at most `probe_budget` of the time spent off since the last one (at a high batch size
the head is far behind on every row, and a probe there is the dearest step there is). Otherwise
K = 0 costs what `none` costs. K is chosen for the whole batch (per-request K would split the
verify forward's shape and save little: rows that accept little cost little extra in a batched
verify).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from aerie.engine.metrics import SpecCounters, StepStats
from aerie.engine.request import SamplingParams, Status

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
    observed: int = 0

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
        rows_drafted = sum(1 for n in drafted if n)
        self.drafted = self.drafted * keep + rows_drafted
        self.observed += rows_drafted
        for n, a in zip(drafted, accepted, strict=True):
            for position in range(min(n, a + 1)):
                self.reached[position] += 1
                self.accepted[position] += position < a

    def expected_tokens(self, k: int) -> float:
        """E(K): mean tokens a row gains from one step that drafts K."""
        return self.gains(k)[-1]

    def gains(self, k: int) -> list[float]:
        """[E(0), E(1), ..., E(K)]: a row with room for only n more tokens gains E(min(K, n - 1))
        (its draft past the room is verified and thrown away)."""
        match = self.drafted / self.offered if self.offered else 1.0
        totals, chain = [1.0], 1.0
        for position in range(min(k, self.depth)):
            chain *= self.accepted[position] / self.reached[position] if self.reached[position] else 0.0
            totals.append(totals[-1] + match * chain)
        return totals


@dataclass(frozen=True)
class Room:
    """The decoding rows' room before their max_tokens: rows by room, capped at `depth` + 1 (no
    draft of the policy's is cut short past it), and the mean room."""

    rows: dict[int, int]
    mean: float

    @classmethod
    def of(cls, tokens_left: Sequence[int], depth: int) -> Room | None:
        if not tokens_left:
            return None
        return cls(Counter(max(1, min(left, depth + 1)) for left in tokens_left), statistics.fmean(tokens_left))

    def tokens(self, gains: list[float]) -> float:
        """The mean of `gains[K]` over the rows, where a row with room for n more tokens gains
        `gains[min(K, n - 1)]` (its draft past the room is verified and thrown away)."""
        total = sum(self.rows.values())
        return sum(count * gains[min(len(gains), room) - 1] for room, count in self.rows.items()) / total


@dataclass
class StepCosts:
    """Seconds of one whole decoding step drafting K for `rows` decoding rows of `context` tokens
    each (`seconds[rows, context, K]`), measured at a grid of batch sizes and context lengths: linear
    in rows and in context between grid points, proportional to rows past the grid, linear in
    context past it (attention reads every cached token)."""

    rows: list[int]
    contexts: list[int]
    seconds: dict[tuple[int, int, int], float]
    catch_up: dict[int, float] = field(default_factory=dict)
    """Seconds per row and column of the head catching up beyond a steady step, per batch size
    (`AdaptivePolicy.extra_catch_up`): what the first drafting step after a prefill pays."""

    def step(self, rows: int, k: int, context: int) -> float:
        low, high = self.contexts[0], self.contexts[-1]
        if low == high:
            return self._at_rows(rows, low, k)
        share = (max(context, low) - low) / (high - low)
        return self._at_rows(rows, low, k) * (1 - share) + self._at_rows(rows, high, k) * share

    @property
    def head_token_seconds(self) -> float:
        """Seconds of the head's pass over one prompt token in a prefill (the catch-up cost per
        column at the largest batch measured: a prefill chunk is hundreds of tokens)."""
        return self.catch_up[max(self.catch_up)] if self.catch_up else 0.0

    def catch_up_column(self, rows: int) -> float:
        """Seconds per row and column of catch-up at `rows` rows (0 where none was measured)."""
        if not self.catch_up:
            return 0.0
        return _interpolate(sorted(self.catch_up), self.catch_up.__getitem__, rows, extrapolate=False)

    def _at_rows(self, rows: int, context: int, k: int) -> float:
        return _interpolate(self.rows, lambda r: self.seconds[r, context, k], rows, extrapolate=True)

    def to_json(self) -> dict:
        return {
            "rows": self.rows,
            "contexts": self.contexts,
            "seconds": [[*key, v] for key, v in self.seconds.items()],
            "catch_up": [[r, v] for r, v in self.catch_up.items()],
        }

    @classmethod
    def from_json(cls, data: dict) -> StepCosts:
        seconds = {(r, c, k): v for r, c, k, v in data["seconds"]}
        return cls(data["rows"], data["contexts"], seconds, {r: v for r, v in data.get("catch_up", [])})


def _interpolate(grid: list[int], value, rows: int, extrapolate: bool) -> float:
    """`value` at `rows`: linear between grid points, the first point's below the grid, past it
    proportional to rows (`extrapolate`) or the last point's."""
    if rows <= grid[0]:
        return value(grid[0])
    for low, high in zip(grid, grid[1:], strict=False):
        if rows <= high:
            share = (rows - low) / (high - low)
            return value(low) * (1 - share) + value(high) * share
    return value(grid[-1]) * (rows / grid[-1] if extrapolate else 1.0)


class LiveCosts:
    """Measured / calibrated seconds of live decode steps, per batch size (the nearest calibration
    grid point) and kind of step (K = 0 or drafting): the mean of the last `window` ratios but the
    largest (throughput follows the mean step; one stall should not decide), the smallest while
    there are only two, while the latest is at most `fresh_steps` decode steps old. A kind with no
    fresh ratio takes the other kind's (load slows both alike until measured otherwise), else 1, so
    a stale verdict against drafting expires and is measured again; one with fewer than `settled`
    takes at most the other kind's (a first drafting step at a new batch size ran 40 % over its
    calibration once, and kept speculation off for the whole run)."""

    def __init__(self, grid: list[int], window: int = 16, fresh_steps: int = 256, settled: int = 3) -> None:
        self.grid = grid
        self.window = window
        self.fresh_steps = fresh_steps
        self.settled = settled
        self.clock = 0
        self._ratios: dict[tuple[int, bool], deque[float]] = {}
        self._means: dict[tuple[int, bool], float] = {}
        self._seen: dict[tuple[int, bool], int] = {}
        self._buckets: dict[int, int] = {}

    def bucket(self, rows: int) -> int:
        if rows not in self._buckets:
            self._buckets[rows] = min(self.grid, key=lambda point: abs(math.log(point / rows)))
        return self._buckets[rows]

    def record(self, rows: int, drafting: bool, ratio: float) -> None:
        key = (self.bucket(rows), drafting)
        if not self.is_fresh(rows, drafting):
            self._ratios[key] = deque(maxlen=self.window)
        self._ratios[key].append(ratio)
        self._seen[key] = self.clock
        ratios = sorted(self._ratios[key])
        self._means[key] = statistics.fmean(ratios[:-1]) if len(ratios) > 2 else ratios[0]

    def age(self, rows: int, drafting: bool) -> float:
        """Decode steps since the last ratio of this kind at this batch size (inf: never)."""
        seen = self._seen.get((self.bucket(rows), drafting))
        return math.inf if seen is None else self.clock - seen

    def is_fresh(self, rows: int, drafting: bool) -> bool:
        return self.age(rows, drafting) <= self.fresh_steps

    def count(self, rows: int, drafting: bool) -> int:
        """Fresh ratios of this kind at this batch size."""
        return len(self._ratios[self.bucket(rows), drafting]) if self.is_fresh(rows, drafting) else 0

    def ratio(self, rows: int, drafting: bool) -> float:
        mine, other = (self._fresh_mean(rows, kind) for kind in (drafting, not drafting))
        if mine is None:
            return 1.0 if other is None else other
        if other is not None and self.count(rows, drafting) < self.settled:
            return min(mine, other)
        return mine

    def _fresh_mean(self, rows: int, drafting: bool) -> float | None:
        return self._means[self.bucket(rows), drafting] if self.is_fresh(rows, drafting) else None


class AdaptivePolicy:
    def __init__(
        self,
        depths: list[int],
        costs: StepCosts,
        acceptance: Acceptance,
        margin: float = 0.03,
        hysteresis: float = 0.02,
        off_hysteresis: float = 0.08,
        probe_every: int = 32,
        max_probe_every: int = 512,
        confident_drafts: int = 64,
        refresh_every: int = 192,
        horizon: int = 16,
        probe_budget: float = 0.02,
        min_plain_samples: int = 3,
    ) -> None:
        self.depths = depths
        self.costs = costs
        self.acceptance = acceptance
        self.margin = margin
        self.hysteresis = hysteresis
        self.off_hysteresis = off_hysteresis
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.confident_drafts = confident_drafts
        self.refresh_every = refresh_every
        self.horizon = horizon
        self.probe_budget = probe_budget
        self.min_plain_samples = min_plain_samples
        self.live = LiveCosts(costs.rows)
        self.catch_up_seconds: deque[float] = deque(maxlen=16)
        self.current = 0
        self.prefill_tokens = 0.0
        """Prompt tokens prefilled per decode step (decayed): while drafting, the head passes over
        each of them too."""
        self._prefilled = 0
        self.calibration_seconds = 0.0
        self._off_steps = 0
        self._off_seconds = 0.0
        self._probe_interval = probe_every

    @property
    def drafting(self) -> bool:
        """Whether the last choice drafted: the head then keeps up with prefills as they happen."""
        return self.current > 0

    @property
    def prefill_seconds(self) -> float:
        """What drafting adds to a step for the head's pass over the prompts prefilled meanwhile."""
        return self.prefill_tokens * self.costs.head_token_seconds

    def step_seconds(self, rows: int, k: int, context: int) -> float:
        """Predicted seconds of a step drafting `k`: the calibration, scaled to live steps."""
        return self.costs.step(rows, k, context) * self.live.ratio(rows, k > 0)

    def extra_catch_up(self, catch_up: int) -> int:
        return extra_catch_up(catch_up, self.depths[-1])

    def switch_seconds(self, rows: int, catch_up: int) -> float:
        """Predicted seconds of the head's catch-up beyond a steady step: seconds per row and column
        of past live catch-ups, before any the calibration's."""
        extra = self.extra_catch_up(catch_up)
        if not extra:
            return 0.0
        if self.catch_up_seconds:
            return statistics.median(self.catch_up_seconds) * rows * extra
        return self.costs.catch_up_column(rows) * rows * extra

    def goodput(self, rows: int, k: int, context: int, switch: float = 0.0, room: Room | None = None) -> float:
        """Predicted tokens per second of a step drafting `k` for `rows` rows of `context` tokens
        with `room` before their max_tokens (none given: unbounded); a `switch` cost (the catch-up
        a first drafting step pays) is spread over the steps the rows still have to go at that K,
        at most `horizon`, and drafting pays the head's pass over the prompts prefilled meanwhile."""
        gains = self.acceptance.gains(k)
        tokens, left = (gains[-1], math.inf) if room is None else (room.tokens(gains), room.mean)
        seconds = self.step_seconds(rows, k, context)
        if k:
            steps = min(self.horizon, max(1.0, left / tokens))
            seconds += switch / steps + self.prefill_seconds
        return rows * tokens / seconds

    def choose(
        self,
        rows: int,
        context: int,
        catch_up: int = 0,
        tokens_left: Sequence[int] = (),
        joining: int = 0,
        backlog: int = 0,
    ) -> int:
        """K for `rows` decoding rows attending to `context` columns each, the head `catch_up`
        positions behind on the row furthest behind, the rows `tokens_left` tokens from their
        max_tokens each (none given: unbounded), `joining` more rows prefilling with `backlog`
        prompt tokens still to go. Drafting must pay at the batch the joining rows are about to make
        (a burst of arrivals starts with a few rows decoding, where drafting always pays, for a step
        or two). Turning drafting on while they prefill means the head passes over their backlog
        too: that is paid back like a catch-up (at 32 slots, a step or two of drafting in a burst's
        ramp-up cost the head's pass over ~4500 prompt tokens, ~4 % of the run). Staying on does not
        pay it again: the steady price of prompts arriving is `prefill_seconds`, and turning off for
        one long prompt left the head behind on it for its whole life."""
        backlog_seconds = 0.0 if self.current else backlog * self.costs.head_token_seconds
        switch = self.switch_seconds(rows, catch_up) + backlog_seconds
        at = rows + joining
        room = Room.of(tokens_left, self.depths[-1])
        scores = {k: self.goodput(at, k, context, switch, room) for k in [0, *self.depths]}
        best = max(self.depths, key=scores.__getitem__)
        if scores[best] < scores[0] * (1 + self.margin):
            best = 0
        keep = 1 + (self.off_hysteresis if self.current and not best else self.hysteresis)
        if best != self.current and scores[best] < scores[self.current] * keep:
            best = self.current
        self.current = best
        if best:
            self._off_steps, self._off_seconds, self._probe_interval = 0, 0.0, self.probe_every
            refresh = self.refresh_every
            if self.live.count(rows, drafting=False) < self.min_plain_samples:
                refresh //= 8  # until a few plain steps are timed at this load, one can decide
            if self.live.is_fresh(rows, drafting=True) and self.live.age(rows, drafting=False) > refresh:
                return 0  # one plain step, so what K = 0 costs under this load is measured, not assumed
            return best
        self._off_steps += 1
        self._off_seconds += self.step_seconds(rows, 0, context)
        probe = max(self.depths, key=scores.__getitem__)
        probe_cost = switch + self.step_seconds(rows, probe, context) - self.step_seconds(rows, 0, context)
        if (
            self._off_steps >= self._probe_interval
            and probe_cost <= self.probe_budget * self._off_seconds
            and self.could_pay(rows, context, switch, room)
        ):
            self._off_steps, self._off_seconds = 0, 0.0
            if self.acceptance.observed >= self.confident_drafts:
                self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
            return probe
        return 0

    def lull(self) -> None:
        """No row is decoding: the K chosen for the last load is forgotten, so rows arriving now
        are decided afresh, their prompts' passes priced in (32 clients arriving after one
        client's stream kept drafting on for a step at 32 rows: the head passed over ~9600 prompt
        tokens and caught up on 7 rows for that one step, 3 % of the run)."""
        self.current = 0

    def drafts_when_caught_up(self, rows: int, context: int, backlog: int) -> bool:
        """Whether drafting would beat K = 0 by `margin` at `rows` rows with the head caught up on
        every row, the head's pass over the `backlog` prompt tokens still to pass (this prefill's
        included) paid back like a catch-up. While off, this decides whether the head passes over
        the prompts prefilled now: there the pass is cheap, while a prompt the head skipped is a
        catch-up later, padded to that row's length on every row, which keeps speculation off for
        the row's whole life (at 8 slots, a 450-token prompt prefilled during one step off kept it
        off for 60 steps where drafting was 1.3x plain). The backlog price keeps a burst's ramp-up
        at a load where drafting will not pay from paying the pass for nothing (3 % of a run at
        32 slots), and so does passing only within `horizon` steps of the last draft: past that the
        rows decoding meanwhile are far behind, no draft follows soon, and the passes of every
        new wave of prompts at 32 slots were paid for nothing."""
        if self._off_steps > self.horizon:
            return False
        switch = backlog * self.costs.head_token_seconds
        plain = self.goodput(rows, 0, context) * (1 + self.margin)
        return any(self.goodput(rows, k, context, switch) >= plain for k in self.depths)

    def could_pay(self, rows: int, context: int, switch: float = 0.0, room: Room | None = None) -> bool:
        """Whether drafting could beat K = 0 at this load even if every draft token within the rows'
        `room` were accepted, the catch-up it starts with (`switch` seconds) spread
        over the steps until the next probe. Where it could not (e.g. verification too dear at a
        high batch size, or rows a token from their end), probing only costs: a probe's head
        catch-up over every token since the last draft is the dearest step there is."""
        baseline = 1 / self.step_seconds(rows, 0, context)
        spread = switch / self._probe_interval + self.prefill_seconds

        def perfect(k: int) -> float:
            every = [1.0 + n for n in range(k + 1)]
            return every[-1] if room is None else room.tokens(every)

        return any(
            perfect(k) / (self.step_seconds(rows, k, context) + spread) > baseline * (1 + self.margin)
            for k in self.depths
        )

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        if any(drafted):
            self.acceptance.update(drafted, accepted)

    def observe_prefill(self, tokens: int) -> None:
        """A prefill fed `tokens` prompt tokens (padding included)."""
        self._prefilled += tokens

    def observe_time(self, rows: int, k: int, context: int, catch_up: int, seconds: float) -> None:
        """The wall time of the decode step this policy chose `k` for. A drafting step with a long
        catch-up (speculation was off, or rows were prefilled while it was) teaches what a catch-up
        column costs; every other step teaches its kind's live ratio."""
        self.live.clock += 1
        self.prefill_tokens = 0.9 * self.prefill_tokens + 0.1 * self._prefilled
        self._prefilled = 0
        extra = self.extra_catch_up(catch_up) if k else 0
        if extra:
            excess = max(0.0, seconds - self.step_seconds(rows, k, context))
            self.catch_up_seconds.append(excess / (rows * extra))
        else:
            self.live.record(rows, k > 0, seconds / self.costs.step(rows, k, context))


def extra_catch_up(catch_up: int, depth: int) -> int:
    """Columns of a catch-up beyond a steady drafting step's (the last draft's accepted tokens and
    one more, for drafts of up to `depth`); 0 unless the head is that far behind (speculation was
    off, or rows are new: the head catches up on their whole prompt)."""
    steady = depth + 1
    return catch_up - steady if catch_up > 2 * steady else 0


@dataclass
class FixedK:
    """A policy that drafts `k` every step: what calibration times."""

    k: int

    @property
    def drafting(self) -> bool:
        return self.k > 0

    def choose(
        self,
        rows: int,
        context: int,
        catch_up: int = 0,
        tokens_left: Sequence[int] = (),
        joining: int = 0,
        backlog: int = 0,
    ) -> int:
        return self.k

    def lull(self) -> None:
        pass

    def drafts_when_caught_up(self, rows: int, context: int, backlog: int) -> bool:
        return self.k > 0

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        pass

    def observe_prefill(self, tokens: int) -> None:
        pass

    def observe_time(self, rows: int, k: int, context: int, catch_up: int, seconds: float) -> None:
        pass


# ---- calibration ----------------------------------------------------------------------------------


TIMED_ROUNDS = 6
"""Rounds of timed steps per grid point, every K once per round after one warm-up round; the
fastest step of each K counts (on a shared machine the minimum is the cost, the rest is waiting,
and interleaving the K's keeps a drift in the machine's speed from favouring one of them)."""


@torch.inference_mode()
def measure_costs(engine: Engine, depths: list[int]) -> StepCosts:
    """Time whole engine steps at each grid point: `rows` requests of `context` prompt tokens are
    prefilled, then decoded with each K in turn, round after round. Runs on an idle engine (no
    request holds a slot) and leaves nothing behind: the requests are cancelled and the step
    counters cleared. Steps are timed at the shortest, middle and longest K and interpolated
    between (every proposer's cost grows step by step with K); the table is made non-decreasing
    in K, rows and context, so one noisy measurement cannot make more work look cheaper. The first drafting step at
    the longest context catches the head up on the whole prompt: what it costs over that K's
    fastest step, per row and column, prices a switch before the policy has timed one live.
    Prompt lookup before a head is timed on the head alone: what a lookup saves is not promised."""
    if engine.requests:
        raise RuntimeError("calibration needs an idle engine")
    proposer = engine.proposer
    engine.proposer = getattr(proposer, "drafter", proposer)
    config = engine.config
    slots = config.max_slots
    grid = sorted({1, slots} | {2**i for i in range(1, slots.bit_length()) if 2**i < slots})
    timed = [0, *sorted({depths[0], depths[len(depths) // 2], depths[-1]})]
    per_round = sum(k + 1 for k in timed)  # the most tokens a row gains in a round
    rounds = max(1, min(TIMED_ROUNDS, (config.max_len - 34) // per_round - 1))  # a short max_len times fewer
    gained = 1 + (1 + rounds) * per_round
    room = max(2, config.max_len - gained - 1)
    contexts = sorted({min(32, room), min(512, room)})
    params = SamplingParams(max_tokens=gained + 1, ignore_eos=True)
    seconds: dict[tuple[int, int, int], float] = {}
    catch_up: dict[int, float] = {}
    try:
        for rows in grid:
            for context in contexts:
                prompt = [(7 * i + 3) % engine.vocab_size for i in range(context)]
                ids = [engine.add_request(prompt, params) for _ in range(rows)]
                engine.policy = FixedK(0)
                while any(engine.requests[i].status is not Status.DECODING for i in ids):
                    engine.step()
                times = {k: [] for k in timed}
                behind = engine.proposer.catch_up_width([engine.requests[i] for i in ids])
                for _ in range(1 + rounds):
                    for k in timed:
                        engine.policy = FixedK(k)
                        times[k].append(_timed_step(engine))
                for k in timed:
                    seconds[rows, context, k] = min(times[k][1:])
                extra = extra_catch_up(behind + 1, depths[-1])  # + the token the K = 0 step added
                if context == contexts[-1] and extra:
                    first = timed[1]
                    catch_up[rows] = max(0.0, times[first][0] - seconds[rows, context, first]) / (rows * extra)
                for request_id in ids:
                    engine.cancel(request_id)
                _fill_between(seconds, (rows, context), depths, timed[1:])
    finally:
        for request_id in list(engine.requests):
            engine.cancel(request_id)
        engine.policy = None
        engine.proposer = proposer
        engine.stats, engine.spec = StepStats(), SpecCounters()
    _monotone(seconds, grid, contexts, [0, *depths])
    return StepCosts(grid, contexts, seconds, catch_up)


def _timed_step(engine: Engine) -> float:
    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    sync()
    start = time.perf_counter()
    engine.step()
    sync()
    return time.perf_counter() - start


def _fill_between(table: dict[tuple, float], point: tuple, keys: list[int], known: list[int]) -> None:
    """Linear interpolation of `table[(*point, k)]` for the keys between the `known` ones."""
    for low, high in zip(known, known[1:], strict=False):
        for k in keys:
            if low < k < high:
                share = (k - low) / (high - low)
                table[(*point, k)] = table[(*point, low)] * (1 - share) + table[(*point, high)] * share


def _monotone(table: dict[tuple, float], grid: list[int], contexts: list[int], keys: list[int]) -> None:
    """A longer draft, more rows or a longer context cost at least as much: a grid point measured
    during a slow spell of a shared machine otherwise makes its neighbours look cheap (a 32-slot
    calibration timed K = 5 at 44.5 ms with 32-token rows and 32.5 ms with 512-token rows), and at
    a high batch size that made drafting look 30-40 % ahead where every static K tied plain
    decoding. Each entry becomes the largest at or below it in all three."""
    for h, k in enumerate(keys):
        for i, rows in enumerate(grid):
            for j, context in enumerate(contexts):
                shorter_draft = [table[rows, context, keys[h - 1]]] if h else []
                fewer_rows = [table[grid[i - 1], context, k]] if i else []
                shorter_context = [table[rows, contexts[j - 1], k]] if j else []
                table[rows, context, k] = max(
                    [table[rows, context, k], *shorter_draft, *fewer_rows, *shorter_context]
                )


COST_MODEL = "whole-step-v4"
"""Bumped when what `measure_costs` measures changes, so no cached calibration of another kind is read."""


def _cache_key(engine: Engine, depths: list[int]) -> str:
    proposer = engine.proposer
    head = getattr(proposer, "head", None)
    parts = {
        "model": COST_MODEL,
        "target": engine.target.config.to_json_string(use_diff=False),
        "head": None if head is None else head.config.model_dump_json(),
        "proposer": type(proposer).__name__,
        "tree": [getattr(proposer, "top_k", None), getattr(proposer, "total_tokens", None)],
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else engine.device.type,
        "dtype": str(engine.target.dtype),
        "engine": [engine.config.max_slots, engine.config.max_len, engine.config.prefill_tokens],
        "depths": depths,
        "threads": torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def calibrate(engine: Engine, depths: list[int], cache: bool = True) -> StepCosts:
    """`measure_costs`, cached under the storage cache directory per target, head, proposer, device,
    dtype, engine shape and thread count."""
    from aerie.storage import cache_dir

    path = cache_dir() / "calibration" / f"{_cache_key(engine, depths)}.json"
    if cache and path.is_file():
        return StepCosts.from_json(json.loads(path.read_text()))
    costs = measure_costs(engine, depths)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs.to_json()))
    return costs


def adaptive_policy(engine: Engine, cache: bool = True, **options) -> AdaptivePolicy:
    """The policy for an engine whose proposer drafts up to `proposer.k` tokens (a tree: depth)."""
    proposer = engine.proposer
    depths = list(range(1, proposer.k + 1))
    started = time.perf_counter()
    costs = calibrate(engine, depths, cache)
    head = getattr(proposer, "head", None)
    metrics = getattr(head, "eval_metrics", None) or {}
    # The head's agreement at the anchors the engine's walk reaches (`walk_chain_d`) is what the
    # engine will measure; over every anchor (`chain_d`, older head files) it runs higher.
    kind = "walk_chain" if "walk_chain_1" in metrics else "chain"
    chain = [metrics[f"{kind}_{d}"] for d in depths if f"{kind}_{d}" in metrics]
    policy = AdaptivePolicy(depths, costs, Acceptance.seeded(proposer.k, chain), **options)
    policy.calibration_seconds = time.perf_counter() - started
    return policy
