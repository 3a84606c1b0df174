// Rotary position embedding (DeepSeek YaRN) for MLA, and the latent KV store that uses it.
//
// Angles are position * inv_freq[i] in fp32 and cos/sin are scaled by the YaRN attention factor, as the
// numpy reference computes them. `interleave`: pairs (2i, 2i+1) (DeepSeek checkpoints) or (i, i + d/2);
// the rotated pair is written back to the same two dims for queries and keys alike.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

constexpr int kRopeMaxDim = 512;  // rope_dim of at most this (one thread per pair in a CTA of 256)

inline bool rope_supported(int rope_dim) { return rope_dim > 0 && rope_dim % 2 == 0 && rope_dim <= kRopeMaxDim; }

struct RopeParams {
    const float* inv_freq;  // device [rope_dim / 2]
    float attention_factor;
    int rope_dim;
    bool interleave;
};

// Query side of absorbed MLA: for each row r and head h, rotate q[r, h, q_offset : q_offset + rope_dim]
// at position positions[r] and write it to out[r, h, out_offset : out_offset + rope_dim].
// q row stride q_ld and head stride q_head; out likewise.
cudaError_t rope_queries(bf16* out, int64_t out_ld, int64_t out_head, int out_offset, const bf16* q, int64_t q_ld,
                         int64_t q_head, int q_offset, const int32_t* positions, int rows, int heads,
                         const RopeParams& rope, cudaStream_t stream);

// Key side: for each row r, kv_a[r] = [latent (kv_lora) | k_rope (rope_dim)] (row stride kv_ld) becomes
// cache[slots[r]] = [rmsnorm(latent) * norm_weight | rope(k_rope, positions[r])], bf16, row length
// kv_lora + rope_dim. rmsnorm in fp32 with `eps`.
cudaError_t mla_store_kv(bf16* cache, const int32_t* slots, const bf16* kv_a, int64_t kv_ld,
                         const bf16* norm_weight, float eps, int kv_lora, const int32_t* positions, int rows,
                         const RopeParams& rope, cudaStream_t stream);

}  // namespace ddtree::kernels
