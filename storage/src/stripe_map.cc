#include "zinf/storage/stripe_map.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace zinf::storage {
namespace {

// The apportionment of `cycle` units to `shares` (summing to 1) by largest remainders, each path
// getting at least one unit: paths whose share of the cycle is below one unit get one, and the
// rest of the cycle is shared among the others in proportion (repeated while that pushes another
// path below one unit). Precondition: cycle >= shares.size().
std::vector<std::uint32_t> Apportion(std::span<const double> shares, std::uint32_t cycle) {
  const std::size_t n = shares.size();
  std::vector<bool> one_unit(n, false);
  std::vector<double> quota(n, 0.0);
  for (bool changed = true; changed;) {
    changed = false;
    std::size_t fixed = 0;
    double rest = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      if (one_unit[i]) {
        ++fixed;
      } else {
        rest += shares[i];
      }
    }
    const double units = static_cast<double>(cycle - fixed);
    for (std::size_t i = 0; i < n; ++i) {
      if (one_unit[i]) continue;
      quota[i] = shares[i] * units / rest;
      if (quota[i] < 1.0) {
        one_unit[i] = true;
        changed = true;
      }
    }
  }
  std::vector<std::uint32_t> weights(n, 1);
  std::uint32_t given = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!one_unit[i]) weights[i] = static_cast<std::uint32_t>(std::floor(quota[i]));
    given += weights[i];
  }
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < n; ++i) {
    if (!one_unit[i]) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return quota[a] - std::floor(quota[a]) > quota[b] - std::floor(quota[b]);
  });
  for (std::size_t k = 0; given < cycle && k < order.size(); ++k, ++given) ++weights[order[k]];
  return weights;
}

// The largest difference between a path's share of the units and its share of the bandwidth.
double ShareError(std::span<const std::uint32_t> weights, std::span<const double> shares) {
  const double cycle = std::accumulate(weights.begin(), weights.end(), 0.0);
  double worst = 0.0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    worst = std::max(worst, std::fabs(weights[i] / cycle - shares[i]));
  }
  return worst;
}

}  // namespace

StripeMap::StripeMap(std::vector<std::uint32_t> weights) : weights_(std::move(weights)) {
  const std::uint32_t cycle = std::accumulate(weights_.begin(), weights_.end(), 0u);
  slot_path_.reserve(cycle);
  slot_index_.reserve(cycle);
  // Smooth weighted round-robin: every slot, each path earns its weight; the richest path takes
  // the slot and pays the whole cycle.
  std::vector<std::int64_t> credit(weights_.size(), 0);
  std::vector<std::uint32_t> taken(weights_.size(), 0);
  for (std::uint32_t s = 0; s < cycle; ++s) {
    std::size_t best = 0;
    for (std::size_t p = 0; p < weights_.size(); ++p) {
      credit[p] += weights_[p];
      if (credit[p] > credit[best]) best = p;
    }
    credit[best] -= cycle;
    slot_path_.push_back(static_cast<std::uint32_t>(best));
    slot_index_.push_back(taken[best]++);
  }
}

StripeMap StripeMap::Equal(std::size_t num_paths) {
  return StripeMap(std::vector<std::uint32_t>(std::max<std::size_t>(num_paths, 1), 1));
}

Result<StripeMap> StripeMap::FromWeights(std::span<const std::uint32_t> weights) {
  if (weights.empty()) return InvalidArgumentError("path weights: none given");
  std::uint32_t divisor = 0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    if (weights[i] == 0) {
      return InvalidArgumentError(
          fmt::format("path weights {}: weight {} of path {} is 0 (each path needs a weight >= 1)",
                      fmt::join(weights, ":"), i + 1, i));
    }
    divisor = std::gcd(divisor, weights[i]);
  }
  std::vector<std::uint32_t> reduced;
  std::uint64_t cycle = 0;
  for (std::uint32_t w : weights) {
    reduced.push_back(w / divisor);
    cycle += w / divisor;
  }
  if (cycle > kMaxCycleUnits && cycle != reduced.size()) {
    return InvalidArgumentError(fmt::format(
        "path weights {}: a cycle of {} stripe units (the weights divided by their gcd {}); at "
        "most {}",
        fmt::join(weights, ":"), cycle, divisor, kMaxCycleUnits));
  }
  return StripeMap(std::move(reduced));
}

Result<StripeMap> StripeMap::FromRatios(std::span<const double> ratios) {
  if (ratios.empty()) return InvalidArgumentError("path bandwidth ratios: none given");
  double largest = 0.0;
  for (std::size_t i = 0; i < ratios.size(); ++i) {
    if (!std::isfinite(ratios[i]) || !(ratios[i] > 0.0)) {
      return InvalidArgumentError(fmt::format(
          "path bandwidth ratios: ratio {} of path {} is {} (each must be a positive finite "
          "number)",
          i + 1, i, ratios[i]));
    }
    largest = std::max(largest, ratios[i]);
  }
  // Scaled to (0, 1] before summing: the sum of ratios near the largest double would overflow
  // to infinity (and every share become 0), whatever their proportions.
  std::vector<double> scaled;
  double total = 0.0;
  for (double r : ratios) {
    scaled.push_back(r / largest);
    total += scaled.back();
  }
  if (std::all_of(ratios.begin(), ratios.end(), [&](double r) { return r == ratios[0]; })) {
    return Equal(ratios.size());
  }
  if (ratios.size() > kMaxCycleUnits) {
    return InvalidArgumentError(
        fmt::format("path bandwidth ratios: {} paths of unequal ratios; at most {}", ratios.size(),
                    kMaxCycleUnits));
  }
  std::vector<double> shares;
  for (double r : scaled) shares.push_back(r / total);
  std::vector<std::uint32_t> best;
  double best_error = 0.0;
  for (std::uint32_t cycle = static_cast<std::uint32_t>(ratios.size()); cycle <= kMaxCycleUnits;
       ++cycle) {
    std::vector<std::uint32_t> weights = Apportion(shares, cycle);
    const double error = ShareError(weights, shares);
    // The tolerance keeps exact integer ratios at their shortest cycle despite rounding.
    if (best.empty() || error < best_error - 1e-12) {
      best = std::move(weights);
      best_error = error;
    }
  }
  return FromWeights(best);
}

StripeMap::Location StripeMap::Locate(std::uint64_t unit) const {
  const std::uint64_t cycle = slot_path_.size();
  const std::uint64_t slot = unit % cycle;
  const std::uint32_t path = slot_path_[slot];
  return {path, (unit / cycle) * weights_[path] + slot_index_[slot]};
}

std::uint64_t StripeMap::UnitsOnPath(std::size_t path, std::uint64_t total_units) const {
  const std::uint64_t cycle = slot_path_.size();
  const std::uint64_t partial = total_units % cycle;
  std::uint64_t units = (total_units / cycle) * weights_[path];
  for (std::uint64_t s = 0; s < partial; ++s) units += slot_path_[s] == path ? 1 : 0;
  return units;
}

bool StripeMap::equal_shares() const {
  return std::all_of(weights_.begin(), weights_.end(), [](std::uint32_t w) { return w == 1; });
}

std::string StripeMap::WeightsText() const { return fmt::format("{}", fmt::join(weights_, ":")); }

}  // namespace zinf::storage
