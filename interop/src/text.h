// Text read from a file (zip entry names, pickle strings, storage keys) as it goes into an error
// message: at most `max` bytes of it, every byte outside printable ASCII as \xNN
// (core::EscapeForTerminal), so a hostile file cannot drive the terminal that shows the error.
#ifndef ZINF_INTEROP_SRC_TEXT_H_
#define ZINF_INTEROP_SRC_TEXT_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "zinf/core/log.h"

namespace zinf::interop {

inline std::string Printable(std::string_view text, std::size_t max = 128) {
  std::string out = EscapeForTerminal(text.substr(0, max));
  if (text.size() > max) out += "...";
  return out;
}

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_SRC_TEXT_H_
