#include "drafter_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "embed.cuh"
#include "gemm.cuh"
#include "gqa_attn.cuh"
#include "head_norm_rope.cuh"
#include "rmsnorm.cuh"
#include "topk.cuh"

namespace ddtree {

namespace k = ddtree::kernels;
using k::bf16;

namespace {

// Every projection the drafter runs (n, k): the block's qkv, o_proj, gate_up, down and LM head, the context's fc
// and k/v.
std::vector<std::array<int, 2>> drafter_gemms(const DrafterDims& d) {
    return {{d.qkv(), d.hidden},        {d.hidden, d.q_dim()},      {2 * d.inter, d.hidden}, {d.hidden, d.inter},
            {d.vocab, d.hidden},        {d.hidden, d.context_width()}, {2 * d.kv_dim(), d.hidden}};
}

k::GqaDims gqa_dims(const DrafterDims& d) { return {d.heads, d.kv_heads, d.head_dim, d.block}; }

// Shapes the kernels take, checked once so that a launch never fails on them.
void check_dims(const DrafterDims& d) {
    auto fail = [](const std::string& what) { throw std::invalid_argument("drafter dims: " + what); };
    if (d.hidden <= 0 || d.hidden % 8 || !k::norm_dim_supported(d.hidden)) {
        fail("hidden_size must be a positive multiple of 8 up to " + std::to_string(k::kNormMaxDim));
    }
    if (d.inter <= 0 || d.inter % 8) fail("intermediate_size must be a positive multiple of 8");
    if (d.layers <= 0 || d.taps <= 0 || d.vocab <= 0) fail("layers, taps and vocab must be positive");
    if (d.vocab > k::kTopkVocabMax) fail("vocab_size must be at most " + std::to_string(k::kTopkVocabMax));
    if (d.block < 2) fail("block_size must be at least 2");
    if (d.mask_token < 0 || d.mask_token >= d.vocab) fail("mask_token_id must be in [0, vocab_size)");
    if (!k::gqa_supported(gqa_dims(d)) || !k::head_norm_rope_supported(d.head_dim)) {
        fail("head_dim must be a multiple of 8 up to " + std::to_string(k::kGqaMaxHeadDim) +
             " and num_attention_heads a multiple of num_key_value_heads");
    }
}

}  // namespace

DrafterModel::Scratch DrafterModel::Scratch::lay_out(const DrafterDims& d, int streams, int capacity, int max_append,
                                                     DeviceArena& arena) {
    const size_t m = static_cast<size_t>(streams) * d.block, heads_rows = static_cast<size_t>(streams) * (d.block - 1);
    const size_t r = max_append;
    auto bf = [&](size_t n) { return arena.take<bf16>(n); };
    Scratch s{};
    s.x = bf(m * d.hidden);
    s.xn = bf(m * d.hidden);
    s.qkv = bf(m * d.qkv());
    s.q = bf(m * d.q_dim());
    s.block_k = bf(m * d.kv_dim());
    s.attn = bf(m * d.q_dim());
    s.delta = bf(m * d.hidden);
    s.act = bf(m * d.inter);
    s.head_in = bf(heads_rows * d.hidden);
    s.ctx = bf(r * d.hidden);
    s.ctx_normed = bf(r * d.hidden);
    s.ctx_kv = bf(r * 2 * d.kv_dim());
    s.logits = arena.take<float>(heads_rows * d.vocab);
    size_t ws = 0, counters = 0;
    for (const auto& [n, kk] : drafter_gemms(d)) {
        ws = std::max<size_t>(ws, k::gemm_workspace_floats(static_cast<int>(std::max(m, r)), n, kk, 1));
        counters = std::max<size_t>(counters, k::gemm_counter_count(n, 1));
    }
    s.gemm_ws = arena.take<float>(ws);
    s.gemm_counters = arena.take<int32_t>(counters);
    s.gemm_counter_count = counters;
    s.attn_ws = arena.take<float>(k::gqa_workspace_floats(gqa_dims(d), streams, capacity));
    s.inv_freq = arena.take<float>(d.head_dim / 2);
    return s;
}

size_t DrafterModel::planned_bytes(const DrafterDims& d, int streams, int capacity, int max_append) {
    check_dims(d);
    DeviceArena plan(DeviceArena::Mode::kCount);
    const DrafterWeights weights(d, nullptr, nullptr, plan, nullptr);
    const DraftCache cache(d, streams, capacity, plan);
    Scratch::lay_out(d, streams, capacity, max_append, plan);
    return plan.bytes();
}

DrafterModel::DrafterModel(const DrafterDims& d, const RopeTable& rope, const bf16* embed, const bf16* lm_head,
                           int streams, int capacity, int max_append, cudaStream_t stream, DeviceArena& arena)
    : dims_((check_dims(d), d)), rope_(rope), streams_(streams), max_append_(max_append), stream_(stream),
      weights_(d, embed, lm_head, arena, stream), cache_(d, streams, capacity, arena),
      s_(Scratch::lay_out(d, streams, capacity, max_append, arena)) {
    if (rope.interleave || static_cast<int>(rope.inv_freq.size()) != d.head_dim / 2) {
        throw std::invalid_argument("drafter rope: rotate-half frequencies over head_dim / 2 = " +
                                    std::to_string(d.head_dim / 2) + " pairs expected");
    }
    CUDA_CHECK(cudaMemsetAsync(s_.gemm_counters, 0, std::max<size_t>(s_.gemm_counter_count, 4) * 4, stream_));
    cache_.clear(stream_);
    CUDA_CHECK(cudaMemcpyAsync(s_.inv_freq, rope_.inv_freq.data(), rope_.inv_freq.size() * 4, cudaMemcpyHostToDevice,
                               stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DrafterModel::append(const DraftAppendRows& rows, OpTimeline* timeline) {
    const DrafterDims& d = dims_;
    if (rows.n < 0 || rows.n > max_append_) {
        throw std::invalid_argument("append of " + std::to_string(rows.n) + " rows; the drafter takes 0.." +
                                    std::to_string(max_append_));
    }
    if (rows.n == 0) return;
    const DrafterWeights& w = weights_;
    auto op = [&](const char* name, auto&& launch) { timed_op(timeline, name, launch); };
    const int n = rows.n, kv = d.kv_dim();
    const k::RopeParams rope{s_.inv_freq, rope_.attention_factor, d.head_dim, false};
    const k::RopeParams no_rope{nullptr, 1.f, d.head_dim, false};
    op("append.fc", [&] {
        CUDA_CHECK(k::gemm_bf16(rows.features, d.context_width(), w.fc, s_.ctx, d.hidden, n, d.hidden,
                                d.context_width(), k::GemmEpilogue::kBf16, {}, s_.gemm_ws, s_.gemm_counters, stream_));
    });
    op("append.norm", [&] {
        CUDA_CHECK(k::rmsnorm(s_.ctx_normed, s_.ctx, w.hidden_norm, n, d.hidden, d.rms_eps, stream_));
    });
    for (int l = 0; l < d.layers; ++l) {
        const DrafterLayerWeights& lw = w.layers[l];
        op("append.kv_proj", [&] {
            CUDA_CHECK(k::gemm_bf16(s_.ctx_normed, d.hidden, lw.qkv + static_cast<size_t>(d.q_dim()) * d.hidden,
                                    s_.ctx_kv, 2 * kv, n, 2 * kv, d.hidden, k::GemmEpilogue::kBf16, {}, s_.gemm_ws,
                                    s_.gemm_counters, stream_));
        });
        op("append.kv_store", [&] {
            CUDA_CHECK(k::head_norm_rope(cache_.keys(l), kv, rows.slots, s_.ctx_kv, 2 * kv, n, d.kv_heads, d.head_dim,
                                         lw.k_norm, d.rms_eps, rows.positions, rope, stream_));
            CUDA_CHECK(k::head_norm_rope(cache_.values(l), kv, rows.slots, s_.ctx_kv + kv, 2 * kv, n, d.kv_heads,
                                         d.head_dim, nullptr, 0.f, nullptr, no_rope, stream_));
        });
    }
}

void DrafterModel::block_forward(const DraftBlockRows& rows, OpTimeline* timeline) {
    const DrafterDims& d = dims_;
    if (rows.streams < 1 || rows.streams > streams_ || rows.span < 0 || rows.span > cache_.capacity()) {
        throw std::invalid_argument("block forward of " + std::to_string(rows.streams) + " streams with span " +
                                    std::to_string(rows.span) + "; the drafter takes 1.." + std::to_string(streams_) +
                                    " streams and spans up to " + std::to_string(cache_.capacity()));
    }
    const DrafterWeights& w = weights_;
    auto op = [&](const char* name, auto&& launch) { timed_op(timeline, name, launch); };
    auto gemm = [&](const char* name, const bf16* x, int64_t ldx, const bf16* weight, void* out, int64_t ldo, int m,
                    int n_out, int k_in, k::GemmEpilogue epi) {
        op(name, [&] {
            CUDA_CHECK(k::gemm_bf16(x, ldx, weight, out, ldo, m, n_out, k_in, epi, {}, s_.gemm_ws, s_.gemm_counters,
                                    stream_));
        });
    };
    const int m = rows.streams * d.block, head_rows = rows.streams * (d.block - 1);
    const int q_dim = d.q_dim(), kv = d.kv_dim(), qkv = d.qkv();
    const k::RopeParams rope{s_.inv_freq, rope_.attention_factor, d.head_dim, false};
    const float softmax_scale = 1.f / std::sqrt(static_cast<float>(d.head_dim));

    op("block.embed", [&] {
        CUDA_CHECK(k::gather_rows(s_.x, d.hidden, w.embed, d.hidden, rows.ids, m, d.hidden, stream_));
    });
    const bf16* pending = nullptr;  // MLP output not yet added to the residual
    for (int l = 0; l < d.layers; ++l) {
        const DrafterLayerWeights& lw = w.layers[l];
        op("block.norm", [&] {
            if (pending == nullptr) {
                CUDA_CHECK(k::rmsnorm(s_.xn, s_.x, lw.input_norm, m, d.hidden, d.rms_eps, stream_));
            } else {
                CUDA_CHECK(k::add_rmsnorm(s_.xn, s_.x, pending, nullptr, lw.input_norm, m, d.hidden, d.rms_eps,
                                          stream_));
            }
        });
        gemm("block.qkv", s_.xn, d.hidden, lw.qkv, s_.qkv, qkv, m, qkv, d.hidden, k::GemmEpilogue::kBf16);
        op("block.qk_norm_rope", [&] {
            CUDA_CHECK(k::head_norm_rope(s_.q, q_dim, nullptr, s_.qkv, qkv, m, d.heads, d.head_dim, lw.q_norm,
                                         d.rms_eps, rows.positions, rope, stream_));
            CUDA_CHECK(k::head_norm_rope(s_.block_k, kv, nullptr, s_.qkv + q_dim, qkv, m, d.kv_heads, d.head_dim,
                                         lw.k_norm, d.rms_eps, rows.positions, rope, stream_));
        });
        op("block.attention", [&] {
            const k::GqaKeys keys{cache_.keys(l), cache_.values(l), cache_.capacity(), rows.cache_streams, rows.starts,
                                  s_.block_k,     kv,               s_.qkv + q_dim + kv, qkv};
            CUDA_CHECK(k::gqa_attention(s_.attn, s_.q, keys, rows.streams, rows.span, gqa_dims(d), softmax_scale,
                                        s_.attn_ws, stream_));
        });
        gemm("block.o_proj", s_.attn, q_dim, lw.o_proj, s_.delta, d.hidden, m, d.hidden, q_dim, k::GemmEpilogue::kBf16);
        op("block.norm", [&] {
            CUDA_CHECK(k::add_rmsnorm(s_.xn, s_.x, s_.delta, nullptr, lw.post_norm, m, d.hidden, d.rms_eps, stream_));
        });
        gemm("block.gate_up", s_.xn, d.hidden, lw.gate_up, s_.act, d.inter, m, 2 * d.inter, d.hidden,
             k::GemmEpilogue::kSiluMul);
        gemm("block.down", s_.act, d.inter, lw.down, s_.delta, d.hidden, m, d.hidden, d.inter, k::GemmEpilogue::kBf16);
        pending = s_.delta;
    }
    op("block.norm", [&] {
        CUDA_CHECK(k::add_rmsnorm(s_.xn, s_.x, pending, nullptr, w.final_norm, m, d.hidden, d.rms_eps, stream_));
    });
    op("lm_head.gather", [&] {
        CUDA_CHECK(k::gather_rows(s_.head_in, d.hidden, s_.xn, d.hidden, rows.head_rows, head_rows, d.hidden, stream_));
    });
    gemm("lm_head", s_.head_in, d.hidden, w.lm_head, s_.logits, d.vocab, head_rows, d.vocab, d.hidden,
         k::GemmEpilogue::kF32);
}

void DrafterModel::top_k(int streams, int k_out, float* log_probs, int32_t* ids, OpTimeline* timeline) {
    const DrafterDims& d = dims_;
    if (streams < 1 || streams > streams_ || k_out < 1 || k_out > std::min(d.vocab, k::kTopkMax)) {
        throw std::invalid_argument("top_k of " + std::to_string(streams) + " streams at k = " +
                                    std::to_string(k_out) + "; the drafter takes 1.." + std::to_string(streams_) +
                                    " streams and k in 1.." + std::to_string(std::min(d.vocab, k::kTopkMax)));
    }
    timed_op(timeline, "top_k", [&] {
        CUDA_CHECK(k::topk_log_softmax(log_probs, ids, s_.logits, d.vocab, streams * (d.block - 1), d.vocab, k_out,
                                       stream_));
    });
}

}  // namespace ddtree
