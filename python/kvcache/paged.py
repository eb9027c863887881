"""Bring your own memory and page table: the kernels on what an engine owns.

PagedCache is a paged cache over memory the engine allocated (its
key_cache / value_cache storage), described by a Layout, with no block pool
and no sequence table: the Python face of C's struct kv_paged_cache. Pages
built by Pages.from_csr / Pages.from_block_table read the engine's own
page-table arrays (FlashInfer's CSR, vLLM's block table + lengths).

    kv = torch.zeros(2, B, N, H, D, dtype=torch.bfloat16)  # vLLM's per-layer cache
    key_cache, value_cache = kv.unbind(0)
    lay = kvcache.Layout(num_layers=1, num_blocks=B, block_tokens=N, num_heads=H,
                         head_dim=D, dtype="bf16")
    pc = kvcache.PagedCache(lay, kv)
    pc.write(0, k, v, slot_mapping)
    pages = kvcache.Pages.from_block_table(lay, block_table, seq_lens)
    pc.decode(0, q, pages, out)

The kernel methods are Cache's own (the same function objects), so the two
classes take the same arguments and refuse the same things.
"""
import ctypes
import sys
from typing import List

import numpy as np

from . import _lib
from . import cuda as _gpu
from ._ints import I32, I64, U32, int_array, integer
from .cache import Cache, Layout, Pages
from .errors import check, error
from .tensors import region

L = _lib.lib
_DL_CUDA, _DL_CUDA_HOST = 2, 3
_MEM_HOST, _MEM_PINNED, _MEM_DEVICE = 0, 1, 2  # enum kv_mem_kind


class PagedCache:
    """A paged KV cache over memory the engine owns: layout describes where
    every K/V element of every layer and block lives in memory (a torch
    tensor, a NumPy array, anything with __dlpack__, the array interface or
    the buffer protocol). The memory must be one C-contiguous range of at
    least layout.total_bytes bytes, host (or CUDA-pinned) memory, writable,
    its address aligned to the layout's element size, and its elements the
    layout's dtype or integers of that size or of one byte (raw bits:
    NumPy's uint16 for bf16, uint8 for fp8 or a byte buffer); every refusal
    names the values. Its shape is the engine's business: vLLM's per-layer
    [2][B][N][H][D] is a layer-major NHD Layout of one layer.

    The PagedCache holds a reference to memory (.memory) for its life; the
    engine keeps writing and reading that memory as it likes. No sequences,
    no block pool: slots and pages come from the engine's own arrays
    (Pages.from_csr / Pages.from_block_table). Kernels: write, read,
    copy_blocks (within it, or with a Cache or PagedCache of the same block
    format as src), decode, prefill, decode_mla, prefill_mla, pack, unpack, exactly as on
    a Cache. Kernels may run concurrently on different outputs.

    Over CUDA memory (a CUDA tensor, or a kDLCUDA DLPack producer) it is a
    device cache (mem "device", .device its CUDA device): write, read,
    decode and copy_blocks run the CUDA kernels with device-resident
    indices on the caller's stream, never synchronizing, and record invalid
    indices in .errors (a DeviceErrors); the other kernels are refused
    (python/README.md, "On the GPU")."""

    # The kernels are Cache's, shared, not copied: each needs only layout,
    # _paged(), _tensor(), _scales() and the _call hooks below.
    write = Cache.write
    read = Cache.read
    copy_blocks = Cache.copy_blocks
    _copy_blocks = Cache._copy_blocks
    decode = Cache.decode
    prefill = Cache.prefill
    decode_mla = Cache.decode_mla
    prefill_mla = Cache.prefill_mla
    pack = Cache.pack
    unpack = Cache.unpack
    _tensor = Cache._tensor
    _attend = Cache._attend
    _attn_opts = Cache.__dict__["_attn_opts"]  # the staticmethod itself
    _qo_indptr = Cache._qo_indptr
    _scales = Cache.__dict__["_scales"]  # the staticmethod itself
    _cuda = None  # a device cache's side (cuda.DeviceSide), set by __init__

    def __init__(self, layout: Layout, memory):
        if not isinstance(layout, Layout):
            raise error("KV_ERR_INVALID_ARG", "layout: a kvcache.Layout, got %s" %
                        type(layout).__name__)
        r = region(memory, "memory", device_ok=True)
        want = L.kv_dtype_name(layout._c.dtype).decode()
        es = layout.elem_bytes
        if r.elem != want and not (r.raw and r.elem_bytes in (1, es)):
            raw = ("1-byte integers" if es == 1 else "integers of %d or 1 byte" % es)
            raise error("KV_ERR_MISMATCH", "memory: %s elements, the layout holds %s (pass %s "
                        "elements, or %s as raw bits)" % (r.elem, want, want, raw))
        if r.nbytes < layout.total_bytes:
            raise error("KV_ERR_OUT_OF_BOUNDS", "memory: %d bytes (%s), the layout needs %d "
                        "(Layout.total_bytes)" % (r.nbytes, _describe(memory), layout.total_bytes))
        pc = _lib.PagedCache()
        pc.layout = layout._c
        pc.base = r.ptr
        pc.storage_bytes = r.nbytes
        cuda = r.device[0] == _DL_CUDA
        pc.mem = (_MEM_DEVICE if cuda else _MEM_PINNED if r.device[0] == _DL_CUDA_HOST else
                  _MEM_HOST)
        check(L.kv_paged_check(ctypes.byref(pc), cuda))  # alignment, the layout's own checks
        self.layout = layout
        self.memory = memory
        self.mem = {_MEM_DEVICE: "device", _MEM_PINNED: "pinned"}.get(pc.mem, "host")
        self.device = r.device[1] if cuda else None
        self._region = r  # holds memory (and a DLPack capsule taken from it)
        torch = sys.modules.get("torch")
        self._torch = memory if torch is not None and isinstance(memory, torch.Tensor) else None
        self._pc = pc
        if cuda:  # its error record, made now (outside any capture) where a GPU is usable
            self._cuda = _gpu.DeviceSide(self.device)

    @property
    def errors(self):
        """A device cache's error record (a DeviceErrors: get(), reset()),
        which its kernels use unless a call passes errors=; None for a host
        cache. Raises why where the CUDA kernels cannot run (no CUDA in the
        library, no usable device)."""
        return self._cuda.errors() if self._cuda is not None else None

    def _paged(self):
        t = self._torch
        if t is not None and t.data_ptr() != self._pc.base:
            raise error("KV_ERR_BAD_STATE", "memory: the tensor now points at 0x%x, this "
                        "PagedCache at 0x%x (set_() or resize_() moved it; the PagedCache keeps "
                        "the old storage alive, but the engine no longer sees it)" %
                        (t.data_ptr(), self._pc.base))
        if self._cuda is not None:
            raise error("KV_ERR_UNSUPPORTED", "this cache is CUDA memory (cuda:%d): the code "
                        "that needs a host or pinned cache (the CPU kernels, prefill, "
                        "decode_mla, pack, unpack, transport registration) cannot address it; a "
                        "device cache runs write, read, decode and copy_blocks on the GPU" %
                        self.device)
        return self._pc

    # Cache's kernels count calls in flight for close(); a PagedCache has no
    # close(): its memory lives as long as it does, and a running kernel
    # holds it.
    def _enter(self):
        pass

    def _leave(self):
        pass

    @property
    def page_tokens(self) -> int:
        return self.layout.block_tokens

    def __repr__(self):
        return "PagedCache(%r, %s memory at 0x%x, %d bytes)" % (
            self.layout, self.mem, self._pc.base, self._pc.storage_bytes)


def _describe(obj):
    shape = getattr(obj, "shape", None)
    dtype = getattr(obj, "dtype", None)
    if shape is None:
        return type(obj).__name__
    return "%s %s %s" % (type(obj).__name__, tuple(shape), dtype)


# ---- the engine's page tables -------------------------------------------------


def _host_ints(obj, what):
    """obj as a NumPy array over the same memory where it is an array (a
    NumPy array, a CPU torch tensor), else converted (a list)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise error("KV_ERR_UNSUPPORTED", "%s is on %s: the package's kernels read page "
                        "tables in host memory" % (what, obj.device))
        return obj.detach().numpy()  # shares the tensor's memory
    if isinstance(obj, np.ndarray):
        return obj
    try:
        if hasattr(obj, "__dlpack__") and not hasattr(obj, "__array_interface__"):
            return np.from_dlpack(obj)
        return np.asarray(obj)
    except (TypeError, ValueError, RuntimeError, BufferError) as e:
        raise error("KV_ERR_INVALID_ARG", "%s: not an array of integers (%s)" % (what, e))


def _index(obj, what, ndim, t):
    """(array the kernel reads, the array as given): t's dtype (I32 or I64),
    C-contiguous and aligned to its element size (C reads it through an
    int32_t / int64_t pointer); the engine's own array when it already is
    (used in place), else one range-checked conversion."""
    a = _host_ints(obj, what)
    if a.size == 0 and a.ndim == 1:  # [] is float64 to NumPy
        a = a.astype(t.dtype)
    if a.dtype.kind not in "iu":
        raise error("KV_ERR_INVALID_ARG", "%s: int32 or int64 integers, got %s values" %
                    (what, a.dtype))
    if a.ndim != ndim:
        raise error("KV_ERR_BAD_SHAPE", "%s: %d-d, got shape %s" % (what, ndim, a.shape))
    if a.dtype == t.dtype and a.flags.c_contiguous and a.flags.aligned:
        return a, a
    return int_array(a, what, t), a


def _ratio(layout, page_ratio):
    lay = layout if isinstance(layout, Layout) else getattr(layout, "layout", None)
    if not isinstance(lay, Layout):
        raise error("KV_ERR_INVALID_ARG", "layout: a kvcache.Layout (or a Cache or PagedCache), "
                    "got %s" % type(layout).__name__)
    if page_ratio is None:
        page_ratio = lay.block_tokens // getattr(layout, "page_tokens", lay.block_tokens)
    r = integer(page_ratio, "page_ratio", U32)
    if r < 1 or lay.block_tokens % r:
        raise error("KV_ERR_INVALID_ARG", "page_ratio %d: >= 1 and dividing the block's %d "
                    "tokens" % (r, lay.block_tokens))
    return lay, r


def _empty_ok(a, dtype):
    """a, or a one-element array where a is empty (the C side wants a
    non-NULL pointer for any sequence count)."""
    return a if a.size else np.zeros(1, dtype)


class _EnginePages(Pages):
    """Pages over an engine's arrays (built by Pages.from_csr /
    Pages.from_block_table): they hold the arrays, used in place."""

    @property
    def _c(self):
        # the one thing the kernels cannot see: the length of indices, which
        # an engine writing indptr in place could outgrow (read from the
        # arrays _cpages points at, not the public attributes, which the
        # caller may rebind)
        c = self._cpages
        if self.format == "csr" and c.n_seqs:
            ip, ix = self._held[0], self._held[1]
            end = int(ip[c.n_seqs])
            if end > ix.size:
                raise error("KV_ERR_OUT_OF_BOUNDS", "pages: indptr[%d] = %d, past the %d "
                            "elements of indices" % (c.n_seqs, end, ix.size))
        return c

    def seq_tokens(self) -> List[int]:
        if self.format == "csr":
            return Pages.seq_tokens(self)
        return [int(x) for x in self.seq_lens]

    def __repr__(self):
        return "Pages(%s, %d sequences, %d tokens, page of %d tokens)" % (
            self.format, self.n_seqs, self.n_tokens, self.page_tokens)


def _first(mask):
    return int(np.flatnonzero(mask)[0])


def pages_csr(layout, indptr, indices, last_page_len, page_ratio=None) -> Pages:
    """Pages.from_csr (see there)."""
    lay, r = _ratio(layout, page_ratio)
    if _gpu.is_device(indptr, indices, last_page_len):
        return _gpu.pages_csr(lay, r, indptr, indices, last_page_len)
    pt, n_ids = lay.block_tokens // r, lay.num_blocks * r
    ip, ip0 = _index(indptr, "indptr", 1, I32)
    ix, ix0 = _index(indices, "indices", 1, I32)
    lp, lp0 = _index(last_page_len, "last_page_len", 1, I32)
    if ip.size < 1:
        raise error("KV_ERR_BAD_SHAPE", "indptr: n_seqs + 1 elements, got none")
    n = integer(ip.size - 1, "len(indptr) - 1", U32)
    if lp.size != n:
        raise error("KV_ERR_BAD_SHAPE", "last_page_len: %d elements for %d sequences "
                    "(len(indptr) - 1)" % (lp.size, n))
    if n:
        if ip[0] != 0:
            raise error("KV_ERR_CORRUPT", "indptr[0] = %d, must be 0" % ip[0])
        d = np.diff(ip.astype(np.int64))
        if (d < 0).any():
            s = _first(d < 0)
            raise error("KV_ERR_CORRUPT", "indptr decreases at sequence %d (%d -> %d)" %
                        (s, ip[s], ip[s + 1]))
        nnz = int(ip[n])
        if nnz > ix.size:
            raise error("KV_ERR_OUT_OF_BOUNDS", "indptr[%d] = %d pages, indices has %d" %
                        (n, nnz, ix.size))
        used = ix[:nnz]
        bad = (used < 0) | (used >= n_ids)
        if bad.any():
            i = _first(bad)
            s = int(np.searchsorted(ip, i, side="right")) - 1
            raise error("KV_ERR_OUT_OF_BOUNDS", "indices[%d] = %d (sequence %d page %d) outside "
                        "[0, %d) (B %d x r %d)" % (i, used[i], s, i - ip[s], n_ids,
                                                   lay.num_blocks, r))
        bad = np.where(d == 0, lp != 0, (lp < 1) | (lp > pt))
        if bad.any():
            s = _first(bad)
            raise error("KV_ERR_CORRUPT", "last_page_len[%d] = %d for sequence %d of %d pages: "
                        "%s" % (s, lp[s], s, d[s], "an empty sequence needs 0" if d[s] == 0 else
                                "1..%d (N/r)" % pt))
    p = _EnginePages.__new__(_EnginePages)
    p.format, p.n_seqs, p.page_ratio, p.page_tokens = "csr", n, r, pt
    p.indptr, p.indices, p.last_page_len = ip, ix, lp
    p._given = (indptr, indices, last_page_len, ip0, ix0, lp0)  # what the engine handed in
    p._ix, p._lp = _empty_ok(ix, np.int32), _empty_ok(lp, np.int32)  # what _cpages points at
    p._held = (ip, ix, p._ix, p._lp)  # held here: p.indptr and the rest may be rebound
    p._cpages = _lib.Pages(1, n, r, _p(ip), _p(p._ix), _p(p._lp), None, 0, None)
    return p


def _p(a):
    return a.ctypes.data_as(_lib.c_i32p if a.dtype == np.int32 else _lib.c_i64p)


def pages_block_table(layout, block_table, seq_lens, page_ratio=None) -> Pages:
    """Pages.from_block_table (see there)."""
    lay, r = _ratio(layout, page_ratio)
    if _gpu.is_device(block_table, seq_lens):
        return _gpu.pages_block_table(lay, r, block_table, seq_lens)
    pt, n_ids = lay.block_tokens // r, lay.num_blocks * r
    bt, bt0 = _index(block_table, "block_table", 2, I32)
    sl, sl0 = _index(seq_lens, "seq_lens", 1, I64)
    n = integer(sl.size, "len(seq_lens)", U32)
    if bt.shape[0] != n:
        raise error("KV_ERR_BAD_SHAPE", "block_table: %d rows for %d sequences (len(seq_lens))"
                    % (bt.shape[0], n))
    cols = integer(bt.shape[1], "block_table columns", U32)
    if n:
        if (sl < 0).any():
            s = _first(sl < 0)
            raise error("KV_ERR_CORRUPT", "seq_lens[%d] = %d < 0" % (s, sl[s]))
        np_ = sl // pt + (sl % pt != 0)  # no int64 wrap near 2**63
        if (np_ > cols).any():
            s = _first(np_ > cols)
            raise error("KV_ERR_OUT_OF_BOUNDS", "sequence %d has %d tokens = %d pages of %d, "
                        "but the block table has %d columns" % (s, sl[s], np_[s], pt, cols))
        used = np.arange(cols)[None, :] < np_[:, None]
        bad = used & ((bt < 0) | (bt >= n_ids))
        if bad.any():
            s, j = (int(x) for x in np.argwhere(bad)[0])
            raise error("KV_ERR_OUT_OF_BOUNDS", "block_table[%d, %d] = %d (sequence %d page %d) "
                        "outside [0, %d) (B %d x r %d)" % (s, j, bt[s, j], s, j, n_ids,
                                                          lay.num_blocks, r))
    p = _EnginePages.__new__(_EnginePages)
    p.format, p.n_seqs, p.page_ratio, p.page_tokens = "block_table", n, r, pt
    p.block_table, p.seq_lens = bt, sl
    p._given = (block_table, seq_lens, bt0, sl0)
    p._bt = _empty_ok(bt.reshape(-1), np.int32)
    p._sl = _empty_ok(sl, np.int64)
    p._held = (p._bt, p._sl)  # what _cpages points at (p.block_table may be rebound)
    p._cpages = _lib.Pages(2, n, r, None, None, None, _p(p._bt), cols, _p(p._sl))
    return p
