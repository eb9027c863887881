/*
 * kv_mem.h - the one door for host memory inside kvcache (library-internal:
 * used by every module, never installed; see kv_lib.h for the header tiers).
 *
 * Normal builds allocate through jemalloc's non-standard API (mallocx with an
 * explicit alignment); sanitizer builds (KV_USE_LIBC_MALLOC) use libc so ASan,
 * UBSan and TSan see every allocation. Nothing else in the library calls
 * malloc.
 */
#ifndef KV_MEM_H
#define KV_MEM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* size bytes aligned to `align` (a power of two >= sizeof(void *)); NULL on
 * failure or size 0. Free with kv__mem_free(). */
void *kv__mem_alloc_aligned(size_t align, size_t size);

/* Like kv__mem_alloc_aligned(16, size). */
void *kv__mem_alloc(size_t size);

/* Zeroed n * size bytes (overflow-checked); NULL on failure. Large requests
 * get fresh pages that the kernel zeroes on first touch (jemalloc's
 * MALLOCX_ZERO, libc calloc), so an untouched table costs no memory. */
void *kv__mem_calloc(size_t n, size_t size);

/* Free memory from any kv__mem_* call; NULL is a no-op. */
void kv__mem_free(void *p);

/* "jemalloc" or "libc": which allocator this build uses. */
const char *kv__mem_backend(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_MEM_H */
