#include "drafter_weights.h"

#include <cmath>
#include <stdexcept>

#include "cuda_check.h"
#include "fill_random.cuh"
#include "gemm.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

std::string layer_name(int layer, const char* rest) { return "layers." + std::to_string(layer) + "." + rest; }

}  // namespace

DrafterWeights::DrafterWeights(const DrafterDims& d, const k::bf16* embed_table, const k::bf16* lm_head_table,
                               DeviceArena& arena, cudaStream_t stream)
    : embed(embed_table), lm_head(lm_head_table), layers(d.layers), dims_(d), stream_(stream),
      counting_(arena.counting()), gate_stage_(d.layers), up_stage_(d.layers) {
    const size_t h = d.hidden;
    auto take = [&](size_t count) { return arena.take<k::bf16>(count); };
    fc = take(h * d.context_width());
    hidden_norm = take(h);
    final_norm = take(h);
    add("fc.weight", fc, h * d.context_width() * 2);
    add("hidden_norm.weight", hidden_norm, h * 2);
    add("norm.weight", final_norm, h * 2);
    for (int l = 0; l < d.layers; ++l) {
        DrafterLayerWeights& w = layers[l];
        w.input_norm = take(h);
        w.post_norm = take(h);
        w.qkv = take(static_cast<size_t>(d.qkv()) * h);
        w.q_norm = take(d.head_dim);
        w.k_norm = take(d.head_dim);
        w.o_proj = take(h * d.q_dim());
        w.gate_up = take(2 * h * d.inter);
        w.down = take(h * d.inter);
        add(layer_name(l, "input_layernorm.weight"), w.input_norm, h * 2);
        add(layer_name(l, "post_attention_layernorm.weight"), w.post_norm, h * 2);
        add(layer_name(l, "self_attn.q_proj.weight"), w.qkv, h * d.q_dim() * 2);
        add(layer_name(l, "self_attn.k_proj.weight"), w.qkv + h * d.q_dim(), h * d.kv_dim() * 2);
        add(layer_name(l, "self_attn.v_proj.weight"), w.qkv + h * (d.q_dim() + d.kv_dim()), h * d.kv_dim() * 2);
        add(layer_name(l, "self_attn.q_norm.weight"), w.q_norm, d.head_dim * 2);
        add(layer_name(l, "self_attn.k_norm.weight"), w.k_norm, d.head_dim * 2);
        add(layer_name(l, "self_attn.o_proj.weight"), w.o_proj, h * d.q_dim() * 2);
        add(layer_name(l, "mlp.gate_proj.weight"), w.gate_up, h * d.inter * 2, Kind::kGate, l);
        add(layer_name(l, "mlp.up_proj.weight"), w.gate_up, h * d.inter * 2, Kind::kUp, l);
        add(layer_name(l, "mlp.down_proj.weight"), w.down, h * d.inter * 2);
    }
}

DrafterWeights::~DrafterWeights() {
    for (int l = 0; l < dims_.layers; ++l) {
        cudaFree(gate_stage_[l]);
        cudaFree(up_stage_[l]);
    }
}

void DrafterWeights::add(const std::string& name, k::bf16* dst, size_t bytes, Kind kind, int layer) {
    if (!counting_) slots_.emplace(name, Slot{dst, bytes, kind, layer});
}

void DrafterWeights::upload(const std::string& name, const void* host, size_t bytes) {
    auto it = slots_.find(name);
    if (it == slots_.end()) {
        throw std::invalid_argument("tensor '" + name + "' is not a tensor of this drafter");
    }
    Slot& slot = it->second;
    if (bytes != slot.bytes) {
        throw std::invalid_argument("tensor '" + name + "' has " + std::to_string(bytes) + " bytes, expected " +
                                    std::to_string(slot.bytes));
    }
    k::bf16* dst = slot.dst;
    if (slot.kind != Kind::kPlain) {
        auto& stage = slot.kind == Kind::kGate ? gate_stage_[slot.layer] : up_stage_[slot.layer];
        if (stage == nullptr) CUDA_CHECK(cudaMalloc(&stage, bytes));
        dst = stage;
    }
    // On the drafter's stream, then waited for: a pageable copy may return before its DMA lands.
    CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    slot.uploaded = true;
    if (slot.kind != Kind::kPlain) interleave_if_ready(slot.layer);
}

void DrafterWeights::interleave_if_ready(int layer) {
    if (gate_stage_[layer] == nullptr || up_stage_[layer] == nullptr) return;
    CUDA_CHECK(k::interleave_gate_up(layers[layer].gate_up, gate_stage_[layer], up_stage_[layer], dims_.inter,
                                     dims_.hidden, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaFree(gate_stage_[layer]));
    CUDA_CHECK(cudaFree(up_stage_[layer]));
    gate_stage_[layer] = up_stage_[layer] = nullptr;
}

void DrafterWeights::randomize(uint64_t seed) {
    const DrafterDims& d = dims_;
    uint64_t salt = seed * 0x9e3779b97f4a7c15ull;
    auto fill = [&](k::bf16* p, size_t count, int fan_in) {
        // uniform with the variance of N(0, 1/fan_in); norm weights (fan_in 0) near 1
        const float scale = fan_in > 0 ? std::sqrt(3.f / fan_in) : 0.1f;
        CUDA_CHECK(k::fill_random_bf16(p, static_cast<int64_t>(count), ++salt, scale, fan_in > 0 ? 0.f : 1.f,
                                       stream_));
    };
    const size_t h = d.hidden;
    fill(fc, h * d.context_width(), d.context_width());
    fill(hidden_norm, h, 0);
    fill(final_norm, h, 0);
    for (DrafterLayerWeights& w : layers) {
        fill(w.input_norm, h, 0);
        fill(w.post_norm, h, 0);
        fill(w.qkv, h * d.qkv(), d.hidden);
        fill(w.q_norm, d.head_dim, 0);
        fill(w.k_norm, d.head_dim, 0);
        fill(w.o_proj, h * d.q_dim(), d.q_dim());
        fill(w.gate_up, 2 * h * d.inter, d.hidden);  // gate and up rows alike: no interleave needed
        fill(w.down, h * d.inter, d.inter);
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (auto& [name, slot] : slots_) slot.uploaded = true;
}

std::string DrafterWeights::missing() const {
    for (const auto& [name, slot] : slots_) {
        if (!slot.uploaded) return name;
    }
    return "";
}

}  // namespace ddtree
