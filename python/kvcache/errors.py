"""Errors: every non-OK kv_status raises a KvError subclass named after it,
carrying the status name (.status), its code (.code) and the C library's
message for the failed call (.message, from kv_last_error, which names the
offending values). Subclasses also derive from the closest Python built-in
(ValueError, IndexError, MemoryError, ...) so generic handlers work too.

The codes are the library's: STATUS (name -> code) is read from
kv_status_name at import, so a refusal made here in Python (error(name,
message)) carries the same code as one from C, and no code is written down
in this package."""
from . import _lib


class KvError(Exception):
    """A kvcache call failed. .status: "KV_ERR_...", .code: its value, .message:
    the library's words (a status the library has no name for: .code None)."""
    status = "KV_ERR_UNKNOWN"
    code = None

    def __init__(self, message, status=None, code=None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code

    def __str__(self):
        return "%s: %s" % (self.status, self.message)


class InvalidArgument(KvError, ValueError): pass
class NullArgument(KvError, ValueError): pass
class BadDim(KvError, IndexError): pass
class BadShape(KvError, ValueError): pass
class OutOfBounds(KvError, IndexError): pass
class NeedsCopy(KvError): pass
class Overlap(KvError, ValueError): pass
class Overflow(KvError, OverflowError): pass
class NoMemory(KvError, MemoryError): pass
class NoBlocks(KvError): pass
class NotFound(KvError, LookupError): pass
class BadState(KvError, RuntimeError): pass
class Unsupported(KvError, NotImplementedError): pass
class TooCostly(KvError): pass
class Mismatch(KvError, ValueError): pass
class IoError(KvError, OSError): pass
class Timeout(KvError, TimeoutError): pass
class Cancelled(KvError): pass
class Corrupt(KvError): pass
class Internal(KvError, RuntimeError): pass
class Capacity(KvError): pass
class DeviceError(KvError, RuntimeError): pass


_BY_NAME = {
    "KV_ERR_INVALID_ARG": InvalidArgument, "KV_ERR_NULL": NullArgument,
    "KV_ERR_BAD_DIM": BadDim, "KV_ERR_BAD_SHAPE": BadShape,
    "KV_ERR_OUT_OF_BOUNDS": OutOfBounds, "KV_ERR_NEEDS_COPY": NeedsCopy,
    "KV_ERR_OVERLAP": Overlap, "KV_ERR_OVERFLOW": Overflow, "KV_ERR_NO_MEMORY": NoMemory,
    "KV_ERR_NO_BLOCKS": NoBlocks, "KV_ERR_NOT_FOUND": NotFound, "KV_ERR_BAD_STATE": BadState,
    "KV_ERR_UNSUPPORTED": Unsupported, "KV_ERR_TOO_COSTLY": TooCostly,
    "KV_ERR_MISMATCH": Mismatch, "KV_ERR_IO": IoError, "KV_ERR_TIMEOUT": Timeout,
    "KV_ERR_CANCELLED": Cancelled, "KV_ERR_CORRUPT": Corrupt, "KV_ERR_INTERNAL": Internal,
    "KV_ERR_CAPACITY": Capacity, "KV_ERR_DEVICE": DeviceError,
}


def _status_table():
    """name -> code of every kv_status the library has (KV_OK and the
    negative KV_ERR_* codes), from its own kv_status_name."""
    table = {}
    for code in range(0, -256, -1):
        name = _lib.lib.kv_status_name(code).decode()
        if name != "KV_UNKNOWN_STATUS":
            table[name] = code
    return table


STATUS = _status_table()
for _name, _cls in _BY_NAME.items():  # InvalidArgument("...") alone has its status and code
    if _name in STATUS:
        _cls.status, _cls.code = _name, STATUS[_name]


def error_class(status):
    """The KvError subclass of a status name ("KV_ERR_NO_BLOCKS" -> NoBlocks)."""
    return _BY_NAME.get(status, KvError)


def error(status, message):
    """The KvError for a refusal made in Python before any C call: status by
    name ("KV_ERR_INVALID_ARG"), its class and the library's code for it."""
    if status not in STATUS:
        raise Internal("kvcache: the library has no status %s (refusing: %s)" %
                       (status, message))
    return error_class(status)(message, status=status, code=STATUS[status])


def error_for(code, context=None):
    """The KvError for status `code` of the call just made (this thread's
    kv_last_error)."""
    name = _lib.lib.kv_status_name(code).decode()
    msg = (_lib.lib.kv_last_error() or b"").decode(errors="replace")
    if context and not msg:
        msg = context
    return error_class(name)(msg or name, status=name, code=code)


def check(code, context=None):
    """Raise the KvError of a non-zero status."""
    if code != 0:
        raise error_for(code, context)
