#include "zinf/core/json.h"

#include <string>
#include <string_view>
#include <vector>

namespace zinf::json_internal {

std::string DescribePath(const std::vector<std::string>& keys) {
  constexpr std::size_t kMaxShown = 120;
  std::string path;
  for (const std::string& key : keys) {
    if (key.empty()) continue;
    if (key == "[]") {
      path += "[]";
    } else {
      if (!path.empty()) path += '.';
      path += key;
    }
    if (path.size() > kMaxShown) return path.substr(0, kMaxShown) + "...";
  }
  return path.empty() ? std::string("the top level") : path;
}

std::string StripExceptionPrefix(std::string_view what) {
  if (what.starts_with("[json.exception.")) {
    if (const std::size_t close = what.find("] "); close != std::string_view::npos) {
      what.remove_prefix(close + 2);
    }
  }
  return std::string(what);
}

}  // namespace zinf::json_internal
