// One GPU's engine: the target model, its latent KV cache, the autoregressive decoder and the tree verify, over
// memory laid out once at creation (after a pre-flight that refuses, with the numbers, what does not fit). Python
// hands it host weights once and then only token ids; nothing on the decode path allocates or waits on the host.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ar_decoder.h"
#include "ddtree_round.h"
#include "device_arena.h"
#include "drafter_model.h"
#include "engine_weights.h"
#include "graph_replay.h"
#include "latent_cache.h"
#include "model_dims.h"
#include "op_timeline.h"
#include "row_batch.h"
#include "target_model.h"
#include "tree_layout.cuh"

namespace ddtree {

// One stream's verify tree: the root (the bonus token, node 0) and its drafted nodes, parents[i] < i.
struct VerifyTree {
    int stream = 0;
    int start = 0;  // committed length: the root sits at position start
    std::vector<int32_t> tokens;   // [nodes + 1], root first
    std::vector<int32_t> parents;  // [nodes + 1], parents[0] == -1
};

struct VerifyOutput {
    std::vector<float> logits;  // [rows, vocab], rows in tree order, nodes in index order
    std::vector<uint16_t> taps; // [rows, tap layers * hidden] bf16 bits
    std::vector<int32_t> routing;  // [moe layers][rows][topk] when asked for
    int rows = 0;
};

// The DFlash drafter an engine runs its DDTree rounds with: its dims and RoPE, the target layers whose residuals
// are its context (increasing, dims.taps of them), and its context window (0: every committed row).
struct DrafterSpec {
    DrafterDims dims;
    RopeTable rope;
    std::vector<int> tap_layers;
    int window = 0;
};

// The device bytes an engine takes (what the pre-flight compares with free memory), by part.
struct MemoryPlan {
    size_t weights = 0, kv = 0, scratch = 0, draft = 0;
    size_t total() const { return weights + kv + scratch + draft; }
};

class Engine {
  public:
    // max_budget: the most drafted nodes per stream a verify takes (0: autoregressive only). Forwards take
    // max(streams x (max_budget + 1), prefill rows) rows. With `drafter`, the engine holds it too (its weights,
    // draft cache and scratch counted by the pre-flight) and runs DDTree rounds with it.
    // A split target (dims.shard, shard.h) holds rank dims.shard.rank with its peers simulated, or with
    // `all_ranks` every rank on this GPU (rank_simulation.h); its drafter (whole on every rank) then holds the whole
    // lm_head itself (DrafterDims::own_lm_head). With `nccl` (rank dims.shard.rank of dims.shard.ranks in a
    // communicator, not all_ranks) its peers are real, on other GPUs (nccl_collectives.h, multi_gpu_engine.h).
    Engine(const ModelDims& dims, const RopeTable& rope, int streams, int max_context, int max_budget, int device,
           const DrafterSpec* drafter = nullptr, bool all_ranks = false, const NcclRank* nccl = nullptr);
    ~Engine() = default;
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    const ModelDims& dims() const { return dims_; }
    int streams() const { return streams_; }
    int max_context() const { return max_context_; }
    int max_budget() const { return max_budget_; }
    int max_rows() const { return max_rows_; }
    int device() const { return device_; }
    Weights& weights() { return model_.weights(); }
    // A held rank's weights (std::invalid_argument naming `rank` when it is not held).
    Weights& weights(int rank) { return model_.weights(rank); }
    const std::vector<int>& held_ranks() const { return model_.held(); }
    // The first target tensor no upload has filled yet, over the held ranks ("" when complete).
    std::string missing();
    // The memory an engine of these arguments takes, counted without a device: the constructor's own layout.
    static MemoryPlan plan_memory(const ModelDims& dims, int streams, int max_context, int max_budget,
                                  const DrafterSpec* drafter, int held_ranks);
    // The drafter's weights (std::invalid_argument when the engine has no drafter).
    DrafterWeights& drafter_weights();
    void randomize_drafter(uint64_t seed) { drafter_weights().randomize(seed); }
    bool has_drafter() const { return drafter_ != nullptr; }
    const DrafterDims* drafter_dims() const { return drafter_ ? &drafter_->dims() : nullptr; }

    // Prefill each prompt into its stream (stream i <- prompts[i], from position 0); each stream's first new token.
    std::vector<int32_t> prefill(const std::vector<std::vector<int32_t>>& prompts, float temperature, uint64_t seed);
    // Prefill and decode in one call: [prompts][max_new_tokens] tokens; prompt + max_new_tokens <= max_context.
    Generation generate(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
                        uint64_t seed);

    // One eager forward over arbitrary rows (stream, position, id), writing their keys into the caches; fp32
    // logits [rows, vocab] (an engine holding one rank of a split target fills its own vocabulary columns, and
    // the others are 0). With `routing`, also each MoE layer's expert choices [moe layer][row][topk].
    std::vector<float> forward_logits(const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
                                      const std::vector<int32_t>& positions, std::vector<int32_t>* routing = nullptr);
    // One eager verify forward of trees over their streams' committed prefixes: every node's logits, and the
    // residual stream after each of tap_layers for every node, and with `routing` the experts each MoE layer chose.
    // Node KV rows go to the streams' tree slots.
    VerifyOutput verify(const std::vector<VerifyTree>& trees, const std::vector<int>& tap_layers, bool routing);
    // Device time per operation of that verify forward (eager, one launch at a time), the mean of `iters` passes
    // after a warm-up.
    StepProfile profile_verify(const std::vector<VerifyTree>& trees, int iters);
    // DDTree generation on the GPU: the drafter's candidates, or the oracle's (tests and benchmarks; see
    // DdtreeRound).
    TreeGeneration generate_ddtree(const RoundRequest& request);
    // The round times a generate_ddtree of this auto-budget request would choose by (DdtreeRound::round_costs).
    CostTable round_costs(const RoundRequest& request);

    // Benchmark support: random cache contents; decode timing (ArDecoder).
    void randomize_cache(uint64_t seed);
    std::pair<double, double> time_decode(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                                          uint64_t seed);
    StepProfile profile_step(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                             uint64_t seed);
    // A split target's collectives of one forward over `rows` rows, replayed apart (TargetModel::time_collectives).
    double time_collectives(int rows, int iters);

    // Profiling: the captured CUDA graphs (decode steps, then DDTree rounds), and the device seconds of each of n
    // replays of the one called `name` (std::invalid_argument naming `name` or `n` otherwise), after a warm-up
    // replay when `warmup`. See ArDecoder::replay and DdtreeRound::replay for the state each replay starts from.
    std::vector<CapturedGraph> graphs() const;
    std::vector<double> replay(const std::string& name, int n, bool warmup);

  private:
    // Checks the arguments, selects the device and compares the planned bytes with its free memory (throws with
    // the numbers); returns the plan.
    static size_t preflight(const ModelDims& dims, const RopeTable& rope, int streams, int max_context,
                            int max_budget, int device, const DrafterSpec* drafter, bool all_ranks,
                            const NcclRank* nccl);
    void check_weights();
    // Rows of the trees in a batch (validated); `tap_layers` checked against the model's layers.
    RowBatchBuilder tree_rows(const std::vector<VerifyTree>& trees) const;
    // Enqueues the copy of the last eager forward's logits [rows, vocab] to `to`: the held ranks' vocabulary
    // columns only (the others' were never written; `to` keeps what it holds there).
    void copy_logits(float* to, int rows, cudaStream_t s) const;

    ModelDims dims_;
    int streams_, max_context_, max_budget_, device_, max_rows_;
    size_t planned_bytes_;
    DeviceArena arena_;
    LatentCache cache_;
    TargetModel model_;
    RowBatch eager_rows_;
    ArDecoder decoder_;
    std::unique_ptr<DrafterModel> drafter_;
    DdtreeRound round_;
};

}  // namespace ddtree
