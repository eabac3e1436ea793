#include "zinf/interop/deepspeed_export.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/interop/pickle.h"
#include "zinf/interop/torch_file.h"
#include "zinf/partition/layout.h"
#include "zinf/storage/fs.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::interop {
namespace {

using checkpoint::CheckpointInfo;
using checkpoint::CheckpointStateReader;
using swapper::StateTensor;

// Pickle values, spelled out: a bare string literal or int must never pick another alternative.
PyValue Str(std::string s) { return PyValue(std::move(s)); }
PyValue Int(std::int64_t v) { return PyValue(v); }
PyValue Float(double v) { return PyValue(v); }
PyValue Bool(bool v) { return PyValue(v); }

struct DictBuilder {
  PyDict d;
  DictBuilder& Add(std::string key, PyValue value) {
    d.items.emplace_back(Str(std::move(key)), std::move(value));
    return *this;
  }
  PyValue Done() { return PyValue(std::move(d)); }
};
DictBuilder Dict(bool ordered = false) {
  DictBuilder b;
  b.d.ordered = ordered;
  return b;
}

// `j` as plain pickle values: null -> None, bool, int, float, str, list, dict (the header's
// mapping of the user state). An integer outside int64 is refused when `exact_integers` (the
// user's state: a float would silently change a seed or a position), else written as the nearest
// float (the stored config). `path` names the value for errors ("the trainer state's
// user.data.files[2]"); `depth` counts the lists and dicts around it.
Result<PyValue> ToPy(const nlohmann::json& j, bool exact_integers, int depth,
                     const std::string& path) {
  auto refuse = [&](std::string_view why) {
    return InvalidArgumentError(
        fmt::format("deepspeed export: {} {}", EscapeForTerminal(path), why));
  };
  const bool container = j.is_array() || j.is_object();
  if (container && depth >= kMaxDeepSpeedUserDepth) {
    return refuse(fmt::format("is nested deeper than {} lists and dicts", kMaxDeepSpeedUserDepth));
  }
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return PyValue(PyNone{});
    case nlohmann::json::value_t::boolean:
      return Bool(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Int(j.get<std::int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.get<std::uint64_t>();
      if (u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return Int(static_cast<std::int64_t>(u));
      }
      if (!exact_integers) return Float(static_cast<double>(u));
      return refuse(fmt::format(
          "is {}, outside int64 (a float would change its value; store it as a string)", u));
    }
    case nlohmann::json::value_t::number_float:
      return Float(j.get<double>());
    case nlohmann::json::value_t::string:
      return Str(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      PyList list;
      for (std::size_t i = 0; i < j.size(); ++i) {
        ZINF_ASSIGN_OR_RETURN(
            PyValue v, ToPy(j[i], exact_integers, depth + 1, fmt::format("{}[{}]", path, i)));
        list.items.push_back(std::move(v));
      }
      return PyValue(std::move(list));
    }
    case nlohmann::json::value_t::object: {
      DictBuilder d = Dict();
      for (const auto& [k, v] : j.items()) {
        ZINF_ASSIGN_OR_RETURN(PyValue value,
                              ToPy(v, exact_integers, depth + 1, fmt::format("{}.{}", path, k)));
        d.Add(k, std::move(value));
      }
      return d.Done();
    }
    default:
      return refuse("is not a JSON value");
  }
}

// The model file's client state: the keys of the trainer state's "user" object.
Result<std::vector<std::pair<std::string, PyValue>>> UserEntries(const CheckpointInfo& info) {
  std::vector<std::pair<std::string, PyValue>> entries;
  const nlohmann::json& trainer = info.trainer;
  if (!trainer.is_object() || !trainer.contains("user") || trainer.at("user").is_null()) {
    return entries;
  }
  const nlohmann::json& user = trainer.at("user");
  if (!user.is_object()) {
    return DataLossError(fmt::format("{}: trainer state 'user' is {}, not a JSON object or null",
                                     info.path, DumpJsonForDisplay(user).substr(0, 80)));
  }
  for (const auto& [key, value] : user.items()) {
    if (std::find(kDeepSpeedModelKeys.begin(), kDeepSpeedModelKeys.end(), key) !=
        kDeepSpeedModelKeys.end()) {
      return InvalidArgumentError(fmt::format(
          "deepspeed export: the trainer state's user key '{}' is one DeepSpeed keeps for itself "
          "in mp_rank_00_model_states.pt, where the user's keys go (client_state); rename it",
          EscapeForTerminal(key)));
    }
    ZINF_ASSIGN_OR_RETURN(
        PyValue v, ToPy(value, /*exact_integers=*/true, 0, "the trainer state's user." + key));
    entries.emplace_back(key, std::move(v));
  }
  return entries;
}

// A number of a JSON object, `fallback` when absent; DataLoss when present but not a number.
Result<double> Number(const nlohmann::json& obj, std::string_view key, double fallback,
                      std::string_view where) {
  if (!obj.is_object() || !obj.contains(key)) return fallback;
  const nlohmann::json& v = obj.at(key);
  if (!v.is_number()) {
    return DataLossError(fmt::format("{}: '{}' is {}, not a number", where, key,
                                     DumpJsonForDisplay(v).substr(0, 80)));
  }
  const double d = v.get<double>();
  if (!std::isfinite(d)) return DataLossError(fmt::format("{}: '{}' is not finite", where, key));
  return d;
}
Result<std::int64_t> Integer(const nlohmann::json& obj, std::string_view key, std::int64_t fallback,
                             std::string_view where) {
  if (!obj.is_object() || !obj.contains(key)) return fallback;
  const nlohmann::json& v = obj.at(key);
  if (!v.is_number_integer()) {
    return DataLossError(fmt::format("{}: '{}' is {}, not an integer", where, key,
                                     DumpJsonForDisplay(v).substr(0, 80)));
  }
  return v.get<std::int64_t>();
}
bool Boolean(const nlohmann::json& obj, std::string_view key, bool fallback) {
  if (!obj.is_object() || !obj.contains(key) || !obj.at(key).is_boolean()) return fallback;
  return obj.at(key).get<bool>();
}

struct Hyper {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

Result<Hyper> ReadHyper(const nlohmann::json& obj, const Hyper& defaults, std::string_view where) {
  Hyper h;
  ZINF_ASSIGN_OR_RETURN(h.lr, Number(obj, "lr", defaults.lr, where));
  ZINF_ASSIGN_OR_RETURN(h.eps, Number(obj, "eps", defaults.eps, where));
  ZINF_ASSIGN_OR_RETURN(h.weight_decay, Number(obj, "weight_decay", defaults.weight_decay, where));
  h.beta1 = defaults.beta1;
  h.beta2 = defaults.beta2;
  if (obj.is_object() && obj.contains("betas")) {
    const nlohmann::json& b = obj.at("betas");
    if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number()) {
      return DataLossError(fmt::format("{}: 'betas' is {}, not two numbers", where,
                                       DumpJsonForDisplay(b).substr(0, 80)));
    }
    h.beta1 = b[0].get<double>();
    h.beta2 = b[1].get<double>();
  }
  return h;
}

// One DeepSpeed parameter group: its parameters (indices into the layout, in layout order) and
// where each starts in the group's flat vector.
struct Group {
  Hyper hyper;
  std::vector<std::size_t> params;
  std::vector<std::uint64_t> starts;
  std::uint64_t numel = 0;      // n
  std::uint64_t partition = 0;  // P = 2 * ceil(n / 2W)
};

// What the export writes besides the state, from the checkpoint's metadata.
struct Plan {
  std::vector<Group> groups;
  std::int64_t step = 0;
  std::int64_t skipped_steps = 0;
  std::int64_t global_samples = 0;
  bool adam_w_mode = true;
  double clip_grad = 0.0;
  bool dynamic_loss_scale = false;
  PyValue loss_scaler;
  PyValue ds_config;
  std::vector<std::pair<std::string, PyValue>> user;  // the model file's client state
};

Result<Plan> MakePlan(const CheckpointInfo& info, int world_size) {
  const std::string where = fmt::format("{}: trainer state", info.path);
  const partition::ParamLayout& layout = *info.layout;
  const nlohmann::json& trainer = info.trainer;
  const nlohmann::json& config = info.config;
  Plan plan;
  plan.step = info.step;
  ZINF_ASSIGN_OR_RETURN(plan.skipped_steps, Integer(trainer, "skipped_steps", 0, where));
  if (plan.skipped_steps < 0 || plan.skipped_steps > plan.step) {
    return DataLossError(fmt::format("{}: skipped_steps {} outside [0, step {}]", where,
                                     plan.skipped_steps, plan.step));
  }
  ZINF_ASSIGN_OR_RETURN(std::int64_t batch, Integer(config, "train_batch_size", 0,
                                                    fmt::format("{}: config", info.path)));
  ZINF_ASSIGN_OR_RETURN(batch, Integer(trainer, "train_batch_size", batch, where));
  if (batch < 0 || __builtin_mul_overflow(plan.step, batch, &plan.global_samples)) {
    return DataLossError(fmt::format("{}: train_batch_size {} times step {} is out of range", where,
                                     batch, plan.step));
  }

  // The optimizer: its type decides adam_w_mode; its params are the groups' defaults.
  const nlohmann::json& opt = info.optimizer;
  const nlohmann::json params =
      opt.is_object() && opt.contains("params") ? opt.at("params") : nlohmann::json::object();
  const std::string type = opt.is_object() && opt.contains("type") && opt.at("type").is_string()
                               ? opt.at("type").get<std::string>()
                               : "AdamW";
  std::optional<bool> adam_w_flag;
  if (params.is_object() && params.contains("adam_w_mode") &&
      params.at("adam_w_mode").is_boolean()) {
    adam_w_flag = params.at("adam_w_mode").get<bool>();
  }
  Result<bool> adamw = swapper::ResolveAdamWMode(type, adam_w_flag);
  if (!adamw) {
    return DataLossError(fmt::format("{}: optimizer: {}", info.path, adamw.error().message()));
  }
  plan.adam_w_mode = *adamw;
  ZINF_ASSIGN_OR_RETURN(const Hyper defaults,
                        ReadHyper(params, Hyper{}, fmt::format("{}: optimizer params", info.path)));

  // The groups: the trainer's param_groups, each parameter named exactly once.
  if (trainer.is_object() && trainer.contains("param_groups")) {
    const nlohmann::json& groups = trainer.at("param_groups");
    if (!groups.is_array() || groups.empty()) {
      return DataLossError(fmt::format("{}: param_groups is not a non-empty list", where));
    }
    std::unordered_map<std::string, std::size_t> index;
    for (std::size_t i = 0; i < layout.num_params(); ++i) index.emplace(layout.params()[i].name, i);
    std::vector<int> seen(layout.num_params(), -1);
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const std::string gwhere = fmt::format("{} param_groups[{}]", where, g);
      Group group;
      ZINF_ASSIGN_OR_RETURN(group.hyper, ReadHyper(groups[g], defaults, gwhere));
      if (!groups[g].is_object() || !groups[g].contains("params") ||
          !groups[g].at("params").is_array()) {
        return DataLossError(fmt::format("{}: no 'params' list", gwhere));
      }
      for (const nlohmann::json& name : groups[g].at("params")) {
        auto it = name.is_string() ? index.find(name.get<std::string>()) : index.end();
        if (it == index.end()) {
          return DataLossError(fmt::format("{}: {} is not a parameter of the layout", gwhere,
                                           DumpJsonForDisplay(name).substr(0, 120)));
        }
        if (seen[it->second] >= 0) {
          return DataLossError(fmt::format("{}: parameter {} is also in param_groups[{}]", gwhere,
                                           EscapeForTerminal(it->first), seen[it->second]));
        }
        seen[it->second] = static_cast<int>(g);
        group.params.push_back(it->second);
      }
      std::sort(group.params.begin(), group.params.end());
      plan.groups.push_back(std::move(group));
    }
    for (std::size_t i = 0; i < seen.size(); ++i) {
      if (seen[i] < 0) {
        return DataLossError(fmt::format("{}: parameter {} is in no param_group", where,
                                         EscapeForTerminal(layout.params()[i].name)));
      }
    }
  } else {
    Group group;
    group.hyper = defaults;
    for (std::size_t i = 0; i < layout.num_params(); ++i) group.params.push_back(i);
    plan.groups.push_back(std::move(group));
  }
  const auto w = static_cast<std::uint64_t>(world_size);
  for (Group& g : plan.groups) {
    for (std::size_t i : g.params) {
      g.starts.push_back(g.numel);
      g.numel += layout.params()[i].numel;
    }
    g.partition = 2 * ((g.numel + 2 * w - 1) / (2 * w));
  }

  // The loss scaler, as DeepSpeed's classes pickle it (never None: DeepSpeed would install it).
  const nlohmann::json fp16 =
      config.is_object() && config.contains("fp16") ? config.at("fp16") : nlohmann::json::object();
  const std::string fwhere = fmt::format("{}: config fp16", info.path);
  ZINF_ASSIGN_OR_RETURN(const double static_scale, Number(fp16, "loss_scale", 0.0, fwhere));
  ZINF_ASSIGN_OR_RETURN(plan.clip_grad, Number(config, "gradient_clipping", 0.0,
                                               fmt::format("{}: config", info.path)));
  ZINF_ASSIGN_OR_RETURN(plan.ds_config, ToPy(config.is_object() ? config : nlohmann::json::object(),
                                             /*exact_integers=*/false, 0, "the stored config"));
  ZINF_ASSIGN_OR_RETURN(plan.user, UserEntries(info));
  const bool fp16_on = Boolean(fp16, "enabled", false);
  if (fp16_on && static_scale == 0.0) {
    ZINF_ASSIGN_OR_RETURN(const std::int64_t power,
                          Integer(fp16, "initial_scale_power", 16, fwhere));
    ZINF_ASSIGN_OR_RETURN(const std::int64_t window,
                          Integer(fp16, "loss_scale_window", 1000, fwhere));
    ZINF_ASSIGN_OR_RETURN(const std::int64_t hysteresis, Integer(fp16, "hysteresis", 2, fwhere));
    ZINF_ASSIGN_OR_RETURN(const double min_scale, Number(fp16, "min_loss_scale", 1.0, fwhere));
    const nlohmann::json saved = trainer.is_object() && trainer.contains("loss_scaler")
                                     ? trainer.at("loss_scaler")
                                     : nlohmann::json::object();
    const std::string swhere = where + " loss_scaler";
    ZINF_ASSIGN_OR_RETURN(
        const double scale,
        Number(saved, "scale",
               std::ldexp(1.0, static_cast<int>(std::clamp<std::int64_t>(power, 0, 64))), swhere));
    ZINF_ASSIGN_OR_RETURN(const std::int64_t iteration, Integer(saved, "iteration", 0, swhere));
    ZINF_ASSIGN_OR_RETURN(const std::int64_t last_overflow,
                          Integer(saved, "last_overflow_iteration", -1, swhere));
    ZINF_ASSIGN_OR_RETURN(const std::int64_t left,
                          Integer(saved, "hysteresis", hysteresis, swhere));
    plan.dynamic_loss_scale = true;
    plan.loss_scaler = PyObject{
        .module = "deepspeed.runtime.fp16.loss_scaler",
        .name = "DynamicLossScaler",
        .state = std::make_shared<PyValue>(
            Dict()
                .Add("cur_scale", Float(scale))
                .Add("cur_iter", Int(iteration))
                .Add("last_overflow_iter", Int(last_overflow))
                .Add("scale_factor", Float(2.0))
                .Add("scale_window", Int(window))
                .Add("min_scale", Float(min_scale))
                .Add("delayed_shift", Int(hysteresis))
                .Add("cur_hysteresis", Int(left))
                .Add("consecutive_hysteresis", Bool(Boolean(fp16, "consecutive_hysteresis", false)))
                .Add("raise_error_at_min_scale", Bool(true))
                .Add("dtype", PyValue(PyDtype{"float16"}))
                .Add("dynamic", Bool(true))
                .Done())};
  } else {
    plan.loss_scaler = PyObject{.module = "deepspeed.runtime.fp16.loss_scaler",
                                .name = "LossScaler",
                                .state = std::make_shared<PyValue>(
                                    Dict()
                                        .Add("cur_scale", Float(fp16_on ? static_scale : 1.0))
                                        .Add("dynamic", Bool(false))
                                        .Done())};
  }
  return plan;
}

// Elements [begin, begin + out.size()) of group `g`'s flat vector of `state`, zeros past its
// end (the padding).
Status ReadGroup(CheckpointStateReader& reader, const partition::ParamLayout& layout,
                 const Group& g, StateTensor state, std::uint64_t begin, std::span<float> out) {
  while (!out.empty()) {
    if (begin >= g.numel) {
      std::fill(out.begin(), out.end(), 0.0f);
      return OkStatus();
    }
    // The last parameter starting at or before `begin` holds it (see the file's comment).
    const auto it = std::upper_bound(g.starts.begin(), g.starts.end(), begin) - 1;
    const std::size_t j = static_cast<std::size_t>(it - g.starts.begin());
    const partition::ParamInfo& p = layout.params()[g.params[j]];
    const std::uint64_t in_param = begin - *it;
    const std::uint64_t n = std::min<std::uint64_t>(out.size(), p.numel - in_param);
    ZINF_RETURN_IF_ERROR(reader.Read(state, p.flat_offset + in_param, out.first(n)));
    out = out.subspan(n);
    begin += n;
  }
  return OkStatus();
}

std::string FileStem(std::string_view file) { return std::string(file.substr(0, file.rfind('.'))); }

// Removes the temporary directory unless it was renamed into place.
struct TempDirGuard {
  std::string path;
  bool keep = false;
  ~TempDirGuard() {
    if (!keep && !path.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  }
};

Status CheckTag(const std::string& tag) {
  const bool ok = !tag.empty() && tag.size() <= 255 && tag != "." && tag != ".." &&
                  std::all_of(tag.begin(), tag.end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                           (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-' || c == '+' ||
                           c == '=';
                  });
  if (!ok) {
    return InvalidArgumentError(fmt::format(
        "deepspeed export: tag '{}' is not one path component of letters, digits and . _ - + = "
        "(at most 255)",
        EscapeForTerminal(tag.substr(0, 80))));
  }
  return OkStatus();
}

// out_dir is missing (its parent a directory) or an empty directory (not a link).
Status CheckOutDir(const std::string& out_dir, const storage::DirAndName& parts) {
  struct stat st {};
  if (::lstat(out_dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return ErrnoError(errno, fmt::format("deepspeed export: {}", out_dir));
    struct stat pst {};
    if (::stat(parts.dir.c_str(), &pst) != 0) {
      return ErrnoError(errno, fmt::format("deepspeed export: parent of {}", out_dir));
    }
    if (!S_ISDIR(pst.st_mode)) {
      return FailedPreconditionError(
          fmt::format("deepspeed export: {} is not a directory", parts.dir));
    }
    return OkStatus();
  }
  if (!S_ISDIR(st.st_mode)) {
    return FailedPreconditionError(fmt::format(
        "deepspeed export: {} exists and is not a directory (the output must be a new or empty "
        "directory)",
        out_dir));
  }
  ZINF_ASSIGN_OR_RETURN(storage::UniqueFd dir,
                        storage::OpenDirectory(out_dir, storage::Follow::kNo));
  ZINF_ASSIGN_OR_RETURN(storage::DirectoryListing listing,
                        storage::ListDirectory(dir.get(), out_dir, 1));
  if (!listing.names.empty()) {
    return FailedPreconditionError(fmt::format(
        "deepspeed export: {} exists and is not empty (the output must be a new or empty "
        "directory)",
        out_dir));
  }
  return OkStatus();
}

// A parameter name as a directory of the universal layout (zero/<name>/): one path component,
// not optimizer_state.pt (the file beside the directories), printable.
Status CheckUniversalName(std::string_view name) {
  const bool ok = !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
                  name != "optimizer_state.pt" && std::all_of(name.begin(), name.end(), [](char c) {
                    const auto u = static_cast<unsigned char>(c);
                    return c != '/' && u >= 0x20 && u != 0x7f;
                  });
  if (!ok) {
    return InvalidArgumentError(fmt::format(
        "deepspeed-universal export: parameter name '{}' cannot be a directory name of the "
        "universal layout (zero/<name>/): it must be one path component of 1 to 255 bytes, not "
        "'.', '..' or 'optimizer_state.pt', without '/' or control characters",
        EscapeForTerminal(name.substr(0, 300))));
  }
  return OkStatus();
}

// What the files' writers share: the checkpoint, the plan, the temporary tag directory and the
// progress count.
struct Output {
  CheckpointStateReader& reader;
  const partition::ParamLayout& layout;
  const Plan& plan;
  const DeepSpeedExportOptions& options;
  std::string tag_dir;
  std::uint64_t total_bytes = 0;
  std::uint64_t done_bytes = 0;

  void Count(std::uint64_t numel) {
    done_bytes += numel * sizeof(float);
    if (options.progress) options.progress(done_bytes, total_bytes);
  }
  // Parameter `p`'s elements of `state` as a tensor of its shape, streamed into `w`.
  Result<PyTensor> StreamParam(TorchWriter& w, StateTensor state, const partition::ParamInfo& p) {
    return w.AddFloat32Streaming(
        p.shape, [&](std::uint64_t offset, std::span<float> out) -> Status {
          ZINF_RETURN_IF_ERROR(reader.Read(state, p.flat_offset + offset, out));
          Count(out.size());
          return OkStatus();
        });
  }
};

// base_optimizer_state's param_groups: group g's hyper-parameters, holding index g.
PyValue ParamGroups(const Plan& plan) {
  PyList groups;
  for (std::size_t gi = 0; gi < plan.groups.size(); ++gi) {
    const Hyper& h = plan.groups[gi].hyper;
    groups.items.push_back(
        Dict()
            .Add("lr", Float(h.lr))
            .Add("betas", PyValue(PyTuple{.items = {Float(h.beta1), Float(h.beta2)}}))
            .Add("eps", Float(h.eps))
            .Add("weight_decay", Float(h.weight_decay))
            .Add("bias_correction", Bool(true))
            .Add("adam_w_mode", Bool(plan.adam_w_mode))
            .Add("params", PyValue(PyList{.items = {Int(static_cast<std::int64_t>(gi))}}))
            .Done());
  }
  return PyValue(std::move(groups));
}

// The W optimizer files of the ZeRO 1/2 layout.
Status WriteZeroFiles(Output& o) {
  const Plan& plan = o.plan;
  const int world = o.options.world_size;
  const PyValue version = Str(std::string(kDeepSpeedExportVersion));
  for (int r = 0; r < world; ++r) {
    const std::string name = fmt::format("zero_pp_rank_{}_mp_rank_00_optim_states.pt", r);
    ZINF_ASSIGN_OR_RETURN(
        TorchWriter w,
        TorchWriter::Create(o.tag_dir + "/" + name, storage::Overwrite::kNo, FileStem(name)));
    PyList fp32_groups, paddings, partition_count, mappings;
    PyDict opt_state;
    for (std::size_t gi = 0; gi < plan.groups.size(); ++gi) {
      const Group& g = plan.groups[gi];
      const std::uint64_t lo = static_cast<std::uint64_t>(r) * g.partition;
      const std::uint64_t hi = lo + g.partition;
      const std::uint64_t kept = g.numel > lo ? std::min(g.numel, hi) - lo : 0;
      auto stream = [&](StateTensor state, std::uint64_t numel) -> Result<PyTensor> {
        return w.AddFloat32Streaming(
            {static_cast<std::int64_t>(numel)},
            [&](std::uint64_t offset, std::span<float> out) -> Status {
              ZINF_RETURN_IF_ERROR(ReadGroup(o.reader, o.layout, g, state, lo + offset, out));
              o.Count(out.size());
              return OkStatus();
            });
      };
      ZINF_ASSIGN_OR_RETURN(PyTensor fp32, stream(StateTensor::kFp32, kept));
      ZINF_ASSIGN_OR_RETURN(PyTensor exp_avg, stream(StateTensor::kExpAvg, g.partition));
      ZINF_ASSIGN_OR_RETURN(PyTensor exp_avg_sq, stream(StateTensor::kExpAvgSq, g.partition));
      fp32_groups.items.push_back(PyValue(std::move(fp32)));
      paddings.items.push_back(Int(static_cast<std::int64_t>(g.partition - kept)));
      partition_count.items.push_back(Int(world));
      DictBuilder mapping = Dict(/*ordered=*/true);
      for (std::size_t j = 0; j < g.params.size(); ++j) {
        const partition::ParamInfo& p = o.layout.params()[g.params[j]];
        const std::uint64_t begin = std::max(g.starts[j], lo);
        const std::uint64_t end = std::min(g.starts[j] + p.numel, std::min(hi, g.numel));
        if (begin >= end) continue;
        mapping.Add(p.name,
                    PyObject{.module = "deepspeed.utils.tensor_fragment",
                             .name = "fragment_address",
                             .state = std::make_shared<PyValue>(
                                 Dict()
                                     .Add("numel", Int(static_cast<std::int64_t>(end - begin)))
                                     .Add("start", Int(static_cast<std::int64_t>(begin - lo)))
                                     .Done())});
      }
      mappings.items.push_back(mapping.Done());
      opt_state.items.emplace_back(Int(static_cast<std::int64_t>(gi)),
                                   Dict()
                                       .Add("step", Int(plan.step - plan.skipped_steps))
                                       .Add("exp_avg", PyValue(std::move(exp_avg)))
                                       .Add("exp_avg_sq", PyValue(std::move(exp_avg_sq)))
                                       .Done());
    }
    PyValue sd = Dict()
                     .Add("loss_scaler", plan.loss_scaler)
                     .Add("dynamic_loss_scale", Bool(plan.dynamic_loss_scale))
                     .Add("overflow", Bool(false))
                     .Add("clip_grad", Float(plan.clip_grad))
                     .Add("base_optimizer_state", Dict()
                                                      .Add("state", PyValue(std::move(opt_state)))
                                                      .Add("param_groups", ParamGroups(plan))
                                                      .Done())
                     .Add("single_partition_of_fp32_groups", PyValue(std::move(fp32_groups)))
                     .Add("zero_stage", Int(o.options.stage))
                     .Add("group_paddings", PyValue(std::move(paddings)))
                     .Add("partition_count", PyValue(std::move(partition_count)))
                     .Add("ds_version", version)
                     .Add("param_slice_mappings", PyValue(std::move(mappings)))
                     .Done();
    ZINF_RETURN_IF_ERROR(w.Finish(Dict()
                                      .Add("optimizer_state_dict", std::move(sd))
                                      .Add("ds_config", plan.ds_config)
                                      .Add("ds_version", version)
                                      .Done()));
  }
  return OkStatus();
}

// The universal layout's zero/ directory: what ds_to_universal writes from the ZeRO 1/2 files
// (its _save_optimizer_state: rank 0's state dict less the sharded keys, after its ZeRO
// checkpoint reader cleared the paddings and set partition_count to [W] * G; its merge: each
// parameter's states whole, in its shape, cat_dim 0, and the step).
Status WriteUniversalFiles(Output& o) {
  const Plan& plan = o.plan;
  const std::string zero_dir = o.tag_dir + "/zero";
  if (::mkdir(zero_dir.c_str(), 0755) != 0) {
    return ErrnoError(errno, fmt::format("deepspeed export: mkdir {}", zero_dir));
  }
  {
    PyList paddings, partition_count;
    for (std::size_t gi = 0; gi < plan.groups.size(); ++gi) {
      paddings.items.push_back(Int(0));
      partition_count.items.push_back(Int(o.options.world_size));
    }
    ZINF_ASSIGN_OR_RETURN(TorchWriter w,
                          TorchWriter::Create(zero_dir + "/optimizer_state.pt",
                                              storage::Overwrite::kNo, "optimizer_state"));
    ZINF_RETURN_IF_ERROR(w.Finish(Dict()
                                      .Add("loss_scaler", plan.loss_scaler)
                                      .Add("dynamic_loss_scale", Bool(plan.dynamic_loss_scale))
                                      .Add("overflow", Bool(false))
                                      .Add("clip_grad", Float(plan.clip_grad))
                                      .Add("zero_stage", Int(o.options.stage))
                                      .Add("group_paddings", PyValue(std::move(paddings)))
                                      .Add("partition_count", PyValue(std::move(partition_count)))
                                      .Add("ds_version", Str(std::string(kDeepSpeedExportVersion)))
                                      .Add("param_groups", ParamGroups(plan))
                                      .Done()));
  }
  constexpr std::pair<StateTensor, std::string_view> kStates[] = {
      {StateTensor::kFp32, "fp32"},
      {StateTensor::kExpAvg, "exp_avg"},
      {StateTensor::kExpAvgSq, "exp_avg_sq"}};
  const PyValue step = Int(plan.step - plan.skipped_steps);
  for (const partition::ParamInfo& p : o.layout.params()) {
    const std::string dir = zero_dir + "/" + p.name;
    if (::mkdir(dir.c_str(), 0755) != 0) {
      return ErrnoError(errno, fmt::format("deepspeed export: mkdir {}", EscapeForTerminal(dir)));
    }
    for (const auto& [state, stem] : kStates) {
      ZINF_ASSIGN_OR_RETURN(TorchWriter w,
                            TorchWriter::Create(fmt::format("{}/{}.pt", dir, stem),
                                                storage::Overwrite::kNo, std::string(stem)));
      ZINF_ASSIGN_OR_RETURN(PyTensor t, o.StreamParam(w, state, p));
      ZINF_RETURN_IF_ERROR(
          w.Finish(Dict().Add("cat_dim", Int(0)).Add("param", PyValue(std::move(t))).Done()));
    }
    ZINF_ASSIGN_OR_RETURN(TorchWriter w,
                          TorchWriter::Create(dir + "/step.pt", storage::Overwrite::kNo, "step"));
    ZINF_RETURN_IF_ERROR(w.Finish(step));
  }
  return storage::SyncDirectory(zero_dir);
}

// mp_rank_00_model_states.pt: the fp32 weights per parameter, the shapes per group, the
// counters, then the user's keys (client state).
Status WriteModelFile(Output& o) {
  const Plan& plan = o.plan;
  const std::string name = "mp_rank_00_model_states.pt";
  ZINF_ASSIGN_OR_RETURN(
      TorchWriter w,
      TorchWriter::Create(o.tag_dir + "/" + name, storage::Overwrite::kNo, FileStem(name)));
  DictBuilder module = Dict(/*ordered=*/true);
  for (const partition::ParamInfo& p : o.layout.params()) {
    ZINF_ASSIGN_OR_RETURN(PyTensor t, o.StreamParam(w, StateTensor::kFp32, p));
    module.Add(p.name, PyValue(std::move(t)));
  }
  PyList shapes;
  for (const Group& g : plan.groups) {
    DictBuilder d = Dict(/*ordered=*/true);
    for (std::size_t i : g.params) {
      const partition::ParamInfo& p = o.layout.params()[i];
      PyTuple size{.items = {}, .torch_size = true};
      for (std::int64_t s : p.shape) size.items.push_back(Int(s));
      d.Add(p.name, PyValue(std::move(size)));
    }
    shapes.items.push_back(d.Done());
  }
  const std::int64_t applied = plan.step - plan.skipped_steps;
  DictBuilder root =
      Dict()
          .Add("module", module.Done())
          .Add("buffer_names", PyValue(PyList{}))
          .Add("optimizer", PyValue(PyNone{}))
          .Add("param_shapes", PyValue(std::move(shapes)))
          .Add("frozen_param_shapes", PyValue(PyNone{}))
          .Add("frozen_param_fragments", PyValue(PyNone{}))
          .Add("shared_params", Dict().Done())
          .Add("lr_scheduler", Dict().Add("last_batch_iteration", Int(applied - 1)).Done())
          .Add("data_sampler", PyValue(PyNone{}))
          .Add("random_ltd", PyValue(PyNone{}))
          .Add("skipped_steps", Int(plan.skipped_steps))
          .Add("global_steps", Int(plan.step))
          .Add("global_samples", Int(plan.global_samples))
          .Add("dp_world_size", Int(o.options.world_size))
          .Add("mp_world_size", Int(1))
          .Add("checkpoint_parallel_dimensions",
               Dict().Add("pp_degree", Int(1)).Add("tp_degree", Int(1)).Done())
          .Add("ds_config", plan.ds_config)
          .Add("ds_version", Str(std::string(kDeepSpeedExportVersion)))
          .Add("universal_checkpoint_info",
               Dict().Add("universal_checkpoint_version", Float(0.4)).Done());
  for (const auto& [key, value] : plan.user) root.Add(key, value);
  return w.Finish(root.Done());
}

}  // namespace

Status ExportDeepSpeed(const std::string& checkpoint_path, const std::string& out_dir,
                       const DeepSpeedExportOptions& options) {
  if (options.world_size < 1 || options.world_size > kMaxDeepSpeedExportWorldSize) {
    return InvalidArgumentError(fmt::format("deepspeed export: world size {} outside [1, {}]",
                                            options.world_size, kMaxDeepSpeedExportWorldSize));
  }
  if (options.stage != 1 && options.stage != 2) {
    return InvalidArgumentError(fmt::format(
        "deepspeed export: stage {}: only ZeRO stage 1 or 2 layouts are written", options.stage));
  }
  if (!options.tag.empty()) ZINF_RETURN_IF_ERROR(CheckTag(options.tag));
  ZINF_ASSIGN_OR_RETURN(const storage::DirAndName parts, storage::SplitPath(out_dir));
  ZINF_RETURN_IF_ERROR(CheckOutDir(out_dir, parts));

  ZINF_ASSIGN_OR_RETURN(CheckpointStateReader reader, CheckpointStateReader::Open(checkpoint_path));
  const CheckpointInfo& info = reader.info();
  if (options.check_info) ZINF_RETURN_IF_ERROR(options.check_info(info));
  const std::string tag =
      options.tag.empty() ? fmt::format("global_step{}", info.step) : options.tag;
  ZINF_RETURN_IF_ERROR(CheckTag(tag));
  const int world = options.world_size;
  ZINF_ASSIGN_OR_RETURN(const Plan plan, MakePlan(info, world));
  const partition::ParamLayout& layout = *info.layout;
  if (options.universal) {
    for (const partition::ParamInfo& p : layout.params()) {
      ZINF_RETURN_IF_ERROR(CheckUniversalName(p.name));
    }
  }

  // Bytes: the model file's weights and, ZeRO 1/2: the W fp32 partitions (the weights again)
  // and the padded moments; universal: the three states once. The pickles are small beside them
  // (a mapping per parameter and rank; universal: four small files per parameter).
  std::uint64_t state_bytes = info.total_numel * sizeof(float);
  std::uint64_t overhead_bytes = 64u << 10;
  if (options.universal) {
    state_bytes += 3 * info.total_numel * sizeof(float);
    overhead_bytes += layout.num_params() * std::uint64_t{40 << 10};
  } else {
    state_bytes += info.total_numel * sizeof(float);
    for (const Group& g : plan.groups) {
      state_bytes += 2 * g.partition * static_cast<std::uint64_t>(world) * sizeof(float);
    }
    overhead_bytes += static_cast<std::uint64_t>(world) * (64u << 10) +
                      layout.num_params() * static_cast<std::uint64_t>(world) * 256;
  }
  const std::uint64_t estimate = state_bytes + overhead_bytes;
  ZINF_ASSIGN_OR_RETURN(const std::uint64_t available, storage::AvailableBytes(parts.dir));
  if (available < estimate) {
    return ResourceExhaustedError(fmt::format("deepspeed export needs about {} in {}, which has {}",
                                              FormatBytes(estimate), parts.dir,
                                              FormatBytes(available)));
  }

  TempDirGuard temp;
  {
    std::string templ = fmt::format("{}/.{}.deepspeed-tmp-XXXXXX", parts.dir, parts.name);
    if (::mkdtemp(templ.data()) == nullptr) {
      return ErrnoError(errno,
                        fmt::format("deepspeed export: creating a directory beside {}", out_dir));
    }
    temp.path = templ;
  }
  // mkdtemp makes it 0700; the output is an ordinary directory.
  if (::chmod(temp.path.c_str(), 0755) != 0) {
    return ErrnoError(errno, fmt::format("deepspeed export: chmod {}", temp.path));
  }
  Output output{.reader = reader,
                .layout = layout,
                .plan = plan,
                .options = options,
                .tag_dir = temp.path + "/" + tag,
                .total_bytes = state_bytes};
  if (::mkdir(output.tag_dir.c_str(), 0755) != 0) {
    return ErrnoError(errno, fmt::format("deepspeed export: mkdir {}", output.tag_dir));
  }
  ZINF_RETURN_IF_ERROR(options.universal ? WriteUniversalFiles(output) : WriteZeroFiles(output));
  ZINF_RETURN_IF_ERROR(WriteModelFile(output));
  ZINF_RETURN_IF_ERROR(reader.Close());

  // DeepSpeed's loader reads `latest`, or `latest_universal` with "load_universal".
  ZINF_RETURN_IF_ERROR(storage::WriteFileAtomic(
      temp.path + (options.universal ? "/latest_universal" : "/latest"), tag));
  ZINF_RETURN_IF_ERROR(storage::SyncDirectory(output.tag_dir));
  ZINF_RETURN_IF_ERROR(storage::SyncDirectory(temp.path));
  // rename(2) replaces an empty directory atomically, and fails (ENOTEMPTY, EEXIST) when
  // something appeared in out_dir meanwhile.
  if (::rename(temp.path.c_str(), out_dir.c_str()) != 0) {
    return ErrnoError(errno,
                      fmt::format("deepspeed export: renaming {} to {}", temp.path, out_dir));
  }
  temp.keep = true;
  return storage::SyncDirectory(parts.dir);
}

}  // namespace zinf::interop
