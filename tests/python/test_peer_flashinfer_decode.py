"""tests/python/test_peer_flashinfer_decode.py - FlashInfer's batch decode test,
ported to the package (issue 20 point 6). Our own code; the oracle is our
float64 re-implementation of the peer's reference, never kvcache.

Follows flashinfer-ai/flashinfer tests/attention/test_batch_decode_kernels.py
(earlier tests/test_batch_decode_kernels.py),
test_batch_decode_with_paged_kv_cache, whose own cases are already a
pairwise product: batch_size [12, 17, 128], kv_len [54, 97, 512, 2048,
16384], page_size [1, 8, 16], num_kv_heads [4], num_qo_heads [4, 32],
head_dim [128, 256, 512], kv_layout ["NHD"] (["NHD", "HND"] in the earlier
file), pos_encoding_mode ["NONE", "ROPE_LLAMA"], logits_soft_cap [0.0]
([0.0, 30.0] earlier), return_lse [True] ([True, False] earlier), q_dtype
[float16], kv_dtype [float16, float8_e4m3fn], contiguous_kv [True] ([True,
False] earlier). q and the paged kv_data [pages][2][page_size][H][D] (HND:
[pages][2][H][page_size][D]) are randn, kv_data converted to kv_dtype (fp8
without scales, as the peer); every sequence has kv_len tokens,
kv_last_page_len (kv_len - 1) % page_size + 1; the output is float16.

The reference is the peer's oracle, single_decode_with_kv_cache over each
sequence's K and V gathered from its pages (whole pages, then the last
page's first kv_last_page_len tokens): softmax over tokens of sm_scale q.k
(sm_scale = head_dim**-0.5; with logits_soft_cap c, c * tanh(x / c)), times
V, the query heads sharing KV head h // (num_qo_heads / num_kv_heads); here
in NumPy float64 over the bytes kv_data holds (fp8 decoded by peer_ref's
e4m3 table). out within one float16 rounding of it (the peer's rtol = atol
= 1e-3 tightened), lse (kvcache's natural log times log2(e): FlashInfer
returns base 2) within 1e-5 relative. The kv_data is the memory of a
PagedCache (block-major Layout, one layer), the pages Pages.from_csr over
FlashInfer's int32 kv_indptr, kv_indices, kv_last_page_len; a second call
with a preallocated out (the peer's "user-allocated output") must give the
same bits.

Reduced to fit `make test`: the lists above (with the earlier file's
values for kv_layout, logits_soft_cap, return_lse and contiguous_kv) run as
a pairwise (all-pairs) subset of their product (peer_ref.pairwise, fixed
seed), with batch_size 128 -> 5, and kv_len 2048 and 16384 -> 600 (past
the split-k chunking of 512 that the long lengths are there for).
contiguous_kv False is kept as a padded page: every K and V page of the
kv_data is followed by 24 elements of padding (block_pad_elems), so the
page and K/V strides are not the product of the inner dims, as the peer
asserts of its strided view; the peer's token, head and element strides of
2 are not ported (a Layout holds the head dimension contiguous). fp8 bytes
are drawn directly as e4m3 codes of magnitude <= 4 instead of converted
from randn (the same range of values; the conversion is not what is
tested here). Not ported: pos_encoding_mode ROPE_LLAMA (kvcache applies no
rotary embedding), q_dtype other than float16 and kv_dtype nvfp4 (not in
the lists we follow; the package takes them), the cuTile and fast-plan
backends, the tuple (separate K and V tensors) form, and the CUDA
workspace."""
import numpy as np
import pytest

import kvcache
from peer_ref import E4M3, assert_one_rounding, e4m3_decode, pairwise

PAD = 24  # elements of padding after each K and V page when not contiguous

CASES = pairwise({"batch_size": [12, 17, 5], "kv_len": [54, 97, 512, 600],
                  "page_size": [1, 8, 16], "num_qo_heads": [4, 32],
                  "head_dim": [128, 256, 512], "kv_layout": ["NHD", "HND"],
                  "logits_soft_cap": [0.0, 30.0], "return_lse": [True, False],
                  "kv_dtype": ["f16", "fp8_e4m3"], "contiguous_kv": [True, False]}, seed=3)
NUM_KV_HEADS = 4


def single_decode_ref(q, k, v, soft_cap):
    """The peer's single decode in float64: q [Hq][D], k, v [n][H][D] ->
    (out [Hq][D], lse [Hq] base 2)."""
    Hq, D = q.shape
    H = k.shape[1]
    x = np.einsum("hgd,nhd->hgn", q.reshape(H, Hq // H, D), k).reshape(Hq, -1) / np.sqrt(D)
    if soft_cap > 0:
        x = soft_cap * np.tanh(x / soft_cap)
    m = x.max(axis=1, keepdims=True)
    p = np.exp(x - m)
    w = (p / p.sum(axis=1, keepdims=True)).reshape(H, Hq // H, -1)
    out = np.einsum("hgn,nhd->hgd", w, v).reshape(Hq, D)
    return out, (m[:, 0] + np.log(p.sum(axis=1))) / np.log(2)


@pytest.mark.parametrize("batch_size,kv_len,page_size,num_qo_heads,head_dim,kv_layout,"
                         "logits_soft_cap,return_lse,kv_dtype,contiguous_kv", CASES)
def test_batch_decode_with_paged_kv_cache(batch_size, kv_len, page_size, num_qo_heads, head_dim,
                                          kv_layout, logits_soft_cap, return_lse, kv_dtype,
                                          contiguous_kv):
    rng = np.random.default_rng(0)
    H, D, P = NUM_KV_HEADS, head_dim, page_size
    q = rng.standard_normal((batch_size, num_qo_heads, D), np.float32).astype(np.float16)
    pages_per_seq = (kv_len + P - 1) // P
    total_pages = pages_per_seq * batch_size
    pad = 0 if contiguous_kv else PAD
    lay = kvcache.Layout(num_layers=1, num_blocks=total_pages, block_tokens=P, num_heads=H,
                         head_dim=D, dtype=kv_dtype, order=kv_layout, arrange="block",
                         block_pad_elems=pad)
    es = 2 if kv_dtype == "f16" else 1
    # kv_data [pages][2][inner] by FlashInfer's formula, padded pages when not contiguous
    plane = P * H * D + pad
    inner = (P * H * D, H * D, D) if kv_layout == "NHD" else (H * P * D, D, P * D)
    want = {"block": 2 * plane * es, "kv": plane * es, "token": inner[1] * es,
            "head": inner[2] * es, "dim": es}
    got = lay.strides_bytes()
    assert {k: got[k] for k in want} == want, "the Layout is FlashInfer's kv_data"
    mem = np.zeros(lay.total_bytes, np.uint8)
    shape = (total_pages, 2) + ((P, H, D) if kv_layout == "NHD" else (H, P, D))
    strides = (2 * plane * es, plane * es) + tuple(s * es for s in
                                                  ((H * D, D, 1) if kv_layout == "NHD"
                                                   else (P * D, D, 1)))
    kv_data = np.ndarray(shape, np.float16 if es == 2 else np.uint8, mem, 0, strides)
    assert contiguous_kv or kv_data.strides[0] != 2 * np.prod(kv_data.shape[2:]) * es
    if kv_dtype == "f16":
        kv_data[...] = rng.standard_normal(shape, np.float32).astype(np.float16)
        kv64 = kv_data.astype(np.float64)
    else:
        codes = np.flatnonzero(np.abs(E4M3) <= 4).astype(np.uint8)
        kv_data[...] = rng.choice(codes, shape)
        kv64 = e4m3_decode(kv_data)
    if kv_layout == "HND":
        kv64 = kv64.transpose(0, 1, 3, 2, 4)  # [pages][2][P][H][D] for the reference
    kv_indptr = (np.arange(batch_size + 1) * pages_per_seq).astype(np.int32)
    kv_indices = rng.permutation(total_pages).astype(np.int32)
    kv_last_page_len = np.full(batch_size, (kv_len - 1) % P + 1, np.int32)

    pc = kvcache.PagedCache(lay, mem)
    pages = kvcache.Pages.from_csr(lay, kv_indptr, kv_indices, kv_last_page_len)
    before = mem.copy()
    o = np.empty((batch_size, num_qo_heads, D), np.float16)
    lse = np.empty((batch_size, num_qo_heads), np.float32) if return_lse else None
    pc.decode(0, q, pages, o, soft_cap=logits_soft_cap or None, lse=lse)

    for i in range(batch_size):
        ids = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
        # whole pages, then the last page's first kv_last_page_len tokens
        kv_i = np.concatenate([kv64[ids[:-1]].transpose(1, 0, 2, 3, 4).reshape(2, -1, H, D),
                               kv64[ids[-1], :, :kv_last_page_len[i]]], axis=1)
        o_ref, lse_ref = single_decode_ref(q[i].astype(np.float64), kv_i[0], kv_i[1],
                                           logits_soft_cap)
        assert_one_rounding(o[i], o_ref, "f16", "o[%d]" % i, vmax=np.abs(kv_i[1]).max())
        if return_lse:
            assert_one_rounding(lse[i].astype(np.float64) * np.log2(np.e), lse_ref, "f32",
                                "lse[%d]" % i)
    o_buffer = np.full_like(o, np.nan)  # the user-allocated output
    pc.decode(0, q, pages, o_buffer, soft_cap=logits_soft_cap or None)
    assert np.array_equal(o_buffer.view(np.uint16), o.view(np.uint16))
    assert np.array_equal(mem, before), "decode changed the kv_data"
