#include "nccl_exchange_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "device_arena.h"
#include "forked_stream.h"
#include "graph_cache.h"
#include "graph_replay.h"
#include "nccl_collectives.h"
#include "nccl_communicators.h"

namespace ddtree {

namespace k = ddtree::kernels;

namespace {

// One rank's stream, collectives and scratch on its device (members destroyed in reverse: the stream last).
struct RankSetup {
    SideStream owned_stream;
    cudaStream_t stream = owned_stream.stream();
    DeviceArena arena{DeviceArena::Mode::kAllocate};
    NcclCollectives collectives;
    k::bf16* out = nullptr;
    int32_t* tokens = nullptr;

    RankSetup(const NcclRank& self, int rows, int width)
        : collectives(self, rows, width, arena), out(arena.take<k::bf16>(static_cast<size_t>(rows) * width)),
          tokens(arena.take<int32_t>(rows)) {}
};

void check_sizes(int ranks, int terms, int rows, int width) {
    if (terms < 1 || terms > CollectiveSlots::kMaxTerms || rows < 1 || width < 1) {
        throw std::invalid_argument("terms must be in 1.." + std::to_string(CollectiveSlots::kMaxTerms) +
                                    ", rows and width positive");
    }
    if (ranks < 1) throw std::invalid_argument("devices: at least one CUDA device");
}

}  // namespace

NcclExchangeResult nccl_exchange_check(const std::string& library, const std::vector<int>& devices, int terms,
                                       int rows, int width, const std::vector<std::vector<uint16_t>>& parts,
                                       const std::vector<std::vector<k::RankCandidate>>& candidates) {
    const int ranks = static_cast<int>(devices.size());
    check_sizes(ranks, terms, rows, width);
    const size_t count = static_cast<size_t>(terms) * rows * width;
    if (static_cast<int>(parts.size()) != ranks || static_cast<int>(candidates.size()) != ranks) {
        throw std::invalid_argument("parts and candidates: one entry per device");
    }
    for (int r = 0; r < ranks; ++r) {
        if (parts[r].size() != count || static_cast<int>(candidates[r].size()) != rows) {
            throw std::invalid_argument("parts[" + std::to_string(r) + "] must hold terms x rows x width values and "
                                        "candidates[" + std::to_string(r) + "] rows");
        }
    }
    NcclRanks group(nccl::Library::open(library), devices);
    NcclExchangeResult out{std::vector<std::vector<uint16_t>>(ranks), std::vector<std::vector<int32_t>>(ranks)};
    group.workers.run([&](int r) {
        RankSetup s(group.comms.rank(r), rows, width);
        CUDA_CHECK(cudaMemcpyAsync(s.collectives.partial_slot(r, count), parts[r].data(), count * 2,
                                   cudaMemcpyHostToDevice, s.stream));
        CUDA_CHECK(cudaMemcpyAsync(s.collectives.candidate_slot(r, rows), candidates[r].data(),
                                   rows * sizeof(k::RankCandidate), cudaMemcpyHostToDevice, s.stream));
        const ScopedGraph graph(s.stream, [&] {
            s.collectives.sum_partials(terms, rows, width, s.out, s.stream);
            s.collectives.pick(rows, s.tokens, s.stream);
        });
        out.sums[r].resize(static_cast<size_t>(rows) * width);
        out.tokens[r].resize(rows);
        CUDA_CHECK(cudaGraphLaunch(graph.exec(), s.stream));
        CUDA_CHECK(cudaMemcpyAsync(out.sums[r].data(), s.out, out.sums[r].size() * 2, cudaMemcpyDeviceToHost,
                                   s.stream));
        CUDA_CHECK(cudaMemcpyAsync(out.tokens[r].data(), s.tokens, rows * 4, cudaMemcpyDeviceToHost, s.stream));
        CUDA_CHECK(cudaStreamSynchronize(s.stream));
    });
    return out;
}

std::pair<double, double> time_nccl_exchange(const std::string& library, const std::vector<int>& devices, int terms,
                                             int rows, int width, int per_graph, int iters) {
    const int ranks = static_cast<int>(devices.size());
    check_sizes(ranks, terms, rows, width);
    if (per_graph < 1 || iters < 1) throw std::invalid_argument("per_graph and iters must be positive");
    const size_t count = static_cast<size_t>(terms) * rows * width;
    NcclRanks group(nccl::Library::open(library), devices);
    std::vector<std::pair<double, double>> seconds(ranks);
    group.workers.run([&](int r) {
        const NcclRank self = group.comms.rank(r);
        RankSetup s(self, rows, width);
        CUDA_CHECK(cudaMemsetAsync(s.collectives.partial_slot(0, count), 0, ranks * count * 2, s.stream));
        const nccl::Library& lib = *self.library;
        k::bf16* reduced = s.arena.take<k::bf16>(count);
        CUDA_CHECK(cudaMemsetAsync(reduced, 0, count * 2, s.stream));
        const ScopedGraph gathered(s.stream, [&] {
            for (int i = 0; i < per_graph; ++i) s.collectives.sum_partials(terms, rows, width, s.out, s.stream);
        });
        const ScopedGraph all_reduced(s.stream, [&] {
            for (int i = 0; i < per_graph; ++i) {
                lib.check(lib.all_reduce(reduced, reduced, count, nccl::kBfloat16, nccl::kSum, self.comm, s.stream),
                          "ncclAllReduce");
            }
        });
        const SavedState nothing({}, s.stream);  // the slots' values do not matter to the time
        const auto per_exchange = [&](const ScopedGraph& g) {
            return median(time_replays(g.exec(), s.stream, iters, true, nothing)) / per_graph;
        };
        seconds[r] = {per_exchange(gathered), per_exchange(all_reduced)};
    });
    std::pair<double, double> slowest{0.0, 0.0};
    for (const auto& [g, a] : seconds) slowest = {std::max(slowest.first, g), std::max(slowest.second, a)};
    return slowest;
}

}  // namespace ddtree
