#include "zinf/storage/stripe_map.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace zinf::storage {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::zinf::testing::StatusIs;

using Weights = std::vector<std::uint32_t>;

StripeMap MapOf(const Weights& weights) {
  Result<StripeMap> map = StripeMap::FromWeights(weights);
  EXPECT_TRUE(map.has_value()) << map.error().ToString();
  return map.value_or(StripeMap::Equal(weights.size()));
}

// The layout of stores before weights: unit g on path g % n at unit g / n.
TEST(StripeMap, EqualWeightsAreTheRoundRobinLayout) {
  for (std::size_t n = 1; n <= 5; ++n) {
    SCOPED_TRACE(n);
    for (const StripeMap& map : {StripeMap::Equal(n), MapOf(Weights(n, 1)), MapOf(Weights(n, 7))}) {
      EXPECT_TRUE(map.equal_shares());
      EXPECT_EQ(map.cycle_units(), n);
      for (std::uint64_t g = 0; g < 500; ++g) {
        const StripeMap::Location at = map.Locate(g);
        ASSERT_EQ(at.path, g % n) << g;
        ASSERT_EQ(at.unit, g / n) << g;
      }
      for (std::uint64_t total = 0; total < 50; ++total) {
        for (std::size_t p = 0; p < n; ++p) {
          EXPECT_EQ(map.UnitsOnPath(p, total), total > p ? (total - p + n - 1) / n : 0)
              << "path " << p << " of " << total << " units";
        }
      }
    }
  }
  // Many paths of equal weight are not limited by the cycle cap.
  ZINF_ASSERT_OK_AND_ASSIGN(StripeMap many, StripeMap::FromWeights(Weights(100, 1)));
  EXPECT_EQ(many.Locate(250).path, 50u);
  EXPECT_EQ(many.Locate(250).unit, 2u);
}

// Every unit has a place of its own, each file is dense (no holes), each path holds its share of
// every cycle, and UnitsOnPath counts what Locate puts there.
TEST(StripeMap, UnitsAreDistinctDenseAndSharedByWeight) {
  for (const Weights& weights : {Weights{1, 3}, Weights{3, 1}, Weights{2, 3}, Weights{1, 1, 2},
                                 Weights{5, 1, 7, 3}, Weights{1, 63}, Weights{10, 17}}) {
    SCOPED_TRACE(::testing::PrintToString(weights));
    const StripeMap map = MapOf(weights);
    const std::uint32_t cycle = std::accumulate(weights.begin(), weights.end(), 0u);
    ASSERT_EQ(map.cycle_units(), cycle);
    EXPECT_EQ(map.weights(), weights);
    const std::uint64_t total = 7 * cycle + cycle / 2;
    std::set<std::pair<std::size_t, std::uint64_t>> seen;
    std::vector<std::uint64_t> count(weights.size(), 0);
    for (std::uint64_t g = 0; g < total; ++g) {
      const StripeMap::Location at = map.Locate(g);
      ASSERT_LT(at.path, weights.size());
      ASSERT_TRUE(seen.insert({at.path, at.unit}).second) << "unit " << g << " collides";
      ++count[at.path];
      for (std::size_t p = 0; p < weights.size(); ++p) {
        ASSERT_EQ(map.UnitsOnPath(p, g + 1), count[p]) << "path " << p << ", units " << g + 1;
      }
      if ((g + 1) % cycle == 0) {
        for (std::size_t p = 0; p < weights.size(); ++p) {
          EXPECT_EQ(count[p], (g + 1) / cycle * weights[p]) << "path " << p;
        }
      }
    }
    // Dense: path p's units are exactly 0 .. count[p] - 1.
    for (std::size_t p = 0; p < weights.size(); ++p) {
      for (std::uint64_t u = 0; u < count[p]; ++u) EXPECT_TRUE(seen.contains({p, u})) << p << u;
    }
  }
}

// The slots of a cycle are interleaved: every prefix of a cycle gives each path its share to
// within one unit (a tensor shorter than a cycle is still split by bandwidth), and runs of a
// path's slots are consecutive in its file, so the store merges them into one request.
TEST(StripeMap, CycleInterleavesThePaths) {
  const StripeMap one_three = MapOf({1, 3});
  std::vector<std::size_t> order;
  for (std::uint64_t g = 0; g < 8; ++g) order.push_back(one_three.Locate(g).path);
  EXPECT_THAT(order, ElementsAre(1, 0, 1, 1, 1, 0, 1, 1));
  EXPECT_EQ(one_three.Locate(2).unit + 1, one_three.Locate(3).unit);
  EXPECT_EQ(one_three.Locate(3).unit + 1, one_three.Locate(4).unit);  // across the cycle

  for (const Weights& weights : {Weights{1, 3}, Weights{2, 3}, Weights{5, 1, 7, 3}, Weights{1, 63},
                                 Weights{9, 4, 4, 1}, Weights{31, 33}}) {
    SCOPED_TRACE(::testing::PrintToString(weights));
    const StripeMap map = MapOf(weights);
    const double cycle = map.cycle_units();
    std::vector<double> count(weights.size(), 0);
    for (std::uint64_t g = 0; g < map.cycle_units(); ++g) {
      ++count[map.Locate(g).path];
      for (std::size_t p = 0; p < weights.size(); ++p) {
        EXPECT_LT(std::fabs(count[p] - (g + 1) * weights[p] / cycle), 1.0)
            << "path " << p << " after " << g + 1 << " units";
      }
    }
  }
}

TEST(StripeMap, WeightsAreReducedByTheirGcd) {
  EXPECT_THAT(MapOf({2, 6}).weights(), ElementsAre(1, 3));
  EXPECT_EQ(MapOf({2, 6}), MapOf({1, 3}));
  EXPECT_EQ(MapOf({128, 384}).cycle_units(), 4u);  // 512 units before the reduction
  EXPECT_EQ(MapOf({2, 6}).WeightsText(), "1:3");
}

TEST(StripeMap, BadWeightsAreRefused) {
  EXPECT_THAT(StripeMap::FromWeights({}), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(StripeMap::FromWeights(Weights{1, 0, 2}),
              StatusIs(ErrorCode::kInvalidArgument,
                       AllOf(HasSubstr("1:0:2"), HasSubstr("weight 2 of path 1 is 0"))));
  EXPECT_THAT(StripeMap::FromWeights(Weights{1, 64}),
              StatusIs(ErrorCode::kInvalidArgument,
                       AllOf(HasSubstr("a cycle of 65 stripe units"), HasSubstr("at most 64"))));
  EXPECT_THAT(StripeMap::FromWeights(Weights{std::numeric_limits<std::uint32_t>::max(), 1}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("at most 64")));
  ZINF_EXPECT_OK(StripeMap::FromWeights(Weights{1, 63}));
}

TEST(StripeMap, RatiosBecomeSmallIntegerWeights) {
  auto weights_of = [](std::vector<double> ratios) -> Weights {
    Result<StripeMap> map = StripeMap::FromRatios(ratios);
    EXPECT_TRUE(map.has_value()) << map.error().ToString();
    return map ? map->weights() : Weights{};
  };
  EXPECT_THAT(weights_of({1, 3}), ElementsAre(1, 3));
  EXPECT_THAT(weights_of({2.5, 7.5}), ElementsAre(1, 3));
  EXPECT_THAT(weights_of({2, 3}), ElementsAre(2, 3));
  EXPECT_THAT(weights_of({8000e6, 1000e6}), ElementsAre(8, 1));  // bytes per second
  EXPECT_THAT(weights_of({5, 1, 7, 3}), ElementsAre(5, 1, 7, 3));
  EXPECT_THAT(weights_of({23, 41}), ElementsAre(23, 41));
  EXPECT_THAT(weights_of({2.5, 2.5, 2.5}), ElementsAre(1, 1, 1));
  // A path of less than 1/64 of the bandwidth still gets one unit per cycle.
  EXPECT_THAT(weights_of({1000, 1}), ElementsAre(63, 1));
  // Equal ratios are equal shares for any number of paths.
  EXPECT_EQ(weights_of(std::vector<double>(100, 0.5)), Weights(100, 1));
}

// Issue 41: ratios whose sum overflows a double (or that are tiny) keep their proportions; 2:3
// is 2:3 at any scale, never equal shares.
TEST(StripeMap, RatiosOfAnyMagnitudeKeepTheirProportions) {
  const double max = std::numeric_limits<double>::max();
  const double denormal_min = std::numeric_limits<double>::denorm_min();
  for (const double scale :
       {1.0, 1e18, 18446744073709551616.0, 1e300, max / 4, 1e-300, 1e-310, denormal_min * 1000}) {
    SCOPED_TRACE(scale);
    Result<StripeMap> map = StripeMap::FromRatios(std::vector<double>{2 * scale, 3 * scale});
    ASSERT_TRUE(map.has_value()) << map.error().ToString();
    EXPECT_THAT(map->weights(), ElementsAre(2, 3));
  }
  // Overflowing sums of more paths, and a path far below the others.
  Result<StripeMap> map = StripeMap::FromRatios(std::vector<double>{max, max / 2, max / 4});
  ASSERT_TRUE(map.has_value()) << map.error().ToString();
  EXPECT_THAT(map->weights(), ElementsAre(4, 2, 1));
  map = StripeMap::FromRatios(std::vector<double>{max, denormal_min});
  ASSERT_TRUE(map.has_value()) << map.error().ToString();
  EXPECT_THAT(map->weights(), ElementsAre(63, 1));
}

// Each path's share of the units differs from its share of the bandwidth by less than 1/64 when
// every path has at least 1/64 of the bandwidth.
TEST(StripeMap, RatioRoundingIsBounded) {
  std::mt19937_64 rng(24);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  double worst = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t n = 2 + trial % 5;
    std::vector<double> ratios;
    for (std::size_t i = 0; i < n; ++i) ratios.push_back(std::pow(10.0, 2 * uniform(rng)));
    const double total = std::accumulate(ratios.begin(), ratios.end(), 0.0);
    if (*std::min_element(ratios.begin(), ratios.end()) < total / 64) continue;
    ZINF_ASSERT_OK_AND_ASSIGN(StripeMap map, StripeMap::FromRatios(ratios));
    ASSERT_LE(map.cycle_units(), StripeMap::kMaxCycleUnits);
    for (std::size_t i = 0; i < n; ++i) {
      const double share = static_cast<double>(map.weights()[i]) / map.cycle_units();
      worst = std::max(worst, std::fabs(share - ratios[i] / total));
    }
  }
  EXPECT_LT(worst, 1.0 / StripeMap::kMaxCycleUnits);
}

TEST(StripeMap, BadRatiosAreRefused) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THAT(StripeMap::FromRatios({}), StatusIs(ErrorCode::kInvalidArgument));
  for (double bad : {0.0, -1.0, nan, inf, -inf}) {
    EXPECT_THAT(StripeMap::FromRatios(std::vector<double>{1.0, bad}),
                StatusIs(ErrorCode::kInvalidArgument,
                         AllOf(HasSubstr("ratio 2 of path 1"), HasSubstr("positive finite"))))
        << bad;
  }
  std::vector<double> many(65, 1.0);
  many[0] = 2.0;
  EXPECT_THAT(StripeMap::FromRatios(many),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("65 paths of unequal ratios")));
}

}  // namespace
}  // namespace zinf::storage
