"""tests/python/test_byo.py - the kernels on memory and page tables an engine
owns (issue 20 points 1 and 2): kvcache.PagedCache over vLLM-shaped
key_cache / value_cache storage allocated by NumPy (and torch where it is
importable), Pages.from_block_table / Pages.from_csr over the engine's own
int32 and int64 arrays, and fp8 across the boundary (uint8 as raw fp8 in and
out, View.as_bytes()).

Every write is checked against the whole pool predicted byte by byte from
the layout formula (untouched bytes byte-identical, the bytes past the
layout too); every read and decode against a float64 NumPy reference and
against the same calls on a kvcache-owned Cache holding the same bytes.
Every refusal is checked with its message, and checked to change nothing.
Run by `make test`; a second or so."""
import ctypes
import gc
import os

import numpy as np
import pytest

import kvcache
from kvcache import _lib

N, H, D, B = 8, 2, 16, 300
LENS = [37, 0, 16, 1]  # a long one, an empty one, one ending on a block edge, one token


def vllm_layout(**kw):
    args = dict(num_layers=2, num_blocks=B, block_tokens=N, num_heads=H, head_dim=D,
                dtype="f16")
    args.update(kw)
    return kvcache.Layout(**args)


def engine_tables(rng, lens=LENS, pad=-5):
    """The engine's page table for sequences of lens tokens: a block table
    over ids far from 0 (rows padded with an id no kernel may read), its
    CSR form, and the slot mapping of every token, sequence after sequence,
    with -1 padding entries between sequences."""
    ids = iter(rng.permutation(np.arange(150, B)))
    cols = max((n + N - 1) // N for n in lens) + 2
    bt = np.full((len(lens), cols), pad, np.int32)
    for s, n in enumerate(lens):
        for j in range((n + N - 1) // N):
            bt[s, j] = next(ids)
    npages = [(n + N - 1) // N for n in lens]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = np.concatenate([bt[s, :npages[s]] for s in range(len(lens))]).astype(np.int32)
    last = np.array([(n - 1) % N + 1 if n else 0 for n in lens], np.int32)
    slots, owner = [], []  # owner: (seq, token) of each slot entry, None for padding
    for s, n in enumerate(lens):
        for t in range(n):
            slots.append(int(bt[s, t // N]) * N + t % N)
            owner.append((s, t))
        slots.append(-1)
        owner.append(None)
    return bt, np.array(lens, np.int64), indptr, indices, last, np.array(slots, np.int64), owner


def layout_strides(lay, pad=0):
    """Byte strides (layer, kv, block, token, head, dim) of a layer-major
    layout, by the formula of docs/kv-layout.md, not by the library."""
    es = np.dtype(np.float16).itemsize if lay.dtype in ("f16", "bf16") else \
        np.dtype(np.float32).itemsize if lay.dtype == "f32" else 1
    blk = (N * H * D + pad) * es
    inner = (D * es, N * D * es) if lay.order == "HND" else (H * D * es, D * es)
    return (2 * B * blk, B * blk, blk, inner[0], inner[1], es)


def typed(mem_bytes, lay, dtype, pad=0):
    """[L][2][B][N][H][D] over the bytes by the formula."""
    st = layout_strides(lay, pad)
    assert st == tuple(lay.strides_bytes()[k] for k in
                       ("layer", "kv", "block", "token", "head", "dim"))
    return np.ndarray((lay.num_layers, 2, B, N, H, D), dtype, buffer=mem_bytes, strides=st)


def expected_pool(before, lay, dtype, layer, k, v, slots, pad=0):
    """The pool after a write: every non-padding slot's K and V rows, every
    other byte as before."""
    want = before.copy()
    t = typed(want, lay, dtype, pad)
    keep = slots >= 0
    sl = slots[keep]
    t[layer, 0, sl // N, sl % N] = np.asarray(k)[keep]
    t[layer, 1, sl // N, sl % N] = np.asarray(v)[keep]
    return want


def decode_ref(q, ks, vs, scale):
    """float64 paged decode: ks[s], vs[s] [n][H][D]; Hq = g * H."""
    S, Hq, _ = q.shape
    g = Hq // H
    out = np.zeros((S, Hq, D))
    for s in range(S):
        if len(ks[s]) == 0:
            continue
        for i in range(Hq):
            lg = ks[s][:, i // g].astype(np.float64) @ q[s, i].astype(np.float64) * scale
            p = np.exp(lg - lg.max())
            out[s, i] = (p / p.sum()) @ vs[s][:, i // g].astype(np.float64)
    return out


def seq_rows(x, owner, s, n):
    """Rows of x (per slot entry) holding sequence s's tokens 0..n-1."""
    idx = {o: i for i, o in enumerate(owner) if o is not None}
    return np.asarray(x)[[idx[(s, t)] for t in range(n)]]


def as_bytes(a):
    return np.ascontiguousarray(a).view(np.uint8)


# ---- the vLLM shape: key_cache / value_cache in one NumPy allocation ---------------


@pytest.mark.parametrize("slot_dtype", [np.int64, np.int32])
def test_vllm_shaped_numpy_memory_against_references_and_an_owned_cache(slot_dtype):
    rng = np.random.default_rng(1)
    lay = vllm_layout()
    kv_cache = np.zeros((2, 2, B, N, H, D), np.float16)  # [L][2][B][N][H][D]
    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]  # vLLM's unbind
    pc = kvcache.PagedCache(lay, kv_cache)
    own = kvcache.Cache(lay, max_seqs=2, zero_fill=True)
    bt, sl, indptr, indices, last, slots, owner = engine_tables(rng)
    T = len(slots)
    qkv = rng.standard_normal((T, 3, H, D)).astype(np.float16)  # K, V: fused-QKV slices
    for layer in (1, 0):
        before = kv_cache.view(np.uint8).copy()
        k, v = qkv[:, 1] + layer, qkv[:, 2] - layer
        pc.write(layer, k, v, slots.astype(slot_dtype))
        own.write(layer, k, v, slots.astype(slot_dtype))
        want = expected_pool(before.reshape(-1), lay, np.float16, layer, k, v, slots)
        assert np.array_equal(kv_cache.view(np.uint8).reshape(-1), want), "pool after write"
    assert np.array_equal(own.arena(), kv_cache.view(np.uint8).reshape(-1)), "same bytes"
    # vLLM's own tensors see the kernel's writes
    s0 = slots[5]
    assert np.array_equal(key_cache[0, s0 // N, s0 % N], qkv[5, 1])
    assert np.array_equal(value_cache[1, s0 // N, s0 % N], qkv[5, 2] - 1)

    total = sum(LENS)
    pages = [kvcache.Pages.from_block_table(lay, bt, sl),
             kvcache.Pages.from_block_table(lay, bt, sl.astype(np.int32)),  # vLLM's seq_lens
             kvcache.Pages.from_csr(lay, indptr, indices, last),
             kvcache.Pages.from_csr(lay, indptr.astype(np.int64), indices.astype(np.int64),
                                    last.astype(np.int64))]
    q = rng.standard_normal((len(LENS), 2 * H, D)).astype(np.float32)  # Hq = 2 H
    for pg in pages:
        assert pg.seq_tokens() == LENS and pg.n_tokens == total
        for layer in (0, 1):
            k_ref = np.concatenate([seq_rows(qkv[:, 1] + layer, owner, s, n)
                                    for s, n in enumerate(LENS)])
            v_ref = np.concatenate([seq_rows(qkv[:, 2] - layer, owner, s, n)
                                    for s, n in enumerate(LENS)])
            # outputs with a padded head stride, NaN around what is written
            kbuf = np.full((total, H + 1, D), np.nan, np.float32)
            vbuf = np.full((total, H + 1, D), np.nan, np.float32)
            pc.read(layer, pg, kbuf[:, 1:], vbuf[:, :H])
            assert np.array_equal(kbuf[:, 1:], k_ref.astype(np.float32))
            assert np.array_equal(vbuf[:, :H], v_ref.astype(np.float32))
            assert np.isnan(kbuf[:, 0]).all() and np.isnan(vbuf[:, H]).all()
            k2 = np.empty((total, H, D), np.float32)
            own.read(layer, pg, k2, None)
            assert np.array_equal(k2, kbuf[:, 1:])

            out = np.full((len(LENS), 2 * H, D), np.nan, np.float32)
            pc.decode(layer, q, pg, out)
            ks = [seq_rows(qkv[:, 1] + layer, owner, s, n) for s, n in enumerate(LENS)]
            vs = [seq_rows(qkv[:, 2] - layer, owner, s, n) for s, n in enumerate(LENS)]
            ref = decode_ref(q, ks, vs, 1 / np.sqrt(D))
            assert np.allclose(out, ref, rtol=1e-5, atol=2e-6)
            out2 = np.empty_like(out)
            own.decode(layer, q, pg, out2)
            assert np.array_equal(out, out2), "the same kernel on the same bytes"
    own.close()


def test_padded_hnd_raw_byte_memory_with_bytes_past_the_layout():
    rng = np.random.default_rng(2)
    pad = 24
    lay = vllm_layout(order="HND", block_pad_elems=pad, dtype="f32", num_layers=1)
    assert lay.total_bytes == 2 * B * (N * H * D + pad) * 4
    mem = rng.integers(0, 256, lay.total_bytes + 64, dtype=np.uint8)  # raw bytes, and 64 more
    pc = kvcache.PagedCache(lay, mem)
    bt, sl, indptr, indices, last, slots, owner = engine_tables(rng)
    k = rng.standard_normal((len(slots), H, D)).astype(np.float32)
    v = rng.standard_normal((len(slots), H, D)).astype(np.float32)
    before = mem.copy()
    pc.write(None, k[None], v[None], slots.astype(np.int32))  # every layer: [L][T][H][D]
    want = before.copy()
    want[:lay.total_bytes] = expected_pool(before[:lay.total_bytes], lay, np.float32, 0, k, v,
                                           slots, pad)
    assert np.array_equal(mem, want)
    pg = kvcache.Pages.from_csr(lay, indptr, indices, last)
    kout = np.empty((1, sum(LENS), H, D), np.float32)
    pc.read(None, pg, kout, None)
    assert np.array_equal(kout[0], np.concatenate([seq_rows(k, owner, s, n)
                                                   for s, n in enumerate(LENS)]))


def test_page_ratio_and_a_cache_as_the_layout():
    rng = np.random.default_rng(3)
    lay = vllm_layout(num_layers=1, dtype="f32")
    mem = np.zeros((2, B, N, H, D), np.float32)
    pc = kvcache.PagedCache(lay, mem)
    k = rng.standard_normal((B * N, H, D)).astype(np.float32)
    pc.write(0, k, k, np.arange(B * N))
    # pages of N/2 tokens: page p is slots p*4 .. p*4+3
    pg = kvcache.Pages.from_block_table(pc, np.array([[599, 1, 400]], np.int32), [10],
                                        page_ratio=2)
    assert pg.page_tokens == 4
    out = np.empty((10, H, D), np.float32)
    pc.read(0, pg, out, None)
    want = np.concatenate([k[599 * 4:600 * 4], k[4:8], k[1600:1602]])
    assert np.array_equal(out, want)
    with kvcache.Cache(lay, max_seqs=2, page_ratio=2) as c:
        assert kvcache.Pages.from_csr(c, [0, 1], [599], [4]).page_tokens == 4  # the cache's r


# ---- torch: the engine's tensors, int32 tables ---------------------------------


def test_vllm_shaped_torch_memory_bf16():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    lay = vllm_layout(dtype="bf16", num_layers=1)
    kv_cache = torch.zeros(2, B, N, H, D, dtype=torch.bfloat16)
    key_cache, value_cache = kv_cache.unbind(0)
    pc = kvcache.PagedCache(lay, kv_cache)
    own = kvcache.Cache(lay, max_seqs=2, zero_fill=True)
    bt, sl, indptr, indices, last, slots, owner = engine_tables(rng)
    k = torch.from_numpy(rng.standard_normal((len(slots), H, D)).astype(np.float32)).bfloat16()
    v = torch.from_numpy(rng.standard_normal((len(slots), H, D)).astype(np.float32)).bfloat16()
    sm = torch.from_numpy(slots)
    pc.write(0, k, v, sm)
    own.write(0, k, v, sm)
    raw = kv_cache.view(torch.int16).numpy().view(np.uint8).reshape(-1)
    assert np.array_equal(own.arena(), raw)
    keep = slots >= 0
    ss = torch.from_numpy(slots[keep])
    assert torch.equal(key_cache[ss // N, ss % N], k[torch.from_numpy(keep)])
    assert torch.equal(value_cache[ss // N, ss % N], v[torch.from_numpy(keep)])
    pages = [kvcache.Pages.from_block_table(lay, torch.from_numpy(bt),
                                            torch.from_numpy(sl).int()),
             kvcache.Pages.from_csr(lay, torch.from_numpy(indptr), torch.from_numpy(indices),
                                    torch.from_numpy(last))]
    q = torch.randn(len(LENS), 2 * H, D, dtype=torch.float32)
    kf, vf = k.float().numpy(), v.float().numpy()
    ks = [seq_rows(kf, owner, s, n) for s, n in enumerate(LENS)]
    vs = [seq_rows(vf, owner, s, n) for s, n in enumerate(LENS)]
    ref = decode_ref(q.numpy(), ks, vs, 1 / np.sqrt(D))
    for pg in pages:
        out = torch.empty(len(LENS), 2 * H, D)
        pc.decode(0, q, pg, out)
        assert np.allclose(out.numpy(), ref, rtol=1e-5, atol=2e-6)
        out2 = torch.empty_like(out)
        own.decode(0, q, pg, out2)
        assert torch.equal(out, out2)
        kout = torch.empty(sum(LENS), H, D, dtype=torch.bfloat16)
        pc.read(0, pg, kout, None)
        assert torch.equal(kout.float(), torch.from_numpy(np.concatenate(ks)))
    own.close()


def test_torch_int32_block_table_is_read_in_place():
    torch = pytest.importorskip("torch")
    lay = vllm_layout(num_layers=1, dtype="f32")
    mem = torch.zeros(2, B, N, H, D)
    pc = kvcache.PagedCache(lay, mem)
    mem[0, 250, 0] = 1.0
    mem[0, 260, 0] = 2.0
    table = torch.tensor([[250]], dtype=torch.int32)
    pg = kvcache.Pages.from_block_table(lay, table, torch.tensor([1]))
    out = torch.empty(1, H, D)
    pc.read(0, pg, out, None)
    assert (out == 1.0).all()
    table[0, 0] = 260  # the engine rewrites its table: the next call reads it
    pc.read(0, pg, out, None)
    assert (out == 2.0).all()


# ---- lifetime: the objects hold what they were built from --------------------------


def test_paged_cache_and_pages_hold_their_arrays():
    lay = vllm_layout(num_layers=1, dtype="f32")
    pc = kvcache.PagedCache(lay, np.full((2, B, N, H, D), 3.0, np.float32))
    pg = kvcache.Pages.from_csr(lay, np.array([0, 1], np.int32), np.array([299], np.int32),
                                np.array([2], np.int32))
    pg64 = kvcache.Pages.from_csr(lay, np.array([0, 1]), np.array([298]), np.array([2]))
    gc.collect()  # nothing but pc and the Pages hold the arrays now
    out = np.zeros((2, H, D), np.float32)
    pc.read(0, pg, out, None)
    assert (out == 3.0).all()
    pc.memory[0, 298, 1] = 4.0
    pc.read(0, pg64, out, None)
    assert (out[0] == 3.0).all() and (out[1] == 4.0).all()


def test_int32_arrays_in_place_int64_converted_once():
    lay = vllm_layout(num_layers=1, dtype="f32")
    mem = np.zeros((2, B, N, H, D), np.float32)
    mem[0, 200:300, :, :, :] = np.arange(200, 300, dtype=np.float32)[:, None, None, None]
    pc = kvcache.PagedCache(lay, mem)
    ind32, ind64 = np.array([200], np.int32), np.array([200], np.int64)
    p32 = kvcache.Pages.from_csr(lay, [0, 1], ind32, [1])
    p64 = kvcache.Pages.from_csr(lay, [0, 1], ind64, [1])
    assert p32.indices is ind32 and p64.indices is not ind64
    ind32[0] = ind64[0] = 290
    out = np.zeros((1, H, D), np.float32)
    pc.read(0, p32, out, None)
    assert (out == 290).all()
    pc.read(0, p64, out, None)
    assert (out == 200).all()
    ind32[0] = B  # out of range now: the kernel's own check, every call
    with pytest.raises(kvcache.OutOfBounds) as e:
        pc.read(0, p32, out, None)
    assert "is 300, outside [0, 300)" in e.value.message and (out == 200).all()


# ---- the kernels are Cache's: copies, swap, pack / unpack ----------------------------


def test_kernel_methods_are_caches_own():
    kernels = set()
    for name, f in vars(kvcache.Cache).items():
        fn = getattr(f, "__func__", f)
        code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
        if code is not None and "_paged" in code.co_names and name != "_paged":
            kernels.add(name)
            assert vars(kvcache.PagedCache).get(name) is f, \
                "Cache.%s is a kernel: PagedCache must share it" % name
    # decode and prefill reach _paged through _attend, which they share
    # copy_blocks reaches it through _copy_blocks (after holding its src open)
    assert kernels >= {"write", "read", "_copy_blocks", "_attend", "pack", "unpack"}
    for name in ("decode", "prefill"):
        assert vars(kvcache.PagedCache).get(name) is vars(kvcache.Cache)[name], name


def test_copy_blocks_swap_and_pack_between_engine_memory_and_a_cache():
    rng = np.random.default_rng(5)
    lay = vllm_layout(dtype="f32")
    mem = rng.standard_normal((2, 2, B, N, H, D)).astype(np.float32)
    pc = kvcache.PagedCache(lay, mem)
    before = mem.copy()
    pc.copy_blocks([[290, 160], [10, 299]], layers=1, planes="v")
    want = before.copy()
    want[1, 1, 160], want[1, 1, 299] = before[1, 1, 290], before[1, 1, 10]
    assert np.array_equal(mem, want)
    host_lay = vllm_layout(dtype="f32", num_blocks=40, arrange="block", block_pad_elems=8)
    with kvcache.Cache(host_lay, max_seqs=2, zero_fill=True) as host:
        host.copy_blocks([[299, 39], [160, 3]], src=pc)  # swap out
        for l in range(2):
            for p in range(2):
                got = host.kv(l, p).numpy()
                assert np.array_equal(got[39], mem[l, p, 299])
                assert np.array_equal(got[3], mem[l, p, 160])
                assert not got[[i for i in range(40) if i not in (3, 39)]].any()
        before = mem.copy()
        pc.copy_blocks([[39, 151]], src=host)  # swap in
        want = before.copy()
        want[:, :, 151] = before[:, :, 299]
        assert np.array_equal(mem, want)
        buf = pc.pack([151, 160], 2 * N)
        host.unpack(buf, [5, 6])
        assert np.array_equal(host.kv(0, 1).numpy()[6], mem[0, 1, 160])


# ---- fp8 end to end ------------------------------------------------------------------


def fp8_to_f64(b, fmt):
    """The value of each fp8 byte by the OCP formats (e4m3fn: bias 7, no
    infinities, S.1111.111 NaN; e5m2: bias 15, IEEE-like)."""
    b = np.asarray(b).astype(np.int64)
    E, M, bias = (4, 3, 7) if fmt == "fp8_e4m3" else (5, 2, 15)
    e, m = (b >> M) & ((1 << E) - 1), b & ((1 << M) - 1)
    val = np.where(e == 0, m / 2.0 ** M * 2.0 ** (1 - bias),
                   (1 + m / 2.0 ** M) * 2.0 ** (e - bias))
    val = np.where(b & 0x80, -val, val)
    special = ((e == 15) & (m == 7)) if fmt == "fp8_e4m3" else (e == 31)
    return np.where(special, np.nan, val)


def small_fp8_bytes(rng, shape):
    """Random fp8 bytes of magnitude < 2 in both formats (exponent field
    small), so that logits stay moderate."""
    return (rng.integers(0, 0x38, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_raw_bytes_in_and_out(fmt):
    rng = np.random.default_rng(6)
    lay = vllm_layout(dtype=fmt, num_layers=1)
    mem = np.zeros((2, B, N, H, D), np.uint8)  # vLLM keeps fp8 caches as uint8
    pc = kvcache.PagedCache(lay, mem)
    own = kvcache.Cache(lay, max_seqs=2, zero_fill=True)
    bt, sl, indptr, indices, last, slots, owner = engine_tables(rng)
    k = rng.integers(0, 256, (len(slots), H, D), dtype=np.uint8)  # pre-quantized: any byte
    v = rng.integers(0, 256, (len(slots), H, D), dtype=np.uint8)
    before = mem.copy()
    pc.write(0, k, v, slots)
    own.write(0, k, v, slots)
    want = expected_pool(before.reshape(-1), lay, np.uint8, 0, k, v, slots)
    assert np.array_equal(mem.reshape(-1), want), "bytes as they are, NaN codes included"
    assert np.array_equal(own.arena(), mem.reshape(-1))
    pg = kvcache.Pages.from_block_table(lay, bt, sl)
    kout = np.zeros((sum(LENS), H, D), np.uint8)
    vout = np.zeros((sum(LENS), H + 3, D), np.uint8)[:, 2:2 + H]  # strided raw output
    pc.read(0, pg, kout, vout)
    assert np.array_equal(kout, np.concatenate([seq_rows(k, owner, s, n)
                                                for s, n in enumerate(LENS)]))
    assert np.array_equal(vout, np.concatenate([seq_rows(v, owner, s, n)
                                                for s, n in enumerate(LENS)]))

    # decode over the fp8 cache with fp8 queries (uint8) and fp8 / f32 outputs
    k = small_fp8_bytes(rng, (len(slots), H, D))
    v = small_fp8_bytes(rng, (len(slots), H, D))
    pc.write(0, k, v, slots)
    q = small_fp8_bytes(rng, (len(LENS), 2 * H, D))
    ks = [fp8_to_f64(seq_rows(k, owner, s, n), fmt) for s, n in enumerate(LENS)]
    vs = [fp8_to_f64(seq_rows(v, owner, s, n), fmt) for s, n in enumerate(LENS)]
    ref = decode_ref(fp8_to_f64(q, fmt), ks, vs, 1 / np.sqrt(D))
    out = np.empty((len(LENS), 2 * H, D), np.float32)
    pc.decode(0, q, pg, out)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-6)
    out8 = np.empty(out.shape, np.uint8)
    pc.decode(0, q, pg, out8)  # fp8 out: ref rounded to the format, within half an ulp
    ulp_bits = 3 if fmt == "fp8_e4m3" else 2
    tiny = 2.0 ** (-6 - ulp_bits) if fmt == "fp8_e4m3" else 2.0 ** (-14 - ulp_bits)
    got = fp8_to_f64(out8, fmt)
    assert (np.abs(got - ref) <= np.abs(ref) * 2.0 ** -(ulp_bits + 1) * 1.0001 + tiny).all()
    own.close()


def test_fp8_view_as_bytes_through_dlpack():
    torch = pytest.importorskip("torch")
    lay = vllm_layout(dtype="fp8_e4m3", num_layers=1)
    with kvcache.Cache(lay, max_seqs=2, zero_fill=True) as c:
        kview = c.kv(0, 0)
        with pytest.raises(kvcache.Unsupported) as e:
            torch.from_dlpack(kview)
        assert "fp8_e4m3 has no DLPack 0.6 type" in e.value.message
        assert "View.as_bytes()" in e.value.message
        raw = torch.from_dlpack(kview.as_bytes())  # the cache's bytes, zero-copy
        assert raw.dtype == torch.uint8 and tuple(raw.shape) == (B, N, H, D)
        raw[277, 3] = 0x38  # 1.0 in e4m3, written through torch
        out = np.empty((4, H, D), np.uint8)
        c.read(0, kvcache.Pages.from_csr(lay, [0, 1], [277], [4]), out, None)
        assert (out[3] == 0x38).all() and not out[:3].any()
        # a raw uint8 View of another cache is an fp8 input too (its View unchanged)
        with kvcache.Cache(lay, max_seqs=2, zero_fill=True) as c2:
            src = c.kv(0, 0).as_bytes().select(0, 277).narrow(0, 3, 1)
            c2.write(0, src, np.zeros((1, H, D), np.uint8), [5])
            assert src.dtype == "u8" and (c2.kv(0, 0).numpy()[0, 5] == 0x38).all()


def test_fp8_of_the_other_format_is_refused_by_name():
    # a View of an e5m2 cache is an fp8 tensor that says its format, as a
    # torch.float8_e5m2 tensor does where torch has one
    with kvcache.Cache(vllm_layout(dtype="fp8_e5m2", num_layers=1), max_seqs=2) as other:
        e5 = other.kv(0, 0).select(0, 201).narrow(0, 0, 3)  # [3][H][D] fp8_e5m2
        lay = vllm_layout(dtype="fp8_e4m3", num_layers=1)
        mem = np.zeros((2, B, N, H, D), np.uint8)
        pc = kvcache.PagedCache(lay, mem)
        with pytest.raises(kvcache.Mismatch) as e:
            pc.write(0, np.zeros((3, H, D), np.uint8), e5, [7, 8, 9])
        assert "v: fp8_e5m2 elements, the cache holds fp8_e4m3" in e.value.message
        with pytest.raises(kvcache.Mismatch) as e:
            pc.read(0, kvcache.Pages.from_csr(lay, [0, 1], [250], [3]), e5, None)
        assert "k_out: fp8_e5m2 elements, the cache holds fp8_e4m3" in e.value.message
        assert not mem.any()
        with pytest.raises(kvcache.Mismatch) as e:
            kvcache.PagedCache(vllm_layout(dtype="bf16", num_layers=1),
                               np.zeros(lay.total_bytes, np.float16))
        assert "memory: f16 elements, the layout holds bf16" in e.value.message


def test_as_bytes_of_a_wider_dtype():
    lay = vllm_layout(dtype="f16", num_layers=1)
    with kvcache.Cache(lay, max_seqs=2) as c:
        v = c.kv(0, 1).select(0, 123).narrow(1, 1, 1)  # [N][1][D], strided
        b = v.as_bytes()
        assert b.dtype == "u8" and b.shape == v.shape + (2,)
        assert b.strides == tuple(s * 2 for s in v.strides) + (1,) and b.offset == v.offset * 2
        assert np.array_equal(np.from_dlpack(b), v.numpy().view(np.uint8).reshape(b.shape))


def test_torch_float8_tensors_match_the_cache_format():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch %s has no float8 dtypes" % torch.__version__)
    lay = vllm_layout(dtype="fp8_e4m3", num_layers=1)
    mem = torch.zeros(2, B, N, H, D, dtype=torch.float8_e4m3fn)
    pc = kvcache.PagedCache(lay, mem)
    k = torch.randn(3, H, D).to(torch.float8_e4m3fn)
    pc.write(0, k, k, [2, 1000, 2399])
    assert torch.equal(mem[0].view(torch.uint8).reshape(-1, H, D)[[2, 1000, 2399]],
                       k.view(torch.uint8))
    with pytest.raises(kvcache.Mismatch) as e:
        pc.write(0, k.to(torch.float8_e5m2), k, [3, 4, 5])
    assert "fp8_e5m2 elements, the cache holds fp8_e4m3" in e.value.message
    with pytest.raises(kvcache.Mismatch) as e:
        kvcache.PagedCache(lay, torch.zeros(2, B, N, H, D, dtype=torch.float8_e5m2))
    assert "fp8_e5m2 elements, the layout holds fp8_e4m3" in e.value.message


# ---- refusals, each named, each changing nothing ----------------------------------


class _DLPackOnly:
    """A DLPack producer with no array interface (device and version as asked)."""

    def __init__(self, device_type, data=4096, versioned=False, flags=0, nbytes=1 << 20):
        from kvcache import tensors
        self._shape = (ctypes.c_int64 * 1)(nbytes)
        if versioned:
            self.mt = tensors.DLManagedTensorVersioned()
            self.mt.version = tensors.DLPackVersion(1, 0)
            self.mt.flags = flags
        else:
            self.mt = _lib.DLManagedTensor()
        t = self.mt.dl_tensor
        t.data, t.device, t.ndim = data, _lib.DLDevice(device_type, 0), 1
        t.dtype = _lib.DLDataType(1, 8, 1)
        t.shape = ctypes.cast(self._shape, _lib.c_i64p)
        self.name = b"dltensor_versioned" if versioned else b"dltensor"

    def __dlpack__(self, stream=None, max_version=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.mt), self.name, None)


def test_memory_refusals_name_the_values():
    lay = vllm_layout(num_layers=1)  # f16, 2 * B * N * H * D * 2 bytes
    need = lay.total_bytes
    cases = [
        (np.zeros(need // 2 - 1, np.float16), kvcache.OutOfBounds,
         "memory: %d bytes (ndarray (%d,) float16), the layout needs %d" %
         (need - 2, need // 2 - 1, need)),
        (np.zeros(need + 1, np.uint8)[1:], kvcache.InvalidArgument,
         "is not aligned to its 2-byte elements"),
        (np.zeros((2, B, N, H, 2 * D), np.float16)[..., :D], kvcache.InvalidArgument,
         "is not C-contiguous"),
        (np.zeros(need // 4, np.float32), kvcache.Mismatch,
         "memory: f32 elements, the layout holds f16"),
        (np.zeros(need // 8, np.int64), kvcache.Mismatch,
         "memory: int64 elements, the layout holds f16"),
        ([0.0] * 8, kvcache.InvalidArgument, "a list is copied on the way in"),
        # CUDA memory makes a device cache (tests/python/test_gpu_package.py)
        (_DLPackOnly(4, versioned=True), kvcache.Unsupported,
         "memory is on device type 4:0: this takes host or pinned memory"),
        (_DLPackOnly(1, versioned=True, flags=1), kvcache.InvalidArgument,
         "memory is an output, and its DLPack tensor is flagged read-only"),
        (_DLPackOnly(1), kvcache.InvalidArgument, "exports DLPack 0.x only"),
        (object(), kvcache.InvalidArgument, "object has neither __dlpack__"),
    ]
    ro = np.zeros(need // 2, np.float16)
    ro.flags.writeable = False
    cases.append((ro, kvcache.InvalidArgument, "memory is an output, and its memory is "
                                               "read-only (NumPy's writeable flag)"))
    for mem, exc, words in cases:
        with pytest.raises(exc) as e:
            kvcache.PagedCache(lay, mem)
        assert words in e.value.message, (words, e.value.message)
    with pytest.raises(kvcache.InvalidArgument) as e:
        kvcache.PagedCache("f16", np.zeros(need, np.uint8))
    assert "layout: a kvcache.Layout, got str" in e.value.message
    # bf16 as NumPy holds it (uint16 bits) and a byte buffer are taken
    kvcache.PagedCache(vllm_layout(num_layers=1, dtype="bf16"), np.zeros(need // 2, np.uint16))
    kvcache.PagedCache(lay, bytearray(need))


def test_flashinfer_shaped_memory_through_a_dlpack_1_producer():
    # FlashInfer's paged cache of one layer, [pages][2][N][H][D], is a
    # block-major layout of one layer; handed over by a DLPack 1.0 producer
    rng = np.random.default_rng(9)
    lay = vllm_layout(num_layers=1, arrange="block", dtype="f32")
    backing = np.zeros((B, 2, N, H, D), np.float32)
    prod = _DLPackOnly(1, data=backing.ctypes.data, versioned=True, nbytes=backing.nbytes)
    pc = kvcache.PagedCache(lay, prod)
    assert pc.memory is prod
    k = rng.standard_normal((3, H, D)).astype(np.float32)
    pc.write(0, k, -k, [2399, 8, 1203])
    want = np.zeros_like(backing)
    for t, sl in enumerate([2399, 8, 1203]):
        want[sl // N, 0, sl % N], want[sl // N, 1, sl % N] = k[t], -k[t]
    assert np.array_equal(backing, want)


def test_page_table_refusals_name_the_values():
    lay = vllm_layout(num_layers=1, dtype="f32")
    csr = [
        (([0.0, 1.0], [1], [1]), kvcache.InvalidArgument, "indptr: int32 or int64 integers, "
                                                          "got float64 values"),
        (([[0, 1]], [1], [1]), kvcache.BadShape, "indptr: 1-d, got shape (1, 2)"),
        (([], [], []), kvcache.BadShape, "indptr: n_seqs + 1 elements, got none"),
        (([0, 1], [1], [1, 1]), kvcache.BadShape,
         "last_page_len: 2 elements for 1 sequences"),
        (([1, 1], [1], [1]), kvcache.Corrupt, "indptr[0] = 1, must be 0"),
        (([0, 2, 1], [1, 2], [1, 1]), kvcache.Corrupt,
         "indptr decreases at sequence 1 (2 -> 1)"),
        (([0, 3], [1, 2], [1]), kvcache.OutOfBounds, "indptr[1] = 3 pages, indices has 2"),
        (([0, 1, 3], [5, 7, B], [1, 1]), kvcache.OutOfBounds,
         "indices[2] = 300 (sequence 1 page 1) outside [0, 300) (B 300 x r 1)"),
        (([0, 1, 1], [5], [1, 2]), kvcache.Corrupt,
         "last_page_len[1] = 2 for sequence 1 of 0 pages: an empty sequence needs 0"),
        (([0, 1], [5], [N + 1]), kvcache.Corrupt,
         "last_page_len[0] = 9 for sequence 0 of 1 pages: 1..8 (N/r)"),
        (([0, 1], np.array([2 ** 31]), [1]), kvcache.InvalidArgument,
         "indices[0] = 2147483648 is outside the range of int32"),
    ]
    for args, exc, words in csr:
        with pytest.raises(exc) as e:
            kvcache.Pages.from_csr(lay, *args)
        assert words in e.value.message, (words, e.value.message)
    bt = [
        (([[1, 2]], [3, 4]), kvcache.BadShape, "block_table: 1 rows for 2 sequences"),
        (([1, 2], [3]), kvcache.BadShape, "block_table: 2-d, got shape (2,)"),
        (([[1, 2]], [2 * N + 1]), kvcache.OutOfBounds,
         "sequence 0 has 17 tokens = 3 pages of 8, but the block table has 2 columns"),
        (([[1, 2], [3, -1]], [3, 9]), kvcache.OutOfBounds,
         "block_table[1, 1] = -1 (sequence 1 page 1) outside [0, 300)"),
        (([[1, 2]], [-1]), kvcache.Corrupt, "seq_lens[0] = -1 < 0"),
    ]
    for args, exc, words in bt:
        with pytest.raises(exc) as e:
            kvcache.Pages.from_block_table(lay, *args)
        assert words in e.value.message, (words, e.value.message)
    with pytest.raises(kvcache.InvalidArgument) as e:
        kvcache.Pages.from_csr(lay, [0], [], [], page_ratio=3)
    assert "page_ratio 3: >= 1 and dividing the block's 8 tokens" in e.value.message
    with pytest.raises(kvcache.InvalidArgument) as e:
        kvcache.Pages.from_csr("f32", [0], [], [])
    assert "layout: a kvcache.Layout (or a Cache or PagedCache), got str" in e.value.message
    # an engine growing indptr in place past its indices: refused at the call
    mem = np.zeros((2, B, N, H, D), np.float32)
    pc = kvcache.PagedCache(lay, mem)
    indptr = np.array([0, 1], np.int32)
    pg = kvcache.Pages.from_csr(lay, indptr, [7], [1])
    indptr[1] = 2
    with pytest.raises(kvcache.OutOfBounds) as e:
        pc.read(0, pg, np.zeros((N + 1, H, D), np.float32), None)
    assert "indptr[1] = 2, past the 1 elements of indices" in e.value.message


def test_kernel_refusals_on_engine_memory_change_nothing():
    rng = np.random.default_rng(8)
    lay = vllm_layout(num_layers=1)
    mem = rng.standard_normal((2, B, N, H, D)).astype(np.float16)
    pc = kvcache.PagedCache(lay, mem)
    before = mem.copy()
    k = np.ones((4, H, D), np.float16)
    with pytest.raises(kvcache.Unsupported) as e:
        pc.write(0, k.view(np.uint8)[..., :D], k, [1, 2, 3, 4])
    assert "k: a uint8 tensor is taken as raw fp8 bytes, and the cache holds f16" in \
        e.value.message
    with pytest.raises(kvcache.OutOfBounds) as e:
        pc.write(0, k, k, [1, 2, 3, B * N])
    assert "2400" in e.value.message
    with pytest.raises(kvcache.Overlap):
        pc.write(0, mem[0, 7, :4], k, [1, 2, 3, 4])  # an input inside the cache's memory
    ro = np.zeros((1, H, D), np.float16)
    ro.flags.writeable = False
    with pytest.raises(kvcache.InvalidArgument) as e:
        pc.read(0, kvcache.Pages.from_csr(lay, [0, 1], [9], [1]), ro, None)
    assert "k_out is an output, and its memory is read-only" in e.value.message
    with pytest.raises(kvcache.Unsupported) as e:
        pc.decode(0, np.ones((1, H, D), np.float32),
                  kvcache.Pages.from_csr(lay, [0, 1], [9], [1]), np.zeros((1, H, D), np.uint8))
    assert "out: a uint8 tensor is taken as raw fp8 bytes" in e.value.message
    assert np.array_equal(mem.view(np.uint16), before.view(np.uint16))


# ---- found by an audit of the edges (2026-12-05) -------------------------------------


def _f32_paged():
    lay = vllm_layout(dtype="f32", num_blocks=16)
    mem = np.zeros(lay.total_bytes // 4, np.float32)
    return lay, mem, kvcache.PagedCache(lay, mem)


def test_lse_rows_that_overlap_are_refused():
    # A broadcast lse (row stride 0, torch's expand()) was passed on as
    # lse_stride 0, which the library reads as Hq: S rows written into one.
    from numpy.lib.stride_tricks import as_strided
    lay, mem, pc = _f32_paged()
    rng = np.random.default_rng(3)
    k = rng.standard_normal((N, H, D)).astype(np.float32)
    pc.write(0, k, k, np.arange(N, dtype=np.int64))
    S, Hq = 8, H
    pages = kvcache.Pages.from_block_table(lay, np.zeros((S, 1), np.int32),
                                           np.full(S, N, np.int64))
    q = rng.standard_normal((S, Hq, D)).astype(np.float32)
    out = np.full((S, Hq, D), 5.0, np.float32)
    backing = np.full(Hq + 4, 7.0, np.float32)
    for strides in ((0, 4), (4, 4)):  # a broadcast; rows one float apart
        lse = as_strided(backing[:Hq], shape=(S, Hq), strides=strides)
        with pytest.raises(kvcache.KvError, match=r"do not overlap.*strides \(%d, 4\)" %
                           strides[0]):
            pc.decode(0, q, pages, out, lse=lse)
    assert (backing == 7.0).all() and (out == 5.0).all()
    lse = np.zeros((S, Hq), np.float32)  # the same call with rows apart: written
    pc.decode(0, q, pages, out, lse=lse)
    assert np.isfinite(lse).all() and not (out == 5.0).any()


def test_copy_blocks_holds_its_src_open():
    lay = vllm_layout(dtype="f32", num_blocks=16)
    dst, src = kvcache.Cache(lay), kvcache.Cache(lay)
    entered = []
    real = src._enter

    def spy():  # copy_blocks counts itself as a call in flight on src
        real()
        entered.append(src._busy)
    src._enter = spy
    dst.copy_blocks([[1, 2]], src=src)
    assert entered == [1] and src._busy == 0
    src.close()
    with pytest.raises(kvcache.KvError, match="src: the cache is closed"):
        dst.copy_blocks([[1, 2]], src=src)
    with pytest.raises(kvcache.KvError, match="src: a Cache or PagedCache, got ndarray"):
        dst.copy_blocks([[1, 2]], src=np.zeros(4))


def test_seq_lens_near_2_63_are_refused_by_name():
    lay, mem, pc = _f32_paged()
    for n in (2**63 - 1, 2**63 - 5):
        with pytest.raises(kvcache.KvError, match="sequence 0 has %d tokens = %d pages" %
                           (n, -(-n // N))):
            kvcache.Pages.from_block_table(lay, np.zeros((1, 1), np.int32),
                                           np.array([n], np.int64))


def test_copy_blocks_layers_on_a_k_only_cache():
    lay = kvcache.Layout(num_layers=2, num_blocks=8, block_tokens=8, num_heads=1, head_dim=32,
                         dtype="f16", k_only=True)
    mem = np.random.default_rng(4).standard_normal(lay.total_bytes // 2).astype(np.float16)
    pc = kvcache.PagedCache(lay, mem)
    before = mem.copy()
    pc.copy_blocks([[0, 5]], layers=1)  # was refused: planes None read as K and V
    per_block = 8 * 32 * 2 // 2  # elements of a block's K rows of one layer
    blk = lambda layer, b: slice((layer * 8 + b) * per_block, (layer * 8 + b + 1) * per_block)
    want = before.copy()
    want[blk(1, 5)] = before[blk(1, 0)]
    assert (mem.view(np.uint16) == want.view(np.uint16)).all()


def test_refusals_that_were_python_errors_name_the_values():
    lay, mem, pc = _f32_paged()
    k = np.zeros((1, H, D), np.float32)
    out = np.zeros((1, H, D), np.float32)
    with pytest.raises(kvcache.KvError, match="pages: a kvcache.Pages .*got NoneType"):
        pc.decode(0, k, None, out)
    with pytest.raises(kvcache.KvError, match="scales: .*got 1.0"):
        pc.write(0, k, k, np.zeros(1, np.int64), scales=1.0)
    with pytest.raises(kvcache.KvError, match="v is None, but this layout has a V plane"):
        pc.write(0, k, None, np.zeros(1, np.int64))
    with pytest.raises(kvcache.KvError, match="layer -1: one in"):  # was read as every layer
        pc.write(-1, k, k, np.zeros(1, np.int64))
    with pytest.raises(kvcache.KvError, match="scales given with their V scales NULL"):
        pc.write(0, k, k, np.zeros(1, np.int64), scales=(1.0, None))
    assert not mem.any()
    l8 = vllm_layout(dtype="fp8_e4m3")
    with pytest.raises(kvcache.KvError, match="1-byte integers as raw bits"):
        kvcache.PagedCache(l8, np.zeros(l8.total_bytes // 2, np.int16))


def test_torch_storage_moved_under_a_paged_cache_is_refused():
    torch = pytest.importorskip("torch")
    lay = vllm_layout(dtype="f32", num_blocks=16)
    t = torch.zeros(lay.total_bytes // 4, dtype=torch.float32)
    pc = kvcache.PagedCache(lay, t)
    # refused by torch while the cache holds it; torch says so with a C++
    # exception, which a preloaded ASan runtime cannot intercept (.ci/run's
    # Python-under-ASan stage aborts on any), so that stage skips this one
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        with pytest.raises(RuntimeError, match="not resizable"):
            t.resize_(t.numel() * 4)
    t.set_(torch.zeros(t.numel()))  # repointed: the old storage stays alive
    k = np.ones((N, H, D), np.float32)
    with pytest.raises(kvcache.KvError, match="set_\\(\\) or resize_\\(\\) moved it"):
        pc.write(0, k, k, np.arange(N, dtype=np.int64))
