#include "moe_layer.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "moe_marlin.cuh"
#include "moe_repack.h"

namespace ddtree {

namespace k = ddtree::kernels::moe;

namespace {

bool same_shape(const MoeLayerShape& a, const MoeLayerShape& b) {
    return a.experts == b.experts && a.hidden == b.hidden && a.inter == b.inter && a.topk == b.topk &&
           a.max_tokens == b.max_tokens;
}

}  // namespace

MoeWorkspace::MoeWorkspace(const MoeLayerShape& shape, int device) : shape_(shape), device_(device) {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMalloc(&memory_, bytes(shape)));
    ws_ = k::carve_workspace(memory_, shape.experts, shape.hidden, shape.inter, shape.topk, shape.max_tokens);
}

MoeWorkspace::~MoeWorkspace() { cudaFree(memory_); }

size_t MoeWorkspace::bytes(const MoeLayerShape& shape) {
    return k::workspace_bytes(shape.experts, shape.hidden, shape.inter, shape.topk, shape.max_tokens);
}

MoeLayer::MoeLayer(const MoeLayerShape& shape, int device, std::shared_ptr<const MoeWorkspace> workspace)
    : shape_(shape), device_(device), workspace_(std::move(workspace)) {
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
    if (workspace_ != nullptr && (!same_shape(workspace_->shape(), shape) || workspace_->device() != device)) {
        throw std::invalid_argument("the shared MoE workspace was made for another shape or device");
    }
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(k::configure(&gemm_ctas_));
    try {
        CUDA_CHECK(cudaMalloc(&w13_, w13_bytes_per_expert() * shape.experts));
        CUDA_CHECK(cudaMalloc(&w2_, w2_bytes_per_expert() * shape.experts));
        if (workspace_ == nullptr) workspace_ = std::make_shared<const MoeWorkspace>(shape, device);
    } catch (...) {
        cudaFree(w13_);
        cudaFree(w2_);
        throw;
    }
}

MoeLayer::~MoeLayer() {
    cudaFree(w13_);
    cudaFree(w2_);
}

size_t MoeLayer::weight_bytes(const MoeLayerShape& shape) {
    return (k::w13_bytes_per_expert(shape.hidden, shape.inter) + k::w2_bytes_per_expert(shape.hidden, shape.inter)) *
           static_cast<size_t>(shape.experts);
}

size_t MoeLayer::w13_bytes_per_expert() const { return k::w13_bytes_per_expert(shape_.hidden, shape_.inter); }
size_t MoeLayer::w2_bytes_per_expert() const { return k::w2_bytes_per_expert(shape_.hidden, shape_.inter); }

MoeLayer::ExpertStripes MoeLayer::expert_stripes(int expert) const {
    if (expert < 0 || expert >= shape_.experts) {
        throw std::out_of_range("expert " + std::to_string(expert) + " outside the layer's 0.." +
                                std::to_string(shape_.experts - 1));
    }
    return {w13_ + expert * w13_bytes_per_expert(), w2_ + expert * w2_bytes_per_expert()};
}

void MoeLayer::set_experts(int first, int count, const void* w13, const void* w2, cudaStream_t stream) {
    if (first < 0 || count < 0 || first + count > shape_.experts) {
        throw std::out_of_range("experts " + std::to_string(first) + ".." + std::to_string(first + count - 1) +
                                " outside the layer's 0.." + std::to_string(shape_.experts - 1));
    }
    if (count == 0) return;  // `first` may then be one past the last expert
    const ExpertStripes dst = expert_stripes(first);
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaMemcpyAsync(dst.w13, w13, count * w13_bytes_per_expert(), cudaMemcpyDefault, stream));
    CUDA_CHECK(cudaMemcpyAsync(dst.w2, w2, count * w2_bytes_per_expert(), cudaMemcpyDefault, stream));
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
    CUDA_CHECK(k::moe_forward(args, workspace_->buffers(), gemm_ctas_, stream));
}

}  // namespace ddtree
