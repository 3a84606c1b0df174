// The target model's dimensions and RoPE table as the runtime reads them. The engine builds them by field name
// from Python's config dict (bind_engine.cpp), never by position.
#pragma once
#include <vector>

namespace ddtree {

// Rank `rank` of `ranks` GPUs the model is split over (shard.h has the layout); {0, 1}: the whole model.
struct Shard {
    int rank = 0, ranks = 1;
};

// Global sizes (as config.json gives them) and the shard this GPU holds: the rank_* sizes are its share of the
// split dimensions, checked to divide by check_shard (shard.h).
struct ModelDims {
    int vocab = 0, hidden = 0, inter = 0, moe_inter = 0, layers = 0, heads = 0, q_lora = 0, kv_lora = 0, nope = 0,
        rope = 0, v = 0;
    int experts = 0, shared_inter = 0, topk = 0, first_dense = 0;
    float routed_scaling_factor = 1.f;
    bool norm_topk_prob = false;
    float rms_eps = 0.f, lora_eps = 0.f, softmax_scale = 0.f;
    Shard shard;

    int qk() const { return nope + rope; }
    int qkv_a() const { return q_lora + kv_lora + rope; }
    int latent_row() const { return kv_lora + rope; }
    bool is_moe(int layer) const { return layer >= first_dense; }
    int moe_layers() const { return layers - first_dense; }
    bool sharded() const { return shard.ranks > 1; }
    int rank_heads() const { return heads / shard.ranks; }
    int rank_inter() const { return inter / shard.ranks; }
    int rank_shared_inter() const { return shared_inter / shard.ranks; }
    int rank_experts() const { return experts / shard.ranks; }
    int first_expert() const { return shard.rank * rank_experts(); }
    int rank_vocab() const { return vocab / shard.ranks; }
    int first_token() const { return shard.rank * rank_vocab(); }
    // The same dims for another rank of the shard.
    ModelDims for_rank(int rank) const {
        ModelDims d = *this;
        d.shard.rank = rank;
        return d;
    }
};

struct RopeTable {
    std::vector<float> inv_freq;
    float attention_factor = 1.f;
    bool interleave = false;
};

}  // namespace ddtree
