"""A parameter and its param group as ZeroOptimizer registers them with the engine: _Registered
(the tensor, its name and host buffers), the param groups' own hyper-parameters (_GROUP_KEYS,
their ranges), which parameters are staged through fp32 host buffers, and the checks of a
tensor's memory and layout against the registered one."""

import math

import torch

from .messages import _shape


class _Registered:
    """One parameter as the engine sees it: the tensor, its name and the host buffers."""

    def __init__(self, name, param, weights, grads, part=None):
        self.name = name
        self.param = param
        self.part = part  # stage 3: the parameter's _Partition (no weights buffer), else None
        self.shape = part.shape if part is not None else tuple(param.shape)
        self.dtype = param.dtype
        self.device = param.device
        # Staged: a CUDA or a float16/bfloat16 parameter, copied through fp32 host buffers
        # around every step. Otherwise (float32 on the CPU) used in place.
        self.staged = part is None and _staged(param)
        self.weights = weights  # in place: param.detach(), its memory; staged: an fp32 copy;
        #                         partitioned: None
        self.grads = grads      # private: an in-place parameter's .grad is a view of it; lent
        #                         gradients (stages 2 and 3): None
        # The parameter's memory and layout as registered (held, so that no later tensor takes
        # its address), and the addresses the engine was given.
        self.view = None if part is not None else param.detach()
        self.addresses = tuple(None if b is None else b.data_ptr() for b in (weights, grads))
        # Lent gradients: the engine's index, the AccumulateGrad node and its hook, and whether
        # this micro-batch's gradient was handed already.
        self.index = -1
        self.group = 0  # its param group's index
        self.node = None
        self.hook = None
        self.handed = False


# A param group's own hyper-parameters (the rest of the optimizer is the config's).
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def _hyper_problem(values, where):
    """What is wrong with a param group's values (a dict of some of _GROUP_KEYS; "" if
    nothing): the ranges of the config's optimizer.params."""
    def number(x):
        if isinstance(x, torch.Tensor) and x.numel() == 1:
            x = x.item()
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError
        return float(x)
    for key in _GROUP_KEYS:
        if key not in values:
            continue
        x = values[key]
        try:
            if key == "betas":
                betas = [number(b) for b in x]
                if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
                    raise ValueError
            else:
                v = number(x)
                if not math.isfinite(v) or v < 0 or (key == "eps" and v == 0):
                    raise ValueError
        except (TypeError, ValueError):
            want = {"lr": "a finite number >= 0", "betas": "two numbers in [0, 1)",
                    "eps": "a finite number > 0", "weight_decay": "a finite number >= 0"}[key]
            return f"{where}: '{key}' is {x!r}; it must be {want}"
    return ""


# Parameter dtypes besides float32, and the config block that must enable them: the engine
# rounds the working weights it writes to that precision, so copying them into the parameter
# is exact.
_HALF_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _staged(p):
    return p.device.type != "cpu" or p.dtype != torch.float32


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



def _grad_array(r, g):
    """A lent gradient as the float32 CPU array the engine copies."""
    if g.layout != torch.strided:
        g = g.to_dense()
    if not g.dtype.is_floating_point or tuple(g.shape) != r.shape:
        raise ValueError(f"parameter {r.name}: its gradient is {g.dtype} of shape "
                         f"{_shape(g.shape)}; the engine takes a floating-point gradient of "
                         f"shape {_shape(r.shape)}")
    return g.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
