// Stage 3 (engine.h, "Stage 3"): how each parameter is held (PlanHolding), the shards on disk
// and their reader thread (CreateReader, ReadAhead), Gather with its prefetch along the
// recorded order (GatherParams), the release of a Gathered scope, and the Gathered class.
#include "engine_impl.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "zinf/comm/timers.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"
#include "zinf/storage/checksum.h"

namespace zinf::engine {

namespace {

using comm::ReduceOp;

// This rank's fp32 shard of parameter `p` from the swap store's committed weights (the sub-groups
// it spans), in pieces through `staging` (kShardStagingBytes + 2 x the store's alignment) on
// `backend` (nullptr: the swapper's read backend). Local.
Status ReadShardFrom(swapper::OptimizerSwapper& swapper, const partition::PartitionPlan& plan,
                     std::size_t p, std::span<float> out, std::span<std::byte> staging,
                     storage::IoBackend* backend) {
  constexpr std::uint64_t kPiece = kShardStagingBytes / sizeof(float);
  const std::uint64_t begin = plan.ShardPartitionOffset(p);
  const std::uint64_t end = begin + out.size();
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
    const std::uint64_t lo = std::max(begin, sg.partition_offset);
    const std::uint64_t hi = std::min(end, sg.partition_offset + sg.numel);
    for (std::uint64_t at = lo; at < hi; at += kPiece) {
      const std::uint64_t n = std::min(kPiece, hi - at);
      ZINF_RETURN_IF_ERROR(swapper.ReadState(i, swapper::StateTensor::kFp32,
                                             at - sg.partition_offset, out.subspan(at - begin, n),
                                             staging, backend));
    }
  }
  return OkStatus();
}

// A staging buffer for ReadShardFrom.
Result<storage::AlignedBuffer> AllocateShardStaging(swapper::OptimizerSwapper& swapper) {
  const std::uint64_t alignment = std::max<std::uint64_t>(swapper.store().alignment(), 4096);
  return storage::AlignedBuffer::Allocate(kShardStagingBytes + 2 * alignment,
                                          {.alignment = alignment, .register_cuda = false});
}

// What a rank is about to gather (the asks, then everything it all-gathers), as one checksum.
std::uint64_t HashIndices(std::span<const std::size_t> asked, std::span<const std::size_t> todo) {
  std::vector<std::uint64_t> list(asked.begin(), asked.end());
  list.push_back(UINT64_MAX);  // no other list of indices hashes alike
  list.insert(list.end(), todo.begin(), todo.end());
  return storage::Checksum64(std::as_bytes(std::span<const std::uint64_t>(list)));
}

}  // namespace

Status ZeroEngine::Impl::State::PlanHolding(const config::Config& config) {
  const config::ZeroConfig& zero = config.zero_optimization;
  const partition::ParamLayout& layout = plan->layout();
  num_partitioned = 0;
  holding.assign(params.size(), Holding::kLoop);
  whole.assign(params.size(), {});
  refs.assign(params.size(), 0);
  std::uint64_t persistent = 0;
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (!params[p].weights.empty()) continue;
    const std::uint64_t numel = layout.param(p).numel;
    if (numel <= zero.stage3_param_persistence_threshold &&
        persistent + numel <= zero.stage3_model_persistence_threshold) {
      holding[p] = Holding::kPersistent;
      persistent += numel;
    } else {
      holding[p] = Holding::kPartitioned;
      ++num_partitioned;
    }
  }
  const bool nvme = zero.offload_param.device == config::OffloadDevice::kNvme;
  if (nvme && num_partitioned == 0) {
    return InvalidArgumentError(
        "zero_optimization.offload_param.device: \"nvme\", but no parameter is partitioned: "
        "register the parameters without weights (Param::init gives their first values) and "
        "above stage3_param_persistence_threshold elements, or set the device to \"cpu\"");
  }
  whole_ranges.clear();
  if (plan->kind() == partition::PlanKind::kFlat) {
    whole_ranges.emplace_back(0, partition_numel);
  } else {
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (holding[p] == Holding::kPartitioned) continue;
      const std::uint64_t begin = plan->ShardPartitionOffset(p);
      const std::uint64_t end = begin + plan->ShardNumel(p);
      if (!whole_ranges.empty() && whole_ranges.back().second == begin) {
        whole_ranges.back().second = end;
      } else {
        whole_ranges.emplace_back(begin, end);
      }
    }
  }
  shard_numel = 0;
  if (num_partitioned == 0) return OkStatus();
  if (!nvme) {
    shard_numel = partition_numel;
    return OkStatus();
  }
  // offload_param nvme: the first shards up to max_in_cpu elements stay in memory; each of
  // the others must fit offload_param.buffer_size (DeepSpeed's check).
  std::uint64_t in_cpu = 0;
  bool full = false;
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (holding[p] != Holding::kPartitioned) continue;
    const std::uint64_t n = plan->ShardNumel(p);
    if (!full && in_cpu + n <= zero.offload_param.max_in_cpu) {
      in_cpu += n;
      shard_numel = plan->ShardPartitionOffset(p) + n;
      continue;
    }
    full = true;
    if (n > zero.offload_param.buffer_size) {
      return InvalidArgumentError(fmt::format(
          "zero_optimization.offload_param.buffer_size: parameter '{}' has a shard of {} "
          "elements per rank to read from NVMe, more than buffer_size {}; raise it",
          EscapeForTerminal(layout.param(p).name), n, zero.offload_param.buffer_size));
    }
  }
  return OkStatus();
}

Status ZeroEngine::Impl::State::CreateReader(const config::Config& config) {
  bool on_disk = false;
  for (std::size_t p = 0; p < params.size() && !on_disk; ++p) {
    on_disk = holding[p] == Holding::kPartitioned && ShardOnDisk(p);
  }
  if (!on_disk) return OkStatus();
  struct Io {
    std::unique_ptr<storage::IoBackend> backend;
    storage::AlignedBuffer staging;
  };
  auto io = std::make_shared<Io>();
  ZINF_ASSIGN_OR_RETURN(io->backend, swapper->CreateReaderBackend());
  ZINF_ASSIGN_OR_RETURN(io->staging, AllocateShardStaging(*swapper));
  const config::ZeroConfig& zero = config.zero_optimization;
  reader = std::make_unique<ShardReader>(
      [io, from = swapper.get(), of = &*plan](std::size_t p, std::span<float> out) {
        return ReadShardFrom(*from, *of, p, out, io->staging.span(), io->backend.get());
      },
      static_cast<std::size_t>(zero.offload_param.buffer_count), zero.stage3_prefetch_bucket_size);
  return OkStatus();
}

void ZeroEngine::Impl::State::ReadAhead() {
  if (!reader) return;
  if (!following) {
    reader->Cancel();
    return;
  }
  for (std::size_t i = trace_at; i < trace.size(); ++i) {
    const std::size_t p = trace[i];
    if (holding[p] != Holding::kPartitioned || !whole[p].empty() || !ShardOnDisk(p) ||
        reader->queued(p)) {
      continue;
    }
    if (!reader->Queue(p, plan->ShardNumel(p))) break;
  }
}

bool ZeroEngine::Impl::State::ShardOnDisk(std::size_t p) const {
  return plan->ShardPartitionOffset(p) + plan->ShardNumel(p) > shard.size();
}

void ZeroEngine::Impl::State::Drop(std::size_t p) {
  live_elems -= plan->layout().param(p).numel;
  std::vector<float>().swap(whole[p]);
}

void ZeroEngine::Impl::State::NextStep() {
  if (reader) reader->Cancel();  // what it read is the master the step is about to change
  for (std::size_t p : kept) Drop(p);
  kept.clear();
  if (!recording.empty()) trace = std::move(recording);
  recording.clear();
  trace_at = 0;
  following = !trace.empty();
}

bool ZeroEngine::Impl::State::ReusedWithin(std::size_t p, std::uint64_t distance) const {
  if (!following) return false;
  std::uint64_t ahead = 0;
  for (std::size_t i = trace_at; i < trace.size() && ahead <= distance; ++i) {
    if (trace[i] == p) return true;
    if (holding[trace[i]] == Holding::kPartitioned) ahead += plan->layout().param(trace[i]).numel;
  }
  return false;
}

Result<Gathered> ZeroEngine::Impl::Gather(std::span<const std::string> names) {
  if (closed_) return FailedPreconditionError("engine: Gather after Close");
  std::vector<std::size_t> indices;
  indices.reserve(names.size());
  for (const std::string& name : names) {
    const std::optional<std::size_t> index = layout().FindParam(name);
    if (!index) {
      // Agreed with the other ranks' Gather (GatherParams), which fail alike.
      Status agreed = AgreeOnCall(
          "Gather", InvalidArgumentError(fmt::format("engine: Gather: no parameter is called '{}'",
                                                     EscapeForTerminal(name))));
      return std::move(agreed).error();
    }
    indices.push_back(*index);
  }
  return GatherByIndex(indices);
}

Result<Gathered> ZeroEngine::Impl::GatherByIndex(std::span<const std::size_t> params) {
  if (closed_) return FailedPreconditionError("engine: Gather after Close");
  ZINF_RETURN_IF_ERROR(GatherParams(params));
  State& s = *state_;
  Gathered gathered;
  gathered.engine_ = self_;
  gathered.params_.assign(params.begin(), params.end());
  for (std::size_t p : params) {
    const std::uint64_t numel = s.plan->layout().param(p).numel;
    gathered.weights_.push_back(s.holding[p] == Holding::kPartitioned
                                    ? std::span<const float>(s.whole[p]).first(numel)
                                    : std::span<const float>(s.WholeWeights(p)));
  }
  return gathered;
}

// Collective. Checks the asks, decides what to all-gather (the asks not gathered yet and what the
// recorded order says comes next), agrees on it, reads the shards kept on disk, and all-gathers
// each parameter into its whole buffer. On success every asked parameter is held once more.
Status ZeroEngine::Impl::GatherParams(std::span<const std::size_t> asked) {
  State& s = *state_;
  std::vector<bool> seen(s.params.size(), false);
  Status local = CheckAsks(asked, &seen);
  // What to all-gather: the asks not gathered now, then ahead of use.
  std::vector<std::size_t> todo;
  std::uint64_t todo_elems = 0;
  std::size_t ahead = 0;
  if (local) ahead = PlanGather(asked, &todo, &todo_elems);
  ZINF_RETURN_IF_ERROR(AgreeOnGather(local, asked, todo));
  s.recording.insert(s.recording.end(), asked.begin(), asked.end());
  MakeRoom(seen, todo_elems);
  std::vector<std::vector<float>> from_disk(todo.size());
  Status read = ReadShards(todo, todo_elems, &from_disk);
  // On failure nothing of this call stays gathered.
  auto fail = [&](Status failed) {
    for (std::size_t p : todo) std::vector<float>().swap(s.whole[p]);
    return failed;
  };
  read = comm().AgreeOnStatus(read);
  if (!read) return fail(std::move(read));
  Status gathered = AllgatherParams(todo, from_disk);
  if (!gathered) return fail(std::move(gathered));
  CountGather(asked, todo, ahead);
  return OkStatus();
}

Status ZeroEngine::Impl::CheckAsks(std::span<const std::size_t> asked,
                                   std::vector<bool>* seen) const {
  const State& s = *state_;
  const partition::ParamLayout& layout = s.plan->layout();
  for (std::size_t p : asked) {
    if (p >= s.params.size()) {
      return InvalidArgumentError(fmt::format(
          "engine: Gather: parameter index {} (there are {} parameters)", p, s.params.size()));
    }
    if ((*seen)[p]) {
      return InvalidArgumentError(fmt::format("engine: Gather: parameter '{}' asked twice",
                                              EscapeForTerminal(layout.param(p).name)));
    }
    (*seen)[p] = true;
  }
  return OkStatus();
}

std::size_t ZeroEngine::Impl::PlanGather(std::span<const std::size_t> asked,
                                         std::vector<std::size_t>* todo,
                                         std::uint64_t* todo_elems) {
  State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  const partition::ParamLayout& layout = s.plan->layout();
  std::size_t ahead = 0;
  for (std::size_t p : asked) {
    if (s.holding[p] != Holding::kPartitioned || !s.whole[p].empty()) continue;
    todo->push_back(p);
    *todo_elems += layout.param(p).numel;
  }
  if (s.following && s.trace_at + asked.size() <= s.trace.size() &&
      std::equal(asked.begin(), asked.end(), s.trace.begin() + s.trace_at)) {
    s.trace_at += asked.size();
  } else {
    s.following = false;
  }
  std::uint64_t prefetch = 0;
  std::int64_t disk_ahead = 0;
  for (std::size_t i = s.trace_at; s.following && i < s.trace.size(); ++i) {
    const std::size_t p = s.trace[i];
    if (s.holding[p] != Holding::kPartitioned || !s.whole[p].empty() ||
        std::find(todo->begin(), todo->end(), p) != todo->end()) {
      continue;
    }
    const std::uint64_t numel = layout.param(p).numel;
    const bool disk = s.ShardOnDisk(p);
    if (prefetch + numel > zero.stage3_prefetch_bucket_size ||
        s.live_elems + *todo_elems + numel > zero.stage3_max_live_parameters ||
        (disk && disk_ahead >= zero.offload_param.buffer_count)) {
      break;
    }
    todo->push_back(p);
    *todo_elems += numel;
    prefetch += numel;
    disk_ahead += disk ? 1 : 0;
    ++ahead;
  }
  return ahead;
}

// Every rank must gather the same parameters: the asks and the decision are agreed (ranks
// whose Gathered scopes were released at different points decide differently).
Status ZeroEngine::Impl::AgreeOnGather(const Status& local, std::span<const std::size_t> asked,
                                       std::span<const std::size_t> todo) {
  State& s = *state_;
  ZINF_RETURN_IF_ERROR(AgreeOnCall("Gather", local));
  const std::uint64_t decided = HashIndices(asked, todo);
  std::array<std::uint64_t, 2> hash = {decided, ~decided};
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<std::uint64_t>(hash, ReduceOp::kMax));
  if (hash[0] != ~hash[1]) {
    return FailedPreconditionError(
        "engine: Gather: the ranks ask for different parameters (or released their Gathered "
        "scopes at different points): every rank must make the same Gather calls in the same "
        "order");
  }
  return OkStatus();
}

// Gathered parameters no scope holds go, oldest first, except those asked now.
void ZeroEngine::Impl::MakeRoom(const std::vector<bool>& seen, std::uint64_t todo_elems) {
  State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  for (std::size_t i = 0;
       i < s.kept.size() && s.live_elems + todo_elems > zero.stage3_max_live_parameters;) {
    const std::size_t p = s.kept[i];
    if (seen[p]) {
      ++i;
      continue;
    }
    s.Drop(p);
    s.kept.erase(s.kept.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

// This rank's shards: from memory, or read from the swap store (agreed by the caller before any
// all-gather, so that a failed read leaves no rank waiting in one).
Status ZeroEngine::Impl::ReadShards(std::span<const std::size_t> todo, std::uint64_t todo_elems,
                                    std::vector<std::vector<float>>* from_disk) {
  State& s = *state_;
  const partition::ParamLayout& layout = s.plan->layout();
  Status read = OkStatus();
  try {
    for (std::size_t i = 0; i < todo.size() && read; ++i) {
      const std::size_t p = todo[i];
      s.whole[p].assign(s.plan->ShardNumel(p) * static_cast<std::uint64_t>(world_.size()), 0.0f);
      if (!s.ShardOnDisk(p)) continue;
      ++s.counters.disk_reads;
      bool waited = true;
      std::optional<Result<std::vector<float>>> read_ahead =
          s.reader ? s.reader->Take(p, waited) : std::nullopt;
      s.counters.disk_waits += waited ? 1 : 0;
      s.counters.read_ahead += read_ahead ? 1 : 0;
      if (read_ahead && *read_ahead) {
        (*from_disk)[i] = std::move(**read_ahead);
        continue;
      }
      if (read_ahead) {
        read = std::move(*read_ahead).error();
      } else {
        (*from_disk)[i].assign(s.plan->ShardNumel(p), 0.0f);
        read = ReadShard(p, (*from_disk)[i]);
      }
      read = Annotate(read, fmt::format("engine: Gather: reading the shard of parameter '{}': ",
                                        EscapeForTerminal(layout.param(p).name)));
    }
  } catch (const std::bad_alloc&) {
    read = ResourceExhaustedError(
        fmt::format("engine: Gather: no host memory for {} gathered elements (lower "
                    "stage3_prefetch_bucket_size or stage3_max_live_parameters)",
                    todo_elems));
  }
  return read;
}

Status ZeroEngine::Impl::AllgatherParams(std::span<const std::size_t> todo,
                                         const std::vector<std::vector<float>>& from_disk) {
  State& s = *state_;
  const partition::ParamLayout& layout = s.plan->layout();
  comm::ScopedTimer timer(s.timers, "param_allgather");
  for (std::size_t i = 0; i < todo.size(); ++i) {
    const std::size_t p = todo[i];
    const std::uint64_t n = s.plan->ShardNumel(p);
    const std::span<const float> mine = s.ShardOnDisk(p) ? std::span<const float>(from_disk[i])
                                                         : std::span<const float>(s.shard).subspan(
                                                               s.plan->ShardPartitionOffset(p), n);
    Status gathered = s.backend->Allgather(mine, s.whole[p]);
    if (!gathered) return gathered;
    if (WorkingOf(config_) != Working::kFp32) {
      const std::span<float> weights = std::span<float>(s.whole[p]).first(layout.param(p).numel);
      State::Round(weights, weights, WorkingOf(config_));
    }
  }
  return OkStatus();
}

void ZeroEngine::Impl::CountGather(std::span<const std::size_t> asked,
                                   std::span<const std::size_t> todo, std::size_t ahead) {
  State& s = *state_;
  const partition::ParamLayout& layout = s.plan->layout();
  for (std::size_t i = 0; i < todo.size(); ++i) {
    s.live_elems += layout.param(todo[i]).numel;
    // Gathered ahead of use: held by no scope until asked.
    if (i >= todo.size() - ahead) s.kept.push_back(todo[i]);
  }
  for (std::size_t p : asked) {
    if (++s.refs[p] == 1 && s.holding[p] == Holding::kPartitioned) {
      std::erase(s.kept, p);
    }
  }
  s.held_refs += asked.size();
  s.counters.calls += 1;
  s.counters.asked += asked.size();
  s.counters.gathered += todo.size();
  s.counters.prefetched += ahead;
  s.counters.served += asked.size() - (todo.size() - ahead);
  s.counters.peak_live_elems = std::max(s.counters.peak_live_elems, s.live_elems);
  s.ReadAhead();
}

// ReadShardFrom in the caller's thread, through the engine's own staging buffer: in the middle of
// a micro-batch the gradient swapper may hold every pool buffer. Local.
Status ZeroEngine::Impl::ReadShard(std::size_t p, std::span<float> out) {
  State& s = *state_;
  if (s.shard_staging.empty()) {
    ZINF_ASSIGN_OR_RETURN(s.shard_staging, AllocateShardStaging(*s.swapper));
  }
  return ReadShardFrom(*s.swapper, *s.plan, p, out, s.shard_staging.span(), nullptr);
}

// Local: the scopes of `params` end; a parameter no scope holds stays gathered while the
// recorded order uses it again within stage3_max_reuse_distance elements (and
// stage3_max_live_parameters allows), else its whole weights go.
void ZeroEngine::Impl::ReleaseParams(std::span<const std::size_t> params) {
  if (closed_) return;
  State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  for (std::size_t p : params) {
    --s.held_refs;
    if (--s.refs[p] > 0 || s.holding[p] != Holding::kPartitioned) continue;
    if (s.live_elems <= zero.stage3_max_live_parameters &&
        s.ReusedWithin(p, zero.stage3_max_reuse_distance)) {
      s.kept.push_back(p);
    } else {
      s.Drop(p);
    }
  }
}

Gathered::Gathered(Gathered&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)),
      params_(std::move(other.params_)),
      weights_(std::move(other.weights_)) {}

Gathered& Gathered::operator=(Gathered&& other) noexcept {
  if (this != &other) {
    Release();
    engine_ = std::exchange(other.engine_, nullptr);
    params_ = std::move(other.params_);
    weights_ = std::move(other.weights_);
  }
  return *this;
}

std::span<const float> Gathered::operator[](std::size_t i) const {
  ZINF_CHECK(i < weights_.size(), "Gathered[{}]: {} parameters", i, weights_.size());
  return weights_[i];
}

std::span<const float> Gathered::Find(std::string_view name) const {
  if (engine_ == nullptr) return {};
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (engine_->layout().param(params_[i]).name == name) return weights_[i];
  }
  return {};
}

void Gathered::Release() {
  if (engine_ != nullptr) engine_->impl_->ReleaseParams(params_);
  engine_ = nullptr;
  params_.clear();
  weights_.clear();
}

}  // namespace zinf::engine
