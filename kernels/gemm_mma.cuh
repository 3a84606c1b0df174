// Device helpers shared by the tensor-core kernels (gemm, mla_attn, moe_marlin): mma.sync, ldmatrix, cp.async,
// mbarriers and bulk copies, the SM count, shared-memory opt-in and resident CTAs per SM.
#pragma once
#include <atomic>
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// D += A(16x16, row) * B(16x8, col), bf16 inputs, fp32 accumulators. Fragment layout (g = lane/4, t = lane%4):
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..2t+1][g],
// b1 = B[2t+8..][g]; c0,c1 = D[g][2t..2t+1], c2,c3 = D[g+8][2t..2t+1].
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Zero-fills the 16 smem bytes when `valid` is false (src-size 0), so masked rows read as zeros.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    return bf16x2_bits(__floats2bfloat162_rn(lo, hi));
}

// An attribute of the current device, queried once per device (`fallback` when the query fails).
template <cudaDeviceAttr kAttr>
inline int cached_device_attribute(int fallback) {
    static std::atomic<int> values[64] = {};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return fallback;
    std::atomic<int>& value = values[device & 63];
    if (value.load() == 0) {
        int v = fallback;
        if (cudaDeviceGetAttribute(&v, kAttr, device) != cudaSuccess) v = fallback;
        value.store(v);
    }
    return value.load();
}

// SMs of the current device (132, an H200's, when the query fails: callers size grids, tiles and K splits by it,
// so a wrong count costs speed, and a K split still depends on the shapes alone).
inline int sm_count() { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(132); }

// CTAs of `kKernel` with `threads` threads and `smem_bytes` of dynamic shared memory that are resident on one SM
// of the current device at once, by the occupancy calculator (registers, threads, static and dynamic shared memory,
// the runtime's reservation per CTA); opts the kernel in to `smem_bytes` first. Both happen once per kernel and
// device: later calls, CUDA-graph captures included, make no attribute or occupancy call, so a kernel must always
// be asked with the same threads and bytes. cudaErrorInvalidConfiguration when not even one CTA fits.
template <auto kKernel>
inline cudaError_t resident_ctas_per_sm(int threads, int smem_bytes, int* ctas) {
    static std::atomic<int> per_device[64] = {};
    int device = 0;
    DDTREE_RETURN_IF_ERROR(cudaGetDevice(&device));
    std::atomic<int>& cached = per_device[device & 63];
    if (cached.load() == 0) {
        DDTREE_RETURN_IF_ERROR(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
        int count = 0;
        DDTREE_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kKernel, threads, smem_bytes));
        if (count < 1) return cudaErrorInvalidConfiguration;
        cached.store(count);
    }
    *ctas = cached.load();
    return cudaSuccess;
}

// Opts `kernel` in to `bytes` of dynamic shared memory once per device (the attribute belongs to the function
// on each device); `done` is the caller's per-kernel record, so later launches, CUDA-graph captures included,
// make no attribute call.
template <typename Kernel>
inline cudaError_t opt_in_smem(Kernel* kernel, int bytes, std::atomic<uint64_t>& done) {
    int device = 0;
    DDTREE_RETURN_IF_ERROR(cudaGetDevice(&device));
    const uint64_t bit = uint64_t{1} << (device & 63);
    if ((done.load() & bit) == 0) {
        DDTREE_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        done.fetch_or(bit);
    }
    return cudaSuccess;
}

// ---- mbarriers: bulk (TMA) copies global -> shared completing on one (one arrival per phase), and hand-offs
// between threads (one arrival per producing thread per phase). ----

// L2 evict-first policy for a stream read once per call (what `createpolicy.fractional.L2::evict_first 1.0`
// yields; a constant because ptxas 13.0 mis-allocated the createpolicy form's registers).
constexpr uint64_t kL2EvictFirstPolicy = 0x12F0000000000000ull;

// A phase completes after `arrivals` arrivals (and the bytes its expect_tx counted).
__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals));
}

// Makes initialised barriers visible to the async proxy (bulk copies) and the other threads after a sync.
__device__ __forceinline__ void barrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Adds `bytes` to the transactions the current phase waits for, without arriving.
__device__ __forceinline__ void barrier_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// Adds `bytes` and arrives: the phase completes once those bytes have landed.
__device__ __forceinline__ void barrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// Arrives (release: this thread's earlier shared-memory accesses are ordered before the phase completes).
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Waits until phase `parity` of the barrier completed; the bytes it counted are then visible to this thread.
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred done;\n BARRIER_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra BARRIER_WAIT;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// `bytes` (multiple of 16, 16-byte aligned ends) from global to shared, counted on `bar`; evict-first in L2.
__device__ __forceinline__ void bulk_copy_streamed(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
        "%4;\n" ::"r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(kL2EvictFirstPolicy)
        : "memory");
}

// As bulk_copy_streamed, for data other CTAs read too (activations): default L2 policy.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

// One box of a 2-D tensor map (`map`: a CUtensorMap in kernel-parameter or global memory) at (col, row) into
// shared memory at `dst`, counted on `bar`, evict-first; parts of the box past the tensor arrive as zeros and
// count too.
__device__ __forceinline__ void bulk_tensor_load_2d(uint32_t dst, const void* map, int col, int row, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
        "%3}], [%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(smem_addr(bar)), "l"(kL2EvictFirstPolicy)
        : "memory");
}

// True in one lane of the calling warp (all 32 lanes must call it): the issuer of a warp's bulk copies, which then
// need no loop over the active lanes to move their operands into uniform registers.
__device__ __forceinline__ bool elect_one_lane() {
    uint32_t elected = 0;
    asm volatile(
        "{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(elected));
    return elected != 0;
}

// Orders this thread's earlier shared-memory accesses before later bulk copies into the same bytes.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace ddtree::kernels
