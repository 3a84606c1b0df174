// Between the tree kernels and the target: the verify forward's row tables filled from the built trees, and the
// tokens a round commits once the accept walk is done. Both run inside the round's CUDA graph.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "tree_layout.cuh"

namespace ddtree::kernels {

// The row tables of a verify forward, [streams * (N + 1)] each (row s * (N + 1) + i = node i of stream s). The
// forward reads node keys through key_nodes = the trees' ancestors [rows, L + 1].
struct VerifyRowTables {
    int32_t* ids;
    int32_t* positions;  // also the sampling positions
    int32_t* kv_start;
    int32_t* kv_len;
    int32_t* slots;
    int32_t* stream_ids;  // also the sampling streams
    int32_t* key_start;
};

// Node i of stream s (committed up to start[s], its rows from stream_base[s]): token, position start + depth,
// kv_len start + depth + 1, keys from position start through the ancestors, its own key at slot
// stream_base + start + i; stream_ids[row] = stream_ids_in[s]. Rows past node_count repeat the root's token at
// position start with contiguous keys: finite rows that nothing reads, writing only their own unused slots.
cudaError_t tree_verify_rows(const VerifyRowTables& rows, const TreeArrays& tree, const int32_t* start,
                             const int32_t* stream_base, const int32_t* stream_ids_in, const TreeShape& shape,
                             cudaStream_t stream);

// Each stream's committed tokens and whether it is finished, [streams] unless noted. `limits` is device memory,
// so one captured round serves every request: limits[0] = the tokens a stream generates at most, limits[1] = the
// number of stop ids (<= kRoundMaxStopIds), limits[2 ..] the stop ids.
constexpr int kRoundMaxStopIds = 64;
constexpr int kRoundLimitsInts = 2 + kRoundMaxStopIds;
struct RoundTokens {
    int32_t* history;     // [streams, history_ld]
    int32_t* accept_log;  // [streams, history_ld]: a per round
    int history_ld;
    int32_t* count;     // tokens so far
    int32_t* rounds;    // rounds that committed tokens
    int32_t* bonus;     // the next round's root
    int32_t* finished;  // set once count >= limits[0] or a stop id is among the first limits[0] tokens
    const int32_t* limits;
};

// After tree_accept: stream s commits the tokens of its accepted nodes below the root and the next bonus, a =
// accept_len[s] tokens, at history[s][count[s] ..], logs a at accept_log[s][rounds[s]] (columns past history_ld - 1
// of either are dropped), then count[s] += a, rounds[s] += 1, bonus[s] = next_bonus[s], and marks the stream
// finished as RoundTokens says. A stream that accepted nothing (a finished one) is left as it is.
cudaError_t commit_round_tokens(const RoundTokens& out, const int32_t* tree_tokens, const int32_t* accepted,
                                const int32_t* accept_len, const int32_t* next_bonus, const TreeShape& shape,
                                cudaStream_t stream);

}  // namespace ddtree::kernels
