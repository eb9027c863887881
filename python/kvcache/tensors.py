"""Any tensor as a kv_view, without a copy: objects with __dlpack__ (PyTorch,
NumPy >= 1.22, CuPy, kvcache Views) through the C library's checked import
(kv_view_from_dlpack), and objects with only __array_interface__ through
their pointer, shape and strides. Strides are honoured as they are: nothing
here calls .contiguous()."""
import ctypes

import numpy as np

from . import _lib
from .errors import check, error

L = _lib.lib

_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_GetPointer.restype = ctypes.c_void_p
_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

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


def _from_dlpack(obj, what):
    cap = obj.__dlpack__()
    addr = _GetPointer(cap, b"dltensor")
    mt = ctypes.cast(addr, ctypes.POINTER(_lib.DLManagedTensor))
    v = _lib.ViewC()
    dev = _lib.DLDevice()
    st = L.kv_view_from_dlpack(mt, ctypes.byref(v), ctypes.byref(dev))
    if st != 0:
        check(st, what)
    # the capsule stays unconsumed: its producer frees the tensor when it goes
    return Borrowed(v, (dev.device_type, dev.device_id), (obj, cap))


def _from_array_interface(obj, what):
    a = obj if isinstance(obj, np.ndarray) else np.asarray(obj)
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
                 "torch.int64": "i64", "torch.uint8": "u8"}
_CODES = {}
_I64x8 = ctypes.c_int64 * _lib.KV_MAX_DIMS


def _code(name):
    c = _CODES.get(name)
    if c is None:
        out = ctypes.c_int()
        check(L.kv_dtype_parse(name.encode(), ctypes.byref(out)))
        c = _CODES[name] = out.value
    return c


def _from_torch(t, what):
    """A CPU torch tensor's view from its own metadata (what its __dlpack__
    would carry, without building a capsule): the common case, made cheap."""
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
    return Borrowed(v, (_DL_CPU, 0), t)


def borrow(obj, what="tensor", writable=False):
    """A Borrowed kv_view of obj (PyTorch / NumPy / kvcache View / anything
    with __dlpack__ or the array interface). writable: obj is an output, so
    a read-only NumPy array is refused rather than written."""
    if type(obj).__module__ == "torch" and hasattr(obj, "data_ptr"):
        if obj.device.type != "cpu":
            raise error("KV_ERR_UNSUPPORTED", "%s is on %s; the CPU kernels take host memory" %
                        (what, obj.device))
        return _from_torch(obj, what)
    if isinstance(obj, np.ndarray):
        if writable and not obj.flags.writeable:
            raise error("KV_ERR_INVALID_ARG", "%s: a read-only NumPy array as an output" % what)
        return _from_array_interface(obj, what)
    if hasattr(obj, "__dlpack__"):
        try:
            return _from_dlpack(obj, what)
        except (RuntimeError, TypeError, BufferError) as e:
            # NumPy refuses to export some arrays (read-only, unaligned): fall
            # back to its array interface, which describes the same memory
            if not hasattr(obj, "__array_interface__"):
                raise error("KV_ERR_INVALID_ARG", "%s: __dlpack__ failed: %s" % (what, e))
    if hasattr(obj, "__array_interface__") or isinstance(obj, (list, tuple)):
        return _from_array_interface(obj, what)
    raise error("KV_ERR_INVALID_ARG", "%s: %s has neither __dlpack__ nor __array_interface__" %
                (what, type(obj).__name__))


def host_only(b, what):
    """Refuse device memory for a CPU kernel (it would dereference it)."""
    if b.device[0] not in (_DL_CPU, _DL_CUDA_HOST):
        raise error("KV_ERR_UNSUPPORTED", "%s is on %s:%d; the CPU kernels take host memory" %
                    (what, _DEVICE_NAMES.get(b.device[0], str(b.device[0])), b.device[1]))
    return b
