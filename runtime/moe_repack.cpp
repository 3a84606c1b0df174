#include "moe_repack.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "moe_marlin.cuh"

namespace ddtree::moe {
namespace {

namespace k = ddtree::kernels::moe;

// Runs fn(expert, stripe) over all pairs on every host core.
void parallel_stripes(int experts, int stripes, const std::function<void(int, int)>& fn) {
    const long total = static_cast<long>(experts) * stripes;
    const long workers = std::max(1L, std::min<long>(total, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(workers);
    for (long w = 0; w < workers; ++w) {
        pool.emplace_back([&, w] {
            try {
                for (long u = w; u < total; u += workers) fn(static_cast<int>(u / stripes), static_cast<int>(u % stripes));
            } catch (...) {
                errors[w] = std::current_exception();
            }
        });
    }
    for (auto& t : pool) t.join();
    for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
}

// `first` and `second`: the checkpoint projections behind the matrix (see StripedMatrix::source_row).
void repack(const k::StripedMatrix& matrix, int experts, PackedProjection first, PackedProjection second,
            uint8_t* out) {
    parallel_stripes(experts, matrix.stripes(), [&](int e, int s) {
        PackedProjection rows[k::kStripeRows];
        for (int r = 0; r < k::kStripeRows; ++r) rows[r] = matrix.source_row(first, second, e, s, r);
        for (int ks = 0; ks < matrix.cols() / k::kStageK; ++ks) {
            k::write_stage(out + matrix.stage_offset(e, s, ks), ks, rows, 0, 1);
        }
    });
}

void unpack(const k::StripedMatrix& matrix, int experts, const uint8_t* repacked, uint8_t* q, uint16_t* scale) {
    const int rows = matrix.stripes() * k::kStripeRows, cols = matrix.cols(), groups = cols / k::kGroup;
    // Every slot is written exactly once when the layout is a bijection; 0xFF / 0xFFFF marks "not yet".
    std::memset(q, 0xFF, static_cast<size_t>(experts) * rows * cols);
    std::vector<uint8_t> scale_hit(static_cast<size_t>(experts) * rows * groups, 0);
    parallel_stripes(experts, matrix.stripes(), [&](int e, int s) {
        for (int ks = 0; ks < cols / k::kStageK; ++ks) {
            const uint8_t* stage = repacked + matrix.stage_offset(e, s, ks);
            for (int word = 0; word < k::kStageWords; ++word) {
                uint32_t v;
                std::memcpy(&v, stage + word * 4, 4);
                for (int nib = 0; nib < 8; ++nib) {
                    const k::LayoutSlot slot = k::weight_slot(word, nib);
                    const size_t at = (static_cast<size_t>(e) * rows + matrix.row(s, slot.tile_row)) * cols +
                                      ks * k::kStageK + slot.col;
                    if (q[at] != 0xFF) throw std::runtime_error("repacked weight element hit twice at " + std::to_string(at));
                    q[at] = static_cast<uint8_t>((v >> (4 * nib)) & 0xFu);
                }
            }
            for (int i = 0; i < k::kStageScales; ++i) {
                const k::LayoutSlot slot = k::scale_slot(i);
                const size_t at = (static_cast<size_t>(e) * rows + matrix.row(s, slot.tile_row)) * groups +
                                  ks * (k::kStageK / k::kGroup) + slot.col;
                if (scale_hit[at]++) throw std::runtime_error("repacked scale hit twice at " + std::to_string(at));
                std::memcpy(&scale[at], stage + k::kStageWeightBytes + i * 2, 2);
            }
        }
    });
    for (size_t i = 0; i < static_cast<size_t>(experts) * rows * cols; ++i) {
        if (q[i] == 0xFF) throw std::runtime_error("repacked weight element never written at " + std::to_string(i));
    }
    for (size_t i = 0; i < scale_hit.size(); ++i) {
        if (!scale_hit[i]) throw std::runtime_error("repacked scale never written at " + std::to_string(i));
    }
}

}  // namespace

void check_moe_shape(int hidden, int inter) {
    if (!k::shape_supported(hidden, inter)) {
        throw std::invalid_argument("MoE shape hidden=" + std::to_string(hidden) + ", inter=" + std::to_string(inter) +
                                    " unsupported: both must be positive multiples of " + std::to_string(k::kStageK));
    }
}

size_t repacked_w13_bytes(int hidden, int inter) {
    check_moe_shape(hidden, inter);
    return k::w13_bytes_per_expert(hidden, inter);
}

size_t repacked_w2_bytes(int hidden, int inter) {
    check_moe_shape(hidden, inter);
    return k::w2_bytes_per_expert(hidden, inter);
}

void repack_w13(PackedProjection gate, PackedProjection up, int experts, int hidden, int inter, uint8_t* out) {
    check_moe_shape(hidden, inter);
    repack(k::StripedMatrix{true, hidden, inter}, experts, gate, up, out);
}

void repack_w2(PackedProjection down, int experts, int hidden, int inter, uint8_t* out) {
    check_moe_shape(hidden, inter);
    repack(k::StripedMatrix{false, hidden, inter}, experts, down, down, out);
}

void unpack_w13(const uint8_t* repacked, int experts, int hidden, int inter, uint8_t* q, uint16_t* scale) {
    check_moe_shape(hidden, inter);
    unpack(k::StripedMatrix{true, hidden, inter}, experts, repacked, q, scale);
}

void unpack_w2(const uint8_t* repacked, int experts, int hidden, int inter, uint8_t* q, uint16_t* scale) {
    check_moe_shape(hidden, inter);
    unpack(k::StripedMatrix{false, hidden, inter}, experts, repacked, q, scale);
}

}  // namespace ddtree::moe
