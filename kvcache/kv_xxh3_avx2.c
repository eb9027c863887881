/*
 * kv_xxh3_avx2.c - XXH3-64 compiled for AVX2 (kv_xxh3.c dispatches here on
 * CPUs that have it). Debian's libxxhash is built for the x86-64 baseline,
 * whose SSE2 XXH3 runs at a third of the AVX2 one; the hash values are the
 * same (the vector paths of XXH3 are bit-identical by design). xxHash is
 * inlined here in a private namespace (XXH_INLINE_ALL), so nothing clashes
 * with the library's symbols.
 */
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif

#include <immintrin.h> /* xxhash.h includes it only under __AVX2__, which clang's
                          attribute does not define */
#include <stddef.h>
#include <stdint.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#define XXH_VECTOR 2 /* XXH_AVX2 */
#include <xxhash.h>

uint64_t kv__xxh3_64_avx2(const void *p, size_t n);
void kv__xxh3_reset_avx2(void *st);
void kv__xxh3_update_avx2(void *st, const void *p, size_t n);
uint64_t kv__xxh3_digest_avx2(const void *st);

uint64_t kv__xxh3_64_avx2(const void *p, size_t n)
{
    return XXH3_64bits(p, n);
}

void kv__xxh3_reset_avx2(void *st)
{
    XXH3_INITSTATE((XXH3_state_t *)st);
    (void)XXH3_64bits_reset((XXH3_state_t *)st);
}

void kv__xxh3_update_avx2(void *st, const void *p, size_t n)
{
    (void)XXH3_64bits_update((XXH3_state_t *)st, p, n);
}

uint64_t kv__xxh3_digest_avx2(const void *st)
{
    return XXH3_64bits_digest((const XXH3_state_t *)st);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* __x86_64__ */
