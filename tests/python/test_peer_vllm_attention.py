"""tests/python/test_peer_vllm_attention.py - vLLM's paged attention test,
ported to the package (issue 20 point 6). Our own code; the oracle is our
float64 re-implementation of the peer's reference, never kvcache.

Follows vllm-project/vllm tests/kernels/attention/test_attention.py
(earlier tests/kernels/test_attention.py), test_paged_attention with its
reference ref_single_query_cached_kv_attention / ref_masked_attention:
version ["v1", "v2"], NUM_GEN_SEQS [7], NUM_HEADS [(40, 40), (64, 8)] (and
(32, 8) of the newer file), HEAD_SIZES [64, 80, 96, 112, 120, 128, 192,
256], BLOCK_SIZES [16, 32], USE_ALIBI [False, True], DTYPES [half,
bfloat16, float], KV_CACHE_DTYPE ["auto", "fp8"], SEEDS [0]; the query
uniform(-scale, scale), scale = head_size**-0.5; seq_lens random in [1,
MAX_SEQ_LEN] with the last one MAX_SEQ_LEN; block tables drawn with
random.randint over all blocks (repeats allowed); the cache filled by the
factory's uniform(-scale, scale) (fp8: random e4m3 bytes in that range);
fp8 k_scale 0.5, v_scale 0.25 (the newer file's values). The output has the
query's dtype, as vLLM's.

The reference is the peer's: for each sequence, gather token j's K and V
from block block_table[j // block_size] offset j % block_size, repeat each
KV head for its num_queries_per_kv query heads, softmax(scale * q.k) @ v,
with fp8 the dequantized cache (value x scale); here in NumPy float64, and
the output within one rounding of the output dtype of it (the peer's atol
1e-3 / 1e-2 for fp8 tightened to that). The cache is vLLM's flash-attention
layout, a per-layer [2][blocks][N][H][D] tensor under a PagedCache, the
pages Pages.from_block_table over vLLM's int32 block_tables and int32
seq_lens.

Reduced to fit `make test`: a pairwise (all-pairs) subset of the product
(peer_ref.pairwise, fixed seed); NUM_HEADS smaller with each
query-per-KV ratio kept, (40, 40) -> (5, 5), (64, 8) -> (16, 2), (32, 8)
-> (8, 2) (two KV heads, so a wrong head mapping fails), and MQA (8, 1)
added; NUM_BLOCKS 4321 -> 67; MAX_SEQ_LEN (shared memory / 4 - 512) ->
520. "v1" and "v2" are one kernel here: v2 splits sequences into
partitions of 512 tokens, so the longest sequence (520) crosses a
partition edge in every case, and both versions map to the same call.
Not ported: USE_ALIBI True (kvcache has no ALiBi bias), the x-split key
cache layout [blocks][H][D/x][N][x] of the v1/v2 kernels (not a kvcache
layout; the flash layout carries the same attention),
test_multi_query_kv_attention (xformers' prefill, not a paged
kernel), the ROCm kernel and opcheck."""
import random

import numpy as np
import pytest

import kvcache
from peer_ref import E4M3, assert_one_rounding, e4m3_decode, pairwise

torch = pytest.importorskip("torch")

DTYPES = {"half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32}
KV_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
NUM_BLOCKS = 67
MAX_SEQ_LEN = 520
NUM_SEQS = 7

CASES = pairwise({"version": ["v1", "v2"], "num_heads": [(5, 5), (16, 2), (8, 2), (8, 1)],
                  "head_size": [64, 80, 96, 112, 120, 128, 192, 256],
                  "block_size": [16, 32], "dtype": list(DTYPES),
                  "kv_cache_dtype": ["auto", "fp8"]})


def ref_single_query_cached_kv_attention(query, g, key_cache, value_cache, block_tables,
                                         seq_lens, scale):
    """The peer's reference in float64: key_cache / value_cache
    [blocks][N][H][D] float64 (dequantized), query [S][Hq][D]."""
    S, Hq, D = query.shape
    N = key_cache.shape[1]
    out = np.empty((S, Hq, D))
    for i in range(S):
        n = int(seq_lens[i])
        j = np.arange(n)
        blk = np.asarray(block_tables[i])[j // N]
        keys = np.repeat(key_cache[blk, j % N], g, axis=1)  # [n][Hq][D]
        values = np.repeat(value_cache[blk, j % N], g, axis=1)
        w = scale * np.einsum("hd,khd->hk", query[i], keys)
        w = np.exp(w - w.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[i] = np.einsum("hk,khd->hd", w, values)
    return out


@pytest.mark.parametrize("version,num_heads,head_size,block_size,dtype,kv_cache_dtype", CASES)
def test_paged_attention(version, num_heads, head_size, block_size, dtype, kv_cache_dtype):
    random.seed(0)
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    fp8 = kv_cache_dtype == "fp8"
    scale = float(1.0 / head_size ** 0.5)
    num_query_heads, num_kv_heads = num_heads
    query = torch.empty(NUM_SEQS, num_query_heads, head_size, dtype=dt).uniform_(-scale, scale)
    g = num_query_heads // num_kv_heads

    seq_lens = [random.randint(1, MAX_SEQ_LEN) for _ in range(NUM_SEQS)]
    seq_lens[-1] = MAX_SEQ_LEN
    max_blocks = (MAX_SEQ_LEN + block_size - 1) // block_size
    block_tables = torch.tensor([[random.randint(0, NUM_BLOCKS - 1) for _ in range(max_blocks)]
                                 for _ in range(NUM_SEQS)], dtype=torch.int)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int)

    shape = (2, NUM_BLOCKS, block_size, num_kv_heads, head_size)  # vLLM's flash layout
    if fp8:
        codes = np.flatnonzero(np.abs(E4M3) <= scale).astype(np.uint8)
        kv = torch.from_numpy(np.random.default_rng(0).choice(codes, shape))
        k_scale, v_scale = 0.5, 0.25
        kv64 = e4m3_decode(kv.numpy())
        key64, value64 = kv64[0] * k_scale, kv64[1] * v_scale
    else:
        kv = torch.empty(shape, dtype=torch.float32).uniform_(-scale, scale).to(dt)
        key64, value64 = (x.double().numpy() for x in kv.unbind(0))
    lay = kvcache.Layout(num_layers=1, num_blocks=NUM_BLOCKS, block_tokens=block_size,
                         num_heads=num_kv_heads, head_dim=head_size,
                         dtype="fp8_e4m3" if fp8 else KV_NAMES[dt])
    pc = kvcache.PagedCache(lay, kv)
    pages = kvcache.Pages.from_block_table(lay, block_tables, seq_lens)
    before = kv.clone()

    output = torch.empty_like(query)  # vLLM: the query's dtype
    pc.decode(0, query, pages, output, scale=scale,
              scales=([k_scale], [v_scale]) if fp8 else None)

    ref = ref_single_query_cached_kv_attention(query.double().numpy(), g, key64, value64,
                                               block_tables.numpy(), seq_lens.numpy(), scale)
    assert_one_rounding(output.double().numpy(), ref, KV_NAMES[dt],
                        "%s output" % version, vmax=np.abs(value64).max())
    assert torch.equal(kv.view(torch.uint8), before.view(torch.uint8)), "decode changed the cache"
