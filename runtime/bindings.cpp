// The ddtree._native module: the only NB_MODULE. Areas register themselves through bindings.h.
#include "bindings.h"

#include <cuda_runtime.h>

#include "cuda_check.h"
#include "target_model.h"

namespace nb = nanobind;

cudaStream_t& ddtree::kernel_launch_stream() {
    static cudaStream_t stream = nullptr;
    return stream;
}

NB_MODULE(_native, m) {
    m.doc() = "ddtree native runtime: CUDA kernels and the decode engine";
    nb::exception<ddtree::CudaError>(m, "CudaError", PyExc_RuntimeError);
    nb::exception<ddtree::NonFiniteLogits>(m, "NonFiniteLogits", PyExc_ArithmeticError);

    m.def(
        "cuda_runtime_version",
        [] {
            int version = 0;
            CUDA_CHECK(cudaRuntimeGetVersion(&version));
            return version;
        },
        "Version of the statically linked CUDA runtime, e.g. 13000 for 13.0.");
    m.attr("gpu_archs") = nb::str(DDTREE_GPU_ARCHS);

    ddtree::bind_kernels(m);
    ddtree::bind_moe(m);
    ddtree::bind_engine(m);
    ddtree::bind_tree(m);
    ddtree::bind_drafter(m);
    ddtree::bind_rank_reduce(m);
    ddtree::bind_multi_gpu(m);
}
