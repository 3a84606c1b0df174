#include "weight_slots.h"

#include <cmath>
#include <stdexcept>
#include <utility>

#include "cuda_check.h"
#include "fill_random.cuh"
#include "gemm.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

void WeightSlots::add(const std::string& name, void* dst, size_t bytes, Kind kind, int layer) {
    slots_.emplace(name, Slot{dst, bytes, kind, layer});
}

const WeightSlots::Slot& WeightSlots::upload(const std::string& name, const void* host, size_t bytes,
                                             cudaStream_t stream) {
    auto it = slots_.find(name);
    if (it == slots_.end()) {
        throw std::invalid_argument("tensor '" + name + "' is not a tensor of " + owner_);
    }
    Slot& slot = it->second;
    if (bytes != slot.bytes) {
        throw std::invalid_argument("tensor '" + name + "' has " + std::to_string(bytes) + " bytes, expected " +
                                    std::to_string(slot.bytes));
    }
    void* dst = slot.dst;
    if (slot.kind == Kind::kGate || slot.kind == Kind::kUp) {
        void*& stage = slot.kind == Kind::kGate ? gate_[slot.layer] : up_[slot.layer];
        if (stage == nullptr) CUDA_CHECK(cudaMalloc(&stage, bytes));
        dst = stage;
    }
    CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    slot.uploaded = true;
    return slot;
}

void WeightSlots::interleave_if_ready(int layer, k::bf16* gate_up, int rows, int hidden, cudaStream_t stream) {
    if (gate_[layer] == nullptr || up_[layer] == nullptr) return;
    CUDA_CHECK(k::interleave_gate_up(gate_up, static_cast<const k::bf16*>(gate_[layer]),
                                     static_cast<const k::bf16*>(up_[layer]), rows, hidden, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaFree(gate_[layer]));
    CUDA_CHECK(cudaFree(up_[layer]));
    gate_[layer] = up_[layer] = nullptr;
}

void WeightSlots::mark_all_uploaded() {
    for (auto& [name, slot] : slots_) slot.uploaded = true;
    free_stages();
}

std::string WeightSlots::missing() const {
    for (const auto& [name, slot] : slots_) {
        if (!slot.uploaded) return name;
    }
    return "";
}

void WeightSlots::free_stages() {
    for (std::vector<void*>* stages : {&gate_, &up_}) {
        for (void*& p : *stages) {
            if (p != nullptr) cudaFree(p);
            p = nullptr;
        }
    }
}

void fill_random_weight(k::bf16* p, size_t count, int fan_in, uint64_t& salt, cudaStream_t stream) {
    const float scale = fan_in > 0 ? std::sqrt(3.f / fan_in) : 0.1f;
    CUDA_CHECK(k::fill_random_bf16(p, static_cast<int64_t>(count), ++salt, scale, fan_in > 0 ? 0.f : 1.f, stream));
}

}  // namespace ddtree
