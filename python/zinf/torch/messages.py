"""zinf.torch's messages: log (zinf.log, also zinf.torch.log) and _shape, a shape as the
errors print it ("[4, 8]")."""

import zinf


def log(*args, level="info"):
    """zinf.log: one line on rank 0 (INFO), every rank for "warn" and "error"."""
    zinf.log(*args, level=level)


def _shape(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"
