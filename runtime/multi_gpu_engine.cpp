#include "multi_gpu_engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "shard.h"

namespace ddtree {

namespace {

// std::runtime_error naming the first rank whose stream tokens differ from rank 0's: the ranks' picks are
// replicated, so a difference means their inputs or collectives diverged.
void check_same_tokens(const std::vector<std::vector<std::vector<int32_t>>>& tokens, const char* what) {
    for (size_t r = 1; r < tokens.size(); ++r) {
        for (size_t s = 0; s < tokens[0].size(); ++s) {
            if (s >= tokens[r].size() || tokens[r][s] != tokens[0][s]) {
                throw std::runtime_error(std::string(what) + ": rank " + std::to_string(r) + " generated other " +
                                         "tokens than rank 0 for stream " + std::to_string(s) +
                                         " (the ranks diverged)");
            }
        }
    }
}

}  // namespace

MultiGpuEngine::MultiGpuEngine(const ModelDims& dims, const RopeTable& rope, int streams, int max_context,
                               int max_budget, const std::vector<int>& devices, const std::string& nccl_library,
                               const DrafterSpec* drafter)
    : devices_(devices), comms_(nccl::Library::open(nccl_library), devices), workers_(devices),
      engines_(devices.size()) {
    const int ranks = static_cast<int>(devices.size());
    ModelDims whole = dims;
    whole.shard = Shard{0, ranks};
    check_shard(whole);  // on the caller: the same refusal for every rank
    std::vector<DrafterSpec> specs;
    if (drafter != nullptr) {
        specs.assign(devices.size(), *drafter);
        for (DrafterSpec& s : specs) s.dims.own_lm_head = ranks > 1;
    }
    try {
        workers_.run(
            [&](int r) {
                ModelDims d = dims;
                d.shard = Shard{r, ranks};
                const NcclRank self = comms_.rank(r);
                engines_[r] = std::make_unique<Engine>(d, rope, streams, max_context, max_budget, devices[r],
                                                       drafter != nullptr ? &specs[r] : nullptr, false,
                                                       ranks > 1 ? &self : nullptr);
            },
            false);  // no collective in an engine's creation
    } catch (...) {
        workers_.run([&](int r) { engines_[r].reset(); }, false);  // each freed on its own device
        throw;
    }
}

MultiGpuEngine::~MultiGpuEngine() {
    try {
        workers_.run([&](int r) { engines_[r].reset(); }, false);  // each freed on its own device and thread
    } catch (...) {  // a destructor reports nothing; what is left goes with the process's contexts
    }
    if (workers_.abandoned()) {  // ranks blocked in a collective for good: leave their engines and communicators
        for (auto& e : engines_) static_cast<void>(e.release());
        comms_.abandon();
    }
}

Engine& MultiGpuEngine::rank(int r) {
    if (r < 0 || r >= ranks()) {
        throw std::invalid_argument("rank " + std::to_string(r) + " is outside 0.." + std::to_string(ranks() - 1));
    }
    return *engines_[r];
}

void MultiGpuEngine::on_every_rank(const std::function<void(int, Engine&)>& job, bool collectives) {
    workers_.run([&](int r) { job(r, *engines_[r]); }, collectives);
}

void MultiGpuEngine::randomize_weights(uint64_t seed) {
    on_every_rank([&](int r, Engine& e) { e.weights(r).randomize(seed + r); }, false);
    on_every_rank(
        [&](int r, Engine& e) {
            if (r > 0) e.weights(r).copy_replicated_from(engines_[0]->weights(0));
        },
        false);
}

void MultiGpuEngine::randomize_drafter(uint64_t seed) {
    on_every_rank([&](int, Engine& e) { e.drafter_weights().randomize(seed); }, false);
}

Generation MultiGpuEngine::generate(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens,
                                    float temperature, uint64_t seed) {
    std::vector<Generation> out(ranks());
    on_every_rank([&](int r, Engine& e) { out[r] = e.generate(prompts, max_new_tokens, temperature, seed); });
    std::vector<std::vector<std::vector<int32_t>>> tokens;
    for (const Generation& g : out) tokens.push_back(g.tokens);
    check_same_tokens(tokens, "generate");
    return out[0];
}

TreeGeneration MultiGpuEngine::generate_ddtree(RoundRequest request) {
    if (!request.auto_budgets.empty() && request.costs.streams.empty() && request.max_new_tokens > 1) {
        // Measured times differ between GPUs; budgets chosen from different tables would differ, and so would the
        // ranks' round graphs. Every rank measures (its replays hold collectives) and all take the slowest time.
        std::vector<CostTable> tables(ranks());
        on_every_rank([&](int r, Engine& e) { tables[r] = e.round_costs(request); });
        CostTable agreed = tables[0];
        for (const CostTable& t : tables) {
            for (size_t i = 0; i < agreed.seconds.size(); ++i) {
                for (size_t c = 0; c < agreed.seconds[i].size(); ++c) {
                    agreed.seconds[i][c] = std::max(agreed.seconds[i][c], t.seconds.at(i).at(c));
                }
            }
        }
        request.costs = agreed;
    }
    std::vector<TreeGeneration> out(ranks());
    on_every_rank([&](int r, Engine& e) { out[r] = e.generate_ddtree(request); });
    std::vector<std::vector<std::vector<int32_t>>> tokens;
    for (const TreeGeneration& g : out) tokens.push_back(g.tokens);
    check_same_tokens(tokens, "generate_ddtree");
    for (int r = 1; r < ranks(); ++r) {
        if (out[r].budgets != out[0].budgets) {
            throw std::runtime_error("generate_ddtree: rank " + std::to_string(r) +
                                     " chose other budgets than rank 0 (the ranks diverged)");
        }
    }
    return out[0];
}

std::vector<float> MultiGpuEngine::forward_logits(const std::vector<int32_t>& ids,
                                                  const std::vector<int32_t>& streams,
                                                  const std::vector<int32_t>& positions) {
    std::vector<std::vector<float>> slices(ranks());
    on_every_rank([&](int r, Engine& e) { slices[r] = e.forward_logits(ids, streams, positions); });
    const int vocab = engines_[0]->dims().vocab;
    std::vector<float> out(slices[0].size());
    for (int r = 0; r < ranks(); ++r) {
        const ShardLayout l = shard_layout(engines_[r]->dims());
        for (size_t row = 0; row < ids.size(); ++row) {
            const float* from = slices[r].data() + row * vocab + l.first_token;
            std::copy(from, from + l.vocab, out.data() + row * vocab + l.first_token);
        }
    }
    return out;
}

std::pair<double, double> MultiGpuEngine::time_decode(int n, const std::vector<int32_t>& positions, int iters,
                                                      float temperature, uint64_t seed) {
    std::vector<std::pair<double, double>> times(ranks());
    on_every_rank([&](int r, Engine& e) { times[r] = e.time_decode(n, positions, iters, temperature, seed); });
    std::pair<double, double> slowest{0.0, 0.0};
    for (const auto& [device, host] : times) slowest = {std::max(slowest.first, device), std::max(slowest.second, host)};
    return slowest;
}

std::vector<CapturedGraph> MultiGpuEngine::graphs() const { return engines_[0]->graphs(); }

std::vector<double> MultiGpuEngine::replay(const std::string& name, int n, bool warmup) {
    std::vector<std::vector<double>> seconds(ranks());
    on_every_rank([&](int r, Engine& e) { seconds[r] = e.replay(name, n, warmup); });
    std::vector<double> slowest = seconds[0];
    for (const auto& s : seconds) {
        for (size_t i = 0; i < slowest.size(); ++i) slowest[i] = std::max(slowest[i], s[i]);
    }
    return slowest;
}

}  // namespace ddtree
