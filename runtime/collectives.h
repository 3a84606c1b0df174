// The exchanges between the GPUs a target is split over (shard.h): the 2 x layers + 1 collective points of a
// forward, inside its CUDA graph. One interface, so that the forward does not know whether its peers are real:
// - sum_partials: every rank's partial sums [terms, rows, width] (an attention's o_proj, a MLP's down projection;
//   a MoE layer's shared and routed experts as two terms) are gathered onto every rank and added there in rank
//   order, then term order, in fp32 (kernels/rank_reduce.cuh). An all-reduce may choose its algorithm and chunking
//   by message size, so its sums could change with the number of rows; gathering then adding in a fixed order keeps
//   a row's result independent of the batch and of the transport.
// - pick: every rank's best (value, id) of a row over its vocabulary slice (greedy or Gumbel-max, sample.cuh) is
//   gathered and the best taken, ties to the lower id: the token one GPU would choose over the whole vocabulary.
// A rank writes its part into its slot (collective_slots.h), then calls the collective on its stream. What differs
// between the implementations is only how the peers' slots get filled (fill_peers); the sums and picks over the
// filled slots are this class's, so every implementation computes bit for bit the same thing from the same parts.
// Implementations: RankSimulation (rank_simulation.h, one GPU); NcclCollectives (nccl_collectives.h, a GPU per rank).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "collective_slots.h"
#include "common.cuh"
#include "device_arena.h"
#include "sample.cuh"

namespace ddtree {

class Collectives {
  public:
    // Slots for `ranks` ranks of at most `max_rows` rows of `width` (std::invalid_argument for ranks < 1).
    Collectives(int ranks, int max_rows, int width, DeviceArena& arena);
    virtual ~Collectives() = default;
    Collectives(const Collectives&) = delete;
    Collectives& operator=(const Collectives&) = delete;

    int ranks() const { return slots_.ranks; }
    // Where rank `rank` writes its `count` = terms x rows x width partial elements for the next sum_partials
    // (rank_order_sum's layout: rank r's part at r x count, so an in-place all-gather fills the others).
    kernels::bf16* partial_slot(int rank, size_t count) { return slots_.partial_slot(rank, count); }
    // out[rows, width] = the rank-order sum of every rank's slot (see above); enqueued on `stream`.
    void sum_partials(int terms, int rows, int width, kernels::bf16* out, cudaStream_t stream);
    // Where rank `rank` writes its candidates of `rows` rows for the next pick.
    kernels::RankCandidate* candidate_slot(int rank, int rows) { return slots_.candidate_slot(rank, rows); }
    // tokens[row] = the best candidate over every rank's; enqueued on `stream`.
    void pick(int rows, int32_t* tokens, cudaStream_t stream);

  protected:
    // Fills every peer's part of the slots at `base`, rank r's `bytes` at base + r x bytes, from the parts this GPU
    // wrote; enqueued on `stream`.
    virtual void fill_peers(uint8_t* base, size_t bytes, cudaStream_t stream) = 0;

  private:
    CollectiveSlots slots_;
};

}  // namespace ddtree
