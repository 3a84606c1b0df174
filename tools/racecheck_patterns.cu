// Which shared-memory hand-offs does compute-sanitizer racecheck model? Each kernel is a correct program using
// one pattern of the engine's kernels or a candidate replacement for one; a hazard reported for it is the tool's,
// not the program's, except where a pattern says otherwise (shfl).
//
//   nvcc -O2 -arch=sm_90a -lineinfo -o racecheck_patterns tools/racecheck_patterns.cu
//   for k in arrive sync mbarrier shfl shfl_syncwarp ring ring_warp init_arrive; do echo "== $k";
//       compute-sanitizer --tool racecheck --racecheck-report all ./racecheck_patterns $k | grep SUMMARY; done
//
// Expected, and what each outcome decides (results on the H200 are in bench/results/gpu_tests/README.md):
//   arrive         hazards (seen: 14340 errors): racecheck does not take bar.arrive as a release.
//   sync           clean (seen): bar.sync on both sides is modelled.
//   mbarrier       clean (seen): init + fence + __syncthreads, then bulk copies completing on the barrier.
//   shfl           warnings (seen: 129): a real WAR by the PTX memory model (shfl.sync orders no memory access),
//                  benign on the hardware; gqa_attn.cu had it (it now lets only the writing lane read the
//                  statistic and shuffles the value to the others, so no shared access is left to order).
//   shfl_syncwarp  clean if racecheck models __syncwarp, which fixes shfl by the memory model; ptxas compiles a
//                  __syncwarp of a converged warp to a NOP, so the tool may not see it. Decides whether other
//                  warp-synchronous hand-offs of the suite can be fixed with __syncwarp alone.
//   ring           clean if racecheck models mbarrier.arrive (release) and try_wait (acquire) between threads:
//                  the P hand-off of mla_attn.cu. Hazards here mean the tool cannot see that pipeline either.
//   ring_warp      as ring with one arrival per warp after __syncwarp (fewer arrivals, the cheaper variant should
//                  the per-thread arrivals of ring cost time); clean only if the tool chains __syncwarp into the
//                  arrive's release.
//   init_arrive    warnings if racecheck attributes an mbarrier.init that ptxas put on the uniform datapath
//                  (one instruction for warp 0) to every lane of the warp: the initialising thread's own
//                  arrive.expect_tx, with no barrier in between, then reads as an intra-warp race. This was
//                  mla_attn.cu's order (the report named gemm_mma.cuh only); it now syncs the CTA first.
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile("{\n .reg .pred done;\n W:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra W;\n}"
                 ::"r"(saddr(bar)), "r"(parity) : "memory");
}

// Producer warps 0-3 write a buffer, bar.arrive(READY); consumer warps 4-7 bar.sync(READY), read, bar.arrive(FREE);
// the producer bar.sync(FREE) before its next write. (mla_attn.cu's P hand-off until now.) `both_sync` makes both
// sides sync.
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
// (gemm.cu's stage barriers; mla_attn.cu's since this change.)
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
    mbar_wait(&bar, 0);
    out[threadIdx.x] = buf[(threadIdx.x + 1) & 255];
}

// As mbarrier_bulk in mla_attn.cu's former order: thread 0 inits the barrier (asm without a memory clobber, as
// gemm_mma.cuh's barrier_init, so that ptxas may predicate it on a warp vote as it did there), other work of every
// thread, then thread 0's own arrive.expect_tx and bulk copy, and only then __syncthreads. Correct by program order.
__global__ void init_then_arrive(const float* in, float* out) {
    __shared__ alignas(128) float buf[256];
    __shared__ alignas(16) float other[256];
    __shared__ alignas(8) uint64_t bar[2];
    const int t = threadIdx.x;
    if (t == 0) {
        for (int s = 0; s < 2; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&bar[s])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    other[t] = in[256 + t];  // the query loads of mla_attn.cu
    if (t == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&bar[0])), "r"(1024) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(saddr(buf)), "l"(in), "r"(1024), "r"(saddr(&bar[0])) : "memory");
    }
    __syncthreads();
    mbar_wait(&bar[0], 0);
    out[t] = buf[(t + 1) & 255] + other[(t + 3) & 255];
}

// A one-slot producer/consumer ring on two mbarriers, the CUTLASS pipeline shape and mla_attn.cu's P hand-off:
// warpgroup 0 (128 producer threads) writes the slot (16 bytes each) and a per-row value, each thread arrives on
// `full` (count 128); warpgroups 1-2 (256 consumers) wait for full's phase, read the slot with ldmatrix and the
// value with a plain load, each arrives on `empty` (count 256), except after the last tile, which nothing
// overwrites; the producer waits for empty's phase before it rewrites. `per_warp`: instead each warp's lanes
// __syncwarp and lane 0 alone arrives (counts 4 and 8).
__global__ void mbarrier_ring(float* out, int tiles, bool per_warp) {
    __shared__ alignas(128) uint4 slot[128];
    __shared__ float value[64];
    __shared__ alignas(8) uint64_t full, empty;
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    if (t == 0) {
        mbar_init(&full, per_warp ? 4 : 128);
        mbar_init(&empty, per_warp ? 8 : 256);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto arrive = [&](uint64_t* bar) {
        if (per_warp) {
            __syncwarp();
            if (lane == 0) mbar_arrive(bar);
        } else {
            mbar_arrive(bar);
        }
    };
    float acc = 0.f;
    for (int tile = 0; tile < tiles; ++tile) {
        if (t < 128) {
            if (tile > 0) mbar_wait(&empty, (tile - 1) & 1);
            slot[t] = make_uint4(tile + t, tile, t, 1);
            if (t % 2 == 0) value[t / 2] = tile + t;
            arrive(&full);
        } else {
            mbar_wait(&full, tile & 1);
            uint32_t r0, r1, r2, r3;
            // Consumer warp w reads 512 bytes: lane l gives the row address l of four 8x8 matrices.
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                         : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                         : "r"(saddr(&slot[((warp - 4) % 4) * 32 + lane])));
            acc += static_cast<float>(r0 + r1 + r2 + r3) + value[(t + 7) & 63];
            if (tile + 1 < tiles) arrive(&empty);
        }
    }
    out[blockIdx.x * 384 + t] = acc;
}

// Lanes read a shared statistic, reduce with __shfl_xor_sync, then lane 0 writes it back. (gqa_attn.cu's row max
// until now.) Lanes 1-31's reads and lane 0's write are unordered: shfl.sync synchronises execution, not memory.
// `syncwarp` puts __syncwarp between the last read and the write.
__global__ void warp_stat(float* out, bool syncwarp) {
    __shared__ float stat[8];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) stat[w] = 1.f;
    __syncwarp();
    float m = stat[w] + lane;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (syncwarp) __syncwarp();
    if (lane == 0) stat[w] = m;
    __syncwarp();
    out[threadIdx.x] = stat[w];
}

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
int main(int argc, char** argv) {
    float *in, *out;
    CHECK(cudaMalloc(&in, 4096)); CHECK(cudaMalloc(&out, 1 << 20)); CHECK(cudaMemset(in, 0, 4096));
    const char* k = argc > 1 ? argv[1] : "";
    if (!strcmp(k, "arrive")) named_handoff<<<4, 256>>>(out, 8, false);
    else if (!strcmp(k, "sync")) named_handoff<<<4, 256>>>(out, 8, true);
    else if (!strcmp(k, "mbarrier")) mbarrier_bulk<<<4, 256>>>(in, out);
    else if (!strcmp(k, "shfl")) warp_stat<<<4, 256>>>(out, false);
    else if (!strcmp(k, "shfl_syncwarp")) warp_stat<<<4, 256>>>(out, true);
    else if (!strcmp(k, "ring")) mbarrier_ring<<<4, 384>>>(out, 8, false);
    else if (!strcmp(k, "ring_warp")) mbarrier_ring<<<4, 384>>>(out, 8, true);
    else if (!strcmp(k, "init_arrive")) init_then_arrive<<<4, 256>>>(in, out);
    else {
        printf("usage: %s arrive|sync|mbarrier|shfl|shfl_syncwarp|ring|ring_warp|init_arrive\n", argv[0]);
        return 2;
    }
    CHECK(cudaGetLastError()); CHECK(cudaDeviceSynchronize());
    return 0;
}
