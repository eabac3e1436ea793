#include "zinf/core/check.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace zinf {
namespace {

std::atomic<int> g_world_rank{-2};  // -2: not set and not looked up yet
std::atomic<int> g_world_size{-2};

int RankFromLauncherEnv(const char* const* names) {
  for (const char* const* name = names; *name != nullptr; ++name) {
    if (const char* value = std::getenv(*name); value != nullptr && *value != '\0') {
      char* end = nullptr;
      long v = std::strtol(value, &end, 10);
      if (*end == '\0' && v >= 0) return static_cast<int>(v);
    }
  }
  return -1;
}

}  // namespace

void SetProcessRank(int world_rank, int world_size) {
  g_world_rank.store(world_rank);
  g_world_size.store(world_size);
}

int ProcessRank() {
  int rank = g_world_rank.load();
  if (rank == -2) {
    static const char* const kNames[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", nullptr};
    rank = RankFromLauncherEnv(kNames);
  }
  return rank;
}

int ProcessWorldSize() {
  int size = g_world_size.load();
  if (size == -2) {
    static const char* const kNames[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", nullptr};
    size = RankFromLauncherEnv(kNames);
  }
  return size;
}

namespace internal {

void CheckFailed(const char* file, int line, const char* condition, const std::string& message) {
  // One write so that lines of several ranks do not interleave mid-line.
  std::string text = fmt::format("zinf: rank {}: CHECK failed at {}:{}: {}{}{}\n",
                                 ProcessRank() < 0 ? std::string("?")
                                                   : std::to_string(ProcessRank()),
                                 file, line, condition, message.empty() ? "" : ": ", message);
  ssize_t ignored = ::write(STDERR_FILENO, text.data(), text.size());
  (void)ignored;
  std::abort();
}

}  // namespace internal
}  // namespace zinf
