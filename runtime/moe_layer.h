// One MoE layer's routed experts on one GPU: the repacked INT4 weights, the scratch of the fused call,
// and the call itself. The engine owns one per layer and calls forward() on its stream (inside CUDA
// graphs: forward neither allocates nor syncs with the host).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "moe_marlin.cuh"

namespace ddtree {

struct MoeLayerShape {
    int experts;        // experts held by this layer (ids 0..experts-1)
    int hidden;         // H, multiple of 128
    int inter;          // moe_intermediate_size, multiple of 128
    int topk;           // experts per token, <= 16
    int max_tokens;     // largest M a forward call may pass
    float routed_scaling_factor;
};

// The scratch of the fused call (routing blocks, intermediate activations, fp32 per-slot outputs) for one
// shape. Calls on one stream run one after another, so the layers of a model share one: at K2 sizes a
// workspace per layer cost about 17 MB x 60 layers at 64 rows.
class MoeWorkspace {
  public:
    MoeWorkspace(const MoeLayerShape& shape, int device);
    ~MoeWorkspace();
    MoeWorkspace(const MoeWorkspace&) = delete;
    MoeWorkspace& operator=(const MoeWorkspace&) = delete;

    static size_t bytes(const MoeLayerShape& shape);
    const MoeLayerShape& shape() const { return shape_; }
    int device() const { return device_; }
    const kernels::moe::Workspace& buffers() const { return ws_; }

  private:
    MoeLayerShape shape_;
    int device_;
    void* memory_ = nullptr;
    kernels::moe::Workspace ws_{};  // memory_ carved into its buffers, once
};

class MoeLayer {
  public:
    // Allocates the weights on `device`, and a workspace unless one is shared (it must be of the same shape
    // and device, and only used by calls on the same stream); throws std::invalid_argument for an unsupported
    // shape or a mismatched workspace.
    MoeLayer(const MoeLayerShape& shape, int device, std::shared_ptr<const MoeWorkspace> workspace = nullptr);
    ~MoeLayer();
    MoeLayer(const MoeLayer&) = delete;
    MoeLayer& operator=(const MoeLayer&) = delete;

    // Device bytes of the repacked weights of `shape` (the workspace aside).
    static size_t weight_bytes(const MoeLayerShape& shape);
    const MoeLayerShape& shape() const { return shape_; }
    int device() const { return device_; }
    size_t w13_bytes_per_expert() const;
    size_t w2_bytes_per_expert() const;
    uint8_t* w13() const { return w13_; }  // [experts, w13_bytes_per_expert]
    uint8_t* w2() const { return w2_; }    // [experts, w2_bytes_per_expert]
    // Where one expert's repacked stripes (weights and their scales) live in w13() and w2().
    struct ExpertStripes {
        uint8_t* w13;  // w13_bytes_per_expert bytes
        uint8_t* w2;   // w2_bytes_per_expert bytes
    };
    // Throws std::out_of_range unless 0 <= expert < experts.
    ExpertStripes expert_stripes(int expert) const;

    // Copies `count` experts' repacked bytes (host or device memory) into slots first..first+count-1.
    void set_experts(int first, int count, const void* w13, const void* w2, cudaStream_t stream);

    // out[M, H] = sum over the top-k slots (fixed order) of weight * rsf * w2(SiLU(w13_gate x) * w13_up x).
    // expert_mask[e] == 0 (or an id outside 0..experts-1) skips that slot; nullptr keeps all experts.
    void forward(const __nv_bfloat16* hidden_states, const int32_t* topk_ids, const float* topk_weights,
                 const uint8_t* expert_mask, __nv_bfloat16* out, int tokens, cudaStream_t stream) const;

  private:
    MoeLayerShape shape_;
    int device_;
    int gemm_ctas_ = 0;
    uint8_t* w13_ = nullptr;
    uint8_t* w2_ = nullptr;
    std::shared_ptr<const MoeWorkspace> workspace_;
};

}  // namespace ddtree
