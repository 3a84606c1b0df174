// DDTree commit on the GPU, as ddtree.reference.tree.commit_rows and next_context: move the accepted nodes' latent
// KV rows of every layer to the end of the committed prefix, gather their tapped hidden rows as the drafter's next
// context, and advance each stream's committed length. Two launches for all streams and layers.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "tree_layout.cuh"

namespace ddtree::kernels {

// One allocation of `layers` contiguous layer blocks of `cache_rows` rows of `row_elems` bf16 (K2: 576 = 512 + 64).
// Rows start on 16-byte boundaries: rows 16-byte aligned and row_elems a multiple of 8.
struct LatentCache {
    bf16* rows;
    int layers;
    int cache_rows;
    int row_elems;
};

constexpr int kCommitChunkElems = 8;             // one 16-byte copy of bf16
constexpr int kCommitMaxStagedBytes = 48 * 1024;  // shared memory for the moved rows of one (layer, stream)

// Whether a commit of up to L + 1 rows of `row_elems` fits the launch (the moved rows are staged in shared memory:
// up to 1536 elements a row at L = 15) and rows of that width keep 16-byte alignment.
constexpr bool commit_rows_supported(int row_elems, int depth_limit) {
    return row_elems > 0 && row_elems % kCommitChunkElems == 0 &&
           static_cast<long long>(depth_limit + 1) * row_elems * 2 <= kCommitMaxStagedBytes;
}

// The verify forward's tapped hidden rows bf16 [streams * (N + 1), width] (stream s node i at row s * (N + 1) + i)
// and the drafter-context buffer bf16 [streams, L + 1, width] that receives the accepted ones; rows j >=
// accept_len are left as they are. taps == nullptr: no gather. 16-byte aligned, width a multiple of 8.
struct TapGather {
    const bf16* taps;
    bf16* context;
    int width;
};

// For every layer and stream s, with a = accept_len[s] and base = stream_base[s] + start[s]: cache row
// base + accepted[s][j] -> base + j for j < a, all rows read before any is written; rows already in place are not
// copied, so a contiguous path copies nothing. Then start[s] += a. accepted / accept_len as tree_accept writes
// them; rows outside 0..cache_rows - 1 are never touched. cudaErrorInvalidValue on a bad shape or alignment.
cudaError_t tree_commit(const LatentCache& cache, const TapGather& taps, const int32_t* stream_base, int32_t* start,
                        const int32_t* accepted, const int32_t* accept_len, const TreeShape& shape,
                        cudaStream_t stream);

}  // namespace ddtree::kernels
