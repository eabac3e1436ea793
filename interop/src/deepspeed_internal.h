// The parts of the DeepSpeed checkpoint reader (zinf/interop/deepspeed.h) that its ZeRO 1/2/3
// reading (deepspeed_read.cc) and its universal reading (deepspeed_universal.cc) share: what
// DeepSpeedCheckpoint holds (CheckpointState), the PyValue tree read with errors that name where
// (deepspeed_state.cc), the checkpoint folder and its files (deepspeed_folder.cc), and the readers
// of the model-states file(s) and of what both kinds of optimizer state hold (deepspeed_state.cc).
// Private to zinf::interop.
//
// Files are opened relative to descriptors of the folders Open opened without following links
// (TorchFile::ReadAt), never again by path: a folder replaced by a link after Open is not read.
#ifndef ZINF_INTEROP_SRC_DEEPSPEED_INTERNAL_H_
#define ZINF_INTEROP_SRC_DEEPSPEED_INTERNAL_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/core/status.h"
#include "zinf/interop/deepspeed.h"
#include "zinf/interop/pickle.h"
#include "zinf/interop/torch_file.h"
#include "zinf/storage/fs.h"

namespace zinf::interop::deepspeed_internal {

// The fields of DeepSpeedCheckpoint::Field, in order: the optimizer state keys of the moments.
inline constexpr std::array<const char*, 3> kFieldNames = {"fp32", "exp_avg", "exp_avg_sq"};
// How many names an error lists.
inline constexpr std::size_t kMaxListed = 5;
// Names of param groups and params quoted in errors are cut at this length.
inline constexpr std::size_t kMaxName = 200;

// ---- what DeepSpeedCheckpoint holds (its Impl), for the functions that fill it ----

struct CheckpointState {
  int stage = 0;
  bool bf16 = false;
  bool elastic = false;
  std::uint64_t world = 0;
  std::string tag_dir;
  std::int64_t global_steps = 0;
  std::int64_t skipped_steps = 0;
  std::optional<std::int64_t> last_batch_iteration;
  DeepSpeedLossScaler scaler;
  nlohmann::json ds_config;
  std::vector<DeepSpeedOptimizerGroup> groups;
  std::vector<DeepSpeedParam> params;
  std::vector<std::pair<std::string, std::string>> shared;
  nlohmann::json client_state = nlohmann::json::object();
  std::vector<std::string> client_state_skipped;

  // Where each param (same index as params) lies: flat group, offset (stage 1/2: in the group's
  // unpadded flat vector; stage 3: in each rank's flat of the sub-group).
  struct Where {
    std::size_t flat = 0;
    std::uint64_t offset = 0;
  };
  std::vector<Where> where;
  // Stage 1/2 per flat group: n and P.
  std::vector<std::uint64_t> flat_numel;
  std::vector<std::uint64_t> partition;
  // The optimizer files, by rank, and their tensors: tensors[flat][rank][field].
  std::vector<TorchFile> files;
  std::vector<std::vector<std::array<PyTensor, 3>>> tensors;

  // A universal folder: each param's field files (same index as params), read again by
  // ReadParam (a descriptor held per file could pass the process's limit) relative to
  // `universal_zero` (zero/, opened at Open without following links; one descriptor), and the
  // tensor Open checked there, which ReadParam must find again.
  bool universal = false;
  PickleLimits pickle;
  storage::UniqueFd universal_zero;
  struct UniversalField {
    std::string path;  // for errors: <tag_dir>/zero/<param>/<field>.pt
    PyTensor tensor;
  };
  std::vector<std::array<UniversalField, 3>> universal_fields;
};

// ---- the PyValue tree, read with errors that name where (DataLoss) ----

Result<const PyDict*> AsDict(const PyValue& v, std::string_view where);
Result<const PyValue*> Need(const PyDict& d, std::string_view key, std::string_view where);
Result<const PyDict*> NeedDict(const PyDict& d, std::string_view key, std::string_view where);
// A list or a tuple.
Result<const std::vector<PyValue>*> AsSequence(const PyValue& v, std::string_view where);
Result<const std::vector<PyValue>*> NeedSequence(const PyDict& d, std::string_view key,
                                                 std::string_view where);
Result<std::int64_t> AsInt(const PyValue& v, std::string_view where);
Result<std::int64_t> NeedInt(const PyDict& d, std::string_view key, std::string_view where);
// An int or a finite float.
Result<double> AsNumber(const PyValue& v, std::string_view where);
Result<const PyTensor*> AsTensor(const PyValue& v, std::string_view where);
// No value, or None.
bool IsNone(const PyValue* v);

// `v` as JSON: None, bool, int, finite float, str, list/tuple, dict with str keys; a dtype as its
// name when `dtype_as_name`. Anything else: InvalidArgument naming where.
Result<nlohmann::json> ToJson(const PyValue& v, const std::string& where, bool dtype_as_name,
                              int depth = 0);

// A torch.Size (or tuple / list of non-negative ints) as a shape and its element count.
Result<std::pair<std::vector<std::int64_t>, std::uint64_t>> AsShape(const PyValue& v,
                                                                    std::string_view where);

// The first kMaxListed of `names`, printable, comma-separated ("..." after them when more).
std::string ListNames(const std::vector<std::string>& names);

inline std::uint64_t CeilDiv(std::uint64_t a, std::uint64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

// ---- the checkpoint folder (deepspeed_folder.cc) ----

// The files of a tag (or universal) folder, by kind.
struct TagFiles {
  std::string prefix;                           // of the optimizer files: "", "bf16_", "fp16_"
  std::map<std::uint64_t, std::string> optim;   // dp -> name
  std::map<std::uint64_t, std::string> model3;  // dp -> name (stage 3)
  std::optional<std::string> model12;           // mp_rank_00_model_states.pt
  bool universal = false;                       // zero/optimizer_state.pt is there
};

// `name` in `dir_fd` is a regular file, not a link (FailedPrecondition naming `display`).
Status CheckRegularFile(int dir_fd, const std::string& name, const std::string& display);

// The checkpoint files in the folder `dir_fd` (`tag_dir` in errors), each checked to be a regular
// file; refuses pipeline, MoE and model-parallel files, names DeepSpeed does not write, two
// prefixes or two files of one rank, and a folder without optimizer files or universal state.
Result<TagFiles> FindFiles(int dir_fd, const std::string& tag_dir, const DeepSpeedLimits& limits);

// Ranks 0..W-1 exactly, W = the count; `what` names the kind of file.
// With `world` (non-zero), ranks 0..world-1.
Status CheckRanks(const std::map<std::uint64_t, std::string>& files, const std::string& tag_dir,
                  std::string_view what, std::uint64_t max_world_size, std::uint64_t world = 0);

// The folder `dir` names: `dir`/<tag> when `dir` holds `latest` or `latest_universal` (naming
// the tag, or the universal folder, beside it), else `dir`; opened once (`fd`), every file of the
// checkpoint is opened relative to it.
struct TagDir {
  std::string path;
  storage::UniqueFd fd;
  std::string pointer;  // the file that named it ("<dir>/latest_universal"), or "" for `dir`
};
Result<TagDir> OpenTagDir(const std::string& dir, const DeepSpeedLimits& limits);

// ---- steps, scalers, param groups, tensors (deepspeed_state.cc) ----

// An Adam step: an int, or a 0-dim int64 / float tensor (of `file`) holding a whole number >= 0.
Result<std::int64_t> ReadStep(const TorchFile& file, const PyValue& v, const std::string& where);
// osd['loss_scaler']: DeepSpeed's LossScaler or DynamicLossScaler, or none.
Result<DeepSpeedLossScaler> ReadLossScaler(const PyDict& osd, const std::string& where);
bool SameScaler(const DeepSpeedLossScaler& a, const DeepSpeedLossScaler& b);
// An Adam param group (lr, betas, eps, weight_decay; the other keys as options).
Result<DeepSpeedOptimizerGroup> ReadOptimizerGroup(const PyValue& v, const std::string& where);
bool SameGroup(const DeepSpeedOptimizerGroup& a, const DeepSpeedOptimizerGroup& b);
// The stage of `osd['zero_stage']` (1..3), or nullopt without the key (BF16_Optimizer).
Result<std::optional<std::int64_t>> ReadZeroStage(const PyDict& osd, const std::string& where);
// An optimizer state entry holds Adam's keys only (step, exp_avg, exp_avg_sq): anything else
// (max_exp_avg_sq, another optimizer's state) is InvalidArgument naming `where`.
Status CheckAdamStateKeys(const PyDict& state, const std::string& where);
// A 1-dim float32 tensor of `numel` elements with stride 1.
Status CheckFlat(const PyTensor& t, std::uint64_t numel, const std::string& where);
// What ReadParam returns must be finite, and a second moment >= 0 (`values` are the param's
// elements from `offset` on).
Status CheckValues(const std::string& tag_dir, const DeepSpeedParam& p,
                   DeepSpeedCheckpoint::Field field, std::uint64_t offset,
                   std::span<const float> values);

// ---- the model file(s) (deepspeed_state.cc) ----

struct ModelFile {
  std::string name;
  TorchFile file;
};

// What every model file holds that the reader uses.
struct ModelInfo {
  struct Shape {
    std::string name;
    std::vector<std::int64_t> shape;
    std::uint64_t numel = 0;
  };
  std::vector<std::vector<Shape>> flat_groups;  // param_shapes
  std::int64_t global_steps = 0;
  std::int64_t skipped_steps = 0;
};

// The model-states file(s) of a checkpoint of ZeRO stage `stage` and `w` ranks, read (relative
// to `tag_fd`, the folder `tag_dir`) and checked against each other:
// mp_rank_00_model_states.pt (stage 1/2) or one per rank (stage 3). `beside` names what else the
// folder holds, for errors.
struct Models {
  std::vector<ModelFile> files;
  ModelInfo info;
};
Result<Models> ReadModels(const TagFiles& found, int tag_fd, const std::string& tag_dir, int stage,
                          std::uint64_t w, std::string_view beside, const DeepSpeedLimits& limits);

// What the model file holds besides the shapes: the steps, frozen and shared params, the
// scheduler's position.
Status ReadModelState(CheckpointState& m, const ModelInfo& info, const TorchFile& model,
                      const PyDict& mroot);

// The param groups of a torch optimizer's state_dict (`state_where` holds 'param_groups'), each
// naming the flat groups (stage 3: sub-groups) it holds: every one of the `flats` exactly once.
struct ParamGroups {
  std::vector<DeepSpeedOptimizerGroup> groups;
  std::vector<std::size_t> group_of_flat;
};
Result<ParamGroups> ReadParamGroups(const std::vector<PyValue>& param_groups, std::size_t flats,
                                    const std::string& state_where);

// ds_config: `config` (the optimizer files', `cw` in errors), else the model file's; null when
// neither has one.
Status ReadDsConfig(CheckpointState& m, const PyValue* config, std::string cw,
                    const TorchFile& model, const PyDict& mroot);

// The client state: the model file's keys DeepSpeed does not own.
void ReadClientState(CheckpointState& m, const TorchFile& model, const PyDict& mroot);

// The params (m.params, m.where) from param_shapes, in module order when module holds them all,
// else in param_shapes order; their dtype from module. Needs m.stage and m.world.
Status BuildParams(CheckpointState& m, const ModelInfo& info, const TorchFile& model,
                   const PyDict& mroot, const std::vector<std::size_t>& group_of_flat);

// ---- universal folders (deepspeed_universal.cc) ----

// Reads the universal folder `m.tag_dir` (open as `tag_fd`; `found` its files) into `m`.
Status ReadUniversal(CheckpointState& m, int tag_fd, const TagFiles& found,
                     const DeepSpeedLimits& limits);
// ReadParam of a universal checkpoint: elements [offset, offset + out.size()) of field `field`
// of param `param` (all in range, out not empty) read again from its file, which must hold the
// tensor Open checked.
Status ReadUniversalParam(const CheckpointState& m, std::size_t param, std::size_t field,
                          std::uint64_t offset, std::span<float> out);

}  // namespace zinf::interop::deepspeed_internal

#endif  // ZINF_INTEROP_SRC_DEEPSPEED_INTERNAL_H_
