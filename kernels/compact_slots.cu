#include "compact_slots.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 256;

// One CTA: slot i is written only after every slot before it, and keep[i] >= i, so a slot is read before any move
// reaches it.
__global__ void __launch_bounds__(kThreads) compact_slots_kernel(SlotArrays arrays, const int32_t* keep, int kept) {
    for (int i = 0; i < kept; ++i) {
        const int from = keep[i];
        if (from != i) {
            for (int a = 0; a < arrays.count; ++a) {
                const int64_t w = arrays.width[a];
                int32_t* data = arrays.data[a];
                for (int64_t e = threadIdx.x; e < w; e += kThreads) data[i * w + e] = data[from * w + e];
            }
        }
        __syncthreads();
    }
}

}  // namespace

cudaError_t compact_slots(const SlotArrays& arrays, const int32_t* keep, int kept, cudaStream_t stream) {
    if (kept < 0 || arrays.count < 0 || arrays.count > kCompactMaxArrays) return cudaErrorInvalidValue;
    for (int a = 0; a < arrays.count; ++a) {
        if (arrays.data[a] == nullptr || arrays.width[a] < 1) return cudaErrorInvalidValue;
    }
    if (kept == 0) return cudaSuccess;
    compact_slots_kernel<<<1, kThreads, 0, stream>>>(arrays, keep, kept);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
