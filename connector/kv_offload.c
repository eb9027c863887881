/*
 * kv_offload.c - the host offload tier (kv_offload.h).
 *
 * One mutex (off->mu) guards the queue, the entry table, the LRU list, the
 * formats, the staging list and the stats; each op's mutex guards its state
 * (lock order: off->mu, then op->mu). The worker takes an op, and for each
 * chunk of blocks does its table work under off->mu, then copies (and
 * checksums) with no lock held, then publishes under off->mu.
 *
 * Entries are keyed by (hash, block format fingerprint): one hash may have
 * an entry in each format, in one bucket (chosen by the hash).
 *
 * Invariants (off->mu held):
 *   entries == number of linked entries == length of the LRU list
 *   no two linked entries share (hash, block_fp)
 *   bytes   == sum of entry bytes over linked entries + unlinked pinned ones
 *   bytes   <= capacity_bytes
 *   linked && !ready  =>  pins > 0 (the worker is writing it)
 *   !linked           =>  pins > 0 (freed at the last unpin)
 */
#include <inttypes.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_attn.h"
#include "kv_lib.h"
#include "kv_mem.h"
#include "kv_offload.h"
#include "kv_offload_int.h"
#include "kv_pack.h"
#include "kv_plan_int.h"

#define KV__OFF_MAX_FMTS 16
#define KV__OFF_CHUNK_BYTES ((int64_t)4 << 20) /* per chunk: cancel is seen between chunks */
#define KV__OFF_CHUNK_MIN 16                   /* blocks */
#define KV__OFF_CHUNK_MAX 1024
#define KV__OFF_ENTRY_ALIGN 64     /* a cache line */
#define KV__OFF_STAGING_ALIGN 4096 /* a page */

/* One cache layout the tier has seen and its two plans. */
struct fmt {
    uint64_t cache_fp;            /* the cache layout's fingerprint */
    uint32_t head_offset;         /* the cache's first head in the model (kv_cache_head_offset) */
    uint64_t block_fp;            /* what a block holds (block_key): half of an entry's key */
    int64_t entry_bytes;          /* the compact block-major image of one block */
    int64_t stride_block_bytes;   /* cache: block id -> start */
    int64_t block_tokens;         /* N */
    kv_plan *to_entry, *to_block; /* cache block -> entry, entry -> cache block */
    uint32_t users;               /* ops posted and not terminal that use it */
    bool sequential;              /* to_entry writes the entry front to back, gap-free:
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

    pthread_mutex_t mu; /* guards everything below */
    bool destroyed;     /* kv_offload_destroy ran; the handle lives while n_stg > 0 */
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
};

const char *kv_offload_state_name(kv_offload_state s)
{
    switch (s) {
    case KV_OFFLOAD_PENDING:
        return "pending";
    case KV_OFFLOAD_RUNNING:
        return "running";
    case KV_OFFLOAD_DONE:
        return "done";
    case KV_OFFLOAD_FAILED:
        return "failed";
    case KV_OFFLOAD_CANCELLED:
        return "cancelled";
    }
    return "unknown";
}

static bool terminal(kv_offload_state s)
{
    return s == KV_OFFLOAD_DONE || s == KV_OFFLOAD_FAILED || s == KV_OFFLOAD_CANCELLED;
}

/* ---- the table and the LRU list (off->mu held) --------------------------- */

static size_t bucket_of(const kv_offload *off, uint64_t h)
{
    return (size_t)((h * 0x9E3779B97F4A7C15ull) >> 17) & (off->n_buckets - 1);
}

/* The entry of (h, block format fp); entries of one hash in several formats
 * share a bucket. */
static struct entry *find(kv_offload *off, uint64_t h, uint64_t fp)
{
    for (struct entry *e = off->buckets[bucket_of(off, h)]; e; e = e->hnext)
        if (e->hash == h && e->block_fp == fp)
            return e;
    return NULL;
}

/* An entry of h in any format (ready_only: a complete one). */
static struct entry *find_any(kv_offload *off, uint64_t h, bool ready_only)
{
    for (struct entry *e = off->buckets[bucket_of(off, h)]; e; e = e->hnext)
        if (e->hash == h && (e->ready || !ready_only))
            return e;
    return NULL;
}

static void lru_unlink(kv_offload *off, struct entry *e)
{
    if (e->lru_prev)
        e->lru_prev->lru_next = e->lru_next;
    else
        off->lru_head = e->lru_next;
    if (e->lru_next)
        e->lru_next->lru_prev = e->lru_prev;
    else
        off->lru_tail = e->lru_prev;
    e->lru_prev = e->lru_next = NULL;
}

static void lru_append(kv_offload *off, struct entry *e)
{
    e->lru_prev = off->lru_tail;
    e->lru_next = NULL;
    if (off->lru_tail)
        off->lru_tail->lru_next = e;
    else
        off->lru_head = e;
    off->lru_tail = e;
}

static void lru_touch(kv_offload *off, struct entry *e)
{
    lru_unlink(off, e);
    lru_append(off, e);
}

/* Double the buckets when entries outgrow them (false: no memory, keep them). */
static void table_grow(kv_offload *off)
{
    if (off->st.entries < off->n_buckets)
        return;
    const size_t nb = off->n_buckets * 2;
    struct entry **b = kv__mem_calloc(nb, sizeof(*b));
    if (!b)
        return; /* longer chains, still correct */
    struct entry **old = off->buckets;
    const size_t on = off->n_buckets;
    off->buckets = b;
    off->n_buckets = nb;
    for (size_t i = 0; i < on; i++)
        for (struct entry *e = old[i], *n; e; e = n) {
            n = e->hnext;
            const size_t k = bucket_of(off, e->hash);
            e->hnext = b[k];
            b[k] = e;
        }
    kv__mem_free(old);
}

static void table_insert(kv_offload *off, struct entry *e)
{
    const size_t k = bucket_of(off, e->hash);
    e->hnext = off->buckets[k];
    off->buckets[k] = e;
    e->linked = true;
    lru_append(off, e);
    off->st.entries++;
    table_grow(off);
}

static void entry_free(kv_offload *off, struct entry *e)
{
    kv__carver_free(off->carver, e->mem);
    off->st.bytes -= (uint64_t)e->bytes;
    kv__mem_free(e);
}

/* Take e out of the table and the LRU list; free it unless the worker holds it. */
static void table_remove(kv_offload *off, struct entry *e)
{
    struct entry **pp = &off->buckets[bucket_of(off, e->hash)];
    while (*pp != e)
        pp = &(*pp)->hnext;
    *pp = e->hnext;
    lru_unlink(off, e);
    e->linked = false;
    off->st.entries--;
    if (e->pins == 0)
        entry_free(off, e);
}

static void unpin(kv_offload *off, struct entry *e)
{
    if (--e->pins == 0 && !e->linked)
        entry_free(off, e);
}

/* The invariants at the top of this file, walked in full (off->mu held):
 * KV_ERR_INTERNAL naming the first one broken. */
static kv_status table_check_locked(const kv_offload *off)
{
    uint64_t linked = 0, bytes = 0, n_lru = 0;
    for (size_t i = 0; i < off->n_buckets; i++)
        for (const struct entry *e = off->buckets[i]; e; e = e->hnext) {
            if (!e->linked || bucket_of(off, e->hash) != i)
                return kv__error(KV_ERR_INTERNAL,
                                 "kv_offload: entry 0x%016" PRIx64 " in bucket %zu: linked %d",
                                 e->hash, i, (int)e->linked);
            if (!e->ready && e->pins == 0)
                return kv__error(KV_ERR_INTERNAL,
                                 "kv_offload: entry 0x%016" PRIx64 " neither ready nor pinned",
                                 e->hash);
            for (const struct entry *o = e->hnext; o; o = o->hnext)
                if (o->hash == e->hash && o->block_fp == e->block_fp)
                    return kv__error(KV_ERR_INTERNAL,
                                     "kv_offload: two entries of (0x%016" PRIx64 ", 0x%016" PRIx64
                                     ")",
                                     e->hash, e->block_fp);
            linked++;
            bytes += (uint64_t)e->bytes;
        }
    for (const struct entry *e = off->lru_head, *prev = NULL; e; prev = e, e = e->lru_next) {
        if (e->lru_prev != prev || !e->linked)
            return kv__error(KV_ERR_INTERNAL, "kv_offload: LRU list broken at 0x%016" PRIx64,
                             e->hash);
        if (!e->lru_next && off->lru_tail != e)
            return kv__error(KV_ERR_INTERNAL, "kv_offload: LRU tail is not the last entry");
        n_lru++;
    }
    if (linked != off->st.entries || n_lru != linked || bytes > off->st.bytes ||
        off->st.bytes > off->cfg.capacity_bytes)
        return kv__error(
            KV_ERR_INTERNAL,
            "kv_offload: %" PRIu64 " linked entries, %" PRIu64 " on the LRU list, %" PRIu64
            " bytes linked; counters: entries %" PRIu64 ", bytes %" PRIu64 " (capacity %zu)",
            linked, n_lru, bytes, off->st.entries, off->st.bytes, off->cfg.capacity_bytes);
    return KV_OK;
}

/* After each change of the table, off->mu held: the full walk in DEBUG=1
 * builds. A failure is a bug in this file: abort with the message. */
static void debug_check(const kv_offload *off)
{
#if defined(KV_DEBUG_CHECKS)
    if (table_check_locked(off) != KV_OK) {
        fprintf(stderr, "kvcache: %s\n", kv_last_error());
        abort();
    }
#else
    (void)off;
    (void)table_check_locked;
#endif
}

/* Evict the least recently used entry nobody holds; false when none. */
static bool evict_one(kv_offload *off)
{
    for (struct entry *e = off->lru_head; e; e = e->lru_next)
        if (e->pins == 0) {
            table_remove(off, e);
            off->st.evictions++;
            return true;
        }
    return false;
}

/* ---- create / destroy ---------------------------------------------------- */

static void *worker_main(void *arg);

kv_status kv_offload_create(const struct kv_offload_config *cfg, kv_offload **out)
{
    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "kv_offload_create: %s is NULL", !cfg ? "cfg" : "out");
    kv_status st = kv__check_struct_size("kv_offload_create", "kv_offload_config", cfg->struct_size,
                                         sizeof(*cfg));
    if (st != KV_OK)
        return st;
    if (cfg->capacity_bytes == 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_offload_create: capacity_bytes is 0");
    if (cfg->mem != KV_OFFLOAD_MEM_AUTO && cfg->mem != KV_OFFLOAD_MEM_HOST &&
        cfg->mem != KV_OFFLOAD_MEM_PINNED)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_offload_create: unknown mem %d (auto 0, host 1, pinned 2)",
                         (int)cfg->mem);
    if (cfg->threads < 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_offload_create: threads %d < 0", cfg->threads);
    size_t slack =
        cfg->slack_bytes ? cfg->slack_bytes : ((size_t)8 << 20) + cfg->capacity_bytes / 32;
    size_t region;
    if (__builtin_add_overflow(cfg->capacity_bytes, cfg->staging_bytes, &region) ||
        __builtin_add_overflow(region, slack, &region))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_offload_create: capacity %zu + staging %zu + slack %zu overflows",
                         cfg->capacity_bytes, cfg->staging_bytes, slack);

    kv_offload *off = kv__mem_calloc(1, sizeof(*off));
    if (!off)
        return kv__error(KV_ERR_NO_MEMORY, "kv_offload_create: %zu bytes", sizeof(*off));
    off->cfg = *cfg;
    off->threads = cfg->threads ? cfg->threads : kv_attn_threads();
    off->chunk = 0; /* by bytes (chunk_of) */
    off->n_buckets = 1024;
    off->buckets = kv__mem_calloc(off->n_buckets, sizeof(*off->buckets));
    if (!off->buckets) {
        st = kv__error(KV_ERR_NO_MEMORY, "kv_offload_create: table");
        goto undo_off;
    }

    /* the region: pinned first where asked or where it may exist */
    struct kv_arena_config ac;
    kv_arena_config_init(&ac, region);
    ac.kind = cfg->mem == KV_OFFLOAD_MEM_HOST ? KV_MEM_HOST : KV_MEM_PINNED;
    st = kv_arena_create(&ac, &off->arena);
    if (st == KV_ERR_UNSUPPORTED && cfg->mem == KV_OFFLOAD_MEM_AUTO) {
        ac.kind = KV_MEM_HOST; /* no CUDA or no GPU: plain host memory */
        st = kv_arena_create(&ac, &off->arena);
    }
    if (st != KV_OK) {
        st = kv__error_wrap(st, "kv_offload_create: a %s region of %zu bytes",
                            kv_mem_kind_name(ac.kind), region);
        goto undo_table;
    }
    off->kind = kv_arena_kind(off->arena);
    st = kv__carver_create(kv_arena_base(off->arena), kv_arena_size(off->arena), &off->carver);
    if (st != KV_OK) {
        st = kv__error_wrap(st, "kv_offload_create");
        goto undo_arena;
    }
    off->st.capacity_bytes = cfg->capacity_bytes;
    off->st.region_bytes = kv_arena_size(off->arena);

    pthread_mutex_init(&off->mu, NULL);
    pthread_cond_init(&off->cv, NULL);
    int e = pthread_create(&off->worker, NULL, worker_main, off);
    if (e != 0) {
        st = kv__error(KV_ERR_INTERNAL, "kv_offload_create: pthread_create failed (%s)",
                       strerror(e));
        goto undo_sync;
    }
    *out = off;
    return kv__ok();

undo_sync:
    pthread_cond_destroy(&off->cv);
    pthread_mutex_destroy(&off->mu);
    kv__carver_destroy(off->carver);
undo_arena:
    kv_arena_destroy(off->arena);
undo_table:
    kv__mem_free(off->buckets);
undo_off:
    kv__mem_free(off);
    return st;
}

/* The op's final state: release what it holds, then publish (the op may be
 * freed by its owner the moment the state is terminal). */
static void op_finish(kv_offload *off, kv_offload_op *op, kv_offload_state fin)
{
    if (!op->is_load) {
        if (kv_block_pool_release(op->pool, op->ids, op->n) != KV_OK)
            abort(); /* retained at post: cannot fail */
    } else if (fin == KV_OFFLOAD_CANCELLED) {
        for (uint32_t i = 0; i < op->n; i++)
            if (op->res[i].block != KV_BLOCK_NULL) {
                if (kv_block_pool_release(op->pool, &op->res[i].block, 1) != KV_OK)
                    abort();
                op->res[i].block = KV_BLOCK_NULL;
            }
    }
    /* a cancelled load: what was verified but not committed is cancelled too */
    if (fin == KV_OFFLOAD_CANCELLED && op->is_load)
        for (uint32_t i = 0; i < op->n; i++)
            if (op->res[i].status == KV_OK)
                op->res[i].status = KV_ERR_CANCELLED;
    /* the op's reference on its cache, with no lock held: when the engine
     * has destroyed the cache meanwhile, this frees it (on this thread) */
    kv_cache_destroy(op->cache);
    op->cache = NULL;
    op->pool = NULL;
    op->base = NULL;
    pthread_mutex_lock(&off->mu);
    if (fin == KV_OFFLOAD_FAILED)
        off->st.failed_ops++;
    if (fin == KV_OFFLOAD_CANCELLED)
        off->st.cancelled_ops++;
    if (off->running == op)
        off->running = NULL;
    off->fmts[op->fmt].users--;
    pthread_mutex_unlock(&off->mu);
    pthread_mutex_lock(&op->mu);
    op->state = fin;
    pthread_cond_broadcast(&op->cv);
    pthread_mutex_unlock(&op->mu);
}

/* The region and the handle: at destroy, or at the last staging buffer
 * returned after it. */
static void tier_free(kv_offload *off)
{
    kv__mem_free(off->stg);
    kv__carver_destroy(off->carver);
    kv_arena_destroy(off->arena);
    pthread_cond_destroy(&off->cv);
    pthread_mutex_destroy(&off->mu);
    kv__mem_free(off);
}

void kv_offload_destroy(kv_offload *off)
{
    if (!off)
        return;
    pthread_mutex_lock(&off->mu);
    off->stopping = true;
    kv_offload_op *q = off->qhead;
    off->qhead = off->qtail = NULL;
    if (off->running)
        atomic_store(&off->running->cancel, true);
    pthread_cond_broadcast(&off->cv);
    pthread_mutex_unlock(&off->mu);
    while (q) {
        kv_offload_op *n = q->qnext;
        op_finish(off, q, KV_OFFLOAD_CANCELLED);
        q = n;
    }
    pthread_join(off->worker, NULL);
    /* no op is left and no worker: the entries (their pieces go with the
     * region) and the plans */
    pthread_mutex_lock(&off->mu);
    for (size_t i = 0; i < off->n_buckets; i++)
        for (struct entry *e = off->buckets[i], *n; e; e = n) {
            n = e->hnext;
            kv__mem_free(e);
        }
    kv__mem_free(off->buckets);
    off->buckets = NULL;
    off->n_buckets = 0;
    off->lru_head = off->lru_tail = NULL;
    off->st.entries = off->st.bytes = 0;
    for (int i = 0; i < off->n_fmts; i++) {
        kv_plan_destroy(off->fmts[i].to_entry);
        kv_plan_destroy(off->fmts[i].to_block);
    }
    off->n_fmts = 0;
    /* staging buffers still out keep the region until the last is returned */
    off->destroyed = true;
    const bool last = off->n_stg == 0;
    pthread_mutex_unlock(&off->mu);
    if (last)
        tier_free(off);
}

enum kv_mem_kind kv_offload_mem_kind(const kv_offload *off)
{
    return off ? off->kind : KV_MEM_HOST;
}

kv_status kv_offload_regions(const kv_offload *off, struct kv_mem_region *out, size_t cap,
                             size_t *n)
{
    if (!off)
        return kv__error(KV_ERR_NULL, "kv_offload_regions: off is NULL");
    return kv_arena_regions(off->arena, out, cap, n);
}

/* ---- posting ------------------------------------------------------------- */

/* What a block of a cache holds, as half of an entry's key: the block
 * format (layers, N, H, D, dtype, order, packing) and which of the model's
 * heads those are (tensor-parallel ranks of one group share a format). */
static uint64_t block_key(const struct kv_layout *lo, uint32_t head_offset)
{
    if (head_offset == 0)
        return lo->block_format_fingerprint;
    const uint64_t k[2] = {lo->block_format_fingerprint, head_offset};
    return kv__xxh3_64(k, sizeof(k));
}

/* The format of cache's layout (made on first use: two plans), off->mu held. */
static kv_status fmt_get(kv_offload *off, const char *fn, const struct kv_layout *lo,
                         uint32_t head_offset, int *idx)
{
    int slot = -1;
    for (int i = 0; i < off->n_fmts; i++)
        if (off->fmts[i].cache_fp == lo->fingerprint && off->fmts[i].head_offset == head_offset) {
            off->fmts[i].users++;
            *idx = i;
            return KV_OK;
        }
    if (off->n_fmts < KV__OFF_MAX_FMTS) {
        slot = off->n_fmts;
    } else { /* reuse the slot of a layout no op in flight uses */
        for (int i = 0; i < off->n_fmts && slot < 0; i++)
            if (off->fmts[i].users == 0)
                slot = i;
        if (slot < 0)
            return kv__error(KV_ERR_CAPACITY,
                             "%s: ops of %d other cache layouts are in flight (the most a tier "
                             "serves at once)",
                             fn, KV__OFF_MAX_FMTS);
    }
    /* an entry is one block in the pack payload's format: the cache's block
     * format, block-major, unpadded (the same layout, so the same code) */
    struct kv_layout el;
    kv_status st = kv_pack_wire_layout(lo, &el);
    struct fmt f = {.cache_fp = lo->fingerprint,
                    .head_offset = head_offset,
                    .block_fp = block_key(lo, head_offset), /* lo's and el's block format */
                    .entry_bytes = el.total_bytes,
                    .stride_block_bytes = lo->stride_block_bytes,
                    .block_tokens = lo->block_tokens};
    if (st == KV_OK)
        st = kv_plan_create(lo, &el, NULL, &f.to_entry);
    if (st == KV_OK)
        st = kv_plan_create(&el, lo, NULL, &f.to_block);
    if (st == KV_OK)
        f.sequential = kv__plan_is_sequential(f.to_entry, f.entry_bytes);
    if (st != KV_OK) {
        kv_plan_destroy(f.to_entry);
        return kv__error_wrap(st, "%s: the entry format of a cache layout", fn);
    }
    if (slot < off->n_fmts) {
        kv_plan_destroy(off->fmts[slot].to_entry);
        kv_plan_destroy(off->fmts[slot].to_block);
    } else {
        off->n_fmts++;
    }
    f.users = 1;
    off->fmts[slot] = f;
    *idx = slot;
    return KV_OK;
}

/* The cache's storage, checked as the CPU kernels check theirs. */
static kv_status cache_side(const char *fn, kv_cache *cache, struct kv_paged_cache *pc)
{
    kv_status st = kv_attn_cache(cache, pc);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: cache", fn);
    if (pc->mem == KV_MEM_DEVICE)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: a device cache: the offload tier has no CUDA executor yet", fn);
    st = kv_attn_cache_check(pc, false);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: cache", fn);
    return KV_OK;
}

static kv_offload_op *op_new(uint32_t n)
{
    kv_offload_op *op = kv__mem_calloc(1, sizeof(*op));
    if (!op)
        return NULL;
    const size_t k = n ? n : 1;
    op->ids = kv__mem_calloc(k, sizeof(*op->ids));
    op->res = kv__mem_calloc(k, sizeof(*op->res));
    if (!op->ids || !op->res) {
        kv__mem_free(op->ids);
        kv__mem_free(op->res);
        kv__mem_free(op);
        return NULL;
    }
    pthread_mutex_init(&op->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&op->cv, &ca);
    pthread_condattr_destroy(&ca);
    atomic_init(&op->cancel, false);
    op->n = n;
    return op;
}

static void op_delete(kv_offload_op *op)
{
    pthread_cond_destroy(&op->cv);
    pthread_mutex_destroy(&op->mu);
    kv__mem_free(op->ids);
    kv__mem_free(op->res);
    kv__mem_free(op);
}

/* Queue op (its format looked up / made under the same lock); on success
 * the op holds a reference on cache until it is terminal (op_finish). */
static kv_status post(kv_offload *off, const char *fn, kv_offload_op *op, kv_cache *cache,
                      const struct kv_layout *lo)
{
    pthread_mutex_lock(&off->mu);
    kv_status st = KV_OK;
    if (off->stopping)
        st = kv__error(KV_ERR_BAD_STATE, "%s: the tier is being destroyed", fn);
    if (st == KV_OK)
        st = fmt_get(off, fn, lo, kv_cache_head_offset(cache), &op->fmt);
    if (st == KV_OK) {
        op->off = off;
        op->cache = kv_cache_retain(cache); /* before the worker can see the op */
        op->state = KV_OFFLOAD_PENDING;
        if (off->qtail)
            off->qtail->qnext = op;
        else
            off->qhead = op;
        off->qtail = op;
        pthread_cond_signal(&off->cv);
    }
    pthread_mutex_unlock(&off->mu);
    return st;
}

/* The start of both posts: the pointers, the cache's storage, a new op of n
 * entries (*o). Nothing is held on failure. */
static kv_status post_begin(const char *fn, kv_offload *off, kv_cache *cache, const void *list,
                            const char *list_name, uint32_t n, kv_offload_op **op,
                            struct kv_paged_cache *pc, kv_offload_op **o)
{
    if (!off || !cache || !op || (n > 0 && !list))
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn,
                         !off     ? "off"
                         : !cache ? "cache"
                         : !op    ? "op"
                                  : list_name);
    kv_status st = cache_side(fn, cache, pc);
    if (st != KV_OK)
        return st;
    if (!(*o = op_new(n)))
        return kv__error(KV_ERR_NO_MEMORY, "%s: an op of %u blocks", fn, n);
    return KV_OK;
}

kv_status kv_offload_store(kv_offload *off, kv_cache *cache, const uint32_t *ids, uint32_t n,
                           kv_offload_op **op)
{
    static const char fn[] = "kv_offload_store";
    struct kv_paged_cache pc;
    kv_offload_op *o = NULL;
    kv_status st = post_begin(fn, off, cache, ids, "ids", n, op, &pc, &o);
    if (st != KV_OK)
        return st;
    kv_block_pool *pool = kv_cache_pool(cache);
    /* retained first: that also proves each id is in range and held */
    st = kv_block_pool_retain(pool, ids, n);
    if (st != KV_OK) {
        op_delete(o);
        return kv__error_wrap(st, "%s: the blocks must be held by the caller", fn);
    }
    for (uint32_t i = 0; i < n; i++) {
        uint64_t h;
        if (kv_block_pool_block_hash(pool, ids[i], &h) != KV_OK) {
            st = kv__error(KV_ERR_NOT_FOUND,
                           "%s: ids[%u] = %u carries no committed hash (only full, committed "
                           "blocks are stored)",
                           fn, i, ids[i]);
            break;
        }
        o->ids[i] = ids[i];
        o->res[i] = (struct kv_offload_result){h, ids[i], KV_ERR_CANCELLED, false};
    }
    o->pool = pool;
    o->base = pc.base;
    if (st == KV_OK)
        st = post(off, fn, o, cache, &pc.layout);
    if (st != KV_OK) { /* undo the retains, keeping the error's words */
        kv__error_mute();
        const kv_status rs = kv_block_pool_release(pool, ids, n);
        kv__error_unmute();
        if (rs != KV_OK)
            abort(); /* retained above */
        op_delete(o);
        return st;
    }
    *op = o;
    return kv__ok();
}

kv_status kv_offload_load(kv_offload *off, kv_cache *cache, const uint64_t *hashes, uint32_t n,
                          kv_offload_op **op)
{
    static const char fn[] = "kv_offload_load";
    struct kv_paged_cache pc;
    kv_offload_op *o = NULL;
    kv_status st = post_begin(fn, off, cache, hashes, "hashes", n, op, &pc, &o);
    if (st != KV_OK)
        return st;
    kv_block_pool *pool = kv_cache_pool(cache);
    o->is_load = true;
    o->pool = pool;
    o->base = pc.base;
    st = kv_block_pool_alloc(pool, n, o->ids);
    if (st != KV_OK) {
        op_delete(o);
        return kv__error_wrap(st, "%s: %u blocks for the loaded entries", fn, n);
    }
    for (uint32_t i = 0; i < n; i++)
        o->res[i] = (struct kv_offload_result){hashes[i], o->ids[i], KV_OK, false};
    st = post(off, fn, o, cache, &pc.layout);
    if (st != KV_OK) { /* undo the allocation, keeping the error's words */
        kv__error_mute();
        const kv_status rs = kv_block_pool_release(pool, o->ids, n);
        kv__error_unmute();
        if (rs != KV_OK)
            abort(); /* allocated above */
        op_delete(o);
        return st;
    }
    *op = o;
    return kv__ok();
}

/* ---- the worker ---------------------------------------------------------- */

static void hook_call(kv_offload *off, enum kv__offload_hook_at at, kv_offload_op *op)
{
    pthread_mutex_lock(&off->mu);
    kv__offload_hook_fn fn = off->hook;
    void *user = off->hook_user;
    pthread_mutex_unlock(&off->mu);
    if (fn)
        fn(user, at, op);
}

/* One block. Store: copy the block into the entry, then checksum the entry.
 * Load: checksum the entry first and copy it into the block only when the
 * sum is the one taken at store, so a corrupt entry never reaches a block.
 * Returns the entry's sum. */
static uint64_t move_block(const struct fmt *f, bool load, char *blk, char *ent, uint64_t want)
{
    const int64_t N = f->block_tokens;
    if (load) {
        const uint64_t sum = kv__xxh3_64(ent, (size_t)f->entry_bytes);
        if (sum == want) {
            const char *s = ent;
            kv__plan_exec_cpu(f->to_block, &s, 1, &blk, 1, (uint64_t)N, 1);
        }
        return sum;
    }
    if (f->sequential) /* copy a row, hash it while it is in cache */
        return kv__plan_copy_hash(f->to_entry, blk, ent);
    const char *s = blk;
    kv__plan_exec_cpu(f->to_entry, &s, 1, &ent, 1, (uint64_t)N, 1);
    return kv__xxh3_64(ent, (size_t)f->entry_bytes);
}

/* The copies of one chunk: slot[i] the entry of block i (NULL: nothing). */
static void move_chunk(const kv_offload *off, const struct fmt *f, kv_offload_op *op, uint32_t i0,
                       uint32_t k, struct entry *const *slot, uint64_t *sum)
{
    const int nt = off->threads < (int)k ? off->threads : (int)k;
    if (nt > 1) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (uint32_t j = 0; j < k; j++)
            if (slot[j])
                sum[j] = move_block(f, op->is_load,
                                    op->base + (int64_t)op->ids[i0 + j] * f->stride_block_bytes,
                                    slot[j]->mem, slot[j]->sum);
    } else { /* no OpenMP runtime on this path (the TSan tests take it) */
        for (uint32_t j = 0; j < k; j++)
            if (slot[j])
                sum[j] = move_block(f, op->is_load,
                                    op->base + (int64_t)op->ids[i0 + j] * f->stride_block_bytes,
                                    slot[j]->mem, slot[j]->sum);
    }
}

/* Store: returns true when cancelled. */
static bool run_store(kv_offload *off, kv_offload_op *op, const struct fmt *f, uint32_t chunk,
                      struct entry **slot, uint64_t *sum)
{
    /* an entry counts what it takes of the region: its carver size class */
    const uint64_t eb =
        (uint64_t)kv__carver_size(off->carver, (size_t)f->entry_bytes, KV__OFF_ENTRY_ALIGN);
    for (uint32_t i0 = 0; i0 < op->n; i0 += chunk) {
        if (atomic_load(&op->cancel))
            return true; /* the rest stay KV_ERR_CANCELLED */
        const uint32_t k = op->n - i0 < chunk ? op->n - i0 : chunk;
        pthread_mutex_lock(&off->mu);
        for (uint32_t j = 0; j < k; j++) {
            struct kv_offload_result *r = &op->res[i0 + j];
            slot[j] = NULL;
            struct entry *e = find(off, r->hash, f->block_fp);
            if (e) { /* held already in this format (or being written by this chunk) */
                lru_touch(off, e);
                off->st.store_touches++;
                r->status = KV_OK;
                continue;
            }
            r->status = KV_ERR_CAPACITY;
            if (eb > off->cfg.capacity_bytes)
                continue;
            bool room = true;
            while (room && off->st.bytes + eb > off->cfg.capacity_bytes)
                room = evict_one(off);
            if (!room)
                continue;
            e = kv__mem_calloc(1, sizeof(*e));
            const size_t want = (size_t)f->entry_bytes;
            char *mem = e ? kv__carver_alloc(off->carver, want, KV__OFF_ENTRY_ALIGN) : NULL;
            while (e && !mem && evict_one(off))
                mem = kv__carver_alloc(off->carver, want, KV__OFF_ENTRY_ALIGN);
            if (!mem) {
                kv__mem_free(e);
                r->status = KV_ERR_NO_MEMORY;
                continue;
            }
            *e = (struct entry){.hash = r->hash,
                                .mem = mem,
                                .len = f->entry_bytes,
                                .bytes = (int64_t)eb,
                                .block_fp = f->block_fp,
                                .pins = 1};
            off->st.bytes += eb;
            table_insert(off, e);
            slot[j] = e;
        }
        debug_check(off);
        pthread_mutex_unlock(&off->mu);
        move_chunk(off, f, op, i0, k, slot, sum);
        pthread_mutex_lock(&off->mu);
        for (uint32_t j = 0; j < k; j++)
            if (slot[j]) {
                slot[j]->sum = sum[j];
                slot[j]->ready = true;
                unpin(off, slot[j]);
                op->res[i0 + j].status = KV_OK;
                off->st.stores++;
            }
        debug_check(off);
        pthread_mutex_unlock(&off->mu);
        hook_call(off, KV__OFFLOAD_HOOK_BLOCK, op);
    }
    return false;
}

/* Load: copy and verify every entry; returns true when cancelled. Results:
 * KV_OK = copied and verified (not committed yet). */
static bool run_load(kv_offload *off, kv_offload_op *op, const struct fmt *f, uint32_t chunk,
                     struct entry **slot, uint64_t *sum)
{
    for (uint32_t i0 = 0; i0 < op->n; i0 += chunk) {
        if (atomic_load(&op->cancel))
            return true;
        const uint32_t k = op->n - i0 < chunk ? op->n - i0 : chunk;
        pthread_mutex_lock(&off->mu);
        for (uint32_t j = 0; j < k; j++) {
            struct kv_offload_result *r = &op->res[i0 + j];
            struct entry *e = find(off, r->hash, f->block_fp);
            slot[j] = NULL;
            if (!e || !e->ready) { /* a miss; MISMATCH when only other formats hold it */
                r->status = find_any(off, r->hash, true) ? KV_ERR_MISMATCH : KV_ERR_NOT_FOUND;
                off->st.misses++;
            } else {
                e->pins++;
                lru_touch(off, e);
                off->st.hits++;
                slot[j] = e;
            }
        }
        debug_check(off);
        pthread_mutex_unlock(&off->mu);
        move_chunk(off, f, op, i0, k, slot, sum);
        pthread_mutex_lock(&off->mu);
        for (uint32_t j = 0; j < k; j++) {
            struct entry *e = slot[j];
            if (!e)
                continue;
            if (sum[j] != e->sum) {
                op->res[i0 + j].status = KV_ERR_CORRUPT;
                off->st.checksum_failures++;
                if (e->linked)
                    table_remove(off, e); /* a corrupt entry is never served again */
            }
            unpin(off, e);
        }
        debug_check(off);
        pthread_mutex_unlock(&off->mu);
        hook_call(off, KV__OFFLOAD_HOOK_BLOCK, op);
    }
    return false;
}

/* Commit the verified blocks of a load, release the failed ones. */
static void load_commit(kv_offload *off, kv_offload_op *op)
{
    uint64_t loaded = 0;
    for (uint32_t i = 0; i < op->n; i++) {
        struct kv_offload_result *r = &op->res[i];
        if (r->status == KV_OK) {
            bool stored = false;
            kv_status st = kv_block_pool_commit_hash(op->pool, r->block, r->hash, &stored);
            if (st == KV_OK) {
                r->committed = stored;
                loaded++;
                continue;
            }
            r->status = st; /* the block is ours and fresh: not expected */
        }
        if (kv_block_pool_release(op->pool, &r->block, 1) != KV_OK)
            abort(); /* allocated at post */
        r->block = KV_BLOCK_NULL;
    }
    pthread_mutex_lock(&off->mu);
    off->st.loads += loaded;
    pthread_mutex_unlock(&off->mu);
}

static void run_op(kv_offload *off, kv_offload_op *op, const struct fmt *f, uint32_t chunk)
{
    struct entry **slot = kv__mem_calloc(chunk, sizeof(*slot));
    uint64_t *sum = kv__mem_calloc(chunk, sizeof(*sum));
    bool cancelled;
    if (!slot || !sum) { /* cannot run: every entry fails, nothing lost */
        for (uint32_t i = 0; i < op->n; i++)
            op->res[i].status = KV_ERR_NO_MEMORY;
        cancelled = false;
    } else {
        cancelled = op->is_load ? run_load(off, op, f, chunk, slot, sum)
                                : run_store(off, op, f, chunk, slot, sum);
    }
    kv__mem_free(slot);
    kv__mem_free(sum);
    /* the last point a cancel is seen: a load commits nothing once cancelled */
    if (!cancelled && atomic_load(&op->cancel) && op->is_load)
        cancelled = true;
    if (cancelled) {
        op_finish(off, op, KV_OFFLOAD_CANCELLED);
        return;
    }
    if (op->is_load)
        load_commit(off, op);
    bool ok = true;
    for (uint32_t i = 0; i < op->n; i++)
        ok = ok && op->res[i].status == KV_OK;
    op_finish(off, op, ok ? KV_OFFLOAD_DONE : KV_OFFLOAD_FAILED);
}

static void *worker_main(void *arg)
{
    kv_offload *off = arg;
    pthread_mutex_lock(&off->mu);
    for (;;) {
        while (!off->qhead && !off->stopping)
            pthread_cond_wait(&off->cv, &off->mu);
        if (!off->qhead)
            break; /* stopping, nothing queued */
        kv_offload_op *op = off->qhead;
        off->qhead = op->qnext;
        if (!off->qhead)
            off->qtail = NULL;
        op->qnext = NULL;
        off->running = op;
        const struct fmt f = off->fmts[op->fmt];
        const int64_t by_bytes = (KV__OFF_CHUNK_BYTES + f.entry_bytes - 1) / f.entry_bytes;
        const uint32_t chunk = off->chunk                     ? off->chunk
                               : by_bytes < KV__OFF_CHUNK_MIN ? KV__OFF_CHUNK_MIN
                               : by_bytes > KV__OFF_CHUNK_MAX ? KV__OFF_CHUNK_MAX
                                                              : (uint32_t)by_bytes;
        pthread_mutex_lock(&op->mu);
        op->state = KV_OFFLOAD_RUNNING;
        pthread_mutex_unlock(&op->mu);
        pthread_mutex_unlock(&off->mu);
        hook_call(off, KV__OFFLOAD_HOOK_START, op);
        run_op(off, op, &f, chunk);
        pthread_mutex_lock(&off->mu);
    }
    pthread_mutex_unlock(&off->mu);
    return NULL;
}

/* ---- ops ----------------------------------------------------------------- */

kv_status kv_offload_test(kv_offload_op *op, kv_offload_state *state)
{
    if (!op || !state)
        return kv__error(KV_ERR_NULL, "kv_offload_test: %s is NULL", !op ? "op" : "state");
    pthread_mutex_lock(&op->mu);
    *state = op->state;
    pthread_mutex_unlock(&op->mu);
    return kv__ok();
}

kv_status kv_offload_wait(kv_offload_op *op, uint32_t timeout_ms, kv_offload_state *state)
{
    if (!op)
        return kv__error(KV_ERR_NULL, "kv_offload_wait: op is NULL");
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&op->mu);
    while (!terminal(op->state))
        if (pthread_cond_timedwait(&op->cv, &op->mu, &dl) != 0)
            break;
    const kv_offload_state s = op->state;
    pthread_mutex_unlock(&op->mu);
    if (state)
        *state = s;
    if (!terminal(s))
        return kv__error(KV_ERR_TIMEOUT, "kv_offload_wait: op still %s after %u ms",
                         kv_offload_state_name(s), timeout_ms);
    return kv__ok();
}

kv_status kv_offload_cancel(kv_offload_op *op)
{
    if (!op)
        return kv__error(KV_ERR_NULL, "kv_offload_cancel: op is NULL");
    pthread_mutex_lock(&op->mu);
    const kv_offload_state s = op->state;
    pthread_mutex_unlock(&op->mu);
    if (terminal(s))
        return kv__ok();
    kv_offload *off = op->off;
    bool queued = false;
    pthread_mutex_lock(&off->mu);
    pthread_mutex_lock(&op->mu);
    if (op->state == KV_OFFLOAD_PENDING) { /* still in the queue: take it out */
        kv_offload_op **pp = &off->qhead, *prev = NULL;
        while (*pp && *pp != op) {
            prev = *pp;
            pp = &(*pp)->qnext;
        }
        if (*pp) {
            *pp = op->qnext;
            if (off->qtail == op)
                off->qtail = prev;
            op->qnext = NULL;
            queued = true;
        }
    }
    atomic_store(&op->cancel, true);
    pthread_mutex_unlock(&op->mu);
    pthread_mutex_unlock(&off->mu);
    if (queued)
        op_finish(off, op, KV_OFFLOAD_CANCELLED);
    return kv__ok();
}

kv_status kv_offload_results(kv_offload_op *op, const struct kv_offload_result **res, uint32_t *n)
{
    if (!op || !res || !n)
        return kv__error(KV_ERR_NULL, "kv_offload_results: %s is NULL",
                         !op    ? "op"
                         : !res ? "res"
                                : "n");
    kv_offload_state s;
    pthread_mutex_lock(&op->mu);
    s = op->state;
    pthread_mutex_unlock(&op->mu);
    if (!terminal(s))
        return kv__error(KV_ERR_BAD_STATE, "kv_offload_results: the op is still %s",
                         kv_offload_state_name(s));
    *res = op->res;
    *n = op->n;
    return kv__ok();
}

kv_status kv_offload_op_free(kv_offload_op *op)
{
    if (!op)
        return kv__ok();
    kv_offload_state s;
    pthread_mutex_lock(&op->mu);
    s = op->state;
    pthread_mutex_unlock(&op->mu);
    if (!terminal(s))
        return kv__error(KV_ERR_BAD_STATE,
                         "kv_offload_op_free: the op is still %s (cancel and wait first)",
                         kv_offload_state_name(s));
    op_delete(op);
    return kv__ok();
}

/* ---- table calls --------------------------------------------------------- */

kv_status kv_offload_evict(kv_offload *off, const uint64_t *hashes, uint32_t n, uint32_t *n_evicted)
{
    if (!off || (n > 0 && !hashes))
        return kv__error(KV_ERR_NULL, "kv_offload_evict: %s is NULL", !off ? "off" : "hashes");
    uint32_t k = 0;
    pthread_mutex_lock(&off->mu);
    for (uint32_t i = 0; i < n; i++) /* every format's entry of the hash */
        for (struct entry *e; (e = find_any(off, hashes[i], false));) {
            table_remove(off, e);
            off->st.evicted++;
            k++;
        }
    debug_check(off);
    pthread_mutex_unlock(&off->mu);
    if (n_evicted)
        *n_evicted = k;
    return kv__ok();
}

bool kv_offload_contains(kv_offload *off, const kv_cache *cache, uint64_t hash)
{
    if (!off)
        return false;
    const struct kv_layout *lo = kv_cache_layout(cache);
    pthread_mutex_lock(&off->mu);
    const struct entry *e = lo ? find(off, hash, block_key(lo, kv_cache_head_offset(cache)))
                               : find_any(off, hash, true);
    const bool yes = e && e->ready;
    pthread_mutex_unlock(&off->mu);
    return yes;
}

kv_status kv_offload_stats_get(kv_offload *off, struct kv_offload_stats *out)
{
    if (!off || !out)
        return kv__error(KV_ERR_NULL, "kv_offload_stats_get: %s is NULL", !off ? "off" : "out");
    pthread_mutex_lock(&off->mu);
    *out = off->st;
    pthread_mutex_unlock(&off->mu);
    return kv__ok();
}

kv_status kv_offload_staging_alloc(kv_offload *off, size_t bytes, void **ptr)
{
    if (!off || !ptr)
        return kv__error(KV_ERR_NULL, "kv_offload_staging_alloc: %s is NULL", !off ? "off" : "ptr");
    if (bytes == 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_offload_staging_alloc: bytes is 0");
    kv_status st = KV_OK;
    pthread_mutex_lock(&off->mu);
    if (off->destroyed) {
        st = kv__error(KV_ERR_BAD_STATE,
                       "kv_offload_staging_alloc: the tier is destroyed (%zu staging buffers "
                       "still out keep its region)",
                       off->n_stg);
    } else if (bytes > off->cfg.staging_bytes - off->st.staging_bytes) {
        st = kv__error(KV_ERR_CAPACITY,
                       "kv_offload_staging_alloc: %zu bytes with %" PRIu64
                       " of staging_bytes %zu in use",
                       bytes, off->st.staging_bytes, off->cfg.staging_bytes);
    } else if (off->n_stg == off->cap_stg) {
        const size_t nc = off->cap_stg ? off->cap_stg * 2 : 8;
        struct staging *g = kv__mem_alloc(nc * sizeof(*g));
        if (!g) {
            st = kv__error(KV_ERR_NO_MEMORY, "kv_offload_staging_alloc: records");
        } else {
            if (off->n_stg)
                memcpy(g, off->stg, off->n_stg * sizeof(*g));
            kv__mem_free(off->stg);
            off->stg = g;
            off->cap_stg = nc;
        }
    }
    void *p = NULL;
    if (st == KV_OK) {
        p = kv__carver_alloc(off->carver, bytes, KV__OFF_STAGING_ALIGN);
        if (!p)
            st = kv__error(KV_ERR_NO_MEMORY,
                           "kv_offload_staging_alloc: %zu bytes: the region of %" PRIu64
                           " bytes has no room (%" PRIu64 " entry bytes held)",
                           bytes, off->st.region_bytes, off->st.bytes);
    }
    if (st == KV_OK) {
        off->stg[off->n_stg++] = (struct staging){p, bytes};
        off->st.staging_bytes += bytes;
        *ptr = p;
    }
    pthread_mutex_unlock(&off->mu);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_offload_staging_free(kv_offload *off, void *ptr)
{
    if (!off || !ptr)
        return kv__error(KV_ERR_NULL, "kv_offload_staging_free: %s is NULL", !off ? "off" : "ptr");
    kv_status st = KV_OK;
    pthread_mutex_lock(&off->mu);
    size_t i = 0;
    while (i < off->n_stg && off->stg[i].p != ptr)
        i++;
    if (i == off->n_stg) {
        st =
            kv__error(KV_ERR_INVALID_ARG,
                      "kv_offload_staging_free: %p is not a live staging buffer of this tier", ptr);
    } else {
        kv__carver_free(off->carver, ptr);
        off->st.staging_bytes -= off->stg[i].bytes;
        off->stg[i] = off->stg[--off->n_stg];
    }
    const bool last = off->destroyed && off->n_stg == 0;
    pthread_mutex_unlock(&off->mu);
    if (last) /* the tier was destroyed: this buffer held the region */
        tier_free(off);
    return st == KV_OK ? kv__ok() : st;
}

/* ---- test hooks (kv_offload_int.h) --------------------------------------- */

kv_status kv__offload_test_corrupt(kv_offload *off, const kv_cache *cache, uint64_t hash,
                                   size_t byte)
{
    kv_status st = KV_OK;
    const struct kv_layout *lo = kv_cache_layout(cache);
    pthread_mutex_lock(&off->mu);
    struct entry *e = lo ? find(off, hash, block_key(lo, kv_cache_head_offset(cache)))
                         : find_any(off, hash, true);
    if (!e || !e->ready)
        st = kv__error(KV_ERR_NOT_FOUND, "offload test corrupt: no entry 0x%016" PRIx64, hash);
    else if ((int64_t)byte >= e->len)
        st = kv__error(KV_ERR_OUT_OF_BOUNDS, "offload test corrupt: byte %zu of %" PRId64, byte,
                       e->len);
    else
        e->mem[byte] ^= 0x5a;
    pthread_mutex_unlock(&off->mu);
    return st;
}

void kv__offload_test_set_hook(kv_offload *off, kv__offload_hook_fn fn, void *user)
{
    pthread_mutex_lock(&off->mu);
    off->hook = fn;
    off->hook_user = user;
    pthread_mutex_unlock(&off->mu);
}

void kv__offload_test_set_chunk(kv_offload *off, uint32_t blocks)
{
    pthread_mutex_lock(&off->mu);
    off->chunk = blocks;
    pthread_mutex_unlock(&off->mu);
}
