// ExportDeepSpeed (interop/deepspeed_export.h) on checkpoints saved on 1-3 ranks, read back with
// TorchFile: each group's W fp32 partitions concatenated are the group's flat vector of the
// checkpoint bitwise (q8: moments decoded, as CheckpointStateReader reads them), the rigid
// moments are padded with zeros, the paddings, mappings, step and loss scaler are DeepSpeed's;
// and every error (bad world size, stage or tag; an output that is not a new or empty
// directory; a checkpoint with a bad chunk or bad param_groups; check_info) leaves nothing.
// The universal layout: each parameter's three states whole, bitwise, its step, the optimizer
// state; names that cannot be directories refused. Both: the trainer state's user keys are the
// model file's other top-level keys, as plain values; a user key DeepSpeed reserves, an integer
// outside int64 or nesting deeper than kMaxDeepSpeedUserDepth is refused, leaving nothing.
#include "zinf/interop/deepspeed_export.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
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

// A pickle value of plain types back as JSON (for comparing with the trainer's user state);
// anything else as the string "<type>".
nlohmann::json ToJson(const PyValue& v) {
  if (v.is<PyNone>()) return nullptr;
  if (const bool* b = v.as<bool>()) return *b;
  if (const std::int64_t* i = v.as<std::int64_t>()) return *i;
  if (const double* d = v.as<double>()) return *d;
  if (const std::string* s = v.as<std::string>()) return *s;
  if (const PyList* l = v.as<PyList>()) {
    nlohmann::json a = nlohmann::json::array();
    for (const PyValue& item : l->items) a.push_back(ToJson(item));
    return a;
  }
  if (const PyDict* d = v.as<PyDict>(); d != nullptr && !d->ordered) {
    nlohmann::json o = nlohmann::json::object();
    for (const auto& [key, value] : d->items) {
      if (!key.is<std::string>()) return "<dict with a " + key.TypeName() + " key>";
      o[*key.as<std::string>()] = ToJson(value);
    }
    return o;
  }
  return "<" + v.TypeName() + ">";
}

// The model file's keys outside kDeepSpeedModelKeys are exactly `user`'s, with its values
// (dumped: an int stays an int, a float a float), after the reserved ones.
void CheckUserKeys(const PyValue& root, const nlohmann::json& user) {
  const PyDict* d = root.as<PyDict>();
  ASSERT_NE(d, nullptr);
  nlohmann::json got = nlohmann::json::object();
  bool in_user = false;
  for (const auto& [key, value] : d->items) {
    ASSERT_TRUE(key.is<std::string>());
    const std::string& k = *key.as<std::string>();
    const bool reserved =
        std::find(kDeepSpeedModelKeys.begin(), kDeepSpeedModelKeys.end(), k) !=
        kDeepSpeedModelKeys.end();
    EXPECT_FALSE(reserved && in_user) << k << " after a user key";
    in_user = in_user || !reserved;
    if (!reserved) got[k] = ToJson(value);
  }
  EXPECT_EQ(got.dump(), user.dump());
}

// The model file: counters, the weights bitwise, the user's keys.
void CheckModelFile(CheckpointStateReader& reader, const std::string& path, int world) {
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile model, TorchFile::Read(path));
  EXPECT_EQ(IntOf(At(model.root(), "global_steps")), 5);
  EXPECT_EQ(IntOf(At(model.root(), "skipped_steps")), 1);
  EXPECT_EQ(IntOf(At(model.root(), "dp_world_size")), world);
  EXPECT_EQ(IntOf(At(At(model.root(), "lr_scheduler"), "last_batch_iteration")), 3);
  const partition::ParamLayout& layout = *reader.info().layout;
  for (const partition::ParamInfo& p : layout.params()) {
    const PyTensor* t = At(At(model.root(), "module"), p.name).as<PyTensor>();
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->shape, p.shape);
    ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> w, model.ReadFloat32(*t, 1 << 24));
    std::vector<float> want(p.numel);
    ZINF_ASSERT_OK(reader.Read(StateTensor::kFp32, p.flat_offset, want));
    EXPECT_TRUE(Bitwise(w, want)) << p.name;
  }
  CheckUserKeys(model.root(), reader.info().trainer.at("user"));
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
  CheckModelFile(reader, out + "/global_step5/mp_rank_00_model_states.pt", world);
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

// The names in `dir`, sorted.
std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}
std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

DeepSpeedExportOptions Universal(int world = 1, int stage = 2) {
  DeepSpeedExportOptions o = Options(world, stage);
  o.universal = true;
  return o;
}

void CheckUniversal(const std::string& ckpt, const std::string& out, int world, int stage) {
  SCOPED_TRACE(fmt::format("universal W={} stage {}", world, stage));
  std::ifstream latest_file(out + "/latest_universal");
  std::string latest((std::istreambuf_iterator<char>(latest_file)), {});
  ASSERT_EQ(latest, "global_step5");
  EXPECT_EQ(Names(out), Sorted({"latest_universal", "global_step5"}));
  const std::string tag_dir = out + "/global_step5";
  EXPECT_EQ(Names(tag_dir), Sorted({"mp_rank_00_model_states.pt", "zero"}));
  ZINF_ASSERT_OK_AND_ASSIGN(CheckpointStateReader reader, CheckpointStateReader::Open(ckpt));
  const partition::ParamLayout& layout = *reader.info().layout;
  std::vector<std::string> want_zero = {"optimizer_state.pt"};
  for (const partition::ParamInfo& p : layout.params()) want_zero.push_back(p.name);
  EXPECT_EQ(Names(tag_dir + "/zero"), Sorted(want_zero));

  // optimizer_state.pt: rank 0's state dict less the sharded keys, plus param_groups.
  ZINF_ASSERT_OK_AND_ASSIGN(TorchFile opt, TorchFile::Read(tag_dir + "/zero/optimizer_state.pt"));
  const PyDict* sd = opt.root().as<PyDict>();
  ASSERT_NE(sd, nullptr);
  std::vector<std::string> keys;
  for (const auto& [k, v] : sd->items) keys.push_back(*k.as<std::string>());
  EXPECT_EQ(keys, (std::vector<std::string>{"loss_scaler", "dynamic_loss_scale", "overflow",
                                            "clip_grad", "zero_stage", "group_paddings",
                                            "partition_count", "ds_version", "param_groups"}));
  EXPECT_EQ(IntOf(At(opt.root(), "zero_stage")), stage);
  EXPECT_EQ(*At(opt.root(), "ds_version").as<std::string>(), kDeepSpeedExportVersion);
  EXPECT_EQ(*At(opt.root(), "clip_grad").as<double>(), 1.0);
  EXPECT_TRUE(*At(opt.root(), "dynamic_loss_scale").as<bool>());
  const PyObject* scaler = At(opt.root(), "loss_scaler").as<PyObject>();
  ASSERT_NE(scaler, nullptr);
  EXPECT_EQ(scaler->name, "DynamicLossScaler");
  EXPECT_EQ(*At(*scaler->state, "cur_scale").as<double>(), 2048.0);
  for (std::size_t g = 0; g < kGroups.size(); ++g) {
    EXPECT_EQ(IntOf(Item(At(opt.root(), "group_paddings"), g)), 0);
    EXPECT_EQ(IntOf(Item(At(opt.root(), "partition_count"), g)), world);
    const PyValue& pg = Item(At(opt.root(), "param_groups"), g);
    EXPECT_EQ(*At(pg, "lr").as<double>(), g == 0 ? 0.002 : 0.001);
    EXPECT_EQ(IntOf(Item(At(pg, "params"), 0)), static_cast<std::int64_t>(g));
    EXPECT_FALSE(*At(pg, "adam_w_mode").as<bool>());
  }
  EXPECT_EQ(At(opt.root(), "param_groups").as<PyList>()->items.size(), kGroups.size());

  // Each parameter: its three states whole and in its shape, bitwise; the step.
  constexpr std::array<std::pair<StateTensor, const char*>, 3> kStates = {
      {{StateTensor::kFp32, "fp32"},
       {StateTensor::kExpAvg, "exp_avg"},
       {StateTensor::kExpAvgSq, "exp_avg_sq"}}};
  for (const partition::ParamInfo& p : layout.params()) {
    SCOPED_TRACE(p.name);
    const std::string dir = tag_dir + "/zero/" + p.name;
    EXPECT_EQ(Names(dir), Sorted({"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"}));
    for (const auto& [state, stem] : kStates) {
      ZINF_ASSERT_OK_AND_ASSIGN(TorchFile f, TorchFile::Read(fmt::format("{}/{}.pt", dir, stem)));
      const PyDict* d = f.root().as<PyDict>();
      ASSERT_NE(d, nullptr);
      ASSERT_EQ(d->items.size(), 2u);
      EXPECT_EQ(IntOf(At(f.root(), "cat_dim")), 0);
      const PyTensor* t = At(f.root(), "param").as<PyTensor>();
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(t->dtype, "float32");
      EXPECT_EQ(t->shape, p.shape);
      ZINF_ASSERT_OK_AND_ASSIGN(std::vector<float> got, f.ReadFloat32(*t, 1 << 24));
      std::vector<float> want(p.numel);
      ZINF_ASSERT_OK(reader.Read(state, p.flat_offset, want));
      EXPECT_TRUE(Bitwise(got, want)) << stem;
    }
    ZINF_ASSERT_OK_AND_ASSIGN(TorchFile step, TorchFile::Read(dir + "/step.pt"));
    EXPECT_EQ(IntOf(step.root()), 4);  // step 5, one skipped
  }
  CheckModelFile(reader, tag_dir + "/mp_rank_00_model_states.pt", world);
}

TEST(DeepSpeedExport, UniversalHoldsEachParameterWhole) {
  SharedScratchDir dir("dsexport_uni");
  for (bool q8 : {false, true}) {
    SCOPED_TRACE(q8 ? "q8" : "fp32");
    const std::string ckpt_dir = dir.Join(q8 ? "ckpt_q8" : "ckpt");
    ZINF_ASSERT_OK_AND_ASSIGN(std::string ckpt,
                              SaveGroupsCheckpoint(World(), dir.path(), ckpt_dir, q8));
    if (World().rank() != 0) continue;
    for (auto [world, stage] : {std::pair{1, 2}, std::pair{3, 1}}) {
      const std::string out = dir.Join(fmt::format("uni{}_{}_{}", q8, world, stage));
      std::uint64_t last_done = 0, last_total = 0;
      DeepSpeedExportOptions o = Universal(world, stage);
      o.progress = [&](std::uint64_t done, std::uint64_t total) {
        last_done = done;
        last_total = total;
      };
      ZINF_ASSERT_OK(ExportDeepSpeed(ckpt_dir, out, o));
      EXPECT_EQ(last_done, last_total);
      EXPECT_EQ(last_total,
                4 * sizeof(float) * deepspeed_testing::GroupsLayout(true).total_numel());
      CheckUniversal(ckpt, out, world, stage);
    }
  }
  ZINF_ASSERT_OK(World().Barrier());
}

// A parameter name that cannot be a directory of zero/ is refused before anything is written;
// the ZeRO 1/2 layout, which has no such directories, takes it.
TEST(DeepSpeedExport, UniversalRefusesNamesThatAreNotDirectories) {
  SharedScratchDir dir("dsexport_names");
  const std::vector<std::string> bad = {"enc/w", ".", "optimizer_state.pt"};
  for (std::size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(bad[i]);
    nlohmann::json trainer = deepspeed_testing::GroupsTrainer(World().size());
    trainer.erase("param_groups");
    const std::string ckpt_dir = dir.Join(fmt::format("ckpt{}", i));
    ZINF_ASSERT_OK(SaveGroupsCheckpoint(World(), dir.path(), ckpt_dir, false, trainer, true,
                                        {{"w1", bad[i]}}));
    if (World().rank() != 0) continue;
    const std::string out = dir.Join("out");
    EXPECT_THAT(ExportDeepSpeed(ckpt_dir, out, Universal(2)),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr(fmt::format("parameter name '{}'", bad[i]))));
    EXPECT_FALSE(std::filesystem::exists(out));
    ExpectNoTemporaries(dir.path());
    const std::string zero = dir.Join(fmt::format("zero{}", i));
    ZINF_EXPECT_OK(ExportDeepSpeed(ckpt_dir, zero, Options(2)));
  }
  ZINF_ASSERT_OK(World().Barrier());
}

// A "user" that DeepSpeed's model file cannot hold as client state is refused by both layouts,
// naming the key, before anything is written. The deepest user state a checkpoint holds (its
// trainer JSON is read with ParseJson's 64 levels: the root, "user" and 62 more) is exported
// whole; kMaxDeepSpeedUserDepth is a second bound behind that one, which no file reaches.
TEST(DeepSpeedExport, UserStateRefusalsWriteNothing) {
  SharedScratchDir dir("dsexport_user");
  auto nested = [](int depth) {
    nlohmann::json v = 7;
    for (int i = 0; i < depth; ++i)
      v = (i % 2 == 0) ? nlohmann::json::array({v}) : nlohmann::json{{"x", v}};
    return v;
  };
  struct Case {
    nlohmann::json user;
    ErrorCode code;
    std::string text;  // in the error; empty: the export succeeds
  };
  const std::vector<Case> cases = {
      {{{"seed", 1}, {"global_steps", 3}}, ErrorCode::kInvalidArgument, "user key 'global_steps'"},
      {{{"module", nullptr}}, ErrorCode::kInvalidArgument, "user key 'module'"},
      {{{"iteration", 1}}, ErrorCode::kInvalidArgument, "user key 'iteration'"},
      {{{"data", {{"hash", std::uint64_t{1} << 63}}}},
       ErrorCode::kInvalidArgument,
       "user.data.hash is 9223372036854775808, outside int64"},
      {nlohmann::json::array({1, 2}), ErrorCode::kDataLoss, "'user' is [1,2]"},
      {{{"deep", nested(62)}, {"empty", nlohmann::json::object()}},
       ErrorCode::kInvalidArgument,
       ""},
      {nullptr, ErrorCode::kInvalidArgument, ""},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(fmt::format("case {}: {}", i, cases[i].user.dump().substr(0, 80)));
    nlohmann::json trainer = deepspeed_testing::GroupsTrainer(World().size());
    trainer["user"] = cases[i].user;
    const std::string ckpt_dir = dir.Join(fmt::format("ckpt{}", i));
    ZINF_ASSERT_OK(SaveGroupsCheckpoint(World(), dir.path(), ckpt_dir, false, trainer));
    if (World().rank() != 0) continue;
    for (bool universal : {false, true}) {
      SCOPED_TRACE(universal ? "universal" : "zero");
      const std::string out = dir.Join(fmt::format("out{}_{}", i, universal));
      DeepSpeedExportOptions o = universal ? Universal(2) : Options(2);
      if (cases[i].text.empty()) {
        ZINF_ASSERT_OK(ExportDeepSpeed(ckpt_dir, out, o));
        ZINF_ASSERT_OK_AND_ASSIGN(
            TorchFile model, TorchFile::Read(out + "/global_step5/mp_rank_00_model_states.pt"));
        CheckUserKeys(model.root(),
                      cases[i].user.is_null() ? nlohmann::json::object() : cases[i].user);
      } else {
        EXPECT_THAT(ExportDeepSpeed(ckpt_dir, out, o),
                    StatusIs(cases[i].code, HasSubstr(cases[i].text)));
        EXPECT_FALSE(std::filesystem::exists(out));
      }
    }
    ExpectNoTemporaries(dir.path());
  }
  ZINF_ASSERT_OK(World().Barrier());
}

}  // namespace
}  // namespace zinf::interop
