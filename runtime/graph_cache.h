// CUDA graphs captured once per key and replayed. A capture records what `record` enqueues on the stream (relaxed
// mode); one that throws is ended and discarded, leaving the stream usable.
//
// Every instantiated graph holds device memory of its own, and the keys a long-running engine meets (stream counts
// as finished streams are compacted out, attention spans, budgets) are many: a cache keeps at most
// kGraphCacheCapacity graphs and destroys the least recently used one to make room, so the engine's device memory
// stays bounded. A destroyed graph still in flight is freed by CUDA once it completes.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <cstdint>
#include <map>

namespace ddtree {

// Captures `record` on `stream` into an instantiated graph; `graph` receives the graph that the exec was made from.
cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& record, cudaGraph_t* graph);
void destroy_graph(cudaGraphExec_t exec, cudaGraph_t graph);

// One graph captured for a scope (run or timed once, outside any cache) and destroyed with it.
class ScopedGraph {
  public:
    ScopedGraph(cudaStream_t stream, const std::function<void()>& record)
        : exec_(capture_graph(stream, record, &graph_)) {}
    ~ScopedGraph() { destroy_graph(exec_, graph_); }
    ScopedGraph(const ScopedGraph&) = delete;
    ScopedGraph& operator=(const ScopedGraph&) = delete;
    cudaGraphExec_t exec() const { return exec_; }

  private:
    cudaGraph_t graph_ = nullptr;  // before exec_: capture_graph fills it while exec_ is initialised
    cudaGraphExec_t exec_;
};

constexpr size_t kGraphCacheCapacity = 32;

template <typename Key>
class GraphCache {
  public:
    GraphCache() = default;
    ~GraphCache() { clear(); }
    GraphCache(const GraphCache&) = delete;
    GraphCache& operator=(const GraphCache&) = delete;

    // The graph of `key`, captured from `record` on first use.
    cudaGraphExec_t get(const Key& key, cudaStream_t stream, const std::function<void()>& record) {
        auto it = graphs_.find(key);
        if (it != graphs_.end()) {
            it->second.last_use = ++uses_;
            return it->second.exec;
        }
        Captured c;
        c.exec = capture_graph(stream, record, &c.graph);
        c.last_use = ++uses_;
        if (graphs_.size() >= kGraphCacheCapacity) evict_least_recent();
        return graphs_.emplace(key, c).first->second.exec;
    }
    void clear() {
        for (auto& [key, c] : graphs_) destroy_graph(c.exec, c.graph);
        graphs_.clear();
    }
    // Calls visit(key, exec, graph) for every captured graph, in key order; a look-up, not a use.
    template <typename Visit>
    void visit(Visit&& visit) const {
        for (const auto& [key, c] : graphs_) visit(key, c.exec, c.graph);
    }

  private:
    struct Captured {
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        uint64_t last_use = 0;
    };
    void evict_least_recent() {
        auto oldest = graphs_.begin();
        for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
            if (it->second.last_use < oldest->second.last_use) oldest = it;
        }
        destroy_graph(oldest->second.exec, oldest->second.graph);
        graphs_.erase(oldest);
    }
    std::map<Key, Captured> graphs_;
    uint64_t uses_ = 0;
};

}  // namespace ddtree
