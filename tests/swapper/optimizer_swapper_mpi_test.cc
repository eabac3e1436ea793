// Multi-rank tests of the optimizer swappers (run under mpirun with 1-4 ranks): swapped training
// equals in-memory training bitwise, in both state formats (fp32, q8), and an I/O error on one
// rank is the same error on every rank, leaving each sub-group's state either before or after
// the failed step.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/layouts.h"
#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/core/check.h"
#include "zinf/core/units.h"
#include "zinf/partition/layout.h"
#include "zinf/partition/plan.h"
#include "zinf/storage/fault_injection.h"
#include "zinf/swapper/buffer_pool.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/gradient_swapper.h"
#include "zinf/swapper/optimizer_swapper.h"
#include "zinf/swapper/partitioned_optimizer_swapper.h"
#include "zinf/swapper/q8.h"

namespace zinf::swapper {
namespace {

using ::testing::HasSubstr;
using testing::IsOk;
using testing::SharedScratchDir;
using testing::StatusIs;
using testing::World;

constexpr std::uint64_t kPlanAlignment = 8;

float Hash01(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return static_cast<float>(x % 100003) / 100003.0f;
}
float InitialWeight(std::uint64_t flat) { return Hash01(flat * 7 + 1) * 2.0f - 1.0f; }
float Gradient(std::int64_t step, std::uint64_t flat, int micro_batch) {
  return (Hash01(flat * 131 + static_cast<std::uint64_t>(step) * 1000003 +
                 static_cast<std::uint64_t>(micro_batch) * 7919) -
          0.5f) *
         0.1f;
}

enum class GradMode { kCopy, kInMemory, kReadAddWrite };
std::string GradModeName(GradMode mode) {
  switch (mode) {
    case GradMode::kCopy:
      return "Copy";
    case GradMode::kInMemory:
      return "InMemory";
    case GradMode::kReadAddWrite:
      return "ReadAddWrite";
  }
  return "?";
}

// The in-memory reference state of one rank's partition: fp32 weights and, in fp32 format, the
// moments; in q8 format the moments' codes and scales per sub-group (blocks start at each
// sub-group's first element, as in the swapper).
struct RefState {
  std::vector<float> fp32, exp_avg, exp_avg_sq;
  std::vector<std::vector<std::uint8_t>> m_codes, v_codes;
  std::vector<std::vector<float>> m_scales, v_scales;
};

// One rank's view: the reference (in-memory) state of its partition and the swapper.
class Harness {
 public:
  Harness(const std::string& dir, std::uint64_t sub_group_size, bool pipelined, GradMode mode,
          int micro_batches, StateFormat format = StateFormat::kFp32)
      : layout_(testing::UnevenLayout()), mode_(mode), micro_batches_(micro_batches) {
    const comm::Communicator& world = World();
    plan_ = std::make_unique<partition::PartitionPlan>(
        *partition::PartitionPlan::CreateFlat(layout_, world.size(), kPlanAlignment));
    const std::uint64_t n = plan_->partition_numel();
    ref_.fp32.assign(n, 0.0f);
    ref_.exp_avg.assign(n, 0.0f);
    ref_.exp_avg_sq.assign(n, 0.0f);
    for (const partition::Fragment& f : plan_->RankFragments(world.rank())) {
      for (std::uint64_t k = 0; k < f.numel; ++k) {
        ref_.fp32[f.partition_offset + k] = InitialWeight(f.flat_offset + k);
      }
    }
    options_.state_format = format;
    options_.store.paths = {dir};
    options_.store.job_id = "swaptest";
    options_.store.stripe_unit_bytes = 64 << 10;
    options_.store.verify_swap = true;
    options_.sub_group_size = sub_group_size;
    options_.pipeline_read = pipelined;
    options_.pipeline_write = pipelined;
    options_.adam = AdamOptions{.lr = 1e-2, .weight_decay = 0.01, .threads = 1};
    options_.bf16_params = true;
    options_.swap_gradients = mode != GradMode::kCopy;
    options_.gradient_accumulation_steps = micro_batches;
    options_.accumulation = mode == GradMode::kInMemory ? GradientAccumulation::kInMemory
                                                        : GradientAccumulation::kReadAddWrite;
    options_.min_swap_numel = 1024;
  }

  SwapperOptions& options() { return options_; }
  OptimizerSwapper& swapper() { return *swapper_; }
  const partition::PartitionPlan& plan() const { return *plan_; }

  Status Create() {
    ZINF_ASSIGN_OR_RETURN(swapper_, CreateOptimizerSwapper(World(), *plan_, options_));
    for (std::size_t i = 0; i < swapper_->num_sub_groups(); ++i) {
      const std::uint64_t numel = swapper_->swap_info(i).sub_group.numel;
      ref_.m_codes.emplace_back(numel, q8::ZeroCode(q8::MapKind::kSigned));
      ref_.v_codes.emplace_back(numel, q8::ZeroCode(q8::MapKind::kUnsigned));
      ref_.m_scales.emplace_back(q8::NumBlocks(numel), 0.0f);
      ref_.v_scales.emplace_back(q8::NumBlocks(numel), 0.0f);
    }
    return swapper_->Initialize([this](std::uint64_t offset, std::span<float> out) {
      std::memcpy(out.data(), ref_.fp32.data() + offset, out.size() * sizeof(float));
      return OkStatus();
    });
  }

  // The partition gradient of one micro-batch (padding 0).
  std::vector<float> PartitionGradient(std::int64_t step, int micro_batch) const {
    std::vector<float> grad(plan_->partition_numel(), 0.0f);
    for (const partition::Fragment& f : plan_->RankFragments(World().rank())) {
      for (std::uint64_t k = 0; k < f.numel; ++k) {
        grad[f.partition_offset + k] = Gradient(step, f.flat_offset + k, micro_batch);
      }
    }
    return grad;
  }

  // Feeds the micro-batches to the gradient swapper (when there is one) and builds the summed
  // gradient the reference uses.
  Status Backward(std::int64_t step) {
    summed_ = PartitionGradient(step, 0);
    if (mode_ != GradMode::kCopy) {
      ZINF_RETURN_IF_ERROR(swapper_->gradient_swapper()->SwapOutPartition(0, summed_));
    }
    for (int mb = 1; mb < micro_batches_; ++mb) {
      std::vector<float> g = PartitionGradient(step, mb);
      for (std::size_t k = 0; k < g.size(); ++k) summed_[k] += g[k];
      if (mode_ != GradMode::kCopy) {
        ZINF_RETURN_IF_ERROR(swapper_->gradient_swapper()->SwapOutPartition(mb, g));
      }
    }
    return OkStatus();
  }

  Status SwappedStep(std::int64_t step) {
    GradientSource source;
    if (mode_ == GradMode::kCopy && step % 2 == 1) {
      source = [this](const partition::SubGroup& sg, std::span<float> grad) {
        std::memcpy(grad.data(), summed_.data() + sg.partition_offset, grad.size() * 4);
        return OkStatus();
      };
    } else if (mode_ == GradMode::kCopy) {
      // Even steps lend the summed gradient instead (no copy): the same bits.
      source = GradientSource::FromView(
          [this](const partition::SubGroup& sg) -> Result<std::span<const float>> {
            return std::span<const float>(summed_).subspan(sg.partition_offset, sg.numel);
          });
    } else if (!empty_source_) {
      source = swapper_->gradient_swapper()->Source();
    }  // else empty: Step takes the gradient swapper's
    working_.resize(plan_->partition_numel());
    bf16_.resize(plan_->partition_numel());
    return swapper_->Step(
        step, source,
        [this](const partition::SubGroup& sg, std::span<const float> fp32,
               std::span<const std::uint16_t> bf16) {
          std::memcpy(working_.data() + sg.partition_offset, fp32.data(), fp32.size() * 4);
          std::memcpy(bf16_.data() + sg.partition_offset, bf16.data(), bf16.size() * 2);
          return OkStatus();
        },
        StepOptions{.lr = std::nullopt, .grad_scale = 0.5f, .segments = segments_});
  }

  // The reference step: CpuAdam over the whole in-memory partition (fp32), or sub-group by
  // sub-group with StepQ8 (q8: its blocks are per sub-group).
  void ReferenceStep(std::int64_t step) {
    auto adam = CpuAdam::Create(options_.adam);
    ZINF_CHECK(adam.has_value());
    if (options_.state_format == StateFormat::kFp32) {
      Status s = adam->Step(step, ref_.fp32, summed_, ref_.exp_avg, ref_.exp_avg_sq,
                            {.grad_scale = 0.5f, .segments = segments_});
      ZINF_CHECK(s.has_value(), "{}", s.error().ToString());
      return;
    }
    for (std::size_t i = 0; i < swapper_->num_sub_groups(); ++i) {
      const partition::SubGroup& sg = swapper_->swap_info(i).sub_group;
      // The segments that meet the sub-group, from its first element: the one it begins in,
      // and those beginning strictly inside it.
      std::vector<AdamSegment> segments;
      for (const AdamSegment& seg : segments_) {
        if (seg.begin <= sg.partition_offset) {
          segments.assign(1, {.begin = 0, .hyper = seg.hyper});
        } else if (seg.begin < sg.partition_offset + sg.numel) {
          segments.push_back({.begin = seg.begin - sg.partition_offset, .hyper = seg.hyper});
        }
      }
      Status s = adam->StepQ8(step, std::span(ref_.fp32).subspan(sg.partition_offset, sg.numel),
                              std::span(summed_).subspan(sg.partition_offset, sg.numel),
                              {ref_.m_codes[i], ref_.m_scales[i]},
                              {ref_.v_codes[i], ref_.v_scales[i]},
                              {.grad_scale = 0.5f, .segments = segments});
      ZINF_CHECK(s.has_value(), "{}", s.error().ToString());
    }
  }

  // One swapped step after Backward(step) and the reference step: the sunk weights and their
  // bf16 equal the reference bitwise, and every sub-group took the step.
  void StepAndCompare(std::int64_t step) {
    ZINF_ASSERT_OK(SwappedStep(step));
    ReferenceStep(step);
    ASSERT_EQ(std::memcmp(working_.data(), ref_.fp32.data(), ref_.fp32.size() * 4), 0)
        << "step " << step;
    for (std::size_t k = 0; k < ref_.fp32.size(); ++k) {
      std::uint32_t bits;
      std::memcpy(&bits, &ref_.fp32[k], 4);
      ASSERT_EQ(bf16_[k], FloatBitsToBf16(bits)) << k;
    }
    for (std::size_t i = 0; i < swapper_->num_sub_groups(); ++i) {
      EXPECT_EQ(swapper_->last_step(i), step);
    }
  }

  // Every committed state tensor equals `ref` bitwise (q8: the codes and scales), for the
  // sub-groups selected by `which` (all when empty).
  void ExpectStateEquals(const RefState& ref, const std::vector<bool>& which) {
    const bool q8 = options_.state_format == StateFormat::kQ8;
    for (std::size_t i = 0; i < swapper_->num_sub_groups(); ++i) {
      if (!which.empty() && !which[i]) continue;
      const partition::SubGroup& sg = swapper_->swap_info(i).sub_group;
      const std::vector<float>* tensors[3] = {&ref.fp32, &ref.exp_avg, &ref.exp_avg_sq};
      for (int t = 0; t < (q8 ? 1 : 3); ++t) {
        std::vector<float> got(sg.numel);
        ZINF_ASSERT_OK(swapper_->ReadState(i, static_cast<StateTensor>(t), 0, got));
        EXPECT_EQ(std::memcmp(got.data(), tensors[t]->data() + sg.partition_offset, sg.numel * 4),
                  0)
            << "rank " << World().rank() << " sub-group " << i << " tensor "
            << StateTensorName(static_cast<StateTensor>(t));
      }
      if (!q8) continue;
      ZINF_ASSERT_OK(swapper_->ReadQ8Moments(i, [&](const Q8Moments& m) {
        EXPECT_TRUE(std::ranges::equal(m.exp_avg.codes, ref.m_codes[i])) << "sub-group " << i;
        EXPECT_TRUE(std::ranges::equal(m.exp_avg_sq.codes, ref.v_codes[i])) << "sub-group " << i;
        EXPECT_EQ(std::memcmp(m.exp_avg.scales.data(), ref.m_scales[i].data(),
                              ref.m_scales[i].size() * 4),
                  0);
        EXPECT_EQ(std::memcmp(m.exp_avg_sq.scales.data(), ref.v_scales[i].data(),
                              ref.v_scales[i].size() * 4),
                  0);
        return OkStatus();
      }));
      // ReadState dequantizes: any range, block boundaries included.
      std::vector<float> want(sg.numel);
      ZINF_ASSERT_OK(q8::Dequantize(q8::MapKind::kSigned, ref.m_codes[i], ref.m_scales[i], want));
      const std::uint64_t offset = sg.numel / 3;
      std::vector<float> got(sg.numel - offset);
      ZINF_ASSERT_OK(swapper_->ReadState(i, StateTensor::kExpAvg, offset, got));
      EXPECT_EQ(std::memcmp(got.data(), want.data() + offset, got.size() * 4), 0);
    }
  }
  void ExpectStateEqualsReference(const std::vector<bool>& which = {}) {
    ExpectStateEquals(ref_, which);
  }

  RefState ref_;
  // Parameter groups' runs (StepOptions::segments, partition offsets); empty: none.
  std::vector<AdamSegment> segments_;
  std::vector<float> summed_, working_;
  std::vector<std::uint16_t> bf16_;
  // With a gradient swapper: SwappedStep passes an empty GradientSource instead of its Source().
  bool empty_source_ = false;

 private:
  partition::ParamLayout layout_;
  std::unique_ptr<partition::PartitionPlan> plan_;
  GradMode mode_;
  int micro_batches_;
  SwapperOptions options_;
  std::unique_ptr<OptimizerSwapper> swapper_;
};

using Params = std::tuple<std::uint64_t, bool, GradMode, StateFormat>;

class SwappedTraining : public ::testing::TestWithParam<Params> {};

TEST_P(SwappedTraining, EqualsInMemoryTrainingBitwise) {
  const auto [sub_group_size, pipelined, mode, format] = GetParam();
  SharedScratchDir dir("swapper");
  const int micro_batches = mode == GradMode::kCopy ? 1 : (mode == GradMode::kInMemory ? 3 : 2);
  Harness h(dir.path(), sub_group_size, pipelined, mode, micro_batches, format);
  ZINF_ASSERT_OK(h.Create());
  EXPECT_EQ(h.swapper().mode_name(), pipelined ? "pipelined" : "partitioned");
  h.ExpectStateEqualsReference();
  for (std::int64_t step = 1; step <= 3; ++step) {
    ZINF_ASSERT_OK(h.Backward(step));
    h.StepAndCompare(step);
    if (::testing::Test::HasFatalFailure()) return;
  }
  h.ExpectStateEqualsReference();
  if (format == StateFormat::kQ8) {
    // The moments are quantized state, not zeros, and not all in the same block's code.
    std::size_t nonzero = 0;
    for (const auto& scales : h.ref_.v_scales) {
      nonzero +=
          static_cast<std::size_t>(std::ranges::count_if(scales, [](float x) { return x > 0; }));
    }
    EXPECT_GT(nonzero, 0u);
  }
  if (mode == GradMode::kReadAddWrite) {
    // The layout has pieces large enough to be swapped, and small ones kept in memory.
    std::size_t swapped = 0;
    for (std::size_t i = 0; i < h.swapper().num_sub_groups(); ++i) {
      swapped += h.swapper().swap_info(i).swapped_gradients.size();
    }
    EXPECT_GT(swapped, 0u);
  }
  ZINF_ASSERT_OK(h.swapper().LogTimers());
  ZINF_ASSERT_OK(h.swapper().Close());
}

INSTANTIATE_TEST_SUITE_P(
    SubGroupsModes, SwappedTraining,
    ::testing::Combine(
        ::testing::Values(std::uint64_t{2048}, std::uint64_t{3000}, std::uint64_t{1} << 20),
        ::testing::Bool(),
        ::testing::Values(GradMode::kCopy, GradMode::kInMemory, GradMode::kReadAddWrite),
        ::testing::Values(StateFormat::kFp32, StateFormat::kQ8)),
    [](const ::testing::TestParamInfo<Params>& p) {
      return fmt::format("SubGroup{}_{}_{}_{}", std::get<0>(p.param),
                         std::get<1>(p.param) ? "Pipelined" : "Sync",
                         GradModeName(std::get<2>(p.param)), StateFormatName(std::get<3>(p.param)));
    });

// The host memory tier: some, one or all sub-groups resident, or offload_optimizer.device "cpu"
// (all resident, no swap store): the same training, bitwise.
enum class Tier { kOne, kSome, kAll, kCpu };
std::string TierName(Tier tier) {
  switch (tier) {
    case Tier::kOne:
      return "OneResident";
    case Tier::kSome:
      return "SomeResident";
    case Tier::kAll:
      return "AllResident";
    case Tier::kCpu:
      return "DeviceCpu";
  }
  return "?";
}
using TierParams = std::tuple<Tier, bool, GradMode, StateFormat>;
class TieredTraining : public ::testing::TestWithParam<TierParams> {};

TEST_P(TieredTraining, EqualsInMemoryTrainingBitwise) {
  const auto [tier, pipelined, mode, format] = GetParam();
  SharedScratchDir dir("swapper");
  const int micro_batches = mode == GradMode::kCopy ? 1 : 2;
  Harness h(dir.path(), 2048, pipelined, mode, micro_batches, format);
  // A sub-group of 2048 elements holds 24 KiB of fp32 state, at most 16 KiB of q8 state.
  const std::uint64_t one = format == StateFormat::kFp32 ? 3 * 8192 : 16384;
  switch (tier) {
    case Tier::kOne:
      h.options().host_cache_bytes = one;
      break;
    case Tier::kSome:
      h.options().host_cache_bytes = 2 * one;
      break;
    case Tier::kAll:
      h.options().host_cache_bytes = std::uint64_t{1} << 30;
      break;
    case Tier::kCpu:
      h.options().all_resident = true;
      h.options().store.paths.clear();  // needs none
      break;
  }
  ZINF_ASSERT_OK(h.Create());
  OptimizerSwapper& swapper = h.swapper();
  const std::size_t n = swapper.num_sub_groups();
  ASSERT_GE(n, 4u);
  switch (tier) {
    case Tier::kOne:
      EXPECT_EQ(swapper.num_resident(), 1u);
      break;
    case Tier::kSome:
      EXPECT_GE(swapper.num_resident(), 2u);
      EXPECT_LT(swapper.num_resident(), n);
      break;
    case Tier::kAll:
    case Tier::kCpu:
      EXPECT_EQ(swapper.num_resident(), n);
      break;
  }
  EXPECT_EQ(swapper.has_store(), tier != Tier::kCpu);
  if (tier == Tier::kCpu && mode != GradMode::kCopy) {
    EXPECT_EQ(swapper.gradient_swapper()->mode(), GradientAccumulation::kInMemory);
  }
  std::uint64_t swapped_bytes = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (swapper.resident(i)) continue;
    for (std::size_t t = 0; t < swapper.num_slot_tensors(); ++t) {
      swapped_bytes += swapper.SlotTensorIoBytes(i, t);
    }
  }
  EXPECT_EQ(swapper.StateIoBytesPerStep(), swapped_bytes);
  h.ExpectStateEqualsReference();
  for (std::int64_t step = 1; step <= 3; ++step) {
    const storage::SwapStore::IoCounters before = swapper.io_counters();
    ZINF_ASSERT_OK(h.Backward(step));
    h.StepAndCompare(step);
    if (::testing::Test::HasFatalFailure()) return;
    if (mode != GradMode::kReadAddWrite) {
      // Only the swapped sub-groups move: their state, once each way.
      const storage::SwapStore::IoCounters after = swapper.io_counters();
      EXPECT_EQ(after.read_bytes - before.read_bytes, swapped_bytes) << "step " << step;
      EXPECT_EQ(after.write_bytes - before.write_bytes, swapped_bytes) << "step " << step;
    }
  }
  h.ExpectStateEqualsReference();
  ZINF_ASSERT_OK(swapper.Close());
}

INSTANTIATE_TEST_SUITE_P(
    Tiers, TieredTraining,
    ::testing::Combine(::testing::Values(Tier::kOne, Tier::kSome, Tier::kAll, Tier::kCpu),
                       ::testing::Bool(),
                       ::testing::Values(GradMode::kCopy, GradMode::kInMemory,
                                         GradMode::kReadAddWrite),
                       ::testing::Values(StateFormat::kFp32, StateFormat::kQ8)),
    [](const ::testing::TestParamInfo<TierParams>& p) {
      return fmt::format("{}_{}_{}_{}", TierName(std::get<0>(p.param)),
                         std::get<1>(p.param) ? "Pipelined" : "Sync",
                         GradModeName(std::get<2>(p.param)), StateFormatName(std::get<3>(p.param)));
    });

TEST(OptimizerSwapper, HostCacheLargerThanTheHostIsRefusedWithTheNumbers) {
  SharedScratchDir dir("swapper");
  Harness h(dir.path(), 2048, false, GradMode::kCopy, 1);
  h.options().host_cache_bytes = std::uint64_t{1} << 62;
  EXPECT_THAT(h.Create(), StatusIs(ErrorCode::kResourceExhausted,
                                   HasSubstr("zinf.host_cache_bytes asks for 4096.00 PiB")));
}

TEST(OptimizerSwapper, AGradientViewOfTheWrongSizeIsRefusedBeforeAnythingChanges) {
  SharedScratchDir dir("swapper");
  for (bool pipelined : {false, true}) {
    Harness h(dir.path(), 2048, pipelined, GradMode::kCopy, 1);
    h.options().host_cache_bytes = 24576;  // sub-group 0 resident: the first one stepped
    h.options().store.job_id = fmt::format("view-{}", pipelined);
    ZINF_ASSERT_OK(h.Create());
    const std::vector<float> short_gradient(100, 1.0f);
    const GradientSource view =
        GradientSource::FromView([&](const partition::SubGroup&) -> Result<std::span<const float>> {
          return std::span<const float>(short_gradient);
        });
    EXPECT_THAT(h.swapper().Step(1, view, {}),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr("the gradient view of sub-group 0 has 100 elements; the "
                                   "sub-group has 2048")));
    // One element more: refused alike (the step must not read a prefix of someone's buffer).
    const std::vector<float> long_gradient(2049, 1.0f);
    const GradientSource long_view =
        GradientSource::FromView([&](const partition::SubGroup&) -> Result<std::span<const float>> {
          return std::span<const float>(long_gradient);
        });
    EXPECT_THAT(h.swapper().Step(1, long_view, {}),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr("the gradient view of sub-group 0 has 2049 elements; the "
                                   "sub-group has 2048")));
    for (std::size_t i = 0; i < h.swapper().num_sub_groups(); ++i) {
      EXPECT_EQ(h.swapper().last_step(i), 0) << i;
    }
    h.ExpectStateEqualsReference();
  }
}

// An empty GradientSource steps with the gradient swapper's gradient: the same bits as passing
// gradient_swapper()->Source() (and as the in-memory reference), for resident and swapped
// sub-groups, synchronous and pipelined, in both accumulation modes.
TEST(OptimizerSwapper, AnEmptySourceStepsWithTheGradientSwappersGradient) {
  SharedScratchDir dir("swapper");
  for (GradMode mode : {GradMode::kInMemory, GradMode::kReadAddWrite}) {
    for (bool pipelined : {false, true}) {
      SCOPED_TRACE(fmt::format("{} {}", GradModeName(mode), pipelined ? "pipelined" : "sync"));
      Harness given(dir.path(), 2048, pipelined, mode, 2);
      Harness empty(dir.path(), 2048, pipelined, mode, 2);
      empty.empty_source_ = true;
      for (Harness* h : {&given, &empty}) {
        h->options().host_cache_bytes = 24576;  // sub-group 0 resident, the rest swapped
        h->options().store.job_id = fmt::format("{}-source-{}-{}", h == &empty ? "empty" : "given",
                                                GradModeName(mode), pipelined);
        ZINF_ASSERT_OK(h->Create());
      }
      ASSERT_NE(empty.swapper().gradient_swapper(), nullptr);
      for (std::int64_t step = 1; step <= 2; ++step) {
        for (Harness* h : {&given, &empty}) {
          ZINF_ASSERT_OK(h->Backward(step));
          h->StepAndCompare(step);
          if (::testing::Test::HasFatalFailure()) return;
        }
        EXPECT_EQ(
            std::memcmp(empty.working_.data(), given.working_.data(), given.working_.size() * 4), 0)
            << "step " << step;
        EXPECT_EQ(empty.bf16_, given.bf16_) << "step " << step;
      }
      empty.ExpectStateEqualsReference();
      ZINF_ASSERT_OK(given.swapper().Close());
      ZINF_ASSERT_OK(empty.swapper().Close());
    }
  }
}

// Without a gradient swapper an empty GradientSource has no gradient to stand for: Step refuses
// it on every rank before any sub-group is stepped, also when only one rank passes it.
TEST(OptimizerSwapper, AnEmptySourceWithoutAGradientSwapperIsAFailedPrecondition) {
  SharedScratchDir dir("swapper");
  const GradientSource zeros = [](const partition::SubGroup&, std::span<float> grad) {
    std::ranges::fill(grad, 0.0f);
    return OkStatus();
  };
  const int last = World().size() - 1;
  for (bool pipelined : {false, true}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "sync");
    Harness h(dir.path(), 2048, pipelined, GradMode::kCopy, 1);
    h.options().host_cache_bytes = 24576;  // sub-group 0 resident, the rest swapped
    h.options().store.job_id = fmt::format("no-gradient-swapper-{}", pipelined);
    ZINF_ASSERT_OK(h.Create());
    ASSERT_EQ(h.swapper().gradient_swapper(), nullptr);
    const auto refused = StatusIs(ErrorCode::kFailedPrecondition,
                                  HasSubstr("step 1: an empty gradient source stands for the "
                                            "gradient swapper's gradient, and this swapper has "
                                            "none (swap_gradients is off)"));
    EXPECT_THAT(h.swapper().Step(1, GradientSource(), {}), refused);
    // Only the last rank passes it: every rank gets its error, no rank steps.
    EXPECT_THAT(h.swapper().Step(1, World().rank() == last ? GradientSource() : zeros, {}),
                refused);
    for (std::size_t i = 0; i < h.swapper().num_sub_groups(); ++i) {
      EXPECT_EQ(h.swapper().last_step(i), 0) << i;
    }
    h.ExpectStateEqualsReference();
    ZINF_ASSERT_OK(h.swapper().Close());
  }
}

// Speculated sub-groups, once committed, hold the state Step would have given them: a resident
// one (its second copy), a swapped one whose successor is read ahead during its Adam, and that
// successor; Step then steps the rest. The weights Speculate hands back are the new ones.
TEST(OptimizerSwapper, CommittedSpeculationsEqualTheStepBitwise) {
  SharedScratchDir dir("swapper");
  for (StateFormat format : {StateFormat::kFp32, StateFormat::kQ8}) {
    SCOPED_TRACE(StateFormatName(format));
    Harness h(dir.path(), 2048, false, GradMode::kCopy, 1, format);
    h.options().host_cache_bytes = format == StateFormat::kFp32 ? 3 * 8192 : 16384;  // sub-group 0
    h.options().speculative_slots = 2;
    h.options().speculate_resident = true;
    h.options().pinned_budget_bytes = 10 * 8192;  // buffers for a read ahead
    h.options().store.job_id = fmt::format("speculate-{}", StateFormatName(format));
    ZINF_ASSERT_OK(h.Create());
    OptimizerSwapper& swapper = h.swapper();
    ASSERT_GE(swapper.num_sub_groups(), 4u);
    ASSERT_TRUE(swapper.resident(0));
    const StepOptions options{.lr = std::nullopt, .grad_scale = 0.5f, .segments = h.segments_};
    for (std::int64_t step = 1; step <= 2; ++step) {
      ZINF_ASSERT_OK(h.Backward(step));
      std::vector<std::vector<float>> weights(3);
      for (std::size_t i = 0; i < 3; ++i) {
        ASSERT_TRUE(swapper.speculable(i)) << i;
        const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
        weights[i].resize(sg.numel);
        const std::optional<std::size_t> next =
            i == 1 ? std::optional<std::size_t>(2) : std::nullopt;
        ZINF_ASSERT_OK(swapper.Speculate(
            step, i, std::span<const float>(h.summed_).subspan(sg.partition_offset, sg.numel),
            options, weights[i], next));
      }
      ZINF_ASSERT_OK(swapper.FinishSpeculation());
      for (std::size_t i = 0; i < 3; ++i) {
        ASSERT_TRUE(swapper.speculated(i)) << i;
        EXPECT_EQ(swapper.last_step(i), step - 1) << i;
        swapper.CommitSpeculated(i);
        EXPECT_EQ(swapper.last_step(i), step) << i;
      }
      ZINF_ASSERT_OK(h.SwappedStep(step));
      h.ReferenceStep(step);
      for (std::size_t i = 0; i < 3; ++i) {
        const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
        EXPECT_EQ(
            std::memcmp(weights[i].data(), h.ref_.fp32.data() + sg.partition_offset, sg.numel * 4),
            0)
            << "step " << step << " sub-group " << i;
      }
      for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
        EXPECT_EQ(swapper.last_step(i), step) << i;
      }
      h.ExpectStateEqualsReference();
    }
    ZINF_ASSERT_OK(swapper.Close());
  }
}

// Parameter groups (StepOptions::segments) whose runs begin exactly where a sub-group begins
// (the previous one's end), and inside one: each element steps with its own group's values,
// bitwise as CpuAdam over the whole partition (fp32) or the sub-group (q8, whose blocks are the
// sub-group's), in memory, swapped and resident, synchronous and pipelined.
TEST(OptimizerSwapper, GroupSegmentsStartingAtASubGroupsEndStepWithTheirOwnValues) {
  SharedScratchDir dir("swapper");
  const AdamHyperParams h0 = {.lr = 1e-2, .betas = {0.9, 0.999}, .eps = 1e-8, .weight_decay = 0.01};
  const AdamHyperParams h1 = {.lr = 3e-3, .betas = {0.8, 0.95}, .eps = 1e-6, .weight_decay = 0.0};
  for (StateFormat format : {StateFormat::kFp32, StateFormat::kQ8}) {
    for (bool pipelined : {false, true}) {
      for (bool resident : {false, true}) {
        SCOPED_TRACE(fmt::format("{} {} {}", StateFormatName(format),
                                 pipelined ? "pipelined" : "sync",
                                 resident ? "sub-groups 0-1 resident" : "swapped"));
        Harness h(dir.path(), 2048, pipelined, GradMode::kCopy, 1, format);
        h.options().store.job_id =
            fmt::format("segments-{}-{}-{}", StateFormatName(format), pipelined, resident);
        const std::uint64_t one = format == StateFormat::kFp32 ? 3 * 8192 : 16384;
        if (resident) h.options().host_cache_bytes = 2 * one;
        // Sub-groups of 2048 elements: 2048, 4096 and 6144 are sub-group ends (each rank's
        // partition has more than 6144 elements on 1-4 ranks); 3000 lies inside sub-group 1.
        ASSERT_GT(h.plan().partition_numel(), 6144u);
        h.segments_ = {{.begin = 0, .hyper = h0},
                       {.begin = 2048, .hyper = h1},
                       {.begin = 3000, .hyper = h0},
                       {.begin = 4096, .hyper = h1},
                       {.begin = 6144, .hyper = h0}};
        ZINF_ASSERT_OK(h.Create());
        for (std::int64_t step = 1; step <= 3; ++step) {
          ZINF_ASSERT_OK(h.Backward(step));
          h.StepAndCompare(step);
          if (::testing::Test::HasFatalFailure()) return;
        }
        h.ExpectStateEqualsReference();
        ZINF_ASSERT_OK(h.swapper().Close());
      }
    }
  }
}

TEST(OptimizerSwapper, Q8MovesHalfTheBytesAndBuysLargerSubGroups) {
  SharedScratchDir dir("swapper");
  // 3 buffers of 8 KiB: one short of an fp32 step, a q8 step's minimum.
  for (StateFormat format : {StateFormat::kFp32, StateFormat::kQ8}) {
    Harness h(dir.path(), 2048, false, GradMode::kCopy, 1, format);
    h.options().pinned_budget_bytes = 3 * 8192;
    h.options().store.job_id = fmt::format("bytes-{}", StateFormatName(format));
    Status created = h.Create();
    if (format == StateFormat::kFp32) {
      EXPECT_THAT(created, StatusIs(ErrorCode::kResourceExhausted,
                                    HasSubstr("a step with fp32 state needs at least 4")));
      continue;
    }
    ZINF_ASSERT_OK(created);
    OptimizerSwapper& swapper = h.swapper();
    EXPECT_EQ(swapper.num_slot_tensors(), 2u);
    EXPECT_EQ(swapper.SlotTensorName(3, 1), "slot3/moments");
    // 2048 elements: 8 KiB of weights, 4 KiB of codes + 16 bytes of scales, aligned to 4 KiB.
    const std::uint64_t alignment = std::max<std::uint64_t>(swapper.store().alignment(), 1);
    EXPECT_EQ(swapper.SlotTensorIoBytes(0, 1), AlignUp(4096 + 16, alignment));
    ZINF_ASSERT_OK(h.Backward(1));
    ZINF_ASSERT_OK(h.SwappedStep(1));
  }
  // Large sub-groups: 6 bytes per element and a bit.
  Harness big(dir.path(), std::uint64_t{1} << 20, true, GradMode::kCopy, 1, StateFormat::kQ8);
  big.options().store.job_id = "bytes-big";
  ZINF_ASSERT_OK(big.Create());
  EXPECT_EQ(big.swapper().mode_name(), "pipelined");
  EXPECT_EQ(big.swapper().pool().buffer_count(), 7u);  // 3 x 2 + the shared gradient
}

TEST(OptimizerSwapper, PoolTooSmallIsTheSameErrorOnEveryRank) {
  SharedScratchDir dir("swapper");
  Harness h(dir.path(), 2048, false, GradMode::kCopy, 1);
  // 2048 elements -> 8 KiB buffers; 3 of them are one short of a step.
  h.options().pinned_budget_bytes = 3 * 8192;
  Status created = h.Create();
  EXPECT_THAT(created, StatusIs(ErrorCode::kResourceExhausted,
                                HasSubstr("holds 3 swap buffers of 8.00 KiB")));
  EXPECT_THAT(created, StatusIs(ErrorCode::kResourceExhausted,
                                HasSubstr("raise zinf.pinned_budget_bytes to at least 32768")));
}

TEST(OptimizerSwapper, PipelineFallsBackToSyncWhenThePoolIsTooSmall) {
  SharedScratchDir dir("swapper");
  Harness h(dir.path(), 2048, true, GradMode::kCopy, 1);
  h.options().pinned_budget_bytes = 4 * 8192;
  ZINF_ASSERT_OK(h.Create());
  EXPECT_EQ(h.swapper().mode_name(), "partitioned");
  EXPECT_EQ(h.swapper().pool().buffer_count(), 4u);
}

// ---- Faults: one rank's backend fails; every rank must get that error, no rank hangs. ----

enum class FaultAt { kSwapIn, kSwapOut, kGradientWrite };

struct FaultCase {
  FaultAt at;
  bool pipelined;
  StateFormat format = StateFormat::kFp32;
  bool tiered = false;  // sub-group 0 resident in the host memory tier, the rest swapped
};

class OneRankFails : public ::testing::TestWithParam<FaultCase> {};

TEST_P(OneRankFails, SameErrorEverywhereAndStateConsistent) {
  const FaultCase fault = GetParam();
  const comm::Communicator& world = World();
  const int failing = world.size() - 1;
  SharedScratchDir dir("swapper");
  const GradMode mode =
      fault.at == FaultAt::kGradientWrite ? GradMode::kReadAddWrite : GradMode::kCopy;
  Harness h(dir.path(), 2048, fault.pipelined, mode, mode == GradMode::kCopy ? 1 : 2, fault.format);
  // Tiered: sub-group 0 (24 KiB of fp32 state, 16 KiB of q8) stays in memory, does no I/O, and
  // steps before the first swapped one; the faults then hit the swapped sub-groups one later.
  const std::size_t resident = fault.tiered ? 1 : 0;
  if (fault.tiered)
    h.options().host_cache_bytes = fault.format == StateFormat::kFp32 ? 24576 : 16384;
  // Initialize writes k blocks per swapped sub-group (every slot tensor is one block here; k = 3
  // for fp32, 2 for q8). Step 2's faults: a read of the 3rd swapped sub-group, the second write
  // of the 2nd, the first gradient write.
  const std::size_t k = fault.format == StateFormat::kQ8 ? 2 : 3;
  std::size_t num_sub_groups = 0;
  {
    auto sub_groups = partition::SubGroupPlan::Create(h.plan(), world.rank(), 2048);
    ZINF_ASSERT_OK(sub_groups);
    num_sub_groups = sub_groups->size() - resident;  // swapped ones
  }
  ASSERT_GE(num_sub_groups, 3u);
  std::string spec;
  IoRole role = IoRole::kRead;
  switch (fault.at) {
    case FaultAt::kSwapIn:
      spec = fmt::format("read:{}:eio", k * num_sub_groups + 2 * k + 1);
      break;
    case FaultAt::kSwapOut:
      spec = fmt::format("write:{}:eio", k * num_sub_groups * 2 + k + 2);
      role = IoRole::kWrite;
      break;
    case FaultAt::kGradientWrite:
      spec = "write:1+:eio";
      role = IoRole::kGradient;
      break;
  }
  std::shared_ptr<storage::FaultInjector> injector;
  if (world.rank() == failing) {
    auto parsed = storage::ParseFaultSpec(spec);
    ZINF_ASSERT_OK(parsed);
    injector = std::make_shared<storage::FaultInjector>(*parsed);
  }
  bool armed = false;
  h.options().io_backend_wrapper =
      [&](IoRole r,
          std::unique_ptr<storage::IoBackend> backend) -> Result<std::unique_ptr<storage::IoBackend>> {
    // A state fault wraps both state backends (read and write) in the one injector, which
    // counts the completions of the op it names.
    const bool state_engine = r != IoRole::kGradient && role != IoRole::kGradient;
    if (!injector || !(r == role || state_engine)) return backend;
    armed = true;
    return storage::FaultInjectingBackend::Wrap(std::move(backend), injector);
  };
  ZINF_ASSERT_OK(h.Create());
  EXPECT_EQ(armed, world.rank() == failing);
  EXPECT_EQ(h.swapper().num_resident(), resident);

  // State faults hit step 2 (step 1 succeeds everywhere); gradient faults hit the first
  // gradient write, in step 1's backward.
  if (fault.at != FaultAt::kGradientWrite) {
    ZINF_ASSERT_OK(h.Backward(1));
    ZINF_ASSERT_OK(h.SwappedStep(1));
    h.ReferenceStep(1);
  }
  const RefState before = h.ref_;
  const std::int64_t step = fault.at == FaultAt::kGradientWrite ? 1 : 2;

  Status backward = h.Backward(step);
  if (world.rank() != failing) ZINF_EXPECT_OK(backward);
  Status stepped = h.SwappedStep(step);
  const std::string rank_prefix = fmt::format("rank {}:", failing);
  if (world.rank() == 0 && !stepped) {
    std::fprintf(stderr, "agreed error: %s\n", stepped.error().ToString().c_str());
  }
  EXPECT_THAT(stepped, StatusIs(ErrorCode::kDataLoss, HasSubstr(rank_prefix)));
  // The injector counts completions, and a sub-group's three reads (or writes) are in flight
  // together, so which tensor's I/O fails varies from run to run; the sub-group does not.
  switch (fault.at) {
    case FaultAt::kSwapIn:
      EXPECT_THAT(stepped,
                  StatusIs(ErrorCode::kDataLoss,
                           HasSubstr(fmt::format("sub-group {}: swap-in ", 2 + resident))));
      break;
    case FaultAt::kSwapOut:
      EXPECT_THAT(stepped,
                  StatusIs(ErrorCode::kDataLoss,
                           HasSubstr(fmt::format("sub-group {}: swap-out ", 1 + resident))));
      break;
    case FaultAt::kGradientWrite:
      EXPECT_THAT(stepped, StatusIs(ErrorCode::kDataLoss, HasSubstr("gradient")));
      break;
  }
  // Every rank: each sub-group holds either the state before the step or after it.
  h.ReferenceStep(step);
  std::vector<bool> committed(h.swapper().num_sub_groups());
  std::size_t took = 0;
  for (std::size_t i = 0; i < committed.size(); ++i) {
    committed[i] = h.swapper().last_step(i) == step;
    took += committed[i] ? 1 : 0;
  }
  h.ExpectStateEquals(h.ref_, committed);
  std::vector<bool> not_committed(committed.size());
  for (std::size_t i = 0; i < committed.size(); ++i) not_committed[i] = !committed[i];
  h.ExpectStateEquals(before, not_committed);
  if (world.rank() == failing) {
    switch (fault.at) {
      case FaultAt::kSwapIn:
        EXPECT_EQ(took, 2u + resident);
        break;
      case FaultAt::kSwapOut:
        EXPECT_EQ(took, 1u + resident);
        break;
      case FaultAt::kGradientWrite:
        EXPECT_EQ(took, 0u);
        break;
    }
  } else if (fault.at == FaultAt::kGradientWrite) {
    EXPECT_EQ(took, 0u);  // agreed before any sub-group was stepped
  } else {
    EXPECT_EQ(took, committed.size());
  }
  if (fault.at != FaultAt::kGradientWrite) {
    // Retrying the same step applies it to exactly the sub-groups that did not take it.
    ZINF_ASSERT_OK(h.SwappedStep(step));
    h.ExpectStateEqualsReference();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, OneRankFails,
    ::testing::Values(FaultCase{FaultAt::kSwapIn, false}, FaultCase{FaultAt::kSwapIn, true},
                      FaultCase{FaultAt::kSwapOut, false}, FaultCase{FaultAt::kSwapOut, true},
                      FaultCase{FaultAt::kGradientWrite, false},
                      FaultCase{FaultAt::kGradientWrite, true},
                      FaultCase{FaultAt::kSwapIn, true, StateFormat::kQ8},
                      FaultCase{FaultAt::kSwapOut, false, StateFormat::kQ8},
                      FaultCase{FaultAt::kSwapOut, true, StateFormat::kQ8},
                      FaultCase{FaultAt::kGradientWrite, true, StateFormat::kQ8},
                      FaultCase{FaultAt::kSwapIn, false, StateFormat::kFp32, true},
                      FaultCase{FaultAt::kSwapOut, true, StateFormat::kFp32, true},
                      FaultCase{FaultAt::kSwapOut, false, StateFormat::kQ8, true},
                      FaultCase{FaultAt::kSwapIn, true, StateFormat::kQ8, true},
                      FaultCase{FaultAt::kGradientWrite, true, StateFormat::kFp32, true}),
    [](const ::testing::TestParamInfo<FaultCase>& p) {
      const char* at = p.param.at == FaultAt::kSwapIn    ? "SwapIn"
                       : p.param.at == FaultAt::kSwapOut ? "SwapOut"
                                                         : "GradientWrite";
      return fmt::format("{}_{}_{}{}", at, p.param.pipelined ? "Pipelined" : "Sync",
                         StateFormatName(p.param.format), p.param.tiered ? "_Tiered" : "");
    });

}  // namespace
}  // namespace zinf::swapper
