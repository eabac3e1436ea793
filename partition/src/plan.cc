#include "zinf/partition/plan.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zinf/core/check.h"
#include "zinf/core/units.h"

namespace zinf::partition {
namespace {

std::uint64_t CeilDiv(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// AlignUp(CeilDiv(numel, world), alignment) within kMaxLayoutNumel, or nothing on overflow.
bool SliceNumel(std::uint64_t numel, std::uint64_t world, std::uint64_t alignment,
                std::uint64_t* out) {
  std::uint64_t per_rank = CeilDiv(numel, world);
  std::uint64_t rem = per_rank % alignment;
  std::uint64_t aligned = per_rank;
  if (rem != 0 && !CheckedAdd(per_rank, alignment - rem, &aligned)) return false;
  std::uint64_t padded_total = 0;
  if (!CheckedMul(aligned, world, &padded_total) || padded_total > kMaxLayoutNumel) return false;
  *out = aligned;
  return true;
}

Error PlanJsonError(std::string_view what) {
  return InvalidArgumentError(fmt::format("partition plan JSON: {}", what));
}

}  // namespace

std::string_view PlanKindName(PlanKind kind) {
  switch (kind) {
    case PlanKind::kFlat:
      return "flat";
    case PlanKind::kPerParam:
      return "per_param";
  }
  return "unknown";
}

Result<PlanKind> ParsePlanKind(std::string_view name) {
  if (name == "flat") return PlanKind::kFlat;
  if (name == "per_param") return PlanKind::kPerParam;
  return InvalidArgumentError(
      fmt::format("unknown partition plan kind '{}' (expected flat or per_param)", name));
}

Result<PlanKind> PlanKindForZeroStage(int zero_stage) {
  if (zero_stage == 1 || zero_stage == 2) return PlanKind::kFlat;
  if (zero_stage == 3) return PlanKind::kPerParam;
  return InvalidArgumentError(
      fmt::format("ZeRO stage {} has no partition plan (expected 1, 2 or 3)", zero_stage));
}

nlohmann::json PlanOptions::ToJson() const {
  return {{"kind", PlanKindName(kind)},
          {"world_size", world_size},
          {"alignment_elems", alignment_elems}};
}

Result<PlanOptions> PlanOptions::FromJson(const nlohmann::json& json) {
  if (!json.is_object()) return PlanJsonError("not an object");
  auto kind = json.find("kind");
  auto world = json.find("world_size");
  auto alignment = json.find("alignment_elems");
  if (kind == json.end() || !kind->is_string()) return PlanJsonError("missing string 'kind'");
  if (world == json.end() || !world->is_number_integer()) {
    return PlanJsonError("missing integer 'world_size'");
  }
  if (alignment == json.end() || !alignment->is_number_unsigned()) {
    return PlanJsonError("missing unsigned integer 'alignment_elems'");
  }
  PlanOptions options;
  ZINF_ASSIGN_OR_RETURN(options.kind,
                        Annotate(ParsePlanKind(kind->get<std::string>()), "partition plan JSON: "));
  std::int64_t world_size = world->get<std::int64_t>();
  if (world->is_number_unsigned() && world->get<std::uint64_t>() > 0x7fffffffULL) {
    world_size = -1;
  }
  if (world_size < 1 || world_size > 0x7fffffff) {
    return PlanJsonError(fmt::format("world_size {} must be in [1, 2^31 - 1]", world->dump()));
  }
  options.world_size = static_cast<int>(world_size);
  options.alignment_elems = alignment->get<std::uint64_t>();
  if (options.alignment_elems == 0) return PlanJsonError("alignment_elems must be >= 1");
  return options;
}

Result<PartitionPlan> PartitionPlan::Create(const ParamLayout& layout, const PlanOptions& options) {
  return Create(std::make_shared<const ParamLayout>(layout), options);
}

Result<PartitionPlan> PartitionPlan::CreateFlat(const ParamLayout& layout, int world_size,
                                                std::uint64_t alignment_elems) {
  return Create(layout, PlanOptions{PlanKind::kFlat, world_size, alignment_elems});
}

Result<PartitionPlan> PartitionPlan::CreatePerParam(const ParamLayout& layout, int world_size,
                                                    std::uint64_t alignment_elems) {
  return Create(layout, PlanOptions{PlanKind::kPerParam, world_size, alignment_elems});
}

Result<PartitionPlan> PartitionPlan::Create(std::shared_ptr<const ParamLayout> layout,
                                            const PlanOptions& options) {
  ZINF_CHECK(layout != nullptr, "PartitionPlan::Create needs a layout");
  if (options.world_size < 1) {
    return InvalidArgumentError(
        fmt::format("partition plan: world_size {} must be >= 1", options.world_size));
  }
  if (options.alignment_elems == 0) {
    return InvalidArgumentError("partition plan: alignment_elems must be >= 1");
  }
  const auto world = static_cast<std::uint64_t>(options.world_size);
  PartitionPlan plan;
  plan.options_ = options;
  switch (options.kind) {
    case PlanKind::kFlat:
      if (!SliceNumel(layout->total_numel(), world, options.alignment_elems,
                      &plan.partition_numel_)) {
        return InvalidArgumentError(fmt::format(
            "partition plan: {} elements on {} ranks aligned to {} exceed 2^63 - 1 elements",
            layout->total_numel(), world, options.alignment_elems));
      }
      break;
    case PlanKind::kPerParam: {
      const std::size_t n = layout->num_params();
      plan.shard_numel_.resize(n);
      plan.shard_offset_.resize(n + 1);
      // Difference array over ranks: ranks [0, full) hold a whole shard, rank `full` the rest.
      std::vector<std::uint64_t> diff(world + 2, 0);
      std::uint64_t offset = 0;
      for (std::size_t p = 0; p < n; ++p) {
        const ParamInfo& info = layout->param(p);
        std::uint64_t shard = 0;
        if (!SliceNumel(info.numel, world, options.alignment_elems, &shard) ||
            !CheckedAdd(offset, shard, &plan.shard_offset_[p + 1]) ||
            plan.shard_offset_[p + 1] > kMaxLayoutNumel / world) {
          return InvalidArgumentError(fmt::format(
              "partition plan: parameter {} '{}': shards of {} elements on {} ranks aligned to {} "
              "exceed 2^63 - 1 elements in all",
              p, info.name, info.numel, world, options.alignment_elems));
        }
        plan.shard_numel_[p] = shard;
        plan.shard_offset_[p] = offset;
        offset = plan.shard_offset_[p + 1];
        const std::uint64_t full = info.numel / shard;
        diff[0] += shard;
        diff[full] -= shard;
        diff[full] += info.numel - full * shard;
        diff[full + 1] -= info.numel - full * shard;
      }
      plan.partition_numel_ = offset;
      plan.real_numel_.resize(world);
      std::uint64_t running = 0;
      for (std::uint64_t r = 0; r < world; ++r) {
        running += diff[r];  // wraps transiently, exact modulo 2^64
        plan.real_numel_[r] = running;
      }
      break;
    }
    default:
      return InvalidArgumentError(
          fmt::format("partition plan: unknown kind {}", static_cast<int>(options.kind)));
  }
  plan.layout_ = std::move(layout);
  return plan;
}

void PartitionPlan::CheckRank(int world_rank) const {
  ZINF_CHECK(world_rank >= 0 && world_rank < options_.world_size,
             "rank {} out of range for a plan of {} ranks", world_rank, options_.world_size);
}

std::uint64_t PartitionPlan::RealNumel(int world_rank) const {
  CheckRank(world_rank);
  if (options_.kind == PlanKind::kPerParam) return real_numel_[world_rank];
  const std::uint64_t total = layout_->total_numel();
  const std::uint64_t begin = PartitionFlatBegin(world_rank);
  return begin >= total ? 0 : std::min(total - begin, partition_numel_);
}

std::uint64_t PartitionPlan::PartitionFlatBegin(int world_rank) const {
  CheckRank(world_rank);
  ZINF_CHECK(options_.kind == PlanKind::kFlat, "a per-parameter plan has no flat range");
  return static_cast<std::uint64_t>(world_rank) * partition_numel_;
}

std::uint64_t PartitionPlan::PartitionFlatEnd(int world_rank) const {
  return PartitionFlatBegin(world_rank) + partition_numel_;
}

std::uint64_t PartitionPlan::ShardNumel(std::size_t param_index) const {
  ZINF_CHECK(options_.kind == PlanKind::kPerParam, "a flat plan has no shards");
  ZINF_CHECK_LT(param_index, shard_numel_.size());
  return shard_numel_[param_index];
}

std::uint64_t PartitionPlan::ShardPartitionOffset(std::size_t param_index) const {
  ZINF_CHECK(options_.kind == PlanKind::kPerParam, "a flat plan has no shards");
  ZINF_CHECK_LT(param_index, shard_numel_.size());
  return shard_offset_[param_index];
}

std::vector<Fragment> PartitionPlan::RankFragments(int world_rank) const {
  return FragmentsInPartitionRange(world_rank, 0, partition_numel_);
}

std::vector<Fragment> PartitionPlan::FragmentsInPartitionRange(int world_rank,
                                                               std::uint64_t partition_offset,
                                                               std::uint64_t numel) const {
  CheckRank(world_rank);
  ZINF_CHECK(partition_offset <= partition_numel_ && numel <= partition_numel_ - partition_offset,
             "range [{}, +{}) outside a partition of {} elements", partition_offset, numel,
             partition_numel_);
  std::vector<Fragment> fragments;
  const std::uint64_t range_end = partition_offset + numel;
  const auto rank = static_cast<std::uint64_t>(world_rank);
  if (options_.kind == PlanKind::kFlat) {
    const std::uint64_t base = rank * partition_numel_;
    const std::uint64_t total = layout_->total_numel();
    std::uint64_t flat = base + partition_offset;
    const std::uint64_t flat_end = std::min(base + range_end, total);
    if (flat >= flat_end) return fragments;
    for (std::size_t p = layout_->ParamAtFlatOffset(flat); flat < flat_end; ++p) {
      const ParamInfo& info = layout_->param(p);
      const std::uint64_t end = std::min(info.flat_offset + info.numel, flat_end);
      fragments.push_back(
          Fragment{world_rank, p, flat - info.flat_offset, flat, flat - base, end - flat});
      flat = end;
    }
    return fragments;
  }
  // kPerParam: the first shard that ends after partition_offset, then every shard that starts
  // before the end of the range.
  auto first =
      std::ranges::upper_bound(shard_offset_.begin() + 1, shard_offset_.end(), partition_offset);
  for (auto p = static_cast<std::size_t>(first - shard_offset_.begin()) - 1;
       p < shard_numel_.size() && shard_offset_[p] < range_end; ++p) {
    const ParamInfo& info = layout_->param(p);
    const std::uint64_t owned_begin = rank * shard_numel_[p];
    if (owned_begin >= info.numel) continue;
    const std::uint64_t owned = std::min(shard_numel_[p], info.numel - owned_begin);
    const std::uint64_t begin = std::max(shard_offset_[p], partition_offset);
    const std::uint64_t end = std::min(shard_offset_[p] + owned, range_end);
    if (begin >= end) continue;
    const std::uint64_t param_offset = owned_begin + (begin - shard_offset_[p]);
    fragments.push_back(
        Fragment{world_rank, p, param_offset, info.flat_offset + param_offset, begin, end - begin});
  }
  return fragments;
}

ElementOwner PartitionPlan::Locate(std::size_t param_index, std::uint64_t param_offset) const {
  const ParamInfo& info = layout_->param(param_index);
  ZINF_CHECK_LT(param_offset, info.numel);
  if (options_.kind == PlanKind::kFlat) {
    const std::uint64_t flat = info.flat_offset + param_offset;
    const std::uint64_t rank = flat / partition_numel_;
    const std::uint64_t partition_end = (rank + 1) * partition_numel_;
    const std::uint64_t run_end = std::min(info.flat_offset + info.numel, partition_end);
    return ElementOwner{static_cast<int>(rank), flat - rank * partition_numel_, run_end - flat};
  }
  const std::uint64_t shard = shard_numel_[param_index];
  const std::uint64_t rank = param_offset / shard;
  const std::uint64_t in_shard = param_offset - rank * shard;
  const std::uint64_t run_end = std::min(info.numel, (rank + 1) * shard);
  return ElementOwner{static_cast<int>(rank), shard_offset_[param_index] + in_shard,
                      run_end - param_offset};
}

std::vector<Fragment> PartitionPlan::ParamFragments(std::size_t param_index) const {
  const ParamInfo& info = layout_->param(param_index);
  std::vector<Fragment> fragments;
  for (std::uint64_t offset = 0; offset < info.numel;) {
    ElementOwner owner = Locate(param_index, offset);
    fragments.push_back(Fragment{owner.world_rank, param_index, offset, info.flat_offset + offset,
                                 owner.partition_offset, owner.run_numel});
    offset += owner.run_numel;
  }
  return fragments;
}

nlohmann::json PartitionPlan::ToJson() const {
  return {{"layout", layout_->ToJson()}, {"plan", options_.ToJson()}};
}

Result<PartitionPlan> PartitionPlan::FromJson(const nlohmann::json& json) {
  if (!json.is_object() || !json.contains("layout") || !json.contains("plan")) {
    return PlanJsonError("expected an object with 'layout' and 'plan'");
  }
  ZINF_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::FromJson(json.at("layout")));
  ZINF_ASSIGN_OR_RETURN(PlanOptions options, PlanOptions::FromJson(json.at("plan")));
  return Create(std::make_shared<const ParamLayout>(std::move(layout)), options);
}

}  // namespace zinf::partition
