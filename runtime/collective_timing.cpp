#include "collective_timing.h"

#include "graph_cache.h"
#include "graph_replay.h"

namespace ddtree {

double time_forward_collectives(Collectives& collectives, const ModelDims& dims, int rows, kernels::bf16* out,
                                int32_t* tokens, cudaStream_t stream, int iters) {
    const ScopedGraph graph(stream, [&] {
        for (int layer = 0; layer < dims.layers; ++layer) {
            collectives.sum_partials(1, rows, dims.hidden, out, stream);
            collectives.sum_partials(dims.is_moe(layer) ? 2 : 1, rows, dims.hidden, out, stream);
        }
        collectives.pick(rows, tokens, stream);
    });
    const SavedState nothing({}, stream);  // the slots' contents do not matter: only the time is wanted
    return median(time_replays(graph.exec(), stream, iters, true, nothing));
}

}  // namespace ddtree
