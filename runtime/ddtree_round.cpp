#include "ddtree_round.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "op_timeline.h"
#include "tree_accept.cuh"
#include "tree_build.cuh"
#include "tree_commit.cuh"
#include "tree_rows.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

// Pinned host memory of `count` int32 that the device copies into while the host goes on (freed unchecked).
class PinnedInts {
  public:
    explicit PinnedInts(size_t count) { CUDA_CHECK(cudaMallocHost(&p_, std::max<size_t>(count, 1) * 4)); }
    ~PinnedInts() { cudaFreeHost(p_); }
    PinnedInts(const PinnedInts&) = delete;
    PinnedInts& operator=(const PinnedInts&) = delete;
    int32_t* data() const { return p_; }

  private:
    int32_t* p_ = nullptr;
};

}  // namespace

DdtreeRound::State DdtreeRound::State::lay_out(int streams, int budget, int history_ld, DeviceArena& arena) {
    State s{};
    const size_t n = streams, rows = static_cast<size_t>(streams) * k::tree_rows(budget);
    const size_t paths = k::kTreeMaxDepth + 1, depths = k::kTreeMaxDepth;
    auto i32 = [&](size_t count) { return arena.take<int32_t>(count); };
    s.start = i32(n);
    s.bonus = i32(n);
    s.count = i32(2 * n);  // tokens so far, then rounds so far
    s.stream_base = i32(n);
    s.stream_ids = i32(n);
    s.tree = k::TreeArrays{i32(rows),
                           i32(rows),
                           i32(rows),
                           i32(rows),
                           i32(rows),
                           arena.take<uint32_t>(rows * k::tree_visibility_words(budget)),
                           i32(rows),
                           i32(rows * paths),
                           i32(n)};
    s.log_probs = arena.take<float>(n * depths * k::tree_rows(budget));
    s.token_ids = i32(n * depths * k::tree_rows(budget));
    s.accepted = i32(n * paths);
    s.accept_len = i32(n);
    s.next_bonus = i32(n);
    s.history = i32(n * history_ld);
    s.reference = i32(n * history_ld);
    s.accept_log = i32(n * history_ld);
    s.oracle_scalars = arena.take<float>(kOracleScalars);
    s.rows = RowBatch::lay_out(static_cast<int>(rows), 0, arena);
    // The verify rows read node keys through the trees' ancestors (their stride is set per depth limit); every row
    // gets logits, keyed for sampling by its own stream and position.
    s.rows.key_nodes = s.tree.ancestors;
    s.rows.logit_stream_ids = s.rows.stream_ids;
    s.rows.logit_positions = s.rows.positions;
    s.history_ld = history_ld;
    return s;
}

DdtreeRound::DdtreeRound(TargetModel& model, const LatentCache& cache, ArDecoder& decoder, int max_budget,
                         const State& state)
    : model_(model), cache_(cache), decoder_(decoder), max_budget_(max_budget), state_(state) {}

void DdtreeRound::record_round(const RoundKey& key, const k::OracleDraft& oracle) {
    cudaStream_t s = model_.stream();
    const k::TreeShape shape{key.streams, key.budget, key.depth_limit};
    const int n = key.streams, rows = n * k::tree_rows(key.budget), width = key.width;
    const State& st = state_;
    RowBatch verify = st.rows;
    verify.key_stride = key.depth_limit + 1;  // the ancestors' stride at this depth limit
    CUDA_CHECK(k::oracle_draft(st.log_probs, st.token_ids, width, st.count, oracle, shape, s));
    CUDA_CHECK(k::tree_build({st.log_probs, st.token_ids, width, st.start, st.bonus}, st.tree, shape, s));
    const k::VerifyRowTables tables{verify.ids,   verify.positions,  verify.kv_start, verify.kv_len,
                                    verify.slots, verify.stream_ids, verify.key_start};
    CUDA_CHECK(k::tree_verify_rows(tables, st.tree, st.start, st.stream_base, st.stream_ids, shape, s));
    model_.forward(verify, rows, rows, key.span, {}, nullptr);
    model_.sample(verify, rows);
    CUDA_CHECK(k::tree_accept(st.tree, model_.tokens(), st.accepted, st.accept_len, st.next_bonus, shape, s));
    const k::LatentCache latent{cache_.layer(0), model_.dims().layers, static_cast<int>(cache_.layer_rows()),
                                model_.dims().latent_row()};
    CUDA_CHECK(k::tree_commit(latent, {nullptr, nullptr, 0}, st.stream_base, st.start, st.accepted, st.accept_len,
                              shape, s));
    CUDA_CHECK(k::commit_round_tokens(st.history, st.accept_log, st.history_ld, st.count, st.count + n, st.bonus,
                                      st.tree.tokens, st.accepted, st.accept_len, st.next_bonus, shape, s));
}

TreeGeneration DdtreeRound::generate_oracle(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens,
                                            float temperature, uint64_t seed, const OracleRequest& oracle, int budget,
                                            int depth_limit, int width) {
    const int n = static_cast<int>(prompts.size());
    const int vocab = model_.dims().vocab;
    if (budget < 1 || budget > max_budget_) {
        throw std::invalid_argument("budget must be in 1.." + std::to_string(max_budget_) + " (the engine's), got " +
                                    std::to_string(budget));
    }
    if (depth_limit < 1 || depth_limit > k::kTreeMaxDepth) {
        throw std::invalid_argument("depth_limit must be in 1.." + std::to_string(k::kTreeMaxDepth) + ", got " +
                                    std::to_string(depth_limit));
    }
    if (width < 1 || width > budget || width >= vocab) {
        throw std::invalid_argument("width: the oracle's candidates per depth must be 1..budget (" +
                                    std::to_string(budget) + ") and below the vocabulary");
    }
    if (static_cast<int>(oracle.hit.size()) != depth_limit ||
        !std::all_of(oracle.hit.begin(), oracle.hit.end(), [](float p) { return p >= 0.f && p <= 1.f; })) {
        throw std::invalid_argument("hit: the oracle profile needs one probability in [0, 1] per depth (" +
                                    std::to_string(depth_limit) + ")");
    }
    if (static_cast<int>(oracle.reference.size()) != n) {
        throw std::invalid_argument("reference: one continuation per prompt");
    }
    const int reference_len = static_cast<int>(oracle.reference.empty() ? 0 : oracle.reference[0].size());
    for (const auto& r : oracle.reference) {
        if (static_cast<int>(r.size()) != reference_len || reference_len > state_.history_ld) {
            throw std::invalid_argument("reference: continuations of one length, at most " +
                                        std::to_string(state_.history_ld));
        }
    }
    check_generation_length(prompts, max_new_tokens, cache_.max_context());
    cudaStream_t s = model_.stream();
    PhaseClock clock(s);  // start, prefilled, decoded
    const int32_t* first = decoder_.prefill_first_tokens(prompts, temperature, seed);
    clock.mark();

    // Round state: start = prompt length, the root of round one = the prefill's token, one token so far.
    const int ld = state_.history_ld;
    const size_t first_pitch = static_cast<size_t>(decoder_.history_ld()) * sizeof(int32_t);
    CUDA_CHECK(cudaMemcpy2DAsync(state_.history, static_cast<size_t>(ld) * 4, first, first_pitch, 4, n,
                                 cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemcpy2DAsync(state_.bonus, 4, first, first_pitch, 4, n, cudaMemcpyDeviceToDevice, s));
    std::vector<int32_t> host(4 * static_cast<size_t>(n));  // start, count and rounds, stream base, stream id
    for (int i = 0; i < n; ++i) {
        host[i] = static_cast<int32_t>(prompts[i].size());
        host[n + i] = 1;
        host[2 * n + i] = 0;
        host[3 * n + i] = cache_.stream_base(i);
    }
    std::vector<int32_t> ids(n), reference(static_cast<size_t>(n) * ld, 0);
    for (int i = 0; i < n; ++i) {
        ids[i] = i;
        std::copy(oracle.reference[i].begin(), oracle.reference[i].end(), reference.begin() + i * ld);
    }
    CUDA_CHECK(cudaMemcpyAsync(state_.start, host.data(), n * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(state_.count, host.data() + n, 2 * n * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(state_.stream_base, host.data() + 3 * n, n * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(state_.stream_ids, ids.data(), n * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(state_.reference, reference.data(), reference.size() * 4, cudaMemcpyHostToDevice, s));
    static_assert(k::kTreeMaxDepth <= kOracleSeedAt && kOracleSeedAt % 2 == 0, "the seed is 8-byte aligned");
    std::vector<float> scalars(kOracleScalars, 0.f);
    std::copy(oracle.hit.begin(), oracle.hit.end(), scalars.begin());
    const unsigned long long oracle_seed = oracle.seed;
    std::memcpy(&scalars[kOracleSeedAt], &oracle_seed, 8);
    std::memcpy(&scalars[kOracleLengthAt], &reference_len, 4);
    CUDA_CHECK(cudaMemcpyAsync(state_.oracle_scalars, scalars.data(), scalars.size() * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));  // the host vectors are this call's

    const k::OracleDraft draft{state_.reference, ld,
                               reinterpret_cast<const int32_t*>(state_.oracle_scalars + kOracleLengthAt),
                               state_.oracle_scalars,
                               reinterpret_cast<const unsigned long long*>(state_.oracle_scalars + kOracleSeedAt),
                               vocab};
    // Every node of every round stays within max prompt + max_new_tokens - 1 + depth_limit keys.
    int longest = 0;
    for (const auto& p : prompts) longest = std::max(longest, static_cast<int>(p.size()));
    const RoundKey key{n, budget, depth_limit, width, cache_.attention_span(longest + max_new_tokens + depth_limit)};
    const cudaGraphExec_t graph = graphs_.get(key, s, [&] { record_round(key, draft); });

    // One round stays queued ahead of the host: after launching round r the host waits for round r - 1's token
    // counts, copied to pinned memory behind it, and stops once every stream has its tokens (round r then only adds
    // tokens past the end). A round commits at least one token, so max_new_tokens rounds always suffice.
    PinnedInts counts(2 * static_cast<size_t>(n));
    cudaEvent_t copied[2];
    for (cudaEvent_t& e : copied) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    int rounds = 0;
    try {
        for (bool done = max_new_tokens <= 1; !done && rounds < max_new_tokens; ++rounds) {
            CUDA_CHECK(cudaGraphLaunch(graph, s));
            CUDA_CHECK(cudaMemcpyAsync(counts.data() + (rounds % 2) * n, state_.count, n * 4, cudaMemcpyDeviceToHost, s));
            CUDA_CHECK(cudaEventRecord(copied[rounds % 2], s));
            if (rounds == 0) continue;
            CUDA_CHECK(cudaEventSynchronize(copied[(rounds - 1) % 2]));
            const int32_t* c = counts.data() + ((rounds - 1) % 2) * n;
            done = std::all_of(c, c + n, [&](int32_t v) { return v >= max_new_tokens; });
        }
    } catch (...) {
        for (cudaEvent_t e : copied) cudaEventDestroy(e);
        throw;
    }
    for (cudaEvent_t e : copied) cudaEventDestroy(e);
    clock.mark();

    TreeGeneration out;
    std::vector<int32_t> history(static_cast<size_t>(n) * ld), log(static_cast<size_t>(n) * ld), done(2 * n);
    CUDA_CHECK(cudaMemcpyAsync(history.data(), state_.history, history.size() * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(log.data(), state_.accept_log, log.size() * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(done.data(), state_.count, done.size() * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    out.tokens.resize(n);
    out.accept_lengths.resize(n);
    for (int i = 0; i < n; ++i) {
        out.tokens[i].assign(history.begin() + static_cast<size_t>(i) * ld,
                             history.begin() + static_cast<size_t>(i) * ld + max_new_tokens);
        // the rounds this stream needed for its tokens (later rounds only ran beside the others)
        int needed = 0;
        for (int tokens = 1; tokens < max_new_tokens && needed < done[n + i]; ++needed) {
            tokens += log[static_cast<size_t>(i) * ld + needed];
        }
        out.accept_lengths[i].assign(log.begin() + static_cast<size_t>(i) * ld,
                                     log.begin() + static_cast<size_t>(i) * ld + needed);
    }
    out.rounds = rounds;
    out.prefill_seconds = clock.seconds(0, 1);
    out.decode_seconds = clock.seconds(1, 2);
    return out;
}

}  // namespace ddtree
