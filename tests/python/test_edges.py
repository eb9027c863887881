"""tests/python/test_edges.py - the Python package at its edges ("Safe at the
edges"): statuses from the library's own table, every integer crossing into C
range-checked and refused by name, every output checked for writability
whatever its type, Views keeping their cache alive, and Cache.close() against
calls in flight on other threads.

The lifetime and thread cases run in a child interpreter (run_isolated): on a
package without the fix they crash (SIGSEGV on the libc build, an ASan abort
under CI's ASan run), and a crash must fail one test, not kill pytest."""
import ctypes
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcache
from kvcache import _lib

L = _lib.lib
PKG_DIR = os.path.dirname(os.path.abspath(kvcache.__file__))


def small_layout(**kw):
    args = dict(num_layers=2, num_blocks=64, block_tokens=16, num_heads=4, head_dim=32,
                dtype="f32")
    args.update(kw)
    return kvcache.Layout(**args)


def run_isolated(code, timeout=180):
    """Run code in a fresh interpreter over the same library (and the same
    environment: under ASan the child is checked too); its output, or a
    failed test naming how it ended."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(PKG_DIR)] +
                                        [p for p in [env.get("PYTHONPATH")] if p])
    env["KVCACHE_LIBRARY"] = kvcache.library_path
    prelude = ("import gc, sys, threading, time\nimport numpy as np\nimport kvcache\n"
               "from kvcache import _lib\n")
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    how = ("killed by signal %d" % -r.returncode if r.returncode < 0
           else "exit status %d" % r.returncode)
    assert r.returncode == 0, "child %s\n--- stdout\n%s\n--- stderr\n%s" % (
        how, r.stdout[-3000:], r.stderr[-6000:])
    return r.stdout


# ---- statuses: the library's table, no numeric literals ------------------------------


def test_status_table_is_the_librarys():
    table = kvcache.errors.STATUS
    assert table["KV_OK"] == 0
    for name, code in table.items():
        assert L.kv_status_name(code).decode() == name
    # every failure status the library has maps to its own class, and back
    for name, code in table.items():
        if name == "KV_OK":
            continue
        cls = kvcache.errors.error_class(name)
        assert cls is not kvcache.KvError, name
        assert cls.status == name and cls.code == code
        e = kvcache.errors.error(name, "x")
        assert type(e) is cls and e.status == name and e.code == code


def lib_code(name):
    """The library's code for a status name, asked of kv_status_name."""
    return next(c for c in range(0, -256, -1) if L.kv_status_name(c).decode() == name)


def test_python_side_refusals_carry_the_librarys_codes():
    with kvcache.Cache(small_layout(), max_seqs=2) as c:
        s = c.seq_create()
        c.append(s, range(4))
        # ndim 9: refused in Python before C sees it - as BadDim, not InvalidArgument
        nine = np.zeros((1,) * 9, np.float32)
        with pytest.raises(kvcache.KvError) as e:
            c.write(0, nine, nine, [0])
        assert type(e.value) is kvcache.BadDim
        assert (e.value.status, e.value.code) == ("KV_ERR_BAD_DIM", lib_code("KV_ERR_BAD_DIM"))
        with pytest.raises(kvcache.KvError) as e:
            c.write(0, np.zeros((1, 4, 32), np.complex64), nine, [0])
        assert type(e.value) is kvcache.Unsupported
        assert e.value.code == lib_code("KV_ERR_UNSUPPORTED")
    with pytest.raises(kvcache.BadState) as e:
        c.seq_len(s)
    assert e.value.code == lib_code("KV_ERR_BAD_STATE")
    # a class raised alone carries its status and the library's code
    assert kvcache.NoBlocks("x").code == lib_code("KV_ERR_NO_BLOCKS")


def test_no_hard_coded_status_codes_in_the_package():
    for name in sorted(os.listdir(PKG_DIR)):
        if name.endswith(".py"):
            src = open(os.path.join(PKG_DIR, name)).read()
            assert not re.search(r"\bcode\s*=\s*-?\d", src), name


# ---- integers crossing into C: range-checked, refused by name ------------------------

U32 = (0, 2**32 - 1)
I32 = (-2**31, 2**31 - 1)
U64 = (0, 2**64 - 1)
I64 = (-2**63, 2**63 - 1)


class Ctx:
    """A cache with one 20-token sequence written, and what the calls need."""

    def __init__(self, c):
        self.c = c
        self.s = c.seq_create()
        self.e = c.seq_create()  # empty
        c.append(self.s, np.arange(20))
        self.slots = [c.slot(self.s, t) for t in range(20)]
        self.k = np.arange(20 * 4 * 32, dtype=np.float32).reshape(20, 4, 32)
        c.write(0, self.k, -self.k, self.slots)
        c.write(1, self.k + 1, -self.k, self.slots)
        self.pg = c.pages([self.s])
        self.out = np.zeros((20, 4, 32), np.float32)
        self.q = np.ones((1, 4, 32), np.float32)
        self.o = np.zeros((1, 4, 32), np.float32)
        self.blocks = [int(b) for b in c.seq_blocks(self.s)]
        self.buf = c.pack(self.blocks, 20)

    def state(self):
        c = self.c
        return (c.seq_len(self.s), list(c.seq_blocks(self.s)), c.table_stats(),
                c.pool_stats(), c.arena().tobytes())


# (argument, its C range, the call with the value in that argument)
SCALARS = [
    ("seq", U32, lambda t, x: t.c.seq_len(x)),
    ("seq", U32, lambda t, x: t.c.append(x, [1])),
    ("seq", U32, lambda t, x: t.c.reuse_prefix(x, [1])),
    ("seq", U32, lambda t, x: t.c.blocks_needed(x, 1)),
    ("seq", U32, lambda t, x: t.c.fork(x)),
    ("seq", U32, lambda t, x: t.c.truncate(x, 0)),
    ("seq", U32, lambda t, x: t.c.free(x)),
    ("seq", U32, lambda t, x: t.c.seq_blocks(x)),
    ("seq", U32, lambda t, x: t.c.slot(x, 0)),
    ("n", U64, lambda t, x: t.c.blocks_needed(t.s, x)),
    ("n_tokens", U64, lambda t, x: t.c.truncate(t.s, x)),
    ("t", U64, lambda t, x: t.c.slot(t.s, x)),
    ("extra_key", U64, lambda t, x: t.c.seq_create(extra_key=x)),
    ("block", U32, lambda t, x: t.c.ref_count(x)),
    ("cols", U32, lambda t, x: t.c.export_vllm([t.s], cols=x)),
    ("pad", I32, lambda t, x: t.c.export_vllm([t.s], pad=x)),
    ("tokens_per_seq", U32, lambda t, x: t.c.export_vllm([t.s], tokens_per_seq=x)),
    ("slot_mapping_len", U64, lambda t, x: t.c.export_vllm([t.s], slot_mapping_len=x)),
    ("layer", U32, lambda t, x: t.c.kv(x, 0)),
    ("kv", I32, lambda t, x: t.c.kv(0, x)),
    ("layer", I32, lambda t, x: t.c.write(x, t.k, t.k, t.slots)),
    ("layer", I32, lambda t, x: t.c.read(x, t.pg, t.out, None)),
    ("layer", U32, lambda t, x: t.c.decode(x, t.q, t.pg, t.o)),
    ("n_tokens", U64, lambda t, x: t.c.pack(t.blocks, x)),
    ("heads", I64, lambda t, x: t.c.unpack(t.buf, t.blocks, heads=(x, 0, 0))),
    ("heads", I64, lambda t, x: t.c.unpack(t.buf, t.blocks, heads=(0, 0, x))),
    ("dim", I32, lambda t, x: t.c.kv(0, 0).select(x, 0)),
    ("index", I64, lambda t, x: t.c.kv(0, 0).select(0, x)),
    ("dim", I32, lambda t, x: t.c.kv(0, 0).narrow(x, 0, 1)),
    ("start", I64, lambda t, x: t.c.kv(0, 0).narrow(0, x, 1)),
    ("length", I64, lambda t, x: t.c.kv(0, 0).narrow(0, 0, x)),
]


@pytest.mark.parametrize("arg,rng,call", SCALARS,
                         ids=["%s-%d" % (s[0], i) for i, s in enumerate(SCALARS)])
def test_every_scalar_is_range_checked_by_name(arg, rng, call):
    lo, hi = rng
    with kvcache.Cache(small_layout(), max_seqs=4) as c:
        t = Ctx(c)
        before = t.state()
        # just past each end, and far past it where a wrap lands on a valid value
        # (2^32 + 1 as uint32 is 1, 2^64 + 16 as uint64 is 16)
        for x in (hi + 1, lo - 1, hi + 1 + t.s + 1, lo - (hi - lo + 1) + 3):
            with pytest.raises(kvcache.InvalidArgument) as e:
                call(t, x)
            msg = str(e.value)
            assert arg in msg and str(x) in msg and "[%d, %d]" % (lo, hi) in msg, msg
            assert e.value.status == "KV_ERR_INVALID_ARG"
        with pytest.raises(kvcache.InvalidArgument) as e:
            call(t, 1.0)  # not an integer: not truncated either
        assert arg in str(e.value)
        assert t.state() == before


def test_module_and_config_integers_are_range_checked():
    for n in (2**31, -2**31 - 1, 2**32 + 1):
        with pytest.raises(kvcache.InvalidArgument, match=r"threads|\bn\b"):
            kvcache.set_threads(n)
    for field in ("num_layers", "num_blocks", "block_tokens", "num_heads", "head_dim",
                  "block_pad_elems", "block_stride_bytes", "align_bytes"):
        for x in (2**63, 2**64 + 64, -2**63 - 1):
            with pytest.raises(kvcache.InvalidArgument, match=field):
                small_layout(**{field: x})
    for arg, rng in (("max_seqs", U32), ("max_blocks_per_seq", U32), ("page_ratio", U32),
                     ("device", I32)):
        for x in (rng[1] + 1, rng[0] - 1, rng[1] + 3):
            with pytest.raises(kvcache.InvalidArgument, match=arg):
                kvcache.Cache(small_layout(), **{arg: x})


def test_copy_blocks_does_not_wrap_block_ids():
    """The issue's case: 2^32 + 3 copied block 3, -2^32 + 5 block 5."""
    with kvcache.Cache(small_layout(), max_seqs=4) as c:
        ar = c.arena()
        ar[:] = np.random.default_rng(2).integers(0, 256, ar.size, dtype=np.uint8)
        before = ar.copy()
        for bad in ([[2**32 + 3, 40]], [[-2**32 + 5, 40]], [[3, 2**32 + 40]],
                    [[3, 40, 2**32]], np.array([[2**64 - 1, 40]], np.uint64),
                    [[3.5, 40]], [[3, 40], [2**70, 41]]):
            with pytest.raises(kvcache.InvalidArgument) as e:
                c.copy_blocks(bad)
            assert "copies" in str(e.value) and "[0, 4294967295]" in str(e.value), bad
            assert np.array_equal(ar, before), bad
        c.copy_blocks([[3, 40]])  # in range: copied
        k0 = c.kv(0, 0).numpy().view(np.uint32)  # random bytes: NaNs as floats
        assert np.array_equal(k0[40], k0[3])


# (argument, its C range, the call with the array in that argument, bad arrays)
ARRAYS = [
    ("seqs", U32, lambda t, a: t.c.export_vllm(a)),
    ("seqs", U32, lambda t, a: t.c.export_flashinfer(a)),
    ("seqs", U32, lambda t, a: t.c.pages(a)),
    ("blocks", U32, lambda t, a: t.c.pack(a, 16)),
    ("blocks", U32, lambda t, a: t.c.unpack(t.buf[:0], a)),
    ("tokens", I32, lambda t, a: t.c.append(t.s, a)),
    ("tokens", I32, lambda t, a: t.c.reuse_prefix(t.e, a)),
    ("slots", I64, lambda t, a: t.c.write(0, t.k[:1], t.k[:1], a)),
    ("ranges", U64, lambda t, a: t.c.export_vllm([t.s], ranges=a)),
]


def _bad_arrays(rng):
    lo, hi = rng
    out = [[hi + 1], [lo - 1], [hi + 2**32 + 1], [1.5]]
    if hi < 2**63:
        out.append(np.array([2**64 - 1], np.uint64))  # wraps to -1 in int64
    if hi == 2**63 - 1:
        out.append([2**64 + 5])
    return out


@pytest.mark.parametrize("arg,rng,call", ARRAYS,
                         ids=["%s-%d" % (s[0], i) for i, s in enumerate(ARRAYS)])
def test_every_index_array_is_range_checked_before_conversion(arg, rng, call):
    with kvcache.Cache(small_layout(), max_seqs=8) as c:
        t = Ctx(c)
        before = t.state()
        for bad in _bad_arrays(rng):
            if arg == "ranges":  # [(start, count)]: the bad value as a count
                bad = (np.array([[0, bad[0]]], bad.dtype) if isinstance(bad, np.ndarray)
                       else [[0, bad[0]]])
            with pytest.raises(kvcache.InvalidArgument) as e:
                call(t, bad)
            assert arg in str(e.value), (bad, str(e.value))
            assert "[%d, %d]" % rng in str(e.value), (bad, str(e.value))
        assert t.state() == before


# ---- outputs: writability checked whatever the type -----------------------------------


class _Interface:
    """Only the array interface of an array (as another library's tensor would)."""

    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):  # DLPack 1.0 (dlpack.h)
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _lib.DLTensor)]


_READ_ONLY, _IS_COPIED = 1, 2
_New = ctypes.pythonapi.PyCapsule_New
_New.restype = ctypes.py_object
_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Producer:
    """A CPU float32 DLPack producer over an array's memory: DLPack 1.0
    (versioned capsule, flags) when asked with max_version, 0.x otherwise -
    as NumPy 2 does."""

    def __init__(self, a, flags=0, major=1):
        self.a = a
        self._shape = (ctypes.c_int64 * a.ndim)(*a.shape)
        self._strides = (ctypes.c_int64 * a.ndim)(*[s // a.itemsize for s in a.strides])
        t = _lib.DLTensor()
        t.data = a.__array_interface__["data"][0]
        t.device = _lib.DLDevice(1, 0)
        t.ndim = a.ndim
        t.dtype = _lib.DLDataType(2, 32, 1)
        t.shape = ctypes.cast(self._shape, _lib.c_i64p)
        t.strides = ctypes.cast(self._strides, _lib.c_i64p)
        self.v = _DLManagedTensorVersioned()
        self.v.version = _DLPackVersion(major, 0)
        self.v.flags = flags
        self.v.dl_tensor = t
        self.m = _lib.DLManagedTensor()
        self.m.dl_tensor = t
        self.asked = []

    def __dlpack__(self, stream=None, max_version=None):
        self.asked.append(max_version)
        if max_version is not None and max_version[0] >= 1:
            return _New(ctypes.addressof(self.v), b"dltensor_versioned", None)
        return _New(ctypes.addressof(self.m), b"dltensor", None)

    def __dlpack_device__(self):
        return (1, 0)


class _LegacyProducer(_Producer):
    """DLPack 0.x only: its capsule cannot say whether the memory is writable."""

    def __dlpack__(self, stream=None):
        return _New(ctypes.addressof(self.m), b"dltensor", None)


def _immutable(shape):
    """A bytes object and a read-only float32 array over its bytes."""
    b = bytes(int(np.prod(shape)) * 4)
    return b, np.frombuffer(b, np.float32).reshape(shape)


def test_read_only_outputs_are_refused_whatever_their_type():
    with kvcache.Cache(small_layout(), max_seqs=4) as c:
        t = Ctx(c)
        shape = (20, 4, 32)
        cases = []
        b, ro = _immutable(shape)
        cases.append(("array interface", b, _Interface(ro)))
        b, ro = _immutable(shape)
        cases.append(("DLPack 1.0 read-only", b, _Producer(ro, flags=_READ_ONLY)))
        b, ro = _immutable(shape)
        cases.append(("DLPack 0.x", b, _LegacyProducer(ro)))
        b, ro = _immutable(shape)
        cases.append(("memoryview of bytes", b, memoryview(b).cast("B").cast("f", shape)))
        for what, b, out in cases:
            for call in (lambda o: c.read(0, t.pg, o, None), lambda o: c.read(0, t.pg, None, o),
                         lambda o: c.read(0, t.pg, t.out, o)):
                with pytest.raises(kvcache.InvalidArgument) as e:
                    call(out)
                assert "read-only" in str(e.value) or "writ" in str(e.value), (what, e.value)
                assert b == bytes(len(b)), what  # the immutable bytes untouched
        # decode's out too
        b, ro = _immutable((1, 4, 32))
        for out in (_Interface(ro), _Producer(ro, flags=_READ_ONLY), _LegacyProducer(ro),
                    memoryview(b).cast("B").cast("f", (1, 4, 32))):
            with pytest.raises(kvcache.InvalidArgument):
                c.decode(0, t.q, t.pg, out)
            assert b == bytes(len(b))


def test_outputs_that_would_be_copies_are_refused():
    with kvcache.Cache(small_layout(), max_seqs=4) as c:
        t = Ctx(c)
        lst = np.zeros((20, 4, 32), np.float32).tolist()
        with pytest.raises(kvcache.InvalidArgument, match="copy|list"):
            c.read(0, t.pg, lst, None)  # the results would go to a temporary
        a = np.zeros((20, 4, 32), np.float32)
        with pytest.raises(kvcache.InvalidArgument, match="cop"):
            c.read(0, t.pg, _Producer(a, flags=_IS_COPIED), None)
        with pytest.raises(kvcache.Unsupported, match="DLPack 2"):
            c.read(0, t.pg, _Producer(a, major=2), None)
        assert not a.any()


def test_writable_outputs_of_every_kind_are_written():
    with kvcache.Cache(small_layout(), max_seqs=4) as c:
        t = Ctx(c)
        want = t.k
        a = np.zeros((20, 4, 32), np.float32)
        c.read(0, t.pg, _Interface(a), None)
        assert np.array_equal(a, want)
        a = np.zeros((20, 4, 32), np.float32)
        p = _Producer(a)
        c.read(0, t.pg, p, None)
        assert np.array_equal(a, want) and p.asked == [(1, 0)]
        ba = bytearray(20 * 4 * 32 * 4)
        c.read(0, t.pg, memoryview(ba).cast("f", (20, 4, 32)), None)
        assert np.array_equal(np.frombuffer(ba, np.float32).reshape(20, 4, 32), want)
        # a View of another cache's memory, as an output
        with kvcache.Cache(small_layout(num_blocks=8, block_tokens=20), max_seqs=1) as d:
            blk = d.kv(0, 0).select(0, 5)
            c.read(0, t.pg, blk, None)
            assert np.array_equal(blk.numpy(), want)


def test_read_only_inputs_are_still_taken():
    with kvcache.Cache(small_layout(), max_seqs=4) as c:
        t = Ctx(c)
        src = np.arange(20 * 4 * 32, dtype=np.float32).reshape(20, 4, 32) * 3
        ro = src.copy()
        ro.flags.writeable = False
        b = src.tobytes()
        for k in (ro, _Interface(ro), _Producer(ro, flags=_READ_ONLY), _LegacyProducer(ro),
                  memoryview(b).cast("B").cast("f", (20, 4, 32))):
            c.write(1, k, k, t.slots)
            out = np.zeros_like(src)
            c.read(1, t.pg, out, None)
            assert np.array_equal(out, src), type(k)
            c.write(1, t.k, t.k, t.slots)


# ---- lifetime: a View keeps its cache alive ----------------------------------------------


def test_view_numpy_after_close_is_the_live_arena():
    """Before: View.numpy() after close() gave an array over the freed arena
    (a SIGSEGV on the first write, the arena being unmapped)."""
    out = run_isolated("""
        lay = kvcache.Layout(num_layers=2, num_blocks=512, block_tokens=16, num_heads=4,
                             head_dim=32, dtype="f32")  # 16 MiB: unmapped when freed
        c = kvcache.Cache(lay, max_seqs=2)
        v = c.kv(1, 0)
        blk = v.select(0, 300)
        c.close()
        a = v.numpy()
        with kvcache.Cache(lay, max_seqs=2) as c4:  # a C kernel reads it (ASan sees that)
            s = c4.seq_create()
            c4.append(s, range(16))
            c4.write(1, a[300], a[301], [c4.slot(s, t) for t in range(16)])
        a[300:] = 1.5  # NumPy writes it (SIGSEGV on an unmapped arena)
        assert (blk.numpy() == 1.5).all()
        d = np.from_dlpack(blk.narrow(1, 2, 2))
        assert d.shape == (16, 2, 32) and (d == 1.5).all()
        # the with-block form, and the kernels on the outliving view's memory
        with kvcache.Cache(lay, max_seqs=2) as c2:
            w = c2.kv(0, 1).select(0, 7)
        del c2
        gc.collect()
        w.numpy()[...] = 2.5
        with kvcache.Cache(lay, max_seqs=2) as c3:
            s = c3.seq_create()
            c3.append(s, range(16))
            c3.write(0, w, w, [c3.slot(s, t) for t in range(16)])
            back = np.zeros((16, 4, 32), np.float32)
            c3.read(0, c3.pages([s]), back, None)
            assert (back == 2.5).all()
        del v, blk, a, d, w
        gc.collect()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_views_release_their_reference(monkeypatch):
    """The reference a View (and an array from View.numpy()) holds is dropped
    with the last of them: no cache outlives its holders."""
    n = {"retain": 0, "destroy": 0}
    real_retain, real_destroy = L.kv_cache_retain, L.kv_cache_destroy

    def retain(h):
        n["retain"] += 1
        return real_retain(h)

    def destroy(h):
        n["destroy"] += 1
        real_destroy(h)

    monkeypatch.setattr(L, "kv_cache_retain", retain)
    monkeypatch.setattr(L, "kv_cache_destroy", destroy)
    c = kvcache.Cache(small_layout(), max_seqs=2)
    v = c.kv(0, 0)
    b = v.select(0, 3).narrow(1, 1, 2)
    a = b.numpy()
    ar = c.arena()
    c.close()
    a[...] = 1.0
    assert (v.numpy()[3, :, 1:3] == 1.0).all() and ar.size == c.layout.total_bytes
    del v, b, a, ar
    import gc
    gc.collect()
    # the creator's reference (close) and every one taken since, all dropped
    assert n["destroy"] == n["retain"] + 1 and n["retain"] >= 1, n


# ---- Cache.close() against calls in flight --------------------------------------------------

_GATE = """
    L = _lib.lib
    lay = kvcache.Layout(num_layers=2, num_blocks=512, block_tokens=16, num_heads=4,
                         head_dim=32, dtype="f32")
    c = kvcache.Cache(lay, max_seqs=2)
    s = c.seq_create()
    c.append(s, range(40))
    c.write(0, np.ones((40, 4, 32), np.float32), np.ones((40, 4, 32), np.float32),
            [c.slot(s, t) for t in range(40)])
    # no View is held: one would keep the arena alive past close()
    b0, b1 = [int(b) for b in c.seq_blocks(s)[:2]]  # full blocks of ones
    entered, proceed = threading.Event(), threading.Event()
    real = L.kv_attn_copy_blocks

    def gated(*args):  # the kernel's call, held at its start until told to go on
        entered.set()
        proceed.wait(30)
        return real(*args)

    L.kv_attn_copy_blocks = gated
    result = {}

    def kernel():
        try:
            c.copy_blocks([[b0, 300], [b1, 301]])
            result["kernel"] = "ok"
        except Exception as e:
            result["kernel"] = repr(e)

    kt = threading.Thread(target=kernel)
    kt.start()
    assert entered.wait(30)
"""


def test_close_waits_for_a_kernel_in_flight():
    """Before: close() freed the arena under the running kernel (a SIGSEGV
    or an ASan heap-use-after-free once the gate opened)."""
    out = run_isolated(_GATE + """
    def closer():
        c.close()
        result["closed_at"] = time.monotonic()

    ct = threading.Thread(target=closer)
    ct.start()
    time.sleep(0.3)
    waited = ct.is_alive()       # close() is waiting for the kernel
    # a new call meanwhile is refused: the cache is closing
    try:
        c.seq_len(s)
        result["new call"] = "ran"
    except kvcache.BadState as e:
        result["new call"] = str(e)
    released = time.monotonic()
    proceed.set()
    kt.join(30)
    ct.join(30)
    assert result["kernel"] == "ok", result
    assert waited and result["closed_at"] >= released, result
    assert "clos" in result["new call"], result
    for call in (lambda: c.seq_len(s), lambda: c.copy_blocks([[0, 1]]), lambda: c.kv(0, 0)):
        try:
            call()
            raise SystemExit("a call after close ran")
        except kvcache.BadState as e:
            assert "closed" in str(e)
    print("ok")
    """)
    assert out.strip() == "ok"


def test_close_with_a_timeout_leaves_the_cache_open():
    out = run_isolated(_GATE + """
    try:
        c.close(timeout=0.2)
        raise SystemExit("close returned with a kernel in flight")
    except kvcache.Timeout as e:
        assert "in flight" in str(e), e
    proceed.set()
    kt.join(30)
    assert result["kernel"] == "ok", result
    assert c.seq_len(s) == 40     # still open, still working
    c.close()
    try:
        c.seq_len(s)
        raise SystemExit("ran after close")
    except kvcache.BadState:
        pass
    print("ok")
    """)
    assert out.strip() == "ok"


def test_close_races_real_kernels_on_other_threads():
    """No gate: threads run kernels and page-table calls back to back while
    the main thread closes. Each call either completes or raises BadState;
    none runs on freed memory."""
    out = run_isolated("""
        lay = kvcache.Layout(num_layers=2, num_blocks=512, block_tokens=16, num_heads=8,
                             head_dim=64, dtype="f32")
        for rnd in range(6):
            c = kvcache.Cache(lay, max_seqs=8)
            seqs = []
            for i in range(4):
                s = c.seq_create()
                c.append(s, range(1000 * i, 1000 * i + 700))
                seqs.append(s)
            pg = c.pages(seqs)
            T = pg.n_tokens
            q = np.ones((4, 8, 64), np.float32)
            errors, started = [], threading.Barrier(4)

            def work(kind):
                out = np.zeros((4, 8, 64), np.float32)
                kbuf = np.zeros((T, 8, 64), np.float32)
                started.wait()
                try:
                    while True:
                        if kind == 0:
                            c.decode(1, q, pg, out)
                        elif kind == 1:
                            c.read(0, pg, kbuf, None)
                        else:
                            c.copy_blocks([[b, b + 1] for b in range(200, 400, 2)])
                            c.seq_len(seqs[0])
                except kvcache.BadState:
                    pass
                except Exception as e:
                    errors.append(repr(e))

            ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
            for t in ts:
                t.start()
            started.wait()
            time.sleep(0.02 * (rnd + 1))
            c.close()
            for t in ts:
                t.join(60)
            assert not errors, errors
            assert not any(t.is_alive() for t in ts)
        print("ok")
    """, timeout=300)
    assert out.strip() == "ok"


def test_every_method_raises_once_closed():
    c = kvcache.Cache(small_layout(), max_seqs=4)
    t = Ctx(c)
    assert not c.closed
    c.close()
    c.close()  # idempotent
    assert c.closed
    calls = [lambda: c.seq_create(), lambda: c.reuse_prefix(t.s, [1]),
             lambda: c.append(t.s, [1]), lambda: c.blocks_needed(t.s, 1),
             lambda: c.fork(t.s), lambda: c.truncate(t.s, 0), lambda: c.free(t.s),
             lambda: c.seq_len(t.s), lambda: c.seq_blocks(t.s), lambda: c.slot(t.s, 0),
             lambda: c.take_copies(), lambda: c.copies_done(), lambda: c.export_vllm([t.s]),
             lambda: c.export_flashinfer([t.s]), lambda: c.pool_stats(),
             lambda: c.table_stats(), lambda: c.ref_count(0), lambda: c.pages([t.s]),
             lambda: c.write(0, t.k, t.k, t.slots), lambda: c.read(0, t.pg, t.out, None),
             lambda: c.copy_blocks([[0, 1]]), lambda: c.decode(0, t.q, t.pg, t.o),
             lambda: c.decode_mla(0, t.q, t.pg, t.o),
             lambda: c.prefill(0, t.q, [0, 1], t.pg, t.o),
             lambda: c.prefill_mla(0, t.q, [0, 1], t.pg, t.o),
             lambda: c.pack(t.blocks, 20), lambda: c.unpack(t.buf, t.blocks),
             lambda: c.arena(), lambda: c.kv(0, 0)]
    public = {n for n in dir(kvcache.Cache) if not n.startswith("_") and
              callable(getattr(kvcache.Cache, n))} - {"close"}
    assert len(calls) == len(public), sorted(public)
    for call in calls:
        with pytest.raises(kvcache.BadState, match="closed"):
            call()


# ---- index arrays C reads through typed pointers: aligned --------------------------


def _unaligned(values, dtype):
    """A C-contiguous array of values one byte past an aligned address (a
    np.frombuffer at an odd offset: NumPy allows it, C's int64_t * does not)."""
    dt = np.dtype(dtype)
    a = np.frombuffer(bytearray(len(values) * dt.itemsize + 1), dt, len(values), 1)
    a[:] = values
    assert a.flags.c_contiguous and not a.flags.aligned
    return a


def _addr(p):
    return ctypes.cast(p, ctypes.c_void_p).value


class _PointerSpy:
    """The library, with the pointer arguments of some functions recorded."""

    def __init__(self, lib, names):
        self._lib, self._names, self.seen = lib, names, []

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if name not in self._names:
            return fn

        def call(*args):
            self.seen += [(name, _addr(a)) for a in args if isinstance(a, ctypes._Pointer)]
            return fn(*args)
        return call


def test_unaligned_index_arrays_reach_c_aligned(monkeypatch):
    """An unaligned int64 slot_mapping, int32 page table or uint32 block list
    went to C as it was: UBSan's "load of misaligned address" in
    kv_attn_check.c; now they are copied to aligned memory first."""
    with kvcache.Cache(small_layout(), max_seqs=2) as c:
        s = c.seq_create()
        c.append(s, np.arange(20))
        k = np.arange(20 * 4 * 32, dtype=np.float32).reshape(20, 4, 32)
        slots = [c.slot(s, t) for t in range(20)]
        spy = _PointerSpy(L, {"kv_attn_write", "kv_attn_write_i32", "kv_pack"})
        monkeypatch.setattr(kvcache.cache, "L", spy)
        for dt in (np.int64, np.int32):
            c.write(0, k, -k, _unaligned(slots, dt))
        blocks = [int(b) for b in c.seq_blocks(s)]
        assert np.array_equal(c.pack(_unaligned(blocks, np.uint32), 20), c.pack(blocks, 20))
        monkeypatch.undo()
        assert len(spy.seen) == 4 and all(a % 4 == 0 for _, a in spy.seen), spy.seen
        assert spy.seen[0][1] % 8 == 0
        want = c.pages([s])
        got = kvcache.Pages.from_csr(c, _unaligned(want.indptr, np.int32),
                                     _unaligned(want.indices, np.int32),
                                     _unaligned(want.last_page_len, np.int32))
        bt, _, sl = c.export_vllm([s], with_seq_lens=True)
        got_bt = kvcache.Pages.from_block_table(
            c, _unaligned(bt.ravel(), np.int32).reshape(bt.shape), _unaligned(sl, np.int64))
        for p in (got, got_bt):
            pc = p._c
            for f, n in (("indptr", 4), ("indices", 4), ("last_page_len", 4),
                         ("block_table", 4), ("seq_lens", 8)):
                assert (_addr(getattr(pc, f)) or 0) % n == 0, f
            out = np.zeros((20, 4, 32), np.float32)
            c.read(0, p, out, None)
            assert np.array_equal(out, k)


def test_pages_hold_what_the_kernels_read_when_attributes_are_rebound():
    """Rebinding a Pages' public array (p.indptr = ...) freed the array its C
    struct pointed at: the next kernel read freed memory (Corrupt naming
    recycled values, or another sequence's pages)."""
    import gc
    import weakref
    with kvcache.Cache(small_layout(), max_seqs=2) as c:
        s = c.seq_create()
        c.append(s, np.arange(20))
        k = np.arange(20 * 4 * 32, dtype=np.float32).reshape(20, 4, 32)
        c.write(0, k, -k, [c.slot(s, t) for t in range(20)])
        ref = c.pages([s])
        for p in (c.pages([s]),  # arrays of its own
                  kvcache.Pages.from_csr(c, ref.indptr.astype(np.int64), ref.indices.astype(
                      np.int64), ref.last_page_len.astype(np.int64))):  # converted once
            gone = [weakref.ref(p.indptr), weakref.ref(p.last_page_len)]
            p.indptr, p.last_page_len = p.indptr.copy(), p.last_page_len.copy()
            gc.collect()
            junk = [np.full(n, 10**9, np.int32) for n in (2, 1) for _ in range(64)]
            assert all(w() is not None for w in gone)
            out = np.zeros((20, 4, 32), np.float32)
            c.read(0, p, out, None)
            assert np.array_equal(out, k)
            del junk


def test_wrong_argument_types_are_named_errors():
    """A caller's wrong type is InvalidArgument naming the argument: not an
    AttributeError / TypeError from inside the package, nor an int made into
    that many zero bytes, nor a dtype name cut at a NUL by C."""
    from kvcache import transport as T
    lay = small_layout()
    with kvcache.Cache(lay, max_seqs=2) as c:
        buf = c.pack([0], 16)
        cases = [
            ("layout", lambda: kvcache.Cache(None)),
            ("dtype", lambda: small_layout(dtype=None)),
            ("dtype", lambda: small_layout(dtype="f32\0junk")),
            ("order", lambda: small_layout(order=["NHD"])),
            ("heads", lambda: kvcache.Plan(lay, lay, heads=5)),
            ("layers", lambda: c.pack([0], 16, layers=2)),
            ("heads", lambda: c.unpack(buf, [0], heads=0)),
            ("buf", lambda: c.unpack(list(buf), [0])),
            ("buf", lambda: c.unpack("KVPACK", [0])),
            ("note data", lambda: kvcache.LayerRx().feed(T.Note(1, T.XLAYER_TAG, 32))),
            ("note data", lambda: kvcache.LayerRx().feed(T.Note(1, T.XLAYER_TAG, "x" * 32))),
        ]
        for name, call in cases:
            with pytest.raises(kvcache.InvalidArgument, match=name):
                call()


def test_scalars_names_and_sizes_of_the_wrong_kind_are_named_errors():
    """The rest of the audit's list: a string as a scale or soft cap (was
    ValueError from float(), or parsed by NumPy), a list as a plane, a
    transport kind or a status name (was TypeError: unhashable), a
    slot_mapping_len NumPy cannot allocate (was its ValueError), and
    big-endian integers as a PagedCache's raw bits (accepted: the kernels
    read them as little-endian words)."""
    from kvcache import transport as T
    lay = small_layout()
    with kvcache.Cache(lay, max_seqs=2) as c:
        s = c.seq_create()
        c.append(s, np.arange(5))
        p = c.pages([s])
        q = np.ones((1, 4, 32), np.float32)
        out = np.zeros((1, 4, 32), np.float32)
        cases = [
            ("softmax_scale", lambda: c.decode(0, q, p, out, scale="0.5")),
            ("soft_cap", lambda: c.decode(0, q, p, out, soft_cap="x")),
            ("k_scales", lambda: c.decode(0, q, p, out, scales=("2.0", 1.0))),
            ("v_scales", lambda: c.decode(0, q, p, out, scales=(1.0, object()))),
            ("planes", lambda: c.copy_blocks([(0, 1)], planes=["k"])),
            ("kind", lambda: kvcache.Transport(7, kind=["tcp"])),
            ("why", lambda: kvcache.LayerRx().fail(1, ["x"])),
        ]
        for name, call in cases:
            with pytest.raises(kvcache.InvalidArgument, match=name):
                call()
        assert np.all(out == 0)
        with pytest.raises(kvcache.NoMemory, match="slot_mapping"):
            c.export_vllm([s], [(0, 5)], slot_mapping_len=2**63)
        bt, sm = c.export_vllm([s], [(0, 5)], slot_mapping_len=8)  # padded, still fine
        assert sm.size == 8
    big = np.zeros(lay.total_bytes // 4, ">u4")
    with pytest.raises(kvcache.Mismatch, match=">u4"):
        kvcache.PagedCache(lay, big)
    kvcache.PagedCache(lay, big.astype("<u4"))  # the machine's order: raw bits
