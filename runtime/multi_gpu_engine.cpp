#include "multi_gpu_engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "shard.h"

namespace ddtree {

namespace {

// std::runtime_error naming the first rank whose tokens differ from rank 0's (and the first stream that does): the
// ranks' picks are replicated, so a difference means their inputs or collectives diverged.
template <typename Result>
void check_same_tokens(const std::vector<Result>& out, const char* what) {
    const auto& want = out[0].tokens;
    for (size_t r = 1; r < out.size(); ++r) {
        const auto& got = out[r].tokens;
        if (got == want) continue;
        size_t s = 0;
        while (s < want.size() && s < got.size() && got[s] == want[s]) ++s;
        throw std::runtime_error(std::string(what) + ": rank " + std::to_string(r) + " generated other tokens than " +
                                 "rank 0 for stream " + std::to_string(s) + " (the ranks diverged)");
    }
}

// into[i] = the larger of into[i] and other[i]: the slowest rank's time of each entry.
void keep_slowest(std::vector<double>& into, const std::vector<double>& other) {
    for (size_t i = 0; i < into.size(); ++i) into[i] = std::max(into[i], other.at(i));
}

}  // namespace

MultiGpuEngine::MultiGpuEngine(const ModelDims& dims, const RopeTable& rope, int streams, int max_context,
                               int max_budget, const std::vector<int>& devices, const std::string& nccl_library,
                               const DrafterSpec* drafter)
    : devices_(devices), ranks_(nccl::Library::open(nccl_library), devices), engines_(devices.size()) {
    const int ranks = static_cast<int>(devices.size());
    try {
        ranks_.workers.run(
            [&](int r) {
                ModelDims d = dims;
                d.shard = Shard{r, ranks};
                const NcclRank self = ranks_.comms.rank(r);
                engines_[r] = std::make_unique<Engine>(d, rope, streams, max_context, max_budget, devices[r], drafter,
                                                       false, ranks > 1 ? &self : nullptr);
            },
            false);  // no collective in an engine's creation
    } catch (...) {
        ranks_.workers.run([&](int r) { engines_[r].reset(); }, false);  // each freed on its own device
        throw;
    }
}

MultiGpuEngine::~MultiGpuEngine() {
    try {
        ranks_.workers.run([&](int r) { engines_[r].reset(); }, false);  // each freed on its own device and thread
    } catch (...) {  // a destructor reports nothing; what is left goes with the process's contexts
    }
    // ranks blocked in a collective for good: their engines go to the process's exit (ranks_, the communicators)
    if (ranks_.workers.abandoned()) {
        for (auto& e : engines_) static_cast<void>(e.release());
    }
}

Engine& MultiGpuEngine::rank(int r) {
    if (r < 0 || r >= ranks()) {
        throw std::invalid_argument("rank " + std::to_string(r) + " is outside 0.." + std::to_string(ranks() - 1));
    }
    return *engines_[r];
}

void MultiGpuEngine::on_every_rank(const std::function<void(int, Engine&)>& job, bool collectives) {
    ranks_.workers.run([&](int r) { job(r, *engines_[r]); }, collectives);
}

void MultiGpuEngine::randomize_weights(uint64_t seed) {
    on_every_rank([&](int r, Engine& e) { e.weights(r).randomize(seed + r); }, false);
    on_every_rank(
        [&](int r, Engine& e) {
            if (r > 0) e.weights(r).copy_replicated_from(engines_[0]->weights(0));
        },
        false);
}

std::vector<int> MultiGpuEngine::held_ranks() const {
    std::vector<int> ranks(engines_.size());
    for (size_t r = 0; r < ranks.size(); ++r) ranks[r] = static_cast<int>(r);
    return ranks;
}

std::string MultiGpuEngine::missing() {
    for (const auto& e : engines_) {
        if (std::string m = e->missing(); !m.empty()) return m;
    }
    return std::string();
}

void MultiGpuEngine::randomize_drafter(uint64_t seed) {
    on_every_rank([&](int, Engine& e) { e.randomize_drafter(seed); }, false);
}

Generation MultiGpuEngine::generate(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens,
                                    float temperature, uint64_t seed) {
    std::vector<Generation> out(ranks());
    on_every_rank([&](int r, Engine& e) { out[r] = e.generate(prompts, max_new_tokens, temperature, seed); });
    check_same_tokens(out, "generate");
    return out[0];
}

TreeGeneration MultiGpuEngine::generate_ddtree(RoundRequest request) {
    if (request.measures_costs()) {
        // Measured times differ between GPUs; budgets chosen from different tables would differ, and so would the
        // ranks' round graphs. Every rank measures (its replays hold collectives) and all take the slowest time.
        std::vector<CostTable> tables(ranks());
        on_every_rank([&](int r, Engine& e) { tables[r] = e.round_costs(request); });
        CostTable agreed = tables[0];
        for (const CostTable& t : tables) {
            for (size_t i = 0; i < agreed.seconds.size(); ++i) keep_slowest(agreed.seconds[i], t.seconds.at(i));
        }
        request.costs = agreed;
    }
    std::vector<TreeGeneration> out(ranks());
    on_every_rank([&](int r, Engine& e) { out[r] = e.generate_ddtree(request); });
    check_same_tokens(out, "generate_ddtree");
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
    for (const auto& s : seconds) keep_slowest(slowest, s);
    return slowest;
}

}  // namespace ddtree
