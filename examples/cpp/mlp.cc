// mlp: a complete training program that brings its own model to zinf (docs/library.md).
//
// A two-layer perceptron (16 -> 64 tanh -> 1) learns a fixed "teacher" function from synthetic
// data, data parallel over the ranks of an mpirun job. The program owns the model: its weights
// and gradients are plain vectors, its forward and backward passes are loops below. zinf owns
// the optimizer: each rank's ZeRO partition of the Adam state lives on NVMe (the config's
// nvme_path). The backward pass hands each parameter's gradient over as soon as it is complete
// (GradientReady), so that its reduction overlaps the rest of the pass; every Step then runs the
// swapped Adam step and writes the new weights back into the vectors. Checkpoints resume on any
// number of ranks.
//
//   mpirun -np 2 ./mlp ds.json 200          # train to step 200, checkpoint at the end
//   mpirun -np 3 ./mlp ds.json 300          # with "load": "auto": resume at 200 on 3 ranks
//
// Output (rank 0): zinf's log lines every steps_per_print steps, then one summary line
//   mlp: steps 1-200 on 2 rank(s), loss 0.412345 -> 0.012345, checkpoint <dir>/step-200.h5
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "zinf/comm/mpi_session.h"
#include "zinf/core/status.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"

namespace {

constexpr int kIn = 16;
constexpr int kHidden = 64;
constexpr int kBatch = 32;  // examples per micro-batch per rank

// The model: weights and gradients the program owns, registered with the engine by name.
struct Mlp {
  std::vector<float> w1 = std::vector<float>(kHidden * kIn), b1 = std::vector<float>(kHidden);
  std::vector<float> w2 = std::vector<float>(kHidden), b2 = std::vector<float>(1);
  std::vector<float> gw1 = w1, gb1 = b1, gw2 = w2, gb2 = b2;

  // The same initial weights on every rank (a fixed seed); a resume overwrites them.
  void Init() {
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& w : w1) w = normal(rng) / std::sqrt(static_cast<float>(kIn));
    for (float& w : w2) w = normal(rng) / std::sqrt(static_cast<float>(kHidden));
  }

  // Positions in Params(), for ZeroEngine::GradientReady.
  static constexpr std::size_t kFc1Weight = 0, kFc1Bias = 1, kFc2Weight = 2, kFc2Bias = 3;
  std::vector<zinf::engine::Param> Params() {
    return {{"fc1.weight", {kHidden, kIn}, w1, gw1},
            {"fc1.bias", {kHidden}, b1, gb1},
            {"fc2.weight", {1, kHidden}, w2, gw2},
            {"fc2.bias", {1}, b2, gb2}};
  }

  // Mean squared error over the batch. The backward pass adds the gradient to gw1, gb1, gw2,
  // gb2 layer by layer from the output back, and calls ready(i) as soon as parameter i's gradient
  // is complete, as a framework's backward hook would: the engine reduces it (on its own thread)
  // while the rest of the backward pass runs.
  template <typename Ready>
  zinf::Result<double> ForwardBackward(const std::vector<float>& x, const std::vector<float>& y,
                                       Ready&& ready) {
    std::vector<float> h(static_cast<std::size_t>(kBatch) * kHidden), d_out(kBatch);
    double loss = 0;
    for (int n = 0; n < kBatch; ++n) {  // forward
      const float* xn = &x[static_cast<std::size_t>(n) * kIn];
      float* hn = &h[static_cast<std::size_t>(n) * kHidden];
      float out = b2[0];
      for (int j = 0; j < kHidden; ++j) {
        float a = b1[j];
        for (int i = 0; i < kIn; ++i) a += w1[j * kIn + i] * xn[i];
        hn[j] = std::tanh(a);
        out += w2[j] * hn[j];
      }
      const float err = out - y[n];
      loss += 0.5 * err * err / kBatch;
      d_out[n] = err / kBatch;
    }
    for (int n = 0; n < kBatch; ++n) {  // backward: the output layer
      gb2[0] += d_out[n];
      for (int j = 0; j < kHidden; ++j) gw2[j] += d_out[n] * h[n * kHidden + j];
    }
    ZINF_RETURN_IF_ERROR(ready(kFc2Bias));
    ZINF_RETURN_IF_ERROR(ready(kFc2Weight));
    for (int n = 0; n < kBatch; ++n) {  // the hidden layer
      const float* xn = &x[static_cast<std::size_t>(n) * kIn];
      for (int j = 0; j < kHidden; ++j) {
        const float hj = h[n * kHidden + j];
        const float d_a = d_out[n] * w2[j] * (1 - hj * hj);
        gb1[j] += d_a;
        for (int i = 0; i < kIn; ++i) gw1[j * kIn + i] += d_a * xn[i];
      }
    }
    ZINF_RETURN_IF_ERROR(ready(kFc1Bias));
    ZINF_RETURN_IF_ERROR(ready(kFc1Weight));
    return loss;
  }
};

// The data: x ~ N(0, 1), y = sin(x . a) + 0.5 x_0, a different batch for every (rank, step,
// micro-batch), so that the ranks together see train_batch_size examples per step.
void MakeBatch(int rank, std::int64_t step, int micro, std::vector<float>* x,
               std::vector<float>* y) {
  std::seed_seq seed{rank, static_cast<int>(step), micro};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  x->resize(static_cast<std::size_t>(kBatch) * kIn);
  y->resize(kBatch);
  for (float& v : *x) v = normal(rng);
  for (int n = 0; n < kBatch; ++n) {
    float dot = 0;
    for (int i = 0; i < kIn; ++i) dot += (i % 3 == 0 ? 0.3f : -0.2f) * (*x)[n * kIn + i];
    (*y)[n] = std::sin(dot) + 0.5f * (*x)[n * kIn];
  }
}

zinf::Status Train(const zinf::comm::Communicator& world, const std::string& config_path,
                   std::int64_t last_step) {
  // The DeepSpeed-style config, strict: a misspelled key is an error naming it.
  ZINF_ASSIGN_OR_RETURN(zinf::config::Config config, zinf::config::LoadConfig(world, config_path));
  zinf::config::LogEffectiveConfig(config);

  Mlp model;
  model.Init();
  // Swaps the initial weights into the NVMe store, or restores zinf.checkpoint.load.
  ZINF_ASSIGN_OR_RETURN(auto engine, zinf::engine::ZeroEngine::Create(
                                         world, config, model.Params(),
                                         {.total_steps = last_step, .create_nvme_paths = true}));

  const int gas = static_cast<int>(config.gradient_accumulation_steps);
  const std::int64_t first_step = engine->step_count() + 1;
  double first_loss = 0, loss = 0;
  std::string checkpoint = engine->resumed_from();
  std::vector<float> x, y;
  for (std::int64_t step = first_step; step <= last_step; ++step) {
    double rank_loss = 0;
    for (int micro = 0; micro < gas; ++micro) {
      MakeBatch(world.rank(), step, micro, &x, &y);
      ZINF_ASSIGN_OR_RETURN(double loss_of_batch,
                            model.ForwardBackward(x, y, [&](std::size_t param) {
                              return engine->GradientReady(param);
                            }));
      rank_loss += loss_of_batch / gas;
      // Every micro-batch but the last ends here; Step ends the last.
      if (micro + 1 < gas) ZINF_RETURN_IF_ERROR(engine->AccumulateGradients());
    }
    ZINF_ASSIGN_OR_RETURN(zinf::engine::StepInfo info, engine->Step(rank_loss));
    if (step == first_step) first_loss = info.loss;
    loss = info.loss;
    // Due every zinf.checkpoint.every steps, at total_steps and on a stop signal (when
    // zinf.checkpoint.dir is set).
    if (info.checkpoint_due) {
      ZINF_ASSIGN_OR_RETURN(zinf::engine::SavedCheckpointInfo saved,
                            engine->SaveCheckpoint({{"data_seed", "rank-step-micro"}}));
      checkpoint = saved.path;
    }
    if (info.stop_requested) break;  // SIGUSR1/SIGTERM: saved above, stop cleanly
  }
  if (world.rank() == 0) {
    std::printf("mlp: steps %lld-%lld on %d rank(s), loss %.6f -> %.6f, checkpoint %s\n",
                static_cast<long long>(first_step), static_cast<long long>(engine->step_count()),
                world.size(), first_loss, loss, checkpoint.empty() ? "none" : checkpoint.c_str());
  }
  return engine->Close();
}

}  // namespace

int main(int argc, char** argv) {
  // MPI_THREAD_SERIALIZED: the engine reduces gradients on its own thread during the backward
  // pass (this program makes no MPI call of its own meanwhile).
  auto session = zinf::comm::MpiSession::Init(&argc, &argv, zinf::comm::ThreadLevel::kSerialized);
  if (!session) {
    std::fprintf(stderr, "mlp: %s\n", session.error().ToString().c_str());
    return 1;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: mpirun -np N %s CONFIG.json LAST_STEP\n", argv[0]);
    return 2;
  }
  char* end = nullptr;
  const long long last_step = std::strtoll(argv[2], &end, 10);
  if (*end != '\0' || last_step < 1) {
    std::fprintf(stderr, "mlp: LAST_STEP must be a positive integer, not '%s'\n", argv[2]);
    return 2;
  }
  // Every rank gets the same Status from every zinf call, so all of them stop here together.
  zinf::Status trained = Train(session->world(), argv[1], last_step);
  if (!trained) {
    if (session->world().rank() == 0) {
      std::fprintf(stderr, "mlp: %s\n", trained.error().ToString().c_str());
    }
    return 1;
  }
  return session->Finalize() ? 0 : 1;
}
