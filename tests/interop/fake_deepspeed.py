"""Stand-ins for the DeepSpeed classes whose objects DeepSpeed's checkpoint files pickle.

DeepSpeed's torch.save files name a few of DeepSpeed's own classes: param_slice_mappings hold
deepspeed.utils.tensor_fragment.fragment_address objects, the optimizer state a LossScaler or
DynamicLossScaler of deepspeed.runtime.fp16.loss_scaler, zero_stage a
deepspeed.runtime.zero.config.ZeroStageEnum member. The classes here carry those names and the
state such files hold, so that the tests can write (pickle.dumps, torch.save) and read
(torch.load) the globals DeepSpeed's files hold without DeepSpeed installed. No DeepSpeed code
is copied: only the names and the state as it appears in the files.

register() puts them in sys.modules under DeepSpeed's module names, which pickle needs to write
a class by name and to find it again when loading. The scripts beside this file import it (they
are run by path, so this folder is on sys.path); torch must be importable (the scripts exit 77
before importing this when it is not).
"""

import dataclasses
import enum
import sys
import types

import torch


@dataclasses.dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's name
    numel: int
    start: int


class LossScaler:
    """A static loss scaler's state."""

    def __init__(self, scale):
        self.cur_scale = scale
        self.dynamic = False


class DynamicLossScaler:
    """A dynamic loss scaler's state, for fp16."""

    def __init__(self, scale, cur_iter, last_overflow_iter, hysteresis):
        self.cur_scale = scale
        self.cur_iter = cur_iter
        self.last_overflow_iter = last_overflow_iter
        self.scale_factor = 2.0
        self.scale_window = 1000
        self.min_scale = 1
        self.delayed_shift = 2
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = False
        self.raise_error_at_min_scale = True
        self.dynamic = True
        self.dtype = torch.float16


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


MODULES = {
    "deepspeed.utils.tensor_fragment": [fragment_address],
    "deepspeed.runtime.fp16.loss_scaler": [LossScaler, DynamicLossScaler],
    "deepspeed.runtime.zero.config": [ZeroStageEnum],
}
for _module, _classes in MODULES.items():
    for _cls in _classes:
        _cls.__module__ = _module


def register():
    """Puts the modules of MODULES (and their parent packages, where missing) in sys.modules,
    each holding its classes. Idempotent; they stay registered."""
    for module, classes in MODULES.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            sys.modules.setdefault(name, types.ModuleType(name))
        for cls in classes:
            setattr(sys.modules[module], cls.__qualname__, cls)
