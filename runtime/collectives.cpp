#include "collectives.h"

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "rank_reduce.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

int checked_ranks(int ranks) {
    if (ranks < 1) throw std::invalid_argument("ranks must be a positive integer, got " + std::to_string(ranks));
    return ranks;
}

}  // namespace

Collectives::Collectives(int ranks, int max_rows, int width, DeviceArena& arena)
    : slots_(CollectiveSlots::lay_out(checked_ranks(ranks), max_rows, width, arena)) {}

void Collectives::sum_partials(int terms, int rows, int width, k::bf16* out, cudaStream_t stream) {
    const size_t count = slots_.partial_count(terms, rows, width);
    fill_peers(reinterpret_cast<uint8_t*>(slots_.partials), count * sizeof(k::bf16), stream);
    CUDA_CHECK(k::rank_order_sum(out, slots_.partials, slots_.ranks, terms, rows, width, stream));
}

void Collectives::pick(int rows, int32_t* tokens, cudaStream_t stream) {
    fill_peers(reinterpret_cast<uint8_t*>(slots_.candidates), static_cast<size_t>(rows) * sizeof(k::RankCandidate),
               stream);
    CUDA_CHECK(k::pick_candidates(tokens, slots_.candidates, slots_.ranks, rows, stream));
}

}  // namespace ddtree
