// Python surface of the engine (ddtree._native.Engine): construction from a config dict, weight upload from
// host numpy views (no copies on the Python side), prefill/decode, and the test/benchmark entry points.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include <utility>

#include "bind_engine_surface.h"
#include "bindings.h"
#include "budget_policy.h"
#include "engine.h"
#include "shard.h"
#include "tree_rows.cuh"
#include "tensor_args.h"

namespace nb = nanobind;

namespace ddtree {
namespace {

template <typename T>
T field(const nb::dict& d, const char* key) {
    return config_field<T>(d, "engine config", key);
}

}  // namespace

ModelDims parse_dims(const nb::dict& d, int rank, int ranks) {
    ModelDims m;
    m.shard = Shard{rank, ranks};
    m.vocab = field<int>(d, "vocab");
    m.hidden = field<int>(d, "hidden");
    m.inter = field<int>(d, "inter");
    m.moe_inter = field<int>(d, "moe_inter");
    m.layers = field<int>(d, "layers");
    m.heads = field<int>(d, "heads");
    m.q_lora = field<int>(d, "q_lora");
    m.kv_lora = field<int>(d, "kv_lora");
    m.nope = field<int>(d, "nope");
    m.rope = field<int>(d, "rope");
    m.v = field<int>(d, "v");
    m.experts = field<int>(d, "experts");
    m.shared_inter = field<int>(d, "shared_inter");
    m.topk = field<int>(d, "topk");
    m.first_dense = field<int>(d, "first_dense");
    m.routed_scaling_factor = field<float>(d, "routed_scaling_factor");
    m.norm_topk_prob = field<bool>(d, "norm_topk_prob");
    m.rms_eps = field<float>(d, "rms_eps");
    m.lora_eps = field<float>(d, "lora_eps");
    m.softmax_scale = field<float>(d, "softmax_scale");
    return m;
}

std::optional<DrafterSpec> parse_drafter_spec(const std::optional<nb::dict>& drafter, bool split) {
    if (!drafter) return std::nullopt;
    const nb::dict& d = *drafter;
    DrafterSpec spec{parse_drafter_dims(nb::cast<nb::dict>(d["dims"])),
                     RopeTable{nb::cast<std::vector<float>>(d["inv_freq"]), nb::cast<float>(d["attention_factor"]),
                               false},
                     nb::cast<std::vector<int>>(d["tap_layers"]), nb::cast<int>(d["window"])};
    spec.dims.own_lm_head = split;  // a split target holds only a slice of its lm_head
    return spec;
}

namespace {

std::vector<VerifyTree> parse_trees(const std::vector<int32_t>& streams, const std::vector<int32_t>& starts,
                                    const std::vector<std::vector<int32_t>>& tokens,
                                    const std::vector<std::vector<int32_t>>& parents) {
    if (starts.size() != streams.size() || tokens.size() != streams.size() || parents.size() != streams.size()) {
        throw nb::value_error("streams, starts, tokens and parents must hold one entry per tree");
    }
    std::vector<VerifyTree> trees(streams.size());
    for (size_t t = 0; t < trees.size(); ++t) trees[t] = VerifyTree{streams[t], starts[t], tokens[t], parents[t]};
    return trees;
}

}  // namespace

void bind_engine_kernels(nb::module_& kernels);

void bind_engine(nb::module_& m) {
    m.def(
        "budget_policy_choices",
        [](const std::vector<int>& candidates, const std::vector<int>& cost_streams,
           const std::vector<std::vector<double>>& cost_seconds, const std::vector<std::vector<float>>& masses,
           const std::vector<std::vector<int32_t>>& accepts, const std::vector<std::vector<int32_t>>& skip,
           const std::vector<int>& used, const std::vector<int>& live) {
            const size_t rounds = masses.size();
            if (accepts.size() != rounds || skip.size() != rounds || used.size() != rounds || live.size() != rounds) {
                throw nb::value_error("masses, accepts, skip, used and live: one entry per round");
            }
            BudgetPolicy policy(candidates, CostTable{cost_streams, cost_seconds});
            std::vector<int> out{policy.choose(live.empty() ? 1 : live[0])};
            for (size_t r = 0; r < rounds; ++r) {
                const size_t rows = accepts[r].size();
                if (skip[r].size() != rows || masses[r].size() != rows * candidates.size()) {
                    const std::string what = "round " + std::to_string(r) + ": rows x candidates masses, rows accepts";
                    throw nb::value_error(what.c_str());
                }
                policy.observe(masses[r].data(), accepts[r].data(), skip[r].data(), static_cast<int>(rows), used[r]);
                out.push_back(policy.choose(live[r]));
            }
            return out;
        },
        nb::arg("candidates"), nb::arg("cost_streams"), nb::arg("cost_seconds"), nb::arg("masses"),
        nb::arg("accepts"), nb::arg("skip"), nb::arg("used"), nb::arg("live"),
        "The auto budgets' policy (runtime/budget_policy) on the host, no device needed: its first choice for "
        "live[0] streams, then after observing each round (masses [rows * candidates], accepts, skip flags, the "
        "budget it ran at) its choice for live[r] streams. The CPU tests hold it to ddtree.reference.budget.");
    m.def(
        "shard_layout",
        [](const nb::dict& dims, int rank, int ranks) {
            const ShardLayout l = shard_layout(parse_dims(dims, rank, ranks));
            nb::dict out;
            for (const auto& [key, value] : {std::pair<const char*, int>{"heads", l.heads}, {"inter", l.inter},
                                             {"shared_inter", l.shared_inter}, {"experts", l.experts},
                                             {"vocab", l.vocab}, {"first_head", l.first_head},
                                             {"first_inter", l.first_inter},
                                             {"first_shared_inter", l.first_shared_inter},
                                             {"first_expert", l.first_expert}, {"first_token", l.first_token}}) {
                out[key] = value;
            }
            return out;
        },
        nb::arg("dims"), nb::arg("rank"), nb::arg("ranks"),
        "The share of rank `rank` of `ranks` (runtime/shard.h) as a dict of ddtree.shard.ShardLayout's fields; "
        "ValueError naming `ranks` and the config field it does not divide.");
    m.def(
        "plan_memory",
        [](const nb::dict& dims, int rank, int ranks, int held_ranks, int streams, int max_context, int budget) {
            const MemoryPlan p = Engine::plan_memory(parse_dims(dims, rank, ranks), streams, max_context, budget,
                                                     nullptr, held_ranks);
            nb::dict out;
            out["weights"] = p.weights;
            out["kv"] = p.kv;
            out["scratch"] = p.scratch;
            out["total"] = p.total();
            return out;
        },
        nb::arg("dims"), nb::arg("rank"), nb::arg("ranks"), nb::arg("held_ranks"), nb::arg("streams"),
        nb::arg("max_context"), nb::arg("budget"),
        "Device bytes (weights, kv, scratch, total) an engine of these arguments without a drafter takes, counted "
        "by the engine's own layout code without a device: the pre-flight's figures.");
    // weak-referenceable so that a test can tell that dropping the last reference frees it
    nb::class_<Engine> engine(m, "Engine", nb::is_weak_referenceable(),
                              "The engine on one GPU: decode and tree verify (see ddtree.Engine)");
    engine.def(
            "__init__",
            [](Engine* self, const nb::dict& dims, const std::vector<float>& inv_freq, float attention_factor,
               bool interleave, int streams, int max_context, int budget, int device,
               const std::optional<nb::dict>& drafter, int rank, int ranks, bool all_ranks) {
                const std::optional<DrafterSpec> spec = parse_drafter_spec(drafter, ranks > 1);
                new (self) Engine(parse_dims(dims, rank, ranks), RopeTable{inv_freq, attention_factor, interleave},
                                  streams, max_context, budget, device, spec ? &*spec : nullptr, all_ranks);
            },
            nb::arg("dims"), nb::arg("inv_freq"), nb::arg("attention_factor"), nb::arg("interleave"),
            nb::arg("streams"), nb::arg("max_context"), nb::arg("budget"), nb::arg("device"),
            nb::arg("drafter") = nb::none(), nb::arg("rank") = 0, nb::arg("ranks") = 1, nb::arg("all_ranks") = false,
            "drafter: None, or a dict of dims (ddtree.drafter_engine.drafter_dims), inv_freq, attention_factor, "
            "tap_layers (the target layers of its context) and window (0: unbounded). rank, ranks: the share of a "
            "target split over `ranks` GPUs this engine holds (ddtree.shard); all_ranks: every rank on this GPU.")
        .def_prop_ro("max_rows", &Engine::max_rows)
        .def_prop_ro("device", &Engine::device)
        .def(
            "randomize_weights",
            [](Engine& e, uint64_t seed) {
                // Each held rank its own draw, the replicated tensors included: random weights stand for no model.
                for (int rank : e.held_ranks()) e.weights(rank).randomize(seed + rank);
            },
            nb::arg("seed"), nb::call_guard<nb::gil_scoped_release>())
        .def("prefill", &Engine::prefill, nb::arg("prompts"), nb::arg("temperature"), nb::arg("seed"),
             nb::call_guard<nb::gil_scoped_release>())
        .def(
            "verify",
            [](Engine& e, const std::vector<int32_t>& streams, const std::vector<int32_t>& starts,
               const std::vector<std::vector<int32_t>>& tokens, const std::vector<std::vector<int32_t>>& parents,
               const std::vector<int>& tap_layers, bool with_routing) {
                const std::vector<VerifyTree> trees = parse_trees(streams, starts, tokens, parents);
                VerifyOutput out;
                {
                    nb::gil_scoped_release release;
                    out = e.verify(trees, tap_layers, with_routing);
                }
                const ModelDims& d = e.dims();
                const size_t rows = out.rows;
                nb::object logits = nb::cast(to_numpy(std::move(out.logits), {rows, static_cast<size_t>(d.vocab)}));
                nb::object taps = nb::cast(to_numpy(std::move(out.taps), {rows, tap_layers.size() * d.hidden}));
                nb::object routing = nb::cast(to_numpy(
                    std::move(out.routing),
                    {with_routing ? static_cast<size_t>(d.moe_layers()) : 0, rows, static_cast<size_t>(d.topk)}));
                return nb::make_tuple(logits, taps, routing);
            },
            nb::arg("streams"), nb::arg("starts"), nb::arg("tokens"), nb::arg("parents"),
            nb::arg("tap_layers") = std::vector<int>{}, nb::arg("with_routing") = false,
            "Eager verify forward of one tree per listed stream over its committed prefix of `starts` tokens: "
            "fp32 logits [nodes, vocab] (trees in order, root first), bf16 bits [nodes, taps * hidden] of the "
            "residual stream after each of tap_layers, and (with_routing) int32 [moe layers, nodes, topk] experts.")
        .def(
            "profile_verify",
            [](Engine& e, const std::vector<int32_t>& streams, const std::vector<int32_t>& starts,
               const std::vector<std::vector<int32_t>>& tokens, const std::vector<std::vector<int32_t>>& parents,
               int iters) {
                const std::vector<VerifyTree> trees = parse_trees(streams, starts, tokens, parents);
                nb::gil_scoped_release release;
                return e.profile_verify(trees, iters);
            },
            nb::arg("streams"), nb::arg("starts"), nb::arg("tokens"), nb::arg("parents"), nb::arg("iters"),
            "Device seconds per operation of that verify forward (eager, one launch at a time).")
        .def(
            "forward_logits",
            [](Engine& e, const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
               const std::vector<int32_t>& positions, bool with_routing) -> nb::object {
                std::vector<float> logits;
                std::vector<int32_t> routing;
                {
                    nb::gil_scoped_release release;
                    logits = e.forward_logits(ids, streams, positions, with_routing ? &routing : nullptr);
                }
                const ModelDims& d = e.dims();
                nb::object out = nb::cast(to_numpy(std::move(logits), {ids.size(), static_cast<size_t>(d.vocab)}));
                if (!with_routing) {
                    return out;
                }
                return nb::make_tuple(out, to_numpy(std::move(routing), {static_cast<size_t>(d.layers - d.first_dense),
                                                                         ids.size(), static_cast<size_t>(d.topk)}));
            },
            nb::arg("ids"), nb::arg("streams"), nb::arg("positions"), nb::arg("with_routing") = false,
            "Eager forward of rows -> fp32 logits [rows, vocab] (an engine holding one rank of a split target: its "
            "vocabulary columns, the others 0); with_routing also returns the experts each MoE layer chose, int32 "
            "[moe layers, rows, topk].")
        .def("randomize_cache", &Engine::randomize_cache, nb::arg("seed"), nb::call_guard<nb::gil_scoped_release>())
        .def("profile_step", &Engine::profile_step, nb::arg("streams"), nb::arg("positions"), nb::arg("iters"),
             nb::arg("temperature") = 1.0f, nb::arg("seed") = 1, nb::call_guard<nb::gil_scoped_release>(),
             "Device seconds per operation of one eager decode step, the sampler at `temperature`.")
        .def("time_collectives", &Engine::time_collectives, nb::arg("rows"), nb::arg("iters"),
             nb::call_guard<nb::gil_scoped_release>(),
             "A split target's collectives of one forward over `rows` rows (on a simulated rank: the stand-in "
             "copies and the rank-order sums), captured apart and replayed: median device seconds.");
    bind_engine_surface(engine);

    m.attr("MAX_BUDGET") = kernels::kTreeMaxBudget;
    m.attr("MAX_STOP_IDS") = kernels::kRoundMaxStopIds;

    nb::module_ kernels = nb::borrow<nb::module_>(m.attr("kernels"));
    bind_engine_kernels(kernels);
}

}  // namespace ddtree
