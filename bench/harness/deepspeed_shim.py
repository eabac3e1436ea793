# Runs DeepSpeed's own checkpoint tools (utils/zero_to_fp32.py, checkpoint/ds_to_universal.py)
# from a DeepSpeed source tree without installing DeepSpeed (zinf's code; none of DeepSpeed's is
# copied here). `import deepspeed` needs pydantic 2 and packaging, which Debian 12's Python lacks,
# so the packages whose __init__ pulls those in are registered as bare packages pointing into the
# tree (their modules load from its files; their __init__.py never runs), with the two names the
# tools take from them (deepspeed.utils.logger, deepspeed.runtime.config_utils's base class).
# torch < 2.1 has no torch.load(mmap=...), which zero_to_fp32 passes: it is dropped there. A
# missing tqdm is replaced by a pass-through.
import importlib.util
import inspect
import logging
import sys
import types


def _package(name, path):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def install(tree):
    """Makes `import deepspeed.<tool module>` load DeepSpeed's files from `tree`."""
    if tree not in sys.path:
        sys.path.insert(0, tree)
    root = f"{tree}/deepspeed"
    _package("deepspeed", root)
    utils = _package("deepspeed.utils", f"{root}/utils")
    utils.logger = logging.getLogger("deepspeed")
    comm = types.ModuleType("deepspeed.comm")
    sys.modules["deepspeed.comm"] = comm
    sys.modules["deepspeed"].comm = comm
    _package("deepspeed.runtime", f"{root}/runtime")
    _package("deepspeed.runtime.fp16", f"{root}/runtime/fp16")
    config_utils = types.ModuleType("deepspeed.runtime.config_utils")

    class DeepSpeedConfigObject:  # what loss_scaler.py derives from
        pass

    DeepSpeedConfigObject.__module__ = "deepspeed.runtime.config_utils"
    config_utils.DeepSpeedConfigObject = DeepSpeedConfigObject
    sys.modules["deepspeed.runtime.config_utils"] = config_utils

    import torch

    if "mmap" not in inspect.signature(torch.load).parameters:
        original = torch.load

        def load(*args, mmap=None, **kwargs):  # noqa: ARG001 (torch < 2.1 maps nothing)
            return original(*args, **kwargs)

        torch.load = load
    if importlib.util.find_spec("tqdm") is None:
        tqdm = types.ModuleType("tqdm")
        tqdm.tqdm = lambda iterable=None, *args, **kwargs: iterable
        sys.modules["tqdm"] = tqdm
