// Private to zinf::h5: move-only owners of HDF5 hid_t handles and the conversion of HDF5's
// error stack into a zinf::Error. Only h5/src and h5's tests include this file; hid_t
// never appears in a public header.
//
// Thread safety: HDF5 here is not thread-safe; everything below runs on one thread at a time.
#pragma once

#include <hdf5.h>

#include <source_location>
#include <string>
#include <string_view>
#include <utility>

#include "zinf/core/status.h"

namespace zinf::h5::handles {

// Turns HDF5's automatic error printing off (once per process) and initializes the library.
// Every entry point that calls HDF5 first calls this.
void InitHdf5();

// An Error with `code` whose message is "<what>: HDF5 error stack: <f>: <desc>; <f>: <desc>..."
// (the current error stack of this thread, innermost call last), then clears the stack.
Error StackError(ErrorCode code, std::string_view what,
                 std::source_location loc = std::source_location::current());

// The current error stack as "function: description" lines joined by "; " (empty if none).
// Does not clear it.
std::string ErrorStackText();

// Owns one hid_t and closes it with `CloseFn`. Move-only; a moved-from handle is empty
// (H5I_INVALID_HID). The destructor closes and ignores errors (clearing the stack it leaves).
template <herr_t (*CloseFn)(hid_t)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id) : id_(id) {}
  ~Handle() { Reset(); }
  Handle(Handle&& other) noexcept : id_(std::exchange(other.id_, H5I_INVALID_HID)) {}
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      Reset();
      id_ = std::exchange(other.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  explicit operator bool() const { return valid(); }

  // Closes the handle and reports a failure (with the HDF5 stack). Empty afterwards either way.
  Status Close(std::string_view what, ErrorCode code = ErrorCode::kInternal) {
    if (!valid()) return OkStatus();
    const hid_t id = std::exchange(id_, H5I_INVALID_HID);
    if (CloseFn(id) < 0) return StackError(code, what);
    return OkStatus();
  }

  // Closes and ignores errors.
  void Reset() {
    if (!valid()) return;
    if (CloseFn(std::exchange(id_, H5I_INVALID_HID)) < 0) H5Eclear2(H5E_DEFAULT);
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

using FileHandle = Handle<H5Fclose>;
using DatasetHandle = Handle<H5Dclose>;
using DataspaceHandle = Handle<H5Sclose>;
using PropListHandle = Handle<H5Pclose>;
using AttributeHandle = Handle<H5Aclose>;
using GroupHandle = Handle<H5Gclose>;
using DatatypeHandle = Handle<H5Tclose>;  // only for types we made or were given; never predefined
using ObjectHandle = Handle<H5Oclose>;    // a group, dataset or named datatype opened by path

// Wraps a returned hid_t: negative -> StackError(code, what).
template <typename H>
Result<H> Check(hid_t id, ErrorCode code, std::string_view what,
                std::source_location loc = std::source_location::current()) {
  if (id < 0) return StackError(code, what, loc);
  return H(id);
}

// Wraps a returned herr_t (or htri_t used as status): negative -> StackError(code, what).
inline Status CheckErr(herr_t rc, ErrorCode code, std::string_view what,
                       std::source_location loc = std::source_location::current()) {
  if (rc < 0) return StackError(code, what, loc);
  return OkStatus();
}

}  // namespace zinf::h5::handles
