/* kv_mem.c - host allocation through jemalloc, or libc under sanitizers. */
#include <assert.h>
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

#if defined(KV_USE_LIBC_MALLOC)

void *kv__mem_alloc_aligned(size_t align, size_t size)
{
    void *p = NULL;
    g_allocs++;
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
