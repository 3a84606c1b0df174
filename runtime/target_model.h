// The target model on one GPU: its weights, the scratch of one forward, and the forward itself over a RowBatch:
// every layer (MLA attention over the latent cache, dense MLP or MoE), the final norm and the LM head's logits,
// with optional taps of the residual stream and capture of the experts chosen. Nothing here allocates or waits on
// the host after construction, so a forward can be captured into a CUDA graph.
// A split target (dims.shard) holds the share of each rank in `held` (every rank, or its own: rank_simulation.h, or
// its own with real peers: nccl_collectives.h):
// each attention and each MLP ends with the ranks' partial sums added by the collectives, and the logits of rank
// r are its vocabulary slice, at columns [first_token, + rank_vocab) of the logits rows.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "collectives.h"
#include "device_arena.h"
#include "engine_weights.h"
#include "latent_cache.h"
#include "model_dims.h"
#include "nccl_collectives.h"
#include "non_finite_logits.h"
#include "op_timeline.h"
#include "row_batch.h"

namespace ddtree {

// What a forward writes besides the logits.
struct ForwardOutputs {
    // The residual stream after each of tap_layers (increasing; HF's hidden_states[layer + 1] before any final norm)
    // for the rows tap_rows (device, n_tap_rows of them): tapped row i's layer t at taps[(i * tap_layers.size() + t)
    // * hidden], so each row's taps lie concatenated, as the drafter's fc reads them.
    std::vector<int> tap_layers;
    const int32_t* tap_rows = nullptr;
    int n_tap_rows = 0;
    kernels::bf16* taps = nullptr;
    // Each MoE layer's expert choices, [moe layer][row][topk], into TargetModel::routing().
    bool capture_routing = false;
};

class TargetModel {
  public:
    // Activations and scratch for forwards of up to max_rows rows whose rows see at most max_len keys, from `arena`.
    struct Scratch {
        kernels::bf16 *x, *xn, *qkv, *qn, *q, *q_abs, *o_lat, *v_out, *delta, *delta2, *act, *expert_act, *hsel;
        float *router_logits, *topk_weights, *logits, *gemm_ws, *shared_gemm_ws, *attn_ws, *temperature, *rope;
        int32_t *topk_ids, *local_ids, *gemm_counters, *shared_gemm_counters, *routing, *tokens, *nonfinite_at;
        unsigned long long* seed;
        size_t gemm_counter_count, shared_gemm_counter_count;
        static Scratch lay_out(const ModelDims& dims, int max_rows, int max_len, int streams, DeviceArena& arena);
    };

    // `held`: the ranks of dims.shard this GPU computes (increasing; {0} for a whole model). `nccl`: this GPU's rank
    // in a communicator of real peers (held is then {dims.shard.rank}); nullptr: the peers are simulated.
    TargetModel(const ModelDims& dims, const RopeTable& rope, const LatentCache& cache, int max_rows, int device,
                DeviceArena& arena, const std::vector<int>& held, const NcclRank* nccl = nullptr);
    ~TargetModel();
    TargetModel(const TargetModel&) = delete;
    TargetModel& operator=(const TargetModel&) = delete;

    const ModelDims& dims() const { return dims_; }
    int max_rows() const { return max_rows_; }
    Weights& weights() { return *weights_.front(); }
    // The weights of held rank `rank` (std::invalid_argument naming `rank` when it is not held).
    Weights& weights(int rank);
    const std::vector<int>& held() const { return held_; }
    cudaStream_t stream() const { return stream_; }
    const float* logits() const { return s_.logits; }  // [logit rows, vocab] fp32 of the last forward
    const int32_t* tokens() const { return s_.tokens; } // [logit rows] of the last sample()
    const int32_t* routing() const { return s_.routing; }

    // `n` rows of `rows`, the first n_logits of its logit rows getting logits. `span` bounds every row's kv_len (see
    // LatentCache::attention_span). A timeline times each launch, one at a time (the shared expert then runs on the
    // main stream too).
    void forward(const RowBatch& rows, int n, int n_logits, int span, const ForwardOutputs& outputs,
                 OpTimeline* timeline);
    // Tokens of the first n_logits logit rows: argmax at temperature 0, else Gumbel-max keyed by (seed, stream,
    // position) (sample.cuh).
    void sample(const RowBatch& rows, int n_logits);
    // Temperature (finite, >= 0; else std::invalid_argument) and seed that every later sample() reads, captured
    // graphs included.
    void set_sampling(float temperature, uint64_t seed);
    // Forgets which streams sampled non-finite logits (enqueued on the stream); a generation starts with it.
    void clear_nonfinite();
    // After a generation of `streams` streams (synchronises the stream): throws NonFiniteLogits naming the lowest
    // stream that sampled a NaN or infinite logit since clear_nonfinite(), and its first such position.
    void check_finite(int streams) const;
    // A simulated rank's collectives of one forward over `rows` rows, timed apart (collective_timing.h): median
    // device seconds over `iters` replays (std::invalid_argument for a whole model, a rank with real NCCL peers,
    // or rows outside 1..max_rows). Overwrites the forward's scratch and the collective slots, as a forward does.
    double time_collectives(int rows, int iters);

  private:
    void tap(const ForwardOutputs& outputs, int layer, OpTimeline* timeline);
    // The MoE layer `l` of held rank index `i` (its routed experts over s_.xn, the ids in `ids`) into `out`.
    void routed_experts(int i, int l, const int32_t* ids, kernels::bf16* out, int n);

    ModelDims dims_;
    RopeTable rope_;
    const LatentCache& cache_;
    int max_rows_;
    cudaStream_t stream_ = nullptr;
    cudaStream_t side_stream_ = nullptr;  // the shared expert, beside the routed experts (see forward)
    cudaEvent_t side_event_ = nullptr;    // forks the side stream from the main stream and joins it back
    std::vector<int> held_;
    std::vector<std::unique_ptr<Weights>> weights_;  // one per held rank
    std::unique_ptr<Collectives> collectives_;      // a split target's; nullptr for a whole model
    Scratch s_;
};

}  // namespace ddtree
