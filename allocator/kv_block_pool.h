/*
 * kv_block_pool.h - the block pool: ids, reference counts, a free list that is
 * also the LRU eviction order, and a prefix cache of full blocks.
 *
 * A pool hands out uint32_t block ids in [1, num_blocks). Id 0 is the null
 * block (KV_BLOCK_NULL): it is reserved at create, never handed out, never on
 * the free list, never counted in the stats; page tables use it as padding
 * (a slot of block 0 is never written). Passing it to any call is
 * KV_ERR_INVALID_ARG.
 *
 * A block is in exactly one state:
 *
 *     free    ref == 0, no hash     on the free list
 *     used    ref  > 0              off the free list (may carry a hash)
 *     cached  ref == 0, hash        on the free list, found by prefix lookup
 *
 *                      alloc (from the head)
 *         free -------------------------------> used <-----------------+
 *          ^                                    | |  commit_full: hash  |
 *          |   release to ref 0, no hash        | |  set (STORED)       |
 *          +------------------------------------+ |                     |
 *                                                 | release to ref 0,   | prefix hit:
 *                                                 v has hash            | ref 0 -> 1
 *                                              cached ------------------+
 *                                                 |
 *          alloc reaches it at the head: evicted  +--> used (no hash)
 *          (hash dropped, REMOVED event)
 *
 * The free list is intrusive and doubly linked: a block released to ref 0 goes
 * to the tail, alloc takes from the head, so the head is the least recently
 * released block. Cached blocks sit in the same list and are evicted lazily,
 * oldest first, only when an alloc takes them. A caller that frees a
 * sequence should release its blocks last-to-first, so a shared prefix
 * (the first blocks) outlives its private tail.
 *
 * Prefix hashes chain: h_i = kv_block_hash(h_{i-1}, tokens of block i,
 * extra_key) with h_{-1} = KV_BLOCK_HASH_ROOT, so a block's hash names its
 * whole prefix. Only full blocks are committed. At most one block carries a
 * given hash, and a block carries at most one hash.
 *
 * Every call is all-or-nothing: a batch is validated as a whole before
 * anything changes, and on error nothing changed (kv_last_error() names the
 * offending index, id and values).
 *
 * Thread-safe: every function on one pool may be called from any thread. One
 * mutex per pool guards the block records, the free list, the hash table,
 * the stats and event delivery. Hashing (kv_block_hash) runs outside it.
 * Event callbacks run with the mutex held, in the order of the state changes:
 * they must not call into the same pool and should be short.
 */
#ifndef KV_BLOCK_POOL_H
#define KV_BLOCK_POOL_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kv_block_ops.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The pool handle (opaque). */
typedef struct kv_block_pool kv_block_pool;

/* The reserved null block: never handed out. */
#define KV_BLOCK_NULL ((uint32_t)0)

/* Parent hash of a sequence's first block. */
#define KV_BLOCK_HASH_ROOT ((uint64_t)0)

/* Largest num_blocks a pool accepts. */
#define KV_BLOCK_POOL_MAX_BLOCKS ((uint32_t)1 << 31)

/* What an event callback reports about a prefix hash. */
typedef enum kv_block_event {
    KV_BLOCK_STORED = 1,  /* hash registered: block id now found by prefix lookup */
    KV_BLOCK_REMOVED = 2, /* hash dropped: block id was evicted for reuse */
} kv_block_event;

/* Called with the pool's mutex held (see "Thread-safe" above). */
typedef void (*kv_block_event_fn)(void *user, kv_block_event ev, uint64_t hash, uint32_t id);

/* Pool flags (kv_block_pool_config.flags). */
/* Run the O(capacity) invariant check after every operation (tests); also
 * enabled by the environment KV_DEBUG_CHECKS=1 (or true, yes, on; 0, false,
 * no, off or empty: off; any other value: kv_block_pool_create refuses it,
 * KV_ERR_INVALID_ARG naming it) or building with -DKV_DEBUG_CHECKS
 * (make DEBUG=1). */
#define KV_BLOCK_POOL_CHECK_FULL 0x1u

/* Input of kv_block_pool_create(). */
struct kv_block_pool_config {
    size_t struct_size;         /* sizeof this struct: set by its _init() or _INIT */
    uint32_t num_blocks;        /* block records incl. the null block 0: ids 1 ..
                                   num_blocks-1 are usable; 2 .. 2^31 */
    unsigned flags;             /* KV_BLOCK_POOL_* */
    kv_block_event_fn on_event; /* stored/removed events; NULL = none */
    void *event_user;           /* passed back to on_event; borrowed for the pool's life */
};

/* C initializer: struct kv_block_pool_config cfg = KV_BLOCK_POOL_CONFIG_INIT; */
#define KV_BLOCK_POOL_CONFIG_INIT                                                                  \
    {                                                                                              \
        .struct_size = sizeof(struct kv_block_pool_config)                                         \
    }

/* Zero *cfg and set its struct_size (C and C++). */
static inline void kv_block_pool_config_init(struct kv_block_pool_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
}

/* free_blocks + used_blocks + cached_blocks == capacity == num_blocks - 1. */
struct kv_block_pool_stats {
    uint32_t capacity;        /* usable blocks (num_blocks - 1) */
    uint32_t free_blocks;     /* ref 0, no hash */
    uint32_t used_blocks;     /* ref > 0 */
    uint32_t cached_blocks;   /* ref 0, with a hash (reusable until evicted) */
    uint32_t used_high_water; /* max used_blocks since create */
    uint32_t hashed_blocks;   /* blocks carrying a hash (used or cached) */
    uint64_t hits;            /* blocks returned by prefix lookups */
    uint64_t misses;          /* blocks asked for by prefix lookups and not returned */
    uint64_t evictions;       /* cached blocks whose hash was dropped for reuse */
    uint64_t stored;          /* hashes registered (STORED events) */
};

/*
 * Create a pool of cfg->num_blocks records (all free but the null block).
 * *out set only on success. Returns KV_OK; KV_ERR_NULL; KV_ERR_INVALID_ARG
 * (num_blocks < 2 or > KV_BLOCK_POOL_MAX_BLOCKS, unknown flags);
 * KV_ERR_NO_MEMORY.
 */
KV_API KV_NODISCARD kv_status kv_block_pool_create(const struct kv_block_pool_config *cfg,
                                                   kv_block_pool **out);

/* Free the pool, or, while page tables made over it (kv_block_pool_ops) are
 * alive, drop the caller's handle and leave the pool to the last table's
 * kv_page_table_destroy (events keep firing into event_user until then).
 * NULL is a no-op. No other thread may be using the handle. No events are
 * fired for the hashes it drops. The pool of a kv_cache (kv_cache_pool) is
 * refused: nothing is freed, kv_last_error() says so (KV_ERR_BAD_STATE);
 * kv_cache_destroy frees it. */
KV_API void kv_block_pool_destroy(kv_block_pool *pool);

/*
 * n blocks, each with ref 1 and no hash, ids written to ids[n], taken from
 * the head of the free list (cached blocks taken are evicted: hash dropped,
 * REMOVED event, evictions += 1). n == 0 is a no-op.
 * Returns KV_OK; KV_ERR_NULL; KV_ERR_INVALID_ARG (ids not 4-byte aligned,
 * n > 0: written as words); KV_ERR_NO_BLOCKS when fewer than n are free or
 * cached (nothing taken; the message names requested and available).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_alloc(kv_block_pool *pool, uint32_t n, uint32_t *ids);

/*
 * ref += 1 for each of ids[n] (an id may repeat: it is retained once per
 * occurrence). Every id must be held (ref > 0). Used to share blocks when a
 * sequence forks (copy-on-write: the page table copies a shared block before
 * writing into it and keeps the (src, dst) list).
 * Returns KV_OK; KV_ERR_NULL; KV_ERR_INVALID_ARG (id 0 or >= num_blocks,
 * ids not 4-byte aligned with n > 0); KV_ERR_BAD_STATE (id not held);
 * KV_ERR_OVERFLOW (ref would pass 2^32-1).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_retain(kv_block_pool *pool, const uint32_t *ids,
                                                   uint32_t n);

/*
 * ref -= 1 for each of ids[n], in order; a block reaching 0 goes to the tail
 * of the free list (cached if it carries a hash, free otherwise). An id may
 * repeat up to its ref count.
 * Returns KV_OK; KV_ERR_NULL; KV_ERR_INVALID_ARG (id 0 or >= num_blocks,
 * ids not 4-byte aligned with n > 0); KV_ERR_BAD_STATE (double free:
 * released more times than its ref count).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_release(kv_block_pool *pool, const uint32_t *ids,
                                                    uint32_t n);

/* Ref count of id; 0 when free, cached, the null block or out of range. */
KV_API uint32_t kv_block_pool_ref_count(kv_block_pool *pool, uint32_t id);

/*
 * The chained prefix hash of one full block: XXH3-64 of the canonical
 * serialization  u64 parent_hash | u64 extra_key | u32 n_tokens |
 * i32 tokens[n_tokens]  (all little-endian). Pure; safe from any thread.
 * extra_key separates caches that must not share blocks (LoRA id, salt).
 */
KV_API uint64_t kv_block_hash(uint64_t parent_hash, const int32_t *tokens, uint32_t n_tokens,
                              uint64_t extra_key);

/*
 * Register held block id under hash so later prefix lookups find it. If
 * another block already carries hash, id stays unregistered (*stored =
 * false); if id already carries this hash it is a no-op (*stored = true).
 * stored may be NULL. Fires STORED when registered.
 * Returns KV_OK; KV_ERR_INVALID_ARG (bad id); KV_ERR_BAD_STATE (id not held,
 * or it already carries a different hash).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_commit_hash(kv_block_pool *pool, uint32_t id,
                                                        uint64_t hash, bool *stored);

/*
 * kv_block_hash(parent_hash, tokens, n_tokens, extra_key) then
 * kv_block_pool_commit_hash(); *hash_out (may be NULL) receives the hash on
 * success whether or not id was registered. Returns as commit_hash, plus
 * KV_ERR_NULL (tokens NULL) and KV_ERR_INVALID_ARG (n_tokens 0).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_commit_full(kv_block_pool *pool, uint32_t id,
                                                        uint64_t parent_hash, const int32_t *tokens,
                                                        uint32_t n_tokens, uint64_t extra_key,
                                                        uint64_t *hash_out);

/*
 * Longest prefix of hashes[n] found in the cache: each block found is retained
 * (ref += 1; a cached block leaves the free list) and written to ids; the
 * search stops at the first miss. *n_found says how many. hits += *n_found,
 * misses += n - *n_found.
 * Returns KV_OK (also when nothing is found); KV_ERR_NULL; KV_ERR_INVALID_ARG
 * (hashes not 8-byte or ids not 4-byte aligned, n > 0: nothing retained).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_lookup(kv_block_pool *pool, const uint64_t *hashes,
                                                   uint32_t n, uint32_t *ids, uint32_t *n_found);

/*
 * Longest cached prefix of tokens[n_tokens] in whole blocks of block_tokens
 * (at most max_blocks), hashes chained from KV_BLOCK_HASH_ROOT with
 * extra_key: the kv_block_ops.match_prefix contract. Blocks found are
 * retained; hashes (may be NULL) receives each found block's hash. Hashing
 * runs outside the mutex, in chunks; each chunk's lookup is atomic.
 * Returns KV_OK; KV_ERR_NULL; KV_ERR_INVALID_ARG (block_tokens 0; ids not
 * 4-byte or hashes not 8-byte aligned with a full block to look up).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_match_prefix(kv_block_pool *pool, const int32_t *tokens,
                                                         uint64_t n_tokens, uint32_t block_tokens,
                                                         uint64_t extra_key, uint32_t *ids,
                                                         uint64_t *hashes, uint32_t max_blocks,
                                                         uint32_t *n_found);

/* The hash id carries in *hash. Returns KV_OK; KV_ERR_NULL;
 * KV_ERR_INVALID_ARG (bad id); KV_ERR_NOT_FOUND (no hash). */
KV_API KV_NODISCARD kv_status kv_block_pool_block_hash(kv_block_pool *pool, uint32_t id,
                                                       uint64_t *hash);

/*
 * The free list in eviction order (head = next taken) into ids[cap]; *n
 * receives its full length (free + cached). For tests and introspection:
 * O(length). Returns KV_OK; KV_ERR_NULL; KV_ERR_INVALID_ARG (cap < length:
 * *n still set; ids may be NULL with cap 0 to ask for the length; ids not
 * 4-byte aligned with cap > 0: *n not set).
 */
KV_API KV_NODISCARD kv_status kv_block_pool_free_list(kv_block_pool *pool, uint32_t *ids,
                                                      uint32_t cap, uint32_t *n);

/* A consistent snapshot of the counters. */
KV_API void kv_block_pool_stats_get(kv_block_pool *pool, struct kv_block_pool_stats *out);

/*
 * Fill the kv_block_ops seam (kvcache/kv_block_ops.h) with this pool: alloc,
 * retain, release, ref_count, match_prefix, commit_full, hold, drop; ctx =
 * pool. A page table made with *out holds the pool (hold / drop), so
 * kv_block_pool_destroy before kv_page_table_destroy is counted, not a use
 * after free: the table keeps working and its destroy frees the pool. A
 * user calling the ops itself holds the pool the same way, or must destroy
 * it last. Returns KV_OK; KV_ERR_NULL.
 */
KV_API KV_NODISCARD kv_status kv_block_pool_ops(kv_block_pool *pool, struct kv_block_ops *out);

#ifdef __cplusplus
}
#endif

#endif /* KV_BLOCK_POOL_H */
