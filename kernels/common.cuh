// Shared helpers for every kernel family: bf16 type, error propagation for launchers, dependent launches.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace ddtree::kernels {

using bf16 = __nv_bfloat16;

#if defined(__CUDACC__)  // g++-built runtime code includes this header for bf16 (and the launch templates below)
// splitmix64's finaliser: a well-mixed 64-bit hash (seeded sampling, random benchmark fills).
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// A well-mixed 64-bit value for element i of the stream seeded by `key` (Weyl step, then mix64).
__device__ __forceinline__ uint64_t hash_at(uint64_t key, uint64_t i) {
    return mix64(key + i * 0x9e3779b97f4a7c15ull);
}

// An arg-max candidate. better(): the larger value wins, equal values go to the lower index (the first maximum,
// as the reference's stable sort and argmax pick it); a NaN value never wins.
struct Best {
    float value;
    int index;
};
__device__ __forceinline__ Best better(Best a, Best b) {
    return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

// Best of a warp, returned to every lane.
__device__ __forceinline__ Best warp_best(Best b) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const Best other{__shfl_xor_sync(0xffffffffu, b.value, offset), __shfl_xor_sync(0xffffffffu, b.index, offset)};
        b = better(b, other);
    }
    return b;
}

// SiLU with the fast exponential, as the dense MLP, the shared expert and the plain INT4 experts use it.
__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

// Sum of `v` over a CTA of kThreads threads, returned to every thread: a butterfly inside each warp, then the warp
// sums in warp order. The order depends on kThreads only. Once per kernel (its shared array is not re-armed).
template <int kThreads>
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float warp_sums[kThreads / 32];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    return total;
}

// Programmatic dependent launch (sm_90). A kernel started by launch_dependent may begin while the previous kernel
// of its stream is still running, so decode-size kernels overlap their start and their weight prefetch with the
// previous kernel's tail. Such a kernel must call grid_dependency_wait() before it reads anything an
// earlier kernel writes or writes anything an earlier kernel reads; before the wait it may touch only data no
// kernel changes (weights). The wait is a no-op in a kernel launched the ordinary way.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// Lets the next dependent kernel of the stream start once every CTA of this grid has called it or exited.
__device__ __forceinline__ void allow_dependent_launch() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// The start of a small kernel launched by launch_dependent: lets the next kernel launch at once (a dependent GEMM
// streams its weights during this kernel), then waits until everything earlier kernels write is visible.
__device__ __forceinline__ void dependent_kernel_start() {
    allow_dependent_launch();
    grid_dependency_wait();
}
#endif

// Launches `kernel` as a programmatic dependent of the previous kernel of `stream` (see grid_dependency_wait). A
// kernel declared with __cluster_dims__ runs in those clusters: the launch needs no cluster attribute for them.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                             cudaStream_t stream, Args&&... args) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace ddtree::kernels

// Launchers return cudaError_t; this propagates a failed CUDA call to the launcher's caller.
#define DDTREE_RETURN_IF_ERROR(call)                \
    do {                                            \
        cudaError_t ddtree_err_ = (call);           \
        if (ddtree_err_ != cudaSuccess) {           \
            return ddtree_err_;                     \
        }                                           \
    } while (0)
