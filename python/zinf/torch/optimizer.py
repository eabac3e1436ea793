"""ZeroOptimizer: the torch.optim optimizer over zinf's engine (the swapped Adam state, the
gradients' hand-over, the checkpoints), with the AccumulateGrad hooks that hand gradients to it.
The parameters it registers are zinf.torch.params'; partitioned ones (stage 3) are
zinf.torch.stage3's until it owns them."""

import gc
import json
import os
import weakref

import torch

import zinf
from zinf import _zinf

from .config import _set_wait_timeout, _stage_of
from .messages import _shape
from .params import (_GROUP_KEYS, _HALF_DTYPES, _Registered, _grad_array, _hyper_problem,
                     _overlaps, _relayout, _staged)
from .stage3 import (_allgather, _converted, _empty, _install_module_hooks, _kept_shard,
                     _lent_bytes, _on_disk, _part, _patch_linear, _release, _spill_directory,
                     _unpatch_linear)
from .step_info import StepInfo

_optimizers = weakref.WeakSet()  # the ZeroOptimizers created (open or closed) not yet collected


def _json_change(value, where):
    """What a JSON round trip would change in `value` ("" if nothing; json.dumps refuses what
    it cannot write): a key that is not a str (it comes back as one), a tuple (a list), an int
    beyond 64 bits (the checkpoint's JSON reads it as a float)."""
    pending = [(value, where)]
    while pending:
        v, at = pending.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    return (f"{at} has the {type(k).__name__} key {k!r}, which would come back "
                            "as a str: use str keys")
                pending.append((item, f"{at}[{k!r}]"))
        elif isinstance(v, tuple):
            return f"{at} is a tuple, which would come back as a list: pass a list"
        elif isinstance(v, list):
            pending.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
        elif isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**64:
            return (f"{at} is the int {v}, beyond 64 bits, which would come back as a float: "
                    "pass it as a str")
    return ""


def _on_registered_gradient(optimizer_ref, r):
    """overlap_backward: the AccumulateGrad node's hook of an in-place parameter: hands the
    gradient in its registered buffer once this backward pass has completed it."""
    def hook(grad_inputs, grad_outputs):
        opt = optimizer_ref()
        if opt is not None and opt._engine is not None and not opt._engine.closed:
            opt._hand_registered(r, grad_outputs[0] if grad_outputs else None)
    return hook


def _on_gradient(optimizer_ref, r):
    """The AccumulateGrad node's hook of a registered parameter (lent gradients): runs once per
    backward pass, after every use of the parameter added its part."""
    def hook(grad_inputs, grad_outputs):
        opt = optimizer_ref()
        if opt is not None and opt._engine is not None and not opt._engine.closed:
            opt._hand(r, grad_outputs[0] if grad_outputs else None)
    return hook


class ZeroOptimizer(torch.optim.Optimizer):
    """A drop-in torch optimizer whose Adam/AdamW state is a ZeRO partition per MPI rank on NVMe.

    Every rank holds the whole model (the same initial weights on every rank) and computes the
    gradient of its own mean loss; step() reduce-scatters the gradients, clips them, runs the
    swapped Adam step of the config's optimizer at each param group's values (param_groups, which
    torch's lr schedulers and the program may write, or the config's scheduler) on this
    rank's partition (fp32 master weights, exp_avg and exp_avg_sq on offload_optimizer.nvme_path),
    and all-gathers the new weights into the parameters. Collective: every rank makes the same
    calls in the same order; every error is raised on every rank alike (zinf.errors).

    Parameters:
      params: model.named_parameters() (names are what checkpoints match on), or parameters
        (named "param.<i>"), or param groups: dicts of "params" and any of "lr", "betas", "eps"
        and "weight_decay" (the config's optimizer.params for the rest; the optimizer type,
        adam_w_mode and amsgrad are the config's for every group). Parameters must be contiguous,
        on the CPU or a CUDA device, and float32, or float16 with the config's fp16.enabled, or
        bfloat16 with bf16.enabled. float32 CPU parameters are used in place (no copy of weights
        or gradients); CUDA and float16/bfloat16 parameters are staged through fp32 host
        buffers around every step (pinned for CUDA). Frozen parameters
        (requires_grad False) are left out (partitioned ones made whole on every rank), and
        requires_grad must stay as it was (a change is refused at step()). add_param_group
        raises ValueError: every group is given here.
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
      overlap_backward: hand each float32 CPU parameter's gradient to the engine from its
        AccumulateGrad hook, as soon as the backward pass completes it, so that its
        reduce-scatter (and with zinf.swap_gradients its write-behind) overlaps the rest of the
        backward pass (docs/python.md, "Overlap"). Its .grad is then None until step() (the
        engine owns the buffer and has reduced it: a .grad set on it before step() is refused
        there, zero_grad() drops the batch), and a step's backward passes must be the config's
        gradient_accumulation_steps (each is a micro-batch; losses not divided; one too many
        raises, dropping the step's gradient). Stage 1 only: stages 2 and 3 always hand every
        gradient so (lent, see Gradients).

    Gradients (stage 1): the engine reads them from fp32 buffers of its own; a float32 CPU
    parameter's .grad is a view of its buffer, kept for the optimizer's whole life (zero_grad
    zeroes it and puts it back, also with set_to_none=True). A .grad the program replaced
    (p.grad = t, p.grad.data = t, p.grad.set_(t)) is copied in at the next step when it is a dense
    floating-point tensor of the parameter's shape on its device or the CPU (any strides, any
    floating dtype: cast to float32), and refused on every rank otherwise (an integer, bool or
    complex dtype, another shape or device, a sparse tensor: FailedPreconditionError naming the
    parameter); a .grad set to None counts as zero. A parameter must keep its shape, dtype,
    device, memory and layout: a .data replaced, also by a view of the same memory
    (p.data = p.data.t()), is refused at the next step. With gradient_accumulation_steps k in
    the config, a step stands for k micro-batches per rank: either run k backward passes and
    call step(), or call accumulate_gradients() after each micro-batch but the last.
    Stages 2 and 3 lend the gradients instead: each parameter's goes to the engine from its
    AccumulateGrad hook as the backward pass completes it (copied into the reduce bucket,
    reduce-scattered, this rank keeps its partition), and .grad is None after the backward
    pass, so no rank holds the whole gradient; each backward pass is a micro-batch (as with
    overlap_backward, which they imply), and a .grad the program sets is handed at the next
    step() or accumulate_gradients(), refused on a parameter whose gradient was handed
    (docs/python.md, "Stage 2").

    fp16 (the config's fp16 block, DeepSpeed's loss scaling): the loop calls opt.backward(loss)
    instead of loss.backward(), which differentiates loss * opt.loss_scale, and passes the
    unscaled loss to step(loss=...). A step whose gradient holds an Inf or NaN on some rank is
    skipped on every rank (StepInfo.skipped: no weight changes, the gradients are zeroed) and
    the scale lowered; clean steps raise it again. The fp32 master weights live in the swapped
    state, starting as the parameters' values; the working weights are rounded to fp16.
    """

    _micro_batches = 0  # accumulate_gradients() hand-overs (also a backward pass's) this step

    def __init__(self, params, config, *, load=None, metrics_path=None, total_steps=0,
                 progress=True, stop_signals=True, create_nvme_paths=False,
                 gradient_memory_limit=256 << 20, overlap_backward=False):
        facts = zinf.init()
        self.rank = facts["rank"]
        self.world_size = facts["world_size"]
        self.local_rank = facts["local_rank"]
        self._engine = None
        self._last_checkpoint = None
        self._linear_patched = False
        problem = ""
        self._constructing = True
        self._frozen = []
        try:
            groups, self._frozen = self._groups(params)
            config_text, is_text = self._config(config)
            self._options = _zinf.EngineOptions(
                metrics_path="" if metrics_path is None else os.fspath(metrics_path),
                total_steps=int(total_steps),
                progress=bool(progress),
                stop_signals=bool(stop_signals),
                create_nvme_paths=bool(create_nvme_paths),
                gradient_memory_limit_bytes=int(gradient_memory_limit),
            )
            named = [(g, name, p) for g, (_, members) in enumerate(groups) for name, p in members]
            super().__init__([dict(options, params=[p for _, p in members])
                              for options, members in groups], {"lr": 0.0})
            self._group_options = [options for options, _ in groups]
            # Stage 3: parameters partitioned by init() have no weights buffer, and then every
            # gradient is lent (handed to the engine as the backward pass completes it). Stage 2
            # lends every gradient too (its parameters whole): the engine partitions each as it
            # arrives, so no rank holds the whole gradient.
            self._lent = (any(_part(p) is not None for _, _, p in named)
                          or _stage_of(config) == 2)
            self._params = [self._register(name, p, self._lent) for _, name, p in named]
            for i, (r, (g, _, _)) in enumerate(zip(self._params, named)):
                r.index, r.group = i, g
        except Exception as e:  # any local failure is agreed on, so that no rank waits alone
            problem = (str(e) if isinstance(e, (TypeError, ValueError))
                       else f"{type(e).__name__}: {e}")
        self._constructing = False
        _zinf.agree("InvalidArgument", problem, call="ZeroOptimizer()")
        self._make_frozen_whole()
        self.last_step_info = None
        self._config_source = (config_text, is_text)
        if any(not o._engine.closed for o in _optimizers if o._engine is not None):
            # One dropped without close() but not collected yet (a reference cycle) would still
            # hold its swap store: collected now, the new engine can take that store over.
            gc.collect()
        self._open(None if load is None else os.fspath(load))
        _optimizers.add(self)
        # Stage 1 with overlap_backward: each float32 CPU parameter's gradient goes to the
        # engine from its AccumulateGrad hook (stages 2 and 3 always hand them so).
        self._overlap = bool(overlap_backward) and not self._lent
        if self._lent:
            self._own_partitions()
        elif self._overlap:
            self._hook_gradients()

    # --- construction -------------------------------------------------------------------------

    def _make_frozen_whole(self):
        """Collective, after the constructor's agreement: the frozen parameters given that
        zinf.torch.init partitioned (frozen after it did: requires_grad_(False) in a parent's
        __init__ or on the finished model, the usual fine-tuning setup) become whole tensors
        again on every rank, gathered from the ranks' shards: the engine never steps them, and
        the forward pass reads them as they are (they cost their whole size on every rank, as
        frozen parameters that init left whole do)."""
        thaw = [(name, p) for name, p in self._frozen if _part(p) is not None]
        listed = repr([(name, _part(p).shape) for name, p in thaw])
        _zinf.agree_same("InvalidArgument", "ZeroOptimizer: the frozen partitioned parameters "
                         "(requires_grad False) differ from rank 0's; freeze the same parameters "
                         "on every rank", listed, call="ZeroOptimizer()")
        for _, p in thaw:
            if not _part(p).full:
                _allgather(p, "ZeroOptimizer()")
            del p._zinf_part

    @staticmethod
    def _groups(params):
        """[(options, [(name, parameter), ...]) per param group] from `params`: parameters,
        (name, parameter) pairs, or param group dicts; frozen parameters left out, and returned
        as the second item: [(name, parameter), ...]."""
        if isinstance(params, torch.Tensor):
            raise TypeError("params: expected an iterable of parameters or (name, parameter) "
                            "pairs, got a single tensor")
        items = list(params)
        dicts = [isinstance(item, dict) for item in items]
        if any(dicts) and not all(dicts):
            raise TypeError("params: a mix of param group dicts and parameters; pass either "
                            "parameters or a list of param group dicts")
        groups = items if items and all(dicts) else [{"params": items}]
        out, seen, index, frozen = [], {}, 0, {}
        for g, group in enumerate(groups):
            if "params" not in group:
                raise ValueError(f"param group {g} has no 'params'")
            unknown = sorted(set(group) - {"params", *_GROUP_KEYS}, key=str)
            if unknown:
                raise ValueError(f"param group {g}: unknown key(s) {unknown}; a group takes "
                                 "'params', 'lr', 'betas', 'eps' and 'weight_decay' (the "
                                 "optimizer type, adam_w_mode and amsgrad are the config's)")
            options = {key: group[key] for key in _GROUP_KEYS if key in group}
            problem = _hyper_problem(options, f"param group {g}")
            if problem:
                raise ValueError(problem)
            if "betas" in options:
                options["betas"] = tuple(float(b) for b in options["betas"])
            members = group["params"]
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            named = []
            for item in members:
                if isinstance(item, tuple) and len(item) == 2:
                    name, p = item
                else:
                    name, p = f"param.{index}", item
                index += 1
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"params: {name} is a {type(p).__name__}, not a tensor")
                part = _part(p)
                if part is not None and part.optimizer() is not None:
                    raise ValueError(f"parameter {name} is partitioned and belongs to another "
                                     "ZeroOptimizer (close it first)")
                if not p.requires_grad:  # frozen: not optimized
                    if part is not None and part.uses > 0:
                        raise ValueError(f"parameter {name} is partitioned, frozen and gathered "
                                         "(inside gathered() or a forward pass): create the "
                                         "optimizer outside them")
                    if part is not None and part.shard is None:
                        raise ValueError(f"parameter {name} is partitioned and has no values: "
                                         "the ZeroOptimizer that held them was dropped without "
                                         "close()")
                    frozen.setdefault(id(p), (str(name), p))
                    continue
                if id(p) in seen:
                    raise ValueError(f"params: {name} is given twice" if seen[id(p)] == g else
                                     f"params: {name} is in param groups {seen[id(p)]} and {g}")
                seen[id(p)] = g
                if p.dtype != torch.float32 and p.dtype not in _HALF_DTYPES:
                    raise ValueError(f"parameter {name} is {p.dtype}; zinf steps float32 "
                                     "parameters, float16 ones with the config's fp16.enabled "
                                     "and bfloat16 ones with bf16.enabled (convert the model "
                                     "with model.float())")
                if p.device.type not in ("cpu", "cuda"):
                    raise ValueError(f"parameter {name} is on {p.device}; zinf supports CPU and "
                                     "CUDA parameters")
                if part is None and not p.is_contiguous():
                    raise ValueError(f"parameter {name} is not contiguous")
                named.append((str(name), p))
            out.append((options, named))
        if not seen:
            raise ValueError("params: no parameter that requires a gradient")
        return out, list(frozen.values())

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
    def _register(name, p, lent):
        part = _part(p)
        if part is not None:  # stage 3: the engine holds it; init from this rank's shard
            return _Registered(name, p, None, None, part)
        # The engine's gradient buffer is private: an in-place parameter's .grad is a view of it,
        # so that a program replacing the view's data (p.grad.data = t, p.grad.set_(t)) never
        # frees or moves the memory the engine reads. Lent gradients: none (gradient_ready).
        pin = p.device.type == "cuda"
        if lent:
            if not _staged(p):
                return _Registered(name, p, p.detach(), None)
            weights = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
            weights.copy_(p.detach())
            return _Registered(name, p, weights, None)
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
        self._spill = None  # where close() leaves the shards (_kept_shard)
        options = self._options
        options.load = load
        buffers = []
        for r in self._params:  # NumPy views: the engine's buffers are these tensors' memory
            shard = None if r.part is None or r.part.shard is None else r.part.shard.numpy()
            buffers.append(_zinf.Param(
                name=r.name, shape=list(r.shape),
                weights=None if r.weights is None else r.weights.numpy(),
                grads=None if r.grads is None else r.grads.numpy(),
                shard=shard, shard_begin=0 if r.part is None else r.part.begin,
                shard_on_disk=shard is not None and _on_disk(r.part.shard), group=r.group))
        options.param_groups = [_zinf.ParamGroup(**group) for group in self._group_options]
        parts = [r.part for r in self._params if r.part is not None]
        if parts:
            options.host_memory_uses = [_zinf.HostMemoryUse(
                name="zinf.torch's gathered stage-3 weights and their gradients",
                bytes=_lent_bytes(parts),
                shrink="smaller modules (the largest chain of modules' own parameters)")]
        config_text, is_text = self._config_source
        self._engine = _zinf.Engine(config_text, is_text, buffers, options)
        settings = json.loads(self._engine.effective_config)
        self._spill = _spill_directory(settings)
        _set_wait_timeout(settings)  # the world's waits too (gathered(), frozen parameters)
        try:  # every rank has the same config: they agree unless their parameters differ
            _zinf.agree("InvalidArgument",
                        self._check_precision(settings) or self._check_lent(settings),
                        call="ZeroOptimizer()")
        except Exception:
            self._engine.close()
            raise
        for r in self._params:
            if r.staged:  # the restored (or initial) weights into the parameter
                r.param.data.copy_(r.weights, non_blocking=False)
        # The config's scheduler block, if any, owns the groups' lr (and OneCycle's betas);
        # without one the groups' values are the program's (torch's lr_scheduler, a hand-written
        # warmup): every step takes them from param_groups.
        self._scheduled = "scheduler" in settings
        self._hyper_pushed = False  # this micro-batch's values went to the engine (_push_hyper)
        optimizer = settings.get("optimizer", {}).get("params", {})
        self.defaults.update(lr=optimizer.get("lr", 1e-3),
                             betas=tuple(optimizer.get("betas", (0.9, 0.999))),
                             eps=optimizer.get("eps", 1e-8),
                             weight_decay=optimizer.get("weight_decay", 0.0))
        self._show_hyper_params()

    def _own_partitions(self):
        """Stages 2 and 3, once the engine holds the initial values: the partitioned parameters
        are this optimizer's (their shards dropped), and every parameter's gradient is handed to
        the engine by a hook on its AccumulateGrad node, which runs once per backward pass after
        every use of the parameter added its part (tied parameters too)."""
        me = weakref.ref(self)
        partitioned = any(r.part is not None for r in self._params)
        if partitioned:
            _install_module_hooks()
        with torch.enable_grad():
            for r in self._params:
                p, part = r.param, r.part
                if part is not None:
                    part.owner, part.index, part.shard = me, r.index, None
                if part is not None and not part.full:
                    # AccumulateGrad checks each gradient against the shape the parameter had
                    # when the node was made: make it (and hold it) with the whole shape, from a
                    # zero-stride tensor that takes no memory.
                    p.data = torch.empty(1, dtype=p.dtype, device=p.device).expand(part.shape)
                    r.node = p.expand_as(p).grad_fn.next_functions[0][0]
                    p.data = _empty(p)
                else:
                    r.node = p.expand_as(p).grad_fn.next_functions[0][0]
                r.hook = r.node.register_hook(_on_gradient(me, r))
        if partitioned:
            # F.linear through _PartitionedLinear while this optimizer is open: between a
            # module's forward and its backward no view keeps its whole weights alive.
            _patch_linear()
            self._linear_patched = True

    def _hook_gradients(self):
        """overlap_backward: a hook on each in-place parameter's AccumulateGrad node (staged
        parameters are copied in at the step)."""
        me = weakref.ref(self)
        with torch.enable_grad():
            for r in self._params:
                if not r.staged:
                    r.node = r.param.expand_as(r.param).grad_fn.next_functions[0][0]
                    r.hook = r.node.register_hook(_on_registered_gradient(me, r))

    def _hand_registered(self, r, incoming=None):
        """overlap_backward: r's gradient of this backward pass to the engine (its registered
        buffer: no copy), then .grad None while the engine owns the buffer. A second pass in one
        step is the next micro-batch: the previous one is handed over first
        (accumulate_gradients)."""
        p, g = r.param, r.param.grad
        if g is None:
            return
        engine = self._open_engine()
        if r.handed:
            self._next_micro_batch(r, incoming)
        if self._gradient_in(r):
            return  # a .grad the step refuses: it raises there, on every rank
        self._push_hyper(engine)
        engine.gradient_ready(r.index)
        r.handed = True
        p.grad = None

    def _disown_partitions(self):
        """Before close (collective): each partitioned parameter gets this rank's shard of its
        current weights back, so the model stays usable (gathered(), a new optimizer)."""
        for r in self._params:
            if r.hook is not None:
                r.hook.remove()
            r.hook = r.node = None
        for r in self._params:
            part = r.part
            if part is None or part.optimizer() is not self:
                continue
            whole = torch.from_numpy(self._engine.gather([r.index])[0])
            part.shard = _kept_shard(whole[part.begin:part.end], self._spill or part.spill)
            if part.full:
                r.param.data = whole.view(part.shape)
            part.owner, part.index = None, -1

    def _gather(self, params):
        """Collective: one engine gather of `params` (partitioned, this optimizer's) in
        registration order; each p.data becomes a torch-owned copy of its whole weights (the
        engine's scope is released at once: autograd may keep views of them until backward)."""
        params = sorted(params, key=lambda p: _part(p).index)
        arrays = self._open_engine().gather([_part(p).index for p in params])
        for p, array in zip(params, arrays):
            part = _part(p)
            p.data = torch.from_numpy(array).view(part.shape)
            part.full = True

    def _hand(self, r, incoming=None):
        """Lent gradients: r's .grad to the engine (copied), then .grad None and, for a
        partitioned parameter no forward or gathered() holds, .data empty again. From the
        AccumulateGrad hook (`incoming`: the gradient this pass added): a second gradient of r
        in one micro-batch (the step's next backward pass) begins the next micro-batch; step()
        refuses a .grad set on a handed parameter before it gets here."""
        p, g = r.param, r.param.grad
        if g is None:
            return
        if r.handed:
            self._next_micro_batch(r, incoming)
        engine = self._open_engine()
        self._push_hyper(engine)
        engine.gradient_ready(r.index, _grad_array(r, g))
        r.handed = True
        p.grad = None
        if r.part is not None and r.part.uses == 0 and r.part.full:
            _release(p)

    def _push_hyper(self, engine):
        """At a micro-batch's first handed gradient: param_groups' values as they are now (a
        torch lr_scheduler steps after step(), before this pass) to the engine, so that the
        speculative step (zinf.speculative_step) runs with the lr step() will use instead of
        being stepped again. Only a hint: step() checks, agrees on and hands them again, and
        reports what is wrong with them, so a value refused here is left to it."""
        if self._hyper_pushed or self._scheduled:
            return
        self._hyper_pushed = True
        if not self._hyper_problem():
            try:
                engine.set_hyper_params(self._hyper_values())
            except zinf.errors.ZinfError:
                pass  # step() raises it, agreed on every rank

    def _end_micro_batch(self):
        self._hyper_pushed = False
        for r in self._params:
            if r.handed and self._overlap:  # the engine zeroed it: .grad is the buffer again
                r.param.grad = r.grads.detach()
            r.handed = False

    def _next_micro_batch(self, r, incoming):
        """A backward pass that finds r's gradient of this micro-batch handed already
        (overlap_backward, stages 2 and 3) is the step's next micro-batch: the previous one is
        handed over first, as accumulate_gradients() does. Collective: every rank's next
        backward pass reaches its first gradient hook here (`incoming`: the gradient this pass
        added to r's .grad). Refused, on every rank, for a .grad the program set on a handed
        parameter since the previous pass (r's then holds more than `incoming`), and by the
        engine (a step takes the config's gradient_accumulation_steps passes): the step's
        gradient is dropped on every rank and the pass raises the agreed error."""
        g, done = r.param.grad, self._micro_batches
        engine = self._open_engine()
        problem = next((self._grad_after_handing(q) for q in self._params
                        if q.handed and q is not r and q.param.grad is not None), "")
        if not problem and incoming is not None and g is not incoming and not (
                g.dtype == incoming.dtype and g.shape == incoming.shape
                and torch.allclose(g, incoming, rtol=0, atol=0, equal_nan=True)):
            problem = self._grad_after_handing(r)  # this pass added into the program's .grad
        try:
            engine.agree("backward()", "FailedPrecondition", problem)
        except zinf.ZinfError as e:
            try:
                engine.drop_gradients()
            finally:
                self._forget_gradients()
            raised = type(e)(
                f"backward(): {e.message}; a further backward pass cannot add to it either, "
                "so the step's gradient (every micro-batch since the last step()) was dropped on "
                "every rank, nothing stepped: go on with the next batch", e.code, e.errno)
            raised.agreed = e.agreed
            raise raised from None
        try:
            engine.accumulate_gradients()
        except zinf.ZinfError as e:
            self._forget_gradients()
            mode = "overlap_backward" if self._overlap else "lent gradients (stages 2 and 3)"
            raised = type(e)(
                f"backward(): this backward pass began micro-batch {done + 2} of the step, "
                f"handing micro-batch {done + 1} over: {e.message}. "
                f"With {mode} each backward pass is a micro-batch, its gradients handed to the "
                "engine as the pass completes them, and a step takes the config's "
                "gradient_accumulation_steps of them (losses undivided). The step's gradient "
                "(every micro-batch since the last step()) was dropped on every rank, nothing "
                "stepped: go on with the next batch (zero_grad() after a backward pass drops "
                "that batch)", e.code, e.errno)
            raised.agreed = e.agreed
            raise raised from None
        self._end_micro_batch()
        self._micro_batches += 1
        r.param.grad = g  # this pass's gradient, in a tensor of its own (.grad was None)

    def _forget_gradients(self):
        """After the engine dropped the step's gradient on every rank (a refused step or
        hand-over, zero_grad()): nothing handed, no micro-batch accumulated, every .grad zeroed
        (an in-place parameter's: its registered buffer, which the engine no longer reads)."""
        self._end_micro_batch()
        self._micro_batches = 0
        self._zero_grads()

    def _grad_after_handing(self, r, at_step=False):
        """The problem ("" if none) of a .grad on a parameter whose gradient this micro-batch
        went to the engine already (overlap_backward, stages 2 and 3): the program set it after
        the backward pass, and the engine has reduced the handed gradient over the ranks. With
        `at_step`, what step() and accumulate_gradients() say, nothing changed."""
        if r.param.grad is None:
            return ""
        if at_step:
            return (self._grad_after_handing(r) + ": set .grad to None to step the handed "
                    "gradient, or call zero_grad() to drop this batch; nothing was stepped")
        if self._overlap:
            how, surgery = ("with overlap_backward each gradient goes", "ZeroOptimizer(..., "
                            "overlap_backward=False) for gradient surgery")
        else:
            how, surgery = ("at stages 2 and 3 every gradient goes", "no gradient surgery at "
                            "stages 2 and 3 (no rank holds the whole gradient)")
        return (f"parameter {r.name}: its .grad was set after the backward pass handed its "
                f"gradient to the engine ({how} to the engine as the pass completes it, reduced "
                f"over the ranks at once), so it cannot replace the handed one ({surgery}; the "
                "config's gradient_clipping clips the reduced gradient)")

    def _check_lent(self, settings):
        """Stage 2 lends every gradient (registered before the engine parsed the config, from
        this module's own reading of it); returns the problem ("" if none) when the engine's
        stage says otherwise."""
        zero = settings.get("zero_optimization", {})
        stage = zero.get("stage") if isinstance(zero, dict) else None
        if stage == 2 and not self._lent:
            return ("the config's zero_optimization.stage is 2, but zinf.torch could not read it "
                    "before creating the engine (stage 2 hands every gradient to the engine as "
                    "the backward pass completes it); pass the config as a dict or a readable "
                    "JSON file")
        return ""

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

    # --- param groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group):
        """Not supported after construction: the ZeRO partition, the swapped state and the
        checkpoint layout are built for the parameters the optimizer was created with. Pass
        every param group to ZeroOptimizer(...) (for a model that grew: a new optimizer).
        Raises ValueError on every rank that calls it, changing nothing."""
        if self._constructing:  # torch.optim.Optimizer.__init__ adds the constructor's groups
            return super().add_param_group(param_group)
        raise ValueError("ZeroOptimizer.add_param_group: parameters cannot join after the "
                         "optimizer was created (its ZeRO partition and swapped state are laid "
                         "out for the parameters it was created with); pass every param group "
                         "to ZeroOptimizer(...)")

    def _show_hyper_params(self):
        """param_groups' lr, betas, eps and weight_decay from the engine: what the next step
        uses (the config's scheduler's values, or the groups' own)."""
        self._hyper_set = self._engine.hyper_params()
        for group, values in zip(self.param_groups, self._hyper_set):
            group.update(values)

    def _hyper_values(self):
        """The groups' values for the next step, as the engine takes them."""
        def number(x):
            return float(x.item() if isinstance(x, torch.Tensor) else x)
        return [{"lr": number(g["lr"]), "betas": tuple(number(b) for b in g["betas"]),
                 "eps": number(g["eps"]), "weight_decay": number(g["weight_decay"])}
                for g in self.param_groups]

    def _hyper_problem(self):
        """What keeps the param_groups' values from the next step ("" if nothing): a value out
        of range, or under the config's scheduler, a value written."""
        if len(self.param_groups) != len(self._hyper_set):
            return (f"param_groups has {len(self.param_groups)} groups, the optimizer was "
                    f"created with {len(self._hyper_set)}; add_param_group is not supported")
        for i, group in enumerate(self.param_groups):
            problem = _hyper_problem({k: group.get(k) for k in _GROUP_KEYS}, f"param_groups[{i}]")
            if problem:
                return problem + " (as a learning-rate scheduler or the program set it)"
        if self._scheduled:
            for i, (have, shown) in enumerate(zip(self._hyper_values(), self._hyper_set)):
                for key in _GROUP_KEYS:
                    if have[key] != shown[key]:
                        return (f"param_groups[{i}]['{key}'] was set to {have[key]}, but the "
                                "config's scheduler block sets the learning rate (and OneCycle "
                                "the betas): remove the scheduler from the config to schedule "
                                "in the loop (torch.optim.lr_scheduler, a warmup of your own), "
                                "or leave param_groups as the optimizer sets them")
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
    def num_partitioned_params(self):
        """Stage 3: the parameters the engine keeps partitioned (the others partitioned by init
        are small enough for stage3_param_persistence_threshold: whole inside the engine)."""
        return self._open_engine().num_partitioned_params

    def gather_counters(self):
        """Stage 3: what the engine's gathers did since creation (calls, asked, gathered,
        prefetched, served, disk_reads, read_ahead, disk_waits, peak_live_elems); the same on
        every rank but disk_waits (the shard reads a gather waited for: a matter of timing)."""
        return self._open_engine().gather_counters()

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

    def _check_and_stage(self, call, loss=None, hyper=False):
        """Local checks before the collective call `call`, agreed on every rank (and that every
        rank is in that call), with the gradients put into the registered buffers (CUDA: device
        to pinned host); with `hyper`, the param_groups' values checked and, without a config
        scheduler, agreed on and handed to the engine for the step. Returns `loss` as a
        float."""
        try:
            if isinstance(loss, torch.Tensor):
                loss = float(loss.detach().float().mean())
            elif loss is not None:
                loss = float(loss)
            problem = self._frozen_problem() or self._stage(hyper)
        except Exception as e:  # agreed below, so that no rank waits alone
            problem = f"{type(e).__name__}: {e}"
        engine = self._open_engine()
        engine.agree(call, "FailedPrecondition", problem)
        if hyper and not self._scheduled:
            values = self._hyper_values()
            _zinf.agree_same(
                "FailedPrecondition",
                f"{call}: param_groups' lr, betas, eps or weight_decay differ from rank 0's (a "
                "scheduler or a write that ran on some ranks only); every rank must step with the "
                "same values", repr(values), call=call)
            engine.set_hyper_params(values)
        return loss

    def _frozen_problem(self):
        """A parameter frozen when the optimizer was created that requires a gradient now ("" if
        none): it is not optimized (the engine has no state for it), so its gradient would be
        ignored, where torch's optimizers would train it."""
        for name, p in self._frozen:
            if p.requires_grad:
                return (f"parameter {name} was frozen (requires_grad False) when the optimizer "
                        "was created, so it is not optimized, and now requires a gradient: the "
                        "engine's state and checkpoints are laid out for the parameters it was "
                        "created with; create a new optimizer (and checkpoint) to train it")
        return ""

    def _stage(self, hyper=False):
        if hyper:
            problem = self._hyper_problem()
            if problem:
                return problem
        if self._lent:
            for r in self._params:
                problem = self._parameter_problem(r) or (
                    self._grad_after_handing(r, at_step=True) if r.handed else "")
                if problem:
                    return problem
            # A .grad the backward pass did not hand (set by the program), in the order a
            # backward pass would; then whatever is still gathered (a parameter that got no
            # gradient) is released.
            for r in reversed(self._params):
                self._hand(r)
            for r in self._params:
                if r.part is not None and r.part.full and r.part.uses == 0:
                    _release(r.param)
            return ""
        for r in self._params:  # handed ones (overlap_backward) are the engine's until the step
            problem = self._parameter_problem(r) or (
                self._grad_after_handing(r, at_step=True) if r.handed else self._gradient_in(r))
            if problem:
                return problem
        return ""

    @staticmethod
    def _parameter_problem(r):
        """What changed in a parameter since it was registered that the engine cannot follow
        ("" if nothing): it keeps the weights of the registered tensor, element by element as
        laid out then, and (in place) writes the new ones into that memory."""
        p = r.param
        if not p.requires_grad:
            return (f"parameter {r.name} was frozen (requires_grad_(False)) after the optimizer "
                    "was created: the engine would go on stepping it (momentum and weight decay "
                    "move it without a gradient); freeze parameters before creating the "
                    "optimizer, which leaves frozen ones out, or create a new one (and "
                    "checkpoint)")
        if r.part is not None:
            # Partitioned: .data is the hooks' (empty or a gathered copy), but its dtype and
            # device are the parameter's (model.half() converts the empty tensor).
            problem = _converted(p)
            return f"parameter {r.name} {problem}" if problem else ""
        if tuple(None if b is None else b.data_ptr() for b in (r.weights, r.grads)) != r.addresses:
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
        self._end_micro_batch()
        self._micro_batches = 0
        for r in self._params:
            if r.staged:
                r.param.data.copy_(r.weights, non_blocking=False)
                if r.param.grad is not None:
                    r.param.grad.zero_()
        if self._scheduled:
            self._show_hyper_params()

    @torch.no_grad()
    def step(self, closure=None, *, loss=None):
        """One optimizer step (collective) for the gradients in the parameters' .grad, at the
        param_groups' lr, betas, eps and weight_decay (or the config's scheduler's). Returns the
        closure's loss with `closure` (as torch.optim), a StepInfo without one; the StepInfo is
        also opt.last_step_info. `loss` (a number or a one-element tensor: this rank's loss,
        unscaled with fp16) is for the log, the metrics and StepInfo.loss; with `closure` its
        return value is that loss. With fp16 a gradient holding an Inf or NaN on some rank
        skips the step on every rank (StepInfo.skipped: weights unchanged, gradients zeroed,
        loss scale adjusted). Raises on every rank, with nothing stepped, for a non-finite loss,
        a non-finite gradient norm without fp16, an fp16 overflow at fp16.min_loss_scale, a
        gradient that is zero on every rank, a parameter that changed since the optimizer was
        created, a param_groups value out of its range, written under a config scheduler, or
        different on some rank, a .grad set on a parameter whose gradient was handed
        (overlap_backward, stages 2 and 3). A step the engine refuses (the loss, the gradient, the
        counts) has consumed the step's gradient on every rank: .grad is zero (None with lent
        gradients), nothing is handed, and the loop goes on with its next batch. One refused
        before (a parameter, .grad or param_groups value) leaves the gradients as they were,
        for a step() once that is fixed; zero_grad() drops them."""
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
            if loss is None:
                loss = result
        engine = self._open_engine()
        loss = self._check_and_stage("step()", loss, hyper=True)
        try:
            info = StepInfo(engine.step(loss))
        except zinf.ZinfError:
            self._forget_gradients()  # the engine consumed them, on every rank
            raise
        self.last_step_info = info
        self._after_step()
        return result if closure is not None else info

    @torch.no_grad()
    def accumulate_gradients(self):
        """Hands this micro-batch's gradient to the engine (reduce-scatter; with
        zinf.swap_gradients written behind to NVMe) and zeroes .grad: call it after every
        micro-batch of a step but the last (gradient_accumulation_steps). Collective. Refused
        by the engine (called gradient_accumulation_steps times in a step): the step's gradient
        is dropped on every rank, as by a refused step()."""
        engine = self._open_engine()
        self._check_and_stage("accumulate_gradients()")
        try:
            engine.accumulate_gradients()
        except zinf.ZinfError:
            self._forget_gradients()  # the engine dropped them, on every rank
            raise
        self._end_micro_batch()
        self._micro_batches += 1
        for r in self._params:
            if r.staged and r.param.grad is not None:
                r.param.grad.zero_()

    @torch.no_grad()
    def zero_grad(self, set_to_none=False):
        """Zeroes the gradients. The engine reads an in-place parameter's .grad where it is, so
        .grad is (again) the registered tensor, zeroed, also with set_to_none=True; a staged
        parameter's .grad is zeroed (a replaced one of another dtype, shape, device or layout
        becomes zeros like the parameter). step() already leaves them zero. With lent gradients
        (stages 2 and 3) .grad is None: each went to the engine as the backward pass completed
        it; a .grad the program set itself is dropped.

        Gradients handed to the engine since the last step (a backward pass with
        overlap_backward or at stages 2 and 3, accumulate_gradients()) are dropped too, as torch's
        zero_grad drops an accumulated gradient: the next backward pass begins the step afresh
        (skipping a bad batch). That is collective (the engine finishes the micro-batch's
        reductions): every rank calls it, as SPMD loops do; otherwise it is local."""
        if self._micro_batches or any(r.handed for r in self._params):
            if self._engine is not None and not self._engine.closed:  # closed: nothing to drop
                self._engine.agree("zero_grad()", "FailedPrecondition", "")  # names the call
                self._engine.drop_gradients()
            self._end_micro_batch()
            self._micro_batches = 0
        self._zero_grads()

    def _zero_grads(self):
        if self._lent:
            for r in self._params:
                r.param.grad = None
                if r.part is not None and r.part.full and r.part.uses == 0:
                    _release(r.param)  # what a broken-off backward pass left gathered
            return
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
        it) is stored and returned by load_checkpoint exactly as given: what a JSON round trip
        would change (an int beyond 64 bits, a tuple, a key that is not a str) is an
        InvalidArgumentError on every rank, nothing saved. Returns the file's path."""
        engine = self._open_engine()
        problem = ""
        try:
            if client_state is not None and not isinstance(client_state, dict):
                raise TypeError(f"client_state must be a dict, not {type(client_state).__name__}")
            # Compared across ranks as JSON with sorted keys (the checkpoint keeps them sorted).
            text = json.dumps(json.loads(json.dumps(client_state, allow_nan=False)),
                              sort_keys=True)
            changed = _json_change(client_state, "client_state")
            if changed:
                problem = (f"save_checkpoint: {changed}; a checkpoint keeps client_state as JSON "
                           "and load_checkpoint gives back exactly what was saved (dicts with "
                           "str keys, lists, str, int in [-2**63, 2**64), finite float, bool, "
                           "None)")
        except Exception as e:  # TypeError, ValueError, RecursionError, ...
            problem, text = f"save_checkpoint: client_state is not JSON-serializable: {e}", "null"
        # The groups' values as param_groups holds them now (a scheduler stepped after the last
        # step has set the next step's): the checkpoint keeps them, as torch's state_dict.
        problem = problem or self._hyper_problem()
        engine.agree("save_checkpoint()", "InvalidArgument", problem)
        if not self._scheduled:
            values = self._hyper_values()
            _zinf.agree_same("InvalidArgument", "save_checkpoint: param_groups' lr, betas, eps or "
                             "weight_decay differ from rank 0's", repr(values),
                             call="save_checkpoint()")
            engine.set_hyper_params(values)
        _zinf.agree_same("InvalidArgument", "save_checkpoint: client_state differs from rank "
                         "0's; a checkpoint keeps one client_state: pass the same on every rank",
                         text, call="save_checkpoint()")
        saved = engine.save_checkpoint(text, "" if dir is None else os.fspath(dir))
        self._last_checkpoint = saved["path"]
        return saved["path"]

    def load_checkpoint(self, path):
        """Restores a checkpoint (a file, or a directory whose `latest` names one), saved on any
        number of ranks, into this optimizer and the parameters' weights; returns the
        client_state that was saved with it (None if none). Collective, between steps. The
        parameters and their groups must be the same (names, shapes, groups) as when it was
        saved. It restores through the open engine: the file is read and verified whole before
        anything changes, so a failed load (a missing or corrupt file, other parameters or
        groups) raises on every rank and leaves the optimizer as it was. Without a config
        scheduler param_groups get the saved values (lr, betas, eps, weight_decay), as torch's
        load_state_dict."""
        path = os.fspath(path)
        engine = self._open_engine()
        problem = ""
        if self._lent:
            held = [r.name for r in self._params if r.part is not None and r.part.uses > 0]
            if held:
                problem = (f"load_checkpoint: parameter {held[0]} is gathered (inside a forward "
                           "pass or gathered()); load between steps")
        engine.agree("load_checkpoint()", "FailedPrecondition", problem)
        if self._lent:
            for r in self._params:
                r.param.grad = None
                if r.part is not None and r.part.full:
                    _release(r.param)  # its gathered copy is of the weights being replaced
        engine.load(path)
        for r in self._params:
            if r.staged:  # the restored weights into the parameter
                r.param.data.copy_(r.weights, non_blocking=False)
        self._end_micro_batch()
        self._show_hyper_params()
        self._last_checkpoint = engine.resumed_from
        return json.loads(engine.user_state)

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
        groups, first = [], 0
        for g in self.param_groups:  # torch's layout: parameters numbered across the groups
            groups.append({k: v for k, v in g.items() if k != "params"}
                          | {"params": list(range(first, first + len(g["params"])))})
            first += len(g["params"])
        return {
            "state": {},
            "param_groups": groups,
            "zinf": {
                "checkpoint": self._last_checkpoint,
                "step": self.global_step,
                "world_size": self.world_size,
                "names": [r.name for r in self._params],
            },
        }

    def load_state_dict(self, state_dict):
        """Restores from the checkpoint file a state_dict() points at (collective, through the
        open engine as load_checkpoint: a failure leaves the optimizer as it was), then the
        param_groups' other keys (a scheduler's initial_lr, ...) and, without a config
        scheduler, their values from the dict, as torch does."""
        meta = state_dict.get("zinf") if isinstance(state_dict, dict) else None
        problem = ""
        if not isinstance(meta, dict) or "checkpoint" not in meta:
            problem = "load_state_dict: not a zinf.torch.ZeroOptimizer state_dict"
        elif meta["checkpoint"] is None and meta.get("step", 0) != 0:
            problem = ("load_state_dict: the state_dict names no checkpoint file (save_checkpoint "
                       "was not called before state_dict)")
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        sizes = [len(g["params"]) for g in self.param_groups]
        if not problem and (not isinstance(groups, list) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
                or [len(g["params"]) for g in groups] != sizes):
            problem = (f"load_state_dict: the state_dict's param_groups differ from this "
                       f"optimizer's ({len(sizes)} group(s) of {sizes} parameters)")
        _zinf.agree("InvalidArgument", problem, call="load_state_dict()")
        if meta["checkpoint"] is not None:
            self.load_checkpoint(meta["checkpoint"])
        # As torch: the groups' other keys (a scheduler's initial_lr, ...) and, without a
        # config scheduler, their values come from the state_dict (the checkpoint's agree).
        for group, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params" and (key not in _GROUP_KEYS or not self._scheduled):
                    group[key] = tuple(value) if key == "betas" else value

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
            if self._lent:
                self._disown_partitions()
            for r in self._params:
                if r.hook is not None:
                    r.hook.remove()
                r.hook = r.node = None
            self._engine.close()
        if self._linear_patched:
            self._linear_patched = False
            _unpatch_linear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
