/*
 * kv_offload_worker.c - the offload tier's worker thread
 * (kv_offload_tier_int.h): it takes the oldest op, and for each chunk of
 * blocks does its table work under off->mu, copies (and checksums) with no
 * lock held, then publishes under off->mu; cancel is seen between chunks.
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
#include "kv_offload_tier_int.h"
#include "kv_pack.h"
#include "kv_pack_int.h"
#include "kv_plan_int.h"

void kv__off_hook_call(kv_offload *off, enum kv__offload_hook_at at, kv_offload_op *op)
{
    pthread_mutex_lock(&off->mu);
    kv__offload_hook_fn fn = off->hook;
    void *user = off->hook_user;
    pthread_mutex_unlock(&off->mu);
    if (fn)
        fn(user, at, op);
}

/* One block. Store: copy the block into the entry and checksum it, one
 * read of the block when the entry is written front to back (always for
 * these plans). Load: checksum the entry first and copy it into the block
 * only when the sum is the one taken at store, so a corrupt entry never
 * reaches a block (the copy then reads the entry from cache). nt: the op is
 * large enough to stream its stores (kv_pack_int.h). Returns the entry's
 * sum. */
static uint64_t move_block(const struct fmt *f, bool load, bool nt, char *blk, char *ent,
                           uint64_t want)
{
    const int64_t N = f->block_tokens;
    if (load) {
        const uint64_t sum = kv__xxh3_64(ent, (size_t)f->entry_bytes);
        if (sum == want) {
            const char *s = ent;
            kv__pack_exec(f->to_block, &s, 1, &blk, 1, (uint64_t)N, 1, nt, false);
        }
        return sum;
    }
    if (f->sequential)
        return kv__pack_copy_hash(f->to_entry, blk, ent, nt);
    const char *s = blk; /* plain stores: the entry is hashed from cache */
    kv__pack_exec(f->to_entry, &s, 1, &ent, 1, (uint64_t)N, 1, false, false);
    return kv__xxh3_64(ent, (size_t)f->entry_bytes);
}

/* The copies of one chunk: slot[i] the entry of block i (NULL: nothing). */
static void move_chunk(const kv_offload *off, const struct fmt *f, kv_offload_op *op, uint32_t i0,
                       uint32_t k, struct entry *const *slot, uint64_t *sum)
{
    const int nt = off->threads < (int)k ? off->threads : (int)k;
    const bool stream = kv__pack_use_nt((uint64_t)op->n * (uint64_t)f->entry_bytes);
    if (nt > 1) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (uint32_t j = 0; j < k; j++)
            if (slot[j])
                sum[j] = move_block(f, op->is_load, stream,
                                    op->base + (int64_t)op->ids[i0 + j] * f->stride_block_bytes,
                                    slot[j]->mem, slot[j]->sum);
    } else { /* no OpenMP runtime on this path (the TSan tests take it) */
        for (uint32_t j = 0; j < k; j++)
            if (slot[j])
                sum[j] = move_block(f, op->is_load, stream,
                                    op->base + (int64_t)op->ids[i0 + j] * f->stride_block_bytes,
                                    slot[j]->mem, slot[j]->sum);
    }
}

/* ---- device caches (kv_offload_dev_int.h) ------------------------------------ */

/* The tier's stream and event on op's device (made on first use). */
static kv_status dev_stream(kv_offload *off, const kv_offload_op *op, void **stream, void **event)
{
    const int d = op->device;
    kv_status st = KV_OK;
    if (!off->dev_stream[d])
        st = off->dev->stream_create(d, &off->dev_stream[d]);
    if (st == KV_OK && !off->dev_event[d])
        st = off->dev->event_create(d, &off->dev_event[d]);
    *stream = off->dev_stream[d];
    *event = off->dev_event[d];
    return st;
}

/* One entry as the plan copy takes it: a one-block cache in the region. */
static struct kv_paged_cache entry_side(const struct fmt *f, char *mem)
{
    return (struct kv_paged_cache){.layout = f->entry_layout,
                                   .base = mem,
                                   .storage_bytes = (size_t)f->entry_bytes,
                                   .mem = KV_MEM_PINNED};
}

static void sum_chunk(const kv_offload *off, const struct fmt *f, uint32_t k,
                      struct entry *const *slot, uint64_t *sum)
{
    const int nt = off->threads < (int)k ? off->threads : (int)k;
    if (nt > 1) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (uint32_t j = 0; j < k; j++)
            if (slot[j])
                sum[j] = kv__xxh3_64(slot[j]->mem, (size_t)f->entry_bytes);
    } else {
        for (uint32_t j = 0; j < k; j++)
            if (slot[j])
                sum[j] = kv__xxh3_64(slot[j]->mem, (size_t)f->entry_bytes);
    }
}

/* The copies of one chunk of a device cache's op on the tier's stream,
 * then a wait on the tier's event (the worker sleeps; no engine stream is
 * touched). Store: block -> entry for every slot, then the sums of what
 * landed. Load: the entries' sums first, then entry -> block only for the
 * slots whose sum is the one taken at store (a corrupt entry is never
 * issued). KV_OK, or the first failed CUDA call's status: the chunk's
 * copies are then not trusted (the caller fails their entries). Either
 * way nothing issued is still running when this returns, unless the wait
 * itself failed: the event record or synchronize failing (a transient
 * error, or the context dead) says nothing of the copies before it, so
 * the worker then synchronizes its stream; when that fails too, *running
 * is set (the copies may still read and write the entries and blocks: the
 * caller keeps them, quarantine()) and the device's stream is marked
 * broken: every later chunk on it fails here without issuing anything. */
static kv_status dev_chunk(kv_offload *off, const struct fmt *f, kv_offload_op *op, uint32_t i0,
                           uint32_t k, struct entry *const *slot, uint64_t *sum, bool *running)
{
    const struct kv__offdev_ops *d = off->dev;
    void *stream = NULL, *event = NULL;
    *running = false;
    if (op->is_load)
        sum_chunk(off, f, k, slot, sum);
    if (off->dev_broken[op->device])
        return kv__error(KV_ERR_DEVICE,
                         "offload: the tier's stream on device %d is unusable (a wait on it "
                         "failed: %s): nothing issued",
                         op->device, off->dev_why);
    kv_status st = dev_stream(off, op, &stream, &event);
    uint32_t issued = 0;
    for (uint32_t j = 0; j < k && st == KV_OK; j++) {
        if (!slot[j] || (op->is_load && sum[j] != slot[j]->sum))
            continue;
        const struct kv_paged_cache e = entry_side(f, slot[j]->mem);
        const uint32_t b = op->ids[i0 + j];
        st = op->is_load ? d->copy(op->device, f->to_block, &e, 0, &op->pc, b,
                                   (uint64_t)f->block_tokens, stream)
                         : d->copy(op->device, f->to_entry, &op->pc, b, &e, 0,
                                   (uint64_t)f->block_tokens, stream);
        issued++;
    }
    if (issued > 0) { /* wait for what was issued, even after a failed issue */
        kv_status ws = d->event_record(op->device, event, stream);
        if (ws == KV_OK)
            ws = d->event_sync(op->device, event);
        if (ws != KV_OK) { /* the copies may still run: wait for the stream */
            char why[96];
            snprintf(why, sizeof(why), "%s", kv_last_error());
            const kv_status ss = d->stream_sync(op->device, stream);
            if (ss != KV_OK) {
                *running = true;
                off->dev_broken[op->device] = true;
                snprintf(off->dev_why, sizeof(off->dev_why), "%.95s; then %.95s", why,
                         kv_last_error());
                ws = kv__error(ws, "offload: device %d: %s: %u copies may still run", op->device,
                               off->dev_why, issued);
            } else {
                ws = kv__error(ws, "%s", why);
            }
        }
        if (st == KV_OK)
            st = ws;
    }
    if (st == KV_OK && !op->is_load)
        sum_chunk(off, f, k, slot, sum);
    return st;
}

/* off->mu held: a chunk whose copies may still run (dev_chunk's *running):
 * a reference on op's cache (its device memory stays) and, for a load, the
 * results' blocks [i0, i0 + k) that a copy was issued into (taken from
 * the results: never released, so never reused) are kept until
 * kv_offload_destroy; a store's entries go to off->quar_entries (the
 * caller). Without memory for the record, they are kept for good. */
static void quarantine(kv_offload *off, kv_offload_op *op, uint32_t i0, uint32_t k,
                       struct entry *const *slot, const uint64_t *sum)
{
    struct kv__off_quar *q = kv__mem_calloc(1, sizeof(*q) + (size_t)k * sizeof(uint32_t));
    if (q) {
        q->cache = kv_cache_retain(op->cache);
        q->pool = op->pool;
    } else {
        (void)kv_cache_retain(op->cache); /* kept for good */
    }
    for (uint32_t j = 0; j < k && op->is_load; j++) {
        struct kv_offload_result *r = &op->res[i0 + j];
        if (!slot[j] || sum[j] != slot[j]->sum || r->block == KV_BLOCK_NULL)
            continue;
        if (q)
            q->blocks[q->n++] = r->block;
        r->block = KV_BLOCK_NULL;
    }
    if (q) {
        q->next = off->quar;
        off->quar = q;
    }
}

/* mu held, dropped around the copies (the slots are pinned): the chunk's
 * copies on the device (dev_chunk) or the host (move_chunk). KV_OK, or
 * dev_chunk's status (and *running). */
static kv_status copy_chunk(kv_offload *off, const struct fmt *f, kv_offload_op *op, uint32_t i0,
                            uint32_t k, struct entry *const *slot, uint64_t *sum, bool *running)
{
    kv__off_debug_check(off);
    pthread_mutex_unlock(&off->mu);
    kv_status st = KV_OK;
    *running = false;
    if (op->dev)
        st = dev_chunk(off, f, op, i0, k, slot, sum, running);
    else
        move_chunk(off, f, op, i0, k, slot, sum);
    pthread_mutex_lock(&off->mu);
    return st;
}

/* Store: returns true when cancelled. */
static bool run_store(kv_offload *off, kv_offload_op *op, const struct fmt *f, uint32_t chunk,
                      struct entry **slot, uint64_t *sum)
{
    /* dup[j]: the entry this chunk is writing that result j found (the
     * same hash twice in the chunk): its status follows that entry's */
    struct entry **dup = slot + chunk;
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
            slot[j] = dup[j] = NULL;
            struct entry *e = kv__off_find(off, r->hash, f->block_fp);
            if (e) { /* held already in this format (or being written by this chunk) */
                for (uint32_t q = 0; q < j; q++)
                    if (slot[q] == e)
                        dup[j] = e;
                kv__off_lru_touch(off, e);
                off->st.store_touches++;
                r->status = KV_OK;
                continue;
            }
            r->status = KV_ERR_CAPACITY;
            if (eb > off->cfg.capacity_bytes)
                continue;
            bool room = true;
            while (room && off->st.bytes + eb > off->cfg.capacity_bytes)
                room = kv__off_evict_one(off);
            if (!room)
                continue;
            e = kv__mem_calloc(1, sizeof(*e));
            const size_t want = (size_t)f->entry_bytes;
            bool no_memory = false;
            char *mem =
                e ? kv__carver_alloc(off->carver, want, KV__OFF_ENTRY_ALIGN, &no_memory) : NULL;
            /* evict for room only: an entry goes for nothing when the
             * carver's records, not the region, ran out */
            while (e && !mem && !no_memory && kv__off_evict_one(off))
                mem = kv__carver_alloc(off->carver, want, KV__OFF_ENTRY_ALIGN, &no_memory);
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
            kv__off_table_insert(off, e);
            slot[j] = e;
        }
        bool running = false;
        const kv_status dst = copy_chunk(off, f, op, i0, k, slot, sum, &running);
        if (running)
            quarantine(off, op, i0, k, slot, sum);
        for (uint32_t j = 0; j < k; j++)
            if (slot[j] && dst != KV_OK) { /* the copy failed: the entry goes */
                op->res[i0 + j].status = KV_ERR_DEVICE;
                for (uint32_t q = 0; q < k; q++) /* and its duplicates were not stored */
                    if (dup[q] == slot[j])
                        op->res[i0 + q].status = KV_ERR_DEVICE;
                if (slot[j]->linked)
                    kv__off_table_remove(off, slot[j]);
                if (running) { /* its D2H may still write it: kept, pinned, till destroy */
                    slot[j]->hnext = off->quar_entries;
                    off->quar_entries = slot[j];
                } else {
                    kv__off_unpin(off, slot[j]);
                }
            } else if (slot[j]) {
                slot[j]->sum = sum[j];
                slot[j]->ready = true;
                kv__off_unpin(off, slot[j]);
                op->res[i0 + j].status = KV_OK;
                off->st.stores++;
            }
        kv__off_debug_check(off);
        pthread_mutex_unlock(&off->mu);
        kv__off_hook_call(off, KV__OFFLOAD_HOOK_BLOCK, op);
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
            struct entry *e = kv__off_find(off, r->hash, f->block_fp);
            slot[j] = NULL;
            if (!e || !e->ready) { /* a miss; MISMATCH when only other formats hold it */
                r->status =
                    kv__off_find_any(off, r->hash, true) ? KV_ERR_MISMATCH : KV_ERR_NOT_FOUND;
                off->st.misses++;
            } else {
                e->pins++;
                kv__off_lru_touch(off, e);
                off->st.hits++;
                slot[j] = e;
            }
        }
        bool running = false;
        const kv_status dst = copy_chunk(off, f, op, i0, k, slot, sum, &running);
        if (running) /* the H2D may still write the blocks: kept till destroy */
            quarantine(off, op, i0, k, slot, sum);
        for (uint32_t j = 0; j < k; j++) {
            struct entry *e = slot[j];
            if (!e)
                continue;
            if (sum[j] == e->sum && dst != KV_OK) {
                op->res[i0 + j].status = KV_ERR_DEVICE; /* the block is released uncommitted */
            } else if (sum[j] != e->sum) {
                op->res[i0 + j].status = KV_ERR_CORRUPT;
                off->st.checksum_failures++;
                if (e->linked)
                    kv__off_table_remove(off, e); /* a corrupt entry is never served again */
            }
            kv__off_unpin(off, e);
        }
        kv__off_debug_check(off);
        pthread_mutex_unlock(&off->mu);
        kv__off_hook_call(off, KV__OFFLOAD_HOOK_BLOCK, op);
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
        if (r->block == KV_BLOCK_NULL)
            continue; /* kept: a copy may still write it (quarantine) */
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
    struct entry **slot =
        kv__mem_calloc(2 * (size_t)chunk, sizeof(*slot)); /* and run_store's dup */
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
        kv__off_op_finish(off, op, KV_OFFLOAD_CANCELLED);
        return;
    }
    if (op->is_load)
        load_commit(off, op);
    bool ok = true;
    for (uint32_t i = 0; i < op->n; i++)
        ok = ok && op->res[i].status == KV_OK;
    kv__off_op_finish(off, op, ok ? KV_OFFLOAD_DONE : KV_OFFLOAD_FAILED);
}

/* The tier's streams and events, destroyed by the thread that made and
 * used them, as it exits: every seam entry sets the calling thread's CUDA
 * device, so no seam call is made on an engine's thread (its current
 * device stays its own). Every copy issued was waited for: they are idle,
 * except on a broken stream (dev_chunk), synchronized once more first. */
static void dev_release(kv_offload *off)
{
    for (int d = 0; d < KV__OFF_MAX_DEVS; d++) {
        if (off->dev_broken[d] && off->dev_stream[d])
            (void)off->dev->stream_sync(d, off->dev_stream[d]);
        if (off->dev_event[d])
            (void)off->dev->event_destroy(d, off->dev_event[d]);
        if (off->dev_stream[d])
            (void)off->dev->stream_destroy(d, off->dev_stream[d]);
        off->dev_event[d] = off->dev_stream[d] = NULL;
    }
}

void *kv__off_worker_main(void *arg)
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
        kv__off_hook_call(off, KV__OFFLOAD_HOOK_START, op);
        run_op(off, op, &f, chunk);
        pthread_mutex_lock(&off->mu);
    }
    pthread_mutex_unlock(&off->mu);
    dev_release(off);
    return NULL;
}
