// Private to zinf::config: the config schema (one KeySpec per key: how to read and write it,
// its range, choices and description) and the helpers the parser and the printers share.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/config/config.h"
#include "zinf/core/status.h"

namespace zinf::config::internal {

using Json = nlohmann::ordered_json;

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kMaxInt32 = 2147483647.0;

// ---- Field access: the schema reaches into Config through these. ----

template <auto M, auto... Ms>
constexpr auto& MemberOf(auto& object) {
  if constexpr (sizeof...(Ms) == 0) {
    return object.*M;
  } else {
    return MemberOf<Ms...>(object.*M);
  }
}

template <typename T>
using Accessor = T* (*)(Config&);

// An enum field, read and written as its index into KeySpec::choices.
struct EnumAccess {
  int (*get)(Config&);
  void (*set)(Config&, int);
};
// An unsigned byte count given as an integer or a size string ("2G").
struct SizeAccess {
  std::uint64_t* (*get)(Config&);
};
// One path or a list of paths.
struct PathListAccess {
  std::vector<std::string>* (*get)(Config&);
};
// zinf.nvme_path_weights: a list of positive numbers or "probe".
struct PathWeightsAccess {
  PathWeightsConfig* (*get)(Config&);
};
// zinf.host_memory_budget: "auto", bytes (an integer or a size string) or a fraction in (0, 1].
struct HostMemoryBudgetAccess {
  HostMemoryBudgetConfig* (*get)(Config&);
};
// An application's key (AppKey): its value lives in Config::app at its path.
struct AppAccess {
  const AppKey* key;
};
// std::monostate: a section (a JSON object holding keys).
using Field = std::variant<std::monostate, Accessor<bool>, Accessor<int>, Accessor<std::int64_t>,
                           Accessor<std::uint64_t>, Accessor<double>, Accessor<std::string>,
                           Accessor<std::array<double, 2>>, EnumAccess, SizeAccess, PathListAccess,
                           PathWeightsAccess, HostMemoryBudgetAccess, AppAccess>;

template <auto... Ms>
Field Leaf() {
  using T = std::remove_cvref_t<decltype(MemberOf<Ms...>(std::declval<Config&>()))>;
  if constexpr (std::is_enum_v<T>) {
    return EnumAccess{[](Config& c) { return static_cast<int>(MemberOf<Ms...>(c)); },
                      [](Config& c, int v) { MemberOf<Ms...>(c) = static_cast<T>(v); }};
  } else {
    return Accessor<T>{[](Config& c) { return &MemberOf<Ms...>(c); }};
  }
}
template <auto... Ms>
Field Size() {
  return SizeAccess{[](Config& c) { return &MemberOf<Ms...>(c); }};
}
template <auto... Ms>
Field PathList() {
  return PathListAccess{[](Config& c) { return &MemberOf<Ms...>(c); }};
}
template <auto... Ms>
Field PathWeights() {
  return PathWeightsAccess{[](Config& c) { return &MemberOf<Ms...>(c); }};
}

template <auto... Ms>
Field HostMemoryBudget() {
  return HostMemoryBudgetAccess{[](Config& c) { return &MemberOf<Ms...>(c); }};
}

struct Range {
  double min = -kInf;
  double max = kInf;
  bool min_open = false;  // (min, ...
  bool max_open = false;  // ..., max)
};

constexpr Range AtLeast(double min) { return {.min = min}; }
constexpr Range Between(double min, double max) { return {.min = min, .max = max}; }
constexpr Range Positive() { return {.min = 0, .min_open = true}; }
constexpr Range UnitOpen() { return {.min = 0, .max = 1, .max_open = true}; }

constexpr unsigned SchedulerBit(SchedulerType type) { return 1u << static_cast<int>(type); }
inline constexpr unsigned kWarmupLRBit = SchedulerBit(SchedulerType::kWarmupLR);
inline constexpr unsigned kWarmupDecayLRBit = SchedulerBit(SchedulerType::kWarmupDecayLR);
inline constexpr unsigned kWarmupCosineLRBit = SchedulerBit(SchedulerType::kWarmupCosineLR);
inline constexpr unsigned kOneCycleBit = SchedulerBit(SchedulerType::kOneCycle);
inline constexpr unsigned kLRRangeTestBit = SchedulerBit(SchedulerType::kLRRangeTest);
inline constexpr unsigned kAllSchedulersBits =
    kWarmupLRBit | kWarmupDecayLRBit | kWarmupCosineLRBit | kOneCycleBit | kLRRangeTestBit;
// DeepSpeed's scheduler names, indexed by SchedulerType ("none" for kNone, the absence of the
// block): the one list of them.
inline constexpr std::array<std::string_view, 6> kSchedulerNames = {
    "none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"};
static_assert(kSchedulerNames.size() == static_cast<std::size_t>(SchedulerType::kLRRangeTest) + 1);
// Only the scheduler types a config may name, in the order --help lists them.
inline constexpr std::span<const std::string_view> kNamedSchedulers =
    std::span(kSchedulerNames).subspan(1);
inline constexpr unsigned kWarmupSchedulersBits =
    kWarmupLRBit | kWarmupDecayLRBit | kWarmupCosineLRBit;

// How zinf treats a key: the three kinds of docs/deepspeed-keys.md (DeepSpeedKeyTable()).
enum class KeyKind {
  kImplemented,  // read into Config with DeepSpeed's semantics and default (or zinf's own key)
  kIgnored,      // a DeepSpeed key accepted with no effect: any value, its content not read;
                 // named in the one INFO line "ignored, no effect in zinf: ..."
  kRefused,      // an error that says what zinf does instead
};

// One key of the schema.
struct KeySpec {
  std::string_view path;  // "aio.queue_depth"
  Field field;            // how to read/write the value; monostate: a section
  std::string_view description;
  Range range = {};                                // numbers
  std::span<const std::string_view> choices = {};  // enums: choices[enum value]
  std::uint64_t multiple_of = 0;                   // integers: must be a multiple of this
  std::string_view default_text = {};              // overrides the printed default
  std::string_view alias_of = {};                  // old name of this other key (a WARN)
  unsigned scheduler_types = 0;                    // nonzero: only for these scheduler types
  bool required = false;                           // scheduler params: its types need it given
  bool auto_is_a_value = false;   // a string key whose documented values include "auto"
  bool case_insensitive = false;  // choices: any case (DeepSpeed's optimizer.type); else exact
  KeyKind kind = KeyKind::kImplemented;
  // kIgnored: why the key has no effect in zinf; kRefused: what zinf does instead (the error).
  std::string_view why = {};
  // kRefused: the values that are harmless, so accepted as kIgnored (e.g. "enabled": false),
  // described for the table by harmless_text.
  bool (*harmless)(const Json& value) = nullptr;
  std::string_view harmless_text = {};
};

// The schema: every key the config knows, in the order EffectiveConfigJson prints them.
const std::vector<KeySpec>& Schema();

// The schema plus an application's keys (after them, with sections made for their
// parents), indexed by path. Keeps views into `app_keys`, which must outlive it.
class SchemaView {
 public:
  explicit SchemaView(std::span<const AppKey> app_keys);
  SchemaView(const SchemaView&) = delete;
  SchemaView& operator=(const SchemaView&) = delete;

  const std::vector<KeySpec>& specs() const { return specs_; }
  std::span<const AppKey> app_keys() const { return app_keys_; }
  const KeySpec* Find(std::string_view path) const;
  // The keys a section may hold (for suggestions): its children that are neither old names nor
  // refused DeepSpeed keys.
  std::vector<std::string_view> ChildKeys(std::string_view section) const;

 private:
  std::span<const AppKey> app_keys_;
  std::vector<std::string> section_paths_;  // sections the application's keys need
  std::vector<std::vector<std::string_view>> choice_views_;
  std::vector<KeySpec> specs_;
  std::map<std::string_view, const KeySpec*> index_;
};

// ---- Helpers shared by the parser and the printers ----

std::string_view ParentOf(std::string_view path);
std::string_view LastComponent(std::string_view path);
bool EqualsIgnoreCase(std::string_view a, std::string_view b);
// The candidate closest to `text` (case-insensitive edit distance), if close enough.
std::optional<std::string_view> Nearest(std::string_view text,
                                        std::span<const std::string_view> candidates);
std::string JoinQuoted(std::span<const std::string_view> items, std::string_view quote);
// A JSON value for a message: the value itself, shortened.
std::string Shown(const Json& value);
Error TypeError(std::string_view path, std::string_view expected, const Json& got);
bool IsIntegerKind(const Field& field);
// The values an integer key accepts, inclusive: its Range with open ends moved inward, within
// what its field holds (int: 32 bits; unsigned fields and sizes: from 0; every integer at most
// 2^63 - 1, the largest a JSON integer is read as). Range errors print these bounds, so the
// printed limit is the largest value accepted, never "inf".
struct IntegerBounds {
  std::int64_t min = 0;
  std::int64_t max = 0;
};
IntegerBounds IntegerBoundsOf(const KeySpec& spec);
// "[1, 4096]" (integers: IntegerBoundsOf), "(0, 1)", "[0, inf)" (numbers, whose open upper end
// is exact: no finite number is excluded).
std::string FormatRange(const KeySpec& spec);
bool InRange(double value, const Range& range);
// An integer: a JSON integer, or a float with an integral value (1e9; not -0.0), within the
// range.
Result<std::int64_t> ReadInteger(std::string_view path, const Json& value, const KeySpec& spec);
Result<double> ReadNumber(std::string_view path, const Json& value, const KeySpec& spec);
// The index into spec.choices: exactly one of them (any case where spec.case_insensitive).
Result<int> ReadChoice(std::string_view path, const Json& value, const KeySpec& spec);
// "auto" given where it is not a value of the key (KeySpec::auto_is_a_value, or one of the
// choices): the Hugging Face Trainer's placeholder, which it replaces before DeepSpeed reads the
// config. An error naming `path`, or OK.
Status RefuseAutoPlaceholder(std::string_view path, const Json& value, const KeySpec& spec);
// "integer", "one of Adam, AdamW", ... for --help.
std::string TypeText(const KeySpec& spec);
// "/a/b" for "a.b".
Json::json_pointer PointerOf(std::string_view path);
// The effective config as JSON, in schema order (see EffectiveConfigJson).
Json CanonicalJson(const Config& config);

}  // namespace zinf::config::internal
