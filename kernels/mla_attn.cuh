// MLA attention in absorbed form over a latent KV cache: for each query row (one token of one stream) and
// head h, out[h] = sum_j softmax_j(scale * q[h] . kv[j]) * kv[j][:kv_lora], over the row's first `kv_len`
// cache rows. q[h] = [q_nope absorbed through W_UK (kv_lora) | rotated q_rope (rope_dim)]; kv[j] =
// [normalised latent | rotated k_rope].
//
// Batch invariance: a row's keys are split into chunks of logical positions whose size depends on the row's own
// length only (mla_chunk_keys); each chunk's partial (max, sum, unnormalised output) is computed by one CTA with a
// fixed tile order, and the partials are merged in chunk order. Nothing depends on how many rows, streams or
// heads-per-launch there are, so prefill rows, decode rows and tree-verify rows at the same position produce
// bitwise the same output.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// Keys per chunk. Short rows keep 512-key chunks so that few rows still spread over many CTAs. Beyond 4096 keys the
// chunks are 1024 keys: that halves the fp32 partials the merge exchanges and keeps 16 rows at 8k in one wave of
// CTAs (H200, 16 rows x 8k: 50.8-51.4 against 64.3-65.5 us), at the cost of a lone row, which then has half the
// CTAs (28.3 against 19.5-20.6 us at 8k); a tree-verify launch has a row per node, so many rows are the common case.
constexpr int kMlaShortChunk = 512;
constexpr int kMlaLongChunk = 1024;
constexpr int kMlaLongFrom = 4097;  // the first kv_len whose chunks are long

__host__ __device__ constexpr int mla_chunk_keys(int kv_len) {
    return kv_len >= kMlaLongFrom ? kMlaLongChunk : kMlaShortChunk;
}
// kv_len >= 1; written so that no kv_len up to INT_MAX overflows.
__host__ __device__ constexpr int mla_chunk_count(int kv_len) { return (kv_len - 1) / mla_chunk_keys(kv_len) + 1; }
// The most chunks of any kv_len in 1..max_len: the count drops where chunks become long (4096 keys are 8 chunks,
// 4097 are 5), so the longest row is not always the one with the most.
constexpr int mla_max_chunks(int max_len) {
    const int short_max = max_len < kMlaLongFrom ? max_len : kMlaLongFrom - 1;
    return mla_chunk_count(short_max) > mla_chunk_count(max_len) ? mla_chunk_count(short_max)
                                                                   : mla_chunk_count(max_len);
}

// The longest kv_len whose launch bound (mla_max_chunks, which never decreases with the length) is `chunks`: rows
// of up to 4096 keys reach 8 chunks, and 1024-key chunks keep the bound at 8 up to 8192 keys.
constexpr int64_t mla_longest_len(int chunks) {
    constexpr int short_bound = (kMlaLongFrom - 1) / kMlaShortChunk;
    static_assert((kMlaLongFrom - 1) % kMlaShortChunk == 0 && short_bound * kMlaLongChunk >= kMlaLongFrom - 1,
                  "short chunks end on a chunk edge, and as many long chunks reach at least as far");
    return static_cast<int64_t>(chunks) * (chunks < short_bound ? kMlaShortChunk : kMlaLongChunk);
}
constexpr bool mla_longest_len_exact(int up_to_chunks) {
    for (int c = 1; c <= up_to_chunks; ++c) {
        const int len = static_cast<int>(mla_longest_len(c));
        if (mla_max_chunks(len) != c || mla_max_chunks(len + 1) != c + 1) return false;
    }
    return true;
}
static_assert(mla_longest_len_exact(64), "mla_longest_len is the last length of each launch bound");

struct MlaDims {
    int heads;
    int kv_lora;   // latent dim (values are its first kv_lora entries)
    int rope_dim;
};

// Keys of tree-verify rows. A row reads logical positions 0 .. key_start[row] - 1 from its contiguous cache rows
// (kv_start + position) and position key_start + j from cache row kv_start + key_start + key_nodes[row * stride + j]:
// its ancestor at depth j, whose node slot follows the committed prefix. The tiles, chunks and reduction order are
// those of a row whose keys are all contiguous, so a node gets bitwise what an autoregressive row of its path gets.
// Rows with key_start >= kv_len (and every row when key_start is null) read contiguously.
struct MlaTreeKeys {
    const int32_t* key_start = nullptr;
    const int32_t* key_nodes = nullptr;
    int stride = 0;
};

// True when a kernel is compiled for these (kv_lora, rope_dim).
bool mla_dims_supported(int kv_lora, int rope_dim);

// Workspace floats for `max_rows` rows whose kv_len never exceeds `max_len`.
int64_t mla_workspace_floats(const MlaDims& dims, int max_rows, int max_len);

// q: [rows, heads, kv_lora + rope_dim]; cache: [cache_rows, kv_lora + rope_dim], 16-byte aligned; row r reads
// cache rows kv_start[r] .. kv_start[r] + kv_len[r] - 1 (kv_len >= 1, <= max_len), or its tree keys (see
// MlaTreeKeys; every redirected row inside the cache). out: [rows, heads, kv_lora].
cudaError_t mla_attention(bf16* out, const bf16* q, const bf16* cache, int64_t cache_rows, const int32_t* kv_start,
                          const int32_t* kv_len, int rows, int max_len, const MlaDims& dims, float softmax_scale,
                          float* workspace, cudaStream_t stream, const MlaTreeKeys& tree = {});

}  // namespace ddtree::kernels
