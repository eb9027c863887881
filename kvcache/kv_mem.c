/* kv_mem.c - host allocation through jemalloc, or libc under sanitizers. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_mem.h"

#if defined(KV_USE_LIBC_MALLOC)

void *kv__mem_alloc_aligned(size_t align, size_t size)
{
    void *p = NULL;
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
