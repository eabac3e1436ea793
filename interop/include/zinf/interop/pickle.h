// Python pickles as torch.save writes them (protocol 2), read without running any code: a small
// stack machine that knows the opcodes of protocols 0-4 torch and DeepSpeed checkpoints use and
// builds the values below. A GLOBAL is looked up in a fixed table of the names those checkpoints
// hold (torch's tensor rebuild, storages and dtypes, OrderedDict, torch.Size, and DeepSpeed's
// fragment_address, loss scalers and ZeroStageEnum); any other name is an error naming it,
// before anything is built with it, so a pickle that would run code (os.system, eval, ...) is
// refused, not run. Every count, length, depth and memo index is bounded by PickleLimits before
// it is used. WritePickle writes the same values back as protocol 2.
#ifndef ZINF_INTEROP_PICKLE_H_
#define ZINF_INTEROP_PICKLE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::interop {

struct PyValue;

struct PyNone {};
struct PyList {
  std::vector<PyValue> items;
};
// A tuple; `torch_size` when it was (and is to be written as) a torch.Size.
struct PyTuple {
  std::vector<PyValue> items;
  bool torch_size = false;
};
// A dict in insertion order; `ordered` when it was (is to be written as) a
// collections.OrderedDict. A set or frozenset is read as a PyList.
struct PyDict {
  std::vector<std::pair<PyValue, PyValue>> items;
  bool ordered = false;

  // The value of the str key `key`, or nullptr.
  const PyValue* Find(std::string_view key) const;
};
// A tensor: a view (offset, shape, stride, in elements) of a storage, which a torch file holds
// as the zip entry "<archive>/data/<storage_key>".
struct PyTensor {
  std::string dtype;  // "float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", ...
  std::string storage_key;
  std::string location;  // "cpu", "cuda:0", ...
  std::uint64_t storage_numel = 0;
  std::uint64_t offset = 0;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> stride;
  bool requires_grad = false;
};
// A torch dtype object (torch.float16), pickled by name.
struct PyDtype {
  std::string name;  // "float16", ...
};
// An instance of one of the allowed classes (DeepSpeed's fragment_address, LossScaler,
// DynamicLossScaler): its module and class name and the state BUILD gave it (a PyDict; an empty
// one when the pickle had no BUILD). WritePickle writes no BUILD for a null state.
struct PyObject {
  std::string module;
  std::string name;
  std::shared_ptr<PyValue> state;
};

struct PyValue {
  std::variant<PyNone, bool, std::int64_t, double, std::string, PyList, PyTuple, PyDict, PyTensor,
               PyDtype, PyObject>
      v;

  PyValue() = default;
  template <typename T>
  PyValue(T value) : v(std::move(value)) {}  // NOLINT: implicit, for building trees

  template <typename T>
  bool is() const { return std::holds_alternative<T>(v); }
  template <typename T>
  const T* as() const { return std::get_if<T>(&v); }
  // "None", "bool", "int", "float", "str", "list", "tuple", "dict", "tensor", "dtype" or the
  // object's class name: for errors.
  std::string TypeName() const;
};

struct PickleLimits {
  std::uint64_t max_bytes = 1 << 30;       // of the pickle itself
  std::uint64_t max_depth = 100;           // of nested containers (taken as 1000 if larger)
  std::uint64_t max_items = 1 << 22;       // of all containers' items together (~176 B each)
  std::uint64_t max_string_bytes = 1 << 26;
  std::uint64_t max_memo = 1 << 24;
};

// The value `bytes` pickles. Errors: DataLoss naming the byte offset and what is wrong (an
// unknown opcode, a truncated pickle, a stack or mark that does not add up, a memo index never
// stored, an integer beyond 64 bits, a container deeper or larger than `limits`, a container
// that holds itself; shared objects count at each use, as the tree copies them), and
// InvalidArgument "pickle names <module>.<name>, which zinf does not load (no code is run)" for a
// global outside the table (also for a bare storage or an allowed class or function that is a
// value of the tree rather than called).
Result<PyValue> ReadPickle(std::string_view bytes, const PickleLimits& limits = {});

// `value` as a protocol-2 pickle (tensors as torch's persistent ids and _rebuild_tensor_v2, a
// PyObject as NEWOBJ + BUILD). Errors: InvalidArgument for what protocol 2 cannot hold (a dict
// key that is not str, int or tuple; nesting deeper than 100).
Result<std::string> WritePickle(const PyValue& value);

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_PICKLE_H_
