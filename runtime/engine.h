// The autoregressive engine: owns one GPU's copy of a DeepSeek-V3 / K2 model, per-stream latent KV caches,
// every scratch buffer, and the CUDA graphs of the decode step. Python hands it host weights once and then only
// token ids; nothing on the decode path allocates or waits on the host.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine_weights.h"

namespace ddtree {

// Row metadata of one forward, in device memory: token ids, positions, cache addressing, sampling keys.
struct RowBuffers {
    int32_t* ids = nullptr;
    int32_t* positions = nullptr;
    int32_t* kv_start = nullptr;  // first cache row of the row's stream
    int32_t* kv_len = nullptr;    // keys visible to the row (position + 1)
    int32_t* slots = nullptr;     // cache row the row's own key is written to
    int32_t* stream_ids = nullptr;
    int32_t* logit_rows = nullptr;       // rows whose logits are computed, increasing
    int32_t* logit_stream_ids = nullptr;
    int32_t* logit_positions = nullptr;
};

// Seconds of device time per named operation, summed over layers (from profile_step).
using StepProfile = std::vector<std::pair<std::string, double>>;

class Engine {
  public:
    Engine(const ModelDims& dims, const RopeTable& rope, int streams, int max_context, int device);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    const ModelDims& dims() const { return dims_; }
    int streams() const { return streams_; }
    int max_context() const { return max_context_; }
    int device() const { return device_; }
    Weights& weights() { return *weights_; }

    // Prefill each prompt into its stream (stream i <- prompts[i], from position 0) and choose each stream's
    // first new token; returns them.
    std::vector<int32_t> prefill(const std::vector<std::vector<int32_t>>& prompts, float temperature, uint64_t seed);

    // After prefill: `steps` decode steps for streams 0..n-1 by replaying the captured graph of n streams.
    // first_tokens are prefill's tokens. Returns [n][steps + 1] tokens (first token included).
    std::vector<std::vector<int32_t>> decode(const std::vector<int32_t>& first_tokens,
                                             const std::vector<int32_t>& prompt_lengths, int steps,
                                             float temperature, uint64_t seed);

    // One eager forward over arbitrary rows (stream, position, id), writing their keys into the caches;
    // returns fp32 logits [rows, vocab]. For tests of batch invariance and against the reference. When
    // `routing` is given it receives the experts each MoE layer chose, [moe layer][row][topk], so a reference
    // can be run on the same routing.
    std::vector<float> forward_logits(const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
                                      const std::vector<int32_t>& positions, std::vector<int32_t>* routing = nullptr);

    // Benchmark support: random weights (see Weights::randomize), random cache contents for every stream.
    void randomize_cache(uint64_t seed);
    // Replays the decode graph of `n` streams at the given positions `iters` times, sampling each next token at
    // `temperature` with `seed`; returns {device seconds per step, host seconds per graph launch}.
    std::pair<double, double> time_decode(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                                          uint64_t seed);
    // Device time per operation of one eager decode step of `n` streams at the given positions, sampling at
    // `temperature` with `seed`.
    StepProfile profile_step(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                             uint64_t seed);

  private:
    struct Graph {
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
    };
    class Timeline;

    size_t allocate_buffers(bool count_only);
    void release_streams();
    void upload_rows(const RowBuffers& rows, const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
                     const std::vector<int32_t>& positions, const std::vector<int32_t>& logit_rows);
    // `span` bounds every row's kv_len: attention launches, for each row, as many chunk CTAs as a row of up to `span`
    // keys can have. With capture_routing, each MoE layer's expert choices are copied to routing_.
    void forward(const RowBuffers& rows, int n_rows, int n_logit_rows, int span, Timeline* timeline,
                 bool capture_routing);
    void sample(const RowBuffers& rows, int n_logit_rows);
    // Temperature (finite, >= 0; else std::invalid_argument) and seed of the device sampler, read by every
    // sampling step, captured graphs included.
    void set_sampling(float temperature, uint64_t seed);
    void set_decode_state(const std::vector<int32_t>& ids, const std::vector<int32_t>& positions, int n);
    // The attention span for rows whose kv_len reaches at most longest = max(positions) + ahead: whole key chunks,
    // rounded up to a quarter of the power of two below `longest` (at most 25% spare keys), then to the longest
    // length with as many chunks (mla_longest_len: 4097..8192 keys are one span), and at most max_context. Each
    // span is one decode graph; CTAs past a row's length exit at once, but a grid sized by max_context launched
    // thousands of them per layer when max_context was long and the contexts short.
    int attention_span(const std::vector<int32_t>& positions, int ahead) const;
    // The decode step of `n` streams whose rows stay within `span` keys, captured on first use.
    Graph& decode_graph(int n, int span);
    void check_rows(const std::vector<int32_t>& streams, const std::vector<int32_t>& positions) const;
    // Latent KV rows of one layer (a stream's rows are max_context apart), and bf16 elements of every layer's cache.
    int64_t cache_rows() const { return static_cast<int64_t>(streams_) * max_context_; }
    size_t kv_cache_elements() const { return static_cast<size_t>(dims_.layers) * cache_rows() * dims_.latent_row(); }

    ModelDims dims_;
    RopeTable rope_;
    int streams_, max_context_, device_;
    int max_rows_;  // rows of one forward: max(streams, prefill chunk)
    int max_steps_; // decode history length
    std::unique_ptr<Weights> weights_;
    cudaStream_t stream_ = nullptr;
    cudaStream_t side_stream_ = nullptr;  // the shared expert, beside the routed experts (see forward)
    cudaEvent_t side_event_ = nullptr;  // forks the side stream from the main stream and joins it back
    std::vector<void*> allocations_;

    // activations and scratch
    kernels::bf16 *x_ = nullptr, *xn_ = nullptr, *qkv_ = nullptr, *qn_ = nullptr, *q_ = nullptr, *q_abs_ = nullptr;
    kernels::bf16 *o_lat_ = nullptr, *v_out_ = nullptr, *delta_ = nullptr, *delta2_ = nullptr, *act_ = nullptr;
    kernels::bf16 *expert_act_ = nullptr, *hsel_ = nullptr, *kv_cache_ = nullptr;
    float *router_logits_ = nullptr, *topk_weights_ = nullptr, *logits_ = nullptr;
    float *gemm_ws_ = nullptr, *attn_ws_ = nullptr;
    int32_t *topk_ids_ = nullptr, *gemm_counters_ = nullptr, *tokens_ = nullptr, *history_ = nullptr;
    int32_t* step_ = nullptr;
    float* shared_gemm_ws_ = nullptr;  // split-K scratch of the shared expert's GEMMs (see forward)
    int32_t* shared_gemm_counters_ = nullptr;
    int32_t* routing_ = nullptr;  // [moe layers][max_rows][topk]: expert choices of an eager forward
    float* temperature_ = nullptr;
    float* rope_device_ = nullptr;  // inv_freq table
    unsigned long long* seed_ = nullptr;
    RowBuffers eager_rows_, decode_rows_;
    std::map<std::pair<int, int>, Graph> graphs_;  // (streams, attention span)
};

}  // namespace ddtree
