#include "engine.h"

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <cmath>
#include <numeric>
#include <thread>
#include <tuple>
#include <stdexcept>

#include "cuda_check.h"
#include "embed.cuh"
#include "fill_random.cuh"
#include "gemm.cuh"
#include "mla_attn.cuh"
#include "rmsnorm.cuh"
#include "rope.cuh"
#include "router.cuh"
#include "sample.cuh"

namespace ddtree {

namespace k = ddtree::kernels;
using k::bf16;

namespace {

constexpr int kPrefillRows = 64;    // rows per prefill forward (one GEMM token block)
constexpr int kDefaultSteps = 4096; // decode history per generate call
constexpr size_t kHeadroomBytes = size_t{1} << 30;

// Holds a stream for a while on the host, so everything enqueued behind it runs back to back on the device
// (per-operation timings then measure the device, not the host's launch rate).
void CUDART_CB hold_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }

// Token ids for timing n streams: distinct and spread over the vocabulary. One id for every stream would make
// the streams' hidden states, and so their expert choices, alike, and understate the routed experts' cost.
std::vector<int32_t> probe_ids(int n, int vocab) {
    std::vector<int32_t> ids(n);
    for (int i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((1 + 7919LL * i) % vocab);
    return ids;
}

// No iostreams in the runtime: a host process can carry a second libstdc++ whose locale facets clash with ours
// (seen on the GPU image: an ostringstream crashed inside codecvt), so messages use snprintf.
std::string gib(size_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
    return text;
}

using GemmShape = std::array<int, 3>;  // n, k, batch

// The projections of the main stream, and the shared expert's, which runs beside the routed experts on the side
// stream with scratch of its own (split-K partials and counters must not be shared by concurrent GEMMs).
std::vector<GemmShape> main_gemms(const ModelDims& d) {
    return {{d.qkv_a(), d.hidden, 1},      {d.heads * d.qk(), d.q_lora, 1}, {d.kv_lora, d.nope, d.heads},
            {d.v, d.kv_lora, d.heads},     {d.hidden, d.heads * d.v, 1},    {2 * d.inter, d.hidden, 1},
            {d.hidden, d.inter, 1},        {d.experts, d.hidden, 1},        {d.vocab, d.hidden, 1}};
}
std::vector<GemmShape> shared_expert_gemms(const ModelDims& d) {
    return {{2 * d.shared_inter, d.hidden, 1}, {d.hidden, d.shared_inter, 1}};
}

// A side stream forked from the main stream at construction (it waits for the main stream's work so far) and
// joined back by join(), or, when an exception leaves the scope first, by the destructor (unchecked: it must not
// throw), so that neither a capture ends with the side stream unjoined nor a later forward overwrites buffers the
// side stream still writes. One event serves both: a wait binds to the record made just before it. With
// fork = false nothing is forked and join() does nothing.
class ForkedStream {
  public:
    ForkedStream(bool fork, cudaStream_t main, cudaStream_t side, cudaEvent_t event)
        : main_(main), side_(side), event_(event) {
        if (!fork) return;
        CUDA_CHECK(cudaEventRecord(event_, main_));
        CUDA_CHECK(cudaStreamWaitEvent(side_, event_));
        forked_ = true;
    }
    ForkedStream(const ForkedStream&) = delete;
    ForkedStream& operator=(const ForkedStream&) = delete;
    ~ForkedStream() { rejoin(); }  // unchecked: an exception may already be leaving
    void join() { CUDA_CHECK(rejoin()); }

  private:
    cudaError_t rejoin() {
        if (!forked_) return cudaSuccess;
        forked_ = false;
        const cudaError_t recorded = cudaEventRecord(event_, side_);
        return recorded != cudaSuccess ? recorded : cudaStreamWaitEvent(main_, event_);
    }

    cudaStream_t main_, side_;
    cudaEvent_t event_;
    bool forked_ = false;
};

// Split-K partials (floats) and arrival counters that `gemms` need at `rows` rows: the maximum over them.
std::pair<size_t, size_t> gemm_scratch(const std::vector<GemmShape>& gemms, int rows) {
    size_t ws = 0, counters = 0;
    for (const auto& [n, kk, b] : gemms) {
        ws = std::max<size_t>(ws, k::gemm_workspace_floats(rows, n, kk, b));
        counters = std::max<size_t>(counters, k::gemm_counter_count(n, b));
    }
    return {ws, counters};
}

}  // namespace

// Optional per-operation timing of an eager forward: events around each named op.
class Engine::Timeline {
  public:
    explicit Timeline(cudaStream_t stream) : stream_(stream) {}
    ~Timeline() {
        for (auto& [name, start, stop] : events_) {
            cudaEventDestroy(start);
            cudaEventDestroy(stop);
        }
    }
    template <typename F>
    void op(const char* name, F&& launch) {
        cudaEvent_t start, stop;
        CUDA_CHECK(cudaEventCreate(&start));
        CUDA_CHECK(cudaEventCreate(&stop));
        events_.emplace_back(name, start, stop);
        CUDA_CHECK(cudaEventRecord(start, stream_));
        launch();
        CUDA_CHECK(cudaEventRecord(stop, stream_));
    }
    void accumulate(std::map<std::string, double>& seconds) const {
        for (const auto& [name, start, stop] : events_) {
            float ms = 0.f;
            CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
            seconds[name] += ms * 1e-3;
        }
    }

  private:
    cudaStream_t stream_;
    std::vector<std::tuple<std::string, cudaEvent_t, cudaEvent_t>> events_;
};

Engine::Engine(const ModelDims& dims, const RopeTable& rope, int streams, int max_context, int device)
    : dims_(dims), rope_(rope), streams_(streams), max_context_(max_context), device_(device) {
    if (streams < 1 || streams > 1024) {
        throw std::invalid_argument("streams must be in 1..1024, got " + std::to_string(streams));
    }
    if (max_context < 1) {
        throw std::invalid_argument("max_context must be >= 1, got " + std::to_string(max_context));
    }
    if (static_cast<int64_t>(streams) * max_context > INT32_MAX) {
        throw std::invalid_argument("streams * max_context must fit in int32");
    }
    if (!k::mla_dims_supported(dims.kv_lora, dims.rope)) {
        throw std::invalid_argument("no MLA attention kernel is compiled for kv_lora_rank " +
                                    std::to_string(dims.kv_lora) + " and qk_rope_head_dim " +
                                    std::to_string(dims.rope));
    }
    for (const auto& [name, dim] : {std::pair<const char*, int>{"hidden_size", dims.hidden},
                                    {"q_lora_rank", dims.q_lora}, {"kv_lora_rank", dims.kv_lora}}) {
        if (!k::norm_dim_supported(dim)) {
            throw std::invalid_argument(std::string(name) + " " + std::to_string(dim) +
                                        " is outside the RMSNorm kernels' 1.." + std::to_string(k::kNormMaxDim));
        }
    }
    if (dims.first_dense < dims.layers && !k::router_supported(dims.experts, dims.topk)) {
        throw std::invalid_argument("no router kernel for n_routed_experts " + std::to_string(dims.experts) +
                                    " and num_experts_per_tok " + std::to_string(dims.topk) + " (at most " +
                                    std::to_string(k::kRouterMaxExperts) + " experts and " +
                                    std::to_string(k::kRouterMaxTopk) + " per token)");
    }
    if (static_cast<int>(rope.inv_freq.size()) != dims.rope / 2) {
        throw std::invalid_argument("rope table has " + std::to_string(rope.inv_freq.size()) + " frequencies, expected " +
                                    std::to_string(dims.rope / 2));
    }
    int count = 0;
    CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count) {
        throw std::invalid_argument("device " + std::to_string(device) + " does not exist (" + std::to_string(count) +
                                    " CUDA devices)");
    }
    CUDA_CHECK(cudaSetDevice(device));
    max_rows_ = std::max(streams, kPrefillRows);
    max_steps_ = kDefaultSteps;

    // Memory pre-flight: refuse, with the numbers, a configuration that cannot fit.
    const size_t weights = Weights::planned_bytes(dims, max_rows_);
    const size_t kv = kv_cache_elements() * sizeof(bf16);
    const size_t scratch = allocate_buffers(true);
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (weights + kv + scratch + kHeadroomBytes > free_bytes) {
        throw std::invalid_argument("model does not fit on device " + std::to_string(device) + ": weights " +
                                    gib(weights) + " + KV cache " + gib(kv) + " (" + std::to_string(streams) +
                                    " streams x " + std::to_string(max_context) + " tokens) + scratch " + gib(scratch) +
                                    " + headroom " + gib(kHeadroomBytes) + " > free " + gib(free_bytes) + " of " +
                                    gib(total_bytes));
    }
    try {
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&side_event_, cudaEventDisableTiming));
        weights_ = std::make_unique<Weights>(dims, device, max_rows_, stream_);
        CUDA_CHECK(cudaMalloc(&kv_cache_, kv));
        allocations_.push_back(kv_cache_);
        allocate_buffers(false);
    } catch (...) {
        for (void* p : allocations_) cudaFree(p);
        weights_.reset();
        release_streams();
        throw;
    }
}

void Engine::release_streams() {
    if (side_event_ != nullptr) cudaEventDestroy(side_event_);
    if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Engine::~Engine() {
    cudaSetDevice(device_);
    for (auto& [n, g] : graphs_) {
        cudaGraphExecDestroy(g.exec);
        cudaGraphDestroy(g.graph);
    }
    weights_.reset();
    for (void* p : allocations_) cudaFree(p);
    release_streams();
}

// Every device buffer besides the weights and the KV cache. With count_only nothing is allocated or written and
// every pointer stays null: the call returns the bytes it would take, which is what the memory pre-flight adds up,
// so the two never disagree.
size_t Engine::allocate_buffers(bool count_only) {
    const ModelDims& d = dims_;
    const size_t r = max_rows_;
    size_t total = 0;
    auto alloc = [&](size_t bytes) -> void* {
        bytes = std::max<size_t>(bytes, 16);
        total += bytes;
        if (count_only) return nullptr;
        void* p = nullptr;
        CUDA_CHECK(cudaMalloc(&p, bytes));
        allocations_.push_back(p);
        return p;
    };
    auto bf = [&](size_t n) { return static_cast<bf16*>(alloc(n * 2)); };
    auto f32 = [&](size_t n) { return static_cast<float*>(alloc(n * 4)); };
    auto i32 = [&](size_t n) { return static_cast<int32_t*>(alloc(n * 4)); };
    x_ = bf(r * d.hidden);
    xn_ = bf(r * d.hidden);
    qkv_ = bf(r * d.qkv_a());
    qn_ = bf(r * d.q_lora);
    q_ = bf(r * d.heads * d.qk());
    q_abs_ = bf(r * d.heads * d.latent_row());
    o_lat_ = bf(r * d.heads * d.kv_lora);
    v_out_ = bf(r * d.heads * d.v);
    delta_ = bf(r * d.hidden);
    delta2_ = bf(r * d.hidden);
    act_ = bf(r * std::max(d.inter, d.shared_inter));
    // Scratch of the plain INT4 expert path; the fused MoE layers have their own workspace.
    expert_act_ = Weights::marlin_supported(d) ? nullptr : bf(r * d.topk * d.moe_inter);
    hsel_ = bf(r * d.hidden);
    router_logits_ = f32(r * d.experts);
    topk_weights_ = f32(r * d.topk);
    logits_ = f32(r * d.vocab);
    topk_ids_ = i32(r * d.topk);
    routing_ = i32(static_cast<size_t>(d.layers - d.first_dense) * r * d.topk);
    tokens_ = i32(r);
    history_ = i32(static_cast<size_t>(streams_) * max_steps_);
    step_ = i32(1);
    temperature_ = f32(1);
    seed_ = static_cast<unsigned long long*>(alloc(8));
    const auto [ws, counters] = gemm_scratch(main_gemms(d), static_cast<int>(r));
    gemm_ws_ = f32(ws);
    gemm_counters_ = i32(counters);
    const auto [shared_ws, shared_counters] = gemm_scratch(shared_expert_gemms(d), static_cast<int>(r));
    shared_gemm_ws_ = f32(shared_ws);
    shared_gemm_counters_ = i32(shared_counters);
    attn_ws_ = f32(k::mla_workspace_floats({d.heads, d.kv_lora, d.rope}, static_cast<int>(r), max_context_));
    int32_t* row_tables[2] = {i32(9 * r), i32(9 * r)};
    rope_device_ = f32(d.rope / 2);
    if (count_only) return total;

    auto row_buffers = [&](int32_t* base) {
        return RowBuffers{base,         base + r,     base + 2 * r, base + 3 * r, base + 4 * r,
                          base + 5 * r, base + 6 * r, base + 7 * r, base + 8 * r};
    };
    eager_rows_ = row_buffers(row_tables[0]);
    decode_rows_ = row_buffers(row_tables[1]);
    // A decode step's logit rows are its stream rows, and their sampling keys the live positions, which
    // advance_decode moves on the device between replays.
    decode_rows_.logit_stream_ids = decode_rows_.stream_ids;
    decode_rows_.logit_positions = decode_rows_.positions;
    CUDA_CHECK(cudaMemsetAsync(gemm_counters_, 0, std::max<size_t>(counters, 4) * 4, stream_));
    CUDA_CHECK(cudaMemsetAsync(shared_gemm_counters_, 0, std::max<size_t>(shared_counters, 4) * 4, stream_));
    // On the engine's stream, like every upload: a pageable cudaMemcpy may return before its DMA lands.
    CUDA_CHECK(cudaMemcpyAsync(rope_device_, rope_.inv_freq.data(), rope_.inv_freq.size() * 4,
                               cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return total;
}

void Engine::check_rows(const std::vector<int32_t>& streams, const std::vector<int32_t>& positions) const {
    for (size_t i = 0; i < streams.size(); ++i) {
        if (streams[i] < 0 || streams[i] >= streams_) {
            throw std::invalid_argument("row " + std::to_string(i) + ": stream " + std::to_string(streams[i]) +
                                        " outside 0.." + std::to_string(streams_ - 1));
        }
        if (positions[i] < 0 || positions[i] >= max_context_) {
            throw std::invalid_argument("row " + std::to_string(i) + ": position " + std::to_string(positions[i]) +
                                        " outside 0.." + std::to_string(max_context_ - 1));
        }
    }
}

void Engine::upload_rows(const RowBuffers& rows, const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
                         const std::vector<int32_t>& positions, const std::vector<int32_t>& logit_rows) {
    const size_t n = ids.size();
    // The nine tables of RowBuffers, one after another; without logit rows (decode) the last three stay as they are.
    const size_t tables = logit_rows.empty() ? 6 : 9;
    std::vector<int32_t> host(tables * static_cast<size_t>(max_rows_), 0);
    for (size_t i = 0; i < n; ++i) {
        const int32_t start = streams[i] * max_context_;
        host[i] = ids[i];
        host[max_rows_ + i] = positions[i];
        host[2 * max_rows_ + i] = start;
        host[3 * max_rows_ + i] = positions[i] + 1;
        host[4 * max_rows_ + i] = start + positions[i];
        host[5 * max_rows_ + i] = streams[i];
    }
    for (size_t j = 0; j < logit_rows.size(); ++j) {
        host[6 * max_rows_ + j] = logit_rows[j];
        host[7 * max_rows_ + j] = streams[logit_rows[j]];
        host[8 * max_rows_ + j] = positions[logit_rows[j]];
    }
    CUDA_CHECK(cudaMemcpyAsync(rows.ids, host.data(), host.size() * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void Engine::forward(const RowBuffers& rows, int n, int n_logits, int span, Timeline* timeline,
                     bool capture_routing) {
    const ModelDims& d = dims_;
    const Weights& w = *weights_;
    cudaStream_t s = stream_;
    auto op = [&](const char* name, auto&& launch) {
        if (timeline != nullptr) {
            timeline->op(name, launch);
        } else {
            launch();
        }
    };
    // A stream with the split-K scratch of the GEMMs it runs: concurrent GEMMs must not share scratch.
    struct Lane {
        cudaStream_t stream;
        float* ws;
        int32_t* counters;
    };
    const Lane main_lane{s, gemm_ws_, gemm_counters_};
    // The shared expert needs only the normed input, so outside a timeline (whose per-op times need one op at a
    // time) it runs on the side stream beside the router and the routed experts: its weight stream hides their
    // latency-bound kernels. Its scratch is its own either way (the main scratch is sized for the main GEMMs).
    const bool concurrent = timeline == nullptr;
    const Lane shared_lane{concurrent ? side_stream_ : s, shared_gemm_ws_, shared_gemm_counters_};
    auto gemm_on = [&](const Lane& lane, const char* name, const bf16* x, int64_t ldx, const bf16* weight, void* out,
                       int64_t ldo, int rows_m, int n_out, int k_in, k::GemmEpilogue epi, k::GemmBatch batch = {}) {
        op(name, [&] {
            CUDA_CHECK(k::gemm_bf16(x, ldx, weight, out, ldo, rows_m, n_out, k_in, epi, batch, lane.ws, lane.counters,
                                    lane.stream));
        });
    };
    auto gemm = [&](const char* name, const bf16* x, int64_t ldx, const bf16* weight, void* out, int64_t ldo,
                    int rows_m, int n_out, int k_in, k::GemmEpilogue epi, k::GemmBatch batch = {}) {
        gemm_on(main_lane, name, x, ldx, weight, out, ldo, rows_m, n_out, k_in, epi, batch);
    };
    const k::RopeParams rope{rope_device_, rope_.attention_factor, d.rope, rope_.interleave};
    const k::MlaDims mla{d.heads, d.kv_lora, d.rope};
    const size_t layer_cache = static_cast<size_t>(cache_rows()) * d.latent_row();

    op("embed", [&] { CUDA_CHECK(k::gather_rows(x_, d.hidden, w.embed, d.hidden, rows.ids, n, d.hidden, s)); });
    const bf16* pending = nullptr;   // MLP output not yet added to the residual
    const bf16* pending2 = nullptr;  // routed-expert output, added in the same fp32 sum
    for (int l = 0; l < d.layers; ++l) {
        const LayerWeights& lw = w.layers[l];
        bf16* cache = kv_cache_ + l * layer_cache;
        op("norm", [&] {
            if (pending == nullptr) {
                CUDA_CHECK(k::rmsnorm(xn_, x_, lw.input_norm, n, d.hidden, d.rms_eps, s));
            } else {
                CUDA_CHECK(k::add_rmsnorm(xn_, x_, pending, pending2, lw.input_norm, n, d.hidden, d.rms_eps, s));
            }
        });
        gemm("q_a+kv_a", xn_, d.hidden, lw.qkv_a, qkv_, d.qkv_a(), n, d.qkv_a(), d.hidden, k::GemmEpilogue::kBf16);
        op("norm", [&] {
            CUDA_CHECK(k::rmsnorm_strided(qn_, d.q_lora, qkv_, d.qkv_a(), lw.q_a_norm, n, d.q_lora, d.lora_eps, s));
        });
        op("kv_store", [&] {
            CUDA_CHECK(k::mla_store_kv(cache, rows.slots, qkv_ + d.q_lora, d.qkv_a(), lw.kv_a_norm, d.lora_eps,
                                       d.kv_lora, rows.positions, n, rope, s));
        });
        gemm("q_b", qn_, d.q_lora, lw.q_b, q_, d.heads * d.qk(), n, d.heads * d.qk(), d.q_lora, k::GemmEpilogue::kBf16);
        gemm("kv_b_absorb_k", q_, d.heads * d.qk(), lw.w_uk_t, q_abs_, d.heads * d.latent_row(), n, d.kv_lora, d.nope,
             k::GemmEpilogue::kBf16,
             {d.heads, d.qk(), static_cast<int64_t>(d.kv_lora) * d.nope, d.latent_row()});
        op("rope_q", [&] {
            CUDA_CHECK(k::rope_queries(q_abs_, d.heads * d.latent_row(), d.latent_row(), d.kv_lora, q_,
                                       d.heads * d.qk(), d.qk(), d.nope, rows.positions, n, d.heads, rope, s));
        });
        op("attention", [&] {
            CUDA_CHECK(k::mla_attention(o_lat_, q_abs_, cache, cache_rows(),
                                        rows.kv_start, rows.kv_len, n, span, mla,
                                        d.softmax_scale, attn_ws_, s));
        });
        gemm("kv_b_absorb_v", o_lat_, d.heads * d.kv_lora, lw.kv_b + static_cast<size_t>(d.nope) * d.kv_lora, v_out_,
             d.heads * d.v, n, d.v, d.kv_lora, k::GemmEpilogue::kBf16,
             {d.heads, d.kv_lora, static_cast<int64_t>(d.nope + d.v) * d.kv_lora, d.v});
        gemm("o_proj", v_out_, d.heads * d.v, lw.o_proj, delta_, d.hidden, n, d.hidden, d.heads * d.v,
             k::GemmEpilogue::kBf16);
        op("norm", [&] {
            CUDA_CHECK(k::add_rmsnorm(xn_, x_, delta_, nullptr, lw.post_norm, n, d.hidden, d.rms_eps, s));
        });
        if (!d.is_moe(l)) {
            gemm("mlp_gate_up", xn_, d.hidden, lw.gate_up, act_, d.inter, n, 2 * d.inter, d.hidden,
                 k::GemmEpilogue::kSiluMul);
            gemm("mlp_down", act_, d.inter, lw.down, delta_, d.hidden, n, d.hidden, d.inter, k::GemmEpilogue::kBf16);
            pending = delta_;
            pending2 = nullptr;
            continue;
        }
        ForkedStream shared_expert(concurrent, s, side_stream_, side_event_);  // after the norm, before the router
        // The router launches first: its CTAs take the SMs before the shared expert's, which fill the gaps after.
        gemm("router", xn_, d.hidden, lw.router, router_logits_, d.experts, n, d.experts, d.hidden,
             k::GemmEpilogue::kF32);
        gemm_on(shared_lane, "shared_gate_up", xn_, d.hidden, lw.gate_up, act_, d.shared_inter, n,
                2 * d.shared_inter, d.hidden, k::GemmEpilogue::kSiluMul);
        gemm_on(shared_lane, "shared_down", act_, d.shared_inter, lw.down, delta_, d.hidden, n, d.hidden,
                d.shared_inter, k::GemmEpilogue::kBf16);
        op("router", [&] {
            CUDA_CHECK(k::route_topk(topk_ids_, topk_weights_, router_logits_, lw.router_bias, n, d.experts, d.topk,
                                     d.norm_topk_prob, s));
        });
        if (capture_routing) {
            const size_t ids = static_cast<size_t>(n) * d.topk;
            CUDA_CHECK(cudaMemcpyAsync(routing_ + (l - d.first_dense) * ids, topk_ids_, ids * sizeof(int32_t),
                                       cudaMemcpyDeviceToDevice, s));
        }
        op("routed_experts", [&] {
            if (lw.marlin) {
                lw.marlin->forward(xn_, topk_ids_, topk_weights_, nullptr, delta2_, n, s);
            } else {
                CUDA_CHECK(k::experts_int4_forward(delta2_, expert_act_, xn_, topk_ids_, topk_weights_, n, d.topk,
                                                   d.routed_scaling_factor, lw.plain, s));
            }
        });
        shared_expert.join();  // delta_ is read by the next norm, and a capture must end with every stream joined
        pending = delta_;
        pending2 = delta2_;
    }
    op("norm", [&] {
        CUDA_CHECK(k::add_rmsnorm(xn_, x_, pending, pending2, w.final_norm, n, d.hidden, d.rms_eps, s));
    });
    // Logit rows are increasing, so n_logits == n means every row in order (decode): the LM head reads xn_ as it is.
    const bf16* head_in = xn_;
    if (n_logits < n) {
        op("gather", [&] {
            CUDA_CHECK(k::gather_rows(hsel_, d.hidden, xn_, d.hidden, rows.logit_rows, n_logits, d.hidden, s));
        });
        head_in = hsel_;
    }
    gemm("lm_head", head_in, d.hidden, w.lm_head, logits_, d.vocab, n_logits, d.vocab, d.hidden, k::GemmEpilogue::kF32);
}

void Engine::sample(const RowBuffers& rows, int n_logits) {
    CUDA_CHECK(k::sample_tokens(tokens_, logits_, dims_.vocab, n_logits, dims_.vocab, temperature_, seed_,
                                rows.logit_stream_ids, rows.logit_positions, stream_));
}

void Engine::set_sampling(float temperature, uint64_t seed) {
    if (!(temperature >= 0.f) || std::isinf(temperature)) {
        throw std::invalid_argument("temperature must be finite and >= 0, got " + std::to_string(temperature));
    }
    CUDA_CHECK(cudaMemcpyAsync(temperature_, &temperature, 4, cudaMemcpyHostToDevice, stream_));
    const unsigned long long seed_value = seed;
    CUDA_CHECK(cudaMemcpyAsync(seed_, &seed_value, 8, cudaMemcpyHostToDevice, stream_));
}

std::vector<int32_t> Engine::prefill(const std::vector<std::vector<int32_t>>& prompts, float temperature,
                                     uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    if (const std::string m = weights_->missing(); !m.empty()) {
        throw std::invalid_argument("weights are incomplete: '" + m + "' was never uploaded");
    }
    if (prompts.empty() || static_cast<int>(prompts.size()) > streams_) {
        throw std::invalid_argument("prefill takes 1.." + std::to_string(streams_) + " prompts, got " +
                                    std::to_string(prompts.size()));
    }
    set_sampling(temperature, seed);
    std::vector<int32_t> ids, streams, positions;
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (prompts[i].empty() || static_cast<int>(prompts[i].size()) > max_context_) {
            throw std::invalid_argument("prompt " + std::to_string(i) + " has " + std::to_string(prompts[i].size()) +
                                        " tokens; must be 1.." + std::to_string(max_context_));
        }
        for (size_t p = 0; p < prompts[i].size(); ++p) {
            ids.push_back(prompts[i][p]);
            streams.push_back(static_cast<int32_t>(i));
            positions.push_back(static_cast<int32_t>(p));
        }
    }
    std::vector<int32_t> first(prompts.size(), 0);
    for (size_t begin = 0; begin < ids.size(); begin += kPrefillRows) {
        const size_t end = std::min(ids.size(), begin + kPrefillRows);
        const std::vector<int32_t> c_ids(ids.begin() + begin, ids.begin() + end);
        const std::vector<int32_t> c_streams(streams.begin() + begin, streams.begin() + end);
        const std::vector<int32_t> c_pos(positions.begin() + begin, positions.begin() + end);
        std::vector<int32_t> last;  // rows holding a prompt's final token
        for (size_t r = 0; r < c_ids.size(); ++r) {
            if (c_pos[r] + 1 == static_cast<int32_t>(prompts[c_streams[r]].size())) last.push_back(static_cast<int32_t>(r));
        }
        upload_rows(eager_rows_, c_ids, c_streams, c_pos, last);
        forward(eager_rows_, static_cast<int>(c_ids.size()), static_cast<int>(last.size()), attention_span(c_pos, 1),
                nullptr, false);
        if (!last.empty()) {
            sample(eager_rows_, static_cast<int>(last.size()));
            std::vector<int32_t> chosen(last.size());
            CUDA_CHECK(cudaMemcpyAsync(chosen.data(), tokens_, chosen.size() * 4, cudaMemcpyDeviceToHost, stream_));
            CUDA_CHECK(cudaStreamSynchronize(stream_));
            for (size_t j = 0; j < last.size(); ++j) first[c_streams[last[j]]] = chosen[j];
        }
    }
    return first;  // the last chunk holds the last prompt's final token: its read-back synchronised the stream
}

void Engine::set_decode_state(const std::vector<int32_t>& ids, const std::vector<int32_t>& positions, int n) {
    std::vector<int32_t> streams(n);
    std::iota(streams.begin(), streams.end(), 0);
    // Stream i is row i. Every row has logits, read in row order with keys aliased to the stream rows (see
    // allocate_buffers), so the logit-row tables are left as they are.
    upload_rows(decode_rows_, ids, streams, positions, {});
}

int Engine::attention_span(const std::vector<int32_t>& positions, int ahead) const {
    const int longest = *std::max_element(positions.begin(), positions.end()) + ahead;
    int granule = k::kMlaShortChunk;  // a quarter of the power of two below `longest`, in whole chunks
    while (granule * 8 <= longest) granule *= 2;
    const int rounded = std::min((longest + granule - 1) / granule * granule, max_context_);
    // The longest span of the same chunk bound launches the same grid, and the spans of one bound then share a graph.
    return static_cast<int>(std::min<int64_t>(k::mla_longest_len(k::mla_max_chunks(rounded)), max_context_));
}

Engine::Graph& Engine::decode_graph(int n, int span) {
    auto it = graphs_.find({n, span});
    if (it != graphs_.end()) {
        return it->second;
    }
    Graph g;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    try {
        forward(decode_rows_, n, n, span, nullptr, false);
        sample(decode_rows_, n);
        CUDA_CHECK(k::advance_decode(decode_rows_.ids, decode_rows_.positions, decode_rows_.kv_len, decode_rows_.slots,
                                     decode_rows_.kv_start, tokens_, history_, max_steps_, step_, n, stream_));
    } catch (...) {
        cudaGraph_t broken = nullptr;
        cudaStreamEndCapture(stream_, &broken);
        if (broken != nullptr) cudaGraphDestroy(broken);
        cudaGetLastError();  // a failed EndCapture leaves its error behind for the next launcher's check
        throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream_, &g.graph));
    CUDA_CHECK(cudaGraphInstantiate(&g.exec, g.graph, 0));
    return graphs_.emplace(std::make_pair(n, span), g).first->second;
}

std::vector<std::vector<int32_t>> Engine::decode(const std::vector<int32_t>& first_tokens,
                                                 const std::vector<int32_t>& prompt_lengths, int steps,
                                                 float temperature, uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    const int n = static_cast<int>(first_tokens.size());
    if (n < 1 || n > streams_ || prompt_lengths.size() != first_tokens.size()) {
        throw std::invalid_argument("decode takes 1.." + std::to_string(streams_) + " streams");
    }
    if (steps < 0 || steps + 1 > max_steps_) {
        throw std::invalid_argument("decode steps must be in 0.." + std::to_string(max_steps_ - 1));
    }
    for (int i = 0; i < n; ++i) {
        if (prompt_lengths[i] + steps > max_context_) {
            throw std::invalid_argument("stream " + std::to_string(i) + ": prompt of " +
                                        std::to_string(prompt_lengths[i]) + " tokens + " + std::to_string(steps) +
                                        " decode steps exceeds max_context " + std::to_string(max_context_));
        }
    }
    set_sampling(temperature, seed);
    set_decode_state(first_tokens, prompt_lengths, n);
    // history[s][0] is the prefill token; each replay appends one. The device only writes the history, so only its
    // first column goes up and only the columns this call fills come back.
    const size_t history_pitch = static_cast<size_t>(max_steps_) * 4;
    const int32_t one = 1;
    CUDA_CHECK(cudaMemcpy2DAsync(history_, history_pitch, first_tokens.data(), 4, 4, n, cudaMemcpyHostToDevice,
                                 stream_));
    CUDA_CHECK(cudaMemcpyAsync(step_, &one, 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (steps > 0) {
        // The last step's row of stream i sits at position prompt_lengths[i] + steps - 1.
        Graph& g = decode_graph(n, attention_span(prompt_lengths, steps));
        for (int i = 0; i < steps; ++i) CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
    }
    const int filled = steps + 1;
    std::vector<int32_t> history(static_cast<size_t>(n) * filled);
    CUDA_CHECK(cudaMemcpy2DAsync(history.data(), static_cast<size_t>(filled) * 4, history_, history_pitch,
                                 static_cast<size_t>(filled) * 4, n, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<std::vector<int32_t>> out(n);
    for (int i = 0; i < n; ++i) {
        const int32_t* row = history.data() + static_cast<size_t>(i) * filled;
        out[i].assign(row, row + filled);
    }
    return out;
}

std::vector<float> Engine::forward_logits(const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
                                          const std::vector<int32_t>& positions, std::vector<int32_t>* routing) {
    CUDA_CHECK(cudaSetDevice(device_));
    const int n = static_cast<int>(ids.size());
    if (n < 1 || n > max_rows_ || streams.size() != ids.size() || positions.size() != ids.size()) {
        throw std::invalid_argument("forward_logits takes 1.." + std::to_string(max_rows_) +
                                    " rows of equal-length ids, streams, positions");
    }
    check_rows(streams, positions);
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    upload_rows(eager_rows_, ids, streams, positions, all);
    forward(eager_rows_, n, n, attention_span(positions, 1), nullptr, routing != nullptr);
    std::vector<float> logits(static_cast<size_t>(n) * dims_.vocab);
    CUDA_CHECK(cudaMemcpyAsync(logits.data(), logits_, logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
    if (routing != nullptr) {
        routing->resize(static_cast<size_t>(dims_.layers - dims_.first_dense) * n * dims_.topk);
        CUDA_CHECK(cudaMemcpyAsync(routing->data(), routing_, routing->size() * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return logits;
}

void Engine::randomize_cache(uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(k::fill_random_bf16(kv_cache_, static_cast<int64_t>(kv_cache_elements()), seed, 1.f, 0.f, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::pair<double, double> Engine::time_decode(int n, const std::vector<int32_t>& positions, int iters,
                                              float temperature, uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    if (n < 1 || n > streams_ || static_cast<int>(positions.size()) != n || iters < 1) {
        throw std::invalid_argument("time_decode: need 1.." + std::to_string(streams_) + " streams, one position each");
    }
    for (int32_t p : positions) {
        if (p < 0 || p + iters + 1 >= max_context_) {
            throw std::invalid_argument("time_decode: position " + std::to_string(p) + " + iters leaves max_context");
        }
    }
    set_sampling(temperature, seed);
    const std::vector<int32_t> ids = probe_ids(n, dims_.vocab);
    set_decode_state(ids, positions, n);
    const int32_t zero = 0;
    CUDA_CHECK(cudaMemcpyAsync(step_, &zero, 4, cudaMemcpyHostToDevice, stream_));
    // Replays reach kv_len p + iters at most (the warm-up replay is undone by the second set_decode_state).
    Graph& g = decode_graph(n, attention_span(positions, iters));
    CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));  // warm-up
    set_decode_state(ids, positions, n);
    CUDA_CHECK(cudaMemcpyAsync(step_, &zero, 4, cudaMemcpyHostToDevice, stream_));
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaEventRecord(start, stream_));
    double host = 0.0;
    const int done = std::min(iters, max_steps_ - 1);
    for (int i = 0; i < done; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
        host += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    CUDA_CHECK(cudaEventRecord(stop, stream_));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return {ms * 1e-3 / done, host / done};
}

StepProfile Engine::profile_step(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                                 uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    if (n < 1 || n > streams_ || static_cast<int>(positions.size()) != n || iters < 1) {
        throw std::invalid_argument("profile_step: need 1.." + std::to_string(streams_) + " streams, one position each");
    }
    std::vector<int32_t> streams(n);
    const std::vector<int32_t> ids = probe_ids(n, dims_.vocab);
    std::iota(streams.begin(), streams.end(), 0);
    check_rows(streams, positions);
    std::map<std::string, double> seconds;
    set_sampling(temperature, seed);
    set_decode_state(ids, positions, n);  // an eager step leaves the rows as they are
    const int span = attention_span(positions, 1);
    for (int i = 0; i <= iters; ++i) {
        Timeline timeline(stream_);
        CUDA_CHECK(cudaLaunchHostFunc(stream_, hold_stream, nullptr));
        forward(decode_rows_, n, n, span, &timeline, false);
        timeline.op("sample", [&] { sample(decode_rows_, n); });
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        if (i > 0) timeline.accumulate(seconds);  // the first pass warms up
    }
    StepProfile out;
    for (auto& [name, sec] : seconds) out.emplace_back(name, sec / iters);
    return out;
}

}  // namespace ddtree
