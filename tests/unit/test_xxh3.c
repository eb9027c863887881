/*
 * test_xxh3.c - kv__xxh3_* (kvcache/kv_xxh3.c): the XXH3-64 of libxxhash's
 * x86 dispatcher (SSE2, AVX2 or AVX-512, as the CPU has them) equals
 * libxxhash's plain XXH3_64bits (built for the x86-64 baseline: SSE2) for
 * every length 0..4,200 (all of XXH3's size branches: 0-16, 17-128,
 * 129-240, the long loop and its stripes and blocks), for the lengths at
 * each branch's edges at all 64 alignments, for 1 MiB and 3 MiB + 5
 * buffers at odd alignments, and streaming with random split points
 * equals one shot.
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
#if defined(__x86_64__)
    __builtin_cpu_init();
    print_message("xxh3: libxxhash's dispatcher on a CPU with avx2 %s, avx512f %s\n",
                  __builtin_cpu_supports("avx2") ? "yes" : "no",
                  __builtin_cpu_supports("avx512f") ? "yes" : "no");
#endif
    for (size_t n = 0; n <= 4200; n++) {
        const unsigned char *p = buf + (n % 7); /* odd alignments too */
        if (kv__xxh3_64(p, n) != XXH3_64bits(p, n))
            fail_msg("length %zu: 0x%016llx, libxxhash 0x%016llx", n,
                     (unsigned long long)kv__xxh3_64(p, n), (unsigned long long)XXH3_64bits(p, n));
    }
    /* each size branch's edges, the stripe (64) and block (1,024) edges of
     * the long loop, at every alignment of a cache line */
    static const size_t edges[] = {0,    1,    3,    4,    8,    9,     16,    17,   128,  129,
                                   240,  241,  255,  256,  257,  319,   320,   1023, 1024, 1025,
                                   1088, 2047, 2048, 2049, 4096, 65535, 65536, 65537};
    for (size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); e++)
        for (size_t a = 0; a < 64; a++) {
            const unsigned char *p = buf + a;
            if (kv__xxh3_64(p, edges[e]) != XXH3_64bits(p, edges[e]))
                fail_msg("length %zu at alignment %zu: 0x%016llx, libxxhash 0x%016llx", edges[e], a,
                         (unsigned long long)kv__xxh3_64(p, edges[e]),
                         (unsigned long long)XXH3_64bits(p, edges[e]));
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
