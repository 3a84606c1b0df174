// Per-row top-k of log-softmax(logits) at temperature 1: the drafter's per-depth candidates for the tree build.
//
// log_probs[r, j] = (x - max) - log(sum exp(x - max)) over row r's logits x, fp32, sorted descending, ties to
// the lower token id, with ids[r, j] the token ids. NaN logits rank as -inf. A row's result depends on that row
// alone (one cluster of CTAs per row, a reduction order fixed by the vocabulary), so it never changes with the
// rows beside it. One launch, no workspace.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

constexpr int kTopkMax = 1024;  // the largest k: the largest tree budget
// The largest vocabulary: a row is staged in the shared memory of its cluster of 8 CTAs (4 bytes a token).
constexpr int kTopkVocabMax = 384 * 1024;

// logits: [rows, vocab] with row stride ld (floats); log_probs, ids: [rows, k]; 1 <= k <= min(vocab, kTopkMax),
// vocab <= kTopkVocabMax, rows <= INT_MAX / 8. Each row needs at least one finite logit.
cudaError_t topk_log_softmax(float* log_probs, int32_t* ids, const float* logits, int64_t ld, int rows, int vocab,
                             int k, cudaStream_t stream);

}  // namespace ddtree::kernels
