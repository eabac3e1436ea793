// CharLM: a character-level (byte-level) language model, the default model of zinf-train.
//
// Architecture (Bengio-style MLP language model), for a batch of B windows of C bytes:
//   x0 = concat(embed[ctx_0], ..., embed[ctx_{C-1}])          [B, C*E]
//   x_{l+1} = act(x_l * layer<l>.weight + layer<l>.bias)      [B, H]   for l in [0, layers)
//   logits = x_layers * out.weight + out.bias                 [B, V]
//   loss = mean over the batch of -log softmax(logits)[target]
// with act = tanh (default) or ReLU, V = vocab_size (256: bytes), and weights stored [in, out]
// row-major. Forward and backward are cblas_sgemm calls over the batch (OpenBLAS).
//
// Parameters, in layout order: "embed" [V, E], "layer<l>.weight" [in_l, H] and "layer<l>.bias"
// [H] (in_0 = C*E, in_l = H after), "out.weight" [in_out, V], "out.bias" [V] (in_out = H, or C*E
// when layers = 0). Count (NumParams):
//   V*E + (C*E*H + H) + (layers-1)*(H*H + H) + H*V + V       (layers >= 1)
// e.g. V=256, C=16, E=16: hidden 64 x 1 -> 37,184; hidden 256 x 2 (default) -> 201,472;
// hidden 1024 x 2 -> 1,579,264; hidden 4096 x 4 -> 52,449,536;
// hidden 32768 x 4 -> 3,238,138,112 (the layout only; nothing is allocated until ForwardBackward).
//
// Initialization (InitSlice): element k of the flat vector is bound * u(seed, k), u uniform in
// [-1, 1) from splitmix64 of (seed, k); bound = sqrt(3) for "embed" (unit variance),
// sqrt(3 / fan_in) for hidden weights (LeCun: unit-variance pre-activations), 1 / sqrt(fan_in)
// for out.weight (small initial logits: initial loss close to ln V), 0 for biases.
//
// Threads: the sgemm calls use OpenBLAS's own thread pool, OpenBLAS's default size (all cores, or
// OPENBLAS_NUM_THREADS) unless SetBlasThreads is called; with several ranks per node, give each
// rank cores / ranks threads. Results are deterministic for a fixed thread count.
//
// Thread safety: const methods may be called concurrently (working memory is per call), though
// concurrent sgemm calls share OpenBLAS's pool.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "data.h"
#include "model.h"
#include "zinf/core/status.h"
#include "zinf/partition/layout.h"

namespace zinf::train {

enum class Activation { kTanh, kRelu };

// "tanh", "relu".
std::string_view ActivationName(Activation activation);
// Parses the names above. Errors: InvalidArgument naming the text.
Result<Activation> ParseActivation(std::string_view text);

struct CharLMOptions {
  int vocab_size = 256;  // output classes; ids must be < vocab_size, [2, 65536]
  int context = 16;      // bytes of context per example, [1, 4096]
  int embed_dim = 16;    // embedding width per byte, [1, 65536]
  int hidden = 256;      // width of each hidden layer, [1, 1 << 20]
  int layers = 2;        // hidden layers, [0, 1024]
  Activation activation = Activation::kTanh;  // of the hidden layers
};

class CharLM final : public Model {
 public:
  // Validates `options` (InvalidArgument naming the field and its range) and builds the layout.
  // Allocates nothing that scales with the parameter count.
  static Result<CharLM> Create(const CharLMOptions& options);
  // The parameter count of the model Create would build (formula at the top), without building
  // it. Errors: InvalidArgument as Create.
  static Result<std::uint64_t> NumParams(const CharLMOptions& options);

  std::string_view name() const override { return "charlm"; }
  std::string Describe() const override;
  const partition::ParamLayout& layout() const override { return layout_; }
  const CharLMOptions& options() const { return options_; }

  Status InitSlice(std::uint64_t seed, std::uint64_t flat_offset,
                   std::span<float> out) const override;
  // Working memory per call: about B * (2*C*E + (layers + 2) * H + V) floats.
  Result<double> ForwardBackward(std::span<const float> flat_weights, const Batch& batch,
                                 std::span<float> flat_grad) const override;
  Result<double> Loss(std::span<const float> flat_weights, const Batch& batch) const override;
  Status CheckBatch(const Batch& batch) const override;
  // Fetches the embedding, each hidden layer's weight and bias, and the output layer (kept
  // from its forward into its backward), then the hidden layers again from the top; the
  // embedding's gradient needs no fetch.
  Result<double> ForwardBackwardLayered(const Batch& batch, LayerAccess& access) const override;
  std::uint64_t WorkingBytes(std::uint64_t examples) const override;

  // Mean loss over dataset.EvalBatch(num_examples, context) (the held-out tail), computed in
  // chunks of at most 256 examples. Errors: as EvalBatch and Loss.
  Result<double> EvalLoss(std::span<const float> flat_weights, const TextDataset& dataset,
                          int num_examples) const;

  // Generates `length` bytes continuing `prompt` (its last `context` bytes; left-padded with
  // spaces when shorter). temperature > 0 samples from softmax(logits / temperature) with a
  // splitmix64 stream from `seed`; temperature <= 0 is greedy. Only printable ASCII and '\n' are
  // ever produced (the other logits are masked), so the result can go to a terminal. Returns the
  // generated bytes only. Requires vocab_size >= 127. Errors: InvalidArgument for a weight span
  // of the wrong size, length < 0 or a vocabulary without the printable bytes.
  Result<std::string> Sample(std::span<const float> flat_weights, std::string_view prompt,
                             int length, std::uint64_t seed, float temperature = 0.8f) const;

 private:
  CharLM(const CharLMOptions& options, partition::ParamLayout layout);

  Status CheckBatch(std::span<const float> flat_weights, const Batch& batch) const;

  CharLMOptions options_;
  partition::ParamLayout layout_;
};

// Sets the number of threads OpenBLAS uses in every later sgemm (threads >= 1); returns the
// number in effect afterwards. A no-op returning 1 when the BLAS is not OpenBLAS.
int SetBlasThreads(int threads);

}  // namespace zinf::train
