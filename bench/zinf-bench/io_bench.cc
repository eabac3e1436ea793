// zinf-bench io: O_DIRECT write then read throughput of an I/O backend, and a sweep over block
// size x queue depth x intra-op parallelism on zinf's own grid (the three knobs DeepSpeed's
// ds_nvme_tune also sweeps). It writes text, JSON lines and CSV only: the pictures of the sweep
// are drawn by the bench harness (python3 bench/run.py io-sweep, bench/harness/plot.py).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "zinf/core/log.h"
#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/file.h"
#include "zinf/storage/fs.h"
#include "zinf/storage/io_backend.h"

namespace zinf::bench {
namespace {

using storage::AioOptions;
using storage::AlignedBuffer;
using storage::IoBackendKind;
using storage::File;
using storage::IoCompletion;
using storage::IoBackend;
using storage::IoOp;
using storage::IoRequest;

struct IoFlags {
  std::string path;
  std::string file;
  std::string size = "1G";
  AioFlags aio{.backend = "uring", .block_size = "1M", .queue_depth = 8,
               .intra_op_parallelism = 1};
  bool single_submit = false;
  bool no_overlap_events = false;
  std::string op = "both";
  // 2 GiB of buffers in flight at most (capped by --size), as a swapper's pool of large
  // sub-groups: on virtual disks the buffer memory DMA cycles through changes the speed (reads
  // through 256 MiB of buffers ran at half the speed of reads through 2 GiB here, for every
  // tool), so comparisons hold the buffer memory equal.
  std::string chunk = "256M";
  int chunks_in_flight = 8;
  bool json = false;
  bool verify = false;
  bool fsync = false;
  bool no_preallocate = false;
  bool register_buffers = true;
  bool keep = false;
  bool sweep = false;
  std::string csv;
};

struct Measurement {
  IoOp op;
  std::string backend;
  AioOptions options;
  std::uint64_t size_bytes = 0;
  double seconds = 0;
  double mib_per_s() const { return seconds > 0 ? size_bytes / double(kMiB) / seconds : 0; }
};

// Word i of the file holds a value derived from its offset, so a misplaced block is caught too.
void FillPattern(std::byte* data, std::uint64_t length, std::uint64_t file_offset) {
  auto* words = reinterpret_cast<std::uint64_t*>(data);
  for (std::uint64_t i = 0; i < length / 8; ++i) {
    words[i] = (file_offset + i * 8) * 0x9E3779B97F4A7C15ull ^ 0x5A5A5A5A5A5A5A5Aull;
  }
}

std::optional<std::uint64_t> FirstMismatch(const std::byte* data, std::uint64_t length,
                                           std::uint64_t file_offset) {
  const auto* words = reinterpret_cast<const std::uint64_t*>(data);
  for (std::uint64_t i = 0; i < length / 8; ++i) {
    if (words[i] != ((file_offset + i * 8) * 0x9E3779B97F4A7C15ull ^ 0x5A5A5A5A5A5A5A5Aull)) {
      return file_offset + i * 8;
    }
  }
  return std::nullopt;
}

// Streams `size` bytes through `chunks_in_flight` buffers of `chunk` bytes each, keeping all of
// them submitted, like the swapper's buffer pool does.
class Streamer {
 public:
  Streamer(IoBackend& backend, File& file, std::vector<AlignedBuffer>& buffers,
           std::uint64_t chunk_bytes)
      : backend_(backend), file_(file), buffers_(buffers), chunk_bytes_(chunk_bytes) {}

  Result<double> Run(IoOp op, std::uint64_t size_bytes, bool verify, bool fsync) {
    std::vector<std::uint64_t> offset_of(buffers_.size());
    std::vector<std::uint64_t> id_to_buffer;  // index: request id
    std::vector<std::uint64_t> length_of(buffers_.size());
    std::uint64_t next_offset = 0;
    const auto start = std::chrono::steady_clock::now();
    auto submit = [&](std::size_t b) -> Status {
      const std::uint64_t length = std::min(chunk_bytes_, size_bytes - next_offset);
      if (op == IoOp::kWrite && verify) FillPattern(buffers_[b].data(), length, next_offset);
      ZINF_ASSIGN_OR_RETURN(std::uint64_t id,
                            backend_.Submit(IoRequest{op, &file_, next_offset,
                                                     buffers_[b].span().subspan(0, length)}));
      if (id_to_buffer.size() <= id) id_to_buffer.resize(id + 1);
      id_to_buffer[id] = b;
      offset_of[b] = next_offset;
      length_of[b] = length;
      next_offset += length;
      return OkStatus();
    };
    for (std::size_t b = 0; b < buffers_.size() && next_offset < size_bytes; ++b) {
      ZINF_RETURN_IF_ERROR(submit(b));
    }
    std::vector<IoCompletion> done;
    while (backend_.pending() > 0) {
      done.clear();
      ZINF_RETURN_IF_ERROR(backend_.Wait(1, &done));
      for (const IoCompletion& completion : done) {
        const std::size_t b = id_to_buffer[completion.id];
        if (op == IoOp::kRead && verify) {
          if (auto bad = FirstMismatch(buffers_[b].data(), length_of[b], offset_of[b])) {
            return DataLossError(
                fmt::format("verify: {} differs at offset {}", file_.path(), *bad));
          }
        }
        if (next_offset < size_bytes) ZINF_RETURN_IF_ERROR(submit(b));
      }
    }
    if (op == IoOp::kWrite && fsync) ZINF_RETURN_IF_ERROR(file_.Sync());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

 private:
  IoBackend& backend_;
  File& file_;
  std::vector<AlignedBuffer>& buffers_;
  std::uint64_t chunk_bytes_;
};

struct Plan {
  std::string file_path;
  // How the test file is opened (kRead for an existing --file) and the inode it must be: every
  // open of the name is checked against what PrepareTestFile created or looked at.
  storage::OpenMode mode = storage::OpenMode::kReadWrite;
  dev_t dev = 0;
  ino_t ino = 0;
  std::uint64_t size_bytes;
  std::uint64_t chunk_bytes;
  IoBackendKind kind;
  bool do_write;
  bool do_read;
};

Result<std::vector<Measurement>> RunOnce(const IoFlags& flags, const Plan& plan,
                                         const AioOptions& options, bool write_untimed_first) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> backend,
                        storage::CreateIoBackend(plan.kind, options, flags.path));
  storage::OpenOptions open_options;
  open_options.mode = plan.mode;
  ZINF_ASSIGN_OR_RETURN(File file, File::Open(plan.file_path, open_options));
  struct stat st {};
  if (::fstat(file.fd(), &st) != 0) return ErrnoError(errno, "fstat " + plan.file_path);
  if (st.st_dev != plan.dev || st.st_ino != plan.ino) {
    return FailedPreconditionError(
        fmt::format("{} was replaced by another file during the benchmark", plan.file_path));
  }
  if (!file.direct()) {
    std::fprintf(stderr, "zinf-bench io: warning: %s has no O_DIRECT; measuring buffered I/O\n",
                 flags.path.c_str());
  }
  const std::uint64_t alignment = std::max<std::uint64_t>(4096, file.alignment());
  if (plan.size_bytes % alignment != 0 || options.block_size % alignment != 0) {
    return InvalidArgumentError(fmt::format(
        "--size {} and --block-size {} must be multiples of the direct-I/O alignment {}",
        plan.size_bytes, options.block_size, alignment));
  }
  storage::BufferOptions buffer_options;
  buffer_options.alignment = alignment;
  buffer_options.register_cuda = false;
  std::vector<AlignedBuffer> buffers;
  const std::uint64_t chunks = std::min<std::uint64_t>(
      flags.chunks_in_flight, (plan.size_bytes + plan.chunk_bytes - 1) / plan.chunk_bytes);
  for (std::uint64_t i = 0; i < chunks; ++i) {
    ZINF_ASSIGN_OR_RETURN(AlignedBuffer buffer,
                          AlignedBuffer::Allocate(plan.chunk_bytes, buffer_options));
    if (!flags.verify) FillPattern(buffer.data(), buffer.size(), i * plan.chunk_bytes);
    buffers.push_back(std::move(buffer));
  }
  if (flags.register_buffers) {
    std::vector<std::span<std::byte>> spans;
    for (AlignedBuffer& buffer : buffers) spans.push_back(buffer.span());
    ZINF_RETURN_IF_ERROR(backend->RegisterBuffers(spans));
  }
  Streamer streamer(*backend, file, buffers, plan.chunk_bytes);
  std::vector<Measurement> out;
  if (plan.do_write || write_untimed_first) {
    ZINF_ASSIGN_OR_RETURN(std::uint64_t current, file.Size());
    if (!flags.no_preallocate && current < plan.size_bytes) {
      ZINF_RETURN_IF_ERROR(file.Allocate(0, plan.size_bytes));
    }
    ZINF_ASSIGN_OR_RETURN(double seconds,
                          streamer.Run(IoOp::kWrite, plan.size_bytes, flags.verify, flags.fsync));
    if (plan.do_write) {
      out.push_back(Measurement{IoOp::kWrite, std::string(backend->name()), options, plan.size_bytes,
                                seconds});
    }
  }
  if (plan.do_read) {
    ZINF_ASSIGN_OR_RETURN(double seconds,
                          streamer.Run(IoOp::kRead, plan.size_bytes, flags.verify, false));
    out.push_back(
        Measurement{IoOp::kRead, std::string(backend->name()), options, plan.size_bytes, seconds});
  }
  ZINF_RETURN_IF_ERROR(backend->RegisterBuffers({}));
  ZINF_RETURN_IF_ERROR(file.Close());
  return out;
}

nlohmann::json ToJson(const Measurement& m, bool verify) {
  return nlohmann::json{
      {"op", std::string(storage::IoOpName(m.op))},
      {"engine", m.backend},
      {"size_bytes", m.size_bytes},
      {"block_size", m.options.block_size},
      {"queue_depth", m.options.queue_depth},
      {"intra_op_parallelism", m.options.intra_op_parallelism},
      {"single_submit", m.options.single_submit},
      {"overlap_events", m.options.overlap_events},
      {"verify", verify},
      {"seconds", m.seconds},
      {"mib_per_s", m.mib_per_s()},
  };
}

void Print(const Measurement& m, const IoFlags& flags) {
  if (flags.json) {
    std::printf("%s\n", ToJson(m, flags.verify).dump().c_str());
  } else {
    std::printf("%-5s %-6s size %s block %s qd %d par %d: %.3f s, %.1f MiB/s\n",
                std::string(storage::IoOpName(m.op)).c_str(), m.backend.c_str(),
                FormatBytes(m.size_bytes).c_str(), FormatBytes(m.options.block_size).c_str(),
                m.options.queue_depth, m.options.intra_op_parallelism, m.seconds, m.mib_per_s());
  }
  std::fflush(stdout);
}

int Sweep(const IoFlags& flags, const Plan& plan) {
  const std::vector<std::uint64_t> blocks = {128 * kKiB, 256 * kKiB, 512 * kKiB, 1 * kMiB,
                                             2 * kMiB,   4 * kMiB,   8 * kMiB};
  const std::vector<int> depths = {1, 2, 4, 8, 16, 32};
  const std::vector<int> parallelisms = {1, 2};
  // The CSV exists as a temporary from the start, so that an output that may not be written
  // (see storage::AtomicFile: a new name or a regular file, replaced) is refused before the
  // sweep runs.
  std::optional<storage::AtomicFile> csv_out;
  if (!flags.csv.empty()) {
    Result<storage::AtomicFile> file =
        storage::AtomicFile::Create(flags.csv, storage::Overwrite::kRegularFile);
    if (!file) {
      std::fprintf(stderr, "zinf-bench io: %s\n", file.error().ToString().c_str());
      return 1;
    }
    csv_out = std::move(*file);
  }
  std::fprintf(stderr, "zinf-bench io: sweeping %zu configurations x %s each way\n",
               blocks.size() * depths.size() * parallelisms.size(),
               FormatBytes(plan.size_bytes).c_str());
  struct Row {
    AioOptions options;
    double write = 0;
    double read = 0;
  };
  std::vector<Row> rows;
  std::vector<Measurement> measurements;
  for (int p : parallelisms) {
    for (std::uint64_t b : blocks) {
      for (int q : depths) {
        AioOptions options;
        options.block_size = b;
        options.queue_depth = q;
        options.intra_op_parallelism = p;
        options.single_submit = flags.single_submit;
        options.overlap_events = !flags.no_overlap_events;
        Result<std::vector<Measurement>> result = RunOnce(flags, plan, options, false);
        if (!result) {
          std::fprintf(stderr, "zinf-bench io: %s\n", result.error().ToString().c_str());
          return 1;
        }
        Row row{options};
        for (const Measurement& m : *result) {
          Print(m, flags);
          (m.op == IoOp::kRead ? row.read : row.write) = m.mib_per_s();
          measurements.push_back(m);
        }
        rows.push_back(row);
      }
    }
  }
  // Grouped by op: the write rows, then the read rows, each in the sweep's order.
  std::string csv = "op,block_size,queue_depth,intra_op_parallelism,size_bytes,seconds,mib_per_s\n";
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    for (const Measurement& m : measurements) {
      if (m.op != op) continue;
      csv += fmt::format("{},{},{},{},{},{},{}\n", storage::IoOpName(m.op), m.options.block_size,
                         m.options.queue_depth, m.options.intra_op_parallelism, m.size_bytes,
                         m.seconds, m.mib_per_s());
    }
  }
  double best_read = 0, best_write = 0;
  for (const Row& row : rows) {
    best_read = std::max(best_read, row.read);
    best_write = std::max(best_write, row.write);
  }
  // One config for both directions: the best sum of throughputs relative to each direction's best.
  const Row* best = nullptr;
  double best_score = -1;
  for (const Row& row : rows) {
    double score = 0;
    if (best_read > 0) score += row.read / best_read;
    if (best_write > 0) score += row.write / best_write;
    if (score > best_score) {
      best_score = score;
      best = &row;
    }
  }
  if (best != nullptr) {
    nlohmann::json aio = {
        {"block_size", best->options.block_size},
        {"queue_depth", best->options.queue_depth},
        {"intra_op_parallelism", best->options.intra_op_parallelism},
        {"single_submit", best->options.single_submit},
        {"overlap_events", best->options.overlap_events},
    };
    std::fprintf(stderr,
                 "zinf-bench io: best config: write %.1f MiB/s (best %.1f), read %.1f MiB/s "
                 "(best %.1f)\n",
                 best->write, best_write, best->read, best_read);
    std::printf("\"aio\": %s\n", aio.dump(2).c_str());
  }
  if (csv_out) {
    Status written = csv_out->Write(std::as_bytes(std::span(csv.data(), csv.size())));
    if (written) written = csv_out->Commit();
    if (!written) {
      std::fprintf(stderr, "zinf-bench io: %s\n", written.error().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "zinf-bench io: wrote %s\n", flags.csv.c_str());
  }
  return 0;
}

// Makes or checks the test file and sets plan->mode, dev and ino; true when it was created. A
// fresh file (a new name in --path, or a --file that does not exist) is created exclusively: the
// benchmark writes only into a file it made, removed at the end unless --keep. An existing
// --file must be a regular file (not a link, device or FIFO) and is only read (--op read).
Result<bool> PrepareTestFile(const IoFlags& flags, Plan* plan) {
  const std::string& path = plan->file_path;
  Result<storage::UniqueFd> fd =
      storage::OpenFile(path, storage::FileAccess::kCreateNew, storage::Follow::kNo, 0600);
  const bool created = fd.has_value();
  if (!created) {
    if (flags.file.empty() || fd.error().code() != ErrorCode::kAlreadyExists) {
      return std::move(fd).error();
    }
    // Refused with its type first if it is not a regular file (looked at, never opened).
    ZINF_ASSIGN_OR_RETURN(
        fd, Annotate(storage::OpenFile(path, storage::FileAccess::kRead), "--file: "));
    if (plan->do_write) {
      return AlreadyExistsError(fmt::format(
          "--file {} exists: zinf-bench io writes only into a file it creates (a --file that "
          "does not exist yet, removed at the end unless --keep); --op read reads an existing "
          "file as it is",
          path));
    }
  }
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0) return ErrnoError(errno, "fstat " + path);
  plan->mode = created ? storage::OpenMode::kReadWrite : storage::OpenMode::kRead;
  plan->dev = st.st_dev;
  plan->ino = st.st_ino;
  ZINF_RETURN_IF_ERROR(fd->Close(path));
  return created;
}

int RunIo(const IoFlags& flags) {
  auto fail = [](const std::string& message, int code) {
    std::fprintf(stderr, "zinf-bench io: %s\n", message.c_str());
    return code;
  };
  std::error_code ec;
  if (!std::filesystem::is_directory(flags.path, ec)) {
    return fail(fmt::format("--path {} is not a directory", flags.path), 2);
  }
  Result<std::uint64_t> size = ParseBytes(flags.size);
  if (!size || *size == 0) return fail(fmt::format("bad --size '{}'", flags.size), 2);
  Result<std::uint64_t> block = ParseBytes(flags.aio.block_size);
  if (!block || *block == 0) return fail(fmt::format("bad --block-size '{}'", flags.aio.block_size), 2);
  Result<std::uint64_t> chunk = ParseBytes(flags.chunk);
  if (!chunk || *chunk == 0) return fail(fmt::format("bad --chunk '{}'", flags.chunk), 2);
  Result<IoBackendKind> kind = storage::ParseIoBackendKind(flags.aio.backend);
  if (!kind) return fail(kind.error().message(), 2);

  Plan plan;
  plan.file_path = flags.file.empty() ? fmt::format("{}/zinf-bench-io-{}.dat", flags.path, getpid())
                                      : flags.file;
  if (!flags.file.empty() && flags.sweep) return fail("--file and --sweep do not mix", 2);
  plan.size_bytes = *size;
  plan.chunk_bytes = std::min(*chunk, *size);
  plan.kind = *kind;
  plan.do_write = flags.op != "read";
  plan.do_read = flags.op != "write";
  Result<bool> created = PrepareTestFile(flags, &plan);
  if (!created) return fail(created.error().ToString(), 1);

  int rc = 0;
  if (flags.sweep) {
    rc = Sweep(flags, plan);
  } else {
    AioOptions options;
    options.block_size = *block;
    options.queue_depth = flags.aio.queue_depth;
    options.intra_op_parallelism = flags.aio.intra_op_parallelism;
    options.single_submit = flags.single_submit;
    options.overlap_events = !flags.no_overlap_events;
    // A read-only run needs the file's contents: write them first, untimed (unless --file names
    // an existing file, which is then read as it is).
    const bool prepare = !plan.do_write && *created;
    Result<std::vector<Measurement>> result = RunOnce(flags, plan, options, prepare);
    if (!result) {
      rc = fail(result.error().ToString(),
                result.error().code() == ErrorCode::kInvalidArgument ? 2 : 1);
    } else {
      for (const Measurement& m : *result) Print(m, flags);
    }
  }
  if (!flags.keep && *created) std::filesystem::remove(plan.file_path, ec);
  return rc;
}

const bool kRegistered = RegisterBenchCommand(
    "io", "O_DIRECT write/read throughput of the I/O backends (and a config sweep)",
    [](CLI::App& app) -> RunFn {
      auto flags = std::make_shared<IoFlags>();
      app.add_option("--path", flags->path, "directory for the test file (removed at the end)")
          ->required();
      app.add_option("--file", flags->file,
                     "use this file instead of a fresh one in --path: a new name (created, "
                     "removed at the end unless --keep), or with --op read an existing regular "
                     "file, read as it is (never written)");
      app.add_option("--size", flags->size, "bytes to write and read, e.g. 1G")
          ->capture_default_str();
      AddAioFlags(app, flags->aio);
      app.add_flag("--single-submit", flags->single_submit, "aio.single_submit = true");
      app.add_flag("--no-overlap-events", flags->no_overlap_events, "aio.overlap_events = false");
      app.add_option("--op", flags->op, "write, read or both (write, then read)")
          ->capture_default_str()
          ->check(CLI::IsMember({"read", "write", "both"}));
      app.add_option("--chunk", flags->chunk, "bytes per request (a pool buffer)")
          ->capture_default_str();
      app.add_option("--chunks-in-flight", flags->chunks_in_flight, "requests kept submitted")
          ->capture_default_str()
          ->check(CLI::Range(1, 64));
      app.add_flag("--json", flags->json, "one JSON object per op on stdout");
      app.add_flag("--verify", flags->verify,
                   "write an offset pattern and check it on read (timed: costs CPU)");
      app.add_flag("--fsync", flags->fsync, "fdatasync after the write (timed)");
      app.add_flag("--no-preallocate", flags->no_preallocate, "do not fallocate the file first");
      app.add_flag("!--no-register-buffers", flags->register_buffers,
                   "do not register the buffers with the backend");
      app.add_flag("--keep", flags->keep, "keep the test file");
      app.add_flag("--sweep", flags->sweep,
                   "block size 128K..8M x queue depth 1..32 x parallelism 1,2; prints the best "
                   "\"aio\" block (python3 bench/run.py io-sweep runs it and draws it)");
      app.add_option("--csv", flags->csv,
                     "sweep results as CSV: a new file, or a regular file replaced whole when "
                     "the sweep is done (a link, directory, device or FIFO is refused first)");
      return [flags] { return RunIo(*flags); };
    });

}  // namespace
}  // namespace zinf::bench
