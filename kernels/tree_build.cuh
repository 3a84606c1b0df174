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

// The budget probe: the expected accepted mass the best-first tree would reach at each of a few budgets, under the
// drafter's own probabilities: for budget b, 1 + the sum of exp(path score) of the first b nodes the build pops
// (the same pops, in the same order, as tree_build at budget shape.budget = the largest probe budget; a tree of a
// smaller budget is the prefix of those pops). Budgets past the nodes the candidates allow get the whole sum.
constexpr int kProbeMaxBudgets = 8;
struct ProbeBudgets {
    int count;                        // 1..kProbeMaxBudgets
    int budgets[kProbeMaxBudgets];    // ascending, 1..shape.budget; the last one is shape.budget
};

// masses fp32 [shape.streams, budgets.count]. Reads in.log_probs alone (the token ids, start and bonus may be
// null). Capturable; cudaErrorInvalidValue when the shape, width or budgets are out of range.
cudaError_t tree_probe(const TreeCandidates& in, const ProbeBudgets& budgets, float* masses, const TreeShape& shape,
                       cudaStream_t stream);

}  // namespace ddtree::kernels
