"""tests/python/test_attn_opts.py - the attention options through the package:
Cache.decode(window_left=, soft_cap=, lse=) and Cache.prefill (several
queries per sequence, qo_indptr, causal mask over the cached tokens) against
a NumPy float64 reference written here from docs/kernels.md's formulas, on
sequences whose blocks are far from 0, and refusals naming the option with
nothing written."""
import numpy as np
import pytest

import kvcache

H, D, G = 2, 32, 3  # KV heads, head dim, query heads per KV head


def _setup(c, lens, rng, layer=1):
    c.append(c.seq_create(), np.arange(300))  # push the next blocks far from 0
    seqs, ks, vs = [], [], []
    for n in lens:
        s = c.seq_create()
        c.append(s, np.arange(n))
        k = rng.uniform(-1, 1, (n, H, D)).astype(np.float32)
        v = rng.uniform(-1, 1, (n, H, D)).astype(np.float32)
        c.write(layer, k, v, [c.slot(s, t) for t in range(n)])
        seqs.append(s), ks.append(k.astype(np.float64)), vs.append(v.astype(np.float64))
    return seqs, ks, vs


def _reference(q, qo, ks, vs, window, cap):
    """out [T][Hq][D], lse [T][Hq] in float64."""
    T, Hq, _ = q.shape
    out = np.zeros((T, Hq, D))
    lse = np.full((T, Hq), -np.inf)
    scale = 1 / np.sqrt(D)
    for s in range(len(ks)):
        n, ql = len(ks[s]), qo[s + 1] - qo[s]
        for i in range(ql):
            pos = n - ql + i
            lo = 0 if window < 0 else max(0, pos - window)
            for h in range(Hq):
                x = ks[s][lo:pos + 1, h // G] @ q[qo[s] + i, h].astype(np.float64) * scale
                if cap > 0:
                    x = cap * np.tanh(x / cap)
                m = x.max()
                p = np.exp(x - m)
                out[qo[s] + i, h] = (p / p.sum()) @ vs[s][lo:pos + 1, h // G]
                lse[qo[s] + i, h] = m + np.log(p.sum())
    return out, lse


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("window,cap", [(-1, 0.0), (7, 0.0), (-1, 1.5), (20, 2.0), (0, 0.0)])
def test_decode_options_against_a_reference(order, window, cap):
    rng = np.random.default_rng(11)
    lay = kvcache.Layout(num_layers=2, num_blocks=96, block_tokens=16, num_heads=H, head_dim=D,
                         dtype="f32", order=order, block_pad_elems=8)
    with kvcache.Cache(lay, max_seqs=8) as c:
        lens = [45, 1, 17]
        seqs, ks, vs = _setup(c, lens, rng)
        q = rng.uniform(-3, 3, (3, H * G, D)).astype(np.float32)
        out = np.full((3, H * G, D), 7.0, np.float32)
        lse_buf = np.full((3, H * G + 2), 9.0, np.float32)  # padded rows
        lse = lse_buf[:, :H * G]
        c.decode(1, q, c.pages(seqs), out, window_left=window, soft_cap=cap, lse=lse)
        want, want_lse = _reference(q, [0, 1, 2, 3], ks, vs, window, cap)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-6)
        assert np.all(lse_buf[:, H * G:] == 9.0)  # the padding untouched


@pytest.mark.parametrize("dtype", ["f32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("qlens", [[40, 23, 5], [1, 1, 1], [6, 0, 2], [1, 23, 3]])
def test_prefill_against_a_reference(dtype, qlens):
    rng = np.random.default_rng(13)
    lay = kvcache.Layout(num_layers=2, num_blocks=96, block_tokens=8, num_heads=H, head_dim=D,
                         dtype=dtype, order="HND")
    with kvcache.Cache(lay, max_seqs=8) as c:
        lens = [40, 23, 5]
        seqs, ks, vs = _setup(c, lens, rng)
        # what the cache holds, dequantized: the reference reads it back
        pg = c.pages(seqs)
        kall = np.empty((sum(lens), H, D), np.float32)
        vall = np.empty_like(kall)
        c.read(1, pg, kall, vall)
        ks = np.split(kall.astype(np.float64), np.cumsum(lens)[:-1])
        vs = np.split(vall.astype(np.float64), np.cumsum(lens)[:-1])
        qo = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        T = int(qo[-1])
        q = rng.uniform(-3, 3, (T, H * G, D)).astype(np.float32)
        out = np.zeros((T, H * G, D), np.float32)
        lse = np.zeros((T, H * G), np.float32)
        c.prefill(1, q, qo, pg, out, window_left=9, soft_cap=3.0, lse=lse)
        want, want_lse = _reference(q, qo, ks, vs, 9, 3.0)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-6)
        out2 = np.zeros_like(out)  # no options, int64 qo_indptr
        c.prefill(1, q, qo.astype(np.int64), pg, out2)
        want2, _ = _reference(q, qo, ks, vs, -1, 0.0)
        np.testing.assert_allclose(out2, want2, rtol=2e-5, atol=2e-6)
        if qlens == [1, 1, 1]:  # a decode step: the same floats
            out3 = np.zeros_like(out)
            c.decode(1, q, pg, out3)
            assert np.array_equal(out2, out3)


def test_refusals_name_the_option_and_write_nothing():
    rng = np.random.default_rng(17)
    lay = kvcache.Layout(num_layers=2, num_blocks=64, block_tokens=16, num_heads=H, head_dim=D,
                         dtype="f16")
    with kvcache.Cache(lay, max_seqs=8) as c:
        seqs, _, _ = _setup(c, [5, 3], rng)
        pg = c.pages(seqs)
        q = rng.uniform(-1, 1, (4, H * G, D)).astype(np.float32)
        out = np.full_like(q, 5.0)
        lse = np.full((4, H * G), 5.0, np.float32)
        cases = [
            (dict(window_left=-2), "KV_ERR_INVALID_ARG", "window_left -2"),
            (dict(soft_cap=-1.0), "KV_ERR_INVALID_ARG", "logit_soft_cap -1"),
            (dict(soft_cap=float("nan")), "KV_ERR_INVALID_ARG", "logit_soft_cap nan"),
            (dict(lse=np.zeros((4, H * G), np.float64)), "KV_ERR_INVALID_ARG", "float32"),
            (dict(lse=np.zeros((3, H * G), np.float32)), "KV_ERR_BAD_SHAPE", "lse shape"),
            (dict(lse=out[:, :H * G, 0]), "KV_ERR_INVALID_ARG", "contiguous heads"),
            (dict(lse=out.reshape(4, -1)[:, :H * G]), "KV_ERR_OVERLAP", "overlaps out"),
        ]
        for kw, status, needle in cases:
            with pytest.raises(kvcache.KvError) as e:
                c.prefill(1, q, [0, 2, 4], pg, out, **kw)
            assert e.value.status == status and needle in str(e.value), (kw, str(e.value))
        for qo, status, needle in [([0, 2, 3], "KV_ERR_BAD_SHAPE", "but q and out have 4 rows"),
                                   ([0, 3, 2], "KV_ERR_CORRUPT", "qo_indptr decreases"),
                                   ([0, 0, 4], "KV_ERR_BAD_SHAPE", "sequence 1 has q_len 4"),
                                   ([1, 2, 4], "KV_ERR_CORRUPT", "qo_indptr[0] is 1"),
                                   ([0, 4], "KV_ERR_BAD_SHAPE", "qo_indptr has 2 entries")]:
            with pytest.raises(kvcache.KvError) as e:
                c.prefill(1, q, qo, pg, out, lse=lse)
            assert e.value.status == status and needle in str(e.value), (qo, str(e.value))
        assert np.all(out == 5.0) and np.all(lse == 5.0)
