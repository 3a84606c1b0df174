#include "op_timeline.h"

#include <chrono>
#include <thread>

namespace ddtree {

namespace {

void CUDART_CB hold_host(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }

}  // namespace

void hold_stream_for_timing(cudaStream_t stream) { CUDA_CHECK(cudaLaunchHostFunc(stream, hold_host, nullptr)); }

OpTimeline::~OpTimeline() {
    for (auto& [name, start, stop] : events_) {
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
    }
}

PhaseClock::~PhaseClock() {
    for (cudaEvent_t e : points_) cudaEventDestroy(e);
}

void PhaseClock::mark() {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    points_.push_back(e);
    CUDA_CHECK(cudaEventRecord(e, stream_));
}

double PhaseClock::seconds(int from, int to) const {
    CUDA_CHECK(cudaEventSynchronize(points_.at(to)));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, points_.at(from), points_.at(to)));
    return ms * 1e-3;
}

void OpTimeline::accumulate(std::map<std::string, double>& seconds) const {
    for (const auto& [name, start, stop] : events_) {
        float ms = 0.f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        seconds[name] += ms * 1e-3;
    }
}

}  // namespace ddtree
