// Weight-streaming bf16 GEMM (see gemm.cuh for the design and the batch-invariance argument).
#include <algorithm>
#include <cstdint>

#include "gemm.cuh"
#include "gemm_mma.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kWarps = 4;  // warp p sums k-part p: columns [128p, 128p + 128) of every chunk
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 512;               // columns per pipeline stage: 1 KB of each weight row
constexpr int kPart = kChunk / kWarps;    // columns per warp per stage (four k32 slices)
constexpr int kTileRows = 16;             // weight rows of one mma tile; split counts are in these units
constexpr int kRowBytes = kChunk * 2 + 64;  // smem row stride: rows g and g + 1 land in different bank halves
// K is split only when the 16-row tiles are no more than the SMs, into enough ranges for two per SM: measured
// on the H200, splitting wider shapes costs more in partial sums and short CTAs than it gains in parallelism.
constexpr int kSplitTilesPerSm = 2;
constexpr int kMaxSplits = 16;
constexpr int kShortRingChunks = 4;  // decode GEMMs with unsplit K of up to this many chunks: two-stage ring

// RT weight tiles of 16 rows and NT token tiles of 8 per CTA, S stages in the ring. Up to 16 tokens the
// shared memory stays near 110 KB or below so that two or more CTAs share an SM; above that one CTA per SM
// holds wider token stages: three of 32 tokens up to 32 tokens, two of 64 above (see launch).
template <int RT, int NT, int S>
struct Config {
    static constexpr int kRows = kTileRows * RT;
    static constexpr int kTokens = 8 * NT;
    static constexpr int kStageBytes = (kRows + kTokens) * kRowBytes;
    static constexpr int kSmemBytes = S * kStageBytes + S * 8;
    static_assert(kWarps * kRows * kTokens * 4 <= S * kStageBytes, "k-part sums reuse the idle ring");
};

struct GemmParams {
    const bf16* x;
    const bf16* w;
    void* out;
    float* workspace;
    int* counters;
    int64_t ldx, ldo;
    int64_t x_stride, w_stride, out_stride;
    int m, n, k;
    int batch, splits;
};

template <GemmEpilogue E>
__device__ __forceinline__ void store_out(const GemmParams& p, int b, int tok, int row, float v) {
    if constexpr (E == GemmEpilogue::kF32) {
        static_cast<float*>(p.out)[b * p.out_stride + tok * p.ldo + row] = v;
    } else {
        static_cast<bf16*>(p.out)[b * p.out_stride + tok * p.ldo + row] = __float2bfloat16(v);
    }
}

// Feature written by a kSiluMul weight row pair: rows 16i..16i+7 are gates, 16i+8..16i+15 the matching ups.
__device__ __forceinline__ int silu_feature(int gate_row) { return (gate_row / 16) * 8 + gate_row % 16; }

__device__ __forceinline__ void store_silu(const GemmParams& p, int b, int tok, int gate_row, float gate, float up) {
    static_cast<bf16*>(p.out)[b * p.out_stride + tok * p.ldo + silu_feature(gate_row)] =
        __float2bfloat16(silu(gate) * up);
}

// The epilogue for outputs [tok0, tok0 + toks) x [row0, row0 + rows) of batch entry b; value(tok, row) is an
// output's fp32 sum, tok and row counted from tok0 and row0.
template <int kRows, GemmEpilogue E, typename Value>
__device__ __forceinline__ void store_tile(const GemmParams& p, int b, int tok0, int toks, int row0, int rows,
                                           Value value) {
    if constexpr (E == GemmEpilogue::kSiluMul) {
        for (int idx = threadIdx.x; idx < toks * (kRows / 2); idx += kThreads) {
            const int tok = idx / (kRows / 2), f = idx % (kRows / 2);
            const int gate = (f / 8) * 16 + f % 8;
            if (gate < rows) store_silu(p, b, tok0 + tok, row0 + gate, value(tok, gate), value(tok, gate + 8));
        }
    } else {
        for (int idx = threadIdx.x; idx < toks * kRows; idx += kThreads) {
            const int tok = idx / kRows, row = idx % kRows;
            if (row < rows) store_out<E>(p, b, tok0 + tok, row0 + row, value(tok, row));
        }
    }
}

__device__ __forceinline__ uint4 load_shared16(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

// One CTA: weight rows [tile * kRows, +kRows) of one batch entry over the chunks of its K split, for every
// token tile. Each stage brings kChunk columns of every weight row and token row into shared memory with one
// bulk copy per row (1 KB contiguous per weight row), completing on the slot's barrier. The weight copies of
// the first stages are issued before grid_dependency_wait: under a dependent launch they overlap the previous
// kernel.
template <int RT, int NT, int S, GemmEpilogue E>
__global__ void __launch_bounds__(kThreads) gemm_kernel(const GemmParams p) {
    using C = Config<RT, NT, S>;
    extern __shared__ __align__(128) uint8_t ring[];
    float* part_sums = reinterpret_cast<float*>(ring);  // [kWarps][kRows][kTokens], once every stage is consumed
    uint64_t* full = reinterpret_cast<uint64_t*>(ring + S * C::kStageBytes);
    __shared__ bool is_last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int b = blockIdx.z, tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const bf16* x = p.x + b * p.x_stride;
    const bf16* w = p.w + b * p.w_stride;
    const int row0 = tile * C::kRows, rows = min(C::kRows, p.n - row0);
    const int chunks = (p.k + kChunk - 1) / kChunk;
    const int c_begin = split * chunks / splits, c_end = (split + 1) * chunks / splits, nc = c_end - c_begin;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) barrier_init(&full[s]);
        barrier_init_fence();
    }
    __syncthreads();

    auto chunk_bytes = [&](int c) { return static_cast<uint32_t>(min(kChunk, p.k - c * kChunk) * 2); };
    // Every thread takes part: copy r is issued by lane r / kWarps of warp r % kWarps, so the warps issue their
    // copies side by side (one warp issuing them all limits the stream). Weights count on the slot's barrier
    // without arriving; thread 0 arrives with the tokens' bytes. A copy may land before the count is raised:
    // the barrier's transaction count may go negative, and the phase cannot complete before the arrival.
    const int copy_index = lane * kWarps + warp;
    auto issue_weights = [&](int c, int slot) {
        const uint32_t bytes = chunk_bytes(c);
        if (threadIdx.x == 0) barrier_expect_tx(&full[slot], bytes * rows);
        if (copy_index < rows) {
            bulk_copy_streamed(ring + slot * C::kStageBytes + copy_index * kRowBytes,
                               w + static_cast<int64_t>(row0 + copy_index) * p.k + c * kChunk, bytes, &full[slot]);
        }
    };
    auto issue_tokens = [&](int c, int slot, int tok0) {
        const uint32_t bytes = chunk_bytes(c);
        const int toks = min(C::kTokens, p.m - tok0);
        if (threadIdx.x == 0) barrier_arrive_expect_tx(&full[slot], bytes * toks);
        if (copy_index < toks) {
            bulk_copy(ring + slot * C::kStageBytes + (C::kRows + copy_index) * kRowBytes,
                      x + static_cast<int64_t>(tok0 + copy_index) * p.ldx + c * kChunk, bytes, &full[slot]);
        }
    };

    uint32_t stage = 0;  // stages consumed so far: slot stage % S, barrier phase (stage / S) & 1
    for (int tok0 = 0; tok0 < p.m; tok0 += C::kTokens) {
        const int ahead = min(S, nc);
        for (int s = 0; s < ahead; ++s) issue_weights(c_begin + s, (stage + s) % S);
        if (tok0 == 0) {
            grid_dependency_wait();  // activations, outputs and workspace belong to earlier kernels until here
            allow_dependent_launch();
        }
        for (int s = 0; s < ahead; ++s) issue_tokens(c_begin + s, (stage + s) % S, tok0);

        float acc[RT][NT][4];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int i = 0; i < NT; ++i) acc[r][i][0] = acc[r][i][1] = acc[r][i][2] = acc[r][i][3] = 0.f;
        }
        for (int ci = 0; ci < nc; ++ci, ++stage) {
            const int slot = stage % S;
            barrier_wait(&full[slot], (stage / S) & 1);
            const uint8_t* ws = ring + slot * C::kStageBytes;
            const uint8_t* xs = ws + C::kRows * kRowBytes;
#pragma unroll
            for (int j = 0; j < kPart / 32; ++j) {
                // Each thread's 8 consecutive k feed slots {2t,2t+1,2t+8,2t+9} of two k16 MMAs; weights and
                // activations use the same permutation, so the dot products are unchanged. Shared memory past K
                // holds stale bytes (possibly NaN), so both operands read zeros there; token rows past M and
                // weight rows past N hold stale bytes that only reach outputs that are never stored.
                const int col = warp * kPart + 32 * j + 8 * t;
                const bool in_k = (c_begin + ci) * kChunk + col < p.k;
                const uint4 zero = make_uint4(0, 0, 0, 0);
                uint4 xv[NT];
#pragma unroll
                for (int i = 0; i < NT; ++i) xv[i] = in_k ? load_shared16(xs + (8 * i + g) * kRowBytes + col * 2) : zero;
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const uint4 wa = in_k ? load_shared16(ws + (16 * r + g) * kRowBytes + col * 2) : zero;
                    const uint4 wb = in_k ? load_shared16(ws + (16 * r + g + 8) * kRowBytes + col * 2) : zero;
#pragma unroll
                    for (int i = 0; i < NT; ++i) {
                        mma_bf16_16816(acc[r][i], wa.x, wb.x, wa.y, wb.y, xv[i].x, xv[i].y);
                        mma_bf16_16816(acc[r][i], wa.z, wb.z, wa.w, wb.w, xv[i].z, xv[i].w);
                    }
                }
            }
            __syncthreads();  // every warp is done with this slot
            if (ci + S < nc) {
                issue_weights(c_begin + ci + S, slot);
                issue_tokens(c_begin + ci + S, slot, tok0);
            }
        }

        // The four k-parts of each output, summed in part order: the order depends on K alone.
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int i = 0; i < NT; ++i) {
                float* dst = part_sums + (warp * C::kRows + 16 * r + g) * C::kTokens + 8 * i + 2 * t;
                dst[0] = acc[r][i][0];
                dst[1] = acc[r][i][1];
                dst[8 * C::kTokens] = acc[r][i][2];
                dst[8 * C::kTokens + 1] = acc[r][i][3];
            }
        }
        __syncthreads();
        auto sum_parts = [&](int tok, int row) {
            const float* src = part_sums + row * C::kTokens + tok;
            constexpr int kPartStride = C::kRows * C::kTokens;
            return ((src[0] + src[kPartStride]) + src[2 * kPartStride]) + src[3 * kPartStride];
        };
        const int toks = min(C::kTokens, p.m - tok0);
        if (splits > 1) {
            float* part = p.workspace + (static_cast<int64_t>(b) * splits + split) * p.m * p.n;
            for (int idx = threadIdx.x; idx < toks * C::kRows; idx += kThreads) {
                const int tok = idx / C::kRows, row = idx % C::kRows;
                if (row < rows) part[static_cast<int64_t>(tok0 + tok) * p.n + row0 + row] = sum_parts(tok, row);
            }
        } else {
            store_tile<C::kRows, E>(p, b, tok0, toks, row0, rows, sum_parts);
        }
        fence_proxy_async();  // the next token tile's bulk copies overwrite these sums
        __syncthreads();
    }
    if (splits == 1) {
        return;
    }

    // The last split of this tile to arrive sums every split's partial in split order.
    __threadfence();
    __syncthreads();
    int* counter = p.counters + b * gridDim.x + tile;
    if (threadIdx.x == 0) {
        is_last = atomicAdd(counter, 1) == splits - 1;
    }
    __syncthreads();
    if (!is_last) {
        return;
    }
    __threadfence();
    if (threadIdx.x == 0) {
        *counter = 0;  // ready for the next launch (graph replays included)
    }
    const float* parts = p.workspace + static_cast<int64_t>(b) * splits * p.m * p.n;
    const int64_t split_stride = static_cast<int64_t>(p.m) * p.n;
    auto reduce = [&](int tok, int row) {
        float sum = 0.f;
        for (int s = 0; s < splits; ++s) {
            sum += __ldcg(parts + s * split_stride + static_cast<int64_t>(tok) * p.n + row0 + row);
        }
        return sum;
    };
    store_tile<C::kRows, E>(p, b, 0, p.m, row0, rows, reduce);
}

// K <= kShortKMax (the absorbed-k projection: K = 128, batch = heads). gemm_kernel would give all of K to warp 0 and
// copy 256-byte rows, the slow size; here the warps own separate 16-row tiles, and a CTA's weight rows, contiguous
// in memory, arrive in one bulk copy. Rows sit densely in shared memory (K * 2 bytes apart): a two-way bank
// conflict on the 16-byte loads, cheap next to the copies it saves. The weights stay for every token tile.
constexpr int kShortKRows = kWarps * kTileRows;
constexpr int kShortKMax = kPart;  // one k-part: the K that gemm_kernel would give to a single warp

template <int NT>
constexpr int short_k_smem_bytes() {
    return (kShortKRows + 8 * NT) * kShortKMax * 2 + kShortKRows * 8 * NT * 4;
}

template <int NT, GemmEpilogue E>
__global__ void __launch_bounds__(kThreads) gemm_short_k_kernel(const GemmParams p) {
    constexpr int kTokens = 8 * NT;
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* ws = smem;                                                // [kShortKRows][K]
    uint8_t* xs = smem + kShortKRows * kShortKMax * 2;                      // [kTokens][K]
    float* sums = reinterpret_cast<float*>(xs + kTokens * kShortKMax * 2);  // [kShortKRows][kTokens]
    __shared__ __align__(8) uint64_t weights_ready, tokens_ready;      // tokens: one phase per token tile
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int b = blockIdx.z, row0 = blockIdx.x * kShortKRows, rows = min(kShortKRows, p.n - row0);
    const int row_bytes = p.k * 2;
    if (threadIdx.x == 0) {
        barrier_init(&weights_ready);
        barrier_init(&tokens_ready);
        barrier_init_fence();
        barrier_arrive_expect_tx(&weights_ready, rows * row_bytes);
        bulk_copy_streamed(ws, p.w + b * p.w_stride + static_cast<int64_t>(row0) * p.k, rows * row_bytes,
                           &weights_ready);
    }
    grid_dependency_wait();  // activations and outputs belong to earlier kernels until here
    allow_dependent_launch();
    __syncthreads();  // the barriers are initialised

    const bf16* x = p.x + b * p.x_stride;
    const uint8_t* w_lo = ws + (warp * kTileRows + g) * row_bytes;
    const uint8_t* w_hi = w_lo + 8 * row_bytes;
    for (int tok0 = 0, pass = 0; tok0 < p.m; tok0 += kTokens, ++pass) {
        const int toks = min(kTokens, p.m - tok0);
        if (threadIdx.x == 0) barrier_arrive_expect_tx(&tokens_ready, toks * row_bytes);
        if (threadIdx.x < toks) {
            bulk_copy(xs + threadIdx.x * row_bytes, x + static_cast<int64_t>(tok0 + threadIdx.x) * p.ldx, row_bytes,
                      &tokens_ready);
        }
        barrier_wait(&weights_ready, 0);
        barrier_wait(&tokens_ready, pass & 1);
        float acc[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
        for (int j = 0; j < kShortKMax / 32; ++j) {
            // The thread's 8 consecutive k feed two k16 MMAs, as in gemm_kernel. Lanes past K feed zeros rather
            // than skip: the MMAs are warp-wide. Rows past N and token rows past M hold stale bytes that only
            // reach outputs that are never stored.
            if (32 * j >= p.k) break;
            const int col = 32 * j + 8 * t;
            const bool in_k = col < p.k;
            const uint4 zero = make_uint4(0, 0, 0, 0);
            const uint4 wa = in_k ? load_shared16(w_lo + col * 2) : zero;
            const uint4 wb = in_k ? load_shared16(w_hi + col * 2) : zero;
#pragma unroll
            for (int i = 0; i < NT; ++i) {
                const uint4 xv = in_k ? load_shared16(xs + (8 * i + g) * row_bytes + col * 2) : zero;
                mma_bf16_16816(acc[i], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
                mma_bf16_16816(acc[i], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
            }
        }
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            float* dst = sums + (warp * kTileRows + g) * kTokens + 8 * i + 2 * t;
            dst[0] = acc[i][0];
            dst[1] = acc[i][1];
            dst[8 * kTokens] = acc[i][2];
            dst[8 * kTokens + 1] = acc[i][3];
        }
        __syncthreads();
        store_tile<kShortKRows, E>(p, b, tok0, toks, row0, rows,
                                   [&](int tok, int row) { return sums[row * kTokens + tok]; });
        fence_proxy_async();  // the next token tile's bulk copies overwrite the tokens read here
        __syncthreads();
    }
}

template <int RT, int NT, int S, GemmEpilogue E>
cudaError_t launch_config(const GemmParams& p, cudaStream_t stream) {
    using C = Config<RT, NT, S>;
    auto* kernel = gemm_kernel<RT, NT, S, E>;
    static std::atomic<uint64_t> configured{0};
    DDTREE_RETURN_IF_ERROR(opt_in_smem(kernel, C::kSmemBytes, configured));
    const dim3 grid((p.n + C::kRows - 1) / C::kRows, p.splits, p.batch);
    return launch_dependent(kernel, grid, dim3(kThreads), C::kSmemBytes, stream, p);
}

// CTAs of Config<RT, NT, S> resident at once on `sms` SMs (opting its kernel in to its shared memory).
template <int RT, int NT, int S, GemmEpilogue E>
cudaError_t cta_slots(int64_t sms, int64_t* slots) {
    int per_sm = 0;
    DDTREE_RETURN_IF_ERROR((resident_ctas_per_sm<gemm_kernel<RT, NT, S, E>>(kThreads, Config<RT, NT, S>::kSmemBytes,
                                                                            &per_sm)));
    *slots = per_sm * sms;
    return cudaSuccess;
}

// The share of the CTA slots of its last wave that a grid of `ctas` fills, `slots` CTAs resident at once.
double last_wave_fill(int64_t ctas, int64_t slots) {
    return static_cast<double>(ctas) / (static_cast<double>((ctas + slots - 1) / slots) * slots);
}

template <int NT, GemmEpilogue E>
cudaError_t launch_short_k(const GemmParams& p, cudaStream_t stream) {
    const dim3 grid((p.n + kShortKRows - 1) / kShortKRows, 1, p.batch);
    return launch_dependent(gemm_short_k_kernel<NT, E>, grid, dim3(kThreads), short_k_smem_bytes<NT>(), stream, p);
}

// Tiles by token count: more weight rows per CTA as tokens grow keeps the activation reads from L2 at most
// the weight bytes. When every K split is a single chunk (small K, or many splits) a deeper ring has nothing
// to prefetch, so one stage lets 2-4x more CTAs share an SM. The reduction order of an output never depends on
// the choice.
template <GemmEpilogue E>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
    if (p.k <= kShortKMax) return p.m <= 8 ? launch_short_k<1, E>(p, stream) : launch_short_k<2, E>(p, stream);
    const bool one_chunk = (p.k + kChunk - 1) / kChunk <= p.splits;
    const bool short_ring = p.splits == 1 && p.k <= kShortRingChunks * kChunk;  // unsplit K of at most 4 chunks
    if (p.m <= 8) {
        // Unsplit K of at most four chunks (q_b, shared down on K2): each CTA's ring never runs deep, and two
        // stages let four CTAs share an SM instead of two, so the tiles need half the latency rounds. Measured at
        // one row: q_b 77% -> 87%, shared down 75% -> 91%; deeper K lost 2-7 points with two stages.
        if (one_chunk) return launch_config<1, 1, 1, E>(p, stream);
        return short_ring ? launch_config<1, 1, 2, E>(p, stream) : launch_config<1, 1, 4, E>(p, stream);
    }
    if (p.m <= 16) {
        // 32-row tiles halve the activation reads; for projections of at most two 16-row tiles per SM
        // (q_a+kv_a, shared gate_up, router on K2) they leave too few CTAs to keep the stream going, and
        // 16-row tiles measured 6-10 points of copy bandwidth faster there (and 3-10 slower on wider ones).
        const int64_t tiles = static_cast<int64_t>((p.n + kTileRows - 1) / kTileRows) * p.batch, sms = sm_count();
        if (tiles <= 2 * sms) {
            return one_chunk ? launch_config<1, 2, 1, E>(p, stream) : launch_config<1, 2, 3, E>(p, stream);
        }
        // Unsplit K of at most four chunks in at most two waves: 16-row tiles with a two-stage ring (three CTAs per
        // SM, against two) when they fill the last wave better than 32-row tiles do. Measured at 16 rows: q_b (768
        // 16-row tiles, 1.94 waves against 1.45) 14.4 -> 12.8 us; shared down (448 tiles, 1.13 waves against
        // 0.85) would lose 10.4 -> 12.5 us and keeps 32-row tiles.
        if (!one_chunk && short_ring) {
            using Wide = Config<2, 2, 2>;
            int64_t narrow_slots = 0, wide_slots = 0;
            DDTREE_RETURN_IF_ERROR((cta_slots<1, 2, 2, E>(sms, &narrow_slots)));
            DDTREE_RETURN_IF_ERROR((cta_slots<2, 2, 2, E>(sms, &wide_slots)));
            const int64_t wide_ctas = static_cast<int64_t>((p.n + Wide::kRows - 1) / Wide::kRows) * p.batch;
            const bool narrow_better = last_wave_fill(tiles, narrow_slots) > last_wave_fill(wide_ctas, wide_slots);
            if (tiles <= 2 * narrow_slots && narrow_better) {
                return launch_config<1, 2, 2, E>(p, stream);
            }
        }
        return one_chunk ? launch_config<2, 2, 1, E>(p, stream) : launch_config<2, 2, 2, E>(p, stream);
    }
    if (p.m <= 32) return one_chunk ? launch_config<2, 4, 1, E>(p, stream) : launch_config<2, 4, 3, E>(p, stream);
    // Above 32 tokens a CTA takes 64 at a time: the weights are streamed once per 64 tokens instead of once per
    // 32, at the price of a two-stage ring (a 64-token stage is 104 KB).
    return one_chunk ? launch_config<2, 8, 1, E>(p, stream) : launch_config<2, 8, 2, E>(p, stream);
}

__global__ void transpose_kernel(bf16* dst, const bf16* src, int rows, int cols) {
    __shared__ bf16 tile[32][33];
    const int64_t base = static_cast<int64_t>(blockIdx.z) * rows * cols;
    const int c = blockIdx.x * 32 + threadIdx.x;
    for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
        const int r = blockIdx.y * 32 + dy;
        if (r < rows && c < cols) tile[dy][threadIdx.x] = src[base + static_cast<int64_t>(r) * cols + c];
    }
    __syncthreads();
    const int r_out = blockIdx.y * 32 + threadIdx.x;  // column of dst = row of src
    for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
        const int c_out = blockIdx.x * 32 + dy;
        if (c_out < cols && r_out < rows) dst[base + static_cast<int64_t>(c_out) * rows + r_out] = tile[threadIdx.x][dy];
    }
}

__global__ void interleave_kernel(bf16* dst, const bf16* gate, const bf16* up, int k) {
    const int row = blockIdx.x;  // destination row
    const int feature = (row / 16) * 8 + row % 8;
    const bf16* src = (row % 16 < 8 ? gate : up) + static_cast<int64_t>(feature) * k;
    bf16* out = dst + static_cast<int64_t>(row) * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) out[i] = src[i];
}

}  // namespace

int gemm_split_count(int n, int k, int batch) {
    const int sms = sm_count();
    const int tiles = (n + kTileRows - 1) / kTileRows * batch;
    if (tiles > sms) {
        return 1;
    }
    const int chunks = (k + kChunk - 1) / kChunk;
    return std::max(1, std::min({(kSplitTilesPerSm * sms + tiles - 1) / tiles, kMaxSplits, chunks}));
}

int64_t gemm_workspace_floats(int max_m, int n, int k, int batch) {
    const int splits = gemm_split_count(n, k, batch);
    return splits == 1 ? 0 : static_cast<int64_t>(batch) * splits * max_m * n;
}

int64_t gemm_counter_count(int n, int batch) { return static_cast<int64_t>((n + kTileRows - 1) / kTileRows) * batch; }

bool gemm_operands_aligned(const bf16* x, int64_t ldx, const bf16* w, int k, const GemmBatch& batch) {
    const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
    return aligned(x) && aligned(w) && ldx % 8 == 0 && k % 8 == 0 && batch.x_stride % 8 == 0 &&
           batch.w_stride % 8 == 0;
}

cudaError_t gemm_bf16(const bf16* x, int64_t ldx, const bf16* w, void* out, int64_t ldo, int m, int n, int k,
                      GemmEpilogue epilogue, GemmBatch batch, float* workspace, int* counters,
                      cudaStream_t stream) {
    if (m < 0 || n <= 0 || k <= 0 || batch.count <= 0 || !gemm_operands_aligned(x, ldx, w, k, batch) ||
        (epilogue == GemmEpilogue::kSiluMul && n % 16)) {
        return cudaErrorInvalidValue;
    }
    if (m == 0) {
        return cudaSuccess;
    }
    const int splits = gemm_split_count(n, k, batch.count);
    if (splits > 1 && (workspace == nullptr || counters == nullptr)) {
        return cudaErrorInvalidValue;
    }
    const GemmParams p{x, w, out, workspace, counters, ldx, ldo, batch.x_stride, batch.w_stride,
                       batch.out_stride, m, n, k, batch.count, splits};
    switch (epilogue) {
        case GemmEpilogue::kBf16:
            return launch<GemmEpilogue::kBf16>(p, stream);
        case GemmEpilogue::kF32:
            return launch<GemmEpilogue::kF32>(p, stream);
        case GemmEpilogue::kSiluMul:
            return launch<GemmEpilogue::kSiluMul>(p, stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t transpose_bf16(bf16* dst, const bf16* src, int batch, int rows, int cols, cudaStream_t stream) {
    if (batch <= 0 || rows <= 0 || cols <= 0) {
        return cudaErrorInvalidValue;
    }
    const dim3 grid((cols + 31) / 32, (rows + 31) / 32, batch);
    transpose_kernel<<<grid, dim3(32, 8), 0, stream>>>(dst, src, rows, cols);
    return cudaGetLastError();
}

cudaError_t interleave_gate_up(bf16* dst, const bf16* gate, const bf16* up, int inter, int k,
                               cudaStream_t stream) {
    if (inter <= 0 || inter % 8 || k <= 0) {
        return cudaErrorInvalidValue;
    }
    interleave_kernel<<<2 * inter, 256, 0, stream>>>(dst, gate, up, k);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
