// StripeMap: which path, and where in that path's file, each logical stripe unit of a swap store
// lives when its paths get shares in proportion to integer weights (DESIGN.md, "Swap store").
//
// Path p of n has a weight w_p >= 1; the cycle is W = w_0 + ... + w_{n-1} units. Unit g is in
// cycle c = g / W at slot s = g % W. Slot s belongs to path P(s), and path p owns w_p of the W
// slots, so unit g lives at unit index c * w_{P(s)} + k(s) of path P(s)'s file, where k(s) counts
// the slots of P(s) before s in the cycle. The slots are dealt once, by smooth weighted
// round-robin (nginx's: each slot goes to the path with the largest running credit, ties to the
// lower index), so each path's slots are spread over the cycle and any run of units gives each
// path close to its share, not only whole cycles. Equal weights give slot s to path s: unit g on
// path g % n at index g / n, the round-robin layout of stores without weights, byte for byte.
//
// Weights are reduced by their greatest common divisor ({2, 6} is {1, 3}). The cycle is at most
// kMaxCycleUnits units (or n, for n > kMaxCycleUnits paths of equal weight): FromRatios scales
// real-valued bandwidths to such weights.
//
// A StripeMap is an immutable value: copyable, thread-safe to read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::storage {

class StripeMap {
 public:
  // The longest cycle of weighted paths: bounds the rounding of FromRatios (below) and keeps the
  // per-cycle tables small.
  static constexpr std::uint32_t kMaxCycleUnits = 64;

  // Equal shares over `num_paths` >= 1 paths.
  static StripeMap Equal(std::size_t num_paths);

  // One integer weight per path, each >= 1, whose sum divided by their gcd is at most
  // max(kMaxCycleUnits, number of paths of equal weight). Errors: InvalidArgument (no weights, a
  // weight of 0, a cycle too long), the message naming the weight ("weight 2 of path 1 is 0").
  static Result<StripeMap> FromWeights(std::span<const std::uint32_t> weights);

  // Relative bandwidths, one per path (any positive finite numbers, of any magnitude: MB/s,
  // ratios such as {1, 2.5}, or {2e307, 3e307}, whose sum overflows), scaled to integer weights:
  // for every cycle length S <= kMaxCycleUnits, the S units are apportioned by largest remainders
  // with at least one unit per path, and the S whose shares differ least from the ratios wins
  // (ties: the shorter cycle). So each path's share of the units differs from its share of the
  // bandwidth by less than 1 / kMaxCycleUnits, unless some path has less than 1 / kMaxCycleUnits of
  // the total (it still gets one unit per cycle). Ratios that are all equal give Equal(n) for any
  // n; weights that are already integers with a short enough cycle come back exactly. Errors:
  // InvalidArgument (no ratios; a ratio that is <= 0, NaN or infinite, naming it; more than
  // kMaxCycleUnits paths of unequal ratios).
  static Result<StripeMap> FromRatios(std::span<const double> ratios);

  // Where unit `unit` lives: its path and its unit index in that path's file (multiply by the
  // stripe unit for the file offset).
  struct Location {
    std::size_t path = 0;
    std::uint64_t unit = 0;
  };
  Location Locate(std::uint64_t unit) const;

  // How many of the units [0, total_units) live on `path`: the units (so, with the stripe unit,
  // the bytes) its file must hold.
  std::uint64_t UnitsOnPath(std::size_t path, std::uint64_t total_units) const;

  std::size_t num_paths() const { return weights_.size(); }
  std::uint32_t cycle_units() const { return static_cast<std::uint32_t>(slot_path_.size()); }
  // The reduced weights, one per path.
  const std::vector<std::uint32_t>& weights() const { return weights_; }
  // Every weight is 1: the round-robin layout.
  bool equal_shares() const;
  // "1:3".
  std::string WeightsText() const;

  bool operator==(const StripeMap& other) const { return weights_ == other.weights_; }

 private:
  explicit StripeMap(std::vector<std::uint32_t> weights);

  std::vector<std::uint32_t> weights_;
  std::vector<std::uint32_t> slot_path_;   // per slot of the cycle: its path
  std::vector<std::uint32_t> slot_index_;  // per slot: how many slots of its path precede it
};

}  // namespace zinf::storage
