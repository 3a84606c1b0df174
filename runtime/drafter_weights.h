// The DFlash drafter's weights on the device, in the layouts its forward reads:
// - per layer q_proj, k_proj and v_proj stacked into one [q_dim + 2 kv_dim, hidden] projection (the block's
//   queries, keys and values in one GEMM; the context's keys and values read its last 2 kv_dim rows);
// - gate_proj / up_proj interleaved in blocks of 8 rows for the GEMM's fused SiLU epilogue;
// - no embedding or LM head: the target's, borrowed from its Weights (the drafter must not outlive them); beside a
//   target split over GPUs, which holds a vocabulary slice of its lm_head, the whole table as a tensor of its own
//   ("lm_head.weight", DrafterDims::own_lm_head).
// Uploads are by HF tensor name from host memory, each checked against the expected byte size.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common.cuh"
#include "device_arena.h"
#include "weight_slots.h"

namespace ddtree {

struct DrafterDims {
    int hidden = 0, inter = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, block = 0, taps = 0;
    int mask_token = 0;
    float rms_eps = 0.f;
    bool own_lm_head = false;  // holds the target's whole lm_head itself (beside a split target)

    int q_dim() const { return heads * head_dim; }
    int kv_dim() const { return kv_heads * head_dim; }
    int qkv() const { return q_dim() + 2 * kv_dim(); }
    int context_width() const { return taps * hidden; }
};

struct DrafterLayerWeights {
    kernels::bf16 *input_norm = nullptr, *post_norm = nullptr, *qkv = nullptr, *q_norm = nullptr, *k_norm = nullptr;
    kernels::bf16 *o_proj = nullptr, *gate_up = nullptr, *down = nullptr;
};

class DrafterWeights {
  public:
    // Lays out every drafter tensor from `arena` (a counting arena only counts them); embed and lm_head
    // [vocab, hidden] are the target's (lm_head unused with dims.own_lm_head).
    DrafterWeights(const DrafterDims& dims, const kernels::bf16* embed, const kernels::bf16* lm_head,
                   DeviceArena& arena, cudaStream_t stream);
    DrafterWeights(const DrafterWeights&) = delete;
    DrafterWeights& operator=(const DrafterWeights&) = delete;

    // Copies one tensor (its checkpoint name, e.g. "layers.0.self_attn.q_proj.weight"). Throws
    // std::invalid_argument naming the tensor for an unknown name or a wrong byte size.
    void upload(const std::string& name, const void* host, size_t bytes);
    // Random weights of the right scale in every tensor (tests and benchmarks at K2 dims without a checkpoint).
    void randomize(uint64_t seed);
    // The first tensor not uploaded yet ("" when complete).
    std::string missing() const;

    const kernels::bf16 *embed, *lm_head;
    kernels::bf16 *fc = nullptr, *hidden_norm = nullptr, *final_norm = nullptr;
    kernels::bf16* owned_lm_head = nullptr;  // with dims.own_lm_head: lm_head points here
    std::vector<DrafterLayerWeights> layers;

  private:
    DrafterDims dims_;
    cudaStream_t stream_;
    WeightSlots slots_;
};

}  // namespace ddtree
