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
    // A rank that fails between collectives (or ranks that diverge) leaves its peers waiting in NCCL for good, and
    // nothing frees them: ncclCommAbort waits for the graphs holding the communicator to be destroyed, and those
    // ranks' threads are inside them. So when some rank has finished and others are still running `kStuckAfter`
    // later, run() gives them up: it throws, naming the ranks left waiting and saying that the process must exit
    // to free them, and every later run() refuses (abandoned()). A job without collectives (`collectives` false:
    // creating engines, drawing weights) is waited for however long its ranks take.
    void run(const std::function<void(int rank)>& job, bool collectives = true);
    bool abandoned() const { return abandoned_; }

    // The ranks of one job do the same work in lockstep (their collectives pair them up), so they finish within a
    // forward of each other; a rank still running seconds after another finished is waiting for a peer that will
    // not come.
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
    bool stop_ = false;
    bool abandoned_ = false;  // ranks left waiting in a collective: those threads are never joined
    std::vector<std::exception_ptr> errors_;
    std::vector<bool> finished_ranks_;  // this run's ranks that returned or threw
    std::vector<std::thread> threads_;
};

}  // namespace ddtree
