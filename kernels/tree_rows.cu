#include "tree_rows.cuh"

namespace ddtree::kernels {
namespace {

__global__ void tree_verify_rows_kernel(VerifyRowTables rows, TreeArrays tree, const int32_t* start,
                                        const int32_t* stream_base, const int32_t* stream_ids_in, int per_stream) {
    const int s = blockIdx.x;
    const int32_t first = start[s], base = stream_base[s], count = tree.node_count[s];
    for (int i = threadIdx.x; i < per_stream; i += blockDim.x) {
        const int64_t r = static_cast<int64_t>(s) * per_stream + i;
        const bool node = i <= count;
        const int32_t depth = node ? tree.depths[r] : 0;
        rows.ids[r] = tree.tokens[node ? r : static_cast<int64_t>(s) * per_stream];
        rows.positions[r] = first + depth;
        rows.kv_start[r] = base;
        rows.kv_len[r] = first + depth + 1;
        rows.slots[r] = base + first + i;
        rows.stream_ids[r] = stream_ids_in[s];
        rows.key_start[r] = node ? first : first + 1;
    }
}

__global__ void commit_round_tokens_kernel(RoundTokens out, const int32_t* tree_tokens, const int32_t* accepted,
                                           const int32_t* accept_len, const int32_t* next_bonus, int per_stream,
                                           int accepted_ld) {
    __shared__ int stopped;
    const int s = blockIdx.x;
    const int a = accept_len[s], at = out.count[s], max_tokens = out.limits[0];
    if (a <= 0) return;
    const int n_stops = min(max(out.limits[1], 0), kRoundMaxStopIds);
    if (threadIdx.x == 0) stopped = 0;
    __syncthreads();
    const int64_t row = static_cast<int64_t>(s) * out.history_ld;
    for (int j = threadIdx.x; j < a; j += blockDim.x) {
        // accepted[s][0] is the root (committed last round); the j-th new token is node accepted[s][j + 1]'s,
        // and the last is the next bonus.
        const int32_t token = j + 1 < a ? tree_tokens[static_cast<int64_t>(s) * per_stream +
                                                      accepted[static_cast<int64_t>(s) * accepted_ld + j + 1]]
                                        : next_bonus[s];
        if (at + j < out.history_ld) out.history[row + at + j] = token;
        if (at + j < max_tokens) {
            for (int i = 0; i < n_stops; ++i) {
                if (out.limits[2 + i] == token) stopped = 1;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int round = out.rounds[s];
        if (round < out.history_ld) out.accept_log[row + round] = a;
        out.rounds[s] = round + 1;
        out.count[s] = at + a;
        out.bonus[s] = next_bonus[s];
        if (stopped || at + a >= max_tokens) out.finished[s] = 1;
    }
}

}  // namespace

cudaError_t tree_verify_rows(const VerifyRowTables& rows, const TreeArrays& tree, const int32_t* start,
                             const int32_t* stream_base, const int32_t* stream_ids_in, const TreeShape& shape,
                             cudaStream_t stream) {
    if (!tree_shape_valid(shape)) return cudaErrorInvalidValue;
    if (shape.streams == 0) return cudaSuccess;
    tree_verify_rows_kernel<<<shape.streams, 256, 0, stream>>>(rows, tree, start, stream_base, stream_ids_in,
                                                                tree_rows(shape.budget));
    return cudaGetLastError();
}

cudaError_t commit_round_tokens(const RoundTokens& out, const int32_t* tree_tokens, const int32_t* accepted,
                                const int32_t* accept_len, const int32_t* next_bonus, const TreeShape& shape,
                                cudaStream_t stream) {
    if (!tree_shape_valid(shape) || out.history_ld < 1) return cudaErrorInvalidValue;
    if (shape.streams == 0) return cudaSuccess;
    commit_round_tokens_kernel<<<shape.streams, 32, 0, stream>>>(out, tree_tokens, accepted, accept_len, next_bonus,
                                                                 tree_rows(shape.budget), shape.depth_limit + 1);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
