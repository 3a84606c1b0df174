// The DFlash drafter on one GPU: the context append (fc over the tapped target hidden states, hidden_norm, every
// layer's K with k_norm and RoPE at absolute positions, and V, into the draft cache) and the block forward (the
// target's embedding of [bonus, MASK x (B - 1)] per stream; per layer RMSNorm, Q/K/V, q_norm/k_norm and RoPE,
// GQA attention over [context; block] without a mask, o_proj, residual, RMSNorm, SwiGLU, residual; the final norm
// and the target's LM head over block rows 1 .. B - 1). Inputs are device tables, nothing allocates or waits on
// the host, so both can be captured into a CUDA graph. Every kernel is batch-invariant: a stream's logits and cache
// rows are bitwise the same whatever other streams share the launch.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "device_arena.h"
#include "draft_cache.h"
#include "drafter_weights.h"
#include "model_dims.h"
#include "op_timeline.h"

namespace ddtree {

// n context rows of an append: row i is features[i] ([n][context_width] bf16, the concatenated taps), of the
// token at positions[i], its keys and values going to cache row slots[i] (DraftCache::slot). Slots must be
// distinct within an append.
struct DraftAppendRows {
    const kernels::bf16* features;
    const int32_t* positions;
    const int32_t* slots;
    int n;
};

// A block forward over `streams` launch streams: launch stream s drafts cache stream cache_streams[s] at its
// committed length starts[s] (block rows s * B + j at positions starts[s] + j with ids[s * B + j], the bonus token
// then B - 1 mask ids); head_rows lists the rows s * B + 1 .. s * B + B - 1 that get logits, in order. span bounds
// DraftCache::rows_held(starts[s]) for every s (it sizes the attention's grid, never a result).
struct DraftBlockRows {
    const int32_t* ids;
    const int32_t* positions;
    const int32_t* cache_streams;
    const int32_t* starts;
    const int32_t* head_rows;
    int streams;
    int span;
};

class DrafterModel {
  public:
    // Activations and scratch for block forwards of up to `streams` streams and appends of up to max_append rows.
    struct Scratch {
        kernels::bf16 *x, *xn, *qkv, *q, *block_k, *attn, *delta, *act, *head_in, *ctx, *ctx_normed, *ctx_kv;
        float *logits, *gemm_ws, *attn_ws, *inv_freq;
        int32_t* gemm_counters;
        size_t gemm_counter_count;
        static Scratch lay_out(const DrafterDims& dims, int streams, int capacity, int max_append, DeviceArena& arena);
    };

    // Device bytes of the weights, cache and scratch of a drafter of these sizes (the engine's pre-flight): the
    // constructor's own layout walked by a counting arena.
    static size_t planned_bytes(const DrafterDims& dims, int streams, int capacity, int max_append);

    // `rope`: over the whole head_dim, rotate-half (interleave false), with the drafter's amplitude. embed and
    // lm_head are the target's [vocab, hidden] tables. Kernels run on `stream`.
    DrafterModel(const DrafterDims& dims, const RopeTable& rope, const kernels::bf16* embed,
                 const kernels::bf16* lm_head, int streams, int capacity, int max_append, cudaStream_t stream,
                 DeviceArena& arena);

    const DrafterDims& dims() const { return dims_; }
    int max_append() const { return max_append_; }
    DrafterWeights& weights() { return weights_; }
    const DraftCache& cache() const { return cache_; }
    cudaStream_t stream() const { return stream_; }
    // fp32 [streams][B - 1][vocab] logits of the last block forward, for the per-depth top-K.
    const float* logits() const { return s_.logits; }

    // A timeline times each launch (OpTimeline), one at a time.
    void append(const DraftAppendRows& rows, OpTimeline* timeline);
    void block_forward(const DraftBlockRows& rows, OpTimeline* timeline);
    // The per-depth candidates of the last block forward of `streams` streams: log-softmax top-k of each logit row
    // (kernels/topk.cuh), log_probs / ids [streams][B - 1][k], 1 <= k <= min(vocab, kTopkMax). No logit row leaves
    // the device.
    void top_k(int streams, int k, float* log_probs, int32_t* ids, OpTimeline* timeline);

  private:
    DrafterDims dims_;
    RopeTable rope_;
    int streams_, max_append_;
    cudaStream_t stream_;
    DrafterWeights weights_;
    DraftCache cache_;
    Scratch s_;
};

}  // namespace ddtree
