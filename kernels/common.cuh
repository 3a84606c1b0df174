// Shared helpers for every kernel family: bf16 type, error propagation for launchers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace ddtree::kernels {

using bf16 = __nv_bfloat16;

}  // namespace ddtree::kernels

// Launchers return cudaError_t; this propagates a failed CUDA call to the launcher's caller.
#define DDTREE_RETURN_IF_ERROR(call)                \
    do {                                            \
        cudaError_t ddtree_err_ = (call);           \
        if (ddtree_err_ != cudaSuccess) {           \
            return ddtree_err_;                     \
        }                                           \
    } while (0)
