// The checkpoint folder of zinf/interop/deepspeed.h: the save directory's `latest` or
// `latest_universal` pointer followed to the tag (or universal) folder, which is opened once
// without following links; the names of the files in it parsed (DeepSpeed's
// [bf16_|fp16_]zero_pp_rank_<r>_mp_rank_<mp>_{optim,model}_states.pt, mp_rank_<mp>_model_states.pt,
// a universal folder's zero/) and the set of ranks checked. Shared by the ZeRO and the universal
// reading (deepspeed_internal.h).
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "deepspeed_internal.h"
#include "text.h"
#include "zinf/storage/fs.h"

namespace zinf::interop::deepspeed_internal {
namespace {

constexpr std::string_view kRankPrefix = "zero_pp_rank_";
constexpr std::string_view kMpInfix = "_mp_rank_";
constexpr std::string_view kOptimSuffix = "optim_states.pt";  // after "_" (or none: legacy)
constexpr std::string_view kModelSuffix = "_model_states.pt";

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

}  // namespace

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

Status CheckRanks(const std::map<std::uint64_t, std::string>& files, const std::string& tag_dir,
                  std::string_view what, std::uint64_t max_world_size, std::uint64_t world) {
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

}  // namespace zinf::interop::deepspeed_internal
