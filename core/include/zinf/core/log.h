// Rank-aware logging. Every line carries the time, the level and "rank r/N":
//
//   [2026-11-30 16:40:01.123] [info] [rank 0/4] swap store ready: 3 paths, 12.0 GiB
//
// INFO, DEBUG and TRACE lines are printed by rank 0 only (every rank with ZINF_LOG_ALL_RANKS=1);
// WARN and ERROR lines by every rank. ZINF_LOG_LEVEL (trace|debug|info|warn|error|off, default
// info) selects the level. Lines go to stderr. The rank comes from zinf::SetProcessRank, which
// comm::MpiSession calls; logging before that shows the launcher's rank or "rank ?".
//
// Thread safe.
#pragma once

#include <string>
#include <string_view>

#include <fmt/format.h>

namespace zinf {

enum class LogLevel : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 5 };

// Parses "trace", "debug", "info", "warn"/"warning", "error", "off" (case-insensitive).
bool ParseLogLevel(std::string_view text, LogLevel* level);

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
void SetLogAllRanks(bool all_ranks);

// True when a line of `level` would be printed by this rank.
bool LogEnabled(LogLevel level);

// Writes one line. Control characters in `message` (C0 such as ESC, CR, BEL but not newline or
// tab; DEL; the C1 set U+0080-U+009F) and bytes that are not valid UTF-8 are escaped as \xNN, so
// text that came from a file or the environment cannot drive the terminal.
void LogLine(LogLevel level, std::string_view message);

// `text` with every byte outside printable ASCII (0x20-0x7e) written as \xNN and backslashes
// doubled; with `keep_newlines`, '\n' and '\t' pass unchanged. For strings read from files
// (parameter names, attributes) before they reach a terminal.
std::string EscapeForTerminal(std::string_view text, bool keep_newlines = false);

template <typename... Args>
void Log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (!LogEnabled(level)) return;
  LogLine(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace zinf

#define ZINF_LOG_TRACE(...) ::zinf::Log(::zinf::LogLevel::kTrace, __VA_ARGS__)
#define ZINF_LOG_DEBUG(...) ::zinf::Log(::zinf::LogLevel::kDebug, __VA_ARGS__)
#define ZINF_LOG_INFO(...) ::zinf::Log(::zinf::LogLevel::kInfo, __VA_ARGS__)
#define ZINF_LOG_WARN(...) ::zinf::Log(::zinf::LogLevel::kWarn, __VA_ARGS__)
#define ZINF_LOG_ERROR(...) ::zinf::Log(::zinf::LogLevel::kError, __VA_ARGS__)
