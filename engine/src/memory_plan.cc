#include "memory_plan.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "zinf/core/units.h"

namespace zinf::engine {
namespace {

// Larger limits are the kernel's "no limit" (v1 prints 2^63 rounded down to a page).
constexpr std::uint64_t kNoLimitAbove = std::uint64_t{1} << 60;

// At most `max_bytes` of a small kernel file; nullopt when it cannot be opened or read. The last
// component is not followed when it is a symbolic link (a planted link cannot point the read at
// a FIFO or a huge file).
std::optional<std::string> ReadSmallFile(const std::string& path, std::size_t max_bytes) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return std::nullopt;
  std::string text(max_bytes, '\0');
  std::size_t got = 0;
  while (got < max_bytes) {
    const ssize_t n = ::read(fd, text.data() + got, max_bytes - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  return text;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\n' || s.front() == '\t')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n' || s.back() == '\t')) {
    s.remove_suffix(1);
  }
  return s;
}

// A cgroup limit file's value: bytes, or nullopt for "max", huge values and anything unreadable.
std::optional<std::uint64_t> ReadLimit(const std::string& path) {
  std::optional<std::string> text = ReadSmallFile(path, 64);
  if (!text) return std::nullopt;
  const std::string_view value = Trim(*text);
  std::uint64_t bytes = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), bytes);
  if (ec != std::errc() || end != value.data() + value.size() || bytes == 0 ||
      bytes > kNoLimitAbove) {
    return std::nullopt;
  }
  return bytes;
}

// A cgroup path from /proc/self/cgroup that stays inside the hierarchy ("/", "/a/b"; no "..").
bool SafeCgroupPath(std::string_view path) {
  if (path.empty() || path.front() != '/' || path.size() > 4096) return false;
  std::size_t start = 1;
  while (start <= path.size()) {
    std::size_t slash = path.find('/', start);
    if (slash == std::string_view::npos) slash = path.size();
    const std::string_view part = path.substr(start, slash - start);
    if (part == ".." || part == ".") return false;
    start = slash + 1;
  }
  return true;
}

// The smallest limit in `file` of cgroup `path` and its ancestors under `mount`, and where.
std::optional<std::pair<std::uint64_t, std::string>> SmallestLimit(const std::string& mount,
                                                                   std::string path,
                                                                   const std::string& file) {
  std::optional<std::pair<std::uint64_t, std::string>> best;
  while (true) {
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    const std::string at = path == "/" ? mount + "/" + file : mount + path + "/" + file;
    if (std::optional<std::uint64_t> limit = ReadLimit(at);
        limit && (!best || *limit < best->first)) {
      best.emplace(*limit, at);
    }
    if (path == "/" || path.empty()) break;
    const std::size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return best;
}

std::optional<std::pair<std::uint64_t, std::string>> CgroupLimit(const std::string& root) {
  std::optional<std::string> text = ReadSmallFile(root + "/proc/self/cgroup", 16384);
  if (!text) return std::nullopt;
  std::string_view rest = *text;
  std::optional<std::pair<std::uint64_t, std::string>> best;
  while (!rest.empty()) {
    const std::size_t newline = rest.find('\n');
    const std::string_view line = rest.substr(0, newline);
    rest = newline == std::string_view::npos ? std::string_view() : rest.substr(newline + 1);
    // "hierarchy-id:controllers:path"; the path may itself hold ':'.
    const std::size_t first = line.find(':');
    if (first == std::string_view::npos) continue;
    const std::size_t second = line.find(':', first + 1);
    if (second == std::string_view::npos) continue;
    const std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string_view path = line.substr(second + 1);
    if (!SafeCgroupPath(path)) continue;
    std::optional<std::pair<std::uint64_t, std::string>> found;
    if (line.substr(0, first) == "0" && controllers.empty()) {
      found = SmallestLimit(root + "/sys/fs/cgroup", std::string(path), "memory.max");
    } else {
      bool memory = false;
      std::size_t start = 0;
      while (start <= controllers.size()) {
        std::size_t comma = controllers.find(',', start);
        if (comma == std::string_view::npos) comma = controllers.size();
        memory = memory || controllers.substr(start, comma - start) == "memory";
        start = comma + 1;
      }
      if (memory) {
        found = SmallestLimit(root + "/sys/fs/cgroup/memory", std::string(path),
                              "memory.limit_in_bytes");
      }
    }
    if (found && (!best || found->first < best->first)) best = std::move(found);
  }
  return best;
}

std::uint64_t MemAvailableBytes(const std::string& root) {
  std::optional<std::string> text = ReadSmallFile(root + "/proc/meminfo", 16384);
  if (!text) return 0;
  constexpr std::string_view kKey = "MemAvailable:";
  const std::size_t at = text->find(kKey);
  if (at == std::string::npos) return 0;
  std::string_view value = std::string_view(*text).substr(at + kKey.size());
  value = Trim(value.substr(0, value.find('\n')));
  std::uint64_t kib = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), kib);
  if (ec != std::errc() || Trim(std::string_view(end, value.data() + value.size() - end)) != "kB" ||
      kib >= (std::uint64_t{1} << 50)) {
    return 0;
  }
  return kib * 1024;
}

std::uint64_t Ranks(int local_ranks) {
  return static_cast<std::uint64_t>(std::max(local_ranks, 1));
}

}  // namespace

void MemoryPlan::Add(std::string name, std::uint64_t bytes, std::string shrink) {
  if (bytes == 0) return;
  items_.push_back({std::move(name), bytes, std::move(shrink)});
}

std::uint64_t MemoryPlan::total_bytes() const {
  std::uint64_t total = 0;
  for (const MemoryItem& item : items_) {
    total = item.bytes > std::numeric_limits<std::uint64_t>::max() - total
                ? std::numeric_limits<std::uint64_t>::max()
                : total + item.bytes;
  }
  return total;
}

std::vector<MemoryItem> MemoryPlan::Largest(std::size_t n) const {
  std::vector<MemoryItem> sorted = items_;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const MemoryItem& a, const MemoryItem& b) { return a.bytes > b.bytes; });
  if (sorted.size() > n) sorted.resize(n);
  return sorted;
}

std::string MemoryPlan::Summary(std::size_t n) const {
  std::string out;
  for (const MemoryItem& item : Largest(n)) {
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {}", item.name, FormatBytes(item.bytes));
  }
  if (items_.size() > n) out += fmt::format(", {} more", items_.size() - n);
  return out.empty() ? std::string("nothing") : out;
}

MemoryBudget DetectHostMemoryBudget(int local_ranks, const std::string& root) {
  MemoryBudget budget;
  if (auto limit = CgroupLimit(root)) {
    budget.node_bytes = limit->first;
    budget.source = fmt::format("memory cgroup limit {}", limit->second.substr(root.size()));
  } else if (const std::uint64_t available = MemAvailableBytes(root); available > 0) {
    budget.node_bytes = available;
    budget.source = "MemAvailable of /proc/meminfo";
  } else {
    budget.source = "unknown (no memory cgroup limit, no /proc/meminfo)";
  }
  budget.rank_bytes = budget.node_bytes / Ranks(local_ranks);
  return budget;
}

Result<MemoryBudget> ResolveHostMemoryBudget(const config::HostMemoryBudgetConfig& config,
                                             int local_ranks, const std::string& root) {
  if (config.bytes > 0) {
    return MemoryBudget{.node_bytes = config.bytes,
                        .rank_bytes = config.bytes / Ranks(local_ranks),
                        .source = "zinf.host_memory_budget"};
  }
  MemoryBudget detected = DetectHostMemoryBudget(local_ranks, root);
  if (config.fraction <= 0) return detected;
  if (detected.node_bytes == 0) {
    return FailedPreconditionError(fmt::format(
        "zinf.host_memory_budget: {} is a fraction of the detected budget, and none was "
        "detected ({}); give bytes (\"8G\")",
        config.fraction, detected.source));
  }
  const auto bytes = static_cast<std::uint64_t>(
      std::floor(static_cast<double>(detected.node_bytes) * config.fraction));
  return MemoryBudget{.node_bytes = bytes,
                      .rank_bytes = bytes / Ranks(local_ranks),
                      .source = fmt::format("zinf.host_memory_budget {} of the {}", config.fraction,
                                            detected.source)};
}

Status CheckMemoryPlan(const MemoryPlan& plan, const MemoryBudget& budget, int local_ranks) {
  const std::uint64_t total = plan.total_bytes();
  if (budget.node_bytes == 0 || total <= budget.rank_bytes) return OkStatus();
  std::string largest;
  for (const MemoryItem& item : plan.Largest(3)) {
    if (!largest.empty()) largest += "; ";
    largest += fmt::format("{} {} (shrink: {})", item.name, FormatBytes(item.bytes), item.shrink);
  }
  return ResourceExhaustedError(fmt::format(
      "host memory plan: {} per rank, more than the budget of {} per rank ({} over {} rank(s) "
      "of this node, from {}); largest: {}; run on more nodes or fewer ranks per node, or raise "
      "zinf.host_memory_budget only if the memory is really there",
      FormatBytes(total), FormatBytes(budget.rank_bytes), FormatBytes(budget.node_bytes),
      Ranks(local_ranks), budget.source, largest));
}

}  // namespace zinf::engine
