// The collectives of a split target on one GPU (collectives.h), for the ranks this GPU computes:
// - every rank (held = all): the engine computes each rank's share in turn and the sums and picks are exact, so the
//   one GPU reproduces what G GPUs would give (tests/gpu/test_ranksim.py);
// - one rank (held = {rank}): the engine is one rank of G, its per-rank time measured (tools/bench_ranksim.py). The
//   peers' parts do not exist: same-size device copies of this rank's part into their slots stand for the
//   all-gather, then the same rank-order sum or pick runs, so the time is the rank's own with local collectives
//   (the NVLink transfer is modelled by ddtree.estimate, not measured here); the values are not those of a model.
// The slots are collective_slots.h's, as NCCL's (nccl_collectives.h).
#pragma once
#include <vector>

#include "collective_slots.h"
#include "collectives.h"
#include "device_arena.h"

namespace ddtree {

class RankSimulation final : public Collectives {
  public:
    RankSimulation(int ranks, std::vector<int> held, int max_rows, int width, DeviceArena& arena);
    int ranks() const override { return ranks_; }
    const std::vector<int>& held() const { return held_; }
    kernels::bf16* partial_slot(int rank, size_t count) override;
    void sum_partials(int terms, int rows, int width, kernels::bf16* out, cudaStream_t stream) override;
    kernels::RankCandidate* candidate_slot(int rank, int rows) override;
    void pick(int rows, int32_t* tokens, cudaStream_t stream) override;

  private:
    // Copies the first held rank's slot of `bytes` (slots `bytes` apart from `base`) over every rank not held.
    void stand_in_for_peers(uint8_t* base, size_t bytes, cudaStream_t stream) const;

    int ranks_;
    std::vector<int> held_;
    std::vector<bool> is_held_;
    CollectiveSlots slots_;
};

}  // namespace ddtree
