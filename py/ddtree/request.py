"""One generation request, checked whole before any work runs: prompt ids, lengths against the model's positions,
method, tree budget, sampling values, and the drafter against its target.

The reference's `generate` and the CLI share these checks; each message names the argument at fault as the
caller calls it (Python parameters by default, the CLI's flags from the CLI) and the config field it meets.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.config import ModelConfig
from ddtree.drafter import DrafterConfig
from ddtree.errors import RequestError, check_token_ids
from ddtree.limits import MAX_TREE_BUDGET, SEED_LIMIT, positions_needed, reference_verify_bytes

METHODS = ("ar", "ddtree")
AUTO = "auto"  # budget="auto": the cost-aware budget per round (ddtree.reference.budget)
# The largest tree of budget "auto" where nothing else bounds it (the reference backend; the CLI's GPU engine).
AUTO_MAX_BUDGET = 64


@dataclass(frozen=True, slots=True)
class ArgumentNames:
    """What messages call a request's parts."""

    prompt: str = "prompt_ids"
    new_tokens: str = "max_new_tokens"
    method: str = "method"
    budget: str = "budget"
    temperature: str = "temperature"
    seed: str = "seed"
    model_config: str = "the model's config.json"
    drafter_config: str = "the drafter's config.json"


@dataclass(frozen=True, slots=True)
class Request:
    prompt: np.ndarray  # int64 [n]
    max_new_tokens: int
    method: str
    budget: int  # DDTree nodes per round (with auto budgets the largest); 0 for autoregressive decoding
    temperature: float
    seed: int
    auto_budgets: tuple[int, ...] = ()  # budget "auto": the candidates each round's budget is chosen among


def _is_integer(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_stop_ids(ids: Sequence[int], vocab_size: int, name: str = "stop_token_ids") -> list[int]:
    """Stop token ids as a list of ints (empty: none); RequestError naming the bad id otherwise."""
    return [] if len(ids) == 0 else check_token_ids(ids, vocab_size, name).tolist()


def check_seed(seed: object, name: str = "seed") -> int:
    if not _is_integer(seed) or not 0 <= seed < SEED_LIMIT:
        raise RequestError(f"{name} must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def check_temperature(temperature: object, name: str = "temperature") -> float:
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool) or \
            not np.isfinite(temperature) or temperature < 0:
        raise RequestError(f"{name} must be a finite number >= 0, got {temperature!r}")
    return float(temperature)


def check_request(model: ModelConfig, drafter: DrafterConfig | None, prompt_ids: Sequence[int] | np.ndarray,
                  max_new_tokens: object, method: object = "ar", budget: object = None, temperature: object = 0.0,
                  seed: object = 0, names: ArgumentNames = ArgumentNames()) -> Request:
    """The request, checked; RequestError naming the first argument at fault otherwise. `budget` None is the
    drafter's default (block_size - 1) for DDTree and must stay None for autoregressive decoding; "auto" chooses each
    round's budget among default_candidates(AUTO_MAX_BUDGET) (8, 16, 32, 64)."""
    prompt = check_token_ids(prompt_ids, model.vocab_size, names.prompt)
    if not _is_integer(max_new_tokens) or max_new_tokens < 0:
        raise RequestError(f"{names.new_tokens} must be a non-negative integer, got {max_new_tokens!r}")
    new_tokens = int(max_new_tokens)
    if method not in METHODS:
        raise RequestError(f"{names.method} must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    checked_temperature, checked_seed = check_temperature(temperature, names.temperature), check_seed(seed, names.seed)
    if method == "ar":
        if budget is not None:
            raise RequestError(f"{names.budget} applies to {names.method} 'ddtree' only")
        _check_positions(prompt.size, new_tokens, None, model.max_position_embeddings, names.model_config, names)
        return Request(prompt, new_tokens, "ar", 0, checked_temperature, checked_seed)
    if drafter is None:
        raise RequestError(f"{names.method} 'ddtree' needs a drafter")
    _check_drafter_matches(model, drafter, names)
    budget = drafter.block_size - 1 if budget is None else budget
    autos: tuple[int, ...] = ()
    if budget == AUTO:
        from ddtree.reference.budget import default_candidates  # here: importing ddtree.reference imports this module

        autos = default_candidates(AUTO_MAX_BUDGET)
        budget = autos[-1]
    _check_budget(model, budget, prompt.size + new_tokens, names)
    for max_positions, config in ((model.max_position_embeddings, names.model_config),
                                  (drafter.max_position_embeddings, names.drafter_config)):
        _check_positions(prompt.size, new_tokens, drafter.block_size, max_positions, config, names)
    return Request(prompt, new_tokens, "ddtree", int(budget), checked_temperature, checked_seed, autos)


def _check_drafter_matches(model: ModelConfig, drafter: DrafterConfig, names: ArgumentNames) -> None:
    for field, mine, theirs in (("hidden_size", drafter.hidden_size, model.hidden_size),
                                ("vocab_size", drafter.vocab_size, model.vocab_size),
                                ("num_target_layers", drafter.num_target_layers, model.num_hidden_layers)):
        if mine != theirs:
            target_field = "num_hidden_layers" if field == "num_target_layers" else field
            raise RequestError(f"{names.drafter_config}: {field} is {mine}, but {target_field} of "
                               f"{names.model_config} is {theirs}: the drafter was made for another target")


def _check_budget(model: ModelConfig, budget: object, context: int, names: ArgumentNames) -> None:
    if not _is_integer(budget) or budget < 0:
        raise RequestError(f"{names.budget} must be a non-negative integer or {AUTO!r}, got {budget!r}")
    if budget > MAX_TREE_BUDGET:
        need = reference_verify_bytes(model, int(budget), context)
        raise RequestError(f"{names.budget} {budget} is more than the maximum tree budget {MAX_TREE_BUDGET}: one "
                           f"round would verify {budget + 1} rows, which needs at least {_gib(need)} in "
                           f"the reference backend for this model (float32 attention scores of "
                           f"{model.num_attention_heads} heads and logits over {model.vocab_size} tokens)")


def _gib(size: int) -> str:
    """Bytes in GiB to one decimal (rounded down), in integer arithmetic: no float overflows for absurd sizes."""
    tenths = size * 10 >> 30
    return f"{tenths // 10}.{tenths % 10} GiB"


def _check_positions(prompt_length: int, new_tokens: int, block: int | None, max_positions: int, config: str,
                     names: ArgumentNames) -> None:
    """`block` is the drafter's block size for DDTree, None for autoregressive decoding."""
    need = positions_needed(prompt_length, new_tokens, block)
    if need > max_positions:
        reach = "" if block is None else f" ({block - 2} of them for the last draft block of block_size {block})"
        raise RequestError(f"{names.prompt} ({prompt_length} ids) and {names.new_tokens} {new_tokens} need "
                           f"{need} positions{reach}, more than max_position_embeddings {max_positions} of "
                           f"{config}")
