"""tests/python/test_copies.py - the engine-shaped copies from Python:
Cache.copy_blocks with layers= and planes=, within one cache and from
another cache of the same block format (swap out / swap in), and
Cache.write with int32 slots read in place. Every layer and plane of the
destination is compared through the cache's own views with what the copy
should leave (the selected blocks' layers and planes from the source,
everything else as it was); refusals change nothing. Run by `make test`."""
import numpy as np
import pytest

import kvcache
from kvcache import _lib

L = _lib.lib


def layout(**kw):
    args = dict(num_layers=4, num_blocks=64, block_tokens=8, num_heads=2, head_dim=16,
                dtype="f16")
    args.update(kw)
    return kvcache.Layout(**args)


def fill(c, seed):
    rng = np.random.default_rng(seed)
    for l in range(c.layout.num_layers):
        for p in (0, 1):
            a = c.kv(l, p).numpy()
            a[...] = rng.standard_normal(a.shape).astype(a.dtype)


def snapshot(c):
    return [[c.kv(l, p).numpy().copy() for p in (0, 1)] for l in range(c.layout.num_layers)]


def expect(dst_before, src_before, copies, layers, planes):
    want = [[a.copy() for a in pl] for pl in dst_before]
    for s, d in copies:
        for l in layers:
            for p in planes:
                want[l][p][d] = src_before[l][p][s]
    return want


def assert_holds(c, want, what):
    for l in range(c.layout.num_layers):
        for p in (0, 1):
            got = c.kv(l, p).numpy()
            assert np.array_equal(got.view(np.uint16), want[l][p].view(np.uint16)), \
                "%s: layer %d plane %d" % (what, l, p)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_swap_out_and_in_between_caches(packed, order):
    dev_lo = layout(order=order, kv_packed=packed, num_blocks=96)
    host_lo = layout(order=order, kv_packed=packed, num_blocks=40, arrange="block",
                     block_pad_elems=8)
    with kvcache.Cache(dev_lo, max_seqs=2) as dev, kvcache.Cache(host_lo, max_seqs=2) as host:
        fill(dev, 1)
        fill(host, 2)
        # swap out: device blocks far from 0 -> host, layers 1..2, V only
        copies = [[90, 3], [95, 39], [60, 7]]
        d0, h0 = snapshot(dev), snapshot(host)
        host.copy_blocks(copies, layers=range(1, 3), planes="v", src=dev)
        assert_holds(host, expect(h0, d0, copies, [1, 2], [1]), "swap out")
        assert_holds(dev, d0, "source unchanged")
        # swap in: every layer, K and V, ids appearing on both sides
        back = [[3, 90], [39, 3]]
        d0, h0 = snapshot(dev), snapshot(host)
        dev.copy_blocks(back, src=host)
        assert_holds(dev, expect(d0, h0, back, range(4), [0, 1]), "swap in")
        assert_holds(host, h0, "source unchanged")


def test_copy_blocks_layers_and_planes_in_one_cache():
    with kvcache.Cache(layout(kv_packed=True), max_seqs=2) as c:
        fill(c, 3)
        for layers, planes, sel_l, sel_p in [(1, "k", [1], [0]), ((2, 4), None, [2, 3], [0, 1]),
                                             (slice(0, 3), "v", [0, 1, 2], [1]),
                                             (None, "kv", range(4), [0, 1])]:
            copies = [[50, 60], [51, 61]]
            b = snapshot(c)
            c.copy_blocks(copies, layers=layers, planes=planes)
            assert_holds(c, expect(b, b, copies, sel_l, sel_p), "layers %r planes %r" %
                         (layers, planes))


def test_copy_refusals_change_nothing():
    with kvcache.Cache(layout(), max_seqs=2) as a, \
            kvcache.Cache(layout(num_heads=4), max_seqs=2) as other:
        fill(a, 4)
        fill(other, 5)
        b, o = snapshot(a), snapshot(other)
        with pytest.raises(kvcache.errors.Mismatch, match=r"H 4 \(src\) vs 2 \(dst\)"):
            a.copy_blocks([[1, 2]], src=other)
        with pytest.raises(kvcache.errors.InvalidArgument, match=r"layers \[3, 5\)"):
            a.copy_blocks([[1, 2]], layers=(3, 5))
        with pytest.raises(kvcache.errors.InvalidArgument, match="empty"):
            a.copy_blocks([[1, 2]], layers=(2, 2))
        with pytest.raises(kvcache.errors.InvalidArgument, match="planes"):
            a.copy_blocks([[1, 2]], planes="q")
        with pytest.raises(kvcache.errors.OutOfBounds, match="names a block >= B = 64"):
            a.copy_blocks([[1, 64]], layers=0)
        with pytest.raises(kvcache.errors.Overlap, match="onto itself"):
            a.copy_blocks([[5, 5]], planes="k")
        assert_holds(a, b, "refused")
        assert_holds(other, o, "refused")


def test_write_int32_slots_read_in_place():
    lo = layout()
    rng = np.random.default_rng(6)
    k = rng.standard_normal((4, 12, 2, 16)).astype(np.float16)
    v = rng.standard_normal((4, 12, 2, 16)).astype(np.float16)
    s64 = np.array([500, 501, 502, 9, -1, 200, 201, 7, 8, 300, 100, 511], np.int64)
    calls = []
    real = L.kv_attn_write_i32

    def spy(*args):
        calls.append(args)
        return real(*args)

    with kvcache.Cache(lo, max_seqs=2) as a, kvcache.Cache(lo, max_seqs=2) as b:
        fill(a, 7)
        fill(b, 7)
        a.write(None, k, v, s64)
        L.kv_attn_write_i32 = spy
        try:
            b.write(None, k, v, s64.astype(np.int32))
        finally:
            L.kv_attn_write_i32 = real
        assert len(calls) == 1  # the int32 entry, not a conversion to int64
        assert_holds(b, snapshot(a), "int32 == int64 slots")
        bad = s64.astype(np.int32)
        bad[3] = 512
        before = snapshot(b)
        with pytest.raises(kvcache.errors.OutOfBounds, match=r"slots\[3\] = 512 outside"):
            b.write(None, k, v, bad)
        bad[3] = -5
        with pytest.raises(kvcache.errors.OutOfBounds, match=r"slots\[3\] = -5"):
            b.write(0, k[0], v[0], bad)
        assert_holds(b, before, "refused")


def test_write_int32_torch_tensor():
    torch = pytest.importorskip("torch")
    lo = layout()
    k = torch.randn(5, 2, 16, dtype=torch.float16)
    v = torch.randn(5, 2, 16, dtype=torch.float16)
    with kvcache.Cache(lo, max_seqs=2) as a, kvcache.Cache(lo, max_seqs=2) as b:
        fill(a, 8)
        fill(b, 8)
        a.write(1, k, v, [40, 41, 42, 3, 100])
        b.write(1, k, v, torch.tensor([40, 41, 42, 3, 100], dtype=torch.int32))
        assert_holds(b, snapshot(a), "torch int32 slots")
