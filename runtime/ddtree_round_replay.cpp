// The DDTree round's captured graphs outside a generation: their names, replays from a fixed starting state (for
// profiling, and to time each (streams, budget) of the auto budgets' cost table).
#include "ddtree_round.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "tree_build.cuh"
#include "tree_rows.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

// The stream counts whose round times the auto budgets measure: 1, 2, 4, ... below n, and n.
std::vector<int> measured_streams(int n) {
    std::vector<int> out;
    for (int m = 1; m < n; m *= 2) out.push_back(m);
    out.push_back(n);
    return out;
}

}  // namespace

std::string DdtreeRound::graph_name(const RoundKey& key) {
    std::string probe;
    for (int i = 0; i < k::kProbeMaxBudgets && key.probe[i] != 0; ++i) {
        probe += (i == 0 ? " probe=" : ",") + std::to_string(key.probe[i]);
    }
    return "round streams=" + std::to_string(key.streams) + " budget=" + std::to_string(key.budget) +
           " depth=" + std::to_string(key.depth_limit) + " width=" + std::to_string(key.width) +
           " span=" + std::to_string(key.span) + " draft_span=" + std::to_string(key.draft_span) +
           (key.oracle ? " oracle" : "") + probe;
}

std::vector<CapturedGraph> DdtreeRound::graphs() const { return list_graphs(graphs_, graph_name); }

CostTable DdtreeRound::measure_costs(const RoundRequest& r, const RoundKey& base) {
    CostTable table;
    table.streams = measured_streams(static_cast<int>(r.prompts.size()));
    bool prefilled = false;  // the replays start from the request's prefill, made at the first key not yet timed
    for (const int m : table.streams) {
        std::vector<double> row;
        for (const int budget : r.auto_budgets) {
            RoundKey key = base;
            key.streams = m;
            key.budget = budget;
            auto found = costs_.find(key);
            if (found == costs_.end()) {
                if (!prefilled) start_streams(r);
                prefilled = true;
                found = costs_.emplace(key, time_round(key)).first;
            }
            row.push_back(found->second);
        }
        table.seconds.push_back(std::move(row));
    }
    if (prefilled) model_.clear_nonfinite();  // the replays' probe rows are no generation's
    return table;
}

double DdtreeRound::time_round(const RoundKey& key) {
    const cudaGraphExec_t exec = graphs_.get(key, model_.stream(), [&] { record_round(key, nullptr); });
    std::vector<double> seconds;
    replay_key(key, exec, 3, true, &seconds);
    return median(std::move(seconds));
}

bool DdtreeRound::replay(const std::string& name, int n, bool warmup, std::vector<double>* seconds) {
    const auto found = find_graph(graphs_, name, graph_name);
    if (!found) return false;
    const auto [key, exec] = *found;
    replay_key(key, exec, n, warmup, seconds);
    return true;
}

void DdtreeRound::replay_key(const RoundKey& key, cudaGraphExec_t exec, int n, bool warmup,
                             std::vector<double>* seconds) {
    const std::string name = graph_name(key);
    // The committed length every replay starts at: its nodes' keys (start + depth + 1) within the attention span,
    // the drafter's context within its span (keys of the generation, when below the drafter cache's capacity) and
    // every position within max_context.
    int keys = std::min(key.span, cache_.max_context());
    if (has_drafter() && key.draft_span < drafter_.model->cache().capacity()) keys = std::min(keys, key.draft_span);
    const int start = keys - key.depth_limit - 1;
    if (start < 1) throw std::logic_error("replay: graph '" + name + "' spans too few keys for a round");
    const int m = key.streams;
    const std::vector<int32_t> bonus = probe_ids(m, model_.dims().vocab);
    std::vector<int32_t> host(6 * static_cast<size_t>(m));  // start, count, rounds, base, id, finished
    for (int i = 0; i < m; ++i) {
        host[i] = start;
        host[m + i] = 1;
        host[2 * m + i] = 0;
        host[3 * m + i] = cache_.stream_base(i);
        host[4 * m + i] = i;
        host[5 * m + i] = 0;
    }
    std::vector<int32_t> limits(k::kRoundLimitsInts, 0);
    limits[0] = state_.history_ld;  // no stream finishes: no token count reached, no stop ids
    cudaStream_t s = model_.stream();
    const size_t bytes = static_cast<size_t>(m) * sizeof(int32_t);
    for (auto [array, at] : {std::pair{state_.start, 0}, {state_.count, 1}, {state_.rounds, 2},
                             {state_.stream_base, 3}, {state_.stream_ids, 4}, {state_.finished, 5}}) {
        CUDA_CHECK(cudaMemcpyAsync(array, host.data() + at * m, bytes, cudaMemcpyHostToDevice, s));
    }
    CUDA_CHECK(cudaMemcpyAsync(state_.bonus, bonus.data(), bytes, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(state_.limits, limits.data(), limits.size() * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));  // the host vectors are this call's
    const SavedState saved({{state_.start, bytes},
                            {state_.bonus, bytes},
                            {state_.count, bytes},
                            {state_.rounds, bytes},
                            {state_.stream_base, bytes},
                            {state_.stream_ids, bytes},
                            {state_.finished, bytes},
                            {state_.limits, limits.size() * 4}},
                           s);
    *seconds = time_replays(exec, s, n, warmup, saved);
}

}  // namespace ddtree
