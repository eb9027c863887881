/*
 * test_page_table.c - page tables (kvcache/kv_page_table.h) over a FAKE block
 * source written here: an array pool with ref counts, a scrambled allocation
 * order, ids far from 0, a configurable limit, and a toy prefix map.
 *
 * References are independent of the table: block lists are rebuilt from the
 * fake's allocation log, slots and pages from the formulas of docs/design.md section 3.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include <kvcache/kv.h>
#include "kv_page_table.h"
#include "kvtest.h"

/* ---- the fake block source -------------------------------------------------------- */

#define FAKE_MAX 4096

struct fake {
    uint32_t n;               /* blocks in the pool */
    uint32_t base;            /* id of block index 0 */
    uint32_t order[FAKE_MAX]; /* allocation preference (a permutation of indices) */
    uint32_t ref[FAKE_MAX];
    bool hashed[FAKE_MAX];
    uint64_t hash[FAKE_MAX];
    uint64_t parent[FAKE_MAX]; /* parent hash passed at commit */
    uint32_t last_alloc[64];   /* ids of the most recent alloc */
    uint32_t n_last;
    uint32_t allocs, releases, retains, commits, matches;
    bool fail_commit;
    bool fail_retain; /* every retain refused (as at a ref-count limit) */
};

static uint64_t toy_hash(uint64_t parent, const int32_t *tokens, uint32_t n, uint64_t extra)
{
    XXH3_state_t *st = XXH3_createState();
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, &parent, sizeof(parent));
    XXH3_64bits_update(st, &extra, sizeof(extra));
    XXH3_64bits_update(st, tokens, n * sizeof(*tokens));
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}

static void fake_init(struct fake *f, uint32_t n, uint32_t base)
{
    memset(f, 0, sizeof(*f));
    assert_true(n <= FAKE_MAX);
    f->n = n;
    f->base = base;
    /* scrambled: stride 7919 (prime, coprime with n unless n is a multiple) */
    uint32_t step = 7919 % n ? 7919 : 7907;
    for (uint32_t k = 0; k < n; k++)
        f->order[k] = (uint32_t)(((uint64_t)k * step + 13) % n);
}

static bool fake_idx(const struct fake *f, uint32_t id, uint32_t *idx)
{
    if (id < f->base || id - f->base >= f->n)
        return false;
    *idx = id - f->base;
    return true;
}

static uint32_t fake_free_count(const struct fake *f)
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < f->n; i++)
        c += f->ref[i] == 0;
    return c;
}

static kv_status fake_alloc(void *ctx, uint32_t n, uint32_t *ids)
{
    struct fake *f = ctx;
    if (fake_free_count(f) < n)
        return KV_ERR_NO_BLOCKS;
    uint32_t got = 0;
    for (int pass = 0; pass < 2 && got < n; pass++) /* unhashed first, then evict */
        for (uint32_t k = 0; k < f->n && got < n; k++) {
            uint32_t i = f->order[k];
            if (f->ref[i] == 0 && f->hashed[i] == (pass == 1)) {
                f->ref[i] = 1;
                f->hashed[i] = false;
                ids[got++] = f->base + i;
            }
        }
    memcpy(f->last_alloc, ids, (n < 64 ? n : 64) * sizeof(*ids));
    f->n_last = n;
    f->allocs++;
    return KV_OK;
}

static kv_status fake_retain(void *ctx, const uint32_t *ids, uint32_t n)
{
    struct fake *f = ctx;
    if (f->fail_retain)
        return KV_ERR_OVERFLOW;
    uint32_t idx;
    for (uint32_t k = 0; k < n; k++)
        if (!fake_idx(f, ids[k], &idx) || f->ref[idx] == 0)
            return KV_ERR_INVALID_ARG;
    for (uint32_t k = 0; k < n; k++) {
        fake_idx(f, ids[k], &idx);
        f->ref[idx]++;
    }
    f->retains++;
    return KV_OK;
}

static kv_status fake_release(void *ctx, const uint32_t *ids, uint32_t n)
{
    struct fake *f = ctx;
    uint32_t idx = 0, k;
    for (k = 0; k < n; k++) {
        if (!fake_idx(f, ids[k], &idx) || f->ref[idx] == 0)
            break;
        f->ref[idx]--;
    }
    if (k < n) { /* undo: all or nothing */
        while (k-- > 0) {
            fake_idx(f, ids[k], &idx);
            f->ref[idx]++;
        }
        return KV_ERR_INVALID_ARG;
    }
    f->releases++;
    return KV_OK;
}

static uint32_t fake_ref_count(void *ctx, uint32_t id)
{
    struct fake *f = ctx;
    uint32_t idx;
    return fake_idx(f, id, &idx) ? f->ref[idx] : 0;
}

static kv_status fake_match(void *ctx, const int32_t *tokens, uint64_t n_tokens,
                            uint32_t block_tokens, uint64_t extra_key, uint32_t *ids,
                            uint64_t *hashes, uint32_t max_blocks, uint32_t *n_found)
{
    struct fake *f = ctx;
    uint64_t parent = 0;
    uint32_t found = 0;
    f->matches++;
    for (uint64_t b = 0; b < n_tokens / block_tokens && found < max_blocks; b++) {
        uint64_t h = toy_hash(parent, tokens + b * block_tokens, block_tokens, extra_key);
        uint32_t i;
        for (i = 0; i < f->n; i++)
            if (f->hashed[i] && f->hash[i] == h)
                break;
        if (i == f->n)
            break;
        ids[found] = f->base + i;
        if (hashes)
            hashes[found] = h;
        found++;
        parent = h;
    }
    for (uint32_t k = 0; k < found; k++)
        f->ref[ids[k] - f->base]++;
    *n_found = found;
    return KV_OK;
}

static kv_status fake_commit(void *ctx, uint32_t id, uint64_t parent_hash, const int32_t *tokens,
                             uint32_t n_tokens, uint64_t extra_key, uint64_t *hash_out)
{
    struct fake *f = ctx;
    uint32_t idx;
    if (f->fail_commit)
        return KV_ERR_NO_MEMORY;
    if (!fake_idx(f, id, &idx) || f->ref[idx] == 0)
        return KV_ERR_INVALID_ARG;
    uint64_t h = toy_hash(parent_hash, tokens, n_tokens, extra_key);
    bool dup = false;
    for (uint32_t i = 0; i < f->n; i++)
        dup |= f->hashed[i] && f->hash[i] == h && i != idx;
    if (!dup) {
        f->hashed[idx] = true;
        f->hash[idx] = h;
        f->parent[idx] = parent_hash;
    }
    f->commits++;
    *hash_out = h;
    return KV_OK;
}

static struct kv_block_ops fake_ops(struct fake *f)
{
    return (struct kv_block_ops){.version = KV_BLOCK_OPS_VERSION,
                                 .ctx = f,
                                 .alloc = fake_alloc,
                                 .retain = fake_retain,
                                 .release = fake_release,
                                 .ref_count = fake_ref_count,
                                 .match_prefix = fake_match,
                                 .commit_full = fake_commit};
}

static uint32_t ref_of(const struct fake *f, uint32_t id)
{
    return f->ref[id - f->base];
}

/* ---- helpers --------------------------------------------------------------------- */

static void expect_msg(kv_status got, kv_status want, const char *needle)
{
    if (got != want)
        fail_msg("status %s, expected %s (%s)", kv_status_name(got), kv_status_name(want),
                 kv_last_error());
    if (!strstr(kv_last_error(), needle))
        fail_msg("message \"%s\" does not contain \"%s\"", kv_last_error(), needle);
}

static kv_page_table *make_pt(struct fake *f, uint32_t N, uint32_t r, uint32_t max_seqs,
                              uint32_t max_blocks, bool prefix)
{
    struct kv_page_table_config cfg = {.struct_size = sizeof(struct kv_page_table_config),
                                       .block_tokens = N,
                                       .page_ratio = r,
                                       .max_seqs = max_seqs,
                                       .max_blocks_per_seq = max_blocks,
                                       .ops = fake_ops(f),
                                       .enable_prefix_caching = prefix};
    kv_page_table *pt = NULL;
    kv_status st = kv_page_table_create(&cfg, &pt);
    if (st != KV_OK)
        fail_msg("create: %s", kv_last_error());
    return pt;
}

static int32_t *make_tokens(uint64_t n, uint64_t seed)
{
    int32_t *t = malloc((n ? n : 1) * sizeof(*t));
    assert_non_null(t);
    for (uint64_t i = 0; i < n; i++)
        t[i] = (int32_t)(kvt_rand(&seed) % 50000);
    return t;
}

/* Test-side model of one sequence's block list, fed by the fake's log. */
struct model {
    uint32_t blocks[512];
    uint32_t n_blocks;
    uint64_t len;
};

static void model_append(kv_page_table *pt, struct fake *f, uint32_t seq, struct model *m,
                         uint64_t n, uint32_t N)
{
    uint32_t allocs = f->allocs;
    f->n_last = 0;
    int32_t *tok = make_tokens(n, m->len + seq);
    kv_status st = kv_page_table_seq_append(pt, seq, tok, n);
    free(tok);
    if (st != KV_OK)
        fail_msg("append: %s", kv_last_error());
    uint32_t need = (uint32_t)((m->len + n + N - 1) / N) - m->n_blocks;
    assert_int_equal(f->allocs - allocs, need ? 1 : 0);
    assert_int_equal(f->n_last, need);
    for (uint32_t k = 0; k < need; k++)
        m->blocks[m->n_blocks++] = f->last_alloc[k];
    m->len += n;
}

/* ---- tests ------------------------------------------------------------------------ */

static void test_page_table_append_across_boundaries(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 1000, 9000);
    kv_page_table *pt = make_pt(f, 16, 1, 4, 64, false);
    uint32_t s;
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    /* tokens may be NULL without prefix caching */
    const uint64_t steps[] = {1, 15, 1, 40, 0, 7};
    const uint32_t want_blocks[] = {1, 1, 2, 4, 4, 4};
    uint64_t len = 0;
    for (int i = 0; i < 6; i++) {
        assert_int_equal(kv_page_table_seq_append(pt, s, NULL, steps[i]), KV_OK);
        len += steps[i];
        const uint32_t *blocks;
        uint32_t nb;
        uint64_t got_len;
        assert_int_equal(kv_page_table_seq_blocks(pt, s, &blocks, &nb), KV_OK);
        assert_int_equal(kv_page_table_seq_len(pt, s, &got_len), KV_OK);
        assert_int_equal(nb, want_blocks[i]);
        assert_int_equal(got_len, len);
        /* a fresh fake hands out base + order[k] in order: block k of the seq */
        for (uint32_t k = 0; k < nb; k++)
            assert_int_equal(blocks[k], 9000 + f->order[k]);
    }
    for (uint64_t t = 0; t < len; t++) {
        int64_t slot;
        assert_int_equal(kv_page_table_slot(pt, s, t, &slot), KV_OK);
        assert_int_equal(slot, (int64_t)(9000 + f->order[t / 16]) * 16 + (int64_t)(t % 16));
    }
    int64_t slot = -7;
    expect_msg(kv_page_table_slot(pt, s, len, &slot), KV_ERR_OUT_OF_BOUNDS,
               "token 64 >= length 64");
    assert_int_equal(slot, -7);
    for (uint32_t k = 0; k < 4; k++)
        assert_int_equal(ref_of(f, 9000 + f->order[k]), 1);
    struct kv_page_table_stats stt;
    kv_page_table_stats_get(pt, &stt);
    assert_int_equal(stt.held_blocks, 4);
    assert_int_equal(stt.live_seqs, 1);
    kv_page_table_destroy(pt);
    assert_int_equal(fake_free_count(f), 1000); /* destroy releases everything */
    free(f);
}

static void test_page_table_slot_64bit(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    const uint32_t base = 200000000u; /* * 16 > 2^31 */
    fake_init(f, 100, base);
    kv_page_table *pt = make_pt(f, 16, 4, 2, 8, false);
    uint32_t s;
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, NULL, 40), KV_OK);
    int64_t slot;
    assert_int_equal(kv_page_table_slot(pt, s, 39, &slot), KV_OK);
    int64_t want = (int64_t)(base + f->order[2]) * 16 + 7;
    assert_true(want > INT32_MAX);
    assert_int_equal(slot, want);
    int64_t sm[40];
    struct kv_token_range rg = {0, 40};
    struct kv_vllm_export ve = {.slot_mapping = sm, .slot_mapping_len = 40};
    assert_int_equal(kv_page_table_export_vllm(pt, &s, 1, &rg, &ve), KV_OK);
    assert_int_equal(sm[39], want);
    /* page ids base*4+3 > INT32_MAX: int32 exports refuse */
    kv_page_table_destroy(pt);
    fake_init(f, 100, 600000000u);
    pt = make_pt(f, 16, 4, 2, 8, false);
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, NULL, 40), KV_OK);
    int32_t bt[8], ip[2], ind[16], lpl[1];
    struct kv_vllm_export ve2 = {.block_table = bt, .block_table_len = 8, .block_table_cols = 8};
    expect_msg(kv_page_table_export_vllm(pt, &s, 1, NULL, &ve2), KV_ERR_OVERFLOW, "page_ratio 4");
    struct kv_flashinfer_export fe = {ip, 2, ind, 16, lpl, 1};
    expect_msg(kv_page_table_export_flashinfer(pt, &s, 1, &fe, NULL), KV_ERR_OVERFLOW, "int32");
    kv_page_table_destroy(pt);
    free(f);
}

/* Exports against the model, for r = 1, 2, 4, packed and padded slot layouts. */
static void check_exports(uint32_t r)
{
    const uint32_t N = 16, P = N / r, S = 8;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 2000, 9000);
    kv_page_table *pt = make_pt(f, N, r, 16, 64, false);
    struct model *m = calloc(S, sizeof(*m));
    uint32_t seqs[8];
    const uint64_t lens[8] = {0, 1, 15, 16, 17, 33, 100, 64};
    for (uint32_t i = 0; i < S; i++)
        assert_int_equal(kv_page_table_seq_create(pt, &seqs[i]), KV_OK);
    /* interleaved appends so every sequence's ids are scattered */
    for (uint64_t step = 0; step < 100; step += 7)
        for (uint32_t i = 0; i < S; i++) {
            uint64_t n = lens[i] > m[i].len ? lens[i] - m[i].len : 0;
            if (n > 7)
                n = 7;
            if (n)
                model_append(pt, f, seqs[i], &m[i], n, N);
        }
    for (uint32_t i = 0; i < S; i++)
        assert_int_equal(m[i].len, lens[i]);
    /* batch order differs from creation order, one sequence twice */
    const uint32_t order[9] = {6, 0, 3, 1, 7, 2, 5, 4, 6};
    uint32_t batch[9];
    struct kv_token_range rg[9];
    uint64_t total = 0, max_count = 0, max_pages = 0;
    for (uint32_t b = 0; b < 9; b++) {
        batch[b] = seqs[order[b]];
        uint64_t len = lens[order[b]], cnt = len < 5 ? len : (b == 0 ? len : len / 3);
        rg[b].start = len - cnt;
        rg[b].count = cnt;
        total += cnt;
        if (cnt > max_count)
            max_count = cnt;
        uint64_t pages = (len + P - 1) / P;
        if (pages > max_pages)
            max_pages = pages;
    }
    const uint32_t cols = (uint32_t)max_pages + 3;

    /* vLLM, packed slots with a padded tail (batch padded to a graph size) */
    const uint64_t sm_len = total + 5;
    int32_t *bt = malloc((9 * cols + 4) * sizeof(*bt));
    int64_t *sm = malloc((sm_len + 4) * sizeof(*sm));
    for (uint64_t k = 0; k < 9 * cols + 4; k++)
        bt[k] = 0x7EADBEEF;
    for (uint64_t k = 0; k < sm_len + 4; k++)
        sm[k] = 0x7EADBEEF;
    struct kv_vllm_export ve = {.block_table = bt,
                                .block_table_len = 9 * (uint64_t)cols,
                                .block_table_cols = cols,
                                .block_table_pad = -3,
                                .slot_mapping = sm,
                                .slot_mapping_len = sm_len};
    if (kv_page_table_export_vllm(pt, batch, 9, rg, &ve) != KV_OK)
        fail_msg("export_vllm: %s", kv_last_error());
    uint64_t pos = 0;
    for (uint32_t b = 0; b < 9; b++) {
        const struct model *mm = &m[order[b]];
        uint64_t pages = (mm->len + P - 1) / P;
        for (uint64_t j = 0; j < cols; j++) {
            int32_t want = j < pages ? (int32_t)(mm->blocks[j / r] * r + j % r) : -3;
            assert_int_equal(bt[b * cols + j], want);
        }
        for (uint64_t t = rg[b].start; t < rg[b].start + rg[b].count; t++)
            assert_int_equal(sm[pos++], (int64_t)mm->blocks[t / N] * N + (int64_t)(t % N));
    }
    for (; pos < sm_len; pos++)
        assert_int_equal(sm[pos], -1);
    for (int k = 0; k < 4; k++) { /* nothing past the declared lengths */
        assert_int_equal(bt[9 * cols + k], 0x7EADBEEF);
        assert_int_equal(sm[sm_len + k], 0x7EADBEEF);
    }

    /* vLLM, padded slots: sequence b at [b*T, b*T + count), -1 after */
    const uint32_t T = (uint32_t)max_count + 2;
    int64_t *sp = malloc(9 * T * sizeof(*sp));
    struct kv_vllm_export vp = {
        .slot_mapping = sp, .slot_mapping_len = 9 * (uint64_t)T, .tokens_per_seq = T};
    assert_int_equal(kv_page_table_export_vllm(pt, batch, 9, rg, &vp), KV_OK);
    for (uint32_t b = 0; b < 9; b++) {
        const struct model *mm = &m[order[b]];
        for (uint32_t k = 0; k < T; k++) {
            uint64_t t = rg[b].start + k;
            int64_t want = k < rg[b].count ? (int64_t)mm->blocks[t / N] * N + (int64_t)(t % N) : -1;
            assert_int_equal(sp[(uint64_t)b * T + k], want);
        }
    }

    /* FlashInfer CSR */
    int32_t indptr[10], lpl[9];
    int32_t *ind = malloc((max_pages * 9 + 1) * sizeof(*ind));
    struct kv_flashinfer_export fe = {indptr, 10, ind, max_pages * 9, lpl, 9};
    uint64_t nnz = 0;
    if (kv_page_table_export_flashinfer(pt, batch, 9, &fe, &nnz) != KV_OK)
        fail_msg("export_flashinfer: %s", kv_last_error());
    uint64_t at = 0;
    assert_int_equal(indptr[0], 0);
    for (uint32_t b = 0; b < 9; b++) {
        const struct model *mm = &m[order[b]];
        uint64_t pages = (mm->len + P - 1) / P;
        for (uint64_t j = 0; j < pages; j++)
            assert_int_equal(ind[at + j], (int32_t)(mm->blocks[j / r] * r + j % r));
        at += pages;
        assert_int_equal(indptr[b + 1], (int32_t)at);
        int32_t want_last = mm->len ? (int32_t)(mm->len - (pages - 1) * P) : 0;
        assert_int_equal(lpl[b], want_last);
        if (mm->len)
            assert_true(lpl[b] >= 1 && lpl[b] <= (int32_t)P);
    }
    assert_int_equal(nnz, at);

    /* sizes too small, ranges outside, unknown ids: named, nothing written */
    struct kv_vllm_export bad = ve;
    bad.block_table_cols = (uint32_t)max_pages - 1;
    bad.block_table_len = 9 * (uint64_t)bad.block_table_cols;
    char needle[64];
    snprintf(needle, sizeof(needle), "block_table_cols %u < %llu", bad.block_table_cols,
             (unsigned long long)max_pages);
    expect_msg(kv_page_table_export_vllm(pt, batch, 9, rg, &bad), KV_ERR_INVALID_ARG, needle);
    bad = ve;
    bad.block_table_len = 9 * (uint64_t)cols - 1;
    expect_msg(kv_page_table_export_vllm(pt, batch, 9, rg, &bad), KV_ERR_INVALID_ARG,
               "block_table_len");
    bad = ve;
    bad.slot_mapping_len = total - 1;
    snprintf(needle, sizeof(needle), "slot_mapping_len %llu < %llu",
             (unsigned long long)(total - 1), (unsigned long long)total);
    expect_msg(kv_page_table_export_vllm(pt, batch, 9, rg, &bad), KV_ERR_INVALID_ARG, needle);
    struct kv_vllm_export badp = vp;
    badp.tokens_per_seq = (uint32_t)max_count - 1;
    badp.slot_mapping_len = 9 * (uint64_t)badp.tokens_per_seq;
    expect_msg(kv_page_table_export_vllm(pt, batch, 9, rg, &badp), KV_ERR_INVALID_ARG,
               "tokens_per_seq");
    struct kv_token_range rg_bad[9];
    memcpy(rg_bad, rg, sizeof(rg));
    rg_bad[4].start = lens[order[4]];
    rg_bad[4].count = 1;
    expect_msg(kv_page_table_export_vllm(pt, batch, 9, rg_bad, &ve), KV_ERR_OUT_OF_BOUNDS,
               "ranges[4]");
    uint32_t batch_bad[9];
    memcpy(batch_bad, batch, sizeof(batch));
    batch_bad[2] = 15; /* never created */
    expect_msg(kv_page_table_export_vllm(pt, batch_bad, 9, rg, &ve), KV_ERR_NOT_FOUND,
               "seqs[2] = 15");
    expect_msg(kv_page_table_export_flashinfer(pt, batch_bad, 9, &fe, NULL), KV_ERR_NOT_FOUND,
               "seqs[2] = 15");
    struct kv_flashinfer_export fb = fe;
    fb.indices_len = at - 1;
    snprintf(needle, sizeof(needle), "indices_len %llu < nnz %llu", (unsigned long long)(at - 1),
             (unsigned long long)at);
    expect_msg(kv_page_table_export_flashinfer(pt, batch, 9, &fb, NULL), KV_ERR_INVALID_ARG,
               needle);
    fb = fe;
    fb.indptr_len = 9;
    expect_msg(kv_page_table_export_flashinfer(pt, batch, 9, &fb, NULL), KV_ERR_INVALID_ARG,
               "indptr_len 9 < n_seqs + 1 = 10");
    fb = fe;
    fb.last_page_len_len = 8;
    expect_msg(kv_page_table_export_flashinfer(pt, batch, 9, &fb, NULL), KV_ERR_INVALID_ARG,
               "last_page_len_len 8");

    free(ind);
    free(sp);
    free(sm);
    free(bt);
    free(m);
    kv_page_table_destroy(pt);
    free(f);
}

static void test_page_table_exports_match_direct_r1(void **state)
{
    (void)state;
    check_exports(1);
}

static void test_page_table_exports_match_direct_r2(void **state)
{
    (void)state;
    check_exports(2);
}

static void test_page_table_exports_match_direct_r4(void **state)
{
    (void)state;
    check_exports(4);
}

/* ---- size queries ------------------------------------------------------------ */

#define CANARY32 0x5AFE5AFE
#define CANARY64 INT64_C(0x5AFE5AFE5AFE5AFE)

static int32_t *alloc_i32(uint64_t n, uint64_t extra)
{
    int32_t *p = malloc((n + extra) * sizeof(*p));
    assert_non_null(p);
    for (uint64_t k = 0; k < n + extra; k++)
        p[k] = CANARY32;
    return p;
}

static int64_t *alloc_i64(uint64_t n, uint64_t extra)
{
    int64_t *p = malloc((n + extra) * sizeof(*p));
    assert_non_null(p);
    for (uint64_t k = 0; k < n + extra; k++)
        p[k] = CANARY64;
    return p;
}

/* One random batch: the size queries of both exports against sizes computed
 * here from the model, then real exports into buffers of exactly those
 * sizes (accepted, filled as the model says, nothing written past them),
 * and each length one short (refused, nothing written). */
static void check_size_queries(kv_page_table *pt, const uint32_t *seqs, const struct model *m,
                               uint32_t r, uint32_t N, uint64_t *rng)
{
    const uint32_t P = N / r;
    const uint32_t n = (uint32_t)kvt_range(rng, 0, 12);
    uint32_t batch[12], which[12];
    struct kv_token_range rg[12];
    uint64_t ref_cols = 0, ref_total = 0, ref_nnz = 0, max_count = 0;
    for (uint32_t b = 0; b < n; b++) {
        which[b] = (uint32_t)kvt_range(rng, 0, 9); /* repeats allowed */
        batch[b] = seqs[which[b]];
        const uint64_t len = m[which[b]].len, pages = (len + P - 1) / P;
        rg[b].start = (uint64_t)kvt_range(rng, 0, (int64_t)len);
        rg[b].count = (uint64_t)kvt_range(rng, 0, (int64_t)(len - rg[b].start));
        ref_cols = pages > ref_cols ? pages : ref_cols;
        ref_total += rg[b].count;
        ref_nnz += pages;
        max_count = rg[b].count > max_count ? rg[b].count : max_count;
    }
    const uint32_t T =
        kvt_range(rng, 0, 1) ? 0 : (uint32_t)max_count + (uint32_t)kvt_range(rng, 0, 3);
    const uint64_t ref_slots = T ? (uint64_t)n * T : ref_total;

    /* vLLM: the size query (no buffers) */
    struct kv_vllm_export_sizes sz = {7, 7, 7, 7};
    struct kv_vllm_export q = {.tokens_per_seq = T, .sizes = &sz};
    if (kv_page_table_export_vllm(pt, batch, n, rg, &q) != KV_OK)
        fail_msg("size query: %s", kv_last_error());
    assert_int_equal(sz.block_table_cols, ref_cols);
    assert_int_equal(sz.block_table_len, (uint64_t)n * ref_cols);
    assert_int_equal(sz.slot_mapping_len, ref_slots);
    assert_int_equal(sz.seq_lens_len, n);
    /* without ranges there is no slot mapping to size */
    struct kv_vllm_export_sizes sz2 = {7, 7, 7, 7};
    q.sizes = &sz2;
    assert_int_equal(kv_page_table_export_vllm(pt, batch, n, NULL, &q), KV_OK);
    assert_int_equal(sz2.block_table_cols, ref_cols);
    assert_int_equal(sz2.slot_mapping_len, 0);

    /* a real export into exactly those sizes */
    const uint64_t X = 3; /* canaries past each buffer */
    int32_t *bt = alloc_i32(sz.block_table_len, X);
    int64_t *sm = alloc_i64(sz.slot_mapping_len, X), *sl = alloc_i64(sz.seq_lens_len, X);
    struct kv_vllm_export_sizes got = {7, 7, 7, 7};
    struct kv_vllm_export ve = {.block_table = bt,
                                .block_table_len = sz.block_table_len,
                                .block_table_cols = sz.block_table_cols,
                                .block_table_pad = -9,
                                .slot_mapping = sm,
                                .slot_mapping_len = sz.slot_mapping_len,
                                .tokens_per_seq = T,
                                .seq_lens = sl,
                                .seq_lens_len = sz.seq_lens_len,
                                .sizes = &got};
    if (kv_page_table_export_vllm(pt, batch, n, rg, &ve) != KV_OK)
        fail_msg("export at the queried sizes: %s", kv_last_error());
    assert_int_equal(got.block_table_cols, sz.block_table_cols);
    assert_int_equal(got.block_table_len, sz.block_table_len);
    assert_int_equal(got.slot_mapping_len, sz.slot_mapping_len);
    assert_int_equal(got.seq_lens_len, sz.seq_lens_len);
    uint64_t pos = 0;
    for (uint32_t b = 0; b < n; b++) {
        const struct model *mm = &m[which[b]];
        const uint64_t pages = (mm->len + P - 1) / P;
        for (uint64_t j = 0; j < ref_cols; j++)
            assert_int_equal(bt[b * ref_cols + j],
                             j < pages ? (int32_t)(mm->blocks[j / r] * r + j % r) : -9);
        assert_int_equal(sl[b], (int64_t)mm->len);
        if (T)
            pos = (uint64_t)b * T;
        for (uint64_t t = rg[b].start; t < rg[b].start + rg[b].count; t++)
            assert_int_equal(sm[pos++], (int64_t)mm->blocks[t / N] * N + (int64_t)(t % N));
        if (T)
            for (; pos < (uint64_t)(b + 1) * T; pos++)
                assert_int_equal(sm[pos], -1);
    }
    assert_int_equal(pos, ref_slots);
    for (uint64_t k = 0; k < X; k++) { /* nothing past the sizes */
        assert_int_equal(bt[sz.block_table_len + k], CANARY32);
        assert_int_equal(sm[sz.slot_mapping_len + k], CANARY64);
        assert_int_equal(sl[sz.seq_lens_len + k], CANARY64);
    }
    /* each buffer one short: refused, nothing written, sizes untouched */
    for (int which_len = 0; which_len < 3; which_len++) {
        struct kv_vllm_export bad = ve;
        uint64_t *len = which_len == 0   ? &bad.block_table_len
                        : which_len == 1 ? &bad.slot_mapping_len
                                         : &bad.seq_lens_len;
        if (*len == 0)
            continue;
        (*len)--;
        int32_t *bt2 = alloc_i32(sz.block_table_len, X);
        int64_t *sm2 = alloc_i64(sz.slot_mapping_len, X), *sl2 = alloc_i64(sz.seq_lens_len, X);
        bad.block_table = bt2;
        bad.slot_mapping = sm2;
        bad.seq_lens = sl2;
        struct kv_vllm_export_sizes keep = {7, 7, 7, 7};
        bad.sizes = &keep;
        expect_msg(kv_page_table_export_vllm(pt, batch, n, rg, &bad), KV_ERR_INVALID_ARG,
                   which_len == 0   ? "block_table_len"
                   : which_len == 1 ? "slot_mapping_len"
                                    : "seq_lens_len");
        for (uint64_t k = 0; k < sz.block_table_len + X; k++)
            assert_int_equal(bt2[k], CANARY32);
        for (uint64_t k = 0; k < sz.slot_mapping_len + X; k++)
            assert_int_equal(sm2[k], CANARY64);
        for (uint64_t k = 0; k < sz.seq_lens_len + X; k++)
            assert_int_equal(sl2[k], CANARY64);
        assert_int_equal(keep.block_table_cols, 7);
        free(bt2);
        free(sm2);
        free(sl2);
    }
    if (ref_cols > 0 && n > 0) { /* one column short */
        struct kv_vllm_export bad = ve;
        bad.block_table_cols--;
        expect_msg(kv_page_table_export_vllm(pt, batch, n, rg, &bad), KV_ERR_INVALID_ARG,
                   "block_table_cols");
    }
    free(bt);
    free(sm);
    free(sl);

    /* FlashInfer: out NULL, or every buffer NULL */
    uint64_t nnz = 7, nnz2 = 7;
    if (kv_page_table_export_flashinfer(pt, batch, n, NULL, &nnz) != KV_OK)
        fail_msg("CSR size query: %s", kv_last_error());
    assert_int_equal(nnz, ref_nnz);
    struct kv_flashinfer_export none = {0};
    assert_int_equal(kv_page_table_export_flashinfer(pt, batch, n, &none, &nnz2), KV_OK);
    assert_int_equal(nnz2, ref_nnz);
    int32_t *ip = alloc_i32(n + 1, X), *ind = alloc_i32(nnz, X), *lpl = alloc_i32(n, X);
    struct kv_flashinfer_export fe = {ip, n + 1, ind, nnz, lpl, n};
    uint64_t nnz3 = 7;
    if (kv_page_table_export_flashinfer(pt, batch, n, &fe, &nnz3) != KV_OK)
        fail_msg("CSR export at the queried sizes: %s", kv_last_error());
    assert_int_equal(nnz3, nnz);
    assert_int_equal(ip[n], (int32_t)nnz);
    uint64_t at = 0;
    for (uint32_t b = 0; b < n; b++) {
        const struct model *mm = &m[which[b]];
        const uint64_t pages = (mm->len + P - 1) / P;
        assert_int_equal(ip[b], (int32_t)at);
        for (uint64_t j = 0; j < pages; j++)
            assert_int_equal(ind[at + j], (int32_t)(mm->blocks[j / r] * r + j % r));
        at += pages;
        /* the documented rule: 1..N/r with pages, 0 without */
        assert_int_equal(lpl[b], pages ? (int32_t)(mm->len - (pages - 1) * P) : 0);
    }
    for (uint64_t k = 0; k < X; k++) {
        assert_int_equal(ip[n + 1 + k], CANARY32);
        assert_int_equal(ind[nnz + k], CANARY32);
        assert_int_equal(lpl[n + k], CANARY32);
    }
    /* one buffer at a time: the others skipped */
    int32_t *ind2 = alloc_i32(nnz, X);
    struct kv_flashinfer_export only = {.indices = ind2, .indices_len = nnz};
    assert_int_equal(kv_page_table_export_flashinfer(pt, batch, n, &only, NULL), KV_OK);
    for (uint64_t k = 0; k < nnz; k++)
        assert_int_equal(ind2[k], ind[k]);
    assert_int_equal(ind2[nnz], CANARY32);
    if (nnz) {
        struct kv_flashinfer_export bad = fe;
        bad.indices_len = nnz - 1;
        expect_msg(kv_page_table_export_flashinfer(pt, batch, n, &bad, NULL), KV_ERR_INVALID_ARG,
                   "indices_len");
    }
    free(ind2);
    free(ip);
    free(ind);
    free(lpl);
}

/* Size queries over random sequences (empty ones included) and random
 * batches, for page ratios 1, 2, 4 and 16 (pages of one token). */
static void test_page_table_size_queries(void **state)
{
    (void)state;
    const uint32_t N = 16, ratios[4] = {1, 2, 4, 16};
    uint64_t rng = 77;
    for (int ri = 0; ri < 4; ri++) {
        const uint32_t r = ratios[ri];
        struct fake *f = malloc(sizeof(*f));
        fake_init(f, 2000, 70000);
        kv_page_table *pt = make_pt(f, N, r, 16, 64, false);
        struct model *m = calloc(10, sizeof(*m));
        uint32_t seqs[10];
        for (uint32_t i = 0; i < 10; i++)
            assert_int_equal(kv_page_table_seq_create(pt, &seqs[i]), KV_OK);
        for (int round = 0; round < 40; round++) {
            /* grow some sequences (3 stay empty), then query a few batches */
            for (uint32_t i = 3; i < 10; i++)
                if (kvt_range(&rng, 0, 2) == 0 && m[i].len < 400)
                    model_append(pt, f, seqs[i], &m[i], (uint64_t)kvt_range(&rng, 1, 37), N);
            for (int k = 0; k < 4; k++)
                check_size_queries(pt, seqs, m, r, N, &rng);
        }
        /* a size query checks what the export would: an unknown sequence, a
         * range past its sequence */
        uint32_t bad_seq[2] = {seqs[4], 15};
        struct kv_vllm_export_sizes sz = {7, 7, 7, 7};
        struct kv_vllm_export q = {.sizes = &sz};
        expect_msg(kv_page_table_export_vllm(pt, bad_seq, 2, NULL, &q), KV_ERR_NOT_FOUND,
                   "seqs[1] = 15");
        uint64_t nnz = 7;
        expect_msg(kv_page_table_export_flashinfer(pt, bad_seq, 2, NULL, &nnz), KV_ERR_NOT_FOUND,
                   "seqs[1] = 15");
        assert_int_equal(nnz, 7);
        struct kv_token_range past = {m[4].len, 1};
        expect_msg(kv_page_table_export_vllm(pt, &seqs[4], 1, &past, &q), KV_ERR_OUT_OF_BOUNDS,
                   "ranges[0]");
        assert_int_equal(sz.block_table_cols, 7);
        /* no sequences at all */
        assert_int_equal(kv_page_table_export_vllm(pt, NULL, 0, NULL, &q), KV_OK);
        assert_int_equal(sz.block_table_cols, 0);
        assert_int_equal(sz.block_table_len, 0);
        assert_int_equal(sz.slot_mapping_len, 0);
        assert_int_equal(sz.seq_lens_len, 0);
        assert_int_equal(kv_page_table_export_flashinfer(pt, NULL, 0, NULL, &nnz), KV_OK);
        assert_int_equal(nnz, 0);
        free(m);
        kv_page_table_destroy(pt);
        free(f);
    }
}

static void test_page_table_fork_and_cow(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 500, 9000);
    kv_page_table *pt = make_pt(f, 16, 1, 8, 16, false);
    uint32_t p, c, c2;
    const uint32_t *pb, *cb;
    uint32_t np, nc;
    assert_int_equal(kv_page_table_seq_create(pt, &p), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, p, NULL, 20), KV_OK); /* 16 + 4 */
    assert_int_equal(kv_page_table_seq_blocks(pt, p, &pb, &np), KV_OK);
    const uint32_t b0 = pb[0], b1 = pb[1];
    assert_int_equal(kv_page_table_seq_fork(pt, p, &c), KV_OK);
    assert_int_equal(ref_of(f, b0), 2);
    assert_int_equal(ref_of(f, b1), 2);
    uint64_t len;
    assert_int_equal(kv_page_table_seq_len(pt, c, &len), KV_OK);
    assert_int_equal(len, 20);

    /* child writes into the shared partial block: private copy + queued copy */
    assert_int_equal(kv_page_table_seq_append(pt, c, NULL, 1), KV_OK);
    assert_int_equal(kv_page_table_seq_blocks(pt, c, &cb, &nc), KV_OK);
    assert_int_equal(nc, 2);
    assert_int_equal(cb[0], b0);
    const uint32_t priv = cb[1];
    assert_true(priv != b1);
    assert_int_equal(ref_of(f, b0), 2);
    assert_int_equal(ref_of(f, b1), 2);   /* the parent + the copy's hold on its src */
    assert_int_equal(ref_of(f, priv), 2); /* the child + the copy's hold on its dst */
    assert_int_equal(kv_page_table_pending_copies(pt), 1);
    struct kv_page_table_stats ts;
    kv_page_table_stats_get(pt, &ts);
    assert_int_equal(ts.copies_held, 1);

    /* parent now owns b1 alone (the copy's hold is not sharing): in place */
    assert_int_equal(kv_page_table_seq_append(pt, p, NULL, 3), KV_OK);
    assert_int_equal(kv_page_table_seq_blocks(pt, p, &pb, &np), KV_OK);
    assert_int_equal(pb[1], b1);
    assert_int_equal(kv_page_table_pending_copies(pt), 1);

    /* full last block shared: appending takes a new block, no copy */
    assert_int_equal(kv_page_table_seq_append(pt, p, NULL, 9), KV_OK); /* 32 tokens */
    assert_int_equal(kv_page_table_seq_fork(pt, p, &c2), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, c2, NULL, 1), KV_OK);
    assert_int_equal(kv_page_table_pending_copies(pt), 1);
    assert_int_equal(ref_of(f, b1), 3); /* p, c2, the hold */
    assert_int_equal(ref_of(f, b0), 3);

    /* a second copy: fork c (21 tokens, private partial) and write in both.
     * c's partial block is the dst of the first copy, not yet done: the
     * second copy reads that copy's src instead, so the two can run at once */
    uint32_t c3;
    assert_int_equal(kv_page_table_seq_fork(pt, c, &c3), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, c, NULL, 2), KV_OK);
    assert_int_equal(kv_page_table_pending_copies(pt), 2);
    assert_int_equal(kv_page_table_seq_blocks(pt, c, &cb, &nc), KV_OK);
    const uint32_t priv2 = cb[1];
    assert_int_equal(ref_of(f, priv), 2);  /* c3 + the first copy's hold */
    assert_int_equal(ref_of(f, priv2), 2); /* c + the second copy's hold */
    assert_int_equal(ref_of(f, b1), 4);    /* p, c2, two holds */
    assert_int_equal(kv_page_table_seq_append(pt, c3, NULL, 2), KV_OK); /* sole owner now */
    assert_int_equal(kv_page_table_pending_copies(pt), 2);

    struct kv_block_copy cp[4];
    uint32_t n = 9;
    assert_int_equal(kv_page_table_take_copies(pt, cp, 0, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_page_table_take_copies(pt, cp, 1, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(cp[0].src, b1);
    assert_int_equal(cp[0].dst, priv);
    assert_int_equal(cp[0].tokens, 4);
    assert_int_equal(kv_page_table_take_copies(pt, cp, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(cp[0].src, b1);
    assert_int_equal(cp[0].dst, priv2);
    assert_int_equal(cp[0].tokens, 5);
    assert_int_equal(kv_page_table_pending_copies(pt), 0);
    /* taken, not done: still held */
    assert_int_equal(ref_of(f, b1), 4);
    kv_page_table_stats_get(pt, &ts);
    assert_int_equal(ts.copies_held, 2);
    assert_int_equal(kv_page_table_copies_done(pt), KV_OK);
    assert_int_equal(ref_of(f, b1), 2);
    assert_int_equal(ref_of(f, priv), 1);
    assert_int_equal(ref_of(f, priv2), 1);
    kv_page_table_stats_get(pt, &ts);
    assert_int_equal(ts.copies_held, 0);
    assert_int_equal(kv_page_table_copies_done(pt), KV_OK); /* nothing taken: no-op */
    struct kv_page_table_stats st;
    kv_page_table_stats_get(pt, &st);
    assert_int_equal(st.cow_copies, 2);

    /* freeing everything returns every block */
    assert_int_equal(kv_page_table_seq_free(pt, p), KV_OK);
    assert_int_equal(kv_page_table_seq_free(pt, c), KV_OK);
    assert_int_equal(kv_page_table_seq_free(pt, c2), KV_OK);
    assert_int_equal(kv_page_table_seq_free(pt, c3), KV_OK);
    assert_int_equal(fake_free_count(f), 500);
    expect_msg(kv_page_table_seq_free(pt, c3), KV_ERR_NOT_FOUND, "seq 3 is not live");
    kv_page_table_destroy(pt);
    free(f);
}

static void test_page_table_truncate_releases_exactly(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 300, 9000);
    kv_page_table *pt = make_pt(f, 16, 1, 4, 16, false);
    uint32_t a, b;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, NULL, 100), KV_OK); /* 7 blocks */
    const uint32_t *ab;
    uint32_t na;
    assert_int_equal(kv_page_table_seq_blocks(pt, a, &ab, &na), KV_OK);
    assert_int_equal(na, 7);
    uint32_t ids[7];
    memcpy(ids, ab, sizeof(ids));
    assert_int_equal(kv_page_table_seq_fork(pt, a, &b), KV_OK);

    assert_int_equal(kv_page_table_seq_truncate(pt, a, 40), KV_OK); /* keep 3 */
    for (int k = 0; k < 7; k++)
        assert_int_equal(ref_of(f, ids[k]), k < 3 ? 2 : 1);
    assert_int_equal(kv_page_table_seq_truncate(pt, b, 48), KV_OK); /* keep 3, boundary */
    for (int k = 0; k < 7; k++)
        assert_int_equal(ref_of(f, ids[k]), k < 3 ? 2 : 0);
    assert_int_equal(fake_free_count(f), 300 - 3);
    struct kv_page_table_stats st;
    kv_page_table_stats_get(pt, &st);
    assert_int_equal(st.held_blocks, 6);
    uint64_t len;
    assert_int_equal(kv_page_table_seq_len(pt, b, &len), KV_OK);
    assert_int_equal(len, 48);

    /* beyond the length: refused, nothing changed */
    uint32_t rel = f->releases;
    expect_msg(kv_page_table_seq_truncate(pt, a, 41), KV_ERR_INVALID_ARG,
               "to 41 tokens > its length 40");
    assert_int_equal(f->releases, rel);
    assert_int_equal(kv_page_table_seq_len(pt, a, &len), KV_OK);
    assert_int_equal(len, 40);

    /* same length: nothing released; to 0: everything of a */
    assert_int_equal(kv_page_table_seq_truncate(pt, a, 40), KV_OK);
    assert_int_equal(f->releases, rel);
    assert_int_equal(kv_page_table_seq_truncate(pt, a, 0), KV_OK);
    for (int k = 0; k < 3; k++)
        assert_int_equal(ref_of(f, ids[k]), 1);
    assert_int_equal(kv_page_table_seq_blocks(pt, a, &ab, &na), KV_OK);
    assert_int_equal(na, 0);
    /* truncated partial block: append writes it in place (sole owner) */
    assert_int_equal(kv_page_table_seq_truncate(pt, b, 20), KV_OK);
    for (int k = 0; k < 3; k++)
        assert_int_equal(ref_of(f, ids[k]), k < 2 ? 1 : 0);
    assert_int_equal(kv_page_table_seq_append(pt, b, NULL, 3), KV_OK);
    assert_int_equal(kv_page_table_pending_copies(pt), 0);
    assert_int_equal(kv_page_table_seq_blocks(pt, b, &ab, &na), KV_OK);
    assert_int_equal(na, 2);
    assert_int_equal(ab[1], ids[1]);
    kv_page_table_destroy(pt);
    assert_int_equal(fake_free_count(f), 300);
    free(f);
}

static void test_page_table_no_blocks_all_or_nothing(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 5, 9000);
    kv_page_table *pt = make_pt(f, 16, 1, 4, 6, false);
    uint32_t a, b, c;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &b), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, NULL, 60), KV_OK); /* 4 blocks */
    uint32_t refs[5];
    memcpy(refs, f->ref, sizeof(refs));
    expect_msg(kv_page_table_seq_append(pt, b, NULL, 40), KV_ERR_NO_BLOCKS, "needs 3 blocks");
    uint64_t len;
    const uint32_t *bb;
    uint32_t nb;
    assert_int_equal(kv_page_table_seq_len(pt, b, &len), KV_OK);
    assert_int_equal(len, 0);
    assert_int_equal(kv_page_table_seq_blocks(pt, b, &bb, &nb), KV_OK);
    assert_int_equal(nb, 0);
    assert_memory_equal(refs, f->ref, sizeof(refs));

    /* a's append across its boundary needs 2 (1 free): refused */
    expect_msg(kv_page_table_seq_append(pt, a, NULL, 30), KV_ERR_NO_BLOCKS, "60 + 30 tokens");
    assert_int_equal(kv_page_table_seq_len(pt, a, &len), KV_OK);
    assert_int_equal(len, 60);

    /* copy-on-write with no block to copy into: refused, still shared */
    assert_int_equal(kv_page_table_seq_append(pt, b, NULL, 1), KV_OK); /* last free block */
    assert_int_equal(kv_page_table_seq_fork(pt, a, &c), KV_OK);
    memcpy(refs, f->ref, sizeof(refs));
    expect_msg(kv_page_table_seq_append(pt, c, NULL, 1), KV_ERR_NO_BLOCKS, "1 copy-on-write");
    assert_memory_equal(refs, f->ref, sizeof(refs));
    assert_int_equal(kv_page_table_pending_copies(pt), 0);
    assert_int_equal(kv_page_table_seq_len(pt, c, &len), KV_OK);
    assert_int_equal(len, 60);

    /* more than max_blocks_per_seq (6 x 16 = 96 tokens) */
    expect_msg(kv_page_table_seq_append(pt, b, NULL, 96), KV_ERR_CAPACITY,
               "1 + 96 tokens needs more than max_blocks_per_seq 6");
    assert_int_equal(kv_page_table_seq_len(pt, b, &len), KV_OK);
    assert_int_equal(len, 1);

    /* freeing b makes room; a can grow now */
    assert_int_equal(kv_page_table_seq_free(pt, b), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, c, NULL, 1), KV_OK); /* COW now possible */
    assert_int_equal(kv_page_table_pending_copies(pt), 1);
    kv_page_table_destroy(pt);
    assert_int_equal(fake_free_count(f), 5);
    free(f);
}

/* The batch taken from the copy queue must be safe to run at once: no dst
 * is another copy's src, no two copies share a dst, and every block a copy
 * names stays held (out of the pool) until copies_done. */
static void check_batch_safe(const struct fake *f, const struct kv_block_copy *cp, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        assert_true(ref_of(f, cp[i].src) >= 1);
        assert_true(ref_of(f, cp[i].dst) >= 1);
        for (uint32_t j = 0; j < n; j++) {
            if (cp[i].dst == cp[j].src)
                fail_msg("copy %u writes block %u that copy %u reads", i, cp[i].dst, j);
            if (i != j && cp[i].dst == cp[j].dst)
                fail_msg("copies %u and %u both write block %u", i, j, cp[i].dst);
        }
    }
}

/* The scenario that broke concurrent copies when a source was released at
 * queue time: A's copy source X is freed by its fork in the same step, the
 * pool hands X out again as the dst of B's copy: [X -> Y, Z -> X]. */
static void test_page_table_cow_sources_stay_held(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 64, 5000);
    kv_page_table *pt = make_pt(f, 16, 1, 8, 8, false);
    uint32_t a, a2, b, b2, n;
    const uint32_t *blk;
    uint32_t nb;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, NULL, 4), KV_OK);
    assert_int_equal(kv_page_table_seq_blocks(pt, a, &blk, &nb), KV_OK);
    const uint32_t x = blk[0];
    assert_int_equal(kv_page_table_seq_create(pt, &b), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, b, NULL, 4), KV_OK);
    assert_int_equal(kv_page_table_seq_fork(pt, a, &a2), KV_OK);
    assert_int_equal(kv_page_table_seq_fork(pt, b, &b2), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, NULL, 1), KV_OK); /* X -> Y queued */
    assert_int_equal(kv_page_table_seq_free(pt, a2), KV_OK);           /* X's last sequence */
    assert_int_equal(ref_of(f, x), 1);                                 /* the copy holds it */
    assert_int_equal(kv_page_table_seq_append(pt, b, NULL, 1), KV_OK); /* Z -> W queued */
    struct kv_block_copy cp[4];
    assert_int_equal(kv_page_table_take_copies(pt, cp, 4, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(cp[0].src, x);
    assert_true(cp[1].dst != x);
    check_batch_safe(f, cp, n);
    assert_int_equal(kv_page_table_copies_done(pt), KV_OK);
    assert_int_equal(ref_of(f, x), 0); /* back to the pool only now */
    assert_int_equal(kv_page_table_seq_free(pt, a), KV_OK);
    assert_int_equal(kv_page_table_seq_free(pt, b), KV_OK);
    assert_int_equal(kv_page_table_seq_free(pt, b2), KV_OK);
    for (uint32_t i = 0; i < f->n; i++)
        assert_int_equal(f->ref[i], 0);
    kv_page_table_destroy(pt);
    free(f);
}

/* Random steps of forks, appends, truncates and frees, each ending with the
 * engine's take -> copy -> done: every batch is safe to run concurrently, and
 * when everything is freed every reference came back (holds included). */
static void test_page_table_cow_batches_random(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 400, 77000);
    kv_page_table *pt = make_pt(f, 8, 1, 32, 16, false);
    uint64_t rng = 99;
    uint32_t live[32], nlive = 0, batches = 0, copies = 0;
    for (int step = 0; step < 3000; step++) {
        for (int k = 0; k < 6; k++) {
            int op = (int)kvt_range(&rng, 0, 9);
            uint32_t id;
            if (nlive == 0 || op == 0) {
                if (nlive < 32 && kv_page_table_seq_create(pt, &id) == KV_OK)
                    live[nlive++] = id;
                continue;
            }
            uint32_t i = (uint32_t)kvt_range(&rng, 0, nlive - 1);
            if (op <= 2 && nlive < 32) {
                if (kv_page_table_seq_fork(pt, live[i], &id) == KV_OK)
                    live[nlive++] = id;
            } else if (op <= 6) {
                kv_status st =
                    kv_page_table_seq_append(pt, live[i], NULL, (uint64_t)kvt_range(&rng, 1, 12));
                assert_true(st == KV_OK || st == KV_ERR_NO_BLOCKS || st == KV_ERR_CAPACITY);
            } else if (op == 7) {
                uint64_t len;
                assert_int_equal(kv_page_table_seq_len(pt, live[i], &len), KV_OK);
                assert_int_equal(kv_page_table_seq_truncate(
                                     pt, live[i], (uint64_t)kvt_range(&rng, 0, (int64_t)len)),
                                 KV_OK);
            } else {
                assert_int_equal(kv_page_table_seq_free(pt, live[i]), KV_OK);
                live[i] = live[--nlive];
            }
        }
        struct kv_block_copy cp[64];
        uint32_t n;
        assert_int_equal(kv_page_table_take_copies(pt, cp, 64, &n), KV_OK);
        check_batch_safe(f, cp, n);
        batches += n > 1;
        copies += n;
        assert_int_equal(kv_page_table_copies_done(pt), KV_OK);
    }
    for (uint32_t i = 0; i < nlive; i++)
        assert_int_equal(kv_page_table_seq_free(pt, live[i]), KV_OK);
    for (uint32_t i = 0; i < f->n; i++)
        assert_int_equal(f->ref[i], 0);
    print_message("cow batches: %u copies, %u batches of more than one\n", copies, batches);
    assert_true(copies > 500 && batches > 50);
    kv_page_table_destroy(pt);
    free(f);
}

/* A slot is block * N + t % N in int64: a block id near 2^32 with pages of
 * 3 x 2^30 tokens does not fit, and both the slot query and the vLLM export say
 * so (never a negative slot with KV_OK). */
static void test_page_table_slot_overflow(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 4, 4000000000u);
    kv_page_table *pt = make_pt(f, 3u << 30, 1, 2, 2, false);
    uint32_t s;
    int64_t slot = 12345;
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, NULL, 3), KV_OK);
    expect_msg(kv_page_table_slot(pt, s, 2, &slot), KV_ERR_OVERFLOW, "exceeds int64");
    assert_int_equal(slot, 12345); /* untouched */
    int64_t sm[4];
    struct kv_token_range rg = {0, 3};
    struct kv_vllm_export ve = {.slot_mapping = sm, .slot_mapping_len = 4};
    assert_int_equal(kv_page_table_export_vllm(pt, &s, 1, &rg, &ve), KV_ERR_OVERFLOW);
    kv_page_table_destroy(pt);
    free(f);
}

/* max_seqs and max_blocks_per_seq have documented bounds; the largest table
 * is accepted and touches nothing per sequence until used. */
static void test_page_table_bounds(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 16, 1);
    struct kv_page_table_config cfg = KV_PAGE_TABLE_CONFIG_INIT;
    kv_page_table *pt = NULL;
    cfg.block_tokens = 4;
    cfg.max_seqs = KV_PAGE_TABLE_MAX_SEQS + 1;
    cfg.max_blocks_per_seq = 4;
    cfg.ops = fake_ops(f);
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG, "KV_PAGE_TABLE_MAX_SEQS");
    cfg.max_seqs = UINT32_MAX;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG, "max_seqs 4294967295");
    cfg.max_seqs = 2;
    cfg.max_blocks_per_seq = KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ + 1;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG,
               "KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ");
    assert_null(pt);
    cfg.max_seqs = KV_PAGE_TABLE_MAX_SEQS;
    cfg.max_blocks_per_seq = KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ;
    assert_int_equal(kv_page_table_create(&cfg, &pt), KV_OK);
    /* ids come lowest first, and a retired id is handed out again first */
    uint32_t a, b, c;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &b), KV_OK);
    assert_int_equal(a, 0);
    assert_int_equal(b, 1);
    assert_int_equal(kv_page_table_seq_free(pt, a), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &c), KV_OK);
    assert_int_equal(c, 0);
    assert_int_equal(kv_page_table_seq_create(pt, &c), KV_OK);
    assert_int_equal(c, 2);
    kv_page_table_destroy(pt);
    free(f);
}

static void test_page_table_prefix_reuse(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 200, 9000);
    kv_page_table *pt = make_pt(f, 16, 1, 8, 16, true);
    int32_t *prompt = make_tokens(50, 42);
    uint32_t a, b, c, d;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, prompt, 30), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, prompt + 30, 20), KV_OK);
    assert_int_equal(f->commits, 3); /* 3 full blocks of 16 */
    const uint32_t *ab;
    uint32_t na;
    assert_int_equal(kv_page_table_seq_blocks(pt, a, &ab, &na), KV_OK);
    uint32_t aid[4];
    memcpy(aid, ab, sizeof(aid));
    /* chained hashes: block 0 from the root hash, block i from block i-1 */
    uint64_t h0 = toy_hash(KV_PAGE_TABLE_ROOT_HASH, prompt, 16, 0);
    uint64_t h1 = toy_hash(h0, prompt + 16, 16, 0);
    uint64_t h2 = toy_hash(h1, prompt + 32, 16, 0);
    assert_true(f->hash[aid[0] - 9000] == h0 && f->parent[aid[0] - 9000] == 0);
    assert_true(f->hash[aid[1] - 9000] == h1 && f->parent[aid[1] - 9000] == h0);
    assert_true(f->hash[aid[2] - 9000] == h2 && f->parent[aid[2] - 9000] == h1);
    assert_false(f->hashed[aid[3] - 9000]);

    /* the same 50-token prompt: 3 blocks reused, then 2 tokens appended */
    uint64_t cached = 99;
    assert_int_equal(kv_page_table_seq_create_from_prefix(pt, prompt, 50, &b, &cached), KV_OK);
    assert_int_equal(cached, 48);
    const uint32_t *bb;
    uint32_t nb;
    assert_int_equal(kv_page_table_seq_blocks(pt, b, &bb, &nb), KV_OK);
    assert_int_equal(nb, 3);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(bb[k], aid[k]);
        assert_int_equal(ref_of(f, aid[k]), 2);
    }
    assert_int_equal(kv_page_table_seq_append(pt, b, prompt + 48, 2), KV_OK);
    assert_int_equal(kv_page_table_pending_copies(pt), 0);

    /* a 48-token prompt, fully cached: the last token is computed, so 2 blocks */
    assert_int_equal(kv_page_table_seq_create_from_prefix(pt, prompt, 48, &c, &cached), KV_OK);
    assert_int_equal(cached, 32);
    /* a prompt differing in block 2: 2 blocks */
    int32_t *other = make_tokens(50, 42);
    other[40] ^= 1;
    assert_int_equal(kv_page_table_seq_create_from_prefix(pt, other, 50, &d, &cached), KV_OK);
    assert_int_equal(cached, 32);
    assert_int_equal(kv_page_table_seq_free(pt, d), KV_OK);
    /* another extra key: nothing */
    assert_int_equal(kv_page_table_seq_create(pt, &d), KV_OK);
    assert_int_equal(kv_page_table_seq_set_extra_key(pt, d, 77), KV_OK);
    assert_int_equal(kv_page_table_seq_reuse_prefix(pt, d, prompt, 50, &cached), KV_OK);
    assert_int_equal(cached, 0);
    assert_int_equal(kv_page_table_seq_free(pt, d), KV_OK);

    /* truncating a into its sealed block 2 and appending copies it first */
    assert_int_equal(kv_page_table_seq_truncate(pt, a, 40), KV_OK);
    assert_int_equal(ref_of(f, aid[3]), 0);
    assert_int_equal(kv_page_table_seq_append(pt, a, other + 40, 10), KV_OK);
    struct kv_block_copy cp[2];
    uint32_t n;
    assert_int_equal(kv_page_table_take_copies(pt, cp, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(cp[0].src, aid[2]);
    assert_int_equal(cp[0].tokens, 8);
    assert_true(f->hash[aid[2] - 9000] == h2); /* the cached block keeps its content */
    assert_int_equal(ref_of(f, aid[2]), 2);    /* b, and the copy until it is done */
    assert_int_equal(kv_page_table_copies_done(pt), KV_OK);
    assert_int_equal(ref_of(f, aid[2]), 1); /* still held by b */
    assert_int_equal(kv_page_table_seq_blocks(pt, a, &ab, &na), KV_OK);
    assert_int_equal(ab[2], cp[0].dst);
    /* the private copy filled with other tokens is committed with parent h1 */
    assert_true(f->hashed[cp[0].dst - 9000]);
    assert_true(f->parent[cp[0].dst - 9000] == h1);

    /* sealed with ref 1 (sole owner): still never written in place */
    uint32_t g;
    const uint32_t *gb;
    uint32_t ng;
    assert_int_equal(kv_page_table_seq_create(pt, &g), KV_OK);
    int32_t *solo = make_tokens(20, 4242);
    assert_int_equal(kv_page_table_seq_append(pt, g, solo, 20), KV_OK);
    assert_int_equal(kv_page_table_seq_blocks(pt, g, &gb, &ng), KV_OK);
    const uint32_t g0 = gb[0];
    assert_int_equal(ref_of(f, g0), 1);
    assert_true(f->hashed[g0 - 9000]);
    assert_int_equal(kv_page_table_seq_truncate(pt, g, 10), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, g, solo + 10, 1), KV_OK);
    assert_int_equal(kv_page_table_take_copies(pt, cp, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(cp[0].src, g0);
    assert_int_equal(cp[0].tokens, 10);
    assert_int_equal(ref_of(f, g0), 1); /* held by the copy until it is done */
    assert_int_equal(kv_page_table_copies_done(pt), KV_OK);
    assert_int_equal(ref_of(f, g0), 0); /* cached-free, content intact */
    assert_true(f->hashed[g0 - 9000]);
    assert_int_equal(kv_page_table_seq_free(pt, g), KV_OK);
    free(solo);

    /* truncating below sealed blocks: the refilled blocks are committed again */
    assert_int_equal(kv_page_table_seq_create(pt, &g), KV_OK);
    assert_int_equal(kv_page_table_seq_set_extra_key(pt, g, 9), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, g, prompt, 50), KV_OK);
    assert_int_equal(kv_page_table_seq_truncate(pt, g, 16), KV_OK);
    uint32_t commits = f->commits;
    int32_t *refill = make_tokens(32, 777);
    assert_int_equal(kv_page_table_seq_append(pt, g, refill, 32), KV_OK);
    assert_int_equal(f->commits, commits + 2);
    assert_int_equal(kv_page_table_seq_blocks(pt, g, &gb, &ng), KV_OK);
    uint64_t want_h =
        toy_hash(toy_hash(toy_hash(0, prompt, 16, 9), refill, 16, 9), refill + 16, 16, 9);
    assert_true(f->hashed[gb[2] - 9000] && f->hash[gb[2] - 9000] == want_h);
    free(refill);
    assert_int_equal(kv_page_table_seq_free(pt, g), KV_OK);

    /* commit failure: the append succeeds; the next append retries */
    struct kv_page_table_stats st;
    f->fail_commit = true;
    assert_int_equal(kv_page_table_seq_append(pt, b, prompt, 14), KV_OK); /* 64: block 3 full */
    kv_page_table_stats_get(pt, &st);
    assert_int_equal(st.commit_failures, 1);
    f->fail_commit = false;
    assert_int_equal(kv_page_table_seq_append(pt, b, prompt, 1), KV_OK);
    kv_page_table_stats_get(pt, &st);
    assert_int_equal(st.commit_failures, 1);
    assert_int_equal(kv_page_table_seq_blocks(pt, b, &bb, &nb), KV_OK);
    assert_true(f->hashed[bb[3] - 9000]);

    /* cached blocks with ref 0 stay reusable after their owners free them */
    assert_int_equal(kv_page_table_seq_free(pt, c), KV_OK);
    assert_int_equal(kv_page_table_seq_free(pt, b), KV_OK);
    assert_int_equal(ref_of(f, aid[0]), 1); /* a */
    assert_int_equal(ref_of(f, aid[2]), 0);
    assert_int_equal(kv_page_table_seq_create_from_prefix(pt, prompt, 50, &c, &cached), KV_OK);
    assert_int_equal(cached, 48);
    assert_int_equal(ref_of(f, aid[2]), 1);
    kv_page_table_stats_get(pt, &st);
    assert_int_equal(st.reused_blocks, 3 + 2 + 2 + 3);

    /* bad input */
    uint32_t e;
    expect_msg(kv_page_table_seq_set_extra_key(pt, c, 5), KV_ERR_BAD_STATE, "has 48 tokens");
    expect_msg(kv_page_table_seq_reuse_prefix(pt, c, prompt, 50, &cached), KV_ERR_BAD_STATE,
               "already has 48 tokens");
    expect_msg(kv_page_table_seq_append(pt, c, NULL, 3), KV_ERR_NULL, "prefix caching on");
    assert_int_equal(kv_page_table_seq_create(pt, &e), KV_OK);
    expect_msg(kv_page_table_seq_reuse_prefix(pt, e, NULL, 5, &cached), KV_ERR_NULL, "n_tokens 5");
    free(other);
    free(prompt);
    kv_page_table_destroy(pt);
    free(f);
}

static void test_page_table_bad_input(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 64, 9000);
    struct kv_page_table_config cfg = {.struct_size = sizeof(struct kv_page_table_config),
                                       .block_tokens = 16,
                                       .page_ratio = 3,
                                       .max_seqs = 2,
                                       .max_blocks_per_seq = 4,
                                       .ops = fake_ops(f)};
    kv_page_table *pt = (kv_page_table *)&cfg; /* sentinel: must stay untouched */
    kv_page_table *const sentinel = pt;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG,
               "block_tokens 16 is not divisible by page_ratio 3");
    assert_ptr_equal(pt, sentinel);
    cfg.page_ratio = 2;
    cfg.max_seqs = 0;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG, "max_seqs 0");
    cfg.max_seqs = 2;
    cfg.ops.release = NULL;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG, "release=NULL");
    cfg.ops = fake_ops(f);
    cfg.ops.match_prefix = NULL;
    cfg.enable_prefix_caching = true;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG, "match_prefix (NULL)");
    expect_msg(kv_page_table_create(NULL, &pt), KV_ERR_NULL, "cfg");
    cfg.ops = fake_ops(f);
    expect_msg(kv_page_table_create(&cfg, NULL), KV_ERR_NULL, "out");
    assert_ptr_equal(pt, sentinel);
    assert_int_equal(kv_page_table_create(&cfg, &pt), KV_OK);
    kv_page_table_destroy(NULL);

    uint32_t s0, s1, s2 = 77;
    assert_int_equal(kv_page_table_seq_create(pt, &s0), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &s1), KV_OK);
    assert_int_equal(s0, 0);
    assert_int_equal(s1, 1);
    expect_msg(kv_page_table_seq_create(pt, &s2), KV_ERR_CAPACITY, "all 2 sequences");
    expect_msg(kv_page_table_seq_fork(pt, s0, &s2), KV_ERR_CAPACITY, "all 2 sequences");
    assert_int_equal(s2, 77);
    int32_t tok[4] = {1, 2, 3, 4};
    expect_msg(kv_page_table_seq_append(pt, 5, tok, 4), KV_ERR_NOT_FOUND, "seq 5 >= max_seqs 2");
    assert_int_equal(kv_page_table_seq_free(pt, s1), KV_OK);
    expect_msg(kv_page_table_seq_append(pt, s1, tok, 4), KV_ERR_NOT_FOUND, "seq 1 is not live");
    expect_msg(kv_page_table_seq_truncate(pt, s1, 0), KV_ERR_NOT_FOUND, "seq 1");
    expect_msg(kv_page_table_seq_fork(pt, s1, &s2), KV_ERR_NOT_FOUND, "seq 1");
    uint64_t len;
    expect_msg(kv_page_table_seq_len(pt, 9, &len), KV_ERR_NOT_FOUND, "seq 9");
    expect_msg(kv_page_table_seq_len(pt, s0, NULL), KV_ERR_NULL, "n_tokens");
    expect_msg(kv_page_table_seq_append(NULL, s0, tok, 4), KV_ERR_NULL, "pt");
    expect_msg(kv_page_table_seq_create(pt, NULL), KV_ERR_NULL, "seq_out");
    uint32_t n;
    expect_msg(kv_page_table_take_copies(pt, NULL, 3, &n), KV_ERR_NULL, "out");
    /* freed ids are handed out again */
    assert_int_equal(kv_page_table_seq_create(pt, &s2), KV_OK);
    assert_int_equal(s2, 1);
    expect_msg(kv_page_table_seq_append(pt, s0, tok, 65), KV_ERR_CAPACITY, "max_blocks_per_seq 4");
    assert_int_equal(kv_page_table_seq_len(pt, s0, &len), KV_OK);
    assert_int_equal(len, 0);
    expect_msg(kv_page_table_export_vllm(pt, NULL, 2, NULL, &(struct kv_vllm_export){0}),
               KV_ERR_NULL, "seqs");
    int64_t sm[4];
    struct kv_vllm_export ve = {.slot_mapping = sm, .slot_mapping_len = 4};
    expect_msg(kv_page_table_export_vllm(pt, &s0, 1, NULL, &ve), KV_ERR_NULL, "ranges");
    kv_page_table_destroy(pt);
    assert_int_equal(fake_free_count(f), 64);
    free(f);
}

/* stats_get of a NULL table gives zeros (documented), not whatever the
 * caller's struct held. */
static void test_page_table_stats_null_pt_zeros(void **state)
{
    (void)state;
    struct kv_page_table_stats st;
    memset(&st, 0xa5, sizeof(st));
    kv_page_table_stats_get(NULL, &st);
    assert_int_equal(st.live_seqs, 0);
    assert_int_equal(st.held_blocks, 0);
    assert_int_equal(st.cow_copies, 0);
    assert_int_equal(st.copies_held, 0);
    assert_int_equal(st.reused_blocks, 0);
    assert_int_equal(st.committed, 0);
    assert_int_equal(st.commit_failures, 0);
    kv_page_table_stats_get(NULL, NULL); /* nothing to write: a no-op */
}

/* The worked example of docs/page-table.md, verbatim. */
static void test_page_table_doc_example(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 16, 0);
    f->order[0] = 7; /* ids handed out: 7, 3, 5, then the rest */
    f->order[1] = 3;
    f->order[2] = 5;
    for (uint32_t k = 3, i = 0; k < 16; i++)
        if (i != 7 && i != 3 && i != 5)
            f->order[k++] = i;
    kv_page_table *pt = make_pt(f, 4, 2, 4, 8, false);
    uint32_t s[2];
    assert_int_equal(kv_page_table_seq_create(pt, &s[0]), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &s[1]), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s[0], NULL, 5), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s[1], NULL, 4), KV_OK);
    struct kv_token_range rg[2] = {{3, 2}, {0, 4}};
    int32_t bt[8];
    int64_t sm[8], sp[8];
    struct kv_vllm_export ve = {.block_table = bt,
                                .block_table_len = 8,
                                .block_table_cols = 4,
                                .block_table_pad = 0,
                                .slot_mapping = sm,
                                .slot_mapping_len = 8};
    assert_int_equal(kv_page_table_export_vllm(pt, s, 2, rg, &ve), KV_OK);
    const int32_t want_bt[8] = {14, 15, 6, 0, 10, 11, 0, 0};
    const int64_t want_sm[8] = {31, 12, 20, 21, 22, 23, -1, -1};
    assert_memory_equal(bt, want_bt, sizeof(bt));
    assert_memory_equal(sm, want_sm, sizeof(sm));
    struct kv_vllm_export vp = {.slot_mapping = sp, .slot_mapping_len = 8, .tokens_per_seq = 4};
    assert_int_equal(kv_page_table_export_vllm(pt, s, 2, rg, &vp), KV_OK);
    const int64_t want_sp[8] = {31, 12, -1, -1, 20, 21, 22, 23};
    assert_memory_equal(sp, want_sp, sizeof(sp));
    int32_t indptr[3], ind[5], lpl[2];
    struct kv_flashinfer_export fe = {indptr, 3, ind, 5, lpl, 2};
    uint64_t nnz;
    assert_int_equal(kv_page_table_export_flashinfer(pt, s, 2, &fe, &nnz), KV_OK);
    const int32_t want_ip[3] = {0, 3, 5}, want_ind[5] = {14, 15, 6, 10, 11}, want_lpl[2] = {1, 2};
    assert_int_equal(nnz, 5);
    assert_memory_equal(indptr, want_ip, sizeof(indptr));
    assert_memory_equal(ind, want_ind, sizeof(ind));
    assert_memory_equal(lpl, want_lpl, sizeof(lpl));
    kv_page_table_destroy(pt);
    free(f);
}

/* Found by an audit (2026-12-05). */

/* A vLLM export of one long range listed 2^16 times: its slots total 2^64,
 * which wrapped to 0, sized the caller's buffer, and the export overran
 * it. A page of 2^31 tokens: FlashInfer's int32 last_page_len wrapped to
 * INT32_MIN. Both refused by name, nothing written. */
/* The block source's lifetime ops: hold once at create, drop once at
 * destroy after every block is released; one without the other refused by
 * name, and a refused create holds nothing. */
static uint32_t holds, drops, held_at_drop;

static void fake_hold(void *ctx)
{
    (void)ctx;
    holds++;
}

static void fake_drop(void *ctx)
{
    const struct fake *f = ctx;
    drops++;
    held_at_drop = 0;
    for (uint32_t i = 0; i < f->n; i++)
        held_at_drop += f->ref[i];
}

static void test_page_table_source_hold_and_drop(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    assert_non_null(f);
    fake_init(f, 16, 100);
    struct kv_page_table_config cfg = {.struct_size = sizeof(struct kv_page_table_config),
                                       .block_tokens = 4,
                                       .max_seqs = 2,
                                       .max_blocks_per_seq = 8,
                                       .ops = fake_ops(f)};
    kv_page_table *pt = NULL;
    holds = drops = 0;
    cfg.ops.hold = fake_hold;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG, "hold (set) and drop (NULL)");
    cfg.ops.hold = NULL;
    cfg.ops.drop = fake_drop;
    expect_msg(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG, "hold (NULL) and drop (set)");
    cfg.max_seqs = 0; /* refused after the pairing check: nothing held */
    cfg.ops.hold = fake_hold;
    assert_int_equal(kv_page_table_create(&cfg, &pt), KV_ERR_INVALID_ARG);
    assert_null(pt);
    assert_int_equal(holds, 0);
    cfg.max_seqs = 2;
    assert_int_equal(kv_page_table_create(&cfg, &pt), KV_OK);
    assert_int_equal(holds, 1);
    uint32_t s = 0;
    int32_t *tok = make_tokens(10, 3);
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, tok, 10), KV_OK);
    assert_int_equal(drops, 0);
    kv_page_table_destroy(pt);
    assert_int_equal(holds, 1);
    assert_int_equal(drops, 1);
    assert_int_equal(held_at_drop, 0); /* dropped after its last release */
    free(tok);
    free(f);
}

static void test_page_table_export_totals_do_not_wrap(void **state)
{
    (void)state;
    struct kv_block_pool_config pc = KV_BLOCK_POOL_CONFIG_INIT;
    pc.num_blocks = (1u << 17) + 4;
    kv_block_pool *pool = NULL;
    assert_int_equal(kv_block_pool_create(&pc, &pool), KV_OK);
    struct kv_page_table_config tc = KV_PAGE_TABLE_CONFIG_INIT;
    tc.block_tokens = 1u << 31;
    tc.max_seqs = 2;
    tc.max_blocks_per_seq = (1u << 17) + 1;
    assert_int_equal(kv_block_pool_ops(pool, &tc.ops), KV_OK);
    kv_page_table *pt = NULL;
    assert_int_equal(kv_page_table_create(&tc, &pt), KV_OK);
    uint32_t s;
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, NULL, (1ull << 48) + 1), KV_OK);
    enum { K = 1 << 16 };
    uint32_t *seqs = malloc(K * sizeof(*seqs));
    struct kv_token_range *rg = malloc(K * sizeof(*rg));
    assert_true(seqs && rg);
    for (uint32_t i = 0; i < K; i++) {
        seqs[i] = s;
        rg[i] = (struct kv_token_range){0, 1ull << 48};
    }
    struct kv_vllm_export_sizes sz = {0};
    struct kv_vllm_export q = {.sizes = &sz};
    expect_msg(kv_page_table_export_vllm(pt, seqs, K, rg, &q), KV_ERR_OVERFLOW,
               "ranges[65535].count 281474976710656 makes the slots");
    int64_t sm[16];
    for (int i = 0; i < 16; i++)
        sm[i] = -7;
    struct kv_vllm_export o = {.slot_mapping = sm, .slot_mapping_len = 16};
    expect_msg(kv_page_table_export_vllm(pt, seqs, K, rg, &o), KV_ERR_OVERFLOW, "exceed 2^64");
    for (int i = 0; i < 16; i++)
        assert_int_equal(sm[i], -7);
    /* FlashInfer: one page of 2^31 tokens */
    uint32_t s2;
    assert_int_equal(kv_page_table_seq_create(pt, &s2), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s2, NULL, 1ull << 31), KV_OK);
    int32_t indptr[2] = {-7, -7}, indices[2] = {-7, -7}, lpl[1] = {-7};
    const struct kv_flashinfer_export fo = {indptr, 2, indices, 2, lpl, 1};
    uint64_t nnz = 0;
    expect_msg(kv_page_table_export_flashinfer(pt, &s2, 1, &fo, &nnz), KV_ERR_OVERFLOW,
               "pages of 2147483648 tokens: last_page_len is int32");
    assert_int_equal(indptr[0], -7);
    assert_int_equal(lpl[0], -7);
    const struct kv_flashinfer_export no_lpl = {indptr, 2, indices, 2, NULL, 0};
    assert_int_equal(kv_page_table_export_flashinfer(pt, &s2, 1, &no_lpl, &nnz), KV_OK);
    assert_int_equal(nnz, 1);
    free(seqs);
    free(rg);
    kv_page_table_destroy(pt);
    kv_block_pool_destroy(pool);
}

/* Copy-on-write through a copy taken and not yet done: the copy may have
 * run and its dst been written since, so redirecting to its src (as for a
 * copy still queued) read stale tokens; refused by name, nothing changed.
 * A hold refused by the block source (a ref-count limit) after the
 * allocation had evicted a cached block: the src is held first now, and a
 * refusal changes nothing. */
static void test_page_table_cow_through_taken_copies(void **state)
{
    (void)state;
    struct fake *f = malloc(sizeof(*f));
    fake_init(f, 16, 200);
    kv_page_table *pt = make_pt(f, 4, 1, 4, 4, false);
    uint32_t a, b, c, d;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, NULL, 2), KV_OK);
    assert_int_equal(kv_page_table_seq_fork(pt, a, &b), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, NULL, 1), KV_OK); /* cow X -> Y */
    struct kv_block_copy cp[4];
    uint32_t n = 0;
    assert_int_equal(kv_page_table_take_copies(pt, cp, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    const uint32_t y = cp[0].dst;
    assert_int_equal(kv_page_table_seq_fork(pt, a, &c), KV_OK); /* Y shared */
    uint32_t refs[16];
    for (uint32_t i = 0; i < 16; i++)
        refs[i] = f->ref[i];
    const uint32_t allocs = f->allocs;
    char want[96];
    snprintf(want, sizeof(want), "last block %u is the dst of a copy taken and not yet done", y);
    expect_msg(kv_page_table_seq_append(pt, a, NULL, 1), KV_ERR_BAD_STATE, want);
    for (uint32_t i = 0; i < 16; i++)
        assert_int_equal(f->ref[i], refs[i]);
    assert_int_equal(f->allocs, allocs);
    uint64_t len = 0;
    assert_int_equal(kv_page_table_seq_len(pt, a, &len), KV_OK);
    assert_int_equal(len, 3);
    assert_int_equal(kv_page_table_copies_done(pt), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, NULL, 1), KV_OK); /* cow Y -> Z, from Y */
    assert_int_equal(kv_page_table_take_copies(pt, cp, 4, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(cp[0].src, y);
    assert_int_equal(kv_page_table_copies_done(pt), KV_OK);
    /* c and d share Y; the block source refuses the hold of c's copy */
    assert_int_equal(kv_page_table_seq_fork(pt, c, &d), KV_OK);
    for (uint32_t i = 0; i < 16; i++)
        refs[i] = f->ref[i];
    const uint32_t allocs2 = f->allocs;
    f->fail_retain = true;
    assert_int_equal(kv_page_table_seq_append(pt, c, NULL, 1), KV_ERR_OVERFLOW);
    f->fail_retain = false;
    assert_int_equal(f->allocs, allocs2); /* nothing allocated, so nothing evicted */
    for (uint32_t i = 0; i < 16; i++)
        assert_int_equal(f->ref[i], refs[i]);
    assert_int_equal(kv_page_table_seq_len(pt, c, &len), KV_OK);
    assert_int_equal(len, 3);
    kv_page_table_destroy(pt);
    free(f);
}

/* The exports' caller arrays. Misaligned for their elements (seqs, ranges
 * and every output): read or written as words, undefined behaviour (UBSan
 * aborts); refused by name. An output over an input of the same call: the
 * fill rewrote seqs (or ranges) after they were checked, and went on with
 * the rewritten values, a page id taken for a sequence id (a read past the
 * table's sequences) or for a range; refused (KV_ERR_OVERLAP naming both).
 * Nothing written on either refusal; the aligned, apart twins export as the
 * reference. */
static void test_page_table_export_caller_arrays(void **state)
{
    (void)state;
    struct fake f;
    fake_init(&f, 64, 1000); /* block ids >= 1000: never a live sequence id */
    kv_page_table *pt = make_pt(&f, 4, 1, 4, 16, false);
    uint32_t sq[2];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(kv_page_table_seq_create(pt, &sq[i]), KV_OK);
        assert_int_equal(kv_page_table_seq_append(pt, sq[i], NULL, 9 + (uint64_t)i), KV_OK);
    }
    const struct kv_token_range rg[2] = {{0, 9}, {2, 8}};
    enum { COLS = 3, BYTES = 512 };
    _Alignas(uint64_t) unsigned char buf[BYTES];
    memset(buf, 0xA5, sizeof(buf));
    unsigned char want[BYTES];
    memcpy(want, buf, sizeof(buf));
    /* misaligned views into buf: 1 byte off for the 4-byte elements, 4 for
     * the 8-byte ones */
    uint32_t *seq_m = (uint32_t *)(void *)(buf + 1);
    memcpy(seq_m, sq, sizeof(sq));
    memcpy(want, buf, sizeof(buf));
    struct kv_token_range *rg_m = (struct kv_token_range *)(void *)(buf + 36);
    memcpy(rg_m, rg, sizeof(rg));
    memcpy(want, buf, sizeof(buf));
    int32_t *i32_m = (int32_t *)(void *)(buf + 129);
    int64_t *i64_m = (int64_t *)(void *)(buf + 132);
    int32_t bt[2 * COLS];
    int64_t sm[20], sl[2];
    struct {
        struct kv_vllm_export o;
        const uint32_t *seqs;
        const struct kv_token_range *ranges;
        const char *frag;
    } bad[] = {
        {{.block_table = bt, .block_table_len = 2 * COLS, .block_table_cols = COLS},
         seq_m,
         rg,
         "kv_page_table_export_vllm: seqs="},
        {{.slot_mapping = sm, .slot_mapping_len = 20}, sq, rg_m, "ranges="},
        {{.block_table = i32_m, .block_table_len = 2 * COLS, .block_table_cols = COLS},
         sq,
         rg,
         "block_table="},
        {{.slot_mapping = i64_m, .slot_mapping_len = 17}, sq, rg, "slot_mapping="},
        {{.seq_lens = i64_m, .seq_lens_len = 2}, sq, rg, "seq_lens="},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        expect_msg(kv_page_table_export_vllm(pt, bad[i].seqs, 2, bad[i].ranges, &bad[i].o),
                   KV_ERR_INVALID_ARG, bad[i].frag);
        assert_memory_equal(buf, want, sizeof(buf));
    }
    struct kv_flashinfer_export fb[] = {
        {.indptr = i32_m, .indptr_len = 3},
        {.indices = i32_m, .indices_len = 6},
        {.last_page_len = i32_m, .last_page_len_len = 2},
    };
    const char *ffrag[] = {"indptr=", "indices=", "last_page_len="};
    uint64_t nnz = 77;
    for (size_t i = 0; i < 3; i++) {
        expect_msg(kv_page_table_export_flashinfer(pt, sq, 2, &fb[i], &nnz), KV_ERR_INVALID_ARG,
                   ffrag[i]);
        assert_memory_equal(buf, want, sizeof(buf));
    }
    expect_msg(kv_page_table_export_flashinfer(pt, seq_m, 2, NULL, &nnz), KV_ERR_INVALID_ARG,
               "kv_page_table_export_flashinfer: seqs=");
    assert_int_equal(nnz, 77);
    /* an empty batch reads no seqs */
    assert_int_equal(kv_page_table_export_flashinfer(pt, seq_m, 0, NULL, &nnz), KV_OK);
    assert_int_equal(nnz, 0);

    /* outputs over the inputs (aligned): the seqs and ranges in the caller's
     * output buffer */
    _Alignas(uint64_t) unsigned char al[BYTES];
    uint32_t *seq_a = (uint32_t *)(void *)al;
    struct kv_token_range *rg_a = (struct kv_token_range *)(void *)(al + 64);
    memset(al, 0x5A, sizeof(al));
    memcpy(seq_a, sq, sizeof(sq));
    memcpy(rg_a, rg, sizeof(rg));
    unsigned char al_want[BYTES];
    memcpy(al_want, al, sizeof(al));
    struct {
        struct kv_vllm_export o;
        const char *frag;
    } ov[] = {
        {{.block_table = (int32_t *)(void *)al,
          .block_table_len = 2 * COLS,
          .block_table_cols = COLS},
         "block_table"},
        {{.seq_lens = (int64_t *)(void *)al, .seq_lens_len = 2}, "seq_lens"},
        {{.slot_mapping = (int64_t *)(void *)(al + 72), .slot_mapping_len = 17}, "slot_mapping"},
        {{.slot_mapping = sm, .slot_mapping_len = 20, .tokens_per_seq = 9}, NULL}, /* apart */
    };
    for (size_t i = 0; i < 3; i++) {
        expect_msg(kv_page_table_export_vllm(pt, seq_a, 2, rg_a, &ov[i].o), KV_ERR_OVERLAP,
                   ov[i].frag);
        assert_non_null(strstr(kv_last_error(), i == 2 ? "ranges" : "seqs"));
        assert_memory_equal(al, al_want, sizeof(al));
    }
    struct kv_flashinfer_export fo[] = {
        {.indptr = (int32_t *)(void *)al, .indptr_len = 3},
        {.indices = (int32_t *)(void *)al, .indices_len = 6},
        {.last_page_len = (int32_t *)(void *)(al + 4), .last_page_len_len = 2},
    };
    const char *ofrag[] = {"indptr", "indices", "last_page_len"};
    for (size_t i = 0; i < 3; i++) {
        expect_msg(kv_page_table_export_flashinfer(pt, seq_a, 2, &fo[i], &nnz), KV_ERR_OVERLAP,
                   ofrag[i]);
        assert_memory_equal(al, al_want, sizeof(al));
    }

    /* apart and aligned: the reference, from the sequences' own blocks */
    struct kv_vllm_export_sizes sz = {0};
    struct kv_vllm_export ok = {.block_table = bt,
                                .block_table_len = 2 * COLS,
                                .block_table_cols = COLS,
                                .slot_mapping = sm,
                                .slot_mapping_len = 20,
                                .seq_lens = sl,
                                .seq_lens_len = 2,
                                .sizes = &sz};
    assert_int_equal(kv_page_table_export_vllm(pt, seq_a, 2, rg_a, &ok), KV_OK);
    uint64_t at = 0;
    for (int i = 0; i < 2; i++) {
        const uint32_t *blocks = NULL;
        uint32_t nb = 0;
        assert_int_equal(kv_page_table_seq_blocks(pt, sq[i], &blocks, &nb), KV_OK);
        assert_int_equal(nb, 3);
        for (int j = 0; j < COLS; j++)
            assert_int_equal(bt[i * COLS + j], (int32_t)blocks[j]);
        assert_int_equal(sl[i], 9 + i);
        for (uint64_t t = rg[i].start; t < rg[i].start + rg[i].count; t++)
            assert_int_equal(sm[at++], (int64_t)blocks[t / 4] * 4 + (int64_t)(t % 4));
    }
    for (; at < 20; at++)
        assert_int_equal(sm[at], -1);
    assert_int_equal(sz.slot_mapping_len, 17);
    assert_int_equal(kv_page_table_export_vllm(pt, seq_a, 2, rg_a, &ov[3].o), KV_OK);
    assert_memory_equal(al, al_want, sizeof(al));
    kv_page_table_destroy(pt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_page_table_append_across_boundaries),
        cmocka_unit_test(test_page_table_slot_64bit),
        cmocka_unit_test(test_page_table_exports_match_direct_r1),
        cmocka_unit_test(test_page_table_exports_match_direct_r2),
        cmocka_unit_test(test_page_table_exports_match_direct_r4),
        cmocka_unit_test(test_page_table_size_queries),
        cmocka_unit_test(test_page_table_fork_and_cow),
        cmocka_unit_test(test_page_table_truncate_releases_exactly),
        cmocka_unit_test(test_page_table_no_blocks_all_or_nothing),
        cmocka_unit_test(test_page_table_cow_sources_stay_held),
        cmocka_unit_test(test_page_table_cow_batches_random),
        cmocka_unit_test(test_page_table_slot_overflow),
        cmocka_unit_test(test_page_table_bounds),
        cmocka_unit_test(test_page_table_prefix_reuse),
        cmocka_unit_test(test_page_table_bad_input),
        cmocka_unit_test(test_page_table_stats_null_pt_zeros),
        cmocka_unit_test(test_page_table_doc_example),
        cmocka_unit_test(test_page_table_export_totals_do_not_wrap),
        cmocka_unit_test(test_page_table_export_caller_arrays),
        cmocka_unit_test(test_page_table_cow_through_taken_copies),
        cmocka_unit_test(test_page_table_source_hold_and_drop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
