// Python surface of the GPU drafter (ddtree._native.Drafter): built beside an Engine whose embedding and LM head it
// borrows (the Engine is kept alive as long as the drafter), weight upload from host numpy views, and the eager
// append / draft / cache read-back / profiling entry points of EagerDrafter.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>

#include "bindings.h"
#include "cuda_check.h"
#include "eager_drafter.h"
#include "engine.h"
#include "tensor_args.h"

namespace nb = nanobind;

namespace ddtree {
namespace {

template <typename T>
T field(const nb::dict& d, const char* key) {
    return config_field<T>(d, "drafter config", key);
}

std::vector<std::pair<std::string, double>> profile(EagerDrafter& e, const std::vector<int32_t>& streams,
                                                    const std::vector<int32_t>& bonus, int iters, int k) {
    nb::gil_scoped_release release;
    return e.profile_round(streams, bonus, iters, k);
}

}  // namespace

DrafterDims parse_drafter_dims(const nb::dict& d) {
    DrafterDims m;
    m.hidden = field<int>(d, "hidden");
    m.inter = field<int>(d, "inter");
    m.layers = field<int>(d, "layers");
    m.heads = field<int>(d, "heads");
    m.kv_heads = field<int>(d, "kv_heads");
    m.head_dim = field<int>(d, "head_dim");
    m.vocab = field<int>(d, "vocab");
    m.block = field<int>(d, "block");
    m.taps = field<int>(d, "taps");
    m.mask_token = field<int>(d, "mask_token");
    m.rms_eps = field<float>(d, "rms_eps");
    return m;
}

void bind_drafter(nb::module_& m) {
    nb::class_<EagerDrafter>(m, "Drafter", "The DFlash drafter on the GPU of an Engine (see ddtree.drafter_engine)")
        .def(
            "__init__",
            [](EagerDrafter* self, Engine& engine, const nb::dict& dims, const std::vector<float>& inv_freq,
               float attention_factor, int streams, int max_context, int window, int max_append) {
                const DrafterDims d = parse_drafter_dims(dims);
                if (engine.dims().sharded()) {
                    throw nb::value_error("argument 'engine' is split over ranks and holds a slice of its lm_head: "
                                          "an eager drafter borrows the whole table");
                }
                if (d.hidden != engine.dims().hidden || d.vocab != engine.dims().vocab) {
                    throw nb::value_error(("drafter hidden/vocab " + std::to_string(d.hidden) + "/" +
                                           std::to_string(d.vocab) + " differ from the engine's " +
                                           std::to_string(engine.dims().hidden) + "/" +
                                           std::to_string(engine.dims().vocab))
                                              .c_str());
                }
                new (self) EagerDrafter(d, RopeTable{inv_freq, attention_factor, false}, engine.weights().embed,
                                        engine.weights().lm_head, streams, max_context, window, max_append,
                                        engine.device());
            },
            nb::keep_alive<1, 2>(), nb::arg("engine"), nb::arg("dims"), nb::arg("inv_freq"),
            nb::arg("attention_factor"), nb::arg("streams"), nb::arg("max_context"), nb::arg("window"),
            nb::arg("max_append"))
        .def_prop_ro("streams", &EagerDrafter::streams)
        .def_prop_ro("max_context", &EagerDrafter::max_context)
        .def(
            "upload",
            [](EagerDrafter& e, const std::string& name, HostArray a) { upload_host(e.weights(), name, a); },
            nb::arg("name"), nb::arg("array"), "Copy one drafter tensor (its checkpoint name) to the device.")
        .def("randomize_weights", [](EagerDrafter& e, uint64_t seed) { e.weights().randomize(seed); },
             nb::arg("seed"), nb::call_guard<nb::gil_scoped_release>())
        .def("missing", [](EagerDrafter& e) { return e.weights().missing(); })
        .def("committed", &EagerDrafter::committed, nb::arg("stream"))
        .def(
            "append",
            [](EagerDrafter& e, const std::vector<int32_t>& streams, const std::vector<int32_t>& counts,
               HostArray features) {
                const int64_t width = e.dims().context_width();
                check_host(features, "features", features.dtype() == nb::dtype<uint16_t>(), "uint16 (bf16 bits)",
                           {-1, width});
                const auto* data = static_cast<const uint16_t*>(features.data());
                const size_t rows = features.shape(0);
                nb::gil_scoped_release release;
                e.append(streams, counts, data, rows);
            },
            nb::arg("streams"), nb::arg("counts"), nb::arg("features"),
            "Append counts[i] context rows (bf16 bits [rows, taps * hidden], the streams' rows in order) to each "
            "listed stream at its next positions.")
        .def(
            "draft",
            [](EagerDrafter& e, const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus) {
                std::vector<float> logits;
                {
                    nb::gil_scoped_release release;
                    logits = e.draft(streams, bonus);
                }
                const DrafterDims& d = e.dims();
                return to_numpy(std::move(logits), {streams.size(), static_cast<size_t>(d.block - 1),
                                                    static_cast<size_t>(d.vocab)});
            },
            nb::arg("streams"), nb::arg("bonus"),
            "Block forward of each listed stream at its committed length: fp32 logits [streams, block - 1, vocab].")
        .def(
            "draft_top_k",
            [](EagerDrafter& e, const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus, int k) {
                std::pair<std::vector<float>, std::vector<int32_t>> top;
                {
                    nb::gil_scoped_release release;
                    top = e.draft_top_k(streams, bonus, k);
                }
                const size_t rows = e.dims().block - 1;
                return nb::make_tuple(to_numpy(std::move(top.first), {streams.size(), rows, static_cast<size_t>(k)}),
                                      to_numpy(std::move(top.second), {streams.size(), rows, static_cast<size_t>(k)}));
            },
            nb::arg("streams"), nb::arg("bonus"), nb::arg("k"),
            "Block forward of each listed stream and its per-depth log-softmax top-k on the device: fp32 log-probs "
            "and int32 ids [streams, block - 1, k].")
        .def(
            "cache_rows",
            [](const EagerDrafter& e, int stream, int layer) {
                auto [k, v] = e.cache_rows(stream, layer);
                const DrafterDims& d = e.dims();
                const size_t rows = k.size() / d.kv_dim(), heads = d.kv_heads, hd = d.head_dim;
                return nb::make_tuple(to_numpy(std::move(k), {rows, heads, hd}), to_numpy(std::move(v), {rows, heads, hd}));
            },
            nb::arg("stream"), nb::arg("layer"),
            "The cached K and V rows of a stream's layer, oldest first: bf16 bits [rows, kv_heads, head_dim].")
        .def("randomize_cache", &EagerDrafter::randomize_cache, nb::arg("seed"),
             nb::call_guard<nb::gil_scoped_release>())
        .def("set_committed", &EagerDrafter::set_committed, nb::arg("streams"), nb::arg("lengths"))
        .def("profile_round", &profile, nb::arg("streams"), nb::arg("bonus"), nb::arg("iters"), nb::arg("k") = 0,
             "Device seconds per operation of the last append launch + the block forward + its top-k (k 0: none) "
             "(eager, one launch at a time).")
        .def("time_round", &EagerDrafter::time_round, nb::arg("streams"), nb::arg("bonus"), nb::arg("iters"),
             nb::arg("k") = 0, nb::call_guard<nb::gil_scoped_release>(),
             "Device seconds of the last append launch + the block forward + its top-k, back to back.")
        .def_static(
            "planned_bytes",
            [](const nb::dict& dims, int streams, int capacity, int max_append) {
                return DrafterModel::planned_bytes(parse_drafter_dims(dims), streams, capacity, max_append);
            },
            nb::arg("dims"), nb::arg("streams"), nb::arg("capacity"), nb::arg("max_append"),
            "Device bytes of a drafter's weights, cache and scratch (the engine's memory pre-flight).");

    m.def(
        "engine_table",
        [](Engine& engine, const std::string& name) {
            const ModelDims& d = engine.dims();
            const kernels::bf16* table = name == "embed" ? engine.weights().embed
                                         : name == "lm_head" ? engine.weights().lm_head
                                                             : nullptr;
            if (table == nullptr) throw nb::value_error("argument 'name' must be 'embed' or 'lm_head'");
            if (table == engine.weights().lm_head && d.sharded()) {
                throw nb::value_error("argument 'name': a split engine holds a vocabulary slice of lm_head");
            }
            auto out = empty_numpy<uint16_t>({static_cast<size_t>(d.vocab), static_cast<size_t>(d.hidden)});
            {
                nb::gil_scoped_release release;
                CUDA_CHECK(cudaSetDevice(engine.device()));
                CUDA_CHECK(cudaMemcpy(out.data(), table, out.nbytes(), cudaMemcpyDeviceToHost));
            }
            return out;
        },
        nb::arg("engine"), nb::arg("name"),
        "A copy of an engine's embedding or LM head table, bf16 bits [vocab, hidden] (tests of what borrows it).");
}

}  // namespace ddtree
