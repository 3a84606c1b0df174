// Reference-grade INT4 experts: one thread per output feature, dequantising on the fly.
#include "experts_int4.cuh"

namespace ddtree::kernels {
namespace {

__device__ __forceinline__ float int4_dot(const bf16* x, const int32_t* packed_row, const bf16* scale_row, int in) {
    float acc = 0.f;
    for (int j = 0; j < in / 8; ++j) {
        const uint32_t word = static_cast<uint32_t>(packed_row[j]);
        const float s = __bfloat162float(scale_row[(8 * j) / 32]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float q = static_cast<float>(static_cast<int>((word >> (4 * i)) & 0xFu) - 8);
            acc += __bfloat162float(x[8 * j + i]) * (q * s);
        }
    }
    return acc;
}

__global__ void experts_up_kernel(bf16* act, const bf16* x, const int32_t* topk_ids, int topk, Int4Experts w) {
    const int pair = blockIdx.x, token = pair / topk;
    const int e = topk_ids[pair];
    if (e < 0) return;  // an expert another GPU holds (localize_expert_ids): its slot adds nothing here
    const bf16* xr = x + static_cast<int64_t>(token) * w.hidden;
    for (int f = threadIdx.x; f < w.inter; f += blockDim.x) {
        const int64_t row = static_cast<int64_t>(e) * w.inter + f;
        const float g = int4_dot(xr, w.gate_packed + row * (w.hidden / 8), w.gate_scale + row * (w.hidden / 32), w.hidden);
        const float u = int4_dot(xr, w.up_packed + row * (w.hidden / 8), w.up_scale + row * (w.hidden / 32), w.hidden);
        act[static_cast<int64_t>(pair) * w.inter + f] = __float2bfloat16(silu(g) * u);
    }
}

__global__ void experts_down_kernel(bf16* out, const bf16* act, const int32_t* topk_ids, const float* topk_weights,
                                    int topk, float scaling, Int4Experts w) {
    const int token = blockIdx.x;
    for (int h = threadIdx.x; h < w.hidden; h += blockDim.x) {
        float sum = 0.f;
        for (int k = 0; k < topk; ++k) {
            const int pair = token * topk + k;
            if (topk_ids[pair] < 0) continue;
            const int64_t row = static_cast<int64_t>(topk_ids[pair]) * w.hidden + h;
            const float y = int4_dot(act + static_cast<int64_t>(pair) * w.inter, w.down_packed + row * (w.inter / 8),
                                     w.down_scale + row * (w.inter / 32), w.inter);
            sum += topk_weights[pair] * scaling * y;
        }
        out[static_cast<int64_t>(token) * w.hidden + h] = __float2bfloat16(sum);
    }
}

}  // namespace

cudaError_t experts_int4_forward(bf16* out, bf16* act, const bf16* x, const int32_t* topk_ids,
                                 const float* topk_weights, int tokens, int topk, float scaling,
                                 const Int4Experts& w, cudaStream_t stream) {
    if (tokens < 0 || topk <= 0 || w.hidden % 32 || w.inter % 32) {
        return cudaErrorInvalidValue;
    }
    if (tokens == 0) {
        return cudaSuccess;
    }
    experts_up_kernel<<<tokens * topk, 128, 0, stream>>>(act, x, topk_ids, topk, w);
    DDTREE_RETURN_IF_ERROR(cudaGetLastError());
    experts_down_kernel<<<tokens, 128, 0, stream>>>(out, act, topk_ids, topk_weights, topk, scaling, w);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
