// The q8 vector kernels against the scalar rule they must reproduce bit for bit, called directly
// (private headers): the AVX-512 arithmetic encoder and the VBMI decoding exist besides the
// gathers they replace, and CpuAdam picks one of each per CPU, so the public tests see only one;
// the AVX2 step encodes the block before, which CpuAdam's tests meet only with whole blocks.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "cpu_adam_kernels.h"
#include "q8_kernels.h"
#include "zinf/swapper/q8.h"

namespace zinf::swapper::q8::internal {
namespace {

bool HasAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

using EncodeFn = void (*)(const Tables&, const float*, std::size_t, float, std::uint8_t*);
const swapper::internal::AdamScalars kScalars = {.beta1 = 0.9f,
                                                 .one_minus_beta1 = 0.1f,
                                                 .beta2 = 0.999f,
                                                 .one_minus_beta2 = 0.001f,
                                                 .step_size = 1e-3f,
                                                 .bc2_sqrt = 0.3f,
                                                 .eps = 1e-8f,
                                                 .grad_scale = 0.5f,
                                                 .l2_decay = 0.0f,
                                                 .param_decay = 0.99f,
                                                 .scale_grad = true,
                                                 .use_l2 = false,
                                                 .use_param_decay = true};

// A block's step input over the two maps, with made-up scales.
swapper::internal::Q8BlockIn BlockIn(const std::uint8_t* m_codes, const std::uint8_t* v_codes) {
  const Tables& ms = TablesFor(MapKind::kSigned);
  const Tables& vs = TablesFor(MapKind::kUnsigned);
  return {.m_codes = m_codes,
          .v_codes = v_codes,
          .m_map = ms.values.data(),
          .v_map = vs.values.data(),
          .m_planes = ms.planes.data(),
          .v_planes = vs.planes.data(),
          .m_scale = 0.37f,
          .v_scale = 2.5e-3f};
}

// The outputs of one q8 step of a block of n elements.
struct StepOut {
  std::vector<float> param, m, v;
  float m_max = 0, v_max = 0;
  bool ok = false;
  // Bit for bit.
  bool operator==(const StepOut& o) const {
    auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
    };
    return same(param, o.param) && same(m, o.m) && same(v, o.v) &&
           std::bit_cast<std::uint32_t>(m_max) == std::bit_cast<std::uint32_t>(o.m_max) &&
           std::bit_cast<std::uint32_t>(v_max) == std::bit_cast<std::uint32_t>(o.v_max) &&
           ok == o.ok;
  }
};

// An AVX2 step of the first n elements of one made-up block of kBlockNumel.
StepOut RunStepAvx2(std::size_t n, const swapper::internal::Q8BlockOut* previous) {
  struct Block {
    std::vector<std::uint8_t> m_codes, v_codes;
    std::vector<float> grad, param;
  };
  static const Block block = [] {
    std::mt19937 rng(17);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    Block b;
    for (std::size_t i = 0; i < kBlockNumel; ++i) {
      b.m_codes.push_back(static_cast<std::uint8_t>(rng()));
      b.v_codes.push_back(static_cast<std::uint8_t>(rng()));
      b.grad.push_back(normal(rng));
      b.param.push_back(normal(rng));
    }
    return b;
  }();
  StepOut out = {std::vector<float>(block.param.begin(), block.param.begin() + n),
                 std::vector<float>(n), std::vector<float>(n)};
  const swapper::internal::Q8BlockIn in = BlockIn(block.m_codes.data(), block.v_codes.data());
  const swapper::internal::AdamArrays a = {.param = out.param.data(),
                                           .grad = block.grad.data(),
                                           .exp_avg = out.m.data(),
                                           .exp_avg_sq = out.v.data(),
                                           .max_exp_avg_sq = nullptr,
                                           .bf16 = nullptr};
  out.ok =
      swapper::internal::AdamStepQ8BlockAvx2(kScalars, a, in, n, &out.m_max, &out.v_max, previous);
  return out;
}

// Every vector encoder this CPU runs gives CodesTail's codes for x[0, n) / scale: the block
// encoders, and the AVX2 step, which encodes the block before (Q8BlockOut) beside a block of its
// own (of another length, so that each outlasts the other) whose results do not change.
void ExpectScalarCodes(const Tables& t, const std::vector<float>& x, float scale,
                       const std::string& what) {
  std::vector<std::uint8_t> want(x.size());
  CodesTail(t, x.data(), 0, x.size(), scale, want.data());
  auto expect = [&](const char* name, const std::vector<std::uint8_t>& got) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << name << ", " << what << ": x = " << std::hexfloat << x[i]
                                 << ", scale = " << scale << ", x / scale = " << x[i] / scale;
    }
  };
  std::vector<std::pair<const char*, EncodeFn>> encoders;
  if (__builtin_cpu_supports("avx2")) encoders.push_back({"avx2", EncodeBlockAvx2});
  if (HasAvx512()) encoders.push_back({"avx512", EncodeBlockAvx512});
  for (const auto& [name, encode] : encoders) {
    std::vector<std::uint8_t> got(x.size());
    encode(t, x.data(), x.size(), scale, got.data());
    expect(name, got);
  }
  if (!__builtin_cpu_supports("avx2") || !InReciprocalRange(scale)) {
    return;
  }
  std::vector<std::uint8_t> m_codes(x.size()), v_codes(x.size());
  const swapper::internal::Q8BlockOut previous = {.m_tables = &TablesFor(MapKind::kSigned),
                                                  .v_tables = &TablesFor(MapKind::kUnsigned),
                                                  .m = x.data(),
                                                  .v = x.data(),
                                                  .n = x.size(),
                                                  .m_scale = scale,
                                                  .v_scale = scale,
                                                  .m_codes = m_codes.data(),
                                                  .v_codes = v_codes.data()};
  const std::size_t step_n = (x.size() * 7 + 13) % kBlockNumel + 1;
  static std::map<std::size_t, StepOut> alone;  // the step without a block before, by length
  auto [it, fresh] = alone.try_emplace(step_n);
  if (fresh) it->second = RunStepAvx2(step_n, nullptr);
  ASSERT_TRUE(RunStepAvx2(step_n, &previous) == it->second)
      << what << ": encoding the block before changed the AVX2 step";
  expect("avx2 step", &t == &TablesFor(MapKind::kSigned) ? m_codes : v_codes);
}

const MapKind kKinds[] = {MapKind::kSigned, MapKind::kUnsigned};

// With scale 1 the encoders see n itself: a sweep over the float bits of [-1, 1] in steps of
// 61, blocks of 2047 so the tails run too.
TEST(Q8Kernels, EncodersGiveTheScalarCodesOnASweepOfNormalizedValues) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no vector encoder";
  for (MapKind kind : kKinds) {
    const Tables& t = TablesFor(kind);
    std::vector<float> x;
    for (std::uint32_t bits = 0; bits <= std::bit_cast<std::uint32_t>(1.0f); bits += 61) {
      x.push_back(std::bit_cast<float>(bits));
      x.push_back(-std::bit_cast<float>(bits));
      if (x.size() >= 2047) {
        ExpectScalarCodes(t, x, 1.0f, "sweep");
        x.clear();
      }
    }
    ExpectScalarCodes(t, x, 1.0f, "sweep");
  }
}

// `steps` floats from each threshold between two codes of `t`, times `scale`, toward 0 and
// toward infinity: where an encoder that rounds 1 / scale differently would pick another code.
std::vector<float> NearThresholds(const Tables& t, float scale, int steps) {
  std::vector<float> x;
  for (std::size_t c = 0; c + 1 < 256; ++c) {
    const double th = (static_cast<double>(t.values[c]) + t.values[c + 1]) / 2;
    const float on = static_cast<float>(th * scale);
    for (float toward : {0.0f, std::numeric_limits<float>::infinity()}) {
      float v = on;
      for (int k = 0; k < steps; ++k, v = std::nextafter(v, toward)) x.push_back(v);
    }
  }
  return x;
}

// Values a few float steps from every threshold times scales whose reciprocals round, mixed
// with log-uniform magnitudes over all decades, zeros, subnormals and +-scale; tails too.
TEST(Q8Kernels, EncodersGiveTheScalarCodesNearThresholdsAndEverywhere) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no vector encoder";
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> log_mag(-28.0f, 0.0f);
  std::uniform_real_distribution<float> log_scale(-100.0f, 100.0f);
  for (MapKind kind : kKinds) {
    const Tables& t = TablesFor(kind);
    for (int round = 0; round < 100; ++round) {
      const float scale = round < 5 ? std::array{1.0f, 0.7f, 3.0f, 1e-30f, 3e-5f}[round]
                                    : std::exp2(log_scale(rng));
      std::vector<float> x = NearThresholds(t, scale, 24);
      for (int i = 0; i < 2000; ++i) {
        const float mag = std::exp2(log_mag(rng)) * scale;
        x.push_back(rng() % 2 ? mag : -mag);
      }
      for (float v : {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-39f, scale, -scale}) x.push_back(v);
      std::shuffle(x.begin(), x.end(), rng);
      // Each value fills a vector of 16 lanes: the encoders recompute a whole vector when one
      // lane is near, which would hide a wrong lane among near ones.
      std::vector<float> lanes;
      for (float v : x) lanes.insert(lanes.end(), 16, v);
      for (std::size_t begin = 0; begin < lanes.size();) {
        // Mostly whole vectors; every few blocks a tail of 1..15.
        std::size_t len = 16 * (1 + rng() % (kBlockNumel / 16));
        if (rng() % 4 == 0) len = len - 16 + 1 + rng() % 15;
        len = std::min(len, lanes.size() - begin);
        std::vector<float> block(lanes.begin() + begin, lanes.begin() + begin + len);
        for (float& v : block) v = std::fmin(std::fmax(v, -scale), scale);
        ExpectScalarCodes(t, block, scale, "round " + std::to_string(round));
        begin += len;
      }
    }
  }
}

// Block scales at the ends of the float range, where 1 / scale stops being a normal float:
// 2^125 to 2^127 (and FLT_MAX) at the top, where 1 / scale is subnormal from 2^126 on, and their
// mirror images at the bottom (subnormal scales among them; from 2^-128 down 1 / scale
// overflows). Every
// encoder must still give the scalar rule's codes: values a few steps from each threshold, log-
// uniform magnitudes, +-scale and 0; each value in a vector of its own, tails too.
TEST(Q8Kernels, EncodersGiveTheScalarCodesAtTheEndsOfTheFloatRange) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no vector encoder";
  const float top = std::numeric_limits<float>::max();
  std::vector<float> scales = {0x1p124f, 0x1.6a09e6p124f, 0x1p125f, std::nextafter(0x1p125f, top),
                               0x1.6a09e6p125f, std::nextafter(0x1p126f, 0.0f), 0x1p126f,
                               std::nextafter(0x1p126f, top), 0x1.6a09e6p126f, 0x1.8p126f,
                               0x1p127f, 0x1.fffffcp127f, top};
  // The bottom: 2^-125 (the range's lower edge) and below, into the subnormals.
  for (float s : {0x1p-124f, 0x1p-125f, std::nextafter(0x1p-125f, 0.0f), 0x1p-126f, 0x1p-127f,
                  0x1.8p-128f, 0x1p-128f, 0x1.6a09e6p-129f, 0x1p-129f, 0x1p-130f, 0x1p-140f,
                  0x1p-149f}) {
    scales.push_back(s);
  }
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> log_mag(-30.0f, 0.0f);
  for (MapKind kind : kKinds) {
    const Tables& t = TablesFor(kind);
    for (float scale : scales) {
      std::vector<float> x = NearThresholds(t, scale, 64);
      for (int i = 0; i < 500; ++i) {
        const float mag = static_cast<float>(std::exp2(static_cast<double>(log_mag(rng))) * scale);
        x.push_back(rng() % 2 ? mag : -mag);
      }
      for (float v : {0.0f, -0.0f, scale, -scale, scale / 2, -scale / 3}) x.push_back(v);
      std::vector<float> lanes;
      for (float v : x) lanes.insert(lanes.end(), 16, std::fmin(std::fmax(v, -scale), scale));
      for (std::size_t begin = 0; begin < lanes.size();) {
        const std::size_t len = std::min<std::size_t>(kBlockNumel - 5, lanes.size() - begin);
        std::vector<float> block(lanes.begin() + begin, lanes.begin() + begin + len);
        std::ostringstream what;
        what << "scale " << std::hexfloat << scale;
        ExpectScalarCodes(t, block, scale, what.str());
        if (::testing::Test::HasFatalFailure()) return;
        begin += len;
      }
    }
  }
}

// The VBMI step decodes by byte permutes what the AVX-512 step gathers: the same params, new
// moments and maxima on random codes (all 256 of each map), every tail length.
TEST(Q8Kernels, VbmiStepEqualsTheGatherStep) {
  if (!HasAvx512() || !__builtin_cpu_supports("avx512vbmi")) {
    GTEST_SKIP() << "this CPU lacks AVX-512 with VBMI";
  }
  using swapper::internal::AdamArrays;
  using swapper::internal::AdamScalars;
  using swapper::internal::Q8BlockIn;
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const AdamScalars& s = kScalars;
  for (std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{63}, std::size_t{64},
                        std::size_t{65}, std::size_t{1000}, kBlockNumel}) {
    std::vector<std::uint8_t> m_codes(n), v_codes(n);
    std::vector<float> grad(n), param(n);
    for (std::size_t i = 0; i < n; ++i) {
      m_codes[i] = static_cast<std::uint8_t>(rng());
      v_codes[i] = static_cast<std::uint8_t>(rng());
      grad[i] = normal(rng);
      param[i] = normal(rng);
    }
    const Q8BlockIn in = BlockIn(m_codes.data(), v_codes.data());
    struct Out {
      std::vector<float> param, m, v;
      std::vector<std::uint16_t> bf16;
      float m_max = 0, v_max = 0;
      bool ok = false;
    };
    auto run = [&](auto kernel) {
      Out out = {param, std::vector<float>(n), std::vector<float>(n),
                 std::vector<std::uint16_t>(n)};
      const AdamArrays a = {.param = out.param.data(),
                            .grad = grad.data(),
                            .exp_avg = out.m.data(),
                            .exp_avg_sq = out.v.data(),
                            .max_exp_avg_sq = nullptr,
                            .bf16 = out.bf16.data()};
      out.ok = kernel(s, a, in, n, &out.m_max, &out.v_max);
      return out;
    };
    const Out want = run(swapper::internal::AdamStepQ8BlockAvx512);
    const Out got = run(swapper::internal::AdamStepQ8BlockAvx512Vbmi);
    SCOPED_TRACE(::testing::Message() << "n = " << n);
    EXPECT_TRUE(want.ok);
    EXPECT_EQ(got.ok, want.ok);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got.m_max), std::bit_cast<std::uint32_t>(want.m_max));
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got.v_max), std::bit_cast<std::uint32_t>(want.v_max));
    EXPECT_EQ(got.bf16, want.bf16);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.param[i]),
                std::bit_cast<std::uint32_t>(want.param[i]))
          << i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.m[i]), std::bit_cast<std::uint32_t>(want.m[i]))
          << i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.v[i]), std::bit_cast<std::uint32_t>(want.v[i]))
          << i;
    }
  }
}

}  // namespace
}  // namespace zinf::swapper::q8::internal
