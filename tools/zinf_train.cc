// zinf-train: data-parallel training with the Adam state swapped to node-local NVMe, run under
// mpirun (or launch/zinf-run); one rank runs without mpirun. See tools/train/trainer.h for the
// step and docs/tools.md ("zinf-train") for the flags and exit codes.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "train/train_config.h"
#include "train/trainer.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/core/log.h"
#include "zinf/core/status.h"
#include "zinf/config/config.h"

namespace {

// Exit codes (docs/tools.md, "zinf-train", "Exit codes").
constexpr int kExitFailure = 1;  // any failure but the two below
// A bad command line or config: InvalidArgument, and every failure to load the config (its file
// missing or unreadable included), so that --check-config exits 0 or 2 as its help says.
constexpr int kExitUsage = 2;

std::vector<std::string> SplitCommas(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    out.push_back(text.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// The agreed error, identical on every rank: code and message, without the source location
// (that differs between the failing rank and the others).
int Fail(const zinf::Error& error) {
  ZINF_LOG_ERROR("zinf-train failed: {}: {}", zinf::ErrorCodeName(error.code()), error.message());
  return error.code() == zinf::ErrorCode::kInvalidArgument ? kExitUsage : kExitFailure;
}

int Main(int argc, char** argv);

}  // namespace

// No exception is expected to reach here (every error is a Status); should one escape anyway, it
// ends the whole job with a message instead of leaving the other ranks in a collective.
int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    ZINF_LOG_ERROR("zinf-train failed: Internal: unexpected exception: {}", e.what());
  } catch (...) {
    ZINF_LOG_ERROR("zinf-train failed: Internal: unexpected exception");
  }
  zinf::comm::MpiSession::AbortJob(kExitFailure);
}

namespace {

int Main(int argc, char** argv) {
  auto session = zinf::comm::MpiSession::Init(&argc, &argv);
  if (!session) {
    std::fprintf(stderr, "zinf-train failed: %s\n", session.error().ToString().c_str());
    return kExitFailure;
  }
  const zinf::comm::Communicator& world = session->world();
  int rc = 0;
  {
    CLI::App app{
        "zinf-train: data-parallel training whose Adam state (fp32 weights, exp_avg, exp_avg_sq) "
        "lives on node-local NVMe, swapped around every step; collective HDF5 checkpoints that "
        "resume on any number of ranks.\n"
        "Run: mpirun -np N zinf-train [--config ds.json] ... (or launch/zinf-run -np N -- "
        "zinf-train ...). Flags override the config's keys. Without --config, a small charlm run "
        "swaps its state under ./zinf-swap.\n"
        "Exit codes: 0 success, 2 bad command line or config (also a config file that cannot "
        "be read), 1 any other failure, 128+signal "
        "when stopped by SIGINT, SIGTERM, SIGUSR1 or SIGUSR2 (after the current step, with a "
        "checkpoint when a checkpoint dir is set). Under mpirun send SIGUSR1 to mpirun: Open "
        "MPI forwards it as it is, while it turns SIGINT/SIGTERM into SIGKILL a second later."};
    app.set_help_flag("-h,--help", "print this help and exit");
    std::string config_path, metrics_path;
    std::optional<std::string> nvme_path;  // split on commas below
    bool help_config = false;
    bool print_key_table = false;
    bool check_config = false;
    // Each flag lands in its override; an unset optional leaves the config's value.
    zinf::train::ConfigOverrides o;
    app.add_option("--config", config_path, "DeepSpeed-style JSON config (see --help-config)");
    app.add_option("--steps", o.steps,
                   "train until global step N (zinf.steps), also after a resume");
    app.add_option("--nvme-path", nvme_path,
                   "swap directories, comma-separated; {local_rank} and {node} are expanded per "
                   "rank (offload_optimizer.nvme_path, and offload_param.nvme_path when the "
                   "config gives one; sets the optimizer's device nvme)");
    app.add_option("--checkpoint-dir", o.checkpoint_dir,
                   "directory of step-<N>.h5 and latest (zinf.checkpoint.dir)");
    app.add_option("--checkpoint-every", o.checkpoint_every,
                   "steps between checkpoints; one is also saved at the last step "
                   "(zinf.checkpoint.every)");
    app.add_option("--keep-last", o.keep_last,
                   "keep only the newest K checkpoints; 0 keeps all (default)");
    app.add_option("--optimizer-state", o.optimizer_state,
                   "fp32 (default) or q8: the moments as 8-bit block-wise quantized codes, half "
                   "the swap bytes per step (zinf.optimizer_state)");
    app.add_option("--resume", o.resume,
                   "latest (<checkpoint-dir>/latest; an error if none), auto (latest if any), or "
                   "a checkpoint file");
    app.add_option("--metrics", metrics_path,
                   "write one JSON object per step to this file (rank 0; appended on resume); "
                   "a regular file or a new name, never a device, FIFO or directory");
    app.add_option("--model", o.model, "charlm (default) or synthetic");
    app.add_option("--hidden", o.hidden, "charlm: hidden width; synthetic: tensors of H x H");
    app.add_option("--layers", o.layers,
                   "charlm: hidden layers; synthetic: number of H x H tensors");
    app.add_option("--data", o.data,
                   "charlm training text: a file or a directory of files (default "
                   "/usr/share/common-licenses)");
    app.add_option("--seed", o.seed, "initialization and data seed (zinf.seed)");
    app.add_flag("--help-config", help_config, "print every config key and exit");
    app.add_flag("--check-config", check_config,
                 "load and check the config with the flags as a run would (collectively, the "
                 "same checks), print the effective config and the keys ignored, and exit: 0 "
                 "when a run would start with it, 2 when not");
    app.add_flag("--print-key-table", print_key_table,
                 "print the table of every DeepSpeed key (implemented, ignored or refused) in "
                 "Markdown, docs/deepspeed-keys.md, and exit");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) {
        if (world.rank() == 0) app.exit(e);
      } else {
        ZINF_LOG_ERROR("zinf-train failed: InvalidArgument: {} (see --help)", e.what());
        rc = kExitUsage;
      }
      (void)session->Finalize();
      return rc;
    }
    if (help_config || print_key_table) {
      if (world.rank() == 0) {
        const std::string text = help_config
                                     ? zinf::config::DescribeConfigKeys(zinf::train::TrainAppKeys())
                                     : zinf::config::DeepSpeedKeyTable();
        std::fputs(text.c_str(), stdout);
      }
      (void)session->Finalize();
      return 0;
    }
    if (nvme_path) o.nvme_path = SplitCommas(*nvme_path);

    zinf::Result<zinf::train::TrainConfig> config =
        zinf::train::BuildTrainConfig(world, config_path, o);
    if (!config) {
      (void)Fail(config.error());
      rc = kExitUsage;
    } else if (check_config) {
      zinf::config::LogEffectiveConfig(*config);
    } else {
      zinf::config::LogEffectiveConfig(*config);
      zinf::Result<zinf::train::TrainSummary> summary = zinf::train::Train(
          world, *config,
          {.metrics_path = metrics_path, .create_nvme_paths = config_path.empty() && !o.nvme_path});
      if (!summary) {
        rc = Fail(summary.error());
      } else if (summary->interrupted) {
        rc = 128 + summary->signal;
      }
    }
  }
  zinf::Status finalized = session->Finalize();
  if (!finalized && rc == 0) {
    ZINF_LOG_ERROR("zinf-train failed: {}", finalized.error().ToString());
    rc = kExitFailure;
  }
  return rc;
}

}  // namespace
