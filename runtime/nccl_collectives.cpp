#include "nccl_collectives.h"

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "rank_reduce.cuh"

namespace ddtree {

namespace k = ddtree::kernels;

NcclCollectives::NcclCollectives(const NcclRank& self, int max_rows, int width, DeviceArena& arena) : self_(self) {
    if (self.library == nullptr || self.comm == nullptr || self.ranks < 1 || self.rank < 0 ||
        self.rank >= self.ranks) {
        throw std::invalid_argument("NCCL rank " + std::to_string(self.rank) + " of " + std::to_string(self.ranks) +
                                    " needs a library and a communicator");
    }
    slots_ = CollectiveSlots::lay_out(self.ranks, max_rows, width, arena);
}

k::bf16* NcclCollectives::partial_slot(int rank, size_t count) { return slots_.partial_slot(rank, count); }

k::RankCandidate* NcclCollectives::candidate_slot(int rank, int rows) { return slots_.candidate_slot(rank, rows); }

void NcclCollectives::sum_partials(int terms, int rows, int width, k::bf16* out, cudaStream_t stream) {
    const size_t count = slots_.partial_count(terms, rows, width);
    const nccl::Library& lib = *self_.library;
    lib.check(lib.all_gather(slots_.partial_slot(self_.rank, count), slots_.partials, count, nccl::kBfloat16,
                             self_.comm, stream),
              "ncclAllGather (partial sums)");
    CUDA_CHECK(k::rank_order_sum(out, slots_.partials, self_.ranks, terms, rows, width, stream));
}

void NcclCollectives::pick(int rows, int32_t* tokens, cudaStream_t stream) {
    const nccl::Library& lib = *self_.library;
    lib.check(lib.all_gather(slots_.candidate_slot(self_.rank, rows), slots_.candidates,
                             static_cast<size_t>(rows) * sizeof(k::RankCandidate), nccl::kUint8, self_.comm, stream),
              "ncclAllGather (candidates)");
    CUDA_CHECK(k::pick_candidates(tokens, slots_.candidates, self_.ranks, rows, stream));
}

}  // namespace ddtree
