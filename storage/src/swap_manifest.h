// The manifest of a swap store (swap_store.h, "On-disk layout"): its text and its parser. Private
// to zinf::storage.
//
// Version 3, written in every rank directory of a store (one line each, '\n'-terminated):
//
//   zinf-swap-store 3
//   stripe_unit_bytes <decimal>
//   paths <decimal>
//   path_weights <w_0> ... <w_{n-1}>
//   tensors <count>
//   tensor <size_bytes> <name>           (count lines, in reservation order)
//   checksum 0x<16 hex digits>           XXH3-64 (checksum.h) of all the text before this line
//
// The checksum makes a manifest proof that zinf wrote it: SwapStore::ReclaimStale and Open with
// reclaim_stale remove only directories whose manifest is of this version and whose checksum
// matches. Version 2 (older zinf) has no checksum line, version 1 no path_weights line either
// (equal shares); both are still read when a store is resumed, never taken as proof.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/stripe_map.h"
#include "zinf/storage/swap_store.h"

namespace zinf::storage {

inline constexpr int kManifestVersion = 3;

struct Manifest {
  int version = 0;  // 1, 2 or 3 (kManifestVersion)
  std::uint64_t stripe_unit_bytes = 0;
  std::uint64_t num_paths = 0;
  StripeMap map = StripeMap::Equal(1);  // num_paths weights; version 1: equal shares
  std::vector<TensorSpec> tensors;
};

// The text of a manifest of the current version for a store of `map.weights().size()` paths.
std::string ManifestText(std::uint64_t stripe_unit_bytes, const StripeMap& map,
                         std::span<const TensorSpec> tensors);

// Parses a manifest of any version, strictly: every line as written by ManifestText (or by the
// zinf of its version), nothing after the last one, valid weights and tensor names, and for
// version 3 a checksum line that matches. Errors: DataLoss saying what is wrong (e.g. "bad first
// line", "no path_weights line", "checksum mismatch: ..."), without naming the file.
Result<Manifest> ParseManifest(std::string_view text);

// A tensor name a store accepts: non-empty, at most 1024 characters, no whitespace or control
// character. Errors: InvalidArgument naming it.
Status ValidateTensorName(const std::string& name);

}  // namespace zinf::storage
