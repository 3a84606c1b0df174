#include "eager_drafter.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "topk.cuh"

namespace ddtree {

namespace {

int capacity_for(int max_context, int window) { return window > 0 ? std::min(window, max_context) : max_context; }

// Int32 entries of the block tables for `streams` streams of block size `block`.
size_t block_table_entries(int streams, int block) {
    return static_cast<size_t>(streams) * (2 * block + 2 + (block - 1));
}

// Entries of the top-k outputs (log-probs and ids each) at the largest k.
size_t top_k_entries(int streams, int block) {
    return static_cast<size_t>(streams) * (block - 1) * kernels::kTopkMax;
}

}  // namespace

EagerDrafter::EagerDrafter(const DrafterDims& dims, const RopeTable& rope, const kernels::bf16* embed,
                           const kernels::bf16* lm_head, int streams, int max_context, int window, int max_append,
                           int device)
    : streams_(streams), max_context_(max_context), device_(device), arena_(DeviceArena::Mode::kAllocate),
      committed_(std::max(streams, 0), 0) {
    if (streams < 1 || max_context < 1 || window < 0 || max_append < 1) {
        throw std::invalid_argument("drafter: streams, max_context and max_append must be positive and window >= 0, "
                                    "got " + std::to_string(streams) + ", " + std::to_string(max_context) + ", " +
                                    std::to_string(max_append) + " and " + std::to_string(window));
    }
    const int capacity = capacity_for(max_context, window);
    CUDA_CHECK(cudaSetDevice(device));
    const size_t tables = static_cast<size_t>(max_append) * dims.context_width() * 2 +
                          (2 * static_cast<size_t>(max_append) + block_table_entries(streams, dims.block)) * 4 +
                          top_k_entries(streams, dims.block) * 8 + 64;
    const size_t planned = DrafterModel::planned_bytes(dims, streams, capacity, max_append) + tables;
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (planned > free_bytes) {
        throw std::invalid_argument("drafter needs " + std::to_string(planned >> 20) + " MiB of device memory, " +
                                    std::to_string(free_bytes >> 20) + " MiB are free");
    }
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    try {
        model_ = std::make_unique<DrafterModel>(dims, rope, embed, lm_head, streams, capacity, max_append, stream_,
                                                arena_);
        features_ = arena_.take<kernels::bf16>(static_cast<size_t>(max_append) * dims.context_width());
        append_tables_ = arena_.take<int32_t>(2 * static_cast<size_t>(max_append));
        block_tables_ = arena_.take<int32_t>(block_table_entries(streams, dims.block));
        top_log_probs_ = arena_.take<float>(top_k_entries(streams, dims.block));
        top_ids_ = arena_.take<int32_t>(top_k_entries(streams, dims.block));
    } catch (...) {
        model_.reset();
        cudaStreamDestroy(stream_);
        throw;
    }
}

EagerDrafter::~EagerDrafter() {
    model_.reset();
    cudaStreamDestroy(stream_);
}

void EagerDrafter::check_stream(int stream, const char* what) const {
    if (stream < 0 || stream >= streams_) {
        throw std::invalid_argument(std::string(what) + ": stream " + std::to_string(stream) + " is outside 0.." +
                                    std::to_string(streams_ - 1));
    }
}

int EagerDrafter::committed(int stream) const {
    check_stream(stream, "committed");
    return committed_[stream];
}

void EagerDrafter::append(const std::vector<int32_t>& streams, const std::vector<int32_t>& counts,
                          const uint16_t* features, size_t rows) {
    const DrafterDims& d = dims();
    if (streams.size() != counts.size()) throw std::invalid_argument("append: streams and counts differ in length");
    size_t total = 0;
    std::vector<bool> seen(streams_, false);
    for (size_t i = 0; i < streams.size(); ++i) {
        check_stream(streams[i], "append");
        if (seen[streams[i]]) throw std::invalid_argument("append: stream " + std::to_string(streams[i]) + " twice");
        seen[streams[i]] = true;
        if (counts[i] < 0 || committed_[streams[i]] + static_cast<int64_t>(counts[i]) > max_context_) {
            throw std::invalid_argument("append: stream " + std::to_string(streams[i]) + " has " +
                                        std::to_string(committed_[streams[i]]) + " committed rows; " +
                                        std::to_string(counts[i]) + " more exceed max_context " +
                                        std::to_string(max_context_));
        }
        total += counts[i];
    }
    if (rows != total) {
        throw std::invalid_argument("append: features has " + std::to_string(rows) + " rows, counts add up to " +
                                    std::to_string(total));
    }
    CUDA_CHECK(cudaSetDevice(device_));
    // Rows a window would drop at once are never projected (as in the reference); the rest go in launches of at
    // most max_append rows, each row's slot distinct within a launch (a stream keeps at most capacity rows).
    const DraftCache& cache = model_->cache();
    const size_t width = d.context_width();
    std::vector<int32_t> positions, slots;
    std::vector<size_t> sources;
    auto flush = [&] {
        const int n = static_cast<int>(positions.size());
        if (n == 0) return;
        std::vector<uint16_t> staged(static_cast<size_t>(n) * width);
        for (int i = 0; i < n; ++i) {
            std::copy_n(features + sources[i] * width, width, staged.begin() + static_cast<size_t>(i) * width);
        }
        CUDA_CHECK(cudaMemcpyAsync(features_, staged.data(), staged.size() * 2, cudaMemcpyHostToDevice, stream_));
        std::vector<int32_t> tables(positions);
        tables.insert(tables.end(), slots.begin(), slots.end());
        CUDA_CHECK(cudaMemcpyAsync(append_tables_, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice, stream_));
        last_append_ = DraftAppendRows{features_, append_tables_, append_tables_ + n, n};
        model_->append(last_append_, nullptr);
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        positions.clear();
        slots.clear();
        sources.clear();
    };
    size_t first = 0;
    for (size_t i = 0; i < streams.size(); ++i) {
        const int s = streams[i], count = counts[i];
        const int kept = std::min(count, cache.capacity());
        for (int r = count - kept; r < count; ++r) {
            const int position = committed_[s] + r;
            positions.push_back(position);
            slots.push_back(cache.slot(s, position));
            sources.push_back(first + r);
            if (static_cast<int>(positions.size()) == model_->max_append()) flush();
        }
        first += count;
    }
    flush();
    for (size_t i = 0; i < streams.size(); ++i) committed_[streams[i]] += counts[i];
}

DraftBlockRows EagerDrafter::stage_block(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus) {
    const DrafterDims& d = dims();
    const int n = static_cast<int>(streams.size());
    if (n < 1 || n > streams_ || bonus.size() != streams.size()) {
        throw std::invalid_argument("draft: 1.." + std::to_string(streams_) +
                                    " streams with one bonus token each expected, got " + std::to_string(n) +
                                    " streams and " + std::to_string(bonus.size()) + " tokens");
    }
    const int b = d.block;
    std::vector<int32_t> ids, positions, cache_streams, starts, head_rows;
    int span = 0;
    for (int i = 0; i < n; ++i) {
        check_stream(streams[i], "draft");
        if (bonus[i] < 0 || bonus[i] >= d.vocab) {
            throw std::invalid_argument("draft: bonus token " + std::to_string(bonus[i]) + " is outside the vocabulary");
        }
        const int start = committed_[streams[i]];
        for (int j = 0; j < b; ++j) {
            ids.push_back(j == 0 ? bonus[i] : d.mask_token);
            positions.push_back(start + j);
            if (j > 0) head_rows.push_back(i * b + j);
        }
        cache_streams.push_back(streams[i]);
        starts.push_back(start);
        span = std::max(span, model_->cache().rows_held(start));
    }
    std::vector<int32_t> tables;
    for (const auto* part : {&ids, &positions, &cache_streams, &starts, &head_rows}) {
        tables.insert(tables.end(), part->begin(), part->end());
    }
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaMemcpyAsync(block_tables_, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // `tables` ends with this call
    const int32_t* t = block_tables_;
    return DraftBlockRows{t, t + n * b, t + 2 * n * b, t + 2 * n * b + n, t + 2 * n * b + 2 * n, n, span};
}

std::vector<float> EagerDrafter::draft(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus) {
    const DraftBlockRows rows = stage_block(streams, bonus);
    model_->block_forward(rows, nullptr);
    const DrafterDims& d = dims();
    std::vector<float> logits(static_cast<size_t>(rows.streams) * (d.block - 1) * d.vocab);
    CUDA_CHECK(cudaMemcpyAsync(logits.data(), model_->logits(), logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return logits;
}

std::pair<std::vector<float>, std::vector<int32_t>> EagerDrafter::draft_top_k(const std::vector<int32_t>& streams,
                                                                             const std::vector<int32_t>& bonus,
                                                                             int k) {
    const DraftBlockRows rows = stage_block(streams, bonus);
    model_->block_forward(rows, nullptr);
    model_->top_k(rows.streams, k, top_log_probs_, top_ids_, nullptr);
    const size_t n = static_cast<size_t>(rows.streams) * (dims().block - 1) * k;
    std::pair<std::vector<float>, std::vector<int32_t>> out{std::vector<float>(n), std::vector<int32_t>(n)};
    CUDA_CHECK(cudaMemcpyAsync(out.first.data(), top_log_probs_, n * 4, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaMemcpyAsync(out.second.data(), top_ids_, n * 4, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return out;
}

std::pair<std::vector<uint16_t>, std::vector<uint16_t>> EagerDrafter::cache_rows(int stream, int layer) const {
    check_stream(stream, "cache_rows");
    const DrafterDims& d = dims();
    if (layer < 0 || layer >= d.layers) {
        throw std::invalid_argument("cache_rows: layer " + std::to_string(layer) + " is outside 0.." +
                                    std::to_string(d.layers - 1));
    }
    CUDA_CHECK(cudaSetDevice(device_));
    const DraftCache& cache = model_->cache();
    const int start = committed_[stream], held = cache.rows_held(start), row = d.kv_dim();
    std::pair<std::vector<uint16_t>, std::vector<uint16_t>> out{std::vector<uint16_t>(size_t(held) * row),
                                                                std::vector<uint16_t>(size_t(held) * row)};
    for (int i = 0; i < held; ++i) {
        const int64_t slot = cache.slot(stream, start - held + i);
        CUDA_CHECK(cudaMemcpyAsync(out.first.data() + size_t(i) * row, cache.keys(layer) + slot * row, row * 2,
                                   cudaMemcpyDeviceToHost, stream_));
        CUDA_CHECK(cudaMemcpyAsync(out.second.data() + size_t(i) * row, cache.values(layer) + slot * row, row * 2,
                                   cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return out;
}

void EagerDrafter::randomize_cache(uint64_t seed) {
    CUDA_CHECK(cudaSetDevice(device_));
    model_->cache().randomize(seed, stream_);
}

void EagerDrafter::set_committed(const std::vector<int32_t>& streams, const std::vector<int32_t>& lengths) {
    if (streams.size() != lengths.size()) throw std::invalid_argument("set_committed: streams and lengths differ");
    for (size_t i = 0; i < streams.size(); ++i) {
        check_stream(streams[i], "set_committed");
        if (lengths[i] < 0 || lengths[i] > max_context_) {
            throw std::invalid_argument("set_committed: length " + std::to_string(lengths[i]) + " is outside 0.." +
                                        std::to_string(max_context_));
        }
        committed_[streams[i]] = lengths[i];
    }
}

void EagerDrafter::run_round(const DraftBlockRows& block, int k, OpTimeline* timeline) {
    model_->append(last_append_, timeline);
    model_->block_forward(block, timeline);
    if (k > 0) model_->top_k(block.streams, k, top_log_probs_, top_ids_, timeline);
}

StepProfile EagerDrafter::profile_round(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus,
                                        int iters, int k) {
    const DraftBlockRows block = stage_block(streams, bonus);
    run_round(block, k, nullptr);  // warm-up
    std::map<std::string, double> seconds;
    for (int i = 0; i < iters; ++i) {
        OpTimeline timeline(stream_);
        hold_stream_for_timing(stream_);
        run_round(block, k, &timeline);
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        timeline.accumulate(seconds);
    }
    StepProfile out;
    for (const auto& [name, total] : seconds) out.emplace_back(name, total / std::max(iters, 1));
    return out;
}

double EagerDrafter::time_round(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus, int iters,
                                int k) {
    const DraftBlockRows block = stage_block(streams, bonus);
    run_round(block, k, nullptr);  // warm-up
    hold_stream_for_timing(stream_);
    PhaseClock clock(stream_);
    for (int i = 0; i < iters; ++i) run_round(block, k, nullptr);
    clock.mark();
    return clock.seconds(0, 1) / std::max(iters, 1);
}

}  // namespace ddtree
