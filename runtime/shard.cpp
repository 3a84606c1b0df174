#include "shard.h"

#include <stdexcept>
#include <string>

namespace ddtree {

namespace {

void divides(int ranks, const char* field, int value, bool needed) {
    if (needed && value % ranks != 0) {
        throw std::invalid_argument("ranks " + std::to_string(ranks) + " does not divide the config's " + field +
                                    " " + std::to_string(value) + ": choose ranks that divide it");
    }
}

}  // namespace

void check_shard(const ModelDims& d) {
    const Shard& s = d.shard;
    if (s.ranks < 1) throw std::invalid_argument("ranks must be a positive integer, got " + std::to_string(s.ranks));
    if (s.rank < 0 || s.rank >= s.ranks) {
        throw std::invalid_argument("rank must be an integer in 0.." + std::to_string(s.ranks - 1) + " (ranks " +
                                    std::to_string(s.ranks) + "), got " + std::to_string(s.rank));
    }
    const bool has_moe = d.layers > d.first_dense;
    divides(s.ranks, "num_attention_heads", d.heads, true);
    divides(s.ranks, "intermediate_size", d.inter, d.first_dense > 0);
    divides(s.ranks, "moe_intermediate_size", d.shared_inter, has_moe);
    divides(s.ranks, "n_routed_experts", d.experts, has_moe);
    divides(s.ranks, "vocab_size", d.vocab, true);
}

ShardLayout shard_layout(const ModelDims& d) {
    check_shard(d);
    const int r = d.shard.rank;
    return {d.rank_heads(),        d.rank_inter(),           d.rank_shared_inter(),
            d.rank_experts(),      d.rank_vocab(),           r * d.rank_heads(),
            r * d.rank_inter(),    r * d.rank_shared_inter(), d.first_expert(),
            d.first_token()};
}

}  // namespace ddtree
