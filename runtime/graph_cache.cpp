#include "graph_cache.h"

#include "cuda_check.h"

namespace ddtree {

cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& record, cudaGraph_t* graph) {
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    try {
        record();
    } catch (...) {
        cudaGraph_t broken = nullptr;
        cudaStreamEndCapture(stream, &broken);
        if (broken != nullptr) cudaGraphDestroy(broken);
        cudaGetLastError();  // a failed EndCapture leaves its error behind for the next launcher's check
        throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream, graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, *graph, 0);
    if (made != cudaSuccess) {
        cudaGraphDestroy(*graph);
        CUDA_CHECK(made);
    }
    return exec;
}

void destroy_graph(cudaGraphExec_t exec, cudaGraph_t graph) {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
}

}  // namespace ddtree
