// The collectives of a split target over several GPUs through NCCL (collectives.h), for the one rank this GPU
// holds: each exchange is an in-place ncclAllGather of this rank's part into the slots of collective_slots.h,
// then the same rank-order sum or pick as the rank simulation's, so a G-GPU engine computes bit for bit what the
// one-GPU simulation of every rank computes. Everything is enqueued on the caller's stream without a host wait, so
// it is captured into the forward's CUDA graphs like any kernel; every rank must then replay the same sequence of
// graphs (multi_gpu_engine.h), as NCCL matches the ranks' calls by their order.
#pragma once
#include "collective_slots.h"
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

    int ranks() const override { return self_.ranks; }
    kernels::bf16* partial_slot(int rank, size_t count) override;
    void sum_partials(int terms, int rows, int width, kernels::bf16* out, cudaStream_t stream) override;
    kernels::RankCandidate* candidate_slot(int rank, int rows) override;
    void pick(int rows, int32_t* tokens, cudaStream_t stream) override;

  private:
    NcclRank self_;
    CollectiveSlots slots_;
};

}  // namespace ddtree
