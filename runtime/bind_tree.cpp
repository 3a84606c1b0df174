// Kernel-level entry points of the DDTree tree kernels (ddtree._native.kernels.tree_*), for the GPU tests and the
// benchmark: each checks its CUDA arrays, launches on kernel_launch_stream() and raises on any CUDA error. The
// round calls the launchers directly.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <vector>
#include <string>

#include "bindings.h"
#include "cuda_check.h"
#include "tensor_args.h"
#include "tree_accept.cuh"
#include "tree_build.cuh"
#include "tree_commit.cuh"

namespace nb = nanobind;
namespace k = ddtree::kernels;

namespace ddtree {
namespace {

int extent(const CudaArray& a, const char* name, size_t ndim, size_t i) {
    if (a.ndim() != ndim) {
        throw nb::value_error(("argument '" + std::string(name) + "' must have " + std::to_string(ndim) +
                               " dimensions, got " + std::to_string(a.ndim()))
                                  .c_str());
    }
    return static_cast<int>(a.shape(i));
}

void check_range(const char* name, int value, int lo, int hi) {
    if (value < lo || value > hi) {
        throw nb::value_error((std::string(name) + " must lie in " + std::to_string(lo) + ".." + std::to_string(hi) +
                               ", got " + std::to_string(value))
                                  .c_str());
    }
}

k::TreeShape tree_shape(int streams, int budget, int depth_limit) {
    check_range("budget", budget, 0, k::kTreeMaxBudget);
    check_range("depth limit L", depth_limit, 1, k::kTreeMaxDepth);
    return {streams, budget, depth_limit};
}

// Every array [streams, N + 1] (visibility as int32 bit words, ancestors [streams, N + 1, L + 1]).
void tree_build(CudaArray tokens, CudaArray parents, CudaArray depths, CudaArray first_child, CudaArray next_sibling,
                CudaArray visibility, CudaArray positions, CudaArray ancestors, CudaArray node_count,
                CudaArray log_probs, CudaArray token_ids, CudaArray start, CudaArray bonus, int budget) {
    same_device({&tokens, &parents, &depths, &first_child, &next_sibling, &visibility, &positions, &ancestors,
                 &node_count, &log_probs, &token_ids, &start, &bonus});
    const int streams = extent(log_probs, "log_probs", 3, 0), depth_limit = extent(log_probs, "log_probs", 3, 1);
    const int width = extent(log_probs, "log_probs", 3, 2);
    const k::TreeShape shape = tree_shape(streams, budget, depth_limit);
    check_range("top-K width (log_probs.shape[2])", width, 1, k::kTreeMaxWidth);
    const int64_t s = streams, rows = k::tree_rows(budget);
    auto node_array = [&](CudaArray& a, const char* name) { return checked<int32_t>(a, name, DType::i32, {s, rows}); };
    const k::TreeArrays tree{
        node_array(tokens, "tokens"),
        node_array(parents, "parents"),
        node_array(depths, "depths"),
        node_array(first_child, "first_child"),
        node_array(next_sibling, "next_sibling"),
        checked<uint32_t>(visibility, "visibility", DType::i32, {s, rows, k::tree_visibility_words(budget)}),
        node_array(positions, "positions"),
        checked<int32_t>(ancestors, "ancestors", DType::i32, {s, rows, depth_limit + 1}),
        checked<int32_t>(node_count, "node_count", DType::i32, {s}),
    };
    const k::TreeCandidates in{
        checked<const float>(log_probs, "log_probs", DType::f32, {s, depth_limit, width}),
        checked<const int32_t>(token_ids, "token_ids", DType::i32, {s, depth_limit, width}),
        width,
        checked<const int32_t>(start, "start", DType::i32, {s}),
        checked<const int32_t>(bonus, "bonus", DType::i32, {s}),
    };
    CUDA_CHECK(k::tree_build(in, tree, shape, kernel_launch_stream()));
}

// masses fp32 [streams, len(budgets)] from log_probs [streams, L, K]; budgets ascending, the last the probe's pops.
void tree_probe(CudaArray masses, CudaArray log_probs, const std::vector<int>& budgets) {
    same_device({&masses, &log_probs});
    const int streams = extent(log_probs, "log_probs", 3, 0), depth_limit = extent(log_probs, "log_probs", 3, 1);
    const int width = extent(log_probs, "log_probs", 3, 2);
    check_range("top-K width (log_probs.shape[2])", width, 1, k::kTreeMaxWidth);
    check_range("len(budgets)", static_cast<int>(budgets.size()), 1, k::kProbeMaxBudgets);
    k::ProbeBudgets list{static_cast<int>(budgets.size()), {}};
    for (size_t i = 0; i < budgets.size(); ++i) {
        check_range("budgets", budgets[i], i == 0 ? 1 : budgets[i - 1] + 1, k::kTreeMaxBudget);
        list.budgets[i] = budgets[i];
    }
    const k::TreeShape shape = tree_shape(streams, budgets.back(), depth_limit);
    const int64_t s = streams;
    const k::TreeCandidates in{checked<const float>(log_probs, "log_probs", DType::f32, {s, depth_limit, width}),
                               nullptr, width, nullptr, nullptr};
    CUDA_CHECK(k::tree_probe(in, list,
                             checked<float>(masses, "masses", DType::f32, {s, static_cast<int64_t>(budgets.size())}),
                             shape, kernel_launch_stream()));
}

void tree_accept(CudaArray accepted, CudaArray accept_len, CudaArray next_bonus, CudaArray tokens,
                 CudaArray first_child, CudaArray next_sibling, CudaArray node_count, CudaArray choice) {
    same_device({&accepted, &accept_len, &next_bonus, &tokens, &first_child, &next_sibling, &node_count, &choice});
    const int streams = extent(tokens, "tokens", 2, 0), rows = extent(tokens, "tokens", 2, 1);
    const k::TreeShape shape = tree_shape(streams, rows - 1, extent(accepted, "accepted", 2, 1) - 1);
    const int64_t s = streams;
    k::TreeArrays tree{};
    tree.tokens = checked<int32_t>(tokens, "tokens", DType::i32, {s, rows});
    tree.first_child = checked<int32_t>(first_child, "first_child", DType::i32, {s, rows});
    tree.next_sibling = checked<int32_t>(next_sibling, "next_sibling", DType::i32, {s, rows});
    tree.node_count = checked<int32_t>(node_count, "node_count", DType::i32, {s});
    CUDA_CHECK(k::tree_accept(tree, checked<const int32_t>(choice, "choice", DType::i32, {s, rows}), nullptr,
                              checked<int32_t>(accepted, "accepted", DType::i32, {s, shape.depth_limit + 1}),
                              checked<int32_t>(accept_len, "accept_len", DType::i32, {s}),
                              checked<int32_t>(next_bonus, "next_bonus", DType::i32, {s}), shape,
                              kernel_launch_stream()));
}

// cache bf16 [layers, cache_rows, row_elems]; taps bf16 [streams * (N + 1), width] with context bf16
// [streams, L + 1, width], both or neither.
void tree_commit(CudaArray cache, CudaArray start, CudaArray stream_base, CudaArray accepted, CudaArray accept_len,
                 int budget, std::optional<CudaArray> taps, std::optional<CudaArray> context) {
    if (taps.has_value() != context.has_value()) throw nb::value_error("pass 'taps' and 'context' together");
    same_device({&cache, &start, &stream_base, &accepted, &accept_len, taps ? &*taps : &cache,
                 context ? &*context : &cache});
    const int streams = extent(accepted, "accepted", 2, 0);
    const k::TreeShape shape = tree_shape(streams, budget, extent(accepted, "accepted", 2, 1) - 1);
    const int layers = extent(cache, "cache", 3, 0), cache_rows = extent(cache, "cache", 3, 1);
    const int row_elems = extent(cache, "cache", 3, 2);
    const int64_t s = streams, path = shape.depth_limit + 1;
    k::TapGather gather{nullptr, nullptr, 0};
    if (taps) {
        gather.width = extent(*taps, "taps", 2, 1);
        gather.taps = checked<const k::bf16>(*taps, "taps", DType::bf16, {s * k::tree_rows(budget), gather.width});
        gather.context = checked<k::bf16>(*context, "context", DType::bf16, {s, path, gather.width});
        if (gather.width % k::kCommitChunkElems != 0) {
            throw nb::value_error("argument 'taps' must have rows of a multiple of 8 elements");
        }
    }
    if (!k::commit_rows_supported(row_elems, shape.depth_limit)) {
        throw nb::value_error("argument 'cache' must have rows of a multiple of 8 elements, L + 1 of them <= 48 KiB");
    }
    const k::LatentCache latent{checked<k::bf16>(cache, "cache", DType::bf16, {layers, cache_rows, row_elems}),
                                layers, cache_rows, row_elems};
    CUDA_CHECK(k::tree_commit(latent, gather, checked<const int32_t>(stream_base, "stream_base", DType::i32, {s}),
                              checked<int32_t>(start, "start", DType::i32, {s}),
                              checked<const int32_t>(accepted, "accepted", DType::i32, {s, path}),
                              checked<const int32_t>(accept_len, "accept_len", DType::i32, {s}), shape,
                              kernel_launch_stream()));
}

}  // namespace

void bind_tree(nb::module_& m) {
    nb::module_ kernels = nb::borrow<nb::module_>(m.attr("kernels"));
    kernels.def("tree_build", &tree_build, nb::arg("tokens"), nb::arg("parents"), nb::arg("depths"),
                nb::arg("first_child"), nb::arg("next_sibling"), nb::arg("visibility"), nb::arg("positions"),
                nb::arg("ancestors"), nb::arg("node_count"), nb::arg("log_probs"), nb::arg("token_ids"),
                nb::arg("start"), nb::arg("bonus"), nb::arg("budget"),
                "DDTree of every stream from per-depth top-K log_probs/token_ids [streams, L, K], as "
                "ddtree.reference.tree.build_tree; node arrays [streams, budget + 1], pad -1.");
    kernels.def("tree_probe", &tree_probe, nb::arg("masses"), nb::arg("log_probs"), nb::arg("budgets"),
                "The auto budgets' probe: masses[s, i] = 1 + the sum of exp(path score) of the first budgets[i] nodes "
                "the tree build pops at budget budgets[-1] (ddtree.reference.budget.probe_masses).");
    kernels.def("tree_accept", &tree_accept, nb::arg("accepted"), nb::arg("accept_len"), nb::arg("next_bonus"),
                nb::arg("tokens"), nb::arg("first_child"), nb::arg("next_sibling"), nb::arg("node_count"),
                nb::arg("choice"), "Bounded accept walk of every stream's tree, as ddtree.reference.tree.accept_walk.");
    kernels.def("tree_commit", &tree_commit, nb::arg("cache"), nb::arg("start"), nb::arg("stream_base"),
                nb::arg("accepted"), nb::arg("accept_len"), nb::arg("budget"), nb::arg("taps") = nb::none(),
                nb::arg("context") = nb::none(),
                "Move the accepted latent rows of every layer to start.., gather their tap rows, start += "
                "accept_len.");
}

}  // namespace ddtree
