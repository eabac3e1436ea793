// ExportDeepSpeed (interop/deepspeed_export.h) on checkpoints saved on 1-3 ranks, read back with
// TorchFile: each group's W fp32 partitions concatenated are the group's flat vector of the
// checkpoint bitwise (q8: moments decoded, as CheckpointStateReader reads them), the rigid
// moments are padded with zeros, the paddings, mappings, step and loss scaler are DeepSpeed's;
// and every error (bad world size, stage or tag; an output that is not a new or empty
// directory; a checkpoint with a bad chunk or bad param_groups; check_info) leaves nothing.
#include "zinf/interop/deepspeed_export.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "deepspeed_export_testing.h"
#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/h5/h5_file.h"
#include "zinf/interop/pickle.h"
#include "zinf/interop/torch_file.h"

namespace zinf::interop {
namespace {

using checkpoint::CheckpointStateReader;
using deepspeed_testing::SaveGroupsCheckpoint;
using swapper::StateTensor;
using ::testing::HasSubstr;
using testing::SharedScratchDir;
using testing::StatusIs;
using testing::World;

// The groups of deepspeed_testing::GroupsTrainer, in layout order.
const std::vector<std::vector<std::string>> kGroups = {{"b1", "scale", "head"},
                                                       {"embed", "w1", "w2"}};

const PyValue& At(const PyValue& v, std::string_view key) {
  const PyDict* d = v.as<PyDict>();
  EXPECT_NE(d, nullptr) << "not a dict looking up " << key;
  const PyValue* found = d ? d->Find(key) : nullptr;
  EXPECT_NE(found, nullptr) << "no key " << key;
  static const PyValue none;
  return found ? *found : none;
}
const PyValue& AtInt(const PyValue& v, std::int64_t key) {
  for (const auto& [k, value] : v.as<PyDict>()->items) {
    if (k.as<std::int64_t>() && *k.as<std::int64_t>() == key) return value;
  }
  ADD_FAILURE() << "no int key " << key;
  static const PyValue none;
  return none;
}
const PyValue& Item(const PyValue& v, std::size_t i) { return v.as<PyList>()->items.at(i); }
std::int64_t IntOf(const PyValue& v) { return v.as<std::int64_t>() ? *v.as<std::int64_t>() : -999; }

DeepSpeedExportOptions Options(int world = 1, int stage = 2, std::string tag = {}) {
  DeepSpeedExportOptions o;
  o.world_size = world;
  o.stage = stage;
  o.tag = std::move(tag);
  return o;
}

bool Bitwise(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

void CheckExport(const std::string& ckpt, const std::string& out, int world, int stage) {
  SCOPED_TRACE(fmt::format("W={} stage {}", world, stage));
  std::ifstream latest_file(out + "/latest");
  std::string latest((std::istreambuf_iterator<char>(latest_file)), {});
  ASSERT_EQ(latest, "global_step5");
  ZINF_ASSERT_OK_AND_ASSIGN(CheckpointStateReader reader, CheckpointStateReader::Open(ckpt));
  const partition::ParamLayout& layout = *reader.info().layout;
  std::vector<TorchFile> files;
  for (int r = 0; r < world; ++r) {
    ZINF_ASSERT_OK_AND_ASSIGN(
        TorchFile f, TorchFile::Read(fmt::format(
                         "{}/global_step5/zero_pp_rank_{}_mp_rank_00_optim_states.pt", out, r)));
    files.push_back(std::move(f));
  }
  for (std::size_t g = 0; g < kGroups.size(); ++g) {
    SCOPED_TRACE(fmt::format("group {}", g));
    // The group's flat vector of each state, from the checkpoint.
    std::array<std::vector<float>, 3> want;
    for (const std::string& name : kGroups[g]) {
      const std::optional<std::size_t> index = layout.FindParam(name);
      ASSERT_TRUE(index.has_value()) << name;
      const partition::ParamInfo* p = &layout.param(*index);
      for (std::size_t s = 0; s < 3; ++s) {
        std::vector<float> v(p->numel);
        ZINF_ASSERT_OK(reader.Read(static_cast<StateTensor>(s), p->flat_offset, v));
        want[s].insert(want[s].end(), v.begin(), v.end());
      }
    }
    const std::uint64_t n = want[0].size();
    const std::uint64_t part = 2 * ((n + 2 * world - 1) / (2 * world));
    std::array<std::vector<float>, 3> got;
    for (int r = 0; r < world; ++r) {
      const PyValue& sd = At(files[r].root(), "optimizer_state_dict");
      EXPECT_EQ(IntOf(At(sd, "zero_stage")), stage);
      EXPECT_EQ(IntOf(Item(At(sd, "partition_count"), g)), world);
      const std::uint64_t keep = n > r * part ? std::min(n, (r + 1) * part) - r * part : 0;
      EXPECT_EQ(IntOf(Item(At(sd, "group_paddings"), g)), static_cast<std::int64_t>(part - keep));
      const PyValue& state = AtInt(At(At(sd, "base_optimizer_state"), "state"), g);
      EXPECT_EQ(IntOf(At(state, "step")), 4);  // step 5, one skipped
      const PyTensor* fp32 = Item(At(sd, "single_partition_of_fp32_groups"), g).as<PyTensor>();
      ASSERT_NE(fp32, nullptr);
      ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> w, files[r].ReadFloat32(*fp32, 1 << 24));
      EXPECT_EQ(w.size(), keep);
      got[0].insert(got[0].end(), w.begin(), w.end());
      for (std::size_t s = 1; s < 3; ++s) {
        const PyTensor* m = At(state, s == 1 ? "exp_avg" : "exp_avg_sq").as<PyTensor>();
        ASSERT_NE(m, nullptr);
        ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> v, files[r].ReadFloat32(*m, 1 << 24));
        EXPECT_EQ(v.size(), part);
        got[s].insert(got[s].end(), v.begin(), v.end());
      }
      // The mapping: every parameter overlapping [r * part, (r + 1) * part), start relative.
      const PyDict* mapping = Item(At(sd, "param_slice_mappings"), g).as<PyDict>();
      ASSERT_NE(mapping, nullptr);
      std::uint64_t offset = 0;
      std::size_t entry = 0;
      for (const std::string& name : kGroups[g]) {
        const std::uint64_t numel = layout.param(*layout.FindParam(name)).numel;
        const std::uint64_t lo = r * part, hi = std::min(n, (r + 1) * part);
        const std::uint64_t begin = std::max(offset, lo), end = std::min(offset + numel, hi);
        if (begin < end) {
          ASSERT_LT(entry, mapping->items.size());
          const auto& [key, address] = mapping->items[entry++];
          EXPECT_EQ(*key.as<std::string>(), name);
          const PyObject* o = address.as<PyObject>();
          ASSERT_NE(o, nullptr);
          EXPECT_EQ(o->name, "fragment_address");
          EXPECT_EQ(IntOf(At(*o->state, "numel")), static_cast<std::int64_t>(end - begin));
          EXPECT_EQ(IntOf(At(*o->state, "start")), static_cast<std::int64_t>(begin - lo));
        }
        offset += numel;
      }
      EXPECT_EQ(entry, mapping->items.size());
      const PyObject* scaler = At(sd, "loss_scaler").as<PyObject>();
      ASSERT_NE(scaler, nullptr);
      EXPECT_EQ(scaler->name, "DynamicLossScaler");
      EXPECT_EQ(*At(*scaler->state, "cur_scale").as<double>(), 2048.0);
    }
    EXPECT_TRUE(Bitwise(got[0], want[0])) << "fp32 partitions are not the group's flat vector";
    for (std::size_t s = 1; s < 3; ++s) {
      ASSERT_EQ(got[s].size(), world * part);
      EXPECT_TRUE(Bitwise(std::span(got[s]).first(n), want[s])) << "moment " << s;
      for (std::uint64_t k = n; k < got[s].size(); ++k) ASSERT_EQ(got[s][k], 0.0f) << k;
    }
  }
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile model,
                            TorchFile::Read(out + "/global_step5/mp_rank_00_model_states.pt"));
  EXPECT_EQ(IntOf(At(model.root(), "global_steps")), 5);
  EXPECT_EQ(IntOf(At(model.root(), "skipped_steps")), 1);
  EXPECT_EQ(IntOf(At(model.root(), "dp_world_size")), world);
  EXPECT_EQ(IntOf(At(At(model.root(), "lr_scheduler"), "last_batch_iteration")), 3);
  for (const partition::ParamInfo& p : layout.params()) {
    const PyTensor* t = At(At(model.root(), "module"), p.name).as<PyTensor>();
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->shape, p.shape);
    ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> w, model.ReadFloat32(*t, 1 << 24));
    std::vector<float> want(p.numel);
    ZINF_ASSERT_OK(reader.Read(StateTensor::kFp32, p.flat_offset, want));
    EXPECT_TRUE(Bitwise(w, want)) << p.name;
  }
}

TEST(DeepSpeedExport, PartitionsAreTheCheckpointsGroups) {
  SharedScratchDir dir("dsexport");
  for (bool q8 : {false, true}) {
    SCOPED_TRACE(q8 ? "q8" : "fp32");
    const std::string ckpt_dir = dir.Join(q8 ? "ckpt_q8" : "ckpt");
    ZINF_ASSERT_OK_AND_ASSIGN(std::string ckpt,
                              SaveGroupsCheckpoint(World(), dir.path(), ckpt_dir, q8));
    if (World().rank() != 0) continue;
    for (int world = 1; world <= 4; ++world) {
      for (int stage : {1, 2}) {
        const std::string out = dir.Join(fmt::format("out{}_{}_{}", q8, world, stage));
        ZINF_ASSERT_OK(ExportDeepSpeed(ckpt_dir, out, Options(world, stage)));
        CheckExport(ckpt, out, world, stage);
      }
    }
  }
  ZINF_ASSERT_OK(World().Barrier());
}

// Nothing named like the export's temporary directory is left in `dir`.
void ExpectNoTemporaries(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename().string().find("deepspeed-tmp"), std::string::npos) << e.path();
  }
}

TEST(DeepSpeedExport, ErrorsLeaveNothing) {
  SharedScratchDir dir("dsexport_err");
  const std::string ckpt_dir = dir.Join("ckpt");
  ZINF_ASSERT_OK_AND_ASSIGN(std::string ckpt,
                            SaveGroupsCheckpoint(World(), dir.path(), ckpt_dir, false));
  nlohmann::json bad_groups = deepspeed_testing::GroupsTrainer(World().size());
  bad_groups["param_groups"][1]["params"] = {"embed", "w1"};
  ZINF_ASSERT_OK(
      SaveGroupsCheckpoint(World(), dir.path(), dir.Join("bad_groups"), false, bad_groups));
  if (World().rank() == 0) {
    const std::string out = dir.Join("out");
    for (int world : {0, -1, kMaxDeepSpeedExportWorldSize + 1}) {
      EXPECT_THAT(ExportDeepSpeed(ckpt_dir, out, Options(world)),
                  StatusIs(ErrorCode::kInvalidArgument, HasSubstr("world size")));
    }
    EXPECT_THAT(ExportDeepSpeed(ckpt_dir, out, Options(1, 3)),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("stage 3")));
    for (const char* tag : {"../up", "a/b", ".", "x\n"}) {
      EXPECT_THAT(ExportDeepSpeed(ckpt_dir, out, Options(1, 2, tag)),
                  StatusIs(ErrorCode::kInvalidArgument, HasSubstr("tag")));
    }
    std::filesystem::create_directory(dir.Join("full"));
    std::ofstream(dir.Join("full/keep")) << "x";
    EXPECT_THAT(ExportDeepSpeed(ckpt_dir, dir.Join("full")),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not empty")));
    EXPECT_THAT(ExportDeepSpeed(ckpt_dir, dir.Join("full/keep")),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a directory")));
    DeepSpeedExportOptions refuse = Options();
    refuse.check_info = [](const checkpoint::CheckpointInfo&) -> Status {
      return DataLossError("refused by check_info");
    };
    EXPECT_THAT(ExportDeepSpeed(ckpt_dir, out, refuse),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("refused by check_info")));
    EXPECT_THAT(ExportDeepSpeed(dir.Join("bad_groups"), out),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("w2 is in no param_group")));
    // A bad chunk at the end of the last state streamed: the files before it were written and
    // are removed.
    const std::string flipped = dir.Join("flipped.h5");
    std::filesystem::copy_file(ckpt, flipped);
    {
      ZINF_ASSERT_OK_AND_ASSIGN(h5::H5File f, h5::H5File::OpenSerial(flipped, false));
      const std::uint64_t last = checkpoint::checkpoint_testing::TestLayout().total_numel() - 1;
      float v = 0;
      ZINF_ASSERT_OK(f.ReadSlab("/state/fp32", last, std::span(&v, 1)));
      v = -v + 1.0f;
      ZINF_ASSERT_OK(f.WriteSlab("/state/fp32", last, std::span<const float>(&v, 1)));
      ZINF_ASSERT_OK(f.Close());
    }
    EXPECT_THAT(ExportDeepSpeed(flipped, out, Options(3)),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("/state/fp32")));
    EXPECT_FALSE(std::filesystem::exists(out));
    ExpectNoTemporaries(dir.path());
    EXPECT_EQ(std::filesystem::directory_iterator(dir.Join("full"))->path().filename(), "keep");

    // An empty directory is filled; a second export into it is refused.
    std::filesystem::create_directory(out);
    std::uint64_t calls = 0, last_done = 0, last_total = 0;
    DeepSpeedExportOptions tagged = Options(2, 2, "mytag");
    tagged.progress = [&](std::uint64_t done, std::uint64_t total) {
      ++calls;
      last_done = done;
      last_total = total;
    };
    ZINF_ASSERT_OK(ExportDeepSpeed(ckpt_dir, out, tagged));
    EXPECT_GT(calls, 0u);
    EXPECT_EQ(last_done, last_total);
    EXPECT_TRUE(std::filesystem::exists(out + "/mytag/zero_pp_rank_1_mp_rank_00_optim_states.pt"));
    EXPECT_THAT(ExportDeepSpeed(ckpt_dir, out),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not empty")));
    ExpectNoTemporaries(dir.path());
  }
  ZINF_ASSERT_OK(World().Barrier());
}

}  // namespace
}  // namespace zinf::interop
