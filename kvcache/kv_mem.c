/* kv_mem.c - host allocation through jemalloc, or libc under sanitizers. */
#include <assert.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_mem.h"

/* Allocation calls made by this thread (kv__mem_allocs). */
static _Thread_local uint64_t g_allocs;

uint64_t kv__mem_allocs(void)
{
    return g_allocs;
}

/* Failure injection (kv__mem_fail_after): allocations left before they fail,
 * -1 when off; and the failures injected so far on this thread. */
static _Thread_local int64_t g_fail_after = -1;
static _Thread_local uint64_t g_failed;

void kv__mem_fail_after(int64_t n)
{
    g_fail_after = n < 0 ? -1 : n;
}

uint64_t kv__mem_failed(void)
{
    return g_failed;
}

/* Failure injection on other threads (kv__mem_fail_others_after): the
 * allocations left to other threads before they fail, -1 when off (a
 * process-wide countdown); the failures injected so far on them; and whether
 * this thread is the one that set it (exempt). */
static _Atomic int64_t g_others_after = -1;
static _Atomic uint64_t g_others_failed;
static _Thread_local int g_others_exempt;

void kv__mem_fail_others_after(int64_t n)
{
    g_others_exempt = n >= 0;
    atomic_store(&g_others_after, n < 0 ? -1 : n);
}

uint64_t kv__mem_others_failed(void)
{
    return atomic_load(&g_others_failed);
}

/* The process-wide countdown, taken by an allocation of a thread that is not
 * exempt: true when it is to fail. */
static int inject_others(void)
{
    int64_t n = atomic_load(&g_others_after);
    while (n > 0)
        if (atomic_compare_exchange_weak(&g_others_after, &n, n - 1))
            return 0;
    if (n < 0)
        return 0; /* turned off meanwhile */
    atomic_fetch_add(&g_others_failed, 1);
    return 1;
}

/* True when this allocation is to fail: one thread-local compare and one
 * relaxed atomic load when off. */
static inline int inject_failure(void)
{
    if (__builtin_expect(atomic_load_explicit(&g_others_after, memory_order_relaxed) >= 0, 0) &&
        !g_others_exempt && inject_others())
        return 1;
    if (__builtin_expect(g_fail_after < 0, 1))
        return 0;
    if (g_fail_after > 0) {
        g_fail_after--;
        return 0;
    }
    g_failed++;
    return 1;
}

#if defined(KV_USE_LIBC_MALLOC)

void *kv__mem_alloc_aligned(size_t align, size_t size)
{
    void *p = NULL;
    g_allocs++;
    if (inject_failure())
        return NULL;
    if (size == 0 || align < sizeof(void *) || (align & (align - 1)))
        return NULL;
    if (posix_memalign(&p, align, size) != 0)
        return NULL;
    return p;
}

void kv__mem_free(void *p)
{
    free(p);
}

void *kv__mem_calloc(size_t n, size_t size)
{
    size_t total;
    g_allocs++;
    if (inject_failure())
        return NULL;
    if (__builtin_mul_overflow(n, size, &total) || total == 0)
        return NULL;
    return calloc(n, size);
}

const char *kv__mem_backend(void)
{
    return "libc";
}

#else

#include <jemalloc/jemalloc.h>

void *kv__mem_alloc_aligned(size_t align, size_t size)
{
    g_allocs++;
    if (inject_failure())
        return NULL;
    if (size == 0 || align < sizeof(void *) || (align & (align - 1)))
        return NULL;
    return mallocx(size, MALLOCX_ALIGN(align));
}

void kv__mem_free(void *p)
{
    if (p)
        dallocx(p, 0);
}

void *kv__mem_calloc(size_t n, size_t size)
{
    size_t total;
    g_allocs++;
    if (inject_failure())
        return NULL;
    if (__builtin_mul_overflow(n, size, &total) || total == 0)
        return NULL;
    return mallocx(total, MALLOCX_ALIGN(16) | MALLOCX_ZERO);
}

const char *kv__mem_backend(void)
{
    return "jemalloc";
}

#endif

void *kv__mem_alloc(size_t size)
{
    return kv__mem_alloc_aligned(16, size);
}

void *kv__mem_grow(void *old, size_t *cap, size_t used, size_t need, size_t elem, size_t first)
{
    assert(need >= 1 && first >= 1 && used <= *cap);
    if (need <= *cap)
        return old;
    size_t n = *cap ? *cap : first, bytes;
    while (n < need)
        n = n > SIZE_MAX / 2 ? need : 2 * n;
    if (__builtin_mul_overflow(n, elem, &bytes))
        return NULL;
    void *p = kv__mem_alloc(bytes);
    if (!p)
        return NULL;
    if (used)
        memcpy(p, old, used * elem);
    kv__mem_free(old);
    *cap = n;
    return p;
}
