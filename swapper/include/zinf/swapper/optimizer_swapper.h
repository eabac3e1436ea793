// OptimizerSwapper: one rank's ZeRO partition of the Adam state (fp32 master weights, exp_avg,
// exp_avg_sq) kept in a SwapStore on node-local NVMe and stepped sub-group by sub-group through
// a BufferPool (DESIGN.md, "One training step"). The C++ counterpart of DeepSpeed's
// OptimizerSwapper / PartitionedOptimizerSwapper / PipelinedOptimizerSwapper.
//
//   ZINF_ASSIGN_OR_RETURN(auto swapper, CreateOptimizerSwapper(world, plan, options));
//   ZINF_RETURN_IF_ERROR(swapper->Initialize(initial_weights));       // collective
//   for (step = 1; ...; ++step) {
//     ... backward; swapper->gradient_swapper()->SwapOut(micro_batch, i, grad) ...
//     ZINF_RETURN_IF_ERROR(swapper->Step(step, {}, sink));  // {}: the gradient swapper's gradient
//   }
//
// Where the gradient lives does not matter to Step: a GradientSource fills a sub-group's
// gradient into a pool buffer (the GradientSwapper, or synthetic data) or lends the memory that
// holds it (an in-memory partition gradient), and a ParamSink receives the updated weights of
// each sub-group. Host memory
// therefore stays bounded by the pool even when the partition gradient is on disk.
//
// Store layout and the consistency guarantee. The store holds one *slot* per swapped sub-group
// (those not resident in the host memory tier) plus a spare, each
// with the slot tensors of the state format (SwapperOptions::state_format) sized for the largest
// sub-group: fp32: "slot<k>/fp32", "slot<k>/exp_avg", "slot<k>/exp_avg_sq"; q8: "slot<k>/fp32"
// and "slot<k>/moments" (Q8MomentsLayout: both moments' codes and scales, one I/O), plus
// "grad<i>" per sub-group when gradients are swapped (read-add-write mode). An in-memory table
// maps each sub-group to the slot holding its committed state; one slot is spare. A stepped
// sub-group is written to the spare slot, and only after every one of its slot tensor writes has
// completed successfully does the table flip (the sub-group's old slot becomes the spare) and the
// ParamSink see the new weights. Hence, whatever I/O error happens during a
// Step (read, write, gradient read, or a failing callback):
//   - every sub-group's committed state is intact: the step was applied to a sub-group either
//     completely (its new state committed, last_step(i) == step, the sink called) or not at all
//     (old state, last_step(i) < step, the sink not called for it);
//   - the returned error names the failing sub-group and how many took the step;
//   - calling Step again with the same step number applies it to exactly the sub-groups that
//     did not take it (sub-groups with last_step(i) >= step are skipped), e.g. after a transient
//     error.
// The table lives in memory: a process that dies mid-step loses it (the store is scratch space;
// durable state is the checkpoint). Gradient errors (write-behind during backward, or flush) are
// agreed on before any sub-group is stepped, so then no rank applies the step at all.
//
// Errors and collectiveness. Create, Initialize, Step, FlushGradients and LogTimers are
// "Collective over `comm`": every rank calls them in the same order and gets the same Status;
// an error on one rank (e.g. EIO) comes back on every rank as that rank's error ("rank 1: step 3,
// sub-group 2 of 5: swap-in exp_avg: ..."). Before any error is returned, every I/O in flight
// has been drained: no buffer goes back to the pool under an in-flight operation. ReadState,
// WriteState and the gradient swapper's SwapOut are local.
//
// Ownership and thread safety: the swapper owns its store, backends, pool, gradient swapper and
// CpuAdam, and a dup of `comm`. One thread at a time (the callbacks run on the calling thread).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "zinf/comm/communicator.h"
#include "zinf/comm/timers.h"
#include "zinf/core/status.h"
#include "zinf/partition/plan.h"
#include "zinf/partition/sub_group.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/io_backend.h"
#include "zinf/storage/swap_store.h"
#include "zinf/swapper/buffer_pool.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/q8.h"

namespace zinf::swapper {

class GradientSwapper;

// The three state tensors of a sub-group, as fp32 values (whatever the format on disk).
enum class StateTensor : int { kFp32 = 0, kExpAvg = 1, kExpAvgSq = 2 };
inline constexpr std::size_t kNumStateTensors = 3;
std::string_view StateTensorName(StateTensor which);  // "fp32", "exp_avg", "exp_avg_sq"

// The q8 format's "moments" slot tensor of a sub-group of `numel` elements, which is also the
// layout of its pool buffer: exp_avg codes [numel] at 0, exp_avg_sq codes [numel] at numel, then
// at scales_offset (a multiple of 64) the fp32 scales of exp_avg [num_blocks] followed by those of
// exp_avg_sq [num_blocks] (q8.h: blocks of q8::kBlockNumel from the sub-group's first element).
struct Q8MomentsLayout {
  std::uint64_t numel = 0;
  std::uint64_t num_blocks = 0;
  std::uint64_t scales_offset = 0;
  std::uint64_t bytes = 0;  // unaligned size
  static Q8MomentsLayout For(std::uint64_t numel);
};
// Both moments of a sub-group in q8, viewed in a moments buffer.
struct Q8Moments {
  Q8Moment exp_avg;
  Q8Moment exp_avg_sq;
};
Q8Moments ViewQ8Moments(std::span<std::byte> buffer, const Q8MomentsLayout& layout);
// Bytes of the state of a sub-group of `numel` elements, each slot tensor aligned up to
// `alignment`: one slot on disk, or its resident memory (fp32: 3 x 4 x numel; q8: 4 x numel
// plus Q8MomentsLayout's bytes).
std::uint64_t SubGroupStateBytes(std::uint64_t numel, StateFormat format, std::uint64_t alignment);

// Which backend an IoBackendWrapper is asked to wrap.
enum class IoRole { kRead, kWrite, kGradient };

// Where Step takes a sub-group's gradient (sub_group.numel elements; padding elements should be
// 0), in one of two ways:
//   - a fill (any callable `Status(const SubGroup&, std::span<float> grad)`) copies it into a pool
//     buffer: from disk (GradientSwapper::Source), or synthetic data;
//   - a view (FromView) returns memory that already holds it and stays unchanged until Step
//     returns (an in-memory partition gradient): Adam reads it there, with no copy.
// An empty source (default-constructed) given to OptimizerSwapper::Step is the gradient swapper's
// gradient (see Step); Get and FillInto read it as a zero gradient. Called on the Step's thread,
// once per sub-group stepped, in the order the swapper steps them (not necessarily sub-group
// order: resident sub-groups step between swapped ones, while their I/O is in flight).
class GradientSource {
 public:
  using Fill = std::function<Status(const partition::SubGroup& sub_group, std::span<float> grad)>;
  using View = std::function<Result<std::span<const float>>(const partition::SubGroup& sub_group)>;

  GradientSource() = default;
  template <typename F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, GradientSource> &&
           std::is_invocable_r_v<Status, F&, const partition::SubGroup&, std::span<float>>)
      GradientSource(F fill)
      : fill_(std::move(fill)) {}  // NOLINT: a callable is a source
  static GradientSource FromView(View view);

  bool empty() const { return !fill_ && !view_; }
  // The gradient of `sub_group`: the view, or `scratch` (at least numel elements) filled.
  // InvalidArgument if a view has another size than the sub-group.
  Result<std::span<const float>> Get(const partition::SubGroup& sub_group,
                                     std::span<float> scratch) const;
  // Copies the gradient into `out` (at least numel elements; a view is copied, empty: zeros).
  Status FillInto(const partition::SubGroup& sub_group, std::span<float> out) const;

 private:
  Fill fill_;
  View view_;
};
// Receives the updated weights of a sub-group after its state is committed (see the top of the
// file); `bf16` is empty unless SwapperOptions::bf16_params. The spans die after the call.
using ParamSink =
    std::function<Status(const partition::SubGroup& sub_group, std::span<const float> fp32,
                         std::span<const std::uint16_t> bf16)>;
// Fills the initial fp32 weights of partition range [partition_offset, partition_offset +
// out.size()).
using InitialWeights = std::function<Status(std::uint64_t partition_offset, std::span<float> out)>;
// Tests: wraps a backend the swapper created (e.g. in a storage::FaultInjectingBackend).
using IoBackendWrapper = std::function<Result<std::unique_ptr<storage::IoBackend>>(
    IoRole role, std::unique_ptr<storage::IoBackend> backend)>;

// How the GradientSwapper accumulates micro-batches.
enum class GradientAccumulation {
  kAuto,         // in memory if the partition's gradient fits accumulation_memory_limit_bytes
  kInMemory,     // a partition-sized host buffer; no gradient I/O
  kReadAddWrite  // swapped pieces on disk: micro-batch 0 writes, later ones read, add, write
};
std::string_view GradientAccumulationName(GradientAccumulation mode);

struct SwapperOptions {
  // Store: paths, job_id, stripe_unit_bytes, keep, verify_swap, direct. world_rank is replaced
  // by the rank in `comm`.
  storage::SwapStoreOptions store;
  storage::AioOptions aio;                                         // DeepSpeed's aio section
  storage::IoBackendKind backend = storage::IoBackendKind::kAuto;         // ZINF_IO_ENGINE overrides
  std::uint64_t sub_group_size = partition::kDefaultSubGroupSize;  // elements per sub-group
  // Pool: zinf.pinned_budget_bytes; 0: buffer_count buffers of the largest sub-group.
  std::uint64_t pinned_budget_bytes = 0;
  std::uint64_t buffer_count =
      0;  // DeepSpeed's buffer_count; 0: the mode's minimum (4, q8 3; pipelined 10, q8 7)
  bool pin_memory = false;  // mlock the pool
  // DeepSpeed's pipeline_read / pipeline_write: either one selects the pipelined swapper.
  bool pipeline_read = false;
  bool pipeline_write = false;
  AdamOptions adam;
  StateFormat state_format = StateFormat::kFp32;  // zinf.optimizer_state
  bool bf16_params = false;  // also hand the ParamSink bf16 weights (round to nearest even)
  // Gradient swapper (created when swap_gradients).
  // Host memory tier (zinf.host_cache_bytes): the first sub-groups whose whole state fits in
  // these bytes stay resident in host memory and are stepped there without I/O; the rest are
  // swapped as usual. 0: none. `all_resident` (offload_optimizer.device "cpu") keeps every
  // sub-group resident whatever the budget, and opens no swap store (gradients accumulate in
  // memory).
  std::uint64_t host_cache_bytes = 0;
  bool all_resident = false;
  bool swap_gradients = false;
  // Speculation (see "Speculation" below): the store keeps this many more spare slots (at most
  // one per swapped sub-group), so that as many sub-groups can be stepped ahead of Step.
  std::size_t speculative_slots = 0;
  // With speculative_slots: the resident sub-groups are speculated too, into a second copy of
  // their state in host memory (the host tier's memory twice).
  bool speculate_resident = false;
  int gradient_accumulation_steps = 1;  // micro-batches per step, >= 1
  GradientAccumulation accumulation = GradientAccumulation::kAuto;
  std::uint64_t accumulation_memory_limit_bytes = 256ull << 20;    // kAuto: in memory up to this
  std::uint64_t min_swap_numel = partition::kDefaultMinSwapNumel;  // smaller pieces stay in RAM
  IoBackendWrapper io_backend_wrapper;  // tests only: e.g. attach a FaultInjector
};

// Per sub-group swap information (DeepSpeed's SwapInfo).
struct SubGroupSwapInfo {
  partition::SubGroup sub_group;
  std::uint64_t io_size_bytes = 0;     // AlignUp(numel * 4, store alignment): one fp32 tensor's I/O
  std::uint64_t moments_io_bytes = 0;  // q8: AlignUp(Q8MomentsLayout bytes, store alignment)
  // The split of the sub-group's gradient: swapped pieces live in "grad<i>" at their sub-group
  // offsets; unswapped remainders stay in host memory (only with the read-add-write mode).
  std::vector<partition::GradientPiece> swapped_gradients;
  std::vector<partition::GradientPiece> unswapped_gradients;
  std::string gradient_name;  // "grad<i>", empty when gradients are not swapped to disk
  bool has_gradients() const { return !gradient_name.empty(); }
};

struct StepOptions {
  std::optional<double> lr = std::nullopt;  // overrides AdamOptions::lr for this step
  float grad_scale = 1.0f;  // multiplies the gradient (clipping, loss-scale, averaging)
  // Override AdamOptions' betas for this step (OneCycle's momentum).
  std::optional<std::array<double, 2>> betas = std::nullopt;
  // Adam's step count for the bias corrections when it differs from the swapper's step number
  // (fp16 steps skipped on overflow advance the engine's step but not Adam's); 0: `step`.
  std::int64_t adam_step = 0;
  // Parameter groups: the hyper-parameters of the partition's elements from each segment's
  // begin (a partition offset) to the next one's, as StepExtras::segments (lr and betas above
  // then unset); the first begins at 0. Empty: AdamOptions with the overrides above.
  std::span<const AdamSegment> segments = {};
};

class OptimizerSwapper {
 public:
  // Buffers per swapped sub-group: one per slot tensor, plus its gradient: fp32: fp32, exp_avg,
  // exp_avg_sq, gradient; q8: fp32, moments, gradient. The fewest a step's pool holds.
  static std::size_t BuffersPerSubGroup(StateFormat format);

  virtual ~OptimizerSwapper();
  OptimizerSwapper(const OptimizerSwapper&) = delete;
  OptimizerSwapper& operator=(const OptimizerSwapper&) = delete;

  // Collective. Writes fp32 = initial weights (padding 0) and exp_avg = exp_avg_sq = 0 for
  // every sub-group, streamed one sub-group at a time through two pool buffers. Resets
  // last_step() to 0. Errors: the callback's, I/O errors (agreed), ResourceExhausted (pool).
  Status Initialize(const InitialWeights& initial_fp32);

  // Collective. One optimizer step (step >= 1) over every sub-group not already at `step`:
  // swap in (flush gradients first), CpuAdam::Step, swap out, commit, sink. See the top of the
  // file for what an error leaves behind. `source` empty (a default-constructed GradientSource):
  // the gradient swapper's gradient, gradient_swapper()->Source(); FailedPrecondition without a
  // gradient swapper (options.swap_gradients off), agreed on before any sub-group is stepped.
  Status Step(std::int64_t step, const GradientSource& source, const ParamSink& sink,
              const StepOptions& options = {});

  // Collective: waits for the gradient swapper's writes (DeepSpeed's flush_gradients) and agrees
  // on their status. OK without a gradient swapper.
  Status FlushGradients();

  // Local. Reads elements [offset_elems, offset_elems + out.size()) of a sub-group's committed
  // state tensor through one pool buffer, or through `staging` when given (aligned to 4 KiB and
  // at least out.size() * 4 + 2 x the store's alignment bytes: for a reader whose pool buffers
  // may all be leased, e.g. by the gradient swapper in the middle of a micro-batch).
  // Errors: InvalidArgument (range, staging too small), ResourceExhausted (no free buffer), I/O
  // errors. `backend` (default: the swapper's read backend) is one from CreateReaderBackend for a
  // reader on another thread: with it, ReadState of the fp32 weights may run there while this
  // thread makes any call but Step, WriteState, WriteQ8State and Close (those change what the
  // committed state is).
  Status ReadState(std::size_t sub_group, StateTensor which, std::uint64_t offset_elems,
                   std::span<float> out, std::span<std::byte> staging = {},
                   storage::IoBackend* backend = nullptr);
  // Local: a backend like the swapper's own (kind, options, options.io_backend_wrapper as a read
  // backend) for ReadState on another thread; no pool buffers are registered with it.
  Result<std::unique_ptr<storage::IoBackend>> CreateReaderBackend() const;
  // (q8: the moments are dequantized from the sub-group's whole moments tensor.)
  // Local. Writes a whole new state of a sub-group (e.g. restored from a checkpoint):
  // `fill(which, span)` fills each state tensor (sub-group numel elements), the state goes to the
  // spare slot and is committed with last_step() = `step` once written. On error the old state
  // stays committed. q8: the moments are quantized (FailedPrecondition for a non-finite value).
  // Errors: the callback's, ResourceExhausted (3 buffers), I/O errors.
  Status WriteState(std::size_t sub_group, std::int64_t step,
                    const std::function<Status(StateTensor, std::span<float>)>& fill);

  // q8 only (FailedPrecondition otherwise), local: the exact quantized state, for checkpoints.
  // ReadQ8Moments reads a sub-group's committed moments into a pool buffer and calls `use` with
  // them (the spans die after the call). WriteQ8State writes a whole new state like WriteState,
  // `fill_fp32` filling the weights and `fill_moments` the codes and scales, as they are.
  Status ReadQ8Moments(std::size_t sub_group, const std::function<Status(const Q8Moments&)>& use);
  Status WriteQ8State(std::size_t sub_group, std::int64_t step,
                      const std::function<Status(std::span<float>)>& fill_fp32,
                      const std::function<Status(const Q8Moments&)>& fill_moments);

  // ---- Speculation (the engine's speculative step, engine.h "Speculative step") ----
  // A swapped sub-group can be stepped ahead of Step (during the backward pass, once its
  // gradient is final) from its committed state into a spare slot of its own, without
  // committing: Step's caller then commits it, which makes it as if Step had stepped it with the
  // same arguments, or discards it, which leaves the committed state as it was. Speculate and
  // FinishSpeculation may run on a thread other than the swapper's (one at a time) while that
  // thread makes no call but ReadState and the accessors: they use backends of their own, pool
  // buffers, and spare slots beyond the one Step needs (SwapperOptions::speculative_slots).
  //
  // A resident sub-group is speculated into the second copy of its state
  // (SwapperOptions::speculate_resident) instead, and committed by swapping the two.
  //
  // Local. Steps sub-group `sub_group` (speculable()) at `step` with `grad` (its numel elements,
  // unchanged until the call returns) and `options` (as Step would: the same arguments give the
  // same bits): reads its committed state, runs Adam, copies the new fp32 weights into
  // `weights` unless it is empty (numel elements), and writes the state into a spare slot; the
  // writes complete by the next Speculate or FinishSpeculation, which report their errors.
  // `next`: the sub-group the next call will speculate, read ahead while this one's Adam runs
  // when the pool has the buffers (a next call for another one drops it).
  // Errors: FailedPrecondition (a sub-group not speculable, speculated, or already at `step`; no
  // spare slot left), ResourceExhausted (pool), I/O errors, Adam's; on error the sub-group is
  // not speculated and its committed state is as it was.
  Status Speculate(std::int64_t step, std::size_t sub_group, std::span<const float> grad,
                   const StepOptions& options, std::span<float> weights,
                   std::optional<std::size_t> next = std::nullopt);
  // Local: waits for the speculated writes in flight (one that failed is not speculated) and
  // drops a read ahead.
  Status FinishSpeculation();
  // Local, on the swapper's thread after FinishSpeculation: the speculated state of `sub_group`
  // becomes its committed state, at the step it was speculated for. Precondition (checked):
  // speculated(sub_group).
  void CommitSpeculated(std::size_t sub_group);
  // Local, on the swapper's thread: waits for the writes in flight and forgets every
  // speculation (their slots are spare again).
  void DiscardSpeculations();
  bool speculated(std::size_t sub_group) const { return speculated_.at(sub_group).has_value(); }
  // Swapped with speculative slots, or resident with a second copy.
  bool speculable(std::size_t sub_group) const;
  std::size_t num_speculated() const;

  // Collective: min/mean/max of the swap timers over ranks, logged by rank 0.
  Status LogTimers(std::string_view title = "optimizer swapper timers");
  // Local: closes (and unless `keep`, removes) the store. Idempotent.
  Status Close();

  // Accessors.
  std::string_view mode_name() const { return mode_name_; }  // "partitioned" / "pipelined"
  const comm::Communicator& comm() const { return comm_; }
  const partition::PartitionPlan& plan() const { return plan_; }
  const partition::SubGroupPlan& sub_groups() const { return sub_groups_; }
  std::size_t num_sub_groups() const { return infos_.size(); }
  const SubGroupSwapInfo& swap_info(std::size_t sub_group) const { return infos_.at(sub_group); }
  storage::SwapStore& store() { return *store_; }
  BufferPool& pool() { return *pool_; }
  CpuAdam& adam() { return adam_; }
  comm::Timers& timers() { return timers_; }
  const SwapperOptions& options() const { return options_; }
  // nullptr unless options.swap_gradients.
  GradientSwapper* gradient_swapper() { return gradient_swapper_.get(); }
  // The step last committed to a sub-group (0 after Initialize).
  std::int64_t last_step(std::size_t sub_group) const { return last_step_.at(sub_group); }
  StateFormat state_format() const { return options_.state_format; }
  // Slot holding a sub-group's committed state; its slot tensors (fp32: 3, q8: 2), their names
  // ("slot<k>/fp32", ...) and their I/O sizes for a sub-group.
  std::size_t slot_of(std::size_t sub_group) const { return slot_of_.at(sub_group); }
  std::size_t num_slot_tensors() const;
  std::string SlotTensorName(std::size_t slot, std::size_t tensor) const;
  std::uint64_t SlotTensorIoBytes(std::size_t sub_group, std::size_t tensor) const;
  // Bytes one step reads and writes (slot tensors of the swapped sub-groups, I/O-aligned;
  // gradients not included), and those per element of the partition.
  std::uint64_t StateIoBytesPerStep() const;
  double StateIoBytesPerElement() const;
  // The host memory tier: whether a sub-group's state is resident (never swapped), how many are,
  // and the bytes they hold.
  bool resident(std::size_t sub_group) const { return !resident_.at(sub_group).empty(); }
  std::size_t num_resident() const;
  std::uint64_t resident_bytes() const;
  // Whether the swapper has a swap store (not with all_resident); store() requires one.
  bool has_store() const { return store_ != nullptr; }
  // The store's I/O counters, zero without a store.
  storage::SwapStore::IoCounters io_counters() const;

 protected:
  struct Parts;  // what Create builds; see optimizer_swapper.cc
  OptimizerSwapper(std::string_view mode_name, Parts&& parts);

  // What a backend has reported so far to IoBatch::WaitFor: the ids completed, and the first
  // failure (whose request is not known: a backend reports failures without ids).
  struct Completions {
    std::unordered_set<std::uint64_t> ids;
    std::optional<Error> failure;
  };
  // The requests one backend has in flight for one sub-group, labelled for error messages.
  class IoBatch {
   public:
    void Add(const std::vector<std::uint64_t>& ids, std::string label);
    bool empty() const { return ids_.empty(); }
    // Drains `backend` (every pending request); on failure the error names the failed labels.
    Status Wait(storage::IoBackend& backend);
    // Waits until this batch's requests have completed, leaving the backend's other requests in
    // flight; `seen` collects what the backend reports, for the backend's other batches. After a
    // failure on the backend it drains the backend and fails if any of its requests did not
    // complete (naming their labels). Empties the batch.
    Status WaitFor(storage::IoBackend& backend, Completions* seen);

   private:
    std::vector<std::uint64_t> ids_;
    std::vector<std::string> labels_;
  };

  static constexpr std::size_t kMaxBuffersPerSubGroup = 4;
  std::size_t buffers_per_sub_group() const { return BuffersPerSubGroup(options_.state_format); }

  // Where one sub-group's slot tensors are while it is stepped or moved: pool buffers (in any
  // order: the swappers rotate their buffers between roles) or its resident memory.
  struct StateBuffers {
    std::array<std::span<std::byte>, kNumStateTensors> tensors;  // slot tensor t
    std::span<float> floats(std::size_t t) const;
  };
  // Buffers 0..num_slot_tensors()-1 of `lease`.
  StateBuffers LeaseBuffers(const PoolLease& lease) const;
  // The resident memory of a resident sub-group.
  StateBuffers ResidentBuffers(std::size_t sub_group) const;
  // Copies the sub-group's slot tensors (their I/O bytes) from `from` to `to`; a tensor already
  // in place is left alone.
  void CopyState(std::size_t sub_group, const StateBuffers& from, const StateBuffers& to) const;

  Status SubmitStateRead(std::size_t sub_group, std::size_t tensor, std::span<std::byte> buffer,
                         storage::IoBackend& backend, IoBatch* batch);
  Status SubmitStateReads(std::size_t sub_group, const StateBuffers& buffers,
                          storage::IoBackend& backend, IoBatch* batch);
  Status VerifyStateReads(std::size_t sub_group, const StateBuffers& buffers) const;
  // Takes the spare slot and submits the writes of the slot tensors to it, in `order` (default
  // 0, 1, ...); one request list per tensor goes to `batches[t]` (or all to batches[0]).
  Result<std::size_t> SubmitStateWrites(std::size_t sub_group, const StateBuffers& buffers,
                                        storage::IoBackend& backend, std::span<IoBatch> batches,
                                        std::span<const std::size_t> order = {});
  // Local: reads bytes [begin, begin + buffer.size()) of slot tensor `name` (I/O-aligned) into
  // `buffer` on `backend`, waits and verifies (verify_swap); errors prefixed by `context`.
  Status ReadSlotTensor(const std::string& name, std::uint64_t begin, std::span<std::byte> buffer,
                        const std::string& context, storage::IoBackend& backend);
  // Makes `buffers` the committed state of the sub-group at `step`: written to the spare slot
  // and committed, or copied into its resident memory.
  Status WriteAndCommit(std::size_t sub_group, std::int64_t step, const StateBuffers& buffers,
                        const std::string& context);
  // After the writes to `slot` completed: the sub-group's state is now in `slot`.
  void Commit(std::size_t sub_group, std::size_t slot, std::int64_t step);
  // After the writes to `slot` failed: `slot` is spare again.
  void Abandon(std::size_t slot);
  // The sub-group's gradient (its numel) from `source`: a view, or filled into `scratch`.
  Result<std::span<const float>> Gradient(std::size_t sub_group, const GradientSource& source,
                                          std::span<float> scratch);
  // Adam on the slot tensors in `buffers` with the gradient `grad`.
  Status Compute(std::int64_t step, std::size_t sub_group, const StateBuffers& buffers,
                 std::span<const float> grad, const StepOptions& options);
  // Hands the committed weights `fp32` to the sink (bf16_params: rounded into `scratch`, a buffer
  // of at least numel * 2 bytes that is free now).
  Status Sink(std::size_t sub_group, std::span<const float> fp32, std::span<std::byte> scratch,
              const ParamSink& sink);
  // Steps up to `limit` resident sub-groups not yet at `step`, in place (q8: through `work`'s
  // first num_slot_tensors() buffers, copied back on success, since its encoder can fail midway);
  // `scratch` is a free pool buffer for a filled gradient and bf16 weights. Returns at the first
  // failure.
  Status StepResident(std::int64_t step, const GradientSource& source, const ParamSink& sink,
                      const StepOptions& options, std::span<float> scratch,
                      const StateBuffers& work, std::size_t limit = SIZE_MAX);
  // The resident sub-groups not yet at `step`.
  std::size_t ResidentTodo(std::int64_t step) const;
  // The swapped sub-groups not yet at `step`, in order.
  std::vector<std::size_t> SwappedTodo(std::int64_t step) const;
  // Step's local part, between the gradient flush and FinishStep: the mode's pass over the
  // sub-groups, with `source` never empty.
  virtual Status StepLocal(std::int64_t step, const GradientSource& source, const ParamSink& sink,
                           const StepOptions& options) = 0;
  // Flushes the gradient swapper unless `local` (the caller's checks) failed, and agrees on the
  // result (collective).
  Status FlushGradientsCollective(std::int64_t step, Status local);
  // "step 3, sub-group 2 of 5 (2 of 5 took the step): "
  std::string StepContext(std::int64_t step, std::size_t sub_group) const;
  // Ends a Step: agrees on `local` over comm_.
  Status FinishStep(std::int64_t step, Status local);

  storage::IoBackend& read_engine() { return *read_engine_; }
  // Both swappers read on one backend and write on another (a ring and thread each), so that
  // reads and writes overlap.
  storage::IoBackend& write_engine() { return *write_engine_; }

  SwapperOptions options_;
  comm::Communicator comm_;
  partition::PartitionPlan plan_;
  partition::SubGroupPlan sub_groups_;
  std::vector<SubGroupSwapInfo> infos_;
  std::unique_ptr<storage::SwapStore> store_;
  std::unique_ptr<storage::IoBackend> read_engine_;
  std::unique_ptr<storage::IoBackend> write_engine_;
  std::unique_ptr<BufferPool> pool_;
  std::unique_ptr<GradientSwapper> gradient_swapper_;
  CpuAdam adam_;
  comm::Timers timers_;
  std::vector<std::size_t> slot_of_;  // swapped sub-groups only
  std::vector<std::size_t> spare_slots_;
  std::vector<std::int64_t> last_step_;
  // Per sub-group: its slot tensors in host memory when resident, else empty.
  std::vector<std::vector<storage::AlignedBuffer>> resident_;
  // A resident sub-group whose in-place WriteState failed: its state is lost until one succeeds.
  std::vector<bool> damaged_;
  // Speculation: per sub-group the slot and step of its speculated state, if any; the backends,
  // and the writes in flight (optimizer_swapper.cc).
  struct Speculated {
    std::size_t slot = 0;  // kResidentSlot: in resident_spare_
    std::int64_t step = 0;
  };
  static constexpr std::size_t kResidentSlot = SIZE_MAX;
  std::vector<std::optional<Speculated>> speculated_;
  // speculate_resident: per resident sub-group the second copy of its state (else empty).
  std::vector<std::vector<storage::AlignedBuffer>> resident_spare_;
  struct SpeculationIo;
  std::unique_ptr<SpeculationIo> speculation_;
  void DropReadAhead();   // waits for the reads ahead and forgets them
  Status FinishWrites();  // FinishSpeculation's writes
  Status CheckNotDamaged(std::size_t sub_group) const;

 private:
  // Speculate's parts. FailedPrecondition or InvalidArgument unless `sub_group` can be
  // speculated at `step` with `grad` and `weights` of its size.
  Status CheckSpeculable(std::int64_t step, std::size_t sub_group, std::span<const float> grad,
                         std::span<float> weights, const std::string& context) const;
  // A resident sub-group, stepped in its second copy.
  Status SpeculateResident(std::int64_t step, std::size_t sub_group, std::span<const float> grad,
                           const StepOptions& options, std::span<float> weights,
                           const std::string& context);
  // The speculation's backends, created on first use.
  Status StartSpeculationIo();
  // The committed state of `sub_group` in a lease: read ahead by the last call, or read now.
  Result<PoolLease> SwapInSpeculated(std::size_t sub_group, const std::string& context);
  // Starts reading `next`'s state while Adam runs, when it is swapped, not speculated, not
  // `sub_group` and the pool has the buffers.
  void ReadAhead(std::size_t sub_group, std::optional<std::size_t> next);
  // Submits the writes of the stepped `lease` to a spare slot (waited for by FinishWrites).
  Status SwapOutSpeculated(std::int64_t step, std::size_t sub_group, PoolLease lease,
                           const std::string& context);

  friend Result<std::unique_ptr<OptimizerSwapper>> CreateOptimizerSwapper(
      const comm::Communicator& comm, const partition::PartitionPlan& plan,
      const SwapperOptions& options);
  std::string mode_name_;
};

// The host memory a swapper built from these arguments allocates per rank, without building it
// (the engine's memory plan, engine/src/memory_plan.h): computed by the same functions Create
// sizes its allocations with, so plan and allocation cannot drift. `alignment_bytes`: the swap
// store's direct-I/O alignment (known once the store is open; 4096 is the usual one, and the
// pool's buffers are aligned to at least 4096 either way). Local; allocates nothing.
struct SwapperHostPlan {
  std::uint64_t pool_bytes = 0;      // BufferPool: buffer count x buffer bytes
  std::uint64_t pool_buffers = 0;    // its buffer count
  std::uint64_t resident_bytes = 0;  // the host tier (zinf.host_cache_bytes; all with device cpu)
  std::uint64_t resident_spare_bytes = 0;  // its second copy with speculate_resident
  // The gradient swapper's host share: the whole partition gradient when it accumulates in
  // memory, the unswapped remainders when it reads, adds and writes; 0 without swap_gradients.
  std::uint64_t gradient_bytes = 0;
  std::uint64_t max_sub_group_numel = 0;
};
// Errors: those of the sub-group plan (InvalidArgument) and of the pool sizing
// (ResourceExhausted: a budget below the mode's minimum, the message Create gives).
Result<SwapperHostPlan> PlanSwapperHostMemory(const partition::PartitionPlan& plan, int rank,
                                              const SwapperOptions& options,
                                              std::uint64_t alignment_bytes = 4096);

// Collective over `comm`. Builds the swapper for `options`: the PipelinedOptimizerSwapper when
// pipeline_read or pipeline_write is set and the pool holds PipelinedOptimizerSwapper::MinBuffers
// (fp32: 10, q8: 7), else the synchronous PartitionedOptimizerSwapper (with a WARN line
// when a pipeline was asked for but the budget is too small). Steps: sub-group plan of this rank,
// store Open, pool, backends, collective free-space preflight (bytes summed per file system over the
// ranks of each node), Reserve. Logs (rank 0) the mode, sub-groups, pool size, backends and store.
// Errors (same on every rank): InvalidArgument (options), ResourceExhausted (pool budget below 4
// buffers, q8: 3, naming the minimum; not enough disk space on a node, naming host, path, needed
// and available bytes), store and backend errors. The pool's buffers hold one fp32 tensor of the
// largest sub-group each, so a q8 sub-group needs 3 of them instead of 4: the same budget takes 4/3
// larger sub-groups.
Result<std::unique_ptr<OptimizerSwapper>> CreateOptimizerSwapper(
    const comm::Communicator& comm, const partition::PartitionPlan& plan,
    const SwapperOptions& options);

}  // namespace zinf::swapper
