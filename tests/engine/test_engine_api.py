"""Engine behaviour beyond the tokens: memory bounds, errors, stops, streaming, cancellation."""

from __future__ import annotations

import pytest
from random_models import hf_greedy, random_model, random_prompts

from aerie.engine import Engine, EngineConfig, SamplingParams
from aerie.target import Target


@pytest.fixture(scope="module")
def model():
    return random_model("qwen3", seed=5)


def test_cache_memory_is_fixed_by_slots_and_max_len(model):
    target = Target(model)
    engine = Engine(target, EngineConfig(max_slots=4, max_len=100))
    config = model.config
    per_column = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert engine.cache.nbytes() == 4 * (100 + 1) * per_column
    engine.generate(random_prompts([30, 30, 30, 30, 30, 30]), SamplingParams(max_tokens=60))
    assert engine.cache.nbytes() == 4 * (100 + 1) * per_column


def test_request_longer_than_cache_is_refused_clearly(model):
    engine = Engine(Target(model), EngineConfig(max_slots=2, max_len=50))
    with pytest.raises(ValueError, match=r"needs 60 tokens \(prompt 40 \+ max_tokens 20\).*max_len is 50"):
        engine.add_request(random_prompts([40])[0], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_stop_token_ids_end_the_request_inclusively(model):
    prompt = random_prompts([8])[0]
    reference = hf_greedy(model, prompt, 12)
    stop = reference[5]
    engine = Engine(Target(model), EngineConfig(max_slots=2, max_len=64))
    [result] = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    cut = reference.index(stop) + 1
    assert result.token_ids == reference[:cut]
    assert result.finish_reason == "stop"


def test_streamed_deltas_add_up_and_cancel_frees_the_slot(model):
    prompts = random_prompts([6, 9, 12])
    engine = Engine(Target(model), EngineConfig(max_slots=2, max_len=64))
    ids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in prompts]
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    finished = {}
    for _ in range(3):
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
    cancelled = engine.cancel(ids[0])
    assert cancelled is not None and cancelled.finished and cancelled.finish_reason == "abort"
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {ids[1]: "length", ids[2]: "length"}
    for request_id, prompt in zip(ids[1:], prompts[1:], strict=True):
        assert streamed[request_id] == hf_greedy(model, prompt, 10)
    assert 0 < len(streamed[ids[0]]) < 10
    assert engine.cancel(ids[0]) is None


def test_finished_requests_leave_the_engine_and_a_failed_generate_leaves_nothing_queued(model):
    engine = Engine(Target(model), EngineConfig(max_slots=2, max_len=40))
    engine.generate(random_prompts([5, 6, 7]), SamplingParams(max_tokens=4))
    assert engine.requests == {} and not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_len"):
        engine.generate(random_prompts([5, 39]), SamplingParams(max_tokens=4))
    assert engine.requests == {} and not engine.has_unfinished()
    [again] = engine.generate(random_prompts([5]), SamplingParams(max_tokens=4))
    assert len(again.token_ids) == 4


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([1, 2, 10_000], {}, "prompt"),
        ([1, -3], {}, "prompt"),
        ([1, 2.5], {}, "prompt"),
        ([], {}, "prompt"),
        ("text", {}, "prompt"),  # the random model has no tokenizer
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"max_tokens": 500}, "max_tokens"),
        ([1, 2], {"temperature": float("nan")}, "temperature"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"top_p": float("nan")}, "top_p"),
        ([1, 2], {"stop": ("\n",)}, "stop"),  # stop strings need a tokenizer
    ],
)
def test_hostile_requests_are_refused_before_they_are_registered(model, prompt, params, field):
    engine = Engine(Target(model), EngineConfig(max_slots=2, max_len=128))
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, SamplingParams(**params))
    assert engine.requests == {} and not engine.has_unfinished()


def test_a_failing_request_finishes_with_an_error_and_the_others_go_on(model):
    """A failure planted in the target forward whenever one request's slot is in the batch: that
    request ends with finish_reason "error", the others finish exactly as without it."""
    target = Target(model)
    prompts = random_prompts([6, 9, 12, 7])
    expected = [hf_greedy(model, p, 10) for p in prompts]
    engine = Engine(target, EngineConfig(max_slots=4, max_len=64))
    ids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in prompts]
    forward, bind = target.forward, engine.cache.bind
    bound: list[int] = []

    def recording_bind(slot_ids, *args, **kwargs):
        bound[:] = slot_ids
        return bind(slot_ids, *args, **kwargs)

    def planted(*args, **kwargs):
        culprit = engine.requests.get(ids[1])
        if culprit is not None and culprit.slot in bound:
            raise RuntimeError("planted failure")
        return forward(*args, **kwargs)

    engine.cache.bind, target.forward = recording_bind, planted
    produced: dict[str, list[int]] = {i: [] for i in ids}
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            produced[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = (out.finish_reason, out.error)
    assert finished[ids[1]] == ("error", "RuntimeError: planted failure")
    for index in (0, 2, 3):
        assert finished[ids[index]] == ("length", None)
        assert produced[ids[index]] == expected[index]
    assert engine.requests == {}
