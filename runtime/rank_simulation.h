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

#include "collectives.h"
#include "device_arena.h"

namespace ddtree {

class RankSimulation final : public Collectives {
  public:
    RankSimulation(int ranks, std::vector<int> held, int max_rows, int width, DeviceArena& arena);
    const std::vector<int>& held() const { return held_; }

  private:
    // Copies the first held rank's part over every rank not held.
    void fill_peers(uint8_t* base, size_t bytes, cudaStream_t stream) override;

    std::vector<int> held_;
    std::vector<bool> is_held_;
};

}  // namespace ddtree
