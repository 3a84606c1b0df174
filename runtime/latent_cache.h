// The target's latent KV cache: per layer, `streams x stream_rows` rows of kv_lora + rope bf16 (normalised latent |
// rotated k_rope). Stream s owns rows [s * stream_rows, (s + 1) * stream_rows): its committed positions 0 ..
// max_context - 1, then the slots of one verify tree. Node i of a tree verified at committed length `start` writes
// row start + i, so the path a round accepts is often already in place, and a tree fits however full the context is.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "device_arena.h"
#include "model_dims.h"

namespace ddtree {

class LatentCache {
  public:
    // tree_rows: the most nodes (root included) of one stream's verify tree.
    LatentCache(const ModelDims& dims, int streams, int max_context, int tree_rows, DeviceArena& arena);

    int streams() const { return streams_; }
    int max_context() const { return max_context_; }
    int stream_rows() const { return stream_rows_; }
    int64_t layer_rows() const { return static_cast<int64_t>(streams_) * stream_rows_; }
    size_t elements() const { return static_cast<size_t>(layers_) * layer_rows() * row_; }
    int32_t stream_base(int stream) const { return stream * stream_rows_; }
    kernels::bf16* layer(int l) const { return data_ + static_cast<size_t>(l) * layer_rows() * row_; }

    // The attention span for rows of at most `longest` keys: whole key chunks, rounded up to a quarter of the
    // power of two below `longest` (at most 25% spare keys), then to the longest length with as many chunks
    // (mla_longest_len: 4097..8192 keys are one span), at most stream_rows. Each span is one captured graph; CTAs
    // past a row's length exit at once, but a grid sized for the whole cache launched thousands of them per layer
    // when the contexts were short.
    int attention_span(int longest) const;

    // Random contents in every row (benchmarks).
    void randomize(uint64_t seed, cudaStream_t stream) const;
    // Zeros in every row, enqueued (the engine, once at creation): attention loads whole 64-key tiles, masking the
    // keys past a row's length, and timing replays decode at positions no prefill wrote; zeroed rows make those
    // reads of initialized memory, so compute-sanitizer's initcheck reports only reads of memory never written.
    void clear(cudaStream_t stream) const;

  private:
    int layers_, row_, streams_, max_context_, stream_rows_;
    kernels::bf16* data_;
};

}  // namespace ddtree
