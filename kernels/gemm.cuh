// bf16 weight-streaming GEMM for the dense projections: out[m, n] = sum_k x[m, k] * w[n, k].
//
// Decode multiplies <= 64 rows by large weights, so the kernel is built to stream weights at copy bandwidth.
// A CTA owns 16 or 32 weight rows (output features) and walks K in chunks of 512 columns: each stage brings
// 1 KB of every weight row and of every token row into shared memory with bulk (TMA) copies, weights marked
// evict-first. Four warps each take a fixed quarter of every chunk and feed mma.sync with the weights as the
// 16-row operand and the tokens (8 per tile) as the narrow one; the four partial sums are added in warp order.
// When N alone gives too few CTAs to fill the GPU, K is split into `gemm_split_count(N, K, batch)` contiguous
// chunk ranges; the last CTA of a tile to finish sums the fp32 partials in split order and applies the
// epilogue. Every count that shapes a reduction depends on (N, K, batch) only, never on M, so a row's result is
// bitwise the same however many rows share the launch (batch invariance).
//
// K <= 128 (the absorbed-k projection) takes a kernel of its own: the four warps own separate 16-row tiles
// over the whole of K, and a CTA's 64 weight rows arrive in one bulk copy.
//
// Launches are dependent launches (kernels/common.cuh): the first stages' weight copies are issued before the
// kernel waits for the previous kernel of the stream, so decode-size GEMMs overlap their start with its tail.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

enum class GemmEpilogue {
    kBf16,     // out bf16 [M, N]
    kF32,      // out fp32 [M, N]
    kSiluMul,  // weight rows interleaved in blocks of 8 gate then 8 up rows; out bf16 [M, N / 2] = silu(g) * u
};

struct GemmBatch {
    int count = 1;         // independent problems sharing shapes (e.g. attention heads)
    int64_t x_stride = 0;  // elements between problems' x, w and out
    int64_t w_stride = 0;
    int64_t out_stride = 0;
};

// Number of K ranges the GEMM splits into for these weight shapes (1 = no split).
int gemm_split_count(int n, int k, int batch);

// Workspace the launcher needs: fp32 partials and per-tile arrival counters (zeroed once; self-resetting).
int64_t gemm_workspace_floats(int max_m, int n, int k, int batch);
int64_t gemm_counter_count(int n, int batch);

// True when the bulk copies can read these operands: x and w 16-byte aligned, ldx, K and the batch strides of
// x and w multiples of 8 elements.
bool gemm_operands_aligned(const bf16* x, int64_t ldx, const bf16* w, int k, const GemmBatch& batch);

// x: [M, K] with row stride ldx; w: [N, K] contiguous; out row stride ldo. Operands as gemm_operands_aligned
// requires; N a multiple of 16 for kSiluMul. workspace/counters may be null when
// gemm_split_count(N, K, batch) == 1.
cudaError_t gemm_bf16(const bf16* x, int64_t ldx, const bf16* w, void* out, int64_t ldo, int m, int n, int k,
                      GemmEpilogue epilogue, GemmBatch batch, float* workspace, int* counters,
                      cudaStream_t stream);

// dst[b] = src[b]^T for `batch` row-major [rows, cols] bf16 matrices (weight preparation at load time).
cudaError_t transpose_bf16(bf16* dst, const bf16* src, int batch, int rows, int cols, cudaStream_t stream);

// dst rows for a kSiluMul weight: blocks of 8 rows taken alternately from gate [I, K] and up [I, K].
cudaError_t interleave_gate_up(bf16* dst, const bf16* gate, const bf16* up, int inter, int k, cudaStream_t stream);

}  // namespace ddtree::kernels
