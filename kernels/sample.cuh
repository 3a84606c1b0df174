// Token choice from fp32 logits, and the device-side bookkeeping that turns one decode step's tokens into
// the next step's inputs (so a replayed decode graph never waits on the host).
//
// Greedy (temperature <= 0): arg-max, ties to the lower id. Sampling: Gumbel-max, argmax(logit / T + G) with G
// from a counter-based hash of (seed, stream, position, token id): reproducible and independent of which other
// rows share the launch. One cluster of CTAs per row, each CTA a slice of the vocabulary.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// What nonfinite_at[stream] holds while none of that stream's sampled rows had a NaN or infinite logit: the int32
// that cudaMemset to 0x7f writes, above every position.
constexpr int32_t kAllLogitsFinite = 0x7f7f7f7f;

// temperature and seed live in device memory so a captured graph picks up new values on replay. Each row takes 8
// CTAs of the grid's x dimension: rows <= INT_MAX / 8. A row whose logits hold a NaN or an infinity lowers
// nonfinite_at[stream_ids[row]] to its position (atomicMin), so the host can name the first bad (stream,
// position) after a whole generation; nonfinite_at has an entry for every stream id.
cudaError_t sample_tokens(int32_t* tokens, int32_t* nonfinite_at, const float* logits, int64_t ld, int rows,
                          int vocab, const float* temperature, const unsigned long long* seed,
                          const int32_t* stream_ids, const int32_t* positions, cudaStream_t stream);

// One rank's best candidate of a row over its vocabulary slice (several GPUs split the LM head by vocabulary).
struct RankCandidate {
    float value;  // the logit, or logit / T + G when sampling; -inf when the slice has no value above -inf
    int32_t id;   // the global token id
};

// sample_tokens over a slice of `vocab` columns whose first is token `first_id`, the noise keyed by global ids:
// candidates[row] = that row's best (value, id), for pick_candidates (rank_reduce.cuh) to combine across ranks.
cudaError_t sample_candidates(RankCandidate* candidates, int32_t* nonfinite_at, const float* logits, int64_t ld,
                              int rows, int vocab, int first_id, const float* temperature,
                              const unsigned long long* seed, const int32_t* stream_ids, const int32_t* positions,
                              cudaStream_t stream);

// Per-stream decode state of `streams` rows: after a step that chose tokens[s] at positions[s],
// history[s * history_ld + *step] = tokens[s]; ids[s] = tokens[s]; positions[s] += 1;
// kv_len[s] = positions[s] + 1; slots[s] = kv_start[s] + positions[s]; then *step += 1.
cudaError_t advance_decode(int32_t* ids, int32_t* positions, int32_t* kv_len, int32_t* slots, const int32_t* kv_start,
                           const int32_t* tokens, int32_t* history, int history_ld, int32_t* step, int streams,
                           cudaStream_t stream);

}  // namespace ddtree::kernels
