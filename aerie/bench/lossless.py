"""The lossless check: at temperature 0 every variant's output ids equal the baseline's, prompt by
prompt. The reference for a prompt is the baseline's first output for it; every request of every
other cell (warm-up ones included) is compared with it. A mismatch or a failed request fails the
variant, with the prompts and the first differing position named."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SHOWN = 5  # mismatches kept per variant in the verdict


@dataclass
class Mismatch:
    prompt: int
    round: int
    concurrency: int
    position: int
    """First index where the output differs from the baseline's (or where the shorter one ends)."""
    expected: int | None
    got: int | None
    error: str | None = None


@dataclass
class Verdict:
    variant: str
    lossless: bool
    checked: int = 0
    mismatched_prompts: list[int] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    failed_requests: int = 0

    def summary(self) -> str:
        if self.lossless:
            return f"{self.variant}: lossless ({self.checked} outputs equal the baseline's)"
        first = self.mismatches[0] if self.mismatches else None
        where = ""
        if first is not None:
            where = (f"; e.g. prompt {first.prompt} (round {first.round}, concurrency {first.concurrency}): "
                     + (first.error or f"token {first.position} is {first.got}, the baseline's is {first.expected}"))
        return (f"{self.variant}: NOT LOSSLESS: {len(self.mismatched_prompts)} prompt(s) "
                f"{self.mismatched_prompts[:10]} differ from the baseline, {self.failed_requests} request(s) "
                f"failed{where}")

    def to_dict(self) -> dict:
        return asdict(self)


def first_difference(expected: list[int], got: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return position
    return None if len(expected) == len(got) else min(len(expected), len(got))


def check_lossless(cells: list[dict], baseline: str) -> dict[str, Verdict]:
    """`cells`: dicts with `variant`, `round`, `concurrency` and `requests` (each with `prompt`,
    `token_ids`, `error`). Returns a verdict per variant, the baseline's judged against its own
    first outputs (a baseline that disagrees with itself is not batch-invariant)."""
    reference: dict[int, list[int]] = {}
    for cell in sorted((c for c in cells if c["variant"] == baseline), key=lambda c: (c["round"], c["concurrency"])):
        for request in cell["requests"]:
            if request["error"] is None:
                reference.setdefault(request["prompt"], request["token_ids"])
    verdicts: dict[str, Verdict] = {}
    for cell in cells:
        verdict = verdicts.setdefault(cell["variant"], Verdict(cell["variant"], True))
        for request in cell["requests"]:
            verdict.checked += 1
            prompt = request["prompt"]
            expected = reference.get(prompt)
            if request["error"] is not None or expected is None:
                verdict.failed_requests += request["error"] is not None
                mismatch = Mismatch(prompt, cell["round"], cell["concurrency"], 0, None, None,
                                    request["error"] or "the baseline has no output for this prompt")
            else:
                position = first_difference(expected, request["token_ids"])
                if position is None:
                    continue
                got = request["token_ids"]
                mismatch = Mismatch(prompt, cell["round"], cell["concurrency"], position,
                                    expected[position] if position < len(expected) else None,
                                    got[position] if position < len(got) else None)
            verdict.lossless = False
            if prompt not in verdict.mismatched_prompts:
                verdict.mismatched_prompts.append(prompt)
            if len(verdict.mismatches) < SHOWN:
                verdict.mismatches.append(mismatch)
    for verdict in verdicts.values():
        verdict.mismatched_prompts.sort()
    return verdicts
