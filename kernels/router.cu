// Router top-k: k rounds of a warp-wide arg-max over the biased scores.
#include <cmath>

#include "router.cuh"

namespace ddtree::kernels {
namespace {

// One warp per token: the biased scores sit in the warp's shared-memory row, and each round is a warp arg-max
// (no CTA barriers), so a token costs a few microseconds of latency at any expert count.
constexpr int kWarpsPerCta = 4;
constexpr int kLoadBatch = 16;
static_assert(kWarpsPerCta * kRouterMaxExperts * sizeof(float) <= 48 * 1024, "score rows fit without opt-in");
static_assert(kRouterMaxTopk <= 32, "lane k holds the k-th choice");

// The router's score, in the reference's form.
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

__global__ void __launch_bounds__(32 * kWarpsPerCta)
    route_topk_kernel(int32_t* topk_ids, float* topk_weights, const float* logits, const float* bias, int tokens,
                      int experts, int topk, bool normalize) {
    extern __shared__ float s_rows[];  // [kWarpsPerCta][experts]
    constexpr uint32_t kAll = 0xffffffffu;
    dependent_kernel_start();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int token = blockIdx.x * kWarpsPerCta + warp;
    if (token >= tokens) return;
    float* s_biased = s_rows + warp * experts;
    const float* row = logits + static_cast<int64_t>(token) * experts;
    // A NaN score (from NaN activations) ranks lowest rather than never, so every round still picks an expert
    // in range; experts already taken are marked NaN and skipped.
    // A lane loads kLoadBatch logits and biases before it uses any: one memory round trip per 32 * kLoadBatch
    // experts rather than one per 32 (the division's slow path would keep the compiler from hoisting the loads).
    for (int base = lane; base < experts; base += 32 * kLoadBatch) {
        float logit[kLoadBatch], b[kLoadBatch];
#pragma unroll
        for (int j = 0; j < kLoadBatch; ++j) {
            const int e = base + 32 * j;
            logit[j] = e < experts ? row[e] : 0.f;
            b[j] = e < experts ? bias[e] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < kLoadBatch; ++j) {
            const int e = base + 32 * j;
            const float score = sigmoid(logit[j]) + b[j];
            if (e < experts) s_biased[e] = isnan(score) ? -INFINITY : score;
        }
    }
    __syncwarp();
    int chosen = 0;  // lane k < topk: the k-th expert
    for (int k = 0; k < topk; ++k) {
        Best best{-INFINITY, experts};
#pragma unroll 4
        for (int e = lane; e < experts; e += 32) {
            best = better(best, Best{s_biased[e], e});  // a taken expert's NaN never wins
        }
        best = warp_best(best);
        if (lane == k) chosen = best.index;
        __syncwarp();  // every lane has read this round's scores
        if (lane == 0) s_biased[best.index] = NAN;
        __syncwarp();
    }
    const float weight = lane < topk ? sigmoid(row[chosen]) : 0.f;
    float sum = 0.f;  // in slot order, as the reference sums
    for (int k = 0; k < topk; ++k) sum += __shfl_sync(kAll, weight, k);
    if (lane < topk) {
        topk_ids[token * topk + lane] = chosen;
        topk_weights[token * topk + lane] = normalize ? weight / (sum + 1e-20f) : weight;
    }
}

__global__ void localize_kernel(int32_t* local_ids, const int32_t* topk_ids, int count, int first, int held) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const int32_t local = topk_ids[i] - first;
    local_ids[i] = local >= 0 && local < held ? local : -1;
}

}  // namespace

cudaError_t localize_expert_ids(int32_t* local_ids, const int32_t* topk_ids, int count, int first, int held,
                                cudaStream_t stream) {
    if (count < 0 || first < 0 || held < 1) {
        return cudaErrorInvalidValue;
    }
    if (count == 0) {
        return cudaSuccess;
    }
    localize_kernel<<<(count + 255) / 256, 256, 0, stream>>>(local_ids, topk_ids, count, first, held);
    return cudaGetLastError();
}

cudaError_t route_topk(int32_t* topk_ids, float* topk_weights, const float* logits, const float* bias,
                       int tokens, int experts, int topk, bool normalize, cudaStream_t stream) {
    if (tokens < 0 || !router_supported(experts, topk)) {
        return cudaErrorInvalidValue;
    }
    if (tokens == 0) {
        return cudaSuccess;
    }
    const int ctas = (tokens + kWarpsPerCta - 1) / kWarpsPerCta;
    const size_t smem = kWarpsPerCta * experts * sizeof(float);
    return launch_dependent(route_topk_kernel, dim3(ctas), dim3(32 * kWarpsPerCta), smem, stream, topk_ids,
                            topk_weights, logits, bias, tokens, experts, topk, normalize);
}

}  // namespace ddtree::kernels
