#include "tensor_args.h"

#include <cuda_runtime.h>

#include <string>

#include "cuda_check.h"

namespace ddtree {
namespace {

bool dtype_matches(nb::dlpack::dtype got, DType want) {
    using code = nb::dlpack::dtype_code;
    switch (want) {
        case DType::bf16:
            return got == nb::dlpack::dtype{static_cast<uint8_t>(code::Bfloat), 16, 1};
        case DType::f32:
            return got == nb::dtype<float>();
        case DType::i32:
            return got == nb::dtype<int32_t>();
        case DType::i64:
            return got == nb::dtype<int64_t>();
        case DType::u8:
            return got == nb::dtype<uint8_t>();
    }
    return false;
}

// Messages are built with std::string and std::to_string only: on the GPU machine's image, formatting an
// integer through std::ostream inside this extension crashed (the num_put facet lookup landed in a
// codecvt facet; backtrace in bench/results/moe/NOTES.md).
std::string extents_string(size_t ndim, const int64_t* extents) {
    std::string s = "[";
    for (size_t i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(extents[i]);
    return s + "]";
}

std::string extents_string(std::initializer_list<int64_t> shape) {
    std::string s = "[";
    size_t i = 0;
    for (int64_t extent : shape) s += (i++ ? ", " : "") + (extent < 0 ? std::string("*") : std::to_string(extent));
    return s + "]";
}

}  // namespace

const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::bf16:
            return "bfloat16";
        case DType::f32:
            return "float32";
        case DType::i32:
            return "int32";
        case DType::i64:
            return "int64";
        case DType::u8:
            return "uint8";
    }
    return "?";
}

void check_host(const HostArray& a, const char* name, bool dtype_ok, const char* dtype,
                std::initializer_list<int64_t> shape) {
    if (!dtype_ok) throw nb::value_error((std::string("argument '") + name + "' must be " + dtype).c_str());
    check_shape(name, a.ndim(), a.shape_ptr(), shape);
}

std::pair<const int32_t*, const uint16_t*> host_int4_projection(const HostArray& packed, const HostArray& scale,
                                                                const char* packed_name, const char* scale_name,
                                                                std::initializer_list<int64_t> packed_shape,
                                                                std::initializer_list<int64_t> scale_shape) {
    const bool bf16_bits = scale.dtype() == nb::dtype<uint16_t>() || dtype_matches(scale.dtype(), DType::bf16);
    check_host(packed, packed_name, packed.dtype() == nb::dtype<int32_t>(), "int32", packed_shape);
    check_host(scale, scale_name, bf16_bits, "uint16 (bf16 bits) or bfloat16", scale_shape);
    return {static_cast<const int32_t*>(packed.data()), static_cast<const uint16_t*>(scale.data())};
}

void check_shape(const char* name, size_t ndim, const int64_t* extents, std::initializer_list<int64_t> shape) {
    bool ok = ndim == shape.size();
    size_t i = 0;
    for (int64_t extent : shape) {
        ok = ok && (extent < 0 || extents[i] == extent);
        ++i;
    }
    if (!ok) {
        throw nb::value_error((std::string("argument '") + name + "' has shape " + extents_string(ndim, extents) +
                               ", expected " + extents_string(shape))
                                  .c_str());
    }
}

void* checked_data(const CudaArray& array, const char* name, DType dtype, std::initializer_list<int64_t> shape) {
    if (!dtype_matches(array.dtype(), dtype)) {
        throw nb::value_error((std::string("argument '") + name + "' must be " + dtype_name(dtype)).c_str());
    }
    check_shape(name, array.ndim(), array.shape_ptr(), shape);
    return array.data();
}

int same_device(std::initializer_list<const CudaArray*> arrays) {
    int device = -1;
    for (const CudaArray* a : arrays) {
        if (device < 0) {
            device = a->device_id();
        } else if (a->device_id() != device) {
            throw nb::value_error("all device arrays of one call must live on the same GPU");
        }
    }
    CUDA_CHECK(cudaSetDevice(device));
    return device;
}

int dim(const CudaArray& a, const char* name, size_t i) {
    if (i >= a.ndim()) {
        throw nb::value_error(("argument '" + std::string(name) + "' has " + std::to_string(a.ndim()) +
                               " dimensions, too few")
                                  .c_str());
    }
    return static_cast<int>(a.shape(i));
}

}  // namespace ddtree
