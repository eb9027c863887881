"""Any tensor as a kv_view, without a copy: objects with __dlpack__ (PyTorch,
NumPy >= 1.22, CuPy, kvcache Views) through the C library's checked import
(kv_view_from_dlpack), and objects with only __array_interface__ or the
buffer protocol through their pointer, shape and strides. Strides are
honoured as they are: nothing here calls .contiguous().

An output (writable=True) is checked for writability whatever its type,
from what the object itself says: NumPy's writeable flag, the array
interface's read-only flag, a memoryview's .readonly, a DLPack >= 1.0
capsule's READ_ONLY flag (asked for with max_version=(1, 0)). An object
that cannot say - a DLPack 0.x capsule has no such flag - is refused as an
output, and so is anything the results would reach only as a copy (a
list, a DLPack capsule flagged IS_COPIED): nothing is written that the
caller did not hand over as writable memory."""
import ctypes
import sys

import numpy as np

from . import _lib
from .errors import check, error

L = _lib.lib

_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_GetPointer.restype = ctypes.c_void_p
_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_IsValid.restype = ctypes.c_int
_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


# DLPack 1.0 (dlpack.h): a versioned managed tensor, which carries flags. The
# library speaks DLPack 0.6; the DLTensor inside is the same struct.
class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _lib.DLTensor)]


DLPACK_FLAG_READ_ONLY = 1 << 0
DLPACK_FLAG_IS_COPIED = 1 << 1

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host"}

_NP_DTYPES = {np.dtype("float32"): "f32", np.dtype("float16"): "f16",
              np.dtype("float64"): "f64", np.dtype("int8"): "i8", np.dtype("int32"): "i32",
              np.dtype("int64"): "i64", np.dtype("uint8"): "u8"}


class Borrowed:
    """A kv_view of someone else's tensor, valid while this object lives (it
    holds the tensor and the DLPack capsule)."""

    def __init__(self, view, device, keep):
        self.view = view
        self.device = device  # (DLDeviceType, id)
        self._keep = keep

    def ref(self):
        return ctypes.byref(self.view)


def _not_writable(what, why):
    return error("KV_ERR_INVALID_ARG", "%s is an output, and %s" % (what, why))


def _capsule(obj, stream=None):
    """obj's DLPack capsule: DLPack 1.0 (versioned, with flags) if the
    producer takes max_version, else 0.x. stream (CUDA producers only): the
    cudaStream_t handle the consumer will use, so that the producer orders
    its own work before it (DLPack's stream argument; 0, the default stream,
    is passed as 1, the legacy default stream, since DLPack reserves 0)."""
    kw = {} if stream is None else {"stream": stream or 1}
    try:
        return obj.__dlpack__(max_version=(1, 0), **kw)
    except TypeError:  # a producer from before DLPack 1.0: no max_version
        return obj.__dlpack__(**kw)


def _from_dlpack(obj, what, writable, cap):
    """The Borrowed view of capsule cap from obj, or None for a DLPack 0.x
    capsule as an output (it cannot say whether its memory is writable)."""
    if _IsValid(cap, b"dltensor_versioned"):
        mv = ctypes.cast(_GetPointer(cap, b"dltensor_versioned"),
                         ctypes.POINTER(DLManagedTensorVersioned)).contents
        if mv.version.major != 1:
            raise error("KV_ERR_UNSUPPORTED", "%s: a DLPack %d.%d tensor (kvcache reads 1.x)" %
                        (what, mv.version.major, mv.version.minor))
        if writable and mv.flags & DLPACK_FLAG_READ_ONLY:
            raise _not_writable(what, "its DLPack tensor is flagged read-only")
        if writable and mv.flags & DLPACK_FLAG_IS_COPIED:
            raise _not_writable(what, "its DLPack tensor is a copy (flagged IS_COPIED): the "
                                "results would not reach it")
        mt = _lib.DLManagedTensor()  # the 0.6 form the library checks: the same DLTensor
        mt.dl_tensor = mv.dl_tensor
        mtp = ctypes.pointer(mt)
    elif _IsValid(cap, b"dltensor"):
        if writable:
            return None
        mtp = ctypes.cast(_GetPointer(cap, b"dltensor"), ctypes.POINTER(_lib.DLManagedTensor))
    else:
        raise error("KV_ERR_INVALID_ARG", "%s: __dlpack__ returned %s, not a DLPack capsule" %
                    (what, type(cap).__name__))
    v = _lib.ViewC()
    dev = _lib.DLDevice()
    st = L.kv_view_from_dlpack(mtp, ctypes.byref(v), ctypes.byref(dev))
    if st != 0:
        check(st, what)
    # the capsule stays unconsumed: its producer frees the tensor when it goes
    return Borrowed(v, (dev.device_type, dev.device_id), (obj, cap))


def _from_array_interface(obj, what, writable=False):
    a = obj if isinstance(obj, np.ndarray) else np.asarray(obj)
    if writable and not a.flags.writeable:
        raise _not_writable(what, "its memory is read-only (%s)" %
                            ("NumPy's writeable flag" if a is obj else
                             "the read-only flag of its array interface" if
                             hasattr(obj, "__array_interface__") else "a read-only buffer"))
    if a.dtype not in _NP_DTYPES:
        raise error("KV_ERR_UNSUPPORTED",
                    "%s: NumPy dtype %s has no kvcache dtype" % (what, a.dtype))
    if any(s < 0 for s in a.strides):
        raise error("KV_ERR_INVALID_ARG", "%s: negative strides %s (kvcache views have none)" %
                    (what, a.strides))
    if any(s % a.itemsize for s in a.strides):
        raise error("KV_ERR_INVALID_ARG", "%s: strides %s are not multiples of the element "
                    "size %d" % (what, a.strides, a.itemsize))
    if a.ndim > _lib.KV_MAX_DIMS:
        raise error("KV_ERR_BAD_DIM", "%s: ndim %d > %d" % (what, a.ndim, _lib.KV_MAX_DIMS))
    code = ctypes.c_int()
    check(L.kv_dtype_parse(_NP_DTYPES[a.dtype].encode(), ctypes.byref(code)))
    v = _lib.ViewC()
    v.dtype = code.value
    v.ndim = a.ndim
    last = 0
    for i in range(a.ndim):
        v.shape[i] = a.shape[i]
        v.strides[i] = a.strides[i] // a.itemsize
        last += (a.shape[i] - 1) * v.strides[i] if a.shape[i] else 0
    v.offset = 0
    v.base = a.ctypes.data if a.size else None
    v.storage_bytes = (last + 1) * a.itemsize if a.size else 0
    return Borrowed(v, (_DL_CPU, 0), (obj, a))


_TORCH_DTYPES = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16",
                 "torch.float64": "f64", "torch.int8": "i8", "torch.int32": "i32",
                 "torch.int64": "i64", "torch.uint8": "u8",
                 # where torch has them (2.1 and later): kvcache's two fp8 formats
                 "torch.float8_e4m3fn": "fp8_e4m3", "torch.float8_e5m2": "fp8_e5m2"}
_CODES = {}
_I64x8 = ctypes.c_int64 * _lib.KV_MAX_DIMS


def _code(name):
    c = _CODES.get(name)
    if c is None:
        out = ctypes.c_int()
        check(L.kv_dtype_parse(name.encode(), ctypes.byref(out)))
        c = _CODES[name] = out.value
    return c


def _from_torch(t, what, device=(_DL_CPU, 0)):
    """A torch tensor's view from its own metadata (what its __dlpack__
    would carry, without building a capsule): the common case, made cheap.
    device: where its data_ptr() points (a CUDA tensor's is a device
    address)."""
    name = _TORCH_DTYPES.get(str(t.dtype))
    if name is None:
        raise error("KV_ERR_UNSUPPORTED",
                    "%s: torch dtype %s has no kvcache dtype" % (what, t.dtype))
    shape, strides = t.shape, t.stride()
    if len(shape) > _lib.KV_MAX_DIMS:
        raise error("KV_ERR_BAD_DIM", "%s: ndim %d > %d" % (what, len(shape), _lib.KV_MAX_DIMS))
    es = t.element_size()
    numel = t.numel()
    last = sum((n - 1) * st for n, st in zip(shape, strides) if n) if numel else 0
    v = _lib.ViewC(_code(name), len(shape), _I64x8(*shape), _I64x8(*strides), 0,
                   t.data_ptr() if numel else None, (last + 1) * es if numel else 0)
    return Borrowed(v, device, t)


def _buffer(obj):
    """A memoryview of obj if it has the buffer protocol, else None."""
    if isinstance(obj, (str, int, float)):
        return None
    try:
        return memoryview(obj)
    except TypeError:
        return None


def where(obj):
    """obj's DLPack device (type, id) as far as it can be told without
    touching its data: a torch tensor's device, a NumPy array, list or
    buffer (host), or what its __dlpack_device__ says; None when nothing
    says (the producer is asked for its capsule then)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        d = obj.device
        if d.type == "cuda":
            return (_DL_CUDA, d.index if d.index is not None else 0)
        return (_DL_CPU, 0) if d.type == "cpu" else (-1, d.type)
    if isinstance(obj, (np.ndarray, list, tuple, range, bytes, bytearray, memoryview)):
        return (_DL_CPU, 0)
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            t, i = dev()
            return (int(t), int(i))
        except Exception:  # a producer that cannot say: let its capsule say
            return None
    if hasattr(obj, "__array_interface__") or _buffer(obj) is not None:
        return (_DL_CPU, 0)
    return None


def where_name(w):
    """A device as words: "cuda:0", "host memory", "cuda_host:0" ..."""
    if w is None:
        return "of unknown device"
    if w[0] == -1:
        return "on %s" % w[1]
    if w[0] == _DL_CPU:
        return "host memory"
    return "on %s:%d" % (_DEVICE_NAMES.get(w[0], "device type %d" % w[0]), w[1])


def borrow(obj, what="tensor", writable=False, stream=None):
    """A Borrowed kv_view of obj (PyTorch / NumPy / kvcache View / anything
    with __dlpack__, the array interface or the buffer protocol; a list as
    an input). writable: obj is an output, and is refused unless it says
    its memory may be written (see the module's doc). A CUDA tensor's view
    has device (kDLCUDA, id); the caller decides whether it takes one.
    stream: the cudaStream_t a CUDA producer's capsule is asked for (see
    _capsule); torch tensors are read from their own metadata."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            return _from_torch(obj, what, (_DL_CUDA, obj.device.index or 0))
        if obj.device.type != "cpu":
            raise error("KV_ERR_UNSUPPORTED", "%s is on %s; kvcache takes host memory and "
                        "CUDA memory" % (what, obj.device))
        return _from_torch(obj, what)
    if isinstance(obj, np.ndarray):
        return _from_array_interface(obj, what, writable)
    own = getattr(type(obj), "_kv_borrow", None)  # a kvcache View: the cache's memory
    if own is not None:
        view, device, keep = own(obj)
        return Borrowed(view, device, keep)
    if isinstance(obj, (list, tuple)):
        if writable:
            raise _not_writable(what, "a %s is copied on the way in: the results would reach "
                                "the copy, not it" % type(obj).__name__)
        return _from_array_interface(obj, what)
    legacy = False
    if hasattr(obj, "__dlpack__"):
        try:
            w = where(obj) if stream is not None else None
            cap = _capsule(obj, stream if w is not None and w[0] == _DL_CUDA else None)
        except (RuntimeError, TypeError, BufferError) as e:
            # NumPy refuses to export some arrays (read-only, unaligned): fall
            # back to its array interface, which describes the same memory
            if not hasattr(obj, "__array_interface__") and _buffer(obj) is None:
                raise error("KV_ERR_INVALID_ARG", "%s: __dlpack__ failed: %s" % (what, e))
        else:
            b = _from_dlpack(obj, what, writable, cap)
            if b is not None:
                return b
            legacy = True  # an output over DLPack 0.x: try what else it says
    if hasattr(obj, "__array_interface__"):
        return _from_array_interface(obj, what, writable)
    m = _buffer(obj)
    if m is not None:
        if writable and m.readonly:
            raise _not_writable(what, "its buffer is read-only")
        try:
            a = np.asarray(m)
        except (ValueError, TypeError) as e:
            raise error("KV_ERR_INVALID_ARG", "%s: its buffer is not an array NumPy can view "
                        "(%s)" % (what, e))
        b = _from_array_interface(a, what, writable)
        b._keep = (obj, m, a)
        return b
    if legacy:
        raise _not_writable(what, "%s exports DLPack 0.x only, which cannot say whether its "
                            "memory may be written (pass a NumPy array, a torch tensor, or a "
                            "DLPack >= 1.0 producer)" % type(obj).__name__)
    raise error("KV_ERR_INVALID_ARG", "%s: %s has neither __dlpack__ nor __array_interface__ "
                "nor the buffer protocol" % (what, type(obj).__name__))


def host_only(b, what):
    """Refuse device memory for a CPU kernel (it would dereference it)."""
    if b.device[0] not in (_DL_CPU, _DL_CUDA_HOST):
        raise error("KV_ERR_UNSUPPORTED", "%s is on %s:%d; the CPU kernels take host memory "
                    "(CUDA tensors go to a PagedCache over CUDA memory)" %
                    (what, _DEVICE_NAMES.get(b.device[0], str(b.device[0])), b.device[1]))
    return b


# ---- fp8 across the boundary ------------------------------------------------

_FP8 = ("fp8_e4m3", "fp8_e5m2")
_U8, FP8_CODES = _code("u8"), (_code(_FP8[0]), _code(_FP8[1]))
FP8_OR_U8 = frozenset((_U8,) + FP8_CODES)  # the dtype codes raw_fp8 looks at


def raw_fp8(b, what, cache_dtype):
    """b for a kernel of a cache of dtype cache_dtype (a kv_dtype code): a
    uint8 tensor holds raw fp8 bytes in the cache's fp8 format (NumPy has
    no fp8 type, and torch had none before 2.1), so on an fp8 cache it is
    read and written as that format, bytes as they are; on any other cache
    it is refused (its bytes have no format to be read in). An fp8 tensor
    (torch.float8_e4m3fn / float8_e5m2) of the other fp8 format than an fp8
    cache is refused by name: mixing the two is a mistake, not a
    conversion anyone asks for. Everything else passes unchanged."""
    dt = b.view.dtype
    if dt == _U8:
        if cache_dtype not in FP8_CODES:
            name = L.kv_dtype_name(cache_dtype).decode()
            raise error("KV_ERR_UNSUPPORTED",
                        "%s: a uint8 tensor is taken as raw fp8 bytes, and the cache holds %s, "
                        "not fp8 (pass %s elements or another float type)" % (what, name, name))
        v = _lib.ViewC.from_buffer_copy(b.view)  # b.view may be a kvcache View's own
        v.dtype = cache_dtype
        return Borrowed(v, b.device, b._keep)
    if dt in FP8_CODES and cache_dtype in FP8_CODES and dt != cache_dtype:
        raise error("KV_ERR_MISMATCH", "%s: %s elements, the cache holds %s (the two fp8 "
                    "formats are not mixed; raw bytes go as uint8)" %
                    (what, L.kv_dtype_name(dt).decode(), L.kv_dtype_name(cache_dtype).decode()))
    return b


# ---- memory an engine owns ----------------------------------------------------

# DLPack (code, bits) -> kvcache name, for the dtype check of a memory tensor
_DL_FLOATS = {(2, 16): "f16", (2, 32): "f32", (2, 64): "f64", (4, 16): "bf16",
              (10, 8): "fp8_e4m3", (12, 8): "fp8_e5m2"}  # 10, 12: DLPack 1.1's fp8 codes


class Region:
    """One contiguous range of bytes someone else owns: address, size, where
    (a DLPack device), its elements (a kvcache dtype name, or "int<bits>" /
    "uint<bits>" for integers, which hold raw bits of any type, or a
    foreign type's name), their size, and what keeps it alive."""

    def __init__(self, ptr, nbytes, device, elem, elem_bytes, keep):
        self.ptr, self.nbytes, self.device = ptr, nbytes, device
        self.elem, self.elem_bytes, self._keep = elem, elem_bytes, keep

    @property
    def raw(self):
        """Integer elements: raw bits, whatever they encode."""
        return self.elem.startswith(("int", "uint"))


def _dense(shape, strides_elems):
    """C-contiguous (strides of size-1 dims do not matter, as in NumPy)."""
    want = 1
    for n, st in zip(reversed(shape), reversed(strides_elems)):
        if n != 1 and st != want:
            return False
        want *= n
    return True


def _not_dense(what, shape, strides):
    return error("KV_ERR_INVALID_ARG", "%s: shape %s with strides %s (elements) is not "
                 "C-contiguous; a paged cache addresses one contiguous range of bytes" %
                 (what, tuple(shape), tuple(strides)))


def _numpy_region(a, what, keep):
    if not a.flags.writeable:
        raise _not_writable(what, "its memory is read-only (%s)" %
                            ("NumPy's writeable flag" if a is keep else
                             "the read-only flag of its array interface or buffer"))
    if not a.flags.c_contiguous:
        raise _not_dense(what, a.shape, tuple(s // a.itemsize for s in a.strides))
    kind = a.dtype.kind
    # raw bits only in the machine's byte order: a '>u4' array's integers
    # are not the bits the kernels read (its name, e.g. >u4, is refused)
    raw = kind in "iu" and (a.dtype.isnative or a.itemsize == 1)
    elem = ("%s%d" % ("int" if kind == "i" else "uint", 8 * a.itemsize) if raw
            else _NP_DTYPES.get(a.dtype, str(a.dtype)))
    return Region(a.ctypes.data if a.size else None, a.nbytes, (_DL_CPU, 0), elem,
                  a.itemsize, keep)


def _torch_region(t, what, device_ok):
    cuda = t.device.type == "cuda"
    if t.device.type != "cpu" and not (cuda and device_ok):
        raise error("KV_ERR_UNSUPPORTED", "%s is on %s: this takes host or pinned memory%s" %
                    (what, t.device, " (a PagedCache takes CUDA memory)" if cuda else ""))
    if not t.is_contiguous():
        raise _not_dense(what, t.shape, t.stride())
    name, es = str(t.dtype), t.element_size()
    if t.is_floating_point() or t.is_complex() or name == "torch.bool":
        elem = _TORCH_DTYPES.get(name, name)
    else:
        elem = "%s%d" % ("uint" if name.startswith("torch.uint") else "int", 8 * es)
    dev = (_DL_CUDA, t.device.index or 0) if cuda else (_DL_CPU, 0)
    # Kept: the storage itself (t.detach(): t.set_() repoints t, not this),
    # and on the CPU a NumPy view of it, with which torch refuses resize_()
    # ("storage that is not resizable") instead of moving the memory.
    u8 = sys.modules["torch"].uint8
    keep = (t.detach(),) if cuda else (t.detach(), t.detach().view(u8).numpy())
    return Region(t.data_ptr() if t.numel() else None, t.numel() * es, dev, elem, es, keep)


def _dlpack_region(obj, what, cap, device_ok):
    if _IsValid(cap, b"dltensor_versioned"):
        mv = ctypes.cast(_GetPointer(cap, b"dltensor_versioned"),
                         ctypes.POINTER(DLManagedTensorVersioned)).contents
        if mv.version.major != 1:
            raise error("KV_ERR_UNSUPPORTED", "%s: a DLPack %d.%d tensor (kvcache reads 1.x)" %
                        (what, mv.version.major, mv.version.minor))
        if mv.flags & DLPACK_FLAG_READ_ONLY:
            raise _not_writable(what, "its DLPack tensor is flagged read-only")
        if mv.flags & DLPACK_FLAG_IS_COPIED:
            raise _not_writable(what, "its DLPack tensor is a copy (flagged IS_COPIED): the "
                                "engine would not see the cache's writes")
        t = mv.dl_tensor
    elif _IsValid(cap, b"dltensor"):
        t = ctypes.cast(_GetPointer(cap, b"dltensor"),
                        ctypes.POINTER(_lib.DLManagedTensor)).contents.dl_tensor
    else:
        raise error("KV_ERR_INVALID_ARG", "%s: __dlpack__ returned %s, not a DLPack capsule" %
                    (what, type(cap).__name__))
    kind, dev_id = t.device.device_type, t.device.device_id
    if kind not in (_DL_CPU, _DL_CUDA_HOST) and not (kind == _DL_CUDA and device_ok):
        raise error("KV_ERR_UNSUPPORTED", "%s is on %s:%d: this takes host or pinned memory%s" %
                    (what, _DEVICE_NAMES.get(kind, "device type %d" % kind), dev_id,
                     " (a PagedCache takes CUDA memory)" if kind == _DL_CUDA else ""))
    if not _IsValid(cap, b"dltensor_versioned"):
        return None  # DLPack 0.x cannot say whether the memory may be written
    if t.dtype.lanes != 1 or t.dtype.bits % 8:
        raise error("KV_ERR_UNSUPPORTED", "%s: DLPack dtype code %d bits %d lanes %d (kvcache "
                    "takes whole bytes, lanes 1)" % (what, t.dtype.code, t.dtype.bits,
                                                     t.dtype.lanes))
    shape = [t.shape[i] for i in range(t.ndim)]
    if t.strides and not _dense(shape, [t.strides[i] for i in range(t.ndim)]):
        raise _not_dense(what, shape, [t.strides[i] for i in range(t.ndim)])
    es = t.dtype.bits // 8
    n = 1
    for x in shape:
        n *= x
    code = t.dtype.code
    elem = ("%s%d" % ("int" if code == 0 else "uint", t.dtype.bits) if code in (0, 1) else
            _DL_FLOATS.get((code, t.dtype.bits), "DLPack code %d bits %d" % (code, t.dtype.bits)))
    ptr = (t.data or 0) + t.byte_offset
    return Region(ptr if n else None, n * es, (kind, dev_id if kind == _DL_CUDA else 0), elem,
                  es, (obj, cap))


def region(obj, what="memory", device_ok=False):
    """The Region of obj, memory an engine allocated (a torch tensor, a NumPy
    array, anything with __dlpack__, the array interface or the buffer
    protocol), for a paged cache over it: one C-contiguous range, host (or
    pinned) memory, or CUDA memory where device_ok (a PagedCache's),
    writable as the outputs of the kernels are (see the module's doc);
    refused naming obj's shape, strides, device or flags."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_region(obj, what, device_ok)
    if isinstance(obj, np.ndarray):
        return _numpy_region(obj, what, obj)
    if isinstance(obj, (list, tuple)):
        raise _not_writable(what, "a %s is copied on the way in: the cache would live in the "
                            "copy" % type(obj).__name__)
    legacy = False
    if hasattr(obj, "__dlpack__"):
        try:
            cap = _capsule(obj)
        except (RuntimeError, TypeError, BufferError) as e:
            if not hasattr(obj, "__array_interface__") and _buffer(obj) is None:
                raise error("KV_ERR_INVALID_ARG", "%s: __dlpack__ failed: %s" % (what, e))
        else:
            r = _dlpack_region(obj, what, cap, device_ok)
            if r is not None:
                return r
            legacy = True
    if hasattr(obj, "__array_interface__"):
        return _numpy_region(np.asarray(obj), what, (obj,))
    m = _buffer(obj)
    if m is not None:
        if m.readonly:
            raise _not_writable(what, "its buffer is read-only")
        a = np.asarray(m)
        r = _numpy_region(a, what, (obj, m, a))
        return r
    if legacy:
        raise _not_writable(what, "%s exports DLPack 0.x only, which cannot say whether its "
                            "memory may be written (pass a NumPy array, a torch tensor, or a "
                            "DLPack >= 1.0 producer)" % type(obj).__name__)
    raise error("KV_ERR_INVALID_ARG", "%s: %s has neither __dlpack__ nor __array_interface__ "
                "nor the buffer protocol" % (what, type(obj).__name__))
