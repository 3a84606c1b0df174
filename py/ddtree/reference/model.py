"""The target model's forward pass in numpy: fp32 math over bf16 weights and INT4 routed experts.

This is the executable specification every GPU kernel and the engine are tested against. A decoder layer is
    h = x + MLA(input_layernorm(x));   out = h + MLP(post_attention_layernorm(h))
where MLP is a dense SwiGLU for the first `first_k_dense_replace` layers and MoE (routed + shared) after them.
Logits = lm_head(norm(x_last)).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddtree import bf16
from ddtree.checkpoint import Checkpoint, expected_tensors, open_checkpoint
from ddtree.config import ModelConfig
from ddtree.errors import CheckpointError, RequestError, check_token_ids
from ddtree.reference.layers import linear, rms_norm, swiglu_mlp
from ddtree.reference.mla import AttentionWeights, KVCache, mla_attention
from ddtree.reference.moe import ExpertStore, moe, route
from ddtree.reference.rope import Rope


@dataclass(frozen=True)
class ForwardOutput:
    logits: np.ndarray  # float32 [n, vocab]
    # layer -> float32 [n, hidden]: the residual stream after that layer, HF's hidden_states[layer + 1] (HF's
    # last entry is taken after the final norm instead)
    hidden: dict[int, np.ndarray]


class ReferenceModel:
    """Reference forward over a checkpoint's tensors (bf16 as uint16 bits, INT4 experts as packed int32)."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray],
                 expert_cache_bytes: int = 8 << 30) -> None:
        if not isinstance(weights, Checkpoint):  # a Checkpoint was validated when opened
            _check_weights(config, weights)
        self.config = config
        self.model_dir: Path | None = None  # the checkpoint directory (its tokenizer) of a model `load` read
        self.rope = Rope.from_config(config)
        self._weights = weights
        self._float32: dict[str, np.ndarray] = {}
        self._experts = ExpertStore(self._raw, expert_cache_bytes)

    @classmethod
    def load(cls, model_dir: str | Path) -> ReferenceModel:
        checkpoint = open_checkpoint(model_dir)
        model = cls(checkpoint.config, checkpoint)
        model.model_dir = Path(model_dir)
        return model

    def new_cache(self) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    # -- weights ------------------------------------------------------------------------------------------------

    def _raw(self, name: str) -> np.ndarray:
        return self._weights[self.config.weight_prefix + name]

    def _tensor(self, name: str) -> np.ndarray:
        """A non-expert tensor as float32, converted once."""
        if name not in self._float32:
            self._float32[name] = bf16.as_float32(self._raw(name))
        return self._float32[name]

    def _attention_weights(self, layer: int) -> AttentionWeights:
        prefix = f"model.layers.{layer}.self_attn"
        return AttentionWeights(*(self._tensor(f"{prefix}.{name}.weight") for name in (
            "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
            "o_proj")))

    def embedding_table(self) -> np.ndarray:
        """The embedding table as stored (bf16 bit patterns): callers widen only the rows they need."""
        return self._raw("model.embed_tokens.weight")

    def lm_head(self) -> np.ndarray:
        """The LM head [vocab, hidden] in float32, converted once."""
        return self._tensor("lm_head.weight")

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        return bf16.as_float32(self.embedding_table()[ids])

    # -- forward ------------------------------------------------------------------------------------------------

    def forward(self, ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray, cache: KVCache,
                visible: np.ndarray | None = None, hidden_layers: Iterable[int] = ()) -> ForwardOutput:
        """Run n new tokens at the given RoPE positions, appending their rows to `cache`.

        Each new token attends to every row already in the cache and to the new tokens `visible` [n, n] allows
        (default causal; the diagonal must be set). Positions need not be consecutive (a tree verify uses
        start + depth).
        """
        cfg = self.config
        ids = check_token_ids(ids, cfg.vocab_size)
        positions = _check_positions(positions, len(ids), cfg.max_position_embeddings)
        visible = _check_visible(visible, len(ids))
        wanted = _check_hidden_layers(hidden_layers, cfg.num_hidden_layers)
        if len(cache.layers) != cfg.num_hidden_layers:
            raise RequestError(f"cache has {len(cache.layers)} layers, the model {cfg.num_hidden_layers}")

        allowed = np.concatenate([np.ones((len(ids), cache.length), dtype=bool), visible], axis=1)
        cos, sin = self.rope.cos_sin(positions)
        x = self._embed(ids)
        hidden = {}
        for layer in range(cfg.num_hidden_layers):
            x = self._decoder_layer(layer, x, cos, sin, allowed, cache)
            if layer in wanted:
                hidden[layer] = x.copy()
        logits = linear(rms_norm(x, self._tensor("model.norm.weight"), cfg.rms_norm_eps),
                        self.lm_head())
        return ForwardOutput(logits.astype(np.float32), hidden)

    def _decoder_layer(self, layer: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, allowed: np.ndarray,
                       cache: KVCache) -> np.ndarray:
        eps, prefix = self.config.rms_norm_eps, f"model.layers.{layer}"
        attn_in = rms_norm(x, self._tensor(f"{prefix}.input_layernorm.weight"), eps)
        h = x + mla_attention(attn_in, cos, sin, allowed, self._attention_weights(layer), cache, layer,
                              self.config, self.rope)
        mlp_in = rms_norm(h, self._tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        return h + self._mlp(layer, mlp_in)

    def _mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        cfg, prefix = self.config, f"model.layers.{layer}.mlp"
        if not cfg.is_moe_layer(layer):
            return self._swiglu(prefix, x)
        routing = route(x, self._tensor(f"{prefix}.gate.weight"),
                        self._tensor(f"{prefix}.gate.e_score_correction_bias"), cfg)
        out = moe(x, routing, f"{prefix}.experts", self._experts)
        if cfg.n_shared_experts:
            out = out + self._swiglu(f"{prefix}.shared_experts", x)
        return out

    def _swiglu(self, prefix: str, x: np.ndarray) -> np.ndarray:
        return swiglu_mlp(x, *(self._tensor(f"{prefix}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")))

    # -- decoding -----------------------------------------------------------------------------------------------

    def greedy_generate(self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int) -> list[int]:
        """Prefill the prompt, then feed back the argmax (lowest id on ties) one token at a time.

        Returns exactly max_new_tokens tokens (no stop on EOS: the engine's greedy contract is token for token).
        """
        from ddtree.reference.generate import generate  # generate builds on this module

        return generate(self, None, prompt_ids, max_new_tokens).tokens


def _check_positions(positions: Sequence[int] | np.ndarray, n: int, max_positions: int) -> np.ndarray:
    array = np.asarray(positions)
    if array.shape != (n,) or not np.issubdtype(array.dtype, np.integer):
        raise RequestError(f"positions must be {n} integers (one per token), got {array.dtype} "
                           f"shape {list(array.shape)}")
    bad = np.flatnonzero((array < 0) | (array >= max_positions))
    if bad.size:
        raise RequestError(f"position {array[bad[0]]} at index {bad[0]} is outside [0, {max_positions})")
    return array.astype(np.int64)


def _check_visible(visible: np.ndarray | None, n: int) -> np.ndarray:
    if visible is None:
        return np.tril(np.ones((n, n), dtype=bool))
    array = np.asarray(visible)
    if array.shape != (n, n) or array.dtype != np.bool_:
        raise RequestError(f"visible must be a bool [{n}, {n}] mask, got {array.dtype} shape {list(array.shape)}")
    blind = np.flatnonzero(~np.diagonal(array))
    if blind.size:
        raise RequestError(f"visible[{blind[0]}, {blind[0]}] is False: every token must attend to itself")
    return array


def _check_hidden_layers(layers: Iterable[int], num_layers: int) -> set[int]:
    wanted = list(layers)
    for i in wanted:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < num_layers:
            raise RequestError(f"hidden_layers entry {i!r} is not a layer index in [0, {num_layers})")
    return {int(i) for i in wanted}


def _check_weights(config: ModelConfig, weights: Mapping[str, np.ndarray]) -> None:
    """Plain dicts get the checks a Checkpoint makes on open: every expected tensor present, of its shape."""
    for name, spec in expected_tensors(config).items():
        if name not in weights:
            raise CheckpointError(f"tensor '{name}' is missing from the weights")
        if tuple(weights[name].shape) != spec.shape:
            raise CheckpointError(f"tensor '{name}' has shape {list(weights[name].shape)}, "
                                  f"expected {list(spec.shape)}")
