// Universal checkpoints (what DeepSpeed's ds_to_universal writes; issue 46's spec, sections 1.5
// and 3) for zinf/interop/deepspeed.h: the folder's zero/optimizer_state.pt and model file(s)
// read and checked, and each param's folder zero/<param>/ holding its whole fp32, exp_avg and
// exp_avg_sq (and, from a stage 1/2 source, its step); ReadParam reads a param's field file
// again, relative to the descriptor of zero/ that Open opened without following links.
#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "deepspeed_internal.h"
#include "text.h"
#include "zinf/storage/fs.h"

namespace zinf::interop::deepspeed_internal {
namespace {

// The files of a param's fields, in the order of DeepSpeedCheckpoint::Field.
constexpr std::array<const char*, 3> kFieldFiles = {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"};

// The keys a universal param file's dict may hold that zinf does not import: DeepSpeed writes
// them for tensor-parallel (vocabulary padding, fused sub-params) and expert-parallel params.
constexpr std::array<std::string_view, 5> kUniversalRefusedKeys = {
    "vocab_tensor", "param_n_sub_params", "sub_param_shape", "is_expert_param", "ep_num_experts"};

// A float32 tensor of `numel` elements, contiguous in row-major order (any shape).
Status CheckContiguous(const PyTensor& t, std::uint64_t numel, const std::string& where) {
  if (t.dtype != "float32") {
    return DataLossError(fmt::format("{}: a {} tensor, not float32", where, Printable(t.dtype)));
  }
  std::uint64_t n = 1;
  bool contiguous = t.stride.size() == t.shape.size();
  for (std::size_t d = t.shape.size(); d-- > 0 && contiguous;) {
    if (t.shape[d] != 1 && static_cast<std::uint64_t>(t.stride[d]) != n) contiguous = false;
    n *= static_cast<std::uint64_t>(t.shape[d]);
  }
  if (!contiguous) {
    return DataLossError(fmt::format("{}: a tensor of shape [{}] stride [{}], not contiguous",
                                     where, fmt::join(t.shape, ", "), fmt::join(t.stride, ", ")));
  }
  if (n != numel) {
    return DataLossError(
        fmt::format("{}: a tensor of shape [{}] ({} elements), param_shapes gives {} elements",
                    where, fmt::join(t.shape, ", "), n, numel));
  }
  return OkStatus();
}

// The tensor of a universal param file: `{'param': tensor of the param's elements, 'cat_dim':
// int}` (from a stage 1/2 checkpoint), or a bare 1-dim tensor (`bare`: from stage 3).
Result<PyTensor> UniversalTensor(const TorchFile& file, bool bare, std::uint64_t numel) {
  const std::string& where = file.path();
  if (bare) {
    ZINF_ASSIGN_OR_RETURN(const PyTensor* t, AsTensor(file.root(), where));
    ZINF_RETURN_IF_ERROR(CheckFlat(*t, numel, where));
    return *t;
  }
  ZINF_ASSIGN_OR_RETURN(const PyDict* d, AsDict(file.root(), where));
  for (const auto& [k, v] : d->items) {
    const auto* key = k.as<std::string>();
    if (key != nullptr && (*key == "param" || *key == "cat_dim")) continue;
    const bool known =
        key != nullptr && std::find(kUniversalRefusedKeys.begin(), kUniversalRefusedKeys.end(),
                                    *key) != kUniversalRefusedKeys.end();
    return InvalidArgumentError(fmt::format(
        "{}: key '{}'{}; zinf imports universal params of data-parallel runs only ('param' and "
        "'cat_dim')",
        where, key != nullptr ? Printable(*key, 64) : k.TypeName(),
        known ? " (a tensor- or expert-parallel param)" : ""));
  }
  // cat_dim says how tensor-parallel slices were joined (none for replicated params): with one
  // slice, the param is whole either way.
  if (const PyValue* cat = d->Find("cat_dim"); cat != nullptr) {
    ZINF_ASSIGN_OR_RETURN(std::int64_t cat_dim, AsInt(*cat, where + "['cat_dim']"));
    if (cat_dim < 0) return DataLossError(fmt::format("{}['cat_dim']: {} < 0", where, cat_dim));
  }
  ZINF_ASSIGN_OR_RETURN(const PyValue* param, Need(*d, "param", where));
  ZINF_ASSIGN_OR_RETURN(const PyTensor* t, AsTensor(*param, where + "['param']"));
  ZINF_RETURN_IF_ERROR(CheckContiguous(*t, numel, where + "['param']"));
  return *t;
}

bool SameTensor(const PyTensor& a, const PyTensor& b) {
  return a.dtype == b.dtype && a.storage_key == b.storage_key &&
         a.storage_numel == b.storage_numel && a.offset == b.offset && a.shape == b.shape &&
         a.stride == b.stride;
}

// Reads the universal param file `name` of the param folder `dir_fd` (`path` in errors) again
// and `out.size()` elements of the tensor Open found there (`expected`).
Status ReadUniversalField(int dir_fd, const std::string& name, const std::string& path,
                          const PyTensor& expected, bool bare, std::uint64_t numel,
                          const PickleLimits& limits, std::uint64_t offset,
                          std::span<float> out) {
  ZINF_ASSIGN_OR_RETURN(TorchFile file, TorchFile::ReadAt(dir_fd, name, path, limits));
  ZINF_ASSIGN_OR_RETURN(PyTensor t, UniversalTensor(file, bare, numel));
  if (!SameTensor(t, expected)) {
    return DataLossError(fmt::format("{}: changed since the checkpoint was opened", path));
  }
  return file.ReadFloat32Range(t, offset, out);
}

// A path component DeepSpeed's universal format can use as a param's folder name.
bool IsFolderName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.size() <= 255 &&
         std::none_of(name.begin(), name.end(), [](char c) {
           return c == '/' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
         });
}

}  // namespace

// A universal folder (what DeepSpeed's ds_to_universal writes; issue 46's spec, sections 1.5
// and 3): the model file(s) copied from the source, zero/optimizer_state.pt (the source's rank 0
// optimizer state without its tensors' partitions, plus param_groups) and zero/<param>/ holding
// the param's whole fp32, exp_avg and exp_avg_sq (and its step, from a stage 1/2 source).
Status ReadUniversal(CheckpointState& m, int tag_fd, const TagFiles& found,
                     const DeepSpeedLimits& limits) {
  m.universal = true;
  m.pickle = limits.pickle;
  const std::string zero_dir = m.tag_dir + "/zero";
  ZINF_ASSIGN_OR_RETURN(storage::UniqueFd zero_fd,
                        storage::OpenDirectoryAt(tag_fd, "zero", zero_dir, storage::Follow::kNo));
  const std::string state_path = zero_dir + "/optimizer_state.pt";
  ZINF_RETURN_IF_ERROR(CheckRegularFile(zero_fd.get(), "optimizer_state.pt", state_path));
  ZINF_ASSIGN_OR_RETURN(TorchFile state_file, TorchFile::ReadAt(zero_fd.get(), "optimizer_state.pt",
                                                                state_path, limits.pickle));
  const std::string& where = state_file.path();
  ZINF_ASSIGN_OR_RETURN(const PyDict* osd, AsDict(state_file.root(), where));
  ZINF_ASSIGN_OR_RETURN(std::optional<std::int64_t> zero_stage, ReadZeroStage(*osd, where));
  m.bf16 = !zero_stage.has_value();
  m.stage = static_cast<int>(zero_stage.value_or(1));
  const bool stage3 = m.stage == 3;

  // partition_count: W (stage 1/2: one per group, each W).
  const std::string pcw = where + "['partition_count']";
  ZINF_ASSIGN_OR_RETURN(const PyValue* pc, Need(*osd, "partition_count", where));
  std::vector<std::int64_t> counts;
  if (stage3) {
    ZINF_ASSIGN_OR_RETURN(std::int64_t count, AsInt(*pc, pcw));
    counts.push_back(count);
  } else {
    ZINF_ASSIGN_OR_RETURN(const std::vector<PyValue>* list, AsSequence(*pc, pcw));
    for (const PyValue& c : *list) {
      ZINF_ASSIGN_OR_RETURN(std::int64_t count, AsInt(c, pcw));
      counts.push_back(count);
    }
    if (counts.empty()) return DataLossError(fmt::format("{}: empty", pcw));
  }
  for (std::int64_t c : counts) {
    if (c < 1 || c != counts[0]) {
      return DataLossError(fmt::format("{}: {}, not a world size equal for every group ({})", pcw,
                                       c, fmt::join(counts, ", ")));
    }
  }
  if (static_cast<std::uint64_t>(counts[0]) > limits.max_world_size) {
    return InvalidArgumentError(
        fmt::format("{}: {} ranks, more than the {} read", pcw, counts[0], limits.max_world_size));
  }
  m.world = static_cast<std::uint64_t>(counts[0]);

  ZINF_ASSIGN_OR_RETURN(Models models, ReadModels(found, tag_fd, m.tag_dir, m.stage, m.world,
                                                  "universal state (zero/)", limits));
  const ModelInfo& info = models.info;
  const TorchFile& model = models.files[0].file;
  ZINF_ASSIGN_OR_RETURN(const PyDict* mroot, AsDict(model.root(), model.path()));
  const std::size_t flats = info.flat_groups.size();
  ZINF_RETURN_IF_ERROR(ReadModelState(m, info, model, *mroot));
  if (!stage3 && counts.size() != flats) {
    return DataLossError(
        fmt::format("{}: {} groups, param_shapes has {}", pcw, counts.size(), flats));
  }
  ZINF_ASSIGN_OR_RETURN(m.scaler, ReadLossScaler(*osd, where));
  ZINF_ASSIGN_OR_RETURN(const std::vector<PyValue>* pgs, NeedSequence(*osd, "param_groups", where));
  ZINF_ASSIGN_OR_RETURN(ParamGroups groups, ReadParamGroups(*pgs, flats, where));
  m.groups = std::move(groups.groups);

  // The step: stage 3, every sub-group's state in optimizer_state.pt; stage 1/2, every param's
  // step.pt (below).
  std::optional<std::int64_t> adam_step;
  std::string step_from;
  auto same_step = [&](std::int64_t s, const std::string& from) -> Status {
    if (!adam_step) {
      adam_step = s;
      step_from = from;
    } else if (s != *adam_step) {
      return DataLossError(
          fmt::format("{}: step {}, but {} has {}", from, s, step_from, *adam_step));
    }
    return OkStatus();
  };
  if (stage3) {
    const std::string iw = where + "['optimizer_state_dict']";
    ZINF_ASSIGN_OR_RETURN(const PyDict* inner, NeedDict(*osd, "optimizer_state_dict", where));
    ZINF_ASSIGN_OR_RETURN(const PyDict* state, NeedDict(*inner, "state", iw));
    if (state->items.size() != flats) {
      return DataLossError(fmt::format("{}['state']: {} entries, not {} (one per sub-group)", iw,
                                       state->items.size(), flats));
    }
    for (std::size_t g = 0; g < flats; ++g) {
      const PyValue* entry = nullptr;
      for (const auto& [k, v] : state->items) {
        if (const auto* i = k.as<std::int64_t>();
            i != nullptr && *i == static_cast<std::int64_t>(g)) {
          entry = &v;
        }
      }
      const std::string gsw = fmt::format("{}['state'][{}]", iw, g);
      if (entry == nullptr) return DataLossError(fmt::format("{}: missing", gsw));
      ZINF_ASSIGN_OR_RETURN(const PyDict* gs, AsDict(*entry, gsw));
      ZINF_RETURN_IF_ERROR(CheckAdamStateKeys(*gs, gsw));
      ZINF_ASSIGN_OR_RETURN(const PyValue* step, Need(*gs, "step", gsw));
      ZINF_ASSIGN_OR_RETURN(std::int64_t s, ReadStep(state_file, *step, gsw + "['step']"));
      ZINF_RETURN_IF_ERROR(same_step(s, gsw + "['step']"));
    }
  }
  ZINF_RETURN_IF_ERROR(
      ReadDsConfig(m, osd->Find("ds_config"), where + "['ds_config']", model, *mroot));
  ReadClientState(m, model, *mroot);
  ZINF_RETURN_IF_ERROR(BuildParams(m, info, model, *mroot, groups.group_of_flat));

  // zero/ holds optimizer_state.pt and a folder for each param of param_shapes, nothing else
  // (DeepSpeed's loader reads the folders of its own model's params: one more is a model zinf
  // would not see).
  std::set<std::string_view> names;
  for (const DeepSpeedParam& p : m.params) {
    if (!IsFolderName(p.name)) {
      return InvalidArgumentError(fmt::format(
          "{}: param '{}' is not a folder name (one path component, not . or .., no '/' or "
          "control characters), which a universal checkpoint needs",
          model.path(), Printable(p.name, kMaxName)));
    }
    names.insert(p.name);
  }
  const std::uint64_t max_entries =
      std::max<std::uint64_t>(limits.max_dir_entries, m.params.size() + 1);
  ZINF_ASSIGN_OR_RETURN(storage::DirectoryListing listing,
                        storage::ListDirectory(zero_fd.get(), zero_dir, max_entries));
  if (listing.truncated) {
    return InvalidArgumentError(fmt::format("{}: more than {} entries", zero_dir, max_entries));
  }
  std::vector<std::string> extra;
  for (const std::string& name : listing.names) {
    if (name != "optimizer_state.pt" && !names.contains(name)) extra.push_back(name);
  }
  if (!extra.empty()) {
    std::sort(extra.begin(), extra.end());
    return DataLossError(
        fmt::format("{}: {} not among the params of {}'s param_shapes ({} of them)", zero_dir,
                    ListNames(extra), model.path(), extra.size()));
  }

  // Each param's folder: its files, checked (and their storages' CRCs), never following links.
  std::vector<std::string> files(kFieldFiles.begin(), kFieldFiles.end());
  if (!stage3) files.emplace_back("step.pt");
  m.universal_fields.resize(m.params.size());
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const DeepSpeedParam& p = m.params[i];
    const std::string display = fmt::format("{}/{}", zero_dir, Printable(p.name, kMaxName));
    const std::string path = fmt::format("{}/{}", zero_dir, p.name);
    auto dir_fd = storage::OpenDirectoryAt(zero_fd.get(), p.name, display, storage::Follow::kNo);
    if (!dir_fd) {
      return std::move(dir_fd).error().WithContext(fmt::format(
          "the folder of param '{}' (a real directory): ", Printable(p.name, kMaxName)));
    }
    ZINF_ASSIGN_OR_RETURN(storage::DirectoryListing in_dir,
                          storage::ListDirectory(dir_fd->get(), display, 16));
    std::vector<std::string> unknown;
    for (const std::string& name : in_dir.names) {
      if (std::find(files.begin(), files.end(), name) == files.end()) unknown.push_back(name);
    }
    if (!unknown.empty() || in_dir.truncated) {
      std::sort(unknown.begin(), unknown.end());
      return InvalidArgumentError(fmt::format(
          "{}: {}{}, which zinf does not import (a universal param folder holds {})", display,
          ListNames(unknown), in_dir.truncated ? ", ..." : "", fmt::join(files, ", ")));
    }
    for (const std::string& file_name : files) {
      ZINF_RETURN_IF_ERROR(
          CheckRegularFile(dir_fd->get(), file_name, fmt::format("{}/{}", display, file_name)));
      ZINF_ASSIGN_OR_RETURN(
          TorchFile file, TorchFile::ReadAt(dir_fd->get(), file_name,
                                            fmt::format("{}/{}", path, file_name), limits.pickle));
      if (file_name == "step.pt") {
        const std::string sw = fmt::format("{}/step.pt", display);
        ZINF_ASSIGN_OR_RETURN(std::int64_t s, ReadStep(file, file.root(), sw));
        ZINF_RETURN_IF_ERROR(same_step(s, sw));
        continue;
      }
      const std::size_t f = static_cast<std::size_t>(&file_name - files.data());
      ZINF_ASSIGN_OR_RETURN(PyTensor t, UniversalTensor(file, stage3, p.numel));
      if (limits.verify_crc) ZINF_RETURN_IF_ERROR(file.VerifyStorage(t));
      m.universal_fields[i][f] = {file.path(), std::move(t)};
    }
  }
  if (!adam_step) {
    return DataLossError(fmt::format("{}: no step (param_shapes holds no params)", m.tag_dir));
  }
  if (*adam_step != m.global_steps - m.skipped_steps) {
    return DataLossError(fmt::format(
        "{}: the optimizer's step is {} ({}), but {} says global_steps {} - skipped_steps {} = {}",
        m.tag_dir, *adam_step, step_from, model.path(), m.global_steps, m.skipped_steps,
        m.global_steps - m.skipped_steps));
  }
  m.universal_zero = std::move(zero_fd);
  return OkStatus();
}

Status ReadUniversalParam(const CheckpointState& m, std::size_t param, std::size_t field,
                          std::uint64_t offset, std::span<float> out) {
  const DeepSpeedParam& p = m.params[param];
  const CheckpointState::UniversalField& u = m.universal_fields[param][field];
  // The param's folder, opened anew in the zero/ Open opened (a descriptor held per param could
  // pass the process's limit), never following a link: one put there since Open is refused.
  auto read = [&]() -> Status {
    ZINF_ASSIGN_OR_RETURN(
        storage::UniqueFd dir_fd,
        storage::OpenDirectoryAt(m.universal_zero.get(), p.name,
                                 fmt::format("{}/zero/{}", m.tag_dir, Printable(p.name, kMaxName)),
                                 storage::Follow::kNo));
    return ReadUniversalField(dir_fd.get(), kFieldFiles[field], u.path, u.tensor, m.stage == 3,
                              p.numel, m.pickle, offset, out);
  };
  if (auto st = read(); !st) {
    return std::move(st).error().WithContext(
        fmt::format("param '{}' {}: ", Printable(p.name, kMaxName), kFieldNames[field]));
  }
  return CheckValues(m.tag_dir, p, static_cast<DeepSpeedCheckpoint::Field>(field), offset, out);
}

}  // namespace zinf::interop::deepspeed_internal
