// DDTree accept walk on the GPU, as ddtree.reference.tree.accept_walk: from the root, follow the child whose token
// equals the target's choice at the current node; the first miss ends the walk and the choice there is the next
// bonus token.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "tree_layout.cuh"

namespace ddtree::kernels {

// The walk reads tree.tokens, first_child, next_sibling and node_count of every stream, whatever wrote them:
// node_count is clamped to 0..N, links outside 1..node_count count as absent and at most node_count links are
// followed in all, so cyclic, self-looping or out-of-range links end the walk and never leave the buffers.
// choice int32 [streams, N + 1] is the target's token at every node. Writes accepted int32 [streams, L + 1]
// (node indices root first, -1 past the end), accept_len int32 [streams] (>= 1, the root counted) and next_bonus
// int32 [streams]. A walk stops at L + 1 nodes (on a malformed tree; a built one is never deeper than L).
// A stream whose `finished` flag is set (finished may be null: none is) accepts nothing: accept_len 0, so the
// commit moves nothing and the stream's state stays as it was (a round of a finished stream changes nothing).
cudaError_t tree_accept(const TreeArrays& tree, const int32_t* choice, const int32_t* finished, int32_t* accepted,
                        int32_t* accept_len, int32_t* next_bonus, const TreeShape& shape, cudaStream_t stream);

}  // namespace ddtree::kernels
