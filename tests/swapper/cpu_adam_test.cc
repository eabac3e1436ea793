#include "zinf/swapper/cpu_adam.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace zinf::swapper {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::StatusIs;

std::uint32_t Bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float FromBits(std::uint32_t b) { return std::bit_cast<float>(b); }

// An independent bf16 reference: keep the high half, round up when the dropped half is above the
// midpoint or exactly at it with an odd kept half; NaN keeps sign and high payload, made quiet.
std::uint16_t RefBf16(float f) {
  const std::uint32_t bits = Bits(f);
  std::uint32_t high = bits >> 16;
  const std::uint32_t low = bits & 0xffffu;
  if (std::isnan(f)) return static_cast<std::uint16_t>(high | 0x40u);
  if (low > 0x8000u || (low == 0x8000u && (high & 1u) != 0)) ++high;
  return static_cast<std::uint16_t>(high);
}

// The whole optimizer state of one test, kept by the reference and by the kernel under test.
struct State {
  std::vector<float> param, exp_avg, exp_avg_sq, max_exp_avg_sq;
  std::vector<std::uint16_t> bf16;
};

// The straightforward reference: torch.optim.Adam(W)'s formulas, per-step scalars in double
// like Python, per-element math in float in the documented order (this file is compiled with
// -ffp-contract=off).
void RefStep(const AdamOptions& o, std::int64_t step, const std::vector<float>& grad,
             float grad_scale, double lr, State* s) {
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  const float beta1 = static_cast<float>(o.beta1);
  const float beta2 = static_cast<float>(o.beta2);
  const float one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  const float one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  const float step_size = static_cast<float>(lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(o.eps);
  const float wd = static_cast<float>(o.weight_decay);
  const float decay = static_cast<float>(1.0 - lr * o.weight_decay);
  for (std::size_t i = 0; i < grad.size(); ++i) {
    float g = grad[i];
    if (grad_scale != 1.0f) g = g * grad_scale;
    float p = s->param[i];
    if (o.weight_decay != 0.0 && !o.adamw) g = g + wd * p;
    if (o.weight_decay != 0.0 && o.adamw) p = p * decay;
    s->exp_avg[i] = beta1 * s->exp_avg[i] + one_minus_beta1 * g;
    s->exp_avg_sq[i] = beta2 * s->exp_avg_sq[i] + (one_minus_beta2 * g) * g;
    float v_hat = s->exp_avg_sq[i];
    if (o.amsgrad) {
      const float old = s->max_exp_avg_sq[i];
      if (std::isnan(old) || old > v_hat) v_hat = old;
      s->max_exp_avg_sq[i] = v_hat;
    }
    const float denom = std::sqrt(v_hat) / bc2_sqrt + eps;
    p = p - (step_size * s->exp_avg[i]) / denom;
    s->param[i] = p;
    if (!s->bf16.empty()) s->bf16[i] = RefBf16(p);
  }
}

// Bitwise equality, except that any two NaNs are equal (NaN payload choice between two NaN
// operands is not part of the contract).
bool SameFloat(float a, float b) { return Bits(a) == Bits(b) || (std::isnan(a) && std::isnan(b)); }

::testing::AssertionResult SameFloats(const char* what, const std::vector<float>& want,
                                      const std::vector<float>& got) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << what << ": size differs";
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!SameFloat(want[i], got[i])) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: want " << want[i] << " (0x" << std::hex << Bits(want[i])
             << ") got " << got[i] << " (0x" << Bits(got[i]) << std::dec << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// Gradients and state with a spread of magnitudes (2^-20 .. 2^4 times `scale`), both signs,
// zeros and denormals. Built from random bits (xorshift) rather than <random> distributions:
// the million-element cases must stay fast.
std::vector<float> RandomVector(std::size_t n, std::uint32_t seed, float scale) {
  std::uint32_t x = 2463534242u ^ (seed * 2654435761u);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    const std::uint32_t exponent = 127u - 20u + (x >> 8) % 25u;
    v[i] = scale * FromBits((x & 0x80000000u) | (exponent << 23) | (x & 0x7fffffu));
    if (i % 97 == 5) v[i] = 0.0f;
    if (i % 101 == 7) v[i] = -0.0f;
    if (i % 113 == 11) v[i] = std::numeric_limits<float>::denorm_min() * 3.0f;
  }
  return v;
}

State InitialState(std::size_t n, bool amsgrad) {
  State s;
  s.param = RandomVector(n, 1, 1.0f);
  // Moments of a run already under way (exp_avg_sq must be >= 0).
  s.exp_avg = RandomVector(n, 2, 1e-2f);
  s.exp_avg_sq = RandomVector(n, 3, 1e-4f);
  for (float& x : s.exp_avg_sq) x = std::fabs(x);
  if (amsgrad) {
    s.max_exp_avg_sq = s.exp_avg_sq;
    for (std::size_t i = 0; i < n; i += 3) s.max_exp_avg_sq[i] *= 2.0f;
  }
  s.bf16.assign(n, 0);
  return s;
}

std::vector<SimdPath> KernelPaths() {
  return {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512};
}

#define SKIP_IF_UNSUPPORTED(path)                                                   \
  if (!SimdPathSupported(path)) {                                                   \
    GTEST_SKIP() << "this CPU lacks the " << SimdPathName(path) << " instructions"; \
  }

struct Config {
  const char* name;
  bool adamw;
  bool amsgrad;
  double weight_decay;
};

const Config kConfigs[] = {
    {"Adam", false, false, 0.0},        {"AdamL2", false, false, 0.01},
    {"AdamW", true, false, 0.01},       {"AdamWNoDecay", true, false, 0.0},
    {"AdamWAmsgrad", true, true, 0.01}, {"AdamAmsgradL2", false, true, 0.05},
};

class CpuAdamPathTest : public ::testing::TestWithParam<std::tuple<SimdPath, Config>> {};
class CpuAdamKernelTest : public ::testing::TestWithParam<SimdPath> {};

// Three steps (grad_scale 1, 0.5, 1; lr overridden on the last) over sizes that are not
// multiples of any vector width, with 1, 2 and 3 threads: every path must give the reference
// bits for param, both moments, the amsgrad max and the bf16 copy.
TEST_P(CpuAdamPathTest, MatchesReferenceBitForBit) {
  const auto& [path, config] = GetParam();
  SKIP_IF_UNSUPPORTED(path);
  const AdamOptions base = {.lr = 1e-3,
                            .beta1 = 0.9,
                            .beta2 = 0.999,
                            .eps = 1e-8,
                            .weight_decay = config.weight_decay,
                            .adamw = config.adamw,
                            .amsgrad = config.amsgrad,
                            .threads = 1,
                            .simd = path};
  const float scales[] = {1.0f, 0.5f, 1.0f};
  const double lrs[] = {1e-3, 1e-3, 3e-4};
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{15},
                        std::size_t{16}, std::size_t{17}, std::size_t{33}, std::size_t{1000003}}) {
    const State initial = InitialState(n, config.amsgrad);
    State want = initial;
    std::vector<std::vector<float>> grads;
    for (int s = 0; s < 3; ++s) {
      grads.push_back(RandomVector(n, 100 + static_cast<std::uint32_t>(s), 1.0f));
      RefStep(base, s + 1, grads.back(), scales[s], lrs[s], &want);
    }
    for (int threads : {1, 2, 3}) {
      // Below one chunk the pool is not used; the big size needs no second 1-thread run.
      if ((n < 1000 && threads > 1) || (n > 1000 && threads == 1)) continue;
      SCOPED_TRACE(::testing::Message() << "n=" << n << " threads=" << threads);
      AdamOptions options = base;
      options.threads = threads;
      ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(options));
      EXPECT_EQ(adam.simd_path(), path);
      EXPECT_EQ(adam.threads(), threads);
      State got = initial;
      for (int s = 0; s < 3; ++s) {
        ZINF_ASSERT_OK(adam.Step(s + 1, got.param, grads[s], got.exp_avg, got.exp_avg_sq,
                                 {.grad_scale = scales[s],
                                  .max_exp_avg_sq = got.max_exp_avg_sq,
                                  .bf16_param = got.bf16,
                                  .lr = lrs[s]}));
      }
      EXPECT_TRUE(SameFloats("param", want.param, got.param));
      EXPECT_TRUE(SameFloats("exp_avg", want.exp_avg, got.exp_avg));
      EXPECT_TRUE(SameFloats("exp_avg_sq", want.exp_avg_sq, got.exp_avg_sq));
      EXPECT_TRUE(SameFloats("max_exp_avg_sq", want.max_exp_avg_sq, got.max_exp_avg_sq));
      EXPECT_TRUE(want.bf16 == got.bf16) << "bf16 copy differs";
    }
  }
}

// Non-finite gradients: NaN and inf must flow through every path like through the reference.
TEST_P(CpuAdamPathTest, NonFiniteGradientsMatchReference) {
  const auto& [path, config] = GetParam();
  SKIP_IF_UNSUPPORTED(path);
  const AdamOptions options = {.weight_decay = config.weight_decay,
                               .adamw = config.adamw,
                               .amsgrad = config.amsgrad,
                               .threads = 1,
                               .simd = path};
  const std::size_t n = 45;
  std::vector<float> grad = RandomVector(n, 7, 1.0f);
  grad[3] = std::numeric_limits<float>::quiet_NaN();
  grad[17] = std::numeric_limits<float>::infinity();
  grad[18] = -std::numeric_limits<float>::infinity();
  grad[40] = std::numeric_limits<float>::max();
  State want = InitialState(n, config.amsgrad);
  if (config.amsgrad) want.max_exp_avg_sq[5] = std::numeric_limits<float>::quiet_NaN();
  State got = want;
  RefStep(options, 4, grad, 1.0f, options.lr, &want);
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(options));
  ZINF_ASSERT_OK(adam.Step(4, got.param, grad, got.exp_avg, got.exp_avg_sq,
                           {.max_exp_avg_sq = got.max_exp_avg_sq, .bf16_param = got.bf16}));
  EXPECT_TRUE(SameFloats("param", want.param, got.param));
  EXPECT_TRUE(SameFloats("exp_avg", want.exp_avg, got.exp_avg));
  EXPECT_TRUE(SameFloats("exp_avg_sq", want.exp_avg_sq, got.exp_avg_sq));
  EXPECT_TRUE(SameFloats("max_exp_avg_sq", want.max_exp_avg_sq, got.max_exp_avg_sq));
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_EQ(got.bf16[i], RefBf16(got.param[i])) << i;
  }
  EXPECT_TRUE(std::isnan(got.param[3]));
  if (config.amsgrad) {
    EXPECT_TRUE(std::isnan(got.max_exp_avg_sq[5]));
  }
}

// lr = 0 and zero gradients leave param unchanged, so the fused bf16 cast can be checked on
// chosen values: ties to even, just above/below ties, overflow to inf, inf, NaN, denormals.
TEST_P(CpuAdamKernelTest, Bf16CastRoundsToNearestEven) {
  const SimdPath path = GetParam();
  SKIP_IF_UNSUPPORTED(path);
  std::vector<float> param = {
      1.0f,
      FromBits(0x3f808000u),                    // tie, kept half even -> 0x3f80
      FromBits(0x3f818000u),                    // tie, kept half odd -> 0x3f82
      FromBits(0x3f808001u),                    // above the tie -> 0x3f81
      FromBits(0x3f807fffu),                    // below the tie -> 0x3f80
      FromBits(0xbf818000u),                    // negative tie, odd -> 0xbf82
      std::numeric_limits<float>::max(),        // rounds up to inf 0x7f80
      std::numeric_limits<float>::infinity(),   // 0x7f80
      -std::numeric_limits<float>::infinity(),  // 0xff80
      std::numeric_limits<float>::quiet_NaN(),  // 0x7fc0
      FromBits(0xffc12345u),                    // negative NaN with payload -> 0xffc1
      FromBits(0x00008000u),                    // denormal tie, even -> 0x0000
      FromBits(0x00018000u),                    // denormal tie, odd -> 0x0002
      FromBits(0x0000ffffu),                    // denormal above tie -> 0x0001
      -0.0f,                                    // 0x8000
      FromBits(0x7f7f8000u),                    // tie below max, odd -> 0x7f80 (inf)
  };
  const std::uint16_t expected[] = {0x3f80, 0x3f80, 0x3f82, 0x3f81, 0x3f80, 0xbf82, 0x7f80, 0x7f80,
                                    0xff80, 0x7fc0, 0xffc1, 0x0000, 0x0002, 0x0001, 0x8000, 0x7f80};
  // Plus random bit patterns of every kind, to compare with the reference rounding.
  std::mt19937 rng(9);
  for (int i = 0; i < 5000; ++i) param.push_back(FromBits(static_cast<std::uint32_t>(rng())));
  const std::size_t n = param.size();
  const std::vector<float> before = param;
  std::vector<float> grad(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
  std::vector<std::uint16_t> out(n, 0);
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.lr = 0.0, .simd = path}));
  ZINF_ASSERT_OK(adam.Step(1, param, grad, m, v, {.bf16_param = out}));
  for (std::size_t i = 0; i < std::size(expected); ++i) {
    EXPECT_EQ(out[i], expected[i]) << "value " << i << " bits 0x" << std::hex << Bits(before[i]);
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(SameFloat(param[i], before[i])) << i;
    ASSERT_EQ(out[i], RefBf16(param[i])) << "bits 0x" << std::hex << Bits(param[i]);
    ASSERT_EQ(out[i], FloatBitsToBf16(Bits(param[i]))) << "bits 0x" << std::hex << Bits(param[i]);
  }
}

TEST_P(CpuAdamKernelTest, NormMatchesFreeFunctionAndLongDouble) {
  const SimdPath path = GetParam();
  SKIP_IF_UNSUPPORTED(path);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17},
                        CpuAdam::kNormBlockNumel + 5, 3 * CpuAdam::kNormBlockNumel + 17}) {
    const std::vector<float> x = RandomVector(n, 11, 3.0f);
    long double want = 0.0L;
    for (float f : x) want += static_cast<long double>(f) * f;
    const double free_norm = SquaredL2Norm(x);
    EXPECT_NEAR(free_norm, static_cast<double>(want), 1e-12 * static_cast<double>(want)) << n;
    for (int threads : {1, 2, 3}) {
      ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.threads = threads, .simd = path}));
      EXPECT_EQ(std::bit_cast<std::uint64_t>(adam.SquaredL2Norm(x)),
                std::bit_cast<std::uint64_t>(free_norm))
          << "n=" << n << " threads=" << threads;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllPaths, CpuAdamPathTest,
    ::testing::Combine(::testing::ValuesIn(KernelPaths()), ::testing::ValuesIn(kConfigs)),
    [](const ::testing::TestParamInfo<CpuAdamPathTest::ParamType>& param_info) {
      return std::string(SimdPathName(std::get<0>(param_info.param))) + "_" +
             std::get<1>(param_info.param).name;
    });
INSTANTIATE_TEST_SUITE_P(AllPaths, CpuAdamKernelTest, ::testing::ValuesIn(KernelPaths()),
                         [](const ::testing::TestParamInfo<SimdPath>& param_info) {
                           return std::string(SimdPathName(param_info.param));
                         });

// Hand-computed from torch's documented algorithm (lr 0.1, betas (0.9, 0.999), eps 1e-8, p 1,
// grad 0.5 then 0.5):
//   step 1: m = 0.1 * 0.5 = 0.05, v = 0.001 * 0.25 = 2.5e-4, bc1 = 0.1, bc2 = 0.001,
//           denom = sqrt(2.5e-4) / sqrt(0.001) + 1e-8 = 0.5 + 1e-8,
//           p = 1 - (0.1 / 0.1) * 0.05 / (0.5 + 1e-8) = 0.900000002
//   step 2: m = 0.9 * 0.05 + 0.05 = 0.095, v = 0.999 * 2.5e-4 + 2.5e-4 = 4.9975e-4,
//           bc1 = 0.19, bc2 = 0.001999, m / bc1 = 0.5, v / bc2 = 0.25,
//           p = 0.9 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.800000004
// AdamW with weight_decay 0.1 multiplies p by 1 - 0.1 * 0.1 = 0.99 first:
//           step 1: 0.99 - 0.1 = 0.890000002; step 2: 0.89 * 0.99 - 0.1 = 0.78110000398
// Adam with weight_decay 0.1 adds 0.1 * p to the gradient: g1 = 0.6 (step 1 still moves by lr:
//           0.9000000017), g2 = 0.5 + 0.1 * 0.9 = 0.59, m = 0.113, v = 7.0774e-4,
//           p = 0.9 - 0.1 * (0.113 / 0.19) / sqrt(7.0774e-4 / 0.001999) = 0.80004734
TEST(CpuAdam, KnownValuesOfTwoSteps) {
  struct Case {
    bool adamw;
    double weight_decay;
    double p1, p2;
  };
  for (const Case& c :
       {Case{true, 0.0, 0.900000002, 0.800000004}, Case{false, 0.0, 0.900000002, 0.800000004},
        Case{true, 0.1, 0.890000002, 0.78110000398}, Case{false, 0.1, 0.9000000017, 0.80004734}}) {
    for (SimdPath path : KernelPaths()) {
      if (!SimdPathSupported(path)) continue;
      SCOPED_TRACE(::testing::Message()
                   << SimdPathName(path) << " adamw=" << c.adamw << " wd=" << c.weight_decay);
      ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.lr = 0.1,
                                                               .weight_decay = c.weight_decay,
                                                               .adamw = c.adamw,
                                                               .threads = 1,
                                                               .simd = path}));
      std::vector<float> p = {1.0f}, g = {0.5f}, m = {0.0f}, v = {0.0f};
      ZINF_ASSERT_OK(adam.Step(1, p, g, m, v));
      EXPECT_NEAR(m[0], 0.1 * (0.5 + (c.adamw ? 0.0 : c.weight_decay)), 1e-8);
      EXPECT_NEAR(p[0], c.p1, 1e-6);
      ZINF_ASSERT_OK(adam.Step(2, p, g, m, v));
      EXPECT_NEAR(p[0], c.p2, 1e-6);
    }
  }
}

TEST(CpuAdam, AmsgradKeepsTheMaximumOfTheSecondMoment) {
  // Step 1 with a large gradient, step 2 with a small one: v falls, max_exp_avg_sq does not.
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.amsgrad = true, .threads = 1}));
  std::vector<float> p = {0.0f}, m = {0.0f}, v = {0.0f}, max_v = {0.0f};
  ZINF_ASSERT_OK(adam.Step(1, p, std::vector<float>{10.0f}, m, v, {.max_exp_avg_sq = max_v}));
  EXPECT_EQ(max_v[0], v[0]);
  const float peak = v[0];
  ZINF_ASSERT_OK(adam.Step(2, p, std::vector<float>{0.0f}, m, v, {.max_exp_avg_sq = max_v}));
  EXPECT_LT(v[0], peak);
  EXPECT_EQ(max_v[0], peak);
}

TEST(CpuAdam, ConcurrentStepsOnOneObjectAreSerialized) {
  const std::size_t n = 5 * CpuAdam::kChunkNumel + 3;
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.threads = 2}));
  State a = InitialState(n, false), b = InitialState(n, false);
  const std::vector<float> grad = RandomVector(n, 5, 1.0f);
  State want = InitialState(n, false);
  RefStep(adam.options(), 1, grad, 1.0f, adam.options().lr, &want);
  std::thread other([&] { ZINF_EXPECT_OK(adam.Step(1, a.param, grad, a.exp_avg, a.exp_avg_sq)); });
  ZINF_EXPECT_OK(adam.Step(1, b.param, grad, b.exp_avg, b.exp_avg_sq));
  other.join();
  EXPECT_TRUE(SameFloats("param a", want.param, a.param));
  EXPECT_TRUE(SameFloats("param b", want.param, b.param));
}

TEST(CpuAdam, ClipCoefficientFollowsClipGradNorm) {
  EXPECT_EQ(ClipCoefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(ClipCoefficient(0.0, 1.0), 1.0f);
  EXPECT_EQ(ClipCoefficient(10.0, 1.0), static_cast<float>(1.0 / (10.0 + 1e-6)));
  EXPECT_EQ(ClipCoefficient(4.0, 2.0), static_cast<float>(2.0 / (4.0 + 1e-6)));
  EXPECT_EQ(ClipCoefficient(std::numeric_limits<double>::infinity(), 1.0), 0.0f);
  EXPECT_TRUE(std::isnan(ClipCoefficient(std::nan(""), 1.0)));
}

TEST(CpuAdam, ResolvesDeepSpeedAdamWMode) {
  EXPECT_EQ(ResolveAdamWMode("AdamW", std::nullopt).value(), true);
  EXPECT_EQ(ResolveAdamWMode("adamw", false).value(), true);
  EXPECT_EQ(ResolveAdamWMode("Adam", std::nullopt).value(), true);
  EXPECT_EQ(ResolveAdamWMode("Adam", true).value(), true);
  EXPECT_EQ(ResolveAdamWMode("adam", false).value(), false);
  EXPECT_THAT(ResolveAdamWMode("Lamb", std::nullopt),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'Lamb'")));
}

TEST(CpuAdam, ParsesSimdPathNames) {
  for (SimdPath p : {SimdPath::kAuto, SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512}) {
    EXPECT_EQ(ParseSimdPath(SimdPathName(p)).value(), p);
  }
  EXPECT_THAT(ParseSimdPath("avx3"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'avx3'")));
  EXPECT_NE(BestSimdPath(), SimdPath::kAuto);
}

TEST(CpuAdam, AutoPicksTheBestPathAndHardwareThreads) {
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({}));
  EXPECT_EQ(adam.simd_path(), BestSimdPath());
  EXPECT_EQ(adam.threads(), static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

TEST(CpuAdam, UnsupportedForcedPathIsUnimplemented) {
  SimdPath missing = SimdPath::kAuto;
  for (SimdPath p : {SimdPath::kAvx512, SimdPath::kAvx2}) {
    if (!SimdPathSupported(p)) missing = p;
  }
  if (missing == SimdPath::kAuto) GTEST_SKIP() << "this CPU supports every SIMD path";
  EXPECT_THAT(CpuAdam::Create({.simd = missing}),
              StatusIs(ErrorCode::kUnimplemented, HasSubstr(SimdPathName(missing))));
}

TEST(CpuAdam, RejectsBadOptionsNamingTheField) {
  struct Bad {
    AdamOptions options;
    const char* field;
  };
  const Bad cases[] = {
      {{.lr = -1e-3}, "lr"},
      {{.lr = std::nan("")}, "lr"},
      {{.beta1 = 1.0}, "beta1"},
      {{.beta1 = -0.1}, "beta1"},
      {{.beta2 = 1.5}, "beta2"},
      {{.beta2 = std::nan("")}, "beta2"},
      {{.eps = 0.0}, "eps"},
      {{.eps = -1e-8}, "eps"},
      {{.eps = 1e-60}, "eps"},  // 0 as a float
      {{.weight_decay = -0.01}, "weight_decay"},
      {{.weight_decay = std::numeric_limits<double>::infinity()}, "weight_decay"},
      {{.threads = -1}, "threads"},
      {{.threads = 100000}, "threads"},
      {{.simd = static_cast<SimdPath>(42)}, "simd"},
  };
  for (const Bad& c : cases) {
    EXPECT_THAT(ValidateAdamOptions(c.options),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr(c.field)));
    EXPECT_THAT(CpuAdam::Create(c.options),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr(c.field)));
  }
  EXPECT_THAT(ValidateAdamOptions({}), IsOk());
}

TEST(CpuAdam, RejectsBadStepArgumentsWithoutTouchingState) {
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.threads = 1}));
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam ams, CpuAdam::Create({.amsgrad = true, .threads = 1}));
  std::vector<float> p(8, 1.0f), g(8, 1.0f), m(8, 0.0f), v(8, 0.0f), max_v(8, 0.0f), short3(3);
  std::vector<std::uint16_t> bf16(8), bf16_short(7);
  const auto kInvalid = ErrorCode::kInvalidArgument;
  EXPECT_THAT(adam.Step(0, p, g, m, v), StatusIs(kInvalid, HasSubstr("step")));
  EXPECT_THAT(adam.Step(-5, p, g, m, v), StatusIs(kInvalid, HasSubstr("step")));
  EXPECT_THAT(adam.Step(1, p, short3, m, v), StatusIs(kInvalid, HasSubstr("grad")));
  EXPECT_THAT(adam.Step(1, p, g, short3, v), StatusIs(kInvalid, HasSubstr("exp_avg")));
  EXPECT_THAT(adam.Step(1, p, g, m, short3), StatusIs(kInvalid, HasSubstr("exp_avg_sq")));
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.bf16_param = bf16_short}),
              StatusIs(kInvalid, HasSubstr("bf16_param")));
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.max_exp_avg_sq = max_v}),
              StatusIs(kInvalid, HasSubstr("amsgrad is off")));
  EXPECT_THAT(ams.Step(1, p, g, m, v), StatusIs(kInvalid, HasSubstr("max_exp_avg_sq")));
  EXPECT_THAT(ams.Step(1, p, g, m, v, {.max_exp_avg_sq = short3}),
              StatusIs(kInvalid, HasSubstr("max_exp_avg_sq")));
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.grad_scale = -1.0f}),
              StatusIs(kInvalid, HasSubstr("grad_scale")));
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.grad_scale = std::numeric_limits<float>::infinity()}),
              StatusIs(kInvalid, HasSubstr("grad_scale")));
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.grad_scale = NAN}),
              StatusIs(kInvalid, HasSubstr("grad_scale")));
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.lr = -1.0}), StatusIs(kInvalid, HasSubstr("lr")));
  // Segments: starting at 0, strictly increasing below the size, valid values, no override.
  const AdamHyperParams h;
  const std::vector<AdamSegment> late = {{.begin = 1, .hyper = h}};
  const std::vector<AdamSegment> repeated = {{.begin = 0, .hyper = h}, {.begin = 0, .hyper = h}};
  const std::vector<AdamSegment> beyond = {{.begin = 0, .hyper = h}, {.begin = 8, .hyper = h}};
  const std::vector<AdamSegment> bad_eps = {{.begin = 0, .hyper = {.eps = 0.0}}};
  const std::vector<AdamSegment> fine = {{.begin = 0, .hyper = h}, {.begin = 5, .hyper = h}};
  for (const auto* segments : {&late, &repeated, &beyond}) {
    EXPECT_THAT(adam.Step(1, p, g, m, v, {.segments = *segments}),
                StatusIs(kInvalid, HasSubstr("segment")));
  }
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.segments = bad_eps}),
              StatusIs(kInvalid, HasSubstr("segment 0: adam eps")));
  EXPECT_THAT(adam.Step(1, p, g, m, v, {.lr = 1e-3, .segments = fine}),
              StatusIs(kInvalid, HasSubstr("override together with segments")));
  EXPECT_EQ(p, std::vector<float>(8, 1.0f));
  EXPECT_EQ(m, std::vector<float>(8, 0.0f));
  EXPECT_EQ(v, std::vector<float>(8, 0.0f));
  EXPECT_EQ(max_v, std::vector<float>(8, 0.0f));
  // The same spans are fine once the arguments are right.
  ZINF_EXPECT_OK(adam.Step(1, p, g, m, v, {.bf16_param = bf16}));
  ZINF_EXPECT_OK(ams.Step(1, p, g, m, v, {.max_exp_avg_sq = max_v}));
}

// Parameter groups: a step over segments is, bit for bit, the step of each segment's elements
// with that segment's lr, betas, eps and weight_decay, also where a segment begins inside a
// work chunk and on several threads.
TEST(CpuAdam, SegmentsStepEachRunWithItsOwnHyperParameters) {
  const std::size_t n = 2 * CpuAdam::kChunkNumel + 333;
  const std::vector<AdamSegment> segments = {
      {.begin = 0, .hyper = {.lr = 1e-2, .betas = {0.9, 0.99}, .eps = 1e-8, .weight_decay = 0.1}},
      {.begin = 1000, .hyper = {.lr = 5e-3, .betas = {0.8, 0.999}, .eps = 1e-6}},
      {.begin = CpuAdam::kChunkNumel + 17,
       .hyper = {.lr = 2e-2, .betas = {0.95, 0.9}, .eps = 1e-7, .weight_decay = 0.01}},
  };
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p0(n), g(n);
  for (float& x : p0) x = normal(rng);
  for (float& x : g) x = normal(rng);
  for (bool adamw : {true, false}) {
    std::vector<float> want_p = p0, want_m(n), want_v(n);
    for (std::size_t i = 0; i < segments.size(); ++i) {
      const std::size_t begin = segments[i].begin;
      const std::size_t end = i + 1 < segments.size() ? segments[i + 1].begin : n;
      const AdamHyperParams& h = segments[i].hyper;
      ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam one, CpuAdam::Create({.lr = h.lr,
                                                              .beta1 = h.betas[0],
                                                              .beta2 = h.betas[1],
                                                              .eps = h.eps,
                                                              .weight_decay = h.weight_decay,
                                                              .adamw = adamw,
                                                              .threads = 1}));
      for (std::int64_t step = 1; step <= 2; ++step) {
        auto span = [&](std::vector<float>& x) { return std::span(x).subspan(begin, end - begin); };
        ZINF_ASSERT_OK(one.Step(step, span(want_p),
                                std::span<const float>(g).subspan(begin, end - begin), span(want_m),
                                span(want_v)));
      }
    }
    ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.adamw = adamw, .threads = 3}));
    std::vector<float> p = p0, m(n), v(n);
    for (std::int64_t step = 1; step <= 2; ++step) {
      ZINF_ASSERT_OK(adam.Step(step, p, g, m, v, {.segments = segments}));
    }
    EXPECT_EQ(0, std::memcmp(p.data(), want_p.data(), n * sizeof(float))) << "adamw " << adamw;
    EXPECT_EQ(0, std::memcmp(m.data(), want_m.data(), n * sizeof(float))) << "adamw " << adamw;
    EXPECT_EQ(0, std::memcmp(v.data(), want_v.data(), n * sizeof(float))) << "adamw " << adamw;
  }
}

TEST(CpuAdam, MovedFromObjectFailsCleanly) {
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.threads = 2}));
  CpuAdam moved = std::move(adam);
  std::vector<float> p(4), g(4), m(4), v(4);
  EXPECT_THAT(adam.Step(1, p, g, m, v),  // NOLINT(bugprone-use-after-move): on purpose
              StatusIs(ErrorCode::kFailedPrecondition));
  ZINF_EXPECT_OK(moved.Step(1, p, g, m, v));
}

}  // namespace
}  // namespace zinf::swapper
