// Seeded random fills of device buffers: benchmark weights and caches of the right scale without a checkpoint.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// dst[i] = bf16(offset + scale * u), u uniform in [-1, 1) from a hash of (seed, i).
cudaError_t fill_random_bf16(bf16* dst, int64_t count, uint64_t seed, float scale, float offset, cudaStream_t stream);
// Random bytes drawn uniformly from [lo, hi] (e.g. INT4 weight bytes whose bf16 scale pairs stay finite).
cudaError_t fill_random_bytes(uint8_t* dst, int64_t count, uint64_t seed, int lo, int hi, cudaStream_t stream);

}  // namespace ddtree::kernels
