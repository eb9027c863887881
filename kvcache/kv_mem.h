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
#include <stdint.h>

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

/* How many allocation calls (kv__mem_alloc*, kv__mem_calloc, through
 * kv__mem_grow too) this thread has made: tests assert that a path
 * allocates nothing (the device-index launchers' host side). */
uint64_t kv__mem_allocs(void);

/* Test-only failure injection, per thread: after n >= 0 more successful
 * allocation calls on this thread (kv__mem_alloc*, kv__mem_calloc, through
 * kv__mem_grow too), every following one on this thread returns NULL, as a
 * real failure does, until kv__mem_fail_after(-1) turns it off (the
 * default). Other threads are never affected. kv__mem_failed() counts the
 * failures injected on this thread. When off, an allocation pays one
 * thread-local compare. */
void kv__mem_fail_after(int64_t n);
uint64_t kv__mem_failed(void);

/* Test-only failure injection on the library's own threads (the offload
 * tier's workers, the transports' progress threads), process-wide: after
 * n >= 0 more successful allocation calls made by threads other than the
 * calling one (one countdown that they all take from, in the order they
 * allocate), every following allocation on those threads returns NULL,
 * until kv__mem_fail_others_after(-1) turns it off (the default). The
 * calling thread is exempt (its own injection stays kv__mem_fail_after's),
 * so a test drives the library while its threads run out of memory;
 * n = 0 fails every allocation of theirs. kv__mem_others_failed() counts
 * the failures injected this way, process-wide. One thread sets it at a
 * time; when off, an allocation pays one relaxed atomic load. */
void kv__mem_fail_others_after(int64_t n);
uint64_t kv__mem_others_failed(void);

/* Free memory from any kv__mem_* call; NULL is a no-op. */
void kv__mem_free(void *p);

/* Grow an array of elem-byte elements so that it holds at least need >= 1
 * of them, by doubling: from *cap, or from first (>= 1) when *cap is 0.
 * The first `used` elements move to the new array and old is freed.
 * Returns the array to use from now on (old itself when need <= *cap) and
 * sets *cap to its capacity; NULL when the capacity overflows or memory runs
 * out, and then old and *cap are unchanged. old is any kv__mem_* array, or
 * NULL with *cap 0:
 *
 *     if (n == cap) {
 *         struct item *t = kv__mem_grow(items, &cap, n, n + 1, sizeof(*t), 8);
 *         if (!t)
 *             return kv__error(KV_ERR_NO_MEMORY, "...: %zu items", cap);
 *         items = t;
 *     }
 */
void *kv__mem_grow(void *old, size_t *cap, size_t used, size_t need, size_t elem, size_t first);

/* "jemalloc" or "libc": which allocator this build uses. */
const char *kv__mem_backend(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_MEM_H */
