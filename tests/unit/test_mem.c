/*
 * test_mem.c - kvcache/kv_mem.h's kv__mem_grow, the one grow-by-doubling of
 * the library's arrays: the capacity it picks (first, then doubling, a
 * jump when doubling falls short), the used elements moved and nothing
 * else required, the same array back when it already fits, and a refused
 * capacity (elem * cap past SIZE_MAX) changing nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kv_mem.h"

static void test_mem_grow_first_then_doubling(void **state)
{
    (void)state;
    size_t cap = 0;
    uint32_t *a = kv__mem_grow(NULL, &cap, 0, 1, sizeof(*a), 8);
    assert_non_null(a);
    assert_int_equal(cap, 8);
    /* the capacities an array appended to one by one goes through */
    static const size_t want[] = {8, 16, 32, 64, 128, 256, 512, 1024};
    size_t k = 0;
    for (uint32_t n = 0; n < 1000; n++) {
        if (n == cap) {
            uint32_t *b = kv__mem_grow(a, &cap, n, (size_t)n + 1, sizeof(*b), 8);
            assert_non_null(b);
            a = b;
            k++;
        }
        assert_int_equal(cap, want[k]);
        a[n] = n * 2654435761u;
    }
    for (uint32_t n = 0; n < 1000; n++) /* every element moved each time */
        assert_int_equal(a[n], n * 2654435761u);
    kv__mem_free(a);
}

static void test_mem_grow_jumps_to_need(void **state)
{
    (void)state;
    size_t cap = 0;
    unsigned char *a = kv__mem_grow(NULL, &cap, 0, 5000, 1, 4096);
    assert_non_null(a);
    assert_int_equal(cap, 8192); /* 4096 doubled once */
    memset(a, 0x5A, 100);
    a = kv__mem_grow(a, &cap, 100, 100000, 1, 4096);
    assert_non_null(a);
    assert_int_equal(cap, 131072); /* 8192 doubled until it holds 100,000 */
    for (int i = 0; i < 100; i++)
        assert_int_equal(a[i], 0x5A);
    kv__mem_free(a);
}

static void test_mem_grow_fits_already(void **state)
{
    (void)state;
    size_t cap = 0;
    void *a = kv__mem_grow(NULL, &cap, 0, 3, 24, 4);
    assert_non_null(a);
    assert_int_equal(cap, 4);
    for (size_t need = 1; need <= 4; need++) {
        assert_ptr_equal(kv__mem_grow(a, &cap, 2, need, 24, 4), a);
        assert_int_equal(cap, 4);
    }
    kv__mem_free(a);
}

static void test_mem_grow_overflow_changes_nothing(void **state)
{
    (void)state;
    size_t cap = 0;
    uint64_t *a = kv__mem_grow(NULL, &cap, 0, 2, sizeof(*a), 2);
    assert_non_null(a);
    a[0] = 7;
    a[1] = 9;
    /* (SIZE_MAX / 8 + 1) * 8 bytes wraps: refused before any allocation */
    assert_null(kv__mem_grow(a, &cap, 2, SIZE_MAX / 8 + 1, sizeof(*a), 2));
    assert_int_equal(cap, 2);
    assert_int_equal(a[0], 7); /* still the caller's, still valid */
    assert_int_equal(a[1], 9);
    /* doubling past SIZE_MAX / 2 takes need itself; 2 bytes a piece wraps */
    assert_null(kv__mem_grow(a, &cap, 2, SIZE_MAX, 2, 2));
    assert_int_equal(cap, 2);
    assert_int_equal(a[1], 9);
    kv__mem_free(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mem_grow_first_then_doubling),
        cmocka_unit_test(test_mem_grow_jumps_to_need),
        cmocka_unit_test(test_mem_grow_fits_already),
        cmocka_unit_test(test_mem_grow_overflow_changes_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
