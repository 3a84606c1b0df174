"""The bytes and FLOPs of every part of a round at Kimi-K2 dimensions (DESIGN.md's model card) and of the
Kimi-K2.5-DFlash drafter, per GPU of a G-GPU layout.

Layout on G GPUs (issue 27's plan, which the serving stacks run for K2): MLA heads split G ways (q_b, the kv_b
absorbs and o_proj by head; the small q_a+kv_a down-projection replicated), dense MLP and shared expert split by
intermediate columns, routed experts 384 / G per GPU, lm_head split by vocabulary, the router replicated; the drafter
whole on every GPU, as the runtime holds it (runtime/shard.h). Every row of a forward is on every GPU (the latent KV
is not sharded by heads: each GPU reads all of it).
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2
HIDDEN = 7168
VOCAB = 163840
HEADS = 64
KV_LORA = 512
ROPE = 64
LATENT_ROW_BYTES = (KV_LORA + ROPE) * BF16  # one cached key of one layer
# Per (row, key) of MLA attention in the absorbed form: scores over 576 dims and P.V over 512, 64 heads, 2 FLOPs
# per multiply-add.
ATTENTION_FLOPS_PER_KEY = HEADS * (KV_LORA + ROPE + KV_LORA) * 2
TOPK = 8
EXPERTS = 384
MOE_INTER = 2048
# INT4 weights + bf16 group-32 scales of gate, up and down (bench/results/moe: 24.77 MB per expert).
EXPERT_BYTES = 24772608
EXPERT_FLOPS_PER_TOKEN = 2 * 3 * HIDDEN * MOE_INTER

# Drafter (Kimi-K2.5-DFlash): 6 Qwen3-style layers, 64 query / 8 KV heads of 128, intermediate 18432, block 8, fc
# over 6 taps; it uses the target's lm_head on one GPU and holds a whole one of its own on several.
DRAFT_LAYERS = 6
DRAFT_BLOCK = 8
DRAFT_KV_HEADS = 8
DRAFT_HEAD_DIM = 128
DRAFT_KV_ROW_BYTES = 2 * DRAFT_KV_HEADS * DRAFT_HEAD_DIM * BF16
DRAFT_ATTENTION_FLOPS_PER_KEY = HEADS * DRAFT_HEAD_DIM * 2 * 2


@dataclass(frozen=True)
class Gemm:
    """A bf16 projection: `out x inp` weights; `split` says whether a G-GPU layout divides it (else replicated)."""

    name: str
    out: int
    inp: int
    split: bool = True

    def weight_bytes(self, gpus: int = 1) -> float:
        return self.out * self.inp * BF16 / (gpus if self.split else 1)


# Target projections per layer; names are those of the benchmarks' per-operation splits.
Q_A_KV_A = Gemm("q_a+kv_a", 1536 + KV_LORA + ROPE, HIDDEN, split=False)
Q_B = Gemm("q_b", HEADS * (128 + ROPE), 1536)
ABSORB_K = Gemm("kv_b_absorb_k", HEADS * 128, KV_LORA)
ABSORB_V = Gemm("kv_b_absorb_v", HEADS * 128, KV_LORA)
O_PROJ = Gemm("o_proj", HIDDEN, HEADS * 128)
DENSE_GATE_UP = Gemm("mlp_gate_up", 2 * 18432, HIDDEN)
DENSE_DOWN = Gemm("mlp_down", HIDDEN, 18432)
SHARED_GATE_UP = Gemm("shared_gate_up", 2 * MOE_INTER, HIDDEN)
SHARED_DOWN = Gemm("shared_down", HIDDEN, MOE_INTER)
LM_HEAD = Gemm("lm_head", VOCAB, HIDDEN)
ATTENTION_GEMMS = (Q_A_KV_A, Q_B, ABSORB_K, ABSORB_V, O_PROJ)

# Drafter projections (per drafter layer unless named append.fc).
DRAFT_QKV = Gemm("block.qkv", (HEADS + 2 * DRAFT_KV_HEADS) * DRAFT_HEAD_DIM, HIDDEN)
DRAFT_O = Gemm("block.o_proj", HIDDEN, HEADS * DRAFT_HEAD_DIM)
DRAFT_GATE_UP = Gemm("block.gate_up", 2 * 18432, HIDDEN)
DRAFT_DOWN = Gemm("block.down", HIDDEN, 18432)
DRAFT_FC = Gemm("append.fc", HIDDEN, 6 * HIDDEN)
DRAFT_KV_PROJ = Gemm("append.kv_proj", 2 * DRAFT_KV_HEADS * DRAFT_HEAD_DIM, HIDDEN)

GEMMS = {g.name: g for g in (*ATTENTION_GEMMS, DENSE_GATE_UP, DENSE_DOWN, SHARED_GATE_UP, SHARED_DOWN, LM_HEAD,
                             DRAFT_QKV, DRAFT_O, DRAFT_GATE_UP, DRAFT_DOWN, DRAFT_FC, DRAFT_KV_PROJ)}


def target_gemm_calls(layers: int) -> list[tuple[Gemm, int]]:
    """(projection, calls per forward) of a target of `layers` layers: layer 0 dense (K2's first_k_dense_replace
    1), the others MoE with one shared expert."""
    moe_layers = layers - 1
    return [*((g, layers) for g in ATTENTION_GEMMS), (DENSE_GATE_UP, 1), (DENSE_DOWN, 1),
            (SHARED_GATE_UP, moe_layers), (SHARED_DOWN, moe_layers), (LM_HEAD, 1)]


def target_weight_bytes(layers: int, gpus: int) -> float:
    """Bytes of the target's weights each GPU holds: its share of the projections and of the routed experts, the
    router and embedding replicated."""
    dense = sum(g.weight_bytes(gpus) * calls for g, calls in target_gemm_calls(layers))
    router = (layers - 1) * EXPERTS * HIDDEN * BF16
    return dense + router + VOCAB * HIDDEN * BF16 + (layers - 1) * EXPERTS / gpus * EXPERT_BYTES


def drafter_weight_bytes(gpus: int) -> float:
    """The drafter's own weights on each GPU: whole on every one; its embedding is the target's, and so is its LM
    head on one GPU, while on several it holds the whole LM head itself (the target's is split)."""
    block = DRAFT_LAYERS * sum(g.weight_bytes(1) for g in (DRAFT_QKV, DRAFT_O, DRAFT_GATE_UP, DRAFT_DOWN,
                                                           DRAFT_KV_PROJ))
    return block + DRAFT_FC.weight_bytes(1) + (LM_HEAD.weight_bytes(1) if gpus > 1 else 0.0)
