// CUDA graphs captured once per key and replayed. A capture records what `record` enqueues on the stream (relaxed
// mode); one that throws is ended and discarded, leaving the stream usable.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <map>

namespace ddtree {

// Captures `record` on `stream` into an instantiated graph; `graph` receives the graph that the exec was made from.
cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& record, cudaGraph_t* graph);
void destroy_graph(cudaGraphExec_t exec, cudaGraph_t graph);

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
        if (it != graphs_.end()) return it->second.exec;
        Captured c;
        c.exec = capture_graph(stream, record, &c.graph);
        return graphs_.emplace(key, c).first->second.exec;
    }
    size_t size() const { return graphs_.size(); }
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
    };
    std::map<Key, Captured> graphs_;
};

}  // namespace ddtree
