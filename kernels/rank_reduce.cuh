// The arithmetic of the collectives across GPUs (runtime/collectives.h), once every rank's part is on this GPU:
// the rank-order sum of partial sums and the pick of a token from every rank's candidate. Both treat each row
// alone in a fixed order, so a row's result depends neither on the batch nor on how the parts were gathered.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "sample.cuh"

namespace ddtree::kernels {

// out[row, c] = sum over r = 0..ranks-1, then over t = 0..terms-1, of parts[(r * terms + t) * rows * width +
// row * width + c], in fp32 in that order, rounded once to bf16.
cudaError_t rank_order_sum(bf16* out, const bf16* parts, int ranks, int terms, int rows, int width,
                           cudaStream_t stream);

// tokens[row] = the id of the best of candidates[r * rows + row] over r = 0..ranks-1: the highest value, ties to
// the lower id; 0 when no rank has a value above -inf (as sample_tokens gives on one GPU).
cudaError_t pick_candidates(int32_t* tokens, const RankCandidate* candidates, int ranks, int rows,
                            cudaStream_t stream);

}  // namespace ddtree::kernels
