#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "train/charlm.h"
#include "train/data.h"
#include "train/model.h"
#include "train/synthetic.h"
#include "zinf/core/process_stats.h"
#include "zinf/swapper/cpu_adam.h"

namespace zinf::train {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::StatusIs;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A batch of random ids below `vocab`.
Batch RandomBatch(int examples, int context, int vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> id(0, vocab - 1);
  Batch batch;
  batch.context_size = context;
  batch.num_examples = static_cast<std::size_t>(examples);
  for (int i = 0; i < examples * context; ++i) batch.contexts.push_back(id(rng));
  for (int i = 0; i < examples; ++i) batch.targets.push_back(id(rng));
  return batch;
}

bool HaveDefaultText() {
  std::error_code ec;
  return std::filesystem::is_directory(kDefaultTextDir, ec);
}

// A LayerAccess over a flat weight vector, as the trainer's is over the engine at stage 3: it
// copies each Fetch into buffers of its own (dropping the previous ones, so a span kept past the
// next Fetch reads freed memory under ASan), records the most elements fetched at once, and
// collects each gradient into a flat vector.
class FlatLayerAccess final : public LayerAccess {
 public:
  FlatLayerAccess(const partition::ParamLayout& layout, const std::vector<float>& weights)
      : layout_(layout),
        weights_(weights),
        grads_(weights.size(), 0.0f),
        handed_(layout.num_params(), 0) {}

  Result<std::vector<std::span<const float>>> Fetch(std::span<const std::size_t> params) override {
    held_.clear();
    std::size_t live = 0;
    for (const std::size_t p : params) {
      const partition::ParamInfo& info = layout_.param(p);
      held_.emplace_back(
          weights_.begin() + static_cast<std::ptrdiff_t>(info.flat_offset),
          weights_.begin() + static_cast<std::ptrdiff_t>(info.flat_offset + info.numel));
      live += info.numel;
    }
    peak_live_ = std::max(peak_live_, live);
    ++fetches_;
    std::vector<std::span<const float>> out(held_.begin(), held_.end());
    return out;
  }

  Status GradientDone(std::size_t index, std::span<const float> grad) override {
    const partition::ParamInfo& info = layout_.param(index);
    if (grad.size() != info.numel) return InvalidArgumentError("gradient of the wrong size");
    std::copy(grad.begin(), grad.end(),
              grads_.begin() + static_cast<std::ptrdiff_t>(info.flat_offset));
    ++handed_[index];
    order_.push_back(index);
    return OkStatus();
  }

  const std::vector<float>& grads() const { return grads_; }
  const std::vector<int>& handed() const { return handed_; }
  const std::vector<std::size_t>& order() const { return order_; }
  std::size_t peak_live() const { return peak_live_; }
  int fetches() const { return fetches_; }

 private:
  const partition::ParamLayout& layout_;
  const std::vector<float>& weights_;
  std::vector<std::vector<float>> held_;
  std::vector<float> grads_;
  std::vector<int> handed_;
  std::vector<std::size_t> order_;
  std::size_t peak_live_ = 0;
  int fetches_ = 0;
};

// Stage 3 (issue 42): the layered pass gives ForwardBackward's loss and gradient, fetching at
// most one layer at a time and handing each gradient once, in reverse layout order.
TEST(CharLM, LayeredPassEqualsForwardBackward) {
  for (const int layers : {0, 1, 3}) {
    SCOPED_TRACE(layers);
    ZINF_ASSERT_OK_AND_ASSIGN(
        CharLM model,
        CharLM::Create({.context = 5,
                        .embed_dim = 6,
                        .hidden = 40,
                        .layers = layers,
                        .activation = layers == 1 ? Activation::kRelu : Activation::kTanh}));
    std::vector<float> w(model.layout().total_numel());
    ZINF_ASSERT_OK(model.InitWeights(3, w));
    const Batch batch = RandomBatch(24, 5, 256, 7);
    std::vector<float> g(w.size(), 0.0f);
    ZINF_ASSERT_OK_AND_ASSIGN(const double loss, model.ForwardBackward(w, batch, g));
    ZINF_ASSERT_OK(model.CheckBatch(batch));
    FlatLayerAccess access(model.layout(), w);
    ZINF_ASSERT_OK_AND_ASSIGN(const double layered, model.ForwardBackwardLayered(batch, access));
    EXPECT_EQ(layered, loss);
    for (std::size_t i = 0; i < w.size(); ++i) {
      ASSERT_NEAR(access.grads()[i], g[i], 1e-6f * std::abs(g[i]) + 1e-12f) << i;
    }
    EXPECT_THAT(access.handed(), ::testing::Each(1));
    std::vector<std::size_t> reverse(model.layout().num_params());
    for (std::size_t i = 0; i < reverse.size(); ++i) reverse[i] = reverse.size() - 1 - i;
    EXPECT_EQ(access.order(), reverse);
    // The largest layer (weight and bias), never the whole model.
    std::size_t largest = 0;
    for (std::size_t p = 1; p + 1 < model.layout().num_params(); p += 2) {
      largest = std::max(largest, static_cast<std::size_t>(model.layout().param(p).numel +
                                                           model.layout().param(p + 1).numel));
    }
    largest = std::max(largest, static_cast<std::size_t>(model.layout().param(0).numel));
    EXPECT_EQ(access.peak_live(), largest);
    EXPECT_EQ(access.fetches(), 2 + 2 * layers);
  }
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.context = 5}));
  EXPECT_THAT(model.CheckBatch(RandomBatch(4, 6, 256, 1)), StatusIs(ErrorCode::kInvalidArgument));
}

TEST(SyntheticModel, LayeredPassEqualsForwardBackward) {
  // Parameters that straddle the noise chunks (kChunkNumel) at unaligned offsets.
  ZINF_ASSERT_OK_AND_ASSIGN(SyntheticModel model,
                            SyntheticModel::Create(3 * SyntheticModel::kChunkNumel + 12345, 5, 2));
  std::vector<float> w(model.layout().total_numel());
  ZINF_ASSERT_OK(model.InitWeights(4, w));
  const Batch batch = SyntheticModel::MakeBatch({.seed = 2, .step = 5, .world_size = 3}, 8);
  std::vector<float> g(w.size(), 0.0f);
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss, model.ForwardBackward(w, batch, g));
  FlatLayerAccess access(model.layout(), w);
  ZINF_ASSERT_OK_AND_ASSIGN(const double layered, model.ForwardBackwardLayered(batch, access));
  EXPECT_NEAR(layered, loss, 1e-12 * loss);
  EXPECT_TRUE(SameBits(access.grads(), g));
  EXPECT_THAT(access.handed(), ::testing::Each(1));
  EXPECT_EQ(access.order(), (std::vector<std::size_t>{4, 3, 2, 1, 0}));
  EXPECT_EQ(access.peak_live(), static_cast<std::size_t>(model.layout().param(0).numel));
}

// ---------------------------------------------------------------------------------------------
// CharLM: layout and size

TEST(CharLM, LayoutFollowsTheParameterFormula) {
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM tiny, CharLM::Create({.hidden = 64, .layers = 1}));
  EXPECT_EQ(tiny.layout().total_numel(), 37'184u);
  ASSERT_EQ(tiny.layout().num_params(), 5u);
  EXPECT_EQ(tiny.layout().param(0).name, "embed");
  EXPECT_EQ(tiny.layout().param(0).shape, (std::vector<std::int64_t>{256, 16}));
  EXPECT_EQ(tiny.layout().param(1).name, "layer0.weight");
  EXPECT_EQ(tiny.layout().param(1).shape, (std::vector<std::int64_t>{256, 64}));
  EXPECT_EQ(tiny.layout().param(2).name, "layer0.bias");
  EXPECT_EQ(tiny.layout().param(3).name, "out.weight");
  EXPECT_EQ(tiny.layout().param(3).shape, (std::vector<std::int64_t>{64, 256}));
  EXPECT_EQ(tiny.layout().param(4).name, "out.bias");
  EXPECT_THAT(tiny.Describe(), HasSubstr("37184 parameters"));

  for (const CharLMOptions& o :
       {CharLMOptions{}, CharLMOptions{.hidden = 1024, .layers = 2},
        CharLMOptions{.vocab_size = 97, .context = 8, .embed_dim = 3, .hidden = 5, .layers = 0},
        CharLMOptions{.context = 32, .embed_dim = 24, .hidden = 300, .layers = 5}}) {
    ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create(o));
    ZINF_ASSERT_OK_AND_ASSIGN(std::uint64_t n, CharLM::NumParams(o));
    EXPECT_EQ(model.layout().total_numel(), n) << model.Describe();
  }
  ZINF_ASSERT_OK_AND_ASSIGN(std::uint64_t medium, CharLM::NumParams({.hidden = 1024, .layers = 2}));
  EXPECT_EQ(medium, 1'579'264u);
}

TEST(CharLM, BillionsOfParametersAreALayoutWithoutAllocation) {
  // Measured in memory, not time: 3.2G parameters materialized would raise the peak RSS by 12 GB.
  const std::uint64_t peak_before = PeakRssBytes();
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.hidden = 32768, .layers = 4}));
  EXPECT_EQ(model.layout().total_numel(), 3'238'138'112u);
  EXPECT_EQ(model.layout().max_param_numel(), 32768u * 32768u);
  // An InitSlice far into the vector costs only its own size.
  std::vector<float> slice(1000);
  ZINF_EXPECT_OK(model.InitSlice(7, model.layout().total_numel() - slice.size(), slice));
  EXPECT_LT(PeakRssBytes() - peak_before, 64u << 20);
  // What one ForwardBackward of a micro-batch would allocate is known before it runs.
  EXPECT_GT(model.WorkingBytes(2'147'483'647), 1ull << 40);
  EXPECT_EQ(model.WorkingBytes(0), 0u);
}

TEST(CharLM, CreateRejectsBadOptions) {
  EXPECT_THAT(CharLM::Create({.hidden = 0}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("hidden")));
  EXPECT_THAT(CharLM::Create({.layers = -1}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("layers")));
  EXPECT_THAT(CharLM::Create({.vocab_size = 1}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("vocab_size")));
  EXPECT_THAT(CharLM::NumParams({.context = 0}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("context")));
  EXPECT_THAT(ParseActivation("gelu"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("gelu")));
  ZINF_ASSERT_OK_AND_ASSIGN(Activation relu, ParseActivation("relu"));
  EXPECT_EQ(relu, Activation::kRelu);
}

// ---------------------------------------------------------------------------------------------
// CharLM: initialization

TEST(CharLM, InitSliceEqualsTheSameSliceOfInitWeights) {
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.hidden = 64, .layers = 2}));
  const std::uint64_t total = model.layout().total_numel();
  std::vector<float> all(total);
  ZINF_ASSERT_OK(model.InitWeights(42, all));
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const std::uint64_t offset = rng() % total;
    const std::uint64_t numel = 1 + rng() % std::min<std::uint64_t>(total - offset, 20000);
    std::vector<float> slice(numel);
    ZINF_ASSERT_OK(model.InitSlice(42, offset, slice));
    ASSERT_EQ(std::memcmp(slice.data(), all.data() + offset, numel * sizeof(float)), 0)
        << "slice [" << offset << ", +" << numel << ")";
  }
  // Deterministic, seed-dependent, and the documented scales.
  std::vector<float> again(total), other(total);
  ZINF_ASSERT_OK(model.InitWeights(42, again));
  ZINF_ASSERT_OK(model.InitWeights(43, other));
  EXPECT_TRUE(SameBits(all, again));
  EXPECT_FALSE(SameBits(all, other));
  for (const partition::ParamInfo& p : model.layout().params()) {
    double sum_sq = 0.0;
    for (std::uint64_t i = 0; i < p.numel; ++i) {
      sum_sq += static_cast<double>(all[p.flat_offset + i]) * all[p.flat_offset + i];
    }
    const double rms = std::sqrt(sum_sq / static_cast<double>(p.numel));
    if (p.shape.size() == 1) {
      EXPECT_EQ(rms, 0.0) << p.name;
    } else if (p.name == "embed") {
      EXPECT_NEAR(rms, 1.0, 0.05) << p.name;
    } else if (p.name == "out.weight") {
      EXPECT_NEAR(rms, 1.0 / std::sqrt(3.0 * static_cast<double>(p.shape[0])), 0.01) << p.name;
    } else {
      EXPECT_NEAR(rms, 1.0 / std::sqrt(static_cast<double>(p.shape[0])), 0.01) << p.name;
    }
  }
  std::vector<float> four(4);
  EXPECT_THAT(model.InitSlice(42, total - 3, four),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("reaches past")));
  EXPECT_THAT(model.InitWeights(42, std::span<float>(all).first(total - 1)),
              StatusIs(ErrorCode::kInvalidArgument));
}

// ---------------------------------------------------------------------------------------------
// CharLM: forward / backward

// Central finite differences of the float forward pass. With eps = 1e-2 the truncation error
// (eps^2 * f''' / 6) and the rounding error of the loss (~1e-7 * loss / eps) are both ~1e-5, far
// below the tolerance; tanh keeps the loss smooth. Parameters are perturbed in place.
void ExpectGradientMatchesFiniteDifferences(const CharLMOptions& options, int examples) {
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create(options));
  std::vector<float> w(model.layout().total_numel());
  ZINF_ASSERT_OK(model.InitWeights(3, w));
  // Non-zero biases, so that their effect is exercised too.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> small(-0.2f, 0.2f);
  for (const partition::ParamInfo& p : model.layout().params()) {
    if (p.shape.size() != 1) continue;
    for (std::uint64_t i = 0; i < p.numel; ++i) w[p.flat_offset + i] = small(rng);
  }
  const Batch batch = RandomBatch(examples, options.context, options.vocab_size, 11);
  std::vector<float> grad(w.size(), 0.0f);
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss, model.ForwardBackward(w, batch, grad));
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss_only, model.Loss(w, batch));
  EXPECT_EQ(loss, loss_only);

  constexpr float kEps = 1e-2f;
  double worst = 0.0;
  int checked = 0;
  for (const partition::ParamInfo& p : model.layout().params()) {
    std::vector<std::uint64_t> picks;
    if (p.name == "embed") {
      // Rows of ids in the batch (the others have a zero gradient): half of the picks.
      for (int k = 0; k < 25; ++k) {
        const auto id = static_cast<std::uint64_t>(batch.contexts[rng() % batch.contexts.size()]);
        picks.push_back(id * static_cast<std::uint64_t>(options.embed_dim) +
                        rng() % static_cast<std::uint64_t>(options.embed_dim));
      }
    }
    while (picks.size() < std::min<std::uint64_t>(50, p.numel)) picks.push_back(rng() % p.numel);
    for (const std::uint64_t i : picks) {
      const std::uint64_t k = p.flat_offset + i;
      const float saved = w[k];
      w[k] = saved + kEps;
      ZINF_ASSERT_OK_AND_ASSIGN(const double plus, model.Loss(w, batch));
      w[k] = saved - kEps;
      ZINF_ASSERT_OK_AND_ASSIGN(const double minus, model.Loss(w, batch));
      w[k] = saved;
      // The perturbation actually applied is (saved + eps) - (saved - eps) in float.
      const double step = static_cast<double>(saved + kEps) - static_cast<double>(saved - kEps);
      const double numeric = (plus - minus) / step;
      const double analytic = grad[k];
      const double err =
          std::abs(numeric - analytic) / (1e-3 + std::max(std::abs(numeric), std::abs(analytic)));
      worst = std::max(worst, err);
      EXPECT_LT(err, 1e-2) << p.name << "[" << i << "]: analytic " << analytic << ", numeric "
                           << numeric;
      ++checked;
    }
  }
  std::printf("gradient check: %d parameters, worst relative error %.2e\n", checked, worst);
}

TEST(CharLM, GradientMatchesFiniteDifferences) {
  ExpectGradientMatchesFiniteDifferences(
      {.vocab_size = 32, .context = 4, .embed_dim = 8, .hidden = 24, .layers = 2}, 16);
}

TEST(CharLM, GradientMatchesFiniteDifferencesWithoutHiddenLayers) {
  ExpectGradientMatchesFiniteDifferences(
      {.vocab_size = 20, .context = 3, .embed_dim = 5, .hidden = 8, .layers = 0}, 8);
}

TEST(CharLM, ForwardBackwardAccumulatesAndIsDeterministic) {
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.hidden = 48, .layers = 2}));
  std::vector<float> w(model.layout().total_numel());
  ZINF_ASSERT_OK(model.InitWeights(9, w));
  const Batch batch = RandomBatch(32, 16, 256, 2);
  std::vector<float> g1(w.size(), 0.0f), g1_again(w.size(), 0.0f);
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss1, model.ForwardBackward(w, batch, g1));
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss1_again, model.ForwardBackward(w, batch, g1_again));
  EXPECT_EQ(loss1, loss1_again);
  EXPECT_TRUE(SameBits(g1, g1_again));
  EXPECT_NEAR(loss1, std::log(256.0), 0.3);  // small initial logits

  // A second call adds to what is there: g1 + g1.
  std::vector<float> g2 = g1;
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss2, model.ForwardBackward(w, batch, g2));
  EXPECT_EQ(loss2, loss1);
  for (std::size_t i = 0; i < w.size(); ++i) {
    // Not bitwise: sgemm with beta = 1 and the embedding scatter-add round differently.
    ASSERT_NEAR(g2[i], 2.0f * g1[i], 1e-5f * std::abs(g1[i]) + 1e-10f) << i;
  }
  // Accumulating two half batches gives the gradient of... the sum of the two half means.
  std::vector<float> halves(w.size(), 0.0f);
  for (int h = 0; h < 2; ++h) {
    Batch half;
    half.context_size = 16;
    half.num_examples = 16;
    half.contexts.assign(batch.contexts.begin() + h * 256, batch.contexts.begin() + (h + 1) * 256);
    half.targets.assign(batch.targets.begin() + h * 16, batch.targets.begin() + (h + 1) * 16);
    ZINF_ASSERT_OK(model.ForwardBackward(w, half, halves));
  }
  double max_diff = 0.0, max_abs = 0.0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    max_diff = std::max(max_diff, static_cast<double>(std::abs(halves[i] / 2.0f - g1[i])));
    max_abs = std::max(max_abs, static_cast<double>(std::abs(g1[i])));
  }
  EXPECT_LT(max_diff, 1e-5 * max_abs);
}

TEST(CharLM, RejectsMismatchedInputs) {
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.hidden = 8, .layers = 1}));
  std::vector<float> w(model.layout().total_numel()), g(w.size());
  ZINF_ASSERT_OK(model.InitWeights(1, w));
  const Batch good = RandomBatch(4, 16, 256, 1);
  ZINF_EXPECT_OK(model.ForwardBackward(w, good, g));
  EXPECT_THAT(model.ForwardBackward(std::span<const float>(w).first(w.size() - 1), good, g),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("weights")));
  EXPECT_THAT(model.ForwardBackward(w, good, std::span<float>(g).first(3)),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("gradient")));
  EXPECT_THAT(model.Loss(w, RandomBatch(4, 8, 256, 1)),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("context")));
  Batch bad_id = good;
  bad_id.targets[2] = 256;
  EXPECT_THAT(model.Loss(w, bad_id), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("id")));
  EXPECT_THAT(model.Loss(w, Batch{.context_size = 16}), StatusIs(ErrorCode::kInvalidArgument));
}

// ---------------------------------------------------------------------------------------------
// CharLM: training on the default text

TEST(CharLM, LossFallsWithAdamOnTheDefaultText) {
  if (!HaveDefaultText()) GTEST_SKIP() << kDefaultTextDir << " is missing on this machine";
  ZINF_ASSERT_OK_AND_ASSIGN(TextDataset data, TextDataset::LoadDefault());
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.hidden = 64, .layers = 1}));
  ZINF_ASSERT_OK_AND_ASSIGN(swapper::CpuAdam adam,
                            swapper::CpuAdam::Create({.lr = 1e-2, .threads = 1}));
  const std::size_t n = model.layout().total_numel();
  std::vector<float> w(n), g(n), m(n, 0.0f), v(n, 0.0f);
  ZINF_ASSERT_OK(model.InitWeights(1, w));
  ZINF_ASSERT_OK_AND_ASSIGN(const double eval_before, model.EvalLoss(w, data, 512));

  constexpr int kSteps = 200;
  std::vector<double> losses;
  const auto start = Clock::now();
  for (int step = 0; step < kSteps; ++step) {
    std::fill(g.begin(), g.end(), 0.0f);
    ZINF_ASSERT_OK_AND_ASSIGN(
        Batch batch, data.SampleBatch({.seed = 1, .step = static_cast<std::uint64_t>(step)}, 64,
                                      model.options().context));
    ZINF_ASSERT_OK_AND_ASSIGN(const double loss, model.ForwardBackward(w, batch, g));
    losses.push_back(loss);
    ZINF_ASSERT_OK(adam.Step(step + 1, w, g, m, v));
  }
  const double seconds = SecondsSince(start);
  ZINF_ASSERT_OK_AND_ASSIGN(const double eval_after, model.EvalLoss(w, data, 512));
  const auto mean = [&](int first, int count) {
    double s = 0.0;
    for (int i = first; i < first + count; ++i) s += losses[static_cast<std::size_t>(i)];
    return s / count;
  };
  std::printf("charlm %s on %s (%zu bytes)\n", model.Describe().c_str(), data.source().c_str(),
              data.size_bytes());
  std::printf("train loss, mean of each 20 steps:");
  for (int first = 0; first < kSteps; first += 20) std::printf(" %.3f", mean(first, 20));
  std::printf("\neval loss (512 held-out windows) %.3f -> %.3f; %.2f s for %d steps\n", eval_before,
              eval_after, seconds, kSteps);
  EXPECT_NEAR(losses.front(), std::log(256.0), 0.3);
  EXPECT_LT(mean(180, 20), 3.3);
  EXPECT_LT(eval_after, 3.5);

  ZINF_ASSERT_OK_AND_ASSIGN(std::string sample, model.Sample(w, "The ", 80, 7));
  std::printf("sample: \"The %s\"\n", sample.c_str());
  EXPECT_EQ(sample.size(), 80u);
}

TEST(CharLM, SampleIsPrintableTextOfTheRequestedLength) {
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.hidden = 32, .layers = 1}));
  std::vector<float> w(model.layout().total_numel());
  ZINF_ASSERT_OK(model.InitWeights(5, w));
  for (const float temperature : {0.0f, 0.8f, 5.0f}) {
    ZINF_ASSERT_OK_AND_ASSIGN(std::string text,
                              model.Sample(w, "GNU General", 120, 3, temperature));
    EXPECT_EQ(text.size(), 120u);
    for (const char c : text) {
      EXPECT_TRUE(c == '\n' || (c >= 32 && c <= 126)) << static_cast<int>(c);
    }
    ZINF_ASSERT_OK_AND_ASSIGN(std::string again,
                              model.Sample(w, "GNU General", 120, 3, temperature));
    EXPECT_EQ(text, again);
  }
  ZINF_ASSERT_OK_AND_ASSIGN(std::string empty, model.Sample(w, "", 0, 3));
  EXPECT_TRUE(empty.empty());
  EXPECT_THAT(model.Sample(w, "x", -1, 3), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM small_vocab,
                            CharLM::Create({.vocab_size = 64, .hidden = 4, .layers = 1}));
  std::vector<float> w_small(small_vocab.layout().total_numel());
  EXPECT_THAT(small_vocab.Sample(w_small, "x", 4, 3),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("vocab_size")));
}

TEST(CharLM, ThroughputOfAMediumModel) {
  ZINF_ASSERT_OK_AND_ASSIGN(CharLM model, CharLM::Create({.hidden = 1024, .layers = 2}));
  std::vector<float> w(model.layout().total_numel()), g(w.size(), 0.0f);
  ZINF_ASSERT_OK(model.InitWeights(1, w));
  const Batch batch = RandomBatch(64, 16, 256, 4);
  ZINF_ASSERT_OK(model.ForwardBackward(w, batch, g));  // warm-up (OpenBLAS threads)
  constexpr int kCalls = 20;
  const auto start = Clock::now();
  for (int i = 0; i < kCalls; ++i) ZINF_ASSERT_OK(model.ForwardBackward(w, batch, g));
  const double seconds = SecondsSince(start);
  std::printf("%s, batch 64: %.0f examples/s (%.2f ms per ForwardBackward)\n",
              model.Describe().c_str(), kCalls * 64 / seconds, 1e3 * seconds / kCalls);
  EXPECT_GT(seconds, 0.0);
}

// ---------------------------------------------------------------------------------------------
// TextDataset

TEST(TextDataset, DefaultIsTheCommonLicenseTexts) {
  if (!HaveDefaultText()) GTEST_SKIP() << kDefaultTextDir << " is missing on this machine";
  ZINF_ASSERT_OK_AND_ASSIGN(TextDataset data, TextDataset::LoadDefault());
  EXPECT_GT(data.size_bytes(), 50'000u);
  EXPECT_THAT(data.source(), HasSubstr(std::string(kDefaultTextDir)));
  EXPECT_THAT(std::string(data.text()), HasSubstr("GNU"));
  EXPECT_NEAR(static_cast<double>(data.train_bytes()) / static_cast<double>(data.size_bytes()),
              0.95, 0.001);
}

TEST(TextDataset, MissingDataIsNotFound) {
  EXPECT_THAT(TextDataset::Load("/nonexistent/zinf/text.txt"),
              StatusIs(ErrorCode::kNotFound, HasSubstr("/nonexistent/zinf/text.txt")));
  EXPECT_THAT(TextDataset::LoadDirectory("/nonexistent/zinf"),
              StatusIs(ErrorCode::kNotFound, HasSubstr("--data")));
  char dir_template[] = "/tmp/zinf-model-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  EXPECT_THAT(TextDataset::LoadDirectory(dir), StatusIs(ErrorCode::kNotFound, HasSubstr("--data")));
  EXPECT_THAT(TextDataset::Load(dir), StatusIs(ErrorCode::kFailedPrecondition));
  std::filesystem::remove_all(dir);
  EXPECT_THAT(TextDataset::FromText(""), StatusIs(ErrorCode::kInvalidArgument));
}

TEST(TextDataset, LoadDirectorySkipsSymlinksAndSortsByName) {
  char dir_template[] = "/tmp/zinf-model-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::filesystem::path dir = dir_template;
  for (const auto& [name, text] :
       {std::pair<const char*, const char*>{"b", "bbb\n"}, {"a", "aaa"}, {"c-empty", ""}}) {
    std::FILE* f = std::fopen((dir / name).c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(text, f);
    std::fclose(f);
  }
  std::filesystem::create_symlink(dir / "a", dir / "link-to-a");
  ZINF_ASSERT_OK_AND_ASSIGN(TextDataset data, TextDataset::LoadDirectory(dir.string()));
  EXPECT_EQ(data.text(), "aaa\nbbb\n");
  EXPECT_THAT(data.source(), HasSubstr("(2 files)"));
  std::filesystem::remove_all(dir);
}

TEST(TextDataset, BatchesArePureFunctionsOfTheirId) {
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "line " + std::to_string(i) + " of the text\n";
  ZINF_ASSERT_OK_AND_ASSIGN(TextDataset data, TextDataset::FromText(text));
  const BatchId id{.seed = 5, .step = 100, .micro_batch = 1, .world_rank = 2, .world_size = 4};
  ZINF_ASSERT_OK_AND_ASSIGN(Batch a, data.SampleBatch(id, 32, 16));
  ZINF_ASSERT_OK_AND_ASSIGN(Batch b, data.SampleBatch(id, 32, 16));
  EXPECT_EQ(a.contexts, b.contexts);
  EXPECT_EQ(a.targets, b.targets);
  EXPECT_EQ(a.key, BatchKey(id));
  EXPECT_EQ(a.size(), 32u);
  // Every example is a window of the train part followed by its next byte.
  for (std::size_t i = 0; i < a.size(); ++i) {
    std::string window;
    for (int c = 0; c < 16; ++c) window.push_back(static_cast<char>(a.contexts[i * 16 + c]));
    window.push_back(static_cast<char>(a.targets[i]));
    EXPECT_NE(std::string(data.text().substr(0, data.train_bytes())).find(window),
              std::string::npos)
        << window;
  }
  // Changing any field of the id changes the batch.
  std::vector<BatchId> others(5, id);
  others[0].seed = 6;
  others[1].step = 101;
  others[2].micro_batch = 0;
  others[3].world_rank = 3;
  others[4].world_size = 8;
  for (const BatchId& other : others) {
    ZINF_ASSERT_OK_AND_ASSIGN(Batch c, data.SampleBatch(other, 32, 16));
    EXPECT_NE(c.contexts, a.contexts);
    EXPECT_NE(c.key, a.key);
  }
  EXPECT_THAT(data.SampleBatch(id, 0, 16), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_ASSERT_OK_AND_ASSIGN(TextDataset tiny, TextDataset::FromText("short"));
  EXPECT_THAT(tiny.SampleBatch(id, 4, 16),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("context")));
}

TEST(TextDataset, EvalBatchComesFromTheHeldOutTail) {
  std::string text(9500, 'a');
  text += std::string(500, 'z');  // exactly the last 5%
  ZINF_ASSERT_OK_AND_ASSIGN(TextDataset data, TextDataset::FromText(text));
  EXPECT_EQ(data.train_bytes(), 9500u);
  ZINF_ASSERT_OK_AND_ASSIGN(Batch eval, data.EvalBatch(100, 16));
  EXPECT_EQ(eval.size(), 100u);
  for (const std::int32_t id : eval.contexts) ASSERT_EQ(id, 'z');
  for (const std::int32_t id : eval.targets) ASSERT_EQ(id, 'z');
  ZINF_ASSERT_OK_AND_ASSIGN(Batch train, data.SampleBatch({}, 100, 16));
  for (const std::int32_t id : train.targets) ASSERT_EQ(id, 'a');
}

// ---------------------------------------------------------------------------------------------
// SyntheticModel

TEST(SyntheticModel, LayoutSplitsTheTotalEvenly) {
  ZINF_ASSERT_OK_AND_ASSIGN(SyntheticModel small, SyntheticModel::Create(10, 3));
  ASSERT_EQ(small.layout().num_params(), 3u);
  EXPECT_EQ(small.layout().param(0).numel, 4u);
  EXPECT_EQ(small.layout().param(1).numel, 3u);
  EXPECT_EQ(small.layout().param(2).numel, 3u);
  EXPECT_EQ(small.layout().param(2).name, "p2");
  ZINF_ASSERT_OK_AND_ASSIGN(SyntheticModel huge, SyntheticModel::Create(20'000'000'000ULL, 8));
  EXPECT_EQ(huge.layout().total_numel(), 20'000'000'000ULL);
  EXPECT_THAT(SyntheticModel::Create(2, 3), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(SyntheticModel::Create(10, 0), StatusIs(ErrorCode::kInvalidArgument));
}

TEST(SyntheticModel, GradientIsDeterministicAndAccumulates) {
  constexpr std::uint64_t kNumel = 8'000'000;
  ZINF_ASSERT_OK_AND_ASSIGN(SyntheticModel one, SyntheticModel::Create(kNumel, 4, 1));
  ZINF_ASSERT_OK_AND_ASSIGN(SyntheticModel three, SyntheticModel::Create(kNumel, 4, 3));
  std::vector<float> w(kNumel);
  ZINF_ASSERT_OK(one.InitWeights(1, w));
  std::vector<float> slice(1000);
  ZINF_ASSERT_OK(one.InitSlice(1, 123'457, slice));
  EXPECT_EQ(std::memcmp(slice.data(), w.data() + 123'457, slice.size() * sizeof(float)), 0);

  const Batch batch =
      SyntheticModel::MakeBatch({.seed = 1, .step = 3, .world_rank = 1, .world_size = 2}, 16);
  EXPECT_EQ(batch.size(), 16u);
  std::vector<float> g1(kNumel, 0.0f), g3(kNumel, 0.0f);
  const auto start = Clock::now();
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss1, one.ForwardBackward(w, batch, g1));
  const double seconds = SecondsSince(start);
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss3, three.ForwardBackward(w, batch, g3));
  EXPECT_EQ(loss1, loss3);
  EXPECT_TRUE(SameBits(g1, g3));
  ZINF_ASSERT_OK_AND_ASSIGN(const double loss_only, one.Loss(w, batch));
  EXPECT_EQ(loss_only, loss1);
  EXPECT_NEAR(loss1, 0.5 * 0.25 / 3.0, 1e-3);  // 0.5 * E[(0.5 u)^2], u uniform in [-1, 1)
  // Gradient = w + noise, noise within kNoise and batch-dependent.
  for (std::size_t i = 0; i < kNumel; i += 997) {
    ASSERT_LE(std::abs(g1[i] - w[i]), SyntheticModel::kNoise * 1.0001f) << i;
  }
  std::vector<float> g_other(kNumel, 0.0f);
  ZINF_ASSERT_OK(
      one.ForwardBackward(w, SyntheticModel::MakeBatch({.seed = 1, .step = 4}, 16), g_other));
  EXPECT_FALSE(SameBits(g1, g_other));
  // Accumulation: a second call adds w + noise again.
  ZINF_ASSERT_OK(one.ForwardBackward(w, batch, g3));
  for (std::size_t i = 0; i < kNumel; i += 997) ASSERT_FLOAT_EQ(g3[i], g1[i] + g1[i]) << i;

  const double gb = static_cast<double>(kNumel) * 3 * sizeof(float) / 1e9;
  std::printf("synthetic ForwardBackward, %llu params, 1 thread: %.1f ms, %.1f GB/s\n",
              static_cast<unsigned long long>(kNumel), 1e3 * seconds, gb / seconds);
  EXPECT_THAT(one.ForwardBackward(w, batch, std::span<float>(g1).first(5)),
              StatusIs(ErrorCode::kInvalidArgument));
}

TEST(SyntheticModel, LossFallsUnderAdam) {
  ZINF_ASSERT_OK_AND_ASSIGN(SyntheticModel model, SyntheticModel::Create(100'000, 2));
  ZINF_ASSERT_OK_AND_ASSIGN(swapper::CpuAdam adam,
                            swapper::CpuAdam::Create({.lr = 1e-2, .threads = 1}));
  std::vector<float> w(100'000), g(w.size()), m(w.size(), 0.0f), v(w.size(), 0.0f);
  ZINF_ASSERT_OK(model.InitWeights(2, w));
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 20; ++step) {
    std::fill(g.begin(), g.end(), 0.0f);
    ZINF_ASSERT_OK_AND_ASSIGN(
        last,
        model.ForwardBackward(w, SyntheticModel::MakeBatch({.step = std::uint64_t(step)}, 1), g));
    if (step == 0) first = last;
    ZINF_ASSERT_OK(adam.Step(step + 1, w, g, m, v));
  }
  EXPECT_LT(last, 0.8 * first);
}

}  // namespace
}  // namespace zinf::train
