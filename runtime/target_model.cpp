#include "target_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "collective_timing.h"
#include "cuda_check.h"
#include "embed.cuh"
#include "gemm.cuh"
#include "mla_attn.cuh"
#include "rmsnorm.cuh"
#include "forked_stream.h"
#include "rank_simulation.h"
#include "rope.cuh"
#include "router.cuh"
#include "sample.cuh"

namespace ddtree {

namespace k = ddtree::kernels;
using k::bf16;

namespace {

using GemmShape = std::array<int, 3>;  // n, k, batch

// The projections of the main stream, and the shared expert's, which runs beside the routed experts on the side
// stream with scratch of its own (split-K partials and counters must not be shared by concurrent GEMMs).
// A split target's GEMMs are its rank's shares (model_dims.h); a whole model's rank is the whole.
std::vector<GemmShape> main_gemms(const ModelDims& d) {
    const int heads = d.rank_heads(), inter = d.rank_inter();
    return {{d.qkv_a(), d.hidden, 1},  {heads * d.qk(), d.q_lora, 1}, {d.kv_lora, d.nope, heads},
            {d.v, d.kv_lora, heads},   {d.hidden, heads * d.v, 1},    {2 * inter, d.hidden, 1},
            {d.hidden, inter, 1},      {d.experts, d.hidden, 1},      {d.rank_vocab(), d.hidden, 1}};
}
std::vector<GemmShape> shared_expert_gemms(const ModelDims& d) {
    return {{2 * d.rank_shared_inter(), d.hidden, 1}, {d.hidden, d.rank_shared_inter(), 1}};
}

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

TargetModel::Scratch TargetModel::Scratch::lay_out(const ModelDims& d, int max_rows, int max_len, int streams,
                                                  DeviceArena& arena) {
    const size_t r = max_rows;
    auto bf = [&](size_t n) { return arena.take<bf16>(n); };
    auto f32 = [&](size_t n) { return arena.take<float>(n); };
    auto i32 = [&](size_t n) { return arena.take<int32_t>(n); };
    Scratch s{};
    s.x = bf(r * d.hidden);
    s.xn = bf(r * d.hidden);
    s.qkv = bf(r * d.qkv_a());
    s.qn = bf(r * d.q_lora);
    s.q = bf(r * d.heads * d.qk());
    s.q_abs = bf(r * d.heads * d.latent_row());
    s.o_lat = bf(r * d.heads * d.kv_lora);
    s.v_out = bf(r * d.heads * d.v);
    s.delta = bf(r * d.hidden);
    s.delta2 = bf(r * d.hidden);
    s.act = bf(r * std::max(d.inter, d.shared_inter));
    // Scratch of the plain INT4 expert path; the fused MoE layers have their own workspace.
    s.expert_act = Weights::marlin_supported(d) ? nullptr : bf(r * d.topk * d.moe_inter);
    s.hsel = bf(r * d.hidden);
    s.router_logits = f32(r * d.experts);
    s.topk_weights = f32(r * d.topk);
    s.logits = f32(r * d.vocab);
    s.topk_ids = i32(r * d.topk);
    s.local_ids = i32(r * d.topk);
    s.routing = i32(static_cast<size_t>(d.moe_layers()) * r * d.topk);
    s.tokens = i32(r);
    s.nonfinite_at = i32(streams);
    s.temperature = f32(1);
    s.seed = arena.take<unsigned long long>(1);
    const auto [ws, counters] = gemm_scratch(main_gemms(d), static_cast<int>(r));
    s.gemm_ws = f32(ws);
    s.gemm_counters = i32(counters);
    s.gemm_counter_count = counters;
    const auto [shared_ws, shared_counters] = gemm_scratch(shared_expert_gemms(d), static_cast<int>(r));
    s.shared_gemm_ws = f32(shared_ws);
    s.shared_gemm_counters = i32(shared_counters);
    s.shared_gemm_counter_count = shared_counters;
    s.attn_ws = f32(k::mla_workspace_floats({d.heads, d.kv_lora, d.rope}, static_cast<int>(r), max_len));
    s.rope = f32(d.rope / 2);
    return s;
}

TargetModel::TargetModel(const ModelDims& dims, const RopeTable& rope, const LatentCache& cache, int max_rows,
                         int device, DeviceArena& arena, const std::vector<int>& held, const NcclRank* nccl)
    : dims_(dims), rope_(rope), cache_(cache), max_rows_(max_rows), held_(held) {
    try {
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&side_event_, cudaEventDisableTiming));
        for (int rank : held_) weights_.push_back(std::make_unique<Weights>(dims.for_rank(rank), device, max_rows,
                                                                            stream_));
        if (dims.sharded() && nccl != nullptr) {
            collectives_ = std::make_unique<NcclCollectives>(*nccl, max_rows, dims.hidden, arena);
        } else if (dims.sharded()) {
            collectives_ = std::make_unique<RankSimulation>(dims.shard.ranks, held_, max_rows, dims.hidden, arena);
        }
        s_ = Scratch::lay_out(dims, max_rows, cache.stream_rows(), cache.streams(), arena);
        CUDA_CHECK(cudaMemsetAsync(s_.gemm_counters, 0, std::max<size_t>(s_.gemm_counter_count, 4) * 4, stream_));
        CUDA_CHECK(cudaMemsetAsync(s_.shared_gemm_counters, 0, std::max<size_t>(s_.shared_gemm_counter_count, 4) * 4,
                                   stream_));
        // On the model's stream, like every upload: a pageable cudaMemcpy may return before its DMA lands.
        CUDA_CHECK(cudaMemcpyAsync(s_.rope, rope_.inv_freq.data(), rope_.inv_freq.size() * 4,
                                   cudaMemcpyHostToDevice, stream_));
        CUDA_CHECK(cudaStreamSynchronize(stream_));
    } catch (...) {
        weights_.clear();
        if (side_event_ != nullptr) cudaEventDestroy(side_event_);
        if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
        if (stream_ != nullptr) cudaStreamDestroy(stream_);
        throw;
    }
}

TargetModel::~TargetModel() {
    weights_.clear();
    cudaEventDestroy(side_event_);
    cudaStreamDestroy(side_stream_);
    cudaStreamDestroy(stream_);
}

void TargetModel::tap(const ForwardOutputs& outputs, int layer, OpTimeline* timeline) {
    const auto found = std::find(outputs.tap_layers.begin(), outputs.tap_layers.end(), layer);
    if (found == outputs.tap_layers.end() || outputs.n_tap_rows == 0) return;
    const int64_t width = static_cast<int64_t>(outputs.tap_layers.size()) * dims_.hidden;
    const int64_t column = (found - outputs.tap_layers.begin()) * static_cast<int64_t>(dims_.hidden);
    timed_op(timeline, "tap", [&] {
        CUDA_CHECK(k::gather_rows(outputs.taps + column, width, s_.x, dims_.hidden, outputs.tap_rows,
                                  outputs.n_tap_rows, dims_.hidden, stream_));
    });
}

Weights& TargetModel::weights(int rank) {
    for (size_t i = 0; i < held_.size(); ++i) {
        if (held_[i] == rank) return *weights_[i];
    }
    throw std::invalid_argument("rank " + std::to_string(rank) + " is not held by this engine");
}

void TargetModel::routed_experts(int i, int l, const int32_t* ids, bf16* out, int n) {
    const ModelDims& d = dims_;
    const LayerWeights& lw = weights_[i]->layers[l];
    if (lw.marlin) {
        lw.marlin->forward(s_.xn, ids, s_.topk_weights, nullptr, out, n, stream_);
    } else {
        CUDA_CHECK(k::experts_int4_forward(out, s_.expert_act, s_.xn, ids, s_.topk_weights, n, d.topk,
                                           d.routed_scaling_factor, lw.plain, stream_));
    }
}

void TargetModel::forward(const RowBatch& rows, int n, int n_logits, int span, const ForwardOutputs& outputs,
                          OpTimeline* timeline) {
    const ModelDims& d = dims_;
    const Weights& w = *weights_.front();  // the replicated tensors: every held rank has the same
    const bool split = d.sharded();
    const int heads = d.rank_heads();
    cudaStream_t s = stream_;
    auto op = [&](const char* name, auto&& launch) { timed_op(timeline, name, launch); };
    // A stream with the split-K scratch of the GEMMs it runs: concurrent GEMMs must not share scratch.
    struct Lane {
        cudaStream_t stream;
        float* ws;
        int32_t* counters;
    };
    const Lane main_lane{s, s_.gemm_ws, s_.gemm_counters};
    // The shared expert needs only the normed input, so outside a timeline (whose per-op times need one op at a
    // time) it runs on the side stream beside the router and the routed experts: its weight stream hides their
    // latency-bound kernels. Its scratch is its own either way (the main scratch is sized for the main GEMMs).
    const bool concurrent = timeline == nullptr;
    const Lane shared_lane{concurrent ? side_stream_ : s, s_.shared_gemm_ws, s_.shared_gemm_counters};
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
    // Rank-order sum of the held ranks' partials of `terms` x [n, hidden] into delta (collectives.h).
    auto sum_partials = [&](int terms) {
        op("sum_partials", [&] { collectives_->sum_partials(terms, n, d.hidden, s_.delta, s); });
    };
    auto partial = [&](int i, int terms) {
        return collectives_->partial_slot(held_[i], static_cast<size_t>(terms) * n * d.hidden);
    };
    const k::RopeParams rope{s_.rope, rope_.attention_factor, d.rope, rope_.interleave};
    const k::MlaDims mla{heads, d.kv_lora, d.rope};
    const k::MlaTreeKeys tree_keys{rows.key_start, rows.key_nodes, rows.key_stride};

    op("embed", [&] { CUDA_CHECK(k::gather_rows(s_.x, d.hidden, w.embed, d.hidden, rows.ids, n, d.hidden, s)); });
    const bf16* pending = nullptr;   // MLP output not yet added to the residual
    const bf16* pending2 = nullptr;  // routed-expert output, added in the same fp32 sum
    for (int l = 0; l < d.layers; ++l) {
        const LayerWeights& lw = w.layers[l];
        bf16* cache = cache_.layer(l);
        op("norm", [&] {
            if (pending == nullptr) {
                CUDA_CHECK(k::rmsnorm(s_.xn, s_.x, lw.input_norm, n, d.hidden, d.rms_eps, s));
            } else {
                CUDA_CHECK(k::add_rmsnorm(s_.xn, s_.x, pending, pending2, lw.input_norm, n, d.hidden, d.rms_eps, s));
            }
        });
        if (l > 0) tap(outputs, l - 1, timeline);  // x now holds the residual after layer l - 1
        gemm("q_a+kv_a", s_.xn, d.hidden, lw.qkv_a, s_.qkv, d.qkv_a(), n, d.qkv_a(), d.hidden, k::GemmEpilogue::kBf16);
        op("norm", [&] {
            CUDA_CHECK(k::rmsnorm_strided(s_.qn, d.q_lora, s_.qkv, d.qkv_a(), lw.q_a_norm, n, d.q_lora, d.lora_eps, s));
        });
        op("kv_store", [&] {
            CUDA_CHECK(k::mla_store_kv(cache, rows.slots, s_.qkv + d.q_lora, d.qkv_a(), lw.kv_a_norm, d.lora_eps,
                                       d.kv_lora, rows.positions, n, rope, s));
        });
        // Each held rank's heads, their o_proj output into `out` (a partial sum when split).
        auto attend = [&](const LayerWeights& hw, bf16* out) {
            gemm("q_b", s_.qn, d.q_lora, hw.q_b, s_.q, heads * d.qk(), n, heads * d.qk(), d.q_lora,
                 k::GemmEpilogue::kBf16);
            gemm("kv_b_absorb_k", s_.q, heads * d.qk(), hw.w_uk_t, s_.q_abs, heads * d.latent_row(), n, d.kv_lora,
                 d.nope, k::GemmEpilogue::kBf16,
                 {heads, d.qk(), static_cast<int64_t>(d.kv_lora) * d.nope, d.latent_row()});
            op("rope_q", [&] {
                CUDA_CHECK(k::rope_queries(s_.q_abs, heads * d.latent_row(), d.latent_row(), d.kv_lora, s_.q,
                                           heads * d.qk(), d.qk(), d.nope, rows.positions, n, heads, rope, s));
            });
            op("attention", [&] {
                CUDA_CHECK(k::mla_attention(s_.o_lat, s_.q_abs, cache, cache_.layer_rows(), rows.kv_start,
                                            rows.kv_len, n, span, mla, d.softmax_scale, s_.attn_ws, s, tree_keys));
            });
            gemm("kv_b_absorb_v", s_.o_lat, heads * d.kv_lora, hw.kv_b + static_cast<size_t>(d.nope) * d.kv_lora,
                 s_.v_out, heads * d.v, n, d.v, d.kv_lora, k::GemmEpilogue::kBf16,
                 {heads, d.kv_lora, static_cast<int64_t>(d.nope + d.v) * d.kv_lora, d.v});
            gemm("o_proj", s_.v_out, heads * d.v, hw.o_proj, out, d.hidden, n, d.hidden, heads * d.v,
                 k::GemmEpilogue::kBf16);
        };
        if (split) {
            for (size_t i = 0; i < held_.size(); ++i) attend(weights_[i]->layers[l], partial(i, 1));
            sum_partials(1);
        } else {
            attend(lw, s_.delta);
        }
        op("norm", [&] {
            CUDA_CHECK(k::add_rmsnorm(s_.xn, s_.x, s_.delta, nullptr, lw.post_norm, n, d.hidden, d.rms_eps, s));
        });
        if (!d.is_moe(l)) {
            const int inter = d.rank_inter();
            auto dense = [&](const LayerWeights& mw, bf16* out) {
                gemm("mlp_gate_up", s_.xn, d.hidden, mw.gate_up, s_.act, inter, n, 2 * inter, d.hidden,
                     k::GemmEpilogue::kSiluMul);
                gemm("mlp_down", s_.act, inter, mw.down, out, d.hidden, n, d.hidden, inter, k::GemmEpilogue::kBf16);
            };
            if (split) {
                for (size_t i = 0; i < held_.size(); ++i) dense(weights_[i]->layers[l], partial(i, 1));
                sum_partials(1);
            } else {
                dense(lw, s_.delta);
            }
            pending = s_.delta;
            pending2 = nullptr;
            continue;
        }
        const int shared_inter = d.rank_shared_inter();
        // The router (replicated) once; then per held rank its shared expert's columns beside its routed experts.
        ForkedStream router_fork(concurrent && !split, s, side_stream_, side_event_);  // after the norm
        // The router launches first: its CTAs take the SMs before the shared expert's, which fill the gaps after.
        gemm("router", s_.xn, d.hidden, lw.router, s_.router_logits, d.experts, n, d.experts, d.hidden,
             k::GemmEpilogue::kF32);
        auto shared_expert = [&](const LayerWeights& mw, bf16* out) {
            gemm_on(shared_lane, "shared_gate_up", s_.xn, d.hidden, mw.gate_up, s_.act, shared_inter, n,
                    2 * shared_inter, d.hidden, k::GemmEpilogue::kSiluMul);
            gemm_on(shared_lane, "shared_down", s_.act, shared_inter, mw.down, out, d.hidden, n, d.hidden,
                    shared_inter, k::GemmEpilogue::kBf16);
        };
        if (!split) shared_expert(lw, s_.delta);
        op("router", [&] {
            CUDA_CHECK(k::route_topk(s_.topk_ids, s_.topk_weights, s_.router_logits, lw.router_bias, n, d.experts,
                                     d.topk, d.norm_topk_prob, s));
        });
        if (outputs.capture_routing) {
            const size_t ids = static_cast<size_t>(n) * d.topk;
            CUDA_CHECK(cudaMemcpyAsync(s_.routing + (l - d.first_dense) * ids, s_.topk_ids, ids * sizeof(int32_t),
                                       cudaMemcpyDeviceToDevice, s));
        }
        if (!split) {
            op("routed_experts", [&] { routed_experts(0, l, s_.topk_ids, s_.delta2, n); });
            router_fork.join();  // delta is read by the next norm, and a capture must end with every stream joined
            pending = s_.delta;
            pending2 = s_.delta2;
            continue;
        }
        for (size_t i = 0; i < held_.size(); ++i) {
            bf16* terms = partial(i, 2);  // [shared expert, routed experts] of this rank
            ForkedStream fork(concurrent, s, side_stream_, side_event_);
            shared_expert(weights_[i]->layers[l], terms);
            const ModelDims rank_dims = d.for_rank(held_[i]);
            op("localize_ids", [&] {
                CUDA_CHECK(k::localize_expert_ids(s_.local_ids, s_.topk_ids, n * d.topk, rank_dims.first_expert(),
                                                  d.rank_experts(), s));
            });
            op("routed_experts", [&] {
                routed_experts(static_cast<int>(i), l, s_.local_ids, terms + static_cast<size_t>(n) * d.hidden, n);
            });
            fork.join();
        }
        sum_partials(2);
        pending = s_.delta;
        pending2 = nullptr;
    }
    op("norm", [&] {
        CUDA_CHECK(k::add_rmsnorm(s_.xn, s_.x, pending, pending2, w.final_norm, n, d.hidden, d.rms_eps, s));
    });
    tap(outputs, d.layers - 1, timeline);
    // Logit rows are increasing, so n_logits == n means every row in order (decode): the LM head reads xn as it is.
    const bf16* head_in = s_.xn;
    if (n_logits < n) {
        op("gather", [&] {
            CUDA_CHECK(k::gather_rows(s_.hsel, d.hidden, s_.xn, d.hidden, rows.logit_rows, n_logits, d.hidden, s));
        });
        head_in = s_.hsel;
    }
    for (size_t i = 0; i < held_.size(); ++i) {  // each held rank's vocabulary slice, in place in the rows
        gemm("lm_head", head_in, d.hidden, weights_[i]->lm_head, s_.logits + d.for_rank(held_[i]).first_token(),
             d.vocab, n_logits, d.rank_vocab(), d.hidden, k::GemmEpilogue::kF32);
    }
}

void TargetModel::sample(const RowBatch& rows, int n_logits) {
    const ModelDims& d = dims_;
    if (!d.sharded()) {
        CUDA_CHECK(k::sample_tokens(s_.tokens, s_.nonfinite_at, s_.logits, d.vocab, n_logits, d.vocab,
                                    s_.temperature, s_.seed, rows.logit_stream_ids, rows.logit_positions, stream_));
        return;
    }
    for (int rank : held_) {  // each held rank's best over its slice, then the pick across every rank's
        const int first = d.for_rank(rank).first_token();
        CUDA_CHECK(k::sample_candidates(collectives_->candidate_slot(rank, n_logits), s_.nonfinite_at,
                                        s_.logits + first, d.vocab, n_logits, d.rank_vocab(), first, s_.temperature,
                                        s_.seed, rows.logit_stream_ids, rows.logit_positions, stream_));
    }
    collectives_->pick(n_logits, s_.tokens, stream_);
}

double TargetModel::time_collectives(int rows, int iters) {
    if (!collectives_) throw std::invalid_argument("time_collectives: the target is not split over ranks");
    if (dynamic_cast<NcclCollectives*>(collectives_.get()) != nullptr) {  // its peers would never join the replays
        throw std::invalid_argument("time_collectives: a rank with real peers cannot time its collectives alone");
    }
    if (rows < 1 || rows > max_rows_ || iters < 1) {
        throw std::invalid_argument("time_collectives: rows " + std::to_string(rows) + " (1.." +
                                    std::to_string(max_rows_) + "), iters " + std::to_string(iters) + " (>= 1)");
    }
    return time_forward_collectives(*collectives_, dims_, rows, s_.delta, s_.tokens, stream_, iters);
}

void TargetModel::clear_nonfinite() {
    static_assert(k::kAllLogitsFinite == 0x7f7f7f7f);
    CUDA_CHECK(cudaMemsetAsync(s_.nonfinite_at, 0x7f, static_cast<size_t>(cache_.streams()) * 4, stream_));
}

void TargetModel::check_finite(int streams) const {
    std::vector<int32_t> at(streams);
    CUDA_CHECK(cudaMemcpyAsync(at.data(), s_.nonfinite_at, static_cast<size_t>(streams) * 4, cudaMemcpyDeviceToHost,
                               stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (int i = 0; i < streams; ++i) {
        if (at[i] != k::kAllLogitsFinite) {
            throw NonFiniteLogits("stream " + std::to_string(i) + ": the target's logits at position " +
                                  std::to_string(at[i]) +
                                  " hold a NaN or an infinity: its weights or config.json give non-finite values");
        }
    }
}

void TargetModel::set_sampling(float temperature, uint64_t seed) {
    if (!(temperature >= 0.f) || std::isinf(temperature)) {
        throw std::invalid_argument("temperature must be finite and >= 0, got " + std::to_string(temperature));
    }
    CUDA_CHECK(cudaMemcpyAsync(s_.temperature, &temperature, 4, cudaMemcpyHostToDevice, stream_));
    const unsigned long long seed_value = seed;
    CUDA_CHECK(cudaMemcpyAsync(s_.seed, &seed_value, 8, cudaMemcpyHostToDevice, stream_));
}

}  // namespace ddtree
