// RMSNorm kernels. Rows are independent; each CTA reduces one row with a fixed tree whose shape
// depends on `dim` and the block size only.
#include "rmsnorm.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 256;

template <bool kFuseResidual>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_kernel(bf16* __restrict__ out, int64_t out_ld, bf16* __restrict__ residual, const bf16* __restrict__ x,
                   int64_t x_ld, const bf16* __restrict__ x2, const bf16* __restrict__ weight, int dim, float eps) {
    allow_dependent_launch();  // a dependent GEMM next may start its weight prefetch during this kernel
    const size_t row = blockIdx.x;
    const bf16* xr = x + row * x_ld;
    const bf16* x2r = x2 != nullptr ? x2 + row * x_ld : nullptr;
    bf16* res = kFuseResidual ? residual + row * dim : nullptr;
    float sq = 0.f;
    for (int i = threadIdx.x; i < dim; i += kThreads) {
        float v = __bfloat162float(xr[i]);
        if constexpr (kFuseResidual) {
            float sum = __bfloat162float(res[i]) + v;
            if (x2r != nullptr) {
                sum += __bfloat162float(x2r[i]);
            }
            const bf16 summed = __float2bfloat16(sum);
            res[i] = summed;
            v = __bfloat162float(summed);
        }
        sq += v * v;
    }
    const float rstd = rsqrtf(block_sum<kThreads>(sq) / static_cast<float>(dim) + eps);
    const bf16* src = kFuseResidual ? res : xr;
    bf16* dst = out + row * out_ld;
    for (int i = threadIdx.x; i < dim; i += kThreads) {
        dst[i] = __float2bfloat16(__bfloat162float(src[i]) * rstd * __bfloat162float(weight[i]));
    }
}

}  // namespace

cudaError_t rmsnorm(bf16* out, const bf16* x, const bf16* weight, int rows, int dim, float eps,
                    cudaStream_t stream) {
    return rmsnorm_strided(out, dim, x, dim, weight, rows, dim, eps, stream);
}

cudaError_t rmsnorm_strided(bf16* out, int64_t out_ld, const bf16* x, int64_t x_ld, const bf16* weight, int rows,
                            int dim, float eps, cudaStream_t stream) {
    if (rows == 0) {
        return cudaSuccess;
    }
    rmsnorm_kernel<false><<<rows, kThreads, 0, stream>>>(out, out_ld, nullptr, x, x_ld, nullptr, weight, dim, eps);
    return cudaGetLastError();
}

cudaError_t add_rmsnorm(bf16* out, bf16* residual, const bf16* delta, const bf16* weight, int rows, int dim,
                        float eps, cudaStream_t stream) {
    return add2_rmsnorm(out, residual, delta, nullptr, weight, rows, dim, eps, stream);
}

cudaError_t add2_rmsnorm(bf16* out, bf16* residual, const bf16* delta, const bf16* delta2, const bf16* weight,
                         int rows, int dim, float eps, cudaStream_t stream) {
    if (rows == 0) {
        return cudaSuccess;
    }
    rmsnorm_kernel<true><<<rows, kThreads, 0, stream>>>(out, dim, residual, delta, dim, delta2, weight, dim, eps);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
