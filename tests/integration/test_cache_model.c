/*
 * test_cache_model.c - a randomized model-based test of the whole cache
 * (issue 3), through the public API only (linked against libkvcache.so).
 *
 * One kv_cache of 10,240 block records (ids 1 .. 10,239 usable; N = 4 tokens
 * per block, L = 2, H = 1, D = 2, f32: a 1.25 MiB arena), prefix caching on,
 * up to 64 live sequences. A fixed-seed stream of random operations runs
 * against a reference model written here in plain arrays:
 *
 *   create      seq_create (+ set_extra_key), then the prompt is appended
 *   prefix      create_from_prefix, or create + set_extra_key +
 *               reuse_prefix, on a prompt drawn from a small tree of shared
 *               "documents" (so prefixes really repeat, across documents
 *               too); then the rest of the prompt is appended; sometimes the
 *               sequence is freed at once (a pure lookup)
 *   append      1..4 sequences in one step: append (counts from 1 to 256,
 *               crossing block boundaries), drain the copy-on-write queue in
 *               random chunks, perform the copies through the layout's block
 *               byte runs, THEN write the step's K/V (the page-table rule)
 *   fork        child shares every block, sometimes continues another document
 *   truncate    small rollbacks, into sealed blocks, to block boundaries, to 0
 *   free
 *   edge        when the pool is nearly full: an append needing exactly
 *               free + cached - 1, + 0, + 1 or + 2 blocks
 *   misuse      dead ids, truncate past the end, extra key or reuse on a
 *               non-empty sequence, slot past the end, appends past
 *               max_blocks_per_seq, double release / retain of a free block
 *
 * A grow/shrink controller drives the pool to the no-blocks boundary and back
 * again and again, so block ids cycle over the whole pool, cached blocks are
 * evicted and allocations fail. At the end most sequences are freed and the
 * cache is destroyed with the rest still live.
 *
 * The model:
 *   pool    ref count, model key and library hash of every block, the free
 *           list in LRU order (alloc from the head, release to the tail; the
 *           table releases a sequence's blocks last to first), a key -> block
 *           map: it predicts the exact ids handed out, every eviction, every
 *           prefix hit, each STORED / REMOVED event and every counter of
 *           kv_block_pool_stats_get().
 *   table   per sequence its tokens, its blocks (ceil(n / N) of them), how
 *           many are sealed and their chained keys; the copy-on-write queue;
 *           the counters of kv_page_table_stats_get().
 *   data    the content id held by every slot of the arena: the K/V of
 *           token t of a sequence is a function of a hash of (extra key,
 *           tokens 0..t), so a block reused through the prefix cache must
 *           hold exactly what a sequence with that prefix would have written.
 *
 * The model's prefix identity is its own hash of (extra key, token prefix),
 * independent of the library's XXH3 chain; the library's hashes are only
 * compared with kv_block_hash() over the same tokens.
 *
 * Checked after every operation: every status; the touched sequences' length,
 * exact block ids and the pool ref count of each of their blocks (and of
 * every block they released); every slot written (kv_page_table_slot ==
 * block * N + t % N); every queued copy (src, dst, tokens) against the model;
 * the data of every reused prefix and of every copied partial block; pool and
 * table counters (free + used + cached == capacity); the event stream; an
 * unchanged sequence after every failed call; a random window of a random
 * sequence's K/V.
 * Checked every 1000 operations and at the end: every block's ref count
 * recounted from the sequences (== pool == model), used == distinct blocks
 * held, the free list in order, every block's hash, every token's slot and
 * K/V, the vLLM and FlashInfer exports of all sequences, and the whole arena
 * against the data model (no stray writes).
 *
 * Two runs: the default cache (layer-major NHD) with 10^6 operations, and a
 * block-major HND padded cache with max_blocks_per_seq 250 and 2 kernel pages
 * per block with a fifth of them. Operations: 10^6 by default; 12,000 in
 * DEBUG builds (the pool then walks all its invariants after every call) and
 * 500,000 in sanitizer builds.
 * The environment overrides: KV_MODEL_OPS=<count>, KV_MODEL_SEED=<seed>, and
 * KV_MODEL_SWEEP_EVERY=<ops> (1 finds the first operation after which the
 * library and the model disagree).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kvtest.h"

enum {
    L = 2,
    N = 4, /* tokens per block */
    H = 1,
    D = 2,
    NB = 10240,    /* block records; 0 is the null block */
    CAP = NB - 1,  /* usable blocks */
    MAX_SEQS = 64, /* live sequences at once */
    NDOC = 24,     /* documents the tokens come from */
    VOCAB = 16,    /* small: equal blocks under different prefixes are common */
    MAP_BITS = 15, /* model key map: 32768 slots >= 2 * CAP */
    MAP_SLOTS = 1 << MAP_BITS,
    SWEEP_EVERY = 1000,
    MAX_BATCH = 4,     /* sequences appended in one step */
    MAX_PROMPT = 1024, /* tokens */
    MAX_APPEND = 1100, /* tokens in one append (edge appends up to ~260 blocks) */
    EDGE_BELOW = 256,  /* edge op when free + cached is below this */
};

#define SENT ((uint32_t)NB) /* sentinel of the model's free list */
#define NIL UINT32_MAX

#if defined(KV_DEBUG_CHECKS)
#define MODEL_DEFAULT_OPS 12000L
#elif defined(KV_USE_LIBC_MALLOC) || defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MODEL_DEFAULT_OPS 500000L
#else
#define MODEL_DEFAULT_OPS 1000000L
#endif
#define MODEL_DEFAULT_SEED 0x6b76636163686531ull /* "kvcache1" */

/* ------------------------------------------------------------ hashing */

static uint64_t mix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Content id of a sequence's token t: a chain over (extra key, tokens 0..t).
 * Never 0 (0 marks a slot never written). */
static uint64_t ph_seed(uint64_t extra)
{
    return mix64(extra ^ 0x5EED5EED5EEDull) | 1;
}

static uint64_t ph_next(uint64_t prev, int32_t tok)
{
    return mix64(prev * 0x100000001B3ull + (uint32_t)tok + 0x12345) | 1;
}

/* The model's identity of a full block: its own chain, not the library's. */
static uint64_t mkey_block(uint64_t parent, const int32_t *t, uint64_t extra)
{
    uint64_t h = mix64(parent ^ 0xB10CB10Cull) ^ mix64(extra + 0xE47A);
    for (int i = 0; i < N; i++)
        h = mix64(h + (uint32_t)t[i] * 0x9E3779B97F4A7C15ull);
    return h | 1; /* 0 = empty slot of the map */
}

/* Element value of a content id in (layer, kv, head, d). */
static uint32_t kv_val(uint64_t ph, uint32_t l, int kv, uint32_t h, uint32_t d)
{
    return (uint32_t)mix64(ph ^ ((uint64_t)l << 48) ^ ((uint64_t)kv << 40) ^ ((uint64_t)h << 20) ^
                           d) |
           1u;
}

/* ------------------------------------------------------------ documents */

/* A small tree: doc d shares tokens [0, bp) with its parent, so prompts of
 * different documents share prefixes, at and off block boundaries. Root 1
 * repeats one block's tokens forever and root 3 has period 2: the chain must
 * tell equal blocks at different positions apart. */
static struct {
    int32_t parent[NDOC]; /* -1 for a root */
    uint64_t bp[NDOC];
    uint32_t period[NDOC];
} DOC;

static void docs_init(uint64_t *rng)
{
    for (int d = 0; d < NDOC; d++) {
        if (d < 4) {
            DOC.parent[d] = -1;
            DOC.bp[d] = 0;
            DOC.period[d] = d == 1 ? N : d == 3 ? 2 : 0;
        } else {
            DOC.parent[d] = (int32_t)kvt_range(rng, 0, d - 1);
            DOC.bp[d] = kvt_range(rng, 0, 1) ? (uint64_t)N * (uint64_t)kvt_range(rng, 0, 100)
                                             : (uint64_t)kvt_range(rng, 0, 400);
            DOC.period[d] = 0;
        }
    }
}

static int32_t doc_tok(uint32_t d, uint64_t p)
{
    while (DOC.parent[d] >= 0 && p < DOC.bp[d])
        d = (uint32_t)DOC.parent[d];
    if (DOC.period[d])
        return 100 + (int32_t)(p % DOC.period[d]);
    return (int32_t)(mix64(((uint64_t)d << 48) ^ p) % VOCAB);
}

/* ------------------------------------------------------------ state */

struct ev {
    int type;
    uint64_t hash;
    uint32_t id;
};

struct evlog {
    struct ev *v;
    size_t n, cap;
};

/* The pool model. */
static struct {
    uint32_t ref[NB];
    uint8_t hashed[NB];
    uint64_t key[NB];   /* model key of a hashed block */
    uint64_t lhash[NB]; /* the library's hash of a hashed block */
    uint32_t prev[NB + 1], next[NB + 1];
    uint32_t list_len, n_used, n_cached, n_hashed, high_water;
    uint64_t hits, misses, evictions, stored, not_stored;
    uint64_t map_key[MAP_SLOTS]; /* 0 = empty */
    uint32_t map_id[MAP_SLOTS];
    uint8_t ever[NB]; /* handed out at least once */
    uint32_t n_ever;
} MP;

/* One sequence of the table model. */
struct mseq {
    bool live;
    uint32_t doc; /* where its next tokens come from */
    uint64_t extra;
    uint64_t n;
    uint32_t nb, ncommit, capb;
    int32_t *tok;    /* [capb * N] */
    uint64_t *ph;    /* [capb * N] content id of each token */
    uint32_t *blk;   /* [capb] */
    uint64_t *bkey;  /* [capb] model key of sealed block i */
    uint64_t *bhash; /* [capb] library hash of sealed block i */
};

static struct mseq MS[MAX_SEQS];

static struct {
    uint32_t live;
    uint64_t held, cow, reused, committed, commit_failures;
} MT;

/* Copy-on-writes not yet done, oldest first: v[0, taken) taken by the
 * test, v[taken, taken + n) queued. Each holds a ref on its src and dst
 * until copies_done (the library's rule for copies run at once). */
static struct {
    struct kv_block_copy v[16];
    uint32_t n;     /* queued (kv_page_table_pending_copies) */
    uint32_t taken; /* taken, not done */
} MQ;

/* Refs the copies not yet done hold on id (not sharing: the COW test
 * subtracts them). */
static uint32_t mq_refs(uint32_t id)
{
    uint32_t r = 0;
    for (uint32_t i = 0; i < MQ.taken + MQ.n; i++)
        r += (MQ.v[i].src == id) + (MQ.v[i].dst == id);
    return r;
}

/* Whether appending to s must copy its partial last block first. */
static bool m_cow_due(const struct mseq *s)
{
    if (s->n % N == 0)
        return false;
    const uint32_t last = s->nb - 1, id = s->blk[last];
    return last < s->ncommit || MP.ref[id] - mq_refs(id) > 1;
}

/* Content id of every slot of the arena (0 = never written). */
static uint64_t CONTENT[(size_t)NB * N];

static uint32_t TMP_IDS[NB + 1];
static uint32_t SAVED[NB + 1];
static uint32_t RECOUNT[NB];

static struct evlog EV_GOT, EV_WANT;

static struct {
    kv_cache *c;
    kv_page_table *pt;
    kv_block_pool *pool;
    const struct kv_layout *lo;
    char *base;
    struct kv_view view[L][2];
    struct kv_layout_config cfg; /* the config: checks address through it alone */
    uint64_t rng, seed;
    long op;
    const char *op_name;
    bool shrink;              /* controller phase */
    uint32_t phase_no_blocks; /* failed appends in this grow phase */
    uint32_t maxb;            /* max_blocks_per_seq */
    uint32_t r;               /* kernel pages per block */
    int32_t scratch[MAX_APPEND + (size_t)CAP * N + 8];
    int32_t prompt[MAX_PROMPT];
} G;

static struct {
    uint64_t create, create_nomem, prefix, prefix_two_step, prefix_probe, prefix_nomem;
    uint64_t prefix_hit_seqs, reused_tokens;
    uint64_t appends, append_ok, append_no_blocks, append_too_long, tokens, reuse_capped;
    uint64_t forks, fork_nomem, truncs, trunc_sealed, frees;
    uint64_t edge, edge_no_blocks, misuse, copies, take_calls, sweeps, phases;
} CNT;

/* ------------------------------------------------------------ failure reports */

static void fail_at(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail_at(const char *fmt, ...)
{
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    fail_msg("op %ld (%s), seed %#llx: %s", G.op, G.op_name, (unsigned long long)G.seed, what);
}

static void check_eq(uint64_t got, uint64_t want, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void check_eq(uint64_t got, uint64_t want, const char *fmt, ...)
{
    char what[384];
    va_list ap;
    if (got == want)
        return;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    fail_at("%s: got %llu, expected %llu", what, (unsigned long long)got, (unsigned long long)want);
}

static void check_st(kv_status got, kv_status want, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void check_st(kv_status got, kv_status want, const char *fmt, ...)
{
    char what[384];
    va_list ap;
    if (got == want)
        return;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    fail_at("%s: got %s, expected %s (last error: %s)", what, kv_status_name(got),
            kv_status_name(want), kv_last_error());
}

/* realloc that fails the test instead of returning NULL. */
static void *xrealloc(void *p, size_t bytes)
{
    void *q = realloc(p, bytes);
    assert_non_null(q);
    return q;
}

/* ------------------------------------------------------------ events */

static void ev_push(struct evlog *l, int type, uint64_t hash, uint32_t id)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 1024;
        l->v = xrealloc(l->v, l->cap * sizeof(*l->v));
    }
    l->v[l->n++] = (struct ev){type, hash, id};
}

static void on_event(void *user, kv_block_event ev, uint64_t hash, uint32_t id)
{
    ev_push(user, (int)ev, hash, id);
}

/* The events the library fired since the last check are exactly the
 * model's, in order. */
static void check_events(void)
{
    check_eq(EV_GOT.n, EV_WANT.n, "number of pool events");
    for (size_t i = 0; i < EV_GOT.n; i++) {
        const struct ev *g = &EV_GOT.v[i], *w = &EV_WANT.v[i];
        if (g->type != w->type || g->hash != w->hash || g->id != w->id)
            fail_at("event %zu: got %s hash %#llx id %u, expected %s hash %#llx id %u", i,
                    g->type == KV_BLOCK_STORED ? "STORED" : "REMOVED", (unsigned long long)g->hash,
                    g->id, w->type == KV_BLOCK_STORED ? "STORED" : "REMOVED",
                    (unsigned long long)w->hash, w->id);
    }
    EV_GOT.n = EV_WANT.n = 0;
}

/* ------------------------------------------------------------ pool model */

static uint32_t map_home(uint64_t k)
{
    return (uint32_t)((k * 0x9E3779B97F4A7C15ull) >> (64 - MAP_BITS));
}

static uint32_t map_find(uint64_t k)
{
    for (uint32_t i = map_home(k);; i = (i + 1) & (MAP_SLOTS - 1)) {
        if (MP.map_key[i] == 0)
            return 0;
        if (MP.map_key[i] == k)
            return MP.map_id[i];
    }
}

static void map_insert(uint64_t k, uint32_t id)
{
    uint32_t i = map_home(k);
    while (MP.map_key[i] != 0)
        i = (i + 1) & (MAP_SLOTS - 1);
    MP.map_key[i] = k;
    MP.map_id[i] = id;
}

/* Linear probing with backward-shift deletion. */
static void map_remove(uint64_t k)
{
    uint32_t i = map_home(k), j;
    while (MP.map_key[i] != k) {
        assert_true(MP.map_key[i] != 0); /* the model itself is broken */
        i = (i + 1) & (MAP_SLOTS - 1);
    }
    j = i;
    for (;;) {
        j = (j + 1) & (MAP_SLOTS - 1);
        if (MP.map_key[j] == 0)
            break;
        uint32_t h = map_home(MP.map_key[j]);
        bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (stays)
            continue;
        MP.map_key[i] = MP.map_key[j];
        MP.map_id[i] = MP.map_id[j];
        i = j;
    }
    MP.map_key[i] = 0;
    MP.map_id[i] = 0;
}

static void ml_push_tail(uint32_t id)
{
    MP.prev[id] = MP.prev[SENT];
    MP.next[id] = SENT;
    MP.next[MP.prev[SENT]] = id;
    MP.prev[SENT] = id;
    MP.list_len++;
}

static void ml_unlink(uint32_t id)
{
    MP.next[MP.prev[id]] = MP.next[id];
    MP.prev[MP.next[id]] = MP.prev[id];
    MP.prev[id] = MP.next[id] = NIL;
    MP.list_len--;
}

static void mp_init(const uint32_t *order, uint32_t n)
{
    memset(&MP, 0, sizeof(MP));
    MP.prev[SENT] = MP.next[SENT] = SENT;
    for (uint32_t id = 0; id < NB; id++)
        MP.prev[id] = MP.next[id] = NIL;
    for (uint32_t i = 0; i < n; i++)
        ml_push_tail(order[i]);
}

/* n blocks from the head (evicting cached ones), or false when short. */
static bool m_alloc(uint32_t n, uint32_t *ids)
{
    if (n > MP.list_len)
        return false;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = MP.next[SENT];
        ml_unlink(id);
        if (MP.hashed[id]) {
            map_remove(MP.key[id]);
            MP.hashed[id] = 0;
            MP.n_cached--;
            MP.n_hashed--;
            MP.evictions++;
            ev_push(&EV_WANT, KV_BLOCK_REMOVED, MP.lhash[id], id);
        }
        MP.ref[id] = 1;
        ids[i] = id;
        if (!MP.ever[id]) {
            MP.ever[id] = 1;
            MP.n_ever++;
        }
    }
    MP.n_used += n;
    if (MP.n_used > MP.high_water)
        MP.high_water = MP.n_used;
    return true;
}

static void m_retain(uint32_t id)
{
    assert_true(MP.ref[id] > 0);
    MP.ref[id]++;
}

static void m_release(uint32_t id)
{
    assert_true(MP.ref[id] > 0);
    if (--MP.ref[id] == 0) {
        ml_push_tail(id);
        MP.n_used--;
        if (MP.hashed[id])
            MP.n_cached++;
    }
}

/* commit_full: false when the library must refuse (id carries another key). */
static bool m_commit(uint32_t id, uint64_t key, uint64_t lhash)
{
    if (MP.hashed[id])
        return MP.key[id] == key;
    if (map_find(key)) {
        MP.not_stored++;
        return true;
    }
    map_insert(key, id);
    MP.hashed[id] = 1;
    MP.key[id] = key;
    MP.lhash[id] = lhash;
    MP.n_hashed++;
    MP.stored++;
    ev_push(&EV_WANT, KV_BLOCK_STORED, lhash, id);
    return true;
}

/* Longest found prefix of keys[want], each found block retained. */
static uint32_t m_match(const uint64_t *keys, uint32_t want, uint32_t *ids)
{
    uint32_t found = 0;
    for (; found < want; found++) {
        uint32_t id = map_find(keys[found]);
        if (!id)
            break;
        if (MP.ref[id]++ == 0) {
            ml_unlink(id);
            MP.n_cached--;
            MP.n_used++;
        }
        ids[found] = id;
    }
    if (MP.n_used > MP.high_water)
        MP.high_water = MP.n_used;
    MP.hits += found;
    MP.misses += want - found;
    return found;
}

/* ------------------------------------------------------------ table model */

static void ms_reserve(struct mseq *s, uint32_t blocks)
{
    if (s->capb >= blocks)
        return;
    uint32_t cap = s->capb * 2 > blocks ? s->capb * 2 : blocks;
    if (cap < 16)
        cap = 16;
    if (cap > CAP + 1)
        cap = CAP + 1;
    s->tok = xrealloc(s->tok, (size_t)cap * N * sizeof(*s->tok));
    s->ph = xrealloc(s->ph, (size_t)cap * N * sizeof(*s->ph));
    s->blk = xrealloc(s->blk, (size_t)cap * sizeof(*s->blk));
    s->bkey = xrealloc(s->bkey, (size_t)cap * sizeof(*s->bkey));
    s->bhash = xrealloc(s->bhash, (size_t)cap * sizeof(*s->bhash));
    s->capb = cap;
}

/* A sequence id the table handed out: in [0, max_seqs) and not live. */
static void ms_create(uint32_t sid, uint32_t doc, uint64_t extra)
{
    if (sid >= MAX_SEQS || MS[sid].live)
        fail_at("the table handed out seq id %u (max_seqs %d, already live: %d)", sid, MAX_SEQS,
                sid < MAX_SEQS ? (int)MS[sid].live : -1);
    struct mseq *s = &MS[sid];
    ms_reserve(s, 1); /* a live sequence always has its arrays */
    s->live = true;
    s->doc = doc;
    s->extra = extra;
    s->n = 0;
    s->nb = s->ncommit = 0;
    MT.live++;
}

/* Tokens t[k] at position at: token ids and content ids. */
static void ms_put_tokens(struct mseq *s, uint64_t at, const int32_t *t, uint64_t k)
{
    uint64_t h = at ? s->ph[at - 1] : ph_seed(s->extra);
    for (uint64_t j = 0; j < k; j++) {
        s->tok[at + j] = t[j];
        h = ph_next(h, t[j]);
        s->ph[at + j] = h;
    }
}

/* Seal the blocks that are full, chained to their parents. */
static void ms_seal(struct mseq *s)
{
    while (s->ncommit < s->n / N) {
        uint32_t i = s->ncommit;
        const int32_t *t = s->tok + (uint64_t)i * N;
        uint64_t key = mkey_block(i ? s->bkey[i - 1] : 0, t, s->extra);
        uint64_t lh = kv_block_hash(i ? s->bhash[i - 1] : KV_PAGE_TABLE_ROOT_HASH, t, N, s->extra);
        if (!m_commit(s->blk[i], key, lh)) {
            MT.commit_failures++;
            break;
        }
        s->bkey[i] = key;
        s->bhash[i] = lh;
        s->ncommit++;
        MT.committed++;
    }
}

/* What the model says appending k tokens to sid takes from the pool
 * (kv_page_table_blocks_needed), or KV_ERR_CAPACITY. */
static kv_status m_blocks_needed(uint32_t sid, uint64_t k, uint32_t *blocks)
{
    const struct mseq *s = &MS[sid];
    if (k > (uint64_t)G.maxb * N || s->n + k > (uint64_t)G.maxb * N)
        return KV_ERR_CAPACITY;
    uint32_t need = (uint32_t)((s->n + k + N - 1) / N) - s->nb;
    bool cow = k > 0 && m_cow_due(s);
    *blocks = need + (cow ? 1 : 0);
    return KV_OK;
}

/* kv_page_table_seq_append as the model sees it. */
static kv_status m_append(uint32_t sid, const int32_t *toks, uint64_t k)
{
    struct mseq *s = &MS[sid];
    if (k == 0)
        return KV_OK;
    if (k > (uint64_t)G.maxb * N || s->n + k > (uint64_t)G.maxb * N)
        return KV_ERR_CAPACITY;
    const uint64_t new_len = s->n + k;
    const uint32_t total = (uint32_t)((new_len + N - 1) / N);
    const uint32_t need = total - s->nb;
    const uint32_t last = s->nb - 1;
    bool cow = m_cow_due(s);
    if (!m_alloc(need + (cow ? 1 : 0), TMP_IDS))
        return KV_ERR_NO_BLOCKS;
    ms_reserve(s, total);
    if (cow) {
        /* a src that is the dst of a copy not yet done is read from that
         * copy's src; the copy holds src and dst, the sequence's ref on its
         * old block moves to dst */
        uint32_t old = s->blk[last], src = old, dst = TMP_IDS[need];
        for (uint32_t i = MQ.taken + MQ.n; i-- > 0;)
            if (MQ.v[i].dst == src) {
                src = MQ.v[i].src;
                break;
            }
        m_retain(src);
        m_retain(dst);
        m_release(old);
        assert_true(MQ.taken + MQ.n < 16);
        MQ.v[MQ.taken + MQ.n++] =
            (struct kv_block_copy){.src = src, .dst = dst, .tokens = (uint32_t)(s->n % N)};
        s->blk[last] = dst;
        if (last < s->ncommit)
            s->ncommit = last;
        MT.cow++;
    }
    memcpy(s->blk + s->nb, TMP_IDS, (size_t)need * sizeof(*TMP_IDS));
    ms_put_tokens(s, s->n, toks, k);
    s->nb = total;
    s->n = new_len;
    MT.held += need;
    ms_seal(s);
    return KV_OK;
}

static void m_fork(uint32_t parent, uint32_t child)
{
    struct mseq *p = &MS[parent], *c;
    ms_create(child, p->doc, p->extra);
    c = &MS[child];
    ms_reserve(c, p->nb);
    for (uint32_t i = 0; i < p->nb; i++)
        m_retain(p->blk[i]);
    memcpy(c->blk, p->blk, (size_t)p->nb * sizeof(*c->blk));
    memcpy(c->bkey, p->bkey, (size_t)p->ncommit * sizeof(*c->bkey));
    memcpy(c->bhash, p->bhash, (size_t)p->ncommit * sizeof(*c->bhash));
    memcpy(c->tok, p->tok, (size_t)p->n * sizeof(*c->tok));
    memcpy(c->ph, p->ph, (size_t)p->n * sizeof(*c->ph));
    c->n = p->n;
    c->nb = p->nb;
    c->ncommit = p->ncommit;
    MT.held += p->nb;
}

/* seq_truncate / seq_free release blocks[from, to) last to first
 * (docs/page-table.md, "Release order"): the tail of a sequence reaches the
 * LRU tail first, so it is evicted before the prefix. */
static void m_release_range(const struct mseq *s, uint32_t from, uint32_t to)
{
    for (uint32_t i = to; i-- > from;)
        m_release(s->blk[i]);
}

static void m_truncate(uint32_t sid, uint64_t m)
{
    struct mseq *s = &MS[sid];
    uint32_t keep = (uint32_t)((m + N - 1) / N);
    m_release_range(s, keep, s->nb);
    MT.held -= s->nb - keep;
    s->nb = keep;
    s->n = m;
    if (s->ncommit > keep)
        s->ncommit = keep; /* a sealed block made partial stays sealed */
}

static void m_free(uint32_t sid)
{
    struct mseq *s = &MS[sid];
    m_release_range(s, 0, s->nb);
    MT.held -= s->nb;
    s->nb = s->ncommit = 0;
    s->n = 0;
    s->live = false;
    MT.live--;
}

/* reuse_prefix on the empty sequence sid: blocks found. */
static uint32_t m_reuse(uint32_t sid, const int32_t *toks, uint64_t n)
{
    struct mseq *s = &MS[sid];
    uint64_t max_reuse = n ? (n - 1) / N : 0;
    static uint64_t keys[MAX_PROMPT / N + 1];
    if (max_reuse > G.maxb) {
        max_reuse = G.maxb;
        CNT.reuse_capped++;
    }
    if (max_reuse == 0)
        return 0;
    ms_reserve(s, (uint32_t)max_reuse);
    for (uint32_t i = 0; i < max_reuse; i++)
        keys[i] = mkey_block(i ? keys[i - 1] : 0, toks + (uint64_t)i * N, s->extra);
    uint32_t found = m_match(keys, (uint32_t)max_reuse, s->blk);
    for (uint32_t i = 0; i < found; i++) {
        s->bkey[i] = keys[i];
        s->bhash[i] = kv_block_hash(i ? s->bhash[i - 1] : KV_PAGE_TABLE_ROOT_HASH,
                                    toks + (uint64_t)i * N, N, s->extra);
    }
    ms_put_tokens(s, 0, toks, (uint64_t)found * N);
    s->nb = s->ncommit = found;
    s->n = (uint64_t)found * N;
    MT.reused += found;
    MT.held += found;
    return found;
}

/* ------------------------------------------------------------ K/V data */

/* Element (l, kv, block b, slot, h, d) through the cache's per-layer view:
 * where the library says it is (writes go here, as an engine's would). */
static uint32_t *elem(uint32_t l, int kv, uint32_t b, uint32_t slot, uint32_t h, uint32_t d)
{
    const struct kv_view *v = &G.view[l][kv];
    int64_t off = v->offset + (int64_t)b * v->strides[0] + (int64_t)slot * v->strides[1] +
                  (int64_t)h * v->strides[2] + (int64_t)d * v->strides[3];
    return (uint32_t *)v->base + off;
}

/* The same element where the config says it is (kvt_ref_offset_elems):
 * every check reads here, so the library's strides are checked, not
 * trusted. */
static uint32_t *ref_elem(uint32_t l, int kv, uint32_t b, uint32_t slot, uint32_t h, uint32_t d)
{
    return (uint32_t *)G.base + kvt_ref_offset_elems(&G.cfg, l, kv, b, slot, h, d);
}

static void write_token(uint32_t b, uint32_t slot, uint64_t ph)
{
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++)
                    *elem(l, kv, b, slot, h, d) = kv_val(ph, l, kv, h, d);
    CONTENT[(size_t)b * N + slot] = ph;
}

/* Token t of seq sid holds its K/V at slot (model block, t % N): read at
 * the reference address, and the table's slot for t agrees. */
static void check_token(uint32_t sid, uint64_t t, const char *why)
{
    const struct mseq *s = &MS[sid];
    uint32_t b = s->blk[t / N], slot = (uint32_t)(t % N);
    int64_t got_slot = -1;
    check_st(kv_page_table_slot(G.pt, sid, t, &got_slot), KV_OK, "slot of seq %u token %llu", sid,
             (unsigned long long)t);
    check_eq((uint64_t)got_slot, (uint64_t)b * N + slot, "slot of seq %u token %llu", sid,
             (unsigned long long)t);
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) {
                    const uint32_t *p = ref_elem(l, kv, b, slot, h, d);
                    uint32_t want = kv_val(s->ph[t], l, kv, h, d);
                    if (!p || *p != want)
                        fail_at("%s: seq %u token %llu (block %u slot %u) layer %u %c h %u d "
                                "%u holds %#x, expected %#x (slot content id %#llx, expected "
                                "%#llx)",
                                why, sid, (unsigned long long)t, b, slot, l, kv ? 'V' : 'K', h, d,
                                p ? *p : 0u, want,
                                (unsigned long long)CONTENT[(size_t)b * N + slot],
                                (unsigned long long)s->ph[t]);
                }
}

/* Perform a batch of copy-on-write copies at once with the block copy
 * kernel (the queue guarantees no copy's dst is another's src or dst). */
static void apply_copies(const struct kv_block_copy *cp, uint32_t n)
{
    struct kv_paged_cache pc;
    check_st(kv_cache_paged(G.c, &pc), KV_OK, "kv_cache_paged");
    check_st(kv_attn_copy_blocks(pc, cp, n), KV_OK, "copy_blocks of %u copies", n);
    for (uint32_t i = 0; i < n; i++) {
        assert_true(cp[i].src != cp[i].dst);
        memcpy(&CONTENT[(size_t)cp[i].dst * N], &CONTENT[(size_t)cp[i].src * N],
               N * sizeof(*CONTENT));
        CNT.copies++;
    }
}

/* ------------------------------------------------------------ checks */

static void check_refs(const uint32_t *ids, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        check_eq(kv_block_pool_ref_count(G.pool, ids[i]), MP.ref[ids[i]], "ref count of block %u",
                 ids[i]);
}

/* Length, exact block ids and their ref counts of one live sequence. */
static void check_seq(uint32_t sid)
{
    const struct mseq *s = &MS[sid];
    const uint32_t *blocks = NULL;
    uint32_t nb = 0;
    uint64_t len = 0;
    check_st(kv_page_table_seq_len(G.pt, sid, &len), KV_OK, "seq_len(%u)", sid);
    check_eq(len, s->n, "length of seq %u", sid);
    check_st(kv_page_table_seq_blocks(G.pt, sid, &blocks, &nb), KV_OK, "seq_blocks(%u)", sid);
    check_eq(nb, s->nb, "blocks of seq %u (%llu tokens)", sid, (unsigned long long)s->n);
    check_eq(nb, (s->n + N - 1) / N, "model blocks of seq %u", sid);
    for (uint32_t i = 0; i < nb; i++)
        if (blocks[i] != s->blk[i])
            fail_at("seq %u (%llu tokens) block %u is %u, expected %u", sid,
                    (unsigned long long)s->n, i, blocks[i], s->blk[i]);
    check_refs(s->blk, s->nb);
}

static void check_counters(void)
{
    struct kv_block_pool_stats st;
    struct kv_page_table_stats ts;
    kv_block_pool_stats_get(G.pool, &st);
    check_eq(st.capacity, CAP, "capacity");
    check_eq(st.free_blocks, MP.list_len - MP.n_cached, "free_blocks");
    check_eq(st.used_blocks, MP.n_used, "used_blocks");
    check_eq(st.cached_blocks, MP.n_cached, "cached_blocks");
    check_eq((uint64_t)st.free_blocks + st.used_blocks + st.cached_blocks, st.capacity,
             "free + used + cached");
    check_eq(st.used_high_water, MP.high_water, "used_high_water");
    check_eq(st.hashed_blocks, MP.n_hashed, "hashed_blocks");
    check_eq(st.hits, MP.hits, "hits");
    check_eq(st.misses, MP.misses, "misses");
    check_eq(st.evictions, MP.evictions, "evictions");
    check_eq(st.stored, MP.stored, "stored");
    kv_page_table_stats_get(G.pt, &ts);
    check_eq(ts.live_seqs, MT.live, "live_seqs");
    check_eq(ts.held_blocks, MT.held, "held_blocks");
    check_eq(ts.cow_copies, MT.cow, "cow_copies");
    check_eq(ts.reused_blocks, MT.reused, "reused_blocks");
    check_eq(ts.committed, MT.committed, "committed");
    check_eq(ts.commit_failures, MT.commit_failures, "commit_failures");
    check_eq(kv_page_table_pending_copies(G.pt), MQ.n, "pending copies");
    check_eq(ts.copies_held, MQ.taken + MQ.n, "copies held");
    check_events();
}

static uint32_t pick_live(void)
{
    uint32_t k = (uint32_t)kvt_range(&G.rng, 0, MT.live - 1);
    for (uint32_t sid = 0; sid < MAX_SEQS; sid++)
        if (MS[sid].live && k-- == 0)
            return sid;
    fail_at("no live sequence to pick (live %u)", MT.live);
    return 0;
}

/* A random window of a random sequence's K/V. */
static void spot_check(void)
{
    if (MT.live == 0)
        return;
    uint32_t sid = pick_live();
    const struct mseq *s = &MS[sid];
    if (s->n == 0)
        return;
    uint64_t from = (uint64_t)kvt_range(&G.rng, 0, (int64_t)s->n - 1);
    uint64_t to = from + (uint64_t)kvt_range(&G.rng, 1, 8);
    if (to > s->n)
        to = s->n;
    for (uint64_t t = from; t < to; t++)
        check_token(sid, t, "spot check");
}

/* Everything, from scratch. */
static void sweep(void)
{
    static uint32_t fl[NB];
    static uint32_t sids[MAX_SEQS];
    static int32_t indptr[MAX_SEQS + 1], last_len[MAX_SEQS];
    static int32_t *indices;
    static int64_t *slots;
    static size_t indices_cap, slots_cap;
    struct kv_block_pool_stats st;
    uint32_t n_sids = 0, distinct = 0, len = 0;
    uint64_t total_pages = 0, total_tokens = 0;

    CNT.sweeps++;
    check_counters();
    memset(RECOUNT, 0, sizeof(RECOUNT));
    for (uint32_t sid = 0; sid < MAX_SEQS; sid++) {
        const struct mseq *s = &MS[sid];
        uint64_t dummy;
        if (!s->live) {
            check_st(kv_page_table_seq_len(G.pt, sid, &dummy), KV_ERR_NOT_FOUND,
                     "seq_len of dead seq %u", sid);
            continue;
        }
        sids[n_sids++] = sid;
        check_seq(sid);
        for (uint32_t i = 0; i < s->nb; i++)
            RECOUNT[s->blk[i]]++;
        for (uint64_t t = 0; t < s->n; t++) {
            uint32_t b = s->blk[t / N], slot = (uint32_t)(t % N);
            int64_t got = -1;
            check_st(kv_page_table_slot(G.pt, sid, t, &got), KV_OK, "slot");
            check_eq((uint64_t)got, (uint64_t)b * N + slot, "slot of seq %u token %llu", sid,
                     (unsigned long long)t);
            if (CONTENT[(size_t)b * N + slot] != s->ph[t])
                fail_at("seq %u token %llu: block %u slot %u holds content %#llx, expected "
                        "%#llx",
                        sid, (unsigned long long)t, b, slot,
                        (unsigned long long)CONTENT[(size_t)b * N + slot],
                        (unsigned long long)s->ph[t]);
        }
        /* a full sealed block still holds the tokens it was committed with:
         * nothing appended into it in place */
        for (uint32_t i = 0; i < s->ncommit && (uint64_t)(i + 1) * N <= s->n; i++) {
            uint64_t lh = kv_block_hash(i ? s->bhash[i - 1] : KV_PAGE_TABLE_ROOT_HASH,
                                        s->tok + (uint64_t)i * N, N, s->extra);
            check_eq(s->bhash[i], lh, "hash of sealed block %u of seq %u vs its tokens now", i,
                     sid);
        }
        total_pages += (s->n + N / G.r - 1) / (N / G.r);
        total_tokens += s->n;
    }
    /* ref counts: recounted from the sequences == pool == model */
    for (uint32_t id = 1; id < NB; id++) {
        uint64_t h = 0;
        kv_status hs;
        check_eq(MP.ref[id], RECOUNT[id], "model ref of block %u vs holders", id);
        check_eq(kv_block_pool_ref_count(G.pool, id), RECOUNT[id],
                 "ref count of block %u vs live sequences holding it", id);
        distinct += RECOUNT[id] > 0;
        hs = kv_block_pool_block_hash(G.pool, id, &h);
        if (MP.hashed[id]) {
            check_st(hs, KV_OK, "hash of block %u", id);
            check_eq(h, MP.lhash[id], "hash of block %u", id);
            check_eq(map_find(MP.key[id]), id, "model map entry of block %u", id);
        } else {
            check_st(hs, KV_ERR_NOT_FOUND, "hash of unhashed block %u", id);
        }
    }
    kv_block_pool_stats_get(G.pool, &st);
    check_eq(st.used_blocks, distinct, "used_blocks vs distinct blocks held");
    /* the free list in LRU order */
    check_st(kv_block_pool_free_list(G.pool, fl, NB, &len), KV_OK, "free_list");
    check_eq(len, MP.list_len, "free list length");
    for (uint32_t i = 0, id = MP.next[SENT]; i < len; i++, id = MP.next[id])
        if (fl[i] != id)
            fail_at("free list position %u is block %u, expected %u", i, fl[i], id);

    /* exports of every live sequence */
    if (n_sids) {
        struct kv_flashinfer_export fx;
        struct kv_vllm_export vx;
        static struct kv_token_range ranges[MAX_SEQS];
        uint64_t nnz = 0, k = 0;
        if (indices_cap < total_pages + 1) {
            indices_cap = total_pages * 2 + 1;
            indices = xrealloc(indices, indices_cap * sizeof(*indices));
        }
        if (slots_cap < total_tokens + 1) {
            slots_cap = total_tokens * 2 + 1;
            slots = xrealloc(slots, slots_cap * sizeof(*slots));
        }
        fx = (struct kv_flashinfer_export){.indptr = indptr,
                                           .indptr_len = n_sids + 1u,
                                           .indices = indices,
                                           .indices_len = total_pages,
                                           .last_page_len = last_len,
                                           .last_page_len_len = n_sids};
        check_st(kv_page_table_export_flashinfer(G.pt, sids, n_sids, &fx, &nnz), KV_OK,
                 "flashinfer export");
        check_eq(nnz, total_pages, "flashinfer nnz");
        check_eq((uint64_t)indptr[0], 0, "indptr[0]");
        for (uint32_t i = 0; i < n_sids; i++) {
            const struct mseq *s = &MS[sids[i]];
            const uint64_t pt_tokens = N / G.r, pages = (s->n + pt_tokens - 1) / pt_tokens;
            check_eq((uint64_t)(indptr[i + 1] - indptr[i]), pages, "indptr of seq %u", sids[i]);
            check_eq((uint64_t)last_len[i], s->n ? (s->n - 1) % pt_tokens + 1 : 0,
                     "last_page_len of seq %u", sids[i]);
            for (uint64_t j = 0; j < pages; j++) /* block b is pages b*r .. b*r + r-1 */
                check_eq((uint64_t)indices[indptr[i] + j],
                         (uint64_t)s->blk[j / G.r] * G.r + j % G.r, "page %llu of seq %u",
                         (unsigned long long)j, sids[i]);
            ranges[i] = (struct kv_token_range){0, s->n};
        }
        memset(&vx, 0, sizeof(vx));
        vx.slot_mapping = slots;
        vx.slot_mapping_len = total_tokens;
        check_st(kv_page_table_export_vllm(G.pt, sids, n_sids, ranges, &vx), KV_OK, "vllm export");
        for (uint32_t i = 0; i < n_sids; i++) {
            const struct mseq *s = &MS[sids[i]];
            for (uint64_t t = 0; t < s->n; t++, k++)
                check_eq((uint64_t)slots[k], (uint64_t)s->blk[t / N] * N + t % N,
                         "vllm slot of seq %u token %llu", sids[i], (unsigned long long)t);
        }
    }

    /* the whole arena against the data model, block 0 and padding included */
    {
        const uint32_t *a = (const uint32_t *)G.base;
        static uint32_t *expect;
        static size_t expect_elems;
        size_t elems = (size_t)G.lo->total_elems;
        if (expect_elems < elems) {
            expect = xrealloc(expect, elems * sizeof(*expect));
            expect_elems = elems;
        }
        memset(expect, 0, elems * sizeof(*expect));
        for (uint32_t b = 0; b < NB; b++)
            for (uint32_t slot = 0; slot < N; slot++) {
                uint64_t ph = CONTENT[(size_t)b * N + slot];
                if (!ph)
                    continue;
                for (uint32_t l = 0; l < L; l++)
                    for (int kv = 0; kv < 2; kv++)
                        for (uint32_t h = 0; h < H; h++)
                            for (uint32_t d = 0; d < D; d++)
                                expect[ref_elem(l, kv, b, slot, h, d) - a] =
                                    kv_val(ph, l, kv, h, d);
            }
        for (size_t e = 0; e < elems; e++)
            if (a[e] != expect[e])
                fail_at("arena element %zu is %#x, expected %#x (a stray write or a lost copy)", e,
                        a[e], expect[e]);
    }
}

/* ------------------------------------------------------------ steps */

struct wr {
    uint32_t sid;
    uint64_t from, to;
};

struct cw {
    uint32_t sid, bi, tokens;
};

struct step {
    struct wr w[MAX_BATCH + 1];
    struct cw c[MAX_BATCH + 1];
    uint32_t nw, nc;
};

/* Append k tokens of sid's document to sid, in the library and the model. */
static kv_status append_one(struct step *stp, uint32_t sid, uint64_t k)
{
    struct mseq *s = &MS[sid];
    const uint64_t n0 = s->n;
    const uint32_t q0 = MQ.n;
    for (uint64_t j = 0; j < k; j++)
        G.scratch[j] = doc_tok(s->doc, n0 + j);
    {
        /* admission query: same answer as the model, and it predicts the
         * append's NO_BLOCKS exactly (free + cached blocks are all takeable) */
        uint32_t lib = 0, mod = 0;
        kv_status qs = kv_page_table_blocks_needed(G.pt, sid, k, &lib);
        check_st(qs, m_blocks_needed(sid, k, &mod), "blocks_needed(seq %u, %llu)", sid,
                 (unsigned long long)k);
        if (qs == KV_OK)
            check_eq(lib, mod, "blocks_needed(seq %u, %llu tokens)", sid, (unsigned long long)k);
    }
    kv_status want = m_append(sid, G.scratch, k);
    kv_status got = kv_page_table_seq_append(G.pt, sid, G.scratch, k);
    CNT.appends++;
    check_st(got, want, "append to seq %u of %llu tokens: + %llu (free + cached %u)", sid,
             (unsigned long long)n0, (unsigned long long)k, MP.list_len);
    check_eq(kv_page_table_pending_copies(G.pt), MQ.n, "copies queued by the append to seq %u",
             sid);
    check_seq(sid); /* unchanged after a failure */
    check_events();
    if (want == KV_OK) {
        CNT.append_ok++;
        CNT.tokens += k;
        stp->w[stp->nw++] = (struct wr){sid, n0, n0 + k};
        if (MQ.n > q0)
            stp->c[stp->nc++] = (struct cw){sid, (uint32_t)(n0 / N), (uint32_t)(n0 % N)};
    } else if (want == KV_ERR_NO_BLOCKS) {
        CNT.append_no_blocks++;
        G.phase_no_blocks++;
    } else if (want == KV_ERR_CAPACITY) {
        CNT.append_too_long++;
    }
    return want;
}

/* copies_done, in the library and the model: each taken copy releases its
 * src, then its dst, oldest first. */
static void copies_done(void)
{
    check_st(kv_page_table_copies_done(G.pt), KV_OK, "copies_done");
    for (uint32_t i = 0; i < MQ.taken; i++) {
        m_release(MQ.v[i].src);
        m_release(MQ.v[i].dst);
    }
    memmove(MQ.v, MQ.v + MQ.taken, MQ.n * sizeof(*MQ.v));
    MQ.taken = 0;
    check_eq(kv_page_table_pending_copies(G.pt), MQ.n, "copies left queued after done");
    check_events();
}

/* Take the copy queue in random chunks and perform the copies; copies_done
 * after each chunk or once after all (always before the step's K/V writes,
 * the library's rule). */
static void drain_copies(void)
{
    struct kv_block_copy out[4];
    uint32_t got = 99;
    const bool done_each = kvt_range(&G.rng, 0, 1) == 0;
    if (kvt_range(&G.rng, 0, 7) == 0) {
        check_st(kv_page_table_take_copies(G.pt, out, 0, &got), KV_OK, "take_copies cap 0");
        check_eq(got, 0, "copies taken with cap 0");
    }
    while (MQ.n > 0) {
        uint32_t cap = (uint32_t)kvt_range(&G.rng, 1, 3), want = MQ.n < cap ? MQ.n : cap;
        got = 99;
        check_st(kv_page_table_take_copies(G.pt, out, cap, &got), KV_OK, "take_copies");
        CNT.take_calls++;
        check_eq(got, want, "copies taken with cap %u", cap);
        for (uint32_t i = 0; i < got; i++) {
            const struct kv_block_copy *w = &MQ.v[MQ.taken + i];
            if (out[i].src != w->src || out[i].dst != w->dst || out[i].tokens != w->tokens)
                fail_at("copy %u: got {src %u, dst %u, tokens %u}, expected {src %u, dst %u, "
                        "tokens %u}",
                        i, out[i].src, out[i].dst, out[i].tokens, w->src, w->dst, w->tokens);
            /* held until done: never back in the pool mid-batch */
            check_eq(MP.ref[w->src] >= 1 && MP.ref[w->dst] >= 1, 1, "copy %u holds its blocks", i);
        }
        apply_copies(out, got);
        MQ.taken += got;
        MQ.n -= got;
        check_eq(kv_page_table_pending_copies(G.pt), MQ.n, "copies left queued");
        if (done_each)
            copies_done();
    }
    if (MQ.taken)
        copies_done();
}

/* Schedule -> copy blocks -> write K/V, as an engine does it. */
static void finish_step(const struct step *stp)
{
    drain_copies();
    /* a copied partial block holds what its sequence had written there */
    for (uint32_t i = 0; i < stp->nc; i++)
        for (uint32_t j = 0; j < stp->c[i].tokens; j++)
            check_token(stp->c[i].sid, (uint64_t)stp->c[i].bi * N + j, "copy-on-write");
    for (uint32_t i = 0; i < stp->nw; i++) {
        const struct mseq *s = &MS[stp->w[i].sid];
        for (uint64_t t = stp->w[i].from; t < stp->w[i].to; t++) {
            int64_t slot = -1;
            check_st(kv_page_table_slot(G.pt, stp->w[i].sid, t, &slot), KV_OK, "slot");
            check_eq((uint64_t)slot, (uint64_t)s->blk[t / N] * N + t % N,
                     "slot of seq %u token %llu", stp->w[i].sid, (unsigned long long)t);
            write_token(s->blk[t / N], (uint32_t)(t % N), s->ph[t]);
        }
    }
}

/* ------------------------------------------------------------ operations */

static uint64_t pick_extra(void)
{
    int64_t r = kvt_range(&G.rng, 0, 9);
    return r < 8 ? 0 : r == 8 ? 7 : UINT64_MAX;
}

static uint64_t prompt_len(void)
{
    return kvt_range(&G.rng, 0, 1) ? (uint64_t)kvt_range(&G.rng, 1, 64)
                                   : (uint64_t)kvt_range(&G.rng, 65, MAX_PROMPT);
}

static uint64_t append_len(void)
{
    int64_t r = kvt_range(&G.rng, 0, 9);
    if (r < 7)
        return (uint64_t)kvt_range(&G.rng, 1, 4);
    if (r < 9)
        return (uint64_t)kvt_range(&G.rng, 5, 32);
    return (uint64_t)kvt_range(&G.rng, 33, 256);
}

static void op_create(void)
{
    uint32_t sid = 0;
    struct step stp = {0};
    if (MT.live == MAX_SEQS) {
        check_st(kv_page_table_seq_create(G.pt, &sid), KV_ERR_CAPACITY, "create at max_seqs");
        CNT.create_nomem++;
        return;
    }
    check_st(kv_page_table_seq_create(G.pt, &sid), KV_OK, "create");
    ms_create(sid, (uint32_t)kvt_range(&G.rng, 0, NDOC - 1), 0);
    CNT.create++;
    if (kvt_range(&G.rng, 0, 3) == 0) {
        uint64_t extra = pick_extra();
        check_st(kv_page_table_seq_set_extra_key(G.pt, sid, extra), KV_OK, "set_extra_key");
        MS[sid].extra = extra;
    }
    check_seq(sid);
    append_one(&stp, sid, prompt_len());
    finish_step(&stp);
}

static void op_free_seq(uint32_t sid)
{
    const struct mseq *s = &MS[sid];
    uint32_t nb = s->nb;
    uint64_t len;
    memcpy(SAVED, s->blk, (size_t)nb * sizeof(*SAVED));
    check_st(kv_page_table_seq_free(G.pt, sid), KV_OK, "free seq %u", sid);
    m_free(sid);
    check_refs(SAVED, nb);
    check_st(kv_page_table_seq_len(G.pt, sid, &len), KV_ERR_NOT_FOUND, "seq_len after free");
    CNT.frees++;
}

static void op_prefix(void)
{
    const uint32_t doc = (uint32_t)kvt_range(&G.rng, 0, NDOC - 1);
    const uint64_t n = kvt_range(&G.rng, 0, 49) ? prompt_len() : 0; /* an empty prompt too */
    const uint64_t extra = pick_extra();
    const bool two_step = extra != 0 || kvt_range(&G.rng, 0, 3) == 0;
    uint64_t cached = UINT64_MAX;
    uint32_t sid = UINT32_MAX;
    struct step stp = {0};

    for (uint64_t p = 0; p < n; p++)
        G.prompt[p] = doc_tok(doc, p);
    if (MT.live == MAX_SEQS) {
        check_st(two_step ? kv_page_table_seq_create(G.pt, &sid)
                          : kv_page_table_seq_create_from_prefix(G.pt, G.prompt, n, &sid, &cached),
                 KV_ERR_CAPACITY, "create at max_seqs");
        CNT.prefix_nomem++;
        return;
    }
    if (two_step) {
        check_st(kv_page_table_seq_create(G.pt, &sid), KV_OK, "create");
        check_st(kv_page_table_seq_set_extra_key(G.pt, sid, extra), KV_OK, "set_extra_key");
        check_st(kv_page_table_seq_reuse_prefix(G.pt, sid, G.prompt, n, &cached), KV_OK,
                 "reuse_prefix of %llu tokens", (unsigned long long)n);
        CNT.prefix_two_step++;
    } else {
        check_st(kv_page_table_seq_create_from_prefix(G.pt, G.prompt, n, &sid, &cached), KV_OK,
                 "create_from_prefix of %llu tokens", (unsigned long long)n);
    }
    CNT.prefix++;
    ms_create(sid, doc, extra);
    uint32_t found = m_reuse(sid, G.prompt, n);
    check_eq(cached, (uint64_t)found * N,
             "cached tokens of a %llu-token prompt of doc %u, extra key %llu",
             (unsigned long long)n, doc, (unsigned long long)extra);
    check_eq(n ? cached <= (n - 1) / N * N : cached == 0, 1,
             "reuse leaves the last prompt token to compute");
    check_seq(sid);
    check_counters();
    /* the reused blocks hold exactly what this prompt's K/V must be */
    for (uint64_t t = 0; t < cached; t++)
        check_token(sid, t, "reused prefix");
    if (found) {
        CNT.prefix_hit_seqs++;
        CNT.reused_tokens += cached;
    }
    if (kvt_range(&G.rng, 0, 9) == 0) { /* a pure lookup */
        op_free_seq(sid);
        CNT.prefix_probe++;
        return;
    }
    append_one(&stp, sid, n - cached);
    finish_step(&stp);
}

static void op_append(void)
{
    uint32_t k = (uint32_t)kvt_range(&G.rng, 1, MAX_BATCH), sids[MAX_BATCH], m = 0;
    struct step stp = {0};
    if (kvt_range(&G.rng, 0, 1))
        k = 1;
    if (k > MT.live)
        k = MT.live;
    while (m < k) {
        uint32_t sid = pick_live(), dup = 0;
        for (uint32_t i = 0; i < m; i++)
            dup |= sids[i] == sid;
        if (!dup)
            sids[m++] = sid;
    }
    for (uint32_t i = 0; i < k; i++) {
        uint64_t n = append_len(), room = (uint64_t)G.maxb * N - MS[sids[i]].n;
        if (n > room && room > 0 && kvt_range(&G.rng, 0, 1)) /* exactly up to the limit */
            n = room;
        append_one(&stp, sids[i], n);
    }
    finish_step(&stp);
}

static void op_fork(void)
{
    uint32_t parent = pick_live(), child = UINT32_MAX;
    const uint32_t *pb = NULL, *cb = NULL;
    uint32_t pn = 0, cn = 0;
    if (MT.live == MAX_SEQS) {
        check_st(kv_page_table_seq_fork(G.pt, parent, &child), KV_ERR_CAPACITY, "fork at max_seqs");
        CNT.fork_nomem++;
        return;
    }
    check_st(kv_page_table_seq_fork(G.pt, parent, &child), KV_OK, "fork seq %u", parent);
    m_fork(parent, child);
    CNT.forks++;
    /* parent and child lists are identical right after the fork */
    check_st(kv_page_table_seq_blocks(G.pt, parent, &pb, &pn), KV_OK, "seq_blocks");
    check_st(kv_page_table_seq_blocks(G.pt, child, &cb, &cn), KV_OK, "seq_blocks");
    check_eq(cn, pn, "blocks of child %u vs parent %u", child, parent);
    for (uint32_t i = 0; i < pn; i++)
        check_eq(cb[i], pb[i], "child %u block %u vs parent %u", child, i, parent);
    check_seq(parent);
    check_seq(child);
    if (kvt_range(&G.rng, 0, 1))
        MS[child].doc = (uint32_t)kvt_range(&G.rng, 0, NDOC - 1);
}

static void op_truncate(void)
{
    uint32_t sid = pick_live();
    struct mseq *s = &MS[sid];
    uint64_t m;
    int64_t r = kvt_range(&G.rng, 0, 19);
    if (!G.shrink && kvt_range(&G.rng, 0, 1)) /* growing: mostly rollbacks */
        r = 0;
    if (s->n == 0)
        m = 0;
    else if (r < 5)
        m = s->n - (uint64_t)kvt_range(&G.rng, 1, s->n < 8 ? (int64_t)s->n : 8);
    else if (r < 10 && s->ncommit > 0) /* into a sealed block */
        m = (uint64_t)kvt_range(&G.rng, 0, s->ncommit - 1) * N +
            (uint64_t)kvt_range(&G.rng, 1, N - 1);
    else if (r < 13)
        m = (uint64_t)kvt_range(&G.rng, 0, (int64_t)(s->n / N)) * N;
    else if (r < 15)
        m = 0;
    else
        m = (uint64_t)kvt_range(&G.rng, 0, (int64_t)s->n);
    if (m > s->n)
        m = s->n;
    if (m % N != 0 && m / N < s->ncommit)
        CNT.trunc_sealed++;
    uint32_t keep = (uint32_t)((m + N - 1) / N), nrel = s->nb - keep;
    memcpy(SAVED, s->blk + keep, (size_t)nrel * sizeof(*SAVED));
    check_st(kv_page_table_seq_truncate(G.pt, sid, m), KV_OK, "truncate seq %u from %llu to %llu",
             sid, (unsigned long long)s->n, (unsigned long long)m);
    m_truncate(sid, m);
    check_refs(SAVED, nrel);
    check_seq(sid);
    CNT.truncs++;
    if (kvt_range(&G.rng, 0, 2) == 0) /* a different continuation */
        s->doc = (uint32_t)kvt_range(&G.rng, 0, NDOC - 1);
}

/* An append that needs exactly free + cached + delta blocks. */
static void op_edge(void)
{
    uint32_t sid = pick_live();
    const struct mseq *s = &MS[sid];
    struct step stp = {0};
    int64_t target = (int64_t)MP.list_len + kvt_range(&G.rng, -1, 2);
    bool cow = m_cow_due(s);
    int64_t fresh = target - (cow ? 1 : 0);
    uint64_t room = s->n % N ? N - s->n % N : 0, k;
    if (fresh <= 0)
        k = room ? (uint64_t)kvt_range(&G.rng, 1, (int64_t)room) : 1;
    else
        k = room + (uint64_t)(fresh - 1) * N + (uint64_t)kvt_range(&G.rng, 1, N);
    CNT.edge++;
    if (append_one(&stp, sid, k) == KV_ERR_NO_BLOCKS)
        CNT.edge_no_blocks++;
    finish_step(&stp);
}

/* Calls that must fail and change nothing. */
static void op_misuse(void)
{
    uint32_t sid = pick_live(), child, n_out = 9;
    const struct mseq *s = &MS[sid];
    uint64_t len, cached;
    int64_t slot;
    const uint32_t *blocks;
    uint32_t nb;
    struct kv_block_copy cp;
    CNT.misuse++;
    switch (kvt_range(&G.rng, 0, 6)) {
    case 0: { /* a dead or foreign sequence id */
        uint32_t dead = (uint32_t)kvt_range(&G.rng, 0, MAX_SEQS + 3);
        if (dead < MAX_SEQS && MS[dead].live)
            break;
        check_st(kv_page_table_seq_len(G.pt, dead, &len), KV_ERR_NOT_FOUND, "dead seq_len");
        check_st(kv_page_table_seq_blocks(G.pt, dead, &blocks, &nb), KV_ERR_NOT_FOUND,
                 "dead seq_blocks");
        check_st(kv_page_table_seq_append(G.pt, dead, G.scratch, 3), KV_ERR_NOT_FOUND,
                 "dead append");
        check_st(kv_page_table_seq_truncate(G.pt, dead, 0), KV_ERR_NOT_FOUND, "dead truncate");
        check_st(kv_page_table_seq_fork(G.pt, dead, &child), KV_ERR_NOT_FOUND, "dead fork");
        check_st(kv_page_table_seq_free(G.pt, dead), KV_ERR_NOT_FOUND, "dead free");
        check_st(kv_page_table_slot(G.pt, dead, 0, &slot), KV_ERR_NOT_FOUND, "dead slot");
        break;
    }
    case 1:
        check_st(kv_page_table_seq_truncate(G.pt, sid, s->n + (uint64_t)kvt_range(&G.rng, 1, 9)),
                 KV_ERR_INVALID_ARG, "truncate past the end");
        break;
    case 2:
        if (s->n == 0)
            break;
        check_st(kv_page_table_seq_set_extra_key(G.pt, sid, 5), KV_ERR_BAD_STATE,
                 "set_extra_key on a non-empty seq");
        check_st(kv_page_table_seq_reuse_prefix(G.pt, sid, G.prompt, 9, &cached), KV_ERR_BAD_STATE,
                 "reuse_prefix on a non-empty seq");
        break;
    case 3:
        check_st(kv_page_table_slot(G.pt, sid, s->n, &slot), KV_ERR_OUT_OF_BOUNDS,
                 "slot past the end");
        break;
    case 4: { /* past max_blocks_per_seq */
        uint64_t k = (uint64_t)G.maxb * N - s->n + (uint64_t)kvt_range(&G.rng, 1, N);
        check_st(m_append(sid, G.scratch, k), KV_ERR_CAPACITY, "model append past max");
        check_st(kv_page_table_seq_append(G.pt, sid, G.scratch, k), KV_ERR_CAPACITY,
                 "append past max_blocks_per_seq");
        break;
    }
    case 5:
        check_st(kv_page_table_take_copies(G.pt, &cp, 0, &n_out), KV_OK, "take_copies cap 0");
        check_eq(n_out, 0, "copies taken from an empty queue");
        check_st(kv_page_table_take_copies(G.pt, &cp, 1, NULL), KV_ERR_NULL,
                 "take_copies without n_out");
        break;
    default: { /* double release / retain of a block nobody holds */
        uint32_t id = (uint32_t)kvt_range(&G.rng, 1, CAP);
        if (MP.ref[id] != 0)
            break;
        check_st(kv_block_pool_release(G.pool, &id, 1), KV_ERR_BAD_STATE, "release of free %u", id);
        check_st(kv_block_pool_retain(G.pool, &id, 1), KV_ERR_BAD_STATE, "retain of free %u", id);
        id = 0;
        check_st(kv_block_pool_release(G.pool, &id, 1), KV_ERR_INVALID_ARG, "release of null");
        break;
    }
    }
    check_seq(sid);
}

/* ------------------------------------------------------------ driver */

enum op {
    OP_CREATE,
    OP_PREFIX,
    OP_APPEND,
    OP_FORK,
    OP_TRUNCATE,
    OP_FREE,
    OP_EDGE,
    OP_MISUSE,
    OP_N
};

static const char *const OP_NAMES[OP_N] = {"create",   "prefix", "append", "fork",
                                           "truncate", "free",   "edge",   "misuse"};

static enum op pick_op(void)
{
    /*                          create prefix append fork trunc free edge misuse */
    static const int grow[OP_N] = {8, 14, 50, 6, 5, 2, 0, 2};
    static const int shrink[OP_N] = {2, 4, 20, 4, 20, 30, 0, 2};
    int w[OP_N], total = 0;
    if (MT.live == 0)
        return kvt_range(&G.rng, 0, 1) ? OP_CREATE : OP_PREFIX;
    memcpy(w, G.shrink ? shrink : grow, sizeof(w));
    if (MT.live == MAX_SEQS) { /* still try now and then: KV_ERR_CAPACITY */
        w[OP_CREATE] = w[OP_PREFIX] = w[OP_FORK] = 1;
    }
    if (MP.list_len < EDGE_BELOW)
        w[OP_EDGE] = 6;
    for (int i = 0; i < OP_N; i++)
        total += w[i];
    int r = (int)kvt_range(&G.rng, 0, total - 1);
    for (int i = 0; i < OP_N; i++) {
        if (r < w[i])
            return (enum op)i;
        r -= w[i];
    }
    return OP_APPEND;
}

static unsigned long long env_u64(const char *name, unsigned long long dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 0) : dflt;
}

/* One run: the cache under test and the length of the stream. */
struct model_cfg {
    kv_arrange arrange;
    kv_order order;
    int64_t pad_elems;
    uint32_t max_blocks_per_seq; /* 0: num_blocks - 1 */
    uint32_t page_ratio;         /* 0: 1 */
    long n_ops;
    uint64_t seed;
    bool expect_full; /* the stream fills the pool and fails allocations at the boundary */
};

static void model_setup(const struct model_cfg *mc)
{
    struct kv_cache_config cfg;
    uint32_t n = 0;
    static uint32_t order[NB];
    static uint8_t seen[NB];

    kv_cache_config_init(&cfg);
    cfg.layout = (struct kv_layout_config){.struct_size = sizeof(struct kv_layout_config),
                                           .num_layers = L,
                                           .num_blocks = NB,
                                           .block_tokens = N,
                                           .num_heads = H,
                                           .head_dim = D,
                                           .dtype = KV_F32,
                                           .order = mc->order,
                                           .arrange = mc->arrange,
                                           .block_pad_elems = mc->pad_elems};
    cfg.max_seqs = MAX_SEQS;
    cfg.max_blocks_per_seq = mc->max_blocks_per_seq;
    cfg.page_ratio = mc->page_ratio;
    cfg.enable_prefix_caching = true;
    cfg.zero_fill = true;
    cfg.on_event = on_event;
    cfg.event_user = &EV_GOT;
    check_st(kv_cache_create(&cfg, &G.c), KV_OK, "kv_cache_create");
    G.cfg = cfg.layout;
    G.pt = kv_cache_page_table(G.c);
    G.pool = kv_cache_pool(G.c);
    G.lo = kv_cache_layout(G.c);
    G.base = kv_arena_base(kv_cache_arena(G.c));
    assert_non_null(G.base);
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            check_st(kv_cache_kv_view(G.c, l, kv, &G.view[l][kv]), KV_OK, "kv_view");

    /* the model starts from the pool's own initial order: every id once */
    check_st(kv_block_pool_free_list(G.pool, order, NB, &n), KV_OK, "initial free list");
    check_eq(n, CAP, "initial free list length");
    memset(seen, 0, sizeof(seen));
    for (uint32_t i = 0; i < n; i++) {
        if (order[i] == 0 || order[i] >= NB || seen[order[i]])
            fail_at("initial free list entry %u is %u", i, order[i]);
        seen[order[i]] = 1;
    }
    mp_init(order, n);
    memset(&MT, 0, sizeof(MT));
    memset(&MQ, 0, sizeof(MQ));
    memset(CONTENT, 0, sizeof(CONTENT));
    memset(&CNT, 0, sizeof(CNT));
    EV_GOT.n = EV_WANT.n = 0;
    for (int i = 0; i < MAX_SEQS; i++)
        MS[i].live = false;
    G.shrink = false;
    G.phase_no_blocks = 0;
    G.maxb = mc->max_blocks_per_seq ? mc->max_blocks_per_seq : CAP;
    G.r = mc->page_ratio ? mc->page_ratio : 1;
}

static void model_teardown(void)
{
    kv_cache_destroy(G.c); /* with live sequences: no events, no leaks (sanitizers) */
    G.c = NULL;
    check_eq(EV_GOT.n, 0, "events fired by kv_cache_destroy");
    for (int i = 0; i < MAX_SEQS; i++) {
        free(MS[i].tok);
        free(MS[i].ph);
        free(MS[i].blk);
        free(MS[i].bkey);
        free(MS[i].bhash);
        memset(&MS[i], 0, sizeof(MS[i]));
    }
}

static void run_model(const struct model_cfg *mc)
{
    const long n_ops = mc->n_ops;
    long sweep_every = (long)env_u64("KV_MODEL_SWEEP_EVERY", SWEEP_EVERY);
    struct timespec t0, t1;
    char desc[96];

    if (sweep_every <= 0)
        sweep_every = SWEEP_EVERY;
    G.seed = mc->seed;
    G.rng = G.seed;
    G.op = -1;
    G.op_name = "setup";
    docs_init(&G.rng);
    model_setup(mc);
    snprintf(desc, sizeof(desc), "%s %s, pad %lld, max_blocks_per_seq %u, page ratio %u",
             kv_arrange_name(mc->arrange), kv_order_name(mc->order), (long long)mc->pad_elems,
             G.maxb, G.r);
    check_counters();
    clock_gettime(CLOCK_MONOTONIC, &t0);

    for (G.op = 0; G.op < n_ops; G.op++) {
        enum op o = pick_op();
        G.op_name = OP_NAMES[o];
        switch (o) {
        case OP_CREATE:
            op_create();
            break;
        case OP_PREFIX:
            op_prefix();
            break;
        case OP_APPEND:
            op_append();
            break;
        case OP_FORK:
            op_fork();
            break;
        case OP_TRUNCATE:
            op_truncate();
            break;
        case OP_FREE:
            op_free_seq(pick_live());
            break;
        case OP_EDGE:
            op_edge();
            break;
        default:
            op_misuse();
            break;
        }
        check_counters();
        spot_check();
        if ((G.op + 1) % sweep_every == 0)
            sweep();
        /* the controller: grow to the no-blocks boundary, then shrink to half */
        if (!G.shrink && G.phase_no_blocks >= 12) {
            G.shrink = true;
        } else if (G.shrink && MP.n_used < CAP / 2) {
            G.shrink = false;
            G.phase_no_blocks = 0;
            CNT.phases++;
        }
    }

    G.op_name = "final";
    sweep();
    while (MT.live > 8) /* free most, in random order; destroy releases the rest */
        op_free_seq(pick_live());
    check_counters();
    sweep();
    clock_gettime(CLOCK_MONOTONIC, &t1);

    print_message(
        "cache model [%s]: %ld ops in %.2f s (seed %#llx): create %llu (+%llu no-mem), prefix %llu "
        "(two-step %llu, hit %llu, %llu tokens reused, capped %llu, probes %llu, +%llu no-mem), "
        "appends %llu (ok %llu, no-blocks %llu, too long %llu, %llu tokens), forks %llu (+%llu "
        "no-mem), truncates %llu (%llu into sealed), frees %llu, edge %llu (%llu no-blocks), "
        "misuse %llu; cow copies %llu in %llu takes; pool: hits %llu, misses %llu, evictions "
        "%llu, stored %llu, duplicate commits %llu, high water %u, ids used %u of %d; "
        "grow/shrink cycles %llu, sweeps %llu\n",
        desc, n_ops, (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9,
        (unsigned long long)G.seed, (unsigned long long)CNT.create,
        (unsigned long long)CNT.create_nomem, (unsigned long long)CNT.prefix,
        (unsigned long long)CNT.prefix_two_step, (unsigned long long)CNT.prefix_hit_seqs,
        (unsigned long long)CNT.reused_tokens, (unsigned long long)CNT.reuse_capped,
        (unsigned long long)CNT.prefix_probe, (unsigned long long)CNT.prefix_nomem,
        (unsigned long long)CNT.appends, (unsigned long long)CNT.append_ok,
        (unsigned long long)CNT.append_no_blocks, (unsigned long long)CNT.append_too_long,
        (unsigned long long)CNT.tokens, (unsigned long long)CNT.forks,
        (unsigned long long)CNT.fork_nomem, (unsigned long long)CNT.truncs,
        (unsigned long long)CNT.trunc_sealed, (unsigned long long)CNT.frees,
        (unsigned long long)CNT.edge, (unsigned long long)CNT.edge_no_blocks,
        (unsigned long long)CNT.misuse, (unsigned long long)MT.cow,
        (unsigned long long)CNT.take_calls, (unsigned long long)MP.hits,
        (unsigned long long)MP.misses, (unsigned long long)MP.evictions,
        (unsigned long long)MP.stored, (unsigned long long)MP.not_stored, MP.high_water, MP.n_ever,
        CAP, (unsigned long long)CNT.phases, (unsigned long long)CNT.sweeps);

    /* the run exercised what it claims (runs of >= 5,000 ops do) */
    if (n_ops >= 5000) {
        check_eq(MT.cow > 0 && CNT.copies == MT.cow, 1, "copy-on-write copies happened");
        check_eq(CNT.prefix_hit_seqs > 0 && MP.hits > 0, 1, "prefix hits happened");
        check_eq(MP.evictions > 0, 1, "evictions happened");
        check_eq(MP.not_stored > 0, 1, "duplicate commits happened");
        check_eq(CNT.trunc_sealed > 0, 1, "truncates into sealed blocks happened");
        check_eq(MP.n_ever, CAP, "every block id was handed out");
        if (mc->expect_full) {
            check_eq(CNT.append_no_blocks > 0 && CNT.edge_no_blocks > 0, 1,
                     "allocations failed at the boundary");
            check_eq(MP.high_water, CAP, "the pool was filled completely");
        }
        if (G.maxb < CAP)
            check_eq(CNT.append_too_long > 0 && CNT.reuse_capped > 0, 1,
                     "max_blocks_per_seq refused appends and capped reuse");
    }
    model_teardown();
}

/* The 10^6 operations on the default cache: layer-major NHD (a COW
 * copy is 2L runs of one block at the layer stride), no per-sequence limit
 * below the pool, page ratio 1. */
static void test_cache_model_random_ops(void **state)
{
    const struct model_cfg mc = {
        .arrange = KV_ARRANGE_LAYER_MAJOR,
        .order = KV_ORDER_NHD,
        .n_ops = (long)env_u64("KV_MODEL_OPS", MODEL_DEFAULT_OPS),
        .seed = env_u64("KV_MODEL_SEED", MODEL_DEFAULT_SEED),
        .expect_full = true,
    };
    (void)state;
    run_model(&mc);
}

/* A fifth of them on a block-major HND layout with padded blocks (a COW copy
 * is 2L runs at the padded block stride; the whole-arena check covers the
 * padding, which nothing may write), max_blocks_per_seq 250 (below the
 * longest prompts: reuse is capped by it, appends reach it exactly and past
 * it are refused with KV_ERR_CAPACITY) and 2 kernel pages per block in the
 * exports. Sequences share more than they can hold here, so the pool is not
 * always driven to its last block. */
static void test_cache_model_block_major_padded(void **state)
{
    const struct model_cfg mc = {
        .arrange = KV_ARRANGE_BLOCK_MAJOR,
        .order = KV_ORDER_HND,
        .pad_elems = 3,
        .max_blocks_per_seq = 250,
        .page_ratio = 2,
        .n_ops = (long)env_u64("KV_MODEL_OPS", MODEL_DEFAULT_OPS) / 5,
        .seed = env_u64("KV_MODEL_SEED", MODEL_DEFAULT_SEED) + 1,
    };
    (void)state;
    run_model(&mc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_model_random_ops),
        cmocka_unit_test(test_cache_model_block_major_padded),
    };
    return cmocka_run_group_tests_name("cache_model", tests, NULL, NULL);
}
