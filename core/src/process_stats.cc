#include "zinf/core/process_stats.h"

#include <algorithm>

#include <fmt/format.h>

#include "zinf/core/units.h"

namespace zinf {

std::uint64_t CurrentRssBytes() {
  // "size resident shared text lib data dt", in pages: a short line, read once.
  const int fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[256];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  text[n] = '\0';
  unsigned long long size = 0, resident = 0;
  if (std::sscanf(text, "%llu %llu", &size, &resident) != 2) return 0;
  const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<std::uint64_t>(resident) * static_cast<std::uint64_t>(page) : 0;
}

Status CheckHostMemoryShare(std::uint64_t need_bytes, int ranks_on_node, std::string_view who,
                            std::string_view detail, std::string_view advice) {
  const std::uint64_t machine = MachineMemoryBytes();
  const auto local = static_cast<std::uint64_t>(std::max(ranks_on_node, 1));
  if (machine == 0 || need_bytes <= machine / local) return OkStatus();
  return ResourceExhaustedError(fmt::format(
      "{} at least {} of host memory{}, more than its share of this machine: {} of RAM + swap "
      "over {} rank(s); {}",
      who, FormatBytes(need_bytes), detail, FormatBytes(machine), local, advice));
}

}  // namespace zinf
