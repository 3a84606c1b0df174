// Work forked from a stream onto a side stream inside a capture (or eagerly) and joined back, and an owned side
// stream to fork onto.
#pragma once
#include <cuda_runtime.h>

#include "cuda_check.h"

namespace ddtree {

// A side stream forked from the main stream at construction (it waits for the main stream's work so far) and
// joined back by join(), or, when an exception leaves the scope first, by the destructor (unchecked: it must not
// throw), so that neither a capture ends with the side stream unjoined nor a later forward overwrites buffers the
// side stream still writes. One event serves both: a wait binds to the record made just before it. With
// fork = false nothing is forked and join() does nothing.
class ForkedStream {
  public:
    ForkedStream(bool fork, cudaStream_t main, cudaStream_t side, cudaEvent_t event)
        : main_(main), side_(side), event_(event) {
        if (!fork) return;
        CUDA_CHECK(cudaEventRecord(event_, main_));
        CUDA_CHECK(cudaStreamWaitEvent(side_, event_));
        forked_ = true;
    }
    ForkedStream(const ForkedStream&) = delete;
    ForkedStream& operator=(const ForkedStream&) = delete;
    ~ForkedStream() { rejoin(); }  // unchecked: an exception may already be leaving
    void join() { CUDA_CHECK(rejoin()); }

  private:
    cudaError_t rejoin() {
        if (!forked_) return cudaSuccess;
        forked_ = false;
        const cudaError_t recorded = cudaEventRecord(event_, side_);
        return recorded != cudaSuccess ? recorded : cudaStreamWaitEvent(main_, event_);
    }

    cudaStream_t main_, side_;
    cudaEvent_t event_;
    bool forked_ = false;
};

// A non-blocking stream and the event that forks work onto it and joins it back (ForkedStream), owned.
class SideStream {
  public:
    SideStream() {
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        if (const cudaError_t e = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming); e != cudaSuccess) {
            cudaStreamDestroy(stream_);
            CUDA_CHECK(e);
        }
    }
    ~SideStream() {
        cudaEventDestroy(event_);
        cudaStreamDestroy(stream_);
    }
    SideStream(const SideStream&) = delete;
    SideStream& operator=(const SideStream&) = delete;
    cudaStream_t stream() const { return stream_; }
    cudaEvent_t event() const { return event_; }

  private:
    cudaStream_t stream_ = nullptr;
    cudaEvent_t event_ = nullptr;
};

}  // namespace ddtree
