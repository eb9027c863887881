/*
 * test_page_exports.c - the page-table exports as the kernels take them,
 * through the public API only (linked against libkvcache.so).
 *
 * For page ratios 1, 2, 4 and 8 and two layouts: sequences of random
 * lengths (empty ones included) get scattered blocks far from 0; every
 * token's K/V is written straight into the arena where the layout CONFIG
 * says it lives (kvt_ref_offset_elems, from the sequence's block list), never
 * through an export or a kernel. Then, for random batches (repeats, any
 * order): each export is sized by its own size query, filled into buffers of
 * exactly that size, and handed as it stands to kv_attn_read as struct
 * kv_pages -- the vLLM block table with the export's seq_lens, and the
 * FlashInfer CSR -- which must return exactly the reference tokens.
 *
 * The CSR rule for last_page_len (1..N/r with pages, 0 for an empty
 * sequence): accepted and refused cases, each refusal naming the sequence
 * and its values and leaving the outputs untouched.
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

#include <kvcache/kv.h>

#include "kvtest.h"

enum { L = 2, B = 700, N = 16, H = 2, D = 4, NSEQ = 10, FILLER = 300, MAXLEN = 200 };

#define UNTOUCHED (-12345.0f)

/* The value of element (l, kv, h, d) of token t of sequence tag: exact in
 * f32 (< 2^24) and never 0 (the arena starts zeroed). */
static float val(uint32_t tag, uint64_t t, uint32_t l, int kv, uint32_t h, uint32_t d)
{
    return (float)(((((uint64_t)tag * 256 + t) * 2 + (uint64_t)kv) * L + l) * H * D + h * D + d +
                   1);
}

struct fixture {
    kv_cache *c;
    kv_page_table *pt;
    struct kv_layout_config cfg;
    struct kv_paged_cache pc;
    uint32_t seqs[NSEQ];
    uint64_t lens[NSEQ];
    uint32_t r, P; /* page ratio, tokens per page */
};

static void fixture_make(struct fixture *f, uint32_t r, bool block_major, uint64_t *rng)
{
    struct kv_cache_config cfg;
    kv_cache_config_init(&cfg);
    cfg.layout.num_layers = L;
    cfg.layout.num_blocks = B;
    cfg.layout.block_tokens = N;
    cfg.layout.num_heads = H;
    cfg.layout.head_dim = D;
    cfg.layout.dtype = KV_F32;
    cfg.layout.order = block_major ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.layout.arrange = block_major ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    cfg.layout.block_pad_elems = block_major ? 4 : 0;
    cfg.max_seqs = NSEQ + 1;
    cfg.page_ratio = r;
    cfg.zero_fill = true;
    memset(f, 0, sizeof(*f));
    if (kv_cache_create(&cfg, &f->c) != KV_OK)
        fail_msg("kv_cache_create: %s", kv_last_error());
    f->cfg = cfg.layout;
    f->pt = kv_cache_page_table(f->c);
    f->r = r;
    f->P = N / r;
    assert_int_equal(kv_cache_paged(f->c, &f->pc), KV_OK);

    /* a filler holds the low ids: the sequences under test get blocks >= FILLER */
    uint32_t filler;
    assert_int_equal(kv_page_table_seq_create(f->pt, &filler), KV_OK);
    assert_int_equal(kv_page_table_seq_append(f->pt, filler, NULL, (uint64_t)(FILLER - 1) * N),
                     KV_OK);
    for (int i = 0; i < NSEQ; i++) {
        assert_int_equal(kv_page_table_seq_create(f->pt, &f->seqs[i]), KV_OK);
        /* 0..2 stay empty; the rest, lengths that hit page and block edges too */
        f->lens[i] = i < 3 ? 0 : (uint64_t)kvt_range(rng, 1, MAXLEN);
        if (i == 3)
            f->lens[i] = 2 * f->P; /* a full last page */
    }
    /* interleaved appends: each sequence's blocks are scattered */
    uint64_t have[NSEQ] = {0};
    for (bool more = true; more;) {
        more = false;
        for (int i = 0; i < NSEQ; i++) {
            uint64_t n = (uint64_t)kvt_range(rng, 1, 23);
            if (n > f->lens[i] - have[i])
                n = f->lens[i] - have[i];
            if (n) {
                assert_int_equal(kv_page_table_seq_append(f->pt, f->seqs[i], NULL, n), KV_OK);
                have[i] += n;
            }
            more |= have[i] < f->lens[i];
        }
    }
    /* the reference write: at the config's address of the token's slot */
    float *arena = kv_arena_base(kv_cache_arena(f->c));
    for (int i = 0; i < NSEQ; i++) {
        const uint32_t *blocks;
        uint32_t nb;
        assert_int_equal(kv_page_table_seq_blocks(f->pt, f->seqs[i], &blocks, &nb), KV_OK);
        assert_int_equal(nb, (f->lens[i] + N - 1) / N);
        for (uint64_t t = 0; t < f->lens[i]; t++) {
            assert_true(blocks[t / N] >= FILLER); /* far from block 0 */
            for (uint32_t l = 0; l < L; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (uint32_t h = 0; h < H; h++)
                        for (uint32_t d = 0; d < D; d++)
                            arena[kvt_ref_offset_elems(&f->cfg, l, kv, blocks[t / N],
                                                       (int64_t)(t % N), h, d)] =
                                val((uint32_t)i, t, l, kv, h, d);
        }
    }
}

static void fixture_free(struct fixture *f)
{
    kv_cache_destroy(f->c);
}

/* [L][T][H][D] f32 outputs, filled with UNTOUCHED. */
static float *outputs(int64_t T, struct kv_view *k, struct kv_view *v)
{
    const size_t n = (size_t)(L * T * H * D);
    float *buf = malloc((2 * n + 1) * sizeof(*buf));
    assert_non_null(buf);
    for (size_t i = 0; i < 2 * n + 1; i++)
        buf[i] = UNTOUCHED;
    int64_t shape[4] = {L, T, H, D};
    assert_int_equal(kv_view_init(buf, n * sizeof(*buf), KV_F32, 4, shape, k), KV_OK);
    assert_int_equal(kv_view_init(buf + n, n * sizeof(*buf), KV_F32, 4, shape, v), KV_OK);
    return buf;
}

/* The read of batch which[n] must be the reference tokens, sequence after
 * sequence, every layer, K and V. */
static void expect_tokens(const float *buf, int64_t T, const uint32_t *which, uint32_t n,
                          const struct fixture *f, const char *form)
{
    const size_t half = (size_t)(L * T * H * D);
    int64_t row = 0;
    for (uint32_t b = 0; b < n; b++)
        for (uint64_t t = 0; t < f->lens[which[b]]; t++, row++)
            for (uint32_t l = 0; l < L; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (uint32_t h = 0; h < H; h++)
                        for (uint32_t d = 0; d < D; d++) {
                            const size_t e = (size_t)kv * half +
                                             (((size_t)l * (size_t)T + (size_t)row) * H + h) * D +
                                             d;
                            const float want = val(which[b], t, l, kv, h, d);
                            if (buf[e] != want)
                                fail_msg("%s, r %u: batch[%u] (seq %u) token %llu l %u kv %d h %u "
                                         "d %u: %g, want %g",
                                         form, f->r, b, which[b], (unsigned long long)t, l, kv, h,
                                         d, (double)buf[e], (double)want);
                        }
    assert_int_equal(row, T);
    assert_true(buf[2 * half] == UNTOUCHED); /* nothing past the outputs */
}

/* One random batch through both exports into kv_attn_read. */
static void check_batch(const struct fixture *f, uint64_t *rng)
{
    const uint32_t n = (uint32_t)kvt_range(rng, 0, 12);
    uint32_t which[12], batch[12];
    struct kv_token_range rg[12];
    int64_t T = 0;
    for (uint32_t b = 0; b < n; b++) {
        which[b] = (uint32_t)kvt_range(rng, 0, NSEQ - 1);
        batch[b] = f->seqs[which[b]];
        T += (int64_t)f->lens[which[b]];
        rg[b].start = 0;
        rg[b].count = f->lens[which[b]];
    }

    /* vLLM: size query, export at exactly those sizes, pages as they stand */
    struct kv_vllm_export_sizes sz;
    struct kv_vllm_export q = {.sizes = &sz};
    if (kv_page_table_export_vllm(f->pt, batch, n, rg, &q) != KV_OK)
        fail_msg("vLLM size query: %s", kv_last_error());
    assert_int_equal(sz.slot_mapping_len, (uint64_t)T);
    int32_t *bt = malloc((sz.block_table_len + 1) * sizeof(*bt));
    int64_t *sl = malloc((sz.seq_lens_len + 1) * sizeof(*sl));
    int64_t *sm = malloc((sz.slot_mapping_len + 1) * sizeof(*sm));
    assert_true(bt && sl && sm);
    struct kv_vllm_export ve = {.block_table = bt,
                                .block_table_len = sz.block_table_len,
                                .block_table_cols = sz.block_table_cols,
                                .block_table_pad = -1,
                                .slot_mapping = sm,
                                .slot_mapping_len = sz.slot_mapping_len,
                                .seq_lens = sl,
                                .seq_lens_len = sz.seq_lens_len};
    if (kv_page_table_export_vllm(f->pt, batch, n, rg, &ve) != KV_OK)
        fail_msg("vLLM export: %s", kv_last_error());
    /* the slot mapping is the reference slot of every token */
    uint64_t pos = 0;
    for (uint32_t b = 0; b < n; b++) {
        const uint32_t *blocks;
        uint32_t nb;
        assert_int_equal(kv_page_table_seq_blocks(f->pt, batch[b], &blocks, &nb), KV_OK);
        assert_int_equal(sl[b], (int64_t)f->lens[which[b]]);
        for (uint64_t t = 0; t < f->lens[which[b]]; t++)
            assert_int_equal(sm[pos++], (int64_t)blocks[t / N] * N + (int64_t)(t % N));
    }
    struct kv_pages pg_bt = {.format = KV_PAGES_BLOCK_TABLE,
                             .n_seqs = n,
                             .page_ratio = f->r,
                             .block_table = bt,
                             .block_table_cols = sz.block_table_cols,
                             .seq_lens = sl};
    struct kv_view k, v;
    float *out = outputs(T, &k, &v);
    if (kv_attn_read(f->pc, KV_ATTN_ALL_LAYERS, &pg_bt, &k, &v, NULL) != KV_OK)
        fail_msg("kv_attn_read, block table: %s", kv_last_error());
    expect_tokens(out, T, which, n, f, "block table");
    free(out);

    /* FlashInfer: size query (out NULL), export, pages as they stand */
    uint64_t nnz = 0;
    if (kv_page_table_export_flashinfer(f->pt, batch, n, NULL, &nnz) != KV_OK)
        fail_msg("CSR size query: %s", kv_last_error());
    int32_t *ip = malloc((n + 1) * sizeof(*ip)), *ind = malloc((nnz + 1) * sizeof(*ind));
    int32_t *lpl = malloc((n + 1) * sizeof(*lpl));
    assert_true(ip && ind && lpl);
    struct kv_flashinfer_export fe = {ip, n + 1, ind, nnz, lpl, n};
    if (kv_page_table_export_flashinfer(f->pt, batch, n, &fe, NULL) != KV_OK)
        fail_msg("CSR export: %s", kv_last_error());
    struct kv_pages pg_csr = {.format = KV_PAGES_CSR,
                              .n_seqs = n,
                              .page_ratio = f->r,
                              .indptr = ip,
                              .indices = ind,
                              .last_page_len = lpl};
    out = outputs(T, &k, &v);
    if (kv_attn_read(f->pc, KV_ATTN_ALL_LAYERS, &pg_csr, &k, &v, NULL) != KV_OK)
        fail_msg("kv_attn_read, CSR: %s", kv_last_error());
    expect_tokens(out, T, which, n, f, "CSR");
    free(out);

    /* the two forms list the same pages */
    for (uint32_t b = 0; b < n; b++) {
        const int32_t np = ip[b + 1] - ip[b];
        for (int32_t j = 0; j < np; j++)
            assert_int_equal(bt[(uint64_t)b * sz.block_table_cols + (uint64_t)j], ind[ip[b] + j]);
        for (uint32_t j = (uint32_t)np; j < sz.block_table_cols; j++)
            assert_int_equal(bt[(uint64_t)b * sz.block_table_cols + j], -1);
    }
    free(ip);
    free(ind);
    free(lpl);
    free(bt);
    free(sl);
    free(sm);
}

static void run_exports(uint32_t r, bool block_major, uint64_t seed)
{
    struct fixture f;
    uint64_t rng = seed;
    fixture_make(&f, r, block_major, &rng);
    for (int k = 0; k < 60; k++)
        check_batch(&f, &rng);
    fixture_free(&f);
}

static void test_page_exports_read_r1(void **state)
{
    (void)state;
    run_exports(1, false, 11);
    run_exports(1, true, 12);
}

static void test_page_exports_read_r2(void **state)
{
    (void)state;
    run_exports(2, false, 21);
    run_exports(2, true, 22);
}

static void test_page_exports_read_r4(void **state)
{
    (void)state;
    run_exports(4, false, 41);
    run_exports(4, true, 42);
}

static void test_page_exports_read_r8(void **state)
{
    (void)state;
    run_exports(8, false, 81);
    run_exports(8, true, 82);
}

/* Read the 3-sequence batch (indptr ip, indices ind) with last_page_len[] =
 * lpl into fresh outputs of T tokens; returns the status, and whether the
 * outputs are untouched in *untouched. */
static kv_status read_csr(const struct fixture *f, const int32_t *ip, const int32_t *ind,
                          const int32_t *lpl, int64_t T, bool *untouched)
{
    struct kv_pages pg = {.format = KV_PAGES_CSR,
                          .n_seqs = 3,
                          .page_ratio = f->r,
                          .indptr = ip,
                          .indices = ind,
                          .last_page_len = lpl};
    struct kv_view k, v;
    float *out = outputs(T, &k, &v);
    kv_status st = kv_attn_read(f->pc, KV_ATTN_ALL_LAYERS, &pg, &k, &v, NULL);
    *untouched = true;
    for (size_t i = 0; i < (size_t)(2 * L * T * H * D); i++)
        *untouched &= out[i] == UNTOUCHED;
    free(out);
    return st;
}

static void expect_refused(kv_status st, bool untouched, const char *needle)
{
    if (st != KV_ERR_CORRUPT)
        fail_msg("status %s, want KV_ERR_CORRUPT (%s)", kv_status_name(st), kv_last_error());
    if (!strstr(kv_last_error(), needle))
        fail_msg("\"%s\" lacks \"%s\"", kv_last_error(), needle);
    assert_true(untouched);
}

/* The CSR rule for last_page_len, as documented beside
 * kv_page_table_export_flashinfer: 1..N/r for a sequence with pages, 0 for
 * an empty one (indptr[i] == indptr[i+1]); anything else KV_ERR_CORRUPT. */
static void test_page_exports_csr_empty_sequence_rule(void **state)
{
    (void)state;
    const uint32_t ratios[2] = {1, 4};
    for (int ri = 0; ri < 2; ri++) {
        struct fixture f;
        uint64_t rng = 99 + (uint64_t)ri;
        fixture_make(&f, ratios[ri], false, &rng);
        const int32_t P = (int32_t)f.P;
        /* seqs[3] has 2 full pages, seqs[0] is empty, seqs[4] is not */
        const uint32_t which[3] = {3, 0, 4};
        uint32_t batch[3] = {f.seqs[3], f.seqs[0], f.seqs[4]};
        const int64_t T = (int64_t)(f.lens[3] + f.lens[4]);
        uint64_t nnz = 0;
        assert_int_equal(kv_page_table_export_flashinfer(f.pt, batch, 3, NULL, &nnz), KV_OK);
        int32_t ip[4], lpl[3], *ind = malloc(nnz * sizeof(*ind));
        assert_non_null(ind);
        struct kv_flashinfer_export fe = {ip, 4, ind, nnz, lpl, 3};
        assert_int_equal(kv_page_table_export_flashinfer(f.pt, batch, 3, &fe, NULL), KV_OK);
        /* what the export wrote: a full last page is N/r, the empty one 0 */
        assert_int_equal(ip[1] - ip[0], 2);
        assert_int_equal(lpl[0], P);
        assert_int_equal(ip[1], ip[2]);
        assert_int_equal(lpl[1], 0);
        const int32_t c_last = lpl[2];
        assert_true(c_last >= 1 && c_last <= P);

        /* accepted: as exported (and the tokens are the reference's) */
        struct kv_pages pg = {.format = KV_PAGES_CSR,
                              .n_seqs = 3,
                              .page_ratio = f.r,
                              .indptr = ip,
                              .indices = ind,
                              .last_page_len = lpl};
        struct kv_view k, v;
        float *out = outputs(T, &k, &v);
        if (kv_attn_read(f.pc, KV_ATTN_ALL_LAYERS, &pg, &k, &v, NULL) != KV_OK)
            fail_msg("read: %s", kv_last_error());
        expect_tokens(out, T, which, 3, &f, "CSR rule");
        free(out);
        bool untouched;
        /* accepted too: a last page of 1 token (fewer tokens, a smaller T) */
        int32_t one[3] = {1, 0, c_last};
        assert_int_equal(read_csr(&f, ip, ind, one, T - (P - 1), &untouched), KV_OK);

        char needle[200];
        /* refused: an empty sequence with last_page_len 1 (or anything but 0) */
        const int32_t bad_empty[3] = {1, -1, P + 1};
        for (int k2 = 0; k2 < 3; k2++) {
            int32_t l2[3] = {P, bad_empty[k2], c_last};
            snprintf(needle, sizeof(needle),
                     "last_page_len[1] = %d but sequence 1 has no pages (indptr[1] = indptr[2] = "
                     "%d): an empty sequence needs last_page_len 0",
                     bad_empty[k2], ip[1]);
            kv_status st = read_csr(&f, ip, ind, l2, T, &untouched);
            expect_refused(st, untouched, needle);
        }
        /* refused: 0 or more than N/r in a sequence with pages */
        const int32_t bad_full[3] = {0, P + 1, -3};
        for (int k2 = 0; k2 < 3; k2++) {
            int32_t l2[3] = {bad_full[k2], 0, c_last};
            snprintf(needle, sizeof(needle),
                     "last_page_len[0] = %d outside 1..%d (N/r) for sequence 0 of 2 pages "
                     "(indptr[0] = 0, indptr[1] = 2)",
                     bad_full[k2], P);
            kv_status st = read_csr(&f, ip, ind, l2, T, &untouched);
            expect_refused(st, untouched, needle);
        }
        int32_t l3[3] = {P, 0, 0}; /* the last sequence has pages */
        snprintf(needle, sizeof(needle), "last_page_len[2] = 0 outside 1..%d (N/r) for sequence 2",
                 P);
        kv_status st = read_csr(&f, ip, ind, l3, T, &untouched);
        expect_refused(st, untouched, needle);
        free(ind);
        fixture_free(&f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_page_exports_read_r1),
        cmocka_unit_test(test_page_exports_read_r2),
        cmocka_unit_test(test_page_exports_read_r4),
        cmocka_unit_test(test_page_exports_read_r8),
        cmocka_unit_test(test_page_exports_csr_empty_sequence_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
