#include "rank_workers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "non_finite_logits.h"

namespace ddtree {

namespace {

// `error` again with `prefix` before its message, of the same kind.
[[noreturn]] void rethrow_with(const std::exception_ptr& error, const std::string& prefix) {
    try {
        std::rethrow_exception(error);
    } catch (const NonFiniteLogits& e) {
        throw NonFiniteLogits(prefix + e.what());
    } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(prefix + e.what());
    } catch (const CudaError& e) {
        throw CudaError(prefix + e.what());
    } catch (const std::exception& e) {
        throw std::runtime_error(prefix + e.what());
    } catch (...) {
        throw std::runtime_error(prefix + "unknown error");
    }
}

std::string message(const std::exception_ptr& error) {
    try {
        std::rethrow_exception(error);
    } catch (const std::exception& e) {
        return e.what();
    } catch (...) {
        return "unknown error";
    }
}

}  // namespace

RankWorkers::RankWorkers(std::vector<int> devices)
    : devices_(std::move(devices)), errors_(devices_.size()), finished_ranks_(devices_.size(), false) {
    threads_.reserve(devices_.size());
    for (int r = 0; r < size(); ++r) threads_.emplace_back([this, r] { serve(r); });
}

RankWorkers::~RankWorkers() {
    std::vector<bool> stuck(threads_.size(), false);
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
        for (int r = 0; r < size(); ++r) stuck[r] = abandoned_ && !finished_ranks_[r];
    }
    start_.notify_all();
    for (int r = 0; r < size(); ++r) {
        if (stuck[r]) {
            threads_[r].detach();  // blocked in NCCL for good; the process's exit ends it
        } else {
            threads_[r].join();  // back waiting for a job: it sees stop_ and returns
        }
    }
}

void RankWorkers::serve(int rank) {
    std::exception_ptr device_error;
    try {
        CUDA_CHECK(cudaSetDevice(devices_[rank]));
    } catch (...) {
        device_error = std::current_exception();  // reported by every job this thread is given
    }
    uint64_t seen = 0;
    for (;;) {
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        const std::function<void(int)>& job = *job_;
        lock.unlock();
        std::exception_ptr error = device_error;
        if (!error) {
            try {
                job(rank);
            } catch (...) {
                error = std::current_exception();
            }
        }
        lock.lock();
        errors_[rank] = error;
        finished_ranks_[rank] = true;
        --pending_;
        finished_.notify_all();
    }
}

void RankWorkers::run(const std::function<void(int rank)>& job, bool collectives) {
    const std::lock_guard<std::mutex> one_run(run_mutex_);  // one job at a time, whatever the callers' threads
    std::unique_lock<std::mutex> lock(mutex_);
    if (abandoned_) {
        throw std::runtime_error("this multi-GPU engine cannot run: ranks of an earlier call are still waiting in a "
                                 "collective; exit the process to free them");
    }
    job_ = &job;
    pending_ = size();
    std::fill(finished_ranks_.begin(), finished_ranks_.end(), false);
    ++generation_;
    start_.notify_all();
    finished_.wait(lock, [&] { return pending_ < size(); });
    if (!collectives) finished_.wait(lock, [&] { return pending_ == 0; });
    if (!finished_.wait_for(lock, kStuckAfter, [&] { return pending_ == 0; })) {
        abandoned_ = true;  // the waiting threads keep `job`'s references; they are never woken
        std::string waiting;
        for (int r = 0; r < size(); ++r) {
            if (!finished_ranks_[r]) waiting += (waiting.empty() ? "" : ", ") + std::to_string(r);
        }
        std::string cause = "the ranks diverged";
        for (int r = 0; r < size(); ++r) {
            if (errors_[r]) {
                cause = "rank " + std::to_string(r) + " failed: " + message(errors_[r]);
                break;
            }
        }
        throw std::runtime_error(cause + "; rank(s) " + waiting + " still wait in a collective " +
                                 std::to_string(kStuckAfter.count()) + " s later, and nothing frees them: exit the "
                                 "process (this engine refuses every further call)");
    }
    job_ = nullptr;
    int first = -1;
    bool alike = true;
    for (int r = 0; r < size(); ++r) {
        if (!errors_[r]) {
            alike = false;
            continue;
        }
        if (first < 0) {
            first = r;
        } else if (message(errors_[r]) != message(errors_[first])) {
            alike = false;
        }
    }
    if (first < 0) return;
    std::exception_ptr error = errors_[first];
    for (std::exception_ptr& e : errors_) e = nullptr;
    lock.unlock();
    if (alike) std::rethrow_exception(error);
    rethrow_with(error, "rank " + std::to_string(first) + ": ");
}

}  // namespace ddtree
