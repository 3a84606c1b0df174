// Absorbed-MLA attention: one CTA per (query row, chunk of its keys (mla_chunk_keys), group of 64 heads, slice of
// the latent columns), then a merge of the chunk partials in chunk order.
//
// The chunk kernel uses Hopper warpgroup MMAs (wgmma) so that every cache byte is read from shared memory
// about once per use: with mma.sync each warp re-reads its operands from shared memory, and the kernel was bound
// by shared-memory bandwidth at a quarter of HBM speed. Cache tiles of 64 keys arrive by bulk-tensor (TMA)
// copies, issued by one thread into a 2-stage ring, already in the 128-byte swizzle wgmma reads (per-thread
// cp.async put the copies' address arithmetic on the critical path). 64-key tiles make every score wgmma
// m64n64k16, which the tensor cores run at 1.5x the rate per FLOP of the m64n32k16 a 32-key tile needs; the
// query (72 KB) and two such stages fill the shared memory. Three warpgroups:
//   warpgroup 0: S = Q K^T for tile i (all 64 heads = wgmma M, Q and K from 128-byte-swizzled shared memory),
//                online softmax in registers, P (bf16) and the rescale factor to shared memory;
//   warpgroups 1, 2: O[:, half] = O * alpha + P V for tile i (P from registers, V = the same cache tile read
//                MN-major), each owning half of the slice's latent columns, while warpgroup 0 scores tile i + 1.
// A pair of mbarriers hands P over (one buffer: "full" once warpgroup 0 has written it, "empty" once the P.V
// warpgroups hold it in registers; every thread arrives on its own, so each thread's shared-memory accesses are
// released to the waiters, an ordering compute-sanitizer's racecheck follows, where it does not follow a named
// barrier's bar.arrive), and a stage is refilled with tile i + 2 as soon as the P.V of tile i is done with it. Every
// reduction order is fixed by the key positions and the row's own kv_len (which sets the chunk size).
//
// Column slices: a launch of few (row, chunk) pairs (one stream at long context, a few streams at short) would
// leave most SMs idle, so it splits each chunk's P.V columns over 2 or 4 CTAs. Each slice computes the same scores
// and softmax (the same instructions on the same data, so the same bits) and only its columns of the output:
// the slice count changes which CTA computes a value, never how, and rows stay batch invariant.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cmath>
#include <type_traits>

#include "gemm_mma.cuh"
#include "mla_attn.cuh"
#include "wgmma.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kHeads = 64;        // heads per CTA: the wgmma M
constexpr int kTileKeys = 64;     // keys per pipeline tile: the S wgmma N
constexpr int kStages = 2;        // cache tiles in the ring: one computed on, one landing
constexpr int kThreads = 3 * 128;
constexpr int kSwizzleRow = 128;  // bytes per row of a 128-byte-swizzled block of 64 bf16 columns
constexpr float kLog2e = 1.4426950408889634f;

// Named barriers (0 is __syncthreads), each synced by all of its threads.
constexpr int kPvOwnBarrier = 1;     // + the P.V warpgroup's index (0, 1): that warpgroup's own 128 threads
constexpr int kStageFreeBarrier = 3; // the P.V warpgroups are done with a tile's stage
constexpr int kScoreOwnBarrier = 4;  // warpgroup 0's own 128 threads (a tile's tree keys are in place)

// Whether DL latent columns split into `slices` P.V column slices of whole 128-column blocks (64 columns for each
// of the two P.V warpgroups).
constexpr bool slices_fit(int dl, int slices) { return slices == 1 || (dl / slices) % 128 == 0; }

template <int DL, int DR, int kSlices>
struct Tile {
    static constexpr int D = DL + DR;
    static constexpr int kBlocks = (D + 63) / 64;  // 64-column swizzled blocks per row
    static constexpr int kKSteps = D / 16;         // S wgmma k16 steps; padding columns are never read
    static constexpr int kSliceCols = DL / kSlices;  // latent columns of this CTA's P.V
    // P.V column split: two warpgroups of kSliceCols/2 columns, or one warpgroup over the first 64-column block
    // when the slice is too small to split into whole blocks (its extra columns are computed and dropped).
    static constexpr int kPvGroups = kSliceCols >= 128 ? 2 : 1;
    static constexpr int kPvBlocks = kSliceCols >= 128 ? kSliceCols / 128 : 1;  // 64-column blocks per warpgroup
    static constexpr int q_bytes = kBlocks * kHeads * kSwizzleRow;
    static constexpr int stage_bytes = kBlocks * kTileKeys * kSwizzleRow;
    static constexpr int p_bytes = kHeads * kTileKeys * 2;
    static constexpr size_t bytes = 1024 + q_bytes + kStages * stage_bytes + p_bytes + kHeads * 4;
    static_assert(D % 16 == 0 && DL % 8 == 0 && (DL % 128 == 0 || DL <= 64), "unsupported MLA dims");
    static_assert(slices_fit(DL, kSlices), "a column slice is whole P.V warpgroup blocks");
    static_assert(bytes <= 227 * 1024, "query, cache stages and P exceed the shared memory of an SM");
};

// Byte offset of 16-byte column chunk `c` of row `r` in a tile of `rows` rows stored as 64-column blocks of
// 128-byte rows with the 128-byte swizzle (chunk ^= row % 8) that wgmma descriptors expect.
__device__ __forceinline__ uint32_t swizzled(int r, int c, int rows) {
    return (c / 8) * rows * kSwizzleRow + r * kSwizzleRow + ((c % 8) ^ (r % 8)) * 16;
}

// P tile [64 heads][64 keys] bf16 in 128-byte rows, chunk ^= row % 8: a warp's stores (8 rows, one chunk each)
// and ldmatrix reads (8 rows of one chunk) both hit 32 distinct banks.
__device__ __forceinline__ uint32_t p_offset(int r, int chunk) { return r * kSwizzleRow + ((chunk ^ (r & 7)) * 16); }

// Waits until all `threads` threads of named barrier `id` have reached it.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int DL, int DR, int kSlices>
__global__ void __launch_bounds__(kThreads, 1)
    mla_chunk_kernel(const __grid_constant__ CUtensorMap cache_map, const bf16* __restrict__ cache,
                     const bf16* __restrict__ q, const int32_t* kv_start, const int32_t* kv_len, MlaTreeKeys tree,
                     int heads, float scale_log2, float* part_o, float* part_ml) {
    using T = Tile<DL, DR, kSlices>;
    constexpr int D = T::D, kRowChunks = D / 8;
    dependent_kernel_start();  // the merge kernel waits for this grid before it reads the partials
    const int chunk = blockIdx.x, row = blockIdx.y, h0 = blockIdx.z / kSlices * kHeads;
    const int slice = blockIdx.z % kSlices, slice_block0 = slice * T::kSliceCols / 64;  // first 64-column block
    const int len = kv_len[row];
    const int chunk_keys = mla_chunk_keys(len), key0 = chunk * chunk_keys;
    if (key0 >= len) {
        return;
    }
    const int nkeys = min(chunk_keys, len - key0);
    const int ntiles = (nkeys + kTileKeys - 1) / kTileKeys;
    const int first_key_row = kv_start[row] + key0;  // cache row of the chunk's first key
    const int tree_from = tree.key_start != nullptr ? min(tree.key_start[row], len) : len;  // first tree position
    const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
    // Warp-uniform by broadcast, so the compiler keeps per-warpgroup values (tile counters, wgmma descriptors) in
    // uniform registers instead of moving each descriptor over with R2UR before every wgmma.
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);

    // Swizzled operands need 1024-byte-aligned blocks (the swizzle acts on address bits 4-9).
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
    unsigned char* s_q = smem;
    unsigned char* s_kv = s_q + T::q_bytes;
    unsigned char* s_p = s_kv + kStages * T::stage_bytes;
    float* s_alpha = reinterpret_cast<float*>(s_p + T::p_bytes);
    const uint32_t q_addr = smem_addr(s_q), kv_addr = smem_addr(s_kv);

    __shared__ __align__(8) uint64_t full[kStages];  // one per cache stage: its tile's bytes have landed
    __shared__ __align__(8) uint64_t p_full, p_empty;  // P and alpha written / held in the P.V registers
    if (tid == 0) {
        for (int st = 0; st < kStages; ++st) barrier_init(&full[st]);
        barrier_init(&p_full, 128);
        barrier_init(&p_empty, T::kPvGroups * 128);
        barrier_init_fence();
    }
    // Before any arrival: ptxas issues the initialisation as one instruction of warp 0, which racecheck then takes
    // as every lane's, racing thread 0's own first arrival.
    __syncthreads();
    for (int idx = tid; idx < kHeads * kRowChunks; idx += kThreads) {
        const int r = idx / kRowChunks, c = idx % kRowChunks;
        const bool valid = h0 + r < heads;
        cp_async16_zfill(s_q + swizzled(r, c, kHeads),
                         q + (static_cast<int64_t>(row) * heads + (valid ? h0 + r : 0)) * D + c * 8, valid);
    }
    cp_async_commit();
    // One thread (the one that initialised the barriers) issues each tile: kBlocks bulk-tensor copies of 64 columns
    // into the swizzled stage (rows past the cache arrive as zeros). Evict-first: the cache is streamed once per
    // launch (a sliced launch's CTAs of a chunk copy each tile at about the same time, so all but the first read it
    // from L2), and the chunk partials should stay in L2 for the merge.
    auto issue = [&](int tile) {
        const int slot = tile % kStages;
        barrier_arrive_expect_tx(&full[slot], T::stage_bytes);
        for (int b = 0; b < T::kBlocks; ++b) {
            bulk_tensor_load_2d(kv_addr + slot * T::stage_bytes + b * kTileKeys * kSwizzleRow, &cache_map, 64 * b,
                                first_key_row + tile * kTileKeys, &full[slot]);
        }
    };
    auto wait_tile = [&](int tile) { barrier_wait(&full[tile % kStages], (tile / kStages) & 1); };
    if (tid == 0) {
        issue(0);
        if (ntiles > 1) issue(1);
    }
    // The query (cp.async by every thread, generic proxy) must be visible to warpgroup 0's score wgmmas (async
    // proxy).
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();

    // Warpgroup 0 scores tile i and runs its softmax while the P.V warpgroups multiply P of tile i - 1. A stage is
    // refilled (tile i + 2) as soon as P.V of tile i is done with it, so one tile is always landing.
    const int r_lo = 16 * warp + g;  // this thread's first head row of the wgmma fragments (the other: + 8)
    // This chunk's partial; computed where it is stored, after the tile loop (registers are short in it).
    auto partial_index = [&] { return static_cast<int64_t>(row) * gridDim.x + chunk; };
    if (wg == 0) {
        const int r_hi = r_lo + 8;
        float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
        float s[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        const uint64_t q_desc = sw128_desc(q_addr, 16, 8 * kSwizzleRow);
        const uint64_t k_desc = sw128_desc(kv_addr, 16, 8 * kSwizzleRow);
        for (int tile = 0; tile < ntiles; ++tile) {
            wait_tile(tile);
            // Tree positions: the bulk copy brought the row at each position itself, which is node j's slot for
            // position tree_from + j; where the ancestor at depth j is another node, its row replaces it here,
            // before the scores or the P.V warpgroups read the stage (they wait for P, published after this).
            const int pos0 = key0 + tile * kTileKeys, fix_from = max(tree_from, pos0);
            const int fix_to = min(len, pos0 + kTileKeys);
            if (fix_from < fix_to) {
                unsigned char* stage = s_kv + (tile % kStages) * T::stage_bytes;
                const int32_t* nodes = tree.key_nodes + static_cast<int64_t>(row) * tree.stride;
                const int64_t slot0 = static_cast<int64_t>(kv_start[row]) + tree_from;
                for (int idx = tid; idx < (fix_to - fix_from) * kRowChunks; idx += 128) {
                    const int p = fix_from + idx / kRowChunks, c = idx % kRowChunks, j = p - tree_from;
                    const int node = nodes[j];
                    if (node == j) continue;
                    *reinterpret_cast<uint4*>(stage + swizzled(p - pos0, c, kTileKeys)) =
                        *reinterpret_cast<const uint4*>(cache + (slot0 + node) * D + c * 8);
                }
                fence_proxy_async();
                named_barrier_sync(kScoreOwnBarrier, 128);
            }
            const uint64_t stage_desc = k_desc + (((tile % kStages) * T::stage_bytes) >> 4);
            fence_registers(s);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < T::kKSteps; ++kk) {
                // block kk / 4 of 64 columns, k16 step kk % 4 inside its 128-byte rows (descriptor units: 16 B)
                const uint32_t off = (kk % 4) * 2;
                wgmma_m64n64k16_ss(s, q_desc + (kk / 4) * (kHeads * kSwizzleRow / 16) + off,
                                   stage_desc + (kk / 4) * (kTileKeys * kSwizzleRow / 16) + off, kk > 0);
            }
            wgmma_commit();
            wgmma_wait();
            fence_registers(s);

            // Online softmax in base 2 (the scale holds log2(e)); each row's 64 scores live in the 4 lanes
            // of one quad: s[4j + {0,1}] = row g, keys 8j + 2t + {0,1}; s[4j + {2,3}] = row g + 8.
            float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const bool valid = tile * kTileKeys + 8 * j + 2 * t + e < nkeys;
                    s[4 * j + e] = valid ? s[4 * j + e] * scale_log2 : -INFINITY;
                    s[4 * j + 2 + e] = valid ? s[4 * j + 2 + e] * scale_log2 : -INFINITY;
                    mx_lo = fmaxf(mx_lo, s[4 * j + e]);
                    mx_hi = fmaxf(mx_hi, s[4 * j + 2 + e]);
                }
            }
#pragma unroll
            for (int offset = 1; offset < 4; offset <<= 1) {
                mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, offset));
                mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, offset));
            }
            float sum_lo = 0.f, sum_hi = 0.f;
            uint32_t p_lo[8], p_hi[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float p0 = exp2f(s[4 * j] - mx_lo), p1 = exp2f(s[4 * j + 1] - mx_lo);
                const float p2 = exp2f(s[4 * j + 2] - mx_hi), p3 = exp2f(s[4 * j + 3] - mx_hi);
                sum_lo += p0 + p1;
                sum_hi += p2 + p3;
                p_lo[j] = pack_bf16x2(p0, p1);
                p_hi[j] = pack_bf16x2(p2, p3);
            }
#pragma unroll
            for (int offset = 1; offset < 4; offset <<= 1) {
                sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, offset);
                sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, offset);
            }
            const float alpha_lo = exp2f(m_lo - mx_lo), alpha_hi = exp2f(m_hi - mx_hi);
            l_lo = l_lo * alpha_lo + sum_lo;
            l_hi = l_hi * alpha_hi + sum_hi;
            m_lo = mx_lo;
            m_hi = mx_hi;
            // One P buffer: wait until the P.V warpgroups hold the previous tile's P and alpha in registers.
            if (tile > 0) barrier_wait(&p_empty, (tile - 1) & 1);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                *reinterpret_cast<uint32_t*>(s_p + p_offset(r_lo, j) + 4 * t) = p_lo[j];
                *reinterpret_cast<uint32_t*>(s_p + p_offset(r_hi, j) + 4 * t) = p_hi[j];
            }
            if (t == 0) {
                s_alpha[r_lo] = alpha_lo;
                s_alpha[r_hi] = alpha_hi;
            }
            barrier_arrive(&p_full);
        }
        if (slice == 0 && t == 0) {
            const int64_t part = partial_index();
            if (h0 + r_lo < heads) {
                *reinterpret_cast<float2*>(part_ml + (part * heads + h0 + r_lo) * 2) = make_float2(m_lo, l_lo);
            }
            if (h0 + r_hi < heads) {
                *reinterpret_cast<float2*>(part_ml + (part * heads + h0 + r_hi) * 2) = make_float2(m_hi, l_hi);
            }
        }
    } else {
        const int pv = wg - 1;  // column half of the slice
        // pv < kPvGroups, as pv is 0 or 1; put so that it is a constant when both P.V warpgroups work (the compiler
        // cannot bound wg, and kept a test of it in every tile).
        const bool active = T::kPvGroups == 2 || pv == 0;
        const int block0 = slice_block0 + pv * T::kPvBlocks;  // this warpgroup's first 64-column block
        const uint64_t pv_desc =
            sw128_desc(kv_addr + block0 * kTileKeys * kSwizzleRow, kTileKeys * kSwizzleRow, 8 * kSwizzleRow);
        constexpr int kPParts = T::kPvBlocks >= 4 ? 2 : 1, kStepsPerPart = kTileKeys / 16 / kPParts;
        float o[T::kPvBlocks][32];
#pragma unroll
        for (int b = 0; b < T::kPvBlocks; ++b) {
#pragma unroll
            for (int i = 0; i < 32; ++i) o[b][i] = 0.f;
        }
        for (int tile = 0; tile < ntiles; ++tile) {
            // Warpgroup 0 may overwrite P and alpha once the active P.V warpgroups hold them in registers (an idle
            // one reads neither and is not counted). No P follows the last tile.
            auto release_p = [&] {
                if (tile + 1 < ntiles) barrier_arrive(&p_empty);
            };
            if (active) {
                barrier_wait(&p_full, tile & 1);
                const float alpha_lo = s_alpha[r_lo], alpha_hi = s_alpha[r_lo + 8];
                // P's A fragments: all four k16 steps at once, or in two parts when the warpgroup's 256 accumulator
                // columns leave no registers for all of them (the second part is loaded after the first's wgmmas).
                uint32_t a[kStepsPerPart][4];
                auto load_p = [&](int part) {
#pragma unroll
                    for (int kk = 0; kk < kStepsPerPart; ++kk) {
                        const int step = part * kStepsPerPart + kk;
                        ldmatrix_x4(a[kk], s_p + p_offset(16 * warp + lane % 16, 2 * step + lane / 16));
                    }
                };
                load_p(0);
                if (kPParts == 1) release_p();
                wait_tile(tile);
                // Keys past the chunk's end are cache rows of other positions (or zeros past the cache): P is 0
                // there, but 0 * V must not become NaN, so this warpgroup zeroes those rows of its V columns
                // (warpgroup 0 has finished reading the stage: it published P after its score wgmmas completed).
                const int valid_rows = nkeys - tile * kTileKeys;
                if (valid_rows < kTileKeys) {
                    unsigned char* stage = s_kv + (tile % kStages) * T::stage_bytes;
                    constexpr int kChunksPerBlock = kTileKeys * kSwizzleRow / 16;
                    for (int idx = tid - 128 * wg; idx < T::kPvBlocks * kChunksPerBlock; idx += 128) {
                        const int b = block0 + idx / kChunksPerBlock, chunk16 = idx % kChunksPerBlock;
                        if (chunk16 >= valid_rows * (kSwizzleRow / 16)) {
                            *reinterpret_cast<uint4*>(stage + b * kTileKeys * kSwizzleRow + chunk16 * 16) =
                                make_uint4(0, 0, 0, 0);
                        }
                    }
                    fence_proxy_async();
                    named_barrier_sync(kPvOwnBarrier + pv, 128);  // this warpgroup's zeroed rows are in place
                }
                const bool rescale = !__all_sync(0xffffffffu, alpha_lo == 1.f && alpha_hi == 1.f);
#pragma unroll
                for (int b = 0; b < T::kPvBlocks; ++b) {
#pragma unroll
                    for (int j = 0; j < 8 && rescale; ++j) {
                        o[b][4 * j] *= alpha_lo;
                        o[b][4 * j + 1] *= alpha_lo;
                        o[b][4 * j + 2] *= alpha_hi;
                        o[b][4 * j + 3] *= alpha_hi;
                    }
                }
                // V = the cache tile read MN-major: lbo steps 64-column blocks, sbo steps 8-key groups. Independent
                // blocks are issued back to back; each block's k16 steps chain.
                const uint64_t v_desc = pv_desc + (((tile % kStages) * T::stage_bytes) >> 4);
#pragma unroll
                for (int part = 0; part < kPParts; ++part) {
                    if (part > 0) {  // the second and last part: now all of P is in registers
                        load_p(part);
                        release_p();
                    }
#pragma unroll
                    for (int b = 0; b < T::kPvBlocks; ++b) fence_registers(o[b]);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < kStepsPerPart; ++kk) {
                        const int step = part * kStepsPerPart + kk;
#pragma unroll
                        for (int b = 0; b < T::kPvBlocks; ++b) {
                            wgmma_m64n64k16_rs_mn(o[b], a[kk],
                                               v_desc + (b * kTileKeys * kSwizzleRow + step * 16 * kSwizzleRow) / 16);
                        }
                    }
                    wgmma_commit();
                    wgmma_wait();
#pragma unroll
                    for (int b = 0; b < T::kPvBlocks; ++b) fence_registers(o[b]);
                }
            }
            // Both P.V warpgroups are done with this tile's stage: refill it with tile + 2.
            if (tile + 2 < ntiles) {
                named_barrier_sync(kStageFreeBarrier, 256);
                if (tid == 128) issue(tile + 2);
            }
        }
        if (active) {
            const int64_t part = partial_index();
#pragma unroll
            for (int b = 0; b < T::kPvBlocks; ++b) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = (block0 + b) * 64 + 8 * j + 2 * t;
                    if (col >= DL) continue;
                    if (h0 + r_lo < heads) {
                        *reinterpret_cast<float2*>(part_o + (part * heads + h0 + r_lo) * DL + col) =
                            make_float2(o[b][4 * j], o[b][4 * j + 1]);
                    }
                    if (h0 + r_lo + 8 < heads) {
                        *reinterpret_cast<float2*>(part_o + (part * heads + h0 + r_lo + 8) * DL + col) =
                            make_float2(o[b][4 * j + 2], o[b][4 * j + 3]);
                    }
                }
            }
        }
    }
}

// out[row, head] = sum_c 2^(m_c - m) O_c / sum_c 2^(m_c - m) l_c, chunks in order; 4 columns per thread.
__global__ void mla_merge_kernel(bf16* out, const float* part_o, const float* part_ml, const int32_t* kv_len,
                                 int heads, int dl, int max_chunks) {
    // Wait first, then let the projection after attention launch and stream its weights during the merge: released
    // before the wait, its CTAs could take shared memory from the chunk kernel's CTAs (tried: no gain).
    grid_dependency_wait();  // the partials come from the chunk kernel just before
    allow_dependent_launch();
    const int row = blockIdx.x, head = blockIdx.y;
    const int chunks = mla_chunk_count(kv_len[row]);
    const int64_t first = static_cast<int64_t>(row) * max_chunks;
    float m = -INFINITY;
    for (int c = 0; c < chunks; ++c) m = fmaxf(m, part_ml[((first + c) * heads + head) * 2]);
    for (int col = 4 * threadIdx.x; col < dl; col += 4 * blockDim.x) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float denom = 0.f;
        for (int c = 0; c < chunks; ++c) {
            const int64_t p = (first + c) * heads + head;
            const float2 ml = *reinterpret_cast<const float2*>(part_ml + p * 2);
            const float w = exp2f(ml.x - m);
            const float4 v = *reinterpret_cast<const float4*>(part_o + p * dl + col);
            acc.x += w * v.x;
            acc.y += w * v.y;
            acc.z += w * v.z;
            acc.w += w * v.w;
            denom += w * ml.y;
        }
        *reinterpret_cast<uint2*>(out + (static_cast<int64_t>(row) * heads + head) * dl + col) =
            make_uint2(pack_bf16x2(acc.x / denom, acc.y / denom), pack_bf16x2(acc.z / denom, acc.w / denom));
    }
}

// The driver's tensor-map encoder, fetched through the runtime (no link to libcuda); null when unavailable.
PFN_cuTensorMapEncodeTiled_v12000 lookup_tensor_map_encoder() {
    cudaDriverEntryPointQueryResult found{};
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
        return nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// The cache as a 2-D tensor [cache_rows, D] of bf16 for bulk-tensor copies of kTileKeys x 64 boxes with the
// 128-byte swizzle.
cudaError_t encode_cache_map(CUtensorMap* map, const bf16* cache, int64_t cache_rows, int d) {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = lookup_tensor_map_encoder();  // once, thread-safe
    if (encode == nullptr) return cudaErrorNotSupported;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(cache_rows)};
    const cuuint64_t row_stride[1] = {static_cast<cuuint64_t>(d) * sizeof(bf16)};
    const cuuint32_t box[2] = {64, kTileKeys};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult status =
        encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(cache), dims, row_stride, box,
               element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return status == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <int DL, int DR, int kSlices>
cudaError_t launch_chunks(const CUtensorMap& cache_map, const bf16* cache, const bf16* q, const int32_t* kv_start,
                          const int32_t* kv_len, const MlaTreeKeys& tree, dim3 grid, int heads, float scale_log2,
                          float* part_o, float* part_ml, cudaStream_t stream) {
    using T = Tile<DL, DR, kSlices>;
    static std::atomic<uint64_t> configured{0};
    DDTREE_RETURN_IF_ERROR(opt_in_smem(mla_chunk_kernel<DL, DR, kSlices>, static_cast<int>(T::bytes), configured));
    grid.z *= kSlices;
    return launch_dependent(mla_chunk_kernel<DL, DR, kSlices>, grid, dim3(kThreads), T::bytes, stream, cache_map,
                            cache, q, kv_start, kv_len, tree, heads, scale_log2, part_o, part_ml);
}

template <int DL, int DR>
cudaError_t launch(bf16* out, const bf16* q, const bf16* cache, int64_t cache_rows, const int32_t* kv_start,
                   const int32_t* kv_len, const MlaTreeKeys& tree, int rows, int max_len, int heads,
                   float softmax_scale, float* workspace, cudaStream_t stream) {
    const int max_chunks = mla_max_chunks(max_len);
    float* part_o = workspace;
    float* part_ml = workspace + static_cast<int64_t>(rows) * max_chunks * heads * DL;
    CUtensorMap cache_map;
    DDTREE_RETURN_IF_ERROR(encode_cache_map(&cache_map, cache, cache_rows, DL + DR));
    const dim3 grid(max_chunks, rows, (heads + kHeads - 1) / kHeads);
    const float scale_log2 = softmax_scale * kLog2e;
    auto run = [&](auto slices) {
        return launch_chunks<DL, DR, decltype(slices)::value>(cache_map, cache, q, kv_start, kv_len, tree, grid,
                                                              heads, scale_log2, part_o, part_ml, stream);
    };
    using Unsliced = std::integral_constant<int, 1>;
    cudaError_t launched;
    if constexpr (slices_fit(DL, 4)) {
        // Column slices while the sliced grid still fits on the SMs at once (one CTA per SM).
        const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z, sms = sm_count();
        launched = 4 * ctas <= sms   ? run(std::integral_constant<int, 4>{})
                   : 2 * ctas <= sms ? run(std::integral_constant<int, 2>{})
                                     : run(Unsliced{});
    } else {
        launched = run(Unsliced{});
    }
    DDTREE_RETURN_IF_ERROR(launched);
    const int merge_threads = DL / 4 < 128 ? 32 : 128;
    return launch_dependent(mla_merge_kernel, dim3(rows, heads), dim3(merge_threads), 0, stream, out, part_o,
                            part_ml, kv_len, heads, DL, max_chunks);
}

}  // namespace

// Compiled (kv_lora, rope_dim) pairs: K2 and the synthetic test presets.
#define DDTREE_MLA_DIMS(X) X(512, 64) X(128, 32) X(32, 16)

bool mla_dims_supported(int kv_lora, int rope_dim) {
#define DDTREE_MLA_MATCH(dl, dr) if (kv_lora == dl && rope_dim == dr) return true;
    DDTREE_MLA_DIMS(DDTREE_MLA_MATCH)
#undef DDTREE_MLA_MATCH
    return false;
}

int64_t mla_workspace_floats(const MlaDims& dims, int max_rows, int max_len) {
    const int64_t chunks = mla_max_chunks(max_len);
    return static_cast<int64_t>(max_rows) * chunks * dims.heads * (dims.kv_lora + 2);
}

cudaError_t mla_attention(bf16* out, const bf16* q, const bf16* cache, int64_t cache_rows, const int32_t* kv_start,
                          const int32_t* kv_len, int rows, int max_len, const MlaDims& dims, float softmax_scale,
                          float* workspace, cudaStream_t stream, const MlaTreeKeys& tree) {
    if (rows < 0 || max_len <= 0 || dims.heads <= 0 || cache_rows <= 0 ||
        reinterpret_cast<uintptr_t>(cache) % 16 != 0 ||
        (tree.key_start != nullptr && (tree.key_nodes == nullptr || tree.stride < 1))) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
#define DDTREE_MLA_LAUNCH(dl, dr)                                                                           \
    if (dims.kv_lora == dl && dims.rope_dim == dr)                                                          \
        return launch<dl, dr>(out, q, cache, cache_rows, kv_start, kv_len, tree, rows, max_len, dims.heads, \
                              softmax_scale, workspace, stream);
    DDTREE_MLA_DIMS(DDTREE_MLA_LAUNCH)
#undef DDTREE_MLA_LAUNCH
    return cudaErrorInvalidValue;
}

}  // namespace ddtree::kernels
