// Bounded JSON parsing for text that comes from outside the process: config files, checkpoint
// attributes, layouts. nlohmann::json's own parse() accepts any nesting depth (a document nested
// 400k deep then overflows the stack when it is printed or compared), silently keeps the last of
// duplicate keys, and throws on numbers out of range (1e400). ParseJson never throws and refuses
// all three:
//
//   ZINF_ASSIGN_OR_RETURN(nlohmann::ordered_json root,
//                         ParseJson<nlohmann::ordered_json>(text, {.max_depth = 32}));
//
// Errors (all InvalidArgument):
//   "JSON syntax error at line 3, column 7: ..."          (nlohmann's lexer/parser message)
//   "JSON nesting deeper than 64 levels (at a.b.c...)"
//   "duplicate key 'stage' in zero_optimization: ..."    (a setting has exactly one spelling)
//   "JSON text of 70000000 bytes is larger than 67108864 bytes"
//
// Thread safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zinf/core/status.h"

namespace zinf {

struct JsonLimits {
  std::size_t max_bytes = 64u << 20;  // longer texts are refused before parsing
  int max_depth = 64;                 // objects and arrays nested deeper are refused
  bool reject_duplicate_keys = true;  // a key twice in one object is an error
};

namespace json_internal {

// "a.b.c" for the open objects' current keys (array levels are shown as "[]"), shortened.
std::string DescribePath(const std::vector<std::string>& keys);
// nlohmann's "[json.exception.parse_error.101] parse error at line 1, column 2: ..." without the
// bracketed prefix.
std::string StripExceptionPrefix(std::string_view what);

// SAX handler: builds the DOM through nlohmann's own DOM builder and enforces the limits.
template <typename BasicJson>
class BoundedSax {
 public:
  using number_integer_t = typename BasicJson::number_integer_t;
  using number_unsigned_t = typename BasicJson::number_unsigned_t;
  using number_float_t = typename BasicJson::number_float_t;
  using string_t = typename BasicJson::string_t;
  using binary_t = typename BasicJson::binary_t;

  BoundedSax(BasicJson& root, const JsonLimits& limits)
      : dom_(root, /*allow_exceptions=*/false), limits_(limits) {}

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) { return dom_.number_float(v, s); }
  bool string(string_t& v) { return dom_.string(v); }
  bool binary(binary_t& v) { return dom_.binary(v); }

  bool start_object(std::size_t n) {
    if (!Enter()) return false;
    keys_.emplace_back();
    seen_.emplace_back();
    return dom_.start_object(n);
  }
  bool key(string_t& k) {
    if (limits_.reject_duplicate_keys && !seen_.back().insert(k).second) {
      keys_.back().clear();
      error_ = fmt::format("duplicate key '{}' in {}: a setting may be given only once",
                           Shorten(k), DescribePath(keys_));
      return false;
    }
    keys_.back() = k;
    return dom_.key(k);
  }
  bool end_object() {
    Leave();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) {
    if (!Enter()) return false;
    keys_.emplace_back("[]");
    seen_.emplace_back();
    return dom_.start_array(n);
  }
  bool end_array() {
    Leave();
    return dom_.end_array();
  }
  template <typename Exception>
  bool parse_error(std::size_t, const std::string&, const Exception& e) {
    error_ = "JSON syntax error: " + StripExceptionPrefix(e.what());
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  static std::string Shorten(std::string_view s) {
    return s.size() <= 60 ? std::string(s) : std::string(s.substr(0, 57)) + "...";
  }
  bool Enter() {
    if (static_cast<int>(keys_.size()) >= limits_.max_depth) {
      error_ = fmt::format("JSON nesting deeper than {} levels (at {})", limits_.max_depth,
                           DescribePath(keys_));
      return false;
    }
    return true;
  }
  void Leave() {
    keys_.pop_back();
    seen_.pop_back();
  }

  nlohmann::detail::json_sax_dom_parser<BasicJson> dom_;
  const JsonLimits& limits_;
  std::vector<std::string> keys_;
  std::vector<std::set<std::string>> seen_;
  std::string error_;
};

}  // namespace json_internal

// Parses `text` as one JSON document (whitespace around it allowed, nothing else) within
// `limits`. Never throws. Errors: InvalidArgument, see the top of the file.
template <typename BasicJson = nlohmann::json>
Result<BasicJson> ParseJson(std::string_view text, const JsonLimits& limits = {}) {
  if (text.size() > limits.max_bytes) {
    return InvalidArgumentError(fmt::format("JSON text of {} bytes is larger than {} bytes",
                                            text.size(), limits.max_bytes));
  }
  BasicJson root;
  json_internal::BoundedSax<BasicJson> sax(root, limits);
  bool ok = false;
  try {
    ok = BasicJson::sax_parse(text, &sax, nlohmann::detail::input_format_t::json,
                              /*strict=*/true);
  } catch (const std::exception& e) {
    // Not expected (the handler reports every error by returning false); kept so that a future
    // nlohmann release that throws anyway cannot end the process.
    return InvalidArgumentError(
        fmt::format("JSON error: {}", json_internal::StripExceptionPrefix(e.what())));
  }
  if (!ok) {
    return InvalidArgumentError(sax.error().empty() ? std::string("JSON syntax error")
                                                    : sax.error());
  }
  return root;
}

// JSON text for a message or a terminal: dump() with invalid UTF-8 replaced (nlohmann throws on
// it otherwise) and every non-ASCII or control character escaped. Never throws.
template <typename BasicJson>
std::string DumpJsonForDisplay(const BasicJson& value, int indent = -1) {
  return value.dump(indent, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

}  // namespace zinf
