#include "charlm.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#if __has_include(<cblas.h>)
#include <cblas.h>

#include "zinf/core/units.h"
#define ZINF_TRAIN_HAVE_CBLAS 1
#else
#define ZINF_TRAIN_HAVE_CBLAS 0
#endif

namespace zinf::train {
namespace {

// C = A * B (or with A / B transposed) + beta * C, row-major, as cblas_sgemm.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, const float* a, int lda, const float* b,
          int ldb, float beta, float* c, int ldc) {
#if ZINF_TRAIN_HAVE_CBLAS
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
#else
  // Reference loops for builds without a CBLAS (slow; same results up to rounding).
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int p = 0; p < k; ++p) {
        const float av = trans_a ? a[static_cast<std::size_t>(p) * lda + i]
                                 : a[static_cast<std::size_t>(i) * lda + p];
        const float bv = trans_b ? b[static_cast<std::size_t>(j) * ldb + p]
                                 : b[static_cast<std::size_t>(p) * ldb + j];
        sum += av * bv;
      }
      float& out = c[static_cast<std::size_t>(i) * ldc + j];
      out = (beta == 0.0f ? 0.0f : beta * out) + sum;
    }
  }
#endif
}

std::size_t Sz(int v) { return static_cast<std::size_t>(v); }

// Where each tensor of the layout starts, and the sizes of the network.
struct Net {
  int vocab = 0;
  int context = 0;
  int embed_dim = 0;
  int hidden = 0;
  int layers = 0;
  Activation activation = Activation::kTanh;
  std::size_t embed = 0;                     // offset of "embed"
  std::vector<std::size_t> weight, bias;     // offsets of layer<l>.weight / .bias
  std::size_t out_weight = 0, out_bias = 0;  // offsets of out.weight / out.bias

  int in0() const { return context * embed_dim; }
  int in(int l) const { return l == 0 ? in0() : hidden; }  // input width of hidden layer l
  int out_in() const { return layers == 0 ? in0() : hidden; }
};

Net MakeNet(const CharLMOptions& o, const partition::ParamLayout& layout) {
  Net net;
  net.vocab = o.vocab_size;
  net.context = o.context;
  net.embed_dim = o.embed_dim;
  net.hidden = o.hidden;
  net.layers = o.layers;
  net.activation = o.activation;
  std::size_t index = 0;
  net.embed = layout.param(index++).flat_offset;
  for (int l = 0; l < o.layers; ++l) {
    net.weight.push_back(layout.param(index++).flat_offset);
    net.bias.push_back(layout.param(index++).flat_offset);
  }
  net.out_weight = layout.param(index++).flat_offset;
  net.out_bias = layout.param(index++).flat_offset;
  return net;
}

// Activations of one forward pass over a batch of `rows` examples.
struct Activations {
  int rows = 0;
  std::vector<float> x0;              // [rows, in0] concatenated embeddings
  std::vector<std::vector<float>> h;  // [rows, hidden] per layer, after the activation
  std::vector<float> logits;          // [rows, vocab]

  const float* input(int l) const { return l == 0 ? x0.data() : h[Sz(l - 1)].data(); }
};

void AddBias(float* x, const float* bias, int rows, int cols) {
  for (int r = 0; r < rows; ++r) {
    float* row = x + Sz(r) * Sz(cols);
    for (int c = 0; c < cols; ++c) row[c] += bias[c];
  }
}

// grad_bias[c] += sum over rows of d[r, c], rows in order (deterministic).
void AddColumnSums(const float* d, int rows, int cols, float* grad_bias) {
  for (int r = 0; r < rows; ++r) {
    const float* row = d + Sz(r) * Sz(cols);
    for (int c = 0; c < cols; ++c) grad_bias[c] += row[c];
  }
}

// The forward pass's steps, each on the weights it names: the flat pass (Forward) runs them on
// the whole weights, the layered one on each layer's fetched weights.

// x0 = the context's embeddings, examples in order.
void EmbedForward(const Net& net, const float* embed, const std::int32_t* contexts, int rows,
                  Activations& acts) {
  acts.rows = rows;
  const int in0 = net.in0();
  acts.x0.resize(Sz(rows) * Sz(in0));
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < net.context; ++c) {
      const std::int32_t id = contexts[Sz(r) * Sz(net.context) + Sz(c)];
      std::copy_n(embed + Sz(id) * Sz(net.embed_dim), net.embed_dim,
                  acts.x0.data() + Sz(r) * Sz(in0) + Sz(c) * Sz(net.embed_dim));
    }
  }
  acts.h.resize(Sz(net.layers));
}

// h_l = activation(input_l * weight + bias).
void HiddenForward(const Net& net, int l, const float* weight, const float* bias,
                   Activations& acts) {
  const int rows = acts.rows;
  std::vector<float>& h = acts.h[Sz(l)];
  h.resize(Sz(rows) * Sz(net.hidden));
  Gemm(false, false, rows, net.hidden, net.in(l), acts.input(l), net.in(l), weight, net.hidden,
       0.0f, h.data(), net.hidden);
  AddBias(h.data(), bias, rows, net.hidden);
  if (net.activation == Activation::kTanh) {
    for (float& v : h) v = std::tanh(v);
  } else {
    for (float& v : h) v = v > 0.0f ? v : 0.0f;
  }
}

// logits = input_layers * out_weight + out_bias.
void OutputForward(const Net& net, const float* out_weight, const float* out_bias,
                   Activations& acts) {
  const int rows = acts.rows;
  acts.logits.resize(Sz(rows) * Sz(net.vocab));
  Gemm(false, false, rows, net.vocab, net.out_in(), acts.input(net.layers), net.out_in(),
       out_weight, net.vocab, 0.0f, acts.logits.data(), net.vocab);
  AddBias(acts.logits.data(), out_bias, rows, net.vocab);
}

void Forward(const Net& net, const float* w, const std::int32_t* contexts, int rows,
             Activations& acts) {
  EmbedForward(net, w + net.embed, contexts, rows, acts);
  for (int l = 0; l < net.layers; ++l) {
    HiddenForward(net, l, w + net.weight[Sz(l)], w + net.bias[Sz(l)], acts);
  }
  OutputForward(net, w + net.out_weight, w + net.out_bias, acts);
}

double CrossEntropy(const Net& net, Activations& acts, const std::int32_t* targets, bool to_grad) {
  double loss_sum = 0.0;
  const float inv_rows = 1.0f / static_cast<float>(acts.rows);
  for (int r = 0; r < acts.rows; ++r) {
    float* row = acts.logits.data() + Sz(r) * Sz(net.vocab);
    const float max = *std::max_element(row, row + net.vocab);
    double sum = 0.0;
    for (int v = 0; v < net.vocab; ++v) sum += std::exp(static_cast<double>(row[v] - max));
    const int target = targets[r];
    loss_sum += std::log(sum) - static_cast<double>(row[target] - max);
    if (to_grad) {
      const double inv_sum = 1.0 / sum;
      for (int v = 0; v < net.vocab; ++v) {
        row[v] =
            static_cast<float>(std::exp(static_cast<double>(row[v] - max)) * inv_sum) * inv_rows;
      }
      row[target] -= inv_rows;
    }
  }
  return loss_sum / acts.rows;
}

// The backward pass's steps, as the forward's. Each adds its gradients into the ones given;
// `d` is d loss / d the input of the layer above, on return d loss / d its own input.

// The output layer's gradients; d starts as d loss / d x_layers.
void OutputBackward(const Net& net, const float* out_weight, const Activations& acts,
                    float* grad_weight, float* grad_bias, std::vector<float>& d) {
  const int rows = acts.rows;
  const float* dlogits = acts.logits.data();
  Gemm(true, false, net.out_in(), net.vocab, rows, acts.input(net.layers), net.out_in(), dlogits,
       net.vocab, 1.0f, grad_weight, net.vocab);
  AddColumnSums(dlogits, rows, net.vocab, grad_bias);
  d.resize(Sz(rows) * Sz(net.out_in()));
  Gemm(false, true, rows, net.out_in(), net.vocab, dlogits, net.vocab, out_weight, net.vocab,
       0.0f, d.data(), net.out_in());
}

// Hidden layer l's gradients; `scratch` is reused between layers.
void HiddenBackward(const Net& net, int l, const float* weight, const Activations& acts,
                    float* grad_weight, float* grad_bias, std::vector<float>& d,
                    std::vector<float>& scratch) {
  const int rows = acts.rows;
  const std::vector<float>& h = acts.h[Sz(l)];
  if (net.activation == Activation::kTanh) {
    for (std::size_t i = 0; i < d.size(); ++i) d[i] *= 1.0f - h[i] * h[i];
  } else {
    for (std::size_t i = 0; i < d.size(); ++i) d[i] = h[i] > 0.0f ? d[i] : 0.0f;
  }
  const int in = net.in(l);
  Gemm(true, false, in, net.hidden, rows, acts.input(l), in, d.data(), net.hidden, 1.0f,
       grad_weight, net.hidden);
  AddColumnSums(d.data(), rows, net.hidden, grad_bias);
  scratch.resize(Sz(rows) * Sz(in));
  Gemm(false, true, rows, in, net.hidden, d.data(), net.hidden, weight, net.hidden, 0.0f,
       scratch.data(), in);
  std::swap(d, scratch);
}

// d is d loss / d x0: scatter-added into the embedding rows, examples in order.
void EmbedBackward(const Net& net, const std::int32_t* contexts, const Activations& acts,
                   const std::vector<float>& d, float* grad_embed) {
  for (int r = 0; r < acts.rows; ++r) {
    for (int c = 0; c < net.context; ++c) {
      const std::int32_t id = contexts[Sz(r) * Sz(net.context) + Sz(c)];
      const float* src = d.data() + Sz(r) * Sz(net.in0()) + Sz(c) * Sz(net.embed_dim);
      float* dst = grad_embed + Sz(id) * Sz(net.embed_dim);
      for (int e = 0; e < net.embed_dim; ++e) dst[e] += src[e];
    }
  }
}

// Accumulates the gradient; acts.logits holds d loss / d logits (CrossEntropy with to_grad).
void Backward(const Net& net, const float* w, const std::int32_t* contexts, Activations& acts,
              float* grad) {
  std::vector<float> d;
  OutputBackward(net, w + net.out_weight, acts, grad + net.out_weight, grad + net.out_bias, d);
  std::vector<float> scratch;
  for (int l = net.layers - 1; l >= 0; --l) {
    HiddenBackward(net, l, w + net.weight[Sz(l)], acts, grad + net.weight[Sz(l)],
                   grad + net.bias[Sz(l)], d, scratch);
  }
  EmbedBackward(net, contexts, acts, d, grad + net.embed);
}

Status CheckRange(std::string_view field, int value, int lo, int hi) {
  if (value < lo || value > hi) {
    return InvalidArgumentError("charlm: " + std::string(field) + " must be in [" +
                                std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                                std::to_string(value));
  }
  return OkStatus();
}

Status Validate(const CharLMOptions& o) {
  ZINF_RETURN_IF_ERROR(CheckRange("vocab_size", o.vocab_size, 2, 65536));
  ZINF_RETURN_IF_ERROR(CheckRange("context", o.context, 1, 4096));
  ZINF_RETURN_IF_ERROR(CheckRange("embed_dim", o.embed_dim, 1, 65536));
  ZINF_RETURN_IF_ERROR(CheckRange("hidden", o.hidden, 1, 1 << 20));
  ZINF_RETURN_IF_ERROR(CheckRange("layers", o.layers, 0, 1024));
  if (static_cast<std::int64_t>(o.context) * o.embed_dim > (1 << 24)) {
    return InvalidArgumentError("charlm: context * embed_dim must be at most 2^24, got " +
                                std::to_string(static_cast<std::int64_t>(o.context) * o.embed_dim));
  }
  if (o.activation != Activation::kTanh && o.activation != Activation::kRelu) {
    return InvalidArgumentError("charlm: unknown activation");
  }
  return OkStatus();
}

constexpr int kMaxRows = 1 << 20;  // examples per ForwardBackward call (keeps sgemm dims in int)
constexpr int kEvalChunk = 256;

}  // namespace

std::string_view ActivationName(Activation activation) {
  return activation == Activation::kRelu ? "relu" : "tanh";
}

Result<Activation> ParseActivation(std::string_view text) {
  if (text == "tanh") return Activation::kTanh;
  if (text == "relu") return Activation::kRelu;
  return InvalidArgumentError("unknown activation '" + std::string(text) +
                              "' (expected tanh or relu)");
}

Result<std::uint64_t> CharLM::NumParams(const CharLMOptions& o) {
  ZINF_RETURN_IF_ERROR(Validate(o));
  const std::uint64_t v = Sz(o.vocab_size), e = Sz(o.embed_dim), h = Sz(o.hidden);
  const std::uint64_t in0 = Sz(o.context) * e;
  if (o.layers == 0) return v * e + in0 * v + v;
  return v * e + (in0 * h + h) + Sz(o.layers - 1) * (h * h + h) + h * v + v;
}

Result<CharLM> CharLM::Create(const CharLMOptions& options) {
  ZINF_RETURN_IF_ERROR(Validate(options));
  const std::int64_t in0 = std::int64_t{options.context} * options.embed_dim;
  std::vector<partition::ParamSpec> specs;
  specs.push_back({"embed", {options.vocab_size, options.embed_dim}});
  for (int l = 0; l < options.layers; ++l) {
    const std::int64_t in = l == 0 ? in0 : options.hidden;
    specs.push_back({"layer" + std::to_string(l) + ".weight", {in, options.hidden}});
    specs.push_back({"layer" + std::to_string(l) + ".bias", {options.hidden}});
  }
  const std::int64_t out_in = options.layers == 0 ? in0 : options.hidden;
  specs.push_back({"out.weight", {out_in, options.vocab_size}});
  specs.push_back({"out.bias", {options.vocab_size}});
  ZINF_ASSIGN_OR_RETURN(partition::ParamLayout layout,
                        Annotate(partition::ParamLayout::Create(std::move(specs)), "charlm: "));
  return CharLM(options, std::move(layout));
}

CharLM::CharLM(const CharLMOptions& options, partition::ParamLayout layout)
    : options_(options), layout_(std::move(layout)) {}

std::string CharLM::Describe() const {
  return "charlm: vocab " + std::to_string(options_.vocab_size) + ", context " +
         std::to_string(options_.context) + " x embed " + std::to_string(options_.embed_dim) +
         ", " + std::to_string(options_.layers) + " x hidden " + std::to_string(options_.hidden) +
         " (" + std::string(ActivationName(options_.activation)) + "), " +
         std::to_string(layout_.total_numel()) + " parameters";
}

Status CharLM::InitSlice(std::uint64_t seed, std::uint64_t flat_offset,
                         std::span<float> out) const {
  ZINF_RETURN_IF_ERROR(CheckSlice(flat_offset, out.size()));
  if (out.empty()) return OkStatus();
  const std::uint64_t seed_key = internal::Mix64(seed ^ 0x636861726c6d0000ULL);  // "charlm"
  const std::uint64_t end = flat_offset + out.size();
  std::size_t index = layout_.ParamAtFlatOffset(flat_offset);
  std::uint64_t k = flat_offset;
  while (k < end) {
    const partition::ParamInfo& p = layout_.param(index);
    float bound = 0.0f;
    if (p.name == "embed") {
      bound = std::sqrt(3.0f);
    } else if (p.shape.size() == 2) {
      const auto fan_in = static_cast<float>(p.shape[0]);
      bound = p.name == "out.weight" ? 1.0f / std::sqrt(fan_in) : std::sqrt(3.0f / fan_in);
    }
    const std::uint64_t stop = std::min(end, p.flat_offset + p.numel);
    float* dst = out.data() + (k - flat_offset);
    if (bound == 0.0f) {
      std::fill(dst, dst + (stop - k), 0.0f);
    } else {
      for (std::uint64_t i = k; i < stop; ++i) {
        *dst++ =
            bound * internal::SymmetricUnit(internal::Mix64(seed_key + i * 0x9e3779b97f4a7c15ULL));
      }
    }
    k = stop;
    ++index;
  }
  return OkStatus();
}

Status CharLM::CheckBatch(std::span<const float> flat_weights, const Batch& batch) const {
  if (flat_weights.size() != layout_.total_numel()) {
    return InvalidArgumentError("charlm: weights have " + std::to_string(flat_weights.size()) +
                                " floats, the model " + std::to_string(layout_.total_numel()));
  }
  return CheckBatch(batch);
}

Status CharLM::CheckBatch(const Batch& batch) const {
  if (batch.context_size != options_.context) {
    return InvalidArgumentError("charlm: batch context size " + std::to_string(batch.context_size) +
                                ", model context " + std::to_string(options_.context));
  }
  const std::size_t n = batch.targets.size();
  if (n == 0 || n != batch.num_examples || n > Sz(kMaxRows) ||
      batch.contexts.size() != n * Sz(options_.context)) {
    return InvalidArgumentError("charlm: malformed batch (" + std::to_string(batch.num_examples) +
                                " examples, " + std::to_string(n) + " targets, " +
                                std::to_string(batch.contexts.size()) + " context ids; need 1.." +
                                std::to_string(kMaxRows) + " examples)");
  }
  const auto bad = [&](std::int32_t id) { return id < 0 || id >= options_.vocab_size; };
  if (std::any_of(batch.contexts.begin(), batch.contexts.end(), bad) ||
      std::any_of(batch.targets.begin(), batch.targets.end(), bad)) {
    return InvalidArgumentError("charlm: batch has an id outside [0, " +
                                std::to_string(options_.vocab_size) + ")");
  }
  return OkStatus();
}

Result<double> CharLM::ForwardBackward(std::span<const float> flat_weights, const Batch& batch,
                                       std::span<float> flat_grad) const {
  ZINF_RETURN_IF_ERROR(CheckBatch(flat_weights, batch));
  if (flat_grad.size() != layout_.total_numel()) {
    return InvalidArgumentError("charlm: gradient has " + std::to_string(flat_grad.size()) +
                                " floats, the model " + std::to_string(layout_.total_numel()));
  }
  const Net net = MakeNet(options_, layout_);
  Activations acts;
  const auto rows = static_cast<int>(batch.targets.size());
  Forward(net, flat_weights.data(), batch.contexts.data(), rows, acts);
  const double loss = CrossEntropy(net, acts, batch.targets.data(), /*to_grad=*/true);
  Backward(net, flat_weights.data(), batch.contexts.data(), acts, flat_grad.data());
  return loss;
}

// The layered pass does what Forward, CrossEntropy and Backward do, a layer at a time on the
// fetched weights; its gradients start from zero per pass (the engine adds the micro-batches).
Result<double> CharLM::ForwardBackwardLayered(const Batch& batch, LayerAccess& access) const {
  const Net net = MakeNet(options_, layout_);
  const auto rows = static_cast<int>(batch.targets.size());
  const std::int32_t* contexts = batch.contexts.data();
  // Layout indices: embed, then layer l's weight and bias, then out.weight and out.bias.
  const std::size_t embed = 0;
  const auto weight = [](int l) { return 1 + 2 * Sz(l); };
  const auto bias = [](int l) { return 2 + 2 * Sz(l); };
  const std::size_t out_weight = 1 + 2 * Sz(net.layers);
  const std::size_t out_bias = out_weight + 1;

  Activations acts;
  {
    const std::size_t ids[] = {embed};
    ZINF_ASSIGN_OR_RETURN(std::vector<std::span<const float>> w, access.Fetch(ids));
    EmbedForward(net, w[0].data(), contexts, rows, acts);
  }
  for (int l = 0; l < net.layers; ++l) {
    const std::size_t ids[] = {weight(l), bias(l)};
    ZINF_ASSIGN_OR_RETURN(std::vector<std::span<const float>> w, access.Fetch(ids));
    HiddenForward(net, l, w[0].data(), w[1].data(), acts);
  }
  // The output layer stays fetched from its forward into its backward.
  const std::size_t out_ids[] = {out_weight, out_bias};
  ZINF_ASSIGN_OR_RETURN(std::vector<std::span<const float>> out, access.Fetch(out_ids));
  OutputForward(net, out[0].data(), out[1].data(), acts);
  const double loss = CrossEntropy(net, acts, batch.targets.data(), /*to_grad=*/true);

  std::vector<float> grad_w(Sz(net.out_in()) * Sz(net.vocab), 0.0f);
  std::vector<float> grad_b(Sz(net.vocab), 0.0f);
  std::vector<float> d;
  OutputBackward(net, out[0].data(), acts, grad_w.data(), grad_b.data(), d);
  ZINF_RETURN_IF_ERROR(access.GradientDone(out_bias, grad_b));
  ZINF_RETURN_IF_ERROR(access.GradientDone(out_weight, grad_w));
  std::vector<float> scratch;
  for (int l = net.layers - 1; l >= 0; --l) {
    const std::size_t ids[] = {weight(l), bias(l)};
    ZINF_ASSIGN_OR_RETURN(std::vector<std::span<const float>> w, access.Fetch(ids));
    grad_w.assign(Sz(net.in(l)) * Sz(net.hidden), 0.0f);
    grad_b.assign(Sz(net.hidden), 0.0f);
    HiddenBackward(net, l, w[0].data(), acts, grad_w.data(), grad_b.data(), d, scratch);
    ZINF_RETURN_IF_ERROR(access.GradientDone(bias(l), grad_b));
    ZINF_RETURN_IF_ERROR(access.GradientDone(weight(l), grad_w));
  }
  // The embedding's gradient needs no weights.
  grad_w.assign(Sz(net.vocab) * Sz(net.embed_dim), 0.0f);
  EmbedBackward(net, contexts, acts, d, grad_w.data());
  ZINF_RETURN_IF_ERROR(access.GradientDone(embed, grad_w));
  return loss;
}

std::uint64_t CharLM::WorkingBytes(std::uint64_t examples) const {
  const Net net = MakeNet(options_, layout_);
  // Per example: its ids and target, the embeddings, every hidden layer, the logits and their
  // gradient, and the two backward buffers (each at most the widest layer).
  const std::uint64_t widest =
      static_cast<std::uint64_t>(std::max({net.in0(), net.hidden, net.vocab}));
  const std::uint64_t floats =
      static_cast<std::uint64_t>(net.context) + 1 + static_cast<std::uint64_t>(net.in0()) +
      static_cast<std::uint64_t>(net.layers) * static_cast<std::uint64_t>(net.hidden) +
      2 * static_cast<std::uint64_t>(net.vocab) + 2 * widest;
  std::uint64_t bytes = 0;
  if (!CheckedMul(examples, floats * sizeof(float), &bytes)) return UINT64_MAX;
  return bytes;
}

Result<double> CharLM::Loss(std::span<const float> flat_weights, const Batch& batch) const {
  ZINF_RETURN_IF_ERROR(CheckBatch(flat_weights, batch));
  const Net net = MakeNet(options_, layout_);
  Activations acts;
  Forward(net, flat_weights.data(), batch.contexts.data(), static_cast<int>(batch.targets.size()),
          acts);
  return CrossEntropy(net, acts, batch.targets.data(), /*to_grad=*/false);
}

Result<double> CharLM::EvalLoss(std::span<const float> flat_weights, const TextDataset& dataset,
                                int num_examples) const {
  ZINF_ASSIGN_OR_RETURN(const Batch all, dataset.EvalBatch(num_examples, options_.context));
  double weighted = 0.0;
  for (std::size_t first = 0; first < all.targets.size(); first += kEvalChunk) {
    const std::size_t n = std::min(Sz(kEvalChunk), all.targets.size() - first);
    Batch chunk;
    chunk.context_size = all.context_size;
    chunk.num_examples = n;
    chunk.targets.assign(all.targets.begin() + static_cast<std::ptrdiff_t>(first),
                         all.targets.begin() + static_cast<std::ptrdiff_t>(first + n));
    const auto ctx_begin =
        all.contexts.begin() + static_cast<std::ptrdiff_t>(first * Sz(all.context_size));
    chunk.contexts.assign(ctx_begin,
                          ctx_begin + static_cast<std::ptrdiff_t>(n * Sz(all.context_size)));
    ZINF_ASSIGN_OR_RETURN(const double loss, Loss(flat_weights, chunk));
    weighted += loss * static_cast<double>(n);
  }
  return weighted / static_cast<double>(all.targets.size());
}

Result<std::string> CharLM::Sample(std::span<const float> flat_weights, std::string_view prompt,
                                   int length, std::uint64_t seed, float temperature) const {
  if (flat_weights.size() != layout_.total_numel()) {
    return InvalidArgumentError("charlm: weights have " + std::to_string(flat_weights.size()) +
                                " floats, the model " + std::to_string(layout_.total_numel()));
  }
  if (length < 0) return InvalidArgumentError("charlm: sample length must be >= 0");
  if (options_.vocab_size < 127) {
    return InvalidArgumentError("charlm: sampling text needs vocab_size >= 127, got " +
                                std::to_string(options_.vocab_size));
  }
  const auto allowed = [](int id) { return id == '\n' || (id >= 32 && id <= 126); };
  const Net net = MakeNet(options_, layout_);
  std::vector<std::int32_t> window(Sz(options_.context), ' ');
  const std::size_t keep = std::min(prompt.size(), window.size());
  for (std::size_t i = 0; i < keep; ++i) {
    window[window.size() - keep + i] =
        static_cast<unsigned char>(prompt[prompt.size() - keep + i]) % options_.vocab_size;
  }
  std::string text;
  text.reserve(Sz(length));
  Activations acts;
  std::vector<double> probs(Sz(options_.vocab_size));
  std::uint64_t stream = internal::Mix64(seed ^ 0x73616d706c650000ULL);  // "sample"
  for (int step = 0; step < length; ++step) {
    Forward(net, flat_weights.data(), window.data(), 1, acts);
    const float* logits = acts.logits.data();
    int next = ' ';
    if (temperature <= 0.0f) {
      float best = -INFINITY;
      for (int v = 0; v < options_.vocab_size; ++v) {
        if (allowed(v) && logits[v] > best) {
          best = logits[v];
          next = v;
        }
      }
    } else {
      float max = -INFINITY;
      for (int v = 0; v < options_.vocab_size; ++v) {
        if (allowed(v)) max = std::max(max, logits[v]);
      }
      double sum = 0.0;
      for (int v = 0; v < options_.vocab_size; ++v) {
        probs[Sz(v)] =
            allowed(v) ? std::exp(static_cast<double>((logits[v] - max) / temperature)) : 0.0;
        sum += probs[Sz(v)];
      }
      stream = internal::Mix64(stream);
      double u = static_cast<double>(stream >> 11) * 0x1.0p-53 * sum;
      for (int v = 0; v < options_.vocab_size; ++v) {
        if (probs[Sz(v)] == 0.0) continue;
        next = v;
        u -= probs[Sz(v)];
        if (u < 0.0) break;
      }
    }
    text.push_back(static_cast<char>(next));
    std::rotate(window.begin(), window.begin() + 1, window.end());
    window.back() = next;
  }
  return text;
}

int SetBlasThreads(int threads) {
#if ZINF_TRAIN_HAVE_CBLAS && defined(OPENBLAS_VERSION)
  openblas_set_num_threads(std::max(threads, 1));
  return openblas_get_num_threads();
#else
  (void)threads;
  return 1;
#endif
}

}  // namespace zinf::train
