// Device repack (see moe_repack.cuh): one CTA per (stage of a stripe, expert), one thread per output word.
#include "moe_repack.cuh"

namespace ddtree::kernels::moe {
namespace {

constexpr int kThreads = 256;

// rows_per_expert: rows of `first` per expert (w13: inter; w2: hidden); w13's rows past inter come from `second`.
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads) repack_kernel(uint8_t* out, PackedProjection first, PackedProjection second,
                                                          int rows_per_expert, int cols, int inter, int stripes) {
    const int nk = cols / kStageK, expert = blockIdx.y;
    const int stripe = blockIdx.x / nk, ks = blockIdx.x % nk;
    uint8_t* stage = out + ((static_cast<size_t>(expert) * stripes + stripe) * nk + ks) * kStageBytes;
    // The checkpoint row behind a tile row of this stripe: its packed words and scales.
    auto source = [&](int tile_row) {
        const int row = checkpoint_row(kGateUp, inter, stripe, tile_row);
        const bool in_first = !kGateUp || row < inter;
        const size_t r = static_cast<size_t>(expert) * rows_per_expert + (in_first ? row : row - inter);
        const PackedProjection& p = in_first ? first : second;
        return PackedProjection{p.packed + r * (cols / 8), p.scale + r * (cols / kGroup)};
    };
    for (int word = threadIdx.x; word < kStageWords; word += kThreads) {
        reinterpret_cast<uint32_t*>(stage)[word] =
            repacked_word(word, ks, [&](int tile_row) { return source(tile_row).packed; });
    }
    for (int i = threadIdx.x; i < kStageScales; i += kThreads) {
        const LayoutSlot slot = scale_slot(i);
        reinterpret_cast<uint16_t*>(stage + kStageWeightBytes)[i] =
            source(slot.tile_row).scale[ks * (kStageK / kGroup) + slot.col];
    }
}

template <bool kGateUp>
cudaError_t launch(uint8_t* out, PackedProjection first, PackedProjection second, int experts, int rows_per_expert,
                   int cols, int inter, int stripes, cudaStream_t stream) {
    if (experts < 0 || experts > 65535) return cudaErrorInvalidValue;  // grid.y
    if (experts == 0) return cudaSuccess;
    repack_kernel<kGateUp><<<dim3(stripes * (cols / kStageK), experts), kThreads, 0, stream>>>(
        out, first, second, rows_per_expert, cols, inter, stripes);
    return cudaGetLastError();
}

}  // namespace

cudaError_t repack_w13_on_device(uint8_t* out, PackedProjection gate, PackedProjection up, int experts, int hidden,
                                 int inter, cudaStream_t stream) {
    if (!shape_supported(hidden, inter)) return cudaErrorInvalidValue;
    return launch<true>(out, gate, up, experts, inter, hidden, inter, 2 * inter / kStripeRows, stream);
}

cudaError_t repack_w2_on_device(uint8_t* out, PackedProjection down, int experts, int hidden, int inter,
                                cudaStream_t stream) {
    if (!shape_supported(hidden, inter)) return cudaErrorInvalidValue;
    return launch<false>(out, down, down, experts, hidden, inter, inter, hidden / kStripeRows, stream);
}

}  // namespace ddtree::kernels::moe
