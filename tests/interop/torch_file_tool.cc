// torch_file_tool: the C++ side of tests/interop/torch_compat_test.py.
//   torch_file_tool dump FILE    TorchFile::Read(FILE), printed as one JSON document (below)
//   torch_file_tool write FILE   TorchWriter: a fixed sample tree (SampleTree) for torch.load
// Exit 0 on success, 1 with the error on stderr, 2 on a usage error.
//
// JSON of a value: None null, bool, int as numbers, str as strings, float {"float": "<16 hex
// digits of the double's bits>"}, list [..], tuple {"tuple": [..]}, torch.Size {"size": [..]},
// dict {"dict": [[k, v], ..]}, OrderedDict {"odict": [[k, v], ..]}, dtype {"dtype": name},
// object {"object": "module.name", "state": value}, tensor {"tensor": {dtype, shape, stride,
// offset, storage, storage_numel, location, requires_grad, values}} where values are the
// elements as fp32 bits ("8 hex digits") for float32/float16/bfloat16, numbers for int64, and
// null for other dtypes or a tensor that is not contiguous.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/status.h"
#include "zinf/interop/pickle.h"
#include "zinf/interop/torch_file.h"
#include "zinf/storage/fs.h"

namespace zinf::interop {
namespace {

constexpr std::uint64_t kMaxDumpNumel = std::uint64_t{1} << 28;

bool ValidUtf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t n = c < 0x80           ? 0
                          : (c >> 5) == 0x6  ? 1
                          : (c >> 4) == 0xe  ? 2
                          : (c >> 3) == 0x1e ? 3
                                             : 4;
    if (n == 4 || n >= s.size() - i) return false;  // a bad lead byte, or cut short
    for (std::size_t k = 1; k <= n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    i += n + 1;
  }
  return true;
}

void JsonString(std::string& out, std::string_view s) {
  const bool utf8 = ValidUtf8(s);
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"') {
      out += "\\\"";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7f || (c >= 0x80 && !utf8)) {
      out += fmt::format("\\u{:04x}", c);
    } else {
      out += ch;
    }
  }
  out += '"';
}

template <typename T>
void JsonList(std::string& out, const std::vector<T>& items) {
  out += '[';
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    out += fmt::format("{}", items[i]);
  }
  out += ']';
}

Status Dump(const TorchFile& file, const PyValue& v, std::string& out);

Status DumpItems(const TorchFile& file, const std::vector<PyValue>& items, std::string& out) {
  out += '[';
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    ZINF_RETURN_IF_ERROR(Dump(file, items[i], out));
  }
  out += ']';
  return OkStatus();
}

Status DumpTensor(const TorchFile& file, const PyTensor& t, std::string& out) {
  out += "{\"tensor\": {\"dtype\": ";
  JsonString(out, t.dtype);
  out += ", \"shape\": ";
  JsonList(out, t.shape);
  out += ", \"stride\": ";
  JsonList(out, t.stride);
  out += fmt::format(", \"offset\": {}, \"storage\": ", t.offset);
  JsonString(out, t.storage_key);
  out += fmt::format(", \"storage_numel\": {}, \"location\": ", t.storage_numel);
  JsonString(out, t.location);
  out += fmt::format(", \"requires_grad\": {}, \"values\": ", t.requires_grad ? "true" : "false");
  bool contiguous = true;
  std::int64_t expected = 1;
  bool empty = false;
  for (auto s : t.shape) empty = empty || s == 0;
  for (std::size_t d = t.shape.size(); d-- > 0 && !empty;) {
    if (t.shape[d] != 1 && t.stride[d] != expected) contiguous = false;
    expected *= t.shape[d];
  }
  if (!contiguous) {
    out += "null";
  } else if (t.dtype == "float32" || t.dtype == "float16" || t.dtype == "bfloat16") {
    auto values = file.ReadFloat32(t, kMaxDumpNumel);
    if (!values) return values.error();
    out += '[';
    for (std::size_t i = 0; i < values->size(); ++i) {
      out += fmt::format("{}\"{:08x}\"", i > 0 ? ", " : "",
                         std::bit_cast<std::uint32_t>((*values)[i]));
    }
    out += ']';
  } else if (t.dtype == "int64") {
    auto values = file.ReadInt64(t, kMaxDumpNumel);
    if (!values) return values.error();
    JsonList(out, *values);
  } else {
    out += "null";
  }
  out += "}}";
  return OkStatus();
}

Status Dump(const TorchFile& file, const PyValue& v, std::string& out) {
  if (v.is<PyNone>()) {
    out += "null";
  } else if (const auto* b = v.as<bool>()) {
    out += *b ? "true" : "false";
  } else if (const auto* i = v.as<std::int64_t>()) {
    out += fmt::format("{}", *i);
  } else if (const auto* d = v.as<double>()) {
    out += fmt::format("{{\"float\": \"{:016x}\"}}", std::bit_cast<std::uint64_t>(*d));
  } else if (const auto* s = v.as<std::string>()) {
    JsonString(out, *s);
  } else if (const auto* l = v.as<PyList>()) {
    ZINF_RETURN_IF_ERROR(DumpItems(file, l->items, out));
  } else if (const auto* t = v.as<PyTuple>()) {
    out += t->torch_size ? "{\"size\": " : "{\"tuple\": ";
    ZINF_RETURN_IF_ERROR(DumpItems(file, t->items, out));
    out += '}';
  } else if (const auto* dict = v.as<PyDict>()) {
    out += dict->ordered ? "{\"odict\": [" : "{\"dict\": [";
    for (std::size_t k = 0; k < dict->items.size(); ++k) {
      out += k > 0 ? ", [" : "[";
      ZINF_RETURN_IF_ERROR(Dump(file, dict->items[k].first, out));
      out += ", ";
      ZINF_RETURN_IF_ERROR(Dump(file, dict->items[k].second, out));
      out += ']';
    }
    out += "]}";
  } else if (const auto* tensor = v.as<PyTensor>()) {
    ZINF_RETURN_IF_ERROR(DumpTensor(file, *tensor, out));
  } else if (const auto* dtype = v.as<PyDtype>()) {
    out += "{\"dtype\": ";
    JsonString(out, dtype->name);
    out += '}';
  } else if (const auto* obj = v.as<PyObject>()) {
    out += "{\"object\": ";
    JsonString(out, obj->module + "." + obj->name);
    out += ", \"state\": ";
    if (obj->state == nullptr) {
      out += "null";
    } else {
      ZINF_RETURN_IF_ERROR(Dump(file, *obj->state, out));
    }
    out += '}';
  } else {
    return InternalError(fmt::format("torch_file_tool: no JSON for a {}", v.TypeName()));
  }
  return OkStatus();
}

// The tree `write` saves; torch_compat_test.py's expected_sample() is the same tree in Python.
Result<PyValue> SampleTree(TorchWriter& w) {
  auto bits = [](std::uint32_t b) { return std::bit_cast<float>(b); };
  std::vector<float> embed(12);
  for (std::size_t k = 0; k < embed.size(); ++k) embed[k] = static_cast<float>(k) * 0.25f - 1.5f;
  std::vector<float> bias = {-0.0f, bits(0x00000001), std::numeric_limits<float>::infinity(),
                             bits(0x7fc00001)};
  std::vector<float> scale = {3.5f};
  std::vector<float> cube(12);
  for (std::size_t k = 0; k < cube.size(); ++k) cube[k] = static_cast<float>(k + 1) / 3.0f;
  std::vector<std::int64_t> step = {7};
  std::vector<std::int64_t> ids = {1, -2, std::int64_t{1} << 40};

  PyDict model{.items = {}, .ordered = true};
  ZINF_ASSIGN_OR_RETURN(PyTensor t_embed, w.AddFloat32(embed, {3, 4}));
  ZINF_ASSIGN_OR_RETURN(PyTensor t_bias, w.AddFloat32(bias, {4}));
  ZINF_ASSIGN_OR_RETURN(PyTensor t_scale, w.AddFloat32(scale, {}));
  ZINF_ASSIGN_OR_RETURN(PyTensor t_empty, w.AddFloat32({}, {0, 3}));
  ZINF_ASSIGN_OR_RETURN(PyTensor t_cube, w.AddFloat32(cube, {2, 3, 2}));
  ZINF_ASSIGN_OR_RETURN(PyTensor t_step, w.AddInt64(step, {}));
  ZINF_ASSIGN_OR_RETURN(PyTensor t_ids, w.AddInt64(ids, {3}));
  model.items.emplace_back(std::string("embed.weight"), t_embed);
  model.items.emplace_back(std::string("embed.bias"), t_bias);
  model.items.emplace_back(std::string("scale"), t_scale);
  model.items.emplace_back(std::string("empty"), t_empty);
  model.items.emplace_back(std::string("cube"), t_cube);

  PyDict inner;
  inner.items.emplace_back(std::string("a"), 1.5);
  inner.items.emplace_back(std::int64_t{3}, std::string("three"));

  PyDict root;
  root.items.emplace_back(std::string("model"), std::move(model));
  root.items.emplace_back(std::string("shape"),
                          PyTuple{.items = {std::int64_t{3}, std::int64_t{4}}, .torch_size = true});
  root.items.emplace_back(std::string("step"), t_step);
  root.items.emplace_back(std::string("ids"), t_ids);
  root.items.emplace_back(std::string("ints"),
                          PyList{.items = {std::int64_t{0}, std::int64_t{-1}, std::int64_t{1} << 40,
                                           std::numeric_limits<std::int64_t>::min(),
                                           std::numeric_limits<std::int64_t>::max()}});
  root.items.emplace_back(
      std::string("floats"),
      PyList{.items = {0.1, -2.5, 1e300, std::numeric_limits<double>::infinity(), -0.0}});
  root.items.emplace_back(std::string("name"), std::string("zinf \xc3\xbcn\xc3\xaf"
                                                           "code \xe2\x9c\x93"));
  root.items.emplace_back(std::string("flags"), PyTuple{.items = {true, false, PyNone{}}});
  root.items.emplace_back(std::string("nested"),
                          PyList{.items = {PyList{.items = {std::int64_t{1}, std::int64_t{2}}},
                                           std::move(inner), PyList{}}});
  return PyValue(std::move(root));
}

int Run(int argc, char** argv) {
  if (argc != 3 || (std::string_view(argv[1]) != "dump" && std::string_view(argv[1]) != "write")) {
    std::fprintf(stderr, "usage: torch_file_tool dump FILE | write FILE\n");
    return 2;
  }
  const std::string path = argv[2];
  if (std::string_view(argv[1]) == "dump") {
    auto file = TorchFile::Read(path);
    if (!file) {
      std::fprintf(stderr, "torch_file_tool: %s\n", file.error().ToString().c_str());
      return 1;
    }
    std::string out;
    if (auto s = Dump(*file, file->root(), out); !s) {
      std::fprintf(stderr, "torch_file_tool: %s\n", s.error().ToString().c_str());
      return 1;
    }
    out += '\n';
    std::fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  }
  auto writer = TorchWriter::Create(path, storage::Overwrite::kRegularFile);
  Status s = writer ? OkStatus() : Status(writer.error());
  if (s) {
    auto tree = SampleTree(*writer);
    s = tree ? writer->Finish(*tree) : Status(tree.error());
  }
  if (!s) {
    std::fprintf(stderr, "torch_file_tool: %s\n", s.error().ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace zinf::interop

int main(int argc, char** argv) { return zinf::interop::Run(argc, argv); }
