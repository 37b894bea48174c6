"""Adaptive speculation: the policy on synthetic costs and acceptance (no timing), and the engine
with k="auto" (lossless, calibrated, K per step counted)."""

from __future__ import annotations

import pytest
from random_models import hf_greedy, random_prompts

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.adaptive import Acceptance, AdaptivePolicy, Room, StepCosts, _monotone
from aerie.engine.build import build_engine

DEPTHS = [1, 2, 3, 4, 5]
ROWS = [1, 2, 4, 8, 16, 32]


CONTEXT = 100


def costs(verify_per_token: float, draft_per_step: float, base: float = 10.0, per_row: float = 1.0) -> StepCosts:
    """A step drafting K over `rows` rows costs base + rows x per_row x (1 + (K + 1) x verify_per_token)
    ms for the target forward, plus K x draft_per_step x (1 + rows / 8) ms of drafting (0 at K = 0)."""
    seconds = {
        (r, CONTEXT, k): base + r * per_row * (1 + (k + 1) * verify_per_token) + k * draft_per_step * (1 + r / 8)
        for r in ROWS
        for k in [0, *DEPTHS]
    }
    return StepCosts(ROWS, [CONTEXT], seconds)


def policy(step_costs: StepCosts, rate: float, **options) -> AdaptivePolicy:
    chain = [rate ** (d + 1) for d in range(len(DEPTHS))]
    acceptance = Acceptance.seeded(len(DEPTHS), chain, weight=1e6)  # a prior this heavy never moves
    return AdaptivePolicy(DEPTHS, step_costs, acceptance, **options)


def best_by_hand(p: AdaptivePolicy, rows: int) -> int:
    scores = {k: rows * p.acceptance.expected_tokens(k) / p.costs.step(rows, k, CONTEXT) for k in [0, *DEPTHS]}
    best = max(scores, key=scores.get)
    return best if scores[best] >= scores[0] * (1 + p.margin) else 0


def test_expected_tokens_follow_the_chain_rates():
    acceptance = Acceptance.seeded(3, [0.8, 0.6, 0.3], weight=100)
    assert acceptance.expected_tokens(0) == pytest.approx(1.0)
    assert acceptance.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.6 + 0.3)
    acceptance.update([3, 3, 0], [3, 0, 0])  # one row accepted all, one none, one did not draft
    assert acceptance.drafted / acceptance.offered < 1
    assert acceptance.expected_tokens(1) < 1 + 0.8


def test_a_row_gains_no_more_than_its_room():
    """A draft past a row's max_tokens is verified and thrown away: rows one token from the end
    gain nothing from drafting, rows two from the end at most one draft token."""
    p = policy(costs(verify_per_token=0.05, draft_per_step=0.5), rate=0.9, probe_every=10**9)
    unbounded = p.goodput(4, 5, CONTEXT)
    assert p.goodput(4, 5, CONTEXT, room=Room.of([2] * 4, DEPTHS[-1])) == pytest.approx(
        unbounded * p.acceptance.expected_tokens(1) / p.acceptance.expected_tokens(5)
    )
    assert p.choose(4, CONTEXT) > 0
    assert p.choose(4, CONTEXT, tokens_left=[1] * 4) == 0


def test_room_averages_each_rows_gain():
    gains = [1.0, 1.8, 2.4, 2.7]
    left = [1, 2, 3, 9, 40, 2]
    room = Room.of(left, depth=3)
    assert room.mean == pytest.approx(sum(left) / len(left))
    assert room.tokens(gains) == pytest.approx(sum(gains[min(len(gains), n) - 1] for n in left) / len(left))


def test_calibration_never_prices_more_work_cheaper():
    """A grid point timed during a slow spell must not make a bigger one look cheap."""
    table = {(1, 32, 0): 5.0, (1, 512, 0): 4.0, (2, 32, 0): 4.5, (2, 512, 0): 6.0,
             (1, 32, 1): 9.0, (1, 512, 1): 8.0, (2, 32, 1): 12.0, (2, 512, 1): 7.0}
    _monotone(table, [1, 2], [32, 512], [0, 1])
    assert table == {(1, 32, 0): 5.0, (1, 512, 0): 5.0, (2, 32, 0): 5.0, (2, 512, 0): 6.0,
                     (1, 32, 1): 9.0, (1, 512, 1): 9.0, (2, 32, 1): 12.0, (2, 512, 1): 12.0}


def test_expensive_verification_or_low_acceptance_turns_speculation_off():
    expensive = policy(costs(verify_per_token=4.0, draft_per_step=0.5, base=0.0), rate=0.8)
    assert all(expensive.choose(rows, CONTEXT) == 0 for rows in ROWS)
    hopeless = policy(costs(verify_per_token=0.05, draft_per_step=0.5), rate=0.05)
    assert all(hopeless.choose(rows, CONTEXT) == 0 for rows in ROWS)


def test_picks_the_k_the_model_says_is_best_at_each_load():
    chosen = {}
    for rows in ROWS:
        p = policy(costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0), rate=0.8)
        chosen[rows] = p.choose(rows, CONTEXT)
        assert chosen[rows] == best_by_hand(p, rows)
    assert chosen[1] >= 3 and chosen[32] < chosen[1], chosen  # deep drafts at low load, fewer at high load


def test_constant_load_does_not_oscillate():
    p = policy(costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0), rate=0.8, probe_every=10**9)
    for rows in ROWS:
        picks = [p.choose(rows, CONTEXT) for _ in range(50)]
        assert len(set(picks[1:])) == 1, (rows, picks)


def test_drafting_stays_on_until_plain_steps_win_clearly():
    p = policy(costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0), rate=0.8, probe_every=10**9)
    k = p.choose(4, CONTEXT)
    edge = p.goodput(4, k, CONTEXT) / p.goodput(4, 0, CONTEXT)  # drafting's lead at calibrated cost
    for _ in range(3):
        p.live.record(4, drafting=False, ratio=1.0)  # plain steps cost what calibration says

    def drafting_costs(times: float) -> int:
        for _ in range(16):  # live drafting steps `times` dearer than the break-even point
            p.live.record(4, drafting=True, ratio=edge * times)
        p.choose(4, CONTEXT)
        return p.current

    assert drafting_costs(1.05) == k  # plain steps 5 % better: flipping would cost more
    assert drafting_costs(1.12) == 0


def test_off_drafting_must_pay_at_the_batch_the_joining_rows_make():
    step_costs = costs(verify_per_token=4.0, draft_per_step=0.5, base=10.0, per_row=1.0)
    assert policy(step_costs, rate=0.8).choose(1, CONTEXT) > 0  # one row: verification is cheap
    assert policy(step_costs, rate=0.8).choose(1, CONTEXT, joining=31) == 0


def test_drafting_pays_for_the_head_s_pass_over_the_prompts_still_to_prefill():
    step_costs = costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0)
    step_costs.catch_up = {r: 0.5 for r in ROWS}  # 0.5 ms a head token
    assert policy(step_costs, rate=0.8, probe_every=10**9).choose(2, CONTEXT, joining=2, backlog=20) > 0
    assert policy(step_costs, rate=0.8, probe_every=10**9).choose(2, CONTEXT, joining=2, backlog=2000) == 0


def test_a_burst_after_a_lull_prices_its_prompts_afresh():
    step_costs = costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0)
    step_costs.catch_up = {r: 0.5 for r in ROWS}
    p = policy(step_costs, rate=0.8, probe_every=10**9)
    assert p.choose(1, CONTEXT) > 0  # one client's stream drafts
    assert p.choose(2, CONTEXT, joining=2, backlog=2000) > 0  # staying on does not pay the pass again
    p.lull()  # nothing decoding: the next rows are a new load
    assert not p.drafting
    assert p.choose(2, CONTEXT, joining=2, backlog=2000) == 0


def test_the_engine_forgets_its_k_when_nothing_decodes(llama_with_heads):
    target, heads = llama_with_heads
    engine = build_engine(
        target, EngineConfig(max_slots=2, max_len=64), "eagle3", heads["eagle3"], "auto", calibration_cache=False
    )
    engine.policy.current = 3
    engine.add_request(random_prompts([7], seed=3)[0], SamplingParams(max_tokens=4))
    engine.step()  # the prefill: no row was decoding
    assert engine.policy.current == 0


def test_off_probes_now_and_then_and_live_acceptance_turns_it_back_on():
    p = policy(costs(verify_per_token=0.05, draft_per_step=0.2), rate=0.05, probe_every=8, max_probe_every=64,
               confident_drafts=2)
    p.acceptance = Acceptance.seeded(len(DEPTHS), [0.05**d for d in range(1, 6)], weight=20)
    probes = []
    for step in range(200):
        if k := p.choose(1, CONTEXT):
            probes.append(step)
            p.observe([k], [0])  # the probe confirms: nothing accepted
    # every 8 steps until 2 live drafts outweigh the seed, then twice as long each time, up to 64
    assert probes == [7, 15, 23, 39, 71, 135, 199]
    for _ in range(200):  # the head turns out to be good: every draft fully accepted
        p.observe([5], [5])
    assert p.choose(1, CONTEXT) > 0


def test_no_probe_for_rows_a_token_from_their_end():
    """A probe there is a catch-up for a draft that cannot be kept (it would only be verified)."""
    p = policy(costs(verify_per_token=0.05, draft_per_step=0.2), rate=0.05, probe_every=8)
    assert not any(p.choose(2, CONTEXT, tokens_left=[1, 1]) for _ in range(40))
    assert any(p.choose(2, CONTEXT, tokens_left=[9, 9]) for _ in range(40))


def test_a_probe_waits_until_its_catch_up_is_a_small_share_of_the_time_off():
    def first_probe(catch_up_ms: float) -> int:
        step_costs = costs(verify_per_token=0.05, draft_per_step=0.2)
        step_costs.catch_up = {r: catch_up_ms for r in ROWS}
        p = policy(step_costs, rate=0.05, probe_every=8)
        return next(step for step in range(10_000) if p.choose(16, CONTEXT, 300))

    assert first_probe(0.0) == 7
    # 16 rows x 288 columns x 0.01 ms = 46 ms of catch-up, 2 % of ~27 ms steps off: ~86 steps
    assert 80 < first_probe(0.01) < 95


def test_no_probes_where_even_a_perfect_draft_could_not_pay():
    p = policy(costs(verify_per_token=4.0, draft_per_step=20.0, base=0.0), rate=0.8, probe_every=4)
    assert not any(p.could_pay(rows, CONTEXT) for rows in ROWS)
    assert all(p.choose(rows, CONTEXT) == 0 for rows in ROWS for _ in range(40))


@pytest.mark.parametrize(("method", "tree"), [("ngram", False), ("eagle3", False), ("peagle", False), ("eagle3", True)])
def test_auto_k_is_lossless_and_counts_k_per_step(llama_with_heads, method, tree):
    target, heads = llama_with_heads
    prompts = [p + p[:5] for p in random_prompts([5, 23, 9, 17], seed=8)]
    expected = [hf_greedy(target.model, p, 20) for p in prompts]
    engine = build_engine(
        target, EngineConfig(max_slots=3, max_len=96), method, heads.get(method), "auto", tree=tree,
        calibration_cache=False,
    )
    results = engine.generate(prompts, SamplingParams(max_tokens=20))
    assert [r.token_ids for r in results] == expected
    assert sum(engine.stats.k_histogram.values()) == engine.stats.decode_steps
    assert set(engine.stats.k_histogram) <= {0, *range(1, engine.proposer.k + 1)}
    assert engine.policy.costs.rows == [1, 2, 3]
    catch_up = engine.policy.costs.catch_up
    assert set(catch_up) == (set() if method == "ngram" else {1, 2, 3})  # prompt lookup has no head to catch up
    assert all(v >= 0 for v in catch_up.values())


def run_live(p: AdaptivePolicy, rows: int, steps: int, slowdown: dict[bool, float]) -> list[int]:
    """Step the policy `steps` times; each step takes its calibrated time x `slowdown[drafting]`."""
    picks = []
    for _ in range(steps):
        k = p.choose(rows, CONTEXT)
        p.observe_time(rows, k, CONTEXT, 1, p.costs.step(rows, k, CONTEXT) * slowdown[k > 0])
        picks.append(k)
    return picks


def test_live_steps_dearer_than_calibrated_turn_speculation_off_until_measured_again():
    p = policy(costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0), rate=0.8, probe_every=10**9)
    assert p.choose(4, CONTEXT) > 0  # calibration says drafting pays at 4 rows
    picks = run_live(p, 4, 40, {False: 1.0, True: 3.0})  # but under this load drafting steps cost 3x
    assert picks[-20:] == [0] * 20
    # once the verdict against drafting is stale it is measured again, and drafting is back if it pays
    picks = run_live(p, 4, p.live.fresh_steps + 40, {False: 1.0, True: 1.0})
    assert picks[-1] > 0


def test_while_drafting_a_plain_step_now_and_then_measures_the_baseline():
    p = policy(costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0), rate=0.8, refresh_every=16)
    picks = run_live(p, 1, 100, {False: 1.0, True: 1.0})
    plain = [i for i, k in enumerate(picks) if k == 0]
    gaps = [b - a for a, b in zip(plain, plain[1:], strict=False)]
    # one plain step once the last is more than 2 steps old until 3 are timed, then more than 16
    assert len(plain) >= 6 and gaps[:2] == [4, 4] and set(gaps[2:]) == {18}, plain
    assert len(set(picks) - {0}) == 1


def test_a_dear_catch_up_is_priced_into_switching_speculation_on():
    p = policy(costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0), rate=0.8, probe_every=10**9)
    far_behind = 200  # columns the head must catch up on (a long prompt, or many steps off)
    assert p.choose(4, CONTEXT, far_behind) > 0  # the calibration measured no catch-up cost
    k = p.current
    catch_up_cost = 4 * p.extra_catch_up(far_behind)  # 1 ms a row and column
    p.observe_time(4, k, CONTEXT, far_behind, p.costs.step(4, k, CONTEXT) + catch_up_cost)
    assert p.catch_up_seconds[-1] == pytest.approx(1.0)
    p.current = 0
    assert p.choose(4, CONTEXT, far_behind) == 0  # ~780 ms of catch-up does not pay back in 16 steps
    assert p.choose(4, CONTEXT, 1) > 0  # a head that is not behind drafts


def test_the_calibrated_catch_up_prices_the_first_switch():
    step_costs = costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0)
    step_costs.catch_up = {r: 1.0 for r in ROWS}  # 1 ms a row and column, as calibration measured it
    p = policy(step_costs, rate=0.8, probe_every=10**9)
    assert step_costs.catch_up_column(3) == 1.0 and step_costs.catch_up_column(64) == 1.0
    assert p.choose(4, CONTEXT, 200) == 0  # no live switch timed yet: the calibration's price holds
    assert p.choose(4, CONTEXT, 1) > 0


def test_a_switch_must_pay_back_before_the_rows_finish():
    step_costs = costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0)
    step_costs.catch_up = {r: 0.1 for r in ROWS}  # 4 rows x 188 columns: 75 ms of catch-up
    assert policy(step_costs, rate=0.8, probe_every=10**9).choose(4, CONTEXT, 200) > 0
    assert policy(step_costs, rate=0.8, probe_every=10**9).choose(4, CONTEXT, 200, tokens_left=[6] * 4) == 0


def test_the_head_s_pass_over_arriving_prompts_is_drafting_s_cost():
    """While drafting, the head prefills every prompt that arrives: a stream of long prompts
    prices drafting out, and a long catch-up teaches the catch-up price, not drafting's ratio."""
    step_costs = costs(verify_per_token=0.3, draft_per_step=1.0, per_row=2.0)
    step_costs.catch_up = {r: 0.5 for r in ROWS}  # 0.5 ms a head token
    p = policy(step_costs, rate=0.8, probe_every=10**9)
    k = p.choose(4, CONTEXT)
    assert k > 0
    p.observe_time(4, k, CONTEXT, 200, p.costs.step(4, k, CONTEXT) + 4 * p.extra_catch_up(200) * 0.5)
    assert p.catch_up_seconds[-1] == pytest.approx(0.5) and p.live.count(4, drafting=True) == 0
    for _ in range(40):  # 128 prompt tokens arrive every step: 64 ms of head prefill a step
        p.observe_prefill(128)
        k = p.choose(4, CONTEXT)
        p.observe_time(4, k, CONTEXT, 1, p.costs.step(4, k, CONTEXT))
    assert p.prefill_tokens == pytest.approx(128, rel=0.02) and p.current == 0