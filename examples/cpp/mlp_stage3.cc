// mlp_stage3: mlp.cc's training program with ZeRO stage 3: zinf holds the weights too
// (docs/library.md).
//
// The same two-layer perceptron (16 -> 64 tanh -> 1), data and optimizer as mlp.cc, but the
// program keeps no copy of the model. It registers each parameter by name and shape with an
// `init` that gives its first values, and the engine partitions it over the ranks. With
// ds_stage3.json (offload_param nvme, max_in_cpu 0) a shard of fc1.weight lives nowhere but in the
// optimizer's fp32 master weights on NVMe; the parameters of at most
// stage3_param_persistence_threshold elements (the biases, and fc2.weight, a single row of 64)
// stay whole on every rank. Each layer's weights are gathered whole (Gather) for the part of the
// pass that reads them and released at the end of the scope; each gradient is handed over
// (GradientReady, which copies it) as soon as the backward pass has produced it.
//
//   mpirun -np 2 ./mlp_stage3 ds_stage3.json 200
//
// Output (rank 0): zinf's log lines every steps_per_print steps, then two summary lines
//   mlp_stage3: steps 1-200 on 2 rank(s), loss 0.412345 -> 0.012345
//   mlp_stage3: 1 of 4 parameter(s) partitioned; Gather: 1200 calls, ...
// The losses are mlp.cc's (the same initial values, data and steps), up to rounding.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
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

// Param::init that copies from values computed in full: a model this small can afford it (a large
// one computes only the elements asked for, which are the rank's own).
zinf::engine::ParamInit CopyOf(std::vector<float> values) {
  return [values = std::move(values)](std::uint64_t offset, std::span<float> out) {
    std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(offset), out.size(), out.begin());
    return zinf::OkStatus();
  };
}

// The model: names and shapes only. Its weights are the engine's, lent by Gather.
struct Mlp {
  // Positions in Params(), for ZeroEngine::GradientReady.
  static constexpr std::size_t kFc1Weight = 0, kFc1Bias = 1, kFc2Weight = 2, kFc2Bias = 3;

  // mlp.cc's initial weights (a fixed seed, the same on every rank), biases zero.
  static std::vector<zinf::engine::Param> Params() {
    std::vector<float> w1(kHidden * kIn), w2(kHidden);
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& w : w1) w = normal(rng) / std::sqrt(static_cast<float>(kIn));
    for (float& w : w2) w = normal(rng) / std::sqrt(static_cast<float>(kHidden));
    return {{.name = "fc1.weight", .shape = {kHidden, kIn}, .init = CopyOf(std::move(w1))},
            {.name = "fc1.bias", .shape = {kHidden}, .init = CopyOf(std::vector<float>(kHidden))},
            {.name = "fc2.weight", .shape = {1, kHidden}, .init = CopyOf(std::move(w2))},
            {.name = "fc2.bias", .shape = {1}, .init = CopyOf(std::vector<float>(1))}};
  }

  // Mean squared error over the batch. Gather is collective: every rank asks for the same
  // parameters in the same order, as every rank runs the same layers. The backward pass hands
  // each gradient over as soon as it is complete, from the output back: the engine reduces it
  // (on its own thread) while the rest of the backward pass runs.
  static zinf::Result<double> ForwardBackward(zinf::engine::ZeroEngine& engine,
                                              const std::vector<float>& x,
                                              const std::vector<float>& y) {
    std::vector<float> h(static_cast<std::size_t>(kBatch) * kHidden), out(kBatch);
    {  // forward: the hidden layer
      ZINF_ASSIGN_OR_RETURN(zinf::engine::Gathered fc1, engine.Gather({"fc1.weight", "fc1.bias"}));
      std::span<const float> w1 = fc1[0], b1 = fc1[1];
      for (int n = 0; n < kBatch; ++n) {
        for (int j = 0; j < kHidden; ++j) {
          float a = b1[j];
          for (int i = 0; i < kIn; ++i) a += w1[j * kIn + i] * x[n * kIn + i];
          h[n * kHidden + j] = std::tanh(a);
        }
      }
    }  // fc1 released: the engine may drop it, or keep it for its next use
    {  // the output layer
      ZINF_ASSIGN_OR_RETURN(zinf::engine::Gathered fc2, engine.Gather({"fc2.weight", "fc2.bias"}));
      for (int n = 0; n < kBatch; ++n) {
        out[n] = fc2[1][0];
        for (int j = 0; j < kHidden; ++j) out[n] += fc2[0][j] * h[n * kHidden + j];
      }
    }
    double loss = 0;
    std::vector<float> d_out(kBatch), d_a(static_cast<std::size_t>(kBatch) * kHidden);
    for (int n = 0; n < kBatch; ++n) {
      const float err = out[n] - y[n];
      loss += 0.5 * err * err / kBatch;
      d_out[n] = err / kBatch;
    }
    {  // backward: the output layer, gathered again for the gradient it passes down
      ZINF_ASSIGN_OR_RETURN(zinf::engine::Gathered fc2, engine.Gather({"fc2.weight", "fc2.bias"}));
      std::vector<float> gw2(kHidden), gb2(1);
      for (int n = 0; n < kBatch; ++n) {
        gb2[0] += d_out[n];
        for (int j = 0; j < kHidden; ++j) {
          const float hj = h[n * kHidden + j];
          gw2[j] += d_out[n] * hj;
          d_a[n * kHidden + j] = d_out[n] * fc2[0][j] * (1 - hj * hj);
        }
      }
      ZINF_RETURN_IF_ERROR(engine.GradientReady(kFc2Bias, gb2));
      ZINF_RETURN_IF_ERROR(engine.GradientReady(kFc2Weight, gw2));
    }
    // The hidden layer's gradient reads no weights (the input x needs no gradient): nothing to
    // gather.
    std::vector<float> gw1(kHidden * kIn), gb1(kHidden);
    for (int n = 0; n < kBatch; ++n) {
      for (int j = 0; j < kHidden; ++j) {
        gb1[j] += d_a[n * kHidden + j];
        for (int i = 0; i < kIn; ++i) gw1[j * kIn + i] += d_a[n * kHidden + j] * x[n * kIn + i];
      }
    }
    ZINF_RETURN_IF_ERROR(engine.GradientReady(kFc1Bias, gb1));
    ZINF_RETURN_IF_ERROR(engine.GradientReady(kFc1Weight, gw1));
    return loss;
  }
};

// mlp.cc's data: x ~ N(0, 1), y = sin(x . a) + 0.5 x_0, a different batch for every (rank, step,
// micro-batch).
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
  ZINF_ASSIGN_OR_RETURN(zinf::config::Config config, zinf::config::LoadConfig(world, config_path));
  zinf::config::LogEffectiveConfig(config);
  // Partitions the parameters and writes their initial values (Param::init, each rank its own
  // elements) into the NVMe store as the fp32 master weights.
  ZINF_ASSIGN_OR_RETURN(auto engine, zinf::engine::ZeroEngine::Create(
                                         world, config, Mlp::Params(),
                                         {.total_steps = last_step, .create_nvme_paths = true}));

  const int gas = static_cast<int>(config.gradient_accumulation_steps);
  double first_loss = 0, loss = 0;
  std::vector<float> x, y;
  for (std::int64_t step = 1; step <= last_step; ++step) {
    double rank_loss = 0;
    for (int micro = 0; micro < gas; ++micro) {
      MakeBatch(world.rank(), step, micro, &x, &y);
      ZINF_ASSIGN_OR_RETURN(double loss_of_batch, Mlp::ForwardBackward(*engine, x, y));
      rank_loss += loss_of_batch / gas;
      if (micro + 1 < gas) ZINF_RETURN_IF_ERROR(engine->AccumulateGradients());
    }
    // No Gathered scope is alive here: Step writes the new weights into the shards.
    ZINF_ASSIGN_OR_RETURN(zinf::engine::StepInfo info, engine->Step(rank_loss));
    if (step == 1) first_loss = info.loss;
    loss = info.loss;
    if (info.stop_requested) break;
  }
  if (world.rank() == 0) {
    // The engine gathers ahead of use once a step has recorded the order of the Gather calls,
    // and serves an ask from what is still gathered (or whole) without an all-gather.
    const zinf::engine::GatherCounters& c = engine->gather_counters();
    std::printf("mlp_stage3: steps 1-%lld on %d rank(s), loss %.6f -> %.6f\n",
                static_cast<long long>(engine->step_count()), world.size(), first_loss, loss);
    std::printf(
        "mlp_stage3: %zu of 4 parameter(s) partitioned; Gather: %llu calls, %llu parameters "
        "asked, %llu all-gathered (%llu ahead of use), %llu served without one, %llu shard "
        "reads from NVMe, at most %llu elements gathered at once\n",
        engine->num_partitioned_params(), static_cast<unsigned long long>(c.calls),
        static_cast<unsigned long long>(c.asked), static_cast<unsigned long long>(c.gathered),
        static_cast<unsigned long long>(c.prefetched), static_cast<unsigned long long>(c.served),
        static_cast<unsigned long long>(c.disk_reads),
        static_cast<unsigned long long>(c.peak_live_elems));
  }
  return engine->Close();
}

}  // namespace

int main(int argc, char** argv) {
  // MPI_THREAD_SERIALIZED: the engine reduces gradients on its own thread during the backward
  // pass (this program makes no MPI call of its own meanwhile).
  auto session = zinf::comm::MpiSession::Init(&argc, &argv, zinf::comm::ThreadLevel::kSerialized);
  if (!session) {
    std::fprintf(stderr, "mlp_stage3: %s\n", session.error().ToString().c_str());
    return 1;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: mpirun -np N %s CONFIG.json LAST_STEP\n", argv[0]);
    return 2;
  }
  char* end = nullptr;
  const long long last_step = std::strtoll(argv[2], &end, 10);
  if (*end != '\0' || last_step < 1) {
    std::fprintf(stderr, "mlp_stage3: LAST_STEP must be a positive integer, not '%s'\n", argv[2]);
    return 2;
  }
  // Every rank gets the same Status from every zinf call, so all of them stop here together.
  zinf::Status trained = Train(session->world(), argv[1], last_step);
  if (!trained) {
    if (session->world().rank() == 0) {
      std::fprintf(stderr, "mlp_stage3: %s\n", trained.error().ToString().c_str());
    }
    return 1;
  }
  return session->Finalize() ? 0 : 1;
}
