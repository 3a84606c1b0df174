// The cost-aware budget of DDTree rounds ("--budget auto"): each round's budget among a few candidates, chosen to
// maximise (expected tokens committed per round, summed over the live streams) / (round time), CaDDTree's rule.
//
// Expected tokens come from the round's budget probe (kernels/tree_build.cuh tree_probe): per stream and candidate
// b, M(b) = 1 + the sum of the path probabilities of the first b nodes the tree build pops, smoothed over rounds.
// Drafter probabilities are over-confident (and an oracle's say nothing), so a candidate run before predicts
// 1 + ratio * (M(b) - 1), its ratio the smoothed observed accept length - 1 over the smoothed M(b) - 1 of the rounds
// that ran at b. A candidate not run yet is judged optimistically, so that it gets tried: with the ratio of the
// largest smaller candidate run (the mass keeps growing with b), else with the expectation of the smallest larger
// one run (an upper bound: a smaller tree is a prefix of the larger one's pops, so it accepts no more), else with
// ratio 1. Round time per (live streams, candidate) comes from a CostTable (measured on the engine: see
// DdtreeRound).
//
// ddtree.reference.budget is this policy's numpy twin, step for step in float64; the CPU tests pin it there.
#pragma once
#include <cstdint>
#include <vector>

namespace ddtree {

// Seconds per round at (live streams, candidate index): measured at a few stream counts (ascending, the first one
// 1), linear in between and flat past the last.
struct CostTable {
    std::vector<int> streams;
    std::vector<std::vector<double>> seconds;  // [streams.size()][candidates]
    double at(int live, int candidate) const;
};

class BudgetPolicy {
  public:
    static constexpr double kSmoothing = 0.25;  // weight of the newest round in every running mean
    static constexpr double kMaxRatio = 2.0;

    BudgetPolicy(std::vector<int> candidates, CostTable costs);

    // One round's statistics: for each of its `rows` streams (the probe's rows), masses[row * C + c] = M(b_c) and
    // the accept length it got; rows whose `skip` is non-zero (streams that finished in that round) are left out,
    // and so are rows holding a non-finite mass (a drafter's NaN would otherwise stay in every running mean).
    // `used` is the budget the round ran at (a candidate).
    void observe(const float* masses, const int32_t* accepts, const int32_t* skip, int rows, int used);
    // The budget for a round of `live` streams: the candidate of the largest expected tokens per second (the
    // smaller on ties); before any observation, the middle candidate.
    int choose(int live) const;

    double ratio(int candidate) const;  // observed / predicted extra tokens of candidate index `candidate` (1 unseen)
    double expected_per_stream(int candidate) const;        // tokens per round and stream
    double expected_tokens(int live, int candidate) const;  // per round, summed over `live` streams
    const std::vector<int>& candidates() const { return candidates_; }
    const CostTable& costs() const { return costs_; }

  private:
    std::vector<int> candidates_;
    CostTable costs_;
    std::vector<double> mass_;       // running mean over rounds of the per-stream mean M(b) - 1
    std::vector<double> observed_;   // per candidate run: running mean of accept length - 1
    std::vector<double> predicted_;  // per candidate run: running mean of M(used) - 1 of the same streams
    std::vector<bool> seen_;
    std::vector<double> round_mean_;  // observe's scratch: no allocation per round
    bool any_ = false;
};

}  // namespace ddtree
