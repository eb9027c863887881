/*
 * kv_peers_shim.c - the small C surface scripts/bench_peers.py drives through
 * ctypes: one kv_cache (one layer, bf16, N 16, H 8, D 128), sequences grown
 * through its page table as an engine grows them, the page-table exports,
 * and the CPU kernels on flat contiguous tensors; and, for the pack_convert
 * case, a packed request of a Llama-3-8B-like cache (shim_pack_*) unpacked
 * into an HND block-major cache. Not a Python binding (the package is
 * python/kvcache); a benchmark fixture.
 *
 * Every function but shim_error, shim_threads and the frees returns a
 * kv_status (0 = KV_OK); shim_error() gives the message of the last failure.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <kvcache/kv.h>

#define SHIM_API __attribute__((visibility("default")))

static const int64_t N = 16, H = 8, D = 128;

SHIM_API const char *shim_error(void);
SHIM_API int shim_new(int order, int64_t blocks, uint32_t max_seqs, kv_cache **out);
SHIM_API void shim_free(kv_cache *c);
SHIM_API int shim_geometry(kv_cache *c, void **base, int64_t out[5]);
SHIM_API int shim_add_seqs(kv_cache *c, uint32_t S, int64_t len, uint32_t *ids);
SHIM_API int shim_export(kv_cache *c, const uint32_t *ids, uint32_t S, int64_t T, int64_t *slots,
                         int32_t *bt, uint32_t cols, int32_t *indptr, int32_t *indices,
                         uint64_t n_indices, int32_t *last);
SHIM_API int shim_time_slot_mapping(kv_cache *c, const uint32_t *ids, uint32_t S, int64_t T,
                                    int64_t *slots, int iters, double *sec);
SHIM_API int shim_write(kv_cache *c, void *k, void *v, const int64_t *slots, int64_t T);
SHIM_API int shim_read(kv_cache *c, const int32_t *indptr, const int32_t *indices,
                       const int32_t *last, uint32_t S, void *ko, void *vo, int64_t T);
SHIM_API int shim_decode(kv_cache *c, void *q, uint32_t S, int64_t Hq, const int32_t *indptr,
                         const int32_t *indices, const int32_t *last, float scale, void *out);

SHIM_API int shim_threads(void);
struct shim_pack;
SHIM_API int shim_pack_new(int64_t T, struct shim_pack **out);
SHIM_API void shim_pack_free(struct shim_pack *p);
SHIM_API int shim_pack_geometry(const struct shim_pack *p, void **src, int64_t src_g[8], void **dst,
                                int64_t dst_g[8], const uint32_t **sid, const uint32_t **did,
                                int64_t *n_blocks, uint64_t *payload_bytes);
SHIM_API int shim_pack_unpack(struct shim_pack *p);

SHIM_API const char *shim_error(void)
{
    return kv_last_error();
}

/* A cache of `blocks` blocks in `order` (0 NHD, 1 HND) for max_seqs
 * sequences. */
SHIM_API int shim_new(int order, int64_t blocks, uint32_t max_seqs, kv_cache **out)
{
    struct kv_cache_config cfg = KV_CACHE_CONFIG_INIT;
    cfg.layout.num_layers = 1;
    cfg.layout.num_blocks = blocks;
    cfg.layout.block_tokens = N;
    cfg.layout.num_heads = H;
    cfg.layout.head_dim = D;
    cfg.layout.dtype = KV_BF16;
    cfg.layout.order = order ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.max_seqs = max_seqs;
    return kv_cache_create(&cfg, out);
}

SHIM_API void shim_free(kv_cache *c)
{
    kv_cache_destroy(c);
}

/* base address and byte strides: out[0..4] = block, token, head, kv, total */
SHIM_API int shim_geometry(kv_cache *c, void **base, int64_t out[5])
{
    const struct kv_layout *lo = kv_cache_layout(c);
    *base = kv_arena_base(kv_cache_arena(c));
    out[0] = lo->stride_block_bytes;
    out[1] = lo->stride_token_bytes;
    out[2] = lo->stride_head_bytes;
    out[3] = lo->stride_kv_bytes;
    out[4] = lo->total_bytes;
    return KV_OK;
}

/* S sequences of len tokens each, appended 16 tokens at a time round robin
 * (their blocks interleave, as concurrent requests' do). ids[S] out. */
SHIM_API int shim_add_seqs(kv_cache *c, uint32_t S, int64_t len, uint32_t *ids)
{
    kv_page_table *pt = kv_cache_page_table(c);
    kv_status st;
    for (uint32_t s = 0; s < S; s++)
        if ((st = kv_page_table_seq_create(pt, &ids[s])) != KV_OK)
            return st;
    for (int64_t done = 0; done < len; done += N)
        for (uint32_t s = 0; s < S; s++) {
            const uint64_t n = (uint64_t)(len - done < N ? len - done : N);
            if ((st = kv_page_table_seq_append(pt, ids[s], NULL, n)) != KV_OK)
                return st;
        }
    return KV_OK;
}

/* Every token of each of the S sequences: rg[s] = [0, len). Free *out. */
static kv_status whole_ranges(kv_page_table *pt, const uint32_t *ids, uint32_t S,
                              struct kv_token_range **out)
{
    struct kv_token_range *rg = calloc(S ? S : 1, sizeof(*rg));
    if (!rg)
        return KV_ERR_NO_MEMORY;
    for (uint32_t s = 0; s < S; s++) {
        uint64_t n = 0;
        kv_status e = kv_page_table_seq_len(pt, ids[s], &n);
        if (e != KV_OK) {
            free(rg);
            return e;
        }
        rg[s] = (struct kv_token_range){0, n};
    }
    *out = rg;
    return KV_OK;
}

/* The exports of the S sequences' tokens: slot mapping [T], block table
 * [S][cols] (pad 0), CSR indptr [S+1], indices [T/N+S], last_page_len [S]. */
SHIM_API int shim_export(kv_cache *c, const uint32_t *ids, uint32_t S, int64_t T, int64_t *slots,
                         int32_t *bt, uint32_t cols, int32_t *indptr, int32_t *indices,
                         uint64_t n_indices, int32_t *last)
{
    kv_page_table *pt = kv_cache_page_table(c);
    struct kv_token_range *rg = NULL;
    kv_status e = whole_ranges(pt, ids, S, &rg);
    if (e != KV_OK)
        return e;
    struct kv_vllm_export ve = {.block_table = bt,
                                .block_table_len = (uint64_t)S * cols,
                                .block_table_cols = cols,
                                .block_table_pad = 0,
                                .slot_mapping = slots,
                                .slot_mapping_len = (uint64_t)T};
    struct kv_flashinfer_export fe = {indptr, S + 1, indices, n_indices, last, S};
    kv_status st = kv_page_table_export_vllm(pt, ids, S, rg, &ve);
    if (st == KV_OK)
        st = kv_page_table_export_flashinfer(pt, ids, S, &fe, NULL);
    free(rg);
    return st;
}

/* Seconds per kv_page_table_export_vllm of the slot mapping alone (median
 * of `runs` runs of `iters` calls), timed here so ctypes is not timed. */
SHIM_API int shim_time_slot_mapping(kv_cache *c, const uint32_t *ids, uint32_t S, int64_t T,
                                    int64_t *slots, int iters, double *sec)
{
    kv_page_table *pt = kv_cache_page_table(c);
    struct kv_token_range *rg = NULL;
    kv_status e = whole_ranges(pt, ids, S, &rg);
    if (e != KV_OK)
        return e;
    struct kv_vllm_export ve = {.slot_mapping = slots, .slot_mapping_len = (uint64_t)T};
    struct timespec a, b;
    kv_status st = KV_OK;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < iters && st == KV_OK; i++)
        st = kv_page_table_export_vllm(pt, ids, S, rg, &ve);
    clock_gettime(CLOCK_MONOTONIC, &b);
    *sec = ((double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9) / iters;
    free(rg);
    return st;
}

static kv_status shim_view(void *p, int64_t a, int64_t b, int64_t c3, kv_dtype dt,
                           struct kv_view *v)
{
    const int64_t shape[3] = {a, b, c3};
    return kv_view_init(p, (size_t)(a * b * c3) * kv_dtype_size(dt), dt, 3, shape, v);
}

/* kv_attn_write of contiguous bf16 K, V [T][8][128] into slots[T]. */
SHIM_API int shim_write(kv_cache *c, void *k, void *v, const int64_t *slots, int64_t T)
{
    struct kv_paged_cache pc;
    struct kv_view kk, vv;
    kv_status st;
    if ((st = kv_attn_cache(c, &pc)) != KV_OK || (st = shim_view(k, T, H, D, KV_BF16, &kk)) ||
        (st = shim_view(v, T, H, D, KV_BF16, &vv)))
        return st;
    return kv_attn_write(pc, 0, &kk, &vv, slots, T, NULL);
}

/* kv_attn_read of the S sequences of a CSR into contiguous bf16 [T][8][128]. */
SHIM_API int shim_read(kv_cache *c, const int32_t *indptr, const int32_t *indices,
                       const int32_t *last, uint32_t S, void *ko, void *vo, int64_t T)
{
    struct kv_paged_cache pc;
    struct kv_view kk, vv;
    kv_status st;
    if ((st = kv_attn_cache(c, &pc)) != KV_OK || (st = shim_view(ko, T, H, D, KV_BF16, &kk)) ||
        (st = shim_view(vo, T, H, D, KV_BF16, &vv)))
        return st;
    struct kv_pages pg = {.format = KV_PAGES_CSR, .n_seqs = S, .page_ratio = 1,
                          .indptr = indptr, .indices = indices, .last_page_len = last};
    return kv_attn_read(pc, 0, &pg, &kk, &vv, NULL);
}

/* kv_attn_decode: q, out contiguous bf16 [S][Hq][128]. */
SHIM_API int shim_decode(kv_cache *c, void *q, uint32_t S, int64_t Hq, const int32_t *indptr,
                         const int32_t *indices, const int32_t *last, float scale, void *out)
{
    struct kv_paged_cache pc;
    struct kv_view qq, oo;
    kv_status st;
    if ((st = kv_attn_cache(c, &pc)) != KV_OK || (st = shim_view(q, S, Hq, D, KV_BF16, &qq)) ||
        (st = shim_view(out, S, Hq, D, KV_BF16, &oo)))
        return st;
    struct kv_pages pg = {.format = KV_PAGES_CSR, .n_seqs = S, .page_ratio = 1,
                          .indptr = indptr, .indices = indices, .last_page_len = last};
    return kv_attn_decode(pc, 0, &qq, &pg, scale, NULL, &oo);
}

/* The OpenMP threads kvcache's CPU work runs on (kv_attn_threads). */
SHIM_API int shim_threads(void)
{
    return kv_attn_threads();
}

/* ---- pack_convert: the request of tools/bench/bench_pack.c ------------------------ */

/* One packed request and the caches on both sides:
 *   src  NHD layer-major, L 32, B nb + 64, N 16, H 8, D 128, bf16, random bytes
 *        [L][2][B][N][H][D]
 *   dst  HND block-major, the same dims, random bytes  [B][L][2][H][N][D]
 *   buf  kv_pack of src's blocks sid[0..nb), once
 * shim_pack_unpack runs kv_unpack(buf -> dst's blocks did[0..nb)). */
struct shim_pack {
    struct kv_paged_cache src, dst;
    uint32_t *sid, *did; /* [nb], distinct, random order */
    int64_t nb;
    kv_plan *up;
    void *buf;
    size_t len;
    uint64_t payload_bytes;
};

static void *shim_alloc_random(size_t bytes, uint64_t seed)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytes ? bytes : 1) != 0)
        return NULL;
    uint64_t *w = p; /* splitmix64 */
    for (size_t i = 0; i < bytes / 8; i++) {
        uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        w[i] = z ^ (z >> 31);
    }
    return p;
}

static kv_status shim_pack_cache(struct kv_paged_cache *pc, int64_t blocks, kv_order order,
                                 kv_arrange arr, uint64_t seed)
{
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = 32;
    c.num_blocks = blocks;
    c.block_tokens = N;
    c.num_heads = H;
    c.head_dim = D;
    c.dtype = KV_BF16;
    c.order = order;
    c.arrange = arr;
    kv_status st = kv_layout_init(&c, &pc->layout);
    if (st != KV_OK)
        return st;
    pc->storage_bytes = (size_t)pc->layout.total_bytes;
    pc->mem = KV_MEM_HOST;
    pc->base = shim_alloc_random(pc->storage_bytes, seed);
    return pc->base ? KV_OK : KV_ERR_NO_MEMORY;
}

/* n distinct ids of [0, range) in random order (a Fisher-Yates prefix). */
static kv_status shim_ids(uint32_t *ids, int64_t n, uint32_t range, uint64_t seed)
{
    uint32_t *all = malloc((size_t)range * sizeof(*all));
    if (!all)
        return KV_ERR_NO_MEMORY;
    for (uint32_t i = 0; i < range; i++)
        all[i] = i;
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t j = (uint32_t)i + (uint32_t)((seed >> 33) % (range - (uint32_t)i));
        const uint32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        ids[i] = all[i];
    }
    free(all);
    return KV_OK;
}

/* A T-token request (T a multiple of 16): caches, ids, the packed buffer and
 * the unpack plan, as described at struct shim_pack. */
SHIM_API int shim_pack_new(int64_t T, struct shim_pack **out)
{
    if (!out)
        return KV_ERR_NULL;
    if (T <= 0 || T % N)
        return KV_ERR_INVALID_ARG;
    struct shim_pack *p = calloc(1, sizeof(*p));
    if (!p)
        return KV_ERR_NO_MEMORY;
    p->nb = T / N;
    const uint32_t B = (uint32_t)p->nb + 64;
    kv_plan *pp = NULL;
    uint64_t size = 0;
    kv_status st = KV_ERR_NO_MEMORY;
    p->sid = malloc((size_t)p->nb * sizeof(*p->sid));
    p->did = malloc((size_t)p->nb * sizeof(*p->did));
    if (!p->sid || !p->did)
        goto fail;
    if ((st = shim_pack_cache(&p->src, B, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 3)) != KV_OK ||
        (st = shim_pack_cache(&p->dst, B, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, 4)) != KV_OK ||
        (st = shim_ids(p->sid, p->nb, B, 19)) != KV_OK ||
        (st = shim_ids(p->did, p->nb, B, 29)) != KV_OK ||
        (st = kv_pack_plan_create(&p->src.layout, &pp)) != KV_OK ||
        (st = kv_unpack_plan_create(&p->src.layout, &p->dst.layout, NULL, &p->up)) != KV_OK ||
        (st = kv_pack_size(&p->src.layout, (uint64_t)T, &size)) != KV_OK)
        goto fail;
    if (posix_memalign(&p->buf, 4096, (size_t)size) != 0) {
        p->buf = NULL;
        st = KV_ERR_NO_MEMORY;
        goto fail;
    }
    struct kv_pack_info info;
    if ((st = kv_pack(pp, p->src, p->sid, (uint32_t)p->nb, (uint64_t)T, p->buf, (size_t)size,
                      &p->len)) != KV_OK ||
        (st = kv_pack_inspect(p->buf, p->len, &info)) != KV_OK)
        goto fail;
    p->payload_bytes = info.payload_bytes;
    kv_plan_destroy(pp);
    *out = p;
    return KV_OK;
fail:
    kv_plan_destroy(pp);
    shim_pack_free(p);
    return st;
}

SHIM_API void shim_pack_free(struct shim_pack *p)
{
    if (!p)
        return;
    kv_plan_destroy(p->up);
    free(p->buf);
    free(p->src.base);
    free(p->dst.base);
    free(p->sid);
    free(p->did);
    free(p);
}

static void shim_layout_geometry(const struct kv_layout *lo, int64_t g[8])
{
    g[0] = lo->stride_layer_bytes;
    g[1] = lo->stride_kv_bytes;
    g[2] = lo->stride_block_bytes;
    g[3] = lo->stride_token_bytes;
    g[4] = lo->stride_head_bytes;
    g[5] = lo->stride_dim_bytes;
    g[6] = lo->total_bytes;
    g[7] = lo->num_blocks;
}

/* Base addresses and byte strides of both caches: g[0..7] = layer, kv,
 * block, token, head, dim, total bytes, blocks; the id lists [nb] (owned by
 * p); nb; the payload bytes kv_unpack moves. */
SHIM_API int shim_pack_geometry(const struct shim_pack *p, void **src, int64_t src_g[8], void **dst,
                                int64_t dst_g[8], const uint32_t **sid, const uint32_t **did,
                                int64_t *n_blocks, uint64_t *payload_bytes)
{
    *src = p->src.base;
    *dst = p->dst.base;
    shim_layout_geometry(&p->src.layout, src_g);
    shim_layout_geometry(&p->dst.layout, dst_g);
    *sid = p->sid;
    *did = p->did;
    *n_blocks = p->nb;
    *payload_bytes = p->payload_bytes;
    return KV_OK;
}

/* One kv_unpack of the packed request into dst's blocks did[0..nb): header
 * and every block checksum verified, then the NHD -> HND conversion. */
SHIM_API int shim_pack_unpack(struct shim_pack *p)
{
    return kv_unpack(p->up, p->buf, p->len, p->dst, p->did, (uint32_t)p->nb, NULL);
}
