// DeepSpeed ZeRO checkpoints (stage 1, 2 and 3, as DeepSpeed v0.19 saves them, and the universal
// checkpoints its ds_to_universal converts them to), read without Python and without running code
// (torch_file.h): the files of one checkpoint tag found and checked against each other, and each
// parameter's fp32 weights and Adam moments assembled from the ranks' partitions (or read from
// its universal files) on demand. The read side of `zinf-ckpt import-deepspeed` (issue 46).
//
// What is read, in a tag directory (global_stepN):
//   [bf16_|fp16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt, r = 0..W-1 (one prefix)
//   mp_rank_00_model_states.pt                        (stage 1/2)
//   zero_pp_rank_{r}_mp_rank_00_model_states.pt, r = 0..W-1  (stage 3)
// What is read in a universal folder (spec sections 1.5 and 3; the folder holds
// zero/optimizer_state.pt):
//   from a stage 1/2 checkpoint:
//     mp_rank_00_model_states.pt                      (copied from the source)
//     zero/optimizer_state.pt                         param_groups, loss_scaler, zero_stage,
//                                                     partition_count ([W] * groups)
//     zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt       {'param': fp32 tensor of the param's
//                                                     elements, 'cat_dim': int (optional)}
//     zero/<param>/step.pt                            the Adam step (int or 0-dim tensor)
//   from a stage 3 checkpoint:
//     zero_pp_rank_{r}_mp_rank_00_model_states.pt, r = 0..W-1  (copied)
//     zero/optimizer_state.pt                         as above, partition_count W (an int), the
//                                                     step in optimizer_state_dict.state[s].step
//     zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt       a bare 1-dim fp32 tensor of numel elements
//   The params and their order come from the model file (param_shapes, module), never from the
//   listing of zero/, which holds optimizer_state.pt and the params' folders only.
// Refused, with an error naming the file: model parallelism (mp_rank other than 00), pipeline
// (layer_*) and MoE expert files, links, missing or extra ranks, frozen parameters, optimizer
// state other than Adam's (exp_avg, exp_avg_sq, step), torch's legacy file format; in universal
// folders a param folder missing, extra or a link, a param name that is not one path component,
// other files in a param's folder, and tensor- or expert-parallel param files (vocab_tensor,
// param_n_sub_params, sub_param_shape, is_expert_param).
//
// Layout (docs: issue 46's spec, section 2). Stage 1/2: per param group, the params of
// param_shapes[g] concatenated (n elements), padded to a multiple of 2W, rank r holding flat
// [r*P, (r+1)*P), P = 2*ceil(n/2W); saved fp32 without the padding (BF16_Optimizer files: with
// it), rigid moments with it (length P), elastic moments without. Stage 3: per sub-group, rank
// r's flat is the concatenation over the sub-group's params of elements [r*pn, (r+1)*pn) of each
// param (pn = ceil(numel/W), zero-padded past numel).
#ifndef ZINF_INTEROP_DEEPSPEED_H_
#define ZINF_INTEROP_DEEPSPEED_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/core/status.h"
#include "zinf/interop/pickle.h"

namespace zinf::interop {

// The top-level keys of a DeepSpeed model-states file that are not client state: every key
// DeepSpeed's engine writes there (runtime/engine.py _common_checkpoint_state), and the others it
// or ds_to_universal read from it (checkpoint_parallel_dimensions, universal_checkpoint_info;
// Megatron's iteration, args, checkpoint_info). Every other top-level key is the user's
// client_state: DeepSpeedCheckpoint::client_state() reads them, deepspeed_export.h writes a zinf
// checkpoint's "user" keys there and refuses one of these names.
inline constexpr std::array<std::string_view, 23> kDeepSpeedModelKeys = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
    "universal_checkpoint_info",
    "iteration",
    "args",
    "checkpoint_info"};

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

  int stage() const;                 // 1, 2 or 3 (universal: the stage of its source)
  bool bf16_optimizer() const;       // BF16_Optimizer files (no zero_stage key; read as stage 1)
  bool elastic() const;              // stage 1/2 elastic (moments saved without padding)
  bool universal() const;            // a universal folder (ds_to_universal's output)
  // W: the data-parallel ranks, = the number of files (universal: partition_count, the source's)
  std::uint64_t world_size() const;
  const std::string& tag_dir() const;  // the tag (or universal) folder read
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
  // The client state: the model file's top-level keys DeepSpeed does not own (what its
  // load_checkpoint returns as client_state; kDeepSpeedModelKeys are its own), as a JSON object
  // of those whose values JSON can hold (None, bool, int, finite float, str, list, tuple, dict
  // with str keys). The others (a tensor, ...) are named in client_state_skipped().
  const nlohmann::json& client_state() const;
  const std::vector<std::string>& client_state_skipped() const;

  // Parameter `param`'s values of `field` (row-major, numel of them) into `out` (exactly numel
  // floats), read as ranges of the ranks' tensors (held open since Open; universal: of the
  // param's file of `field`, opened again in the zero/ folder Open opened, whatever its path
  // now leads to, never following a link, and whose tensor must still be the one Open checked):
  // memory `out` plus bounded buffers. Thread-safe (reads with pread). Errors: InvalidArgument
  // (param out of range, `out` of another size), DataLoss naming the param and field for a NaN
  // or infinity in any field or a negative exp_avg_sq, read errors (naming the file), a
  // universal file changed since Open, FailedPrecondition for a universal param folder or file
  // replaced by a link since Open.
  Status ReadParam(std::size_t param, Field field, std::span<float> out) const;
  // The same for elements [offset, offset + out.size()) of the parameter (row-major; a range
  // past its numel is InvalidArgument): a large parameter read in bounded pieces.
  Status ReadParam(std::size_t param, Field field, std::uint64_t offset,
                   std::span<float> out) const;

 private:
  friend Result<DeepSpeedCheckpoint> OpenDeepSpeedCheckpoint(const std::string& dir,
                                                             const DeepSpeedLimits& limits);
  struct Impl;
  explicit DeepSpeedCheckpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "fp32", "exp_avg", "exp_avg_sq".
const char* DeepSpeedFieldName(DeepSpeedCheckpoint::Field field);

// Opens the checkpoint in `dir`: a save directory holding `latest` or `latest_universal` (a
// regular file of at most limits.max_latest_bytes naming one path component, the tag or
// universal folder beside it, not a link; both there is InvalidArgument), a tag directory, or a
// universal folder (it holds zero/optimizer_state.pt). The folder is opened once, and every file
// relative to it (never again by path, so a folder replaced by a link meanwhile is not read).
// Reads and checks every file's pickle (see the top of this file); the tensors' data is read
// only to check CRCs (limits.verify_crc) and by ReadParam. Errors: NotFound (no such directory,
// no optimizer files, a missing model file or param folder or file, a `latest_universal` naming
// a folder that is not universal),
// FailedPrecondition (a link or non-regular file or folder), InvalidArgument (what zinf does not
// import: model/pipeline parallel or MoE files, frozen params, non-Adam state, torch's legacy
// format, a `latest` that is not one component, a ds_config JSON cannot hold, tensor- or
// expert-parallel universal params, a param name that is not a folder name), DataLoss (files
// that disagree with each other or with the layout: ranks missing or repeated, partition_count,
// zero_stage, group counts, tensor lengths, steps, step != G - K, extra folders in a universal
// zero/, a pickle that is not what DeepSpeed writes), and those of TorchFile::Read (a hostile
// pickle is InvalidArgument naming the global it wanted), each naming the file and key.
Result<DeepSpeedCheckpoint> OpenDeepSpeedCheckpoint(const std::string& dir,
                                                    const DeepSpeedLimits& limits = {});

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_DEEPSPEED_H_
