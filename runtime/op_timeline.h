// The profiling hook of a forward: device time per named operation, from events recorded around each launch, each
// also an NVTX range (Nsight Systems). The model calls op() for every launch; without a timeline it launches
// directly (captured graphs, timed replays).
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "nvtx_range.h"

namespace ddtree {

// Seconds of device time per named operation, summed over layers.
using StepProfile = std::vector<std::pair<std::string, double>>;

class OpTimeline {
  public:
    explicit OpTimeline(cudaStream_t stream) : stream_(stream) {}
    ~OpTimeline();
    OpTimeline(const OpTimeline&) = delete;
    OpTimeline& operator=(const OpTimeline&) = delete;

    template <typename F>
    void op(const char* name, F&& launch) {
        cudaEvent_t start, stop;
        CUDA_CHECK(cudaEventCreate(&start));
        CUDA_CHECK(cudaEventCreate(&stop));
        events_.emplace_back(name, start, stop);
        NvtxRange range(name);
        CUDA_CHECK(cudaEventRecord(start, stream_));
        launch();
        CUDA_CHECK(cudaEventRecord(stop, stream_));
    }
    // Adds each op's elapsed time (the stream must have finished) to `seconds`.
    void accumulate(std::map<std::string, double>& seconds) const;

  private:
    cudaStream_t stream_;
    std::vector<std::tuple<std::string, cudaEvent_t, cudaEvent_t>> events_;
};

// Device time between points of a stream's work: CUDA events recorded at construction (point 0) and at each mark().
class PhaseClock {
  public:
    explicit PhaseClock(cudaStream_t stream) : stream_(stream) { mark(); }
    ~PhaseClock();
    PhaseClock(const PhaseClock&) = delete;
    PhaseClock& operator=(const PhaseClock&) = delete;
    void mark();
    // Seconds from point `from` to point `to` (both recorded; waits for the later one).
    double seconds(int from, int to) const;

  private:
    cudaStream_t stream_;
    std::vector<cudaEvent_t> points_;
};

// Holds `stream` for a while on the host, so everything enqueued behind it runs back to back on the device: the
// per-operation times then measure the device, not the host's launch rate.
void hold_stream_for_timing(cudaStream_t stream);

// Runs `launch`, timed as `name` when a timeline is given.
template <typename F>
void timed_op(OpTimeline* timeline, const char* name, F&& launch) {
    if (timeline != nullptr) {
        timeline->op(name, launch);
    } else {
        launch();
    }
}

}  // namespace ddtree
