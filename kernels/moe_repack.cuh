// Device repack of compressed-tensors INT4 experts into the fused MoE's stripe layout (moe_marlin.cuh): the same
// mapping as the host repack (runtime/moe_repack.cpp), so checkpoint bytes can go to the device as they are and
// a model's experts load at copy speed instead of waiting for a host repack of every expert.
#pragma once
#include <cstdint>

#include "moe_marlin.cuh"

namespace ddtree::kernels::moe {

// Device pointers. out: experts * w13_bytes_per_expert (w2_bytes_per_expert) bytes; gate and up [experts, inter,
// hidden / 8] and [experts, inter, hidden / 32]; down [experts, hidden, inter / 8] and [experts, hidden, inter / 32].
// hidden and inter must satisfy shape_supported.
cudaError_t repack_w13_on_device(uint8_t* out, PackedProjection gate, PackedProjection up, int experts, int hidden,
                                 int inter, cudaStream_t stream);
cudaError_t repack_w2_on_device(uint8_t* out, PackedProjection down, int experts, int hidden, int inter,
                                cudaStream_t stream);

}  // namespace ddtree::kernels::moe
