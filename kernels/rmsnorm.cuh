// RMSNorm over bf16 rows, optionally fused with the residual add that precedes it.
// One CTA per row; the reduction order depends on `dim` only, so each row's result is
// independent of how many rows share the launch (batch invariance). dim: 1..kNormMaxDim.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// A row is held in registers by one CTA (row_norm.cuh): kNormThreads threads, each up to kNormMaxGroups groups of
// kNormVec elements. The latent KV store (rope.cuh) uses the same rows.
constexpr int kNormThreads = 256;
constexpr int kNormVec = 8;
constexpr int kNormMaxGroups = 8;
constexpr int kNormMaxDim = kNormThreads * kNormVec * kNormMaxGroups;  // 16384

// Whether the norm kernels take rows of `dim` elements.
inline bool norm_dim_supported(int64_t dim) { return dim > 0 && dim <= kNormMaxDim; }

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
