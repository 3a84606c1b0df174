#include "row_batch.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_check.h"

namespace ddtree {

namespace {

enum Table { kIds, kPositions, kKvStart, kKvLen, kSlots, kStreamIds, kKeyStart, kLogitRows, kLogitStreams,
             kLogitPositions };

}  // namespace

RowBatch RowBatch::lay_out(int capacity, int key_stride, DeviceArena& arena) {
    RowBatch b;
    b.capacity = capacity;
    b.key_stride = key_stride;
    int32_t* tables = arena.take<int32_t>(static_cast<size_t>(kRowTables) * capacity);
    b.key_nodes = arena.take<int32_t>(static_cast<size_t>(capacity) * key_stride);
    if (tables == nullptr) return b;  // counted only
    int32_t** fields[kRowTables] = {&b.ids,        &b.positions, &b.kv_start,         &b.kv_len,
                                    &b.slots,      &b.stream_ids, &b.key_start,       &b.logit_rows,
                                    &b.logit_stream_ids, &b.logit_positions};
    for (int t = 0; t < kRowTables; ++t) *fields[t] = tables + static_cast<size_t>(t) * capacity;
    return b;
}

RowBatchBuilder::RowBatchBuilder(int capacity, int key_stride)
    : capacity_(capacity), key_stride_(key_stride), host_(static_cast<size_t>(RowBatch::kRowTables) * capacity, 0) {}

int RowBatchBuilder::add(int32_t id, int32_t stream, int32_t stream_base, int32_t position, int32_t slot,
                         int32_t key_start, bool logits) {
    if (rows_ == capacity_) {
        throw std::invalid_argument("a forward takes at most " + std::to_string(capacity_) + " rows");
    }
    const int r = rows_++;
    table(kIds, r) = id;
    table(kPositions, r) = position;
    table(kKvStart, r) = stream_base;
    table(kKvLen, r) = position + 1;
    table(kSlots, r) = slot;
    table(kStreamIds, r) = stream;
    table(kKeyStart, r) = key_start;
    longest_ = std::max(longest_, position + 1);
    if (logits) {
        table(kLogitRows, logits_) = r;
        table(kLogitStreams, logits_) = stream;
        table(kLogitPositions, logits_) = position;
        ++logits_;
    }
    return r;
}

void RowBatchBuilder::add_row(int32_t id, int32_t stream, int32_t stream_base, int32_t position, bool logits) {
    add(id, stream, stream_base, position, stream_base + position, position + 1, logits);
}

void RowBatchBuilder::add_tree_row(int32_t id, int32_t stream, int32_t stream_base, int32_t start, int32_t node,
                                   const int32_t* path, int depth, bool logits) {
    if (depth >= key_stride_) {
        throw std::invalid_argument("tree depth " + std::to_string(depth) + " exceeds the engine's budget " +
                                    std::to_string(key_stride_ - 1));
    }
    const int r = add(id, stream, stream_base, start + depth, stream_base + start + node, start, logits);
    key_nodes_.resize(static_cast<size_t>(r + 1) * key_stride_, 0);
    std::copy(path, path + depth + 1, key_nodes_.begin() + static_cast<size_t>(r) * key_stride_);
}

void RowBatchBuilder::upload(const RowBatch& device, cudaStream_t stream) const {
    if (device.capacity != capacity_ || device.key_stride != key_stride_) {
        throw std::logic_error("a row batch is uploaded into device tables of another shape");
    }
    if (rows_ == 0) return;
    const size_t pitch = static_cast<size_t>(capacity_) * sizeof(int32_t);  // the device tables' too
    CUDA_CHECK(cudaMemcpy2DAsync(device.ids, pitch, host_.data(), pitch, rows_ * sizeof(int32_t), RowBatch::kRowTables,
                                 cudaMemcpyHostToDevice, stream));
    if (!key_nodes_.empty()) {
        CUDA_CHECK(cudaMemcpyAsync(device.key_nodes, key_nodes_.data(), key_nodes_.size() * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream));
    }
    // The host tables are the builder's: the copies must land before it is reused or destroyed.
    CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace ddtree
