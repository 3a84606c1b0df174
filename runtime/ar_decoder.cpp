#include "ar_decoder.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "nvtx_range.h"
#include "sample.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

std::vector<int32_t> probe_ids(int n, int vocab) {
    std::vector<int32_t> ids(n);
    for (int i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((1 + 7919LL * i) % vocab);
    return ids;
}

namespace {

std::string graph_name(int streams, int span) {
    return "ar streams=" + std::to_string(streams) + " span=" + std::to_string(span);
}

std::string key_name(const std::pair<int, int>& key) { return graph_name(key.first, key.second); }

}  // namespace

void check_generation_length(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens,
                             int max_context) {
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (max_new_tokens < 1 || static_cast<int64_t>(prompts[i].size()) + max_new_tokens > max_context) {
            throw std::invalid_argument("max_new_tokens: prompt " + std::to_string(i) + " of " +
                                        std::to_string(prompts[i].size()) + " tokens + " +
                                        std::to_string(max_new_tokens) +
                                        " new tokens must be at least 1 new token and at most max_context " +
                                        std::to_string(max_context));
        }
    }
}

DecodeState DecodeState::lay_out(int streams, int max_context, DeviceArena& arena) {
    DecodeState s;
    s.rows = RowBatch::lay_out(streams, 0, arena);  // no tree rows: no key indirection
    // A decode row reads its keys contiguously, and its logit rows are its stream rows (n_logits == n).
    s.rows.key_start = nullptr;
    s.rows.logit_stream_ids = s.rows.stream_ids;
    s.rows.logit_positions = s.rows.positions;
    s.history = arena.take<int32_t>(static_cast<size_t>(streams) * max_context);
    s.step = arena.take<int32_t>(1);
    return s;
}

ArDecoder::ArDecoder(TargetModel& model, const LatentCache& cache, const RowBatch& eager_rows,
                     const DecodeState& state)
    : model_(model), cache_(cache), eager_rows_(eager_rows), state_(state) {
    // A replay saves and restores the decode row tables whole, though a decode of fewer streams than the engine
    // has writes only their first entries: zeroed once, they never hold never-written memory (initcheck).
    const RowBatch& rows = state_.rows;
    CUDA_CHECK(cudaMemsetAsync(rows.ids, 0, RowBatch::kRowTables * static_cast<size_t>(rows.capacity) * sizeof(int32_t),
                               model_.stream()));
}

void ArDecoder::prefill_to_history(const std::vector<std::vector<int32_t>>& prompts, float temperature,
                                   uint64_t seed, const PrefillTaps* taps) {
    const int vocab = model_.dims().vocab;
    if (prompts.empty() || static_cast<int>(prompts.size()) > cache_.streams()) {
        throw std::invalid_argument("prompts: 1.." + std::to_string(cache_.streams()) + " prompts, got " +
                                    std::to_string(prompts.size()));
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (prompts[i].empty() || static_cast<int>(prompts[i].size()) > cache_.max_context()) {
            throw std::invalid_argument("prompt " + std::to_string(i) + " has " + std::to_string(prompts[i].size()) +
                                        " tokens; must be 1.." + std::to_string(cache_.max_context()) +
                                        " (max_context)");
        }
        for (size_t p = 0; p < prompts[i].size(); ++p) {
            if (prompts[i][p] < 0 || prompts[i][p] >= vocab) {
                throw std::invalid_argument("prompt " + std::to_string(i) + ": token id " +
                                            std::to_string(prompts[i][p]) + " at position " + std::to_string(p) +
                                            " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
            }
        }
    }
    model_.set_sampling(temperature, seed);
    cudaStream_t s = model_.stream();
    const int64_t ld = cache_.max_context();
    // Rows of all prompts in order, cut into forwards of kPrefillRows rows.
    std::vector<std::pair<int, int>> rows;  // (stream, position)
    for (size_t i = 0; i < prompts.size(); ++i) {
        for (size_t p = 0; p < prompts[i].size(); ++p) rows.emplace_back(static_cast<int>(i), static_cast<int>(p));
    }
    RowBatchBuilder batch(eager_rows_.capacity, eager_rows_.key_stride);  // one host mirror for every chunk
    for (size_t begin = 0; begin < rows.size(); begin += kPrefillRows) {
        const size_t end = std::min(rows.size(), begin + kPrefillRows);
        batch.clear();
        std::vector<int> finished;  // streams whose final prompt token is in this chunk, in logit-row order
        for (size_t r = begin; r < end; ++r) {
            const auto [stream, position] = rows[r];
            const bool last = position + 1 == static_cast<int>(prompts[stream].size());
            batch.add_row(prompts[stream][position], stream, cache_.stream_base(stream), position, last);
            if (last) finished.push_back(stream);
        }
        batch.upload(eager_rows_, s);
        ForwardOutputs outputs;
        if (taps != nullptr) {
            outputs = taps->outputs;
            outputs.n_tap_rows = batch.rows();
        }
        model_.forward(eager_rows_, batch.rows(), batch.logit_rows(), cache_.attention_span(batch.longest()), outputs,
                       nullptr);
        if (taps != nullptr) {
            taps->consume(std::vector<std::pair<int, int>>(rows.begin() + begin, rows.begin() + end));
        }
        if (finished.empty()) continue;
        model_.sample(eager_rows_, batch.logit_rows());
        for (size_t j = 0; j < finished.size(); ++j) {
            CUDA_CHECK(cudaMemcpyAsync(state_.history + finished[j] * ld, model_.tokens() + j, sizeof(int32_t),
                                       cudaMemcpyDeviceToDevice, s));
        }
    }
}

std::vector<int32_t> ArDecoder::prefill(const std::vector<std::vector<int32_t>>& prompts, float temperature,
                                        uint64_t seed) {
    prefill_to_history(prompts, temperature, seed);
    std::vector<int32_t> first(prompts.size());
    const size_t pitch = static_cast<size_t>(cache_.max_context()) * sizeof(int32_t);
    CUDA_CHECK(cudaMemcpy2DAsync(first.data(), sizeof(int32_t), state_.history, pitch, sizeof(int32_t), first.size(),
                                 cudaMemcpyDeviceToHost, model_.stream()));
    CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
    return first;
}

void ArDecoder::set_decode_state(const std::vector<int32_t>& positions, const std::vector<int32_t>* ids,
                                 int32_t step) {
    const int n = static_cast<int>(positions.size());
    RowBatchBuilder batch(state_.rows.capacity, state_.rows.key_stride);
    for (int i = 0; i < n; ++i) {
        batch.add_row(ids != nullptr ? (*ids)[i] : 0, i, cache_.stream_base(i), positions[i], false);
    }
    cudaStream_t s = model_.stream();
    batch.upload(state_.rows, s);
    if (ids == nullptr) {
        const size_t pitch = static_cast<size_t>(cache_.max_context()) * sizeof(int32_t);
        CUDA_CHECK(cudaMemcpy2DAsync(state_.rows.ids, sizeof(int32_t), state_.history, pitch, sizeof(int32_t), n,
                                     cudaMemcpyDeviceToDevice, s));
    }
    CUDA_CHECK(cudaMemcpyAsync(state_.step, &step, sizeof(int32_t), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));  // `step` is the caller's
}

cudaGraphExec_t ArDecoder::decode_graph(int n, int span) {
    return graphs_.get({n, span}, model_.stream(), [&] {
        const RowBatch& rows = state_.rows;
        model_.forward(rows, n, n, span, {}, nullptr);
        model_.sample(rows, n);
        CUDA_CHECK(k::advance_decode(rows.ids, rows.positions, rows.kv_len, rows.slots, rows.kv_start,
                                     model_.tokens(), state_.history, cache_.max_context(), state_.step, n,
                                     model_.stream()));
    });
}

Generation ArDecoder::generate(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens,
                               float temperature, uint64_t seed) {
    check_generation_length(prompts, max_new_tokens, cache_.max_context());
    cudaStream_t s = model_.stream();
    PhaseClock clock(s);  // start, prefilled, decoded
    prefill_to_history(prompts, temperature, seed);
    clock.mark();
    const int n = static_cast<int>(prompts.size());
    std::vector<int32_t> lengths(n);
    for (int i = 0; i < n; ++i) lengths[i] = static_cast<int32_t>(prompts[i].size());
    if (max_new_tokens > 1) {
        set_decode_state(lengths, nullptr, 1);
        // The last step's row of stream i sits at position lengths[i] + max_new_tokens - 2.
        const int longest = *std::max_element(lengths.begin(), lengths.end()) + max_new_tokens - 1;
        const int span = cache_.attention_span(longest);
        const cudaGraphExec_t graph = decode_graph(n, span);
        const std::string name = graph_name(n, span);
        for (int i = 1; i < max_new_tokens; ++i) {
            NvtxRange step(name);
            CUDA_CHECK(cudaGraphLaunch(graph, s));
        }
    }
    // The device only writes the history: only the columns this call filled come back.
    const size_t pitch = static_cast<size_t>(cache_.max_context()) * sizeof(int32_t);
    const size_t filled = static_cast<size_t>(max_new_tokens) * sizeof(int32_t);
    clock.mark();
    std::vector<int32_t> history(static_cast<size_t>(n) * max_new_tokens);
    CUDA_CHECK(cudaMemcpy2DAsync(history.data(), filled, state_.history, pitch, filled, n, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    Generation out;
    out.tokens.resize(n);
    for (int i = 0; i < n; ++i) {
        out.tokens[i].assign(history.begin() + static_cast<size_t>(i) * max_new_tokens,
                             history.begin() + static_cast<size_t>(i + 1) * max_new_tokens);
    }
    out.prefill_seconds = clock.seconds(0, 1);
    out.decode_seconds = clock.seconds(1, 2);
    return out;
}

std::pair<double, double> ArDecoder::time_decode(int n, const std::vector<int32_t>& positions, int iters,
                                                 float temperature, uint64_t seed) {
    if (n < 1 || n > cache_.streams() || static_cast<int>(positions.size()) != n || iters < 1) {
        throw std::invalid_argument("time_decode: need 1.." + std::to_string(cache_.streams()) +
                                    " streams, one position each, iters >= 1");
    }
    for (int32_t p : positions) {
        // The history holds max_context columns and the replays write iters + 1 of them (the warm-up's included).
        if (p < 0 || static_cast<int64_t>(p) + iters + 1 >= cache_.max_context()) {
            throw std::invalid_argument("time_decode: position " + std::to_string(p) + " + iters leaves max_context");
        }
    }
    model_.set_sampling(temperature, seed);
    const std::vector<int32_t> ids = probe_ids(n, model_.dims().vocab);
    cudaStream_t s = model_.stream();
    set_decode_state(positions, &ids, 0);
    // Replays reach kv_len p + iters at most (the warm-up replay is undone by the second set_decode_state).
    const int longest = *std::max_element(positions.begin(), positions.end()) + iters;
    const cudaGraphExec_t graph = decode_graph(n, cache_.attention_span(longest));
    CUDA_CHECK(cudaGraphLaunch(graph, s));  // warm-up
    set_decode_state(positions, &ids, 0);
    PhaseClock clock(s);
    double host = 0.0;
    for (int i = 0; i < iters; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        CUDA_CHECK(cudaGraphLaunch(graph, s));
        host += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    clock.mark();
    return {clock.seconds(0, 1) / iters, host / iters};
}

StepProfile ArDecoder::profile_step(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                                    uint64_t seed) {
    if (n < 1 || n > cache_.streams() || static_cast<int>(positions.size()) != n || iters < 1) {
        throw std::invalid_argument("profile_step: need 1.." + std::to_string(cache_.streams()) +
                                    " streams, one position each, iters >= 1");
    }
    for (int32_t p : positions) {
        if (p < 0 || p >= cache_.max_context()) {
            throw std::invalid_argument("profile_step: position " + std::to_string(p) + " outside 0.." +
                                        std::to_string(cache_.max_context() - 1));
        }
    }
    model_.set_sampling(temperature, seed);
    const std::vector<int32_t> ids = probe_ids(n, model_.dims().vocab);
    set_decode_state(positions, &ids, 0);  // an eager step leaves the rows as they are
    const int span = cache_.attention_span(*std::max_element(positions.begin(), positions.end()) + 1);
    cudaStream_t s = model_.stream();
    std::map<std::string, double> seconds;
    for (int i = 0; i <= iters; ++i) {
        OpTimeline timeline(s);
        hold_stream_for_timing(s);
        model_.forward(state_.rows, n, n, span, {}, &timeline);
        timeline.op("sample", [&] { model_.sample(state_.rows, n); });
        CUDA_CHECK(cudaStreamSynchronize(s));
        if (i > 0) timeline.accumulate(seconds);  // the first pass warms up
    }
    StepProfile out;
    for (auto& [name, sec] : seconds) out.emplace_back(name, sec / iters);
    return out;
}

std::vector<CapturedGraph> ArDecoder::graphs() const { return list_graphs(graphs_, key_name); }

bool ArDecoder::replay(const std::string& name, int n, bool warmup, std::vector<double>* seconds) {
    const auto found = find_graph(graphs_, name, key_name);
    if (!found) return false;
    const auto [key, exec] = *found;
    const auto [streams, span] = key;
    // A row at position p reads p + 1 keys, at most the span (and the cache holds max_context positions).
    const int position = std::min(span, cache_.max_context()) - 1;
    const std::vector<int32_t> ids = probe_ids(streams, model_.dims().vocab);
    set_decode_state(std::vector<int32_t>(streams, position), &ids, 0);
    const RowBatch& rows = state_.rows;
    const SavedState saved({{rows.ids, RowBatch::kRowTables * static_cast<size_t>(rows.capacity) * sizeof(int32_t)},
                            {state_.step, sizeof(int32_t)}},
                           model_.stream());
    *seconds = time_replays(exec, model_.stream(), n, warmup, saved);
    return true;
}

}  // namespace ddtree
