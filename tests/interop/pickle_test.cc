#include "zinf/interop/pickle.h"

#include <sys/stat.h>

#include <bit>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"

namespace zinf::interop {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

// An error of `code` whose message holds `text`.
MATCHER_P2(ErrorIs, code, text,
           fmt::format("is a {} error saying \"{}\"", ErrorCodeName(code), text)) {
  if (arg.has_value()) {
    *result_listener << "is OK";
    return false;
  }
  *result_listener << "is " << arg.error().ToString();
  return arg.error().code() == code &&
         arg.error().message().find(std::string_view(text)) != std::string::npos;
}

// ---- the canonical text of a value (make_pickles.py prints the same for Python's objects)

std::string Quote(std::string_view s) {
  std::string out = "'";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out.push_back(ch);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out + "'";
}

std::string Canon(const PyValue& v) {
  const auto join = [](const std::vector<PyValue>& items) {
    std::string out;
    for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + Canon(items[i]);
    return out;
  };
  if (v.is<PyNone>()) return "None";
  if (const auto* b = v.as<bool>()) return *b ? "True" : "False";
  if (const auto* i = v.as<std::int64_t>()) return std::to_string(*i);
  if (const auto* d = v.as<double>())
    return fmt::format("f:{:016x}", std::bit_cast<std::uint64_t>(*d));
  if (const auto* s = v.as<std::string>()) return Quote(*s);
  if (const auto* l = v.as<PyList>()) return "[" + join(l->items) + "]";
  if (const auto* t = v.as<PyTuple>()) {
    return (t->torch_size ? "Size(" : "(") + join(t->items) + ")";
  }
  if (const auto* d = v.as<PyDict>()) {
    std::string out = d->ordered ? "OrderedDict{" : "{";
    for (std::size_t i = 0; i < d->items.size(); ++i) {
      out += (i ? ", " : "") + Canon(d->items[i].first) + ": " + Canon(d->items[i].second);
    }
    return out + "}";
  }
  if (const auto* t = v.as<PyTensor>()) {
    return fmt::format("tensor({}, {}, {}, {}, {}, [{}], [{}], {})", t->dtype,
                       Quote(t->storage_key), Quote(t->location), t->storage_numel, t->offset,
                       fmt::join(t->shape, ", "), fmt::join(t->stride, ", "),
                       t->requires_grad ? "True" : "False");
  }
  if (const auto* d = v.as<PyDtype>()) return "dtype(" + d->name + ")";
  if (const auto* o = v.as<PyObject>()) {
    return o->module + "." + o->name + "(" + (o->state ? Canon(*o->state) : "null") + ")";
  }
  return "?";
}

// ---- building pickles by hand

std::string B(std::initializer_list<unsigned> bytes) {
  std::string out;
  for (unsigned b : bytes) out.push_back(static_cast<char>(b));
  return out;
}
std::string Le32(std::uint32_t v) {
  return B({v & 0xff, (v >> 8) & 0xff, (v >> 16) & 0xff, v >> 24});
}
std::string Le64(std::uint64_t v) {
  return Le32(static_cast<std::uint32_t>(v)) + Le32(static_cast<std::uint32_t>(v >> 32));
}
std::string Proto(unsigned v = 2) { return B({0x80, v}); }
std::string Unicode(std::string_view s) {
  return "X" + Le32(static_cast<std::uint32_t>(s.size())) + std::string(s);
}
std::string Global(std::string_view module, std::string_view name) {
  return fmt::format("c{}\n{}\n", module, name);
}

PyTensor Tensor(std::string key, std::vector<std::int64_t> shape, std::vector<std::int64_t> stride,
                std::uint64_t numel, std::uint64_t offset = 0, std::string dtype = "float32") {
  PyTensor t;
  t.dtype = std::move(dtype);
  t.storage_key = std::move(key);
  t.location = "cpu";
  t.storage_numel = numel;
  t.offset = offset;
  t.shape = std::move(shape);
  t.stride = std::move(stride);
  return t;
}

PyDict Dict(std::vector<std::pair<PyValue, PyValue>> items, bool ordered = false) {
  return PyDict{std::move(items), ordered};
}

PyObject Object(std::string module, std::string name, PyDict state) {
  return PyObject{std::move(module), std::move(name), std::make_shared<PyValue>(std::move(state))};
}

// A tree with every kind of value: what DeepSpeed's files hold.
PyValue EveryKind() {
  PyTensor param = Tensor("0", {2, 3}, {3, 1}, 6);
  PyTensor view = Tensor("0", {2}, {3}, 6, 1);
  view.requires_grad = true;
  PyTensor half = Tensor("1", {4}, {1}, 4, 0, "float16");
  half.location = "cuda:0";
  return Dict({
      {"none", PyNone{}},
      {"true", true},
      {"false", false},
      {"ints", PyList{{std::int64_t{0}, std::int64_t{255}, std::int64_t{256}, std::int64_t{-1},
                       std::int64_t{1} << 40, std::numeric_limits<std::int64_t>::min(),
                       std::numeric_limits<std::int64_t>::max()}}},
      {"floats", PyTuple{{1.5, -0.0, std::numeric_limits<double>::infinity(), 1e-300}}},
      {"str", std::string("h\xc3\xa9llo \xe2\x98\x83")},
      {"empty", PyTuple{}},
      {"t1", PyTuple{{std::int64_t{1}}}},
      {"t3", PyTuple{{std::int64_t{1}, std::string("a"), PyNone{}}}},
      {"size", PyTuple{{std::int64_t{2}, std::int64_t{3}}, true}},
      {std::int64_t{7}, std::string("int key")},
      {PyTuple{{std::int64_t{1}, std::string("a")}}, std::string("tuple key")},
      {"module", Dict({{"w", param}, {"v", view}, {"h", half}}, true)},
      {"dtype", PyDtype{"bfloat16"}},
      {"frag", Object("deepspeed.utils.tensor_fragment", "fragment_address",
                      Dict({{"numel", std::int64_t{6}}, {"start", std::int64_t{0}}}))},
      {"scaler", Object("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler",
                        Dict({{"cur_scale", 65536.0}, {"dtype", PyDtype{"float16"}}}))},
      {"big_list", PyList{std::vector<PyValue>(2500, PyValue(std::int64_t{3}))}},
      {"nested", PyList{{PyList{{PyList{{Dict({{"x", PyList{}}})}}}}}}},
  });
}

Result<PyValue> RoundTrip(const PyValue& v) {
  ZINF_ASSIGN_OR_RETURN(std::string bytes, WritePickle(v));
  return ReadPickle(bytes);
}

// ---- values and the writer

TEST(PyValue, TypeNameAndFind) {
  EXPECT_EQ(PyValue().TypeName(), "None");
  EXPECT_EQ(PyValue(true).TypeName(), "bool");
  EXPECT_EQ(PyValue(std::int64_t{1}).TypeName(), "int");
  EXPECT_EQ(PyValue(1.0).TypeName(), "float");
  EXPECT_EQ(PyValue(std::string("x")).TypeName(), "str");
  EXPECT_EQ(PyValue(PyList{}).TypeName(), "list");
  EXPECT_EQ(PyValue(PyTuple{}).TypeName(), "tuple");
  EXPECT_EQ(PyValue(PyDict{}).TypeName(), "dict");
  EXPECT_EQ(PyValue(PyTensor{}).TypeName(), "tensor");
  EXPECT_EQ(PyValue(PyDtype{"float16"}).TypeName(), "dtype");
  EXPECT_EQ(PyValue(Object("m", "LossScaler", {})).TypeName(), "LossScaler");
  const PyDict d = Dict({{std::int64_t{1}, std::string("int")}, {"a", std::int64_t{2}}});
  ASSERT_NE(d.Find("a"), nullptr);
  EXPECT_EQ(*d.Find("a")->as<std::int64_t>(), 2);
  EXPECT_EQ(d.Find("1"), nullptr);  // an int key is not the str "1"
  EXPECT_EQ(d.Find("b"), nullptr);
}

TEST(PickleRoundTrip, EveryKindOfValue) {
  const PyValue tree = EveryKind();
  ZINF_ASSERT_OK_AND_ASSIGN(std::string bytes, WritePickle(tree));
  ZINF_ASSERT_OK_AND_ASSIGN(PyValue back, ReadPickle(bytes));
  EXPECT_EQ(Canon(back), Canon(tree));
  ZINF_ASSERT_OK_AND_ASSIGN(std::string again, WritePickle(back));
  EXPECT_EQ(again, bytes);
}

TEST(PickleRoundTrip, IntegersAtEveryWidth) {
  std::vector<std::int64_t> values = {0, 1, 255, 256, 65535, 65536, -1, -128, -129, -32768};
  for (int bits = 8; bits < 63; ++bits) {
    const std::int64_t p = std::int64_t{1} << bits;
    for (std::int64_t v : {p - 1, p, p + 1, -p - 1, -p, -p + 1}) values.push_back(v);
  }
  values.push_back(std::numeric_limits<std::int64_t>::max());
  values.push_back(std::numeric_limits<std::int64_t>::min());
  for (std::int64_t v : values) {
    ZINF_ASSERT_OK_AND_ASSIGN(PyValue back, RoundTrip(v));
    ASSERT_TRUE(back.is<std::int64_t>()) << v;
    EXPECT_EQ(*back.as<std::int64_t>(), v);
  }
}

TEST(PickleWrite, TensorIsWrittenAsTorchWritesIt) {
  // torch 1.13's torch.save({'a': torch.arange(6.).reshape(2, 3)}) data.pkl, its BINPUTs left
  // out (WritePickle keeps no memo).
  const std::string torch_bytes =
      Proto() + "}" + Unicode("a") + Global("torch._utils", "_rebuild_tensor_v2") + "((" +
      Unicode("storage") + Global("torch", "FloatStorage") + Unicode("0") + Unicode("cpu") +
      B({'K', 6}) + "tQ" + B({'K', 0, 'K', 2, 'K', 3, 0x86, 'K', 3, 'K', 1, 0x86, 0x89}) +
      Global("collections", "OrderedDict") + ")RtRs.";
  const PyValue tree = Dict({{"a", Tensor("0", {2, 3}, {3, 1}, 6)}});
  ZINF_ASSERT_OK_AND_ASSIGN(std::string bytes, WritePickle(tree));
  EXPECT_EQ(bytes, torch_bytes);
}

TEST(PickleWrite, RefusesWhatProtocol2CannotHold) {
  EXPECT_THAT(WritePickle(Dict({{PyList{}, std::int64_t{1}}})),
              ErrorIs(ErrorCode::kInvalidArgument, ("dict key of type list")));
  EXPECT_THAT(WritePickle(Dict({{1.5, std::int64_t{1}}})),
              ErrorIs(ErrorCode::kInvalidArgument, ("dict key of type float")));
  PyValue deep = PyList{};
  for (int i = 0; i < 101; ++i) deep = PyList{{deep}};
  EXPECT_THAT(WritePickle(deep), ErrorIs(ErrorCode::kInvalidArgument, ("deeper")));
  EXPECT_THAT(WritePickle(std::string("\xff")),
              ErrorIs(ErrorCode::kInvalidArgument, ("not UTF-8")));
  EXPECT_THAT(WritePickle(Tensor("0", {2}, {1}, 2, 0, "float8")),
              ErrorIs(ErrorCode::kInvalidArgument, ("float8")));
  EXPECT_THAT(WritePickle(Tensor("0", {2, 3}, {3, 1}, 5)),
              ErrorIs(ErrorCode::kInvalidArgument, ("storage of 5")));
  EXPECT_THAT(WritePickle(PyDtype{"system"}), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(WritePickle(Object("os", "system", {})),
              ErrorIs(ErrorCode::kInvalidArgument, ("os.system")));
  EXPECT_THAT(WritePickle(PyTuple{{std::string("x")}, true}),
              ErrorIs(ErrorCode::kInvalidArgument, ("torch.Size holds a str")));
}

// ---- the reader on hand-made pickles

TEST(PickleRead, OpcodesOfProtocols0To4) {
  // Protocol 4 forms in one list: FRAME, SHORT_BINUNICODE, MEMOIZE, STACK_GLOBAL,
  // EMPTY_SET/ADDITEMS, FROZENSET, BINUNICODE8, BINBYTES, a 9-byte LONG4 that fits, NEWOBJ_EX,
  // DUP/POP and POP_MARK (which leave nothing), LIST.
  const std::string p4 =
      B({0x80, 4, 0x95}) + Le64(0) + "(" + B({0x8c, 4}) + "size" + B({0x94}) +  //
      B({0x8c, 5}) + "torch" + B({0x8c, 4}) + "Size" + B({0x93, 'K', 2, 'K', 3, 0x86, 0x85, 'R'}) +
      B({'h', 0}) +                           //
      B({0x8f, '(', 'K', 1, 'K', 2, 0x90}) +  // a set
      B({'(', 'K', 9, 0x91}) +                // a frozenset
      B({0x8d}) + Le64(2) + "hi" +            //
      "B" + Le32(3) + B({'a', 0, 'b'}) +      //
      B({0x8b}) + Le32(9) + B({0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}) +
      B({0x8c, 31}) + "deepspeed.utils.tensor_fragment" + B({0x8c, 16}) + "fragment_address" +
      B({0x93, ')', '}', 0x92, '}', 'K', 5, 'K', 6, 's', 'b'}) +  //
      B({'2', '0', '(', 'N', '1', 'l', '.'});
  ZINF_ASSERT_OK_AND_ASSIGN(PyValue v, ReadPickle(p4));
  EXPECT_EQ(Canon(v),
            "['size', Size(2, 3), 'size', [1, 2], [9], 'hi', 'a\\x00b', -2, "
            "deepspeed.utils.tensor_fragment.fragment_address({5: 6})]");
  // Protocol 0 text forms: INT (and its bools), LONG, FLOAT, PUT, GET, LIST, DICT.
  const std::string p0 =
      "(lp0\nI12\naI01\naL-12345678901234L\naF2.5\na(dp1\nI3\nI4\nsag1\naI00\na.";
  ZINF_ASSERT_OK_AND_ASSIGN(PyValue v0, ReadPickle(p0));
  EXPECT_EQ(Canon(v0), fmt::format("[12, True, -12345678901234, f:{:016x}, {{3: 4}}, {{3: 4}}, "
                                   "False]",
                                   std::bit_cast<std::uint64_t>(2.5)));
}

TEST(PickleRead, MemoSharesObjectsAsPythonDoes) {
  // d = {}; memoized empty, filled after; the list holds it twice: both copies are filled.
  const std::string p = Proto() + "]q" + B({0}) + "}q" + B({1}) + Unicode("k") + B({'K', 1}) + "s" +
                        "h" + B({1}) + "e" + ".";
  // APPENDS without a MARK; then the dict fetched again before it is filled, filled through
  // the second reference: both are the same dict, as in Python.
  const std::string fixed =
      Proto() + "]q" + B({0}) + "(}q" + B({1}) + "h" + B({1}) + Unicode("k") + B({'K', 1}) + "se.";
  EXPECT_THAT(ReadPickle(p), StatusIs(ErrorCode::kDataLoss));
  ZINF_ASSERT_OK_AND_ASSIGN(PyValue v, ReadPickle(fixed));
  EXPECT_EQ(Canon(v), "[{'k': 1}, {'k': 1}]");
  // A key set twice keeps its first place and its last value, as a Python dict does.
  const std::string twice = Proto() + "}(" + Unicode("a") + B({'K', 1}) + Unicode("b") +
                            B({'K', 2}) + Unicode("a") + B({'K', 3}) + "u.";
  ZINF_ASSERT_OK_AND_ASSIGN(PyValue d, ReadPickle(twice));
  EXPECT_EQ(Canon(d), "{'a': 3, 'b': 2}");
}

TEST(PickleRead, ZeroStageEnumBothWays) {
  // Python 3.11: getattr(ZeroStageEnum, 'gradients'); older: ZeroStageEnum(2).
  const std::string enum_class = Global("deepspeed.runtime.zero.config", "ZeroStageEnum");
  ZINF_ASSERT_OK_AND_ASSIGN(PyValue a,
                            ReadPickle(Proto() + Global("builtins", "getattr") + enum_class +
                                       Unicode("gradients") + B({0x86}) + "R."));
  EXPECT_EQ(Canon(a), "2");
  ZINF_ASSERT_OK_AND_ASSIGN(PyValue b, ReadPickle(Proto() + enum_class + B({'K', 3, 0x85}) + "R."));
  EXPECT_EQ(Canon(b), "3");
  EXPECT_THAT(ReadPickle(Proto() + enum_class + B({'K', 9, 0x85}) + "R."),
              ErrorIs(ErrorCode::kDataLoss, ("ZeroStageEnum")));
  // getattr on anything else is refused, not called.
  EXPECT_THAT(
      ReadPickle(Proto() + Global("builtins", "getattr") + Global("collections", "OrderedDict") +
                 Unicode("fromkeys") + B({0x86}) + "R."),
      ErrorIs(ErrorCode::kInvalidArgument, ("getattr")));
}

// ---- hostile pickles

TEST(PickleHostile, CodeRunningGlobalsAreRefusedByNameAndNothingRuns) {
  testing::ScratchDir dir("pickle");
  const std::string marker = dir.Join("ran");
  const std::string command = "touch " + marker;
  const std::vector<std::pair<std::string, std::string>> names = {
      {"os", "system"},
      {"posix", "system"},
      {"nt", "system"},
      {"builtins", "eval"},
      {"builtins", "exec"},
      {"__builtin__", "eval"},
      {"builtins", "__import__"},
      {"subprocess", "Popen"},
      {"subprocess", "check_output"},
      {"torch", "load"},
      {"torch._utils", "_rebuild_device_tensor_from_numpy"},
      {"collections", "defaultdict"},
      {"argparse", "Namespace"},
      {"copyreg", "_reconstruct"},
  };
  for (const auto& [module, name] : names) {
    const std::string want =
        fmt::format("pickle names {}.{}, which zinf does not load (no code is run)", module, name);
    // GLOBAL + REDUCE, as protocol 2 writes os.system('touch ...').
    const std::string global = Proto() + Global(module, name) + Unicode(command) + B({0x85}) + "R.";
    EXPECT_THAT(ReadPickle(global), ErrorIs(ErrorCode::kInvalidArgument, (want)));
    // STACK_GLOBAL, as protocol 4 writes it.
    const std::string stack = B({0x80, 4}) + Unicode(module) + Unicode(name) + B({0x93}) +
                              Unicode(command) + B({0x85}) + "R.";
    EXPECT_THAT(ReadPickle(stack), ErrorIs(ErrorCode::kInvalidArgument, (want)));
    // INST, protocol 0's class call.
    const std::string inst = "(" + Unicode(command) + fmt::format("i{}\n{}\n.", module, name);
    EXPECT_THAT(ReadPickle(inst), ErrorIs(ErrorCode::kInvalidArgument, (want)));
  }
  // A name with bytes that are not text is named escaped.
  EXPECT_THAT(ReadPickle(Proto() + Global("os\x1b[2J", "system") + "."),
              ErrorIs(ErrorCode::kInvalidArgument, ("os\\x1b[2J.system")));
  struct stat st;
  EXPECT_NE(::stat(marker.c_str(), &st), 0) << "a pickle ran a command";
}

TEST(PickleHostile, TruncatedAtEveryByteIsDataLoss) {
  ZINF_ASSERT_OK_AND_ASSIGN(std::string whole, WritePickle(EveryKind()));
  for (std::size_t n = 0; n < whole.size(); ++n) {
    auto r = ReadPickle(std::string_view(whole).substr(0, n));
    ASSERT_FALSE(r.has_value()) << "prefix of " << n << " bytes";
    ASSERT_EQ(r.error().code(), ErrorCode::kDataLoss) << n << ": " << r.error().ToString();
  }
}

TEST(PickleHostile, NestingBeyondMaxDepthIsDataLoss) {
  // With MARKs, as Python writes lists of two items.
  std::string marks = Proto();
  for (int i = 0; i < 200; ++i) marks += "](";
  for (int i = 0; i < 200; ++i) marks += "Ne";
  marks += ".";
  EXPECT_THAT(ReadPickle(marks), ErrorIs(ErrorCode::kDataLoss, ("max_depth 100")));
  // On the stack, no MARK: lists appended into each other.
  std::string stack = Proto();
  for (int i = 0; i < 200; ++i) stack += "]";
  for (int i = 0; i < 199; ++i) stack += "a";
  stack += ".";
  EXPECT_THAT(ReadPickle(stack), ErrorIs(ErrorCode::kDataLoss, ("max_depth 100")));
  // Through the memo, with a stack of two: ] q0 then (] q1 a POP h1) ... .
  std::string memo = Proto() + "]q" + B({0});
  for (unsigned i = 1; i < 250; ++i) memo += "]q" + B({i}) + "a0h" + B({i});
  memo += "0h" + B({0}) + ".";
  EXPECT_THAT(ReadPickle(memo), ErrorIs(ErrorCode::kDataLoss, ("max_depth 100")));
  // A list that holds itself.
  EXPECT_THAT(ReadPickle(Proto() + "]q" + B({0}) + "h" + B({0}) + "a."),
              ErrorIs(ErrorCode::kDataLoss, ("a container holds itself")));
  // Within the limit, and a lower limit.
  std::string ok = Proto();
  for (int i = 0; i < 50; ++i) ok += "]";
  for (int i = 0; i < 49; ++i) ok += "a";
  ok += ".";
  ZINF_EXPECT_OK(ReadPickle(ok));
  EXPECT_THAT(ReadPickle(ok, PickleLimits{.max_depth = 10}),
              ErrorIs(ErrorCode::kDataLoss, ("max_depth 10")));
}

TEST(PickleHostile, HugeLengthsAreRefusedBeforeAllocating) {
  EXPECT_THAT(ReadPickle(Proto() + "X" + Le32(0xfffffff0) + "abc."),
              ErrorIs(ErrorCode::kDataLoss, ("max_string_bytes")));
  EXPECT_THAT(ReadPickle(Proto() + B({0x8d}) + Le64(std::uint64_t{1} << 40) + "abc."),
              ErrorIs(ErrorCode::kDataLoss, ("max_string_bytes")));
  EXPECT_THAT(ReadPickle(Proto() + B({0x8e}) + Le64(~std::uint64_t{0}) + "abc."),
              StatusIs(ErrorCode::kDataLoss));
  EXPECT_THAT(ReadPickle(Proto() + "X" + Le32(1000) + "abc."),
              ErrorIs(ErrorCode::kDataLoss, ("truncated")));
  EXPECT_THAT(ReadPickle(Proto() + "X" + Le32(5) + "abcde.", PickleLimits{.max_string_bytes = 4}),
              ErrorIs(ErrorCode::kDataLoss, ("max_string_bytes 4")));
  // LONG4 claiming 2 GiB of digits, a negative count, and 9 bytes that do not fit 64 bits.
  EXPECT_THAT(ReadPickle(Proto() + B({0x8b}) + Le32(0x7fffffff) + "abc."),
              ErrorIs(ErrorCode::kDataLoss, ("beyond 64 bits")));
  EXPECT_THAT(ReadPickle(Proto() + B({0x8b}) + Le32(0x80000000) + "abc."),
              ErrorIs(ErrorCode::kDataLoss, ("negative")));
  EXPECT_THAT(ReadPickle(Proto() + B({0x8b}) + Le32(9) + B({0, 0, 0, 0, 0, 0, 0, 0, 1}) + "."),
              ErrorIs(ErrorCode::kDataLoss, ("beyond 64 bits")));
  EXPECT_THAT(ReadPickle(Proto() + B({0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0x80, 0}) + "."),
              ErrorIs(ErrorCode::kDataLoss, ("beyond 64 bits")));
  EXPECT_THAT(ReadPickle(Proto() + "L123456789012345678901234567890L\n."),
              ErrorIs(ErrorCode::kDataLoss, ("beyond 64 bits")));
  EXPECT_THAT(ReadPickle(Proto() + B({0x95}) + Le64(std::uint64_t{1} << 40) + "N."),
              ErrorIs(ErrorCode::kDataLoss, ("FRAME")));
  EXPECT_THAT(ReadPickle(Proto() + "c" + std::string(5000, 'a') + "\nb\n."),
              ErrorIs(ErrorCode::kDataLoss, ("too long")));
  EXPECT_THAT(ReadPickle("N.", PickleLimits{.max_bytes = 1}),
              ErrorIs(ErrorCode::kDataLoss, ("max_bytes")));
  // A 9-byte LONG4 whose extra byte is only sign is the int64 it holds.
  ZINF_ASSERT_OK_AND_ASSIGN(
      PyValue minus_one,
      ReadPickle(Proto() + B({0x8b}) + Le32(9) +
                 B({0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}) + "."));
  EXPECT_EQ(Canon(minus_one), "-1");
}

TEST(PickleHostile, MemoErrors) {
  EXPECT_THAT(ReadPickle(Proto() + "h" + B({5}) + "."),
              ErrorIs(ErrorCode::kDataLoss, ("memo index 5 was never stored")));
  EXPECT_THAT(ReadPickle(Proto() + "j" + Le32(0xffffffff) + "."),
              ErrorIs(ErrorCode::kDataLoss, ("never stored")));
  EXPECT_THAT(ReadPickle(Proto() + "g7\n."), ErrorIs(ErrorCode::kDataLoss, ("never stored")));
  EXPECT_THAT(ReadPickle(Proto() + "Nr" + Le32(0xffffff00) + "."),
              ErrorIs(ErrorCode::kDataLoss, ("max_memo")));
  EXPECT_THAT(ReadPickle(Proto() + "q" + B({0}) + "N."),
              ErrorIs(ErrorCode::kDataLoss, ("stack underflow")));
}

TEST(PickleHostile, StackAndMarkErrors) {
  const auto data_loss = [](const std::string& p, const char* what) {
    EXPECT_THAT(ReadPickle(p), ErrorIs(ErrorCode::kDataLoss, (what))) << Quote(p);
  };
  data_loss(Proto() + "a.", "stack underflow");
  data_loss(Proto() + "]a.", "stack underflow");
  data_loss(Proto() + "0.", "no MARK");
  data_loss(Proto() + "Nt.", "no MARK");
  data_loss(Proto() + "](Na.", "stack underflow");  // the APPEND's list is below the MARK
  data_loss(Proto() + "N(Na.", "stack underflow");
  data_loss(Proto() + ".", "STOP with 0 values");
  data_loss(Proto() + "NN.", "STOP with 2 values");
  data_loss(Proto() + "(N.", "1 MARKs");
  data_loss(Proto() + "}(NNN" + "u.", "odd number");
  data_loss(Proto() + "(NNNd.", "odd number");
  data_loss(Proto() + "Ns.", "stack underflow");
  data_loss(Proto() + B({0xff}) + ".", "unsupported pickle opcode 0xff");
  data_loss(Proto() + "S'x'\n.", "unsupported pickle opcode 0x53");
  data_loss(Proto() + "N.N", "1 bytes after STOP");
  data_loss(Proto() + "N", "ends before STOP");
  data_loss(Proto(9) + "N.", "protocol 9");
  data_loss(Proto() + "N" + B({0x85, 0x86}) + ".", "stack underflow");
}

TEST(PickleHostile, ReduceBuildAndPersistentIdMisuse) {
  const auto data_loss = [](const std::string& p, const char* what) {
    EXPECT_THAT(ReadPickle(p), ErrorIs(ErrorCode::kDataLoss, (what))) << Quote(p);
  };
  const std::string od = Global("collections", "OrderedDict");
  data_loss(Proto() + Unicode("os.system") + ")R.", "REDUCE of a str, not a callable");
  data_loss(Proto() + "])R.", "REDUCE of a list, not a callable");
  data_loss(Proto() + od + "]R.", "REDUCE arguments is a list");
  data_loss(Proto() + od + "K" + B({1}) + B({0x85}) + "R.", "called with 1 arguments");
  data_loss(Proto() + Global("torch", "FloatStorage") + ")R.", "which zinf does not call");
  data_loss(Proto() + "]}b.", "BUILD target is a list");
  data_loss(Proto() + od + ")R}b.", "BUILD target is a dict");
  const std::string frag = Global("deepspeed.utils.tensor_fragment", "fragment_address");
  data_loss(Proto() + frag + ")" + B({0x81}) + "]b.", "BUILD state is a list");
  data_loss(Proto() + frag + ")" + B({0x81}) + "}b}b.", "built already");
  data_loss(Proto() + od + ")" + B({0x81}) + ".", "not a class zinf builds");
  data_loss(Proto() + frag + "K" + B({1}) + B({0x85, 0x81}) + ".", "NEWOBJ with arguments");
  // Persistent ids: only ('storage', <storage class>, key, location, numel).
  const std::string storage = Unicode("storage") + Global("torch", "FloatStorage") + Unicode("0") +
                              Unicode("cpu") + "K" + B({6});
  data_loss(Proto() + Unicode("0") + "Q.", "persistent id is a str");
  data_loss(Proto() + "(" + storage + "Nt" + "Q.", "persistent id of 6 items");
  data_loss(Proto() + "(" + Unicode("stor") + Global("torch", "FloatStorage") + Unicode("0") +
                Unicode("cpu") + "K" + B({6}) + "tQ.",
            "tagged 'stor'");
  data_loss(Proto() + "(" + Unicode("storage") + od + Unicode("0") + Unicode("cpu") + "K" + B({6}) +
                "tQ.",
            "storage class is collections.OrderedDict");
  data_loss(Proto() + "(" + Unicode("storage") + Global("torch", "FloatStorage") + Unicode("0") +
                Unicode("cpu") + "J" + Le32(0xffffffff) + "tQ.",
            "numel");
  // Tensor rebuilds with the wrong arguments, or beyond their storage.
  const std::string rebuild = Global("torch._utils", "_rebuild_tensor_v2");
  const auto tensor = [&](const std::string& size, const std::string& stride,
                          const std::string& offset = "K" + B({0})) {
    return Proto() + rebuild + "((" + storage + "tQ" + offset + size + stride + B({0x89}) + od +
           ")RtR.";
  };
  ZINF_ASSERT_OK_AND_ASSIGN(
      PyValue t, ReadPickle(tensor(B({'K', 2, 'K', 3, 0x86}), B({'K', 3, 'K', 1, 0x86}))));
  EXPECT_EQ(Canon(t), "tensor(float32, '0', 'cpu', 6, 0, [2, 3], [3, 1], False)");
  data_loss(tensor(B({'K', 2, 'K', 4, 0x86}), B({'K', 4, 'K', 1, 0x86})), "storage of 6");
  data_loss(tensor(B({'K', 2, 0x85}), B({'K', 1, 0x85}), "K" + B({5})), "storage of 6");
  data_loss(tensor(B({'K', 2, 'K', 3, 0x86}), B({'K', 1, 0x85})), "2 sizes but 1 strides");
  data_loss(tensor(B({'J'}) + Le32(0xffffffff) + B({0x85}), B({'K', 1, 0x85})), "negative");
  data_loss(tensor(B({'K', 2, 0x85}), B({'K', 1, 0x85}), "N"), "offset");
  data_loss(tensor(B({0x8a, 8}) + Le64(std::uint64_t{1} << 62) + B({'K', 3, 0x86}),
                   B({0x8a, 8}) + Le64(std::uint64_t{1} << 62) + B({'K', 1, 0x86})),
            "overflows");
  data_loss(
      Proto() + rebuild + "(" + Unicode("x") + "K" + B({0}) + ")" + ")" + B({0x89}) + od + ")RtR.",
      "tensor storage is a str");
  // A bare storage or a global as a value is refused, not made up.
  EXPECT_THAT(ReadPickle(Proto() + "(" + storage + "tQ."),
              ErrorIs(ErrorCode::kInvalidArgument, ("bare torch storage")));
  EXPECT_THAT(ReadPickle(Proto() + od + "."),
              ErrorIs(ErrorCode::kInvalidArgument, ("collections.OrderedDict itself")));
}

TEST(PickleHostile, SharingCannotMultiplyTheTree) {
  // Each level a list of the previous level ten times: 10^12 items if expanded.
  std::string p = Proto() + "]q" + B({0});
  for (unsigned level = 1; level <= 12; ++level) {
    p += "](";
    for (int k = 0; k < 10; ++k) p += "h" + B({level - 1});
    p += "eq" + B({level});
  }
  p += ".";
  // Only the last list is on the stack at STOP? No: every level stayed; leave only the last.
  std::string clean = Proto() + "]q" + B({0}) + "0";
  for (unsigned level = 1; level <= 12; ++level) {
    clean += "](";
    for (int k = 0; k < 10; ++k) clean += "h" + B({level - 1});
    clean += "eq" + B({level}) + (level < 12 ? "0" : "");
  }
  clean += ".";
  EXPECT_THAT(ReadPickle(p), ErrorIs(ErrorCode::kDataLoss, ("STOP with 13 values")));
  // Found before anything is copied (a copy that found it late would be an Internal error).
  ASSERT_THAT(ReadPickle(clean, PickleLimits{.max_items = 100000}),
              ErrorIs(ErrorCode::kDataLoss, ("max_items 100000")));
  EXPECT_THAT(ReadPickle(clean), ErrorIs(ErrorCode::kDataLoss, ("max_items")));
  // The same with a string: a megabyte string used 2000 times is more than max_bytes.
  std::string s = Proto() + "X" + Le32(1 << 20) + std::string(1 << 20, 'a') + "q" + B({0}) + "0](";
  for (int k = 0; k < 2000; ++k) s += "h" + B({0});
  s += "e.";
  EXPECT_THAT(ReadPickle(s, PickleLimits{.max_bytes = 1 << 30}),
              ErrorIs(ErrorCode::kDataLoss, ("strings of more than max_bytes")));
  EXPECT_THAT(
      ReadPickle(Proto() + "](" + std::string(100, 'N') + "e.", PickleLimits{.max_items = 50}),
      ErrorIs(ErrorCode::kDataLoss, ("max_items 50")));
}

// Mutations of real pickles: each gives a value or an error (DataLoss or InvalidArgument), never
// a crash, a hang or another code. Run under ASan in CI.
TEST(PickleHostile, RandomMutationsGiveAValueOrAnError) {
  std::vector<std::string> seeds;
  ZINF_ASSERT_OK_AND_ASSIGN(std::string every, WritePickle(EveryKind()));
  seeds.push_back(every);
  seeds.push_back(B({0x80, 4, 0x95}) + Le64(0) + B({0x8c, 5}) + "torch" + B({0x94, 0x8c, 4}) +
                  "Size" + B({0x94, 0x93, 'K', 2,    'K', 3, 0x86, 0x85, 'R',  0x94, 0x8f,
                              '(',  'K',  1,   0x90, 'h', 0, 'h',  2,    0x87, '.'}));
  seeds.push_back("(lp0\nI12\naI01\naL-12345678901234L\naF2.5\na(dp1\nI3\nI4\nsag1\naI00\na.");
  std::mt19937_64 rng(46);
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  const std::string interesting =
      B({0x00, 0xff, 0x7f, 0x80, '(', ')',  '.',  'h',  'q', 'R', 'b',
         'e',  'u',  'a',  's',  't', 0x85, 0x93, 0x81, 'Q', 'X', 0x8b});
  int values = 0;
  for (int iteration = 0; iteration < 4000; ++iteration) {
    std::string p = seeds[pick(seeds.size())];
    const int edits = 1 + static_cast<int>(pick(4));
    for (int e = 0; e < edits && !p.empty(); ++e) {
      const std::size_t at = pick(p.size());
      switch (pick(5)) {
        case 0:
          p[at] = static_cast<char>(rng());
          break;
        case 1:
          p[at] = interesting[pick(interesting.size())];
          break;
        case 2:
          p.erase(at, 1 + pick(4));
          break;
        case 3:
          p.insert(at, 1, interesting[pick(interesting.size())]);
          break;
        case 4:
          p.insert(at, p.substr(pick(p.size()), pick(16)));
          break;
      }
    }
    auto r = ReadPickle(p, PickleLimits{.max_items = 1 << 16, .max_string_bytes = 1 << 20});
    if (r.has_value()) {
      ++values;
      continue;
    }
    const ErrorCode code = r.error().code();
    ASSERT_TRUE(code == ErrorCode::kDataLoss || code == ErrorCode::kInvalidArgument)
        << Quote(p) << ": " << r.error().ToString();
  }
  EXPECT_GT(values, 0);  // some mutations still read: the test reaches past the first error
}

// ---- Python's side (make_pickles.py): pickles Python and torch.save wrote, read here; pickles
// written here, read by Python's unpickler and torch.load.

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int RunScript(const std::string& command, const std::string& dir) {
  const std::string line = fmt::format("PYTHONDONTWRITEBYTECODE=1 {} {} {} {} > {}/log.txt 2>&1",
                                       ZINF_PYTHON, ZINF_MAKE_PICKLES_PY, command, dir, dir);
  const int rc = std::system(line.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(PythonPickles, ReadWhatPythonAndTorchWrite) {
  testing::ScratchDir dir("pickle-py");
  const int rc = RunScript("gen", dir.path());
  if (rc == 77) ZINF_SKIP_MISSING("torch", ReadText(dir.Join("log.txt")));
  ASSERT_EQ(rc, 0) << ReadText(dir.Join("log.txt"));
  std::istringstream cases(ReadText(dir.Join("cases.txt")));
  int n = 0;
  for (std::string name; std::getline(cases, name);) {
    if (name.empty()) continue;
    ++n;
    SCOPED_TRACE(name);
    auto value = ReadPickle(ReadText(dir.Join(name + ".pkl")));
    const std::string error = ReadText(dir.Join(name + ".error"));
    if (!error.empty()) {
      ASSERT_FALSE(value.has_value());
      EXPECT_THAT(value.error().message(), HasSubstr(error));
      continue;
    }
    ASSERT_TRUE(value.has_value()) << value.error().ToString();
    EXPECT_EQ(Canon(*value), ReadText(dir.Join(name + ".canon")));
  }
  EXPECT_GE(n, 25);
  struct stat st;
  EXPECT_NE(::stat(dir.Join("MARKER_os_system_ran").c_str(), &st), 0);
}

TEST(PythonPickles, PythonAndTorchReadWhatZinfWrites) {
  testing::ScratchDir dir("pickle-py");
  ASSERT_EQ(::mkdir(dir.Join("out").c_str(), 0700), 0);
  const std::vector<std::pair<std::string, PyValue>> trees = {
      {"every_kind", EveryKind()},
      {"tensors", Dict({{"t", Tensor("0", {3, 4}, {4, 1}, 12)},
                        {"col", Tensor("0", {3}, {4}, 12, 2)},
                        {"scalar", Tensor("1", {}, {}, 1, 0, "int64")},
                        {"half", Tensor("2", {2, 2}, {1, 2}, 4, 0, "float16")},
                        {"bf16", Tensor("3", {5}, {1}, 7, 2, "bfloat16")},
                        {"empty", Tensor("4", {0, 3}, {3, 1}, 0)}})},
      {"plain", PyList{{std::string("x"), 0.1, PyTuple{{std::int64_t{1} << 50}},
                        Dict({{"a", PyNone{}}}, true)}}},
  };
  for (const auto& [name, tree] : trees) {
    ZINF_ASSERT_OK_AND_ASSIGN(std::string bytes, WritePickle(tree));
    std::ofstream(dir.Join("out/" + name + ".pkl"), std::ios::binary) << bytes;
    std::ofstream(dir.Join("out/" + name + ".canon"), std::ios::binary) << Canon(tree);
  }
  const int rc = RunScript("check", dir.Join("out"));
  if (rc == 77) ZINF_SKIP_MISSING("torch", ReadText(dir.Join("out/log.txt")));
  EXPECT_EQ(rc, 0) << ReadText(dir.Join("out/log.txt"));
}

}  // namespace
}  // namespace zinf::interop
