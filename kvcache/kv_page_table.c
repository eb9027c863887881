/* kv_page_table.c - per-sequence block lists, copy-on-write, prefix reuse
 * and the queries; the vLLM / FlashInfer exports are in
 * kv_page_table_export.c, the state in kv_page_table_int.h. Model:
 * kv_page_table.h and docs/page-table.md. */
#include <assert.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_mem.h"
#include "kv_page_table.h"
#include "kv_lib.h"

#include "kv_page_table_int.h"

/* ---- helpers --------------------------------------------------------------- */

#if defined(KV_DEBUG_CHECKS) && !defined(NDEBUG)
static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}
#endif

static void seq_check(const kv_page_table *pt, const struct kv__seq *s)
{
#ifndef NDEBUG
    if (!s->live)
        return;
    assert(s->n_blocks == (uint32_t)((s->n_tokens + pt->N - 1) / pt->N));
    assert(s->n_committed <= s->n_blocks && s->n_blocks <= s->cap);
    assert(s->n_blocks <= pt->cfg.max_blocks_per_seq);
    assert(pt->prefix || (s->n_committed == 0 && !s->hashes && !s->tokens));
#if defined(KV_DEBUG_CHECKS)
    /* Full check (DEBUG=1 builds): every block is an id the source says is
     * held, and no block appears twice in one sequence (sorted copy). */
    {
        /* plain malloc: a debug check is not one of the library's
         * allocations (test_oom fails those in turn) */
        uint32_t *ids = malloc((size_t)s->n_blocks * sizeof(uint32_t) + 1);
        if (!ids) /* no memory for the check: skip it */
            return;
        for (uint32_t i = 0; i < s->n_blocks; i++) {
            assert(pt->cfg.ops.ref_count(pt->cfg.ops.ctx, s->blocks[i]) >= 1);
            ids[i] = s->blocks[i];
        }
        qsort(ids, s->n_blocks, sizeof(uint32_t), cmp_u32);
        for (uint32_t i = 1; i < s->n_blocks; i++)
            assert(ids[i] != ids[i - 1]);
        free(ids);
    }
#endif
#else
    (void)pt;
    (void)s;
#endif
}

static void note_ids(kv_page_table *pt, const uint32_t *ids, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (!pt->any_block || ids[i] > pt->max_id) {
            pt->max_id = ids[i];
            pt->any_block = true;
        }
}

struct kv__seq *kv__pt_seq_get(const kv_page_table *pt, uint32_t id)
{
    if (id >= pt->cfg.max_seqs || !pt->seqs[id].live)
        return NULL;
    return &pt->seqs[id];
}

static kv_status bad_seq(const char *fn, const kv_page_table *pt, uint32_t id)
{
    if (id >= pt->cfg.max_seqs)
        return kv__error(KV_ERR_NOT_FOUND, "%s: seq %" PRIu32 " >= max_seqs %" PRIu32, fn, id,
                         pt->cfg.max_seqs);
    return kv__error(KV_ERR_NOT_FOUND, "%s: seq %" PRIu32 " is not live", fn, id);
}

/* Grow s's arrays to hold at least need blocks. Changes no logical state. */
static kv_status seq_reserve(kv_page_table *pt, struct kv__seq *s, uint32_t need)
{
    if (s->cap >= need)
        return KV_OK;
    uint64_t ncap = (uint64_t)s->cap * 2;
    if (ncap < 4)
        ncap = 4;
    if (ncap > (uint64_t)pt->cfg.max_blocks_per_seq + 1)
        ncap = (uint64_t)pt->cfg.max_blocks_per_seq + 1;
    if (ncap < need)
        ncap = need;
    uint32_t *nb = kv__mem_alloc(ncap * sizeof(*nb));
    uint64_t *nh = NULL;
    int32_t *nt = NULL;
    if (!nb)
        goto fail;
    if (pt->prefix) {
        nh = kv__mem_alloc(ncap * sizeof(*nh));
        nt = kv__mem_alloc(ncap * pt->N * sizeof(*nt));
        if (!nh || !nt)
            goto fail;
    }
    if (s->cap) {
        memcpy(nb, s->blocks, s->n_blocks * sizeof(*nb));
        if (pt->prefix) {
            memcpy(nh, s->hashes, s->n_blocks * sizeof(*nh));
            memcpy(nt, s->tokens, s->n_tokens * sizeof(*nt));
        }
    }
    kv__mem_free(s->blocks);
    kv__mem_free(s->hashes);
    kv__mem_free(s->tokens);
    s->blocks = nb;
    s->hashes = nh;
    s->tokens = nt;
    s->cap = (uint32_t)ncap;
    return KV_OK;
fail:
    kv__mem_free(nt);
    kv__mem_free(nh);
    kv__mem_free(nb);
    return kv__error(KV_ERR_NO_MEMORY,
                     "kv_page_table: cannot grow a sequence to %" PRIu64 " blocks", ncap);
}

static void seq_free_arrays(struct kv__seq *s)
{
    kv__mem_free(s->blocks);
    kv__mem_free(s->hashes);
    kv__mem_free(s->tokens);
    s->blocks = NULL;
    s->hashes = NULL;
    s->tokens = NULL;
    s->cap = 0;
}

/* References the copy list holds on id (as a src or a dst of a copy not yet
 * done): the copy-on-write test subtracts them, since a block held only by
 * one sequence and by pending copies is that sequence's to write (the
 * copies read or write tokens before its new ones, and run first). */
static uint32_t copy_refs(const kv_page_table *pt, uint32_t id)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < pt->n_copies; i++)
        n += (pt->copies[i].src == id) + (pt->copies[i].dst == id);
    return n;
}

static kv_status copies_reserve(kv_page_table *pt, uint32_t extra)
{
    size_t cap = pt->cap_copies, need = (size_t)pt->n_copies + extra;
    if (need <= cap)
        return KV_OK;
    struct kv_block_copy *nc =
        need > UINT32_MAX ? NULL
                          : kv__mem_grow(pt->copies, &cap, pt->n_copies, need, sizeof(*nc), 16);
    if (!nc)
        return kv__error(KV_ERR_NO_MEMORY,
                         "kv_page_table: cannot grow the copy queue to %zu entries", need);
    pt->copies = nc;
    pt->cap_copies = cap > UINT32_MAX ? UINT32_MAX : (uint32_t)cap;
    return KV_OK;
}

/* Take an id -- the most recently retired one, else the lowest never used --
 * and reset its record (arrays kept). */
static uint32_t id_take(kv_page_table *pt, uint64_t extra_key)
{
    uint32_t id = pt->n_retired ? pt->free_ids[--pt->n_retired] : pt->fresh_id++;
    pt->n_free--;
    struct kv__seq *s = &pt->seqs[id];
    s->n_blocks = 0;
    s->n_committed = 0;
    s->n_tokens = 0;
    s->extra_key = extra_key;
    s->live = true;
    pt->stats.live_seqs++;
    return id;
}

static void id_return(kv_page_table *pt, uint32_t id)
{
    pt->seqs[id].live = false;
    pt->free_ids[pt->n_retired++] = id;
    pt->n_free++;
    pt->stats.live_seqs--;
}

/* ---- lifetime ---------------------------------------------------------------- */

kv_status kv_page_table_create(const struct kv_page_table_config *cfg, kv_page_table **out)
{
    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "kv_page_table_create: %s is NULL", !cfg ? "cfg" : "out");
    kv_status abi = kv__check_struct_size("kv_page_table_create", "kv_page_table_config",
                                          cfg->struct_size, sizeof(*cfg));
    if (abi != KV_OK)
        return abi;
    if (cfg->ops.version != KV_BLOCK_OPS_VERSION)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: block ops version %" PRIu32 " but this library "
                         "speaks version %u (set ops.version = KV_BLOCK_OPS_VERSION, or fill the "
                         "ops with kv_block_pool_ops())",
                         cfg->ops.version, KV_BLOCK_OPS_VERSION);
    uint32_t r = cfg->page_ratio ? cfg->page_ratio : 1;
    if (cfg->block_tokens == 0 || cfg->max_seqs == 0 || cfg->max_blocks_per_seq == 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: block_tokens %" PRIu32 ", max_seqs %" PRIu32
                         ", max_blocks_per_seq %" PRIu32 " must all be >= 1",
                         cfg->block_tokens, cfg->max_seqs, cfg->max_blocks_per_seq);
    if (cfg->max_seqs > KV_PAGE_TABLE_MAX_SEQS)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: max_seqs %" PRIu32
                         " exceeds KV_PAGE_TABLE_MAX_SEQS (%u live sequences)",
                         cfg->max_seqs, KV_PAGE_TABLE_MAX_SEQS);
    if (cfg->max_blocks_per_seq > KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: max_blocks_per_seq %" PRIu32
                         " exceeds KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ (%u)",
                         cfg->max_blocks_per_seq, KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ);
    if (cfg->block_tokens % r != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: block_tokens %" PRIu32
                         " is not divisible by page_ratio %" PRIu32,
                         cfg->block_tokens, r);
    if (!cfg->ops.alloc || !cfg->ops.retain || !cfg->ops.release || !cfg->ops.ref_count)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: block ops need alloc, retain, release and "
                         "ref_count (alloc=%s retain=%s release=%s ref_count=%s)",
                         cfg->ops.alloc ? "set" : "NULL", cfg->ops.retain ? "set" : "NULL",
                         cfg->ops.release ? "set" : "NULL", cfg->ops.ref_count ? "set" : "NULL");
    if (!cfg->ops.hold != !cfg->ops.drop)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: block ops hold (%s) and drop (%s) go together",
                         cfg->ops.hold ? "set" : "NULL", cfg->ops.drop ? "set" : "NULL");
    if (cfg->enable_prefix_caching && (!cfg->ops.match_prefix || !cfg->ops.commit_full))
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_create: prefix caching needs match_prefix (%s) and "
                         "commit_full (%s)",
                         cfg->ops.match_prefix ? "set" : "NULL",
                         cfg->ops.commit_full ? "set" : "NULL");

    kv_page_table *pt = kv__mem_calloc(1, sizeof(*pt));
    if (!pt)
        goto fail_pt;
    pt->seqs = kv__mem_calloc(cfg->max_seqs, sizeof(*pt->seqs));
    if (!pt->seqs)
        goto fail_seqs;
    pt->free_ids = kv__mem_calloc(cfg->max_seqs, sizeof(*pt->free_ids));
    if (!pt->free_ids)
        goto fail_ids;
    pt->cfg = *cfg;
    pt->cfg.page_ratio = r;
    pt->N = cfg->block_tokens;
    pt->r = r;
    pt->page_tokens = cfg->block_tokens / r;
    pt->prefix = cfg->enable_prefix_caching;
    pt->n_free = cfg->max_seqs; /* all fresh: nothing to initialize per id */
    if (pt->cfg.ops.hold)       /* the source lives until this table's destroy */
        pt->cfg.ops.hold(pt->cfg.ops.ctx);
    *out = pt;
    return kv__ok();

fail_ids:
    kv__mem_free(pt->seqs);
fail_seqs:
    kv__mem_free(pt);
fail_pt:
    return kv__error(KV_ERR_NO_MEMORY, "kv_page_table_create: no memory for %" PRIu32 " sequences",
                     cfg->max_seqs);
}

/* Release blocks[from..n) of s last-to-first: the pool puts each block that
 * reaches ref 0 at the tail of its LRU list, so releasing the tail of a
 * sequence first leaves its prefix (the blocks most worth keeping cached)
 * the last to be evicted. The array is restored if the release fails. */
static void reverse_ids(uint32_t *ids, uint32_t n)
{
    for (uint32_t i = 0, j = n ? n - 1 : 0; i < j; i++, j--) {
        uint32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
}

static kv_status release_tail(kv_page_table *pt, struct kv__seq *s, uint32_t from)
{
    uint32_t n = s->n_blocks - from;
    kv_status st;
    reverse_ids(s->blocks + from, n);
    st = pt->cfg.ops.release(pt->cfg.ops.ctx, s->blocks + from, n);
    if (st != KV_OK)
        reverse_ids(s->blocks + from, n);
    return st;
}

/* Release the holds of copies [0, n) and drop them from the list: src then
 * dst of each, oldest copy first, in one call to the block source. */
static kv_status copies_release(kv_page_table *pt, uint32_t n)
{
    uint32_t ids[64];
    for (uint32_t done = 0; done < n;) {
        uint32_t k = 0;
        for (; done + k < n && 2 * k + 1 < 64; k++) {
            ids[2 * k] = pt->copies[done + k].src;
            ids[2 * k + 1] = pt->copies[done + k].dst;
        }
        kv__error_clear();
        kv_status st = pt->cfg.ops.release(pt->cfg.ops.ctx, ids, 2 * k);
        if (st != KV_OK) {
            /* drop what was released; the rest stays held and listed */
            memmove(pt->copies, pt->copies + done, (pt->n_copies - done) * sizeof(*pt->copies));
            pt->n_copies -= done;
            pt->n_taken -= done < pt->n_taken ? done : pt->n_taken;
            return st;
        }
        done += k;
    }
    memmove(pt->copies, pt->copies + n, (pt->n_copies - n) * sizeof(*pt->copies));
    pt->n_copies -= n;
    pt->n_taken -= n < pt->n_taken ? n : pt->n_taken;
    return KV_OK;
}

void kv_page_table_destroy(kv_page_table *pt)
{
    if (!pt)
        return;
    if (pt->owned) {
        (void)kv__error(KV_ERR_BAD_STATE, "kv_page_table_destroy: the page table of a kv_cache "
                                          "(kv_cache_page_table): kv_cache_destroy frees it; "
                                          "nothing freed");
        return;
    }
    kv__page_table_free(pt);
}

void kv__page_table_set_owned(kv_page_table *pt)
{
    pt->owned = true;
}

void kv__page_table_free(kv_page_table *pt)
{
    if (!pt)
        return;
    for (uint32_t i = 0; i < pt->fresh_id; i++) { /* ids past fresh_id were never used */
        struct kv__seq *s = &pt->seqs[i];
        if (s->live && s->n_blocks)
            (void)release_tail(pt, s, 0);
        seq_free_arrays(s);
    }
    if (pt->n_copies) {
        kv_status st = copies_release(pt, pt->n_copies);
        (void)st; /* the source refused: nothing more a destroy can do */
    }
    if (pt->cfg.ops.drop) /* after the last release: the source may go with it */
        pt->cfg.ops.drop(pt->cfg.ops.ctx);
    kv__mem_free(pt->copies);
    kv__mem_free(pt->free_ids);
    kv__mem_free(pt->seqs);
    kv__mem_free(pt);
}

/* ---- sequences ----------------------------------------------------------------- */

kv_status kv_page_table_seq_create(kv_page_table *pt, uint32_t *seq_out)
{
    if (!pt || !seq_out)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_create: %s is NULL",
                         !pt ? "pt" : "seq_out");
    if (pt->n_free == 0)
        return kv__error(KV_ERR_CAPACITY,
                         "kv_page_table_seq_create: all %" PRIu32 " sequences (max_seqs) are live",
                         pt->cfg.max_seqs);
    *seq_out = id_take(pt, pt->cfg.extra_key);
    return kv__ok();
}

kv_status kv_page_table_seq_set_extra_key(kv_page_table *pt, uint32_t seq, uint64_t extra_key)
{
    if (!pt)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_set_extra_key: pt is NULL");
    struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_seq_set_extra_key", pt, seq);
    if (s->n_tokens != 0)
        return kv__error(KV_ERR_BAD_STATE,
                         "kv_page_table_seq_set_extra_key: seq %" PRIu32 " has %" PRIu64
                         " tokens; the key can only be set while empty",
                         seq, s->n_tokens);
    s->extra_key = extra_key;
    return kv__ok();
}

kv_status kv_page_table_seq_reuse_prefix(kv_page_table *pt, uint32_t seq, const int32_t *tokens,
                                         uint64_t n_tokens, uint64_t *cached_tokens)
{
    if (!pt || !cached_tokens)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_reuse_prefix: %s is NULL",
                         !pt ? "pt" : "cached_tokens");
    struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_seq_reuse_prefix", pt, seq);
    if (s->n_tokens != 0)
        return kv__error(KV_ERR_BAD_STATE,
                         "kv_page_table_seq_reuse_prefix: seq %" PRIu32 " already has %" PRIu64
                         " tokens",
                         seq, s->n_tokens);
    if (n_tokens > 0 && !tokens)
        return kv__error(KV_ERR_NULL,
                         "kv_page_table_seq_reuse_prefix: tokens is NULL with n_tokens %" PRIu64,
                         n_tokens);
    /* vLLM's rule: the last prompt token is always computed */
    uint64_t max_reuse = n_tokens ? (n_tokens - 1) / pt->N : 0;
    if (max_reuse > pt->cfg.max_blocks_per_seq)
        max_reuse = pt->cfg.max_blocks_per_seq;
    if (!pt->prefix || max_reuse == 0) {
        *cached_tokens = 0;
        return kv__ok();
    }
    kv_status st = seq_reserve(pt, s, (uint32_t)max_reuse);
    if (st != KV_OK)
        return st;
    uint32_t found = 0;
    kv__error_clear(); /* a user's source may record no detail */
    st = pt->cfg.ops.match_prefix(pt->cfg.ops.ctx, tokens, max_reuse * pt->N, pt->N, s->extra_key,
                                  s->blocks, s->hashes, (uint32_t)max_reuse, &found);
    if (st != KV_OK)
        return kv__error_wrap(
            st, "kv_page_table_seq_reuse_prefix: match_prefix over %" PRIu64 " blocks failed (%s)",
            max_reuse, kv_status_name(st));
    if (found > max_reuse) {
        (void)pt->cfg.ops.release(pt->cfg.ops.ctx, s->blocks, found);
        return kv__error(KV_ERR_INTERNAL,
                         "kv_page_table_seq_reuse_prefix: match_prefix returned %" PRIu32
                         " blocks > max %" PRIu64,
                         found, max_reuse);
    }
    note_ids(pt, s->blocks, found);
    memcpy(s->tokens, tokens, (size_t)found * pt->N * sizeof(*tokens));
    s->n_blocks = found;
    s->n_committed = found;
    s->n_tokens = (uint64_t)found * pt->N;
    pt->stats.reused_blocks += found;
    pt->stats.held_blocks += found;
    *cached_tokens = s->n_tokens;
    seq_check(pt, s);
    return kv__ok();
}

kv_status kv_page_table_seq_create_from_prefix(kv_page_table *pt, const int32_t *tokens,
                                               uint64_t n_tokens, uint32_t *seq_out,
                                               uint64_t *cached_tokens)
{
    uint32_t id;
    kv_status st = kv_page_table_seq_create(pt, &id);
    if (st != KV_OK)
        return st;
    uint64_t cached = 0;
    if (!seq_out) {
        st = kv__error(KV_ERR_NULL, "kv_page_table_seq_create_from_prefix: seq_out is NULL");
        goto fail_reuse;
    }
    st = kv_page_table_seq_reuse_prefix(pt, id, tokens, n_tokens,
                                        cached_tokens ? cached_tokens : &cached);
    if (st != KV_OK)
        goto fail_reuse;
    *seq_out = id;
    return kv__ok();

fail_reuse:
    id_return(pt, id);
    return st;
}

/*
 * What appending n tokens to s takes: total blocks after, new blocks, and
 * whether the partial last block must be copied first (it is shared or
 * sealed). KV_ERR_CAPACITY past max_blocks_per_seq. Shared by append and
 * kv_page_table_blocks_needed so the two can never disagree.
 */
static kv_status append_plan(const char *fn, const kv_page_table *pt, uint32_t seq,
                             const struct kv__seq *s, uint64_t n, uint32_t *total_blocks,
                             uint32_t *need, bool *cow)
{
    const uint64_t N = pt->N, old = s->n_tokens;
    const uint64_t max_tokens = (uint64_t)pt->cfg.max_blocks_per_seq * N;
    if (n > max_tokens || old + n > max_tokens)
        return kv__error(KV_ERR_CAPACITY,
                         "%s: seq %" PRIu32 " with %" PRIu64 " + %" PRIu64
                         " tokens needs more than max_blocks_per_seq %" PRIu32 " blocks of %" PRIu64
                         " tokens",
                         fn, seq, old, n, pt->cfg.max_blocks_per_seq, N);
    *total_blocks = (uint32_t)((old + n + N - 1) / N);
    *need = *total_blocks - s->n_blocks;
    *cow = false;
    if (n > 0 && old % N != 0) {
        uint32_t last = s->n_blocks - 1;
        const uint32_t id = s->blocks[last];
        *cow = last < s->n_committed ||
               pt->cfg.ops.ref_count(pt->cfg.ops.ctx, id) - copy_refs(pt, id) > 1;
    }
    return KV_OK;
}

kv_status kv_page_table_blocks_needed(const kv_page_table *pt, uint32_t seq, uint64_t n,
                                      uint32_t *blocks)
{
    uint32_t total, need;
    bool cow;
    if (!pt || !blocks)
        return kv__error(KV_ERR_NULL, "kv_page_table_blocks_needed: %s is NULL",
                         !pt ? "pt" : "blocks");
    const struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_blocks_needed", pt, seq);
    kv_status st = append_plan("kv_page_table_blocks_needed", pt, seq, s, n, &total, &need, &cow);
    if (st != KV_OK)
        return st;
    *blocks = need + (cow ? 1 : 0);
    return kv__ok();
}

kv_status kv_page_table_seq_append(kv_page_table *pt, uint32_t seq, const int32_t *tokens,
                                   uint64_t n)
{
    if (!pt)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_append: pt is NULL");
    struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_seq_append", pt, seq);
    if (n == 0)
        return kv__ok();
    if (pt->prefix && !tokens)
        return kv__error(
            KV_ERR_NULL,
            "kv_page_table_seq_append: tokens is NULL (n %" PRIu64 ") with prefix caching on", n);
    const uint64_t N = pt->N, old = s->n_tokens;
    const uint64_t new_len = old + n;
    uint32_t total_blocks, need;
    bool cow;
    kv_status st =
        append_plan("kv_page_table_seq_append", pt, seq, s, n, &total_blocks, &need, &cow);
    if (st != KV_OK)
        return st;
    uint32_t last = s->n_blocks - 1;
    /* The copy holds its src and dst until done (kv_page_table_copies_done),
     * so neither can return to the pool and be handed out again while a
     * batch of copies runs at once. A src that is itself the dst of a copy
     * still queued is read from that copy's src instead: no copy of a batch
     * reads a block another copy of the batch writes. One taken and not yet
     * done is refused: it may have run and its dst been written since (its
     * src would then be stale), or not (its dst not yet written); only
     * kv_page_table_copies_done tells the two apart. */
    uint32_t last_id = cow ? s->blocks[last] : 0, src = last_id;
    if (cow) {
        for (uint32_t i = 0; i < pt->n_taken; i++)
            if (pt->copies[i].dst == last_id)
                return kv__error(KV_ERR_BAD_STATE,
                                 "kv_page_table_seq_append: seq %" PRIu32 "'s last block %" PRIu32
                                 " is the dst of a copy taken and not yet done (%" PRIu32
                                 " taken): call kv_page_table_copies_done once the taken copies "
                                 "ran, then append",
                                 seq, last_id, pt->n_taken);
        for (uint32_t i = pt->n_copies; i-- > pt->n_taken;)
            if (pt->copies[i].dst == src) {
                src = pt->copies[i].src;
                break;
            }
    }

    st = seq_reserve(pt, s, total_blocks + (cow ? 1 : 0));
    if (st != KV_OK)
        return st;
    if (cow && (st = copies_reserve(pt, 1)) != KV_OK)
        return st;
    /* the src's hold first: a refusal then changes nothing, before the
     * allocation below may have evicted a cached block */
    if (cow) {
        kv__error_clear();
        if ((st = pt->cfg.ops.retain(pt->cfg.ops.ctx, &src, 1)) != KV_OK)
            return kv__error_wrap(st,
                                  "kv_page_table_seq_append: holding block %" PRIu32
                                  " as the src of a copy-on-write failed",
                                  src);
    }

    uint32_t *fresh = s->blocks + s->n_blocks; /* need new ids, then the private copy */
    uint32_t n_alloc = need + (cow ? 1 : 0);
    if (n_alloc) {
        kv__error_clear(); /* a user's source may record no detail */
        st = pt->cfg.ops.alloc(pt->cfg.ops.ctx, n_alloc, fresh);
        if (st != KV_OK) {
            if (cow) {
                kv_status undo = pt->cfg.ops.release(pt->cfg.ops.ctx, &src, 1);
                (void)undo;
            }
            return kv__error_wrap(st,
                                  "kv_page_table_seq_append: seq %" PRIu32 " needs %" PRIu32
                                  " blocks (%" PRIu32 " new + %d copy-on-write) for %" PRIu64
                                  " + %" PRIu64 " tokens",
                                  seq, n_alloc, need, cow ? 1 : 0, old, n);
        }
    }
    if (cow) {
        uint32_t dst = fresh[need];
        kv__error_clear();
        st = pt->cfg.ops.retain(pt->cfg.ops.ctx, &dst, 1);
        if (st == KV_OK) {
            st = pt->cfg.ops.release(pt->cfg.ops.ctx, &last_id,
                                     1); /* the sequence's ref moves to dst */
            if (st != KV_OK) {
                kv_status undo = pt->cfg.ops.release(pt->cfg.ops.ctx, &dst, 1);
                (void)undo;
            }
        }
        if (st != KV_OK) {
            kv_status undo = pt->cfg.ops.release(pt->cfg.ops.ctx, fresh, n_alloc);
            (void)undo;
            undo = pt->cfg.ops.release(pt->cfg.ops.ctx, &src, 1);
            (void)undo;
            return kv__error_wrap(st,
                                  "kv_page_table_seq_append: holding blocks %" PRIu32 " -> %" PRIu32
                                  " for copy-on-write failed",
                                  src, dst);
        }
        pt->copies[pt->n_copies++] =
            (struct kv_block_copy){.src = src, .dst = dst, .tokens = (uint32_t)(old % N)};
        s->blocks[last] = dst;
        if (last < s->n_committed)
            s->n_committed = last;
        pt->stats.cow_copies++;
    }
    note_ids(pt, fresh, n_alloc);
    if (pt->prefix)
        memcpy(s->tokens + old, tokens, n * sizeof(*tokens));
    s->n_blocks = total_blocks;
    s->n_tokens = new_len;
    pt->stats.held_blocks += need;

    /* seal blocks that are now full, in order, each chained to its parent */
    while (pt->prefix && s->n_committed < new_len / N) {
        uint32_t i = s->n_committed;
        uint64_t parent = i ? s->hashes[i - 1] : KV_PAGE_TABLE_ROOT_HASH, h = 0;
        st = pt->cfg.ops.commit_full(pt->cfg.ops.ctx, s->blocks[i], parent,
                                     s->tokens + (uint64_t)i * N, (uint32_t)N, s->extra_key, &h);
        if (st != KV_OK) {
            pt->stats.commit_failures++;
            break; /* retried by the next append */
        }
        s->hashes[i] = h;
        s->n_committed++;
        pt->stats.committed++;
    }
    seq_check(pt, s);
    return kv__ok();
}

kv_status kv_page_table_seq_fork(kv_page_table *pt, uint32_t parent, uint32_t *child_out)
{
    if (!pt || !child_out)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_fork: %s is NULL",
                         !pt ? "pt" : "child_out");
    struct kv__seq *p = kv__pt_seq_get(pt, parent);
    if (!p)
        return bad_seq("kv_page_table_seq_fork", pt, parent);
    if (pt->n_free == 0)
        return kv__error(KV_ERR_CAPACITY,
                         "kv_page_table_seq_fork: all %" PRIu32 " sequences (max_seqs) are live",
                         pt->cfg.max_seqs);
    uint32_t id = id_take(pt, p->extra_key);
    struct kv__seq *c = &pt->seqs[id];
    kv_status st = seq_reserve(pt, c, p->n_blocks);
    if (st != KV_OK)
        goto fail_reserve;
    if (p->n_blocks) {
        kv__error_clear();
        st = pt->cfg.ops.retain(pt->cfg.ops.ctx, p->blocks, p->n_blocks);
        if (st != KV_OK) {
            st = kv__error_wrap(st,
                                "kv_page_table_seq_fork: retaining %" PRIu32
                                " blocks of seq %" PRIu32 " failed",
                                p->n_blocks, parent);
            goto fail_reserve;
        }
        memcpy(c->blocks, p->blocks, p->n_blocks * sizeof(*c->blocks));
        if (pt->prefix) {
            memcpy(c->hashes, p->hashes, p->n_blocks * sizeof(*c->hashes));
            memcpy(c->tokens, p->tokens, p->n_tokens * sizeof(*c->tokens));
        }
    }
    c->n_blocks = p->n_blocks;
    c->n_committed = p->n_committed;
    c->n_tokens = p->n_tokens;
    pt->stats.held_blocks += p->n_blocks;
    seq_check(pt, c);
    *child_out = id;
    return kv__ok();

fail_reserve:
    id_return(pt, id);
    return st;
}

kv_status kv_page_table_seq_truncate(kv_page_table *pt, uint32_t seq, uint64_t n_tokens)
{
    if (!pt)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_truncate: pt is NULL");
    struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_seq_truncate", pt, seq);
    if (n_tokens > s->n_tokens)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_page_table_seq_truncate: seq %" PRIu32 " to %" PRIu64
                         " tokens > its length %" PRIu64,
                         seq, n_tokens, s->n_tokens);
    uint32_t keep = (uint32_t)((n_tokens + pt->N - 1) / pt->N);
    if (keep < s->n_blocks) {
        kv__error_clear();
        kv_status st = release_tail(pt, s, keep);
        if (st != KV_OK)
            return kv__error_wrap(st,
                                  "kv_page_table_seq_truncate: releasing %" PRIu32
                                  " blocks of seq %" PRIu32 " failed",
                                  s->n_blocks - keep, seq);
        pt->stats.held_blocks -= s->n_blocks - keep;
    }
    s->n_blocks = keep;
    s->n_tokens = n_tokens;
    if (s->n_committed > keep)
        s->n_committed = keep; /* a sealed block made partial stays sealed */
    seq_check(pt, s);
    return kv__ok();
}

kv_status kv_page_table_seq_free(kv_page_table *pt, uint32_t seq)
{
    if (!pt)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_free: pt is NULL");
    struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_seq_free", pt, seq);
    if (s->n_blocks) {
        kv__error_clear();
        kv_status st = release_tail(pt, s, 0);
        if (st != KV_OK)
            return kv__error_wrap(st,
                                  "kv_page_table_seq_free: releasing %" PRIu32
                                  " blocks of seq %" PRIu32 " failed",
                                  s->n_blocks, seq);
        pt->stats.held_blocks -= s->n_blocks;
    }
    s->n_blocks = 0;
    s->n_tokens = 0;
    s->n_committed = 0;
    id_return(pt, seq);
    return kv__ok();
}

/* ---- queries ----------------------------------------------------------------- */

kv_status kv_page_table_seq_len(const kv_page_table *pt, uint32_t seq, uint64_t *n_tokens)
{
    if (!pt || !n_tokens)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_len: %s is NULL", !pt ? "pt" : "n_tokens");
    const struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_seq_len", pt, seq);
    *n_tokens = s->n_tokens;
    return kv__ok();
}

kv_status kv_page_table_seq_blocks(const kv_page_table *pt, uint32_t seq, const uint32_t **blocks,
                                   uint32_t *n_blocks)
{
    if (!pt || !blocks || !n_blocks)
        return kv__error(KV_ERR_NULL, "kv_page_table_seq_blocks: %s is NULL",
                         !pt       ? "pt"
                         : !blocks ? "blocks"
                                   : "n_blocks");
    const struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_seq_blocks", pt, seq);
    *blocks = s->blocks;
    *n_blocks = s->n_blocks;
    return kv__ok();
}

kv_status kv_page_table_slot(const kv_page_table *pt, uint32_t seq, uint64_t t, int64_t *slot)
{
    if (!pt || !slot)
        return kv__error(KV_ERR_NULL, "kv_page_table_slot: %s is NULL", !pt ? "pt" : "slot");
    const struct kv__seq *s = kv__pt_seq_get(pt, seq);
    if (!s)
        return bad_seq("kv_page_table_slot", pt, seq);
    if (t >= s->n_tokens)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_page_table_slot: token %" PRIu64 " >= length %" PRIu64
                         " of seq %" PRIu32,
                         t, s->n_tokens, seq);
    const uint32_t b = s->blocks[t / pt->N];
    int64_t base;
    if (!kv__mul_i64((int64_t)b, (int64_t)pt->N, &base) ||
        !kv__add_i64(base, (int64_t)(t % pt->N), slot))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_page_table_slot: block %" PRIu32 " * %" PRIu32 " tokens + %" PRIu64
                         " exceeds int64 (seq %" PRIu32 " token %" PRIu64 ")",
                         b, pt->N, t % pt->N, seq, t);
    return kv__ok();
}

uint32_t kv_page_table_pending_copies(const kv_page_table *pt)
{
    return pt ? pt->n_copies - pt->n_taken : 0;
}

kv_status kv_page_table_take_copies(kv_page_table *pt, struct kv_block_copy *out, uint32_t cap,
                                    uint32_t *n_out)
{
    if (!pt || !n_out || (!out && cap))
        return kv__error(KV_ERR_NULL, "kv_page_table_take_copies: %s is NULL",
                         !pt      ? "pt"
                         : !n_out ? "n_out"
                                  : "out");
    uint32_t queued = pt->n_copies - pt->n_taken;
    uint32_t n = queued < cap ? queued : cap;
    if (n) {
        memcpy(out, pt->copies + pt->n_taken, n * sizeof(*out));
        pt->n_taken += n; /* still held until copies_done */
    }
    *n_out = n;
    return kv__ok();
}

kv_status kv_page_table_copies_done(kv_page_table *pt)
{
    if (!pt)
        return kv__error(KV_ERR_NULL, "kv_page_table_copies_done: pt is NULL");
    if (pt->n_taken == 0)
        return kv__ok();
    const uint32_t n = pt->n_taken;
    kv_status st = copies_release(pt, n);
    if (st != KV_OK)
        return kv__error_wrap(
            st, "kv_page_table_copies_done: releasing the blocks of %" PRIu32 " copies failed", n);
    return kv__ok();
}

void kv_page_table_stats_get(const kv_page_table *pt, struct kv_page_table_stats *out)
{
    if (!out)
        return;
    if (!pt) { /* zeros, as documented: not whatever the caller's struct held */
        memset(out, 0, sizeof(*out));
        return;
    }
    *out = pt->stats;
    out->copies_held = pt->n_copies;
}
