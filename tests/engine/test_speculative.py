"""Speculative decoding is lossless: greedy output equals the baseline token for token, and
sampled output is distributed as the target's own."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from random_models import hf_greedy, random_model, random_prompts, trained_heads
from stats import chi_square_pvalue

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine
from aerie.engine.sampling import adjusted_probs
from aerie.engine.tree import TreeProposer
from aerie.engine.verify import verify_sampled, verify_tree_sampled
from aerie.target import Target, load_target
from aerie.target.segmented_attention import CALL_COST_COLUMNS

LENGTHS = [5, 23, 9, 41, 3, 17, 30, 11]
NEW_TOKENS = 24
CONFIG = EngineConfig(max_slots=3, max_len=128, prefill_tokens=16)
METHODS = ("eagle3", "peagle", "eagle")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=8)


@pytest.fixture(scope="module")
def baseline(llama_with_heads, prompts):
    target, _ = llama_with_heads
    return [hf_greedy(target.model, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_baseline(llama_with_heads, prompts, baseline, method, k):
    target, heads = llama_with_heads
    engine = build_engine(target, CONFIG, method, heads[method], k)
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == baseline
    per_request = {r.spec.accepted_tokens / max(r.spec.drafts, 1) for r in results}
    assert engine.spec.accepted_tokens > 0 and len(per_request) > 1, "slots should accept different counts"
    assert engine.spec.acceptance_length == pytest.approx(1 + engine.spec.accepted_tokens / engine.spec.drafts)


def refining(head, passes: int):
    """A copy of a P-EAGLE head that drafts in `passes` forwards."""
    head = copy.deepcopy(head)
    head.config = head.config.model_copy(update={"draft_passes": passes})
    return head


@pytest.mark.parametrize("passes", [2, 3])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_refined_peagle_drafts_equal_baseline(llama_with_heads, prompts, baseline, passes, k):
    target, heads = llama_with_heads
    engine = build_engine(target, CONFIG, "peagle", refining(heads["peagle"], passes), k)
    assert engine.proposer.passes == passes
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == baseline
    assert engine.spec.accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_with_attention_in_runs_of_rows_equals_baseline(
    llama_with_heads, prompts, baseline, method, monkeypatch
):
    """Target and head attention cut into the most runs (calls cost nothing), 6 rows of 3-41 tokens."""
    monkeypatch.setitem(CALL_COST_COLUMNS, "cpu", 0)
    target, heads = llama_with_heads
    config = EngineConfig(max_slots=6, max_len=128, prefill_tokens=64)
    engine = build_engine(target, config, method, heads[method], 4)
    cache, bind, cut = engine.proposer.cache, engine.proposer.cache.bind, []

    def spying_bind(*args, **kwargs):
        bind(*args, **kwargs)
        cut.append(cache.segments is not None)

    cache.bind = spying_bind
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == baseline
    assert any(cut) or method == "eagle"  # the EAGLE head drafts a tree: one call over the batch


@pytest.mark.parametrize("method", METHODS)
def test_the_head_keeps_up_with_prefills(llama_with_heads, prompts, baseline, method):
    """Prompts of up to 41 tokens prefilled 16 at a time: the head processes each chunk with the
    target's prefill, so no draft starts by catching up on a whole prompt."""
    target, heads = llama_with_heads
    engine = build_engine(target, CONFIG, method, heads[method], 3)
    width, propose, widths = engine.proposer.catch_up_width, engine.proposer.propose, []

    def spying_propose(rows, k):
        widths.append(width(rows))
        return propose(rows, k)

    engine.proposer.propose = spying_propose
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == baseline
    assert widths and max(widths) <= 3 + 2, widths  # the last draft's accepted tokens, the bonus, the first token


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_greedy_speculation_on_other_architectures(arch, prompts):
    target = Target(random_model(arch, seed=2))
    heads = trained_heads(target, METHODS, epochs=4)
    expected = [hf_greedy(target.model, p, NEW_TOKENS) for p in prompts[:5]]
    for method in METHODS:
        for k in (1, 3, 5):
            engine = build_engine(target, CONFIG, method, heads[method], k)
            results = engine.generate(prompts[:5], SamplingParams(max_tokens=NEW_TOKENS))
            assert [r.token_ids for r in results] == expected, (method, k)


def test_greedy_speculation_on_the_tiny_target(tiny_target_dir, prompts):
    target = load_target(tiny_target_dir)
    heads = trained_heads(target, METHODS, epochs=2)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    expected = [r.token_ids for r in build_engine(target, CONFIG, "none").generate(prompts, params)]
    for method in METHODS:
        for k in (1, 3, 5):
            results = build_engine(target, CONFIG, method, heads[method], k).generate(prompts, params)
            assert [r.token_ids for r in results] == expected, (method, k)


def test_seeded_speculative_sampling_is_reproducible(llama_with_heads, prompts):
    target, heads = llama_with_heads
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(len(prompts))]
    first = build_engine(target, CONFIG, "eagle3", heads["eagle3"], 3).generate(prompts, params)
    second = build_engine(target, EngineConfig(max_slots=8, max_len=128), "eagle3", heads["eagle3"], 3).generate(
        prompts, params
    )
    assert [r.token_ids for r in first] == [r.token_ids for r in second]


@pytest.mark.parametrize("method", [*METHODS, "peagle:2"])
def test_first_speculated_token_is_distributed_as_target(llama_with_heads, method):
    """The second output token is the first one a speculative step produces (chain or tree);
    its marginal over the first token's distribution must equal the target's. `peagle:2`: a
    P-EAGLE head drafting in two passes."""
    target, heads = llama_with_heads
    samples, temperature = 2500, 0.8
    prompt = random_prompts([6], seed=21)[0]
    method, _, passes = method.partition(":")
    head = refining(heads[method], int(passes)) if passes else heads[method]
    engine = build_engine(target, EngineConfig(max_slots=64, max_len=24), method, head, 3)
    params = [SamplingParams(max_tokens=2, temperature=temperature, seed=s) for s in range(samples)]
    seconds = np.array([r.token_ids[1] for r in engine.generate([prompt] * samples, params)])
    assert engine.spec.accepted_tokens > 0

    vocab, t, top_p = target.vocab_size, torch.tensor([temperature]), torch.tensor([1.0])
    with torch.no_grad():
        p_first = adjusted_probs(target.model(torch.tensor([prompt])).logits[0, -1:], t, top_p)[0]
        second_logits = target.model(torch.tensor([prompt + [tok] for tok in range(vocab)])).logits[:, -1]
        p_second = (p_first[:, None] * adjusted_probs(second_logits, t.expand(vocab), top_p.expand(vocab))).sum(0)
    assert chi_square_pvalue(np.bincount(seconds, minlength=vocab), p_second.double().numpy()) > 1e-3


def _peaked(vocab: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2, -1)


def test_chain_rejection_sampling_first_and_second_positions():
    vocab, samples = 12, 20000
    p = torch.stack([_peaked(vocab, 1), _peaked(vocab, 2), _peaked(vocab, 3)])[None]
    q = torch.stack([_peaked(vocab, 4), _peaked(vocab, 5)])[None]

    def run(generator):
        drafts = torch.stack([torch.multinomial(q[0, i], 1, generator=generator)[0] for i in range(2)])[None]
        uniforms = torch.rand(1, 3, generator=generator, dtype=torch.float64)
        accepted, emitted = verify_sampled(p, drafts, q, uniforms)
        assert emitted[0, : int(accepted[0])].tolist() == drafts[0, : int(accepted[0])].tolist()
        return emitted[0, : int(accepted[0]) + 1].tolist()

    first = np.zeros(vocab)
    second_given = np.zeros(vocab)
    for seed in range(samples):
        out = run(torch.Generator().manual_seed(seed))
        first[out[0]] += 1
        if len(out) > 1:
            second_given[out[1]] += 1
    assert chi_square_pvalue(first, p[0, 0].double().numpy()) > 1e-3
    # Whenever a second token comes out of the same step, the first was an accepted draft, and the
    # target's distribution at position 2 is p[1] (the synthetic context does not depend on it).
    assert chi_square_pvalue(second_given, p[0, 1].double().numpy()) > 1e-3


def test_tree_sibling_rejection_sampling_first_and_second_positions():
    vocab, samples = 10, 20000
    # root -> nodes 0, 1, 2 (tokens 3, 7, 1); node 0 -> nodes 3, 4 (tokens 2, 5)
    tokens = torch.tensor([[3, 7, 1, 2, 5]])
    parents = torch.tensor([[-1, -1, -1, 0, 0]])
    target_probs = [_peaked(vocab, s) for s in range(6)]
    logits = torch.stack(target_probs).log()[None]

    def run(generator):
        [(path, token)] = verify_tree_sampled(
            logits, tokens, parents, torch.tensor([1.0]), torch.tensor([1.0]), [generator]
        )
        return [int(tokens[0, i]) for i in path] + [token]

    first = np.zeros(vocab)
    second_after_node0 = np.zeros(vocab)
    for seed in range(samples):
        out = run(torch.Generator().manual_seed(seed))
        first[out[0]] += 1
        if out[0] == 3 and len(out) > 1:
            second_after_node0[out[1]] += 1
    assert chi_square_pvalue(first, target_probs[0].double().numpy()) > 1e-3
    assert chi_square_pvalue(second_after_node0, target_probs[1].double().numpy()) > 1e-3


def test_tree_selection_keeps_every_parent_at_any_score_magnitude():
    """Children whose score equals their parent's (a draft probability of ~1) at |score| >= 16,
    where a 1e-6 x depth tie-break vanishes in float32: parents still rank first."""
    tokens = [torch.tensor([[10, 11, 12, 13]]), torch.tensor([[20, 21, 22, 23]])]
    scores = [torch.tensor([[-20.0, -30.0, -40.0, -50.0]]), torch.full((1, 4), -20.0)]
    parents = [torch.full((1, 4), -1), torch.zeros(1, 4, dtype=torch.long)]
    depths = [torch.ones(1, 4, dtype=torch.long), torch.full((1, 4), 2)]
    for size in range(1, 8):
        draft = TreeProposer._select(tokens, scores, parents, depths, size, 2)
        kept = draft.tokens[0].tolist()
        assert kept[0] == 10, (size, kept)
        assert all(p < i for i, p in enumerate(draft.parents[0].tolist())), (size, draft.parents)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tree_with_a_head_sure_of_itself_stays_lossless(llama_with_heads, prompts, baseline, method):
    """A head whose top logit leads by far more than 20 ties children with parents everywhere."""
    target, heads = llama_with_heads
    head = copy.deepcopy(heads[method])
    with torch.no_grad():
        head.lm_head.weight.mul_(200.0)
    engine = build_engine(target, CONFIG, method, head, 4, tree=True)
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == baseline
