/*
 * kv_xxh3.c - XXH3-64 for the bulk checksums (kv_lib.h): libxxhash's
 * portable code, or its AVX2 build (kv_xxh3_avx2.c) where the CPU and the
 * OS support AVX2, chosen once. Both give the same values.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "kv_lib.h"

_Static_assert(sizeof(XXH3_state_t) <= sizeof(struct kv__xxh3_state),
               "kv__xxh3_state too small for XXH3_state_t");
_Static_assert(_Alignof(XXH3_state_t) <= 64, "XXH3_state_t alignment above 64");

#if defined(__x86_64__)
#include <cpuid.h>

uint64_t kv__xxh3_64_avx2(const void *p, size_t n);
void kv__xxh3_reset_avx2(void *st);
void kv__xxh3_update_avx2(void *st, const void *p, size_t n);
uint64_t kv__xxh3_digest_avx2(const void *st);

/* AVX2 in CPUID leaf 7 and YMM state enabled by the OS (OSXSAVE, XCR0). */
static bool cpu_avx2(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))
        return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6u) != 6u)
        return false;
    if (__get_cpuid_max(0, NULL) < 7)
        return false;
    __cpuid_count(7, 0, a, b, c, d);
    return (b & (1u << 5)) != 0;
}

static int use_avx2 = -1; /* -1 not decided; the answer never changes */

static bool avx2(void)
{
    int u = __atomic_load_n(&use_avx2, __ATOMIC_RELAXED);
    if (u < 0) {
        u = cpu_avx2();
        __atomic_store_n(&use_avx2, u, __ATOMIC_RELAXED);
    }
    return u != 0;
}
#else
static bool avx2(void)
{
    return false;
}
#define kv__xxh3_64_avx2(p, n) XXH3_64bits(p, n)
#define kv__xxh3_reset_avx2(st) (void)XXH3_64bits_reset(st)
#define kv__xxh3_update_avx2(st, p, n) (void)XXH3_64bits_update(st, p, n)
#define kv__xxh3_digest_avx2(st) XXH3_64bits_digest(st)
#endif

uint64_t kv__xxh3_64(const void *p, size_t n)
{
    return avx2() ? kv__xxh3_64_avx2(p, n) : XXH3_64bits(p, n);
}

void kv__xxh3_reset(struct kv__xxh3_state *s)
{
    memset(s->b, 0, sizeof(s->b)); /* every byte defined, whatever reset touches */
    XXH3_state_t *st = (XXH3_state_t *)(void *)s->b;
    if (avx2()) {
        kv__xxh3_reset_avx2(st);
    } else {
        XXH3_INITSTATE(st);
        (void)XXH3_64bits_reset(st);
    }
}

void kv__xxh3_update(struct kv__xxh3_state *s, const void *p, size_t n)
{
    XXH3_state_t *st = (XXH3_state_t *)(void *)s->b;
    if (avx2())
        kv__xxh3_update_avx2(st, p, n);
    else
        (void)XXH3_64bits_update(st, p, n);
}

uint64_t kv__xxh3_digest(const struct kv__xxh3_state *s)
{
    const XXH3_state_t *st = (const XXH3_state_t *)(const void *)s->b;
    return avx2() ? kv__xxh3_digest_avx2(st) : XXH3_64bits_digest(st);
}

bool kv__xxh3_is_avx2(void)
{
    return avx2();
}
