/*
 * test_view_index.c - the shared CPU/GPU addressing header and the host-side
 * validation of kv_view_copy_cuda (which runs here without a GPU).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_view_hd.h"
#include "kvtest.h"

static int cmp_pair(const void *x, const void *y)
{
    const int64_t *a = x, *b = y;
    return a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1] < b[1] ? -1 : a[1] > b[1];
}

static struct kv_view_geom geom_of(const struct kv_view *v)
{
    struct kv_view_geom g;
    memset(&g, 0, sizeof(g));
    g.ndim = v->ndim;
    for (int i = 0; i < v->ndim; i++) {
        g.shape[i] = v->shape[i];
        g.strides[i] = v->strides[i];
    }
    g.offset = v->offset;
    return g;
}

/* Random permuted / sliced / offset views: the linear -> offset map of the
 * shared header equals the odometer walk through kv_view_offset_of. */
static void test_view_index_matches_offset_of(void **state)
{
    static char storage[1 << 16];
    uint64_t rng = 42;
    (void)state;
    for (int iter = 0; iter < 2000; iter++) {
        struct kv_view v;
        int ndim = (int)kvt_range(&rng, 1, 5), perm[8];
        int64_t shape[8], idx[8] = {0}, n;
        for (int i = 0; i < ndim; i++)
            shape[i] = kvt_range(&rng, 1, 6);
        assert_int_equal(kv_view_init(storage, sizeof(storage), KV_BF16, ndim, shape, &v), KV_OK);
        for (int i = 0; i < ndim; i++)
            perm[i] = i;
        for (int i = ndim - 1; i > 0; i--) {
            int j = (int)kvt_range(&rng, 0, i), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        assert_int_equal(kv_view_permute(&v, perm, ndim, &v), KV_OK);
        {
            int d = (int)kvt_range(&rng, 0, ndim - 1);
            int64_t start = kvt_range(&rng, 0, v.shape[d] - 1);
            assert_int_equal(kv_view_slice(&v, d, start, v.shape[d], kvt_range(&rng, 1, 3), &v),
                             KV_OK);
        }
        {
            struct kv_view_geom g = geom_of(&v);
            n = kv_view_numel(&v);
            for (int64_t lin = 0; lin < n; lin++) {
                int64_t want;
                assert_int_equal(kv_view_offset_of(&v, idx, &want), KV_OK);
                assert_int_equal(kv_geom_offset_of_linear(&g, lin), want);
                for (int k = v.ndim - 1; k >= 0; k--) {
                    if (++idx[k] < v.shape[k])
                        break;
                    idx[k] = 0;
                }
            }
        }
    }
}

static void test_view_index_64bit(void **state)
{
    /* [2^20 blocks][16][8][128]: the last element sits past 2^31. */
    struct kv_view_geom g = {4, {1 << 20, 16, 8, 128}, {16 * 8 * 128, 8 * 128, 128, 1}, 7};
    int64_t last = ((int64_t)1 << 20) * 16 * 8 * 128 - 1;
    (void)state;
    assert_true(kv_geom_offset_of_linear(&g, last) == last + 7);
    assert_true(kv_geom_offset_of_linear(&g, last) > ((int64_t)1 << 31));
}

/* Host-side validation of the device copy: bad input is refused before any
 * CUDA call, so these hold with or without a GPU; and it is the CPU copy's
 * validator, so status and message match kv_view_copy's word for word. */
static void expect_same_refusal(const struct kv_view *src, const struct kv_view *dst,
                                kv_status want)
{
    char cpu[1024], gpu[1024];
    kv_status a = kv_view_copy(src, dst);
    snprintf(cpu, sizeof(cpu), "%s", kv_last_error());
    kv_status b = kv_view_copy_cuda(src, dst, NULL);
    snprintf(gpu, sizeof(gpu), "%s", kv_last_error());
    assert_int_equal(a, want);
    assert_int_equal(b, want);
    /* same text once the function names are aligned */
    const char *c = strstr(cpu, "kv_view_copy: "), *g = strstr(gpu, "kv_view_copy_cuda: ");
    assert_non_null(c);
    assert_non_null(g);
    assert_string_equal(c + strlen("kv_view_copy: "), g + strlen("kv_view_copy_cuda: "));
}

static void test_view_index_cuda_copy_validation(void **state)
{
    static char buf[4096];
    struct kv_view a, b, c;
    int64_t s1[2] = {4, 8}, s2[2] = {8, 4}, e[3] = {2, 4, 8};
    (void)state;
    assert_int_equal(kv_view_init(buf, 1024, KV_F32, 2, s1, &a), KV_OK);
    assert_int_equal(kv_view_init(buf + 2048, 1024, KV_F32, 2, s2, &b), KV_OK);
    assert_int_equal(kv_view_copy_cuda(&a, NULL, NULL), KV_ERR_NULL);
    expect_same_refusal(&a, &b, KV_ERR_BAD_SHAPE);
    assert_non_null(strstr(kv_last_error(), "src shape [4,8] != dst shape [8,4]"));
    assert_int_equal(kv_view_expand(&a, 3, e, &c), KV_OK);
    assert_int_equal(kv_view_init(buf + 2048, 2048, KV_F32, 3, e, &b), KV_OK);
    expect_same_refusal(&b, &c, KV_ERR_OVERLAP); /* stride-0 dst */
    b.dtype = KV_F16;
    expect_same_refusal(&a, &b, KV_ERR_BAD_SHAPE);
    assert_int_equal(kv_view_init(buf + 2048, 1024, KV_F16, 2, s1, &b), KV_OK);
    expect_same_refusal(&a, &b, KV_ERR_INVALID_ARG); /* dtypes differ */
    /* dst overlapping src */
    assert_int_equal(kv_view_init(buf + 64, 1024, KV_F32, 2, s1, &b), KV_OK);
    expect_same_refusal(&a, &b, KV_ERR_OVERLAP);
    /* a hand-built dst reaching past its storage */
    assert_int_equal(kv_view_init(buf + 2048, 1024, KV_F32, 2, s1, &b), KV_OK);
    b.strides[0] = 1000;
    expect_same_refusal(&a, &b, KV_ERR_OUT_OF_BOUNDS);
}

/* A valid copy: KV_OK where a GPU exists; otherwise refused with a reason
 * that says which (no CUDA in the build, or no usable device), and never
 * KV_ERR_DEVICE (that is for a failed launch on a real device). */
static void test_view_index_cuda_copy_without_gpu(void **state)
{
    static char buf[4096];
    struct kv_view a, b;
    int64_t s1[2] = {4, 8};
    (void)state;
    assert_int_equal(kv_view_init(buf, 1024, KV_F32, 2, s1, &a), KV_OK);
    assert_int_equal(kv_view_init(buf + 2048, 1024, KV_F32, 2, s1, &b), KV_OK);
    kv_status st = kv_view_copy_cuda(&a, &b, NULL);
    if (!KV_HAVE_CUDA) {
        assert_int_equal(st, KV_ERR_UNSUPPORTED);
        assert_non_null(strstr(kv_last_error(), "this build has no CUDA"));
    } else if (st != KV_OK) {
        assert_int_equal(st, KV_ERR_UNSUPPORTED);
        assert_non_null(strstr(kv_last_error(), "no usable CUDA device"));
    }
}

/* The shared plan, executed here by a plain loop over its rows, moves every
 * element where the view formula says: compared with kv_geom_offset_of_linear
 * over random permuted, sliced, offset views on both sides. */
static void test_view_index_plan_matches_formula(void **state)
{
    uint64_t rng = 7;
    (void)state;
    for (int iter = 0; iter < 3000; iter++) {
        int ndim = (int)kvt_range(&rng, 0, 5), perm[8];
        int64_t shape[8];
        struct kv_view_geom sg = {ndim, {0}, {0}, 0}, dg = {ndim, {0}, {0}, 0};
        for (int i = 0; i < ndim; i++)
            shape[i] = kvt_range(&rng, 1, 5);
        /* dst: C-contiguous with padding, at an offset; src: a permutation of
         * a contiguous tensor, sliced with a step, at an offset */
        int64_t st = 1;
        for (int i = ndim - 1; i >= 0; i--) {
            dg.shape[i] = shape[i];
            dg.strides[i] = st;
            st *= shape[i] + (kvt_range(&rng, 0, 3) == 0);
        }
        dg.offset = kvt_range(&rng, 0, 9);
        for (int i = 0; i < ndim; i++)
            perm[i] = i;
        for (int i = ndim - 1; i > 0; i--) {
            int j = (int)kvt_range(&rng, 0, i), t = perm[i];
            perm[i] = perm[j], perm[j] = t;
        }
        int64_t ps[8], step[8];
        st = 1;
        for (int i = ndim - 1; i >= 0; i--) {
            step[i] = kvt_range(&rng, 1, 2);
            ps[i] = st;
            st *= shape[perm[i]] * step[i];
        }
        for (int i = 0; i < ndim; i++) {
            int k = 0; /* dim i of the view is dim k of the permuted base */
            sg.shape[i] = shape[i];
            while (perm[k] != i)
                k++;
            sg.strides[i] = ps[k] * step[k];
        }
        sg.offset = kvt_range(&rng, 0, 9);
        int32_t esz = (int32_t)(1 << kvt_range(&rng, 0, 3));
        struct kv_copy_plan p;
        int64_t numel = 1;
        for (int i = 0; i < ndim; i++)
            numel *= shape[i];
        assert_int_equal(kv_copy_plan_build(&p, &sg, &dg, esz), 1);
        assert_int_equal(p.rows * p.row_elems, numel);
        assert_true(p.ndim <= ndim);
        for (int k = 0; k < p.ndim; k++)
            assert_true(p.shape[k] >= 2);
        /* every (src, dst) byte pair the plan visits, in its order, is the
         * pair the formula gives for some linear index: compare as sets by
         * sorting on the dst offset (dst has no internal overlap) */
        int64_t *want = malloc((size_t)numel * 2 * sizeof(int64_t));
        int64_t *got = malloc((size_t)numel * 2 * sizeof(int64_t));
        assert_non_null(want);
        assert_non_null(got);
        for (int64_t lin = 0; lin < numel; lin++) {
            want[2 * lin] = kv_geom_offset_of_linear(&dg, lin) * esz;
            want[2 * lin + 1] = kv_geom_offset_of_linear(&sg, lin) * esz;
        }
        int64_t n = 0;
        for (int64_t r = 0; r < p.rows; r++) {
            int64_t so, d;
            kv_copy_plan_row(&p, r, &so, &d);
            for (int64_t i = 0; i < p.row_elems; i++, n++) {
                got[2 * n] = d + i * kv_copy_plan_dst_step(&p);
                got[2 * n + 1] = so + i * kv_copy_plan_src_step(&p);
            }
        }
        assert_int_equal(n, numel);
        qsort(want, (size_t)numel, 2 * sizeof(int64_t), cmp_pair);
        qsort(got, (size_t)numel, 2 * sizeof(int64_t), cmp_pair);
        assert_memory_equal(want, got, (size_t)numel * 2 * sizeof(int64_t));
        free(want);
        free(got);
    }
    /* nothing to copy */
    struct kv_view_geom e = {2, {3, 0}, {1, 1}, 0};
    struct kv_copy_plan p;
    assert_int_equal(kv_copy_plan_build(&p, &e, &e, 4), 0);
}

/* The vector width of the device's contiguous path: the widest of 16/8/4/2/1
 * bytes that keeps every access aligned, 0 for rows that are not contiguous. */
static void test_view_index_vector_width(void **state)
{
    (void)state;
    /* [blocks 4][heads 8][128] bf16, both contiguous: one run of 8 KiB */
    struct kv_view_geom a = {3, {4, 8, 128}, {8 * 128, 128, 1}, 0};
    struct kv_copy_plan p;
    assert_int_equal(kv_copy_plan_build(&p, &a, &a, 2), 1);
    assert_int_equal(p.ndim, 1);
    assert_int_equal(kv_copy_plan_vector_bytes(&p, 0x10000, 0x20000), 16);
    assert_int_equal(kv_copy_plan_vector_bytes(&p, 0x10008, 0x20000), 8); /* base */
    assert_int_equal(kv_copy_plan_vector_bytes(&p, 0x10000, 0x20002), 2);
    /* NHD src -> HND dst: rows of D=128 contiguous on both sides, outer strides
     * 256 B: 16-byte vectors */
    struct kv_view_geom s = {3, {4, 8, 128}, {16 * 8 * 128, 128, 1}, 0};
    struct kv_view_geom d = {3, {4, 8, 128}, {8 * 128, 16 * 128, 1}, 0};
    s.shape[0] = d.shape[0] = 16;
    assert_int_equal(kv_copy_plan_build(&p, &s, &d, 2), 1);
    assert_int_equal(p.row_elems, 128);
    assert_int_equal(kv_copy_plan_vector_bytes(&p, 0, 0), 16);
    /* an odd head dim (D = 3, f32): 12-byte rows -> 4-byte vectors */
    struct kv_view_geom o = {2, {5, 3}, {4, 1}, 1};
    struct kv_view_geom od = {2, {5, 3}, {3, 1}, 0};
    assert_int_equal(kv_copy_plan_build(&p, &o, &od, 4), 1);
    assert_int_equal(kv_copy_plan_vector_bytes(&p, 0, 0), 4);
    /* a transposed src: rows not contiguous -> the strided path */
    struct kv_view_geom t = {2, {8, 8}, {1, 8}, 0};
    struct kv_view_geom td = {2, {8, 8}, {8, 1}, 0};
    assert_int_equal(kv_copy_plan_build(&p, &t, &td, 4), 1);
    assert_int_equal(kv_copy_plan_vector_bytes(&p, 0, 0), 0);
    assert_int_equal(kv_copy_plan_src_step(&p), 32);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_view_index_matches_offset_of),
        cmocka_unit_test(test_view_index_64bit),
        cmocka_unit_test(test_view_index_cuda_copy_validation),
        cmocka_unit_test(test_view_index_cuda_copy_without_gpu),
        cmocka_unit_test(test_view_index_plan_matches_formula),
        cmocka_unit_test(test_view_index_vector_width),
    };
    return cmocka_run_group_tests_name("view_index", tests, NULL, NULL);
}
