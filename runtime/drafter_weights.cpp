#include "drafter_weights.h"

#include <stdexcept>

#include "cuda_check.h"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

std::string layer_name(int layer, const char* rest) { return "layers." + std::to_string(layer) + "." + rest; }

}  // namespace

DrafterWeights::DrafterWeights(const DrafterDims& d, const k::bf16* embed_table, const k::bf16* lm_head_table,
                               DeviceArena& arena, cudaStream_t stream)
    : embed(embed_table), lm_head(lm_head_table), layers(d.layers), dims_(d), stream_(stream),
      slots_(d.layers, "this drafter") {
    const size_t h = d.hidden;
    auto take = [&](size_t count) { return arena.take<k::bf16>(count); };
    using Kind = WeightSlots::Kind;
    auto add = [&](const std::string& name, k::bf16* dst, size_t bytes, Kind kind = Kind::kPlain, int layer = -1) {
        if (!arena.counting()) slots_.add(name, dst, bytes, kind, layer);
    };
    fc = take(h * d.context_width());
    hidden_norm = take(h);
    final_norm = take(h);
    add("fc.weight", fc, h * d.context_width() * 2);
    add("hidden_norm.weight", hidden_norm, h * 2);
    add("norm.weight", final_norm, h * 2);
    if (d.own_lm_head) {
        owned_lm_head = take(d.vocab * h);
        lm_head = owned_lm_head;
        add("lm_head.weight", owned_lm_head, d.vocab * h * 2);
    }
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

void DrafterWeights::upload(const std::string& name, const void* host, size_t bytes) {
    const WeightSlots::Slot& slot = slots_.upload(name, host, bytes, stream_);
    if (slot.kind != WeightSlots::Kind::kPlain) {
        slots_.interleave_if_ready(slot.layer, layers[slot.layer].gate_up, dims_.inter, dims_.hidden, stream_);
    }
}

void DrafterWeights::randomize(uint64_t seed) {
    const DrafterDims& d = dims_;
    uint64_t salt = seed * 0x9e3779b97f4a7c15ull;
    auto fill = [&](k::bf16* p, size_t count, int fan_in) { fill_random_weight(p, count, fan_in, salt, stream_); };
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
    if (owned_lm_head != nullptr) fill(owned_lm_head, d.vocab * h, d.hidden);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    slots_.mark_all_uploaded();
}

std::string DrafterWeights::missing() const { return slots_.missing(); }

}  // namespace ddtree
