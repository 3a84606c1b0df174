// The weight uploads, generation and graph entry points ddtree.Engine's facade calls, bound alike on the one-GPU engine
// (_native.Engine) and the multi-GPU one (_native.MultiGpuEngine): one definition, so the two cannot drift apart;
// and the argument parsing of both constructors. g++-built binding code only.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddtree_round.h"
#include "engine.h"
#include "graph_replay.h"
#include "multi_gpu_engine.h"
#include "tensor_args.h"

namespace ddtree {

// By field name: a dict built from config.json (ddtree.engine.engine_dims), holding rank `rank` of `ranks`.
ModelDims parse_dims(const nanobind::dict& d, int rank = 0, int ranks = 1);
// None, or a dict of dims (ddtree.drafter_engine.drafter_dims), inv_freq, attention_factor, tap_layers and window;
// `split`: beside a split target, whose lm_head slice it cannot borrow.
std::optional<DrafterSpec> parse_drafter_spec(const std::optional<nanobind::dict>& drafter, bool split);

// Held rank `rank`'s weights (std::invalid_argument naming `rank` when not held).
inline Weights& held_weights(Engine& e, int rank) { return e.weights(rank); }
inline Weights& held_weights(MultiGpuEngine& e, int rank) { return e.rank(rank).weights(rank); }
// Every copy of the drafter's weights: one per GPU.
inline void upload_drafter_tensor(Engine& e, const std::string& name, HostArray a) {
    upload_host(e.drafter_weights(), name, a);
}
inline void upload_drafter_tensor(MultiGpuEngine& e, const std::string& name, HostArray a) {
    for (int r = 0; r < e.ranks(); ++r) upload_host(e.rank(r).drafter_weights(), name, a);
}

template <typename E>
void bind_engine_surface(nanobind::class_<E>& c) {
    namespace nb = nanobind;
    c
        .def_prop_ro("held_ranks", &E::held_ranks)
        .def_prop_ro("has_drafter", &E::has_drafter)
        .def_prop_ro("streams", &E::streams)
        .def_prop_ro("max_context", &E::max_context)
        .def_prop_ro("budget", &E::max_budget)
        .def("missing", &E::missing, "The first target tensor not uploaded yet (\"\" when complete).")
        .def(
            "upload_drafter", [](E& e, const std::string& name, HostArray a) { upload_drafter_tensor(e, name, a); },
            nb::arg("name"), nb::arg("array"),
             "Copy one drafter tensor (its checkpoint name) to the device (to every device of a split engine).")
        .def("randomize_drafter", &E::randomize_drafter, nb::arg("seed"), nb::call_guard<nb::gil_scoped_release>())
        .def("drafter_missing", [](E& e) { return e.drafter_weights().missing(); })
        .def(
            "upload",
            [](E& e, const std::string& name, HostArray a, int rank) { upload_host(held_weights(e, rank), name, a); },
            nb::arg("name"), nb::arg("array"), nb::arg("rank") = 0,
            "Copy one tensor (name without the weight prefix; a split target's: held rank `rank`'s slice, "
            "ddtree.shard) to the device.")
        .def(
            "upload_expert",
            [](E& e, int layer, int expert, HostArray gp, HostArray gs, HostArray up, HostArray us, HostArray dp,
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
                Weights& weights = held_weights(e, rank);
                nb::gil_scoped_release release;
                weights.upload_expert(layer, expert, gp_p, gs_p, up_p, us_p, dp_p, ds_p);
            },
            nb::arg("layer"), nb::arg("expert"), nb::arg("gate_packed"), nb::arg("gate_scale"), nb::arg("up_packed"),
            nb::arg("up_scale"), nb::arg("down_packed"), nb::arg("down_scale"), nb::arg("rank") = 0)
        .def(
            "generate",
            [](E& e, const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
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
            "generate_ddtree",
            [](E& e, const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
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
        .def("time_decode", &E::time_decode, nb::arg("streams"), nb::arg("positions"), nb::arg("iters"),
             nb::arg("temperature") = 1.0f, nb::arg("seed") = 1, nb::call_guard<nb::gil_scoped_release>(),
             "Device and host seconds per replayed decode step. Tokens are sampled at `temperature` (default 1): "
             "greedy decoding of random weights can settle on a few tokens, and the routed work per step would "
             "then follow tiny numeric differences.")
        .def(
            "graphs",
            [](const E& e) {
                std::vector<std::pair<std::string, size_t>> out;
                for (const CapturedGraph& g : e.graphs()) out.emplace_back(g.name, g.nodes);
                return out;
            },
            "The captured CUDA graphs as (name, node count): decode steps 'ar streams=N span=S', then DDTree rounds "
            "'round streams=N budget=B depth=D width=W span=S draft_span=T' (+ ' oracle').")
        .def("replay", &E::replay, nb::arg("name"), nb::arg("n"), nb::arg("warmup") = true,
             nb::call_guard<nb::gil_scoped_release>(),
             "Device seconds of each of n replays of the captured graph `name` on the engine's stream (CUDA events "
             "around each; the state every replay starts from is put back before it, untimed), after one untimed "
             "warm-up replay when `warmup`. The timed replays sit in the NVTX range 'replay'.");
}

}  // namespace ddtree
