// Draft candidates from an oracle, for benchmarks and tests only (never a drafter's output): random-weight drafters
// accept almost nothing, so speed and correctness at controlled acceptance are measured with candidates that hold
// the target's own continuation at a rank drawn per depth.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "tree_layout.cuh"

namespace ddtree::kernels {

// The continuation of stream s is reference[s][0 .. reference_len - 1]: the target's tokens after the prompt (column
// 0 = the prefill's token). A round whose root is column count[s] - 1 wants column count[s] - 1 + d at depth d.
// Drawn by a hash of (seed, stream, count, depth): with probability hit[d - 1] that token is the rank-0 candidate
// (so the chain of rank-0 candidates accepts about sum of prod hit tokens), with half the rest at a rank in
// 1..min(width, 4) - 1 (a side branch, when width > 1), else it is no candidate. The other ranks hold
// (token + 1 + rank) % vocab, distinct. Log-probs are -0.1 - 0.5 * rank. log_probs, token_ids: [streams, L, width];
// width < vocab.
// Every field that changes between calls is read from device memory, so a captured round serves them all.
struct OracleDraft {
    const int32_t* reference;      // [streams][reference_ld]
    int reference_ld;
    const int32_t* reference_len;  // [1]
    const float* hit;              // [L]
    const unsigned long long* seed;  // [1]
    int vocab;
};

cudaError_t oracle_draft(float* log_probs, int32_t* token_ids, int width, const int32_t* count,
                         const OracleDraft& oracle, const TreeShape& shape, cudaStream_t stream);

}  // namespace ddtree::kernels
