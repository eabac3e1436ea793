// Every ZINF_* environment variable is read through here (and listed in the table in env.cc and in
// README.md), so the set of knobs is in one place.
// A ZINF_* variable that is not known is reported once as a WARN line (a misspelt knob must not
// be silently ignored).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace zinf {

struct EnvVarInfo {
  std::string_view name;
  std::string_view description;
};

// The known variables with a one-line description (for README and --help texts).
std::span<const EnvVarInfo> KnownEnvVars();

// The current value of a known ZINF_* variable, or nullopt when it is
// unset or empty. Asking for an unknown name is a programmer error (checked).
std::optional<std::string> GetEnv(std::string_view name);

// Returns the ZINF_* variables in the environment that are not known, for the warning above.
std::string UnknownZinfEnvVars();

}  // namespace zinf
