"""Objectives, metrics, the trainer and the draft vocabulary."""

from __future__ import annotations

import pytest
import torch

from aerie.heads.fit import Example, TrainConfig, evaluate, train_head
from aerie.heads.losses import Agreement, peagle_sample, walk_anchors
from aerie.heads.vocab import build_draft_vocab, target_to_draft_index, token_counts
from tests.heads.conftest import VOCAB


def greedy_examples(target, count=6, prompt_len=6, reply_len=26, seed=0):
    """Replies the target writes itself (greedy), so the data agree with its top-1."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB - 1, (count, prompt_len), generator=g)
    ids = prompts
    with torch.no_grad():
        for _ in range(reply_len):
            logits = target.forward(ids).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return [Example(row.tolist(), [False] * prompt_len + [True] * reply_len) for row in ids]


@pytest.mark.parametrize("method", ["eagle3", "peagle", "eagle"])
def test_loss_decreases_on_tiny_overfit(sharp_target, method):
    target = sharp_target
    data = greedy_examples(target, count=4)
    config = TrainConfig(epochs=40, batch_size=4, lr=3e-3, ttt_steps=2, peagle_depths=3, warmup_ratio=0.1, eval_depth=3)
    head, result = train_head(target, method, data, data, config, draft_vocab_size=128, progress=False)
    first = sum(h["loss"] for h in result.history[:3]) / 3
    last = sum(h["loss"] for h in result.history[-3:]) / 3
    assert last < 0.5 * first, (first, last)
    assert result.eval["acc_1"] > 0.5, result.eval
    assert result.steps == 40


def test_fit_is_deterministic(target):
    data = greedy_examples(target, count=4, seed=1)
    config = TrainConfig(epochs=2, batch_size=2, seed=7, peagle_depths=3)
    a, ra = train_head(target, "peagle", data, None, config, draft_vocab_size=100, progress=False)
    b, rb = train_head(target, "peagle", data, None, config, draft_vocab_size=100, progress=False)
    assert [h["loss"] for h in ra.history] == [h["loss"] for h in rb.history]
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_evaluate_reports_depths(target):
    data = greedy_examples(target, count=3, seed=2)
    head, _ = train_head(
        target, "eagle3", data, None, TrainConfig(epochs=1, batch_size=3), draft_vocab_size=64, progress=False
    )
    ev = evaluate(head, target, data, depth=5)
    assert [f"acc_{d}" in ev and f"chain_{d}" in ev for d in range(1, 6)] == [True] * 5
    assert all(ev[f"chain_{d}"] <= ev[f"acc_{d}"] + 1e-9 for d in range(1, 6))
    assert all(ev[f"chain_{d + 1}"] <= ev[f"chain_{d}"] + 1e-9 for d in range(1, 5))
    assert ev["tau"] == pytest.approx(1 + sum(ev[f"chain_{d}"] for d in range(1, 6)))



@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_sharded_eval_totals_add_up_to_evaluate(target, method):
    """The job's evaluation (each rank a share, the totals summed) is `evaluate`'s, plus the loss."""
    from aerie.heads.evaluation import EvalTotals, eval_totals

    data = greedy_examples(target, count=5, seed=3)
    config = TrainConfig(epochs=1, batch_size=2, peagle_depths=3, eval_depth=3)
    head, _ = train_head(target, method, data, None, config, draft_vocab_size=64, progress=False)
    whole = evaluate(head, target, data, depth=3, batch_size=2)
    shares = [eval_totals(head, target, data[rank::2], 3, 2, loss_config=config).vector(3) for rank in range(2)]
    summed = EvalTotals.from_vector([a + b for a, b in zip(*shares, strict=True)], 3).metrics()
    assert {k: summed[k if k == "eval_tokens" else f"eval_{k}"] for k in whole} == pytest.approx(whole)
    assert whole["eval_tokens"] > 0 and 0 < summed["eval_loss"] < float("inf")
    assert eval_totals(head, target, data, 3, 2).tokens == 0  # no loss asked, none computed

def test_agreement_chain_counts():
    correct = torch.tensor([[[True, True, False], [True, False, True], [False, True, True]]])
    fed_ok = torch.tensor([[[True, True, True], [True, True, True], [True, False, True]]])
    counted = torch.ones_like(correct)
    a = Agreement.from_grid(correct, fed_ok, counted)
    assert a.acc == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    assert a.chain_rate == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert a.tau == pytest.approx(2.0)
    merged = a.merge(a)
    assert merged.chain_rate == pytest.approx(a.chain_rate) and merged.count == [6.0, 6.0, 6.0]


def test_peagle_depth_sampling_sizes():
    n = 40
    valid = torch.ones(1, n, dtype=torch.bool)
    loss_mask = torch.zeros(1, n, dtype=torch.bool)
    loss_mask[0, 10:] = True
    g = torch.Generator().manual_seed(0)
    ((anchors, depths),) = peagle_sample(valid, loss_mask, depths=8, ratio=0.7, ratio_min=0.2, generator=g)
    assert int((depths == 0).sum()) == n
    n_loss = 30
    prev = set(anchors[depths == 0].tolist())
    for d in range(1, 8):
        chosen = anchors[depths == d]
        assert chosen.numel() <= int((n_loss - d) * max(0.7**d, 0.2))
        # survivors of the previous depth whose depth-d element is a reply row
        assert set(chosen.tolist()) <= prev
        assert bool(loss_mask[0, chosen + d].all())
        prev = set(chosen.tolist())


def test_draft_vocab():
    seqs = [[5, 5, 5, 7, 7, 9, 1], [7, 9, 3, 3, 3, 3]]
    masks = [[True] * 7, [False, False, True, True, True, True]]
    counts = token_counts(seqs, masks, 12)
    assert counts[3] == 4 and counts[5] == 3 and counts[7] == 2 and counts[9] == 1
    d2t, t2d = build_draft_vocab(counts, 4, always_include=[11])
    draft_ids = torch.arange(4) + d2t
    assert draft_ids.tolist() == [3, 5, 7, 11]  # ascending target ids; 11 forced in; 9 and 1 dropped
    assert t2d.nonzero().flatten().tolist() == [3, 5, 7, 11]
    index = target_to_draft_index(t2d)
    assert index[[3, 5, 7, 11, 9]].tolist() == [0, 1, 2, 3, -1]
    d2t_full, t2d_full = build_draft_vocab(counts, 100)
    assert d2t_full.numel() == 12 and bool((d2t_full == 0).all()) and bool(t2d_full.all())


def test_train_step_through_objective_wrapper(sharp_target):
    """The Objective wrapper (what DDP wraps under Ray Train) trains exactly like the bare head."""
    from aerie.heads.fit import Objective, make_optimizer, train_step

    data = greedy_examples(sharp_target, count=2, seed=3)
    config = TrainConfig(batch_size=2, ttt_steps=2)
    a, _ = train_head(sharp_target, "eagle3", data, None, TrainConfig(epochs=0), draft_vocab_size=64, progress=False)
    b, _ = train_head(sharp_target, "eagle3", data, None, TrainConfig(epochs=0), draft_vocab_size=64, progress=False)
    opt_a, _ = make_optimizer(a, config, 4)
    opt_b, _ = make_optimizer(b, config, 4)
    ma = train_step(a, sharp_target, data, opt_a, None, config)
    mb = train_step(Objective(b, config), sharp_target, data, opt_b, None, config)
    assert ma["loss"] == mb["loss"]
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_bf16_precision_trains_close_to_fp32(sharp_target, method):
    """bf16 autocast runs the head in bf16 and keeps fp32 weights; its losses track fp32's."""
    data = greedy_examples(sharp_target, count=4, seed=6)
    runs = {}
    for precision in ("fp32", "bf16"):
        config = TrainConfig(epochs=20, batch_size=4, lr=3e-3, ttt_steps=2, peagle_depths=3, precision=precision)
        head, result = train_head(sharp_target, method, data, None, config, draft_vocab_size=128, progress=False)
        assert all(p.dtype == torch.float32 for p in head.parameters())
        runs[precision] = [h["loss"] for h in result.history]
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert fp32 != bf16  # autocast did run
    assert bf16[-1] < 0.5 * bf16[0] and abs(bf16[-1] - fp32[-1]) < 0.1 * fp32[0], (fp32, bf16)
    with pytest.raises(ValueError, match="precision"):
        train_head(sharp_target, method, data, None, TrainConfig(precision="fp16"), draft_vocab_size=128,
                   progress=False)


def test_cached_target_outputs(target):
    """Caching the target's outputs changes nothing in the first epoch and trains on after."""
    data = greedy_examples(target, count=6, seed=4)
    plain = TrainConfig(epochs=1, batch_size=2, ttt_steps=2)
    cached = TrainConfig(epochs=1, batch_size=2, ttt_steps=2, cache_target=True)
    _, ra = train_head(target, "eagle3", data, None, plain, draft_vocab_size=64, progress=False)
    _, rb = train_head(target, "eagle3", data, None, cached, draft_vocab_size=64, progress=False)
    assert [h["loss"] for h in ra.history] == [h["loss"] for h in rb.history]
    two = TrainConfig(epochs=2, batch_size=2, ttt_steps=2, cache_target=True)
    _, rc = train_head(target, "peagle", data, None, two, draft_vocab_size=64, progress=False)
    assert rc.steps == 6


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_time_budget_stops_training(target, clock):
    data = greedy_examples(target, count=4, seed=5)
    config = TrainConfig(epochs=100, batch_size=2, ttt_steps=2, max_seconds=1e-6, clock=clock)
    _, result = train_head(target, "eagle3", data, None, config, draft_vocab_size=64, progress=False)
    assert result.steps == 1 and result.cpu_seconds > 0


def test_agreement_walks_the_engines_anchors():
    """The prefill emits the first reply token; the walk drafts from there, then one past each
    accepted run."""
    correct = torch.tensor([[[True, True, False], [True, True, True], [False, True, True],
                             [True, False, False], [True, True, True], [False, False, False]]])
    counted = torch.ones_like(correct)
    counted[0, 0] = False  # a prompt row; row 1 predicts the first reply token, the walk starts at 2
    a = Agreement.from_grid(correct, torch.ones_like(correct), counted)
    # row 2 accepts 0 -> row 3 accepts 1 -> row 5 accepts 0 -> past the end
    assert a.visits == 3 and a.visited == [1.0, 0.0, 0.0]
    accepted = torch.cumprod(correct.long(), dim=-1).bool() & counted
    assert walk_anchors(accepted, counted[..., 0]) == [[2, 3, 5]]
    assert a.summary()["walk_tau"] == pytest.approx(4 / 3)
    merged = a.merge(a)
    assert merged.visits == 6 and merged.visited_rate == pytest.approx([1 / 3, 0.0, 0.0])


@pytest.mark.parametrize("method,k,passes", [("eagle3", 3, 1), ("peagle", 4, 1), ("peagle", 4, 3)])
def test_walk_acceptance_is_what_the_engine_measures(sharp_target, method, k, passes):
    """Greedy decoding's per-position acceptance is the trainer's agreement at the anchors the
    engine's walk reaches on the same replies (for P-EAGLE in `passes` forwards per draft). Only
    each reply's last draft may differ: the engine counts drafts accepted past max_tokens, which the
    reply does not hold."""
    from aerie.engine import EngineConfig, SamplingParams
    from aerie.engine.build import build_engine

    target = sharp_target
    data = greedy_examples(target, count=6)
    config = TrainConfig(
        epochs=30, batch_size=6, lr=3e-3, peagle_depths=k, eval_depth=k, ttt_steps=2,
        peagle_passes=passes, peagle_fed_ratio=0.5 if passes > 1 else 0.0,
    )
    head, _ = train_head(target, method, data, None, config, draft_vocab_size=VOCAB, progress=False)
    assert method != "peagle" or head.config.draft_passes == passes
    prompts = [e.input_ids[:6] for e in data]
    engine = build_engine(target, EngineConfig(max_slots=1, max_len=64), method, head, k)
    replies = [engine.generate([p], SamplingParams(max_tokens=40))[0].token_ids for p in prompts]
    examples = [Example(p + r, [False] * 6 + [True] * len(r)) for p, r in zip(prompts, replies, strict=True)]
    ev = evaluate(head, target, examples, k)
    engine_rates = engine.spec.per_position_acceptance
    walk = [ev[f"walk_chain_{d}"] for d in range(1, k + 1)]
    assert 0 < engine_rates[-1] and engine_rates[0] < 1
    assert walk[0] == pytest.approx(engine_rates[0])
    assert walk == pytest.approx(engine_rates, abs=len(prompts) / engine.spec.drafts)
