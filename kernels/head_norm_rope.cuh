// Per-head RMSNorm and rotate-half RoPE of projection rows, stored to destination rows picked per source row: the
// DFlash drafter's q_norm + RoPE of its queries, k_norm + RoPE of its keys into the draft cache's slots, and (with
// neither) the plain copy of its values there. Each (row, head) is one warp's: its reduction order depends on
// head_dim only, so a row's result never depends on the other rows of the launch.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "rope.cuh"

namespace ddtree::kernels {

constexpr int kHeadNormRopeMaxDim = 256;

inline bool head_norm_rope_supported(int head_dim) {
    return head_dim > 0 && head_dim % 2 == 0 && head_dim <= kHeadNormRopeMaxDim;
}

// For row r < rows and head h < heads: y = x[r * x_ld + h * head_dim + (0 .. head_dim)];
// with norm_weight, y = norm_weight * y / sqrt(mean(y^2) + eps) (fp32); with rope.inv_freq, y is rotated at
// positions[r] over the whole head (pairs (i, i + head_dim / 2), cos and sin times rope.attention_factor;
// rope.rope_dim must be head_dim and rope.interleave false). The bf16 result goes to
// out[dst * out_ld + h * head_dim + ...], dst = out_rows[r] (or r when out_rows is null); a row whose dst is
// negative is not stored (the padding rows of a fixed-size append).
cudaError_t head_norm_rope(bf16* out, int64_t out_ld, const int32_t* out_rows, const bf16* x, int64_t x_ld, int rows,
                           int heads, int head_dim, const bf16* norm_weight, float eps, const int32_t* positions,
                           const RopeParams& rope, cudaStream_t stream);

}  // namespace ddtree::kernels
