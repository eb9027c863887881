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
