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
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import numpy as np

from ddtree.errors import NonFiniteError, RequestError
from ddtree.reference.budget import BudgetPolicy, LaggedPolicy, probe_masses, rows_cost
from ddtree.reference.drafter import ReferenceDrafter, draft_top_k
from ddtree.reference.model import ReferenceModel
from ddtree.reference.sampling import target_choices
from ddtree.reference.tree import accept_tree, build_tree, next_context, verify_inputs
from ddtree.request import check_request, check_stop_ids
from ddtree.results import GenerationResult, cut_at_stop, with_text
from ddtree.tokenizer import encode_prompts


def generate(model: ReferenceModel, drafter: ReferenceDrafter | None, prompt_ids: Sequence[int] | np.ndarray,
             max_new_tokens: int, method: str = "ar", budget: int | None = None, temperature: float = 0.0,
             seed: int = 0, stop_token_ids: Sequence[int] = (),
             on_tokens: Callable[[list[int]], None] | None = None,
             draft_window: int | None = None, stream: int = 0) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (fewer when a stop token is emitted; it is
    kept). ``prompt_ids`` may be text, encoded with the tokenizer of the model's checkpoint directory; the result
    then holds the decoded text too. ``method`` "ar" needs no drafter; "ddtree" runs one round per tree with
    ``budget`` nodes (default block_size - 1, the reference's default; "auto": each round's budget among 8, 16, 32,
    64 by the cost-aware policy of ``ddtree.reference.budget``, with the round time in rows, ``rows_cost``) and
    records each round's acceptance length (accepted nodes including the root, as the reference counts it) and
    budget. ``draft_window`` (None: unbounded) lets the drafter attend to the last ``draft_window`` committed tokens
    only. ``on_tokens`` is called with the tokens emitted so far whenever they grow (progress displays, streamed
    text). At temperature > 0 each token's Gumbel noise is keyed by (``seed``, ``stream``, its position), as the
    GPU engine keys stream ``stream`` of a batch (``ddtree.reference.sampling``): DDTree and autoregressive
    decoding then draw the same tokens.

    The whole request is checked before any forward runs (``ddtree.request.check_request``); logits that are not
    finite raise NonFiniteError naming the position, instead of decoding NaN as token 0."""
    [prompt], tokenizer = encode_prompts([prompt_ids], model.model_dir)
    request = check_request(model.config, drafter.config if drafter is not None else None, prompt,
                            max_new_tokens, method, budget, temperature, seed)
    stops = set(check_stop_ids(stop_token_ids, model.config.vocab_size))
    if draft_window is not None and (isinstance(draft_window, bool) or not isinstance(draft_window, int)
                                     or draft_window < 1):
        raise RequestError(f"draft_window must be a positive integer or None, got {draft_window!r}")
    progress = on_tokens if on_tokens is not None else (lambda tokens: None)
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 1 << 31:
        raise RequestError(f"stream must be an integer in [0, 2**31), got {stream!r}")
    sampling = Sampling(request.temperature, request.seed, stream)
    if request.method == "ar":
        result = _autoregressive(model, request.prompt, request.max_new_tokens, sampling, stops, progress)
    else:
        assert drafter is not None  # check_request refuses DDTree without one
        policy = None
        if request.auto_budgets:
            costs = rows_cost(request.auto_budgets, drafter.config.block_size)
            policy = LaggedPolicy(BudgetPolicy(request.auto_budgets, costs))
        result = _ddtree(model, drafter, request.prompt, request.max_new_tokens, request.budget, sampling, stops,
                         progress, draft_window, policy)
    return with_text(result, tokenizer)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    seed: int
    stream: int

    def choose(self, logits: np.ndarray, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        return target_choices(logits, self.temperature, self.seed, self.stream, positions)


def _finite(logits: np.ndarray, positions: Sequence[int] | np.ndarray, source: str) -> np.ndarray:
    """`logits` [rows, vocab], row i computed at `positions[i]`; NonFiniteError at the first row with a NaN or
    infinite value (argmax would quietly read NaN as token 0)."""
    bad = np.flatnonzero(~np.isfinite(logits).all(axis=1))
    if bad.size:
        row = logits[bad[0]]
        value = row[~np.isfinite(row)][0]
        raise NonFiniteError(f"the {source}'s logits at position {int(positions[bad[0]])} hold {value}: its weights "
                             f"or config.json give non-finite values")
    return logits


def _finish(tokens: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first stop token; report whether generation is over."""
    kept, stopped = cut_at_stop(tokens[:max_new_tokens], stops)
    return kept, stopped or len(tokens) >= max_new_tokens


def _autoregressive(model: ReferenceModel, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling,
                    stops: set[int], progress: Callable[[list[int]], None]) -> GenerationResult:
    begin = time.perf_counter()
    cache = model.new_cache()
    tokens: list[int] = []
    if max_new_tokens == 0:
        return GenerationResult(tokens, 0.0, 0.0)
    logits = model.forward(prompt, np.arange(prompt.size), cache).logits[-1:]
    logits = _finite(logits, [prompt.size - 1], "target model")
    prefill = time.perf_counter() - begin
    position = prompt.size - 1  # of the row whose logits choose the next token
    while True:
        tokens.append(int(sampling.choose(logits, [position])[0]))
        tokens, done = _finish(tokens, max_new_tokens, stops)
        progress(tokens)
        if done:
            break
        position = cache.length
        logits = _finite(model.forward([tokens[-1]], [position], cache).logits, [position], "target model")
    return GenerationResult(tokens, prefill, time.perf_counter() - begin - prefill)


def _ddtree(model: ReferenceModel, drafter: ReferenceDrafter, prompt: np.ndarray, max_new_tokens: int,
            budget: int, sampling: Sampling, stops: set[int], progress: Callable[[list[int]], None],
            draft_window: int | None, policy: LaggedPolicy | None = None) -> GenerationResult:
    """With `policy`, each round's budget is the policy's (`budget` is the largest, the top-K width of every round,
    as the engine's auto rounds draft), and each round's probe and accept length go back to it."""
    begin = time.perf_counter()
    taps = drafter.config.target_layer_ids
    if max_new_tokens == 0:
        return GenerationResult([], 0.0, 0.0)
    cache = model.new_cache()
    out = model.forward(prompt, np.arange(prompt.size), cache, hidden_layers=taps)
    last = [prompt.size - 1]
    bonus = int(sampling.choose(_finite(out.logits[-1:], last, "target model"), last)[0])
    context = next_context([out.hidden[layer] for layer in taps], np.arange(prompt.size))
    prefill = time.perf_counter() - begin
    draft_cache = drafter.new_cache(draft_window)
    start = prompt.size  # committed rows in both caches; the bonus sits at position `start`
    tokens, done = _finish([bonus], max_new_tokens, stops)
    accept_lengths: list[int] = []
    budgets: list[int] = []
    while not done:
        round_budget = policy.next_budget() if policy is not None else budget
        draft_logits = _finite(drafter.draft(draft_cache, context, bonus, start),
                               start + np.arange(1, drafter.config.block_size), "drafter")
        log_probs, token_ids = draft_top_k(draft_logits, budget)
        tree = build_tree(log_probs, token_ids, round_budget)
        ids, positions, visible = verify_inputs(tree, bonus, start)
        out = model.forward(ids, positions, cache, visible=visible, hidden_layers=taps)
        choices = sampling.choose(_finite(out.logits, positions, "target model"), positions)
        accepted, bonus = accept_tree(tree, choices)
        cache.compact(start, accepted)
        context = next_context([out.hidden[layer] for layer in taps], accepted)
        start += accepted.size
        accept_lengths.append(int(accepted.size))
        budgets.append(round_budget)
        if policy is not None:
            policy.finished_round(probe_masses(log_probs, token_ids, policy.policy.candidates), int(accepted.size),
                                  round_budget)
        tokens, done = _finish(tokens + ids[accepted[1:]].tolist() + [bonus], max_new_tokens, stops)
        progress(tokens)
    return GenerationResult(tokens, prefill, time.perf_counter() - begin - prefill, accept_lengths,
                            budgets=budgets)
