#include "zinf/interop/deepspeed.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <ranges>
#include <set>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "text.h"
#include "zinf/interop/torch_file.h"
#include "zinf/storage/fs.h"

namespace zinf::interop {
namespace {

constexpr std::string_view kRankPrefix = "zero_pp_rank_";
constexpr std::string_view kMpInfix = "_mp_rank_";
constexpr std::string_view kOptimSuffix = "optim_states.pt";  // after "_" (or none: legacy)
constexpr std::string_view kModelSuffix = "_model_states.pt";
constexpr std::string_view kLossScalerModule = "deepspeed.runtime.fp16.loss_scaler";
// The fields of DeepSpeedCheckpoint::Field, in order: the optimizer state keys of the moments.
constexpr std::array<const char*, 3> kFieldNames = {"fp32", "exp_avg", "exp_avg_sq"};
// How many names an error lists.
constexpr std::size_t kMaxListed = 5;
// Names of param groups and params quoted in errors are cut at this length.
constexpr std::size_t kMaxName = 200;

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
                              int depth = 0) {
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

std::uint64_t CeilDiv(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// ---- the tag directory ----

// A decimal of at most 9 digits at the front of `s`; advances `s` past it.
std::optional<std::uint64_t> TakeNumber(std::string_view& s) {
  std::size_t n = 0;
  while (n < s.size() && s[n] >= '0' && s[n] <= '9') ++n;
  if (n == 0 || n > 9) return std::nullopt;
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v = v * 10 + static_cast<std::uint64_t>(s[i] - '0');
  s.remove_prefix(n);
  return v;
}

struct RankName {
  std::uint64_t dp = 0;
  std::string mp;  // as written ("00")
};
// "zero_pp_rank_{dp}_mp_rank_{mp}" followed by `suffix` (the whole rest of `s`).
std::optional<RankName> ParseRankName(std::string_view s, std::string_view suffix) {
  if (!s.starts_with(kRankPrefix)) return std::nullopt;
  s.remove_prefix(kRankPrefix.size());
  const std::string_view dp_text = s;
  auto dp = TakeNumber(s);
  if (!dp || (dp_text[0] == '0' && dp_text.size() > 1 && dp_text[1] >= '0' && dp_text[1] <= '9')) {
    return std::nullopt;  // leading zeros are not DeepSpeed's
  }
  if (!s.starts_with(kMpInfix)) return std::nullopt;
  s.remove_prefix(kMpInfix.size());
  std::size_t n = 0;
  while (n < s.size() && s[n] >= '0' && s[n] <= '9') ++n;
  if (n == 0 || n > 9) return std::nullopt;
  RankName out{*dp, std::string(s.substr(0, n))};
  s.remove_prefix(n);
  if (s != suffix) return std::nullopt;
  return out;
}

bool AllZeros(std::string_view digits) {
  return std::all_of(digits.begin(), digits.end(), [](char c) { return c == '0'; });
}

struct TagFiles {
  std::string prefix;                           // of the optimizer files: "", "bf16_", "fp16_"
  std::map<std::uint64_t, std::string> optim;   // dp -> name
  std::map<std::uint64_t, std::string> model3;  // dp -> name (stage 3)
  std::optional<std::string> model12;           // mp_rank_00_model_states.pt
  bool universal = false;                       // zero/optimizer_state.pt is there
};

Status CheckRegularFile(int dir_fd, const std::string& name, const std::string& display) {
  struct stat st {};
  if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return ErrnoError(errno, fmt::format("stat {}", display));
  }
  if (S_ISLNK(st.st_mode)) {
    return FailedPreconditionError(
        fmt::format("{}: a symbolic link; checkpoint files are read only as regular files, "
                    "links are not followed",
                    display));
  }
  if (!S_ISREG(st.st_mode)) {
    return FailedPreconditionError(fmt::format("{}: not a regular file", display));
  }
  return OkStatus();
}

Result<TagFiles> FindFiles(int dir_fd, const std::string& tag_dir, const DeepSpeedLimits& limits) {
  ZINF_ASSIGN_OR_RETURN(storage::DirectoryListing listing,
                        storage::ListDirectory(dir_fd, tag_dir, limits.max_dir_entries));
  if (listing.truncated) {
    return InvalidArgumentError(
        fmt::format("{}: more than {} entries", tag_dir, limits.max_dir_entries));
  }
  std::sort(listing.names.begin(), listing.names.end());
  TagFiles files;
  std::optional<std::string> prefix_seen_in;  // a file of the prefix first seen
  std::vector<std::string> refused_parallel;
  for (const std::string& name : listing.names) {
    const std::string display = fmt::format("{}/{}", tag_dir, Printable(name));
    if (name == "zero") {
      // A universal folder's mark (the loader's test too). `zero` itself may be a link here: the
      // universal reader opens it without following links, and says so.
      struct stat st {};
      if (::fstatat(dir_fd, "zero/optimizer_state.pt", &st, AT_SYMLINK_NOFOLLOW) == 0) {
        files.universal = true;
      } else if (errno != ENOENT && errno != ENOTDIR) {
        return ErrnoError(errno, fmt::format("stat {}/zero/optimizer_state.pt", tag_dir));
      }
      continue;
    }
    if (name.starts_with("layer_") || name.starts_with("expp_rank_") ||
        name.find("expert") != std::string::npos) {
      return InvalidArgumentError(
          fmt::format("{}: a pipeline-parallel (layer_*) or MoE expert file; zinf imports only "
                      "data-parallel ZeRO checkpoints (no pipeline, tensor or expert parallelism)",
                      display));
    }
    std::string_view rest = name;
    std::string prefix;
    for (std::string_view p : {"bf16_", "fp16_"}) {
      if (rest.starts_with(p) && rest.substr(p.size()).starts_with(kRankPrefix)) {
        prefix = std::string(p);
        rest.remove_prefix(p.size());
      }
    }
    std::optional<RankName> rank;
    enum { kNone, kOptim, kModel3, kModel12 } kind = kNone;
    if ((rank = ParseRankName(rest, std::string("_") + std::string(kOptimSuffix))) ||
        (rank = ParseRankName(rest, kOptimSuffix))) {  // DeepSpeed's legacy name lacks the "_"
      kind = kOptim;
    } else if (prefix.empty() && (rank = ParseRankName(rest, kModelSuffix))) {
      kind = kModel3;
    } else if (name.starts_with("mp_rank_") && name.ends_with(kModelSuffix)) {
      const std::string_view digits =
          std::string_view(name).substr(8, name.size() - 8 - kModelSuffix.size());
      if (!digits.empty() && digits.size() <= 9 &&
          std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        kind = kModel12;
        rank = RankName{0, std::string(digits)};
      }
    }
    if (kind == kNone) {
      if ((name.find(kRankPrefix) != std::string::npos || name.starts_with("mp_rank_")) &&
          name.ends_with("states.pt")) {
        return DataLossError(fmt::format(
            "{}: named like a checkpoint file, but not as DeepSpeed names its files "
            "([bf16_|fp16_]zero_pp_rank_<r>_mp_rank_<mp>_optim_states.pt, "
            "zero_pp_rank_<r>_mp_rank_<mp>_model_states.pt, mp_rank_<mp>_model_states.pt)",
            display));
      }
      continue;  // zero_to_fp32.py and whatever else a user keeps there
    }
    if (!AllZeros(rank->mp)) {
      refused_parallel.push_back(name);
      continue;
    }
    ZINF_RETURN_IF_ERROR(CheckRegularFile(dir_fd, name, display));
    if (kind == kModel12) {
      if (files.model12) {
        return DataLossError(fmt::format("{}: two model files, {} and {}", tag_dir,
                                         Printable(*files.model12), Printable(name)));
      }
      files.model12 = name;
      continue;
    }
    auto& map = kind == kOptim ? files.optim : files.model3;
    if (kind == kOptim) {
      if (prefix_seen_in && prefix != files.prefix) {
        return DataLossError(
            fmt::format("{}: optimizer files of two prefixes, {} and {} (one checkpoint has one)",
                        tag_dir, Printable(*prefix_seen_in), Printable(name)));
      }
      files.prefix = prefix;
      prefix_seen_in = name;
    }
    auto [it, added] = map.emplace(rank->dp, name);
    if (!added) {
      return DataLossError(fmt::format("{}: two files of data-parallel rank {}: {} and {}", tag_dir,
                                       rank->dp, Printable(it->second), Printable(name)));
    }
  }
  if (!refused_parallel.empty()) {
    return InvalidArgumentError(fmt::format(
        "{}: model-parallel files (mp_rank other than 00: {}); zinf imports only data-parallel "
        "ZeRO checkpoints (no tensor or pipeline parallelism)",
        tag_dir, ListNames(refused_parallel)));
  }
  if (files.universal && !files.optim.empty()) {
    return DataLossError(fmt::format(
        "{}: ZeRO optimizer files ({}) beside a universal checkpoint's zero/optimizer_state.pt; "
        "a folder holds one or the other",
        tag_dir, Printable(files.optim.begin()->second)));
  }
  if (!files.universal && files.optim.empty()) {
    return NotFoundError(fmt::format(
        "{}: no ZeRO optimizer files ([bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt) and no "
        "universal checkpoint (zero/optimizer_state.pt)",
        tag_dir));
  }
  return files;
}

// Ranks 0..W-1 exactly, W = the count; `what` names the kind of file.
// With `world` (non-zero), ranks 0..world-1.
Status CheckRanks(const std::map<std::uint64_t, std::string>& files, const std::string& tag_dir,
                  std::string_view what, std::uint64_t max_world_size, std::uint64_t world = 0) {
  const std::uint64_t w = world != 0 ? world : files.size();
  if (w > max_world_size) {
    return InvalidArgumentError(fmt::format("{}: {} {} files, more than the {} ranks read", tag_dir,
                                            w, what, max_world_size));
  }
  // Keys are unique and sorted: ranks 0..W-1 exactly when the highest is W-1.
  if (files.rbegin()->first != w - 1 || files.size() != w) {
    std::vector<std::string> missing;
    for (std::uint64_t r = 0;
         r < std::max(w, files.rbegin()->first + 1) && missing.size() <= kMaxListed; ++r) {
      if (!files.contains(r)) missing.push_back(std::to_string(r));
    }
    return DataLossError(fmt::format(
        "{}: {} {} files, of ranks up to {}; a checkpoint of {} ranks has exactly ranks 0..{} "
        "(missing: {})",
        tag_dir, files.size(), what, files.rbegin()->first, w, w - 1,
        missing.empty() ? std::string("none") : ListNames(missing)));
  }
  return OkStatus();
}

// The folder `dir` names: `dir`/<tag> when `dir` holds `latest` or `latest_universal` (naming
// the tag, or the universal folder, beside it), else `dir`.
struct TagDir {
  std::string path;
  storage::UniqueFd fd;
  std::string pointer;  // the file that named it ("<dir>/latest_universal"), or "" for `dir`
};
Result<TagDir> OpenTagDir(const std::string& dir, const DeepSpeedLimits& limits) {
  ZINF_ASSIGN_OR_RETURN(storage::UniqueFd dir_fd, storage::OpenDirectory(dir));
  std::vector<std::string> pointers;
  for (const char* name : {"latest", "latest_universal"}) {
    struct stat st {};
    if (::fstatat(dir_fd.get(), name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
      pointers.emplace_back(name);
    } else if (errno != ENOENT) {
      return ErrnoError(errno, fmt::format("stat {}/{}", dir, name));
    }
  }
  if (pointers.empty()) return TagDir{dir, std::move(dir_fd), ""};
  if (pointers.size() > 1) {
    // DeepSpeed's loader picks one by its config (load_universal); zinf has no such setting.
    return InvalidArgumentError(fmt::format(
        "{}: holds both latest and latest_universal; give the tag folder or the universal "
        "folder itself",
        dir));
  }
  const std::string& pointer = pointers[0];
  const std::string latest_path = fmt::format("{}/{}", dir, pointer);
  ZINF_RETURN_IF_ERROR(CheckRegularFile(dir_fd.get(), pointer, latest_path));
  ZINF_ASSIGN_OR_RETURN(std::string text,
                        storage::ReadSmallFileAt(dir_fd.get(), pointer, latest_path,
                                                 limits.max_latest_bytes, storage::Follow::kNo));
  std::string_view tag = text;
  auto space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!tag.empty() && space(tag.front())) tag.remove_prefix(1);
  while (!tag.empty() && space(tag.back())) tag.remove_suffix(1);
  const bool printable = std::all_of(tag.begin(), tag.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f;
  });
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string_view::npos ||
      tag.find('\\') != std::string_view::npos || !printable || tag.size() > 255) {
    return InvalidArgumentError(
        fmt::format("{}: '{}' is not a tag (one path component, not . or .., no '/')", latest_path,
                    Printable(tag, 64)));
  }
  const std::string tag_dir = fmt::format("{}/{}", dir, tag);
  auto tag_fd =
      storage::OpenDirectoryAt(dir_fd.get(), std::string(tag), tag_dir, storage::Follow::kNo);
  if (!tag_fd) {
    return std::move(tag_fd).error().WithContext(
        fmt::format("the tag {} names (a real directory beside it): ", latest_path));
  }
  return TagDir{tag_dir, std::move(*tag_fd), latest_path};
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

// What ReadParam returns must be finite, and a second moment >= 0.
Status CheckValues(const std::string& tag_dir, const DeepSpeedParam& p,
                   DeepSpeedCheckpoint::Field field, std::span<const float> values) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float v = values[i];
    if (!std::isfinite(v) || (field == DeepSpeedCheckpoint::Field::kExpAvgSq && v < 0)) {
      return DataLossError(fmt::format(
          "{}: param '{}' {}: element {} is {}{}", tag_dir, Printable(p.name, kMaxName),
          kFieldNames[static_cast<std::size_t>(field)], i, v,
          std::isfinite(v) ? " (a negative second moment)" : " (not finite); not imported"));
    }
  }
  return OkStatus();
}

// ---- universal checkpoints: one folder per param ----

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

// Reads the universal param file `path` again and `out.size()` elements of the tensor Open
// found there (`expected`).
Status ReadUniversalField(const std::string& path, const PyTensor& expected, bool bare,
                          std::uint64_t numel, const PickleLimits& limits, std::span<float> out) {
  ZINF_ASSIGN_OR_RETURN(TorchFile file, TorchFile::Read(path, limits));
  ZINF_ASSIGN_OR_RETURN(PyTensor t, UniversalTensor(file, bare, numel));
  if (!SameTensor(t, expected)) {
    return DataLossError(fmt::format("{}: changed since the checkpoint was opened", path));
  }
  return file.ReadFloat32Range(t, 0, out);
}

}  // namespace

// ---- the checkpoint ----

namespace {

// What DeepSpeedCheckpoint holds (its Impl), for the functions that fill it.
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
  // ReadParam (a descriptor held per file could pass the process's limit), and the tensor Open
  // checked there, which ReadParam must find again.
  bool universal = false;
  PickleLimits pickle;
  struct UniversalField {
    std::string path;
    PyTensor tensor;
  };
  std::vector<std::array<UniversalField, 3>> universal_fields;
};

}  // namespace

struct DeepSpeedCheckpoint::Impl : CheckpointState {};

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
  const Impl& m = *impl_;
  if (param >= m.params.size()) {
    return InvalidArgumentError(fmt::format("ReadParam: param {} of {}", param, m.params.size()));
  }
  const DeepSpeedParam& p = m.params[param];
  const auto f = static_cast<std::size_t>(field);
  if (f >= kFieldNames.size()) return InvalidArgumentError("ReadParam: unknown field");
  if (out.size() != p.numel) {
    return InvalidArgumentError(fmt::format("ReadParam: '{}' has {} elements, out holds {}",
                                            Printable(p.name, kMaxName), p.numel, out.size()));
  }
  if (p.numel == 0) return OkStatus();
  if (m.universal) {
    const Impl::UniversalField& u = m.universal_fields[param][f];
    auto st = ReadUniversalField(u.path, u.tensor, m.stage == 3, p.numel, m.pickle, out);
    if (!st) {
      return std::move(st).error().WithContext(
          fmt::format("param '{}' {}: ", Printable(p.name, kMaxName), kFieldNames[f]));
    }
    return CheckValues(m.tag_dir, p, field, out);
  }
  const Impl::Where& at = m.where[param];
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
    const std::uint64_t pn = CeilDiv(p.numel, w);
    for (std::uint64_t r = 0; r < w; ++r) {
      const std::uint64_t first = r * pn;
      if (first >= p.numel) break;
      const std::uint64_t count = std::min(pn, p.numel - first);
      ZINF_RETURN_IF_ERROR(read(r, at.offset, out.subspan(first, count)));
    }
  } else {
    const std::uint64_t n = m.flat_numel[at.flat];
    const std::uint64_t part = m.partition[at.flat];
    const std::uint64_t begin = at.offset;
    const std::uint64_t end = at.offset + p.numel;
    for (std::uint64_t r = begin / part; r < w && r * part < end; ++r) {
      const std::uint64_t lo = std::max(begin, r * part);
      const std::uint64_t hi = std::min({end, (r + 1) * part, n});
      if (lo >= hi) continue;
      ZINF_RETURN_IF_ERROR(read(r, lo - r * part, out.subspan(lo - begin, hi - lo)));
    }
  }
  return CheckValues(m.tag_dir, p, field, out);
}

namespace {

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

// The model-states file(s) of a checkpoint of ZeRO stage `stage` and `w` ranks, read and checked
// against each other: mp_rank_00_model_states.pt (stage 1/2) or one per rank (stage 3).
// `beside` names what else the folder holds, for errors.
struct Models {
  std::vector<ModelFile> files;
  ModelInfo info;
};
Result<Models> ReadModels(const TagFiles& found, const std::string& tag_dir, int stage,
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
      ZINF_ASSIGN_OR_RETURN(TorchFile file,
                            TorchFile::Read(fmt::format("{}/{}", tag_dir, name), limits.pickle));
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
        TorchFile::Read(fmt::format("{}/{}", tag_dir, *found.model12), limits.pickle));
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

// The param groups of a torch optimizer's state_dict (`where` holds 'param_groups'), each
// naming the flat groups (stage 3: sub-groups) it holds: every one of the `flats` exactly once.
struct ParamGroups {
  std::vector<DeepSpeedOptimizerGroup> groups;
  std::vector<std::size_t> group_of_flat;
};
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
    if (k == nullptr || std::find(kDeepSpeedModelKeys.begin(), kDeepSpeedModelKeys.end(),
                                  *k) != kDeepSpeedModelKeys.end()) {
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

// A path component DeepSpeed's universal format can use as a param's folder name.
bool IsFolderName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.size() <= 255 &&
         std::none_of(name.begin(), name.end(), [](char c) {
           return c == '/' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
         });
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
  ZINF_ASSIGN_OR_RETURN(TorchFile state_file, TorchFile::Read(state_path, limits.pickle));
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

  ZINF_ASSIGN_OR_RETURN(Models models, ReadModels(found, m.tag_dir, m.stage, m.world,
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
      for (const auto& [k, v] : gs->items) {
        const auto* key = k.as<std::string>();
        if (key == nullptr || (*key != "step" && *key != "exp_avg" && *key != "exp_avg_sq")) {
          return InvalidArgumentError(fmt::format(
              "{}: optimizer state '{}', which zinf does not import (it imports Adam's step, "
              "exp_avg and exp_avg_sq)",
              gsw, key != nullptr ? Printable(*key, 64) : k.TypeName()));
        }
      }
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
  std::vector<std::string> files = {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"};
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
      ZINF_ASSIGN_OR_RETURN(TorchFile file,
                            TorchFile::Read(fmt::format("{}/{}", path, file_name), limits.pickle));
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
  return OkStatus();
}

}  // namespace

Result<DeepSpeedCheckpoint> OpenDeepSpeedCheckpoint(const std::string& dir,
                                                    const DeepSpeedLimits& limits) {
  auto impl = std::make_unique<DeepSpeedCheckpoint::Impl>();
  DeepSpeedCheckpoint::Impl& m = *impl;
  ZINF_ASSIGN_OR_RETURN(TagDir tag, OpenTagDir(dir, limits));
  m.tag_dir = tag.path;
  ZINF_ASSIGN_OR_RETURN(TagFiles found, FindFiles(tag.fd.get(), m.tag_dir, limits));
  if (tag.pointer.ends_with("latest_universal") && !found.universal) {
    return NotFoundError(fmt::format(
        "{}: names {}, which holds no zero/optimizer_state.pt (not a universal checkpoint)",
        tag.pointer, m.tag_dir));
  }
  if (found.universal) {
    ZINF_RETURN_IF_ERROR(ReadUniversal(m, tag.fd.get(), found, limits));
    return DeepSpeedCheckpoint(std::move(impl));
  }
  ZINF_RETURN_IF_ERROR(CheckRanks(found.optim, m.tag_dir, "optimizer", limits.max_world_size));
  m.world = found.optim.size();
  const std::uint64_t w = m.world;

  // The optimizer files: zero_stage, partition_count, group counts.
  std::vector<const PyDict*> osds;
  std::optional<std::int64_t> zero_stage;  // nullopt: no key (BF16_Optimizer)
  for (const auto& [rank, name] : found.optim) {
    const std::string path = fmt::format("{}/{}", m.tag_dir, name);
    ZINF_ASSIGN_OR_RETURN(TorchFile file, TorchFile::Read(path, limits.pickle));
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

  ZINF_ASSIGN_OR_RETURN(Models models,
                        ReadModels(found, m.tag_dir, m.stage, w, "optimizer files", limits));
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
      for (const auto& [k, v] : gs->items) {
        const auto* key = k.as<std::string>();
        if (key == nullptr || (*key != "step" && *key != "exp_avg" && *key != "exp_avg_sq")) {
          return InvalidArgumentError(fmt::format(
              "{}: optimizer state '{}', which zinf does not import (it imports Adam's step, "
              "exp_avg and exp_avg_sq)",
              gsw, key != nullptr ? Printable(*key, 64) : k.TypeName()));
        }
      }
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
  return DeepSpeedCheckpoint(std::move(impl));
}

}  // namespace zinf::interop
