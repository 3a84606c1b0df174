"""What a generation returns, whichever backend (numpy reference or GPU engine) produced it."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddtree.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One stream's output. The first token comes from the prefill; `decode_seconds` covers the rest.

    `accept_lengths` holds one entry per DDTree round (empty for autoregressive decoding), `budgets` the tree budget
    each of those rounds ran at (one value throughout for a fixed budget; chosen per round by `budget="auto"`);
    `text` is the decoded
    tokens when the prompt was text (None for token ids); `stage_seconds` the device time of each DDTree stage
    summed over the rounds, when the GPU engine was asked to profile (shared by the streams of one call).
    """

    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    accept_lengths: list[int] = field(default_factory=list)
    text: str | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)  # device time per DDTree stage, when profiled
    budgets: list[int] = field(default_factory=list)  # the tree budget of each DDTree round

    @property
    def tokens_per_second(self) -> float:
        decoded = len(self.tokens) - 1
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0


def cut_at_stop(tokens: list[int], stops: Collection[int]) -> tuple[list[int], bool]:
    """`tokens` up to and including the first stop token, and whether there was one."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], True
    return tokens, False


def with_text(result: GenerationResult, tokenizer: Tokenizer | None) -> GenerationResult:
    """`result` with its tokens decoded by `tokenizer` (the prompt's, None for token-id prompts)."""
    return result if tokenizer is None else dataclasses.replace(result, text=tokenizer.decode(result.tokens))
