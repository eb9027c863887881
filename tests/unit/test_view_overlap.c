/*
 * test_view_overlap.c - kv_view_extent_bytes / has_internal_overlap /
 * may_share / shares against a brute-force reference that marks every byte
 * each element covers, over known layouts and thousands of random views.
 *
 * Views here are built by hand (struct kv_view literals) so the test depends
 * on kv_view_overlap.c alone.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kv_view.h"
#include "kvtest.h"

#define BUF_BYTES 4096
#define SEED 0x9E3779B97F4A7C15ull

static unsigned char g_buf[BUF_BYTES + 64]; /* storage all views point into */

/* ---- helpers ------------------------------------------------------------ */

static uint64_t g_rng; /* kvt_rand state: fixed seeds, replayable */

static int64_t rng_range(int64_t lo, int64_t hi) /* inclusive */
{
    return kvt_range(&g_rng, lo, hi);
}

static struct kv_view mk(kv_dtype dt, size_t base_off, int64_t offset, int ndim,
                         const int64_t *shape, const int64_t *strides)
{
    struct kv_view v;
    memset(&v, 0, sizeof(v));
    v.dtype = dt;
    v.ndim = ndim;
    for (int k = 0; k < ndim; k++) {
        v.shape[k] = shape[k];
        v.strides[k] = strides[k];
    }
    v.offset = offset;
    v.base = g_buf + base_off;
    v.storage_bytes = BUF_BYTES - base_off;
    return v;
}

static int64_t ref_numel(const struct kv_view *v)
{
    int64_t n = 1;
    for (int k = 0; k < v->ndim; k++)
        n *= v->shape[k];
    return n;
}

/* Byte offset from g_buf of the element with linear C-order index `lin`. */
static int64_t ref_addr(const struct kv_view *v, int64_t lin)
{
    int64_t e = v->offset;
    for (int k = v->ndim - 1; k >= 0; k--) {
        e += (lin % v->shape[k]) * v->strides[k];
        lin /= v->shape[k];
    }
    return (int64_t)((unsigned char *)v->base - g_buf) + e * (int64_t)kv_dtype_size(v->dtype);
}

/* count[b] = how many elements of v cover byte b of g_buf. */
static void ref_mark(const struct kv_view *v, unsigned short *count)
{
    int64_t n = ref_numel(v), eb = (int64_t)kv_dtype_size(v->dtype);
    for (int64_t i = 0; i < n; i++) {
        int64_t a = ref_addr(v, i);
        for (int64_t b = 0; b < eb; b++)
            count[a + b]++;
    }
}

static bool ref_internal_overlap(const struct kv_view *v)
{
    static unsigned short count[BUF_BYTES + 64];
    memset(count, 0, sizeof(count));
    ref_mark(v, count);
    for (size_t b = 0; b < sizeof(count) / sizeof(count[0]); b++)
        if (count[b] > 1)
            return true;
    return false;
}

static bool ref_shares(const struct kv_view *a, const struct kv_view *b)
{
    static unsigned short ca[BUF_BYTES + 64], cb[BUF_BYTES + 64];
    memset(ca, 0, sizeof(ca));
    memset(cb, 0, sizeof(cb));
    ref_mark(a, ca);
    ref_mark(b, cb);
    for (size_t i = 0; i < sizeof(ca) / sizeof(ca[0]); i++)
        if (ca[i] && cb[i])
            return true;
    return false;
}

/* Extent relative to v->base, in bytes; [0, 0) when empty. */
static void ref_extent(const struct kv_view *v, int64_t *lo, int64_t *hi)
{
    int64_t n = ref_numel(v), eb = (int64_t)kv_dtype_size(v->dtype);
    int64_t base_off = (int64_t)((unsigned char *)v->base - g_buf);
    *lo = 0;
    *hi = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t a = ref_addr(v, i) - base_off;
        if (i == 0 || a < *lo)
            *lo = a;
        if (i == 0 || a + eb > *hi)
            *hi = a + eb;
    }
}

static bool ref_may_share(const struct kv_view *a, const struct kv_view *b)
{
    int64_t alo, ahi, blo, bhi, oa, ob;
    if (ref_numel(a) == 0 || ref_numel(b) == 0)
        return false;
    ref_extent(a, &alo, &ahi);
    ref_extent(b, &blo, &bhi);
    oa = (int64_t)((unsigned char *)a->base - g_buf);
    ob = (int64_t)((unsigned char *)b->base - g_buf);
    return oa + alo < ob + bhi && ob + blo < oa + ahi;
}

static bool overlap_of(const struct kv_view *v)
{
    bool out = false;
    assert_int_equal(kv_view_has_internal_overlap(v, 0, &out), KV_OK);
    return out;
}

static bool shares_of(const struct kv_view *a, const struct kv_view *b)
{
    bool ab = false, ba = false;
    assert_int_equal(kv_view_shares(a, b, 0, &ab), KV_OK);
    assert_int_equal(kv_view_shares(b, a, 0, &ba), KV_OK);
    assert_int_equal(ab, ba); /* symmetric */
    return ab;
}

/* A random small view of g_buf: random dtype, base offset, shape (sizes 0..5,
 * numel <= 256), strides from several families (C order, permuted, random
 * small, zero, overlapping), and an offset that keeps it in storage. */
static struct kv_view rand_view(void)
{
    int64_t shape[KV_MAX_DIMS], strides[KV_MAX_DIMS];
    kv_dtype dt = (kv_dtype)rng_range(0, KV_DTYPE_COUNT - 1);
    int64_t eb = (int64_t)kv_dtype_size(dt);
    size_t base_off = (size_t)rng_range(0, 15);
    int ndim = (int)rng_range(0, 4);
    int64_t numel = 1, reach = 0, cap_elems, offset;
    int family = (int)rng_range(0, 4);

    for (int k = 0; k < ndim; k++) {
        int64_t n = rng_range(0, 20) == 0 ? 0 : rng_range(1, 5);
        if (numel * (n ? n : 1) > 256)
            n = 1;
        shape[k] = n;
        numel *= n ? n : 1;
    }
    switch (family) {
    case 0: /* C order, maybe padded, then shuffled (transpose-like) */
    case 1: {
        int64_t st = rng_range(1, 2);
        for (int k = ndim - 1; k >= 0; k--) {
            strides[k] = st;
            st *= (shape[k] ? shape[k] : 1) + (family == 1 ? rng_range(0, 1) : 0);
        }
        for (int k = ndim - 1; k > 0; k--) {
            int j = (int)rng_range(0, k);
            int64_t t = strides[k];
            strides[k] = strides[j];
            strides[j] = t;
        }
        break;
    }
    case 2: /* small random strides: lots of overlap and near-misses */
        for (int k = 0; k < ndim; k++)
            strides[k] = rng_range(0, 6);
        break;
    case 3: /* random strides over a wider range */
        for (int k = 0; k < ndim; k++)
            strides[k] = rng_range(0, 40);
        break;
    default: /* a stride-0 (expanded) dim among C-order ones */
        for (int k = 0; k < ndim; k++)
            strides[k] = rng_range(0, 3) == 0 ? 0 : rng_range(1, 12);
        break;
    }
    for (int k = 0; k < ndim; k++)
        reach += (shape[k] > 0 ? shape[k] - 1 : 0) * strides[k];
    cap_elems = (int64_t)(BUF_BYTES - base_off) / eb;
    if (reach + 1 > cap_elems) { /* too big for the buffer: fall back to 0-d */
        ndim = 0;
        reach = 0;
    }
    offset = rng_range(0, cap_elems - reach - 1 < 64 ? cap_elems - reach - 1 : 64);
    return mk(dt, base_off, offset, ndim, shape, strides);
}

/* A second view near `a` (same region of g_buf) so pairs often meet. */
static struct kv_view rand_view_near(const struct kv_view *a)
{
    struct kv_view b = rand_view();
    int64_t ea = (int64_t)kv_dtype_size(a->dtype), eb = (int64_t)kv_dtype_size(b.dtype);
    int64_t a_start = (int64_t)((unsigned char *)a->base - g_buf) + a->offset * ea;
    int64_t lo, hi, b_base = (int64_t)((unsigned char *)b.base - g_buf);
    int64_t want = a_start + rng_range(-8, 24) - b_base; /* bytes from b.base */
    ref_extent(&b, &lo, &hi);
    b.offset = want < 0 ? 0 : want / eb;
    /* keep b inside storage */
    while (b.offset > 0 && b_base + (b.offset * eb) + (hi - lo) > BUF_BYTES)
        b.offset--;
    if (b_base + b.offset * eb + (hi - lo) > BUF_BYTES)
        b.offset = 0;
    return b;
}

/* ---- known layouts ------------------------------------------------------ */

static void test_view_overlap_contiguous_and_transpose(void **state)
{
    (void)state;
    const int64_t sh[2] = {3, 4}, st[2] = {4, 1};
    const int64_t tsh[2] = {4, 3}, tst[2] = {1, 4};
    struct kv_view c = mk(KV_F32, 0, 0, 2, sh, st);
    struct kv_view t = mk(KV_F32, 0, 0, 2, tsh, tst);
    int64_t lo = -1, hi = -1;

    assert_false(overlap_of(&c));
    assert_false(overlap_of(&t));
    kv_view_extent_bytes(&t, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 48);
    assert_true(kv_view_may_share(&c, &t));
    assert_true(shares_of(&c, &t));
    assert_string_equal(kv_last_error(), "");
}

static void test_view_overlap_expand_and_stride0(void **state)
{
    (void)state;
    const int64_t sh[2] = {3, 4}, st[2] = {0, 1};
    const int64_t sh1[2] = {1, 4}, st1[2] = {0, 1};
    const int64_t sh5[1] = {5}, st5[1] = {0};
    struct kv_view e = mk(KV_F16, 0, 2, 2, sh, st);
    struct kv_view e1 = mk(KV_F16, 0, 2, 2, sh1, st1); /* stride 0 on size 1: fine */
    struct kv_view b = mk(KV_I64, 0, 7, 1, sh5, st5);  /* one element seen 5 times */
    int64_t lo, hi;

    assert_true(overlap_of(&e));
    assert_false(overlap_of(&e1));
    assert_true(overlap_of(&b));
    kv_view_extent_bytes(&b, &lo, &hi);
    assert_int_equal(lo, 56);
    assert_int_equal(hi, 64);
}

static void test_view_overlap_sliding_window(void **state)
{
    (void)state;
    /* sliding_window_view(x[10], 3): shape (8,3) strides (1,1) */
    const int64_t sh[2] = {8, 3}, st[2] = {1, 1};
    const int64_t sh1[2] = {8, 1}, st1[2] = {1, 1}; /* window 1: no overlap */
    struct kv_view w = mk(KV_F32, 0, 0, 2, sh, st);
    struct kv_view w1 = mk(KV_F32, 0, 0, 2, sh1, st1);
    int64_t lo, hi;

    assert_true(overlap_of(&w));
    assert_false(overlap_of(&w1));
    kv_view_extent_bytes(&w, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 40);
}

static void test_view_overlap_two_by_two_unit_strides(void **state)
{
    (void)state;
    const int64_t sh[2] = {2, 2}, st[2] = {1, 1};
    struct kv_view v = mk(KV_U8, 0, 0, 2, sh, st);
    assert_true(overlap_of(&v)); /* (0,1) and (1,0) both reach byte 1 */
}

static void test_view_overlap_even_odd(void **state)
{
    (void)state;
    /* a[::2] vs a[1::2] over a[10] f32 */
    const int64_t sh[1] = {5}, st[1] = {2};
    struct kv_view ev = mk(KV_F32, 0, 0, 1, sh, st);
    struct kv_view od = mk(KV_F32, 0, 1, 1, sh, st);
    bool out = true;

    assert_true(kv_view_may_share(&ev, &od));
    assert_false(shares_of(&ev, &od));
    assert_true(shares_of(&ev, &ev));
    assert_false(overlap_of(&ev));
    /* large: the gcd test must answer without a search */
    {
        const int64_t big[1] = {1000000}, st2[1] = {2};
        struct kv_view a = ev, b = od;
        a.shape[0] = big[0];
        b.shape[0] = big[0];
        a.strides[0] = st2[0];
        b.strides[0] = st2[0];
        a.storage_bytes = b.storage_bytes = (size_t)1 << 30; /* metadata only */
        assert_int_equal(kv_view_shares(&a, &b, 16, &out), KV_OK);
        assert_false(out);
    }
    /* large interleave without a common gcd: bytes 0 mod 3 vs 1,2 mod 3;
     * equal strides merge into one term, so no search either */
    {
        const int64_t ash[1] = {1000000}, ast[1] = {3};
        const int64_t bsh[2] = {1000000, 2}, bst[2] = {3, 1};
        struct kv_view a = mk(KV_U8, 0, 0, 1, ash, ast);
        struct kv_view b = mk(KV_U8, 1, 0, 2, bsh, bst);
        a.storage_bytes = b.storage_bytes = (size_t)1 << 30; /* metadata only */
        out = true;
        assert_int_equal(kv_view_shares(&a, &b, 4, &out), KV_OK);
        assert_false(out);
        b.offset = 2; /* bytes 3,4, 6,7, ...: now they meet at 3 */
        assert_int_equal(kv_view_shares(&a, &b, 4, &out), KV_OK);
        assert_true(out);
    }
}

static void test_view_overlap_interleaved_complex(void **state)
{
    (void)state;
    /* 6 complex f32 numbers [6][2]: re = x[:,0], im = x[:,1], and the same
     * bytes seen as f64 (one complex per element) and as raw bytes. */
    const int64_t sh[1] = {6}, st2[1] = {2}, st1[1] = {1};
    const int64_t bsh[1] = {48}, bst[1] = {1};
    const int64_t ish[1] = {4}, ist[1] = {8};
    struct kv_view re = mk(KV_F32, 16, 0, 1, sh, st2);
    struct kv_view im = mk(KV_F32, 16, 1, 1, sh, st2);
    struct kv_view c64 = mk(KV_F64, 16, 0, 1, sh, st1);
    struct kv_view bytes = mk(KV_U8, 16, 0, 1, bsh, bst);
    /* bytes 4..7 of each complex through a different base pointer */
    struct kv_view imb = mk(KV_U8, 20, 0, 1, ish, ist);
    /* the real parts of complex 3..5 through a base 24 bytes further on */
    const int64_t sh3[1] = {3};
    struct kv_view re_tail = mk(KV_F32, 40, 0, 1, sh3, st2);

    assert_false(shares_of(&re, &im));
    assert_true(kv_view_may_share(&re, &im));
    assert_true(shares_of(&re, &c64));
    assert_true(shares_of(&im, &c64));
    assert_true(shares_of(&bytes, &im));
    assert_true(shares_of(&imb, &im));
    assert_false(shares_of(&imb, &re));
    assert_true(shares_of(&re_tail, &re));
    assert_false(shares_of(&re_tail, &im));
    assert_false(overlap_of(&re));
    assert_false(overlap_of(&c64));
}

static void test_view_overlap_byte_edges(void **state)
{
    (void)state;
    const int64_t one[1] = {1}, st[1] = {1};
    struct kv_view f = mk(KV_F32, 0, 0, 0, NULL, NULL); /* 0-d: bytes 0..3 */
    struct kv_view b3 = mk(KV_U8, 3, 0, 0, NULL, NULL);
    struct kv_view b4 = mk(KV_U8, 4, 0, 0, NULL, NULL);
    struct kv_view h = mk(KV_F16, 2, 0, 1, one, st);    /* bytes 2..3 */
    struct kv_view d = mk(KV_F64, 1, 0, 0, NULL, NULL); /* bytes 1..8 */

    assert_true(shares_of(&f, &b3));
    assert_false(shares_of(&f, &b4));
    assert_false(kv_view_may_share(&f, &b4));
    assert_true(shares_of(&f, &h));
    assert_true(shares_of(&d, &b4));
    assert_true(shares_of(&f, &f));
    assert_false(overlap_of(&f));
    assert_false(overlap_of(&h));
}

static void test_view_overlap_empty_views(void **state)
{
    (void)state;
    const int64_t sh[2] = {0, 4}, st[2] = {0, 0};
    struct kv_view e = mk(KV_F32, 0, 3, 2, sh, st);
    struct kv_view s = mk(KV_F32, 0, 0, 0, NULL, NULL);
    int64_t lo = -1, hi = -1;

    kv_view_extent_bytes(&e, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 0);
    assert_false(overlap_of(&e));
    assert_false(kv_view_may_share(&e, &e));
    assert_false(shares_of(&e, &e));
    assert_false(shares_of(&e, &s));
    kv_view_extent_bytes(&s, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 4);
}

/* kv_view_check refuses negative strides, but the overlap functions take
 * hand-built views and must still answer correctly for them. */
static void test_view_overlap_negative_strides_tolerated(void **state)
{
    (void)state;
    const int64_t sh[1] = {4}, neg[1] = {-1}, pos[1] = {1}, neg2[1] = {-2};
    struct kv_view rev = mk(KV_F32, 0, 3, 1, sh, neg);   /* elements 3,2,1,0 */
    struct kv_view fwd = mk(KV_F32, 0, 0, 1, sh, pos);   /* elements 0..3 */
    struct kv_view rev2 = mk(KV_F32, 0, 7, 1, sh, neg2); /* elements 7,5,3,1 */
    struct kv_view even = fwd;
    int64_t lo, hi;

    even.strides[0] = 2; /* elements 0,2,4,6 */
    kv_view_extent_bytes(&rev, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 16);
    kv_view_extent_bytes(&rev2, &lo, &hi);
    assert_int_equal(lo, 4);
    assert_int_equal(hi, 32);
    assert_false(overlap_of(&rev));
    assert_true(shares_of(&rev, &fwd));
    assert_false(shares_of(&rev2, &even));
    assert_true(kv_view_may_share(&rev2, &even));
    assert_true(shares_of(&rev2, &fwd));
}

/* ---- work bound --------------------------------------------------------- */

static void test_view_overlap_too_costly(void **state)
{
    (void)state;
    /* u8 strides (7,3), sizes 10: overlaps (7*3 == 3*7) but only a search
     * finds it. */
    const int64_t sh[2] = {10, 10}, st[2] = {3, 7};
    struct kv_view v = mk(KV_U8, 0, 0, 2, sh, st);
    /* a: bytes 0,3,6,... (0 or 3 mod 6); b: bytes 2,4, 8,10, ... via another
     * base (2 or 4 mod 6): disjoint, gcd 1, three step sizes, so only a
     * search shows it. */
    const int64_t ash[1] = {200}, ast[1] = {3};
    const int64_t bsh[2] = {200, 2}, bst[2] = {6, 2};
    struct kv_view a = mk(KV_U8, 0, 0, 1, ash, ast);
    struct kv_view b = mk(KV_U8, 2, 0, 2, bsh, bst);
    bool out = true;

    assert_int_equal(kv_view_has_internal_overlap(&v, 1, &out), KV_ERR_TOO_COSTLY);
    assert_true(out); /* untouched */
    assert_non_null(strstr(kv_last_error(), "max_work 1"));
    assert_int_equal(kv_view_has_internal_overlap(&v, 0, &out), KV_OK);
    assert_true(out);
    assert_true(ref_internal_overlap(&v));

    out = true;
    assert_int_equal(kv_view_shares(&a, &b, 10, &out), KV_ERR_TOO_COSTLY);
    assert_true(out); /* untouched */
    assert_non_null(strstr(kv_last_error(), "max_work 10"));
    assert_non_null(strstr(kv_last_error(), "[200,2]"));
    assert_int_equal(kv_view_shares(&a, &b, -5, &out), KV_OK); /* default bound */
    assert_false(out);
    assert_false(ref_shares(&a, &b));
    assert_string_equal(kv_last_error(), "");
    assert_true(kv_view_may_share(&a, &b));
}

/* ---- argument checks ---------------------------------------------------- */

static void test_view_overlap_null_and_bad_args(void **state)
{
    (void)state;
    const int64_t sh[1] = {4}, st[1] = {1};
    struct kv_view v = mk(KV_F32, 0, 0, 1, sh, st);
    struct kv_view bad = v;
    bool out = false;
    int64_t lo = 7, hi = 7;

    assert_int_equal(kv_view_has_internal_overlap(NULL, 0, &out), KV_ERR_NULL);
    assert_non_null(strstr(kv_last_error(), "NULL"));
    assert_int_equal(kv_view_has_internal_overlap(&v, 0, NULL), KV_ERR_NULL);
    assert_non_null(strstr(kv_last_error(), "out"));
    assert_int_equal(kv_view_shares(NULL, &v, 0, &out), KV_ERR_NULL);
    assert_non_null(strstr(kv_last_error(), "view a"));
    assert_int_equal(kv_view_shares(&v, NULL, 0, &out), KV_ERR_NULL);
    assert_non_null(strstr(kv_last_error(), "view b"));
    assert_int_equal(kv_view_shares(&v, &v, 0, NULL), KV_ERR_NULL);
    assert_false(kv_view_may_share(NULL, &v));
    assert_false(kv_view_may_share(&v, NULL));
    kv_view_extent_bytes(NULL, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 0);
    kv_view_extent_bytes(&v, NULL, NULL); /* no crash */

    bad.ndim = 9;
    assert_int_equal(kv_view_has_internal_overlap(&bad, 0, &out), KV_ERR_BAD_DIM);
    assert_non_null(strstr(kv_last_error(), "ndim 9"));
    bad = v;
    bad.shape[0] = -2;
    assert_int_equal(kv_view_shares(&v, &bad, 0, &out), KV_ERR_BAD_SHAPE);
    assert_non_null(strstr(kv_last_error(), "-2"));
    bad = v;
    bad.dtype = KV_DTYPE_COUNT;
    assert_int_equal(kv_view_has_internal_overlap(&bad, 0, &out), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "dtype"));
    bad = v;
    bad.strides[0] = INT64_MAX / 2; /* extent overflows int64 */
    assert_int_equal(kv_view_has_internal_overlap(&bad, 0, &out), KV_ERR_OVERFLOW);
    assert_non_null(strstr(kv_last_error(), "overflow"));
}

/* ---- randomized against brute force ------------------------------------- */

static void test_view_overlap_random_extent_and_internal(void **state)
{
    (void)state;
    int yes = 0, no = 0;
    g_rng = SEED;
    for (int it = 0; it < 20000; it++) {
        struct kv_view v = rand_view();
        int64_t lo, hi, rlo, rhi;
        bool got = false, want = ref_internal_overlap(&v);
        kv_status st = kv_view_has_internal_overlap(&v, 0, &got);
        kv_view_extent_bytes(&v, &lo, &hi);
        ref_extent(&v, &rlo, &rhi);
        if (st != KV_OK || got != want || lo != rlo || hi != rhi) {
            char sh[128], sd[128];
            snprintf(sh, sizeof(sh), "%d:[%lld,%lld,%lld,%lld]", v.ndim, (long long)v.shape[0],
                     (long long)v.shape[1], (long long)v.shape[2], (long long)v.shape[3]);
            snprintf(sd, sizeof(sd), "[%lld,%lld,%lld,%lld] off %lld %s", (long long)v.strides[0],
                     (long long)v.strides[1], (long long)v.strides[2], (long long)v.strides[3],
                     (long long)v.offset, kv_dtype_name(v.dtype));
            fail_msg("iter %d shape %s strides %s: status %d overlap %d want %d extent "
                     "[%lld,%lld) want [%lld,%lld)",
                     it, sh, sd, (int)st, got, want, (long long)lo, (long long)hi, (long long)rlo,
                     (long long)rhi);
        }
        want ? yes++ : no++;
    }
    /* the generator must exercise both answers */
    assert_true(yes > 2000);
    assert_true(no > 2000);
}

static void test_view_overlap_random_pairs(void **state)
{
    (void)state;
    int share_yes = 0, share_no_but_may = 0;
    g_rng = SEED ^ 0x1234;
    for (int it = 0; it < 20000; it++) {
        struct kv_view a = rand_view();
        struct kv_view b = (it & 1) ? rand_view_near(&a) : rand_view();
        bool got = false, want = ref_shares(&a, &b);
        bool may = kv_view_may_share(&a, &b), want_may = ref_may_share(&a, &b);
        kv_status st = kv_view_shares(&a, &b, 0, &got);
        if (st != KV_OK || got != want || may != want_may)
            fail_msg("iter %d: status %d shares %d want %d may %d want %d (%s)", it, (int)st, got,
                     want, may, want_may, kv_last_error());
        if (want)
            assert_true(may); /* shares => may_share */
        share_yes += want;
        share_no_but_may += !want && may;
    }
    assert_true(share_yes > 1000);
    assert_true(share_no_but_may > 500);
}

/* Every view against sub-views of itself built by shifting one index: the
 * hard cases for the search (same strides, different starts). */
static void test_view_overlap_random_shifted_self(void **state)
{
    (void)state;
    int yes = 0, no = 0;
    g_rng = SEED ^ 0xABCDEF;
    for (int it = 0; it < 5000; it++) {
        struct kv_view a = rand_view(), b = a;
        bool got = false, want;
        int64_t eb = (int64_t)kv_dtype_size(a.dtype);
        int64_t lo, hi;
        b.offset = a.offset + rng_range(0, 7);
        ref_extent(&b, &lo, &hi);
        if ((int64_t)((unsigned char *)b.base - g_buf) + b.offset * eb + (hi - lo) > BUF_BYTES)
            continue;
        want = ref_shares(&a, &b);
        assert_int_equal(kv_view_shares(&a, &b, 0, &got), KV_OK);
        if (got != want)
            fail_msg("iter %d: shares %d want %d", it, got, want);
        want ? yes++ : no++;
    }
    assert_true(yes > 100);
    assert_true(no > 100);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_view_overlap_contiguous_and_transpose),
        cmocka_unit_test(test_view_overlap_expand_and_stride0),
        cmocka_unit_test(test_view_overlap_sliding_window),
        cmocka_unit_test(test_view_overlap_two_by_two_unit_strides),
        cmocka_unit_test(test_view_overlap_even_odd),
        cmocka_unit_test(test_view_overlap_interleaved_complex),
        cmocka_unit_test(test_view_overlap_byte_edges),
        cmocka_unit_test(test_view_overlap_empty_views),
        cmocka_unit_test(test_view_overlap_negative_strides_tolerated),
        cmocka_unit_test(test_view_overlap_too_costly),
        cmocka_unit_test(test_view_overlap_null_and_bad_args),
        cmocka_unit_test(test_view_overlap_random_extent_and_internal),
        cmocka_unit_test(test_view_overlap_random_pairs),
        cmocka_unit_test(test_view_overlap_random_shifted_self),
    };
    return cmocka_run_group_tests_name("view_overlap", tests, NULL, NULL);
}
