// The fixed layout of one launch's draft trees, shared by the tree build, accept and commit kernels and by the
// verify forward that reads them. A launch holds `streams` trees of at most `budget` (N) nodes below the root;
// every per-node array has exactly N + 1 rows per stream (row 0 = the root = the bonus token), so the verify batch
// has a shape fixed by (streams, N) and a CUDA graph can be captured once per bucket. Rows past a stream's node
// count hold kTreePad (visibility rows: zero words).
#pragma once
#include <cstdint>

namespace ddtree::kernels {

constexpr int kTreeMaxBudget = 1024;  // nodes below the root
constexpr int kTreeMaxDepth = 15;     // L = the drafter's block size - 1
constexpr int kTreeMaxWidth = 1024;   // top-K width K of the per-depth candidates
constexpr int32_t kTreePad = -1;

struct TreeShape {
    int streams;
    int budget;       // N: rows per stream = N + 1
    int depth_limit;  // L: accepted paths hold at most L + 1 nodes, ancestors rows L + 1 entries
};

constexpr int tree_rows(int budget) { return budget + 1; }

// uint32 words per visibility row: node j is visible to node i when bit j % 32 of word j / 32 of row i is set.
constexpr int tree_visibility_words(int budget) { return (tree_rows(budget) + 31) / 32; }

constexpr bool tree_shape_valid(const TreeShape& s) {
    return s.streams >= 0 && s.budget >= 0 && s.budget <= kTreeMaxBudget && s.depth_limit >= 1 &&
           s.depth_limit <= kTreeMaxDepth;
}

// The tree of every stream, [streams, N + 1] per-node arrays unless noted.
struct TreeArrays {
    int32_t* tokens;        // row 0 = the bonus token
    int32_t* parents;       // -1 for the root; parents[i] < i
    int32_t* depths;        // 0 for the root
    int32_t* first_child;   // lowest-indexed child, -1 when none
    int32_t* next_sibling;  // next child of the same parent in ascending index, -1 when none
    uint32_t* visibility;   // [streams, N + 1, tree_visibility_words(N)]: ancestor-or-self bit rows
    int32_t* positions;     // start + depth
    int32_t* ancestors;     // [streams, N + 1, L + 1]: node index of the ancestor at depth j (j <= depth), else -1
    int32_t* node_count;    // [streams]: nodes below the root
};

}  // namespace ddtree::kernels
