"""tests/python/test_mla.py - MLA latent caches through the package: a K-only
Layout (k_only=True, one KV head, D 576), Cache.write with v None, read back,
Cache.decode_mla against a NumPy float64 reference written here from
docs/kernels.md's formula (scores over all D dims, values the first dv
dims), on sequences whose blocks are far from 0; a V tensor refused."""
import numpy as np
import pytest

import kvcache

D, DV = 576, 512


@pytest.mark.parametrize("hq,dtype", [(1, "f32"), (16, "bf16"), (5, "f32")])
def test_decode_mla_against_a_reference(hq, dtype):
    rng = np.random.default_rng(5 + hq)
    lay = kvcache.Layout(num_layers=2, num_blocks=64, block_tokens=16, num_heads=1, head_dim=D,
                         dtype=dtype, block_pad_elems=32, k_only=True)
    with kvcache.Cache(lay, max_seqs=8) as c:
        c.append(c.seq_create(), np.arange(400))  # push the next blocks far from 0
        seqs, lat = [], []
        for n in (37, 1, 70):
            s = c.seq_create()
            c.append(s, np.arange(n))
            k = rng.uniform(-1, 1, (n, 1, D)).astype(np.float32)
            c.write(1, k, None, [c.slot(s, t) for t in range(n)])
            if dtype == "bf16":  # what the cache holds: f32 rounded to bf16
                u = k.view(np.uint32)
                k = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)
            seqs.append(s), lat.append(k[:, 0].astype(np.float64))
        pages = c.pages(seqs)
        back = np.zeros((sum(len(x) for x in lat), 1, D), np.float32)
        c.read(1, pages, back)
        assert np.array_equal(back[:, 0].astype(np.float64), np.concatenate(lat))
        q = rng.uniform(-1, 1, (3, hq, D)).astype(np.float32)
        out = np.full((3, hq, DV), 9.0, np.float32)
        c.decode_mla(1, q, pages, out)
        scale = 1 / np.sqrt(D)
        for s in range(3):
            for h in range(hq):
                x = lat[s] @ q[s, h].astype(np.float64) * scale
                p = np.exp(x - x.max())
                want = (p / p.sum()) @ lat[s][:, :DV]
                assert np.allclose(out[s, h], want, rtol=1e-4, atol=2e-5), (s, h)
        with pytest.raises(kvcache.errors.KvError) as e:
            c.write(1, back[:1], back[:1], [c.slot(seqs[0], 0)])
        assert "v given" in str(e.value)


@pytest.mark.parametrize("hq,dtype,window,cap", [(16, "bf16", None, None), (5, "f32", 20, 15.0),
                                                 (3, "f16", None, 4.0)])
def test_prefill_mla_against_a_reference(hq, dtype, window, cap):
    """Cache.prefill_mla: sequences of q_len 0, 1, several and the whole
    sequence, out and lse padded (non-contiguous), against NumPy float64;
    the q_len 1 row equal to decode_mla's bit for bit (no options)."""
    rng = np.random.default_rng(11 + hq)
    lay = kvcache.Layout(num_layers=2, num_blocks=64, block_tokens=16, num_heads=1, head_dim=D,
                         dtype=dtype, block_pad_elems=32, k_only=True)
    with kvcache.Cache(lay, max_seqs=8) as c:
        c.append(c.seq_create(), np.arange(400))  # push the next blocks far from 0
        seqs, lat = [], []
        lens, qlens = (37, 1, 70, 20), (5, 1, 70, 0)
        for n in lens:
            s = c.seq_create()
            c.append(s, np.arange(n))
            k = rng.uniform(-1, 1, (n, 1, D)).astype(np.float32)
            c.write(1, k, None, [c.slot(s, t) for t in range(n)])
            back = np.zeros((n, 1, D), np.float32)
            c.read(1, c.pages([s]), back)  # what the cache holds, as f32
            seqs.append(s), lat.append(back[:, 0].astype(np.float64))
        pages = c.pages(seqs)
        qo = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        T = int(qo[-1])
        qbuf = rng.uniform(-1, 1, (T, hq + 1, D + 8)).astype(np.float32)
        q = qbuf[:, :hq, :D]  # padded heads and rows
        obuf = np.full((T, hq, DV + 5), 9.0, np.float32)
        out = obuf[:, :, :DV]
        lbuf = np.full((T, hq + 3), 7.0, np.float32)
        lse = lbuf[:, :hq]
        c.prefill_mla(1, q, qo, pages, out, window_left=window, soft_cap=cap, lse=lse)
        scale = 1 / np.sqrt(D)
        for s in range(len(lens)):
            for i in range(qlens[s]):
                pos = lens[s] - qlens[s] + i
                lo = 0 if window is None else max(0, pos - window)
                rows = lat[s][lo:pos + 1]
                for h in range(hq):
                    x = rows @ q[qo[s] + i, h].astype(np.float64) * scale
                    if cap:
                        x = cap * np.tanh(x / cap)
                    p = np.exp(x - x.max())
                    want = (p / p.sum()) @ rows[:, :DV]
                    got = out[qo[s] + i, h]
                    assert np.allclose(got, want, rtol=1e-4, atol=2e-5), (s, i, h)
                    assert abs(lse[qo[s] + i, h] - (x.max() + np.log(p.sum()))) < 1e-4
        assert np.all(obuf[:, :, DV:] == 9.0) and np.all(lbuf[:, hq:] == 7.0)
        # no options: the q_len 1 row (sequence 1) is decode_mla's, bit for bit
        c.prefill_mla(1, q, qo, pages, out)
        dq = np.ascontiguousarray(np.stack([q[qo[s + 1] - 1] if qlens[s] else q[0]
                                            for s in range(len(lens))]))
        dout = np.zeros((len(lens), hq, DV), np.float32)
        c.decode_mla(1, dq, pages, dout)
        for s in range(len(lens)):
            if qlens[s]:
                assert np.array_equal(out[qo[s + 1] - 1], dout[s]), s
        # refusals name the values: q_len above len, a bad qo_indptr
        with pytest.raises(kvcache.errors.KvError) as e:
            rot = c.pages(seqs[1:] + seqs[:1])  # sequence 0 of 1 token
            c.prefill_mla(1, q[:2], np.array([0, 2, 2, 2, 2], np.int32), rot, out[:2])
        assert "q_len 2" in str(e.value)
        with pytest.raises(kvcache.errors.KvError) as e:
            c.prefill_mla(1, q, qo[::-1].copy(), pages, out)
        assert "qo_indptr[0]" in str(e.value)
