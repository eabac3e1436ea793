// The pieces of zinf/interop/deepspeed.h's reader that the ZeRO 1/2/3 reading
// (deepspeed_read.cc) and the universal reading (deepspeed_universal.cc) share
// (deepspeed_internal.h): the PyValue tree read with errors that name where, JSON of Python
// values, the Adam step, the loss scaler and param groups of the optimizer state, and the
// model-states file(s): param_shapes, steps, frozen and shared params, the scheduler, ds_config,
// client state, and the params built from them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "deepspeed_internal.h"
#include "text.h"

namespace zinf::interop::deepspeed_internal {
namespace {

constexpr std::string_view kLossScalerModule = "deepspeed.runtime.fp16.loss_scaler";

Result<ModelInfo> ReadModelInfo(const TorchFile& file, const DeepSpeedLimits& limits) {
  const std::string where = file.path();
  ZINF_ASSIGN_OR_RETURN(const PyDict* root, AsDict(file.root(), where));
  ModelInfo info;
  ZINF_ASSIGN_OR_RETURN(info.global_steps, NeedInt(*root, "global_steps", where));
  ZINF_ASSIGN_OR_RETURN(info.skipped_steps, NeedInt(*root, "skipped_steps", where));
  if (info.global_steps < 0 || info.skipped_steps < 0 || info.skipped_steps > info.global_steps) {
    return DataLossError(fmt::format("{}: global_steps {} and skipped_steps {} (0 <= K <= G)",
                                     where, info.global_steps, info.skipped_steps));
  }
  ZINF_ASSIGN_OR_RETURN(const std::vector<PyValue>* shapes,
                        NeedSequence(*root, "param_shapes", where));
  std::uint64_t count = 0;
  for (std::size_t g = 0; g < shapes->size(); ++g) {
    const std::string gw = fmt::format("{}['param_shapes'][{}]", where, g);
    ZINF_ASSIGN_OR_RETURN(const PyDict* d, AsDict((*shapes)[g], gw));
    auto& group = info.flat_groups.emplace_back();
    for (const auto& [key, value] : d->items) {
      const auto* name = key.as<std::string>();
      if (name == nullptr || name->empty()) {
        return DataLossError(fmt::format("{}: a key that is not a parameter name", gw));
      }
      if (++count > limits.max_params) {
        return InvalidArgumentError(
            fmt::format("{}: more than {} parameters", where, limits.max_params));
      }
      ZINF_ASSIGN_OR_RETURN(auto shape,
                            AsShape(value, fmt::format("{}['{}']", gw, Printable(*name, 64))));
      group.push_back({*name, std::move(shape.first), shape.second});
    }
  }
  return info;
}

bool SameModelInfo(const ModelInfo& a, const ModelInfo& b) {
  if (a.global_steps != b.global_steps || a.skipped_steps != b.skipped_steps ||
      a.flat_groups.size() != b.flat_groups.size()) {
    return false;
  }
  for (std::size_t g = 0; g < a.flat_groups.size(); ++g) {
    if (a.flat_groups[g].size() != b.flat_groups[g].size()) return false;
    for (std::size_t i = 0; i < a.flat_groups[g].size(); ++i) {
      if (a.flat_groups[g][i].name != b.flat_groups[g][i].name ||
          a.flat_groups[g][i].shape != b.flat_groups[g][i].shape) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

// ---- the PyValue tree, read with errors that name where ----

Result<const PyDict*> AsDict(const PyValue& v, std::string_view where) {
  const auto* d = v.as<PyDict>();
  if (d == nullptr) return DataLossError(fmt::format("{}: a {}, not a dict", where, v.TypeName()));
  return d;
}
Result<const PyValue*> Need(const PyDict& d, std::string_view key, std::string_view where) {
  const PyValue* v = d.Find(key);
  if (v == nullptr) return DataLossError(fmt::format("{}: no key '{}'", where, key));
  return v;
}
Result<const PyDict*> NeedDict(const PyDict& d, std::string_view key, std::string_view where) {
  ZINF_ASSIGN_OR_RETURN(const PyValue* v, Need(d, key, where));
  return AsDict(*v, fmt::format("{}['{}']", where, key));
}
// A list or a tuple.
Result<const std::vector<PyValue>*> AsSequence(const PyValue& v, std::string_view where) {
  if (const auto* l = v.as<PyList>()) return &l->items;
  if (const auto* t = v.as<PyTuple>()) return &t->items;
  return DataLossError(fmt::format("{}: a {}, not a list", where, v.TypeName()));
}
Result<const std::vector<PyValue>*> NeedSequence(const PyDict& d, std::string_view key,
                                                 std::string_view where) {
  ZINF_ASSIGN_OR_RETURN(const PyValue* v, Need(d, key, where));
  return AsSequence(*v, fmt::format("{}['{}']", where, key));
}
Result<std::int64_t> AsInt(const PyValue& v, std::string_view where) {
  const auto* i = v.as<std::int64_t>();
  if (i == nullptr) return DataLossError(fmt::format("{}: a {}, not an int", where, v.TypeName()));
  return *i;
}
Result<std::int64_t> NeedInt(const PyDict& d, std::string_view key, std::string_view where) {
  ZINF_ASSIGN_OR_RETURN(const PyValue* v, Need(d, key, where));
  return AsInt(*v, fmt::format("{}['{}']", where, key));
}
Result<double> AsNumber(const PyValue& v, std::string_view where) {
  if (const auto* i = v.as<std::int64_t>()) return static_cast<double>(*i);
  if (const auto* f = v.as<double>()) {
    if (!std::isfinite(*f)) return DataLossError(fmt::format("{}: {} is not finite", where, *f));
    return *f;
  }
  return DataLossError(fmt::format("{}: a {}, not a number", where, v.TypeName()));
}
Result<const PyTensor*> AsTensor(const PyValue& v, std::string_view where) {
  const auto* t = v.as<PyTensor>();
  if (t == nullptr)
    return DataLossError(fmt::format("{}: a {}, not a tensor", where, v.TypeName()));
  return t;
}
bool IsNone(const PyValue* v) { return v == nullptr || v->is<PyNone>(); }

// `v` as JSON: None, bool, int, finite float, str, list/tuple, dict with str keys; a dtype as its
// name when `dtype_as_name`. Anything else: InvalidArgument naming where.
Result<nlohmann::json> ToJson(const PyValue& v, const std::string& where, bool dtype_as_name,
                              int depth) {
  if (depth > 100) return InvalidArgumentError(fmt::format("{}: nested too deep", where));
  if (v.is<PyNone>()) return nlohmann::json(nullptr);
  if (const auto* b = v.as<bool>()) return nlohmann::json(*b);
  if (const auto* i = v.as<std::int64_t>()) return nlohmann::json(*i);
  if (const auto* f = v.as<double>()) {
    if (!std::isfinite(*f)) {
      return InvalidArgumentError(fmt::format("{}: {}, which JSON cannot hold", where, *f));
    }
    return nlohmann::json(*f);
  }
  if (const auto* s = v.as<std::string>()) {
    // nlohmann::json refuses to dump invalid UTF-8; check here, where the error can say where.
    nlohmann::json j = *s;
    try {
      (void)j.dump();
    } catch (const nlohmann::json::exception&) {
      return InvalidArgumentError(fmt::format("{}: a str that is not UTF-8", where));
    }
    return j;
  }
  const std::vector<PyValue>* items = nullptr;
  if (const auto* l = v.as<PyList>()) items = &l->items;
  if (const auto* t = v.as<PyTuple>()) items = &t->items;
  if (items != nullptr) {
    nlohmann::json out = nlohmann::json::array();
    for (std::size_t i = 0; i < items->size(); ++i) {
      ZINF_ASSIGN_OR_RETURN(nlohmann::json e, ToJson((*items)[i], fmt::format("{}[{}]", where, i),
                                                     dtype_as_name, depth + 1));
      out.push_back(std::move(e));
    }
    return out;
  }
  if (const auto* d = v.as<PyDict>()) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [key, value] : d->items) {
      const auto* k = key.as<std::string>();
      if (k == nullptr) {
        return InvalidArgumentError(fmt::format(
            "{}: a {} key, which JSON cannot hold (only str keys)", where, key.TypeName()));
      }
      const std::string sub = fmt::format("{}['{}']", where, Printable(*k, 64));
      if (out.contains(*k)) return InvalidArgumentError(fmt::format("{}: a repeated key", sub));
      ZINF_ASSIGN_OR_RETURN(nlohmann::json e, ToJson(value, sub, dtype_as_name, depth + 1));
      // The key's UTF-8 is checked by dumping it.
      nlohmann::json kj = *k;
      try {
        (void)kj.dump();
      } catch (const nlohmann::json::exception&) {
        return InvalidArgumentError(fmt::format("{}: a key that is not UTF-8", where));
      }
      out[*k] = std::move(e);
    }
    return out;
  }
  if (const auto* dt = v.as<PyDtype>(); dt != nullptr && dtype_as_name) {
    return nlohmann::json(dt->name);
  }
  return InvalidArgumentError(fmt::format("{}: a {}, which JSON cannot hold", where, v.TypeName()));
}

// A torch.Size (or tuple / list of non-negative ints) as a shape and its element count.
Result<std::pair<std::vector<std::int64_t>, std::uint64_t>> AsShape(const PyValue& v,
                                                                    std::string_view where) {
  ZINF_ASSIGN_OR_RETURN(const std::vector<PyValue>* dims, AsSequence(v, where));
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 1;
  for (const PyValue& d : *dims) {
    ZINF_ASSIGN_OR_RETURN(std::int64_t n, AsInt(d, where));
    if (n < 0 || __builtin_mul_overflow(numel, static_cast<std::uint64_t>(n), &numel) ||
        numel > (std::uint64_t{1} << 62)) {
      return DataLossError(fmt::format("{}: not a shape of at most 2^62 elements", where));
    }
    shape.push_back(n);
  }
  return std::pair{std::move(shape), numel};
}

std::string ListNames(const std::vector<std::string>& names) {
  std::vector<std::string> shown;
  for (std::size_t i = 0; i < names.size() && i < kMaxListed; ++i) {
    shown.push_back(Printable(names[i], kMaxName));
  }
  return fmt::format("{}{}", fmt::join(shown, ", "), names.size() > kMaxListed ? ", ..." : "");
}

// ---- steps and scalers ----

// An Adam step: an int, or a 0-dim int64 / float tensor holding a whole number >= 0.
Result<std::int64_t> ReadStep(const TorchFile& file, const PyValue& v, const std::string& where) {
  if (const auto* i = v.as<std::int64_t>()) {
    if (*i < 0) return DataLossError(fmt::format("{}: step {} < 0", where, *i));
    return *i;
  }
  if (const auto* f = v.as<double>()) {
    if (!(*f >= 0 && *f < 9007199254740992.0 && std::floor(*f) == *f)) {
      return DataLossError(fmt::format("{}: step {} is not a whole number >= 0", where, *f));
    }
    return static_cast<std::int64_t>(*f);
  }
  const auto* t = v.as<PyTensor>();
  if (t == nullptr) {
    return DataLossError(
        fmt::format("{}: step is a {}, not an int or tensor", where, v.TypeName()));
  }
  if (!t->shape.empty() && !(t->shape.size() == 1 && t->shape[0] == 1)) {
    return DataLossError(fmt::format("{}: step is a tensor of shape [{}], not 0-dim", where,
                                     fmt::join(t->shape, ", ")));
  }
  if (t->dtype == "int64") {
    auto values = file.ReadInt64(*t, 1);
    if (!values) return std::move(values).error().WithContext(where + ": step: ");
    if (values->size() != 1 || (*values)[0] < 0) {
      return DataLossError(fmt::format("{}: step tensor is not one value >= 0", where));
    }
    return (*values)[0];
  }
  auto values = file.ReadFloat32(*t, 1);
  if (!values) return std::move(values).error().WithContext(where + ": step: ");
  const float s = values->size() == 1 ? (*values)[0] : -1.0f;
  if (!(s >= 0 && s < 16777216.0f && std::floor(s) == s)) {
    return DataLossError(
        fmt::format("{}: step tensor holds {}, not a whole number >= 0 below 2^24", where, s));
  }
  return static_cast<std::int64_t>(s);
}

Result<DeepSpeedLossScaler> ReadLossScaler(const PyDict& osd, const std::string& where) {
  DeepSpeedLossScaler out;
  const PyValue* v = osd.Find("loss_scaler");
  if (IsNone(v)) return out;
  const std::string w = where + "['loss_scaler']";
  const auto* obj = v->as<PyObject>();
  if (obj == nullptr || obj->module != kLossScalerModule ||
      (obj->name != "LossScaler" && obj->name != "DynamicLossScaler")) {
    return DataLossError(
        fmt::format("{}: a {}, not DeepSpeed's LossScaler or DynamicLossScaler", w, v->TypeName()));
  }
  if (obj->state == nullptr) return DataLossError(fmt::format("{}: no state", w));
  ZINF_ASSIGN_OR_RETURN(const PyDict* state, AsDict(*obj->state, w + ".__dict__"));
  ZINF_ASSIGN_OR_RETURN(out.state, ToJson(*obj->state, w + ".__dict__", true));
  const std::string sw = w + ".__dict__";
  ZINF_ASSIGN_OR_RETURN(const PyValue* scale, Need(*state, "cur_scale", sw));
  ZINF_ASSIGN_OR_RETURN(out.scale, AsNumber(*scale, sw + "['cur_scale']"));
  if (!(out.scale > 0)) {
    return DataLossError(fmt::format("{}['cur_scale']: {} is not > 0", sw, out.scale));
  }
  if (obj->name == "LossScaler") {
    out.kind = DeepSpeedLossScaler::Kind::kStatic;
    return out;
  }
  out.kind = DeepSpeedLossScaler::Kind::kDynamic;
  ZINF_ASSIGN_OR_RETURN(out.iteration, NeedInt(*state, "cur_iter", sw));
  ZINF_ASSIGN_OR_RETURN(out.last_overflow_iteration, NeedInt(*state, "last_overflow_iter", sw));
  ZINF_ASSIGN_OR_RETURN(out.hysteresis, NeedInt(*state, "cur_hysteresis", sw));
  return out;
}

bool SameScaler(const DeepSpeedLossScaler& a, const DeepSpeedLossScaler& b) {
  return a.kind == b.kind && a.state == b.state;
}

Result<DeepSpeedOptimizerGroup> ReadOptimizerGroup(const PyValue& v, const std::string& where) {
  ZINF_ASSIGN_OR_RETURN(const PyDict* d, AsDict(v, where));
  DeepSpeedOptimizerGroup g;
  g.options = nlohmann::json::object();
  for (std::string_view key : {"lr", "betas", "eps", "weight_decay"}) {
    if (d->Find(key) == nullptr) {
      return InvalidArgumentError(fmt::format(
          "{}: no '{}': not an Adam optimizer's param group (zinf imports Adam/AdamW state)", where,
          key));
    }
  }
  ZINF_ASSIGN_OR_RETURN(g.lr, AsNumber(*d->Find("lr"), where + "['lr']"));
  ZINF_ASSIGN_OR_RETURN(g.eps, AsNumber(*d->Find("eps"), where + "['eps']"));
  ZINF_ASSIGN_OR_RETURN(g.weight_decay,
                        AsNumber(*d->Find("weight_decay"), where + "['weight_decay']"));
  ZINF_ASSIGN_OR_RETURN(const std::vector<PyValue>* betas,
                        AsSequence(*d->Find("betas"), where + "['betas']"));
  if (betas->size() != 2) {
    return DataLossError(fmt::format("{}['betas']: {} values, not 2", where, betas->size()));
  }
  ZINF_ASSIGN_OR_RETURN(g.beta1, AsNumber((*betas)[0], where + "['betas'][0]"));
  ZINF_ASSIGN_OR_RETURN(g.beta2, AsNumber((*betas)[1], where + "['betas'][1]"));
  for (const auto& [key, value] : d->items) {
    const auto* k = key.as<std::string>();
    if (k == nullptr) {
      return DataLossError(fmt::format("{}: a {} key", where, key.TypeName()));
    }
    if (*k == "params" || *k == "lr" || *k == "betas" || *k == "eps" || *k == "weight_decay") {
      continue;
    }
    ZINF_ASSIGN_OR_RETURN(g.options[*k],
                          ToJson(value, fmt::format("{}['{}']", where, Printable(*k, 64)), true));
  }
  return g;
}

bool SameGroup(const DeepSpeedOptimizerGroup& a, const DeepSpeedOptimizerGroup& b) {
  return a.saved == b.saved && a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 &&
         a.eps == b.eps && a.weight_decay == b.weight_decay && a.options == b.options;
}

// A 1-dim float32 tensor of `numel` elements with stride 1.
Status CheckFlat(const PyTensor& t, std::uint64_t numel, const std::string& where) {
  if (t.dtype != "float32") {
    return DataLossError(fmt::format("{}: a {} tensor, not float32", where, Printable(t.dtype)));
  }
  if (t.shape.size() != 1 || t.stride.size() != 1 || (t.shape[0] > 1 && t.stride[0] != 1)) {
    return DataLossError(fmt::format("{}: a tensor of shape [{}] stride [{}], not a flat 1-dim one",
                                     where, fmt::join(t.shape, ", "), fmt::join(t.stride, ", ")));
  }
  if (static_cast<std::uint64_t>(t.shape[0]) != numel) {
    return DataLossError(
        fmt::format("{}: {} elements, the layout gives {}", where, t.shape[0], numel));
  }
  return OkStatus();
}

Status CheckAdamStateKeys(const PyDict& state, const std::string& where) {
  for (const auto& [k, v] : state.items) {
    const auto* key = k.as<std::string>();
    if (key == nullptr || (*key != "step" && *key != "exp_avg" && *key != "exp_avg_sq")) {
      return InvalidArgumentError(fmt::format(
          "{}: optimizer state '{}', which zinf does not import (it imports Adam's step, "
          "exp_avg and exp_avg_sq)",
          where, key != nullptr ? Printable(*key, 64) : k.TypeName()));
    }
  }
  return OkStatus();
}

// What ReadParam returns must be finite, and a second moment >= 0.
Status CheckValues(const std::string& tag_dir, const DeepSpeedParam& p,
                   DeepSpeedCheckpoint::Field field, std::uint64_t offset,
                   std::span<const float> values) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float v = values[i];
    if (!std::isfinite(v) || (field == DeepSpeedCheckpoint::Field::kExpAvgSq && v < 0)) {
      return DataLossError(fmt::format(
          "{}: param '{}' {}: element {} is {}{}", tag_dir, Printable(p.name, kMaxName),
          kFieldNames[static_cast<std::size_t>(field)], offset + i, v,
          std::isfinite(v) ? " (a negative second moment)" : " (not finite); not imported"));
    }
  }
  return OkStatus();
}

// The stage of `osd['zero_stage']` (1..3), or nullopt without the key (BF16_Optimizer).
Result<std::optional<std::int64_t>> ReadZeroStage(const PyDict& osd, const std::string& where) {
  std::optional<std::int64_t> stage;
  if (const PyValue* s = osd.Find("zero_stage"); s != nullptr) {
    ZINF_ASSIGN_OR_RETURN(stage, AsInt(*s, where + "['zero_stage']"));
    if (*stage < 1 || *stage > 3) {
      return InvalidArgumentError(
          fmt::format("{}['zero_stage']: {}, not a ZeRO stage 1..3", where, *stage));
    }
  }
  return stage;
}

// ---- the model file(s) ----

Result<Models> ReadModels(const TagFiles& found, int tag_fd, const std::string& tag_dir, int stage,
                          std::uint64_t w, std::string_view beside, const DeepSpeedLimits& limits) {
  Models out;
  std::vector<ModelFile>& models = out.files;
  if (stage == 3) {
    if (found.model12) {
      return DataLossError(fmt::format("{}/{}: a stage 1/2 model file beside stage 3 {}", tag_dir,
                                       Printable(*found.model12), beside));
    }
    if (found.model3.empty()) {
      return NotFoundError(fmt::format(
          "{}: no zero_pp_rank_<r>_mp_rank_00_model_states.pt (a stage 3 checkpoint has one per "
          "rank)",
          tag_dir));
    }
    ZINF_RETURN_IF_ERROR(CheckRanks(found.model3, tag_dir, "model", limits.max_world_size, w));
    for (const auto& [rank, name] : found.model3) {
      ZINF_ASSIGN_OR_RETURN(
          TorchFile file,
          TorchFile::ReadAt(tag_fd, name, fmt::format("{}/{}", tag_dir, name), limits.pickle));
      models.push_back({name, std::move(file)});
    }
  } else {
    if (!found.model3.empty()) {
      return DataLossError(fmt::format("{}/{}: a stage 3 model file beside stage {} {}", tag_dir,
                                       Printable(found.model3.begin()->second), stage, beside));
    }
    if (!found.model12) {
      return NotFoundError(fmt::format("{}: no mp_rank_00_model_states.pt", tag_dir));
    }
    ZINF_ASSIGN_OR_RETURN(
        TorchFile file,
        TorchFile::ReadAt(tag_fd, *found.model12, fmt::format("{}/{}", tag_dir, *found.model12),
                          limits.pickle));
    models.push_back({*found.model12, std::move(file)});
  }
  ZINF_ASSIGN_OR_RETURN(out.info, ReadModelInfo(models[0].file, limits));
  for (std::size_t r = 1; r < models.size(); ++r) {
    ZINF_ASSIGN_OR_RETURN(ModelInfo other, ReadModelInfo(models[r].file, limits));
    if (!SameModelInfo(out.info, other)) {
      return DataLossError(fmt::format(
          "{}: param_shapes, global_steps or skipped_steps differ from rank 0's model file",
          models[r].file.path()));
    }
  }
  return out;
}

// What the model file holds besides the shapes: the steps, frozen and shared params, the
// scheduler's position.
Status ReadModelState(CheckpointState& m, const ModelInfo& info, const TorchFile& model,
                      const PyDict& mroot) {
  m.global_steps = info.global_steps;
  m.skipped_steps = info.skipped_steps;
  if (info.flat_groups.empty()) {
    return DataLossError(fmt::format("{}: param_shapes is empty", model.path()));
  }
  // Frozen parameters are not imported; shared ones are reported.
  if (const PyValue* frozen = mroot.Find("frozen_param_shapes"); !IsNone(frozen)) {
    ZINF_ASSIGN_OR_RETURN(const PyDict* d,
                          AsDict(*frozen, model.path() + "['frozen_param_shapes']"));
    if (!d->items.empty()) {
      std::vector<std::string> names;
      for (const auto& [k, v] : d->items) {
        names.push_back(k.as<std::string>() != nullptr ? *k.as<std::string>() : k.TypeName());
      }
      return InvalidArgumentError(fmt::format(
          "{}: {} frozen parameters ({}); zinf imports only checkpoints whose parameters all "
          "train",
          model.path(), d->items.size(), ListNames(names)));
    }
  }
  if (const PyValue* shared = mroot.Find("shared_params"); !IsNone(shared)) {
    const std::string sw = model.path() + "['shared_params']";
    ZINF_ASSIGN_OR_RETURN(const PyDict* d, AsDict(*shared, sw));
    for (const auto& [k, v] : d->items) {
      const auto* alias = k.as<std::string>();
      const auto* owner = v.as<std::string>();
      if (alias == nullptr || owner == nullptr) {
        return DataLossError(fmt::format("{}: an entry that is not str -> str", sw));
      }
      m.shared.emplace_back(*alias, *owner);
    }
  }
  if (const PyValue* sched = mroot.Find("lr_scheduler"); !IsNone(sched)) {
    if (const auto* d = sched->as<PyDict>(); d != nullptr) {
      if (const PyValue* lbi = d->Find("last_batch_iteration"); lbi != nullptr) {
        ZINF_ASSIGN_OR_RETURN(
            m.last_batch_iteration,
            AsInt(*lbi, model.path() + "['lr_scheduler']['last_batch_iteration']"));
        const std::int64_t want = m.global_steps - m.skipped_steps - 1;
        if (*m.last_batch_iteration != want) {
          return DataLossError(fmt::format(
              "{}: lr_scheduler last_batch_iteration {}, but global_steps {} - skipped_steps {} "
              "- 1 = {}",
              model.path(), *m.last_batch_iteration, m.global_steps, m.skipped_steps, want));
        }
      }
    }
  }

  return OkStatus();
}

Result<ParamGroups> ReadParamGroups(const std::vector<PyValue>& param_groups, std::size_t flats,
                                    const std::string& state_where) {
  std::vector<std::size_t> owner(flats, SIZE_MAX);
  std::vector<DeepSpeedOptimizerGroup> groups;
  for (std::size_t i = 0; i < param_groups.size(); ++i) {
    const std::string gw = fmt::format("{}['param_groups'][{}]", state_where, i);
    ZINF_ASSIGN_OR_RETURN(DeepSpeedOptimizerGroup g, ReadOptimizerGroup(param_groups[i], gw));
    groups.push_back(std::move(g));
    ZINF_ASSIGN_OR_RETURN(const std::vector<PyValue>* ids,
                          NeedSequence(*param_groups[i].as<PyDict>(), "params", gw));
    for (const PyValue& id : *ids) {
      ZINF_ASSIGN_OR_RETURN(std::int64_t flat, AsInt(id, gw + "['params']"));
      if (flat < 0 || static_cast<std::uint64_t>(flat) >= flats ||
          owner[static_cast<std::size_t>(flat)] != SIZE_MAX) {
        return DataLossError(fmt::format(
            "{}['params']: {} is not one of the {} flat groups, or is in two param groups", gw,
            flat, flats));
      }
      owner[static_cast<std::size_t>(flat)] = i;
    }
  }
  for (std::size_t s = 0; s < flats; ++s) {
    if (owner[s] == SIZE_MAX) {
      return DataLossError(
          fmt::format("{}['param_groups']: no group holds flat group {}", state_where, s));
    }
  }
  return ParamGroups{std::move(groups), std::move(owner)};
}

// ds_config: `config` (the optimizer files'), else the model file's; null when neither has one.
Status ReadDsConfig(CheckpointState& m, const PyValue* config, std::string cw,
                    const TorchFile& model, const PyDict& mroot) {
  if (IsNone(config)) {
    config = mroot.Find("ds_config");
    cw = model.path() + "['ds_config']";
  }
  if (!IsNone(config)) {
    if (!config->is<PyDict>()) {
      return InvalidArgumentError(fmt::format("{}: a {}, not a dict", cw, config->TypeName()));
    }
    ZINF_ASSIGN_OR_RETURN(m.ds_config, ToJson(*config, cw, false));
  }
  return OkStatus();
}

// The client state: the model file's keys DeepSpeed does not own.
void ReadClientState(CheckpointState& m, const TorchFile& model, const PyDict& mroot) {
  for (const auto& [key, value] : mroot.items) {
    const auto* k = key.as<std::string>();
    if (k == nullptr || std::find(kDeepSpeedModelKeys.begin(), kDeepSpeedModelKeys.end(), *k) !=
                            kDeepSpeedModelKeys.end()) {
      continue;
    }
    Result<nlohmann::json> j =
        ToJson(value, fmt::format("{}['{}']", model.path(), Printable(*k, 64)), false);
    nlohmann::json kj = *k;
    bool utf8 = true;
    try {
      (void)kj.dump();
    } catch (const nlohmann::json::exception&) {
      utf8 = false;
    }
    if (j && utf8 && !m.client_state.contains(*k)) {
      m.client_state[*k] = *std::move(j);
    } else {
      m.client_state_skipped.push_back(Printable(*k, 64));
    }
  }
}

// The params (m.params, m.where) from param_shapes, in module order when module holds them all,
// else in param_shapes order; their dtype from module.
Status BuildParams(CheckpointState& m, const ModelInfo& info, const TorchFile& model,
                   const PyDict& mroot, const std::vector<std::size_t>& group_of_flat) {
  const std::size_t flats = info.flat_groups.size();
  const std::uint64_t w = m.world;
  std::map<std::string_view, std::pair<std::size_t, const PyTensor*>> module_pos;
  if (const PyValue* module = mroot.Find("module"); !IsNone(module)) {
    ZINF_ASSIGN_OR_RETURN(const PyDict* d, AsDict(*module, model.path() + "['module']"));
    for (std::size_t i = 0; i < d->items.size(); ++i) {
      const auto* k = d->items[i].first.as<std::string>();
      if (k != nullptr) module_pos.emplace(*k, std::pair{i, d->items[i].second.as<PyTensor>()});
    }
  }
  std::set<std::string_view> names;
  bool all_in_module = true;
  std::string dtype;
  std::string dtype_from;
  for (std::size_t s = 0; s < flats; ++s) {
    std::uint64_t offset = 0;
    for (const ModelInfo::Shape& shape : info.flat_groups[s]) {
      if (!names.insert(shape.name).second) {
        return DataLossError(fmt::format("{}: param_shapes names '{}' twice", model.path(),
                                         Printable(shape.name, kMaxName)));
      }
      DeepSpeedParam p{.name = shape.name,
                       .shape = shape.shape,
                       .dtype = "",
                       .numel = shape.numel,
                       .group = group_of_flat[s]};
      auto it = module_pos.find(shape.name);
      if (it == module_pos.end() || it->second.second == nullptr) {
        all_in_module = false;
      } else {
        const PyTensor& t = *it->second.second;
        p.dtype = t.dtype;
        if (dtype.empty()) {
          dtype = t.dtype;
          dtype_from = shape.name;
        } else if (t.dtype != dtype) {
          return InvalidArgumentError(
              fmt::format("{}: module holds '{}' as {} but '{}' as {}; zinf imports one dtype",
                          model.path(), Printable(shape.name, kMaxName), Printable(t.dtype),
                          Printable(dtype_from, kMaxName), Printable(dtype)));
        }
        std::uint64_t tnumel = 1;
        for (auto d : t.shape) tnumel *= static_cast<std::uint64_t>(d);
        if (t.shape != shape.shape && !(m.stage == 3 && tnumel == 0)) {
          return DataLossError(fmt::format("{}: module['{}'] has shape [{}], param_shapes [{}]",
                                           model.path(), Printable(shape.name, kMaxName),
                                           fmt::join(t.shape, ", "), fmt::join(shape.shape, ", ")));
        }
      }
      m.params.push_back(std::move(p));
      m.where.push_back({s, offset});
      offset += m.stage == 3 ? CeilDiv(shape.numel, w) : shape.numel;
    }
  }
  for (DeepSpeedParam& p : m.params) {
    if (p.dtype.empty()) p.dtype = dtype;
  }
  if (all_in_module && !module_pos.empty()) {
    std::vector<std::size_t> order(m.params.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return module_pos.at(m.params[a].name).first < module_pos.at(m.params[b].name).first;
    });
    std::vector<DeepSpeedParam> params;
    std::vector<CheckpointState::Where> where;
    for (std::size_t i : order) {
      params.push_back(std::move(m.params[i]));
      where.push_back(m.where[i]);
    }
    m.params = std::move(params);
    m.where = std::move(where);
  }

  return OkStatus();
}

}  // namespace zinf::interop::deepspeed_internal
