/*
 * test_oom.c - allocation failure injection (the SQLite "malloc failure"
 * technique): every kv__mem_* allocation a call makes on the calling thread
 * is made to fail in turn (kv__mem_fail_after(k), k = 0, 1, 2, ...), until
 * the call makes no allocation that fails. Each failed call must answer
 * KV_ERR_NO_MEMORY (or a status its header documents for it) with a
 * message, and leave everything observable as it was (all or nothing);
 * outputs set only on success stay untouched. Leaks are caught by the
 * sanitizer build (ASan's leak checker).
 *
 * The injection is thread-local: allocations made by a worker thread (the
 * offload tier's copies) are not failed, only the posting thread's.
 */
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
#include "kv_mem.h"
#include "kvtest.h"
#include "kv_xport_int.h"
#include "kvt_side.h"
#include "kvt_oom.h"
#include "kvt_oom_post.h"
#include "kvt_oom_xport.h"
#include "kvt_xport.h"

/* ---- a small cache ----------------------------------------------------------------- */

#define NB 17u /* blocks, the null block included */
#define NT 4u  /* tokens per block */

static void cache_cfg(struct kv_cache_config *cfg)
{
    kv_cache_config_init(cfg);
    cfg->layout.num_layers = 2;
    cfg->layout.num_blocks = NB;
    cfg->layout.block_tokens = NT;
    cfg->layout.num_heads = 2;
    cfg->layout.head_dim = 8;
    cfg->layout.dtype = KV_F32;
    cfg->mem_kind = KV_MEM_HOST;
    cfg->max_seqs = 8;
    cfg->max_blocks_per_seq = 8;
    cfg->page_ratio = 2;
    cfg->enable_prefix_caching = true;
    cfg->zero_fill = true;
    cfg->head_offset = 2;
}

static kv_cache *mk_cache(void)
{
    struct kv_cache_config cfg;
    cache_cfg(&cfg);
    kv_cache *c = NULL;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    return c;
}

static int32_t g_tokens[64];

static void tokens_init(void)
{
    for (int i = 0; i < 64; i++)
        g_tokens[i] = 1000 + 7 * i;
}

/* ---- create ------------------------------------------------------------------------ */

struct create_ctx {
    void *out;
};

static kv_status call_arena(void *p)
{
    struct create_ctx *x = p;
    struct kv_arena_config cfg = KV_ARENA_CONFIG_INIT(1u << 16);
    cfg.flags = KV_ARENA_ZERO;
    return kv_arena_create(&cfg, (kv_arena **)&x->out);
}
static void ok_arena(void *p)
{
    struct create_ctx *x = p;
    assert_true(kv_arena_size(x->out) >= (1u << 16));
    kv_arena_destroy(x->out);
    x->out = SENTINEL;
}
static void failed_out(void *p)
{
    struct create_ctx *x = p;
    assert_ptr_equal(x->out, SENTINEL); /* set only on success */
}

static kv_status call_pool(void *p)
{
    struct create_ctx *x = p;
    struct kv_block_pool_config cfg = KV_BLOCK_POOL_CONFIG_INIT;
    cfg.num_blocks = 64;
    return kv_block_pool_create(&cfg, (kv_block_pool **)&x->out);
}
static void ok_pool(void *p)
{
    struct create_ctx *x = p;
    struct kv_block_pool_stats st;
    kv_block_pool_stats_get(x->out, &st);
    assert_int_equal(st.capacity, 63);
    assert_int_equal(st.free_blocks, 63);
    kv_block_pool_destroy(x->out);
    x->out = SENTINEL;
}

static kv_block_pool *g_pt_pool;

static kv_status call_pt(void *p)
{
    struct create_ctx *x = p;
    struct kv_page_table_config cfg = KV_PAGE_TABLE_CONFIG_INIT;
    cfg.block_tokens = NT;
    cfg.page_ratio = 2;
    cfg.max_seqs = 8;
    cfg.max_blocks_per_seq = 8;
    cfg.enable_prefix_caching = true;
    cfg.extra_key = 5;
    assert_int_equal(kv_block_pool_ops(g_pt_pool, &cfg.ops), KV_OK);
    return kv_page_table_create(&cfg, (kv_page_table **)&x->out);
}
static void ok_pt(void *p)
{
    struct create_ctx *x = p;
    uint32_t s;
    assert_int_equal(kv_page_table_seq_create(x->out, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(x->out, s, g_tokens, 5), KV_OK);
    kv_page_table_destroy(x->out);
    x->out = SENTINEL;
}

static kv_status call_cache(void *p)
{
    struct create_ctx *x = p;
    struct kv_cache_config cfg;
    cache_cfg(&cfg);
    return kv_cache_create(&cfg, (kv_cache **)&x->out);
}
static void ok_cache(void *p)
{
    struct create_ctx *x = p;
    uint32_t s;
    kv_page_table *pt = kv_cache_page_table(x->out);
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, g_tokens, 9), KV_OK);
    kv_cache_destroy(x->out);
    x->out = SENTINEL;
}

static void test_create(void **state)
{
    (void)state;
    tokens_init();
    struct create_ctx x = {SENTINEL};
    struct oom_case c = {"kv_arena_create", &x, call_arena, NULL, ok_arena, failed_out, KV_OK};
    oom_run(&c);
    c = (struct oom_case){"kv_block_pool_create", &x, call_pool, NULL, ok_pool, failed_out, KV_OK};
    oom_run(&c);
    struct kv_block_pool_config pcfg = KV_BLOCK_POOL_CONFIG_INIT;
    pcfg.num_blocks = 64;
    assert_int_equal(kv_block_pool_create(&pcfg, &g_pt_pool), KV_OK);
    c = (struct oom_case){"kv_page_table_create", &x, call_pt, NULL, ok_pt, NULL, KV_OK};
    oom_run(&c);
    kv_block_pool_destroy(g_pt_pool);
    c = (struct oom_case){"kv_cache_create", &x, call_cache, NULL, ok_cache, failed_out, KV_OK};
    oom_run(&c);
}

/* ---- page table -------------------------------------------------------------------- */

struct pt_ctx {
    kv_cache *c;
    kv_page_table *pt;
    kv_block_pool *pool;
    uint32_t seqs[8]; /* the live sequences the snapshot walks */
    uint32_t n_seqs;
    uint32_t seq, seq2; /* the scenario's subjects */
    uint32_t out_seq;
    uint64_t cached;
    struct kv_block_copy copies[8];
    uint32_t n_copies;
};

static void pt_snap(void *p, struct snap *s)
{
    struct pt_ctx *x = p;
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(x->pool, &ps);
    snap_put(s, ps.capacity);
    snap_put(s, ps.free_blocks);
    snap_put(s, ps.used_blocks);
    snap_put(s, ps.cached_blocks);
    snap_put(s, ps.hashed_blocks);
    snap_put(s, ps.hits);
    snap_put(s, ps.misses);
    snap_put(s, ps.evictions);
    snap_put(s, ps.stored);
    for (uint32_t b = 1; b < NB; b++)
        snap_put(s, kv_block_pool_ref_count(x->pool, b));
    struct kv_page_table_stats ts;
    kv_page_table_stats_get(x->pt, &ts);
    snap_put(s, ts.live_seqs);
    snap_put(s, ts.held_blocks);
    snap_put(s, ts.cow_copies);
    snap_put(s, ts.copies_held);
    snap_put(s, ts.reused_blocks);
    snap_put(s, kv_page_table_pending_copies(x->pt));
    for (uint32_t i = 0; i < x->n_seqs; i++) {
        uint64_t len = 0;
        const uint32_t *blocks = NULL;
        uint32_t nb = 0;
        assert_int_equal(kv_page_table_seq_len(x->pt, x->seqs[i], &len), KV_OK);
        assert_int_equal(kv_page_table_seq_blocks(x->pt, x->seqs[i], &blocks, &nb), KV_OK);
        snap_put(s, len);
        snap_put(s, nb);
        for (uint32_t j = 0; j < nb; j++)
            snap_put(s, blocks[j]);
    }
}

static void pt_setup(struct pt_ctx *x)
{
    memset(x, 0, sizeof(*x));
    x->c = mk_cache();
    x->pt = kv_cache_page_table(x->c);
    x->pool = kv_cache_pool(x->c);
    x->out_seq = 0xdeadbeefu;
    x->cached = 0xdeadbeefull;
}

static uint32_t pt_new_seq(struct pt_ctx *x, uint64_t n)
{
    uint32_t s;
    assert_int_equal(kv_page_table_seq_create(x->pt, &s), KV_OK);
    if (n)
        assert_int_equal(kv_page_table_seq_append(x->pt, s, g_tokens, n), KV_OK);
    x->seqs[x->n_seqs++] = s;
    return s;
}

static uint64_t seq_len(struct pt_ctx *x, uint32_t s)
{
    uint64_t n = 0;
    assert_int_equal(kv_page_table_seq_len(x->pt, s, &n), KV_OK);
    return n;
}

static void failed_seq_out(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(x->out_seq, 0xdeadbeefu);
}

static kv_status call_seq_create(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_create(x->pt, &x->out_seq);
}
static void ok_seq_create(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(seq_len(x, x->out_seq), 0);
    assert_int_equal(kv_page_table_seq_free(x->pt, x->out_seq), KV_OK);
    x->out_seq = 0xdeadbeefu;
}

static kv_status call_append(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_append(x->pt, x->seq, g_tokens + 3, 6); /* 3 -> 9: two boundaries */
}
static void ok_append(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(seq_len(x, x->seq), 9);
    assert_int_equal(kv_page_table_seq_truncate(x->pt, x->seq, 3), KV_OK);
}

static kv_status call_append_grow(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_append(x->pt, x->seq, g_tokens + 15, 6); /* 4 -> 6 blocks */
}
static void ok_append_grow(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(seq_len(x, x->seq), 21);
    assert_int_equal(kv_page_table_seq_truncate(x->pt, x->seq, 15), KV_OK);
}

static kv_status call_from_prefix(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_create_from_prefix(x->pt, g_tokens, 25, &x->out_seq, &x->cached);
}
static void ok_from_prefix(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(x->cached, 24);
    assert_int_equal(seq_len(x, x->out_seq), 24);
    assert_int_equal(kv_page_table_seq_free(x->pt, x->out_seq), KV_OK);
    x->out_seq = 0xdeadbeefu;
    x->cached = 0xdeadbeefull;
}

static kv_status call_reuse(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_reuse_prefix(x->pt, x->seq, g_tokens, 25, &x->cached);
}
static void ok_reuse(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(x->cached, 24);
    assert_int_equal(seq_len(x, x->seq), 24);
    assert_int_equal(kv_page_table_seq_truncate(x->pt, x->seq, 0), KV_OK);
    x->cached = 0xdeadbeefull;
}

static kv_status call_fork(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_fork(x->pt, x->seq, &x->out_seq);
}
static void ok_fork(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(seq_len(x, x->out_seq), 6);
    assert_int_equal(kv_page_table_seq_free(x->pt, x->out_seq), KV_OK);
    x->out_seq = 0xdeadbeefu;
}

static kv_status call_truncate(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_truncate(x->pt, x->seq, 3);
}
static void ok_truncate(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(seq_len(x, x->seq), 3);
    assert_int_equal(kv_page_table_seq_append(x->pt, x->seq, g_tokens + 3, 7), KV_OK);
}

static kv_status call_cow(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_seq_append(x->pt, x->seq2, g_tokens + 6, 1);
}
static void ok_cow(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(seq_len(x, x->seq2), 7);
    assert_int_equal(kv_page_table_pending_copies(x->pt), 1);
    /* undo: nothing to restore exactly; the loop stops on the first success
     * that failed nothing, else re-snapshots */
}

static kv_status call_take(void *p)
{
    struct pt_ctx *x = p;
    return kv_page_table_take_copies(x->pt, x->copies, 8, &x->n_copies);
}
static void ok_take(void *p)
{
    struct pt_ctx *x = p;
    assert_int_equal(x->n_copies, 1);
    assert_int_equal(kv_page_table_copies_done(x->pt), KV_OK);
}

static kv_status call_vllm(void *p)
{
    struct pt_ctx *x = p;
    int32_t bt[8 * 8];
    int64_t sm[32], sl[8];
    struct kv_vllm_export_sizes sz;
    struct kv_token_range r[2] = {{0, 6}, {0, 3}};
    uint32_t seqs[2] = {x->seq, x->seq2};
    struct kv_vllm_export e = {.block_table = bt,
                               .block_table_len = 64,
                               .block_table_cols = 8,
                               .slot_mapping = sm,
                               .slot_mapping_len = 32,
                               .seq_lens = sl,
                               .seq_lens_len = 8,
                               .sizes = &sz};
    return kv_page_table_export_vllm(x->pt, seqs, 2, r, &e);
}
static kv_status call_flashinfer(void *p)
{
    struct pt_ctx *x = p;
    int32_t ip[3], ix[32], lp[2];
    uint64_t nnz;
    uint32_t seqs[2] = {x->seq, x->seq2};
    struct kv_flashinfer_export e = {ip, 3, ix, 32, lp, 2};
    return kv_page_table_export_flashinfer(x->pt, seqs, 2, &e, &nnz);
}
static void ok_nothing(void *p)
{
    (void)p;
}

static void test_page_table(void **state)
{
    (void)state;
    tokens_init();
    struct pt_ctx x;
    struct oom_case c;

    pt_setup(&x);
    pt_new_seq(&x, 5);
    c = (struct oom_case){"seq_create",   &x,   call_seq_create, pt_snap, ok_seq_create,
                          failed_seq_out, KV_OK};
    oom_run(&c);
    kv_cache_destroy(x.c);

    pt_setup(&x);
    x.seq = pt_new_seq(&x, 3);
    pt_new_seq(&x, 6);
    c = (struct oom_case){"seq_append", &x, call_append, pt_snap, ok_append, NULL, KV_OK};
    oom_run(&c);
    kv_cache_destroy(x.c);

    /* past a sequence's first arrays (4 blocks) */
    pt_setup(&x);
    x.seq = pt_new_seq(&x, 15);
    pt_new_seq(&x, 6);
    c = (struct oom_case){
        "seq_append (grow)", &x, call_append_grow, pt_snap, ok_append_grow, NULL, KV_OK};
    oom_run(&c);
    kv_cache_destroy(x.c);

    /* cached blocks: a sequence of 25 tokens (6 full blocks) freed; its id
     * (and arrays) go to the next sequence made, so the scenarios get
     * fresh ones */
    pt_setup(&x);
    {
        uint32_t s = pt_new_seq(&x, 25);
        assert_int_equal(kv_page_table_seq_free(x.pt, s), KV_OK);
        x.n_seqs = 0;
    }
    pt_new_seq(&x, 2);
    x.seq = pt_new_seq(&x, 0);
    c = (struct oom_case){"seq_create_from_prefix", &x,   call_from_prefix, pt_snap, ok_from_prefix,
                          failed_seq_out,           KV_OK};
    oom_run(&c);
    c = (struct oom_case){"seq_reuse_prefix", &x, call_reuse, pt_snap, ok_reuse, NULL, KV_OK};
    oom_run(&c);
    kv_cache_destroy(x.c);

    pt_setup(&x);
    x.seq = pt_new_seq(&x, 6);
    c = (struct oom_case){"seq_fork", &x, call_fork, pt_snap, ok_fork, failed_seq_out, KV_OK};
    oom_run(&c);
    c = (struct oom_case){"seq_truncate", &x, call_truncate, pt_snap, ok_truncate, NULL, KV_OK};
    oom_run(&c);
    kv_cache_destroy(x.c);

    /* copy-on-write: the child shares a partly filled block */
    pt_setup(&x);
    x.seq = pt_new_seq(&x, 6);
    assert_int_equal(kv_page_table_seq_fork(x.pt, x.seq, &x.seq2), KV_OK);
    x.seqs[x.n_seqs++] = x.seq2;
    c = (struct oom_case){"seq_append (copy-on-write)", &x, call_cow, pt_snap, ok_cow, NULL, KV_OK};
    oom_run(&c);
    c = (struct oom_case){"take_copies", &x, call_take, pt_snap, ok_take, NULL, KV_OK};
    oom_run(&c);
    assert_int_equal(kv_page_table_seq_truncate(x.pt, x.seq2, 3), KV_OK);
    c = (struct oom_case){"export_vllm", &x, call_vllm, pt_snap, ok_nothing, NULL, KV_OK};
    oom_run(&c);
    c = (struct oom_case){
        "export_flashinfer", &x, call_flashinfer, pt_snap, ok_nothing, NULL, KV_OK};
    oom_run(&c);
    kv_cache_destroy(x.c);
}

/* ---- block pool calls, page-table calls that allocate nothing ----------------------- */

struct bp_ctx {
    struct pt_ctx *t;
    uint32_t ids[4], out_ids[16];
    uint64_t hash, hashes[4];
    uint32_t n, blocks;
    bool stored;
};

static void bp_snap(void *p, struct snap *s)
{
    struct bp_ctx *x = p;
    pt_snap(x->t, s);
}
static void bp_untouched(void *p)
{
    struct bp_ctx *x = p;
    assert_int_equal(x->out_ids[0], 0xdeadbeefu);
    assert_int_equal(x->n, 0xdeadbeefu);
}
static void bp_reset(struct bp_ctx *x)
{
    for (int i = 0; i < 16; i++)
        x->out_ids[i] = 0xdeadbeefu;
    x->n = 0xdeadbeefu;
    x->blocks = 0xdeadbeefu;
    x->hash = 0xdeadbeefull;
}

static kv_status call_bp_alloc(void *p)
{
    struct bp_ctx *x = p;
    return kv_block_pool_alloc(x->t->pool, 2, x->out_ids);
}
static void ok_bp_alloc(void *p)
{
    struct bp_ctx *x = p;
    assert_int_equal(kv_block_pool_ref_count(x->t->pool, x->out_ids[0]), 1);
    assert_int_equal(kv_block_pool_release(x->t->pool, x->out_ids, 2), KV_OK);
    bp_reset(x);
}
static kv_status call_bp_retain(void *p)
{
    struct bp_ctx *x = p;
    return kv_block_pool_retain(x->t->pool, x->ids, 2);
}
static void ok_bp_retain(void *p)
{
    struct bp_ctx *x = p;
    assert_int_equal(kv_block_pool_release(x->t->pool, x->ids, 2), KV_OK);
}
static kv_status call_bp_release(void *p)
{
    struct bp_ctx *x = p;
    return kv_block_pool_release(x->t->pool, x->ids, 1); /* 2 -> 1 */
}
static void ok_bp_release(void *p)
{
    struct bp_ctx *x = p;
    assert_int_equal(kv_block_pool_retain(x->t->pool, x->ids, 1), KV_OK);
}
static kv_status call_bp_commit_hash(void *p)
{
    struct bp_ctx *x = p;
    return kv_block_pool_commit_hash(x->t->pool, x->ids[2], 0x1234567ull, &x->stored);
}
static kv_status call_bp_commit_full(void *p)
{
    struct bp_ctx *x = p;
    return kv_block_pool_commit_full(x->t->pool, x->ids[3], 0x1234567ull, g_tokens + 40, NT, 9,
                                     &x->hash);
}
static kv_status call_bp_lookup(void *p)
{
    struct bp_ctx *x = p;
    return kv_block_pool_lookup(x->t->pool, x->hashes, 2, x->out_ids, &x->n);
}
static void ok_bp_found(void *p)
{
    struct bp_ctx *x = p;
    assert_true(x->n <= 16);
    /* lookup and match_prefix take a reference on what they find */
    assert_int_equal(kv_block_pool_release(x->t->pool, x->out_ids, x->n), KV_OK);
    bp_reset(x);
}
static kv_status call_bp_match(void *p)
{
    struct bp_ctx *x = p;
    uint64_t h[8];
    return kv_block_pool_match_prefix(x->t->pool, g_tokens, 13, NT, 5, x->out_ids, h, 8, &x->n);
}
static kv_status call_bp_free_list(void *p)
{
    struct bp_ctx *x = p;
    return kv_block_pool_free_list(x->t->pool, x->out_ids, 16, &x->n);
}
static void ok_bp_free_list(void *p)
{
    struct bp_ctx *x = p;
    assert_true(x->n > 0 && x->n <= 16);
    bp_reset(x);
}
static kv_status call_pt_extra_key(void *p)
{
    struct bp_ctx *x = p;
    return kv_page_table_seq_set_extra_key(x->t->pt, x->t->seq2, 77);
}
static kv_status call_pt_needed(void *p)
{
    struct bp_ctx *x = p;
    return kv_page_table_blocks_needed(x->t->pt, x->t->seq, 9, &x->blocks);
}
static void ok_pt_needed(void *p)
{
    struct bp_ctx *x = p;
    assert_true(x->blocks >= 2 && x->blocks <= 4);
    x->blocks = 0xdeadbeefu;
}
static kv_status call_pt_copies_done(void *p)
{
    struct bp_ctx *x = p;
    return kv_page_table_copies_done(x->t->pt);
}
static kv_status call_pt_seq_free(void *p)
{
    struct bp_ctx *x = p;
    return kv_page_table_seq_free(x->t->pt, x->t->seq);
}
static void ok_pt_seq_free(void *p)
{
    struct bp_ctx *x = p;
    x->t->n_seqs = 0; /* the snapshot no longer walks it */
}

static void test_pool_calls(void **state)
{
    (void)state;
    tokens_init();
    static struct pt_ctx t;
    struct bp_ctx x;
    memset(&x, 0, sizeof(x));
    x.t = &t;
    pt_setup(&t);
    t.seq = pt_new_seq(&t, 10); /* blocks: 2 full (hashed), 1 partial */
    t.seq2 = pt_new_seq(&t, 0);
    const uint32_t *blocks;
    uint32_t nb;
    assert_int_equal(kv_page_table_seq_blocks(t.pt, t.seq, &blocks, &nb), KV_OK);
    assert_int_equal(nb, 3);
    x.ids[0] = blocks[0];
    x.ids[1] = blocks[1];
    for (int i = 0; i < 2; i++)
        assert_int_equal(kv_block_pool_block_hash(t.pool, x.ids[i], &x.hashes[i]), KV_OK);
    assert_int_equal(kv_block_pool_alloc(t.pool, 2, x.ids + 2), KV_OK); /* private, unhashed */
    bp_reset(&x);

    struct oom_case c = {"pool_alloc", &x,           call_bp_alloc, bp_snap,
                         ok_bp_alloc,  bp_untouched, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){"pool_retain", &x, call_bp_retain, bp_snap, ok_bp_retain, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    assert_int_equal(kv_block_pool_retain(t.pool, x.ids, 1), KV_OK);
    c = (struct oom_case){"pool_release", &x, call_bp_release, bp_snap, ok_bp_release, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    assert_int_equal(kv_block_pool_release(t.pool, x.ids, 1), KV_OK);
    c = (struct oom_case){"pool_lookup", &x,           call_bp_lookup, bp_snap,
                          ok_bp_found,   bp_untouched, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){"pool_match_prefix", &x,           call_bp_match, bp_snap,
                          ok_bp_found,         bp_untouched, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){"pool_free_list", &x,   call_bp_free_list, bp_snap, ok_bp_free_list,
                          bp_untouched,     KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){
        "pool_commit_hash", &x, call_bp_commit_hash, NULL, ok_nothing, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){
        "pool_commit_full", &x, call_bp_commit_full, NULL, ok_nothing, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    assert_int_equal(kv_block_pool_release(t.pool, x.ids + 2, 2), KV_OK);

    c = (struct oom_case){
        "seq_set_extra_key", &x, call_pt_extra_key, NULL, ok_nothing, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    x.blocks = 0xdeadbeefu;
    c = (struct oom_case){"blocks_needed", &x, call_pt_needed, bp_snap, ok_pt_needed, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){"copies_done", &x, call_pt_copies_done, bp_snap, ok_nothing, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    t.seqs[0] = t.seq2;
    t.n_seqs = 1;
    c = (struct oom_case){"seq_free", &x, call_pt_seq_free, NULL, ok_pt_seq_free, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    kv_cache_destroy(t.c);
}

/* ---- DLPack ------------------------------------------------------------------------ */

struct dl_ctx {
    kv_cache *c;
    struct kv_view v;
    DLManagedTensor *t;
};

static kv_status call_dlpack(void *p)
{
    struct dl_ctx *x = p;
    return kv_cache_to_dlpack(x->c, &x->v, &x->t);
}
static void ok_dlpack(void *p)
{
    struct dl_ctx *x = p;
    assert_non_null(x->t);
    assert_ptr_not_equal(x->t, SENTINEL);
    assert_int_equal(x->t->dl_tensor.ndim, x->v.ndim);
    x->t->deleter(x->t);
    x->t = SENTINEL;
}
static void failed_dlpack(void *p)
{
    struct dl_ctx *x = p;
    assert_ptr_equal(x->t, SENTINEL);
}

static void test_dlpack(void **state)
{
    (void)state;
    struct dl_ctx x = {mk_cache(), {0}, SENTINEL};
    assert_int_equal(kv_cache_kv_view(x.c, 1, 1, &x.v), KV_OK);
    struct oom_case c = {"kv_cache_to_dlpack", &x,   call_dlpack, NULL, ok_dlpack,
                         failed_dlpack,        KV_OK};
    oom_run(&c);
    /* the last reference: a reference leaked by a failed export would leave
     * the cache to the leak checker */
    kv_cache_destroy(x.c);
}

/* ---- plans, pack, unpack ----------------------------------------------------------- */

static void mk_layout(struct kv_layout *lo, int64_t N, kv_order order, kv_arrange arr, bool packed,
                      int64_t pad)
{
    struct kv_layout_config cfg;
    kv_layout_config_init(&cfg);
    cfg.num_layers = 2;
    cfg.num_blocks = 9;
    cfg.block_tokens = N;
    cfg.num_heads = 2;
    cfg.head_dim = 8;
    cfg.dtype = KV_F16;
    cfg.order = order;
    cfg.arrange = arr;
    cfg.kv_packed = packed;
    cfg.block_pad_elems = pad;
    assert_int_equal(kv_layout_init(&cfg, lo), KV_OK);
}

struct plan_ctx {
    struct kv_layout src, dst;
    kv_plan *plan;
    struct kv_paged_cache ps, pd;
    unsigned char *ms, *md, *buf;
    size_t buf_cap, out_bytes;
    uint32_t n_dst; /* ceil(11 / dst N) */
};

static kv_status call_plan_create(void *p)
{
    struct plan_ctx *x = p;
    struct kv_plan_config cfg = KV_PLAN_CONFIG_INIT;
    return kv_plan_create(&x->src, &x->dst, &cfg, &x->plan);
}
static void ok_plan_create(void *p)
{
    struct plan_ctx *x = p;
    struct kv_plan_stats st;
    assert_int_equal(kv_plan_stats_get(x->plan, &st), KV_OK);
    assert_true(st.window_bytes > 0);
    kv_plan_destroy(x->plan);
    x->plan = SENTINEL;
}
static void failed_plan(void *p)
{
    struct plan_ctx *x = p;
    /* kv_plan_create clears *out on any error (kv_plan.h) */
    assert_null(x->plan);
    x->plan = SENTINEL;
}

static void plan_snap(void *p, struct snap *s)
{
    struct plan_ctx *x = p;
    snap_bytes(s, x->md, x->dst.total_bytes);
    if (x->buf)
        snap_bytes(s, x->buf, x->buf_cap);
    snap_bytes(s, x->ms, x->src.total_bytes);
}

static const uint32_t g_src_blocks[3] = {3, 1, 7};
static const uint32_t g_dst_blocks[6] = {8, 2, 5, 4, 6, 1};

static kv_status call_plan_copy(void *p)
{
    struct plan_ctx *x = p;
    return kv_plan_copy(x->plan, x->ps, g_src_blocks, 3, x->pd, g_dst_blocks, x->n_dst, 11);
}
static void ok_copy(void *p)
{
    struct plan_ctx *x = p;
    /* restore the destination for the next run */
    memset(x->md, 0xA5, (size_t)x->dst.total_bytes);
}

static kv_status call_pack(void *p)
{
    struct plan_ctx *x = p;
    return kv_pack(NULL, x->ps, g_src_blocks, 3, 11, x->buf, x->buf_cap, &x->out_bytes, NULL);
}
static void ok_pack(void *p)
{
    struct plan_ctx *x = p;
    assert_true(x->out_bytes > 0 && x->out_bytes <= x->buf_cap);
    memset(x->buf, 0x5A, x->buf_cap);
}

static kv_status call_unpack(void *p)
{
    struct plan_ctx *x = p;
    return kv_unpack(NULL, x->buf, x->out_bytes, x->pd, g_dst_blocks, x->n_dst, NULL);
}

static void plan_mem(struct plan_ctx *x)
{
    x->ms = malloc(x->src.total_bytes);
    x->md = malloc(x->dst.total_bytes);
    assert_non_null(x->ms);
    assert_non_null(x->md);
    for (size_t i = 0; i < (size_t)x->src.total_bytes; i++)
        x->ms[i] = (unsigned char)(i * 131u + 7u);
    memset(x->md, 0xA5, (size_t)x->dst.total_bytes);
    x->ps = (struct kv_paged_cache){x->src, x->ms, x->src.total_bytes, KV_MEM_HOST};
    x->pd = (struct kv_paged_cache){x->dst, x->md, x->dst.total_bytes, KV_MEM_HOST};
}

static void test_plan(void **state)
{
    (void)state;
    static const struct {
        int64_t ns, nd;
        kv_order os, od;
        kv_arrange as, ad;
        bool pks, pkd;
        int64_t pads, padd;
    } pairs[] = {
        {4, 4, KV_ORDER_NHD, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, KV_ARRANGE_LAYER_MAJOR, 0, 0, 0,
         0},
        {4, 2, KV_ORDER_NHD, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, KV_ARRANGE_BLOCK_MAJOR, 0, 0, 0,
         8},
        {4, 2, KV_ORDER_HND, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, KV_ARRANGE_LAYER_MAJOR, 1, 0, 16,
         0},
    };
    struct oom_case c;
    for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
        struct plan_ctx x;
        memset(&x, 0, sizeof(x));
        x.plan = SENTINEL;
        mk_layout(&x.src, pairs[i].ns, pairs[i].os, pairs[i].as, pairs[i].pks, pairs[i].pads);
        mk_layout(&x.dst, pairs[i].nd, pairs[i].od, pairs[i].ad, pairs[i].pkd, pairs[i].padd);
        c = (struct oom_case){"kv_plan_create", &x,   call_plan_create, NULL, ok_plan_create,
                              failed_plan,      KV_OK};
        oom_run(&c);

        plan_mem(&x);
        x.n_dst = (uint32_t)((11 + pairs[i].nd - 1) / pairs[i].nd);
        struct kv_plan_config pcfg = KV_PLAN_CONFIG_INIT;
        assert_int_equal(kv_plan_create(&x.src, &x.dst, &pcfg, &x.plan), KV_OK);
        c = (struct oom_case){"kv_plan_copy", &x, call_plan_copy, plan_snap, ok_copy, NULL, KV_OK};
        oom_run(&c);
        kv_plan_destroy(x.plan);

        uint64_t need = 0;
        assert_int_equal(kv_pack_size(&x.src, NULL, 11, &need), KV_OK);
        x.buf_cap = (size_t)need;
        x.buf = malloc(x.buf_cap);
        assert_non_null(x.buf);
        memset(x.buf, 0x5A, x.buf_cap);
        x.out_bytes = 0xdead;
        c = (struct oom_case){"kv_pack", &x, call_pack, plan_snap, ok_pack, NULL, KV_OK};
        oom_run(&c);
        assert_int_equal(
            kv_pack(NULL, x.ps, g_src_blocks, 3, 11, x.buf, x.buf_cap, &x.out_bytes, NULL), KV_OK);
        c = (struct oom_case){"kv_unpack", &x, call_unpack, plan_snap, ok_copy, NULL, KV_OK};
        oom_run(&c);
        free(x.buf);
        free(x.ms);
        free(x.md);
    }
}

/* head and layer ranges; pack and unpack plans; the device plan */
static struct kv_plan_config g_range_cfg;

static kv_status call_plan_create_range(void *p)
{
    struct plan_ctx *x = p;
    return kv_plan_create(&x->src, &x->dst, &g_range_cfg, &x->plan);
}
static kv_status call_pack_plan_create(void *p)
{
    struct plan_ctx *x = p;
    return kv_pack_plan_create(&x->src, &g_range_cfg, &x->plan);
}
static kv_status call_unpack_plan_create(void *p)
{
    struct plan_ctx *x = p;
    return kv_unpack_plan_create(&x->src, &x->dst, &g_range_cfg, &x->plan);
}
static kv_status call_pack_size(void *p)
{
    struct plan_ctx *x = p;
    uint64_t n = 0;
    const kv_status st = kv_pack_size(&x->src, &g_range_cfg, 11, &n);
    if (st == KV_OK)
        x->out_bytes = (size_t)n;
    return st;
}
static void ok_pack_size(void *p)
{
    struct plan_ctx *x = p;
    assert_true(x->out_bytes > 0 && x->out_bytes <= x->buf_cap);
}
static kv_status call_pack_range(void *p)
{
    struct plan_ctx *x = p;
    return kv_pack(NULL, x->ps, g_src_blocks, 3, 11, x->buf, x->buf_cap, &x->out_bytes,
                   &g_range_cfg);
}
static kv_status call_unpack_range(void *p)
{
    struct plan_ctx *x = p;
    return kv_unpack(NULL, x->buf, x->out_bytes, x->pd, g_dst_blocks, x->n_dst, &g_range_cfg);
}

static void test_plan_ranges(void **state)
{
    (void)state;
    struct plan_ctx x;
    memset(&x, 0, sizeof(x));
    x.plan = SENTINEL;
    mk_layout(&x.src, 4, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, false, 0);
    mk_layout(&x.dst, 2, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, true, 8);
    g_range_cfg = (struct kv_plan_config)KV_PLAN_CONFIG_INIT;
    g_range_cfg.src_head0 = 1;
    g_range_cfg.dst_head0 = 0;
    g_range_cfg.n_heads = 1;
    g_range_cfg.src_layer0 = 1;
    g_range_cfg.dst_layer0 = 0;
    g_range_cfg.n_layers = 1;
    struct oom_case c = {"kv_plan_create (ranges)",
                         &x,
                         call_plan_create_range,
                         NULL,
                         ok_plan_create,
                         failed_plan,
                         KV_OK};
    oom_run(&c);
    c = (struct oom_case){"kv_pack_plan_create", &x,   call_pack_plan_create, NULL, ok_plan_create,
                          failed_plan,           KV_OK};
    oom_run(&c);
    c = (struct oom_case){"kv_unpack_plan_create",
                          &x,
                          call_unpack_plan_create,
                          NULL,
                          ok_plan_create,
                          failed_plan,
                          KV_OK};
    oom_run(&c);

    plan_mem(&x);
    x.n_dst = 6;
    assert_int_equal(kv_plan_create(&x.src, &x.dst, &g_range_cfg, &x.plan), KV_OK);
    c = (struct oom_case){
        "kv_plan_copy (ranges)", &x, call_plan_copy, plan_snap, ok_copy, NULL, KV_OK};
    oom_run(&c);

    /* the device plan: no GPU here, its documented status, nothing leaked */
    for (int64_t k = 0; k < 4; k++) {
        kv_plan_dev *pd = SENTINEL;
        kv__mem_fail_after(k);
        const kv_status st = kv_plan_dev_create(x.plan, &pd);
        kv__mem_fail_after(-1);
        if (st == KV_OK) {
            kv_plan_dev_destroy(pd);
            break;
        }
        assert_true(st == KV_ERR_UNSUPPORTED || st == KV_ERR_NO_MEMORY);
        assert_true(kv_last_error() && kv_last_error()[0]);
        assert_ptr_equal(pd, SENTINEL);
    }
    kv_plan_destroy(x.plan);

    uint64_t need = 0;
    assert_int_equal(kv_pack_size(&x.src, NULL, 11, &need), KV_OK);
    x.buf_cap = (size_t)need;
    x.buf = malloc(x.buf_cap);
    assert_non_null(x.buf);
    memset(x.buf, 0x5A, x.buf_cap);
    x.out_bytes = 0xdead;
    c = (struct oom_case){
        "kv_pack_size (ranges)", &x, call_pack_size, NULL, ok_pack_size, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){"kv_pack (ranges)", &x, call_pack_range, plan_snap, ok_pack, NULL, KV_OK};
    oom_run(&c);
    assert_int_equal(
        kv_pack(NULL, x.ps, g_src_blocks, 3, 11, x.buf, x.buf_cap, &x.out_bytes, &g_range_cfg),
        KV_OK);
    c = (struct oom_case){
        "kv_unpack (convert, ranges)", &x, call_unpack_range, plan_snap, ok_copy, NULL, KV_OK};
    oom_run(&c);
    free(x.buf);
    free(x.ms);
    free(x.md);
}

/* ---- view copies (a staged transpose's buffer is best effort) ----------------------- */

#define VW 256

struct vw_ctx {
    float *src, *dst;
    struct kv_view s, t, d;
};

static void vw_snap(void *p, struct snap *s)
{
    struct vw_ctx *x = p;
    snap_bytes(s, x->dst, VW * VW * sizeof(float));
    snap_bytes(s, x->src, VW * VW * sizeof(float));
}
static kv_status call_view_copy(void *p)
{
    struct vw_ctx *x = p;
    return kv_view_copy(&x->t, &x->d);
}
static kv_status call_materialize(void *p)
{
    struct vw_ctx *x = p;
    return kv_view_materialize(&x->t, x->dst, VW * VW * sizeof(float));
}
static void ok_view(void *p)
{
    struct vw_ctx *x = p;
    assert_true(x->dst[1] == x->src[VW]); /* transposed */
    memset(x->dst, 0, VW * VW * sizeof(float));
}

static void test_view(void **state)
{
    (void)state;
    struct vw_ctx x;
    x.src = malloc(VW * VW * sizeof(float));
    x.dst = calloc(VW * VW, sizeof(float));
    assert_non_null(x.src);
    assert_non_null(x.dst);
    for (int i = 0; i < VW * VW; i++)
        x.src[i] = (float)i;
    const int64_t shape[2] = {VW, VW};
    assert_int_equal(kv_view_init(x.src, VW * VW * sizeof(float), KV_F32, 2, shape, &x.s), KV_OK);
    assert_int_equal(kv_view_transpose(&x.s, 0, 1, &x.t), KV_OK);
    assert_int_equal(kv_view_init(x.dst, VW * VW * sizeof(float), KV_F32, 2, shape, &x.d), KV_OK);
    struct oom_case c = {
        "kv_view_copy (transpose)", &x, call_view_copy, vw_snap, ok_view, NULL, KV_OK};
    oom_run(&c);
    c = (struct oom_case){
        "kv_view_materialize", &x, call_materialize, vw_snap, ok_view, NULL, KV_OK};
    oom_run(&c);
    free(x.src);
    free(x.dst);
}

/* ---- offload ----------------------------------------------------------------------- */

struct off_ctx {
    kv_offload *off;
    kv_cache *c;
    kv_page_table *pt;
    uint32_t seq;
    uint32_t ids[2];
    uint64_t hashes[2];
    kv_offload_op *op;
    void *staging;
};

static void off_cfg(struct kv_offload_config *cfg)
{
    *cfg = (struct kv_offload_config)KV_OFFLOAD_CONFIG_INIT;
    cfg->capacity_bytes = 1u << 20;
    cfg->staging_bytes = 1u << 16;
    cfg->mem = KV_OFFLOAD_MEM_HOST;
    cfg->threads = 1;
}

static kv_status call_off_create(void *p)
{
    struct off_ctx *x = p;
    struct kv_offload_config cfg;
    off_cfg(&cfg);
    return kv_offload_create(&cfg, &x->off);
}
static void ok_off_create(void *p)
{
    struct off_ctx *x = p;
    assert_int_equal(kv_offload_mem_kind(x->off), KV_MEM_HOST);
    kv_offload_destroy(x->off);
    x->off = SENTINEL;
}
static void failed_off_create(void *p)
{
    struct off_ctx *x = p;
    assert_ptr_equal(x->off, SENTINEL);
}

static void off_snap(void *p, struct snap *s)
{
    struct off_ctx *x = p;
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(x->off, &st), KV_OK);
    snap_put(s, st.entries);
    snap_put(s, st.bytes);
    snap_put(s, st.staging_bytes);
    snap_put(s, st.stores);
    snap_put(s, st.loads);
    snap_put(s, st.hits);
    snap_put(s, st.misses);
    snap_put(s, st.failed_ops);
    snap_put(s, st.cancelled_ops);
    kv_block_pool *pool = kv_cache_pool(x->c);
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(pool, &ps);
    snap_put(s, ps.free_blocks);
    snap_put(s, ps.used_blocks);
    snap_put(s, ps.cached_blocks);
    snap_put(s, ps.hashed_blocks);
    for (uint32_t b = 1; b < NB; b++)
        snap_put(s, kv_block_pool_ref_count(pool, b));
}
static void failed_op(void *p)
{
    struct off_ctx *x = p;
    assert_ptr_equal(x->op, SENTINEL);
}

static void op_finish(struct off_ctx *x, bool load)
{
    kv_offload_state st;
    assert_int_equal(kv_offload_wait(x->op, 20000, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_DONE);
    const struct kv_offload_result *res;
    uint32_t n;
    assert_int_equal(kv_offload_results(x->op, &res, &n), KV_OK);
    assert_int_equal(n, 2);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(res[i].status, KV_OK);
        if (load)
            assert_int_equal(kv_block_pool_release(kv_cache_pool(x->c), &res[i].block, 1), KV_OK);
    }
    assert_int_equal(kv_offload_op_free(x->op), KV_OK);
    x->op = SENTINEL;
}

static kv_status call_store(void *p)
{
    struct off_ctx *x = p;
    return kv_offload_store(x->off, x->c, x->ids, 2, &x->op);
}
static void ok_store(void *p)
{
    op_finish(p, false);
}
static kv_status call_load(void *p)
{
    struct off_ctx *x = p;
    return kv_offload_load(x->off, x->c, x->hashes, 2, &x->op);
}
static void ok_load(void *p)
{
    op_finish(p, true);
}

static kv_status call_staging(void *p)
{
    struct off_ctx *x = p;
    return kv_offload_staging_alloc(x->off, 10000, &x->staging);
}
static void ok_staging(void *p)
{
    struct off_ctx *x = p;
    memset(x->staging, 1, 10000);
    assert_int_equal(kv_offload_staging_free(x->off, x->staging), KV_OK);
    x->staging = SENTINEL;
}
static void failed_staging(void *p)
{
    struct off_ctx *x = p;
    assert_ptr_equal(x->staging, SENTINEL);
}

static kv_status call_evict(void *p)
{
    struct off_ctx *x = p;
    uint32_t n = 0xdeadbeefu;
    const kv_status st = kv_offload_evict(x->off, x->hashes, 2, &n);
    assert_true(st != KV_OK || n == 2);
    return st;
}
static void ok_evict(void *p)
{
    struct off_ctx *x = p;
    /* store them again */
    assert_int_equal(kv_offload_store(x->off, x->c, x->ids, 2, &x->op), KV_OK);
    op_finish(x, false);
}
static kv_status call_results(void *p)
{
    struct off_ctx *x = p;
    const struct kv_offload_result *res;
    uint32_t n;
    return kv_offload_results(x->op, &res, &n);
}
static kv_status call_op_free(void *p)
{
    struct off_ctx *x = p;
    return kv_offload_op_free(x->op);
}
static void ok_op_freed(void *p)
{
    struct off_ctx *x = p;
    x->op = SENTINEL;
}

static void test_offload(void **state)
{
    (void)state;
    tokens_init();
    struct off_ctx x;
    memset(&x, 0, sizeof(x));
    x.off = SENTINEL;
    struct oom_case c = {
        "kv_offload_create", &x, call_off_create, NULL, ok_off_create, failed_off_create,
        KV_ERR_INTERNAL};
    oom_run(&c);

    struct kv_offload_config cfg;
    off_cfg(&cfg);
    assert_int_equal(kv_offload_create(&cfg, &x.off), KV_OK);
    x.c = mk_cache();
    x.pt = kv_cache_page_table(x.c);
    assert_int_equal(kv_page_table_seq_create(x.pt, &x.seq), KV_OK);
    assert_int_equal(kv_page_table_seq_append(x.pt, x.seq, g_tokens, 9), KV_OK);
    const uint32_t *blocks;
    uint32_t nb;
    assert_int_equal(kv_page_table_seq_blocks(x.pt, x.seq, &blocks, &nb), KV_OK);
    assert_int_equal(nb, 3);
    for (int i = 0; i < 2; i++) {
        x.ids[i] = blocks[i];
        assert_int_equal(kv_block_pool_block_hash(kv_cache_pool(x.c), x.ids[i], &x.hashes[i]),
                         KV_OK);
    }
    x.op = SENTINEL;
    c = (struct oom_case){"kv_offload_store", &x, call_store, off_snap, ok_store, failed_op, KV_OK};
    oom_run(&c);
    c = (struct oom_case){"kv_offload_load", &x, call_load, off_snap, ok_load, failed_op, KV_OK};
    oom_run(&c);
    x.staging = SENTINEL;
    c = (struct oom_case){
        "kv_offload_staging_alloc", &x, call_staging, off_snap, ok_staging, failed_staging, KV_OK};
    oom_run(&c);
    c = (struct oom_case){"kv_offload_evict", &x, call_evict, off_snap, ok_evict, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    assert_int_equal(kv_offload_store(x.off, x.c, x.ids, 2, &x.op), KV_OK);
    kv_offload_state ost;
    assert_int_equal(kv_offload_wait(x.op, 20000, &ost), KV_OK);
    c = (struct oom_case){"kv_offload_results", &x,   call_results, off_snap,
                          ok_nothing,           NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    c = (struct oom_case){"kv_offload_op_free", &x, call_op_free, NULL, ok_op_freed, NULL, KV_OK};
    assert_int_equal(oom_run(&c), 0);
    kv_offload_destroy(x.off);
    kv_cache_destroy(x.c);
}

/* ---- attention (CPU) --------------------------------------------------------------- */

struct attn_ctx {
    kv_cache *c;
    struct kv_paged_cache pc;
    struct kv_pages pages;
    int32_t indptr[3], indices[16], last[2];
    int32_t qo[3];
    float qbuf[8 * 4 * 8], obuf[8 * 4 * 8];
    struct kv_view q, out;
};

static void attn_snap(void *p, struct snap *s)
{
    struct attn_ctx *x = p;
    snap_bytes(s, x->obuf, sizeof(x->obuf));
    snap_bytes(s, x->pc.base, x->pc.storage_bytes);
}

static kv_status call_decode(void *p)
{
    struct attn_ctx *x = p;
    return kv_attn_decode(x->pc, 1, &x->q, &x->pages, 0.3f, NULL, &x->out);
}
static kv_status call_prefill(void *p)
{
    struct attn_ctx *x = p;
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.window_left = 4;
    return kv_attn_prefill(x->pc, 1, &x->q, x->qo, &x->pages, 0.3f, NULL, &x->out, &o);
}
static void ok_attn(void *p)
{
    struct attn_ctx *x = p;
    bool written = false;
    for (size_t i = 0; i < sizeof(x->obuf) / sizeof(x->obuf[0]); i++)
        written |= x->obuf[i] != -7.0f;
    assert_true(written);
    for (size_t i = 0; i < sizeof(x->obuf) / sizeof(x->obuf[0]); i++)
        x->obuf[i] = -7.0f;
}

/* ---- attention: decode options, write, read, block copies, MLA --------------------- */

struct attn2_ctx {
    struct attn_ctx *a;
    struct kv_paged_cache pc2; /* a second cache of the same layout (copy_blocks_ex) */
    unsigned char *saved;      /* the cache's bytes, restored after each success */
    unsigned char *saved2;
    float kin[16 * 2 * 8], vin[16 * 2 * 8], vout[16 * 2 * 8], lse[8 * 4];
    int64_t slots[16];
    int32_t slots32[16];
    struct kv_view k, v, ko, vo;
    struct kv_block_copy copies[2];
    struct kv_copy_blocks_opts copts;
    /* MLA: a K-only cache of one latent head */
    struct kv_paged_cache mla;
    unsigned char *mla_saved;
    float mq[5 * 4 * 16], mo[5 * 4 * 8];
    struct kv_view mlq, mlo;
    int32_t m_indptr[3], m_indices[3], m_last[2], m_qo[3];
    struct kv_pages m_pages;
};

static void attn2_snap(void *p, struct snap *s)
{
    struct attn2_ctx *x = p;
    attn_snap(x->a, s);
    snap_bytes(s, x->pc2.base, x->pc2.storage_bytes);
    snap_bytes(s, x->vout, sizeof(x->vout));
    snap_bytes(s, x->lse, sizeof(x->lse));
    snap_bytes(s, x->mla.base, x->mla.storage_bytes);
    snap_bytes(s, x->mo, sizeof(x->mo));
}

/* undo a success: the caches and outputs as they were */
static void ok_attn2(void *p)
{
    struct attn2_ctx *x = p;
    memcpy(x->a->pc.base, x->saved, x->a->pc.storage_bytes);
    memcpy(x->pc2.base, x->saved2, x->pc2.storage_bytes);
    memcpy(x->mla.base, x->mla_saved, x->mla.storage_bytes);
    for (size_t i = 0; i < sizeof(x->a->obuf) / sizeof(x->a->obuf[0]); i++)
        x->a->obuf[i] = -7.0f;
    for (size_t i = 0; i < sizeof(x->vout) / sizeof(x->vout[0]); i++)
        x->vout[i] = -7.0f;
    for (size_t i = 0; i < sizeof(x->lse) / sizeof(x->lse[0]); i++)
        x->lse[i] = -7.0f;
    for (size_t i = 0; i < sizeof(x->mo) / sizeof(x->mo[0]); i++)
        x->mo[i] = -7.0f;
}

static kv_status call_decode_ex(void *p)
{
    struct attn2_ctx *x = p;
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.window_left = 3;
    o.logit_soft_cap = 5.0f;
    o.lse = x->lse;
    return kv_attn_decode_ex(x->a->pc, 1, &x->a->q, &x->a->pages, 0.3f, NULL, &x->a->out, &o);
}
static kv_status call_write(void *p)
{
    struct attn2_ctx *x = p;
    return kv_attn_write(x->a->pc, 1, &x->k, &x->v, x->slots, 16, NULL);
}
static kv_status call_write_i32(void *p)
{
    struct attn2_ctx *x = p;
    return kv_attn_write_i32(x->a->pc, 0, &x->k, &x->v, x->slots32, 16, NULL);
}
static kv_status call_read(void *p)
{
    struct attn2_ctx *x = p;
    return kv_attn_read(x->a->pc, 1, &x->a->pages, &x->ko, &x->vo, NULL);
}
static kv_status call_copy_blocks(void *p)
{
    struct attn2_ctx *x = p;
    return kv_attn_copy_blocks(x->a->pc, x->copies, 2);
}
static kv_status call_copy_blocks_ex(void *p)
{
    struct attn2_ctx *x = p;
    return kv_attn_copy_blocks_ex(x->a->pc, x->a->pc, x->copies, 2, &x->copts);
}
static kv_status call_copy_blocks_ex2(void *p)
{
    struct attn2_ctx *x = p;
    return kv_attn_copy_blocks_ex(x->pc2, x->a->pc, x->copies, 2, &x->copts);
}
static kv_status call_decode_mla(void *p)
{
    struct attn2_ctx *x = p;
    return kv_attn_decode_mla(x->mla, 1, &x->mlq, &x->m_pages, 8, 0.25f, NULL, &x->mlo);
}
static kv_status call_prefill_mla(void *p)
{
    struct attn2_ctx *x = p;
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.window_left = 2;
    o.logit_soft_cap = 4.0f;
    o.lse = x->lse;
    return kv_attn_prefill_mla(x->mla, 0, &x->mlq, x->m_qo, &x->m_pages, 8, 0.25f, NULL, &x->mlo,
                               &o);
}

static void paged_mem(struct kv_paged_cache *pc, const struct kv_layout *lo, unsigned char **saved)
{
    pc->layout = *lo;
    pc->storage_bytes = (size_t)lo->total_bytes;
    pc->base = kv__mem_alloc_aligned(4096, pc->storage_bytes);
    *saved = malloc(pc->storage_bytes);
    assert_non_null(pc->base);
    assert_non_null(*saved);
    float *f = pc->base;
    for (size_t i = 0; i < pc->storage_bytes / sizeof(float); i++)
        f[i] = (float)((i * 29u) % 97u) / 97.0f - 0.5f;
    memcpy(*saved, pc->base, pc->storage_bytes);
    pc->mem = KV_MEM_HOST;
}

static void test_attn_more(struct attn_ctx *a)
{
    static struct attn2_ctx x;
    memset(&x, 0, sizeof(x));
    x.a = a;
    x.saved = malloc(a->pc.storage_bytes);
    assert_non_null(x.saved);
    memcpy(x.saved, a->pc.base, a->pc.storage_bytes);
    paged_mem(&x.pc2, &a->pc.layout, &x.saved2);

    struct kv_layout_config mc = KV_LAYOUT_CONFIG_INIT;
    mc.num_layers = 2, mc.num_blocks = 9, mc.block_tokens = 4, mc.num_heads = 1;
    mc.head_dim = 16, mc.dtype = KV_F32, mc.k_only = true;
    struct kv_layout ml;
    assert_int_equal(kv_layout_init(&mc, &ml), KV_OK);
    paged_mem(&x.mla, &ml, &x.mla_saved);
    ok_attn2(&x);

    /* decode with a window, a soft cap and the lse: q [2][4][8] */
    const int64_t dshape[3] = {2, 4, 8};
    assert_int_equal(kv_view_init(a->qbuf, sizeof(a->qbuf), KV_F32, 3, dshape, &a->q), KV_OK);
    assert_int_equal(kv_view_init(a->obuf, sizeof(a->obuf), KV_F32, 3, dshape, &a->out), KV_OK);
    struct oom_case c = {
        "kv_attn_decode_ex (opts)", &x, call_decode_ex, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);

    /* write: 16 tokens [16][2][8], scattered slots (one skipped) */
    const int64_t wshape[3] = {16, 2, 8};
    for (size_t i = 0; i < sizeof(x.kin) / sizeof(x.kin[0]); i++) {
        x.kin[i] = (float)i * 0.01f;
        x.vin[i] = (float)i * -0.02f;
    }
    static const int64_t slot_src[16] = {40, 41, 42, 7,  8,  -1, 60, 61,
                                         62, 63, 3,  20, 21, 22, 30, 31};
    for (int i = 0; i < 16; i++) {
        x.slots[i] = slot_src[i];
        x.slots32[i] = (int32_t)slot_src[i];
    }
    assert_int_equal(kv_view_init(x.kin, sizeof(x.kin), KV_F32, 3, wshape, &x.k), KV_OK);
    assert_int_equal(kv_view_init(x.vin, sizeof(x.vin), KV_F32, 3, wshape, &x.v), KV_OK);
    c = (struct oom_case){"kv_attn_write", &x, call_write, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);
    c = (struct oom_case){
        "kv_attn_write_i32", &x, call_write_i32, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);

    /* read the 15 tokens of the two sequences into [15][2][8] */
    const int64_t rshape[3] = {15, 2, 8};
    assert_int_equal(kv_view_init(a->obuf, sizeof(a->obuf), KV_F32, 3, rshape, &x.ko), KV_OK);
    assert_int_equal(kv_view_init(x.vout, sizeof(x.vout), KV_F32, 3, rshape, &x.vo), KV_OK);
    c = (struct oom_case){"kv_attn_read", &x, call_read, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);

    /* block copies: two unused blocks, then a layer range and one plane */
    const uint32_t B = (uint32_t)a->pc.layout.num_blocks;
    x.copies[0] = (struct kv_block_copy){1, B - 1, 0};
    x.copies[1] = (struct kv_block_copy){2, B - 2, 0};
    c = (struct oom_case){
        "kv_attn_copy_blocks", &x, call_copy_blocks, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);
    x.copts = (struct kv_copy_blocks_opts)KV_COPY_BLOCKS_OPTS_INIT;
    x.copts.layer0 = 1;
    x.copts.n_layers = 1;
    x.copts.planes = KV_ATTN_PLANE_V;
    c = (struct oom_case){
        "kv_attn_copy_blocks_ex", &x, call_copy_blocks_ex, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);
    x.copies[1] = (struct kv_block_copy){1, 3, 0}; /* another cache: any id on both sides */
    c = (struct oom_case){
        "kv_attn_copy_blocks_ex (2)", &x, call_copy_blocks_ex2, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);

    /* MLA: seq 0 has 7 tokens (pages 1, 2), seq 1 has 2 (page 5) */
    x.m_indptr[0] = 0, x.m_indptr[1] = 2, x.m_indptr[2] = 3;
    x.m_indices[0] = 1, x.m_indices[1] = 2, x.m_indices[2] = 5;
    x.m_last[0] = 3, x.m_last[1] = 2;
    x.m_pages = (struct kv_pages){.format = KV_PAGES_CSR,
                                  .n_seqs = 2,
                                  .page_ratio = 1,
                                  .indptr = x.m_indptr,
                                  .indices = x.m_indices,
                                  .last_page_len = x.m_last};
    for (size_t i = 0; i < sizeof(x.mq) / sizeof(x.mq[0]); i++)
        x.mq[i] = (float)((i * 11u) % 19u) / 19.0f - 0.5f;
    const int64_t mq2[3] = {2, 4, 16}, mo2[3] = {2, 4, 8};
    assert_int_equal(kv_view_init(x.mq, sizeof(x.mq), KV_F32, 3, mq2, &x.mlq), KV_OK);
    assert_int_equal(kv_view_init(x.mo, sizeof(x.mo), KV_F32, 3, mo2, &x.mlo), KV_OK);
    c = (struct oom_case){
        "kv_attn_decode_mla", &x, call_decode_mla, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);
    x.m_qo[0] = 0, x.m_qo[1] = 3, x.m_qo[2] = 5;
    const int64_t mq5[3] = {5, 4, 16}, mo5[3] = {5, 4, 8};
    assert_int_equal(kv_view_init(x.mq, sizeof(x.mq), KV_F32, 3, mq5, &x.mlq), KV_OK);
    assert_int_equal(kv_view_init(x.mo, sizeof(x.mo), KV_F32, 3, mo5, &x.mlo), KV_OK);
    c = (struct oom_case){
        "kv_attn_prefill_mla (opts)", &x, call_prefill_mla, attn2_snap, ok_attn2, NULL, KV_OK};
    oom_run(&c);

    kv__mem_free(x.pc2.base);
    kv__mem_free(x.mla.base);
    free(x.saved);
    free(x.saved2);
    free(x.mla_saved);
}

static void test_attn(void **state)
{
    (void)state;
    tokens_init();
    struct attn_ctx x;
    memset(&x, 0, sizeof(x));
    x.c = mk_cache();
    kv_page_table *pt = kv_cache_page_table(x.c);
    uint32_t seqs[2];
    assert_int_equal(kv_page_table_seq_create(pt, &seqs[0]), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, seqs[0], g_tokens, 9), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &seqs[1]), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, seqs[1], g_tokens + 20, 6), KV_OK);
    assert_int_equal(kv_cache_paged(x.c, &x.pc), KV_OK);
    float *kvmem = x.pc.base;
    for (size_t i = 0; i < x.pc.storage_bytes / sizeof(float); i++)
        kvmem[i] = (float)((i * 37u) % 101u) / 101.0f - 0.5f;
    struct kv_flashinfer_export e = {x.indptr, 3, x.indices, 16, x.last, 2};
    assert_int_equal(kv_page_table_export_flashinfer(pt, seqs, 2, &e, NULL), KV_OK);
    x.pages = (struct kv_pages){.format = KV_PAGES_CSR,
                                .n_seqs = 2,
                                .page_ratio = 2,
                                .indptr = x.indptr,
                                .indices = x.indices,
                                .last_page_len = x.last};
    for (size_t i = 0; i < sizeof(x.qbuf) / sizeof(x.qbuf[0]); i++) {
        x.qbuf[i] = (float)((i * 13u) % 17u) / 17.0f - 0.5f;
        x.obuf[i] = -7.0f;
    }
    const int64_t dshape[3] = {2, 4, 8};
    assert_int_equal(kv_view_init(x.qbuf, sizeof(x.qbuf), KV_F32, 3, dshape, &x.q), KV_OK);
    assert_int_equal(kv_view_init(x.obuf, sizeof(x.obuf), KV_F32, 3, dshape, &x.out), KV_OK);
    struct oom_case c = {"kv_attn_decode", &x, call_decode, attn_snap, ok_attn, NULL, KV_OK};
    oom_run(&c);

    const int64_t pshape[3] = {5, 4, 8}; /* 3 queries of seq 0, 2 of seq 1 */
    x.qo[0] = 0;
    x.qo[1] = 3;
    x.qo[2] = 5;
    assert_int_equal(kv_view_init(x.qbuf, sizeof(x.qbuf), KV_F32, 3, pshape, &x.q), KV_OK);
    assert_int_equal(kv_view_init(x.obuf, sizeof(x.obuf), KV_F32, 3, pshape, &x.out), KV_OK);
    c = (struct oom_case){"kv_attn_prefill", &x, call_prefill, attn_snap, ok_attn, NULL, KV_OK};
    oom_run(&c);
    test_attn_more(&x);
    kv_cache_destroy(x.c);
}

/* ---- TCP and same-host (SHM) transports: create, connect, regions ----------------- */

/* The cases (kvt_oom_xport.h) over TCP (no connect case) and SHM. */
static void test_xport(void **state)
{
    (void)state;
    static struct kvt_ox x;
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_TCP, false, 77, 1),
                           cb = kvt_xport_cfg(KV_XPORT_TCP, true, 77, 1);
    static const struct kvt_ox_names names = {"kv_xport_create", NULL, "kv_xport_mem_reg",
                                              "kv_xport_mem_expose", "kv_xport_rmem_import"};
    kvt_ox_run(&x, &names, &ca, &cb);
}

static void test_xport_shm(void **state)
{
    (void)state;
    static struct kvt_ox x;
    struct kv_xport_config ca = kvt_xport_cfg(KV_XPORT_SHM, false, 78, 1),
                           cb = kvt_xport_cfg(KV_XPORT_SHM, true, 78, 1);
    static const struct kvt_ox_names names = {"shm create", "shm connect", "shm mem_reg",
                                              "shm mem_expose", "shm rmem_import"};
    kvt_ox_run(&x, &names, &ca, &cb);
}

/* ---- posting transfers (TCP and SHM pairs) ------------------------------------------ */

/* The common part (modes 0-2: kvt_oom_post.h), and mode 3: a plan between
 * two layouts written with a notification. */
struct po_ctx {
    struct kvt_po base;
    /* the plan's sides */
    struct kvt_side s, d;
    unsigned char *d0, *ref;
    kv_plan *plan;
    kv_xport_mem *mps, *mpd;
    kv_xport_rmem *rp;
    uint32_t sid[4], did[4];
    uint64_t T;
};

static void po_snap(void *p, struct snap *s)
{
    struct po_ctx *x = p;
    kv_xport *a = x->base.p.a;
    kvt_po_snap(&x->base, s);
    pthread_mutex_lock(&a->mu);
    snap_put(s, a->stats.plans_gathered);
    snap_put(s, a->stats.plans_direct);
    snap_put(s, x->mps->users);
    snap_put(s, x->rp->users);
    pthread_mutex_unlock(&a->mu);
    snap_bytes(s, x->d.mem, (size_t)x->d.lo.total_bytes);
}

static kv_status call_post(void *p)
{
    struct po_ctx *x = p;
    if (x->base.mode != 3)
        return kvt_po_call(&x->base);
    const struct kv_xport_notify nt = kvt_po_begin(&x->base);
    return kv_xport_write_plan(x->base.p.pa, x->plan, x->mps, 0, x->sid, 4, x->rp, 0, x->did, 4,
                               x->T, &nt, &x->base.t);
}

static void ok_post(void *p)
{
    struct po_ctx *x = p;
    if (x->base.mode != 3) {
        kvt_po_ok(&x->base);
        return;
    }
    kvt_po_done(&x->base);
    kvt_po_note(&x->base);
    assert_memory_equal(x->d.mem, x->ref, (size_t)x->d.lo.total_bytes);
    memcpy(x->d.mem, x->d0, (size_t)x->d.lo.total_bytes);
}

/* Nothing queued: the handle untouched, the regions free again at once
 * (deregistered / freed and made again), no notification at b. */
static void failed_post(void *p)
{
    struct po_ctx *x = p;
    if (x->base.mode != 3) {
        kvt_po_failed(&x->base);
        return;
    }
    kvt_po_untouched(&x->base);
    assert_int_equal(kv_xport_mem_dereg(x->mps), KV_OK);
    assert_int_equal(
        kv_xport_mem_reg(x->base.p.a, x->s.mem, (size_t)x->s.lo.total_bytes, KV_MEM_HOST, &x->mps),
        KV_OK);
    assert_int_equal(kv_xport_rmem_free(x->rp), KV_OK);
    x->rp = kvt_share_direct(&x->base.p, x->mpd);
    kvt_po_quiet(&x->base);
}

static void po_open(struct po_ctx *x, kv_xport_kind kind)
{
    struct kv_xport_config ca = kvt_xport_cfg(kind, false, 79, 3),
                           cb = kvt_xport_cfg(kind, true, 79, 3);
    kvt_pair_open(&x->base.p, &ca, &cb);
    kvt_po_open(&x->base);
    /* a plan between two layouts (NHD -> HND), 4 blocks of each */
    kvt_side_make(&x->s, 2, 12, 8, 2, 16, KV_F16, 0, 31);
    kvt_side_make(&x->d, 2, 10, 8, 2, 16, KV_F16, 1, 32);
    x->T = 30;
    const uint32_t sid[4] = {7, 2, 11, 4}, did[4] = {3, 9, 1, 6};
    memcpy(x->sid, sid, sizeof(sid));
    memcpy(x->did, did, sizeof(did));
    assert_int_equal(kv_plan_create(&x->s.lo, &x->d.lo, NULL, &x->plan), KV_OK);
    const size_t db = (size_t)x->d.lo.total_bytes;
    x->d0 = malloc(db);
    x->ref = malloc(db);
    assert_true(x->d0 && x->ref);
    memcpy(x->d0, x->d.mem, db);
    memcpy(x->ref, x->d.mem, db);
    struct kv_paged_cache rc = x->d.pc;
    rc.base = x->ref;
    assert_int_equal(kv_plan_copy(x->plan, x->s.pc, x->sid, 4, rc, x->did, 4, x->T), KV_OK);
    assert_true(memcmp(x->ref, x->d0, db) != 0);
    assert_int_equal(
        kv_xport_mem_reg(x->base.p.a, x->s.mem, (size_t)x->s.lo.total_bytes, KV_MEM_HOST, &x->mps),
        KV_OK);
    assert_int_equal(kv_xport_mem_reg(x->base.p.b, x->d.mem, db, KV_MEM_HOST, &x->mpd), KV_OK);
    x->rp = kvt_share_direct(&x->base.p, x->mpd);
}

static void po_close(struct po_ctx *x)
{
    assert_int_equal(kv_xport_rmem_free(x->rp), KV_OK);
    assert_int_equal(kv_xport_mem_unexpose(x->base.p.pb, x->mpd), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x->mps), KV_OK);
    assert_int_equal(kv_xport_mem_dereg(x->mpd), KV_OK);
    kvt_po_close(&x->base); /* the pair closed: after every region */
    kv_plan_destroy(x->plan);
    kvt_side_free(&x->s);
    kvt_side_free(&x->d);
    free(x->d0);
    free(x->ref);
}

static void post_cases(kv_xport_kind kind)
{
    static struct po_ctx x;
    memset(&x, 0, sizeof(x));
    po_open(&x, kind);
    static const char *const names[2][6] = {
        {"tcp write", "tcp write+note", "tcp read", "tcp plan direct", "tcp plan gathered"},
        {"shm write", "shm write+note", "shm read", "shm plan direct", "shm plan gathered"}};
    for (int mode = 0; mode < 5; mode++) {
        x.base.mode = mode < 3 ? mode : 3;
        if (mode >= 3) /* never gathered / always (the sender's threshold) */
            x.base.p.a->cfg.plan_gather_below_bytes = mode == 3 ? 1u : UINT32_MAX;
        struct oom_case c = {
            names[kind == KV_XPORT_SHM][mode], &x, call_post, po_snap, ok_post, failed_post, KV_OK};
        oom_run(&c);
    }
    struct kv_xport_stats st = KV_XPORT_STATS_INIT;
    assert_int_equal(kv_xport_stats_get(x.base.p.a, &st), KV_OK);
    assert_true(st.plans_direct > 0);
    assert_true(st.plans_gathered > 0);
    po_close(&x);
}

static void test_xport_post(void **state)
{
    (void)state;
    post_cases(KV_XPORT_TCP);
    post_cases(KV_XPORT_SHM);
}

/* ---- layer by layer ----------------------------------------------------------------- */

struct xl_ctx {
    struct po_ctx *po;
    kv_xlayer_tx *tx;
    kv_xlayer_rx *rx;
    uint64_t req;
    void *out;
};

static kv_status call_xl_tx_create(void *p)
{
    struct xl_ctx *x = p;
    struct kv_xlayer_tx_config c = KV_XLAYER_TX_CONFIG_INIT;
    x->out = SENTINEL;
    return kv_xlayer_tx_create(&c, (kv_xlayer_tx **)&x->out);
}
static void ok_xl_tx_create(void *p)
{
    struct xl_ctx *x = p;
    assert_int_equal(kv_xlayer_tx_destroy(x->out), KV_OK);
}
static kv_status call_xl_rx_create(void *p)
{
    struct xl_ctx *x = p;
    struct kv_xlayer_rx_config c = KV_XLAYER_RX_CONFIG_INIT;
    x->out = SENTINEL;
    return kv_xlayer_rx_create(&c, (kv_xlayer_rx **)&x->out);
}
static void ok_xl_rx_create(void *p)
{
    struct xl_ctx *x = p;
    assert_int_equal(kv_xlayer_rx_destroy(x->out), KV_OK);
}
static void failed_xl_out(void *p)
{
    struct xl_ctx *x = p;
    assert_ptr_equal(x->out, SENTINEL);
}

/* The next request: 2 layers (the plan moves both), expected at b, begun at a. */
static void xl_begin(struct xl_ctx *x)
{
    x->req++;
    assert_int_equal(kv_xlayer_rx_expect(x->rx, kv_xport_peer_id(x->po->base.p.pb), x->req, 2),
                     KV_OK);
    assert_int_equal(kv_xlayer_tx_begin(x->tx, x->po->base.p.pa, x->req, 2), KV_OK);
}

static void xl_snap(void *p, struct snap *s)
{
    struct xl_ctx *x = p;
    po_snap(x->po, s);
    /* the request as it was: not terminal, no layer posted at b */
    snap_put(s, (uint64_t)(int64_t)kv_xlayer_tx_wait(x->tx, x->req, 0));
    struct kv_xlayer_rx_stats st = KV_XLAYER_RX_STATS_INIT;
    assert_int_equal(kv_xlayer_rx_stats_get(x->rx, &st), KV_OK);
    snap_put(s, st.tracked);
    snap_put(s, st.notes_layers);
}

static kv_status call_xl_post(void *p)
{
    struct xl_ctx *x = p;
    struct po_ctx *o = x->po;
    return kv_xlayer_tx_post(x->tx, x->req, o->plan, 0, 2, o->mps, 0, o->sid, 4, o->rp, 0, o->did,
                             4, o->T);
}

/* decode fed the request's notification (LAYERS or ABORT): the request
 * reported on both sides with want; the next one begun. */
static void xl_finish(struct xl_ctx *x, kv_status want)
{
    struct po_ctx *o = x->po;
    assert_int_equal(kv_xport_notify_poll(o->base.p.b, 5000, o->base.msg), KV_OK);
    assert_int_equal(o->base.msg->tag, KV_XLAYER_TAG);
    assert_int_equal(kv_xlayer_rx_feed(x->rx, o->base.msg), KV_OK);
    if (want == KV_OK)
        assert_int_equal(kv_xlayer_rx_wait(x->rx, x->req, 1, 5000), KV_OK);
    assert_int_equal(kv_xlayer_tx_wait(x->tx, x->req, 5000), want);
    struct kv_xlayer_done d[2];
    uint32_t n = 0;
    assert_int_equal(kv_xlayer_tx_finished(x->tx, d, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(d[0].request, x->req);
    assert_int_equal(d[0].status, want);
    assert_int_equal(kv_xlayer_rx_finished(x->rx, d, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(d[0].request, x->req);
    assert_int_equal(d[0].status, want);
    xl_begin(x);
}

static void ok_xl_post(void *p)
{
    struct xl_ctx *x = p;
    xl_finish(x, KV_OK);
    assert_memory_equal(x->po->d.mem, x->po->ref, (size_t)x->po->d.lo.total_bytes);
    memcpy(x->po->d.mem, x->po->d0, (size_t)x->po->d.lo.total_bytes);
}

static void failed_xl_post(void *p)
{
    struct xl_ctx *x = p;
    assert_int_equal(kv_xport_notify_poll(x->po->base.p.b, 0, x->po->base.msg), KV_ERR_TIMEOUT);
}

/* cancel of a request with nothing in flight: ABORT sent at once */
static kv_status call_xl_cancel(void *p)
{
    struct xl_ctx *x = p;
    return kv_xlayer_tx_cancel(x->tx, x->req);
}
static void ok_xl_cancel(void *p)
{
    struct xl_ctx *x = p;
    /* KV_OK: decode is told (ABORT, sent by the time the request is
     * terminal), else it holds the request for ever */
    assert_int_equal(kv_xlayer_tx_wait(x->tx, x->req, 5000), KV_ERR_CANCELLED);
    const kv_status st = kv_xport_notify_poll(x->po->base.p.b, 2000, x->po->base.msg);
    if (st != KV_OK)
        fail_msg("kv_xlayer_tx_cancel: KV_OK, but no ABORT reached decode (%s)",
                 kv_status_name(st));
    assert_int_equal(x->po->base.msg->tag, KV_XLAYER_TAG);
    assert_int_equal(kv_xlayer_rx_feed(x->rx, x->po->base.msg), KV_OK);
    struct kv_xlayer_done d[2];
    uint32_t n = 0;
    assert_int_equal(kv_xlayer_tx_finished(x->tx, d, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(kv_xlayer_rx_finished(x->rx, d, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(d[0].status, KV_ERR_CANCELLED);
    xl_begin(x);
}

static void test_xport_layers(void **state)
{
    (void)state;
    static struct po_ctx o;
    static struct xl_ctx x;
    memset(&o, 0, sizeof(o));
    memset(&x, 0, sizeof(x));
    x.po = &o;
    struct oom_case c = {"xlayer_tx_create", &x,   call_xl_tx_create, NULL, ok_xl_tx_create,
                         failed_xl_out,      KV_OK};
    oom_run(&c);
    c = (struct oom_case){"xlayer_rx_create", &x,   call_xl_rx_create, NULL, ok_xl_rx_create,
                          failed_xl_out,      KV_OK};
    oom_run(&c);
    for (int kind = 0; kind < 2; kind++) {
        po_open(&o, kind ? KV_XPORT_SHM : KV_XPORT_TCP);
        struct kv_xlayer_tx_config tc = KV_XLAYER_TX_CONFIG_INIT;
        struct kv_xlayer_rx_config rc = KV_XLAYER_RX_CONFIG_INIT;
        assert_int_equal(kv_xlayer_tx_create(&tc, &x.tx), KV_OK);
        assert_int_equal(kv_xlayer_rx_create(&rc, &x.rx), KV_OK);
        xl_begin(&x);
        for (int g = 0; g < 2; g++) {
            o.base.p.a->cfg.plan_gather_below_bytes = g ? UINT32_MAX : 1u;
            c = (struct oom_case){kind ? "shm xlayer_tx_post" : "tcp xlayer_tx_post",
                                  &x,
                                  call_xl_post,
                                  xl_snap,
                                  ok_xl_post,
                                  failed_xl_post,
                                  KV_OK};
            oom_run(&c);
        }
        c = (struct oom_case){kind ? "shm xlayer_tx_cancel" : "tcp xlayer_tx_cancel",
                              &x,
                              call_xl_cancel,
                              xl_snap,
                              ok_xl_cancel,
                              failed_xl_post,
                              KV_OK};
        oom_run(&c);
        assert_int_equal(kv_xlayer_tx_cancel(x.tx, x.req), KV_OK);
        assert_int_equal(kv_xlayer_tx_wait(x.tx, x.req, 5000), KV_ERR_CANCELLED);
        struct kv_xlayer_done d[2];
        uint32_t n = 0;
        assert_int_equal(kv_xlayer_tx_finished(x.tx, d, 2, &n), KV_OK);
        assert_int_equal(n, 1);
        assert_int_equal(kv_xport_notify_poll(o.base.p.b, 5000, o.base.msg), KV_OK); /* its ABORT */
        assert_int_equal(kv_xlayer_rx_feed(x.rx, o.base.msg), KV_OK);
        assert_int_equal(kv_xlayer_rx_finished(x.rx, d, 2, &n), KV_OK);
        assert_int_equal(n, 1);
        assert_int_equal(kv_xlayer_tx_destroy(x.tx), KV_OK);
        assert_int_equal(kv_xlayer_rx_destroy(x.rx), KV_OK);
        po_close(&o);
    }
}

/* ---- the hook itself ---------------------------------------------------------------- */

static void test_hook(void **state)
{
    (void)state;
    const uint64_t f0 = kv__mem_failed();
    kv__mem_fail_after(2);
    void *a = kv__mem_alloc(8), *b = kv__mem_calloc(2, 8), *c = kv__mem_alloc(8);
    size_t cap = 0;
    void *d = kv__mem_grow(NULL, &cap, 0, 4, 8, 4);
    kv__mem_fail_after(-1);
    assert_non_null(a);
    assert_non_null(b);
    assert_null(c);
    assert_null(d);
    assert_int_equal(cap, 0);
    assert_int_equal(kv__mem_failed() - f0, 2);
    void *e = kv__mem_alloc_aligned(64, 8);
    assert_non_null(e);
    kv__mem_free(a);
    kv__mem_free(b);
    kv__mem_free(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hook),        cmocka_unit_test(test_create),
        cmocka_unit_test(test_page_table),  cmocka_unit_test(test_pool_calls),
        cmocka_unit_test(test_dlpack),      cmocka_unit_test(test_plan),
        cmocka_unit_test(test_plan_ranges), cmocka_unit_test(test_view),
        cmocka_unit_test(test_offload),     cmocka_unit_test(test_attn),
        cmocka_unit_test(test_xport),       cmocka_unit_test(test_xport_shm),
        cmocka_unit_test(test_xport_post),  cmocka_unit_test(test_xport_layers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
