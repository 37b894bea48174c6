"""Which prompts a step prefills: padded tokens within the budget, the oldest first, most tokens fed."""

from aerie.engine.request import Request, SamplingParams, Status
from aerie.engine.scheduler import Scheduler


def admitted(*prompt_lengths: int, slots: int = 8) -> tuple[Scheduler, list[Request]]:
    scheduler = Scheduler(slots)
    requests = [Request(prompt_ids=[1] * n, params=SamplingParams()) for n in prompt_lengths]
    for request in requests:
        scheduler.add(request)
    scheduler.admit()
    return scheduler, requests


def padded(batch: dict[Request, int]) -> int:
    return len(batch) * max(batch.values())


def feed(batch: dict[Request, int]) -> None:
    for request, n in batch.items():
        request.prefilled += n
        if request.prefilled == len(request.prompt_ids):
            request.status = Status.DECODING


def test_one_long_prompt_does_not_pad_the_short_ones_to_its_width() -> None:
    scheduler, (long, *short) = admitted(600, 20, 30, 16, 25)
    first = scheduler.prefill_batch(512)
    assert first == {long: 512}  # the most prompt tokens 512 padded ones can carry
    feed(first)
    second = scheduler.prefill_batch(512)
    assert second == {long: 88} | {r: len(r.prompt_ids) for r in short} and padded(second) == 5 * 88
    # one forward padded every row to 512 before: 2560 tokens for 691 of prompt, now 952


def test_the_oldest_row_always_progresses_and_the_prefill_takes_few_steps() -> None:
    scheduler, (long, short) = admitted(1000, 8)
    steps = 0
    while scheduler.in_status(Status.PREFILLING):
        batch = scheduler.prefill_batch(256)
        assert padded(batch) <= 256 and (long in batch or long.status is Status.DECODING)
        feed(batch)
        steps += 1
    assert steps == 5  # 1008 tokens at 256 a step


def test_rows_come_in_slot_order_and_only_prefilling_ones() -> None:
    scheduler, requests = admitted(40, 40, 40)
    requests[1].status = Status.DECODING
    assert list(scheduler.prefill_batch(512)) == [requests[0], requests[2]]
    assert scheduler.prefill_batch(40) == {requests[0]: 40}
