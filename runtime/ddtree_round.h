// The DDTree round on the GPU: draft candidates -> tree build -> verify rows -> verify forward -> the target's choice
// at every node (greedy, or Gumbel-max keyed by stream and position as in autoregressive decoding) -> accept walk
// -> commit (latent KV rows, committed length) -> the round's tokens into each stream's history. One CUDA graph
// per (streams, budget, attention span), replayed; the round state lives on the device, and the host only reads
// each stream's token count asynchronously to decide when to stop.
//
// The candidates come from the oracle (oracle_draft.cuh: tests and benchmarks only) until the GPU drafter joins
// the round.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "ar_decoder.h"
#include "device_arena.h"
#include "graph_cache.h"
#include "latent_cache.h"
#include "oracle_draft.cuh"
#include "row_batch.h"
#include "target_model.h"
#include "tree_layout.cuh"

namespace ddtree {

// What generate_ddtree returns per stream: max_new_tokens tokens (the prefill's first), and each round's accept
// length (nodes accepted, the root counted: the round committed that many tokens).
struct TreeGeneration {
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<int32_t>> accept_lengths;
    int rounds = 0;
    double prefill_seconds = 0.0, decode_seconds = 0.0;
};

// The oracle's continuation and profile (see oracle_draft.cuh), host side.
struct OracleRequest {
    std::vector<std::vector<int32_t>> reference;  // [streams][tokens after the prompt]
    std::vector<float> hit;                       // [depth limit]
    uint64_t seed = 0;
};

class DdtreeRound {
  public:
    // Device state for `streams` streams and trees of up to `budget` nodes below the root (any depth limit up to
    // kTreeMaxDepth), from `arena` (a counting arena only counts it).
    struct State {
        int32_t *start, *bonus, *count, *stream_base, *stream_ids;
        kernels::TreeArrays tree;
        float* log_probs;
        int32_t* token_ids;
        int32_t *accepted, *accept_len, *next_bonus;
        int32_t* history;  // [streams][history_ld]
        int32_t *reference, *accept_log;  // oracle continuation [streams][history_ld]; accept lengths [streams][history_ld]
        float* oracle_scalars;  // the hit profile [kTreeMaxDepth], then the oracle's seed and continuation length
        RowBatch rows;
        int history_ld;
        static State lay_out(int streams, int budget, int history_ld, DeviceArena& arena);
    };
    static constexpr int kOracleSeedAt = 16, kOracleLengthAt = 18, kOracleScalars = 20;  // float offsets

    DdtreeRound(TargetModel& model, const LatentCache& cache, ArDecoder& decoder, int max_budget, const State& state);

    // Prefill, then rounds of trees of `budget` nodes (<= the engine's) and depth <= depth_limit until every stream
    // has max_new_tokens tokens, with oracle candidates (`width` per depth, 1..budget).
    TreeGeneration generate_oracle(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens,
                                   float temperature, uint64_t seed, const OracleRequest& oracle, int budget,
                                   int depth_limit, int width);

  private:
    struct RoundKey {
        int streams, budget, depth_limit, width, span;
        bool operator<(const RoundKey& o) const {
            return std::tie(streams, budget, depth_limit, width, span) <
                   std::tie(o.streams, o.budget, o.depth_limit, o.width, o.span);
        }
    };
    void record_round(const RoundKey& key, const kernels::OracleDraft& oracle);

    TargetModel& model_;
    const LatentCache& cache_;
    ArDecoder& decoder_;
    int max_budget_;
    State state_;
    GraphCache<RoundKey> graphs_;
};

}  // namespace ddtree
