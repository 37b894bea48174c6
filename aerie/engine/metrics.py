"""What the engine counts: speculation per request and per engine (as vLLM counts it), and
per-step statistics that keep acceptance figures honest when K varies from step to step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    """Speculation counters, counted the way vLLM counts them."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens gained per target forward: 1 + accepted / drafts (the bonus token counts)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / proposed draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [count / self.drafts for count in self.accepted_per_position] if self.drafts else []


@dataclass
class StepStats:
    """Engine-wide, per step: how many steps ran, how many of them decoded, the draft length K of
    each decoding step (0: no speculation that step), and the tokens decoding rows produced."""

    steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    decode_tokens: int = 0
    k_histogram: Counter[int] = field(default_factory=Counter)

    def record_decode(self, k: int, rows: int, tokens: int) -> None:
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_tokens += tokens
        self.k_histogram[k] += 1

    @property
    def tokens_per_row_step(self) -> float | None:
        """Mean tokens a decoding row gains per step (1.0 without speculation)."""
        return self.decode_tokens / self.decode_rows if self.decode_rows else None
