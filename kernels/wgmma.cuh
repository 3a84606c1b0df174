// Hopper warpgroup MMA (wgmma) helpers shared by the attention kernel and the tensor-rate tool: shared-memory
// descriptors in the 128-byte swizzle, the m64n64k16 MMAs the attention issues, the fence / commit / wait around
// asynchronous MMAs, and the accumulator operand lists of the inline asm.
#pragma once
#include <cstdint>

// Read-write operand lists of 4 and 16 fp32 accumulators d[b..] for a wgmma's inline asm.
#define DDTREE_WGMMA_D4(d, b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3])
#define DDTREE_WGMMA_D16(d, b) \
    DDTREE_WGMMA_D4(d, b), DDTREE_WGMMA_D4(d, b + 4), DDTREE_WGMMA_D4(d, b + 8), DDTREE_WGMMA_D4(d, b + 12)

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

// d[64 x 64] (+)= A[64 x 16] B[16 x 64], bf16 in, fp32 accumulators; A and B K-major in shared memory. With
// accumulate == 0, d is overwritten.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : DDTREE_WGMMA_D16(d, 0), DDTREE_WGMMA_D16(d, 16)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d[64 x 64] += A[64 x 16] B[16 x 64]; A in registers (the mma.sync A-fragment layout per warp), B MN-major in
// shared memory.
__device__ __forceinline__ void wgmma_m64n64k16_rs_mn(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
        : DDTREE_WGMMA_D16(d, 0), DDTREE_WGMMA_D16(d, 16)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Keeps the compiler from moving accumulator reads/writes across wgmma issue and wait.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
#endif

}  // namespace ddtree::kernels
