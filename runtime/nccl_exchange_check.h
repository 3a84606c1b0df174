// NcclCollectives on their own, outside an engine, over real communicators: a check that the library loads, the
// communicators come up and the in-place gathers plus rank-order sum and pick give what the rank simulation gives,
// captured in a CUDA graph per rank (tests/gpu/test_multigpu.py; one GPU is enough for the loading and the
// capture); and the time of a partial-sum exchange against a plain ncclAllReduce of the same bytes
// (tools/bench_multigpu.py). One rank per device, one host thread per rank (rank_workers.h).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sample.cuh"

namespace ddtree {

struct NcclExchangeResult {
    std::vector<std::vector<uint16_t>> sums;   // per rank: bf16 bits [rows, width]
    std::vector<std::vector<int32_t>> tokens;  // per rank: [rows]
};

// parts[r]: rank r's bf16 bits [terms, rows, width]; candidates[r]: its [rows] (value, global id). Each rank
// writes its own into its slots, then replays one captured graph of sum_partials and pick. Every rank's result
// should be the same: the rank-order sum of all parts and the best candidate of each row.
NcclExchangeResult nccl_exchange_check(const std::string& library, const std::vector<int>& devices, int terms,
                                       int rows, int width, const std::vector<std::vector<uint16_t>>& parts,
                                       const std::vector<std::vector<kernels::RankCandidate>>& candidates);

// Device seconds per exchange of terms x rows x width bf16 partial sums (the slowest rank's median over `iters`
// replays of a graph of `per_graph` exchanges, divided by per_graph): gather then rank-order sum, and
// ncclAllReduce (sum, bf16) of the same count in place.
std::pair<double, double> time_nccl_exchange(const std::string& library, const std::vector<int>& devices, int terms,
                                             int rows, int width, int per_graph, int iters);

}  // namespace ddtree
