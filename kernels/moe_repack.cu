// Device repack (see moe_repack.cuh): one CTA per (stage of a stripe, expert), its threads sharing the stage's
// words and scales; the stripe's layout and checkpoint rows are those the host repack uses (moe_marlin.cuh).
#include "moe_repack.cuh"

namespace ddtree::kernels::moe {
namespace {

constexpr int kThreads = 256;
static_assert(kThreads >= kStripeRows, "one thread finds each tile row's checkpoint row");

// w13: `first` is gate, `second` up; w2: `first` is down.
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads) repack_kernel(uint8_t* out, PackedProjection first, PackedProjection second,
                                                          int hidden, int inter) {
    const StripedMatrix matrix{kGateUp, hidden, inter};
    const int nk = matrix.cols() / kStageK, expert = blockIdx.y;
    const int stripe = blockIdx.x / nk, ks = blockIdx.x % nk;
    // Found once per CTA: every word gathers its nibbles from two of these rows.
    __shared__ PackedProjection rows[kStripeRows];
    if (threadIdx.x < kStripeRows) rows[threadIdx.x] = matrix.source_row(first, second, expert, stripe, threadIdx.x);
    __syncthreads();
    write_stage(out + matrix.stage_offset(expert, stripe, ks), ks, rows, threadIdx.x, kThreads);
}

template <bool kGateUp>
cudaError_t launch(uint8_t* out, PackedProjection first, PackedProjection second, int experts, int hidden, int inter,
                   cudaStream_t stream) {
    if (!shape_supported(hidden, inter) || experts < 0 || experts > 65535) return cudaErrorInvalidValue;  // grid.y
    if (experts == 0) return cudaSuccess;
    const StripedMatrix matrix{kGateUp, hidden, inter};
    repack_kernel<kGateUp><<<dim3(matrix.stripes() * (matrix.cols() / kStageK), experts), kThreads, 0, stream>>>(
        out, first, second, hidden, inter);
    return cudaGetLastError();
}

}  // namespace

cudaError_t repack_w13_on_device(uint8_t* out, PackedProjection gate, PackedProjection up, int experts, int hidden,
                                 int inter, cudaStream_t stream) {
    return launch<true>(out, gate, up, experts, hidden, inter, stream);
}

cudaError_t repack_w2_on_device(uint8_t* out, PackedProjection down, int experts, int hidden, int inter,
                                cudaStream_t stream) {
    return launch<false>(out, down, down, experts, hidden, inter, stream);
}

}  // namespace ddtree::kernels::moe
