#include "zinf/core/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <ctime>
#include <mutex>
#include <string>

#include "zinf/core/check.h"
#include "zinf/core/env.h"

namespace zinf {
namespace {

struct LogState {
  std::atomic<int> level{static_cast<int>(LogLevel::kInfo)};
  std::atomic<bool> all_ranks{false};
};

// Reads ZINF_LOG_LEVEL and ZINF_LOG_ALL_RANKS once, before the first line, and warns about
// unknown ZINF_* variables (after the state exists, so the warning itself can be logged).
LogState& State() {
  static LogState state;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string bad_level;
    if (auto text = GetEnv("ZINF_LOG_LEVEL")) {
      LogLevel level;
      if (ParseLogLevel(*text, &level)) {
        state.level.store(static_cast<int>(level));
      } else {
        bad_level = *text;
      }
    }
    if (auto all = GetEnv("ZINF_LOG_ALL_RANKS")) state.all_ranks.store(*all != "0");
    if (!bad_level.empty()) {
      LogLine(LogLevel::kWarn,
              fmt::format("ZINF_LOG_LEVEL='{}' is not one of trace|debug|info|warn|error|off; "
                          "using info",
                          bad_level));
    }
    if (std::string unknown = UnknownZinfEnvVars(); !unknown.empty()) {
      LogLine(LogLevel::kWarn, fmt::format("unknown ZINF_* environment variables ignored: {} "
                                           "(README.md lists the known ones)",
                                           unknown));
    }
  });
  return state;
}

std::string_view LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return "trace";
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

}  // namespace

bool ParseLogLevel(std::string_view text, LogLevel* level) {
  std::string lower;
  for (char c : text) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  static constexpr std::pair<std::string_view, LogLevel> kNames[] = {
      {"trace", LogLevel::kTrace}, {"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
      {"warn", LogLevel::kWarn},   {"warning", LogLevel::kWarn}, {"error", LogLevel::kError},
      {"off", LogLevel::kOff}};
  for (const auto& [name, value] : kNames) {
    if (lower == name) {
      *level = value;
      return true;
    }
  }
  return false;
}

void SetLogLevel(LogLevel level) { State().level.store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(State().level.load()); }
void SetLogAllRanks(bool all_ranks) { State().all_ranks.store(all_ranks); }

bool LogEnabled(LogLevel level) {
  LogState& state = State();
  if (level == LogLevel::kOff || static_cast<int>(level) < state.level.load()) return false;
  if (level >= LogLevel::kWarn || state.all_ranks.load()) return true;
  return ProcessRank() <= 0;  // rank 0, or a process that is not part of an MPI job
}

std::string EscapeForTerminal(std::string_view text, bool keep_newlines) {
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c >= 0x20 && c < 0x7f && c != '\\') || (keep_newlines && (c == '\n' || c == '\t'))) {
      out.push_back(ch);
    } else if (c == '\\') {
      out += "\\\\";
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out;
}

namespace {

// Control characters other than newline and tab escaped as \xNN: the C0 set and DEL, the C1 set
// (U+0080-U+009F, which some terminals obey as escape sequences: U+009B is CSI) and bytes that
// are not valid UTF-8. Valid UTF-8 text passes unchanged.
std::string EscapeControls(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  auto escape = [&out](std::string_view bytes) {
    for (const char ch : bytes) out += fmt::format("\\x{:02x}", static_cast<unsigned char>(ch));
  };
  std::size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) {
        escape(text.substr(i, 1));
      } else {
        out.push_back(text[i]);
      }
      ++i;
      continue;
    }
    // A UTF-8 sequence: its length from the lead byte, then continuation bytes 10xxxxxx.
    const std::size_t length = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
    bool valid = length != 0 && i + length <= text.size() && !(c > 0xf4);
    for (std::size_t k = 1; valid && k < length; ++k) {
      valid = (static_cast<unsigned char>(text[i + k]) & 0xc0) == 0x80;
    }
    if (!valid) {
      escape(text.substr(i, 1));
      ++i;
      continue;
    }
    // U+0080-U+009F are C2 80 - C2 9F.
    const bool c1 = length == 2 && c == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0;
    if (c1) {
      escape(text.substr(i, length));
    } else {
      out.append(text.substr(i, length));
    }
    i += length;
  }
  return out;
}

}  // namespace

void LogLine(LogLevel level, std::string_view message) {
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm local;
  localtime_r(&tv.tv_sec, &local);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &local);
  int rank = ProcessRank();
  int size = ProcessWorldSize();
  std::string rank_text = rank < 0 ? std::string("rank ?")
                                   : fmt::format("rank {}/{}", rank, size < 0 ? 1 : size);
  std::string line = fmt::format("[{}.{:03d}] [{}] [{}] {}\n", when, tv.tv_usec / 1000,
                                 LevelName(level), rank_text, EscapeControls(message));
  // One write per line keeps lines of concurrent threads and ranks whole.
  std::string_view rest = line;
  while (!rest.empty()) {
    ssize_t n = ::write(STDERR_FILENO, rest.data(), rest.size());
    if (n <= 0) break;
    rest.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace zinf
