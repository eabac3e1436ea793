// Measurements of this process for logs, metrics and benchmarks.
//
//   const double start = zinf::MonotonicSeconds();
//   ...
//   ZINF_LOG_INFO("{:.3f} s, peak RSS {}", zinf::MonotonicSeconds() - start,
//                 zinf::FormatBytes(zinf::PeakRssBytes()));
//
// Thread safety: all may be called from any thread.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf {

// Seconds on the steady clock (arbitrary origin): only differences mean something.
inline double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The peak resident set size of this process so far (getrusage's ru_maxrss), in bytes.
inline std::uint64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
}

// The resident set size of this process now (/proc/self/statm), in bytes; 0 if unknown.
std::uint64_t CurrentRssBytes();

// Restarts PeakRssBytes() from the current RSS (Linux: "5" written to /proc/self/clear_refs
// resets the high-water mark), so that a benchmark running several configurations in one
// process reports each one's own peak rather than the largest so far. False if the kernel
// refused: PeakRssBytes() then still covers the whole process.
inline bool ResetPeakRss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool reset = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return reset;
}

// The machine's RAM plus swap (sysinfo), in bytes: what all processes together could ever
// allocate. 0 if unknown.
inline std::uint64_t MachineMemoryBytes() {
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return 0;
  return (static_cast<std::uint64_t>(info.totalram) + info.totalswap) * info.mem_unit;
}

// The host-memory preflight of the engine and of zinf-train: OK when `need_bytes` fits in this
// rank's share of the machine (MachineMemoryBytes() over the node's `ranks_on_node` ranks; OK
// too when the machine's memory is unknown), else ResourceExhausted "<who> at least <need> of
// host memory<detail>, more than its share of this machine: <M> of RAM + swap over <K> rank(s);
// <advice>", before anything is allocated.
Status CheckHostMemoryShare(std::uint64_t need_bytes, int ranks_on_node, std::string_view who,
                            std::string_view detail, std::string_view advice);

// The memory the kernel estimates new allocations can take without swapping (MemAvailable in
// /proc/meminfo), in bytes. 0 if unknown.
inline std::uint64_t AvailableMemoryBytes() {
  std::FILE* file = std::fopen("/proc/meminfo", "re");
  if (file == nullptr) return 0;
  char line[256];
  std::uint64_t bytes = 0;
  for (int lines = 0; lines < 256 && std::fgets(line, sizeof(line), file) != nullptr; ++lines) {
    unsigned long long kib = 0;
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1 && kib < (1ull << 50)) {
      bytes = static_cast<std::uint64_t>(kib) * 1024;
      break;
    }
  }
  std::fclose(file);
  return bytes;
}

}  // namespace zinf
