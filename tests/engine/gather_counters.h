// Test helpers for ZeroEngine's stage-3 GatherCounters (engine.h): what changed between two
// readings, and a line that shows them in a failure message.
#pragma once

#include <string>

#include <fmt/format.h>

#include "zinf/engine/engine.h"

namespace zinf::engine::testing {

// `now` less `before`, counter by counter; peak_live_elems is `now`'s (a peak, not a count).
inline GatherCounters Delta(const GatherCounters& now, const GatherCounters& before) {
  return {.calls = now.calls - before.calls,
          .asked = now.asked - before.asked,
          .gathered = now.gathered - before.gathered,
          .prefetched = now.prefetched - before.prefetched,
          .served = now.served - before.served,
          .disk_reads = now.disk_reads - before.disk_reads,
          .read_ahead = now.read_ahead - before.read_ahead,
          .disk_waits = now.disk_waits - before.disk_waits,
          .peak_live_elems = now.peak_live_elems};
}

inline std::string Show(const GatherCounters& c) {
  return fmt::format(
      "calls {} asked {} gathered {} prefetched {} served {} disk_reads {} read_ahead {} "
      "disk_waits {} peak_live_elems {}",
      c.calls, c.asked, c.gathered, c.prefetched, c.served, c.disk_reads, c.read_ahead,
      c.disk_waits, c.peak_live_elems);
}

}  // namespace zinf::engine::testing
