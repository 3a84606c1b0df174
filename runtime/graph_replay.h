// Replaying one captured graph on its own, for profiling: what a listing says of it, and timed replays that each
// start from the same saved device state.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "graph_cache.h"

namespace ddtree {

// One captured graph: a stable name that says what it runs and for which key (e.g. "ar streams=4 span=1024"), and
// its node count.
struct CapturedGraph {
    std::string name;
    size_t nodes = 0;
};

size_t graph_node_count(cudaGraph_t graph);

// Every graph `cache` holds, named by name(key).
template <typename Key, typename Name>
std::vector<CapturedGraph> list_graphs(const GraphCache<Key>& cache, Name&& name) {
    std::vector<CapturedGraph> out;
    cache.visit([&](const Key& key, cudaGraphExec_t, cudaGraph_t graph) {
        out.push_back({name(key), graph_node_count(graph)});
    });
    return out;
}

// The key and graph of `cache` that name(key) calls `wanted`, if it holds one.
template <typename Key, typename Name>
std::optional<std::pair<Key, cudaGraphExec_t>> find_graph(const GraphCache<Key>& cache, const std::string& wanted,
                                                          Name&& name) {
    std::optional<std::pair<Key, cudaGraphExec_t>> found;
    cache.visit([&](const Key& key, cudaGraphExec_t exec, cudaGraph_t) {
        if (name(key) == wanted) found.emplace(key, exec);
    });
    return found;
}

// Device arrays a graph reads and advances, copied aside at construction; restore() copies them back on the stream
// (device to device), so that replay after replay starts from one state.
class SavedState {
  public:
    SavedState(std::vector<std::pair<void*, size_t>> arrays, cudaStream_t stream);  // (pointer, bytes)
    ~SavedState();
    SavedState(const SavedState&) = delete;
    SavedState& operator=(const SavedState&) = delete;
    void restore() const;

  private:
    std::vector<std::pair<void*, size_t>> arrays_;
    cudaStream_t stream_;
    char* saved_ = nullptr;
};

// The most replays one call times.
constexpr int kMaxReplays = 10000;

// Device seconds of each of `n` replays of `exec` on `stream`, each timed by its own pair of CUDA events and
// preceded (untimed) by state.restore(); first one untimed warm-up replay when `warmup`. The timed replays run
// inside the NVTX range "replay" (Nsight Compute: --nvtx --nvtx-include "replay/").
std::vector<double> time_replays(cudaGraphExec_t exec, cudaStream_t stream, int n, bool warmup,
                                 const SavedState& state);

// The median of `seconds` (the mean of the middle two for an even count); seconds is not empty.
double median(std::vector<double> seconds);

}  // namespace ddtree
