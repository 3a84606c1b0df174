// Routing alignment for the fused MoE: groups (token, slot) pairs by expert and cuts each expert's list
// into token blocks of at most kBlockTokens, entirely on the device (one CTA, one thread per expert).
// Blocks are ordered widest first (8 token tiles down to 1) so the persistent GEMMs start the longest
// units early; within a width, by expert. The order inside an expert's list comes from shared-memory
// atomics and may vary between calls; it only decides which MMA column a token uses, never its value.
#include "moe_marlin.cuh"

namespace ddtree::kernels::moe {
namespace {

constexpr int kAlignThreads = 1024;
constexpr int kWidths = kBlockTokens / 8;  // token tiles per block: 1..8
constexpr int kScanValues = kWidths + 1;   // [0]: pairs of the expert, [w]: its blocks of width w

// Exclusive scan of v over the block; returns the totals in `total`.
__device__ void block_exclusive_scan(int (&v)[kScanValues], int (&total)[kScanValues]) {
    __shared__ int warp_sums[kAlignThreads / 32][kScanValues];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int incl[kScanValues];
#pragma unroll
    for (int i = 0; i < kScanValues; ++i) {
        int x = v[i];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, d);
            if (lane >= d) x += y;
        }
        incl[i] = x;
        if (lane == 31) warp_sums[warp][i] = x;
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < kScanValues; ++i) {
            int x = warp_sums[lane][i];
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, x, d);
                if (lane >= d) x += y;
            }
            warp_sums[lane][i] = x;  // inclusive over warps
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kScanValues; ++i) {
        const int before_warp = warp > 0 ? warp_sums[warp - 1][i] : 0;
        v[i] = before_warp + incl[i] - v[i];
        total[i] = warp_sums[kAlignThreads / 32 - 1][i];
    }
}

__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int32_t* __restrict__ topk_ids, const uint8_t* __restrict__ mask, int pairs, int experts,
                     int* __restrict__ pair_rank, int* __restrict__ sorted_pairs, int4* __restrict__ blocks,
                     int* __restrict__ counters) {
    __shared__ int count[kMaxExperts];
    __shared__ int offset[kMaxExperts];
    // Launched as a dependent: the routing and the buffers (read by the previous call's kernels) belong to
    // earlier kernels.
    grid_dependency_wait();
    allow_dependent_launch();
    const int tid = threadIdx.x;
    for (int e = tid; e < kMaxExperts; e += kAlignThreads) count[e] = 0;
    __syncthreads();
    // A thread's first pair stays in registers for the scatter below (at small M the only pair: no re-read).
    int first_expert = 0, first_rank = -1;
    for (int i = tid; i < pairs; i += kAlignThreads) {
        const int e = topk_ids[i];
        const bool used = routed(e, experts, mask);
        const int rank = used ? atomicAdd(&count[e], 1) : -1;
        if (i == tid) {
            first_expert = e;
            first_rank = rank;
        } else {
            pair_rank[i] = rank;
        }
    }
    __syncthreads();

    const int n = tid < experts ? count[tid] : 0;
    const int full = n / kBlockTokens, rest = n % kBlockTokens;
    const int tail_width = (rest + 7) / 8;  // 0 when the expert splits into full blocks only
    int v[kScanValues], total[kScanValues];
    v[0] = n;
#pragma unroll
    for (int w = 1; w <= kWidths; ++w) v[w] = (w == kWidths ? full : 0) + (tail_width == w ? 1 : 0);
    block_exclusive_scan(v, total);

    if (tid < experts) {
        offset[tid] = v[0];
        int base = 0;  // blocks of wider classes come first
        for (int w = kWidths; w >= 1; --w) {
            int slot = base + v[w];
            if (w == kWidths) {
                for (int j = 0; j < full; ++j) blocks[slot++] = make_int4(tid, v[0] + j * kBlockTokens, kBlockTokens, 0);
            }
            if (tail_width == w) blocks[slot] = make_int4(tid, v[0] + full * kBlockTokens, rest, 0);
            base += total[w];
        }
    }
    if (tid == 0) {
        int nblocks = 0, wide = 0;
        for (int w = 1; w <= kWidths; ++w) {
            nblocks += total[w];
            if (w > kPairedMaxTiles) wide += total[w];
        }
        counters[0] = nblocks;
        counters[1] = 0;
        counters[2] = 0;
        counters[3] = wide;
    }
    __syncthreads();
    for (int i = tid; i < pairs; i += kAlignThreads) {
        const int r = i == tid ? first_rank : pair_rank[i];
        if (r >= 0) sorted_pairs[offset[i == tid ? first_expert : topk_ids[i]] + r] = i;
    }
}

}  // namespace

cudaError_t moe_align(const int32_t* topk_ids, const uint8_t* expert_mask, int tokens, int topk, int experts,
                      const Workspace& ws, cudaStream_t stream) {
    if (experts < 1 || experts > kMaxExperts) return cudaErrorInvalidValue;
    return launch_dependent(moe_align_kernel, dim3(1), dim3(kAlignThreads), 0, stream, topk_ids, expert_mask,
                            tokens * topk, experts, ws.pair_rank, ws.sorted_pairs, ws.blocks, ws.counters);
}

}  // namespace ddtree::kernels::moe
