// The device slots every Collectives implementation hands out (collectives.h), laid out for an in-place
// all-gather: rank r's `count` partial elements at r x count, its `rows` candidates at r x rows, so a gather of
// each rank's own part fills its peers' parts around it. One buffer of each from the engine's arena, sized for
// max_rows rows of two terms (a MoE layer's shared and routed experts) of `width`; the pre-flight counts the same.
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "device_arena.h"
#include "sample.cuh"

namespace ddtree {

struct CollectiveSlots {
    static constexpr int kMaxTerms = 2;

    int ranks = 0;
    int max_rows = 0;
    size_t capacity = 0;  // partial elements per rank
    kernels::bf16* partials = nullptr;
    kernels::RankCandidate* candidates = nullptr;

    // Takes the slots from `arena` (a counting arena: the pre-flight's bytes).
    static CollectiveSlots lay_out(int ranks, int max_rows, int width, DeviceArena& arena) {
        CollectiveSlots s;
        s.ranks = ranks;
        s.max_rows = max_rows;
        s.capacity = static_cast<size_t>(kMaxTerms) * max_rows * width;
        s.partials = arena.take<kernels::bf16>(static_cast<size_t>(ranks) * s.capacity);
        s.candidates = arena.take<kernels::RankCandidate>(static_cast<size_t>(ranks) * max_rows);
        return s;
    }

    kernels::bf16* partial_slot(int rank, size_t count) const {
        if (rank < 0 || rank >= ranks || count > capacity) {
            throw std::invalid_argument("partial_slot: rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                                        ", count " + std::to_string(count) + " (at most " + std::to_string(capacity) +
                                        ")");
        }
        return partials + rank * count;
    }

    kernels::RankCandidate* candidate_slot(int rank, int rows) const {
        if (rank < 0 || rank >= ranks || rows < 0 || rows > max_rows) {
            throw std::invalid_argument("candidate_slot: rank " + std::to_string(rank) + " of " +
                                        std::to_string(ranks) + ", rows " + std::to_string(rows) + " (at most " +
                                        std::to_string(max_rows) + ")");
        }
        return candidates + static_cast<size_t>(rank) * rows;
    }

    // The element count of a sum_partials (std::invalid_argument when it exceeds the slots).
    size_t partial_count(int terms, int rows, int width) const {
        const size_t count = static_cast<size_t>(terms) * rows * width;
        if (terms < 1 || terms > kMaxTerms || rows < 0 || count > capacity) {
            throw std::invalid_argument("sum_partials: " + std::to_string(terms) + " terms of " +
                                        std::to_string(rows) + " x " + std::to_string(width) + " exceed the slots");
        }
        return count;
    }
};

}  // namespace ddtree
