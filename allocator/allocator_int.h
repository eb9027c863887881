/*
 * allocator_int.h - private cross-file declarations of the allocator module.
 * Not installed.
 */
#ifndef ALLOCATOR_INT_H
#define ALLOCATOR_INT_H

#include <stddef.h>

#include "kv_arena.h"
#include "kv_block_pool.h"

/* The full O(capacity + table) invariant check of a pool, taking its mutex
 * (tests, debug builds). KV_OK, or KV_ERR_INTERNAL naming the broken
 * equation and the block. */
kv_status kv__block_pool_check(kv_block_pool *pool);

/* A kv_cache's parts: marked owned by kv_cache_create, so their public
 * destroy refuses them (KV_ERR_BAD_STATE in kv_last_error, nothing freed);
 * the cache frees them with these (the arena: its reference; the last,
 * perhaps a transport's, frees it). */
void kv__arena_set_owned(kv_arena *arena);
void kv__arena_free(kv_arena *arena);
void kv__block_pool_set_owned(kv_block_pool *pool);
void kv__block_pool_free(kv_block_pool *pool);

/* Test hook: pinned and device arenas from a CUDA test double (the
 * offload tier's tests/softcuda) instead of the CUDA runtime, so a CPU test
 * can make a KV_MEM_DEVICE kv_cache over memory the double tracks. NULL
 * restores the runtime. Set it with no arena alive. */
struct kv__arena_cuda_mem {
    kv_status (*host_alloc)(size_t bytes, void **out); /* cudaMallocHost */
    void (*host_free)(void *p);
    kv_status (*device_alloc)(int device, size_t bytes, void **out); /* cudaMalloc */
    void (*device_free)(int device, void *p);
};
void kv__arena_set_cuda_mem(const struct kv__arena_cuda_mem *m);

#endif /* ALLOCATOR_INT_H */
