// Which shared-memory hand-offs does compute-sanitizer racecheck model? Each kernel is a correct program using
// one pattern of the engine's kernels; a hazard reported for it is the tool's, not the program's.
//
//   nvcc -O2 -arch=sm_90a -lineinfo -o racecheck_patterns tools/racecheck_patterns.cu
//   for k in arrive sync mbarrier shfl; do
//       compute-sanitizer --tool racecheck --racecheck-report all ./racecheck_patterns $k | grep SUMMARY; done
//
// Results on the H200 are in bench/results/gpu_tests/README.md.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Producer warps 0-3 write a buffer, bar.arrive(READY); consumer warps 4-7 bar.sync(READY), read, bar.arrive(FREE);
// the producer bar.sync(FREE) before its next write. (mla_attn.cu's P hand-off.) `both_sync` makes both sides sync.
__global__ void named_handoff(float* out, int tiles, bool both_sync) {
    __shared__ float buf[128];
    const int t = threadIdx.x;
    float acc = 0.f;
    for (int tile = 0; tile < tiles; ++tile) {
        if (t < 128) {
            if (tile > 0) bar_sync(2, 256);
            buf[t] = tile + t;
            if (both_sync) bar_sync(1, 256); else bar_arrive(1, 256);
        } else {
            bar_sync(1, 256);
            acc += buf[(t + 5) & 127];
            if (tile + 1 < tiles) { if (both_sync) bar_sync(2, 256); else bar_arrive(2, 256); }
        }
    }
    out[blockIdx.x * 256 + t] = acc;
}

// Thread 0 inits an mbarrier, fences, __syncthreads; then thread 0 arrive.expect_tx and a bulk copy, all wait.
// (gemm.cu's stage barriers.)
__global__ void mbarrier_bulk(const float* in, float* out) {
    __shared__ alignas(128) float buf[256];
    __shared__ alignas(8) uint64_t bar;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&bar)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&bar)), "r"(1024) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(saddr(buf)), "l"(in), "r"(1024), "r"(saddr(&bar)) : "memory");
    }
    asm volatile("{\n .reg .pred done;\n W:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n @!done bra W;\n}"
                 ::"r"(saddr(&bar)) : "memory");
    out[threadIdx.x] = buf[(threadIdx.x + 1) & 255];
}

// Lanes read a shared statistic, reduce with __shfl_xor_sync, then lane 0 writes it back. (gqa_attn.cu's row max.)
__global__ void warp_stat(float* out) {
    __shared__ float stat[8];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) stat[w] = 1.f;
    __syncwarp();
    float m = stat[w] + lane;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) stat[w] = m;
    __syncwarp();
    out[threadIdx.x] = stat[w];
}

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
#include <cstring>
int main(int argc, char** argv) {
    float *in, *out;
    CHECK(cudaMalloc(&in, 4096)); CHECK(cudaMalloc(&out, 1 << 20)); CHECK(cudaMemset(in, 0, 4096));
    const char* k = argc > 1 ? argv[1] : "";
    if (!strcmp(k, "arrive")) named_handoff<<<4, 256>>>(out, 8, false);
    else if (!strcmp(k, "sync")) named_handoff<<<4, 256>>>(out, 8, true);
    else if (!strcmp(k, "mbarrier")) mbarrier_bulk<<<4, 256>>>(in, out);
    else if (!strcmp(k, "shfl")) warp_stat<<<4, 256>>>(out);
    else { printf("usage: %s arrive|sync|mbarrier|shfl\n", argv[0]); return 2; }
    CHECK(cudaGetLastError()); CHECK(cudaDeviceSynchronize());
    return 0;
}
