#include "rank_simulation.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"

namespace ddtree {

namespace {

std::string rank_list_error(int ranks) {
    return "held ranks must be distinct, increasing ranks in 0.." + std::to_string(ranks - 1);
}

}  // namespace

RankSimulation::RankSimulation(int ranks, std::vector<int> held, int max_rows, int width, DeviceArena& arena)
    : Collectives(ranks, max_rows, width, arena), held_(std::move(held)), is_held_(ranks, false) {
    if (held_.empty()) throw std::invalid_argument(rank_list_error(ranks));
    for (size_t i = 0; i < held_.size(); ++i) {
        if (held_[i] < 0 || held_[i] >= ranks || (i > 0 && held_[i] <= held_[i - 1])) {
            throw std::invalid_argument(rank_list_error(ranks));
        }
        is_held_[held_[i]] = true;
    }
}

void RankSimulation::fill_peers(uint8_t* base, size_t bytes, cudaStream_t stream) {
    const uint8_t* own = base + held_.front() * bytes;
    for (int r = 0; r < ranks(); ++r) {
        if (!is_held_[r]) CUDA_CHECK(cudaMemcpyAsync(base + r * bytes, own, bytes, cudaMemcpyDeviceToDevice, stream));
    }
}

}  // namespace ddtree
