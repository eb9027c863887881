/*
 * kv_peers_shim.c - the small C surface scripts/bench_peers.py drives through
 * ctypes: one kv_cache (one layer, bf16, N 16, H 8, D 128), sequences grown
 * through its page table as an engine grows them, the page-table exports,
 * and the CPU kernels on flat contiguous tensors. Not a Python binding (the
 * package is python/kvcache); a benchmark fixture.
 *
 * Every function returns a kv_status (0 = KV_OK); shim_error() gives the
 * message of the last failure.
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
