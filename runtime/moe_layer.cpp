#include "moe_layer.h"

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "moe_marlin.cuh"
#include "moe_repack.h"

namespace ddtree {

namespace k = ddtree::kernels::moe;

MoeLayer::MoeLayer(const MoeLayerShape& shape, int device) : shape_(shape), device_(device) {
    moe::check_moe_shape(shape.hidden, shape.inter);
    if (shape.experts < 1 || shape.experts > k::kMaxExperts) {
        throw std::invalid_argument("MoE experts must be in 1.." + std::to_string(k::kMaxExperts) + ", got " +
                                    std::to_string(shape.experts));
    }
    if (shape.topk < 1 || shape.topk > k::kMaxTopk) {
        throw std::invalid_argument("MoE topk must be in 1.." + std::to_string(k::kMaxTopk) + ", got " +
                                    std::to_string(shape.topk));
    }
    if (shape.max_tokens < 1) {
        throw std::invalid_argument("MoE max_tokens must be >= 1, got " + std::to_string(shape.max_tokens));
    }
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(k::configure(device, &gemm_ctas_));
    try {
        CUDA_CHECK(cudaMalloc(&w13_, w13_bytes_per_expert() * shape.experts));
        CUDA_CHECK(cudaMalloc(&w2_, w2_bytes_per_expert() * shape.experts));
        CUDA_CHECK(cudaMalloc(&workspace_, k::workspace_bytes(shape.experts, shape.hidden, shape.inter, shape.topk,
                                                              shape.max_tokens)));
        ws_ = k::carve_workspace(workspace_, shape.experts, shape.hidden, shape.inter, shape.topk, shape.max_tokens);
    } catch (...) {
        cudaFree(w13_);
        cudaFree(w2_);
        throw;
    }
}

MoeLayer::~MoeLayer() {
    cudaFree(w13_);
    cudaFree(w2_);
    cudaFree(workspace_);
}

size_t MoeLayer::w13_bytes_per_expert() const { return k::w13_bytes_per_expert(shape_.hidden, shape_.inter); }
size_t MoeLayer::w2_bytes_per_expert() const { return k::w2_bytes_per_expert(shape_.hidden, shape_.inter); }

void MoeLayer::set_experts(int first, int count, const void* w13, const void* w2, cudaStream_t stream) {
    if (first < 0 || count < 0 || first + count > shape_.experts) {
        throw std::out_of_range("experts " + std::to_string(first) + ".." + std::to_string(first + count - 1) +
                                " outside the layer's 0.." + std::to_string(shape_.experts - 1));
    }
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaMemcpyAsync(w13_ + first * w13_bytes_per_expert(), w13, count * w13_bytes_per_expert(),
                               cudaMemcpyDefault, stream));
    CUDA_CHECK(cudaMemcpyAsync(w2_ + first * w2_bytes_per_expert(), w2, count * w2_bytes_per_expert(),
                               cudaMemcpyDefault, stream));
}

void MoeLayer::forward(const __nv_bfloat16* hidden_states, const int32_t* topk_ids, const float* topk_weights,
                       const uint8_t* expert_mask, __nv_bfloat16* out, int tokens, cudaStream_t stream) const {
    if (tokens < 0 || tokens > shape_.max_tokens) {
        throw std::out_of_range("MoE forward of " + std::to_string(tokens) + " tokens; the layer was sized for " +
                                std::to_string(shape_.max_tokens));
    }
    k::MoeArgs args{};
    args.w13 = w13_;
    args.w2 = w2_;
    args.hidden_states = hidden_states;
    args.topk_ids = topk_ids;
    args.topk_weights = topk_weights;
    args.expert_mask = expert_mask;
    args.out = out;
    args.tokens = tokens;
    args.experts = shape_.experts;
    args.hidden = shape_.hidden;
    args.inter = shape_.inter;
    args.topk = shape_.topk;
    args.routed_scaling_factor = shape_.routed_scaling_factor;
    CUDA_CHECK(k::moe_forward(args, ws_, gemm_ctas_, stream));
}

}  // namespace ddtree
