"""Integers crossing into C: every one checked against the range of the C
type it lands in, and refused by name, before ctypes or NumPy can wrap it.

ctypes stores 2**32 + 3 in a uint32 field or argument as 3 without a word,
and NumPy's astype wraps the same way, so a value is checked here as the
Python integer it is, and an array's min and max before any conversion
(an array whose dtype converts safely needs no check and gets none: the
common case costs nothing).

    seq = integer(seq, "seq", U32)
    blocks = int_array(blocks, "blocks", U32, ndim=1)
"""
import ctypes
import operator

import numpy as np

from .errors import error


class CInt:
    """A C integer type: its name, range [lo, hi], and NumPy dtype."""
    __slots__ = ("name", "lo", "hi", "dtype")

    def __init__(self, name, ctype):
        bits = 8 * ctypes.sizeof(ctype)
        signed = ctype(-1).value == -1
        self.name = name
        self.lo = -(1 << (bits - 1)) if signed else 0
        self.hi = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
        self.dtype = np.dtype("%s%d" % ("int" if signed else "uint", bits))

    def __repr__(self):
        return "%s [%d, %d]" % (self.name, self.lo, self.hi)


I32 = CInt("int32", ctypes.c_int32)
U32 = CInt("uint32", ctypes.c_uint32)
I64 = CInt("int64", ctypes.c_int64)
U64 = CInt("uint64", ctypes.c_uint64)
INT = CInt("int", ctypes.c_int)  # C int (enums, dims, device ids)
SIZE = CInt("size_t", ctypes.c_size_t)


def _outside(what, value, t):
    return error("KV_ERR_INVALID_ARG", "%s = %d is outside the range of %s, [%d, %d]" %
                 (what, value, t.name, t.lo, t.hi))


def integer(value, what, t):
    """value as a Python int in t's range, or InvalidArgument naming `what`.
    Integers of any kind (int, NumPy integers, anything with __index__) are
    taken; floats and strings are refused rather than truncated."""
    try:
        v = operator.index(value)
    except TypeError:
        raise error("KV_ERR_INVALID_ARG", "%s: an integer (%s, [%d, %d]), got %s %r" %
                    (what, t.name, t.lo, t.hi, type(value).__name__, value)) from None
    if v < t.lo or v > t.hi:
        raise _outside(what, v, t)
    return v


def _first_outside(a, t):
    """(index, value) of a's first element outside t (a: an integer or
    object array known to have one)."""
    for i, x in enumerate(a.reshape(-1).tolist()):
        if x < t.lo or x > t.hi:
            return np.unravel_index(i, a.shape), x
    return None, None


def c_array(a, dtype=None):
    """a as a C-contiguous array whose address is aligned to its element size
    (what C reads through a typed pointer): a itself when it already is,
    else a copy. np.ascontiguousarray keeps an unaligned array as it is (a
    np.frombuffer at an odd offset), and C reading int64_t or float through
    that address is undefined behaviour (UBSan: "load of misaligned
    address")."""
    a = np.ascontiguousarray(a, dtype)
    return a if a.flags.aligned else a.copy()


def real(x, what):
    """x as a Python float (a softmax scale, a soft cap), or InvalidArgument
    naming `what` and the value: a string, None or an array is not one."""
    if isinstance(x, (str, bytes)) or x is None:
        raise error("KV_ERR_INVALID_ARG", "%s: a real number, got %s %r"
                    % (what, type(x).__name__, x))
    try:
        return float(x)
    except (TypeError, ValueError) as e:
        raise error("KV_ERR_INVALID_ARG", "%s: a real number, got %s %r (%s)"
                    % (what, type(x).__name__, x, e)) from None


def int_array(xs, what, t, ndim=None):
    """xs as a C-contiguous, aligned array of t's dtype, every element
    checked against t's range before the conversion (none wraps), or
    InvalidArgument naming `what` and the first element outside. Non-integer
    elements (floats, bools) are refused, not truncated; an empty sequence
    of any dtype is an empty array."""
    try:
        a = xs if isinstance(xs, np.ndarray) else np.asarray(xs)
    except (ValueError, TypeError, OverflowError) as e:
        raise error("KV_ERR_INVALID_ARG",
                    "%s: not an array of integers (%s)" % (what, e)) from None
    if a.dtype == t.dtype and (ndim is None or a.ndim == ndim):  # the common case
        return c_array(a)
    if ndim is not None and a.ndim != ndim and not (a.size == 0 and a.ndim == 1):
        raise error("KV_ERR_INVALID_ARG", "%s: %d-d, got shape %s" % (what, ndim, a.shape))
    if a.size == 0:
        return np.zeros(a.shape, t.dtype)
    kind = a.dtype.kind
    if kind == "O":  # Python integers past int64 / uint64, or a mix
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
                   for x in a.reshape(-1).tolist()):
            raise error("KV_ERR_INVALID_ARG", "%s: integers (%s, [%d, %d]), got %s" %
                        (what, t.name, t.lo, t.hi,
                         sorted({type(x).__name__ for x in a.reshape(-1).tolist()})))
        where, bad = _first_outside(a, t)
        if where is not None:
            raise _index_outside(what, where, bad, t)
        return np.array(a.reshape(-1).tolist(), t.dtype).reshape(a.shape)
    if kind not in "iu":
        raise error("KV_ERR_INVALID_ARG", "%s: integers (%s, [%d, %d]), got %s values" %
                    (what, t.name, t.lo, t.hi, a.dtype))
    if not np.can_cast(a.dtype, t.dtype, "safe"):
        lo, hi = int(a.min()), int(a.max())
        if lo < t.lo or hi > t.hi:
            where, bad = _first_outside(a, t)
            raise _index_outside(what, where, bad, t)
    return c_array(a, t.dtype)


def _index_outside(what, where, value, t):
    at = "[%s]" % ", ".join(str(int(i)) for i in where) if where else ""
    return _outside("%s%s" % (what, at), value, t)
