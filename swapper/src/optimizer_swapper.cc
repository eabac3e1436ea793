#include "zinf/swapper/optimizer_swapper.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <set>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "optimizer_swapper_internal.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/units.h"
#include "zinf/swapper/gradient_swapper.h"
#include "zinf/swapper/partitioned_optimizer_swapper.h"
#include "zinf/swapper/pipelined_optimizer_swapper.h"

namespace zinf::swapper {
namespace {

constexpr StateTensor kStateTensors[] = {StateTensor::kFp32, StateTensor::kExpAvg,
                                         StateTensor::kExpAvgSq};

std::span<const std::byte> ConstBytes(std::span<std::byte> b) { return {b.data(), b.size()}; }

// pool.Allocate, where a count of 0 (everything goes to resident memory) is an empty lease.
Result<PoolLease> AllocateUpTo(BufferPool& pool, std::uint64_t numel, std::size_t count) {
  if (count == 0) return PoolLease();
  return pool.Allocate(numel, count);
}

// Slot tensors per sub-group, and the I/O bytes of slot tensor `tensor` of a sub-group, in a
// state format (the members num_slot_tensors and SlotTensorIoBytes, before a swapper exists).
std::size_t NumSlotTensors(StateFormat format) {
  return format == StateFormat::kQ8 ? 2 : kNumStateTensors;
}
std::uint64_t TensorIoBytes(const SubGroupSwapInfo& info, StateFormat format, std::size_t tensor) {
  return format == StateFormat::kQ8 && tensor == 1 ? info.moments_io_bytes : info.io_size_bytes;
}

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
  ZINF_RETURN_IF_ERROR(
      comm.AgreeOnStatus(planned.has_value() ? OkStatus() : Status(planned.error())));
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

// Creates the backend for `role` (wrapped by options.io_backend_wrapper) with the pool's buffers
// registered (none without a pool). Defined with Create's parts below.
Result<std::unique_ptr<storage::IoBackend>> MakeIoBackend(const SwapperOptions& options,
                                                      IoRole role, BufferPool* pool);

}  // namespace

std::string_view StateTensorName(StateTensor which) {
  switch (which) {
    case StateTensor::kFp32:
      return "fp32";
    case StateTensor::kExpAvg:
      return "exp_avg";
    case StateTensor::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}

std::string_view GradientAccumulationName(GradientAccumulation mode) {
  switch (mode) {
    case GradientAccumulation::kAuto:
      return "auto";
    case GradientAccumulation::kInMemory:
      return "in-memory";
    case GradientAccumulation::kReadAddWrite:
      return "read-add-write";
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

std::uint64_t SubGroupStateBytes(std::uint64_t numel, StateFormat format, std::uint64_t alignment) {
  const std::uint64_t fp32 = AlignUp(numel * sizeof(float), alignment);
  if (format == StateFormat::kQ8) {
    return fp32 + AlignUp(Q8MomentsLayout::For(numel).bytes, alignment);
  }
  return kNumStateTensors * fp32;
}

std::size_t OptimizerSwapper::BuffersPerSubGroup(StateFormat format) {
  return format == StateFormat::kQ8 ? 3 : 4;
}

std::size_t OptimizerSwapper::num_slot_tensors() const {
  return NumSlotTensors(options_.state_format);
}

std::string OptimizerSwapper::SlotTensorName(std::size_t slot, std::size_t tensor) const {
  if (options_.state_format == StateFormat::kQ8 && tensor == 1) {
    return fmt::format("slot{}/moments", slot);
  }
  return fmt::format("slot{}/{}", slot, StateTensorName(static_cast<StateTensor>(tensor)));
}

std::uint64_t OptimizerSwapper::SlotTensorIoBytes(std::size_t sub_group, std::size_t tensor) const {
  return TensorIoBytes(infos_.at(sub_group), options_.state_format, tensor);
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
  resident_ = std::move(parts.resident);
  resident_.resize(n);
  resident_spare_ = std::move(parts.resident_spare);
  resident_spare_.resize(n);
  damaged_.assign(n, false);
  // Slots are numbered over the swapped sub-groups; the rest of the slots are spare.
  slot_of_.assign(n, 0);
  std::size_t next_slot = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!resident(i)) slot_of_[i] = next_slot++;
  }
  for (std::size_t s = parts.num_slots; s-- > next_slot;) spare_slots_.push_back(s);
  last_step_.assign(n, 0);
  speculated_.assign(n, std::nullopt);
}

OptimizerSwapper::~OptimizerSwapper() {
  // The backends drain in their destructors; they must go before the pool and the store that
  // their requests point into.
  speculation_.reset();
  gradient_swapper_.reset();
  write_engine_.reset();
  read_engine_.reset();
  if (store_) {
    Status closed = store_->Close();
    if (!closed)
      ZINF_LOG_WARN("optimizer swapper: closing the swap store: {}", closed.error().ToString());
  }
}

Status OptimizerSwapper::Close() {
  if (gradient_swapper_) ZINF_RETURN_IF_ERROR(gradient_swapper_->Flush());
  return store_ ? store_->Close() : OkStatus();
}

std::uint64_t OptimizerSwapper::StateIoBytesPerStep() const {
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    if (resident(i)) continue;
    for (std::size_t t = 0; t < num_slot_tensors(); ++t) bytes += SlotTensorIoBytes(i, t);
  }
  return bytes;
}

std::size_t OptimizerSwapper::num_resident() const {
  std::size_t count = 0;
  for (std::size_t i = 0; i < infos_.size(); ++i) count += resident(i) ? 1 : 0;
  return count;
}

std::uint64_t OptimizerSwapper::resident_bytes() const {
  std::uint64_t bytes = 0;
  for (const auto& memory : resident_) {
    for (const storage::AlignedBuffer& buffer : memory) bytes += buffer.size();
  }
  return bytes;
}

storage::SwapStore::IoCounters OptimizerSwapper::io_counters() const {
  return store_ ? store_->io_counters() : storage::SwapStore::IoCounters{};
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

Status OptimizerSwapper::IoBatch::Wait(storage::IoBackend& backend) {
  Status first = OkStatus();
  std::unordered_set<std::uint64_t> completed;
  std::vector<storage::IoCompletion> done;
  while (backend.pending() > 0) {
    done.clear();
    Status status = backend.Wait(backend.pending(), &done);
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

Status OptimizerSwapper::IoBatch::WaitFor(storage::IoBackend& backend, Completions* seen) {
  auto all_done = [&] {
    return std::ranges::all_of(ids_, [&](std::uint64_t id) { return seen->ids.contains(id); });
  };
  std::vector<storage::IoCompletion> done;
  auto wait = [&](std::size_t count) {
    done.clear();
    Status status = backend.Wait(count, &done);
    for (const storage::IoCompletion& c : done) seen->ids.insert(c.id);
    if (!status && !seen->failure) seen->failure = std::move(status).error();
  };
  while (!all_done() && !seen->failure && backend.pending() > 0) wait(1);
  if (!all_done()) {
    while (backend.pending() > 0) wait(backend.pending());
  }
  std::vector<std::string> failed;
  for (std::size_t i = 0; i < ids_.size(); ++i) {
    if (!seen->ids.contains(ids_[i]) &&
        std::find(failed.begin(), failed.end(), labels_[i]) == failed.end()) {
      failed.push_back(labels_[i]);
    }
  }
  ids_.clear();
  labels_.clear();
  if (failed.empty()) return OkStatus();
  const Error error =
      seen->failure ? *seen->failure : InternalError("the I/O backend lost a request");
  return error.WithContext(fmt::format("{}: ", fmt::join(failed, ", ")));
}

// ---- Shared machinery ----

std::span<float> OptimizerSwapper::StateBuffers::floats(std::size_t t) const {
  return {reinterpret_cast<float*>(tensors[t].data()), tensors[t].size() / sizeof(float)};
}

OptimizerSwapper::StateBuffers OptimizerSwapper::LeaseBuffers(const PoolLease& lease) const {
  StateBuffers buffers;
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) buffers.tensors[t] = lease.bytes(t);
  return buffers;
}

OptimizerSwapper::StateBuffers OptimizerSwapper::ResidentBuffers(std::size_t sub_group) const {
  StateBuffers buffers;
  const std::vector<storage::AlignedBuffer>& memory = resident_[sub_group];
  for (std::size_t t = 0; t < memory.size(); ++t) {
    buffers.tensors[t] =
        std::span<std::byte>(const_cast<std::byte*>(memory[t].data()), memory[t].size());
  }
  return buffers;
}

Status OptimizerSwapper::SubmitStateRead(std::size_t sub_group, std::size_t tensor,
                                         std::span<std::byte> buffer, storage::IoBackend& backend,
                                         IoBatch* batch) {
  const std::string name = SlotTensorName(slot_of_[sub_group], tensor);
  const std::uint64_t bytes = SlotTensorIoBytes(sub_group, tensor);
  ZINF_ASSIGN_OR_RETURN(
      std::vector<std::uint64_t> ids,
      Annotate(store_->SubmitReadRange(name, 0, bytes, buffer.first(bytes), backend),
               fmt::format("{}: ", name)));
  batch->Add(ids, name);
  return OkStatus();
}

Status OptimizerSwapper::SubmitStateReads(std::size_t sub_group, const StateBuffers& buffers,
                                          storage::IoBackend& backend, IoBatch* batch) {
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) {
    ZINF_RETURN_IF_ERROR(SubmitStateRead(sub_group, t, buffers.tensors[t], backend, batch));
  }
  return OkStatus();
}

Status OptimizerSwapper::VerifyStateReads(std::size_t sub_group,
                                          const StateBuffers& buffers) const {
  if (!options_.store.verify_swap) return OkStatus();
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) {
    const std::string name = SlotTensorName(slot_of_[sub_group], t);
    ZINF_RETURN_IF_ERROR(Annotate(store_->VerifyRead(name, ConstBytes(buffers.tensors[t].first(
                                                               SlotTensorIoBytes(sub_group, t)))),
                                  fmt::format("{}: ", name)));
  }
  return OkStatus();
}

Result<std::size_t> OptimizerSwapper::SubmitStateWrites(std::size_t sub_group,
                                                        const StateBuffers& buffers,
                                                        storage::IoBackend& backend,
                                                        std::span<IoBatch> batches,
                                                        std::span<const std::size_t> order) {
  ZINF_CHECK(!spare_slots_.empty(), "no spare slot for sub-group {}", sub_group);
  ZINF_CHECK(order.empty() || order.size() == num_slot_tensors(), "{} tensors ordered of {}",
             order.size(), num_slot_tensors());
  const std::size_t slot = spare_slots_.back();
  spare_slots_.pop_back();
  for (std::size_t k = 0; k < num_slot_tensors(); ++k) {
    const std::size_t t = order.empty() ? k : order[k];
    const std::string name = SlotTensorName(slot, t);
    const std::uint64_t bytes = SlotTensorIoBytes(sub_group, t);
    Result<std::vector<std::uint64_t>> ids = store_->SubmitWriteRange(
        name, 0, bytes, ConstBytes(buffers.tensors[t].first(bytes)), backend);
    if (!ids) {
      // The caller drains the batches; the slot is spare again whatever happened to the others.
      Abandon(slot);
      return std::move(ids).error().WithContext(fmt::format("{}: ", name));
    }
    batches[batches.size() == 1 ? 0 : t].Add(*ids, name);
  }
  return slot;
}

void OptimizerSwapper::CopyState(std::size_t sub_group, const StateBuffers& from,
                                 const StateBuffers& to) const {
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) {
    if (from.tensors[t].data() == to.tensors[t].data()) continue;
    std::memcpy(to.tensors[t].data(), from.tensors[t].data(), SlotTensorIoBytes(sub_group, t));
  }
}

Status OptimizerSwapper::WriteAndCommit(std::size_t sub_group, std::int64_t step,
                                        const StateBuffers& buffers, const std::string& context) {
  if (resident(sub_group)) {
    CopyState(sub_group, buffers, ResidentBuffers(sub_group));
    last_step_[sub_group] = step;
    return OkStatus();
  }
  IoBatch batch;
  Result<std::size_t> slot =
      SubmitStateWrites(sub_group, buffers, write_engine(), std::span<IoBatch>(&batch, 1));
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

// ---- Speculation ----

// The speculation's backends (its thread's: the swapper's belong to the swapper's thread) and the
// sub-group whose writes are in flight, with the pool buffers they write from.
struct OptimizerSwapper::SpeculationIo {
  std::unique_ptr<storage::IoBackend> read;
  std::unique_ptr<storage::IoBackend> write;
  // A sub-group's state being read ahead (Speculate's `next`), or written.
  struct InFlight {
    std::size_t sub_group = 0;
    std::size_t slot = 0;  // written: the spare slot taken
    std::int64_t step = 0;
    PoolLease lease;
    IoBatch batch;
    Status submitted = OkStatus();  // read ahead: a failed submission, for the call that uses it
  };
  std::optional<InFlight> reading;
  std::optional<InFlight> writing;
  // The backends drain before the lease goes back to the pool.
  ~SpeculationIo() {
    write.reset();
    read.reset();
  }
};

bool OptimizerSwapper::speculable(std::size_t sub_group) const {
  if (resident(sub_group)) return !resident_spare_.at(sub_group).empty();
  return store_ != nullptr && spare_slots_.size() > 1;
}

std::size_t OptimizerSwapper::num_speculated() const {
  return static_cast<std::size_t>(
      std::ranges::count_if(speculated_, [](const auto& s) { return s.has_value(); }));
}

Status OptimizerSwapper::Speculate(std::int64_t step, std::size_t sub_group,
                                   std::span<const float> grad, const StepOptions& options,
                                   std::span<float> weights, std::optional<std::size_t> next) {
  const std::string context = fmt::format("speculative {}", StepContext(step, sub_group));
  ZINF_RETURN_IF_ERROR(CheckSpeculable(step, sub_group, grad, weights, context));
  if (resident(sub_group)) {
    return SpeculateResident(step, sub_group, grad, options, weights, context);
  }
  // Step keeps one spare slot for itself.
  if (spare_slots_.size() < 2) {
    return FailedPreconditionError(context + "no spare slot left for a speculated sub-group");
  }
  ZINF_RETURN_IF_ERROR(StartSpeculationIo());
  ZINF_ASSIGN_OR_RETURN(PoolLease lease, SwapInSpeculated(sub_group, context));
  const StateBuffers buffers = LeaseBuffers(lease);
  ReadAhead(sub_group, next);
  ZINF_RETURN_IF_ERROR(Annotate(Compute(step, sub_group, buffers, grad, options), context));
  if (!weights.empty()) {
    std::ranges::copy(buffers.floats(0).first(infos_[sub_group].sub_group.numel), weights.begin());
  }
  return SwapOutSpeculated(step, sub_group, std::move(lease), context);
}

Status OptimizerSwapper::CheckSpeculable(std::int64_t step, std::size_t sub_group,
                                         std::span<const float> grad, std::span<float> weights,
                                         const std::string& context) const {
  if (sub_group >= infos_.size() || speculated(sub_group) || last_step_[sub_group] >= step ||
      (resident(sub_group) && resident_spare_[sub_group].empty()) ||
      (!resident(sub_group) && !store_)) {
    return FailedPreconditionError(
        context + "not a speculable sub-group behind the step, or speculated already");
  }
  const std::size_t numel = infos_[sub_group].sub_group.numel;
  if (grad.size() != numel || (!weights.empty() && weights.size() != numel)) {
    return InvalidArgumentError(
        fmt::format("{}gradient of {} and weights of {} elements, {} expected", context,
                    grad.size(), weights.size(), numel));
  }
  return OkStatus();
}

Status OptimizerSwapper::SpeculateResident(std::int64_t step, std::size_t sub_group,
                                           std::span<const float> grad, const StepOptions& options,
                                           std::span<float> weights, const std::string& context) {
  // The second copy: the committed state copied in, stepped there (the swapper's thread only
  // reads the first copy meanwhile).
  ZINF_RETURN_IF_ERROR(Annotate(CheckNotDamaged(sub_group), context));
  StateBuffers spare;
  for (std::size_t t = 0; t < num_slot_tensors(); ++t) {
    spare.tensors[t] = resident_spare_[sub_group][t].span();
  }
  CopyState(sub_group, ResidentBuffers(sub_group), spare);
  ZINF_RETURN_IF_ERROR(Annotate(Compute(step, sub_group, spare, grad, options), context));
  if (!weights.empty()) {
    std::ranges::copy(spare.floats(0).first(infos_[sub_group].sub_group.numel), weights.begin());
  }
  speculated_[sub_group] = Speculated{.slot = kResidentSlot, .step = step};
  return OkStatus();
}

Status OptimizerSwapper::StartSpeculationIo() {
  if (speculation_) return OkStatus();
  auto io = std::make_unique<SpeculationIo>();
  ZINF_ASSIGN_OR_RETURN(io->read, MakeIoBackend(options_, IoRole::kRead, nullptr));
  ZINF_ASSIGN_OR_RETURN(io->write, MakeIoBackend(options_, IoRole::kWrite, nullptr));
  speculation_ = std::move(io);
  return OkStatus();
}

Result<PoolLease> OptimizerSwapper::SwapInSpeculated(std::size_t sub_group,
                                                     const std::string& context) {
  SpeculationIo& io = *speculation_;
  const std::size_t n = num_slot_tensors();
  // Read ahead by the last call, or read now (with the pool's buffers for the writes in flight
  // too when it has them, else after those writes ended).
  PoolLease lease;
  IoBatch reads;
  Status submitted = OkStatus();
  if (io.reading && io.reading->sub_group == sub_group) {
    lease = std::move(io.reading->lease);
    reads = std::move(io.reading->batch);
    submitted = std::move(io.reading->submitted);
    io.reading.reset();
  } else {
    DropReadAhead();
    if (io.writing && pool_->free_count() < n) ZINF_RETURN_IF_ERROR(FinishSpeculation());
    ZINF_ASSIGN_OR_RETURN(lease, pool_->Allocate(sub_groups_.max_sub_group_numel(), n));
    submitted = SubmitStateReads(sub_group, LeaseBuffers(lease), *io.read, &reads);
  }
  const Status read = reads.Wait(*io.read);
  ZINF_RETURN_IF_ERROR(Annotate(submitted, context + "swap-in "));
  ZINF_RETURN_IF_ERROR(Annotate(read, context + "swap-in "));
  ZINF_RETURN_IF_ERROR(
      Annotate(VerifyStateReads(sub_group, LeaseBuffers(lease)), context + "swap-in "));
  return lease;
}

void OptimizerSwapper::ReadAhead(std::size_t sub_group, std::optional<std::size_t> next) {
  SpeculationIo& io = *speculation_;
  const std::size_t n = num_slot_tensors();
  if (!next || *next >= infos_.size() || resident(*next) || speculated(*next) ||
      *next == sub_group || pool_->free_count() < n) {
    return;
  }
  Result<PoolLease> ahead = pool_->Allocate(sub_groups_.max_sub_group_numel(), n);
  if (!ahead) return;
  SpeculationIo::InFlight reading;
  reading.sub_group = *next;
  reading.lease = std::move(*ahead);
  // A failed submission is the next call's error (its batch holds what was submitted).
  reading.submitted =
      SubmitStateReads(*next, LeaseBuffers(reading.lease), *io.read, &reading.batch);
  io.reading = std::move(reading);
}

Status OptimizerSwapper::SwapOutSpeculated(std::int64_t step, std::size_t sub_group,
                                           PoolLease lease, const std::string& context) {
  SpeculationIo& io = *speculation_;
  // One sub-group's writes in flight at a time: the last one's end before these begin.
  ZINF_RETURN_IF_ERROR(FinishWrites());
  SpeculationIo::InFlight writing;
  writing.sub_group = sub_group;
  writing.step = step;
  writing.lease = std::move(lease);
  Result<std::size_t> slot = SubmitStateWrites(sub_group, LeaseBuffers(writing.lease), *io.write,
                                               std::span<IoBatch>(&writing.batch, 1));
  if (!slot) {
    (void)writing.batch.Wait(*io.write);
    return std::move(slot).error().WithContext(context + "swap-out ");
  }
  writing.slot = *slot;
  io.writing = std::move(writing);
  return OkStatus();
}

Status OptimizerSwapper::FinishSpeculation() {
  DropReadAhead();
  return FinishWrites();
}

void OptimizerSwapper::DropReadAhead() {
  if (!speculation_ || !speculation_->reading) return;
  (void)speculation_->reading->batch.Wait(*speculation_->read);
  speculation_->reading.reset();
}

Status OptimizerSwapper::FinishWrites() {
  if (!speculation_ || !speculation_->writing) return OkStatus();
  SpeculationIo& io = *speculation_;
  SpeculationIo::InFlight writing = std::move(*io.writing);
  io.writing.reset();
  Status written = writing.batch.Wait(*io.write);
  if (!written) {
    Abandon(writing.slot);
    return Annotate(std::move(written), fmt::format("speculative {}swap-out ",
                                                    StepContext(writing.step, writing.sub_group)));
  }
  speculated_[writing.sub_group] = Speculated{.slot = writing.slot, .step = writing.step};
  return OkStatus();
}

void OptimizerSwapper::CommitSpeculated(std::size_t sub_group) {
  ZINF_CHECK(speculated(sub_group), "sub-group {} has no speculated state", sub_group);
  const Speculated s = *speculated_[sub_group];
  speculated_[sub_group].reset();
  if (resident(sub_group)) {
    std::swap(resident_[sub_group], resident_spare_[sub_group]);
    last_step_[sub_group] = s.step;
    return;
  }
  Commit(sub_group, s.slot, s.step);
}

void OptimizerSwapper::DiscardSpeculations() {
  (void)FinishSpeculation();
  for (std::optional<Speculated>& s : speculated_) {
    if (s && s->slot != kResidentSlot) Abandon(s->slot);
    s.reset();
  }
}

GradientSource GradientSource::FromView(View view) {
  GradientSource source;
  source.view_ = std::move(view);
  return source;
}

Result<std::span<const float>> GradientSource::Get(const partition::SubGroup& sub_group,
                                                   std::span<float> scratch) const {
  if (!view_) {
    ZINF_RETURN_IF_ERROR(FillInto(sub_group, scratch));
    return std::span<const float>(scratch.first(sub_group.numel));
  }
  ZINF_ASSIGN_OR_RETURN(const std::span<const float> grad, view_(sub_group));
  if (grad.size() != sub_group.numel) {
    return InvalidArgumentError(
        fmt::format("the gradient view of sub-group {} has {} elements; the sub-group has {}",
                    sub_group.index, grad.size(), sub_group.numel));
  }
  return grad;
}

Status GradientSource::FillInto(const partition::SubGroup& sub_group, std::span<float> out) const {
  out = out.first(sub_group.numel);
  if (fill_) return fill_(sub_group, out);
  if (!view_) {
    std::ranges::fill(out, 0.0f);
    return OkStatus();
  }
  ZINF_ASSIGN_OR_RETURN(const std::span<const float> grad, Get(sub_group, {}));
  std::ranges::copy(grad, out.begin());
  return OkStatus();
}

Result<std::span<const float>> OptimizerSwapper::Gradient(std::size_t sub_group,
                                                          const GradientSource& source,
                                                          std::span<float> scratch) {
  comm::ScopedTimer gradient(timers_, "swap_in_gradient");
  Result<std::span<const float>> grad = source.Get(infos_[sub_group].sub_group, scratch);
  if (!grad) return std::move(grad).error().WithContext("gradient: ");
  return grad;
}

Status OptimizerSwapper::Compute(std::int64_t step, std::size_t sub_group,
                                 const StateBuffers& buffers, std::span<const float> grad,
                                 const StepOptions& options) {
  comm::ScopedTimer timer(timers_, "optimizer_step");
  const std::size_t numel = infos_[sub_group].sub_group.numel;
  grad = grad.first(numel);
  // The groups' segments that meet [offset, offset + numel), from the sub-group's start.
  std::vector<AdamSegment> segments;
  if (!options.segments.empty()) {
    const std::uint64_t offset = infos_[sub_group].sub_group.partition_offset;
    auto it = std::ranges::upper_bound(options.segments, offset, {}, &AdamSegment::begin);
    if (it == options.segments.begin()) {
      return InvalidArgumentError("step segments do not start at partition offset 0");
    }
    segments.push_back({.begin = 0, .hyper = std::prev(it)->hyper});
    for (; it != options.segments.end() && it->begin < offset + numel; ++it) {
      segments.push_back({.begin = it->begin - offset, .hyper = it->hyper});
    }
  }
  const StepExtras extras{.grad_scale = options.grad_scale,
                          .lr = options.lr,
                          .betas = options.betas,
                          .segments = segments};
  const std::int64_t adam_step = options.adam_step > 0 ? options.adam_step : step;
  if (options_.state_format == StateFormat::kQ8) {
    const Q8Moments moments = ViewQ8Moments(buffers.tensors[1], Q8MomentsLayout::For(numel));
    return Annotate(adam_.StepQ8(adam_step, buffers.floats(0).first(numel), grad, moments.exp_avg,
                                 moments.exp_avg_sq, extras),
                    "adam (q8): ");
  }
  return Annotate(
      adam_.Step(adam_step, buffers.floats(0).first(numel), grad, buffers.floats(1).first(numel),
                 buffers.floats(2).first(numel), extras),
      "adam: ");
}

Status OptimizerSwapper::Sink(std::size_t sub_group, std::span<const float> fp32,
                              std::span<std::byte> scratch, const ParamSink& sink) {
  if (!sink) return OkStatus();
  const SubGroupSwapInfo& info = infos_[sub_group];
  const std::size_t numel = info.sub_group.numel;
  fp32 = fp32.first(numel);
  std::span<const std::uint16_t> bf16;
  if (options_.bf16_params) {
    ZINF_CHECK(scratch.size() >= numel * sizeof(std::uint16_t), "bf16 scratch of {} bytes",
               scratch.size());
    auto* out = reinterpret_cast<std::uint16_t*>(scratch.data());
    for (std::size_t i = 0; i < numel; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &fp32[i], sizeof(bits));
      out[i] = FloatBitsToBf16(bits);
    }
    bf16 = {out, numel};
  }
  return Annotate(sink(info.sub_group, fp32, bf16), "param sink: ");
}

Status OptimizerSwapper::StepResident(std::int64_t step, const GradientSource& source,
                                      const ParamSink& sink, const StepOptions& options,
                                      std::span<float> scratch, const StateBuffers& work,
                                      std::size_t limit) {
  for (std::size_t i = 0; i < infos_.size() && limit > 0; ++i) {
    if (!resident(i) || last_step_[i] >= step) continue;
    --limit;
    const std::string context = StepContext(step, i);
    ZINF_RETURN_IF_ERROR(Annotate(CheckNotDamaged(i), context));
    Result<std::span<const float>> grad = Gradient(i, source, scratch);
    if (!grad) return std::move(grad).error().WithContext(context);
    const StateBuffers memory = ResidentBuffers(i);
    if (options_.state_format == StateFormat::kQ8) {
      // The q8 encoder can refuse a non-finite moment after part of the state changed: step a
      // copy, so that a refused step leaves the committed state as it was.
      CopyState(i, memory, work);
      ZINF_RETURN_IF_ERROR(Annotate(Compute(step, i, work, *grad, options), context));
      ZINF_RETURN_IF_ERROR(WriteAndCommit(i, step, work, context));
    } else {
      // Adam on fp32 checks its arguments before it changes anything: in place is all or nothing.
      ZINF_RETURN_IF_ERROR(Annotate(Compute(step, i, memory, *grad, options), context));
      last_step_[i] = step;
    }
    ZINF_RETURN_IF_ERROR(
        Annotate(Sink(i, memory.floats(0), std::as_writable_bytes(scratch), sink), context));
  }
  return OkStatus();
}

std::size_t OptimizerSwapper::ResidentTodo(std::int64_t step) const {
  std::size_t n = 0;
  for (std::size_t i = 0; i < infos_.size(); ++i) n += resident(i) && last_step_[i] < step ? 1 : 0;
  return n;
}

Status OptimizerSwapper::CheckNotDamaged(std::size_t sub_group) const {
  if (!damaged_[sub_group]) return OkStatus();
  return FailedPreconditionError(fmt::format(
      "sub-group {} (resident in host memory) lost its state when writing it failed; write it "
      "again (restore a checkpoint)",
      sub_group));
}

std::vector<std::size_t> OptimizerSwapper::SwappedTodo(std::int64_t step) const {
  std::vector<std::size_t> todo;
  for (std::size_t i = 0; i < infos_.size(); ++i) {
    if (!resident(i) && last_step_[i] < step) todo.push_back(i);
  }
  return todo;
}

Status OptimizerSwapper::Step(std::int64_t step, const GradientSource& source,
                              const ParamSink& sink, const StepOptions& options) {
  // The caller's source is used where it is (not copied: its callable may hold state).
  GradientSource own;
  const GradientSource* gradient = &source;
  Status usable = OkStatus();
  if (source.empty() && gradient_swapper_) {
    own = gradient_swapper_->Source();
    gradient = &own;
  } else if (source.empty()) {
    usable = FailedPreconditionError(
        fmt::format("step {}: an empty gradient source stands for the gradient swapper's "
                    "gradient, and this swapper has none (swap_gradients is off); pass the "
                    "gradient (no sub-group took the step)",
                    step));
  }
  ZINF_RETURN_IF_ERROR(FlushGradientsCollective(step, std::move(usable)));
  return FinishStep(step, StepLocal(step, *gradient, sink, options));
}

Status OptimizerSwapper::FlushGradientsCollective(std::int64_t step, Status local) {
  if (local && gradient_swapper_) {
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
    // Two buffers stage a swapped sub-group's state; resident ones are written in place.
    ZINF_ASSIGN_OR_RETURN(PoolLease lease, AllocateUpTo(*pool_, sub_groups_.max_sub_group_numel(),
                                                        num_resident() == infos_.size() ? 0 : 2));
    // Buffer 1 holds the zero state of the moments: fp32 zeros, or q8 codes of zero with scale 0
    // (re-laid out per sub-group size).
    if (!lease.empty()) std::ranges::fill(lease.floats(1), 0.0f);
    for (std::size_t i = 0; i < infos_.size(); ++i) {
      const SubGroupSwapInfo& info = infos_[i];
      // A resident sub-group is written in place: a failure here fails the whole Initialize.
      const StateBuffers memory = resident(i) ? ResidentBuffers(i) : StateBuffers{};
      std::span<float> fp32 = resident(i) ? memory.floats(0) : lease.floats(0);
      std::fill(fp32.begin(), fp32.begin() + static_cast<std::ptrdiff_t>(info.io_size_bytes / 4),
                0.0f);
      std::span<float> values = fp32.first(info.sub_group.numel);
      if (initial_fp32) {
        ZINF_RETURN_IF_ERROR(Annotate(initial_fp32(info.sub_group.partition_offset, values),
                                      fmt::format("sub-group {}: initial weights: ", i)));
      }
      ZeroPadding(info.sub_group, values);
      StateBuffers buffers = memory;
      if (!resident(i)) {
        buffers.tensors.fill(lease.bytes(1));
        buffers.tensors[0] = lease.bytes(0);
      } else {
        for (std::size_t t = 1; t < num_slot_tensors(); ++t) {
          std::ranges::fill(buffers.tensors[t], std::byte{0});
        }
      }
      if (options_.state_format == StateFormat::kQ8) {
        // Only the bytes this sub-group's moments write: the codes of zero, scales 0.
        std::span<std::byte> moments_bytes = buffers.tensors[1].first(info.moments_io_bytes);
        std::ranges::fill(moments_bytes, std::byte{0});
        const Q8Moments moments =
            ViewQ8Moments(moments_bytes, Q8MomentsLayout::For(info.sub_group.numel));
        std::ranges::fill(moments.exp_avg.codes, q8::ZeroCode(q8::MapKind::kSigned));
        std::ranges::fill(moments.exp_avg_sq.codes, q8::ZeroCode(q8::MapKind::kUnsigned));
      }
      ZINF_RETURN_IF_ERROR(
          WriteAndCommit(i, 0, buffers, fmt::format("sub-group {}: initialize: ", i)));
      damaged_[i] = false;
    }
    return OkStatus();
  };
  return comm_.AgreeOnStatus(Annotate(local(), "initialize optimizer state: "));
}

Status OptimizerSwapper::ReadState(std::size_t sub_group, StateTensor which,
                                   std::uint64_t offset_elems, std::span<float> out,
                                   std::span<std::byte> staging, storage::IoBackend* backend) {
  if (sub_group >= infos_.size()) {
    return InvalidArgumentError(
        fmt::format("ReadState: sub-group {} of {}", sub_group, infos_.size()));
  }
  const SubGroupSwapInfo& info = infos_[sub_group];
  if (offset_elems > info.sub_group.numel || out.size() > info.sub_group.numel - offset_elems) {
    return InvalidArgumentError(
        fmt::format("ReadState: elements [{}, {}) outside sub-group {} of {} elements",
                    offset_elems, offset_elems + out.size(), sub_group, info.sub_group.numel));
  }
  if (out.empty()) return OkStatus();
  ZINF_RETURN_IF_ERROR(Annotate(CheckNotDamaged(sub_group), "ReadState: "));
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
  if (resident(sub_group)) {
    const std::span<float> values =
        ResidentBuffers(sub_group).floats(static_cast<std::size_t>(which));
    std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(offset_elems), out.size(),
                out.begin());
    return OkStatus();
  }
  const std::uint64_t alignment = std::max<std::uint64_t>(store_->alignment(), 1);
  const std::uint64_t begin = AlignDown(offset_elems * sizeof(float), alignment);
  const std::uint64_t end =
      std::min(AlignUp((offset_elems + out.size()) * sizeof(float), alignment), info.io_size_bytes);
  std::optional<PoolLease> lease;
  std::span<std::byte> buffer;
  if (staging.empty()) {
    ZINF_ASSIGN_OR_RETURN(lease, pool_->Allocate(1, 1));
    buffer = lease->bytes(0).first(end - begin);
  } else if (staging.size() < end - begin) {
    return InvalidArgumentError(fmt::format(
        "ReadState: a staging buffer of {} bytes for a read of {}", staging.size(), end - begin));
  } else {
    buffer = staging.first(end - begin);
  }
  ZINF_RETURN_IF_ERROR(
      ReadSlotTensor(SlotTensorName(slot_of_[sub_group], static_cast<std::size_t>(which)), begin,
                     buffer, fmt::format("read state of sub-group {}: ", sub_group),
                     backend != nullptr ? *backend : read_engine()));
  std::memcpy(out.data(), buffer.data() + (offset_elems * sizeof(float) - begin),
              out.size() * sizeof(float));
  return OkStatus();
}

Status OptimizerSwapper::ReadSlotTensor(const std::string& name, std::uint64_t begin,
                                        std::span<std::byte> buffer, const std::string& context,
                                        storage::IoBackend& backend) {
  IoBatch batch;
  Result<std::vector<std::uint64_t>> ids =
      store_->SubmitReadRange(name, begin, buffer.size(), buffer, backend);
  if (ids) batch.Add(*ids, name);
  Status waited = batch.Wait(backend);
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
  if (resident(sub_group)) {
    ZINF_RETURN_IF_ERROR(Annotate(CheckNotDamaged(sub_group), "ReadQ8Moments: "));
    return use(ViewQ8Moments(ResidentBuffers(sub_group).tensors[1],
                             Q8MomentsLayout::For(info.sub_group.numel)));
  }
  ZINF_ASSIGN_OR_RETURN(PoolLease lease, pool_->Allocate(1, 1));
  std::span<std::byte> buffer = lease.bytes(0).first(info.moments_io_bytes);
  ZINF_RETURN_IF_ERROR(ReadSlotTensor(SlotTensorName(slot_of_[sub_group], 1), 0, buffer,
                                      fmt::format("read q8 moments of sub-group {}: ", sub_group),
                                      read_engine()));
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
  // A resident sub-group is filled in place (its q8 moments through one staging buffer): no
  // second copy of the state. A failure then leaves it damaged until a WriteState succeeds.
  const bool in_place = resident(sub_group);
  const std::size_t staging_buffers = options_.state_format == StateFormat::kQ8 ? 1 : 0;
  ZINF_ASSIGN_OR_RETURN(PoolLease lease,
                        AllocateUpTo(*pool_, numel, in_place ? staging_buffers : 3));
  StateBuffers buffers = in_place ? ResidentBuffers(sub_group) : LeaseBuffers(lease);
  if (options_.state_format == StateFormat::kQ8 && !in_place) buffers.tensors[1] = lease.bytes(2);
  if (in_place) damaged_[sub_group] = true;
  auto fill_one = [&](StateTensor which, std::span<float> values) -> Status {
    std::fill(values.begin(), values.end(), 0.0f);
    return Annotate(fill(which, values.first(numel)),
                    context + std::string(StateTensorName(which)) + ": ");
  };
  if (options_.state_format == StateFormat::kQ8) {
    // fp32 and the moments in `buffers`; one fp32 moment at a time is staged in lease buffer
    // in_place ? 0 : 1 and quantized into the moments.
    std::span<float> fp32 = buffers.floats(0).first(info.io_size_bytes / 4);
    ZINF_RETURN_IF_ERROR(fill_one(StateTensor::kFp32, fp32));
    std::span<std::byte> moments_bytes = buffers.tensors[1].first(info.moments_io_bytes);
    std::ranges::fill(moments_bytes, std::byte{0});
    const Q8Moments moments = ViewQ8Moments(moments_bytes, Q8MomentsLayout::For(numel));
    std::span<float> staging = lease.floats(in_place ? 0 : 1).first(numel);
    for (StateTensor which : {StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      ZINF_RETURN_IF_ERROR(fill_one(which, staging));
      const bool signed_map = which == StateTensor::kExpAvg;
      const Q8Moment& m = signed_map ? moments.exp_avg : moments.exp_avg_sq;
      ZINF_RETURN_IF_ERROR(
          Annotate(q8::Quantize(signed_map ? q8::MapKind::kSigned : q8::MapKind::kUnsigned, staging,
                                m.codes, m.scales),
                   context + std::string(StateTensorName(which)) + ": "));
    }
  } else {
    for (StateTensor which : kStateTensors) {
      const auto t = static_cast<std::size_t>(which);
      ZINF_RETURN_IF_ERROR(fill_one(which, buffers.floats(t).first(info.io_size_bytes / 4)));
    }
  }
  ZINF_RETURN_IF_ERROR(WriteAndCommit(sub_group, step, buffers, context));
  damaged_[sub_group] = false;
  return OkStatus();
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
  const bool in_place = resident(sub_group);  // as in WriteState
  ZINF_ASSIGN_OR_RETURN(PoolLease lease,
                        AllocateUpTo(*pool_, info.sub_group.numel, in_place ? 0 : 2));
  const StateBuffers buffers = in_place ? ResidentBuffers(sub_group) : LeaseBuffers(lease);
  if (in_place) damaged_[sub_group] = true;
  std::span<float> fp32 = buffers.floats(0).first(info.io_size_bytes / 4);
  std::ranges::fill(fp32, 0.0f);
  ZINF_RETURN_IF_ERROR(Annotate(fill_fp32(fp32.first(info.sub_group.numel)), context + "fp32: "));
  std::span<std::byte> moments_bytes = buffers.tensors[1].first(info.moments_io_bytes);
  std::ranges::fill(moments_bytes, std::byte{0});
  ZINF_RETURN_IF_ERROR(Annotate(
      fill_moments(ViewQ8Moments(moments_bytes, Q8MomentsLayout::For(info.sub_group.numel))),
      context + "moments: "));
  ZINF_RETURN_IF_ERROR(WriteAndCommit(sub_group, step, buffers, context));
  damaged_[sub_group] = false;
  return OkStatus();
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
  if (options.store.paths.empty() && !options.all_resident) {
    return InvalidArgumentError("optimizer swapper: no nvme_path given");
  }
  if (options.gradient_accumulation_steps < 1) {
    return InvalidArgumentError(fmt::format("gradient_accumulation_steps {} must be >= 1",
                                            options.gradient_accumulation_steps));
  }
  return OkStatus();
}

// Refuses host memory for the resident state (`what`) beyond what this node has available,
// counting every rank of the node, which all keep as much.
Status CheckHostMemory(const comm::Communicator& comm, std::uint64_t bytes_per_rank,
                       const std::string& what) {
  const std::uint64_t available = AvailableMemoryBytes();
  if (available == 0 || bytes_per_rank == 0) return OkStatus();
  const auto ranks = static_cast<std::uint64_t>(std::max(comm.topology().local_size, 1));
  std::uint64_t total = 0;
  if (!CheckedMul(bytes_per_rank, ranks, &total) || total > available) {
    return ResourceExhaustedError(fmt::format(
        "{} asks for {} ({} bytes) of host memory per rank, {} for the {} ranks of host {}; it "
        "has {} ({} bytes) available (MemAvailable)",
        what, FormatBytes(bytes_per_rank), bytes_per_rank,
        total >= bytes_per_rank ? FormatBytes(total) : std::string("more than 16 EiB"), ranks,
        comm.topology().hostname, FormatBytes(available), available));
  }
  return OkStatus();
}

// The sub-groups AllocateResident keeps in memory and (`*bytes`) their state's bytes.
std::vector<std::size_t> ChooseResident(const SwapperOptions& options,
                                        const std::vector<SubGroupSwapInfo>& infos,
                                        std::uint64_t alignment, std::uint64_t* bytes) {
  std::vector<std::size_t> chosen;
  *bytes = 0;
  for (std::size_t i = 0; i < infos.size(); ++i) {
    const std::uint64_t need =
        SubGroupStateBytes(infos[i].sub_group.numel, options.state_format, alignment);
    if (!options.all_resident && need > options.host_cache_bytes - *bytes) break;
    chosen.push_back(i);
    *bytes += need;
  }
  return chosen;
}

// Whether the resident sub-groups get a second copy for the speculative step.
bool SpeculateResident(const SwapperOptions& options) {
  return options.speculate_resident && options.speculative_slots > 0;
}

// The resident sub-groups' memory (empty for swapped ones): every sub-group with all_resident,
// else the first ones whose state fits host_cache_bytes together; with SpeculateResident, a
// second copy of each.
struct ResidentMemory {
  std::vector<std::vector<storage::AlignedBuffer>> state, spare;
};
Result<ResidentMemory> AllocateResident(
    const comm::Communicator& comm, const SwapperOptions& options,
    const std::vector<SubGroupSwapInfo>& infos, std::uint64_t alignment) {
  const StateFormat format = options.state_format;
  std::uint64_t bytes = 0;
  const std::vector<std::size_t> chosen = ChooseResident(options, infos, alignment, &bytes);
  const bool spare = SpeculateResident(options);
  if (options.all_resident) {
    ZINF_RETURN_IF_ERROR(CheckHostMemory(
        comm, bytes, "offload_optimizer.device \"cpu\" (the whole optimizer state in memory)"));
  } else {
    ZINF_RETURN_IF_ERROR(CheckHostMemory(
        comm, (spare ? 2 : 1) * options.host_cache_bytes,
        spare ? "zinf.host_cache_bytes (twice, with the speculative step's second copy)"
              : "zinf.host_cache_bytes"));
  }
  ResidentMemory memory;
  memory.state.resize(infos.size());
  memory.spare.resize(infos.size());
  storage::BufferOptions buffer_options;
  buffer_options.alignment = std::max<std::uint64_t>(alignment, 64);
  buffer_options.register_cuda = false;
  for (std::size_t i : chosen) {
    for (int copy = 0; copy < (spare ? 2 : 1); ++copy) {
      for (std::size_t t = 0; t < NumSlotTensors(format); ++t) {
        ZINF_ASSIGN_OR_RETURN(storage::AlignedBuffer buffer,
                              Annotate(storage::AlignedBuffer::Allocate(
                                           TensorIoBytes(infos[i], format, t), buffer_options),
                                       fmt::format("resident sub-group {}: ", i)));
        (copy == 0 ? memory.state : memory.spare)[i].push_back(std::move(buffer));
      }
    }
  }
  return memory;
}

// A pool's size: `count` buffers of `buffer_bytes`; whether it holds the pipelined swapper's.
struct PoolSize {
  std::uint64_t count = 0;
  std::uint64_t buffer_bytes = 0;
  std::uint64_t buffer_alignment = 0;
  bool pipelined = false;
};

// The pool's buffers at least `min_buffers` of the largest sub-group (CreatePool's and the
// plan's one sizing).
Result<PoolSize> SizePool(const SwapperOptions& options, std::uint64_t max_numel,
                          std::uint64_t alignment, std::uint64_t min_buffers) {
  const std::uint64_t buffer_alignment = std::max<std::uint64_t>(alignment, 4096);
  const std::uint64_t buffer_bytes = AlignUp(max_numel * sizeof(float), buffer_alignment);
  // Pool: the mode decides the minimum number of buffers.
  const bool want_pipeline = options.pipeline_read || options.pipeline_write;
  const std::uint64_t pipeline_buffers =
      PipelinedOptimizerSwapper::MinBuffers(options.state_format);
  std::uint64_t count = 0;
  if (options.all_resident) {
    count = min_buffers;  // no swapping: the gradient (and q8's work copy) only
  } else if (options.pinned_budget_bytes > 0) {
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
  return PoolSize{.count = count,
                  .buffer_bytes = buffer_bytes,
                  .buffer_alignment = buffer_alignment,
                  .pipelined = want_pipeline && count >= pipeline_buffers && !options.all_resident};
}

// The buffers a pool needs at the least: a swapped sub-group's (BuffersPerSubGroup), or with
// every sub-group resident the gradient's (and q8's work copy).
std::uint64_t MinPoolBuffers(const SwapperOptions& options) {
  return options.all_resident ? (options.state_format == StateFormat::kQ8 ? 3 : 1)
                              : OptimizerSwapper::BuffersPerSubGroup(options.state_format);
}

// Sizes the pool for the mode (at least `min_buffers` buffers of the largest sub-group) and
// creates it; `*pipelined`: it holds the pipelined swapper's buffers (WARN if asked but not).
Result<std::unique_ptr<BufferPool>> CreatePool(const SwapperOptions& options,
                                               std::uint64_t max_numel, std::uint64_t alignment,
                                               std::uint64_t min_buffers, bool* pipelined) {
  ZINF_ASSIGN_OR_RETURN(const PoolSize size, SizePool(options, max_numel, alignment, min_buffers));
  const std::uint64_t count = size.count;
  const std::uint64_t buffer_bytes = size.buffer_bytes;
  const std::uint64_t buffer_alignment = size.buffer_alignment;
  const bool want_pipeline = options.pipeline_read || options.pipeline_write;
  const std::uint64_t pipeline_buffers =
      PipelinedOptimizerSwapper::MinBuffers(options.state_format);
  *pipelined = size.pipelined;
  if (want_pipeline && !*pipelined && !options.all_resident) {
    ZINF_LOG_WARN(
        "optimizer swapper: pipeline_read/pipeline_write need {} swap buffers of {} ({}), the "
        "pool holds {}: stepping synchronously; raise zinf.pinned_budget_bytes to pipeline",
        pipeline_buffers, FormatBytes(buffer_bytes), FormatBytes(pipeline_buffers * buffer_bytes),
        count);
  }
  return BufferPool::Create(
      BufferPoolOptions{.budget_bytes = options.all_resident ? 0 : options.pinned_budget_bytes,
                        .buffer_count = count,
                        .buffer_bytes = buffer_bytes,
                        .alignment = buffer_alignment,
                        .pin_memory = options.pin_memory});
}

Result<std::unique_ptr<storage::IoBackend>> MakeIoBackend(const SwapperOptions& options,
                                                      IoRole role, BufferPool* pool) {
  ZINF_ASSIGN_OR_RETURN(
      std::unique_ptr<storage::IoBackend> backend,
      storage::CreateIoBackend(options.backend, options.aio, options.store.paths.front()));
  if (options.io_backend_wrapper) {
    ZINF_ASSIGN_OR_RETURN(backend, options.io_backend_wrapper(role, std::move(backend)));
  }
  if (pool != nullptr) ZINF_RETURN_IF_ERROR(backend->RegisterBuffers(pool->AllBuffers()));
  return backend;
}

// options.accumulation, with kAuto resolved when gradients are swapped: in memory if the
// partition's gradient fits accumulation_memory_limit_bytes.
GradientAccumulation ResolveAccumulation(const SwapperOptions& options,
                                         std::uint64_t partition_numel) {
  const std::uint64_t partition_bytes = partition_numel * sizeof(float);
  // Without a swap store (every sub-group resident) the gradient stays in memory too.
  if (options.swap_gradients && options.all_resident) return GradientAccumulation::kInMemory;
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
  ZINF_RETURN_IF_ERROR(PreflightSpace(comm, store.options(), specs));
  return comm.AgreeOnStatus(Annotate(store.Reserve(specs), on_host + "reserve the swap store: "));
}

// The gradient the gradient swapper keeps in host memory per rank (GradientSwapper's own
// buffers: the whole partition in memory, else the unswapped remainders).
std::uint64_t GradientHostBytes(GradientAccumulation accumulation, std::uint64_t partition_numel,
                                const std::vector<SubGroupSwapInfo>& infos) {
  if (accumulation == GradientAccumulation::kInMemory) return partition_numel * sizeof(float);
  std::uint64_t bytes = 0;
  for (const SubGroupSwapInfo& info : infos) {
    for (const partition::GradientPiece& piece : info.unswapped_gradients) {
      bytes += piece.numel * sizeof(float);
    }
  }
  return bytes;
}

// Logs the gradient swapper's mode and the gradient it keeps in host memory per rank.
void LogGradientSwapper(GradientAccumulation accumulation, int gradient_accumulation_steps,
                        std::uint64_t partition_numel, const std::vector<SubGroupSwapInfo>& infos) {
  const std::uint64_t extra_bytes = GradientHostBytes(accumulation, partition_numel, infos);
  ZINF_LOG_INFO(
      "gradient swapper: {} accumulation over {} micro-batches ({} of gradient in "
      "host memory per rank{})",
      GradientAccumulationName(accumulation), gradient_accumulation_steps, FormatBytes(extra_bytes),
      accumulation == GradientAccumulation::kInMemory
          ? ": the partition gradient fits accumulation_memory_limit_bytes"
          : ": unswapped remainders; swapped pieces are read, added and written");
}

// Logs (rank 0) the mode, sub-groups, host tier, pool size, backends and store of a new swapper.
void LogSwapper(OptimizerSwapper& swapper, const std::string& engine_name,
                std::span<const storage::TensorSpec> specs) {
  std::uint64_t disk_bytes = 0;
  for (const storage::TensorSpec& spec : specs) disk_bytes += spec.size_bytes;
  const BufferPool& pool = swapper.pool();
  const std::size_t swapped = swapper.num_sub_groups() - swapper.num_resident();
  const std::size_t speculative = std::min(swapper.options().speculative_slots, swapped);
  const std::string store =
      swapper.has_store()
          ? fmt::format("swap store {} per rank on {} ({} slots{}, alignment {})",
                        FormatBytes(disk_bytes), fmt::join(swapper.options().store.paths, ","),
                        swapped + 1 + speculative,
                        speculative > 0
                            ? fmt::format(", {} for the speculative step", speculative)
                            : std::string(),
                        swapper.store().alignment())
          : std::string("no swap store (offload_optimizer.device \"cpu\")");
  ZINF_LOG_INFO(
      "optimizer swapper: {} ({} backend{}), {} state ({:.2f} bytes per element each way per "
      "step), {} sub-groups of <= {} elements per rank, {} resident in host memory ({}); pool {} "
      "x {} = {} (budget {}, pinned: {}); {}",
      swapper.mode_name(), engine_name, swapper.has_store() ? "s, read + write" : "",
      StateFormatName(swapper.state_format()), swapper.StateIoBytesPerElement(),
      swapper.num_sub_groups(), swapper.sub_groups().max_sub_group_numel(), swapper.num_resident(),
      FormatBytes(swapper.resident_bytes()), pool.buffer_count(), FormatBytes(pool.buffer_bytes()),
      FormatBytes(pool.total_bytes()), FormatBytes(pool.budget_bytes()),
      pool.pinned() ? "yes" : "no", store);
}

}  // namespace

Result<std::unique_ptr<storage::IoBackend>> OptimizerSwapper::CreateReaderBackend() const {
  return MakeIoBackend(options_, IoRole::kRead, nullptr);
}

Status OptimizerSwapper::Parts::SetUpLocally(Parts& parts, const comm::Communicator& comm,
                                             const partition::PartitionPlan& plan,
                                             const SwapperOptions& options, LocalSetup* setup) {
  ZINF_RETURN_IF_ERROR(CheckOptions(plan, comm, options));
  ZINF_ASSIGN_OR_RETURN(partition::SubGroupPlan sub_groups,
                        partition::SubGroupPlan::Create(plan, comm.rank(), options.sub_group_size));
  parts.plan = plan;
  ZINF_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::Create(options.adam));
  parts.adam.emplace(std::move(adam));
  setup->accumulation = ResolveAccumulation(options, plan.partition_numel());
  const bool gradients_on_disk =
      options.swap_gradients && setup->accumulation == GradientAccumulation::kReadAddWrite;
  // Every rank decides alike (one config): a store unless nothing is ever swapped (device cpu
  // keeps the gradient in memory too: ResolveAccumulation).
  if (!options.all_resident) {
    ZINF_ASSIGN_OR_RETURN(parts.store, storage::SwapStore::Open(parts.options.store));
  }
  const std::uint64_t alignment =
      parts.store ? std::max<std::uint64_t>(parts.store->alignment(), 1) : 4096;
  const std::uint64_t max_numel = sub_groups.max_sub_group_numel();
  ZINF_ASSIGN_OR_RETURN(parts.infos, MakeSwapInfos(sub_groups, alignment, options.state_format,
                                                   gradients_on_disk, options.min_swap_numel));
  ZINF_ASSIGN_OR_RETURN(ResidentMemory resident,
                        AllocateResident(comm, options, parts.infos, alignment));
  parts.resident = std::move(resident.state);
  parts.resident_spare = std::move(resident.spare);
  const std::uint64_t min_buffers = MinPoolBuffers(options);
  ZINF_ASSIGN_OR_RETURN(parts.pool,
                        CreatePool(options, max_numel, alignment, min_buffers, &setup->pipelined));
  if (parts.store) {
    // Reads and writes each have a backend (ring and thread): both swappers overlap them.
    ZINF_ASSIGN_OR_RETURN(parts.read_engine,
                          MakeIoBackend(options, IoRole::kRead, parts.pool.get()));
    ZINF_ASSIGN_OR_RETURN(parts.write_engine,
                          MakeIoBackend(options, IoRole::kWrite, parts.pool.get()));
  }
  if (gradients_on_disk) {
    ZINF_ASSIGN_OR_RETURN(setup->gradient_engine,
                          MakeIoBackend(options, IoRole::kGradient, parts.pool.get()));
  }
  std::size_t swapped = 0;
  for (const auto& memory : parts.resident) swapped += memory.empty() ? 1 : 0;
  parts.sub_groups.emplace(std::move(sub_groups));
  // One spare slot suffices in both modes: each backend has at most one sub-group in flight.
  // Speculation keeps up to one more per swapped sub-group.
  parts.num_slots = swapped + 1 + std::min(options.speculative_slots, swapped);
  if (parts.store) {
    setup->specs =
        StoreSpecs(parts.num_slots, options.state_format, max_numel, alignment, parts.infos);
  }
  return OkStatus();
}

Result<SwapperHostPlan> PlanSwapperHostMemory(const partition::PartitionPlan& plan, int rank,
                                              const SwapperOptions& options,
                                              std::uint64_t alignment_bytes) {
  // SetUpLocally's steps, without the store, the backends and the allocations.
  ZINF_ASSIGN_OR_RETURN(partition::SubGroupPlan sub_groups,
                        partition::SubGroupPlan::Create(plan, rank, options.sub_group_size));
  const GradientAccumulation accumulation = ResolveAccumulation(options, plan.partition_numel());
  const bool gradients_on_disk =
      options.swap_gradients && accumulation == GradientAccumulation::kReadAddWrite;
  const std::uint64_t alignment = std::max<std::uint64_t>(alignment_bytes, 1);
  ZINF_ASSIGN_OR_RETURN(std::vector<SubGroupSwapInfo> infos,
                        MakeSwapInfos(sub_groups, alignment, options.state_format,
                                      gradients_on_disk, options.min_swap_numel));
  SwapperHostPlan out;
  out.max_sub_group_numel = sub_groups.max_sub_group_numel();
  (void)ChooseResident(options, infos, alignment, &out.resident_bytes);
  if (SpeculateResident(options)) out.resident_spare_bytes = out.resident_bytes;
  ZINF_ASSIGN_OR_RETURN(const PoolSize pool, SizePool(options, out.max_sub_group_numel, alignment,
                                                      MinPoolBuffers(options)));
  out.pool_buffers = pool.count;
  out.pool_bytes = pool.count * pool.buffer_bytes;
  const bool gradient_swapper =
      gradients_on_disk ||
      (options.swap_gradients && accumulation == GradientAccumulation::kInMemory);
  if (gradient_swapper) {
    out.gradient_bytes = GradientHostBytes(accumulation, plan.partition_numel(), infos);
  }
  return out;
}

Result<std::unique_ptr<OptimizerSwapper>> CreateOptimizerSwapper(
    const comm::Communicator& comm, const partition::PartitionPlan& plan,
    const SwapperOptions& options) {
  ZINF_ASSIGN_OR_RETURN(comm::Communicator dup, comm.Dup());
  OptimizerSwapper::Parts parts;
  parts.options = options;
  parts.options.store.world_rank = dup.rank();
  LocalSetup setup;
  // Store, backend and pool errors are about this node's disks and memory: name the host, so a
  // multi-node job says which node lacks its nvme_path.
  const std::string on_host =
      fmt::format("optimizer swapper on host {}: ", dup.topology().hostname);
  ZINF_RETURN_IF_ERROR(dup.AgreeOnStatus(
      Annotate(OptimizerSwapper::Parts::SetUpLocally(parts, dup, plan, options, &setup), on_host)));
  if (parts.store) {
    ZINF_RETURN_IF_ERROR(
        ReserveStore(dup, parts.options.store, *parts.store, setup.specs, on_host));
  }

  const std::string engine_name(parts.read_engine ? parts.read_engine->name() : "no");
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
  LogSwapper(*swapper, engine_name, setup.specs);
  return swapper;
}

}  // namespace zinf::swapper
