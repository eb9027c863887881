/*
 * test_view_index.c - the shared CPU/GPU addressing header and the host-side
 * validation of kv_view_copy_cuda (which runs here without a GPU).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_view_index.h"
#include "kvtest.h"

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
 * CUDA call, so these hold with or without a GPU. */
static void test_view_index_cuda_copy_validation(void **state)
{
    static char buf[4096];
    struct kv_view a, b, c;
    int64_t s1[2] = {4, 8}, s2[2] = {8, 4}, e[3] = {2, 4, 8};
    (void)state;
    assert_int_equal(kv_view_init(buf, 1024, KV_F32, 2, s1, &a), KV_OK);
    assert_int_equal(kv_view_init(buf + 2048, 1024, KV_F32, 2, s2, &b), KV_OK);
    assert_int_equal(kv_view_copy_cuda(&a, NULL, NULL), KV_ERR_NULL);
    assert_int_equal(kv_view_copy_cuda(&a, &b, NULL), KV_ERR_BAD_SHAPE);
    assert_non_null(strstr(kv_last_error(), "dim 0 differs (dst 8, src 4)"));
    assert_int_equal(kv_view_expand(&a, 3, e, &c), KV_OK);
    assert_int_equal(kv_view_init(buf + 2048, 2048, KV_F32, 3, e, &b), KV_OK);
    assert_int_equal(kv_view_copy_cuda(&b, &c, NULL), KV_ERR_OVERLAP); /* stride-0 dst */
    b.dtype = KV_F16;
    assert_int_equal(kv_view_copy_cuda(&b, &a, NULL), KV_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_view_index_matches_offset_of),
        cmocka_unit_test(test_view_index_64bit),
        cmocka_unit_test(test_view_index_cuda_copy_validation),
    };
    return cmocka_run_group_tests_name("view_index", tests, NULL, NULL);
}
