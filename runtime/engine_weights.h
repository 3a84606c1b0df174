// The model's weights on the device, in the layouts the engine's kernels read:
// - q_a_proj and kv_a_proj_with_mqa concatenated into one [q_lora + kv_lora + rope, hidden] projection;
// - kv_b_proj kept as is (its value rows are the absorbed W_UV) plus W_UK transposed per head [kv_lora, nope];
// - gate_proj / up_proj interleaved in blocks of 8 rows for the GEMM's fused SiLU epilogue;
// - routed experts repacked on the device for the Marlin-style MoE kernel, or kept in checkpoint layout for the
//   plain INT4 kernel when the shape is one the fused kernel does not take.
// On a split target (dims.shard, shard.h) it holds one rank's share, in the same layouts, and takes each tensor as
// the loader sliced it for that rank (ddtree.shard); experts by their global ids.
// Uploads are by HF tensor name from host memory (Python's memory-mapped checkpoint views); each is checked
// against the expected byte size so a wrong tensor never overruns a buffer.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.cuh"
#include "device_arena.h"
#include "experts_int4.cuh"
#include "model_dims.h"
#include "moe_layer.h"
#include "weight_slots.h"

namespace ddtree {

struct LayerWeights {
    kernels::bf16 *input_norm = nullptr, *post_norm = nullptr;
    kernels::bf16 *qkv_a = nullptr, *q_a_norm = nullptr, *kv_a_norm = nullptr, *q_b = nullptr;
    kernels::bf16 *kv_b = nullptr, *w_uk_t = nullptr, *o_proj = nullptr;
    kernels::bf16 *gate_up = nullptr, *down = nullptr;  // dense MLP, or the shared expert of a MoE layer
    kernels::bf16* router = nullptr;
    float* router_bias = nullptr;
    std::unique_ptr<MoeLayer> marlin;  // fused INT4 experts when the shape allows
    kernels::Int4Experts plain{};      // otherwise: checkpoint-layout INT4 experts
    std::vector<bool> expert_uploaded;
};

class Weights {
  public:
    Weights(const ModelDims& dims, int device, int max_tokens, cudaStream_t stream);
    ~Weights();
    Weights(const Weights&) = delete;
    Weights& operator=(const Weights&) = delete;

    // Device bytes the weights of `dims` take (the engine's memory pre-flight): the constructor's own layout,
    // walked without allocating, so the plan and the allocations never disagree.
    static size_t planned_bytes(const ModelDims& dims, int max_tokens);
    // Whether the fused MoE kernel takes this rank's routed experts.
    static bool marlin_supported(const ModelDims& dims);
    // Checkpoint bytes of one expert's projection (gate, up or down): packed 4-bit weights, bf16 group-32 scales.
    struct ExpertProjectionBytes {
        size_t packed, scales;
    };
    static ExpertProjectionBytes expert_projection_bytes(const ModelDims& dims);

    // Copies one non-expert tensor; `name` without the checkpoint's weight prefix. Throws std::invalid_argument
    // naming the tensor for an unknown name or a wrong byte size.
    void upload(const std::string& name, const void* host, size_t bytes);
    // One routed expert's compressed-tensors tensors (weight_packed int32, weight_scale bf16 bits).
    void upload_expert(int layer, int expert, const int32_t* gate_packed, const uint16_t* gate_scale,
                       const int32_t* up_packed, const uint16_t* up_scale, const int32_t* down_packed,
                       const uint16_t* down_scale);
    // Random weights of the right scale in every tensor (benchmarks at K2 dims without a checkpoint on disk).
    void randomize(uint64_t seed);
    // The replicated tensors (embedding, norms, q_a/kv_a projections, routers) copied from another rank's weights,
    // on this device or another: random ranks on several GPUs then share them, as the one-GPU simulation of every
    // rank does (it reads its first rank's), so both compute one model.
    void copy_replicated_from(const Weights& from);
    // The first tensor not uploaded yet ("" when complete).
    std::string missing() const;

    kernels::bf16 *embed = nullptr, *final_norm = nullptr, *lm_head = nullptr;
    std::vector<LayerWeights> layers;

  private:
    // The plan: lays out `dims` with every allocation counted by a counting arena and none made.
    Weights(const ModelDims& dims, int max_tokens);
    // Every weight buffer of the model, its upload slot, and each MoE layer's experts (allocated, or counted).
    void lay_out(int max_tokens);
    void add(const std::string& name, void* dst, size_t bytes, WeightSlots::Kind kind = WeightSlots::Kind::kPlain,
             int layer = -1);
    void derive_w_uk_t(int layer);

    ModelDims dims_;
    int device_;
    cudaStream_t stream_;
    DeviceArena arena_;  // a plan's only counts
    WeightSlots slots_;
    uint8_t* expert_stage_ = nullptr;  // one expert's checkpoint bytes on the device, for the fused MoE's repack
    long experts_missing_ = 0;         // routed experts not yet uploaded (the staging is freed at zero)
};

}  // namespace ddtree
