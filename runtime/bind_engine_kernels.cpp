// Kernel-level entry points of the engine's kernel families (ddtree._native.kernels.*), for the GPU tests and
// the benchmark: each checks its CUDA arrays, launches on kernel_launch_stream() and raises on any CUDA error.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <optional>
#include <string>

#include "bindings.h"
#include "cuda_check.h"
#include "embed.cuh"
#include "experts_int4.cuh"
#include "gemm.cuh"
#include "mla_attn.cuh"
#include "rope.cuh"
#include "router.cuh"
#include "sample.cuh"
#include "topk.cuh"
#include "tensor_args.h"

namespace nb = nanobind;
namespace k = ddtree::kernels;

namespace ddtree {

namespace {

k::GemmEpilogue parse_epilogue(const std::string& name) {
    if (name == "bf16") return k::GemmEpilogue::kBf16;
    if (name == "f32") return k::GemmEpilogue::kF32;
    if (name == "silu_mul") return k::GemmEpilogue::kSiluMul;
    throw nb::value_error(("argument 'epilogue' must be 'bf16', 'f32' or 'silu_mul', got '" + name + "'").c_str());
}

// out[m, b, n'] = epilogue(x[m, b, :] . w[b, n, :]) for b < batch; 2-D x/w/out mean batch 1.
void gemm(CudaArray out, CudaArray x, CudaArray w, const std::string& epilogue, CudaArray workspace,
          CudaArray counters) {
    same_device({&out, &x, &w, &workspace, &counters});
    const k::GemmEpilogue epi = parse_epilogue(epilogue);
    const bool batched = x.ndim() == 3;
    if (x.ndim() != 2 && !batched) throw nb::value_error("argument 'x' must be [m, k] or [m, batch, k]");
    const int m = dim(x, "x", 0), batch = batched ? dim(x, "x", 1) : 1, kk = dim(x, "x", x.ndim() - 1);
    const int n = dim(w, "w", w.ndim() - 2);
    const int n_out = epi == k::GemmEpilogue::kSiluMul ? n / 2 : n;
    const k::bf16* x_p = batched ? checked<const k::bf16>(x, "x", DType::bf16, {m, batch, kk})
                                 : checked<const k::bf16>(x, "x", DType::bf16, {m, kk});
    const k::bf16* w_p = batched ? checked<const k::bf16>(w, "w", DType::bf16, {batch, n, kk})
                                 : checked<const k::bf16>(w, "w", DType::bf16, {n, kk});
    const DType out_type = epi == k::GemmEpilogue::kF32 ? DType::f32 : DType::bf16;
    void* out_p = batched ? checked<void>(out, "out", out_type, {m, batch, n_out})
                          : checked<void>(out, "out", out_type, {m, n_out});
    const int64_t need = k::gemm_workspace_floats(m, n, kk, batch);
    float* ws = checked<float>(workspace, "workspace", DType::f32, {-1});
    if (static_cast<int64_t>(workspace.shape(0)) < need) throw nb::value_error("argument 'workspace' is too small");
    int* ctr = checked<int>(counters, "counters", DType::i32, {-1});
    if (static_cast<int64_t>(counters.shape(0)) < k::gemm_counter_count(n, batch)) {
        throw nb::value_error("argument 'counters' is too small");
    }
    const k::GemmBatch b{batch, kk, static_cast<int64_t>(n) * kk, n_out};
    if (!k::gemm_operands_aligned(x_p, static_cast<int64_t>(batch) * kk, w_p, kk, b)) {
        throw nb::value_error("arguments 'x' and 'w' must start on 16-byte boundaries with k a multiple of 8");
    }
    CUDA_CHECK(k::gemm_bf16(x_p, static_cast<int64_t>(batch) * kk, w_p, out_p, static_cast<int64_t>(batch) * n_out, m,
                            n, kk, epi, b, ws, ctr, kernel_launch_stream()));
}

void gather_rows(CudaArray out, CudaArray table, CudaArray ids) {
    same_device({&out, &table, &ids});
    const int rows = dim(ids, "ids", 0), d = dim(table, "table", 1);
    CUDA_CHECK(k::gather_rows(checked<k::bf16>(out, "out", DType::bf16, {rows, d}), d,
                              checked<const k::bf16>(table, "table", DType::bf16, {-1, d}), d,
                              checked<const int32_t>(ids, "ids", DType::i32, {rows}), rows, d, kernel_launch_stream()));
}

k::RopeParams rope_params(CudaArray& inv_freq, float attention_factor, bool interleave) {
    const int half = dim(inv_freq, "inv_freq", 0);
    return {checked<const float>(inv_freq, "inv_freq", DType::f32, {half}), attention_factor, 2 * half, interleave};
}

// out[r, h, out_offset:+rope] = rope(q[r, h, q_offset:+rope], positions[r])
void rope_queries(CudaArray out, int out_offset, CudaArray q, int q_offset, CudaArray positions, CudaArray inv_freq,
                  float attention_factor, bool interleave) {
    same_device({&out, &q, &positions, &inv_freq});
    const int rows = dim(q, "q", 0), heads = dim(q, "q", 1), dq = dim(q, "q", 2), dout = dim(out, "out", 2);
    const k::RopeParams rope = rope_params(inv_freq, attention_factor, interleave);
    if (q_offset < 0 || q_offset + rope.rope_dim > dq || out_offset < 0 || out_offset + rope.rope_dim > dout) {
        throw nb::value_error("rope slice outside 'q' or 'out'");
    }
    CUDA_CHECK(k::rope_queries(checked<k::bf16>(out, "out", DType::bf16, {rows, heads, dout}),
                               static_cast<int64_t>(heads) * dout, dout, out_offset,
                               checked<const k::bf16>(q, "q", DType::bf16, {rows, heads, dq}),
                               static_cast<int64_t>(heads) * dq, dq, q_offset,
                               checked<const int32_t>(positions, "positions", DType::i32, {rows}), rows, heads, rope,
                               kernel_launch_stream()));
}

void mla_store_kv(CudaArray cache, CudaArray slots, CudaArray kv_a, CudaArray norm_weight, float eps,
                  CudaArray positions, CudaArray inv_freq, float attention_factor, bool interleave) {
    same_device({&cache, &slots, &kv_a, &norm_weight, &positions, &inv_freq});
    const int rows = dim(kv_a, "kv_a", 0), row_len = dim(kv_a, "kv_a", 1);
    const int kv_lora = dim(norm_weight, "norm_weight", 0);
    const k::RopeParams rope = rope_params(inv_freq, attention_factor, interleave);
    if (kv_lora + rope.rope_dim != row_len) throw nb::value_error("argument 'kv_a' must be [rows, kv_lora + rope]");
    CUDA_CHECK(k::mla_store_kv(checked<k::bf16>(cache, "cache", DType::bf16, {-1, row_len}),
                               checked<const int32_t>(slots, "slots", DType::i32, {rows}),
                               checked<const k::bf16>(kv_a, "kv_a", DType::bf16, {rows, row_len}), row_len,
                               checked<const k::bf16>(norm_weight, "norm_weight", DType::bf16, {kv_lora}), eps, kv_lora,
                               checked<const int32_t>(positions, "positions", DType::i32, {rows}), rows, rope,
                               kernel_launch_stream()));
}

void mla_attention(CudaArray out, CudaArray q, CudaArray cache, CudaArray kv_start, CudaArray kv_len, int max_len,
                   float softmax_scale, CudaArray workspace, std::optional<CudaArray> key_start,
                   std::optional<CudaArray> key_nodes) {
    same_device({&out, &q, &cache, &kv_start, &kv_len, &workspace});
    const int rows = dim(q, "q", 0), heads = dim(q, "q", 1), d = dim(q, "q", 2), dl = dim(out, "out", 2);
    const k::MlaDims dims{heads, dl, d - dl};
    if (!k::mla_dims_supported(dims.kv_lora, dims.rope_dim)) {
        throw nb::value_error("no MLA kernel for these (kv_lora, rope) dims");
    }
    float* ws = checked<float>(workspace, "workspace", DType::f32, {-1});
    if (static_cast<int64_t>(workspace.shape(0)) < k::mla_workspace_floats(dims, rows, max_len)) {
        throw nb::value_error("argument 'workspace' is too small");
    }
    // Tree keys for kernel tests: the caller keeps every redirected row inside the cache.
    k::MlaTreeKeys tree;
    if (key_start.has_value() != key_nodes.has_value()) {
        throw nb::value_error("arguments 'key_start' and 'key_nodes' go together");
    }
    if (key_start) {
        same_device({&out, &*key_start, &*key_nodes});
        tree.stride = dim(*key_nodes, "key_nodes", 1);
        tree.key_start = checked<const int32_t>(*key_start, "key_start", DType::i32, {rows});
        tree.key_nodes = checked<const int32_t>(*key_nodes, "key_nodes", DType::i32, {rows, tree.stride});
    }
    CUDA_CHECK(k::mla_attention(checked<k::bf16>(out, "out", DType::bf16, {rows, heads, dl}),
                                checked<const k::bf16>(q, "q", DType::bf16, {rows, heads, d}),
                                checked<const k::bf16>(cache, "cache", DType::bf16, {-1, d}), dim(cache, "cache", 0),
                                checked<const int32_t>(kv_start, "kv_start", DType::i32, {rows}),
                                checked<const int32_t>(kv_len, "kv_len", DType::i32, {rows}), rows, max_len, dims,
                                softmax_scale, ws, kernel_launch_stream(), tree));
}

void topk_log_softmax(CudaArray log_probs, CudaArray ids, CudaArray logits) {
    same_device({&log_probs, &ids, &logits});
    const int rows = dim(logits, "logits", 0), vocab = dim(logits, "logits", 1), top = dim(log_probs, "log_probs", 1);
    if (vocab > k::kTopkVocabMax) {
        throw nb::value_error(("argument 'logits' must be [rows, vocab] with vocab <= " +
                               std::to_string(k::kTopkVocabMax))
                                  .c_str());
    }
    if (top < 1 || top > std::min(vocab, k::kTopkMax)) {
        throw nb::value_error(("argument 'log_probs' must be [rows, k] with 1 <= k <= min(vocab, " +
                               std::to_string(k::kTopkMax) + ")")
                                  .c_str());
    }
    CUDA_CHECK(k::topk_log_softmax(checked<float>(log_probs, "log_probs", DType::f32, {rows, top}),
                                   checked<int32_t>(ids, "ids", DType::i32, {rows, top}),
                                   checked<const float>(logits, "logits", DType::f32, {rows, vocab}), vocab, rows,
                                   vocab, top, kernel_launch_stream()));
}

void route_topk(CudaArray ids, CudaArray weights, CudaArray logits, CudaArray bias, bool normalize) {
    same_device({&ids, &weights, &logits, &bias});
    const int tokens = dim(logits, "logits", 0), experts = dim(logits, "logits", 1), topk = dim(ids, "ids", 1);
    CUDA_CHECK(k::route_topk(checked<int32_t>(ids, "ids", DType::i32, {tokens, topk}),
                             checked<float>(weights, "weights", DType::f32, {tokens, topk}),
                             checked<const float>(logits, "logits", DType::f32, {tokens, experts}),
                             checked<const float>(bias, "bias", DType::f32, {experts}), tokens, experts, topk,
                             normalize, kernel_launch_stream()));
}

void sample_tokens(CudaArray tokens, CudaArray nonfinite_at, CudaArray logits, CudaArray temperature, CudaArray seed,
                   CudaArray stream_ids, CudaArray positions) {
    same_device({&tokens, &nonfinite_at, &logits, &temperature, &seed, &stream_ids, &positions});
    const int rows = dim(logits, "logits", 0), vocab = dim(logits, "logits", 1);
    CUDA_CHECK(k::sample_tokens(checked<int32_t>(tokens, "tokens", DType::i32, {rows}),
                                checked<int32_t>(nonfinite_at, "nonfinite_at", DType::i32,
                                                 {dim(nonfinite_at, "nonfinite_at", 0)}),
                                checked<const float>(logits, "logits", DType::f32, {rows, vocab}), vocab, rows, vocab,
                                checked<const float>(temperature, "temperature", DType::f32, {1}),
                                checked<const unsigned long long>(seed, "seed", DType::i64, {1}),
                                checked<const int32_t>(stream_ids, "stream_ids", DType::i32, {rows}),
                                checked<const int32_t>(positions, "positions", DType::i32, {rows}),
                                kernel_launch_stream()));
}

// Routed experts in checkpoint layout: packed int32 [E, out, in/8], scale bf16 [E, out, in/32].
void experts_int4(CudaArray out, CudaArray act, CudaArray x, CudaArray ids, CudaArray weights, float scaling,
                  CudaArray gate_packed, CudaArray gate_scale, CudaArray up_packed, CudaArray up_scale,
                  CudaArray down_packed, CudaArray down_scale) {
    same_device({&out, &act, &x, &ids, &weights, &gate_packed, &gate_scale, &up_packed, &up_scale, &down_packed,
                 &down_scale});
    const int tokens = dim(x, "x", 0), hidden = dim(x, "x", 1), topk = dim(ids, "ids", 1);
    const int experts = dim(gate_packed, "gate_packed", 0), inter = dim(gate_packed, "gate_packed", 1);
    const k::Int4Experts w{
        checked<const int32_t>(gate_packed, "gate_packed", DType::i32, {experts, inter, hidden / 8}),
        checked<const k::bf16>(gate_scale, "gate_scale", DType::bf16, {experts, inter, hidden / 32}),
        checked<const int32_t>(up_packed, "up_packed", DType::i32, {experts, inter, hidden / 8}),
        checked<const k::bf16>(up_scale, "up_scale", DType::bf16, {experts, inter, hidden / 32}),
        checked<const int32_t>(down_packed, "down_packed", DType::i32, {experts, hidden, inter / 8}),
        checked<const k::bf16>(down_scale, "down_scale", DType::bf16, {experts, hidden, inter / 32}),
        hidden, inter};
    CUDA_CHECK(k::experts_int4_forward(checked<k::bf16>(out, "out", DType::bf16, {tokens, hidden}),
                                       checked<k::bf16>(act, "act", DType::bf16, {tokens * topk, inter}),
                                       checked<const k::bf16>(x, "x", DType::bf16, {tokens, hidden}),
                                       checked<const int32_t>(ids, "ids", DType::i32, {tokens, topk}),
                                       checked<const float>(weights, "weights", DType::f32, {tokens, topk}), tokens,
                                       topk, scaling, w, kernel_launch_stream()));
}

}  // namespace

void bind_engine_kernels(nb::module_& kernels) {
    kernels.def(
        "use_stream", [](uintptr_t handle) { kernel_launch_stream() = reinterpret_cast<cudaStream_t>(handle); },
        nb::arg("handle"), "Launch the engine-kernel entry points on this CUDA stream (0: default stream).");
    kernels.def("gemm", &gemm, nb::arg("out"), nb::arg("x"), nb::arg("w"), nb::arg("epilogue"), nb::arg("workspace"),
                nb::arg("counters"), "out = epilogue(x @ w^T); 3-D x [m, batch, k] with w [batch, n, k] is batched.");
    kernels.def("gemm_workspace_floats", &k::gemm_workspace_floats, nb::arg("m"), nb::arg("n"), nb::arg("k"),
                nb::arg("batch") = 1);
    kernels.def("gemm_counter_count", &k::gemm_counter_count, nb::arg("n"), nb::arg("batch") = 1);
    kernels.def("gemm_split_count", &k::gemm_split_count, nb::arg("n"), nb::arg("k"), nb::arg("batch") = 1);
    kernels.def("gather_rows", &gather_rows, nb::arg("out"), nb::arg("table"), nb::arg("ids"));
    kernels.def("rope_queries", &rope_queries, nb::arg("out"), nb::arg("out_offset"), nb::arg("q"), nb::arg("q_offset"),
                nb::arg("positions"), nb::arg("inv_freq"), nb::arg("attention_factor"), nb::arg("interleave"));
    kernels.def("mla_store_kv", &mla_store_kv, nb::arg("cache"), nb::arg("slots"), nb::arg("kv_a"),
                nb::arg("norm_weight"), nb::arg("eps"), nb::arg("positions"), nb::arg("inv_freq"),
                nb::arg("attention_factor"), nb::arg("interleave"));
    kernels.def("mla_attention", &mla_attention, nb::arg("out"), nb::arg("q"), nb::arg("cache"), nb::arg("kv_start"),
                nb::arg("kv_len"), nb::arg("max_len"), nb::arg("softmax_scale"), nb::arg("workspace"),
                nb::arg("key_start") = nb::none(), nb::arg("key_nodes") = nb::none());
    kernels.def(
        "mla_workspace_floats",
        [](int heads, int kv_lora, int rope, int rows, int max_len) {
            return k::mla_workspace_floats({heads, kv_lora, rope}, rows, max_len);
        },
        nb::arg("heads"), nb::arg("kv_lora"), nb::arg("rope"), nb::arg("rows"), nb::arg("max_len"));
    kernels.def("topk_log_softmax", &topk_log_softmax, nb::arg("log_probs"), nb::arg("ids"), nb::arg("logits"),
                "Per-row top-k of log-softmax(logits): fp32 log-probs [rows, k] sorted descending (ties to the lower "
                "id) and their int32 token ids.");
    kernels.def("route_topk", &route_topk, nb::arg("ids"), nb::arg("weights"), nb::arg("logits"), nb::arg("bias"),
                nb::arg("normalize"));
    kernels.def("sample_tokens", &sample_tokens, nb::arg("tokens"), nb::arg("nonfinite_at"), nb::arg("logits"),
                nb::arg("temperature"), nb::arg("seed"), nb::arg("stream_ids"), nb::arg("positions"),
                "Arg-max or seeded Gumbel-max tokens of fp32 logits; a row with a NaN or infinite logit lowers "
                "nonfinite_at[stream_ids[row]] (int32, an entry for every stream id) to its position.");
    kernels.def("experts_int4", &experts_int4, nb::arg("out"), nb::arg("act"), nb::arg("x"), nb::arg("ids"),
                nb::arg("weights"), nb::arg("scaling"), nb::arg("gate_packed"), nb::arg("gate_scale"),
                nb::arg("up_packed"), nb::arg("up_scale"), nb::arg("down_packed"), nb::arg("down_scale"));
}

}  // namespace ddtree
