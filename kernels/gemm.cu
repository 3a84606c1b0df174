// Weight-streaming bf16 GEMM (see gemm.cuh for the design and the batch-invariance argument).
#include <algorithm>

#include "gemm.cuh"
#include "gemm_mma.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerCta = kWarps * 16;
constexpr int kSubSteps = 4;  // k32 slices per pipeline step (8 cp.async of 16 B per thread)
constexpr int kStepK = 32 * kSubSteps;
constexpr int kXLd = kStepK + 32;  // activation rows of 320 B in smem: conflict-free 16-byte fragment reads
constexpr int kTargetCtas = 264;  // one wave of 2 resident CTAs per SM on a 132-SM H200
constexpr int kMaxSplits = 16;
constexpr int kMinStepsPerSplit = 4;

// Per token-tile count NT: pipeline depth and shared memory (weights 16 KB + activations 8*NT rows per stage),
// chosen so two CTAs fit on an SM.
template <int NT>
struct Pipe {
    static constexpr int kStages = NT <= 2 ? 5 : 3;
    static constexpr int kRows = 8 * NT;
    static constexpr int kWeightU4 = kSubSteps * 2 * kThreads;  // uint4 per weight stage
    static constexpr int kXElems = kRows * kXLd;
    static constexpr int kSmemBytes = kStages * (kWeightU4 * 16 + kXElems * 2);
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
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

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

template <GemmEpilogue E>
__device__ __forceinline__ void store_silu(const GemmParams& p, int b, int tok, int gate_row, float gate,
                                           float up) {
    static_cast<bf16*>(p.out)[b * p.out_stride + tok * p.ldo + silu_feature(gate_row)] =
        __float2bfloat16(silu(gate) * up);
}

template <int NT, GemmEpilogue E>
__global__ void __launch_bounds__(kThreads) gemm_kernel(GemmParams p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int b = blockIdx.z, tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const bf16* x = p.x + b * p.x_stride;
    const bf16* w = p.w + b * p.w_stride;
    const int row_a = tile * kRowsPerCta + warp * 16 + g, row_b = row_a + 8;
    const bool valid_a = row_a < p.n, valid_b = row_b < p.n;
    const bf16* w_a = w + static_cast<int64_t>(valid_a ? row_a : 0) * p.k;
    const bf16* w_b = w + static_cast<int64_t>(valid_b ? row_b : 0) * p.k;
    const int steps = (p.k + kStepK - 1) / kStepK;
    const int step_begin = split * steps / splits, step_end = (split + 1) * steps / splits;

    // Weights: each thread prefetches exactly the fragments it will consume into its own smem slots
    // (consecutive lanes, 16 B each: conflict-free). Activations of the CTA's token tile are shared by its
    // warps, so a barrier per stage publishes them (and frees the stage refilled next).
    using P = Pipe<NT>;
    extern __shared__ uint4 stage_smem[];
    uint4* w_smem = stage_smem;
    bf16* x_smem = reinterpret_cast<bf16*>(stage_smem + P::kStages * P::kWeightU4);
    int tok0 = 0;
    auto issue = [&](int step) {
        uint4* dst = w_smem + (step % P::kStages) * P::kWeightU4 + threadIdx.x;
#pragma unroll
        for (int j = 0; j < kSubSteps; ++j) {
            const int kk = step * kStepK + 32 * j + 8 * t;
            const bool in_k = kk < p.k;
            cp_async16_zfill(dst + (2 * j) * kThreads, w_a + (in_k ? kk : 0), valid_a && in_k);
            cp_async16_zfill(dst + (2 * j + 1) * kThreads, w_b + (in_k ? kk : 0), valid_b && in_k);
        }
        bf16* xs = x_smem + (step % P::kStages) * P::kXElems;
        for (int c = threadIdx.x; c < P::kRows * (kStepK / 8); c += kThreads) {
            const int r = c / (kStepK / 8), kk = step * kStepK + (c % (kStepK / 8)) * 8;
            const int tok = tok0 + r;
            const bool valid = tok < p.m && kk < p.k;
            cp_async16_zfill(xs + r * kXLd + (c % (kStepK / 8)) * 8,
                             x + static_cast<int64_t>(valid ? tok : 0) * p.ldx + (valid ? kk : 0), valid);
        }
    };

    for (; tok0 < p.m; tok0 += P::kRows) {
        float acc[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
        }
#pragma unroll
        for (int s = 0; s < P::kStages - 1; ++s) {
            if (step_begin + s < step_end) issue(step_begin + s);
            cp_async_commit();
        }
        for (int step = step_begin; step < step_end; ++step) {
            cp_async_wait<P::kStages - 2>();
            __syncthreads();
            if (step + P::kStages - 1 < step_end) issue(step + P::kStages - 1);
            cp_async_commit();
            const uint4* src = w_smem + (step % P::kStages) * P::kWeightU4 + threadIdx.x;
            const bf16* xs = x_smem + (step % P::kStages) * P::kXElems;
            uint4 wa[kSubSteps], wb[kSubSteps];
#pragma unroll
            for (int j = 0; j < kSubSteps; ++j) {
                wa[j] = src[(2 * j) * kThreads];
                wb[j] = src[(2 * j + 1) * kThreads];
            }
#pragma unroll
            for (int i = 0; i < NT; ++i) {
#pragma unroll
                for (int j = 0; j < kSubSteps; ++j) {
                    // Each thread's 8 consecutive k feed slots {2t,2t+1,2t+8,2t+9} of two k16 MMAs; weights
                    // and activations use the same permutation, so the dot products are unchanged.
                    const uint4 xa = *reinterpret_cast<const uint4*>(xs + (8 * i + g) * kXLd + 32 * j + 8 * t);
                    mma_bf16_16816(acc[i], wa[j].x, wb[j].x, wa[j].y, wb[j].y, xa.x, xa.y);
                    mma_bf16_16816(acc[i], wa[j].z, wb[j].z, wa[j].w, wb[j].w, xa.z, xa.w);
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the next token tile refills every stage
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            const int tok = tok0 + 8 * i + 2 * t;
            if (splits == 1) {
                if constexpr (E == GemmEpilogue::kSiluMul) {
                    if (valid_a) {
                        if (tok < p.m) store_silu<E>(p, b, tok, row_a, acc[i][0], acc[i][2]);
                        if (tok + 1 < p.m) store_silu<E>(p, b, tok + 1, row_a, acc[i][1], acc[i][3]);
                    }
                } else {
                    if (valid_a && tok < p.m) store_out<E>(p, b, tok, row_a, acc[i][0]);
                    if (valid_a && tok + 1 < p.m) store_out<E>(p, b, tok + 1, row_a, acc[i][1]);
                    if (valid_b && tok < p.m) store_out<E>(p, b, tok, row_b, acc[i][2]);
                    if (valid_b && tok + 1 < p.m) store_out<E>(p, b, tok + 1, row_b, acc[i][3]);
                }
            } else {
                float* part = p.workspace + (static_cast<int64_t>(b) * splits + split) * p.m * p.n;
                if (valid_a && tok < p.m) part[static_cast<int64_t>(tok) * p.n + row_a] = acc[i][0];
                if (valid_a && tok + 1 < p.m) part[static_cast<int64_t>(tok + 1) * p.n + row_a] = acc[i][1];
                if (valid_b && tok < p.m) part[static_cast<int64_t>(tok) * p.n + row_b] = acc[i][2];
                if (valid_b && tok + 1 < p.m) part[static_cast<int64_t>(tok + 1) * p.n + row_b] = acc[i][3];
            }
        }
    }
    if (splits == 1) {
        return;
    }

    // The last split of this tile to arrive sums every split's partial in split order.
    __shared__ bool is_last;
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
            sum += __ldcg(parts + s * split_stride + static_cast<int64_t>(tok) * p.n + row);
        }
        return sum;
    };
    if constexpr (E == GemmEpilogue::kSiluMul) {
        for (int idx = threadIdx.x; idx < p.m * (kRowsPerCta / 2); idx += kThreads) {
            const int tok = idx / (kRowsPerCta / 2), f = idx % (kRowsPerCta / 2);
            const int gate_row = tile * kRowsPerCta + (f / 8) * 16 + f % 8;
            if (gate_row < p.n) {
                store_silu<E>(p, b, tok, gate_row, reduce(tok, gate_row), reduce(tok, gate_row + 8));
            }
        }
    } else {
        for (int idx = threadIdx.x; idx < p.m * kRowsPerCta; idx += kThreads) {
            const int tok = idx / kRowsPerCta, row = tile * kRowsPerCta + idx % kRowsPerCta;
            if (row < p.n) {
                store_out<E>(p, b, tok, row, reduce(tok, row));
            }
        }
    }
}

template <int NT, GemmEpilogue E>
cudaError_t launch_nt(const GemmParams& p, dim3 grid, cudaStream_t stream) {
    static std::atomic<uint64_t> configured{0};
    DDTREE_RETURN_IF_ERROR(opt_in_smem(gemm_kernel<NT, E>, Pipe<NT>::kSmemBytes, configured));
    gemm_kernel<NT, E><<<grid, kThreads, Pipe<NT>::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
}

template <GemmEpilogue E>
cudaError_t launch(const GemmParams& p, dim3 grid, cudaStream_t stream) {
    if (p.m <= 8) return launch_nt<1, E>(p, grid, stream);
    if (p.m <= 16) return launch_nt<2, E>(p, grid, stream);
    if (p.m <= 32) return launch_nt<4, E>(p, grid, stream);
    return launch_nt<8, E>(p, grid, stream);
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

__device__ __forceinline__ uint64_t hash64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__global__ void fill_bf16_kernel(bf16* dst, int64_t count, uint64_t seed, float scale, float offset) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float u = static_cast<float>(hash64(seed + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull) >> 40) *
                            (2.f / 16777216.f) - 1.f;
        dst[i] = __float2bfloat16(offset + scale * u);
    }
}

__global__ void fill_bytes_kernel(uint8_t* dst, int64_t count, uint64_t seed, int lo, int span) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        dst[i] = static_cast<uint8_t>(lo + hash64(seed + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull) % span);
    }
}

}  // namespace

cudaError_t fill_random_bf16(bf16* dst, int64_t count, uint64_t seed, float scale, float offset, cudaStream_t stream) {
    if (count <= 0) {
        return count == 0 ? cudaSuccess : cudaErrorInvalidValue;
    }
    fill_bf16_kernel<<<1024, 256, 0, stream>>>(dst, count, seed, scale, offset);
    return cudaGetLastError();
}

cudaError_t fill_random_bytes(uint8_t* dst, int64_t count, uint64_t seed, int lo, int hi, cudaStream_t stream) {
    if (count < 0 || lo < 0 || hi > 255 || lo > hi) {
        return cudaErrorInvalidValue;
    }
    if (count == 0) {
        return cudaSuccess;
    }
    fill_bytes_kernel<<<1024, 256, 0, stream>>>(dst, count, seed, lo, hi - lo + 1);
    return cudaGetLastError();
}

int gemm_split_count(int n, int k, int batch) {
    const int tiles = (n + kRowsPerCta - 1) / kRowsPerCta * batch;
    const int steps = (k + kStepK - 1) / kStepK;
    int splits = (kTargetCtas + tiles - 1) / tiles;
    splits = std::min({splits, kMaxSplits, steps / kMinStepsPerSplit});
    return std::max(splits, 1);
}

int64_t gemm_workspace_floats(int max_m, int n, int k, int batch) {
    const int splits = gemm_split_count(n, k, batch);
    return splits == 1 ? 0 : static_cast<int64_t>(batch) * splits * max_m * n;
}

int64_t gemm_counter_count(int n, int batch) {
    return static_cast<int64_t>((n + kRowsPerCta - 1) / kRowsPerCta) * batch;
}

cudaError_t gemm_bf16(const bf16* x, int64_t ldx, const bf16* w, void* out, int64_t ldo, int m, int n, int k,
                      GemmEpilogue epilogue, GemmBatch batch, float* workspace, int* counters,
                      cudaStream_t stream) {
    if (m < 0 || n <= 0 || k <= 0 || k % 8 || ldx % 8 || batch.count <= 0 ||
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
                       batch.out_stride, m, n, k};
    const dim3 grid((n + kRowsPerCta - 1) / kRowsPerCta, splits, batch.count);
    switch (epilogue) {
        case GemmEpilogue::kBf16:
            return launch<GemmEpilogue::kBf16>(p, grid, stream);
        case GemmEpilogue::kF32:
            return launch<GemmEpilogue::kF32>(p, grid, stream);
        case GemmEpilogue::kSiluMul:
            return launch<GemmEpilogue::kSiluMul>(p, grid, stream);
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
