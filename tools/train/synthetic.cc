#include "synthetic.h"

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

namespace zinf::train {
namespace {

constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// 32-bit integer hash (Chris Wellons' lowbias32): cheap enough to vectorize with 32-bit lanes.
constexpr std::uint32_t Hash32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  return x ^ (x >> 16);
}

// Sum of w^2 over [begin, end) (< kChunkNumel elements, 8 double lanes added in a fixed order),
// and g += w + noise there. The noise of element begin + j is Hash32(chunk_key ^ (j * golden32)).
double Chunk(const float* w, float* g, std::uint32_t chunk_key, std::size_t begin,
             std::size_t end) {
  constexpr std::size_t kLanes = 8;
  double lanes[kLanes] = {};
  const std::size_t n = end - begin;
  const float* wc = w + begin;
  std::size_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) {
      lanes[l] += static_cast<double>(wc[j + l]) * static_cast<double>(wc[j + l]);
    }
  }
  for (; j < n; ++j) lanes[0] += static_cast<double>(wc[j]) * static_cast<double>(wc[j]);
  double sum = 0.0;
  for (const double lane : lanes) sum += lane;
  if (g != nullptr) {
    float* gc = g + begin;
    const auto m = static_cast<std::uint32_t>(n);
    for (std::uint32_t k = 0; k < m; ++k) {
      const std::uint32_t h = Hash32(chunk_key ^ (k * 0x9e3779b9U));
      const float noise = static_cast<float>(static_cast<std::int32_t>(h >> 8) - (1 << 23)) *
                          (1.0f / static_cast<float>(1 << 23));
      gc[k] += wc[k] + SyntheticModel::kNoise * noise;
    }
  }
  return sum;
}

}  // namespace

Result<SyntheticModel> SyntheticModel::Create(std::uint64_t total_params, int num_params,
                                              int threads) {
  if (num_params < 1 || total_params < static_cast<std::uint64_t>(num_params)) {
    return InvalidArgumentError("synthetic: need 1 <= num_params <= total_params, got " +
                                std::to_string(num_params) + " and " +
                                std::to_string(total_params));
  }
  if (threads < 0) {
    return InvalidArgumentError("synthetic: threads must be >= 0, got " + std::to_string(threads));
  }
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const auto n = static_cast<std::uint64_t>(num_params);
  std::vector<partition::ParamSpec> specs;
  for (std::uint64_t p = 0; p < n; ++p) {
    const std::uint64_t numel = total_params / n + (p < total_params % n ? 1 : 0);
    specs.push_back({"p" + std::to_string(p), {static_cast<std::int64_t>(numel)}});
  }
  ZINF_ASSIGN_OR_RETURN(partition::ParamLayout layout,
                        Annotate(partition::ParamLayout::Create(std::move(specs)), "synthetic: "));
  return SyntheticModel(std::move(layout), threads);
}

SyntheticModel::SyntheticModel(partition::ParamLayout layout, int threads)
    : layout_(std::move(layout)), threads_(threads) {}

Batch SyntheticModel::MakeBatch(const BatchId& id, std::size_t micro_batch_size) {
  Batch batch;
  batch.key = BatchKey(id);
  batch.num_examples = micro_batch_size;
  return batch;
}

std::string SyntheticModel::Describe() const {
  return "synthetic: " + std::to_string(layout_.num_params()) + " parameter tensors, " +
         std::to_string(layout_.total_numel()) + " parameters, pseudo-gradients, " +
         std::to_string(threads_) + " threads";
}

Status SyntheticModel::InitSlice(std::uint64_t seed, std::uint64_t flat_offset,
                                 std::span<float> out) const {
  ZINF_RETURN_IF_ERROR(CheckSlice(flat_offset, out.size()));
  const std::uint64_t seed_key = internal::Mix64(seed ^ 0x73796e7468000000ULL);  // "synth"
  for (std::size_t j = 0; j < out.size(); ++j) {
    out[j] =
        0.5f * internal::SymmetricUnit(internal::Mix64(seed_key + (flat_offset + j) * kGolden));
  }
  return OkStatus();
}

double SyntheticModel::Run(std::span<const float> w, std::uint64_t key,
                           std::span<float> grad) const {
  const std::size_t n = w.size();
  const std::size_t num_chunks = (n + kChunkNumel - 1) / kChunkNumel;
  std::vector<double> sums(num_chunks, 0.0);
  const std::uint64_t noise_key = internal::Mix64(key ^ 0x6e6f697365000000ULL);  // "noise"
  float* g = grad.empty() ? nullptr : grad.data();
  // Chunk c goes to worker c % workers: the split never changes what a chunk computes.
  const auto work = [&](std::size_t worker, std::size_t workers) {
    for (std::size_t c = worker; c < num_chunks; c += workers) {
      const auto chunk_key = static_cast<std::uint32_t>(internal::Mix64(noise_key + c * kGolden));
      sums[c] = Chunk(w.data(), g, chunk_key, c * kChunkNumel, std::min(n, (c + 1) * kChunkNumel));
    }
  };
  const std::size_t workers = std::min<std::size_t>(static_cast<std::size_t>(threads_),
                                                    std::max<std::size_t>(num_chunks, 1));
  std::vector<std::jthread> pool;
  for (std::size_t t = 1; t < workers; ++t) pool.emplace_back(work, t, workers);
  work(0, workers);
  pool.clear();  // joins
  double total = 0.0;
  for (double s : sums) total += s;
  return 0.5 * total / static_cast<double>(n);
}

Result<double> SyntheticModel::ForwardBackward(std::span<const float> flat_weights,
                                               const Batch& batch,
                                               std::span<float> flat_grad) const {
  if (flat_weights.size() != layout_.total_numel() || flat_grad.size() != layout_.total_numel()) {
    return InvalidArgumentError("synthetic: weights and gradient need " +
                                std::to_string(layout_.total_numel()) + " floats, got " +
                                std::to_string(flat_weights.size()) + " and " +
                                std::to_string(flat_grad.size()));
  }
  return Run(flat_weights, batch.key, flat_grad);
}

Status SyntheticModel::CheckBatch(const Batch&) const { return OkStatus(); }

// Per parameter, in reverse layout order: each element's gradient is that of Run (the noise of
// flat index i is the same hash of its chunk and place in it); the loss sums in another order.
Result<double> SyntheticModel::ForwardBackwardLayered(const Batch& batch,
                                                      LayerAccess& access) const {
  const std::uint64_t noise_key = internal::Mix64(batch.key ^ 0x6e6f697365000000ULL);  // "noise"
  double total = 0.0;
  std::vector<float> grad;
  for (std::size_t p = layout_.num_params(); p-- > 0;) {
    const std::size_t ids[] = {p};
    ZINF_ASSIGN_OR_RETURN(std::vector<std::span<const float>> fetched, access.Fetch(ids));
    const std::span<const float> w = fetched[0];
    const std::uint64_t offset = layout_.param(p).flat_offset;
    grad.resize(w.size());
    double sum = 0.0;
    for (std::size_t j = 0; j < w.size(); ++j) {
      const std::uint64_t i = offset + j;
      const std::uint64_t c = i / kChunkNumel;
      const auto chunk_key = static_cast<std::uint32_t>(internal::Mix64(noise_key + c * kGolden));
      const auto k = static_cast<std::uint32_t>(i % kChunkNumel);
      const std::uint32_t h = Hash32(chunk_key ^ (k * 0x9e3779b9U));
      const float noise = static_cast<float>(static_cast<std::int32_t>(h >> 8) - (1 << 23)) *
                          (1.0f / static_cast<float>(1 << 23));
      sum += static_cast<double>(w[j]) * static_cast<double>(w[j]);
      grad[j] = w[j] + kNoise * noise;
    }
    total += sum;
    ZINF_RETURN_IF_ERROR(access.GradientDone(p, grad));
  }
  return 0.5 * total / static_cast<double>(layout_.total_numel());
}

Result<double> SyntheticModel::Loss(std::span<const float> flat_weights, const Batch& batch) const {
  if (flat_weights.size() != layout_.total_numel()) {
    return InvalidArgumentError("synthetic: weights need " + std::to_string(layout_.total_numel()) +
                                " floats, got " + std::to_string(flat_weights.size()));
  }
  return Run(flat_weights, batch.key, {});
}

}  // namespace zinf::train
