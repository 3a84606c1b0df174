#include "oracle_draft.cuh"

namespace ddtree::kernels {
namespace {

__global__ void oracle_draft_kernel(float* log_probs, int32_t* token_ids, int width, const int32_t* count,
                                    OracleDraft oracle, int depth_limit) {
    const int s = blockIdx.x, d = blockIdx.y + 1;  // depth 1..L
    const int column = count[s] - 1 + d;
    const bool known = column < *oracle.reference_len;
    const int32_t want = known ? oracle.reference[static_cast<int64_t>(s) * oracle.reference_ld + column] : 0;
    const uint64_t h =
        hash_at(*oracle.seed ^ (static_cast<uint64_t>(s) << 40), static_cast<uint64_t>(count[s]) * 64 + d);
    const float draw = static_cast<float>(h >> 40) * (1.f / 16777216.f), p = oracle.hit[d - 1];
    const int spread = min(width, 4);
    // rank 0 below p, a side rank in the next half of the rest (when there is one), else no candidate
    const int rank = draw < p                                        ? 0
                     : spread > 1 && draw < p + 0.5f * (1.f - p) ? 1 + static_cast<int>((h >> 8) % (spread - 1))
                                                                   : -1;
    const bool hit = known && rank >= 0;
    const int64_t at = (static_cast<int64_t>(s) * depth_limit + (d - 1)) * width;
    for (int r = threadIdx.x; r < width; r += blockDim.x) {
        log_probs[at + r] = -0.1f - 0.5f * r;
        token_ids[at + r] = hit && r == rank ? want : static_cast<int32_t>((want + 1 + r) % oracle.vocab);
    }
}

}  // namespace

cudaError_t oracle_draft(float* log_probs, int32_t* token_ids, int width, const int32_t* count,
                         const OracleDraft& oracle, const TreeShape& shape, cudaStream_t stream) {
    if (!tree_shape_valid(shape) || width < 1 || width >= oracle.vocab) {
        return cudaErrorInvalidValue;
    }
    if (shape.streams == 0) return cudaSuccess;
    oracle_draft_kernel<<<dim3(shape.streams, shape.depth_limit), 128, 0, stream>>>(log_probs, token_ids, width,
                                                                                    count, oracle, shape.depth_limit);
    return cudaGetLastError();
}

}  // namespace ddtree::kernels
