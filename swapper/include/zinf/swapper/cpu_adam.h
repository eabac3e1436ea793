// Fused CPU Adam / AdamW over float32 spans: the optimizer step of one swapped-in sub-group.
//
//   ZINF_ASSIGN_OR_RETURN(auto adam, zinf::swapper::CpuAdam::Create({.lr = 1e-4, .threads = 2}));
//   ZINF_RETURN_IF_ERROR(adam.Step(step, fp32, grad, exp_avg, exp_avg_sq,
//                                  {.grad_scale = clip, .bf16_param = working_copy}));
//
// Numerics: the math of torch.optim.Adam / torch.optim.AdamW (single-tensor implementation),
// element by element, in float32, in this order (s = step >= 1):
//   bc1 = 1 - beta1^s, bc2 = 1 - beta2^s, step_size = lr / bc1, bc2_sqrt = sqrt(bc2)
//       (these per-step scalars in double, as Python computes them, then rounded to float)
//   g = grad * grad_scale                      (only when grad_scale != 1)
//   g = g + weight_decay * p                   (Adam, weight_decay != 0: L2 penalty)
//   p = p * (1 - lr * weight_decay)            (AdamW, weight_decay != 0: decoupled decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + ((1 - beta2) * g) * g
//   v_hat = amsgrad ? (max_v = max(max_v, v)) : v      (max propagates NaN like torch.maximum)
//   denom = sqrt(v_hat) / bc2_sqrt + eps
//   p = p - (step_size * m) / denom
//   bf16_out = RoundToNearestEven(p)           (when an output span is given)
// Every dispatch path (scalar, AVX2, AVX-512) performs exactly these IEEE operations, with no
// fused multiply-add anywhere (the kernels are compiled with -ffp-contract=off and use separate
// mul/add instructions), correctly rounded sqrt and division, and the same bf16 rounding in
// integer arithmetic: the results are bit-identical across paths and thread counts.
// (vcvtneps2bf16 is not used: it flushes denormal inputs to zero, the reference does not.)
//
// Threads: a CpuAdam owns a persistent pool of `threads - 1` std::threads, created once in
// Create(); the calling thread takes part in every step. Work is split into chunks of
// kChunkNumel elements claimed dynamically. Spans smaller than two chunks run on the caller alone.
//
// Thread safety: a CpuAdam may be used from several threads; its Step() and SquaredL2Norm()
// calls are serialized by an internal mutex. Distinct objects are independent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::swapper {

// Which kernel runs the step. kAuto picks the widest the CPU supports.
enum class SimdPath { kAuto, kScalar, kAvx2, kAvx512 };

// "auto", "scalar", "avx2", "avx512".
std::string_view SimdPathName(SimdPath path);
// Parses the names above. Errors: InvalidArgument naming the text.
Result<SimdPath> ParseSimdPath(std::string_view text);
// True when this CPU (and build) can run `path`, and ZINF_SIMD (scalar|avx2|avx512) does not cap
// the paths below it (to run as a machine without the wider instructions would); kAuto and
// kScalar always can.
// kAvx2 needs avx2 (no FMA is used); kAvx512 needs avx512f, avx512bw, avx512vl and avx512dq.
bool SimdPathSupported(SimdPath path);
// The path kAuto resolves to on this CPU.
SimdPath BestSimdPath();

// Hyper-parameters are doubles, like the Python floats torch receives; the per-element math is
// float32 (see the top of this file).
struct AdamOptions {
  double lr = 1e-3;           // learning rate, >= 0; StepExtras::lr overrides it per step
  double beta1 = 0.9;         // first-moment decay, in [0, 1)
  double beta2 = 0.999;       // second-moment decay, in [0, 1)
  double eps = 1e-8;          // added to the denominator, > 0
  double weight_decay = 0.0;  // >= 0; L2 penalty (Adam) or decoupled decay (AdamW)
  bool adamw = true;          // true: AdamW (decoupled decay); false: Adam (L2 on the gradient)
  bool amsgrad = false;       // keep max_exp_avg_sq and use it in the denominator (torch)
  int threads = 0;            // threads per step including the caller; 0 = hardware concurrency
  SimdPath simd = SimdPath::kAuto;  // force a kernel (tests, benchmarks); kAuto = best available
};

// Checks the hyper-parameters. Errors: InvalidArgument naming the field and value.
Status ValidateAdamOptions(const AdamOptions& options);

// The hyper-parameters that may differ from one parameter group to another (torch's
// param_groups) and from step to step (schedules), with AdamOptions' ranges.
struct AdamHyperParams {
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool operator==(const AdamHyperParams&) const = default;
};

// Checks them as ValidateAdamOptions does. Errors: InvalidArgument naming the field and value.
Status ValidateAdamHyperParams(const AdamHyperParams& hyper);

// Elements [begin, the next segment's begin or the end) of a step's spans take `hyper`.
struct AdamSegment {
  std::size_t begin = 0;
  AdamHyperParams hyper;
};

// DeepSpeed's mapping of optimizer `type` and `adam_w_mode` to the AdamOptions::adamw flag:
// "AdamW" -> true (whatever adam_w_mode says); "Adam" -> adam_w_mode, which defaults to true in
// DeepSpeed (so a DeepSpeed "Adam" is AdamW math unless adam_w_mode is false). Case-insensitive.
// Errors: InvalidArgument for any other type.
Result<bool> ResolveAdamWMode(std::string_view optimizer_type, std::optional<bool> adam_w_mode);

// Per-call inputs besides the four state spans.
struct StepExtras {
  float grad_scale = 1.0f;                   // multiplies the gradient first; finite, >= 0
  std::span<float> max_exp_avg_sq = {};      // amsgrad state: required (same size) iff amsgrad
  std::span<std::uint16_t> bf16_param = {};  // if non-empty (same size): bf16 bits of new param
  std::optional<double> lr = std::nullopt;   // overrides AdamOptions::lr for this step (schedules)
  // Override AdamOptions::beta1 and beta2 for this step (OneCycle's momentum), each in [0, 1);
  // the bias corrections use them too (1 - beta^step, as torch with a changed group beta).
  std::optional<std::array<double, 2>> betas = std::nullopt;
  // Parameter groups: when non-empty, each segment's hyper-parameters replace AdamOptions' lr,
  // betas, eps and weight_decay (and the overrides above, which must then be unset) for its
  // elements, in the same pass over memory. Begins strictly increasing, the first 0, each
  // below the spans' size.
  std::span<const AdamSegment> segments = {};
};

// torch.nn.utils.clip_grad_norm_: max_norm / (global_norm + 1e-6), clamped to at most 1. Pass
// the result as StepExtras::grad_scale. A NaN norm gives NaN (the caller decides what to do).
float ClipCoefficient(double global_norm, double max_norm);

// Sum of x[i]^2 in double, on the best SIMD path, one thread. The sum order is fixed (16
// interleaved double lanes per block of kNormBlockNumel, blocks added in order), so the result
// is bit-identical across paths and thread counts. Each rank sums its partition, then allreduces.
double SquaredL2Norm(std::span<const float> x);

// float -> bf16 bits, round to nearest even; NaN stays NaN (quiet bit set, sign kept); infinities
// and denormals are converted exactly like any other value.
constexpr std::uint16_t FloatBitsToBf16(std::uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// One 8-bit quantized Adam moment (q8.h): a code per element and an fp32 scale per block of
// q8::kBlockNumel elements.
struct Q8Moment {
  std::span<std::uint8_t> codes;
  std::span<float> scales;
};

namespace internal {
class AdamThreadPool;
struct AdamScalars;
}  // namespace internal

class CpuAdam {
 public:
  // Elements per work chunk (256 KiB per float array) and per norm block.
  static constexpr std::size_t kChunkNumel = std::size_t{1} << 16;
  static constexpr std::size_t kNormBlockNumel = std::size_t{1} << 16;

  // Validates `options`, resolves the SIMD path and starts the thread pool.
  // Errors: InvalidArgument (bad options, naming the field), Unimplemented (the forced SIMD path
  // is not supported by this CPU), ResourceExhausted (threads could not be started).
  static Result<CpuAdam> Create(const AdamOptions& options);

  CpuAdam(CpuAdam&&) noexcept;
  CpuAdam& operator=(CpuAdam&&) noexcept;
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;
  ~CpuAdam();

  // One optimizer step (numbered from 1) over the sub-group: updates param, exp_avg, exp_avg_sq
  // (and extras.max_exp_avg_sq, extras.bf16_param) in place. Spans must have equal sizes and
  // must not overlap each other. On error nothing has been modified.
  // Errors: InvalidArgument for step < 1, size mismatches, a missing or unexpected amsgrad
  // span, a bad grad_scale, lr or betas override or segment (each naming what is wrong).
  Status Step(std::int64_t step, std::span<float> param, std::span<const float> grad,
              std::span<float> exp_avg, std::span<float> exp_avg_sq, const StepExtras& extras = {});

  // Step() over the q8 state format: block by block, exp_avg (signed map) and exp_avg_sq
  // (unsigned map) are decoded into fp32, stepped with Step()'s operations in Step()'s order
  // (the vector paths decode inside that pass and find the block scales in it), and encoded
  // again (q8.h): the same bits on every path and thread count. The new moments exist
  // one block at a time on each thread's stack (2 x 8 KiB; AVX2: two blocks, its step writes a
  // block's codes during the next block's): no scratch grows with the sub-group, so a q8 step
  // needs no memory beyond its spans. With extras.segments a block
  // that holds elements of two segments is decoded, stepped segment by segment and encoded
  // again: the block scales are those of the whole block, wherever the groups meet. `codes` have
  // the param's size, `scales` q8::NumBlocks of it. Errors: those of Step(); InvalidArgument with
  // amsgrad (no quantized max_exp_avg_sq); FailedPrecondition when a moment becomes non-finite,
  // naming the element (param and the moments are then partly updated: the caller must not keep
  // them).
  Status StepQ8(std::int64_t step, std::span<float> param, std::span<const float> grad,
                Q8Moment exp_avg, Q8Moment exp_avg_sq, const StepExtras& extras = {});

  // SquaredL2Norm() above on this optimizer's path and threads (same bits as the free function).
  double SquaredL2Norm(std::span<const float> x);

  const AdamOptions& options() const { return options_; }
  SimdPath simd_path() const { return path_; }  // resolved, never kAuto
  int threads() const { return threads_; }      // resolved, >= 1

 private:
  CpuAdam(const AdamOptions& options, SimdPath path, int threads,
          std::unique_ptr<internal::AdamThreadPool> pool);
  struct Segment;  // [begin, end) and its scalars
  class Q8Pass;    // one StepQ8 over the blocks (cpu_adam.cc)
  // The checks common to Step and StepQ8 (param size n, the grad's size, extras) and the
  // step's scalars for each segment (one covering [0, n) without extras.segments).
  Status Prepare(std::int64_t step, std::size_t n, std::size_t grad_size, const StepExtras& extras,
                 std::vector<Segment>* segments) const;

  AdamOptions options_;
  SimdPath path_;
  int threads_;
  std::unique_ptr<internal::AdamThreadPool> pool_;
};

}  // namespace zinf::swapper
