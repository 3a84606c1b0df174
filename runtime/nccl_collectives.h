// The collectives of a split target over several GPUs through NCCL (collectives.h), for the one rank this GPU
// holds: each exchange is an in-place ncclAllGather of this rank's part into the slots of collective_slots.h,
// then the same rank-order sum or pick as the rank simulation's, so a G-GPU engine computes bit for bit what the
// one-GPU simulation of every rank computes. Everything is enqueued on the caller's stream without a host wait, so
// it is captured into the forward's CUDA graphs like any kernel; every rank must then replay the same sequence of
// graphs (multi_gpu_engine.h), as NCCL matches the ranks' calls by their order.
#pragma once
#include "collectives.h"
#include "device_arena.h"
#include "nccl_library.h"

namespace ddtree {

// Rank `rank` of `ranks` in a communicator (ncclCommInitAll's; not owned).
struct NcclRank {
    const nccl::Library* library = nullptr;
    nccl::Comm comm = nullptr;
    int rank = 0, ranks = 1;
};

class NcclCollectives final : public Collectives {
  public:
    NcclCollectives(const NcclRank& self, int max_rows, int width, DeviceArena& arena);

  private:
    // An in-place ncclAllGather of this rank's part (bytes: a gather only moves them).
    void fill_peers(uint8_t* base, size_t bytes, cudaStream_t stream) override;

    NcclRank self_;
};

}  // namespace ddtree
