// Checksums over byte buffers: XXH3-64 from the xxHash library (libxxhash 0.8.1).
//
// Used for the per-chunk checksums of checkpoint datasets (/checksum/<state>) and for verifying
// data read back from the swap store. A format that stores checksums also stores
// kChecksumAlgorithm next to them, so that a reader knows how they were computed.
//
//   std::uint64_t sum = zinf::storage::Checksum64(std::as_bytes(std::span(values)));
//   ZINF_RETURN_IF_ERROR(
//       zinf::storage::VerifyChecksum(bytes, stored, "dataset /state/fp32 chunk 3"));
//
// The value is XXH3_64bits with the default seed (0), i.e. what `xxhsum -H3` prints. It is not
// cryptographic: it detects corruption (bit flips, torn or misplaced writes), not tampering.
//
// Thread safety: the free functions are thread safe. A ChecksumBuilder is used by one thread at a
// time; distinct builders are independent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf::storage {

// The name formats record for the algorithm below.
inline constexpr std::string_view kChecksumAlgorithm = "xxh3-64";

// XXH3-64 (seed 0) of `data`. An empty span has a well-defined checksum (0x2d06800538d394c2).
std::uint64_t Checksum64(std::span<const std::byte> data);

// "0x" followed by 16 lower-case hex digits, e.g. "0x2d06800538d394c2".
std::string ChecksumToHex(std::uint64_t checksum);

// OK if Checksum64(data) == expected. Otherwise DataLoss with a message naming `what` (e.g.
// "dataset /state/fp32 chunk 12 elements [49152, 53248)"), the algorithm, the byte count and
// both values in hex:
//   "checksum mismatch in <what>: stored 0x..., computed 0x... (xxh3-64 over N bytes)"
Status VerifyChecksum(std::span<const std::byte> data, std::uint64_t expected,
                      std::string_view what);

// Incremental XXH3-64: feeding the same bytes in any split gives the same Digest() as
// Checksum64 over their concatenation.
//
// Owns its hashing state (heap-allocated by xxHash). Move-only; a moved-from builder is empty
// and must be Reset() before it is used again (using it otherwise is a programmer error and
// aborts through ZINF_CHECK).
class ChecksumBuilder {
 public:
  ChecksumBuilder();
  ~ChecksumBuilder();
  ChecksumBuilder(ChecksumBuilder&& other) noexcept;
  ChecksumBuilder& operator=(ChecksumBuilder&& other) noexcept;
  ChecksumBuilder(const ChecksumBuilder&) = delete;
  ChecksumBuilder& operator=(const ChecksumBuilder&) = delete;

  // Appends `data` to the bytes hashed so far.
  void Update(std::span<const std::byte> data);
  // The checksum of everything fed since construction or the last Reset(). Does not change the
  // state: more Update() calls may follow.
  std::uint64_t Digest() const;
  // Starts over with no bytes (and makes a moved-from builder usable again).
  void Reset();

  // Bytes fed since construction or the last Reset().
  std::uint64_t size_bytes() const { return size_bytes_; }

 private:
  struct State;
  struct StateDeleter {
    void operator()(State* state) const;
  };
  std::unique_ptr<State, StateDeleter> state_;
  std::uint64_t size_bytes_ = 0;
};

}  // namespace zinf::storage
