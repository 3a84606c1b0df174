// The drafter's row tables inside a DDTree round, filled on the device from the round state so that the round's
// CUDA graph never waits on the host: the block forward's rows [bonus, MASK x (B - 1)] at the committed length,
// and the context append of the rows a round accepted.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// Block row s * block + j of launch stream s: id bonus[s] (j = 0) or mask_token, position start[s] + j.
cudaError_t draft_block_rows(int32_t* ids, int32_t* positions, const int32_t* bonus, const int32_t* start,
                             int streams, int block, int32_t mask_token, cudaStream_t stream);

// Append row s * per_stream + j of launch stream s, after a commit that advanced start[s] by a = accept_len[s]:
// position start[s] - a + j and draft-cache slot cache_stream * capacity + position % capacity (cache_stream =
// stream_ids[s]) for j < a; slot -1 (not stored) for the padding rows j >= a.
cudaError_t draft_append_rows(int32_t* positions, int32_t* slots, const int32_t* start, const int32_t* accept_len,
                              const int32_t* stream_ids, int streams, int per_stream, int capacity,
                              cudaStream_t stream);

}  // namespace ddtree::kernels
