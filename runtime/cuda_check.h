// The one CUDA error style of the runtime: CUDA_CHECK throws ddtree::CudaError naming the call,
// file, line and device; nanobind turns it into a Python RuntimeError.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace ddtree {

class CudaError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
    int device = -1;
    (void)cudaGetDevice(&device);
    (void)cudaGetLastError();  // clear a sticky launch error so later calls report their own
    throw CudaError(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                    ") in " + call + " at " + file + ":" + std::to_string(line) + " on device " +
                    std::to_string(device));
}

}  // namespace ddtree

#define CUDA_CHECK(call)                                                          \
    do {                                                                          \
        cudaError_t cuda_check_err_ = (call);                                     \
        if (cuda_check_err_ != cudaSuccess) {                                     \
            ::ddtree::throw_cuda_error(cuda_check_err_, #call, __FILE__, __LINE__); \
        }                                                                         \
    } while (0)

namespace ddtree {

// std::invalid_argument naming `device` (as `name`) when it is not a CUDA device of this machine.
inline void check_device(int device, const char* name = "device") {
    int count = 0;
    CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count) {
        throw std::invalid_argument(name + (" " + std::to_string(device)) + " does not exist (" + std::to_string(count) +
                                    " CUDA devices)");
    }
}

}  // namespace ddtree
