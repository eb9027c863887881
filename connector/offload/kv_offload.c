/*
 * kv_offload.c - the host offload tier (kv_offload.h): create and destroy,
 * posting store and load, ops, staging buffers. The table and the worker
 * are in kv_offload_table.c and kv_offload_worker.c; the state and its
 * invariants in kv_offload_tier_int.h.
 */
#include <inttypes.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_paged.h"
#include "kv_threads.h"
#include "kv_lib.h"
#include "kv_mem.h"
#include "kv_offload_cuda_int.h"
#include "kv_offload_tier_int.h"
#include "kv_pack.h"
#include "kv_plan_int.h"

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

static _Atomic(const struct kv__offdev_ops *) offdev_installed;

void kv__offdev_set(const struct kv__offdev_ops *ops)
{
    atomic_store(&offdev_installed, ops);
}

const struct kv__offdev_ops *kv__offdev_get(void)
{
    const struct kv__offdev_ops *o = atomic_load(&offdev_installed);
    return o ? o : kv__offdev_cuda();
}

bool kv__off_terminal(kv_offload_state s)
{
    return s == KV_OFFLOAD_DONE || s == KV_OFFLOAD_FAILED || s == KV_OFFLOAD_CANCELLED;
}

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
    size_t slack = cfg->slack_bytes
                       ? cfg->slack_bytes
                       : ((size_t)8 << 20) + cfg->capacity_bytes / 32 + cfg->staging_bytes / 4;
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
    off->threads = cfg->threads ? cfg->threads : kv_threads();
    off->dev = kv__offdev_get();
    if (off->dev && off->dev->version != KV__OFFDEV_VERSION)
        off->dev = NULL; /* a table built against another seam: device caches refused */
    off->chunk = 0;      /* by bytes (chunk_of) */
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
    int e = pthread_create(&off->worker, NULL, kv__off_worker_main, off);
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
void kv__off_op_finish(kv_offload *off, kv_offload_op *op, kv_offload_state fin)
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
        kv__off_op_finish(off, q, KV_OFFLOAD_CANCELLED);
        q = n;
    }
    pthread_join(off->worker, NULL); /* it destroyed its streams and events */
    /* what copies that may have still run kept (kv_offload_worker.c): the
     * streams are gone, so the blocks go back and the caches are dropped */
    for (struct kv__off_quar *qr = off->quar, *n; qr; qr = n) {
        n = qr->next;
        if (qr->n > 0 && kv_block_pool_release(qr->pool, qr->blocks, qr->n) != KV_OK)
            abort(); /* allocated at post, held since */
        kv_cache_destroy(qr->cache);
        kv__mem_free(qr);
    }
    off->quar = NULL;
    /* no op is left and no worker: the entries (their pieces go with the
     * region) and the plans */
    pthread_mutex_lock(&off->mu);
    for (struct entry *e = off->quar_entries, *n; e; e = n) {
        n = e->hnext;
        kv__mem_free(e);
    }
    off->quar_entries = NULL;
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
    const bool last = off->n_stg == 0 && off->n_holds == 0;
    pthread_mutex_unlock(&off->mu);
    if (last)
        tier_free(off);
}

kv_status kv__offload_region_hold(kv_offload *off)
{
    pthread_mutex_lock(&off->mu);
    const bool gone = off->destroyed || off->stopping;
    if (!gone)
        off->n_holds++;
    pthread_mutex_unlock(&off->mu);
    return gone ? kv__error(KV_ERR_BAD_STATE, "kv_offload: the tier is being destroyed: its "
                                              "region cannot be held")
                : KV_OK;
}

void kv__offload_region_release(kv_offload *off)
{
    pthread_mutex_lock(&off->mu);
    off->n_holds--;
    const bool last = off->destroyed && off->n_stg == 0 && off->n_holds == 0;
    pthread_mutex_unlock(&off->mu);
    if (last) /* the tier was destroyed: this hold kept the region */
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
                    .block_fp = kv__off_block_key(lo, head_offset), /* lo's and el's block format */
                    .entry_bytes = el.total_bytes,
                    .entry_layout = el,
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

/* The cache's storage, checked as the kernels check theirs (the CPU ones,
 * or for a device cache the CUDA ones); *device: a device cache's CUDA
 * device, -1 for host memory. */
static kv_status cache_side(const char *fn, const kv_offload *off, kv_cache *cache,
                            struct kv_paged_cache *pc, int *device)
{
    kv_status st = kv_cache_paged(cache, pc);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: cache", fn);
    *device = -1;
    const bool dev = pc->mem == KV_MEM_DEVICE;
    if (dev) {
        if (!off->dev)
            return kv__error(KV_ERR_UNSUPPORTED,
                             "%s: a device cache, and this build has no CUDA (KV_HAVE_CUDA=0)", fn);
        if (off->kind != KV_MEM_PINNED)
            return kv__error(KV_ERR_UNSUPPORTED,
                             "%s: a device cache needs the tier's region in pinned memory "
                             "(KV_OFFLOAD_MEM_AUTO or _PINNED on a host with a GPU); this "
                             "tier's is %s memory",
                             fn, kv_mem_kind_name(off->kind));
        struct kv_mem_region r;
        size_t nr = 0;
        st = kv_cache_regions(cache, &r, 1, &nr);
        if (st != KV_OK || nr != 1)
            return kv__error_wrap(st != KV_OK ? st : KV_ERR_INTERNAL, "%s: the cache's region", fn);
        if (r.device < 0 || r.device >= KV__OFF_MAX_DEVS)
            return kv__error(KV_ERR_CAPACITY,
                             "%s: a device cache on CUDA device %d (a tier serves devices 0 to "
                             "%d)",
                             fn, r.device, KV__OFF_MAX_DEVS - 1);
        *device = r.device;
    }
    st = kv_paged_check(pc, dev);
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

/* The op's format, looked up or made, and counted as used (op->fmt):
 * before anything of the cache changes, so that a refusal (no slot for
 * another layout, a tier being destroyed) leaves its pool as it was (a
 * load's allocation may evict cached blocks). */
static kv_status post_format(kv_offload *off, const char *fn, kv_offload_op *op,
                             const kv_cache *cache, const struct kv_layout *lo)
{
    pthread_mutex_lock(&off->mu);
    kv_status st = KV_OK;
    if (off->stopping)
        st = kv__error(KV_ERR_BAD_STATE, "%s: the tier is being destroyed", fn);
    if (st == KV_OK)
        st = fmt_get(off, fn, lo, kv_cache_head_offset(cache), &op->fmt);
    pthread_mutex_unlock(&off->mu);
    return st;
}

/* Undo post_format (the op is not posted). */
static void post_format_undo(kv_offload *off, const kv_offload_op *op)
{
    pthread_mutex_lock(&off->mu);
    off->fmts[op->fmt].users--;
    pthread_mutex_unlock(&off->mu);
}

/* Queue op (its format counted by post_format; uncounted on a refusal); on
 * success the op holds a reference on cache until it is terminal
 * (op_finish). */
static kv_status post(kv_offload *off, const char *fn, kv_offload_op *op, kv_cache *cache)
{
    pthread_mutex_lock(&off->mu);
    kv_status st = KV_OK;
    if (off->stopping) {
        st = kv__error(KV_ERR_BAD_STATE, "%s: the tier is being destroyed", fn);
        off->fmts[op->fmt].users--;
    }
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

/* The start of both posts: the pointers, the list's alignment for its
 * elem-byte elements, the cache's storage, a new op of n entries (*o).
 * Nothing is held on failure. */
static kv_status post_begin(const char *fn, kv_offload *off, kv_cache *cache, const void *list,
                            const char *list_name, uint32_t n, size_t elem, kv_offload_op **op,
                            struct kv_paged_cache *pc, kv_offload_op **o)
{
    if (!off || !cache || !op || (n > 0 && !list))
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn,
                         !off     ? "off"
                         : !cache ? "cache"
                         : !op    ? "op"
                                  : list_name);
    kv_status st;
    if (n > 0 && (st = kv__check_aligned(fn, list_name, list, elem)) != KV_OK)
        return st;
    int device = -1;
    st = cache_side(fn, off, cache, pc, &device);
    if (st != KV_OK)
        return st;
    if (!(*o = op_new(n)))
        return kv__error(KV_ERR_NO_MEMORY, "%s: an op of %u blocks", fn, n);
    (*o)->dev = device >= 0;
    (*o)->device = device;
    (*o)->pc = *pc;
    return KV_OK;
}

kv_status kv_offload_store(kv_offload *off, kv_cache *cache, const uint32_t *ids, uint32_t n,
                           kv_offload_op **op)
{
    static const char fn[] = "kv_offload_store";
    struct kv_paged_cache pc;
    kv_offload_op *o = NULL;
    kv_status st = post_begin(fn, off, cache, ids, "ids", n, sizeof(*ids), op, &pc, &o);
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
        st = post_format(off, fn, o, cache, &pc.layout);
    if (st == KV_OK)
        st = post(off, fn, o, cache);
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
    kv_status st = post_begin(fn, off, cache, hashes, "hashes", n, sizeof(*hashes), op, &pc, &o);
    if (st != KV_OK)
        return st;
    kv_block_pool *pool = kv_cache_pool(cache);
    o->is_load = true;
    o->pool = pool;
    o->base = pc.base;
    /* the format first: the allocation may evict cached blocks */
    st = post_format(off, fn, o, cache, &pc.layout);
    if (st != KV_OK) {
        op_delete(o);
        return st;
    }
    st = kv_block_pool_alloc(pool, n, o->ids);
    if (st != KV_OK) {
        post_format_undo(off, o);
        op_delete(o);
        return kv__error_wrap(st, "%s: %u blocks for the loaded entries", fn, n);
    }
    for (uint32_t i = 0; i < n; i++)
        o->res[i] = (struct kv_offload_result){hashes[i], o->ids[i], KV_OK, false};
    st = post(off, fn, o, cache);
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
    const struct timespec dl = kv__deadline_ts(timeout_ms);
    pthread_mutex_lock(&op->mu);
    while (!kv__off_terminal(op->state))
        if (pthread_cond_timedwait(&op->cv, &op->mu, &dl) != 0)
            break;
    const kv_offload_state s = op->state;
    pthread_mutex_unlock(&op->mu);
    if (state)
        *state = s;
    if (!kv__off_terminal(s))
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
    if (kv__off_terminal(s))
        return kv__ok();
    kv_offload *off = op->off;
    bool queued = false, taken = false;
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
        } else {
            /* PENDING and out of the queue: the worker sets RUNNING under
             * off->mu as it takes an op, so another cancel (or the tier's
             * destroy) took it and is finishing it CANCELLED; "a queued op
             * becomes CANCELLED now" holds for this caller too once it has */
            taken = true;
        }
    }
    atomic_store(&op->cancel, true);
    pthread_mutex_unlock(&op->mu);
    pthread_mutex_unlock(&off->mu);
    if (queued) {
        kv__off_hook_call(off, KV__OFFLOAD_HOOK_TAKEN, op);
        kv__off_op_finish(off, op, KV_OFFLOAD_CANCELLED);
    }
    if (taken) {
        pthread_mutex_lock(&op->mu);
        while (!kv__off_terminal(op->state))
            pthread_cond_wait(&op->cv, &op->mu);
        pthread_mutex_unlock(&op->mu);
    }
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
    if (!kv__off_terminal(s))
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
    if (!kv__off_terminal(s))
        return kv__error(KV_ERR_BAD_STATE,
                         "kv_offload_op_free: the op is still %s (cancel and wait first)",
                         kv_offload_state_name(s));
    op_delete(op);
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
    /* charged the pages it takes, not the bytes asked (1-byte buffers take
     * a page each); the page jemalloc adds to a large piece comes out of
     * the slack, which counts a quarter of staging_bytes for it */
    const size_t charge =
        bytes > SIZE_MAX - (KV__OFF_STAGING_ALIGN - 1)
            ? 0
            : (bytes + KV__OFF_STAGING_ALIGN - 1) / KV__OFF_STAGING_ALIGN * KV__OFF_STAGING_ALIGN;
    if (off->destroyed) {
        st = kv__error(KV_ERR_BAD_STATE,
                       "kv_offload_staging_alloc: the tier is destroyed (%zu staging buffers "
                       "still out keep its region)",
                       off->n_stg);
    } else if (charge < bytes || charge > off->cfg.staging_bytes - off->st.staging_bytes) {
        st = kv__error(KV_ERR_CAPACITY,
                       "kv_offload_staging_alloc: %zu bytes (%zu of the region) with %" PRIu64
                       " of staging_bytes %zu in use",
                       bytes, charge, off->st.staging_bytes, off->cfg.staging_bytes);
    } else if (off->n_stg == off->cap_stg) {
        struct staging *g =
            kv__mem_grow(off->stg, &off->cap_stg, off->n_stg, off->n_stg + 1, sizeof(*g), 8);
        if (!g)
            st = kv__error(KV_ERR_NO_MEMORY, "kv_offload_staging_alloc: records");
        else
            off->stg = g;
    }
    void *p = NULL;
    if (st == KV_OK) {
        bool no_memory = false;
        p = kv__carver_alloc(off->carver, bytes, KV__OFF_STAGING_ALIGN, &no_memory);
        if (!p && no_memory)
            st = kv__error(KV_ERR_NO_MEMORY,
                           "kv_offload_staging_alloc: %zu bytes: the carver's "
                           "records",
                           bytes);
        else if (!p)
            st = kv__error(KV_ERR_NO_MEMORY,
                           "kv_offload_staging_alloc: %zu bytes: the region of %" PRIu64
                           " bytes has no room (%" PRIu64 " entry bytes held)",
                           bytes, off->st.region_bytes, off->st.bytes);
    }
    if (st == KV_OK) {
        off->stg[off->n_stg++] = (struct staging){p, charge};
        off->st.staging_bytes += charge;
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
    const bool last = off->destroyed && off->n_stg == 0 && off->n_holds == 0;
    pthread_mutex_unlock(&off->mu);
    if (last) /* the tier was destroyed: this buffer held the region */
        tier_free(off);
    return st == KV_OK ? kv__ok() : st;
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
