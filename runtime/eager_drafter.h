// The drafter driven from the host, one call at a time: memory laid out once after a pre-flight, host-side
// committed lengths per stream, and row tables built on the host and uploaded before each append or block forward.
// This is the surface of the Python facade, the tests and the benchmark; a DDTree round drives DrafterModel with
// device tables of its own instead.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "device_arena.h"
#include "drafter_model.h"
#include "op_timeline.h"

namespace ddtree {

class EagerDrafter {
  public:
    // window 0: the cache keeps every committed row (max_context per stream); else the last `window`.
    // max_append: context rows per append launch (longer appends take several).
    EagerDrafter(const DrafterDims& dims, const RopeTable& rope, const kernels::bf16* embed,
                 const kernels::bf16* lm_head, int streams, int max_context, int window, int max_append, int device);
    ~EagerDrafter();
    EagerDrafter(const EagerDrafter&) = delete;
    EagerDrafter& operator=(const EagerDrafter&) = delete;

    const DrafterDims& dims() const { return model_->dims(); }
    int streams() const { return streams_; }
    int max_context() const { return max_context_; }
    DrafterWeights& weights() { return model_->weights(); }
    int committed(int stream) const;

    // Appends counts[i] context rows of streams[i] (distinct), in order, from `features` (rows x context_width
    // bf16 bits, the streams' rows one after another), at the stream's next positions.
    void append(const std::vector<int32_t>& streams, const std::vector<int32_t>& counts, const uint16_t* features,
                size_t rows);
    // The block forward of each listed stream at its committed length with its bonus token: fp32 logits
    // [streams][B - 1][vocab].
    std::vector<float> draft(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus);
    // The same block forward's per-depth log-softmax top-k (on the device): log-probs [streams][B - 1][k] and ids.
    std::pair<std::vector<float>, std::vector<int32_t>> draft_top_k(const std::vector<int32_t>& streams,
                                                                    const std::vector<int32_t>& bonus, int k);
    // The cached K and V rows of `stream` in `layer`, oldest position first: bf16 bits [rows][kv_heads][head_dim].
    std::pair<std::vector<uint16_t>, std::vector<uint16_t>> cache_rows(int stream, int layer) const;

    // Benchmark support: random cache contents and committed lengths set without appending.
    void randomize_cache(uint64_t seed);
    void set_committed(const std::vector<int32_t>& streams, const std::vector<int32_t>& lengths);
    // Device time per operation of the last append launch, the block forward of `streams` and its top-k (k 0:
    // none) (eager, one launch at a time, mean of `iters` after a warm-up); the append rewrites the rows it wrote,
    // so the state is unchanged.
    StepProfile profile_round(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus, int iters,
                              int k);
    // Device seconds of that append + block forward + top-k, launched back to back (mean of `iters`).
    double time_round(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus, int iters, int k);

  private:
    void check_stream(int stream, const char* what) const;
    DraftBlockRows stage_block(const std::vector<int32_t>& streams, const std::vector<int32_t>& bonus);
    void run_round(const DraftBlockRows& block, int k, OpTimeline* timeline);

    int streams_, max_context_, device_;
    cudaStream_t stream_ = nullptr;
    DeviceArena arena_;
    std::unique_ptr<DrafterModel> model_;
    std::vector<int> committed_;
    // Host-filled tables: append features, positions and slots; block ids, positions, cache streams, starts and
    // head rows.
    kernels::bf16* features_ = nullptr;
    int32_t* append_tables_ = nullptr;
    int32_t* block_tables_ = nullptr;
    float* top_log_probs_ = nullptr;  // [streams][B - 1][kTopkMax]
    int32_t* top_ids_ = nullptr;
    DraftAppendRows last_append_{};
};

}  // namespace ddtree
