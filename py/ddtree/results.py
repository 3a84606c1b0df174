"""What a generation returns, whichever backend (numpy reference or GPU engine) produced it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One stream's output. The first token comes from the prefill; `decode_seconds` covers the rest.

    `accept_lengths` holds one entry per DDTree round (empty for autoregressive decoding).
    """

    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    accept_lengths: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        decoded = len(self.tokens) - 1
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0
