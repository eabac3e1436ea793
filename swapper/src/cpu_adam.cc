#include "zinf/swapper/cpu_adam.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cpu_adam_kernels.h"
#include "cpu_adam_thread_pool.h"
#include "q8_kernels.h"
#include "zinf/core/check.h"
#include "zinf/core/env.h"
#include "zinf/core/log.h"
#include "zinf/swapper/q8.h"

namespace zinf::swapper {
namespace {

using internal::AdamArrays;
using internal::AdamScalars;

constexpr int kMaxThreads = 1024;

using StepKernel = void (*)(const AdamScalars&, const AdamArrays&, std::size_t, std::size_t);
using NormKernel = double (*)(const float*, std::size_t);

StepKernel StepKernelFor(SimdPath path) {
  switch (path) {
    case SimdPath::kAvx512:
      return internal::AdamStepAvx512;
    case SimdPath::kAvx2:
      return internal::AdamStepAvx2;
    case SimdPath::kScalar:
    case SimdPath::kAuto:
      break;
  }
  return internal::AdamStepScalar;
}

// The q8 block kernels of `path` (q8_kernels.h, cpu_adam_kernels.h). The vector paths fuse
// decoding into the Adam pass (`step`, which also finds the block scales) and encode with those
// scales; the AVX2 step (`step_encoding`) writes a block's codes during the next block's step
// (Q8BlockOut). The scalar path decodes, steps and quantizes one pass after the other.
struct Q8Kernels {
  float (*quantize)(const q8::internal::Tables&, const float*, std::size_t, std::uint8_t*);
  void (*dequantize)(const q8::internal::Tables&, const std::uint8_t*, float, std::size_t, float*);
  bool (*step)(const AdamScalars&, const AdamArrays&, const internal::Q8BlockIn&, std::size_t,
               float*, float*);
  bool (*step_encoding)(const AdamScalars&, const AdamArrays&, const internal::Q8BlockIn&,
                        std::size_t, float*, float*, const internal::Q8BlockOut* previous);
  void (*encode)(const q8::internal::Tables&, const float*, std::size_t, float, std::uint8_t*);
};

Q8Kernels Q8KernelsFor(SimdPath path) {
  switch (path) {
    case SimdPath::kAvx512:
      // VBMI is not part of the path: a CPU without it gets the decoding by gathers.
      return {q8::internal::QuantizeBlockAvx512, q8::internal::DequantizeBlockAvx512,
              __builtin_cpu_supports("avx512vbmi") ? internal::AdamStepQ8BlockAvx512Vbmi
                                                   : internal::AdamStepQ8BlockAvx512,
              nullptr, q8::internal::EncodeBlockAvx512};
    case SimdPath::kAvx2:
      return {q8::internal::QuantizeBlockAvx2, q8::internal::DequantizeBlockAvx2, nullptr,
              internal::AdamStepQ8BlockAvx2, q8::internal::EncodeBlockAvx2};
    case SimdPath::kScalar:
    case SimdPath::kAuto:
      break;
  }
  return {q8::internal::QuantizeBlockScalar, q8::internal::DequantizeBlockScalar, nullptr, nullptr,
          nullptr};
}

// A block's codes for its scale (the largest |x|, finite).
void Encode(const Q8Kernels& codec, const q8::internal::Tables& t, const float* x, std::size_t n,
            float scale, std::uint8_t* codes) {
  if (scale == 0.0f) {
    std::fill(codes, codes + n, t.zero_code);
  } else {
    codec.encode(t, x, n, scale, codes);
  }
}

NormKernel NormKernelFor(SimdPath path) {
  switch (path) {
    case SimdPath::kAvx512:
      return internal::SquaredNormBlockAvx512;
    case SimdPath::kAvx2:
      return internal::SquaredNormBlockAvx2;
    case SimdPath::kScalar:
    case SimdPath::kAuto:
      break;
  }
  return internal::SquaredNormBlockScalar;
}

// Per-block partial sums added in block order: the result does not depend on who computed them.
double BlockedNorm(std::span<const float> x, NormKernel kernel, internal::AdamThreadPool* pool) {
  const std::size_t n = x.size();
  const std::size_t blocks = (n + CpuAdam::kNormBlockNumel - 1) / CpuAdam::kNormBlockNumel;
  auto block_sum = [&](std::size_t b) {
    const std::size_t begin = b * CpuAdam::kNormBlockNumel;
    return kernel(x.data() + begin, std::min(CpuAdam::kNormBlockNumel, n - begin));
  };
  double sum = 0.0;
  if (pool == nullptr || blocks <= 1) {
    for (std::size_t b = 0; b < blocks; ++b) sum += block_sum(b);
    return sum;
  }
  std::vector<double> partial(blocks);
  pool->Run(blocks, [&](std::size_t b) { partial[b] = block_sum(b); });
  for (double p : partial) sum += p;
  return sum;
}

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::string_view SimdPathName(SimdPath path) {
  switch (path) {
    case SimdPath::kAuto:
      return "auto";
    case SimdPath::kScalar:
      return "scalar";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Result<SimdPath> ParseSimdPath(std::string_view text) {
  for (SimdPath p : {SimdPath::kAuto, SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512}) {
    if (text == SimdPathName(p)) return p;
  }
  return InvalidArgumentError(
      fmt::format("unknown SIMD path '{}' (expected auto, scalar, avx2 or avx512)", text));
}

namespace {

// ZINF_SIMD caps the paths this process may use, as if the CPU lacked the wider ones (to run
// the suite as an AVX2-only machine would). Read once; a bad value is a WARN and no cap.
SimdPath SimdCap() {
  static const SimdPath cap = [] {
    const std::optional<std::string> text = GetEnv("ZINF_SIMD");
    if (!text) return SimdPath::kAvx512;
    Result<SimdPath> parsed = ParseSimdPath(*text);
    if (!parsed) {
      ZINF_LOG_WARN("ZINF_SIMD: {}; ignored", parsed.error().message());
      return SimdPath::kAvx512;
    }
    return *parsed == SimdPath::kAuto ? SimdPath::kAvx512 : *parsed;
  }();
  return cap;
}

bool CpuHas(SimdPath path) {
  switch (path) {
    case SimdPath::kAuto:
    case SimdPath::kScalar:
      return true;
    case SimdPath::kAvx2:
      return __builtin_cpu_supports("avx2");
    case SimdPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  return false;
}

}  // namespace

bool SimdPathSupported(SimdPath path) {
  // The enum is ordered scalar < avx2 < avx512.
  if (path != SimdPath::kAuto && static_cast<int>(path) > static_cast<int>(SimdCap())) {
    return false;
  }
  return CpuHas(path);
}

SimdPath BestSimdPath() {
  if (SimdPathSupported(SimdPath::kAvx512)) return SimdPath::kAvx512;
  if (SimdPathSupported(SimdPath::kAvx2)) return SimdPath::kAvx2;
  return SimdPath::kScalar;
}

Status ValidateAdamHyperParams(const AdamHyperParams& h) {
  // Written as !(ok) so that NaN fails every check.
  if (!(h.lr >= 0.0) || !std::isfinite(h.lr)) {
    return InvalidArgumentError(fmt::format("adam lr must be finite and >= 0, got {}", h.lr));
  }
  for (std::size_t k = 0; k < 2; ++k) {
    if (!(h.betas[k] >= 0.0 && h.betas[k] < 1.0)) {
      return InvalidArgumentError(
          fmt::format("adam beta{} must be in [0, 1), got {}", k + 1, h.betas[k]));
    }
  }
  // eps is added in float: it must stay > 0 there too.
  if (!(h.eps > 0.0) || !std::isfinite(h.eps) || static_cast<float>(h.eps) <= 0.0f) {
    return InvalidArgumentError(
        fmt::format("adam eps must be finite and > 0 (as a float), got {}", h.eps));
  }
  if (!(h.weight_decay >= 0.0) || !std::isfinite(h.weight_decay)) {
    return InvalidArgumentError(
        fmt::format("adam weight_decay must be finite and >= 0, got {}", h.weight_decay));
  }
  return OkStatus();
}

Status ValidateAdamOptions(const AdamOptions& o) {
  ZINF_RETURN_IF_ERROR(ValidateAdamHyperParams(
      {.lr = o.lr, .betas = {o.beta1, o.beta2}, .eps = o.eps, .weight_decay = o.weight_decay}));
  if (o.threads < 0 || o.threads > kMaxThreads) {
    return InvalidArgumentError(fmt::format(
        "adam threads must be in [0, {}] (0 = all cores), got {}", kMaxThreads, o.threads));
  }
  switch (o.simd) {
    case SimdPath::kAuto:
    case SimdPath::kScalar:
    case SimdPath::kAvx2:
    case SimdPath::kAvx512:
      break;
    default:
      return InvalidArgumentError(
          fmt::format("adam simd has no such path ({})", static_cast<int>(o.simd)));
  }
  return OkStatus();
}

Result<bool> ResolveAdamWMode(std::string_view optimizer_type, std::optional<bool> adam_w_mode) {
  const std::string type = Lower(optimizer_type);
  if (type == "adamw") return true;
  if (type == "adam") return adam_w_mode.value_or(true);
  return InvalidArgumentError(
      fmt::format("optimizer type '{}' is not Adam or AdamW", optimizer_type));
}

float ClipCoefficient(double global_norm, double max_norm) {
  const double coef = max_norm / (global_norm + 1e-6);
  return static_cast<float>(std::isnan(coef) ? coef : std::min(coef, 1.0));
}

double SquaredL2Norm(std::span<const float> x) {
  return BlockedNorm(x, NormKernelFor(BestSimdPath()), nullptr);
}

Result<CpuAdam> CpuAdam::Create(const AdamOptions& options) {
  ZINF_RETURN_IF_ERROR(ValidateAdamOptions(options));
  SimdPath path = options.simd;
  if (path == SimdPath::kAuto) path = BestSimdPath();
  if (!SimdPathSupported(path)) {
    return UnimplementedError(
        fmt::format("adam simd path {} is not supported by this CPU", SimdPathName(path)));
  }
  int threads = options.threads;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, kMaxThreads);
  ZINF_ASSIGN_OR_RETURN(auto pool, internal::AdamThreadPool::Create(threads));
  return CpuAdam(options, path, threads, std::move(pool));
}

CpuAdam::CpuAdam(const AdamOptions& options, SimdPath path, int threads,
                 std::unique_ptr<internal::AdamThreadPool> pool)
    : options_(options), path_(path), threads_(threads), pool_(std::move(pool)) {}

CpuAdam::CpuAdam(CpuAdam&&) noexcept = default;
CpuAdam& CpuAdam::operator=(CpuAdam&&) noexcept = default;
CpuAdam::~CpuAdam() = default;

struct CpuAdam::Segment {
  std::size_t begin;
  std::size_t end;
  AdamScalars scalars;
};

Status CpuAdam::Prepare(std::int64_t step, std::size_t n, std::size_t grad_size,
                        const StepExtras& extras, std::vector<Segment>* segments) const {
  if (pool_ == nullptr) return FailedPreconditionError("adam step on a moved-from CpuAdam");
  if (step < 1) {
    return InvalidArgumentError(
        fmt::format("adam step must be >= 1 (counted from 1), got {}", step));
  }
  if (grad_size != n) {
    return InvalidArgumentError(
        fmt::format("adam grad has {} elements, param has {}", grad_size, n));
  }
  if (!extras.bf16_param.empty() && extras.bf16_param.size() != n) {
    return InvalidArgumentError(
        fmt::format("adam bf16_param has {} elements, param has {}", extras.bf16_param.size(), n));
  }
  if (!(extras.grad_scale >= 0.0f) || !std::isfinite(extras.grad_scale)) {
    return InvalidArgumentError(
        fmt::format("adam grad_scale must be finite and >= 0, got {}", extras.grad_scale));
  }
  // The per-step scalars of one set of hyper-parameters, in double as torch's Python code
  // computes them.
  auto scalars_for = [&](const AdamHyperParams& h) {
    const double bc1 = 1.0 - std::pow(h.betas[0], static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(h.betas[1], static_cast<double>(step));
    const bool decay = h.weight_decay != 0.0;
    return AdamScalars{
        .beta1 = static_cast<float>(h.betas[0]),
        .one_minus_beta1 = static_cast<float>(1.0 - h.betas[0]),
        .beta2 = static_cast<float>(h.betas[1]),
        .one_minus_beta2 = static_cast<float>(1.0 - h.betas[1]),
        .step_size = static_cast<float>(h.lr / bc1),
        .bc2_sqrt = static_cast<float>(std::sqrt(bc2)),
        .eps = static_cast<float>(h.eps),
        .grad_scale = extras.grad_scale,
        .l2_decay = static_cast<float>(h.weight_decay),
        .param_decay = static_cast<float>(1.0 - h.lr * h.weight_decay),
        .scale_grad = extras.grad_scale != 1.0f,
        .use_l2 = decay && !options_.adamw,
        .use_param_decay = decay && options_.adamw,
    };
  };
  segments->clear();
  if (extras.segments.empty()) {
    const AdamHyperParams h = {
        .lr = extras.lr.value_or(options_.lr),
        .betas = extras.betas.value_or(std::array<double, 2>{options_.beta1, options_.beta2}),
        .eps = options_.eps,
        .weight_decay = options_.weight_decay};
    ZINF_RETURN_IF_ERROR(Annotate(ValidateAdamHyperParams(h), "step override: "));
    segments->push_back({.begin = 0, .end = n, .scalars = scalars_for(h)});
    return OkStatus();
  }
  if (extras.lr || extras.betas) {
    return InvalidArgumentError("adam: an lr or betas override together with segments");
  }
  for (std::size_t i = 0; i < extras.segments.size(); ++i) {
    const AdamSegment& seg = extras.segments[i];
    const std::size_t end = i + 1 < extras.segments.size() ? extras.segments[i + 1].begin : n;
    if ((i == 0 && seg.begin != 0) || seg.begin >= end || end > n) {
      return InvalidArgumentError(fmt::format(
          "adam segment {} spans [{}, {}) of {} elements; segments start at 0 and their begins "
          "increase strictly below the size",
          i, seg.begin, end, n));
    }
    ZINF_RETURN_IF_ERROR(
        Annotate(ValidateAdamHyperParams(seg.hyper), fmt::format("segment {}: ", i)));
    segments->push_back({.begin = seg.begin, .end = end, .scalars = scalars_for(seg.hyper)});
  }
  return OkStatus();
}

Status CpuAdam::Step(std::int64_t step, std::span<float> param, std::span<const float> grad,
                     std::span<float> exp_avg, std::span<float> exp_avg_sq,
                     const StepExtras& extras) {
  const std::size_t n = param.size();
  auto check_size = [n](std::string_view name, std::size_t size) -> Status {
    if (size == n) return OkStatus();
    return InvalidArgumentError(
        fmt::format("adam {} has {} elements, param has {}", name, size, n));
  };
  std::vector<Segment> segments;
  ZINF_RETURN_IF_ERROR(Prepare(step, n, grad.size(), extras, &segments));
  ZINF_RETURN_IF_ERROR(check_size("exp_avg", exp_avg.size()));
  ZINF_RETURN_IF_ERROR(check_size("exp_avg_sq", exp_avg_sq.size()));
  if (options_.amsgrad) {
    ZINF_RETURN_IF_ERROR(check_size("max_exp_avg_sq (amsgrad)", extras.max_exp_avg_sq.size()));
  } else if (!extras.max_exp_avg_sq.empty()) {
    return InvalidArgumentError("adam max_exp_avg_sq given but amsgrad is off");
  }
  const AdamArrays arrays = {
      .param = param.data(),
      .grad = grad.data(),
      .exp_avg = exp_avg.data(),
      .exp_avg_sq = exp_avg_sq.data(),
      .max_exp_avg_sq = options_.amsgrad ? extras.max_exp_avg_sq.data() : nullptr,
      .bf16 = extras.bf16_param.empty() ? nullptr : extras.bf16_param.data(),
  };
  const StepKernel kernel = StepKernelFor(path_);
  // Chunks of kChunkNumel elements that never cross a segment: each runs with one segment's
  // scalars (one segment, from 0: the chunks of the whole span).
  struct Chunk {
    std::size_t segment, begin, end;
  };
  std::vector<Chunk> chunks;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    for (std::size_t b = segments[i].begin; b < segments[i].end; b += kChunkNumel) {
      chunks.push_back({i, b, std::min(segments[i].end, b + kChunkNumel)});
    }
  }
  pool_->Run(chunks.size(), [&](std::size_t c) {
    kernel(segments[chunks[c].segment].scalars, arrays, chunks[c].begin, chunks[c].end);
  });
  return OkStatus();
}

// One StepQ8 over a sub-group: what every chunk reads, and the first element whose moments are
// not finite. A chunk runs on one thread, block by block (StepChunk); a block is decoded,
// stepped and encoded by the fused kernels of the path, or one pass after the other
// (StepBlockApart). The parts are always inlined: a chunk compiles to one loop, as when it was
// one function (these members are not local to this file, so GCC would call them otherwise).
class CpuAdam::Q8Pass {
 public:
  Q8Pass(SimdPath path, const std::vector<Segment>& segments, std::span<float> param,
         std::span<const float> grad, Q8Moment exp_avg, Q8Moment exp_avg_sq,
         std::span<std::uint16_t> bf16)
      : kernel_(StepKernelFor(path)),
        codec_(Q8KernelsFor(path)),
        fused_(codec_.step != nullptr || codec_.step_encoding != nullptr),
        segments_(segments),
        n_(param.size()),
        param_(param),
        grad_(grad),
        exp_avg_(exp_avg),
        exp_avg_sq_(exp_avg_sq),
        bf16_(bf16) {}

  // The error for a non-finite moment, after every chunk ran.
  Status Finish() const {
    if (bad_.load() == std::numeric_limits<std::size_t>::max()) return OkStatus();
    return FailedPreconditionError(fmt::format(
        "adam q8: the moments of element {} are not finite (exp_avg or exp_avg_sq overflowed); "
        "the state cannot be encoded",
        bad_.load()));
  }

  [[gnu::always_inline]] void StepChunk(std::size_t c) {
    // The decoded moments of two blocks: the one being stepped, and (step_encoding) the one
    // before while its codes are written during that step. 32 KiB, on this thread's stack.
    std::array<float, q8::kBlockNumel> scratch_m[2];
    std::array<float, q8::kBlockNumel> scratch_v[2];
    int current = 0;
    std::optional<internal::Q8BlockOut> pending;
    const std::size_t chunk_end = std::min(n_, (c + 1) * kChunkNumel);
    for (std::size_t begin = c * kChunkNumel; begin < chunk_end; begin += q8::kBlockNumel) {
      std::array<float, q8::kBlockNumel>& m = scratch_m[current];
      std::array<float, q8::kBlockNumel>& v = scratch_v[current];
      const std::size_t len = std::min(q8::kBlockNumel, n_ - begin);
      const std::size_t b = begin / q8::kBlockNumel;
      const AdamArrays arrays = {
          .param = param_.data() + begin,
          .grad = grad_.data() + begin,
          .exp_avg = m.data(),
          .exp_avg_sq = v.data(),
          .max_exp_avg_sq = nullptr,
          .bf16 = bf16_.empty() ? nullptr : bf16_.data() + begin,
      };
      // The segment of the block's first element, and whether the block ends inside it.
      const auto home = std::ranges::upper_bound(segments_, begin, {}, &Segment::begin) - 1;
      const bool whole = home->end >= begin + len;
      if (!fused_ || !whole) {
        EncodePending(&pending);
        StepBlockApart(home, arrays, begin, len);
      } else if (StepBlockFused(home->scalars, arrays, begin, len, &pending)) {
        current ^= 1;
      }
      if (exp_avg_.scales[b] < 0 || exp_avg_sq_.scales[b] < 0) {
        RecordNonFinite(begin, len, m.data(), v.data());
      }
    }
    EncodePending(&pending);
  }

 private:
  using SegmentIt = std::vector<Segment>::const_iterator;

  [[gnu::always_inline]] void EncodePending(std::optional<internal::Q8BlockOut>* pending) const {
    if (!*pending) return;
    const internal::Q8BlockOut& p = **pending;
    codec_.encode(signed_map_, p.m, p.n, p.m_scale, p.m_codes);
    codec_.encode(unsigned_map_, p.v, p.n, p.v_scale, p.v_codes);
    pending->reset();
  }

  // Decoded, stepped (segment by segment where groups meet in the block), encoded.
  [[gnu::always_inline]] void StepBlockApart(SegmentIt home, const AdamArrays& arrays,
                                             std::size_t begin, std::size_t len) {
    const std::size_t b = begin / q8::kBlockNumel;
    std::uint8_t* m_codes = exp_avg_.codes.data() + begin;
    std::uint8_t* v_codes = exp_avg_sq_.codes.data() + begin;
    codec_.dequantize(signed_map_, m_codes, exp_avg_.scales[b], len, arrays.exp_avg);
    codec_.dequantize(unsigned_map_, v_codes, exp_avg_sq_.scales[b], len, arrays.exp_avg_sq);
    for (auto seg = home; seg != segments_.end() && seg->begin < begin + len; ++seg) {
      kernel_(seg->scalars, arrays, std::max(seg->begin, begin) - begin,
              std::min(seg->end, begin + len) - begin);
    }
    exp_avg_.scales[b] = codec_.quantize(signed_map_, arrays.exp_avg, len, m_codes);
    exp_avg_sq_.scales[b] = codec_.quantize(unsigned_map_, arrays.exp_avg_sq, len, v_codes);
  }

  // The fused kernel on a block inside one segment. True when the block's codes are left in
  // *pending, to be written during the next block's step (its scratch must then be kept).
  [[gnu::always_inline]] bool StepBlockFused(const AdamScalars& scalars, const AdamArrays& arrays,
                                             std::size_t begin, std::size_t len,
                                             std::optional<internal::Q8BlockOut>* pending) {
    const std::size_t b = begin / q8::kBlockNumel;
    std::uint8_t* m_codes = exp_avg_.codes.data() + begin;
    std::uint8_t* v_codes = exp_avg_sq_.codes.data() + begin;
    const internal::Q8BlockIn in = {
        .m_codes = m_codes,
        .v_codes = v_codes,
        .m_map = signed_map_.values.data(),
        .v_map = unsigned_map_.values.data(),
        .m_planes = signed_map_.planes.data(),
        .v_planes = unsigned_map_.planes.data(),
        .m_scale = exp_avg_.scales[b],
        .v_scale = exp_avg_sq_.scales[b],
    };
    float m_scale = 0.0f, v_scale = 0.0f;
    const bool finite = codec_.step_encoding != nullptr
                            ? codec_.step_encoding(scalars, arrays, in, len, &m_scale, &v_scale,
                                                   *pending ? &**pending : nullptr)
                            : codec_.step(scalars, arrays, in, len, &m_scale, &v_scale);
    pending->reset();
    if (!finite) {
      exp_avg_.scales[b] = -1.0f;
      exp_avg_sq_.scales[b] = -1.0f;
      return false;
    }
    exp_avg_.scales[b] = m_scale;
    exp_avg_sq_.scales[b] = v_scale;
    // The fused step encodes only blocks whose scales allow 1 / scale (q8_kernels.h); the
    // others, a zero block among them, are encoded at once.
    if (codec_.step_encoding != nullptr && q8::internal::InReciprocalRange(m_scale) &&
        q8::internal::InReciprocalRange(v_scale)) {
      *pending = internal::Q8BlockOut{.m_tables = &signed_map_,
                                      .v_tables = &unsigned_map_,
                                      .m = arrays.exp_avg,
                                      .v = arrays.exp_avg_sq,
                                      .n = len,
                                      .m_scale = m_scale,
                                      .v_scale = v_scale,
                                      .m_codes = m_codes,
                                      .v_codes = v_codes};
      return true;
    }
    Encode(codec_, signed_map_, arrays.exp_avg, len, m_scale, m_codes);
    Encode(codec_, unsigned_map_, arrays.exp_avg_sq, len, v_scale, v_codes);
    return false;
  }

  // Keeps the first element of the block [begin, begin + len) whose moments m, v are not
  // finite, if it precedes the one found so far.
  [[gnu::always_inline]] void RecordNonFinite(std::size_t begin, std::size_t len, const float* m,
                                              const float* v) {
    std::size_t first = begin;
    while (first < begin + len && std::isfinite(m[first - begin]) &&
           std::isfinite(v[first - begin])) {
      ++first;
    }
    std::size_t seen = bad_.load();
    while (first < seen && !bad_.compare_exchange_weak(seen, first)) {
    }
  }

  const StepKernel kernel_;
  const Q8Kernels codec_;
  const bool fused_;
  const q8::internal::Tables& signed_map_ = q8::internal::TablesFor(q8::MapKind::kSigned);
  const q8::internal::Tables& unsigned_map_ = q8::internal::TablesFor(q8::MapKind::kUnsigned);
  const std::vector<Segment>& segments_;
  const std::size_t n_;
  const std::span<float> param_;
  const std::span<const float> grad_;
  const Q8Moment exp_avg_;
  const Q8Moment exp_avg_sq_;
  const std::span<std::uint16_t> bf16_;
  std::atomic<std::size_t> bad_{std::numeric_limits<std::size_t>::max()};
};

Status CpuAdam::StepQ8(std::int64_t step, std::span<float> param, std::span<const float> grad,
                       Q8Moment exp_avg, Q8Moment exp_avg_sq, const StepExtras& extras) {
  const std::size_t n = param.size();
  std::vector<Segment> segments;
  ZINF_RETURN_IF_ERROR(Prepare(step, n, grad.size(), extras, &segments));
  if (options_.amsgrad || !extras.max_exp_avg_sq.empty()) {
    return InvalidArgumentError("adam: amsgrad is not supported with the q8 state format");
  }
  for (const auto& [name, m] : {std::pair{"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}}) {
    if (m.codes.size() != n || m.scales.size() != q8::NumBlocks(n)) {
      return InvalidArgumentError(
          fmt::format("adam q8 {} has {} codes and {} scales; param has {} elements ({} blocks)",
                      name, m.codes.size(), m.scales.size(), n, q8::NumBlocks(n)));
    }
  }
  static_assert(kChunkNumel % q8::kBlockNumel == 0, "chunks hold whole blocks");
  Q8Pass pass(path_, segments, param, grad, exp_avg, exp_avg_sq, extras.bf16_param);
  pool_->Run((n + kChunkNumel - 1) / kChunkNumel, [&pass](std::size_t c) { pass.StepChunk(c); });
  return pass.Finish();
}

double CpuAdam::SquaredL2Norm(std::span<const float> x) {
  ZINF_CHECK(pool_ != nullptr, "SquaredL2Norm on a moved-from CpuAdam");
  return BlockedNorm(x, NormKernelFor(path_), pool_.get());
}

}  // namespace zinf::swapper
