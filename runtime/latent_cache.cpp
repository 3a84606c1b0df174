#include "latent_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "fill_random.cuh"
#include "mla_attn.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

LatentCache::LatentCache(const ModelDims& dims, int streams, int max_context, int tree_rows, DeviceArena& arena)
    : layers_(dims.layers), row_(dims.latent_row()), streams_(streams), max_context_(max_context),
      stream_rows_(0) {
    if (static_cast<int64_t>(streams) * (static_cast<int64_t>(max_context) + tree_rows) > INT32_MAX) {
        throw std::invalid_argument("streams x (max_context + budget + 1) = " + std::to_string(streams) + " x " +
                                    std::to_string(static_cast<int64_t>(max_context) + tree_rows) +
                                    " cache rows exceed the int32 row index");
    }
    stream_rows_ = max_context + tree_rows;
    data_ = arena.take<k::bf16>(elements());
}

int LatentCache::attention_span(int longest) const {
    int granule = k::kMlaShortChunk;  // a quarter of the power of two below `longest`, in whole chunks
    while (granule * 8 <= longest) granule *= 2;
    const int rounded = std::min((longest + granule - 1) / granule * granule, stream_rows_);
    // The longest span of the same chunk bound launches the same grid, and the spans of one bound then share a graph.
    return static_cast<int>(std::min<int64_t>(k::mla_longest_len(k::mla_max_chunks(rounded)), stream_rows_));
}

void LatentCache::clear(cudaStream_t stream) const {
    CUDA_CHECK(cudaMemsetAsync(data_, 0, elements() * sizeof(k::bf16), stream));
}

void LatentCache::randomize(uint64_t seed, cudaStream_t stream) const {
    CUDA_CHECK(k::fill_random_bf16(data_, static_cast<int64_t>(elements()), seed, 1.f, 0.f, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace ddtree
