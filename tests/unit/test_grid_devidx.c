/*
 * test_grid_devidx.c - the device-index entries (kv_attn_*_cuda_dev) on the
 * CPU grid emulator: the CUDA launcher's job (kv__attn_*_dev_check: scalar
 * checks only), the same launch parameters, and the kernel bodies reading
 * the index arrays themselves (kv__grid_attn_*_dev; host memory stands for
 * device memory), the error record finished as the CUDA launcher finishes
 * it. Fixtures: tests/common/kvt_grid.h (pools between guard bytes).
 *
 *   - write: valid slots (blocks far from 0, a -1, one layer and all
 *     layers, padded NHD and HND, bytes and converting moves, no scales,
 *     scales by value and in device memory with a row per layer): the
 *     WHOLE pool equals an element-by-element reference and the host-index
 *     path's pool; the record stays all zero; invalid slots (B x N, -5,
 *     INT64_MAX) skipped, guards untouched, each counted once, the first
 *     named (index, value); a later launch keeps an earlier first unless it
 *     finds a lower index;
 *   - the host side makes no allocation (kv__mem_allocs), reads no index,
 *     and refuses bad scalars and scales naming the values (by value past
 *     KV_ATTN_DEV_SCALES_MAX: KV_ERR_UNSUPPORTED), pool untouched;
 *   - decode with device CSR and with a block table + seq_lens, scales by
 *     value and in device memory: valid pages equal the host-index decode
 *     bit for bit and a float64 softmax within 1e-5; a bad indptr,
 *     last_page_len or seq_lens zeroes that sequence, a page id of -3, -2
 *     or B leaves its tokens out, block-table columns past a length are
 *     never read, the pool and the output's padding untouched, the record
 *     naming the first (array, index, value) and the count; a window that
 *     starts inside a bad page records it once, on every body;
 *   - a record whose first a launch left unfinished (another stream): a
 *     later launch fills in its value only from its own array within its
 *     length;
 *   - device pointers misaligned for their element (slots, each page
 *     array of both forms, out_indptr, copy pairs, device scales, the plan
 *     copy's id lists and its error record, the attention entries' error
 *     record): refused naming the pointer before any launch;
 *   - read with device CSR and block-table pages and out_indptr (one layer
 *     and all, f16 and f32 outputs, scales): the whole output buffers equal
 *     a reference from the documented rules and the host-index read; bad
 *     sequences, pages and output rows skipped (their rows untouched) and
 *     recorded;
 *   - copy blocks and copy_ex with device pairs: layer- and block-major
 *     padded caches, two caches of different block counts, a layer range,
 *     K, V or both, packed K|V: valid pairs equal an element reference and
 *     the host mode's pool; a src or dst id past its cache skips its pair,
 *     recorded; the source pool unchanged.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_convert_hd.h"

#include "kv_attn_grid_int.h"
#include "kv_attn_kernels_hd.h"
#include "kv_plan_grid_int.h"
#include "kv_mem.h"
#include "kvt_grid.h"
#include "kvt_side.h"
#include "kvtest.h"

struct dcase {
    kv_order order;
    int64_t pad;
    kv_dtype cache_dt, src_dt;
    bool all_layers;
};

/* Scales of a test: per KV head, a row per layer (rows 2) or shared
 * (rows 0): K [rows][2], V [rows][2] (H = 2). */
static const float wks[4] = {0.25f, 1.75f, 3.0f, 0.5f}, wvs[4] = {1.5f, 0.375f, 0.75f, 2.5f};

/* One write of slots[T] through the device-index path into f (and, with
 * host_too, through the host-index path into a copy, compared). sc: 0 no
 * scales, 1 by value (shared by the layers), 2 device memory (a row per
 * layer; host memory stands for it on the emulator). want: the expected
 * record. */
/* The record after the launches: want_count skipped indices, the first in
 * want_array (KV_ATTN_DEV_NONE with none) and, with any, at want_index
 * with want_value. */
static void check_record(const struct kv_attn_cuda_errors *rec, uint64_t want_count, int want_array,
                         int64_t want_index, int64_t want_value)
{
    struct kv_attn_cuda_error_info info;
    kv__attn_errors_decode(rec, &info);
    assert_int_equal(info.count, want_count);
    assert_int_equal((int)info.array, want_array);
    if (want_count) {
        assert_int_equal(info.index, want_index);
        assert_int_equal(info.value, want_value);
    }
}

static void run_write(const struct dcase *dc, int sc, const int64_t *slots, int64_t T,
                      uint64_t seed, bool host_too, uint64_t want_count, int64_t want_index)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    const int64_t L = 2, N = 4, H = 2, D = 8, B = 300;
    cfg.num_layers = L, cfg.num_blocks = B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = dc->cache_dt, cfg.order = dc->order;
    cfg.block_pad_elems = dc->pad;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, seed);
    const int64_t nl = dc->all_layers ? L : 1;
    const int32_t layer = dc->all_layers ? KV_ATTN_ALL_LAYERS : 1;
    struct kvt_tens k, v;
    kvt_tens_make(&k, dc->src_dt, dc->all_layers ? L : 0, T, H, D, false, 0, seed + 3);
    kvt_tens_make(&v, dc->src_dt, dc->all_layers ? L : 0, T, H, D, false, 0, seed + 5);
    const bool raw = dc->cache_dt == dc->src_dt && !sc;
    const uint32_t rows = sc == 2 ? (uint32_t)L : 0;
    const struct kv_attn_dev_scales dsc = {wks, wvs, (uint32_t)H, rows, sc == 2};
    const struct kv_scales hsc = {wks, wvs, (uint32_t)H, rows};
    const int64_t limit = B * N;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= limit)
            continue;
        for (int64_t lr = 0; lr < nl; lr++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++) {
                        unsigned char *dst =
                            kvt_gat(&f, f.ref, dc->all_layers ? lr : layer, kv, slots[t], h, d);
                        const unsigned char *src = kvt_tens_at(kv ? &v : &k, lr, t, h, d);
                        const int64_t l = dc->all_layers ? lr : layer;
                        const float s = (kv ? wvs : wks)[(rows ? l * H : 0) + h];
                        const float x = kv_to_f32(dc->src_dt, src);
                        if (raw)
                            memcpy(dst, src, (size_t)f.es);
                        else
                            kv_from_f32(dc->cache_dt, sc ? x / s : x, dst);
                    }
    }
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    const uint64_t a0 = kv__mem_allocs();
    kv_status st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, layer, &k.v, &v.v,
                                            slots, T, sc ? &dsc : NULL, &j);
    assert_int_equal(kv__mem_allocs(), a0); /* the host side allocates nothing */
    if (st != KV_OK)
        fail_msg("dev check: %s: %s", kv_status_name(st), kv_last_error());
    assert_null(j.runs); /* nothing allocated, no slot read on the host */
    assert_int_equal(j.n_runs, 0);
    st = kv__grid_attn_write_dev(&j, slots, T, sc == 1, &rec);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated dev write: %s: %s", kv_status_name(st), kv_last_error());
    kvt_gfix_check(&f, "guards + pool after the device-index write");

    check_record(&rec, want_count, want_count ? KV_ATTN_DEV_SLOTS : KV_ATTN_DEV_NONE, want_index,
                 want_count ? slots[want_index] : 0);
    if (!want_count)
        assert_int_equal(rec.first_key, 0);

    if (host_too) {
        /* the host-index path on the same initial pool lands the same bytes */
        struct kvt_gfix g;
        kvt_gfix_init(&g, &cfg, seed);
        const uint64_t a1 = kv__mem_allocs();
        st = kv__attn_write_check("kv_attn_write_cuda", &g.c, layer, &k.v, &v.v,
                                  (struct kv__attn_slots){slots, false}, T, sc ? &hsc : NULL, &j);
        assert_true(kv__mem_allocs() > a1); /* the counter sees the host mode's runs */
        if (st != KV_OK)
            fail_msg("host check: %s: %s", kv_status_name(st), kv_last_error());
        assert_int_equal(kv__grid_attn_move(&j, true), KV_OK);
        kv__attn_job_free(&j);
        kvt_check_bytes(g.mem, f.mem, f.bytes + 2 * KVT_GUARD,
                        "host-index pool vs device-index pool");
        kvt_gfix_free(&g);
    }
    kv__mem_free(k.mem), kv__mem_free(v.mem);
    kvt_gfix_free(&f);
}

static const struct dcase cases[] = {
    {KV_ORDER_NHD, 3, KV_F16, KV_F16, false},  /* bytes */
    {KV_ORDER_HND, 5, KV_F16, KV_F16, true},   /* bytes, all layers */
    {KV_ORDER_NHD, 0, KV_F16, KV_F32, true},   /* converting */
    {KV_ORDER_HND, 2, KV_BF16, KV_F32, false}, /* converting */
};

static void test_devidx_write_valid(void **state)
{
    (void)state;
    /* a decode step: scattered slots in blocks 200..299, one padding -1 */
    const int64_t slots[] = {1150, 803, 4 * 250 + 2, -1, 4 * 299 + 3, 4 * 201};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        for (int sc = 0; sc < 3; sc++)
            run_write(&cases[i], sc, slots, 6, 100 + i, true, 0, 0);
}

static void test_devidx_write_invalid(void **state)
{
    (void)state;
    const int64_t B_N = 300 * 4;
    /* index 2: past the pool; 4: negative other than -1; 6: INT64_MAX */
    const int64_t slots[] = {1001, -1, B_N, 4 * 250 + 1, -5, 4 * 299, INT64_MAX, B_N - 1};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_write(&cases[i], (int)i % 3, slots, 8, 200 + i, false, 3, 2);
    /* the first invalid at index 0 */
    const int64_t first[] = {-2, 1001, 1002};
    run_write(&cases[0], 0, first, 3, 300, false, 1, 0);
}

/* Two launches into one record: the first stays unless a lower index. */
static void test_devidx_record_across_launches(void **state)
{
    (void)state;
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv_attn_cuda_error_info info;
    const int64_t a[] = {0, 0, 0, -7}, b[] = {0, 0, 0, 0, 0, 99999}, c[] = {0, -9};
    kv__dev_error(&rec, KV_ATTN_DEV_SLOTS, 3);
    kv__dev_error_finish_in(&rec, &(struct kv__dev_arrays){.slots = a, .n_slots = 4});
    kv__dev_error(&rec, KV_ATTN_DEV_SLOTS, 5);
    kv__dev_error_finish_in(&rec, &(struct kv__dev_arrays){.slots = b, .n_slots = 6});
    kv__attn_errors_decode(&rec, &info);
    assert_int_equal(info.count, 2);
    assert_int_equal(info.index, 3);
    assert_int_equal(info.value, -7);
    kv__dev_error(&rec, KV_ATTN_DEV_SLOTS, 1);
    kv__dev_error_finish_in(&rec, &(struct kv__dev_arrays){.slots = c, .n_slots = 2});
    kv__attn_errors_decode(&rec, &info);
    assert_int_equal(info.count, 3);
    assert_int_equal(info.index, 1);
    assert_int_equal(info.value, -9);
}

static void test_devidx_write_refusals(void **state)
{
    (void)state;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2, cfg.num_blocks = 300, cfg.block_tokens = 4, cfg.num_heads = 2;
    cfg.head_dim = 8, cfg.dtype = KV_F16, cfg.block_pad_elems = 3;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 7);
    struct kvt_tens k, v;
    kvt_tens_make(&k, KV_F16, 0, 3, 2, 8, false, 0, 1);
    kvt_tens_make(&v, KV_F16, 0, 3, 2, 8, false, 0, 2);
    const int64_t slots[4] = {1000, 1001, 1002, 1003};
    struct kv__attn_job j;
    kv_status st =
        kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 1, &k.v, &v.v, slots, 4, NULL, &j);
    assert_int_equal(st, KV_ERR_BAD_SHAPE);
    assert_non_null(strstr(kv_last_error(), "n_slots 4 outside [0, T = 3]"));
    st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 1, &k.v, &v.v, NULL, 2, NULL, &j);
    assert_int_equal(st, KV_ERR_NULL);
    /* scales: each refusal names the values */
    const float one[2] = {1.0f, 1.0f}, bad[2] = {1.0f, NAN};
    const struct {
        struct kv_attn_dev_scales sc;
        kv_status want;
        const char *msg;
    } scr[5] = {
        {{one, one, 1, 0, 2}, KV_ERR_INVALID_ARG, "scales device 2: expected 0"},
        {{one, bad, 2, 0, 0}, KV_ERR_INVALID_ARG, "V scale 1 is nan"},
        {{NULL, one, 1, 0, 1},
         KV_ERR_NULL,
         "device scales given with their K scales NULL (k=(nil)"},
        {{one, one, 3, 0, 1}, KV_ERR_INVALID_ARG, "3 scales: expected 1 (per tensor) or 2"},
        {{one, one, 1, 5, 1}, KV_ERR_INVALID_ARG, "scales for 5 layers: expected 0 or 1"},
    };
    for (int i = 0; i < 5; i++) {
        st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 1, &k.v, &v.v, slots, 3,
                                      &scr[i].sc, &j);
        assert_int_equal(st, scr[i].want);
        kvt_assert_msg_has(scr[i].msg);
    }
    /* by value past KV_ATTN_DEV_SCALES_MAX: 70 layers x 2 heads */
    {
        struct kv_layout_config c70 = KV_LAYOUT_CONFIG_INIT;
        c70.num_layers = 70, c70.num_blocks = 4, c70.block_tokens = 1, c70.num_heads = 2;
        c70.head_dim = 8, c70.dtype = KV_F16;
        struct kvt_gfix g;
        kvt_gfix_init(&g, &c70, 8);
        struct kvt_tens k70, v70;
        kvt_tens_make(&k70, KV_F16, 70, 1, 2, 8, false, 0, 3);
        kvt_tens_make(&v70, KV_F16, 70, 1, 2, 8, false, 0, 4);
        float s140[140];
        for (int i = 0; i < 140; i++)
            s140[i] = 1.0f;
        const struct kv_attn_dev_scales by_value = {s140, s140, 2, 70, 0};
        st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &g.c, KV_ATTN_ALL_LAYERS, &k70.v,
                                      &v70.v, slots, 1, &by_value, &j);
        assert_int_equal(st, KV_ERR_UNSUPPORTED);
        kvt_assert_msg_has("140 scales per plane by value (at most 128)");
        const struct kv_attn_dev_scales on_dev = {s140, s140, 2, 70, 1};
        st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &g.c, KV_ATTN_ALL_LAYERS, &k70.v,
                                      &v70.v, slots, 1, &on_dev, &j);
        assert_int_equal(st, KV_OK);
        kv__attn_job_free(&j);
        kvt_gfix_check(&g, "pool after the checks");
        kv__mem_free(k70.mem), kv__mem_free(v70.mem);
        kvt_gfix_free(&g);
    }
    st =
        kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 2, &k.v, &v.v, slots, 3, NULL, &j);
    assert_int_not_equal(st, KV_OK);
    /* the public entry: same refusals, nothing launched or changed */
    st = kv_attn_write_cuda_dev(f.c, 1, &k.v, &v.v, slots, 4, NULL, NULL, NULL);
    assert_int_not_equal(st, KV_OK);
    kvt_gfix_check(&f, "pool after refusals");
    kv__mem_free(k.mem), kv__mem_free(v.mem);
    kvt_gfix_free(&f);
}

/* ---- decode with device CSR ------------------------------------------------------- */

#define DEC_B 200
#define DEC_N 4
#define DEC_H 2
#define DEC_G 2
#define DEC_D 40

/* Sequence s of device pages dp by the documented device rules: its tokens
 * (0 for a sequence skipped) and its page list. */
static int64_t ref_seq(const struct kv_attn_dev_pages *dp, uint32_t s, int64_t pt,
                       const int32_t **pages)
{
    if (dp->format == KV_PAGES_BLOCK_TABLE) {
        const int64_t len = dp->seq_lens[s];
        *pages = dp->block_table + (int64_t)s * dp->block_table_cols;
        return len >= 0 && len <= (int64_t)dp->block_table_cols * pt ? len : 0;
    }
    const int64_t a = dp->indptr[s], b = dp->indptr[s + 1], ll = dp->last_page_len[s];
    bool ok = a >= 0 && a <= dp->n_pages && b >= a && b <= dp->n_pages;
    ok = ok && (b == a ? ll == 0 : ll >= 1 && ll <= pt);
    *pages = dp->indices + (ok ? a : 0);
    return ok && b > a ? (b - a - 1) * pt + ll : 0;
}

/* Decode dp's sequences (layer 1 of a padded HND f32 cache) on the emulator
 * in the device mode. sc: 0 no scales, 1 by value, 2 device memory (per
 * KV head, a row per layer: layer 1's row is read). want_*: the expected
 * record. With host_too the host-index mode's output (CSR or block table
 * as dp, the same scales as kv_scales) must be the same bytes. */
/* Options of run_dec's two decodes (NULL: none). With options the
 * device-index output (and lse) must equal the host-index one byte for
 * byte; test_grid.c checks the options against float64. */
static struct kv_attn_opts *dec_opts;
/* run_dec's block padding (elements): 3 leaves rows 4-byte aligned (the
 * general body whatever the hook), 4 makes them 16-byte vectors (the
 * vector bodies) */
static int64_t dec_pad = 3;
/* run_dec's record before its launch (NULL: all zero); the next run_dec
 * takes it and sets it back to NULL (a failed case leaves none behind) */
static const struct kv_attn_cuda_errors *dec_rec_in;

static void run_dec(const struct kv_attn_dev_pages *dp, int sc, uint64_t want_count, int want_array,
                    int64_t want_index, int64_t want_value, bool host_too)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    const int64_t N = DEC_N, H = DEC_H, D = DEC_D, Hq = H * DEC_G, pt = N;
    const uint32_t S = dp->n_seqs;
    cfg.num_layers = 2, cfg.num_blocks = DEC_B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = KV_F32, cfg.order = KV_ORDER_HND, cfg.block_pad_elems = dec_pad;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 77);
    uint64_t rng = 5;
    const uint32_t layer = 1;
    for (int64_t slot = 0; slot < DEC_B * N; slot++)
        for (int kv = 0; kv < 2; kv++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++) {
                    const float x = (float)kvt_range(&rng, -1000, 1000) / 1000.0f;
                    kv_from_f32(KV_F32, x, kvt_gat(&f, f.pool, layer, kv, slot, h, d));
                }
    memcpy(f.refmem, f.mem, f.bytes + 2 * KVT_GUARD);
    const int64_t row = D + 8, n1 = (int64_t)S * Hq * row;
    float *qb = kv__mem_alloc_aligned(64, (size_t)n1 * 4),
          *ob = kv__mem_alloc_aligned(64, (size_t)n1 * 4);
    float *ob0 = malloc((size_t)n1 * 4), *oh = malloc((size_t)n1 * 4);
    assert_true(qb && ob && ob0 && oh);
    for (int64_t i = 0; i < n1; i++)
        qb[i] = (float)kvt_range(&rng, -1000, 1000) / 1000.0f;
    kvt_fill(ob, (size_t)n1 * 4, 9);
    memcpy(ob0, ob, (size_t)n1 * 4);
    struct kv_view q, out, flat;
    int64_t sh[3] = {S, Hq, D}, st3[3] = {Hq * row, row, 1}, nn = n1;
    assert_int_equal(kv_view_init(qb, (size_t)n1 * 4, KV_F32, 1, &nn, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st3, 0, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)n1 * 4, KV_F32, 1, &nn, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st3, 0, &out), KV_OK);
    const float smscale = 1.0f / sqrtf((float)D);
    /* per KV head, rows for layers 0 and 1 (layer 1: wks[2..3]) */
    const struct kv_attn_dev_scales dsc = {wks, wvs, (uint32_t)H, 2, sc == 2};
    const struct kv_scales hsc = {wks, wvs, (uint32_t)H, 2};
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    if (dec_rec_in)
        rec = *dec_rec_in;
    dec_rec_in = NULL;
    struct kv__attn_job j;
    const uint64_t a0 = kv__mem_allocs();
    float lse_dev[64], lse_host[64];
    assert_true(S * Hq <= 64);
    if (dec_opts) {
        for (int i = 0; i < 64; i++)
            lse_dev[i] = lse_host[i] = -7.0f;
        dec_opts->lse = lse_dev;
    }
    kv_status st = kv__attn_decode_dev_check("kv_attn_decode_ex_cuda_dev", &f.c, layer, &q, dp,
                                             smscale, sc ? &dsc : NULL, &out, dec_opts, &j);
    assert_int_equal(kv__mem_allocs(), a0); /* the host side allocates nothing */
    if (st != KV_OK)
        fail_msg("dev decode check: %s: %s", kv_status_name(st), kv_last_error());
    assert_null(j.page_ids); /* nothing read or allocated on the host */
    st = kv__grid_attn_decode_dev(&j, dp, sc == 1, &rec);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated dev decode: %s: %s", kv_status_name(st), kv_last_error());
    /* the body that ran: a vector-family one (4 x 4 x (D + 2) floats of
     * shared memory) where rows are 16-byte aligned (pad 4: 10 vectors)
     * and one was asked for, else the general one (pad 3: 40 4-byte
     * vectors, more than a warp) */
    struct kv__grid_attn_last lst;
    kv__grid_attn_last(&lst);
    const bool vec_ran = dec_pad % 4 == 0 && kv__cdec_body != KV__CDEC_GENERAL;
    assert_int_equal(lst.launch.shared_bytes,
                     vec_ran ? 16 * (D + 2) * 4 : (2 * D + 4 * (2 * D + 4)) * 4);
    kvt_gfix_check(&f, "guards + pool after the decode");
    check_record(&rec, want_count, want_array, want_index, want_value);
    if (host_too) {
        memcpy(oh, ob, (size_t)n1 * 4);
        memcpy(ob, ob0, (size_t)n1 * 4);
        struct kv_pages hp;
        memset(&hp, 0, sizeof(hp));
        hp.n_seqs = S, hp.page_ratio = 1;
        int64_t lens[16];
        if (dp->format == KV_PAGES_BLOCK_TABLE) {
            for (uint32_t i = 0; i < S; i++)
                lens[i] = dp->seq_lens[i];
            hp.format = KV_PAGES_BLOCK_TABLE, hp.block_table = dp->block_table;
            hp.block_table_cols = dp->block_table_cols, hp.seq_lens = lens;
        } else {
            hp.format = KV_PAGES_CSR, hp.indptr = dp->indptr, hp.indices = dp->indices;
            hp.last_page_len = dp->last_page_len;
        }
        if (dec_opts)
            dec_opts->lse = lse_host;
        st = kv__attn_decode_check("kv_attn_decode_cuda", &f.c, layer, &q, NULL, &hp, smscale,
                                   sc ? &hsc : NULL, &out, dec_opts, &j);
        assert_int_equal(st, KV_OK);
        assert_int_equal(kv__grid_attn_decode(&j), KV_OK);
        kv__attn_job_free(&j);
        kvt_check_bytes((unsigned char *)oh, (unsigned char *)ob, (size_t)n1 * 4,
                        "device-index output vs host-index output");
        if (dec_opts) {
            kvt_check_bytes((unsigned char *)lse_dev, (unsigned char *)lse_host, sizeof(lse_dev),
                            "device-index lse vs host-index lse");
            /* the float64 reference below has no options */
            free(ob0), free(oh);
            kv__mem_free(qb), kv__mem_free(ob);
            kvt_gfix_free(&f);
            return;
        }
    }
    /* float64 reference, from the pages by the documented rules (options
     * here: a window only) */
    const int64_t wl = dec_opts ? dec_opts->window_left : -1;
    assert_true(!dec_opts || dec_opts->logit_soft_cap == 0.0f);
    for (uint32_t s = 0; s < S; s++) {
        const int32_t *pages;
        const int64_t n_tok = ref_seq(dp, s, pt, &pages);
        const int64_t t_first = wl >= 0 && n_tok - 1 - wl > 0 ? n_tok - 1 - wl : 0;
        for (int64_t qi = 0; qi < Hq; qi++) {
            const int64_t h = qi / DEC_G;
            const double ks = sc ? wks[H + h] : 1.0, vs = sc ? wvs[H + h] : 1.0;
            double scv[64], mx = -INFINITY, sum = 0;
            int64_t sl[64], n = 0;
            for (int64_t t = t_first; t < n_tok; t++) {
                const int64_t pg = pages[t / pt];
                if (pg < 0 || pg >= DEC_B)
                    continue;
                sl[n] = pg * pt + t % pt;
                double dot = 0;
                for (int64_t d = 0; d < D; d++)
                    dot += (double)qb[(s * Hq + qi) * row + d] *
                           (double)kv_to_f32(KV_F32, kvt_gat(&f, f.ref, layer, 0, sl[n], h, d));
                scv[n] = dot * smscale * ks;
                mx = scv[n] > mx ? scv[n] : mx;
                n++;
            }
            for (int64_t t = 0; t < n; t++)
                sum += (scv[t] = exp(scv[t] - mx));
            for (int64_t d = 0; d < D; d++) {
                double ref = 0;
                for (int64_t t = 0; t < n; t++)
                    ref += scv[t] / sum * vs *
                           (double)kv_to_f32(KV_F32, kvt_gat(&f, f.ref, layer, 1, sl[t], h, d));
                float *o = &ob[(s * Hq + qi) * row + d];
                const double err = fabs((double)*o - ref) / (fabs(ref) > 0.1 ? fabs(ref) : 0.1);
                if (!(err <= 1e-5))
                    fail_msg("decode s%u q%lld d%lld: %.9g vs %.9g", s, (long long)qi, (long long)d,
                             (double)*o, ref);
                *o = ob0[o - ob];
            }
        }
    }
    kvt_check_bytes((unsigned char *)ob, (unsigned char *)ob0, (size_t)n1 * 4, "output padding");
    free(ob0), free(oh);
    kv__mem_free(qb), kv__mem_free(ob);
    kvt_gfix_free(&f);
}

static struct kv_attn_dev_pages csr(uint32_t S, const int32_t *indptr, const int32_t *indices,
                                    int64_t n_pages, const int32_t *last)
{
    return (struct kv_attn_dev_pages){.n_seqs = S,
                                      .page_ratio = 1,
                                      .indptr = indptr,
                                      .indices = indices,
                                      .n_pages = n_pages,
                                      .last_page_len = last};
}

static struct kv_attn_dev_pages btab(uint32_t S, const int32_t *table, uint32_t cols,
                                     const int32_t *lens)
{
    struct kv_attn_dev_pages p = {.n_seqs = S, .page_ratio = 1};
    p.format = KV_PAGES_BLOCK_TABLE, p.block_table = table, p.block_table_cols = cols;
    p.seq_lens = lens;
    return p;
}

/* The sequences of the valid decode, MLA decode and read tests: lengths 7,
 * 0, 1, 16 on pages far from 0, as CSR (vs_csr) and as a block table of 5
 * columns (vs_btab: padding -1 and a stale id past the pool beyond each
 * length, never read). */
static const int32_t vs_indptr[5] = {0, 2, 2, 3, 7}, vs_last[4] = {3, 0, 1, 4};
static const int32_t vs_indices[7] = {150, 199, 120, 101, 188, 170, 131};
static const int32_t vs_table[4 * 5] = {150, 199, -1, DEC_B, -1, 77,  -1,  -1,  -1,  -1,
                                        120, -1,  -1, -1,    -1, 101, 188, 170, 131, 9999};
static const int32_t vs_lens[4] = {7, 0, 1, 16};

static struct kv_attn_dev_pages vs_csr(void)
{
    return csr(4, vs_indptr, vs_indices, 7, vs_last);
}

static struct kv_attn_dev_pages vs_btab(void)
{
    return btab(4, vs_table, 5, vs_lens);
}

/* The decode bodies each decode test runs (kv__cdec_body, kv__cdec_chunks),
 * each with the block padding of 3 (every body runs the general one) and
 * then 4 (the vector family runs): general, auto (the vector body with pad
 * 4), pipelined vector, split-KV in 3 chunks (16 tokens: 6, 6, 4) and by
 * its plan (the device mode's plan has no lengths: chunks of >= 256
 * tokens, all but the first empty). Index N_DEC_BODIES: back to auto,
 * pad 3. */
static const int dec_bodies[][2] = {{KV__CDEC_GENERAL, 0},
                                    {KV__CDEC_AUTO, 0},
                                    {KV__CDEC_PIPE, 0},
                                    {KV__CDEC_SPLIT, 3},
                                    {KV__CDEC_SPLIT, 0}};
#define N_DEC_BODIES (2 * sizeof(dec_bodies) / sizeof(dec_bodies[0]))

static void dec_body(size_t b)
{
    const size_t n = N_DEC_BODIES / 2, i = b % n;
    kv__cdec_body = b < N_DEC_BODIES ? dec_bodies[i][0] : KV__CDEC_AUTO;
    kv__cdec_chunks = b < N_DEC_BODIES ? dec_bodies[i][1] : 0;
    dec_pad = b < N_DEC_BODIES && b >= n ? 4 : 3;
}

static void decode_valid(void);

static void test_devidx_decode_valid(void **state)
{
    (void)state;
    for (size_t b = 0; b < N_DEC_BODIES; b++) {
        dec_body(b);
        decode_valid();
    }
    dec_body(N_DEC_BODIES);
}

static void decode_valid(void)
{
    /* the vs_ sequences, CSR then the block table */
    const struct kv_attn_dev_pages c = vs_csr(), t = vs_btab();
    for (int sc = 0; sc < 3; sc++)
        run_dec(&c, sc, 0, KV_ATTN_DEV_NONE, 0, 0, true);
    for (int sc = 0; sc < 3; sc++)
        run_dec(&t, sc, 0, KV_ATTN_DEV_NONE, 0, 0, true);
}

/* kv_attn_decode_ex_cuda_dev: a window (shorter than some sequences), a
 * soft cap and lse, CSR and block table, scales by value and in device
 * memory: output and lse equal the host-index decode's with the same
 * options, byte for byte. */
static void test_devidx_decode_options(void **state)
{
    (void)state;
    const struct kv_attn_dev_pages c = vs_csr(), t = vs_btab();
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.window_left = 4;
    o.logit_soft_cap = 3.0f;
    o.lse_stride = 0;
    dec_opts = &o;
    for (size_t b = 0; b < N_DEC_BODIES; b++) {
        dec_body(b);
        for (int sc = 0; sc < 3; sc++) {
            run_dec(&c, sc, 0, KV_ATTN_DEV_NONE, 0, 0, true);
            run_dec(&t, sc, 0, KV_ATTN_DEV_NONE, 0, 0, true);
        }
    }
    dec_body(N_DEC_BODIES);
    dec_opts = NULL;
}

/* ---- MLA decode with device pages ------------------------------------------------ */

/* MLA decode (kv_attn_decode_mla_cuda_dev: one latent plane, H 1, D 64,
 * dv 48, Hq 5, bf16, a K scale row per layer) of dp's sequences on the
 * emulator; sc: 0 no scale, 1 by value, 2 device memory (layer 1's row is
 * read). The record must be want_*; every output row must equal the
 * host-index MLA decode's over host_lens (the sequences' lengths with the
 * bad ones 0, the same page lists) byte for byte, except the sequences in
 * skip (a bad page's tokens are left out): those match, within float
 * rounding, the host decode over their valid pages alone (all full). */
static void run_mla_dev(const struct kv_attn_dev_pages *dp, int sc, const int64_t *host_lens,
                        const bool *skip, uint64_t want_count, int want_array, int64_t want_index,
                        int64_t want_value)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    const int64_t N = DEC_N, D = 64, dv = 48, Hq = 5;
    const uint32_t S = dp->n_seqs, layer = 1;
    cfg.num_layers = 2, cfg.num_blocks = DEC_B, cfg.block_tokens = N, cfg.num_heads = 1;
    cfg.head_dim = D, cfg.dtype = KV_BF16, cfg.k_only = true, cfg.block_pad_elems = 8;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 91);
    uint64_t rng = 17;
    for (int64_t slot = 0; slot < DEC_B * N; slot++)
        for (int64_t d = 0; d < D; d++)
            kv_from_f32(KV_BF16, (float)kvt_range(&rng, -1000, 1000) / 1000.0f,
                        kvt_gat(&f, f.pool, layer, 0, slot, 0, d));
    memcpy(f.refmem, f.mem, f.bytes + 2 * KVT_GUARD);
    const int64_t nq = (int64_t)S * Hq * D, no = (int64_t)S * Hq * dv;
    float *qb = kv__mem_alloc_aligned(64, (size_t)nq * 4), *ob = malloc((size_t)no * 4),
          *oh = malloc((size_t)no * 4);
    assert_true(qb && ob && oh);
    for (int64_t i = 0; i < nq; i++)
        qb[i] = (float)kvt_range(&rng, -1000, 1000) / 1000.0f;
    kvt_fill(ob, (size_t)no * 4, 3);
    memcpy(oh, ob, (size_t)no * 4);
    struct kv_view q, out, hout;
    int64_t shq[3] = {S, Hq, D}, sho[3] = {S, Hq, dv};
    assert_int_equal(kv_view_init(qb, (size_t)nq * 4, KV_F32, 3, shq, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)no * 4, KV_F32, 3, sho, &out), KV_OK);
    assert_int_equal(kv_view_init(oh, (size_t)no * 4, KV_F32, 3, sho, &hout), KV_OK);
    static const float ksr[2] = {0.5f, 1.25f}; /* layer rows */
    const struct kv_attn_dev_scales dsc = {ksr, NULL, 1, 2, sc == 2};
    const struct kv_scales hsc = {ksr, NULL, 1, 2};
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    const float *ksc = NULL;
    const uint64_t a0 = kv__mem_allocs();
    kv_status st = kv__attn_decode_mla_dev_check("kv_attn_decode_mla_cuda_dev", &f.c, layer, &q, dp,
                                                 dv, 0.125f, sc ? &dsc : NULL, &out, &j, &ksc);
    assert_int_equal(kv__mem_allocs(), a0);
    if (st != KV_OK)
        fail_msg("MLA dev check: %s: %s", kv_status_name(st), kv_last_error());
    assert_true(sc == 2 ? ksc == ksr + layer : ksc == NULL);
    st = kv__grid_attn_decode_mla_dev(&j, dp, ksc, &rec);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated MLA dev decode: %s: %s", kv_status_name(st), kv_last_error());
    kvt_gfix_check(&f, "guards + pool after the MLA decode");
    check_record(&rec, want_count, want_array, want_index, want_value);
    /* the host-index MLA decode over the same pages, bad sequences empty */
    struct kv_pages hp;
    memset(&hp, 0, sizeof(hp));
    hp.n_seqs = S, hp.page_ratio = 1;
    int32_t hindptr[17], hlast[16];
    const int32_t *src_pages[16];
    int32_t hidx[64];
    int32_t k = 0;
    for (uint32_t i = 0; i < S; i++) {
        const int32_t *pg;
        (void)ref_seq(dp, i, N, &pg);
        src_pages[i] = pg;
        const int64_t np = (host_lens[i] + N - 1) / N;
        hindptr[i] = k;
        int64_t kept = 0;
        for (int64_t x = 0; x < np; x++)
            if (!skip[i] || (src_pages[i][x] >= 0 && src_pages[i][x] < DEC_B))
                hidx[k++] = src_pages[i][x], kept++;
        /* a skip sequence: its valid pages, each full (the test's choice) */
        hlast[i] =
            skip[i] ? (kept ? (int32_t)N : 0) : (np ? (int32_t)(host_lens[i] - (np - 1) * N) : 0);
    }
    hindptr[S] = k;
    hp.format = KV_PAGES_CSR, hp.indptr = hindptr, hp.indices = hidx, hp.last_page_len = hlast;
    st = kv__attn_decode_mla_check("kv_attn_decode_mla_cuda", &f.c, layer, &q, &hp, dv, 0.125f,
                                   sc ? &hsc : NULL, &hout, &j);
    if (st != KV_OK)
        fail_msg("MLA host check: %s: %s", kv_status_name(st), kv_last_error());
    assert_int_equal(kv__grid_attn_decode_mla(&j), KV_OK);
    kv__attn_job_free(&j);
    for (uint32_t i = 0; i < S; i++) {
        const size_t at = (size_t)i * (size_t)(Hq * dv), n = (size_t)(Hq * dv) * 4;
        if (skip[i]) { /* the same tokens in other tiles: within float rounding */
            for (size_t e = 0; e < (size_t)(Hq * dv); e++) {
                const double x = ob[at + e], y = oh[at + e];
                if (!(fabs(x - y) <= 1e-5 * (fabs(y) > 0.1 ? fabs(y) : 0.1)))
                    fail_msg("MLA sequence %u elem %zu: %.9g vs %.9g without the bad page", i, e, x,
                             y);
            }
            continue;
        }
        if (memcmp(ob + at, oh + at, n) != 0)
            fail_msg("MLA sequence %u: device-index output differs from host-index", i);
    }
    free(ob), free(oh);
    kv__mem_free(qb);
    kvt_gfix_free(&f);
}

static void test_devidx_decode_mla(void **state)
{
    (void)state;
    /* the vs_ sequences, CSR and the block table */
    const int64_t lens[4] = {7, 0, 1, 16};
    const bool none[4] = {false, false, false, false};
    const struct kv_attn_dev_pages c = vs_csr(), t = vs_btab();
    for (int sc = 0; sc < 3; sc++) {
        run_mla_dev(&c, sc, lens, none, 0, KV_ATTN_DEV_NONE, 0, 0);
        run_mla_dev(&t, sc, lens, none, 0, KV_ATTN_DEV_NONE, 0, 0);
    }
    /* s2's seq_lens 21 > 5 columns x 4: output 0 (as an empty sequence) */
    const int32_t blens[4] = {7, 0, 21, 16};
    const int64_t hl[4] = {7, 0, 0, 16};
    const struct kv_attn_dev_pages tb = btab(4, vs_table, 5, blens);
    run_mla_dev(&tb, 1, hl, none, 1, KV_ATTN_DEV_SEQ_LENS, 2, 21);
    /* s3's second page id is the pool's size: its tokens are left out */
    const int32_t bad[7] = {150, 199, 120, 101, DEC_B, 170, 131};
    const bool s3[4] = {false, false, false, true};
    const struct kv_attn_dev_pages cb = csr(4, vs_indptr, bad, 7, vs_last);
    run_mla_dev(&cb, 2, lens, s3, 1, KV_ATTN_DEV_PAGES, 4, DEC_B);
}

static void decode_invalid(void);

static void test_devidx_decode_invalid(void **state)
{
    (void)state;
    for (size_t b = 0; b < N_DEC_BODIES; b++) {
        dec_body(b);
        decode_invalid();
    }
    dec_body(N_DEC_BODIES);
}

static void decode_invalid(void)
{
    /* s1: page ids 200 (= B) and 120; s2: last_page_len 5 > N; s3: indptr
     * decreases (5 -> 3); s0 valid */
    const int32_t indptr[5] = {0, 2, 4, 5, 3}, last[4] = {3, 2, 5, 2};
    const int32_t indices[5] = {150, 199, DEC_B, 120, 101};
    const struct kv_attn_dev_pages c1 = csr(4, indptr, indices, 5, last);
    run_dec(&c1, 1, 3, KV_ATTN_DEV_INDPTR, 4, 3, false);
    /* page errors only: -3 at index 1, B at index 2 */
    const int32_t ip2[3] = {0, 2, 4}, l2[2] = {4, 3}, ix2[4] = {150, -3, DEC_B, 120};
    const struct kv_attn_dev_pages c2 = csr(2, ip2, ix2, 4, l2);
    run_dec(&c2, 0, 2, KV_ATTN_DEV_PAGES, 1, -3, false);
    /* indptr past n_pages: index 2 */
    const int32_t ip3[3] = {0, 1, 9}, l3[2] = {4, 3}, ix3[2] = {150, 120};
    const struct kv_attn_dev_pages c3 = csr(2, ip3, ix3, 2, l3);
    run_dec(&c3, 2, 1, KV_ATTN_DEV_INDPTR, 2, 9, false);
    /* block table: s0 page 1 of 3 is B (index 0 x 3 + 1); s1 seq_lens 13 >
     * 3 x N; s2 seq_lens -1; s3 valid with page -7 past its length */
    const int32_t tb[4 * 3] = {150, DEC_B, 120, 101, 102, 103, 104, 105, 106, 131, 132, -7};
    const int32_t lens[4] = {9, 13, -1, 6};
    const struct kv_attn_dev_pages t = btab(4, tb, 3, lens);
    run_dec(&t, 1, 3, KV_ATTN_DEV_PAGES, 1, DEC_B, false); /* the lowest array first */
    /* seq_lens errors only: s1 13 > 3 x N is the first */
    const int32_t lens3[4] = {3, 13, -1, 6};
    const struct kv_attn_dev_pages t3 = btab(4, tb, 3, lens3);
    run_dec(&t3, 0, 2, KV_ATTN_DEV_SEQ_LENS, 1, 13, false);
    /* block-table page errors only: s1's page 0 is -2 (index 1 x 2 + 0) */
    const int32_t tb2[2 * 2] = {150, 151, -2, 120}, lens2[2] = {8, 5};
    const struct kv_attn_dev_pages t2 = btab(2, tb2, 2, lens2);
    run_dec(&t2, 2, 1, KV_ATTN_DEV_PAGES, 2, -2, false);
}

/* A record whose first was recorded by a launch whose finish has not run
 * (another stream sharing the record): a later launch's finish reads its
 * own arrays only within their lengths; past them the first keeps no value
 * (never read out of bounds: each array here is longer in memory than the
 * launch says, holding a decoy past its end). */
static void test_devidx_record_foreign_first(void **state)
{
    (void)state;
    struct kv_attn_cuda_errors in;
    /* decode, CSR: 1 sequence of 3 pages (n_pages 3, indptr [2]) */
    const int32_t ip[8] = {0, 3, 0, 0, 0, 9, 0, 0}, last[4] = {4, 0, 0, 3};
    int32_t idx[1200];
    for (int i = 0; i < 1200; i++)
        idx[i] = 77;
    idx[0] = 150, idx[1] = 120, idx[2] = 101;
    const struct kv_attn_dev_pages c = csr(1, ip, idx, 3, last);
    const struct {
        int array;
        int64_t index;
    } foreign[4] = {{KV_ATTN_DEV_PAGES, 1000},
                    {KV_ATTN_DEV_PAGES, 3},
                    {KV_ATTN_DEV_INDPTR, 5},
                    {KV_ATTN_DEV_LAST_LEN, 3}};
    for (int i = 0; i < 4; i++) {
        memset(&in, 0, sizeof(in));
        kv__dev_error(&in, foreign[i].array, foreign[i].index);
        dec_rec_in = &in;
        run_dec(&c, 0, 1, foreign[i].array, foreign[i].index, 0, false);
    }
    /* block table: 1 sequence, 3 columns (entries 0..2), seq_lens [1] */
    const int32_t tb[8] = {150, 120, 101, 77, 77, 77, 77, 77}, lens[4] = {12, 5, 5, 5};
    const struct kv_attn_dev_pages t = btab(1, tb, 3, lens);
    memset(&in, 0, sizeof(in));
    kv__dev_error(&in, KV_ATTN_DEV_PAGES, 6);
    dec_rec_in = &in;
    run_dec(&t, 0, 1, KV_ATTN_DEV_PAGES, 6, 0, false);
    memset(&in, 0, sizeof(in));
    kv__dev_error(&in, KV_ATTN_DEV_SEQ_LENS, 2);
    dec_rec_in = &in;
    run_dec(&t, 0, 1, KV_ATTN_DEV_SEQ_LENS, 2, 0, false);
    /* within the launch's arrays it gets this launch's value (the record
     * cannot tell the launches apart there) */
    memset(&in, 0, sizeof(in));
    kv__dev_error(&in, KV_ATTN_DEV_PAGES, 2);
    dec_rec_in = &in;
    run_dec(&t, 0, 1, KV_ATTN_DEV_PAGES, 2, 101, false);
    /* slots and copy pairs: the finish itself */
    const int64_t slots[6] = {0, 0, 0, 0, 0, -7};
    const struct kv_block_copy pairs[3] = {{1, 2, 4}, {3, 4, 4}, {5, 999, 4}};
    struct kv__dev_arrays a;
    memset(&a, 0, sizeof(a));
    memset(&in, 0, sizeof(in));
    kv__dev_error(&in, KV_ATTN_DEV_SLOTS, 5);
    a.slots = slots, a.n_slots = 3;
    kv__dev_error_finish_in(&in, &a);
    check_record(&in, 1, KV_ATTN_DEV_SLOTS, 5, 0);
    a.n_slots = 6;
    kv__dev_error_finish_in(&in, &a);
    check_record(&in, 1, KV_ATTN_DEV_SLOTS, 5, -7);
    memset(&a, 0, sizeof(a));
    memset(&in, 0, sizeof(in));
    kv__dev_error(&in, KV_ATTN_DEV_COPIES, 5); /* pair 2's dst */
    a.pairs = pairs, a.n_pairs = 2;
    kv__dev_error_finish_in(&in, &a);
    check_record(&in, 1, KV_ATTN_DEV_COPIES, 5, 0);
    a.n_pairs = 3;
    kv__dev_error_finish_in(&in, &a);
    check_record(&in, 1, KV_ATTN_DEV_COPIES, 5, 999);
}

/* A window starting mid-page on a bad page id: the page's tokens the
 * window sees are left out and the page recorded once, at the window's
 * first token (its first token is before the window), on every body. s0:
 * 16 tokens, page 1 (-3) bad; s1: 11 tokens, page 0 (B) bad. window_left
 * 9: s0 sees 6..15 (page 1 from its third token), s1 1..10 (page 0 from
 * its second); 10: s0 from 5, s1 from 0 (a page's first token); 11: s0
 * from 4; 13: s0 from 2 (page 0 mid-page, valid), s1 whole. As CSR (s1's
 * page 0 at index 4) and as a block table of 4 columns (index 1 x 4 + 0). */
static void decode_window_bad_page(void)
{
    const int32_t indptr[3] = {0, 4, 7}, last[2] = {4, 3};
    const int32_t indices[7] = {150, -3, 120, 101, DEC_B, 140, 131};
    const int32_t tb[2 * 4] = {150, -3, 120, 101, DEC_B, 140, 131, -1}, lens[2] = {16, 11};
    const struct kv_attn_dev_pages c = csr(2, indptr, indices, 7, last), t = btab(2, tb, 4, lens);
    const int32_t windows[4] = {9, 10, 11, 13};
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    dec_opts = &o;
    for (int w = 0; w < 4; w++) {
        o.window_left = windows[w];
        run_dec(&c, w % 3, 2, KV_ATTN_DEV_PAGES, 1, -3, false);
        run_dec(&t, (w + 1) % 3, 2, KV_ATTN_DEV_PAGES, 1, -3, false);
    }
    /* s0's bad page before the window (s0 from 8): s1's alone, mid-page */
    o.window_left = 7;
    const int32_t lens2[2] = {16, 9}, last2[2] = {4, 1};
    const struct kv_attn_dev_pages c2 = csr(2, indptr, indices, 7, last2),
                                   t2 = btab(2, tb, 4, lens2);
    run_dec(&c2, 0, 1, KV_ATTN_DEV_PAGES, 4, DEC_B, false);
    run_dec(&t2, 1, 1, KV_ATTN_DEV_PAGES, 4, DEC_B, false);
    dec_opts = NULL;
}

static void test_devidx_decode_window_bad_page(void **state)
{
    (void)state;
    for (size_t b = 0; b < N_DEC_BODIES; b++) {
        dec_body(b);
        decode_window_bad_page();
    }
    dec_body(N_DEC_BODIES);
}

static void test_devidx_decode_refusals(void **state)
{
    (void)state;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2, cfg.num_blocks = DEC_B, cfg.block_tokens = DEC_N, cfg.num_heads = DEC_H;
    cfg.head_dim = DEC_D, cfg.dtype = KV_F32;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 3);
    const int64_t n = 2 * DEC_H * DEC_G * DEC_D;
    float *qb = calloc((size_t)n, 4), *ob = calloc((size_t)n, 4);
    assert_true(qb && ob);
    struct kv_view q, out;
    int64_t sh[3] = {2, DEC_H * DEC_G, DEC_D};
    assert_int_equal(kv_view_init(qb, (size_t)n * 4, KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)n * 4, KV_F32, 3, sh, &out), KV_OK);
    const int32_t tb[2] = {1, 2}, lens[2] = {1, 1};
    struct kv_attn_dev_pages t = btab(2, tb, 1, lens);
    struct kv__attn_job j;
    t.seq_lens = NULL;
    assert_int_equal(kv__attn_decode_dev_check("kv_attn_decode_cuda_dev", &f.c, 1, &q, &t, 1.0f,
                                               NULL, &out, NULL, &j),
                     KV_ERR_NULL);
    kvt_assert_msg_has("block_table=");
    t.seq_lens = lens, t.block_table_cols = 0;
    assert_int_equal(kv__attn_decode_dev_check("kv_attn_decode_cuda_dev", &f.c, 1, &q, &t, 1.0f,
                                               NULL, &out, NULL, &j),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("block_table_cols 0 with n_seqs 2");
    t.block_table_cols = 1, t.format = (enum kv_pages_format)7;
    assert_int_equal(kv__attn_decode_dev_check("kv_attn_decode_cuda_dev", &f.c, 1, &q, &t, 1.0f,
                                               NULL, &out, NULL, &j),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("pages format 7");
    t.format = KV_PAGES_BLOCK_TABLE;
    const float one[2] = {1.0f, 1.0f};
    const struct kv_attn_dev_scales d3 = {one, one, 3, 0, 1};
    assert_int_equal(kv__attn_decode_dev_check("kv_attn_decode_cuda_dev", &f.c, 1, &q, &t, 1.0f,
                                               &d3, &out, NULL, &j),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("3 scales: expected 1 (per tensor) or 2 (per KV head)");
    const struct kv_attn_dev_scales ok = {one, one, 1, 0, 1};
    assert_int_equal(kv__attn_decode_dev_check("kv_attn_decode_cuda_dev", &f.c, 1, &q, &t, 1.0f,
                                               &ok, &out, NULL, &j),
                     KV_OK);
    kv__attn_job_free(&j);
    kvt_gfix_check(&f, "pool after the checks");
    free(qb), free(ob);
    kvt_gfix_free(&f);
}

/* ---- misaligned device pointers ----------------------------------------------------- */

/* A device pointer misaligned for its element (a GPU load through it faults
 * with cudaErrorMisalignedAddress, sticky): every device-index entry's
 * check refuses it before any launch, naming the pointer and its
 * alignment; the same call with the pointer aligned passes. buf: 64-byte
 * aligned, a copy of the array at buf + off. */
static const void *at_off(unsigned char *buf, const void *src, size_t bytes, size_t off)
{
    assert_true(off + bytes <= 256);
    memcpy(buf + off, src, bytes);
    return buf + off;
}

#define DEV_REFUSED(call, needle)                                                                  \
    do {                                                                                           \
        assert_int_equal((call), KV_ERR_INVALID_ARG);                                              \
        kvt_assert_msg_has(needle);                                                                \
    } while (0)

static void test_devidx_misaligned(void **state)
{
    (void)state;
    unsigned char *buf = kv__mem_alloc_aligned(64, 256);
    assert_non_null(buf);
    struct kv__attn_job j;
    kv_status st;
    /* write: slots (int64) and device scales (float) */
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2, cfg.num_blocks = DEC_B, cfg.block_tokens = DEC_N, cfg.num_heads = DEC_H;
    cfg.head_dim = DEC_D, cfg.dtype = KV_F32, cfg.block_pad_elems = 3;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 12);
    struct kvt_tens k, v;
    kvt_tens_make(&k, KV_F32, 0, 3, DEC_H, DEC_D, false, 0, 1);
    kvt_tens_make(&v, KV_F32, 0, 3, DEC_H, DEC_D, false, 0, 2);
    static const char wfn[] = "kv_attn_write_cuda_dev";
    const int64_t slots[3] = {40, 41, 42};
    const float one[2] = {1.0f, 1.0f};
    for (size_t off = 0; off < 8; off += 4) {
        const int64_t *sl = at_off(buf, slots, sizeof(slots), off);
        st = kv__attn_write_dev_check(wfn, &f.c, 1, &k.v, &v.v, sl, 3, NULL, &j);
        if (off == 0) {
            assert_int_equal(st, KV_OK);
            kv__attn_job_free(&j);
            continue;
        }
        assert_int_equal(st, KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("slots_dev=");
        kvt_assert_msg_has("is not 8-byte aligned");
    }
    for (size_t off = 0; off < 4; off++) {
        const float *ks = at_off(buf, one, 8, 64 + off), *vs = at_off(buf, one, 8, 128 + off);
        const struct kv_attn_dev_scales bad_k = {ks, one, 2, 0, 1}, bad_v = {one, vs, 2, 0, 1};
        st = kv__attn_write_dev_check(wfn, &f.c, 1, &k.v, &v.v, slots, 3, &bad_k, &j);
        if (off == 0) {
            assert_int_equal(st, KV_OK);
            kv__attn_job_free(&j);
            assert_int_equal(
                kv__attn_write_dev_check(wfn, &f.c, 1, &k.v, &v.v, slots, 3, &bad_v, &j), KV_OK);
            kv__attn_job_free(&j);
            continue;
        }
        DEV_REFUSED(kv__attn_write_dev_check(wfn, &f.c, 1, &k.v, &v.v, slots, 3, &bad_k, &j),
                    "device scales k=");
        kvt_assert_msg_has("is not 4-byte aligned");
        DEV_REFUSED(kv__attn_write_dev_check(wfn, &f.c, 1, &k.v, &v.v, slots, 3, &bad_v, &j),
                    "device scales v=");
    }
    /* decode and read: each int32 page array of CSR and of a block table,
     * out_indptr, device scales */
    const int64_t Hq = DEC_H * DEC_G, nq = 2 * Hq * DEC_D;
    float *qb = kv__mem_alloc_aligned(64, (size_t)nq * 4),
          *ob = kv__mem_alloc_aligned(64, (size_t)nq * 4);
    assert_true(qb && ob);
    memset(qb, 0, (size_t)nq * 4);
    struct kv_view q, out;
    int64_t shq[3] = {2, Hq, DEC_D};
    assert_int_equal(kv_view_init(qb, (size_t)nq * 4, KV_F32, 3, shq, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)nq * 4, KV_F32, 3, shq, &out), KV_OK);
    struct kvt_tens ro;
    kvt_tens_make(&ro, KV_F32, 0, 8, DEC_H, DEC_D, false, 0, 3);
    static const char dfn[] = "kv_attn_decode_cuda_dev", rfn[] = "kv_attn_read_cuda_dev";
    const int32_t indptr[3] = {0, 1, 2}, indices[2] = {5, 6}, last[2] = {4, 4};
    const int32_t table[2] = {5, 6}, lens[2] = {4, 4}, oip[3] = {0, 4, 8};
    const char *names[5] = {"indptr=", "indices=", "last_page_len=", "block_table=", "seq_lens="};
    for (int a = 0; a < 6; a++) {
        for (size_t off = 0; off < 4; off++) {
            struct kv_attn_dev_pages c = csr(2, indptr, indices, 2, last),
                                     t = btab(2, table, 1, lens);
            const int32_t *oi = oip;
            const void *src = a == 0   ? (const void *)indptr
                              : a == 1 ? (const void *)indices
                              : a == 2 ? (const void *)last
                              : a == 3 ? (const void *)table
                              : a == 4 ? (const void *)lens
                                       : (const void *)oip;
            const void *mis = at_off(buf, src, a == 0 || a == 5 ? 12 : 8, 64 + off);
            if (a == 0)
                c.indptr = mis;
            else if (a == 1)
                c.indices = mis;
            else if (a == 2)
                c.last_page_len = mis;
            else if (a == 3)
                t.block_table = mis;
            else if (a == 4)
                t.seq_lens = mis;
            else
                oi = mis;
            const struct kv_attn_dev_pages *dp = a >= 3 && a < 5 ? &t : &c;
            const kv_status sd =
                kv__attn_decode_dev_check(dfn, &f.c, 1, &q, dp, 1.0f, NULL, &out, NULL, &j);
            if (sd == KV_OK)
                kv__attn_job_free(&j);
            const kv_status sr =
                kv__attn_read_dev_check(rfn, &f.c, 1, dp, oi, &ro.v, NULL, NULL, &j);
            if (sr == KV_OK)
                kv__attn_job_free(&j);
            if (off == 0) {
                assert_int_equal(sd, KV_OK);
                assert_int_equal(sr, KV_OK);
                continue;
            }
            assert_int_equal(sr, KV_ERR_INVALID_ARG);
            kvt_assert_msg_has(a == 5 ? "out_indptr_dev=" : names[a]);
            kvt_assert_msg_has("is not 4-byte aligned");
            if (a < 5) {
                DEV_REFUSED(
                    kv__attn_decode_dev_check(dfn, &f.c, 1, &q, dp, 1.0f, NULL, &out, NULL, &j),
                    names[a]);
            } else {
                assert_int_equal(sd, KV_OK); /* the decode has no out_indptr */
            }
        }
    }
    {
        const struct kv_attn_dev_pages c = csr(2, indptr, indices, 2, last);
        const float *ks = at_off(buf, one, 8, 130);
        const struct kv_attn_dev_scales dk = {ks, one, 2, 0, 1}, dv = {one, ks, 2, 0, 1};
        DEV_REFUSED(kv__attn_decode_dev_check(dfn, &f.c, 1, &q, &c, 1.0f, &dk, &out, NULL, &j),
                    "device scales k=");
        DEV_REFUSED(kv__attn_decode_dev_check(dfn, &f.c, 1, &q, &c, 1.0f, &dv, &out, NULL, &j),
                    "device scales v=");
        DEV_REFUSED(kv__attn_read_dev_check(rfn, &f.c, 1, &c, oip, &ro.v, NULL, &dk, &j),
                    "device scales k=");
    }
    /* MLA: its K scale and its pages (the same checks) */
    {
        struct kv_layout_config mc = KV_LAYOUT_CONFIG_INIT;
        mc.num_layers = 2, mc.num_blocks = DEC_B, mc.block_tokens = DEC_N, mc.num_heads = 1;
        mc.head_dim = 64, mc.dtype = KV_BF16, mc.k_only = true;
        struct kvt_gfix m;
        kvt_gfix_init(&m, &mc, 13);
        float *mq = kv__mem_alloc_aligned(64, 2 * 5 * 64 * 4),
              *mo = kv__mem_alloc_aligned(64, 2 * 5 * 48 * 4);
        assert_true(mq && mo);
        memset(mq, 0, 2 * 5 * 64 * 4);
        struct kv_view vq, vo;
        int64_t sq[3] = {2, 5, 64}, so[3] = {2, 5, 48};
        assert_int_equal(kv_view_init(mq, 2 * 5 * 64 * 4, KV_F32, 3, sq, &vq), KV_OK);
        assert_int_equal(kv_view_init(mo, 2 * 5 * 48 * 4, KV_F32, 3, so, &vo), KV_OK);
        static const char mfn[] = "kv_attn_decode_mla_cuda_dev";
        const float *ksc;
        struct kv_attn_dev_pages c = csr(2, indptr, indices, 2, last);
        const struct kv_attn_dev_scales ok = {one, NULL, 1, 0, 1},
                                        bad = {at_off(buf, one, 4, 66), NULL, 1, 0, 1};
        assert_int_equal(
            kv__attn_decode_mla_dev_check(mfn, &m.c, 1, &vq, &c, 48, 1.0f, &ok, &vo, &j, &ksc),
            KV_OK);
        kv__attn_job_free(&j);
        DEV_REFUSED(
            kv__attn_decode_mla_dev_check(mfn, &m.c, 1, &vq, &c, 48, 1.0f, &bad, &vo, &j, &ksc),
            "device scales k=");
        c.indices = at_off(buf, indices, 8, 130);
        DEV_REFUSED(
            kv__attn_decode_mla_dev_check(mfn, &m.c, 1, &vq, &c, 48, 1.0f, NULL, &vo, &j, &ksc),
            "indices=");
        kvt_gfix_check(&m, "MLA pool after the refusals");
        kv__mem_free(mq), kv__mem_free(mo);
        kvt_gfix_free(&m);
    }
    /* copy and copy_ex: the pairs (uint32 fields) */
    const struct kv_block_copy pairs[2] = {{5, 6, 4}, {7, 8, 4}};
    for (size_t off = 0; off < 4; off++) {
        const struct kv_block_copy *pp = at_off(buf, pairs, sizeof(pairs), 64 + off);
        const kv_status s1 =
            kv__attn_copy_dev_check("kv_attn_copy_blocks_cuda_dev", &f.c, pp, 2, &j);
        if (s1 == KV_OK)
            kv__attn_job_free(&j);
        const kv_status s2 = kv__attn_copy_ex_dev_check("kv_attn_copy_blocks_ex_cuda_dev", &f.c,
                                                        &f.c, pp, 2, NULL, &j);
        if (s2 == KV_OK)
            kv__attn_job_free(&j);
        if (off == 0) {
            assert_int_equal(s1, KV_OK);
            assert_int_equal(s2, KV_OK);
            continue;
        }
        assert_int_equal(s1, KV_ERR_INVALID_ARG);
        assert_int_equal(s2, KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("copies_dev=");
        kvt_assert_msg_has("is not 4-byte aligned");
    }
    /* the public entries refuse the same, nothing launched */
    DEV_REFUSED(kv_attn_write_cuda_dev(f.c, 1, &k.v, &v.v, at_off(buf, slots, sizeof(slots), 4), 3,
                                       NULL, NULL, NULL),
                "slots_dev=");
    DEV_REFUSED(
        kv_attn_copy_blocks_cuda_dev(f.c, at_off(buf, pairs, sizeof(pairs), 2), 2, NULL, NULL),
        "copies_dev=");
    /* the entries' error record, misaligned for its 64-bit atomics (was
     * launched with it); the record is not written */
    unsigned char *rec = buf + 160;
    memset(rec, 0, 64);
    const int64_t *sl0 = at_off(buf, slots, sizeof(slots), 0);
    const struct kv_block_copy *pp0 = at_off(buf, pairs, sizeof(pairs), 64);
    for (size_t off = 1; off < 8; off++) {
        struct kv_attn_cuda_errors *e = (struct kv_attn_cuda_errors *)(void *)(rec + off);
        DEV_REFUSED(kv_attn_write_cuda_dev(f.c, 1, &k.v, &v.v, sl0, 3, NULL, e, NULL),
                    "kv_attn_write_cuda_dev: errors=");
        kvt_assert_msg_has("is not 8-byte aligned");
        DEV_REFUSED(kv_attn_copy_blocks_cuda_dev(f.c, pp0, 2, e, NULL),
                    "kv_attn_copy_blocks_cuda_dev: errors=");
        DEV_REFUSED(kv_attn_copy_blocks_ex_cuda_dev(f.c, f.c, pp0, 2, NULL, e, NULL),
                    "kv_attn_copy_blocks_ex_cuda_dev: errors=");
    }
    for (size_t i = 0; i < 64; i++)
        assert_int_equal(rec[i], 0);
    kvt_gfix_check(&f, "pool after the refusals");
    kv__mem_free(k.mem), kv__mem_free(v.mem), kv__mem_free(ro.mem);
    kv__mem_free(qb), kv__mem_free(ob);
    kvt_gfix_free(&f);
    kv__mem_free(buf);
}

/* ---- read with device pages ----------------------------------------------------- */

/* Read dp's sequences (out_indptr out [S + 1], T rows) from layer 1 (or
 * every layer) of a padded HND f16 cache into garbage-filled padded f16 /
 * f32 outputs on the emulator in the device mode. sc as in run_dec (x =
 * stored x scale). The whole output buffers against a reference from the
 * documented rules (rows of skipped sequences and pages untouched); with
 * host_too the host-index read's outputs (sequences in order) too. */
static void run_read(const struct kv_attn_dev_pages *dp, const int32_t *out, int64_t T, int sc,
                     bool all_layers, kv_dtype out_dt, uint64_t want_count, int want_array,
                     int64_t want_index, int64_t want_value, bool host_too)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    const int64_t L = 2, N = DEC_N, H = DEC_H, D = 8, pt = N;
    cfg.num_layers = L, cfg.num_blocks = DEC_B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = KV_F16, cfg.order = KV_ORDER_HND, cfg.block_pad_elems = 5;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 88);
    uint64_t rng = 17;
    for (int64_t l = 0; l < L; l++)
        for (int64_t slot = 0; slot < DEC_B * N; slot++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++)
                        kv_from_f32(KV_F16, (float)kvt_range(&rng, -4000, 4000) / 1000.0f,
                                    kvt_gat(&f, f.pool, l, kv, slot, h, d));
    memcpy(f.refmem, f.mem, f.bytes + 2 * KVT_GUARD);
    const int32_t layer = all_layers ? KV_ATTN_ALL_LAYERS : 1;
    const int64_t nl = all_layers ? L : 1;
    struct kvt_tens ko, vo;
    kvt_tens_make(&ko, out_dt, all_layers ? L : 0, T, H, D, false, 0, 41);
    kvt_tens_make(&vo, out_dt, all_layers ? L : 0, T, H, D, false, 0, 42);
    unsigned char *want[2], *host[2];
    for (int kv = 0; kv < 2; kv++) {
        const struct kvt_tens *o = kv ? &vo : &ko;
        want[kv] = malloc(o->bytes + 64);
        host[kv] = malloc(o->bytes + 64);
        assert_true(want[kv] && host[kv]);
        memcpy(want[kv], o->mem, o->bytes + 64);
        memcpy(host[kv], o->mem, o->bytes + 64);
    }
    const struct kv_attn_dev_scales dsc = {wks, wvs, (uint32_t)H, sc == 2 ? 2u : 0u, sc == 2};
    const struct kv_scales hsc = {wks, wvs, (uint32_t)H, sc == 2 ? 2u : 0u};
    for (uint32_t s = 0; s < dp->n_seqs; s++) {
        const int32_t *pages;
        const int64_t n_tok = ref_seq(dp, s, pt, &pages);
        const bool seq_ok =
            (dp->format == KV_PAGES_BLOCK_TABLE
                 ? dp->seq_lens[s] >= 0 && dp->seq_lens[s] <= dp->block_table_cols * pt
                 : n_tok > 0 || dp->indptr[s] == dp->indptr[s + 1]) &&
            out[s] >= 0 && out[s] <= T && out[s + 1] >= out[s] && out[s + 1] <= T &&
            out[s + 1] - out[s] == n_tok;
        if (!seq_ok)
            continue;
        for (int64_t t = 0; t < n_tok; t++) {
            const int64_t pg = pages[t / pt];
            if (pg < 0 || pg >= DEC_B)
                continue;
            for (int64_t lr = 0; lr < nl; lr++)
                for (int kv = 0; kv < 2; kv++)
                    for (int64_t h = 0; h < H; h++)
                        for (int64_t d = 0; d < D; d++) {
                            const struct kvt_tens *o = kv ? &vo : &ko;
                            const int64_t l = all_layers ? lr : layer;
                            const float x = kv_to_f32(
                                KV_F16, kvt_gat(&f, f.ref, l, kv, pg * pt + t % pt, h, d));
                            const float m = (kv ? wvs : wks)[(sc == 2 ? l * H : 0) + h];
                            unsigned char *dst =
                                want[kv] + (kvt_tens_at(o, lr, out[s] + t, h, d) - o->mem);
                            kv_from_f32(out_dt, sc ? x * m : x, dst);
                        }
        }
    }
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    const uint64_t a0 = kv__mem_allocs();
    kv_status st = kv__attn_read_dev_check("kv_attn_read_cuda_dev", &f.c, layer, dp, out, &ko.v,
                                           &vo.v, sc ? &dsc : NULL, &j);
    assert_int_equal(kv__mem_allocs(), a0);
    if (st != KV_OK)
        fail_msg("dev read check: %s: %s", kv_status_name(st), kv_last_error());
    assert_null(j.runs);
    st = kv__grid_attn_read_dev(&j, dp, out, sc == 1, &rec);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated dev read: %s: %s", kv_status_name(st), kv_last_error());
    kvt_gfix_check(&f, "guards + pool after the device-index read");
    kvt_check_bytes(ko.mem, want[0], ko.bytes + 64, "k_out after the device-index read");
    kvt_check_bytes(vo.mem, want[1], vo.bytes + 64, "v_out after the device-index read");
    check_record(&rec, want_count, want_array, want_index, want_value);
    if (host_too) {
        memcpy(ko.mem, host[0], ko.bytes + 64);
        memcpy(vo.mem, host[1], vo.bytes + 64);
        struct kv_pages hp;
        memset(&hp, 0, sizeof(hp));
        hp.n_seqs = dp->n_seqs, hp.page_ratio = 1;
        int64_t lens[16];
        if (dp->format == KV_PAGES_BLOCK_TABLE) {
            for (uint32_t i = 0; i < dp->n_seqs; i++)
                lens[i] = dp->seq_lens[i];
            hp.format = KV_PAGES_BLOCK_TABLE, hp.block_table = dp->block_table;
            hp.block_table_cols = dp->block_table_cols, hp.seq_lens = lens;
        } else {
            hp.format = KV_PAGES_CSR, hp.indptr = dp->indptr, hp.indices = dp->indices;
            hp.last_page_len = dp->last_page_len;
        }
        st = kv__attn_read_check("kv_attn_read_cuda", &f.c, layer, &hp, &ko.v, &vo.v,
                                 sc ? &hsc : NULL, &j);
        if (st != KV_OK)
            fail_msg("host read check: %s: %s", kv_status_name(st), kv_last_error());
        assert_int_equal(kv__grid_attn_move(&j, false), KV_OK);
        kv__attn_job_free(&j);
        kvt_check_bytes(ko.mem, want[0], ko.bytes + 64, "k_out of the host-index read");
        kvt_check_bytes(vo.mem, want[1], vo.bytes + 64, "v_out of the host-index read");
    }
    for (int kv = 0; kv < 2; kv++)
        free(want[kv]), free(host[kv]);
    kv__mem_free(ko.mem), kv__mem_free(vo.mem);
    kvt_gfix_free(&f);
}

static void test_devidx_read(void **state)
{
    (void)state;
    /* the vs_ sequences (as the decode): CSR and the block table */
    const int32_t out[5] = {0, 7, 7, 8, 24};
    const struct kv_attn_dev_pages c = vs_csr(), t = vs_btab();
    for (int sc = 0; sc < 3; sc++) {
        run_read(&c, out, 24, sc, sc == 1, sc ? KV_F32 : KV_F16, 0, KV_ATTN_DEV_NONE, 0, 0, true);
        run_read(&t, out, 24, sc, sc != 1, sc == 2 ? KV_F32 : KV_F16, 0, KV_ATTN_DEV_NONE, 0, 0,
                 true);
    }
    /* CSR: entry 4 is B (s3's 2nd page: its tokens 4..7 skipped); s1 (0
     * tokens) given rows 7..8 and s2 (1 token) rows 8..8: both skipped; the
     * page is the first (the lowest array) */
    const int32_t ix2[7] = {150, 199, 120, 101, DEC_B, 170, 131};
    const int32_t out2[5] = {0, 7, 8, 8, 24};
    const struct kv_attn_dev_pages c2 = csr(4, vs_indptr, ix2, 7, vs_last);
    run_read(&c2, out2, 24, 1, false, KV_F32, 3, KV_ATTN_DEV_PAGES, 4, DEC_B, false);
    /* rows past T: s2's end and s3's start (30 > 24), both index 3 */
    const int32_t out5[5] = {0, 7, 7, 30, 24};
    run_read(&c, out5, 24, 0, false, KV_F16, 2, KV_ATTN_DEV_OUT_INDPTR, 3, 30, false);
    /* rows errors only: s1 has 0 tokens but out 7 -> 9; s3 fine */
    const int32_t out3[5] = {0, 7, 9, 10, 26};
    run_read(&c, out3, 26, 0, true, KV_F16, 1, KV_ATTN_DEV_OUT_INDPTR, 2, 9, false);
    /* block table: s0 seq_lens 21 > 5 x N; s3 page -1 at column 1 (index 16) */
    const int32_t lens4[4] = {21, 0, 1, 16};
    const int32_t tb4[4 * 5] = {150, 199, -1, DEC_B, -1, 77,  -1, -1,  -1,  -1,
                                120, -1,  -1, -1,    -1, 101, -1, 170, 131, 9999};
    const struct kv_attn_dev_pages t4 = btab(4, tb4, 5, lens4);
    run_read(&t4, out, 24, 2, false, KV_F16, 2, KV_ATTN_DEV_PAGES, 16, -1, false);
    /* the host side: out_indptr NULL, k_out / v_out of different T */
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2, cfg.num_blocks = DEC_B, cfg.block_tokens = DEC_N, cfg.num_heads = DEC_H;
    cfg.head_dim = 8, cfg.dtype = KV_F16;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 4);
    struct kvt_tens a, b;
    kvt_tens_make(&a, KV_F16, 0, 24, DEC_H, 8, false, 0, 1);
    kvt_tens_make(&b, KV_F16, 0, 23, DEC_H, 8, false, 0, 2);
    struct kv__attn_job j;
    assert_int_equal(
        kv__attn_read_dev_check("kv_attn_read_cuda_dev", &f.c, 1, &c, NULL, &a.v, &a.v, NULL, &j),
        KV_ERR_NULL);
    kvt_assert_msg_has("out_indptr_dev is NULL with n_seqs 4");
    assert_int_equal(
        kv__attn_read_dev_check("kv_attn_read_cuda_dev", &f.c, 1, &c, out, &a.v, &b.v, NULL, &j),
        KV_ERR_BAD_SHAPE);
    kvt_assert_msg_has("k_out has 24 tokens, v_out 23");
    kvt_gfix_check(&f, "pool after the refusals");
    kv__mem_free(a.mem), kv__mem_free(b.mem);
    kvt_gfix_free(&f);
}

/* ---- copy blocks with device pairs ------------------------------------------------- */

/* The record of a copy of pairs: want_count pairs skipped, the first at
 * want_index (2 x pair + 0 src, 1 dst) with that id. */
static void check_copy_record(const struct kv_attn_cuda_errors *rec,
                              const struct kv_block_copy *pairs, uint64_t want_count,
                              int64_t want_index)
{
    check_record(
        rec, want_count, want_count ? KV_ATTN_DEV_COPIES : KV_ATTN_DEV_NONE, want_index,
        want_count ? (want_index % 2 ? pairs[want_index / 2].dst : pairs[want_index / 2].src) : 0);
}

/* The reference of a copy of pairs[n] from s's pool into d's reference:
 * every pair with src < s_blocks and dst < d_blocks, layers l0 .. L - 1,
 * the planes in planes (bit 0 K, bit 1 V); N tokens a block, H heads, D
 * dims. */
static void ref_copy_pairs(const struct kvt_gfix *d, const struct kvt_gfix *s,
                           const struct kv_block_copy *pairs, uint32_t n, uint32_t d_blocks,
                           uint32_t s_blocks, int64_t l0, int64_t L, uint32_t planes, int64_t N,
                           int64_t H, int64_t D)
{
    for (uint32_t i = 0; i < n; i++) {
        if (pairs[i].src >= s_blocks || pairs[i].dst >= d_blocks)
            continue;
        for (int64_t l = l0; l < L; l++)
            for (int kv = 0; kv < 2; kv++) {
                if (!(planes & (1u << kv)))
                    continue;
                for (int64_t t = 0; t < N; t++)
                    for (int64_t h = 0; h < H; h++)
                        for (int64_t e = 0; e < D; e++)
                            memcpy(kvt_gat(d, d->ref, l, kv, (int64_t)pairs[i].dst * N + t, h, e),
                                   kvt_gat(s, s->pool, l, kv, (int64_t)pairs[i].src * N + t, h, e),
                                   (size_t)d->es);
            }
    }
}

/* Copy pairs[n] in a padded cache (layer- or block-major) on the emulator in
 * the device mode; reference: each valid pair's elements, every layer and
 * plane, by kvt_ref_offset_elems; with host_too the host mode's pool too. */
static void run_copy(kv_arrange arrange, const struct kv_block_copy *pairs, uint32_t n,
                     uint64_t want_count, int64_t want_index, bool host_too)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 3, cfg.num_blocks = 300, cfg.block_tokens = 4, cfg.num_heads = 2;
    cfg.head_dim = 8, cfg.dtype = KV_F16, cfg.arrange = arrange, cfg.block_pad_elems = 5;
    struct kvt_gfix f;
    kvt_gfix_init(&f, &cfg, 31);
    ref_copy_pairs(&f, &f, pairs, n, 300, 300, 0, 3, 3, 4, 2, 8);
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    const uint64_t a0 = kv__mem_allocs();
    kv_status st = kv__attn_copy_dev_check("kv_attn_copy_blocks_cuda_dev", &f.c, pairs, n, &j);
    assert_int_equal(kv__mem_allocs(), a0);
    if (st != KV_OK)
        fail_msg("dev copy check: %s: %s", kv_status_name(st), kv_last_error());
    st = kv__grid_attn_copy_dev(&j, pairs, n, &rec);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated dev copy: %s: %s", kv_status_name(st), kv_last_error());
    kvt_gfix_check(&f, "guards + pool after the device-index copy");
    check_copy_record(&rec, pairs, want_count, want_index);
    if (host_too) {
        struct kvt_gfix g;
        kvt_gfix_init(&g, &cfg, 31);
        st = kv__attn_copy_check("kv_attn_copy_blocks_cuda", &g.c, NULL, pairs, n, NULL, &j);
        assert_int_equal(st, KV_OK);
        assert_int_equal(kv__grid_attn_copy(&j), KV_OK);
        kv__attn_job_free(&j);
        kvt_check_bytes(g.mem, f.mem, f.bytes + 2 * KVT_GUARD,
                        "host-index pool vs device-index pool");
        kvt_gfix_free(&g);
    }
    kvt_gfix_free(&f);
}

static void test_devidx_copy_blocks(void **state)
{
    (void)state;
    const struct kv_block_copy ok[3] = {{250, 260, 4}, {270, 201, 4}, {299, 150, 4}};
    run_copy(KV_ARRANGE_LAYER_MAJOR, ok, 3, 0, 0, true);
    run_copy(KV_ARRANGE_BLOCK_MAJOR, ok, 3, 0, 0, true);
    /* pair 1: src = B; pair 3: dst = B */
    const struct kv_block_copy bad[4] = {
        {250, 260, 4}, {300, 210, 4}, {270, 201, 4}, {205, 300, 4}};
    run_copy(KV_ARRANGE_LAYER_MAJOR, bad, 4, 2, 2, false);
    run_copy(KV_ARRANGE_BLOCK_MAJOR, bad, 4, 2, 2, false);
}

/* ---- copy_ex with device pairs ---------------------------------------------------- */

/* copy_ex of pairs[n] from a source cache of 300 blocks (block-major,
 * padded) into a destination of 260 (layer-major, another padding), layers
 * 1..2 of 3, planes (1 K, 2 V, 3 both), K|V packed or not, on the emulator
 * in the device mode. Reference: each valid pair's selected elements by
 * kvt_ref_offset_elems; with host_too the host mode's destination pool
 * too; the source pool unchanged. */
static void run_copy_ex(bool packed, uint32_t planes, const struct kv_block_copy *pairs, uint32_t n,
                        uint64_t want_count, int64_t want_index, bool host_too)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 3, cfg.block_tokens = 4, cfg.num_heads = 3, cfg.head_dim = 8;
    cfg.dtype = KV_F16, cfg.kv_packed = packed, cfg.order = packed ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.num_blocks = 260, cfg.block_pad_elems = 4;
    struct kvt_gfix d, s;
    kvt_gfix_init(&d, &cfg, 61);
    cfg.num_blocks = 300, cfg.block_pad_elems = 12, cfg.arrange = KV_ARRANGE_BLOCK_MAJOR;
    kvt_gfix_init(&s, &cfg, 62);
    ref_copy_pairs(&d, &s, pairs, n, 260, 300, 1, 3, planes, 4, 3, 8);
    struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
    o.layer0 = 1, o.n_layers = 2, o.planes = planes;
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    const uint64_t a0 = kv__mem_allocs();
    kv_status st =
        kv__attn_copy_ex_dev_check("kv_attn_copy_blocks_ex_cuda_dev", &d.c, &s.c, pairs, n, &o, &j);
    assert_int_equal(kv__mem_allocs(), a0);
    if (st != KV_OK)
        fail_msg("dev copy_ex check: %s: %s", kv_status_name(st), kv_last_error());
    st = kv__grid_attn_copy_ex_dev(&j, pairs, n, &rec);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated dev copy_ex: %s: %s", kv_status_name(st), kv_last_error());
    kvt_gfix_check(&d, "guards + destination pool after the device-index copy_ex");
    kvt_gfix_check(&s, "guards + source pool after the device-index copy_ex");
    check_copy_record(&rec, pairs, want_count, want_index);
    if (host_too) {
        struct kvt_gfix g;
        cfg.num_blocks = 260, cfg.block_pad_elems = 4, cfg.arrange = KV_ARRANGE_LAYER_MAJOR;
        kvt_gfix_init(&g, &cfg, 61);
        st = kv__attn_copy_check("kv_attn_copy_blocks_ex_cuda", &g.c, &s.c, pairs, n, &o, &j);
        assert_int_equal(st, KV_OK);
        assert_int_equal(kv__grid_attn_copy_ex(&j), KV_OK);
        kv__attn_job_free(&j);
        kvt_check_bytes(g.mem, d.mem, d.bytes + 2 * KVT_GUARD,
                        "host-index pool vs device-index pool (copy_ex)");
        kvt_gfix_free(&g);
    }
    kvt_gfix_free(&d);
    kvt_gfix_free(&s);
}

static void test_devidx_copy_blocks_ex(void **state)
{
    (void)state;
    /* ids far from 0; src 299 exists only in the source cache */
    const struct kv_block_copy ok[3] = {{299, 255, 4}, {210, 201, 4}, {201, 150, 4}};
    for (uint32_t planes = 1; planes <= 3; planes++) {
        run_copy_ex(false, planes, ok, 3, 0, 0, true);
        run_copy_ex(true, planes, ok, 3, 0, 0, true);
    }
    /* pair 1: dst 260 (= dst's B; a valid src id); pair 2: src 300 */
    const struct kv_block_copy bad[4] = {
        {299, 255, 4}, {210, 260, 4}, {300, 150, 4}, {201, 240, 4}};
    run_copy_ex(false, 3, bad, 4, 2, 3, false);
    run_copy_ex(true, 2, bad, 4, 2, 3, false);
    /* the host side refuses what it can check without reading a pair */
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 3, cfg.num_blocks = 8, cfg.block_tokens = 4, cfg.num_heads = 3;
    cfg.head_dim = 8, cfg.dtype = KV_F16;
    struct kvt_gfix d, s;
    kvt_gfix_init(&d, &cfg, 1);
    cfg.head_dim = 16;
    kvt_gfix_init(&s, &cfg, 2);
    struct kv__attn_job j;
    assert_int_equal(
        kv__attn_copy_ex_dev_check("kv_attn_copy_blocks_ex_cuda_dev", &d.c, &s.c, ok, 3, NULL, &j),
        KV_ERR_MISMATCH);
    assert_int_equal(kv__attn_copy_ex_dev_check("kv_attn_copy_blocks_ex_cuda_dev", &d.c, &d.c, NULL,
                                                3, NULL, &j),
                     KV_ERR_NULL);
    kvt_assert_msg_has("copies_dev is NULL with n_copies 3");
    kvt_gfix_check(&d, "pool after the refusals");
    kvt_gfix_free(&d);
    kvt_gfix_free(&s);
}

/* ---- the plan copy with device block lists ------------------------------------- */

/* Request ns / nd blocks (sid, did; an id past its pool skips the tokens
 * of that block) through plan (layers 1..2 of s onto 0..1 of d, heads hs0
 * .. + nh onto hd0 ..) on the emulator in the device mode. Reference:
 * config-only, token by token; with host_too the host-index executor's
 * pool (schedule + emulated launch) too. */
static void run_plan_dev(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                         int64_t hs0, int64_t hd0, int64_t nh, kv_dtype dt, const uint32_t *sid,
                         uint32_t ns, const uint32_t *did, uint32_t nd, uint64_t want_count,
                         int64_t want_key, int64_t want_value, bool host_too)
{
    struct kvt_side s, d;
    const int64_t D = 32, B = 60;
    kvt_side_make(&s, 3, B, Ns, Hs, D, dt, sbits, 5);
    kvt_side_make(&d, 3, B, Nd, Hd, D, dt, dbits, 6);
    s.pc.mem = d.pc.mem = KV_MEM_PINNED; /* what the CUDA executors take */
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = hs0, pc.dst_head0 = hd0, pc.n_heads = nh;
    pc.src_layer0 = 1, pc.dst_layer0 = 0, pc.n_layers = 2;
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, &pc, &plan), KV_OK);
    const uint64_t T = (uint64_t)(ns * Ns < nd * Nd ? ns * Ns : nd * Nd);
    const size_t sb = (size_t)s.lo.total_bytes, db = (size_t)d.lo.total_bytes;
    unsigned char *ref = malloc(db), *d0 = malloc(db), *s0 = malloc(sb);
    assert_true(ref && d0 && s0);
    memcpy(ref, d.mem, db), memcpy(d0, d.mem, db), memcpy(s0, s.mem, sb);
    const int64_t es = s.lo.elem_bytes;
    for (uint64_t t = 0; t < T; t++) {
        const uint32_t bs = sid[t / (uint64_t)Ns], bd = did[t / (uint64_t)Nd];
        if (bs >= B || bd >= B)
            continue;
        for (int64_t l = 0; l < 2; l++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < nh; h++) {
                    const int64_t so = kvt_ref_offset_elems(
                        &s.cfg, 1 + l, kv, bs, (int64_t)(t % (uint64_t)Ns), hs0 + h, 0);
                    const int64_t dof = kvt_ref_offset_elems(
                        &d.cfg, l, kv, bd, (int64_t)(t % (uint64_t)Nd), hd0 + h, 0);
                    memcpy(ref + dof * es, s.mem + so * es, (size_t)(D * es));
                }
    }
    struct kv_plan_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    const uint64_t a0 = kv__mem_allocs();
    kv_status st = kv__plan_check_request_dev("kv_plan_copy_cuda_dev", plan, &s.pc, sid, ns, &d.pc,
                                              did, nd, T);
    assert_int_equal(kv__mem_allocs(), a0);
    if (st != KV_OK)
        fail_msg("dev plan check: %s: %s", kv_status_name(st), kv_last_error());
    st = kv__grid_plan_copy_dev(plan, &s.pc, sid, ns, &d.pc, did, nd, T, &rec);
    if (st != KV_OK)
        fail_msg("emulated dev plan copy: %s: %s", kv_status_name(st), kv_last_error());
    kvt_check_bytes(d.mem, ref, db, "destination pool after the device-list plan copy");
    kvt_check_bytes(s.mem, s0, sb, "source pool after the device-list plan copy");
    assert_int_equal(rec.count, want_count);
    if (want_count) {
        assert_int_equal(rec.first_key, ~(uint64_t)want_key);
        assert_int_equal(rec.value_key, rec.first_key);
        assert_int_equal(rec.first_value, want_value);
    } else {
        assert_int_equal(rec.first_key, 0);
    }
    if (host_too) {
        memcpy(d.mem, d0, db);
        struct kv__plan_sched sc;
        assert_int_equal(kv__plan_check_request("kv_plan_copy_cuda", plan, &s.pc, sid, ns, &d.pc,
                                                did, nd, T, true),
                         KV_OK);
        assert_int_equal(
            kv__plan_cuda_schedule("test", plan, &s.pc, sid, ns, &d.pc, did, nd, T, 0, &sc), KV_OK);
        assert_int_equal(kv__grid_plan_copy(&sc), KV_OK);
        kv__plan_sched_free(&sc);
        kvt_check_bytes(d.mem, ref, db, "destination pool of the host-index plan copy");
    }
    kv_plan_destroy(plan);
    free(ref), free(d0), free(s0);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

static void test_devidx_plan_copy(void **state)
{
    (void)state;
    uint64_t rng = 3;
    uint32_t sid[16], did[16];
    kvt_pick_ids(&rng, 60, 16, sid);
    kvt_pick_ids(&rng, 60, 16, did);
    /* NHD -> NHD, block-major both sides: whole-block (wide) copies */
    run_plan_dev(2, 2, 8, 8, 4, 4, 0, 0, 4, KV_F16, sid, 4, did, 4, 0, 0, 0, true);
    /* NHD -> HND f32, block sizes 8 -> 4, heads 1..2 of 4 into 0..1 of 2, padded */
    run_plan_dev(4, 1 | 4, 8, 4, 4, 2, 1, 0, 2, KV_F32, sid, 3, did, 6, 0, 0, 0, true);
    /* HND -> NHD bf16, blocks 4 -> 8, packed K|V on the source */
    run_plan_dev(1 | 8, 0, 4, 8, 2, 2, 0, 0, 2, KV_BF16, sid, 8, did, 4, 0, 0, 0, true);
    /* invalid ids: source entry 1 = B, destination entries 0 and 3 past B */
    uint32_t bs[6], bd[6];
    memcpy(bs, sid, sizeof(bs)), memcpy(bd, did, sizeof(bd));
    bs[1] = 60, bd[0] = 1000, bd[3] = 61;
    run_plan_dev(4, 1 | 4, 8, 4, 4, 2, 1, 0, 2, KV_F32, bs, 3, bd, 6, 3, 1, 60, false);
    /* destination errors only: the first is side 1, entry 0 */
    run_plan_dev(2, 2, 8, 8, 4, 4, 0, 0, 4, KV_F16, sid, 4, bd, 4, 2, (int64_t)1 << 56 | 0, 1000,
                 false);
    /* the host side: NULL lists, lengths, memory kind */
    struct kvt_side s, d;
    kvt_side_make(&s, 3, 60, 8, 4, 32, KV_F16, 0, 1);
    kvt_side_make(&d, 3, 60, 8, 4, 32, KV_F16, 0, 2);
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, NULL, &plan), KV_OK);
    s.pc.mem = d.pc.mem = KV_MEM_PINNED;
    assert_int_equal(kv__plan_check_request_dev("kv_plan_copy_cuda_dev", plan, &s.pc, NULL, 2,
                                                &d.pc, did, 2, 16),
                     KV_ERR_NULL);
    kvt_assert_msg_has("src_blocks_dev is NULL with 2 blocks");
    assert_int_equal(
        kv__plan_check_request_dev("kv_plan_copy_cuda_dev", plan, &s.pc, sid, 3, &d.pc, did, 2, 16),
        KV_ERR_BAD_SHAPE);
    kvt_assert_msg_has("3 src blocks for a request that needs 2");
    /* a list misaligned for its uint32 ids: refused before any launch (pd
     * as kv_plan_dev_create makes it, no table needed to refuse) */
    {
        unsigned char *buf = kv__mem_alloc_aligned(64, 64);
        assert_non_null(buf);
        memcpy(buf + 2, sid, 8), memcpy(buf + 33, did, 8);
        const struct kv_plan_dev pd = {.plan = plan};
        const uint32_t *ms = (const uint32_t *)(buf + 2), *md = (const uint32_t *)(buf + 33);
        assert_int_equal(kv_plan_copy_cuda_dev(&pd, s.pc, ms, 2, d.pc, did, 2, 16, NULL, NULL),
                         KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("src_blocks_dev=");
        kvt_assert_msg_has("is not 4-byte aligned");
        assert_int_equal(kv_plan_copy_cuda_dev(&pd, s.pc, sid, 2, d.pc, md, 2, 16, NULL, NULL),
                         KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("dst_blocks_dev=");
        /* the error record, misaligned for its 64-bit atomics (an audit:
         * the lists were checked, the record was not); not written */
        memset(buf, 0, 64);
        for (size_t off = 1; off < 8; off++) {
            struct kv_plan_cuda_errors *rec = (struct kv_plan_cuda_errors *)(void *)(buf + off);
            assert_int_equal(kv_plan_copy_cuda_dev(&pd, s.pc, sid, 2, d.pc, did, 2, 16, rec, NULL),
                             KV_ERR_INVALID_ARG);
            kvt_assert_msg_has("kv_plan_copy_cuda_dev: errors=");
            kvt_assert_msg_has("is not 8-byte aligned");
        }
        for (size_t i = 0; i < 64; i++)
            assert_int_equal(buf[i], 0);
        kv__mem_free(buf);
    }
    d.pc.mem = KV_MEM_HOST;
    assert_int_not_equal(
        kv__plan_check_request_dev("kv_plan_copy_cuda_dev", plan, &s.pc, sid, 2, &d.pc, did, 2, 16),
        KV_OK);
    kv_plan_destroy(plan);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

/* A K-only (MLA) cache's scales in the device-index entries (found by an
 * audit, 2026-12-05): by value, K alone (the documented form) crashed the
 * launch, which copied V's NULL scales; in device memory, K alone was
 * refused and K with V accepted, the reverse of the header. Now: K alone
 * writes K divided by its scale, and V scales for a K-only layout are
 * refused either way. */
static void test_devidx_k_only_scales(void **state)
{
    (void)state;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 2, cfg.num_blocks = 4, cfg.block_tokens = 4, cfg.num_heads = 1;
    cfg.head_dim = 8, cfg.dtype = KV_F32, cfg.k_only = true;
    struct kv_paged_cache c;
    memset(&c, 0, sizeof(c));
    assert_int_equal(kv_layout_init(&cfg, &c.layout), KV_OK);
    c.storage_bytes = (size_t)c.layout.total_bytes;
    c.base = kv__mem_calloc(1, c.storage_bytes);
    assert_non_null(c.base);
    c.mem = KV_MEM_PINNED;
    float kb[2 * 8];
    for (int i = 0; i < 16; i++)
        kb[i] = (float)(i + 1);
    const int64_t sh[3] = {2, 1, 8};
    struct kv_view k;
    assert_int_equal(kv_view_init(kb, sizeof(kb), KV_F32, 3, sh, &k), KV_OK);
    const float ks = 0.5f, vs = 2.0f;
    const struct kv_attn_dev_scales by_value = {&ks, NULL, 1, 0, 0};
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    const int64_t slots[2] = {9, 14};
    assert_int_equal(kv__attn_write_dev_check("kv_attn_write_cuda_dev", &c, 1, &k, NULL, slots, 2,
                                              &by_value, &j),
                     KV_OK);
    assert_int_equal(kv__grid_attn_write_dev(&j, slots, 2, true, &rec), KV_OK);
    const float *f = c.base;
    for (int t = 0; t < 2; t++)
        for (int d = 0; d < 8; d++) {
            const uint32_t b = (uint32_t)(slots[t] / 4), tt = (uint32_t)(slots[t] % 4);
            assert_true(f[kv_layout_elem_offset(&c.layout, 1, 0, b, tt, 0, (uint32_t)d)] ==
                        kb[t * 8 + d] / ks);
        }
    /* device memory: K alone accepted, V refused */
    const struct kv_attn_dev_scales in_dev = {&ks, NULL, 1, 0, 1};
    assert_int_equal(
        kv__attn_write_dev_check("kv_attn_write_cuda_dev", &c, 1, &k, NULL, slots, 2, &in_dev, &j),
        KV_OK);
    kv__attn_job_free(&j);
    const struct kv_attn_dev_scales dev_v = {&ks, &vs, 1, 0, 1};
    assert_int_equal(
        kv__attn_write_dev_check("kv_attn_write_cuda_dev", &c, 1, &k, NULL, slots, 2, &dev_v, &j),
        KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("V scales given");
    const struct kv_attn_dev_scales val_v = {&ks, &vs, 1, 0, 0};
    assert_int_equal(
        kv__attn_write_dev_check("kv_attn_write_cuda_dev", &c, 1, &k, NULL, slots, 2, &val_v, &j),
        KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("V scales given");
    kv__mem_free(c.base);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_devidx_write_valid),
        cmocka_unit_test(test_devidx_write_invalid),
        cmocka_unit_test(test_devidx_record_across_launches),
        cmocka_unit_test(test_devidx_record_foreign_first),
        cmocka_unit_test(test_devidx_write_refusals),
        cmocka_unit_test(test_devidx_decode_valid),
        cmocka_unit_test(test_devidx_decode_options),
        cmocka_unit_test(test_devidx_decode_mla),
        cmocka_unit_test(test_devidx_decode_invalid),
        cmocka_unit_test(test_devidx_decode_window_bad_page),
        cmocka_unit_test(test_devidx_decode_refusals),
        cmocka_unit_test(test_devidx_misaligned),
        cmocka_unit_test(test_devidx_read),
        cmocka_unit_test(test_devidx_copy_blocks),
        cmocka_unit_test(test_devidx_copy_blocks_ex),
        cmocka_unit_test(test_devidx_plan_copy),
        cmocka_unit_test(test_devidx_k_only_scales),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
