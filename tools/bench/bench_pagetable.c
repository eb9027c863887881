/*
 * bench_pagetable.c - page-table export benchmarks (see docs/bench-method.md).
 *
 *   pagetable.export  slot_mapping (vLLM, int64, every token of a prefill
 *                     batch) + FlashInfer CSR (indptr / indices /
 *                     last_page_len) for 256 sequences, 128k tokens in all,
 *                     N = 16, page ratio r = 1 and 4. Goal < 200 us.
 *                     Baseline "block_table_loop": per sequence, the block
 *                     table from kv_page_table_seq_blocks and a tight loop
 *                     over it writing each block's run of slots and pages
 *                     (what a C engineer would write instead; no checks).
 *                     Both outputs are compared in full: a difference fails
 *                     the run (kvb_mismatch).
 *
 * The block source is a tiny in-file pool (free stack, ref counts) handing
 * out scrambled ids, so block tables are not sequential.
 */
#include <stdio.h>

#include "bench.h"
#include "kv_mem.h"
#include "kv_page_table.h"

/* ---- tiny block source ------------------------------------------------------ */

struct kvb__pool {
    uint32_t n;
    uint32_t *free_ids; /* [n] stack */
    uint32_t n_free;
    uint32_t *ref; /* [n] */
};

static kv_status kvb__pool_alloc(void *ctx, uint32_t n, uint32_t *ids)
{
    struct kvb__pool *p = ctx;
    if (p->n_free < n)
        return KV_ERR_NO_BLOCKS;
    for (uint32_t i = 0; i < n; i++) {
        ids[i] = p->free_ids[--p->n_free];
        p->ref[ids[i]] = 1;
    }
    return KV_OK;
}

static kv_status kvb__pool_retain(void *ctx, const uint32_t *ids, uint32_t n)
{
    struct kvb__pool *p = ctx;
    for (uint32_t i = 0; i < n; i++)
        p->ref[ids[i]]++;
    return KV_OK;
}

static kv_status kvb__pool_release(void *ctx, const uint32_t *ids, uint32_t n)
{
    struct kvb__pool *p = ctx;
    for (uint32_t i = 0; i < n; i++)
        if (--p->ref[ids[i]] == 0)
            p->free_ids[p->n_free++] = ids[i];
    return KV_OK;
}

static uint32_t kvb__pool_ref(void *ctx, uint32_t id)
{
    struct kvb__pool *p = ctx;
    return id < p->n ? p->ref[id] : 0;
}

/* ---- baseline: a tight loop over each block table ----------------------------- */

/*
 * What a strong engineer writing the slot mapping and the CSR in C would do
 * with the table's public accessors: per sequence, one kv_page_table_seq_len
 * and one kv_page_table_seq_blocks (the borrowed block array), then for each
 * block b its run of slots b*N + k and its pages b*r + j -- no per-token
 * calls, no division, no allocation; for r == 1 the pages are the block ids.
 * It skips the candidate's checks (live ids, output lengths, int32 page
 * ids), so the ratio includes what those checks cost.
 */
static kv_status kvb__loop_export(const kv_page_table *pt, const uint32_t *seqs, uint32_t n_seqs,
                                  uint32_t N, uint32_t r, int64_t *slots, int32_t *indptr,
                                  int32_t *indices, int32_t *last_page_len)
{
    const uint32_t P = N / r; /* tokens per kernel page */
    uint64_t pos = 0, at = 0;
    indptr[0] = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        const uint32_t *blocks;
        uint32_t nb;
        uint64_t n_tokens;
        kv_status st = kv_page_table_seq_len(pt, seqs[i], &n_tokens);
        if (st == KV_OK)
            st = kv_page_table_seq_blocks(pt, seqs[i], &blocks, &nb);
        if (st != KV_OK)
            return st;
        const uint64_t len = n_tokens, pages = (len + P - 1) / P;
        /* slots: block b covers tokens [b*N, b*N + N) */
        for (uint64_t b = 0, t = 0; t < len; b++) {
            const int64_t first = (int64_t)blocks[b] * N;
            const uint64_t run = len - t < N ? len - t : N;
            for (uint64_t k = 0; k < run; k++)
                slots[pos + k] = first + (int64_t)k;
            pos += run;
            t += run;
        }
        /* pages: block b is pages b*r .. b*r + r-1 */
        if (r == 1) {
            for (uint64_t j = 0; j < pages; j++)
                indices[at + j] = (int32_t)blocks[j];
        } else {
            for (uint64_t b = 0, j = 0; j < pages; b++) {
                const int32_t first = (int32_t)(blocks[b] * r);
                const uint64_t run = pages - j < r ? pages - j : r;
                for (uint64_t k = 0; k < run; k++)
                    indices[at + j + k] = first + (int32_t)k;
                j += run;
            }
        }
        at += pages;
        indptr[i + 1] = (int32_t)at;
        last_page_len[i] = pages ? (int32_t)(len - (pages - 1) * P) : 0;
    }
    return KV_OK;
}

/* First index where a[n] and b[n] differ, or n. */
static uint64_t kvb__first_diff64(const int64_t *a, const int64_t *b, uint64_t n)
{
    uint64_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

static uint64_t kvb__first_diff32(const int32_t *a, const int32_t *b, uint64_t n)
{
    uint64_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* ---- pagetable.export -------------------------------------------------------- */

static void kvb__export_case(uint32_t r)
{
    static const char bench[] = "pagetable.export";
    const uint32_t S = kvb_quick() ? 32 : 256, N = 16;
    const uint64_t T = kvb_quick() ? 16384 : 131072;
    char case_name[128];
    snprintf(case_name, sizeof(case_name), "%useq/%llutok/N%u/r%u", S, (unsigned long long)T, N, r);
    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);

    const int runs = kvb_runs() < 64 ? kvb_runs() : 64, iters = kvb_quick() ? 5 : 20;
    const uint32_t n_blocks = (uint32_t)(T / N + S + 16);
    struct kvb__pool pool = {.n = n_blocks};
    pool.free_ids = kv__mem_calloc(n_blocks, sizeof(uint32_t));
    pool.ref = kv__mem_calloc(n_blocks, sizeof(uint32_t));
    uint32_t *seqs = kv__mem_calloc(S, sizeof(uint32_t));
    struct kv_token_range *rg = kv__mem_calloc(S, sizeof(*rg));
    int64_t *slots = kv__mem_calloc(T, sizeof(int64_t));
    int32_t *indptr = kv__mem_calloc(S + 1, sizeof(int32_t));
    int32_t *lpl = kv__mem_calloc(S, sizeof(int32_t));
    const uint64_t max_pages = (T / N + S) * r;
    int32_t *indices = kv__mem_calloc(max_pages, sizeof(int32_t));
    int64_t *slots2 = kv__mem_calloc(T, sizeof(int64_t));
    int32_t *indptr2 = kv__mem_calloc(S + 1, sizeof(int32_t));
    int32_t *lpl2 = kv__mem_calloc(S, sizeof(int32_t));
    int32_t *indices2 = kv__mem_calloc(max_pages, sizeof(int32_t));
    kv_page_table *pt = NULL;
    double tc[64], tb[64];
    kv_status st;
    if (!pool.free_ids || !pool.ref || !seqs || !rg || !slots || !indptr || !lpl || !indices ||
        !slots2 || !indptr2 || !lpl2 || !indices2) {
        kvb_failed(bench, case_name, "out of memory for %u sequences of %llu tokens", S,
                   (unsigned long long)T);
        goto out;
    }
    /* scrambled free stack: ids come out in a stride-7919 order */
    for (uint32_t k = 0; k < n_blocks; k++)
        pool.free_ids[k] = (uint32_t)(((uint64_t)k * 7919 + 13) % n_blocks);
    pool.n_free = n_blocks;
    if (n_blocks % 7919 == 0) { /* not a permutation: fall back to sequential */
        for (uint32_t k = 0; k < n_blocks; k++)
            pool.free_ids[k] = k;
    }

    struct kv_page_table_config cfg = {.struct_size = sizeof(struct kv_page_table_config),
                                       .block_tokens = N,
                                       .page_ratio = r,
                                       .max_seqs = S,
                                       .max_blocks_per_seq = (uint32_t)(T / N),
                                       .ops = {.version = KV_BLOCK_OPS_VERSION,
                                               .ctx = &pool,
                                               .alloc = kvb__pool_alloc,
                                               .retain = kvb__pool_retain,
                                               .release = kvb__pool_release,
                                               .ref_count = kvb__pool_ref}};
    if ((st = kv_page_table_create(&cfg, &pt)) != KV_OK)
        goto fail;
    /* lengths T/S +- T/(2S), summing to exactly T; appended interleaved */
    uint64_t left = T;
    for (uint32_t i = 0; i < S; i++) {
        uint64_t avg = T / S, len = i + 1 == S ? left : avg / 2 + (i * 2654435761u) % avg;
        if (len > left)
            len = left;
        left -= len;
        rg[i] = (struct kv_token_range){0, len};
        if ((st = kv_page_table_seq_create(pt, &seqs[i])) != KV_OK)
            goto fail;
    }
    for (uint64_t chunk = 0; chunk < T; chunk += 37)
        for (uint32_t i = 0; i < S; i++) {
            uint64_t have = chunk < rg[i].count ? chunk : rg[i].count;
            uint64_t n = rg[i].count - have < 37 ? rg[i].count - have : 37;
            if (n && (st = kv_page_table_seq_append(pt, seqs[i], NULL, n)) != KV_OK)
                goto fail;
        }

    struct kv_vllm_export ve = {.slot_mapping = slots, .slot_mapping_len = T};
    struct kv_flashinfer_export fe = {indptr, S + 1, indices, max_pages, lpl, S};
    for (int run = -1; run < runs; run++) { /* run == -1: warm-up */
        double t0 = kvb_now();
        for (int it = 0; it < iters; it++) {
            if ((st = kv_page_table_export_vllm(pt, seqs, S, rg, &ve)) != KV_OK ||
                (st = kv_page_table_export_flashinfer(pt, seqs, S, &fe, NULL)) != KV_OK)
                goto fail;
        }
        double t1 = kvb_now();
        for (int it = 0; it < iters; it++)
            if ((st = kvb__loop_export(pt, seqs, S, N, r, slots2, indptr2, indices2, lpl2)) !=
                KV_OK)
                goto fail;
        double t2 = kvb_now();
        if (run >= 0) {
            tc[run] = (t1 - t0) / iters * 1e6;
            tb[run] = (t2 - t1) / iters * 1e6;
        }
    }
    /* both paths must agree, or the numbers mean nothing */
    {
        const uint64_t ds = kvb__first_diff64(slots, slots2, T);
        const uint64_t dp = kvb__first_diff32(indptr, indptr2, (uint64_t)S + 1);
        const uint64_t nnz = dp == (uint64_t)S + 1 ? (uint64_t)indptr[S] : 0;
        const uint64_t di = kvb__first_diff32(indices, indices2, nnz);
        const uint64_t dl = kvb__first_diff32(lpl, lpl2, S);
        if (ds < T) {
            kvb_mismatch(bench, case_name, "slot_mapping[%llu]: export %lld, block_table_loop %lld",
                         (unsigned long long)ds, (long long)slots[ds], (long long)slots2[ds]);
            goto out;
        }
        if (dp <= S) {
            kvb_mismatch(bench, case_name, "indptr[%llu]: export %d, block_table_loop %d",
                         (unsigned long long)dp, indptr[dp], indptr2[dp]);
            goto out;
        }
        if (di < nnz) {
            kvb_mismatch(bench, case_name, "indices[%llu]: export %d, block_table_loop %d",
                         (unsigned long long)di, indices[di], indices2[di]);
            goto out;
        }
        if (dl < S) {
            kvb_mismatch(bench, case_name, "last_page_len[%llu]: export %d, block_table_loop %d",
                         (unsigned long long)dl, lpl[dl], lpl2[dl]);
            goto out;
        }
    }
    kvb_sink((uint64_t)slots[T - 1] + (uint64_t)indices[0]);
    kvb_emit_us(bench, case_name, kvb_median(tc, runs), "block_table_loop", kvb_median(tb, runs),
                runs);
    goto out;
fail:
    kvb_failed(bench, case_name, "%s (%s)", kv_status_name(st), kv_last_error());
out:
    kv_page_table_destroy(pt);
    kv__mem_free(indices2);
    kv__mem_free(lpl2);
    kv__mem_free(indptr2);
    kv__mem_free(slots2);
    kv__mem_free(indices);
    kv__mem_free(lpl);
    kv__mem_free(indptr);
    kv__mem_free(slots);
    kv__mem_free(rg);
    kv__mem_free(seqs);
    kv__mem_free(pool.ref);
    kv__mem_free(pool.free_ids);
}

static void kvb__export(void)
{
    kvb__export_case(1);
    kvb__export_case(4);
}

KVB_REGISTER("pagetable", kvb__export)
