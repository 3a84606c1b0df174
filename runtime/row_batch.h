// The rows of one forward in device memory, and their host-side builder. A row is one token of one stream: its id,
// RoPE position, where its keys are (the stream's contiguous prefix, then for a tree node its ancestors through the
// key indirection, see MlaTreeKeys), the cache row its own key goes to, and whether it gets logits (with the
// stream and position that key its sampling noise).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "device_arena.h"

namespace ddtree {

struct RowBatch {
    // Per row, each table `capacity` long.
    int32_t* ids = nullptr;
    int32_t* positions = nullptr;
    int32_t* kv_start = nullptr;   // first cache row of the row's stream
    int32_t* kv_len = nullptr;     // keys visible to the row (position + 1)
    int32_t* slots = nullptr;      // cache row the row's own key is written to
    int32_t* stream_ids = nullptr;
    int32_t* key_start = nullptr;  // first logical position read through key_nodes (kv_len for plain rows)
    // Per logit row (increasing row indices).
    int32_t* logit_rows = nullptr;
    int32_t* logit_stream_ids = nullptr;
    int32_t* logit_positions = nullptr;
    int32_t* key_nodes = nullptr;  // [capacity][key_stride]: node index of the ancestor at each depth
    int capacity = 0, key_stride = 0;

    static constexpr int kRowTables = 10;  // the int32 tables above key_nodes, one after another from ids
    static RowBatch lay_out(int capacity, int key_stride, DeviceArena& arena);
};

// Host mirror of a RowBatch, filled row by row and uploaded in two copies: the used rows of every table, and the
// key indirection of the rows up to the last tree row (it grows with them: a batch of plain rows has none).
class RowBatchBuilder {
  public:
    RowBatchBuilder(int capacity, int key_stride);
    int rows() const { return rows_; }
    int logit_rows() const { return logits_; }
    int longest() const { return longest_; }  // the most keys any row sees
    // Empty again, to fill the next batch (only the rows added count, so the tables need no clearing).
    void clear() {
        rows_ = logits_ = longest_ = 0;
        key_nodes_.clear();
    }

    // A row whose keys are the stream's positions 0..position (prefill, decode).
    void add_row(int32_t id, int32_t stream, int32_t stream_base, int32_t position, bool logits);
    // Tree node `node` at depth `depth` of a stream committed up to `start`: `path` holds the node indices of its
    // ancestors-and-self, root first (depth + 1 of them); its key goes to the node slot start + node.
    void add_tree_row(int32_t id, int32_t stream, int32_t stream_base, int32_t start, int32_t node,
                      const int32_t* path, int depth, bool logits);
    void upload(const RowBatch& device, cudaStream_t stream) const;

  private:
    int32_t& table(int t, int row) { return host_[static_cast<size_t>(t) * capacity_ + row]; }
    int add(int32_t id, int32_t stream, int32_t stream_base, int32_t position, int32_t slot, int32_t key_start,
            bool logits);

    int capacity_, key_stride_, rows_ = 0, logits_ = 0, longest_ = 0;
    std::vector<int32_t> host_, key_nodes_;
};

}  // namespace ddtree
