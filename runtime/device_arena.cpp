#include "device_arena.h"

#include <algorithm>

#include <cuda_runtime.h>

#include "cuda_check.h"

namespace ddtree {

DeviceArena::~DeviceArena() {
    for (void* p : owned_) cudaFree(p);
}

void* DeviceArena::take_bytes(size_t bytes) {
    bytes = std::max<size_t>(bytes, 16);
    bytes_ += bytes;
    if (counting()) return nullptr;
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    owned_.push_back(p);
    return p;
}

}  // namespace ddtree
