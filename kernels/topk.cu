// Per-row top-k of log-softmax: one CTA of 1024 threads per row, in passes over the row (it stays in L2):
//   1. the row's max and sum of exp (online, per thread, then a fixed-order tree over the block);
//   2. radix select of the k-th largest log-prob over its orderable 32-bit key, 11 + 11 + 10 bits, one pass per
//      digit with a shared histogram (lanes of a warp that share a bin add once, so the few bins the high digits
//      of real logits fall in do not serialise the atomics);
//   3. an ordered compaction in token order: every key above the k-th, then the lowest ids of those equal to it;
//   4. a bitonic sort of the k candidates in shared memory by (key descending, id ascending).
// The log-prob is recomputed from the logit in every pass, by the same expression, so every pass ranks the same
// values.
#include "topk.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2048;  // 11-bit digits

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

// Online (max, sum of exp) of two partials.
__device__ __forceinline__ void merge_stats(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

__device__ RowStats row_stats(const float* x, int vocab, float* s_m, float* s_s) {
    float m = -INFINITY, s = 0.f;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
        const float v = finite_or_lowest(x[i]);
        if (v > m) {
            s = s * expf(m - v) + 1.f;
            m = v;
        } else if (v != -INFINITY) {
            s += expf(v - m);
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        merge_stats(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        s_m[warp] = m;
        s_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = s_m[lane];
        s = s_s[lane];
        for (int offset = 16; offset > 0; offset >>= 1) {
            merge_stats(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
        }
        if (lane == 0) {
            s_m[0] = m;
            s_s[0] = logf(s);
        }
    }
    __syncthreads();
    const RowStats st{s_m[0], s_s[0]};
    __syncthreads();  // s_m / s_s are reused
    return st;
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

__global__ void __launch_bounds__(kThreads, 1)
    topk_kernel(float* log_probs, int32_t* ids, const float* logits, int64_t ld, int vocab, int k, int sorted_len) {
    __shared__ uint32_t s_hist[kBins];
    __shared__ unsigned long long s_cand[kTopkMax];
    __shared__ float s_m[kWarps], s_s[kWarps];
    __shared__ int s_warp[kWarps];
    __shared__ uint32_t s_digit;
    __shared__ int s_remaining;
    const int row = blockIdx.x;
    const float* x = logits + static_cast<int64_t>(row) * ld;
    const RowStats st = row_stats(x, vocab, s_m, s_s);

    // Radix select: after the three digits, `prefix` is the k-th largest key and `remaining` how many keys equal to
    // it belong to the top k.
    uint32_t prefix = 0, mask = 0;
    int remaining = k;
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, bits = pass == 2 ? 10 : 11;
        const uint32_t digit_mask = (1u << bits) - 1u;
        for (int b = threadIdx.x; b < kBins; b += kThreads) s_hist[b] = 0;
        __syncthreads();
        const int lane = threadIdx.x % 32;
        for (int base = 0; base < vocab; base += kThreads) {
            const int i = base + threadIdx.x;
            bool counted = false;
            uint32_t digit = 0;
            if (i < vocab) {
                const uint32_t key = order_key(log_prob(x[i], st));
                counted = (key & mask) == prefix;
                digit = (key >> shift) & digit_mask;
            }
            const unsigned voters = __ballot_sync(0xffffffffu, counted);
            if (counted) {
                const unsigned same = __match_any_sync(voters, digit);
                if (lane == __ffs(same) - 1) atomicAdd(&s_hist[digit], __popc(same));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int above = 0;
            uint32_t b = digit_mask;
            while (above + static_cast<int>(s_hist[b]) < remaining) above += s_hist[b--];
            s_digit = b;
            s_remaining = remaining - above;
        }
        __syncthreads();
        prefix |= s_digit << shift;
        mask |= digit_mask << shift;
        remaining = s_remaining;
        __syncthreads();
    }

    // Ordered compaction: keys above the k-th take slots 0..k-remaining-1, the first `remaining` equal ones (lowest
    // ids) the rest.
    int taken_above = 0, taken_equal = 0;
    const int above_total = k - remaining;
    for (int base = 0; base < vocab && (taken_above < above_total || taken_equal < remaining); base += kThreads) {
        const int i = base + threadIdx.x;
        uint32_t key = 0;
        bool above = false, equal = false;
        if (i < vocab) {
            key = order_key(log_prob(x[i], st));
            above = key > prefix;
            equal = key == prefix;
        }
        int tile_above = 0, tile_equal = 0;
        const int before_above = block_scan(above, s_warp, tile_above) - above;
        const int before_equal = block_scan(equal, s_warp, tile_equal) - equal;
        const auto entry = [&] { return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - i); };
        if (above) s_cand[taken_above + before_above] = entry();
        if (equal && taken_equal + before_equal < remaining) s_cand[above_total + taken_equal + before_equal] = entry();
        taken_above += tile_above;
        taken_equal += tile_equal;
    }
    for (int j = k + threadIdx.x; j < sorted_len; j += kThreads) s_cand[j] = 0;  // below every real entry
    __syncthreads();

    // Bitonic sort, descending.
    for (int size = 2; size <= sorted_len; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int j = threadIdx.x; j < sorted_len; j += kThreads) {
                const int partner = j ^ stride;
                if (partner > j) {
                    const bool descending = (j & size) == 0;
                    const unsigned long long a = s_cand[j], b = s_cand[partner];
                    if ((a < b) == descending) {
                        s_cand[j] = b;
                        s_cand[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int j = threadIdx.x; j < k; j += kThreads) {
        const unsigned long long e = s_cand[j];
        log_probs[static_cast<int64_t>(row) * k + j] = key_value(static_cast<uint32_t>(e >> 32));
        ids[static_cast<int64_t>(row) * k + j] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(e));
    }
}

}  // namespace

cudaError_t topk_log_softmax(float* log_probs, int32_t* ids, const float* logits, int64_t ld, int rows, int vocab,
                             int k, cudaStream_t stream) {
    if (rows < 0 || vocab < 1 || ld < vocab || k < 1 || k > vocab || k > kTopkMax) return cudaErrorInvalidValue;
    if (rows == 0) return cudaSuccess;
    int sorted_len = 1;
    while (sorted_len < k) sorted_len <<= 1;
    topk_kernel<<<rows, kThreads, 0, stream>>>(log_probs, ids, logits, ld, vocab, k, sorted_len);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
