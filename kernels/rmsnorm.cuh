// RMSNorm over bf16 rows, optionally fused with the residual add that precedes it.
// One CTA per row; the reduction order depends on `dim` only, so each row's result is
// independent of how many rows share the launch (batch invariance). dim: 1..kNormMaxDim (row_norm.cuh).
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * weight), fp32 math.
cudaError_t rmsnorm(bf16* out, const bf16* x, const bf16* weight, int rows, int dim, float eps,
                    cudaStream_t stream);

// rmsnorm over rows with strides (elements) for input and output, e.g. a slice of a fused projection.
cudaError_t rmsnorm_strided(bf16* out, int64_t out_ld, const bf16* x, int64_t x_ld, const bf16* weight, int rows,
                            int dim, float eps, cudaStream_t stream);

// residual[r] = bf16(residual[r] + delta[r] + delta2[r]) summed in fp32 (delta2 may be null); out[r] =
// rmsnorm(residual[r]). The norm reads the rounded residual, exactly as an unfused add followed by rmsnorm would.
cudaError_t add_rmsnorm(bf16* out, bf16* residual, const bf16* delta, const bf16* delta2, const bf16* weight,
                        int rows, int dim, float eps, cudaStream_t stream);

}  // namespace ddtree::kernels
