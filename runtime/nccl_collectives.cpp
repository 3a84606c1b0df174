#include "nccl_collectives.h"

#include <stdexcept>
#include <string>

namespace ddtree {

namespace {

const NcclRank& checked(const NcclRank& self) {
    if (self.library == nullptr || self.comm == nullptr || self.ranks < 1 || self.rank < 0 ||
        self.rank >= self.ranks) {
        throw std::invalid_argument("NCCL rank " + std::to_string(self.rank) + " of " + std::to_string(self.ranks) +
                                    " needs a library and a communicator");
    }
    return self;
}

}  // namespace

NcclCollectives::NcclCollectives(const NcclRank& self, int max_rows, int width, DeviceArena& arena)
    : Collectives(checked(self).ranks, max_rows, width, arena), self_(self) {}

void NcclCollectives::fill_peers(uint8_t* base, size_t bytes, cudaStream_t stream) {
    const nccl::Library& lib = *self_.library;
    lib.check(lib.all_gather(base + self_.rank * bytes, base, bytes, nccl::kUint8, self_.comm, stream),
              "ncclAllGather");
}

}  // namespace ddtree
