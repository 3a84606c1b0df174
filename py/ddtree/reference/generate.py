"""Reference decoding loops: autoregressive, and DDTree (draft -> tree -> verify -> accept -> commit).

One DDTree round, as the published reference runs it (batch 1):
1. the drafter turns the context rows committed last round and the bonus token into B - 1 per-depth
   distributions; their top-``min(budget, vocab)`` log-softmax values feed ``build_tree``;
2. the target verifies ``[bonus, nodes...]`` at positions ``start + depth`` with ancestor-only visibility over the
   tree block (every node sees the whole committed prefix);
3. the target's choice at every node (argmax at T = 0, one independent sample per node at T > 0) is walked
   from the root; the first choice with no matching child is the next bonus token;
4. the accepted nodes' target KV rows move to the end of the prefix, their tapped hidden states become the
   drafter's next context.
Every emitted token is the target's own choice given its true prefix, so greedy DDTree emits exactly the
greedy autoregressive tokens and sampled DDTree has the autoregressive output distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ddtree.errors import RequestError, check_token_ids
from ddtree.reference.drafter import ReferenceDrafter, draft_top_k
from ddtree.reference.model import ReferenceModel
from ddtree.reference.tree import accept_tree, build_tree, next_context, target_choices, verify_inputs
from ddtree.results import GenerationResult


def generate(model: ReferenceModel, drafter: ReferenceDrafter | None, prompt_ids: Sequence[int] | np.ndarray,
             max_new_tokens: int, method: str = "ar", budget: int | None = None, temperature: float = 0.0,
             seed: int = 0, stop_token_ids: Sequence[int] = (),
             on_tokens: Callable[[int], None] | None = None, draft_window: int | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (fewer when a stop token is emitted; it is
    kept). ``method`` "ar" needs no drafter; "ddtree" runs one round per tree with ``budget`` nodes (default
    block_size - 1, the reference's default) and records each round's acceptance length (accepted nodes
    including the root, as the reference counts it). ``draft_window`` (None: unbounded) lets the drafter attend
    to the last ``draft_window`` committed tokens only. ``on_tokens`` is called with the number of tokens emitted
    so far whenever it grows (progress displays)."""
    prompt = check_token_ids(prompt_ids, model.config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be finite and >= 0, got {temperature}")
    if method not in ("ar", "ddtree"):
        raise RequestError(f"method must be 'ar' or 'ddtree', got {method!r}")
    stops = {int(t) for t in stop_token_ids}
    progress = on_tokens if on_tokens is not None else (lambda count: None)
    rng = np.random.default_rng(seed)
    if method == "ar":
        return _autoregressive(model, prompt, max_new_tokens, temperature, rng, stops, progress)
    if drafter is None:
        raise RequestError("method 'ddtree' needs a drafter")
    c = drafter.config
    if c.hidden_size != model.config.hidden_size or c.vocab_size != model.config.vocab_size or \
            c.num_target_layers != model.config.num_hidden_layers:
        raise RequestError("the drafter does not match the target model (hidden_size, vocab_size or "
                           "num_target_layers differ)")
    budget = c.block_size - 1 if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise RequestError(f"budget must be a non-negative integer, got {budget!r}")
    if draft_window is not None and (isinstance(draft_window, bool) or not isinstance(draft_window, int)
                                     or draft_window < 1):
        raise RequestError(f"draft_window must be a positive integer or None, got {draft_window!r}")
    return _ddtree(model, drafter, prompt, max_new_tokens, budget, temperature, rng, stops, progress,
                   draft_window)


def _finish(tokens: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first stop token; report whether generation is over."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stops:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def _autoregressive(model: ReferenceModel, prompt: np.ndarray, max_new_tokens: int, temperature: float,
                    rng: np.random.Generator, stops: set[int],
                    progress: Callable[[int], None]) -> GenerationResult:
    begin = time.perf_counter()
    cache = model.new_cache()
    tokens: list[int] = []
    if max_new_tokens == 0:
        return GenerationResult(tokens, 0.0, 0.0)
    logits = model.forward(prompt, np.arange(prompt.size), cache).logits[-1:]
    prefill = time.perf_counter() - begin
    while True:
        tokens.append(int(target_choices(logits, temperature, rng)[0]))
        tokens, done = _finish(tokens, max_new_tokens, stops)
        progress(len(tokens))
        if done:
            break
        logits = model.forward([tokens[-1]], [cache.length], cache).logits
    return GenerationResult(tokens, prefill, time.perf_counter() - begin - prefill)


def _ddtree(model: ReferenceModel, drafter: ReferenceDrafter, prompt: np.ndarray, max_new_tokens: int,
            budget: int, temperature: float, rng: np.random.Generator, stops: set[int],
            progress: Callable[[int], None], draft_window: int | None) -> GenerationResult:
    begin = time.perf_counter()
    taps = drafter.config.target_layer_ids
    if max_new_tokens == 0:
        return GenerationResult([], 0.0, 0.0)
    cache = model.new_cache()
    out = model.forward(prompt, np.arange(prompt.size), cache, hidden_layers=taps)
    bonus = int(target_choices(out.logits[-1:], temperature, rng)[0])
    context = next_context([out.hidden[layer] for layer in taps], np.arange(prompt.size))
    prefill = time.perf_counter() - begin
    draft_cache = drafter.new_cache(draft_window)
    start = prompt.size  # committed rows in both caches; the bonus sits at position `start`
    tokens, done = _finish([bonus], max_new_tokens, stops)
    accept_lengths: list[int] = []
    while not done:
        draft_logits = drafter.draft(draft_cache, context, bonus, start)
        log_probs, token_ids = draft_top_k(draft_logits, budget)
        tree = build_tree(log_probs, token_ids, budget)
        ids, positions, visible = verify_inputs(tree, bonus, start)
        out = model.forward(ids, positions, cache, visible=visible, hidden_layers=taps)
        accepted, bonus = accept_tree(tree, target_choices(out.logits, temperature, rng))
        cache.compact(start, accepted)
        context = next_context([out.hidden[layer] for layer in taps], accepted)
        start += accepted.size
        accept_lengths.append(int(accepted.size))
        tokens, done = _finish(tokens + ids[accepted[1:]].tolist() + [bonus], max_new_tokens, stops)
        progress(len(tokens))
    return GenerationResult(tokens, prefill, time.perf_counter() - begin - prefill, accept_lengths)
