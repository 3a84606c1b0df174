// The device time a target forward spends in its collectives, measured apart from the forward: one forward's
// sequence of them (after each layer's attention one term, after its MLP one for a dense layer and two for a MoE
// layer, then the LM head's pick) captured over `rows` rows into a graph and replayed. On a simulated rank
// (rank_simulation.h) that is the stand-in copies and the rank-order sums inside the forward's own graphs, the part
// of a measured step that real NCCL gathers would replace (tools/bench_ranksim.py).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "collectives.h"
#include "common.cuh"
#include "model_dims.h"

namespace ddtree {

// Median device seconds per replay of that graph over `iters` replays after a warm-up; `out` holds rows x
// dims.hidden and `tokens` rows, the forward's own buffers. The slots' contents are whatever they hold: only the
// time is wanted.
double time_forward_collectives(Collectives& collectives, const ModelDims& dims, int rows, kernels::bf16* out,
                                int32_t* tokens, cudaStream_t stream, int iters);

}  // namespace ddtree
