/*
 * test_wire.c - kvcache/kv_wire.h, the one copy of the wire helpers: the
 * byte order pinned against hand-written bytes, round trips of every width
 * at every misalignment, no byte written outside [p, p + n), and the range
 * check at its edges and past 2^64.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kv_wire.h"

static void test_wire_byte_order_pinned(void **state)
{
    (void)state;
    unsigned char b[8];
    kv__le_put64(b, 0x0102030405060708ull);
    static const unsigned char w64[8] = {8, 7, 6, 5, 4, 3, 2, 1};
    assert_memory_equal(b, w64, 8);
    kv__le_put32(b, 0xA1B2C3D4u);
    static const unsigned char w32[4] = {0xD4, 0xC3, 0xB2, 0xA1};
    assert_memory_equal(b, w32, 4);
    kv__le_put16(b, 0xBEEF);
    assert_int_equal(b[0], 0xEF);
    assert_int_equal(b[1], 0xBE);
    static const unsigned char r[8] = {0xF0, 0xDE, 0xBC, 0x9A, 0x78, 0x56, 0x34, 0x12};
    assert_true(kv__le_get64(r) == 0x123456789ABCDEF0ull);
    assert_int_equal(kv__le_get32(r), 0x9ABCDEF0u);
    assert_int_equal(kv__le_get16(r), 0xDEF0);
    assert_true(kv__le_get(r, 3) == 0xBCDEF0u);
    assert_true(kv__le_get(r, 0) == 0);
}

static void test_wire_round_trip_every_width_and_alignment(void **state)
{
    (void)state;
    const uint64_t v = 0xFEDCBA9876543210ull;
    for (int n = 0; n <= 8; n++)
        for (int at = 0; at < 8; at++) {
            unsigned char b[24];
            memset(b, 0x5A, sizeof(b));
            kv__le_put(b + at, v, n);
            const uint64_t mask = n == 8 ? UINT64_MAX : (((uint64_t)1 << (8 * n)) - 1);
            assert_true(kv__le_get(b + at, n) == (v & mask));
            for (int i = 0; i < (int)sizeof(b); i++) /* nothing outside [at, at + n) */
                if (i < at || i >= at + n)
                    assert_int_equal(b[i], 0x5A);
        }
    unsigned char b[11];
    kv__le_put16(b + 1, 0x1234);
    kv__le_put32(b + 3, 0x89ABCDEFu);
    kv__le_put64(b + 3, kv__le_get64(b + 3)); /* reads back what it wrote */
    assert_int_equal(kv__le_get16(b + 1), 0x1234);
    assert_int_equal(kv__le_get32(b + 3), 0x89ABCDEFu);
}

static void test_wire_range_check(void **state)
{
    (void)state;
    assert_true(kv__range_ok(4096, 0, 4096));
    assert_true(kv__range_ok(4096, 4096, 0));
    assert_true(kv__range_ok(4096, 100, 3996));
    assert_true(kv__range_ok(0, 0, 0));
    assert_true(kv__range_ok(UINT64_MAX, UINT64_MAX, 0));
    assert_true(kv__range_ok(UINT64_MAX, 1, UINT64_MAX - 1));
    assert_false(kv__range_ok(4096, 100, 3997));
    assert_false(kv__range_ok(4096, 4097, 0));
    assert_false(kv__range_ok(4096, UINT64_MAX, 2)); /* offset + len wraps to 1 */
    assert_false(kv__range_ok(4096, 2, UINT64_MAX)); /* wraps to 1 */
    assert_false(kv__range_ok(0, 0, 1));
    assert_false(kv__range_ok(UINT64_MAX, 1, UINT64_MAX));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_byte_order_pinned),
        cmocka_unit_test(test_wire_round_trip_every_width_and_alignment),
        cmocka_unit_test(test_wire_range_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
