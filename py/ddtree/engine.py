"""The native GPU engine behind a thin Python facade: load a checkpoint onto one GPU, generate tokens.

The C++ runtime (ddtree._native.Engine) owns the device: weights, per-stream latent KV caches, the kernels and
the CUDA graphs of the decode step. This module only validates requests, hands it host views of the
memory-mapped checkpoint (no copies here) and wraps the results. The runtime checks every request again at its
boundary; what it refuses arrives here as a RequestError naming the argument.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddtree import bf16
from ddtree.checkpoint import Checkpoint, open_checkpoint
from ddtree.config import LORA_NORM_EPS, ModelConfig
from ddtree.drafter import DrafterConfig, open_drafter
from ddtree.errors import NonFiniteError, RequestError, check_token_ids
from ddtree.limits import MAX_STOP_IDS, MAX_TREE_BUDGET
from ddtree.nccl import nccl_library
from ddtree.reference.budget import CostTable, check_candidates, default_candidates
from ddtree.request import AUTO, METHODS, check_seed, check_stop_ids
from ddtree.reference.rope import Rope
from ddtree.results import GenerationResult, cut_at_stop, with_text
from ddtree.shard import Shard, shard_layout, shard_tensor
from ddtree.tokenizer import encode_prompts

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MAX_REPLAYS = 10000  # the most replays one Engine.replay call times


@dataclass(frozen=True, slots=True)
class CapturedGraph:
    """A CUDA graph the engine has captured: its stable name, which says what it runs and for which key ("ar
    streams=4 span=1024": a decode step; "round streams=16 budget=32 depth=15 width=32 span=1024 draft_span=1000",
    with " oracle" when the oracle's candidates replace the drafter's: a DDTree round), and its node count."""

    name: str
    nodes: int

    @property
    def kind(self) -> str:
        """"ar" or "round"."""
        return self.name.split(" ", 1)[0]


def engine_dims(cfg: ModelConfig) -> dict[str, Any]:
    """The model dimensions the native engine is built from."""
    return {
        "vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "inter": cfg.intermediate_size,
        "moe_inter": cfg.moe_intermediate_size, "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads, "q_lora": cfg.q_lora_rank, "kv_lora": cfg.kv_lora_rank,
        "nope": cfg.qk_nope_head_dim, "rope": cfg.qk_rope_head_dim, "v": cfg.v_head_dim,
        "experts": cfg.n_routed_experts, "shared_inter": cfg.n_shared_experts * cfg.moe_intermediate_size,
        "topk": cfg.num_experts_per_tok, "first_dense": cfg.first_k_dense_replace,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "rms_eps": cfg.rms_norm_eps, "lora_eps": LORA_NORM_EPS, "softmax_scale": cfg.softmax_scale,
    }


def drafter_dims(cfg: DrafterConfig) -> dict[str, Any]:
    """The drafter dimensions the native drafter is built from."""
    return {
        "hidden": cfg.hidden_size, "inter": cfg.intermediate_size, "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "vocab": cfg.vocab_size, "block": cfg.block_size, "taps": len(cfg.target_layer_ids),
        "mask_token": cfg.mask_token_id, "rms_eps": cfg.rms_norm_eps,
    }


def drafter_spec(cfg: DrafterConfig, window: int | None) -> dict[str, Any]:
    """What the native engine holds its drafter by: dims, RoPE, the target layers it taps, its context window."""
    rope = Rope.from_drafter_config(cfg)
    return {"dims": drafter_dims(cfg), "inv_freq": rope.inv_freq.tolist(),
            "attention_factor": float(rope.attention_factor), "tap_layers": list(cfg.target_layer_ids),
            "window": window or 0}


def _native_call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls the runtime; its refusals of an argument (C++ std::invalid_argument) become RequestError, and a
    generation that sampled NaN or infinite logits (_native.NonFiniteLogits, naming the stream and position)
    NonFiniteError."""
    try:
        return method(*args, **kwargs)
    except ValueError as err:
        raise RequestError(str(err)) from None
    except ArithmeticError as err:
        raise NonFiniteError(str(err)) from None


def upload_drafter_tensors(weights: Mapping[str, np.ndarray], upload: Callable[[str, np.ndarray], None],
                           missing: Callable[[], str]) -> None:
    """Copy every drafter tensor of ``weights`` (bf16 bits) through the runtime's `upload`; RuntimeError naming the
    first tensor `missing` still reports afterwards."""
    for name in weights:
        _native_call(upload, name, np.ascontiguousarray(weights[name]))
    left = missing()
    if left:
        raise RuntimeError(f"drafter weights incomplete: {left!r} was not uploaded")


def _native_engine(cfg: ModelConfig, streams: int, max_context: int, budget: int, device: int,
                   drafter: dict[str, Any] | None, shard: Shard, all_ranks: bool,
                   devices: tuple[int, ...] | None) -> Any:
    from ddtree.device import has_cuda_device

    if not has_cuda_device():
        raise RuntimeError("ddtree.Engine needs a CUDA device, and none is present (the numpy reference "
                           "ddtree.reference runs without one)")
    from ddtree import _native

    rope = Rope.from_config(cfg)
    args = (engine_dims(cfg), rope.inv_freq.tolist(), float(rope.attention_factor), rope.interleave, streams,
            max_context, budget)
    if devices is None:
        return _native_call(_native.Engine, *args, device, drafter, shard.rank, shard.ranks, all_ranks)
    return _native_call(_native.MultiGpuEngine, *args, list(devices), nccl_library(), drafter)


def check_devices(devices: Sequence[int] | None, shard: Shard | None, all_ranks: bool) -> tuple[int, ...] | None:
    """`devices` as a tuple of distinct device indices (None: one GPU); RequestError naming the argument for
    anything else, or beside `shard` or `all_ranks` (devices split the target themselves, one rank per GPU)."""
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or len(devices) == 0:
        raise RequestError(f"devices must be a non-empty sequence of CUDA device indices, got {devices!r:.80}")
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise RequestError(f"devices must hold non-negative integers (CUDA device indices), got {d!r:.40}")
    if len(set(devices)) != len(devices):
        raise RequestError(f"devices must not repeat a device, got {tuple(devices)}")
    if shard is not None:
        raise RequestError("devices and shard: pass one (devices split the target, rank r on devices[r])")
    if all_ranks:
        raise RequestError("devices and all_ranks: pass one (all_ranks simulates every rank on one GPU)")
    return tuple(devices)


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.num_hidden_layers > cfg.first_k_dense_replace and cfg.n_shared_experts != 1:
        raise RequestError(f"n_shared_experts is {cfg.n_shared_experts}; the engine runs MoE layers with exactly one "
                           "shared expert (as Kimi-K2 and DeepSeek-V3 have)")


def _check_sizes(streams: int, max_context: int, budget: int, cfg: ModelConfig) -> None:
    for name, value in (("streams", streams), ("max_context", max_context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_TREE_BUDGET:
        raise RequestError(f"budget must be an integer in 0..{MAX_TREE_BUDGET}, got {budget!r}")
    if max_context > cfg.max_position_embeddings:
        raise RequestError(f"max_context {max_context} exceeds the model's max_position_embeddings "
                           f"{cfg.max_position_embeddings}")


def validate_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, streams: int,
                     max_context: int, vocab_size: int) -> list[list[int]]:
    """Checked prompts as lists of ints; RequestError naming the prompt and token at fault otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be finite and >= 0, got {temperature}")
    if len(prompts) == 0:
        raise RequestError("prompts is empty: pass at least one prompt")
    if len(prompts) > streams:
        raise RequestError(f"{len(prompts)} prompts but the engine was created for {streams} streams")
    checked = []
    for i, prompt in enumerate(prompts):
        ids = check_token_ids(prompt, vocab_size, f"prompt {i}")
        if ids.size + max_new_tokens > max_context:
            raise RequestError(f"prompt {i}: {ids.size} tokens + {max_new_tokens} new tokens exceed max_context "
                               f"{max_context}")
        checked.append(ids.tolist())
    return checked


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise RequestError(f"draft_window must be a positive integer or None, got {window!r}")


class Engine:
    """Generation on one GPU for 1..streams concurrent prompts, autoregressive or DDTree with a DFlash drafter.

    `streams`, `max_context` (prompt + generated tokens per stream) and `budget` (the most drafted nodes per stream
    a round's tree holds; its verify forwards run streams x (budget + 1) rows; default: the drafter's block size - 1,
    0 without a drafter) are fixed at creation; the engine refuses, with the numbers, a configuration whose weights,
    KV caches, drafter and scratch do not fit in free device memory. `draft_window` keeps only the drafter's last
    that many context rows per stream (None: all).

    `shard` (ddtree.shard.Shard) splits the target over shard.ranks GPUs and holds rank shard.rank's share, each
    checkpoint tensor sliced for it at upload; on one GPU its peers are simulated (runtime/rank_simulation.h): its
    tokens are not a model's, its time is one rank's. With `all_ranks` the engine holds every rank's share on this
    GPU and its collectives are exact: its logits are the whole model's up to the rank-order sums' rounding. Its
    drafter is whole on every rank and holds the target's whole lm_head itself.

    `devices` (instead of `device`, `shard` and `all_ranks`): the target split over len(devices) GPUs of this host,
    rank r on devices[r] (runtime/multi_gpu_engine.h): one process and one host thread per GPU, NCCL between them
    (ddtree.nccl finds the library). The checkpoint is opened once and each rank's slices uploaded to its GPU; the
    ranks run every call in lockstep and their tokens are checked to agree. Its logits are those of the one-GPU
    `all_ranks` engine (the same rank-order sums).
    """

    last_costs: CostTable | None = None  # the round times the last budget="auto" generate chose by

    def __init__(self, model_dir: str | Path, drafter_dir: str | Path | None = None, streams: int = 1,
                 max_context: int = 4096, budget: int | None = None, device: int = 0,
                 draft_window: int | None = None, shard: Shard | None = None, all_ranks: bool = False,
                 devices: Sequence[int] | None = None) -> None:
        checkpoint = open_checkpoint(model_dir)
        drafter_config, drafter_checkpoint = (None, None) if drafter_dir is None else \
            open_drafter(drafter_dir, checkpoint.config)
        self._create(checkpoint.config, streams, max_context, budget, device, drafter_config, draft_window, shard,
                     all_ranks, devices)
        self._upload(checkpoint)
        if drafter_checkpoint is not None:
            if self.shard.ranks > 1:  # the drafter's LM head is the target's whole table, held by the drafter
                prefix = checkpoint.config.weight_prefix
                _native_call(self._native.upload_drafter, "lm_head.weight", checkpoint[f"{prefix}lm_head.weight"])
            self.upload_drafter(drafter_checkpoint)
        self.model_dir: Path | None = Path(model_dir)  # its tokenizer encodes text prompts

    @classmethod
    def random(cls, cfg: ModelConfig, streams: int, max_context: int, budget: int | None = None, device: int = 0,
               seed: int = 0, drafter: DrafterConfig | None = None,
               drafter_weights: Mapping[str, np.ndarray] | None = None,
               draft_window: int | None = None, shard: Shard | None = None, all_ranks: bool = False,
               devices: Sequence[int] | None = None) -> Engine:
        """An engine with random weights of the right scale (benchmarks at K2 dims with no checkpoint on disk), and
        with `drafter` a drafter of those dims: `drafter_weights` (bf16 bits by checkpoint name), else random.
        `shard`, `all_ranks`, `devices`: as for Engine (each held rank's share drawn on the device, no checkpoint
        needed; with devices, the same model as the all_ranks engine of the same seed)."""
        engine = cls.__new__(cls)
        engine._create(cfg, streams, max_context, budget, device, drafter, draft_window, shard, all_ranks, devices)
        engine._native.randomize_weights(seed)
        if drafter is not None:
            if drafter_weights is None or engine.shard.ranks > 1:  # a split target's drafter: a random LM head too
                engine._native.randomize_drafter(seed + 1)
            if drafter_weights is not None:
                engine.upload_drafter(drafter_weights)
        engine.model_dir = None
        return engine

    def _create(self, cfg: ModelConfig, streams: int, max_context: int, budget: int | None, device: int,
                drafter: DrafterConfig | None, draft_window: int | None, shard: Shard | None,
                all_ranks: bool, devices: Sequence[int] | None) -> None:
        _check_supported(cfg)
        devices = check_devices(devices, shard, all_ranks)
        if devices is not None:
            shard = Shard(0, len(devices))
        shard = Shard() if shard is None else shard
        if not isinstance(shard, Shard):
            raise RequestError(f"shard must be a ddtree.shard.Shard or None, got {shard!r:.80}")
        shard_layout(cfg, shard)  # RequestError naming ranks and the field it does not divide
        self.shard = shard
        _check_window(draft_window)
        if budget is None:
            budget = drafter.block_size - 1 if drafter is not None else 0
        _check_sizes(streams, max_context, budget, cfg)
        if drafter is not None and (drafter.hidden_size, drafter.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise RequestError(f"drafter hidden_size/vocab_size {drafter.hidden_size}/{drafter.vocab_size} differ "
                               f"from the target's {cfg.hidden_size}/{cfg.vocab_size}")
        self.config, self.streams, self.max_context, self.budget = cfg, streams, max_context, budget
        self.drafter_config, self.draft_window = drafter, draft_window
        spec = None if drafter is None else drafter_spec(drafter, draft_window)
        self._native = _native_engine(cfg, streams, max_context, budget, device, spec, shard, bool(all_ranks),
                                      devices)

    @property
    def native(self) -> Any:
        """The C++ engine (profiling and test entry points)."""
        return self._native

    def _upload(self, checkpoint: Checkpoint) -> None:
        for rank in self._native.held_ranks:
            self._upload_rank(checkpoint, rank)
        missing = self._native.missing()
        if missing:
            raise RuntimeError(f"engine weights incomplete: {missing!r} was not uploaded")

    def _upload_rank(self, checkpoint: Checkpoint, rank: int) -> None:
        """Every tensor held rank `rank` needs, sliced for it (ddtree.shard; a whole model's slices are whole)."""
        cfg, prefix = self.config, self.config.weight_prefix
        layout = shard_layout(cfg, Shard(rank, self.shard.ranks))
        for name in checkpoint:
            if ".mlp.experts." in name:
                continue
            array = checkpoint[name]
            if name.endswith("e_score_correction_bias"):
                array = np.ascontiguousarray(bf16.as_float32(array))
            short = name[len(prefix):]
            _native_call(self._native.upload, short, shard_tensor(short, array, cfg, layout), rank)
        for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
            for e in range(layout.first_expert, layout.first_expert + layout.experts):
                base = f"{prefix}model.layers.{layer}.mlp.experts.{e}"
                parts = []
                for proj in EXPERT_PROJECTIONS:
                    parts += [checkpoint[f"{base}.{proj}.weight_packed"], checkpoint[f"{base}.{proj}.weight_scale"]]
                _native_call(self._native.upload_expert, layer, e, *parts, rank)

    def auto_candidates(self, auto_budgets: Sequence[int] | None = None) -> tuple[int, ...]:
        """The budgets a budget="auto" generation chooses among: `auto_budgets` checked against the engine's
        budget, or by default ddtree.reference.budget.default_candidates of it; RequestError otherwise."""
        if self.budget < 1:
            raise RequestError("budget 'auto' needs an engine budget of at least 1")
        try:
            return default_candidates(self.budget) if auto_budgets is None else \
                check_candidates(auto_budgets, self.budget)
        except (TypeError, ValueError) as err:
            raise RequestError(f"auto_budgets: {err}") from None

    def upload_drafter(self, weights: Mapping[str, np.ndarray]) -> None:
        """Copy every drafter tensor of ``weights`` (bf16 bits by checkpoint name) to the device."""
        upload_drafter_tensors(weights, self._native.upload_drafter, self._native.drafter_missing)

    def _stop_ids(self, stop_token_ids: Sequence[int] | None) -> list[int]:
        if stop_token_ids is None:
            return [e for e in self.config.eos_token_ids if 0 <= e < self.config.vocab_size]
        ids = check_stop_ids(stop_token_ids, self.config.vocab_size)
        if len(ids) > MAX_STOP_IDS:
            raise RequestError(f"stop_token_ids: at most {MAX_STOP_IDS} ids, got {len(ids)}")
        return ids

    def graphs(self) -> list[CapturedGraph]:
        """The CUDA graphs captured so far (a generate call captures the ones it replays), decode steps first. The
        engine keeps a bounded number per kind and drops the least recently used one to make room."""
        return [CapturedGraph(name, nodes) for name, nodes in self._native.graphs()]

    def replay(self, name: str, n: int = 20, warmup: bool = True) -> float:
        """Device seconds per replay of the captured graph `name` (one of graphs()): the median of n replays on the
        engine's stream, each timed by CUDA events, after one untimed warm-up replay (unless warmup=False).

        Every replay starts from the same state, put back (untimed) before it: each of the graph's streams live at
        the longest context the graph's attention span holds, with a distinct probe token; a decode step at the last
        position, a round with one token committed (its tree, verify, accept and commit run as in a generation; the
        cache contents, the oracle's continuation and the temperature are those the last generate left). Replaying
        advances the device state of those streams as decoding does: cache rows past the context, the decode rows,
        the round's tokens. A later generate starts every stream anew from its prefill, so its tokens are those it
        would give without the replays. The timed replays run inside the NVTX range "replay" (Nsight Compute:
        --nvtx --nvtx-include "replay/").
        """
        if not isinstance(name, str):
            raise RequestError(f"name must be a graph name (a str, one of Engine.graphs()), got {name!r:.80}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_REPLAYS:
            raise RequestError(f"n must be an integer in 1..{MAX_REPLAYS}, got {n!r:.40}")
        return statistics.median(_native_call(self._native.replay, name, n, bool(warmup)))

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, method: str | None = None, stop_token_ids: Sequence[int] | None = None,
                 budget: int | str | None = None, profile: bool = False,
                 auto_budgets: Sequence[int] | None = None,
                 budget_costs: CostTable | None = None) -> list[GenerationResult]:
        """Generate up to max_new_tokens tokens for each prompt (one stream each, all decoded together): fewer when a
        stop token comes (it is kept; default stop tokens: the config's eos ids, () for none). A prompt may be text,
        encoded with the checkpoint's tokenizer; its result then holds the decoded text too.

        method: "ddtree" (the default with a drafter: rounds of `budget` nodes, default the engine's) or "ar".
        temperature 0 is greedy (lowest id on ties); > 0 samples with a seeded Gumbel-max per (stream, position),
        the same in both methods, so DDTree's tokens equal AR's bit for bit. profile: DDTree rounds run eagerly with
        each stage timed (GenerationResult.stage_seconds, summed over the rounds).

        budget="auto": each round's budget is chosen on the fly among `auto_budgets` (default: the powers of two
        from 8 below the engine's budget, and the engine's budget) by the cost-aware policy of
        ddtree.reference.budget: the largest (expected tokens of the live streams per round, from the round's probe
        of the tree's path probabilities calibrated by the accept lengths seen) / (round time). Round times come
        from `budget_costs` (a ddtree.reference.budget.CostTable) or, by default, from replays of each (stream
        count, candidate) round graph, timed once per engine and attention span before the generation that first
        needs them. GenerationResult.budgets holds each round's budget.
        """
        method = method if method is not None else ("ddtree" if self.drafter_config is not None else "ar")
        if method not in METHODS:
            raise RequestError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        prompt_ids, tokenizer = encode_prompts(prompts, self.model_dir)
        checked = validate_request(prompt_ids, max_new_tokens, temperature, self.streams, self.max_context,
                                   self.config.vocab_size)
        seed = check_seed(seed)
        stops = self._stop_ids(stop_token_ids)
        autos: tuple[int, ...] = ()
        if budget == AUTO:
            autos = self.auto_candidates(auto_budgets)
            budget = autos[-1]
        elif auto_budgets is not None or budget_costs is not None:
            raise RequestError("auto_budgets and budget_costs apply to budget='auto' only")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or not 1 <= budget <= self.budget):
            raise RequestError(f"budget must be an integer in 1..{self.budget} (the engine's) or 'auto', got "
                               f"{budget!r}")
        budget = self.budget if budget is None else budget
        if method == "ar":
            tokens, prefill_seconds, decode_seconds = _native_call(self._native.generate, checked, max_new_tokens,
                                                                   float(temperature), seed)
            results = [GenerationResult(tokens=cut_at_stop(list(t), stops)[0], prefill_seconds=prefill_seconds,
                                        decode_seconds=decode_seconds) for t in tokens]
            return [with_text(r, tokenizer) for r in results]
        if self.drafter_config is None:
            raise RequestError("method 'ddtree' needs a drafter: create the Engine with drafter_dir")
        costs = {} if budget_costs is None else {"cost_streams": list(budget_costs.streams),
                                                 "cost_seconds": [list(r) for r in budget_costs.seconds]}
        out = _native_call(self._native.generate_ddtree, checked, max_new_tokens, float(temperature), seed, budget,
                           stops, bool(profile), auto_budgets=list(autos), **costs)
        stages = dict(out["stages"])
        # None when no round chose a budget (a single new token: the runtime measures no round times then)
        self.last_costs = CostTable(tuple(out["cost_streams"]), tuple(map(tuple, out["cost_seconds"]))) \
            if autos and out["cost_streams"] else None
        results = [GenerationResult(tokens=cut_at_stop(list(t), stops)[0], prefill_seconds=out["prefill_seconds"],
                                    decode_seconds=out["decode_seconds"], accept_lengths=list(a),
                                    stage_seconds=stages, budgets=list(out["budgets"][:len(a)]))
                   for t, a in zip(out["tokens"], out["accept_lengths"])]
        return [with_text(r, tokenizer) for r in results]


__all__ = ["CapturedGraph", "Engine", "check_devices", "drafter_dims", "drafter_spec", "engine_dims",
           "validate_request"]
