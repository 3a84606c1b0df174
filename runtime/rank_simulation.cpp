#include "rank_simulation.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "rank_reduce.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

std::string rank_list_error(int ranks) {
    return "held ranks must be distinct, increasing ranks in 0.." + std::to_string(ranks - 1);
}

}  // namespace

// is_held_ is sized before the check of `ranks`: a negative size would throw std::length_error instead of its message
RankSimulation::RankSimulation(int ranks, std::vector<int> held, int max_rows, int width, DeviceArena& arena)
    : ranks_(ranks), held_(std::move(held)), is_held_(ranks > 0 ? ranks : 0, false) {
    if (ranks < 1) throw std::invalid_argument("ranks must be a positive integer, got " + std::to_string(ranks));
    if (held_.empty()) throw std::invalid_argument(rank_list_error(ranks));
    for (size_t i = 0; i < held_.size(); ++i) {
        if (held_[i] < 0 || held_[i] >= ranks || (i > 0 && held_[i] <= held_[i - 1])) {
            throw std::invalid_argument(rank_list_error(ranks));
        }
        is_held_[held_[i]] = true;
    }
    slots_ = CollectiveSlots::lay_out(ranks, max_rows, width, arena);
}

k::bf16* RankSimulation::partial_slot(int rank, size_t count) { return slots_.partial_slot(rank, count); }

k::RankCandidate* RankSimulation::candidate_slot(int rank, int rows) { return slots_.candidate_slot(rank, rows); }

void RankSimulation::stand_in_for_peers(uint8_t* base, size_t bytes, cudaStream_t stream) const {
    const uint8_t* own = base + held_.front() * bytes;
    for (int r = 0; r < ranks_; ++r) {
        if (!is_held_[r]) CUDA_CHECK(cudaMemcpyAsync(base + r * bytes, own, bytes, cudaMemcpyDeviceToDevice, stream));
    }
}

void RankSimulation::sum_partials(int terms, int rows, int width, k::bf16* out, cudaStream_t stream) {
    const size_t count = slots_.partial_count(terms, rows, width);
    stand_in_for_peers(reinterpret_cast<uint8_t*>(slots_.partials), count * sizeof(k::bf16), stream);
    CUDA_CHECK(k::rank_order_sum(out, slots_.partials, ranks_, terms, rows, width, stream));
}

void RankSimulation::pick(int rows, int32_t* tokens, cudaStream_t stream) {
    stand_in_for_peers(reinterpret_cast<uint8_t*>(slots_.candidates),
                       static_cast<size_t>(rows) * sizeof(k::RankCandidate), stream);
    CUDA_CHECK(k::pick_candidates(tokens, slots_.candidates, ranks_, rows, stream));
}

}  // namespace ddtree
