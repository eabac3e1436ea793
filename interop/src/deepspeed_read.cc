// DeepSpeed ZeRO 1/2/3 checkpoints read (zinf/interop/deepspeed.h): the ranks' optimizer files
// of a tag folder read and checked against each other and the layout, and each param's values
// assembled from the ranks' partitions by ReadParam; and DeepSpeedCheckpoint itself, whose Open
// finds the folder and its files (deepspeed_folder.cc) and reads a universal folder through
// deepspeed_universal.cc. What both kinds share is in deepspeed_internal.h.
#include "zinf/interop/deepspeed.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "deepspeed_internal.h"
#include "text.h"
#include "zinf/interop/torch_file.h"

namespace zinf::interop {
namespace deepspeed_internal {
namespace {

// The param_slice_mappings of rank r's group g must be the params overlapping [lo, hi) of the
// group's flat vector, in param_shapes order, with start relative to lo.
Status CheckSliceMappings(const PyValue& mappings, const std::vector<ModelInfo::Shape>& shapes,
                          std::uint64_t lo, std::uint64_t hi, const std::string& where) {
  ZINF_ASSIGN_OR_RETURN(const PyDict* d, AsDict(mappings, where));
  std::size_t k = 0;
  std::uint64_t offset = 0;
  for (const ModelInfo::Shape& s : shapes) {
    const std::uint64_t a = std::max(offset, lo);
    const std::uint64_t b = std::min(offset + s.numel, hi);
    offset += s.numel;
    if (a >= b) continue;
    bool ok = k < d->items.size();
    if (ok) {
      const auto& [key, value] = d->items[k];
      const auto* name = key.as<std::string>();
      const auto* obj = value.as<PyObject>();
      const PyDict* st =
          obj != nullptr && obj->state != nullptr ? obj->state->as<PyDict>() : nullptr;
      const PyValue* numel = st != nullptr ? st->Find("numel") : nullptr;
      const PyValue* start = st != nullptr ? st->Find("start") : nullptr;
      ok = name != nullptr && *name == s.name && numel != nullptr && start != nullptr &&
           numel->as<std::int64_t>() != nullptr && start->as<std::int64_t>() != nullptr &&
           static_cast<std::uint64_t>(*numel->as<std::int64_t>()) == b - a &&
           static_cast<std::uint64_t>(*start->as<std::int64_t>()) == a - lo;
    }
    if (!ok) {
      return DataLossError(fmt::format(
          "{}: entry {} is not '{}' (numel {}, start {}) as param_shapes' order gives (a run with "
          "zero_optimization.round_robin_gradients is not imported)",
          where, k, Printable(s.name, kMaxName), b - a, a - lo));
    }
    ++k;
  }
  if (k != d->items.size()) {
    return DataLossError(
        fmt::format("{}: {} entries, the layout gives {}", where, d->items.size(), k));
  }
  return OkStatus();
}

// Adds the storage of `t` in `file` to `seen` and checks its CRC once.
Status VerifyOnce(const TorchFile& file, const PyTensor& t, std::set<std::string>& seen) {
  if (!seen.insert(t.storage_key).second) return OkStatus();
  return file.VerifyStorage(t);
}

// The ZeRO 1/2/3 checkpoint in the tag folder `m.tag_dir` (open as `tag_fd`; `found` its files)
// into `m`: the optimizer files (held open for ReadZeroParam) and the model file(s).
Status ReadZero(CheckpointState& m, int tag_fd, const TagFiles& found,
                const DeepSpeedLimits& limits) {
  ZINF_RETURN_IF_ERROR(CheckRanks(found.optim, m.tag_dir, "optimizer", limits.max_world_size));
  m.world = found.optim.size();
  const std::uint64_t w = m.world;

  // The optimizer files: zero_stage, partition_count, group counts.
  std::vector<const PyDict*> osds;
  std::optional<std::int64_t> zero_stage;  // nullopt: no key (BF16_Optimizer)
  for (const auto& [rank, name] : found.optim) {
    // Relative to the folder Open opened: a path could meanwhile lead elsewhere.
    ZINF_ASSIGN_OR_RETURN(
        TorchFile file,
        TorchFile::ReadAt(tag_fd, name, fmt::format("{}/{}", m.tag_dir, name), limits.pickle));
    m.files.push_back(std::move(file));
    const TorchFile& f = m.files.back();
    ZINF_ASSIGN_OR_RETURN(const PyDict* root, AsDict(f.root(), f.path()));
    ZINF_ASSIGN_OR_RETURN(const PyDict* osd, NeedDict(*root, "optimizer_state_dict", f.path()));
    osds.push_back(osd);
    const std::string where = f.path() + ": optimizer_state_dict";
    ZINF_ASSIGN_OR_RETURN(std::optional<std::int64_t> stage, ReadZeroStage(*osd, where));
    if (rank == 0) {
      zero_stage = stage;
    } else if (stage != zero_stage) {
      return DataLossError(fmt::format("{}['zero_stage']: {}, but rank 0's file says {}", where,
                                       stage ? std::to_string(*stage) : "none",
                                       zero_stage ? std::to_string(*zero_stage) : "none"));
    }
  }
  m.bf16 = !zero_stage.has_value();
  m.stage = zero_stage.value_or(1);

  ZINF_ASSIGN_OR_RETURN(
      Models models, ReadModels(found, tag_fd, m.tag_dir, m.stage, w, "optimizer files", limits));
  const ModelInfo& info = models.info;
  const TorchFile& model = models.files[0].file;
  ZINF_ASSIGN_OR_RETURN(const PyDict* mroot, AsDict(model.root(), model.path()));
  const std::size_t flats = info.flat_groups.size();
  ZINF_RETURN_IF_ERROR(ReadModelState(m, info, model, *mroot));

  // The per-file checks of the optimizer state, and the tensors.
  m.tensors.assign(flats, std::vector<std::array<PyTensor, 3>>(w));
  std::optional<std::int64_t> adam_step;
  std::vector<std::size_t> group_of_flat(flats, SIZE_MAX);
  std::vector<std::uint64_t> rank_flat_numel(flats, 0);  // stage 3
  m.flat_numel.resize(flats);
  m.partition.resize(flats);
  for (std::size_t g = 0; g < flats; ++g) {
    std::uint64_t n = 0;
    for (const auto& p : info.flat_groups[g]) {
      n += p.numel;  // each at most 2^62: the sum of two does not wrap
      rank_flat_numel[g] += CeilDiv(p.numel, w);
      if (n > (std::uint64_t{1} << 62)) {
        return InvalidArgumentError(
            fmt::format("{}: param_shapes[{}] holds more than 2^62 elements", model.path(), g));
      }
    }
    m.flat_numel[g] = n;
    m.partition[g] = 2 * CeilDiv(n, 2 * w);
  }
  for (std::uint64_t r = 0; r < w; ++r) {
    const TorchFile& f = m.files[r];
    const PyDict& osd = *osds[r];
    const std::string where = f.path() + ": optimizer_state_dict";
    // partition_count
    ZINF_ASSIGN_OR_RETURN(const PyValue* pc, Need(osd, "partition_count", where));
    if (m.stage == 3) {
      ZINF_ASSIGN_OR_RETURN(std::int64_t count, AsInt(*pc, where + "['partition_count']"));
      if (count < 0 || static_cast<std::uint64_t>(count) != w) {
        return DataLossError(
            fmt::format("{}['partition_count']: {}, but the checkpoint has {} optimizer files",
                        where, count, w));
      }
    } else {
      ZINF_ASSIGN_OR_RETURN(const std::vector<PyValue>* counts,
                            AsSequence(*pc, where + "['partition_count']"));
      if (counts->size() != flats) {
        return DataLossError(fmt::format("{}['partition_count']: {} groups, param_shapes has {}",
                                         where, counts->size(), flats));
      }
      for (const PyValue& c : *counts) {
        ZINF_ASSIGN_OR_RETURN(std::int64_t count, AsInt(c, where + "['partition_count']"));
        if (count < 0 || static_cast<std::uint64_t>(count) != w) {
          return DataLossError(
              fmt::format("{}['partition_count']: {}, but the checkpoint has {} optimizer files",
                          where, count, w));
        }
      }
    }
    // The loss scaler, the same in every file.
    ZINF_ASSIGN_OR_RETURN(DeepSpeedLossScaler scaler, ReadLossScaler(osd, where));
    if (r == 0) {
      m.scaler = std::move(scaler);
    } else if (!SameScaler(scaler, m.scaler)) {
      return DataLossError(fmt::format("{}['loss_scaler']: differs from rank 0's", where));
    }

    // Where the moments and the param groups are.
    const PyDict* state = nullptr;                         // rigid: {flat: {...}}
    const std::vector<PyValue>* elastic_states = nullptr;  // elastic: [{...}] per group
    const std::vector<PyValue>* param_groups = nullptr;
    std::string state_where;
    const std::vector<PyValue>* fp32 = nullptr;
    if (m.stage == 3) {
      ZINF_ASSIGN_OR_RETURN(const PyDict* inner, NeedDict(osd, "optimizer_state_dict", where));
      state_where = where + "['optimizer_state_dict']";
      ZINF_ASSIGN_OR_RETURN(state, NeedDict(*inner, "state", state_where));
      ZINF_ASSIGN_OR_RETURN(param_groups, NeedSequence(*inner, "param_groups", state_where));
      ZINF_ASSIGN_OR_RETURN(fp32, NeedSequence(osd, "fp32_flat_groups", where));
    } else {
      ZINF_ASSIGN_OR_RETURN(const PyValue* base, Need(osd, "base_optimizer_state", where));
      state_where = where + "['base_optimizer_state']";
      if (const auto* list = base->as<PyList>(); list != nullptr) {
        if (m.bf16) {
          return DataLossError(
              fmt::format("{}: a list (elastic) in a BF16_Optimizer file", state_where));
        }
        elastic_states = &list->items;
        if (r == 0) m.elastic = true;
      } else {
        ZINF_ASSIGN_OR_RETURN(const PyDict* base_dict, AsDict(*base, state_where));
        ZINF_ASSIGN_OR_RETURN(state, NeedDict(*base_dict, "state", state_where));
        ZINF_ASSIGN_OR_RETURN(param_groups, NeedSequence(*base_dict, "param_groups", state_where));
        if (r == 0) m.elastic = false;
      }
      if (m.elastic != (elastic_states != nullptr)) {
        return DataLossError(
            fmt::format("{}: elastic in some files, rigid in others", state_where));
      }
      ZINF_ASSIGN_OR_RETURN(fp32, NeedSequence(osd, "single_partition_of_fp32_groups", where));
    }
    const std::string fp32_where =
        where + (m.stage == 3 ? "['fp32_flat_groups']" : "['single_partition_of_fp32_groups']");
    if (fp32->size() != flats) {
      return DataLossError(
          fmt::format("{}: {} groups, param_shapes has {}", fp32_where, fp32->size(), flats));
    }

    // Param groups (rigid): which flat group each holds, and the hyper-parameters.
    if (param_groups != nullptr) {
      ZINF_ASSIGN_OR_RETURN(ParamGroups read, ReadParamGroups(*param_groups, flats, state_where));
      auto& [groups, owner] = read;
      if (r == 0) {
        m.groups = std::move(groups);
        group_of_flat = std::move(owner);
      } else {
        bool same = groups.size() == m.groups.size() && owner == group_of_flat;
        for (std::size_t i = 0; same && i < groups.size(); ++i) {
          same = SameGroup(groups[i], m.groups[i]);
        }
        if (!same) {
          return DataLossError(
              fmt::format("{}['param_groups']: differ from rank 0's", state_where));
        }
      }
    } else if (r == 0) {
      m.groups.assign(flats, DeepSpeedOptimizerGroup{.saved = false, .options = nullptr});
      for (std::size_t g = 0; g < flats; ++g) group_of_flat[g] = g;
    }

    // group_paddings and param_slice_mappings (stage 1/2), when present.
    const std::vector<PyValue>* paddings = nullptr;
    const std::vector<PyValue>* mappings = nullptr;
    if (m.stage != 3) {
      if (osd.Find("group_paddings") != nullptr) {
        ZINF_ASSIGN_OR_RETURN(paddings, NeedSequence(osd, "group_paddings", where));
        if (paddings->size() != flats) {
          return DataLossError(fmt::format("{}['group_paddings']: {} groups, not {}", where,
                                           paddings->size(), flats));
        }
      }
      if (const PyValue* sm = osd.Find("param_slice_mappings"); !IsNone(sm)) {
        ZINF_ASSIGN_OR_RETURN(mappings, NeedSequence(osd, "param_slice_mappings", where));
        if (mappings->size() != flats) {
          return DataLossError(fmt::format("{}['param_slice_mappings']: {} groups, not {}", where,
                                           mappings->size(), flats));
        }
      }
    }

    for (std::size_t g = 0; g < flats; ++g) {
      // Expected lengths.
      std::uint64_t fp32_len = 0;
      std::uint64_t moment_len = 0;
      std::uint64_t valid = 0;  // stage 1/2: this rank's unpadded part
      if (m.stage == 3) {
        fp32_len = moment_len = rank_flat_numel[g];
      } else {
        const std::uint64_t n = m.flat_numel[g];
        const std::uint64_t part = m.partition[g];
        valid = n > r * part ? std::min(part, n - r * part) : 0;
        fp32_len = m.bf16 ? part : valid;
        moment_len = m.elastic ? valid : part;
        if (paddings != nullptr) {
          const std::string pw = fmt::format("{}['group_paddings'][{}]", where, g);
          ZINF_ASSIGN_OR_RETURN(std::int64_t pad, AsInt((*paddings)[g], pw));
          const std::uint64_t want = m.bf16 ? (r == w - 1 ? part * w - n : 0) : part - valid;
          if (pad < 0 || static_cast<std::uint64_t>(pad) != want) {
            return DataLossError(
                fmt::format("{}: {}, the layout (n {}, P {}) gives {}", pw, pad, n, part, want));
          }
        }
        if (mappings != nullptr) {
          ZINF_RETURN_IF_ERROR(
              CheckSliceMappings((*mappings)[g], info.flat_groups[g], r * part, r * part + valid,
                                 fmt::format("{}['param_slice_mappings'][{}]", where, g)));
        }
      }
      const std::string tw = fmt::format("{}[{}]", fp32_where, g);
      ZINF_ASSIGN_OR_RETURN(const PyTensor* t, AsTensor((*fp32)[g], tw));
      ZINF_RETURN_IF_ERROR(CheckFlat(*t, fp32_len, tw));
      m.tensors[g][r][0] = *t;

      // The moments and the step.
      const PyDict* gs = nullptr;
      std::string gsw;
      if (elastic_states != nullptr) {
        if (elastic_states->size() != flats) {
          return DataLossError(
              fmt::format("{}: {} groups, not {}", state_where, elastic_states->size(), flats));
        }
        gsw = fmt::format("{}[{}]", state_where, g);
        ZINF_ASSIGN_OR_RETURN(gs, AsDict((*elastic_states)[g], gsw));
      } else {
        if (state->items.size() != flats) {
          return DataLossError(fmt::format("{}['state']: {} entries, not {} (one per group)",
                                           state_where, state->items.size(), flats));
        }
        const PyValue* entry = nullptr;
        for (const auto& [k, v] : state->items) {
          if (const auto* i = k.as<std::int64_t>();
              i != nullptr && *i == static_cast<std::int64_t>(g)) {
            entry = &v;
          }
        }
        gsw = fmt::format("{}['state'][{}]", state_where, g);
        if (entry == nullptr) return DataLossError(fmt::format("{}: missing", gsw));
        ZINF_ASSIGN_OR_RETURN(gs, AsDict(*entry, gsw));
      }
      ZINF_RETURN_IF_ERROR(CheckAdamStateKeys(*gs, gsw));
      for (std::size_t field = 1; field <= 2; ++field) {
        ZINF_ASSIGN_OR_RETURN(const PyValue* mv, Need(*gs, kFieldNames[field], gsw));
        const std::string mw = fmt::format("{}['{}']", gsw, kFieldNames[field]);
        ZINF_ASSIGN_OR_RETURN(const PyTensor* mt, AsTensor(*mv, mw));
        ZINF_RETURN_IF_ERROR(CheckFlat(*mt, moment_len, mw));
        m.tensors[g][r][field] = *mt;
      }
      const PyValue* step = gs->Find("step");
      std::string step_where = gsw + "['step']";
      if (step == nullptr && elastic_states != nullptr) {
        step = osd.Find("base_optimizer_state_step");
        step_where = where + "['base_optimizer_state_step']";
      }
      if (step == nullptr) return DataLossError(fmt::format("{}: no step", gsw));
      ZINF_ASSIGN_OR_RETURN(std::int64_t s, ReadStep(f, *step, step_where));
      if (!adam_step) {
        adam_step = s;
      } else if (s != *adam_step) {
        return DataLossError(
            fmt::format("{}: step {}, but rank 0's group 0 has {}", step_where, s, *adam_step));
      }
    }
  }
  if (*adam_step != m.global_steps - m.skipped_steps) {
    return DataLossError(fmt::format(
        "{}: the optimizer's step is {}, but {} says global_steps {} - skipped_steps {} = {}",
        m.tag_dir, *adam_step, model.path(), m.global_steps, m.skipped_steps,
        m.global_steps - m.skipped_steps));
  }

  // ds_config: the optimizer files' (rank 0), else the model file's.
  ZINF_RETURN_IF_ERROR(ReadDsConfig(m, m.files[0].root().as<PyDict>()->Find("ds_config"),
                                    m.files[0].path() + "['ds_config']", model, *mroot));
  ReadClientState(m, model, *mroot);
  ZINF_RETURN_IF_ERROR(BuildParams(m, info, model, *mroot, group_of_flat));

  if (limits.verify_crc) {
    for (std::uint64_t r = 0; r < w; ++r) {
      std::set<std::string> seen;
      for (std::size_t g = 0; g < flats; ++g) {
        for (const PyTensor& t : m.tensors[g][r]) {
          ZINF_RETURN_IF_ERROR(VerifyOnce(m.files[r], t, seen));
        }
      }
    }
  }
  return OkStatus();
}

// ReadParam of a ZeRO checkpoint: elements [offset, offset + out.size()) of field `f` of param
// `param` (all in range, out not empty) assembled from the ranks' partitions.
Status ReadZeroParam(const CheckpointState& m, std::size_t param, std::size_t f,
                     std::uint64_t offset, std::span<float> out) {
  const DeepSpeedParam& p = m.params[param];
  const CheckpointState::Where& at = m.where[param];
  const std::uint64_t w = m.world;
  auto read = [&](std::uint64_t rank, std::uint64_t begin, std::span<float> dst) -> Status {
    const PyTensor& t = m.tensors[at.flat][rank][f];
    auto st = m.files[rank].ReadFloat32Range(t, begin, dst);
    if (!st) {
      return std::move(st).error().WithContext(
          fmt::format("param '{}' {}: ", Printable(p.name, kMaxName), kFieldNames[f]));
    }
    return OkStatus();
  };
  if (m.stage == 3) {
    // Rank r holds the param's elements [r * pn, (r + 1) * pn) at at.offset of its flat.
    const std::uint64_t pn = CeilDiv(p.numel, w);
    const std::uint64_t end = offset + out.size();
    for (std::uint64_t r = offset / pn; r < w && r * pn < end; ++r) {
      const std::uint64_t lo = std::max(offset, r * pn);
      const std::uint64_t hi = std::min(end, (r + 1) * pn);
      ZINF_RETURN_IF_ERROR(read(r, at.offset + (lo - r * pn), out.subspan(lo - offset, hi - lo)));
    }
  } else {
    const std::uint64_t n = m.flat_numel[at.flat];
    const std::uint64_t part = m.partition[at.flat];
    const std::uint64_t begin = at.offset + offset;
    const std::uint64_t end = begin + out.size();
    for (std::uint64_t r = begin / part; r < w && r * part < end; ++r) {
      const std::uint64_t lo = std::max(begin, r * part);
      const std::uint64_t hi = std::min({end, (r + 1) * part, n});
      if (lo >= hi) continue;
      ZINF_RETURN_IF_ERROR(read(r, lo - r * part, out.subspan(lo - begin, hi - lo)));
    }
  }
  return CheckValues(m.tag_dir, p, static_cast<DeepSpeedCheckpoint::Field>(f), offset, out);
}

}  // namespace
}  // namespace deepspeed_internal

using deepspeed_internal::kFieldNames;
using deepspeed_internal::kMaxName;

struct DeepSpeedCheckpoint::Impl : deepspeed_internal::CheckpointState {};

DeepSpeedCheckpoint::DeepSpeedCheckpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeepSpeedCheckpoint::DeepSpeedCheckpoint(DeepSpeedCheckpoint&&) noexcept = default;
DeepSpeedCheckpoint& DeepSpeedCheckpoint::operator=(DeepSpeedCheckpoint&&) noexcept = default;
DeepSpeedCheckpoint::~DeepSpeedCheckpoint() = default;

int DeepSpeedCheckpoint::stage() const { return impl_->stage; }
bool DeepSpeedCheckpoint::bf16_optimizer() const { return impl_->bf16; }
bool DeepSpeedCheckpoint::elastic() const { return impl_->elastic; }
bool DeepSpeedCheckpoint::universal() const { return impl_->universal; }
std::uint64_t DeepSpeedCheckpoint::world_size() const { return impl_->world; }
const std::string& DeepSpeedCheckpoint::tag_dir() const { return impl_->tag_dir; }
std::int64_t DeepSpeedCheckpoint::global_steps() const { return impl_->global_steps; }
std::int64_t DeepSpeedCheckpoint::skipped_steps() const { return impl_->skipped_steps; }
std::optional<std::int64_t> DeepSpeedCheckpoint::scheduler_last_batch_iteration() const {
  return impl_->last_batch_iteration;
}
const DeepSpeedLossScaler& DeepSpeedCheckpoint::loss_scaler() const { return impl_->scaler; }
const nlohmann::json& DeepSpeedCheckpoint::ds_config() const { return impl_->ds_config; }
const std::vector<DeepSpeedOptimizerGroup>& DeepSpeedCheckpoint::optimizer_groups() const {
  return impl_->groups;
}
const std::vector<DeepSpeedParam>& DeepSpeedCheckpoint::params() const { return impl_->params; }
const std::vector<std::pair<std::string, std::string>>& DeepSpeedCheckpoint::shared_params() const {
  return impl_->shared;
}

const nlohmann::json& DeepSpeedCheckpoint::client_state() const { return impl_->client_state; }
const std::vector<std::string>& DeepSpeedCheckpoint::client_state_skipped() const {
  return impl_->client_state_skipped;
}

const char* DeepSpeedFieldName(DeepSpeedCheckpoint::Field field) {
  return kFieldNames[static_cast<std::size_t>(field)];
}

Status DeepSpeedCheckpoint::ReadParam(std::size_t param, Field field, std::span<float> out) const {
  if (param < impl_->params.size() && out.size() != impl_->params[param].numel) {
    return InvalidArgumentError(fmt::format("ReadParam: '{}' has {} elements, out holds {}",
                                            Printable(impl_->params[param].name, kMaxName),
                                            impl_->params[param].numel, out.size()));
  }
  return ReadParam(param, field, 0, out);
}

Status DeepSpeedCheckpoint::ReadParam(std::size_t param, Field field, std::uint64_t offset,
                                      std::span<float> out) const {
  const Impl& m = *impl_;
  if (param >= m.params.size()) {
    return InvalidArgumentError(fmt::format("ReadParam: param {} of {}", param, m.params.size()));
  }
  const DeepSpeedParam& p = m.params[param];
  const auto f = static_cast<std::size_t>(field);
  if (f >= kFieldNames.size()) return InvalidArgumentError("ReadParam: unknown field");
  if (offset > p.numel || out.size() > p.numel - offset) {
    return InvalidArgumentError(
        fmt::format("ReadParam: elements [{}, +{}) of '{}', which has {}", offset, out.size(),
                    Printable(p.name, kMaxName), p.numel));
  }
  if (out.empty()) return OkStatus();
  if (m.universal) return deepspeed_internal::ReadUniversalParam(m, param, f, offset, out);
  return deepspeed_internal::ReadZeroParam(m, param, f, offset, out);
}

Result<DeepSpeedCheckpoint> OpenDeepSpeedCheckpoint(const std::string& dir,
                                                    const DeepSpeedLimits& limits) {
  using deepspeed_internal::TagDir;
  using deepspeed_internal::TagFiles;
  auto impl = std::make_unique<DeepSpeedCheckpoint::Impl>();
  DeepSpeedCheckpoint::Impl& m = *impl;
  ZINF_ASSIGN_OR_RETURN(TagDir tag, deepspeed_internal::OpenTagDir(dir, limits));
  m.tag_dir = tag.path;
  ZINF_ASSIGN_OR_RETURN(TagFiles found,
                        deepspeed_internal::FindFiles(tag.fd.get(), m.tag_dir, limits));
  if (tag.pointer.ends_with("latest_universal") && !found.universal) {
    return NotFoundError(fmt::format(
        "{}: names {}, which holds no zero/optimizer_state.pt (not a universal checkpoint)",
        tag.pointer, m.tag_dir));
  }
  if (found.universal) {
    ZINF_RETURN_IF_ERROR(deepspeed_internal::ReadUniversal(m, tag.fd.get(), found, limits));
  } else {
    ZINF_RETURN_IF_ERROR(deepspeed_internal::ReadZero(m, tag.fd.get(), found, limits));
  }
  return DeepSpeedCheckpoint(std::move(impl));
}

}  // namespace zinf::interop
