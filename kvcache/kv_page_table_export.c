/* kv_page_table_export.c - the page table's exports in the forms kernels
 * take (kv_page_table.h): vLLM's block table + slot mapping (+ seq_lens) and
 * FlashInfer's CSR indptr / indices / last_page_len, each with a size query
 * (NULL buffers report the sizes). No per-token allocation. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kv_lib.h"
#include "kv_mem.h"
#include "kv_page_table_int.h"

/* ---- exports ----------------------------------------------------------------- */

static kv_status check_page_ids(const kv_page_table *pt, const char *fn)
{
    if (pt->any_block && (uint64_t)pt->max_id * pt->r + (pt->r - 1) > (uint64_t)INT32_MAX)
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: block id %" PRIu32 " x page_ratio %" PRIu32
                         " does not fit an int32 page id",
                         fn, pt->max_id, pt->r);
    return KV_OK;
}

/* A caller's array, read or written as words: misaligned is undefined
 * behaviour (NULL: not given, passes). */
static kv_status check_arrays_aligned(const char *fn, const char *const *names,
                                      const void *const *ptrs, const size_t *aligns, int n)
{
    for (int i = 0; i < n; i++) {
        const kv_status st = kv__check_aligned(fn, names[i], ptrs[i], aligns[i]);
        if (st != KV_OK)
            return st;
    }
    return KV_OK;
}

/* The end of n elements of size bytes at p, saturating at the top of the
 * address space (a length the caller overstates cannot wrap the check). */
static uintptr_t span_end(const void *p, uint64_t n, size_t size)
{
    const uintptr_t a = (uintptr_t)p;
    if (n > (UINTPTR_MAX - a) / size)
        return UINTPTR_MAX;
    return a + (uintptr_t)(n * size);
}

/* An output the fill writes over an input it reads (seqs, ranges): the
 * values pass 1 checked would be replaced by page ids and slots, and the
 * fill would go on with those unchecked. */
static kv_status check_apart(const char *fn, const char *oname, const void *o, uint64_t on,
                             size_t osize, const char *iname, const void *in, uint64_t inn,
                             size_t isize)
{
    if (!o || !in || on == 0 || inn == 0)
        return KV_OK;
    const uintptr_t oa = (uintptr_t)o, ob = span_end(o, on, osize);
    const uintptr_t ia = (uintptr_t)in, ib = span_end(in, inn, isize);
    if (oa < ib && ia < ob)
        return kv__error(KV_ERR_OVERLAP,
                         "%s: the output %s [%p, %p) overlaps the input %s [%p, %p) (the export "
                         "reads it while it writes)",
                         fn, oname, (void *)oa, (void *)ob, iname, (void *)ia, (void *)ib);
    return KV_OK;
}

static inline uint64_t seq_pages(const kv_page_table *pt, const struct kv__seq *s)
{
    return (s->n_tokens + pt->page_tokens - 1) / pt->page_tokens;
}

/* Pages [0, n_pages) of s into dst: block b -> b*r .. b*r + r-1. */
static void write_pages(const kv_page_table *pt, const struct kv__seq *s, uint64_t n_pages,
                        int32_t *dst)
{
    const uint32_t r = pt->r;
    if (r == 1) {
        for (uint64_t j = 0; j < n_pages; j++)
            dst[j] = (int32_t)s->blocks[j];
        return;
    }
    uint64_t j = 0;
    for (uint32_t b = 0; j < n_pages; b++) {
        int32_t first = (int32_t)(s->blocks[b] * r);
        for (uint32_t k = 0; k < r && j < n_pages; k++)
            dst[j++] = first + (int32_t)k;
    }
}

kv_status kv_page_table_export_vllm(const kv_page_table *pt, const uint32_t *seqs, uint32_t n_seqs,
                                    const struct kv_token_range *ranges,
                                    const struct kv_vllm_export *out)
{
    static const char fn[] = "kv_page_table_export_vllm";
    if (!pt || !out || (!seqs && n_seqs))
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !pt ? "pt" : !out ? "out" : "seqs");
    if (out->slot_mapping && !ranges && n_seqs)
        return kv__error(KV_ERR_NULL, "%s: ranges is NULL but slot_mapping is requested", fn);
    const char *const names[] = {"seqs", "ranges", "block_table", "slot_mapping", "seq_lens"};
    const void *const ptrs[] = {n_seqs ? seqs : NULL, n_seqs ? ranges : NULL, out->block_table,
                                out->slot_mapping, out->seq_lens};
    const size_t aligns[] = {sizeof(*seqs), _Alignof(struct kv_token_range),
                             sizeof(*out->block_table), sizeof(*out->slot_mapping),
                             sizeof(*out->seq_lens)};
    kv_status st = check_arrays_aligned(fn, names, ptrs, aligns, 5);
    if (st == KV_OK)
        st = check_page_ids(pt, fn);
    if (st != KV_OK)
        return st;

    /* pass 1: validate everything, size the outputs. The slot mapping is
     * sized (and ranges checked) when it is written or, given ranges, when
     * the sizes are asked for: a size query checks what the export would. */
    const bool slots_sized = out->slot_mapping || (out->sizes && ranges);
    uint64_t max_pages = 0, total = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        const struct kv__seq *s = kv__pt_seq_get(pt, seqs[i]);
        if (!s)
            return kv__error(KV_ERR_NOT_FOUND, "%s: seqs[%" PRIu32 "] = %" PRIu32 " is not live",
                             fn, i, seqs[i]);
        uint64_t pages = seq_pages(pt, s);
        if (pages > max_pages)
            max_pages = pages;
        if (slots_sized) {
            const struct kv_token_range *rg = &ranges[i];
            if (rg->start > s->n_tokens || rg->count > s->n_tokens - rg->start)
                return kv__error(KV_ERR_OUT_OF_BOUNDS,
                                 "%s: ranges[%" PRIu32 "] = [%" PRIu64 ", +%" PRIu64
                                 ") outside seq %" PRIu32 " of %" PRIu64 " tokens",
                                 fn, i, rg->start, rg->count, seqs[i], s->n_tokens);
            if (out->tokens_per_seq && rg->count > out->tokens_per_seq)
                return kv__error(KV_ERR_INVALID_ARG,
                                 "%s: ranges[%" PRIu32 "].count %" PRIu64
                                 " > tokens_per_seq %" PRIu32,
                                 fn, i, rg->count, out->tokens_per_seq);
            if (rg->count > UINT64_MAX - total) /* was unchecked: a wrapped total sized the
                                                     buffer, and the export overran it */
                return kv__error(KV_ERR_OVERFLOW,
                                 "%s: ranges[%" PRIu32 "].count %" PRIu64 " makes the slots of "
                                 "ranges 0..%" PRIu32 " exceed 2^64 (%" PRIu64 " before it)",
                                 fn, i, rg->count, i, total);
            total += rg->count;
        }
    }
    if (max_pages > UINT32_MAX) /* not reached with distinct blocks: page ids are < 2^31 */
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: %" PRIu64 " pages in one sequence exceed a uint32 column count", fn,
                         max_pages);
    if (out->block_table) {
        if (max_pages > out->block_table_cols)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: block_table_cols %" PRIu32 " < %" PRIu64
                             " pages of the longest sequence",
                             fn, out->block_table_cols, max_pages);
        if ((uint64_t)n_seqs * out->block_table_cols > out->block_table_len)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: block_table_len %" PRIu64 " < %" PRIu32 " seqs x %" PRIu32
                             " cols",
                             fn, out->block_table_len, n_seqs, out->block_table_cols);
    }
    uint64_t slots = !slots_sized          ? 0
                     : out->tokens_per_seq ? (uint64_t)n_seqs * out->tokens_per_seq
                                           : total;
    if (out->slot_mapping && slots > out->slot_mapping_len)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: slot_mapping_len %" PRIu64 " < %" PRIu64 " slots needed", fn,
                         out->slot_mapping_len, slots);
    if (out->seq_lens && out->seq_lens_len < n_seqs)
        return kv__error(KV_ERR_INVALID_ARG, "%s: seq_lens_len %" PRIu64 " < n_seqs %" PRIu32, fn,
                         out->seq_lens_len, n_seqs);
    /* every output apart from what the fill reads: seqs, and ranges when
     * the slot mapping is sized from them */
    const struct {
        const char *name;
        const void *p;
        uint64_t n;
        size_t size;
    } outs[] = {
        {"block_table", out->block_table, (uint64_t)n_seqs * out->block_table_cols,
         sizeof(*out->block_table)},
        {"slot_mapping", out->slot_mapping, out->slot_mapping_len, sizeof(*out->slot_mapping)},
        {"seq_lens", out->seq_lens, n_seqs, sizeof(*out->seq_lens)},
    };
    for (int i = 0; i < 3; i++)
        if ((st = check_apart(fn, outs[i].name, outs[i].p, outs[i].n, outs[i].size, "seqs", seqs,
                              n_seqs, sizeof(*seqs))) != KV_OK ||
            (st = check_apart(fn, outs[i].name, outs[i].p, outs[i].n, outs[i].size, "ranges",
                              slots_sized ? ranges : NULL, n_seqs, sizeof(*ranges))) != KV_OK)
            return st;

    /* pass 2: fill */
    if (out->block_table) {
        const uint64_t cols = out->block_table_cols;
        for (uint32_t i = 0; i < n_seqs; i++) {
            const struct kv__seq *s = &pt->seqs[seqs[i]];
            int32_t *row = out->block_table + i * cols; /* [cols] */
            uint64_t pages = seq_pages(pt, s);
            write_pages(pt, s, pages, row);
            for (uint64_t j = pages; j < cols; j++)
                row[j] = out->block_table_pad;
        }
    }
    if (out->slot_mapping) {
        int64_t *sm = out->slot_mapping; /* [slot_mapping_len] */
        const uint64_t N = pt->N;
        uint64_t pos = 0;
        for (uint32_t i = 0; i < n_seqs; i++) {
            const struct kv__seq *s = &pt->seqs[seqs[i]];
            uint64_t t = ranges[i].start, end = t + ranges[i].count;
            if (out->tokens_per_seq)
                pos = (uint64_t)i * out->tokens_per_seq;
            while (t < end) { /* one block at a time: no division per token */
                uint64_t off = t % N, chunk = N - off;
                if (chunk > end - t)
                    chunk = end - t;
                int64_t first = (int64_t)s->blocks[t / N] * (int64_t)N + (int64_t)off;
                for (uint64_t k = 0; k < chunk; k++)
                    sm[pos + k] = first + (int64_t)k;
                pos += chunk;
                t += chunk;
            }
            if (out->tokens_per_seq)
                for (uint64_t e = (uint64_t)(i + 1) * out->tokens_per_seq; pos < e; pos++)
                    sm[pos] = -1;
        }
        for (; pos < out->slot_mapping_len; pos++)
            sm[pos] = -1;
    }
    if (out->seq_lens) {
        int64_t *sl = out->seq_lens; /* [seq_lens_len] */
        for (uint32_t i = 0; i < n_seqs; i++)
            sl[i] = (int64_t)pt->seqs[seqs[i]].n_tokens; /* < 2^32 * 2^31 */
    }
    if (out->sizes)
        *out->sizes = (struct kv_vllm_export_sizes){.block_table_cols = (uint32_t)max_pages,
                                                    .block_table_len = (uint64_t)n_seqs * max_pages,
                                                    .slot_mapping_len = slots,
                                                    .seq_lens_len = n_seqs};
    return kv__ok();
}

kv_status kv_page_table_export_flashinfer(const kv_page_table *pt, const uint32_t *seqs,
                                          uint32_t n_seqs, const struct kv_flashinfer_export *out,
                                          uint64_t *nnz_out)
{
    static const char fn[] = "kv_page_table_export_flashinfer";
    if (!pt || (!seqs && n_seqs))
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !pt ? "pt" : "seqs");
    /* out NULL: a size query (every buffer NULL) */
    static const struct kv_flashinfer_export none = {0};
    const struct kv_flashinfer_export *o = out ? out : &none;
    const char *const names[] = {"seqs", "indptr", "indices", "last_page_len"};
    const void *const ptrs[] = {n_seqs ? seqs : NULL, o->indptr, o->indices, o->last_page_len};
    const size_t aligns[] = {sizeof(*seqs), sizeof(*o->indptr), sizeof(*o->indices),
                             sizeof(*o->last_page_len)};
    kv_status st = check_arrays_aligned(fn, names, ptrs, aligns, 4);
    if (st == KV_OK)
        st = check_page_ids(pt, fn);
    if (st != KV_OK)
        return st;

    uint64_t nnz = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        const struct kv__seq *s = kv__pt_seq_get(pt, seqs[i]);
        if (!s)
            return kv__error(KV_ERR_NOT_FOUND, "%s: seqs[%" PRIu32 "] = %" PRIu32 " is not live",
                             fn, i, seqs[i]);
        nnz += seq_pages(pt, s);
    }
    if (nnz > (uint64_t)INT32_MAX)
        return kv__error(KV_ERR_OVERFLOW, "%s: %" PRIu64 " pages exceed int32 indptr", fn, nnz);
    if (o->last_page_len && pt->page_tokens > (uint64_t)INT32_MAX)
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: pages of %" PRIu64 " tokens: last_page_len is int32 (FlashInfer's)",
                         fn, (uint64_t)pt->page_tokens);
    if (o->indptr && o->indptr_len < (uint64_t)n_seqs + 1)
        return kv__error(KV_ERR_INVALID_ARG, "%s: indptr_len %" PRIu64 " < n_seqs + 1 = %" PRIu64,
                         fn, o->indptr_len, (uint64_t)n_seqs + 1);
    if (o->last_page_len && o->last_page_len_len < n_seqs)
        return kv__error(KV_ERR_INVALID_ARG, "%s: last_page_len_len %" PRIu64 " < n_seqs %" PRIu32,
                         fn, o->last_page_len_len, n_seqs);
    if (o->indices && o->indices_len < nnz)
        return kv__error(KV_ERR_INVALID_ARG, "%s: indices_len %" PRIu64 " < nnz %" PRIu64, fn,
                         o->indices_len, nnz);
    if ((st = check_apart(fn, "indptr", o->indptr, (uint64_t)n_seqs + 1, sizeof(*o->indptr), "seqs",
                          seqs, n_seqs, sizeof(*seqs))) != KV_OK ||
        (st = check_apart(fn, "indices", o->indices, nnz, sizeof(*o->indices), "seqs", seqs, n_seqs,
                          sizeof(*seqs))) != KV_OK ||
        (st = check_apart(fn, "last_page_len", o->last_page_len, n_seqs, sizeof(*o->last_page_len),
                          "seqs", seqs, n_seqs, sizeof(*seqs))) != KV_OK)
        return st;

    const uint64_t P = pt->page_tokens;
    uint64_t at = 0;
    if (o->indptr)
        o->indptr[0] = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        const struct kv__seq *s = &pt->seqs[seqs[i]];
        uint64_t pages = seq_pages(pt, s);
        if (o->indices)
            write_pages(pt, s, pages, o->indices + at);
        at += pages;
        if (o->indptr)
            o->indptr[i + 1] = (int32_t)at;
        if (o->last_page_len) /* empty: 0 pages, last_page_len 0 (FlashInfer's convention) */
            o->last_page_len[i] = pages ? (int32_t)(s->n_tokens - (pages - 1) * P) : 0;
    }
    if (nnz_out)
        *nnz_out = nnz;
    return kv__ok();
}
