/*
 * test_xxh3.c - kv__xxh3_* (kvcache/kv_xxh3.c): the dispatched XXH3-64
 * (AVX2 where the CPU has it) equals libxxhash's for every length 0..4,200
 * (all of XXH3's size branches: 0-16, 17-128, 129-240, the long loop and
 * its stripes and blocks), for 1 MiB and 3 MiB + 5 buffers at odd
 * alignments, and streaming with random split points equals one shot.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include "kv_lib.h"
#include "kvtest.h"

static void test_xxh3_matches_libxxhash(void **state)
{
    (void)state;
    const size_t big = ((size_t)3 << 20) + 5;
    unsigned char *buf = malloc(big + 64);
    assert_non_null(buf);
    uint64_t rng = 0x5EED;
    for (size_t i = 0; i < big + 64; i++)
        buf[i] = (unsigned char)kvt_rand(&rng);
    print_message("xxh3: %s code\n", kv__xxh3_is_avx2() ? "AVX2" : "portable");
    for (size_t n = 0; n <= 4200; n++) {
        const unsigned char *p = buf + (n % 7); /* odd alignments too */
        if (kv__xxh3_64(p, n) != XXH3_64bits(p, n))
            fail_msg("length %zu: 0x%016llx, libxxhash 0x%016llx", n,
                     (unsigned long long)kv__xxh3_64(p, n), (unsigned long long)XXH3_64bits(p, n));
    }
    const size_t sizes[3] = {(size_t)1 << 20, big, 65536 + 3};
    for (int k = 0; k < 3; k++) {
        const unsigned char *p = buf + k;
        const uint64_t want = XXH3_64bits(p, sizes[k]);
        assert_int_equal(kv__xxh3_64(p, sizes[k]), want);
        for (int rep = 0; rep < 20; rep++) { /* streaming, random pieces */
            struct kv__xxh3_state s;
            kv__xxh3_reset(&s);
            size_t at = 0;
            while (at < sizes[k]) {
                size_t piece = (size_t)kvt_range(&rng, 0, rep < 10 ? 300 : 70000);
                if (piece > sizes[k] - at)
                    piece = sizes[k] - at;
                kv__xxh3_update(&s, p + at, piece);
                at += piece;
            }
            assert_int_equal(kv__xxh3_digest(&s), want);
        }
    }
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xxh3_matches_libxxhash),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
