// The config as text: --help, the effective config, its hash and the job id.
#include <algorithm>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "config_schema.h"
#include "zinf/core/log.h"
#include "zinf/engine/config.h"
#include "zinf/storage/checksum.h"

namespace zinf::engine {

using namespace config_internal;  // NOLINT(google-build-using-namespace): the schema's vocabulary

std::string DescribeConfigKeys(std::span<const AppKey> app_keys) {
  const SchemaView schema(app_keys);
  Config defaults;
  for (const AppKey& key : app_keys) {
    if (key.type != AppKeyType::kSection) defaults.app[PointerOf(key.path)] = key.default_value;
  }
  const Json canonical = CanonicalJson(defaults);
  std::string out =
      "config keys (DeepSpeed names and defaults where DeepSpeed has the key; unknown keys are "
      "errors):\n";
  std::string rejected;
  for (const KeySpec& spec : schema.specs()) {
    if (!spec.unsupported.empty()) {
      rejected += fmt::format("  {}{}{}\n", spec.path, spec.description.empty() ? "" : ": ",
                              spec.description);
      continue;
    }
    std::string line = fmt::format("{} ({}", spec.path, TypeText(spec));
    if (!std::holds_alternative<std::monostate>(spec.field)) {
      std::string default_text(spec.default_text);
      if (default_text.empty()) {
        Config with_scheduler;  // scheduler params print under their own type
        with_scheduler.scheduler.type = SchedulerType::kWarmupCosineLR;
        if (spec.scheduler_types != 0 && (spec.scheduler_types & kWarmupCosineLRBit) == 0) {
          with_scheduler.scheduler.type = SchedulerType::kWarmupLR;
        }
        const Json source = spec.scheduler_types != 0 ? CanonicalJson(with_scheduler) : canonical;
        const Json::json_pointer ptr = PointerOf(spec.path);
        default_text = source.contains(ptr) ? source.at(ptr).dump() : "none";
      }
      line += fmt::format(", default {}", default_text);
      if (spec.range.min != -kInf || spec.range.max != kInf) {
        line += fmt::format(", range {}", FormatRange(spec.range, IsIntegerKind(spec.field)));
      }
      if (spec.multiple_of != 0) line += fmt::format(", a multiple of {}", spec.multiple_of);
      if (spec.scheduler_types != 0 && spec.path != "scheduler.type") {
        std::vector<std::string_view> types;
        for (SchedulerType t : {SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR,
                                SchedulerType::kWarmupCosineLR}) {
          if ((spec.scheduler_types & SchedulerBit(t)) != 0) types.push_back(SchedulerTypeName(t));
        }
        line += fmt::format(", for {}", JoinQuoted(types, ""));
      }
    }
    out += line + ")\n    " + std::string(spec.description) + "\n";
  }
  out += "DeepSpeed keys zinf rejects (remove them):\n" + rejected;
  return out;
}

std::string EffectiveConfigJson(const Config& config) { return CanonicalJson(config).dump(2); }

std::uint64_t ConfigHash(const Config& config) {
  const std::string text = CanonicalJson(config).dump();
  return storage::Checksum64(std::as_bytes(std::span(text.data(), text.size())));
}

std::string EffectiveJobId(const Config& config, const partition::ParamLayout& layout) {
  if (!config.zinf.job_id.empty()) return config.zinf.job_id;
  // Only what identifies the job: a resumed run (other steps, --resume, checkpoint cadence,
  // learning rate, ...) must find the store its killed predecessor left, to reclaim it.
  Json identity = Json::object();
  identity["checkpoint_dir"] = config.zinf.checkpoint.dir;
  identity["layout"] = layout.ToJsonString();
  identity["world_size"] = config.world_size;
  const std::string text = identity.dump(-1, ' ', false, Json::error_handler_t::replace);
  // ChecksumToHex gives "0x" + 16 digits.
  return "cfg" + storage::ChecksumToHex(
                     storage::Checksum64(std::as_bytes(std::span(text.data(), text.size()))))
                     .substr(2, 12);
}

Status CheckSameConfigOnAllRanks(const comm::Communicator& comm, const Config& config) {
  const std::uint64_t mine = ConfigHash(config);
  std::vector<std::uint64_t> hashes(static_cast<std::size_t>(comm.size()));
  ZINF_RETURN_IF_ERROR(Annotate(
      comm.Allgather<std::uint64_t>(std::span<const std::uint64_t>(&mine, 1), std::span(hashes)),
      "config check: "));
  for (std::size_t r = 1; r < hashes.size(); ++r) {
    if (hashes[r] != hashes[0]) {
      return InvalidArgumentError(fmt::format(
          "rank {} loaded a different config (hash {}, rank 0 has {}): every rank must read the "
          "same file with the same world size",
          r, storage::ChecksumToHex(hashes[r]), storage::ChecksumToHex(hashes[0])));
    }
  }
  return OkStatus();
}

void LogEffectiveConfig(const Config& config) {
  ZINF_LOG_INFO("effective config (world size {}, config hash {}):\n{}", config.world_size,
                storage::ChecksumToHex(ConfigHash(config)), EffectiveConfigJson(config));
}

}  // namespace zinf::engine
