/*
 * test_xport_frame.c - the TCP frame header: round trips of every field at
 * its documented offset, every byte flipped is refused (and the frame left
 * as it was), the version mismatch named (kv_transport.h's version against
 * the next), the range check (kv_wire.h's) at its edges and past 2^64.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_lib.h"
#include "kv_xport_frame_int.h"

/* The version is kv_transport.h's KV_XPORT_PROTOCOL_VERSION, the one
 * definition the frame codec speaks (it has no fallback of its own). */
static const struct kv__xf sample = {.version = KV_XPORT_PROTOCOL_VERSION,
                                     .type = KV__XF_WRITE,
                                     .flags = 0,
                                     .entry = 17,
                                     .xfer = 0x1122334455667788ull,
                                     .region = 9,
                                     .conn = 3,
                                     .offset = 0x0102030405060708ull,
                                     .length = 4096,
                                     .payload_sum = 0xCAFEF00DBEEF1234ull};

static void test_frame_round_trip_and_offsets(void **state)
{
    (void)state;
    unsigned char b[KV__XF_BYTES];
    kv__xf_encode(&sample, b);
    assert_memory_equal(b, "KVXF", 4);
    assert_int_equal(b[6], KV__XF_WRITE); /* type at 6 */
    assert_int_equal(b[12], 17);          /* entry at 12 */
    assert_int_equal(b[16], 0x88);        /* xfer at 16, little-endian */
    assert_int_equal(b[23], 0x11);
    assert_int_equal(b[24], 9);    /* region at 24 */
    assert_int_equal(b[32], 0x08); /* offset at 32 */
    assert_int_equal(b[41], 0x10); /* length 4096 at 40 */
    struct kv__xf f;
    memset(&f, 0, sizeof(f));
    assert_int_equal(kv__xf_decode(b, &f), KV_OK);
    /* field by field: the padding after entry (bytes 12..15) holds whatever
     * the decoder's stack did */
    assert_int_equal(f.version, sample.version);
    assert_int_equal(f.type, sample.type);
    assert_int_equal(f.flags, sample.flags);
    assert_int_equal(f.entry, sample.entry);
    assert_int_equal(f.xfer, sample.xfer);
    assert_int_equal(f.region, sample.region);
    assert_int_equal(f.conn, sample.conn);
    assert_int_equal(f.offset, sample.offset);
    assert_int_equal(f.length, sample.length);
    assert_int_equal(f.payload_sum, sample.payload_sum);
}

static void test_frame_every_byte_flipped_is_refused(void **state)
{
    (void)state;
    unsigned char b[KV__XF_BYTES];
    kv__xf_encode(&sample, b);
    for (int i = 0; i < KV__XF_BYTES; i++)
        for (int bit = 0; bit < 8; bit++) {
            unsigned char c[KV__XF_BYTES];
            memcpy(c, b, sizeof(c));
            c[i] ^= (unsigned char)(1u << bit);
            struct kv__xf f = {.entry = 0xABCD};
            const kv_status st = kv__xf_decode(c, &f);
            assert_int_equal(st, KV_ERR_CORRUPT);
            assert_int_equal(f.entry, 0xABCD); /* untouched */
        }
}

static void test_frame_field_checks(void **state)
{
    (void)state;
    unsigned char b[KV__XF_BYTES];
    struct kv__xf f, x = sample;
    x.version = KV_XPORT_PROTOCOL_VERSION + 1;
    kv__xf_encode(&x, b);
    assert_int_equal(kv__xf_decode(b, &f), KV_ERR_MISMATCH);
    char want[80];
    snprintf(want, sizeof(want), "protocol version %u, this library speaks %u",
             KV_XPORT_PROTOCOL_VERSION + 1, KV_XPORT_PROTOCOL_VERSION);
    assert_non_null(strstr(kv_last_error(), want));
    x = sample;
    x.type = 99;
    kv__xf_encode(&x, b);
    assert_int_equal(kv__xf_decode(b, &f), KV_ERR_CORRUPT);
    assert_non_null(strstr(kv_last_error(), "type 99"));
    x = sample;
    x.flags = 4;
    kv__xf_encode(&x, b);
    assert_int_equal(kv__xf_decode(b, &f), KV_ERR_CORRUPT);
    x = sample;
    x.length = KV__XF_MAX_PAYLOAD + 1;
    kv__xf_encode(&x, b);
    assert_int_equal(kv__xf_decode(b, &f), KV_ERR_CORRUPT);
    x = sample;
    x.length = 0;
    kv__xf_encode(&x, b);
    assert_int_equal(kv__xf_decode(b, &f), KV_ERR_CORRUPT); /* a sum without payload */
    x.payload_sum = 0;
    kv__xf_encode(&x, b);
    assert_int_equal(kv__xf_decode(b, &f), KV_OK);
}

static void test_frame_range_check(void **state)
{
    (void)state;
    assert_true(kv__range_ok(4096, 0, 4096));
    assert_true(kv__range_ok(4096, 4096, 0));
    assert_true(kv__range_ok(4096, 100, 3996));
    assert_false(kv__range_ok(4096, 100, 3997));
    assert_false(kv__range_ok(4096, 4097, 0));
    assert_false(kv__range_ok(4096, UINT64_MAX, 2)); /* would wrap */
    assert_false(kv__range_ok(4096, 2, UINT64_MAX));
    assert_false(kv__range_ok(0, 0, 1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_frame_round_trip_and_offsets),
        cmocka_unit_test(test_frame_every_byte_flipped_is_refused),
        cmocka_unit_test(test_frame_field_checks),
        cmocka_unit_test(test_frame_range_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
