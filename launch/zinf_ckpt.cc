// zinf-ckpt: inspect, verify and export zinf checkpoints, serially (no mpirun needed).
//
//   zinf-ckpt ls PATH                       PATH: a step-<N>.h5 file or a checkpoint directory
//   zinf-ckpt verify PATH                   recomputes every chunk checksum
//   zinf-ckpt export PATH --out FILE [--format h5|safetensors]
//
// Exit status: 0 on success; 1 when the checkpoint is bad (verify: the first bad chunk is
// printed); 2 on a usage error.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/partition/layout.h"
#include "zinf/swapper/checkpoint.h"

namespace {

using zinf::FormatBytes;
using zinf::swapper::CheckpointInfo;

// A live progress line on a TTY, nothing otherwise.
zinf::swapper::CheckpointProgressFn Progress(const char* what) {
  if (isatty(STDERR_FILENO) != 1) return {};
  return [what](std::uint64_t done, std::uint64_t total) {
    static std::uint64_t last = 0;
    if (done != total && done - last < (64ull << 20)) return;
    last = done;
    std::fprintf(stderr, "\r%s: %s / %s\033[K", what, FormatBytes(done).c_str(),
                 FormatBytes(total).c_str());
    if (done == total) std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  };
}

int Fail(const zinf::Error& error) {
  std::fprintf(stderr, "zinf-ckpt: %s\n", error.ToString().c_str());
  return 1;
}

int List(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    static const std::regex kName(R"(step-(\d+)\.h5(\.partial)?)");
    std::vector<std::pair<long long, std::string>> files;
    for (const auto& e : std::filesystem::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      std::smatch m;
      if (std::regex_match(name, m, kName)) files.emplace_back(std::stoll(m[1].str()), name);
    }
    std::sort(files.begin(), files.end());
    std::printf("directory %s: %zu checkpoint file(s)\n", path.c_str(), files.size());
    for (const auto& [step, name] : files) {
      std::printf("  %-28s %12s%s\n", name.c_str(),
                  FormatBytes(std::filesystem::file_size(path + "/" + name, ec)).c_str(),
                  name.ends_with(".partial") ? "  (incomplete)" : "");
    }
  }
  zinf::Result<CheckpointInfo> info = zinf::swapper::ReadCheckpointInfo(path);
  if (!info) return Fail(info.error());
  const zinf::partition::ParamLayout& layout = *info->layout;
  std::printf("checkpoint %s\n", info->path.c_str());
  std::printf("  format_version %lld, step %lld, saved on %lld rank(s), created %s\n",
              static_cast<long long>(info->format_version), static_cast<long long>(info->step),
              static_cast<long long>(info->world_size), info->created.c_str());
  std::printf("  optimizer %s\n", info->optimizer.dump().c_str());
  std::printf("  parameters %zu, total_numel %llu, sub_group_size %lld\n", layout.num_params(),
              static_cast<unsigned long long>(info->total_numel),
              static_cast<long long>(info->sub_group_size));
  std::printf("  state 3 x %s (fp32, exp_avg, exp_avg_sq), file %s\n",
              FormatBytes(info->total_numel * 4).c_str(),
              FormatBytes(info->file_size_bytes).c_str());
  std::printf(
      "  checksums %s, %llu chunk(s) of %llu elements per state (not verified; run "
      "`zinf-ckpt verify`)\n",
      info->checksum_algorithm.c_str(), static_cast<unsigned long long>(info->num_chunks),
      static_cast<unsigned long long>(info->chunk_numel));
  std::printf("  trainer %s\n", info->trainer.dump().c_str());
  std::printf("  %-40s %-20s %14s %14s\n", "name", "shape", "numel", "flat_offset");
  for (const zinf::partition::ParamInfo& p : layout.params()) {
    std::printf("  %-40s %-20s %14llu %14llu\n", p.name.c_str(),
                zinf::partition::FormatShape(p.shape).c_str(),
                static_cast<unsigned long long>(p.numel),
                static_cast<unsigned long long>(p.flat_offset));
  }
  return 0;
}

int Verify(const std::string& path) {
  zinf::Result<std::string> file = zinf::swapper::ResolveCheckpointPath(path);
  if (!file) return Fail(file.error());
  zinf::Status s = zinf::swapper::VerifyCheckpoint(*file, Progress("verify"));
  if (!s) {
    std::printf("%s: BAD\n", file->c_str());
    return Fail(s.error());
  }
  std::printf("%s: OK (every chunk checksum matches)\n", file->c_str());
  return 0;
}

int Export(const std::string& path, const std::string& out, const std::string& format) {
  const zinf::swapper::ExportFormat f = format == "safetensors"
                                            ? zinf::swapper::ExportFormat::kSafetensors
                                            : zinf::swapper::ExportFormat::kHdf5;
  zinf::Status s = zinf::swapper::ExportCheckpoint(path, out, f, Progress("export"));
  if (!s) return Fail(s.error());
  std::printf("wrote %s (%s)\n", out.c_str(), format.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zinf-ckpt: list, verify and export zinf checkpoints (serial, no MPI needed)"};
  app.require_subcommand(1);
  std::string path, out, format = "h5";
  CLI::App* ls = app.add_subcommand("ls", "step, world size, parameters, sizes, checksums");
  ls->add_option("PATH", path, "a step-<N>.h5 file or a checkpoint directory")->required();
  CLI::App* verify = app.add_subcommand("verify", "recompute every checksum; exit 1 if bad");
  verify->add_option("PATH", path, "a step-<N>.h5 file or a checkpoint directory")->required();
  CLI::App* exp =
      app.add_subcommand("export", "consolidated fp32 weights per parameter (zero_to_fp32)");
  exp->add_option("PATH", path, "a step-<N>.h5 file or a checkpoint directory")->required();
  exp->add_option("--out", out, "output file")->required();
  exp->add_option("--format", format, "h5 or safetensors")
      ->check(CLI::IsMember({"h5", "safetensors"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (*ls) return List(path);
  if (*verify) return Verify(path);
  return Export(path, out, format);
}
