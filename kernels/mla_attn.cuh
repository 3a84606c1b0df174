// MLA attention in absorbed form over a latent KV cache: for each query row (one token of one stream) and
// head h, out[h] = sum_j softmax_j(scale * q[h] . kv[j]) * kv[j][:kv_lora], over the row's first `kv_len`
// cache rows. q[h] = [q_nope absorbed through W_UK (kv_lora) | rotated q_rope (rope_dim)]; kv[j] =
// [normalised latent | rotated k_rope].
//
// Batch invariance: keys are split into fixed chunks of kMlaChunk logical positions; each chunk's partial
// (max, sum, unnormalised output) is computed by one CTA with a fixed tile order, and the partials are merged
// in chunk order. Nothing depends on how many rows, streams or heads-per-launch there are, so prefill rows,
// decode rows and (later) tree-verify rows at the same position produce bitwise the same output.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

constexpr int kMlaChunk = 512;

struct MlaDims {
    int heads;
    int kv_lora;   // latent dim (values are its first kv_lora entries)
    int rope_dim;
};

// True when a kernel is compiled for these (kv_lora, rope_dim).
bool mla_dims_supported(int kv_lora, int rope_dim);

// Workspace floats for `max_rows` rows whose kv_len never exceeds `max_len`.
int64_t mla_workspace_floats(const MlaDims& dims, int max_rows, int max_len);

// q: [rows, heads, kv_lora + rope_dim]; cache: [cache_rows, kv_lora + rope_dim], 16-byte aligned; row r reads
// cache rows kv_start[r] .. kv_start[r] + kv_len[r] - 1 (kv_len >= 1, <= max_len). out: [rows, heads, kv_lora].
cudaError_t mla_attention(bf16* out, const bf16* q, const bf16* cache, int64_t cache_rows, const int32_t* kv_start,
                          const int32_t* kv_len, int rows, int max_len, const MlaDims& dims, float softmax_scale,
                          float* workspace, cudaStream_t stream);

}  // namespace ddtree::kernels
