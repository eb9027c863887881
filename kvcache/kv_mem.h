/*
 * kv_mem.h - the one door for host memory inside kvcache.
 *
 * Normal builds allocate through jemalloc's non-standard API (mallocx with an
 * explicit alignment); sanitizer builds (KV_USE_LIBC_MALLOC) use libc so ASan,
 * UBSan and TSan see every allocation. Nothing else in the tree calls malloc.
 */
#ifndef KV_MEM_H
#define KV_MEM_H

#include <stddef.h>

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* size bytes aligned to `align` (a power of two >= sizeof(void *)); NULL on
 * failure or size 0. Free with kv_mem_free(). */
KV_API void *kv_mem_alloc_aligned(size_t align, size_t size);

/* Like kv_mem_alloc_aligned(alignof(max_align_t), size). */
KV_API void *kv_mem_alloc(size_t size);

/* Zeroed n * size bytes (overflow-checked); NULL on failure. */
KV_API void *kv_mem_calloc(size_t n, size_t size);

/* Free memory from any kv_mem_* call; NULL is a no-op. */
KV_API void kv_mem_free(void *p);

/* "jemalloc" or "libc": which allocator this build uses. */
KV_API const char *kv_mem_backend(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_MEM_H */
