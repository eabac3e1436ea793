// zinf-ckpt: inspect, verify, export and import zinf checkpoints, serially (no mpirun needed).
//
//   zinf-ckpt ls PATH                       PATH: a step-<N>.h5 file or a checkpoint directory
//   zinf-ckpt verify PATH                   checks what a resume checks (engine/trainer_state.h)
//   zinf-ckpt export PATH --out FILE [--format h5|safetensors] [--moments] [--force]
//   zinf-ckpt export PATH --format deepspeed --out DIR [--world-size W] [--stage 1|2] [--tag T]
//                                           DeepSpeed's ZeRO 1/2 checkpoint layout for W ranks
//                                           (interop/deepspeed_export.h): DIR/latest, DIR/<tag>/
//   zinf-ckpt export PATH --format deepspeed-universal --out DIR [--world-size W] [--stage 1|2]
//                    [--tag T]              DeepSpeed's universal checkpoint layout (what its
//                                           ds_to_universal makes of the above):
//                                           DIR/latest_universal, DIR/<tag>/zero/<name>/*.pt
//   zinf-ckpt import-deepspeed DIR --out FILE [--force]
//                                           a DeepSpeed ZeRO 1/2/3 or universal checkpoint (DIR:
//                                           its save directory, a tag or universal folder) as
//                                           one zinf checkpoint file that resumes on any number
//                                           of ranks
//                                           (interop/deepspeed_import.h)
//
// Exit status: 0 on success; 1 when the checkpoint is bad (verify: the first problem is
// printed) or cannot be read, or export's --out is refused (an existing file without --force;
// anything but a regular file, /dev/null included: nothing is written), or import-deepspeed
// refuses its input or --out (nothing is written); 2 on a usage error.
// Everything read from a file is treated as hostile: sizes are range-checked before use, strings
// are escaped before they are printed.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/engine/trainer_state.h"
#include "zinf/interop/deepspeed_export.h"
#include "zinf/interop/deepspeed_import.h"
#include "zinf/partition/layout.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fs.h"

namespace {

using zinf::FormatBytes;
using zinf::checkpoint::CheckpointInfo;

// A live progress line on a TTY, nothing otherwise.
zinf::checkpoint::CheckpointProgressFn Progress(const char* what) {
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

// Text from a file or the command line, safe to print on a terminal.
std::string Shown(std::string_view text) { return zinf::EscapeForTerminal(text); }

int Fail(const zinf::Error& error) {
  std::fprintf(stderr, "zinf-ckpt: %s\n", Shown(error.ToString()).c_str());
  return 1;
}

// The checkpoint files of a directory: names the commit protocol makes (step-<N>.h5 and its
// .partial), in step order. At most kMaxEntries entries are looked at; sizes come from lstat, so
// a link is shown as a link and never followed.
void ListDirectory(const std::string& path) {
  constexpr std::size_t kMaxEntries = 1 << 20;
  zinf::Result<zinf::storage::UniqueFd> dir = zinf::storage::OpenDirectory(path);
  if (!dir) return;
  zinf::Result<zinf::storage::DirectoryListing> listing =
      zinf::storage::ListDirectory(dir->get(), path, kMaxEntries);
  if (!listing) return;
  struct File {
    std::int64_t step;
    bool partial;
    std::string name;
  };
  std::vector<File> files;
  const bool truncated = listing->truncated;
  for (const std::string& name : listing->names) {
    if (auto step = zinf::checkpoint::ParseCheckpointFileName(name)) {
      files.push_back({*step, false, name});
    } else if (auto partial = zinf::checkpoint::ParseCheckpointFileName(name, ".partial")) {
      files.push_back({*partial, true, name});
    }
  }
  std::sort(files.begin(), files.end(), [](const File& a, const File& b) {
    return std::tie(a.step, a.partial) < std::tie(b.step, b.partial);
  });
  std::printf("directory %s: %zu checkpoint file(s)%s\n", Shown(path).c_str(), files.size(),
              truncated ? " (more than 1Mi entries: only the first were listed)" : "");
  for (const File& f : files) {
    struct stat st {};
    const bool have = zinf::storage::Env::Default().StatAt(dir->get(), f.name.c_str(), &st,
                                                           AT_SYMLINK_NOFOLLOW) == 0;
    const char* note = !have                  ? "  (vanished)"
                       : S_ISLNK(st.st_mode)  ? "  (a symbolic link: not a checkpoint)"
                       : !S_ISREG(st.st_mode) ? "  (not a regular file)"
                       : f.partial            ? "  (incomplete)"
                                              : "";
    std::printf("  %-28s %12s%s\n", f.name.c_str(),
                have ? FormatBytes(static_cast<std::uint64_t>(st.st_size)).c_str() : "-", note);
  }
}

int List(const std::string& path) {
  struct stat st {};
  if (zinf::storage::Env::Default().StatAt(AT_FDCWD, path.c_str(), &st, 0) == 0 &&
      S_ISDIR(st.st_mode)) {
    ListDirectory(path);
  }
  zinf::Result<CheckpointInfo> info = zinf::checkpoint::ReadCheckpointInfo(path);
  if (!info) return Fail(info.error());
  const zinf::partition::ParamLayout& layout = *info->layout;
  std::printf("checkpoint %s\n", Shown(info->path).c_str());
  std::printf("  format_version %lld, step %lld, saved on %lld rank(s), created %s\n",
              static_cast<long long>(info->format_version), static_cast<long long>(info->step),
              static_cast<long long>(info->world_size), Shown(info->created).c_str());
  std::printf("  optimizer %s\n", zinf::DumpJsonForDisplay(info->optimizer).c_str());
  std::printf("  parameters %zu, total_numel %llu, sub_group_size %lld\n", layout.num_params(),
              static_cast<unsigned long long>(info->total_numel),
              static_cast<long long>(info->sub_group_size));
  if (info->state_format == zinf::swapper::StateFormat::kQ8) {
    std::printf(
        "  state q8: fp32 %s, exp_avg and exp_avg_sq as 8-bit codes 2 x %s, %llu blocks (%llu "
        "segments) of scales; file %s\n",
        FormatBytes(info->total_numel * 4).c_str(), FormatBytes(info->total_numel).c_str(),
        static_cast<unsigned long long>(info->num_blocks),
        static_cast<unsigned long long>(info->num_segments),
        FormatBytes(info->file_size_bytes).c_str());
  } else {
    std::printf("  state fp32: 3 x %s (fp32, exp_avg, exp_avg_sq), file %s\n",
                FormatBytes(info->total_numel * 4).c_str(),
                FormatBytes(info->file_size_bytes).c_str());
  }
  std::printf(
      "  checksums %s, %llu chunk(s) of %llu elements per state (not verified; run "
      "`zinf-ckpt verify`)\n",
      Shown(info->checksum_algorithm).c_str(), static_cast<unsigned long long>(info->num_chunks),
      static_cast<unsigned long long>(info->chunk_numel));
  std::printf("  trainer %s\n", zinf::DumpJsonForDisplay(info->trainer).c_str());
  std::printf("  %-40s %-20s %14s %14s\n", "name", "shape", "numel", "flat_offset");
  for (const zinf::partition::ParamInfo& p : layout.params()) {
    std::printf("  %-40s %-20s %14llu %14llu\n", Shown(p.name).c_str(),
                zinf::partition::FormatShape(p.shape).c_str(),
                static_cast<unsigned long long>(p.numel),
                static_cast<unsigned long long>(p.flat_offset));
  }
  return 0;
}

int Verify(const std::string& path) {
  zinf::Result<std::string> file = zinf::checkpoint::ResolveCheckpointPath(path);
  if (!file) return Fail(file.error());
  zinf::Status s = zinf::engine::VerifyResumable(*file, Progress("verify"));
  if (!s) {
    std::printf("%s: BAD\n", Shown(*file).c_str());
    return Fail(s.error());
  }
  std::printf(
      "%s: OK (structure, ranges, trainer state, q8 tables and every chunk checksum: a resume "
      "restores it)\n",
      Shown(*file).c_str());
  return 0;
}

int Export(const std::string& path, const std::string& out, const std::string& format, bool moments,
           bool force) {
  const zinf::checkpoint::ExportFormat f = format == "safetensors"
                                               ? zinf::checkpoint::ExportFormat::kSafetensors
                                               : zinf::checkpoint::ExportFormat::kHdf5;
  zinf::Status s = zinf::checkpoint::ExportCheckpoint(
      path, out, f, Progress("export"), moments,
      force ? zinf::storage::Overwrite::kRegularFile : zinf::storage::Overwrite::kNo);
  if (!s) {
    const int rc = Fail(s.error());
    if (s.error().code() == zinf::ErrorCode::kAlreadyExists) {
      std::fprintf(stderr, "zinf-ckpt: export --force replaces an existing regular file\n");
    }
    return rc;
  }
  std::printf("wrote %s (%s)\n", Shown(out).c_str(), format.c_str());
  return 0;
}

// The DeepSpeed layout: the trainer state is checked as a resume checks it before anything is
// written (engine::ReadTrainerState); every chunk is verified as it is streamed.
int ExportDeepSpeed(const std::string& path, const std::string& out, int world_size, int stage,
                    const std::string& tag, bool universal) {
  zinf::interop::DeepSpeedExportOptions options;
  options.world_size = world_size;
  options.stage = stage;
  options.tag = tag;
  options.universal = universal;
  options.progress = Progress("export");
  options.check_info = [](const CheckpointInfo& info) -> zinf::Status {
    ZINF_RETURN_IF_ERROR(zinf::engine::ReadTrainerState(info));
    return zinf::OkStatus();
  };
  zinf::Status s = zinf::interop::ExportDeepSpeed(path, out, options);
  if (!s) return Fail(s.error());
  if (universal) {
    std::printf("wrote %s (deepspeed-universal: ZeRO stage %d, recorded for %d rank(s))\n",
                Shown(out).c_str(), stage, world_size);
  } else {
    std::printf("wrote %s (deepspeed: ZeRO stage %d layout for %d rank(s))\n", Shown(out).c_str(),
                stage, world_size);
  }
  return 0;
}

// A DeepSpeed checkpoint as a zinf checkpoint: the complete temporary file must pass what
// `verify` checks (engine::VerifyResumable) before it is renamed to `out`.
int ImportDeepSpeed(const std::string& dir, const std::string& out, bool force) {
  zinf::interop::DeepSpeedImportOptions options;
  options.overwrite =
      force ? zinf::storage::Overwrite::kRegularFile : zinf::storage::Overwrite::kNo;
  options.progress = Progress("import");
  options.check = [](const std::string& temp_path) {
    return zinf::engine::VerifyResumable(temp_path);
  };
  zinf::Result<zinf::interop::DeepSpeedImportResult> r =
      zinf::interop::ImportDeepSpeed(dir, out, options);
  if (!r) {
    const int rc = Fail(r.error());
    if (r.error().code() == zinf::ErrorCode::kAlreadyExists) {
      std::fprintf(stderr,
                   "zinf-ckpt: import-deepspeed --force replaces an existing regular file\n");
    }
    return rc;
  }
  for (const std::string& key : r->client_state_skipped) {
    std::fprintf(stderr,
                 "zinf-ckpt: warning: client state key '%s' not imported (a value JSON cannot "
                 "hold, e.g. a tensor)\n",
                 Shown(key).c_str());
  }
  std::printf("wrote %s (deepspeed%s ZeRO stage %d, %llu rank(s), step %lld, %llu params)\n",
              Shown(out).c_str(), r->universal ? " universal," : "", r->stage,
              static_cast<unsigned long long>(r->world_size), static_cast<long long>(r->step),
              static_cast<unsigned long long>(r->num_params));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "zinf-ckpt: list, verify, export and import zinf checkpoints (serial, no MPI needed)"};
  app.require_subcommand(1);
  std::string path, out, format = "h5", tag;
  bool moments = false, force = false;
  int world_size = 1, stage = 2;
  CLI::App* ls = app.add_subcommand("ls", "step, world size, parameters, sizes, checksums");
  ls->add_option("PATH", path, "a step-<N>.h5 file or a checkpoint directory")->required();
  CLI::App* verify = app.add_subcommand(
      "verify",
      "check what a resume checks: the structure, every attribute's range, the layout, the "
      "trainer state (step, world size, schedule, loss scaler: against the file's own config), "
      "the q8 tables and scales, and every chunk's checksum; OK means a resume with a matching "
      "model and config restores the file; exit 1 if bad");
  verify->add_option("PATH", path, "a step-<N>.h5 file or a checkpoint directory")->required();
  CLI::App* exp = app.add_subcommand(
      "export",
      "consolidated fp32 weights per parameter (zero_to_fp32); written to a temporary file "
      "renamed to --out when complete, so a failure leaves a previous output as it was; an "
      "output that is the checkpoint, its `latest` or a step-<N>.h5 name of its directory is "
      "refused. --format deepspeed writes DeepSpeed's ZeRO stage 1/2 checkpoint directory "
      "instead (--out DIR/latest and DIR/<tag>/*.pt for --world-size ranks; fp32 moments, a q8 "
      "checkpoint's decoded), which DeepSpeed's zero_to_fp32 and ds_to_universal read; "
      "--format deepspeed-universal writes DeepSpeed's universal checkpoint (--out "
      "DIR/latest_universal and DIR/<tag>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt), "
      "what ds_to_universal makes of the former. Both keep the trainer state's user keys as "
      "top-level keys of <tag>/mp_rank_00_model_states.pt (DeepSpeed's client_state)");
  exp->add_option("PATH", path, "a step-<N>.h5 file or a checkpoint directory")->required();
  exp->add_option("--out", out,
                  "output file: a new name, or with --force an existing regular file (replaced "
                  "whole); a symbolic link, directory, device (/dev/null too), FIFO or socket "
                  "is refused before anything is written (exit 1). --format "
                  "deepspeed[-universal]: a new or empty directory, filled through a temporary "
                  "directory beside it renamed when complete (nothing is left on failure)")
      ->required();
  exp->add_flag("--force", force, "replace an existing regular file at --out");
  exp->add_option("--format", format, "h5, safetensors, deepspeed or deepspeed-universal")
      ->check(CLI::IsMember({"h5", "safetensors", "deepspeed", "deepspeed-universal"}));
  CLI::Option* world_opt =
      exp->add_option("--world-size", world_size,
                      "deepspeed: data-parallel ranks of the layout, 1..4096 (default 1); "
                      "deepspeed-universal: recorded only (partition_count, dp_world_size)")
          ->check(CLI::Range(1, zinf::interop::kMaxDeepSpeedExportWorldSize));
  CLI::Option* stage_opt =
      exp->add_option("--stage", stage,
                      "deepspeed[-universal]: ZeRO stage recorded, 1 or 2 (default 2)")
          ->check(CLI::IsMember({1, 2}));
  CLI::Option* tag_opt = exp->add_option(
      "--tag", tag,
      "deepspeed[-universal]: the checkpoint folder under --out (default global_step<step>)");
  exp->add_flag("--moments", moments,
                "also Adam's moments as fp32 tensors exp_avg/<name> and exp_avg_sq/<name> (a q8 "
                "checkpoint's decoded)");
  std::string import_dir, import_out;
  bool import_force = false;
  CLI::App* import_ds = app.add_subcommand(
      "import-deepspeed",
      "a DeepSpeed checkpoint (ZeRO stage 1, 2 or 3, or DeepSpeed's universal layout: its save "
      "directory holding `latest` or `latest_universal`, a tag directory or a universal folder) "
      "as one zinf checkpoint file, fp32 weights and Adam moments bitwise, with "
      "the step, lr scheduler position, fp16 loss scaler, param groups and the client state "
      "(JSON-representable keys; each other key is named in a warning); it restores on any "
      "number of ranks. The .pt files are read without running code (a pickle naming anything "
      "but tensors and DeepSpeed's own classes is refused). Written to a temporary file beside "
      "--out, checked as `verify` checks it, and renamed when complete: on any error (exit 1) "
      "nothing is written");
  import_ds->add_option("DIR", import_dir, "the DeepSpeed checkpoint directory")->required();
  import_ds
      ->add_option("--out", import_out,
                   "the zinf checkpoint file: a new name, or with --force an existing regular "
                   "file (replaced whole); anything else there is refused (exit 1)")
      ->required();
  import_ds->add_flag("--force", import_force, "replace an existing regular file at --out");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (*exp) {
    const bool deepspeed = format == "deepspeed" || format == "deepspeed-universal";
    auto usage = [](const char* message) {
      std::fprintf(stderr, "zinf-ckpt export: %s\n", message);
      return 2;
    };
    if (deepspeed && (moments || force)) {
      return usage(
          "--moments and --force do not apply to --format deepspeed[-universal] (it always "
          "writes the moments, into a new or empty --out directory)");
    }
    if (!deepspeed && (world_opt->count() + stage_opt->count() + tag_opt->count()) > 0) {
      return usage(
          "--world-size, --stage and --tag apply only to --format deepspeed and "
          "deepspeed-universal");
    }
  }
  // Every failure is an Error; should an exception escape anyway, it is a message, not a crash.
  try {
    if (*ls) return List(path);
    if (*verify) return Verify(path);
    if (*import_ds) return ImportDeepSpeed(import_dir, import_out, import_force);
    if (format == "deepspeed" || format == "deepspeed-universal") {
      return ExportDeepSpeed(path, out, world_size, stage, tag, format == "deepspeed-universal");
    }
    return Export(path, out, format, moments, force);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zinf-ckpt: internal error: %s\n", Shown(e.what()).c_str());
  }
  return 1;
}
