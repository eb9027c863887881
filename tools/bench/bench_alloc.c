/*
 * bench_alloc.c - block pool benchmarks (see docs/bench-method.md).
 *
 *   alloc.pairs          alloc + release pairs per second on a pool that is
 *                        75% held (a busy cache): one id per call, 64 ids per
 *                        call, and 2 threads on one pool (one id per call).
 *                        Baseline `naive`: a mutex-protected bitmap with a
 *                        first-fit scan (the obvious allocator).
 *   alloc.prefix_lookup  per-block chained prefix hash (XXH3) + hash-table
 *                        lookup + retain, then release, for 256 sequences of
 *                        32 cached blocks of 16 tokens. Baselines: `naive`
 *                        (FNV-1a chain + linear search over the committed
 *                        hashes) and `hash_only` (kv_block_hash alone: the
 *                        cost floor the lookup adds to).
 *
 * Candidate and baseline run interleaved (A B A B ...) after a warm-up;
 * medians are reported. Sizes fit in cache on purpose: these are
 * metadata-path rates, not memory bandwidth.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "kv_block_pool.h"
#include "kv_mem.h"

#define KVB_POOL_BLOCKS 65536u /* ids 1 .. 65535 */
#define KVB_HELD_FRACTION 0.75

static void kvb__alloc_die(const char *what, kv_status st)
{
    fprintf(stderr, "kvbench: %s failed: %s (%s)\n", what, kv_status_name(st), kv_last_error());
    kvb_sink((uint64_t)st);
}

/* ---- the naive baseline: mutex + bitmap first-fit ----------------------- */

struct kvb__bitmap {
    pthread_mutex_t mu;
    uint64_t *bits; /* [words]; bit set = held; bit 0 (null block) always set */
    uint32_t words;
};

static int kvb__bitmap_init(struct kvb__bitmap *b, uint32_t num_blocks)
{
    b->words = (num_blocks + 63) / 64;
    b->bits = kv__mem_calloc(b->words, sizeof(uint64_t));
    if (!b->bits)
        return -1;
    b->bits[0] = 1; /* null block */
    for (uint32_t i = num_blocks; i < b->words * 64u; i++)
        b->bits[i / 64] |= 1ull << (i % 64);
    pthread_mutex_init(&b->mu, NULL);
    return 0;
}

static void kvb__bitmap_fini(struct kvb__bitmap *b)
{
    pthread_mutex_destroy(&b->mu);
    kv__mem_free(b->bits);
}

/* n ids by first-fit scan from word 0; all-or-nothing. */
static int kvb__bitmap_alloc(struct kvb__bitmap *b, uint32_t n, uint32_t *ids)
{
    uint32_t got = 0;
    pthread_mutex_lock(&b->mu);
    for (uint32_t w = 0; w < b->words && got < n; w++) {
        while (b->bits[w] != ~0ull && got < n) {
            int bit = __builtin_ctzll(~b->bits[w]);
            b->bits[w] |= 1ull << bit;
            ids[got++] = w * 64u + (uint32_t)bit;
        }
    }
    if (got < n) /* undo */
        for (uint32_t i = 0; i < got; i++)
            b->bits[ids[i] / 64] &= ~(1ull << (ids[i] % 64));
    pthread_mutex_unlock(&b->mu);
    return got == n ? 0 : -1;
}

static void kvb__bitmap_release(struct kvb__bitmap *b, const uint32_t *ids, uint32_t n)
{
    pthread_mutex_lock(&b->mu);
    for (uint32_t i = 0; i < n; i++)
        b->bits[ids[i] / 64] &= ~(1ull << (ids[i] % 64));
    pthread_mutex_unlock(&b->mu);
}

/* ---- alloc.pairs --------------------------------------------------------- */

struct kvb__pairs_job {
    kv_block_pool *pool;       /* candidate, or NULL for the baseline */
    struct kvb__bitmap *naive; /* baseline */
    uint64_t pairs;            /* alloc+release pairs to run */
    uint32_t batch;            /* ids per call */
    pthread_barrier_t *start;  /* NULL when single-threaded */
    int failed;
};

static void *kvb__pairs_run(void *arg)
{
    struct kvb__pairs_job *j = arg;
    uint32_t ids[64];
    uint64_t sum = 0;
    if (j->start)
        pthread_barrier_wait(j->start);
    for (uint64_t done = 0; done < j->pairs; done += j->batch) {
        if (j->pool) {
            if (kv_block_pool_alloc(j->pool, j->batch, ids) != KV_OK ||
                kv_block_pool_release(j->pool, ids, j->batch) != KV_OK) {
                j->failed = 1;
                break;
            }
        } else {
            if (kvb__bitmap_alloc(j->naive, j->batch, ids) != 0) {
                j->failed = 1;
                break;
            }
            kvb__bitmap_release(j->naive, ids, j->batch);
        }
        sum += ids[0];
    }
    kvb_sink(sum);
    return NULL;
}

/* Seconds for `threads` workers of pairs/threads pairs each. */
static double kvb__pairs_time(kv_block_pool *pool, struct kvb__bitmap *naive, uint64_t pairs,
                              uint32_t batch, int threads, int *failed)
{
    struct kvb__pairs_job jobs[2];
    pthread_t th[2];
    pthread_barrier_t bar;
    double t0, t1;
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct kvb__pairs_job){
            pool, naive, pairs / (uint64_t)threads, batch, threads > 1 ? &bar : NULL, 0};
    if (threads == 1) {
        t0 = kvb_now();
        kvb__pairs_run(&jobs[0]);
        t1 = kvb_now();
    } else {
        pthread_barrier_init(&bar, NULL, (unsigned)threads + 1);
        for (int i = 0; i < threads; i++)
            pthread_create(&th[i], NULL, kvb__pairs_run, &jobs[i]);
        pthread_barrier_wait(&bar);
        t0 = kvb_now();
        for (int i = 0; i < threads; i++)
            pthread_join(th[i], NULL);
        t1 = kvb_now();
        pthread_barrier_destroy(&bar);
    }
    for (int i = 0; i < threads; i++)
        *failed |= jobs[i].failed;
    return t1 - t0;
}

static void kvb__pairs_case(uint32_t batch, int threads)
{
    static const char bench[] = "alloc.pairs";
    char case_name[128];
    const uint64_t pairs = kvb_quick() ? 100000 : 1000000;
    const int runs = kvb_runs();
    const uint32_t held_n = (uint32_t)((KVB_POOL_BLOCKS - 1) * KVB_HELD_FRACTION);
    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = KVB_POOL_BLOCKS};
    kv_block_pool *pool = NULL;
    struct kvb__bitmap naive;
    uint32_t *held = NULL;
    double cand[64], base[64];
    int failed = 0;
    kv_status st;

    snprintf(case_name, sizeof(case_name), "%dthread%s/batch%u/blocks%u/held75%%", threads,
             threads > 1 ? "s" : "", batch, KVB_POOL_BLOCKS);
    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);

    st = kv_block_pool_create(&cfg, &pool);
    if (st != KV_OK) {
        kvb__alloc_die("kv_block_pool_create", st);
        return;
    }
    held = kv__mem_calloc(held_n, sizeof(*held));
    if (!held || kvb__bitmap_init(&naive, KVB_POOL_BLOCKS) != 0) {
        fprintf(stderr, "kvbench: %s: out of memory\n", bench);
        kv__mem_free(held);
        kv_block_pool_destroy(pool);
        return;
    }
    /* A busy cache: 75% of the blocks held by both allocators. */
    st = kv_block_pool_alloc(pool, held_n, held);
    if (st != KV_OK || kvb__bitmap_alloc(&naive, held_n, held) != 0) {
        kvb__alloc_die("pre-allocation", st);
        goto out;
    }
    /* Warm-up, then interleaved runs. */
    kvb__pairs_time(pool, NULL, pairs / 10, batch, threads, &failed);
    kvb__pairs_time(NULL, &naive, pairs / 10, batch, threads, &failed);
    for (int r = 0; r < runs && r < 64; r++) {
        cand[r] = kvb__pairs_time(pool, NULL, pairs, batch, threads, &failed);
        base[r] = kvb__pairs_time(NULL, &naive, pairs, batch, threads, &failed);
    }
    if (failed) {
        fprintf(stderr, "kvbench: %s %s: an allocation failed\n", bench, case_name);
        goto out;
    }
    kvb_emit_ops(bench, case_name, pairs, kvb_median(cand, runs < 64 ? runs : 64), "naive",
                 kvb_median(base, runs < 64 ? runs : 64), runs < 64 ? runs : 64);
out:
    kvb__bitmap_fini(&naive);
    kv__mem_free(held);
    kv_block_pool_destroy(pool);
}

static void kvb__alloc_pairs(void)
{
    kvb__pairs_case(1, 1);
    kvb__pairs_case(64, 1);
    kvb__pairs_case(1, 2);
}

/* ---- alloc.prefix_lookup ------------------------------------------------- */

#define KVB_SEQS 256
#define KVB_SEQ_BLOCKS 32
#define KVB_BT 16

/* FNV-1a over the same fields, chained: the obvious hand-rolled hash. */
static uint64_t kvb__fnv_block(uint64_t parent, const int32_t *tokens, uint32_t n, uint64_t extra)
{
    uint64_t h = 0xcbf29ce484222325ull;
    const uint64_t words[2] = {parent, extra};
    const unsigned char *p = (const unsigned char *)words;
    for (size_t i = 0; i < sizeof(words); i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    p = (const unsigned char *)tokens;
    for (size_t i = 0; i < (size_t)n * 4; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

struct kvb__naive_cache {
    uint64_t *hash; /* [n] committed hashes, in commit order */
    uint32_t *id;   /* [n] */
    uint32_t *ref;  /* [num ids] */
    uint32_t n;
};

/* Longest prefix by FNV chain + linear search; retain, then release. */
static uint32_t kvb__naive_match(struct kvb__naive_cache *c, const int32_t *tokens, uint32_t nb,
                                 uint32_t *ids)
{
    uint64_t parent = 0;
    uint32_t found = 0;
    for (; found < nb; found++) {
        uint32_t k;
        parent = kvb__fnv_block(parent, tokens + (size_t)found * KVB_BT, KVB_BT, 0);
        for (k = 0; k < c->n && c->hash[k] != parent; k++)
            ;
        if (k == c->n)
            break;
        ids[found] = c->id[k];
        c->ref[c->id[k]]++;
    }
    for (uint32_t i = 0; i < found; i++)
        c->ref[ids[i]]--;
    return found;
}

static void kvb__alloc_prefix_lookup(void)
{
    static const char bench[] = "alloc.prefix_lookup";
    char case_name[128];
    const int runs = kvb_runs() < 64 ? kvb_runs() : 64;
    const uint32_t total = KVB_SEQS * KVB_SEQ_BLOCKS;
    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = KVB_POOL_BLOCKS};
    kv_block_pool *pool = NULL;
    struct kvb__naive_cache nc = {0};
    int32_t *tokens = NULL; /* [KVB_SEQS][KVB_SEQ_BLOCKS * KVB_BT] */
    uint32_t ids[KVB_SEQ_BLOCKS];
    double cand[64], base[64], hash_only[64];
    uint64_t sum = 0;
    int bad = 0;
    kv_status st;

    snprintf(case_name, sizeof(case_name), "seqs%d/blocks%d/N%d/cached%u", KVB_SEQS, KVB_SEQ_BLOCKS,
             KVB_BT, total);
    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);

    tokens = kv__mem_alloc((size_t)total * KVB_BT * sizeof(int32_t));
    nc.hash = kv__mem_calloc(total, sizeof(uint64_t));
    nc.id = kv__mem_calloc(total, sizeof(uint32_t));
    nc.ref = kv__mem_calloc(KVB_POOL_BLOCKS, sizeof(uint32_t));
    st = kv_block_pool_create(&cfg, &pool);
    if (!tokens || !nc.hash || !nc.id || !nc.ref || st != KV_OK) {
        kvb__alloc_die("prefix_lookup setup", st);
        goto out;
    }
    kvb_fill_random(tokens, (size_t)total * KVB_BT * sizeof(int32_t), 42);
    /* Every sequence's blocks committed as a chain, then released: all
     * cached (ref 0, on the free list), as after a finished request. */
    for (uint32_t s = 0; s < KVB_SEQS; s++) {
        const int32_t *t = tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT;
        uint64_t parent = KV_BLOCK_HASH_ROOT, fparent = 0;
        st = kv_block_pool_alloc(pool, KVB_SEQ_BLOCKS, ids);
        for (uint32_t b = 0; st == KV_OK && b < KVB_SEQ_BLOCKS; b++) {
            st =
                kv_block_pool_commit_full(pool, ids[b], parent, t + b * KVB_BT, KVB_BT, 0, &parent);
            fparent = kvb__fnv_block(fparent, t + b * KVB_BT, KVB_BT, 0);
            nc.hash[nc.n] = fparent;
            nc.id[nc.n++] = ids[b];
        }
        if (st == KV_OK)
            st = kv_block_pool_release(pool, ids, KVB_SEQ_BLOCKS);
        if (st != KV_OK) {
            kvb__alloc_die("prefix_lookup commit", st);
            goto out;
        }
    }

    for (int r = -1; r < runs; r++) { /* r == -1: warm-up */
        double t0 = kvb_now();
        for (uint32_t s = 0; s < KVB_SEQS; s++) {
            uint32_t n = 0;
            st = kv_block_pool_match_prefix(pool, tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT,
                                            (uint64_t)KVB_SEQ_BLOCKS * KVB_BT, KVB_BT, 0, ids, NULL,
                                            KVB_SEQ_BLOCKS, &n);
            bad |= st != KV_OK || n != KVB_SEQ_BLOCKS;
            bad |= kv_block_pool_release(pool, ids, n) != KV_OK;
            sum += ids[0];
        }
        double t1 = kvb_now();
        for (uint32_t s = 0; s < KVB_SEQS; s++) {
            uint32_t n = kvb__naive_match(&nc, tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT,
                                          KVB_SEQ_BLOCKS, ids);
            bad |= n != KVB_SEQ_BLOCKS;
            sum += ids[0];
        }
        double t2 = kvb_now();
        for (uint32_t s = 0; s < KVB_SEQS; s++) {
            uint64_t parent = KV_BLOCK_HASH_ROOT;
            const int32_t *t = tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT;
            for (uint32_t b = 0; b < KVB_SEQ_BLOCKS; b++)
                parent = kv_block_hash(parent, t + b * KVB_BT, KVB_BT, 0);
            sum += parent;
        }
        double t3 = kvb_now();
        if (r >= 0) {
            cand[r] = t1 - t0;
            base[r] = t2 - t1;
            hash_only[r] = t3 - t2;
        }
    }
    kvb_sink(sum);
    if (bad) {
        fprintf(stderr, "kvbench: %s: a lookup did not find the whole prefix\n", bench);
        goto out;
    }
    kvb_emit_ops(bench, case_name, total, kvb_median(cand, runs), "naive", kvb_median(base, runs),
                 runs);
    kvb_emit_ops(bench, case_name, total, kvb_median(cand, runs), "hash_only",
                 kvb_median(hash_only, runs), runs);
out:
    kv_block_pool_destroy(pool);
    kv__mem_free(nc.ref);
    kv__mem_free(nc.id);
    kv__mem_free(nc.hash);
    kv__mem_free(tokens);
}

KVB_REGISTER("alloc", kvb__alloc_pairs)
KVB_REGISTER("alloc", kvb__alloc_prefix_lookup)
