// A zinf checkpoint written as a DeepSpeed ZeRO stage 1/2 checkpoint directory (issue 46), for a
// chosen data-parallel world size W, such that DeepSpeed's own tools (utils/zero_to_fp32.py,
// checkpoint/ds_to_universal.py) and DeepSpeed's engine read it:
//
//   OUT/latest                                          the tag (no newline)
//   OUT/<tag>/mp_rank_00_model_states.pt               the model states (below)
//   OUT/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt    for r = 0 .. W-1
//
// or, with DeepSpeedExportOptions::universal, as DeepSpeed's *universal* checkpoint: exactly what
// DeepSpeed v0.19.6's ds_to_universal makes of the ZeRO 1/2 export above (its output folder
// being OUT/<tag>), which DeepSpeed's engine loads on any world size ("load_universal": true):
//
//   OUT/latest_universal                    the tag (no newline)
//   OUT/<tag>/mp_rank_00_model_states.pt   the same model states as the ZeRO 1/2 export
//   OUT/<tag>/zero/optimizer_state.pt      rank 0's S below without base_optimizer_state,
//                                          single_partition_of_fp32_groups and
//                                          param_slice_mappings, with group_paddings [0] * G and
//                                          'param_groups' (base_optimizer_state's param_groups)
//   OUT/<tag>/zero/<name>/fp32.pt          {'cat_dim': 0, 'param': the fp32 weights of parameter
//   OUT/<tag>/zero/<name>/exp_avg.pt        <name>, a tensor of its shape}; the same for the two
//   OUT/<tag>/zero/<name>/exp_avg_sq.pt     moments (a q8 checkpoint's decoded, see below)
//   OUT/<tag>/zero/<name>/step.pt          a bare int: the checkpoint's step - skipped_steps
//
// W is then recorded only (partition_count [W] * G in optimizer_state.pt, dp_world_size W in the
// model states): the files do not depend on it, and DeepSpeed's universal load repartitions for
// its own world size. Each parameter name is a directory name there, so a name that cannot be
// one (empty, ".", "..", "optimizer_state.pt", longer than 255 bytes, holding '/' or an ASCII
// control character) is refused; zinf's layouts allow '/' in names (a Flax-style "enc/w").
//
// Parameter groups: one DeepSpeed group per entry of the checkpoint's trainer `param_groups`
// (engine/trainer_state.h), holding its parameters in zinf layout order; one group of every
// parameter when the trainer state has none. Group g's flat vector (its parameters' elements
// concatenated, n_g elements) is padded with zeros to a multiple of 2W and split into W
// partitions of P_g = 2 * ceil(n_g / 2W) elements (DeepSpeed's alignment and partitioning);
// rank r holds flat [r * P_g, (r + 1) * P_g).
//
// Each optim file is {'optimizer_state_dict': S, 'ds_config': the checkpoint's stored config,
// 'ds_version': kDeepSpeedExportVersion}, S holding, per group g:
//   single_partition_of_fp32_groups[g]   the rank's fp32 weights, padding removed (so the W
//                                        partitions concatenated are exactly the group's flat
//                                        vector: zero_to_fp32 recovers zinf's weights bitwise)
//   base_optimizer_state                 {'state': {g: {'step': int, 'exp_avg', 'exp_avg_sq'}},
//                                        'param_groups': [{lr, betas (tuple), eps, weight_decay,
//                                        bias_correction True, adam_w_mode, params [g]}]}: the
//                                        "rigid" form, moments of P_g elements with the padding
//                                        (zeros); step = the checkpoint's step - skipped_steps
//                                        (Adam's step count); lr = the group's configured lr
//                                        (DeepSpeed's scheduler sets the current one from
//                                        lr_scheduler on its next step)
//   group_paddings[g], partition_count [W] * G, param_slice_mappings[g] (OrderedDict name ->
//   deepspeed.utils.tensor_fragment.fragment_address{numel, start}, start relative to the
//   rank's partition, for the parameters overlapping it), zero_stage (a plain int: 1 or 2),
//   loss_scaler (deepspeed.runtime.fp16.loss_scaler DynamicLossScaler for a dynamic fp16 run,
//   with the saved scaler's state; LossScaler {cur_scale, dynamic False} otherwise: fp16's
//   static scale, else 1.0), dynamic_loss_scale, overflow False, clip_grad (gradient_clipping),
//   ds_version.
// The model file: module (OrderedDict name -> fp32 tensor of the parameter's shape: the fp32
// master weights), buffer_names [], optimizer None, param_shapes (one OrderedDict name ->
// torch.Size per group), frozen_param_shapes None, frozen_param_fragments None, shared_params
// {}, lr_scheduler {'last_batch_iteration': step - skipped_steps - 1}, global_steps (the
// checkpoint's step), skipped_steps, global_samples (step * train_batch_size), dp_world_size W,
// mp_world_size 1, checkpoint_parallel_dimensions {pp_degree 1, tp_degree 1}, ds_config,
// ds_version, universal_checkpoint_info {'universal_checkpoint_version': 0.4} (so ds_to_universal
// runs without --inject_missing_state).
// DeepSpeed v0.19.6's ds_to_universal cannot convert a checkpoint holding a 0-dim parameter
// (shape []: its merge concatenates 0-dim tensors), DeepSpeed's own checkpoints included;
// zero_to_fp32 and DeepSpeed's engine read it, and the universal export writes it (shape []).
// Client state: DeepSpeed keeps a user's client_state as extra top-level keys of the model-states
// file and gives back every key it does not own as client_state on load (runtime/engine.py:
// _save_checkpoint's state.update(client_state); _load_checkpoint). zinf keeps the training
// loop's state as the trainer state's "user" object (engine/trainer_state.h; zinf-train's seed
// and data position, zinf.torch's client_state), so both layouts write each key of "user" as a
// top-level key of mp_rank_00_model_states.pt, after DeepSpeed's own keys, its value as plain
// pickle values: null -> None, true/false -> bool, integers -> int, other numbers -> float,
// strings -> str, arrays -> list, objects -> dict (str keys). Reading it back: every top-level
// key outside kDeepSpeedModelKeys is a key of "user". Refused (InvalidArgument naming
// the key, nothing written): a key in kDeepSpeedModelKeys (every key the model file
// holds, and those DeepSpeed or ds_to_universal read from it), an integer outside int64 (a
// float would silently change a seed or a position: store such values as strings), nesting
// deeper than kMaxDeepSpeedUserDepth containers. A trainer state whose "user" is null or absent
// (an older zinf-train's state, which a resume takes whole as the user's) adds no keys; a
// "user" that is neither an object nor null is DataLoss.
// A q8 checkpoint's moments are written decoded, as fp32 (DeepSpeed has no q8 state): a
// DeepSpeed run resumed from the export continues from the decoded moments.
//
// Everything is streamed from the checkpoint through CheckpointStateReader (every chunk's
// checksum verified) into the torch files piece by piece: memory is about one checkpoint chunk
// plus one piece of 1 Mi floats, whatever the model size.
//
// Thread safety: a plain function; one call per output directory.
#ifndef ZINF_INTEROP_DEEPSPEED_EXPORT_H_
#define ZINF_INTEROP_DEEPSPEED_EXPORT_H_

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/status.h"
#include "zinf/interop/deepspeed.h"

namespace zinf::interop {

// The DeepSpeed release whose layout the export follows (written as ds_version).
inline constexpr std::string_view kDeepSpeedExportVersion = "0.19.6";
inline constexpr int kMaxDeepSpeedExportWorldSize = 4096;

// The deepest nesting of lists and dicts in a "user" value (the user object itself not counted).
inline constexpr int kMaxDeepSpeedUserDepth = 64;

struct DeepSpeedExportOptions {
  int world_size = 1;      // W, the data-parallel ranks of the layout, in [1, kMaxDeepSpeed...]
  int stage = 2;           // ZeRO stage recorded in the files: 1 or 2 (the layout is the same)
  std::string tag;         // the folder under out_dir; empty: "global_step<step>"
  bool universal = false;  // DeepSpeed's universal layout (above) instead of ZeRO 1/2's
  // Called with (bytes written, bytes total) as the files are written. Empty: none.
  checkpoint::CheckpointProgressFn progress;
  // A further check of the checkpoint's metadata before anything is written (zinf-ckpt runs the
  // engine's check of the trainer state, engine::ReadTrainerState, the one a resume runs).
  std::function<Status(const checkpoint::CheckpointInfo&)> check_info;
};

// Writes the checkpoint `checkpoint_path` (as checkpoint::ResolveCheckpointPath takes it) to
// `out_dir` in the layout above. `out_dir` must not exist (its parent must) or be an empty
// directory. Everything is written into a new temporary directory beside it
// (".<name>.deepspeed-tmp-XXXXXX"), synced, and renamed to `out_dir` when complete: on any error
// nothing is left (the temporary is removed) and an empty `out_dir` stays as it was.
// Errors: InvalidArgument (world_size outside [1, kMaxDeepSpeedExportWorldSize], stage not 1 or
// 2, a tag that is not one path component of letters, digits and . _ - + =; a "user" key or
// value refused above; universal: a parameter name that cannot be a directory name);
// FailedPrecondition (out_dir exists and is not an empty directory);
// ResourceExhausted (the parent's file system has too little space for the files);
// the checkpoint's errors (checkpoint::ReadCheckpointInfo, DataLoss for a bad chunk while
// streaming, a trainer state whose param_groups do not name every parameter exactly once);
// check_info's; file-system errors.
Status ExportDeepSpeed(const std::string& checkpoint_path, const std::string& out_dir,
                       const DeepSpeedExportOptions& options = {});

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_DEEPSPEED_EXPORT_H_
