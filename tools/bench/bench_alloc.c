/*
 * bench_alloc.c - block pool benchmarks (see docs/bench-method.md).
 *
 *   alloc.pairs          alloc + release pairs per second on a pool that is
 *                        75% held (a busy cache): one id per call, 64 ids per
 *                        call, and 2 threads on one pool (one id per call).
 *                        Baseline `mutex_stack`: one pthread mutex and a LIFO
 *                        array of free ids (pop n / push n under the lock)
 *                        with a ref count per id, the same 75% held: what a
 *                        strong engineer writes when no prefix cache is
 *                        needed. After the runs both must still hold exactly
 *                        the 75% (kvb_mismatch otherwise).
 *   alloc.prefix_lookup  longest cached prefix (chained XXH3 per block of 16
 *                        tokens, hash-table lookup, retain), then release,
 *                        for 256 sequences of 32 cached blocks. Baselines:
 *                        `hash_table` (the same chained XXH3 hash over the
 *                        same bytes, a power-of-two open-addressing table with
 *                        linear probing at load 1/2, a ref count per id
 *                        behind one mutex) and `hash_chain_floor`
 *                        (kv_block_hash alone: no table, no ref counts; not an
 *                        alternative but the share of the lookup that is
 *                        hashing, so its ratio is < 1 by construction). Every
 *                        lookup's hit count and ids must equal the
 *                        baseline's, and the candidate's hashes the
 *                        baseline's (kvb_mismatch otherwise).
 *
 * Candidate and baseline run interleaved (A B A B ...) after a warm-up;
 * medians are reported. Sizes fit in cache on purpose: these are
 * metadata-path rates, not memory bandwidth.
 */
#include <pthread.h>
#include <stdio.h>

#include <xxhash.h>

#include "bench.h"
#include "kv_block_pool.h"
#include "kv_mem.h"

#define KVB_POOL_BLOCKS 65536u /* ids 1 .. 65535 */
#define KVB_HELD_FRACTION 0.75
#define KVB_MAX_RUNS 64

/* ---- baseline mutex_stack: a mutex and a LIFO stack of free ids ------------- */

/*
 * Ids 1 .. num_blocks-1 (0 is the null block, as in the pool).
 *   n_free + (ids with ref > 0) == num_blocks - 1
 *   free_ids[0, n_free) are exactly the ids with ref == 0
 */
struct kvb__stack {
    pthread_mutex_t mu; /* guards everything below */
    uint32_t *free_ids; /* [num_blocks - 1]; the top is free_ids[n_free - 1] */
    uint32_t *ref;      /* [num_blocks] */
    uint32_t n_free;
    uint32_t num_blocks;
};

static int kvb__stack_init(struct kvb__stack *k, uint32_t num_blocks)
{
    k->free_ids = kv__mem_calloc(num_blocks - 1, sizeof(uint32_t));
    k->ref = kv__mem_calloc(num_blocks, sizeof(uint32_t));
    if (!k->free_ids || !k->ref) {
        kv__mem_free(k->free_ids);
        kv__mem_free(k->ref);
        return -1;
    }
    /* pushed high to low, so the first pops are 1, 2, 3 ... like the pool */
    for (uint32_t i = 0; i < num_blocks - 1; i++)
        k->free_ids[i] = num_blocks - 1 - i;
    k->n_free = num_blocks - 1;
    k->num_blocks = num_blocks;
    pthread_mutex_init(&k->mu, NULL);
    return 0;
}

static void kvb__stack_fini(struct kvb__stack *k)
{
    pthread_mutex_destroy(&k->mu);
    kv__mem_free(k->ref);
    kv__mem_free(k->free_ids);
}

/* n ids with ref 1; all or nothing (-1 when fewer than n are free). */
static int kvb__stack_alloc(struct kvb__stack *k, uint32_t n, uint32_t *ids)
{
    pthread_mutex_lock(&k->mu);
    if (k->n_free < n) {
        pthread_mutex_unlock(&k->mu);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t id = k->free_ids[--k->n_free];
        k->ref[id] = 1;
        ids[i] = id;
    }
    pthread_mutex_unlock(&k->mu);
    return 0;
}

/* ref -= 1 for each id, pushed back at 0; refused (-1, nothing changed) when
 * an id is out of range or not held. */
static int kvb__stack_release(struct kvb__stack *k, const uint32_t *ids, uint32_t n)
{
    pthread_mutex_lock(&k->mu);
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] == 0 || ids[i] >= k->num_blocks || k->ref[ids[i]] == 0) {
            pthread_mutex_unlock(&k->mu);
            return -1;
        }
    for (uint32_t i = 0; i < n; i++)
        if (--k->ref[ids[i]] == 0)
            k->free_ids[k->n_free++] = ids[i];
    pthread_mutex_unlock(&k->mu);
    return 0;
}

/* ---- alloc.pairs ---------------------------------------------------------------- */

struct kvb__pairs_job {
    kv_block_pool *pool;      /* candidate, or NULL for the baseline */
    struct kvb__stack *stack; /* baseline */
    uint64_t pairs;           /* alloc+release pairs to run */
    uint32_t batch;           /* ids per call */
    pthread_barrier_t *start; /* NULL when single-threaded */
    double t0, t1;            /* this worker's own start and end */
    int failed;               /* a call failed: why[] says which and how */
    char why[400];
};

static void *kvb__pairs_run(void *arg)
{
    struct kvb__pairs_job *j = arg;
    uint32_t ids[64];
    uint64_t sum = 0;
    if (j->start)
        pthread_barrier_wait(j->start);
    j->t0 = kvb_now();
    for (uint64_t done = 0; done < j->pairs; done += j->batch) {
        if (j->pool) {
            kv_status st = kv_block_pool_alloc(j->pool, j->batch, ids);
            if (st == KV_OK)
                st = kv_block_pool_release(j->pool, ids, j->batch);
            if (st != KV_OK) { /* the last error is this thread's: copy it now */
                snprintf(j->why, sizeof(j->why), "kv_block_pool alloc/release of %u ids: %s (%s)",
                         j->batch, kv_status_name(st), kv_last_error());
                j->failed = 1;
                break;
            }
        } else if (kvb__stack_alloc(j->stack, j->batch, ids) != 0 ||
                   kvb__stack_release(j->stack, ids, j->batch) != 0) {
            snprintf(j->why, sizeof(j->why), "mutex_stack alloc/release of %u ids refused",
                     j->batch);
            j->failed = 1;
            break;
        }
        sum += ids[0];
    }
    j->t1 = kvb_now();
    kvb_sink(sum);
    return NULL;
}

/* Seconds from the first worker's start to the last one's end, for
 * `threads` workers of pairs/threads pairs each (timed by the workers
 * themselves: with 2 cores the main thread may not run again until they are
 * done). A failure is copied to *fail (the first one seen). */
static double kvb__pairs_time(kv_block_pool *pool, struct kvb__stack *stack, uint64_t pairs,
                              uint32_t batch, int threads, struct kvb__pairs_job *fail)
{
    struct kvb__pairs_job jobs[2];
    pthread_t th[2];
    pthread_barrier_t bar;
    if (threads > 1)
        pthread_barrier_init(&bar, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct kvb__pairs_job){.pool = pool,
                                          .stack = stack,
                                          .pairs = pairs / (uint64_t)threads,
                                          .batch = batch,
                                          .start = threads > 1 ? &bar : NULL};
    if (threads == 1) {
        kvb__pairs_run(&jobs[0]);
    } else {
        for (int i = 0; i < threads; i++)
            pthread_create(&th[i], NULL, kvb__pairs_run, &jobs[i]);
        for (int i = 0; i < threads; i++)
            pthread_join(th[i], NULL);
        pthread_barrier_destroy(&bar);
    }
    double t0 = jobs[0].t0, t1 = jobs[0].t1;
    for (int i = 0; i < threads; i++) {
        t0 = jobs[i].t0 < t0 ? jobs[i].t0 : t0;
        t1 = jobs[i].t1 > t1 ? jobs[i].t1 : t1;
        if (jobs[i].failed && !fail->failed)
            *fail = jobs[i];
    }
    return t1 - t0;
}

static void kvb__pairs_case(uint32_t batch, int threads)
{
    static const char bench[] = "alloc.pairs";
    char case_name[128];
    const uint64_t pairs = kvb_quick() ? 100000 : 1000000;
    const int runs = kvb_runs() < KVB_MAX_RUNS ? kvb_runs() : KVB_MAX_RUNS;
    const uint32_t held_n = (uint32_t)((KVB_POOL_BLOCKS - 1) * KVB_HELD_FRACTION);
    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = KVB_POOL_BLOCKS};
    kv_block_pool *pool = NULL;
    struct kvb__stack stack;
    struct kvb__pairs_job fail = {0};
    struct kv_block_pool_stats ps;
    uint32_t *held = NULL, *held2 = NULL;
    double cand[KVB_MAX_RUNS], base[KVB_MAX_RUNS];
    kv_status st;

    snprintf(case_name, sizeof(case_name), "%dthread%s/batch%u/blocks%u/held75%%", threads,
             threads > 1 ? "s" : "", batch, KVB_POOL_BLOCKS);
    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);

    st = kv_block_pool_create(&cfg, &pool);
    if (st != KV_OK) {
        kvb_failed(bench, case_name, "kv_block_pool_create(num_blocks %u): %s (%s)",
                   KVB_POOL_BLOCKS, kv_status_name(st), kv_last_error());
        return;
    }
    held = kv__mem_calloc(held_n, sizeof(*held));
    held2 = kv__mem_calloc(held_n, sizeof(*held2));
    if (!held || !held2 || kvb__stack_init(&stack, KVB_POOL_BLOCKS) != 0) {
        kvb_failed(bench, case_name, "out of memory for %u ids", KVB_POOL_BLOCKS);
        kv__mem_free(held2);
        kv__mem_free(held);
        kv_block_pool_destroy(pool);
        return;
    }
    /* A busy cache: 75% of the blocks held in both allocators. */
    st = kv_block_pool_alloc(pool, held_n, held);
    if (st != KV_OK) {
        kvb_failed(bench, case_name, "holding %u of %u blocks: %s (%s)", held_n,
                   KVB_POOL_BLOCKS - 1, kv_status_name(st), kv_last_error());
        goto out;
    }
    if (kvb__stack_alloc(&stack, held_n, held2) != 0) {
        kvb_failed(bench, case_name, "mutex_stack: holding %u of %u blocks", held_n,
                   KVB_POOL_BLOCKS - 1);
        goto out;
    }
    /* Warm-up, then interleaved runs. */
    kvb__pairs_time(pool, NULL, pairs / 10, batch, threads, &fail);
    kvb__pairs_time(NULL, &stack, pairs / 10, batch, threads, &fail);
    for (int r = 0; r < runs && !fail.failed; r++) {
        cand[r] = kvb__pairs_time(pool, NULL, pairs, batch, threads, &fail);
        base[r] = kvb__pairs_time(NULL, &stack, pairs, batch, threads, &fail);
    }
    if (fail.failed) {
        kvb_failed(bench, case_name, "%s", fail.why);
        goto out;
    }
    /* Every pair gave back what it took: both still hold exactly the 75%. */
    kv_block_pool_stats_get(pool, &ps);
    if (ps.used_blocks != held_n || stack.n_free != KVB_POOL_BLOCKS - 1 - held_n) {
        kvb_mismatch(bench, case_name,
                     "after the runs the pool holds %u blocks and mutex_stack %u, expected %u",
                     ps.used_blocks, KVB_POOL_BLOCKS - 1 - stack.n_free, held_n);
        goto out;
    }
    kvb_emit_ops(bench, case_name, pairs, kvb_median(cand, runs), "mutex_stack",
                 kvb_median(base, runs), runs);
out:
    kvb__stack_fini(&stack);
    kv__mem_free(held2);
    kv__mem_free(held);
    kv_block_pool_destroy(pool);
}

static void kvb__alloc_pairs(void)
{
    kvb__pairs_case(1, 1);
    kvb__pairs_case(64, 1);
    kvb__pairs_case(1, 2);
}

/* ---- alloc.prefix_lookup: baseline hash_table -------------------------------- */

#define KVB_SEQS 256
#define KVB_SEQ_BLOCKS 32
#define KVB_BT 16

/* The chained block hash, written directly against xxhash.h: XXH3-64 of
 * parent (le64), extra_key (le64), n_tokens (le32), tokens (le32 each) --
 * the bytes kv_block_hash hashes, so both tables hold the same keys. */
static uint64_t kvb__xxh3_block(uint64_t parent, const int32_t *tokens, uint64_t extra_key)
{
    unsigned char buf[20 + 4 * KVB_BT];
    for (int i = 0; i < 8; i++) {
        buf[i] = (unsigned char)(parent >> (8 * i));
        buf[8 + i] = (unsigned char)(extra_key >> (8 * i));
    }
    for (int i = 0; i < 4; i++)
        buf[16 + i] = (unsigned char)((uint32_t)KVB_BT >> (8 * i));
    for (int t = 0; t < KVB_BT; t++)
        for (int i = 0; i < 4; i++)
            buf[20 + 4 * t + i] = (unsigned char)((uint32_t)tokens[t] >> (8 * i));
    return XXH3_64bits(buf, sizeof(buf));
}

/*
 * A prefix cache as a strong engineer would write it without our pool: an
 * open-addressing table of (hash, id), power-of-two capacity >= 2 * entries
 * (load <= 1/2), linear probing from hash & mask (XXH3 bits are uniform), and
 * a ref count per id, all behind one mutex as in the (thread-safe) pool.
 * Id 0 marks an empty slot. No free list or eviction: the candidate also
 * moves each hit block off its LRU list and back, which this does not.
 */
struct kvb__slot {
    uint64_t hash;
    uint32_t id;
    uint32_t pad;
};

struct kvb__hash_table {
    pthread_mutex_t mu;     /* guards slots and ref */
    struct kvb__slot *slot; /* [mask + 1] */
    uint64_t mask;
    uint32_t *ref; /* [KVB_POOL_BLOCKS] */
};

static int kvb__ht_init(struct kvb__hash_table *h, uint32_t entries)
{
    uint64_t cap = 1;
    while (cap < 2 * (uint64_t)entries)
        cap <<= 1;
    h->slot = kv__mem_calloc(cap, sizeof(*h->slot));
    h->ref = kv__mem_calloc(KVB_POOL_BLOCKS, sizeof(*h->ref));
    if (!h->slot || !h->ref) {
        kv__mem_free(h->slot);
        kv__mem_free(h->ref);
        return -1;
    }
    h->mask = cap - 1;
    pthread_mutex_init(&h->mu, NULL);
    return 0;
}

static void kvb__ht_fini(struct kvb__hash_table *h)
{
    pthread_mutex_destroy(&h->mu);
    kv__mem_free(h->ref);
    kv__mem_free(h->slot);
}

/* hash must be absent. */
static void kvb__ht_insert(struct kvb__hash_table *h, uint64_t hash, uint32_t id)
{
    uint64_t i = hash & h->mask;
    while (h->slot[i].id != 0)
        i = (i + 1) & h->mask;
    h->slot[i].hash = hash;
    h->slot[i].id = id;
}

/* Longest cached prefix of tokens[nb * KVB_BT]: hash the chain outside the
 * lock, then probe block by block until a miss, ref += 1 per hit. Returns
 * the hit count; ids[] and hashes[] get the hits. */
static uint32_t kvb__ht_match(struct kvb__hash_table *h, const int32_t *tokens, uint32_t nb,
                              uint32_t *ids, uint64_t *hashes)
{
    uint64_t parent = KV_BLOCK_HASH_ROOT;
    uint32_t found = 0;
    for (uint32_t b = 0; b < nb; b++)
        hashes[b] = parent = kvb__xxh3_block(parent, tokens + (size_t)b * KVB_BT, 0);
    pthread_mutex_lock(&h->mu);
    for (; found < nb; found++) {
        uint64_t i = hashes[found] & h->mask;
        while (h->slot[i].id != 0 && h->slot[i].hash != hashes[found])
            i = (i + 1) & h->mask;
        if (h->slot[i].id == 0)
            break;
        ids[found] = h->slot[i].id;
        h->ref[ids[found]]++;
    }
    pthread_mutex_unlock(&h->mu);
    return found;
}

/* ref -= 1 per id; -1 (nothing changed) if one is not held. */
static int kvb__ht_release(struct kvb__hash_table *h, const uint32_t *ids, uint32_t n)
{
    pthread_mutex_lock(&h->mu);
    for (uint32_t i = 0; i < n; i++)
        if (h->ref[ids[i]] == 0) {
            pthread_mutex_unlock(&h->mu);
            return -1;
        }
    for (uint32_t i = 0; i < n; i++)
        h->ref[ids[i]]--;
    pthread_mutex_unlock(&h->mu);
    return 0;
}

/* ---- alloc.prefix_lookup ---------------------------------------------------- */

/* One lookup's answer: hit count and ids, per sequence. */
struct kvb__answer {
    uint32_t n;
    uint32_t ids[KVB_SEQ_BLOCKS];
};

/* 0 when a[s] == b[s] for every sequence, else reports the first difference
 * as a mismatch and returns -1. */
static int kvb__answers_agree(const char *bench, const char *case_name, const char *base_name,
                              const struct kvb__answer *a, const struct kvb__answer *b)
{
    for (uint32_t s = 0; s < KVB_SEQS; s++) {
        if (a[s].n != b[s].n) {
            kvb_mismatch(bench, case_name, "seq %u: match_prefix found %u blocks, %s %u", s, a[s].n,
                         base_name, b[s].n);
            return -1;
        }
        for (uint32_t i = 0; i < a[s].n; i++)
            if (a[s].ids[i] != b[s].ids[i]) {
                kvb_mismatch(bench, case_name, "seq %u block %u: match_prefix id %u, %s id %u", s,
                             i, a[s].ids[i], base_name, b[s].ids[i]);
                return -1;
            }
    }
    return 0;
}

static void kvb__alloc_prefix_lookup(void)
{
    static const char bench[] = "alloc.prefix_lookup";
    char case_name[128];
    const int runs = kvb_runs() < KVB_MAX_RUNS ? kvb_runs() : KVB_MAX_RUNS;
    const uint32_t total = KVB_SEQS * KVB_SEQ_BLOCKS;
    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = KVB_POOL_BLOCKS};
    kv_block_pool *pool = NULL;
    struct kvb__hash_table ht;
    int ht_ok = 0;
    int32_t *tokens = NULL;                    /* [KVB_SEQS][KVB_SEQ_BLOCKS * KVB_BT] */
    struct kvb__answer *ca = NULL, *ba = NULL; /* [KVB_SEQS]: candidate, hash_table */
    uint32_t ids[KVB_SEQ_BLOCKS];
    uint64_t hashes[KVB_SEQ_BLOCKS], chashes[KVB_SEQ_BLOCKS];
    double cand[KVB_MAX_RUNS], base[KVB_MAX_RUNS], floor_s[KVB_MAX_RUNS];
    uint64_t sum = 0;
    kv_status st;

    snprintf(case_name, sizeof(case_name), "seqs%d/blocks%d/N%d/cached%u", KVB_SEQS, KVB_SEQ_BLOCKS,
             KVB_BT, total);
    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);

    tokens = kv__mem_alloc((size_t)total * KVB_BT * sizeof(int32_t));
    ca = kv__mem_calloc(KVB_SEQS, sizeof(*ca));
    ba = kv__mem_calloc(KVB_SEQS, sizeof(*ba));
    ht_ok = kvb__ht_init(&ht, total) == 0;
    if (!tokens || !ca || !ba || !ht_ok) {
        kvb_failed(bench, case_name, "out of memory for %u cached blocks", total);
        goto out;
    }
    st = kv_block_pool_create(&cfg, &pool);
    if (st != KV_OK) {
        kvb_failed(bench, case_name, "kv_block_pool_create(num_blocks %u): %s (%s)",
                   KVB_POOL_BLOCKS, kv_status_name(st), kv_last_error());
        goto out;
    }
    kvb_fill_random(tokens, (size_t)total * KVB_BT * sizeof(int32_t), 42);
    /* Every sequence's blocks committed as a chain, then released: all
     * cached (ref 0, on the free list), as after a finished request. The
     * baseline table gets the same (hash, id) entries. */
    for (uint32_t s = 0; s < KVB_SEQS; s++) {
        const int32_t *t = tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT;
        uint64_t parent = KV_BLOCK_HASH_ROOT, bparent = KV_BLOCK_HASH_ROOT;
        st = kv_block_pool_alloc(pool, KVB_SEQ_BLOCKS, ids);
        for (uint32_t b = 0; st == KV_OK && b < KVB_SEQ_BLOCKS; b++) {
            st =
                kv_block_pool_commit_full(pool, ids[b], parent, t + b * KVB_BT, KVB_BT, 0, &parent);
            bparent = kvb__xxh3_block(bparent, t + b * KVB_BT, 0);
            if (st == KV_OK && parent != bparent) {
                kvb_mismatch(bench, case_name,
                             "seq %u block %u: kv_block_hash 0x%016llx, hash_table's XXH3 "
                             "0x%016llx",
                             s, b, (unsigned long long)parent, (unsigned long long)bparent);
                goto out;
            }
            kvb__ht_insert(&ht, bparent, ids[b]);
        }
        if (st == KV_OK)
            st = kv_block_pool_release(pool, ids, KVB_SEQ_BLOCKS);
        if (st != KV_OK) {
            kvb_failed(bench, case_name, "committing seq %u: %s (%s)", s, kv_status_name(st),
                       kv_last_error());
            goto out;
        }
    }

    /* The answers, hashes included, once outside the timing. */
    for (uint32_t s = 0; s < KVB_SEQS; s++) {
        const int32_t *t = tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT;
        uint32_t n = 0;
        st = kv_block_pool_match_prefix(pool, t, (uint64_t)KVB_SEQ_BLOCKS * KVB_BT, KVB_BT, 0, ids,
                                        chashes, KVB_SEQ_BLOCKS, &n);
        if (st == KV_OK)
            st = kv_block_pool_release(pool, ids, n);
        if (st != KV_OK) {
            kvb_failed(bench, case_name, "seq %u: %s (%s)", s, kv_status_name(st), kv_last_error());
            goto out;
        }
        uint32_t bn = kvb__ht_match(&ht, t, KVB_SEQ_BLOCKS, ba[s].ids, hashes);
        ba[s].n = bn;
        if (kvb__ht_release(&ht, ba[s].ids, bn) != 0) {
            kvb_failed(bench, case_name, "seq %u: hash_table release refused", s);
            goto out;
        }
        if (n != KVB_SEQ_BLOCKS || bn != KVB_SEQ_BLOCKS) {
            kvb_mismatch(bench, case_name,
                         "seq %u: match_prefix found %u blocks, hash_table %u, all %u are cached",
                         s, n, bn, KVB_SEQ_BLOCKS);
            goto out;
        }
        for (uint32_t b = 0; b < n; b++)
            if (chashes[b] != hashes[b] || ids[b] != ba[s].ids[b]) {
                kvb_mismatch(bench, case_name,
                             "seq %u block %u: match_prefix id %u hash 0x%016llx, hash_table id "
                             "%u hash 0x%016llx",
                             s, b, ids[b], (unsigned long long)chashes[b], ba[s].ids[b],
                             (unsigned long long)hashes[b]);
                goto out;
            }
    }

    for (int r = -1; r < runs; r++) { /* r == -1: warm-up */
        int refused = 0;
        double t0 = kvb_now();
        for (uint32_t s = 0; s < KVB_SEQS && st == KV_OK; s++) {
            st = kv_block_pool_match_prefix(pool, tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT,
                                            (uint64_t)KVB_SEQ_BLOCKS * KVB_BT, KVB_BT, 0, ca[s].ids,
                                            NULL, KVB_SEQ_BLOCKS, &ca[s].n);
            if (st == KV_OK)
                st = kv_block_pool_release(pool, ca[s].ids, ca[s].n);
        }
        double t1 = kvb_now();
        for (uint32_t s = 0; s < KVB_SEQS; s++) {
            ba[s].n = kvb__ht_match(&ht, tokens + (size_t)s * KVB_SEQ_BLOCKS * KVB_BT,
                                    KVB_SEQ_BLOCKS, ba[s].ids, hashes);
            refused |= kvb__ht_release(&ht, ba[s].ids, ba[s].n);
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
        if (st != KV_OK) {
            kvb_failed(bench, case_name, "match_prefix/release: %s (%s)", kv_status_name(st),
                       kv_last_error());
            goto out;
        }
        if (refused) {
            kvb_failed(bench, case_name, "hash_table release refused");
            goto out;
        }
        if (kvb__answers_agree(bench, case_name, "hash_table", ca, ba) != 0)
            goto out;
        sum += ca[KVB_SEQS - 1].ids[0] + ba[KVB_SEQS - 1].ids[0];
        if (r >= 0) {
            cand[r] = t1 - t0;
            base[r] = t2 - t1;
            floor_s[r] = t3 - t2;
        }
    }
    kvb_sink(sum);
    kvb_emit_ops(bench, case_name, total, kvb_median(cand, runs), "hash_table",
                 kvb_median(base, runs), runs);
    kvb_emit_ops(bench, case_name, total, kvb_median(cand, runs), "hash_chain_floor",
                 kvb_median(floor_s, runs), runs);
out:
    kv_block_pool_destroy(pool);
    if (ht_ok)
        kvb__ht_fini(&ht);
    kv__mem_free(ba);
    kv__mem_free(ca);
    kv__mem_free(tokens);
}

KVB_REGISTER("alloc", kvb__alloc_pairs)
KVB_REGISTER("alloc", kvb__alloc_prefix_lookup)
