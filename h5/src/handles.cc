#include "handles.h"

#include <H5PLpublic.h>

#include <array>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/check.h"

namespace zinf::h5::handles {
namespace {

herr_t CollectFrame(unsigned /*n*/, const H5E_error2_t* frame, void* client_data) {
  auto* lines = static_cast<std::vector<std::string>*>(client_data);
  std::string line = fmt::format("{}: {}", frame->func_name != nullptr ? frame->func_name : "?",
                                 frame->desc != nullptr ? frame->desc : "");
  // The minor message ("file signature not found", "can't open object") is often the most
  // telling part and is not repeated in the description.
  std::array<char, 256> minor{};
  if (H5Eget_msg(frame->min_num, nullptr, minor.data(), minor.size()) > 0) {
    line += fmt::format(" ({})", minor.data());
  }
  lines->push_back(std::move(line));
  return 0;
}

}  // namespace

void InitHdf5() {
  ZINF_CHECK(H5open() >= 0, "H5open failed");
  // Per library instance (and per thread in thread-safe builds), so cheap to repeat; repeating
  // also covers a library that was closed and reopened.
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  // A file must not make this process load code: no filter or VOL plugins from HDF5_PLUGIN_PATH.
  // (zinf writes no filters, and datasets with filters are refused when opened anyway.)
  static const bool plugins_off = H5PLset_loading_state(0) >= 0;
  ZINF_CHECK(plugins_off, "H5PLset_loading_state(0) failed");
}

std::string ErrorStackText() {
  std::vector<std::string> lines;
  // Downward: the API call first, the innermost failure last, as h5dump and H5Eprint show it.
  if (H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, &CollectFrame, &lines) < 0) {
    return "(HDF5 error stack unreadable)";
  }
  if (lines.empty()) return "(HDF5 error stack empty)";
  return fmt::format("{}", fmt::join(lines, "; "));
}

Error StackError(ErrorCode code, std::string_view what, std::source_location loc) {
  std::string message = fmt::format("{}: HDF5 error stack: {}", what, ErrorStackText());
  H5Eclear2(H5E_DEFAULT);
  return Error(code, std::move(message), 0, loc);
}

}  // namespace zinf::h5::handles
