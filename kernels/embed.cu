// Row gather kernels: pure copies, 16 bytes per thread per iteration.
#include "embed.cuh"

namespace ddtree::kernels {
namespace {

__global__ void gather_rows_kernel(bf16* out, int64_t out_ld, const bf16* table, int64_t table_ld,
                                   const int32_t* ids, int chunks) {
    dependent_kernel_start();
    const int64_t src_row = ids[blockIdx.x];
    const uint4* src = reinterpret_cast<const uint4*>(table + src_row * table_ld);
    uint4* dst = reinterpret_cast<uint4*>(out + static_cast<int64_t>(blockIdx.x) * out_ld);
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
        dst[i] = src[i];
    }
}

}  // namespace

cudaError_t gather_rows(bf16* out, int64_t out_ld, const bf16* table, int64_t table_ld, const int32_t* ids,
                        int rows, int dim, cudaStream_t stream) {
    if (rows < 0 || dim <= 0 || dim % 8 || table_ld % 8 || out_ld % 8) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
    return launch_dependent(gather_rows_kernel, dim3(rows), dim3(128), 0, stream, out, out_ld, table, table_ld, ids,
                            dim / 8);
}

}  // namespace ddtree::kernels
