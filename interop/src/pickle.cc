#include "zinf/interop/pickle.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <unordered_map>

#include <fmt/format.h>

#include "text.h"

namespace zinf::interop {

// ---------------------------------------------------------------------------------------------
// The values.

std::string PyValue::TypeName() const {
  struct Visitor {
    std::string operator()(const PyNone&) const { return "None"; }
    std::string operator()(bool) const { return "bool"; }
    std::string operator()(std::int64_t) const { return "int"; }
    std::string operator()(double) const { return "float"; }
    std::string operator()(const std::string&) const { return "str"; }
    std::string operator()(const PyList&) const { return "list"; }
    std::string operator()(const PyTuple&) const { return "tuple"; }
    std::string operator()(const PyDict&) const { return "dict"; }
    std::string operator()(const PyTensor&) const { return "tensor"; }
    std::string operator()(const PyDtype&) const { return "dtype"; }
    std::string operator()(const PyObject& o) const { return o.name; }
  };
  return std::visit(Visitor{}, v);
}

const PyValue* PyDict::Find(std::string_view key) const {
  for (const auto& [k, value] : items) {
    if (const auto* s = k.as<std::string>(); s != nullptr && *s == key) return &value;
  }
  return nullptr;
}

namespace {

// ---------------------------------------------------------------------------------------------
// The globals zinf knows: each maps to an inert constructor below; nothing named in a pickle is
// ever imported or called.

enum class Global : std::uint8_t {
  kRebuildTensor,              // torch._utils._rebuild_tensor (storage, offset, size, stride)
  kRebuildTensorV2,            // ... _v2 (+ requires_grad, hooks [, metadata])
  kRebuildParameter,           // (tensor, requires_grad, hooks)
  kRebuildParameterWithState,  // (tensor, requires_grad, hooks, state)
  kStorageClass,               // arg: the dtype its persistent ids hold
  kDtype,                      // arg: the dtype name; a value, not a callable
  kOrderedDict,
  kTorchSize,
  kSet,  // set and frozenset: read as a list
  kZeroStageEnum,
  kGetattr,               // only getattr(ZeroStageEnum, name)
  kClass,                 // an allowed class: NEWOBJ then BUILD
  kCopyregNewobj,         // copyreg.__newobj__(cls): protocol 0/1 spelling of NEWOBJ
  kCopyregReconstructor,  // copyreg._reconstructor(cls, object, None)
  kObjectBase,            // builtins.object, only as _reconstructor's argument
};

struct GlobalEntry {
  std::string_view module;
  std::string_view name;
  Global kind;
  std::string_view arg;
};

constexpr GlobalEntry kGlobals[] = {
    {"torch._utils", "_rebuild_tensor", Global::kRebuildTensor, ""},
    {"torch._utils", "_rebuild_tensor_v2", Global::kRebuildTensorV2, ""},
    {"torch._utils", "_rebuild_parameter", Global::kRebuildParameter, ""},
    {"torch._utils", "_rebuild_parameter_with_state", Global::kRebuildParameterWithState, ""},
    // Storage classes, in the order WritePickle looks a dtype up (first match).
    {"torch", "FloatStorage", Global::kStorageClass, "float32"},
    {"torch", "HalfStorage", Global::kStorageClass, "float16"},
    {"torch", "BFloat16Storage", Global::kStorageClass, "bfloat16"},
    {"torch", "DoubleStorage", Global::kStorageClass, "float64"},
    {"torch", "LongStorage", Global::kStorageClass, "int64"},
    {"torch", "IntStorage", Global::kStorageClass, "int32"},
    {"torch", "ShortStorage", Global::kStorageClass, "int16"},
    {"torch", "CharStorage", Global::kStorageClass, "int8"},
    {"torch", "ByteStorage", Global::kStorageClass, "uint8"},
    {"torch", "BoolStorage", Global::kStorageClass, "bool"},
    {"torch", "ComplexFloatStorage", Global::kStorageClass, "complex64"},
    {"torch", "ComplexDoubleStorage", Global::kStorageClass, "complex128"},
    // torch 1.13 names an untyped storage's class torch.storage.UntypedStorage; its numel is bytes.
    {"torch.storage", "UntypedStorage", Global::kStorageClass, "uint8"},
    {"torch", "UntypedStorage", Global::kStorageClass, "uint8"},
    {"torch", "float16", Global::kDtype, "float16"},
    {"torch", "bfloat16", Global::kDtype, "bfloat16"},
    {"torch", "float32", Global::kDtype, "float32"},
    {"torch", "float64", Global::kDtype, "float64"},
    {"torch", "int8", Global::kDtype, "int8"},
    {"torch", "int16", Global::kDtype, "int16"},
    {"torch", "int32", Global::kDtype, "int32"},
    {"torch", "int64", Global::kDtype, "int64"},
    {"torch", "uint8", Global::kDtype, "uint8"},
    {"torch", "bool", Global::kDtype, "bool"},
    {"torch", "complex64", Global::kDtype, "complex64"},
    {"torch", "complex128", Global::kDtype, "complex128"},
    {"collections", "OrderedDict", Global::kOrderedDict, ""},
    {"torch", "Size", Global::kTorchSize, ""},
    {"builtins", "set", Global::kSet, ""},
    {"__builtin__", "set", Global::kSet, ""},
    {"builtins", "frozenset", Global::kSet, ""},
    {"__builtin__", "frozenset", Global::kSet, ""},
    {"deepspeed.runtime.zero.config", "ZeroStageEnum", Global::kZeroStageEnum, ""},
    {"builtins", "getattr", Global::kGetattr, ""},
    {"__builtin__", "getattr", Global::kGetattr, ""},
    {"deepspeed.utils.tensor_fragment", "fragment_address", Global::kClass, ""},
    {"deepspeed.runtime.fp16.loss_scaler", "LossScaler", Global::kClass, ""},
    {"deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", Global::kClass, ""},
    {"copyreg", "__newobj__", Global::kCopyregNewobj, ""},
    {"copy_reg", "__newobj__", Global::kCopyregNewobj, ""},
    {"copyreg", "_reconstructor", Global::kCopyregReconstructor, ""},
    {"copy_reg", "_reconstructor", Global::kCopyregReconstructor, ""},
    {"builtins", "object", Global::kObjectBase, ""},
    {"__builtin__", "object", Global::kObjectBase, ""},
};

std::optional<std::uint32_t> FindGlobal(std::string_view module, std::string_view name) {
  for (std::uint32_t i = 0; i < std::size(kGlobals); ++i) {
    if (kGlobals[i].module == module && kGlobals[i].name == name) return i;
  }
  return std::nullopt;
}

// ZeroStageEnum's members (deepspeed/runtime/zero/config.py).
constexpr std::pair<std::string_view, std::int64_t> kZeroStages[] = {
    {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3}};

Error UnknownGlobal(std::string_view module, std::string_view name, std::uint64_t offset) {
  return InvalidArgumentError(
      fmt::format("pickle names {}.{}, which zinf does not load (no code is run); at byte {}",
                  Printable(module), Printable(name), offset));
}

// UTF-8 as Python's pickler writes it ('surrogatepass': encoded surrogates allowed).
bool IsUtf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i <= n) return false;
    for (std::size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    constexpr std::uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff) return false;
    i += n + 1;
  }
  return true;
}

// A tensor's elements must lie in its storage: offset + sum((size-1)*stride) < numel, sizes and
// strides non-negative, no overflow. Empty text when it does.
std::string TensorExtentProblem(const PyTensor& t) {
  if (t.shape.size() != t.stride.size()) {
    return fmt::format("{} sizes but {} strides", t.shape.size(), t.stride.size());
  }
  std::uint64_t last = t.offset;  // the highest element index the view touches
  bool empty = false;
  for (std::size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] < 0 || t.stride[i] < 0) {
      return fmt::format("negative size or stride in dimension {}", i);
    }
    if (t.shape[i] == 0) empty = true;
  }
  if (empty) return t.offset <= t.storage_numel ? "" : "offset beyond its storage";
  for (std::size_t i = 0; i < t.shape.size(); ++i) {
    std::uint64_t span = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(t.shape[i] - 1),
                               static_cast<std::uint64_t>(t.stride[i]), &span) ||
        __builtin_add_overflow(last, span, &last)) {
      return "extent overflows";
    }
  }
  if (last >= t.storage_numel) {
    return fmt::format("reaches element {} of a storage of {}", last, t.storage_numel);
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// The reader: a stack machine over an arena of nodes. Containers, strings and other objects
// are nodes referenced by index, so that a memo GET shares the object as Python's does (a dict
// memoized when empty and filled later is found filled), and cycles cost nothing until the tree
// is built at STOP, where depth and size are bounded.

using NodeId = std::uint32_t;
struct Ref {
  NodeId id;
};
using Val = std::variant<PyNone, bool, std::int64_t, double, Ref>;

enum class NodeKind : std::uint8_t {
  kStr,
  kList,
  kTuple,
  kDict,  // items: key, value, key, value, ...
  kSet,
  kObject,  // entry: its class; items: [state] once built
  kTensor,
  kStorage,  // a persistent id: tensor holds dtype, key, location, numel
  kDtype,    // entry: the torch dtype
  kGlobal,   // entry: a callable or class of kGlobals
};

struct Node {
  NodeKind kind;
  bool flag = false;  // kTuple: torch.Size; kDict: OrderedDict
  std::uint32_t entry = 0;
  std::string str;
  std::vector<Val> items;
  std::unique_ptr<PyTensor> tensor;
};

// Nesting of the recursive tree build is capped here whatever max_depth says, so that the C++
// stack stays small.
constexpr std::uint64_t kHardMaxDepth = 1000;

namespace op {
enum : std::uint8_t {
  kMark = '(',
  kStop = '.',
  kPop = '0',
  kPopMark = '1',
  kDup = '2',
  kFloat = 'F',
  kInt = 'I',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kLong = 'L',
  kBinInt2 = 'M',
  kNone = 'N',
  kBinPersId = 'Q',
  kReduce = 'R',
  kBinString = 'T',
  kShortBinString = 'U',
  kBinUnicode = 'X',
  kAppend = 'a',
  kBuild = 'b',
  kGlobal = 'c',
  kDict = 'd',
  kEmptyDict = '}',
  kAppends = 'e',
  kGet = 'g',
  kBinGet = 'h',
  kInst = 'i',
  kLongBinGet = 'j',
  kList = 'l',
  kEmptyList = ']',
  kPut = 'p',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kEmptyTuple = ')',
  kSetItems = 'u',
  kBinFloat = 'G',
  kBinBytes = 'B',
  kShortBinBytes = 'C',
  kProto = 0x80,
  kNewObj = 0x81,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
  kLong4 = 0x8b,
  kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d,
  kBinBytes8 = 0x8e,
  kEmptySet = 0x8f,
  kAddItems = 0x90,
  kFrozenSet = 0x91,
  kNewObjEx = 0x92,
  kStackGlobal = 0x93,
  kMemoize = 0x94,
  kFrame = 0x95,
};
}  // namespace op

class Reader {
 public:
  Reader(std::string_view bytes, const PickleLimits& limits) : in_(bytes), limits_(limits) {}

  Result<PyValue> Run();

 private:
  Error Corrupt(std::string_view what) const {
    return DataLossError(fmt::format("pickle byte {}: {}", op_offset_, what));
  }

  // --- input
  Result<std::string_view> Take(std::uint64_t n, std::string_view what) {
    if (n > in_.size() - pos_) {
      return Corrupt(
          fmt::format("truncated: {} needs {} bytes, {} are left", what, n, in_.size() - pos_));
    }
    std::string_view out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  template <typename T>
  Result<T> Little(std::string_view what) {
    ZINF_ASSIGN_OR_RETURN(std::string_view b, Take(sizeof(T), what));
    std::make_unsigned_t<T> u = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      u |= static_cast<std::make_unsigned_t<T>>(static_cast<unsigned char>(b[i])) << (8 * i);
    }
    return static_cast<T>(u);
  }
  Result<std::string_view> Line(std::string_view what) {
    constexpr std::size_t kMaxLine = 1024;
    const std::string_view window = in_.substr(pos_, kMaxLine + 1);
    const std::size_t length = window.find('\n');
    if (length == std::string_view::npos) {
      if (window.size() > kMaxLine) return Corrupt(fmt::format("{} line too long", what));
      return Corrupt(fmt::format("truncated: {} line has no end", what));
    }
    std::string_view out = window.substr(0, length);
    pos_ += length + 1;
    return out;
  }
  Result<std::int64_t> DecimalLine(std::string_view what, bool long_suffix);

  // --- nodes and the stack
  Result<NodeId> NewNode(NodeKind kind) {
    if (nodes_.size() >= limits_.max_items || nodes_.size() >= kMaxNodes) {
      return Corrupt(fmt::format("more than max_items {} objects", limits_.max_items));
    }
    nodes_.emplace_back();
    nodes_.back().kind = kind;
    return static_cast<NodeId>(nodes_.size() - 1);
  }
  Status CountItems(std::uint64_t n) {
    if (n > limits_.max_items - items_) {
      return Corrupt(fmt::format("more than max_items {} container items", limits_.max_items));
    }
    items_ += n;
    return OkStatus();
  }
  std::size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Status Push(Val v) {
    if (stack_.size() >= limits_.max_items) {
      return Corrupt(fmt::format("stack deeper than max_items {}", limits_.max_items));
    }
    stack_.push_back(v);
    return OkStatus();
  }
  Result<Val> Pop() {
    if (stack_.size() <= Floor()) return Corrupt("stack underflow");
    Val v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Result<Val> Top() {
    if (stack_.size() <= Floor()) return Corrupt("stack underflow");
    return stack_.back();
  }
  // The values above the topmost MARK, which is removed.
  Result<std::vector<Val>> PopMark() {
    if (marks_.empty()) return Corrupt("no MARK to pop to");
    const std::size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<Val> out(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return out;
  }
  Result<Node*> NodeOf(const Val& v, NodeKind kind, std::string_view what) {
    if (const Ref* r = std::get_if<Ref>(&v); r != nullptr && nodes_[r->id].kind == kind) {
      return &nodes_[r->id];
    }
    return Corrupt(fmt::format("{} is a {}", what, TypeName(v)));
  }
  std::string TypeName(const Val& v) const;
  Result<Val> NewStr(std::string_view s, bool check_utf8) {
    if (check_utf8 && !IsUtf8(s)) return Corrupt("str is not UTF-8");
    ZINF_ASSIGN_OR_RETURN(NodeId id, NewNode(NodeKind::kStr));
    nodes_[id].str = std::string(s);
    return Ref{id};
  }
  Status PushStr(std::uint64_t n, bool check_utf8) {
    if (n > limits_.max_string_bytes) {
      return Corrupt(fmt::format("string of {} bytes, more than max_string_bytes {}", n,
                                 limits_.max_string_bytes));
    }
    ZINF_ASSIGN_OR_RETURN(std::string_view s, Take(n, "string"));
    ZINF_ASSIGN_OR_RETURN(Val v, NewStr(s, check_utf8));
    return Push(v);
  }
  Result<Val> NewContainer(NodeKind kind, std::vector<Val> items, bool flag = false) {
    ZINF_RETURN_IF_ERROR(CountItems(items.size()));
    ZINF_ASSIGN_OR_RETURN(NodeId id, NewNode(kind));
    nodes_[id].items = std::move(items);
    nodes_[id].flag = flag;
    return Ref{id};
  }
  Status PushInt(std::string_view bytes);  // little-endian two's complement (LONG1/LONG4)

  // --- memo
  Status MemoPut(std::uint64_t index) {
    if (index >= limits_.max_memo) {
      return Corrupt(fmt::format("memo index {} beyond max_memo {}", index, limits_.max_memo));
    }
    ZINF_ASSIGN_OR_RETURN(Val v, Top());
    // Python numbers memo entries 0, 1, 2, ...: those go to a vector, any others to a map.
    if (index < memo_dense_.size()) {
      if (!memo_dense_[index]) ++memo_count_;
      memo_dense_[index] = v;
    } else if (index == memo_dense_.size() && !memo_sparse_.contains(index)) {
      memo_dense_.emplace_back(v);
      ++memo_count_;
    } else {
      memo_count_ += memo_sparse_.insert_or_assign(index, v).second ? 1 : 0;
    }
    return OkStatus();
  }
  Status MemoGet(std::uint64_t index) {
    if (index < memo_dense_.size() && memo_dense_[index]) return Push(*memo_dense_[index]);
    auto it = memo_sparse_.find(index);
    if (it == memo_sparse_.end()) {
      return Corrupt(fmt::format("memo index {} was never stored", index));
    }
    return Push(it->second);
  }

  // --- the opcodes that build
  Status Step(std::uint8_t code);
  Status OnGlobal(std::string_view module, std::string_view name);
  Result<Val> Call(const Val& callable, std::vector<Val> args);
  Result<Val> NewObject(const Val& cls, std::string_view how);
  Result<Val> RebuildTensor(Global kind, const std::vector<Val>& args);
  Result<Val> PersistentLoad(const Val& pid);

  // --- the tree, at STOP
  // What the tree of `id` will hold once shared objects are copied (items, string bytes),
  // found before anything is copied; a cycle or nesting beyond max_depth is an error.
  Status Measure(NodeId id, std::uint64_t depth);
  Result<PyValue> ToValue(const Val& v, std::uint64_t depth);

  static constexpr std::size_t kMaxNodes = std::numeric_limits<NodeId>::max();
  static constexpr std::uint64_t kSaturated = std::numeric_limits<std::uint64_t>::max() / 2;

  std::string_view in_;
  const PickleLimits& limits_;
  std::uint64_t pos_ = 0;
  std::uint64_t op_offset_ = 0;
  std::uint64_t items_ = 0;
  std::vector<Node> nodes_;
  std::vector<Val> stack_;
  std::vector<std::size_t> marks_;
  std::vector<std::optional<Val>> memo_dense_;
  std::unordered_map<std::uint64_t, Val> memo_sparse_;
  std::uint64_t memo_count_ = 0;  // entries stored: MEMOIZE's index
  bool stopped_ = false;
  // Measure's results per node (0 unvisited, 1 in progress, 2 done).
  std::vector<std::uint8_t> measure_state_;
  std::vector<std::uint64_t> measure_items_;
  std::vector<std::uint64_t> measure_bytes_;
  // The tree build's budgets: Measure has checked them; ToValue checks again.
  std::uint64_t out_items_ = 0;
  std::uint64_t out_string_bytes_ = 0;
};

std::string Reader::TypeName(const Val& v) const {
  struct Visitor {
    const Reader* r;
    std::string operator()(const PyNone&) const { return "None"; }
    std::string operator()(bool) const { return "bool"; }
    std::string operator()(std::int64_t) const { return "int"; }
    std::string operator()(double) const { return "float"; }
    std::string operator()(const Ref& ref) const {
      const Node& n = r->nodes_[ref.id];
      switch (n.kind) {
        case NodeKind::kStr:
          return "str";
        case NodeKind::kList:
          return "list";
        case NodeKind::kTuple:
          return n.flag ? "torch.Size" : "tuple";
        case NodeKind::kDict:
          return "dict";
        case NodeKind::kSet:
          return "set";
        case NodeKind::kObject:
        case NodeKind::kGlobal:
          return fmt::format("{}.{}", kGlobals[n.entry].module, kGlobals[n.entry].name);
        case NodeKind::kTensor:
          return "tensor";
        case NodeKind::kStorage:
          return "storage";
        case NodeKind::kDtype:
          return "dtype";
      }
      return "?";
    }
  };
  return std::visit(Visitor{this}, v);
}

Result<std::int64_t> Reader::DecimalLine(std::string_view what, bool long_suffix) {
  ZINF_ASSIGN_OR_RETURN(std::string_view line, Line(what));
  if (long_suffix && !line.empty() && line.back() == 'L') line.remove_suffix(1);
  if (!line.empty() && line.front() == '+') line.remove_prefix(1);
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), value);
  if (ec == std::errc::result_out_of_range) return Corrupt("integer beyond 64 bits");
  if (ec != std::errc() || end != line.data() + line.size() || line.empty()) {
    return Corrupt(fmt::format("{} '{}' is not a decimal integer", what, Printable(line)));
  }
  return value;
}

Status Reader::PushInt(std::string_view b) {
  if (b.empty()) return Push(std::int64_t{0});
  // Bytes past the eighth must only repeat the sign of the eighth.
  if (b.size() > 8) {
    const auto sign =
        static_cast<unsigned char>((static_cast<unsigned char>(b[7]) & 0x80) ? 0xff : 0);
    for (std::size_t i = 8; i < b.size(); ++i) {
      if (static_cast<unsigned char>(b[i]) != sign) return Corrupt("integer beyond 64 bits");
    }
    b = b.substr(0, 8);
  }
  std::uint64_t u = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    u |= std::uint64_t{static_cast<unsigned char>(b[i])} << (8 * i);
  }
  if (b.size() < 8 && (static_cast<unsigned char>(b.back()) & 0x80)) {
    u |= ~std::uint64_t{0} << (8 * b.size());  // sign extension
  }
  return Push(static_cast<std::int64_t>(u));
}

Status Reader::OnGlobal(std::string_view module, std::string_view name) {
  const auto entry = FindGlobal(module, name);
  if (!entry) return UnknownGlobal(module, name, op_offset_);
  const GlobalEntry& g = kGlobals[*entry];
  ZINF_ASSIGN_OR_RETURN(NodeId id,
                        NewNode(g.kind == Global::kDtype ? NodeKind::kDtype : NodeKind::kGlobal));
  nodes_[id].entry = *entry;
  return Push(Ref{id});
}

Result<Val> Reader::PersistentLoad(const Val& pid) {
  // torch's zip format: ('storage', <storage class>, key, location, numel).
  auto tuple = NodeOf(pid, NodeKind::kTuple, "persistent id");
  if (!tuple) return std::move(tuple).error();
  const std::vector<Val> items = (*tuple)->items;
  if (items.size() != 5) {
    return Corrupt(
        fmt::format("persistent id of {} items, not ('storage', class, key, "
                    "location, numel)",
                    items.size()));
  }
  ZINF_ASSIGN_OR_RETURN(Node * tag, NodeOf(items[0], NodeKind::kStr, "persistent id's tag"));
  if (tag->str != "storage") {
    return Corrupt(fmt::format("persistent id tagged '{}', not 'storage'", Printable(tag->str)));
  }
  ZINF_ASSIGN_OR_RETURN(Node * cls, NodeOf(items[1], NodeKind::kGlobal, "storage class"));
  if (kGlobals[cls->entry].kind != Global::kStorageClass) {
    return Corrupt(fmt::format("storage class is {}", TypeName(items[1])));
  }
  const std::string dtype(kGlobals[cls->entry].arg);
  ZINF_ASSIGN_OR_RETURN(Node * key, NodeOf(items[2], NodeKind::kStr, "storage key"));
  std::string key_str = key->str;
  ZINF_ASSIGN_OR_RETURN(Node * location, NodeOf(items[3], NodeKind::kStr, "storage location"));
  std::string location_str = location->str;
  const auto* numel = std::get_if<std::int64_t>(&items[4]);
  if (numel == nullptr || *numel < 0) return Corrupt("storage numel is not an int >= 0");
  auto storage = std::make_unique<PyTensor>();
  storage->dtype = dtype;
  storage->storage_key = std::move(key_str);
  storage->location = std::move(location_str);
  storage->storage_numel = static_cast<std::uint64_t>(*numel);
  ZINF_ASSIGN_OR_RETURN(NodeId id, NewNode(NodeKind::kStorage));
  nodes_[id].tensor = std::move(storage);
  return Ref{id};
}

Result<Val> Reader::RebuildTensor(Global kind, const std::vector<Val>& args) {
  const bool v2 = kind == Global::kRebuildTensorV2;
  if (v2 ? (args.size() != 6 && args.size() != 7) : args.size() != 4) {
    return Corrupt(fmt::format("tensor rebuild with {} arguments", args.size()));
  }
  ZINF_ASSIGN_OR_RETURN(Node * storage, NodeOf(args[0], NodeKind::kStorage, "tensor storage"));
  auto tensor = std::make_unique<PyTensor>(*storage->tensor);
  const auto* offset = std::get_if<std::int64_t>(&args[1]);
  if (offset == nullptr || *offset < 0) return Corrupt("tensor offset is not an int >= 0");
  tensor->offset = static_cast<std::uint64_t>(*offset);
  for (int which = 0; which < 2; ++which) {
    ZINF_ASSIGN_OR_RETURN(Node * dims, NodeOf(args[2 + which], NodeKind::kTuple,
                                              which == 0 ? "tensor size" : "tensor stride"));
    auto& out = which == 0 ? tensor->shape : tensor->stride;
    for (const Val& d : dims->items) {
      const auto* i = std::get_if<std::int64_t>(&d);
      if (i == nullptr) return Corrupt("tensor size or stride holds a non-int");
      out.push_back(*i);
    }
  }
  if (v2) {
    const bool* requires_grad = std::get_if<bool>(&args[4]);
    if (requires_grad == nullptr) return Corrupt("tensor requires_grad is not a bool");
    tensor->requires_grad = *requires_grad;
    ZINF_RETURN_IF_ERROR(NodeOf(args[5], NodeKind::kDict, "tensor backward hooks"));
  }
  if (std::string problem = TensorExtentProblem(*tensor); !problem.empty()) {
    return Corrupt(
        fmt::format("tensor of storage '{}': {}", Printable(tensor->storage_key), problem));
  }
  ZINF_RETURN_IF_ERROR(CountItems(tensor->shape.size() + tensor->stride.size()));
  ZINF_ASSIGN_OR_RETURN(NodeId id, NewNode(NodeKind::kTensor));
  nodes_[id].tensor = std::move(tensor);
  return Ref{id};
}

Result<Val> Reader::NewObject(const Val& cls, std::string_view how) {
  ZINF_ASSIGN_OR_RETURN(Node * c, NodeOf(cls, NodeKind::kGlobal, how));
  if (kGlobals[c->entry].kind != Global::kClass) {
    return Corrupt(fmt::format("{} of {}, not a class zinf builds", how, TypeName(cls)));
  }
  const std::uint32_t entry = c->entry;
  ZINF_ASSIGN_OR_RETURN(NodeId id, NewNode(NodeKind::kObject));
  nodes_[id].entry = entry;
  return Ref{id};
}

Result<Val> Reader::Call(const Val& callable, std::vector<Val> args) {
  const Ref* ref = std::get_if<Ref>(&callable);
  if (ref == nullptr || nodes_[ref->id].kind != NodeKind::kGlobal) {
    return Corrupt(fmt::format("REDUCE of a {}, not a callable", TypeName(callable)));
  }
  const std::uint32_t entry = nodes_[ref->id].entry;
  const GlobalEntry& g = kGlobals[entry];
  const auto bad_args = [&] {
    return Corrupt(fmt::format("{}.{} called with {} arguments it does not take", g.module, g.name,
                               args.size()));
  };
  switch (g.kind) {
    case Global::kRebuildTensor:
    case Global::kRebuildTensorV2:
      return RebuildTensor(g.kind, args);
    case Global::kRebuildParameter:
    case Global::kRebuildParameterWithState: {
      if (args.size() != (g.kind == Global::kRebuildParameter ? 3u : 4u)) return bad_args();
      ZINF_ASSIGN_OR_RETURN(Node * t, NodeOf(args[0], NodeKind::kTensor, "parameter data"));
      const bool* requires_grad = std::get_if<bool>(&args[1]);
      if (requires_grad == nullptr) return Corrupt("parameter requires_grad is not a bool");
      auto tensor = std::make_unique<PyTensor>(*t->tensor);
      tensor->requires_grad = *requires_grad;
      ZINF_ASSIGN_OR_RETURN(NodeId id, NewNode(NodeKind::kTensor));
      nodes_[id].tensor = std::move(tensor);
      return Ref{id};
    }
    case Global::kOrderedDict:
      if (!args.empty()) return bad_args();
      return NewContainer(NodeKind::kDict, {}, /*flag=*/true);
    case Global::kTorchSize: {
      if (args.size() != 1) return bad_args();
      ZINF_ASSIGN_OR_RETURN(Node * dims, NodeOf(args[0], NodeKind::kTuple, "torch.Size's sizes"));
      std::vector<Val> items = dims->items;
      for (const Val& d : items) {
        if (!std::holds_alternative<std::int64_t>(d)) return Corrupt("torch.Size of a non-int");
      }
      return NewContainer(NodeKind::kTuple, std::move(items), /*flag=*/true);
    }
    case Global::kSet: {
      if (args.empty()) return NewContainer(NodeKind::kSet, {});
      if (args.size() != 1) return bad_args();
      const Ref* from = std::get_if<Ref>(&args[0]);
      const NodeKind k = from == nullptr ? NodeKind::kStr : nodes_[from->id].kind;
      if (from == nullptr ||
          (k != NodeKind::kList && k != NodeKind::kTuple && k != NodeKind::kSet)) {
        return Corrupt(fmt::format("set of a {}", TypeName(args[0])));
      }
      std::vector<Val> items = nodes_[from->id].items;
      return NewContainer(NodeKind::kSet, std::move(items));
    }
    case Global::kZeroStageEnum: {
      const auto* i = args.size() == 1 ? std::get_if<std::int64_t>(&args[0]) : nullptr;
      if (i == nullptr || *i < 0 || *i > 3) return Corrupt("ZeroStageEnum of a value not 0..3");
      return *i;
    }
    case Global::kGetattr: {
      // Only getattr(ZeroStageEnum, member), as Python 3.11 pickles an enum member.
      if (args.size() == 2) {
        const Ref* cls = std::get_if<Ref>(&args[0]);
        const Ref* member = std::get_if<Ref>(&args[1]);
        if (cls != nullptr && member != nullptr && nodes_[cls->id].kind == NodeKind::kGlobal &&
            kGlobals[nodes_[cls->id].entry].kind == Global::kZeroStageEnum &&
            nodes_[member->id].kind == NodeKind::kStr) {
          for (const auto& [name, value] : kZeroStages) {
            if (nodes_[member->id].str == name) return value;
          }
        }
      }
      return InvalidArgumentError(fmt::format(
          "pickle calls getattr on something other than a ZeroStageEnum member, which zinf does "
          "not load (no code is run); at byte {}",
          op_offset_));
    }
    case Global::kClass:
      if (!args.empty()) return bad_args();
      return NewObject(callable, "REDUCE");
    case Global::kCopyregNewobj:
      if (args.size() != 1) return bad_args();
      return NewObject(args[0], "copyreg.__newobj__");
    case Global::kCopyregReconstructor: {
      if (args.size() != 3 || !std::holds_alternative<PyNone>(args[2])) return bad_args();
      const Ref* base = std::get_if<Ref>(&args[1]);
      if (base == nullptr || nodes_[base->id].kind != NodeKind::kGlobal ||
          kGlobals[nodes_[base->id].entry].kind != Global::kObjectBase) {
        return bad_args();
      }
      return NewObject(args[0], "copyreg._reconstructor");
    }
    case Global::kStorageClass:
    case Global::kDtype:
    case Global::kObjectBase:
      break;
  }
  return Corrupt(fmt::format("REDUCE of {}, which zinf does not call", TypeName(callable)));
}

Status Reader::Step(std::uint8_t code) {
  switch (code) {
    case op::kProto: {
      ZINF_ASSIGN_OR_RETURN(std::uint8_t version, Little<std::uint8_t>("PROTO"));
      if (version > 5) return Corrupt(fmt::format("pickle protocol {}", version));
      return OkStatus();
    }
    case op::kFrame: {
      ZINF_ASSIGN_OR_RETURN(std::uint64_t n, Little<std::uint64_t>("FRAME"));
      if (n > in_.size() - pos_) return Corrupt(fmt::format("truncated: FRAME of {} bytes", n));
      return OkStatus();
    }
    case op::kStop:
      stopped_ = true;
      return OkStatus();
    case op::kMark:
      // Python's MARKs nest with the containers being built, plus two for a tensor's
      // persistent id and arguments.
      if (marks_.size() >= std::min(limits_.max_depth, kHardMaxDepth) + 8) {
        return Corrupt(fmt::format("nested deeper than max_depth {} (MARKs)", limits_.max_depth));
      }
      marks_.push_back(stack_.size());
      return OkStatus();
    case op::kPop:
      if (stack_.size() > Floor()) {
        stack_.pop_back();
        return OkStatus();
      }
      [[fallthrough]];  // as Python: POP with nothing above the MARK pops the MARK
    case op::kPopMark: {
      ZINF_RETURN_IF_ERROR(PopMark());
      return OkStatus();
    }
    case op::kDup: {
      ZINF_ASSIGN_OR_RETURN(Val v, Top());
      return Push(v);
    }
    case op::kNone:
      return Push(PyNone{});
    case op::kNewTrue:
      return Push(true);
    case op::kNewFalse:
      return Push(false);
    case op::kInt: {
      // Protocol 0: "I01\n" and "I00\n" are True and False.
      const std::size_t save = pos_;
      ZINF_ASSIGN_OR_RETURN(std::string_view line, Line("INT"));
      if (line == "00" || line == "01") return Push(line == "01");
      pos_ = save;
      ZINF_ASSIGN_OR_RETURN(std::int64_t v, DecimalLine("INT", false));
      return Push(v);
    }
    case op::kLong: {
      ZINF_ASSIGN_OR_RETURN(std::int64_t v, DecimalLine("LONG", true));
      return Push(v);
    }
    case op::kFloat: {
      ZINF_ASSIGN_OR_RETURN(std::string_view line, Line("FLOAT"));
      double d = 0;
      const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), d);
      if (ec != std::errc() || end != line.data() + line.size() || line.empty()) {
        return Corrupt(fmt::format("FLOAT '{}' is not a number", Printable(line)));
      }
      return Push(d);
    }
    case op::kBinInt: {
      ZINF_ASSIGN_OR_RETURN(std::int32_t v, Little<std::int32_t>("BININT"));
      return Push(std::int64_t{v});
    }
    case op::kBinInt1: {
      ZINF_ASSIGN_OR_RETURN(std::uint8_t v, Little<std::uint8_t>("BININT1"));
      return Push(std::int64_t{v});
    }
    case op::kBinInt2: {
      ZINF_ASSIGN_OR_RETURN(std::uint16_t v, Little<std::uint16_t>("BININT2"));
      return Push(std::int64_t{v});
    }
    case op::kLong1: {
      ZINF_ASSIGN_OR_RETURN(std::uint8_t n, Little<std::uint8_t>("LONG1"));
      ZINF_ASSIGN_OR_RETURN(std::string_view b, Take(n, "LONG1"));
      return PushInt(b);
    }
    case op::kLong4: {
      ZINF_ASSIGN_OR_RETURN(std::int32_t n, Little<std::int32_t>("LONG4"));
      if (n < 0) return Corrupt("LONG4 of a negative byte count");
      // Beyond 64 bits unless all but eight bytes are sign; refuse before reading a long run.
      if (n > 64) return Corrupt(fmt::format("integer beyond 64 bits (LONG4 of {} bytes)", n));
      ZINF_ASSIGN_OR_RETURN(std::string_view b, Take(static_cast<std::uint64_t>(n), "LONG4"));
      return PushInt(b);
    }
    case op::kBinFloat: {
      ZINF_ASSIGN_OR_RETURN(std::string_view b, Take(8, "BINFLOAT"));
      std::uint64_t u = 0;
      for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<unsigned char>(b[i]);  // big-endian
      return Push(std::bit_cast<double>(u));
    }
    case op::kShortBinUnicode: {
      ZINF_ASSIGN_OR_RETURN(std::uint8_t n, Little<std::uint8_t>("SHORT_BINUNICODE"));
      return PushStr(n, true);
    }
    case op::kBinUnicode: {
      ZINF_ASSIGN_OR_RETURN(std::uint32_t n, Little<std::uint32_t>("BINUNICODE"));
      return PushStr(n, true);
    }
    case op::kBinUnicode8: {
      ZINF_ASSIGN_OR_RETURN(std::uint64_t n, Little<std::uint64_t>("BINUNICODE8"));
      return PushStr(n, true);
    }
    case op::kShortBinString:
    case op::kShortBinBytes: {
      ZINF_ASSIGN_OR_RETURN(std::uint8_t n, Little<std::uint8_t>("SHORT_BINSTRING"));
      return PushStr(n, false);
    }
    case op::kBinString: {
      ZINF_ASSIGN_OR_RETURN(std::int32_t n, Little<std::int32_t>("BINSTRING"));
      if (n < 0) return Corrupt("BINSTRING of a negative length");
      return PushStr(static_cast<std::uint64_t>(n), false);
    }
    case op::kBinBytes: {
      ZINF_ASSIGN_OR_RETURN(std::uint32_t n, Little<std::uint32_t>("BINBYTES"));
      return PushStr(n, false);
    }
    case op::kBinBytes8: {
      ZINF_ASSIGN_OR_RETURN(std::uint64_t n, Little<std::uint64_t>("BINBYTES8"));
      return PushStr(n, false);
    }
    case op::kEmptyList:
    case op::kEmptyTuple:
    case op::kEmptyDict:
    case op::kEmptySet: {
      const NodeKind kind = code == op::kEmptyList    ? NodeKind::kList
                            : code == op::kEmptyTuple ? NodeKind::kTuple
                            : code == op::kEmptyDict  ? NodeKind::kDict
                                                      : NodeKind::kSet;
      ZINF_ASSIGN_OR_RETURN(Val v, NewContainer(kind, {}));
      return Push(v);
    }
    case op::kList:
    case op::kTuple:
    case op::kFrozenSet: {
      ZINF_ASSIGN_OR_RETURN(std::vector<Val> items, PopMark());
      const NodeKind kind = code == op::kList    ? NodeKind::kList
                            : code == op::kTuple ? NodeKind::kTuple
                                                 : NodeKind::kSet;
      ZINF_ASSIGN_OR_RETURN(Val v, NewContainer(kind, std::move(items)));
      return Push(v);
    }
    case op::kTuple1:
    case op::kTuple2:
    case op::kTuple3: {
      const std::size_t n = code - op::kTuple1 + 1;
      if (stack_.size() < Floor() + n) return Corrupt("stack underflow");
      std::vector<Val> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
      stack_.resize(stack_.size() - n);
      ZINF_ASSIGN_OR_RETURN(Val v, NewContainer(NodeKind::kTuple, std::move(items)));
      return Push(v);
    }
    case op::kDict: {
      ZINF_ASSIGN_OR_RETURN(std::vector<Val> items, PopMark());
      if (items.size() % 2 != 0) return Corrupt("DICT of an odd number of items");
      ZINF_ASSIGN_OR_RETURN(Val v, NewContainer(NodeKind::kDict, {}));
      ZINF_RETURN_IF_ERROR(CountItems(items.size() / 2));
      nodes_[std::get<Ref>(v).id].items = std::move(items);
      return Push(v);
    }
    case op::kAppend:
    case op::kAppends:
    case op::kAddItems:
    case op::kSetItem:
    case op::kSetItems: {
      std::vector<Val> items;
      if (code == op::kAppend || code == op::kSetItem) {
        const std::size_t n = code == op::kAppend ? 1 : 2;
        if (stack_.size() < Floor() + n) return Corrupt("stack underflow");
        items.assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
        stack_.resize(stack_.size() - n);
      } else {
        ZINF_ASSIGN_OR_RETURN(items, PopMark());
      }
      const bool dict = code == op::kSetItem || code == op::kSetItems;
      if (dict && items.size() % 2 != 0) return Corrupt("SETITEMS of an odd number of items");
      ZINF_ASSIGN_OR_RETURN(Val target, Top());
      const NodeKind kind = dict                    ? NodeKind::kDict
                            : code == op::kAddItems ? NodeKind::kSet
                                                    : NodeKind::kList;
      const char* what = dict                    ? "SETITEM target"
                         : code == op::kAddItems ? "ADDITEMS target"
                                                 : "APPEND target";
      ZINF_ASSIGN_OR_RETURN(Node * node, NodeOf(target, kind, what));
      ZINF_RETURN_IF_ERROR(CountItems(dict ? items.size() / 2 : items.size()));
      node->items.insert(node->items.end(), items.begin(), items.end());
      return OkStatus();
    }
    case op::kGlobal:
    case op::kInst: {
      ZINF_ASSIGN_OR_RETURN(std::string_view module, Line("GLOBAL module"));
      ZINF_ASSIGN_OR_RETURN(std::string_view name, Line("GLOBAL name"));
      if (code == op::kInst) {
        if (!FindGlobal(module, name)) return UnknownGlobal(module, name, op_offset_);
        return Corrupt("INST (protocol 0 instances) is not supported");
      }
      return OnGlobal(module, name);
    }
    case op::kStackGlobal: {
      ZINF_ASSIGN_OR_RETURN(Val name, Pop());
      ZINF_ASSIGN_OR_RETURN(Val module, Pop());
      ZINF_ASSIGN_OR_RETURN(Node * m, NodeOf(module, NodeKind::kStr, "STACK_GLOBAL module"));
      ZINF_ASSIGN_OR_RETURN(Node * n, NodeOf(name, NodeKind::kStr, "STACK_GLOBAL name"));
      const std::string module_str = m->str;
      const std::string name_str = n->str;
      return OnGlobal(module_str, name_str);
    }
    case op::kReduce: {
      ZINF_ASSIGN_OR_RETURN(Val args, Pop());
      ZINF_ASSIGN_OR_RETURN(Val callable, Pop());
      ZINF_ASSIGN_OR_RETURN(Node * a, NodeOf(args, NodeKind::kTuple, "REDUCE arguments"));
      ZINF_ASSIGN_OR_RETURN(Val v, Call(callable, a->items));
      return Push(v);
    }
    case op::kNewObj:
    case op::kNewObjEx: {
      if (code == op::kNewObjEx) {
        ZINF_ASSIGN_OR_RETURN(Val kwargs, Pop());
        ZINF_ASSIGN_OR_RETURN(Node * k, NodeOf(kwargs, NodeKind::kDict, "NEWOBJ_EX kwargs"));
        if (!k->items.empty()) return Corrupt("NEWOBJ_EX with keyword arguments");
      }
      ZINF_ASSIGN_OR_RETURN(Val args, Pop());
      ZINF_ASSIGN_OR_RETURN(Val cls, Pop());
      ZINF_ASSIGN_OR_RETURN(Node * a, NodeOf(args, NodeKind::kTuple, "NEWOBJ arguments"));
      if (!a->items.empty()) return Corrupt("NEWOBJ with arguments");
      ZINF_ASSIGN_OR_RETURN(Val v, NewObject(cls, "NEWOBJ"));
      return Push(v);
    }
    case op::kBuild: {
      ZINF_ASSIGN_OR_RETURN(Val state, Pop());
      ZINF_ASSIGN_OR_RETURN(Val target, Top());
      ZINF_ASSIGN_OR_RETURN(Node * obj, NodeOf(target, NodeKind::kObject, "BUILD target"));
      if (!obj->items.empty()) return Corrupt("BUILD of an object built already");
      ZINF_RETURN_IF_ERROR(NodeOf(state, NodeKind::kDict, "BUILD state"));
      obj->items.push_back(state);
      return OkStatus();
    }
    case op::kBinPersId: {
      ZINF_ASSIGN_OR_RETURN(Val pid, Pop());
      ZINF_ASSIGN_OR_RETURN(Val v, PersistentLoad(pid));
      return Push(v);
    }
    case op::kPut: {
      ZINF_ASSIGN_OR_RETURN(std::int64_t index, DecimalLine("PUT", false));
      if (index < 0) return Corrupt("negative memo index");
      return MemoPut(static_cast<std::uint64_t>(index));
    }
    case op::kBinPut: {
      ZINF_ASSIGN_OR_RETURN(std::uint8_t index, Little<std::uint8_t>("BINPUT"));
      return MemoPut(index);
    }
    case op::kLongBinPut: {
      ZINF_ASSIGN_OR_RETURN(std::uint32_t index, Little<std::uint32_t>("LONG_BINPUT"));
      return MemoPut(index);
    }
    case op::kMemoize:
      return MemoPut(memo_count_);
    case op::kGet: {
      ZINF_ASSIGN_OR_RETURN(std::int64_t index, DecimalLine("GET", false));
      if (index < 0) return Corrupt("negative memo index");
      return MemoGet(static_cast<std::uint64_t>(index));
    }
    case op::kBinGet: {
      ZINF_ASSIGN_OR_RETURN(std::uint8_t index, Little<std::uint8_t>("BINGET"));
      return MemoGet(index);
    }
    case op::kLongBinGet: {
      ZINF_ASSIGN_OR_RETURN(std::uint32_t index, Little<std::uint32_t>("LONG_BINGET"));
      return MemoGet(index);
    }
    default:
      break;
  }
  return Corrupt(fmt::format("unsupported pickle opcode 0x{:02x}", code));
}

Status Reader::Measure(NodeId id, std::uint64_t depth) {
  const std::uint64_t max_depth = std::min(limits_.max_depth, kHardMaxDepth);
  if (measure_state_[id] == 2) return OkStatus();
  if (measure_state_[id] == 1) {
    return DataLossError(
        "pickle value: a container holds itself (a cycle), which zinf does not load");
  }
  const Node& node = nodes_[id];
  std::uint64_t items = 0;
  std::uint64_t bytes = 0;
  const auto add = [](std::uint64_t& total, std::uint64_t n) {
    total = n > kSaturated - total ? kSaturated : total + n;
  };
  switch (node.kind) {
    case NodeKind::kStr:
      bytes = node.str.size();
      break;
    case NodeKind::kTensor:
      items = node.tensor->shape.size() + node.tensor->stride.size();
      break;
    case NodeKind::kList:
    case NodeKind::kSet:
    case NodeKind::kTuple:
    case NodeKind::kDict:
    case NodeKind::kObject: {
      if (depth + 1 > max_depth) {
        return DataLossError(
            fmt::format("pickle value: nested deeper than max_depth {}", max_depth));
      }
      measure_state_[id] = 1;
      items = node.kind == NodeKind::kObject ? 0 : node.items.size();
      for (const Val& item : node.items) {
        const Ref* ref = std::get_if<Ref>(&item);
        if (ref == nullptr) continue;
        ZINF_RETURN_IF_ERROR(Measure(ref->id, depth + 1));
        add(items, measure_items_[ref->id]);
        add(bytes, measure_bytes_[ref->id]);
      }
      break;
    }
    case NodeKind::kStorage:
    case NodeKind::kDtype:
    case NodeKind::kGlobal:
      break;
  }
  if (items > limits_.max_items) {
    return DataLossError(fmt::format(
        "pickle value: more than max_items {} items (shared objects counted at each use)",
        limits_.max_items));
  }
  if (bytes > limits_.max_bytes) {
    return DataLossError(fmt::format(
        "pickle value: strings of more than max_bytes {} together (shared ones counted at each "
        "use)",
        limits_.max_bytes));
  }
  measure_state_[id] = 2;
  measure_items_[id] = items;
  measure_bytes_[id] = bytes;
  return OkStatus();
}

Result<PyValue> Reader::ToValue(const Val& v, std::uint64_t depth) {
  const Ref* ref = std::get_if<Ref>(&v);
  if (ref == nullptr) {
    return std::visit(
        [](const auto& x) -> PyValue {
          if constexpr (std::is_same_v<std::decay_t<decltype(x)>, Ref>) {
            return PyNone{};  // unreachable
          } else {
            return x;
          }
        },
        v);
  }
  const Node& node = nodes_[ref->id];
  const std::uint64_t max_depth = std::min(limits_.max_depth, kHardMaxDepth);
  const auto count = [&](std::uint64_t n) -> Status {
    if (n > limits_.max_items - out_items_) {
      return InternalError("pickle value: more items than Measure found");
    }
    out_items_ += n;
    return OkStatus();
  };
  const auto nest = [&]() -> Status {
    if (depth + 1 > max_depth) {
      return InternalError("pickle value: deeper than Measure found");
    }
    return OkStatus();
  };
  const auto children = [&](std::span<const Val> in) -> Result<std::vector<PyValue>> {
    ZINF_RETURN_IF_ERROR(nest());
    ZINF_RETURN_IF_ERROR(count(in.size()));
    std::vector<PyValue> out;
    out.reserve(in.size());
    for (const Val& item : in) {
      ZINF_ASSIGN_OR_RETURN(PyValue child, ToValue(item, depth + 1));
      out.push_back(std::move(child));
    }
    return out;
  };
  switch (node.kind) {
    case NodeKind::kStr:
      // Counted at each use: a memoized string referenced a million times is a million copies.
      if (node.str.size() > limits_.max_bytes - std::min(limits_.max_bytes, out_string_bytes_)) {
        return InternalError("pickle value: more string bytes than Measure found");
      }
      out_string_bytes_ += node.str.size();
      return PyValue(node.str);
    case NodeKind::kList:
    case NodeKind::kSet: {
      ZINF_ASSIGN_OR_RETURN(std::vector<PyValue> items, children(node.items));
      return PyValue(PyList{std::move(items)});
    }
    case NodeKind::kTuple: {
      ZINF_ASSIGN_OR_RETURN(std::vector<PyValue> items, children(node.items));
      return PyValue(PyTuple{std::move(items), node.flag});
    }
    case NodeKind::kDict: {
      ZINF_ASSIGN_OR_RETURN(std::vector<PyValue> flat, children(node.items));
      PyDict dict;
      dict.ordered = node.flag;
      dict.items.reserve(flat.size() / 2);
      // A key set twice keeps its first place and its last value, as in Python (str and int keys).
      std::unordered_map<std::string, std::size_t> seen;
      for (std::size_t i = 0; i + 1 < flat.size(); i += 2) {
        std::optional<std::string> canonical;
        if (const auto* s = flat[i].as<std::string>()) canonical = "s" + *s;
        if (const auto* n = flat[i].as<std::int64_t>()) canonical = fmt::format("i{}", *n);
        if (const auto* b = flat[i].as<bool>()) canonical = fmt::format("i{}", *b ? 1 : 0);
        if (canonical) {
          auto [it, inserted] = seen.emplace(std::move(*canonical), dict.items.size());
          if (!inserted) {
            dict.items[it->second].second = std::move(flat[i + 1]);
            continue;
          }
        }
        dict.items.emplace_back(std::move(flat[i]), std::move(flat[i + 1]));
      }
      return PyValue(std::move(dict));
    }
    case NodeKind::kObject: {
      ZINF_RETURN_IF_ERROR(nest());
      PyObject obj;
      obj.module = std::string(kGlobals[node.entry].module);
      obj.name = std::string(kGlobals[node.entry].name);
      if (node.items.empty()) {
        obj.state = std::make_shared<PyValue>(PyDict{});
      } else {
        ZINF_ASSIGN_OR_RETURN(PyValue state, ToValue(node.items[0], depth + 1));
        obj.state = std::make_shared<PyValue>(std::move(state));
      }
      return PyValue(std::move(obj));
    }
    case NodeKind::kTensor:
      ZINF_RETURN_IF_ERROR(count(node.tensor->shape.size() + node.tensor->stride.size()));
      return PyValue(*node.tensor);
    case NodeKind::kDtype:
      return PyValue(PyDtype{std::string(kGlobals[node.entry].arg)});
    case NodeKind::kStorage:
      return InvalidArgumentError(fmt::format(
          "pickle holds a bare torch storage ('{}'), not a tensor; zinf does not load those",
          Printable(node.tensor->storage_key)));
    case NodeKind::kGlobal:
      return InvalidArgumentError(
          fmt::format("pickle holds {}.{} itself as a value, which zinf does not load",
                      kGlobals[node.entry].module, kGlobals[node.entry].name));
  }
  return InternalError("pickle: unknown node kind");
}

Result<PyValue> Reader::Run() {
  if (in_.size() > limits_.max_bytes) {
    return DataLossError(
        fmt::format("pickle of {} bytes, more than max_bytes {}", in_.size(), limits_.max_bytes));
  }
  while (!stopped_) {
    op_offset_ = pos_;
    if (pos_ >= in_.size()) return Corrupt("truncated: the pickle ends before STOP");
    const auto code = static_cast<std::uint8_t>(in_[pos_++]);
    ZINF_RETURN_IF_ERROR(Step(code));
  }
  if (!marks_.empty() || stack_.size() != 1) {
    return Corrupt(fmt::format("STOP with {} values and {} MARKs on the stack, not one value",
                               stack_.size(), marks_.size()));
  }
  if (pos_ != in_.size()) {
    return Corrupt(fmt::format("{} bytes after STOP", in_.size() - pos_));
  }
  if (const Ref* root = std::get_if<Ref>(&stack_.back())) {
    measure_state_.assign(nodes_.size(), 0);
    measure_items_.assign(nodes_.size(), 0);
    measure_bytes_.assign(nodes_.size(), 0);
    ZINF_RETURN_IF_ERROR(Measure(root->id, 0));
  }
  return ToValue(stack_.back(), 0);
}

// ---------------------------------------------------------------------------------------------
// The writer: protocol 2, as torch.save (pickle_protocol=2) writes it; no memo.

constexpr std::uint64_t kMaxWriteDepth = 100;

class Writer {
 public:
  Result<std::string> Run(const PyValue& value) {
    out_ += "\x80\x02";
    ZINF_RETURN_IF_ERROR(Write(value, 0));
    out_.push_back('.');
    return std::move(out_);
  }

 private:
  void Op(std::uint8_t code) { out_.push_back(static_cast<char>(code)); }
  void Le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void Global(std::string_view module, std::string_view name) {
    Op(op::kGlobal);
    out_ += module;
    out_.push_back('\n');
    out_ += name;
    out_.push_back('\n');
  }
  void Int(std::int64_t v) {
    if (v >= 0 && v < 0x100) {
      Op(op::kBinInt1);
      Le(static_cast<std::uint64_t>(v), 1);
    } else if (v >= 0 && v < 0x10000) {
      Op(op::kBinInt2);
      Le(static_cast<std::uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<std::int32_t>::min() &&
               v <= std::numeric_limits<std::int32_t>::max()) {
      Op(op::kBinInt);
      Le(static_cast<std::uint64_t>(v), 4);
    } else {
      // LONG1: the shortest little-endian two's complement, as Python's encode_long.
      int n = 8;
      while (n > 1) {
        const std::int64_t shifted = v >> (8 * (n - 1) - 1);
        if (shifted != 0 && shifted != -1) break;
        --n;
      }
      Op(op::kLong1);
      Le(static_cast<std::uint64_t>(n), 1);
      Le(static_cast<std::uint64_t>(v), n);
    }
  }
  Status Str(std::string_view s) {
    if (!IsUtf8(s)) {
      return InvalidArgumentError(fmt::format("WritePickle: str '{}' is not UTF-8", Printable(s)));
    }
    if (s.size() > std::numeric_limits<std::uint32_t>::max()) {
      return InvalidArgumentError("WritePickle: str of 4 GiB or more");
    }
    Op(op::kBinUnicode);
    Le(s.size(), 4);
    out_ += s;
    return OkStatus();
  }
  Status Tuple(const std::vector<PyValue>& items, std::uint64_t depth) {
    if (items.empty()) {
      Op(op::kEmptyTuple);
      return OkStatus();
    }
    if (items.size() > 3) Op(op::kMark);
    for (const PyValue& item : items) ZINF_RETURN_IF_ERROR(Write(item, depth + 1));
    Op(items.size() > 3 ? std::uint8_t{op::kTuple}
                        : static_cast<std::uint8_t>(op::kTuple1 + items.size() - 1));
    return OkStatus();
  }
  static bool Hashable(const PyValue& key, bool top) {
    if (key.is<std::string>() || key.is<std::int64_t>()) return true;
    if (!top && (key.is<PyNone>() || key.is<bool>() || key.is<double>())) return true;
    if (const auto* t = key.as<PyTuple>()) {
      return std::all_of(t->items.begin(), t->items.end(),
                         [](const PyValue& item) { return Hashable(item, false); });
    }
    return false;
  }
  Status Tensor(const PyTensor& t) {
    std::string_view storage_class;
    for (const GlobalEntry& g : kGlobals) {
      if (g.kind == Global::kStorageClass && g.module == "torch" && g.arg == t.dtype) {
        storage_class = g.name;
        break;
      }
    }
    if (storage_class.empty()) {
      return InvalidArgumentError(
          fmt::format("WritePickle: tensor of dtype '{}', which has no torch storage class",
                      Printable(t.dtype)));
    }
    if (std::string problem = TensorExtentProblem(t); !problem.empty()) {
      return InvalidArgumentError(fmt::format("WritePickle: tensor of storage '{}': {}",
                                              Printable(t.storage_key), problem));
    }
    if (t.storage_numel > std::uint64_t{std::numeric_limits<std::int64_t>::max()} ||
        t.offset > std::uint64_t{std::numeric_limits<std::int64_t>::max()}) {
      return InvalidArgumentError("WritePickle: tensor numel or offset beyond int64");
    }
    Global("torch._utils", "_rebuild_tensor_v2");
    Op(op::kMark);
    Op(op::kMark);
    ZINF_RETURN_IF_ERROR(Str("storage"));
    Global("torch", storage_class);
    ZINF_RETURN_IF_ERROR(Str(t.storage_key));
    ZINF_RETURN_IF_ERROR(Str(t.location));
    Int(static_cast<std::int64_t>(t.storage_numel));
    Op(op::kTuple);
    Op(op::kBinPersId);
    Int(static_cast<std::int64_t>(t.offset));
    for (const auto* dims : {&t.shape, &t.stride}) {
      std::vector<PyValue> items(dims->begin(), dims->end());
      ZINF_RETURN_IF_ERROR(Tuple(items, 0));
    }
    Op(t.requires_grad ? op::kNewTrue : op::kNewFalse);
    Global("collections", "OrderedDict");
    Op(op::kEmptyTuple);
    Op(op::kReduce);
    Op(op::kTuple);
    Op(op::kReduce);
    return OkStatus();
  }

  Status Write(const PyValue& value, std::uint64_t depth) {
    if (depth > kMaxWriteDepth) {
      return InvalidArgumentError(
          fmt::format("WritePickle: value nested deeper than {}", kMaxWriteDepth));
    }
    struct Visitor {
      Writer* w;
      std::uint64_t depth;
      Status operator()(const PyNone&) const {
        w->Op(op::kNone);
        return OkStatus();
      }
      Status operator()(bool b) const {
        w->Op(b ? op::kNewTrue : op::kNewFalse);
        return OkStatus();
      }
      Status operator()(std::int64_t i) const {
        w->Int(i);
        return OkStatus();
      }
      Status operator()(double d) const {
        w->Op(op::kBinFloat);
        const auto u = std::bit_cast<std::uint64_t>(d);
        for (int i = 7; i >= 0; --i) w->out_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
        return OkStatus();
      }
      Status operator()(const std::string& s) const { return w->Str(s); }
      Status operator()(const PyList& l) const {
        w->Op(op::kEmptyList);
        // Batches of 1000, as Python's pickler.
        for (std::size_t i = 0; i < l.items.size(); i += 1000) {
          const std::size_t n = std::min<std::size_t>(1000, l.items.size() - i);
          if (n > 1) w->Op(op::kMark);
          for (std::size_t k = i; k < i + n; ++k) {
            ZINF_RETURN_IF_ERROR(w->Write(l.items[k], depth + 1));
          }
          w->Op(n > 1 ? op::kAppends : op::kAppend);
        }
        return OkStatus();
      }
      Status operator()(const PyTuple& t) const {
        if (t.torch_size) {
          for (const PyValue& d : t.items) {
            if (!d.is<std::int64_t>()) {
              return InvalidArgumentError(
                  fmt::format("WritePickle: torch.Size holds a {}", d.TypeName()));
            }
          }
          w->Global("torch", "Size");
          ZINF_RETURN_IF_ERROR(w->Tuple(t.items, depth + 1));
          w->Op(op::kTuple1);
          w->Op(op::kReduce);
          return OkStatus();
        }
        return w->Tuple(t.items, depth);
      }
      Status operator()(const PyDict& d) const {
        if (d.ordered) {
          w->Global("collections", "OrderedDict");
          w->Op(op::kEmptyTuple);
          w->Op(op::kReduce);
        } else {
          w->Op(op::kEmptyDict);
        }
        for (std::size_t i = 0; i < d.items.size(); i += 1000) {
          const std::size_t n = std::min<std::size_t>(1000, d.items.size() - i);
          if (n > 1) w->Op(op::kMark);
          for (std::size_t k = i; k < i + n; ++k) {
            const auto& [key, value] = d.items[k];
            if (!Hashable(key, true)) {
              return InvalidArgumentError(fmt::format(
                  "WritePickle: dict key of type {}, not str, int or tuple", key.TypeName()));
            }
            ZINF_RETURN_IF_ERROR(w->Write(key, depth + 1));
            ZINF_RETURN_IF_ERROR(w->Write(value, depth + 1));
          }
          w->Op(n > 1 ? op::kSetItems : op::kSetItem);
        }
        return OkStatus();
      }
      Status operator()(const PyTensor& t) const { return w->Tensor(t); }
      Status operator()(const PyDtype& d) const {
        const auto entry = FindGlobal("torch", d.name);
        if (!entry || kGlobals[*entry].kind != Global::kDtype) {
          return InvalidArgumentError(
              fmt::format("WritePickle: '{}' is not a torch dtype zinf writes", Printable(d.name)));
        }
        w->Global("torch", d.name);
        return OkStatus();
      }
      Status operator()(const PyObject& o) const {
        const auto entry = FindGlobal(o.module, o.name);
        if (!entry || kGlobals[*entry].kind != Global::kClass) {
          return InvalidArgumentError(fmt::format("WritePickle: class {}.{} is not one zinf writes",
                                                  Printable(o.module), Printable(o.name)));
        }
        w->Global(o.module, o.name);
        w->Op(op::kEmptyTuple);
        w->Op(op::kNewObj);
        if (o.state != nullptr) {
          if (!o.state->is<PyDict>()) {
            return InvalidArgumentError(fmt::format("WritePickle: state of {} is a {}, not a dict",
                                                    o.name, o.state->TypeName()));
          }
          ZINF_RETURN_IF_ERROR(w->Write(*o.state, depth + 1));
          w->Op(op::kBuild);
        }
        return OkStatus();
      }
    };
    return std::visit(Visitor{this, depth}, value.v);
  }

  std::string out_;
};

}  // namespace

Result<PyValue> ReadPickle(std::string_view bytes, const PickleLimits& limits) {
  return Reader(bytes, limits).Run();
}

Result<std::string> WritePickle(const PyValue& value) { return Writer().Run(value); }

}  // namespace zinf::interop
