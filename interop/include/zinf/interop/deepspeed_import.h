// A DeepSpeed checkpoint (ZeRO stage 1, 2 or 3 as DeepSpeed saves it, or DeepSpeed's universal
// layout; deepspeed.h reads it) written as one zinf checkpoint file (checkpoint/checkpoint.h, fp32
// state) that restores on any number of ranks: what `zinf-ckpt import-deepspeed DIR --out FILE`
// runs (issue 46). The way back of deepspeed_export.h.
//
// What the zinf file holds:
//   layout       the parameters in DeepSpeedCheckpoint::params() order (the model's state_dict
//                order), with their shapes and the module's dtype (float32 when the module holds
//                none of them); tied aliases (shared_params) are not parameters of their own
//   /state/*     each parameter's fp32 master weights, exp_avg and exp_avg_sq, bitwise as
//                DeepSpeed saved them (padding dropped)
//   step         global_steps (G, every step, fp16-skipped ones included)
//   world_size   DeepSpeed's data-parallel world size W (the file restores on any number)
//   sub_group_size  zero_optimization.sub_group_size of ds_config, else DeepSpeed's 1e9 default
//   optimizer    {"type": "Adam" | "AdamW", "params": {lr, betas, eps, weight_decay,
//                adam_w_mode}}: the type of ds_config's optimizer block as zinf's config spells
//                it, adam_w_mode resolved as zinf's config resolves it (swapper::
//                ResolveAdamWMode: Adam's defaults to true, DeepSpeed's default), so that a
//                resume with that config passes the restore's optimizer check; without an
//                optimizer block (a client optimizer) "Adam" with the saved groups' adam_w_mode
//                (DeepSpeed's FusedAdam and CPUAdam save it). The numbers are group 0's below.
//   config       ds_config as DeepSpeed stored it (an object; {} when none)
//   trainer      engine/trainer_state.h's JSON: step G, world_size W, skipped_steps K,
//                scheduler_last_batch_iteration G - K - 1, lr (group 0's), the three batch sizes
//                when ds_config's batch keys resolve for W ranks (zinf's config rule; omitted
//                when they do not divide, e.g. a file exported for another world size),
//                loss_scaler {dynamic: true, scale, iteration, last_overflow_iteration,
//                hysteresis} (LossScaler::ToJson's shape) from a DynamicLossScaler, present
//                exactly when ds_config's fp16 has a dynamic loss scale, param_groups: one per
//                DeepSpeed optimizer group, {lr, betas, eps, weight_decay, params: [names in
//                layout order]} as saved (elastic files save none: ds_config's optimizer values),
//                and "user": the model file's client state (DeepSpeedCheckpoint::client_state():
//                what deepspeed_export.h writes from a zinf checkpoint's user state)
// Refused (InvalidArgument, before anything is written): what OpenDeepSpeedCheckpoint refuses;
// what zinf's config parser refuses in ds_config's optimizer, fp16 and
// zero_optimization.sub_group_size (config::ParseConfig: an optimizer type other than Adam and
// AdamW, a negative lr, ...) and optimizer.params.amsgrad true; no optimizer block and no saved
// adam_w_mode (Adam and AdamW state cannot be told apart); saved group options zinf's Adam would
// continue with other math (bias_correction false, amsgrad or maximize true) or an adam_w_mode
// that contradicts ds_config's; group hyper-parameters outside AdamOptions' ranges; a loss scaler
// that contradicts ds_config's fp16 block (a DynamicLossScaler without a dynamic fp16 config, or
// a static or no scaler with one: the scale's state would be lost); a module dtype zinf's
// layouts do not hold; parameter names or shapes ParamLayout refuses.
//
// Memory: pieces of at most 1 Mi floats (parameters are read in ranges, DeepSpeedCheckpoint::
// ReadParam) plus the writer's chunk buffers, whatever the model size.
//
// Thread safety: a plain function.
#ifndef ZINF_INTEROP_DEEPSPEED_IMPORT_H_
#define ZINF_INTEROP_DEEPSPEED_IMPORT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/status.h"
#include "zinf/interop/deepspeed.h"
#include "zinf/storage/fs.h"

namespace zinf::interop {

struct DeepSpeedImportOptions {
  DeepSpeedLimits limits;
  storage::Overwrite overwrite = storage::Overwrite::kNo;
  // Called with (bytes written, bytes total) as the state is written. Empty: none.
  checkpoint::CheckpointProgressFn progress;
  // Run on the complete file before it is renamed to out_path (zinf-ckpt runs
  // engine::VerifyResumable: the checks a resume runs, e.g. the loss scale against fp16's
  // min_loss_scale). Its error, prefixed "deepspeed import: the file made for <out_path> fails its
  // check: ", leaves nothing.
  std::function<Status(const std::string& temp_path)> check;
};

struct DeepSpeedImportResult {
  int stage = 0;           // DeepSpeedCheckpoint::stage()
  bool universal = false;  // a universal folder was read
  std::uint64_t world_size = 0;
  std::int64_t step = 0;
  std::uint64_t num_params = 0;
  std::uint64_t total_numel = 0;
  // Client-state keys not imported (values JSON cannot hold), for the caller to report.
  std::vector<std::string> client_state_skipped;
};

// Reads the DeepSpeed checkpoint `dir` (as OpenDeepSpeedCheckpoint takes it) and writes it as a
// zinf checkpoint file `out_path` (checkpoint::CheckpointWriter: nothing at out_path until it is
// complete and checked). Errors: those of OpenDeepSpeedCheckpoint and ReadParam (every problem of
// the input, naming the file and key: DataLoss for a NaN, an infinity or a negative exp_avg_sq),
// InvalidArgument (what is refused above), CheckpointWriter's (AlreadyExists: out_path exists
// and options.overwrite is kNo; FailedPrecondition: it is not a regular file), options.check's.
// On error nothing is written: nothing at out_path (an existing file stays as it was) and no
// temporary beside it.
Result<DeepSpeedImportResult> ImportDeepSpeed(const std::string& dir, const std::string& out_path,
                                              const DeepSpeedImportOptions& options = {});

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_DEEPSPEED_IMPORT_H_
