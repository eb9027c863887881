/*
 * test_offload_model.c - the host offload tier under pressure, against a
 * plain reference model: 10^5 random store / load / evict / cancel /
 * corrupt operations (KVT_MODEL_OPS overrides the count) on a tier whose
 * capacity is a fraction of the working set, shared by three caches of two
 * block formats (two interchange, one does not, and its entries are twice
 * the size). Every key may be stored from either format: the tier keys
 * entries by (hash, block format), so a key has up to two entries, each
 * with its own LRU place, and a load finds only its own format's (another
 * format's alone is KV_ERR_MISMATCH).
 *
 * Up to four ops are in flight at once; then the test waits for all of
 * them and replays them, in the order posted (the worker runs ops FIFO),
 * into the model: an array of entries with an LRU stamp, the byte
 * capacity, and every counter of kv_offload_stats. A hook on the worker
 * counts the chunks each op finished, so a cancel that lands mid-op is
 * replayed exactly: entries of finished chunks took effect, the rest did
 * not. At every such point the test checks
 *   - each entry's status against the model's prediction;
 *   - every loaded block holds exactly what was stored under its hash
 *     (contents are a function of the hash, checked through the reference
 *     addressing of kvtest.h), and a committed block carries the hash;
 *   - kv_offload_contains for every hash in each format and in any, and
 *     every counter of the tier;
 *   - each pool: the sum of ref counts equals the references the test
 *     holds, and free + cached + used blocks equal the capacity.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_offload_int.h"
#include "kvt_cache.h"
#include "kvtest.h"

#define N_KEYS 128 /* each in format 0 (caches A and C) and format 1 (X) */
#define MAX_FLIGHT 4
#define MAX_N 6
#define CHUNK 2
#define WAIT_MS 30000

struct ment { /* the model's entry of one key in one format */
    bool present, corrupt;
    uint64_t stamp; /* LRU: smallest goes first */
};

struct model {
    struct ment e[N_KEYS][2]; /* [key][format] */
    uint64_t clock, bytes, capacity;
    uint64_t eb[2]; /* entry bytes per format */
    struct kv_offload_stats st;
    uint64_t mismatches; /* loads answered KV_ERR_MISMATCH */
    uint64_t beside;     /* stores that made a key's second entry (the other format's held) */
};

struct flight {
    kv_offload_op *op;
    bool load;
    int cache; /* 0 A, 1 C, 2 X */
    uint32_t n;
    int keys[MAX_N];
    uint32_t src[MAX_N]; /* store: the source blocks (held by the test until replay) */
    int chunks;          /* counted by the hook */
};

static pthread_mutex_t hook_mu = PTHREAD_MUTEX_INITIALIZER;
static struct flight fl[MAX_FLIGHT];
static int n_fl;

static void chunk_hook(void *user, enum kv__offload_hook_at at, kv_offload_op *op)
{
    (void)user;
    if (at != KV__OFFLOAD_HOOK_BLOCK)
        return;
    pthread_mutex_lock(&hook_mu);
    for (int i = 0; i < n_fl; i++)
        if (fl[i].op == op)
            fl[i].chunks++;
    pthread_mutex_unlock(&hook_mu);
}

static uint64_t key_hash(int k)
{
    uint64_t s = 0xA11CE + (uint64_t)k * 7919;
    return kvt_rand(&s);
}

static int cache_fmt(int c)
{
    return c == 2;
}

static void m_touch(struct model *m, int k, int f)
{
    m->e[k][f].stamp = ++m->clock;
}

static void m_remove(struct model *m, int k, int f)
{
    m->e[k][f].present = false;
    m->e[k][f].corrupt = false;
    m->bytes -= m->eb[f];
    m->st.entries--;
    m->st.bytes = m->bytes;
}

static void m_insert(struct model *m, int k, int f)
{
    const uint64_t eb = m->eb[f];
    while (m->bytes + eb > m->capacity) { /* the least recent entry of any format */
        int lk = -1, lf = 0;
        for (int j = 0; j < N_KEYS; j++)
            for (int g = 0; g < 2; g++)
                if (m->e[j][g].present && (lk < 0 || m->e[j][g].stamp < m->e[lk][lf].stamp)) {
                    lk = j;
                    lf = g;
                }
        assert_true(lk >= 0);
        m_remove(m, lk, lf);
        m->st.evictions++;
    }
    m->e[k][f].present = true;
    m->e[k][f].corrupt = false;
    m->bytes += eb;
    m->st.entries++;
    m->st.bytes = m->bytes;
    m_touch(m, k, f);
}

/* A held block of cache t holding key k's contents with its hash committed. */
static uint32_t source_block(struct kvt_cache *t, int k)
{
    const uint64_t h = key_hash(k);
    for (;;) {
        uint32_t id, nf = 0;
        assert_int_equal(kv_block_pool_lookup(t->pool, &h, 1, &id, &nf), KV_OK);
        if (nf == 1) { /* written by the test or committed by a load: must hold it */
            assert_true(kvt_block_holds(t, t->base, id, h));
            return id;
        }
        assert_int_equal(kv_block_pool_alloc(t->pool, 1, &id), KV_OK);
        kvt_block_write(t, t->base, id, h);
        bool stored = false;
        assert_int_equal(kv_block_pool_commit_hash(t->pool, id, h, &stored), KV_OK);
        if (stored)
            return id;
        /* a load in flight committed the hash between the lookup and here */
        assert_int_equal(kv_block_pool_release(t->pool, &id, 1), KV_OK);
    }
}

static void check_pool(const struct kvt_cache *t)
{
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(t->pool, &ps);
    assert_int_equal(ps.free_blocks + ps.cached_blocks + ps.used_blocks, ps.capacity);
    assert_int_equal(kvt_pool_refs(t), 0); /* the test holds nothing between rounds */
    assert_int_equal(ps.used_blocks, 0);
}

/* Replay one terminal op into the model and check its results. */
static void replay(struct model *m, struct kvt_cache *caches, struct flight *f)
{
    kv_offload_state s;
    assert_int_equal(kv_offload_wait(f->op, WAIT_MS, &s), KV_OK);
    const struct kv_offload_result *res;
    uint32_t n;
    assert_int_equal(kv_offload_results(f->op, &res, &n), KV_OK);
    assert_int_equal(n, f->n);
    const uint32_t done = (uint32_t)f->chunks * CHUNK < f->n ? (uint32_t)f->chunks * CHUNK : f->n;
    const bool cancelled = s == KV_OFFLOAD_CANCELLED;
    if (!cancelled)
        assert_int_equal(done, f->n);
    struct kvt_cache *t = &caches[f->cache];
    const int fc = cache_fmt(f->cache);
    bool all_ok = true;
    for (uint32_t i = 0; i < n; i++) {
        const int k = f->keys[i];
        const uint64_t h = key_hash(k);
        assert_int_equal(res[i].hash, h);
        kv_status want = KV_ERR_CANCELLED;
        if (!f->load && i < done) {
            if (m->e[k][fc].present) {
                m_touch(m, k, fc);
                m->st.store_touches++;
            } else {
                m->beside += m->e[k][!fc].present;
                m_insert(m, k, fc);
                m->st.stores++;
            }
            want = KV_OK;
        } else if (f->load && i < done) {
            struct ment *e = &m->e[k][fc];
            if (!e->present) { /* held in the other format alone: a mismatch */
                want = m->e[k][!fc].present ? KV_ERR_MISMATCH : KV_ERR_NOT_FOUND;
                m->mismatches += want == KV_ERR_MISMATCH;
                m->st.misses++;
            } else if (e->corrupt) {
                want = KV_ERR_CORRUPT;
                m->st.hits++;
                m->st.checksum_failures++;
                m_remove(m, k, fc);
            } else {
                want = cancelled ? KV_ERR_CANCELLED : KV_OK;
                m->st.hits++;
                m_touch(m, k, fc);
            }
        }
        assert_int_equal(res[i].status, want);
        all_ok = all_ok && want == KV_OK;
        if (!f->load) {
            assert_int_equal(res[i].block, f->src[i]);
            continue;
        }
        if (want != KV_OK) {
            assert_int_equal(res[i].block, KV_BLOCK_NULL);
            assert_false(res[i].committed);
            continue;
        }
        m->st.loads++;
        assert_true(kvt_block_holds(t, t->base, res[i].block, h));
        if (res[i].committed) {
            uint64_t x = 0;
            assert_int_equal(kv_block_pool_block_hash(t->pool, res[i].block, &x), KV_OK);
            assert_int_equal(x, h);
        } else { /* another block carried the hash at commit (it may have been
                  * evicted from the pool since, by a later allocation) */
            uint64_t x = 0;
            assert_int_equal(kv_block_pool_block_hash(t->pool, res[i].block, &x), KV_ERR_NOT_FOUND);
            uint32_t id, nf = 0;
            assert_int_equal(kv_block_pool_lookup(t->pool, &h, 1, &id, &nf), KV_OK);
            if (nf == 1) {
                assert_int_not_equal(id, res[i].block);
                assert_true(kvt_block_holds(t, t->base, id, h));
                assert_int_equal(kv_block_pool_release(t->pool, &id, 1), KV_OK);
            }
        }
        assert_int_equal(kv_block_pool_release(t->pool, &res[i].block, 1), KV_OK);
    }
    if (!f->load) /* the test's own references on the sources */
        assert_int_equal(kv_block_pool_release(t->pool, f->src, f->n), KV_OK);
    const kv_offload_state want_s = cancelled ? KV_OFFLOAD_CANCELLED
                                    : all_ok  ? KV_OFFLOAD_DONE
                                              : KV_OFFLOAD_FAILED;
    assert_int_equal(s, want_s);
    if (s == KV_OFFLOAD_CANCELLED)
        m->st.cancelled_ops++;
    if (s == KV_OFFLOAD_FAILED)
        m->st.failed_ops++;
    assert_int_equal(kv_offload_op_free(f->op), KV_OK);
}

static void quiesce(kv_offload *off, struct model *m, struct kvt_cache *caches)
{
    for (int i = 0; i < n_fl; i++) {
        kv_offload_state s;
        assert_int_equal(kv_offload_wait(fl[i].op, WAIT_MS, &s), KV_OK);
    }
    /* terminal ops: the hook has run for each of their chunks */
    for (int i = 0; i < n_fl; i++)
        replay(m, caches, &fl[i]);
    pthread_mutex_lock(&hook_mu);
    n_fl = 0;
    pthread_mutex_unlock(&hook_mu);
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    m->st.capacity_bytes = st.capacity_bytes;
    m->st.region_bytes = st.region_bytes;
    m->st.staging_bytes = st.staging_bytes;
    assert_string_equal(kvt_offload_stats_diff(&st, &m->st), "");
    assert_true(st.bytes <= st.capacity_bytes);
    for (int k = 0; k < N_KEYS; k++) {
        const uint64_t h = key_hash(k);
        assert_int_equal(kv_offload_contains(off, caches[0].c, h), m->e[k][0].present);
        assert_int_equal(kv_offload_contains(off, caches[1].c, h), m->e[k][0].present);
        assert_int_equal(kv_offload_contains(off, caches[2].c, h), m->e[k][1].present);
        assert_int_equal(kv_offload_contains(off, NULL, h),
                         m->e[k][0].present || m->e[k][1].present);
    }
    for (int c = 0; c < 3; c++)
        check_pool(&caches[c]);
}

static void test_offload_model(void **state)
{
    (void)state;
    long n_ops = 100000;
    const char *env = getenv("KVT_MODEL_OPS");
    if (env && atol(env) > 0)
        n_ops = atol(env);
    uint64_t rng = 0x0FF10AD5EEDull;
    struct kvt_cache caches[3];
    kvt_cache_make(&caches[0], 2, 96, 4, 2, 8, KV_BF16, 4, 1); /* A: NHD layer-major padded */
    kvt_cache_make(&caches[1], 2, 80, 4, 2, 8, KV_BF16, 2, 2); /* C: NHD block-major */
    kvt_cache_make(&caches[2], 2, 64, 8, 2, 8, KV_BF16, 1, 3); /* X: HND, N 8 */
    for (int c = 0; c < 3; c++)
        kvt_pool_scramble(&caches[c], &rng);

    struct model m;
    memset(&m, 0, sizeof(m));
    m.eb[0] = 2 * 2 * 4 * 2 * 8 * 2;
    m.eb[1] = 2 * m.eb[0];
    m.capacity = 96 * m.eb[0] + m.eb[0] / 2; /* ~1/4 of the working set (128 x 3 eb[0]) */
    struct kv_offload_config cfg = KV_OFFLOAD_CONFIG_INIT;
    cfg.capacity_bytes = m.capacity;
    cfg.mem = KV_OFFLOAD_MEM_HOST;
    cfg.threads = 1;
    kv_offload *off;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_OK);
    kv__offload_test_set_chunk(off, CHUNK);
    kv__offload_test_set_hook(off, chunk_hook, NULL);

    long counts[6] = {0};
    for (long it = 0; it < n_ops; it++) {
        if (n_fl == MAX_FLIGHT) { /* the most in flight: a checkpoint first */
            quiesce(off, &m, caches);
            counts[5]++;
        }
        const int r = (int)kvt_range(&rng, 0, 99);
        if (r < 40) { /* store */
            struct flight f = {.load = false, .cache = (int)kvt_range(&rng, 0, 2)};
            f.n = (uint32_t)kvt_range(&rng, 1, MAX_N);
            for (uint32_t i = 0; i < f.n; i++) {
                bool dup;
                do { /* distinct within one store */
                    f.keys[i] = (int)kvt_range(&rng, 0, N_KEYS - 1);
                    dup = false;
                    for (uint32_t j = 0; j < i; j++)
                        dup = dup || f.keys[j] == f.keys[i];
                } while (dup);
                f.src[i] = source_block(&caches[f.cache], f.keys[i]);
            }
            pthread_mutex_lock(&hook_mu); /* registered before the worker's hook can look */
            assert_int_equal(kv_offload_store(off, caches[f.cache].c, f.src, f.n, &f.op), KV_OK);
            fl[n_fl++] = f;
            pthread_mutex_unlock(&hook_mu);
            counts[0]++;
        } else if (r < 78) { /* load */
            struct flight f = {.load = true, .cache = (int)kvt_range(&rng, 0, 2)};
            f.n = (uint32_t)kvt_range(&rng, 1, MAX_N);
            for (uint32_t i = 0; i < f.n; i++)
                f.keys[i] = (int)kvt_range(&rng, 0, N_KEYS - 1);
            uint64_t h[MAX_N];
            for (uint32_t i = 0; i < f.n; i++)
                h[i] = key_hash(f.keys[i]);
            pthread_mutex_lock(&hook_mu); /* registered before the worker's hook can look */
            assert_int_equal(kv_offload_load(off, caches[f.cache].c, h, f.n, &f.op), KV_OK);
            fl[n_fl++] = f;
            pthread_mutex_unlock(&hook_mu);
            counts[1]++;
        } else if (r < 88 && n_fl > 0) { /* cancel one in flight */
            assert_int_equal(kv_offload_cancel(fl[kvt_range(&rng, 0, n_fl - 1)].op), KV_OK);
            counts[2]++;
        } else if (r < 92) { /* evict some keys (held or not), at a quiet point */
            quiesce(off, &m, caches);
            uint64_t h[4];
            const int ne = (int)kvt_range(&rng, 1, 4);
            uint32_t want = 0, got = 0;
            for (int i = 0; i < ne; i++) {
                const int k = (int)kvt_range(&rng, 0, N_KEYS - 1);
                h[i] = key_hash(k);
                for (int g = 0; g < 2; g++) /* every format's entry of the key */
                    if (m.e[k][g].present) {
                        m_remove(&m, k, g);
                        m.st.evicted++;
                        want++;
                    }
            }
            /* a key listed twice is dropped once */
            assert_int_equal(kv_offload_evict(off, h, (uint32_t)ne, &got), KV_OK);
            assert_int_equal(got, want);
            counts[3]++;
        } else if (r < 95) { /* corrupt a held entry, at a quiet point */
            quiesce(off, &m, caches);
            const int k = (int)kvt_range(&rng, 0, N_KEYS - 1);
            const int g = (int)kvt_range(&rng, 0, 1); /* the format: cache A's or X's */
            if (m.e[k][g].corrupt)
                continue; /* a second flip of the same byte would heal it */
            const kv_status st = kv__offload_test_corrupt(off, caches[g ? 2 : 0].c, key_hash(k),
                                                          (size_t)kvt_range(&rng, 0, 511));
            assert_int_equal(st, m.e[k][g].present ? KV_OK : KV_ERR_NOT_FOUND);
            if (m.e[k][g].present)
                m.e[k][g].corrupt = true;
            counts[4]++;
        } else {
            quiesce(off, &m, caches);
            counts[5]++;
        }
    }
    quiesce(off, &m, caches);
    print_message("offload model: %ld ops (store %ld, load %ld, cancel %ld, evict %ld, corrupt "
                  "%ld, checkpoints %ld); %" PRIu64 " stores, %" PRIu64 " loads, %" PRIu64
                  " evictions, %" PRIu64 " checksum failures, %" PRIu64 " cancelled, %" PRIu64
                  " second-format entries, %" PRIu64 " mismatches\n",
                  n_ops, counts[0], counts[1], counts[2], counts[3], counts[4], counts[5],
                  m.st.stores, m.st.loads, m.st.evictions, m.st.checksum_failures,
                  m.st.cancelled_ops, m.beside, m.mismatches);
    assert_true(m.st.evictions > 1000); /* the capacity really was under pressure */
    assert_true(m.st.cancelled_ops > 100);
    assert_true(m.st.checksum_failures > 10);
    assert_true(m.beside > 100);     /* keys really held in both formats at once */
    assert_true(m.mismatches > 100); /* and in the other format alone */
    kv_offload_destroy(off);
    for (int c = 0; c < 3; c++)
        kvt_cache_free(&caches[c]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_offload_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
