"""zinf: ZeRO optimizer state on node-local NVMe for PyTorch training loops under mpirun.

    import zinf.torch
    opt = zinf.torch.ZeroOptimizer(model.named_parameters(), config="ds.json")

See zinf.torch.ZeroOptimizer and docs/python.md. This package itself holds what does not need
torch: MPI start-up (init), rank-0 logging (log) and the exceptions (zinf.errors).
"""

import atexit as _atexit
import ctypes as _ctypes
import sys as _sys

from . import errors
from .errors import ZinfError

# Open MPI loads its transport plugins with dlopen; they need libmpi's symbols global, which a
# Python extension (loaded RTLD_LOCAL) does not give them. Load libmpi globally first.
for _name in ("libmpi.so.40", "libmpi.so"):
    try:
        _ctypes.CDLL(_name, mode=_ctypes.RTLD_GLOBAL)
        break
    except OSError:
        pass

from . import _zinf  # noqa: E402  (after libmpi)

__all__ = ["init", "log", "errors", "ZinfError"]

_facts = None


def init():
    """Initializes MPI (or adopts it when mpi4py or another library already did) and returns
    the process's place in the job: a dict with rank, world_size, local_rank, local_size, node
    and owns_mpi. Idempotent; ZeroOptimizer calls it. MPI is finalized at interpreter exit
    (after the optimizers still open are closed) only when zinf initialized it."""
    global _facts
    if _facts is None:
        _facts = dict(_zinf.init())
        _atexit.register(_zinf.finalize)
        if _facts["world_size"] > 1:
            _end_job_on_unhandled_exception(_facts["rank"])
    return dict(_facts)


def _end_job_on_unhandled_exception(rank):
    """An exception that ends the program on one rank would leave the others waiting for it in
    their next collective: after Python has printed it, the job is ended (MPI_Abort) with an
    ERROR line naming the rank and the exception. zinf's errors raised alike on every rank (the
    result of a collective call: .agreed) end the program as usual."""
    previous = _sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        if getattr(value, "agreed", False):
            return
        text = str(value).splitlines()[0][:500] if str(value) else ""
        _zinf.abort_job(f"rank {rank}: unhandled {kind.__name__}"
                        f"{': ' + text if text else ''}; ending the job so that no rank "
                        "waits for this one")

    _sys.excepthook = hook


def log(*args, level="info"):
    """Prints one line through zinf's logger: "[time] [info] [rank 0/N] ..."; INFO lines are
    printed by rank 0 only (every rank with ZINF_LOG_ALL_RANKS=1), WARN and ERROR by every
    rank."""
    init()
    _zinf.log(level, " ".join(str(a) for a in args))
