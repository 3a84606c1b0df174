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

// By field name: a dict built from config.json (ddtree.engine.engine_dims).
ModelDims parse_dims(const nb::dict& d, int rank = 0, int ranks = 1) {
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
    nb::class_<Engine>(m, "Engine", nb::is_weak_referenceable(),
                       "The engine on one GPU: decode and tree verify (see ddtree.Engine)")
        .def(
            "__init__",
            [](Engine* self, const nb::dict& dims, const std::vector<float>& inv_freq, float attention_factor,
               bool interleave, int streams, int max_context, int budget, int device,
               const std::optional<nb::dict>& drafter, int rank, int ranks, bool all_ranks) {
                std::optional<DrafterSpec> spec;
                if (drafter) {
                    const nb::dict& d = *drafter;
                    spec = DrafterSpec{parse_drafter_dims(nb::cast<nb::dict>(d["dims"])),
                                       RopeTable{nb::cast<std::vector<float>>(d["inv_freq"]),
                                                 nb::cast<float>(d["attention_factor"]), false},
                                       nb::cast<std::vector<int>>(d["tap_layers"]), nb::cast<int>(d["window"])};
                    spec->dims.own_lm_head = ranks > 1;  // a split target holds only a slice of its lm_head
                }
                new (self) Engine(parse_dims(dims, rank, ranks), RopeTable{inv_freq, attention_factor, interleave},
                                  streams, max_context, budget, device, spec ? &*spec : nullptr, all_ranks);
            },
            nb::arg("dims"), nb::arg("inv_freq"), nb::arg("attention_factor"), nb::arg("interleave"),
            nb::arg("streams"), nb::arg("max_context"), nb::arg("budget"), nb::arg("device"),
            nb::arg("drafter") = nb::none(), nb::arg("rank") = 0, nb::arg("ranks") = 1, nb::arg("all_ranks") = false,
            "drafter: None, or a dict of dims (ddtree.drafter_engine.drafter_dims), inv_freq, attention_factor, "
            "tap_layers (the target layers of its context) and window (0: unbounded). rank, ranks: the share of a "
            "target split over `ranks` GPUs this engine holds (ddtree.shard); all_ranks: every rank on this GPU.")
        .def_prop_ro("held_ranks", &Engine::held_ranks)
        .def_prop_ro("has_drafter", &Engine::has_drafter)
        .def_prop_ro("streams", &Engine::streams)
        .def_prop_ro("max_context", &Engine::max_context)
        .def_prop_ro("budget", &Engine::max_budget)
        .def_prop_ro("max_rows", &Engine::max_rows)
        .def_prop_ro("device", &Engine::device)
        .def(
            "upload",
            [](Engine& e, const std::string& name, HostArray a, int rank) { upload_host(e.weights(rank), name, a); },
            nb::arg("name"), nb::arg("array"), nb::arg("rank") = 0,
            "Copy one tensor (name without the weight prefix; a split target's: held rank `rank`'s slice, "
            "ddtree.shard) to the device.")
        .def(
            "upload_expert",
            [](Engine& e, int layer, int expert, HostArray gp, HostArray gs, HostArray up, HostArray us, HostArray dp,
               HostArray ds, int rank) {
                // compressed-tensors layout: packed [out, in / 8] int32, scale [out, in / 32] bf16 bits
                const ModelDims& d = e.dims();
                const int64_t inter = d.moe_inter, hidden = d.hidden;
                auto projection = [](const HostArray& packed, const HostArray& scale, const char* packed_name,
                                     const char* scale_name, int64_t out, int64_t in) {
                    return host_int4_projection(packed, scale, packed_name, scale_name, {out, in / 8}, {out, in / 32});
                };
                const auto [gp_p, gs_p] = projection(gp, gs, "gate_packed", "gate_scale", inter, hidden);
                const auto [up_p, us_p] = projection(up, us, "up_packed", "up_scale", inter, hidden);
                const auto [dp_p, ds_p] = projection(dp, ds, "down_packed", "down_scale", hidden, inter);
                Weights& weights = e.weights(rank);
                nb::gil_scoped_release release;
                weights.upload_expert(layer, expert, gp_p, gs_p, up_p, us_p, dp_p, ds_p);
            },
            nb::arg("layer"), nb::arg("expert"), nb::arg("gate_packed"), nb::arg("gate_scale"), nb::arg("up_packed"),
            nb::arg("up_scale"), nb::arg("down_packed"), nb::arg("down_scale"), nb::arg("rank") = 0)
        .def(
            "upload_drafter",
            [](Engine& e, const std::string& name, HostArray a) { upload_host(e.drafter_weights(), name, a); },
            nb::arg("name"), nb::arg("array"), "Copy one drafter tensor (its checkpoint name) to the device.")
        .def("randomize_drafter", [](Engine& e, uint64_t seed) { e.drafter_weights().randomize(seed); },
             nb::arg("seed"), nb::call_guard<nb::gil_scoped_release>())
        .def("drafter_missing", [](Engine& e) { return e.drafter_weights().missing(); })
        .def(
            "randomize_weights",
            [](Engine& e, uint64_t seed) {
                // Each held rank its own draw, the replicated tensors included: random weights stand for no model.
                for (int rank : e.held_ranks()) e.weights(rank).randomize(seed + rank);
            },
            nb::arg("seed"), nb::call_guard<nb::gil_scoped_release>())
        .def(
            "missing",
            [](Engine& e) {
                for (int rank : e.held_ranks()) {
                    if (std::string m = e.weights(rank).missing(); !m.empty()) return m;
                }
                return std::string();
            })
        .def("prefill", &Engine::prefill, nb::arg("prompts"), nb::arg("temperature"), nb::arg("seed"),
             nb::call_guard<nb::gil_scoped_release>())
        .def(
            "generate",
            [](Engine& e, const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
               uint64_t seed) {
                Generation g;
                {
                    nb::gil_scoped_release release;
                    g = e.generate(prompts, max_new_tokens, temperature, seed);
                }
                return nb::make_tuple(g.tokens, g.prefill_seconds, g.decode_seconds);
            },
            nb::arg("prompts"), nb::arg("max_new_tokens"), nb::arg("temperature"), nb::arg("seed"),
            "Prefill and decode in one call: ([prompts][max_new_tokens] tokens, prefill seconds, decode seconds), "
            "device time.")
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
            "generate_ddtree",
            [](Engine& e, const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
               uint64_t seed, int budget, const std::vector<int32_t>& stop_ids, bool profile,
               const std::optional<std::vector<std::vector<int32_t>>>& reference,
               const std::optional<std::vector<float>>& hit, uint64_t oracle_seed, int depth_limit, int width,
               const std::vector<int>& auto_budgets, const std::vector<int>& cost_streams,
               const std::vector<std::vector<double>>& cost_seconds) {
                if (reference.has_value() != hit.has_value()) {
                    throw nb::value_error("reference and hit: the oracle needs both (or neither)");
                }
                OracleRequest oracle;
                RoundRequest r;
                r.prompts = prompts;
                r.max_new_tokens = max_new_tokens;
                r.temperature = temperature;
                r.seed = seed;
                r.budget = budget;
                r.stop_ids = stop_ids;
                r.profile = profile;
                r.depth_limit = depth_limit;
                r.width = width;
                r.auto_budgets = auto_budgets;
                r.costs = CostTable{cost_streams, cost_seconds};
                if (reference) {
                    oracle = OracleRequest{*reference, *hit, oracle_seed};
                    r.oracle = &oracle;
                }
                TreeGeneration g;
                {
                    nb::gil_scoped_release release;
                    g = e.generate_ddtree(r);
                }
                nb::dict out;
                out["tokens"] = nb::cast(g.tokens);
                out["accept_lengths"] = nb::cast(g.accept_lengths);
                out["rounds"] = nb::cast(g.rounds);
                out["prefill_seconds"] = nb::cast(g.prefill_seconds);
                out["decode_seconds"] = nb::cast(g.decode_seconds);
                out["host_seconds_per_round"] = nb::cast(g.host_seconds_per_round);
                out["stages"] = nb::cast(g.stages);
                out["budgets"] = nb::cast(g.budgets);
                out["cost_streams"] = nb::cast(g.costs.streams);
                out["cost_seconds"] = nb::cast(g.costs.seconds);
                return out;
            },
            nb::arg("prompts"), nb::arg("max_new_tokens"), nb::arg("temperature"), nb::arg("seed"), nb::arg("budget"),
            nb::arg("stop_ids") = std::vector<int32_t>{}, nb::arg("profile") = false,
            nb::arg("reference") = nb::none(), nb::arg("hit") = nb::none(), nb::arg("oracle_seed") = 0,
            nb::arg("depth_limit") = 0, nb::arg("width") = 0, nb::arg("auto_budgets") = std::vector<int>{},
            nb::arg("cost_streams") = std::vector<int>{},
            nb::arg("cost_seconds") = std::vector<std::vector<double>>{},
            "DDTree generation on the GPU with the engine's drafter. With reference and hit, an oracle replaces the "
            "drafter's candidates (tests and benchmarks only): at depth d the stream's `reference` continuation is "
            "a candidate with probability hit[d - 1]; an engine without a drafter then takes depth_limit and width "
            "(candidates per depth). With a drafter, width 0 is min(budget, vocab); width 1 at budget block - 1 "
            "verifies the drafter's chain of top-1 tokens. profile: eager rounds with per-stage device time. "
            "auto_budgets "
            "(ascending candidates): each round's budget chosen among them by the cost-aware policy (budget is then "
            "ignored), from the round times cost_seconds [len(cost_streams)][candidates] at cost_streams (1, ...), or "
            "measured by replays when none are given. Returns a dict: tokens "
            "[prompts][<= max_new_tokens], accept_lengths per round, rounds, prefill_seconds, decode_seconds, "
            "host_seconds_per_round, stages [(name, seconds summed over rounds)], budgets (each round's), "
            "cost_streams and cost_seconds (the auto budgets' table; empty otherwise).")
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
            "Eager forward of rows -> fp32 logits [rows, vocab]; with_routing also returns the experts each MoE "
            "layer chose, int32 [moe layers, rows, topk].")
        .def("randomize_cache", &Engine::randomize_cache, nb::arg("seed"), nb::call_guard<nb::gil_scoped_release>())
        .def("time_decode", &Engine::time_decode, nb::arg("streams"), nb::arg("positions"), nb::arg("iters"),
             nb::arg("temperature") = 1.0f, nb::arg("seed") = 1, nb::call_guard<nb::gil_scoped_release>(),
             "Device and host seconds per replayed decode step. Tokens are sampled at `temperature` (default 1): "
             "greedy decoding of random weights can settle on a few tokens, and the routed work per step would "
             "then follow tiny numeric differences.")
        .def("profile_step", &Engine::profile_step, nb::arg("streams"), nb::arg("positions"), nb::arg("iters"),
             nb::arg("temperature") = 1.0f, nb::arg("seed") = 1, nb::call_guard<nb::gil_scoped_release>(),
             "Device seconds per operation of one eager decode step, the sampler at `temperature`.")
        .def(
            "graphs",
            [](const Engine& e) {
                std::vector<std::pair<std::string, size_t>> out;
                for (const CapturedGraph& g : e.graphs()) out.emplace_back(g.name, g.nodes);
                return out;
            },
            "The captured CUDA graphs as (name, node count): decode steps 'ar streams=N span=S', then DDTree rounds "
            "'round streams=N budget=B depth=D width=W span=S draft_span=T' (+ ' oracle').")
        .def("replay", &Engine::replay, nb::arg("name"), nb::arg("n"), nb::arg("warmup") = true,
             nb::call_guard<nb::gil_scoped_release>(),
             "Device seconds of each of n replays of the captured graph `name` on the engine's stream (CUDA events "
             "around each; the state every replay starts from is put back before it, untimed), after one untimed "
             "warm-up replay when `warmup`. The timed replays sit in the NVTX range 'replay'.");

    m.attr("MAX_BUDGET") = kernels::kTreeMaxBudget;
    m.attr("MAX_STOP_IDS") = kernels::kRoundMaxStopIds;

    nb::module_ kernels = nb::borrow<nb::module_>(m.attr("kernels"));
    bind_engine_kernels(kernels);
}

}  // namespace ddtree
