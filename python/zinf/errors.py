"""The exceptions zinf raises: one class per zinf error code, all subclasses of ZinfError.

Every error of the engine reaches Python as the class of its code, on every rank alike (the
engine agrees on errors across ranks). ``e.code`` is the code's name ("DataLoss", ...),
``e.errno`` the system error behind it (0 if none), ``str(e)`` the message. ``e.agreed`` is
True when every rank raises the same error (the result of a collective call); a zinf error of
one rank alone (e.g. a closed optimizer) and any other exception that ends the program on one
rank ends the whole job (zinf.init's excepthook, docs/python.md "When a rank fails").
"""


class ZinfError(RuntimeError):
    """A zinf error: ``code`` (e.g. "NotFound"), ``errno`` (0 if none), the message."""

    def __init__(self, message, code="Internal", errno=0):
        super().__init__(message)
        self.message = message
        self.code = code
        self.errno = errno
        self.agreed = False

    def __str__(self):
        return f"{self.code}: {self.message}"


class UnavailableError(ZinfError):
    """Transient: a busy resource; retrying may work."""


class NotFoundError(ZinfError):
    """A file, directory, key or checkpoint does not exist."""


class AlreadyExistsError(ZinfError):
    """Something to be created exists already."""


class InvalidArgumentError(ZinfError, ValueError):
    """A bad value: a config key, a parameter, an argument."""


class FailedPreconditionError(ZinfError):
    """The state does not allow the call (e.g. a parameter changed, a closed optimizer)."""


class ResourceExhaustedError(ZinfError):
    """Out of disk space, memory or buffers."""


class UnimplementedError(ZinfError):
    """Not supported here (a kernel feature, a build option)."""


class AbortedError(ZinfError):
    """Cancelled, e.g. because another rank failed."""


class DataLossError(ZinfError):
    """An I/O error, a checksum mismatch, truncated or corrupted data."""


class InternalError(ZinfError):
    """A broken invariant or an unexpected library failure."""


_BY_CODE = {
    "Unavailable": UnavailableError,
    "NotFound": NotFoundError,
    "AlreadyExists": AlreadyExistsError,
    "InvalidArgument": InvalidArgumentError,
    "FailedPrecondition": FailedPreconditionError,
    "ResourceExhausted": ResourceExhaustedError,
    "Unimplemented": UnimplementedError,
    "Aborted": AbortedError,
    "DataLoss": DataLossError,
    "Internal": InternalError,
}


def class_for_code(code):
    """The exception class of a zinf error code name (ZinfError for an unknown one)."""
    return _BY_CODE.get(code, ZinfError)
