"""The limits a generation request must respect, each decided here once for the numpy reference, the CLI and the
GPU engine (this module imports nothing that needs a GPU)."""

from __future__ import annotations

from ddtree.config import ModelConfig

# The most DDTree nodes one round may draft and verify per stream, whatever the backend. A round verifies
# budget + 1 rows per stream, and the reference's attention scores grow with the square of that
# (reference_verify_bytes): budget 100000 on the tiny preset would need 149 GiB.
MAX_TREE_BUDGET = 1024
# The most stop token ids one GPU generation takes (the round checks each committed token against them on the
# device).
MAX_STOP_IDS = 64
# Seeds key the GPU engine's sampling noise as uint64.
SEED_LIMIT = 1 << 64
FLOAT32_BYTES = 4


def positions_needed(prompt_length: int, max_new_tokens: int, block_size: int | None = None) -> int:
    """Positions a request occupies: one per prompt token and per new token and, for DDTree with drafter blocks of
    `block_size`, the block_size - 2 positions the last round's block reaches past the last new token (that
    round starts at the token before it, and its block spans block_size positions)."""
    draft_reach = 0 if block_size is None else block_size - 2
    return prompt_length + max_new_tokens + draft_reach


def reference_verify_bytes(cfg: ModelConfig, budget: int, context: int) -> int:
    """A lower bound on the memory one DDTree verify of `budget` nodes takes in the reference backend after
    `context` committed tokens: one layer's float32 attention scores (heads x rows x keys) and the float32 logits
    (rows x vocab), for budget + 1 rows."""
    rows = budget + 1
    return FLOAT32_BYTES * rows * (cfg.num_attention_heads * (context + rows) + cfg.vocab_size)
