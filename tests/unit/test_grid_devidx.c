/*
 * test_grid_devidx.c - the device-index write (kv_attn_write_cuda_dev) on
 * the CPU grid emulator: the CUDA launcher's job (kv__attn_write_dev_check:
 * scalar checks only), the same launch parameters, and the kernel body
 * reading the slot mapping itself (kv__grid_attn_write_dev), the error
 * record finished as the CUDA launcher finishes it.
 *
 *   - valid slots (blocks far from 0, a -1, one layer and all layers, a
 *     padded NHD layout and a padded HND one, bytes and converting moves):
 *     the WHOLE pool equals an element-by-element reference and the host
 *     index path's pool; the record stays all zero;
 *   - invalid slots (B x N, -5, INT64_MAX) amid valid ones: the invalid
 *     tokens are skipped, the valid ones written as the reference says,
 *     guard bytes around the pool untouched, the record counts each invalid
 *     token once and names the first (index, value); a later launch keeps
 *     an earlier first unless it finds a lower index;
 *   - the host side refuses bad scalars naming the values, pool untouched.
 */
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
#include "kv_mem.h"
#include "kvt_side.h"
#include "kvtest.h"

#define GUARD 256

struct fix {
    struct kv_layout_config cfg;
    struct kv_paged_cache c;
    unsigned char *mem, *pool, *ref;
    size_t bytes;
    int64_t es;
};

static void fill_random(void *p, size_t n, uint64_t seed)
{
    unsigned char *b = p;
    uint64_t r = seed;
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)kvt_rand(&r);
}

/* The pool between two GUARD-byte guards; ref: the expected guards + pool. */
static void fix_init(struct fix *f, const struct kv_layout_config *cfg, uint64_t seed)
{
    memset(f, 0, sizeof(*f));
    f->cfg = *cfg;
    assert_int_equal(kv_layout_init(cfg, &f->c.layout), KV_OK);
    f->bytes = (size_t)f->c.layout.total_bytes;
    f->es = f->c.layout.elem_bytes;
    f->mem = kv__mem_alloc_aligned(64, f->bytes + 2 * GUARD);
    f->ref = kv__mem_alloc_aligned(64, f->bytes + 2 * GUARD);
    assert_true(f->mem && f->ref);
    fill_random(f->mem, f->bytes + 2 * GUARD, seed);
    memcpy(f->ref, f->mem, f->bytes + 2 * GUARD);
    f->pool = f->mem + GUARD;
    f->c.base = f->pool;
    f->c.storage_bytes = f->bytes;
    f->c.mem = KV_MEM_PINNED;
}

static void fix_free(struct fix *f)
{
    kv__mem_free(f->mem);
    kv__mem_free(f->ref);
}

static unsigned char *ref_at(const struct fix *f, int64_t l, int kv, int64_t slot, int64_t h,
                             int64_t d)
{
    const int64_t N = f->cfg.block_tokens;
    return f->ref + GUARD + kvt_ref_offset_elems(&f->cfg, l, kv, slot / N, slot % N, h, d) * f->es;
}

static void check_bytes(const unsigned char *got, const unsigned char *want, size_t n,
                        const char *what)
{
    if (memcmp(got, want, n) == 0)
        return;
    size_t i = 0;
    while (got[i] == want[i])
        i++;
    fail_msg("%s: byte %zu is 0x%02x, expected 0x%02x (%zu bytes in all)", what, i, got[i], want[i],
             n);
}

/* K or V [L?][T][H][D] of dtype dt, rows padded by 8 elements. */
struct tens {
    unsigned char *buf;
    struct kv_view v;
    int64_t row;
};

static void make_tens(struct tens *t, kv_dtype dt, int64_t L, int64_t T, int64_t H, int64_t D,
                      uint64_t seed)
{
    const int64_t es = (int64_t)kv_dtype_size(dt), row = D + 8, lead = L ? L : 1;
    const int64_t elems = lead * T * H * row;
    t->row = row;
    t->buf = kv__mem_alloc_aligned(64, (size_t)(elems * es));
    assert_non_null(t->buf);
    uint64_t r = seed;
    for (int64_t i = 0; i < elems; i++)
        kv_from_f32(dt, (float)kvt_range(&r, -30000, 30000) / 1000.0f, t->buf + i * es);
    int64_t shape[4] = {L, T, H, D}, st[4] = {T * H * row, H * row, row, 1};
    struct kv_view flat;
    int64_t n1 = elems;
    assert_int_equal(kv_view_init(t->buf, (size_t)(elems * es), dt, 1, &n1, &flat), KV_OK);
    assert_int_equal(
        kv_view_as_strided(&flat, L ? 4 : 3, L ? shape : shape + 1, L ? st : st + 1, 0, &t->v),
        KV_OK);
}

static const unsigned char *tens_at(const struct tens *t, int64_t l, int64_t T, int64_t H,
                                    int64_t tk, int64_t h, int64_t d)
{
    const int64_t es = (int64_t)kv_dtype_size(t->v.dtype);
    return t->buf + (((l * T + tk) * H + h) * t->row + d) * es;
}

struct dcase {
    kv_order order;
    int64_t pad;
    kv_dtype cache_dt, src_dt;
    bool all_layers;
};

/* One write of slots[T] through the device-index path into f (and, with
 * host_too, through the host-index path into a copy, compared). want:
 * the expected record. */
static void run_write(const struct dcase *dc, const int64_t *slots, int64_t T, uint64_t seed,
                      bool host_too, uint64_t want_count, int64_t want_index)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    const int64_t L = 2, N = 4, H = 2, D = 8, B = 300;
    cfg.num_layers = L, cfg.num_blocks = B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = dc->cache_dt, cfg.order = dc->order;
    cfg.block_pad_elems = dc->pad;
    struct fix f;
    fix_init(&f, &cfg, seed);
    const int64_t nl = dc->all_layers ? L : 1;
    const int32_t layer = dc->all_layers ? KV_ATTN_ALL_LAYERS : 1;
    struct tens k, v;
    make_tens(&k, dc->src_dt, dc->all_layers ? L : 0, T, H, D, seed + 3);
    make_tens(&v, dc->src_dt, dc->all_layers ? L : 0, T, H, D, seed + 5);
    const bool raw = dc->cache_dt == dc->src_dt;
    const int64_t limit = B * N;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= limit)
            continue;
        for (int64_t lr = 0; lr < nl; lr++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++) {
                        unsigned char *dst = ref_at(&f, dc->all_layers ? lr : layer, kv, slots[t],
                                                    h, d);
                        const unsigned char *src = tens_at(kv ? &v : &k, lr, T, H, t, h, d);
                        if (raw)
                            memcpy(dst, src, (size_t)f.es);
                        else
                            kv_from_f32(dc->cache_dt, kv_to_f32(dc->src_dt, src), dst);
                    }
    }
    struct kv_attn_cuda_errors rec;
    memset(&rec, 0, sizeof(rec));
    struct kv__attn_job j;
    kv_status st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, layer, &k.v, &v.v,
                                            slots, T, NULL, &j);
    if (st != KV_OK)
        fail_msg("dev check: %s: %s", kv_status_name(st), kv_last_error());
    assert_null(j.runs); /* nothing allocated, no slot read on the host */
    assert_int_equal(j.n_runs, 0);
    st = kv__grid_attn_write_dev(&j, slots, T, &rec);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated dev write: %s: %s", kv_status_name(st), kv_last_error());
    check_bytes(f.mem, f.ref, f.bytes + 2 * GUARD, "guards + pool after the device-index write");

    struct kv_attn_cuda_error_info info;
    kv__attn_errors_decode(&rec, &info);
    assert_int_equal(info.count, want_count);
    if (want_count) {
        assert_int_equal(info.array, KV_ATTN_DEV_SLOTS);
        assert_int_equal(info.index, want_index);
        assert_int_equal(info.value, slots[want_index]);
    } else {
        assert_int_equal(rec.first_key, 0);
        assert_int_equal(info.array, KV_ATTN_DEV_NONE);
    }

    if (host_too) {
        /* the host-index path on the same initial pool lands the same bytes */
        struct fix g;
        fix_init(&g, &cfg, seed);
        st = kv__attn_write_check("kv_attn_write_cuda", &g.c, layer, &k.v, &v.v,
                                  (struct kv__attn_slots){slots, false}, T, NULL, &j);
        if (st != KV_OK)
            fail_msg("host check: %s: %s", kv_status_name(st), kv_last_error());
        assert_int_equal(kv__grid_attn_move(&j, true), KV_OK);
        kv__attn_job_free(&j);
        check_bytes(g.mem, f.mem, f.bytes + 2 * GUARD, "host-index pool vs device-index pool");
        fix_free(&g);
    }
    kv__mem_free(k.buf), kv__mem_free(v.buf);
    fix_free(&f);
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
        run_write(&cases[i], slots, 6, 100 + i, true, 0, 0);
}

static void test_devidx_write_invalid(void **state)
{
    (void)state;
    const int64_t B_N = 300 * 4;
    /* index 2: past the pool; 4: negative other than -1; 6: INT64_MAX */
    const int64_t slots[] = {1001, -1, B_N, 4 * 250 + 1, -5, 4 * 299, INT64_MAX, B_N - 1};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_write(&cases[i], slots, 8, 200 + i, false, 3, 2);
    /* the first invalid at index 0 */
    const int64_t first[] = {-2, 1001, 1002};
    run_write(&cases[0], first, 3, 300, false, 1, 0);
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
    kv__dev_error_finish(&rec, a);
    kv__dev_error(&rec, KV_ATTN_DEV_SLOTS, 5);
    kv__dev_error_finish(&rec, b);
    kv__attn_errors_decode(&rec, &info);
    assert_int_equal(info.count, 2);
    assert_int_equal(info.index, 3);
    assert_int_equal(info.value, -7);
    kv__dev_error(&rec, KV_ATTN_DEV_SLOTS, 1);
    kv__dev_error_finish(&rec, c);
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
    struct fix f;
    fix_init(&f, &cfg, 7);
    struct tens k, v;
    make_tens(&k, KV_F16, 0, 3, 2, 8, 1);
    make_tens(&v, KV_F16, 0, 3, 2, 8, 2);
    const int64_t slots[4] = {1000, 1001, 1002, 1003};
    struct kv__attn_job j;
    kv_status st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 1, &k.v, &v.v, slots,
                                            4, NULL, &j);
    assert_int_equal(st, KV_ERR_BAD_SHAPE);
    assert_non_null(strstr(kv_last_error(), "n_slots 4 outside [0, T = 3]"));
    st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 1, &k.v, &v.v, NULL, 2, NULL, &j);
    assert_int_equal(st, KV_ERR_NULL);
    float one = 1.0f;
    struct kv_scales sc = {&one, &one, 1, 0};
    st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 1, &k.v, &v.v, slots, 3, &sc,
                                  &j);
    assert_int_equal(st, KV_ERR_UNSUPPORTED);
    st = kv__attn_write_dev_check("kv_attn_write_cuda_dev", &f.c, 2, &k.v, &v.v, slots, 3, NULL,
                                  &j);
    assert_int_not_equal(st, KV_OK);
    /* the public entry: same refusals, nothing launched or changed */
    st = kv_attn_write_cuda_dev(f.c, 1, &k.v, &v.v, slots, 4, NULL, NULL, NULL);
    assert_int_not_equal(st, KV_OK);
    check_bytes(f.mem, f.ref, f.bytes + 2 * GUARD, "pool after refusals");
    kv__mem_free(k.buf), kv__mem_free(v.buf);
    fix_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_devidx_write_valid),
        cmocka_unit_test(test_devidx_write_invalid),
        cmocka_unit_test(test_devidx_record_across_launches),
        cmocka_unit_test(test_devidx_write_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
