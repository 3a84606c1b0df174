// Python surface of the multi-GPU engine (ddtree._native.MultiGpuEngine, behind ddtree.Engine(devices=...)) and of
// the NCCL exchange check and timing (ddtree._native.kernels.nccl_exchange_check, nccl_exchange_seconds).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bind_engine_surface.h"
#include "bindings.h"
#include "multi_gpu_engine.h"
#include "nccl_exchange_check.h"
#include "tensor_args.h"

namespace nb = nanobind;

namespace ddtree {
namespace {

namespace k = ddtree::kernels;

// Candidates travel as two int32 per row (the value's bits, the id), as in bind_rank_reduce.cpp.
std::vector<k::RankCandidate> parse_candidates(const std::vector<int32_t>& pairs) {
    if (pairs.size() % 2 != 0) throw nb::value_error("candidates: (value bits, id) pairs of int32");
    std::vector<k::RankCandidate> out(pairs.size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
        std::memcpy(&out[i].value, &pairs[2 * i], sizeof(float));
        out[i].id = pairs[2 * i + 1];
    }
    return out;
}

}  // namespace

void bind_multi_gpu(nb::module_& m) {
    nb::class_<MultiGpuEngine> engine(
        m, "MultiGpuEngine",
        "A target split over several GPUs of this host, rank r on devices[r], NCCL between them (see ddtree.Engine)");
    engine
        .def(
            "__init__",
            [](MultiGpuEngine* self, const nb::dict& dims, const std::vector<float>& inv_freq,
               float attention_factor, bool interleave, int streams, int max_context, int budget,
               const std::vector<int>& devices, const std::string& nccl_library,
               const std::optional<nb::dict>& drafter) {
                const std::optional<DrafterSpec> spec = parse_drafter_spec(drafter, devices.size() > 1);
                const ModelDims d = parse_dims(dims);
                const RopeTable rope{inv_freq, attention_factor, interleave};
                nb::gil_scoped_release release;
                new (self) MultiGpuEngine(d, rope, streams, max_context, budget, devices, nccl_library,
                                          spec ? &*spec : nullptr);
            },
            nb::arg("dims"), nb::arg("inv_freq"), nb::arg("attention_factor"), nb::arg("interleave"),
            nb::arg("streams"), nb::arg("max_context"), nb::arg("budget"), nb::arg("devices"),
            nb::arg("nccl_library"), nb::arg("drafter") = nb::none(),
            "As Engine, the target split over len(devices) ranks, rank r on devices[r]; nccl_library: the path of "
            "libnccl.so.2, loaded at run time.")
        .def_prop_ro("ranks", &MultiGpuEngine::ranks)
        .def_prop_ro("devices", &MultiGpuEngine::devices)
        .def("randomize_weights", &MultiGpuEngine::randomize_weights, nb::arg("seed"),
             nb::call_guard<nb::gil_scoped_release>(),
             "Rank r's split tensors drawn with seed + r, its replicated ones rank 0's: the model of an all_ranks "
             "Engine on one GPU with the same seed.")
        .def(
            "forward_logits",
            [](MultiGpuEngine& e, const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
               const std::vector<int32_t>& positions) {
                std::vector<float> logits;
                {
                    nb::gil_scoped_release release;
                    logits = e.forward_logits(ids, streams, positions);
                }
                return to_numpy(std::move(logits), {ids.size(), static_cast<size_t>(e.dims().vocab)});
            },
            nb::arg("ids"), nb::arg("streams"), nb::arg("positions"),
            "Eager forward of rows on every rank -> fp32 logits [rows, vocab], each rank's vocabulary slice.");
    bind_engine_surface(engine);

    nb::module_ kernels = nb::borrow<nb::module_>(m.attr("kernels"));
    kernels.def(
        "nccl_exchange_check",
        [](const std::string& library, const std::vector<int>& devices, int terms, int rows, int width,
           const std::vector<std::vector<uint16_t>>& parts, const std::vector<std::vector<int32_t>>& candidates) {
            std::vector<std::vector<k::RankCandidate>> parsed;
            for (const auto& c : candidates) parsed.push_back(parse_candidates(c));
            NcclExchangeResult out;
            {
                nb::gil_scoped_release release;
                out = nccl_exchange_check(library, devices, terms, rows, width, parts, parsed);
            }
            return nb::make_tuple(out.sums, out.tokens);
        },
        nb::arg("library"), nb::arg("devices"), nb::arg("terms"), nb::arg("rows"), nb::arg("width"),
        nb::arg("parts"), nb::arg("candidates"),
        "NcclCollectives over communicators of `devices`, one captured graph per rank: parts[r] rank r's bf16 bits "
        "[terms * rows * width], candidates[r] its [rows * 2] int32 (value bits, id). Returns (sums, tokens): per "
        "rank, the bf16 bits [rows * width] of the rank-order sum and the picked token of each row.");
    kernels.def("nccl_exchange_seconds", &time_nccl_exchange, nb::arg("library"), nb::arg("devices"),
                nb::arg("terms"), nb::arg("rows"), nb::arg("width"), nb::arg("per_graph") = 20,
                nb::arg("iters") = 20, nb::call_guard<nb::gil_scoped_release>(),
                "Device seconds per exchange of terms x rows x width bf16 partial sums over `devices`: (gather then "
                "rank-order sum, ncclAllReduce of the same count), the slowest rank's median.");
    kernels.def(
        "nccl_version",
        [](const std::string& library) { return nccl::Library::open(library).version(); }, nb::arg("library"),
        "NCCL's version code of the library at `library` (RuntimeError naming it when it cannot be loaded).");
}

}  // namespace ddtree
