// Per-head RMSNorm + rotate-half RoPE (see head_norm_rope.cuh).
#include "head_norm_rope.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kPerLane = kHeadNormRopeMaxDim / 32;

__global__ void __launch_bounds__(kWarpsPerCta * 32)
    head_norm_rope_kernel(bf16* __restrict__ out, int64_t out_ld, const int32_t* out_rows, const bf16* __restrict__ x,
                          int64_t x_ld, int rows, int heads, int head_dim, const bf16* norm_weight, float eps,
                          const int32_t* positions, RopeParams rope) {
    // The rotation pairs dims i and i + head_dim / 2, which other lanes hold: the normed head goes through smem.
    __shared__ float normed[kWarpsPerCta][kHeadNormRopeMaxDim];
    dependent_kernel_start();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
    if (item >= static_cast<int64_t>(rows) * heads) return;
    const int r = static_cast<int>(item / heads), h = static_cast<int>(item % heads);
    const bf16* src = x + r * x_ld + static_cast<int64_t>(h) * head_dim;
    float v[kPerLane];
    float squares = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < head_dim ? __bfloat162float(src[e]) : 0.f;
        squares += v[j] * v[j];
    }
    float scale = 1.f;
    if (norm_weight != nullptr) {
        for (int offset = 16; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
        scale = rsqrtf(squares / static_cast<float>(head_dim) + eps);
    }
    float* buf = normed[warp];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (e < head_dim) buf[e] = norm_weight != nullptr ? __bfloat162float(norm_weight[e]) * (v[j] * scale) : v[j];
    }
    __syncwarp();
    const int64_t dst_row = out_rows != nullptr ? out_rows[r] : r;
    if (dst_row < 0) return;
    bf16* dst = out + dst_row * out_ld + static_cast<int64_t>(h) * head_dim;
    const int half = head_dim / 2;
    for (int e = lane; e < head_dim; e += 32) {
        float y = buf[e];
        if (rope.inv_freq != nullptr) {
            const int i = e < half ? e : e - half;
            float s, c;
            sincosf(static_cast<float>(positions[r]) * rope.inv_freq[i], &s, &c);
            c *= rope.attention_factor;
            s *= rope.attention_factor;
            y = e < half ? buf[e] * c - buf[e + half] * s : buf[e] * c + buf[e - half] * s;
        }
        dst[e] = __float2bfloat16(y);
    }
}

}  // namespace

cudaError_t head_norm_rope(bf16* out, int64_t out_ld, const int32_t* out_rows, const bf16* x, int64_t x_ld, int rows,
                           int heads, int head_dim, const bf16* norm_weight, float eps, const int32_t* positions,
                           const RopeParams& rope, cudaStream_t stream) {
    const bool rotate = rope.inv_freq != nullptr;
    if (rows < 0 || heads <= 0 || !head_norm_rope_supported(head_dim) ||
        (rotate && (rope.rope_dim != head_dim || rope.interleave || positions == nullptr))) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) return cudaSuccess;
    const int64_t items = static_cast<int64_t>(rows) * heads;
    const dim3 grid(static_cast<unsigned>((items + kWarpsPerCta - 1) / kWarpsPerCta));
    return launch_dependent(head_norm_rope_kernel, grid, dim3(kWarpsPerCta * 32), 0, stream, out, out_ld, out_rows, x,
                            x_ld, rows, heads, head_dim, norm_weight, eps, positions, rope);
}

}  // namespace ddtree::kernels
