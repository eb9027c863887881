/*
 * cache.c - one side's cache: what prefill and decode each hold.
 *
 * A side is a kv_cache (arena, block pool, page table, layout: one call
 * creates them all) and the kernels' view of its arena (kv_cache_paged).
 * Prefill has one side, decode one per layout group. The helpers below
 * reach a block's bytes through the layout (kv_layout_block_runs: where a
 * block's data lies, whatever the order, arrangement or padding) and
 * export a sequence's pages the way the attention kernels take them.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kvdemo.h"

/* A side over layout lc (prefix: with prefix caching); false, named, when
 * the library refuses it. */
bool side_make(struct side *s, const struct kv_layout_config *lc, bool prefix)
{
    memset(s, 0, sizeof(*s));
    struct kv_cache_config cfg;
    kv_cache_config_init(&cfg);
    cfg.layout = *lc;
    cfg.max_seqs = 16;
    cfg.enable_prefix_caching = prefix;
    if (!ok_call(kv_cache_create(&cfg, &s->c), "kv_cache_create"))
        return false;
    s->pt = kv_cache_page_table(s->c);
    s->pool = kv_cache_pool(s->c);
    s->lo = kv_cache_layout(s->c);
    if (!ok_call(kv_cache_paged(s->c, &s->pc), "kv_cache_paged"))
        return false;
    snprintf(s->desc, sizeof(s->desc), "N=%" PRId64 " %s %s%s", lc->block_tokens,
             kv_order_name(lc->order), kv_arrange_name(lc->arrange),
             lc->block_pad_elems || lc->block_stride_bytes ? " padded" : "");
    return true;
}

void side_free(struct side *s)
{
    kv_cache_destroy(s->c);
    memset(s, 0, sizeof(*s));
}

/* Every byte of block b's data (its runs, padding excluded): copied into out,
 * or from in, or (both NULL) set to fill. */
void block_bytes(const struct side *s, uint32_t b, unsigned char *out, const void *in, int fill)
{
    struct kv_byte_runs br;
    if (kv_layout_block_runs(s->lo, b, &br) != KV_OK)
        return;
    unsigned char *base = s->pc.base;
    for (int64_t i = 0; i < br.run_count; i++) {
        unsigned char *p = base + br.first_offset_bytes + i * br.run_stride_bytes;
        if (out)
            memcpy(out + i * br.run_bytes, p, (size_t)br.run_bytes);
        else if (in)
            memcpy(p, (const unsigned char *)in + i * br.run_bytes, (size_t)br.run_bytes);
        else
            memset(p, fill, (size_t)br.run_bytes);
    }
}

/* The bytes of one block's data: every layer, K and V, padding excluded. */
uint64_t block_data_bytes(const struct side *s)
{
    return (uint64_t)(s->lo->num_layers * s->lo->kv_planes * s->lo->block_bytes);
}

/* The CSR pages of one sequence (arrays sized by the caller). */
bool seq_pages(const struct side *s, uint32_t seq, int32_t *indptr, int32_t *indices,
               uint64_t indices_len, int32_t *last, struct kv_pages *pages)
{
    const struct kv_flashinfer_export fx = {indptr, 2, indices, indices_len, last, 1};
    if (!ok_call(kv_page_table_export_flashinfer(s->pt, &seq, 1, &fx, NULL),
                 "kv_page_table_export_flashinfer"))
        return false;
    memset(pages, 0, sizeof(*pages));
    pages->format = KV_PAGES_CSR;
    pages->n_seqs = 1;
    pages->page_ratio = 1;
    pages->indptr = indptr;
    pages->indices = indices;
    pages->last_page_len = last;
    return true;
}

/* Views of host K and V of T tokens in the generator's shape: [L][T][H][D] bf16. */
bool views_of_kv(uint16_t *k, uint16_t *v, uint32_t T, struct kv_view *kv_, struct kv_view *vv)
{
    const int64_t shape[4] = {L_LAYERS, T, H_KV, D_HEAD};
    const size_t bytes = (size_t)L_LAYERS * T * H_KV * D_HEAD * ELEM;
    return ok_call(kv_view_init(k, bytes, DTYPE, 4, shape, kv_), "kv_view_init (K)") &&
           ok_call(kv_view_init(v, bytes, DTYPE, 4, shape, vv), "kv_view_init (V)");
}
