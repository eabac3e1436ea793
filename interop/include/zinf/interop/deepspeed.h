// DeepSpeed ZeRO checkpoints (stage 1, 2 and 3, as DeepSpeed v0.19 saves them), read without
// Python and without running code (torch_file.h): the files of one checkpoint tag found and
// checked against each other, and each parameter's fp32 weights and Adam moments assembled from
// the ranks' partitions on demand. The read side of `zinf-ckpt import-deepspeed` (issue 46).
//
// What is read, in a tag directory (global_stepN):
//   [bf16_|fp16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt, r = 0..W-1 (one prefix)
//   mp_rank_00_model_states.pt                        (stage 1/2)
//   zero_pp_rank_{r}_mp_rank_00_model_states.pt, r = 0..W-1  (stage 3)
// Refused, with an error naming the file: model parallelism (mp_rank other than 00), pipeline
// (layer_*) and MoE expert files, links, missing or extra ranks, frozen parameters, optimizer
// state other than Adam's (exp_avg, exp_avg_sq, step), torch's legacy file format.
//
// Layout (docs: issue 46's spec, section 2). Stage 1/2: per param group, the params of
// param_shapes[g] concatenated (n elements), padded to a multiple of 2W, rank r holding flat
// [r*P, (r+1)*P), P = 2*ceil(n/2W); saved fp32 without the padding (BF16_Optimizer files: with
// it), rigid moments with it (length P), elastic moments without. Stage 3: per sub-group, rank
// r's flat is the concatenation over the sub-group's params of elements [r*pn, (r+1)*pn) of each
// param (pn = ceil(numel/W), zero-padded past numel).
#ifndef ZINF_INTEROP_DEEPSPEED_H_
#define ZINF_INTEROP_DEEPSPEED_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/core/status.h"
#include "zinf/interop/pickle.h"

namespace zinf::interop {

struct DeepSpeedLimits {
  PickleLimits pickle;                      // of each file's data.pkl
  std::uint64_t max_world_size = 4096;      // ranks (one open descriptor per file, held)
  std::uint64_t max_dir_entries = 1 << 20;  // names in the tag directory
  std::uint64_t max_latest_bytes = 4096;    // of the save directory's `latest`
  std::uint64_t max_params = 1 << 24;       // parameters in param_shapes
  // Open reads every storage the parameters' values come from once, to check its CRC-32
  // (ReadParam reads ranges, which cannot be checked on their own). Off: Open reads the pickles
  // and the 0-dim step tensors only, and ReadParam's values are not CRC-checked.
  bool verify_crc = true;
};

// One trainable parameter, in the order of DeepSpeedCheckpoint::params().
struct DeepSpeedParam {
  std::string name;
  std::vector<std::int64_t> shape;  // from param_shapes
  // The dtype of the model file's module[name] ("float16", ...), one for all params (a param
  // module does not hold gets the others'; "" when it holds none).
  std::string dtype;
  std::uint64_t numel = 0;
  std::size_t group = 0;  // index into DeepSpeedCheckpoint::optimizer_groups()
};

// One optimizer param group: base_optimizer_state's param_groups[i] (stage 3: the inner
// optimizer_state_dict's). Elastic stage 1/2 checkpoints do not save them: then `saved` is false
// and the numbers are 0 (DeepSpeed takes them from its config).
struct DeepSpeedOptimizerGroup {
  bool saved = true;
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
  nlohmann::json options;  // every other key but 'params' ("amsgrad", "bias_correction", ...)
};

// The fp16 loss scaler object of the optimizer files (the same in every rank's file).
struct DeepSpeedLossScaler {
  enum class Kind { kNone, kStatic, kDynamic };
  Kind kind = Kind::kNone;  // kNone: no loss_scaler key (bf16 / BF16_Optimizer) or None
  double scale = 1.0;       // cur_scale
  // DynamicLossScaler only:
  std::int64_t iteration = 0;                // cur_iter
  std::int64_t last_overflow_iteration = 0;  // last_overflow_iter
  std::int64_t hysteresis = 0;               // cur_hysteresis
  nlohmann::json state;                      // the object's whole __dict__ (a dtype as its name)
};

class DeepSpeedCheckpoint {
 public:
  enum class Field { kFp32, kExpAvg, kExpAvgSq };

  DeepSpeedCheckpoint(DeepSpeedCheckpoint&&) noexcept;
  DeepSpeedCheckpoint& operator=(DeepSpeedCheckpoint&&) noexcept;
  ~DeepSpeedCheckpoint();

  int stage() const;                 // 1, 2 or 3
  bool bf16_optimizer() const;       // BF16_Optimizer files (no zero_stage key; read as stage 1)
  bool elastic() const;              // stage 1/2 elastic (moments saved without padding)
  std::uint64_t world_size() const;  // W: the data-parallel ranks, = the number of files
  const std::string& tag_dir() const;
  std::int64_t global_steps() const;   // G: every step, skipped ones included
  std::int64_t skipped_steps() const;  // K: fp16 overflow steps; Adam's step is G - K
  // lr_scheduler's last_batch_iteration (= G - K - 1, checked), when the model file has one.
  std::optional<std::int64_t> scheduler_last_batch_iteration() const;
  const DeepSpeedLossScaler& loss_scaler() const;
  // The user's config (the optimizer files' ds_config, else the model file's); null if none.
  const nlohmann::json& ds_config() const;
  const std::vector<DeepSpeedOptimizerGroup>& optimizer_groups() const;
  // Parameters in the order of the model file's module (its state_dict order), or in
  // param_shapes order when module does not hold all of them.
  const std::vector<DeepSpeedParam>& params() const;
  // shared_params: (alias, owner) for tied weights. Aliases are not in params().
  const std::vector<std::pair<std::string, std::string>>& shared_params() const;

  // Parameter `param`'s values of `field` (row-major, numel of them) into `out` (exactly numel
  // floats), read as ranges of the ranks' tensors: memory `out` plus bounded buffers.
  // Thread-safe (reads with pread). Errors: InvalidArgument (param out of range, `out` of
  // another size), DataLoss naming the param and field for a NaN or infinity in any field or a
  // negative exp_avg_sq, read errors (naming the file).
  Status ReadParam(std::size_t param, Field field, std::span<float> out) const;

 private:
  friend Result<DeepSpeedCheckpoint> OpenDeepSpeedCheckpoint(const std::string& dir,
                                                             const DeepSpeedLimits& limits);
  struct Impl;
  explicit DeepSpeedCheckpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "fp32", "exp_avg", "exp_avg_sq".
const char* DeepSpeedFieldName(DeepSpeedCheckpoint::Field field);

// Opens the checkpoint in `dir`: a save directory holding `latest` (a regular file of at most
// limits.max_latest_bytes naming one path component, the tag directory beside it, not a link)
// or a tag directory itself. Reads and checks every file's pickle (see the top of this file);
// the tensors' data is read only to check CRCs (limits.verify_crc) and by ReadParam. Errors:
// NotFound (no such directory, no optimizer files, a missing model file), FailedPrecondition
// (a link or non-regular file), InvalidArgument (what zinf does not import: model/pipeline
// parallel or MoE files, frozen params, non-Adam state, torch's legacy format, a `latest` that
// is not one component, a ds_config JSON cannot hold, a DeepSpeed universal checkpoint
// directory), DataLoss (files that disagree with each other or with the layout: ranks missing
// or repeated, partition_count, zero_stage, group counts, tensor lengths, steps, step != G - K,
// a pickle that is not what DeepSpeed writes), and those of TorchFile::Read (a hostile pickle
// is InvalidArgument naming the global it wanted), each naming the file and key.
Result<DeepSpeedCheckpoint> OpenDeepSpeedCheckpoint(const std::string& dir,
                                                    const DeepSpeedLimits& limits = {});

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_DEEPSPEED_H_
