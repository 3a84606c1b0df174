#include "collective_timing.h"

#include <algorithm>
#include <vector>

#include "cuda_check.h"
#include "graph_cache.h"

namespace ddtree {

double time_forward_collectives(Collectives& collectives, const ModelDims& dims, int rows, kernels::bf16* out,
                                int32_t* tokens, cudaStream_t stream, int iters) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = capture_graph(
        stream,
        [&] {
            for (int layer = 0; layer < dims.layers; ++layer) {
                collectives.sum_partials(1, rows, dims.hidden, out, stream);
                collectives.sum_partials(dims.is_moe(layer) ? 2 : 1, rows, dims.hidden, out, stream);
            }
            collectives.pick(rows, tokens, stream);
        },
        &graph);
    cudaEvent_t begin = nullptr, end = nullptr;
    std::vector<double> seconds;
    try {
        CUDA_CHECK(cudaEventCreate(&begin));
        CUDA_CHECK(cudaEventCreate(&end));
        CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
        for (int i = 0; i < iters; ++i) {
            CUDA_CHECK(cudaEventRecord(begin, stream));
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CUDA_CHECK(cudaEventRecord(end, stream));
            CUDA_CHECK(cudaEventSynchronize(end));
            float ms = 0.f;
            CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
            seconds.push_back(ms * 1e-3);
        }
    } catch (...) {
        if (begin != nullptr) cudaEventDestroy(begin);
        if (end != nullptr) cudaEventDestroy(end);
        destroy_graph(exec, graph);
        throw;
    }
    cudaEventDestroy(begin);
    cudaEventDestroy(end);
    destroy_graph(exec, graph);
    std::sort(seconds.begin(), seconds.end());
    const size_t mid = seconds.size() / 2;
    return seconds.size() % 2 == 1 ? seconds[mid] : 0.5 * (seconds[mid - 1] + seconds[mid]);
}

}  // namespace ddtree
