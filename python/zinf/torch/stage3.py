"""ZeRO stage 3 in zinf.torch: partitioned parameters (docs/python.md, "Stage 3").

init() partitions the parameters of the modules built inside it (each rank keeps its shard,
on disk with offload_param nvme); gathered() makes them whole for reading or setting; the
global module hooks gather a module's parameters around its forward and backward (and lend a
parameter read by name to the running forward or __init__); F.linear is patched, while an
optimizer holds partitioned parameters, so that no saved view keeps whole weights alive between
forward and backward; copy.deepcopy of a partitioned parameter stays partitioned. An open
ZeroOptimizer (zinf.torch.optimizer) owns the values once created: gathers then go through its
engine (opt._gather).
"""

import collections
import contextlib
import functools
import math
import mmap
import os
import sys
import tempfile

import torch

import zinf
from zinf import _zinf

from .config import _config_dict, _set_wait_timeout, _stage_of
from .messages import _shape, log


# The alignment of a parameter's shards in elements (engine.h's kPartitionAlignmentElems, the
# partition/plan.h kPerParam rule): init() partitions before any engine exists.
_SHARD_ALIGNMENT = _zinf.PARTITION_ALIGNMENT


def _shard_range(numel, rank, world):
    """Elements [begin, end) of a parameter of `numel` elements that `rank` of `world` owns:
    rank r owns [r * S, (r + 1) * S) clipped to numel, S = AlignUp(ceil(numel / world), 1024)."""
    per = -(-numel // world)
    per = -(-per // _SHARD_ALIGNMENT) * _SHARD_ALIGNMENT
    begin = min(rank * per, numel)
    return begin, min(begin + per, numel)


class _Partition:
    """What zinf.torch.init leaves on a parameter (as p._zinf_part): its shape, this rank's
    shard of its values until an optimizer owns it, and whether p.data holds it whole now."""

    __slots__ = ("shape", "numel", "rank", "world", "begin", "end", "shard", "spill", "full",
                 "uses", "owner", "index", "name", "holder", "root")

    def __init__(self, shape, rank, world, shard, spill=None):
        self.name = "a parameter"  # its path in the outermost module built with it: "fc.weight"
        self.holder = ""           # the path of the module that holds it ("fc"; "" the root)
        self.root = ""             # the class of that outermost module
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape)
        self.rank, self.world = rank, world
        self.begin, self.end = _shard_range(self.numel, rank, world)
        self.shard = shard  # float32 [end - begin]; None once an optimizer holds the values
        self.spill = spill  # where its shards wait on disk (_kept_shard); None: in memory
        self.full = False   # p.data holds the whole weights (a torch-owned copy)
        self.uses = 0       # forward passes and gathered() scopes inside which it stays whole
        self.owner = None   # weakref to the ZeroOptimizer that registered it
        self.index = -1     # its index in that optimizer's engine

    def optimizer(self):
        return None if self.owner is None else self.owner()


def _part(p):
    return getattr(p, "_zinf_part", None)


def is_partitioned(param):
    """Whether `param` was partitioned by zinf.torch.init (its .data is empty outside forward,
    backward and gathered(); partitioned_shape(param) is its shape)."""
    return _part(param) is not None


def partitioned_shape(param):
    """The shape of a partitioned parameter (param.shape is (0,) while it is not gathered)."""
    part = _part(param)
    return tuple(param.shape) if part is None else part.shape


def _empty(p):
    return torch.empty(0, dtype=p.dtype, device=p.device)


def _release(p):
    """p.data back to an empty tensor; torch frees the whole weights unless autograd saved a
    view of them for the backward pass."""
    p.data = _empty(p)
    _part(p).full = False


def _spill_directory(config):
    """Where the shards of partitioned parameters wait while no optimizer holds them: with
    offload_param nvme, its nvme_path (else offload_optimizer's first one) when it is a
    directory now; None (in memory) otherwise."""
    config = _config_dict(config)
    zero = config.get("zero_optimization") if config is not None else None
    if not isinstance(zero, dict):
        return None
    param, state = zero.get("offload_param"), zero.get("offload_optimizer")
    if not isinstance(param, dict) or param.get("device") != "nvme":
        return None
    for section in (param, state):
        path = section.get("nvme_path") if isinstance(section, dict) else None
        if isinstance(path, list):
            path = path[0] if path else None
        if isinstance(path, str) and "{" not in path and os.path.isdir(path):
            return path
    return None


def _kept_shard(values, directory):
    """A float32 copy of the 1-D `values` (a shard) that does not stay in this process's memory
    when `directory` is given: the memory-mapped pages of an unlinked file there (gone with the
    tensor, even if the process is killed), written back and dropped from memory at once, so
    the shards of a model larger than memory wait on disk until an optimizer (or a gather) reads
    them. In memory without a directory, or when the file cannot be made or written (a full
    disk, no permission: said once, and later shards stay in memory too)."""
    global _spill_failed
    if directory is not None and values.numel() > 0 and not _spill_failed:
        try:
            return _mapped_copy(values, directory)
        except (OSError, ValueError) as e:
            _spill_failed = True
            log(f"zinf.torch: the shards of partitioned parameters stay in memory: cannot keep "
                f"them in {directory} ({e})", level="warn")
    return values.detach().clone()


def _mapped_copy(values, directory):
    fd, path = tempfile.mkstemp(prefix="zinf-shard-", dir=directory)
    try:
        os.unlink(path)
        size = values.numel() * 4
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        shard = torch.frombuffer(mapped, dtype=torch.float32)
        shard._zinf_mapped = mapped
        shard.copy_(values.detach().reshape(-1))
        mapped.flush()  # on disk: the pages are clean, and dropped below
        mapped.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return shard
    finally:
        os.close(fd)


_spill_failed = False


def _on_disk(shard):
    """Whether `shard` is one of _kept_shard's file mappings (not memory of its own)."""
    return isinstance(getattr(shard, "_zinf_mapped", None), mmap.mmap)


def _partition(p, rank, world, spill=None):
    if p.dtype != torch.float32 or p.device.type != "cpu":
        raise TypeError(f"zinf.torch.init: a parameter of shape {_shape(p.shape)} is {p.dtype} on "
                        f"{p.device}; stage 3 partitions float32 CPU parameters (build the model "
                        "in float32 on the CPU)")
    part = _Partition(p.shape, rank, world, None, spill)
    part.shard = _kept_shard(p.detach().reshape(-1)[part.begin:part.end], spill)
    p._zinf_part = part
    p.data = _empty(p)


def _allgather(p, call):
    """Collective over the world in the API call `call` ("gathered()", ...): p.data = the whole
    weights from every rank's shard (before an optimizer owns the parameter)."""
    part = _part(p)
    if part.shard is None:
        raise RuntimeError(f"a partitioned parameter of shape {_shape(part.shape)} has no values: "
                           "the ZeroOptimizer that held them was dropped without close()")
    counts = [e - b for b, e in (_shard_range(part.numel, r, part.world)
                                 for r in range(part.world))]
    whole = torch.empty(part.numel, dtype=torch.float32)
    _zinf.allgatherv(part.shard.numpy(), whole.numpy(), counts, call=call)
    p.data = whole.view(part.shape)
    part.full = True


def _gather(params, call):
    """Collective in the API call `call`: the whole weights into p.data for each of `params`
    (partitioned, not whole now): through the engine of the optimizer that owns them (one call
    per optimizer, in registration order), from the shards before one does."""
    groups = {}
    for p in params:
        opt = _part(p).optimizer()
        groups.setdefault(id(opt), (opt, []))[1].append(p)
    for opt, ps in groups.values():
        if opt is None:
            if _linear_users > 0:
                frozen = [p for p in ps if not p.requires_grad]
                if frozen:
                    # A world collective here could run beside an engine's own MPI calls on its
                    # reduction thread (MPI_THREAD_SERIALIZED), and the engine never steps it.
                    part = _part(frozen[0])
                    raise zinf.errors.FailedPreconditionError(
                        f"{call}: parameter {part.name} of {part.root} is partitioned (stage 3) "
                        "and frozen (requires_grad False), and no ZeroOptimizer holds it: give "
                        "the optimizer every parameter (model.named_parameters(), frozen ones "
                        "included), which makes frozen partitioned parameters whole on every "
                        "rank and never steps them", "FailedPrecondition")
            for p in ps:
                _allgather(p, call)
        else:
            opt._gather(ps)


def _converted(p):
    """How a partitioned parameter was converted ("" if it was not), to follow its name: stage 3
    keeps them float32 on the CPU (its shard and the engine's master weights are), so
    model.half(), .double() or .cuda() on a partitioned model would be undone by the next
    gather."""
    if p.dtype == torch.float32 and p.device.type == "cpu":
        return ""
    owned = _part(p).optimizer() is not None
    return (f"is partitioned (stage 3) and was converted to "
            f"{p.dtype} on {p.device} (model.half(), .to(), .cuda(), ...)"
            f"{' while a ZeroOptimizer holds it' if owned else ''}; partitioned parameters stay "
            "float32 on the CPU, as their shards and the engine's fp32 master weights are: "
            "convert it back (model.float()), and build and train stage 3 models in float32 on "
            "the CPU")


def _acquire(params, call):
    """The partitioned `params` whole until the matching _unuse (forward, gathered()).
    Collective in the API call `call` when some are not whole now."""
    for p in params:
        problem = _converted(p)
        if problem:
            part = _part(p)
            raise zinf.errors.FailedPreconditionError(
                f"{call}: parameter {part.name} of {part.root} {problem}", "FailedPrecondition")
    need = [p for p in params if not _part(p).full]
    if need:
        _gather(need, call)
    for p in params:
        _part(p).uses += 1


def _unuse(params):
    for p in params:
        part = _part(p)
        part.uses -= 1
        if part.uses == 0 and part.full:
            _release(p)


def _partitioned_of(module):
    own = [p for p in module._parameters.values() if p is not None and _part(p) is not None]
    external = module.__dict__.get("_zinf_external")
    if external:
        own += [p for p in external if _part(p) is not None and all(p is not q for q in own)]
    return own


def register_external_parameter(module, param):
    """Gather `param` (a partitioned parameter of another module) around every forward and
    backward of `module`, as if `module` held it: for a parameter that module's forward reaches
    other than as a module attribute (held in a list or a closure, say). A parameter read as
    an attribute of a submodule inside a running forward (`self.child.weight`) is gathered
    without it. Not partitioned: nothing to do."""
    if not isinstance(module, torch.nn.Module) or not isinstance(param, torch.nn.Parameter):
        raise TypeError("register_external_parameter(module, param) takes an nn.Module and an "
                        f"nn.Parameter, not {type(module).__name__} and {type(param).__name__}")
    external = module.__dict__.setdefault("_zinf_external", [])
    if all(param is not q for q in external):
        external.append(param)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class _Scope:
    """A forward pass or __init__ running now (_scopes): the partitioned parameters it holds
    whole, its own and those lent to it, and the frame that runs it (of Module._call_impl, or
    of the wrapped __init__), by which a scope whose code raised is found and ended."""

    __slots__ = ("module", "call", "own", "lent", "frame")

    def __init__(self, module, call, own, frame):
        self.module, self.call, self.own, self.lent, self.frame = module, call, own, [], frame


# The forward passes and __init__ calls running now, innermost last. A partitioned parameter
# that such code reads by name from a module's _parameters (`self.out_proj.weight`:
# nn.MultiheadAttention's forward passes it to F.multi_head_attention_forward without calling
# out_proj) is gathered then and lent to the innermost one until it ends; a forward's lent
# parameters are gathered again before its backward, as its own are.
_scopes = []


def _drop_raised_scopes(frame):
    """Ends the innermost scopes whose code is no longer running (it raised, so no post-hook
    ran): their parameters are released. `frame` is the caller's frame; a running scope's
    frame is among its ancestors, a few frames up."""
    while _scopes:
        target, f = _scopes[-1].frame, frame
        while f is not None and f is not target:
            f = f.f_back
        if f is not None:
            return
        raised = _scopes.pop()
        _unuse(raised.own)
        _unuse(raised.lent)


class _Parameters(collections.OrderedDict):
    """module._parameters of a module whose parameters zinf.torch.init partitioned: reading one
    by name inside a running forward or __init__ lends it whole to that scope (_scopes).
    Iteration (values(), items(): named_parameters(), state_dict()) reads them as they are."""

    def __getitem__(self, name):
        p = super().__getitem__(name)
        if _scopes and p is not None:
            part = getattr(p, "_zinf_part", None)
            if part is not None and not part.full:
                _drop_raised_scopes(sys._getframe(1))
                if _scopes:
                    scope = _scopes[-1]
                    _acquire([p], scope.call)
                    scope.lent.append(p)
        return p


def _end_scope(module):
    """`module`'s scope ends: (its own parameters, those lent to it), still to be released.
    Scopes above it (a forward inside it that raised) end too, released at once."""
    for i in range(len(_scopes) - 1, -1, -1):
        if _scopes[i].module is module:
            scope = _scopes[i]
            for raised in _scopes[i + 1:]:
                _unuse(raised.own)
                _unuse(raised.lent)
            del _scopes[i:]
            return scope.own, scope.lent
    return [], []


def _pre_forward(module, inputs):
    frame = sys._getframe(1)  # Module._call_impl of `module`
    if _scopes:
        _drop_raised_scopes(frame)
    call = f"the forward of {type(module).__name__}"
    params = _partitioned_of(module)
    if params:
        _acquire(params, call)
    _scopes.append(_Scope(module, call, params, frame))


def _post_forward(module, inputs, output):
    params, lent = _end_scope(module)
    if not params and not lent:
        return
    _unuse(params)
    _unuse(lent)
    params = params + [p for p in lent if all(p is not q for q in params)]
    outputs = [t for t in _tensors(output) if t.requires_grad]
    if not outputs:
        return
    # torch 1.13 has no module backward pre-hook: a hook on the outputs' gradients runs before
    # the module's own backward nodes, which may read the parameters (a leaf saved for the
    # backward pass, layer_norm's weight, is read from p.data then). Once per forward call.
    pending = [True]

    def before_backward(grad):
        if pending[0]:
            pending[0] = False
            need = [p for p in params if not _part(p).full]
            if need:
                _gather(need, f"the backward of {type(module).__name__}")
        return None

    for t in outputs:
        t.register_hook(before_backward)


_module_hooks = None


def _install_module_hooks():
    """Global forward hooks (every module, once per process): a module whose own parameters are
    partitioned gathers them before its forward and releases them after it. They do nothing for
    other modules."""
    global _module_hooks
    if _module_hooks is None:
        from torch.nn.modules import module as nn_module
        _module_hooks = (nn_module.register_module_forward_pre_hook(_pre_forward),
                         nn_module.register_module_forward_hook(_post_forward))


class _PartitionedLinear(torch.autograd.Function):
    """F.linear with a partitioned weight. F.linear saves a view of the weight for its backward
    (weight.t() for addmm), and that view would keep the whole gathered weights alive from the
    module's forward to its backward: every layer's at once at the end of a forward pass. This
    saves the parameter itself: a saved leaf is read through the parameter when the backward
    runs, by which time the hook on the module outputs' gradients has gathered it again (and
    its AccumulateGrad hook, after every use, empties it). param.data assignments keep the
    parameter's version counter, so the saved-tensor check passes."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight, bias)
        ctx.weight_shape = tuple(weight.shape)
        return _original_linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        if tuple(weight.shape) != ctx.weight_shape:
            raise RuntimeError(f"a partitioned linear weight of shape {_shape(ctx.weight_shape)} "
                               f"is {_shape(weight.shape)} in its backward pass: it was not "
                               "gathered again (is the optimizer that owns it still open?)")
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)  # [..., out] @ [out, in]; 1-D input too
        # The weight and bias gradients sum over every leading (batch) dimension.
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t().matmul(input.reshape(-1, input.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_input, grad_weight, grad_bias


_original_linear = torch.nn.functional.linear  # what the patch falls back to (and restores)
_linear_users = 0  # open optimizers that hold partitioned parameters


def _linear(input, weight, bias=None):
    """torch.nn.functional.linear while a ZeroOptimizer holds partitioned parameters: a
    partitioned 2-D weight under autograd goes through _PartitionedLinear, anything else (no
    gradient, autocast, a tensor subclass with __torch_function__) to torch's own."""
    part = _part(weight)
    if part is not None and not part.full:
        raise zinf.errors.FailedPreconditionError(_used_outside(part), "FailedPrecondition")
    if (part is None or len(part.shape) != 2 or not torch.is_grad_enabled()
            or not weight.requires_grad or torch.is_autocast_enabled()
            or torch.is_autocast_cpu_enabled()
            or torch.overrides.has_torch_function((input, weight, bias))):
        return _original_linear(input, weight, bias)
    return _PartitionedLinear.apply(input, weight, bias)


def _used_outside(part):
    """The error of a partitioned parameter used where it is empty: outside any forward that
    holds it or read it by name (F.linear(x, model.fc.weight) outside the model's forward, a
    weight a forward reaches through a list or a closure, module.forward(x) at the top level)."""
    return (f"{part.name} of {part.root} is partitioned (stage 3) and used where it is empty "
            "(shape [0]): zinf gathers a partitioned parameter around the forward and backward "
            "of the module that holds it, and when a running forward (or __init__) reads it by "
            "name as a module attribute (self.out_proj.weight). Use it inside a module's "
            "forward, call modules as module(x) (module.forward(x) runs no hooks), read it "
            "inside zinf.torch.gathered(...), or register a parameter a forward reaches "
            "otherwise with zinf.torch.register_external_parameter(module, param)")


_original_parameter_deepcopy = torch.nn.Parameter.__deepcopy__


def _deepcopy_parameter(p, memo):
    """torch.nn.Parameter.__deepcopy__ once zinf.torch.init ran: the copy of a partitioned
    parameter is partitioned, with a shard of its own holding the same values
    (nn.TransformerEncoder deep-copies the layer it is given); others as torch copies them."""
    part = _part(p)
    if part is None:
        return _original_parameter_deepcopy(p, memo)
    if id(p) in memo:
        return memo[id(p)]
    if part.full:
        shard = _kept_shard(p.detach().reshape(-1)[part.begin:part.end], part.spill)
    elif part.shard is not None:
        shard = _kept_shard(part.shard, part.spill)
    else:
        raise zinf.errors.FailedPreconditionError(
            f"copy.deepcopy: parameter {part.name} of {part.root} is partitioned (stage 3) and "
            "its values are in the ZeroOptimizer that holds it: copy it inside "
            "zinf.torch.gathered(...) (collective), or before the optimizer is created",
            "FailedPrecondition")
    copied = torch.nn.Parameter(_empty(p), p.requires_grad)
    new = _Partition(part.shape, part.rank, part.world, shard, part.spill)
    new.name, new.holder, new.root = part.name, part.holder, part.root
    copied._zinf_part = new
    memo[id(p)] = copied
    return copied


def _patch_linear():
    """torch.nn.functional.linear becomes _linear until the matching _unpatch_linear (nn.Linear
    looks F.linear up at each call). Counted: one per open optimizer."""
    global _original_linear, _linear_users
    if _linear_users == 0 and torch.nn.functional.linear is not _linear:
        _original_linear = torch.nn.functional.linear
        torch.nn.functional.linear = _linear
    _linear_users += 1


def _unpatch_linear():
    global _linear_users
    _linear_users -= 1
    # Restored only if it is still ours: a later patch by someone else wraps ours, and stays.
    if _linear_users == 0 and torch.nn.functional.linear is _linear:
        torch.nn.functional.linear = _original_linear


# Modules whose __init__ initializes its submodules' parameters through self.parameters()
# (nn.Transformer's _reset_parameters: xavier_uniform_ of every matrix), which iterates them as
# they are: the submodules are partitioned when that __init__ returns, not as each of theirs
# does, so the module is whole while it is built.
_WHOLE_WHILE_BUILT = (torch.nn.Transformer,)


class _InitContext:
    """zinf.torch.init's work: every nn.Module subclass's __init__ wrapped, so that the
    parameters of a module (and of its submodules not yet partitioned) are partitioned when the
    outermost __init__ of that instance returns."""

    def __init__(self, rank, world, spill):
        self.rank, self.world = rank, world
        self.spill = spill  # _kept_shard's directory
        self.wrapped = {}  # class -> its own __init__
        self.depth = {}    # id(module) -> __init__ calls of that instance in progress
        self.whole = 0     # _WHOLE_WHILE_BUILT modules being built: their children wait
        self.subclass_hook = None

    def wrap(self, cls):
        original = cls.__dict__.get("__init__")
        if original is None or cls in self.wrapped:
            return
        context = self

        @functools.wraps(original)
        def __init__(module, *args, **kwargs):
            key = id(module)
            depth = context.depth.get(key, 0)
            context.depth[key] = depth + 1
            whole = depth == 0 and isinstance(module, _WHOLE_WHILE_BUILT)
            if depth == 0:
                # Partitioned parameters of other modules its __init__ reads by name are lent
                # to it (nn.MultiheadAttention's zeroes out_proj.bias).
                if _scopes:
                    _drop_raised_scopes(sys._getframe(0))
                _scopes.append(_Scope(module, f"the __init__ of {type(module).__name__}", [],
                                      sys._getframe(0)))
                context.whole += whole
            done = False
            try:
                original(module, *args, **kwargs)
                done = True
            finally:
                if depth == 0:
                    del context.depth[key]
                    context.whole -= whole
                    _, lent = _end_scope(module)
                    try:
                        if done:
                            context.keep(lent)
                    finally:
                        _unuse(lent)
                else:
                    context.depth[key] = depth
            if depth == 0 and not context.whole:
                context.partition(module)

        self.wrapped[cls] = original
        cls.__init__ = __init__

    @staticmethod
    def keep(lent):
        """The values an __init__ set in the partitioned parameters lent to it, kept: rank 0's
        become every rank's shards (collective, as gathered(modify=True)); one an optimizer
        holds is only read (the engine has its master weights)."""
        mine = [p for p in lent if _part(p).optimizer() is None]
        if mine:
            _broadcast_from_rank0(mine, call="zinf.torch.init")

    def partition(self, module):
        if "_modules" not in module.__dict__:
            return  # its __init__ did not call nn.Module's
        # Each partitioned parameter is named by its path in the outermost module built with it
        # (a child's, partitioned when the child's __init__ returned, renamed by its parent's),
        # for the errors that name it.
        root, named = type(module).__name__, set()
        for prefix, m in module.named_modules():
            for key, p in m._parameters.items():
                if p is None:
                    continue
                if p.requires_grad and _part(p) is None:
                    _partition(p, self.rank, self.world, self.spill)
                part = _part(p)
                if part is not None and id(p) not in named:  # a tied one: its first path
                    named.add(id(p))
                    part.name = f"{prefix}.{key}" if prefix else key
                    part.holder, part.root = prefix, root
            if type(m._parameters) is not _Parameters and any(
                    p is not None and _part(p) is not None for p in m._parameters.values()):
                m.__dict__["_parameters"] = _Parameters(m._parameters)

    def enter(self):
        pending = [torch.nn.Module]
        while pending:
            cls = pending.pop()
            self.wrap(cls)
            pending.extend(cls.__subclasses__())
        # Classes defined inside the context.
        previous = torch.nn.Module.__dict__.get("__init_subclass__")
        self.subclass_hook = previous
        context = self

        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            context.wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)

    def exit(self):
        if self.subclass_hook is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self.subclass_hook
        for cls, original in self.wrapped.items():
            cls.__init__ = original
        self.wrapped.clear()


_active_init = None


@contextlib.contextmanager
def init(config=None):
    """ZeRO stage 3: modules constructed inside this context have their parameters partitioned
    over the ranks as soon as each module's __init__ returns (its reset_parameters and custom
    initialization still see the whole tensors): each rank keeps its shard of the values and
    param.data becomes an empty tensor, so the whole model never exists on a rank. A
    ZeroOptimizer created over such parameters gathers them around each module's forward and
    backward (docs/python.md, "Stage 3"). Float32 CPU parameters that require a gradient are
    partitioned; buffers and frozen parameters stay whole. `config` (optional, a path or dict)
    is checked to say zero_optimization.stage 3. Local: needs only the rank and world size
    (zinf.init()); every rank must build the same model with the same initial values (seed)."""
    global _active_init
    stage = _stage_of(config) if config is not None else 3
    if stage is not None and stage != 3:
        raise ValueError(f"zinf.torch.init partitions parameters for ZeRO stage 3, but the "
                         f"config's zero_optimization.stage is {stage}")
    if _active_init is not None:  # nested: the outer context partitions
        yield
        return
    facts = zinf.init()
    if config is not None:
        _set_wait_timeout(config)
    context = _InitContext(facts["rank"], facts["world_size"],
                           None if config is None else _spill_directory(config))
    _install_module_hooks()
    torch.nn.Parameter.__deepcopy__ = _deepcopy_parameter
    context.enter()
    _active_init = context
    try:
        yield
    finally:
        _active_init = None
        context.exit()


@contextlib.contextmanager
def gathered(params, modify=False):
    """Inside this context the partitioned parameters among `params` (a module, a parameter, or
    an iterable of parameters or (name, parameter) pairs) hold their whole weights in .data:
    for reading (evaluation, export) or, before a ZeroOptimizer owns them, with modify=True, for
    setting them (load_state_dict of a pretrained model): on exit rank 0's values become every
    rank's (each keeps its shard of them). Collective: every rank passes the same parameters in
    the same order. Parameters that are not partitioned are left alone. With modify=False a
    change is discarded on exit; modify=True on parameters an optimizer owns raises ValueError
    (the engine holds their fp32 master weights: restore a checkpoint instead). Scopes nest:
    an inner scope or a forward pass inside one leaves the outer scope's whole weights."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    elif isinstance(params, torch.Tensor):
        params = [params]
    chosen, seen = [], set()
    for item in params:
        p = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        if _part(p) is not None and id(p) not in seen:
            seen.add(id(p))
            chosen.append(p)
    if modify:
        owned = [p for p in chosen if _part(p).optimizer() is not None]
        if owned:
            raise ValueError(
                f"gathered(modify=True): {len(owned)} parameter(s) (the first of shape "
                f"{_shape(_part(owned[0]).shape)}) belong to a ZeroOptimizer, whose engine holds "
                "their fp32 master weights: set the weights before creating the optimizer, or "
                "restore a checkpoint")
    _acquire(chosen, "gathered()")
    try:
        yield
        if modify:
            _broadcast_from_rank0(chosen)
    finally:
        _unuse(chosen)


def _broadcast_from_rank0(params, call="gathered()"):
    """Collective: rank 0's whole weights into every rank's p.data and shard."""
    problem = ""
    for p in params:
        part = _part(p)
        if tuple(p.shape) != part.shape or p.dtype != torch.float32 or p.device.type != "cpu":
            where = "gathered(modify=True)" if call == "gathered()" else call
            problem = (f"{where}: parameter {part.name}'s .data was replaced by a {p.dtype} "
                       f"tensor of shape {_shape(p.shape)} on {p.device}; set its values in place "
                       f"(a float32 CPU tensor of shape {_shape(part.shape)})")
            break
    _zinf.agree("InvalidArgument", problem, call=call)
    for p in params:
        part = _part(p)
        whole = p.detach().reshape(-1).contiguous().clone()
        _zinf.broadcast(whole.numpy(), 0, call=call)
        part.shard = _kept_shard(whole[part.begin:part.end], part.spill)
        p.data = whole.view(part.shape)
        part.full = True


def _lent_bytes(parts):
    """An estimate for the engine's memory plan of the most whole weights this process holds at
    once for the partitioned parameters `parts` (_Partition): those of the modules on one chain
    of forward calls (a module and its ancestors), the largest once more for one lent by name,
    and as much again for their gradients before backward hands them."""
    own = collections.Counter()
    for part in parts:
        own[part.holder] += part.numel * 4
    def chain(holder):
        names = holder.split(".") if holder else []
        return sum(own.get(".".join(names[:i]), 0) for i in range(len(names) + 1))
    return 2 * (max(chain(h) for h in own) + max(part.numel for part in parts) * 4)
