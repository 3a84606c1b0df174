// Kernel-level entry points of the collectives' arithmetic (kernels/rank_reduce.cuh) and of the sampler's per-rank
// candidates, for tests/gpu/test_rank_reduce.py. A candidate travels as two int32 per row: the value's bits, the id.
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "cuda_check.h"
#include "rank_reduce.cuh"
#include "sample.cuh"
#include "tensor_args.h"

namespace nb = nanobind;

namespace ddtree {
namespace {

namespace k = ddtree::kernels;

static_assert(sizeof(k::RankCandidate) == 8, "a candidate is two int32 in the bindings");

// parts: bf16 [ranks, terms, rows, width] -> out: bf16 [rows, width].
void rank_order_sum(CudaArray out, CudaArray parts) {
    same_device({&out, &parts});
    const int ranks = dim(parts, "parts", 0), terms = dim(parts, "parts", 1), rows = dim(parts, "parts", 2),
              width = dim(parts, "parts", 3);
    CUDA_CHECK(k::rank_order_sum(checked<k::bf16>(out, "out", DType::bf16, {rows, width}),
                                 checked<const k::bf16>(parts, "parts", DType::bf16, {ranks, terms, rows, width}),
                                 ranks, terms, rows, width, kernel_launch_stream()));
}

// The candidates [rows, 2] of logits[:, first : first + width] (logits f32 [rows, vocab]).
void sample_candidates(CudaArray candidates, CudaArray nonfinite_at, CudaArray logits, int first, int width,
                       CudaArray temperature, CudaArray seed, CudaArray stream_ids, CudaArray positions) {
    same_device({&candidates, &nonfinite_at, &logits, &temperature, &seed, &stream_ids, &positions});
    const int rows = dim(logits, "logits", 0), vocab = dim(logits, "logits", 1);
    if (first < 0 || width < 1 || first + width > vocab) {
        throw nb::value_error("first and width must select columns of logits");
    }
    const float* base = checked<const float>(logits, "logits", DType::f32, {rows, vocab});
    CUDA_CHECK(k::sample_candidates(
        reinterpret_cast<k::RankCandidate*>(checked<int32_t>(candidates, "candidates", DType::i32, {rows, 2})),
        checked<int32_t>(nonfinite_at, "nonfinite_at", DType::i32, {dim(nonfinite_at, "nonfinite_at", 0)}),
        base + first, vocab, rows, width, first, checked<const float>(temperature, "temperature", DType::f32, {1}),
        checked<const unsigned long long>(seed, "seed", DType::i64, {1}),
        checked<const int32_t>(stream_ids, "stream_ids", DType::i32, {rows}),
        checked<const int32_t>(positions, "positions", DType::i32, {rows}), kernel_launch_stream()));
}

// candidates: int32 [ranks, rows, 2] -> tokens int32 [rows].
void pick_candidates(CudaArray tokens, CudaArray candidates) {
    same_device({&tokens, &candidates});
    const int ranks = dim(candidates, "candidates", 0), rows = dim(candidates, "candidates", 1);
    const auto* c = checked<const int32_t>(candidates, "candidates", DType::i32, {ranks, rows, 2});
    CUDA_CHECK(k::pick_candidates(checked<int32_t>(tokens, "tokens", DType::i32, {rows}),
                                  reinterpret_cast<const k::RankCandidate*>(c), ranks, rows,
                                  kernel_launch_stream()));
}

}  // namespace

void bind_rank_reduce(nb::module_& m) {
    nb::module_ kernels = nb::borrow<nb::module_>(m.attr("kernels"));
    kernels.def("rank_order_sum", &rank_order_sum, nb::arg("out"), nb::arg("parts"),
                "out[row, c] = bf16 of the fp32 sum over ranks, then terms, of parts[rank, term, row, c], in order.");
    kernels.def("sample_candidates", &sample_candidates, nb::arg("candidates"), nb::arg("nonfinite_at"),
                nb::arg("logits"), nb::arg("first"), nb::arg("width"), nb::arg("temperature"), nb::arg("seed"),
                nb::arg("stream_ids"), nb::arg("positions"),
                "Each row's best (value bits, global id) over logits[:, first : first + width], greedy or Gumbel-max "
                "keyed by the global id, as one rank of a vocabulary-split LM head.");
    kernels.def("pick_candidates", &pick_candidates, nb::arg("tokens"), nb::arg("candidates"),
                "The token of each row from every rank's candidates: the highest value, ties to the lower id.");
}

}  // namespace ddtree
