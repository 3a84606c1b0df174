#include "budget_policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace ddtree {

namespace {

double smooth(double running, double value, bool first) {
    return first ? value : running + BudgetPolicy::kSmoothing * (value - running);
}

}  // namespace

double CostTable::at(int live, int candidate) const {
    const size_t n = streams.size();
    if (live <= streams[0]) return seconds[0][candidate];
    for (size_t i = 1; i < n; ++i) {
        if (live <= streams[i]) {
            const double t = static_cast<double>(live - streams[i - 1]) / (streams[i] - streams[i - 1]);
            return seconds[i - 1][candidate] + t * (seconds[i][candidate] - seconds[i - 1][candidate]);
        }
    }
    return seconds[n - 1][candidate];
}

BudgetPolicy::BudgetPolicy(std::vector<int> candidates, CostTable costs)
    : candidates_(std::move(candidates)), costs_(std::move(costs)), mass_(candidates_.size(), 0.0),
      observed_(candidates_.size(), 0.0), predicted_(candidates_.size(), 0.0), seen_(candidates_.size(), false),
      round_mean_(candidates_.size(), 0.0) {
    if (candidates_.empty() || costs_.streams.empty() || costs_.seconds.size() != costs_.streams.size()) {
        throw std::invalid_argument("budget policy: no candidates or an empty cost table");
    }
    for (const auto& row : costs_.seconds) {
        if (row.size() != candidates_.size()) throw std::invalid_argument("budget policy: cost table width");
    }
}

void BudgetPolicy::observe(const float* masses, const int32_t* accepts, const int32_t* skip, int rows, int used) {
    const int c_count = static_cast<int>(candidates_.size());
    const int u = static_cast<int>(std::find(candidates_.begin(), candidates_.end(), used) - candidates_.begin());
    std::vector<double>& mean = round_mean_;
    std::fill(mean.begin(), mean.end(), 0.0);
    double accepted = 0.0;
    int streams = 0;
    for (int row = 0; row < rows; ++row) {
        const float* m = masses + static_cast<size_t>(row) * c_count;
        if (skip[row] != 0 || !std::all_of(m, m + c_count, [](float x) { return std::isfinite(x); })) continue;
        ++streams;
        for (int c = 0; c < c_count; ++c) mean[c] += static_cast<double>(m[c]) - 1.0;
        accepted += static_cast<double>(accepts[row]) - 1.0;
    }
    if (streams == 0) return;
    for (int c = 0; c < c_count; ++c) mass_[c] = smooth(mass_[c], mean[c] / streams, !any_);
    any_ = true;
    if (u < c_count) {
        observed_[u] = smooth(observed_[u], accepted / streams, !seen_[u]);
        predicted_[u] = smooth(predicted_[u], mean[u] / streams, !seen_[u]);
        seen_[u] = true;
    }
}

double BudgetPolicy::ratio(int candidate) const {
    if (predicted_[candidate] <= 1e-9) return 1.0;
    return std::clamp(observed_[candidate] / predicted_[candidate], 0.0, kMaxRatio);
}

double BudgetPolicy::expected_per_stream(int candidate) const {
    const int c_count = static_cast<int>(candidates_.size());
    if (seen_[candidate]) return 1.0 + ratio(candidate) * mass_[candidate];
    for (int below = candidate - 1; below >= 0; --below) {  // the largest smaller candidate run: its calibration
        if (seen_[below]) return 1.0 + ratio(below) * mass_[candidate];
    }
    for (int above = candidate + 1; above < c_count; ++above) {  // the smallest larger one run bounds it
        if (seen_[above]) return expected_per_stream(above);
    }
    return 1.0 + mass_[candidate];
}

double BudgetPolicy::expected_tokens(int live, int candidate) const { return live * expected_per_stream(candidate); }

int BudgetPolicy::choose(int live) const {
    const int c_count = static_cast<int>(candidates_.size());
    if (!any_) return candidates_[(c_count - 1) / 2];
    int best = 0;
    double best_rate = -1.0;
    for (int c = 0; c < c_count; ++c) {
        const double rate = expected_tokens(live, c) / costs_.at(live, c);
        if (rate > best_rate) {
            best = c;
            best_rate = rate;
        }
    }
    return candidates_[best];
}

}  // namespace ddtree
