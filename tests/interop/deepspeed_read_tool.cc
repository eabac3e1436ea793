// deepspeed_read_tool: the C++ side of tests/interop/deepspeed_read_test.py.
//   deepspeed_read_tool dump DIR   OpenDeepSpeedCheckpoint(DIR), printed as one JSON document:
//     {stage, bf16_optimizer, elastic, universal, world_size, global_steps, skipped_steps,
//      scheduler_last_batch_iteration (null if none), loss_scaler {kind, scale, iteration,
//      last_overflow_iteration, hysteresis, state}, ds_config, optimizer_groups [{saved, lr,
//      betas, eps, weight_decay, options}], shared_params [[alias, owner]], client_state,
//      client_state_skipped [names], params [{name, shape, dtype, numel, group, fp32, exp_avg,
//      exp_avg_sq}]}, the values of each field as the fp32 bits ("8 hex digits") of every
//      element, row-major (ReadParam; read again in ranges of 3 elements, which must agree).
// Exit 0 on success, 1 with the error on stderr, 2 on a usage error.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zinf/core/status.h"
#include "zinf/interop/deepspeed.h"

namespace zinf::interop {
namespace {

Result<nlohmann::json> Dump(const std::string& dir) {
  ZINF_ASSIGN_OR_RETURN(DeepSpeedCheckpoint ckpt, OpenDeepSpeedCheckpoint(dir));
  nlohmann::json out;
  out["stage"] = ckpt.stage();
  out["bf16_optimizer"] = ckpt.bf16_optimizer();
  out["elastic"] = ckpt.elastic();
  out["universal"] = ckpt.universal();
  out["world_size"] = ckpt.world_size();
  out["global_steps"] = ckpt.global_steps();
  out["skipped_steps"] = ckpt.skipped_steps();
  const auto lbi = ckpt.scheduler_last_batch_iteration();
  out["scheduler_last_batch_iteration"] = lbi ? nlohmann::json(*lbi) : nlohmann::json(nullptr);
  const DeepSpeedLossScaler& s = ckpt.loss_scaler();
  out["loss_scaler"] = {{"kind", s.kind == DeepSpeedLossScaler::Kind::kNone     ? "none"
                                 : s.kind == DeepSpeedLossScaler::Kind::kStatic ? "static"
                                                                                : "dynamic"},
                        {"scale", s.scale},
                        {"iteration", s.iteration},
                        {"last_overflow_iteration", s.last_overflow_iteration},
                        {"hysteresis", s.hysteresis},
                        {"state", s.state}};
  out["ds_config"] = ckpt.ds_config();
  out["optimizer_groups"] = nlohmann::json::array();
  for (const DeepSpeedOptimizerGroup& g : ckpt.optimizer_groups()) {
    out["optimizer_groups"].push_back({{"saved", g.saved},
                                       {"lr", g.lr},
                                       {"betas", {g.beta1, g.beta2}},
                                       {"eps", g.eps},
                                       {"weight_decay", g.weight_decay},
                                       {"options", g.options}});
  }
  out["shared_params"] = nlohmann::json::array();
  for (const auto& [alias, owner] : ckpt.shared_params()) {
    out["shared_params"].push_back({alias, owner});
  }
  out["client_state"] = ckpt.client_state();
  out["client_state_skipped"] = ckpt.client_state_skipped();
  out["params"] = nlohmann::json::array();
  std::vector<float> values;
  for (std::size_t i = 0; i < ckpt.params().size(); ++i) {
    const DeepSpeedParam& p = ckpt.params()[i];
    nlohmann::json jp = {{"name", p.name},
                         {"shape", p.shape},
                         {"dtype", p.dtype},
                         {"numel", p.numel},
                         {"group", p.group}};
    values.resize(p.numel);
    for (auto field : {DeepSpeedCheckpoint::Field::kFp32, DeepSpeedCheckpoint::Field::kExpAvg,
                       DeepSpeedCheckpoint::Field::kExpAvgSq}) {
      ZINF_RETURN_IF_ERROR(ckpt.ReadParam(i, field, values));
      // The same values read in ranges of 3 elements (crossing the ranks' partitions), and a
      // range past the end refused.
      std::vector<float> piece(3);
      for (std::uint64_t at = 0; at < p.numel; at += piece.size()) {
        const std::span<float> part =
            std::span(piece).first(std::min<std::uint64_t>(piece.size(), p.numel - at));
        ZINF_RETURN_IF_ERROR(ckpt.ReadParam(i, field, at, part));
        if (std::memcmp(part.data(), values.data() + at, part.size_bytes()) != 0) {
          return InternalError(fmt::format("'{}' {}: ReadParam of [{}, +{}) differs from the "
                                           "whole read",
                                           p.name, DeepSpeedFieldName(field), at, part.size()));
        }
      }
      if (Status past = ckpt.ReadParam(i, field, p.numel, std::span(piece).first(1));
          past || past.error().code() != ErrorCode::kInvalidArgument) {
        return InternalError(fmt::format("'{}': a ReadParam past the end was not refused", p.name));
      }
      nlohmann::json bits = nlohmann::json::array();
      for (float v : values) bits.push_back(fmt::format("{:08x}", std::bit_cast<std::uint32_t>(v)));
      jp[DeepSpeedFieldName(field)] = std::move(bits);
    }
    out["params"].push_back(std::move(jp));
  }
  return out;
}

}  // namespace
}  // namespace zinf::interop

int main(int argc, char** argv) {
  if (argc != 3 || std::string_view(argv[1]) != "dump") {
    std::fprintf(stderr, "usage: %s dump DIR\n", argv[0]);
    return 2;
  }
  auto out = zinf::interop::Dump(argv[2]);
  if (!out) {
    std::fprintf(stderr, "%s\n", out.error().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", out->dump().c_str());
  return 0;
}
