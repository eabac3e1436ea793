#include "zinf/core/process_stats.h"

#include <algorithm>

#include <fmt/format.h>

#include "zinf/core/units.h"

namespace zinf {

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
