// INT4 grouped MoE GEMMs (swap-AB: dequantized weights are the m16 MMA operand, tokens the n8 one),
// the fixed-order top-k combine, and the device dequantization oracle. Layout: see moe_marlin.cuh.
//
// Schedule: a persistent grid pulls units (token block, stripe) from a counter that moe_align resets;
// each unit streams its contiguous weight stripe once through a shared-memory ring: one bulk copy (TMA,
// cp.async.bulk) per 9 KB stage chunk, completing on that slot's mbarrier and marked evict-first in L2,
// and the gathered activations of up to 64 tokens by per-thread cp.async. The stage count per unit follows
// the unit's token count (fewer tokens -> deeper weight pipeline). Which CTA runs a unit, and how many
// token columns it pads to, never changes the arithmetic of a column, so results are batch invariant.
#include "moe_marlin.cuh"

#include "gemm_mma.cuh"

namespace ddtree::kernels::moe {
namespace {

constexpr int kThreads = 256;
constexpr int kRingBytes = 110 * 1024;  // two CTAs per SM fit in 228 KB
constexpr int kActRowBytes = kStageK * 2;

constexpr int act_stage_bytes(int nt) { return nt * 8 * kActRowBytes; }
constexpr int stage_count(int nt) {
    return kRingBytes / (kStageBytes + act_stage_bytes(nt)) < 10 ? kRingBytes / (kStageBytes + act_stage_bytes(nt))
                                                                   : 10;
}
static_assert(stage_count(8) >= 3, "ring too small for the widest token block");
static_assert(kBlockTokens * kStripeRows * 4 <= kRingBytes, "epilogue tile must fit in the ring");

// L2 policy "evict first, whole line" (the value createpolicy.fractional.L2::evict_first 1.0 yields, as
// CUTLASS also passes it). Weights are read once per call, so they should not push activations out of L2.
// A constant, not createpolicy: with ptxas 13.0 the createpolicy form of a hinted copy referenced uniform
// registers that were never written (seen in the SASS; it faulted on an H200).
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
constexpr int kMaxStages = 10;

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)));
}

// Waits until phase `parity` of the barrier completed; the completed bulk copy is then visible to this thread.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred done;\n WAIT_PHASE:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_PHASE;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// One thread: arms `bar` for `bytes` and starts one bulk copy global -> shared that completes on it.
__device__ __forceinline__ void bulk_load_weights(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(kL2EvictFirst)
        : "memory");
}





__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 as_bf16x2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// (a & mask) | bits as one LOP3; written out because the compiler emits an AND and an OR for it.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
}

// One k16 step of one lane's A fragment: nibble pairs (i, i + 4) become the two bf16 halves of register
// i. OR-ing a nibble into the mantissa of 128.0 gives exactly 128 + q; subtracting 136 gives q - 8
// exactly; one rounded multiply gives bf16((q - 8) * s).
__device__ __forceinline__ void dequant_k16(uint32_t q, __nv_bfloat162 s_lo, __nv_bfloat162 s_hi,
                                            uint32_t (&a)[4]) {
    constexpr uint32_t kMask = 0x000F000Fu, kMagic = 0x43004300u;  // bf16 128.0 in both halves
    const __nv_bfloat162 bias = __float2bfloat162_rn(136.f);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 v = __hsub2_rn(as_bf16x2(and_or(q >> (4 * i), kMask, kMagic)), bias);
        a[i] = bf16x2_bits(__hmul2_rn(v, (i & 1) ? s_hi : s_lo));
    }
}

// Scales of one lane for one stage: sc holds rows g (groups 0..3) then g + 8 (groups 0..3).
__device__ __forceinline__ __nv_bfloat162 scale_pair(const uint4& sc, int group, bool high_row) {
    const uint32_t word = high_row ? (group < 2 ? sc.z : sc.w) : (group < 2 ? sc.x : sc.y);
    const uint16_t bits = static_cast<uint16_t>((group & 1) ? word >> 16 : word & 0xFFFFu);
    const __nv_bfloat16 s = __ushort_as_bfloat16(bits);
    return __bfloat162bfloat162(s);
}

struct GemmParams {
    const uint8_t* weights;   // repacked, stripes contiguous
    const bf16* act_in;       // GEMM1: hidden [tokens, k]; GEMM2: act [pairs, k]
    int k;                    // reduction length
    int stripes;              // stripes per expert
    int topk;
    const int* sorted_pairs;
    const int4* blocks;
    const int* num_blocks;
    int* next_unit;
    bf16* act_out;            // GEMM1 epilogue target [pairs, inter]
    int inter;
    float* contrib_out;       // GEMM2 epilogue target [pairs, hidden]
    int hidden;
    const float* topk_weights;
    float scaling;
};

struct UnitShared {
    uint64_t full[kMaxStages];         // per ring slot: the stage's weight chunk has landed
    const bf16* rows[kBlockTokens];    // activation row to gather (token or pair), nullptr pads
    int pairs[kBlockTokens];           // -1 pads the block
    float weight[kBlockTokens];
    int unit;
};

// phase_bits: bit s = parity of the next completion of ring slot s's barrier; every thread keeps the same copy
// across units (a unit consumes every stage it loads, so no copy is in flight between units).
template <int NT, bool kGateUp>
__device__ void run_unit(const GemmParams& p, const int4 blk, int stripe, uint8_t* ring, UnitShared& us,
                         uint32_t& phase_bits) {
    constexpr int kStages = stage_count(NT);
    constexpr int kSlotBytes = kStageBytes + act_stage_bytes(NT);
    constexpr int kRows = NT * 8;
    constexpr int kActChunks = kRows * (kActRowBytes / 16);
    static_assert(kStages <= kMaxStages && kSlotBytes % 16 == 0, "ring slots must be 16-byte aligned");
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int nk = p.k / kStageK;
    const uint8_t* wsrc = p.weights + (static_cast<size_t>(blk.x) * p.stripes + stripe) * nk * kStageBytes;

    auto load_act = [&](int ks, int slot) {
        uint8_t* adst = ring + slot * kSlotBytes + kStageBytes;
#pragma unroll
        for (int i = 0; i < (kActChunks + kThreads - 1) / kThreads; ++i) {
            const int c = tid + i * kThreads;
            if (kActChunks % kThreads == 0 || c < kActChunks) {
                const int r = c / (kActRowBytes / 16), ch = c % (kActRowBytes / 16);
                const bf16* row = us.rows[r];
                // 16-byte chunks of a token row are XOR-swizzled by row so ldmatrix reads are conflict-free.
                cp_async16_zfill(adst + r * kActRowBytes + ((ch ^ (r & 7)) * 16),
                                 (row ? row : p.act_in) + ks * kStageK + ch * 8, row != nullptr);
            }
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
    }

    // The weight prologue depends only on the expert: it streams while the unit's token list is read.
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) {
            if (s < nk) bulk_load_weights(ring + s * kSlotBytes, wsrc + static_cast<size_t>(s) * kStageBytes,
                                          kStageBytes, &us.full[s]);
        }
    }
    if (tid < kBlockTokens) {
        const int pair = tid < blk.z ? p.sorted_pairs[blk.y + tid] : -1;
        us.pairs[tid] = pair;
        us.rows[tid] = pair < 0 ? nullptr : p.act_in + static_cast<size_t>(kGateUp ? pair / p.topk : pair) * p.k;
        if (!kGateUp) us.weight[tid] = pair < 0 ? 0.f : p.topk_weights[pair] * p.scaling;
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < nk) load_act(s, s);
        cp_async_commit();
    }

    const int g = lane / 4;
    for (int ks = 0; ks < nk; ++ks) {
        const int cur = ks % kStages;
        cp_async_wait<kStages - 2>();
        mbar_wait(&us.full[cur], (phase_bits >> cur) & 1u);
        phase_bits ^= 1u << cur;
        __syncthreads();  // every thread's activation chunks landed; the slot refilled below is free
        {
            const int next = ks + kStages - 1;
            if (next < nk) {
                uint8_t* dst = ring + (next % kStages) * kSlotBytes;
                if (tid == 0) {
                    bulk_load_weights(dst, wsrc + static_cast<size_t>(next) * kStageBytes, kStageBytes,
                                      &us.full[next % kStages]);
                }
                load_act(next, next % kStages);
            }
            cp_async_commit();
        }
        const uint8_t* slot = ring + cur * kSlotBytes;
        const uint4 sc = *reinterpret_cast<const uint4*>(slot + kStageWeightBytes + (warp * 8 + g) * 16);
        const uint8_t* act = slot + kStageBytes;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const uint4 wq = *reinterpret_cast<const uint4*>(slot + ((warp * 2 + half) * 32 + lane) * 16);
#pragma unroll
            for (int pairk = 0; pairk < 2; ++pairk) {
                const int q32 = half * 2 + pairk;  // k32 sub-step of the stage == scale group
                const __nv_bfloat162 s_lo = scale_pair(sc, q32, false), s_hi = scale_pair(sc, q32, true);
                uint32_t a0[4], a1[4];
                dequant_k16(pairk ? wq.z : wq.x, s_lo, s_hi, a0);
                dequant_k16(pairk ? wq.w : wq.y, s_lo, s_hi, a1);
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int r = n * 8 + (lane & 7);
                    const int ch = q32 * 4 + (lane >> 3);
                    uint32_t b[4];
                    ldmatrix_x4(b, act + r * kActRowBytes + ((ch ^ (r & 7)) * 16));
                    mma_bf16_16816(acc[n], a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
                    mma_bf16_16816(acc[n], a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: reuse it as the epilogue tile

    const int t = lane % 4;
    if constexpr (kGateUp) {
        // c0/c1: gate feature 8*warp+g, tokens 2t/2t+1; c2/c3: the matching up feature.
        constexpr int kCols = kStripeRows / 2;
        bf16* tile = reinterpret_cast<bf16*>(ring);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float gate = acc[n][h], up = acc[n][2 + h];
                const float silu = gate / (1.f + expf(-gate));
                tile[(n * 8 + 2 * t + h) * kCols + warp * 8 + g] = __float2bfloat16_rn(silu * up);
            }
        }
        __syncthreads();
        for (int c = tid; c < kRows * (kCols / 8); c += kThreads) {
            const int r = c / (kCols / 8), ch = c % (kCols / 8);
            const int pair = us.pairs[r];
            if (pair >= 0) {
                *reinterpret_cast<uint4*>(p.act_out + static_cast<size_t>(pair) * p.inter + stripe * kCols + ch * 8) =
                    *reinterpret_cast<const uint4*>(tile + r * kCols + ch * 8);
            }
        }
    } else {
        // c0/c1: output feature 16*warp+g, tokens 2t/2t+1; c2/c3: feature + 8.
        float* tile = reinterpret_cast<float*>(ring);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = n * 8 + 2 * t + (i & 1);
                tile[r * kStripeRows + warp * 16 + g + 8 * (i >> 1)] = acc[n][i] * us.weight[r];
            }
        }
        __syncthreads();
        for (int c = tid; c < kRows * (kStripeRows / 4); c += kThreads) {
            const int r = c / (kStripeRows / 4), ch = c % (kStripeRows / 4);
            const int pair = us.pairs[r];
            if (pair >= 0) {
                *reinterpret_cast<float4*>(p.contrib_out + static_cast<size_t>(pair) * p.hidden +
                                           stripe * kStripeRows + ch * 4) =
                    *reinterpret_cast<const float4*>(tile + r * kStripeRows + ch * 4);
            }
        }
    }
    // The next unit's bulk copies (async proxy) overwrite the tile written here by ordinary stores.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // tile and unit data are reused by the next unit
}

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 2) moe_gemm_kernel(const GemmParams p) {
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ UnitShared us;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kMaxStages; ++s) mbar_init(&us.full[s]);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    const int total = *p.num_blocks * p.stripes;
    uint32_t phase_bits = 0;
    int claimed = 0;  // thread 0: the unit this CTA runs next
    if (threadIdx.x == 0) claimed = atomicAdd(p.next_unit, 1);
    for (;;) {
        if (threadIdx.x == 0) us.unit = claimed;
        __syncthreads();
        const int unit = us.unit;
        if (unit >= total) break;
        // Claim the following unit now, so the atomic's latency hides behind this unit's stream.
        if (threadIdx.x == 0) claimed = atomicAdd(p.next_unit, 1);
        const int4 blk = p.blocks[unit / p.stripes];
        const int stripe = unit % p.stripes;
        switch ((blk.z + 7) / 8) {
            case 1: run_unit<1, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
            case 2: run_unit<2, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
            case 3: run_unit<3, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
            case 4: run_unit<4, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
            case 5: run_unit<5, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
            case 6: run_unit<6, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
            case 7: run_unit<7, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
            default: run_unit<8, kGateUp>(p, blk, stripe, ring, us, phase_bits); break;
        }
    }
}

// out[token] = bf16(sum over slots s = 0..topk-1, in order, of contrib[token * topk + s]); skipped slots add
// nothing.
__global__ void __launch_bounds__(256) moe_combine_kernel(bf16* __restrict__ out, const float* __restrict__ contrib,
                                                          const int32_t* __restrict__ topk_ids,
                                                          const uint8_t* __restrict__ mask, int experts, int topk,
                                                          int hidden) {
    __shared__ bool used[kMaxTopk];
    const size_t token = blockIdx.x;
    if (threadIdx.x < topk) {
        const int e = topk_ids[token * topk + threadIdx.x];
        used[threadIdx.x] = e >= 0 && e < experts && (mask == nullptr || mask[e] != 0);
    }
    __syncthreads();
    for (int h = threadIdx.x * 4; h < hidden; h += blockDim.x * 4) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < topk; ++s) {
            if (!used[s]) continue;
            const float4 v = *reinterpret_cast<const float4*>(contrib + (token * topk + s) * hidden + h);
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + token * hidden + h);
        dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
        dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
    }
}

// One CTA per (stripe, expert); every lane expands exactly the fragments the GEMM would give it.
__global__ void __launch_bounds__(kThreads) dequantize_kernel(bf16* __restrict__ out, const uint8_t* __restrict__ w,
                                                              int k, int stripes, bool gate_up, int inter) {
    const int stripe = blockIdx.x, expert = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int nk = k / kStageK;
    const int rows = stripes * kStripeRows;
    const uint8_t* src = w + (static_cast<size_t>(expert) * stripes + stripe) * nk * kStageBytes;
    bf16* dst = out + static_cast<size_t>(expert) * rows * k;
    auto out_row = [&](int r) {  // tile row -> checkpoint row
        if (!gate_up) return stripe * kStripeRows + warp * 16 + r;
        const int f = stripe * (kStripeRows / 2) + warp * 8 + (r & 7);
        return r < 8 ? f : inter + f;
    };
    for (int ks = 0; ks < nk; ++ks) {
        const uint8_t* stage = src + static_cast<size_t>(ks) * kStageBytes;
        const uint4 sc = *reinterpret_cast<const uint4*>(stage + kStageWeightBytes + (warp * 8 + g) * 16);
        for (int half = 0; half < 2; ++half) {
            const uint4 wq = *reinterpret_cast<const uint4*>(stage + ((warp * 2 + half) * 32 + lane) * 16);
            const uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
            for (int j = 0; j < 4; ++j) {
                const int group = half * 2 + j / 2;
                uint32_t a[4];
                dequant_k16(words[j], scale_pair(sc, group, false), scale_pair(sc, group, true), a);
                const int kb = ks * kStageK + (half * 4 + j) * 16 + 2 * t;
                for (int i = 0; i < 4; ++i) {
                    const int r = g + 8 * (i & 1), kk = kb + 8 * (i >> 1);
                    *reinterpret_cast<uint32_t*>(dst + static_cast<size_t>(out_row(r)) * k + kk) = a[i];
                }
            }
        }
    }
}

}  // namespace

size_t workspace_bytes(int experts, int hidden, int inter, int topk, int max_tokens) {
    const size_t pairs = static_cast<size_t>(max_tokens) * topk;
    auto up = [](size_t b) { return (b + 255) / 256 * 256; };
    return up(pairs * 4) * 2 + up(static_cast<size_t>(max_blocks(experts, static_cast<int>(pairs))) * 16) + up(16) +
           up(pairs * inter * 2) + up(pairs * hidden * 4);
}

Workspace carve_workspace(void* base, int experts, int hidden, int inter, int topk, int max_tokens) {
    const size_t pairs = static_cast<size_t>(max_tokens) * topk;
    auto up = [](size_t b) { return (b + 255) / 256 * 256; };
    uint8_t* p = static_cast<uint8_t*>(base);
    Workspace ws;
    ws.pair_rank = reinterpret_cast<int*>(p);
    p += up(pairs * 4);
    ws.sorted_pairs = reinterpret_cast<int*>(p);
    p += up(pairs * 4);
    ws.blocks = reinterpret_cast<int4*>(p);
    p += up(static_cast<size_t>(max_blocks(experts, static_cast<int>(pairs))) * 16);
    ws.counters = reinterpret_cast<int*>(p);
    p += up(16);
    ws.act = reinterpret_cast<bf16*>(p);
    p += up(pairs * inter * 2);
    ws.contrib = reinterpret_cast<float*>(p);
    return ws;
}

cudaError_t configure(int device, int* gemm_ctas) {
    DDTREE_RETURN_IF_ERROR(cudaSetDevice(device));
    DDTREE_RETURN_IF_ERROR(
        cudaFuncSetAttribute(moe_gemm_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes));
    DDTREE_RETURN_IF_ERROR(
        cudaFuncSetAttribute(moe_gemm_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes));
    int sms = 0, per_sm_gate = 0, per_sm_down = 0;
    DDTREE_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    DDTREE_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_gate, moe_gemm_kernel<true>, kThreads, kRingBytes));
    DDTREE_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_down, moe_gemm_kernel<false>, kThreads, kRingBytes));
    const int per_sm = per_sm_gate < per_sm_down ? per_sm_gate : per_sm_down;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    *gemm_ctas = sms * per_sm;
    return cudaSuccess;
}

cudaError_t moe_forward(const MoeArgs& a, const Workspace& ws, int gemm_ctas, cudaStream_t stream) {
    if (a.tokens == 0) return cudaSuccess;
    DDTREE_RETURN_IF_ERROR(moe_align(a.topk_ids, a.expert_mask, a.tokens, a.topk, a.experts, ws, stream));

    GemmParams p{};
    p.topk = a.topk;
    p.sorted_pairs = ws.sorted_pairs;
    p.blocks = ws.blocks;
    p.num_blocks = ws.counters;
    p.inter = a.inter;
    p.hidden = a.hidden;
    p.topk_weights = a.topk_weights;
    p.scaling = a.routed_scaling_factor;
    p.act_out = ws.act;
    p.contrib_out = ws.contrib;

    p.weights = a.w13;
    p.act_in = a.hidden_states;
    p.k = a.hidden;
    p.stripes = 2 * a.inter / kStripeRows;
    p.next_unit = ws.counters + 1;
    moe_gemm_kernel<true><<<gemm_ctas, kThreads, kRingBytes, stream>>>(p);
    DDTREE_RETURN_IF_ERROR(cudaGetLastError());

    p.weights = a.w2;
    p.act_in = ws.act;
    p.k = a.inter;
    p.stripes = a.hidden / kStripeRows;
    p.next_unit = ws.counters + 2;
    moe_gemm_kernel<false><<<gemm_ctas, kThreads, kRingBytes, stream>>>(p);
    DDTREE_RETURN_IF_ERROR(cudaGetLastError());

    moe_combine_kernel<<<a.tokens, 256, 0, stream>>>(a.out, ws.contrib, a.topk_ids, a.expert_mask, a.experts, a.topk,
                                                     a.hidden);
    return cudaGetLastError();
}

cudaError_t dequantize_w13(bf16* out, const uint8_t* w13, int experts, int hidden, int inter, cudaStream_t stream) {
    if (experts == 0) return cudaSuccess;
    dequantize_kernel<<<dim3(2 * inter / kStripeRows, experts), kThreads, 0, stream>>>(
        out, w13, hidden, 2 * inter / kStripeRows, true, inter);
    return cudaGetLastError();
}

cudaError_t dequantize_w2(bf16* out, const uint8_t* w2, int experts, int hidden, int inter, cudaStream_t stream) {
    if (experts == 0) return cudaSuccess;
    dequantize_kernel<<<dim3(hidden / kStripeRows, experts), kThreads, 0, stream>>>(out, w2, inter,
                                                                                     hidden / kStripeRows, false, 0);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels::moe
