// Rank-order sums of partials and the cross-rank token pick.
#include <cmath>

#include "rank_reduce.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 256;

// One thread per output element; the parts of rank r, term t are plane elements apart.
__global__ void rank_order_sum_kernel(bf16* out, const bf16* parts, int ranks, int terms, int64_t plane,
                                      int64_t count) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (i >= count) return;
    float sum = 0.f;
    for (int p = 0; p < ranks * terms; ++p) sum += __bfloat162float(parts[p * plane + i]);
    out[i] = __float2bfloat16(sum);
}

__global__ void pick_kernel(int32_t* tokens, const RankCandidate* candidates, int ranks, int rows) {
    const int row = blockIdx.x * kThreads + threadIdx.x;
    if (row >= rows) return;
    RankCandidate best = candidates[row];
    for (int r = 1; r < ranks; ++r) {
        const RankCandidate c = candidates[static_cast<int64_t>(r) * rows + row];
        if (c.value > best.value || (c.value == best.value && c.id < best.id)) best = c;
    }
    tokens[row] = isinf(best.value) && best.value < 0.f ? 0 : best.id;
}

}  // namespace

cudaError_t rank_order_sum(bf16* out, const bf16* parts, int ranks, int terms, int rows, int width,
                           cudaStream_t stream) {
    if (ranks < 1 || terms < 1 || rows < 0 || width < 1) {
        return cudaErrorInvalidValue;
    }
    const int64_t count = static_cast<int64_t>(rows) * width;
    if (count == 0) {
        return cudaSuccess;
    }
    rank_order_sum_kernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        out, parts, ranks, terms, count, count);
    return cudaGetLastError();
}

cudaError_t pick_candidates(int32_t* tokens, const RankCandidate* candidates, int ranks, int rows,
                            cudaStream_t stream) {
    if (ranks < 1 || rows < 0) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    pick_kernel<<<(rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(tokens, candidates, ranks, rows);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
