/*
 * kvt_offload.h - the offload tier in a test (kvt_cache.h caches): blocks
 * written and committed under hashes, an op waited for, a store checked
 * entry by entry with its source arena unchanged, a load checked against
 * the WHOLE destination arena (its snapshot plus the blocks loaded, so a
 * stray write anywhere fails). Include after <cmocka.h>.
 */
#ifndef KVT_OFFLOAD_H
#define KVT_OFFLOAD_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kv.h>

#include "kvt_cache.h"
#include "kvt_side.h"

/* How long kvt_offload_finish waits for an op. */
#define KVT_OFFLOAD_WAIT_MS 20000

/* n blocks of t (spread: the pool is scrambled by the caller), each filled
 * with the contents of hashes[i] and committed under it; ids out. */
static inline void kvt_put_blocks(struct kvt_cache *t, const uint64_t *hashes, uint32_t n,
                                  uint32_t *ids)
{
    assert_int_equal(kv_block_pool_alloc(t->pool, n, ids), KV_OK);
    for (uint32_t i = 0; i < n; i++) {
        kvt_block_write(t, t->base, ids[i], hashes[i]);
        bool stored = false;
        assert_int_equal(kv_block_pool_commit_hash(t->pool, ids[i], hashes[i], &stored), KV_OK);
        assert_true(stored);
    }
}

/* Wait (KVT_OFFLOAD_WAIT_MS) for op; its state. */
static inline kv_offload_state kvt_offload_finish(kv_offload_op *op)
{
    kv_offload_state s = KV_OFFLOAD_PENDING;
    assert_int_equal(kv_offload_wait(op, KVT_OFFLOAD_WAIT_MS, &s), KV_OK);
    return s;
}

/* Store hashes[n] from t (blocks written here; released right after the
 * post when release, the tier holding its own references) and wait: DONE,
 * every entry KV_OK, the source arena unchanged by the store, refs back to
 * the caller's. */
static inline void kvt_store_all(kv_offload *off, struct kvt_cache *t, const uint64_t *hashes,
                                 uint32_t n, bool release)
{
    uint32_t *ids = malloc(n * sizeof(*ids));
    assert_non_null(ids);
    kvt_put_blocks(t, hashes, n, ids);
    unsigned char *snap = malloc(t->bytes);
    assert_non_null(snap);
    memcpy(snap, t->base, t->bytes);
    const uint64_t refs = kvt_pool_refs(t);
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_store(off, t->c, ids, n, &op), KV_OK);
    if (release)
        assert_int_equal(kv_block_pool_release(t->pool, ids, n), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    const struct kv_offload_result *res;
    uint32_t nr;
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    assert_int_equal(nr, n);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(res[i].status, KV_OK);
        assert_int_equal(res[i].hash, hashes[i]);
        assert_int_equal(res[i].block, ids[i]);
        assert_true(kv_offload_contains(off, t->c, hashes[i]));
    }
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kvt_pool_refs(t), release ? refs - n : refs);
    assert_int_equal(kvt_first_diff(snap, t->base, (int64_t)t->bytes), -1);
    free(snap);
    free(ids);
}

/* Load hashes[n] into d and check the whole arena: want[i] KV_OK = the
 * block holds hashes[i]'s contents (and is committed under it, when
 * must_commit), else the entry fails with want[i] and nothing of it is
 * anywhere. Returns the op's state (DONE iff every want[i] is KV_OK);
 * loaded blocks are released (they stay cached under their hashes). */
static inline kv_offload_state kvt_load_check(kv_offload *off, struct kvt_cache *d,
                                              const uint64_t *hashes, uint32_t n,
                                              const kv_status *want, bool must_commit)
{
    unsigned char *exp = malloc(d->bytes);
    assert_non_null(exp);
    memcpy(exp, d->base, d->bytes);
    struct kv_block_pool_stats before, after;
    kv_block_pool_stats_get(d->pool, &before);
    const uint64_t refs = kvt_pool_refs(d);
    kv_offload_op *op = NULL;
    assert_int_equal(kv_offload_load(off, d->c, hashes, n, &op), KV_OK);
    const kv_offload_state s = kvt_offload_finish(op);
    const struct kv_offload_result *res;
    uint32_t nr;
    assert_int_equal(kv_offload_results(op, &res, &nr), KV_OK);
    assert_int_equal(nr, n);
    bool all_ok = true;
    uint32_t held = 0;
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(res[i].hash, hashes[i]);
        if (want[i] != KV_OK) {
            assert_int_equal(res[i].status, want[i]);
            assert_int_equal(res[i].block, KV_BLOCK_NULL);
            assert_false(res[i].committed);
            all_ok = false;
            continue;
        }
        assert_int_equal(res[i].status, KV_OK);
        assert_int_not_equal(res[i].block, KV_BLOCK_NULL);
        assert_int_equal(kv_block_pool_ref_count(d->pool, res[i].block), 1);
        kvt_block_write(d, exp, res[i].block, hashes[i]);
        if (must_commit)
            assert_true(res[i].committed);
        if (res[i].committed) {
            uint64_t h = 0;
            assert_int_equal(kv_block_pool_block_hash(d->pool, res[i].block, &h), KV_OK);
            assert_int_equal(h, hashes[i]);
        }
        held++;
    }
    assert_int_equal(s, all_ok ? KV_OFFLOAD_DONE : KV_OFFLOAD_FAILED);
    /* a failed entry writes nothing (the checksum is verified before the
     * copy): the whole arena is exactly the expectation */
    assert_int_equal(kvt_first_diff(exp, d->base, (int64_t)d->bytes), -1);
    assert_int_equal(kvt_pool_refs(d), refs + held);
    kv_block_pool_stats_get(d->pool, &after);
    assert_int_equal(after.used_blocks, before.used_blocks + held);
    for (uint32_t i = 0; i < n; i++)
        if (res[i].status == KV_OK)
            assert_int_equal(kv_block_pool_release(d->pool, &res[i].block, 1), KV_OK);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    free(exp);
    return s;
}

#endif /* KVT_OFFLOAD_H */
