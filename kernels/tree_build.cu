// DDTree build: one CTA per stream. Warp 0 runs the reference's best-first heap as a frontier (every pushed, not
// yet popped entry); each pop takes the frontier's best entry by the heap's own total order (score descending, then
// rank tuple ascending), so the pops, and with them the node numbering, are the reference's. The frontier's slots
// are dealt round-robin to the 32 lanes and live in their registers (kSlots per lane, a compile-time count chosen
// from the budget); each lane keeps the best of its slots, and a pop is a warp arg-max over those: a redux.sync
// over the high half of an order-preserving 64-bit key of the score (a second over the low half when lanes share
// the high one), then the rank tuple among the (rare) lanes of exactly equal score. A pop is a short chain of warp
// operations, with no shared-memory round trip on the path from one pop to the next (each lane fetches its best
// entry's successor log-probs ahead of time). The nodes' parents, ranks
// and links go to shared memory as they are popped; after the last pop all threads derive the ancestor rows and
// write the tree's arrays from there.
#include <atomic>
#include <type_traits>

#include "gemm_mma.cuh"  // opt_in_smem
#include "tree_build.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kAncestorStride = kTreeMaxDepth + 1;  // ancestor row of a node: depths 0..15

// A frontier entry's parent (0..1024, 11 bits), depth (1..15, 4 bits) and rank (0..1023, 10 bits) in one word.
struct Entry {
    int parent, depth, rank;
};
__device__ __forceinline__ uint32_t pack_entry(int parent, int depth, int rank) {
    return static_cast<uint32_t>(parent) | static_cast<uint32_t>(depth) << 11 | static_cast<uint32_t>(rank) << 15;
}
__device__ __forceinline__ Entry unpack_entry(uint32_t m) {
    return {static_cast<int>(m & 2047u), static_cast<int>((m >> 11) & 15u), static_cast<int>(m >> 15)};
}

// Byte offsets of the CTA's shared arrays; the host sizes the launch with the same computation.
struct BuildLayout {
    int top_k, rows;
    unsigned lp, ids, anc, parent, rank, first, next, depth, bytes;

    __host__ __device__ BuildLayout(int budget, int depth_limit, int width) {
        top_k = budget < width ? budget : width;  // ranks at or past min(budget, K) are never pushed
        rows = tree_rows(budget);
        const unsigned candidates = static_cast<unsigned>(depth_limit * top_k);
        unsigned at = 0;
        auto take = [&at](unsigned bytes, unsigned align) {
            at = (at + align - 1) / align * align;
            const unsigned offset = at;
            at += bytes;
            return offset;
        };
        lp = take(4u * candidates, 4);
        ids = take(4u * candidates, 4);
        anc = take(2u * rows * kAncestorStride, 2);
        parent = take(2u * rows, 2);
        rank = take(2u * rows, 2);
        first = take(2u * rows, 2);
        next = take(2u * rows, 2);
        depth = take(1u * rows, 1);
        bytes = take(0, 16);
    }
};

struct BuildSmem {
    float* lp;          // [L, top_k]
    int32_t* ids;       // [L, top_k]
    int16_t* anc;       // [rows, kAncestorStride]: ancestors at depths 0..depth (the node last), after the pops
    int16_t* parent;    // [rows]
    int16_t* rank;      // [rows]
    int16_t* first;     // [rows] first child
    int16_t* next;      // [rows] next sibling
    int8_t* depth;      // [rows]
    int top_k;

    __device__ BuildSmem(unsigned char* base, const BuildLayout& l)
        : lp(reinterpret_cast<float*>(base + l.lp)),
          ids(reinterpret_cast<int32_t*>(base + l.ids)),
          anc(reinterpret_cast<int16_t*>(base + l.anc)),
          parent(reinterpret_cast<int16_t*>(base + l.parent)),
          rank(reinterpret_cast<int16_t*>(base + l.rank)),
          first(reinterpret_cast<int16_t*>(base + l.first)),
          next(reinterpret_cast<int16_t*>(base + l.next)),
          depth(reinterpret_cast<int8_t*>(base + l.depth)),
          top_k(l.top_k) {}
};

// Order of two entries of equal score: their rank tuples (the rank chosen at depths 1..depth) lexicographically,
// a prefix before its extensions, as Python compares tuples. Two entries never share a tuple. A position is "the
// child of `parent` of rank `rank`"; tuples first differ just below the two paths' deepest common node, found by
// walking the parents (only on exact score ties).
__device__ bool tuple_precedes(const BuildSmem& m, uint32_t a, uint32_t b) {
    const Entry x = unpack_entry(a), y = unpack_entry(b);
    int xp = x.parent, xr = x.rank, yp = y.parent, yr = y.rank;
    for (int d = x.depth; d > y.depth; --d) {
        xr = m.rank[xp];
        xp = m.parent[xp];
    }
    for (int d = y.depth; d > x.depth; --d) {
        yr = m.rank[yp];
        yp = m.parent[yp];
    }
    if (xp == yp && xr == yr) return x.depth < y.depth;  // one tuple is a prefix of the other
    while (xp != yp) {
        xr = m.rank[xp];
        xp = m.parent[xp];
        yr = m.rank[yp];
        yp = m.parent[yp];
    }
    return xr < yr;
}

// Unsigned key ordered as the score, equal exactly when the scores compare equal (-0 keyed as +0); 0 = no entry.
__device__ __forceinline__ uint64_t score_key(double score) {
    const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(__dadd_rn(score, 0.0)));
    return (bits >> 63) ? ~bits : bits | (1ull << 63);
}

// One lane's frontier slots lane, lane + 32, ... (slot s in register s / 32 of lane s % 32), and the best of them
// with the log-probs its pop will need: lp[depth, rank], lp[depth, rank + 1] and lp[depth + 1, 0]. An entry is its
// score, its packed (parent, depth, rank) and the node it is the next sibling of (-1 for a rank-0 child).
template <int kSlots>
struct LaneFrontier {
    double score[kSlots];
    uint32_t meta[kSlots];
    int prev[kSlots];
    int best;  // register index of the best slot, -1 when the lane holds none
    double best_score;
    uint32_t best_meta;
    int best_prev;
    uint64_t best_key;
    float lp_rank, lp_next, lp_child;

    __device__ __forceinline__ void set(int lane, int slot, double value, uint32_t entry, int previous) {
        // Selects over every register by a bit mask, not an access to register slot >> 5: an indexed access (which
        // the compiler makes of a compare against the index, too) would put the arrays in local memory.
        const uint32_t which = lane == (slot & 31) ? 1u << (slot >> 5) : 0u;
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
            const bool hit = (which >> k) & 1u;
            score[k] = hit ? value : score[k];
            meta[k] = hit ? entry : meta[k];
            prev[k] = hit ? previous : prev[k];
        }
    }

    // Slot `slot`'s entry, to every lane.
    __device__ __forceinline__ void get(int slot, double& value, uint32_t& entry, int& previous) const {
        const uint32_t which = 1u << (slot >> 5);
        double v = score[0];
        uint32_t e = meta[0];
        int p = prev[0];
#pragma unroll
        for (int k = 1; k < kSlots; ++k) {
            v = (which >> k) & 1u ? score[k] : v;
            e = (which >> k) & 1u ? meta[k] : e;
            p = (which >> k) & 1u ? prev[k] : p;
        }
        value = __shfl_sync(kFullMask, v, slot & 31);
        entry = __shfl_sync(kFullMask, e, slot & 31);
        previous = __shfl_sync(kFullMask, p, slot & 31);
    }

    __device__ __forceinline__ void refresh(const BuildSmem& m, int lane, int slots, int depth_limit) {
        best = -1;
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
            if (k * 32 + lane < slots &&
                (best < 0 || score[k] > best_score ||
                 (score[k] == best_score && tuple_precedes(m, meta[k], best_meta)))) {
                best = k;
                best_score = score[k];
                best_meta = meta[k];
                best_prev = prev[k];
            }
        }
        best_key = best >= 0 ? score_key(best_score) : 0;
        if (best >= 0) {  // loads that complete while the warp finds the next pop
            const Entry e = unpack_entry(best_meta);
            const float* row = m.lp + (e.depth - 1) * m.top_k;
            lp_rank = row[e.rank];
            lp_next = e.rank + 1 < m.top_k ? row[e.rank + 1] : 0.f;
            lp_child = e.depth < depth_limit ? row[m.top_k] : 0.f;
        }
    }
};

// The probe's running mass on lane 0 (tree_probe): 1 + exp(score) summed in pop order, in float64, written at each
// probe budget as the pops reach it.
struct MassSink {
    const ProbeBudgets* budgets;
    float* out;  // this stream's [budgets->count]
    double mass;
    int next;

    __device__ __forceinline__ void add(int node, double score) {
        mass += exp(score);
        while (next < budgets->count && budgets->budgets[next] == node) out[next++] = static_cast<float>(mass);
    }
    __device__ __forceinline__ void finish() {
        while (next < budgets->count) out[next++] = static_cast<float>(mass);
    }
};

// Warp 0: pops up to `budget` nodes into the shared node arrays; returns how many. kSlots * 32 >= budget. The
// shared arrays are only written here (the rank tuples of tied entries read them), so a pop waits on no
// shared-memory load. With kProbe, lane 0 also adds each popped node's path probability to `sink`.
template <int kSlots, bool kProbe = false>
__device__ __forceinline__ int pop_nodes(const BuildSmem& m, int budget, int depth_limit, MassSink* sink = nullptr) {
    const int lane = static_cast<int>(threadIdx.x);
    LaneFrontier<kSlots> f;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
        f.score[k] = 0.0;
        f.meta[k] = 0;
        f.prev[k] = -1;
    }
    f.best_score = 0.0;
    f.best_meta = 0;
    f.best_prev = -1;
    int slots = 0;
    if (budget > 0) {
        f.set(lane, 0, static_cast<double>(m.lp[0]), pack_entry(0, 1, 0), -1);
        slots = 1;
    }
    f.refresh(m, lane, slots, depth_limit);
    int count = 0;
    while (count < budget && slots > 0) {
        const uint32_t high = __reduce_max_sync(kFullMask, static_cast<uint32_t>(f.best_key >> 32));
        const bool top = f.best >= 0 && static_cast<uint32_t>(f.best_key >> 32) == high;
        uint32_t tied = __ballot_sync(kFullMask, top);
        if (tied & (tied - 1)) {  // `tied` is warp-uniform: the low halves decide, then the rank tuple
            const uint32_t low = __reduce_max_sync(kFullMask, top ? static_cast<uint32_t>(f.best_key) : 0u);
            tied = __ballot_sync(kFullMask, top && static_cast<uint32_t>(f.best_key) == low);
        }
        int winner = __ffs(tied) - 1;
        if (tied & (tied - 1)) {
            uint32_t leader = __shfl_sync(kFullMask, f.best_meta, winner);
            for (uint32_t rest = tied & (tied - 1); rest != 0; rest &= rest - 1) {
                const int other_lane = __ffs(rest) - 1;
                const uint32_t other = __shfl_sync(kFullMask, f.best_meta, other_lane);
                if (tuple_precedes(m, other, leader)) {
                    winner = other_lane;
                    leader = other;
                }
            }
        }
        const double score = __shfl_sync(kFullMask, f.best_score, winner);
        const Entry e = unpack_entry(__shfl_sync(kFullMask, f.best_meta, winner));
        const int previous = __shfl_sync(kFullMask, f.best_prev, winner);
        const int w = __shfl_sync(kFullMask, f.best, winner) * 32 + winner;
        const float lp_rank = __shfl_sync(kFullMask, f.lp_rank, winner);
        const float lp_next = __shfl_sync(kFullMask, f.lp_next, winner);
        const float lp_child = __shfl_sync(kFullMask, f.lp_child, winner);

        // Siblings pop in rank order (each is pushed when the one before it pops), so the rank-0 child is the
        // first child and every other child is the next sibling of the node that pushed it.
        const int node = ++count;
        if constexpr (kProbe) {
            if (lane == 0) sink->add(node, score);
        }
        if (lane == 0) {
            m.parent[node] = static_cast<int16_t>(e.parent);
            m.rank[node] = static_cast<int16_t>(e.rank);
            m.depth[node] = static_cast<int8_t>(e.depth);
            if (e.rank == 0) {
                m.first[e.parent] = static_cast<int16_t>(node);
            } else {
                m.next[previous] = static_cast<int16_t>(node);
            }
        }
        if (count == budget) break;  // the last pop's successors would never be popped

        // Push the next sibling into the popped slot and the rank-0 child into a new one (or into the popped
        // slot when there is no sibling); with neither, the last slot moves into the popped one.
        const bool sibling = e.rank + 1 < m.top_k;
        const bool child = e.depth < depth_limit;
        if (sibling) {
            f.set(lane, w, __dadd_rn(__dsub_rn(score, static_cast<double>(lp_rank)), static_cast<double>(lp_next)),
                  pack_entry(e.parent, e.depth, e.rank + 1), node);
        }
        if (child) {
            f.set(lane, sibling ? slots++ : w, __dadd_rn(score, static_cast<double>(lp_child)),
                  pack_entry(node, e.depth + 1, 0), -1);
        } else if (!sibling && w != --slots) {
            double moved_score;
            uint32_t moved_entry;
            int moved_prev;
            f.get(slots, moved_score, moved_entry, moved_prev);
            f.set(lane, w, moved_score, moved_entry, moved_prev);
        }
        __syncwarp();  // the new node's parent and rank are visible to the rank-tuple comparisons
        f.refresh(m, lane, slots, depth_limit);
    }
    return count;
}

template <int kSlots>
__global__ void __launch_bounds__(kThreads, 1) tree_build_kernel(TreeCandidates in, TreeArrays tree, TreeShape shape) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int nodes;
    const BuildLayout layout(shape.budget, shape.depth_limit, in.width);
    const BuildSmem m(smem, layout);
    const int s = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
    const int depth_limit = shape.depth_limit, top_k = layout.top_k, rows = layout.rows;
    dependent_kernel_start();  // the candidates come from the drafter's top-K kernel

    const size_t in_base = static_cast<size_t>(s) * depth_limit * in.width;
    for (int i = tid; i < depth_limit * top_k; i += kThreads) {
        const size_t at = in_base + static_cast<size_t>(i / top_k) * in.width + i % top_k;
        m.lp[i] = in.log_probs[at];
        m.ids[i] = in.token_ids[at];
    }
    for (int i = tid; i < rows; i += kThreads) m.first[i] = m.next[i] = -1;
    if (tid == 0) {
        m.parent[0] = -1;
        m.depth[0] = 0;
    }
    __syncthreads();
    if (tid < 32) {
        const int count = pop_nodes<kSlots>(m, shape.budget, depth_limit);
        if (tid == 0) nodes = count;
    }
    __syncthreads();

    const int n = nodes;
    for (int i = tid; i <= n; i += kThreads) {  // ancestor rows: walk up from the node
        int node = i;
        for (int j = m.depth[i]; j >= 0; --j) {
            m.anc[i * kAncestorStride + j] = static_cast<int16_t>(node);
            node = m.parent[node];
        }
    }
    __syncthreads();
    const int start = in.start[s];
    const size_t row0 = static_cast<size_t>(s) * rows;
    for (int i = tid; i < rows; i += kThreads) {
        const bool live = i <= n;
        const int d = live ? m.depth[i] : 0;
        tree.tokens[row0 + i] = !live ? kTreePad : i == 0 ? in.bonus[s] : m.ids[(d - 1) * top_k + m.rank[i]];
        tree.parents[row0 + i] = live ? m.parent[i] : kTreePad;
        tree.depths[row0 + i] = live ? d : kTreePad;
        tree.first_child[row0 + i] = live ? m.first[i] : kTreePad;
        tree.next_sibling[row0 + i] = live ? m.next[i] : kTreePad;
        tree.positions[row0 + i] = live ? start + d : kTreePad;
    }
    const int anc_len = depth_limit + 1;
    for (int t = tid; t < rows * anc_len; t += kThreads) {
        const int i = t / anc_len, j = t % anc_len;
        tree.ancestors[row0 * anc_len + t] = i <= n && j <= m.depth[i] ? m.anc[i * kAncestorStride + j] : kTreePad;
    }
    const int words = tree_visibility_words(shape.budget);
    for (int t = tid; t < rows * words; t += kThreads) {
        const int i = t / words, w = t % words;
        uint32_t bits = 0;
        if (i <= n) {
            for (int j = 0; j <= m.depth[i]; ++j) {
                const int a = m.anc[i * kAncestorStride + j];
                if ((a >> 5) == w) bits |= 1u << (a & 31);
            }
        }
        tree.visibility[row0 * words + t] = bits;
    }
    if (tid == 0) tree.node_count[s] = n;
}

// The probe: the build's candidate loads and pops, then only the masses (no tree arrays).
template <int kSlots>
__global__ void __launch_bounds__(kThreads, 1) tree_probe_kernel(TreeCandidates in, ProbeBudgets budgets,
                                                                 float* masses, TreeShape shape) {
    extern __shared__ __align__(16) unsigned char smem[];
    const BuildLayout layout(shape.budget, shape.depth_limit, in.width);
    const BuildSmem m(smem, layout);
    const int s = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
    const int depth_limit = shape.depth_limit, top_k = layout.top_k;
    dependent_kernel_start();

    const size_t in_base = static_cast<size_t>(s) * depth_limit * in.width;
    for (int i = tid; i < depth_limit * top_k; i += kThreads) {
        const size_t at = in_base + static_cast<size_t>(i / top_k) * in.width + i % top_k;
        m.lp[i] = in.log_probs[at];
    }
    for (int i = tid; i < layout.rows; i += kThreads) m.first[i] = m.next[i] = -1;
    if (tid == 0) {
        m.parent[0] = -1;
        m.depth[0] = 0;
    }
    __syncthreads();
    if (tid < 32) {
        MassSink sink{&budgets, masses + static_cast<size_t>(s) * budgets.count, 1.0, 0};
        pop_nodes<kSlots, true>(m, shape.budget, depth_limit, &sink);
        if (tid == 0) sink.finish();
    }
}

// One CTA per stream of `kernel` (an instantiation for one frontier size) with the build's shared memory for this
// shape; its opt-in to the largest layout is made once per device (`opted_in`: one per instantiation).
template <typename Kernel, typename... Args>
cudaError_t launch_per_stream(Kernel* kernel, std::atomic<uint64_t>& opted_in, const TreeCandidates& in,
                              const TreeShape& shape, cudaStream_t stream, const Args&... args) {
    DDTREE_RETURN_IF_ERROR(
        opt_in_smem(kernel, BuildLayout(kTreeMaxBudget, kTreeMaxDepth, kTreeMaxWidth).bytes, opted_in));
    const BuildLayout layout(shape.budget, shape.depth_limit, in.width);
    return launch_dependent(kernel, dim3(shape.streams), dim3(kThreads), layout.bytes, stream, in, args..., shape);
}

// launch(std::integral_constant<int, kSlots>{}) with the fewest frontier slots per lane that hold `budget` entries
// (the frontier never holds more), so each lane keeps the fewest registers.
template <typename Launch>
cudaError_t by_frontier_size(int budget, Launch&& launch) {
    const int per_lane = (budget + 31) / 32;
    if (per_lane <= 1) return launch(std::integral_constant<int, 1>{});
    if (per_lane <= 2) return launch(std::integral_constant<int, 2>{});
    if (per_lane <= 4) return launch(std::integral_constant<int, 4>{});
    if (per_lane <= 8) return launch(std::integral_constant<int, 8>{});
    if (per_lane <= 16) return launch(std::integral_constant<int, 16>{});
    return launch(std::integral_constant<int, 32>{});
}

}  // namespace

cudaError_t tree_probe(const TreeCandidates& in, const ProbeBudgets& budgets, float* masses, const TreeShape& shape,
                       cudaStream_t stream) {
    if (!tree_shape_valid(shape) || in.width < 1 || in.width > kTreeMaxWidth || budgets.count < 1 ||
        budgets.count > kProbeMaxBudgets || budgets.budgets[budgets.count - 1] != shape.budget) {
        return cudaErrorInvalidValue;
    }
    for (int i = 0; i < budgets.count; ++i) {
        if (budgets.budgets[i] < 1 || (i > 0 && budgets.budgets[i] <= budgets.budgets[i - 1])) {
            return cudaErrorInvalidValue;
        }
    }
    if (shape.streams == 0) return cudaSuccess;
    return by_frontier_size(shape.budget, [&](auto slots) {
        static std::atomic<uint64_t> opted_in{0};
        return launch_per_stream(tree_probe_kernel<decltype(slots)::value>, opted_in, in, shape, stream, budgets,
                                 masses);
    });
}

cudaError_t tree_build(const TreeCandidates& in, const TreeArrays& tree, const TreeShape& shape, cudaStream_t stream) {
    if (!tree_shape_valid(shape) || in.width < 1 || in.width > kTreeMaxWidth) return cudaErrorInvalidValue;
    if (shape.streams == 0) return cudaSuccess;
    return by_frontier_size(shape.budget, [&](auto slots) {
        static std::atomic<uint64_t> opted_in{0};
        return launch_per_stream(tree_build_kernel<decltype(slots)::value>, opted_in, in, shape, stream, tree);
    });
}

}  // namespace ddtree::kernels
