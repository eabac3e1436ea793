// Model: what zinf-train trains. A model owns a ParamLayout (the named parameters and their place
// in one flat fp32 vector), a deterministic initialization of that vector, and a forward/backward
// pass that turns the full flat weight vector and one micro-batch into a loss and a gradient.
//
//   ZINF_ASSIGN_OR_RETURN(CharLM model, CharLM::Create({.hidden = 256, .layers = 2}));
//   std::vector<float> w(model.layout().total_numel()), g(w.size(), 0.0f);
//   ZINF_RETURN_IF_ERROR(model.InitWeights(seed, w));
//   ZINF_ASSIGN_OR_RETURN(Batch batch, dataset.SampleBatch(
//       {.seed = seed, .step = step, .micro_batch = m, .world_rank = r, .world_size = n}, 64, 16));
//   ZINF_ASSIGN_OR_RETURN(double loss, model.ForwardBackward(w, batch, g));  // g += dloss/dw
//
// Implementations: charlm.h (character-level MLP language model), synthetic.h (pseudo-gradients
// at memory speed for I/O and scaling runs).
//
// Thread safety: every const method of every Model may be called concurrently (working memory
// is per call). A Model is immutable after Create.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/partition/layout.h"

namespace zinf::train {

// Identifies one micro-batch of a data-parallel run. Every batch a run sees is a pure function of
// these fields, so an interrupted and resumed run sees exactly the batches of an uninterrupted
// one, and each rank sees its own.
struct BatchId {
  std::uint64_t seed = 0;  // the run's data seed
  std::uint64_t step = 0;  // global optimizer step (0-based)
  int micro_batch = 0;     // micro-batch index within the step (gradient accumulation), >= 0
  int world_rank = 0;      // in [0, world_size)
  int world_size = 1;      // >= 1
};

// A 64-bit key mixing every field of `id` (splitmix64 chain): distinct ids give distinct keys
// with overwhelming probability. Pure function; the synthetic model derives its gradient from it.
inline std::uint64_t BatchKey(const BatchId& id);

// One micro-batch of next-token examples: example i has the context ids
// contexts[i * context_size, (i + 1) * context_size) and the id to predict targets[i].
// A batch with no examples (synthetic model) carries only its key.
struct Batch {
  int context_size = 0;
  std::vector<std::int32_t> contexts = {};  // size() * context_size ids, row-major
  std::vector<std::int32_t> targets = {};   // one per example
  std::uint64_t key = 0;                    // BatchKey of the BatchId it was made from
  // Examples the batch stands for (a synthetic batch has no data but a nominal size, used for
  // throughput figures); equals targets.size() for a data batch.
  std::size_t num_examples = 0;

  std::size_t size() const { return num_examples; }
};

// Stages 2 and 3: what a model's layered pass (Model::ForwardBackwardLayered) sees of the
// parameters. The trainer implements it over the engine's Gather scopes (stage 3: partitioned
// parameters) or its whole working weights (stage 2), with GradientReady; a test may implement
// it over a flat vector.
class LayerAccess {
 public:
  virtual ~LayerAccess() = default;
  // Makes the whole weights of the parameters `params` (layout indices, in that order) readable
  // and gives up those of the previous Fetch: the spans stay valid until the next Fetch or the
  // end of the pass, never longer. In the trainer at stage 3 collective (every rank fetches the
  // same parameters in the same order); its errors are then the same on every rank.
  virtual Result<std::vector<std::span<const float>>> Fetch(
      std::span<const std::size_t> params) = 0;
  // Parameter `index`'s gradient of the pass's mean loss, complete (its numel elements); `grad`
  // is read before the call returns. Each parameter exactly once per pass.
  virtual Status GradientDone(std::size_t index, std::span<const float> grad) = 0;
};

class Model {
 public:
  virtual ~Model() = default;

  // "charlm", "synthetic".
  virtual std::string_view name() const = 0;
  // One line for the log: architecture and parameter count.
  virtual std::string Describe() const = 0;
  // The named parameters; layout().total_numel() is the number of parameters.
  virtual const partition::ParamLayout& layout() const = 0;

  // Writes elements [flat_offset, flat_offset + out.size()) of the deterministic initial weight
  // vector for `seed`. Every element is a pure function of (seed, its flat index), so any slice
  // is computed independently and equals the same slice of InitWeights (the trainer streams
  // slices of it into the swapper without materializing the whole vector).
  // Errors: InvalidArgument if the slice reaches past layout().total_numel().
  virtual Status InitSlice(std::uint64_t seed, std::uint64_t flat_offset,
                           std::span<float> out) const = 0;

  // The whole initial vector: InitSlice(seed, 0, flat_weights).
  // Errors: InvalidArgument unless flat_weights.size() == layout().total_numel().
  Status InitWeights(std::uint64_t seed, std::span<float> flat_weights) const {
    if (flat_weights.size() != layout().total_numel()) {
      return InvalidArgumentError(std::string(name()) + ": InitWeights needs " +
                                  std::to_string(layout().total_numel()) + " floats, got " +
                                  std::to_string(flat_weights.size()));
    }
    return InitSlice(seed, 0, flat_weights);
  }

  // Forward and backward over `batch` with the full flat weight vector (layout order). Returns
  // the mean loss over the batch and ACCUMULATES the gradient of that mean loss into flat_grad
  // (flat_grad += d loss / d weights), so that micro-batches can be summed. Deterministic: the
  // same weights and batch give bitwise the same loss and gradient (for a fixed BLAS thread count).
  // Errors: InvalidArgument for spans of the wrong size or a batch the model cannot take
  // (wrong context size, ids out of range, empty batch for a data model).
  virtual Result<double> ForwardBackward(std::span<const float> flat_weights, const Batch& batch,
                                         std::span<float> flat_grad) const = 0;

  // Checks that `batch` is one this model takes (the ForwardBackward errors for a batch), so that
  // a layered pass, whose fetches are collective, begins only on a batch every rank agreed on.
  virtual Status CheckBatch(const Batch& batch) const = 0;

  // Stages 2 and 3: the same forward and backward pass over `batch`, one layer at a time. The weights
  // come from `access.Fetch` (a layer's parameters before its forward, and again before its
  // backward), and each parameter's gradient of the mean loss goes to `access.GradientDone` as
  // soon as the backward pass has completed it (in reverse layout order), so that no more than
  // a layer's weights and gradients are held at once. Returns the mean loss. The same loss and
  // gradient as ForwardBackward up to the order of float sums. The fetches are the same for
  // every batch (every rank fetches alike). Precondition: CheckBatch(batch) is OK.
  // Errors: those of `access`.
  virtual Result<double> ForwardBackwardLayered(const Batch& batch, LayerAccess& access) const = 0;

  // The mean loss only (evaluation); same value as ForwardBackward would return.
  // Errors: as ForwardBackward.
  virtual Result<double> Loss(std::span<const float> flat_weights, const Batch& batch) const = 0;

  // An upper estimate of the host memory one ForwardBackward of `examples` examples allocates
  // (the batch, the activations and their gradients), for a check before the first step: a
  // micro-batch that cannot fit is an error, not a std::bad_alloc. Saturates at UINT64_MAX.
  virtual std::uint64_t WorkingBytes(std::uint64_t examples) const = 0;

 protected:
  // Shared check of InitSlice's arguments.
  Status CheckSlice(std::uint64_t flat_offset, std::size_t numel) const {
    const std::uint64_t total = layout().total_numel();
    if (flat_offset > total || numel > total - flat_offset) {
      return InvalidArgumentError(std::string(name()) + ": slice [" + std::to_string(flat_offset) +
                                  ", +" + std::to_string(numel) + ") reaches past the " +
                                  std::to_string(total) + " parameters");
    }
    return OkStatus();
  }
};

namespace internal {

// splitmix64 finalizer: a bijective 64-bit mix.
constexpr std::uint64_t Mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from 24 high bits of `bits` (exactly representable as float).
constexpr float SymmetricUnit(std::uint64_t bits) {
  return static_cast<float>(static_cast<std::int64_t>(bits >> 40) - (std::int64_t{1} << 23)) *
         (1.0f / static_cast<float>(1 << 23));
}

}  // namespace internal

inline std::uint64_t BatchKey(const BatchId& id) {
  std::uint64_t h = internal::Mix64(id.seed ^ 0x7a696e6664617461ULL);  // "zinfdata"
  h = internal::Mix64(h ^ id.step);
  h = internal::Mix64(h ^ static_cast<std::uint32_t>(id.micro_batch));
  h = internal::Mix64(h ^ static_cast<std::uint32_t>(id.world_rank));
  return internal::Mix64(h ^ static_cast<std::uint32_t>(id.world_size));
}

}  // namespace zinf::train
