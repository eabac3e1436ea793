#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "schema.h"
#include "zinf/config/config.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/storage/fs.h"
#include "zinf/storage/stripe_map.h"
#include "zinf/storage/swap_store.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::config {
namespace {

using namespace internal;  // NOLINT(google-build-using-namespace): the schema's vocabulary

// What a config file may be: at most 16 MiB, nested at most 32 levels (the schema needs 4).
constexpr std::uint64_t kMaxConfigBytes = 16u << 20;
constexpr JsonLimits kConfigJsonLimits{.max_bytes = kMaxConfigBytes, .max_depth = 32};
// The smallest swap buffer the optimizer swapper's pool makes: one sub-group's bytes rounded up to
// the direct-I/O alignment, at least a 4 KiB page (swapper/src/optimizer_swapper.cc, CreatePool).
constexpr std::uint64_t kMinSwapBufferBytes = 4096;

// A string value with a NUL byte: no path, name or id holds one (the C library would end it
// there, so a path would name another file than the one the config shows).
Status RefuseNul(std::string_view path, const Json& value) {
  const auto& text = value.get_ref<const std::string&>();
  const std::size_t nul = text.find('\0');
  if (nul == std::string::npos) return OkStatus();
  return InvalidArgumentError(
      fmt::format("{}: {} contains a NUL byte (at offset {})", path, Shown(value), nul));
}

std::string_view DisplayPath(std::string_view path) { return path.empty() ? "(top level)" : path; }

// A key written with dots ("zinf.steps", or "checkpoint.dir" inside "zinf") would be a second
// spelling of a nested key, one that could contradict it or slip past a command-line flag
// written into the nested one: refused, naming the nested spelling.
Error DottedKeyError(const std::string& key, std::string_view path) {
  auto quoted = [](std::string_view text) {
    return Json(std::string(text)).dump(-1, ' ', false, Json::error_handler_t::replace);
  };
  std::string nested;
  std::size_t levels = 0;
  for (std::string_view rest = path;; ++levels) {
    const std::size_t dot = rest.find('.');
    nested += fmt::format("{{{}: ", quoted(rest.substr(0, dot)));
    if (dot == std::string_view::npos) break;
    rest.remove_prefix(dot + 1);
  }
  nested += "..." + std::string(levels + 1, '}');
  return InvalidArgumentError(
      fmt::format("{}: the key {} contains a '.'; keys are nested objects, one spelling per "
                  "setting: write {}",
                  path, quoted(key), nested));
}

class Parser {
 public:
  Parser(const ConfigContext& ctx, std::span<const AppKey> app_keys)
      : ctx_(ctx), schema_(app_keys) {}

  Result<Config> Run(std::string_view json_text) {
    if (ctx_.world_size < 1 || ctx_.local_rank < 0 || ctx_.node < 0) {
      return InvalidArgumentError(
          fmt::format("config context: world_size {} must be >= 1, local_rank {} and node {} >= 0",
                      ctx_.world_size, ctx_.local_rank, ctx_.node));
    }
    // Bounded: nesting, duplicate keys (a setting has one spelling) and numbers out of range are
    // errors, never an exception or a stack overflow.
    ZINF_ASSIGN_OR_RETURN(Json root, ParseJson<Json>(json_text, kConfigJsonLimits));
    if (!root.is_object()) return TypeError(DisplayPath(""), "an object", root);
    for (const AppKey& key : schema_.app_keys()) {
      if (key.type != AppKeyType::kSection) config_.app[PointerOf(key.path)] = key.default_value;
    }
    ZINF_RETURN_IF_ERROR(WalkObject(root, ""));
    ZINF_RETURN_IF_ERROR(CheckAliases());
    ZINF_RETURN_IF_ERROR(CheckScheduler());
    ZINF_RETURN_IF_ERROR(CheckOffload());
    ZINF_RETURN_IF_ERROR(CheckOffloadParam());
    ZINF_RETURN_IF_ERROR(CheckPathWeights());
    ZINF_RETURN_IF_ERROR(CheckZinf());
    ZINF_RETURN_IF_ERROR(CheckPrecision());
    ZINF_RETURN_IF_ERROR(ResolveBatchSizes());
    config_.world_size = ctx_.world_size;
    for (const std::string& path : given_) {
      const KeySpec* spec = schema_.Find(path);
      config_.given_keys.emplace_back(
          spec != nullptr && !spec->alias_of.empty() ? spec->alias_of : std::string_view(path));
    }
    std::sort(config_.given_keys.begin(), config_.given_keys.end());
    if (!config_.ignored_keys.empty()) {
      std::sort(config_.ignored_keys.begin(), config_.ignored_keys.end());
      std::vector<std::string_view> keys(config_.ignored_keys.begin(), config_.ignored_keys.end());
      ZINF_LOG_INFO("config: ignored, no effect in zinf: {} (docs/deepspeed-keys.md says why)",
                    JoinQuoted(keys, ""));
    }
    return std::move(config_);
  }

 private:
  bool Given(std::string_view path) const { return given_.contains(path); }

  Status WalkObject(const Json& object, const std::string& prefix) {
    for (const auto& [key, value] : object.items()) {
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      if (key.find('.') != std::string::npos) return DottedKeyError(key, path);
      const KeySpec* spec = schema_.Find(path);
      if (spec == nullptr) return UnknownKey(prefix, key, path);
      if (spec->kind != KeyKind::kImplemented) {
        ZINF_RETURN_IF_ERROR(NotImplemented(*spec, path, value));
        continue;
      }
      given_.insert(path);
      if (std::holds_alternative<std::monostate>(spec->field)) {
        if (!value.is_object()) return TypeError(path, "an object", value);
        ZINF_RETURN_IF_ERROR(WalkObject(value, path));
        continue;
      }
      ZINF_RETURN_IF_ERROR(SetLeaf(*spec, path, value));
    }
    return OkStatus();
  }

  // A DeepSpeed key zinf does not implement: accepted with no effect (its value, whatever it is,
  // is not read further), or refused with what zinf does instead.
  Status NotImplemented(const KeySpec& spec, const std::string& path, const Json& value) {
    if (spec.kind == KeyKind::kIgnored || (spec.harmless != nullptr && spec.harmless(value))) {
      config_.ignored_keys.push_back(path);
      return OkStatus();
    }
    if (spec.harmless != nullptr) {
      return InvalidArgumentError(fmt::format("{}: {} is not supported: {} ({})", path,
                                              Shown(value), spec.why, spec.description));
    }
    return InvalidArgumentError(
        fmt::format("{}: not supported: {} ({})", path, spec.why, spec.description));
  }

  Status UnknownKey(const std::string& prefix, const std::string& key, const std::string& path) {
    const std::vector<std::string_view> keys = schema_.ChildKeys(prefix);
    if (auto nearest = Nearest(key, keys)) {
      return InvalidArgumentError(
          fmt::format("{}: unknown key; did you mean '{}'?", path, *nearest));
    }
    return InvalidArgumentError(fmt::format("{}: unknown key; valid keys in {}: {}", path,
                                            DisplayPath(prefix), JoinQuoted(keys, "'")));
  }

  Status SetLeaf(const KeySpec& spec, const std::string& path, const Json& value) {
    Config& c = config_;
    ZINF_RETURN_IF_ERROR(RefuseAutoPlaceholder(path, value, spec));
    if (auto* f = std::get_if<Accessor<bool>>(&spec.field)) {
      if (value.is_string() && (value == "true" || value == "false")) {
        return InvalidArgumentError(
            fmt::format("{}: expected a boolean, got the string \"{}\"; write {} without quotes",
                        path, value.get<std::string>(), value.get<std::string>()));
      }
      if (!value.is_boolean()) return TypeError(path, "a boolean", value);
      *(*f)(c) = value.get<bool>();
    } else if (auto* fi = std::get_if<Accessor<int>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(const std::int64_t v, ReadInteger(path, value, spec));
      *(*fi)(c) = static_cast<int>(v);
    } else if (auto* fl = std::get_if<Accessor<std::int64_t>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(*(*fl)(c), ReadInteger(path, value, spec));
    } else if (auto* fu = std::get_if<Accessor<std::uint64_t>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(const std::int64_t v, ReadInteger(path, value, spec));
      *(*fu)(c) = static_cast<std::uint64_t>(v);
    } else if (auto* fd = std::get_if<Accessor<double>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(*(*fd)(c), ReadNumber(path, value, spec));
    } else if (auto* fs = std::get_if<Accessor<std::string>>(&spec.field)) {
      if (!value.is_string()) return TypeError(path, "a string", value);
      ZINF_RETURN_IF_ERROR(RefuseNul(path, value));
      *(*fs)(c) = value.get<std::string>();
    } else if (auto* fb = std::get_if<Accessor<std::array<double, 2>>>(&spec.field)) {
      if (!value.is_array() || value.size() != 2) {
        return TypeError(path, "an array of 2 numbers", value);
      }
      for (std::size_t i = 0; i < 2; ++i) {
        ZINF_ASSIGN_OR_RETURN((*(*fb)(c))[i],
                              ReadNumber(fmt::format("{}[{}]", path, i), value[i], spec));
      }
    } else if (auto* fe = std::get_if<EnumAccess>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(const int index, ReadChoice(path, value, spec));
      fe->set(c, index);
    } else if (auto* fz = std::get_if<SizeAccess>(&spec.field)) {
      ZINF_RETURN_IF_ERROR(SetSize(spec, path, value, fz->get(c)));
    } else if (auto* fp = std::get_if<PathListAccess>(&spec.field)) {
      ZINF_RETURN_IF_ERROR(SetPathList(spec, path, value, fp->get(c)));
    } else if (auto* fw = std::get_if<PathWeightsAccess>(&spec.field)) {
      ZINF_RETURN_IF_ERROR(SetPathWeights(path, value, fw->get(c)));
    } else if (auto* fh = std::get_if<HostMemoryBudgetAccess>(&spec.field)) {
      ZINF_RETURN_IF_ERROR(SetHostMemoryBudget(path, value, fh->get(c)));
    } else if (auto* fa = std::get_if<AppAccess>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(c.app[PointerOf(path)], ReadAppValue(*fa->key, spec, path, value));
    }
    return OkStatus();
  }

  // An application key's value, checked as its AppKey says.
  static Result<Json> ReadAppValue(const AppKey& key, const KeySpec& spec, const std::string& path,
                                   const Json& value) {
    switch (key.type) {
      case AppKeyType::kBool:
        if (!value.is_boolean()) return TypeError(path, "a boolean", value);
        return value;
      case AppKeyType::kInteger: {
        ZINF_ASSIGN_OR_RETURN(const std::int64_t v, ReadInteger(path, value, spec));
        return Json(v);
      }
      case AppKeyType::kNumber: {
        ZINF_ASSIGN_OR_RETURN(const double v, ReadNumber(path, value, spec));
        return Json(v);
      }
      case AppKeyType::kString:
        if (!value.is_string()) return TypeError(path, "a string", value);
        ZINF_RETURN_IF_ERROR(RefuseNul(path, value));
        return value;
      case AppKeyType::kChoice: {
        ZINF_ASSIGN_OR_RETURN(const int index, ReadChoice(path, value, spec));
        return Json(key.choices[static_cast<std::size_t>(index)]);
      }
      case AppKeyType::kSection:
        break;
    }
    return InternalError(fmt::format("{}: a section has no value", path));
  }

  Status SetSize(const KeySpec& spec, const std::string& path, const Json& value,
                 std::uint64_t* out) {
    if (value.is_string()) {
      const auto& text = value.get_ref<const std::string&>();
      auto bytes = ParseBytes(text);
      if (!bytes) {
        return InvalidArgumentError(fmt::format(
            "{}: \"{}\" is not a size (an integer number of bytes, or a number with a unit: "
            "\"4096\", \"512M\", \"2GiB\", \"1.5G\")",
            path, text));
      }
      const IntegerBounds bounds = IntegerBoundsOf(spec);  // sizes: min >= 0
      if (*bytes < static_cast<std::uint64_t>(bounds.min) ||
          *bytes > static_cast<std::uint64_t>(bounds.max)) {
        return InvalidArgumentError(fmt::format("{}: {} ({} bytes) is out of range {}", path,
                                                Shown(value), *bytes, FormatRange(spec)));
      }
      *out = *bytes;
      return OkStatus();
    }
    if (!value.is_number()) {
      return TypeError(path, "an integer or a size string (\"2G\")", value);
    }
    ZINF_ASSIGN_OR_RETURN(const std::int64_t v, ReadInteger(path, value, spec));
    *out = static_cast<std::uint64_t>(v);
    return OkStatus();
  }

  // "auto", a byte count > 1 (an integer or a size string) or a fraction in (0, 1].
  static Status SetHostMemoryBudget(const std::string& path, const Json& value,
                                    HostMemoryBudgetConfig* out) {
    constexpr std::string_view kExpected =
        "bytes per node (an integer or a size string: \"8G\"), a fraction in (0, 1] of the "
        "detected budget (0.5), or \"auto\"";
    *out = {};
    if (value.is_string()) {
      const auto& text = value.get_ref<const std::string&>();
      if (text == "auto") return OkStatus();
      Result<std::uint64_t> bytes = ParseBytes(text);
      if (!bytes || *bytes == 0) {
        return InvalidArgumentError(fmt::format("{}: {} is not a positive size; expected {}", path,
                                                Shown(value), kExpected));
      }
      out->bytes = *bytes;
      return OkStatus();
    }
    if (value.is_number_unsigned() || value.is_number_integer()) {
      if (value.is_number_integer() && value.get<std::int64_t>() <= 0) {
        return InvalidArgumentError(
            fmt::format("{}: {} is not positive; expected {}", path, Shown(value), kExpected));
      }
      const auto v = value.get<std::uint64_t>();
      if (v == 1) {
        out->fraction = 1.0;  // the whole detected budget, not one byte
      } else {
        out->bytes = v;
      }
      return OkStatus();
    }
    if (!value.is_number()) return TypeError(path, kExpected, value);
    const double v = value.get<double>();
    if (!std::isfinite(v) || !(v > 0) || v > 1) {
      return InvalidArgumentError(fmt::format("{}: {} is not a fraction in (0, 1]; expected {}",
                                              path, Shown(value), kExpected));
    }
    out->fraction = v;
    return OkStatus();
  }

  Status SetPathList(const KeySpec& spec, const std::string& path, const Json& value,
                     std::vector<std::string>* out) {
    constexpr std::string_view kExpected = "a string or a list of strings";
    out->clear();
    if (value.is_string()) {
      ZINF_RETURN_IF_ERROR(RefuseNul(path, value));
      out->push_back(value.get<std::string>());
    } else if (value.is_array()) {
      if (value.empty()) {
        return InvalidArgumentError(
            fmt::format("{}: empty list; give at least one directory", path));
      }
      for (std::size_t i = 0; i < value.size(); ++i) {
        const std::string element = fmt::format("{}[{}]", path, i);
        if (!value[i].is_string()) return TypeError(element, "a string", value[i]);
        ZINF_RETURN_IF_ERROR(RefuseAutoPlaceholder(element, value[i], spec));
        ZINF_RETURN_IF_ERROR(RefuseNul(element, value[i]));
        out->push_back(value[i].get<std::string>());
      }
    } else {
      return TypeError(path, kExpected, value);
    }
    return OkStatus();
  }

  // "probe", or a list of positive finite numbers that the swap store can turn into weights
  // (storage::StripeMap::FromRatios). The count is checked against nvme_path later.
  static Status SetPathWeights(const std::string& path, const Json& value, PathWeightsConfig* out) {
    constexpr std::string_view kExpected =
        "a list of positive numbers (one per nvme_path) or \"probe\"";
    *out = {};
    if (value.is_string()) {
      if (value.get_ref<const std::string&>() != "probe") {
        return InvalidArgumentError(fmt::format("{}: {} is not {}", path, Shown(value), kExpected));
      }
      out->probe = true;
      return OkStatus();
    }
    if (!value.is_array()) return TypeError(path, kExpected, value);
    if (value.empty()) {
      return InvalidArgumentError(fmt::format("{}: empty list; expected {}", path, kExpected));
    }
    for (std::size_t i = 0; i < value.size(); ++i) {
      const std::string element = fmt::format("{}[{}]", path, i);
      if (!value[i].is_number()) return TypeError(element, "a positive number", value[i]);
      const double weight = value[i].get<double>();
      if (!std::isfinite(weight) || !(weight > 0)) {
        return InvalidArgumentError(
            fmt::format("{}: {} is not a positive finite number (a path's relative bandwidth)",
                        element, Shown(value[i])));
      }
      out->weights.push_back(weight);
    }
    Result<storage::StripeMap> map = storage::StripeMap::FromRatios(out->weights);
    if (!map) return std::move(map).error().WithContext(path + ": ");
    return OkStatus();
  }

  Status CheckPathWeights() {
    const PathWeightsConfig& w = config_.zinf.nvme_path_weights;
    const std::size_t paths = config_.zero_optimization.offload_optimizer.nvme_path.size();
    if (w.weights.empty() || w.weights.size() == paths) return OkStatus();
    return InvalidArgumentError(fmt::format(
        "zinf.nvme_path_weights: {} weight{} for {} zero_optimization.offload_optimizer.nvme_path "
        "entr{}; give one weight per path (or \"probe\")",
        w.weights.size(), w.weights.size() == 1 ? "" : "s", paths, paths == 1 ? "y" : "ies"));
  }

  Status CheckAliases() {
    for (const KeySpec& spec : schema_.specs()) {
      if (spec.alias_of.empty() || !Given(spec.path)) continue;
      if (Given(spec.alias_of)) {
        return InvalidArgumentError(fmt::format(
            "{}: old name of {}; give only one of them (both are set)", spec.path, spec.alias_of));
      }
      ZINF_LOG_WARN("config: {} is the old name of {}; please rename it", spec.path, spec.alias_of);
    }
    return OkStatus();
  }

  Status CheckScheduler() {
    SchedulerConfig& s = config_.scheduler;
    if (Given("scheduler") && !Given("scheduler.type")) {
      return InvalidArgumentError(
          fmt::format("scheduler.type: required in a scheduler block "
                      "(one of {})",
                      JoinQuoted(kNamedSchedulers, "\"")));
    }
    const unsigned bit = SchedulerBit(s.type);
    for (const KeySpec& spec : schema_.specs()) {
      if (spec.scheduler_types == 0 || !Given(spec.path) || (spec.scheduler_types & bit) != 0) {
        continue;
      }
      std::vector<std::string_view> valid;
      for (const KeySpec& other : schema_.specs()) {
        if (ParentOf(other.path) == "scheduler.params" && (other.scheduler_types & bit) != 0) {
          valid.push_back(LastComponent(other.path));
        }
      }
      return InvalidArgumentError(
          fmt::format("{}: not a parameter of scheduler {} (its "
                      "parameters: {})",
                      spec.path, SchedulerTypeName(s.type), JoinQuoted(valid, "")));
    }
    for (const KeySpec& spec : schema_.specs()) {
      if (spec.required && (spec.scheduler_types & bit) != 0 && !Given(spec.path)) {
        return InvalidArgumentError(
            fmt::format("{}: required by scheduler {}", spec.path, SchedulerTypeName(s.type)));
      }
    }
    if (s.type == SchedulerType::kWarmupDecayLR || s.type == SchedulerType::kWarmupCosineLR) {
      const std::int64_t warmup = std::max<std::int64_t>(2, s.warmup_num_steps);
      if (s.type == SchedulerType::kWarmupCosineLR && s.total_num_steps <= warmup) {
        // DeepSpeed divides by total - warmup: equal values divide by zero.
        return InvalidArgumentError(fmt::format(
            "scheduler.params.total_num_steps: {} must be greater than warmup_num_steps {} "
            "(WarmupCosineLR decays over the steps after the warmup)",
            s.total_num_steps, warmup));
      }
      if (s.total_num_steps < warmup) {
        ZINF_LOG_WARN(
            "config: scheduler.params.total_num_steps {} is less than "
            "warmup_num_steps {}",
            s.total_num_steps, warmup);
      }
    }
    if (s.type == SchedulerType::kOneCycle) {
      // DeepSpeed's default of the second half: the first.
      if (!Given("scheduler.params.cycle_second_step_size")) {
        s.cycle_second_step_size = s.cycle_first_step_size;
      }
      if (s.cycle_momentum && s.cycle_min_mom > s.cycle_max_mom) {
        ZINF_LOG_WARN("config: scheduler.params.cycle_min_mom {} > cycle_max_mom {}",
                      s.cycle_min_mom, s.cycle_max_mom);
      }
    }
    if (s.type == SchedulerType::kWarmupLR || s.type == SchedulerType::kWarmupDecayLR) {
      // DeepSpeed >= 0.17.2: without warmup_max_lr the warmup ends at the optimizer's lr (each
      // parameter group's own).
      if (!Given("scheduler.params.warmup_max_lr")) {
        s.warmup_max_lr = config_.optimizer.lr;
        s.warmup_to_group_lr = true;
      }
      if (s.warmup_min_lr > s.warmup_max_lr) {
        ZINF_LOG_WARN(
            "config: scheduler.params.warmup_min_lr {} > warmup_max_lr {}: the warmup "
            "lowers the learning rate",
            s.warmup_min_lr, s.warmup_max_lr);
      }
    }
    return OkStatus();
  }

  static Result<std::string> ExpandPlaceholders(const std::string& path, const std::string& text,
                                                const ConfigContext& ctx) {
    std::string out;
    std::size_t pos = 0;
    while (pos < text.size()) {
      const char ch = text[pos];
      if (ch == '}') {
        return InvalidArgumentError(fmt::format("{}: unmatched '}}' in \"{}\"", path, text));
      }
      if (ch != '{') {
        out += ch;
        ++pos;
        continue;
      }
      const std::size_t close = text.find('}', pos);
      if (close == std::string::npos) {
        return InvalidArgumentError(
            fmt::format("{}: unterminated placeholder in \"{}\"", path, text));
      }
      const std::string_view name = std::string_view(text).substr(pos + 1, close - pos - 1);
      if (name == "local_rank") {
        out += std::to_string(ctx.local_rank);
      } else if (name == "node") {
        out += std::to_string(ctx.node);
      } else {
        return InvalidArgumentError(fmt::format(
            "{}: unknown placeholder '{{{}}}' in \"{}\" (known: {{local_rank}}, {{node}})", path,
            name, text));
      }
      pos = close + 1;
    }
    return out;
  }

  Status CheckOffload() {
    OffloadOptimizerConfig& o = config_.zero_optimization.offload_optimizer;
    constexpr std::string_view kPath = "zero_optimization.offload_optimizer.nvme_path";
    o.resolved_nvme_paths.clear();
    for (std::size_t i = 0; i < o.nvme_path.size(); ++i) {
      const std::string element =
          o.nvme_path.size() > 1 ? fmt::format("{}[{}]", kPath, i) : std::string(kPath);
      if (o.nvme_path[i].empty()) {
        return InvalidArgumentError(fmt::format("{}: empty path", element));
      }
      ZINF_ASSIGN_OR_RETURN(std::string resolved,
                            ExpandPlaceholders(element, o.nvme_path[i], ctx_));
      if (std::find(o.resolved_nvme_paths.begin(), o.resolved_nvme_paths.end(), resolved) !=
          o.resolved_nvme_paths.end()) {
        return InvalidArgumentError(fmt::format("{}: \"{}\" is listed twice", element, resolved));
      }
      o.resolved_nvme_paths.push_back(std::move(resolved));
    }
    if (o.device == OffloadDevice::kNvme && o.nvme_path.empty()) {
      return InvalidArgumentError(
          fmt::format("{}: required when offload_optimizer.device is \"nvme\"", kPath));
    }
    // CpuAdam has amsgrad, but the swap store keeps three tensors per sub-group, not the fourth
    // (max_exp_avg_sq) it needs, and neither does the checkpoint: refused here rather than
    // failing the first step.
    if (o.device != OffloadDevice::kNone && config_.optimizer.amsgrad) {
      return InvalidArgumentError(fmt::format(
          "optimizer.params.amsgrad: true is not supported with offload_optimizer.device "
          "\"{}\" (the optimizer state and checkpoints keep no max_exp_avg_sq); set it to false",
          OffloadDeviceName(o.device)));
    }
    return OkStatus();
  }

  // offload_param.device nvme reads each shard from the fp32 master weights in the optimizer's
  // swap store, so it needs partitioned parameters (stage 3) and that store, and uses no
  // directory of its own. With another device nvme_path has no effect (accepted, as DeepSpeed
  // does).
  Status CheckOffloadParam() {
    const ZeroConfig& z = config_.zero_optimization;
    const OffloadParamConfig& p = z.offload_param;
    if (p.device != OffloadDevice::kNvme) return OkStatus();
    constexpr std::string_view kDevice = "zero_optimization.offload_param.device";
    if (z.stage != 3) {
      return InvalidArgumentError(fmt::format(
          "{}: \"nvme\" needs zero_optimization.stage 3, not {} (parameters are partitioned only "
          "at stage 3); set stage 3, or give device \"cpu\"",
          kDevice, z.stage));
    }
    if (z.offload_optimizer.device != OffloadDevice::kNvme) {
      return InvalidArgumentError(fmt::format(
          "{}: \"nvme\" needs zero_optimization.offload_optimizer.device \"nvme\", not \"{}\" "
          "(each rank's shard of the parameters is read from the fp32 master weights in the "
          "optimizer's swap store); put the optimizer state on nvme, or give device \"cpu\"",
          kDevice, OffloadDeviceName(z.offload_optimizer.device)));
    }
    // DeepSpeed's configs often give the parameters a directory of their own. zinf keeps no
    // second copy of them on disk, so such a path is accepted, named once, and never written.
    constexpr std::string_view kPath = "zero_optimization.offload_param.nvme_path";
    const std::vector<std::string>& optimizer_paths = z.offload_optimizer.nvme_path;
    std::vector<std::string_view> unused;
    for (const std::string& path : p.nvme_path) {
      if (std::find(optimizer_paths.begin(), optimizer_paths.end(), path) ==
          optimizer_paths.end()) {
        unused.push_back(path);
      }
    }
    if (!unused.empty()) {
      const std::vector<std::string_view> paths(optimizer_paths.begin(), optimizer_paths.end());
      ZINF_LOG_INFO(
          "config: {} {} not used: the parameters are read from the fp32 master weights in the "
          "optimizer's swap store ({}), nothing is written there",
          kPath, JoinQuoted(unused, "\""), JoinQuoted(paths, "\""));
    }
    return OkStatus();
  }

  Status CheckZinf() {
    const std::string& job_id = config_.zinf.job_id;
    // The swap store's rule, checked when the config is loaded rather than when the store opens.
    if (!job_id.empty()) {
      ZINF_RETURN_IF_ERROR(Annotate(storage::ValidateJobId(job_id), "zinf.job_id: "));
    }
    ZINF_RETURN_IF_ERROR(CheckPinnedBudget());
    const CheckpointConfig& checkpoint = config_.zinf.checkpoint;
    if ((checkpoint.load == "latest" || checkpoint.load == "auto") && checkpoint.dir.empty()) {
      return InvalidArgumentError(fmt::format(
          "zinf.checkpoint.load: \"{}\" resumes from <dir>/latest, but zinf.checkpoint.dir is "
          "not set",
          checkpoint.load));
    }
    return OkStatus();
  }

  // With the state on NVMe the pool holds BuffersPerSubGroup swap buffers at least, each of at
  // least kMinSwapBufferBytes however small the sub-groups: a smaller budget (a size string "3"
  // is 3 bytes, as the integer 3) is refused by every run, so it is refused here. A budget above
  // this floor can still be too small for the model's largest sub-group: the swapper says so
  // when it sizes the pool (ResourceExhausted, with the bytes it needs). Device "cpu" keeps
  // everything in memory and uses no budget.
  Status CheckPinnedBudget() const {
    const std::uint64_t budget = config_.zinf.pinned_budget_bytes;
    if (budget == 0 || config_.zero_optimization.offload_optimizer.device != OffloadDevice::kNvme) {
      return OkStatus();
    }
    const swapper::StateFormat format = config_.zinf.optimizer_state;
    const std::uint64_t buffers = swapper::OptimizerSwapper::BuffersPerSubGroup(format);
    const std::uint64_t floor = buffers * kMinSwapBufferBytes;
    if (budget >= floor) return OkStatus();
    return InvalidArgumentError(fmt::format(
        "zinf.pinned_budget_bytes: {} bytes cannot hold the swap buffers of a step with {} state "
        "({} buffers of at least {} bytes each, {} bytes, more for sub-groups above {} "
        "elements); give at least {}, or 0 for offload_optimizer.buffer_count buffers of the "
        "largest sub-group",
        budget, swapper::StateFormatName(format), buffers, kMinSwapBufferBytes, floor,
        kMinSwapBufferBytes / sizeof(float), floor));
  }

  Status CheckPrecision() {
    if (config_.fp16.enabled && config_.bf16) {
      return InvalidArgumentError(
          "fp16.enabled: fp16 and bf16 are both enabled; enable at most one (as DeepSpeed)");
    }
    return OkStatus();
  }

  // DeepSpeed's _set_batch_related_parameters + _batch_assertion, with exact divisibility.
  Status ResolveBatchSizes() {
    Config& c = config_;
    const std::int64_t world = ctx_.world_size;
    const bool has_batch = Given("train_batch_size");
    const bool has_micro = Given("train_micro_batch_size_per_gpu");
    const bool has_gas = Given("gradient_accumulation_steps");
    std::int64_t& batch = c.train_batch_size;
    std::int64_t& micro = c.train_micro_batch_size_per_gpu;
    std::int64_t& gas = c.gradient_accumulation_steps;
    if (has_batch && has_micro && has_gas) {
      if (batch != micro * gas * world) {
        return InvalidArgumentError(
            fmt::format("train_batch_size: {} != train_micro_batch_size_per_gpu {} * "
                        "gradient_accumulation_steps {} * world_size {} = {}",
                        batch, micro, gas, world, micro * gas * world));
      }
    } else if (has_batch && has_micro) {
      if (batch % (micro * world) != 0) {
        return InvalidArgumentError(fmt::format(
            "train_batch_size: {} is not divisible by train_micro_batch_size_per_gpu {} * "
            "world_size {} = {}, so gradient_accumulation_steps cannot be derived",
            batch, micro, world, micro * world));
      }
      gas = batch / (micro * world);
    } else if (has_batch && has_gas) {
      if (batch % (gas * world) != 0) {
        return InvalidArgumentError(
            fmt::format("train_batch_size: {} is not divisible by gradient_accumulation_steps {} * "
                        "world_size {} = {}, so train_micro_batch_size_per_gpu cannot be derived",
                        batch, gas, world, gas * world));
      }
      micro = batch / (gas * world);
    } else if (has_micro && has_gas) {
      batch = micro * gas * world;
    } else if (has_batch) {
      if (batch % world != 0) {
        return InvalidArgumentError(
            fmt::format("train_batch_size: {} is not divisible by world_size {}, so "
                        "train_micro_batch_size_per_gpu cannot be derived",
                        batch, world));
      }
      gas = 1;
      micro = batch / world;
    } else if (has_micro) {
      gas = 1;
      batch = micro * world;
    } else {
      return InvalidArgumentError(
          "train_batch_size: either train_batch_size or train_micro_batch_size_per_gpu must be "
          "given (DeepSpeed's rule)");
    }
    if (batch > static_cast<std::int64_t>(kMaxInt32)) {
      return InvalidArgumentError(
          fmt::format("train_batch_size: the derived value {} is out of range [1, {}]", batch,
                      static_cast<std::int64_t>(kMaxInt32)));
    }
    return OkStatus();
  }

  const ConfigContext& ctx_;
  SchemaView schema_;
  Config config_;
  std::set<std::string, std::less<>> given_;  // every key (and section) the file sets
};

}  // namespace

Result<Config> ParseConfig(std::string_view json_text, const ConfigContext& ctx,
                           std::span<const AppKey> app_keys) {
  return Parser(ctx, app_keys).Run(json_text);
}

Result<std::string> ReadConfigFile(const std::string& path) {
  // The path is the user's own: a link is followed, but a FIFO or device is refused, never read.
  return Annotate(storage::ReadSmallFile(path, kMaxConfigBytes, storage::Follow::kYes), "config: ");
}

Result<Config> LoadConfigFile(const std::string& path, const ConfigContext& ctx,
                              std::span<const AppKey> app_keys) {
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadConfigFile(path));
  return Annotate(ParseConfig(text, ctx, app_keys), fmt::format("config {}: ", path));
}

Status CheckEngineConfig(const Config& config) {
  if (config.zero_optimization.offload_optimizer.device == OffloadDevice::kNone) {
    return InvalidArgumentError(
        "zero_optimization.offload_optimizer.device: \"none\" (also the default when it is not "
        "given): zinf steps the optimizer on the CPU; set it to \"cpu\" (the state in host "
        "memory) or \"nvme\" (with a nvme_path)");
  }
  return OkStatus();
}

ConfigContext ContextOf(const comm::Communicator& world) {
  return ConfigContext{.world_size = world.size(),
                       .local_rank = world.topology().local_rank,
                       .node = world.topology().node};
}

Result<Config> LoadConfig(const comm::Communicator& world, const std::string& path,
                          std::span<const AppKey> app_keys) {
  return AgreeOnConfig(world, LoadConfigFile(path, ContextOf(world), app_keys));
}

Result<Config> LoadConfigText(const comm::Communicator& world, std::string_view json_text,
                              std::string_view source, std::span<const AppKey> app_keys) {
  return AgreeOnConfig(world, Annotate(ParseConfig(json_text, ContextOf(world), app_keys),
                                       fmt::format("config {}: ", source)));
}

}  // namespace zinf::config
