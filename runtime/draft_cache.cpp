#include "draft_cache.h"

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "fill_random.cuh"

namespace ddtree {

DraftCache::DraftCache(const DrafterDims& dims, int streams, int capacity, DeviceArena& arena)
    : layers_(dims.layers), row_(dims.kv_dim()), streams_(streams), capacity_(capacity) {
    if (streams < 1 || capacity < 1 || static_cast<int64_t>(streams) * capacity > INT32_MAX) {
        throw std::invalid_argument("draft cache of " + std::to_string(streams) + " streams x " +
                                    std::to_string(capacity) + " rows: both must be positive and their product "
                                    "an int32 row index");
    }
    keys_ = arena.take<kernels::bf16>(layers_ * layer_elements());
    values_ = arena.take<kernels::bf16>(layers_ * layer_elements());
}

void DraftCache::clear(cudaStream_t stream) const {
    const size_t bytes = static_cast<size_t>(layers_ * layer_elements()) * sizeof(kernels::bf16);
    CUDA_CHECK(cudaMemsetAsync(keys_, 0, bytes, stream));
    CUDA_CHECK(cudaMemsetAsync(values_, 0, bytes, stream));
}

void DraftCache::randomize(uint64_t seed, cudaStream_t stream) const {
    const int64_t count = layers_ * layer_elements();
    CUDA_CHECK(kernels::fill_random_bf16(keys_, count, seed * 2 + 1, 1.f, 0.f, stream));
    CUDA_CHECK(kernels::fill_random_bf16(values_, count, seed * 2 + 2, 1.f, 0.f, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace ddtree
