// DDTree commit: one grid of (layers + tap-row slices) x streams CTAs. A layer CTA stages the moved latent rows of
// one (layer, stream) in shared memory before writing any (source and destination rows overlap whenever a node was
// skipped); a tap CTA copies a 16 KiB slice of one accepted node's tapped hidden row into the drafter context. A
// one-CTA launch behind it advances the committed lengths, after every layer CTA has read them. Both are launched
// as programmatic dependents, so each launch overlaps the kernel before it.
#include <atomic>

#include "gemm_mma.cuh"  // opt_in_smem
#include "tree_commit.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTapChunksPerCta = 4 * kThreads;  // a tap row (K2: 5376 chunks) is split over CTAs of 16 KiB each

constexpr int tap_splits(int width) { return (width / kCommitChunkElems + kTapChunksPerCta - 1) / kTapChunksPerCta; }

__global__ void __launch_bounds__(kThreads)
    tree_commit_kernel(LatentCache cache, TapGather taps, const int32_t* stream_base, const int32_t* start,
                       const int32_t* accepted, const int32_t* accept_len, TreeShape shape) {
    extern __shared__ uint4 staged[];
    __shared__ int path[kTreeMaxDepth + 1];
    const int s = static_cast<int>(blockIdx.y), tid = static_cast<int>(threadIdx.x);
    const int max_len = shape.depth_limit + 1;
    dependent_kernel_start();  // the path comes from the accept walk
    const int len = min(max(accept_len[s], 1), max_len);
    if (tid < len) path[tid] = accepted[static_cast<size_t>(s) * max_len + tid];
    __syncthreads();

    if (static_cast<int>(blockIdx.x) >= cache.layers) {  // a slice of a tap row
        const int splits = tap_splits(taps.width);
        const int j = (static_cast<int>(blockIdx.x) - cache.layers) / splits;
        const int part = (static_cast<int>(blockIdx.x) - cache.layers) % splits;
        if (j >= len || path[j] < 0 || path[j] > shape.budget) return;
        const int chunks = taps.width / kCommitChunkElems;
        const uint4* src = reinterpret_cast<const uint4*>(
            taps.taps + (static_cast<size_t>(s) * tree_rows(shape.budget) + path[j]) * taps.width);
        uint4* dst = reinterpret_cast<uint4*>(taps.context + (static_cast<size_t>(s) * max_len + j) * taps.width);
        const int end = min(chunks, (part + 1) * kTapChunksPerCta);
        for (int c = part * kTapChunksPerCta + tid; c < end; c += kThreads) dst[c] = src[c];
        return;
    }

    int first_moved = 0;
    while (first_moved < len && path[first_moved] == first_moved) ++first_moved;
    if (first_moved == len) return;
    const int base = stream_base[s] + start[s];
    const int chunks = cache.row_elems / kCommitChunkElems;
    const int total = (len - first_moved) * chunks;
    uint4* layer = reinterpret_cast<uint4*>(cache.rows) +
                   static_cast<size_t>(blockIdx.x) * cache.cache_rows * chunks;
    auto in_cache = [&](int row) { return row >= 0 && row < cache.cache_rows; };
    for (int t = tid; t < total; t += kThreads) {
        const int row = base + path[first_moved + t / chunks];
        if (in_cache(row)) staged[t] = layer[static_cast<size_t>(row) * chunks + t % chunks];
    }
    __syncthreads();
    for (int t = tid; t < total; t += kThreads) {
        const int j = first_moved + t / chunks;
        if (in_cache(base + path[j]) && in_cache(base + j)) {
            layer[static_cast<size_t>(base + j) * chunks + t % chunks] = staged[t];
        }
    }
}

__global__ void advance_start_kernel(int32_t* start, const int32_t* accept_len, int streams) {
    grid_dependency_wait();  // every commit CTA has read start
    for (int s = static_cast<int>(threadIdx.x); s < streams; s += static_cast<int>(blockDim.x)) {
        start[s] += accept_len[s];
    }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t tree_commit(const LatentCache& cache, const TapGather& taps, const int32_t* stream_base, int32_t* start,
                        const int32_t* accepted, const int32_t* accept_len, const TreeShape& shape,
                        cudaStream_t stream) {
    const bool cache_ok = cache.layers >= 0 && cache.cache_rows >= 0 &&
                          commit_rows_supported(cache.row_elems, shape.depth_limit) && aligned16(cache.rows);
    const bool taps_ok = taps.taps == nullptr ||
                         (taps.width > 0 && taps.width % kCommitChunkElems == 0 && aligned16(taps.taps) &&
                          aligned16(taps.context));
    if (!tree_shape_valid(shape) || !cache_ok || !taps_ok) return cudaErrorInvalidValue;
    if (shape.streams == 0) return cudaSuccess;
    const int tap_ctas = taps.taps != nullptr ? (shape.depth_limit + 1) * tap_splits(taps.width) : 0;
    const size_t staged = static_cast<size_t>(shape.depth_limit + 1) * cache.row_elems * sizeof(bf16);
    if (cache.layers + tap_ctas > 0) {
        static std::atomic<uint64_t> opted_in{0};  // the staged rows plus the static path can pass 48 KiB
        DDTREE_RETURN_IF_ERROR(opt_in_smem(tree_commit_kernel, kCommitMaxStagedBytes, opted_in));
        const dim3 grid(static_cast<unsigned>(cache.layers + tap_ctas), static_cast<unsigned>(shape.streams));
        DDTREE_RETURN_IF_ERROR(launch_dependent(tree_commit_kernel, grid, dim3(kThreads), staged, stream, cache, taps,
                                                stream_base, static_cast<const int32_t*>(start), accepted,
                                                accept_len, shape));
    }
    return launch_dependent(advance_start_kernel, dim3(1), dim3(kThreads), 0, stream, start, accept_len,
                            shape.streams);
}

}  // namespace ddtree::kernels
