// Seeded random fills (see fill_random.cuh): a hash of (seed, index) per element, so the result does not depend
// on the launch shape.
#include "fill_random.cuh"

namespace ddtree::kernels {
namespace {

__global__ void fill_bf16_kernel(bf16* dst, int64_t count, uint64_t seed, float scale, float offset) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float u = static_cast<float>(hash_at(seed, i) >> 40) * (2.f / 16777216.f) - 1.f;
        dst[i] = __float2bfloat16(offset + scale * u);
    }
}

__global__ void fill_bytes_kernel(uint8_t* dst, int64_t count, uint64_t seed, int lo, int span) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        dst[i] = static_cast<uint8_t>(lo + hash_at(seed, i) % span);
    }
}

}  // namespace

cudaError_t fill_random_bf16(bf16* dst, int64_t count, uint64_t seed, float scale, float offset, cudaStream_t stream) {
    if (count <= 0) {
        return count == 0 ? cudaSuccess : cudaErrorInvalidValue;
    }
    fill_bf16_kernel<<<1024, 256, 0, stream>>>(dst, count, seed, scale, offset);
    return cudaGetLastError();
}

cudaError_t fill_random_bytes(uint8_t* dst, int64_t count, uint64_t seed, int lo, int hi, cudaStream_t stream) {
    if (count < 0 || lo < 0 || hi > 255 || lo > hi) {
        return cudaErrorInvalidValue;
    }
    if (count == 0) {
        return cudaSuccess;
    }
    fill_bytes_kernel<<<1024, 256, 0, stream>>>(dst, count, seed, lo, hi - lo + 1);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
