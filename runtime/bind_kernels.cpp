// Kernel-level entry points for tests and benchmarks: each takes CUDA arrays (DLPack), checks them,
// launches on the default stream and raises on any CUDA error. The engine calls the launchers directly.
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "cuda_check.h"
#include "rmsnorm.cuh"
#include "tensor_args.h"

namespace nb = nanobind;
namespace k = ddtree::kernels;

namespace ddtree {
namespace {

void rmsnorm(CudaArray out, CudaArray x, CudaArray weight, float eps) {
    same_device({&out, &x, &weight});
    if (x.ndim() != 2) {
        throw nb::value_error("argument 'x' must be 2-D [rows, dim]");
    }
    const int64_t rows = x.shape(0), dim = x.shape(1);
    auto* x_p = checked<const k::bf16>(x, "x", DType::bf16, {rows, dim});
    auto* w_p = checked<const k::bf16>(weight, "weight", DType::bf16, {dim});
    auto* out_p = checked<k::bf16>(out, "out", DType::bf16, {rows, dim});
    CUDA_CHECK(k::rmsnorm(out_p, x_p, w_p, static_cast<int>(rows), static_cast<int>(dim), eps, nullptr));
}

void add_rmsnorm(CudaArray out, CudaArray residual, CudaArray delta, CudaArray weight, float eps) {
    same_device({&out, &residual, &delta, &weight});
    if (residual.ndim() != 2) {
        throw nb::value_error("argument 'residual' must be 2-D [rows, dim]");
    }
    const int64_t rows = residual.shape(0), dim = residual.shape(1);
    auto* res_p = checked<k::bf16>(residual, "residual", DType::bf16, {rows, dim});
    auto* delta_p = checked<const k::bf16>(delta, "delta", DType::bf16, {rows, dim});
    auto* w_p = checked<const k::bf16>(weight, "weight", DType::bf16, {dim});
    auto* out_p = checked<k::bf16>(out, "out", DType::bf16, {rows, dim});
    CUDA_CHECK(k::add_rmsnorm(out_p, res_p, delta_p, w_p, static_cast<int>(rows), static_cast<int>(dim), eps,
                              nullptr));
}

}  // namespace

void bind_kernels(nb::module_& m) {
    nb::module_ kernels = m.def_submodule("kernels", "Single-kernel entry points for tests and benchmarks");
    kernels.def("rmsnorm", &rmsnorm, nb::arg("out"), nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
                "out = rmsnorm(x) * weight over the last dim (bf16, fp32 math).");
    kernels.def("add_rmsnorm", &add_rmsnorm, nb::arg("out"), nb::arg("residual"), nb::arg("delta"),
                nb::arg("weight"), nb::arg("eps"), "residual += delta (bf16); out = rmsnorm(residual) * weight.");
}

}  // namespace ddtree
