// The q8 codec (swapper/q8.h) against references written here independently: the maps decoded
// bit pattern by bit pattern from the paper's tree layout, and the nearest code by brute force.
#include "zinf/swapper/q8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "zinf/core/process_stats.h"
#include "zinf/swapper/cpu_adam.h"

namespace zinf::swapper::q8 {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

// Decodes every 8-bit pattern: (sign,) zeros, the indicator bit, fraction bits; the patterns
// without an indicator are 0 and 1.
std::vector<float> ReferenceMap(MapKind kind) {
  const bool is_signed = kind == MapKind::kSigned;
  const int bits = is_signed ? 7 : 8;
  std::vector<float> out;
  for (int b = 0; b < 256; ++b) {
    const bool negative = is_signed && (b & 0x80) != 0;
    const int r = is_signed ? (b & 0x7f) : b;
    const int specials = is_signed ? 0 : 1;  // unsigned: 0 and 1 are the patterns 0 and 1
    if (r <= specials) {
      out.push_back(r == 0 && !negative ? 0.0f : 1.0f);
      continue;
    }
    int top = bits - 1;
    while ((r >> top) == 0) --top;
    const int zeros = bits - 1 - top;
    const int fraction_bits = top;  // below the indicator
    const int k = r & ((1 << fraction_bits) - 1);
    const double fraction = 0.1 + (k + 0.5) * 0.9 / (1 << fraction_bits);
    const double value = fraction / std::pow(10.0, zeros);
    out.push_back(static_cast<float>(negative ? -value : value));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::uint8_t BruteForceNearest(MapKind kind, float normalized) {
  const auto& values = MapValues(kind);
  int best = 0;
  for (int c = 1; c < 256; ++c) {
    if (std::fabs(static_cast<double>(normalized) - values[c]) <
        std::fabs(static_cast<double>(normalized) - values[best])) {
      best = c;
    }
  }
  return static_cast<std::uint8_t>(best);
}

class MapTest : public ::testing::TestWithParam<MapKind> {};

TEST_P(MapTest, EqualsTheTreeLayoutAndIsStrictlyAscending) {
  const MapKind kind = GetParam();
  const auto& values = MapValues(kind);
  const std::vector<float> ref = ReferenceMap(kind);
  for (int c = 0; c < 256; ++c) {
    EXPECT_NEAR(values[c], ref[c], std::fabs(ref[c]) * 2e-7) << "code " << c;
    if (c > 0) {
      EXPECT_LT(values[c - 1], values[c]) << "code " << c;
    }
  }
  EXPECT_EQ(values[255], 1.0f);
  EXPECT_EQ(values[ZeroCode(kind)], 0.0f);
  if (kind == MapKind::kSigned) {
    EXPECT_EQ(ZeroCode(kind), 127);
    EXPECT_LT(values[0], -0.99f);
    // Symmetric: every negative value is the negation of a positive one.
    for (int c = 0; c < 127; ++c) EXPECT_EQ(values[c], -values[254 - c]) << "code " << c;
  } else {
    EXPECT_EQ(ZeroCode(kind), 0);
  }
  // Seven decades: the smallest magnitude is about 1e-7.
  EXPECT_LT(std::fabs(values[ZeroCode(kind) + 1]), 1e-6f);
}

TEST_P(MapTest, NearestCodeIsTheBruteForceNearestTiesDown) {
  const MapKind kind = GetParam();
  const auto& values = MapValues(kind);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(kind == MapKind::kSigned ? -1.0f : 0.0f, 1.0f);
  std::vector<float> probes;
  for (int i = 0; i < 20000; ++i) probes.push_back(uniform(rng));
  std::uniform_real_distribution<float> exponent(-9.0f, 0.0f);  // every decade, and below
  for (int i = 0; i < 20000; ++i) {
    const float magnitude = std::pow(10.0f, exponent(rng));
    probes.push_back(i % 2 == 0 ? magnitude : -magnitude);
  }
  for (int c = 0; c + 1 < 256; ++c) {
    // Exactly between two values (when a float can be) and the floats around it.
    const float mid = static_cast<float>((static_cast<double>(values[c]) + values[c + 1]) / 2);
    for (float p : {mid, std::nextafter(mid, -2.0f), std::nextafter(mid, 2.0f), values[c]}) {
      probes.push_back(p);
    }
  }
  for (float p : probes) {
    if (kind == MapKind::kUnsigned && p < 0) continue;
    ASSERT_EQ(NearestCode(kind, p), BruteForceNearest(kind, p)) << "x/scale = " << p;
  }
  EXPECT_EQ(NearestCode(kind, 1.0f), 255);
  EXPECT_EQ(NearestCode(kind, 0.0f), ZeroCode(kind));
  if (kind == MapKind::kUnsigned) {
    EXPECT_EQ(NearestCode(kind, -0.5f), 0);
  }
}

TEST_P(MapTest, RoundTripErrorIsAtMostHalfTheLocalGap) {
  const MapKind kind = GetParam();
  const auto& values = MapValues(kind);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(3 * kBlockNumel + 123);
  for (std::size_t i = 0; i < x.size(); ++i) {
    // Magnitudes over many decades, as Adam's moments have.
    const float v = normal(rng) * std::pow(10.0f, -static_cast<float>(i % 9));
    x[i] = kind == MapKind::kSigned ? v : std::fabs(v);
  }
  std::vector<std::uint8_t> codes(x.size());
  std::vector<float> scales(NumBlocks(x.size()));
  ZINF_ASSERT_OK(Quantize(kind, x, codes, scales));
  std::vector<float> back(x.size());
  ZINF_ASSERT_OK(Dequantize(kind, codes, scales, back));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float scale = scales[i / kBlockNumel];
    const float n = x[i] / scale;
    const int c = codes[i];
    // x/scale lies between the neighbours of its code's value, nearer to that value.
    const float lo = c > 0 ? values[c - 1] : values[0];
    const float hi = c < 255 ? values[c + 1] : values[255];
    EXPECT_LE(std::fabs(n - values[c]), std::max(values[c] - lo, hi - values[c]) / 2 + 1e-7f) << i;
    EXPECT_EQ(back[i], values[c] * scale) << i;
  }
  // Each block's largest element is its scale; a positive one comes back exactly.
  for (std::size_t b = 0; b < scales.size(); ++b) {
    const auto first = x.begin() + static_cast<std::ptrdiff_t>(b * kBlockNumel);
    const auto last =
        first + static_cast<std::ptrdiff_t>(std::min(kBlockNumel, x.size() - b * kBlockNumel));
    const auto top =
        std::max_element(first, last, [](float a, float c) { return std::fabs(a) < std::fabs(c); });
    EXPECT_EQ(scales[b], std::fabs(*top));
    if (*top > 0) {
      EXPECT_EQ(back[static_cast<std::size_t>(top - x.begin())], *top);
    }
  }
}

TEST_P(MapTest, ZeroAndConstantBlocks) {
  const MapKind kind = GetParam();
  std::vector<float> zeros(kBlockNumel, 0.0f);
  std::vector<std::uint8_t> codes(kBlockNumel, 99);
  EXPECT_EQ(QuantizeBlock(kind, zeros, codes), 0.0f);
  EXPECT_THAT(codes, ::testing::Each(ZeroCode(kind)));
  std::vector<float> back(kBlockNumel, 5.0f);
  DequantizeBlock(kind, codes, 0.0f, back);
  EXPECT_THAT(back, ::testing::Each(0.0f));

  // A constant block (also of a denormal) is exact: every element is the scale.
  for (float c : {0.25f, 3e-41f, std::numeric_limits<float>::max()}) {
    std::vector<float> constant(100, c);
    std::vector<std::uint8_t> cc(100);
    EXPECT_EQ(QuantizeBlock(kind, constant, cc), c);
    std::vector<float> out(100);
    DequantizeBlock(kind, cc, c, out);
    EXPECT_THAT(out, ::testing::Each(c));
  }
}

TEST_P(MapTest, NonFiniteStateIsRefusedNotEncoded) {
  const MapKind kind = GetParam();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(kBlockNumel + 10, 0.5f);
    x[kBlockNumel + 3] = bad;
    std::vector<std::uint8_t> codes(x.size());
    std::vector<float> scales(2);
    EXPECT_THAT(Quantize(kind, x, codes, scales),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("element 2051")));
  }
}

INSTANTIATE_TEST_SUITE_P(Maps, MapTest, ::testing::Values(MapKind::kSigned, MapKind::kUnsigned),
                         [](const ::testing::TestParamInfo<MapKind>& p) {
                           return p.param == MapKind::kSigned ? "Signed" : "Unsigned";
                         });

TEST(Q8, SizesAreChecked) {
  std::vector<float> x(kBlockNumel + 1);
  std::vector<std::uint8_t> codes(x.size());
  std::vector<float> one_scale(1), two_scales(2);
  EXPECT_THAT(Quantize(MapKind::kSigned, x, codes, one_scale),
              StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(Dequantize(MapKind::kSigned, codes, one_scale, x),
              StatusIs(ErrorCode::kInvalidArgument));
  ZINF_EXPECT_OK(Quantize(MapKind::kSigned, x, codes, two_scales));
  EXPECT_EQ(NumBlocks(0), 0u);
  EXPECT_EQ(NumBlocks(kBlockNumel), 1u);
}

// ---- CpuAdam::StepQ8 against a reference written here: decode, torch's Adam/AdamW per element
// in the documented order (cpu_adam.h), encode with the brute-force nearest code.

struct RefState {
  std::vector<float> param, grad;
  std::vector<std::uint8_t> m_codes, v_codes;
  std::vector<float> m_scales, v_scales;
  std::vector<std::uint16_t> bf16;
};

void RefEncode(MapKind kind, const std::vector<float>& x, std::size_t begin, std::size_t len,
               std::vector<std::uint8_t>& codes, float& scale) {
  scale = 0;
  for (std::size_t i = 0; i < len; ++i) scale = std::max(scale, std::fabs(x[i]));
  for (std::size_t i = 0; i < len; ++i) {
    codes[begin + i] = scale == 0 ? ZeroCode(kind) : BruteForceNearest(kind, x[i] / scale);
  }
}

// n normal weights and zero moments (the state a swapper initializes).
RefState Fresh(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  RefState s;
  s.param.resize(n);
  for (float& p : s.param) p = normal(rng);
  s.m_codes.assign(n, ZeroCode(MapKind::kSigned));
  s.v_codes.assign(n, ZeroCode(MapKind::kUnsigned));
  s.m_scales.assign(NumBlocks(n), 0.0f);
  s.v_scales.assign(NumBlocks(n), 0.0f);
  s.bf16.assign(n, 0);
  return s;
}

// One step of the reference; element e takes the hyper-parameters of the last segment that
// begins at or before it (cpu_adam.h, StepExtras::segments).
void RefStepQ8(RefState& s, std::int64_t step, std::span<const AdamSegment> segments, bool adamw,
               float grad_scale) {
  const auto& ms = MapValues(MapKind::kSigned);
  const auto& vs = MapValues(MapKind::kUnsigned);
  struct Scalars {
    float b1, b2, omb1, omb2, step_size, bc2_sqrt, eps, wd, decay;
    bool use_wd;
  };
  std::vector<Scalars> scalars;
  for (const AdamSegment& seg : segments) {
    const AdamHyperParams& h = seg.hyper;
    scalars.push_back({
        .b1 = static_cast<float>(h.betas[0]),
        .b2 = static_cast<float>(h.betas[1]),
        .omb1 = static_cast<float>(1.0 - h.betas[0]),
        .omb2 = static_cast<float>(1.0 - h.betas[1]),
        .step_size = static_cast<float>(h.lr / (1.0 - std::pow(h.betas[0], step))),
        .bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.betas[1], step))),
        .eps = static_cast<float>(h.eps),
        .wd = static_cast<float>(h.weight_decay),
        .decay = static_cast<float>(1.0 - h.lr * h.weight_decay),
        .use_wd = h.weight_decay != 0,
    });
  }
  const std::size_t n = s.param.size();
  std::size_t at = 0;  // the segment of element e
  for (std::size_t begin = 0; begin < n; begin += kBlockNumel) {
    const std::size_t len = std::min(kBlockNumel, n - begin);
    const std::size_t b = begin / kBlockNumel;
    std::vector<float> m(len), v(len);
    for (std::size_t i = 0; i < len; ++i) {
      const std::size_t e = begin + i;
      while (at + 1 < segments.size() && segments[at + 1].begin <= e) ++at;
      const Scalars& c = scalars[at];
      float mi = ms[s.m_codes[e]] * s.m_scales[b];
      float vi = vs[s.v_codes[e]] * s.v_scales[b];
      float g = s.grad[e];
      if (grad_scale != 1.0f) g = g * grad_scale;
      float p = s.param[e];
      if (c.use_wd && !adamw) g = g + c.wd * p;
      if (c.use_wd && adamw) p = p * c.decay;
      mi = c.b1 * mi + c.omb1 * g;
      vi = c.b2 * vi + (c.omb2 * g) * g;
      const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
      p = p - (c.step_size * mi) / denom;
      s.param[e] = p;
      s.bf16[e] = FloatBitsToBf16(std::bit_cast<std::uint32_t>(p));
      m[i] = mi;
      v[i] = vi;
    }
    RefEncode(MapKind::kSigned, m, begin, len, s.m_codes, s.m_scales[b]);
    RefEncode(MapKind::kUnsigned, v, begin, len, s.v_codes, s.v_scales[b]);
  }
}

void RefStepQ8(RefState& s, std::int64_t step, double lr, double beta1, double beta2, double eps,
               double wd, bool adamw, float grad_scale) {
  const AdamSegment one = {
      .begin = 0, .hyper = {.lr = lr, .betas = {beta1, beta2}, .eps = eps, .weight_decay = wd}};
  RefStepQ8(s, step, std::span(&one, 1), adamw, grad_scale);
}

// Three steps over two chunks (the second short, with a short last block), AdamW on 1 and 3
// threads and Adam (L2) on 3, with grad_scale and an lr override: every SIMD path this CPU has
// gives the reference's bytes (the reference runs once per configuration).
TEST(StepQ8, MatchesTheReferenceBitForBitOnEveryPath) {
  const std::size_t n = CpuAdam::kChunkNumel + 2 * kBlockNumel + 77;
  constexpr int kSteps = 3;
  std::vector<SimdPath> paths;
  for (SimdPath path : {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512}) {
    if (SimdPathSupported(path)) paths.push_back(path);
  }
  for (bool adamw : {true, false}) {
    for (int threads : {1, 3}) {
      if (!adamw && threads == 1) continue;
      std::mt19937 rng(3);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      RefState ref = Fresh(n, rng);
      const RefState initial = ref;
      std::vector<std::vector<float>> grads;
      std::vector<RefState> after;  // the reference after each step
      for (int step = 1; step <= kSteps; ++step) {
        ref.grad.resize(n);
        for (std::size_t i = 0; i < n; ++i) {
          // Magnitudes over several decades, some blocks all zero.
          const bool zero_block = (i / kBlockNumel) % 7 == 3;
          ref.grad[i] = zero_block ? 0.0f : normal(rng) * std::pow(10.0f, -float(i % 5));
        }
        grads.push_back(ref.grad);
        RefStepQ8(ref, step, step == 3 ? 3e-3 : 1e-2, 0.9, 0.99, 1e-8, 0.01, adamw,
                  step == 2 ? 0.5f : 1.0f);
        after.push_back(ref);
      }
      for (SimdPath path : paths) {
        SCOPED_TRACE(::testing::Message() << "adamw=" << adamw << " threads=" << threads
                                          << " path=" << SimdPathName(path));
        ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.lr = 1e-2,
                                                                 .beta1 = 0.9,
                                                                 .beta2 = 0.99,
                                                                 .eps = 1e-8,
                                                                 .weight_decay = 0.01,
                                                                 .adamw = adamw,
                                                                 .threads = threads,
                                                                 .simd = path}));
        RefState got = initial;
        for (int step = 1; step <= kSteps; ++step) {
          const RefState& want = after[static_cast<std::size_t>(step - 1)];
          got.grad = grads[static_cast<std::size_t>(step - 1)];
          ZINF_ASSERT_OK(adam.StepQ8(step, got.param, got.grad, {got.m_codes, got.m_scales},
                                     {got.v_codes, got.v_scales},
                                     {.grad_scale = step == 2 ? 0.5f : 1.0f,
                                      .bf16_param = got.bf16,
                                      .lr = step == 3 ? 3e-3 : 1e-2}));
          ASSERT_EQ(got.m_scales, want.m_scales) << "step " << step;
          ASSERT_EQ(got.v_scales, want.v_scales) << "step " << step;
          ASSERT_EQ(got.m_codes, want.m_codes) << "step " << step;
          ASSERT_EQ(got.v_codes, want.v_codes) << "step " << step;
          ASSERT_EQ(0, std::memcmp(got.param.data(), want.param.data(), n * sizeof(float)))
              << "step " << step;
          ASSERT_EQ(got.bf16, want.bf16) << "step " << step;
        }
      }
    }
  }
}

// Parameter groups: segments that begin inside a block, on a block boundary and inside the
// second chunk switch the hyper-parameters element by element; a block holding two groups keeps
// one scale (the reference's), on every path and thread count.
TEST(StepQ8, SegmentsSwitchHyperParametersInsideBlocks) {
  const std::size_t n = CpuAdam::kChunkNumel + 2 * kBlockNumel + 77;
  const std::vector<AdamSegment> segments = {
      {.begin = 0, .hyper = {.lr = 1e-2, .betas = {0.9, 0.99}, .eps = 1e-8, .weight_decay = 0.1}},
      {.begin = kBlockNumel + 100, .hyper = {.lr = 3e-3, .betas = {0.8, 0.999}, .eps = 1e-6}},
      {.begin = 3 * kBlockNumel,
       .hyper = {.lr = 2e-2, .betas = {0.95, 0.9}, .eps = 1e-8, .weight_decay = 0.01}},
      {.begin = CpuAdam::kChunkNumel + 5, .hyper = {.lr = 0.0, .weight_decay = 0.5}},
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const RefState initial = Fresh(n, rng);
  std::vector<std::vector<float>> grads(3, std::vector<float>(n));
  for (auto& g : grads) {
    for (float& x : g) x = normal(rng);
  }
  for (bool adamw : {true, false}) {
    RefState want = initial;
    std::vector<RefState> after;
    for (int step = 1; step <= 3; ++step) {
      want.grad = grads[static_cast<std::size_t>(step - 1)];
      RefStepQ8(want, step, segments, adamw, 1.0f);
      after.push_back(want);
    }
    for (SimdPath path : {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512}) {
      if (!SimdPathSupported(path)) continue;
      for (int threads : {1, 3}) {
        SCOPED_TRACE(::testing::Message() << "adamw=" << adamw << " threads=" << threads
                                          << " path=" << SimdPathName(path));
        ZINF_ASSERT_OK_AND_ASSIGN(
            CpuAdam adam, CpuAdam::Create({.adamw = adamw, .threads = threads, .simd = path}));
        RefState got = initial;
        for (int step = 1; step <= 3; ++step) {
          const RefState& expected = after[static_cast<std::size_t>(step - 1)];
          got.grad = grads[static_cast<std::size_t>(step - 1)];
          ZINF_ASSERT_OK(adam.StepQ8(step, got.param, got.grad, {got.m_codes, got.m_scales},
                                     {got.v_codes, got.v_scales},
                                     {.bf16_param = got.bf16, .segments = segments}));
          ASSERT_EQ(got.m_scales, expected.m_scales) << "step " << step;
          ASSERT_EQ(got.v_scales, expected.v_scales) << "step " << step;
          ASSERT_EQ(got.m_codes, expected.m_codes) << "step " << step;
          ASSERT_EQ(got.v_codes, expected.v_codes) << "step " << step;
          ASSERT_EQ(0, std::memcmp(got.param.data(), expected.param.data(), n * sizeof(float)))
              << "step " << step;
        }
      }
    }
  }
}

// With beta1 = beta2 = 0 a step's moments are exactly grad and grad * grad: the vector paths'
// encoders (which multiply by 1 / scale and fall back to the division near a threshold) must
// give the scalar codec's codes on inputs built to sit on, and a few steps around, every
// threshold times the scale, for scales where 1 / scale is and is not a normal float, with tiny
// values, denormals and signed zeros, and the block maximum at every position of a block.
std::vector<float> AdversarialGrad() {
  std::vector<float> g;
  const auto& values = MapValues(MapKind::kSigned);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  // 1 / scale is normal for scales in [2^-125, 2^125]; the squares (exp_avg_sq) must stay finite:
  // from 0x1.6a09e6p+62 on their block scales lie in [2^125, 2^127], where 1 / scale is at best
  // subnormal.
  for (float scale : {1.0f, 0.7f, 3e-5f, 0x1p-125f, 1e-39f, 0x1p-63f, 0x1p+62f, 0x1.6a09e6p+62f,
                      0x1.8p+62f, 0x1p+63f, 1e19f, 0x1.6a09e6p+63f, 0x1.fffp+63f}) {
    std::vector<float> block;
    for (int c = 0; c + 1 < 256; ++c) {
      const double t = (static_cast<double>(values[c]) + values[c + 1]) / 2;
      const float on = static_cast<float>(t * scale);
      for (int k : {0, 1, 2, 3, 4, 5, 8, 16, 31, 32, 33, 40, 64}) {
        for (float toward :
             {-std::numeric_limits<float>::max(), std::numeric_limits<float>::max()}) {
          float x = on;
          for (int j = 0; j < k; ++j) x = std::nextafter(x, toward);
          if (std::fabs(x) < scale) block.push_back(x);
        }
      }
    }
    for (float tiny : {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-40f, 1e-38f, -3e-39f}) {
      block.push_back(tiny);
      block.push_back(tiny * scale);
    }
    // The maximum (with either sign) at a different place in each block.
    for (std::size_t begin = 0; begin < block.size(); begin += kBlockNumel) {
      const std::size_t len = std::min(kBlockNumel, block.size() - begin);
      block[begin + (begin / kBlockNumel * 997) % len] = (begin / kBlockNumel) % 2 ? -scale : scale;
    }
    while (block.size() % kBlockNumel != 0) block.push_back(unit(rng) * scale);
    g.insert(g.end(), block.begin(), block.end());
  }
  // A block with its maximum at each position, then a short block.
  for (std::size_t pos = 0; pos < kBlockNumel; ++pos) {
    for (std::size_t i = 0; i < kBlockNumel; ++i) g.push_back(unit(rng) * 0.5f);
    g[g.size() - kBlockNumel + pos] = pos % 3 == 0 ? -0.75f : 0.75f;
  }
  for (int i = 0; i < 77; ++i) g.push_back(unit(rng) * 1e-3f);
  return g;
}

TEST(StepQ8, VectorEncodersGiveTheScalarCodesOnAdversarialMoments) {
  const std::vector<float> grad = AdversarialGrad();
  const std::size_t n = grad.size();
  std::vector<float> squared(n);
  for (std::size_t i = 0; i < n; ++i) squared[i] = grad[i] * grad[i];
  std::vector<std::uint8_t> want_m(n), want_v(n);
  std::vector<float> want_m_scales(NumBlocks(n)), want_v_scales(NumBlocks(n));
  ZINF_ASSERT_OK(Quantize(MapKind::kSigned, grad, want_m, want_m_scales));
  ZINF_ASSERT_OK(Quantize(MapKind::kUnsigned, squared, want_v, want_v_scales));
  int paths = 0;
  for (SimdPath path : {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512}) {
    if (!SimdPathSupported(path)) continue;
    ++paths;
    SCOPED_TRACE(::testing::Message() << "path=" << SimdPathName(path));
    ZINF_ASSERT_OK_AND_ASSIGN(
        CpuAdam adam,
        CpuAdam::Create({.lr = 0.0, .beta1 = 0.0, .beta2 = 0.0, .threads = 2, .simd = path}));
    std::vector<float> param(n, 1.0f);
    std::vector<std::uint8_t> m(n, ZeroCode(MapKind::kSigned)), v(n, ZeroCode(MapKind::kUnsigned));
    std::vector<float> m_scales(NumBlocks(n)), v_scales(NumBlocks(n));
    ZINF_ASSERT_OK(adam.StepQ8(1, param, grad, {m, m_scales}, {v, v_scales}));
    ASSERT_EQ(m_scales, want_m_scales);
    ASSERT_EQ(v_scales, want_v_scales);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(m[i], want_m[i]) << "exp_avg element " << i << " = " << grad[i] << ", scale "
                                 << want_m_scales[i / kBlockNumel];
      ASSERT_EQ(v[i], want_v[i]) << "exp_avg_sq element " << i << " = " << squared[i] << ", scale "
                                 << want_v_scales[i / kBlockNumel];
    }
  }
  EXPECT_GE(paths, 1);
}

TEST(StepQ8, BadArgumentsAndNonFiniteMoments) {
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.threads = 1}));
  std::vector<float> param(10, 1.0f), grad(10, 0.1f), scales(1), short_scales;
  std::vector<std::uint8_t> m(10), v(10);
  EXPECT_THAT(adam.StepQ8(1, param, grad, {m, short_scales}, {v, scales}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("exp_avg has 10 codes and 0")));
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam ams, CpuAdam::Create({.amsgrad = true, .threads = 1}));
  std::vector<float> scales2(1);
  EXPECT_THAT(ams.StepQ8(1, param, grad, {m, scales}, {v, scales2}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("amsgrad")));
  // A gradient whose square overflows: exp_avg_sq becomes infinite and is not encoded.
  grad[4] = 3e30f;
  EXPECT_THAT(adam.StepQ8(1, param, grad, {m, scales}, {v, scales2}),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("element 4")));
}

// The decoded moments live one q8 block at a time on each thread's stack: the step adds nothing
// that grows with the sub-group to the RSS (the swapper's pool is the only per-sub-group memory).
// A decoded fp32 moment of this sub-group would be 32 MiB; the bound leaves room for page noise.
TEST(StepQ8, ScratchDoesNotGrowWithTheSubGroup) {
  constexpr std::size_t kNumel = std::size_t{8} << 20;
  constexpr std::uint64_t kBoundBytes = std::uint64_t{4} << 20;
  std::vector<float> param(kNumel, 0.5f), grad(kNumel, 1e-3f);
  std::vector<std::uint8_t> m(kNumel, ZeroCode(MapKind::kSigned));
  std::vector<std::uint8_t> v(kNumel, ZeroCode(MapKind::kUnsigned));
  std::vector<float> m_scales(NumBlocks(kNumel)), v_scales(NumBlocks(kNumel));
  ZINF_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create({.threads = 2}));
  if (!ResetPeakRss()) GTEST_SKIP() << "this kernel does not let the process reset its peak RSS";
  const std::uint64_t before = PeakRssBytes();
  ZINF_ASSERT_OK(adam.StepQ8(1, param, grad, {m, m_scales}, {v, v_scales}));
  EXPECT_LT(PeakRssBytes() - before, kBoundBytes)
      << "StepQ8 of " << kNumel << " elements raised the peak RSS by that many bytes";
}

}  // namespace
}  // namespace zinf::swapper::q8
