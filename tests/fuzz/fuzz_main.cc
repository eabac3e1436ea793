// zinf_fuzz: a deterministic mutation fuzzer for the two readers of hostile input, the config
// parser and the checkpoint reader. No libFuzzer needed: a seeded RNG mutates a corpus for a
// bounded time, so a run is reproducible from its seed and fits in the test suite (CTest, ASan).
//
//   zinf_fuzz config --corpus DIR [--corpus DIR...] --seconds 20 --seed 1
//   zinf_fuzz checkpoint --seed-file good.h5 [--seed-file ...] --workdir DIR --seconds 30 --seed 1
//
// config: every *.json of the corpus directories is mutated (bytes flipped, inserted, deleted,
// spliced from another input, numbers replaced by extremes, nesting added) and parsed with
// ParseTrainConfig for a few world sizes. Each result must be OK or InvalidArgument.
// checkpoint: each seed file is copied and mutated either byte-wise (HDF5's own structures
// included) or through the HDF5 API (attributes rewritten with extreme numbers, other types, deep
// or malformed JSON, control characters; objects deleted; soft and external links planted; a q8
// scale or a number of the trainer state set to an extreme, with the q8 table checksum
// recomputed so that the range checks behind it are reached), then read with
// ReadCheckpointInfo, VerifyResumable (what `zinf-ckpt verify` and a resume check) and
// ExportCheckpoint. Each must return (any error code), verify OK implies the other two OK, a
// failed export must leave no output and no temporary file, and no single input may take longer
// than --max-input-seconds (a hang is a failure, not a slow input).
//
// A crash, an abort or a sanitizer report fails the run (the test sees the signal). The last
// input is kept in the work directory (last-input.*) so a crash can be reproduced. Prints one
// JSON line of counts on stdout.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <hdf5.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "train/train_config.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/config/config.h"
#include "zinf/engine/trainer_state.h"
#include "zinf/storage/checksum.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string mode;
  std::vector<std::string> corpus;      // config: directories of *.json
  std::vector<std::string> seed_files;  // checkpoint: valid checkpoints
  std::string workdir = "/tmp";
  double seconds = 10;
  double max_input_seconds = 10;
  std::uint64_t seed = 1;
};

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "zinf_fuzz: %s\nusage: zinf_fuzz config --corpus DIR... | checkpoint "
               "--seed-file F... --workdir DIR; [--seconds S] [--max-input-seconds S] [--seed N]\n",
               why);
  std::exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  if (argc < 2) Usage("no mode");
  Flags f;
  f.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) Usage("a flag without its value");
    const std::string v = argv[++i];
    if (a == "--corpus") {
      f.corpus.push_back(v);
    } else if (a == "--seed-file") {
      f.seed_files.push_back(v);
    } else if (a == "--workdir") {
      f.workdir = v;
    } else if (a == "--seconds") {
      f.seconds = std::stod(v);
    } else if (a == "--max-input-seconds") {
      f.max_input_seconds = std::stod(v);
    } else if (a == "--seed") {
      f.seed = std::stoull(v);
    } else {
      Usage("unknown flag");
    }
  }
  return f;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// ---- Byte-level mutations, shared by both modes ----

class Mutator {
 public:
  explicit Mutator(std::uint64_t seed) : rng_(seed) {}

  std::uint64_t Below(std::uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[Below(v.size())];
  }

  // Numbers and fragments that parsers and range checks get wrong.
  std::string Interesting() {
    static const std::vector<std::string> kValues = {
        "0",
        "-1",
        "1e400",
        "-1e400",
        "1e-400",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551616",
        "-9223372036854775808",
        "2147483647",
        "2147483648",
        "4294967296",
        "1.5",
        "0.0",
        "-0",
        "NaN",
        "Infinity",
        "null",
        "true",
        "\"\"",
        "\"\\u0000\"",
        "\"\\u001b[2J\"",
        "[]",
        "{}",
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]"
        "]]]]]]]]]",
        "\"\xff\xfe\"",
        "1e9",
        "65536",
        "\"nvme\"",
        "\"/\"",
        "\"..\""};
    return Pick(kValues);
  }

  std::string MutateBytes(std::string s, const std::vector<std::string>& others) {
    const int rounds = 1 + static_cast<int>(Below(4));
    for (int r = 0; r < rounds; ++r) {
      const std::uint64_t size = s.size();
      switch (Below(9)) {
        case 0:  // flip a bit
          if (size > 0) s[Below(size)] ^= static_cast<char>(1 << Below(8));
          break;
        case 1:  // a random byte
          if (size > 0) s[Below(size)] = static_cast<char>(Below(256));
          break;
        case 2:  // delete a run
          if (size > 0) {
            const std::uint64_t at = Below(size);
            s.erase(at, 1 + Below(std::min<std::uint64_t>(64, size - at)));
          }
          break;
        case 3:  // duplicate a run
          if (size > 0) {
            const std::uint64_t at = Below(size);
            const std::uint64_t n = 1 + Below(std::min<std::uint64_t>(256, size - at));
            s.insert(Below(size + 1), s.substr(at, n));
          }
          break;
        case 4:  // splice a piece of another input
          if (!others.empty()) {
            const std::string& o = Pick(others);
            if (!o.empty()) {
              const std::uint64_t at = Below(o.size());
              s.insert(Below(size + 1),
                       o.substr(at, 1 + Below(std::min<std::uint64_t>(512, o.size() - at))));
            }
          }
          break;
        case 5: {  // replace a number by an extreme one
          const std::uint64_t at = Below(size + 1);
          const std::size_t digit = s.find_first_of("-0123456789", at);
          if (digit != std::string::npos) {
            std::size_t end = s.find_first_not_of("-+.eE0123456789", digit);
            if (end == std::string::npos) end = s.size();
            s.replace(digit, end - digit, Interesting());
          }
          break;
        }
        case 6:  // insert an interesting value
          s.insert(Below(size + 1), Interesting());
          break;
        case 7: {  // nest a value deeper
          const std::uint64_t at = Below(size + 1);
          const std::uint64_t depth = 1 + Below(Chance(0.1) ? 5000 : 40);
          s.insert(at, std::string(depth, Chance(0.5) ? '[' : '{'));
          break;
        }
        case 8:  // truncate
          if (size > 0) s.resize(Below(size));
          break;
      }
    }
    return s;
  }

 private:
  std::mt19937_64 rng_;
};

// ---- config ----

int FuzzConfig(const Flags& flags) {
  std::vector<std::string> inputs;
  for (const std::string& dir : flags.corpus) {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() == ".json") inputs.push_back(ReadAll(entry.path().string()));
    }
  }
  if (inputs.empty()) Usage("no *.json in the corpus directories");
  Mutator m(flags.seed);
  const std::string last = flags.workdir + "/last-input.json";
  std::map<std::string, std::uint64_t> counts;
  const auto deadline = Clock::now() + std::chrono::duration<double>(flags.seconds);
  std::uint64_t iterations = 0;
  while (Clock::now() < deadline) {
    const std::string text =
        m.Chance(0.05) ? m.Pick(inputs) : m.MutateBytes(m.Pick(inputs), inputs);
    WriteAll(last, text);
    const zinf::config::ConfigContext ctx{.world_size = static_cast<int>(1 + m.Below(7)),
                                          .local_rank = static_cast<int>(m.Below(3)),
                                          .node = static_cast<int>(m.Below(3))};
    const auto start = Clock::now();
    zinf::Result<zinf::train::TrainConfig> parsed = zinf::train::ParseTrainConfig(text, ctx);
    zinf::Result<nlohmann::json> json = zinf::ParseJson(text);
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    if (took > flags.max_input_seconds) {
      std::fprintf(stderr, "FAIL: an input took %.1f s to parse (kept in %s)\n", took,
                   last.c_str());
      return 1;
    }
    if (!parsed && parsed.error().code() != zinf::ErrorCode::kInvalidArgument) {
      std::fprintf(stderr,
                   "FAIL: the config parser returned %s, not InvalidArgument (input in %s)\n",
                   zinf::EscapeForTerminal(parsed.error().ToString()).c_str(), last.c_str());
      return 1;
    }
    if (parsed) {
      // What the parser accepts, it prints and reads back the same.
      const std::string effective = zinf::config::EffectiveConfigJson(*parsed);
      zinf::Result<zinf::train::TrainConfig> again = zinf::train::ParseTrainConfig(effective, ctx);
      if (!again || zinf::config::ConfigHash(*again) != zinf::config::ConfigHash(*parsed)) {
        std::fprintf(stderr, "FAIL: an accepted config does not round-trip (input in %s)\n",
                     last.c_str());
        return 1;
      }
    }
    ++counts[parsed ? "accepted" : "rejected"];
    ++counts[json ? "json_ok" : "json_error"];
    ++iterations;
  }
  std::printf(
      "{\"fuzz\": \"config\", \"seed\": %llu, \"iterations\": %llu, \"accepted\": %llu, "
      "\"rejected\": %llu, \"json_ok\": %llu, \"json_error\": %llu, \"corpus\": %zu}\n",
      static_cast<unsigned long long>(flags.seed), static_cast<unsigned long long>(iterations),
      static_cast<unsigned long long>(counts["accepted"]),
      static_cast<unsigned long long>(counts["rejected"]),
      static_cast<unsigned long long>(counts["json_ok"]),
      static_cast<unsigned long long>(counts["json_error"]), inputs.size());
  return 0;
}

// ---- checkpoint ----

// The objects and attributes of a zinf checkpoint, for structure-aware mutations.
const std::vector<std::string> kObjects = {"/state/fp32",
                                           "/state/exp_avg",
                                           "/state/exp_avg_sq",
                                           "/checksum/fp32",
                                           "/checksum/exp_avg",
                                           "/checksum/exp_avg_sq",
                                           "/layout/flat_offset",
                                           "/layout/numel",
                                           "/layout",
                                           "/trainer",
                                           "/state",
                                           "/checksum",
                                           "/state/exp_avg_codes",
                                           "/state/exp_avg_sq_codes",
                                           "/checksum/exp_avg_codes",
                                           "/checksum/exp_avg_sq_codes",
                                           "/q8/map_signed",
                                           "/q8/segment_start",
                                           "/q8/segment_numel",
                                           "/q8/segment_block",
                                           "/q8/exp_avg_scales",
                                           "/checksum/q8",
                                           "/q8"};
const std::vector<std::string> kIntAttributes = {"format_version", "step",           "world_size",
                                                 "total_numel",    "sub_group_size", "chunk_numel"};
const std::vector<std::string> kStringAttributes = {"format", "optimizer", "config", "created",
                                                    "optimizer_state"};

// One API-level mutation of `path` (opened read-write with the raw HDF5 API). Failures are fine:
// the mutation simply does not happen.
void MutateStructure(const std::string& path, const std::string& other_file, Mutator& m) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (file < 0) return;
  auto set_int = [&](const char* object, const std::string& name, std::int64_t value) {
    if (H5Aexists_by_name(file, object, name.c_str(), H5P_DEFAULT) > 0) {
      H5Adelete_by_name(file, object, name.c_str(), H5P_DEFAULT);
    }
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attr = H5Acreate_by_name(file, object, name.c_str(), H5T_STD_I64LE, space,
                                         H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (attr >= 0) {
      H5Awrite(attr, H5T_NATIVE_INT64, &value);
      H5Aclose(attr);
    }
    H5Sclose(space);
  };
  auto set_string = [&](const char* object, const std::string& name, const std::string& value) {
    if (H5Aexists_by_name(file, object, name.c_str(), H5P_DEFAULT) > 0) {
      H5Adelete_by_name(file, object, name.c_str(), H5P_DEFAULT);
    }
    const hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, value.size() + 1);
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attr = H5Acreate_by_name(file, object, name.c_str(), type, space, H5P_DEFAULT,
                                         H5P_DEFAULT, H5P_DEFAULT);
    if (attr >= 0) {
      H5Awrite(attr, type, value.c_str());
      H5Aclose(attr);
    }
    H5Sclose(space);
    H5Tclose(type);
  };
  auto read_string = [&](const char* object, const char* name) -> std::string {
    const hid_t attr = H5Aopen_by_name(file, object, name, H5P_DEFAULT, H5P_DEFAULT);
    if (attr < 0) return "";
    const hid_t type = H5Aget_type(attr);
    std::string out(H5Tget_size(type), '\0');
    H5Aread(attr, type, out.data());
    H5Tclose(type);
    H5Aclose(attr);
    out.resize(std::min(out.find('\0'), out.size()));
    return out;
  };
  static const std::vector<std::int64_t> kExtremes = {
      0,           -1,          1,         2,         3,
      999,         1000,        1001,      1 << 20,   (1LL << 26) + 1,
      1LL << 40,   (1LL << 53), INT64_MAX, INT64_MIN, 2147483647,
      4294967296LL};
  // Dataset `name` (1-D, of T), read whole; empty when it cannot be.
  auto read_dataset = [&]<typename T>(const char* name, hid_t mem_type, std::vector<T>* out) {
    out->clear();
    const hid_t ds = H5Dopen2(file, name, H5P_DEFAULT);
    if (ds < 0) return;
    const hid_t space = H5Dget_space(ds);
    const hssize_t n = H5Sget_simple_extent_npoints(space);
    if (n > 0 && n < (1 << 20)) {
      out->resize(static_cast<std::size_t>(n));
      if (H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out->data()) < 0) out->clear();
    }
    H5Sclose(space);
    H5Dclose(ds);
  };
  auto write_dataset = [&]<typename T>(const char* name, hid_t mem_type, const std::vector<T>& v) {
    const hid_t ds = H5Dopen2(file, name, H5P_DEFAULT);
    if (ds < 0) return;
    H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
  };
  static const std::vector<float> kExtremeScales = {3e38f,
                                                    std::numeric_limits<float>::infinity(),
                                                    std::numeric_limits<float>::quiet_NaN(),
                                                    -1.0f,
                                                    -0.0f,
                                                    std::numeric_limits<float>::denorm_min(),
                                                    0x1p92f,
                                                    0x1.000002p92f,
                                                    std::numeric_limits<float>::max()};
  static const std::vector<nlohmann::json> kExtremeJson = {0,
                                                           -1,
                                                           1,
                                                           11,
                                                           5e-324,
                                                           1e308,
                                                           -0.001,
                                                           18446744073709551615ull,
                                                           INT64_MIN,
                                                           nullptr,
                                                           "10",
                                                           nlohmann::json::array({1, 2}),
                                                           18446744073709551616.0,
                                                           65536.0};
  switch (m.Below(9)) {
    case 0:  // an integer attribute to an extreme
      set_int("/", m.Pick(kIntAttributes), m.Pick(kExtremes));
      break;
    case 1:  // an attribute of the wrong type
      if (m.Chance(0.5)) {
        set_string("/", m.Pick(kIntAttributes), m.Interesting());
      } else {
        set_int("/", m.Pick(kStringAttributes), m.Pick(kExtremes));
      }
      break;
    case 2: {  // a JSON attribute mutated like a config
      const char* object = m.Chance(0.2) ? "/layout" : m.Chance(0.25) ? "/trainer" : "/";
      const std::string name = std::string(object) == "/layout"    ? "json"
                               : std::string(object) == "/trainer" ? "state"
                                                                   : m.Pick(kStringAttributes);
      const std::string text = read_string(object, name.c_str());
      set_string(object, name, m.MutateBytes(text, {text}));
      break;
    }
    case 3:  // an object removed
      H5Ldelete(file, m.Pick(kObjects).c_str(), H5P_DEFAULT);
      break;
    case 4: {  // a soft link in place of an object
      const std::string victim = m.Pick(kObjects);
      if (H5Ldelete(file, victim.c_str(), H5P_DEFAULT) >= 0) {
        H5Lcreate_soft(m.Pick(kObjects).c_str(), file, victim.c_str(), H5P_DEFAULT, H5P_DEFAULT);
      }
      break;
    }
    case 5: {  // an external link in place of an object
      const std::string victim = m.Pick(kObjects);
      if (H5Ldelete(file, victim.c_str(), H5P_DEFAULT) >= 0) {
        H5Lcreate_external(other_file.c_str(), m.Pick(kObjects).c_str(), file, victim.c_str(),
                           H5P_DEFAULT, H5P_DEFAULT);
      }
      break;
    }
    case 6:  // control characters and long text where strings are printed
      set_string("/", "created", std::string("\x1b[2J\r\x07") + std::string(m.Below(100000), 'x'));
      break;
    case 7: {  // a q8 scale to an extreme, the table's checksum recomputed
      const bool exp_avg = m.Chance(0.5);
      const char* name = exp_avg ? "/q8/exp_avg_scales" : "/q8/exp_avg_sq_scales";
      std::vector<float> scales;
      std::vector<std::uint64_t> sums;
      read_dataset(name, H5T_NATIVE_FLOAT, &scales);
      read_dataset("/checksum/q8", H5T_NATIVE_UINT64, &sums);
      if (scales.empty() || sums.size() != 7) break;
      scales[m.Below(scales.size())] = m.Pick(kExtremeScales);
      sums[exp_avg ? 5 : 6] = zinf::storage::Checksum64(std::as_bytes(std::span(scales)));
      write_dataset(name, H5T_NATIVE_FLOAT, scales);
      write_dataset("/checksum/q8", H5T_NATIVE_UINT64, sums);
      break;
    }
    case 8: {  // a number of the trainer state (or of its loss scaler) to an extreme
      zinf::Result<nlohmann::json> state = zinf::ParseJson(read_string("/trainer", "state"));
      if (!state || !state->is_object() || state->empty()) break;
      nlohmann::json* target = &*state;
      if (state->contains("loss_scaler") && (*state)["loss_scaler"].is_object() &&
          !(*state)["loss_scaler"].empty() && m.Chance(0.5)) {
        target = &(*state)["loss_scaler"];
      }
      auto it = target->begin();
      std::advance(it, static_cast<std::ptrdiff_t>(m.Below(target->size())));
      *it = m.Pick(kExtremeJson);
      set_string("/trainer", "state", state->dump());
      break;
    }
  }
  H5Fclose(file);
}

int FuzzCheckpoint(const Flags& flags) {
  if (flags.seed_files.empty()) Usage("no --seed-file");
  std::vector<std::string> seeds;
  for (const std::string& f : flags.seed_files) seeds.push_back(ReadAll(f));
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  Mutator m(flags.seed);
  const std::string input = flags.workdir + "/last-input.h5";
  const std::string other = flags.workdir + "/other.h5";
  const std::string out_dir = flags.workdir + "/out";
  std::filesystem::create_directories(out_dir);
  WriteAll(other, seeds.front());
  std::map<std::string, std::uint64_t> counts;
  const auto deadline = Clock::now() + std::chrono::duration<double>(flags.seconds);
  std::uint64_t iterations = 0;
  while (Clock::now() < deadline) {
    const std::string& seed = m.Pick(seeds);
    if (m.Chance(0.4)) {
      WriteAll(input, m.MutateBytes(seed, seeds));
    } else {
      WriteAll(input, seed);
      const int n = 1 + static_cast<int>(m.Below(3));
      for (int i = 0; i < n; ++i) MutateStructure(input, other, m);
    }
    const auto start = Clock::now();
    zinf::Result<zinf::checkpoint::CheckpointInfo> info =
        zinf::checkpoint::ReadCheckpointInfo(input);
    zinf::Status verified = zinf::engine::VerifyResumable(input);
    const std::string out = out_dir + "/weights.out";
    std::filesystem::remove(out);
    zinf::Status exported = zinf::checkpoint::ExportCheckpoint(
        input, out,
        m.Chance(0.5) ? zinf::checkpoint::ExportFormat::kHdf5
                      : zinf::checkpoint::ExportFormat::kSafetensors);
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    if (took > flags.max_input_seconds) {
      std::fprintf(stderr, "FAIL: one input took %.1f s to read (kept in %s)\n", took,
                   input.c_str());
      return 1;
    }
    if (verified && !info) {
      std::fprintf(stderr,
                   "FAIL: verify said OK where ReadCheckpointInfo failed: %s (input in %s)\n",
                   zinf::EscapeForTerminal(info.error().ToString()).c_str(), input.c_str());
      return 1;
    }
    if (verified && !exported) {
      std::fprintf(stderr, "FAIL: verify said OK, export failed: %s (input in %s)\n",
                   zinf::EscapeForTerminal(exported.error().ToString()).c_str(), input.c_str());
      return 1;
    }
    std::size_t left = 0;
    for (const auto& entry : std::filesystem::directory_iterator(out_dir)) {
      (void)entry;
      ++left;
    }
    if (left != (exported ? 1u : 0u)) {
      std::fprintf(stderr, "FAIL: export %s left %zu file(s) in %s (input in %s)\n",
                   exported ? "succeeded but" : "failed and", left, out_dir.c_str(), input.c_str());
      return 1;
    }
    ++counts[verified ? "verified" : "rejected"];
    ++iterations;
  }
  std::printf(
      "{\"fuzz\": \"checkpoint\", \"seed\": %llu, \"iterations\": %llu, \"verified\": %llu, "
      "\"rejected\": %llu, \"seeds\": %zu}\n",
      static_cast<unsigned long long>(flags.seed), static_cast<unsigned long long>(iterations),
      static_cast<unsigned long long>(counts["verified"]),
      static_cast<unsigned long long>(counts["rejected"]), seeds.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  zinf::SetLogLevel(zinf::LogLevel::kError);
  if (flags.mode == "config") return FuzzConfig(flags);
  if (flags.mode == "checkpoint") return FuzzCheckpoint(flags);
  Usage("mode must be config or checkpoint");
}
