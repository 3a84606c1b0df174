// MoE router (noaux_tc, DeepSeek-V3 / K2): scores = sigmoid(logits); the top-k experts by score + bias (ties
// to the lower expert id, best first); weights = their unbiased scores, normalised to sum 1 when `normalize`.
// The routed scaling factor is applied by the expert kernels. One warp per token: batch-invariant.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

constexpr int kRouterMaxTopk = 16;
constexpr int kRouterMaxExperts = 3072;  // four tokens' score rows per CTA fit the default 48 KB of shared memory

inline bool router_supported(int experts, int topk) {
    return experts >= 1 && experts <= kRouterMaxExperts && topk >= 1 && topk <= kRouterMaxTopk && topk <= experts;
}

// logits: fp32 [tokens, experts]; bias: fp32 [experts]; topk_ids int32 / topk_weights fp32 [tokens, topk].
cudaError_t route_topk(int32_t* topk_ids, float* topk_weights, const float* logits, const float* bias,
                       int tokens, int experts, int topk, bool normalize, cudaStream_t stream);

// Experts split over GPUs: local_ids[i] = topk_ids[i] - first when this GPU holds that expert (first <= id <
// first + held), else -1, which the expert kernels skip. `count` ids (tokens x topk).
cudaError_t localize_expert_ids(int32_t* local_ids, const int32_t* topk_ids, int count, int first, int held,
                                cudaStream_t stream);

}  // namespace ddtree::kernels
