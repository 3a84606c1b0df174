// RoPE kernels for MLA queries and keys. Each output element depends on its own row only.
#include "rope.cuh"

#include "row_norm.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kRopeThreads = 256;
static_assert(kRopeMaxDim / 2 <= kRopeThreads && kRopeMaxDim / 2 <= kNormThreads, "a thread per rope pair");

struct Rotation {
    float c, s;
};

// cos/sin of pair i at `position`, scaled by the YaRN attention factor.
__device__ __forceinline__ Rotation rotation(int i, int position, const RopeParams& r) {
    const float angle = static_cast<float>(position) * r.inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    return {c * r.attention_factor, s * r.attention_factor};
}

// The two dims of pair i: (2i, 2i + 1) interleaved, else (i, i + rope_dim / 2).
struct PairDims {
    int lo, hi;
};
__device__ __forceinline__ PairDims pair_dims(int i, const RopeParams& r) {
    return {r.interleave ? 2 * i : i, r.interleave ? 2 * i + 1 : i + r.rope_dim / 2};
}

// (x0, x1) rotated, rounded to bf16, stored to dims d of `dst`.
__device__ __forceinline__ void store_rotated(bf16* dst, PairDims d, float x0, float x1, Rotation rot) {
    dst[d.lo] = __float2bfloat16(x0 * rot.c - x1 * rot.s);
    dst[d.hi] = __float2bfloat16(x1 * rot.c + x0 * rot.s);
}

// Rotates pair i of `src` (rope_dim elements) into `dst`.
__device__ __forceinline__ void rotate_pair(bf16* dst, const bf16* src, int i, Rotation rot, const RopeParams& r) {
    const PairDims d = pair_dims(i, r);
    const float x0 = __bfloat162float(src[d.lo]), x1 = __bfloat162float(src[d.hi]);
    store_rotated(dst, d, x0, x1, rot);
}

// Thread t rotates pair t % half of heads t / half, t / half + kRopeThreads / half, ...: the row's angles are
// computed once per pair, not once per head, and a thread loads kHeadBatch heads' pairs before it stores any.
constexpr int kHeadBatch = 8;

__global__ void __launch_bounds__(kRopeThreads)
    rope_queries_kernel(bf16* __restrict__ out, int64_t out_ld, int64_t out_head, int out_offset,
                        const bf16* __restrict__ q, int64_t q_ld, int64_t q_head, int q_offset,
                        const int32_t* positions, int heads, RopeParams rope) {
    dependent_kernel_start();
    const int64_t row = blockIdx.x;
    const int half = rope.rope_dim / 2, heads_per_pass = kRopeThreads / half;
    const int i = threadIdx.x % half, h0 = threadIdx.x / half;
    if (h0 >= heads_per_pass) return;
    const PairDims d = pair_dims(i, rope);
    bf16* dst = out + row * out_ld + out_offset;
    const bf16* src = q + row * q_ld + q_offset;
    const Rotation rot = rotation(i, positions[row], rope);
    for (int hb = h0; hb < heads; hb += kHeadBatch * heads_per_pass) {
        float x0[kHeadBatch], x1[kHeadBatch];
#pragma unroll
        for (int j = 0; j < kHeadBatch; ++j) {
            const int h = hb + j * heads_per_pass;
            x0[j] = h < heads ? __bfloat162float(src[h * q_head + d.lo]) : 0.f;
            x1[j] = h < heads ? __bfloat162float(src[h * q_head + d.hi]) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < kHeadBatch; ++j) {
            const int h = hb + j * heads_per_pass;
            if (h < heads) store_rotated(dst + h * out_head, d, x0[j], x1[j], rot);
        }
    }
}

// The latent half of a cache row is rmsnorm(latent) * norm_weight, held in registers (row_norm.cuh); the
// rope half is rotated by the first rope_dim / 2 threads.
template <int G, bool kVector>
__global__ void __launch_bounds__(kNormThreads)
    mla_store_kv_kernel(bf16* cache, const int32_t* slots, const bf16* kv_a, int64_t kv_ld, const bf16* norm_weight,
                        float eps, int kv_lora, const int32_t* positions, RopeParams rope) {
    dependent_kernel_start();
    const int64_t row = blockIdx.x;
    const bf16* src = kv_a + row * kv_ld;
    bf16* dst = cache + static_cast<int64_t>(slots[row]) * (kv_lora + rope.rope_dim);
    float v[G][kNormVec];
    load_row<G, kVector>(v, src, kv_lora);
    if (threadIdx.x < rope.rope_dim / 2) {
        rotate_pair(dst + kv_lora, src + kv_lora, threadIdx.x, rotation(threadIdx.x, positions[row], rope), rope);
    }
    float w[G][kNormVec];  // in flight during the reduction
    load_row<G, kVector>(w, norm_weight, kv_lora);
    store_normed<G, kVector>(dst, v, row_rstd<G>(v, kv_lora, eps), w, kv_lora);
}

}  // namespace

cudaError_t rope_queries(bf16* out, int64_t out_ld, int64_t out_head, int out_offset, const bf16* q, int64_t q_ld,
                         int64_t q_head, int q_offset, const int32_t* positions, int rows, int heads,
                         const RopeParams& rope, cudaStream_t stream) {
    if (rows < 0 || heads <= 0 || !rope_supported(rope.rope_dim)) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    return launch_dependent(rope_queries_kernel, dim3(rows), dim3(kRopeThreads), 0, stream, out, out_ld, out_head,
                            out_offset, q, q_ld, q_head, q_offset, positions, heads, rope);
}

cudaError_t mla_store_kv(bf16* cache, const int32_t* slots, const bf16* kv_a, int64_t kv_ld,
                         const bf16* norm_weight, float eps, int kv_lora, const int32_t* positions, int rows,
                         const RopeParams& rope, cudaStream_t stream) {
    if (rows < 0 || !norm_dim_supported(kv_lora) || !rope_supported(rope.rope_dim)) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    // Cache rows are kv_lora + rope_dim long: 16-byte stores need that length and kv_ld in whole vectors.
    const bool vector = rows_vectorizable(kv_a, kv_ld, kv_lora) && rows_vectorizable(norm_weight, 0, kv_lora) &&
                        rows_vectorizable(cache, kv_lora + rope.rope_dim, kv_lora);
    return dispatch_norm_row(kv_lora, vector, [&](auto groups, auto vec) {
        return launch_dependent(mla_store_kv_kernel<decltype(groups)::value, decltype(vec)::value>, dim3(rows),
                                dim3(kNormThreads), 0, stream, cache, slots, kv_a, kv_ld, norm_weight, eps, kv_lora,
                                positions, rope);
    });
}

}  // namespace ddtree::kernels
