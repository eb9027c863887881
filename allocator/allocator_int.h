/*
 * allocator_int.h - private cross-file declarations of the allocator module.
 * Not installed.
 */
#ifndef ALLOCATOR_INT_H
#define ALLOCATOR_INT_H

#include "kv_block_pool.h"

/* The full O(capacity + table) invariant check of a pool, taking its mutex
 * (tests, debug builds). KV_OK, or KV_ERR_INTERNAL naming the broken
 * equation and the block. */
kv_status kv__block_pool_check(kv_block_pool *pool);

#endif /* ALLOCATOR_INT_H */
