// Arg-max / Gumbel-max sampling and the decode-state advance.
#include <cooperative_groups.h>

#include <cmath>
#include <limits>

#include "sample.cuh"

namespace ddtree::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
// CTAs per row, one thread-block cluster: one CTA per row left a 163840-token vocabulary (a 64-bit hash and two
// logarithms per token when sampling) to a single SM. The pick is an exact maximum with ties to the lower id, so
// how the vocabulary is cut never changes the token.
constexpr int kRowCtas = 8;

// One cluster per row along the grid's x dimension (2^31 - 1 CTAs; y would hold only 65535 rows).
__global__ void __cluster_dims__(kRowCtas, 1, 1) __launch_bounds__(kThreads)
    sample_kernel(int32_t* tokens, int32_t* nonfinite_at, const float* logits, int64_t ld, int vocab,
                  const float* temperature, const unsigned long long* seed, const int32_t* stream_ids,
                  const int32_t* positions, int first_id, RankCandidate* candidates) {
    __shared__ Best warp_bests[kThreads / 32];
    __shared__ Best cta_bests[kRowCtas];  // rank 0's copy gathers every CTA's best, in rank order
    // Each CTA writes its best into rank 0's shared memory, which needs rank 0 to have started: arrive here, wait
    // just before the write, so the scan of the vocabulary hides the wait.
    __cluster_barrier_arrive_relaxed();
    dependent_kernel_start();
    const cg::cluster_group cluster = cg::this_cluster();
    const int row = blockIdx.x / kRowCtas;
    const int part = static_cast<int>(cluster.block_rank());
    const int per_part = (vocab + kRowCtas - 1) / kRowCtas;
    const int end = min(vocab, (part + 1) * per_part);
    const float* x = logits + row * ld;
    const float temp = *temperature;
    const bool greedy = !(temp > 0.f);
    const float inv_t = greedy ? 1.f : 1.f / temp;
    const uint64_t key = mix64(*seed ^ mix64((static_cast<uint64_t>(stream_ids[row]) << 32) |
                                             static_cast<uint32_t>(positions[row])));
    Best best{-INFINITY, vocab};
    bool finite = true;
    for (int i = part * per_part + threadIdx.x; i < end; i += kThreads) {
        float v = x[i];
        finite = finite && isfinite(v);
        if (!greedy) {
            const uint64_t h = hash_at(key, static_cast<uint64_t>(first_id) + i);
            // (0, 1): 23 bits + 1/2 over 2^23 tops out at 1 - 2^-24, a float below 1 (24 bits would round the
            // top value to 1.0, an infinite G that wins whatever the logits).
            const float u = (static_cast<float>(h >> 41) + 0.5f) * (1.f / 8388608.f);
            v = v * inv_t - logf(-logf(u));
        }
        best = better(best, Best{v, i});
    }
    if (!finite) atomicMin(&nonfinite_at[stream_ids[row]], positions[row]);
    best = warp_best(best);
    if (threadIdx.x % 32 == 0) warp_bests[threadIdx.x / 32] = best;
    __syncthreads();
    cluster.barrier_wait();  // every CTA of the cluster, rank 0 with them, has started
    if (threadIdx.x == 0) {
        for (int w = 1; w < kThreads / 32; ++w) best = better(best, warp_bests[w]);
        cluster.map_shared_rank(cta_bests, 0)[part] = best;
    }
    // Every CTA's best is in rank 0's shared memory; the others may exit, as no CTA reads theirs.
    cluster.sync();
    if (part == 0 && threadIdx.x == 0) {
        best = cta_bests[0];
        for (int r = 1; r < kRowCtas; ++r) best = better(best, cta_bests[r]);
        if (candidates != nullptr) {  // a rank's slice: its best, a row of NaNs as -inf
            candidates[row] = best.index < vocab ? RankCandidate{best.value, first_id + best.index}
                                                 : RankCandidate{-INFINITY, first_id};
        } else {
            // A row of NaNs leaves no maximum; token 0 keeps the id in range.
            tokens[row] = best.index < vocab ? best.index : 0;
        }
    }
}

__global__ void advance_kernel(int32_t* ids, int32_t* positions, int32_t* kv_len, int32_t* slots,
                               const int32_t* kv_start, const int32_t* tokens, int32_t* history, int history_ld,
                               int32_t* step, int streams) {
    grid_dependency_wait();  // launched as a dependent: the sampled tokens come from the kernel before
    const int current = *step;
    for (int s = threadIdx.x; s < streams; s += blockDim.x) {
        const int32_t token = tokens[s];
        history[static_cast<int64_t>(s) * history_ld + current] = token;
        ids[s] = token;
        const int32_t pos = positions[s] + 1;
        positions[s] = pos;
        kv_len[s] = pos + 1;
        slots[s] = kv_start[s] + pos;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        *step = current + 1;
    }
}

}  // namespace

cudaError_t sample_tokens(int32_t* tokens, int32_t* nonfinite_at, const float* logits, int64_t ld, int rows,
                          int vocab, const float* temperature, const unsigned long long* seed,
                          const int32_t* stream_ids, const int32_t* positions, cudaStream_t stream) {
    if (rows < 0 || rows > std::numeric_limits<int>::max() / kRowCtas || vocab <= 0 || ld < vocab) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    return launch_dependent(sample_kernel, dim3(rows * kRowCtas), dim3(kThreads), 0, stream, tokens, nonfinite_at,
                            logits, ld, vocab, temperature, seed, stream_ids, positions, 0,
                            static_cast<RankCandidate*>(nullptr));
}

cudaError_t sample_candidates(RankCandidate* candidates, int32_t* nonfinite_at, const float* logits, int64_t ld,
                              int rows, int vocab, int first_id, const float* temperature,
                              const unsigned long long* seed, const int32_t* stream_ids, const int32_t* positions,
                              cudaStream_t stream) {
    if (rows < 0 || rows > std::numeric_limits<int>::max() / kRowCtas || vocab <= 0 || ld < vocab || first_id < 0 ||
        candidates == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    return launch_dependent(sample_kernel, dim3(rows * kRowCtas), dim3(kThreads), 0, stream,
                            static_cast<int32_t*>(nullptr), nonfinite_at, logits, ld, vocab, temperature, seed,
                            stream_ids, positions, first_id, candidates);
}

cudaError_t advance_decode(int32_t* ids, int32_t* positions, int32_t* kv_len, int32_t* slots, const int32_t* kv_start,
                           const int32_t* tokens, int32_t* history, int history_ld, int32_t* step, int streams,
                           cudaStream_t stream) {
    if (streams <= 0 || history_ld <= 0) {
        return cudaErrorInvalidValue;
    }
    return launch_dependent(advance_kernel, dim3(1), dim3(256), 0, stream, ids, positions, kv_len, slots, kv_start,
                            tokens, history, history_ld, step, streams);
}

}  // namespace ddtree::kernels
