"""The kernels on the GPU: a PagedCache over CUDA memory runs the CUDA kernels
with device-resident indices (attention/kv_attn.h, the *_cuda_dev entries).

    kv = torch.zeros(2, B, N, H, D, dtype=torch.bfloat16, device="cuda")
    pc = kvcache.PagedCache(lay, kv)                  # mem "device"
    pc.write(0, k, v, slot_mapping)                   # CUDA tensors, int64 slots
    pages = kvcache.Pages.from_block_table(pc, block_table, seq_lens)  # int32, CUDA
    pc.decode(0, q, pages, out)                       # on torch's current stream
    info = pc.errors.get()                            # the one synchronizing call

What crosses into C per call is scalars and pointers: the tensors' views
(shape, strides, device address), the index arrays' device addresses and
lengths, the stream. No index is read, copied or checked on the host (the
kernel checks each one and records the invalid ones in the cache's error
record, DeviceErrors), nothing synchronizes, nothing is allocated on the
device. Every argument is checked for being where the cache is (CUDA memory
on the cache's device) before anything is launched: a host array given to a
device cache, or a CUDA tensor given to a host cache, is refused by name.

Streams: stream=None is torch.cuda.current_stream(device).cuda_stream when
torch is imported and has CUDA, else 0 (the default stream); an int is a
cudaStream_t handle, and an object with a cuda_stream attribute (a
torch.cuda.Stream) gives its own. The kernels are enqueued on it and
return; the tensors and index arrays must stay alive (and, with torch's
caching allocator, unreused: Tensor.record_stream) until it has run them.
"""
import collections
import contextlib
import ctypes
import sys
import threading

from . import _lib
from ._ints import I32, INT, U32, U64, integer
from .errors import check, error
from .tensors import FP8_OR_U8, borrow, raw_fp8, where, where_name, _code

L = _lib.lib
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3

# ---- streams and the current device -------------------------------------------

_torch_cuda = None  # torch.cuda when torch is imported and has a device (looked up once)
_torch_lock = threading.Lock()


def _torch():
    """torch.cuda when torch is imported and CUDA is available to it, else
    None. An unimported torch has set no current stream: 0 is then what its
    current stream would be, so torch is never imported here."""
    global _torch_cuda
    if _torch_cuda is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        with _torch_lock:
            try:
                ok = bool(torch.cuda.is_available())
            except Exception:  # a torch without CUDA support compiled in
                ok = False
            _torch_cuda = torch.cuda if ok else False
    return _torch_cuda or None


def stream_handle(stream, device):
    """The cudaStream_t handle (an int) a call runs on: stream as given (an
    int handle, or an object with .cuda_stream such as torch.cuda.Stream),
    or with None, torch's current stream on `device` (0 without torch)."""
    if stream is None:
        tc = _torch()
        return tc.current_stream(device).cuda_stream if tc is not None else 0
    s = getattr(stream, "cuda_stream", stream)
    if isinstance(s, bool):
        s = None
    return integer(s, "stream (a cudaStream_t handle)", U64)


def on_device(device):
    """A context in which the calling thread's current CUDA device is
    `device`: torch.cuda.device(device) when torch has CUDA and another
    device is current (the library's CUDA runtime takes the thread's
    current context), else nothing to do."""
    tc = _torch()
    if tc is None or tc.current_device() == device:
        return contextlib.nullcontext()
    return tc.device(device)


# ---- the error record ------------------------------------------------------------

# enum kv_attn_dev_array -> the array an error names (docs/kernels.md)
ARRAYS = {0: None, 1: "slots", 2: "indptr", 3: "last_page_len", 4: "pages", 5: "copies",
          6: "seq_lens", 7: "out_indptr"}

ErrorInfo = collections.namedtuple("ErrorInfo", "count array index value")
ErrorInfo.__doc__ = """The error record as read: count of invalid indices the
kernels skipped since the last reset (0: none); of the first one (lowest
array, then index), the array ("slots", "indptr", "last_page_len",
"pages", "copies", "seq_lens" or "out_indptr"; None with count 0), its
index in that array and the value found there. "pages" is an index into
the CSR indices, or s * block_table_cols + i into the block table;
"copies" is 2 * pair + (0 for src, 1 for dst)."""


class DeviceErrors:
    """A device-side error record (struct kv_attn_cuda_errors, device memory
    on `device`): the CUDA kernels skip every invalid index they meet and
    count it here, keeping the first one. A PagedCache over CUDA memory has
    one (PagedCache.errors) that its kernels use unless a call passes
    errors=another. get() copies it to the host and waits for the stream
    (the one synchronizing call: never inside a CUDA graph capture);
    reset() zeroes it on the stream (capture-safe). Created and freed
    outside the hot path (cudaMalloc / cudaFree, which synchronize)."""

    def __init__(self, device: int = 0):
        self.device = integer(device, "device", INT)
        self._h = None
        h = ctypes.c_void_p()
        with on_device(self.device):
            check(L.kv_attn_cuda_errors_create(ctypes.byref(h)))
        self._h = h.value

    def _handle(self):
        if not self._h:
            raise error("KV_ERR_BAD_STATE", "the error record is closed")
        return self._h

    def get(self, stream=None, reset: bool = False) -> ErrorInfo:
        """The record (ErrorInfo), read on stream after the work queued on
        it; reset=True zeroes it after the read, on the same stream."""
        h = self._handle()
        st = stream_handle(stream, self.device)
        out = _lib.CudaErrorInfo()
        with on_device(self.device):
            check(L.kv_attn_cuda_errors_get(h, ctypes.byref(out), st))
            if reset:
                check(L.kv_attn_cuda_errors_reset(h, st))
        return ErrorInfo(out.count, ARRAYS.get(out.array, out.array),
                         out.index if out.count else 0, out.value if out.count else 0)

    def reset(self, stream=None) -> None:
        """Zero the record on stream (cudaMemsetAsync: no wait, capture-safe)."""
        h = self._handle()
        with on_device(self.device):
            check(L.kv_attn_cuda_errors_reset(h, stream_handle(stream, self.device)))

    def close(self) -> None:
        """Free the record (cudaFree: it waits for the device). Idempotent."""
        h, self._h = getattr(self, "_h", None), None
        if h and L is not None:  # (at interpreter exit the module may be gone)
            L.kv_attn_cuda_errors_destroy(h)

    def __del__(self):
        self.close()

    def __repr__(self):
        return "DeviceErrors(cuda:%d%s)" % (self.device, "" if self._h else ", closed")


def available() -> bool:
    """Whether the loaded library can run its CUDA kernels here: it was
    built with CUDA and a device is usable (an error record can be made)."""
    h = ctypes.c_void_p()
    if L.kv_attn_cuda_errors_create(ctypes.byref(h)) != 0:
        return False
    L.kv_attn_cuda_errors_destroy(h.value)
    return True


# ---- a device cache's side ---------------------------------------------------------


class DeviceSide:
    """What a PagedCache over CUDA memory adds: its device and its error
    record, made with the cache. Where no CUDA device is usable the record
    cannot be made; the cache still exists (its arguments are checked as
    anywhere) and every kernel call and .errors raise why."""

    def __init__(self, device):
        self.device = device
        self.record = None
        self.refusal = None
        try:
            self.record = DeviceErrors(device)
        except Exception as e:  # no CUDA in the build, no device: said at each use
            self.refusal = e

    def errors(self):
        if self.record is None:
            e = self.refusal
            cls = type(e) if hasattr(e, "status") else None
            msg = ("this cache is CUDA memory (cuda:%d), and its kernels cannot run here: %s" %
                   (self.device, getattr(e, "message", str(e))))
            if cls is None:
                raise error("KV_ERR_UNSUPPORTED", msg)
            raise cls(msg, status=e.status, code=e.code)
        return self.record


def _record(side, errors):
    """The error record handle a call passes: errors (a DeviceErrors on the
    cache's device) or the cache's own."""
    if errors is None:
        return side.errors()._handle()
    if not isinstance(errors, DeviceErrors):
        raise error("KV_ERR_INVALID_ARG", "errors: a kvcache.DeviceErrors, got %s" %
                    type(errors).__name__)
    if errors.device != side.device:
        raise error("KV_ERR_MISMATCH", "errors: a record on cuda:%d, the cache is on cuda:%d" %
                    (errors.device, side.device))
    side.errors()  # no device here: say so as every call does
    return errors._handle()


def _on_cache_device(obj, what, device, role):
    """Refuse obj unless it is CUDA memory on `device` (its own words say
    where it is instead): role names what it is for."""
    w = where(obj)
    if w is None:
        return  # only its capsule can say: borrow asks it, and the caller checks
    _refuse_unless(w, obj, what, device, role)


def _refuse_unless(w, obj, what, device, role):
    if w[0] == _DL_CUDA:
        if w[1] != device:
            raise error("KV_ERR_MISMATCH", "%s is on cuda:%d, the cache on cuda:%d" %
                        (what, w[1], device))
        return
    raise error("KV_ERR_UNSUPPORTED",
                "%s is %s (%s); this cache is CUDA memory (cuda:%d), and its kernels take %s in "
                "CUDA memory on its device, never copied from the host (pass a CUDA tensor, "
                "e.g. torch.as_tensor(x, device=\"cuda:%d\"))" %
                (what, where_name(w), type(obj).__name__, device, role, device))


def tensor(cache, obj, what, writable, st):
    """obj as a device kernel's tensor: CUDA memory on the cache's device,
    any strides, uint8 as raw fp8 (tensors.raw_fp8)."""
    device = cache._cuda.device
    _on_cache_device(obj, what, device, "tensors")
    b = borrow(obj, what, writable, stream=st)
    _refuse_unless(b.device, obj, what, device, "tensors")
    return raw_fp8(b, what, cache.layout._c.dtype) if b.view.dtype in FP8_OR_U8 else b


_TORCH_INTS = {"torch.int32": "i32", "torch.int64": "i64"}
_INT_NAMES = {"i32": "int32", "i64": "int64"}


class DevArray:
    """An index array in device memory: its address, shape, device, and
    what keeps it alive (the object, and a DLPack capsule taken from it)."""

    def __init__(self, ptr, shape, device, keep):
        self.ptr, self.shape, self.device, self._keep = ptr, shape, device, keep


def index_array(obj, what, device, dtypes, ndim, st=None):
    """obj as a device-resident index array for the CUDA kernels: CUDA
    memory on `device` (None: any device, returned in .device), one of
    dtypes ("i32", "i64"), ndim dims, C-contiguous. Nothing is read:
    its values are the kernel's to check."""
    w = where(obj)
    if w is None or w[0] != _DL_CUDA:
        if w is None:  # only its capsule can say
            b = borrow(obj, what, False, stream=st)
            if b.device[0] == _DL_CUDA:
                return _view_array(b, obj, what, device, dtypes, ndim)
            w = b.device
        if device is None:
            raise error("KV_ERR_UNSUPPORTED", "%s is %s (%s): device pages take CUDA arrays" %
                        (what, where_name(w), type(obj).__name__))
        _refuse_unless(w, obj, what, device, "index arrays")  # raises: not CUDA memory
    if device is not None and w[1] != device:
        raise error("KV_ERR_MISMATCH", "%s is on cuda:%d, the cache on cuda:%d" %
                    (what, w[1], device))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        name = _TORCH_INTS.get(str(obj.dtype))
        if name not in dtypes:
            raise _bad_dtype(what, str(obj.dtype).replace("torch.", ""), dtypes)
        if obj.dim() != ndim:
            raise error("KV_ERR_BAD_SHAPE", "%s: %d-d, got shape %s" %
                        (what, ndim, tuple(obj.shape)))
        if not obj.is_contiguous():
            raise error("KV_ERR_INVALID_ARG", "%s: shape %s with strides %s is not "
                        "C-contiguous (the kernels read it densely)" %
                        (what, tuple(obj.shape), obj.stride()))
        return DevArray(obj.data_ptr() if obj.numel() else None, tuple(obj.shape), w[1], obj)
    return _view_array(borrow(obj, what, False, stream=st), obj, what, device, dtypes, ndim)


def _bad_dtype(what, got, dtypes):
    return error("KV_ERR_INVALID_ARG", "%s: %s values on the device, got %s (the kernels read "
                 "device indices in place, never converted)" %
                 (what, " or ".join(_INT_NAMES[d] for d in dtypes), got))


def _view_array(b, obj, what, device, dtypes, ndim):
    v = b.view
    if device is not None and b.device[1] != device:
        raise error("KV_ERR_MISMATCH", "%s is on cuda:%d, the cache on cuda:%d" %
                    (what, b.device[1], device))
    if v.dtype not in [_code(d) for d in dtypes]:
        raise _bad_dtype(what, L.kv_dtype_name(v.dtype).decode(), dtypes)
    shape = tuple(v.shape[i] for i in range(v.ndim))
    if v.ndim != ndim:
        raise error("KV_ERR_BAD_SHAPE", "%s: %d-d, got shape %s" % (what, ndim, shape))
    want = 1
    for i in reversed(range(v.ndim)):
        if shape[i] != 1 and v.strides[i] != want:
            raise error("KV_ERR_INVALID_ARG", "%s: shape %s with strides %s is not "
                        "C-contiguous (the kernels read it densely)" %
                        (what, shape, tuple(v.strides[i] for i in range(v.ndim))))
        want *= shape[i]
    n = 1
    for x in shape:
        n *= x
    es = L.kv_dtype_size(v.dtype)
    ptr = (v.base or 0) + v.offset * es if n else None
    return DevArray(ptr, shape, b.device[1], (obj, b))


# ---- device pages -------------------------------------------------------------------


class DevicePages:
    """Pages whose arrays are CUDA memory (Pages.from_csr / from_block_table
    over CUDA tensors): int32, C-contiguous, held and read in place by the
    kernels, which check every value when they run (an engine may rewrite
    them between calls, or between replays of a captured graph). Built from
    shapes only: no value is read here."""

    def __init__(self, fmt, n_seqs, ratio, page_tokens, device, arrays, dev):
        self.format, self.n_seqs, self.page_ratio = fmt, n_seqs, ratio
        self.page_tokens, self.device = page_tokens, device
        self._arrays = arrays
        self._dev = dev

    @property
    def _c(self):
        raise error("KV_ERR_UNSUPPORTED", "pages: CUDA arrays (on cuda:%d); this cache's kernels "
                    "run on the CPU and read host arrays (build its Pages over NumPy arrays or "
                    "CPU tensors)" % self.device)

    def seq_tokens(self):
        raise error("KV_ERR_UNSUPPORTED", "pages on cuda:%d: their token counts are device "
                    "memory, not read on the host" % self.device)

    @property
    def n_tokens(self):
        return self.seq_tokens()

    def __repr__(self):
        return "Pages(%s, %d sequences on cuda:%d, page of %d tokens)" % (
            self.format, self.n_seqs, self.device, self.page_tokens)


def _one_device(arrays, names):
    dev = arrays[0].device
    for a, n in zip(arrays[1:], names[1:]):
        if a.device != dev:
            raise error("KV_ERR_MISMATCH", "%s is on cuda:%d, %s on cuda:%d: one Pages' arrays "
                        "live on one device" % (names[0], dev, n, a.device))
    return dev


def is_device(*objs):
    """True when any of objs is CUDA memory (say so by its device)."""
    for o in objs:
        w = where(o)
        if w is not None and w[0] == _DL_CUDA:
            return True
    return False


def _mixed(objs, names):
    """Refuse arrays of one Pages on different sides (host and CUDA)."""
    ws = [where(o) for o in objs]
    cuda = [i for i, w in enumerate(ws) if w is not None and w[0] == _DL_CUDA]
    host = [i for i, w in enumerate(ws) if w is not None and w[0] != _DL_CUDA]
    if cuda and host:
        raise error("KV_ERR_MISMATCH", "%s is on cuda:%d, %s is %s: one Pages' arrays live on "
                    "one device" % (names[cuda[0]], ws[cuda[0]][1], names[host[0]],
                                    where_name(ws[host[0]])))


def pages_csr(lay, r, indptr, indices, last_page_len):
    names = ("indptr", "indices", "last_page_len")
    _mixed((indptr, indices, last_page_len), names)
    ip = index_array(indptr, "indptr", None, ("i32",), 1)
    ix = index_array(indices, "indices", None, ("i32",), 1)
    lp = index_array(last_page_len, "last_page_len", None, ("i32",), 1)
    dev = _one_device((ip, ix, lp), names)
    if ip.shape[0] < 1:
        raise error("KV_ERR_BAD_SHAPE", "indptr: n_seqs + 1 elements, got none")
    n = integer(ip.shape[0] - 1, "len(indptr) - 1", U32)
    if lp.shape[0] != n:
        raise error("KV_ERR_BAD_SHAPE", "last_page_len: %d elements for %d sequences "
                    "(len(indptr) - 1)" % (lp.shape[0], n))
    n_pages = integer(ix.shape[0], "len(indices)", I32)
    c = _lib.DevPages()
    c.n_seqs, c.page_ratio, c.format = n, r, _lib.KV_PAGES_CSR
    c.indptr, c.indices, c.n_pages, c.last_page_len = ip.ptr, ix.ptr, n_pages, lp.ptr
    return DevicePages("csr", n, r, lay.block_tokens // r, dev, (ip, ix, lp), c)


def pages_block_table(lay, r, block_table, seq_lens):
    names = ("block_table", "seq_lens")
    _mixed((block_table, seq_lens), names)
    bt = index_array(block_table, "block_table", None, ("i32",), 2)
    sl = index_array(seq_lens, "seq_lens", None, ("i32",), 1)
    dev = _one_device((bt, sl), names)
    n = integer(sl.shape[0], "len(seq_lens)", U32)
    if bt.shape[0] != n:
        raise error("KV_ERR_BAD_SHAPE", "block_table: %d rows for %d sequences (len(seq_lens))"
                    % (bt.shape[0], n))
    cols = integer(bt.shape[1], "block_table columns", U32)
    if n and cols == 0:
        raise error("KV_ERR_BAD_SHAPE", "block_table: 0 columns for %d sequences" % n)
    c = _lib.DevPages()
    c.n_seqs, c.page_ratio, c.format = n, r, _lib.KV_PAGES_BLOCK_TABLE
    c.block_table, c.block_table_cols, c.seq_lens = bt.ptr, cols, sl.ptr
    return DevicePages("block_table", n, r, lay.block_tokens // r, dev, (bt, sl), c)


def _pages(side, pages):
    if not isinstance(pages, DevicePages):
        raise error("KV_ERR_UNSUPPORTED",
                    "pages: host arrays (%s); this cache is CUDA memory (cuda:%d), and its kernels "
                    "read the pages in device memory: build them with Pages.from_csr / "
                    "Pages.from_block_table over int32 CUDA tensors" %
                    (type(pages).__name__, side.device))
    if pages.device != side.device:
        raise error("KV_ERR_MISMATCH", "pages are on cuda:%d, the cache on cuda:%d" %
                    (pages.device, side.device))
    return ctypes.byref(pages._dev)


# ---- scales -----------------------------------------------------------------------------


def scales(side, sc, keep, st):
    """struct kv_attn_dev_scales for (k_scales, v_scales): CUDA float32
    tensors (read by the kernel when it runs; [n] or [L][n]) or host values
    (checked and passed by value, as the host kernels take them); None for
    no scales."""
    if sc is None:
        return None
    ks, vs = sc
    if is_device(ks) or (vs is not None and is_device(vs)):
        if not (is_device(ks) and (vs is None or is_device(vs))):
            raise error("KV_ERR_MISMATCH", "scales: one on the device, one on the host (both "
                        "CUDA float32 tensors, or both host values)")
        arrs = []
        for x, nm in ((ks, "k_scales"), (vs, "v_scales")):
            if x is None:
                arrs.append(None)
                continue
            _on_cache_device(x, nm, side.device, "scales")
            b = borrow(x, nm, False, stream=st)
            v = b.view
            if v.dtype != _code("f32") or v.ndim not in (1, 2):
                raise error("KV_ERR_INVALID_ARG", "%s: a float32 CUDA tensor [n] or [L][n], got "
                            "%s %d-d" % (nm, L.kv_dtype_name(v.dtype).decode(), v.ndim))
            shape = tuple(v.shape[i] for i in range(v.ndim))
            if v.strides[v.ndim - 1] != 1 or (v.ndim == 2 and v.strides[0] != shape[1]):
                raise error("KV_ERR_INVALID_ARG", "%s: shape %s not C-contiguous" % (nm, shape))
            keep.append(b)
            arrs.append((b.view.base + b.view.offset * 4, shape))
        k0 = arrs[0]
        if arrs[1] is not None and arrs[1][1] != k0[1]:
            raise error("KV_ERR_INVALID_ARG", "scales: K shape %s, V shape %s" %
                        (k0[1], arrs[1][1]))
        shape = k0[1]
        c = _lib.DevScales(k0[0], arrs[1][0] if arrs[1] else None,
                           integer(shape[-1], "scales per layer", U32),
                           integer(shape[0], "scale rows", U32) if len(shape) == 2 else 0, 1)
    else:
        import numpy as np
        k = np.ascontiguousarray(np.asarray(ks, dtype=np.float32).reshape(-1))
        v = (None if vs is None else
             np.ascontiguousarray(np.asarray(vs, dtype=np.float32).reshape(-1)))
        if v is not None and v.size != k.size:
            raise error("KV_ERR_INVALID_ARG", "scales: %d K scales, %d V scales" %
                        (k.size, v.size))
        keep += [k, v]
        c = _lib.DevScales(k.ctypes.data, v.ctypes.data if v is not None else None,
                           integer(k.size, "scales", U32), 0, 0)
    keep.append(c)
    return ctypes.byref(c)


# ---- the kernels ------------------------------------------------------------------------


def write(cache, layer, k, v, slots, sc, stream, errors):
    side = cache._cuda
    st = stream_handle(stream, side.device)
    layer = -1 if layer is None else integer(layer, "layer", I32)
    w = where(slots)
    torch = sys.modules.get("torch")
    if (w is not None and w[0] == _DL_CUDA and torch is not None and
            isinstance(slots, torch.Tensor) and slots.dtype == torch.int32):
        raise error("KV_ERR_UNSUPPORTED", "slots: int32 on the device; the device-index write "
                    "(kv_attn_write_cuda_dev) reads int64 slots (vLLM's slot_mapping): pass "
                    "slots.long()")
    sl = index_array(slots, "slots", side.device, ("i64",), 1, st)
    kb = tensor(cache, k, "k", False, st)
    vb = tensor(cache, v, "v", False, st) if v is not None else None
    keep = []
    scp = scales(side, sc, keep, st)
    rec = _record(side, errors)
    with on_device(side.device):
        check(L.kv_attn_write_cuda_dev(cache._pc, layer, kb.ref(), vb.ref() if vb else None,
                                       sl.ptr, sl.shape[0], scp, rec, st))


def read(cache, layer, pages, k_out, v_out, sc, stream, errors, out_indptr):
    side = cache._cuda
    st = stream_handle(stream, side.device)
    layer = -1 if layer is None else integer(layer, "layer", I32)
    pg = _pages(side, pages)
    if out_indptr is None:
        raise error("KV_ERR_INVALID_ARG", "out_indptr: a device cache's read needs the output "
                    "rows of each sequence, out_indptr [S + 1] int32 on the device (vLLM "
                    "gather_cache's cu_seq_lens): the sequences' lengths are device memory, "
                    "never read on the host")
    oi = index_array(out_indptr, "out_indptr", side.device, ("i32",), 1, st)
    if oi.shape[0] != pages.n_seqs + 1:
        raise error("KV_ERR_BAD_SHAPE", "out_indptr: %d elements for %d sequences (+1)" %
                    (oi.shape[0], pages.n_seqs))
    kb = tensor(cache, k_out, "k_out", True, st) if k_out is not None else None
    vb = tensor(cache, v_out, "v_out", True, st) if v_out is not None else None
    keep = []
    scp = scales(side, sc, keep, st)
    rec = _record(side, errors)
    with on_device(side.device):
        check(L.kv_attn_read_cuda_dev(cache._pc, layer, pg, oi.ptr, kb.ref() if kb else None,
                                      vb.ref() if vb else None, scp, rec, st))


def decode(cache, layer, q, pages, out, scale, sc, opts, stream, errors):
    side = cache._cuda
    st = stream_handle(stream, side.device)
    for name, val, off in zip(("window_left", "soft_cap", "lse"), opts, (-1, 0, None)):
        if val is not None and not (off is not None and val == off):
            raise error("KV_ERR_UNSUPPORTED", "decode on a device cache: %s has no "
                        "device-index CUDA kernel yet (kv_attn_decode_cuda_dev takes no "
                        "options)" % name)
    layer = integer(layer, "layer", U32)
    pg = _pages(side, pages)
    qb = tensor(cache, q, "q", False, st)
    ob = tensor(cache, out, "out", True, st)
    if scale is None:
        scale = 1.0 / float(cache.layout.head_dim) ** 0.5
    keep = []
    scp = scales(side, sc, keep, st)
    rec = _record(side, errors)
    with on_device(side.device):
        check(L.kv_attn_decode_cuda_dev(cache._pc, layer, qb.ref(), pg, float(scale), scp,
                                        ob.ref(), rec, st))


def _copy_side(cache, src):
    """(the device side, dst paged cache, src paged cache or None) of a copy
    where either cache is CUDA memory; the other must be CUDA memory too or
    pinned host memory (what the CUDA kernels can address)."""
    side = cache._cuda or src._cuda
    for c, nm in ((cache, "this cache"), (src, "src")):
        if c is None or c._cuda is not None:
            if c is not None and c._cuda.device != side.device:
                raise error("KV_ERR_MISMATCH", "%s is on cuda:%d, the other cache on cuda:%d" %
                            (nm, c._cuda.device, side.device))
            continue
        if c.mem != "pinned":
            raise error("KV_ERR_UNSUPPORTED",
                        "%s is %s memory and the other cache CUDA memory (cuda:%d): a copy "
                        "between them runs on the GPU, which addresses device or pinned memory "
                        "only" % (nm, c.mem, side.device))
    dpc = cache._pc if cache._cuda is not None else cache._paged()
    spc = None if src is None else (src._pc if src._cuda is not None else src._paged())
    return side, dpc, spc


def copy_blocks(cache, copies, opts, src, stream, errors):
    side, dpc, spc = _copy_side(cache, src)
    st = stream_handle(stream, side.device)
    cp = index_array(copies, "copies", side.device, ("i32",), 2, st)
    if cp.shape[1] != 3:
        raise error("KV_ERR_BAD_SHAPE", "copies: [n, 3] (src, dst, tokens) int32 on the device "
                    "(struct kv_block_copy; tokens is ignored), got shape %s" % (cp.shape,))
    n = integer(cp.shape[0], "len(copies)", U32)
    rec = _record(side, errors)
    with on_device(side.device):
        if spc is None and opts is None:
            check(L.kv_attn_copy_blocks_cuda_dev(dpc, cp.ptr, n, rec, st))
            return
        check(L.kv_attn_copy_blocks_ex_cuda_dev(dpc, spc if spc is not None else dpc, cp.ptr, n,
                                                ctypes.byref(opts) if opts is not None else None,
                                                rec, st))


def refuse_host_kernel(cache, kernel):
    raise error("KV_ERR_UNSUPPORTED", "%s on a device cache: this cache is CUDA memory "
                "(cuda:%d), and %s has no device-index CUDA kernel here (a device cache runs "
                "write, read, decode and copy_blocks)" % (kernel, cache._cuda.device, kernel))
