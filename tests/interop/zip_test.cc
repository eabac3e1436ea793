// Zip archives (interop/zip.h): the writer's output reads back (and through Python's zipfile), the
// reader reads what Python's zipfile writes, and hostile archives crafted here byte by byte are
// refused with DataLoss naming what is wrong, never a crash.
#include "zinf/interop/zip.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fault_injection.h"

namespace zinf::interop {
namespace internal {
void ForceZip64ForTesting(bool force);  // zip.cc
}  // namespace internal
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;

constexpr const char* kPython = "/usr/bin/python3";

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

std::string Content(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xFF);
  return s;
}

// Bit-at-a-time CRC-32, the reference for the table-driven one.
std::uint32_t SlowCrc32(const std::string& s) {
  std::uint32_t c = 0xFFFFFFFF;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

// Runs `script` with /usr/bin/python3 and `args`; the exit status (-1: no Python).
int RunPython(const ScratchDir& dir, const std::string& script, const std::string& args) {
  if (::access(kPython, X_OK) != 0) return -1;
  const std::string file = dir.Join("check.py");
  std::ofstream(file) << script;
  const int rc = std::system(fmt::format("{} {} {}", kPython, file, args).c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

// ---- a byte-level archive composer for hostile cases ----
void P16(std::string& o, std::uint64_t v) {
  o.push_back(static_cast<char>(v & 0xFF));
  o.push_back(static_cast<char>((v >> 8) & 0xFF));
}
void P32(std::string& o, std::uint64_t v) {
  P16(o, v & 0xFFFF);
  P16(o, (v >> 16) & 0xFFFF);
}
void P64(std::string& o, std::uint64_t v) {
  P32(o, v & 0xFFFFFFFF);
  P32(o, v >> 32);
}

struct RawEntry {
  std::string name;
  std::string data;
  std::uint16_t method = 0;
  std::uint16_t flags = 0;
  std::optional<std::uint16_t> local_method = std::nullopt;  // when it differs from the central
  std::optional<std::uint16_t> local_flags = std::nullopt;   // when they differ from the central
  std::optional<std::string> local_name = std::nullopt;  // the local header's name, when it differs
  std::optional<std::uint32_t> crc = std::nullopt;       // both headers' CRC, when not the data's
  std::optional<std::uint64_t> local_size =
      std::nullopt;  // the local header's sizes, when they differ
  std::optional<std::uint64_t> central_size =
      std::nullopt;  // the central header's sizes, when they differ
  std::optional<std::uint64_t> central_offset = std::nullopt;
  bool zip64 = false;       // sizes (and offset) in ZIP64 extra fields, 0xFFFFFFFF in the fixed
  bool descriptor = false;  // as torch writes: flag bit 3, zeros in the local header
};

std::uint32_t CrcOf(const RawEntry& e) { return e.crc.value_or(Crc32(Bytes(e.data))); }

std::string LocalHeader(const RawEntry& e) {
  const std::string& name = e.local_name.value_or(e.name);
  const std::uint64_t size = e.local_size.value_or(e.data.size());
  std::string h;
  P32(h, 0x04034b50);
  P16(h, 20);
  P16(h, e.local_flags.value_or(e.flags) | (e.descriptor ? 8 : 0));
  P16(h, e.local_method.value_or(e.method));
  P16(h, 0);
  P16(h, 0x21);
  P32(h, e.descriptor ? 0 : CrcOf(e));
  P32(h, e.descriptor ? 0 : (e.zip64 ? 0xFFFFFFFF : size));
  P32(h, e.descriptor ? 0 : (e.zip64 ? 0xFFFFFFFF : size));
  P16(h, name.size());
  P16(h, e.zip64 ? 20 : 0);
  h += name;
  if (e.zip64) {
    P16(h, 1);
    P16(h, 16);
    P64(h, size);
    P64(h, size);
  }
  return h;
}

std::string CentralHeader(const RawEntry& e, std::uint64_t offset) {
  const std::uint64_t size = e.central_size.value_or(e.data.size());
  std::string h;
  P32(h, 0x02014b50);
  P16(h, 20);
  P16(h, 20);
  P16(h, e.flags | (e.descriptor ? 8 : 0));
  P16(h, e.method);
  P16(h, 0);
  P16(h, 0x21);
  P32(h, CrcOf(e));
  P32(h, e.zip64 ? 0xFFFFFFFF : size);
  P32(h, e.zip64 ? 0xFFFFFFFF : size);
  P16(h, e.name.size());
  P16(h, e.zip64 ? 28 : 0);
  P16(h, 0);
  P16(h, 0);
  P16(h, 0);
  P32(h, 0);
  P32(h, e.zip64 ? 0xFFFFFFFF : offset);
  h += e.name;
  if (e.zip64) {
    P16(h, 1);
    P16(h, 24);
    P64(h, size);
    P64(h, size);
    P64(h, offset);
  }
  return h;
}

struct RawArchive {
  std::vector<RawEntry> entries;
  std::optional<std::uint64_t> count = std::nullopt;      // entries claimed by the end records
  std::optional<std::uint64_t> cd_offset = std::nullopt;  // central directory offset claimed
  bool zip64_eocd = false;
  std::string comment;
};

std::string Compose(const RawArchive& a) {
  std::string out;
  std::vector<std::uint64_t> offsets;
  for (const RawEntry& e : a.entries) {
    offsets.push_back(e.central_offset.value_or(out.size()));
    out += LocalHeader(e) + e.data;
  }
  const std::uint64_t cd_offset = a.cd_offset.value_or(out.size());
  const std::uint64_t cd_begin = out.size();
  for (std::size_t i = 0; i < a.entries.size(); ++i) out += CentralHeader(a.entries[i], offsets[i]);
  const std::uint64_t cd_size = out.size() - cd_begin;
  const std::uint64_t count = a.count.value_or(a.entries.size());
  if (a.zip64_eocd) {
    const std::uint64_t rec = out.size();
    P32(out, 0x06064b50);
    P64(out, 44);
    P16(out, 45);
    P16(out, 45);
    P32(out, 0);
    P32(out, 0);
    P64(out, count);
    P64(out, count);
    P64(out, cd_size);
    P64(out, cd_offset);
    P32(out, 0x07064b50);
    P32(out, 0);
    P64(out, rec);
    P32(out, 1);
  }
  P32(out, 0x06054b50);
  P16(out, 0);
  P16(out, 0);
  P16(out, a.zip64_eocd ? 0xFFFF : count);
  P16(out, a.zip64_eocd ? 0xFFFF : count);
  P32(out, a.zip64_eocd ? 0xFFFFFFFF : cd_size);
  P32(out, a.zip64_eocd ? 0xFFFFFFFF : cd_offset);
  P16(out, a.comment.size());
  out += a.comment;
  return out;
}

RawArchive TwoEntries() {
  RawArchive a;
  a.entries.push_back({.name = "arch/a", .data = "alpha"});
  a.entries.push_back({.name = "arch/b", .data = "bravo!"});
  return a;
}

class ZipTest : public ::testing::Test {
 protected:
  Result<ZipReader> OpenBytes(const std::string& bytes, const ZipLimits& limits = {}) {
    const std::string path = dir_.Join(fmt::format("raw{}.zip", n_++));
    WriteBytes(path, bytes);
    return ZipReader::Open(path, limits);
  }
  ScratchDir dir_{"zip"};
  int n_ = 0;
};

// ---- CRC ----

TEST(Crc32, MatchesTheBitwiseDefinitionAndChains) {
  EXPECT_EQ(Crc32({}), 0u);
  EXPECT_EQ(Crc32(Bytes("123456789")), 0xCBF43926u);
  for (std::size_t n : {1u, 7u, 8u, 9u, 63u, 1000u, 4099u}) {
    const std::string s = Content(n, static_cast<unsigned>(n));
    EXPECT_EQ(Crc32(Bytes(s)), SlowCrc32(s)) << n;
    const std::size_t cut = n / 3;
    EXPECT_EQ(Crc32(Bytes(s.substr(cut)), Crc32(Bytes(s.substr(0, cut)))), SlowCrc32(s)) << n;
  }
}

// ---- writer and reader ----

TEST_F(ZipTest, RoundTripManyEntriesAlignedData) {
  const std::string path = dir_.Join("many.zip");
  std::vector<std::pair<std::string, std::string>> want;
  for (int i = 0; i < 300; ++i) {
    want.emplace_back(fmt::format("archive/data/{}", i), Content((i * 37) % 1500, i));
  }
  want.emplace_back("archive/empty", "");
  want.emplace_back("archive/version", "3\n");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w, ZipWriter::Create(path, storage::Overwrite::kNo));
    for (const auto& [name, data] : want) ZINF_ASSERT_OK(w.Add(name, data));
    ZINF_ASSERT_OK(w.Finish());
  }
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, ZipReader::Open(path));
  ASSERT_EQ(r.entries().size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const ZipEntry& e = r.entries()[i];
    EXPECT_EQ(e.name, want[i].first);
    EXPECT_EQ(e.size, want[i].second.size());
    EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
    EXPECT_EQ(e.crc32, SlowCrc32(want[i].second));
    EXPECT_EQ(r.Find(e.name), &e);
    ZINF_ASSERT_OK_AND_ASSIGN(std::string got, r.ReadEntry(e.name, 1 << 20));
    EXPECT_EQ(got, want[i].second) << e.name;
    ZINF_EXPECT_OK(r.VerifyCrc(e));
  }
  EXPECT_EQ(r.Find("archive/nope"), nullptr);
  EXPECT_THAT(r.ReadEntry("archive/nope", 10), StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(r.ReadEntry("archive/data/1", 10),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("larger than 10")));
}

TEST_F(ZipTest, PiecewiseEntryAndRanges) {
  const std::string path = dir_.Join("pieces.zip");
  const std::string big = Content(9 << 20, 7);  // > two VerifyCrc chunks
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w, ZipWriter::Create(path, storage::Overwrite::kNo));
    ZINF_ASSERT_OK(w.Add("x/first", "hello"));
    ZINF_ASSERT_OK(w.Begin("x/big", big.size()));
    for (std::size_t at = 0; at < big.size(); at += 1000003) {
      ZINF_ASSERT_OK(w.Append(Bytes(big.substr(at, 1000003))));
    }
    ZINF_ASSERT_OK(w.End());
    ZINF_ASSERT_OK(w.Begin("x/empty", 0));
    ZINF_ASSERT_OK(w.End());
    ZINF_ASSERT_OK(w.Add("x/last", "bye"));
    ZINF_ASSERT_OK(w.Finish());
  }
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, ZipReader::Open(path));
  ASSERT_EQ(r.entries().size(), 4u);
  for (const ZipEntry& e : r.entries()) EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
  const ZipEntry* e = r.Find("x/big");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->crc32, SlowCrc32(big));
  ZINF_EXPECT_OK(r.VerifyCrc(*e));
  ZINF_ASSERT_OK_AND_ASSIGN(std::string got, r.ReadEntry("x/big", big.size()));
  EXPECT_TRUE(got == big);
  ZINF_ASSERT_OK_AND_ASSIGN(std::string empty, r.ReadEntry("x/empty", 0));
  EXPECT_EQ(empty, "");
  std::string part(100, '\0');
  auto out = std::as_writable_bytes(std::span(part.data(), part.size()));
  ZINF_ASSERT_OK(r.ReadRange(*e, big.size() - 100, out));
  EXPECT_EQ(part, big.substr(big.size() - 100));
  EXPECT_THAT(r.ReadRange(*e, big.size() - 99, out), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(r.ReadRange(*e, ~std::uint64_t{0} - 10, out), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_EXPECT_OK(r.ReadRange(*e, big.size(), out.subspan(0, 0)));

  // One byte flipped deep in the big entry (past the first 4 MiB chunk): both checks see it.
  std::string bytes = ReadBytes(path);
  bytes[e->data_offset + (17 << 19)] ^= 0x10;
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader bad, OpenBytes(bytes));
  EXPECT_THAT(bad.VerifyCrc(*bad.Find("x/big")), StatusIs(ErrorCode::kDataLoss, HasSubstr("CRC")));
  EXPECT_THAT(bad.ReadEntry("x/big", big.size()), StatusIs(ErrorCode::kDataLoss, HasSubstr("CRC")));
  ZINF_EXPECT_OK(bad.VerifyCrc(*bad.Find("x/first")));
}

TEST_F(ZipTest, WriterRefusesMisuse) {
  const std::string path = dir_.Join("misuse.zip");
  ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w, ZipWriter::Create(path, storage::Overwrite::kNo));
  EXPECT_THAT(w.Add("", "x"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(w.Add(std::string(4097, 'n'), "x"), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_ASSERT_OK(w.Add(std::string(4096, 'n'), "x"));
  ZINF_ASSERT_OK(w.Add("a", "x"));
  EXPECT_THAT(w.Add("a", "y"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("twice")));
  EXPECT_THAT(w.Append(Bytes("x")), StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_THAT(w.End(), StatusIs(ErrorCode::kFailedPrecondition));
  ZINF_ASSERT_OK(w.Begin("b", 3));
  EXPECT_THAT(w.Add("c", "x"), StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_THAT(w.Append(Bytes("abcd")), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_ASSERT_OK(w.Append(Bytes("ab")));
  EXPECT_THAT(w.End(), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("2 bytes appended")));
  EXPECT_THAT(w.Finish(), StatusIs(ErrorCode::kFailedPrecondition));
  ZINF_ASSERT_OK(w.Append(Bytes("c")));
  ZINF_ASSERT_OK(w.End());
  ZINF_ASSERT_OK(w.Finish());
  EXPECT_THAT(w.Add("d", "x"), StatusIs(ErrorCode::kFailedPrecondition));
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, ZipReader::Open(path));
  ZINF_ASSERT_OK_AND_ASSIGN(std::string b, r.ReadEntry("b", 10));
  EXPECT_EQ(b, "abc");
  // An existing output is not replaced with Overwrite::kNo.
  EXPECT_THAT(ZipWriter::Create(path, storage::Overwrite::kNo),
              StatusIs(ErrorCode::kAlreadyExists));
}

TEST_F(ZipTest, AbandonedOrDestroyedWriterLeavesNothing) {
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w,
                              ZipWriter::Create(dir_.Join("a.zip"), storage::Overwrite::kNo));
    ZINF_ASSERT_OK(w.Add("x", "data"));
    w.Abandon();
    EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
    EXPECT_THAT(w.Finish(), StatusIs(ErrorCode::kFailedPrecondition));
  }
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w,
                              ZipWriter::Create(dir_.Join("b.zip"), storage::Overwrite::kNo));
    ZINF_ASSERT_OK(w.Begin("x", 10));
    ZINF_ASSERT_OK(w.Append(Bytes("12345")));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
}

TEST_F(ZipTest, LinkIsRefused) {
  const std::string path = dir_.Join("real.zip");
  WriteBytes(path, Compose(TwoEntries()));
  ZINF_ASSERT_OK(ZipReader::Open(path));
  ASSERT_EQ(::symlink(path.c_str(), dir_.Join("link.zip").c_str()), 0);
  EXPECT_THAT(ZipReader::Open(dir_.Join("link.zip")),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
}

// ---- Python's zipfile ----

constexpr const char* kPythonReads = R"(
import sys, zipfile, zlib
path, manifest = sys.argv[1], sys.argv[2]
want = [line.split('\t') for line in open(manifest).read().splitlines()]
with zipfile.ZipFile(path) as z:
    assert z.testzip() is None
    infos = z.infolist()
    assert [i.filename for i in infos] == [w[0] for w in want], 'names'
    for info, (name, size, crc) in zip(infos, want):
        assert info.compress_type == zipfile.ZIP_STORED, name
        data = z.read(name)
        assert len(data) == int(size) == info.file_size, name
        assert zlib.crc32(data) == int(crc) == info.CRC, name
print('python read', len(infos), 'entries')
)";

void PythonReadsWhatWeWrite(const ScratchDir& dir, bool zip64) {
  const std::string path = dir.Join(zip64 ? "w64.zip" : "w.zip");
  std::string manifest;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w, ZipWriter::Create(path, storage::Overwrite::kNo));
    for (int i = 0; i < 20; ++i) {
      const std::string name = fmt::format("arch/data/{}", i);
      const std::string data = Content(i * 101, i + 1);
      if (i % 3 == 0) {
        ZINF_ASSERT_OK(w.Begin(name, data.size()));
        ZINF_ASSERT_OK(w.Append(Bytes(data.substr(0, data.size() / 2))));
        ZINF_ASSERT_OK(w.Append(Bytes(data.substr(data.size() / 2))));
        ZINF_ASSERT_OK(w.End());
      } else {
        ZINF_ASSERT_OK(w.Add(name, data));
      }
      manifest += fmt::format("{}\t{}\t{}\n", name, data.size(), SlowCrc32(data));
    }
    ZINF_ASSERT_OK(w.Finish());
  }
  WriteBytes(dir.Join("manifest"), manifest);
  const int rc = RunPython(dir, kPythonReads, path + " " + dir.Join("manifest"));
  if (rc == -1) GTEST_SKIP() << kPython << " is missing";
  EXPECT_EQ(rc, 0);
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, ZipReader::Open(path));
  EXPECT_EQ(r.entries().size(), 20u);
  for (const ZipEntry& e : r.entries()) ZINF_EXPECT_OK(r.VerifyCrc(e));
}

TEST_F(ZipTest, PythonReadsWhatWeWrite) { PythonReadsWhatWeWrite(dir_, false); }

TEST_F(ZipTest, PythonReadsWhatWeWriteWithZip64Forced) {
  internal::ForceZip64ForTesting(true);
  PythonReadsWhatWeWrite(dir_, true);
  internal::ForceZip64ForTesting(false);
  // The forced records are really ZIP64 ones.
  const std::string bytes = ReadBytes(dir_.Join("w64.zip"));
  EXPECT_NE(bytes.find(std::string("PK\x06\x06", 4)), std::string::npos);
  EXPECT_NE(bytes.find(std::string("PK\x06\x07", 4)), std::string::npos);
}

TEST_F(ZipTest, ReadsWhatPythonWrites) {
  const std::string path = dir_.Join("py.zip");
  const int rc = RunPython(dir_, R"(
import sys, zipfile
with zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_STORED) as z:
    z.comment = b'a comment'
    z.writestr('top/a', b'alpha')
    z.writestr('top/empty', b'')
    z.writestr('top/bin', bytes(range(256)) * 40)
    with z.open('top/z64', 'w', force_zip64=True) as f:
        f.write(b'zip64 entry')
)",
                           path);
  if (rc == -1) GTEST_SKIP() << kPython << " is missing";
  ASSERT_EQ(rc, 0);
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, ZipReader::Open(path));
  ASSERT_EQ(r.entries().size(), 4u);
  EXPECT_EQ(r.entries()[3].name, "top/z64");
  std::string bin;
  for (int i = 0; i < 40; ++i) {
    for (int b = 0; b < 256; ++b) bin.push_back(static_cast<char>(b));
  }
  const std::vector<std::pair<std::string, std::string>> want = {
      {"top/a", "alpha"}, {"top/empty", ""}, {"top/bin", bin}, {"top/z64", "zip64 entry"}};
  for (const auto& [name, data] : want) {
    ZINF_ASSERT_OK_AND_ASSIGN(std::string got, r.ReadEntry(name, 1 << 20));
    EXPECT_EQ(got, data) << name;
  }
}

// torch.save's archive (data descriptors, "FB" padding) reads, and the same entries rewritten by
// ZipWriter load with torch.load (whose miniz reader checks CRCs and the layout), ZIP64 forced too.
// Skipped when /usr/bin/python3 cannot import torch.
void TorchRoundTrip(const ScratchDir& dir, bool zip64) {
  const std::string saved = dir.Join("saved.pt");
  constexpr const char* kSave = R"(
import sys
try:
    import torch
except Exception:
    sys.exit(77)
torch.save({'w': torch.arange(1000, dtype=torch.float32), 'b': torch.ones(3, 5, dtype=torch.int64),
            'n': 7}, sys.argv[1])
)";
  const int rc = RunPython(dir, kSave, saved);
  if (rc == -1 || rc == 77) GTEST_SKIP() << "no torch in " << kPython;
  ASSERT_EQ(rc, 0);
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, ZipReader::Open(saved));
  ASSERT_GE(r.entries().size(), 3u);
  const std::string rewritten = dir.Join("rewritten.pt");
  internal::ForceZip64ForTesting(zip64);
  auto created = ZipWriter::Create(rewritten, storage::Overwrite::kNo);
  internal::ForceZip64ForTesting(false);
  ZINF_ASSERT_OK(created);
  for (const ZipEntry& e : r.entries()) {
    EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
    ZINF_ASSERT_OK_AND_ASSIGN(std::string data, r.ReadEntry(e.name, 1 << 20));
    ZINF_ASSERT_OK(created->Add(e.name, data));
  }
  ZINF_ASSERT_OK(created->Finish());
  constexpr const char* kLoad = R"(
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
assert a.keys() == b.keys() and a['n'] == b['n'] == 7
assert torch.equal(a['w'], b['w']) and torch.equal(a['b'], b['b'])
)";
  EXPECT_EQ(RunPython(dir, kLoad, saved + " " + rewritten), 0);
}

TEST_F(ZipTest, TorchSaveReadsAndOurRewriteLoads) { TorchRoundTrip(dir_, false); }
TEST_F(ZipTest, TorchLoadsOurZip64Rewrite) { TorchRoundTrip(dir_, true); }

// ---- crafted archives ----

TEST_F(ZipTest, CraftedArchiveReads) {
  RawArchive a = TwoEntries();
  a.comment = "trailing comment with PK\x05\x06 inside";
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, OpenBytes(Compose(a)));
  ASSERT_EQ(r.entries().size(), 2u);
  ZINF_ASSERT_OK_AND_ASSIGN(std::string b, r.ReadEntry("arch/b", 100));
  EXPECT_EQ(b, "bravo!");
}

TEST_F(ZipTest, TorchStyleDataDescriptorReads) {
  RawArchive a = TwoEntries();
  for (RawEntry& e : a.entries) e.descriptor = true;
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, OpenBytes(Compose(a)));
  ZINF_ASSERT_OK_AND_ASSIGN(std::string got, r.ReadEntry("arch/a", 100));
  EXPECT_EQ(got, "alpha");
}

TEST_F(ZipTest, Zip64RecordsAndExtraFieldsRead) {
  RawArchive a = TwoEntries();
  a.entries[1].zip64 = true;
  a.entries.push_back({.name = "arch/c", .data = Content(300, 3), .zip64 = true});
  a.zip64_eocd = true;
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, OpenBytes(Compose(a)));
  ASSERT_EQ(r.entries().size(), 3u);
  EXPECT_EQ(r.entries()[2].size, 300u);
  ZINF_ASSERT_OK_AND_ASSIGN(std::string b, r.ReadEntry("arch/b", 100));
  EXPECT_EQ(b, "bravo!");
  ZINF_ASSERT_OK_AND_ASSIGN(std::string c, r.ReadEntry("arch/c", 1000));
  EXPECT_EQ(c, a.entries[2].data);

  // A ZIP64 record claiming more entries than the limit.
  a.count = 1u << 20;
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("limit")));
  // 0xFFFFFFFF in a fixed field without the ZIP64 extra field behind it.
  RawArchive m = TwoEntries();
  m.entries[0].central_size = 0xFFFFFFFF;
  EXPECT_THAT(OpenBytes(Compose(m)), StatusIs(ErrorCode::kDataLoss, HasSubstr("ZIP64")));
}

TEST_F(ZipTest, TruncatedArchivesAreRefused) {
  const std::string path = dir_.Join("whole.zip");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w, ZipWriter::Create(path, storage::Overwrite::kNo));
    for (int i = 0; i < 10; ++i) ZINF_ASSERT_OK(w.Add(fmt::format("t/{}", i), Content(500, i)));
    ZINF_ASSERT_OK(w.Finish());
  }
  const std::string whole = ReadBytes(path);
  ZINF_ASSERT_OK(OpenBytes(whole));
  for (int k = 0; k < 8; ++k) {
    EXPECT_THAT(OpenBytes(whole.substr(0, whole.size() * k / 8)), StatusIs(ErrorCode::kDataLoss))
        << k << "/8";
  }
  // The end record kept but the entries before it cut away.
  const std::string tail = whole.substr(whole.size() / 2);
  EXPECT_THAT(OpenBytes(tail), StatusIs(ErrorCode::kDataLoss));
}

TEST_F(ZipTest, NoEndRecordIsNotAZip) {
  EXPECT_THAT(OpenBytes(Content(5000, 1)),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("not a zip archive")));
  EXPECT_THAT(OpenBytes(""), StatusIs(ErrorCode::kDataLoss, HasSubstr("not a zip archive")));
  // An end record farther from the end than the longest comment allows is not looked for.
  std::string far = Compose(TwoEntries()) + std::string(70000, 'x');
  EXPECT_THAT(OpenBytes(far), StatusIs(ErrorCode::kDataLoss, HasSubstr("not a zip archive")));
}

TEST_F(ZipTest, EndRecordPointingPastTheEndIsRefused) {
  RawArchive a = TwoEntries();
  a.cd_offset = 1 << 20;
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("central")));
  a.cd_offset = 0xFFFFFFF0;
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("central")));
}

TEST_F(ZipTest, EntryCountsBeyondLimitsOrRoomAreRefused) {
  RawArchive a = TwoEntries();
  a.entries.push_back({.name = "arch/c", .data = "c"});
  ZINF_ASSERT_OK(OpenBytes(Compose(a), ZipLimits{.max_entries = 3}));
  EXPECT_THAT(OpenBytes(Compose(a), ZipLimits{.max_archive_bytes = 100}),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("larger than the limit of 100 bytes")));
  EXPECT_THAT(OpenBytes(Compose(a), ZipLimits{.max_entries = 2}),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("more than the limit of 2")));
  a.count = 0xFFFF;
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("cannot fit")));
  a.count = 2;  // fewer than are there: the rest of the directory is unexplained
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("after its")));
}

TEST_F(ZipTest, CompressedOrEncryptedEntriesAreRefused) {
  // Said by both headers, by the central one only, by the local one only.
  for (int where = 0; where < 3; ++where) {
    RawArchive a = TwoEntries();
    a.entries[1].method = where == 2 ? 0 : 8;
    if (where != 0) a.entries[1].local_method = where == 1 ? 0 : 8;
    EXPECT_THAT(OpenBytes(Compose(a)),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("compressed (method 8)")))
        << where;
    a = TwoEntries();
    a.entries[0].flags = where == 2 ? 0 : 1;
    if (where != 0) a.entries[0].local_flags = where == 1 ? 0 : 1;
    EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("encrypted")))
        << where;
  }
}

TEST_F(ZipTest, OverlappingEntriesAreRefused) {
  RawEntry inner{.name = "arch/b", .data = "BBBB"};
  RawArchive a;
  a.entries.push_back({.name = "arch/a", .data = "xx" + LocalHeader(inner) + "BBBB" + "yy"});
  inner.central_offset = 30 + 6 + 2;  // inside arch/a's data
  a.entries.push_back(inner);
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("overlaps")));
  // Two central entries for the same local header.
  RawArchive same = TwoEntries();
  same.entries[1] = same.entries[0];
  same.entries[1].central_offset = 0;
  EXPECT_THAT(OpenBytes(Compose(same)), StatusIs(ErrorCode::kDataLoss));
}

TEST_F(ZipTest, DuplicateEmptyOrLongNamesAreRefused) {
  RawArchive a = TwoEntries();
  a.entries[1].name = "arch/a";
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("duplicate")));
  a = TwoEntries();
  a.entries[0].name = "";
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("empty name")));
  a = TwoEntries();
  EXPECT_THAT(OpenBytes(Compose(a), ZipLimits{.max_name_bytes = 5}),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("longer than the limit of 5")));
}

TEST_F(ZipTest, LocalHeaderDisagreeingWithCentralIsRefused) {
  RawArchive a = TwoEntries();
  a.entries[1].local_name = "arch/X";
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("differs")));
  a = TwoEntries();
  a.entries[1].local_name = "arch/bb";
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("differs")));
  a = TwoEntries();
  a.entries[0].local_size = 4;
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("differ")));
  // Sizes that agree but run into the central directory.
  a = TwoEntries();
  a.entries[1].local_size = a.entries[1].central_size = 1000;
  EXPECT_THAT(OpenBytes(Compose(a)),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("past the start of the central")));
  // A central offset that points at no local header.
  a = TwoEntries();
  a.entries[1].central_offset = 3;
  EXPECT_THAT(OpenBytes(Compose(a)), StatusIs(ErrorCode::kDataLoss, HasSubstr("local header")));
}

TEST_F(ZipTest, CrcMismatchIsDataLoss) {
  RawArchive a = TwoEntries();
  a.entries[1].crc = 0x12345678;
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, OpenBytes(Compose(a)));
  EXPECT_THAT(r.ReadEntry("arch/b", 100), StatusIs(ErrorCode::kDataLoss, HasSubstr("CRC")));
  EXPECT_THAT(r.VerifyCrc(*r.Find("arch/b")), StatusIs(ErrorCode::kDataLoss, HasSubstr("CRC")));
  ZINF_EXPECT_OK(r.VerifyCrc(*r.Find("arch/a")));
}

// Every single-byte corruption of a small archive is an error or a readable archive, never a
// crash (run under the sanitizers in CI).
TEST_F(ZipTest, SingleByteCorruptionsNeverCrash) {
  RawArchive a = TwoEntries();
  a.entries[1].zip64 = true;
  a.zip64_eocd = true;
  const std::string good = Compose(a);
  for (std::size_t i = 0; i < good.size(); ++i) {
    for (unsigned char v : {0x00, 0xFF, 0x80}) {
      std::string bad = good;
      bad[i] = static_cast<char>(v);
      auto r = OpenBytes(bad);
      if (!r) {
        EXPECT_NE(r.error().code(), ErrorCode::kInternal) << r.error().ToString();
        continue;
      }
      for (const ZipEntry& e : r->entries()) (void)r->ReadEntry(e.name, 1 << 20);
    }
  }
}

}  // namespace
}  // namespace zinf::interop

namespace zinf::interop {
namespace {

// An entry of several write-behind windows (32 MiB each) reads back whole, CRC verified; a
// failed sync_file_range of the write-behind fails the write and leaves nothing.
TEST(ZipWriter, WriteBehindKeepsLargeEntriesWholeAndReportsItsErrors) {
  ScratchDir dir("zip_wb");
  const std::string path = dir.Join("big.zip");
  const std::string piece = Content(3 << 20, 7);  // 3 MiB: windows end inside pieces
  constexpr int kPieces = 30;                      // 90 MiB
  {
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w, ZipWriter::Create(path, storage::Overwrite::kNo));
    ZINF_ASSERT_OK(w.Begin("a/data/0", std::uint64_t{kPieces} * piece.size()));
    for (int i = 0; i < kPieces; ++i) ZINF_ASSERT_OK(w.Append(Bytes(piece)));
    ZINF_ASSERT_OK(w.End());
    ZINF_ASSERT_OK(w.Finish());
  }
  ZINF_ASSERT_OK_AND_ASSIGN(ZipReader r, ZipReader::Open(path));
  ASSERT_EQ(r.entries().size(), 1u);
  ZINF_EXPECT_OK(r.VerifyCrc(r.entries()[0]));
  std::string tail(piece.size(), '\0');
  ZINF_ASSERT_OK(r.ReadRange(r.entries()[0], (kPieces - 1) * piece.size(),
                             std::as_writable_bytes(std::span(tail.data(), tail.size()))));
  EXPECT_TRUE(tail == piece);

  ZINF_ASSERT_OK_AND_ASSIGN(storage::FaultSpec spec,
                            storage::ParseFaultSpec("sync_file_range:2:eio"));
  storage::FaultInjectingEnv env(storage::Env::Posix(),
                                 std::make_shared<storage::FaultInjector>(spec));
  const std::string failed = dir.Join("failed.zip");
  {
    storage::ScopedDefaultEnv scope(env);
    ZINF_ASSERT_OK_AND_ASSIGN(ZipWriter w, ZipWriter::Create(failed, storage::Overwrite::kNo));
    ZINF_ASSERT_OK(w.Begin("a/data/0", std::uint64_t{kPieces} * piece.size()));
    Status appended = OkStatus();
    for (int i = 0; i < kPieces && appended; ++i) appended = w.Append(Bytes(piece));
    ASSERT_FALSE(appended);
    EXPECT_THAT(appended.error().message(), HasSubstr("write-behind"));
    EXPECT_THAT(w.Finish(), ::testing::Not(IsOk()));
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    left.push_back(e.path().filename().string());
  }
  EXPECT_THAT(left, ::testing::ElementsAre("big.zip"));
}

}  // namespace
}  // namespace zinf::interop
