#include "graph_replay.h"

#include <algorithm>
#include <stdexcept>

#include "cuda_check.h"
#include "nvtx_range.h"
#include "op_timeline.h"

namespace ddtree {

size_t graph_node_count(cudaGraph_t graph) {
    size_t count = 0;
    CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
    return count;
}

SavedState::SavedState(std::vector<std::pair<void*, size_t>> arrays, cudaStream_t stream)
    : arrays_(std::move(arrays)), stream_(stream) {
    size_t bytes = 0;
    for (const auto& [data, size] : arrays_) bytes += size;
    if (bytes > 0) CUDA_CHECK(cudaMalloc(&saved_, bytes));  // none: a graph whose starting state does not matter
    size_t at = 0;
    for (const auto& [data, size] : arrays_) {
        const cudaError_t copied = cudaMemcpyAsync(saved_ + at, data, size, cudaMemcpyDeviceToDevice, stream_);
        if (copied != cudaSuccess) {
            cudaFree(saved_);
            CUDA_CHECK(copied);
        }
        at += size;
    }
}

SavedState::~SavedState() {
    cudaStreamSynchronize(stream_);  // no restore still reads the copy
    cudaFree(saved_);
}

void SavedState::restore() const {
    size_t at = 0;
    for (const auto& [data, size] : arrays_) {
        CUDA_CHECK(cudaMemcpyAsync(data, saved_ + at, size, cudaMemcpyDeviceToDevice, stream_));
        at += size;
    }
}

namespace {

// CUDA events that are destroyed with the vector's owner, also when a check throws.
struct Events {
    std::vector<cudaEvent_t> events;
    explicit Events(size_t n) {
        events.reserve(n);
        for (size_t i = 0; i < n; ++i) {
            cudaEvent_t e;
            CUDA_CHECK(cudaEventCreate(&e));
            events.push_back(e);
        }
    }
    ~Events() {
        for (cudaEvent_t e : events) cudaEventDestroy(e);
    }
};

}  // namespace

std::vector<double> time_replays(cudaGraphExec_t exec, cudaStream_t stream, int n, bool warmup,
                                 const SavedState& state) {
    if (n < 1 || n > kMaxReplays) {
        throw std::invalid_argument("n: replays must be 1.." + std::to_string(kMaxReplays) + ", got " +
                                    std::to_string(n));
    }
    if (warmup) {
        state.restore();
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
    }
    Events marks(2 * static_cast<size_t>(n));
    {
        NvtxRange range("replay");
        // The host enqueues every replay while the stream waits, so none waits on a launch.
        hold_stream_for_timing(stream);
        for (int i = 0; i < n; ++i) {
            state.restore();
            CUDA_CHECK(cudaEventRecord(marks.events[2 * i], stream));
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CUDA_CHECK(cudaEventRecord(marks.events[2 * i + 1], stream));
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<double> seconds(n);
    for (int i = 0; i < n; ++i) {
        float ms = 0.f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, marks.events[2 * i], marks.events[2 * i + 1]));
        seconds[i] = ms * 1e-3;
    }
    return seconds;
}

double median(std::vector<double> seconds) {
    std::sort(seconds.begin(), seconds.end());
    const size_t mid = seconds.size() / 2;
    return seconds.size() % 2 == 1 ? seconds[mid] : 0.5 * (seconds[mid - 1] + seconds[mid]);
}

}  // namespace ddtree
