// One row of an RMSNorm held in registers by one CTA, for the norm kernels and the latent KV store.
//
// Thread t owns groups of kNormVec consecutive elements: group g starts at element kNormVec * (g * kNormThreads + t).
// A row is read once (one 16-byte load per group and array when every row is 16-byte aligned), so a row costs
// one memory round trip instead of one per loop iteration. The sum of squares runs over each thread's groups in
// order, then block_sum: the order depends on `dim` only (elements past `dim` are zeros and add exactly nothing),
// never on how many rows share the launch or on alignment.
#pragma once
#include <type_traits>

#include "common.cuh"
#include "rmsnorm.cuh"

namespace ddtree::kernels {

#if defined(__CUDACC__)
// Rows of `dim` elements at base + r * ld can be read and written 16 bytes at a time.
inline bool rows_vectorizable(const void* base, int64_t ld, int dim) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && ld % kNormVec == 0 && dim % kNormVec == 0;
}

__device__ __forceinline__ int norm_group_start(int g) { return kNormVec * (g * kNormThreads + threadIdx.x); }

// Elements [e0, e0 + kNormVec) of `row` as floats, zeros past dim.
template <bool kVector>
__device__ __forceinline__ void load_group(float (&v)[kNormVec], const bf16* row, int e0, int dim) {
    if constexpr (kVector) {
        const uint4 u = *reinterpret_cast<const uint4*>(row + e0);
        const bf16* h = reinterpret_cast<const bf16*>(&u);
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) v[j] = __bfloat162float(h[j]);
    } else {
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) v[j] = e0 + j < dim ? __bfloat162float(row[e0 + j]) : 0.f;
    }
}

// Rounds v to bf16 and stores the elements of [e0, e0 + kNormVec) below dim.
template <bool kVector>
__device__ __forceinline__ void store_group(bf16* row, int e0, int dim, const float (&v)[kNormVec]) {
    if constexpr (kVector) {
        uint4 u;
        bf16* h = reinterpret_cast<bf16*>(&u);
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) h[j] = __float2bfloat16(v[j]);
        *reinterpret_cast<uint4*>(row + e0) = u;
    } else {
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) {
            if (e0 + j < dim) row[e0 + j] = __float2bfloat16(v[j]);
        }
    }
}

// The thread's groups of a row of `dim` elements, zeros past dim.
template <int G, bool kVector>
__device__ __forceinline__ void load_row(float (&v)[G][kNormVec], const bf16* row, int dim) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int e0 = norm_group_start(g);
        if (e0 < dim) {
            load_group<kVector>(v[g], row, e0, dim);
        } else {
#pragma unroll
            for (int j = 0; j < kNormVec; ++j) v[g][j] = 0.f;
        }
    }
}

// rsqrt(mean of squares + eps) of the row held in v, returned to every thread of the CTA.
template <int G>
__device__ __forceinline__ float row_rstd(const float (&v)[G][kNormVec], int dim, float eps) {
    float sq = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) sq += v[g][j] * v[g][j];
    }
    return rsqrtf(block_sum<kNormThreads>(sq) / static_cast<float>(dim) + eps);
}

// dst = bf16(v * rstd * w), fp32 math, for the held row and its held weights.
template <int G, bool kVector>
__device__ __forceinline__ void store_normed(bf16* dst, const float (&v)[G][kNormVec], float rstd,
                                             const float (&w)[G][kNormVec], int dim) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int e0 = norm_group_start(g);
        if (e0 >= dim) break;
        float y[kNormVec];
#pragma unroll
        for (int j = 0; j < kNormVec; ++j) y[j] = v[g][j] * rstd * w[g][j];
        store_group<kVector>(dst, e0, dim, y);
    }
}

// Calls launch(std::integral_constant<int, G>, std::bool_constant<vector>) with the fewest groups per thread that
// hold `dim` elements; cudaErrorInvalidValue past kNormMaxDim.
template <typename Launch>
cudaError_t dispatch_norm_row(int dim, bool vector, Launch&& launch) {
    const int groups = (dim + kNormThreads * kNormVec - 1) / (kNormThreads * kNormVec);
    auto with_groups = [&](auto vec) -> cudaError_t {
        if (groups <= 1) return launch(std::integral_constant<int, 1>{}, vec);
        if (groups <= 2) return launch(std::integral_constant<int, 2>{}, vec);
        if (groups <= 4) return launch(std::integral_constant<int, 4>{}, vec);
        if (groups <= kNormMaxGroups) return launch(std::integral_constant<int, kNormMaxGroups>{}, vec);
        return cudaErrorInvalidValue;
    };
    return vector ? with_groups(std::true_type{}) : with_groups(std::false_type{});
}
#endif

}  // namespace ddtree::kernels
