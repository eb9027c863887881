/*
 * test_block_pool.c - allocator/kv_block_pool: ids, ref counts, the LRU free
 * list, the null block, all-or-nothing batches, prefix hashing and lookup,
 * lazy eviction, events, stats, the kv_block_ops seam; a randomized
 * model-based test (10^6 operations against a plain reference model) and a
 * multi-threaded test (run it under SANITIZE=thread too).
 */
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
#include <xxhash.h>

#include <kvcache/kv.h>
#include "allocator_int.h"
#include "kv_block_pool.h"
#include "kvtest.h"

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define KVT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define KVT_SANITIZED 1
#endif
#endif
#ifndef KVT_SANITIZED
#define KVT_SANITIZED 0
#endif

/* ---- helpers ------------------------------------------------------------- */

#define MAX_EVENTS 4096

struct event {
    kv_block_event ev;
    uint64_t hash;
    uint32_t id;
};

/* Events recorded by the callback (it runs under the pool mutex). */
struct event_log {
    struct event ev[MAX_EVENTS];
    size_t n;
    uint64_t stored, removed; /* totals, never reset */
};

static void record_event(void *user, kv_block_event ev, uint64_t hash, uint32_t id)
{
    struct event_log *log = user;
    if (ev == KV_BLOCK_STORED)
        log->stored++;
    else
        log->removed++;
    if (log->n < MAX_EVENTS)
        log->ev[log->n++] = (struct event){ev, hash, id};
}

static kv_block_pool *make_pool(uint32_t num_blocks, struct event_log *log)
{
    struct kv_block_pool_config cfg = {
        .struct_size = sizeof(struct kv_block_pool_config),
        .num_blocks = num_blocks,
        .flags = KV_BLOCK_POOL_CHECK_FULL,
        .on_event = log ? record_event : NULL,
        .event_user = log,
    };
    kv_block_pool *p = NULL;
    assert_int_equal(kv_block_pool_create(&cfg, &p), KV_OK);
    assert_non_null(p);
    return p;
}

static struct kv_block_pool_stats stats_of(kv_block_pool *p)
{
    struct kv_block_pool_stats s;
    memset(&s, 0xff, sizeof(s));
    kv_block_pool_stats_get(p, &s);
    return s;
}

/* The whole observable state, for "nothing changed" checks. */
struct snapshot {
    struct kv_block_pool_stats st;
    uint32_t *refs;      /* [num_blocks] */
    uint64_t *hashes;    /* [num_blocks], ~0 = none */
    uint32_t *free_list; /* [n_free_list] */
    uint32_t n_free_list;
    uint32_t num_blocks;
};

static void snap_take(kv_block_pool *p, uint32_t num_blocks, struct snapshot *s)
{
    s->num_blocks = num_blocks;
    s->st = stats_of(p);
    s->refs = calloc(num_blocks, sizeof(*s->refs));
    s->hashes = calloc(num_blocks, sizeof(*s->hashes));
    s->free_list = calloc(num_blocks, sizeof(*s->free_list));
    assert_non_null(s->refs);
    assert_non_null(s->hashes);
    assert_non_null(s->free_list);
    for (uint32_t id = 0; id < num_blocks; id++) {
        s->refs[id] = kv_block_pool_ref_count(p, id);
        if (id == 0 || kv_block_pool_block_hash(p, id, &s->hashes[id]) != KV_OK)
            s->hashes[id] = ~0ull;
    }
    assert_int_equal(kv_block_pool_free_list(p, s->free_list, num_blocks, &s->n_free_list), KV_OK);
}

static void snap_free(struct snapshot *s)
{
    free(s->refs);
    free(s->hashes);
    free(s->free_list);
}

static void assert_same_state(kv_block_pool *p, const struct snapshot *before)
{
    struct snapshot now;
    snap_take(p, before->num_blocks, &now);
    assert_string_equal(kvt_block_pool_stats_diff(&now.st, &before->st), "");
    assert_memory_equal(now.refs, before->refs, before->num_blocks * sizeof(*now.refs));
    assert_memory_equal(now.hashes, before->hashes, before->num_blocks * sizeof(*now.hashes));
    assert_int_equal(now.n_free_list, before->n_free_list);
    assert_memory_equal(now.free_list, before->free_list,
                        before->n_free_list * sizeof(*now.free_list));
    snap_free(&now);
    assert_int_equal(kv__block_pool_check(p), KV_OK);
}

static void assert_free_list(kv_block_pool *p, const uint32_t *want, uint32_t n)
{
    uint32_t got[64], len = 0;
    assert_int_equal(kv_block_pool_free_list(p, got, 64, &len), KV_OK);
    assert_int_equal(len, n);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(got[i], want[i]);
}

/* ---- basic behaviour ----------------------------------------------------- */

static void test_block_pool_create_refuses_bad_config(void **state)
{
    (void)state;
    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = 1};
    kv_block_pool *p = NULL;
    assert_int_equal(kv_block_pool_create(&cfg, &p), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("num_blocks 1");
    cfg.num_blocks = 0;
    assert_int_equal(kv_block_pool_create(&cfg, &p), KV_ERR_INVALID_ARG);
    cfg.num_blocks = KV_BLOCK_POOL_MAX_BLOCKS + 1u;
    assert_int_equal(kv_block_pool_create(&cfg, &p), KV_ERR_INVALID_ARG);
    cfg.num_blocks = 8;
    cfg.flags = 0x100;
    assert_int_equal(kv_block_pool_create(&cfg, &p), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("0x100");
    assert_int_equal(kv_block_pool_create(NULL, &p), KV_ERR_NULL);
    assert_int_equal(kv_block_pool_create(&cfg, NULL), KV_ERR_NULL);
    assert_null(p);
    kv_block_pool_destroy(NULL);
}

static void test_block_pool_fresh_pool_state(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(9, NULL);
    struct kv_block_pool_stats s = stats_of(p);
    assert_int_equal(s.capacity, 8);
    assert_int_equal(s.free_blocks, 8);
    assert_int_equal(s.used_blocks, 0);
    assert_int_equal(s.cached_blocks, 0);
    assert_int_equal(s.used_high_water, 0);
    assert_int_equal(s.hits + s.misses + s.evictions + s.stored, 0);
    const uint32_t order[] = {1, 2, 3, 4, 5, 6, 7, 8};
    assert_free_list(p, order, 8);
    assert_int_equal(kv__block_pool_check(p), KV_OK);
    kv_block_pool_destroy(p);
}

static void test_block_pool_null_block_never_handed_out(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(5, NULL);
    uint32_t ids[5] = {0};
    uint32_t zero = 0;
    assert_int_equal(kv_block_pool_alloc(p, 4, ids), KV_OK);
    for (int i = 0; i < 4; i++)
        assert_int_not_equal(ids[i], KV_BLOCK_NULL);
    assert_int_equal(kv_block_pool_alloc(p, 1, ids + 4), KV_ERR_NO_BLOCKS);
    assert_int_equal(kv_block_pool_ref_count(p, 0), 0);
    assert_int_equal(kv_block_pool_retain(p, &zero, 1), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("null block");
    assert_int_equal(kv_block_pool_release(p, &zero, 1), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("null block");
    assert_int_equal(kv_block_pool_commit_hash(p, 0, 42, NULL), KV_ERR_INVALID_ARG);
    /* Cycle every block many times: 0 still never appears. */
    for (int round = 0; round < 100; round++) {
        assert_int_equal(kv_block_pool_release(p, ids, 4), KV_OK);
        assert_int_equal(kv_block_pool_alloc(p, 4, ids), KV_OK);
        for (int i = 0; i < 4; i++)
            assert_true(ids[i] >= 1 && ids[i] <= 4);
    }
    kv_block_pool_destroy(p);
}

static void test_block_pool_alloc_free_lru_order(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(5, NULL);
    uint32_t ids[4];
    assert_int_equal(kv_block_pool_alloc(p, 4, ids), KV_OK);
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(ids[i], i + 1); /* fresh pool: ids in order */
        assert_int_equal(kv_block_pool_ref_count(p, ids[i]), 1);
    }
    assert_free_list(p, NULL, 0);
    const uint32_t rel[] = {3, 1, 4, 2};
    for (int i = 0; i < 4; i++)
        assert_int_equal(kv_block_pool_release(p, &rel[i], 1), KV_OK);
    assert_free_list(p, rel, 4); /* released order, head first */
    uint32_t got[2];
    assert_int_equal(kv_block_pool_alloc(p, 2, got), KV_OK);
    assert_int_equal(got[0], 3); /* least recently released first */
    assert_int_equal(got[1], 1);
    const uint32_t rest[] = {4, 2};
    assert_free_list(p, rest, 2);
    /* Released again: back at the tail. */
    assert_int_equal(kv_block_pool_release(p, got, 2), KV_OK);
    const uint32_t after[] = {4, 2, 3, 1};
    assert_free_list(p, after, 4);
    /* A batch release goes to the tail in array order. */
    assert_int_equal(kv_block_pool_alloc(p, 0, NULL), KV_OK);
    kv_block_pool_destroy(p);
}

static void test_block_pool_batch_alloc_all_or_nothing(void **state)
{
    (void)state;
    struct event_log log = {0};
    kv_block_pool *p = make_pool(11, &log);
    uint32_t ids[16], extra[16];
    struct snapshot before;
    /* A mixed state: used, cached and free blocks. */
    assert_int_equal(kv_block_pool_alloc(p, 6, ids), KV_OK);
    assert_int_equal(kv_block_pool_commit_hash(p, ids[0], 100, NULL), KV_OK);
    assert_int_equal(kv_block_pool_commit_hash(p, ids[1], 101, NULL), KV_OK);
    assert_int_equal(kv_block_pool_release(p, ids, 2), KV_OK);     /* cached */
    assert_int_equal(kv_block_pool_release(p, ids + 2, 1), KV_OK); /* free */
    size_t events = log.n;

    snap_take(p, 11, &before);
    assert_int_equal(before.st.free_blocks + before.st.cached_blocks, 7);
    memset(extra, 0xee, sizeof(extra));
    assert_int_equal(kv_block_pool_alloc(p, 8, extra), KV_ERR_NO_BLOCKS);
    kvt_assert_msg_has("requested 8");
    kvt_assert_msg_has("7 available (5 free + 2 cached)");
    for (int i = 0; i < 16; i++)
        assert_int_equal(extra[i], 0xeeeeeeeeu); /* nothing written */
    assert_same_state(p, &before);
    assert_int_equal(log.n, events); /* no eviction happened */
    /* Exactly what is available works, evicting both cached blocks. */
    assert_int_equal(kv_block_pool_alloc(p, 7, extra), KV_OK);
    assert_int_equal(stats_of(p).evictions, 2);
    assert_int_equal(kv_block_pool_alloc(p, 1, extra), KV_ERR_NO_BLOCKS);
    snap_free(&before);
    kv_block_pool_destroy(p);
}

static void test_block_pool_double_free_is_an_error(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(9, NULL);
    uint32_t ids[3];
    struct snapshot before;
    assert_int_equal(kv_block_pool_alloc(p, 3, ids), KV_OK);
    assert_int_equal(kv_block_pool_release(p, &ids[1], 1), KV_OK);
    snap_take(p, 9, &before);
    assert_int_equal(kv_block_pool_release(p, &ids[1], 1), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("double free");
    char want[64];
    snprintf(want, sizeof(want), "ids[0] = %u", ids[1]);
    kvt_assert_msg_has(want);
    assert_same_state(p, &before);

    /* A batch with a double free in the middle changes nothing. */
    uint32_t batch[3] = {ids[0], ids[2], ids[0]};
    assert_int_equal(kv_block_pool_release(p, batch, 3), KV_ERR_BAD_STATE);
    snprintf(want, sizeof(want), "ids[2] = %u released 2 times", ids[0]);
    kvt_assert_msg_has(want);
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_ref_count(p, ids[0]), 1);
    assert_int_equal(kv_block_pool_ref_count(p, ids[2]), 1);
    /* The same id twice is fine when its ref count allows it. */
    assert_int_equal(kv_block_pool_retain(p, &ids[0], 1), KV_OK);
    assert_int_equal(kv_block_pool_release(p, batch, 3), KV_OK);
    assert_int_equal(kv_block_pool_ref_count(p, ids[0]), 0);
    assert_int_equal(kv_block_pool_ref_count(p, ids[2]), 0);
    snap_free(&before);
    kv_block_pool_destroy(p);
}

static void test_block_pool_foreign_id_is_an_error(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(9, NULL);
    uint32_t ids[2];
    struct snapshot before;
    assert_int_equal(kv_block_pool_alloc(p, 2, ids), KV_OK);
    snap_take(p, 9, &before);
    uint32_t bad[3] = {ids[0], 9, ids[1]};
    assert_int_equal(kv_block_pool_release(p, bad, 3), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("ids[1] = 9 is not a block of this pool (ids 1 .. 8)");
    assert_same_state(p, &before);
    bad[1] = 0xfffffff0u;
    assert_int_equal(kv_block_pool_retain(p, bad, 3), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("4294967280");
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_ref_count(p, 9), 0);
    assert_int_equal(kv_block_pool_ref_count(p, UINT32_MAX), 0);
    assert_int_equal(kv_block_pool_commit_hash(p, 12, 1, NULL), KV_ERR_INVALID_ARG);
    uint64_t h;
    assert_int_equal(kv_block_pool_block_hash(p, 12, &h), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_block_pool_release(p, NULL, 1), KV_ERR_NULL);
    assert_int_equal(kv_block_pool_alloc(p, 1, NULL), KV_ERR_NULL);
    assert_same_state(p, &before);
    snap_free(&before);
    kv_block_pool_destroy(p);
}

static void test_block_pool_retain_shares_blocks(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(9, NULL);
    uint32_t ids[2], fork[4];
    struct snapshot before;
    assert_int_equal(kv_block_pool_alloc(p, 2, ids), KV_OK);
    /* Fork twice: each block held by three. */
    fork[0] = ids[0], fork[1] = ids[1], fork[2] = ids[0], fork[3] = ids[1];
    assert_int_equal(kv_block_pool_retain(p, fork, 4), KV_OK);
    assert_int_equal(kv_block_pool_ref_count(p, ids[0]), 3);
    assert_int_equal(stats_of(p).used_blocks, 2);
    /* Retaining a free block is refused, nothing retained. */
    uint32_t bad[2] = {ids[0], 5};
    snap_take(p, 9, &before);
    assert_int_equal(kv_block_pool_retain(p, bad, 2), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("ids[1] = 5 is not held");
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_release(p, fork, 4), KV_OK);
    assert_int_equal(kv_block_pool_ref_count(p, ids[1]), 1);
    assert_int_equal(stats_of(p).free_blocks, 6);
    assert_int_equal(kv_block_pool_release(p, ids, 2), KV_OK);
    assert_int_equal(stats_of(p).free_blocks, 8);
    snap_free(&before);
    kv_block_pool_destroy(p);
}

/* ---- hashing --------------------------------------------------------------- */

/* The documented canonical serialization, hashed directly with XXH3. */
static uint64_t ref_hash(uint64_t parent, const int32_t *tokens, uint32_t n, uint64_t extra)
{
    size_t bytes = 20 + (size_t)n * 4;
    unsigned char *buf = malloc(bytes);
    assert_non_null(buf);
    for (int i = 0; i < 8; i++) {
        buf[i] = (unsigned char)(parent >> (8 * i));
        buf[8 + i] = (unsigned char)(extra >> (8 * i));
    }
    for (int i = 0; i < 4; i++)
        buf[16 + i] = (unsigned char)(n >> (8 * i));
    for (uint32_t t = 0; t < n; t++)
        for (int i = 0; i < 4; i++)
            buf[20 + t * 4 + i] = (unsigned char)((uint32_t)tokens[t] >> (8 * i));
    uint64_t h = XXH3_64bits(buf, bytes);
    free(buf);
    return h;
}

static void test_block_pool_hash_is_canonical_xxh3(void **state)
{
    (void)state;
    int32_t tok[1000];
    for (int i = 0; i < 1000; i++)
        tok[i] = (i * 7919) - 300000; /* negative ids too */
    const uint32_t sizes[] = {1, 16, 255, 256, 257, 512, 1000};
    for (size_t k = 0; k < sizeof(sizes) / sizeof(*sizes); k++)
        assert_int_equal(kv_block_hash(0x1234, tok, sizes[k], 77),
                         ref_hash(0x1234, tok, sizes[k], 77));
}

static void test_block_pool_hash_chaining(void **state)
{
    (void)state;
    int32_t a[16], b[16];
    for (int i = 0; i < 16; i++)
        a[i] = b[i] = i + 1;
    uint64_t h0 = kv_block_hash(KV_BLOCK_HASH_ROOT, a, 16, 0);
    uint64_t h1 = kv_block_hash(h0, b, 16, 0);
    /* Same tokens, different parent -> different hash. */
    assert_int_not_equal(h1, kv_block_hash(KV_BLOCK_HASH_ROOT, b, 16, 0));
    assert_int_not_equal(h1, kv_block_hash(h0 + 1, b, 16, 0));
    /* Extra key changes the hash. */
    assert_int_not_equal(h0, kv_block_hash(KV_BLOCK_HASH_ROOT, a, 16, 1));
    /* One token changes the hash; so does the token count. */
    b[15] = 99;
    assert_int_not_equal(h1, kv_block_hash(h0, b, 16, 0));
    assert_int_not_equal(h0, kv_block_hash(KV_BLOCK_HASH_ROOT, a, 15, 0));
    /* Deterministic. */
    assert_int_equal(h0, kv_block_hash(KV_BLOCK_HASH_ROOT, a, 16, 0));
}

/* ---- prefix cache ---------------------------------------------------------- */

#define BT 4 /* tokens per block in the prefix tests */

static void fill_tokens(int32_t *t, uint32_t n, int32_t seed)
{
    for (uint32_t i = 0; i < n; i++)
        t[i] = seed * 1000 + (int32_t)i;
}

/* Allocate n_blocks for tokens and commit the full ones as a chain. */
static void commit_chain(kv_block_pool *p, const int32_t *tokens, uint32_t n_blocks, uint64_t extra,
                         uint32_t *ids, uint64_t *hashes)
{
    uint64_t parent = KV_BLOCK_HASH_ROOT;
    assert_int_equal(kv_block_pool_alloc(p, n_blocks, ids), KV_OK);
    for (uint32_t i = 0; i < n_blocks; i++) {
        assert_int_equal(
            kv_block_pool_commit_full(p, ids[i], parent, tokens + i * BT, BT, extra, &hashes[i]),
            KV_OK);
        assert_int_equal(hashes[i], kv_block_hash(parent, tokens + i * BT, BT, extra));
        parent = hashes[i];
    }
}

static void test_block_pool_longest_prefix_lookup(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(33, NULL);
    int32_t tok[6 * BT];
    uint32_t ids[6], got[8];
    uint64_t hashes[6], got_h[8];
    uint32_t n = 99;
    fill_tokens(tok, 6 * BT, 1);
    commit_chain(p, tok, 3, 0, ids, hashes); /* first 3 blocks cached */

    /* 5 full blocks + 2 tokens asked: the first 3 are found. */
    assert_int_equal(kv_block_pool_match_prefix(p, tok, 5 * BT + 2, BT, 0, got, got_h, 8, &n),
                     KV_OK);
    assert_int_equal(n, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(got[i], ids[i]);
        assert_int_equal(got_h[i], hashes[i]);
        assert_int_equal(kv_block_pool_ref_count(p, ids[i]), 2); /* retained */
    }
    struct kv_block_pool_stats s = stats_of(p);
    assert_int_equal(s.hits, 3);
    assert_int_equal(s.misses, 2);
    assert_int_equal(kv_block_pool_release(p, got, n), KV_OK);

    /* max_blocks caps the answer (and the misses). */
    assert_int_equal(kv_block_pool_match_prefix(p, tok, 6 * BT, BT, 0, got, NULL, 2, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kv_block_pool_release(p, got, n), KV_OK);
    /* A different extra key (LoRA id) shares nothing. */
    assert_int_equal(kv_block_pool_match_prefix(p, tok, 6 * BT, BT, 5, got, NULL, 8, &n), KV_OK);
    assert_int_equal(n, 0);
    /* A token changed in block 1: only block 0 matches. */
    int32_t tok2[6 * BT];
    memcpy(tok2, tok, sizeof(tok));
    tok2[BT + 2] = -1;
    assert_int_equal(kv_block_pool_match_prefix(p, tok2, 6 * BT, BT, 0, got, NULL, 8, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(got[0], ids[0]);
    assert_int_equal(kv_block_pool_release(p, got, n), KV_OK);
    /* Fewer tokens than a block: nothing asked, nothing found. */
    assert_int_equal(kv_block_pool_match_prefix(p, tok, BT - 1, BT, 0, NULL, NULL, 8, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_block_pool_match_prefix(p, tok, 8, 0, 0, got, NULL, 8, &n),
                     KV_ERR_INVALID_ARG);
    /* Same answer through kv_block_pool_lookup with the hashes. */
    assert_int_equal(kv_block_pool_lookup(p, hashes, 3, got, &n), KV_OK);
    assert_int_equal(n, 3);
    assert_memory_equal(got, ids, 3 * sizeof(*ids));
    assert_int_equal(kv_block_pool_release(p, got, n), KV_OK);
    kv_block_pool_destroy(p);
}

static void test_block_pool_long_prefix_spans_chunks(void **state)
{
    (void)state;
    enum { NB = 100 }; /* more than one match chunk */
    kv_block_pool *p = make_pool(NB + 1, NULL);
    static int32_t tok[NB * BT];
    uint32_t ids[NB], got[NB], n;
    uint64_t hashes[NB], got_h[NB];
    fill_tokens(tok, NB * BT, 3);
    commit_chain(p, tok, NB, 9, ids, hashes);
    assert_int_equal(kv_block_pool_release(p, ids, NB), KV_OK);
    assert_int_equal(stats_of(p).cached_blocks, NB);
    assert_int_equal(kv_block_pool_match_prefix(p, tok, NB * BT, BT, 9, got, got_h, NB, &n), KV_OK);
    assert_int_equal(n, NB);
    assert_memory_equal(got, ids, sizeof(ids));
    assert_memory_equal(got_h, hashes, sizeof(hashes));
    assert_int_equal(stats_of(p).used_blocks, NB);
    assert_int_equal(stats_of(p).cached_blocks, 0);
    assert_int_equal(stats_of(p).misses, 0);
    assert_int_equal(kv_block_pool_release(p, got, n), KV_OK);
    /* A miss in the second chunk (block 40) and in the first (block 5): every
     * block asked for and not returned is a miss, beyond the chunk too. */
    static int32_t tok2[NB * BT];
    memcpy(tok2, tok, sizeof(tok2));
    tok2[40 * BT] = -7;
    assert_int_equal(kv_block_pool_match_prefix(p, tok2, NB * BT, BT, 9, got, NULL, NB, &n), KV_OK);
    assert_int_equal(n, 40);
    assert_int_equal(stats_of(p).misses, 60);
    assert_int_equal(kv_block_pool_release(p, got, n), KV_OK);
    tok2[5 * BT + 1] = -7;
    assert_int_equal(kv_block_pool_match_prefix(p, tok2, NB * BT, BT, 9, got, NULL, NB, &n), KV_OK);
    assert_int_equal(n, 5);
    assert_int_equal(stats_of(p).misses, 60 + 95);
    assert_int_equal(stats_of(p).hits, NB + 40 + 5);
    kv_block_pool_destroy(p);
}

static void test_block_pool_cached_hit_leaves_free_list(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(5, NULL);
    int32_t tok[2 * BT];
    uint32_t ids[2], got[2], n;
    uint64_t h[2];
    fill_tokens(tok, 2 * BT, 2);
    commit_chain(p, tok, 2, 0, ids, h);
    assert_int_equal(kv_block_pool_release(p, ids, 2), KV_OK);
    struct kv_block_pool_stats s = stats_of(p);
    assert_int_equal(s.cached_blocks, 2);
    assert_int_equal(s.free_blocks, 2);
    assert_int_equal(s.used_blocks, 0);
    const uint32_t fl[] = {3, 4, ids[0], ids[1]};
    assert_free_list(p, fl, 4);

    assert_int_equal(kv_block_pool_match_prefix(p, tok, 2 * BT, BT, 0, got, NULL, 2, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kv_block_pool_ref_count(p, ids[0]), 1);
    s = stats_of(p);
    assert_int_equal(s.cached_blocks, 0);
    assert_int_equal(s.used_blocks, 2);
    assert_int_equal(s.used_high_water, 2);
    assert_free_list(p, fl, 2);
    /* Hash survives the round trip. */
    uint64_t hh;
    assert_int_equal(kv_block_pool_block_hash(p, ids[1], &hh), KV_OK);
    assert_int_equal(hh, h[1]);
    assert_int_equal(kv_block_pool_block_hash(p, 3, &hh), KV_ERR_NOT_FOUND);
    kv_block_pool_destroy(p);
}

static void test_block_pool_lazy_eviction_oldest_first(void **state)
{
    (void)state;
    struct event_log log = {0};
    kv_block_pool *p = make_pool(5, &log);
    uint32_t ids[4], got[4], n;
    uint64_t h[4] = {0};
    for (uint32_t i = 0; i < 4; i++)
        h[i] = 1000 + i;
    assert_int_equal(kv_block_pool_alloc(p, 4, ids), KV_OK);
    for (int i = 0; i < 4; i++)
        assert_int_equal(kv_block_pool_commit_hash(p, ids[i], h[i], NULL), KV_OK);
    /* Release in the order 2, 4, 1, 3 (ids): all cached, nothing evicted yet. */
    const uint32_t order[] = {ids[1], ids[3], ids[0], ids[2]};
    for (int i = 0; i < 4; i++)
        assert_int_equal(kv_block_pool_release(p, &order[i], 1), KV_OK);
    assert_int_equal(stats_of(p).cached_blocks, 4);
    assert_int_equal(stats_of(p).evictions, 0);
    log.n = 0;

    assert_int_equal(kv_block_pool_alloc(p, 2, got), KV_OK);
    assert_int_equal(got[0], ids[1]); /* oldest released first */
    assert_int_equal(got[1], ids[3]);
    assert_int_equal(log.n, 2);
    assert_int_equal(log.ev[0].ev, KV_BLOCK_REMOVED);
    assert_int_equal(log.ev[0].id, ids[1]);
    assert_int_equal(log.ev[0].hash, h[1]);
    assert_int_equal(log.ev[1].id, ids[3]);
    assert_int_equal(log.ev[1].hash, h[3]);
    struct kv_block_pool_stats s = stats_of(p);
    assert_int_equal(s.evictions, 2);
    assert_int_equal(s.cached_blocks, 2);
    assert_int_equal(s.hashed_blocks, 2);
    /* Evicted hashes are gone; the others are still found. */
    assert_int_equal(kv_block_pool_lookup(p, &h[1], 1, got + 2, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_block_pool_lookup(p, &h[0], 1, got + 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(got[2], ids[0]);
    /* Reused blocks carry no hash: a fresh allocation is not cached. */
    uint64_t hh;
    assert_int_equal(kv_block_pool_block_hash(p, ids[1], &hh), KV_ERR_NOT_FOUND);
    kv_block_pool_destroy(p);
}

static void test_block_pool_events_fire_with_hash_and_id(void **state)
{
    (void)state;
    struct event_log log = {0};
    kv_block_pool *p = make_pool(4, &log);
    int32_t tok[BT];
    uint32_t ids[3];
    uint64_t h, h2;
    bool stored;
    fill_tokens(tok, BT, 4);
    assert_int_equal(kv_block_pool_alloc(p, 3, ids), KV_OK);
    assert_int_equal(kv_block_pool_commit_full(p, ids[0], KV_BLOCK_HASH_ROOT, tok, BT, 0, &h),
                     KV_OK);
    assert_int_equal(log.n, 1);
    assert_int_equal(log.ev[0].ev, KV_BLOCK_STORED);
    assert_int_equal(log.ev[0].hash, h);
    assert_int_equal(log.ev[0].id, ids[0]);
    /* Same content in another block: not registered, no event, hash returned. */
    assert_int_equal(kv_block_pool_commit_full(p, ids[1], KV_BLOCK_HASH_ROOT, tok, BT, 0, &h2),
                     KV_OK);
    assert_int_equal(h2, h);
    assert_int_equal(log.n, 1);
    assert_int_equal(kv_block_pool_block_hash(p, ids[1], &h2), KV_ERR_NOT_FOUND);
    assert_int_equal(kv_block_pool_commit_hash(p, ids[1], h, &stored), KV_OK);
    assert_false(stored);
    /* Recommitting the same hash is a no-op; a different one is refused. */
    assert_int_equal(kv_block_pool_commit_hash(p, ids[0], h, &stored), KV_OK);
    assert_true(stored);
    assert_int_equal(log.n, 1);
    assert_int_equal(kv_block_pool_commit_hash(p, ids[0], h + 1, NULL), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("already carries hash");
    /* Committing a block that is not held is refused. */
    assert_int_equal(kv_block_pool_release(p, &ids[2], 1), KV_OK);
    assert_int_equal(kv_block_pool_commit_hash(p, ids[2], 5, NULL), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("not held");
    assert_int_equal(kv_block_pool_commit_full(p, ids[1], 0, tok, 0, 0, &h2), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_block_pool_commit_full(p, ids[1], 0, NULL, BT, 0, &h2), KV_ERR_NULL);
    /* Evict it: REMOVED with the same (hash, id). */
    assert_int_equal(kv_block_pool_release(p, &ids[0], 1), KV_OK);
    uint32_t got[2];
    assert_int_equal(kv_block_pool_alloc(p, 2, got), KV_OK); /* ids[2] (free), then ids[0] */
    assert_int_equal(got[0], ids[2]);
    assert_int_equal(got[1], ids[0]);
    assert_int_equal(log.n, 2);
    assert_int_equal(log.ev[1].ev, KV_BLOCK_REMOVED);
    assert_int_equal(log.ev[1].hash, h);
    assert_int_equal(log.ev[1].id, ids[0]);
    /* Now ids[1] can register the content. */
    assert_int_equal(kv_block_pool_commit_hash(p, ids[1], h, &stored), KV_OK);
    assert_true(stored);
    assert_int_equal(log.n, 3);
    assert_int_equal(log.ev[2].id, ids[1]);
    struct kv_block_pool_stats s = stats_of(p);
    assert_int_equal(s.stored, 2);
    assert_int_equal(s.evictions, 1);
    kv_block_pool_destroy(p);
}

static void test_block_pool_stats_track_every_counter(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(21, NULL);
    int32_t tok[3 * BT];
    uint32_t ids[10], got[3], n;
    uint64_t h[3];
    fill_tokens(tok, 3 * BT, 5);
    assert_int_equal(kv_block_pool_alloc(p, 10, ids), KV_OK);
    assert_int_equal(kv_block_pool_release(p, ids, 10), KV_OK);
    commit_chain(p, tok, 3, 0, ids, h);
    assert_int_equal(kv_block_pool_release(p, ids + 2, 1), KV_OK);
    struct kv_block_pool_stats s = stats_of(p);
    assert_int_equal(s.used_high_water, 10);
    assert_int_equal(s.used_blocks, 2);
    assert_int_equal(s.cached_blocks, 1);
    assert_int_equal(s.free_blocks, 17);
    assert_int_equal(s.hashed_blocks, 3);
    assert_int_equal(s.stored, 3);
    assert_int_equal(s.free_blocks + s.used_blocks + s.cached_blocks, s.capacity);
    assert_int_equal(kv_block_pool_match_prefix(p, tok, 3 * BT, BT, 0, got, NULL, 3, &n), KV_OK);
    assert_int_equal(kv_block_pool_match_prefix(p, tok, 3 * BT, BT, 1, got + 3 - 3, NULL, 0, &n),
                     KV_OK); /* max_blocks 0: nothing asked */
    s = stats_of(p);
    assert_int_equal(s.hits, 3);
    assert_int_equal(s.misses, 0);
    assert_int_equal(s.used_blocks, 3);
    assert_int_equal(s.cached_blocks, 0);
    kv_block_pool_destroy(p);
}

static void test_block_pool_ops_seam(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(9, NULL);
    struct kv_block_ops ops;
    int32_t tok[2 * BT];
    uint32_t ids[2], got[2], n;
    uint64_t h0, h1, hh[2];
    assert_int_equal(kv_block_pool_ops(p, &ops), KV_OK);
    assert_ptr_equal(ops.ctx, p);
    assert_int_equal(kv_block_pool_ops(NULL, &ops), KV_ERR_NULL);
    fill_tokens(tok, 2 * BT, 6);
    assert_int_equal(ops.alloc(ops.ctx, 2, ids), KV_OK);
    assert_int_equal(ops.ref_count(ops.ctx, ids[0]), 1);
    assert_int_equal(ops.retain(ops.ctx, ids, 2), KV_OK);
    assert_int_equal(ops.ref_count(ops.ctx, ids[1]), 2);
    assert_int_equal(ops.commit_full(ops.ctx, ids[0], KV_BLOCK_HASH_ROOT, tok, BT, 0, &h0), KV_OK);
    assert_int_equal(ops.commit_full(ops.ctx, ids[1], h0, tok + BT, BT, 0, &h1), KV_OK);
    assert_int_equal(ops.release(ops.ctx, ids, 2), KV_OK);
    assert_int_equal(ops.release(ops.ctx, ids, 2), KV_OK);
    assert_int_equal(ops.release(ops.ctx, ids, 2), KV_ERR_BAD_STATE);
    assert_int_equal(ops.alloc(ops.ctx, 9, got), KV_ERR_NO_BLOCKS);
    assert_int_equal(ops.match_prefix(ops.ctx, tok, 2 * BT, BT, 0, got, hh, 2, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(got[0], ids[0]);
    assert_int_equal(hh[1], h1);
    assert_int_equal(ops.ref_count(ops.ctx, 0), 0);
    kv_block_pool_destroy(p);
}

/* kv_block_pool_destroy before the page tables made over it (through
 * kv_block_pool_ops) is counted: the tables keep allocating, committing and
 * releasing (events still delivered), and the last table's destroy frees
 * the pool (under ASan a pool freed at its destroy is a use after free
 * here, and one never freed a leak). */
static void test_block_pool_destroyed_before_its_tables(void **state)
{
    (void)state;
    struct event_log log = {0};
    kv_block_pool *p = make_pool(17, &log);
    struct kv_block_ops ops;
    assert_int_equal(kv_block_pool_ops(p, &ops), KV_OK);
    assert_non_null(ops.hold);
    assert_non_null(ops.drop);
    struct kv_page_table_config cfg;
    kv_page_table_config_init(&cfg);
    cfg.block_tokens = BT;
    cfg.max_seqs = 4;
    cfg.max_blocks_per_seq = 8;
    cfg.ops = ops;
    cfg.enable_prefix_caching = true;
    kv_page_table *pt[2] = {NULL, NULL};
    assert_int_equal(kv_page_table_create(&cfg, &pt[0]), KV_OK);
    assert_int_equal(kv_page_table_create(&cfg, &pt[1]), KV_OK);
    int32_t tok[6 * BT];
    fill_tokens(tok, 6 * BT, 11);
    uint32_t seq[2];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(kv_page_table_seq_create(pt[i], &seq[i]), KV_OK);
        assert_int_equal(kv_page_table_seq_append(pt[i], seq[i], tok, 3 * BT), KV_OK);
    }
    const uint64_t stored = log.stored;
    assert_true(stored >= 3);
    kv_block_pool_destroy(p); /* the caller's handle; both tables still hold it */
    assert_int_equal(kv_page_table_seq_append(pt[0], seq[0], tok + 3 * BT, 3 * BT), KV_OK);
    assert_true(log.stored > stored); /* events still delivered */
    const uint32_t *ids = NULL;
    uint32_t n = 0;
    assert_int_equal(kv_page_table_seq_blocks(pt[0], seq[0], &ids, &n), KV_OK);
    assert_int_equal(n, 6);
    for (uint32_t i = 0; i < n; i++)
        assert_true(ops.ref_count(ops.ctx, ids[i]) >= 1);
    kv_page_table_destroy(pt[0]); /* pt[1] still holds the pool */
    assert_int_equal(kv_page_table_seq_append(pt[1], seq[1], tok + 3 * BT, 2 * BT), KV_OK);
    assert_int_equal(kv_page_table_seq_blocks(pt[1], seq[1], &ids, &n), KV_OK);
    assert_int_equal(n, 5);
    assert_int_equal(ops.ref_count(ops.ctx, ids[4]), 1);
    kv_page_table_destroy(pt[1]); /* the last user: the pool goes with it */
}

static void test_block_pool_hash_table_survives_churn(void **state)
{
    (void)state;
    /* Many commits/evictions through a small table: backward-shift deletion
     * must keep every remaining hash reachable (checked after every op). */
    enum { NB = 64 };
    kv_block_pool *p = make_pool(NB + 1, NULL);
    uint64_t rng = 7;
    uint32_t id, n, got;
    for (int round = 0; round < 5000; round++) {
        assert_int_equal(kv_block_pool_alloc(p, 1, &id), KV_OK);
        /* Clustered hashes: the home slot collides often. */
        uint64_t h = (kvt_rand(&rng) % 512) << 55;
        assert_int_equal(kv_block_pool_commit_hash(p, id, h, NULL), KV_OK);
        assert_int_equal(kv_block_pool_release(p, &id, 1), KV_OK);
        assert_int_equal(kv_block_pool_lookup(p, &h, 1, &got, &n), KV_OK);
        assert_int_equal(n, 1);
        assert_int_equal(kv_block_pool_release(p, &got, 1), KV_OK);
    }
    assert_int_equal(kv__block_pool_check(p), KV_OK);
    kv_block_pool_destroy(p);
}

/* ---- randomized model-based test ------------------------------------------- */

/*
 * The reference model: plain arrays. The free list is a FIFO of (id, stamp)
 * entries with lazy deletion (an entry is live while the block is on the list
 * with that stamp); block content comes from a small universe of "documents"
 * whose block hashes are precomputed and deduplicated into keys, so the model
 * maps key <-> block with two arrays and never needs a hash table.
 */
#define M_BLOCKS 10001u /* ids 1 .. 10000 */
#define M_DOCS 128
#define M_DOC_BLOCKS 16
#define M_BT 4
#define M_KEYS (M_DOCS * M_DOC_BLOCKS)
#define M_HELD_MAX 200000

struct model {
    uint32_t ref[M_BLOCKS];
    int32_t key[M_BLOCKS];    /* key the block carries, -1 none */
    uint32_t stamp[M_BLOCKS]; /* stamp of its live FIFO entry */
    bool on_list[M_BLOCKS];
    uint32_t owner[M_KEYS]; /* block carrying key k, 0 none */
    uint64_t *q;            /* FIFO entries: id << 32 | stamp */
    size_t qhead, qtail, qcap;
    uint32_t next_stamp;
    uint32_t n_list, n_used, n_cached, high;
    uint64_t hits, misses, evictions, stored;
    uint32_t *held; /* multiset of held references */
    size_t n_held;
};

struct universe {
    int32_t tokens[M_DOCS][M_DOC_BLOCKS * M_BT];
    uint64_t extra[M_DOCS];
    uint64_t hash[M_DOCS][M_DOC_BLOCKS];
    int32_t key[M_DOCS][M_DOC_BLOCKS]; /* dedup: equal hash -> equal key */
    uint64_t key_hash[M_KEYS];
    uint32_t n_keys;
};

static void universe_build(struct universe *u, uint64_t *rng)
{
    /* Docs in families of 8 share a prefix of 0..7 blocks; every 16th doc uses
     * extra key 7 (a LoRA), so its blocks never match the others'. */
    u->n_keys = 0;
    for (int d = 0; d < M_DOCS; d++) {
        int fam = d / 8, shared = (d % 8);
        u->extra[d] = (d % 16 == 15) ? 7 : 0;
        for (int j = 0; j < M_DOC_BLOCKS; j++)
            for (int t = 0; t < M_BT; t++)
                u->tokens[d][j * M_BT + t] = j < shared
                                                 ? fam * 100000 + j * 10 + t
                                                 : (int32_t)(kvt_rand(rng) % 50000) + 1000000;
        uint64_t parent = KV_BLOCK_HASH_ROOT;
        for (int j = 0; j < M_DOC_BLOCKS; j++) {
            parent = ref_hash(parent, &u->tokens[d][j * M_BT], M_BT, u->extra[d]);
            u->hash[d][j] = parent;
            int32_t k = -1;
            for (uint32_t q = 0; q < u->n_keys; q++)
                if (u->key_hash[q] == parent)
                    k = (int32_t)q;
            if (k < 0) {
                k = (int32_t)u->n_keys++;
                u->key_hash[k] = parent;
            }
            u->key[d][j] = k;
        }
    }
}

static void m_push(struct model *m, uint32_t id)
{
    if (m->qtail == m->qcap) { /* compact: keep live entries */
        size_t w = 0;
        for (size_t r = m->qhead; r < m->qtail; r++) {
            uint32_t qid = (uint32_t)(m->q[r] >> 32), st = (uint32_t)m->q[r];
            if (m->on_list[qid] && m->stamp[qid] == st)
                m->q[w++] = m->q[r];
        }
        m->qhead = 0;
        m->qtail = w;
        assert_true(m->qtail < m->qcap);
    }
    m->stamp[id] = ++m->next_stamp;
    m->on_list[id] = true;
    m->q[m->qtail++] = (uint64_t)id << 32 | m->stamp[id];
    m->n_list++;
}

static uint32_t m_pop(struct model *m)
{
    for (;;) {
        assert_true(m->qhead < m->qtail);
        uint64_t e = m->q[m->qhead++];
        uint32_t id = (uint32_t)(e >> 32), st = (uint32_t)e;
        if (m->on_list[id] && m->stamp[id] == st) {
            m->on_list[id] = false;
            m->n_list--;
            return id;
        }
    }
}

static void m_unlink(struct model *m, uint32_t id)
{
    m->on_list[id] = false; /* its FIFO entry goes stale */
    m->n_list--;
}

static void m_release_one(struct model *m, uint32_t id)
{
    if (--m->ref[id] == 0) {
        m_push(m, id);
        m->n_used--;
        if (m->key[id] >= 0)
            m->n_cached++;
    }
}

static void m_held_add(struct model *m, uint32_t id)
{
    assert_true(m->n_held < M_HELD_MAX);
    m->held[m->n_held++] = id;
}

static uint32_t m_held_take(struct model *m, size_t i)
{
    uint32_t id = m->held[i];
    m->held[i] = m->held[--m->n_held];
    return id;
}

static void m_check_stats(kv_block_pool *p, const struct model *m)
{
    struct kv_block_pool_stats s = stats_of(p);
    assert_int_equal(s.capacity, M_BLOCKS - 1);
    assert_int_equal(s.used_blocks, m->n_used);
    assert_int_equal(s.cached_blocks, m->n_cached);
    assert_int_equal(s.free_blocks, m->n_list - m->n_cached);
    assert_int_equal(s.used_high_water, m->high);
    assert_int_equal(s.hits, m->hits);
    assert_int_equal(s.misses, m->misses);
    assert_int_equal(s.evictions, m->evictions);
    assert_int_equal(s.stored, m->stored);
}

static void m_check_full(kv_block_pool *p, const struct model *m, const struct universe *u,
                         uint32_t *scratch)
{
    uint32_t n = 0, k = 0;
    assert_int_equal(kv__block_pool_check(p), KV_OK);
    for (uint32_t id = 1; id < M_BLOCKS; id++) {
        uint64_t h;
        kv_status s = kv_block_pool_block_hash(p, id, &h);
        assert_int_equal(kv_block_pool_ref_count(p, id), m->ref[id]);
        if (m->key[id] >= 0) {
            assert_int_equal(s, KV_OK);
            assert_int_equal(h, u->key_hash[m->key[id]]);
        } else {
            assert_int_equal(s, KV_ERR_NOT_FOUND);
        }
    }
    /* The free list, in order, equals the live FIFO entries. */
    assert_int_equal(kv_block_pool_free_list(p, scratch, M_BLOCKS, &n), KV_OK);
    assert_int_equal(n, m->n_list);
    for (size_t r = m->qhead; r < m->qtail; r++) {
        uint32_t id = (uint32_t)(m->q[r] >> 32), st = (uint32_t)m->q[r];
        if (m->on_list[id] && m->stamp[id] == st) {
            assert_true(k < n);
            assert_int_equal(scratch[k], id);
            k++;
        }
    }
    assert_int_equal(k, n);
}

static void expect_events(struct event_log *log, const struct event *want, size_t n)
{
    assert_int_equal(log->n, n);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(log->ev[i].ev, want[i].ev);
        assert_int_equal(log->ev[i].hash, want[i].hash);
        assert_int_equal(log->ev[i].id, want[i].id);
    }
    log->n = 0;
}

/* Audit (2026-12-05): KV_DEBUG_CHECKS was on for any value starting with
 * '1' ("10") and silently off for "true": now the named values only, any
 * other refused by name. */
static void test_block_pool_debug_env_values(void **state)
{
    (void)state;
    const char *was = getenv("KV_DEBUG_CHECKS");
    char *saved = was ? strdup(was) : NULL;
    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = 8};
    static const char *const ok[] = {"1", "TRUE", "yes", "On", "0", "false", "NO", "off", ""};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        kv_block_pool *p = NULL;
        assert_int_equal(setenv("KV_DEBUG_CHECKS", ok[i], 1), 0);
        assert_int_equal(kv_block_pool_create(&cfg, &p), KV_OK);
        kv_block_pool_destroy(p);
    }
    static const char *const bad[] = {"10", "2", "enable", " 1", "1 "};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kv_block_pool *p = NULL;
        assert_int_equal(setenv("KV_DEBUG_CHECKS", bad[i], 1), 0);
        assert_int_equal(kv_block_pool_create(&cfg, &p), KV_ERR_INVALID_ARG);
        assert_null(p);
        char want[64];
        snprintf(want, sizeof(want), "KV_DEBUG_CHECKS='%s'", bad[i]);
        kvt_assert_msg_has(want);
    }
    if (saved)
        assert_int_equal(setenv("KV_DEBUG_CHECKS", saved, 1), 0);
    else
        assert_int_equal(unsetenv("KV_DEBUG_CHECKS"), 0);
    free(saved);
}

static void test_block_pool_model_random_ops(void **state)
{
    (void)state;
    /* DEBUG=1 builds walk every record and table slot after each op (O(10^4)
     * per op): 30,000 ops there keep CI's debug run short. */
#if defined(KV_DEBUG_CHECKS)
    const long n_ops = 30000;
#else
    const long n_ops = KVT_SANITIZED ? 100000 : 1000000;
#endif
    static struct model m;
    static struct universe u;
    static struct event_log log;
    static struct event want[MAX_EVENTS];
    uint64_t rng = 0x5eedULL;
    uint32_t *ids = calloc(M_BLOCKS + 8, sizeof(*ids));
    uint32_t *scratch = calloc(M_BLOCKS, sizeof(*scratch));
    assert_non_null(ids);
    assert_non_null(scratch);
    memset(&m, 0, sizeof(m));
    memset(&log, 0, sizeof(log));
    universe_build(&u, &rng);
    printf("# model: %u distinct block keys over %d docs\n", u.n_keys, M_DOCS);
    m.qcap = 8 * (size_t)M_BLOCKS;
    m.q = calloc(m.qcap, sizeof(*m.q));
    m.held = calloc(M_HELD_MAX, sizeof(*m.held));
    assert_non_null(m.q);
    assert_non_null(m.held);
    for (uint32_t id = 0; id < M_BLOCKS; id++)
        m.key[id] = -1;
    for (uint32_t id = 1; id < M_BLOCKS; id++)
        m_push(&m, id);

    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = M_BLOCKS,
                                       .on_event = record_event,
                                       .event_user = &log};
    kv_block_pool *p = NULL;
    assert_int_equal(kv_block_pool_create(&cfg, &p), KV_OK);
    long counts[8] = {0};

    for (long op = 0; op < n_ops; op++) {
        uint64_t r = kvt_rand(&rng) % 1000;
        size_t nw = 0;
        /* Keep the number of held references near 6000: below, alloc more. */
        bool want_more = m.n_held < 6000;
        if (r < (want_more ? 300u : 180u)) {
            /* ---- alloc batch (sometimes too big) ---- */
            uint32_t n = (uint32_t)kvt_range(&rng, 0, 12);
            if (r % 97 == 0)
                n = m.n_list + (uint32_t)kvt_range(&rng, 1, 3);
            else if (r % 89 == 0 && m.n_held < 20000)
                n = m.n_list < 3000 ? m.n_list : 3000;
            kv_status s = kv_block_pool_alloc(p, n, ids);
            if (n > m.n_list) {
                assert_int_equal(s, KV_ERR_NO_BLOCKS);
                counts[7]++;
            } else {
                assert_int_equal(s, KV_OK);
                for (uint32_t i = 0; i < n; i++) {
                    uint32_t id = m_pop(&m);
                    assert_int_equal(ids[i], id);
                    if (m.key[id] >= 0) {
                        want[nw++] = (struct event){KV_BLOCK_REMOVED, u.key_hash[m.key[id]], id};
                        m.owner[m.key[id]] = 0;
                        m.key[id] = -1;
                        m.n_cached--;
                        m.evictions++;
                    }
                    m.ref[id] = 1;
                    m.n_used++;
                    m_held_add(&m, id);
                    assert_int_equal(kv_block_pool_ref_count(p, id), 1);
                }
                if (m.n_used > m.high)
                    m.high = m.n_used;
                counts[0]++;
            }
            if (nw > MAX_EVENTS)
                fail_msg("too many events in one op");
            expect_events(&log, want, nw < MAX_EVENTS ? nw : MAX_EVENTS);
        } else if (r < 560) {
            /* ---- release a batch of held references (sometimes a bad one) ---- */
            uint32_t n = (uint32_t)kvt_range(&rng, 0, want_more ? 6 : 16);
            if (n > m.n_held)
                n = (uint32_t)m.n_held;
            if (r % 53 == 0 && n > 0) {
                /* Inject a double free or a foreign id at a random position:
                 * the call fails and nothing changes. */
                uint32_t bad;
                kv_status want_s;
                if (r % 2 == 0 && m.n_list > 0) {
                    bad = (uint32_t)(m.q[m.qtail - 1] >> 32); /* recent list entry */
                    if (!m.on_list[bad])
                        bad = M_BLOCKS + 5;
                } else {
                    bad = (r % 3 == 0) ? 0 : M_BLOCKS + (uint32_t)kvt_range(&rng, 0, 100);
                }
                want_s = m.on_list[bad < M_BLOCKS ? bad : 0] && bad != 0 ? KV_ERR_BAD_STATE
                                                                         : KV_ERR_INVALID_ARG;
                /* Distinct held references (a valid batch), then one bad id. */
                uint32_t pos = (uint32_t)kvt_range(&rng, 0, n - 1);
                size_t start = (size_t)kvt_range(&rng, 0, (int64_t)(m.n_held - n));
                for (uint32_t i = 0; i < n; i++)
                    ids[i] = m.held[start + i];
                ids[pos] = bad;
                assert_int_equal(kv_block_pool_release(p, ids, n), want_s);
                for (uint32_t i = 0; i < n; i++)
                    if (ids[i] < M_BLOCKS)
                        assert_int_equal(kv_block_pool_ref_count(p, ids[i]), m.ref[ids[i]]);
                counts[6]++;
            } else {
                for (uint32_t i = 0; i < n; i++)
                    ids[i] = m_held_take(&m, (size_t)kvt_range(&rng, 0, (int64_t)m.n_held - 1));
                assert_int_equal(kv_block_pool_release(p, ids, n), KV_OK);
                for (uint32_t i = 0; i < n; i++)
                    m_release_one(&m, ids[i]);
                for (uint32_t i = 0; i < n; i++)
                    assert_int_equal(kv_block_pool_ref_count(p, ids[i]), m.ref[ids[i]]);
                counts[1]++;
            }
            expect_events(&log, want, 0);
        } else if (r < 640) {
            /* ---- retain (fork) held references; sometimes a non-held id ---- */
            uint32_t n = (uint32_t)kvt_range(&rng, 1, 6);
            if (m.n_held == 0)
                continue;
            for (uint32_t i = 0; i < n; i++)
                ids[i] = m.held[(size_t)kvt_range(&rng, 0, (int64_t)m.n_held - 1)];
            if (r % 41 == 0 && m.n_list > 0) {
                uint32_t bad = (uint32_t)(m.q[m.qtail - 1] >> 32);
                ids[kvt_range(&rng, 0, n - 1)] = m.on_list[bad] ? bad : 0;
                kv_status s = kv_block_pool_retain(p, ids, n);
                assert_true(s == KV_ERR_BAD_STATE || s == KV_ERR_INVALID_ARG);
                counts[6]++;
            } else {
                assert_int_equal(kv_block_pool_retain(p, ids, n), KV_OK);
                for (uint32_t i = 0; i < n; i++) {
                    m.ref[ids[i]]++;
                    m_held_add(&m, ids[i]);
                }
                counts[2]++;
            }
            for (uint32_t i = 0; i < n; i++)
                if (ids[i] && ids[i] < M_BLOCKS)
                    assert_int_equal(kv_block_pool_ref_count(p, ids[i]), m.ref[ids[i]]);
            expect_events(&log, want, 0);
        } else if (r < 780) {
            /* ---- commit_full: a held block takes a (doc, block) content ---- */
            if (m.n_held == 0)
                continue;
            int d = (int)kvt_range(&rng, 0, M_DOCS - 1), j = (int)kvt_range(&rng, 0, 5);
            uint32_t id = m.held[(size_t)kvt_range(&rng, 0, (int64_t)m.n_held - 1)];
            if (r % 61 == 0 && m.n_list > 0) {
                uint32_t fid = (uint32_t)(m.q[m.qtail - 1] >> 32);
                if (m.on_list[fid])
                    id = fid; /* not held: refused */
            }
            int32_t k = u.key[d][j];
            uint64_t parent = j ? u.hash[d][j - 1] : KV_BLOCK_HASH_ROOT, hout = 0;
            kv_status s = kv_block_pool_commit_full(p, id, parent, &u.tokens[d][j * M_BT], M_BT,
                                                    u.extra[d], &hout);
            if (m.ref[id] == 0 || (m.key[id] >= 0 && m.key[id] != k)) {
                assert_int_equal(s, KV_ERR_BAD_STATE);
            } else {
                assert_int_equal(s, KV_OK);
                assert_int_equal(hout, u.key_hash[k]);
                if (m.key[id] < 0 && m.owner[k] == 0) {
                    m.owner[k] = id;
                    m.key[id] = k;
                    m.stored++;
                    want[nw++] = (struct event){KV_BLOCK_STORED, u.key_hash[k], id};
                }
            }
            expect_events(&log, want, nw);
            counts[3]++;
        } else if (r < 940) {
            /* ---- prefix lookup of a doc (the prefill path) ---- */
            int d = (int)kvt_range(&rng, 0, M_DOCS - 1);
            uint32_t nb = (uint32_t)kvt_range(&rng, 0, M_DOC_BLOCKS);
            uint64_t nt = (uint64_t)nb * M_BT + (uint64_t)kvt_range(&rng, 0, M_BT - 1);
            uint32_t maxb = (uint32_t)kvt_range(&rng, 0, M_DOC_BLOCKS + 2), nf = 99;
            uint64_t hs[M_DOC_BLOCKS + 4];
            if (nt > M_DOC_BLOCKS * M_BT)
                nt = M_DOC_BLOCKS * M_BT;
            uint32_t want_n = (uint32_t)(nt / M_BT) < maxb ? (uint32_t)(nt / M_BT) : maxb;
            assert_int_equal(kv_block_pool_match_prefix(p, u.tokens[d], nt, M_BT, u.extra[d], ids,
                                                        hs, maxb, &nf),
                             KV_OK);
            uint32_t f = 0;
            while (f < want_n && m.owner[u.key[d][f]] != 0)
                f++;
            assert_int_equal(nf, f);
            for (uint32_t i = 0; i < f; i++) {
                uint32_t id = m.owner[u.key[d][i]];
                assert_int_equal(ids[i], id);
                assert_int_equal(hs[i], u.hash[d][i]);
                if (m.ref[id]++ == 0) {
                    m_unlink(&m, id);
                    m.n_cached--;
                    m.n_used++;
                }
                m_held_add(&m, id);
                assert_int_equal(kv_block_pool_ref_count(p, id), m.ref[id]);
            }
            if (m.n_used > m.high)
                m.high = m.n_used;
            m.hits += f;
            m.misses += want_n - f;
            expect_events(&log, want, 0);
            counts[4]++;
        } else {
            /* ---- a whole sequence: lookup, allocate the rest, commit the
             * chain, release it last-to-first (cached for later) ---- */
            int d = (int)kvt_range(&rng, 0, M_DOCS - 1);
            uint32_t nb = (uint32_t)kvt_range(&rng, 1, M_DOC_BLOCKS), nf = 0;
            uint32_t seq[M_DOC_BLOCKS];
            assert_int_equal(kv_block_pool_match_prefix(p, u.tokens[d], (uint64_t)nb * M_BT, M_BT,
                                                        u.extra[d], seq, NULL, nb, &nf),
                             KV_OK);
            uint32_t f = 0;
            while (f < nb && m.owner[u.key[d][f]] != 0)
                f++;
            assert_int_equal(nf, f);
            for (uint32_t i = 0; i < f; i++) {
                uint32_t id = seq[i];
                assert_int_equal(id, m.owner[u.key[d][i]]);
                if (m.ref[id]++ == 0) {
                    m_unlink(&m, id);
                    m.n_cached--;
                    m.n_used++;
                }
            }
            if (m.n_used > m.high)
                m.high = m.n_used;
            m.hits += f;
            m.misses += nb - f;
            kv_status s = kv_block_pool_alloc(p, nb - f, seq + f);
            if (nb - f > m.n_list) {
                assert_int_equal(s, KV_ERR_NO_BLOCKS);
            } else {
                assert_int_equal(s, KV_OK);
                for (uint32_t i = f; i < nb; i++) {
                    uint32_t id = m_pop(&m);
                    assert_int_equal(seq[i], id);
                    if (m.key[id] >= 0) {
                        want[nw++] = (struct event){KV_BLOCK_REMOVED, u.key_hash[m.key[id]], id};
                        m.owner[m.key[id]] = 0;
                        m.key[id] = -1;
                        m.n_cached--;
                        m.evictions++;
                    }
                    m.ref[id] = 1;
                    m.n_used++;
                }
                if (m.n_used > m.high)
                    m.high = m.n_used;
                for (uint32_t i = f; i < nb; i++) {
                    uint64_t parent = i ? u.hash[d][i - 1] : KV_BLOCK_HASH_ROOT, hout;
                    int32_t k = u.key[d][i];
                    assert_int_equal(kv_block_pool_commit_full(p, seq[i], parent,
                                                               &u.tokens[d][i * M_BT], M_BT,
                                                               u.extra[d], &hout),
                                     KV_OK);
                    assert_int_equal(hout, u.hash[d][i]);
                    if (m.owner[k] == 0) {
                        m.owner[k] = seq[i];
                        m.key[seq[i]] = k;
                        m.stored++;
                        want[nw++] = (struct event){KV_BLOCK_STORED, u.key_hash[k], seq[i]};
                    }
                }
                f = nb;
            }
            /* Release what we hold, last block first. */
            for (uint32_t i = 0; i < f / 2; i++) {
                uint32_t t = seq[i];
                seq[i] = seq[f - 1 - i];
                seq[f - 1 - i] = t;
            }
            assert_int_equal(kv_block_pool_release(p, seq, f), KV_OK);
            for (uint32_t i = 0; i < f; i++)
                m_release_one(&m, seq[i]);
            for (uint32_t i = 0; i < f; i++)
                assert_int_equal(kv_block_pool_ref_count(p, seq[i]), m.ref[seq[i]]);
            expect_events(&log, want, nw);
            counts[5]++;
        }
        /* Statuses and ref counts were checked above; stats every op; a
         * random block every op; everything every 1000 ops. */
        m_check_stats(p, &m);
        uint32_t spot = (uint32_t)kvt_range(&rng, 0, M_BLOCKS + 3);
        assert_int_equal(kv_block_pool_ref_count(p, spot), spot < M_BLOCKS ? m.ref[spot] : 0);
        if (op % 1000 == 999)
            m_check_full(p, &m, &u, scratch);
    }
    m_check_full(p, &m, &u, scratch);
    printf("# model: %ld ops: alloc %ld, release %ld, retain %ld, commit %ld, lookup %ld, "
           "sequence %ld, rejected bad ids %ld, NO_BLOCKS %ld\n",
           n_ops, counts[0], counts[1], counts[2], counts[3], counts[4], counts[5], counts[6],
           counts[7]);
    printf("# model: hits %llu misses %llu evictions %llu stored %llu high water %u\n",
           (unsigned long long)m.hits, (unsigned long long)m.misses,
           (unsigned long long)m.evictions, (unsigned long long)m.stored, m.high);
    /* The run exercised what it claims to. */
    assert_true(m.evictions > 1000);
    assert_true(m.hits > 1000);
    assert_true(counts[6] > 100);
    assert_true(counts[7] > 10);
    /* Drain: every reference released -> nothing used. */
    while (m.n_held > 0) {
        uint32_t id = m_held_take(&m, m.n_held - 1);
        assert_int_equal(kv_block_pool_release(p, &id, 1), KV_OK);
        m_release_one(&m, id);
    }
    log.n = 0;
    m_check_stats(p, &m);
    assert_int_equal(m.n_used, 0);
    m_check_full(p, &m, &u, scratch);
    kv_block_pool_destroy(p);
    free(m.q);
    free(m.held);
    free(ids);
    free(scratch);
}

/* ---- multi-threaded test --------------------------------------------------- */

#define T_THREADS 4
#define T_DOCS 16
#define T_DOC_BLOCKS 8

struct thread_arg {
    kv_block_pool *pool;
    int index;
    long iters;
    int32_t (*tokens)[T_DOC_BLOCKS * M_BT];
    uint64_t hits, asked, stored, allocs, no_blocks;
    int failed;
};

static void *thread_main(void *argp)
{
    struct thread_arg *a = argp;
    uint64_t rng = 0xabc + (uint64_t)a->index;
    uint32_t held[64];
    for (long it = 0; it < a->iters && !a->failed; it++) {
        uint32_t n_held = 0, nf = 0;
        int d = (int)kvt_range(&rng, 0, T_DOCS - 1);
        uint32_t nb = (uint32_t)kvt_range(&rng, 1, T_DOC_BLOCKS);
        /* Prefix lookup on shared docs: hits on other threads' blocks. */
        if (kv_block_pool_match_prefix(a->pool, a->tokens[d], (uint64_t)nb * M_BT, M_BT, 0, held,
                                       NULL, nb, &nf) != KV_OK) {
            a->failed = 1;
            break;
        }
        a->hits += nf;
        a->asked += nb;
        n_held = nf;
        /* Allocate the rest and commit it as a chain. */
        if (nb > nf) {
            kv_status s = kv_block_pool_alloc(a->pool, nb - nf, held + nf);
            if (s == KV_ERR_NO_BLOCKS) {
                a->no_blocks++;
            } else if (s != KV_OK) {
                a->failed = 2;
                break;
            } else {
                a->allocs += nb - nf;
                uint64_t parent = KV_BLOCK_HASH_ROOT;
                for (uint32_t i = 0; i < nb; i++) {
                    uint64_t h = kv_block_hash(parent, &a->tokens[d][i * M_BT], M_BT, 0);
                    if (i >= nf) {
                        bool stored = false;
                        if (kv_block_pool_commit_hash(a->pool, held[i], h, &stored) != KV_OK) {
                            a->failed = 3;
                            break;
                        }
                        a->stored += stored;
                    }
                    parent = h;
                }
                n_held = nb;
            }
        }
        /* Fork: retain and release the extra references. */
        if (n_held > 0 && (it & 3) == 0) {
            if (kv_block_pool_retain(a->pool, held, n_held) != KV_OK ||
                kv_block_pool_ref_count(a->pool, held[0]) < 2 ||
                kv_block_pool_release(a->pool, held, n_held) != KV_OK) {
                a->failed = 4;
                break;
            }
        }
        /* Some private churn without hashes. */
        uint32_t tmp[4];
        if (kv_block_pool_alloc(a->pool, 4, tmp) == KV_OK) {
            a->allocs += 4;
            if (kv_block_pool_release(a->pool, tmp, 4) != KV_OK) {
                a->failed = 5;
                break;
            }
        }
        for (uint32_t i = 0; i < n_held / 2; i++) {
            uint32_t t = held[i];
            held[i] = held[n_held - 1 - i];
            held[n_held - 1 - i] = t;
        }
        if (kv_block_pool_release(a->pool, held, n_held) != KV_OK) {
            a->failed = 6;
            break;
        }
        if ((it & 1023) == 0) {
            struct kv_block_pool_stats s;
            kv_block_pool_stats_get(a->pool, &s);
            if (s.free_blocks + s.used_blocks + s.cached_blocks != s.capacity) {
                a->failed = 7;
                break;
            }
        }
    }
    return NULL;
}

static void test_block_pool_threads_share_one_pool(void **state)
{
    (void)state;
    static int32_t tokens[T_DOCS][T_DOC_BLOCKS * M_BT];
    static struct event_log log;
    struct thread_arg args[T_THREADS];
    pthread_t th[T_THREADS];
    memset(&log, 0, sizeof(log));
    for (int d = 0; d < T_DOCS; d++)
        for (int t = 0; t < T_DOC_BLOCKS * M_BT; t++)
            tokens[d][t] = (t < 2 * M_BT) ? t : d * 1000 + t; /* docs share 2 blocks */
    /* 30 usable blocks: 16 docs * 8 blocks of content keep evicting each
     * other; 4 threads holding up to 8 + 4 each can starve, and a
     * KV_ERR_NO_BLOCKS is then an accepted (counted) answer. */
    struct kv_block_pool_config cfg = {.struct_size = sizeof(struct kv_block_pool_config),
                                       .num_blocks = 31,
                                       .on_event = record_event,
                                       .event_user = &log};
    kv_block_pool *p = NULL;
    assert_int_equal(kv_block_pool_create(&cfg, &p), KV_OK);
    for (int i = 0; i < T_THREADS; i++) {
        args[i] = (struct thread_arg){
            .pool = p, .index = i, .iters = KVT_SANITIZED ? 10000 : 100000, .tokens = tokens};
        assert_int_equal(pthread_create(&th[i], NULL, thread_main, &args[i]), 0);
    }
    uint64_t hits = 0, asked = 0, stored = 0, allocs = 0, starved = 0;
    for (int i = 0; i < T_THREADS; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(args[i].failed, 0);
        hits += args[i].hits;
        asked += args[i].asked;
        stored += args[i].stored;
        allocs += args[i].allocs;
        starved += args[i].no_blocks;
    }
    struct kv_block_pool_stats s = stats_of(p);
    printf("# threads: %d x %ld iters: hits %llu of %llu, stored %llu, evictions %llu, allocs "
           "%llu, NO_BLOCKS %llu\n",
           T_THREADS, args[0].iters, (unsigned long long)hits, (unsigned long long)asked,
           (unsigned long long)stored, (unsigned long long)s.evictions, (unsigned long long)allocs,
           (unsigned long long)starved);
    assert_int_equal(kv__block_pool_check(p), KV_OK);
    assert_int_equal(s.used_blocks, 0);
    assert_int_equal(s.free_blocks + s.cached_blocks, s.capacity);
    assert_int_equal(s.hits, hits);
    assert_int_equal(s.hits + s.misses, asked);
    assert_int_equal(s.stored, stored);
    assert_int_equal(log.stored, stored);
    assert_int_equal(log.removed, s.evictions);
    assert_int_equal(s.stored - s.evictions, s.hashed_blocks);
    assert_int_equal(s.hashed_blocks, s.cached_blocks); /* nothing held any more */
    assert_true(hits > 0);
    assert_true(s.evictions > 0);
    kv_block_pool_destroy(p);
}

/* Arrays misaligned for their elements (uint32 ids, uint64 hashes): read or
 * written as words, undefined behaviour (UBSan aborts). Each entry refuses
 * them by name with the pool as it was and its out-params untouched; an
 * empty list is never read, so it may be anything. */
static void test_block_pool_misaligned_arrays(void **state)
{
    (void)state;
    kv_block_pool *p = make_pool(9, NULL);
    uint32_t held[2];
    assert_int_equal(kv_block_pool_alloc(p, 2, held), KV_OK);
    assert_int_equal(kv_block_pool_commit_hash(p, held[0], 0x11, NULL), KV_OK);
    const int32_t toks[4] = {1, 2, 3, 4};
    uint64_t h = 0;
    assert_int_equal(kv_block_pool_commit_full(p, held[1], KV_BLOCK_HASH_ROOT, toks, 4, 0, &h),
                     KV_OK);
    const uint64_t hashes[2] = {0x11, 0x22};
    _Alignas(uint64_t) char ibuf[1 + 2 * sizeof(uint32_t)], hbuf[1 + sizeof(hashes)];
    memcpy(ibuf + 1, held, sizeof(held));
    memcpy(hbuf + 1, hashes, sizeof(hashes));
    uint32_t *im = (uint32_t *)(void *)(ibuf + 1);
    const uint64_t *hm = (const uint64_t *)(void *)(hbuf + 1);
    _Alignas(uint64_t) char obuf[1 + 2 * sizeof(uint64_t)];
    uint64_t *om = (uint64_t *)(void *)(obuf + 1);
    struct snapshot before;
    snap_take(p, 9, &before);
    uint32_t n = 77, ids[2] = {0, 0};
    uint64_t hs[2] = {0, 0};

    assert_int_equal(kv_block_pool_alloc(p, 2, im), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_block_pool_alloc: ids=");
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_retain(p, im, 2), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_block_pool_retain: ids=");
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_release(p, im, 1), KV_ERR_INVALID_ARG); /* the fast path */
    kvt_assert_msg_has("kv_block_pool_release: ids=");
    assert_int_equal(kv_block_pool_release(p, im, 2), KV_ERR_INVALID_ARG);
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_lookup(p, hm, 2, ids, &n), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_block_pool_lookup: hashes=");
    assert_int_equal(kv_block_pool_lookup(p, hashes, 2, im, &n), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_block_pool_lookup: ids=");
    assert_int_equal(n, 77);
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_match_prefix(p, toks, 4, 4, 0, im, hs, 8, &n),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_block_pool_match_prefix: ids=");
    assert_int_equal(kv_block_pool_match_prefix(p, toks, 4, 4, 0, ids, om, 8, &n),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_block_pool_match_prefix: hashes=");
    assert_int_equal(n, 77);
    assert_same_state(p, &before);
    assert_int_equal(kv_block_pool_free_list(p, im, 9, &n), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_block_pool_free_list: ids=");
    assert_int_equal(n, 77);
    assert_same_state(p, &before);

    /* nothing to read or write: accepted */
    assert_int_equal(kv_block_pool_alloc(p, 0, im), KV_OK);
    assert_int_equal(kv_block_pool_retain(p, im, 0), KV_OK);
    assert_int_equal(kv_block_pool_release(p, im, 0), KV_OK);
    assert_int_equal(kv_block_pool_lookup(p, hm, 0, im, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_same_state(p, &before);
    /* the aligned twins do what the misaligned calls were refused */
    assert_int_equal(kv_block_pool_lookup(p, hashes, 2, ids, &n), KV_OK);
    assert_int_equal(n, 1); /* 0x22 is not block 2's hash */
    assert_int_equal(ids[0], held[0]);
    assert_int_equal(kv_block_pool_match_prefix(p, toks, 4, 4, 0, ids, hs, 8, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], held[1]);
    assert_int_equal(hs[0], h);
    const uint32_t back[2] = {held[0], held[1]};
    assert_int_equal(kv_block_pool_release(p, back, 2), KV_OK);
    assert_int_equal(kv_block_pool_ref_count(p, held[0]), 1);
    assert_int_equal(kv_block_pool_ref_count(p, held[1]), 1);
    snap_free(&before);
    kv_block_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_block_pool_create_refuses_bad_config),
        cmocka_unit_test(test_block_pool_fresh_pool_state),
        cmocka_unit_test(test_block_pool_null_block_never_handed_out),
        cmocka_unit_test(test_block_pool_alloc_free_lru_order),
        cmocka_unit_test(test_block_pool_batch_alloc_all_or_nothing),
        cmocka_unit_test(test_block_pool_double_free_is_an_error),
        cmocka_unit_test(test_block_pool_foreign_id_is_an_error),
        cmocka_unit_test(test_block_pool_retain_shares_blocks),
        cmocka_unit_test(test_block_pool_hash_is_canonical_xxh3),
        cmocka_unit_test(test_block_pool_hash_chaining),
        cmocka_unit_test(test_block_pool_longest_prefix_lookup),
        cmocka_unit_test(test_block_pool_long_prefix_spans_chunks),
        cmocka_unit_test(test_block_pool_cached_hit_leaves_free_list),
        cmocka_unit_test(test_block_pool_lazy_eviction_oldest_first),
        cmocka_unit_test(test_block_pool_events_fire_with_hash_and_id),
        cmocka_unit_test(test_block_pool_stats_track_every_counter),
        cmocka_unit_test(test_block_pool_ops_seam),
        cmocka_unit_test(test_block_pool_destroyed_before_its_tables),
        cmocka_unit_test(test_block_pool_hash_table_survives_churn),
        cmocka_unit_test(test_block_pool_debug_env_values),
        cmocka_unit_test(test_block_pool_misaligned_arrays),
        cmocka_unit_test(test_block_pool_model_random_ops),
        cmocka_unit_test(test_block_pool_threads_share_one_pool),
    };
    return cmocka_run_group_tests_name("block_pool", tests, NULL, NULL);
}
