#include "rank_simulation.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "rank_reduce.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

constexpr int kMaxTerms = 2;  // a MoE layer's shared and routed experts

std::string rank_list_error(int ranks) {
    return "held ranks must be distinct, increasing ranks in 0.." + std::to_string(ranks - 1);
}

}  // namespace

void RankSimulation::lay_out(int ranks, int max_rows, int width, DeviceArena& arena) {
    arena.take<k::bf16>(static_cast<size_t>(ranks) * kMaxTerms * max_rows * width);
    arena.take<k::RankCandidate>(static_cast<size_t>(ranks) * max_rows);
}

RankSimulation::RankSimulation(int ranks, std::vector<int> held, int max_rows, int width, DeviceArena& arena)
    : ranks_(ranks), held_(std::move(held)), is_held_(ranks, false),
      capacity_(static_cast<size_t>(kMaxTerms) * max_rows * width), max_rows_(max_rows) {
    if (ranks < 1) throw std::invalid_argument("ranks must be a positive integer, got " + std::to_string(ranks));
    if (held_.empty()) throw std::invalid_argument(rank_list_error(ranks));
    for (size_t i = 0; i < held_.size(); ++i) {
        if (held_[i] < 0 || held_[i] >= ranks || (i > 0 && held_[i] <= held_[i - 1])) {
            throw std::invalid_argument(rank_list_error(ranks));
        }
        is_held_[held_[i]] = true;
    }
    partials_ = arena.take<k::bf16>(static_cast<size_t>(ranks) * capacity_);
    candidates_ = arena.take<k::RankCandidate>(static_cast<size_t>(ranks) * max_rows);
}

k::bf16* RankSimulation::partial_slot(int rank, size_t count) {
    if (rank < 0 || rank >= ranks_ || count > capacity_) {
        throw std::invalid_argument("partial_slot: rank " + std::to_string(rank) + " of " + std::to_string(ranks_) +
                                    ", count " + std::to_string(count) + " (at most " + std::to_string(capacity_) +
                                    ")");
    }
    return partials_ + rank * count;
}

k::RankCandidate* RankSimulation::candidate_slot(int rank, int rows) {
    if (rank < 0 || rank >= ranks_ || rows < 0 || rows > max_rows_) {
        throw std::invalid_argument("candidate_slot: rank " + std::to_string(rank) + " of " +
                                    std::to_string(ranks_) + ", rows " + std::to_string(rows) + " (at most " +
                                    std::to_string(max_rows_) + ")");
    }
    return candidates_ + static_cast<size_t>(rank) * rows;
}

void RankSimulation::stand_in_for_peers(uint8_t* base, size_t bytes, cudaStream_t stream) const {
    const uint8_t* own = base + held_.front() * bytes;
    for (int r = 0; r < ranks_; ++r) {
        if (!is_held_[r]) CUDA_CHECK(cudaMemcpyAsync(base + r * bytes, own, bytes, cudaMemcpyDeviceToDevice, stream));
    }
}

void RankSimulation::sum_partials(int terms, int rows, int width, k::bf16* out, cudaStream_t stream) {
    const size_t count = static_cast<size_t>(terms) * rows * width;
    if (terms < 1 || terms > kMaxTerms || count > capacity_) {
        throw std::invalid_argument("sum_partials: " + std::to_string(terms) + " terms of " + std::to_string(rows) +
                                    " x " + std::to_string(width) + " exceed the slots");
    }
    stand_in_for_peers(reinterpret_cast<uint8_t*>(partials_), count * sizeof(k::bf16), stream);
    CUDA_CHECK(k::rank_order_sum(out, partials_, ranks_, terms, rows, width, stream));
}

void RankSimulation::pick(int rows, int32_t* tokens, cudaStream_t stream) {
    stand_in_for_peers(reinterpret_cast<uint8_t*>(candidates_), static_cast<size_t>(rows) * sizeof(k::RankCandidate),
                       stream);
    CUDA_CHECK(k::pick_candidates(tokens, candidates_, ranks_, rows, stream));
}

}  // namespace ddtree
