"""tests/python/test_gpu_package.py - the package on the GPU (issue 21 point
6): a PagedCache over CUDA memory runs the CUDA kernels with device-resident
indices (kv_attn_*_cuda_dev) on the caller's stream.

Here without a GPU: the refusals that need none. A CUDA tensor (a DLPack
1.0 producer claiming kDLCUDA memory at a made-up address: nothing is ever
launched on it) given to a host cache is refused by name before its capsule
is taken; a host index array (slots, pages, out_indptr, copies) given to a
device cache is refused by name; arrays of one Pages on two sides, a
device id that differs, int32 slots, options the device decode lacks; and,
where no GPU is usable, a device cache's kernel call says so (and the
producers were asked for their capsules on the call's stream).

With torch and CUDA (scripts/gpu-check.sh): a write through a device
slot_mapping against the CPU kernel's bytes and a formula, read back
through device block tables and CSR, decode against a float64 NumPy
reference, an invalid slot / page / copy pair skipped and recorded in the
error record, copy_blocks, and a non-default stream; every call on
torch.cuda.current_stream() unless the test says otherwise. Skipped
cleanly where torch has no CUDA (KV_EXPECT_GPU=1 turns the library's
missing CUDA into a failure)."""
import ctypes
import os

import numpy as np
import pytest

import kvcache
from kvcache import _lib, tensors

N, H, D, B = 8, 2, 16, 64
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# DLPack type codes and bits of the dtypes used below
F16, F32, I32, I64 = (2, 16), (2, 32), (0, 32), (0, 64)


class FakeCuda:
    """A DLPack 1.0 producer of a C-contiguous tensor claiming CUDA memory
    (device `device`) at a made-up address. It records each stream it is
    asked for a capsule on; nothing may dereference its address."""

    def __init__(self, shape, dtype=F32, device=0, data=1 << 24):
        self.shape = tuple(shape)
        self._shape = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        self.mt = tensors.DLManagedTensorVersioned()
        self.mt.version = tensors.DLPackVersion(1, 0)
        t = self.mt.dl_tensor
        t.data, t.device, t.ndim = data, _lib.DLDevice(2, device), len(shape)
        t.dtype = _lib.DLDataType(dtype[0], dtype[1], 1)
        t.shape = ctypes.cast(self._shape, _lib.c_i64p)
        self.device = device
        self.streams = []

    def __dlpack_device__(self):
        return (2, self.device)

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        return _new_capsule(ctypes.addressof(self.mt), b"dltensor_versioned", None)


def layout(**kw):
    args = dict(num_layers=1, num_blocks=B, block_tokens=N, num_heads=H, head_dim=D,
                dtype="f16")
    args.update(kw)
    return kvcache.Layout(**args)


def fake_cache(device=0, **kw):
    """A device PagedCache over made-up CUDA memory (checked, never touched)."""
    lay = layout(**kw)
    es = lay.elem_bytes
    return kvcache.PagedCache(lay, FakeCuda((lay.total_bytes // es,), (2, 8 * es), device))


def fake_args(T=4, Hq=H):
    """CUDA-claiming K, V [T][H][D] f16, int64 slots [T], q and out
    [S=2][Hq][D] f32, at distinct made-up addresses."""
    return (FakeCuda((T, H, D), F16, data=1 << 30), FakeCuda((T, H, D), F16, data=1 << 31),
            FakeCuda((T,), I64, data=1 << 32), FakeCuda((2, Hq, D), F32, data=1 << 33),
            FakeCuda((2, Hq, D), F32, data=1 << 34))


def fake_pages(lay, device=0):
    return kvcache.Pages.from_csr(lay, FakeCuda((3,), I32, device, 1 << 35),
                                  FakeCuda((4,), I32, device, 1 << 36),
                                  FakeCuda((2,), I32, device, 1 << 37))


# ---- the refusals that need no GPU ------------------------------------------------


def test_a_cuda_tensor_given_to_a_host_cache_is_refused_by_name():
    lay = layout()
    mem = np.zeros(lay.total_bytes // 2, np.float16)
    pc = kvcache.PagedCache(lay, mem)
    assert pc.mem == "host" and pc.errors is None and pc.device is None
    k, v, slots, q, out = fake_args()
    hk = np.ones((4, H, D), np.float16)
    with pytest.raises(kvcache.Unsupported) as e:
        pc.write(0, k, hk, [1, 2, 3, 4])
    assert "k is on cuda:0; this cache is host memory and its kernels run on the CPU" in \
        e.value.message
    assert k.streams == []  # refused from __dlpack_device__, before any capsule
    with pytest.raises(kvcache.Unsupported) as e:
        pc.write(0, hk, hk, slots)
    assert "slots is on cuda:0; this cache is host memory" in e.value.message
    host_pages = kvcache.Pages.from_csr(lay, [0, 1], [3], [2])
    with pytest.raises(kvcache.Unsupported) as e:
        pc.decode(0, q, host_pages, np.zeros((2, H, D), np.float32))
    assert "q is on cuda:0" in e.value.message
    with pytest.raises(kvcache.Unsupported) as e:
        pc.decode(0, np.ones((1, H, D), np.float32), fake_pages(lay),
                  np.zeros((1, H, D), np.float32))
    assert "pages: CUDA arrays (on cuda:0); this cache's kernels run on the CPU" in \
        e.value.message
    with pytest.raises(kvcache.Unsupported) as e:
        pc.copy_blocks(FakeCuda((2, 3), I32))
    assert "copies is on cuda:0" in e.value.message
    with pytest.raises(kvcache.Unsupported) as e:  # a device cache as src of a pageable one
        pc.copy_blocks(np.array([[1, 2]]), src=fake_cache())
    assert "this cache is host memory and the other cache CUDA memory (cuda:0)" in \
        e.value.message
    for kw in ({"stream": 0}, {"errors": object()}):
        with pytest.raises(kvcache.InvalidArgument) as e:
            pc.write(0, hk, hk, [1, 2, 3, 4], **kw)
        assert "an argument of a device cache's kernels" in e.value.message
    with pytest.raises(kvcache.InvalidArgument) as e:
        pc.read(0, host_pages, np.zeros((2, H, D), np.float16), None, out_indptr=[0, 2])
    assert "out_indptr: an argument of a device cache's kernels" in e.value.message
    assert not mem.any()
    # a kvcache-owned host cache says the same
    with kvcache.Cache(lay, max_seqs=2) as c:
        with pytest.raises(kvcache.Unsupported) as e:
            c.write(0, hk, v, [1, 2, 3, 4])
        assert "v is on cuda:0" in e.value.message


def test_host_arrays_given_to_a_device_cache_are_refused_by_name():
    pc = fake_cache()
    lay = pc.layout
    assert pc.mem == "device" and pc.device == 0
    k, v, slots, q, out = fake_args()
    hk = np.ones((4, H, D), np.float16)
    cases = [
        (lambda: pc.write(0, k, v, np.array([1, 2, 3, 4])), kvcache.Unsupported,
         "slots is host memory (ndarray); this cache is CUDA memory (cuda:0), and its kernels "
         "take index arrays in CUDA memory on its device, never copied from the host"),
        (lambda: pc.write(0, k, v, [1, 2, 3, 4]), kvcache.Unsupported,
         "slots is host memory (list)"),
        (lambda: pc.write(0, hk, v, slots), kvcache.Unsupported,
         "k is host memory (ndarray); this cache is CUDA memory (cuda:0)"),
        (lambda: pc.write(0, k, v, FakeCuda((4,), I32)), kvcache.InvalidArgument,
         "slots: int64 values on the device, got i32"),
        (lambda: pc.write(0, FakeCuda((4, H, D), F16, device=1), v, slots), kvcache.Mismatch,
         "k is on cuda:1, the cache on cuda:0"),
        (lambda: pc.decode(0, q, kvcache.Pages.from_csr(lay, [0, 1], [3], [2]), out),
         kvcache.Unsupported, "pages: host arrays (_EnginePages); this cache is CUDA memory"),
        (lambda: pc.decode(0, q, fake_pages(lay, device=1), out), kvcache.Mismatch,
         "pages are on cuda:1, the cache on cuda:0"),
        (lambda: pc.decode(0, q, fake_pages(lay), out, window_left=4), kvcache.Unsupported,
         "window_left has no device-index CUDA kernel yet"),
        (lambda: pc.read(0, fake_pages(lay), k, v), kvcache.InvalidArgument,
         "out_indptr: a device cache's read needs the output rows of each sequence"),
        (lambda: pc.read(0, fake_pages(lay), k, v, out_indptr=np.array([0, 1, 4], np.int32)),
         kvcache.Unsupported, "out_indptr is host memory (ndarray)"),
        (lambda: pc.read(0, fake_pages(lay), k, v, out_indptr=FakeCuda((2,), I32)),
         kvcache.BadShape, "out_indptr: 2 elements for 2 sequences (+1)"),
        (lambda: pc.copy_blocks(np.array([[1, 2, 0]], np.int32)), kvcache.Unsupported,
         "copies is host memory (ndarray)"),
        (lambda: pc.copy_blocks(FakeCuda((2, 2), I32)), kvcache.BadShape,
         "copies: [n, 3] (src, dst, tokens) int32 on the device"),
        (lambda: pc.prefill(0, q, [0, 1, 2], fake_pages(lay), out), kvcache.Unsupported,
         "this cache is CUDA memory (cuda:0): the code that needs a host or pinned cache"),
        (lambda: pc.pack([1], 4), kvcache.Unsupported, "this cache is CUDA memory (cuda:0)"),
        (lambda: pc.write(0, k, v, slots, stream=-1), kvcache.InvalidArgument,
         "stream (a cudaStream_t handle) = -1 is outside the range of uint64"),
        (lambda: pc.write(0, k, v, slots, errors="mine"), kvcache.InvalidArgument,
         "errors: a kvcache.DeviceErrors, got str"),
    ]
    for call, exc, words in cases:
        with pytest.raises(exc) as e:
            call()
        assert words in e.value.message, (words, e.value.message)
    # one Pages' arrays live on one device, and are int32 there
    mixed = [
        (lambda: kvcache.Pages.from_csr(lay, FakeCuda((2,), I32), np.array([3], np.int32),
                                        FakeCuda((1,), I32)), kvcache.Mismatch,
         "indptr is on cuda:0, indices is host memory: one Pages' arrays live on one device"),
        (lambda: kvcache.Pages.from_csr(lay, FakeCuda((2,), I32), FakeCuda((1,), I32),
                                        FakeCuda((1,), I32, device=1)), kvcache.Mismatch,
         "indptr is on cuda:0, last_page_len on cuda:1"),
        (lambda: kvcache.Pages.from_csr(lay, FakeCuda((2,), I64), FakeCuda((1,), I32),
                                        FakeCuda((1,), I32)), kvcache.InvalidArgument,
         "indptr: int32 values on the device, got i64"),
        (lambda: kvcache.Pages.from_csr(lay, FakeCuda((2,), I32), FakeCuda((1,), I32),
                                        FakeCuda((2,), I32)), kvcache.BadShape,
         "last_page_len: 2 elements for 1 sequences"),
        (lambda: kvcache.Pages.from_block_table(lay, FakeCuda((2, 3), I32),
                                                np.array([1, 2], np.int32)), kvcache.Mismatch,
         "block_table is on cuda:0, seq_lens is host memory"),
        (lambda: kvcache.Pages.from_block_table(lay, FakeCuda((3, 3), I32), FakeCuda((2,), I32)),
         kvcache.BadShape, "block_table: 3 rows for 2 sequences"),
    ]
    for call, exc, words in mixed:
        with pytest.raises(exc) as e:
            call()
        assert words in e.value.message, (words, e.value.message)
    bt = kvcache.Pages.from_block_table(lay, FakeCuda((2, 3), I32), FakeCuda((2,), I32), 2)
    assert (bt.format, bt.n_seqs, bt.page_ratio, bt.page_tokens, bt.device) == \
        ("block_table", 2, 2, N // 2, 0)
    with pytest.raises(kvcache.Unsupported) as e:
        bt.seq_tokens()  # device memory: not read on the host
    assert "not read on the host" in e.value.message


def test_device_memory_is_checked_as_host_memory_is():
    lay = layout()
    with pytest.raises(kvcache.OutOfBounds) as e:
        kvcache.PagedCache(lay, FakeCuda((lay.total_bytes // 2 - 1,), F16))
    assert "the layout needs %d" % lay.total_bytes in e.value.message
    with pytest.raises(kvcache.Mismatch) as e:
        kvcache.PagedCache(lay, FakeCuda((lay.total_bytes // 4,), F32))
    assert "memory: f32 elements, the layout holds f16" in e.value.message
    with pytest.raises(kvcache.InvalidArgument) as e:
        kvcache.PagedCache(lay, FakeCuda((lay.total_bytes,), (1, 8), data=(1 << 24) + 1))
    assert "is not aligned to its 2-byte elements" in e.value.message
    # registering device memory with a transport stays refused (no RDMA flush yet)
    x = kvcache.Transport(1)
    try:
        with pytest.raises(kvcache.Unsupported) as e:
            x.register(FakeCuda((1024,), (1, 8)))
        assert "memory is on cuda:0: this takes host or pinned memory" in e.value.message
        with pytest.raises(kvcache.Unsupported) as e:
            x.register(fake_cache())
        assert "this cache is CUDA memory (cuda:0)" in e.value.message
    finally:
        x.close()


@pytest.mark.skipif(kvcache.cuda_available(), reason="a CUDA device is usable here")
def test_without_a_gpu_a_device_cache_says_why_at_each_call():
    pc = fake_cache()
    k, v, slots, q, out = fake_args()
    words = "this cache is CUDA memory (cuda:0), and its kernels cannot run here: "
    with pytest.raises(kvcache.Unsupported) as e:
        pc.write(0, k, v, slots, stream=7)
    assert words in e.value.message and "kv_attn_cuda_errors_create" in e.value.message
    # the producers were asked for their capsules on the call's stream
    assert k.streams == [7] and v.streams == [7] and slots.streams == [7]
    with pytest.raises(kvcache.Unsupported) as e:
        pc.decode(0, q, fake_pages(pc.layout), out)
    assert words in e.value.message
    assert q.streams == [1]  # the default stream (0) is DLPack's 1, the legacy stream
    with pytest.raises(kvcache.Unsupported) as e:
        pc.errors
    assert words in e.value.message
    with pytest.raises(kvcache.Unsupported) as e:
        kvcache.DeviceErrors()
    assert "kv_attn_cuda_errors_create" in e.value.message


class _Calls:
    """Stands in for the C entries: records each call's arguments, answers OK."""

    def __init__(self):
        self.calls = []

    def entry(self, name):
        def f(*args):
            self.calls.append((name, args))
            return 0
        return f


def test_the_calls_pass_device_addresses_lengths_the_stream_and_the_record(monkeypatch):
    # the marshalling checked without a GPU: the C entries and the record
    # replaced, every argument a device call would get compared
    rec = _Calls()
    for name in ("kv_attn_write_cuda_dev", "kv_attn_read_cuda_dev", "kv_attn_decode_cuda_dev",
                 "kv_attn_copy_blocks_cuda_dev", "kv_attn_copy_blocks_ex_cuda_dev"):
        monkeypatch.setattr(_lib.lib, name, rec.entry(name))

    class Record:
        device = 0

        def _handle(self):
            return 0xE0

    monkeypatch.setattr(kvcache.cuda.DeviceSide, "errors", lambda self: Record())
    pc = fake_cache()
    k, v, slots, q, out = fake_args()
    pc.write(None, k, v, slots, stream=7)
    name, (cpc, layer, kref, vref, sptr, n, sc, err, st) = rec.calls[-1]
    assert name == "kv_attn_write_cuda_dev" and cpc is pc._pc and cpc.mem == 2
    assert (layer, sptr, n, sc, err, st) == (-1, 1 << 32, 4, None, 0xE0, 7)
    assert (kref._obj.base, vref._obj.base) == (1 << 30, 1 << 31)
    assert tuple(kref._obj.shape[:3]) == (4, H, D)
    pc.write(0, k, None, slots, scales=([0.5], [2.0]))  # host scales: by value
    sc = rec.calls[-1][1][6]._obj
    assert (sc.n, sc.layers, sc.device) == (1, 0, 0) and rec.calls[-1][1][3] is None
    assert ctypes.cast(sc.k, ctypes.POINTER(ctypes.c_float))[0] == 0.5
    assert rec.calls[-1][1][8] == 0  # no torch CUDA here: the default stream
    ks, vs = FakeCuda((1, H), F32, data=1 << 40), FakeCuda((1, H), F32, data=1 << 41)
    pc.write(0, k, v, slots, scales=(ks, vs))  # device scales: read by the kernel
    sc = rec.calls[-1][1][6]._obj
    assert (sc.k, sc.v, sc.n, sc.layers, sc.device) == (1 << 40, 1 << 41, H, 1, 1)
    pages = fake_pages(pc.layout)
    pc.decode(0, q, pages, out, scale=0.25, stream=3)
    name, (cpc, layer, qref, pref, scale, sc, oref, err, st) = rec.calls[-1]
    d = pref._obj
    assert name == "kv_attn_decode_cuda_dev" and (layer, scale, sc, err, st) == \
        (0, 0.25, None, 0xE0, 3)
    assert (d.format, d.n_seqs, d.page_ratio, d.indptr, d.indices, d.n_pages,
            d.last_page_len) == (1, 2, 1, 1 << 35, 1 << 36, 4, 1 << 37)
    assert (qref._obj.base, oref._obj.base) == (1 << 33, 1 << 34)
    bt = kvcache.Pages.from_block_table(pc, FakeCuda((2, 5), I32, data=1 << 38),
                                        FakeCuda((2,), I32, data=1 << 39))
    pc.read(1 - 1, bt, k, None, out_indptr=FakeCuda((3,), I32, data=1 << 42))
    name, (cpc, layer, pref, oi, kref, vref, sc, err, st) = rec.calls[-1]
    d = pref._obj
    assert name == "kv_attn_read_cuda_dev" and (oi, vref, err) == (1 << 42, None, 0xE0)
    assert (d.format, d.n_seqs, d.block_table, d.block_table_cols, d.seq_lens) == \
        (2, 2, 1 << 38, 5, 1 << 39)
    pc.copy_blocks(FakeCuda((6, 3), I32, data=1 << 43))
    assert rec.calls[-1][0] == "kv_attn_copy_blocks_cuda_dev"
    assert rec.calls[-1][1][1:] == (1 << 43, 6, 0xE0, 0)
    pc.copy_blocks(FakeCuda((6, 3), I32, data=1 << 43), planes="k", src=fake_cache())
    name, (dpc, spc, ptr, n, opts, err, st) = rec.calls[-1]
    assert name == "kv_attn_copy_blocks_ex_cuda_dev" and (ptr, n) == (1 << 43, 6)
    assert opts._obj.planes == 1 and spc.base == dpc.base  # both fake caches at 1 << 24
    with pytest.raises(kvcache.Mismatch) as e:
        pc.copy_blocks(FakeCuda((6, 3), I32), src=fake_cache(device=1))
    assert "src is on cuda:1, the other cache on cuda:0" in e.value.message


# ---- on a GPU ------------------------------------------------------------------------


def _cuda():
    """torch with CUDA, or skip; the library must run CUDA then."""
    try:
        import torch
    except ImportError:
        pytest.skip("no torch")
    if not torch.cuda.is_available():
        pytest.skip("torch %s has no CUDA device" % torch.__version__)
    if not kvcache.cuda_available():
        if os.environ.get("KV_EXPECT_GPU") == "1":
            pytest.fail("torch sees a GPU, and %s cannot run CUDA kernels" %
                        kvcache.library_path)
        pytest.skip("%s has no CUDA (a CUDA=1 MALLOC=libc build has)" % kvcache.library_path)
    return torch


def tables(rng, lens, pad=-5):
    """An engine's page table: a block table over distinct random blocks
    (padding entries `pad`, never read), its CSR form, and the slot mapping
    of every token with a -1 padding entry after each sequence; owner[i]:
    (seq, token) of slot entry i, None for padding."""
    ids = iter(rng.permutation(B))
    cols = max((n + N - 1) // N for n in lens) + 1
    bt = np.full((len(lens), cols), pad, np.int32)
    for s, n in enumerate(lens):
        for j in range((n + N - 1) // N):
            bt[s, j] = next(ids)
    npages = [(n + N - 1) // N for n in lens]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = np.concatenate([bt[s, :npages[s]] for s in range(len(lens))]).astype(np.int32)
    last = np.array([(n - 1) % N + 1 if n else 0 for n in lens], np.int32)
    slots, owner = [], []
    for s, n in enumerate(lens):
        for t in range(n):
            slots.append(int(bt[s, t // N]) * N + t % N)
            owner.append((s, t))
        slots.append(-1)
        owner.append(None)
    return bt, indptr, indices, last, np.array(slots, np.int64), owner


LENS = [13, 0, 8, 1]


def _host_twin(lay, kh, vh, slots):
    """The reference pool: the same write by the CPU kernel on host memory."""
    mem = np.zeros(lay.total_bytes // 2, np.float16)
    kvcache.PagedCache(lay, mem).write(0, kh, vh, slots)
    return mem


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_write_on_device_then_read_back_equals_the_host_reference(order):
    torch = _cuda()
    rng = np.random.default_rng(1)
    lay = layout(order=order)
    bt, indptr, indices, last, slots, owner = tables(rng, LENS)
    T = len(slots)
    kh = rng.standard_normal((T, H, D)).astype(np.float16)
    vh = rng.standard_normal((T, H, D)).astype(np.float16)
    mem = torch.zeros(lay.total_bytes // 2, dtype=torch.float16, device="cuda")
    pc = kvcache.PagedCache(lay, mem)
    assert pc.mem == "device" and pc.device == torch.cuda.current_device()
    dev = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    pc.write(0, dev(kh), dev(vh), dev(slots))
    got = mem.cpu().numpy()  # the stream's work is done before the copy returns
    want = _host_twin(lay, kh, vh, slots)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    if order == "NHD":  # and by the formula: [kv][block][token][head][dim]
        pool = got.reshape(2, B, N, H, D)
        for i, sl in enumerate(slots):
            if sl >= 0:
                assert np.array_equal(pool[0, sl // N, sl % N], kh[i])
                assert np.array_equal(pool[1, sl // N, sl % N], vh[i])
    assert pc.errors.get().count == 0
    rows = [i for i, o in enumerate(owner) if o is not None]  # the tokens, sequence order
    out_indptr = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    for pages in (kvcache.Pages.from_block_table(lay, dev(bt), dev(np.array(LENS, np.int32))),
                  kvcache.Pages.from_csr(lay, dev(indptr), dev(indices), dev(last))):
        k_out = torch.full((len(rows), H, D), float("nan"), dtype=torch.float16, device="cuda")
        v_out = torch.full_like(k_out, float("nan"))
        pc.read(0, pages, k_out, v_out, out_indptr=dev(out_indptr))
        assert np.array_equal(k_out.cpu().numpy().view(np.uint16), kh[rows].view(np.uint16))
        assert np.array_equal(v_out.cpu().numpy().view(np.uint16), vh[rows].view(np.uint16))
    assert pc.errors.get().count == 0


def ref_decode(q, K, V, lens_pages, scale):
    """float64 decode: q [S][Hq][D]; K, V [S] lists of [t][H][D] rows."""
    S, Hq, _ = q.shape
    g = Hq // H
    out = np.zeros((S, Hq, D))
    for s in range(S):
        if len(K[s]) == 0:
            continue
        for i in range(Hq):
            logits = scale * (K[s][:, i // g] @ q[s, i])
            p = np.exp(logits - logits.max())
            out[s, i] = (p / p.sum()) @ V[s][:, i // g]
    return out


def test_decode_on_device_against_a_float64_reference():
    torch = _cuda()
    rng = np.random.default_rng(2)
    lay = layout()
    bt, indptr, indices, last, slots, owner = tables(rng, LENS)
    T, Hq = len(slots), 2 * H
    kh = rng.standard_normal((T, H, D)).astype(np.float16)
    vh = rng.standard_normal((T, H, D)).astype(np.float16)
    mem = torch.zeros(lay.total_bytes // 2, dtype=torch.float16, device="cuda")
    pc = kvcache.PagedCache(lay, mem)
    dev = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    pc.write(0, dev(kh), dev(vh), dev(slots))
    q = rng.standard_normal((len(LENS), Hq, D)).astype(np.float32)
    K = [np.array([kh[i] for i, o in enumerate(owner) if o and o[0] == s], np.float64)
         .reshape(-1, H, D) for s in range(len(LENS))]
    V = [np.array([vh[i] for i, o in enumerate(owner) if o and o[0] == s], np.float64)
         .reshape(-1, H, D) for s in range(len(LENS))]
    scale = 1.0 / np.sqrt(D)
    ref = ref_decode(q.astype(np.float64), K, V, None, scale)
    for pages in (kvcache.Pages.from_block_table(lay, dev(bt), dev(np.array(LENS, np.int32))),
                  kvcache.Pages.from_csr(lay, dev(indptr), dev(indices), dev(last))):
        out = torch.full((len(LENS), Hq, D), float("nan"), device="cuda")
        pc.decode(0, dev(q), pages, out)
        assert np.allclose(out.cpu().numpy(), ref, rtol=1e-4, atol=1e-5)
    assert pc.errors.get().count == 0


def test_invalid_indices_are_skipped_and_recorded():
    torch = _cuda()
    rng = np.random.default_rng(3)
    lay = layout()
    bt, indptr, indices, last, slots, owner = tables(rng, LENS)
    T = len(slots)
    kh = rng.standard_normal((T, H, D)).astype(np.float16)
    vh = rng.standard_normal((T, H, D)).astype(np.float16)
    mem = torch.zeros(lay.total_bytes // 2, dtype=torch.float16, device="cuda")
    pc = kvcache.PagedCache(lay, mem)
    dev = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    bad = slots.copy()
    bad[2], bad[5] = B * N, -7  # outside [-1, B * N): skipped, recorded
    pc.write(0, dev(kh), dev(vh), dev(bad))
    skipped = bad.copy()
    skipped[2] = skipped[5] = -1
    assert np.array_equal(mem.cpu().numpy().view(np.uint16),
                          _host_twin(lay, kh, vh, skipped).view(np.uint16))
    assert pc.errors.get(reset=True) == kvcache.ErrorInfo(2, "slots", 2, B * N)
    assert pc.errors.get() == kvcache.ErrorInfo(0, None, 0, 0)
    # a page id outside [0, B): its tokens are left out of the softmax
    pc.write(0, dev(kh), dev(vh), dev(slots))
    bt_bad = bt.copy()
    bt_bad[0, 1] = B + 3  # sequence 0's tokens 8..12
    cols = bt.shape[1]
    q = rng.standard_normal((len(LENS), 2 * H, D)).astype(np.float32)
    K = [np.array([kh[i] for i, o in enumerate(owner) if o and o[0] == s and
                   not (s == 0 and o[1] >= N)], np.float64).reshape(-1, H, D)
         for s in range(len(LENS))]
    V = [np.array([vh[i] for i, o in enumerate(owner) if o and o[0] == s and
                   not (s == 0 and o[1] >= N)], np.float64).reshape(-1, H, D)
         for s in range(len(LENS))]
    ref = ref_decode(q.astype(np.float64), K, V, None, 1.0 / np.sqrt(D))
    out = torch.zeros((len(LENS), 2 * H, D), device="cuda")
    own = kvcache.DeviceErrors(pc.device)  # a record of the caller's own
    pc.decode(0, dev(q), kvcache.Pages.from_block_table(lay, dev(bt_bad),
                                                        dev(np.array(LENS, np.int32))),
              out, errors=own)
    assert np.allclose(out.cpu().numpy(), ref, rtol=1e-4, atol=1e-5)
    assert own.get() == kvcache.ErrorInfo(1, "pages", 0 * cols + 1, B + 3)
    assert pc.errors.get().count == 0  # the cache's record untouched
    # a copy pair past the cache: skipped, the others done
    before = mem.cpu().numpy().reshape(2, B, N, H, D).copy()
    src, dst = [int(x) for x in bt[0, :2]], [int(x) for x in rng.choice(
        [b for b in range(B) if b not in bt], 2, replace=False)]
    copies = np.array([[src[0], dst[0], 0], [src[1], B + 1, 0], [src[1], dst[1], 0]], np.int32)
    pc.copy_blocks(dev(copies))
    want = before.copy()
    want[:, dst[0]], want[:, dst[1]] = before[:, src[0]], before[:, src[1]]
    assert np.array_equal(mem.cpu().numpy().reshape(2, B, N, H, D).view(np.uint16),
                          want.view(np.uint16))
    assert pc.errors.get() == kvcache.ErrorInfo(1, "copies", 2 * 1 + 1, B + 1)


def test_a_non_default_stream():
    torch = _cuda()
    rng = np.random.default_rng(4)
    lay = layout()
    bt, indptr, indices, last, slots, owner = tables(rng, LENS)
    T = len(slots)
    kh = rng.standard_normal((T, H, D)).astype(np.float16)
    vh = rng.standard_normal((T, H, D)).astype(np.float16)
    mem = torch.zeros(lay.total_bytes // 2, dtype=torch.float16, device="cuda")
    pc = kvcache.PagedCache(lay, mem)
    k, v, sl = (torch.from_numpy(a).cuda() for a in (kh, vh, slots))
    want = _host_twin(lay, kh, vh, slots).view(np.uint16)
    s = torch.cuda.Stream()
    for how in ("current", "object", "int"):
        mem.zero_()
        s.wait_stream(torch.cuda.current_stream())  # the inputs and the zeroing first
        if how == "current":
            with torch.cuda.stream(s):  # stream=None: torch's current stream, s
                pc.write(0, k, v, sl)
        else:
            pc.write(0, k, v, sl, stream=s if how == "object" else s.cuda_stream)
        torch.cuda.current_stream().wait_stream(s)
        assert np.array_equal(mem.cpu().numpy().view(np.uint16), want), how
    assert pc.errors.get(stream=s).count == 0
