// Private: the per-path kernels behind CpuAdam. Every kernel performs the operations listed at
// the top of cpu_adam.h in that order, without FMA, so that all paths give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf::swapper::q8::internal {
struct Tables;
}  // namespace zinf::swapper::q8::internal

namespace zinf::swapper::internal {

// Per-step float scalars, computed once per Step() (in double, then rounded, as torch does).
struct AdamScalars {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;  // lr / bc1
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float eps;
  float grad_scale;
  float l2_decay;        // Adam: weight_decay
  float param_decay;     // AdamW: 1 - lr * weight_decay
  bool scale_grad;       // grad_scale != 1
  bool use_l2;           // Adam and weight_decay != 0
  bool use_param_decay;  // AdamW and weight_decay != 0
};

// Base pointers of the whole spans; kernels work on [begin, end). max_exp_avg_sq and bf16 are
// null when absent.
struct AdamArrays {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  std::uint16_t* bf16;
};

void AdamStepScalar(const AdamScalars& s, const AdamArrays& a, std::size_t begin, std::size_t end);
void AdamStepAvx2(const AdamScalars& s, const AdamArrays& a, std::size_t begin, std::size_t end);
void AdamStepAvx512(const AdamScalars& s, const AdamArrays& a, std::size_t begin, std::size_t end);

// The q8 step of one block of n <= q8::kBlockNumel elements (CpuAdam::StepQ8), decode and Adam
// fused: the old moments are decoded from their codes (map[code] * scale, q8.h), stepped exactly
// as the kernels above step them, and written to a.exp_avg / a.exp_avg_sq (the block's scratch,
// indexed from 0 like a.param, a.grad and a.bf16, which point at the block). *m_max and *v_max
// get the largest |new moment| (the block scales); false when a new moment is not finite.
struct Q8BlockIn {
  const std::uint8_t* m_codes;
  const std::uint8_t* v_codes;
  const float* m_map;  // q8::MapValues(kSigned)
  const float* v_map;  // q8::MapValues(kUnsigned)
  // The maps' values as byte planes (q8::internal::Tables::planes), for the VBMI kernel.
  const std::uint8_t* m_planes;
  const std::uint8_t* v_planes;
  float m_scale;
  float v_scale;
};
// A stepped block whose codes are still to be written: its new moments m[0, n), v[0, n) (the
// scratch of the block before) and their scales, each in [kMinReciprocalScale,
// kMaxReciprocalScale] (q8_kernels.h). The AVX2 step writes these codes, as EncodeBlockAvx2
// would, while it steps the next block: the encoder's table loads then run beside the step's
// divisions and memory streams instead of in a pass of their own, during which memory stands idle
// (5% faster, measured). The AVX-512 steps do not: interleaved with their encoder, whose tables
// take 16 registers, the loop spilled and ran 15% slower, and the second block of scratch cost
// them too, so they encode each block at once.
struct Q8BlockOut {
  const q8::internal::Tables* m_tables;  // kSigned
  const q8::internal::Tables* v_tables;  // kUnsigned
  const float* m;
  const float* v;
  std::size_t n;
  float m_scale;
  float v_scale;
  std::uint8_t* m_codes;
  std::uint8_t* v_codes;
};

// `previous` is null where there is no block to encode.
bool AdamStepQ8BlockAvx2(const AdamScalars& s, const AdamArrays& a, const Q8BlockIn& in,
                         std::size_t n, float* m_max, float* v_max, const Q8BlockOut* previous);
bool AdamStepQ8BlockAvx512(const AdamScalars& s, const AdamArrays& a, const Q8BlockIn& in,
                           std::size_t n, float* m_max, float* v_max);
// The same with table lookups instead of gathers; needs AVX512-VBMI besides the AVX-512 path.
bool AdamStepQ8BlockAvx512Vbmi(const AdamScalars& s, const AdamArrays& a, const Q8BlockIn& in,
                               std::size_t n, float* m_max, float* v_max);

// Lanes of the fixed-order norm: element i of a block goes to lane i % kNormLanes; the lanes
// are added 0..15 in order at the end of the block.
inline constexpr std::size_t kNormLanes = 16;

// Squared L2 norm of x[0, n) with the lane order above; n <= CpuAdam::kNormBlockNumel.
double SquaredNormBlockScalar(const float* x, std::size_t n);
double SquaredNormBlockAvx2(const float* x, std::size_t n);
double SquaredNormBlockAvx512(const float* x, std::size_t n);

// Shared by the scalar kernel and the AVX2 tail: lanes[] += x[i]^2 for i in [begin, n).
inline void AccumulateNormLanes(const float* x, std::size_t begin, std::size_t n, double* lanes) {
  for (std::size_t i = begin; i < n; ++i) {
    const double d = x[i];
    lanes[i % kNormLanes] += d * d;
  }
}

inline double SumNormLanes(const double* lanes) {
  double sum = lanes[0];
  for (std::size_t j = 1; j < kNormLanes; ++j) sum += lanes[j];
  return sum;
}

}  // namespace zinf::swapper::internal
