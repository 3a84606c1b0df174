// Fused routed-expert MoE with INT4 group-32 weights (W4A16): routing alignment, w13 GEMM with
// SiLU(gate) * up in its epilogue, w2 GEMM with the router weight in its epilogue, and a top-k combine
// in fixed slot order.
//
// Batch invariance: every output element is one chain of m16n8k16 MMAs over k in increasing order,
// with weights as the MMA rows and tokens as independent MMA columns; the combine sums a token's slots
// in slot order. Nothing depends on how many tokens share the call.
//
// Repacked weight layout (produced by runtime/moe_repack.cpp on the host and by kernels/moe_repack.cu on the
// device): per expert, the weight rows (output features) are cut into stripes of kStripeRows rows; one CTA unit
// streams one stripe over the whole reduction dim. A stripe is contiguous and made of K / kStageK stage chunks
// of kStageBytes:
//   weights: int32 word ((warp * 2 + half) * 32 + lane) * 4 + j, warp 0..7 owning tile rows
//            16*warp .. 16*warp+15, k16 step = half * 4 + j of the stage. With g = lane / 4,
//            t = lane % 4 and kb = stage k + 16 * step, nibble i holds q at tile row g + 8 * (i & 1),
//            k = kb + 2t + 8 * ((i >> 1) & 1) + (i >> 2) (the bf16 MMA A fragment, two k per register).
//   scales:  after the weights, bf16 index ((warp * 8 + g) * 2 + hi) * 4 + grp = scale of tile row
//            16*warp + g + 8*hi for k group (stage k / 32) + grp.
// w13 tile rows interleave gate and up: warp tile row r < 8 is gate feature f, r >= 8 is up feature f,
// f = 64 * stripe + 8 * warp + (r & 7), so the GEMM1 epilogue sees both in one thread.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common.cuh"

namespace ddtree::kernels::moe {

constexpr int kGroup = 32;            // inputs per quantization scale
constexpr int kStripeRows = 128;      // weight rows per CTA unit (8 warps x m16)
constexpr int kStageK = 128;          // reduction slice per pipeline stage
constexpr int kStageWeightBytes = kStripeRows * kStageK / 2;
constexpr int kStageScaleBytes = kStripeRows * (kStageK / kGroup) * 2;
constexpr int kStageBytes = kStageWeightBytes + kStageScaleBytes;
constexpr int kBlockTokens = 64;      // token columns per CTA unit at most
constexpr int kPairedMaxTiles = 4;    // blocks of at most 4 x 8 tokens may run two stripes per CTA unit
constexpr int kMaxExperts = 1024;     // one routing thread per expert
constexpr int kMaxTopk = 16;

#if defined(__CUDACC__)
// Whether a (token, slot) pair goes to its expert: an id in range that the mask keeps (nullptr keeps all). The
// alignment, the GEMM and the combine must agree on it, or a token's sum would depend on the call.
__device__ __forceinline__ bool routed(int e, int experts, const uint8_t* mask) {
    return e >= 0 && e < experts && (mask == nullptr || mask[e] != 0);
}
#endif

// Sizes that hold for every supported shape: hidden % 128 == 0, inter % 128 == 0.
inline bool shape_supported(int hidden, int inter) {
    return hidden > 0 && inter > 0 && hidden % kStageK == 0 && inter % kStageK == 0;
}
// Whether the fused MoE takes a layer of this shape (MoeLayer's constructor names the bound that fails).
inline bool layer_supported(int hidden, int inter, int experts, int topk) {
    return shape_supported(hidden, inter) && experts >= 1 && experts <= kMaxExperts && topk >= 1 && topk <= kMaxTopk;
}
// One projection of stacked experts in checkpoint format: packed int32 [experts, rows, cols / 8] (nibble i of word
// j = q of input 8j + i, LSB first) and bf16 scale bits [experts, rows, cols / 32]; host or device memory.
struct PackedProjection {
    const int32_t* packed;
    const uint16_t* scale;
};

// The repacked layout above as index arithmetic, shared by the host repack, its unpack oracle and the device
// repack. A stage holds kStageWords weight words, then kStageScales scales.
constexpr int kStageWords = kStageWeightBytes / 4;
constexpr int kStageScales = kStageScaleBytes / 2;
struct LayoutSlot {
    int tile_row, col;  // tile row of the stripe; k (weights) or k group (scales) from the stage's first
};
__host__ __device__ inline LayoutSlot weight_slot(int word, int nibble) {
    const int j = word % 4, lane = (word / 4) % 32, warp_half = word / 128;
    const int warp = warp_half / 2, half = warp_half % 2;
    const int g = lane / 4, t = lane % 4;
    return {warp * 16 + g + 8 * (nibble & 1), (half * 4 + j) * 16 + 2 * t + 8 * ((nibble >> 1) & 1) + (nibble >> 2)};
}
__host__ __device__ inline LayoutSlot scale_slot(int index) {
    const int grp = index % 4, hi = (index / 4) % 2, wg = index / 8;
    const int warp = wg / 8, g = wg % 8;
    return {warp * 16 + g + 8 * hi, grp};
}
// Weight word `word` of stage `ks` of a stripe, its nibbles gathered from the checkpoint: row_words(tile_row) is
// that tile row's packed int32 row.
template <typename RowWords>
__host__ __device__ inline uint32_t repacked_word(int word, int ks, RowWords row_words) {
    uint32_t v = 0;
    for (int nib = 0; nib < 8; ++nib) {
        const LayoutSlot slot = weight_slot(word, nib);
        const int col = ks * kStageK + slot.col;
        const uint32_t src = static_cast<uint32_t>(row_words(slot.tile_row)[col / 8]);
        v |= ((src >> (4 * (col % 8))) & 0xFu) << (4 * nib);
    }
    return v;
}

// One repacked matrix of a layer: w13 (gate_up: gate and up rows, reduced over hidden) or w2 (down rows, reduced
// over inter). Its sizes and checkpoint rows follow from (hidden, inter) alone.
struct StripedMatrix {
    bool gate_up;
    int hidden, inter;

    __host__ __device__ int stripes() const { return (gate_up ? 2 * inter : hidden) / kStripeRows; }
    __host__ __device__ int cols() const { return gate_up ? hidden : inter; }  // reduction length
    __host__ __device__ size_t stripe_bytes() const { return static_cast<size_t>(cols() / kStageK) * kStageBytes; }
    __host__ __device__ size_t expert_bytes() const { return stripe_bytes() * stripes(); }
    __host__ __device__ size_t stage_offset(int expert, int stripe, int ks) const {
        return expert * expert_bytes() + stripe * stripe_bytes() + static_cast<size_t>(ks) * kStageBytes;
    }
    // Checkpoint row of a stripe's tile row: w2 rows in order; w13 gate row f (< inter) or up row inter + f.
    __host__ __device__ int row(int stripe, int tile_row) const {
        if (!gate_up) return stripe * kStripeRows + tile_row;
        const int warp = tile_row / 16, r = tile_row % 16;
        const int f = stripe * (kStripeRows / 2) + warp * 8 + (r & 7);
        return r < 8 ? f : inter + f;
    }
    // Packed words and scales of the checkpoint row behind a tile row. w13: `first` is gate, `second` up, both
    // [experts, inter, ...]; w2: `first` is down [experts, hidden, ...] (`second` unused).
    __host__ __device__ PackedProjection source_row(PackedProjection first, PackedProjection second, int expert,
                                                    int stripe, int tile_row) const {
        const int r = row(stripe, tile_row);
        const bool in_first = !gate_up || r < inter;
        const size_t at = static_cast<size_t>(expert) * (gate_up ? inter : hidden) + (in_first ? r : r - inter);
        const PackedProjection& p = in_first ? first : second;
        return {p.packed + at * (cols() / 8), p.scale + at * (cols() / kGroup)};
    }
};

// Stores `v` at byte address `at`: as one store on the device, whose stages start 16-byte aligned in its own
// allocation; through memcpy on the host, which may write into any caller's buffer.
template <typename T>
__host__ __device__ inline void store_bytes(uint8_t* at, T v) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<T*>(at) = v;
#else
    std::memcpy(at, &v, sizeof(T));
#endif
}

// Writes stage `ks` of a stripe (weight words, then scales) from the checkpoint rows of its tile rows. Items
// first, first + step, ..., so that one host thread (0, 1) or the threads of a CTA (thread, threads) write it.
__host__ __device__ inline void write_stage(uint8_t* stage, int ks, const PackedProjection* rows, int first,
                                            int step) {
    for (int word = first; word < kStageWords; word += step) {
        store_bytes(stage + word * 4, repacked_word(word, ks, [&](int tile_row) { return rows[tile_row].packed; }));
    }
    for (int i = first; i < kStageScales; i += step) {
        const LayoutSlot slot = scale_slot(i);
        store_bytes(stage + kStageWeightBytes + i * 2, rows[slot.tile_row].scale[ks * (kStageK / kGroup) + slot.col]);
    }
}

inline size_t w13_bytes_per_expert(int hidden, int inter) { return StripedMatrix{true, hidden, inter}.expert_bytes(); }
inline size_t w2_bytes_per_expert(int hidden, int inter) { return StripedMatrix{false, hidden, inter}.expert_bytes(); }
inline int max_blocks(int experts, int max_pairs) { return experts + max_pairs / kBlockTokens + 1; }

// Scratch of one fused call, sized for max_tokens at creation (see workspace_bytes).
struct Workspace {
    int* pair_rank;     // [max_pairs] rank of a (token, slot) pair inside its expert, -1 if skipped (align's
                        //     scratch; pairs 0..1023 keep theirs in registers)
    int* sorted_pairs;  // [max_pairs] pair ids grouped by expert
    int4* blocks;       // [max_blocks] {expert, first sorted index, tokens, 0}
    int* counters;      // [4] block count, next GEMM1 unit, next GEMM2 unit, blocks wider than
                        //     kPairedMaxTiles tiles (listed first)
    bf16* act;          // [max_pairs, inter] SiLU(gate) * up per pair
    float* contrib;     // [max_pairs, hidden] weighted expert output per pair
};
size_t workspace_bytes(int experts, int hidden, int inter, int topk, int max_tokens);
// Carves `base` (256-byte aligned, workspace_bytes long) into the buffers above.
Workspace carve_workspace(void* base, int experts, int hidden, int inter, int topk, int max_tokens);

struct MoeArgs {
    const uint8_t* w13;           // [experts, w13_bytes_per_expert] repacked gate/up
    const uint8_t* w2;            // [experts, w2_bytes_per_expert] repacked down
    const bf16* hidden_states;    // [tokens, hidden]
    const int32_t* topk_ids;      // [tokens, topk]; ids outside [0, experts) are skipped
    const float* topk_weights;    // [tokens, topk]
    const uint8_t* expert_mask;   // [experts], 0 = expert owned elsewhere (skipped); nullptr = all local
    bf16* out;                    // [tokens, hidden]
    int tokens, experts, hidden, inter, topk;
    float routed_scaling_factor;
};

// Sets kernel attributes on the current device (once per device) and returns its persistent GEMM grid (CTAs
// resident at once).
cudaError_t configure(int* gemm_ctas);

// The whole routed MoE on `stream`: 4 kernels (3 for at most 32 (token, slot) pairs, whose GEMMs align the
// routing themselves and leave the workspace's routing buffers untouched), each launched as a programmatic
// dependent of the previous one (the first waits for whatever precedes the call); no allocation, no host sync
// (CUDA-graph capturable).
cudaError_t moe_forward(const MoeArgs& args, const Workspace& ws, int gemm_ctas, cudaStream_t stream);

// Routing alignment only (moe_align.cu): fills sorted_pairs, blocks, counters, and pair_rank for pairs past the
// first 1024. moe_forward skips it for calls of at most 32 pairs.
cudaError_t moe_align(const int32_t* topk_ids, const uint8_t* expert_mask, int tokens, int topk, int experts,
                      const Workspace& ws, cudaStream_t stream);

// Test oracle on the device: expands repacked weights to bf16((q - 8) * s) with the GEMM's own
// fragment loads and dequantization. out is [experts, rows, k] in checkpoint row order (w13: gate rows
// then up rows).
cudaError_t dequantize_w13(bf16* out, const uint8_t* w13, int experts, int hidden, int inter, cudaStream_t stream);
cudaError_t dequantize_w2(bf16* out, const uint8_t* w2, int experts, int hidden, int inter, cudaStream_t stream);

}  // namespace ddtree::kernels::moe
