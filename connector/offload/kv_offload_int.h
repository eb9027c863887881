/*
 * kv_offload_int.h - the inside of the host offload tier (module-private):
 * the region carver behind one interface, and test hooks.
 *
 * The carver hands out aligned pieces of one region and nothing else. Two
 * implementations, one interface (connector/offload/kv_offload_carve.c):
 *
 *   normal builds      a jemalloc arena (mallctl "arenas.create") whose
 *                      extent hooks carve only from the region: alloc bumps
 *                      a pointer with the requested alignment and refuses
 *                      when the region is exhausted; dalloc, decommit and
 *                      purge refuse (jemalloc keeps the extent, retained,
 *                      and reuses it); split and merge accept. At create
 *                      the region (less a metadata reserve) is allocated
 *                      and freed once, so it is one retained extent that
 *                      pieces are split from exactly; decay 0 sends freed
 *                      pieces straight back to it (merged with their
 *                      neighbours). Pieces come from mallocx(MALLOCX_ARENA
 *                      | MALLOCX_TCACHE_NONE) and take their size class;
 *                      the arena's own metadata comes from the region too.
 *   KV_USE_LIBC_MALLOC a first-fit free list with coalescing (segments in
 *   (ASan/UBSan/TSan)  address order, records outside the region): what the
 *                      sanitizer builds test.
 *
 * Thread-safe: alloc and free may be called from any thread.
 */
#ifndef KV_OFFLOAD_INT_H
#define KV_OFFLOAD_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_offload.h"

typedef struct kv__carver kv__carver;

/* A hold on off's region for a user outside the tier (a transport's
 * registration, kv_xport_mem_reg_offload): kv_offload_destroy then ends
 * the ops, joins the worker and drops the entries, but the region and the
 * handle live until the last hold (and staging buffer) is released. The
 * hold is taken on a live tier (KV_ERR_BAD_STATE once destroyed). */
kv_status kv__offload_region_hold(kv_offload *off);
/* Release a hold; the last release after kv_offload_destroy frees the
 * region and the handle. */
void kv__offload_region_release(kv_offload *off);

/* A carver over [base, base + bytes). KV_ERR_NO_MEMORY; KV_ERR_INTERNAL
 * (jemalloc refused the arena). */
kv_status kv__carver_create(void *base, size_t bytes, kv__carver **out);
/* Drop the carver (every piece dies with it; the region is the caller's). */
void kv__carver_destroy(kv__carver *c);
/* bytes at align (a power of two); NULL when the region has no room, or
 * (*no_memory set: evicting makes no room for it) when the carver's own
 * records could not be allocated. */
void *kv__carver_alloc(kv__carver *c, size_t bytes, size_t align, bool *no_memory);
/* The bytes a piece of bytes at align takes of the region (jemalloc: its
 * size class, plus a page for a large class; first-fit: bytes rounded up to
 * align). The tier counts entries and staging buffers at this size, so
 * capacity_bytes and staging_bytes bound what they take of the region. */
size_t kv__carver_size(kv__carver *c, size_t bytes, size_t align);
/* Return a piece from kv__carver_alloc (NULL: no-op). */
void kv__carver_free(kv__carver *c, void *p);
/* Bytes of the region handed to the carver's users or its metadata so far
 * (jemalloc: the high-water mark of the hooks; first-fit: in use now). */
size_t kv__carver_used(kv__carver *c);
/* "jemalloc-arena" or "first-fit". */
const char *kv__carver_name(void);

/* ---- test hooks ---------------------------------------------------------- */

/* Flip byte `byte` of hash's entry in cache's block format (cache NULL: the
 * first complete entry of hash in any format); the checksum then fails on
 * load. KV_ERR_NOT_FOUND; KV_ERR_OUT_OF_BOUNDS (byte >= entry size). */
kv_status kv__offload_test_corrupt(kv_offload *off, const kv_cache *cache, uint64_t hash,
                                   size_t byte);

/* Where the worker calls the hook. */
enum kv__offload_hook_at {
    KV__OFFLOAD_HOOK_START = 1, /* the op just became RUNNING */
    KV__OFFLOAD_HOOK_BLOCK = 2, /* between chunks of blocks (cancel is seen after it) */
    KV__OFFLOAD_HOOK_TAKEN = 3, /* kv_offload_cancel took a queued op out of the queue, on the
                                   cancelling thread, before the op is finished CANCELLED */
};
typedef void (*kv__offload_hook_fn)(void *user, enum kv__offload_hook_at at, kv_offload_op *op);

/* Install (fn NULL: remove) a hook the worker (and, for TAKEN, kv_offload_cancel)
 * calls without any lock held. */
void kv__offload_test_set_hook(kv_offload *off, kv__offload_hook_fn fn, void *user);

/* Blocks per chunk of the worker (cancel is seen between chunks); 0 = the
 * default (4 MiB of entries, 16 to 1,024 blocks). */
void kv__offload_test_set_chunk(kv_offload *off, uint32_t blocks);

#endif /* KV_OFFLOAD_INT_H */
