#include "draft_rows.cuh"

namespace ddtree::kernels {
namespace {

__global__ void draft_block_rows_kernel(int32_t* ids, int32_t* positions, const int32_t* bonus, const int32_t* start,
                                        int block, int32_t mask_token) {
    const int s = blockIdx.x;
    for (int j = threadIdx.x; j < block; j += blockDim.x) {
        const int64_t r = static_cast<int64_t>(s) * block + j;
        ids[r] = j == 0 ? bonus[s] : mask_token;
        positions[r] = start[s] + j;
    }
}

__global__ void draft_append_rows_kernel(int32_t* positions, int32_t* slots, const int32_t* start,
                                         const int32_t* accept_len, const int32_t* stream_ids, int per_stream,
                                         int capacity) {
    const int s = blockIdx.x;
    const int a = accept_len[s], first = start[s] - a;
    const int64_t base = static_cast<int64_t>(stream_ids[s]) * capacity;
    for (int j = threadIdx.x; j < per_stream; j += blockDim.x) {
        const int64_t r = static_cast<int64_t>(s) * per_stream + j;
        const int position = first + j;
        positions[r] = position;
        slots[r] = j < a ? static_cast<int32_t>(base + position % capacity) : -1;
    }
}

}  // namespace

cudaError_t draft_block_rows(int32_t* ids, int32_t* positions, const int32_t* bonus, const int32_t* start,
                             int streams, int block, int32_t mask_token, cudaStream_t stream) {
    if (streams < 0 || block < 1) return cudaErrorInvalidValue;
    if (streams == 0) return cudaSuccess;
    draft_block_rows_kernel<<<streams, 32, 0, stream>>>(ids, positions, bonus, start, block, mask_token);
    return cudaGetLastError();
}

cudaError_t draft_append_rows(int32_t* positions, int32_t* slots, const int32_t* start, const int32_t* accept_len,
                              const int32_t* stream_ids, int streams, int per_stream, int capacity,
                              cudaStream_t stream) {
    if (streams < 0 || per_stream < 1 || capacity < 1) return cudaErrorInvalidValue;
    if (streams == 0) return cudaSuccess;
    draft_append_rows_kernel<<<streams, 32, 0, stream>>>(positions, slots, start, accept_len, stream_ids, per_stream,
                                                         capacity);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
