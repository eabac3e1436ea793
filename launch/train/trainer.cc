#include "trainer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <span>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "charlm.h"
#include "data.h"
#include "model.h"
#include "synthetic.h"
#include "zinf/comm/timers.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/units.h"
#include "zinf/partition/plan.h"
#include "zinf/storage/fs.h"
#include "zinf/storage/swap_store.h"
#include "zinf/swapper/checkpoint.h"
#include "zinf/swapper/gradient_swapper.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::train {
namespace {

using Json = nlohmann::json;
using comm::ReduceOp;

// Partitions and sub-groups are multiples of 1024 elements (4 KiB of fp32): the direct-I/O
// alignment of every file system we have seen, so no sub-group needs a padded tail on disk.
constexpr std::uint64_t kPartitionAlignmentElems = 1024;
// Held-out examples for the periodic charlm evaluation.
constexpr int kEvalExamples = 512;

const char kDefaultConfig[] = R"json({
  "train_micro_batch_size_per_gpu": 64,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "steps_per_print": 25,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.003, "warmup_num_steps": 20,
                           "warmup_type": "linear"}},
  "zero_optimization": {
    "stage": 1,
    "sub_group_size": 65536,
    "offload_optimizer": {"device": "nvme", "nvme_path": "zinf-swap", "buffer_count": 12,
                          "pipeline_read": true, "pipeline_write": true}
  },
  "zinf": {
    "model": {"name": "charlm", "hidden": 512, "layers": 2, "context": 16, "embed_dim": 16},
    "steps": 200,
    "seed": 1234
  }
})json";

// ---- Config overrides ----

// The object at `path` inside `root`, created when missing. nullptr when something on the way
// is not an object: the override is then skipped and the parser reports the bad type.
Json* ObjectAt(Json& root, std::initializer_list<const char*> path) {
  Json* node = &root;
  for (const char* key : path) {
    if (!node->is_object()) return nullptr;
    Json& child = (*node)[key];
    if (child.is_null()) child = Json::object();
    node = &child;
  }
  return node->is_object() ? node : nullptr;
}

void Set(Json& root, std::initializer_list<const char*> parents, const char* key, Json value) {
  if (Json* parent = ObjectAt(root, parents)) (*parent)[key] = std::move(value);
}

void ApplyOverrides(const ConfigOverrides& o, Json& root) {
  if (o.steps) Set(root, {"zinf"}, "steps", *o.steps);
  if (o.nvme_path) {
    Set(root, {"zero_optimization", "offload_optimizer"}, "device", "nvme");
    Set(root, {"zero_optimization", "offload_optimizer"}, "nvme_path", *o.nvme_path);
  }
  if (o.checkpoint_dir) Set(root, {"zinf", "checkpoint"}, "dir", *o.checkpoint_dir);
  if (o.checkpoint_every) Set(root, {"zinf", "checkpoint"}, "every", *o.checkpoint_every);
  if (o.keep_last) Set(root, {"zinf", "checkpoint"}, "keep_last", *o.keep_last);
  if (o.resume) Set(root, {"zinf", "checkpoint"}, "load", *o.resume);
  if (o.model) Set(root, {"zinf", "model"}, "name", *o.model);
  if (o.data) Set(root, {"zinf", "data"}, "path", *o.data);
  if (o.seed) Set(root, {"zinf"}, "seed", *o.seed);
  if (!o.hidden && !o.layers) return;
  // Which model the sizes apply to: the override, else the config's name, else the default.
  std::string name = "charlm";
  if (Json* model = ObjectAt(root, {"zinf", "model"}); model && model->contains("name") &&
                                                      (*model)["name"].is_string()) {
    name = (*model)["name"].get<std::string>();
  }
  if (name != "synthetic") {
    if (o.hidden) Set(root, {"zinf", "model"}, "hidden", *o.hidden);
    if (o.layers) Set(root, {"zinf", "model"}, "layers", *o.layers);
    return;
  }
  // synthetic: L tensors of H x H. A flag not given takes the config's (or the default) value.
  const ModelConfig defaults;
  std::int64_t hidden = defaults.hidden, layers = defaults.layers;
  if (Json* model = ObjectAt(root, {"zinf", "model"})) {
    if (model->contains("hidden") && (*model)["hidden"].is_number_integer()) {
      hidden = (*model)["hidden"].get<std::int64_t>();
    }
    if (model->contains("layers") && (*model)["layers"].is_number_integer()) {
      layers = (*model)["layers"].get<std::int64_t>();
    }
  }
  if (o.hidden) hidden = *o.hidden;
  if (o.layers) layers = *o.layers;
  layers = std::max<std::int64_t>(layers, 1);
  // Out-of-range values reach the parser as they are (it names the key and the range).
  const std::int64_t total =
      hidden < 1 ? hidden : layers * std::min<std::int64_t>(hidden, 1 << 30) * hidden;
  Set(root, {"zinf", "model"}, "total_params", total);
  Set(root, {"zinf", "model"}, "num_params", layers);
}

// ---- Working state of one run ----

class Run {
 public:
  Run(const comm::Communicator& world, const TrainConfig& config, const TrainOptions& options)
      : world_(world), config_(config), options_(options) {}

  Result<TrainSummary> Go();

 private:
  Status Setup();
  Status BuildModel();
  Status CheckHostMemory(std::uint64_t padded_numel) const;
  Status InitializeOrRestore();
  // The rank's partition buffer from the swapper's committed fp32 state.
  Status ReadPartition();
  // partition_ of every rank -> gathered_ -> weights_.
  Status GatherWeights();
  // One optimizer step; fills the metrics record.
  Status Step(std::int64_t step, Json* record);
  Status ForwardBackward(std::int64_t step, int micro_batch, std::span<float> grad,
                         double* loss_sum);
  Result<double> PartitionGradSquaredSum();
  Status SaveCheckpoint(std::int64_t step, double loss);
  Status Finish(const TrainSummary& summary);
  // Rank 0 logs the swap bandwidth of every node (its ranks' bytes over their slowest
  // optimizer time): on several hosts, the node with the slow disk stands out. Collective.
  Status LogPerNode();
  Json TrainerState(std::int64_t step, double loss) const;
  Status WriteMetrics(const Json& record);

  const comm::Communicator& world_;
  const TrainConfig& config_;
  TrainOptions options_;

  std::unique_ptr<Model> model_;
  const CharLM* charlm_ = nullptr;  // model_ when it is a CharLM
  std::optional<TextDataset> data_;
  std::optional<partition::PartitionPlan> plan_;
  std::unique_ptr<swapper::OptimizerSwapper> swapper_;
  std::uint64_t total_numel_ = 0;
  std::uint64_t partition_numel_ = 0;
  std::vector<float> partition_;       // this rank's updated fp32 weights (padding 0)
  std::vector<float> partition_grad_;  // this rank's reduced gradient (in-memory mode)
  std::vector<float> gathered_;        // every rank's partition, rank order
  std::vector<float> flat_storage_;    // per-param plans: the layout-order weights
  std::span<float> weights_;           // the working weights, layout order
  std::vector<float> grad_;            // the flat gradient, padded to gathered_'s size
  std::vector<float> grad_scratch_;    // per-param plans: grad_ in partition order
  comm::Timers timers_;
  storage::UniqueFd metrics_;  // rank 0, with --metrics
  std::string resumed_from_;
  std::string last_checkpoint_;
  std::int64_t last_checkpoint_step_ = -1;
  std::int64_t start_step_ = 1;
  double swap_seconds_ = 0;      // this rank's optimizer steps, wall time
  std::uint64_t swap_bytes_ = 0;  // this rank's swap reads + writes in its optimizer steps
};

std::atomic<int> g_stop_signal{0};

extern "C" void OnStopSignal(int sig) { g_stop_signal.store(sig, std::memory_order_relaxed); }

// Installs the stop handlers for the lifetime of the object and restores the old ones after.
// A stop signal ends the run after the current step (all ranks agree on it in the step's
// allreduce), with a checkpoint when a checkpoint directory is set.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction action {};
    action.sa_handler = OnStopSignal;
    sigemptyset(&action.sa_mask);
    for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &action, &old_[i]);
  }
  ~StopSignals() {
    for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  // SIGINT/SIGTERM for a rank run directly; under Open MPI's mpirun those become SIGTERM then
  // SIGKILL a second later, while SIGUSR1/SIGUSR2 sent to mpirun reach the ranks unchanged and
  // the job waits for them: the way to stop a job with a final checkpoint.
  static constexpr std::array<int, 4> kSignals = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
  std::array<struct sigaction, 4> old_{};
};

Status Run::BuildModel() {
  const ModelConfig& m = config_.zinf.model;
  // A fixed BLAS thread count per rank: the split of an sgemm over threads can change its last
  // bits on some CPUs' kernels, so runs compare bitwise only at the same count.
  const int local = std::max(world_.topology().local_size, 1);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads =
      config_.zinf.compute_threads > 0 ? config_.zinf.compute_threads : std::max(1, cores / local);
  if (m.name == ModelName::kCharLM) {
    ZINF_ASSIGN_OR_RETURN(CharLM charlm, CharLM::Create({.context = m.context,
                                                         .embed_dim = m.embed_dim,
                                                         .hidden = m.hidden,
                                                         .layers = m.layers,
                                                         .activation = m.activation}));
    auto owned = std::make_unique<CharLM>(std::move(charlm));
    charlm_ = owned.get();
    model_ = std::move(owned);
    SetBlasThreads(threads);
    Result<TextDataset> data = config_.zinf.data_path.empty()
                                   ? TextDataset::LoadDefault()
                                   : (std::filesystem::is_directory(config_.zinf.data_path)
                                          ? TextDataset::LoadDirectory(config_.zinf.data_path)
                                          : TextDataset::Load(config_.zinf.data_path));
    if (!data) return std::move(data).error();
    data_.emplace(std::move(*data));
  } else {
    ZINF_ASSIGN_OR_RETURN(SyntheticModel synthetic,
                          SyntheticModel::Create(m.total_params, m.num_params, threads));
    model_ = std::make_unique<SyntheticModel>(std::move(synthetic));
  }
  return OkStatus();
}

// Every size that grows with the config (the replicated weights and gradient, a micro-batch's
// activations) against the machine's RAM + swap shared by this node's ranks: what cannot fit is
// ResourceExhausted before it is allocated, not a std::bad_alloc half-way.
Status Run::CheckHostMemory(std::uint64_t padded_numel) const {
  const std::uint64_t machine = MachineMemoryBytes();
  if (machine == 0) return OkStatus();
  const auto local = static_cast<std::uint64_t>(std::max(world_.topology().local_size, 1));
  const std::uint64_t per_rank = machine / local;
  // gathered_ and grad_, and per-parameter plans' flat copy and scratch.
  const std::uint64_t copies = plan_->kind() == partition::PlanKind::kFlat ? 2 : 4;
  std::uint64_t replicated = 0;
  if (!CheckedMul(padded_numel, copies * sizeof(float), &replicated)) replicated = UINT64_MAX;
  const std::uint64_t activations =
      model_->WorkingBytes(static_cast<std::uint64_t>(config_.train_micro_batch_size_per_gpu));
  std::uint64_t need = 0;
  if (!CheckedAdd(replicated, activations, &need)) need = UINT64_MAX;
  if (need <= per_rank) return OkStatus();
  return ResourceExhaustedError(fmt::format(
      "this rank needs at least {} of host memory (replicated weights and gradient {}, the "
      "activations of a micro-batch of {} examples {}), more than its share of this machine: {} "
      "of RAM + swap over {} rank(s); lower train_micro_batch_size_per_gpu (use "
      "gradient_accumulation_steps), the model size, or the ranks per node",
      FormatBytes(need), FormatBytes(replicated), config_.train_micro_batch_size_per_gpu,
      FormatBytes(activations), FormatBytes(machine), local));
}

Status Run::Setup() {
  if (config_.zero_optimization.offload_optimizer.device != OffloadDevice::kNvme) {
    return InvalidArgumentError(fmt::format(
        "zero_optimization.offload_optimizer.device: \"{}\": zinf-train keeps the optimizer state "
        "on NVMe; set it to \"nvme\" with a nvme_path (or pass --nvme-path)",
        OffloadDeviceName(config_.zero_optimization.offload_optimizer.device)));
  }
  // Every rank builds the model and loads the data; agree before the first collective.
  ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(BuildModel()));
  const partition::ParamLayout& layout = model_->layout();
  total_numel_ = layout.total_numel();
  ZINF_LOG_INFO("model: {}", model_->Describe());
  if (data_) ZINF_LOG_INFO("data: {} ({})", data_->source(), FormatBytes(data_->size_bytes()));

  ZINF_ASSIGN_OR_RETURN(plan_, partition::PartitionPlan::Create(
                                   layout, {.kind = ToPlanKind(config_),
                                            .world_size = world_.size(),
                                            .alignment_elems = kPartitionAlignmentElems}));
  partition_numel_ = plan_->partition_numel();
  if (partition_numel_ > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    return InvalidArgumentError(fmt::format(
        "model: {} parameters per rank exceed what one MPI collective moves ({}); run on more "
        "ranks",
        partition_numel_, std::numeric_limits<int>::max()));
  }
  const std::size_t padded = partition_numel_ * static_cast<std::size_t>(world_.size());
  ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(CheckHostMemory(padded)));
  // The working weights and the flat gradient are replicated on every rank (ZeRO-1/2): they must
  // fit in host memory beside the pool.
  ZINF_LOG_INFO("working weights and gradient: {} per rank (replicated), partition {} elements",
                FormatBytes(2 * padded * sizeof(float)), partition_numel_);
  partition_.assign(partition_numel_, 0.0f);
  gathered_.assign(padded, 0.0f);
  grad_.assign(padded, 0.0f);
  if (plan_->kind() == partition::PlanKind::kFlat) {
    weights_ = std::span<float>(gathered_).first(total_numel_);
  } else {
    flat_storage_.assign(total_numel_, 0.0f);
    weights_ = flat_storage_;
    grad_scratch_.assign(padded, 0.0f);
  }

  if (options_.create_nvme_paths) {
    Status created = OkStatus();
    for (const std::string& path : config_.zero_optimization.offload_optimizer.resolved_nvme_paths) {
      std::error_code ec;
      std::filesystem::create_directories(path, ec);
      if (ec) {
        created = ErrnoError(ec.value(), fmt::format("create swap directory {}", path));
        break;
      }
    }
    ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(created));
  }
  swapper::SwapperOptions options = ToSwapperOptions(config_, world_.rank());
  // Stores left by killed runs are scratch: this job's own is reused, other jobs' are removed
  // once every rank's store is open (SwapStore::ReclaimStale; kept ones are named in a WARN).
  options.store.reclaim_stale = !config_.zinf.keep_swap;
  ZINF_ASSIGN_OR_RETURN(swapper_, swapper::CreateOptimizerSwapper(world_, *plan_, options));
  if (swapper_->gradient_swapper() == nullptr) partition_grad_.assign(partition_numel_, 0.0f);
  return OkStatus();
}

Status Run::InitializeOrRestore() {
  const CheckpointConfig& ckpt = config_.zinf.checkpoint;
  std::string path;
  if (ckpt.load == "latest" || ckpt.load == "auto") {
    // Any entry named `latest` (a link or a dangling one included) is resolved, so that a bad
    // one is an error rather than a silent fresh start.
    const std::string latest = ckpt.dir + "/latest";
    struct stat st {};
    if (::lstat(latest.c_str(), &st) == 0) {
      path = ckpt.dir;
    } else if (ckpt.load == "latest") {
      return NotFoundError(
          fmt::format("--resume latest: no checkpoint to resume from: {} does not exist", latest));
    }
  } else if (!ckpt.load.empty()) {
    path = ckpt.load;
  }
  if (path.empty()) {
    const double start = MonotonicSeconds();
    const std::uint64_t seed = static_cast<std::uint64_t>(config_.zinf.seed);
    const swapper::InitialWeights initial = [&](std::uint64_t partition_offset,
                                                std::span<float> out) -> Status {
      std::fill(out.begin(), out.end(), 0.0f);
      for (const partition::Fragment& f :
           plan_->FragmentsInPartitionRange(world_.rank(), partition_offset, out.size())) {
        ZINF_RETURN_IF_ERROR(model_->InitSlice(
            seed, f.flat_offset, out.subspan(f.partition_offset - partition_offset, f.numel)));
      }
      return OkStatus();
    };
    ZINF_RETURN_IF_ERROR(swapper_->Initialize(initial));
    ZINF_LOG_INFO("initialized {} parameters (seed {}) in {:.2f} s", total_numel_, seed,
                  MonotonicSeconds() - start);
    start_step_ = 1;
    return OkStatus();
  }
  // One pass: every chunk is verified as it is read, and a bad file fails the restore on every
  // rank before any step runs. The store was created empty for this run and is discarded with
  // it on error, so the verify-first pass (which keeps a live store untouched by reading the
  // file twice) would only cost time.
  ZINF_ASSIGN_OR_RETURN(swapper::RestoredCheckpoint restored,
                        swapper::RestoreCheckpoint(*swapper_, path,
                                                   {.verify_before_write = false,
                                                    .progress = options_.progress}));
  resumed_from_ = restored.path;
  start_step_ = restored.step + 1;
  const Json& trainer = restored.trainer;
  if (trainer.is_object() && trainer.contains("seed") && trainer["seed"].is_number_integer() &&
      trainer["seed"].get<std::int64_t>() != config_.zinf.seed) {
    ZINF_LOG_WARN("resuming with seed {}, but the checkpoint was trained with seed {}: the data "
                  "order changes",
                  config_.zinf.seed, trainer["seed"].get<std::int64_t>());
  }
  ZINF_LOG_INFO("resumed from {} (step {}, saved on {} ranks, now {}) in {:.2f} s", restored.path,
                restored.step, restored.world_size, world_.size(), restored.seconds);
  return OkStatus();
}

Status Run::ReadPartition() {
  std::fill(partition_.begin(), partition_.end(), 0.0f);
  for (std::size_t i = 0; i < swapper_->num_sub_groups(); ++i) {
    const partition::SubGroup& sg = swapper_->swap_info(i).sub_group;
    ZINF_RETURN_IF_ERROR(swapper_->ReadState(
        i, swapper::StateTensor::kFp32, 0,
        std::span<float>(partition_).subspan(sg.partition_offset, sg.numel)));
  }
  return OkStatus();
}

// bf16 round-to-nearest-even, kept in fp32 (the value the bf16 working weights hold).
float RoundToBf16(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u) return x;  // inf and NaN stay as they are
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

Status Run::GatherWeights() {
  comm::ScopedTimer timer(timers_, "allgather");
  ZINF_RETURN_IF_ERROR(world_.Allgather<float>(partition_, gathered_));
  if (plan_->kind() != partition::PlanKind::kFlat) {
    for (int r = 0; r < world_.size(); ++r) {
      const float* base = gathered_.data() + static_cast<std::size_t>(r) * partition_numel_;
      for (const partition::Fragment& f : plan_->RankFragments(r)) {
        std::copy_n(base + f.partition_offset, f.numel, weights_.data() + f.flat_offset);
      }
    }
  }
  if (config_.bf16) {
    for (float& w : weights_) w = RoundToBf16(w);
  }
  return OkStatus();
}

Status Run::ForwardBackward(std::int64_t step, int micro_batch, std::span<float> grad,
                            double* loss_sum) {
  const BatchId id{.seed = static_cast<std::uint64_t>(config_.zinf.seed),
                   .step = static_cast<std::uint64_t>(step - 1),
                   .micro_batch = micro_batch,
                   .world_rank = world_.rank(),
                   .world_size = world_.size()};
  const int batch_size = static_cast<int>(config_.train_micro_batch_size_per_gpu);
  Batch batch;
  if (data_) {
    ZINF_ASSIGN_OR_RETURN(batch,
                          data_->SampleBatch(id, batch_size, config_.zinf.model.context));
  } else {
    batch = SyntheticModel::MakeBatch(id, static_cast<std::size_t>(batch_size));
  }
  // The flat gradient is laid out like gathered_ for the reduce-scatter; per-param plans are
  // remapped after the backward pass.
  ZINF_ASSIGN_OR_RETURN(double loss, model_->ForwardBackward(weights_, batch,
                                                             grad.first(total_numel_)));
  *loss_sum += loss;
  return OkStatus();
}

// Moves a layout-order gradient (grad[0, total)) into the partition order of a per-param plan
// (each rank's partition at r * partition_numel). `scratch` is a buffer of the same size.
void ToPartitionOrder(const partition::PartitionPlan& plan, std::vector<float>& grad,
                      std::vector<float>& scratch) {
  std::fill(scratch.begin(), scratch.end(), 0.0f);
  for (int r = 0; r < plan.world_size(); ++r) {
    float* base = scratch.data() + static_cast<std::size_t>(r) * plan.partition_numel();
    for (const partition::Fragment& f : plan.RankFragments(r)) {
      std::copy_n(grad.data() + f.flat_offset, f.numel, base + f.partition_offset);
    }
  }
  grad.swap(scratch);
}

Result<double> Run::PartitionGradSquaredSum() {
  double sum = 0;
  auto add = [&sum](std::span<const float> g) {
    double s = 0;
    for (float v : g) s += static_cast<double>(v) * v;
    sum += s;
  };
  swapper::GradientSwapper* gradients = swapper_->gradient_swapper();
  if (gradients == nullptr) {
    add(partition_grad_);
    return sum;
  }
  // The accumulated gradient is in the gradient swapper: read it once through one pool buffer.
  ZINF_RETURN_IF_ERROR(swapper_->FlushGradients());
  Status local = [&]() -> Status {
    ZINF_ASSIGN_OR_RETURN(swapper::PoolLease lease,
                          swapper_->pool().Allocate(swapper_->sub_groups().max_sub_group_numel(),
                                                    1));
    for (std::size_t i = 0; i < swapper_->num_sub_groups(); ++i) {
      std::span<float> g = lease.floats(0).first(swapper_->swap_info(i).sub_group.numel);
      ZINF_RETURN_IF_ERROR(gradients->SwapIn(i, g));
      add(g);
    }
    return OkStatus();
  }();
  ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(local));
  return sum;
}

Status Run::Step(std::int64_t step, Json* record) {
  const double step_start = MonotonicSeconds();
  const storage::SwapStore& store = swapper_->store();
  const storage::SwapStore::IoCounters io_start = store.io_counters();
  const int gas = static_cast<int>(config_.gradient_accumulation_steps);
  swapper::GradientSwapper* gradients = swapper_->gradient_swapper();
  double loss_sum = 0;
  // 1-2: forward/backward and reduce-scatter. Local failures (a bad batch) are agreed on before
  // the collective so that no rank waits in it alone.
  for (int m = 0; m < gas; ++m) {
    if (m == 0 || gradients != nullptr) std::fill(grad_.begin(), grad_.end(), 0.0f);
    timers_.Start("forward_backward");
    Status local = ForwardBackward(step, m, grad_, &loss_sum);
    timers_.Stop("forward_backward");
    ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(local));
    if (gradients == nullptr && m + 1 < gas) continue;  // accumulate in memory
    if (plan_->kind() != partition::PlanKind::kFlat) ToPartitionOrder(*plan_, grad_, grad_scratch_);
    std::span<float> reduced =
        gradients == nullptr ? std::span<float>(partition_grad_) : std::span<float>(partition_);
    {
      comm::ScopedTimer timer(timers_, "reduce_scatter");
      ZINF_RETURN_IF_ERROR(world_.ReduceScatterBlock<float>(grad_, reduced, ReduceOp::kSum));
    }
    if (gradients != nullptr) {
      // partition_ is free until the step's sink refills it: use it as the staging buffer.
      comm::ScopedTimer timer(timers_, "gradient_swap_out");
      ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(gradients->SwapOutPartition(m, reduced)));
    }
  }
  // 3: global norm of the averaged gradient, and the loss, in one allreduce.
  const double average = 1.0 / (static_cast<double>(gas) * world_.size());
  ZINF_ASSIGN_OR_RETURN(double squared, PartitionGradSquaredSum());
  std::array<double, 3> sums = {squared, loss_sum, g_stop_signal.load() != 0 ? 1.0 : 0.0};
  ZINF_RETURN_IF_ERROR(world_.AllreduceInPlace<double>(sums, ReduceOp::kSum));
  const double grad_norm = std::sqrt(sums[0]) * average;
  const double loss = sums[1] / (static_cast<double>(gas) * world_.size());
  double clip = 1.0;
  if (config_.gradient_clipping > 0 && grad_norm > config_.gradient_clipping) {
    clip = config_.gradient_clipping / (grad_norm + 1e-6);
  }
  if (!std::isfinite(grad_norm) || !std::isfinite(loss)) {
    return FailedPreconditionError(fmt::format(
        "step {}: the loss ({}) or the gradient norm ({}) is not finite; lower the learning rate "
        "or set gradient_clipping",
        step, loss, grad_norm));
  }
  // 4: the swapped optimizer step; the sink gathers the new weights into partition_.
  const double lr = LearningRate(config_.scheduler, config_.optimizer.lr, step - 1);
  const swapper::GradientSource source =
      gradients != nullptr
          ? gradients->Source()
          : swapper::GradientSource([this](const partition::SubGroup& sg, std::span<float> g) {
              std::copy_n(partition_grad_.data() + sg.partition_offset, sg.numel, g.data());
              return OkStatus();
            });
  const swapper::ParamSink sink = [this](const partition::SubGroup& sg,
                                         std::span<const float> fp32,
                                         std::span<const std::uint16_t>) {
    std::copy_n(fp32.data(), sg.numel, partition_.data() + sg.partition_offset);
    return OkStatus();
  };
  const double optimizer_start = MonotonicSeconds();
  const storage::SwapStore::IoCounters io_optimizer_start = store.io_counters();
  {
    comm::ScopedTimer timer(timers_, "optimizer_step");
    ZINF_RETURN_IF_ERROR(swapper_->Step(
        step, source, sink, {.lr = lr, .grad_scale = static_cast<float>(average * clip)}));
  }
  const double optimizer_seconds = MonotonicSeconds() - optimizer_start;
  const storage::SwapStore::IoCounters io_optimizer_end = store.io_counters();
  swap_seconds_ += optimizer_seconds;
  // 5: the updated partitions to every rank.
  ZINF_RETURN_IF_ERROR(GatherWeights());
  const double step_seconds = MonotonicSeconds() - step_start;
  const storage::SwapStore::IoCounters io_end = store.io_counters();

  // Per-step figures: peak RSS and the slowest rank's times; swap bytes, as the store counted
  // them, summed over the ranks: over the whole step (gradient swap-outs in the backward
  // included) and within the optimizer step.
  std::array<double, 3> maxima = {static_cast<double>(PeakRssBytes()), step_seconds,
                                  optimizer_seconds};
  ZINF_RETURN_IF_ERROR(world_.AllreduceInPlace<double>(maxima, ReduceOp::kMax));
  std::array<std::uint64_t, 4> bytes = {
      io_end.read_bytes - io_start.read_bytes, io_end.write_bytes - io_start.write_bytes,
      io_optimizer_end.read_bytes - io_optimizer_start.read_bytes,
      io_optimizer_end.write_bytes - io_optimizer_start.write_bytes};
  swap_bytes_ += bytes[2] + bytes[3];
  ZINF_RETURN_IF_ERROR(world_.AllreduceInPlace<std::uint64_t>(bytes, ReduceOp::kSum));
  auto gbps = [&](std::uint64_t b) {
    return static_cast<double>(b) / std::max(maxima[2], 1e-9) / 1e9;
  };
  ZINF_LOG_INFO("step {}/{} loss {:.6f} lr {:.2e} time {:.3f} s swap read {:.2f} GB/s write "
                "{:.2f} GB/s{}",
                step, config_.zinf.steps, loss, lr, maxima[1], gbps(bytes[2]), gbps(bytes[3]),
                clip < 1.0 ? fmt::format(" (clipped, norm {:.3g})", grad_norm) : "");
  *record = Json{{"step", step},
                 {"loss", loss},
                 {"lr", lr},
                 {"grad_norm", grad_norm},
                 {"step_seconds", maxima[1]},
                 {"optimizer_seconds", maxima[2]},
                 {"swap_read_bytes", bytes[0]},
                 {"swap_write_bytes", bytes[1]},
                 {"optimizer_swap_read_bytes", bytes[2]},
                 {"optimizer_swap_write_bytes", bytes[3]},
                 {"peak_rss_bytes", static_cast<std::uint64_t>(maxima[0])},
                 {"world_size", world_.size()}};
  if (sums[2] > 0) (*record)["stop_requested"] = true;
  return OkStatus();
}

Json Run::TrainerState(std::int64_t step, double loss) const {
  return Json{{"step", step},
              {"seed", config_.zinf.seed},
              {"world_size", world_.size()},
              {"train_micro_batch_size_per_gpu", config_.train_micro_batch_size_per_gpu},
              {"gradient_accumulation_steps", config_.gradient_accumulation_steps},
              {"samples_seen", step * config_.train_micro_batch_size_per_gpu *
                                   config_.gradient_accumulation_steps * world_.size()},
              {"data", "batches are a pure function of (seed, step, micro_batch, rank, world)"},
              {"lr", LearningRate(config_.scheduler, config_.optimizer.lr, step - 1)},
              {"scheduler_last_batch_iteration", step - 1},
              {"loss", loss}};
}

Status Run::SaveCheckpoint(std::int64_t step, double loss) {
  const Json effective = Json::parse(EffectiveConfigJson(config_));
  swapper::CheckpointSaveOptions options;
  options.dir = config_.zinf.checkpoint.dir;
  options.keep_last = static_cast<int>(config_.zinf.checkpoint.keep_last);
  options.optimizer = effective.at("optimizer");
  options.config = effective;
  options.trainer = TrainerState(step, loss);
  options.progress = options_.progress;
  comm::ScopedTimer timer(timers_, "checkpoint");
  ZINF_ASSIGN_OR_RETURN(swapper::SavedCheckpoint saved,
                        swapper::SaveCheckpoint(*swapper_, step, options));
  last_checkpoint_ = saved.path;
  last_checkpoint_step_ = step;
  ZINF_LOG_INFO("checkpoint {}: {} in {:.2f} s ({:.2f} GB/s){}", saved.path,
                FormatBytes(saved.state_bytes), saved.seconds,
                saved.state_bytes / std::max(saved.seconds, 1e-9) / 1e9,
                saved.removed.empty() ? "" : fmt::format(", removed {}", saved.removed.size()));
  return OkStatus();
}

Status Run::WriteMetrics(const Json& record) {
  if (!metrics_) return OkStatus();
  return storage::WriteAll(metrics_.get(), record.dump() + "\n",
                           fmt::format("--metrics {}", options_.metrics_path));
}

Result<TrainSummary> Run::Go() {
  TrainSummary summary;
  ZINF_RETURN_IF_ERROR(Setup());
  ZINF_RETURN_IF_ERROR(InitializeOrRestore());
  ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(Annotate(
      ReadPartition(), resumed_from_.empty() ? "reading the initial weights back: "
                                             : "reading the restored weights back: ")));
  ZINF_RETURN_IF_ERROR(GatherWeights());
  summary.first_step = start_step_;
  summary.resumed_from = resumed_from_;
  const std::int64_t last = config_.zinf.steps;
  if (start_step_ > last) {
    ZINF_LOG_INFO("nothing to do: the checkpoint is at step {}, --steps is {}", start_step_ - 1,
                  last);
  }
  // Rank 0 appends to the metrics of a resumed run and starts a fresh file otherwise.
  Status opened = OkStatus();
  if (world_.rank() == 0 && !options_.metrics_path.empty()) {
    // The user's own path (a link is followed); a FIFO or device is refused, never blocked on.
    Result<storage::UniqueFd> fd =
        storage::OpenFile(options_.metrics_path,
                          resumed_from_.empty() ? storage::FileAccess::kTruncateOrCreate
                                                : storage::FileAccess::kAppendOrCreate,
                          storage::Follow::kYes);
    if (fd) {
      metrics_ = std::move(*fd);
    } else {
      opened = std::move(fd).error().WithContext("--metrics: ");
    }
  }
  ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(opened));

  const CheckpointConfig& ckpt = config_.zinf.checkpoint;
  const double loop_start = MonotonicSeconds();
  double loss = std::numeric_limits<double>::quiet_NaN();
  std::int64_t step = start_step_;
  for (; step <= last; ++step) {
    Json record;
    ZINF_RETURN_IF_ERROR(Step(step, &record));
    loss = record["loss"].get<double>();
    summary.last_step = step;
    ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(WriteMetrics(record)));
    const bool stop = record.contains("stop_requested");
    if (!ckpt.dir.empty() && (step % ckpt.every == 0 || step == last || stop)) {
      ZINF_RETURN_IF_ERROR(SaveCheckpoint(step, loss));
    }
    if (charlm_ != nullptr && config_.steps_per_print > 0 &&
        (step % config_.steps_per_print == 0 || step == last) && world_.rank() == 0) {
      Result<double> eval = charlm_->EvalLoss(weights_, *data_, kEvalExamples);
      if (eval) ZINF_LOG_INFO("step {}: held-out loss {:.4f}", step, *eval);
    }
    if (stop) {
      summary.interrupted = true;
      summary.signal = g_stop_signal.load();
      ZINF_LOG_WARN("stopping after step {}: signal received on some rank{}", step,
                    last_checkpoint_step_ == step ? fmt::format(" (checkpoint {})",
                                                                last_checkpoint_)
                                                  : "");
      break;
    }
  }
  summary.seconds = MonotonicSeconds() - loop_start;
  summary.final_loss = loss;
  summary.last_checkpoint = last_checkpoint_;
  if (summary.last_step == 0) summary.last_step = start_step_ - 1;
  ZINF_RETURN_IF_ERROR(Finish(summary));
  return summary;
}

Status Run::LogPerNode() {
  constexpr std::size_t kHostChars = 64;
  const comm::Topology& topo = world_.topology();
  std::string host = topo.hostname.substr(0, kHostChars - 1);
  host.resize(kHostChars, '\0');
  std::string hosts(kHostChars * static_cast<std::size_t>(world_.size()), '\0');
  ZINF_RETURN_IF_ERROR(world_.Allgather<char>(host, hosts));
  const std::array<double, 3> mine = {static_cast<double>(topo.node),
                                      static_cast<double>(swap_bytes_), swap_seconds_};
  std::vector<double> all(3 * static_cast<std::size_t>(world_.size()));
  ZINF_RETURN_IF_ERROR(world_.Allgather<double>(mine, all));
  if (world_.rank() != 0) return OkStatus();
  struct Node {
    std::string host;
    int ranks = 0;
    double bytes = 0, seconds = 0;
  };
  std::vector<Node> nodes(static_cast<std::size_t>(topo.num_nodes));
  for (int r = 0; r < world_.size(); ++r) {
    Node& n = nodes.at(static_cast<std::size_t>(all[3 * r]));
    n.host = hosts.substr(kHostChars * r, kHostChars).c_str();
    ++n.ranks;
    n.bytes += all[3 * r + 1];
    n.seconds = std::max(n.seconds, all[3 * r + 2]);
  }
  std::string table;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    table += fmt::format("\n  node {} ({}): {} rank(s), {} swapped in {:.2f} s: {:.2f} GB/s", i,
                         n.host, n.ranks, FormatBytes(static_cast<std::uint64_t>(n.bytes)),
                         n.seconds, n.bytes / std::max(n.seconds, 1e-9) / 1e9);
  }
  ZINF_LOG_INFO("swap read + write per node (over the optimizer steps):{}", table);
  return OkStatus();
}

Status Run::Finish(const TrainSummary& summary) {
  ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(metrics_.Close(options_.metrics_path)));
  const std::int64_t steps = summary.last_step - summary.first_step + 1;
  ZINF_RETURN_IF_ERROR(timers_.LogSummary(world_, "zinf-train timers"));
  ZINF_RETURN_IF_ERROR(swapper_->LogTimers());
  ZINF_RETURN_IF_ERROR(LogPerNode());
  if (steps > 0) {
    const std::int64_t samples = steps * config_.train_micro_batch_size_per_gpu *
                                 config_.gradient_accumulation_steps * world_.size();
    ZINF_LOG_INFO("done: steps {}..{} in {:.1f} s ({:.3f} s/step, {:.0f} samples/s), final loss "
                  "{:.4f}",
                  summary.first_step, summary.last_step, summary.seconds,
                  summary.seconds / steps, samples / std::max(summary.seconds, 1e-9),
                  summary.final_loss);
  }
  if (charlm_ != nullptr && world_.rank() == 0) {
    Result<std::string> sample =
        charlm_->Sample(weights_, "The ", 240, static_cast<std::uint64_t>(config_.zinf.seed));
    if (sample) ZINF_LOG_INFO("sample (temperature 0.8) after \"The \":\nThe {}", *sample);
  }
  if (!last_checkpoint_.empty()) {
    ZINF_LOG_INFO("last checkpoint: {} (inspect: zinf-ckpt ls {}; resume: --resume latest "
                  "--checkpoint-dir {})",
                  last_checkpoint_, last_checkpoint_, config_.zinf.checkpoint.dir);
  }
  return world_.AgreeOnStatus(swapper_->Close());
}

}  // namespace

const char* DefaultConfigJson() { return kDefaultConfig; }

Result<TrainConfig> BuildTrainConfig(const comm::Communicator& world,
                                     const std::string& config_path,
                                     const ConfigOverrides& overrides) {
  const ConfigContext ctx{.world_size = world.size(),
                          .local_rank = world.topology().local_rank,
                          .node = world.topology().node};
  Result<TrainConfig> config = [&]() -> Result<TrainConfig> {
    std::string text = kDefaultConfig;
    const std::string where =
        config_path.empty() ? std::string("built-in config: ") : "config " + config_path + ": ";
    if (!config_path.empty()) {
      ZINF_ASSIGN_OR_RETURN(text, ReadConfigFile(config_path));
    }
    Result<Json> root = ParseJson<Json>(text, {.max_bytes = 16u << 20, .max_depth = 32});
    if (!root) return Annotate(ParseTrainConfig(text, ctx), where);  // the parser's own message
    ApplyOverrides(overrides, *root);
    return Annotate(ParseTrainConfig(DumpJsonForDisplay(*root), ctx), where);
  }();
  ZINF_RETURN_IF_ERROR(world.AgreeOnStatus(config.has_value() ? OkStatus()
                                                              : Status(config.error())));
  ZINF_RETURN_IF_ERROR(CheckSameConfigOnAllRanks(world, *config));
  return config;
}

Result<TrainSummary> Train(const comm::Communicator& world, const TrainConfig& config,
                           const TrainOptions& options) {
  StopSignals signals;
  Run run(world, config, options);
  return run.Go();
}

}  // namespace zinf::train
