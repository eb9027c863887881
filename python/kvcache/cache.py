"""Layout, Cache and View: the paged KV cache as Python objects.

Arrays handed out (block tables, slot mappings, CSR indices, block lists)
are NumPy arrays the caller owns. Views of the cache's memory are zero-copy:
View objects implement __dlpack__ / __dlpack_device__, so
torch.from_dlpack(view) and numpy.from_dlpack(view) see the cache's own
bytes, and the tensor keeps the cache alive (a reference on the C cache)
until the framework frees it.

The kernels take uint8 tensors as raw fp8 bytes of an fp8 cache's format
(inputs and outputs; tensors.raw_fp8), and View.as_bytes() exports an fp8
view through DLPack. PagedCache (paged.py) runs the same kernel methods on
memory an engine owns, with Pages.from_csr / Pages.from_block_table over
its own page-table arrays.
"""
import ctypes
import functools
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from . import _lib
from ._ints import I32, I64, INT, U32, U64, c_array, int_array, integer, real
from .errors import check, error
from . import cuda as _gpu
from .tensors import FP8_CODES, FP8_OR_U8, borrow, host_only, raw_fp8, where

L = _lib.lib

ORDERS = {"NHD": 0, "HND": 1}
ARRANGES = {"layer": 0, "block": 1}
_MEM = {"host": 0, "pinned": 1, "device": 2}
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


def _dtype_code(name):
    out = ctypes.c_int()
    check(L.kv_dtype_parse(name.encode(), ctypes.byref(out)))
    return out.value


def _plan_config(heads, layers):
    """A kv_plan_config from (values, names) pairs for heads and layers
    (either None), or None when both are: each tuple's length and every value
    checked, InvalidArgument naming the field."""
    if heads is None and layers is None:
        return None
    cfg = _lib.PlanConfig()
    cfg.struct_size = ctypes.sizeof(_lib.PlanConfig)
    for part, what in ((heads, "heads"), (layers, "layers")):
        if part is None:
            continue
        values, names = part
        try:
            fits = not isinstance(values, (str, bytes)) and len(values) == len(names)
        except TypeError:  # an int, None: no length
            fits = False
        if not fits:
            raise error("KV_ERR_INVALID_ARG", "%s: (%s), got %r" % (what, ", ".join(names),
                                                                     values))
        for x, n in zip(values, names):
            setattr(cfg, n, integer(x, "%s.%s" % (what, n), I64))
    return cfg


def _layer_arg(layer):
    """A write's or read's layer: None (every layer: the library's
    KV_ATTN_ALL_LAYERS, -1) or one in [0, L); a negative one is refused by
    name rather than read as every layer."""
    if layer is None:
        return -1
    v = integer(layer, "layer", I32)
    if v < 0:
        raise error("KV_ERR_INVALID_ARG", "layer %d: one in [0, L), or None for every layer" % v)
    return v


def _pages_c(pages):
    """pages' struct kv_pages, or InvalidArg naming what was passed."""
    c = getattr(pages, "_c", None)
    if c is None:
        raise error("KV_ERR_INVALID_ARG", "pages: a kvcache.Pages (Cache.pages(seqs), "
                    "Pages.from_csr, Pages.from_block_table), got %s" % type(pages).__name__)
    return c


_PLANES = {None: 0, "kv": 3, "k": 1, "v": 2}  # 0: the planes the cache has


def _copy_opts(layers, planes, num_layers):
    """A kv_copy_blocks_opts for copy_blocks' layers and planes, or None
    when both are None (every layer, K and V). layers: one layer, a range or
    slice of step 1, or (start, stop); the bounds are the library's to
    check, an empty range is refused here (n_layers 0 would mean "to the
    end")."""
    if layers is None and planes is None:
        return None
    if not (planes is None or isinstance(planes, str)) or planes not in _PLANES:
        raise error("KV_ERR_INVALID_ARG", "planes: None, \"kv\", \"k\" or \"v\", got %r"
                    % (planes,))
    o = _lib.CopyBlocksOpts()
    o.struct_size = ctypes.sizeof(_lib.CopyBlocksOpts)
    o.planes = _PLANES[planes]
    if layers is None:
        return o
    if isinstance(layers, (range, slice)):
        if layers.step not in (None, 1):
            raise error("KV_ERR_INVALID_ARG", "layers: a range of step 1, got %r" % (layers,))
        start = 0 if layers.start is None else layers.start
        stop = num_layers if layers.stop is None else layers.stop
    elif isinstance(layers, tuple):
        if len(layers) != 2:
            raise error("KV_ERR_INVALID_ARG", "layers: (start, stop), got %r" % (layers,))
        start, stop = layers
    else:
        start = integer(layers, "layers", U32)
        stop = start + 1
    start, stop = integer(start, "layers start", U32), integer(stop, "layers stop", U32)
    if stop <= start:
        raise error("KV_ERR_INVALID_ARG", "layers: [%d, %d) is empty" % (start, stop))
    o.layer0, o.n_layers = start, stop - start
    return o


def _int32_slots(slots):
    """slots as a 1-d int32 array when the caller holds int32 (a NumPy
    array, or a CPU tensor seen through __array__ without a copy), read in
    place by kv_attn_write_i32 (copied where it is not contiguous, or not
    4-byte aligned: C reads it as int32_t); None for anything else (the
    int64 path)."""
    if slots is None or isinstance(slots, (list, tuple, range)) or not hasattr(slots, "dtype"):
        return None
    try:
        a = slots if isinstance(slots, np.ndarray) else np.asarray(slots)
    except (TypeError, ValueError, RuntimeError):
        return None  # a device tensor: the int64 path says why
    if a.dtype != np.int32:
        return None
    return c_array(a).reshape(-1)  # a view when contiguous and aligned


def _scale_values(x, what):
    """A scale or scales as a 1-d float32 array, or InvalidArgument naming
    `what` (a string is not a scale; NumPy would parse "2.0")."""
    try:
        if isinstance(x, (str, bytes)):
            raise TypeError("a string")
        return np.asarray(x, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise error("KV_ERR_INVALID_ARG", "%s: a float or one per KV head, got %s %r (%s)"
                    % (what, type(x).__name__, x, e)) from None


def _u32_array(xs, what):
    """A 1-d uint32 array of ids (sequences, blocks), none wrapped."""
    return int_array(xs, what, U32, ndim=1)


def _tokens(tokens):
    return int_array(tokens, "tokens", I32, ndim=1)


def _p(a, typ):
    return a.ctypes.data_as(typ)


def _host_index(obj, what, mem):
    """Refuse a CUDA index array for a host cache's kernel, by name."""
    w = where(obj)
    if w is not None and w[0] == _DL_CUDA:
        raise error("KV_ERR_UNSUPPORTED", "%s is on cuda:%d; this cache is %s memory and its "
                    "kernels read host arrays (CUDA index arrays go to a PagedCache over CUDA "
                    "memory)" % (what, w[1], mem))
    return obj


def _host_call(stream, errors, out_indptr=None):
    """Refuse the device kernels' arguments on a host cache's call."""
    for name, val in (("stream", stream), ("errors", errors), ("out_indptr", out_indptr)):
        if val is not None:
            raise error("KV_ERR_INVALID_ARG", "%s: an argument of a device cache's kernels "
                        "(a PagedCache over CUDA memory); this cache is host memory, and its "
                        "kernels run on the CPU in the calling thread" % name)


@dataclass(frozen=True)
class Layout:
    """Where every K/V element of every layer and block lives (kv_layout.h).

    num_layers, num_blocks, block_tokens (N), num_heads (H), head_dim (D),
    dtype ("bf16", "f16", "f32", "fp8_e4m3", ...), order ("NHD" / "HND"),
    arrange ("layer" / "block"-major), kv_packed, block_pad_elems,
    block_stride_bytes, align_bytes, k_only (one plane, K only: an MLA
    latent cache; not with kv_packed): as the C config (0 = default).
    Derived values (strides, sizes, fingerprints) are computed by the C
    library at construction; a config it refuses raises there."""
    num_layers: int
    num_blocks: int
    block_tokens: int
    num_heads: int
    head_dim: int
    dtype: str = "bf16"
    order: str = "NHD"
    arrange: str = "layer"
    kv_packed: bool = False
    block_pad_elems: int = 0
    block_stride_bytes: int = 0
    align_bytes: int = 0
    k_only: bool = False
    _c: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        out = _lib.LayoutC()
        check(L.kv_layout_init(ctypes.byref(self._config()), ctypes.byref(out)))
        object.__setattr__(self, "_c", out)

    def _config(self):
        for n in ("dtype", "order", "arrange"):  # C would stop a name at a NUL
            v = getattr(self, n)
            if not isinstance(v, str) or "\0" in v:
                raise error("KV_ERR_INVALID_ARG", "%s: a name (a string without NUL), got %s %r"
                            % (n, type(v).__name__, v))
        if self.order not in ORDERS:
            raise error("KV_ERR_INVALID_ARG", "order %r: one of %s" % (self.order, sorted(ORDERS)))
        if self.arrange not in ARRANGES:
            raise error("KV_ERR_INVALID_ARG",
                        "arrange %r: one of %s" % (self.arrange, sorted(ARRANGES)))
        c = _lib.LayoutConfig()
        c.struct_size = ctypes.sizeof(c)
        for n in ("num_layers", "num_blocks", "block_tokens", "num_heads", "head_dim",
                  "block_pad_elems", "block_stride_bytes", "align_bytes"):
            setattr(c, n, integer(getattr(self, n), n, I64))
        c.dtype = _dtype_code(self.dtype)
        c.order = ORDERS[self.order]
        c.arrange = ARRANGES[self.arrange]
        c.kv_packed = bool(self.kv_packed)
        c.k_only = bool(self.k_only)
        return c

    @property
    def fingerprint(self) -> int:
        """64-bit identity of the layout (equal layouts, equal fingerprints)."""
        return int(self._c.fingerprint)

    @property
    def block_format_fingerprint(self) -> int:
        """Identity of one block's format (ignores placement: count, padding, arrangement)."""
        return int(self._c.block_format_fingerprint)

    @property
    def total_bytes(self) -> int:
        return int(self._c.total_bytes)

    @property
    def elem_bytes(self) -> int:
        return int(self._c.elem_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer and plane (K or V; K|V when packed)."""
        return int(self._c.block_bytes)

    def strides_bytes(self) -> Dict[str, int]:
        """Byte strides: layer, kv, block, token, head, dim."""
        c = self._c
        return {"layer": c.stride_layer_bytes, "kv": c.stride_kv_bytes,
                "block": c.stride_block_bytes, "token": c.stride_token_bytes,
                "head": c.stride_head_bytes, "dim": c.stride_dim_bytes}


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The capsule destructor is C (kv_dlpack_capsule_destructor): it runs its
# tensor's deleter unless a consumer took the tensor, with no Python frame
# (an exception pending in the consumer stays as it is).
L.kv_dlpack_capsule_api(ctypes.cast(ctypes.pythonapi.PyCapsule_IsValid, ctypes.c_void_p),
                        ctypes.cast(ctypes.pythonapi.PyCapsule_GetPointer, ctypes.c_void_p))
_CAPSULE_DESTRUCTOR = ctypes.cast(L.kv_dlpack_capsule_destructor, ctypes.c_void_p).value


class _Memory:
    """A reference on the C cache (kv_cache_retain), dropped when this object
    goes, and what the cache's memory is: the owner of a View's bytes. Views
    (and View.numpy()'s arrays) hold one, so their memory outlives
    Cache.close() the way an exported DLPack tensor's does."""
    __slots__ = ("h", "mem", "device")

    def __init__(self, cache):
        self.h = None
        self.h = L.kv_cache_retain(cache._h)
        self.mem, self.device = cache.mem, cache.device

    def __del__(self):
        h, self.h = self.h, None
        if h:
            L.kv_cache_destroy(h)


class View:
    """A strided view of the cache's memory (kv_view): dtype, shape, strides
    (elements) and offset exactly as the C library describes them. Export
    with torch.from_dlpack(view) / numpy.from_dlpack(view): zero-copy, and
    the tensor holds a reference on the cache. The View holds one too: it,
    its select()/narrow() views and its numpy() arrays stay valid after
    Cache.close(), and the cache is freed when the last of them goes."""

    def __init__(self, memory, cview):
        self._m = memory
        self._v = cview

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._v.shape[i] for i in range(self._v.ndim))

    @property
    def strides(self) -> Tuple[int, ...]:
        """In elements."""
        return tuple(self._v.strides[i] for i in range(self._v.ndim))

    @property
    def offset(self) -> int:
        return int(self._v.offset)

    @property
    def dtype(self) -> str:
        return L.kv_dtype_name(self._v.dtype).decode()

    def select(self, dim: int, index: int) -> "View":
        """The view with dim removed at index (no copy)."""
        out = _lib.ViewC()
        check(L.kv_view_select(ctypes.byref(self._v), integer(dim, "dim", INT),
                               integer(index, "index", I64), ctypes.byref(out)))
        return View(self._m, out)

    def narrow(self, dim: int, start: int, length: int) -> "View":
        """The view of [start, start + length) along dim (no copy)."""
        out = _lib.ViewC()
        check(L.kv_view_narrow(ctypes.byref(self._v), integer(dim, "dim", INT),
                               integer(start, "start", I64), integer(length, "length", I64),
                               ctypes.byref(out)))
        return View(self._m, out)

    def numpy(self) -> np.ndarray:
        """A writeable NumPy array over the same bytes (zero-copy; host and
        pinned memory only). numpy.from_dlpack also works, but NumPy 1.x
        marks DLPack imports read-only. NumPy has no bfloat16 or fp8: those
        come as uint16 / uint8 holding the raw bits. The array keeps the
        cache alive (a reference on the C cache) while it exists."""
        if self._m.mem == "device":
            raise error("KV_ERR_INVALID_ARG", "numpy(): the view is in device memory (use "
                        "__dlpack__ with a GPU framework)")
        return np.asarray(_ArrayRef(self))

    def as_bytes(self) -> "View":
        """The same memory as a uint8 View, which DLPack exports whatever the
        dtype (fp8 has no DLPack 0.6 type): torch.from_dlpack(v.as_bytes())
        is the raw fp8 bytes (.view(torch.float8_e4m3fn) where torch has
        fp8). A 1-byte dtype (fp8, i8, u8) keeps its shape and strides; a
        wider one gets a last dimension of its element size (strides and
        offset scaled to bytes). It holds the same reference on the cache."""
        v = self._v
        es = L.kv_dtype_size(v.dtype)
        out = _lib.ViewC.from_buffer_copy(v)
        out.dtype = _dtype_code("u8")
        if es != 1:
            if v.ndim >= _lib.KV_MAX_DIMS:
                raise error("KV_ERR_BAD_DIM", "as_bytes(): a %d-d %s view has no room for the "
                            "byte dimension (at most %d dims)" % (v.ndim, self.dtype,
                                                                   _lib.KV_MAX_DIMS))
            for i in range(v.ndim):
                out.strides[i] = v.strides[i] * es
            out.shape[v.ndim], out.strides[v.ndim] = es, 1
            out.ndim = v.ndim + 1
            out.offset = v.offset * es
        return View(self._m, out)

    def __dlpack__(self, stream=None):
        if self._v.dtype in FP8_CODES:
            raise error("KV_ERR_UNSUPPORTED", "__dlpack__: dtype %s has no DLPack 0.6 type; "
                        "View.as_bytes() is a uint8 View of the same bytes that exports "
                        "(raw fp8 bytes; torch >= 2.1: .view(torch.float8_%s))" %
                        (self.dtype, "e4m3fn" if self.dtype == "fp8_e4m3" else "e5m2"))
        if stream not in (None, -1):
            if self._m.mem != "device":
                raise error("KV_ERR_INVALID_ARG",
                            "__dlpack__: stream %r for host memory" % (stream,))
        mt = ctypes.POINTER(_lib.DLManagedTensor)()
        check(L.kv_cache_to_dlpack(self._m.h, ctypes.byref(self._v), ctypes.byref(mt)))
        addr = ctypes.cast(mt, ctypes.c_void_p).value
        return _PyCapsule_New(addr, b"dltensor", _CAPSULE_DESTRUCTOR)

    def _kv_borrow(self):
        """For the kernels (tensors.borrow): this view, its DLPack device, and
        what keeps its memory alive. The cache's memory is writable."""
        return self._v, self.__dlpack_device__(), self._m

    def __dlpack_device__(self) -> Tuple[int, int]:
        kind = {"host": _DL_CPU, "pinned": _DL_CUDA_HOST, "device": _DL_CUDA}[self._m.mem]
        return (kind, self._m.device if kind == _DL_CUDA else 0)

    def __repr__(self):
        return "View(%s, shape=%s, strides=%s, offset=%d)" % (self.dtype, self.shape,
                                                               self.strides, self.offset)


_NP_TYPESTR = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "f64": "<f8", "i8": "|i1",
               "i32": "<i4", "i64": "<i8", "u8": "|u1", "fp8_e4m3": "|u1", "fp8_e5m2": "|u1"}


class _ArrayRef:
    """The __array_interface__ of a View, holding its reference on the cache
    (the array's base keeps this object, so the memory lives as long as the
    array)."""

    def __init__(self, view):
        v = view._v
        es = L.kv_dtype_size(v.dtype)
        self._m = view._m
        shape = tuple(v.shape[i] for i in range(v.ndim))
        self.__array_interface__ = {
            "shape": shape,
            "typestr": _NP_TYPESTR[view.dtype],
            "data": (v.base + v.offset * es if v.base else 0, False),
            "strides": tuple(v.strides[i] * es for i in range(v.ndim)),
            "version": 3,
        }


def _call(method):
    """A Cache method as one call in flight: refused (BadState) once the
    cache is closed or closing, and counted while it runs, so that close()
    on another thread waits for it instead of freeing the cache under it."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._leave()
    return call


class Cache:
    """A model's KV cache (kv_cache.h): layout, memory, block pool with prefix
    caching, page table. Sequences are integer ids from seq_create()/fork().

    The page table is single-threaded, like the C one: use a Cache from one
    thread (the engine's scheduler) at a time. Kernels on other threads may
    run alongside it. close() is safe from any thread: it waits for the
    calls in flight, and every call after it raises BadState."""

    _cuda = None  # a PagedCache over CUDA memory has its device side here (cuda.DeviceSide)

    def __init__(self, layout: Layout, max_seqs: int = 16, mem: str = "host", device: int = 0,
                 prefix_caching: bool = True, max_blocks_per_seq: int = 0, page_ratio: int = 0,
                 zero_fill: bool = False):
        self._h = None
        self._lock = threading.Lock()  # guards _h, _busy, _closers
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # calls in flight
        self._closers = 0  # close() calls waiting for them
        if not isinstance(layout, Layout):
            raise error("KV_ERR_INVALID_ARG", "layout: a kvcache.Layout, got %s" %
                        type(layout).__name__)
        if not isinstance(mem, str) or mem not in _MEM:
            raise error("KV_ERR_INVALID_ARG", "mem %r: one of %s" % (mem, sorted(_MEM)))
        page_ratio = integer(page_ratio, "page_ratio", U32)
        self.layout = layout
        self.mem = mem
        self.page_tokens = layout.block_tokens // max(page_ratio, 1)
        self.device = integer(device, "device", INT)
        cfg = _lib.CacheConfig()
        cfg.struct_size = ctypes.sizeof(cfg)
        cfg.layout = layout._config()
        cfg.mem_kind = _MEM[mem]
        cfg.device = self.device
        cfg.max_seqs = integer(max_seqs, "max_seqs", U32)
        cfg.max_blocks_per_seq = integer(max_blocks_per_seq, "max_blocks_per_seq", U32)
        cfg.page_ratio = page_ratio
        cfg.enable_prefix_caching = bool(prefix_caching)
        cfg.zero_fill = bool(zero_fill)
        h = ctypes.c_void_p()
        check(L.kv_cache_create(ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h
        self._pc = None
        self._pt = L.kv_cache_page_table(h)
        self._pool = L.kv_cache_pool(h)

    def _enter(self):
        with self._lock:
            if not self._h or self._closers:
                raise error("KV_ERR_BAD_STATE", "the cache is closed" if not self._h else
                            "the cache is closing (close() waits for the calls in flight)")
            self._busy += 1

    def _leave(self):
        with self._lock:
            self._busy -= 1
            if not self._busy and self._closers:
                self._idle.notify_all()

    @property
    def closed(self) -> bool:
        """True once close() has dropped the cache."""
        return not self._h

    def close(self, timeout: Optional[float] = None) -> None:
        """Drop this object's reference on the C cache (Views and tensors
        exported from it keep theirs). Calls in flight on other threads (a
        kernel, a page-table call) finish first: close() waits for them, and
        calls made meanwhile raise BadState. timeout (seconds): raise Timeout
        instead of waiting longer, the cache left open. Idempotent; also runs
        when the object is collected."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before there was anything to close
            return
        with self._idle:
            if not self._h:
                return
            self._closers += 1
            try:
                if not self._idle.wait_for(lambda: not self._busy, timeout):
                    raise error("KV_ERR_TIMEOUT", "close(): %d call(s) still in flight after "
                                "%gs; the cache stays open" % (self._busy, timeout))
            finally:
                self._closers -= 1
            h, self._h = self._h, None
            self._pc = self._pt = self._pool = None
        if h:  # another close() may have dropped it while this one waited
            L.kv_cache_destroy(h)

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- sequences ----------------------------------------------------------

    @_call
    def seq_create(self, extra_key: Optional[int] = None) -> int:
        """A new empty sequence; extra_key (LoRA id, salt) separates prefixes."""
        if extra_key is not None:
            extra_key = integer(extra_key, "extra_key", U64)
        s = ctypes.c_uint32()
        check(L.kv_page_table_seq_create(self._pt, ctypes.byref(s)))
        if extra_key is not None:
            check(L.kv_page_table_seq_set_extra_key(self._pt, s.value, extra_key))
        return s.value

    @_call
    def reuse_prefix(self, seq: int, tokens: Iterable[int]) -> int:
        """Start empty seq with the longest cached prefix of tokens; returns the
        number of tokens it now holds (whole cached blocks)."""
        seq = integer(seq, "seq", U32)
        t = _tokens(tokens)
        n = ctypes.c_uint64()
        check(L.kv_page_table_seq_reuse_prefix(self._pt, seq, _p(t, _lib.c_i32p), t.size,
                                               ctypes.byref(n)))
        return n.value

    @_call
    def append(self, seq: int, tokens: Iterable[int]) -> None:
        """Append tokens to seq (blocks allocated, full blocks hashed for reuse)."""
        seq = integer(seq, "seq", U32)
        t = _tokens(tokens)
        check(L.kv_page_table_seq_append(self._pt, seq, _p(t, _lib.c_i32p), t.size))

    @_call
    def blocks_needed(self, seq: int, n: int) -> int:
        b = ctypes.c_uint32()
        check(L.kv_page_table_blocks_needed(self._pt, integer(seq, "seq", U32),
                                            integer(n, "n", U64), ctypes.byref(b)))
        return b.value

    @_call
    def fork(self, seq: int) -> int:
        """A child sharing all of seq's blocks (copy-on-write on the next write
        into a shared block: see take_copies)."""
        c = ctypes.c_uint32()
        check(L.kv_page_table_seq_fork(self._pt, integer(seq, "seq", U32), ctypes.byref(c)))
        return c.value

    @_call
    def truncate(self, seq: int, n_tokens: int) -> None:
        check(L.kv_page_table_seq_truncate(self._pt, integer(seq, "seq", U32),
                                           integer(n_tokens, "n_tokens", U64)))

    @_call
    def free(self, seq: int) -> None:
        """Release seq's blocks (full ones stay cached for prefix reuse)."""
        check(L.kv_page_table_seq_free(self._pt, integer(seq, "seq", U32)))

    @_call
    def seq_len(self, seq: int) -> int:
        return self._seq_len(integer(seq, "seq", U32))

    def _seq_len(self, seq):
        n = ctypes.c_uint64()
        check(L.kv_page_table_seq_len(self._pt, seq, ctypes.byref(n)))
        return n.value

    @_call
    def seq_blocks(self, seq: int) -> np.ndarray:
        """seq's block ids, a new uint32 array."""
        p = _lib.c_u32p()
        n = ctypes.c_uint32()
        check(L.kv_page_table_seq_blocks(self._pt, integer(seq, "seq", U32), ctypes.byref(p),
                                         ctypes.byref(n)))
        return np.ctypeslib.as_array(p, shape=(n.value,)).copy() if n.value else \
            np.zeros(0, np.uint32)

    @_call
    def slot(self, seq: int, t: int) -> int:
        s = ctypes.c_int64()
        check(L.kv_page_table_slot(self._pt, integer(seq, "seq", U32), integer(t, "t", U64),
                                   ctypes.byref(s)))
        return s.value

    @_call
    def take_copies(self) -> np.ndarray:
        """Queued copy-on-write copies as an [n, 3] uint32 array (src, dst,
        tokens); run them, then call copies_done()."""
        n = L.kv_page_table_pending_copies(self._pt)
        buf = (_lib.BlockCopy * max(n, 1))()
        got = ctypes.c_uint32()
        check(L.kv_page_table_take_copies(self._pt, buf, n, ctypes.byref(got)))
        return np.array([[buf[i].src, buf[i].dst, buf[i].tokens] for i in range(got.value)],
                        dtype=np.uint32).reshape(got.value, 3)

    @_call
    def copies_done(self) -> None:
        check(L.kv_page_table_copies_done(self._pt))

    # ---- exports ------------------------------------------------------------

    @_call
    def export_vllm(self, seqs: Sequence[int],
                    ranges: Optional[Sequence[Tuple[int, int]]] = None,
                    cols: Optional[int] = None, pad: int = 0, tokens_per_seq: int = 0,
                    slot_mapping_len: Optional[int] = None, with_seq_lens: bool = False
                    ) -> Tuple[np.ndarray, ...]:
        """vLLM's forms: (block_table int32 [n_seqs, cols], slot_mapping int64)
        for the token ranges [(start, count), ...] of each sequence (default:
        all of each); slot_mapping is None without ranges and no default.
        with_seq_lens: also seq_lens int64 [n_seqs], the token count of each
        sequence (with block_table, the kernels' block-table pages). The
        arrays are sized by the library's own size query (cols: the longest
        sequence's pages, at least 1)."""
        s = _u32_array(seqs, "seqs")
        n = s.size
        pad = integer(pad, "pad", I32)
        tokens_per_seq = integer(tokens_per_seq, "tokens_per_seq", U32)
        if cols is not None:
            cols = integer(cols, "cols", U32)
        if slot_mapping_len is not None:
            slot_mapping_len = integer(slot_mapping_len, "slot_mapping_len", U64)
        if ranges is None:
            rga = np.array([(0, self._seq_len(int(q))) for q in s], np.uint64).reshape(-1, 2)
        else:
            # [n][2] uint64 (start, count) has kv_token_range's layout: no per-range loop
            rga = int_array(ranges, "ranges", U64)
            if rga.size % 2:
                raise error("KV_ERR_INVALID_ARG", "ranges: (start, count) pairs, got shape %s"
                            % (rga.shape,))
            rga = rga.reshape(-1, 2)
        if len(rga) != n:
            raise error("KV_ERR_INVALID_ARG", "ranges: %d for %d sequences" % (len(rga), n))
        rg = rga.ctypes.data_as(ctypes.POINTER(_lib.TokenRange)) if n else None
        sz = _lib.VllmExportSizes()
        query = _lib.VllmExport(tokens_per_seq=tokens_per_seq, sizes=ctypes.pointer(sz))
        check(L.kv_page_table_export_vllm(self._pt, _p(s, _lib.c_u32p), n, rg,
                                          ctypes.byref(query)))
        if cols is None:
            cols = max(sz.block_table_cols, 1)
        if slot_mapping_len is None:
            slot_mapping_len = sz.slot_mapping_len
        try:  # sizes the caller chose: NumPy's refusal (too large) as ours
            bt = np.empty((n, cols), dtype=np.int32)
            sm = np.empty(slot_mapping_len, dtype=np.int64)
        except (ValueError, MemoryError) as e:
            raise error("KV_ERR_NO_MEMORY", "export_vllm: block_table [%d, %d] int32 and "
                        "slot_mapping [%d] int64 (%d needed): %s" %
                        (n, cols, slot_mapping_len, sz.slot_mapping_len, e)) from None
        sl = np.empty(n if with_seq_lens else 0, dtype=np.int64)
        out = _lib.VllmExport(_p(bt, _lib.c_i32p), bt.size, cols, pad, _p(sm, _lib.c_i64p),
                              sm.size, tokens_per_seq,
                              _p(sl, _lib.c_i64p) if with_seq_lens else None, sl.size, None)
        check(L.kv_page_table_export_vllm(self._pt, _p(s, _lib.c_u32p), n, rg,
                                          ctypes.byref(out)))
        return (bt, sm, sl) if with_seq_lens else (bt, sm)

    @_call
    def export_flashinfer(self, seqs: Sequence[int]
                          ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's CSR form: (indptr [n+1], indices [nnz], last_page_len [n]), int32.
        An empty sequence has no pages and last_page_len 0."""
        s = _u32_array(seqs, "seqs")
        n = s.size
        nnz = ctypes.c_uint64()
        check(L.kv_page_table_export_flashinfer(self._pt, _p(s, _lib.c_u32p), n, None,
                                                ctypes.byref(nnz)))  # the size query
        indptr = np.empty(n + 1, np.int32)
        indices = np.empty(max(nnz.value, 1), np.int32)
        last = np.empty(max(n, 1), np.int32)
        out = _lib.FlashinferExport(_p(indptr, _lib.c_i32p), indptr.size,
                                    _p(indices, _lib.c_i32p), nnz.value,
                                    _p(last, _lib.c_i32p), n)
        got = ctypes.c_uint64()
        check(L.kv_page_table_export_flashinfer(self._pt, _p(s, _lib.c_u32p), n,
                                                ctypes.byref(out), ctypes.byref(got)))
        return indptr, indices[:got.value], last[:n]

    # ---- stats --------------------------------------------------------------

    @_call
    def pool_stats(self) -> Dict[str, int]:
        st = _lib.PoolStats()
        L.kv_block_pool_stats_get(self._pool, ctypes.byref(st))
        return {n: getattr(st, n) for n, _ in st._fields_}

    @_call
    def table_stats(self) -> Dict[str, int]:
        st = _lib.TableStats()
        L.kv_page_table_stats_get(self._pt, ctypes.byref(st))
        return {n: getattr(st, n) for n, _ in st._fields_}

    @_call
    def ref_count(self, block: int) -> int:
        return L.kv_block_pool_ref_count(self._pool, integer(block, "block", U32))

    # ---- kernels (CPU; the GIL is released while they run) -----------------

    def _paged(self):
        if self.mem == "device":
            raise error("KV_ERR_UNSUPPORTED", "the CPU kernels need a host or pinned cache; "
                        "this one is device memory (the CUDA kernels run on a PagedCache over "
                        "CUDA memory)")
        if self._pc is None:  # fixed for the cache's life: layout, base, size, kind
            pc = _lib.PagedCache()
            check(L.kv_cache_paged(self._h, ctypes.byref(pc)))
            self._pc = pc
        return self._pc

    def _tensor(self, obj, what, writable=False):
        """obj as a CPU kernel's tensor: host memory, any strides (borrowed,
        not copied), and uint8 read as raw bytes of an fp8 cache's format
        (tensors.raw_fp8)."""
        w = where(obj)  # a CUDA tensor is refused by name before its capsule is taken
        if w is not None and w[0] == _DL_CUDA:
            raise error("KV_ERR_UNSUPPORTED", "%s is on cuda:%d; this cache is %s memory and its "
                        "kernels run on the CPU (CUDA tensors go to a PagedCache over CUDA "
                        "memory)" % (what, w[1], self.mem))
        b = host_only(borrow(obj, what, writable), what)
        return raw_fp8(b, what, self.layout._c.dtype) if b.view.dtype in FP8_OR_U8 else b

    @staticmethod
    def _scales(scales, keep):
        if scales is None:
            return None
        if not isinstance(scales, (tuple, list)) or len(scales) != 2 or scales[0] is None:
            raise error("KV_ERR_INVALID_ARG", "scales: (k_scales, v_scales), or (k_scales, None) "
                        "for a K-only cache, each a float or one per KV head; got %r" % (scales,))
        ks = c_array(_scale_values(scales[0], "k_scales"))
        if scales[1] is None:  # K scales only: a K-only (MLA) cache
            keep.append(ks)
            sc = _lib.Scales(_p(ks, ctypes.POINTER(ctypes.c_float)), None,
                             integer(ks.size, "scales", U32))
            keep.append(sc)
            return ctypes.byref(sc)
        vs = c_array(_scale_values(scales[1], "v_scales"))
        if ks.size != vs.size:
            raise error("KV_ERR_INVALID_ARG",
                        "scales: %d K scales, %d V scales" % (ks.size, vs.size))
        keep += [ks, vs]
        sc = _lib.Scales(_p(ks, ctypes.POINTER(ctypes.c_float)),
                         _p(vs, ctypes.POINTER(ctypes.c_float)), integer(ks.size, "scales", U32))
        return ctypes.byref(sc)

    @_call
    def write(self, layer: Optional[int], k, v, slots: Sequence[int], scales=None,
              stream=None, errors=None) -> None:
        """Write K and V [T][H][D] (layer None: [L][T][H][D], every layer) of
        tokens 0..len(slots)-1 into their slots (-1 skips a token). k and v:
        any tensor with __dlpack__ or the array interface, any strides.
        scales: None or (k_scales, v_scales), one per tensor or per KV head.
        A K-only (MLA) cache takes v None and scales None or (k_scales, None).
        Scales apply to every cache dtype (stored = convert(x / scale)); vLLM
        applies them to fp8 caches only, so pass None for the others to
        match it. slots: int64 (vLLM's slot_mapping) or int32 (FlashInfer's
        and most engines'): a contiguous int32 NumPy array or CPU tensor is
        read in place (kv_attn_write_i32), never converted; anything else
        goes through int64. On a device cache (a PagedCache over CUDA memory:
        python/README.md "On the GPU"), k, v and slots (int64) are CUDA
        tensors, the call is enqueued on stream (default: torch's current
        stream) and invalid slots are recorded in errors (default: the
        cache's record)."""
        if self._cuda is not None:
            return _gpu.write(self, layer, k, v, slots, scales, stream, errors)
        _host_call(stream, errors)
        pc = self._paged()
        layer = _layer_arg(layer)
        s32 = _int32_slots(_host_index(slots, "slots", self.mem))
        sl = s32 if s32 is not None else int_array(slots, "slots", I64).reshape(-1)
        kb = self._tensor(k, "k")
        if v is None and not self.layout.k_only:
            raise error("KV_ERR_INVALID_ARG", "write: v is None, but this layout has a V plane "
                        "(only a K-only layout, Layout(k_only=True), takes v None)")
        vb = self._tensor(v, "v") if v is not None else None
        vref = vb.ref() if vb is not None else None
        keep = []
        if s32 is not None:
            check(L.kv_attn_write_i32(pc, layer, kb.ref(), vref, _p(sl, _lib.c_i32p),
                                      sl.size, self._scales(scales, keep)))
            return
        check(L.kv_attn_write(pc, layer, kb.ref(), vref, _p(sl, _lib.c_i64p), sl.size,
                              self._scales(scales, keep)))

    def pages(self, seqs: Sequence[int]) -> "Pages":
        """The CSR pages (FlashInfer form) of seqs, for read and decode."""
        return Pages(self, seqs)

    @_call
    def read(self, layer: Optional[int], pages: "Pages", k_out=None, v_out=None,
             scales=None, stream=None, errors=None, out_indptr=None) -> None:
        """Gather the tokens of pages' sequences into k_out / v_out [T][H][D]
        (layer None: [L][T][H][D]); either may be None. On a device cache:
        CUDA tensors and device pages, and out_indptr [S + 1] (int32, CUDA)
        gives each sequence's output rows; stream and errors as in write."""
        if self._cuda is not None:
            return _gpu.read(self, layer, pages, k_out, v_out, scales, stream, errors,
                              out_indptr)
        _host_call(stream, errors, out_indptr)
        pc = self._paged()
        layer = _layer_arg(layer)
        kb = self._tensor(k_out, "k_out", True) if k_out is not None else None
        vb = self._tensor(v_out, "v_out", True) if v_out is not None else None
        keep = []
        check(L.kv_attn_read(pc, layer, ctypes.byref(_pages_c(pages)),
                             kb.ref() if kb else None, vb.ref() if vb else None,
                             self._scales(scales, keep)))

    @_call
    def copy_blocks(self, copies, layers=None, planes=None, src: Optional["Cache"] = None,
                    stream=None, errors=None) -> None:
        """Copy blocks: copies [n, 2] or [n, 3] (src, dst[, tokens]), e.g.
        take_copies()'s result. layers: None (every layer), one layer, a
        range / slice with step 1, or (start, stop). planes: None or "kv"
        (K and V), "k" or "v". src: None copies within this cache (vLLM's
        copy_blocks: no dst may be another copy's src or dst); another Cache
        (or PagedCache) of the same block format (L, N, H, D, dtype, order,
        packing; its block count, arrangement and padding may differ) copies its blocks
        into this one (vLLM's swap_blocks: swap out into a host cache, swap
        in back), any ids on either side, no dst twice. Where this cache or
        src is a device cache: copies is an int32 CUDA tensor [n, 3], the
        other cache CUDA or pinned memory, stream and errors as in write."""
        if src is None or src is self:
            return self._copy_blocks(copies, layers, planes, None, stream, errors)
        if not hasattr(src, "_paged") or not hasattr(src, "_enter"):
            raise error("KV_ERR_INVALID_ARG", "src: a Cache or PagedCache, got %s" %
                        type(src).__name__)
        if getattr(src, "closed", False):
            raise error("KV_ERR_BAD_STATE", "src: the cache is closed")
        src._enter()  # src's close() waits for this copy, as self's does
        try:
            return self._copy_blocks(copies, layers, planes, src, stream, errors)
        finally:
            src._leave()

    def _copy_blocks(self, copies, layers, planes, src, stream, errors):
        if self._cuda is not None or (src is not None and src._cuda is not None):
            opts = _copy_opts(layers, planes, self.layout.num_layers)
            return _gpu.copy_blocks(self, copies, opts, src, stream, errors)
        _host_call(stream, errors)
        pc = self._paged()
        spc = src._paged() if src is not None else None
        opts = _copy_opts(layers, planes, self.layout.num_layers)
        a = int_array(_host_index(copies, "copies", self.mem), "copies", U32)
        if a.size == 0:
            return
        if a.ndim != 2 or a.shape[1] not in (2, 3):
            raise error("KV_ERR_INVALID_ARG", "copies: [n, 2] or [n, 3] (src, dst[, tokens]), "
                        "got shape %s" % (a.shape,))
        if a.shape[1] == 2:  # kv_block_copy is (src, dst, tokens), three uint32
            a = np.concatenate([a, np.zeros((len(a), 1), np.uint32)], axis=1)
        n = integer(len(a), "len(copies)", U32)
        cp = a.ctypes.data_as(ctypes.POINTER(_lib.BlockCopy))
        if spc is None and opts is None:
            check(L.kv_attn_copy_blocks(pc, cp, n))
            return
        check(L.kv_attn_copy_blocks_ex(pc, spc if spc is not None else pc, cp, n,
                                       ctypes.byref(opts) if opts is not None else None))

    @_call
    def decode(self, layer: int, q, pages: "Pages", out, scale: Optional[float] = None,
               scales=None, window_left: Optional[int] = None,
               soft_cap: Optional[float] = None, lse=None, stream=None, errors=None) -> None:
        """Paged decode attention of layer: q [S][Hq][D] -> out [S][Hq][D]
        over each sequence's tokens in pages; scale defaults to 1/sqrt(D).
        Options (kv_attn_decode_ex; docs/kernels.md has the formulas):
        window_left W (FlashInfer's: the last W + 1 tokens; None or -1: no
        window), soft_cap c (logits c * tanh(x / c); None or 0: off), lse
        (a writable float32 array [S][Hq], heads contiguous: the natural-log
        log-sum-exp of each query head's logits, -inf with no token). On a
        device cache: CUDA tensors, device pages, no options yet; stream and
        errors as in write."""
        if self._cuda is not None:
            return _gpu.decode(self, layer, q, pages, out, scale, scales,
                                (window_left, soft_cap, lse), stream, errors)
        _host_call(stream, errors)
        self._attend(layer, q, None, pages, out, scale, scales, window_left, soft_cap, lse)

    @_call
    def decode_mla(self, layer: int, q, pages: "Pages", out, scale: Optional[float] = None,
                   k_scale: Optional[float] = None) -> None:
        """MLA decode (kv_attn_decode_mla) over a K-only cache of one KV head:
        q [S][Hq][D] -> out [S][Hq][dv] (dv: out's last dim), FlashMLA's
        convention: scores over all D dims of the latent rows, values their
        first dv dims. scale defaults to 1/sqrt(D); k_scale: the per-tensor
        scale of an fp8 latent (None: 1)."""
        pc = self._paged()
        layer = integer(layer, "layer", U32)
        qb = self._tensor(q, "q")
        ob = self._tensor(out, "out", True)
        if scale is None:
            scale = 1.0 / float(self.layout.head_dim) ** 0.5
        keep = []
        sc = self._scales(None if k_scale is None else ([k_scale], None), keep)
        dv = ob.view.shape[ob.view.ndim - 1] if ob.view.ndim else 0
        check(L.kv_attn_decode_mla(pc, layer, qb.ref(), ctypes.byref(_pages_c(pages)),
                                   integer(dv, "dv", I64), real(scale, "softmax_scale"), sc, ob.ref()))

    @_call
    def prefill_mla(self, layer: int, q, qo_indptr, pages: "Pages", out,
                    scale: Optional[float] = None, k_scale: Optional[float] = None,
                    window_left: Optional[int] = None, soft_cap: Optional[float] = None,
                    lse=None) -> None:
        """MLA prefill (kv_attn_prefill_mla): prefill's causal multi-token
        attention in decode_mla's convention, over a K-only cache of one KV
        head. Sequence s's queries are rows qo_indptr[s] .. qo_indptr[s+1] -
        1 of q [T][Hq][D], its last q_len tokens (their latent rows already
        written); out [T][Hq][dv] (dv: out's last dim), lse [T][Hq]; scale,
        k_scale as in decode_mla, window_left, soft_cap, lse as in prefill.
        A query with q_len 1 and no options gives decode_mla's bits."""
        pc = self._paged()
        layer = integer(layer, "layer", U32)
        qb = self._tensor(q, "q")
        ob = self._tensor(out, "out", True)
        if scale is None:
            scale = 1.0 / float(self.layout.head_dim) ** 0.5
        keep = []
        sc = self._scales(None if k_scale is None else ([k_scale], None), keep)
        opts = self._attn_opts(qb, window_left, soft_cap, lse, keep)
        qo = self._qo_indptr(qo_indptr, pages)
        dv = ob.view.shape[ob.view.ndim - 1] if ob.view.ndim else 0
        check(L.kv_attn_prefill_mla(pc, layer, qb.ref(), _p(qo, _lib.c_i32p),
                                    ctypes.byref(_pages_c(pages)), integer(dv, "dv", I64),
                                    real(scale, "softmax_scale"), sc, ob.ref(), opts))

    @_call
    def prefill(self, layer: int, q, qo_indptr, pages: "Pages", out,
                scale: Optional[float] = None, scales=None, window_left: Optional[int] = None,
                soft_cap: Optional[float] = None, lse=None) -> None:
        """Paged attention of several query tokens per sequence with a causal
        mask (kv_attn_prefill): sequence s's queries are rows qo_indptr[s] ..
        qo_indptr[s+1] - 1 of q [T][Hq][D] (FlashInfer's qo_indptr, int32
        or int64 values, starting at 0, ending at T), its last q_len tokens
        (their K/V already written): query i sits at position len - q_len + i
        and sees tokens 0 .. that position (less with a window). out and lse
        [T][Hq][D], [T][Hq]; the options as in decode."""
        self._attend(layer, q, qo_indptr, pages, out, scale, scales, window_left, soft_cap, lse)

    def _attend(self, layer, q, qo_indptr, pages, out, scale, scales, window_left, soft_cap,
                lse):
        pc = self._paged()
        layer = integer(layer, "layer", U32)
        qb = self._tensor(q, "q")
        ob = self._tensor(out, "out", True)
        if scale is None:
            scale = 1.0 / float(self.layout.head_dim) ** 0.5
        keep = []
        sc = self._scales(scales, keep)
        opts = self._attn_opts(qb, window_left, soft_cap, lse, keep)
        if qo_indptr is None:
            if opts is None:
                check(L.kv_attn_decode(pc, layer, qb.ref(), ctypes.byref(_pages_c(pages)),
                                       real(scale, "softmax_scale"), sc, ob.ref()))
            else:
                check(L.kv_attn_decode_ex(pc, layer, qb.ref(), ctypes.byref(_pages_c(pages)),
                                          real(scale, "softmax_scale"), sc, ob.ref(), opts))
            return
        qo = self._qo_indptr(qo_indptr, pages)
        check(L.kv_attn_prefill(pc, layer, qb.ref(), _p(qo, _lib.c_i32p),
                                ctypes.byref(_pages_c(pages)), real(scale, "softmax_scale"), sc, ob.ref(), opts))

    def _qo_indptr(self, qo_indptr, pages):
        qo = int_array(_host_index(qo_indptr, "qo_indptr", self.mem), "qo_indptr",
                       I32).reshape(-1)
        qo = np.ascontiguousarray(qo, dtype=np.int32)
        if qo.size != _pages_c(pages).n_seqs + 1:
            raise error("KV_ERR_BAD_SHAPE", "qo_indptr has %d entries, pages %d sequences (+1)" %
                        (qo.size, _pages_c(pages).n_seqs))
        return qo

    @staticmethod
    def _attn_opts(qb, window_left, soft_cap, lse, keep):
        """struct kv_attn_opts for the options (None: every one off), or None."""
        opts = None
        if window_left is not None or soft_cap is not None or lse is not None:
            o = _lib.AttnOpts()
            o.struct_size = ctypes.sizeof(_lib.AttnOpts)
            o.window_left = -1 if window_left is None else integer(window_left, "window_left",
                                                                   I32)
            o.logit_soft_cap = 0.0 if soft_cap is None else real(soft_cap, "soft_cap")
            if lse is not None:
                a = lse if isinstance(lse, np.ndarray) else np.asarray(lse)
                if (a.dtype != np.float32 or a.ndim != 2 or not a.flags.writeable or
                        (a.shape[1] > 1 and a.strides[1] != 4) or a.strides[0] % 4 or
                        a.strides[0] < 0 or (a.shape[0] > 1 and a.strides[0] < 4 * a.shape[1])):
                    # rows closer than Hq floats (a broadcast, stride 0) overlap
                    raise error("KV_ERR_INVALID_ARG",
                                "lse: a writable float32 array [rows][Hq] with contiguous heads "
                                "and rows that do not overlap, got %s %s strides %s" %
                                (a.dtype, a.shape, a.strides))
                if a.shape != (qb.view.shape[0], qb.view.shape[1]):
                    raise error("KV_ERR_BAD_SHAPE", "lse shape %s, q has %d rows of %d heads" %
                                (a.shape, qb.view.shape[0], qb.view.shape[1]))
                keep.append(a)
                o.lse = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if a.size else None
                o.lse_stride = a.strides[0] // 4 if a.shape[0] > 1 else 0
            keep.append(o)
            opts = ctypes.byref(o)
        return opts

    # ---- pack / unpack (connector/pack/kv_pack.h) -------------------------------

    @_call
    def pack(self, blocks: Sequence[int], n_tokens: int,
             layers: Optional[Tuple[int, int]] = None) -> np.ndarray:
        """The request's blocks (ceil(n_tokens / N) of them) in kvcache's
        self-describing wire format (docs/connector.md): a uint8 array.
        layers = (src_layer0, n_layers) packs that layer range only (every
        layer when None)."""
        pc = self._paged()
        b = _u32_array(blocks, "blocks")
        n_tokens = integer(n_tokens, "n_tokens", U64)
        cfg = _plan_config(None, None if layers is None else (layers, ("src_layer0", "n_layers")))
        ref = ctypes.byref(cfg) if cfg is not None else None
        size = ctypes.c_uint64()
        check(L.kv_pack_size(ctypes.byref(pc.layout), ref, n_tokens, ctypes.byref(size)))
        buf = np.empty(size.value, np.uint8)
        got = ctypes.c_size_t()
        check(L.kv_pack(None, pc, _p(b, _lib.c_u32p), b.size, n_tokens, buf.ctypes.data,
                        buf.size, ctypes.byref(got), ref))
        return buf[:got.value]

    @_call
    def unpack(self, buf, blocks: Sequence[int],
               heads: Optional[Tuple[int, int, int]] = None,
               layers: Optional[Tuple[int, int, int]] = None) -> None:
        """Unpack a packed buffer into blocks of this cache, converting to its
        layout; heads = (src_head0, dst_head0, n_heads) moves a head range,
        layers = (src_layer0, dst_layer0, n_layers) lands the packed layers
        [src_layer0, +n_layers) on [dst_layer0, +n_layers) of this cache (the
        buffer must carry exactly those layers). The header, layout, layer
        range and blocks are verified before the first byte is written; each
        block's checksum as it is copied: on a corrupt payload (Corrupt
        naming the block) the unpacked layers of the listed blocks are
        zeroed and nothing else is written."""
        pc = self._paged()
        b = _u32_array(blocks, "blocks")
        try:  # its bytes, whatever the array's dtype and strides
            a = np.ascontiguousarray(np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray)
                                     else np.ascontiguousarray(buf).view(np.uint8).reshape(-1))
        except (TypeError, ValueError, BufferError) as e:  # a str, a list, an object array
            raise error("KV_ERR_INVALID_ARG", "buf: the bytes of a packed buffer (pack()'s "
                        "uint8 array, bytes), got %s (%s)" % (type(buf).__name__, e)) from None
        cfg = _plan_config(
            None if heads is None else (heads, ("src_head0", "dst_head0", "n_heads")),
            None if layers is None else (layers, ("src_layer0", "dst_layer0", "n_layers")))
        check(L.kv_unpack(None, a.ctypes.data, a.size, pc, _p(b, _lib.c_u32p), b.size,
                          ctypes.byref(cfg) if cfg is not None else None))

    # ---- memory -------------------------------------------------------------

    @_call
    def arena(self) -> np.ndarray:
        """The whole arena as a writeable uint8 array (zero-copy; host and
        pinned memory), e.g. to compare a destination pool whole. Holds a
        reference on the cache."""
        v = self._kv_view(0, 0)  # layer 0's K starts at the arena's base
        full = _lib.ViewC()
        full.dtype = _dtype_code("u8")
        full.ndim = 1
        full.shape[0] = self.layout.total_bytes
        full.strides[0] = 1
        full.offset = 0
        full.base = v.base
        full.storage_bytes = self.layout.total_bytes
        return View(_Memory(self), full).numpy()

    @_call
    def kv(self, layer: int, kv: int) -> View:
        """Layer's K (kv=0) or V (kv=1) tensor over the cache's memory, as a
        View of the logical shape [num_blocks][block_tokens][num_heads][head_dim]
        whatever the order: for HND the order is in the strides (token
        stride head_dim, head stride block_tokens * head_dim), not in the
        shape (view.numpy().transpose(0, 2, 1, 3) is [B][H][N][D], contiguous
        per block for HND)."""
        return View(_Memory(self), self._kv_view(layer, kv))

    def _kv_view(self, layer, kv):
        v = _lib.ViewC()
        check(L.kv_cache_kv_view(self._h, integer(layer, "layer", U32), integer(kv, "kv", INT),
                                 ctypes.byref(v)))
        return v


class Pages:
    """The pages of some sequences, as the kernels take them: Cache.pages()
    builds them from the cache's own sequences (FlashInfer's CSR form,
    arrays owned here; rebuild after the sequences change), and
    Pages.from_csr / Pages.from_block_table from an engine's own arrays."""

    @classmethod
    def from_csr(cls, layout, indptr, indices, last_page_len,
                 page_ratio: Optional[int] = None) -> "Pages":
        """The pages of an engine's FlashInfer-style CSR: indptr [S + 1]
        (0 first, never decreasing), indices [>= indptr[S]] (page ids in [0,
        B * r)), last_page_len [S] (1..N/r tokens in a sequence's last page,
        0 for a sequence with no pages). layout: the Layout (or a Cache or
        PagedCache: its layout and page size) the ids are checked against;
        page_ratio r: pages of N / r tokens (default 1, or the cache's).
        int32 arrays (NumPy, CPU torch tensors), C-contiguous and aligned,
        are used in place and held, never copied: the engine may rewrite
        their values between calls (the kernels check them on every call).
        Any other integer array (int64, a list, an unaligned one) is
        converted to int32 once, here, each value range-checked: a later
        change to it is not seen. Every check above is made here, refusals
        naming the index and value."""
        from .paged import pages_csr
        return pages_csr(layout, indptr, indices, last_page_len, page_ratio)

    @classmethod
    def from_block_table(cls, layout, block_table, seq_lens,
                         page_ratio: Optional[int] = None) -> "Pages":
        """The pages of an engine's vLLM-style block table: block_table [S]
        [cols] (sequence s's pages in its row; only the first
        ceil(seq_lens[s] / (N / r)) are read, padding may hold anything),
        seq_lens [S] (tokens of each sequence). layout and page_ratio as in
        from_csr. A C-contiguous, aligned int32 block_table and int64
        seq_lens are used in place (what the kernels take); other integer
        arrays (vLLM's int32 seq_lens, a sliced table) are converted once,
        here."""
        from .paged import pages_block_table
        return pages_block_table(layout, block_table, seq_lens, page_ratio)

    def __init__(self, cache, seqs):
        self.indptr, self.indices, self.last_page_len = cache.export_flashinfer(seqs)
        self.page_tokens = cache.page_tokens
        ratio = cache.layout.block_tokens // cache.page_tokens
        self._ind = self.indices if self.indices.size else np.zeros(1, np.int32)
        # what _c points at, held here: the public arrays may be rebound
        self._held = (self.indptr, self._ind, self.last_page_len)
        self._c = _lib.Pages(1, len(self.indptr) - 1, ratio, _p(self.indptr, _lib.c_i32p),
                             _p(self._ind, _lib.c_i32p), _p(self.last_page_len, _lib.c_i32p),
                             None, 0, None)

    def seq_tokens(self) -> List[int]:
        """Tokens of each sequence, in order."""
        out = []
        for s in range(len(self.indptr) - 1):
            n = int(self.indptr[s + 1] - self.indptr[s])
            out.append(0 if n == 0 else (n - 1) * self.page_tokens + int(self.last_page_len[s]))
        return out

    @property
    def n_tokens(self) -> int:
        """Tokens of all the sequences (the T of read's outputs)."""
        return sum(self.seq_tokens())
