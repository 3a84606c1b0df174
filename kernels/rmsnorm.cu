// RMSNorm kernels: one CTA per row, the row held in registers (row_norm.cuh), so a row costs one read and one
// write of each array. Rows are independent; the reduction order depends on `dim` only.
#include "rmsnorm.cuh"

#include "row_norm.cuh"

namespace ddtree::kernels {
namespace {

struct NormArgs {
    bf16* out;
    int64_t out_ld;
    bf16* residual;  // [rows, dim], updated in place when the residual add is fused
    const bf16* x;
    int64_t x_ld;
    const bf16* x2;  // optional second delta of the fused add
    const bf16* weight;
    int rows, dim;
    float eps;
};

template <int G, bool kVector, bool kFuseResidual>
__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(const NormArgs a) {
    dependent_kernel_start();
    const int64_t row = blockIdx.x;
    const bf16* xr = a.x + row * a.x_ld;
    // Every load is issued before any store: a store to the residual could alias the next group's loads, and the
    // compiler would otherwise wait out one memory round trip per group.
    float v[G][kNormVec];
    load_row<G, kVector>(v, xr, a.dim);
    if constexpr (kFuseResidual) {
        // residual + delta (+ delta2) in fp32, rounded once; the norm reads the rounded sum.
        bf16* res = a.residual + row * a.dim;
        float r[G][kNormVec], v2[G][kNormVec];
        load_row<G, kVector>(r, res, a.dim);
        if (a.x2 != nullptr) load_row<G, kVector>(v2, a.x2 + row * a.x_ld, a.dim);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int j = 0; j < kNormVec; ++j) {
                float sum = r[g][j] + v[g][j];
                if (a.x2 != nullptr) sum += v2[g][j];
                v[g][j] = __bfloat162float(__float2bfloat16(sum));
            }
            const int e0 = norm_group_start(g);
            if (e0 < a.dim) store_group<kVector>(res, e0, a.dim, v[g]);
        }
    }
    float w[G][kNormVec];  // in flight during the reduction
    load_row<G, kVector>(w, a.weight, a.dim);
    const float rstd = row_rstd<G>(v, a.dim, a.eps);
    store_normed<G, kVector>(a.out + row * a.out_ld, v, rstd, w, a.dim);
}

template <bool kFuseResidual>
cudaError_t launch_norm(const NormArgs& a, cudaStream_t stream) {
    if (a.rows < 0 || !norm_dim_supported(a.dim)) {
        return cudaErrorInvalidValue;
    }
    if (a.rows == 0) {
        return cudaSuccess;
    }
    bool vector = rows_vectorizable(a.out, a.out_ld, a.dim) && rows_vectorizable(a.x, a.x_ld, a.dim) &&
                  rows_vectorizable(a.weight, 0, a.dim);
    if constexpr (kFuseResidual) {
        vector = vector && rows_vectorizable(a.residual, a.dim, a.dim) &&
                 (a.x2 == nullptr || rows_vectorizable(a.x2, a.x_ld, a.dim));
    }
    return dispatch_norm_row(a.dim, vector, [&](auto groups, auto vec) {
        return launch_dependent(rmsnorm_kernel<decltype(groups)::value, decltype(vec)::value, kFuseResidual>,
                                dim3(a.rows), dim3(kNormThreads), 0, stream, a);
    });
}

}  // namespace

cudaError_t rmsnorm(bf16* out, const bf16* x, const bf16* weight, int rows, int dim, float eps,
                    cudaStream_t stream) {
    return rmsnorm_strided(out, dim, x, dim, weight, rows, dim, eps, stream);
}

cudaError_t rmsnorm_strided(bf16* out, int64_t out_ld, const bf16* x, int64_t x_ld, const bf16* weight, int rows,
                            int dim, float eps, cudaStream_t stream) {
    return launch_norm<false>({out, out_ld, nullptr, x, x_ld, nullptr, weight, rows, dim, eps}, stream);
}

cudaError_t add_rmsnorm(bf16* out, bf16* residual, const bf16* delta, const bf16* delta2, const bf16* weight,
                        int rows, int dim, float eps, cudaStream_t stream) {
    return launch_norm<true>({out, dim, residual, delta, dim, delta2, weight, rows, dim, eps}, stream);
}

}  // namespace ddtree::kernels
