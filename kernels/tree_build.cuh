// DDTree build on the GPU: one CTA per stream turns the per-depth top-K draft candidates into the best-first tree
// of ddtree.reference.tree.build_tree, bit for bit: float64 path scores added in the reference's order, ties
// broken by the rank tuple, nodes numbered in pop order.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "tree_layout.cuh"

namespace ddtree::kernels {

// The drafter's candidates of every stream: log-probs fp32 [streams, L, width] (each depth sorted descending,
// finite, <= 0) and their token ids int32 [streams, L, width] (distinct within a depth); start (committed length)
// and bonus (root token) int32 [streams].
struct TreeCandidates {
    const float* log_probs;
    const int32_t* token_ids;
    int width;  // K, 1..kTreeMaxWidth; ranks below min(N, K) are used
    const int32_t* start;
    const int32_t* bonus;
};

// Writes every array of `tree` for shape.streams streams. No allocation, no host synchronisation: capturable.
// cudaErrorInvalidValue when the shape or width is out of range.
cudaError_t tree_build(const TreeCandidates& in, const TreeArrays& tree, const TreeShape& shape, cudaStream_t stream);

}  // namespace ddtree::kernels
