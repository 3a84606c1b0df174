// Tensor-core rates of one GPU for the MMA shapes ddtree's kernels use: mma.sync m16n8k16 (GEMM, MoE) and
// warpgroup wgmma m64nNk16 with both operands in shared memory (SS, attention scores) or A in registers (RS,
// attention P.V and a register-A MoE), bf16 in, fp32 accumulators. The grid has one CTA per SM (all resident at
// once, one per SM as the block scheduler places them), whose warps or warpgroups issue chains of MMAs on fixed
// operands; the rate is FLOPs over CUDA-event time.
// Built and run by tools/bench_mma.py; prints one line per case: kind shape units_per_sm tflops ns_per_mma.
#include <cstdint>
#include <cstdio>

#include "../kernels/gemm_mma.cuh"
#include "../kernels/wgmma.cuh"

namespace {

using namespace ddtree::kernels;

constexpr int kChain = 8;  // MMAs per committed wgmma group, and per mma.sync loop step

#define REGS16 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"

// One wgmma m64nNk16 into d (N / 2 accumulators per thread). SS: descriptors a and b; RS: registers r, descriptor b.
template <int N, bool kRegisterA>
__device__ __forceinline__ void wgmma(float (&d)[32], uint64_t a, const uint32_t (&r)[4], uint64_t b) {
#define RS_OPS "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "l"(b)
    if constexpr (kRegisterA) {
        if constexpr (N == 8) {
            asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, "
                         "1, 1, 1, 0;\n"
                         : DDTREE_WGMMA_D4(d, 0) : RS_OPS);
        } else if constexpr (N == 16) {
            asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                         "{%8,%9,%10,%11}, %12, 1, 1, 1, 0;\n"
                         : DDTREE_WGMMA_D4(d, 0), DDTREE_WGMMA_D4(d, 4) : RS_OPS);
        } else if constexpr (N == 24) {
            asm volatile("wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 "
                         "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, %16, 1, 1, 1, 0;\n"
                         : DDTREE_WGMMA_D4(d, 0), DDTREE_WGMMA_D4(d, 4), DDTREE_WGMMA_D4(d, 8) : RS_OPS);
        } else if constexpr (N == 32) {
            asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" REGS16
                         "}, {%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
                         : DDTREE_WGMMA_D16(d, 0) : RS_OPS);
        } else {
            static_assert(N == 64);
            wgmma_m64n64k16_rs_mn(d, r, b);  // the attention's P.V form: B MN-major, unlike the narrower RS rows
        }
    } else if constexpr (N == 32) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" REGS16 "}, %16, %17, 1, 1, 1, 0, 0;\n"
                     : DDTREE_WGMMA_D16(d, 0) : "l"(a), "l"(b));
    } else {
        static_assert(N == 64);
        wgmma_m64n64k16_ss(d, a, b, 1);  // the attention's score form
    }
#undef RS_OPS
}

// Each warpgroup: `steps` groups of kChain chained wgmmas, one group in flight behind the one being issued.
template <int N, bool kRegisterA>
__global__ void wgmma_kernel(float* sink, int steps) {
    extern __shared__ __align__(1024) unsigned char raw[];
    unsigned char* smem = raw + (1024 - smem_addr(raw) % 1024) % 1024;
    for (int i = threadIdx.x; i < 16 * 1024 / 4; i += blockDim.x) {
        reinterpret_cast<uint32_t*>(smem)[i] = 0x3C003C00u ^ ((i * 2654435761u) & 0x003F003Fu);  // small finite bf16
    }
    fence_proxy_async();
    __syncthreads();
    // K-major operands in the 128-byte swizzle, 8-row groups 1024 bytes apart (the attention kernel's layout); the
    // RS N = 64 row reads the same bytes as B MN-major (transposed), the form of the attention's P.V.
    const uint32_t base = smem_addr(smem);
    const uint64_t a = sw128_desc(base, 16, 1024), b = sw128_desc(base + 8192, 16, 1024);
    const uint32_t r[4] = {0x3C003C00u, 0x3C013C00u, 0x3C003C01u, 0x3C013C01u};
    float d[32] = {};
    for (int step = 0; step < steps; ++step) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < kChain; ++j) wgmma<N, kRegisterA>(d, a + 2 * (j % 4), r, b + 2 * (j % 4));
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait();
    float sum = 0.f;
    for (float v : d) sum += v;
    if (sum == 1.2345f) sink[threadIdx.x] = sum;  // keeps the MMAs; never true for these operands
}

// Each warp: kChain mma.sync m16n8k16 per step spread over `Chains` independent accumulators.
template <int Chains>
__global__ void mma_sync_kernel(float* sink, int steps) {
    const uint32_t a0 = 0x3C003C00u + (threadIdx.x & 7), a1 = a0 ^ 1u, a2 = a0 ^ 2u, a3 = a0 ^ 3u, b0 = a0 ^ 4u,
                   b1 = a0 ^ 5u;
    float c[Chains][4] = {};
    for (int step = 0; step < steps; ++step) {
#pragma unroll
        for (int j = 0; j < kChain; ++j) mma_bf16_16816(c[j % Chains], a0, a1, a2, a3, b0, b1);
    }
    float sum = 0.f;
    for (auto& acc : c) sum += acc[0] + acc[1] + acc[2] + acc[3];
    if (sum == 1.2345f) sink[threadIdx.x] = sum;
}

// One timed launch after a shorter warm-up launch: each runs for milliseconds, far above the launch cost.
template <typename Kernel>
cudaError_t time_kernel(Kernel kernel, int ctas, int threads, int smem, float* sink, int steps, float* ms) {
    cudaEvent_t start = nullptr, stop = nullptr;
    DDTREE_RETURN_IF_ERROR(cudaEventCreate(&start));
    cudaError_t status = cudaEventCreate(&stop);
    auto then = [&status](cudaError_t next) {
        if (status == cudaSuccess) status = next;
    };
    if (status == cudaSuccess) {
        kernel<<<ctas, threads, smem>>>(sink, steps / 8);
        then(cudaGetLastError());
        then(cudaEventRecord(start));
        kernel<<<ctas, threads, smem>>>(sink, steps);
        then(cudaGetLastError());
        then(cudaEventRecord(stop));
        then(cudaEventSynchronize(stop));
        then(cudaEventElapsedTime(ms, start, stop));
        then(cudaEventDestroy(stop));
    }
    then(cudaEventDestroy(start));
    return status;
}

constexpr int kSteps = 20000;
constexpr int kSmem = 20 * 1024;  // the operands and the 1024-byte alignment, under the 48 KB default

template <int N, bool kRegisterA>
cudaError_t report_wgmma(int sms, float* sink) {
    for (int groups = 1; groups <= 3; ++groups) {
        float ms = 0.f;
        DDTREE_RETURN_IF_ERROR(time_kernel(wgmma_kernel<N, kRegisterA>, sms, 128 * groups, kSmem, sink, kSteps, &ms));
        const double mmas = static_cast<double>(kSteps) * kChain * groups;  // per SM
        const double flops = 2.0 * 64 * N * 16 * mmas * sms;
        std::printf("wgmma_%s m64n%dk16 %d %.1f %.2f\n", kRegisterA ? "rs" : "ss", N, groups, flops / ms / 1e9,
                    ms * 1e6 / mmas);
    }
    return cudaSuccess;
}

template <int Chains>
cudaError_t report_mma_sync(int sms, float* sink) {
    for (int warps : {4, 8, 16}) {
        float ms = 0.f;
        DDTREE_RETURN_IF_ERROR(time_kernel(mma_sync_kernel<Chains>, sms, 32 * warps, 0, sink, kSteps, &ms));
        const double per_scheduler = static_cast<double>(kSteps) * kChain * warps / 4;
        const double flops = 2.0 * 16 * 8 * 16 * kSteps * kChain * warps * sms;
        std::printf("mma_sync_chains%d m16n8k16 %d %.1f %.2f\n", Chains, warps, flops / ms / 1e9,
                    ms * 1e6 / per_scheduler);
    }
    return cudaSuccess;
}

cudaError_t report_all() {
    int sms = 0;
    DDTREE_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float* sink = nullptr;
    DDTREE_RETURN_IF_ERROR(cudaMalloc(&sink, 1024 * sizeof(float)));
    for (auto report : {report_mma_sync<1>, report_mma_sync<8>, report_wgmma<32, false>, report_wgmma<64, false>,
                        report_wgmma<8, true>, report_wgmma<16, true>, report_wgmma<24, true>,
                        report_wgmma<32, true>, report_wgmma<64, true>}) {
        const cudaError_t status = report(sms, sink);
        if (status != cudaSuccess) {
            cudaFree(sink);
            return status;
        }
    }
    return cudaFree(sink);
}

}  // namespace

int main() {
    const cudaError_t status = report_all();
    if (status != cudaSuccess) {
        std::fprintf(stderr, "mma_rates: %s\n", cudaGetErrorString(status));
        return 1;
    }
    return 0;
}
