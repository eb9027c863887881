/*
 * kv_offload_tier_int.h - the offload tier's state (kv_offload.h), shared by
 * its files (module-private):
 *
 *   kv_offload.c         create and destroy, posting store and load (the
 *                        formats of the caches it serves), ops (test, wait,
 *                        cancel, results, free), staging buffers;
 *   kv_offload_table.c   the entry table keyed by (hash, block key), the LRU
 *                        list and eviction, their invariants (checked after
 *                        every change in DEBUG builds), the table calls
 *                        (evict, contains, stats);
 *   kv_offload_worker.c  the worker thread: each op in chunks of blocks, table
 *                        work under off->mu, copies and checksums without it;
 *   kv_offload_carve.c   the region carver (kv_offload_int.h);
 *   kv_offload_dev_cuda.c the CUDA table of the device seam for device caches
 *                        (kv_offload_dev_int.h; CUDA builds only).
 *
 * One mutex (off->mu) guards the queue, the entry table, the LRU list, the
 * formats, the staging list and the stats; each op's mutex guards its state
 * (lock order: off->mu, then op->mu).
 *
 * Entries are keyed by (hash, block key): the block format fingerprint and
 * which of the model's heads a cache holds (kv__off_block_key); one hash may
 * have an entry under several keys, in one bucket (chosen by the hash).
 *
 * Invariants (off->mu held):
 *   entries == number of linked entries == length of the LRU list
 *   no two linked entries share (hash, block_fp)
 *   bytes   == sum of entry bytes over linked entries + unlinked pinned ones
 *   bytes   <= capacity_bytes
 *   linked && !ready  =>  pins > 0 (the worker is writing it)
 *   !linked           =>  pins > 0 (freed at the last unpin; a quarantined
 *                         one is never unpinned: freed at destroy)
 */
#ifndef KV_OFFLOAD_TIER_INT_H
#define KV_OFFLOAD_TIER_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "kv_offload.h"
#include "kv_offload_dev_int.h"
#include "kv_offload_int.h"
#include "kv_plan.h"

#define KV__OFF_MAX_FMTS 16
#define KV__OFF_CHUNK_BYTES ((int64_t)4 << 20) /* per chunk: cancel is seen between chunks */
#define KV__OFF_CHUNK_MIN 16                   /* blocks */
#define KV__OFF_CHUNK_MAX 1024
#define KV__OFF_ENTRY_ALIGN 64     /* a cache line */
#define KV__OFF_STAGING_ALIGN 4096 /* a page */
#define KV__OFF_MAX_DEVS 16        /* CUDA devices whose caches a tier serves */

/* One cache layout the tier has seen and its two plans. */
struct fmt {
    uint64_t cache_fp;             /* the cache layout's fingerprint */
    uint32_t head_offset;          /* the cache's first head in the model (kv_cache_head_offset) */
    uint64_t block_fp;             /* what a block holds (block_key): half of an entry's key */
    int64_t entry_bytes;           /* the compact block-major image of one block */
    struct kv_layout entry_layout; /* one entry as a one-block cache (device caches' copies) */
    int64_t stride_block_bytes;    /* cache: block id -> start */
    int64_t block_tokens;          /* N */
    kv_plan *to_entry, *to_block;  /* cache block -> entry, entry -> cache block */
    uint32_t users;                /* ops posted and not terminal that use it */
    bool sequential;               /* to_entry writes the entry front to back, gap-free:
                                      a store hashes each row as it lands (one pass) */
};

struct entry { /* keyed by (hash, block_fp) */
    uint64_t hash, sum;
    struct entry *hnext;               /* bucket chain */
    struct entry *lru_prev, *lru_next; /* head = least recently used */
    char *mem;                         /* [len] in the region */
    int64_t len;                       /* the entry's bytes (its format's entry_bytes) */
    int64_t bytes;                     /* what it takes of the region (its size class) */
    uint64_t block_fp;
    uint32_t pins; /* the worker reads or writes it */
    bool ready;    /* checksum taken: visible to loads and contains */
    bool linked;   /* in the table and the LRU list */
};

struct staging {
    void *p;
    size_t bytes;
};

struct kv_offload_op {
    pthread_mutex_t mu; /* guards state */
    pthread_cond_t cv;
    kv_offload_state state;
    atomic_bool cancel;
    bool is_load;
    kv_offload *off;
    kv_cache *cache; /* a reference (kv_cache_retain) from post until terminal */
    kv_block_pool *pool;
    char *base; /* the cache's storage */
    bool dev;   /* a KV_MEM_DEVICE cache: copies on the tier's stream (kv_offload_dev_int.h) */
    int device; /* its CUDA device (dev) */
    struct kv_paged_cache pc; /* the cache's storage as the plan copy takes it (dev) */
    int fmt;
    uint32_t n;
    uint32_t *ids;                 /* [n] store: retained blocks; load: allocated blocks */
    struct kv_offload_result *res; /* [n] */
    struct kv_offload_op *qnext;
};

struct kv_offload {
    struct kv_offload_config cfg;
    kv_arena *arena;
    kv__carver *carver;
    enum kv_mem_kind kind;
    int threads;
    pthread_t worker;
    /* the device seam (NULL: device caches refused) and, per device, the
     * tier's own stream and event: made by the worker on first use, used
     * only by it, destroyed by it as it exits (every seam call sets the
     * calling thread's CUDA device: none is made on an engine's thread) */
    const struct kv__offdev_ops *dev;
    void *dev_stream[KV__OFF_MAX_DEVS];
    void *dev_event[KV__OFF_MAX_DEVS];
    /* a wait on the tier's stream failed, and so did the stream synchronize:
     * copies on it may still run; every later chunk on the device fails
     * without issuing (dev_why: the error, worker only) */
    bool dev_broken[KV__OFF_MAX_DEVS];
    char dev_why[200];

    pthread_mutex_t mu; /* guards everything below */
    bool destroyed;     /* kv_offload_destroy ran; the handle lives while n_stg > 0 or
                           n_holds > 0 */
    uint32_t n_holds;   /* holds of the region (kv__offload_region_hold: a transport's
                           registration of it) */
    pthread_cond_t cv;  /* the worker waits for work */
    kv_offload_op *qhead, *qtail;
    kv_offload_op *running;
    bool stopping;
    struct fmt fmts[KV__OFF_MAX_FMTS];
    int n_fmts;
    struct entry **buckets;
    size_t n_buckets; /* a power of two */
    struct entry *lru_head, *lru_tail;
    struct staging *stg;
    size_t n_stg, cap_stg;
    struct kv_offload_stats st;
    kv__offload_hook_fn hook;
    void *hook_user;
    uint32_t chunk; /* blocks per chunk; 0: KV__OFF_CHUNK_BYTES of entries */
    /* what a copy that may still run touches, kept until destroy (after the
     * worker destroyed its streams): entries (unlinked, pinned, counted in
     * st.bytes, chained by hnext) and the records of kv_offload_worker.c */
    struct entry *quar_entries;
    struct kv__off_quar *quar;
};

/* A chunk whose copies may still run (the wait and the stream synchronize
 * failed): the op's cache kept (a reference: its device memory is not
 * freed) and, for a load, the blocks they write (never released to the
 * pool, so never reused) until kv_offload_destroy. */
struct kv__off_quar {
    struct kv__off_quar *next;
    kv_cache *cache;
    kv_block_pool *pool;
    uint32_t n;        /* blocks[n] */
    uint32_t blocks[]; /* load: allocated at post, held */
};

/* kv_offload.c */
bool kv__off_terminal(kv_offload_state s);
/* off->mu held: op ends in fin (terminal): its cache reference dropped, its
 * waiters woken. */
void kv__off_op_finish(kv_offload *off, kv_offload_op *op, kv_offload_state fin);

/* kv_offload_table.c (off->mu held) */
uint64_t kv__off_block_key(const struct kv_layout *lo, uint32_t head_offset);
struct entry *kv__off_find(kv_offload *off, uint64_t h, uint64_t fp);
struct entry *kv__off_find_any(kv_offload *off, uint64_t h, bool ready_only);
void kv__off_lru_unlink(kv_offload *off, struct entry *e);
void kv__off_lru_append(kv_offload *off, struct entry *e);
void kv__off_lru_touch(kv_offload *off, struct entry *e);
void kv__off_table_insert(kv_offload *off, struct entry *e);
void kv__off_entry_free(kv_offload *off, struct entry *e);
void kv__off_table_remove(kv_offload *off, struct entry *e);
void kv__off_unpin(kv_offload *off, struct entry *e);
void kv__off_debug_check(const kv_offload *off);
bool kv__off_evict_one(kv_offload *off);

/* kv_offload_worker.c */
void kv__off_hook_call(kv_offload *off, enum kv__offload_hook_at at, kv_offload_op *op);
void *kv__off_worker_main(void *arg);

#endif /* KV_OFFLOAD_TIER_INT_H */
