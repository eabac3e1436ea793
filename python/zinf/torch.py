"""zinf.torch: ZeroOptimizer, a torch.optim optimizer whose Adam state lives on NVMe.

    import torch, zinf.torch
    model = MyModel()                                   # the same initial weights on every rank
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config="ds.json")  # or a dict
    for batch in loader:                                # each rank its own shard of the data
        loss = model(batch).mean()
        opt.backward(loss)              # loss.backward() times opt.loss_scale (1 without fp16)
        info = opt.step(loss=loss)      # reduce-scatter, clip, lr, swapped Adam, all-gather
        opt.zero_grad()
        if info.step % 500 == 0:
            opt.save_checkpoint("ckpt", client_state={"epoch": epoch})
        if info.stop_requested:         # SIGUSR1/SIGTERM/Ctrl-C on some rank: save and stop
            opt.save_checkpoint("ckpt"); break

launched with ``mpirun -np N python3 train.py`` (or ``zinf-run -np N -- python3 train.py``).
The config is a DeepSpeed JSON file or dict (docs/deepspeed-keys.md); the optimizer, learning-rate
schedule, gradient clipping and batch sizes come from it. docs/python.md teaches the rest.
"""

import json
import os

import torch

import zinf
from zinf import _zinf

__all__ = ["ZeroOptimizer", "StepInfo", "log"]


def log(*args, level="info"):
    """zinf.log: one line on rank 0 (INFO), every rank for "warn" and "error"."""
    zinf.log(*args, level=level)


class StepInfo:
    """What one step did; the figures are the same on every rank.

    step (1-based), lr, loss (mean over ranks; NaN when no loss was passed), grad_norm (before
    clipping; with fp16 of the unscaled gradient, Inf or NaN on a skipped step), clipped,
    loss_scale (the scale this step's gradient carried; 1 without fp16), next_loss_scale (the
    one for the next step: ZeroOptimizer.loss_scale), skipped (fp16: an Inf or NaN in the
    gradient on some rank skipped the step: no weight changed, no swap I/O, the schedule did not
    advance), skipped_steps (skipped steps so far, this one included), step_seconds and
    optimizer_seconds (slowest rank), swap_read_bytes and
    swap_write_bytes (all ranks, since the previous step), read_bytes_per_element and
    write_bytes_per_element (the optimizer step's swap bytes per parameter element: about 12 with
    zinf.optimizer_state fp32, about 6 with q8), peak_rss_bytes (largest rank),
    stop_requested (a stop signal arrived on some rank) and stop_signal (this rank's, 0 if none).
    """

    __slots__ = ("step", "lr", "loss", "grad_norm", "clipped", "loss_scale", "next_loss_scale",
                 "skipped", "skipped_steps", "step_seconds",
                 "optimizer_seconds", "swap_read_bytes", "swap_write_bytes",
                 "optimizer_swap_read_bytes", "optimizer_swap_write_bytes",
                 "read_bytes_per_element", "write_bytes_per_element", "peak_rss_bytes",
                 "stop_requested", "stop_signal")

    def __init__(self, fields):
        for key in self.__slots__:
            setattr(self, key, fields[key])

    def __repr__(self):
        return "StepInfo(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


class _Registered:
    """One parameter as the engine sees it: the tensor, its name and the host buffers."""

    def __init__(self, name, param, weights, grads):
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.dtype = param.dtype
        self.device = param.device
        # Staged: a CUDA or a float16/bfloat16 parameter, copied through fp32 host buffers
        # around every step. Otherwise (float32 on the CPU) used in place.
        self.staged = _staged(param)
        self.weights = weights  # in place: param.detach(), its memory; staged: an fp32 copy
        self.grads = grads      # private: an in-place parameter's .grad is a view of it
        # The parameter's memory and layout as registered (held, so that no later tensor takes
        # its address), and the addresses the engine was given.
        self.view = param.detach()
        self.addresses = (weights.data_ptr(), grads.data_ptr())


# Parameter dtypes besides float32, and the config block that must enable them: the engine
# rounds the working weights it writes to that precision, so copying them into the parameter
# is exact.
_HALF_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _staged(p):
    return p.device.type != "cpu" or p.dtype != torch.float32


def _shape(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _relayout(registered, t):
    """How `t` differs from `registered` in memory or layout ("" if it does not)."""
    if t.layout != torch.strided:
        return f"a {t.layout} tensor"
    changes = []
    if t.data_ptr() != registered.data_ptr():
        changes.append("in other memory")
    if t.stride() != registered.stride():
        changes.append(f"with strides {tuple(t.stride())} instead of {tuple(registered.stride())}")
    return "a tensor " + " and ".join(changes) if changes else ""


def _overlaps(a, b):
    """Whether two strided CPU tensors' elements may share bytes."""
    def span(t):
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()
    if a.numel() == 0 or b.numel() == 0 or a.device.type != "cpu" or b.device.type != "cpu":
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


class ZeroOptimizer(torch.optim.Optimizer):
    """A drop-in torch optimizer whose Adam/AdamW state is a ZeRO partition per MPI rank on NVMe.

    Every rank holds the whole model (the same initial weights on every rank) and computes the
    gradient of its own mean loss; step() reduce-scatters the gradients, clips them, runs the
    swapped Adam step of the config's optimizer at the config's learning-rate schedule on this
    rank's partition (fp32 master weights, exp_avg and exp_avg_sq on offload_optimizer.nvme_path),
    and all-gathers the new weights into the parameters. Collective: every rank makes the same
    calls in the same order; every error is raised on every rank alike (zinf.errors).

    Parameters:
      params: model.named_parameters() (names are what checkpoints match on), or parameters
        (named "param.<i>"), or one param group {"params": ...}. Parameters must be contiguous,
        on the CPU or a CUDA device, and float32, or float16 with the config's fp16.enabled, or
        bfloat16 with bf16.enabled. float32 CPU parameters are used in place (no copy of weights
        or gradients); CUDA and float16/bfloat16 parameters are staged through fp32 host
        buffers around every step (pinned for CUDA). Frozen parameters
        (requires_grad False) are left out. Per-group hyper-parameters are not supported: the
        config's optimizer applies to every parameter.
      config: a DeepSpeed config file path or dict. offload_optimizer.device must be "nvme".
      load: restore this checkpoint (a file, or a directory's `latest`) instead of the config's
        zinf.checkpoint.load ("latest", "auto", a path).
      metrics_path: rank 0 appends one JSON object per step there.
      total_steps: the loop's last step, for the live progress line's ETA.
      progress: the log line every steps_per_print steps and the live line on a terminal.
      stop_signals: SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 set StepInfo.stop_requested while the
        optimizer is open instead of interrupting the program (as zinf-train: save, then stop).
      create_nvme_paths: create missing nvme_path directories (off: a missing one is an error).
      gradient_memory_limit: with zinf.swap_gradients, bytes of accumulated gradient kept in
        memory per rank before it is written behind to NVMe.

    Gradients: the engine reads them from fp32 buffers of its own; a float32 CPU parameter's
    .grad is a view of its buffer, kept for the optimizer's whole life (zero_grad zeroes it and
    puts it back, also with set_to_none=True). A .grad the program replaced (p.grad = t,
    p.grad.data = t, p.grad.set_(t)) is copied in at the next step when it is a dense
    floating-point tensor of the parameter's shape on its device or the CPU (any strides, any
    floating dtype: cast to float32), and refused on every rank otherwise (an integer, bool or
    complex dtype, another shape or device, a sparse tensor: FailedPreconditionError naming the
    parameter); a .grad set to None counts as zero. A parameter must keep its shape, dtype,
    device, memory and layout: a .data replaced, also by a view of the same memory
    (p.data = p.data.t()), is refused at the next step. With gradient_accumulation_steps k in
    the config, a step stands for k micro-batches per rank: either run k backward passes and
    call step(), or call accumulate_gradients() after each micro-batch but the last.

    fp16 (the config's fp16 block, DeepSpeed's loss scaling): the loop calls opt.backward(loss)
    instead of loss.backward(), which differentiates loss * opt.loss_scale, and passes the
    unscaled loss to step(loss=...). A step whose gradient holds an Inf or NaN on some rank is
    skipped on every rank (StepInfo.skipped: no weight changes, the gradients are zeroed) and
    the scale lowered; clean steps raise it again. The fp32 master weights live in the swapped
    state, starting as the parameters' values; the working weights are rounded to fp16.
    """

    def __init__(self, params, config, *, load=None, metrics_path=None, total_steps=0,
                 progress=True, stop_signals=True, create_nvme_paths=False,
                 gradient_memory_limit=256 << 20):
        facts = zinf.init()
        self.rank = facts["rank"]
        self.world_size = facts["world_size"]
        self.local_rank = facts["local_rank"]
        self._engine = None
        self._last_checkpoint = None
        problem = ""
        try:
            named = self._named(params)
            config_text, is_text = self._config(config)
            super().__init__([p for _, p in named], {"lr": 0.0})
            self._params = [self._register(name, p) for name, p in named]
        except Exception as e:  # any local failure is agreed on, so that no rank waits alone
            problem = (str(e) if isinstance(e, (TypeError, ValueError))
                       else f"{type(e).__name__}: {e}")
        _zinf.agree("InvalidArgument", problem)
        self._options = {
            "metrics_path": "" if metrics_path is None else os.fspath(metrics_path),
            "total_steps": int(total_steps),
            "progress": bool(progress),
            "stop_signals": bool(stop_signals),
            "create_nvme_paths": bool(create_nvme_paths),
            "gradient_memory_limit_bytes": int(gradient_memory_limit),
        }
        self._config_source = (config_text, is_text)
        self._open(None if load is None else os.fspath(load))

    # --- construction -------------------------------------------------------------------------

    @staticmethod
    def _named(params):
        if isinstance(params, torch.Tensor):
            raise TypeError("params: expected an iterable of parameters or (name, parameter) "
                            "pairs, got a single tensor")
        items = list(params)
        if len(items) == 1 and isinstance(items[0], dict):
            group = items[0]
            extra = sorted(set(group) - {"params"})
            if extra:
                raise ValueError(f"params: param group options {extra} are not supported; the "
                                 "config's optimizer applies to every parameter")
            items = list(group["params"])
        named, seen = [], set()
        for i, item in enumerate(items):
            if isinstance(item, dict):
                raise ValueError("params: several param groups are not supported; the config's "
                                 "optimizer applies to every parameter")
            if isinstance(item, tuple) and len(item) == 2:
                name, p = item
            else:
                name, p = f"param.{i}", item
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params: {name} is a {type(p).__name__}, not a tensor")
            if not p.requires_grad:
                continue  # frozen: not optimized
            if id(p) in seen:
                raise ValueError(f"params: {name} is given twice")
            seen.add(id(p))
            if p.dtype != torch.float32 and p.dtype not in _HALF_DTYPES:
                raise ValueError(f"parameter {name} is {p.dtype}; zinf steps float32 parameters, "
                                 "float16 ones with the config's fp16.enabled and bfloat16 ones "
                                 "with bf16.enabled (convert the model with model.float())")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"parameter {name} is on {p.device}; zinf supports CPU and CUDA "
                                 "parameters")
            if not p.is_contiguous():
                raise ValueError(f"parameter {name} is not contiguous")
            named.append((str(name), p))
        if not named:
            raise ValueError("params: no parameter that requires a gradient")
        return named

    @staticmethod
    def _config(config):
        if isinstance(config, dict):
            try:
                return json.dumps(config), True
            except (TypeError, ValueError) as e:
                raise TypeError(f"config: the dict is not JSON: {e}") from None
        if isinstance(config, (str, os.PathLike)):
            return os.fspath(config), False
        raise TypeError(f"config: expected a path or a dict, got {type(config).__name__}")

    @staticmethod
    def _register(name, p):
        # The engine's gradient buffer is private: an in-place parameter's .grad is a view of it,
        # so that a program replacing the view's data (p.grad.data = t, p.grad.set_(t)) never
        # frees or moves the memory the engine reads.
        pin = p.device.type == "cuda"
        grads = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
        if not _staged(p):
            r = _Registered(name, p, p.detach(), grads)
            problem = ZeroOptimizer._gradient_in(r)  # a .grad from before counts at the first step
            if problem:
                raise ValueError(problem)
            return r
        # fp32 host buffers; the weights start as the parameter's values exactly (fp16 and bf16
        # widen to fp32 without rounding), and so does the fp32 master in the swapped state.
        # A staged .grad is copied in at every step (from before: at the first).
        weights = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
        weights.copy_(p.detach())
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return _Registered(name, p, weights, grads)

    def _open(self, load):
        options = dict(self._options, load=load)
        buffers = []
        for r in self._params:  # NumPy views: the engine's buffers are these tensors' memory
            buffers.append((r.name, list(r.shape), r.weights.numpy(), r.grads.numpy()))
        config_text, is_text = self._config_source
        self._engine = _zinf.Engine(config_text, is_text, buffers, options)
        settings = json.loads(self._engine.effective_config)
        try:  # every rank has the same config: they agree unless their parameters differ
            _zinf.agree("InvalidArgument", self._check_precision(settings))
        except Exception:
            self._engine.close()
            raise
        for r in self._params:
            if r.staged:  # the restored (or initial) weights into the parameter
                r.param.data.copy_(r.weights, non_blocking=False)
        optimizer = settings.get("optimizer", {}).get("params", {})
        for group in self.param_groups:
            group["lr"] = self._engine.next_lr
            for key in ("betas", "eps", "weight_decay"):
                if key in optimizer:
                    group[key] = tuple(optimizer[key]) if key == "betas" else optimizer[key]
        self._lr_set = self._engine.next_lr

    def _check_precision(self, settings):
        """float16/bfloat16 parameters need the config block that rounds the working weights
        to their precision; returns the problem ("" if none)."""
        for r in self._params:
            block = _HALF_DTYPES.get(r.dtype)
            if block is None:
                continue
            enabled = settings.get(block, {})
            enabled = enabled.get("enabled", False) if isinstance(enabled, dict) else False
            if not enabled:
                return (f"parameter {r.name} is {r.dtype}, but the config's {block}.enabled is "
                        f"not true: set \"{block}\": {{\"enabled\": true}} for {r.dtype} "
                        "parameters, or convert the model with model.float()")
        return ""

    # --- the loop -----------------------------------------------------------------------------

    @property
    def global_step(self):
        """The last step applied (0 before the first; the checkpoint's after a restore)."""
        return self._open_engine().step_count

    @property
    def loss_scale(self):
        """The factor the loss is multiplied by before the backward pass for the next step:
        fp16's dynamic (or static) loss scale, 1.0 without fp16. backward() applies it."""
        return self._open_engine().loss_scale

    @property
    def skipped_steps(self):
        """Steps skipped for an fp16 overflow so far (a checkpoint keeps the count)."""
        return self._open_engine().skipped_steps

    def scale_loss(self, loss):
        """loss * loss_scale, computed in float32 for a tensor (an fp16 loss times a scale of
        2^16 would overflow): what backward() differentiates. For loops that call backward
        themselves (torch.autograd.grad, a custom backward)."""
        scale = self.loss_scale
        if isinstance(loss, torch.Tensor):
            return loss.float() * scale
        return loss * scale

    def backward(self, loss, retain_graph=False):
        """(loss * loss_scale).backward(): the gradients of the scaled loss into .grad, as
        DeepSpeed's engine.backward. Use it instead of loss.backward() with fp16; without fp16
        the scale is 1 and it is loss.backward(). step() divides the scale out."""
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def _open_engine(self):
        if self._engine is None or self._engine.closed:
            raise zinf.errors.FailedPreconditionError("the optimizer is closed",
                                                      "FailedPrecondition")
        return self._engine

    def _check_and_stage(self, call, loss=None):
        """Local checks before the collective call `call`, agreed on every rank (and that every
        rank is in that call), with the gradients put into the registered buffers (CUDA: device
        to pinned host). Returns `loss` as a float."""
        try:
            if isinstance(loss, torch.Tensor):
                loss = float(loss.detach().float().mean())
            elif loss is not None:
                loss = float(loss)
            problem = self._stage()
        except Exception as e:  # agreed below, so that no rank waits alone
            problem = f"{type(e).__name__}: {e}"
        self._open_engine().agree(call, "FailedPrecondition", problem)
        return loss

    def _stage(self):
        for group in self.param_groups:
            if group["lr"] != self._lr_set:
                return (f"param_groups[...]['lr'] was set to {group['lr']}; the learning rate "
                        "comes from the config's scheduler (read it, do not set it)")
        for r in self._params:
            problem = self._parameter_problem(r) or self._gradient_in(r)
            if problem:
                return problem
        return ""

    @staticmethod
    def _parameter_problem(r):
        """What changed in a parameter since it was registered that the engine cannot follow
        ("" if nothing): it keeps the weights of the registered tensor, element by element as
        laid out then, and (in place) writes the new ones into that memory."""
        p = r.param
        if (r.weights.data_ptr(), r.grads.data_ptr()) != r.addresses:
            return (f"parameter {r.name}: the memory the optimizer registered for it was "
                    "reallocated (resize_() or share_memory_() on a tensor or storage sharing "
                    "it); create the optimizer after the model is final")
        if tuple(p.shape) != r.shape:
            return (f"parameter {r.name} changed shape from {_shape(r.shape)} to "
                    f"{_shape(p.shape)}; the optimizer's state is laid out for the shapes it was "
                    "created with: create a new optimizer (and checkpoint) for the new model")
        if p.dtype != r.dtype or p.device != r.device:
            return (f"parameter {r.name} changed from {r.dtype} on {r.device} to {p.dtype} on "
                    f"{p.device}; create the optimizer after moving or converting the model")
        change = _relayout(r.view, p)
        if change:
            return (f"parameter {r.name}: its .data was replaced by {change}; the optimizer "
                    "updates the tensor it registered, element by element as laid out then, so "
                    "this gradient would update other elements: create the optimizer after the "
                    "model is final")
        return ""

    @staticmethod
    def _is_registered_grad(r, g):
        """Whether `g` is an in-place parameter's .grad as registered: a view of r.grads."""
        return (not r.staged and g.dtype == torch.float32 and tuple(g.shape) == r.shape
                and not _relayout(r.grads, g))

    @staticmethod
    def _gradient_in(r):
        """Puts the parameter's .grad into the engine's fp32 buffer r.grads (None: zeros), copied
        and cast unless it is the registered view; an in-place parameter's .grad is that view
        again. Returns the problem ("" if none), the buffer untouched then."""
        p, g = r.param, r.param.grad
        if g is not None and ZeroOptimizer._is_registered_grad(r, g):
            return ""
        if g is None:
            r.grads.zero_()
        else:
            wrong = ""
            if g.layout != torch.strided:
                wrong = f"is a {g.layout} tensor"
            elif not g.dtype.is_floating_point:
                wrong = f"is {g.dtype}"
            elif tuple(g.shape) != r.shape:
                wrong = f"has shape {_shape(g.shape)}, not {_shape(r.shape)}"
            elif g.device != r.device and g.device.type != "cpu":
                wrong = f"is on {g.device}, the parameter on {r.device}"
            if wrong:
                return (f"parameter {r.name}: its .grad {wrong}; a replaced .grad is copied in "
                        "when it is a dense floating-point tensor of the parameter's shape, on "
                        "its device or the CPU")
            # fp16/bf16/fp64 to fp32 (an fp16 Inf stays Inf: skipped with fp16); a view of the
            # buffer's own memory in another layout through a copy.
            r.grads.copy_(g.clone() if _overlaps(g, r.grads) else g)
        if not r.staged:
            p.grad = r.grads.detach()
        return ""

    def _after_step(self):
        # The engine zeroed the registered grads; staged parameters get the new weights (a
        # skipped step left them as they were) and their own .grad zeroed.
        for r in self._params:
            if r.staged:
                r.param.data.copy_(r.weights, non_blocking=False)
                if r.param.grad is not None:
                    r.param.grad.zero_()
        self._lr_set = self._engine.next_lr
        for group in self.param_groups:
            group["lr"] = self._lr_set

    @torch.no_grad()
    def step(self, closure=None, *, loss=None):
        """One optimizer step (collective) for the gradients in the parameters' .grad; returns a
        StepInfo. `loss` (a number or a one-element tensor: this rank's loss, unscaled with
        fp16) is for the log, the metrics and StepInfo.loss; with `closure` its return value is
        the loss. With fp16 a gradient holding an Inf or NaN on some rank skips the step on
        every rank (StepInfo.skipped: weights unchanged, gradients zeroed, loss scale adjusted).
        Raises on every rank, with nothing stepped, for a non-finite loss, a non-finite gradient
        norm without fp16, an fp16 overflow at fp16.min_loss_scale, a gradient that is zero on
        every rank, or a parameter that changed since the optimizer was created."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._open_engine()
        info = StepInfo(engine.step(self._check_and_stage("step()", loss)))
        self._after_step()
        return info

    @torch.no_grad()
    def accumulate_gradients(self):
        """Hands this micro-batch's gradient to the engine (reduce-scatter; with
        zinf.swap_gradients written behind to NVMe) and zeroes .grad: call it after every
        micro-batch of a step but the last (gradient_accumulation_steps). Collective."""
        engine = self._open_engine()
        self._check_and_stage("accumulate_gradients()")
        engine.accumulate_gradients()
        for r in self._params:
            if r.staged and r.param.grad is not None:
                r.param.grad.zero_()

    @torch.no_grad()
    def zero_grad(self, set_to_none=False):
        """Zeroes the gradients. The engine reads an in-place parameter's .grad where it is, so
        .grad is (again) the registered tensor, zeroed, also with set_to_none=True; a staged
        parameter's .grad is zeroed (a replaced one of another dtype, shape, device or layout
        becomes zeros like the parameter). step() already leaves them zero."""
        for r in self._params:
            p, g = r.param, r.param.grad
            r.grads.zero_()
            if not r.staged:
                if g is None or not self._is_registered_grad(r, g):
                    p.grad = r.grads.detach()
            elif g is None:
                continue
            elif (g.layout == torch.strided and g.dtype == p.dtype and g.shape == p.shape
                  and g.device == p.device):
                g.zero_()
            else:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, dir=None, client_state=None):
        """Saves step `global_step` collectively into one HDF5 file <dir>/step-<N>.h5 (dir: the
        config's zinf.checkpoint.dir when None) and points <dir>/latest at it; keep_last from
        the config. `client_state` (a JSON-serializable dict, the same on every rank: a rank
        whose client_state differs from rank 0's is an InvalidArgumentError on every rank naming
        it) is stored and returned by load_checkpoint. Returns the file's path."""
        engine = self._open_engine()
        problem = ""
        try:
            if client_state is not None and not isinstance(client_state, dict):
                raise TypeError(f"client_state must be a dict, not {type(client_state).__name__}")
            # Compared across ranks as JSON with sorted keys (the checkpoint keeps them sorted).
            text = json.dumps(json.loads(json.dumps(client_state, allow_nan=False)),
                              sort_keys=True)
        except Exception as e:  # TypeError, ValueError, RecursionError, ...
            problem, text = f"save_checkpoint: client_state is not JSON-serializable: {e}", "null"
        engine.agree("save_checkpoint()", "InvalidArgument", problem)
        _zinf.agree_same("InvalidArgument", "save_checkpoint: client_state differs from rank "
                         "0's; a checkpoint keeps one client_state: pass the same on every rank",
                         text)
        saved = engine.save_checkpoint(text, "" if dir is None else os.fspath(dir))
        self._last_checkpoint = saved["path"]
        return saved["path"]

    def load_checkpoint(self, path):
        """Restores a checkpoint (a file, or a directory whose `latest` names one), saved on any
        number of ranks, into this optimizer and the parameters' weights; returns the
        client_state that was saved with it (None if none). Collective. The parameters must be
        the same (names and shapes) as when it was saved. The optimizer closes its engine and
        reopens it from the file: after a failed load (a missing or corrupt file, other
        parameters) the optimizer is closed, as the error says; create a new one
        (ZeroOptimizer(..., load=path)) to go on."""
        path = os.fspath(path)
        self._open_engine().close()
        try:
            self._open(path)
        except zinf.ZinfError as e:
            e.message += ("; load_checkpoint closed the optimizer to reopen it from the file, so "
                          "it is closed now: create a new one to go on")
            e.args = (e.message,)
            raise
        self._last_checkpoint = self._engine.resumed_from
        return json.loads(self._engine.user_state)

    @property
    def resumed_from(self):
        """The checkpoint file this optimizer restored ("" when it started fresh)."""
        return self._open_engine().resumed_from

    @property
    def client_state(self):
        """The client_state of the checkpoint restored (None when none was)."""
        return json.loads(self._open_engine().user_state)

    def state_dict(self):
        """The optimizer's small metadata, not its state: the Adam state lives on NVMe and is
        never pulled into memory. The dict points at the checkpoint file last saved or loaded
        (call save_checkpoint first); load_state_dict restores from that file."""
        return {
            "state": {},
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"}
                | {"params": list(range(len(g["params"])))} for g in self.param_groups
            ],
            "zinf": {
                "checkpoint": self._last_checkpoint,
                "step": self.global_step,
                "world_size": self.world_size,
                "names": [r.name for r in self._params],
            },
        }

    def load_state_dict(self, state_dict):
        """Restores from the checkpoint file a state_dict() points at (collective)."""
        meta = state_dict.get("zinf") if isinstance(state_dict, dict) else None
        problem = ""
        if not isinstance(meta, dict) or "checkpoint" not in meta:
            problem = "load_state_dict: not a zinf.torch.ZeroOptimizer state_dict"
        elif meta["checkpoint"] is None and meta.get("step", 0) != 0:
            problem = ("load_state_dict: the state_dict names no checkpoint file (save_checkpoint "
                       "was not called before state_dict)")
        _zinf.agree("InvalidArgument", problem)
        if meta["checkpoint"] is not None:
            self.load_checkpoint(meta["checkpoint"])

    # --- the end ------------------------------------------------------------------------------

    def log_summary(self):
        """Logs the timers (min/mean/max over ranks) and the swap bandwidth per node on rank 0.
        Collective."""
        self._open_engine().log_summary()

    def close(self):
        """Closes the engine (collective): removes the swap store unless zinf.keep_swap. The
        optimizers still open at exit are closed then. A rank that is in another call (step)
        meanwhile makes every rank raise FailedPreconditionError naming the calls, and the
        optimizer stays open. An optimizer dropped without close() stays open until exit; a
        rank that waits for it in any other call meanwhile ends the job (docs/python.md, "When
        a rank fails")."""
        if self._engine is not None and not self._engine.closed:
            self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
