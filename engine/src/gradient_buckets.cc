// GradientBuckets (gradient_buckets.h): the buckets, their order and the worker thread.
#include "gradient_buckets.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include <fmt/format.h>

namespace zinf::engine {
namespace {

// Gives the whole pages inside `range` back to the kernel; they read as zero afterwards. Best
// effort: a failure only keeps the pages.
void ReleasePages(std::span<const float> range) {
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(range.data());
  const std::uintptr_t first = (begin + page - 1) / page * page;
  const std::uintptr_t last = (begin + range.size_bytes()) / page * page;
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// Each parameter's bucket: parameters in layout order, a new bucket once one holds
// `bucket_elems` elements (Build's and PlanHostMemory's one cut).
std::vector<std::size_t> CutIntoBuckets(const partition::PartitionPlan& plan,
                                        std::uint64_t bucket_elems) {
  const auto& params = plan.layout().params();
  std::vector<std::size_t> bucket_of(params.size());
  std::size_t buckets = 0;
  std::uint64_t in_bucket = 0;
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (buckets == 0 || in_bucket >= bucket_elems) {
      ++buckets;
      in_bucket = 0;
    }
    bucket_of[p] = buckets - 1;
    in_bucket += params[p].numel;
  }
  return bucket_of;
}

}  // namespace

GradientBuckets::HostPlan GradientBuckets::PlanHostMemory(const partition::PartitionPlan& plan,
                                                          int rank, std::uint64_t bucket_elems,
                                                          bool lent,
                                                          std::uint64_t max_sub_group_numel) {
  const std::vector<std::size_t> cut =
      CutIntoBuckets(plan, std::max<std::uint64_t>(bucket_elems, 1));
  const std::size_t buckets = cut.empty() ? 0 : cut.back() + 1;
  std::vector<std::uint64_t> total(buckets, 0), mine(buckets, 0);
  for (std::size_t p = 0; p < cut.size(); ++p) total[cut[p]] += plan.layout().param(p).numel;
  for (const partition::Fragment& f : plan.RankFragments(rank)) mine[cut[f.param_index]] += f.numel;
  HostPlan out;
  const std::uint64_t largest = total.empty() ? 0 : *std::max_element(total.begin(), total.end());
  const std::uint64_t largest_mine = mine.empty() ? 0 : *std::max_element(mine.begin(), mine.end());
  out.max_bucket_elems = largest;
  // With more than one rank, the backend's receive scratch (collective_backend.h): as large as
  // this rank's share.
  const std::uint64_t scratch = plan.world_size() > 1 ? largest_mine : 0;
  out.bucket_bytes = ((lent ? 2 : 1) * largest + largest_mine + scratch) * sizeof(float);
  if (max_sub_group_numel > 0) {
    out.staging_bytes =
        std::min(plan.partition_numel(), largest_mine + 2 * max_sub_group_numel) * sizeof(float);
  }
  return out;
}

Result<std::unique_ptr<GradientBuckets>> GradientBuckets::Create(
    const partition::PartitionPlan& plan, int rank, std::vector<std::span<float>> grads,
    std::uint64_t bucket_elems, comm::CollectiveBackend* backend, Target target,
    comm::Timers* timers, bool background) {
  std::unique_ptr<GradientBuckets> b(new GradientBuckets());
  b->grads_ = std::move(grads);
  b->backend_ = backend;
  b->target_ = std::move(target);
  b->timers_ = timers;
  b->background_ = background;
  b->rank_ = rank;
  ZINF_RETURN_IF_ERROR(b->Build(plan, rank, std::max<std::uint64_t>(bucket_elems, 1)));
  return b;
}

// Cuts the parameters into buckets and sorts every rank's fragments into them.
Status GradientBuckets::Build(const partition::PartitionPlan& plan, int rank,
                              std::uint64_t bucket_elems) {
  const auto& params = plan.layout().params();
  const auto world = static_cast<std::size_t>(plan.world_size());
  bucket_of_.resize(params.size());
  for (const partition::ParamInfo& info : params) sizes_.push_back(info.numel);
  const std::vector<std::size_t> cut = CutIntoBuckets(plan, bucket_elems);
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (buckets_.empty() || cut[p] != buckets_.size() - 1) {
      buckets_.emplace_back();
      buckets_.back().first_param = p;
      buckets_.back().counts.assign(world, 0);
    }
    bucket_of_[p] = buckets_.size() - 1;
    buckets_.back().end_param = p + 1;
  }
  if (lent()) pieces_of_.resize(params.size());
  for (int r = 0; r < plan.world_size(); ++r) {
    for (const partition::Fragment& f : plan.RankFragments(r)) {
      Bucket& bucket = buckets_[bucket_of_[f.param_index]];
      const Piece piece{f.param_index, f.param_offset, f.numel, f.partition_offset, bucket.total};
      if (lent()) pieces_of_[f.param_index].push_back(bucket.send.size());
      bucket.send.push_back(piece);
      bucket.total += f.numel;
      bucket.counts[static_cast<std::size_t>(r)] += static_cast<std::int64_t>(f.numel);
      if (r == rank) bucket.mine.push_back(piece);
    }
  }
  // Which of this rank's sub-groups each bucket fills, and by how much.
  const std::vector<partition::SubGroup>& sgs = target_.sub_groups;
  sub_group_total_.assign(sgs.size(), 0);
  std::uint64_t largest = 0, largest_mine = 0;
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& bucket = buckets_[i];
    const std::uint64_t total = bucket.total;
    if (total > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
      return InvalidArgumentError(fmt::format(
          "zero_optimization.reduce_bucket_size: gradient bucket {} holds {} elements, more than "
          "one MPI collective moves ({}); lower it",
          i, total, std::numeric_limits<int>::max()));
    }
    largest = std::max(largest, total);
    largest_mine = std::max(largest_mine, static_cast<std::uint64_t>(bucket.counts[rank]));
    std::vector<std::uint64_t> per_sub_group(sgs.size(), 0);
    for (const Piece& piece : bucket.mine) {
      // Sub-groups are contiguous and sorted: split the piece over those it covers.
      auto it = std::upper_bound(
          sgs.begin(), sgs.end(), piece.partition_offset,
          [](std::uint64_t v, const partition::SubGroup& sg) { return v < sg.partition_offset; });
      std::size_t s = static_cast<std::size_t>(it - sgs.begin()) - 1;
      std::uint64_t at = piece.partition_offset;
      const std::uint64_t end = piece.partition_offset + piece.numel;
      while (at < end && s < sgs.size()) {
        const std::uint64_t sg_end = sgs[s].partition_offset + sgs[s].numel;
        const std::uint64_t n = std::min(end, sg_end) - at;
        per_sub_group[s] += n;
        at += n;
        ++s;
      }
    }
    for (std::size_t s = 0; s < sgs.size(); ++s) {
      if (per_sub_group[s] == 0) continue;
      bucket.sub_group_elems.emplace_back(s, per_sub_group[s]);
      sub_group_total_[s] += per_sub_group[s];
    }
  }
  // Lent gradients are packed into the buckets' own buffers as they arrive.
  max_bucket_elems_ = largest;
  if (!lent()) send_.assign(largest, 0.0f);
  lent_send_.resize(lent() ? buckets_.size() : 0);
  recv_.assign(largest_mine, 0.0f);
  ready_.assign(params.size(), false);
  missing_.assign(buckets_.size(), 0);
  return OkStatus();
}

GradientBuckets::~GradientBuckets() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

// A new micro-batch: nothing handed, nothing arrived. The caller's thread, worker idle.
void GradientBuckets::Begin(int micro_batch) {
  active_ = true;
  micro_batch_ = micro_batch;
  std::fill(ready_.begin(), ready_.end(), false);
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    missing_[i] = buckets_[i].end_param - buckets_[i].first_param;
  }
  pending_ = sub_group_total_;
  collective_error_.reset();
  // What a failed micro-batch left unreduced.
  for (std::vector<float>& buffer : lent_send_) std::vector<float>().swap(buffer);
  send_buffers_ = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    complete_ = 0;
    reduced_ = 0;
  }
  // A sub-group of padding only (a tiny model on many ranks) has nothing to wait for.
  if (target_.gradients == nullptr) return;
  for (std::size_t s = 0; s < pending_.size(); ++s) {
    if (pending_[s] == 0) SwapOut(s);
  }
}

void GradientBuckets::RecordLocal(Status status) {
  if (status) return;
  std::lock_guard<std::mutex> lock(error_mu_);
  if (!local_error_) local_error_ = std::move(status).error();
}

bool GradientBuckets::HasLocalError() {
  std::lock_guard<std::mutex> lock(error_mu_);
  return local_error_.has_value();
}

Status GradientBuckets::Ready(std::size_t param, int micro_batch) {
  if (lent()) {
    Status wrong = FailedPreconditionError(fmt::format(
        "engine: GradientReady({}) without a gradient: the parameters were registered without "
        "grads buffers; hand each gradient with GradientReady(index, grad)",
        param));
    RecordLocal(wrong);
    return wrong;
  }
  ZINF_RETURN_IF_ERROR(Accept(param, micro_batch));
  Handed(param);
  return OkStatus();
}

Status GradientBuckets::Ready(std::size_t param, int micro_batch, std::span<const float> grad) {
  Status bad = OkStatus();
  if (!lent()) {
    bad = FailedPreconditionError(fmt::format(
        "engine: GradientReady({}, grad): the parameters were registered with grads buffers; "
        "call GradientReady({}) once the gradient is in its buffer",
        param, param));
  } else if (param < ready_.size() && grad.size() != sizes_[param]) {
    bad = InvalidArgumentError(
        fmt::format("engine: GradientReady({}, grad): the gradient has {} elements, the "
                    "parameter {}",
                    param, grad.size(), sizes_[param]));
  }
  if (!bad) {
    RecordLocal(bad);
    return bad;
  }
  ZINF_RETURN_IF_ERROR(Accept(param, micro_batch));
  const std::size_t b = bucket_of_[param];
  const Bucket& bucket = buckets_[b];
  std::vector<float>& send = lent_send_[b];
  if (send.empty()) {
    if (background_) {  // Ready's bound on the buffers alive
      std::unique_lock<std::mutex> lock(mu_);
      idle_cv_.wait(lock, [&] { return reduced_ >= complete_; });
    }
    send.assign(bucket.total, 0.0f);
    peak_send_buffers_ = std::max(peak_send_buffers_, ++send_buffers_);
  }
  for (std::size_t i : pieces_of_[param]) {
    const Piece& piece = bucket.send[i];
    std::copy_n(grad.data() + piece.in_param, piece.numel, send.data() + piece.send_at);
  }
  Handed(param);
  return OkStatus();
}

Status GradientBuckets::Accept(std::size_t param, int micro_batch) {
  if (param >= ready_.size()) {
    Status bad = InvalidArgumentError(
        fmt::format("engine: GradientReady({}): there are {} parameters", param, ready_.size()));
    RecordLocal(bad);
    return bad;
  }
  if (!active_) Begin(micro_batch);
  if (ready_[param]) {
    Status twice = FailedPreconditionError(fmt::format(
        "engine: GradientReady({}) called twice in micro-batch {}", param, micro_batch_));
    RecordLocal(twice);
    return twice;
  }
  return OkStatus();
}

void GradientBuckets::Handed(std::size_t param) {
  ready_[param] = true;
  const std::size_t bucket = bucket_of_[param];
  if (--missing_[bucket] > 0) return;
  // The order reduces the last bucket first: how many of it are complete now.
  std::size_t complete;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (complete_ < buckets_.size() && missing_[buckets_.size() - 1 - complete_] == 0) {
      ++complete_;
    }
    complete = complete_;
    if (background_ && !worker_.joinable()) worker_ = std::thread([this] { Work(); });
  }
  if (background_) {
    work_cv_.notify_one();
    return;
  }
  while (reduced_ < complete) Reduce(reduced_++);
}

void GradientBuckets::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return !busy_ && reduced_ >= complete_; });
}

Status GradientBuckets::Finish(int micro_batch) {
  if (!active_) Begin(micro_batch);
  WaitIdle();
  // The worker is idle and gets nothing new (complete_ stays below reduced_ from here).
  while (true) {
    std::size_t k;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (reduced_ >= buckets_.size()) break;
      k = reduced_++;
    }
    Reduce(k);
  }
  active_ = false;
  if (collective_error_) return *collective_error_;
  std::lock_guard<std::mutex> lock(error_mu_);
  if (local_error_) {
    Error error = std::move(*local_error_);
    local_error_.reset();
    return error;
  }
  return OkStatus();
}

void GradientBuckets::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || reduced_ < complete_; });
    if (reduced_ >= complete_) return;  // stop_, and nothing given is left
    const std::size_t k = reduced_++;
    busy_ = true;
    lock.unlock();
    Reduce(k);
    lock.lock();
    busy_ = false;
    idle_cv_.notify_all();
  }
}

void GradientBuckets::Reduce(std::size_t k) {
  if (collective_error_) return;  // every rank stops at the same collective
  const std::size_t b = buckets_.size() - 1 - k;
  const Bucket& bucket = buckets_[b];
  std::span<const float> send;
  if (lent()) {
    // A bucket none of whose parameters was handed sends zeros.
    if (lent_send_[b].empty()) {
      lent_send_[b].assign(bucket.total, 0.0f);
      ++send_buffers_;
    }
    send = lent_send_[b];
  } else {
    for (const Piece& piece : bucket.send) {
      std::copy_n(grads_[piece.param].data() + piece.in_param, piece.numel,
                  send_.data() + piece.send_at);
    }
    for (std::size_t p = bucket.first_param; p < bucket.end_param; ++p) {
      std::fill(grads_[p].begin(), grads_[p].end(), 0.0f);
    }
    send = std::span<const float>(send_).first(bucket.total);
  }
  const auto mine = static_cast<std::size_t>(bucket.counts[static_cast<std::size_t>(rank_)]);
  Status reduced;
  {
    comm::ScopedTimer timer(*timers_, "reduce_scatter");
    reduced = backend_->ReduceScatterVSum(send, bucket.counts, std::span<float>(recv_).first(mine));
  }
  if (lent() && !lent_send_[b].empty()) {
    std::vector<float>().swap(lent_send_[b]);
    --send_buffers_;
  }
  if (!reduced) {
    collective_error_ = std::move(reduced).error();
    return;
  }
  Unpack(bucket);
}

// This rank's sums into the partition gradient or the staging partition; each sub-group whose
// elements have all arrived goes to the gradient swapper.
void GradientBuckets::Unpack(const Bucket& bucket) {
  const bool swapped = target_.gradients != nullptr;
  float* base = swapped ? target_.staging.data() : target_.accumulated.data();
  const bool add = !swapped && micro_batch_ > 0;
  std::size_t at = 0;
  for (const Piece& piece : bucket.mine) {
    float* dst = base + piece.partition_offset;
    const float* src = recv_.data() + at;
    if (add) {
      for (std::uint64_t i = 0; i < piece.numel; ++i) dst[i] += src[i];
    } else {
      std::copy_n(src, piece.numel, dst);
    }
    at += piece.numel;
  }
  if (!swapped && !target_.complete) return;
  for (const auto& [s, n] : bucket.sub_group_elems) {
    pending_[s] -= n;
    if (pending_[s] != 0) continue;
    if (target_.complete) target_.complete(s, micro_batch_);
    if (!swapped || HasLocalError()) continue;
    comm::ScopedTimer timer(*timers_, "gradient_swap_out");
    SwapOut(s);
  }
}

void GradientBuckets::SwapOut(std::size_t s) {
  const partition::SubGroup& sg = target_.sub_groups[s];
  const std::span<const float> grad =
      std::span<const float>(target_.staging).subspan(sg.partition_offset, sg.numel);
  RecordLocal(target_.gradients->SwapOut(micro_batch_, s, grad));  // copies what it keeps
  ReleasePages(grad);
}

}  // namespace zinf::engine
