#include "engine_weights.h"

#include <stdexcept>

#include "cuda_check.h"
#include "fill_random.cuh"
#include "gemm.cuh"
#include "moe_marlin.cuh"
#include "moe_repack.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

using Kind = WeightSlots::Kind;

namespace {

std::string layer_name(int layer, const char* rest) { return "model.layers." + std::to_string(layer) + "." + rest; }

}  // namespace

Weights::ExpertProjectionBytes Weights::expert_projection_bytes(const ModelDims& d) {
    const size_t weights = static_cast<size_t>(d.moe_inter) * d.hidden;  // gate/up [inter, hidden], down [hidden, inter]
    return {weights / 2, weights / 32 * 2};
}

bool Weights::marlin_supported(const ModelDims& d) {
    return k::moe::layer_supported(d.hidden, d.moe_inter, d.rank_experts(), d.topk);
}

size_t Weights::planned_bytes(const ModelDims& d, int max_tokens) {
    const Weights plan(d, max_tokens);
    return plan.arena_.bytes();
}

Weights::Weights(const ModelDims& d, int device, int max_tokens, cudaStream_t stream)
    : layers(d.layers), dims_(d), device_(device), stream_(stream), arena_(DeviceArena::Mode::kAllocate),
      slots_(d.layers, "this model (or an expert tensor)") {
    lay_out(max_tokens);
}

Weights::Weights(const ModelDims& d, int max_tokens)
    : layers(d.layers), dims_(d), device_(-1), stream_(nullptr), arena_(DeviceArena::Mode::kCount),
      slots_(d.layers, "this model (or an expert tensor)") {
    lay_out(max_tokens);
}

void Weights::lay_out(int max_tokens) {
    const ModelDims& d = dims_;
    const size_t h = d.hidden;
    auto alloc_bf16 = [&](size_t count) { return arena_.take<k::bf16>(count); };
    auto alloc_bytes = [&](size_t bytes) { return arena_.take_bytes(bytes); };
    const size_t heads = d.rank_heads();
    embed = alloc_bf16(d.vocab * h);
    final_norm = alloc_bf16(h);
    lm_head = alloc_bf16(d.rank_vocab() * h);
    add("model.embed_tokens.weight", embed, d.vocab * h * 2);
    add("model.norm.weight", final_norm, h * 2);
    add("lm_head.weight", lm_head, d.rank_vocab() * h * 2);
    std::shared_ptr<const MoeWorkspace> moe_workspace;  // one for every fused MoE layer (they run in turn)
    for (int l = 0; l < d.layers; ++l) {
        LayerWeights& w = layers[l];
        w.input_norm = alloc_bf16(h);
        w.post_norm = alloc_bf16(h);
        w.qkv_a = alloc_bf16(static_cast<size_t>(d.qkv_a()) * h);
        w.q_a_norm = alloc_bf16(d.q_lora);
        w.kv_a_norm = alloc_bf16(d.kv_lora);
        w.q_b = alloc_bf16(heads * d.qk() * d.q_lora);
        w.kv_b = alloc_bf16(heads * (d.nope + d.v) * d.kv_lora);
        w.w_uk_t = alloc_bf16(heads * d.kv_lora * d.nope);
        w.o_proj = alloc_bf16(h * heads * d.v);
        add(layer_name(l, "input_layernorm.weight"), w.input_norm, h * 2);
        add(layer_name(l, "post_attention_layernorm.weight"), w.post_norm, h * 2);
        add(layer_name(l, "self_attn.q_a_proj.weight"), w.qkv_a, d.q_lora * h * 2);
        add(layer_name(l, "self_attn.kv_a_proj_with_mqa.weight"), w.qkv_a + d.q_lora * h,
            (d.kv_lora + d.rope) * h * 2);
        add(layer_name(l, "self_attn.q_a_layernorm.weight"), w.q_a_norm, d.q_lora * 2);
        add(layer_name(l, "self_attn.kv_a_layernorm.weight"), w.kv_a_norm, d.kv_lora * 2);
        add(layer_name(l, "self_attn.q_b_proj.weight"), w.q_b, heads * d.qk() * d.q_lora * 2);
        add(layer_name(l, "self_attn.kv_b_proj.weight"), w.kv_b, heads * (d.nope + d.v) * d.kv_lora * 2,
            Kind::kDerived, l);
        add(layer_name(l, "self_attn.o_proj.weight"), w.o_proj, h * heads * d.v * 2);
        const bool moe = d.is_moe(l);
        const size_t mlp = moe ? d.rank_shared_inter() : d.rank_inter();
        const std::string prefix = moe ? "mlp.shared_experts." : "mlp.";
        w.gate_up = alloc_bf16(2 * mlp * h);
        w.down = alloc_bf16(mlp * h);
        add(layer_name(l, (prefix + "gate_proj.weight").c_str()), w.gate_up, mlp * h * 2, Kind::kGate, l);
        add(layer_name(l, (prefix + "up_proj.weight").c_str()), w.gate_up, mlp * h * 2, Kind::kUp, l);
        add(layer_name(l, (prefix + "down_proj.weight").c_str()), w.down, mlp * h * 2);
        if (!moe) {
            continue;
        }
        w.router = alloc_bf16(static_cast<size_t>(d.experts) * h);
        w.router_bias = static_cast<float*>(alloc_bytes(d.experts * sizeof(float)));
        add(layer_name(l, "mlp.gate.weight"), w.router, d.experts * h * 2);
        add(layer_name(l, "mlp.gate.e_score_correction_bias"), w.router_bias, d.experts * 4);
        w.expert_uploaded.assign(d.rank_experts(), false);
        experts_missing_ += d.rank_experts();
        if (marlin_supported(d)) {
            const MoeLayerShape shape{d.rank_experts(), d.hidden, d.moe_inter, d.topk, max_tokens,
                                      d.routed_scaling_factor};
            if (arena_.counting()) {  // the first MoE layer's workspace is every layer's
                arena_.count(MoeLayer::weight_bytes(shape) + (l == d.first_dense ? MoeWorkspace::bytes(shape) : 0));
            } else {
                if (moe_workspace == nullptr) moe_workspace = std::make_shared<const MoeWorkspace>(shape, device_);
                w.marlin = std::make_unique<MoeLayer>(shape, device_, moe_workspace);
            }
        } else {
            const ExpertProjectionBytes one = expert_projection_bytes(d);
            const size_t packed = one.packed * d.rank_experts(), scales = one.scales * d.rank_experts();
            auto scale_buffer = [&] { return static_cast<k::bf16*>(alloc_bytes(scales)); };
            w.plain = k::Int4Experts{static_cast<int32_t*>(alloc_bytes(packed)), scale_buffer(),
                                     static_cast<int32_t*>(alloc_bytes(packed)), scale_buffer(),
                                     static_cast<int32_t*>(alloc_bytes(packed)), scale_buffer(),
                                     d.hidden, d.moe_inter};
        }
    }
}

Weights::~Weights() {
    if (arena_.counting()) return;
    cudaFree(expert_stage_);
}

void Weights::add(const std::string& name, void* dst, size_t bytes, WeightSlots::Kind kind, int layer) {
    if (!arena_.counting()) slots_.add(name, dst, bytes, kind, layer);
}

void Weights::upload(const std::string& name, const void* host, size_t bytes) {
    CUDA_CHECK(cudaSetDevice(device_));
    // Every copy and kernel of an upload runs on the engine's stream: a plain cudaMemcpy from pageable memory
    // may return before its DMA lands, and the non-blocking stream would not wait for it (seen as weights that
    // differed between engines built from the same checkpoint).
    const WeightSlots::Slot& slot = slots_.upload(name, host, bytes, stream_);
    if (slot.kind == Kind::kDerived) {
        derive_w_uk_t(slot.layer);
    } else if (slot.kind != Kind::kPlain) {
        slots_.interleave_if_ready(slot.layer, layers[slot.layer].gate_up,
                                   dims_.is_moe(slot.layer) ? dims_.rank_shared_inter() : dims_.rank_inter(),
                                   dims_.hidden, stream_);
    }
}

// W_UK^T of every head (the absorbed-k GEMM's weights) from kv_b: head h's W_UK is rows [h*(nope+v), +nope).
void Weights::derive_w_uk_t(int layer) {
    const ModelDims& d = dims_;
    LayerWeights& w = layers[layer];
    for (int h = 0; h < d.rank_heads(); ++h) {
        CUDA_CHECK(k::transpose_bf16(w.w_uk_t + static_cast<size_t>(h) * d.kv_lora * d.nope,
                                     w.kv_b + static_cast<size_t>(h) * (d.nope + d.v) * d.kv_lora, 1, d.nope,
                                     d.kv_lora, stream_));
    }
}

void Weights::upload_expert(int layer, int expert, const int32_t* gate_packed, const uint16_t* gate_scale,
                            const int32_t* up_packed, const uint16_t* up_scale, const int32_t* down_packed,
                            const uint16_t* down_scale) {
    const ModelDims& d = dims_;
    if (layer < 0 || layer >= d.layers || !d.is_moe(layer)) {
        throw std::invalid_argument("layer " + std::to_string(layer) + " has no routed experts");
    }
    if (expert < 0 || expert >= d.experts) {
        throw std::invalid_argument("expert " + std::to_string(expert) + " is outside 0.." +
                                    std::to_string(d.experts - 1));
    }
    if (expert < d.first_expert() || expert >= d.first_expert() + d.rank_experts()) {
        throw std::invalid_argument("expert " + std::to_string(expert) + " is not held by rank " +
                                    std::to_string(d.shard.rank) + " of " + std::to_string(d.shard.ranks) +
                                    " (experts " + std::to_string(d.first_expert()) + ".." +
                                    std::to_string(d.first_expert() + d.rank_experts() - 1) + ")");
    }
    expert -= d.first_expert();  // the slot of this rank's experts
    CUDA_CHECK(cudaSetDevice(device_));
    LayerWeights& w = layers[layer];
    const auto [packed, scales] = expert_projection_bytes(d);
    if (w.marlin) {
        // The checkpoint bytes go up as they are, into a staging buffer kept until every expert is in, and are
        // repacked there on the device: a host repack took tens of ms per K2 expert.
        if (expert_stage_ == nullptr) CUDA_CHECK(cudaMalloc(&expert_stage_, 3 * (packed + scales)));
        uint8_t* next = expert_stage_;
        auto stage = [&](const int32_t* host_packed, const uint16_t* host_scale) {
            CUDA_CHECK(cudaMemcpyAsync(next, host_packed, packed, cudaMemcpyHostToDevice, stream_));
            CUDA_CHECK(cudaMemcpyAsync(next + packed, host_scale, scales, cudaMemcpyHostToDevice, stream_));
            const k::moe::PackedProjection on_device{reinterpret_cast<const int32_t*>(next),
                                                     reinterpret_cast<const uint16_t*>(next + packed)};
            next += packed + scales;
            return on_device;
        };
        const auto gate = stage(gate_packed, gate_scale), up = stage(up_packed, up_scale);
        const auto down = stage(down_packed, down_scale);
        const MoeLayer::ExpertStripes dst = w.marlin->expert_stripes(expert);
        CUDA_CHECK(k::moe::repack_w13_on_device(dst.w13, gate, up, 1, d.hidden, d.moe_inter, stream_));
        CUDA_CHECK(k::moe::repack_w2_on_device(dst.w2, down, 1, d.hidden, d.moe_inter, stream_));
    } else {
        auto copy = [&](const void* dst_base, const void* src, size_t bytes) {
            CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(const_cast<void*>(dst_base)) + bytes * expert, src,
                                       bytes, cudaMemcpyHostToDevice, stream_));
        };
        copy(w.plain.gate_packed, gate_packed, packed);
        copy(w.plain.gate_scale, gate_scale, scales);
        copy(w.plain.up_packed, up_packed, packed);
        copy(w.plain.up_scale, up_scale, scales);
        copy(w.plain.down_packed, down_packed, packed);
        copy(w.plain.down_scale, down_scale, scales);
    }
    // The caller's host bytes may be read after the copies are queued (pinned memory is read by the DMA itself).
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (!w.expert_uploaded[expert]) {
        w.expert_uploaded[expert] = true;
        if (--experts_missing_ == 0) {  // the staging's last use
            CUDA_CHECK(cudaFree(expert_stage_));
            expert_stage_ = nullptr;
        }
    }
}

void Weights::randomize(uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    const ModelDims& d = dims_;
    uint64_t salt = seed * 0x9e3779b97f4a7c15ull;
    auto fill = [&](k::bf16* p, size_t count, int fan_in) { fill_random_weight(p, count, fan_in, salt, stream_); };
    const size_t h = d.hidden;
    fill(embed, d.vocab * h, 1);
    fill(final_norm, h, 0);
    fill(lm_head, d.rank_vocab() * h, d.hidden);
    for (int l = 0; l < d.layers; ++l) {
        LayerWeights& w = layers[l];
        fill(w.input_norm, h, 0);
        fill(w.post_norm, h, 0);
        fill(w.qkv_a, d.qkv_a() * h, d.hidden);
        fill(w.q_a_norm, d.q_lora, 0);
        fill(w.kv_a_norm, d.kv_lora, 0);
        // Fan-ins are the whole model's: a rank's partial sums then add up to sums of the whole model's scale.
        const size_t heads = d.rank_heads();
        fill(w.q_b, heads * d.qk() * d.q_lora, d.q_lora);
        fill(w.kv_b, heads * (d.nope + d.v) * d.kv_lora, d.kv_lora);
        derive_w_uk_t(l);
        fill(w.o_proj, h * heads * d.v, d.heads * d.v);
        const size_t mlp = d.is_moe(l) ? d.rank_shared_inter() : d.rank_inter();
        fill(w.gate_up, 2 * mlp * h, d.hidden);
        fill(w.down, mlp * h, d.is_moe(l) ? d.shared_inter : d.inter);
        if (!d.is_moe(l)) {
            continue;
        }
        fill(w.router, static_cast<size_t>(d.experts) * h, d.hidden);
        CUDA_CHECK(cudaMemsetAsync(w.router_bias, 0, d.experts * sizeof(float), stream_));
        if (w.marlin) {
            // Bytes in [0x30, 0x3c]: every bf16 scale these bytes can form is finite and small.
            CUDA_CHECK(k::fill_random_bytes(w.marlin->w13(), w.marlin->w13_bytes_per_expert() * d.rank_experts(),
                                            ++salt, 0x30, 0x3c, stream_));
            CUDA_CHECK(k::fill_random_bytes(w.marlin->w2(), w.marlin->w2_bytes_per_expert() * d.rank_experts(),
                                            ++salt, 0x30, 0x3c, stream_));
        } else {
            const ExpertProjectionBytes one = expert_projection_bytes(d);
            for (const k::bf16* scale : {w.plain.gate_scale, w.plain.up_scale, w.plain.down_scale}) {
                CUDA_CHECK(k::fill_random_bf16(const_cast<k::bf16*>(scale), one.scales / 2 * d.rank_experts(),
                                               ++salt, 0.005f, 0.01f, stream_));
            }
            for (const int32_t* packed : {w.plain.gate_packed, w.plain.up_packed, w.plain.down_packed}) {
                CUDA_CHECK(k::fill_random_bytes(reinterpret_cast<uint8_t*>(const_cast<int32_t*>(packed)),
                                                one.packed * d.rank_experts(), ++salt, 0, 255, stream_));
            }
        }
        w.expert_uploaded.assign(d.rank_experts(), true);
    }
    experts_missing_ = 0;
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaFree(expert_stage_);  // the staging of a load that randomize() ends
    expert_stage_ = nullptr;
    slots_.mark_all_uploaded();
}

void Weights::copy_replicated_from(const Weights& from) {
    CUDA_CHECK(cudaStreamSynchronize(from.stream_));  // its own uploads or draws land first
    CUDA_CHECK(cudaSetDevice(device_));
    const ModelDims& d = dims_;
    auto copy = [&](void* dst, const void* src, size_t bytes) {
        CUDA_CHECK(cudaMemcpyPeerAsync(dst, device_, src, from.device_, bytes, stream_));
    };
    const size_t h = d.hidden, bf = sizeof(k::bf16);
    copy(embed, from.embed, d.vocab * h * bf);
    copy(final_norm, from.final_norm, h * bf);
    for (int l = 0; l < d.layers; ++l) {
        LayerWeights& w = layers[l];
        const LayerWeights& f = from.layers[l];
        copy(w.input_norm, f.input_norm, h * bf);
        copy(w.post_norm, f.post_norm, h * bf);
        copy(w.qkv_a, f.qkv_a, d.qkv_a() * h * bf);
        copy(w.q_a_norm, f.q_a_norm, d.q_lora * bf);
        copy(w.kv_a_norm, f.kv_a_norm, d.kv_lora * bf);
        if (d.is_moe(l)) {
            copy(w.router, f.router, static_cast<size_t>(d.experts) * h * bf);
            copy(w.router_bias, f.router_bias, d.experts * sizeof(float));
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::string Weights::missing() const {
    if (std::string m = slots_.missing(); !m.empty()) return m;
    for (int l = 0; l < dims_.layers; ++l) {
        for (int e = 0; e < static_cast<int>(layers[l].expert_uploaded.size()); ++e) {
            if (!layers[l].expert_uploaded[e]) {
                return layer_name(l, "mlp.experts.") + std::to_string(dims_.first_expert() + e);
            }
        }
    }
    return "";
}

}  // namespace ddtree
