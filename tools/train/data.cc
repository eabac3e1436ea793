#include "data.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "zinf/storage/fs.h"

namespace zinf::train {
namespace {

// The text a dataset may hold in all (it lives in every rank's memory), and the directory
// entries LoadDirectory looks at.
constexpr std::uint64_t kMaxTextBytes = 1ull << 30;
constexpr std::size_t kMaxDirectoryEntries = 100'000;

// Reads a whole regular file of at most `max_bytes` (a FIFO or device is refused, never read).
Result<std::string> ReadFile(int dir_fd, const std::string& name, const std::string& display,
                             std::uint64_t max_bytes, storage::Follow follow) {
  return storage::ReadSmallFileAt(dir_fd, name, display, max_bytes, follow);
}

Status CheckShape(std::string_view what, int count, int context_size) {
  if (count < 1) {
    return InvalidArgumentError(std::string(what) + ": need at least 1 example, got " +
                                std::to_string(count));
  }
  if (context_size < 1) {
    return InvalidArgumentError(std::string(what) + ": context size must be >= 1, got " +
                                std::to_string(context_size));
  }
  return OkStatus();
}

}  // namespace

TextDataset::TextDataset(std::string text, std::string source)
    : text_(std::move(text)), source_(std::move(source)) {
  const auto held_out =
      static_cast<std::size_t>(static_cast<double>(text_.size()) * kHeldOutFraction);
  train_bytes_ = text_.size() - held_out;
}

Result<TextDataset> TextDataset::FromText(std::string text, std::string source) {
  if (text.empty()) return InvalidArgumentError("text dataset '" + source + "' is empty");
  return TextDataset(std::move(text), std::move(source));
}

Result<TextDataset> TextDataset::Load(const std::string& path) {
  Result<std::string> text = ReadFile(AT_FDCWD, path, path, kMaxTextBytes, storage::Follow::kYes);
  if (!text) {
    if (text.error().code() == ErrorCode::kNotFound) {
      return NotFoundError("text data file '" + path + "' does not exist");
    }
    return std::move(text).error().WithContext("text data: ");
  }
  if (text->empty()) return InvalidArgumentError("text data file '" + path + "' is empty");
  return TextDataset(std::move(*text), path);
}

Result<TextDataset> TextDataset::LoadDirectory(const std::string& dir) {
  Result<storage::UniqueFd> dir_fd = storage::OpenDirectory(dir, storage::Follow::kYes);
  if (!dir_fd) {
    return NotFoundError("cannot open text directory '" + dir + "': " + dir_fd.error().message() +
                         "; pass a text file with --data");
  }
  // Regular files only (links are not followed), in name order, at most kMaxDirectoryEntries
  // entries looked at and kMaxTextBytes read in all.
  std::vector<std::string> names;
  {
    const int fd = ::dup(dir_fd->get());
    DIR* listing = fd >= 0 ? ::fdopendir(fd) : nullptr;
    if (listing == nullptr) {
      if (fd >= 0) ::close(fd);
      return NotFoundError("cannot list text directory '" + dir +
                           "'; pass a text file with --data");
    }
    std::size_t seen = 0;
    while (const dirent* entry = ::readdir(listing)) {
      if (++seen > kMaxDirectoryEntries) break;
      const std::string name = entry->d_name;
      if (name == "." || name == "..") continue;
      struct stat st {};
      if (::fstatat(dir_fd->get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISREG(st.st_mode)) {
        names.push_back(name);
      }
    }
    ::closedir(listing);
  }
  std::sort(names.begin(), names.end());
  std::string text;
  int used = 0;
  for (const std::string& name : names) {
    const std::uint64_t left = kMaxTextBytes - std::min<std::uint64_t>(text.size(), kMaxTextBytes);
    Result<std::string> part =
        ReadFile(dir_fd->get(), name, dir + "/" + name, left, storage::Follow::kNo);
    if (!part.has_value() || part->empty()) continue;  // unreadable or too large: skipped
    text += *part;
    if (text.back() != '\n') text += '\n';
    ++used;
  }
  if (text.empty()) {
    return NotFoundError("no readable non-empty regular file in '" + dir +
                         "'; pass a text file with --data");
  }
  return TextDataset(std::move(text), dir + " (" + std::to_string(used) + " files)");
}

Result<TextDataset> TextDataset::LoadDefault() {
  return LoadDirectory(std::string(kDefaultTextDir));
}

Result<Batch> TextDataset::SampleBatch(const BatchId& id, int batch_size, int context_size) const {
  ZINF_RETURN_IF_ERROR(CheckShape("SampleBatch", batch_size, context_size));
  if (train_bytes_ <= static_cast<std::size_t>(context_size)) {
    return InvalidArgumentError("SampleBatch: the train part of '" + source_ + "' has " +
                                std::to_string(train_bytes_) + " bytes, need more than the " +
                                std::to_string(context_size) + "-byte context");
  }
  Batch batch;
  batch.context_size = context_size;
  batch.key = BatchKey(id);
  batch.num_examples = static_cast<std::size_t>(batch_size);
  batch.contexts.resize(static_cast<std::size_t>(batch_size) *
                        static_cast<std::size_t>(context_size));
  batch.targets.resize(static_cast<std::size_t>(batch_size));
  // Windows [start, start + context_size] must lie in the train part.
  const std::uint64_t num_starts = train_bytes_ - static_cast<std::size_t>(context_size);
  const auto* bytes = reinterpret_cast<const unsigned char*>(text_.data());
  for (std::size_t i = 0; i < batch.targets.size(); ++i) {
    // Modulo bias is below num_starts / 2^64: irrelevant for sampling text windows.
    const std::uint64_t start = internal::Mix64(batch.key ^ internal::Mix64(i)) % num_starts;
    std::int32_t* ctx = batch.contexts.data() + i * static_cast<std::size_t>(context_size);
    for (int c = 0; c < context_size; ++c) ctx[c] = bytes[start + static_cast<std::uint64_t>(c)];
    batch.targets[i] = bytes[start + static_cast<std::uint64_t>(context_size)];
  }
  return batch;
}

Result<Batch> TextDataset::EvalBatch(int num_examples, int context_size) const {
  ZINF_RETURN_IF_ERROR(CheckShape("EvalBatch", num_examples, context_size));
  const std::size_t held_out = text_.size() - train_bytes_;
  if (held_out <= static_cast<std::size_t>(context_size)) {
    return InvalidArgumentError("EvalBatch: the held-out part of '" + source_ + "' has " +
                                std::to_string(held_out) + " bytes, need more than the " +
                                std::to_string(context_size) + "-byte context");
  }
  Batch batch;
  batch.context_size = context_size;
  batch.num_examples = static_cast<std::size_t>(num_examples);
  batch.contexts.resize(static_cast<std::size_t>(num_examples) *
                        static_cast<std::size_t>(context_size));
  batch.targets.resize(static_cast<std::size_t>(num_examples));
  const std::size_t num_starts = held_out - static_cast<std::size_t>(context_size);
  const auto* bytes = reinterpret_cast<const unsigned char*>(text_.data()) + train_bytes_;
  for (std::size_t i = 0; i < batch.targets.size(); ++i) {
    const std::size_t start = i * num_starts / batch.targets.size();
    std::int32_t* ctx = batch.contexts.data() + i * static_cast<std::size_t>(context_size);
    for (int c = 0; c < context_size; ++c) ctx[c] = bytes[start + static_cast<std::size_t>(c)];
    batch.targets[i] = bytes[start + static_cast<std::size_t>(context_size)];
  }
  return batch;
}

}  // namespace zinf::train
