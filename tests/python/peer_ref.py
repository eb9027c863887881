"""tests/python/peer_ref.py - what the ported peer tests (test_peer_*.py) share:
the pairwise reduction of a peer's parameter lists, an fp8 e4m3fn codec
written from the format's definition (OCP E4M3: bias 7, 3 mantissa bits, no
infinities, 0x7F/0xFF NaN, max finite 448), and the tolerance of "one output
rounding of a float64 reference". None of it calls kvcache: it is the oracle
side."""
import itertools
import random

import numpy as np


def pairwise(params, seed=0):
    """A subset of the product of params (a dict name -> list of values) in
    which every pair of values of every two parameters appears at least
    once (all-pairs), chosen greedily with a fixed seed. Returns a list of
    tuples in the order of params, for pytest.mark.parametrize."""
    names = list(params)
    rng = random.Random(seed)
    full = list(itertools.product(*(range(len(params[n])) for n in names)))
    rng.shuffle(full)
    cand = np.array(full, np.int64).reshape(len(full), len(names))
    sizes = [len(params[n]) for n in names]
    cols, base = [], 0
    for i, j in itertools.combinations(range(len(names)), 2):
        cols.append(base + cand[:, i] * sizes[j] + cand[:, j])  # a global id per pair
        base += sizes[i] * sizes[j]
    ids = np.stack(cols, axis=1) if cols else np.zeros((len(full), 0), np.int64)
    covered = np.zeros(base, bool)
    out = []
    while not covered.all():
        best = int(np.argmax((~covered[ids]).sum(axis=1)))
        covered[ids[best]] = True
        out.append(tuple(params[n][k] for n, k in zip(names, cand[best])))
    return out if out else [tuple(params[n][0] for n in names)]


def _e4m3_table():
    """float64 value of each of the 256 e4m3fn bytes (NaN for 0x7F, 0xFF)."""
    vals = np.empty(256)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            v = np.nan
        elif e == 0:
            v = m * 2.0 ** -9
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        vals[b] = -v if s else v
    return vals


E4M3 = _e4m3_table()
_POS = np.arange(0, 127)  # bytes 0x00..0x7E: +0 .. +448, increasing
_POS_VALS = E4M3[_POS]


def e4m3_decode(u8):
    """uint8 array of e4m3fn bytes -> float64 values."""
    return E4M3[np.asarray(u8, np.uint8)]


def e4m3_encode(x):
    """float array -> e4m3fn bytes, the nearest finite value (saturating at
    448; on a tie, the even mantissa). Used to make fp8 data, as the peers'
    cache factories convert random floats to fp8."""
    x = np.asarray(x, np.float64)
    a = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(_POS_VALS, a), 1, len(_POS_VALS) - 1)
    lo = hi - 1
    dlo, dhi = a - _POS_VALS[lo], _POS_VALS[hi] - a
    pick = np.where((dhi < dlo) | ((dhi == dlo) & (_POS[hi] % 2 == 0)), _POS[hi], _POS[lo])
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def assert_e4m3_nearest(u8, want, what):
    """Each stored byte decodes to a finite e4m3 value nearest to want (the
    float64 value the kernel had to store: x / scale), saturated to +-448:
    one rounding, either side of a tie."""
    got = e4m3_decode(u8)
    want = np.asarray(want, np.float64)
    a = np.minimum(np.abs(want), 448.0)
    hi = np.clip(np.searchsorted(_POS_VALS, a), 1, len(_POS_VALS) - 1)
    best = np.minimum(a - _POS_VALS[hi - 1], np.abs(_POS_VALS[hi] - a))
    err = np.abs(np.abs(got) - a)
    ok = np.isfinite(got) & (err <= best * (1 + 1e-12)) & \
        ((np.signbit(got) == np.signbit(want)) | (got == 0))
    assert ok.all(), "%s: %d of %d bytes are not the nearest e4m3 value (first: stored %r, " \
        "wanted %r)" % (what, (~ok).sum(), ok.size, got[~ok][:3], want[~ok][:3])


def half_ulp(ref, dtype):
    """Half the spacing of the output dtype ("f16", "bf16", "f32") at ref:
    the largest error one rounding of ref to that dtype makes."""
    a = np.abs(np.asarray(ref, np.float64))
    if dtype == "f16":
        return np.spacing(a.astype(np.float16)).astype(np.float64) / 2
    mant = {"bf16": 7, "f32": 23}[dtype]
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -126)))
    return 2.0 ** (e - mant) / 2


def assert_one_rounding(out, ref, dtype, what, vmax=1.0):
    """out (any float array) within one rounding to dtype of the float64
    ref, plus what f32 accumulation in the kernel may add (1e-5 relative,
    2e-6 of the largest |V| element vmax): the project's tolerance."""
    out = np.asarray(out, np.float64)
    err = np.abs(out - ref)
    tol = half_ulp(ref, dtype) * (1 + 1e-6) + 1e-5 * np.abs(ref) + 2e-6 * vmax
    bad = ~(err <= tol)
    assert not bad.any(), "%s: %d of %d elements off by more than one %s rounding (worst %g " \
        "at ref %g)" % (what, bad.sum(), bad.size, dtype, err.max(), ref.flat[np.argmax(err)])
