// zinf._zinf: the Python extension over the engine (the package zinf.torch, python/zinf/torch/, is
// its user; docs/python.md).
//
// It links no Python framework: parameters cross as buffers (the buffer protocol: NumPy arrays,
// which torch CPU tensors share memory with), so the same build works with any torch. Every
// zinf error becomes an exception of the zinf.errors class for its code (ZinfError subclasses,
// with .code, .errno and the message), the same on every rank because the engine's calls agree
// on their Status.
//
// MPI: init() adopts MPI when the process already initialized it (mpi4py, another extension)
// and otherwise initializes it; finalize() (registered with atexit by zinf/__init__.py) closes
// the engines still open and finalizes MPI only if init() initialized it.
//
// The boundary is typed: a parameter crosses as a Param (engine::Param with its memory as Python
// buffers), the options as EngineOptions, ParamGroup and HostMemoryUse (the engine's own structs,
// engine.h); each is constructed by keyword from its read-write fields, so a field's name is
// stated once here (its def_readwrite) and once in zinf.torch.
//
// Thread safety: the GIL is released during the engine's calls; one Python thread at a time
// may use an Engine (the engine's contract), which the GIL-holding entry points check.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "zinf/comm/mpi_session.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/status.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"

namespace py = pybind11;

namespace zinf::python {
namespace {

using Json = nlohmann::json;

// Raises the zinf.errors exception for `error`'s code. `agreed`: every rank raises the same one
// (a collective call's result); zinf's excepthook ends the job for any other exception left
// unhandled (zinf/__init__.py).
[[noreturn]] void Raise(const Error& error, bool agreed) {
  py::object errors = py::module_::import("zinf.errors");
  py::object cls = errors.attr("class_for_code")(std::string(ErrorCodeName(error.code())));
  py::object exc =
      cls(error.message(), std::string(ErrorCodeName(error.code())), error.sys_errno());
  exc.attr("agreed") = agreed;
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw py::error_already_set();
}

// The result of a collective call: the same on every rank.
void Check(const Status& status) {
  if (!status) Raise(status.error(), /*agreed=*/true);
}

template <typename T>
T Value(Result<T> result) {
  if (!result) Raise(result.error(), /*agreed=*/true);
  return std::move(*result);
}

ErrorCode CodeNamed(const std::string& name) {
  return ErrorCodeNamed(name).value_or(ErrorCode::kInvalidArgument);
}

// A local problem as a Status: OK when `message` is empty.
Status Problem(const std::string& code, const std::string& message) {
  return message.empty() ? OkStatus() : Status(Error(CodeNamed(code), message));
}

class EngineHandle;

// The process's MPI session and the engines open in it.
// An engine whose optimizer was dropped without close(), kept open (with the buffers it works
// in) until finalize() closes it collectively: the other ranks may drop theirs later, or not.
struct Orphan {
  std::uint64_t serial = 0;
  std::unique_ptr<engine::ZeroEngine> engine;
  std::vector<py::object> buffers;
};

// The process's MPI session and the engines open in it; `serial` numbers the engines in the
// order they were created, the same on every rank (creation is collective).
struct Runtime {
  std::optional<comm::MpiSession> session;
  std::vector<EngineHandle*> engines;
  std::vector<Orphan> orphans;
  std::uint64_t next_serial = 0;
};

Runtime& GetRuntime() {
  static Runtime* runtime = new Runtime();  // never destroyed: finalize() ends it
  return *runtime;
}

const comm::Communicator& World() {
  Runtime& rt = GetRuntime();
  if (!rt.session) {
    Raise(FailedPreconditionError("zinf: MPI is not initialized (call zinf.init() first)"),
          /*agreed=*/false);
  }
  return rt.session->world();
}

// Collective (every rank holds the store in the orphan `serial`): closes it, as at exit, for a new
// optimizer to take its swap store over (EngineHandle::TakeOverOwnStore).
Status CloseOrphanForTakeOver(std::int64_t serial) {
  Runtime& rt = GetRuntime();
  auto it = std::find_if(rt.orphans.begin(), rt.orphans.end(), [serial](const Orphan& o) {
    return static_cast<std::int64_t>(o.serial) == serial;
  });
  Orphan dropped = std::move(*it);
  rt.orphans.erase(it);
  Status closed = [&] {
    py::gil_scoped_release release;
    Status c = dropped.engine->Close();
    dropped.engine.reset();
    return c;
  }();
  if (!closed) {
    return Error(closed.error().code(),
                 fmt::format("closing the optimizer dropped without close() that held this "
                             "swap store, for the new one to take it over: {}",
                             closed.error().message()),
                 closed.error().sys_errno());
  }
  LogLine(LogLevel::kWarn,
          "zinf: an optimizer dropped without close() held the swap store on this "
          "nvme_path; it was closed, and the new optimizer takes its store over (close() an "
          "optimizer before dropping it)");
  return OkStatus();
}

// A float32, C-contiguous buffer of exactly `numel` elements (writable unless `writable` is
// false); `what` names it. (buffer.request raises a Python error for a read-only buffer asked
// writable, or a non-buffer object.)
Result<std::span<float>> FloatSpan(const py::buffer& buffer, std::int64_t numel,
                                   const std::string& what, bool writable = true) {
  py::buffer_info info = buffer.request(writable);
  if (info.itemsize != sizeof(float) || info.format != py::format_descriptor<float>::format()) {
    return InvalidArgumentError(
        fmt::format("{}: must hold float32 elements, not format '{}' of "
                    "{} bytes",
                    what, info.format, info.itemsize));
  }
  if (info.size != numel) {
    return InvalidArgumentError(
        fmt::format("{}: holds {} elements, its shape needs {}", what, info.size, numel));
  }
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected) {
      return InvalidArgumentError(fmt::format("{}: is not contiguous", what));
    }
    expected *= info.shape[d];
  }
  return std::span<float>(static_cast<float*>(info.ptr), static_cast<std::size_t>(numel));
}

// Param::init of a partitioned parameter from this rank's shard: `shard` holds its elements
// [begin, begin + shard size), the ones the engine's plan gives this rank (zinf.torch computes
// them with the same rule, partition/plan.h kPerParam). The engine asks only for those; an ask
// outside them means the two rules differ, an InvalidArgument naming both ranges. `on_disk`:
// the shard is a shared mapping of a file (zinf.torch's shards waiting on disk), whose pages
// each copy drops from this process again (MADV_DONTNEED: a later read faults them back in from
// the file), so the engine's reading them does not hold the whole partition in memory; never
// for other memory, which MADV_DONTNEED would zero.
Result<engine::ParamInit> ShardInit(const py::buffer& shard, std::int64_t begin, std::int64_t numel,
                                    const std::string& name, std::shared_ptr<const bool> live,
                                    bool on_disk) {
  const std::int64_t size = shard.request(/*writable=*/false).size;
  ZINF_ASSIGN_OR_RETURN(std::span<float> values,
                        FloatSpan(shard, size, "parameter " + name + " shard", /*writable=*/false));
  if (begin < 0 || begin + size > numel) {
    return InvalidArgumentError(fmt::format(
        "parameter {}: a shard of {} elements from element {} lies outside its {} elements", name,
        size, begin, numel));
  }
  const auto first = static_cast<std::uint64_t>(begin);
  return [values, first, name, live = std::move(live), on_disk](std::uint64_t offset,
                                                                std::span<float> out) -> Status {
    if (!*live) {
      return FailedPreconditionError(
          fmt::format("parameter {}: init called after the engine was created", name));
    }
    if (offset < first || offset + out.size() > first + values.size()) {
      return InvalidArgumentError(fmt::format(
          "parameter {}: the engine asks for elements [{}, {}), this rank's shard holds [{}, {}) "
          "(zinf.torch's ownership rule differs from the engine's partition plan)",
          name, offset, offset + out.size(), first, first + values.size()));
    }
    const float* from = values.data() + (offset - first);
    std::copy_n(from, out.size(), out.data());
    if (on_disk) {
      static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
      const auto start = reinterpret_cast<std::uintptr_t>(from);
      const std::uintptr_t end = start + out.size() * sizeof(float);
      const std::uintptr_t inner = (start + page - 1) / page * page;  // whole pages only
      const std::uintptr_t stop = end / page * page;
      if (stop > inner) madvise(reinterpret_cast<void*>(inner), stop - inner, MADV_DONTNEED);
    }
    return OkStatus();
  };
}

// Element count of `shape`; -1 for a negative dimension or a count beyond int64.
std::int64_t NumelOf(const std::vector<std::int64_t>& shape) {
  std::int64_t numel = 1;
  for (std::int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) return -1;
  }
  return numel;
}

// One parameter as zinf.torch registers it (Python's Param): engine::Param with its memory as
// Python buffers (NumPy views of the tensors' memory), which the engine works in.
struct ParamBuffers {
  std::string name;
  std::vector<std::int64_t> shape;
  py::object weights = py::none();  // float32; None: partitioned (stage 3), its values in `shard`
  py::object grads = py::none();    // float32; None: lent, handed with gradient_ready
  // Stage 3: this rank's float32 shard of its first values, its elements from shard_begin on;
  // shard_on_disk: the shard maps a file (ShardInit's `on_disk`).
  py::object shard = py::none();
  std::int64_t shard_begin = 0;
  bool shard_on_disk = false;
  std::size_t group = 0;  // an index into EngineOptions.param_groups
};

// `p` as the engine's Param, its buffers checked (float32, contiguous, as many elements as its
// shape) and its weights and grads kept in `buffers` (alive as long as the engine). Its shard is
// read only by Create (`live` turns a later call into an error); the caller keeps it alive.
Result<engine::Param> EngineParam(const ParamBuffers& p, const std::shared_ptr<const bool>& live,
                                  std::vector<py::object>* buffers) {
  engine::Param param{.name = p.name, .shape = p.shape, .group = p.group};
  const std::int64_t numel = NumelOf(p.shape);
  if (numel < 0) {
    return InvalidArgumentError(fmt::format(
        "parameter {}: a dimension is negative or the element count overflows", p.name));
  }
  if (!p.weights.is_none()) {
    ZINF_ASSIGN_OR_RETURN(param.weights, FloatSpan(p.weights.cast<py::buffer>(), numel,
                                                   "parameter " + p.name + " weights"));
    buffers->push_back(p.weights);
  }
  if (!p.grads.is_none()) {
    ZINF_ASSIGN_OR_RETURN(param.grads, FloatSpan(p.grads.cast<py::buffer>(), numel,
                                                 "parameter " + p.name + " grads"));
    buffers->push_back(p.grads);
  }
  if (!p.shard.is_none()) {
    ZINF_ASSIGN_OR_RETURN(param.init, ShardInit(p.shard.cast<py::buffer>(), p.shard_begin, numel,
                                                p.name, live, p.shard_on_disk));
  }
  return param;
}

// Every parameter as EngineParam makes it; a Python error (a field that is not a buffer) is an
// InvalidArgument too.
Result<std::vector<engine::Param>> EngineParams(const std::vector<ParamBuffers>& params,
                                                const std::shared_ptr<const bool>& live,
                                                std::vector<py::object>* buffers) {
  std::vector<engine::Param> list;
  try {
    for (const ParamBuffers& p : params) {
      ZINF_ASSIGN_OR_RETURN(engine::Param param, EngineParam(p, live, buffers));
      list.push_back(std::move(param));
    }
  } catch (py::error_already_set& e) {
    return InvalidArgumentError(fmt::format("parameters: {}", e.what()));
  } catch (const std::exception& e) {  // pybind11's cast_error, ...
    return InvalidArgumentError(fmt::format("parameters: {}", e.what()));
  }
  return list;
}

// The fields of the bound struct T: the properties its def_readwrite calls made, in order.
template <typename T>
std::vector<std::string> FieldNames() {
  const py::object property = py::module_::import("builtins").attr("property");
  std::vector<std::string> names;
  for (const py::handle item : py::type::of<T>().attr("__dict__").attr("items")()) {
    const auto pair = item.cast<py::tuple>();
    if (py::isinstance(pair[1], property)) names.push_back(pair[0].cast<std::string>());
  }
  return names;
}

// A plain struct T as the Python class `name`, constructed by keyword from its fields
// (T(**fields), the others left at T's defaults; an unknown key is a TypeError naming them) and
// printed with them: each field is named only in its def_readwrite.
template <typename T>
py::class_<T> Record(py::module_& m, const char* name, const char* doc) {
  py::class_<T> cls(m, name, doc);
  cls.def(py::init([](const py::kwargs& fields) {
    T value{};
    const py::object self = py::cast(&value, py::return_value_policy::reference);
    const std::vector<std::string> names = FieldNames<T>();
    const std::string type = py::str(py::type::of<T>().attr("__name__"));
    for (const auto& [key, field] : fields) {
      const std::string text = py::str(key);
      if (std::ranges::find(names, text) == names.end()) {
        throw py::type_error(fmt::format("{}() has no field '{}'; its fields: {}", type, text,
                                         fmt::join(names, ", ")));
      }
      try {
        py::setattr(self, key, field);
      } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_TypeError)) throw;
        throw py::type_error(fmt::format("{}(): field '{}' cannot hold {} (its type or range)",
                                         type, text, std::string(py::repr(field))));
      }
    }
    return value;
  }));
  cls.def("__repr__", [](const py::object& self) -> std::string {
    std::vector<std::string> fields;
    for (const std::string& field : FieldNames<T>()) {
      fields.push_back(field + "=" + std::string(py::repr(self.attr(field.c_str()))));
    }
    return fmt::format("{}({})", std::string(py::str(py::type::of<T>().attr("__name__"))),
                       fmt::join(fields, ", "));
  });
  return cls;
}

// Every StepInfo field (engine/step_info.h: the one list the metrics file uses too).
py::dict StepInfoDict(const engine::StepInfo& info) {
  py::dict d;
  engine::ForEachStepInfoField(info, [&d](std::string_view name, const auto& value) {
    d[py::str(name.data(), name.size())] = value;
  });
  return d;
}

// One ZeroEngine and the Python buffers it works in (kept alive as long as it is).
class EngineHandle {
 public:
  // `params`: every parameter's buffers (the Param class: weights and grads in place, or a
  // stage-3 shard); `options`: the engine's, whose param_groups the params' `group` index.
  // `config` is a path or, with `config_is_text`, JSON text. Collective.
  EngineHandle(const std::string& config, bool config_is_text,
               const std::vector<ParamBuffers>& params, const engine::EngineOptions& options) {
    const comm::Communicator& world = World();
    const config::Config cfg =
        Value(config_is_text ? config::LoadConfigText(world, config, "(dict)")
                             : config::LoadConfig(world, config));
    // Bad parameters are agreed on before Create, so that every rank raises. The shards
    // Param::init copies from are `params`', alive through Create (it is the one caller);
    // `init_live` turns a later call into an error instead of a read of freed memory.
    auto init_live = std::make_shared<bool>(true);
    Result<std::vector<engine::Param>> list = EngineParams(params, init_live, &buffers_);
    Check(world.AgreeOnStatus(list ? OkStatus() : Status(list.error())));
    const std::vector<engine::Param> again = *list;  // for a second Create after a take-over
    auto create = [&](std::vector<engine::Param> registered) {
      py::gil_scoped_release release;
      return engine::ZeroEngine::Create(world, cfg, std::move(registered), options);
    };
    Result<std::unique_ptr<engine::ZeroEngine>> created = create(std::move(*list));
    if (!created && created.error().code() == ErrorCode::kAlreadyExists) {
      const Status taken = TakeOverOwnStore(world, cfg, created.error());
      created = taken ? create(again) : Result<std::unique_ptr<engine::ZeroEngine>>(taken.error());
    }
    *init_live = false;
    engine_ = Value(std::move(created));
    serial_ = GetRuntime().next_serial++;
    GetRuntime().engines.push_back(this);
  }

  ~EngineHandle() {
    Forget();
    if (engine_ && !engine_->closed() && GetRuntime().session) {
      // Dropped without close(): open until finalize() closes it with the other ranks'. A rank
      // waiting for this one in any other call ends the job.
      engine_->Detach("its optimizer was dropped without close(); zinf closes it at exit");
      GetRuntime().orphans.push_back(
          {.serial = serial_, .engine = std::move(engine_), .buffers = std::move(buffers_)});
    }
    if (engine_) {
      py::gil_scoped_release release;
      engine_.reset();  // local: ZeroEngine's destructor tells the other ranks
    }
  }

  std::uint64_t serial() const { return serial_; }

  // Collective over the engine's communicator: every rank is in the call `call` and none has a
  // problem (`message` empty), else the agreed error is raised on every rank.
  void Agree(const std::string& call, const std::string& code, const std::string& message) {
    const Status local = Problem(code, message);
    engine::ZeroEngine& engine = Open();
    Status status = [&] {
      py::gil_scoped_release release;
      return engine.AgreeOnCall(call, local);
    }();
    Check(status);
  }

  EngineHandle(const EngineHandle&) = delete;
  EngineHandle& operator=(const EngineHandle&) = delete;

 private:
  // Create failed with AlreadyExists, which the swap store says when another instance of the
  // job holds it: that may be this process's own optimizer on the same nvme_path. Collective over
  // `world` (every rank's Create failed alike). When every rank holds the store in the same
  // optimizer dropped without close() (an Orphan, open until exit), that one is closed now,
  // collectively as at exit, and OK returned: the new optimizer takes its store over (the caller
  // creates again). When some rank holds it in an optimizer still open, or in one dropped on
  // some ranks only, returns `failed` saying so; otherwise `failed` as it is (another process).
  static Status TakeOverOwnStore(const comm::Communicator& world, const config::Config& cfg,
                                 const Error& failed) {
    Runtime& rt = GetRuntime();
    auto shares_path = [&cfg](const config::Config& other) {
      for (const std::string& a : cfg.zero_optimization.offload_optimizer.resolved_nvme_paths) {
        for (const std::string& b : other.zero_optimization.offload_optimizer.resolved_nvme_paths) {
          std::error_code ec;
          if (a == b || std::filesystem::equivalent(a, b, ec)) return true;
        }
      }
      return false;
    };
    std::int64_t live = 0;
    for (const EngineHandle* e : rt.engines) {
      if (e->engine_ && shares_path(e->engine_->config())) live = 1;
    }
    std::int64_t orphan = -1;  // the newest dropped optimizer on the path
    for (const Orphan& o : rt.orphans) {
      if (shares_path(o.engine->config())) {
        orphan = std::max(orphan, static_cast<std::int64_t>(o.serial));
      }
    }
    // Under MAX: open somewhere, the newest orphan, and minus the oldest (-1 on a rank without).
    std::array<std::int64_t, 3> facts = {live, orphan, -orphan};
    Status reduced = [&] {
      py::gil_scoped_release release;
      return world.AllreduceInPlace<std::int64_t>(facts, comm::ReduceOp::kMax);
    }();
    ZINF_RETURN_IF_ERROR(reduced);
    const bool open_somewhere = facts[0] > 0;
    const std::int64_t newest = facts[1];
    const std::int64_t oldest = -facts[2];
    if (!open_somewhere && newest >= 0 && newest == oldest) return CloseOrphanForTakeOver(newest);
    std::string why;
    if (open_somewhere) {
      why =
          "another ZeroOptimizer of this process, still open, holds this swap store: close() it "
          "before creating a new one on the same nvme_path and job (`opt = ZeroOptimizer(...)` "
          "creates the new one before the old one is dropped), or give the new one another "
          "zinf.job_id";
    } else if (newest >= 0) {
      why =
          "an optimizer of this process dropped without close() holds this swap store (zinf "
          "keeps a dropped optimizer open until exit, where it is closed with the other ranks'), "
          "but not every rank dropped the same one: close() an optimizer on every rank before "
          "creating a new one on the same nvme_path and job";
    } else {
      return Status(failed);
    }
    return Error(failed.code(), fmt::format("{}: {}", why, failed.message()), failed.sys_errno());
  }

 public:
  // Local: every group's lr, betas, eps and weight_decay for the next Step (dicts, in order).
  void SetHyperParams(const py::list& groups) {
    std::vector<engine::HyperParams> values;
    for (const py::handle& item : groups) {
      const auto group = item.cast<py::dict>();
      values.push_back({.lr = group["lr"].cast<double>(),
                        .betas = group["betas"].cast<std::array<double, 2>>(),
                        .eps = group["eps"].cast<double>(),
                        .weight_decay = group["weight_decay"].cast<double>()});
    }
    Check(Open().SetHyperParams(values));
  }

  // What the next Step uses for every group: dicts of lr, betas, eps, weight_decay.
  py::list HyperParams() {
    engine::ZeroEngine& engine = Open();
    py::list out;
    for (std::size_t g = 0; g < engine.num_param_groups(); ++g) {
      const engine::HyperParams h = engine.next_hyper_params(g);
      py::dict d;
      d["lr"] = h.lr;
      d["betas"] = py::make_tuple(h.betas[0], h.betas[1]);
      d["eps"] = h.eps;
      d["weight_decay"] = h.weight_decay;
      out.append(d);
    }
    return out;
  }

  py::dict Step(std::optional<double> loss) {
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    Result<engine::StepInfo> info = [&] {
      py::gil_scoped_release release;
      return engine.Step(loss);
    }();
    return StepInfoDict(Value(std::move(info)));
  }

  void AccumulateGradients() {
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    Status status = [&] {
      py::gil_scoped_release release;
      return engine.AccumulateGradients();
    }();
    Check(status);
  }

  // Collective: ZeroEngine::DropGradients (zero_grad() after gradients were handed).
  void DropGradients() {
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    Status status = [&] {
      py::gil_scoped_release release;
      return engine.DropGradients();
    }();
    Check(status);
  }

  // Collective (stage 3): the whole weights of the parameters `indices` (positions in the
  // registration), as new float32 arrays of their numel elements. The engine's Gathered scope is
  // released before the call returns: the arrays are copies the caller owns.
  py::list Gather(const std::vector<std::size_t>& indices) {
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    Result<engine::Gathered> result = [&] {
      py::gil_scoped_release release;
      return engine.GatherByIndex(indices);
    }();
    engine::Gathered gathered = Value(std::move(result));
    py::list out;
    for (std::size_t i = 0; i < gathered.size(); ++i) {
      const std::span<const float> weights = gathered[i];
      py::array_t<float> array(static_cast<py::ssize_t>(weights.size()));
      std::copy(weights.begin(), weights.end(), array.mutable_data());
      out.append(std::move(array));
    }
    gathered.Release();
    return out;
  }

  // Local: parameter `index`'s lent gradient of this micro-batch (copied before the call
  // returns). Its errors are this rank's (the next step reports them on every rank).
  // The gradient in the registered grads buffer (overlap_backward), or a lent one (copied).
  void GradientReady(std::size_t index, const std::optional<py::buffer>& grad) {
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    if (!grad) {
      Status status = [&] {
        py::gil_scoped_release release;
        return engine.GradientReady(index);
      }();
      if (!status) Raise(status.error(), /*agreed=*/false);
      return;
    }
    const py::buffer& given = *grad;
    const std::int64_t numel = given.request(/*writable=*/false).size;
    Result<std::span<float>> span =
        FloatSpan(given, numel, fmt::format("gradient_ready({})", index), /*writable=*/false);
    if (!span) Raise(span.error(), /*agreed=*/false);
    Status status = [&] {
      py::gil_scoped_release release;
      return engine.GradientReady(index, std::span<const float>(*span));
    }();
    if (!status) Raise(status.error(), /*agreed=*/false);
  }

  py::dict GatherCounters() {
    const engine::GatherCounters& c = Open().gather_counters();
    py::dict d;
    d["calls"] = c.calls;
    d["asked"] = c.asked;
    d["gathered"] = c.gathered;
    d["prefetched"] = c.prefetched;
    d["served"] = c.served;
    d["disk_reads"] = c.disk_reads;
    d["read_ahead"] = c.read_ahead;
    d["disk_waits"] = c.disk_waits;
    d["peak_live_elems"] = c.peak_live_elems;
    return d;
  }

  std::size_t num_partitioned_params() { return Open().num_partitioned_params(); }

  // `user_state`: JSON text of an object (or "null").
  // Collective: ZeroEngine::Load (a failure leaves the engine as it was, but for a swap-store
  // I/O error part-way).
  void Load(const std::string& path) {
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    Status status = [&] {
      py::gil_scoped_release release;
      return engine.Load(path);
    }();
    Check(status);
  }

  py::dict SaveCheckpoint(const std::string& user_state, const std::string& dir) {
    // Bounded (depth, size, duplicate keys), as everything from outside the process.
    Result<Json> parsed = ParseJson(user_state);
    const Status local = parsed ? OkStatus()
                                : Status(InvalidArgumentError(fmt::format(
                                      "save_checkpoint: client_state is not valid JSON: {}",
                                      parsed.error().message())));
    const Json state = parsed ? std::move(*parsed) : Json();
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    Result<engine::SavedCheckpointInfo> saved = [&]() -> Result<engine::SavedCheckpointInfo> {
      py::gil_scoped_release release;
      ZINF_RETURN_IF_ERROR(engine.AgreeOnCall("save_checkpoint", local));
      return engine.SaveCheckpoint(state, dir);
    }();
    engine::SavedCheckpointInfo info = Value(std::move(saved));
    py::dict d;
    d["path"] = info.path;
    d["state_bytes"] = info.state_bytes;
    d["seconds"] = info.seconds;
    d["removed"] = info.removed;
    return d;
  }

  void LogSummary() {
    engine::ZeroEngine& engine = Open();  // raises with the GIL held
    Status status = [&] {
      py::gil_scoped_release release;
      return engine.LogSummary();
    }();
    Check(status);
  }

  void Close() {
    if (!engine_) return;
    // Destroyed once closed: its stop-signal handlers give Python's back. A close refused
    // because some rank is in another call leaves it open on every rank (at exit it is closed
    // again, collectively).
    Status status = [&] {
      py::gil_scoped_release release;
      Status closed = engine_->Close();
      if (engine_->closed()) engine_.reset();
      return closed;
    }();
    if (!engine_) Forget();
    Check(status);
  }

  // Local: ZeroEngine's destructor (this rank's store closed, the other ranks told).
  void CloseLocally() {
    Forget();
    py::gil_scoped_release release;
    engine_.reset();
  }

  std::int64_t step_count() { return Open().step_count(); }
  double next_lr() { return Open().next_lr(); }
  double loss_scale() { return Open().loss_scale(); }
  std::int64_t skipped_steps() { return Open().skipped_steps(); }
  std::string resumed_from() { return Open().resumed_from(); }
  int resumed_world_size() { return Open().resumed_world_size(); }
  std::string user_state() { return Open().user_state().dump(); }
  std::string effective_config() { return config::EffectiveConfigJson(Open().config()); }
  bool closed() const { return !engine_; }

 private:
  engine::ZeroEngine& Open() {
    if (!engine_) {
      Raise(FailedPreconditionError("the optimizer's engine is closed"), /*agreed=*/false);
    }
    return *engine_;
  }

  void Forget() {
    auto& engines = GetRuntime().engines;
    std::erase(engines, this);
  }

  std::unique_ptr<engine::ZeroEngine> engine_;
  std::vector<py::object> buffers_;
  std::uint64_t serial_ = 0;
};

py::dict Init() {
  Runtime& rt = GetRuntime();
  if (!rt.session) {
    // MPI_Init_thread accepts null argc/argv; Open MPI reads its settings from the environment.
    // Serialized: the engines reduce handed gradients on threads of their own during the
    // backward pass; zinf.torch makes its own MPI calls only while they are idle (an engine call
    // first waits for them: AgreeOnCall).
    Result<comm::MpiSession> session =
        comm::MpiSession::Init(nullptr, nullptr, comm::ThreadLevel::kSerialized);
    if (!session) Raise(session.error(), /*agreed=*/false);
    rt.session.emplace(std::move(*session));
  }
  const comm::Communicator& world = rt.session->world();
  py::dict d;
  d["rank"] = world.rank();
  d["world_size"] = world.size();
  d["local_rank"] = world.topology().local_rank;
  d["local_size"] = world.topology().local_size;
  d["node"] = world.topology().node;
  d["owns_mpi"] = rt.session->owns_mpi();
  return d;
}

// Closes every engine still open (collective: every rank exits at the same point, or the
// engines' agreed errors already ended the program alike), then ends the session.
void Finalize() {
  Runtime& rt = GetRuntime();
  // Newest first, open and dropped alike: the same order on every rank.
  for (;;) {
    auto handle = std::max_element(
        rt.engines.begin(), rt.engines.end(),
        [](const EngineHandle* a, const EngineHandle* b) { return a->serial() < b->serial(); });
    auto orphan =
        std::max_element(rt.orphans.begin(), rt.orphans.end(),
                         [](const Orphan& a, const Orphan& b) { return a.serial < b.serial; });
    if (handle == rt.engines.end() && orphan == rt.orphans.end()) break;
    if (orphan == rt.orphans.end() ||
        (handle != rt.engines.end() && (*handle)->serial() > orphan->serial)) {
      EngineHandle* e = *handle;
      try {
        e->Close();
      } catch (py::error_already_set& ex) {
        LogLine(LogLevel::kWarn, fmt::format("zinf: closing an optimizer at exit: {}", ex.what()));
        e->CloseLocally();  // a rank waiting for this one in a collective ends the job
      }
      continue;
    }
    Orphan dropped = std::move(*orphan);
    rt.orphans.erase(orphan);
    py::gil_scoped_release release;
    Status closed = dropped.engine->Close();
    if (!closed) {
      LogLine(LogLevel::kWarn, fmt::format("zinf: closing a dropped optimizer at exit: {}",
                                           closed.error().ToString()));
    }
    dropped.engine.reset();
  }
  if (rt.session) {
    Status status = rt.session->Finalize();
    rt.session.reset();
    if (!status) Raise(status.error(), /*agreed=*/false);
  }
}

// Ends every process of the job (MPI_Abort) after an ERROR line with `message`: for an
// exception one rank cannot report collectively (zinf's excepthook).
[[noreturn]] void AbortJob(const std::string& message) {
  LogLine(LogLevel::kError, message);
  std::fflush(stderr);
  comm::MpiSession::AbortJob(1);
}

// The module-level collectives below are over the world and each names the API call it belongs
// to (`call`: "gathered()", "ZeroOptimizer()", ...): its first agreement is tagged with it
// (Communicator::AgreeOnCall), so ranks in different calls all raise FailedPrecondition "the
// ranks are in different calls (rank 0 in gathered(), rank 1 in ZeroOptimizer()) ..." instead
// of matching one call's collective with another's (an MPI operation of other sizes that may
// never end).

// Collective: raises on every rank the agreed error when `message` is not empty on some rank.
void Agree(const std::string& code, const std::string& message, const std::string& call) {
  const Status local = Problem(code, message);
  const comm::Communicator& world = World();
  Status status = [&] {
    py::gil_scoped_release release;
    return world.AgreeOnCall(call, local);
  }();
  Check(status);
}

// Collective: raises on every rank `message` ("rank r: ..." for the lowest rank r whose `text`
// differs from rank 0's) when some rank's `text` differs from rank 0's.
void AgreeSame(const std::string& code, const std::string& message, const std::string& text,
               const std::string& call) {
  const comm::Communicator& world = World();
  std::string root_text = text;
  Status sent = [&]() -> Status {
    py::gil_scoped_release release;
    ZINF_RETURN_IF_ERROR(world.AgreeOnCall(call));  // every rank in `call` before the broadcast
    return world.BroadcastString(&root_text, 0);
  }();
  Check(sent);
  const Status local = Problem(code, root_text == text ? "" : message);
  Status status = [&] {
    py::gil_scoped_release release;
    return world.AgreeOnStatus(local);
  }();
  Check(status);
}

// Collective over the world: `recv` (float32, sum(counts) elements) gets every rank's `send`
// (counts[rank] elements) in rank order. For zinf.torch's partitioned parameters before an
// optimizer owns them (zinf.torch.gathered).
void Allgatherv(const py::buffer& send, const py::buffer& recv,
                const std::vector<std::int64_t>& counts, const std::string& call) {
  const comm::Communicator& world = World();
  std::int64_t total = 0;
  for (std::int64_t c : counts) total += c;
  Result<std::span<float>> in =
      counts.size() == static_cast<std::size_t>(world.size())
          ? FloatSpan(send, counts[world.rank()], "allgatherv send", /*writable=*/false)
          : InvalidArgumentError(
                fmt::format("allgatherv: {} counts for {} ranks", counts.size(), world.size()));
  Result<std::span<float>> out = in ? FloatSpan(recv, total, "allgatherv recv") : in;
  const Status local = out ? OkStatus() : Status(out.error());
  Status status = [&]() -> Status {
    py::gil_scoped_release release;
    ZINF_RETURN_IF_ERROR(world.AgreeOnCall(call, local));
    return world.Allgatherv<float>(*in, *out, counts);
  }();
  Check(status);
}

// Collective over the world: rank `root`'s float32 `data` into every rank's (the same size).
void Broadcast(const py::buffer& data, int root, const std::string& call) {
  const comm::Communicator& world = World();
  const std::int64_t numel = data.request(/*writable=*/true).size;
  Result<std::span<float>> span = FloatSpan(data, numel, "broadcast data");
  const Status local = span ? OkStatus() : Status(span.error());
  Status status = [&]() -> Status {
    py::gil_scoped_release release;
    ZINF_RETURN_IF_ERROR(world.AgreeOnCall(call, local));
    return world.Broadcast<float>(*span, root);
  }();
  Check(status);
}

// Local: how long the world's collectives (the ones above, zinf.torch's before an optimizer
// owns the parameters) wait for the other ranks before they end the job: the config's
// zinf.collective_timeout_seconds (default 600), set by zinf.torch.init(config) and by each
// ZeroOptimizer from its config. Every rank sets the same value.
void SetWaitTimeout(double seconds) {
  if (!(seconds >= 1 && seconds <= 7 * 24 * 3600)) {
    Raise(
        InvalidArgumentError(fmt::format(
            "set_wait_timeout: {} s; zinf.collective_timeout_seconds is in [1, 604800]", seconds)),
        /*agreed=*/false);
  }
  World();  // raises before zinf.init()
  GetRuntime().session->world().SetWaitTimeout(
      std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000)));
}

void Log(const std::string& level, const std::string& message) {
  LogLevel l = LogLevel::kInfo;
  if (!ParseLogLevel(level, &l)) {
    Raise(InvalidArgumentError("log: unknown level " + level), /*agreed=*/false);
  }
  if (LogEnabled(l)) LogLine(l, message);
}

// The module's constants and the world's functions (MPI, its collectives, the log).
void BindWorld(py::module_& m) {
  m.def("init", &Init, "Initializes or adopts MPI; returns the rank facts.");
  // Stage 3's shard rule (engine.h): zinf.torch.init partitions before any engine exists.
  m.attr("PARTITION_ALIGNMENT") = engine::kPartitionAlignmentElems;
  // The keys of Engine.step()'s dict, in order (zinf.torch.StepInfo's attributes).
  py::tuple step_fields(engine::StepInfoFieldNames().size());
  for (std::size_t i = 0; i < step_fields.size(); ++i) {
    const std::string_view name = engine::StepInfoFieldNames()[i];
    step_fields[i] = py::str(name.data(), name.size());
  }
  m.attr("STEP_INFO_FIELDS") = step_fields;
  // The names of the error codes (core/status.h), each one a class of zinf.errors.
  py::tuple codes(kErrorCodes.size());
  for (std::size_t i = 0; i < codes.size(); ++i) {
    const std::string_view name = ErrorCodeName(kErrorCodes[i]);
    codes[i] = py::str(name.data(), name.size());
  }
  m.attr("ERROR_CODES") = codes;
  m.def("finalize", &Finalize,
        "Closes the open engines and finalizes MPI if init() initialized it.");
  // The world's collectives, each tagged with the API call (`call`) it belongs to.
  m.def("agree", &Agree, py::arg("code"), py::arg("message"), py::kw_only(), py::arg("call"),
        "Collective in `call`: raises on every rank when some rank passes a message.");
  m.def("agree_same", &AgreeSame, py::arg("code"), py::arg("message"), py::arg("text"),
        py::kw_only(), py::arg("call"),
        "Collective in `call`: raises `message` on every rank, naming the lowest rank whose text "
        "differs from rank 0's, when some rank's does.");
  m.def("allgatherv", &Allgatherv, py::arg("send"), py::arg("recv"), py::arg("counts"),
        py::kw_only(), py::arg("call"),
        "Collective in `call`: every rank's float32 `send` into `recv`, in rank order.");
  m.def("broadcast", &Broadcast, py::arg("data"), py::arg("root"), py::kw_only(), py::arg("call"),
        "Collective in `call`: rank root's float32 `data` into every rank's.");
  m.def("set_wait_timeout", &SetWaitTimeout, py::arg("seconds"),
        "Local: the world's collectives wait this long for the other ranks, then end the job.");
  m.def("log", &Log, py::arg("level"), py::arg("message"));
  m.def("abort_job", &AbortJob, py::arg("message"),
        "Logs an ERROR line and ends every process of the job (MPI_Abort).");
}

// What Engine() takes: the parameters and the engine's options (engine.h's structs, whose
// comments say what each field does), each constructed by keyword.
void BindRecords(py::module_& m) {
  Record<ParamBuffers>(m, "Param", "One parameter for Engine(): its name, shape and buffers.")
      .def_readwrite("name", &ParamBuffers::name)
      .def_readwrite("shape", &ParamBuffers::shape)
      .def_readwrite("weights", &ParamBuffers::weights)
      .def_readwrite("grads", &ParamBuffers::grads)
      .def_readwrite("shard", &ParamBuffers::shard)
      .def_readwrite("shard_begin", &ParamBuffers::shard_begin)
      .def_readwrite("shard_on_disk", &ParamBuffers::shard_on_disk)
      .def_readwrite("group", &ParamBuffers::group);
  Record<engine::ParamGroup>(m, "ParamGroup",
                             "A param group's own lr, betas, eps and weight_decay (None: the "
                             "config optimizer's).")
      .def_readwrite("lr", &engine::ParamGroup::lr)
      .def_readwrite("betas", &engine::ParamGroup::betas)
      .def_readwrite("eps", &engine::ParamGroup::eps)
      .def_readwrite("weight_decay", &engine::ParamGroup::weight_decay);
  Record<engine::HostMemoryUse>(m, "HostMemoryUse",
                                "The caller's own host memory per rank, in the engine's plan.")
      .def_readwrite("name", &engine::HostMemoryUse::name)
      .def_readwrite("bytes", &engine::HostMemoryUse::bytes)
      .def_readwrite("shrink", &engine::HostMemoryUse::shrink);
  using engine::EngineOptions;
  Record<EngineOptions>(m, "EngineOptions", "The engine's options (engine::EngineOptions).")
      .def_readwrite("metrics_path", &EngineOptions::metrics_path)
      .def_readwrite("total_steps", &EngineOptions::total_steps)
      .def_readwrite("progress", &EngineOptions::progress)
      .def_readwrite("stop_signals", &EngineOptions::stop_signals)
      .def_readwrite("create_nvme_paths", &EngineOptions::create_nvme_paths)
      .def_readwrite("gradient_memory_limit_bytes", &EngineOptions::gradient_memory_limit_bytes)
      .def_readwrite("load", &EngineOptions::load)
      .def_readwrite("param_groups", &EngineOptions::param_groups)
      .def_readwrite("host_memory_uses", &EngineOptions::host_memory_uses);
}

void BindEngine(py::module_& m) {
  py::class_<EngineHandle>(m, "Engine")
      .def(py::init<const std::string&, bool, const std::vector<ParamBuffers>&,
                    const engine::EngineOptions&>(),
           py::arg("config"), py::arg("config_is_text"), py::arg("params"), py::arg("options"))
      .def("agree", &EngineHandle::Agree, py::arg("call"), py::arg("code"), py::arg("message"))
      .def("step", &EngineHandle::Step, py::arg("loss") = py::none())
      .def("accumulate_gradients", &EngineHandle::AccumulateGradients)
      .def("drop_gradients", &EngineHandle::DropGradients)
      .def("gather", &EngineHandle::Gather, py::arg("indices"))
      .def("gradient_ready", &EngineHandle::GradientReady, py::arg("index"),
           py::arg("grad") = py::none())
      .def("gather_counters", &EngineHandle::GatherCounters)
      .def("set_hyper_params", &EngineHandle::SetHyperParams, py::arg("groups"))
      .def("hyper_params", &EngineHandle::HyperParams)
      .def_property_readonly("num_partitioned_params", &EngineHandle::num_partitioned_params)
      .def("save_checkpoint", &EngineHandle::SaveCheckpoint, py::arg("user_state"), py::arg("dir"))
      .def("load", &EngineHandle::Load, py::arg("path"))
      .def("log_summary", &EngineHandle::LogSummary)
      .def("close", &EngineHandle::Close)
      .def_property_readonly("step_count", &EngineHandle::step_count)
      .def_property_readonly("next_lr", &EngineHandle::next_lr)
      .def_property_readonly("loss_scale", &EngineHandle::loss_scale)
      .def_property_readonly("skipped_steps", &EngineHandle::skipped_steps)
      .def_property_readonly("resumed_from", &EngineHandle::resumed_from)
      .def_property_readonly("resumed_world_size", &EngineHandle::resumed_world_size)
      .def_property_readonly("user_state", &EngineHandle::user_state)
      .def_property_readonly("effective_config", &EngineHandle::effective_config)
      .def_property_readonly("closed", &EngineHandle::closed);
}

}  // namespace
}  // namespace zinf::python

PYBIND11_MODULE(_zinf, m) {
  m.doc() = "zinf's engine (use zinf.torch.ZeroOptimizer; docs/python.md)";
  zinf::python::BindWorld(m);
  zinf::python::BindRecords(m);
  zinf::python::BindEngine(m);
}
