/*
 * kv_block_ops.h - the seam between page tables (kvcache/) and a block
 * allocator (allocator/). kvcache/ never includes allocator headers: a page
 * table calls a block source through this ops table, and the allocator's
 * block pool fills one in (kv_block_pool_ops()). Tests can plug in a fake.
 *
 * Block ids are uint32_t. A block is "held" while its ref count is > 0.
 * Every call is all-or-nothing: on error nothing changed.
 */
#ifndef KV_BLOCK_OPS_H
#define KV_BLOCK_OPS_H

#include <stdint.h>

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Version of struct kv_block_ops this header describes. */
#define KV_BLOCK_OPS_VERSION 2u

/* A block source: the allocator's pool, or a test fake. A user filling one
 * by hand zeroes it, sets version = KV_BLOCK_OPS_VERSION and the ops; the
 * page table refuses another version (KV_ERR_INVALID_ARG naming both). */
struct kv_block_ops {
    uint32_t version; /* KV_BLOCK_OPS_VERSION */
    void *ctx;        /* passed back as the first argument of every op */

    /* n fresh blocks, each with ref 1, ids written to ids[n].
     * KV_ERR_NO_BLOCKS (nothing allocated) when fewer than n are available. */
    kv_status (*alloc)(void *ctx, uint32_t n, uint32_t *ids);

    /* ref += 1 for each id (ids must be held). */
    kv_status (*retain)(void *ctx, const uint32_t *ids, uint32_t n);

    /* ref -= 1 for each id; a block reaching 0 returns to the pool (a block
     * with a prefix hash stays reusable until evicted). */
    kv_status (*release)(void *ctx, const uint32_t *ids, uint32_t n);

    /* Current ref count of id (0 when free or cached-free; 0 for a bad id). */
    uint32_t (*ref_count)(void *ctx, uint32_t id);

    /* ---- optional prefix caching (NULL = none) ---- */

    /* Longest cached prefix of tokens[n_tokens], in whole blocks of
     * block_tokens tokens, hash chain seeded by extra_key. Each block found is
     * retained (ref += 1) and its id written to ids (at most max_blocks);
     * *n_found says how many; hashes[i] (if hashes != NULL) receives each
     * block's chained hash. */
    kv_status (*match_prefix)(void *ctx, const int32_t *tokens, uint64_t n_tokens,
                              uint32_t block_tokens, uint64_t extra_key, uint32_t *ids,
                              uint64_t *hashes, uint32_t max_blocks, uint32_t *n_found);

    /* Held block id has just become full with tokens[n_tokens]; register it
     * under hash = H(parent_hash, tokens, extra_key) so later sequences can
     * reuse it, and return that hash (for chaining) in *hash_out. If another
     * block already carries the same hash, id stays unregistered but
     * *hash_out is still the chained hash. */
    kv_status (*commit_full)(void *ctx, uint32_t id, uint64_t parent_hash, const int32_t *tokens,
                             uint32_t n_tokens, uint64_t extra_key, uint64_t *hash_out);
    /* ---- optional lifetime (both or neither; NULL = none) ---- */
    /* A user of ctx begins (kv_page_table_create, once it succeeds) and
     * ends (kv_page_table_destroy, after its last release). A source that
     * counts them stays alive until the last user ends, whichever of the
     * source and its users the caller frees first (the pool does). */
    void (*hold)(void *ctx);
    void (*drop)(void *ctx);
};

#ifdef __cplusplus
}
#endif

#endif /* KV_BLOCK_OPS_H */
