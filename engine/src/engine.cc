// ZeroEngine (engine.h): the ZeRO step over the user's parameters. The step is a sequence of named
// parts, each collective: HandGradient (the micro-batch's buckets reduce-scattered into the
// partition gradient, gradient_buckets.h), the global norm, the swapped Adam step, Gather (the
// updated partitions into the user's weights), Report (log, live line, metrics).
// Each part lives in the file of its concept (engine_impl.h lists them); this one holds Create
// and Build, Step and its phases, Close, and ZeroEngine's calls forwarding to Impl's.
#include "zinf/engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "engine_impl.h"
#include "zinf/comm/timers.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/stop_signals.h"
#include "zinf/core/units.h"
#include "zinf/engine/config_options.h"

namespace zinf::engine {

namespace {

using comm::ReduceOp;

// Where stage 3 keeps this rank's shards, for the log.
std::string ShardWhereabouts(const config::Config& config, std::uint64_t in_memory,
                             std::uint64_t partition_numel) {
  if (config.zero_optimization.offload_param.device != config::OffloadDevice::kNvme) {
    return "in host memory";
  }
  if (in_memory == 0) return "read from the swap store when gathered";
  return fmt::format(
      "in host memory up to partition element {} of {} (offload_param.max_in_cpu), beyond it "
      "read from the swap store when gathered",
      in_memory, partition_numel);
}

// The parameters as a layout, after checking every buffer against its shape and the stage.
Result<partition::ParamLayout> LayoutOf(const std::vector<Param>& params, int stage) {
  if (params.empty()) return InvalidArgumentError("engine: no parameters");
  std::vector<partition::ParamSpec> specs;
  specs.reserve(params.size());
  for (const Param& p : params) specs.push_back({p.name, p.shape});
  ZINF_ASSIGN_OR_RETURN(partition::ParamLayout layout,
                        Annotate(partition::ParamLayout::Create(std::move(specs)), "engine: "));
  const bool lent = params[0].grads.empty();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const partition::ParamInfo& info = layout.params()[i];
    const std::string name = EscapeForTerminal(info.name);
    const bool no_weights = params[i].weights.empty();
    const bool no_grads = params[i].grads.empty();
    if ((!no_weights && params[i].weights.size() != info.numel) ||
        (!no_grads && params[i].grads.size() != info.numel)) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' of shape {} has {} elements, but its weights buffer holds "
          "{} and its grads buffer {}",
          i, name, partition::FormatShape(info.shape), info.numel, params[i].weights.size(),
          params[i].grads.size()));
    }
    if (no_weights && stage != 3) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' has no weights buffer: only zero_optimization.stage 3 "
          "partitions parameters (this config has stage {})",
          i, name, stage));
    }
    if (no_grads != lent) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' {} a grads buffer and parameter 0 '{}' {}: register "
          "grads for every parameter, or for none and lend them with GradientReady(index, grad)",
          i, name, no_grads ? "has no" : "has", EscapeForTerminal(layout.params()[0].name),
          lent ? "has none" : "has one"));
    }
  }
  if (lent && stage < 2) {
    return InvalidArgumentError(
        "engine: the parameters have no grads buffers: lent gradients (GradientReady(index, "
        "grad)) are partitioned as they arrive, which needs zero_optimization.stage 2 or 3 "
        "(stage 1 keeps the whole gradient)");
  }
  // A buffer registered twice (two names, or weights and grads alike) would be written twice
  // per step: its parameters would silently train on each other's values.
  struct Buffer {
    const float* begin;
    const float* end;
    std::size_t param;
    const char* what;
  };
  std::vector<Buffer> buffers;
  for (std::size_t i = 0; i < params.size(); ++i) {
    for (auto [span, what] :
         {std::pair{params[i].weights, "weights"}, {params[i].grads, "grads"}}) {
      if (!span.empty()) buffers.push_back({span.data(), span.data() + span.size(), i, what});
    }
  }
  std::sort(buffers.begin(), buffers.end(),
            [](const Buffer& x, const Buffer& y) { return x.begin < y.begin; });
  for (std::size_t i = 1; i < buffers.size(); ++i) {
    const Buffer& a = buffers[i - 1];
    const Buffer& b = buffers[i];
    if (b.begin < a.end) {
      return InvalidArgumentError(fmt::format(
          "engine: the {} buffer of parameter '{}' overlaps the {} buffer of parameter '{}'; "
          "every parameter needs weights and grads of its own",
          b.what, EscapeForTerminal(layout.params()[b.param].name), a.what,
          EscapeForTerminal(layout.params()[a.param].name)));
    }
  }
  return layout;
}

}  // namespace

ZeroEngine::ZeroEngine(const comm::Communicator& world, const config::Config& config,
                       const EngineOptions& options)
    : impl_(std::make_unique<Impl>(this, world, config, options)) {}

ZeroEngine::~ZeroEngine() = default;

ZeroEngine::Impl::Impl(ZeroEngine* self, const comm::Communicator& world,
                       const config::Config& config, const EngineOptions& options)
    : self_(self),
      world_(world),
      config_(config),
      options_(options),
      state_(std::make_unique<State>()) {
  state_->scaler.emplace(config.fp16);
}

ZeroEngine::Impl::~Impl() {
  if (closed_) return;
  // Local: a garbage collector runs a destructor at different times on different ranks, so it
  // never waits for them. They are told, so that none waits for this rank in a collective.
  if (state_->swapper) {
    ZINF_LOG_WARN(
        "engine: destroyed without Close(): closed on this rank only; another rank "
        "that waits for it in a collective of this engine ends the job");
  }
  CloseLocally("its engine was destroyed without Close()");
}

const comm::Communicator& ZeroEngine::Impl::comm() const {
  return state_->comm ? *state_->comm : world_;
}

void ZeroEngine::Impl::CloseLocally(std::string_view reason) {
  closed_ = true;
  State& s = *state_;
  s.buckets.reset();     // joins its worker before the swapper goes
  s.speculator.reset();  // likewise, and waits for its writes
  s.reader.reset();      // likewise
  if (s.comm && !reason.empty()) {
    s.comm->Leave(fmt::format("rank {}: {}", world_.rank(), reason));
  }
  Status metrics = s.metrics.Close(options_.metrics_path);
  if (!metrics) ZINF_LOG_WARN("engine: {}", metrics.error().ToString());
  s.swapper.reset();  // drains its I/O, then closes (and unless keep_swap removes) the store
  s.stop_signals.reset();
}

void ZeroEngine::Impl::Detach(std::string_view reason) {
  if (!closed_ && state_->comm) {
    state_->comm->Leave(fmt::format("rank {}: {}", world_.rank(), reason), "Close");
  }
}

Status ZeroEngine::Impl::AgreeOnCall(std::string_view call, const Status& local) {
  if (closed_) return FailedPreconditionError(fmt::format("engine: {} after Close", call));
  if (state_->buckets) state_->buckets->WaitIdle();
  return comm().AgreeOnCall(call, local);
}

const partition::ParamLayout& ZeroEngine::Impl::layout() const { return state_->plan->layout(); }

double ZeroEngine::Impl::loss_scale() const { return state_->scaler->scale(); }

Result<std::unique_ptr<ZeroEngine>> ZeroEngine::Create(const comm::Communicator& world,
                                                       const config::Config& config,
                                                       std::vector<Param> params,
                                                       const EngineOptions& options) {
  std::unique_ptr<ZeroEngine> engine(new ZeroEngine(world, config, options));
  Impl& impl = *engine->impl_;
  Status created = impl.Build(std::move(params));
  if (created) created = impl.InitializeOrRestore();
  if (!created) {
    impl.CloseLocally({});  // agreed: every rank drops its engine here, nobody to tell
    return std::move(created).error();
  }
  Impl::State& s = *impl.state_;
  s.last_step_end = MonotonicSeconds();
  s.loop_start = s.last_step_end;
  s.io_mark = s.swapper->io_counters();
  s.first_step = impl.step_ + 1;
  return engine;
}

Status ZeroEngine::Impl::Build(std::vector<Param> params) {
  State& s = *state_;
  s.rss_before_engine = CurrentRssBytes();
  if (Status usable = config::CheckEngineConfig(config_); !usable) {
    return comm().AgreeOnStatus(std::move(usable));
  }
  if (config_.world_size != world_.size()) {
    return comm().AgreeOnStatus(InvalidArgumentError(fmt::format(
        "engine: the config was parsed for {} ranks, the world has {} (batch sizes depend on it)",
        config_.world_size, world_.size())));
  }
  ZINF_ASSIGN_OR_RETURN(partition::ParamLayout layout, AdoptParams(std::move(params)));
  // Speculating, every rank owns a part of every parameter (as at stage 3), so that each rank's
  // partition fills from its end as the backward pass goes: a flat partition of the first
  // parameters would complete only when the pass ends.
  const bool speculating = SpeculationWanted(
      config_.zinf.swap_gradients,
      config_.zero_optimization.offload_optimizer.device == config::OffloadDevice::kCpu);
  ZINF_RETURN_IF_ERROR(PlanPartition(layout, speculating));
  ZINF_ASSIGN_OR_RETURN(swapper::SwapperOptions options, PlanMemory(speculating));
  ZINF_RETURN_IF_ERROR(AllocateWeightBuffers());
  ZINF_RETURN_IF_ERROR(CreateSwapper(options));
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(CreateBuckets()));
  config_.zinf.speculative_step = s.speculator != nullptr;  // what config() reports

  if (options_.stop_signals) s.stop_signals.emplace();
  // Rank 0 appends to the metrics of a resumed run and starts a fresh file otherwise: opened
  // after the restore decides which (InitializeOrRestore).
  s.tty = options_.progress && world_.rank() == 0 && isatty(STDERR_FILENO) == 1;
  return OkStatus();
}

// Checks the parameters against their shapes and the groups (each rank its own buffers, agreed
// before the first collective), then adopts them and dups the engine's communicator.
Result<partition::ParamLayout> ZeroEngine::Impl::AdoptParams(std::vector<Param> params) {
  State& s = *state_;
  // Every rank checks its own buffers; agree before the first collective.
  Result<partition::ParamLayout> layout = LayoutOf(params, config_.zero_optimization.stage);
  Result<std::vector<HyperParams>> groups =
      ResolveGroups(config_.optimizer, options_.param_groups, params);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(!layout   ? Status(layout.error())
                                            : !groups ? Status(groups.error())
                                                      : OkStatus()));
  groups_ = std::move(*groups);
  s.params = std::move(params);
  // The engine's own failure domain (comm/communicator.h): its agreements wait at most
  // zinf.collective_timeout_seconds, and end at once when a rank destroys its engine.
  ZINF_ASSIGN_OR_RETURN(s.comm, world_.DupDomain());
  s.comm->SetWaitTimeout(std::chrono::seconds(config_.zinf.collective_timeout_seconds));
  return std::move(*layout);
}

// The partition plan (per parameter while speculating), the runs of parameter groups in this
// rank's partition, and the holding plan (stage 3).
Status ZeroEngine::Impl::PlanPartition(const partition::ParamLayout& layout, bool speculating) {
  State& s = *state_;
  ZINF_ASSIGN_OR_RETURN(s.plan, partition::PartitionPlan::Create(
                                    layout, {.kind = speculating ? partition::PlanKind::kPerParam
                                                                 : ToPlanKind(config_),
                                             .world_size = world_.size(),
                                             .alignment_elems = kPartitionAlignmentElems}));
  s.total_numel = s.plan->layout().total_numel();
  s.partition_numel = s.plan->partition_numel();
  for (const partition::Fragment& f : s.plan->RankFragments(world_.rank())) {
    const std::size_t g = s.params[f.param_index].group;
    if (s.group_runs.empty()) {
      s.group_runs.emplace_back(0, g);
    } else if (s.group_runs.back().second != g) {
      s.group_runs.emplace_back(f.partition_offset, g);
    }
  }
  if (s.group_runs.empty()) s.group_runs.emplace_back(0, 0);  // a rank of padding only
  if (s.partition_numel > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    return comm().AgreeOnStatus(InvalidArgumentError(fmt::format(
        "engine: {} parameters per rank exceed what one MPI collective moves ({}); run on more "
        "ranks",
        s.partition_numel, std::numeric_limits<int>::max())));
  }
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(s.PlanHolding(config_)));
  if (speculating) ShapeForSpeculation(s.partition_numel);
  return OkStatus();
}

// Logs the partition and how stage 3 holds the parameters, then allocates the shards kept in
// memory, the persistent parameters' weights and the all-gather rounds, and creates the
// collective backend.
Status ZeroEngine::Impl::AllocateWeightBuffers() {
  State& s = *state_;
  std::uint64_t whole_numel = 0;
  for (const auto& [begin, end] : s.whole_ranges) whole_numel += end - begin;
  const std::uint64_t round = s.GatherRound(config_, world_.size());
  ZINF_LOG_INFO(
      "engine: {} parameters in {} tensors; partition {} elements per rank; weights held whole "
      "gathered in {} round(s) of {} elements per rank",
      s.total_numel, s.params.size(), s.partition_numel, (whole_numel + round - 1) / round, round);
  if (config_.zero_optimization.stage == 3) {
    std::size_t loop = 0, persistent = 0;
    for (Holding h : s.holding) {
      loop += h == Holding::kLoop ? 1 : 0;
      persistent += h == Holding::kPersistent ? 1 : 0;
    }
    ZINF_LOG_INFO(
        "engine: stage 3: {} parameter(s) partitioned (shards {}), {} persistent (whole on every "
        "rank, at most {} elements each), {} whole in the loop's weights buffers",
        s.num_partitioned, ShardWhereabouts(config_, s.shard_numel, s.partition_numel), persistent,
        config_.zero_optimization.stage3_param_persistence_threshold, loop);
  }
  s.shard.assign(s.shard_numel, 0.0f);
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    if (s.holding[p] == Holding::kPersistent)
      s.whole[p].assign(s.plan->layout().param(p).numel, 0.0f);
  }
  s.gather_send.assign(round, 0.0f);
  s.gather_recv.assign(round * static_cast<std::uint64_t>(world_.size()), 0.0f);
  ZINF_ASSIGN_OR_RETURN(s.backend, comm::CreateCollectiveBackend(*s.comm, comm::BackendKind::kMpi));
  return OkStatus();
}

// The swap directories (EngineOptions::create_nvme_paths), the swapper (without the speculation's
// second slots when they do not fit and were not asked for), the shard reader, and the partition
// gradient (in memory) or its staging (with a gradient swapper).
Status ZeroEngine::Impl::CreateSwapper(swapper::SwapperOptions& options) {
  State& s = *state_;
  if (options_.create_nvme_paths) {
    Status created = OkStatus();
    for (const std::string& path :
         config_.zero_optimization.offload_optimizer.resolved_nvme_paths) {
      std::error_code ec;
      std::filesystem::create_directories(path, ec);
      if (ec) {
        created = ErrnoError(ec.value(), fmt::format("create swap directory {}", path));
        break;
      }
    }
    ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(created));
  }
  ZINF_LOG_INFO("engine: job id {}", options.store.job_id);
  Result<std::unique_ptr<swapper::OptimizerSwapper>> created =
      swapper::CreateOptimizerSwapper(*s.comm, *s.plan, options);
  if (!created && options.speculative_slots > 0 &&
      created.error().code() == ErrorCode::kResourceExhausted) {
    // The speculation's second slots do not fit (the same error on every rank): unasked for,
    // it gives way; asked for, the error says what it costs.
    if (config_.Gave("zinf.speculative_step")) {
      return std::move(created).error().WithContext(
          "zinf.speculative_step keeps a second slot per swapped sub-group (false halves the "
          "swap store): ");
    }
    ZINF_LOG_INFO(
        "engine: no speculative step: the swap store with a second slot per sub-group does not "
        "fit ({}); set zinf.speculative_step to decide",
        created.error().message());
    options.speculative_slots = 0;
    created = swapper::CreateOptimizerSwapper(*s.comm, *s.plan, options);
  }
  ZINF_RETURN_IF_ERROR(created);
  s.swapper = std::move(*created);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(s.CreateReader(config_)));
  if (s.swapper->gradient_swapper() == nullptr) {
    s.partition_grad.assign(s.partition_numel, 0.0f);
  } else {
    ZINF_ASSIGN_OR_RETURN(
        s.staging, storage::AlignedBuffer::Allocate(s.partition_numel * sizeof(float),
                                                    {.register_cuda = false, .zero = false}));
  }
  return OkStatus();
}

// Step in its phases: reduce the gradient, measure it (norm, loss, stop flag), decide (skip an
// fp16 overflow, refuse a zero or non-finite gradient, clip), optimize (the swapped Adam step at
// the scheduled hyper-parameters), gather the new weights, then report (FinishStep).
Result<StepInfo> ZeroEngine::Impl::Step(std::optional<double> loss) {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: Step after Close");
  StepInfo info;
  info.step = step_ + 1;
  // The step's swap I/O counts from the end of the previous one: earlier micro-batches'
  // write-behind and the swap-outs during the backward pass.
  const storage::SwapStore::IoCounters io_start = s.io_mark;
  // The speculation takes no more sub-groups (those the rest of the reduction completes are the
  // swapper's Step's); whatever this Step does not commit is discarded on the way out.
  if (s.speculator) s.speculator->Seal();
  struct Discard {
    Impl* impl;
    ~Discard() { impl->DiscardSpeculation(nullptr); }
  } discard{this};
  ZINF_RETURN_IF_ERROR(ReduceGradients(info.step));
  Status speculation = OkStatus();
  if (s.speculator && s.speculator->armed()) {
    speculation = s.speculator->Stop();
    info.speculated = s.swapper->num_speculated();
  }
  ZINF_ASSIGN_OR_RETURN(StepPlan plan, MeasureGradient(loss, &info));
  ZINF_RETURN_IF_ERROR(Decide(loss.has_value(), &plan, &info));
  const storage::SwapStore::IoCounters io_optimizer_start = s.swapper->io_counters();
  if (plan.skip) {
    // No swap I/O, the weights and the schedule stay; the gradient was consumed.
    DiscardSpeculation(&info);
    ZINF_RETURN_IF_ERROR(s.scaler->Update(/*overflow=*/true));
    return FinishStep(info, /*skipped=*/true, io_start, io_optimizer_start, io_optimizer_start,
                      0.0);
  }
  s.last_step_clipped = info.clipped;
  // A failed speculation fails the step on every rank, with nothing stepped (a step that is
  // skipped needs none of it).
  if (s.speculator) ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(speculation));
  ZINF_ASSIGN_OR_RETURN(const double optimizer_seconds, Optimize(plan, &info));
  const storage::SwapStore::IoCounters io_optimizer_end = s.swapper->io_counters();
  // The scale for the next step (a clean step may double it).
  ZINF_RETURN_IF_ERROR(s.scaler->Update(/*overflow=*/false));
  // The updated partitions into every parameter's weights.
  step_ = info.step;
  ZINF_RETURN_IF_ERROR(GatherWholeWeights());
  return FinishStep(info, /*skipped=*/false, io_start, io_optimizer_start, io_optimizer_end,
                    optimizer_seconds);
}

// Reduce: the last micro-batch's gradient is reduced (the earlier ones were), after the ranks
// agreed that they all make this call the same way: a rank whose loop made other calls must not
// leave the rest in a collective it skips.
Status ZeroEngine::Impl::ReduceGradients(std::int64_t step) {
  State& s = *state_;
  const int gas = static_cast<int>(config_.gradient_accumulation_steps);
  Status calls = OkStatus();
  if (s.micro_batches != 0 && s.micro_batches != gas - 1) {
    calls = FailedPreconditionError(
        fmt::format("engine: step {}: AccumulateGradients was called {} times; with "
                    "gradient_accumulation_steps {} call it {} times per step, or not at all",
                    step, s.micro_batches, gas, gas - 1));
  }
  if (calls && s.held_refs > 0) {
    calls = FailedPreconditionError(fmt::format(
        "engine: step {}: {} gathered parameter(s) are still held by a Gathered scope; release "
        "them before Step (the step changes their weights)",
        step, s.held_refs));
  }
  const Status handed = HandGradient(s.micro_batches);
  s.micro_batches = 0;
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("Step", calls));
  s.NextStep();
  ZINF_RETURN_IF_ERROR(handed);
  return AgreeOnGroups(step);
}

// Measure: the global norm of the averaged gradient, the loss and the stop flag, in one
// allreduce. With fp16 the gradient is of the loss times the scale: the norm is divided by it.
Result<ZeroEngine::Impl::StepPlan> ZeroEngine::Impl::MeasureGradient(std::optional<double> loss,
                                                                     StepInfo* info) {
  State& s = *state_;
  const double scale = s.scaler->scale();
  const double average = Average();
  ZINF_ASSIGN_OR_RETURN(const double squared, PartitionGradSquaredSum());
  const double my_loss = loss.value_or(std::numeric_limits<double>::quiet_NaN());
  std::array<double, 3> sums = {squared, my_loss, ReceivedStopSignal() != 0 ? 1.0 : 0.0};
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<double>(sums, ReduceOp::kSum));
  info->grad_norm = std::sqrt(sums[0]) * average / scale;
  info->loss = sums[1] / world_.size();
  info->stop_requested = sums[2] > 0;
  info->stop_signal = ReceivedStopSignal();
  info->loss_scale = scale;
  return StepPlan{.squared_sum = sums[0], .average = average, .loss_scale = scale};
}

// Decide, the same on every rank (from the agreed sums): an fp16 overflow (a non-finite sum: an
// Inf or NaN anywhere, on any rank) skips the step; a gradient that is zero everywhere or not
// finite, or a non-finite loss, fails it with nothing stepped; a norm above gradient_clipping
// scales the gradient down.
Status ZeroEngine::Impl::Decide(bool have_loss, StepPlan* plan, StepInfo* info) {
  if (state_->scaler->enabled() && !std::isfinite(plan->squared_sum)) {
    plan->skip = true;
    info->lr = next_lr();  // what the step would have run at, and the next one will
    return OkStatus();
  }
  if (plan->squared_sum == 0) {
    // Adam would still move every weight (momentum, weight decay): a loop that forgot its
    // backward pass, or wrote elsewhere, must not train silently on nothing.
    return FailedPreconditionError(fmt::format(
        "step {}: the gradient is zero on every rank: Step was called before any gradient was "
        "written into the registered grads buffers; nothing was stepped",
        info->step));
  }
  if (!std::isfinite(info->grad_norm) || (have_loss && !std::isfinite(info->loss))) {
    return FailedPreconditionError(fmt::format(
        "step {}: the loss ({}) or the gradient norm ({}) is not finite; lower the learning rate "
        "or set gradient_clipping{}",
        info->step, info->loss, info->grad_norm,
        config_.bf16 || config_.fp16.enabled
            ? ""
            : " (fp16.enabled skips such steps and lowers the loss scale)"));
  }
  if (config_.gradient_clipping > 0 && info->grad_norm > config_.gradient_clipping) {
    plan->clip = config_.gradient_clipping / (info->grad_norm + 1e-6);
    info->clipped = true;
  }
  return OkStatus();
}

double ZeroEngine::Impl::Average() const {
  return 1.0 / (static_cast<double>(config_.gradient_accumulation_steps) * world_.size());
}

swapper::StepOptions ZeroEngine::Impl::StepOptionsFor(const StepPlan& plan, std::int64_t applied) {
  return {.grad_scale = static_cast<float>(plan.average * plan.clip / plan.loss_scale),
          .adam_step = applied};
}

// Optimize: the swapped Adam step over the rank's sub-groups, each parameter group at its
// scheduled hyper-parameters; the sink writes this rank's new weights into the parameters (its
// own part of them), from where GatherWholeWeights gathers them. What was speculated for the
// same arguments is committed first (UseSpeculation). Returns the step's seconds.
Result<double> ZeroEngine::Impl::Optimize(const StepPlan& plan, StepInfo* info) {
  State& s = *state_;
  const std::int64_t applied = info->step - skipped_steps_;
  ZINF_ASSIGN_OR_RETURN(const std::vector<HyperParams> hyper, StepHyperParams(info->step));
  info->lr = hyper[0].lr;
  const std::vector<swapper::AdamSegment> segments = StepSegments(hyper);
  swapper::StepOptions options = StepOptionsFor(plan, applied);
  options.segments = segments;
  // With a gradient swapper an empty source: the swapper steps from its own gradient swapper.
  const swapper::GradientSource source =
      s.swapper->gradient_swapper() != nullptr
          ? swapper::GradientSource()
          : swapper::GradientSource::FromView(
                [&s](const partition::SubGroup& sg) -> Result<std::span<const float>> {
                  return std::span<const float>(s.partition_grad)
                      .subspan(sg.partition_offset, sg.numel);
                });
  const swapper::ParamSink sink = [&s, rank = world_.rank()](const partition::SubGroup& sg,
                                                             std::span<const float> fp32,
                                                             std::span<const std::uint16_t>) {
    s.UnpackWeights(rank, sg.partition_offset, fp32.first(sg.numel), Working::kFp32, rank);
    return OkStatus();
  };
  const double start = MonotonicSeconds();
  {
    comm::ScopedTimer timer(s.timers, "optimizer_step");
    UseSpeculation(options, info);
    ZINF_RETURN_IF_ERROR(s.swapper->Step(info->step, source, sink, options));
  }
  const double seconds = MonotonicSeconds() - start;
  s.swap_seconds += seconds;
  return seconds;
}

Status ZeroEngine::Impl::Close() {
  if (closed_) return OkStatus();
  State& s = *state_;
  if (s.buckets) s.buckets->WaitIdle();
  DiscardSpeculation(nullptr);
  // A rank in another call (Step) must not match this close's collectives: the call is agreed
  // first. Once the ranks' calls diverged (here or earlier: every rank knows), nothing collective
  // can run again and each rank closes its own part.
  const bool diverged_before = comm().diverged();
  Status same_call = comm().AgreeOnCall("Close");
  if (!same_call) {
    if (!comm().diverged()) return same_call;
    CloseLocally({});
    return diverged_before ? OkStatus() : same_call;  // reported once, by the call that diverged
  }
  closed_ = true;
  s.buckets.reset();     // joins its worker before the swapper goes
  s.speculator.reset();  // likewise, and waits for its writes
  s.reader.reset();      // likewise
  Status local = s.metrics.Close(options_.metrics_path);
  if (s.swapper) {
    Status swapper_closed = s.swapper->Close();
    if (local) local = std::move(swapper_closed);
  }
  s.stop_signals.reset();
  return comm().AgreeOnStatus(local);
}

Result<Gathered> ZeroEngine::Gather(std::initializer_list<std::string_view> names) {
  return Gather(std::vector<std::string>(names.begin(), names.end()));
}

// ---- The interface: each call forwards to Impl's ----

Status ZeroEngine::AccumulateGradients() { return impl_->AccumulateGradients(); }
Status ZeroEngine::DropGradients() { return impl_->DropGradients(); }
Status ZeroEngine::GradientReady(std::size_t index) { return impl_->GradientReady(index); }
Status ZeroEngine::GradientReady(std::size_t index, std::span<const float> grad) {
  return impl_->GradientReady(index, grad);
}
Result<Gathered> ZeroEngine::Gather(std::span<const std::string> names) {
  return impl_->Gather(names);
}
Result<Gathered> ZeroEngine::GatherByIndex(std::span<const std::size_t> params) {
  return impl_->GatherByIndex(params);
}
Result<StepInfo> ZeroEngine::Step(std::optional<double> loss) { return impl_->Step(loss); }
Result<SavedCheckpointInfo> ZeroEngine::SaveCheckpoint(const nlohmann::json& user_state,
                                                       const std::string& dir) {
  return impl_->SaveCheckpoint(user_state, dir);
}
Status ZeroEngine::Load(const std::string& path) { return impl_->Load(path); }
Status ZeroEngine::LogSummary() { return impl_->LogSummary(); }
Status ZeroEngine::Close() { return impl_->Close(); }
void ZeroEngine::Detach(std::string_view reason) { impl_->Detach(reason); }
Status ZeroEngine::AgreeOnCall(std::string_view call, const Status& local) {
  return impl_->AgreeOnCall(call, local);
}
bool ZeroEngine::closed() const { return impl_->closed_; }
std::int64_t ZeroEngine::step_count() const { return impl_->step_; }
const GatherCounters& ZeroEngine::gather_counters() const { return impl_->state_->counters; }
std::size_t ZeroEngine::num_partitioned_params() const { return impl_->state_->num_partitioned; }
double ZeroEngine::next_lr() const { return impl_->next_lr(); }
std::size_t ZeroEngine::num_param_groups() const { return impl_->groups_.size(); }
HyperParams ZeroEngine::next_hyper_params(std::size_t g) const {
  return impl_->next_hyper_params(g);
}
Status ZeroEngine::SetHyperParams(std::span<const HyperParams> groups) {
  return impl_->SetHyperParams(groups);
}
double ZeroEngine::loss_scale() const { return impl_->loss_scale(); }
std::int64_t ZeroEngine::skipped_steps() const { return impl_->skipped_steps_; }
const std::string& ZeroEngine::resumed_from() const { return impl_->resumed_from_; }
const nlohmann::json& ZeroEngine::user_state() const { return impl_->user_state_; }
int ZeroEngine::resumed_world_size() const { return impl_->resumed_world_size_; }
const config::Config& ZeroEngine::config() const { return impl_->config_; }
const partition::ParamLayout& ZeroEngine::layout() const { return impl_->layout(); }
const comm::Communicator& ZeroEngine::world() const { return impl_->world_; }

}  // namespace zinf::engine
