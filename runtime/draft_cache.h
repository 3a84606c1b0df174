// The drafter's KV cache: per layer K (after k_norm and RoPE) and V of the committed context rows only, bf16
// [streams][capacity][kv_heads][head_dim]. capacity is max_context, or with a window W the last W rows as a ring:
// position p of a stream lives in its row p % capacity either way, so a stream at committed length `start` holds
// positions [max(start - capacity, 0), start). The block's own keys never enter the cache.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common.cuh"
#include "device_arena.h"
#include "drafter_weights.h"

namespace ddtree {

class DraftCache {
  public:
    DraftCache(const DrafterDims& dims, int streams, int capacity, DeviceArena& arena);

    int streams() const { return streams_; }
    int capacity() const { return capacity_; }
    int64_t layer_elements() const { return static_cast<int64_t>(streams_) * capacity_ * row_; }
    kernels::bf16* keys(int layer) const { return keys_ + layer * layer_elements(); }
    kernels::bf16* values(int layer) const { return values_ + layer * layer_elements(); }
    // The cache row (over all streams) of `position` of `stream`.
    int32_t slot(int stream, int position) const { return stream * capacity_ + position % capacity_; }
    // Rows held at committed length `start`.
    int rows_held(int start) const { return start < capacity_ ? start : capacity_; }

    // Random contents in every row (benchmarks).
    void randomize(uint64_t seed, cudaStream_t stream) const;
    // Zeros in every row, enqueued (the drafter, once at creation): timing replays draft over context rows no
    // prefill wrote (see LatentCache::clear).
    void clear(cudaStream_t stream) const;

  private:
    int layers_, row_, streams_, capacity_;
    kernels::bf16 *keys_, *values_;
};

}  // namespace ddtree
