// The DDTree round on the GPU: drafter block forward -> per-depth top-K -> tree build -> verify rows -> verify
// forward with the drafter's taps -> the target's choice at every node (greedy, or Gumbel-max keyed by stream and
// position as in autoregressive decoding) -> accept walk -> commit (latent KV rows, the accepted taps as the
// drafter's next context, committed length) -> the round's tokens into each stream's history -> the drafter's
// context append. One CUDA graph per (streams, budget, spans), replayed; the round state lives on the device.
//
// Streams that finish (their token count, or a stop id) are frozen by the round itself (they accept nothing), and
// the host, reading each round's finished flags asynchronously one round behind, moves the live streams to the
// front slots and switches to the graph of fewer streams, so finished streams' rows cost nothing afterwards.
//
// Candidates come from the drafter, or from the oracle (oracle_draft.cuh: tests and benchmarks only), which
// replaces the drafter's top-K after its forward has run (or stands alone in an engine without a drafter).
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ar_decoder.h"
#include "budget_policy.h"
#include "device_arena.h"
#include "drafter_model.h"
#include "forked_stream.h"
#include "graph_cache.h"
#include "graph_replay.h"
#include "latent_cache.h"
#include "oracle_draft.cuh"
#include "row_batch.h"
#include "target_model.h"
#include "tree_build.cuh"
#include "tree_layout.cuh"

namespace ddtree {

// What a DDTree generation returns per stream: its tokens (at most max_new_tokens: fewer when it committed a stop
// id, which is then among them, possibly followed by the rest of that round's tokens), each round's accept length
// (nodes accepted, the root counted: the round committed that many tokens).
struct TreeGeneration {
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<int32_t>> accept_lengths;
    int rounds = 0;  // rounds launched (every stream's rounds, and up to two more that changed nothing)
    double prefill_seconds = 0.0, decode_seconds = 0.0;
    double host_seconds_per_round = 0.0;  // host time of a replayed round's launch and copies
    std::vector<int32_t> budgets;  // the budget of each launched round (stream i's round j ran at budgets[j])
    CostTable costs;               // with auto budgets: the round times the policy chose by
    std::vector<std::pair<std::string, double>> stages;  // device seconds per stage summed over rounds (profile)
};

// The oracle's continuation and profile (see oracle_draft.cuh), host side.
struct OracleRequest {
    std::vector<std::vector<int32_t>> reference;  // [streams][tokens after the prompt]
    std::vector<float> hit;                       // [depth limit]
    uint64_t seed = 0;
};

struct RoundRequest {
    std::vector<std::vector<int32_t>> prompts;
    int max_new_tokens = 0;
    float temperature = 0.f;
    uint64_t seed = 0;
    int budget = 0;                  // nodes below the root, 1..the engine's (ignored with auto_budgets)
    // Auto budgets (BudgetPolicy): each round's budget among these candidates (ascending, 1..the engine's, at most
    // kernels::kProbeMaxBudgets), from the round's probe and the round times of `costs`; with no costs given
    // (costs.streams empty), each (stream count, candidate) round graph is timed once by replays before the first
    // generation that needs it.
    std::vector<int> auto_budgets;
    CostTable costs;
    std::vector<int32_t> stop_ids;   // at most kernels::kRoundMaxStopIds
    const OracleRequest* oracle = nullptr;
    // Without a drafter (oracle only): the tree depth limit and the oracle's candidates per depth. With one the
    // depth limit is the drafter's block - 1, and width (candidates per depth) 0 means min(budget, vocab); width 1
    // with budget block - 1 verifies DFlash's own chain of top-1 tokens.
    int depth_limit = 0, width = 0;
    bool profile = false;  // eager rounds, each stage timed (TreeGeneration::stages)

    // Rounds choose their budgets: auto budgets, and a round to choose for (a single new token is the prefill's).
    bool chooses_budgets() const { return !auto_budgets.empty() && max_new_tokens > 1; }
    // ... by round times measured on the engine, none being given.
    bool measures_costs() const { return chooses_budgets() && costs.streams.empty(); }
};

// The drafter of an engine's rounds and the target layers whose residuals are its context.
struct RoundDrafter {
    DrafterModel* model = nullptr;
    std::vector<int> tap_layers;
};

class DdtreeRound {
  public:
    // Device state for `streams` streams and trees of up to `budget` nodes below the root (any depth limit up to
    // kTreeMaxDepth), from `arena` (a counting arena only counts it). draft_block / tap_width: the drafter's block
    // size and context width (0 without a drafter).
    struct State {
        int32_t *start, *bonus, *count, *rounds, *stream_base, *stream_ids, *finished, *limits, *keep;
        kernels::TreeArrays tree;
        float* log_probs;
        int32_t* token_ids;
        int32_t *accepted, *accept_len, *next_bonus;
        float* probe;  // [streams][kernels::kProbeMaxBudgets]: the budget probe's masses (auto budgets)
        int32_t *history, *accept_log, *reference;  // [streams][history_ld]: tokens, accept lengths, oracle
        float* oracle_scalars;  // the hit profile [kTreeMaxDepth], then the oracle's seed and continuation length
        RowBatch rows;
        // The drafter's side: verify taps [tap_rows][tap_width], the accepted ones [streams][L + 1][tap_width],
        // row indices 0.. for the taps, block ids / positions / head rows, append positions / slots.
        kernels::bf16 *taps, *context;
        int32_t *tap_index, *block_ids, *block_positions, *head_rows, *append_positions, *append_slots;
        int history_ld, tap_rows, max_append;
        static State lay_out(int streams, int budget, int history_ld, int draft_block, int tap_width,
                             DeviceArena& arena);
    };
    static constexpr int kOracleSeedAt = 16, kOracleLengthAt = 18, kOracleScalars = 20;  // float offsets

    // Context rows a drafter of block size `block` takes per append in a round of `streams` streams.
    static int max_append_rows(int streams, int block);

    DdtreeRound(TargetModel& model, const LatentCache& cache, ArDecoder& decoder, int max_budget, const State& state,
                RoundDrafter drafter);
    ~DdtreeRound();
    DdtreeRound(const DdtreeRound&) = delete;
    DdtreeRound& operator=(const DdtreeRound&) = delete;

    bool has_drafter() const { return drafter_.model != nullptr; }

    // Prefill (its taps appended to the drafter's context), then rounds until every stream has max_new_tokens
    // tokens or has committed a stop id.
    TreeGeneration generate(const RoundRequest& request);
    // The auto budgets' round times generate(request) would choose by when given none (measured as it would:
    // replays from the request's prefill, once per key). Engines holding the ranks of one model agree on one table
    // from these (multi_gpu_engine.h) and hand it to generate, so that every rank chooses the same budgets.
    CostTable round_costs(const RoundRequest& request);

    // The captured round graphs, named "round streams=N budget=B depth=D width=W span=S draft_span=T", with
    // " oracle" after it when the oracle's candidates replace (or stand for) the drafter's.
    std::vector<CapturedGraph> graphs() const;
    // Device seconds of each of n replays of the round graph called `name` (see time_replays); false when no
    // captured graph has that name. Every replay starts from one state: each of the graph's streams live, one token
    // committed, at the longest context its attention spans hold (a distinct probe token as the root), with the
    // cache contents, the oracle's continuation and the sampling settings the last generation left. A replay
    // advances that state as a round does (cache rows past the context, the drafter's context, tokens and accept
    // lengths); the next generate starts every stream anew from its prefill, so none of it carries over.
    bool replay(const std::string& name, int n, bool warmup, std::vector<double>* seconds);

  private:
    using ProbeList = std::array<int, kernels::kProbeMaxBudgets>;  // the probe's budgets, zero-padded; all 0: none
    struct RoundKey {
        int streams, budget, depth_limit, width, span, draft_span;
        bool oracle;
        ProbeList probe;
        bool operator<(const RoundKey& o) const {
            return std::tie(streams, budget, depth_limit, width, span, draft_span, oracle, probe) <
                   std::tie(o.streams, o.budget, o.depth_limit, o.width, o.span, o.draft_span, o.oracle, o.probe);
        }
    };
    static std::string graph_name(const RoundKey& key);
    void check(const RoundRequest& request, int budget, int depth_limit, int width) const;
    // The request's checked round key at its largest budget (the auto budgets' largest, or its budget).
    RoundKey request_key(const RoundRequest& request) const;
    // The round's per-stream state for the request (prefill included) on the device.
    void start_streams(const RoundRequest& request);
    void record_round(const RoundKey& key, OpTimeline* timeline);
    // Moves the live slots `keep` (ascending) to the front of every per-slot array.
    void compact(const std::vector<int>& keep);
    // Copies slot `slot`'s history, accept log, count and rounds to stream `stream`'s pinned output.
    void save_slot(int slot, int stream);
    // Device seconds of a replay of `key`'s graph (captured if needed), from replay's starting state: the median of
    // 3 after a warm-up.
    double time_round(const RoundKey& key);
    // replay() of a known key and graph.
    void replay_key(const RoundKey& key, cudaGraphExec_t exec, int n, bool warmup, std::vector<double>* seconds);
    // The auto budgets' cost table for the request's keys: measured round times (each timed once per key, kept in
    // costs_ across generations; the replays start from the request's prefill, made here only when a key is not
    // timed yet, and the caller then prefills anew).
    CostTable measure_costs(const RoundRequest& request, const RoundKey& base);

    TargetModel& model_;
    const LatentCache& cache_;
    ArDecoder& decoder_;
    int max_budget_;
    State state_;
    RoundDrafter drafter_;
    kernels::OracleDraft oracle_;  // reads the request's continuation and profile from state_
    GraphCache<RoundKey> graphs_;
    SideStream probe_stream_;  // the auto budgets' probe, beside the verify (record_round)
    std::map<RoundKey, double> costs_;  // measured seconds per round graph key (auto budgets)
    // [streams][2 * history_ld + 2] outputs, then [2][streams] finished flags, [2][streams] accept lengths and
    // [2][streams][kProbeMaxBudgets] probe masses (floats)
    int32_t* pinned_ = nullptr;
};

}  // namespace ddtree
