// Router top-k: k rounds of a block-wide arg-max over the biased scores.
#include <cmath>

#include "router.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 256;

struct Best {
    float value;
    int index;
};

// Larger value wins; equal values go to the lower index (the reference's stable sort).
__device__ __forceinline__ Best better(Best a, Best b) {
    return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__global__ void __launch_bounds__(kThreads)
    route_topk_kernel(int32_t* topk_ids, float* topk_weights, const float* logits, const float* bias, int experts,
                      int topk, bool normalize) {
    extern __shared__ float s_biased[];  // [experts]
    __shared__ Best warp_best[kThreads / 32];
    __shared__ int chosen[kRouterMaxTopk];
    allow_dependent_launch();  // a dependent GEMM next may start its weight prefetch during this kernel
    const int token = blockIdx.x;
    const float* row = logits + static_cast<int64_t>(token) * experts;
    // A NaN score (from NaN activations) ranks lowest rather than never, so every round still picks an expert
    // in range; experts already taken are marked NaN and skipped.
    for (int e = threadIdx.x; e < experts; e += kThreads) {
        const float score = 1.f / (1.f + expf(-row[e])) + bias[e];
        s_biased[e] = isnan(score) ? -INFINITY : score;
    }
    __syncthreads();
    for (int k = 0; k < topk; ++k) {
        Best best{-INFINITY, experts};
        for (int e = threadIdx.x; e < experts; e += kThreads) {
            if (!isnan(s_biased[e])) best = better(best, Best{s_biased[e], e});
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const Best other{__shfl_xor_sync(0xffffffffu, best.value, offset),
                             __shfl_xor_sync(0xffffffffu, best.index, offset)};
            best = better(best, other);
        }
        if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
        __syncthreads();
        if (threadIdx.x == 0) {
            Best b = warp_best[0];
            for (int w = 1; w < kThreads / 32; ++w) b = better(b, warp_best[w]);
            chosen[k] = b.index;
            s_biased[b.index] = NAN;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float weights[kRouterMaxTopk];
        float sum = 0.f;
        for (int k = 0; k < topk; ++k) {
            weights[k] = 1.f / (1.f + expf(-row[chosen[k]]));
            sum += weights[k];
        }
        for (int k = 0; k < topk; ++k) {
            topk_ids[token * topk + k] = chosen[k];
            topk_weights[token * topk + k] = normalize ? weights[k] / (sum + 1e-20f) : weights[k];
        }
    }
}

}  // namespace

cudaError_t route_topk(int32_t* topk_ids, float* topk_weights, const float* logits, const float* bias,
                       int tokens, int experts, int topk, bool normalize, cudaStream_t stream) {
    if (tokens < 0 || experts <= 0 || topk <= 0 || topk > kRouterMaxTopk || topk > experts || experts > 8192) {
        return cudaErrorInvalidValue;
    }
    if (tokens == 0) {
        return cudaSuccess;
    }
    route_topk_kernel<<<tokens, kThreads, experts * sizeof(float), stream>>>(topk_ids, topk_weights, logits, bias,
                                                                           experts, topk, normalize);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
