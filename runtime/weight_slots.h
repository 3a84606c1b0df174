// A model's weights by checkpoint name, shared by the target's and the drafter's weights: where each tensor goes
// on the device and how many bytes it must have, which have arrived, and the staging of gate/up projections. The
// GEMM's fused SiLU epilogue reads gate and up rows interleaved, so each half waits in a staging buffer until both
// are in. Also the random fill that stands in for a checkpoint in tests and benchmarks.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common.cuh"

namespace ddtree {

class WeightSlots {
  public:
    // kDerived: the owner derives further device data from the tensor once it is in (the target's W_UK^T).
    enum class Kind { kPlain, kGate, kUp, kDerived };
    struct Slot {
        void* dst;
        size_t bytes;
        Kind kind;
        int layer;
        bool uploaded = false;
    };

    // `owner` ends the unknown-name message: "tensor 'x' is not a tensor of <owner>".
    WeightSlots(int layers, std::string owner) : gate_(layers), up_(layers), owner_(std::move(owner)) {}
    ~WeightSlots() { free_stages(); }
    WeightSlots(const WeightSlots&) = delete;
    WeightSlots& operator=(const WeightSlots&) = delete;

    void add(const std::string& name, void* dst, size_t bytes, Kind kind = Kind::kPlain, int layer = -1);
    // Copies `bytes` of host memory into the tensor `name` (a gate or up half into its staging) on `stream` and waits
    // for it (a pageable copy may return before its DMA lands); std::invalid_argument naming the tensor for an
    // unknown name or a wrong byte size.
    const Slot& upload(const std::string& name, const void* host, size_t bytes, cudaStream_t stream);
    // Once both halves of `layer` are staged: gate and up [rows, hidden] interleaved into gate_up, stages freed.
    void interleave_if_ready(int layer, kernels::bf16* gate_up, int rows, int hidden, cudaStream_t stream);
    // Every tensor counts as in (random weights), and no staging is left.
    void mark_all_uploaded();
    // The first tensor not uploaded yet ("" when complete).
    std::string missing() const;

  private:
    void free_stages();

    std::map<std::string, Slot> slots_;
    std::vector<void*> gate_, up_;  // staged halves per layer
    std::string owner_;
};

// Uniform random bf16 with the variance of N(0, 1 / fan_in); fan_in 0 (norm weights): near 1. Each call takes the
// next value of `salt`, so a model's tensors differ.
void fill_random_weight(kernels::bf16* p, size_t count, int fan_in, uint64_t& salt, cudaStream_t stream);

}  // namespace ddtree
