// Host repack of compressed-tensors INT4 group-32 experts into the fused MoE's stripe layout
// (kernels/moe_marlin.cuh documents the layout), and its inverse as a test oracle.
//
// Input per projection (checkpoint format, experts stacked): weight_packed int32 [E, out, in/8], nibble i of
// word [o, j] = q[o, 8j + i] (q = w + 8, LSB first); weight_scale bf16 bits [E, out, in/32].
// w13 is gate_proj and up_proj of shape [inter, hidden]; w2 is down_proj of shape [hidden, inter].
#pragma once
#include <cstddef>
#include <cstdint>

#include "moe_marlin.cuh"

namespace ddtree::moe {

using PackedProjection = kernels::moe::PackedProjection;  // host memory here

// Throws std::invalid_argument unless hidden and inter are positive multiples of 128.
void check_moe_shape(int hidden, int inter);
size_t repacked_w13_bytes(int hidden, int inter);  // per expert
size_t repacked_w2_bytes(int hidden, int inter);   // per expert

// out: experts * repacked_w13_bytes (resp. w2) bytes. Runs on all host cores.
void repack_w13(PackedProjection gate, PackedProjection up, int experts, int hidden, int inter, uint8_t* out);
void repack_w2(PackedProjection down, int experts, int hidden, int inter, uint8_t* out);

// Oracle: walks every nibble and scale slot of the repacked bytes and writes it back to checkpoint order,
// q [E, rows, cols] (0..15) and scale [E, rows, cols / 32]; w13 rows are gate rows then up rows.
// Throws std::runtime_error if any (row, col) or scale is written twice or never.
void unpack_w13(const uint8_t* repacked, int experts, int hidden, int inter, uint8_t* q, uint16_t* scale);
void unpack_w2(const uint8_t* repacked, int experts, int hidden, int inter, uint8_t* q, uint16_t* scale);

}  // namespace ddtree::moe
