#include "ddtree_round.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include "compact_slots.cuh"
#include "cuda_check.h"
#include "draft_rows.cuh"
#include "nvtx_range.h"
#include "op_timeline.h"
#include "tree_accept.cuh"
#include "tree_build.cuh"
#include "tree_commit.cuh"
#include "topk.cuh"
#include "tree_rows.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

static_assert(k::kTopkMax >= k::kTreeMaxBudget, "the drafter's top-k covers every budget");

// Ints of one stream's pinned output: history row, accept-log row, count, rounds.
size_t output_ints(int history_ld) { return 2 * static_cast<size_t>(history_ld) + 2; }

// The pinned words behind the outputs: [2][streams] finished flags, [2][streams] accept lengths, [2][streams][P]
// probe masses.
size_t round_copy_words(int streams) { return 2 * static_cast<size_t>(streams) * (2 + k::kProbeMaxBudgets); }

}  // namespace

int DdtreeRound::max_append_rows(int streams, int block) {
    return std::max(streams * block, ArDecoder::kPrefillRows);  // a round's L + 1 = block rows, or a prefill chunk
}

DdtreeRound::State DdtreeRound::State::lay_out(int streams, int budget, int history_ld, int draft_block,
                                               int tap_width, DeviceArena& arena) {
    State s{};
    const size_t n = streams, rows = static_cast<size_t>(streams) * k::tree_rows(budget);
    const size_t paths = k::kTreeMaxDepth + 1, depths = k::kTreeMaxDepth;
    auto i32 = [&](size_t count) { return arena.take<int32_t>(count); };
    s.start = i32(n);
    s.bonus = i32(n);
    s.count = i32(n);
    s.rounds = i32(n);
    s.stream_base = i32(n);
    s.stream_ids = i32(n);
    s.finished = i32(n);
    s.limits = i32(k::kRoundLimitsInts);
    s.keep = i32(n);
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
    s.probe = arena.take<float>(n * k::kProbeMaxBudgets);
    s.history = i32(n * history_ld);
    s.accept_log = i32(n * history_ld);
    s.reference = i32(n * history_ld);
    s.oracle_scalars = arena.take<float>(kOracleScalars);
    s.rows = RowBatch::lay_out(static_cast<int>(rows), 0, arena);
    // The verify rows read node keys through the trees' ancestors (their stride is set per depth limit); every row
    // gets logits, keyed for sampling by its own stream and position.
    s.rows.key_nodes = s.tree.ancestors;
    s.rows.logit_stream_ids = s.rows.stream_ids;
    s.rows.logit_positions = s.rows.positions;
    s.history_ld = history_ld;
    if (draft_block > 0) {
        // Taps of every verify row, or of one prefill chunk.
        s.tap_rows = std::max(static_cast<int>(rows), ArDecoder::kPrefillRows);
        s.max_append = max_append_rows(streams, draft_block);
        s.taps = arena.take<k::bf16>(static_cast<size_t>(s.tap_rows) * tap_width);
        s.context = arena.take<k::bf16>(n * draft_block * tap_width);
        s.tap_index = i32(s.tap_rows);
        s.block_ids = i32(n * draft_block);
        s.block_positions = i32(n * draft_block);
        s.head_rows = i32(n * (draft_block - 1));
        s.append_positions = i32(s.max_append);
        s.append_slots = i32(s.max_append);
    }
    return s;
}

DdtreeRound::DdtreeRound(TargetModel& model, const LatentCache& cache, ArDecoder& decoder, int max_budget,
                         const State& state, RoundDrafter drafter)
    : model_(model), cache_(cache), decoder_(decoder), max_budget_(max_budget), state_(state),
      drafter_(std::move(drafter)),
      oracle_{state_.reference, state_.history_ld,
              reinterpret_cast<const int32_t*>(state_.oracle_scalars + kOracleLengthAt), state_.oracle_scalars,
              reinterpret_cast<const unsigned long long*>(state_.oracle_scalars + kOracleSeedAt),
              model_.dims().vocab} {
    const int n = cache_.streams();
    cudaStream_t stream = model_.stream();
    // Written in part by design, zeroed once so that no copy or load of them reads never-written memory
    // (compute-sanitizer's initcheck): the history, accept-log and oracle rows are copied to the host and compacted
    // whole while only their first count / rounds entries are read; a stream's drafter context rows past its
    // accept length go through the drafter's fc GEMM as padding (their slots -1, dropped).
    const size_t history_bytes = static_cast<size_t>(n) * state_.history_ld * sizeof(int32_t);
    for (int32_t* rows : {state_.history, state_.accept_log, state_.reference}) {
        CUDA_CHECK(cudaMemsetAsync(rows, 0, history_bytes, stream));
    }
    if (has_drafter()) {
        const int block = drafter_.model->dims().block;
        CUDA_CHECK(cudaMemsetAsync(state_.context, 0,
                                   static_cast<size_t>(n) * block * drafter_.model->dims().context_width() *
                                       sizeof(k::bf16),
                                   stream));
        // Fixed tables: tap row i is verify (or prefill) row i; block row s * B + 1 + d has the logits of depth d + 1.
        std::vector<int32_t> index(state_.tap_rows), head(static_cast<size_t>(n) * (block - 1));
        for (int i = 0; i < state_.tap_rows; ++i) index[i] = i;
        for (int s = 0; s < n; ++s) {
            for (int d = 0; d < block - 1; ++d) head[static_cast<size_t>(s) * (block - 1) + d] = s * block + 1 + d;
        }
        CUDA_CHECK(cudaMemcpyAsync(state_.tap_index, index.data(), index.size() * 4, cudaMemcpyHostToDevice, stream));
        CUDA_CHECK(cudaMemcpyAsync(state_.head_rows, head.data(), head.size() * 4, cudaMemcpyHostToDevice, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaMallocHost(&pinned_, (n * output_ints(state_.history_ld) + round_copy_words(n)) * 4));
}

DdtreeRound::~DdtreeRound() { cudaFreeHost(pinned_); }

void DdtreeRound::record_round(const RoundKey& key, OpTimeline* timeline) {
    cudaStream_t s = model_.stream();
    const k::TreeShape shape{key.streams, key.budget, key.depth_limit};
    const int n = key.streams, rows = n * k::tree_rows(key.budget), width = key.width;
    const State& st = state_;
    auto stage = [&](const char* name, auto&& launch) { timed_op(timeline, name, launch); };
    DrafterModel* drafter = drafter_.model;
    if (drafter != nullptr) {
        const DrafterDims& d = drafter->dims();
        stage("draft", [&] {
            CUDA_CHECK(k::draft_block_rows(st.block_ids, st.block_positions, st.bonus, st.start, n, d.block,
                                           d.mask_token, s));
            drafter->block_forward({st.block_ids, st.block_positions, st.stream_ids, st.start, st.head_rows, n,
                                    key.draft_span},
                                   nullptr);
        });
        drafter->top_k(n, width, st.log_probs, st.token_ids, timeline);
    }
    if (key.oracle) {
        stage("oracle", [&] {
            CUDA_CHECK(k::oracle_draft(st.log_probs, st.token_ids, width, st.count, oracle_, shape, s));
        });
    }
    stage("tree_build", [&] {
        CUDA_CHECK(k::tree_build({st.log_probs, st.token_ids, width, st.start, st.bonus}, st.tree, shape, s));
    });
    // The auto budgets' probe: the masses the same candidates reach at each candidate budget. It reads what the
    // tree build read and writes only what the host reads after the round, so it runs beside the rest of the round
    // on a stream of its own (in turn in timed, eager rounds), joined back at the round's end.
    ForkedStream probe_lane(key.probe[0] != 0 && timeline == nullptr, s, probe_stream_.stream(),
                            probe_stream_.event());
    if (key.probe[0] != 0) {
        k::ProbeBudgets budgets{0, {}};
        while (budgets.count < k::kProbeMaxBudgets && key.probe[budgets.count] != 0) {
            budgets.budgets[budgets.count] = key.probe[budgets.count];
            ++budgets.count;
        }
        const k::TreeShape probe_shape{n, budgets.budgets[budgets.count - 1], key.depth_limit};
        stage("probe", [&] {
            // log-probs only: the commit rewrites start and bonus while the probe may still run
            CUDA_CHECK(k::tree_probe({st.log_probs, st.token_ids, width, nullptr, nullptr}, budgets, st.probe,
                                     probe_shape, timeline == nullptr ? probe_stream_.stream() : s));
        });
    }
    RowBatch verify = st.rows;
    verify.key_stride = key.depth_limit + 1;  // the ancestors' stride at this depth limit
    stage("verify_rows", [&] {
        const k::VerifyRowTables tables{verify.ids,   verify.positions,  verify.kv_start, verify.kv_len,
                                        verify.slots, verify.stream_ids, verify.key_start};
        CUDA_CHECK(k::tree_verify_rows(tables, st.tree, st.start, st.stream_base, st.stream_ids, shape, s));
    });
    ForwardOutputs outputs;
    if (drafter != nullptr) {
        outputs.tap_layers = drafter_.tap_layers;
        outputs.tap_rows = st.tap_index;
        outputs.n_tap_rows = rows;
        outputs.taps = st.taps;
    }
    stage("verify", [&] { model_.forward(verify, rows, rows, key.span, outputs, nullptr); });
    stage("sample", [&] { model_.sample(verify, rows); });
    stage("accept", [&] {
        CUDA_CHECK(k::tree_accept(st.tree, model_.tokens(), st.finished, st.accepted, st.accept_len, st.next_bonus,
                                  shape, s));
    });
    stage("commit", [&] {
        const k::LatentCache latent{cache_.layer(0), model_.dims().layers, static_cast<int>(cache_.layer_rows()),
                                    model_.dims().latent_row()};
        const k::TapGather gather{drafter != nullptr ? st.taps : nullptr, st.context,
                                  drafter != nullptr ? drafter->dims().context_width() : 0};
        CUDA_CHECK(k::tree_commit(latent, gather, st.stream_base, st.start, st.accepted, st.accept_len, shape, s));
        const k::RoundTokens tokens{st.history, st.accept_log, st.history_ld, st.count, st.rounds,
                                    st.bonus,   st.finished,   st.limits};
        CUDA_CHECK(k::commit_round_tokens(tokens, st.tree.tokens, st.accepted, st.accept_len, st.next_bonus, shape, s));
    });
    if (drafter != nullptr) {
        stage("draft_append", [&] {
            const int per_stream = key.depth_limit + 1;
            CUDA_CHECK(k::draft_append_rows(st.append_positions, st.append_slots, st.start, st.accept_len,
                                            st.stream_ids, n, per_stream, drafter->cache().capacity(), s));
            drafter->append({st.context, st.append_positions, st.append_slots, n * per_stream}, nullptr);
        });
    }
    probe_lane.join();
}

void DdtreeRound::check(const RoundRequest& r, int budget, int depth_limit, int width) const {
    const int n = static_cast<int>(r.prompts.size());
    const int vocab = model_.dims().vocab;
    if (r.oracle == nullptr && !has_drafter()) {
        throw std::invalid_argument("the engine has no drafter: DDTree needs one (or an oracle)");
    }
    const std::vector<int>& autos = r.auto_budgets;
    if (static_cast<int>(autos.size()) > k::kProbeMaxBudgets) {
        throw std::invalid_argument("auto budgets: at most " + std::to_string(k::kProbeMaxBudgets) + " candidates");
    }
    for (size_t i = 0; i < autos.size(); ++i) {
        if (autos[i] < 1 || autos[i] > max_budget_ || (i > 0 && autos[i] <= autos[i - 1])) {
            throw std::invalid_argument("auto budgets must ascend within 1.." + std::to_string(max_budget_) +
                                        " (the engine's budget), got " + std::to_string(autos[i]));
        }
    }
    const CostTable& costs = r.costs;
    if (!costs.streams.empty() || !costs.seconds.empty()) {  // seconds without stream counts: refused
        bool ok = !autos.empty() && !costs.streams.empty() && costs.streams[0] == 1 &&
                  costs.seconds.size() == costs.streams.size();
        for (size_t i = 0; ok && i < costs.streams.size(); ++i) {
            ok = (i == 0 || costs.streams[i] > costs.streams[i - 1]) && costs.seconds[i].size() == autos.size() &&
                 std::all_of(costs.seconds[i].begin(), costs.seconds[i].end(), [](double t) { return t > 0.0; });
        }
        if (!ok) {
            throw std::invalid_argument("costs: auto budgets' round seconds, one positive value per candidate at "
                                        "ascending stream counts starting at 1");
        }
    }
    if (budget < 1 || budget > max_budget_) {
        throw std::invalid_argument("budget must be in 1.." + std::to_string(max_budget_) + " (the engine's), got " +
                                    std::to_string(budget));
    }
    if (depth_limit < 1 || depth_limit > k::kTreeMaxDepth) {
        throw std::invalid_argument("depth_limit must be in 1.." + std::to_string(k::kTreeMaxDepth) + ", got " +
                                    std::to_string(depth_limit));
    }
    if (width < 1 || width > budget || width > vocab || (r.oracle != nullptr && width >= vocab)) {
        throw std::invalid_argument("width: the oracle's candidates per depth must be 1..budget (" +
                                    std::to_string(budget) + ") and below the vocabulary");
    }
    if (static_cast<int>(r.stop_ids.size()) > k::kRoundMaxStopIds) {
        throw std::invalid_argument("stop_token_ids: at most " + std::to_string(k::kRoundMaxStopIds) + " ids, got " +
                                    std::to_string(r.stop_ids.size()));
    }
    for (const int32_t id : r.stop_ids) {
        if (id < 0 || id >= vocab) {
            throw std::invalid_argument("stop_token_ids: " + std::to_string(id) + " is outside the vocabulary [0, " +
                                        std::to_string(vocab) + ")");
        }
    }
    if (r.oracle == nullptr) return;
    const OracleRequest& oracle = *r.oracle;
    if (static_cast<int>(oracle.hit.size()) != depth_limit ||
        !std::all_of(oracle.hit.begin(), oracle.hit.end(), [](float p) { return p >= 0.f && p <= 1.f; })) {
        throw std::invalid_argument("hit: the oracle profile needs one probability in [0, 1] per depth (" +
                                    std::to_string(depth_limit) + ")");
    }
    if (static_cast<int>(oracle.reference.size()) != n) {
        throw std::invalid_argument("reference: one continuation per prompt");
    }
    const size_t reference_len = oracle.reference.empty() ? 0 : oracle.reference[0].size();
    for (const auto& ref : oracle.reference) {
        if (ref.size() != reference_len || static_cast<int>(reference_len) > state_.history_ld) {
            throw std::invalid_argument("reference: continuations of one length, at most " +
                                        std::to_string(state_.history_ld));
        }
    }
}

void DdtreeRound::start_streams(const RoundRequest& r) {
    const int n = static_cast<int>(r.prompts.size());
    cudaStream_t s = model_.stream();
    const int32_t* first = nullptr;
    if (has_drafter()) {
        // The prompt rows' taps go to the drafter chunk by chunk; with a window only its last rows are stored
        // (those are distinct slots within a chunk).
        DrafterModel& drafter = *drafter_.model;
        const DraftCache& dc = drafter.cache();
        PrefillTaps taps;
        taps.outputs.tap_layers = drafter_.tap_layers;
        taps.outputs.tap_rows = state_.tap_index;
        taps.outputs.taps = state_.taps;
        std::vector<int32_t> tables(2 * static_cast<size_t>(ArDecoder::kPrefillRows));
        taps.consume = [&](const std::vector<std::pair<int, int>>& chunk) {
            const int m = static_cast<int>(chunk.size());
            for (int i = 0; i < m; ++i) {
                const auto [stream, position] = chunk[i];
                const int prompt_len = static_cast<int>(r.prompts[stream].size());
                tables[i] = position;
                tables[ArDecoder::kPrefillRows + i] =
                    position >= prompt_len - dc.capacity() ? dc.slot(stream, position) : -1;
            }
            // Pageable source: the copy has left `tables` when the call returns.
            CUDA_CHECK(cudaMemcpyAsync(state_.append_positions, tables.data(), m * 4, cudaMemcpyHostToDevice, s));
            CUDA_CHECK(cudaMemcpyAsync(state_.append_slots, tables.data() + ArDecoder::kPrefillRows, m * 4,
                                       cudaMemcpyHostToDevice, s));
            drafter.append({state_.taps, state_.append_positions, state_.append_slots, m}, nullptr);
        };
        first = decoder_.prefill_first_tokens(r.prompts, r.temperature, r.seed, &taps);
    } else {
        first = decoder_.prefill_first_tokens(r.prompts, r.temperature, r.seed);
    }

    // Round state: start = prompt length, the root of round one = the prefill's token, one token so far.
    const int ld = state_.history_ld;
    const size_t first_pitch = static_cast<size_t>(decoder_.history_ld()) * sizeof(int32_t);
    CUDA_CHECK(cudaMemcpy2DAsync(state_.history, static_cast<size_t>(ld) * 4, first, first_pitch, 4, n,
                                 cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemcpy2DAsync(state_.bonus, 4, first, first_pitch, 4, n, cudaMemcpyDeviceToDevice, s));
    std::vector<int32_t> host(6 * static_cast<size_t>(n));  // start, count, rounds, base, id, finished
    for (int i = 0; i < n; ++i) {
        host[i] = static_cast<int32_t>(r.prompts[i].size());
        host[n + i] = 1;
        host[2 * n + i] = 0;
        host[3 * n + i] = cache_.stream_base(i);
        host[4 * n + i] = i;
        host[5 * n + i] = r.max_new_tokens <= 1 ? 1 : 0;
    }
    for (auto [array, at] : {std::pair{state_.start, 0}, {state_.count, 1}, {state_.rounds, 2},
                             {state_.stream_base, 3}, {state_.stream_ids, 4}, {state_.finished, 5}}) {
        CUDA_CHECK(cudaMemcpyAsync(array, host.data() + at * n, n * 4, cudaMemcpyHostToDevice, s));
    }
    std::vector<int32_t> limits(k::kRoundLimitsInts, 0);
    limits[0] = r.max_new_tokens;
    limits[1] = static_cast<int32_t>(r.stop_ids.size());
    std::copy(r.stop_ids.begin(), r.stop_ids.end(), limits.begin() + 2);
    CUDA_CHECK(cudaMemcpyAsync(state_.limits, limits.data(), limits.size() * 4, cudaMemcpyHostToDevice, s));
    std::vector<int32_t> reference;
    std::vector<float> scalars(kOracleScalars, 0.f);
    if (r.oracle != nullptr) {
        reference.assign(static_cast<size_t>(n) * ld, 0);
        for (int i = 0; i < n; ++i) {
            std::copy(r.oracle->reference[i].begin(), r.oracle->reference[i].end(), reference.begin() + i * ld);
        }
        CUDA_CHECK(cudaMemcpyAsync(state_.reference, reference.data(), reference.size() * 4, cudaMemcpyHostToDevice,
                                   s));
        static_assert(k::kTreeMaxDepth <= kOracleSeedAt && kOracleSeedAt % 2 == 0, "the seed is 8-byte aligned");
        std::copy(r.oracle->hit.begin(), r.oracle->hit.end(), scalars.begin());
        const unsigned long long oracle_seed = r.oracle->seed;
        const int32_t reference_len = static_cast<int32_t>(r.oracle->reference[0].size());
        std::memcpy(&scalars[kOracleSeedAt], &oracle_seed, 8);
        std::memcpy(&scalars[kOracleLengthAt], &reference_len, 4);
        CUDA_CHECK(cudaMemcpyAsync(state_.oracle_scalars, scalars.data(), scalars.size() * 4, cudaMemcpyHostToDevice,
                                   s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));  // the host vectors are this call's
}

void DdtreeRound::save_slot(int slot, int stream) {
    cudaStream_t s = model_.stream();
    const int ld = state_.history_ld;
    int32_t* out = pinned_ + static_cast<size_t>(stream) * output_ints(ld);
    const size_t row = static_cast<size_t>(slot) * ld;
    CUDA_CHECK(cudaMemcpyAsync(out, state_.history + row, ld * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(out + ld, state_.accept_log + row, ld * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(out + 2 * ld, state_.count + slot, 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(out + 2 * ld + 1, state_.rounds + slot, 4, cudaMemcpyDeviceToHost, s));
}

void DdtreeRound::compact(const std::vector<int>& keep) {
    cudaStream_t s = model_.stream();
    const int ld = state_.history_ld;
    CUDA_CHECK(cudaMemcpyAsync(state_.keep, keep.data(), keep.size() * 4, cudaMemcpyHostToDevice, s));
    k::SlotArrays arrays{};
    for (auto [data, width] : {std::pair<int32_t*, int64_t>{state_.start, 1}, {state_.bonus, 1}, {state_.count, 1},
                               {state_.rounds, 1}, {state_.stream_base, 1}, {state_.stream_ids, 1},
                               {state_.finished, 1}, {state_.history, ld}, {state_.accept_log, ld},
                               {state_.reference, ld}}) {
        arrays.data[arrays.count] = data;
        arrays.width[arrays.count++] = width;
    }
    CUDA_CHECK(k::compact_slots(arrays, state_.keep, static_cast<int>(keep.size()), s));
}

DdtreeRound::RoundKey DdtreeRound::request_key(const RoundRequest& r) const {
    const int n = static_cast<int>(r.prompts.size());
    const int vocab = model_.dims().vocab;
    const bool automatic = !r.auto_budgets.empty();
    const int top = automatic ? r.auto_budgets.back() : r.budget;  // the largest tree of the generation
    const int depth_limit = has_drafter() ? drafter_.model->dims().block - 1 : r.depth_limit;
    const int width = has_drafter() && r.width == 0 ? std::min(top, vocab) : r.width;
    check(r, top, depth_limit, width);
    check_generation_length(r.prompts, r.max_new_tokens, cache_.max_context());
    // Every node of every round stays within max prompt + max_new_tokens - 1 + depth_limit keys (a finished stream
    // no longer moves); the drafter's context is at most as long, and bounded by its cache.
    int longest = 0;
    for (const auto& p : r.prompts) longest = std::max(longest, static_cast<int>(p.size()));
    const int keys = longest + r.max_new_tokens + depth_limit;
    const int span = cache_.attention_span(keys);
    const int draft_span = has_drafter() ? std::min(keys, drafter_.model->cache().capacity()) : 0;
    ProbeList probe{};
    std::copy(r.auto_budgets.begin(), r.auto_budgets.end(), probe.begin());
    return RoundKey{n, top, depth_limit, width, span, draft_span, r.oracle != nullptr, probe};
}

CostTable DdtreeRound::round_costs(const RoundRequest& r) {
    if (r.auto_budgets.empty()) throw std::invalid_argument("round costs: the request has no auto budgets");
    return measure_costs(r, request_key(r));
}

TreeGeneration DdtreeRound::generate(const RoundRequest& r) {
    const RoundKey base = request_key(r);
    const int n = base.streams;
    const int top = base.budget;
    cudaStream_t s = model_.stream();

    // Auto budgets: the round times (given, or measured once per key by replays from the request's own prefill,
    // before the timed phases), then the policy that picks each round's budget.
    std::optional<BudgetPolicy> policy;
    if (r.chooses_budgets()) policy.emplace(r.auto_budgets, r.measures_costs() ? measure_costs(r, base) : r.costs);
    PhaseClock clock(s);  // start, prefilled, decoded
    start_streams(r);
    clock.mark();

    // slot -> stream; one round stays queued ahead of the host: after launching round r the host reads round
    // r - 1's finished flags (copied to pinned memory behind it, with its accept lengths and probe masses under
    // auto budgets), saves and drops the streams that finished, picks the next round's budget, and stops once every
    // stream has. A round commits at least one token of every live stream, so max_new_tokens rounds finish them all.
    std::vector<int> slots(n), keep, live;  // slot -> stream; the slots and streams a compaction keeps
    for (int i = 0; i < n; ++i) slots[i] = i;
    keep.reserve(n);
    live.reserve(n);
    std::vector<std::vector<int>> flagged_slots(2);  // the slot map each pinned flag copy was taken under
    for (auto& map : flagged_slots) map.reserve(n);
    int32_t* flags = pinned_ + n * output_ints(state_.history_ld);
    int32_t* accepts = flags + 2 * n;
    float* masses = reinterpret_cast<float*>(accepts + 2 * n);
    const int probe_width = static_cast<int>(r.auto_budgets.size());
    int budget = policy ? policy->choose(n) : top;
    int flagged_budget[2] = {budget, budget};  // the budget of the round each copy was taken behind
    std::vector<int32_t> budgets;
    budgets.reserve(r.max_new_tokens + 2);
    int rounds = 0, replays = 0;
    double host_seconds = 0.0;
    std::map<std::string, double> stage_seconds;
    cudaEvent_t copied[2];
    for (cudaEvent_t& e : copied) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    // Finished is sticky and every copy is read in turn, so a stream leaves at the first copy that flags it; every
    // live stream was in every earlier slot map.
    auto read_flags = [&](int parity) {
        CUDA_CHECK(cudaEventSynchronize(copied[parity]));
        const std::vector<int>& map = flagged_slots[parity];
        if (policy) {
            policy->observe(masses + static_cast<size_t>(parity) * n * probe_width, accepts + parity * n,
                            flags + parity * n, static_cast<int>(map.size()), flagged_budget[parity]);
        }
        keep.clear();
        live.clear();
        for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
            const int at = static_cast<int>(std::find(map.begin(), map.end(), slots[i]) - map.begin());
            if (flags[parity * n + at] != 0) {
                save_slot(i, slots[i]);
            } else {
                keep.push_back(i);
                live.push_back(slots[i]);
            }
        }
        if (live.size() != slots.size()) {
            if (!keep.empty()) compact(keep);
            slots.swap(live);
        }
        if (policy && !slots.empty()) budget = policy->choose(static_cast<int>(slots.size()));
    };
    if (r.max_new_tokens <= 1) {  // the prefill's token is all: no round
        for (int i = 0; i < n; ++i) save_slot(i, i);
        slots.clear();
    }
    cudaGraphExec_t graph = nullptr;  // the graph of (slots.size(), budget), looked up when either changes
    int graph_streams = 0, graph_budget = 0;
    std::string graph_label = "round (eager)";  // its NVTX range
    try {
        while (!slots.empty() && rounds <= r.max_new_tokens + 1) {
            const int m = static_cast<int>(slots.size());
            RoundKey key = base;
            key.streams = m;
            key.budget = budget;
            const int parity = rounds % 2;
            if (!r.profile && (m != graph_streams || budget != graph_budget)) {
                graph = graphs_.get(key, s, [&] { record_round(key, nullptr); });
                graph_streams = m;
                graph_budget = budget;
                graph_label = graph_name(key);
            }
            const auto begin = std::chrono::steady_clock::now();
            NvtxRange range(graph_label);
            if (r.profile) {
                OpTimeline timeline(s);
                hold_stream_for_timing(s);
                record_round(key, &timeline);
                CUDA_CHECK(cudaStreamSynchronize(s));
                timeline.accumulate(stage_seconds);
            } else {
                CUDA_CHECK(cudaGraphLaunch(graph, s));
            }
            CUDA_CHECK(cudaMemcpyAsync(flags + parity * n, state_.finished, m * 4, cudaMemcpyDeviceToHost, s));
            if (policy) {
                CUDA_CHECK(cudaMemcpyAsync(accepts + parity * n, state_.accept_len, m * 4, cudaMemcpyDeviceToHost, s));
                CUDA_CHECK(cudaMemcpyAsync(masses + static_cast<size_t>(parity) * n * probe_width, state_.probe,
                                           static_cast<size_t>(m) * probe_width * 4, cudaMemcpyDeviceToHost, s));
            }
            CUDA_CHECK(cudaEventRecord(copied[parity], s));
            if (!r.profile) {
                host_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
                ++replays;
            }
            flagged_slots[parity] = slots;
            flagged_budget[parity] = budget;
            budgets.push_back(budget);
            ++rounds;
            if (r.profile) {
                read_flags(parity);
            } else if (rounds > 1) {
                read_flags(1 - parity);
            }
        }
        if (!slots.empty()) throw std::logic_error("DDTree rounds did not finish every stream");
    } catch (...) {
        for (cudaEvent_t e : copied) cudaEventDestroy(e);
        throw;
    }
    for (cudaEvent_t e : copied) cudaEventDestroy(e);
    clock.mark();
    CUDA_CHECK(cudaStreamSynchronize(s));

    TreeGeneration out;
    const int ld = state_.history_ld;
    out.tokens.resize(n);
    out.accept_lengths.resize(n);
    for (int i = 0; i < n; ++i) {
        const int32_t* saved = pinned_ + static_cast<size_t>(i) * output_ints(ld);
        const int count = std::min(saved[2 * ld], r.max_new_tokens), stream_rounds = std::min(saved[2 * ld + 1], ld);
        out.tokens[i].assign(saved, saved + count);
        out.accept_lengths[i].assign(saved + ld, saved + ld + stream_rounds);
    }
    out.rounds = rounds;
    out.prefill_seconds = clock.seconds(0, 1);
    out.decode_seconds = clock.seconds(1, 2);
    out.host_seconds_per_round = replays > 0 ? host_seconds / replays : 0.0;
    out.budgets = std::move(budgets);
    if (policy) out.costs = policy->costs();
    for (auto& [name, sec] : stage_seconds) out.stages.emplace_back(name, sec);
    return out;
}

}  // namespace ddtree
