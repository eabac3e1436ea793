#include "zinf/swapper/optimizer_swapper.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "optimizer_swapper_internal.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/swapper/gradient_swapper.h"
#include "zinf/swapper/partitioned_optimizer_swapper.h"
#include "zinf/swapper/pipelined_optimizer_swapper.h"

namespace zinf::swapper {
namespace {

constexpr StateTensor kStateTensors[] = {StateTensor::kFp32, StateTensor::kExpAvg,
                                         StateTensor::kExpAvgSq};

std::span<const std::byte> ConstBytes(std::span<std::byte> b) { return {b.data(), b.size()}; }

// Zeroes the elements of `sub_group` that no fragment covers (partition padding).
void ZeroPadding(const partition::SubGroup& sub_group, std::span<float> values) {
  std::uint64_t next = 0;
  for (const partition::SubGroupFragment& f : sub_group.fragments) {
    std::fill(values.begin() + static_cast<std::ptrdiff_t>(next),
              values.begin() + static_cast<std::ptrdiff_t>(f.sub_group_offset), 0.0f);
    next = f.sub_group_offset + f.numel;
  }
  std::fill(values.begin() + static_cast<std::ptrdiff_t>(next), values.end(), 0.0f);
}

// Sums, per file system of a node, what the swap stores of all its ranks need, and compares it
// with what is free. Collective over `comm`.
Status PreflightSpace(const comm::Communicator& comm, const storage::SwapStoreOptions& options,
                      std::span<const storage::TensorSpec> specs) {
  Result<std::vector<storage::PathSpace>> planned = storage::SwapStore::PlanSpace(options, specs);
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(planned.has_value() ? OkStatus()
                                                              : Status(planned.error())));
  ZINF_ASSIGN_OR_RETURN(comm::Communicator node, comm.SplitNode());
  std::vector<std::uint64_t> mine;
  for (const storage::PathSpace& space : *planned) {
    mine.push_back(space.device_id);
    mine.push_back(space.needed_bytes);
  }
  std::vector<std::int64_t> counts(static_cast<std::size_t>(node.size()));
  const std::int64_t my_count = static_cast<std::int64_t>(mine.size());
  ZINF_RETURN_IF_ERROR(
      node.Allgather<std::int64_t>(std::span<const std::int64_t>(&my_count, 1), counts));
  std::int64_t total = 0;
  for (std::int64_t c : counts) total += c;
  std::vector<std::uint64_t> all(static_cast<std::size_t>(total));
  ZINF_RETURN_IF_ERROR(node.Allgatherv<std::uint64_t>(mine, all, counts));
  Status local = OkStatus();
  std::set<std::uint64_t> reported;
  for (const storage::PathSpace& space : *planned) {
    if (!reported.insert(space.device_id).second) continue;
    std::uint64_t needed = 0;
    for (std::size_t i = 0; i + 1 < all.size(); i += 2) {
      if (all[i] == space.device_id) needed += all[i + 1];
    }
    if (needed > space.available_bytes) {
      local = ResourceExhaustedError(fmt::format(
          "not enough space for the optimizer swap stores on host {}: path {} needs {} ({} "
          "bytes) for the {} ranks of this node, {} ({} bytes) available",
          comm.topology().hostname, space.path, FormatBytes(needed), needed, node.size(),
          FormatBytes(space.available_bytes), space.available_bytes));
      break;
    }
  }
  return comm.AgreeOnStatus(local);
}

// Removes what killed runs left in this node's swap directories (SwapStore::ReclaimStale), once
// per directory and node: each rank scans those of its paths that no lower local rank of the
// node has (paths with {local_rank} differ per rank). Run after every rank's store is open, so
// that the job's own stores are locked. Collective over `comm`; what the scan finds or fails at
// is WARN lines, only a communication error fails.
Status ReclaimStaleStores(const comm::Communicator& comm,
                          const storage::SwapStoreOptions& options) {
  std::vector<std::uint64_t> mine;  // (st_dev, st_ino) per path
  for (const std::string& path : options.paths) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) st = {};  // cannot happen after Open; scan it anyway
    mine.push_back(static_cast<std::uint64_t>(st.st_dev));
    mine.push_back(static_cast<std::uint64_t>(st.st_ino));
  }
  ZINF_ASSIGN_OR_RETURN(comm::Communicator node, comm.SplitNode());
  std::vector<std::int64_t> counts(static_cast<std::size_t>(node.size()));
  const std::int64_t my_count = static_cast<std::int64_t>(mine.size());
  ZINF_RETURN_IF_ERROR(
      node.Allgather<std::int64_t>(std::span<const std::int64_t>(&my_count, 1), counts));
  std::int64_t total = 0;
  std::int64_t lower = 0;  // entries of the node's lower ranks
  for (std::size_t r = 0; r < counts.size(); ++r) {
    if (static_cast<int>(r) < node.rank()) lower += counts[r];
    total += counts[r];
  }
  std::vector<std::uint64_t> all(static_cast<std::size_t>(total));
  ZINF_RETURN_IF_ERROR(node.Allgatherv<std::uint64_t>(mine, all, counts));
  storage::SwapStoreOptions scan = options;
  scan.paths.clear();
  for (std::size_t i = 0; i < options.paths.size(); ++i) {
    bool scanned_below = false;
    for (std::int64_t j = 0; j + 1 < lower; j += 2) {
      const auto k = static_cast<std::size_t>(j);
      scanned_below = scanned_below || (all[k] == mine[2 * i] && all[k + 1] == mine[2 * i + 1]);
    }
    if (!scanned_below) scan.paths.push_back(options.paths[i]);
  }
  if (scan.paths.empty()) return OkStatus();
  Result<std::vector<storage::StaleStore>> found = storage::SwapStore::ReclaimStale(scan);
  if (!found) {
    ZINF_LOG_WARN("optimizer swapper: looking for swap stores that killed runs left behind: {}",
                  found.error().ToString());
  }
  return OkStatus();
}

}  // namespace

std::string_view StateTensorName(StateTensor which) {
  switch (which) {
    case StateTensor::kFp32: return "fp32";
    case StateTensor::kExpAvg: return "exp_avg";
    case StateTensor::kExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

std::string_view EngineRoleName(EngineRole role) {
  switch (role) {
    case EngineRole::kRead: return "read";
    case EngineRole::kWrite: return "write";
    case EngineRole::kGradient: return "gradient";
  }
  return "?";
}

std::string_view GradientAccumulationName(GradientAccumulation mode) {
  switch (mode) {
    case GradientAccumulation::kAuto: return "auto";
    case GradientAccumulation::kInMemory: return "in-memory";
    case GradientAccumulation::kReadAddWrite: return "read-add-write";
  }
  return "?";
}

Q8MomentsLayout Q8MomentsLayout::For(std::uint64_t numel) {
  Q8MomentsLayout layout;
  layout.numel = numel;
  layout.num_blocks = q8::NumBlocks(numel);
  layout.scales_offset = AlignUp(2 * numel, 64);
  layout.bytes = layout.scales_offset + 2 * layout.num_blocks * sizeof(float);
  return layout;
}

Q8Moments ViewQ8Moments(std::span<std::byte> buffer, const Q8MomentsLayout& layout) {
  ZINF_CHECK(buffer.size() >= layout.bytes, "q8 moments buffer of {} bytes, {} needed",
             buffer.size(), layout.bytes);
  auto* codes = reinterpret_cast<std::uint8_t*>(buffer.data());
  auto* scales = reinterpret_cast<float*>(buffer.data() + layout.scales_offset);
  return Q8Moments{
      .exp_avg = {.codes = {codes, layout.numel}, .scales = {scales, layout.num_blocks}},
      .exp_avg_sq = {.codes = {codes + layout.numel, layout.numel},
                     .scales = {scales + layout.num_blocks, layout.num_blocks}}};
}

std::size_t OptimizerSwapper::BuffersPerSubGroup(StateFormat format) {
  return format == StateFormat::kQ8 ? 3 : 4;
}

std::size_t OptimizerSwapper::num_slot_tensors() const {
  return options_.state_format == StateFormat::kQ8 ? 2 : kNumStateTensors;
}

std::string OptimizerSwapper::SlotTensorName(std::size_t slot, std::size_t tensor) const {
  if (options_.state_format == StateFormat::kQ8 && tensor == 1) {
    return fmt::format("slot{}/moments", slot);
  }
  return fmt::format("slot{}/{}", slot, StateTensorName(static_cast<StateTensor>(tensor)));
}

std::uint64_t OptimizerSwapper::SlotTensorIoBytes(std::size_t sub_group, std::size_t tensor) const {
  const SubGroupSwapInfo& info = infos_.at(sub_group);
  return options_.state_format == StateFormat::kQ8 && tensor == 1 ? info.moments_io_bytes
                                                                  : info.io_size_bytes;
}

OptimizerSwapper::OptimizerSwapper(std::string_view mode_name, Parts&& parts)
    : options_(std::move(parts.options)),
      comm_(std::move(*parts.comm)),
      plan_(std::move(*parts.plan)),
      sub_groups_(std::move(*parts.sub_groups)),
      infos_(std::move(parts.infos)),
      store_(std::move(parts.store)),
      read_engine_(std::move(parts.read_engine)),
      write_engine_(std::move(parts.write_engine)),
      pool_(std::move(parts.pool)),
      adam_(std::move(*parts.adam)),
      mode_name_(mode_name) {
  const std::size_t n = infos_.size();
  slot_of_.resize(n);
  for (std::size_t i = 0; i < n; ++i) slot_of_[i] = i;
  for (std::size_t s = parts.num_slots; s-- > n;) spare_slots_.push_back(s);
  last_step_.assign(n, 0);
}

OptimizerSwapper::~OptimizerSwapper() {
  // The engines drain in their destructors; they must go before the pool and the store that
  // their requests point into.
  gradient_swapper_.reset();
  write_engine_.reset();
  read_engine_.reset();
  if (store_) {
    Status closed = store_->Close();
    if (!closed) ZINF_LOG_WARN("optimizer swapper: closing the swap store: {}",
                               closed.error().ToString());
  }
}

Status OptimizerSwapper::Close() {
  if (gradient_swapper_) ZINF_RETURN_IF_ERROR(gradient_swapper_->Flush());
  return store_->Close();
}

std::uint64_t OptimizerSwapper::StateIoBytesPerStep() const {
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    for (std::size_t t = 0; t < num_slot_tensors(); ++t) bytes += SlotTensorIoBytes(i, t);
  }
  return bytes;
}

double OptimizerSwapper::StateIoBytesPerElement() const {
  std::uint64_t numel = 0;
  for (const SubGroupSwapInfo& info : infos_) numel += info.sub_group.numel;
  return numel == 0 ? 0.0 : static_cast<double>(StateIoBytesPerStep()) / static_cast<double>(numel);
}

// ---- IoBatch ----

void OptimizerSwapper::IoBatch::Add(const std::vector<std::uint64_t>& ids, std::string label) {
  for (std::uint64_t id : ids) {
    ids_.push_back(id);
    labels_.push_back(label);
  }
}

Status OptimizerSwapper::IoBatch::Wait(storage::IoEngine& engine) {
  Status first = OkStatus();
  std::unordered_set<std::uint64_t> completed;
  std::vector<storage::IoCompletion> done;
  while (engine.pending() > 0) {
    done.clear();
    Status status = engine.Wait(engine.pending(), &done);
    for (const storage::IoCompletion& c : done) completed.insert(c.id);
    if (!status && first) first = std::move(status);
  }
  std::vector<std::string> failed;
  for (std::size_t i = 0; i < ids_.size(); ++i) {
    if (!completed.contains(ids_[i]) &&
        std::find(failed.begin(), failed.end(), labels_[i]) == failed.end()) {
      failed.push_back(labels_[i]);
    }
  }
  ids_.clear();
  labels_.clear();
  if (first) return first;
  if (failed.empty()) return first;
  return std::move(first).error().WithContext(fmt::format("{}: ", fmt::join(failed, ", ")));
}

// ---- Shared machinery ----

Status OptimizerSwapper::SubmitStateReads(std::size_t sub_group, const PoolLease& lease,
                                          storage::IoEngine& engine, IoBatch* batch) {
  const std::size_t slot = slot_of_[sub_group];
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) {
    const std::string name = SlotTensorName(slot, t);
    const std::uint64_t bytes = SlotTensorIoBytes(sub_group, t);
    ZINF_ASSIGN_OR_RETURN(
        std::vector<std::uint64_t> ids,
        Annotate(store_->SubmitReadRange(name, 0, bytes, lease.bytes(t).first(bytes), engine),
                 fmt::format("{}: ", name)));
    batch->Add(ids, name);
  }
  return OkStatus();
}

Status OptimizerSwapper::VerifyStateReads(std::size_t sub_group, const PoolLease& lease) const {
  if (!options_.store.verify_swap) return OkStatus();
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) {
    const std::string name = SlotTensorName(slot_of_[sub_group], t);
    ZINF_RETURN_IF_ERROR(Annotate(
        store_->VerifyRead(name, ConstBytes(lease.bytes(t).first(SlotTensorIoBytes(sub_group, t)))),
        fmt::format("{}: ", name)));
  }
  return OkStatus();
}

Result<std::size_t> OptimizerSwapper::SubmitStateWrites(std::size_t sub_group,
                                                        const PoolLease& lease,
                                                        storage::IoEngine& engine, IoBatch* batch,
                                                        std::span<const std::size_t> buffers) {
  ZINF_CHECK(!spare_slots_.empty(), "no spare slot for sub-group {}", sub_group);
  ZINF_CHECK(buffers.empty() || buffers.size() == num_slot_tensors(), "{} buffers for {} tensors",
             buffers.size(), num_slot_tensors());
  const std::size_t slot = spare_slots_.back();
  spare_slots_.pop_back();
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) {
    const std::string name = SlotTensorName(slot, t);
    const std::uint64_t bytes = SlotTensorIoBytes(sub_group, t);
    const std::size_t buffer = buffers.empty() ? t : buffers[t];
    Result<std::vector<std::uint64_t>> ids = store_->SubmitWriteRange(
        name, 0, bytes, ConstBytes(lease.bytes(buffer).first(bytes)), engine);
    if (!ids) {
      // The caller drains `batch`; the slot is spare again whatever happened to the others.
      Abandon(slot);
      return std::move(ids).error().WithContext(fmt::format("{}: ", name));
    }
    batch->Add(*ids, name);
  }
  return slot;
}

Status OptimizerSwapper::WriteAndCommit(std::size_t sub_group, std::int64_t step,
                                        const PoolLease& lease,
                                        std::span<const std::size_t> buffers,
                                        const std::string& context) {
  IoBatch batch;
  Result<std::size_t> slot = SubmitStateWrites(sub_group, lease, write_engine(), &batch, buffers);
  Status written = batch.Wait(write_engine());
  if (!slot) return std::move(slot).error().WithContext(context);
  if (!written) {
    Abandon(*slot);
    return std::move(written).error().WithContext(context);
  }
  Commit(sub_group, *slot, step);
  return OkStatus();
}

void OptimizerSwapper::Commit(std::size_t sub_group, std::size_t slot, std::int64_t step) {
  spare_slots_.push_back(slot_of_[sub_group]);
  slot_of_[sub_group] = slot;
  last_step_[sub_group] = step;
}

void OptimizerSwapper::Abandon(std::size_t slot) { spare_slots_.push_back(slot); }

Status OptimizerSwapper::Compute(std::int64_t step, std::size_t sub_group, const PoolLease& lease,
                                 const StepOptions& options) {
  comm::ScopedTimer timer(timers_, "optimizer_step");
  const std::size_t numel = infos_[sub_group].sub_group.numel;
  std::span<float> grad = lease.floats(gradient_buffer()).first(numel);
  const StepExtras extras{
      .grad_scale = options.grad_scale, .lr = options.lr, .betas = options.betas};
  const std::int64_t adam_step = options.adam_step > 0 ? options.adam_step : step;
  if (options_.state_format == StateFormat::kQ8) {
    const Q8Moments moments = ViewQ8Moments(lease.bytes(1), Q8MomentsLayout::For(numel));
    ZINF_RETURN_IF_ERROR(Annotate(adam_.StepQ8(adam_step, lease.floats(0).first(numel), grad,
                                               moments.exp_avg, moments.exp_avg_sq, extras),
                                  "adam (q8): "));
  } else {
    ZINF_RETURN_IF_ERROR(
        Annotate(adam_.Step(adam_step, lease.floats(0).first(numel), grad,
                            lease.floats(1).first(numel), lease.floats(2).first(numel), extras),
                 "adam: "));
  }
  if (options_.bf16_params) {
    // The gradient is consumed: its buffer takes the bf16 weights for the sink.
    auto* bf16 = reinterpret_cast<std::uint16_t*>(grad.data());
    const float* fp32 = lease.floats(0).data();
    for (std::size_t i = 0; i < numel; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &fp32[i], sizeof(bits));
      bf16[i] = FloatBitsToBf16(bits);
    }
  }
  return OkStatus();
}

Status OptimizerSwapper::Sink(std::size_t sub_group, const PoolLease& lease,
                              const ParamSink& sink) {
  if (!sink) return OkStatus();
  const SubGroupSwapInfo& info = infos_[sub_group];
  const std::size_t numel = info.sub_group.numel;
  std::span<const std::uint16_t> bf16;
  if (options_.bf16_params) {
    bf16 = {reinterpret_cast<const std::uint16_t*>(lease.floats(gradient_buffer()).data()), numel};
  }
  return Annotate(sink(info.sub_group, lease.floats(0).first(numel), bf16), "param sink: ");
}

Status OptimizerSwapper::FlushGradientsCollective(std::int64_t step) {
  Status local = OkStatus();
  if (gradient_swapper_) {
    local = Annotate(gradient_swapper_->Flush(),
                     fmt::format("step {}: gradient flush (no sub-group took the step): ", step));
  }
  return comm_.AgreeOnStatus(local);
}

Status OptimizerSwapper::FlushGradients() {
  Status local = OkStatus();
  if (gradient_swapper_) local = Annotate(gradient_swapper_->Flush(), "gradient flush: ");
  return comm_.AgreeOnStatus(local);
}

std::string OptimizerSwapper::StepContext(std::int64_t step, std::size_t sub_group) const {
  (void)step;
  return fmt::format("sub-group {}: ", sub_group);
}

Status OptimizerSwapper::FinishStep(std::int64_t step, Status local) {
  if (!local) {
    std::size_t took = 0;
    for (std::int64_t s : last_step_) took += s >= step ? 1 : 0;
    local = std::move(local).error().WithContext(
        fmt::format("step {}: {} of {} sub-groups took the step; ", step, took, last_step_.size()));
  }
  return comm_.AgreeOnStatus(local);
}

Status OptimizerSwapper::LogTimers(std::string_view title) {
  return timers_.LogSummary(comm_, title);
}

// ---- Initialize / ReadState / WriteState ----

Status OptimizerSwapper::Initialize(const InitialWeights& initial_fp32) {
  auto local = [&]() -> Status {
    if (gradient_swapper_) ZINF_RETURN_IF_ERROR(gradient_swapper_->Flush());
    ZINF_ASSIGN_OR_RETURN(PoolLease lease,
                          pool_->Allocate(sub_groups_.max_sub_group_numel(), 2));
    // Buffer 1 holds the zero state of the moments: fp32 zeros, or q8 codes of zero with scale 0
    // (re-laid out per sub-group size).
    std::span<float> zeros = lease.floats(1);
    std::fill(zeros.begin(), zeros.end(), 0.0f);
    for (std::size_t i = 0; i < infos_.size(); ++i) {
      const SubGroupSwapInfo& info = infos_[i];
      std::span<float> fp32 = lease.floats(0);
      std::fill(fp32.begin(), fp32.begin() + static_cast<std::ptrdiff_t>(info.io_size_bytes / 4),
                0.0f);
      std::span<float> values = fp32.first(info.sub_group.numel);
      if (initial_fp32) {
        ZINF_RETURN_IF_ERROR(Annotate(initial_fp32(info.sub_group.partition_offset, values),
                                      fmt::format("sub-group {}: initial weights: ", i)));
      }
      ZeroPadding(info.sub_group, values);
      std::vector<std::size_t> buffers(num_slot_tensors(), 1);
      buffers[0] = 0;
      if (options_.state_format == StateFormat::kQ8) {
        // Only the bytes this sub-group's moments write: the codes of zero, scales 0.
        std::span<std::byte> moments_bytes = lease.bytes(1).first(info.moments_io_bytes);
        std::ranges::fill(moments_bytes, std::byte{0});
        const Q8Moments moments =
            ViewQ8Moments(moments_bytes, Q8MomentsLayout::For(info.sub_group.numel));
        std::ranges::fill(moments.exp_avg.codes, q8::ZeroCode(q8::MapKind::kSigned));
        std::ranges::fill(moments.exp_avg_sq.codes, q8::ZeroCode(q8::MapKind::kUnsigned));
      }
      ZINF_RETURN_IF_ERROR(
          WriteAndCommit(i, 0, lease, buffers, fmt::format("sub-group {}: initialize: ", i)));
    }
    return OkStatus();
  };
  return comm_.AgreeOnStatus(Annotate(local(), "initialize optimizer state: "));
}

Status OptimizerSwapper::ReadState(std::size_t sub_group, StateTensor which,
                                   std::uint64_t offset_elems, std::span<float> out) {
  if (sub_group >= infos_.size()) {
    return InvalidArgumentError(
        fmt::format("ReadState: sub-group {} of {}", sub_group, infos_.size()));
  }
  const SubGroupSwapInfo& info = infos_[sub_group];
  if (offset_elems > info.sub_group.numel || out.size() > info.sub_group.numel - offset_elems) {
    return InvalidArgumentError(fmt::format(
        "ReadState: elements [{}, {}) outside sub-group {} of {} elements", offset_elems,
        offset_elems + out.size(), sub_group, info.sub_group.numel));
  }
  if (out.empty()) return OkStatus();
  if (options_.state_format == StateFormat::kQ8 && which != StateTensor::kFp32) {
    return ReadQ8Moments(sub_group, [&](const Q8Moments& moments) -> Status {
      const bool signed_map = which == StateTensor::kExpAvg;
      const Q8Moment& m = signed_map ? moments.exp_avg : moments.exp_avg_sq;
      const q8::MapKind kind = signed_map ? q8::MapKind::kSigned : q8::MapKind::kUnsigned;
      std::uint64_t done = 0;
      while (done < out.size()) {
        const std::uint64_t at = offset_elems + done;
        const std::uint64_t block = at / q8::kBlockNumel;
        const std::uint64_t n =
            std::min<std::uint64_t>(out.size() - done, (block + 1) * q8::kBlockNumel - at);
        q8::DequantizeBlock(kind, m.codes.subspan(at, n), m.scales[block], out.subspan(done, n));
        done += n;
      }
      return OkStatus();
    });
  }
  const std::uint64_t alignment = std::max<std::uint64_t>(store_->alignment(), 1);
  const std::uint64_t begin = AlignDown(offset_elems * sizeof(float), alignment);
  const std::uint64_t end =
      std::min(AlignUp((offset_elems + out.size()) * sizeof(float), alignment),
               info.io_size_bytes);
  ZINF_ASSIGN_OR_RETURN(PoolLease lease, pool_->Allocate(1, 1));
  std::span<std::byte> buffer = lease.bytes(0).first(end - begin);
  ZINF_RETURN_IF_ERROR(
      ReadSlotTensor(SlotTensorName(slot_of_[sub_group], static_cast<std::size_t>(which)), begin,
                     buffer, fmt::format("read state of sub-group {}: ", sub_group)));
  std::memcpy(out.data(), buffer.data() + (offset_elems * sizeof(float) - begin),
              out.size() * sizeof(float));
  return OkStatus();
}

Status OptimizerSwapper::ReadSlotTensor(const std::string& name, std::uint64_t begin,
                                        std::span<std::byte> buffer, const std::string& context) {
  IoBatch batch;
  Result<std::vector<std::uint64_t>> ids =
      store_->SubmitReadRange(name, begin, buffer.size(), buffer, read_engine());
  if (ids) batch.Add(*ids, name);
  Status waited = batch.Wait(read_engine());
  if (!ids) return std::move(ids).error().WithContext(context + name + ": ");
  ZINF_RETURN_IF_ERROR(Annotate(waited, context));
  return Annotate(store_->VerifyRead(name, ConstBytes(buffer), begin), context);
}

Status OptimizerSwapper::ReadQ8Moments(std::size_t sub_group,
                                       const std::function<Status(const Q8Moments&)>& use) {
  if (options_.state_format != StateFormat::kQ8) {
    return FailedPreconditionError("ReadQ8Moments: the optimizer state format is not q8");
  }
  if (sub_group >= infos_.size()) {
    return InvalidArgumentError(
        fmt::format("ReadQ8Moments: sub-group {} of {}", sub_group, infos_.size()));
  }
  const SubGroupSwapInfo& info = infos_[sub_group];
  ZINF_ASSIGN_OR_RETURN(PoolLease lease, pool_->Allocate(1, 1));
  std::span<std::byte> buffer = lease.bytes(0).first(info.moments_io_bytes);
  ZINF_RETURN_IF_ERROR(ReadSlotTensor(SlotTensorName(slot_of_[sub_group], 1), 0, buffer,
                                      fmt::format("read q8 moments of sub-group {}: ", sub_group)));
  return use(ViewQ8Moments(buffer, Q8MomentsLayout::For(info.sub_group.numel)));
}

Status OptimizerSwapper::WriteState(
    std::size_t sub_group, std::int64_t step,
    const std::function<Status(StateTensor, std::span<float>)>& fill) {
  if (sub_group >= infos_.size()) {
    return InvalidArgumentError(
        fmt::format("WriteState: sub-group {} of {}", sub_group, infos_.size()));
  }
  const SubGroupSwapInfo& info = infos_[sub_group];
  const std::size_t numel = info.sub_group.numel;
  const std::string context = fmt::format("write state of sub-group {}: ", sub_group);
  ZINF_ASSIGN_OR_RETURN(PoolLease lease, pool_->Allocate(numel, 3));
  auto fill_one = [&](StateTensor which, std::span<float> values) -> Status {
    std::fill(values.begin(), values.end(), 0.0f);
    return Annotate(fill(which, values.first(numel)),
                    context + std::string(StateTensorName(which)) + ": ");
  };
  if (options_.state_format == StateFormat::kQ8) {
    // Buffer 0: fp32; buffer 1: one fp32 moment at a time, quantized into buffer 2.
    std::span<float> fp32 = lease.floats(0).first(info.io_size_bytes / 4);
    ZINF_RETURN_IF_ERROR(fill_one(StateTensor::kFp32, fp32));
    std::span<std::byte> moments_bytes = lease.bytes(2).first(info.moments_io_bytes);
    std::ranges::fill(moments_bytes, std::byte{0});
    const Q8Moments moments = ViewQ8Moments(moments_bytes, Q8MomentsLayout::For(numel));
    std::span<float> staging = lease.floats(1).first(numel);
    for (StateTensor which : {StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      ZINF_RETURN_IF_ERROR(fill_one(which, staging));
      const bool signed_map = which == StateTensor::kExpAvg;
      const Q8Moment& m = signed_map ? moments.exp_avg : moments.exp_avg_sq;
      ZINF_RETURN_IF_ERROR(
          Annotate(q8::Quantize(signed_map ? q8::MapKind::kSigned : q8::MapKind::kUnsigned, staging,
                                m.codes, m.scales),
                   context + std::string(StateTensorName(which)) + ": "));
    }
    const std::size_t buffers[] = {0, 2};
    return WriteAndCommit(sub_group, step, lease, buffers, context);
  }
  for (StateTensor which : kStateTensors) {
    const auto t = static_cast<std::size_t>(which);
    ZINF_RETURN_IF_ERROR(fill_one(which, lease.floats(t).first(info.io_size_bytes / 4)));
  }
  return WriteAndCommit(sub_group, step, lease, {}, context);
}

Status OptimizerSwapper::WriteQ8State(std::size_t sub_group, std::int64_t step,
                                      const std::function<Status(std::span<float>)>& fill_fp32,
                                      const std::function<Status(const Q8Moments&)>& fill_moments) {
  if (options_.state_format != StateFormat::kQ8) {
    return FailedPreconditionError("WriteQ8State: the optimizer state format is not q8");
  }
  if (sub_group >= infos_.size()) {
    return InvalidArgumentError(
        fmt::format("WriteQ8State: sub-group {} of {}", sub_group, infos_.size()));
  }
  const SubGroupSwapInfo& info = infos_[sub_group];
  const std::string context = fmt::format("write q8 state of sub-group {}: ", sub_group);
  ZINF_ASSIGN_OR_RETURN(PoolLease lease, pool_->Allocate(info.sub_group.numel, 2));
  std::span<float> fp32 = lease.floats(0).first(info.io_size_bytes / 4);
  std::ranges::fill(fp32, 0.0f);
  ZINF_RETURN_IF_ERROR(Annotate(fill_fp32(fp32.first(info.sub_group.numel)), context + "fp32: "));
  std::span<std::byte> moments_bytes = lease.bytes(1).first(info.moments_io_bytes);
  std::ranges::fill(moments_bytes, std::byte{0});
  ZINF_RETURN_IF_ERROR(Annotate(
      fill_moments(ViewQ8Moments(moments_bytes, Q8MomentsLayout::For(info.sub_group.numel))),
      context + "moments: "));
  return WriteAndCommit(sub_group, step, lease, {}, context);
}

// ---- Create ----

namespace {

// Checks the options against the plan and the communicator.
Status CheckOptions(const partition::PartitionPlan& plan, const comm::Communicator& comm,
                    const SwapperOptions& options) {
  if (plan.world_size() != comm.size()) {
    return InvalidArgumentError(
        fmt::format("the partition plan is for {} ranks, the "
                    "communicator has {}",
                    plan.world_size(), comm.size()));
  }
  if (options.store.paths.empty()) {
    return InvalidArgumentError("optimizer swapper: no nvme_path given");
  }
  if (options.gradient_accumulation_steps < 1) {
    return InvalidArgumentError(fmt::format("gradient_accumulation_steps {} must be >= 1",
                                            options.gradient_accumulation_steps));
  }
  return OkStatus();
}

// Sizes the pool for the mode (at least `min_buffers` buffers of the largest sub-group) and
// creates it; `*pipelined`: it holds the pipelined swapper's buffers (WARN if asked but not).
Result<std::unique_ptr<BufferPool>> CreatePool(const SwapperOptions& options,
                                               std::uint64_t max_numel, std::uint64_t alignment,
                                               std::uint64_t min_buffers, bool* pipelined) {
  const std::uint64_t buffer_alignment = std::max<std::uint64_t>(alignment, 4096);
  const std::uint64_t buffer_bytes = AlignUp(max_numel * sizeof(float), buffer_alignment);
  // Pool: the mode decides the minimum number of buffers.
  const bool want_pipeline = options.pipeline_read || options.pipeline_write;
  const std::uint64_t pipeline_buffers =
      PipelinedOptimizerSwapper::MinBuffers(options.state_format);
  std::uint64_t count = 0;
  if (options.pinned_budget_bytes > 0) {
    count = options.pinned_budget_bytes / buffer_bytes;
  } else {
    count = options.buffer_count > 0 ? options.buffer_count
                                     : (want_pipeline ? pipeline_buffers : min_buffers);
  }
  if (count < min_buffers) {
    const std::uint64_t budget =
        options.pinned_budget_bytes > 0 ? options.pinned_budget_bytes : count * buffer_bytes;
    return ResourceExhaustedError(fmt::format(
        "optimizer swapper: the pool budget {} ({} bytes) holds {} swap buffers of {} (the "
        "largest sub-group, {} elements); a step with {} state needs at least {} ({} to pipeline): "
        "raise "
        "zinf.pinned_budget_bytes to at least {} bytes ({}) or lower sub_group_size",
        FormatBytes(budget), budget, count, FormatBytes(buffer_bytes), max_numel,
        StateFormatName(options.state_format), min_buffers, pipeline_buffers,
        min_buffers * buffer_bytes, FormatBytes(min_buffers * buffer_bytes)));
  }
  *pipelined = want_pipeline && count >= pipeline_buffers;
  if (want_pipeline && !*pipelined) {
    ZINF_LOG_WARN(
        "optimizer swapper: pipeline_read/pipeline_write need {} swap buffers of {} ({}), the "
        "pool holds {}: stepping synchronously; raise zinf.pinned_budget_bytes to pipeline",
        pipeline_buffers, FormatBytes(buffer_bytes), FormatBytes(pipeline_buffers * buffer_bytes),
        count);
  }
  return BufferPool::Create(BufferPoolOptions{.budget_bytes = options.pinned_budget_bytes,
                                              .buffer_count = count,
                                              .buffer_bytes = buffer_bytes,
                                              .alignment = buffer_alignment,
                                              .pin_memory = options.pin_memory});
}

// Creates the engine for `role` (wrapped by options.engine_wrapper) with the pool's buffers
// registered.
Result<std::unique_ptr<storage::IoEngine>> MakeEngine(const SwapperOptions& options,
                                                      EngineRole role, BufferPool& pool) {
  ZINF_ASSIGN_OR_RETURN(
      std::unique_ptr<storage::IoEngine> engine,
      storage::CreateIoEngine(options.engine, options.aio, options.store.paths.front()));
  if (options.engine_wrapper) {
    ZINF_ASSIGN_OR_RETURN(engine, options.engine_wrapper(role, std::move(engine)));
  }
  ZINF_RETURN_IF_ERROR(engine->RegisterBuffers(pool.AllBuffers()));
  return engine;
}

// options.accumulation, with kAuto resolved when gradients are swapped: in memory if the
// partition's gradient fits accumulation_memory_limit_bytes.
GradientAccumulation ResolveAccumulation(const SwapperOptions& options,
                                         std::uint64_t partition_numel) {
  const std::uint64_t partition_bytes = partition_numel * sizeof(float);
  if (options.swap_gradients && options.accumulation == GradientAccumulation::kAuto) {
    return partition_bytes <= options.accumulation_memory_limit_bytes
               ? GradientAccumulation::kInMemory
               : GradientAccumulation::kReadAddWrite;
  }
  return options.accumulation;
}

// Each sub-group's swap info; with gradients on disk, also its gradient split and "grad<i>".
Result<std::vector<SubGroupSwapInfo>> MakeSwapInfos(const partition::SubGroupPlan& sub_groups,
                                                    std::uint64_t alignment, StateFormat format,
                                                    bool gradients_on_disk,
                                                    std::uint64_t min_swap_numel) {
  const std::uint64_t alignment_elems = std::max<std::uint64_t>(alignment / sizeof(float), 1);
  std::vector<SubGroupSwapInfo> infos;
  for (const partition::SubGroup& sub_group : sub_groups.sub_groups()) {
    SubGroupSwapInfo info;
    info.sub_group = sub_group;
    info.io_size_bytes = AlignUp(sub_group.numel * sizeof(float), alignment);
    if (format == StateFormat::kQ8) {
      info.moments_io_bytes = AlignUp(Q8MomentsLayout::For(sub_group.numel).bytes, alignment);
      // A pool buffer holds one fp32 tensor of the sub-group: the moments must fit in it.
      ZINF_CHECK(info.moments_io_bytes <= std::max<std::uint64_t>(info.io_size_bytes, 4096),
                 "q8 moments of {} elements: {} bytes", sub_group.numel, info.moments_io_bytes);
    }
    if (gradients_on_disk) {
      ZINF_ASSIGN_OR_RETURN(
          partition::GradientSwapSplit split,
          partition::SplitGradientForSwap(sub_group, alignment_elems, min_swap_numel));
      info.swapped_gradients = std::move(split.swapped);
      info.unswapped_gradients = std::move(split.unswapped);
      info.gradient_name = fmt::format("grad{}", sub_group.index);
    }
    infos.push_back(std::move(info));
  }
  return infos;
}

// The store's tensors: the slot tensors of every slot (sized for the largest sub-group), then
// the swapped gradients. Slot tensor names as OptimizerSwapper::SlotTensorName.
std::vector<storage::TensorSpec> StoreSpecs(std::size_t num_slots, StateFormat format,
                                            std::uint64_t max_numel, std::uint64_t alignment,
                                            const std::vector<SubGroupSwapInfo>& infos) {
  std::vector<storage::TensorSpec> specs;
  const std::uint64_t fp32_bytes = AlignUp(max_numel * sizeof(float), alignment);
  for (std::size_t slot = 0; slot < num_slots; ++slot) {
    specs.push_back({fmt::format("slot{}/fp32", slot), fp32_bytes});
    if (format == StateFormat::kQ8) {
      specs.push_back({fmt::format("slot{}/moments", slot),
                       AlignUp(Q8MomentsLayout::For(max_numel).bytes, alignment)});
    } else {
      specs.push_back({fmt::format("slot{}/exp_avg", slot), fp32_bytes});
      specs.push_back({fmt::format("slot{}/exp_avg_sq", slot), fp32_bytes});
    }
  }
  for (const SubGroupSwapInfo& info : infos) {
    if (info.has_gradients()) specs.push_back({info.gradient_name, info.io_size_bytes});
  }
  return specs;
}

// Collective: reclaims stale stores (if asked), checks every node's space, reserves `store`.
Status ReserveStore(const comm::Communicator& comm, const storage::SwapStoreOptions& options,
                    storage::SwapStore& store, const std::vector<storage::TensorSpec>& specs,
                    const std::string& on_host) {
  // Every rank's store is open (and locked): stores of killed runs on this node's swap paths
  // can be told apart now, and removing them frees space before the preflight counts it.
  // reclaim_stale is the same on every rank (one config), so all ranks take this branch.
  if (options.reclaim_stale) {
    ZINF_RETURN_IF_ERROR(ReclaimStaleStores(comm, options));
  }
  ZINF_RETURN_IF_ERROR(PreflightSpace(comm, options, specs));
  return comm.AgreeOnStatus(Annotate(store.Reserve(specs), on_host + "reserve the swap store: "));
}

// Logs the gradient swapper's mode and the gradient it keeps in host memory per rank.
void LogGradientSwapper(GradientAccumulation accumulation, int gradient_accumulation_steps,
                        std::uint64_t partition_numel, const std::vector<SubGroupSwapInfo>& infos) {
  std::uint64_t extra_bytes = 0;
  if (accumulation == GradientAccumulation::kInMemory) {
    extra_bytes = partition_numel * sizeof(float);
  } else {
    for (const SubGroupSwapInfo& info : infos) {
      for (const partition::GradientPiece& piece : info.unswapped_gradients) {
        extra_bytes += piece.numel * sizeof(float);
      }
    }
  }
  ZINF_LOG_INFO(
      "gradient swapper: {} accumulation over {} micro-batches ({} of gradient in "
      "host memory per rank{})",
      GradientAccumulationName(accumulation), gradient_accumulation_steps, FormatBytes(extra_bytes),
      accumulation == GradientAccumulation::kInMemory
          ? ": the partition gradient fits accumulation_memory_limit_bytes"
          : ": unswapped remainders; swapped pieces are read, added and written");
}

// Logs (rank 0) the mode, sub-groups, pool size, engines and store of a new swapper.
void LogSwapper(OptimizerSwapper& swapper, const std::string& engine_name, bool pipelined,
                std::span<const storage::TensorSpec> specs) {
  std::uint64_t disk_bytes = 0;
  for (const storage::TensorSpec& spec : specs) disk_bytes += spec.size_bytes;
  const BufferPool& pool = swapper.pool();
  ZINF_LOG_INFO(
      "optimizer swapper: {} ({} engine{}), {} state ({:.2f} bytes per element each way per "
      "step), {} sub-groups of <= {} elements per rank; pool {} x {} = {} (budget {}, pinned: "
      "{}); swap store {} per rank on {} ({} slots, alignment {})",
      swapper.mode_name(), engine_name, pipelined ? "s, read + write" : "",
      StateFormatName(swapper.state_format()), swapper.StateIoBytesPerElement(),
      swapper.num_sub_groups(), swapper.sub_groups().max_sub_group_numel(), pool.buffer_count(),
      FormatBytes(pool.buffer_bytes()), FormatBytes(pool.total_bytes()),
      FormatBytes(pool.budget_bytes()), pool.pinned() ? "yes" : "no", FormatBytes(disk_bytes),
      fmt::join(swapper.options().store.paths, ","), swapper.num_sub_groups() + 1,
      swapper.store().alignment());
}

}  // namespace

Status OptimizerSwapper::Parts::SetUpLocally(Parts& parts, const comm::Communicator& comm,
                                             const partition::PartitionPlan& plan,
                                             const SwapperOptions& options, LocalSetup* setup) {
  ZINF_RETURN_IF_ERROR(CheckOptions(plan, comm, options));
  ZINF_ASSIGN_OR_RETURN(partition::SubGroupPlan sub_groups,
                        partition::SubGroupPlan::Create(plan, comm.rank(), options.sub_group_size));
  parts.plan = plan;
  ZINF_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::Create(options.adam));
  parts.adam.emplace(std::move(adam));
  ZINF_ASSIGN_OR_RETURN(parts.store, storage::SwapStore::Open(parts.options.store));
  const std::uint64_t alignment = std::max<std::uint64_t>(parts.store->alignment(), 1);
  const std::uint64_t max_numel = sub_groups.max_sub_group_numel();
  ZINF_ASSIGN_OR_RETURN(parts.pool,
                        CreatePool(options, max_numel, alignment,
                                   BuffersPerSubGroup(options.state_format), &setup->pipelined));
  ZINF_ASSIGN_OR_RETURN(parts.read_engine, MakeEngine(options, EngineRole::kRead, *parts.pool));
  if (setup->pipelined) {
    ZINF_ASSIGN_OR_RETURN(parts.write_engine, MakeEngine(options, EngineRole::kWrite, *parts.pool));
  }
  setup->accumulation = ResolveAccumulation(options, plan.partition_numel());
  const bool gradients_on_disk =
      options.swap_gradients && setup->accumulation == GradientAccumulation::kReadAddWrite;
  if (gradients_on_disk) {
    ZINF_ASSIGN_OR_RETURN(setup->gradient_engine,
                          MakeEngine(options, EngineRole::kGradient, *parts.pool));
  }
  ZINF_ASSIGN_OR_RETURN(parts.infos, MakeSwapInfos(sub_groups, alignment, options.state_format,
                                                   gradients_on_disk, options.min_swap_numel));
  parts.sub_groups.emplace(std::move(sub_groups));
  // One spare slot suffices in both modes: each engine has at most one sub-group in flight.
  parts.num_slots = parts.infos.size() + 1;
  setup->specs =
      StoreSpecs(parts.num_slots, options.state_format, max_numel, alignment, parts.infos);
  return OkStatus();
}

Result<std::unique_ptr<OptimizerSwapper>> CreateOptimizerSwapper(
    const comm::Communicator& comm, const partition::PartitionPlan& plan,
    const SwapperOptions& options) {
  ZINF_ASSIGN_OR_RETURN(comm::Communicator dup, comm.Dup());
  OptimizerSwapper::Parts parts;
  parts.options = options;
  parts.options.store.world_rank = dup.rank();
  LocalSetup setup;
  // Store, engine and pool errors are about this node's disks and memory: name the host, so a
  // multi-node job says which node lacks its nvme_path.
  const std::string on_host =
      fmt::format("optimizer swapper on host {}: ", dup.topology().hostname);
  ZINF_RETURN_IF_ERROR(dup.AgreeOnStatus(
      Annotate(OptimizerSwapper::Parts::SetUpLocally(parts, dup, plan, options, &setup), on_host)));
  ZINF_RETURN_IF_ERROR(ReserveStore(dup, parts.options.store, *parts.store, setup.specs, on_host));

  const std::string engine_name(parts.read_engine->name());
  parts.comm.emplace(std::move(dup));
  std::unique_ptr<OptimizerSwapper> swapper;
  if (setup.pipelined) {
    swapper.reset(new PipelinedOptimizerSwapper(std::move(parts)));
  } else {
    swapper.reset(new PartitionedOptimizerSwapper(std::move(parts)));
  }
  if (setup.gradient_engine ||
      (options.swap_gradients && setup.accumulation == GradientAccumulation::kInMemory)) {
    swapper->gradient_swapper_ = std::make_unique<GradientSwapper>(
        setup.accumulation, options.gradient_accumulation_steps, &swapper->infos_,
        plan.partition_numel(), swapper->store_.get(), std::move(setup.gradient_engine),
        swapper->pool_.get(), &swapper->timers_);
    LogGradientSwapper(setup.accumulation, options.gradient_accumulation_steps,
                       plan.partition_numel(), swapper->infos_);
  }
  LogSwapper(*swapper, engine_name, setup.pipelined, setup.specs);
  return swapper;
}

}  // namespace zinf::swapper
