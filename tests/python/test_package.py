"""tests/python/test_package.py - the Python package (python/kvcache) over
libkvcache.so: the ABI check, Layout, Cache (sequences, fork / copy-on-write,
prefix reuse, stats), the page-table exports against references built from
seq_blocks, zero-copy DLPack both ways (NumPy and PyTorch), lifetime (a
tensor outliving its Cache), and bad inputs raising the right KvError and
changing nothing. Run by `make test` (`make pytest`)."""
import ctypes
import gc

import numpy as np
import pytest

import kvcache
from kvcache import _lib


def small_layout(**kw):
    args = dict(num_layers=2, num_blocks=64, block_tokens=16, num_heads=4, head_dim=32,
                dtype="f16")
    args.update(kw)
    return kvcache.Layout(**args)


# ---- the ABI check -----------------------------------------------------------


def test_abi_check_passes_and_catches_a_wrong_declaration():
    _lib._check_abi()  # what import did

    class Wrong(ctypes.Structure):  # kv_token_range with its fields swapped in size
        _fields_ = [("start", ctypes.c_uint32), ("count", ctypes.c_uint64)]

    saved = dict(_lib._ABI)
    try:
        _lib._ABI["kv_token_range"] = Wrong
        with pytest.raises(_lib.AbiMismatch, match="kv_token_range"):
            _lib._check_abi()

        class Extra(ctypes.Structure):  # a field the C struct does not have
            _fields_ = [("start", ctypes.c_uint64), ("count", ctypes.c_uint64),
                        ("stop", ctypes.c_uint64)]
        _lib._ABI["kv_token_range"] = Extra
        with pytest.raises(_lib.AbiMismatch):
            _lib._check_abi()
    finally:
        _lib._ABI.clear()
        _lib._ABI.update(saved)


# ---- Layout ------------------------------------------------------------------


def test_layout_fields_and_fingerprints():
    a = small_layout()
    b = small_layout()
    c = small_layout(order="HND")
    d = small_layout(num_blocks=65)
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != c.fingerprint
    assert a.block_format_fingerprint == d.block_format_fingerprint  # placement only
    assert a.fingerprint != d.fingerprint
    assert a.elem_bytes == 2
    assert a.block_bytes == 16 * 4 * 32 * 2
    assert a.total_bytes == 2 * 2 * 64 * a.block_bytes
    s = a.strides_bytes()
    assert s["token"] == 4 * 32 * 2 and s["head"] == 32 * 2 and s["dim"] == 2
    assert c.strides_bytes()["head"] == 16 * 32 * 2


@pytest.mark.parametrize("kw,exc,words", [
    (dict(dtype="f17"), kvcache.InvalidArgument, "f17"),
    (dict(num_heads=0), kvcache.BadShape, "num_heads"),
    (dict(order="XYZ"), kvcache.InvalidArgument, "order"),
    (dict(arrange="diagonal"), kvcache.InvalidArgument, "arrange"),
])
def test_layout_refusals_name_the_field(kw, exc, words):
    with pytest.raises(exc) as e:
        small_layout(**kw)
    assert words in str(e.value)
    assert isinstance(e.value, kvcache.KvError) and e.value.status.startswith("KV_ERR_")


# ---- sequences and exports ---------------------------------------------------


def test_sequences_exports_against_references():
    with kvcache.Cache(small_layout(), max_seqs=8) as c:
        seqs, lens = [], [1, 16, 17, 40, 5]
        for n in lens:
            s = c.seq_create()
            c.append(s, np.arange(n) + 1000 * len(seqs))
            seqs.append(s)
        for s, n in zip(seqs, lens):
            assert c.seq_len(s) == n
            blocks = c.seq_blocks(s)
            assert len(blocks) == (n + 15) // 16
            for t in (0, n // 2, n - 1):
                assert c.slot(s, t) == int(blocks[t // 16]) * 16 + t % 16
        bt, sm = c.export_vllm(seqs, pad=-1)
        assert bt.shape == (len(seqs), 3)
        want_sm = []
        for i, (s, n) in enumerate(zip(seqs, lens)):
            blocks = c.seq_blocks(s)
            assert list(bt[i, :len(blocks)]) == list(blocks)
            assert all(x == -1 for x in bt[i, len(blocks):])
            want_sm += [int(blocks[t // 16]) * 16 + t % 16 for t in range(n)]
        assert list(sm) == want_sm
        # padded slot mapping for a sub-range
        bt2, sm2 = c.export_vllm(seqs[3:4], ranges=[(8, 20)], tokens_per_seq=32)
        b = c.seq_blocks(seqs[3])
        assert list(sm2[:20]) == [int(b[t // 16]) * 16 + t % 16 for t in range(8, 28)]
        assert all(x == -1 for x in sm2[20:])
        indptr, indices, last = c.export_flashinfer(seqs)
        assert list(indptr) == list(np.cumsum([0] + [(n + 15) // 16 for n in lens]))
        assert list(indices) == [int(x) for s in seqs for x in c.seq_blocks(s)]
        assert list(last) == [(n - 1) % 16 + 1 for n in lens]
        # seq_lens (the kernels' block-table form) and an empty sequence
        empty = c.seq_create()
        batch = [seqs[3], empty, seqs[0]]
        bt3, sm3, sl3 = c.export_vllm(batch, with_seq_lens=True)
        assert sl3.dtype == np.int64 and list(sl3) == [40, 0, 1]
        assert bt3.shape == (3, 3) and sm3.size == 41
        assert list(bt3[0]) == [int(x) for x in c.seq_blocks(seqs[3])]
        indptr3, indices3, last3 = c.export_flashinfer(batch)
        assert list(indptr3) == [0, 3, 3, 4] and list(last3) == [8, 0, 1]
        c.free(empty)
        st = c.table_stats()
        assert st["live_seqs"] == len(seqs)
        ps = c.pool_stats()
        assert ps["used_blocks"] == sum((n + 15) // 16 for n in lens)
        assert ps["free_blocks"] + ps["cached_blocks"] + ps["used_blocks"] == ps["capacity"]


def test_fork_copy_on_write_and_prefix_reuse():
    with kvcache.Cache(small_layout(), max_seqs=8) as c:
        prompt = np.arange(40)
        a = c.seq_create()
        c.append(a, prompt)
        b = c.fork(a)
        assert list(c.seq_blocks(b)) == list(c.seq_blocks(a))
        shared_last = int(c.seq_blocks(a)[-1])
        assert c.ref_count(shared_last) == 2
        c.append(b, [7])  # writes into the shared partial block: copy-on-write
        cp = c.take_copies()
        assert cp.shape == (1, 3) and cp[0, 0] == shared_last
        assert int(c.seq_blocks(b)[-1]) == cp[0, 1] != shared_last
        c.copies_done()
        c.free(b)
        c.free(a)  # full blocks stay cached under their prefix hashes
        d = c.seq_create()
        got = c.reuse_prefix(d, np.arange(50))
        assert got == 32  # two full blocks of the 40-token prompt
        assert c.pool_stats()["hits"] >= 2
        assert c.table_stats()["reused_blocks"] >= 2


def test_bad_inputs_raise_and_change_nothing():
    with kvcache.Cache(small_layout(num_blocks=8), max_seqs=2) as c:
        s = c.seq_create()
        c.append(s, range(20))
        before = (c.seq_len(s), list(c.seq_blocks(s)), c.pool_stats())
        with pytest.raises(kvcache.InvalidArgument):
            c.append(s, [[1, 2], [3, 4]])
        with pytest.raises(kvcache.InvalidArgument):
            c.append(s, [2**40])
        with pytest.raises(kvcache.Capacity) as e:
            c.append(s, range(200))  # more than max_blocks_per_seq (7)
        assert "max_blocks_per_seq 7" in e.value.message
        s2 = c.seq_create()
        with pytest.raises(kvcache.NoBlocks) as e:
            c.append(s2, range(96))  # 6 blocks, and only 5 of 7 are left
        assert c.seq_len(s2) == 0
        with pytest.raises(kvcache.KvError) as e:
            c.free(999)
        assert "999" in e.value.message
        with pytest.raises(kvcache.KvError):
            c.export_vllm([999])
        assert (c.seq_len(s), list(c.seq_blocks(s)), c.pool_stats()) == before
        with pytest.raises(kvcache.InvalidArgument):
            c.export_flashinfer([-1])
    with pytest.raises(kvcache.BadState):
        c.seq_create()  # closed
    with pytest.raises(kvcache.InvalidArgument):
        kvcache.Cache(small_layout(), mem="disk")


# ---- DLPack, zero-copy -------------------------------------------------------


def test_numpy_sees_the_cache_without_a_copy():
    c = kvcache.Cache(small_layout(), max_seqs=2)
    v = c.kv(1, 1)  # layer 1's V: [B][N][H][D]
    assert v.shape == (64, 16, 4, 32) and v.dtype == "f16"
    assert v.__dlpack_device__() == (1, 0)
    ro = np.from_dlpack(v)  # NumPy 1.x: read-only, the same bytes
    whole = v.numpy()
    assert ro.ctypes.data == whole.ctypes.data and ro.strides == whole.strides
    blk = v.select(0, 37).numpy()  # one block far from 0
    head = v.select(0, 37).narrow(1, 2, 2).numpy()  # a head slice
    assert whole.strides == tuple(x * 2 for x in v.strides)
    whole[37, 5, 3, 7] = 1.5
    assert blk[5, 3, 7] == np.float16(1.5)
    assert head[5, 1, 7] == np.float16(1.5)
    blk[0, 0, 0] = -2.0
    assert whole[37, 0, 0, 0] == np.float16(-2.0)
    # the same bytes the layout says: K of layer 0 and V of layer 1 are disjoint
    k0 = np.from_dlpack(c.kv(0, 0))
    assert k0[37, 5, 3, 7] != np.float16(1.5) or k0.ctypes.data != whole.ctypes.data
    off = (whole.ctypes.data - k0.ctypes.data)
    assert off == c.layout.strides_bytes()["layer"] + c.layout.strides_bytes()["kv"]
    c.close()
    del v, blk, head, k0


def test_tensor_outlives_its_cache_and_any_free_order():
    c = kvcache.Cache(small_layout(), max_seqs=2)
    a = c.kv(0, 1).numpy()
    b = c.kv(0, 1).select(0, 9).numpy()
    c.close()
    del c
    gc.collect()
    a[9, 1, 1, 1] = 3.0  # the memory is still the cache's, still alive
    assert b[1, 1, 1] == np.float16(3.0)
    # a C kernel reads the outliving tensor (under ASan in CI a freed arena
    # would be a heap-use-after-free here, not a silent read)
    with kvcache.Cache(small_layout(), max_seqs=2) as c2:
        s = c2.seq_create()
        c2.append(s, range(16))
        slots = [c2.slot(s, t) for t in range(16)]
        c2.write(0, b, b, slots)
        back = np.zeros((16, 4, 32), np.float16)
        c2.read(0, c2.pages([s]), back, None)
        assert back[1, 1, 1] == np.float16(3.0)
    del a
    gc.collect()
    b[0, 0, 0] = 1.0  # the last tensor keeps it
    assert b[0, 0, 0] == np.float16(1.0)
    del b
    gc.collect()
    # the same through DLPack alone: the tensor's own reference keeps the arena
    c = kvcache.Cache(small_layout(), max_seqs=2)
    w = c.kv(1, 0).select(0, 4).numpy()
    w[...] = 2.5
    del w
    d = np.from_dlpack(c.kv(1, 0).select(0, 4))  # read-only in NumPy 1.x; holds a reference
    c.close()
    del c
    gc.collect()
    with kvcache.Cache(small_layout(), max_seqs=2) as c2:
        s = c2.seq_create()
        c2.append(s, range(16))
        c2.write(1, d, d, [c2.slot(s, t) for t in range(16)])  # the kernel reads d
        back = np.zeros((16, 4, 32), np.float16)
        c2.read(1, c2.pages([s]), None, back)
        assert (back == np.float16(2.5)).all()
    del d
    # an exported capsule nobody consumed frees its reference too
    c = kvcache.Cache(small_layout(), max_seqs=2)
    cap = c.kv(0, 0).__dlpack__()
    del cap
    c.close()


def test_torch_zero_copy_both_ways():
    torch = pytest.importorskip("torch")
    lay = small_layout(dtype="bf16", order="HND", block_pad_elems=24)
    c = kvcache.Cache(lay, max_seqs=2)
    k = torch.from_dlpack(c.kv(1, 0))  # [B][H][N][D] with padded blocks
    # logical [B][N][H][D]; HND shows in the strides, the padding in the block stride
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == (64, 16, 4, 32)
    assert k.stride() == (4 * 16 * 32 + 24, 32, 16 * 32, 1)
    k[50, 7, 2] = torch.arange(32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):  # NumPy has no bfloat16: refused by NumPy itself
        np.from_dlpack(c.kv(1, 0).select(0, 50))
    again = torch.from_dlpack(c.kv(1, 0).select(0, 50))
    assert torch.equal(again[7, 2], torch.arange(32, dtype=torch.bfloat16))
    raw = c.kv(1, 0).select(0, 50).numpy()  # bf16 as uint16 bits
    assert raw[7, 2, 5] == (torch.tensor(5.0, dtype=torch.bfloat16).view(torch.int16).item()
                            & 0xFFFF)
    again[0, 0, 0] = 5
    assert k[50, 0, 0, 0].item() == 5
    # torch -> the cache: a view of the same memory imported back through DLPack
    mt = torch.utils.dlpack.to_dlpack(k[50])
    p = ctypes.pythonapi.PyCapsule_GetPointer
    p.restype = ctypes.c_void_p
    p.argtypes = [ctypes.py_object, ctypes.c_char_p]
    addr = p(mt, b"dltensor")
    view = _lib.ViewC()
    dev = _lib.DLDevice()
    kvcache.errors.check(_lib.lib.kv_view_from_dlpack(
        ctypes.cast(addr, ctypes.POINTER(_lib.DLManagedTensor)), ctypes.byref(view),
        ctypes.byref(dev)))
    assert view.base + view.offset * 2 == k[50].data_ptr()
    assert tuple(view.shape[:3]) == (16, 4, 32)
    assert tuple(view.strides[:3]) == (32, 16 * 32, 1)
    c.close()
    del k, again


# ---- kernels ------------------------------------------------------------------


def _cache_with(c, n):
    s = c.seq_create()
    c.append(s, np.arange(n))
    return s, [c.slot(s, t) for t in range(n)]


def test_write_read_round_trip_with_strided_tensors():
    rng = np.random.default_rng(7)
    lay = small_layout(dtype="f32", order="HND", block_pad_elems=24, num_blocks=96)
    with kvcache.Cache(lay, max_seqs=4) as c:
        c.append(c.seq_create(), np.arange(500))  # push the next blocks far from 0
        s, slots = _cache_with(c, 37)
        # K and V as slices of a fused [T][3][H][D] buffer: token stride 3*H*D
        qkv = rng.standard_normal((37, 3, 4, 32)).astype(np.float32)
        c.write(1, qkv[:, 1], qkv[:, 2], slots)
        pg = c.pages([s])
        assert pg.n_tokens == 37
        # outputs with a padded token stride, written in place
        kbuf = np.full((37, 5, 32), np.nan, np.float32)
        vbuf = np.full((37, 5, 32), np.nan, np.float32)
        c.read(1, pg, kbuf[:, :4], vbuf[:, 1:])
        assert np.array_equal(kbuf[:, :4], qkv[:, 1]) and np.isnan(kbuf[:, 4]).all()
        assert np.array_equal(vbuf[:, 1:], qkv[:, 2]) and np.isnan(vbuf[:, 0]).all()
        # layer 0 untouched by the layer-1 write (its bytes as the arena had them)
        k0 = np.zeros((37, 4, 32), np.float32)
        c.read(0, pg, k0, None)
        assert not np.array_equal(k0, qkv[:, 1])


def test_zero_copy_between_torch_and_the_kernels():
    torch = pytest.importorskip("torch")
    lay = small_layout(dtype="bf16", num_blocks=80)
    with kvcache.Cache(lay, max_seqs=4) as c:
        c.append(c.seq_create(), np.arange(700))
        s, slots = _cache_with(c, 20)
        pg = c.pages([s])
        kcache = torch.from_dlpack(c.kv(0, 0))  # [B][N][H][D] over the arena
        vcache = torch.from_dlpack(c.kv(0, 1))
        # written through torch at the slots' (block, offset) -> read by the C kernel
        src = torch.randn(20, 4, 32).to(torch.bfloat16)
        for t, sl in enumerate(slots):
            kcache[sl // 16, sl % 16] = src[t]
            vcache[sl // 16, sl % 16] = -src[t]
        kout = torch.empty(20, 4, 32, dtype=torch.bfloat16)
        vout = torch.empty(20, 4, 32, dtype=torch.bfloat16)
        c.read(0, pg, kout, vout)
        assert torch.equal(kout, src) and torch.equal(vout, -src)
        # written by the C kernel -> seen by torch in the cache's memory
        src2 = torch.randn(20, 4, 32).to(torch.bfloat16)
        c.write(0, src2, src2 * 2, slots)
        for t, sl in enumerate(slots):
            assert torch.equal(kcache[sl // 16, sl % 16], src2[t])
            assert torch.equal(vcache[sl // 16, sl % 16], src2[t] * 2)


def test_decode_against_a_reference():
    rng = np.random.default_rng(3)
    lay = small_layout(dtype="f32", num_blocks=64)
    with kvcache.Cache(lay, max_seqs=4) as c:
        lens = [33, 1, 16]
        seqs, ks, vs = [], [], []
        for n in lens:
            s, slots = _cache_with(c, n)
            k = rng.standard_normal((n, 4, 32)).astype(np.float32)
            v = rng.standard_normal((n, 4, 32)).astype(np.float32)
            c.write(0, k, v, slots)
            seqs.append(s), ks.append(k), vs.append(v)
        q = rng.standard_normal((3, 8, 32)).astype(np.float32)  # Hq 8 over H 4
        out = np.zeros_like(q)
        c.decode(0, q, c.pages(seqs), out)
        scale = 1 / np.sqrt(32)
        for s in range(3):
            for i in range(8):
                lg = ks[s][:, i // 2] @ q[s, i] * scale
                p = np.exp(lg - lg.max())
                want = (p / p.sum()) @ vs[s][:, i // 2]
                assert np.allclose(out[s, i], want, atol=2e-6, rtol=1e-5)


def test_copy_blocks_runs_copy_on_write():
    rng = np.random.default_rng(5)
    lay = small_layout(dtype="f32")
    with kvcache.Cache(lay, max_seqs=4) as c:
        a, slots = _cache_with(c, 24)
        k = rng.standard_normal((24, 4, 32)).astype(np.float32)
        for layer in (0, 1):
            c.write(layer, k + layer, -k, slots)
        b = c.fork(a)
        c.append(b, [99])  # copy-on-write of the shared partial block
        cp = c.take_copies()
        c.copy_blocks(cp)
        c.copies_done()
        assert c.seq_len(b) == 25
        for layer in (0, 1):
            kb = np.zeros((25, 4, 32), np.float32)
            c.read(layer, c.pages([b]), kb, None)
            assert np.array_equal(kb[:24], k + layer)  # b's copy holds a's tokens


class _FakeDeviceTensor:
    """A DLPack producer claiming CUDA memory (no GPU needed to test the refusal)."""

    def __init__(self):
        self.shape = (4, 4, 32)
        self._shape = (ctypes.c_int64 * 3)(*self.shape)
        self.mt = _lib.DLManagedTensor()
        t = self.mt.dl_tensor
        t.data = 4096
        t.device = _lib.DLDevice(2, 0)
        t.ndim = 3
        t.dtype = _lib.DLDataType(2, 32, 1)
        t.shape = ctypes.cast(self._shape, _lib.c_i64p)

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.mt), b"dltensor", None)


def test_kernel_refusals_change_nothing():
    lay = small_layout(dtype="f32")
    with kvcache.Cache(lay, max_seqs=4) as c:
        s, slots = _cache_with(c, 8)
        k = np.ones((8, 4, 32), np.float32)
        c.write(0, k, k, slots)
        before = c.kv(0, 0).numpy().view(np.uint32).copy()  # bits: the arena may hold NaNs
        with pytest.raises(kvcache.BadShape):
            c.write(0, np.ones((8, 3, 32), np.float32), np.ones((8, 3, 32), np.float32), slots)
        with pytest.raises(kvcache.OutOfBounds) as e:
            c.write(0, k * 2, k * 2, [0, 1, 2, 3, 4, 5, 6, 10**9])
        assert str(10**9) in e.value.message
        with pytest.raises(kvcache.Overlap):
            c.write(0, k * 2, k * 2, [5, 5, 1, 2, 3, 4, 6, 7])
        with pytest.raises(kvcache.Unsupported) as e:
            c.write(0, _FakeDeviceTensor(), k, slots[:4])
        assert "cuda" in e.value.message
        with pytest.raises(kvcache.Unsupported):
            c.write(0, np.ones((8, 4, 32), np.complex64), k, slots)
        with pytest.raises(kvcache.InvalidArgument):
            c.write(0, k[::-1], k, slots)  # negative strides: not a kvcache view
        with pytest.raises(kvcache.InvalidArgument):
            c.write(0, object(), k, slots)
        ro = np.zeros((8, 4, 32), np.float32)
        ro.flags.writeable = False
        with pytest.raises(kvcache.InvalidArgument) as e:
            c.read(0, c.pages([s]), ro, None)  # NumPy said read-only: not written
        assert "read-only" in e.value.message and not ro.any()
        out_small = np.zeros((7, 4, 32), np.float32)
        with pytest.raises(kvcache.BadShape):
            c.read(0, c.pages([s]), out_small, None)
        assert np.array_equal(c.kv(0, 0).numpy().view(np.uint32), before)


# ---- pack / unpack, the arena, threads ----------------------------------------


def test_pack_unpack_converts_and_refuses_corruption():
    src = kvcache.Cache(small_layout(num_blocks=40))
    dst = kvcache.Cache(small_layout(num_blocks=50, block_tokens=32, order="HND",
                                     arrange="block", block_pad_elems=24))
    ar = src.arena()
    ar[:] = np.random.default_rng(1).integers(0, 256, ar.size, dtype=np.uint8)
    buf = src.pack([5, 9, 33], 40)
    before = dst.arena().copy()
    dst.unpack(buf, [7, 44])
    for layer in (0, 1):
        for kv in (0, 1):
            a = src.kv(layer, kv).numpy().view(np.uint16)
            b = dst.kv(layer, kv).numpy().view(np.uint16)
            assert np.array_equal(np.concatenate([a[5], a[9], a[33]])[:40],
                                  np.concatenate([b[7], b[44]])[:40])
    # everything outside blocks 7 and 44 of dst is as it was
    after = dst.arena()
    changed = np.nonzero(after != before)[0]
    bs = dst.layout.strides_bytes()["block"]
    assert set(int(x) // bs for x in changed) <= {7, 44}
    # a flipped payload byte: refused, and what the request writes is zeroed
    # (tokens 0..31 of block 7, 32..47 = tokens 0..15 of block 44), nothing
    # else of dst written
    snap = dst.arena().copy()
    want = {(layer, kv): dst.kv(layer, kv).numpy().view(np.uint16).copy()
            for layer in (0, 1) for kv in (0, 1)}
    bad = buf.copy()
    bad[-1] ^= 1
    with pytest.raises(kvcache.Corrupt) as e:
        dst.unpack(bad, [7, 44])
    assert "block 2 of 3" in e.value.message
    for (layer, kv), w in want.items():
        w[7] = 0
        w[44][:16] = 0
        assert np.array_equal(dst.kv(layer, kv).numpy().view(np.uint16), w)
    changed = np.nonzero(dst.arena() != snap)[0]
    assert set(int(x) // bs for x in changed) <= {7, 44}
    snap = dst.arena().copy()
    with pytest.raises(kvcache.Corrupt):
        dst.unpack(buf[:100], [7, 44])  # truncated
    with pytest.raises(kvcache.BadShape):
        dst.unpack(buf, [7])  # 40 tokens need 2 blocks of 32
    assert np.array_equal(dst.arena(), snap)
    src.close()
    dst.close()


def test_pack_unpack_layer_range():
    """Layer 1 of a 2-layer prefill cache into layer 2 of a 3-layer decode
    cache (another layout); the other layers untouched; a buffer of other
    layers than the call names is refused with nothing written."""
    src = kvcache.Cache(small_layout(num_blocks=40))
    dst = kvcache.Cache(small_layout(num_layers=3, num_blocks=50, block_tokens=32, order="HND"))
    ar = src.arena()
    ar[:] = np.random.default_rng(2).integers(0, 256, ar.size, dtype=np.uint8)
    da = dst.arena()
    da[:] = np.random.default_rng(3).integers(0, 256, da.size, dtype=np.uint8)
    buf = src.pack([5, 9, 33], 40, layers=(1, 1))
    whole = src.pack([5, 9, 33], 40)
    assert buf.size < whole.size
    before = [[dst.kv(layer, kv).numpy().view(np.uint16).copy() for kv in (0, 1)]
              for layer in range(3)]  # bits: random f16 holds NaNs
    snap = dst.arena().copy()
    with pytest.raises(kvcache.Mismatch) as e:
        dst.unpack(buf, [7, 44], layers=(0, 2, 1))  # the buffer carries layer 1, not 0
    assert "layers [1, 1+1)" in e.value.message
    with pytest.raises(kvcache.BadShape):
        dst.unpack(buf, [7, 44])  # every layer: L 2 and 3 differ
    with pytest.raises(kvcache.InvalidArgument):
        dst.unpack(buf, [7, 44], layers=(1, 2))
    assert np.array_equal(dst.arena(), snap)
    dst.unpack(buf, [7, 44], layers=(1, 2, 1))
    for kv in (0, 1):
        a = src.kv(1, kv).numpy().view(np.uint16)  # [B][N][H][D] views of both orders
        b = dst.kv(2, kv).numpy().view(np.uint16)
        assert np.array_equal(np.concatenate([a[5], a[9], a[33]])[:40],
                              np.concatenate([b[7], b[44]])[:40])
        for layer in (0, 1):
            assert np.array_equal(dst.kv(layer, kv).numpy().view(np.uint16), before[layer][kv])
    src.close()
    dst.close()


def test_threads_setting():
    n = kvcache.threads()
    assert n >= 1
    kvcache.set_threads(1)
    assert kvcache.threads() == 1
    with pytest.raises(kvcache.InvalidArgument):
        kvcache.set_threads(-1)
    kvcache.set_threads(0)
    assert kvcache.threads() == n


def test_remaining_sequence_calls():
    with kvcache.Cache(small_layout(num_blocks=32), max_seqs=4) as c:
        a = c.seq_create(extra_key=7)
        b = c.seq_create()
        assert c.blocks_needed(a, 17) == 2
        c.append(a, range(40))
        c.append(b, range(40))
        assert c.blocks_needed(a, 8) == 0 and c.blocks_needed(a, 9) == 1
        # another extra key: a's full blocks are not b's prefix
        d = c.seq_create(extra_key=7)
        assert c.reuse_prefix(d, range(40)) == 32
        e = c.seq_create()
        assert c.reuse_prefix(e, range(40)) == 32  # b's, under the default key
        assert list(c.seq_blocks(d)[:2]) == list(c.seq_blocks(a)[:2])
        assert list(c.seq_blocks(e)[:2]) == list(c.seq_blocks(b)[:2])
        c.truncate(a, 20)
        assert c.seq_len(a) == 20 and len(c.seq_blocks(a)) == 2
        with pytest.raises(kvcache.KvError):
            c.truncate(a, 21)  # longer than it is
        lay = c.layout
        assert (lay.num_layers, lay.num_blocks, lay.block_tokens, lay.num_heads,
                lay.head_dim, lay.dtype, lay.order, lay.arrange) == (2, 32, 16, 4, 32, "f16",
                                                                     "NHD", "layer")


def test_the_gil_is_released_around_every_c_call():
    """ctypes releases the GIL around a foreign call unless the function is
    flagged as using the Python API (PyDLL). Checked on the mechanism, not
    on timing: every function the package binds must be a plain CDLL one
    (a timing-based version of this check, with decode loaded through
    PyDLL, saw the main thread stall; tests do not depend on timing)."""
    assert type(_lib.lib) is ctypes.CDLL
    for name in _lib._PROTOS:
        fn = getattr(_lib.lib, name)
        assert not (fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI), name
    for name in ("kv_attn_write", "kv_attn_read", "kv_attn_decode", "kv_attn_copy_blocks",
                 "kv_pack", "kv_unpack"):
        assert name in _lib._PROTOS
