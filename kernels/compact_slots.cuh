// Compaction of per-slot state: when streams of a batched generation finish, the live ones move to the front
// slots so that later launches cover only them (their rows then cost nothing).
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

constexpr int kCompactMaxArrays = 16;

// Arrays of `width[a]` int32 per slot, slot i at data[a] + i * width[a].
struct SlotArrays {
    int32_t* data[kCompactMaxArrays];
    int64_t width[kCompactMaxArrays];
    int count;
};

// For i < kept: slot keep[i] -> slot i in every array. keep (device) must ascend strictly; slots are moved in
// ascending order, so no source is overwritten before it is read.
cudaError_t compact_slots(const SlotArrays& arrays, const int32_t* keep, int kept, cudaStream_t stream);

}  // namespace ddtree::kernels
