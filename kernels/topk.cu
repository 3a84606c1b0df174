// Per-row top-k of log-softmax: one thread-block cluster of kRowCtas CTAs per row, one launch, the row read once.
//
// The row's (max, sum of exp) has a fixed reduction order that depends on nothing but the vocabulary: 1024
// strided partials (partial t takes tokens t, t + 1024, ... online), a butterfly over each warp of 32 partials,
// then a butterfly over the 32 warps' results. CTA `part` of the cluster owns partials [128 part, 128 part + 128),
// whole warps, and the tokens they take (its slice), which it stages in shared memory:
//   1. its 4 warps stage the slice, each thread the tokens of its own partial, run the partials as the tokens
//      land, then the warp butterflies, and write the results to every CTA of the cluster; each CTA then runs
//      the same 32-warp butterfly on the same values, so all hold the same row statistics;
//   2. each CTA turns its slice into orderable 32-bit keys of the log-probs, in place, and selects its top k by
//      (log-prob descending, id ascending): radix select of the k-th largest key (11 + 11 + 10 bits) among those
//      at or above a floor (for k <= 128, the k-th largest of its partials' maxima), an ordered compaction (every
//      key above it, then the lowest ids of those equal to it) and a bitonic sort. Fewer than k entries of the
//      row rank above an entry of the row's top k, so fewer than k of its slice do: it is in its slice's top k;
//   3. every CTA copies the cluster's sorted lists and ranks each of its own entries among all of them (binary
//      searches); an entry of rank < k is in the row's top k, and its rank is its place there. Entries are
//      distinct (the ids are), so the ranks of the row's top k are exactly 0..k-1.
// Every log-prob comes from its logit by the same expression, the one the keys and the outputs hold.
#include <cooperative_groups.h>

#include <atomic>
#include <limits>

#include "gemm_mma.cuh"
#include "topk.cuh"

namespace ddtree::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kPartials = 1024;  // the row reduction's strided partials
constexpr int kRowCtas = 8;      // CTAs per row: a 163840-token row leaves 20480 tokens to each
constexpr int kCtaPartials = kPartials / kRowCtas;
constexpr int kCtaWarps = kCtaPartials / 32;
constexpr int kBins = 2048;  // 11-bit digits
constexpr int kStages = 4;   // cp.async groups a partial's tokens arrive in
static_assert(kCtaPartials % 32 == 0 && kCtaPartials <= kThreads, "a CTA runs whole warps of partials");
static_assert(kTopkMax <= kThreads, "the sort keeps one candidate per thread");

// Shared memory beyond the static arrays: the slice, later every CTA's sorted candidates.
constexpr int slice_capacity(int vocab) { return (vocab + kPartials - 1) / kPartials * kCtaPartials; }
constexpr size_t dynamic_smem_bytes(int vocab, int sorted_len) {
    const size_t slice = sizeof(float) * slice_capacity(vocab);
    const size_t lists = sizeof(unsigned long long) * kRowCtas * sorted_len;
    return slice > lists ? slice : lists;
}
constexpr size_t kMaxDynamicSmem = dynamic_smem_bytes(kTopkVocabMax, kTopkMax);
static_assert(kMaxDynamicSmem + 20 * 1024 <= 227 * 1024, "the slice of the largest vocabulary fits on an SM");

// Slice position p of CTA `part` holds token (p / 128) * 1024 + 128 part + p % 128: ascending in p.
__device__ __forceinline__ int slice_token(int p, int part) {
    return (p / kCtaPartials) * kPartials + part * kCtaPartials + p % kCtaPartials;
}
__device__ __forceinline__ int slice_count(int vocab, int part) {
    return vocab / kPartials * kCtaPartials + min(max(vocab % kPartials - part * kCtaPartials, 0), kCtaPartials);
}

struct RowStats {
    float max;
    float log_sum;
};

__device__ __forceinline__ float finite_or_lowest(float x) { return isnan(x) ? -INFINITY : x; }

// Larger floats map to larger keys (NaN never occurs: finite_or_lowest).
__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ float log_prob(float x, const RowStats& st) {
    return (finite_or_lowest(x) - st.max) - st.log_sum;
}

// A candidate as one integer: larger is better, equal keys go to the lower id; 0 is below every real entry (the
// key of -inf is 0x007fffff).
__device__ __forceinline__ unsigned long long entry_of(uint32_t key, int id) {
    return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}

__device__ __forceinline__ void cp_async4(uint32_t* smem, const float* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}

// Online (max, sum of exp) of two partials.
__device__ __forceinline__ void merge_stats(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

// Every lane's (m, s) merged over the warp, lane 0's result being the one the order defines.
__device__ __forceinline__ void warp_merge_stats(float& m, float& s) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        merge_stats(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    }
}

// Waits until at most `pending` of this thread's cp.async groups are in flight (0 <= pending < kStages). The
// thread reads what landed with no barrier in between, so the wait is also a compiler memory barrier: no load of
// the slice moves above it.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_landed() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
    static_assert(kStages == 4, "one case per stage");
    switch (pending) {
        case 0: cp_async_wait_landed<0>(); break;
        case 1: cp_async_wait_landed<1>(); break;
        case 2: cp_async_wait_landed<2>(); break;
        default: cp_async_wait_landed<3>(); break;
    }
}

// Partial `partial` of the row (thread t of its CTA), from (m, s) = (-inf, 0), over its tokens partial,
// partial + 1024, ..., which this thread alone stages, at slice positions j * 128 + t: in kStages groups, each run
// as it lands, so the statistics overlap the read of the row.
__device__ __forceinline__ void run_partial(uint32_t* slice, const float* x, int t, int partial, int vocab,
                                            float& m, float& s) {
    const int n = partial < vocab ? (vocab - partial + kPartials - 1) / kPartials : 0;
    const int per_stage = (n + kStages - 1) / kStages;
    for (int g = 0; g < kStages; ++g) {
        for (int j = g * per_stage; j < min(n, (g + 1) * per_stage); ++j) {
            cp_async4(&slice[j * kCtaPartials + t], x + partial + j * kPartials);
        }
        cp_async_commit();
    }
    for (int g = 0; g < kStages; ++g) {
        cp_async_wait_pending(kStages - 1 - g);
        const int end = min(n, (g + 1) * per_stage);
#pragma unroll 8
        for (int j = g * per_stage; j < end; ++j) {
            const float v = finite_or_lowest(__uint_as_float(slice[j * kCtaPartials + t]));
            if (v > m) {
                s = s * expf(m - v) + 1.f;
                m = v;
            } else if (v != -INFINITY) {
                s += expf(v - m);
            }
        }
    }
}

// Inclusive prefix sum of `v` over the block (thread order), and the block total.
__device__ int block_scan(int v, int* s_warp, int& total) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int x = v;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, offset);
        if (lane >= offset) x += y;
    }
    if (lane == 31) s_warp[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = s_warp[lane];
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, offset);
            if (lane >= offset) w += y;
        }
        s_warp[lane] = w;
    }
    __syncthreads();
    total = s_warp[kWarps - 1];
    const int result = x + (warp > 0 ? s_warp[warp - 1] : 0);
    __syncthreads();  // s_warp is reused
    return result;
}

struct Threshold {
    uint32_t key;   // the want-th largest key of the slice
    int remaining;  // how many keys equal to it belong to the top `want`
};

// Radix select over the slice's `count` keys, 1 <= want <= count, given a key at or below the want-th largest:
// the keys under it are left out of every histogram, so the atomics serve only the few that may be in.
__device__ Threshold radix_select(const uint32_t* keys, int count, uint32_t floor_key, int want, uint32_t* s_hist,
                                  int* s_warp, Threshold* s_result) {
    uint32_t prefix = 0, mask = 0;
    int remaining = want;
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bits = pass == 2 ? 10 : 11;
        const uint32_t digit_mask = (1u << bits) - 1u;
        for (int b = threadIdx.x; b < kBins; b += kThreads) s_hist[b] = 0;
        __syncthreads();
        const int lane = threadIdx.x % 32;
        for (int base = 0; base < count; base += kThreads) {
            const int p = base + threadIdx.x;
            bool counted = false;
            uint32_t digit = 0;
            if (p < count) {
                const uint32_t key = keys[p];
                counted = key >= floor_key && (key & mask) == prefix;
                digit = (key >> shift) & digit_mask;
            }
            // Lanes that share a bin add once: the few bins the high digits of real logits fall in would otherwise
            // serialise the atomics.
            const unsigned voters = __ballot_sync(0xffffffffu, counted);
            if (counted) {
                const unsigned same = __match_any_sync(voters, digit);
                if (lane == __ffs(same) - 1) atomicAdd(&s_hist[digit], __popc(same));
            }
        }
        __syncthreads();
        // The digit is the bin where the count from the top bin down reaches `remaining`: thread t scans bins
        // top - 2t and top - 2t - 1, in order over the threads.
        const int hi = static_cast<int>(digit_mask) - 2 * static_cast<int>(threadIdx.x), lo = hi - 1;
        const int h_hi = hi >= 0 ? static_cast<int>(s_hist[hi]) : 0, h_lo = lo >= 0 ? static_cast<int>(s_hist[lo]) : 0;
        int total = 0;
        const int through = block_scan(h_hi + h_lo, s_warp, total);
        const int above = through - h_hi - h_lo;
        if (above < remaining && remaining <= above + h_hi) {
            *s_result = Threshold{static_cast<uint32_t>(hi), remaining - above};
        } else if (above + h_hi < remaining && remaining <= through) {
            *s_result = Threshold{static_cast<uint32_t>(lo), remaining - above - h_hi};
        }
        __syncthreads();
        prefix |= s_result->key << shift;
        mask |= digit_mask << shift;
        remaining = s_result->remaining;
        __syncthreads();  // s_result is reused
    }
    return Threshold{prefix, remaining};
}

// The slice's top `want` into s_cand[0, want), unordered but for the keys equal to the threshold, of which the
// lowest ids are taken: thread t takes a run of consecutive positions, so thread order is token order.
__device__ void compact(const uint32_t* keys, int count, int part, int want, Threshold th, unsigned long long* s_cand,
                        int* s_warp) {
    const int run = (count + kThreads - 1) / kThreads;
    const int begin = min(count, static_cast<int>(threadIdx.x) * run), end = min(count, begin + run);
    int above = 0, equal = 0;
    for (int p = begin; p < end; ++p) {
        const uint32_t key = keys[p];
        above += key > th.key;
        equal += key == th.key;
    }
    int total = 0;
    int slot_above = block_scan(above, s_warp, total) - above;
    int slot_equal = block_scan(equal, s_warp, total) - equal;
    const int above_total = want - th.remaining;
    for (int p = begin; p < end && (slot_above < above_total || slot_equal < th.remaining); ++p) {
        const uint32_t key = keys[p];
        if (key > th.key) {
            s_cand[slot_above++] = entry_of(key, slice_token(p, part));
        } else if (key == th.key && slot_equal < th.remaining) {
            s_cand[above_total + slot_equal++] = entry_of(key, slice_token(p, part));
        }
    }
}

// Bitonic sort, descending, of s_cand[0, sorted_len) (sorted_len a power of two, every thread holding one entry);
// returns thread t's entry, the t-th largest. Strides within a warp exchange by shuffles, wider ones through
// s_cand. Threads at or past sorted_len sort their own blocks of the padding, apart from the rest.
__device__ unsigned long long sort_descending(unsigned long long* s_cand, int sorted_len) {
    unsigned long long e = s_cand[threadIdx.x];
    for (int size = 2; size <= sorted_len; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            unsigned long long other;
            if (stride >= 32) {
                __syncthreads();
                s_cand[threadIdx.x] = e;
                __syncthreads();
                other = s_cand[threadIdx.x ^ stride];
            } else {
                other = __shfl_xor_sync(0xffffffffu, e, stride);
            }
            const bool larger = ((threadIdx.x & size) == 0) == ((threadIdx.x & stride) == 0);
            e = larger ? max(e, other) : min(e, other);
        }
    }
    return e;
}

__global__ void __cluster_dims__(kRowCtas, 1, 1) __launch_bounds__(kThreads, 2)
    topk_kernel(float* log_probs, int32_t* ids, const float* logits, int64_t ld, int vocab, int k, int sorted_len) {
    extern __shared__ float4 s_dynamic[];
    // The slice's logits as raw words, then in place their keys; after the selection, every CTA's sorted lists.
    uint32_t* s_slice = reinterpret_cast<uint32_t*>(s_dynamic);
    unsigned long long* s_lists = reinterpret_cast<unsigned long long*>(s_dynamic);
    __shared__ uint32_t s_hist[kBins];
    __shared__ unsigned long long s_cand[kThreads];
    __shared__ float s_m[kWarps], s_s[kWarps];  // every warp's partial of the row, in warp order
    __shared__ int s_warp[kWarps];
    __shared__ RowStats s_stats;
    __shared__ Threshold s_threshold;
    __shared__ uint32_t s_partial_keys[kCtaPartials];  // the key of each partial's largest logit
    __shared__ uint32_t s_floor;
    // CTAs write their warps' partials into each other's shared memory, which needs every CTA of the cluster to
    // have started: arrive now, wait just before the writes, so staging the slice hides the wait.
    __cluster_barrier_arrive_relaxed();
    const cg::cluster_group cluster = cg::this_cluster();
    const int row = blockIdx.x / kRowCtas;
    const int part = static_cast<int>(cluster.block_rank());
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* x = logits + static_cast<int64_t>(row) * ld;
    const int count = slice_count(vocab, part);

    const int partial = part * kCtaPartials + static_cast<int>(threadIdx.x);
    float m = -INFINITY, s = 0.f, partial_max = -INFINITY;
    if (threadIdx.x < kCtaPartials) {
        run_partial(s_slice, x, threadIdx.x, partial, vocab, m, s);
        partial_max = m;
        warp_merge_stats(m, s);
    }
    cluster.barrier_wait();
    if (threadIdx.x < kCtaPartials && lane == 0) {
        for (int r = 0; r < kRowCtas; ++r) {
            cluster.map_shared_rank(s_m, r)[part * kCtaWarps + warp] = m;
            cluster.map_shared_rank(s_s, r)[part * kCtaWarps + warp] = s;
        }
    }
    cluster.sync();  // every warp's partial is in every CTA's s_m / s_s
    if (warp == 0) {
        m = s_m[lane];
        s = s_s[lane];
        warp_merge_stats(m, s);
        if (lane == 0) s_stats = RowStats{m, logf(s)};
    }
    __syncthreads();  // also: the whole slice has landed
    const RowStats st = s_stats;

    const int want = min(k, count);
    if (want > 0) {
        for (int p = threadIdx.x; p < count; p += kThreads) {
            s_slice[p] = order_key(log_prob(__uint_as_float(s_slice[p]), st));
        }
        // A floor under the want-th largest key: the want-th largest of the partials' maxima, as each partial with
        // tokens holds its maximum (a partial without tokens takes key 0, below every real one: when want <= 128,
        // the partials with tokens number at least want).
        uint32_t floor_key = 0;
        if (want <= kCtaPartials) {
            if (threadIdx.x == 0) s_floor = 0xffffffffu;
            if (threadIdx.x < kCtaPartials) {
                s_partial_keys[threadIdx.x] = partial < vocab ? order_key(log_prob(partial_max, st)) : 0;
            }
            __syncthreads();
            if (threadIdx.x < kCtaPartials) {
                const uint32_t mine = s_partial_keys[threadIdx.x];
                int greater = 0;
                for (int u = 0; u < kCtaPartials; ++u) greater += s_partial_keys[u] > mine;
                if (greater < want) atomicMin(&s_floor, mine);
            }
        }
        __syncthreads();  // the keys are in place, the floor known
        if (want <= kCtaPartials) floor_key = s_floor;
        const Threshold th = radix_select(s_slice, count, floor_key, want, s_hist, s_warp, &s_threshold);
        compact(s_slice, count, part, want, th, s_cand, s_warp);
    }
    for (int j = want + threadIdx.x; j < kThreads; j += kThreads) s_cand[j] = 0;
    __syncthreads();
    const unsigned long long mine = sort_descending(s_cand, sorted_len);
    __syncthreads();
    s_cand[threadIdx.x] = mine;
    cluster.sync();  // every CTA's sorted candidates are in its s_cand

    // The slice is dead: its space takes the cluster's lists, list r at s_lists[r * sorted_len].
    for (int i = threadIdx.x; i < kRowCtas * sorted_len; i += kThreads) {
        s_lists[i] = cluster.map_shared_rank(s_cand, i / sorted_len)[i % sorted_len];
    }
    // This CTA reads no other's shared memory from here on; it waits for the others to say the same before it
    // exits, below, so the ranking overlaps their copies.
    __cluster_barrier_arrive();
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < want) {
        // The entries above `mine` in list r: the longest prefix of it that is above, by a binary search over
        // prefix lengths, the lists searched side by side.
        int above[kRowCtas] = {};
        for (int step = sorted_len; step > 0; step >>= 1) {
#pragma unroll
            for (int r = 0; r < kRowCtas; ++r) {
                const int n = above[r] + step;
                if (r != part && n <= sorted_len && s_lists[r * sorted_len + n - 1] > mine) above[r] = n;
            }
        }
        int rank = threadIdx.x;
#pragma unroll
        for (int r = 0; r < kRowCtas; ++r) rank += above[r];
        if (rank < k) {
            log_probs[static_cast<int64_t>(row) * k + rank] = key_value(static_cast<uint32_t>(mine >> 32));
            ids[static_cast<int64_t>(row) * k + rank] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(mine));
        }
    }
    cluster.barrier_wait();
}

}  // namespace

cudaError_t topk_log_softmax(float* log_probs, int32_t* ids, const float* logits, int64_t ld, int rows, int vocab,
                             int k, cudaStream_t stream) {
    if (rows < 0 || rows > std::numeric_limits<int>::max() / kRowCtas || vocab < 1 || vocab > kTopkVocabMax ||
        ld < vocab || k < 1 || k > vocab || k > kTopkMax) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) return cudaSuccess;
    static std::atomic<uint64_t> opted_in{0};
    DDTREE_RETURN_IF_ERROR(opt_in_smem(topk_kernel, static_cast<int>(kMaxDynamicSmem), opted_in));
    int sorted_len = 1;
    while (sorted_len < k) sorted_len <<= 1;
    topk_kernel<<<rows * kRowCtas, kThreads, dynamic_smem_bytes(vocab, sorted_len), stream>>>(log_probs, ids, logits,
                                                                                             ld, vocab, k, sorted_len);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
