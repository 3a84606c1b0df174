// One persistent host thread per GPU of a multi-GPU engine (multi_gpu_engine.h): each thread keeps its device
// current for the engine's life, and run() hands every thread the same job at once and waits for all of them. The
// ranks' NCCL calls block until every peer has made its matching call, so they must come from concurrent threads;
// and each thread captures its own rank's CUDA graphs.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace ddtree {

class RankWorkers {
  public:
    explicit RankWorkers(std::vector<int> devices);  // thread r runs on devices[r]
    ~RankWorkers();
    RankWorkers(const RankWorkers&) = delete;
    RankWorkers& operator=(const RankWorkers&) = delete;

    int size() const { return static_cast<int>(devices_.size()); }
    // job(rank) on every rank's thread, concurrently; returns once all are done. When a rank throws: the same
    // message from every rank (a refused request: each rank checks it alike) is rethrown as it is; otherwise the
    // lowest failing rank's, its rank named. Either keeps the exception's kind (std::invalid_argument, CudaError,
    // NonFiniteLogits, else std::runtime_error).
    // A rank that fails between collectives leaves its peers waiting in NCCL for it: when some rank has failed
    // and others are still running `kStuckAfter` later, run() calls the unstick hook once (the multi-GPU engine
    // aborts its communicators there, so the waiting ranks fail too) and goes on waiting for them.
    void run(const std::function<void(int rank)>& job);
    void set_unstick(std::function<void()> unstick) { unstick_ = std::move(unstick); }

    // Refusals fail every rank within microseconds of each other; a failure that leaves peers in a collective
    // leaves them there for good, so any wait of seconds tells the two apart.
    static constexpr std::chrono::seconds kStuckAfter{10};

  private:
    void serve(int rank);

    std::vector<int> devices_;
    std::mutex run_mutex_;
    std::mutex mutex_;
    std::condition_variable start_, finished_;
    const std::function<void(int)>* job_ = nullptr;
    uint64_t generation_ = 0;  // bumped by every run: a thread runs each generation's job once
    int pending_ = 0;
    bool failed_ = false;  // some rank's job of this run threw
    bool stop_ = false;
    std::function<void()> unstick_;
    std::vector<std::exception_ptr> errors_;
    std::vector<std::thread> threads_;
};

}  // namespace ddtree
