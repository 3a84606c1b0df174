#include "engine.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "cuda_check.h"
#include "mla_attn.cuh"
#include "collective_slots.h"
#include "rmsnorm.cuh"
#include "router.cuh"
#include "shard.h"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

constexpr size_t kHeadroomBytes = size_t{1} << 30;

// No iostreams in the runtime: a host process can carry a second libstdc++ whose locale facets clash with ours
// (seen on the GPU image: an ostringstream crashed inside codecvt), so messages use snprintf.
std::string gib(size_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
    return text;
}

// A stream's round history: max_context tokens, and room for a last round's tokens past the end.
int round_history(int max_context) { return max_context + k::kTreeMaxDepth + 1; }

// Tree slots after each stream's context: one tree, and the last round's tokens past max_context of a stream
// that finished while the others go on (a finished stream's trees are verified at its final length).
int tree_slots(int max_budget) { return max_budget > 0 ? max_budget + 1 + k::kTreeMaxDepth : 1; }

int draft_capacity(const DrafterSpec& d, int max_context) { return d.window > 0 ? d.window : max_context; }

void check_drafter(const DrafterSpec& d, const ModelDims& target, int max_context, int max_budget) {
    auto fail = [](const std::string& what) { throw std::invalid_argument("drafter: " + what); };
    if (d.dims.hidden != target.hidden || d.dims.vocab != target.vocab) {
        fail("hidden_size/vocab_size " + std::to_string(d.dims.hidden) + "/" + std::to_string(d.dims.vocab) +
             " differ from the target's " + std::to_string(target.hidden) + "/" + std::to_string(target.vocab));
    }
    if (d.dims.block < 2 || d.dims.block - 1 > k::kTreeMaxDepth) {
        fail("block_size must be in 2.." + std::to_string(k::kTreeMaxDepth + 1) + " (trees of depth block - 1), got " +
             std::to_string(d.dims.block));
    }
    if (static_cast<int>(d.tap_layers.size()) != d.dims.taps) fail("one target layer per tap expected");
    for (size_t t = 0; t < d.tap_layers.size(); ++t) {
        if (d.tap_layers[t] < 0 || d.tap_layers[t] >= target.layers || (t > 0 && d.tap_layers[t] <= d.tap_layers[t - 1])) {
            fail("target_layer_ids must be increasing layer indices in 0.." + std::to_string(target.layers - 1));
        }
    }
    if (d.window != 0 && (d.window < d.dims.block || d.window > max_context)) {
        fail("window must be in " + std::to_string(d.dims.block) + " (block_size)..max_context, got " +
             std::to_string(d.window));
    }
    if (max_budget < 1) fail("a drafter needs a budget of at least 1");
}

int forward_rows(int streams, int max_budget) {
    return static_cast<int>(std::max<int64_t>(static_cast<int64_t>(streams) * (max_budget + 1),
                                              ArDecoder::kPrefillRows));
}

// A rank's dense MLP and shared expert widths are the GEMMs' K and (twice) their fused SiLU N: multiples of 8.
void check_rank_widths(const ModelDims& d) {
    if (!d.sharded()) return;
    for (const auto& [field, width, present] :
         {std::tuple<const char*, int, bool>{"intermediate_size", d.rank_inter(), d.first_dense > 0},
          {"moe_intermediate_size", d.rank_shared_inter(), d.layers > d.first_dense}}) {
        if (present && width % 8 != 0) {
            throw std::invalid_argument("ranks " + std::to_string(d.shard.ranks) + " leaves " + std::to_string(width) +
                                        " columns of the config's " + field +
                                        " per rank: the GEMM kernels take multiples of 8; choose fewer ranks");
        }
    }
}

// The ranks a GPU computes: every rank of the shard, or its own (a whole model: rank 0 of 1).
std::vector<int> held_ranks_of(const ModelDims& dims, bool all_ranks) {
    if (!all_ranks) return {dims.shard.rank};
    std::vector<int> held(dims.shard.ranks);
    for (int r = 0; r < dims.shard.ranks; ++r) held[r] = r;
    return held;
}

// Device buffers that only live through one eager verify (a test and benchmark entry; the round owns its own).
class TemporaryBuffer {
  public:
    explicit TemporaryBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 16))); }
    ~TemporaryBuffer() { cudaFree(p_); }
    TemporaryBuffer(const TemporaryBuffer&) = delete;
    TemporaryBuffer& operator=(const TemporaryBuffer&) = delete;
    template <typename T>
    T* as() const {
        return static_cast<T*>(p_);
    }

  private:
    void* p_ = nullptr;
};

}  // namespace

MemoryPlan Engine::plan_memory(const ModelDims& dims, int streams, int max_context, int max_budget,
                               const DrafterSpec* drafter, int held_ranks) {
    check_shard(dims);
    check_rank_widths(dims);
    // The same layout code as the constructor, through a counting arena.
    const int rows = forward_rows(streams, max_budget);
    MemoryPlan plan;
    plan.weights = Weights::planned_bytes(dims, rows) * held_ranks;
    DeviceArena arena(DeviceArena::Mode::kCount);
    const LatentCache cache(dims, streams, max_context, tree_slots(max_budget), arena);
    plan.kv = arena.bytes();
    TargetModel::Scratch::lay_out(dims, rows, cache.stream_rows(), streams, arena);
    if (dims.sharded()) CollectiveSlots::lay_out(dims.shard.ranks, rows, dims.hidden, arena);  // simulated or NCCL
    RowBatch::lay_out(rows, max_budget + 1, arena);
    DecodeState::lay_out(streams, max_context, arena);
    const int block = drafter != nullptr ? drafter->dims.block : 0;
    const int tap_width = drafter != nullptr ? drafter->dims.context_width() : 0;
    DdtreeRound::State::lay_out(streams, max_budget, round_history(max_context), block, tap_width, arena);
    plan.scratch = arena.bytes() - plan.kv;
    plan.draft = drafter == nullptr ? 0
                                    : DrafterModel::planned_bytes(drafter->dims, streams,
                                                                  draft_capacity(*drafter, max_context),
                                                                  DdtreeRound::max_append_rows(streams, block));
    return plan;
}

size_t Engine::preflight(const ModelDims& dims, const RopeTable& rope, int streams, int max_context, int max_budget,
                         int device, const DrafterSpec* drafter, bool all_ranks, const NcclRank* nccl) {
    check_shard(dims);
    if (nccl != nullptr && (all_ranks || !dims.sharded() || nccl->rank != dims.shard.rank ||
                            nccl->ranks != dims.shard.ranks)) {
        throw std::invalid_argument("an NCCL communicator's rank " + std::to_string(nccl->rank) + " of " +
                                    std::to_string(nccl->ranks) + " must be the engine's one held rank " +
                                    std::to_string(dims.shard.rank) + " of " + std::to_string(dims.shard.ranks));
    }
    const int held_ranks = all_ranks ? dims.shard.ranks : 1;
    if (drafter != nullptr && drafter->dims.own_lm_head != dims.sharded()) {
        throw std::invalid_argument("drafter: own_lm_head must be set exactly beside a split target");
    }
    if (streams < 1 || streams > 1024) {
        throw std::invalid_argument("streams must be in 1..1024, got " + std::to_string(streams));
    }
    if (max_context < 1) {
        throw std::invalid_argument("max_context must be >= 1, got " + std::to_string(max_context));
    }
    if (max_budget < 0 || max_budget > k::kTreeMaxBudget) {
        throw std::invalid_argument("budget must be in 0.." + std::to_string(k::kTreeMaxBudget) + ", got " +
                                    std::to_string(max_budget));
    }
    if (!k::mla_dims_supported(dims.kv_lora, dims.rope)) {
        throw std::invalid_argument("no MLA attention kernel is compiled for kv_lora_rank " +
                                    std::to_string(dims.kv_lora) + " and qk_rope_head_dim " +
                                    std::to_string(dims.rope));
    }
    for (const auto& [name, dim] : {std::pair<const char*, int>{"hidden_size", dims.hidden},
                                    {"q_lora_rank", dims.q_lora}, {"kv_lora_rank", dims.kv_lora}}) {
        if (!k::norm_dim_supported(dim)) {
            throw std::invalid_argument(std::string(name) + " " + std::to_string(dim) +
                                        " is outside the RMSNorm kernels' 1.." + std::to_string(k::kNormMaxDim));
        }
    }
    if (dims.first_dense < dims.layers && !k::router_supported(dims.experts, dims.topk)) {
        throw std::invalid_argument("no router kernel for n_routed_experts " + std::to_string(dims.experts) +
                                    " and num_experts_per_tok " + std::to_string(dims.topk) + " (at most " +
                                    std::to_string(k::kRouterMaxExperts) + " experts and " +
                                    std::to_string(k::kRouterMaxTopk) + " per token)");
    }
    if (static_cast<int>(rope.inv_freq.size()) != dims.rope / 2) {
        throw std::invalid_argument("rope table has " + std::to_string(rope.inv_freq.size()) +
                                    " frequencies, expected " + std::to_string(dims.rope / 2));
    }
    if (drafter != nullptr) check_drafter(*drafter, dims, max_context, max_budget);
    check_device(device);
    CUDA_CHECK(cudaSetDevice(device));

    const MemoryPlan plan = plan_memory(dims, streams, max_context, max_budget, drafter, held_ranks);
    const size_t weights = plan.weights, kv = plan.kv, scratch = plan.scratch, draft = plan.draft;
    const int rows = forward_rows(streams, max_budget);
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (weights + kv + scratch + draft + kHeadroomBytes > free_bytes) {
        throw std::invalid_argument("model does not fit on device " + std::to_string(device) + ": weights " +
                                    gib(weights) + " + KV cache " + gib(kv) + " (" + std::to_string(streams) +
                                    " streams x (" + std::to_string(max_context) + " tokens + " +
                                    std::to_string(tree_slots(max_budget)) + " tree slots)) + scratch " + gib(scratch) +
                                    " (" + std::to_string(rows) + " rows per forward) + drafter " + gib(draft) + " + headroom " +
                                    gib(kHeadroomBytes) + " > free " + gib(free_bytes) + " of " + gib(total_bytes));
    }
    return plan.total();
}

Engine::Engine(const ModelDims& dims, const RopeTable& rope, int streams, int max_context, int max_budget,
               int device, const DrafterSpec* drafter, bool all_ranks, const NcclRank* nccl)
    : dims_(dims), streams_(streams), max_context_(max_context), max_budget_(max_budget), device_(device),
      max_rows_(forward_rows(streams, max_budget)),
      planned_bytes_(preflight(dims, rope, streams, max_context, max_budget, device, drafter, all_ranks, nccl)),
      arena_(DeviceArena::Mode::kAllocate),
      cache_(dims, streams, max_context, tree_slots(max_budget), arena_),
      model_(dims, rope, cache_, max_rows_, device, arena_, held_ranks_of(dims, all_ranks), nccl),
      eager_rows_(RowBatch::lay_out(max_rows_, max_budget + 1, arena_)),
      decoder_(model_, cache_, eager_rows_, DecodeState::lay_out(streams, max_context, arena_)),
      drafter_(drafter == nullptr
                   ? nullptr
                   : std::make_unique<DrafterModel>(drafter->dims, drafter->rope, model_.weights().embed,
                                                    drafter->dims.own_lm_head ? nullptr : model_.weights().lm_head,
                                                    streams,
                                                    draft_capacity(*drafter, max_context),
                                                    DdtreeRound::max_append_rows(streams, drafter->dims.block),
                                                    model_.stream(), arena_)),
      round_(model_, cache_, decoder_, max_budget,
             DdtreeRound::State::lay_out(streams, max_budget, round_history(max_context),
                                         drafter != nullptr ? drafter->dims.block : 0,
                                         drafter != nullptr ? drafter->dims.context_width() : 0, arena_),
             RoundDrafter{drafter_.get(), drafter != nullptr ? drafter->tap_layers : std::vector<int>{}}) {
    cache_.clear(model_.stream());
    CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
}

DrafterWeights& Engine::drafter_weights() {
    if (drafter_ == nullptr) throw std::invalid_argument("the engine was created without a drafter");
    CUDA_CHECK(cudaSetDevice(device_));
    return drafter_->weights();
}

std::string Engine::missing() {
    for (int rank : model_.held()) {
        if (std::string m = model_.weights(rank).missing(); !m.empty()) return m;
    }
    return std::string();
}

void Engine::check_weights() {
    CUDA_CHECK(cudaSetDevice(device_));
    for (int rank : model_.held()) {
        if (const std::string m = model_.weights(rank).missing(); !m.empty()) {
            throw std::invalid_argument("weights are incomplete: '" + m + "' was never uploaded" +
                                        (dims_.sharded() ? " to rank " + std::to_string(rank) : std::string()));
        }
    }
    if (drafter_ != nullptr) {
        if (const std::string m = drafter_->weights().missing(); !m.empty()) {
            throw std::invalid_argument("drafter weights are incomplete: '" + m + "' was never uploaded");
        }
    }
}

std::vector<int32_t> Engine::prefill(const std::vector<std::vector<int32_t>>& prompts, float temperature,
                                     uint64_t seed) {
    check_weights();
    model_.clear_nonfinite();
    std::vector<int32_t> first = decoder_.prefill(prompts, temperature, seed);
    model_.check_finite(static_cast<int>(prompts.size()));
    return first;
}

Generation Engine::generate(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
                            uint64_t seed) {
    check_weights();
    model_.clear_nonfinite();
    Generation out = decoder_.generate(prompts, max_new_tokens, temperature, seed);
    model_.check_finite(static_cast<int>(prompts.size()));
    return out;
}

std::vector<float> Engine::forward_logits(const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
                                          const std::vector<int32_t>& positions, std::vector<int32_t>* routing) {
    CUDA_CHECK(cudaSetDevice(device_));
    const int n = static_cast<int>(ids.size());
    if (n < 1 || n > max_rows_ || streams.size() != ids.size() || positions.size() != ids.size()) {
        throw std::invalid_argument("forward_logits takes 1.." + std::to_string(max_rows_) +
                                    " rows of equal-length ids, streams, positions");
    }
    RowBatchBuilder batch(eager_rows_.capacity, eager_rows_.key_stride);
    for (int i = 0; i < n; ++i) {
        if (streams[i] < 0 || streams[i] >= streams_) {
            throw std::invalid_argument("row " + std::to_string(i) + ": stream " + std::to_string(streams[i]) +
                                        " outside 0.." + std::to_string(streams_ - 1));
        }
        if (positions[i] < 0 || positions[i] >= max_context_) {
            throw std::invalid_argument("row " + std::to_string(i) + ": position " + std::to_string(positions[i]) +
                                        " outside 0.." + std::to_string(max_context_ - 1));
        }
        if (ids[i] < 0 || ids[i] >= dims_.vocab) {
            throw std::invalid_argument("row " + std::to_string(i) + ": token id " + std::to_string(ids[i]) +
                                        " outside the vocabulary [0, " + std::to_string(dims_.vocab) + ")");
        }
        batch.add_row(ids[i], streams[i], cache_.stream_base(streams[i]), positions[i], true);
    }
    cudaStream_t s = model_.stream();
    batch.upload(eager_rows_, s);
    ForwardOutputs outputs;
    outputs.capture_routing = routing != nullptr;
    model_.forward(eager_rows_, n, n, cache_.attention_span(batch.longest()), outputs, nullptr);
    std::vector<float> logits(static_cast<size_t>(n) * dims_.vocab);
    copy_logits(logits.data(), n, s);
    if (routing != nullptr) {
        routing->resize(static_cast<size_t>(dims_.moe_layers()) * n * dims_.topk);
        CUDA_CHECK(cudaMemcpyAsync(routing->data(), model_.routing(), routing->size() * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    return logits;
}

void Engine::copy_logits(float* to, int rows, cudaStream_t s) const {
    const size_t pitch = static_cast<size_t>(dims_.vocab) * sizeof(float);
    for (int r : model_.held()) {  // an unsplit engine holds rank 0, every column: rows copied whole
        const ModelDims rank = dims_.for_rank(r);
        CUDA_CHECK(cudaMemcpy2DAsync(to + rank.first_token(), pitch, model_.logits() + rank.first_token(), pitch,
                                     static_cast<size_t>(rank.rank_vocab()) * sizeof(float), rows,
                                     cudaMemcpyDeviceToHost, s));
    }
}

RowBatchBuilder Engine::tree_rows(const std::vector<VerifyTree>& trees) const {
    if (trees.empty() || static_cast<int>(trees.size()) > streams_) {
        throw std::invalid_argument("trees: 1.." + std::to_string(streams_) + " trees, got " +
                                    std::to_string(trees.size()));
    }
    RowBatchBuilder batch(eager_rows_.capacity, eager_rows_.key_stride);
    std::vector<bool> taken(streams_, false);
    for (size_t t = 0; t < trees.size(); ++t) {
        const VerifyTree& tree = trees[t];
        const std::string name = "tree " + std::to_string(t);
        if (tree.stream < 0 || tree.stream >= streams_ || taken[tree.stream]) {
            throw std::invalid_argument(name + ": stream " + std::to_string(tree.stream) + " is outside 0.." +
                                        std::to_string(streams_ - 1) + " or has another tree");
        }
        taken[tree.stream] = true;
        const int nodes = static_cast<int>(tree.tokens.size());
        if (nodes < 1 || nodes > max_budget_ + 1 || tree.parents.size() != tree.tokens.size()) {
            throw std::invalid_argument(name + ": tokens and parents must both hold 1.." +
                                        std::to_string(max_budget_ + 1) + " nodes (the engine's budget + 1)");
        }
        if (tree.start < 0 || tree.start >= max_context_) {
            throw std::invalid_argument(name + ": start " + std::to_string(tree.start) + " is outside 0.." +
                                        std::to_string(max_context_ - 1));
        }
        std::vector<int> depth(nodes, 0);
        std::vector<int32_t> path(nodes);
        for (int i = 0; i < nodes; ++i) {
            const int32_t parent = tree.parents[i];
            if ((i == 0 && parent != -1) || (i > 0 && (parent < 0 || parent >= i))) {
                throw std::invalid_argument(name + ": parents[" + std::to_string(i) + "] = " + std::to_string(parent) +
                                            "; the root's is -1 and every other node's is a lower node index");
            }
            if (tree.tokens[i] < 0 || tree.tokens[i] >= dims_.vocab) {
                throw std::invalid_argument(name + ": token id " + std::to_string(tree.tokens[i]) + " of node " +
                                            std::to_string(i) + " is outside the vocabulary [0, " +
                                            std::to_string(dims_.vocab) + ")");
            }
            depth[i] = i == 0 ? 0 : depth[parent] + 1;
            for (int j = depth[i], node = i; j >= 0; --j, node = tree.parents[node]) path[j] = node;
            batch.add_tree_row(tree.tokens[i], tree.stream, cache_.stream_base(tree.stream), tree.start, i,
                               path.data(), depth[i], true);
        }
    }
    return batch;
}

VerifyOutput Engine::verify(const std::vector<VerifyTree>& trees, const std::vector<int>& tap_layers, bool routing) {
    check_weights();
    const RowBatchBuilder batch = tree_rows(trees);
    for (size_t t = 0; t < tap_layers.size(); ++t) {
        if (tap_layers[t] < 0 || tap_layers[t] >= dims_.layers || (t > 0 && tap_layers[t] <= tap_layers[t - 1])) {
            throw std::invalid_argument("tap_layers must be increasing layer indices in 0.." +
                                        std::to_string(dims_.layers - 1));
        }
    }
    const int n = batch.rows();
    cudaStream_t s = model_.stream();
    batch.upload(eager_rows_, s);
    const size_t tap_width = tap_layers.size() * static_cast<size_t>(dims_.hidden);
    TemporaryBuffer taps(static_cast<size_t>(n) * tap_width * sizeof(uint16_t));
    ForwardOutputs outputs;
    outputs.tap_layers = tap_layers;
    outputs.tap_rows = eager_rows_.logit_rows;  // every row has logits, in order
    outputs.n_tap_rows = tap_layers.empty() ? 0 : n;
    outputs.taps = taps.as<k::bf16>();
    outputs.capture_routing = routing;
    model_.forward(eager_rows_, n, n, cache_.attention_span(batch.longest()), outputs, nullptr);
    VerifyOutput out;
    out.rows = n;
    out.logits.resize(static_cast<size_t>(n) * dims_.vocab);
    out.taps.resize(static_cast<size_t>(n) * tap_width);
    copy_logits(out.logits.data(), n, s);
    CUDA_CHECK(cudaMemcpyAsync(out.taps.data(), taps.as<uint16_t>(), out.taps.size() * 2, cudaMemcpyDeviceToHost, s));
    if (routing) {
        out.routing.resize(static_cast<size_t>(dims_.moe_layers()) * n * dims_.topk);
        CUDA_CHECK(cudaMemcpyAsync(out.routing.data(), model_.routing(), out.routing.size() * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    return out;
}

StepProfile Engine::profile_verify(const std::vector<VerifyTree>& trees, int iters) {
    check_weights();
    if (iters < 1) throw std::invalid_argument("iters must be >= 1");
    const RowBatchBuilder batch = tree_rows(trees);
    const int n = batch.rows();
    cudaStream_t s = model_.stream();
    batch.upload(eager_rows_, s);
    const int span = cache_.attention_span(batch.longest());
    std::map<std::string, double> seconds;
    for (int i = 0; i <= iters; ++i) {
        OpTimeline timeline(s);
        hold_stream_for_timing(s);
        model_.forward(eager_rows_, n, n, span, {}, &timeline);
        CUDA_CHECK(cudaStreamSynchronize(s));
        if (i > 0) timeline.accumulate(seconds);  // the first pass warms up
    }
    StepProfile out;
    for (auto& [name, sec] : seconds) out.emplace_back(name, sec / iters);
    return out;
}

TreeGeneration Engine::generate_ddtree(const RoundRequest& request) {
    check_weights();
    model_.clear_nonfinite();
    TreeGeneration out = round_.generate(request);
    model_.check_finite(static_cast<int>(request.prompts.size()));
    return out;
}

CostTable Engine::round_costs(const RoundRequest& request) {
    check_weights();
    return round_.round_costs(request);
}

void Engine::randomize_cache(uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    cache_.randomize(seed, model_.stream());
}

std::pair<double, double> Engine::time_decode(int n, const std::vector<int32_t>& positions, int iters,
                                              float temperature, uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    return decoder_.time_decode(n, positions, iters, temperature, seed);
}

StepProfile Engine::profile_step(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                                 uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    return decoder_.profile_step(n, positions, iters, temperature, seed);
}

double Engine::time_collectives(int rows, int iters) {
    CUDA_CHECK(cudaSetDevice(device_));
    return model_.time_collectives(rows, iters);
}

std::vector<CapturedGraph> Engine::graphs() const {
    std::vector<CapturedGraph> out = decoder_.graphs();
    for (CapturedGraph& g : round_.graphs()) out.push_back(std::move(g));
    return out;
}

std::vector<double> Engine::replay(const std::string& name, int n, bool warmup) {
    if (n < 1 || n > kMaxReplays) {
        throw std::invalid_argument("n: replays must be 1.." + std::to_string(kMaxReplays) + ", got " +
                                    std::to_string(n));
    }
    CUDA_CHECK(cudaSetDevice(device_));
    std::vector<double> seconds;
    if (decoder_.replay(name, n, warmup, &seconds) || round_.replay(name, n, warmup, &seconds)) return seconds;
    std::string captured;
    for (const CapturedGraph& g : graphs()) captured += (captured.empty() ? "" : "; ") + g.name;
    throw std::invalid_argument("name: no captured graph is called '" + name + "' (captured: " +
                                (captured.empty() ? "none yet: generate first" : captured) + ")");
}

}  // namespace ddtree
