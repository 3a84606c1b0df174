// DDTree accept walk: one CTA per stream copies the stream's links, tokens and choices into shared memory in one
// coalesced pass, then one thread walks them there (a walk is a chain of dependent loads: shared-memory latency
// instead of a global round trip per step). Launched as a programmatic dependent, so its launch overlaps the
// previous kernel.
#include "tree_accept.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 128;

struct AcceptNode {
    int32_t token;
    int32_t next_sibling;
};

__global__ void __launch_bounds__(kThreads)
    tree_accept_kernel(TreeArrays tree, const int32_t* choice, const int32_t* finished, int32_t* accepted,
                       int32_t* accept_len, int32_t* next_bonus, TreeShape shape) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int rows = tree_rows(shape.budget);
    AcceptNode* node = reinterpret_cast<AcceptNode*>(smem);
    int32_t* first_child = reinterpret_cast<int32_t*>(node + rows);
    int32_t* chosen = first_child + rows;

    const int s = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
    const size_t row0 = static_cast<size_t>(s) * rows;
    dependent_kernel_start();  // the choices come from the sampler, the tree from the build
    const int count = tree.node_count[s];
    const int n = count < 0 ? 0 : count > shape.budget ? shape.budget : count;
    for (int i = tid; i <= n; i += kThreads) {
        node[i] = {tree.tokens[row0 + i], tree.next_sibling[row0 + i]};
        first_child[i] = tree.first_child[row0 + i];
        chosen[i] = choice[row0 + i];
    }
    __syncthreads();
    if (tid != 0) return;

    const int max_len = shape.depth_limit + 1;
    int32_t* path = accepted + static_cast<size_t>(s) * max_len;
    if (finished != nullptr && finished[s] != 0) {
        for (int j = 0; j < max_len; ++j) path[j] = kTreePad;
        accept_len[s] = 0;
        next_bonus[s] = node[0].token;
        return;
    }
    int len = 1, current = 0, steps_left = n;
    path[0] = 0;
    while (len < max_len) {
        const int wanted = chosen[current];
        int candidate = first_child[current], matched = -1;
        while (candidate >= 1 && candidate <= n && steps_left > 0) {
            --steps_left;
            const AcceptNode c = node[candidate];
            if (c.token == wanted) {
                matched = candidate;
                break;
            }
            candidate = c.next_sibling;
        }
        if (matched < 0) break;
        path[len++] = matched;
        current = matched;
    }
    for (int j = len; j < max_len; ++j) path[j] = kTreePad;
    accept_len[s] = len;
    next_bonus[s] = chosen[current];
}

}  // namespace

cudaError_t tree_accept(const TreeArrays& tree, const int32_t* choice, const int32_t* finished, int32_t* accepted,
                        int32_t* accept_len, int32_t* next_bonus, const TreeShape& shape, cudaStream_t stream) {
    if (!tree_shape_valid(shape)) return cudaErrorInvalidValue;
    if (shape.streams == 0) return cudaSuccess;
    const size_t smem = static_cast<size_t>(tree_rows(shape.budget)) * (sizeof(AcceptNode) + 2 * sizeof(int32_t));
    return launch_dependent(tree_accept_kernel, dim3(shape.streams), dim3(kThreads), smem, stream, tree, choice,
                            finished, accepted, accept_len, next_bonus, shape);
}

}  // namespace ddtree::kernels
