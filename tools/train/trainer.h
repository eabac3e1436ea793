// Trainer: zinf-train's training loop, a user of the engine (engine/engine.h) like any other:
// its models (charlm, synthetic) and data are the workload; the ZeRO step, checkpoints, resume,
// stop signals and metrics are the engine's.
//
//   ZINF_ASSIGN_OR_RETURN(TrainConfig config, BuildTrainConfig(world, flags.config_path,
//                                                              flags.overrides));  // collective
//   ZINF_ASSIGN_OR_RETURN(TrainSummary summary, Train(world, config, {.metrics_path = "m.jsonl"}));
//
// One step, on every rank: forward/backward of the rank's micro-batches (BatchId {seed, step - 1,
// micro-batch, rank, world size}) on the working weights the engine keeps up to date, at stage 1
// the gradient accumulated into a flat buffer registered with the engine (handed over after
// every micro-batch with zinf.swap_gradients), then ZeroEngine::Step (reduce-scatter, clipping,
// the learning rate, the swapped Adam step, all-gather); every zinf.checkpoint.every steps, at
// the last step and on a stop signal: ZeroEngine::SaveCheckpoint.
// At zero_optimization.stage 2 the gradients are partitioned: the parameters are registered with
// their weights but without grads buffers, each micro-batch runs Model::ForwardBackwardLayered
// over the working weights and hands each parameter's gradient with GradientReady as the
// backward pass completes it (a layer's at a time), so no rank holds the whole gradient (only a
// layer's, its partition and the engine's buckets in flight); AccumulateGradients ends every
// micro-batch but the last. At stage 3 the model is partitioned too: its parameters are
// registered without buffers (initial shards from Model::InitSlice), and the layered pass reads
// them through the engine's Gather scopes (one layer's at a time, in forward and again in
// backward order). charlm's held-out loss and sample are then skipped (they need the whole
// weights on rank 0). Checkpoints hold the same parameters at every stage, so a run resumes
// across stages and world sizes.
// Determinism: batches are pure functions of their BatchId, the models are deterministic for a
// fixed BLAS thread count (zinf.compute_threads; by default cores / ranks per node) on one kind
// of CPU, and MPI's reductions are deterministic for a fixed world size, so a run that is
// checkpointed and resumed on the same ranks and machines reproduces the uninterrupted run
// bitwise. Other CPU kinds (another OpenBLAS kernel) and other thread counts may differ in the
// last bits; CPU Adam itself gives the same bits on every SIMD path and thread count.
//
// Errors: every error is agreed over the ranks (comm::Communicator::AgreeOnStatus and the
// collective swapper calls), so every rank returns the same Status. A failed step leaves the last
// committed checkpoint as it was.
//
// Thread safety: one call at a time; the engine installs SIGINT/SIGTERM/SIGUSR1/SIGUSR2 handlers
// for the run's duration (stop after the current step, with a checkpoint when a directory is
// set).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "train_config.h"
#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"

namespace zinf::train {

// The built-in configuration used without --config: a small charlm (hidden 512 x 2 layers, 530k
// parameters, 64 examples per rank and step, AdamW 3e-3 after a 20-step warmup, clipping 1.0)
// whose Adam state is swapped (pipelined swapper) under ./zinf-swap.
const char* DefaultConfigJson();

// Collective. Reads `config_path` (or DefaultConfigJson() when empty), applies `overrides`, and
// parses the result for this process (ConfigContext from world's topology) and checks what the
// engine would refuse of it (config::CheckEngineConfig); then checks that all ranks hold the same
// config (CheckSameConfigOnAllRanks). Every rank returns the same Status. zinf-train's run and
// its --check-config both load the config through this one function.
// Errors: InvalidArgument for a bad config or override (the message names the key path, prefixed
// "config <path>: "), the file errors of ReadConfigFile.
Result<TrainConfig> BuildTrainConfig(const comm::Communicator& world,
                                     const std::string& config_path,
                                     const ConfigOverrides& overrides);

struct TrainOptions {
  std::string metrics_path;  // rank 0 writes one JSON object per step; empty: none
  bool progress = true;      // checkpoint progress lines
  // Create missing nvme_path directories (mode 0700, parents included). zinf-train sets it only
  // for the built-in config's ./zinf-swap: a configured path that is missing is an error (an
  // unmounted drive must not silently become a directory on the root file system).
  bool create_nvme_paths = false;
};

struct TrainSummary {
  std::int64_t first_step = 0;  // the first step run (1, or the checkpoint's step + 1)
  std::int64_t last_step = 0;   // the last step run (== first_step - 1 when nothing was left)
  double final_loss = 0;        // the loss of the last step run (NaN when none ran)
  double seconds = 0;           // wall time of the loop
  std::string resumed_from;     // the checkpoint restored, if any
  std::string last_checkpoint;  // the last checkpoint saved, if any
  bool interrupted = false;     // stopped early by a stop signal (after checkpointing)
  int signal = 0;               // the signal that stopped it
};

// Collective over `world`. Runs the training described by `config` (see the top of the file).
// Errors: those of the model and data (NotFound for a missing data file, ...), the swapper
// (ResourceExhausted for too little disk or pool memory, DataLoss for I/O errors), and the
// checkpoint (restore errors name the file and the first mismatch). The same on every rank.
Result<TrainSummary> Train(const comm::Communicator& world, const TrainConfig& config,
                           const TrainOptions& options = {});

}  // namespace zinf::train
