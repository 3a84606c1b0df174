// The engine's one memory planner. Every device buffer of the engine (weights, KV cache, scratch, decode state) is
// taken from an arena; a counting arena walks the same layout code without allocating and only adds up the bytes,
// so the memory pre-flight and the allocations can never disagree.
#pragma once
#include <cstddef>
#include <vector>

namespace ddtree {

class DeviceArena {
  public:
    enum class Mode { kCount, kAllocate };
    explicit DeviceArena(Mode mode) : mode_(mode) {}
    ~DeviceArena();  // frees what it allocated
    DeviceArena(const DeviceArena&) = delete;
    DeviceArena& operator=(const DeviceArena&) = delete;

    bool counting() const { return mode_ == Mode::kCount; }
    size_t bytes() const { return bytes_; }  // taken or counted so far
    // At least 16 bytes (cudaMalloc alignment); nullptr when counting. Throws CudaError when the device is full.
    void* take_bytes(size_t bytes);
    template <typename T>
    T* take(size_t count) {
        return static_cast<T*>(take_bytes(count * sizeof(T)));
    }
    // Bytes that an owner of its own allocates (a fused MoE layer), added to the plan.
    void count(size_t bytes) { bytes_ += bytes; }

  private:
    Mode mode_;
    size_t bytes_ = 0;
    std::vector<void*> owned_;
};

}  // namespace ddtree
