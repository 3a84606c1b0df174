"""The GPU engine end to end: greedy tokens against the numpy reference (teacher-forced), bitwise batch
invariance of a whole step, CUDA-graph decode equal to eager steps, and request validation; on models whose
routed experts take the plain INT4 path (tiny, small) and one whose experts load into the fused INT4 MoE."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
from ddtree.errors import RequestError  # noqa: E402
from ddtree.presets import preset_config  # noqa: E402
from ddtree.reference.model import ReferenceModel  # noqa: E402
from engine_models import TINY_FUSED, TINY_LONG, model_config, reference_on_engine_routing  # noqa: E402

NEW_TOKENS = 64


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _engine_logits_and_routing(native, stream: int, seq: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The engine's logits at every position of seq, computed as prefill rows (chunks of 64), and the experts
    its MoE layers chose for each row, int [moe layers, rows, topk]."""
    logits, routing = [], []
    for begin in range(0, len(seq), 64):
        ids = seq[begin:begin + 64]
        chunk_logits, chunk_routing = native.forward_logits(ids, [stream] * len(ids),
                                                            list(range(begin, begin + len(ids))), with_routing=True)
        logits.append(chunk_logits)
        routing.append(chunk_routing)
    return np.concatenate(logits), np.concatenate(routing, axis=1)


def _teacher_forced_check(reference: ReferenceModel, native, stream: int, prompt: list[int], tokens: list[int],
                          monkeypatch: pytest.MonkeyPatch) -> str:
    """The reference runs the engine's token sequence on the engine's expert choices; at every position the
    engine's token must be the reference's argmax or within bf16 rounding of it. Expert choice is discrete: a
    bf16 activation may legitimately pick another expert where the reference's own biased scores nearly tie,
    and nowhere else, which is checked too. Also: recomputing the whole sequence as prefill rows gives exactly
    the decoded tokens (batch invariance between prefill and decode). Returns a one-line summary."""
    seq = prompt + tokens
    eng, routing = _engine_logits_and_routing(native, stream, seq[:-1])
    ref, far_from_tie = reference_on_engine_routing(reference, seq[:-1], routing, monkeypatch)
    ref = ref.logits
    eng, ref = eng[len(prompt) - 1:], ref[len(prompt) - 1:]
    assert eng.argmax(-1).tolist() == tokens, "prefill rows disagree with the decoded tokens"
    assert not far_from_tie, "engine routing differs from the reference's away from near-ties:\n" + \
        "\n".join(far_from_tie[:5])
    scale = np.abs(ref).max(-1)
    rel_err = np.abs(eng - ref).max(-1) / scale
    problems = []
    off = 0
    for i, token in enumerate(tokens):
        best = int(np.argmax(ref[i]))
        if token == best:
            continue
        off += 1
        gap = float(ref[i, best] - ref[i, token]) / float(scale[i])
        # bf16 keeps 8 significant bits: logits closer than 2^-7 of the largest are a rounding tie
        if gap > 2**-7:
            problems.append(f"position {len(prompt) + i}: engine {token} ({ref[i, token]:.5f}), reference argmax "
                            f"{best} ({ref[i, best]:.5f}), relative gap {gap:.2e}")
    summary = (f"prompt of {len(prompt)}: {off} of {len(tokens)} tokens off the reference argmax (all within "
               f"rounding); logits within {np.median(rel_err):.1e} (median) / {rel_err.max():.1e} (max) of the "
               f"reference, relative to the row's max |logit|")
    assert not problems, summary + "\n" + "\n".join(problems[:5])
    return summary



@pytest.mark.parametrize("preset", ["tiny", "small", TINY_FUSED])
def test_greedy_matches_reference_teacher_forced(preset: str, model_dirs: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = model_config(preset)
    prompts = _prompts(cfg.vocab_size, [5, 1, 17, 70], seed=1)  # 70 > one 64-row prefill chunk
    engine = ddtree.Engine(model_dirs[preset], streams=4, max_context=160)
    results = engine.generate(prompts, NEW_TOKENS, stop_token_ids=())
    reference = ReferenceModel.load(model_dirs[preset])
    summaries = []
    for s, (prompt, result) in enumerate(zip(prompts, results)):
        assert len(result.tokens) == NEW_TOKENS
        summaries.append(_teacher_forced_check(reference, engine.native, s, prompt, result.tokens, monkeypatch))
    print(f"{preset}: " + "; ".join(summaries))


def test_built_in_demo_matches_reference_teacher_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trained pair ddtree ships (what generate runs without --model) on the engine: its greedy tokens are the
    reference's, as for the random presets."""
    from ddtree.cli import DEFAULT_MODEL_DIR
    from ddtree.tokenizer import load_tokenizer

    prompt = load_tokenizer(DEFAULT_MODEL_DIR).encode("def fibonacci(n):")
    engine = ddtree.Engine(DEFAULT_MODEL_DIR, streams=1, max_context=128)
    [result] = engine.generate([prompt], NEW_TOKENS)
    print("demo: " + _teacher_forced_check(ReferenceModel.load(DEFAULT_MODEL_DIR), engine.native, 0, prompt,
                                           result.tokens, monkeypatch))


def _assert_graph_decode_equals_eager_steps(engine, prompts: list[list[int]], new_tokens: int) -> None:
    results = engine.generate(prompts, new_tokens, stop_token_ids=())
    native = engine.native
    streams = list(range(len(prompts)))
    first = native.prefill(prompts, 0.0, 0)
    tokens = [[t] for t in first]
    for step in range(new_tokens - 1):
        ids = [t[-1] for t in tokens]
        positions = [len(p) + step for p in prompts]
        logits = native.forward_logits(ids, streams, positions)
        for s in streams:
            tokens[s].append(int(np.argmax(logits[s])))
    assert [r.tokens for r in results] == tokens


def test_graph_decode_equals_eager_steps(model_dirs: dict[str, Path]) -> None:
    engine = ddtree.Engine(model_dirs["tiny"], streams=3, max_context=64)
    prompts = _prompts(512, [4, 9, 2], seed=2)
    _assert_graph_decode_equals_eager_steps(engine, prompts, 12)
    # one new token: the prefill's, with no decode step
    one = engine.generate(prompts, 1, stop_token_ids=())
    assert [r.tokens for r in one] == [r.tokens[:1] for r in engine.generate(prompts, 12, stop_token_ids=())]


@pytest.mark.parametrize("lengths,max_context", [([4090, 4093], 4160), ([8186, 8189], 8224)])
def test_graph_decode_across_attention_chunk_bounds(model_dirs: dict[str, Path], lengths: list[int],
                                                    max_context: int) -> None:
    """The rows cross from 512-key to 1024-key attention chunks (4096 -> 4097 keys), or past 8192 keys, inside one
    decode call. The graph is sized for the call's longest row (9 chunk CTAs per row in the second case); eager
    steps are sized for each step alone (8 before 8192 keys, 9 after)."""
    engine = ddtree.Engine(model_dirs[TINY_LONG], streams=2, max_context=max_context)
    _assert_graph_decode_equals_eager_steps(engine, _prompts(512, lengths, seed=4), 12)


@pytest.mark.parametrize("preset", ["tiny", "small", TINY_FUSED])
def test_step_logits_batch_invariant(preset: str, model_dirs: dict[str, Path]) -> None:
    cfg = model_config(preset)
    engine = ddtree.Engine(model_dirs[preset], streams=16, max_context=600)
    prompts = _prompts(cfg.vocab_size, [3 + 37 * i for i in range(16)], seed=3)  # 3 .. 558 tokens
    native = engine.native
    native.prefill(prompts, 0.0, 0)
    ids = [p[0] for p in prompts]
    positions = [len(p) for p in prompts]
    together = native.forward_logits(ids, list(range(16)), positions)
    for s in (0, 7, 15):
        alone = native.forward_logits([ids[s]], [s], [positions[s]])
        assert np.array_equal(alone[0], together[s]), s
    # and beside a different set of rows at other positions
    mixed = native.forward_logits(ids[::-1], list(range(15, -1, -1)), positions[::-1])
    assert np.array_equal(mixed[::-1], together)


@pytest.mark.parametrize("preset", ["tiny", "small", TINY_FUSED])
def test_forward_is_deterministic(preset: str, model_dirs: dict[str, Path]) -> None:
    """The same rows give bitwise the same logits and expert choices: again on one engine, and on a new one."""
    cfg = model_config(preset)
    seq = _prompts(cfg.vocab_size, [150], seed=6)[0]

    def run(engine) -> list[tuple[np.ndarray, np.ndarray]]:
        return [_engine_logits_and_routing(engine.native, stream, seq) for stream in (0, 3)]

    first = ddtree.Engine(model_dirs[preset], streams=4, max_context=160)
    a = run(first)
    b = run(first)
    del first
    gc.collect()
    c = run(ddtree.Engine(model_dirs[preset], streams=4, max_context=160))
    for (la, ra), (lb, rb), (lc, rc) in zip(a, b, c):
        assert np.array_equal(la, lb) and np.array_equal(ra, rb)
        assert np.array_equal(la, lc) and np.array_equal(ra, rc)
    assert np.array_equal(a[0][0], a[1][0])  # stream 0 and stream 3 hold the same sequence


def test_sampled_generation_is_reproducible(model_dirs: dict[str, Path]) -> None:
    engine = ddtree.Engine(model_dirs["tiny"], streams=2, max_context=64)
    prompts = _prompts(512, [6, 3], seed=4)
    a = engine.generate(prompts, 16, temperature=0.9, seed=5, stop_token_ids=())
    b = engine.generate(prompts, 16, temperature=0.9, seed=5, stop_token_ids=())
    c = engine.generate(prompts, 16, temperature=0.9, seed=6, stop_token_ids=())
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_engine_rejects_bad_requests(model_dirs: dict[str, Path]) -> None:
    engine = ddtree.Engine(model_dirs["tiny"], streams=2, max_context=32)
    with pytest.raises(RequestError, match="3 prompts but the engine was created for 2 streams"):
        engine.generate([[1], [2], [3]], 4, stop_token_ids=())
    with pytest.raises(RequestError, match="token id 512 at position 1 is outside the vocabulary"):
        engine.generate([[1, 512]], 4, stop_token_ids=())
    with pytest.raises(RequestError, match="exceed max_context 32"):
        engine.generate([[1] * 30], 4, stop_token_ids=())


def test_time_decode_samples_and_rejects_a_bad_temperature(model_dirs: dict[str, Path]) -> None:
    native = ddtree.Engine(model_dirs["tiny"], streams=2, max_context=64).native
    step_s, host_s = native.time_decode(2, [5, 9], 4, temperature=1.0, seed=3)
    assert step_s > 0 and host_s > 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            native.time_decode(2, [5, 9], 4, temperature=bad)
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            native.profile_step(2, [5, 9], 1, temperature=bad)


def test_memory_preflight_refuses_with_numbers() -> None:
    cfg = preset_config("k2-layers", 4)
    with pytest.raises(ValueError, match=r"does not fit on device 0: weights .* GiB \+ KV cache .* GiB"):
        ddtree.Engine.random(cfg, streams=256, max_context=262144)
