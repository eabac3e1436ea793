// TextDataset: the bytes a character-level model learns from, and the deterministic micro-batches
// cut from them.
//
//   ZINF_ASSIGN_OR_RETURN(TextDataset data, TextDataset::LoadDefault());  // or Load(path)
//   ZINF_ASSIGN_OR_RETURN(Batch batch, data.SampleBatch(
//       {.seed = 1, .step = 7, .micro_batch = 0, .world_rank = 2, .world_size = 4}, 64, 16));
//
// The text is split once: the first 95% (train part) feeds SampleBatch, the last 5% (held-out
// part) feeds EvalBatch. Ids are byte values (0..255): the byte-level vocabulary of CharLM.
//
// Thread safety: immutable after Load; const methods may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "model.h"
#include "zinf/core/status.h"

namespace zinf::train {

// Where the default text comes from: every Debian system has these license texts.
inline constexpr std::string_view kDefaultTextDir = "/usr/share/common-licenses";

class TextDataset {
 public:
  // Fraction of the text (from the end) held out for evaluation.
  static constexpr double kHeldOutFraction = 0.05;

  // Reads the whole file at `path` (symlinks followed).
  // Errors: NotFound (missing), FailedPrecondition (not a regular file, unreadable),
  // InvalidArgument (empty), each naming the path.
  static Result<TextDataset> Load(const std::string& path);

  // Concatenates every regular file directly in `dir` (sorted by name; symlinks skipped, so that
  // "GPL -> GPL-3" is not read twice; unreadable files skipped). Errors: NotFound naming `dir`
  // when nothing could be read (no such directory, no readable non-empty regular file).
  static Result<TextDataset> LoadDirectory(const std::string& dir);
  // LoadDirectory(kDefaultTextDir), with an error message that says to pass --data.
  static Result<TextDataset> LoadDefault();
  // A dataset over `text` (tests). Errors: InvalidArgument if empty.
  static Result<TextDataset> FromText(std::string text, std::string source = "<memory>");

  // Micro-batch `id` of `batch_size` next-byte examples with `context_size` bytes of context,
  // from the train part. Window starts are drawn from Mix64(BatchKey(id), example index), so the
  // batch is a pure function of (id, batch_size, context_size) and every rank, step and
  // micro-batch gets its own. Errors: InvalidArgument for batch_size < 1, context_size < 1, or a
  // train part not longer than context_size.
  Result<Batch> SampleBatch(const BatchId& id, int batch_size, int context_size) const;

  // `num_examples` windows evenly spaced over the held-out part (the same every call).
  // Errors: InvalidArgument for num_examples < 1, context_size < 1, or a held-out part not longer
  // than context_size.
  Result<Batch> EvalBatch(int num_examples, int context_size) const;

  std::string_view text() const { return text_; }
  std::size_t size_bytes() const { return text_.size(); }
  // Bytes [0, train_bytes()) are the train part, the rest the held-out part.
  std::size_t train_bytes() const { return train_bytes_; }
  // What was loaded: a path, or "<dir> (N files)".
  const std::string& source() const { return source_; }

 private:
  TextDataset(std::string text, std::string source);

  std::string text_;
  std::size_t train_bytes_ = 0;
  std::string source_;
};

}  // namespace zinf::train
