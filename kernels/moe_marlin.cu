// INT4 grouped MoE GEMMs (swap-AB: dequantized weights are the m16 MMA operand, tokens the n8 one),
// the fixed-order top-k combine, and the device dequantization oracle. Layout: see moe_marlin.cuh.
//
// Schedule: a persistent grid runs units (token block, S adjacent stripes); a CTA's first unit is its block
// index, later ones come from a counter that moe_align resets (calls of at most kCtaAlignPairs pairs: a static
// stride, see below). Each unit streams its S contiguous weight stripes once through a shared-memory ring: per
// stage one bulk copy (TMA, cp.async.bulk) per stripe chunk, completing on that slot's mbarrier and marked
// evict-first in L2, and the gathered activations of up to 64 tokens by per-thread cp.async, shared by the S
// stripes (S = 2 halves activation traffic and per-byte overhead; S = 1 when there are too few units to fill
// the grid). The stage count per unit follows its token count. Which CTA runs a unit, S, and how many token
// columns it pads to never change the arithmetic of a column (one MMA chain over k in order per output), so
// results are batch invariant.
//
// Dependent launches: align -> GEMM1 -> GEMM2 -> combine are each launched while the previous kernel runs.
// Each kernel waits (grid_dependency_wait) before touching what earlier kernels write, except GEMM2's
// start: GEMM1 releases GEMM2 only after its own wait, so align's block list is complete and GEMM2 claims
// its first unit and streams that unit's weights before waiting for GEMM1's activations. Every CTA waits
// before it exits, so a kernel's completion implies its predecessors' completion.
//
// Decode-size calls (at most kCtaAlignPairs (token, slot) pairs) skip moe_align: one warp of every GEMM CTA
// aligns the routing itself in a few warp instructions, which costs less than a dependent launch of align's
// single CTA and its completion. GEMM2 does this before its wait too: topk_ids come from before the call, and
// GEMM1 releases GEMM2 only after its own wait.
#include "moe_marlin.cuh"

#include <algorithm>

#include "gemm_mma.cuh"

namespace ddtree::kernels::moe {
namespace {

constexpr int kThreads = 256;
constexpr int kRingBytes = 110 * 1024;  // two CTAs per SM fit in 228 KB
constexpr int kActRowBytes = kStageK * 2;

constexpr int kMaxStages = 10;
constexpr int kCtaAlignPairs = 32;  // one lane per pair
static_assert(kCtaAlignPairs <= kPairedMaxTiles * 8, "a CTA-aligned expert fits one narrow block");

constexpr int act_stage_bytes(int nt) { return nt * 8 * kActRowBytes; }
constexpr int slot_bytes(int nt, int s) { return s * kStageBytes + act_stage_bytes(nt); }
constexpr int stage_count(int nt, int s) {
    return kRingBytes / slot_bytes(nt, s) < kMaxStages ? kRingBytes / slot_bytes(nt, s) : kMaxStages;
}
static_assert(stage_count(8, 1) >= 3 && stage_count(kPairedMaxTiles, 2) >= 3, "ring too small for the widest block");
static_assert(kBlockTokens * kStripeRows * 4 <= kRingBytes &&
                  kPairedMaxTiles * 8 * 2 * kStripeRows * 4 <= kRingBytes,
              "epilogue tile must fit in the ring");

// One thread: arms `bar` for the stage's `stripes` chunks (each kStageBytes, `stride` bytes apart in global
// memory, adjacent in shared memory) and starts one bulk copy per chunk, all completing on `bar`.
__device__ __forceinline__ void bulk_load_weights(uint8_t* dst, const uint8_t* src, int stripes, size_t stride,
                                                  uint64_t* bar) {
    barrier_arrive_expect_tx(bar, stripes * kStageBytes);
    for (int s = 0; s < stripes; ++s) bulk_copy_streamed(dst + s * kStageBytes, src + s * stride, kStageBytes, bar);
}

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
    const int* sorted_pairs;  // moe_align's routing (unused by the kAlignInCta instances)
    const int4* blocks;
    const int* block_counts;  // [0] token blocks, [3] wide blocks (see Workspace::counters)
    int* next_unit;
    const int32_t* topk_ids;
    const uint8_t* expert_mask;
    int pairs, experts;
    bf16* act_out;            // GEMM1 epilogue target [pairs, inter]
    int inter;
    float* contrib_out;       // GEMM2 epilogue target [pairs, hidden]
    int hidden;
    const float* topk_weights;
    float scaling;
};

// A call's token blocks, from moe_align (global memory) or from align_in_warp (this CTA's shared memory).
struct Routing {
    const int4* blocks;
    const int* sorted_pairs;
    int count, wide;
};

// Shared-memory result of align_in_warp.
struct CtaRouting {
    int4 blocks[kCtaAlignPairs];
    int sorted_pairs[kCtaAlignPairs];
    int count;
};

// Routing alignment of a call of at most kCtaAlignPairs pairs by one warp, lane = pair: each used expert's pairs
// form one block (narrow: at most 32 tokens), in lane order; blocks come in the order of their experts' first
// pairs. Same skipping rule as moe_align (ids outside [0, experts), masked experts).
__device__ void align_in_warp(const GemmParams& p, CtaRouting& r) {
    constexpr uint32_t kAll = 0xffffffffu;
    const int lane = threadIdx.x % 32;
    int e = -1;
    bool used = false;
    if (lane < p.pairs) {
        e = p.topk_ids[lane];
        used = routed(e, p.experts, p.expert_mask);
    }
    const uint32_t peers = __match_any_sync(kAll, used ? e : -1 - lane);  // skipped pairs match no other lane
    const uint32_t used_lanes = __ballot_sync(kAll, used);
    const uint32_t below = (1u << lane) - 1u;
    const int leader = __ffs(peers) - 1;
    const bool leads = used && leader == lane;
    const uint32_t leaders = __ballot_sync(kAll, leads);
    int start = 0;  // pairs of the experts whose first pair comes earlier
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int leader_j = __shfl_sync(kAll, leader, j);
        start += ((used_lanes >> j) & 1u) != 0 && leader_j < leader;
    }
    if (used) r.sorted_pairs[start + __popc(peers & below)] = lane;
    if (leads) r.blocks[__popc(leaders & below)] = make_int4(e, start, __popc(peers), 0);
    if (lane == 0) r.count = __popc(leaders);
}

struct UnitShared {
    uint64_t full[kMaxStages];         // per ring slot: the stage's S weight chunks have landed
    const bf16* rows[kBlockTokens];    // activation row to gather (token or pair), nullptr pads
    int pairs[kBlockTokens];           // -1 pads the block
    float weight[kBlockTokens];
    int unit;
};

// Unit ids: first every stripe of each wide block (align lists those first), then the narrow blocks' stripes
// S at a time (S = 2 unless that leaves more than a fifth of the grid without a first unit).
struct UnitMap {
    int wide_units, narrow_stripes, narrow_units_per_block, total;
};

struct Unit {
    int4 blk;          // {expert, first sorted index, tokens, 0}
    const int* pairs;  // the block's pair ids (blk.z of them)
    int stripe0;       // first stripe
    int stripes;       // 1 or 2
};

__device__ __forceinline__ UnitMap make_unit_map(const GemmParams& p, const Routing& r) {
    UnitMap m;
    const int narrow_blocks = r.count - r.wide;
    m.wide_units = r.wide * p.stripes;
    const bool paired = p.stripes % 2 == 0 &&
                        5 * (m.wide_units + narrow_blocks * (p.stripes / 2)) >= 4 * static_cast<int>(gridDim.x);
    m.narrow_stripes = paired ? 2 : 1;
    m.narrow_units_per_block = p.stripes / m.narrow_stripes;
    m.total = m.wide_units + narrow_blocks * m.narrow_units_per_block;
    return m;
}

__device__ __forceinline__ Unit locate(const GemmParams& p, const Routing& r, const UnitMap& m, int unit) {
    if (unit < m.wide_units) {
        const int4 blk = r.blocks[unit / p.stripes];
        return {blk, r.sorted_pairs + blk.y, unit % p.stripes, 1};
    }
    const int u = unit - m.wide_units;
    const int4 blk = r.blocks[r.wide + u / m.narrow_units_per_block];
    return {blk, r.sorted_pairs + blk.y, u % m.narrow_units_per_block * m.narrow_stripes, m.narrow_stripes};
}

// The thread that claims units: outside warp 0, one of whose lanes issues the bulk copies, so waiting for the
// claim's atomic never delays a stage's copies.
constexpr int kSchedulerThread = 32;

// What a CTA carries from unit to unit.
struct CtaState {
    uint32_t phase_bits;   // bit s = parity of the next completion of ring slot s's barrier (same in every thread;
                           // a unit consumes every stage it loads, so no copy is in flight between units)
    bool wait_before_act;  // the CTA has not yet waited for the previous kernel: wait before reading activations
    int next_unit;         // scheduler thread only: the unit this CTA runs next
};

// Runs one unit: token block u.blk against stripes u.stripe0 .. u.stripe0 + S - 1 of its expert.
template <int NT, int S, bool kGateUp>
__device__ void run_unit(const GemmParams& p, const Unit& u, uint8_t* ring, UnitShared& us, CtaState& cta) {
    constexpr int kStages = stage_count(NT, S);
    constexpr int kSlotBytes = slot_bytes(NT, S);
    constexpr int kRows = NT * 8;
    constexpr int kActChunks = kRows * (kActRowBytes / 16);
    static_assert(kStages <= kMaxStages && kSlotBytes % 16 == 0, "ring slots must be 16-byte aligned");
    const int4 blk = u.blk;
    const int stripe0 = u.stripe0;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // Warp 0 issues the weight copies (one elected lane). Tested on the warp index broadcast from lane 0, which the
    // compiler then knows to be warp-uniform, so that warps 1-7 branch past the copy block.
    const bool copying_warp = __shfl_sync(0xffffffffu, warp, 0) == 0;
    const int nk = p.k / kStageK;
    const size_t stripe_bytes = static_cast<size_t>(nk) * kStageBytes;
    const uint8_t* wsrc = p.weights + (static_cast<size_t>(blk.x) * p.stripes + stripe0) * stripe_bytes;

    // A thread's activation chunks keep their token rows and places over the unit: found once below, they are
    // only advanced by kStageK columns per stage.
    constexpr int kActPerThread = (kActChunks + kThreads - 1) / kThreads;
    const bf16* act_src[kActPerThread];
    uint32_t act_dst[kActPerThread];  // byte offset in a slot's activation stage
    bool act_row[kActPerThread];      // a token's row, not a pad (zero-filled)
    auto load_act = [&](int ks, int slot) {
        uint8_t* adst = ring + slot * kSlotBytes + S * kStageBytes;
#pragma unroll
        for (int i = 0; i < kActPerThread; ++i) {
            if (kActChunks % kThreads == 0 || tid + i * kThreads < kActChunks) {
                cp_async16_zfill(adst + act_dst[i], act_src[i] + ks * kStageK, act_row[i]);
            }
        }
    };

    float acc[S][NT][4];
#pragma unroll
    for (int st = 0; st < S; ++st) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[st][n][i] = 0.f;
        }
    }

    // The weight prologue depends only on the expert: it streams while the unit's token list is read.
    if (copying_warp && elect_one_lane()) {
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) {
            if (s < nk) bulk_load_weights(ring + s * kSlotBytes, wsrc + static_cast<size_t>(s) * kStageBytes, S,
                                          stripe_bytes, &us.full[s]);
        }
    }
    if (tid < kBlockTokens) {
        const int pair = tid < blk.z ? u.pairs[tid] : -1;
        us.pairs[tid] = pair;
        us.rows[tid] = pair < 0 ? nullptr : p.act_in + static_cast<size_t>(kGateUp ? pair / p.topk : pair) * p.k;
        if (!kGateUp) us.weight[tid] = pair < 0 ? 0.f : p.topk_weights[pair] * p.scaling;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kActPerThread; ++i) {
        const int c = tid + i * kThreads;
        const int r = c / (kActRowBytes / 16), ch = c % (kActRowBytes / 16);
        const bf16* row = c < kActChunks ? us.rows[r] : nullptr;
        act_row[i] = row != nullptr;
        act_src[i] = (row ? row : p.act_in) + ch * 8;
        // 16-byte chunks of a token row are XOR-swizzled by row so ldmatrix reads are conflict-free.
        act_dst[i] = r * kActRowBytes + ((ch ^ (r & 7)) * 16);
    }
    if (cta.wait_before_act) grid_dependency_wait();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < nk) load_act(s, s);
        cp_async_commit();
    }

    const int g = lane / 4;
    // Stage ks is in slot `cur`; the slot refilled during it (with stage ks + kStages - 1) is the one stage ks - 1
    // used. Running counters, not ks modulo kStages: the stage loop is short and mostly dequantization.
    int cur = 0, refill = kStages - 1;
    size_t refill_offset = static_cast<size_t>(kStages - 1) * kStageBytes;  // of stage ks + kStages - 1 in a stripe
    for (int ks = 0; ks < nk; ++ks) {
        cp_async_wait<kStages - 2>();
        barrier_wait(&us.full[cur], (cta.phase_bits >> cur) & 1u);
        cta.phase_bits ^= 1u << cur;
        __syncthreads();  // every thread's activation chunks landed; the slot refilled below is free
        if (ks + kStages - 1 < nk) {
            if (copying_warp && elect_one_lane()) {
                bulk_load_weights(ring + refill * kSlotBytes, wsrc + refill_offset, S, stripe_bytes, &us.full[refill]);
            }
            load_act(ks + kStages - 1, refill);
        }
        cp_async_commit();
        refill_offset += kStageBytes;
        const uint8_t* slot = ring + cur * kSlotBytes;
        const uint8_t* act = slot + S * kStageBytes;
        uint4 sc[S];
#pragma unroll
        for (int st = 0; st < S; ++st) {
            const uint8_t* scales = slot + st * kStageBytes + kStageWeightBytes;
            sc[st] = *reinterpret_cast<const uint4*>(scales + (warp * 8 + g) * 16);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            uint4 wq[S];
#pragma unroll
            for (int st = 0; st < S; ++st) {
                const uint8_t* weights = slot + st * kStageBytes;
                wq[st] = *reinterpret_cast<const uint4*>(weights + ((warp * 2 + half) * 32 + lane) * 16);
            }
#pragma unroll
            for (int pairk = 0; pairk < 2; ++pairk) {
                const int q32 = half * 2 + pairk;  // k32 sub-step of the stage == scale group
                uint32_t a0[S][4], a1[S][4];
#pragma unroll
                for (int st = 0; st < S; ++st) {
                    const __nv_bfloat162 s_lo = scale_pair(sc[st], q32, false), s_hi = scale_pair(sc[st], q32, true);
                    dequant_k16(pairk ? wq[st].z : wq[st].x, s_lo, s_hi, a0[st]);
                    dequant_k16(pairk ? wq[st].w : wq[st].y, s_lo, s_hi, a1[st]);
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int r = n * 8 + (lane & 7);
                    const int ch = q32 * 4 + (lane >> 3);
                    uint32_t b[4];
                    ldmatrix_x4(b, act + r * kActRowBytes + ((ch ^ (r & 7)) * 16));
#pragma unroll
                    for (int st = 0; st < S; ++st) {
                        mma_bf16_16816(acc[st][n], a0[st][0], a0[st][1], a0[st][2], a0[st][3], b[0], b[1]);
                        mma_bf16_16816(acc[st][n], a1[st][0], a1[st][1], a1[st][2], a1[st][3], b[2], b[3]);
                    }
                }
            }
        }
        refill = cur;
        cur = cur + 1 == kStages ? 0 : cur + 1;
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: reuse it as the epilogue tile

    const int t = lane % 4;
    if constexpr (kGateUp) {
        // c0/c1: gate feature 8*warp+g of stripe st, tokens 2t/2t+1; c2/c3: the matching up feature.
        constexpr int kCols = S * kStripeRows / 2;
        bf16* tile = reinterpret_cast<bf16*>(ring);
#pragma unroll
        for (int st = 0; st < S; ++st) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float gate = acc[st][n][h], up = acc[st][n][2 + h];
                    const float silu = gate / (1.f + expf(-gate));
                    tile[(n * 8 + 2 * t + h) * kCols + st * (kStripeRows / 2) + warp * 8 + g] =
                        __float2bfloat16_rn(silu * up);
                }
            }
        }
        __syncthreads();
        for (int c = tid; c < kRows * (kCols / 8); c += kThreads) {
            const int r = c / (kCols / 8), ch = c % (kCols / 8);
            const int pair = us.pairs[r];
            if (pair >= 0) {
                *reinterpret_cast<uint4*>(p.act_out + static_cast<size_t>(pair) * p.inter +
                                          stripe0 * (kStripeRows / 2) + ch * 8) =
                    *reinterpret_cast<const uint4*>(tile + r * kCols + ch * 8);
            }
        }
    } else {
        // c0/c1: output feature 16*warp+g of stripe st, tokens 2t/2t+1; c2/c3: feature + 8.
        constexpr int kCols = S * kStripeRows;
        float* tile = reinterpret_cast<float*>(ring);
#pragma unroll
        for (int st = 0; st < S; ++st) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = n * 8 + 2 * t + (i & 1);
                    tile[r * kCols + st * kStripeRows + warp * 16 + g + 8 * (i >> 1)] = acc[st][n][i] * us.weight[r];
                }
            }
        }
        __syncthreads();
        for (int c = tid; c < kRows * (kCols / 4); c += kThreads) {
            const int r = c / (kCols / 4), ch = c % (kCols / 4);
            const int pair = us.pairs[r];
            if (pair >= 0) {
                *reinterpret_cast<float4*>(p.contrib_out + static_cast<size_t>(pair) * p.hidden +
                                           stripe0 * kStripeRows + ch * 4) =
                    *reinterpret_cast<const float4*>(tile + r * kCols + ch * 4);
            }
        }
    }
    // The next unit's bulk copies (async proxy) overwrite the tile written here by ordinary stores.
    fence_proxy_async();
    __syncthreads();  // tile and unit data are reused by the next unit
}

// Dispatches on the block's 8-token tiles, 1..kMaxTiles (the caller guarantees the bound).
template <int S, int kMaxTiles, bool kGateUp>
__device__ void run_unit_of_width(const GemmParams& p, const Unit& u, uint8_t* ring, UnitShared& us,
                                  CtaState& cta) {
    const int tiles = (u.blk.z + 7) / 8;
    switch (tiles) {
        case 1: run_unit<1, S, kGateUp>(p, u, ring, us, cta); return;
        case 2: run_unit<2, S, kGateUp>(p, u, ring, us, cta); return;
        case 3: run_unit<3, S, kGateUp>(p, u, ring, us, cta); return;
        case 4: run_unit<4, S, kGateUp>(p, u, ring, us, cta); return;
    }
    if constexpr (kMaxTiles == 8) {
        switch (tiles) {
            case 5: run_unit<5, S, kGateUp>(p, u, ring, us, cta); return;
            case 6: run_unit<6, S, kGateUp>(p, u, ring, us, cta); return;
            case 7: run_unit<7, S, kGateUp>(p, u, ring, us, cta); return;
            default: run_unit<8, S, kGateUp>(p, u, ring, us, cta); return;
        }
    }
}

// kAlignInCta: a call of at most kCtaAlignPairs pairs, whose CTAs align the routing themselves (no moe_align
// launch). A separate instance, so that larger calls run code with no trace of that path.
template <bool kGateUp, bool kAlignInCta>
__global__ void __launch_bounds__(kThreads, 2) moe_gemm_kernel(const GemmParams p) {
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ UnitShared us;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kMaxStages; ++s) barrier_init(&us.full[s]);
        barrier_init_fence();
    }
    // GEMM1 reads align's block list or the routing; GEMM2 starts only after every GEMM1 CTA passed this wait
    // (see top).
    if constexpr (kGateUp) grid_dependency_wait();
    allow_dependent_launch();
    Routing routing;
    if constexpr (kAlignInCta) {
        __shared__ CtaRouting cta_routing;
        if (threadIdx.x < 32) align_in_warp(p, cta_routing);
        __syncthreads();
        routing = {cta_routing.blocks, cta_routing.sorted_pairs, cta_routing.count, 0};
    } else {
        routing = {p.blocks, p.sorted_pairs, p.block_counts[0], p.block_counts[3]};
    }
    const UnitMap map = make_unit_map(p, routing);
    CtaState cta{0u, !kGateUp, static_cast<int>(blockIdx.x)};  // the first unit needs no atomic
    for (;;) {
        if (threadIdx.x == kSchedulerThread) us.unit = cta.next_unit;
        __syncthreads();  // also publishes the barrier initialisation
        const int unit = us.unit;
        if (unit >= map.total) break;
        // Claim the following unit now, so the atomic's latency hides behind this unit's stream. A CTA-aligned
        // call's units all stream the same bytes (one token tile) and no moe_align ran to reset the counter:
        // a static stride.
        if (threadIdx.x == kSchedulerThread) {
            cta.next_unit = static_cast<int>(gridDim.x) + (kAlignInCta ? unit : atomicAdd(p.next_unit, 1));
        }
        const Unit u = locate(p, routing, map, unit);
        if (u.stripes == 2) {  // narrow block: at most kPairedMaxTiles tiles
            run_unit_of_width<2, kPairedMaxTiles, kGateUp>(p, u, ring, us, cta);
        } else {  // a CTA-aligned call's blocks are narrow too (kCtaAlignPairs tokens at most)
            run_unit_of_width<1, kAlignInCta ? kPairedMaxTiles : 8, kGateUp>(p, u, ring, us, cta);
        }
        cta.wait_before_act = false;
    }
    if (cta.wait_before_act) grid_dependency_wait();
}

// out[token] = bf16(sum over slots s = 0..topk-1, in order, of contrib[token * topk + s]); skipped slots add
// nothing. One CTA per (token, kCombineCols columns).
constexpr int kCombineThreads = 256;
constexpr int kCombineCols = kCombineThreads * 4;

__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(bf16* __restrict__ out, const float* __restrict__ contrib, const int32_t* __restrict__ topk_ids,
                       const uint8_t* __restrict__ mask, int experts, int topk, int hidden) {
    grid_dependency_wait();
    allow_dependent_launch();
    __shared__ bool used[kMaxTopk];
    const size_t token = blockIdx.x;
    if (threadIdx.x < kMaxTopk) {
        bool u = false;
        if (static_cast<int>(threadIdx.x) < topk) {
            const int e = topk_ids[token * topk + threadIdx.x];
            u = routed(e, experts, mask);
        }
        used[threadIdx.x] = u;
    }
    __syncthreads();
    const int h = blockIdx.y * kCombineCols + threadIdx.x * 4;
    if (h >= hidden) return;
    // All slot loads are issued before the ordered sum.
    float4 v[kMaxTopk];
#pragma unroll
    for (int s = 0; s < kMaxTopk; ++s) {
        if (used[s]) v[s] = __ldcs(reinterpret_cast<const float4*>(contrib + (token * topk + s) * hidden + h));
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kMaxTopk; ++s) {
        if (used[s]) {
            acc.x += v[s].x;
            acc.y += v[s].y;
            acc.z += v[s].z;
            acc.w += v[s].w;
        }
    }
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + token * hidden + h);
    dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
    dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
}

// One CTA per (stripe, expert); every lane expands exactly the fragments the GEMM would give it.
__global__ void __launch_bounds__(kThreads) dequantize_kernel(bf16* __restrict__ out, const uint8_t* __restrict__ w,
                                                              StripedMatrix matrix) {
    const int stripe = blockIdx.x, expert = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int k = matrix.cols(), nk = k / kStageK;
    bf16* dst = out + static_cast<size_t>(expert) * matrix.stripes() * kStripeRows * k;
    for (int ks = 0; ks < nk; ++ks) {
        const uint8_t* stage = w + matrix.stage_offset(expert, stripe, ks);
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
                    const int row = matrix.row(stripe, warp * 16 + g + 8 * (i & 1)), kk = kb + 8 * (i >> 1);
                    *reinterpret_cast<uint32_t*>(dst + static_cast<size_t>(row) * k + kk) = a[i];
                }
            }
        }
    }
}

// The oracle over every stripe of every expert of `matrix`.
cudaError_t dequantize(bf16* out, const uint8_t* w, StripedMatrix matrix, int experts, cudaStream_t stream) {
    if (experts == 0) return cudaSuccess;
    dequantize_kernel<<<dim3(matrix.stripes(), experts), kThreads, 0, stream>>>(out, w, matrix);
    return cudaGetLastError();
}

// The workspace's one layout: buffers at 256-byte boundaries from `base` (null: offsets only). Returns the bytes.
size_t layout_workspace(uint8_t* base, int experts, int hidden, int inter, int topk, int max_tokens, Workspace* ws) {
    const size_t pairs = static_cast<size_t>(max_tokens) * topk;
    size_t offset = 0;
    auto take = [&](size_t bytes) {
        uint8_t* at = base != nullptr ? base + offset : nullptr;
        offset += (bytes + 255) / 256 * 256;
        return at;
    };
    ws->pair_rank = reinterpret_cast<int*>(take(pairs * 4));
    ws->sorted_pairs = reinterpret_cast<int*>(take(pairs * 4));
    ws->blocks = reinterpret_cast<int4*>(take(static_cast<size_t>(max_blocks(experts, static_cast<int>(pairs))) * 16));
    ws->counters = reinterpret_cast<int*>(take(16));
    ws->act = reinterpret_cast<bf16*>(take(pairs * inter * 2));
    ws->contrib = reinterpret_cast<float*>(take(pairs * hidden * 4));
    return offset;
}

}  // namespace

size_t workspace_bytes(int experts, int hidden, int inter, int topk, int max_tokens) {
    Workspace offsets_only;
    return layout_workspace(nullptr, experts, hidden, inter, topk, max_tokens, &offsets_only);
}

Workspace carve_workspace(void* base, int experts, int hidden, int inter, int topk, int max_tokens) {
    Workspace ws;
    layout_workspace(static_cast<uint8_t*>(base), experts, hidden, inter, topk, max_tokens, &ws);
    return ws;
}

// Resident CTAs per SM of one GEMM instance (opting it in to the ring's shared memory).
template <bool kGateUp, bool kAlignInCta>
cudaError_t gemm_ctas_per_sm(int* per_sm) {
    return resident_ctas_per_sm<moe_gemm_kernel<kGateUp, kAlignInCta>>(kThreads, kRingBytes, per_sm);
}

cudaError_t configure(int* gemm_ctas) {
    int per_sm[4] = {};
    DDTREE_RETURN_IF_ERROR((gemm_ctas_per_sm<true, false>(&per_sm[0])));
    DDTREE_RETURN_IF_ERROR((gemm_ctas_per_sm<false, false>(&per_sm[1])));
    DDTREE_RETURN_IF_ERROR((gemm_ctas_per_sm<true, true>(&per_sm[2])));
    DDTREE_RETURN_IF_ERROR((gemm_ctas_per_sm<false, true>(&per_sm[3])));
    *gemm_ctas = sm_count() * std::min({per_sm[0], per_sm[1], per_sm[2], per_sm[3]});
    return cudaSuccess;
}

cudaError_t moe_forward(const MoeArgs& a, const Workspace& ws, int gemm_ctas, cudaStream_t stream) {
    if (a.tokens == 0) return cudaSuccess;
    GemmParams p{};
    p.pairs = a.tokens * a.topk;
    const bool align_in_cta = p.pairs <= kCtaAlignPairs;
    if (!align_in_cta) {
        DDTREE_RETURN_IF_ERROR(moe_align(a.topk_ids, a.expert_mask, a.tokens, a.topk, a.experts, ws, stream));
    }
    p.topk_ids = a.topk_ids;
    p.expert_mask = a.expert_mask;
    p.experts = a.experts;
    p.topk = a.topk;
    p.sorted_pairs = ws.sorted_pairs;
    p.blocks = ws.blocks;
    p.block_counts = ws.counters;
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
    DDTREE_RETURN_IF_ERROR(launch_dependent(align_in_cta ? moe_gemm_kernel<true, true> : moe_gemm_kernel<true, false>,
                                            dim3(gemm_ctas), dim3(kThreads), kRingBytes, stream, p));

    p.weights = a.w2;
    p.act_in = ws.act;
    p.k = a.inter;
    p.stripes = a.hidden / kStripeRows;
    p.next_unit = ws.counters + 2;
    DDTREE_RETURN_IF_ERROR(launch_dependent(align_in_cta ? moe_gemm_kernel<false, true> : moe_gemm_kernel<false, false>,
                                            dim3(gemm_ctas), dim3(kThreads), kRingBytes, stream, p));

    return launch_dependent(moe_combine_kernel, dim3(a.tokens, (a.hidden + kCombineCols - 1) / kCombineCols),
                            dim3(kCombineThreads), 0, stream, a.out, static_cast<const float*>(ws.contrib), a.topk_ids,
                            a.expert_mask, a.experts, a.topk, a.hidden);
}

cudaError_t dequantize_w13(bf16* out, const uint8_t* w13, int experts, int hidden, int inter, cudaStream_t stream) {
    return dequantize(out, w13, StripedMatrix{true, hidden, inter}, experts, stream);
}

cudaError_t dequantize_w2(bf16* out, const uint8_t* w2, int experts, int hidden, int inter, cudaStream_t stream) {
    return dequantize(out, w2, StripedMatrix{false, hidden, inter}, experts, stream);
}

}  // namespace ddtree::kernels::moe
