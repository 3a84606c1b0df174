// Hopper warpgroup MMA (wgmma) helpers shared by the attention kernel and the tensor-rate tool: shared-memory
// descriptors in the 128-byte swizzle, the fence / commit / wait around asynchronous MMAs, and the accumulator
// operand lists of the inline asm.
#pragma once
#include <cstdint>

namespace ddtree::kernels {

#if defined(__CUDACC__)
// wgmma shared-memory descriptor, 128-byte swizzle. K-major: sbo = stride of 8-row groups (lbo unused);
// MN-major: lbo = stride of 64-column blocks, sbo = stride of 8-row (K) groups.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16 |
           static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32 | uint64_t{1} << 62;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most kPending of this warpgroup's committed wgmma groups are still running.
template <int kPending = 0>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across wgmma issue and wait.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
#endif

}  // namespace ddtree::kernels

// Read-write operand lists of 4 and 16 fp32 accumulators d[b..] for a wgmma's inline asm.
#define DDTREE_WGMMA_D4(d, b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3])
#define DDTREE_WGMMA_D16(d, b) \
    DDTREE_WGMMA_D4(d, b), DDTREE_WGMMA_D4(d, b + 4), DDTREE_WGMMA_D4(d, b + 8), DDTREE_WGMMA_D4(d, b + 12)
