// RoPE kernels for MLA queries and keys. Each output element depends on its own row only.
#include "rope.cuh"

namespace ddtree::kernels {
namespace {

// Rotates pair i of `src` (d elements) into `dst`; cos/sin from the row's position.
__device__ __forceinline__ void rotate_pair(bf16* dst, const bf16* src, int i, int position, const RopeParams& r) {
    const int half = r.rope_dim / 2;
    const int lo = r.interleave ? 2 * i : i;
    const int hi = r.interleave ? 2 * i + 1 : i + half;
    const float angle = static_cast<float>(position) * r.inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    c *= r.attention_factor;
    s *= r.attention_factor;
    const float x0 = __bfloat162float(src[lo]), x1 = __bfloat162float(src[hi]);
    dst[lo] = __float2bfloat16(x0 * c - x1 * s);
    dst[hi] = __float2bfloat16(x1 * c + x0 * s);
}

__global__ void rope_queries_kernel(bf16* out, int64_t out_ld, int64_t out_head, int out_offset, const bf16* q,
                                    int64_t q_ld, int64_t q_head, int q_offset, const int32_t* positions,
                                    int heads, RopeParams rope) {
    allow_dependent_launch();  // a dependent GEMM next may start its weight prefetch during this kernel
    const int row = blockIdx.x;
    const int half = rope.rope_dim / 2;
    const int position = positions[row];
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        const int h = idx / half, i = idx % half;
        rotate_pair(out + row * out_ld + h * out_head + out_offset, q + row * q_ld + h * q_head + q_offset, i,
                    position, rope);
    }
}

constexpr int kStoreThreads = 128;

__global__ void __launch_bounds__(kStoreThreads)
    mla_store_kv_kernel(bf16* cache, const int32_t* slots, const bf16* kv_a, int64_t kv_ld,
                        const bf16* norm_weight, float eps, int kv_lora, const int32_t* positions, RopeParams rope) {
    allow_dependent_launch();  // a dependent GEMM next may start its weight prefetch during this kernel
    const int row = blockIdx.x;
    const bf16* src = kv_a + row * kv_ld;
    bf16* dst = cache + static_cast<int64_t>(slots[row]) * (kv_lora + rope.rope_dim);
    float sq = 0.f;
    for (int i = threadIdx.x; i < kv_lora; i += kStoreThreads) {
        const float v = __bfloat162float(src[i]);
        sq += v * v;
    }
    const float rstd = rsqrtf(block_sum<kStoreThreads>(sq) / static_cast<float>(kv_lora) + eps);
    for (int i = threadIdx.x; i < kv_lora; i += kStoreThreads) {
        dst[i] = __float2bfloat16(__bfloat162float(src[i]) * rstd * __bfloat162float(norm_weight[i]));
    }
    for (int i = threadIdx.x; i < rope.rope_dim / 2; i += kStoreThreads) {
        rotate_pair(dst + kv_lora, src + kv_lora, i, positions[row], rope);
    }
}

}  // namespace

cudaError_t rope_queries(bf16* out, int64_t out_ld, int64_t out_head, int out_offset, const bf16* q, int64_t q_ld,
                         int64_t q_head, int q_offset, const int32_t* positions, int rows, int heads,
                         const RopeParams& rope, cudaStream_t stream) {
    if (rows < 0 || heads <= 0 || rope.rope_dim <= 0 || rope.rope_dim % 2) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    rope_queries_kernel<<<rows, 256, 0, stream>>>(out, out_ld, out_head, out_offset, q, q_ld, q_head, q_offset,
                                                  positions, heads, rope);
    return cudaGetLastError();
}

cudaError_t mla_store_kv(bf16* cache, const int32_t* slots, const bf16* kv_a, int64_t kv_ld,
                         const bf16* norm_weight, float eps, int kv_lora, const int32_t* positions, int rows,
                         const RopeParams& rope, cudaStream_t stream) {
    if (rows < 0 || kv_lora <= 0 || rope.rope_dim <= 0 || rope.rope_dim % 2) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    mla_store_kv_kernel<<<rows, kStoreThreads, 0, stream>>>(cache, slots, kv_a, kv_ld, norm_weight, eps, kv_lora,
                                                            positions, rope);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
