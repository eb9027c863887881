/*
 * kv_offload_table.c - the offload tier's entry table (kv_offload_tier_int.h):
 * buckets by hash, entries keyed by (hash, block key), the LRU list that is
 * also the eviction order, the invariants (kv__off_debug_check in DEBUG
 * builds), and the calls that read or trim the table (evict, contains,
 * stats). Every function here runs with off->mu held unless it takes it.
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
#include "kv_plan_int.h"

static size_t bucket_of(const kv_offload *off, uint64_t h)
{
    return (size_t)((h * 0x9E3779B97F4A7C15ull) >> 17) & (off->n_buckets - 1);
}

/* The entry of (h, block format fp); entries of one hash in several formats
 * share a bucket. */
struct entry *kv__off_find(kv_offload *off, uint64_t h, uint64_t fp)
{
    for (struct entry *e = off->buckets[bucket_of(off, h)]; e; e = e->hnext)
        if (e->hash == h && e->block_fp == fp)
            return e;
    return NULL;
}

/* An entry of h in any format (ready_only: a complete one). */
struct entry *kv__off_find_any(kv_offload *off, uint64_t h, bool ready_only)
{
    for (struct entry *e = off->buckets[bucket_of(off, h)]; e; e = e->hnext)
        if (e->hash == h && (e->ready || !ready_only))
            return e;
    return NULL;
}

void kv__off_lru_unlink(kv_offload *off, struct entry *e)
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

void kv__off_lru_append(kv_offload *off, struct entry *e)
{
    e->lru_prev = off->lru_tail;
    e->lru_next = NULL;
    if (off->lru_tail)
        off->lru_tail->lru_next = e;
    else
        off->lru_head = e;
    off->lru_tail = e;
}

void kv__off_lru_touch(kv_offload *off, struct entry *e)
{
    kv__off_lru_unlink(off, e);
    kv__off_lru_append(off, e);
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

void kv__off_table_insert(kv_offload *off, struct entry *e)
{
    const size_t k = bucket_of(off, e->hash);
    e->hnext = off->buckets[k];
    off->buckets[k] = e;
    e->linked = true;
    kv__off_lru_append(off, e);
    off->st.entries++;
    table_grow(off);
}

void kv__off_entry_free(kv_offload *off, struct entry *e)
{
    kv__carver_free(off->carver, e->mem);
    off->st.bytes -= (uint64_t)e->bytes;
    kv__mem_free(e);
}

/* Take e out of the table and the LRU list; free it unless the worker holds it. */
void kv__off_table_remove(kv_offload *off, struct entry *e)
{
    struct entry **pp = &off->buckets[bucket_of(off, e->hash)];
    while (*pp != e)
        pp = &(*pp)->hnext;
    *pp = e->hnext;
    kv__off_lru_unlink(off, e);
    e->linked = false;
    off->st.entries--;
    if (e->pins == 0)
        kv__off_entry_free(off, e);
}

void kv__off_unpin(kv_offload *off, struct entry *e)
{
    if (--e->pins == 0 && !e->linked)
        kv__off_entry_free(off, e);
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
void kv__off_debug_check(const kv_offload *off)
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
bool kv__off_evict_one(kv_offload *off)
{
    for (struct entry *e = off->lru_head; e; e = e->lru_next)
        if (e->pins == 0) {
            kv__off_table_remove(off, e);
            off->st.evictions++;
            return true;
        }
    return false;
}

kv_status kv_offload_evict(kv_offload *off, const uint64_t *hashes, uint32_t n, uint32_t *n_evicted)
{
    if (!off || (n > 0 && !hashes))
        return kv__error(KV_ERR_NULL, "kv_offload_evict: %s is NULL", !off ? "off" : "hashes");
    if (n > 0) {
        const kv_status st =
            kv__check_aligned("kv_offload_evict", "hashes", hashes, sizeof(*hashes));
        if (st != KV_OK)
            return st;
    }
    uint32_t k = 0;
    pthread_mutex_lock(&off->mu);
    if (off->destroyed) { /* the table is gone; a staging buffer or a hold keeps the handle */
        const size_t n_stg = off->n_stg;
        const uint32_t n_holds = off->n_holds;
        pthread_mutex_unlock(&off->mu);
        return kv__error(KV_ERR_BAD_STATE,
                         "kv_offload_evict: the tier is destroyed (%zu staging buffers and %u "
                         "region holds still keep its handle); %u hashes not evicted",
                         n_stg, n_holds, n);
    }
    for (uint32_t i = 0; i < n; i++) /* every format's entry of the hash */
        for (struct entry *e; (e = kv__off_find_any(off, hashes[i], false));) {
            kv__off_table_remove(off, e);
            off->st.evicted++;
            k++;
        }
    kv__off_debug_check(off);
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
    /* destroyed: the table is gone (a staging buffer or a hold keeps the handle) */
    const struct entry *e =
        off->destroyed ? NULL
        : lo           ? kv__off_find(off, hash, kv__off_block_key(lo, kv_cache_head_offset(cache)))
                       : kv__off_find_any(off, hash, true);
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

/* What a block of a cache holds, as half of an entry's key: the block
 * format (layers, N, H, D, dtype, order, packing) and which of the model's
 * heads those are (tensor-parallel ranks of one group share a format). */
uint64_t kv__off_block_key(const struct kv_layout *lo, uint32_t head_offset)
{
    if (head_offset == 0)
        return lo->block_format_fingerprint;
    const uint64_t k[2] = {lo->block_format_fingerprint, head_offset};
    return kv__xxh3_64(k, sizeof(k));
}

kv_status kv__offload_test_corrupt(kv_offload *off, const kv_cache *cache, uint64_t hash,
                                   size_t byte)
{
    kv_status st = KV_OK;
    const struct kv_layout *lo = kv_cache_layout(cache);
    pthread_mutex_lock(&off->mu);
    struct entry *e =
        lo ? kv__off_find(off, hash, kv__off_block_key(lo, kv_cache_head_offset(cache)))
           : kv__off_find_any(off, hash, true);
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
