// Checks for programmer errors: a broken invariant is not a Status, it aborts the process with
// the rank, the condition, the location and a message, so that mpirun ends the whole job.
//
//   ZINF_CHECK(offset % alignment == 0, "offset {} not aligned to {}", offset, alignment);
//   ZINF_CHECK_EQ(a.size(), b.size());
//
// Checks stay on in release builds. Use them only for conditions that no input can cause; bad
// input gets an InvalidArgument Status instead.
#pragma once

#include <string>
#include <string_view>

#include <fmt/format.h>

namespace zinf {

// The rank printed by failed checks and log lines. comm::MpiSession sets it; before that (or
// without MPI) it is read from the launcher's environment (OMPI_COMM_WORLD_RANK, PMI_RANK), else
// -1 ("rank ?").
void SetProcessRank(int world_rank, int world_size);
int ProcessRank();
int ProcessWorldSize();

namespace internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const std::string& message);
}  // namespace internal

}  // namespace zinf

#define ZINF_CHECK(condition, ...)                                                       \
  do {                                                                                   \
    if (!(condition)) [[unlikely]] {                                                     \
      ::zinf::internal::CheckFailed(__FILE__, __LINE__, #condition,                      \
                                    ::fmt::format("" __VA_OPT__(__VA_ARGS__)));          \
    }                                                                                    \
  } while (false)

#define ZINF_CHECK_OP_(op, a, b)                                                         \
  do {                                                                                   \
    const auto& zinf_check_a_ = (a);                                                     \
    const auto& zinf_check_b_ = (b);                                                     \
    if (!(zinf_check_a_ op zinf_check_b_)) [[unlikely]] {                                \
      ::zinf::internal::CheckFailed(__FILE__, __LINE__, #a " " #op " " #b,               \
                                    ::fmt::format("{} vs {}", zinf_check_a_, zinf_check_b_)); \
    }                                                                                    \
  } while (false)

#define ZINF_CHECK_EQ(a, b) ZINF_CHECK_OP_(==, a, b)
#define ZINF_CHECK_NE(a, b) ZINF_CHECK_OP_(!=, a, b)
#define ZINF_CHECK_LT(a, b) ZINF_CHECK_OP_(<, a, b)
#define ZINF_CHECK_LE(a, b) ZINF_CHECK_OP_(<=, a, b)
#define ZINF_CHECK_GT(a, b) ZINF_CHECK_OP_(>, a, b)
#define ZINF_CHECK_GE(a, b) ZINF_CHECK_OP_(>=, a, b)
