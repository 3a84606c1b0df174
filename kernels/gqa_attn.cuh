// GQA attention of the DFlash drafter's block: for every stream, its `block` query rows x `heads` heads attend,
// with no mask, to the stream's cached context rows and to the block's own keys and values (computed by this
// forward, never cached). Scores and P.V on tensor cores (mma.sync, fp32 accumulators; the probabilities enter P.V
// rounded to bf16 as in flash attention), the softmax in fp32, bf16 output.
//
// A CTA takes one stream, one KV head, a tile of 64 of its (block row, query head) pairs and one chunk of
// kGqaChunkKeys keys (the stream's context keys first, then its block keys), and writes the chunk's unnormalised
// partial (max, sum, P.V) to the workspace; a merge kernel adds the chunks in chunk order. The chunks follow the
// stream's own key count only, so a stream's output is bitwise the same whatever other streams share the launch.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

constexpr int kGqaChunkKeys = 256;
constexpr int kGqaMaxHeadDim = 256;

struct GqaDims {
    int heads, kv_heads, head_dim;
    int block;  // query rows (and block keys) per stream
};

// head_dim a multiple of 8 up to kGqaMaxHeadDim; heads a multiple of kv_heads.
bool gqa_supported(const GqaDims& d);

// Keys and values. Stream s of the launch reads cache stream cache_streams[s]: its first min(starts[s], capacity)
// rows of ctx_k / ctx_v ([cache streams][capacity][kv_heads][head_dim]; a window's ring holds its rows in any
// order), then its block rows s * block .. s * block + block - 1 of block_k and block_v ([rows][kv_heads][head_dim]
// with row strides block_k_ld and block_v_ld, multiples of 8).
struct GqaKeys {
    const bf16* ctx_k;
    const bf16* ctx_v;
    int capacity;
    const int32_t* cache_streams;
    const int32_t* starts;
    const bf16* block_k;
    int64_t block_k_ld;
    const bf16* block_v;
    int64_t block_v_ld;
};

// Workspace floats for up to `streams` streams of at most max_ctx context rows each.
int64_t gqa_workspace_floats(const GqaDims& d, int streams, int max_ctx);

// out [streams * block][heads * head_dim] = softmax(q k^T * scale) v for q [streams * block][heads][head_dim].
// `span` bounds min(starts[s], capacity) of every stream (it sizes the grid, never a result) and is at most the
// max_ctx of the workspace.
cudaError_t gqa_attention(bf16* out, const bf16* q, const GqaKeys& keys, int streams, int span, const GqaDims& d,
                          float scale, float* workspace, cudaStream_t stream);

}  // namespace ddtree::kernels
