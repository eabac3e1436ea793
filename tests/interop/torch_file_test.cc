// torch files (interop/torch_file.h): TorchWriter -> TorchFile::Read round trips, the checks
// Read makes on every tensor of hand-built trees, ReadFloat32's widening of every fp16 and bf16
// value, CRC checks of storages, and the archive checks (one folder, data.pkl, version, legacy).
#include "zinf/interop/torch_file.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/interop/pickle.h"
#include "zinf/interop/zip.h"

namespace zinf::interop {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;

PyTensor Tensor(std::string dtype, std::string key, std::uint64_t storage_numel,
                std::uint64_t offset, std::vector<std::int64_t> shape,
                std::vector<std::int64_t> stride) {
  return PyTensor{.dtype = std::move(dtype),
                  .storage_key = std::move(key),
                  .location = "cpu",
                  .storage_numel = storage_numel,
                  .offset = offset,
                  .shape = std::move(shape),
                  .stride = std::move(stride),
                  .requires_grad = false};
}

PyValue Dict(std::vector<std::pair<std::string, PyValue>> items, bool ordered = false) {
  PyDict d{.items = {}, .ordered = ordered};
  for (auto& [k, v] : items) d.items.emplace_back(PyValue(k), std::move(v));
  return d;
}

std::string Bytes(std::uint64_t n, char fill = 0) { return std::string(n, fill); }

// A torch file written entry by entry: storages "<archive>/data/<key>", data.pkl holding `root`
// (WritePickle), and "<archive>/version" unless `version` is null.
struct RawFile {
  std::string archive = "archive";
  std::vector<std::pair<std::string, std::string>> storages;  // key, bytes
  const char* version = "3\n";
  std::vector<std::pair<std::string, std::string>> extra;  // full name, bytes
};
RawFile WithStorages(std::vector<std::pair<std::string, std::string>> storages) {
  RawFile f;
  f.storages = std::move(storages);
  return f;
}
RawFile WithVersion(const char* version,
                    std::vector<std::pair<std::string, std::string>> extra = {}) {
  RawFile f;
  f.version = version;
  f.extra = std::move(extra);
  return f;
}
RawFile WithExtra(std::vector<std::pair<std::string, std::string>> extra) {
  return WithVersion("3\n", std::move(extra));
}
Status WriteRaw(const std::string& path, const RawFile& f, const PyValue& root) {
  ZINF_ASSIGN_OR_RETURN(ZipWriter zip, ZipWriter::Create(path, storage::Overwrite::kRegularFile));
  for (const auto& [key, bytes] : f.storages) {
    ZINF_RETURN_IF_ERROR(zip.Add(f.archive + "/data/" + key, std::string_view(bytes)));
  }
  ZINF_ASSIGN_OR_RETURN(std::string pkl, WritePickle(root));
  ZINF_RETURN_IF_ERROR(zip.Add(f.archive + "/data.pkl", std::string_view(pkl)));
  if (f.version != nullptr) {
    ZINF_RETURN_IF_ERROR(zip.Add(f.archive + "/version", std::string_view(f.version)));
  }
  for (const auto& [name, bytes] : f.extra) {
    ZINF_RETURN_IF_ERROR(zip.Add(name, std::string_view(bytes)));
  }
  return zip.Finish();
}

// A protocol-2 pickle of {"t": t} written opcode by opcode, as torch writes a tensor, for
// tensors WritePickle refuses to write (strides that do not match, views past the storage).
void PutLong1(std::string& out, std::uint64_t v, bool unsigned_high) {
  out += '\x8a';
  const bool extra = unsigned_high && (v >> 63) != 0;  // a positive value >= 2^63
  out += static_cast<char>(extra ? 9 : 8);
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
  if (extra) out += '\0';
}
void PutStr(std::string& out, std::string_view s) {
  out += 'X';
  const auto n = static_cast<std::uint32_t>(s.size());
  for (int i = 0; i < 4; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  out += s;
}
std::string StorageClass(std::string_view dtype) {
  if (dtype == "float32") return "FloatStorage";
  if (dtype == "float16") return "HalfStorage";
  if (dtype == "bfloat16") return "BFloat16Storage";
  if (dtype == "int32") return "IntStorage";
  return "LongStorage";
}
std::string HandPickledTensor(const PyTensor& t) {
  std::string p("\x80\x02}", 3);
  PutStr(p, "t");
  p += "ctorch._utils\n_rebuild_tensor_v2\n((";  // the arguments, the persistent id
  PutStr(p, "storage");
  p += "ctorch\n" + StorageClass(t.dtype) + "\n";
  PutStr(p, t.storage_key);
  PutStr(p, t.location);
  PutLong1(p, t.storage_numel, true);
  p += "tQ";
  PutLong1(p, t.offset, true);
  p += '(';
  for (auto v : t.shape) PutLong1(p, static_cast<std::uint64_t>(v), false);
  p += "t(";
  for (auto v : t.stride) PutLong1(p, static_cast<std::uint64_t>(v), false);
  p += "t\x89"
       "ccollections\nOrderedDict\n)RtRs.";
  return p;
}
Status WriteHandPickled(const std::string& path, const RawFile& f, const PyTensor& t) {
  ZINF_ASSIGN_OR_RETURN(ZipWriter zip, ZipWriter::Create(path, storage::Overwrite::kRegularFile));
  for (const auto& [key, bytes] : f.storages) {
    ZINF_RETURN_IF_ERROR(zip.Add(f.archive + "/data/" + key, std::string_view(bytes)));
  }
  ZINF_RETURN_IF_ERROR(zip.Add(f.archive + "/data.pkl", std::string_view(HandPickledTensor(t))));
  ZINF_RETURN_IF_ERROR(zip.Add(f.archive + "/version", std::string_view("3\n")));
  return zip.Finish();
}

// Flips one bit of the `at`-th byte of entry `name` of the zip at `path`.
void FlipEntryByte(const std::string& path, const std::string& name, std::uint64_t at) {
  auto zip = ZipReader::Open(path);
  ASSERT_THAT(zip, IsOk());
  const ZipEntry* e = zip->Find(name);
  ASSERT_NE(e, nullptr) << name;
  ASSERT_LT(at, e->size);
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(e->data_offset + at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(e->data_offset + at));
  f.write(&c, 1);
  ASSERT_TRUE(f.good());
}

const PyTensor* TensorAt(const PyValue& root, std::string_view key) {
  const auto* d = root.as<PyDict>();
  if (d == nullptr) return nullptr;
  const PyValue* v = d->Find(key);
  return v == nullptr ? nullptr : v->as<PyTensor>();
}

std::vector<std::uint32_t> Bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> out;
  for (float f : v) out.push_back(std::bit_cast<std::uint32_t>(f));
  return out;
}

TEST(DtypeBytes, KnowsTorchDtypes) {
  EXPECT_EQ(DtypeBytes("float32"), 4u);
  EXPECT_EQ(DtypeBytes("float16"), 2u);
  EXPECT_EQ(DtypeBytes("bfloat16"), 2u);
  EXPECT_EQ(DtypeBytes("float64"), 8u);
  EXPECT_EQ(DtypeBytes("int64"), 8u);
  EXPECT_EQ(DtypeBytes("int32"), 4u);
  EXPECT_EQ(DtypeBytes("int16"), 2u);
  EXPECT_EQ(DtypeBytes("int8"), 1u);
  EXPECT_EQ(DtypeBytes("uint8"), 1u);
  EXPECT_EQ(DtypeBytes("bool"), 1u);
  EXPECT_EQ(DtypeBytes("float"), 0u);
  EXPECT_EQ(DtypeBytes(""), 0u);
  EXPECT_EQ(DtypeBytes("float32 "), 0u);
}

TEST(TorchWriter, RoundTripsTensorsAndTree) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("rt.pt");
  const std::vector<float> w = {1.0f,
                                -2.5f,
                                std::bit_cast<float>(0x7fc00123u),
                                -0.0f,
                                std::numeric_limits<float>::infinity(),
                                std::bit_cast<float>(0x00000001u)};
  const std::vector<float> scalar = {0.125f};
  const std::vector<std::int64_t> step = {42};
  const std::vector<std::int64_t> ids = {std::numeric_limits<std::int64_t>::min(), 0, 7};
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter writer,
                              TorchWriter::Create(path, storage::Overwrite::kNo));
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor tw, writer.AddFloat32(w, {2, 3}));
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor ts, writer.AddFloat32(scalar, {}));
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor te, writer.AddFloat32({}, {0, 5}));
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor tstep, writer.AddInt64(step, {}));
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor tids, writer.AddInt64(ids, {3}));
    EXPECT_EQ(tw.stride, (std::vector<std::int64_t>{3, 1}));
    EXPECT_EQ(te.stride, (std::vector<std::int64_t>{5, 1}));
    EXPECT_TRUE(ts.stride.empty());
    // Nothing at the path before Finish.
    EXPECT_FALSE(std::ifstream(path).good());
    PyValue root =
        Dict({{"w", tw},
              {"scalar", ts},
              {"empty", te},
              {"step", tstep},
              {"ids", tids},
              {"shape", PyTuple{.items = {std::int64_t{2}, std::int64_t{3}}, .torch_size = true}},
              {"model", Dict({{"w", tw}}, /*ordered=*/true)}});
    ZINF_ASSERT_OK(writer.Finish(root));
  }
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));
  EXPECT_EQ(file.path(), path);
  const PyTensor* tw = TensorAt(file.root(), "w");
  ASSERT_NE(tw, nullptr);
  EXPECT_EQ(tw->dtype, "float32");
  EXPECT_EQ(tw->shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(tw->stride, (std::vector<std::int64_t>{3, 1}));
  EXPECT_EQ(tw->offset, 0u);
  EXPECT_EQ(tw->storage_numel, 6u);
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> got, file.ReadFloat32(*tw, 6));
  EXPECT_EQ(Bits(got), Bits(w));
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> got_s,
                            file.ReadFloat32(*TensorAt(file.root(), "scalar"), 1));
  EXPECT_EQ(Bits(got_s), Bits(scalar));
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> got_e,
                            file.ReadFloat32(*TensorAt(file.root(), "empty"), 0));
  EXPECT_TRUE(got_e.empty());
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<std::int64_t> got_step,
                            file.ReadInt64(*TensorAt(file.root(), "step"), 1));
  EXPECT_EQ(got_step, step);
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<std::int64_t> got_ids,
                            file.ReadInt64(*TensorAt(file.root(), "ids"), 3));
  EXPECT_EQ(got_ids, ids);
  const PyValue* model = file.root().as<PyDict>()->Find("model");
  ASSERT_NE(model, nullptr);
  ASSERT_TRUE(model->is<PyDict>());
  EXPECT_TRUE(model->as<PyDict>()->ordered);
  EXPECT_EQ(TensorAt(*model, "w")->storage_key, tw->storage_key);
  const PyValue* shape = file.root().as<PyDict>()->Find("shape");
  ASSERT_NE(shape, nullptr);
  EXPECT_TRUE(shape->as<PyTuple>()->torch_size);

  // The archive torch expects: one folder, a storage per tensor, data.pkl, version "3\n".
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader zip, ZipReader::Open(path));
  std::vector<std::string> names;
  for (const ZipEntry& e : zip.entries()) names.push_back(e.name);
  EXPECT_THAT(names, ::testing::UnorderedElementsAre(
                         "archive/data/0", "archive/data/1", "archive/data/2", "archive/data/3",
                         "archive/data/4", "archive/data.pkl", "archive/version"));
  ZINF_ASSERT_OK_AND_ASSIGN(std::string version, zip.ReadEntry("archive/version", 16));
  EXPECT_EQ(version, "3\n");
  EXPECT_EQ(zip.Find("archive/data/0")->size, 24u);
}

TEST(TorchWriter, ArchiveNameIsOneComponent) {
  ScratchDir dir("torch_file");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(
        TorchWriter writer, TorchWriter::Create(dir.Join("a.pt"), storage::Overwrite::kNo, "ckpt"));
    std::vector<float> v = {1, 2};
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor t, writer.AddFloat32(v, {2}));
    ZINF_ASSERT_OK(writer.Finish(PyValue(t)));
  }
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(dir.Join("a.pt")));
  ASSERT_TRUE(file.root().is<PyTensor>());
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader zip, ZipReader::Open(dir.Join("a.pt")));
  EXPECT_NE(zip.Find("ckpt/data.pkl"), nullptr);
  for (const char* bad : {"", "a/b", "..", ".", "a\\b"}) {
    EXPECT_THAT(TorchWriter::Create(dir.Join("b.pt"), storage::Overwrite::kNo, bad),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("archive name")))
        << bad;
  }
}

TEST(TorchWriter, RefusesAnExistingFileAndLeavesNothingWithoutFinish) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("x.pt");
  { std::ofstream(path) << "old"; }
  EXPECT_THAT(TorchWriter::Create(path, storage::Overwrite::kNo),
              StatusIs(ErrorCode::kAlreadyExists));
  const std::string fresh = dir.Join("fresh.pt");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter writer,
                              TorchWriter::Create(fresh, storage::Overwrite::kNo));
    std::vector<float> v = {1};
    ZINF_ASSERT_OK(writer.AddFloat32(v, {1}));
  }
  EXPECT_FALSE(std::ifstream(fresh).good());
}

TEST(TorchWriter, RefusesBadShapesAndForeignTensors) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("w.pt");
  ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter writer, TorchWriter::Create(path, storage::Overwrite::kNo));
  std::vector<float> six(6, 1.0f);
  std::vector<std::int64_t> four(4, 1);
  EXPECT_THAT(writer.AddFloat32(six, {4}), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("6")));
  EXPECT_THAT(writer.AddFloat32(six, {-2, -3}), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(writer.AddFloat32(six, {std::int64_t{1} << 40, std::int64_t{1} << 40}),
              StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(writer.AddInt64(four, {2, 2}), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_ASSERT_OK_AND_ASSIGN(PyTensor t, writer.AddFloat32(six, {2, 3}));

  PyTensor foreign = t;
  foreign.storage_key = "7";
  EXPECT_THAT(writer.Finish(Dict({{"t", foreign}})),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("root[\"t\"]")));
  PyTensor retyped = t;
  retyped.dtype = "float16";
  EXPECT_THAT(writer.Finish(PyList{.items = {retyped}}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("root[0]")));
  PyTensor past = t;
  past.offset = 1;
  EXPECT_THAT(writer.Finish(PyValue(past)), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_FALSE(std::ifstream(path).good());
  // A view within the storage is fine.
  PyTensor row = t;
  row.offset = 3;
  row.shape = {3};
  row.stride = {1};
  ZINF_ASSERT_OK(writer.Finish(Dict({{"t", t}, {"row", row}})));
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));
  EXPECT_THAT(file.ReadFloat32(*TensorAt(file.root(), "row"), 3), IsOk());
}

// A file whose one tensor (in root["t"]) is `t`, over storages `storages`; the error of Read.
struct TensorCase {
  const char* name;
  PyTensor tensor;
  std::vector<std::pair<std::string, std::string>> storages;
  const char* message;  // a substring of the DataLoss message
};

// What a tensor says against what its storage entry holds: only Read can see it.
TEST(TorchFileRead, ChecksEveryTensorAgainstItsStorageEntry) {
  ScratchDir dir("torch_file");
  const std::uint64_t big = std::uint64_t{1} << 62;
  const std::vector<TensorCase> cases = {
      {"missing storage",
       Tensor("float32", "1", 4, 0, {4}, {1}),
       {{"0", Bytes(16)}},
       "archive/data/1 is missing"},
      {"missing storage, escaped key",
       Tensor("float32", "k\n\x1b[31m", 4, 0, {4}, {1}),
       {{"0", Bytes(16)}},
       "archive/data/k\\x0a\\x1b[31m is missing"},
      {"short storage",
       Tensor("float32", "0", 4, 0, {4}, {1}),
       {{"0", Bytes(12)}},
       "holds 12 bytes, but 4 elements of float32 need 16"},
      {"long storage",
       Tensor("float16", "0", 4, 0, {4}, {1}),
       {{"0", Bytes(10)}},
       "holds 10 bytes, but 4 elements of float16 need 8"},
      {"int storage",
       Tensor("int32", "0", 4, 0, {4}, {1}),
       {{"0", Bytes(8)}},
       "holds 8 bytes, but 4 elements of int32 need 16"},
      {"storage bytes overflow",
       Tensor("float32", "0", big, 0, {4}, {1}),
       {{"0", Bytes(16)}},
       "need more than 2^64"},
  };
  for (const TensorCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.Join("case.pt");
    ZINF_ASSERT_OK(WriteHandPickled(path, WithStorages(c.storages), c.tensor));
    EXPECT_THAT(
        TorchFile::Read(path),
        StatusIs(ErrorCode::kDataLoss, ::testing::AllOf(HasSubstr(c.message), HasSubstr(path),
                                                        HasSubstr("tensor root[\"t\"]: "))));
  }
}

// A view's shape, strides and offset against its storage. ReadPickle checks them too (so a
// file never reaches TorchFile's own check), but a caller may hand ReadFloat32 any PyTensor.
TEST(TorchFileRead, ChecksTheViewOfEveryTensor) {
  ScratchDir dir("torch_file");
  const std::vector<TensorCase> cases = {
      {"shape and stride ranks",
       Tensor("float32", "0", 4, 0, {2, 2}, {2}),
       {},
       "2 dims of shape but 1 of stride"},
      {"negative size", Tensor("float32", "0", 4, 0, {-1}, {1}), {}, "negative size or stride"},
      {"negative stride", Tensor("float32", "0", 4, 3, {2}, {-1}), {}, "negative size or stride"},
      {"past the end",
       Tensor("float32", "0", 4, 2, {3}, {1}),
       {},
       "reaches element 4 (offset 2, shape [3], stride [1]) of a storage of 4"},
      {"strided past the end",
       Tensor("float32", "0", 4, 0, {2, 2}, {3, 1}),
       {},
       "reaches element 4"},
      {"extent overflow",
       Tensor("float32", "0", 4, 0, {5, 2}, {std::int64_t{1} << 62, 1}),
       {},
       "extent overflows 64 bits"},
      {"huge offset",
       Tensor("float32", "0", 4, std::numeric_limits<std::int64_t>::max(), {2}, {1}),
       {},
       "reaches element 9223372036854775808"},
      {"extent overflow via offset",
       Tensor("float32", "0", 4, ~std::uint64_t{0}, {2}, {1}),
       {},
       "extent overflows 64 bits"},
      {"numel overflow",
       Tensor("float32", "0", 4, 0, {std::int64_t{1} << 32, std::int64_t{1} << 32}, {0, 0}),
       {},
       "element count overflows"},
      {"empty past the end", Tensor("float32", "0", 4, 5, {0}, {1}), {}, "storage offset 5 past"},
      {"too many dims",
       Tensor("float32", "0", 4, 0, std::vector<std::int64_t>(65, 1),
              std::vector<std::int64_t>(65, 1)),
       {},
       "65 dims"},
  };
  const std::string good = dir.Join("good.pt");
  ZINF_ASSERT_OK(WriteRaw(good, WithStorages({{"0", Bytes(16)}}),
                          Dict({{"t", Tensor("float32", "0", 4, 0, {4}, {1})}})));
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(good));
  for (const TensorCase& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_THAT(
        file.ReadFloat32(c.tensor, 1000),
        StatusIs(ErrorCode::kDataLoss, ::testing::AllOf(HasSubstr(c.message), HasSubstr(good))));
    // In a file: refused, by ReadPickle or by Read (the offset past 2^63 cannot be pickled).
    if (c.tensor.offset > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      continue;
    }
    const std::string path = dir.Join("case.pt");
    ZINF_ASSERT_OK(WriteHandPickled(path, WithStorages({{"0", Bytes(16)}}), c.tensor));
    EXPECT_THAT(TorchFile::Read(path), StatusIs(ErrorCode::kDataLoss, HasSubstr(path)));
  }
}

TEST(TorchFileRead, AcceptsViewsAndSharedStorages) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("views.pt");
  std::string storage;
  for (int i = 0; i < 10; ++i) {
    float f = static_cast<float>(i);
    storage.append(reinterpret_cast<const char*>(&f), 4);
  }
  PyValue root = Dict({{"whole", Tensor("float32", "s", 10, 0, {10}, {1})},
                       {"block", Tensor("float32", "s", 10, 3, {2, 2}, {2, 1})},
                       {"ones", Tensor("float32", "s", 10, 6, {1, 4}, {99, 1})},
                       {"transposed", Tensor("float32", "s", 10, 0, {2, 5}, {1, 2})},
                       {"empty_end", Tensor("float32", "s", 10, 10, {0}, {1})},
                       {"broadcast", Tensor("float32", "s", 10, 9, {3}, {0})}});
  ZINF_ASSERT_OK(WriteRaw(path, WithStorages({{"s", storage}}), root));
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));
  ZINF_ASSERT_OK_AND_ASSIGN(auto block, file.ReadFloat32(*TensorAt(file.root(), "block"), 4));
  EXPECT_EQ(block, (std::vector<float>{3, 4, 5, 6}));
  ZINF_ASSERT_OK_AND_ASSIGN(auto ones, file.ReadFloat32(*TensorAt(file.root(), "ones"), 4));
  EXPECT_EQ(ones, (std::vector<float>{6, 7, 8, 9}));
  EXPECT_THAT(file.ReadFloat32(*TensorAt(file.root(), "transposed"), 10),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not contiguous")));
  EXPECT_THAT(file.ReadFloat32(*TensorAt(file.root(), "broadcast"), 10),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not contiguous")));
  ZINF_ASSERT_OK_AND_ASSIGN(auto empty, file.ReadFloat32(*TensorAt(file.root(), "empty_end"), 0));
  EXPECT_TRUE(empty.empty());
  EXPECT_THAT(file.ReadFloat32(*TensorAt(file.root(), "whole"), 9),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("more than the 9")));
  EXPECT_THAT(file.ReadInt64(*TensorAt(file.root(), "whole"), 10),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("float32, not int64")));
  // A tensor that is not of this file.
  EXPECT_THAT(file.ReadFloat32(Tensor("float32", "zz", 1, 0, {1}, {1}), 1),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("archive/data/zz is missing")));
  EXPECT_THAT(file.ReadFloat32(Tensor("float32", "s", 10, 8, {3}, {1}), 3),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("reaches element 10")));
}

TEST(TorchFileRead, OneDtypePerStorage) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("mixed.pt");
  PyValue root = Dict({{"a", Tensor("float32", "0", 4, 0, {4}, {1})},
                       {"b", PyList{.items = {Tensor("int32", "0", 4, 0, {4}, {1})}}}});
  ZINF_ASSERT_OK(WriteRaw(path, WithStorages({{"0", Bytes(16)}}), root));
  EXPECT_THAT(TorchFile::Read(path),
              StatusIs(ErrorCode::kDataLoss,
                       ::testing::AllOf(HasSubstr("root[\"b\"][0]"),
                                        HasSubstr("read as int32 here and as float32"))));
}

TEST(TorchFileRead, NamesTheTensorsPlaceInTheTree) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("deep.pt");
  PyValue v = Tensor("float32", "0", 4, 0, {4}, {1});  // its storage entry is short
  for (int i = 0; i < 40; ++i) v = PyList{.items = {PyValue(std::int64_t{i}), std::move(v)}};
  auto state = std::make_shared<PyValue>(Dict({{"exp_avg", std::move(v)}}));
  PyDict with_int_key;
  with_int_key.items.emplace_back(
      PyValue(std::int64_t{3}),
      PyObject{
          .module = "deepspeed.runtime.fp16.loss_scaler", .name = "LossScaler", .state = state});
  ZINF_ASSERT_OK(WriteRaw(path, WithStorages({{"0", Bytes(12)}}), PyValue(with_int_key)));
  std::string where = "root[3].__dict__[\"exp_avg\"]";
  for (int i = 0; i < 40; ++i) where += "[1]";
  EXPECT_THAT(TorchFile::Read(path), StatusIs(ErrorCode::kDataLoss, HasSubstr(where + ": ")));
}

TEST(TorchFileRead, ChecksTheArchive) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("archive.pt");
  const PyValue root = Dict({{"x", std::int64_t{1}}});
  ZINF_ASSERT_OK(WriteRaw(path, WithExtra({{"other/version", "3\n"}}), root));
  EXPECT_THAT(TorchFile::Read(path),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("two folders, 'archive' and 'other'")));
  ZINF_ASSERT_OK(WriteRaw(path, WithExtra({{"toplevel", "x"}}), root));
  EXPECT_THAT(TorchFile::Read(path),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("'toplevel' is not under an archive")));
  ZINF_ASSERT_OK(WriteRaw(path, WithExtra({{"top\xff\x1b", "x"}}), root));
  EXPECT_THAT(TorchFile::Read(path),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("'top\\xff\\x1b' is not printable ASCII")));
  ZINF_ASSERT_OK(WriteRaw(path, WithVersion(nullptr), root));
  EXPECT_THAT(TorchFile::Read(path),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("no entry archive/version")));
  for (const char* bad :
       {"99\n", "", "three", "3 3\n", "-3\n", "0\n",
        "3\n                                                                  "}) {
    ZINF_ASSERT_OK(WriteRaw(path, WithVersion(bad), root));
    EXPECT_THAT(TorchFile::Read(path),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("not a format version")))
        << bad;
  }
  // torch >= 2 may keep the version in .data/version.
  ZINF_ASSERT_OK(WriteRaw(path, WithVersion(nullptr, {{"archive/.data/version", "6\n"}}), root));
  EXPECT_THAT(TorchFile::Read(path), IsOk());
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter zip,
                              ZipWriter::Create(path, storage::Overwrite::kRegularFile));
    ZINF_ASSERT_OK(zip.Add("archive/version", std::string_view("3\n")));
    ZINF_ASSERT_OK(zip.Finish());
  }
  EXPECT_THAT(TorchFile::Read(path),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("no entry archive/data.pkl")));
}

TEST(TorchFileRead, RefusesTheLegacyFormat) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("legacy.pt");
  // What torch.save(_use_new_zipfile_serialization=False) starts with: PROTO 2, LONG1 magic.
  {
    std::ofstream(path, std::ios::binary)
        << std::string("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15);
  }
  EXPECT_THAT(TorchFile::Read(path),
              StatusIs(ErrorCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr(path), HasSubstr("legacy (non-zip)"),
                                        HasSubstr("_use_new_zipfile_serialization=True"))));
  { std::ofstream(path, std::ios::binary) << "not a torch file at all"; }
  EXPECT_THAT(TorchFile::Read(path), StatusIs(ErrorCode::kDataLoss));
  EXPECT_THAT(TorchFile::Read(dir.Join("absent.pt")), StatusIs(ErrorCode::kNotFound));
}

TEST(TorchFileRead, BrokenStorageCrcIsDataLoss) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("crc.pt");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter writer,
                              TorchWriter::Create(path, storage::Overwrite::kNo));
    std::vector<float> v(1000);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor t, writer.AddFloat32(v, {1000}));
    PyTensor view = t;
    view.offset = 10;
    view.shape = {5};
    ZINF_ASSERT_OK(writer.Finish(Dict({{"whole", t}, {"view", view}})));
  }
  FlipEntryByte(path, "archive/data/0", 3000);                       // outside the view
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));  // storages read lazily
  EXPECT_THAT(file.ReadFloat32(*TensorAt(file.root(), "whole"), 1000),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("CRC")));
  EXPECT_THAT(file.ReadFloat32(*TensorAt(file.root(), "view"), 5), StatusIs(ErrorCode::kDataLoss));
}

// fp16 -> fp32 computed from the definition (not bit tricks): NaNs come out quiet with their
// payload, as torch's .float() makes them.
std::uint32_t HalfReference(std::uint16_t h) {
  const bool negative = (h & 0x8000) != 0;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0x1f && mant != 0) {
    return (negative ? 0x80000000u : 0u) | 0x7fc00000u | (static_cast<std::uint32_t>(mant) << 13);
  }
  float v = exp == 0x1f ? std::numeric_limits<float>::infinity()
            : exp == 0  ? std::ldexp(static_cast<float>(mant), -24)
                        : std::ldexp(static_cast<float>(mant + 1024), exp - 25);
  return std::bit_cast<std::uint32_t>(negative ? -v : v);
}

TEST(TorchFileRead, WidensEveryHalfAndBFloat16Exactly) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("halves.pt");
  std::string all;
  for (std::uint32_t v = 0; v < 65536; ++v) {
    all += static_cast<char>(v & 0xff);
    all += static_cast<char>(v >> 8);
  }
  PyValue root = Dict({{"h", Tensor("float16", "h", 65536, 0, {256, 256}, {256, 1})},
                       {"b", Tensor("bfloat16", "b", 65536, 0, {65536}, {1})},
                       {"h_view", Tensor("float16", "h", 65536, 65530, {6}, {1})}});
  ZINF_ASSERT_OK(WriteRaw(path, WithStorages({{"h", all}, {"b", all}}), root));
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));
  ZINF_ASSERT_OK_AND_ASSIGN(auto h, file.ReadFloat32(*TensorAt(file.root(), "h"), 65536));
  ZINF_ASSERT_OK_AND_ASSIGN(auto b, file.ReadFloat32(*TensorAt(file.root(), "b"), 65536));
  ASSERT_EQ(h.size(), 65536u);
  ASSERT_EQ(b.size(), 65536u);
  int bad = 0;
  for (std::uint32_t v = 0; v < 65536 && bad < 5; ++v) {
    const auto hv = static_cast<std::uint16_t>(v);
    if (std::bit_cast<std::uint32_t>(h[v]) != HalfReference(hv)) {
      ADD_FAILURE() << "fp16 " << std::hex << v << " -> " << std::bit_cast<std::uint32_t>(h[v])
                    << ", want " << HalfReference(hv);
      ++bad;
    }
    if (std::bit_cast<std::uint32_t>(b[v]) != v << 16) {
      ADD_FAILURE() << "bf16 " << std::hex << v << " -> " << std::bit_cast<std::uint32_t>(b[v]);
      ++bad;
    }
  }
  ZINF_ASSERT_OK_AND_ASSIGN(auto view, file.ReadFloat32(*TensorAt(file.root(), "h_view"), 6));
  for (std::uint32_t i = 0; i < 6; ++i) {
    EXPECT_EQ(std::bit_cast<std::uint32_t>(view[i]),
              HalfReference(static_cast<std::uint16_t>(65530 + i)));
  }
}

TEST(TorchFileRange, ReadsAnyRangeOfAViewAsFp32) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("range.pt");
  std::string f32;
  for (int i = 0; i < 10; ++i) {
    float f = static_cast<float>(i);
    f32.append(reinterpret_cast<const char*>(&f), 4);
  }
  // 600000 16-bit elements: more than one 1 MiB chunk of the 16-bit path. Element i is the fp16
  // and bf16 pattern i % 65536.
  constexpr std::uint64_t kHalfNumel = 600000;
  std::string halves;
  for (std::uint64_t i = 0; i < kHalfNumel; ++i) {
    halves += static_cast<char>(i & 0xff);
    halves += static_cast<char>((i >> 8) & 0xff);
  }
  PyValue root = Dict({{"whole", Tensor("float32", "s", 10, 0, {10}, {1})},
                       {"block", Tensor("float32", "s", 10, 3, {2, 2}, {2, 1})},
                       {"transposed", Tensor("float32", "s", 10, 0, {2, 5}, {1, 2})},
                       {"h", Tensor("float16", "h", kHalfNumel, 0, {kHalfNumel}, {1})},
                       {"b", Tensor("bfloat16", "h2", kHalfNumel, 7, {kHalfNumel - 7}, {1})},
                       {"i", Tensor("int64", "i", 1, 0, {}, {})}});
  ZINF_ASSERT_OK(WriteRaw(
      path, WithStorages({{"s", f32}, {"h", halves}, {"h2", halves}, {"i", Bytes(8)}}), root));
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));
  std::vector<float> out(3);
  ZINF_ASSERT_OK(file.ReadFloat32Range(*TensorAt(file.root(), "whole"), 7, out));
  EXPECT_EQ(out, (std::vector<float>{7, 8, 9}));
  ZINF_ASSERT_OK(file.ReadFloat32Range(*TensorAt(file.root(), "block"), 1, out));
  EXPECT_EQ(out, (std::vector<float>{4, 5, 6}));  // the view's elements 1..3, from offset 3
  // Empty ranges, also at the end.
  ZINF_ASSERT_OK(file.ReadFloat32Range(*TensorAt(file.root(), "block"), 4, std::span<float>()));
  EXPECT_THAT(file.ReadFloat32Range(*TensorAt(file.root(), "block"), 2, out),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("elements [2, +3) of its 4")));
  EXPECT_THAT(file.ReadFloat32Range(*TensorAt(file.root(), "whole"),
                                    std::numeric_limits<std::uint64_t>::max(), out),
              StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(file.ReadFloat32Range(*TensorAt(file.root(), "transposed"), 0, out),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not contiguous")));
  EXPECT_THAT(file.ReadFloat32Range(*TensorAt(file.root(), "i"), 0, std::span(out).first(1)),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("int64, not float32")));
  // 16-bit ranges across the chunk boundary (element 524288), widened exactly.
  for (const char* key : {"h", "b"}) {
    const PyTensor& t = *TensorAt(file.root(), key);
    const std::uint64_t skip = key[0] == 'b' ? 7 : 0;
    const std::uint64_t begin = 1000;
    std::vector<float> part(kHalfNumel - skip - begin);
    ZINF_ASSERT_OK(file.ReadFloat32Range(t, begin, part));
    ZINF_ASSERT_OK_AND_ASSIGN(auto whole, file.ReadFloat32(t, kHalfNumel));
    int bad = 0;
    for (std::size_t i = 0; i < part.size() && bad < 5; ++i) {
      const auto pattern = static_cast<std::uint16_t>((skip + begin + i) & 0xffff);
      const std::uint32_t want =
          key[0] == 'h' ? HalfReference(pattern) : std::uint32_t{pattern} << 16;
      if (std::bit_cast<std::uint32_t>(part[i]) != want ||
          std::bit_cast<std::uint32_t>(whole[begin + i]) != want) {
        ADD_FAILURE() << key << " element " << begin + i;
        ++bad;
      }
    }
  }
}

TEST(TorchFileRange, VerifyStorageChecksWhatRangesDoNot) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("range_crc.pt");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter writer,
                              TorchWriter::Create(path, storage::Overwrite::kNo));
    std::vector<float> v(1000);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor a, writer.AddFloat32(v, {1000}));
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor b, writer.AddFloat32(v, {10, 100}));
    ZINF_ASSERT_OK(writer.Finish(Dict({{"a", a}, {"b", b}})));
  }
  FlipEntryByte(path, "archive/data/0", 3000);  // element 750 of "a"
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));
  const PyTensor& a = *TensorAt(file.root(), "a");
  std::vector<float> out(5);
  ZINF_ASSERT_OK(file.ReadFloat32Range(a, 10, out));  // the range is not checked ...
  EXPECT_EQ(out, (std::vector<float>{10, 11, 12, 13, 14}));
  EXPECT_THAT(file.VerifyStorage(a),  // ... its storage is
              StatusIs(ErrorCode::kDataLoss, HasSubstr("CRC-32")));
  EXPECT_THAT(file.VerifyStorage(*TensorAt(file.root(), "b")), IsOk());
  EXPECT_THAT(file.VerifyStorage(Tensor("float32", "9", 1, 0, {1}, {1})),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("archive/data/9 is missing")));
}

TEST(TorchFileRead, PickleErrorsNameTheFile) {
  ScratchDir dir("torch_file");
  const std::string path = dir.Join("pickle.pt");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter zip, ZipWriter::Create(path, storage::Overwrite::kNo));
    ZINF_ASSERT_OK(zip.Add("a/data.pkl", std::string_view("\x80\x02"
                                                          "cos\nsystem\n"
                                                          "X\x04\x00\x00\x00true\x85R.",
                                                          25)));
    ZINF_ASSERT_OK(zip.Add("a/version", std::string_view("3\n")));
    ZINF_ASSERT_OK(zip.Finish());
  }
  EXPECT_THAT(TorchFile::Read(path), StatusIs(ErrorCode::kInvalidArgument,
                                              ::testing::AllOf(HasSubstr(path + ": a/data.pkl: "),
                                                               HasSubstr("os.system"))));
  PickleLimits tiny;
  tiny.max_bytes = 8;
  EXPECT_THAT(
      TorchFile::Read(path, tiny),
      StatusIs(ErrorCode::kDataLoss, HasSubstr("a/data.pkl holds 25 bytes, more than the 8")));
}

// AddFloat32Streaming: the pieces land in order in one storage (read back bitwise with its CRC),
// beside an ordinary tensor; a fill error is returned and the abandoned writer leaves nothing.
TEST(TorchWriterStreaming, PiecesLandInOrderAndErrorsLeaveNothing) {
  ScratchDir dir("torch_stream");
  const std::string path = dir.Join("stream.pt");
  auto value = [](std::uint64_t i) { return static_cast<float>(i) * 0.25f - 3.0f; };
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter w, TorchWriter::Create(path, storage::Overwrite::kNo));
    const std::vector<float> small = {1.5f, -2.0f};
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor a, w.AddFloat32(small, {2}));
    std::vector<std::uint64_t> calls;
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor b,
                              w.AddFloat32Streaming(
                                  {5, 7},
                                  [&](std::uint64_t offset, std::span<float> out) -> Status {
                                    calls.push_back(offset);
                                    EXPECT_LE(out.size(), 16u);
                                    for (std::size_t k = 0; k < out.size(); ++k)
                                      out[k] = value(offset + k);
                                    return OkStatus();
                                  },
                                  16));
    EXPECT_EQ(calls, (std::vector<std::uint64_t>{0, 16, 32}));
    EXPECT_EQ(b.shape, (std::vector<std::int64_t>{5, 7}));
    EXPECT_EQ(b.stride, (std::vector<std::int64_t>{7, 1}));
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor empty,
                              w.AddFloat32Streaming({0}, [](std::uint64_t, std::span<float>) {
                                return InternalError("never called for no elements");
                              }));
    EXPECT_THAT(w.AddFloat32Streaming({-1}, {}), StatusIs(ErrorCode::kInvalidArgument));
    EXPECT_THAT(w.AddFloat32Streaming({2}, {}, 0), StatusIs(ErrorCode::kInvalidArgument));
    ZINF_ASSERT_OK(w.Finish(Dict({{"a", a}, {"b", b}, {"e", empty}})));
  }
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile file, TorchFile::Read(path));
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> got,
                            file.ReadFloat32(*TensorAt(file.root(), "b"), 1000));
  ASSERT_EQ(got.size(), 35u);
  for (std::uint64_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(value(i))) << i;
  }
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> a, file.ReadFloat32(*TensorAt(file.root(), "a"), 2));
  EXPECT_EQ(a, (std::vector<float>{1.5f, -2.0f}));

  const std::string failed = dir.Join("failed.pt");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter w, TorchWriter::Create(failed, storage::Overwrite::kNo));
    EXPECT_THAT(w.AddFloat32Streaming(
                    {100},
                    [](std::uint64_t offset, std::span<float> out) -> Status {
                      if (offset >= 50) return DataLossError("piece at 50");
                      std::fill(out.begin(), out.end(), 1.0f);
                      return OkStatus();
                    },
                    25),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("piece at 50")));
  }
  EXPECT_FALSE(std::filesystem::exists(failed));
}

}  // namespace
}  // namespace zinf::interop
