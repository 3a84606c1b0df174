// NVTX ranges for Nsight Systems (and Nsight Compute's --nvtx-include): host-side push/pop around what the host
// enqueues, projected onto the device by the profiler. NVTX3 is header-only; with no tool attached each call is a
// no-op through a stub, so the ranges stay in release builds.
#pragma once
#include <nvtx3/nvToolsExt.h>

#include <string>

namespace ddtree {

class NvtxRange {
  public:
    explicit NvtxRange(const char* message) { nvtxRangePushA(message); }
    explicit NvtxRange(const std::string& message) : NvtxRange(message.c_str()) {}
    ~NvtxRange() { nvtxRangePop(); }
    NvtxRange(const NvtxRange&) = delete;
    NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace ddtree
