// DeepSpeed checkpoints (interop/deepspeed.h) whose folders are replaced by links while they are
// read: OpenDeepSpeedCheckpoint opens the folder once and every file relative to it, and a
// universal checkpoint's ReadParam reopens a param's file relative to the zero/ folder Open
// opened, never by path. So a checkpoint folder, its zero/ or a param folder replaced by a link
// to another checkpoint (a decoy whose files are valid and lay their tensors out the same way)
// is never read: ReadParam refuses a param folder that became a link, and reads the original
// files when a folder above it was replaced. The swaps during Open happen in an Env (env.h) that
// replaces the folder just before the first file of the checkpoint is opened.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/interop/deepspeed.h"
#include "zinf/interop/pickle.h"
#include "zinf/interop/torch_file.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fs.h"

namespace zinf::interop {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;

// The params of every checkpoint here: w [4] and b [2], one param group, one rank.
constexpr std::int64_t kNumelW = 4;
constexpr std::int64_t kNumelB = 2;

PyValue Int(std::int64_t v) { return PyValue(v); }
PyValue Str(const char* s) { return PyValue(std::string(s)); }
PyValue Dict(std::vector<std::pair<PyValue, PyValue>> items, bool ordered = false) {
  return PyDict{.items = std::move(items), .ordered = ordered};
}
PyValue Size(std::int64_t n) { return PyTuple{.items = {Int(n)}, .torch_size = true}; }

// The values of a field of a param in the checkpoint whose values start at `base` (the original
// and the decoy differ by their base): positive, so that every field (exp_avg_sq) is valid.
std::vector<float> Values(float base, int param, int field, std::int64_t numel) {
  std::vector<float> v;
  for (std::int64_t i = 0; i < numel; ++i) {
    v.push_back(base + 10.0f * static_cast<float>(param) + static_cast<float>(field) +
                0.125f * static_cast<float>(i));
  }
  return v;
}

// A torch file at `path` holding `root(tensors)`, the tensors made of `data` (fp32, 1-dim).
void WriteTorch(const std::string& path, const std::vector<std::vector<float>>& data,
                const std::function<PyValue(const std::vector<PyTensor>&)>& root) {
  ZINF_ASSERT_OK_AND_ASSIGN(TorchWriter writer, TorchWriter::Create(path, storage::Overwrite::kNo));
  std::vector<PyTensor> tensors;
  for (const std::vector<float>& d : data) {
    ZINF_ASSERT_OK_AND_ASSIGN(PyTensor t,
                              writer.AddFloat32(d, {static_cast<std::int64_t>(d.size())}));
    tensors.push_back(std::move(t));
  }
  ZINF_ASSERT_OK(writer.Finish(root(tensors)));
}

PyValue ModelStates(std::int64_t global_steps) {
  return Dict({{Str("param_shapes"),
                PyList{.items = {Dict({{Str("w"), Size(kNumelW)}, {Str("b"), Size(kNumelB)}},
                                      /*ordered=*/true)}}},
               {Str("global_steps"), Int(global_steps)},
               {Str("skipped_steps"), Int(0)}});
}

// lr: the checkpoint's base / 1000 (the original's and the decoy's differ).
PyValue AdamGroup(float base) {
  return Dict({{Str("lr"), PyValue(static_cast<double>(base) / 1000)},
               {Str("betas"), PyTuple{.items = {PyValue(0.9), PyValue(0.999)}}},
               {Str("eps"), PyValue(1e-8)},
               {Str("weight_decay"), PyValue(0.0)},
               {Str("params"), PyList{.items = {Int(0)}}}});
}

// A universal folder `dir` (from ZeRO stage 2, one rank) at step `step` (= global_steps).
void WriteUniversal(const std::string& dir, float base, std::int64_t step) {
  fs::create_directories(dir + "/zero");
  WriteTorch(dir + "/mp_rank_00_model_states.pt", {},
             [&](const std::vector<PyTensor>&) { return ModelStates(step); });
  WriteTorch(dir + "/zero/optimizer_state.pt", {}, [&](const std::vector<PyTensor>&) {
    return Dict({{Str("zero_stage"), Int(2)},
                 {Str("partition_count"), PyList{.items = {Int(1)}}},
                 {Str("param_groups"), PyList{.items = {AdamGroup(base)}}}});
  });
  const std::vector<std::pair<const char*, std::int64_t>> params = {{"w", kNumelW}, {"b", kNumelB}};
  for (int p = 0; p < 2; ++p) {
    const std::string folder = dir + "/zero/" + params[p].first;
    fs::create_directory(folder);
    int field = 0;
    for (const char* name : {"fp32", "exp_avg", "exp_avg_sq"}) {
      WriteTorch(folder + "/" + name + ".pt", {Values(base, p, field++, params[p].second)},
                 [](const std::vector<PyTensor>& t) {
                   return Dict({{Str("param"), t[0]}, {Str("cat_dim"), Int(0)}});
                 });
    }
    WriteTorch(folder + "/step.pt", {}, [&](const std::vector<PyTensor>&) { return Int(step); });
  }
}

// A ZeRO stage 2 tag folder `dir` of one rank at step `step` (= global_steps).
void WriteZero(const std::string& dir, float base, std::int64_t step) {
  fs::create_directories(dir);
  WriteTorch(dir + "/mp_rank_00_model_states.pt", {},
             [&](const std::vector<PyTensor>&) { return ModelStates(step); });
  // The group's flat vectors: w then b (6 elements, a multiple of 2W: no padding).
  std::vector<std::vector<float>> flats;
  for (int field = 0; field < 3; ++field) {
    std::vector<float> flat = Values(base, 0, field, kNumelW);
    for (float v : Values(base, 1, field, kNumelB)) flat.push_back(v);
    flats.push_back(std::move(flat));
  }
  WriteTorch(dir + "/zero_pp_rank_0_mp_rank_00_optim_states.pt", flats,
             [&](const std::vector<PyTensor>& t) {
               PyValue state = Dict({{Int(0), Dict({{Str("step"), Int(step)},
                                                    {Str("exp_avg"), t[1]},
                                                    {Str("exp_avg_sq"), t[2]}})}});
               PyValue osd =
                   Dict({{Str("zero_stage"), Int(2)},
                         {Str("partition_count"), PyList{.items = {Int(1)}}},
                         {Str("base_optimizer_state"),
                          Dict({{Str("state"), std::move(state)},
                                {Str("param_groups"), PyList{.items = {AdamGroup(base)}}}})},
                         {Str("single_partition_of_fp32_groups"), PyList{.items = {t[0]}}}});
               return Dict({{Str("optimizer_state_dict"), std::move(osd)}});
             });
}

// The original checkpoint's values start at 1, the decoy's at 1000; the decoy is one step on,
// so that a model file read from it disagrees with the original's optimizer state.
constexpr float kOriginal = 1.0f;
constexpr float kDecoy = 1000.0f;
constexpr std::int64_t kStep = 3;
constexpr std::int64_t kDecoyStep = 4;

// Replaces `path` by a symbolic link to `target` (the original moved to `path`.moved).
void SwapForLink(const std::string& path, const std::string& target) {
  fs::rename(path, path + ".moved");
  fs::create_directory_symlink(target, path);
}

void ExpectOriginal(const DeepSpeedCheckpoint& ckpt) {
  ASSERT_EQ(ckpt.params().size(), 2u);
  EXPECT_EQ(ckpt.global_steps(), kStep);
  ASSERT_EQ(ckpt.optimizer_groups().size(), 1u);
  EXPECT_EQ(ckpt.optimizer_groups()[0].lr, static_cast<double>(kOriginal) / 1000);
  for (int p = 0; p < 2; ++p) {
    const std::int64_t numel = p == 0 ? kNumelW : kNumelB;
    for (int field = 0; field < 3; ++field) {
      std::vector<float> out(static_cast<std::size_t>(numel));
      ZINF_ASSERT_OK(ckpt.ReadParam(static_cast<std::size_t>(p),
                                    static_cast<DeepSpeedCheckpoint::Field>(field), out));
      EXPECT_THAT(out, ElementsAreArray(Values(kOriginal, p, field, numel)))
          << "param " << p << " field " << field;
    }
  }
}

TEST(DeepSpeedReopen, UniversalParamFolderReplacedByLinkIsRefused) {
  ScratchDir dir("ds_reopen");
  const std::string uc = dir.Join("universal");
  WriteUniversal(uc, kOriginal, kStep);
  WriteUniversal(dir.Join("decoy"), kDecoy, kStep);
  ZINF_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ckpt, OpenDeepSpeedCheckpoint(uc));
  ASSERT_TRUE(ckpt.universal());
  ExpectOriginal(ckpt);

  SwapForLink(uc + "/zero/w", dir.Join("decoy/zero/w"));
  std::vector<float> out(kNumelW);
  EXPECT_THAT(ckpt.ReadParam(0, DeepSpeedCheckpoint::Field::kFp32, out),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  EXPECT_NE(out, Values(kDecoy, 0, 0, kNumelW));
  // The other param's folder is still the original.
  std::vector<float> b(kNumelB);
  ZINF_ASSERT_OK(ckpt.ReadParam(1, DeepSpeedCheckpoint::Field::kExpAvg, b));
  EXPECT_THAT(b, ElementsAreArray(Values(kOriginal, 1, 1, kNumelB)));
}

TEST(DeepSpeedReopen, UniversalFolderOrZeroReplacedByLinkAfterOpenIsNotRead) {
  for (const char* replaced : {"", "/zero"}) {
    SCOPED_TRACE(std::string("replaced: universal") + replaced);
    ScratchDir dir("ds_reopen");
    const std::string uc = dir.Join("universal");
    WriteUniversal(uc, kOriginal, kStep);
    WriteUniversal(dir.Join("decoy"), kDecoy, kStep);
    ZINF_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ckpt, OpenDeepSpeedCheckpoint(uc));
    SwapForLink(uc + replaced, dir.Join("decoy") + replaced);
    ExpectOriginal(ckpt);
  }
}

// Env::Posix(), except that the first open of a name ending in `suffix` first runs `swap`.
class SwapOnOpenEnv final : public storage::Env {
 public:
  SwapOnOpenEnv(std::string suffix, std::function<void()> swap)
      : suffix_(std::move(suffix)), swap_(std::move(swap)) {}

  bool swapped() const { return swapped_; }

  int OpenAt(int dir_fd, const char* name, int flags, mode_t mode) override {
    if (!swapped_ && std::string_view(name).ends_with(suffix_)) {
      swapped_ = true;
      swap_();
    }
    return base_.OpenAt(dir_fd, name, flags, mode);
  }
  int StatAt(int dir_fd, const char* name, struct stat* st, int flags) override {
    return base_.StatAt(dir_fd, name, st, flags);
  }
  int MkdirAt(int dir_fd, const char* name, mode_t mode) override {
    return base_.MkdirAt(dir_fd, name, mode);
  }
  int RenameAt(int from_dir, const char* from, int to_dir, const char* to,
               unsigned flags) override {
    return base_.RenameAt(from_dir, from, to_dir, to, flags);
  }
  int UnlinkAt(int dir_fd, const char* name, int flags) override {
    return base_.UnlinkAt(dir_fd, name, flags);
  }
  int Sync(int fd, bool data_only) override { return base_.Sync(fd, data_only); }
  int Allocate(int fd, int mode, off_t offset, off_t length) override {
    return base_.Allocate(fd, mode, offset, length);
  }
  ssize_t Write(int fd, const void* data, std::size_t size) override {
    return base_.Write(fd, data, size);
  }
  ssize_t Read(int fd, void* data, std::size_t size) override { return base_.Read(fd, data, size); }
  ssize_t PWrite(int fd, const void* data, std::size_t size, off_t offset) override {
    return base_.PWrite(fd, data, size, offset);
  }
  ssize_t PRead(int fd, void* data, std::size_t size, off_t offset) override {
    return base_.PRead(fd, data, size, offset);
  }
  int Truncate(int fd, off_t length) override { return base_.Truncate(fd, length); }
  int Fcntl(int fd, int command, int arg) override { return base_.Fcntl(fd, command, arg); }
  int Lock(int fd, int operation) override { return base_.Lock(fd, operation); }
  int ChangeMode(int fd, mode_t mode) override { return base_.ChangeMode(fd, mode); }
  int Advise(int fd, off_t offset, off_t length, int advice) override {
    return base_.Advise(fd, offset, length, advice);
  }
  int SyncRange(int fd, off_t offset, off_t length, unsigned flags) override {
    return base_.SyncRange(fd, offset, length, flags);
  }
  int StatFs(const char* path, struct statvfs* st) override { return base_.StatFs(path, st); }
  int Close(int fd) override { return base_.Close(fd); }
  int ReadDir(int dir_fd, std::size_t max_names, std::vector<std::string>* names) override {
    return base_.ReadDir(dir_fd, max_names, names);
  }

 private:
  storage::Env& base_ = storage::Env::Posix();
  std::string suffix_;
  std::function<void()> swap_;
  bool swapped_ = false;
};

// The folder Open was given is replaced by a link to the decoy just before the first file in it
// is opened (after Open listed it): every file is still read from the original folder.
TEST(DeepSpeedReopen, FolderReplacedByLinkDuringOpenIsNotRead) {
  struct Case {
    const char* what;
    void (*write)(const std::string&, float, std::int64_t);
    const char* first_file;  // the first file Open opens in the folder
  };
  for (const Case& c : {Case{"zero stage 2", &WriteZero, "_optim_states.pt"},
                        Case{"universal", &WriteUniversal, "optimizer_state.pt"}}) {
    SCOPED_TRACE(c.what);
    ScratchDir dir("ds_reopen");
    const std::string ck = dir.Join("ckpt");
    c.write(ck, kOriginal, kStep);
    c.write(dir.Join("decoy"), kDecoy, kDecoyStep);
    SwapOnOpenEnv env(c.first_file, [&] { SwapForLink(ck, dir.Join("decoy")); });
    Result<DeepSpeedCheckpoint> ckpt = [&] {
      storage::ScopedDefaultEnv scope(env);
      return OpenDeepSpeedCheckpoint(ck);
    }();
    ASSERT_TRUE(env.swapped()) << "Open never opened a file named *" << c.first_file;
    ZINF_ASSERT_OK(ckpt);
    ExpectOriginal(*ckpt);
  }
}

}  // namespace
}  // namespace zinf::interop
