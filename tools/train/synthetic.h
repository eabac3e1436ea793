// SyntheticModel: a model with no data and no math beyond one pass over memory, for I/O and
// scaling runs of the optimizer path (swap store, pool, collectives) at any size.
//
// Layout: `num_params` 1-D parameters "p0", "p1", ... splitting `total_params` as evenly as
// possible (the first total % num_params get one element more).
//
// Definitions, for weights w (N = total_params) and batch key K = batch.key:
//   pseudo-loss  L(w)     = 0.5 * mean_i(w_i^2)
//   gradient     g_i     += w_i + kNoise * u(K, i)      u uniform in [-1, 1): a 32-bit hash of i
//                                                       keyed per chunk of kChunkNumel by K
// The gradient is that of 0.5 * sum_i(w_i^2) (N times L, so its elements are O(w), not O(w / N))
// plus batch-dependent noise: Adam drives the weights towards 0 and the loss falls, visibly but
// meaninglessly. Both are pure functions of (w, K) and bitwise reproducible whatever the thread
// count: the loss is summed per fixed chunk of kChunkNumel elements in double (8 lanes), chunks
// added in order. One pass over w and the gradient, vectorizable: memory speed.
//
// Initialization: w_i = 0.5 * u(seed, i) (InitSlice: any slice on its own).
//
// Thread safety: const methods may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "model.h"
#include "zinf/core/status.h"
#include "zinf/partition/layout.h"

namespace zinf::train {

class SyntheticModel final : public Model {
 public:
  static constexpr float kNoise = 0.01f;
  static constexpr std::size_t kChunkNumel = std::size_t{1} << 16;

  // threads: threads per ForwardBackward/Loss call including the caller (0 = hardware
  // concurrency). Errors: InvalidArgument for num_params < 1, total_params < num_params,
  // threads < 0, or sizes ParamLayout rejects.
  static Result<SyntheticModel> Create(std::uint64_t total_params, int num_params = 4,
                                       int threads = 1);

  // A batch that is only its key (BatchKey(id)) and a nominal `micro_batch_size` examples.
  static Batch MakeBatch(const BatchId& id, std::size_t micro_batch_size);

  std::string_view name() const override { return "synthetic"; }
  std::string Describe() const override;
  const partition::ParamLayout& layout() const override { return layout_; }

  Status InitSlice(std::uint64_t seed, std::uint64_t flat_offset,
                   std::span<float> out) const override;
  // The batch may be empty of examples (only its key is used). Errors: InvalidArgument for spans
  // of the wrong size.
  Result<double> ForwardBackward(std::span<const float> flat_weights, const Batch& batch,
                                 std::span<float> flat_grad) const override;
  Result<double> Loss(std::span<const float> flat_weights, const Batch& batch) const override;
  // Every batch is one it takes (only its key is used).
  Status CheckBatch(const Batch& batch) const override;
  // One fetch per parameter, in reverse layout order: its gradient needs only its own weights.
  Result<double> ForwardBackwardLayered(const Batch& batch, LayerAccess& access) const override;
  // A synthetic batch is nominal: no memory per example.
  std::uint64_t WorkingBytes(std::uint64_t) const override { return 0; }

 private:
  SyntheticModel(partition::ParamLayout layout, int threads);

  // Loss, and with a non-empty grad the gradient accumulation, over the whole vector.
  double Run(std::span<const float> w, std::uint64_t key, std::span<float> grad) const;

  partition::ParamLayout layout_;
  int threads_ = 1;
};

}  // namespace zinf::train
