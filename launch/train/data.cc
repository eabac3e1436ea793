#include "data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <utility>
#include <vector>

namespace zinf::train {
namespace {

namespace fs = std::filesystem;

// Reads a whole file. Errors: FailedPrecondition.
Result<std::string> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return FailedPreconditionError("cannot open '" + path.string() + "' for reading");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return FailedPreconditionError("error while reading '" + path.string() + "'");
  return text;
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
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) {
    return NotFoundError("text data file '" + path + "' does not exist");
  }
  if (!fs::is_regular_file(status)) {
    return FailedPreconditionError("text data '" + path + "' is not a regular file");
  }
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  if (text.empty()) return InvalidArgumentError("text data file '" + path + "' is empty");
  return TextDataset(std::move(text), path);
}

Result<TextDataset> TextDataset::LoadDirectory(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> files;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_regular_file(type_ec) && !it->is_symlink(type_ec)) files.push_back(it->path());
  }
  if (ec && files.empty()) {
    return NotFoundError("cannot list text directory '" + dir + "': " + ec.message() +
                         "; pass a text file with --data");
  }
  std::sort(files.begin(), files.end());
  std::string text;
  int used = 0;
  for (const fs::path& file : files) {
    Result<std::string> part = ReadFile(file);
    if (!part.has_value() || part->empty()) continue;  // unreadable files are skipped
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
