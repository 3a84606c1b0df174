// A plain INT4 routed-expert MoE for shapes the Marlin-style kernel (moe_marlin.cuh) does not take (hidden or
// moe_intermediate not a multiple of 128, as in the small test presets). Weights stay in the checkpoint's
// compressed-tensors layout: packed int32 [E, out, in/8] (nibble i of word j = input 8j+i, +8 offset) and bf16
// scales [E, out, in/32]; w = (q - 8) * s in fp32 (the fused kernel rounds it to bf16 first), fp32 dot products,
// SiLU(g) * u rounded to bf16, slots combined in order: within bf16 tolerance of the fused kernel, not bitwise
// equal to it. One CTA per (token, slot) then per token: batch-invariant.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

struct Int4Experts {
    const int32_t* gate_packed;
    const bf16* gate_scale;
    const int32_t* up_packed;
    const bf16* up_scale;
    const int32_t* down_packed;
    const bf16* down_scale;
    int hidden, inter;
};

// act: scratch bf16 [tokens * topk, inter]. out[t] = bf16(sum_k topk_weights[t,k] * scaling * down(act)).
cudaError_t experts_int4_forward(bf16* out, bf16* act, const bf16* x, const int32_t* topk_ids,
                                 const float* topk_weights, int tokens, int topk, float scaling,
                                 const Int4Experts& w, cudaStream_t stream);

}  // namespace ddtree::kernels
