/*
 * kv_offload.h - the host offload tier: full blocks of a kv_cache kept in
 * host memory by prefix hash, with a byte capacity and LRU eviction, moved
 * by a worker thread (docs/connector.md, "Host offload tier").
 *
 * Model. A tier holds entries, each keyed by (prefix hash, block format):
 * the hash a block carries in its pool (kv_block_pool_block_hash) and the
 * block format of the cache it came from. An entry is the block's bytes as
 * a compact, unpadded, block-major image in that format, plus an XXH3-64
 * checksum of those bytes taken at store. entries' bytes <= capacity_bytes;
 * when a store needs room the least recently used entries go first, of any
 * format (a store that finds its (hash, format) already there, and a load
 * that hits, make the entry the most recent).
 *
 * Block format: what one block's bytes are, hence what an entry holds and
 * its size. It is the cache layout's block_format_fingerprint (kv_layout.h):
 * layers L, tokens per block N, KV heads H, head dim D, dtype (name and
 * size), in-block order (NHD/HND) and K|V packing; an entry is L x {K, V} x
 * N x H x D elements in that order and packing. Not part of it: the block
 * count, padding, alignment and arrangement (layer-/block-major), which say
 * where blocks sit, not what they hold; caches differing only in those
 * share entries. Entries of one hash in several formats coexist (ranks with
 * different head counts storing one prefix into one tier each load back
 * their own), and each is stored, touched, evicted and counted on its own.
 * Which of the model's heads a cache holds is part of the key too
 * (kv_cache_config.head_offset): the ranks of one tensor-parallel group
 * (same H, other heads) store one prefix into one tier and each loads back
 * its own heads.
 *
 *   engine thread                     worker thread
 *   kv_offload_store(cache, ids) --->  copy block -> entry, checksum, insert
 *   kv_offload_load(cache, hashes) ->  find (hash, format), verify its checksum,
 *        (blocks allocated at post)    copy entry -> new block, commit
 *   kv_offload_test / _wait / _cancel on the op; results once terminal
 *
 * Every post returns an op that reaches exactly one terminal state:
 *
 *   PENDING --worker takes it--> RUNNING --+--> DONE       every entry OK
 *      |                                   +--> FAILED     >= 1 entry failed (named)
 *      +--- cancel, destroy ------------------> CANCELLED  (also a running op that sees
 *                                                           the cancel before it finishes)
 *
 * Memory. The tier's host memory is one region allocated at create
 * (kv_arena: page-locked through CUDA where a GPU is present, plain host
 * memory otherwise; kv_offload_regions reports it for a one-time RDMA or
 * cudaHostRegister registration). Entries and staging buffers are carved
 * from it (a jemalloc arena whose extent hooks hand out only this region; a
 * first-fit carver in sanitizer builds), so nothing the tier hands out needs
 * a registration of its own. region = capacity_bytes + staging_bytes +
 * slack_bytes.
 *
 * Device caches (KV_MEM_DEVICE, CUDA builds, a pinned region): the same
 * ops, with the copies on the GPU (kv_plan_copy_cuda of each block, on a
 * non-blocking stream the tier owns per device; the worker waits on its
 * own event, never on an engine's stream); a store hashes an entry after
 * its D2H landed, a load verifies it before issuing its H2D; a failed CUDA
 * call fails its entries with KV_ERR_DEVICE (docs/connector.md, "Device
 * caches"). Every CUDA call is made on the worker thread (never the
 * engine's current device or capture mode changed). The tier's stream
 * waits for no engine stream, so: a store's blocks must hold their bytes
 * when it is posted (the engine's writes to them landed: its stream
 * synchronized, or an event after them waited for), and no engine work
 * still in flight may touch a load's blocks (taken from the pool at post).
 *
 * Nothing is lost silently: a store that cannot make room fails that hash
 * (the block stays in the cache, untouched); a load whose entry is gone or
 * fails its checksum names the hash, and its block is released uncommitted.
 *
 * Lifetimes. No handle is freed under a user, whatever the order of the
 * frees:
 *   op -> cache   an op holds a reference on its cache (kv_cache_retain)
 *                 from post until it is terminal, so the engine may
 *                 kv_cache_destroy its own reference with ops queued or
 *                 running; the cache is freed when the last reference goes
 *                 (by the worker, on its thread, when that is the op's).
 *                 A load running then still commits its blocks, so the
 *                 cache's on_event fires on the worker's thread: its
 *                 event_user must stay valid until the op is terminal
 *                 (kv_offload_wait) or the tier destroyed;
 *   op -> tier    kv_offload_destroy ends every op (CANCELLED); the op
 *                 handles stay valid for kv_offload_test / _wait / _results
 *                 / _op_free (and _cancel, a no-op once terminal), which
 *                 never touch the tier;
 *   op handle     kv_offload_op_free refuses (KV_ERR_BAD_STATE, naming the
 *                 state) an op that is not terminal;
 *   staging       buffers still out at kv_offload_destroy keep the region
 *                 (and the handle, for kv_offload_staging_free alone) until
 *                 the last is returned;
 *   registration  a transport's kv_xport_mem_reg_offload holds the region
 *                 the same way, until kv_xport_mem_dereg.
 *
 * Thread-safe: every kv_offload_* call but create and destroy may be made
 * from any thread while the worker runs (one mutex per tier guards the
 * queue, the entry table, the LRU list and the stats; one per op its state);
 * destroy must not overlap another call on the tier or on one of its ops
 * but kv_offload_test / _wait / _results. While ops run, the engine may keep
 * using the cache (its page table, pool and kernels) with two rules: (1) the
 * blocks of a store are retained by the tier from post to end: the engine
 * may release its own references meanwhile but must not write them; (2) the
 * blocks of a load belong to the tier until the op is terminal: the engine
 * must not read, write or release them before. The worker calls only these
 * pool functions, each thread-safe: kv_block_pool_release,
 * kv_block_pool_commit_hash (and kv_cache_destroy, for the last reference).
 * Pool event callbacks must not call into the tier.
 */
#ifndef KV_OFFLOAD_H
#define KV_OFFLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_arena.h"
#include "kv_cache.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The tier handle and an operation handle (opaque). */
typedef struct kv_offload kv_offload;
typedef struct kv_offload_op kv_offload_op;

/* Where the region lives. */
typedef enum kv_offload_mem {
    KV_OFFLOAD_MEM_AUTO = 0,   /* pinned where CUDA and a GPU exist, host otherwise */
    KV_OFFLOAD_MEM_HOST = 1,   /* host memory (kv_arena KV_MEM_HOST) */
    KV_OFFLOAD_MEM_PINNED = 2, /* page-locked host memory, or KV_ERR_UNSUPPORTED */
} kv_offload_mem;

/* Input of kv_offload_create. Start from KV_OFFLOAD_CONFIG_INIT (or
 * kv_offload_config_init); zero means the default. */
struct kv_offload_config {
    size_t struct_size;    /* sizeof this struct: set by _INIT / _init() */
    size_t capacity_bytes; /* > 0: most entry bytes held at once */
    size_t staging_bytes;  /* most bytes of staging buffers at once (0: none) */
    size_t slack_bytes;    /* region bytes beyond capacity + staging for the carver's
                              metadata and a page of each large staging buffer; 0 = 8 MiB
                              + capacity/32 + staging/4 */
    kv_offload_mem mem;    /* KV_OFFLOAD_MEM_* */
    int threads;           /* copy threads of the worker (OpenMP); 0 = kv_threads(),
                              1 = the worker thread alone */
};

#define KV_OFFLOAD_CONFIG_INIT                                                                     \
    {                                                                                              \
        .struct_size = sizeof(struct kv_offload_config)                                            \
    }

static inline void kv_offload_config_init(struct kv_offload_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
}

/* States of an op. */
typedef enum kv_offload_state {
    KV_OFFLOAD_PENDING = 0,   /* queued */
    KV_OFFLOAD_RUNNING = 1,   /* the worker is on it */
    KV_OFFLOAD_DONE = 2,      /* terminal: every entry KV_OK */
    KV_OFFLOAD_FAILED = 3,    /* terminal: at least one entry failed; results name them */
    KV_OFFLOAD_CANCELLED = 4, /* terminal: cancelled (kv_offload_cancel or destroy) */
} kv_offload_state;

/* "pending", "running", "done", "failed", "cancelled"; "unknown". */
KV_API const char *kv_offload_state_name(kv_offload_state s);

/* One entry of an op, in the order posted.
 * status: KV_OK; KV_ERR_NOT_FOUND (load: no entry for the hash in any block
 * format when the worker looked); KV_ERR_MISMATCH (load: none in the cache's
 * block format, but one in another: stored from a cache whose blocks hold
 * other bytes); KV_ERR_CORRUPT (load: the checksum did not match; the entry
 * is dropped); KV_ERR_CAPACITY (store: the block is larger than
 * the capacity, or every other entry is in use); KV_ERR_NO_MEMORY (store:
 * the region had no room even with nothing left to evict); KV_ERR_DEVICE
 * (a device cache: a CUDA call of the entry's chunk failed); KV_ERR_CANCELLED
 * (not done: the op was cancelled first). */
struct kv_offload_result {
    uint64_t hash;
    uint32_t block;   /* store: the source block; load: the loaded block when status is
                         KV_OK (held by the caller: release it), KV_BLOCK_NULL otherwise */
    kv_status status; /* see above */
    bool committed;   /* load: the hash was registered on block (false with KV_OK when
                         another block of the pool already carried it) */
};

/* Counters of a tier (a consistent snapshot). entries and bytes are what the
 * table holds now (bytes also counts entries evicted while the worker still
 * reads them, until it is done). */
struct kv_offload_stats {
    uint64_t entries;           /* entries held: (hash, block format) pairs */
    uint64_t bytes;             /* region bytes the entries take, each what its piece
                                   takes (jemalloc: its size class, plus a page for a
                                   class of 16 KiB or more): <= capacity_bytes */
    uint64_t capacity_bytes;    /* the configured capacity */
    uint64_t region_bytes;      /* the region: capacity + staging + slack (rounded) */
    uint64_t staging_bytes;     /* bytes of the staging buffers out now, each rounded up
                                   to whole 4 KiB pages */
    uint64_t stores;            /* entries written (one already held is not counted) */
    uint64_t store_touches;     /* stores that found their (hash, format) already held */
    uint64_t loads;             /* blocks loaded (checksum verified) */
    uint64_t hits;              /* load lookups that found their hash */
    uint64_t misses;            /* load lookups that did not */
    uint64_t evictions;         /* entries dropped to make room (LRU) */
    uint64_t evicted;           /* entries dropped by kv_offload_evict */
    uint64_t checksum_failures; /* loads whose entry failed verification */
    uint64_t failed_ops;        /* ops that ended FAILED */
    uint64_t cancelled_ops;     /* ops that ended CANCELLED */
};

/*
 * Create a tier: the region (cfg->mem), its carver, the worker thread.
 * *out set only on success. cfg is borrowed for the call. Every field and
 * the region size are checked before anything is allocated.
 * KV_ERR_NULL; KV_ERR_INVALID_ARG (struct_size, capacity 0, unknown mem,
 * threads < 0); KV_ERR_OVERFLOW (the region size); KV_ERR_UNSUPPORTED
 * (KV_OFFLOAD_MEM_PINNED without CUDA or a GPU); KV_ERR_NO_MEMORY;
 * KV_ERR_INTERNAL (the jemalloc arena or the thread could not be made).
 */
KV_API KV_NODISCARD kv_status kv_offload_create(const struct kv_offload_config *cfg,
                                                kv_offload **out);

/* Cancel every queued op and the running one, wait until each is terminal
 * (blocks and cache references released), join the worker, free the entries
 * and the region. Op handles stay valid (terminal) for kv_offload_op_free.
 * Staging buffers still out keep the region: it is freed, with the handle,
 * by the kv_offload_staging_free of the last one (the one call the handle
 * then takes; kv_offload_staging_alloc answers KV_ERR_BAD_STATE). NULL is a
 * no-op. */
KV_API void kv_offload_destroy(kv_offload *off);

/* The kind of memory the region got (KV_MEM_HOST or KV_MEM_PINNED). */
KV_API enum kv_mem_kind kv_offload_mem_kind(const kv_offload *off);

/* The region, for a transport to register once: as kv_arena_regions (one
 * region). */
KV_API KV_NODISCARD kv_status kv_offload_regions(const kv_offload *off, struct kv_mem_region *out,
                                                 size_t cap, size_t *n);

/*
 * Post a store of blocks ids[n] of cache. Each block must be held (ref > 0)
 * and carry a committed hash; the tier retains each at post and releases it
 * when the op ends, so the caller may release its references meanwhile (and
 * the op holds a reference on cache until then). Each entry is keyed by the
 * block's hash and cache's block format; one already held only becomes the
 * most recent. *op set on success.
 * KV_ERR_NULL; KV_ERR_INVALID_ARG (id 0 or out of range, ids not 4-byte
 * aligned); KV_ERR_BAD_STATE (a block not held); KV_ERR_NOT_FOUND (a block
 * without a hash); KV_ERR_UNSUPPORTED (a device cache, in a build without CUDA or with a
 * region in plain host memory); KV_ERR_CAPACITY (a device cache on device
 * 16 or above, or
 * ops of 16 other cache layouts in flight: a tier keeps the copy plans of
 * at most 16 layouts, reusing the slot of one no op uses); KV_ERR_NO_MEMORY;
 * each naming the index and id; nothing is posted or retained on error.
 */
KV_API KV_NODISCARD kv_status kv_offload_store(kv_offload *off, kv_cache *cache,
                                               const uint32_t *ids, uint32_t n, kv_offload_op **op);

/*
 * Post a load of the entries of hashes[n] in cache's block format into n
 * new blocks of cache, allocated now
 * (kv_block_pool_alloc; they belong to the tier until the op is terminal,
 * and the op holds a reference on cache until then).
 * The worker looks each hash up when it reaches it, verifies the entry's
 * checksum, copies it into the block only when it matches (a corrupt entry
 * writes nothing) and, once every entry is done, commits each loaded
 * block's hash (kv_block_pool_commit_hash). Failed entries' blocks are
 * released uncommitted; a cancelled load commits nothing and releases every
 * block. A block whose hash another block of the pool carried at commit
 * stays uncommitted (committed false): it is still the caller's, with the
 * right bytes, to use or release.
 * KV_ERR_NULL; KV_ERR_INVALID_ARG (hashes not 8-byte aligned);
 * KV_ERR_NO_BLOCKS (the pool cannot give n blocks);
 * KV_ERR_UNSUPPORTED, KV_ERR_CAPACITY (as kv_offload_store);
 * KV_ERR_NO_MEMORY; nothing posted or allocated on error, and no cached
 * block of the pool evicted.
 */
KV_API KV_NODISCARD kv_status kv_offload_load(kv_offload *off, kv_cache *cache,
                                              const uint64_t *hashes, uint32_t n,
                                              kv_offload_op **op);

/* The op's state now, in *state. KV_ERR_NULL. */
KV_API KV_NODISCARD kv_status kv_offload_test(kv_offload_op *op, kv_offload_state *state);

/* Wait at most timeout_ms for a terminal state; *state (may be NULL) gets
 * the state seen last. KV_OK when terminal; KV_ERR_TIMEOUT otherwise;
 * KV_ERR_NULL. */
KV_API KV_NODISCARD kv_status kv_offload_wait(kv_offload_op *op, uint32_t timeout_ms,
                                              kv_offload_state *state);

/* Ask for cancellation: a queued op becomes CANCELLED now (its blocks
 * released); a running op ends CANCELLED at its next block boundary unless it
 * is already committing (it then ends DONE or FAILED); a terminal op is left
 * as it is. Entries a cancelled store already wrote stay (KV_OK in its
 * results). KV_OK in every case; KV_ERR_NULL. */
KV_API KV_NODISCARD kv_status kv_offload_cancel(kv_offload_op *op);

/* The op's per-entry results (*res points into the op, valid until
 * kv_offload_op_free; *n entries, the order posted). KV_ERR_NULL;
 * KV_ERR_BAD_STATE (not terminal yet). */
KV_API KV_NODISCARD kv_status kv_offload_results(kv_offload_op *op,
                                                 const struct kv_offload_result **res, uint32_t *n);

/* Free a terminal op (NULL is a no-op). KV_ERR_BAD_STATE (and nothing freed)
 * while it is pending or running: cancel and wait first. */
KV_API KV_NODISCARD kv_status kv_offload_op_free(kv_offload_op *op);

/* Drop the entries of hashes[n], in every block format, now (hashes not
 * held are skipped); an entry the worker is reading is unlinked now and
 * freed when the worker is done. *n_evicted (may be NULL) gets how many
 * entries were dropped. KV_ERR_NULL; KV_ERR_INVALID_ARG (hashes not 8-byte
 * aligned, nothing dropped); KV_ERR_BAD_STATE (the tier is destroyed, its
 * handle kept by a staging buffer still out). */
KV_API KV_NODISCARD kv_status kv_offload_evict(kv_offload *off, const uint64_t *hashes, uint32_t n,
                                               uint32_t *n_evicted);

/* True when the tier holds a complete entry for hash in cache's block
 * format; cache NULL: in any format. False for a NULL or destroyed tier. */
KV_API bool kv_offload_contains(kv_offload *off, const kv_cache *cache, uint64_t hash);

/* A snapshot of the counters. KV_ERR_NULL. */
KV_API KV_NODISCARD kv_status kv_offload_stats_get(kv_offload *off, struct kv_offload_stats *out);

/* A staging buffer of bytes (4 KiB aligned) carved from the region, so a
 * transport can use it without registering it; it counts against
 * staging_bytes as the whole pages it takes (a page at least).
 * KV_ERR_NULL; KV_ERR_INVALID_ARG (bytes 0); KV_ERR_CAPACITY (more than
 * staging_bytes in use at once); KV_ERR_NO_MEMORY (the region has no room);
 * KV_ERR_BAD_STATE (the tier is destroyed, other buffers still out). */
KV_API KV_NODISCARD kv_status kv_offload_staging_alloc(kv_offload *off, size_t bytes, void **ptr);

/* Return a staging buffer; after kv_offload_destroy, the last one returned
 * frees the region and the handle. KV_ERR_NULL; KV_ERR_INVALID_ARG (ptr not
 * a live staging buffer of this tier). */
KV_API KV_NODISCARD kv_status kv_offload_staging_free(kv_offload *off, void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* KV_OFFLOAD_H */
