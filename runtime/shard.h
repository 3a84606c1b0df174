// How the target splits over G GPUs: the runtime's copy of ddtree.shard (tests/test_shard.py checks that they
// agree). MLA heads split G ways (q_b and kv_b rows of whole heads, o_proj columns); the LoRA down-projections,
// norms, embedding and router replicated; dense MLP and shared expert by intermediate columns; routed experts E / G
// per rank; lm_head by vocabulary rows. Weights (engine_weights.h) holds one rank's share, sliced by the loader.
#pragma once
#include "model_dims.h"

namespace ddtree {

// One rank's share of every split dimension, and where it starts.
struct ShardLayout {
    int heads, inter, shared_inter, experts, vocab;
    int first_head, first_inter, first_shared_inter, first_expert, first_token;
};

// Throws std::invalid_argument naming `rank` or `ranks` and the config field a rank count does not divide (the
// dense width only with dense layers, the experts' only with MoE layers), with ddtree.shard's message.
void check_shard(const ModelDims& dims);
// The layout of dims.shard, after check_shard.
ShardLayout shard_layout(const ModelDims& dims);

}  // namespace ddtree
