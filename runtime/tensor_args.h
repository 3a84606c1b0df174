// Validation of device arrays handed in through DLPack (torch, cupy, ...), used by the kernel-level
// bindings. Every check names the argument at fault and raises ValueError in Python.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace ddtree {

namespace nb = nanobind;
using CudaArray = nb::ndarray<nb::device::cuda, nb::c_contig>;
using HostArray = nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>;  // read-only memory maps welcome

enum class DType { bf16, f32, i32, i64, u8 };

const char* dtype_name(DType dtype);

// Raises ValueError naming `name` unless `extents` (ndim of them) match `shape`; a negative extent in `shape`
// matches anything. For host and device arrays alike.
void check_shape(const char* name, size_t ndim, const int64_t* extents, std::initializer_list<int64_t> shape);

// Checks a host array's dtype (`dtype_ok`; `dtype` names the one expected) and shape (extents < 0 are free),
// naming `name` in the error.
void check_host(const HostArray& a, const char* name, bool dtype_ok, const char* dtype,
                std::initializer_list<int64_t> shape);

// A compressed-tensors INT4 projection in host memory, checked by name: packed int32 words of `packed_shape` and
// group scales of `scale_shape` as bf16 bits (uint16) or bfloat16. Returns (packed words, scale bits).
std::pair<const int32_t*, const uint16_t*> host_int4_projection(const HostArray& packed, const HostArray& scale,
                                                                const char* packed_name, const char* scale_name,
                                                                std::initializer_list<int64_t> packed_shape,
                                                                std::initializer_list<int64_t> scale_shape);

// Copies host array `a` into the weight registry `weights` (target or drafter) as tensor `name`, with the GIL
// released while the bytes travel.
template <typename Weights>
void upload_host(Weights& weights, const std::string& name, const HostArray& a) {
    const void* data = a.data();
    const size_t bytes = a.nbytes();
    nb::gil_scoped_release release;
    weights.upload(name, data, bytes);
}

// Field `key` of a config dict built by the Python side; ValueError naming `where` and the field when it is absent.
template <typename T>
T config_field(const nb::dict& d, const char* where, const char* key) {
    if (!d.contains(key)) {
        throw nb::value_error((std::string(where) + ": missing field '" + key + "'").c_str());
    }
    return nb::cast<T>(d[key]);
}

// Checks device, dtype, rank and (where an extent is >= 0) each extent; returns the data pointer.
void* checked_data(const CudaArray& array, const char* name, DType dtype, std::initializer_list<int64_t> shape);

template <typename T>
T* checked(const CudaArray& array, const char* name, DType dtype, std::initializer_list<int64_t> shape) {
    return static_cast<T*>(checked_data(array, name, dtype, shape));
}

// Extent i of argument `name`; too few dimensions is the caller's error (ValueError), not an out-of-range read.
int dim(const CudaArray& a, const char* name, size_t i);

// Checks that every given array lives on one device and makes it current; returns that device.
int same_device(std::initializer_list<const CudaArray*> arrays);

// A numpy array that owns `values` (moved, not copied), of the given shape.
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& values, std::initializer_list<size_t> shape) {
    auto* owned = new std::vector<T>(std::move(values));
    nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
    return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

// A numpy array of the given shape with its elements left unset, for a caller that writes every one (a vector
// would zero-fill gigabytes of repacked experts first).
template <typename T>
nb::ndarray<nb::numpy, T> empty_numpy(std::initializer_list<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    T* data = new T[n];
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
    return nb::ndarray<nb::numpy, T>(data, shape, owner);
}

}  // namespace ddtree
