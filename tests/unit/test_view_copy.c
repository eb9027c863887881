/*
 * test_view_copy.c - kv_view_materialize / kv_view_copy / copy stats against
 * an independent reference that computes every element address with the view
 * formula  base + (offset + sum_k i_k * strides[k]) * elem_bytes.
 *
 * Copies into a strided destination always live inside a larger pool that is
 * filled with a sentinel first; the WHOLE pool is compared afterwards (touched
 * elements == reference, untouched bytes == sentinel), and the source storage
 * is compared against a saved copy (unchanged).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kv_mem.h"
#include "kv_view.h"
#include "kvtest.h"

#define SENTINEL 0xA5
#define SEED 0x5EEDC0FFEEull

static const kv_dtype all_dtypes[] = {KV_U8, KV_F16, KV_BF16, KV_F32, KV_I32, KV_F64, KV_I64};
#define N_DTYPES (sizeof(all_dtypes) / sizeof(all_dtypes[0]))

/* ---- reference ---------------------------------------------------------- */

static int64_t ref_numel(const struct kv_view *v)
{
    int64_t n = 1;
    for (int k = 0; k < v->ndim; k++)
        n *= v->shape[k];
    return n;
}

/* Byte offset from v->base of the element with C-order linear index lin. */
static int64_t ref_byte_off(const struct kv_view *v, int64_t lin)
{
    int64_t off = v->offset;
    for (int k = v->ndim - 1; k >= 0; k--) {
        int64_t i = lin % v->shape[k];
        lin /= v->shape[k];
        off += i * v->strides[k];
    }
    return off * (int64_t)kv_dtype_size(v->dtype);
}

static void *xalloc(size_t n)
{
    void *p = kv__mem_alloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

static void fill_random(void *p, size_t n, uint64_t *rng)
{
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(kvt_rand(rng) | 1); /* never the 0 of a missed write */
}

/* ---- checks ------------------------------------------------------------- */

/* Materialize src and compare with the reference; also checks a guard after
 * the output and that src's storage is unchanged. */
static void check_materialize(const struct kv_view *src)
{
    const size_t esz = kv_dtype_size(src->dtype);
    const int64_t numel = ref_numel(src);
    const size_t out_bytes = (size_t)numel * esz;
    unsigned char *out = xalloc(out_bytes + 64);
    unsigned char *saved = xalloc(src->storage_bytes);

    memcpy(saved, src->base, src->storage_bytes);
    memset(out, SENTINEL, out_bytes + 64);
    assert_int_equal(kv_view_materialize(src, out, out_bytes), KV_OK);
    for (int64_t i = 0; i < numel; i++) {
        const unsigned char *want = (const unsigned char *)src->base + ref_byte_off(src, i);
        if (memcmp(out + (size_t)i * esz, want, esz) != 0) {
            char d[512];
            kv_view_describe(src, d, sizeof(d));
            fail_msg("materialize: element %lld differs for %s", (long long)i, d);
        }
    }
    for (size_t i = 0; i < 64; i++)
        assert_int_equal(out[out_bytes + i], SENTINEL);
    assert_memory_equal(saved, src->base, src->storage_bytes);
    kv__mem_free(saved);
    kv__mem_free(out);
}

/* kv_view_copy(src, dst) where dst lives in a pool (dst->base, dst->
 * storage_bytes) disjoint from src's storage. */
static void check_copy(const struct kv_view *dst, const struct kv_view *src)
{
    const size_t esz = kv_dtype_size(src->dtype);
    const int64_t numel = ref_numel(src);
    unsigned char *pool = dst->base;
    unsigned char *expect = xalloc(dst->storage_bytes);
    unsigned char *saved = xalloc(src->storage_bytes);

    memset(pool, SENTINEL, dst->storage_bytes);
    memcpy(expect, pool, dst->storage_bytes);
    memcpy(saved, src->base, src->storage_bytes);
    for (int64_t i = 0; i < numel; i++)
        memcpy(expect + ref_byte_off(dst, i),
               (const unsigned char *)src->base + ref_byte_off(src, i), esz);
    assert_int_equal(kv_view_copy(src, dst), KV_OK);
    if (memcmp(expect, pool, dst->storage_bytes) != 0) {
        char a[512], b[512];
        size_t first = 0;
        while (expect[first] == pool[first])
            first++;
        kv_view_describe(dst, a, sizeof(a));
        kv_view_describe(src, b, sizeof(b));
        fail_msg("copy: pool byte %zu is 0x%02x, want 0x%02x (dst %s, src %s)", first, pool[first],
                 expect[first], a, b);
    }
    assert_memory_equal(saved, src->base, src->storage_bytes);
    kv__mem_free(saved);
    kv__mem_free(expect);
}

/* A C-contiguous view of `shape` over fresh random storage (caller frees base). */
static struct kv_view make_src(kv_dtype dt, int ndim, const int64_t *shape, size_t extra_bytes,
                               uint64_t *rng)
{
    struct kv_view v;
    int64_t n = 1;
    for (int k = 0; k < ndim; k++)
        n *= shape[k];
    const size_t bytes = (size_t)n * kv_dtype_size(dt) + extra_bytes;
    void *buf = xalloc(bytes);
    fill_random(buf, bytes, rng);
    assert_int_equal(kv_view_init(buf, bytes, dt, ndim, shape, &v), KV_OK);
    return v;
}

/* Contiguous dst pool for src's shape; also runs check_copy into it. */
static void check_copy_contig_dst(const struct kv_view *src)
{
    struct kv_view d;
    const size_t bytes = (size_t)ref_numel(src) * kv_dtype_size(src->dtype) + 32;
    void *pool = xalloc(bytes);
    assert_int_equal(kv_view_init(pool, bytes, src->dtype, src->ndim, src->shape, &d), KV_OK);
    check_copy(&d, src);
    kv__mem_free(pool);
}

/* Both materialize and copy-into-contiguous. */
static void check_both(const struct kv_view *src)
{
    check_materialize(src);
    check_copy_contig_dst(src);
}

/* ---- layouts ------------------------------------------------------------ */

static void test_view_copy_contiguous(void **state)
{
    (void)state;
    uint64_t rng = SEED;
    const int64_t shapes[][3] = {{3, 4, 5}, {1, 1, 1}, {7, 1, 13}, {2, 64, 33}};
    for (size_t t = 0; t < N_DTYPES; t++) {
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            struct kv_view v = make_src(all_dtypes[t], 3, shapes[s], 0, &rng);
            check_both(&v);
            kv__mem_free(v.base);
        }
    }
}

static void test_view_copy_transpose_2d(void **state)
{
    (void)state;
    uint64_t rng = SEED + 1;
    /* odd sizes, degenerate sizes, and sizes big enough for the staged
     * (buffered) transpose path of each element size */
    const int64_t sizes[][2] = {{37, 129}, {129, 37}, {1, 1}, {0, 5},   {5, 0},  {1, 17},
                                {17, 1},   {8, 8},    {9, 7}, {64, 64}, {65, 63}};
    for (size_t t = 0; t < N_DTYPES; t++) {
        for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
            struct kv_view v = make_src(all_dtypes[t], 2, sizes[s], 0, &rng), tv;
            assert_int_equal(kv_view_transpose(&v, 0, 1, &tv), KV_OK);
            check_both(&tv);
            kv__mem_free(v.base);
        }
    }
    const struct {
        kv_dtype dt;
        int64_t shape[2];
    } big[] = {
        {KV_U8, {1500, 1301}}, {KV_F16, {1100, 1030}}, {KV_F32, {700, 603}}, {KV_F64, {400, 391}}};
    for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
        struct kv_view v = make_src(big[i].dt, 2, big[i].shape, 0, &rng), tv;
        assert_int_equal(kv_view_transpose(&v, 0, 1, &tv), KV_OK);
        check_both(&tv);
        kv__mem_free(v.base);
    }
}

static void test_view_copy_permute_3d_4d(void **state)
{
    (void)state;
    uint64_t rng = SEED + 2;
    const int perms3[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    const int64_t shape3[3] = {5, 6, 7};
    for (size_t t = 0; t < N_DTYPES; t++) {
        struct kv_view v = make_src(all_dtypes[t], 3, shape3, 0, &rng), p;
        for (int i = 0; i < 6; i++) {
            assert_int_equal(kv_view_permute(&v, perms3[i], 3, &p), KV_OK);
            check_both(&p);
        }
        kv__mem_free(v.base);
    }
    const int perms4[][4] = {{0, 2, 1, 3}, {3, 2, 1, 0}, {1, 3, 0, 2}, {0, 3, 1, 2}, {2, 0, 3, 1}};
    const int64_t shape4[4] = {3, 4, 5, 6};
    for (size_t t = 0; t < N_DTYPES; t++) {
        struct kv_view v = make_src(all_dtypes[t], 4, shape4, 0, &rng), p;
        for (size_t i = 0; i < sizeof(perms4) / sizeof(perms4[0]); i++) {
            assert_int_equal(kv_view_permute(&v, perms4[i], 4, &p), KV_OK);
            check_both(&p);
        }
        kv__mem_free(v.base);
    }
    /* the KV re-layout: [blocks][N][H][D] -> [blocks][H][N][D], bf16 */
    const int64_t kv[4] = {6, 16, 8, 128};
    const int nhd_hnd[4] = {0, 2, 1, 3};
    struct kv_view v = make_src(KV_BF16, 4, kv, 0, &rng), p;
    assert_int_equal(kv_view_permute(&v, nhd_hnd, 4, &p), KV_OK);
    check_both(&p);
    kv__mem_free(v.base);

    /* big enough (32 MiB) for the streaming-store run copy */
    const int64_t kvbig[4] = {1024, 16, 8, 128};
    v = make_src(KV_BF16, 4, kvbig, 0, &rng);
    assert_int_equal(kv_view_permute(&v, nhd_hnd, 4, &p), KV_OK);
    check_both(&p);
    kv__mem_free(v.base);
}

static void test_view_copy_sliced_steps(void **state)
{
    (void)state;
    uint64_t rng = SEED + 3;
    const int64_t shape[3] = {9, 10, 11};
    for (size_t t = 0; t < N_DTYPES; t++) {
        struct kv_view v = make_src(all_dtypes[t], 3, shape, 0, &rng), a, b, c;
        assert_int_equal(kv_view_slice(&v, 2, 1, 11, 3, &a), KV_OK);
        check_both(&a);
        assert_int_equal(kv_view_slice(&a, 0, 2, 9, 2, &b), KV_OK);
        check_both(&b);
        assert_int_equal(kv_view_transpose(&b, 0, 2, &c), KV_OK);
        check_both(&c);
        assert_int_equal(kv_view_slice(&v, 1, 0, 10, 2, &a), KV_OK); /* every other row */
        assert_int_equal(kv_view_transpose(&a, 1, 2, &b), KV_OK);
        check_both(&b);
        kv__mem_free(v.base);
    }
}

static void test_view_copy_offset_views(void **state)
{
    (void)state;
    uint64_t rng = SEED + 4;
    const int64_t shape[3] = {6, 7, 8};
    for (size_t t = 0; t < N_DTYPES; t++) {
        struct kv_view v = make_src(all_dtypes[t], 3, shape, 0, &rng), a, b, c;
        assert_int_equal(kv_view_narrow(&v, 0, 2, 3, &a), KV_OK); /* offset 2*56 */
        assert_true(a.offset > 0);
        check_both(&a);
        assert_int_equal(kv_view_select(&v, 1, 5, &b), KV_OK); /* [6][8], offset 40 */
        assert_true(b.offset > 0);
        check_both(&b);
        assert_int_equal(kv_view_transpose(&b, 0, 1, &c), KV_OK);
        check_both(&c);
        const int64_t sh[2] = {5, 4}, st[2] = {1, 9};
        assert_int_equal(kv_view_as_strided(&v, 2, sh, st, 17, &a), KV_OK);
        check_both(&a);
        kv__mem_free(v.base);
    }
}

static void test_view_copy_padded(void **state)
{
    (void)state;
    uint64_t rng = SEED + 5;
    for (size_t t = 0; t < N_DTYPES; t++) {
        const int64_t flat[1] = {4096};
        struct kv_view v = make_src(all_dtypes[t], 1, flat, 0, &rng), a, b;
        const int64_t sh2[2] = {10, 7}, st2[2] = {9, 1}; /* rows padded 7 -> 9 */
        assert_int_equal(kv_view_as_strided(&v, 2, sh2, st2, 3, &a), KV_OK);
        check_both(&a);
        assert_int_equal(kv_view_transpose(&a, 0, 1, &b), KV_OK);
        check_both(&b);
        const int64_t sh3[3] = {4, 5, 6}, st3[3] = {40, 7, 1}; /* both outer dims padded */
        assert_int_equal(kv_view_as_strided(&v, 3, sh3, st3, 5, &a), KV_OK);
        check_both(&a);
        const int perm[3] = {2, 0, 1};
        assert_int_equal(kv_view_permute(&a, perm, 3, &b), KV_OK);
        check_both(&b);
        kv__mem_free(v.base);
    }
}

static void test_view_copy_expanded_source(void **state)
{
    (void)state;
    uint64_t rng = SEED + 6;
    for (size_t t = 0; t < N_DTYPES; t++) {
        const int64_t row[2] = {1, 5}, col[2] = {3, 1};
        struct kv_view r = make_src(all_dtypes[t], 2, row, 0, &rng);
        struct kv_view c = make_src(all_dtypes[t], 2, col, 0, &rng);
        struct kv_view e, f;
        const int64_t to45[2] = {4, 5}, to36[2] = {3, 6}, to3d[3] = {2, 3, 6};
        assert_int_equal(kv_view_expand(&r, 2, to45, &e), KV_OK); /* stride 0 outer */
        assert_int_equal(e.strides[0], 0);
        check_both(&e);
        assert_int_equal(kv_view_expand(&c, 2, to36, &e), KV_OK); /* stride 0 inner */
        assert_int_equal(e.strides[1], 0);
        check_both(&e);
        assert_int_equal(kv_view_expand(&c, 3, to3d, &f), KV_OK); /* new leading dim */
        check_both(&f);
        assert_int_equal(kv_view_transpose(&f, 0, 2, &e), KV_OK);
        check_both(&e);
        kv__mem_free(r.base);
        kv__mem_free(c.base);
    }
}

static void test_view_copy_zero_dim_and_empty(void **state)
{
    (void)state;
    uint64_t rng = SEED + 7;
    struct kv_view s0 = make_src(KV_F32, 0, NULL, 0, &rng);
    check_both(&s0); /* 0-d: one element */
    kv__mem_free(s0.base);

    const int64_t empty[3] = {4, 0, 3};
    struct kv_view v = make_src(KV_F16, 3, empty, 16, &rng), d;
    unsigned char out[4] = {1, 2, 3, 4};
    assert_int_equal(kv_view_materialize(&v, out, 0), KV_OK);
    assert_int_equal(out[0], 1);
    assert_int_equal(kv_view_init(out, sizeof(out), KV_F16, 3, empty, &d), KV_OK);
    assert_int_equal(kv_view_copy(&v, &d), KV_OK);
    assert_int_equal(out[3], 4);
    kv__mem_free(v.base);
}

/* ---- strided destinations inside a pool --------------------------------- */

static void test_view_copy_into_strided_pool(void **state)
{
    (void)state;
    uint64_t rng = SEED + 8;
    for (size_t t = 0; t < N_DTYPES; t++) {
        const kv_dtype dt = all_dtypes[t];
        const size_t esz = kv_dtype_size(dt);
        const int64_t pshape[3] = {12, 40, 9}; /* pool [12][40][9] */
        const size_t pbytes = 12 * 40 * 9 * esz;
        void *pool = xalloc(pbytes);
        struct kv_view p, d1, d2, d3;
        assert_int_equal(kv_view_init(pool, pbytes, dt, 3, pshape, &p), KV_OK);

        /* dst: pool[2:10:2, 5:35:3, 1:8]  -> [4][10][7], offset and steps */
        assert_int_equal(kv_view_slice(&p, 0, 2, 10, 2, &d1), KV_OK);
        assert_int_equal(kv_view_slice(&d1, 1, 5, 35, 3, &d2), KV_OK);
        assert_int_equal(kv_view_slice(&d2, 2, 1, 8, 1, &d3), KV_OK);
        const int64_t sshape[3] = {4, 10, 7};
        struct kv_view s = make_src(dt, 3, sshape, 0, &rng), st;
        check_copy(&d3, &s);

        /* dst transposed inside the pool, src contiguous of the permuted shape */
        const int perm[3] = {2, 1, 0};
        assert_int_equal(kv_view_permute(&d3, perm, 3, &d1), KV_OK);
        const int64_t tshape[3] = {7, 10, 4};
        struct kv_view s2 = make_src(dt, 3, tshape, 0, &rng);
        check_copy(&d1, &s2);

        /* strided src into strided dst */
        assert_int_equal(kv_view_permute(&s2, perm, 3, &st), KV_OK);
        check_copy(&d3, &st);
        kv__mem_free(s.base);
        kv__mem_free(s2.base);
        kv__mem_free(pool);
    }
}

/* Random views (fixed seed): random dtype, shape, permutation, steps and
 * offsets on both sides, dst inside a padded pool. */
static void test_view_copy_random_views(void **state)
{
    (void)state;
    uint64_t rng = SEED + 9;
    for (int iter = 0; iter < 400; iter++) {
        const kv_dtype dt = all_dtypes[kvt_range(&rng, 0, N_DTYPES - 1)];
        const size_t esz = kv_dtype_size(dt);
        const int nd = (int)kvt_range(&rng, 1, 5);
        int64_t shape[KV_MAX_DIMS], sst[KV_MAX_DIMS], dst_[KV_MAX_DIMS];
        int perm_s[KV_MAX_DIMS], perm_d[KV_MAX_DIMS];
        for (int k = 0; k < nd; k++) {
            shape[k] = kvt_range(&rng, 0, 9) == 0 ? 1 : kvt_range(&rng, 1, nd <= 2 ? 70 : 6);
            perm_s[k] = perm_d[k] = k;
        }
        for (int k = nd - 1; k > 0; k--) { /* Fisher-Yates, both sides */
            int j = (int)kvt_range(&rng, 0, k), x = perm_s[k];
            perm_s[k] = perm_s[j];
            perm_s[j] = x;
            j = (int)kvt_range(&rng, 0, k);
            x = perm_d[k];
            perm_d[k] = perm_d[j];
            perm_d[j] = x;
        }
        /* Strides: lay dims out in perm order with random steps/padding;
         * sometimes a stride-0 (broadcast) dim on the src side. */
        int64_t span = 1, sspan = 1;
        const int64_t s_off = kvt_range(&rng, 0, 7), d_off = kvt_range(&rng, 0, 7);
        for (int t = nd - 1; t >= 0; t--) {
            int k = perm_s[t];
            int64_t step = kvt_range(&rng, 0, 3) == 0 ? kvt_range(&rng, 2, 3) : 1;
            sst[k] = kvt_range(&rng, 0, 11) == 0 ? 0 : sspan * step;
            sspan = sspan * step * shape[k] + kvt_range(&rng, 0, 2);
            k = perm_d[t];
            step = kvt_range(&rng, 0, 3) == 0 ? 2 : 1;
            dst_[k] = span * step;
            span = span * step * shape[k] + kvt_range(&rng, 0, 3);
        }
        const size_t sbytes = (size_t)(sspan + s_off + 1) * esz;
        const size_t dbytes = (size_t)(span + d_off + 1) * esz;
        void *sbuf = xalloc(sbytes), *dbuf = xalloc(dbytes);
        fill_random(sbuf, sbytes, &rng);
        struct kv_view sv, dv, s, d;
        const int64_t sflat[1] = {(int64_t)(sbytes / esz)}, dflat[1] = {(int64_t)(dbytes / esz)};
        assert_int_equal(kv_view_init(sbuf, sbytes, dt, 1, sflat, &sv), KV_OK);
        assert_int_equal(kv_view_init(dbuf, dbytes, dt, 1, dflat, &dv), KV_OK);
        assert_int_equal(kv_view_as_strided(&sv, nd, shape, sst, s_off, &s), KV_OK);
        assert_int_equal(kv_view_as_strided(&dv, nd, shape, dst_, d_off, &d), KV_OK);
        check_materialize(&s);
        check_copy(&d, &s);
        kv__mem_free(sbuf);
        kv__mem_free(dbuf);
    }
}

/* ---- bad input ---------------------------------------------------------- */

/* The streaming paths only start at 32 MiB: odd-sized transposes and a page
 * permute above that size, into aligned, misaligned (offset 1 element) and
 * padded destinations, checked element by element and over the whole pool. */
static void test_view_copy_large_streaming_paths(void **state)
{
    uint64_t rng = SEED ^ 0x1A26E;
    struct kv_view s, t, d;
    (void)state;
    {
        int64_t shape[2] = {3000, 3001}; /* 36 MB f32 */
        s = make_src(KV_F32, 2, shape, 0, &rng);
        assert_int_equal(kv_view_transpose(&s, 0, 1, &t), KV_OK);
        check_materialize(&t);
        {
            int64_t dshape[2] = {3001, 3000}, dstr[2] = {3000, 1};
            size_t bytes = (size_t)3001 * 3000 * 4 + 64;
            void *pool = xalloc(bytes);
            assert_int_equal(kv_view_init(pool, bytes, KV_F32, 2, dshape, &d), KV_OK);
            assert_int_equal(kv_view_as_strided(&d, 2, dshape, dstr, 1, &d), KV_OK);
            check_copy(&d, &t); /* dst 4 bytes off 16-byte alignment */
            kv__mem_free(pool);
        }
        kv__mem_free(s.base);
    }
    {
        int64_t shape[2] = {4099, 4100}; /* 33.6 MB f16 */
        s = make_src(KV_F16, 2, shape, 0, &rng);
        assert_int_equal(kv_view_transpose(&s, 0, 1, &t), KV_OK);
        check_materialize(&t);
        kv__mem_free(s.base);
    }
    {
        int64_t shape[4] = {1030, 16, 8, 128}; /* 33.75 MB bf16, NHD -> HND */
        int perm[4] = {0, 2, 1, 3};
        s = make_src(KV_BF16, 4, shape, 0, &rng);
        assert_int_equal(kv_view_permute(&s, perm, 4, &t), KV_OK);
        check_both(&t);
        {
            int64_t dshape[4] = {1030, 8, 16, 128};
            int64_t dstr[4] = {16 * 8 * 128 + 64, 16 * 128, 128, 1}; /* padded blocks */
            int64_t pool_elems = 1030 * dstr[0] + 8;
            void *pool = xalloc((size_t)pool_elems * 2);
            assert_int_equal(
                kv_view_init(pool, (size_t)pool_elems * 2, KV_BF16, 1, &pool_elems, &d), KV_OK);
            assert_int_equal(kv_view_as_strided(&d, 4, dshape, dstr, 3, &d), KV_OK);
            check_copy(&d, &t);
            kv__mem_free(pool);
        }
        kv__mem_free(s.base);
    }
}

static void test_view_copy_rejects_null(void **state)
{
    (void)state;
    float buf[12];
    const int64_t shape[2] = {3, 4};
    struct kv_view v;
    assert_int_equal(kv_view_init(buf, sizeof(buf), KV_F32, 2, shape, &v), KV_OK);
    assert_int_equal(kv_view_materialize(NULL, buf, sizeof(buf)), KV_ERR_NULL);
    assert_int_equal(kv_view_materialize(&v, NULL, 48), KV_ERR_NULL);
    assert_non_null(strstr(kv_last_error(), "48"));
    assert_int_equal(kv_view_copy(&v, NULL), KV_ERR_NULL);
    assert_int_equal(kv_view_copy(NULL, &v), KV_ERR_NULL);
}

static void test_view_copy_rejects_shape_mismatch(void **state)
{
    (void)state;
    float a[12], b[12];
    const int64_t s34[2] = {3, 4}, s43[2] = {4, 3}, s12[1] = {12};
    struct kv_view va, vb, vc;
    assert_int_equal(kv_view_init(a, sizeof(a), KV_F32, 2, s34, &va), KV_OK);
    assert_int_equal(kv_view_init(b, sizeof(b), KV_F32, 2, s43, &vb), KV_OK);
    assert_int_equal(kv_view_init(b, sizeof(b), KV_F32, 1, s12, &vc), KV_OK);
    memset(a, 0x11, sizeof(a));
    assert_int_equal(kv_view_copy(&vb, &va), KV_ERR_BAD_SHAPE);
    assert_non_null(strstr(kv_last_error(), "[3,4]"));
    assert_non_null(strstr(kv_last_error(), "[4,3]"));
    assert_int_equal(kv_view_copy(&vc, &va), KV_ERR_BAD_SHAPE); /* different ndim */
    assert_non_null(strstr(kv_last_error(), "[12]"));
    for (size_t i = 0; i < sizeof(a); i++) /* a failed call changes nothing */
        assert_int_equal(((unsigned char *)a)[i], 0x11);
}

static void test_view_copy_rejects_dtype_mismatch(void **state)
{
    (void)state;
    float a[12];
    uint16_t b[12];
    const int64_t shape[2] = {3, 4};
    struct kv_view va, vb;
    assert_int_equal(kv_view_init(a, sizeof(a), KV_F32, 2, shape, &va), KV_OK);
    assert_int_equal(kv_view_init(b, sizeof(b), KV_BF16, 2, shape, &vb), KV_OK);
    assert_int_equal(kv_view_copy(&vb, &va), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "f32"));
    assert_non_null(strstr(kv_last_error(), "bf16"));
}

static void test_view_copy_rejects_small_dst(void **state)
{
    (void)state;
    double src[35], dst[35];
    const int64_t shape[2] = {5, 7};
    struct kv_view v, t;
    assert_int_equal(kv_view_init(src, sizeof(src), KV_F64, 2, shape, &v), KV_OK);
    assert_int_equal(kv_view_transpose(&v, 0, 1, &t), KV_OK);
    memset(dst, 0x22, sizeof(dst));
    assert_int_equal(kv_view_materialize(&t, dst, 279), KV_ERR_OUT_OF_BOUNDS);
    assert_non_null(strstr(kv_last_error(), "279"));
    assert_non_null(strstr(kv_last_error(), "280"));
    for (size_t i = 0; i < sizeof(dst); i++)
        assert_int_equal(((unsigned char *)dst)[i], 0x22);
}

static void test_view_copy_rejects_overlap(void **state)
{
    (void)state;
    int32_t buf[64];
    const int64_t flat[1] = {64};
    struct kv_view all, a, b;
    for (int i = 0; i < 64; i++)
        buf[i] = i;
    assert_int_equal(kv_view_init(buf, sizeof(buf), KV_I32, 1, flat, &all), KV_OK);

    /* materialize into the source's own bytes */
    assert_int_equal(kv_view_narrow(&all, 0, 0, 20, &a), KV_OK);
    assert_int_equal(kv_view_materialize(&a, buf + 10, 80), KV_ERR_OVERLAP);
    assert_non_null(strstr(kv_last_error(), "80"));

    /* copy between overlapping ranges of one storage */
    assert_int_equal(kv_view_narrow(&all, 0, 0, 20, &a), KV_OK);
    assert_int_equal(kv_view_narrow(&all, 0, 10, 20, &b), KV_OK);
    assert_int_equal(kv_view_copy(&a, &b), KV_ERR_OVERLAP);
    assert_non_null(strstr(kv_last_error(), "40")); /* dst starts at byte 40 */
    for (int i = 0; i < 64; i++)
        assert_int_equal(buf[i], i);

    /* same storage, interleaved but disjoint: allowed (exact test) */
    assert_int_equal(kv_view_slice(&all, 0, 0, 64, 2, &a), KV_OK);
    assert_int_equal(kv_view_slice(&all, 0, 1, 64, 2, &b), KV_OK);
    assert_int_equal(kv_view_copy(&a, &b), KV_OK);
    for (int i = 0; i < 64; i++)
        assert_int_equal(buf[i], i % 2 ? i - 1 : i);
}

static void test_view_copy_rejects_stride0_dst(void **state)
{
    (void)state;
    float d[8], s[24];
    const int64_t one[2] = {1, 8}, to[2] = {3, 8};
    struct kv_view vd, ve, vs;
    memset(d, 0x33, sizeof(d));
    memset(s, 0x44, sizeof(s));
    assert_int_equal(kv_view_init(d, sizeof(d), KV_F32, 2, one, &vd), KV_OK);
    assert_int_equal(kv_view_expand(&vd, 2, to, &ve), KV_OK);
    assert_int_equal(kv_view_init(s, sizeof(s), KV_F32, 2, to, &vs), KV_OK);
    assert_int_equal(kv_view_copy(&vs, &ve), KV_ERR_OVERLAP);
    assert_non_null(strstr(kv_last_error(), "[0,1]")); /* the offending strides */
    for (size_t i = 0; i < sizeof(d); i++)
        assert_int_equal(((unsigned char *)d)[i], 0x33);
    /* the same expanded view is fine as a SOURCE */
    assert_int_equal(kv_view_copy(&ve, &vs), KV_OK);
}

/* ---- accounting --------------------------------------------------------- */

static void test_view_copy_stats(void **state)
{
    (void)state;
    struct kv_copy_stats st;
    float a[12], b[12], out[12];
    const int64_t shape[2] = {3, 4}, s43[2] = {4, 3};
    struct kv_view va, vb, vt, vbad;

    memset(a, 1, sizeof(a));
    assert_int_equal(kv_view_init(a, sizeof(a), KV_F32, 2, shape, &va), KV_OK);
    assert_int_equal(kv_view_init(b, sizeof(b), KV_F32, 2, shape, &vb), KV_OK);
    assert_int_equal(kv_view_init(b, sizeof(b), KV_F32, 2, s43, &vbad), KV_OK);
    assert_int_equal(kv_view_transpose(&va, 0, 1, &vt), KV_OK);

    kv_copy_stats_reset();
    kv_copy_stats_get(&st);
    for (int r = 0; r < KV_COPY_REASON_COUNT; r++) {
        assert_int_equal(st.calls[r], 0);
        assert_int_equal(st.bytes[r], 0);
    }
    assert_int_equal(kv_view_materialize(&vt, out, sizeof(out)), KV_OK);
    assert_int_equal(kv_view_copy(&va, &vb), KV_OK);
    assert_int_equal(kv_view_copy(&va, &vb), KV_OK);
    assert_int_equal(kv_view_copy(&va, &vbad), KV_ERR_BAD_SHAPE); /* failures do not count */
    kv_copy_stats_get(&st);
    assert_int_equal(st.calls[KV_COPY_MATERIALIZE], 1);
    assert_int_equal(st.bytes[KV_COPY_MATERIALIZE], 48);
    assert_int_equal(st.calls[KV_COPY_VIEW_COPY], 2);
    assert_int_equal(st.bytes[KV_COPY_VIEW_COPY], 96);
    assert_int_equal(st.calls[KV_COPY_RESHAPE], 0);
    kv_copy_stats_reset();
    kv_copy_stats_get(&st);
    assert_int_equal(st.calls[KV_COPY_VIEW_COPY], 0);

    assert_string_equal(kv_copy_reason_name(KV_COPY_RESHAPE), "reshape");
    assert_string_equal(kv_copy_reason_name(KV_COPY_MATERIALIZE), "materialize");
    assert_string_equal(kv_copy_reason_name(KV_COPY_VIEW_COPY), "view_copy");
    assert_string_equal(kv_copy_reason_name((kv_copy_reason)KV_COPY_REASON_COUNT), "?");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_view_copy_contiguous),
        cmocka_unit_test(test_view_copy_transpose_2d),
        cmocka_unit_test(test_view_copy_permute_3d_4d),
        cmocka_unit_test(test_view_copy_sliced_steps),
        cmocka_unit_test(test_view_copy_offset_views),
        cmocka_unit_test(test_view_copy_padded),
        cmocka_unit_test(test_view_copy_expanded_source),
        cmocka_unit_test(test_view_copy_zero_dim_and_empty),
        cmocka_unit_test(test_view_copy_into_strided_pool),
        cmocka_unit_test(test_view_copy_random_views),
        cmocka_unit_test(test_view_copy_large_streaming_paths),
        cmocka_unit_test(test_view_copy_rejects_null),
        cmocka_unit_test(test_view_copy_rejects_shape_mismatch),
        cmocka_unit_test(test_view_copy_rejects_dtype_mismatch),
        cmocka_unit_test(test_view_copy_rejects_small_dst),
        cmocka_unit_test(test_view_copy_rejects_overlap),
        cmocka_unit_test(test_view_copy_rejects_stride0_dst),
        cmocka_unit_test(test_view_copy_stats),
    };
    return cmocka_run_group_tests_name("view_copy", tests, NULL, NULL);
}
