// Kernel-level entry points for tests and benchmarks: each takes CUDA arrays (DLPack), checks them,
// launches on kernel_launch_stream() and raises on any CUDA error. The engine calls the launchers directly.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "cuda_check.h"
#include "rmsnorm.cuh"
#include "tensor_args.h"

namespace nb = nanobind;
namespace k = ddtree::kernels;

namespace ddtree {
namespace {

// [rows, dim] of a 2-D array whose rows the norm kernels take.
std::pair<int64_t, int64_t> norm_rows(const CudaArray& a, const char* name) {
    if (a.ndim() != 2) {
        throw nb::value_error((std::string("argument '") + name + "' must be 2-D [rows, dim]").c_str());
    }
    const int64_t dim = a.shape(1);
    if (!k::norm_dim_supported(dim)) {
        throw nb::value_error((std::string("argument '") + name + "' has rows of " + std::to_string(dim) +
                               " elements; the norm kernels take 1.." + std::to_string(k::kNormMaxDim))
                                  .c_str());
    }
    return {a.shape(0), dim};
}

void rmsnorm(CudaArray out, CudaArray x, CudaArray weight, float eps) {
    same_device({&out, &x, &weight});
    const auto [rows, dim] = norm_rows(x, "x");
    auto* x_p = checked<const k::bf16>(x, "x", DType::bf16, {rows, dim});
    auto* w_p = checked<const k::bf16>(weight, "weight", DType::bf16, {dim});
    auto* out_p = checked<k::bf16>(out, "out", DType::bf16, {rows, dim});
    CUDA_CHECK(k::rmsnorm(out_p, x_p, w_p, static_cast<int>(rows), static_cast<int>(dim), eps,
                          kernel_launch_stream()));
}

// residual += delta (+ delta2, when given) in fp32, rounded once; out = rmsnorm(residual) * weight.
void add_rmsnorm(CudaArray out, CudaArray residual, CudaArray delta, CudaArray weight, float eps,
                 std::optional<CudaArray> delta2) {
    same_device({&out, &residual, &delta, delta2 ? &*delta2 : &delta, &weight});
    const auto [rows, dim] = norm_rows(residual, "residual");
    auto* res_p = checked<k::bf16>(residual, "residual", DType::bf16, {rows, dim});
    auto* delta_p = checked<const k::bf16>(delta, "delta", DType::bf16, {rows, dim});
    auto* delta2_p = delta2 ? checked<const k::bf16>(*delta2, "delta2", DType::bf16, {rows, dim}) : nullptr;
    auto* w_p = checked<const k::bf16>(weight, "weight", DType::bf16, {dim});
    auto* out_p = checked<k::bf16>(out, "out", DType::bf16, {rows, dim});
    CUDA_CHECK(k::add_rmsnorm(out_p, res_p, delta_p, delta2_p, w_p, static_cast<int>(rows), static_cast<int>(dim),
                               eps, kernel_launch_stream()));
}

}  // namespace

void bind_kernels(nb::module_& m) {
    nb::module_ kernels = m.def_submodule("kernels", "Single-kernel entry points for tests and benchmarks");
    kernels.def("rmsnorm", &rmsnorm, nb::arg("out"), nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
                "out = rmsnorm(x) * weight over the last dim (bf16, fp32 math).");
    kernels.def("add_rmsnorm", &add_rmsnorm, nb::arg("out"), nb::arg("residual"), nb::arg("delta"),
                nb::arg("weight"), nb::arg("eps"), nb::arg("delta2") = nb::none(),
                "residual += delta (+ delta2) in fp32, rounded to bf16; out = rmsnorm(residual) * weight.");
}

}  // namespace ddtree
