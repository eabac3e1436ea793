#include "zinf/storage/checksum.h"

#include <xxhash.h>
// The x86 build of libxxhash picks SSE2/AVX2/AVX-512 at run time behind these entry points (and
// computes the same values); the plain XXH3_64bits is compiled for SSE2 only. The header maps
// the plain names onto the dispatching ones.
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#endif

#include <utility>

#include <fmt/format.h>

#include "zinf/core/check.h"

namespace zinf::storage {

std::uint64_t Checksum64(std::span<const std::byte> data) {
  return XXH3_64bits(data.data(), data.size());
}

std::string ChecksumToHex(std::uint64_t checksum) { return fmt::format("{:#018x}", checksum); }

Status VerifyChecksum(std::span<const std::byte> data, std::uint64_t expected,
                      std::string_view what) {
  const std::uint64_t computed = Checksum64(data);
  if (computed == expected) return OkStatus();
  return DataLossError(fmt::format(
      "checksum mismatch in {}: stored {}, computed {} ({} over {} bytes)", what,
      ChecksumToHex(expected), ChecksumToHex(computed), kChecksumAlgorithm, data.size()));
}

// xxHash allocates its streaming state itself (it needs 64-byte alignment); we keep only the
// pointer so that xxhash.h stays out of the public header.
struct ChecksumBuilder::State {
  XXH3_state_t* xxh = nullptr;
};

void ChecksumBuilder::StateDeleter::operator()(State* state) const {
  if (state == nullptr) return;
  XXH3_freeState(state->xxh);
  delete state;
}

ChecksumBuilder::ChecksumBuilder() { Reset(); }
ChecksumBuilder::~ChecksumBuilder() = default;

ChecksumBuilder::ChecksumBuilder(ChecksumBuilder&& other) noexcept
    : state_(std::move(other.state_)), size_bytes_(std::exchange(other.size_bytes_, 0)) {}

ChecksumBuilder& ChecksumBuilder::operator=(ChecksumBuilder&& other) noexcept {
  if (this != &other) {
    state_ = std::move(other.state_);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void ChecksumBuilder::Reset() {
  if (state_ == nullptr) {
    std::unique_ptr<State, StateDeleter> fresh(new State);
    fresh->xxh = XXH3_createState();
    ZINF_CHECK(fresh->xxh != nullptr, "XXH3_createState: out of memory");
    state_ = std::move(fresh);
  }
  // Fails only for a null state, which cannot happen here.
  ZINF_CHECK(XXH3_64bits_reset(state_->xxh) == XXH_OK, "XXH3_64bits_reset failed");
  size_bytes_ = 0;
}

void ChecksumBuilder::Update(std::span<const std::byte> data) {
  ZINF_CHECK(state_ != nullptr, "ChecksumBuilder used after move without Reset()");
  ZINF_CHECK(XXH3_64bits_update(state_->xxh, data.data(), data.size()) == XXH_OK,
             "XXH3_64bits_update failed");
  size_bytes_ += data.size();
}

std::uint64_t ChecksumBuilder::Digest() const {
  ZINF_CHECK(state_ != nullptr, "ChecksumBuilder used after move without Reset()");
  return XXH3_64bits_digest(state_->xxh);
}

}  // namespace zinf::storage
