// The working weights: the precision they hold (fp32, or values rounded to bf16 / fp16) and
// moving them between the parameters held whole and the partition (PackWeights, UnpackWeights).
#include "engine_impl.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

namespace zinf::engine {

Working WorkingOf(const config::Config& config) {
  if (config.bf16) return Working::kBf16;
  return config.fp16.enabled ? Working::kFp16 : Working::kFp32;
}

namespace {

// fp16 round-to-nearest-even, kept in fp32 (beyond the fp16 range: infinity).
float RoundToFp16(float x) { return static_cast<float>(static_cast<_Float16>(x)); }

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

}  // namespace

std::span<float> ZeroEngine::Impl::State::WholeWeights(std::size_t p) {
  return holding[p] == Holding::kLoop ? params[p].weights : std::span<float>(whole[p]);
}

void ZeroEngine::Impl::State::PackWeights(int rank, std::uint64_t partition_offset,
                                          std::span<float> out) {
  std::fill(out.begin(), out.end(), 0.0f);
  for (const partition::Fragment& f :
       plan->FragmentsInPartitionRange(rank, partition_offset, out.size())) {
    if (holding[f.param_index] == Holding::kPartitioned) continue;
    std::copy_n(WholeWeights(f.param_index).data() + f.param_offset, f.numel,
                out.data() + (f.partition_offset - partition_offset));
  }
}

void ZeroEngine::Impl::State::UnpackWeights(int rank, std::uint64_t partition_offset,
                                            std::span<const float> in, Working working,
                                            int my_rank) {
  for (const partition::Fragment& f :
       plan->FragmentsInPartitionRange(rank, partition_offset, in.size())) {
    const float* src = in.data() + (f.partition_offset - partition_offset);
    if (holding[f.param_index] == Holding::kPartitioned) {
      if (rank == my_rank && f.partition_offset + f.numel <= shard.size()) {
        std::copy_n(src, f.numel, shard.data() + f.partition_offset);
      }
      continue;
    }
    Round(std::span<const float>(src, f.numel),
          WholeWeights(f.param_index).subspan(f.param_offset, f.numel), working);
  }
}

void ZeroEngine::Impl::State::Round(std::span<const float> in, std::span<float> out,
                                    Working working) {
  switch (working) {
    case Working::kBf16:
      for (std::size_t k = 0; k < in.size(); ++k) out[k] = RoundToBf16(in[k]);
      break;
    case Working::kFp16:
      for (std::size_t k = 0; k < in.size(); ++k) out[k] = RoundToFp16(in[k]);
      break;
    case Working::kFp32:
      std::copy_n(in.data(), in.size(), out.data());
      break;
  }
}

}  // namespace zinf::engine
