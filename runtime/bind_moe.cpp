// ddtree._native.moe: repack of compressed-tensors INT4 experts on the host (numpy in, numpy out) and on the
// device, the host unpack oracle, and MoeLayer, the device object that owns one layer's repacked experts and runs
// the fused MoE.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "cuda_check.h"
#include "moe_layer.h"
#include "moe_marlin.cuh"
#include "moe_repack.cuh"
#include "moe_repack.h"
#include "tensor_args.h"

namespace nb = nanobind;

namespace ddtree {
namespace {

template <typename T>
using NumpyArray = nb::ndarray<nb::numpy, T>;

// A projection [E, rows, cols] in checkpoint format, checked; returns its packed words and scale bits.
moe::PackedProjection projection(const HostArray& packed, const HostArray& scale, const char* packed_name,
                                 const char* scale_name, int64_t rows, int64_t cols, int64_t experts) {
    const auto [words, scales] = host_int4_projection(packed, scale, packed_name, scale_name,
                                                      {experts, rows, cols / 8}, {experts, rows, cols / 32});
    return {words, scales};
}

struct ExpertDims {
    int64_t experts;
    int hidden, inter;
};

// The expert count, hidden and inter of a checkpoint-format projection's packed words, host or device: gate/up
// [experts, inter, hidden / 8] (w13) or down [experts, hidden, inter / 8]; checked against what the MoE kernels take.
template <typename Array>
ExpertDims expert_dims(const Array& packed, bool w13) {
    if (packed.ndim() != 3) {
        throw nb::value_error(w13 ? "argument 'gate_packed' must be 3-D [experts, inter, hidden/8]"
                                  : "argument 'down_packed' must be 3-D [experts, hidden, inter/8]");
    }
    const int rows = static_cast<int>(packed.shape(1)), cols = static_cast<int>(packed.shape(2) * 8);
    const ExpertDims d{static_cast<int64_t>(packed.shape(0)), w13 ? cols : rows, w13 ? rows : cols};
    moe::check_moe_shape(d.hidden, d.inter);
    return d;
}

NumpyArray<uint8_t> repack_w13(HostArray gate_packed, HostArray gate_scale, HostArray up_packed, HostArray up_scale) {
    const auto [experts, hidden, inter] = expert_dims(gate_packed, true);
    const auto gate = projection(gate_packed, gate_scale, "gate_packed", "gate_scale", inter, hidden, experts);
    const auto up = projection(up_packed, up_scale, "up_packed", "up_scale", inter, hidden, experts);
    auto out = empty_numpy<uint8_t>({static_cast<size_t>(experts), moe::repacked_w13_bytes(hidden, inter)});
    {
        nb::gil_scoped_release release;
        moe::repack_w13(gate, up, static_cast<int>(experts), hidden, inter, out.data());
    }
    return out;
}

NumpyArray<uint8_t> repack_w2(HostArray down_packed, HostArray down_scale) {
    const auto [experts, hidden, inter] = expert_dims(down_packed, false);
    const auto down = projection(down_packed, down_scale, "down_packed", "down_scale", hidden, inter, experts);
    auto out = empty_numpy<uint8_t>({static_cast<size_t>(experts), moe::repacked_w2_bytes(hidden, inter)});
    {
        nb::gil_scoped_release release;
        moe::repack_w2(down, static_cast<int>(experts), hidden, inter, out.data());
    }
    return out;
}

std::pair<NumpyArray<uint8_t>, NumpyArray<uint16_t>> unpack(HostArray repacked, int hidden, int inter, bool w13) {
    moe::check_moe_shape(hidden, inter);
    const size_t per_expert = w13 ? moe::repacked_w13_bytes(hidden, inter) : moe::repacked_w2_bytes(hidden, inter);
    check_host(repacked, "repacked", repacked.dtype() == nb::dtype<uint8_t>(), "uint8",
               {-1, static_cast<int64_t>(per_expert)});
    const size_t experts = repacked.shape(0);
    const size_t rows = w13 ? 2 * inter : hidden, cols = w13 ? hidden : inter;
    auto q = empty_numpy<uint8_t>({experts, rows, cols});
    auto scale = empty_numpy<uint16_t>({experts, rows, cols / 32});
    {
        nb::gil_scoped_release release;
        const auto* src = static_cast<const uint8_t*>(repacked.data());
        if (w13) {
            moe::unpack_w13(src, static_cast<int>(experts), hidden, inter, q.data(), scale.data());
        } else {
            moe::unpack_w2(src, static_cast<int>(experts), hidden, inter, q.data(), scale.data());
        }
    }
    return {q, scale};
}

// A projection [E, rows, cols] in checkpoint format on the GPU (scales as bfloat16), checked.
moe::PackedProjection device_projection(const CudaArray& packed, const CudaArray& scale, const char* packed_name,
                                        const char* scale_name, int64_t experts, int64_t rows, int64_t cols) {
    return {checked<const int32_t>(packed, packed_name, DType::i32, {experts, rows, cols / 8}),
            checked<const uint16_t>(scale, scale_name, DType::bf16, {experts, rows, cols / 32})};
}

// The device repacks (the engine's checkpoint load does the same per expert) into `out` on the same GPU; block.
void repack_w13_on_device(CudaArray out, CudaArray gate_packed, CudaArray gate_scale, CudaArray up_packed,
                          CudaArray up_scale) {
    same_device({&out, &gate_packed, &gate_scale, &up_packed, &up_scale});
    const auto [experts, hidden, inter] = expert_dims(gate_packed, true);
    const auto gate = device_projection(gate_packed, gate_scale, "gate_packed", "gate_scale", experts, inter, hidden);
    const auto up = device_projection(up_packed, up_scale, "up_packed", "up_scale", experts, inter, hidden);
    auto* dst = checked<uint8_t>(out, "out", DType::u8,
                                 {experts, static_cast<int64_t>(moe::repacked_w13_bytes(hidden, inter))});
    CUDA_CHECK(kernels::moe::repack_w13_on_device(dst, gate, up, static_cast<int>(experts), hidden, inter, nullptr));
    CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

void repack_w2_on_device(CudaArray out, CudaArray down_packed, CudaArray down_scale) {
    same_device({&out, &down_packed, &down_scale});
    const auto [experts, hidden, inter] = expert_dims(down_packed, false);
    const auto down = device_projection(down_packed, down_scale, "down_packed", "down_scale", experts, hidden, inter);
    auto* dst = checked<uint8_t>(out, "out", DType::u8,
                                 {experts, static_cast<int64_t>(moe::repacked_w2_bytes(hidden, inter))});
    CUDA_CHECK(kernels::moe::repack_w2_on_device(dst, down, static_cast<int>(experts), hidden, inter, nullptr));
    CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

using AnyArray = nb::ndarray<nb::c_contig>;

void set_experts(MoeLayer& layer, int first, AnyArray w13, AnyArray w2) {
    const auto n = static_cast<int64_t>(w13.ndim() == 2 ? w13.shape(0) : -1);
    auto check = [&](const AnyArray& a, const char* name, size_t bytes) {
        if (a.dtype() != nb::dtype<uint8_t>() || a.ndim() != 2 || static_cast<int64_t>(a.shape(0)) != n ||
            a.shape(1) != bytes) {
            throw nb::value_error((std::string("argument '") + name + "' must be uint8 [experts, " +
                                   std::to_string(bytes) + "] with one row per expert of 'w13'")
                                      .c_str());
        }
        if (a.device_type() == nb::device::cuda::value && a.device_id() != layer.device()) {
            throw nb::value_error((std::string("argument '") + name + "' lives on another GPU than the layer").c_str());
        }
    };
    check(w13, "w13", layer.w13_bytes_per_expert());
    check(w2, "w2", layer.w2_bytes_per_expert());
    layer.set_experts(first, static_cast<int>(n), w13.data(), w2.data(), nullptr);
    CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

void forward(const MoeLayer& layer, CudaArray out, CudaArray hidden_states, CudaArray topk_ids,
             CudaArray topk_weights, std::optional<CudaArray> expert_mask, uintptr_t stream) {
    const MoeLayerShape& s = layer.shape();
    if (same_device({&out, &hidden_states, &topk_ids, &topk_weights}) != layer.device()) {
        throw nb::value_error("the arrays of forward must live on the layer's GPU");
    }
    if (hidden_states.ndim() != 2) throw nb::value_error("argument 'hidden_states' must be 2-D [tokens, hidden]");
    const int64_t m = hidden_states.shape(0);
    if (m > s.max_tokens) {
        throw nb::value_error(("argument 'hidden_states' has " + std::to_string(m) +
                               " tokens; the layer was created for max_tokens=" + std::to_string(s.max_tokens))
                                  .c_str());
    }
    auto* x = checked<const __nv_bfloat16>(hidden_states, "hidden_states", DType::bf16, {m, s.hidden});
    auto* ids = checked<const int32_t>(topk_ids, "topk_ids", DType::i32, {m, s.topk});
    auto* wts = checked<const float>(topk_weights, "topk_weights", DType::f32, {m, s.topk});
    auto* y = checked<__nv_bfloat16>(out, "out", DType::bf16, {m, s.hidden});
    const uint8_t* mask = nullptr;
    if (expert_mask) {
        if (expert_mask->device_id() != layer.device()) throw nb::value_error("argument 'expert_mask' lives on another GPU");
        mask = checked<const uint8_t>(*expert_mask, "expert_mask", DType::u8, {s.experts});
    }
    layer.forward(x, ids, wts, mask, y, static_cast<int>(m), reinterpret_cast<cudaStream_t>(stream));
}

void dequantize(const MoeLayer& layer, CudaArray out, bool w13) {
    const MoeLayerShape& s = layer.shape();
    if (same_device({&out}) != layer.device()) throw nb::value_error("argument 'out' lives on another GPU");
    const int64_t rows = w13 ? 2 * s.inter : s.hidden, cols = w13 ? s.hidden : s.inter;
    auto* dst = checked<__nv_bfloat16>(out, "out", DType::bf16, {s.experts, rows, cols});
    if (w13) {
        CUDA_CHECK(kernels::moe::dequantize_w13(dst, layer.w13(), s.experts, s.hidden, s.inter, nullptr));
    } else {
        CUDA_CHECK(kernels::moe::dequantize_w2(dst, layer.w2(), s.experts, s.hidden, s.inter, nullptr));
    }
    CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

}  // namespace

void bind_moe(nb::module_& m) {
    nb::module_ moe_m = m.def_submodule("moe", "INT4 grouped MoE: expert repack and the fused routed-expert layer");
    moe_m.def(
        "repacked_bytes",
        [](int hidden, int inter) {
            return std::make_pair(moe::repacked_w13_bytes(hidden, inter), moe::repacked_w2_bytes(hidden, inter));
        },
        nb::arg("hidden"), nb::arg("inter"), "Bytes per expert of the repacked (w13, w2).");
    moe_m.def("repack_w13", &repack_w13, nb::arg("gate_packed"), nb::arg("gate_scale"), nb::arg("up_packed"),
              nb::arg("up_scale"),
              "Checkpoint gate_proj/up_proj (weight_packed int32 [E, I, H/8], weight_scale bf16 bits [E, I, H/32]) "
              "-> repacked w13 uint8 [E, bytes].");
    moe_m.def("repack_w2", &repack_w2, nb::arg("down_packed"), nb::arg("down_scale"),
              "Checkpoint down_proj (int32 [E, H, I/8], bf16 bits [E, H, I/32]) -> repacked w2 uint8 [E, bytes].");
    moe_m.def("repack_w13_on_device", &repack_w13_on_device, nb::arg("out"), nb::arg("gate_packed"),
              nb::arg("gate_scale"), nb::arg("up_packed"), nb::arg("up_scale"),
              "repack_w13 on the GPU: device arrays (scales as bfloat16) -> out uint8 [E, bytes] on the same GPU; "
              "blocks.");
    moe_m.def("repack_w2_on_device", &repack_w2_on_device, nb::arg("out"), nb::arg("down_packed"),
              nb::arg("down_scale"),
              "repack_w2 on the GPU: device arrays (scales as bfloat16) -> out uint8 [E, bytes] on the same GPU; "
              "blocks.");
    moe_m.def(
        "unpack_w13", [](HostArray r, int hidden, int inter) { return unpack(r, hidden, inter, true); },
        nb::arg("repacked"), nb::arg("hidden"), nb::arg("inter"),
        "Oracle: repacked w13 -> (q uint8 [E, 2I, H], scale uint16 [E, 2I, H/32]), gate rows first; raises if "
        "the layout is not a bijection.");
    moe_m.def(
        "unpack_w2", [](HostArray r, int hidden, int inter) { return unpack(r, hidden, inter, false); },
        nb::arg("repacked"), nb::arg("hidden"), nb::arg("inter"),
        "Oracle: repacked w2 -> (q uint8 [E, H, I], scale uint16 [E, H, I/32]).");

    nb::class_<MoeLayer>(moe_m, "MoeLayer", "One layer's routed experts on one GPU and the fused MoE call.")
        .def(
            "__init__",
            [](MoeLayer* self, int experts, int hidden, int inter, int topk, int max_tokens, float rsf, int device) {
                new (self) MoeLayer(MoeLayerShape{experts, hidden, inter, topk, max_tokens, rsf}, device);
            },
            nb::arg("experts"), nb::arg("hidden"), nb::arg("inter"), nb::arg("topk"), nb::arg("max_tokens"),
            nb::arg("routed_scaling_factor"), nb::arg("device") = 0)
        .def_prop_ro("experts", [](const MoeLayer& l) { return l.shape().experts; })
        .def_prop_ro("hidden", [](const MoeLayer& l) { return l.shape().hidden; })
        .def_prop_ro("inter", [](const MoeLayer& l) { return l.shape().inter; })
        .def_prop_ro("topk", [](const MoeLayer& l) { return l.shape().topk; })
        .def_prop_ro("max_tokens", [](const MoeLayer& l) { return l.shape().max_tokens; })
        .def("set_experts", &set_experts, nb::arg("first"), nb::arg("w13"), nb::arg("w2"),
             "Copies repacked experts (uint8 [n, bytes], host or device) into slots first..first+n-1; blocks.")
        .def("forward", &forward, nb::arg("out"), nb::arg("hidden_states"), nb::arg("topk_ids"),
             nb::arg("topk_weights"), nb::arg("expert_mask") = nb::none(), nb::arg("stream") = 0,
             "Fused routed MoE on `stream` (a cudaStream_t as int; 0 = legacy default): out[M, H] bf16 from "
             "hidden_states bf16 [M, H], topk_ids int32 [M, k], topk_weights float32 [M, k], optional expert_mask "
             "uint8 [E] (0 = skip). Asynchronous and CUDA-graph capturable.")
        .def(
            "dequantize_w13", [](const MoeLayer& l, CudaArray out) { dequantize(l, out, true); }, nb::arg("out"),
            "Test oracle: the kernel's own dequantization of w13 into bf16 [E, 2I, H] (gate rows first).")
        .def(
            "dequantize_w2", [](const MoeLayer& l, CudaArray out) { dequantize(l, out, false); }, nb::arg("out"),
            "Test oracle: the kernel's own dequantization of w2 into bf16 [E, H, I].");
}

}  // namespace ddtree
