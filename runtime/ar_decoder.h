// Autoregressive generation on the target: the prompts prefilled in chunks of rows, the first tokens sampled on
// the device, then decode steps replayed from CUDA graphs (one per stream count and attention span) that advance
// the decode state (tokens, positions, cache slots, history) on the device, so no step waits on the host.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "device_arena.h"
#include "graph_cache.h"
#include "graph_replay.h"
#include "latent_cache.h"
#include "op_timeline.h"
#include "row_batch.h"
#include "target_model.h"

namespace ddtree {

// Token ids for timing n streams: distinct and spread over the vocabulary. One id for every stream would make
// the streams' hidden states, and so their expert choices, alike, and understate the routed experts' cost.
std::vector<int32_t> probe_ids(int n, int vocab);

// The one rule for how long a generation may be: every prompt + max_new_tokens within max_context, and at least
// one new token (std::invalid_argument naming max_new_tokens otherwise).
void check_generation_length(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, int max_context);

// The device state of decoding: one row per stream, whose logit rows are its stream rows (keyed by the live
// positions, which advance_decode moves between replays), and each stream's history of max_context tokens.
struct DecodeState {
    RowBatch rows;
    int32_t* history = nullptr;  // [streams][max_context]
    int32_t* step = nullptr;     // history column the next step writes
    static DecodeState lay_out(int streams, int max_context, DeviceArena& arena);
};

struct Generation {
    std::vector<std::vector<int32_t>> tokens;  // [prompts][max_new_tokens]
    double prefill_seconds = 0.0, decode_seconds = 0.0;  // device time (CUDA events) of the two phases
};

// What a prefill also hands on, chunk by chunk: the taps of `outputs` (its tap_rows must list rows 0 .. kPrefillRows
// - 1; n_tap_rows is set per chunk) for every prompt row, then consume(rows) with the chunk's (stream, position)
// rows in tap order. The DDTree round appends them to the drafter's context.
struct PrefillTaps {
    ForwardOutputs outputs;
    std::function<void(const std::vector<std::pair<int, int>>& rows)> consume;
};

class ArDecoder {
  public:
    static constexpr int kPrefillRows = 64;  // rows per prefill forward (one GEMM token block)

    // eager_rows: the batch prefill forwards use (at least kPrefillRows rows).
    ArDecoder(TargetModel& model, const LatentCache& cache, const RowBatch& eager_rows, const DecodeState& state);

    // Prefills prompts[i] into stream i from position 0 and samples each stream's first new token; returns them.
    std::vector<int32_t> prefill(const std::vector<std::vector<int32_t>>& prompts, float temperature, uint64_t seed);
    // Prefill, then max_new_tokens - 1 replayed decode steps. The first tokens stay on the device between the two.
    Generation generate(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
                        uint64_t seed);

    // Prefills the prompts (checked) and leaves each stream's first token in column 0 of the device history, whose
    // rows are history_ld() apart (the DDTree round starts from there).
    const int32_t* prefill_first_tokens(const std::vector<std::vector<int32_t>>& prompts, float temperature,
                                        uint64_t seed, const PrefillTaps* taps = nullptr) {
        prefill_to_history(prompts, temperature, seed, taps);
        return state_.history;
    }
    int history_ld() const { return cache_.max_context(); }

    // Benchmark support: replays the decode graph of n streams at `positions` `iters` times; returns {device
    // seconds per step, host seconds per graph launch}.
    std::pair<double, double> time_decode(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                                          uint64_t seed);
    // Device time per operation of one eager decode step of n streams at `positions`.
    StepProfile profile_step(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                             uint64_t seed);

    // The captured decode graphs, named "ar streams=N span=S".
    std::vector<CapturedGraph> graphs() const;
    // Device seconds of each of n replays of the decode graph called `name` (see time_replays); false when no
    // captured graph has that name. Every replay starts from one state: each stream's row at the last position the
    // graph's attention span holds (a distinct probe token each), at the last generation's sampling settings. The
    // decode rows and the step column are left at that state; the next generate or prefill sets them anew.
    bool replay(const std::string& name, int n, bool warmup, std::vector<double>* seconds);

  private:
    // Prefills the prompts (checked) and writes each stream's first token into history column 0 on the device.
    void prefill_to_history(const std::vector<std::vector<int32_t>>& prompts, float temperature, uint64_t seed,
                            const PrefillTaps* taps = nullptr);
    // Decode rows of streams 0..n-1 at `positions`, their ids from `ids`, or from history column 0 when null; the
    // next step writes history column `step`.
    void set_decode_state(const std::vector<int32_t>& positions, const std::vector<int32_t>* ids, int32_t step);
    cudaGraphExec_t decode_graph(int n, int span);

    TargetModel& model_;
    const LatentCache& cache_;
    RowBatch eager_rows_;
    DecodeState state_;
    GraphCache<std::pair<int, int>> graphs_;  // (streams, attention span)
};

}  // namespace ddtree
