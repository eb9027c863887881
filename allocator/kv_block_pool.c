/* kv_block_pool.c - block records, the intrusive free/LRU list, ref counts and
 * the prefix-hash table. See kv_block_pool.h for the model. */
#include <assert.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack, no allocation */
#include <xxhash.h>

#include "allocator_int.h"
#include "kv_block_pool.h"
#include "kv_mem.h"
#include "kv_lib.h"
#include "kv_wire.h"

#define KV__NIL UINT32_MAX        /* no link: the block is not on the free list */
#define KV__BLOCK_HASHED 0x1u     /* kv__block.hash is valid and in the table */
#define KV__MATCH_CHUNK 32        /* blocks hashed per mutex acquisition in match_prefix */
#define KV__HASH_STACK_TOKENS 256 /* one-shot XXH3 up to this many tokens per block */

/*
 * One record per block id, 32 bytes. Links are ids; the list sentinel is the
 * extra record at index num_blocks (its next = head, prev = tail).
 *
 * The free list is the fresh range [fresh, num_blocks) -- ids never handed
 * out, in id order -- followed by the linked list of released ids. It is the
 * list an eager build (every id pushed at create) would hold, because every
 * release goes to the tail: so create touches no record (records come from
 * lazily zeroed pages) and costs O(1) whatever num_blocks is.
 *
 * Invariants (ids 1 .. num_blocks-1; kv__block_pool_check verifies them):
 *   id >= fresh                    =>   record all zero (never used)
 *   id <  fresh: ref > 0           <=>  prev == next == KV__NIL (off the list)
 *   ref == 0 && (flags & HASHED)   <=>  cached
 *   (flags & HASHED)               <=>  table[hash] == id
 *   pending == 0                        between calls (batch validation scratch)
 * The null block (id 0) has ref 0, no hash, and is never on the list.
 */
struct kv__block {
    uint64_t hash;    /* chained prefix hash, valid with KV__BLOCK_HASHED */
    uint32_t prev;    /* free list: previous id (toward the head) or KV__NIL */
    uint32_t next;    /* free list: next id (toward the tail) or KV__NIL */
    uint32_t ref;     /* holders */
    uint32_t flags;   /* KV__BLOCK_* */
    uint32_t pending; /* occurrences in the batch being validated */
    uint32_t pad;
};
_Static_assert(sizeof(struct kv__block) == 32, "block record is half a cache line");

/* Open-addressing slot (linear probing, backward-shift deletion). id 0 = empty
 * (the null block never carries a hash). */
struct kv__slot {
    uint64_t hash;
    uint32_t id;
    uint32_t pad;
};

/*
 * Counters (all under mu):
 *   n_free + n_used + n_cached == capacity == num_blocks - 1
 *   n_list == n_free + n_cached               (length of the free list,
 *                                              fresh range included)
 *   n_hashed == entries in the table == n_cached + (used blocks with a hash)
 *   used_high_water >= n_used
 *   table_mask + 1 >= 2 * num_blocks          (load factor <= 1/2)
 */
struct kv_block_pool {
    pthread_mutex_t mu;       /* guards everything below */
    struct kv__block *blocks; /* [num_blocks + 1]; the last one is the list sentinel */
    struct kv__slot *table;   /* [table_mask + 1] */
    uint64_t table_mask;
    unsigned table_shift; /* 64 - log2(table size) */
    uint32_t num_blocks;
    uint32_t capacity;
    uint32_t fresh;  /* first never-used id: [fresh, num_blocks) heads the free list */
    uint32_t n_list; /* (num_blocks - fresh) + linked ids */
    uint32_t n_used;
    uint32_t n_cached;
    uint32_t n_hashed;
    uint32_t used_high_water;
    uint64_t hits, misses, evictions, stored;
    bool check_full;
    kv_block_event_fn on_event;
    void *event_user;
    uint32_t n_users; /* page tables over it (kv_block_ops hold/drop) */
    bool destroyed;   /* kv_block_pool_destroy ran: freed by the last drop */
    bool owned;       /* a kv_cache's part: kv_block_pool_destroy refuses it */
};

/* ---------------------------------------------------------------- hashing */

/* tokens as little-endian int32: a plain copy on little-endian hosts. */
static void put_tokens(unsigned char *p, const int32_t *tokens, uint32_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, tokens, (size_t)n * 4);
#else
    for (uint32_t i = 0; i < n; i++)
        kv__le_put32(p + (size_t)i * 4, (uint32_t)tokens[i]);
#endif
}

uint64_t kv_block_hash(uint64_t parent_hash, const int32_t *tokens, uint32_t n_tokens,
                       uint64_t extra_key)
{
    enum { HDR = 8 + 8 + 4 };
    unsigned char buf[HDR + 4 * KV__HASH_STACK_TOKENS];

    kv__le_put64(buf, parent_hash);
    kv__le_put64(buf + 8, extra_key);
    kv__le_put32(buf + 16, n_tokens);
    if (n_tokens <= KV__HASH_STACK_TOKENS) {
        if (n_tokens)
            put_tokens(buf + HDR, tokens, n_tokens);
        return XXH3_64bits(buf, HDR + (size_t)n_tokens * 4);
    }
    /* Same bytes, streamed in pieces: equal to the one-shot hash. */
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, buf, HDR);
    for (uint32_t done = 0; done < n_tokens;) {
        uint32_t k =
            n_tokens - done < KV__HASH_STACK_TOKENS ? n_tokens - done : KV__HASH_STACK_TOKENS;
        put_tokens(buf, tokens + done, k);
        XXH3_64bits_update(&st, buf, (size_t)k * 4);
        done += k;
    }
    return XXH3_64bits_digest(&st);
}

/* ------------------------------------------------------------ hash table */

static inline uint64_t table_home(const kv_block_pool *p, uint64_t hash)
{
    /* Fibonacci mix: callers may commit hashes that are not uniform. */
    return (hash * 0x9E3779B97F4A7C15ull) >> p->table_shift;
}

/* Slot index holding hash, or UINT64_MAX when absent. */
static inline uint64_t table_find(const kv_block_pool *p, uint64_t hash)
{
    uint64_t i = table_home(p, hash);
    for (;;) {
        const struct kv__slot *s = &p->table[i];
        if (s->id == 0)
            return UINT64_MAX;
        if (s->hash == hash)
            return i;
        i = (i + 1) & p->table_mask;
    }
}

/* hash must be absent; the table never fills (load <= 1/2). */
static void table_insert(kv_block_pool *p, uint64_t hash, uint32_t id)
{
    uint64_t i = table_home(p, hash);
    while (p->table[i].id != 0)
        i = (i + 1) & p->table_mask;
    p->table[i].hash = hash;
    p->table[i].id = id;
}

/* Remove slot i, shifting later members of its probe run back. */
static void table_remove_at(kv_block_pool *p, uint64_t i)
{
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & p->table_mask;
        if (p->table[j].id == 0)
            break;
        uint64_t k = table_home(p, p->table[j].hash);
        /* Entry j may stay iff its home k lies cyclically in (i, j]. */
        bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays)
            continue;
        p->table[i] = p->table[j];
        i = j;
    }
    p->table[i].id = 0;
    p->table[i].hash = 0;
}

/* ------------------------------------------------------------- free list */

static inline uint32_t sentinel(const kv_block_pool *p)
{
    return p->num_blocks;
}

static inline void list_push_tail(kv_block_pool *p, uint32_t id)
{
    struct kv__block *s = &p->blocks[sentinel(p)];
    struct kv__block *b = &p->blocks[id];
    b->next = sentinel(p);
    b->prev = s->prev;
    p->blocks[s->prev].next = id;
    s->prev = id;
    p->n_list++;
}

static inline void list_unlink(kv_block_pool *p, uint32_t id)
{
    struct kv__block *b = &p->blocks[id];
    p->blocks[b->prev].next = b->next;
    p->blocks[b->next].prev = b->prev;
    b->prev = b->next = KV__NIL;
    p->n_list--;
}

/* ------------------------------------------------------------ invariants */

static inline void fire(kv_block_pool *p, kv_block_event ev, uint64_t hash, uint32_t id)
{
    if (p->on_event)
        p->on_event(p->event_user, ev, hash, id);
}

/* The full check; mutex held. Only failure touches the last error. */
static kv_status check_locked(kv_block_pool *p)
{
    const uint32_t s = sentinel(p);
    uint32_t n_free = 0, n_used = 0, n_cached = 0, n_hashed = 0, n_slots = 0;
    uint32_t n_list = 0, prev = s;

    if (p->n_list - p->n_cached + p->n_used + p->n_cached != p->capacity || p->n_cached > p->n_list)
        return kv__error(KV_ERR_INTERNAL,
                         "kv_block_pool: free %u + used %u + cached %u != capacity %u",
                         p->n_list - p->n_cached, p->n_used, p->n_cached, p->capacity);
    if (p->used_high_water < p->n_used)
        return kv__error(KV_ERR_INTERNAL, "kv_block_pool: high water %u < used %u",
                         p->used_high_water, p->n_used);

    /* Walk the list: links consistent, members have ref 0, length matches. */
    if (p->fresh < 1 || p->fresh > p->num_blocks)
        return kv__error(KV_ERR_INTERNAL, "kv_block_pool: fresh %u outside [1, %u]", p->fresh,
                         p->num_blocks);
    n_list = p->num_blocks - p->fresh;
    for (uint32_t id = p->blocks[s].next; id != s; id = p->blocks[id].next) {
        if (id == 0 || id >= p->fresh || n_list > p->capacity)
            return kv__error(KV_ERR_INTERNAL,
                             "kv_block_pool: free list corrupt at id %u (after %u)", id, prev);
        if (p->blocks[id].prev != prev)
            return kv__error(KV_ERR_INTERNAL, "kv_block_pool: id %u prev %u != %u", id,
                             p->blocks[id].prev, prev);
        if (p->blocks[id].ref != 0)
            return kv__error(KV_ERR_INTERNAL, "kv_block_pool: id %u on the free list with ref %u",
                             id, p->blocks[id].ref);
        prev = id;
        n_list++;
    }
    if (p->blocks[s].prev != prev || n_list != p->n_list)
        return kv__error(KV_ERR_INTERNAL,
                         "kv_block_pool: free list length %u != n_list %u (tail %u)", n_list,
                         p->n_list, p->blocks[s].prev);

    /* Every record: ref > 0 <=> off the list; hashed <=> in the table. */
    if (p->blocks[0].ref || p->blocks[0].flags || p->blocks[0].prev != KV__NIL)
        return kv__error(KV_ERR_INTERNAL, "kv_block_pool: null block 0 was touched");
    for (uint32_t id = 1; id < p->num_blocks; id++) {
        const struct kv__block *b = &p->blocks[id];
        if (id >= p->fresh) {
            if (b->hash || b->prev || b->next || b->ref || b->flags || b->pending)
                return kv__error(KV_ERR_INTERNAL,
                                 "kv_block_pool: never-used id %u (fresh %u) has a record", id,
                                 p->fresh);
            n_free++;
            continue;
        }
        bool on_list = b->prev != KV__NIL;
        if ((b->ref > 0) == on_list || (on_list != (b->next != KV__NIL)))
            return kv__error(KV_ERR_INTERNAL, "kv_block_pool: id %u ref %u but on_list %d", id,
                             b->ref, (int)on_list);
        if (b->pending)
            return kv__error(KV_ERR_INTERNAL, "kv_block_pool: id %u pending %u between calls", id,
                             b->pending);
        if (b->flags & KV__BLOCK_HASHED) {
            uint64_t i = table_find(p, b->hash);
            n_hashed++;
            if (i == UINT64_MAX || p->table[i].id != id)
                return kv__error(KV_ERR_INTERNAL,
                                 "kv_block_pool: id %u carries hash 0x%016llx not mapped to it", id,
                                 (unsigned long long)b->hash);
        }
        if (b->ref > 0)
            n_used++;
        else if (b->flags & KV__BLOCK_HASHED)
            n_cached++;
        else
            n_free++;
    }
    for (uint64_t i = 0; i <= p->table_mask; i++) {
        const struct kv__slot *sl = &p->table[i];
        if (sl->id == 0)
            continue;
        n_slots++;
        if (sl->id >= p->num_blocks || !(p->blocks[sl->id].flags & KV__BLOCK_HASHED) ||
            p->blocks[sl->id].hash != sl->hash)
            return kv__error(KV_ERR_INTERNAL,
                             "kv_block_pool: table hash 0x%016llx maps to id %u which does not "
                             "carry it",
                             (unsigned long long)sl->hash, sl->id);
    }
    if (n_used != p->n_used || n_cached != p->n_cached || n_free != p->n_list - p->n_cached ||
        n_hashed != p->n_hashed || n_slots != n_hashed)
        return kv__error(KV_ERR_INTERNAL,
                         "kv_block_pool: counted free %u used %u cached %u hashed %u slots %u; "
                         "counters free %u used %u cached %u hashed %u",
                         n_free, n_used, n_cached, n_hashed, n_slots, p->n_list - p->n_cached,
                         p->n_used, p->n_cached, p->n_hashed);
    return KV_OK;
}

/* After every mutating operation, mutex held: the O(1) equations always (in
 * builds without NDEBUG), the full walk when enabled. A failure is a bug in
 * this file: abort with the message. */
static inline void debug_check(kv_block_pool *p)
{
#ifndef NDEBUG
    assert(p->n_list - p->n_cached + p->n_used + p->n_cached == p->capacity);
    assert(p->n_cached <= p->n_list && p->n_cached <= p->n_hashed);
    assert(p->used_high_water >= p->n_used);
    if (p->check_full && check_locked(p) != KV_OK) {
        fprintf(stderr, "kvcache: %s\n", kv_last_error());
        abort();
    }
#else
    (void)p;
#endif
}

kv_status kv__block_pool_check(kv_block_pool *pool)
{
    kv_status s;
    if (!pool)
        return kv__error(KV_ERR_NULL, "kv_block_pool_check: pool is NULL");
    pthread_mutex_lock(&pool->mu);
    s = check_locked(pool);
    pthread_mutex_unlock(&pool->mu);
    return s;
}

/* ------------------------------------------------------------ create */

/* The environment's KV_DEBUG_CHECKS: on for 1 true yes on, off when unset,
 * empty or 0 false no off (any case); any other value is refused, named,
 * not read as one or the other. */
static kv_status debug_env(bool *on)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    const char *env = getenv("KV_DEBUG_CHECKS");
    *on = false;
    if (!env || !env[0])
        return KV_OK;
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
        if (strcasecmp(env, yes[i]) == 0) {
            *on = true;
            return KV_OK;
        }
        if (strcasecmp(env, no[i]) == 0)
            return KV_OK;
    }
    return kv__error(KV_ERR_INVALID_ARG,
                     "kv_block_pool_create: the environment's KV_DEBUG_CHECKS='%.40s' is none of "
                     "1 true yes on (checks on), 0 false no off",
                     env);
}

kv_status kv_block_pool_create(const struct kv_block_pool_config *cfg, kv_block_pool **out)
{
    kv_block_pool *p;
    pthread_mutexattr_t attr;
    uint64_t slots = 1;
    unsigned bits = 0;
    kv_status s;
    bool env_checks = false;

    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "kv_block_pool_create: %s is NULL", !cfg ? "cfg" : "out");
    if ((s = debug_env(&env_checks)) != KV_OK)
        return s;
    s = kv__check_struct_size("kv_block_pool_create", "kv_block_pool_config", cfg->struct_size,
                              sizeof(*cfg));
    if (s != KV_OK)
        return s;
    if (cfg->num_blocks < 2 || cfg->num_blocks > KV_BLOCK_POOL_MAX_BLOCKS)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_block_pool_create: num_blocks %u outside [2, %u] (block 0 is the "
                         "reserved null block)",
                         cfg->num_blocks, KV_BLOCK_POOL_MAX_BLOCKS);
    if (cfg->flags & ~KV_BLOCK_POOL_CHECK_FULL)
        return kv__error(KV_ERR_INVALID_ARG, "kv_block_pool_create: unknown flags 0x%x",
                         cfg->flags & ~KV_BLOCK_POOL_CHECK_FULL);
    while (slots < 2 * (uint64_t)cfg->num_blocks) {
        slots <<= 1;
        bits++;
    }

    p = kv__mem_calloc(1, sizeof(*p));
    if (!p) {
        s = kv__error(KV_ERR_NO_MEMORY, "kv_block_pool_create: handle allocation failed");
        goto fail;
    }
    p->blocks = kv__mem_calloc((size_t)cfg->num_blocks + 1, sizeof(*p->blocks));
    if (!p->blocks) {
        s = kv__error(KV_ERR_NO_MEMORY, "kv_block_pool_create: %u block records (%zu bytes)",
                      cfg->num_blocks, ((size_t)cfg->num_blocks + 1) * sizeof(*p->blocks));
        goto free_pool;
    }
    p->table = kv__mem_calloc((size_t)slots, sizeof(*p->table));
    if (!p->table) {
        s = kv__error(KV_ERR_NO_MEMORY, "kv_block_pool_create: hash table of %llu slots",
                      (unsigned long long)slots);
        goto free_blocks;
    }
    pthread_mutexattr_init(&attr);
#if defined(PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP)
    /* Spin briefly before sleeping: critical sections are tens of ns. */
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
#endif
    if (pthread_mutex_init(&p->mu, &attr) != 0) {
        pthread_mutexattr_destroy(&attr);
        s = kv__error(KV_ERR_INTERNAL, "kv_block_pool_create: pthread_mutex_init failed");
        goto free_table;
    }
    pthread_mutexattr_destroy(&attr);

    p->table_mask = slots - 1;
    p->table_shift = 64 - bits;
    p->num_blocks = cfg->num_blocks;
    p->capacity = cfg->num_blocks - 1;
    p->on_event = cfg->on_event;
    p->event_user = cfg->event_user;
    p->check_full = (cfg->flags & KV_BLOCK_POOL_CHECK_FULL) || env_checks;
#if defined(KV_DEBUG_CHECKS)
    p->check_full = true;
#endif
    if (bits == 0) /* slots == 1 cannot happen (num_blocks >= 2), but keep shift < 64 */
        p->table_shift = 63;

    /* Null block: ref 0, off the list, never touched. Ids 1.. in order: the
     * fresh range, nothing linked yet. */
    p->blocks[0].prev = p->blocks[0].next = KV__NIL;
    p->blocks[sentinel(p)].prev = p->blocks[sentinel(p)].next = sentinel(p);
    p->fresh = 1;
    p->n_list = p->capacity;
    debug_check(p);
    *out = p;
    return kv__ok();

free_table:
    kv__mem_free(p->table);
free_blocks:
    kv__mem_free(p->blocks);
free_pool:
    kv__mem_free(p);
fail:
    return s;
}

static void pool_free(kv_block_pool *pool)
{
    pthread_mutex_destroy(&pool->mu);
    kv__mem_free(pool->table);
    kv__mem_free(pool->blocks);
    kv__mem_free(pool);
}

static void pool_destroy(kv_block_pool *pool)
{
    pthread_mutex_lock(&pool->mu);
    pool->destroyed = true;
    const bool last = pool->n_users == 0;
    pthread_mutex_unlock(&pool->mu);
    if (last)
        pool_free(pool);
}

void kv_block_pool_destroy(kv_block_pool *pool)
{
    if (!pool)
        return;
    if (pool->owned) {
        (void)kv__error(KV_ERR_BAD_STATE, "kv_block_pool_destroy: the pool of a kv_cache "
                                          "(kv_cache_pool): kv_cache_destroy frees it; nothing "
                                          "freed");
        return;
    }
    pool_destroy(pool);
}

void kv__block_pool_set_owned(kv_block_pool *pool)
{
    pool->owned = true;
}

void kv__block_pool_free(kv_block_pool *pool)
{
    if (pool)
        pool_destroy(pool);
}

/* ------------------------------------------------------------ alloc/free */

/* A caller's array of n elements of size bytes, read or written as words:
 * misaligned is undefined behaviour, refused by name (an empty one is never
 * touched). */
static kv_status check_array(const char *fn, const char *name, const void *p, uint32_t n,
                             size_t size)
{
    return n > 0 ? kv__check_aligned(fn, name, p, size) : KV_OK;
}

kv_status kv_block_pool_alloc(kv_block_pool *pool, uint32_t n, uint32_t *ids)
{
    if (!pool || (!ids && n > 0))
        return kv__error(KV_ERR_NULL, "kv_block_pool_alloc: %s is NULL", !pool ? "pool" : "ids");
    if (n == 0)
        return kv__ok();
    kv_status st = check_array("kv_block_pool_alloc", "ids", ids, n, sizeof(*ids));
    if (st != KV_OK)
        return st;

    pthread_mutex_lock(&pool->mu);
    if (n > pool->n_list) {
        uint32_t avail = pool->n_list, cached = pool->n_cached;
        pthread_mutex_unlock(&pool->mu);
        return kv__error(KV_ERR_NO_BLOCKS,
                         "kv_block_pool_alloc: requested %u blocks, %u available (%u free + %u "
                         "cached) of capacity %u",
                         n, avail, avail - cached, cached, pool->capacity);
    }
    const uint32_t s = sentinel(pool);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id;
        struct kv__block *b;
        if (pool->fresh < pool->num_blocks) { /* the head of the list: never used */
            id = pool->fresh++;
            b = &pool->blocks[id];
            b->prev = b->next = KV__NIL;
            pool->n_list--;
        } else {
            id = pool->blocks[s].next;
            b = &pool->blocks[id];
            list_unlink(pool, id);
        }
        if (b->flags & KV__BLOCK_HASHED) {
            /* Lazy eviction of the least recently released cached block. */
            table_remove_at(pool, table_find(pool, b->hash));
            b->flags &= ~KV__BLOCK_HASHED;
            pool->n_cached--;
            pool->n_hashed--;
            pool->evictions++;
            fire(pool, KV_BLOCK_REMOVED, b->hash, id);
        }
        b->ref = 1;
        ids[i] = id;
    }
    pool->n_used += n;
    if (pool->n_used > pool->used_high_water)
        pool->used_high_water = pool->n_used;
    debug_check(pool);
    pthread_mutex_unlock(&pool->mu);
    return kv__ok();
}

/* Undo the pending counts of ids[0, upto) after a failed validation. */
static void clear_pending(kv_block_pool *p, const uint32_t *ids, uint32_t upto)
{
    for (uint32_t i = 0; i < upto; i++)
        p->blocks[ids[i]].pending = 0;
}

/* Mutex held. The batch is valid for a release (dec) or retain (!dec) as a
 * whole; pending counts are left at 0. */
static kv_status validate_batch(kv_block_pool *p, const uint32_t *ids, uint32_t n, bool dec,
                                const char *what)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = ids[i];
        if (id == KV_BLOCK_NULL || id >= p->num_blocks) {
            clear_pending(p, ids, i);
            if (id == KV_BLOCK_NULL)
                return kv__error(KV_ERR_INVALID_ARG,
                                 "kv_block_pool_%s: ids[%u] = 0 is the reserved null block", what,
                                 i);
            return kv__error(KV_ERR_INVALID_ARG,
                             "kv_block_pool_%s: ids[%u] = %u is not a block of this pool (ids 1 .. "
                             "%u)",
                             what, i, id, p->num_blocks - 1);
        }
        struct kv__block *b = &p->blocks[id];
        if (dec && b->pending == b->ref) {
            uint32_t times = b->pending + 1, ref = b->ref;
            clear_pending(p, ids, i);
            if (ref == 0)
                return kv__error(KV_ERR_BAD_STATE,
                                 "kv_block_pool_release: double free: ids[%u] = %u has ref 0 (%s)",
                                 i, id, (b->flags & KV__BLOCK_HASHED) ? "cached" : "free");
            return kv__error(KV_ERR_BAD_STATE,
                             "kv_block_pool_release: ids[%u] = %u released %u times in this batch "
                             "but its ref count is %u",
                             i, id, times, ref);
        }
        if (!dec && b->ref == 0) {
            clear_pending(p, ids, i);
            return kv__error(KV_ERR_BAD_STATE,
                             "kv_block_pool_retain: ids[%u] = %u is not held (ref 0, %s)", i, id,
                             (b->flags & KV__BLOCK_HASHED) ? "cached" : "free");
        }
        if (!dec && (uint64_t)b->ref + b->pending + 1 > UINT32_MAX) {
            uint32_t ref = b->ref;
            clear_pending(p, ids, i);
            return kv__error(KV_ERR_OVERFLOW,
                             "kv_block_pool_retain: ids[%u] = %u ref count %u would overflow", i,
                             id, ref);
        }
        b->pending++;
    }
    clear_pending(p, ids, n);
    return KV_OK;
}

kv_status kv_block_pool_retain(kv_block_pool *pool, const uint32_t *ids, uint32_t n)
{
    kv_status s;
    if (!pool || (!ids && n > 0))
        return kv__error(KV_ERR_NULL, "kv_block_pool_retain: %s is NULL", !pool ? "pool" : "ids");
    if ((s = check_array("kv_block_pool_retain", "ids", ids, n, sizeof(*ids))) != KV_OK)
        return s;
    pthread_mutex_lock(&pool->mu);
    s = validate_batch(pool, ids, n, false, "retain");
    if (s == KV_OK)
        for (uint32_t i = 0; i < n; i++)
            pool->blocks[ids[i]].ref++;
    debug_check(pool);
    pthread_mutex_unlock(&pool->mu);
    return s == KV_OK ? kv__ok() : s;
}

kv_status kv_block_pool_release(kv_block_pool *pool, const uint32_t *ids, uint32_t n)
{
    kv_status s;
    if (!pool || (!ids && n > 0))
        return kv__error(KV_ERR_NULL, "kv_block_pool_release: %s is NULL", !pool ? "pool" : "ids");
    if ((s = check_array("kv_block_pool_release", "ids", ids, n, sizeof(*ids))) != KV_OK)
        return s;
    pthread_mutex_lock(&pool->mu);
    if (n == 1) {
        /* Fast path for the common single release: same checks, no scratch. */
        uint32_t id = ids[0];
        if (id != KV_BLOCK_NULL && id < pool->num_blocks && pool->blocks[id].ref > 0)
            s = KV_OK;
        else
            s = validate_batch(pool, ids, n, true, "release");
    } else {
        s = validate_batch(pool, ids, n, true, "release");
    }
    if (s == KV_OK) {
        for (uint32_t i = 0; i < n; i++) {
            struct kv__block *b = &pool->blocks[ids[i]];
            if (--b->ref == 0) {
                list_push_tail(pool, ids[i]);
                pool->n_used--;
                if (b->flags & KV__BLOCK_HASHED)
                    pool->n_cached++;
            }
        }
    }
    debug_check(pool);
    pthread_mutex_unlock(&pool->mu);
    return s == KV_OK ? kv__ok() : s;
}

uint32_t kv_block_pool_ref_count(kv_block_pool *pool, uint32_t id)
{
    uint32_t ref;
    if (!pool || id == KV_BLOCK_NULL || id >= pool->num_blocks)
        return 0;
    pthread_mutex_lock(&pool->mu);
    ref = pool->blocks[id].ref;
    pthread_mutex_unlock(&pool->mu);
    return ref;
}

/* ------------------------------------------------------------ prefix cache */

kv_status kv_block_pool_commit_hash(kv_block_pool *pool, uint32_t id, uint64_t hash, bool *stored)
{
    struct kv__block *b;
    if (!pool)
        return kv__error(KV_ERR_NULL, "kv_block_pool_commit: pool is NULL");
    if (id == KV_BLOCK_NULL || id >= pool->num_blocks)
        return kv__error(KV_ERR_INVALID_ARG, "kv_block_pool_commit: id %u is %s (ids 1 .. %u)", id,
                         id == KV_BLOCK_NULL ? "the reserved null block" : "not in this pool",
                         pool->num_blocks - 1);
    pthread_mutex_lock(&pool->mu);
    b = &pool->blocks[id];
    if (b->ref == 0) {
        pthread_mutex_unlock(&pool->mu);
        return kv__error(KV_ERR_BAD_STATE, "kv_block_pool_commit: id %u is not held (ref 0)", id);
    }
    if (b->flags & KV__BLOCK_HASHED) {
        uint64_t have = b->hash;
        pthread_mutex_unlock(&pool->mu);
        if (have != hash)
            return kv__error(KV_ERR_BAD_STATE,
                             "kv_block_pool_commit: id %u already carries hash 0x%016llx, not "
                             "0x%016llx",
                             id, (unsigned long long)have, (unsigned long long)hash);
        if (stored)
            *stored = true;
        return kv__ok();
    }
    bool fresh = table_find(pool, hash) == UINT64_MAX;
    if (fresh) {
        table_insert(pool, hash, id);
        b->hash = hash;
        b->flags |= KV__BLOCK_HASHED;
        pool->n_hashed++;
        pool->stored++;
        fire(pool, KV_BLOCK_STORED, hash, id);
    }
    debug_check(pool);
    pthread_mutex_unlock(&pool->mu);
    if (stored)
        *stored = fresh;
    return kv__ok();
}

kv_status kv_block_pool_commit_full(kv_block_pool *pool, uint32_t id, uint64_t parent_hash,
                                    const int32_t *tokens, uint32_t n_tokens, uint64_t extra_key,
                                    uint64_t *hash_out)
{
    uint64_t h;
    kv_status s;
    if (!pool || !tokens)
        return kv__error(KV_ERR_NULL, "kv_block_pool_commit_full: %s is NULL",
                         !pool ? "pool" : "tokens");
    if (n_tokens == 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_block_pool_commit_full: id %u with n_tokens 0",
                         id);
    h = kv_block_hash(parent_hash, tokens, n_tokens, extra_key);
    s = kv_block_pool_commit_hash(pool, id, h, NULL);
    if (s == KV_OK && hash_out)
        *hash_out = h;
    return s;
}

/* Mutex held. Retain the longest found prefix of hashes[n]; extra_misses are
 * blocks beyond this chunk the caller will not look up if this chunk misses. */
static uint32_t lookup_locked(kv_block_pool *p, const uint64_t *hashes, uint32_t n, uint32_t *ids,
                              uint64_t extra_misses)
{
    uint32_t found = 0;
    for (; found < n; found++) {
        uint64_t i = table_find(p, hashes[found]);
        if (i == UINT64_MAX)
            break;
        uint32_t id = p->table[i].id;
        struct kv__block *b = &p->blocks[id];
        if (b->ref == UINT32_MAX)
            break; /* cannot retain once more: a shorter prefix is still a valid answer */
        if (b->ref++ == 0) {
            list_unlink(p, id);
            p->n_cached--;
            p->n_used++;
        }
        ids[found] = id;
    }
    if (p->n_used > p->used_high_water)
        p->used_high_water = p->n_used;
    p->hits += found;
    if (found < n)
        p->misses += (n - found) + extra_misses;
    debug_check(p);
    return found;
}

kv_status kv_block_pool_lookup(kv_block_pool *pool, const uint64_t *hashes, uint32_t n,
                               uint32_t *ids, uint32_t *n_found)
{
    if (!pool || !n_found || (n > 0 && (!hashes || !ids)))
        return kv__error(KV_ERR_NULL, "kv_block_pool_lookup: %s is NULL",
                         !pool      ? "pool"
                         : !n_found ? "n_found"
                         : !hashes  ? "hashes"
                                    : "ids");
    kv_status st;
    if ((st = check_array("kv_block_pool_lookup", "hashes", hashes, n, sizeof(*hashes))) != KV_OK ||
        (st = check_array("kv_block_pool_lookup", "ids", ids, n, sizeof(*ids))) != KV_OK)
        return st;
    *n_found = 0;
    if (n == 0)
        return kv__ok();
    pthread_mutex_lock(&pool->mu);
    *n_found = lookup_locked(pool, hashes, n, ids, 0);
    pthread_mutex_unlock(&pool->mu);
    return kv__ok();
}

kv_status kv_block_pool_match_prefix(kv_block_pool *pool, const int32_t *tokens, uint64_t n_tokens,
                                     uint32_t block_tokens, uint64_t extra_key, uint32_t *ids,
                                     uint64_t *hashes, uint32_t max_blocks, uint32_t *n_found)
{
    uint64_t chunk[KV__MATCH_CHUNK];
    uint64_t parent = KV_BLOCK_HASH_ROOT;
    uint32_t want, done = 0;

    if (!pool || !n_found)
        return kv__error(KV_ERR_NULL, "kv_block_pool_match_prefix: %s is NULL",
                         !pool ? "pool" : "n_found");
    if (block_tokens == 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_block_pool_match_prefix: block_tokens is 0");
    want = n_tokens / block_tokens < max_blocks ? (uint32_t)(n_tokens / block_tokens) : max_blocks;
    if (want > 0 && (!tokens || !ids))
        return kv__error(KV_ERR_NULL, "kv_block_pool_match_prefix: %s is NULL with %u full blocks",
                         !tokens ? "tokens" : "ids", want);
    kv_status st;
    if ((st = check_array("kv_block_pool_match_prefix", "ids", ids, want, sizeof(*ids))) != KV_OK ||
        (st = check_array("kv_block_pool_match_prefix", "hashes", hashes, want, sizeof(*hashes))) !=
            KV_OK)
        return st;
    *n_found = 0;
    while (done < want) {
        uint32_t k = want - done < KV__MATCH_CHUNK ? want - done : KV__MATCH_CHUNK;
        for (uint32_t j = 0; j < k; j++) {
            const int32_t *t = tokens + (uint64_t)(done + j) * block_tokens;
            parent = kv_block_hash(parent, t, block_tokens, extra_key);
            chunk[j] = parent;
        }
        pthread_mutex_lock(&pool->mu);
        uint32_t got = lookup_locked(pool, chunk, k, ids + done, want - done - k);
        pthread_mutex_unlock(&pool->mu);
        if (hashes)
            memcpy(hashes + done, chunk, (size_t)got * sizeof(*chunk));
        done += got;
        if (got < k)
            break;
    }
    *n_found = done;
    return kv__ok();
}

kv_status kv_block_pool_block_hash(kv_block_pool *pool, uint32_t id, uint64_t *hash)
{
    kv_status s = KV_OK;
    if (!pool || !hash)
        return kv__error(KV_ERR_NULL, "kv_block_pool_block_hash: %s is NULL",
                         !pool ? "pool" : "hash");
    if (id == KV_BLOCK_NULL || id >= pool->num_blocks)
        return kv__error(KV_ERR_INVALID_ARG, "kv_block_pool_block_hash: id %u is %s (ids 1 .. %u)",
                         id, id == KV_BLOCK_NULL ? "the reserved null block" : "not in this pool",
                         pool->num_blocks - 1);
    pthread_mutex_lock(&pool->mu);
    if (pool->blocks[id].flags & KV__BLOCK_HASHED)
        *hash = pool->blocks[id].hash;
    else
        s = KV_ERR_NOT_FOUND;
    pthread_mutex_unlock(&pool->mu);
    if (s != KV_OK)
        return kv__error(s, "kv_block_pool_block_hash: id %u carries no hash", id);
    return kv__ok();
}

/* ------------------------------------------------------------ introspection */

kv_status kv_block_pool_free_list(kv_block_pool *pool, uint32_t *ids, uint32_t cap, uint32_t *n)
{
    uint32_t len, i = 0;
    if (!pool || !n || (!ids && cap > 0))
        return kv__error(KV_ERR_NULL, "kv_block_pool_free_list: %s is NULL",
                         !pool ? "pool"
                         : !n  ? "n"
                               : "ids");
    const kv_status st = check_array("kv_block_pool_free_list", "ids", ids, cap, sizeof(*ids));
    if (st != KV_OK)
        return st;
    pthread_mutex_lock(&pool->mu);
    len = pool->n_list;
    *n = len;
    if (cap < len) {
        pthread_mutex_unlock(&pool->mu);
        if (!ids)
            return kv__ok();
        return kv__error(KV_ERR_INVALID_ARG, "kv_block_pool_free_list: cap %u < list length %u",
                         cap, len);
    }
    for (uint32_t id = pool->fresh; id < pool->num_blocks; id++)
        ids[i++] = id;
    for (uint32_t id = pool->blocks[sentinel(pool)].next; id != sentinel(pool);
         id = pool->blocks[id].next)
        ids[i++] = id;
    pthread_mutex_unlock(&pool->mu);
    return kv__ok();
}

void kv_block_pool_stats_get(kv_block_pool *pool, struct kv_block_pool_stats *out)
{
    if (!pool || !out)
        return;
    pthread_mutex_lock(&pool->mu);
    *out = (struct kv_block_pool_stats){
        .capacity = pool->capacity,
        .free_blocks = pool->n_list - pool->n_cached,
        .used_blocks = pool->n_used,
        .cached_blocks = pool->n_cached,
        .used_high_water = pool->used_high_water,
        .hashed_blocks = pool->n_hashed,
        .hits = pool->hits,
        .misses = pool->misses,
        .evictions = pool->evictions,
        .stored = pool->stored,
    };
    pthread_mutex_unlock(&pool->mu);
}

/* ------------------------------------------------------------ ops seam */

static kv_status ops_alloc(void *ctx, uint32_t n, uint32_t *ids)
{
    return kv_block_pool_alloc(ctx, n, ids);
}

static kv_status ops_retain(void *ctx, const uint32_t *ids, uint32_t n)
{
    return kv_block_pool_retain(ctx, ids, n);
}

static kv_status ops_release(void *ctx, const uint32_t *ids, uint32_t n)
{
    return kv_block_pool_release(ctx, ids, n);
}

static uint32_t ops_ref_count(void *ctx, uint32_t id)
{
    return kv_block_pool_ref_count(ctx, id);
}

static kv_status ops_match_prefix(void *ctx, const int32_t *tokens, uint64_t n_tokens,
                                  uint32_t block_tokens, uint64_t extra_key, uint32_t *ids,
                                  uint64_t *hashes, uint32_t max_blocks, uint32_t *n_found)
{
    return kv_block_pool_match_prefix(ctx, tokens, n_tokens, block_tokens, extra_key, ids, hashes,
                                      max_blocks, n_found);
}

static kv_status ops_commit_full(void *ctx, uint32_t id, uint64_t parent_hash,
                                 const int32_t *tokens, uint32_t n_tokens, uint64_t extra_key,
                                 uint64_t *hash_out)
{
    return kv_block_pool_commit_full(ctx, id, parent_hash, tokens, n_tokens, extra_key, hash_out);
}

static void ops_hold(void *ctx)
{
    kv_block_pool *pool = ctx;
    pthread_mutex_lock(&pool->mu);
    pool->n_users++;
    pthread_mutex_unlock(&pool->mu);
}

static void ops_drop(void *ctx)
{
    kv_block_pool *pool = ctx;
    pthread_mutex_lock(&pool->mu);
    const bool last = --pool->n_users == 0 && pool->destroyed;
    pthread_mutex_unlock(&pool->mu);
    if (last) /* the pool's destroy ran: this user kept it */
        pool_free(pool);
}

kv_status kv_block_pool_ops(kv_block_pool *pool, struct kv_block_ops *out)
{
    if (!pool || !out)
        return kv__error(KV_ERR_NULL, "kv_block_pool_ops: %s is NULL", !pool ? "pool" : "out");
    *out = (struct kv_block_ops){
        .version = KV_BLOCK_OPS_VERSION,
        .ctx = pool,
        .alloc = ops_alloc,
        .retain = ops_retain,
        .release = ops_release,
        .ref_count = ops_ref_count,
        .match_prefix = ops_match_prefix,
        .commit_full = ops_commit_full,
        .hold = ops_hold,
        .drop = ops_drop,
    };
    return kv__ok();
}
