/*
 * test_cache.c - the cache object end to end, through the public API only
 * (linked against libkvcache.so).
 *
 * For every arrangement x in-block order x padding: sequences get blocks far
 * from 0 (a filler sequence holds the low ids), K/V of every token is written
 * through the per-layer views at the slots the vLLM export gives, read back
 * through the CSR export, a fork takes a copy-on-write copy (performed through
 * the layout's block byte runs), and the WHOLE arena is compared against an
 * independent model of which bytes were written.
 *
 * Every create (cache, arena, pool, offload tier) checks its whole config
 * before it allocates: probed in a forked child under RLIMIT_AS, where a
 * create that mapped its GiBs first would answer KV_ERR_NO_MEMORY instead
 * of naming the field.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include <kvcache/kv.h>

#include "kvtest.h"

enum { L = 3, B = 2048, N = 16, H = 4, D = 8, FILLER_BLOCKS = 1500 };

/* The value a token's K/V element should hold: never 0 (0 = untouched). */
static uint16_t val(uint32_t tag, uint64_t t, uint32_t l, int kv, uint32_t h, uint32_t d)
{
    uint64_t x = tag * 0x9E3779B97F4A7C15ull ^ (t << 20) ^ ((uint64_t)l << 12) ^
                 ((uint64_t)kv << 11) ^ ((uint64_t)h << 5) ^ d;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return (uint16_t)(x | 1);
}

struct model {
    uint16_t *expect; /* same size as the arena in elements; 0 = untouched */
    size_t elems;
};

/* The layout config of the cache under test: the model addresses elements
 * through it (kvt_ref_offset_elems), never through the library's strides. */
static struct kv_layout_config g_cfg;

/* Write tag's values for tokens [start, start+count) of seq through the
 * per-layer views at the slots of the vLLM export; record them in the model. */
static void write_tokens(kv_cache *c, struct model *m, uint32_t seq, uint32_t tag, uint64_t start,
                         uint64_t count)
{
    kv_page_table *pt = kv_cache_page_table(c);
    int64_t slots[256];
    struct kv_token_range r = {start, count};
    struct kv_vllm_export ex = {0};
    assert_true(count <= 256);
    ex.slot_mapping = slots;
    ex.slot_mapping_len = count;
    assert_int_equal(kv_page_table_export_vllm(pt, &seq, 1, &r, &ex), KV_OK);
    for (uint64_t i = 0; i < count; i++) {
        int64_t blk = slots[i] / N, tok = slots[i] % N;
        assert_true(slots[i] >= 0);
        for (uint32_t l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++) {
                struct kv_view v;
                assert_int_equal(kv_cache_kv_view(c, l, kv, &v), KV_OK);
                for (uint32_t h = 0; h < H; h++)
                    for (uint32_t d = 0; d < D; d++) {
                        int64_t idx[4] = {blk, tok, h, d};
                        uint16_t *p = kv_view_ptr(&v, idx); /* where the library writes */
                        assert_non_null(p);
                        *p = val(tag, start + i, l, kv, h, d);
                        /* where the config says the element is */
                        m->expect[kvt_ref_offset_elems(&g_cfg, l, kv, blk, tok, h, d)] = *p;
                    }
            }
    }
}

/* Read every token of seq through the FlashInfer CSR export and compare. */
/* Lowest page id the sequences under test may use (the filler holds the rest). */
static int32_t g_min_page;

static void check_tokens(kv_cache *c, uint32_t seq, uint32_t tag, uint64_t start, uint64_t count)
{
    kv_page_table *pt = kv_cache_page_table(c);
    int32_t indptr[2], indices[512], last[1];
    struct kv_flashinfer_export ex = {indptr, 2, indices, 512, last, 1};
    uint64_t nnz = 0;
    assert_int_equal(kv_page_table_export_flashinfer(pt, &seq, 1, &ex, &nnz), KV_OK);
    for (uint64_t t = start; t < start + count; t++) {
        int32_t page = indices[t / N];   /* page ratio 1 in this test */
        assert_true(page >= g_min_page); /* far from block 0 */
        for (uint32_t l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++) {
                const uint16_t *a = kv_arena_base(kv_cache_arena(c));
                for (uint32_t h = 0; h < H; h++)
                    for (uint32_t d = 0; d < D; d++) {
                        int64_t e =
                            kvt_ref_offset_elems(&g_cfg, l, kv, page, (int64_t)(t % N), h, d);
                        assert_int_equal(a[e], val(tag, t, l, kv, h, d));
                    }
            }
    }
}

/* Perform queued copy-on-write copies with the block copy kernel (all of
 * them at once, as an engine does). */
static void run_copies(kv_cache *c, struct model *m)
{
    struct kv_block_copy cp[8];
    uint32_t n = 0;
    struct kv_paged_cache pc;
    assert_int_equal(kv_cache_paged(c, &pc), KV_OK);
    assert_int_equal(kv_page_table_take_copies(kv_cache_page_table(c), cp, 8, &n), KV_OK);
    assert_int_equal(kv_attn_copy_blocks(pc, cp, n), KV_OK);
    for (uint32_t i = 0; i < n; i++) {
        /* the model copies element by element at the reference addresses */
        for (uint32_t l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++)
                for (uint32_t t = 0; t < N; t++)
                    for (uint32_t h = 0; h < H; h++)
                        for (uint32_t d = 0; d < D; d++)
                            m->expect[kvt_ref_offset_elems(&g_cfg, l, kv, cp[i].dst, t, h, d)] =
                                m->expect[kvt_ref_offset_elems(&g_cfg, l, kv, cp[i].src, t, h, d)];
    }
    assert_int_equal(kv_page_table_copies_done(kv_cache_page_table(c)), KV_OK);
}

static void check_arena(kv_cache *c, const struct model *m)
{
    const uint16_t *a = kv_arena_base(kv_cache_arena(c));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < m->elems; i++)
        if (a[i] != m->expect[i] && bad++ == 0)
            first = i;
    if (bad)
        fail_msg("%zu arena elements differ from the model, first at element %zu (%u vs %u)", bad,
                 first, a[first], m->expect[first]);
}

static void run_case(kv_arrange arrange, kv_order order, int64_t pad)
{
    struct kv_cache_config cfg;
    kv_cache *c = NULL;
    kv_page_table *pt;
    struct model m;
    uint32_t filler, s1, s2, child;
    int32_t toks[200];
    const struct kv_layout *lo;

    kv_cache_config_init(&cfg);
    cfg.layout.num_layers = L;
    cfg.layout.num_blocks = B;
    cfg.layout.block_tokens = N;
    cfg.layout.num_heads = H;
    cfg.layout.head_dim = D;
    cfg.layout.dtype = KV_BF16;
    cfg.layout.order = order;
    cfg.layout.arrange = arrange;
    cfg.layout.block_pad_elems = pad;
    cfg.max_seqs = 8;
    cfg.zero_fill = true;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    g_cfg = cfg.layout;
    lo = kv_cache_layout(c);
    pt = kv_cache_page_table(c);
    m.elems = (size_t)lo->total_elems;
    m.expect = calloc(m.elems, 2);
    assert_non_null(m.expect);
    for (int i = 0; i < 200; i++)
        toks[i] = 1000 + i;

    /* Hold the low block ids so the sequences under test get ids >= 1500. */
    g_min_page = FILLER_BLOCKS;
    assert_int_equal(kv_page_table_seq_create(pt, &filler), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, filler, NULL, (uint64_t)FILLER_BLOCKS * N - N),
                     KV_OK);

    assert_int_equal(kv_page_table_seq_create(pt, &s1), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &s2), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s1, toks, 37), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s2, toks, 70), KV_OK);
    write_tokens(c, &m, s1, 1, 0, 37);
    write_tokens(c, &m, s2, 2, 0, 70);

    /* Fork s1 (37 tokens: the third block is partial and now shared). */
    assert_int_equal(kv_page_table_seq_fork(pt, s1, &child), KV_OK);
    {
        uint32_t need = 0;
        assert_int_equal(kv_page_table_blocks_needed(pt, child, 5, &need), KV_OK);
        assert_int_equal(need, 1); /* no new block, one private copy */
        assert_int_equal(kv_page_table_blocks_needed(pt, child, 12, &need), KV_OK);
        assert_int_equal(need, 2); /* 49 tokens: a 4th block + the copy */
        assert_int_equal(kv_page_table_blocks_needed(pt, child, 0, &need), KV_OK);
        assert_int_equal(need, 0);
    }
    assert_int_equal(kv_page_table_seq_append(pt, child, toks + 37, 5), KV_OK);
    assert_int_equal(kv_page_table_pending_copies(pt), 1);
    run_copies(c, &m);
    write_tokens(c, &m, child, 3, 37, 5);
    assert_int_equal(kv_page_table_seq_append(pt, s1, toks + 37, 4), KV_OK);
    write_tokens(c, &m, s1, 4, 37, 4);

    check_tokens(c, s1, 1, 0, 37);
    check_tokens(c, s1, 4, 37, 4);
    check_tokens(c, s2, 2, 0, 70);
    check_tokens(c, child, 1, 0, 37); /* inherited, incl. the copied partial block */
    check_tokens(c, child, 3, 37, 5);
    check_arena(c, &m); /* no stray writes anywhere, padding included */

    free(m.expect);
    kv_cache_destroy(c); /* live sequences release their blocks */
}

static void test_cache_layer_major_nhd(void **s)
{
    (void)s;
    run_case(KV_ARRANGE_LAYER_MAJOR, KV_ORDER_NHD, 0);
}
static void test_cache_layer_major_hnd_padded(void **s)
{
    (void)s;
    run_case(KV_ARRANGE_LAYER_MAJOR, KV_ORDER_HND, 24);
}
static void test_cache_block_major_nhd_padded(void **s)
{
    (void)s;
    run_case(KV_ARRANGE_BLOCK_MAJOR, KV_ORDER_NHD, 40);
}
static void test_cache_block_major_hnd(void **s)
{
    (void)s;
    run_case(KV_ARRANGE_BLOCK_MAJOR, KV_ORDER_HND, 0);
}

/* A cached prefix is reused by a new sequence with the same tokens, and the
 * K/V the first sequence wrote is what the second one reads. */
static void test_cache_prefix_reuse(void **state)
{
    struct kv_cache_config cfg;
    kv_cache *c = NULL;
    kv_page_table *pt;
    struct model m;
    uint32_t a, b;
    uint64_t cached = 0;
    int32_t toks[100];
    struct kv_block_pool_stats st;
    (void)state;
    kv_cache_config_init(&cfg);
    cfg.layout = (struct kv_layout_config){.struct_size = sizeof(struct kv_layout_config),
                                           .num_layers = L,
                                           .num_blocks = 64,
                                           .block_tokens = N,
                                           .num_heads = H,
                                           .head_dim = D,
                                           .dtype = KV_BF16};
    cfg.max_seqs = 4;
    cfg.enable_prefix_caching = true;
    g_min_page = 1;
    cfg.zero_fill = true;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    g_cfg = cfg.layout;
    pt = kv_cache_page_table(c);
    m.elems = (size_t)kv_cache_layout(c)->total_elems;
    m.expect = calloc(m.elems, 2);
    for (int i = 0; i < 100; i++)
        toks[i] = 7 * i + 3;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, toks, 56), KV_OK); /* 3 full + 8 */
    write_tokens(c, &m, a, 9, 0, 56);
    assert_int_equal(kv_page_table_seq_free(pt, a), KV_OK);
    assert_int_equal(kv_page_table_seq_create_from_prefix(pt, toks, 60, &b, &cached), KV_OK);
    assert_int_equal(cached, 3 * N);
    kv_block_pool_stats_get(kv_cache_pool(c), &st);
    assert_int_equal(st.hits, 3);
    assert_int_equal(kv_page_table_seq_append(pt, b, toks + cached, 60 - cached), KV_OK);
    check_tokens(c, b, 9, 0, 3 * N); /* written by a, read by b */
    free(m.expect);
    kv_cache_destroy(c);
}

/* Freed sequences release last-to-first, so under memory pressure the pool
 * evicts a cached prefix from its tail and the head stays reusable. */
static void test_cache_prefix_survives_pressure(void **state)
{
    struct kv_cache_config cfg;
    kv_cache *c = NULL;
    kv_page_table *pt;
    uint32_t a, b, d;
    uint64_t cached = 99;
    int32_t toks[13], other[8];
    (void)state;
    kv_cache_config_init(&cfg);
    cfg.layout = (struct kv_layout_config){.struct_size = sizeof(struct kv_layout_config),
                                           .num_layers = 1,
                                           .num_blocks = 5,
                                           .block_tokens = 4,
                                           .num_heads = 1,
                                           .head_dim = 8,
                                           .dtype = KV_F16};
    cfg.max_seqs = 4;
    cfg.enable_prefix_caching = true;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK); /* 4 usable blocks */
    pt = kv_cache_page_table(c);
    for (int i = 0; i < 13; i++)
        toks[i] = 50 + i;
    for (int i = 0; i < 8; i++)
        other[i] = 900 + i;
    assert_int_equal(kv_page_table_seq_create(pt, &a), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, a, toks, 12), KV_OK); /* 3 full blocks */
    assert_int_equal(kv_page_table_seq_free(pt, a), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &b), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, b, other, 8), KV_OK); /* evicts 1 cached */
    assert_int_equal(kv_page_table_seq_create_from_prefix(pt, toks, 13, &d, &cached), KV_OK);
    assert_int_equal(cached, 8); /* blocks 1 and 2 of a survived; its last block was evicted */
    kv_cache_destroy(c);
}

/* layout.num_blocks = B counts the null block: a cache of B = 9 hands out
 * exactly 8 blocks (ids 1..8, never 0), (B - 1) * N tokens, and no more. */
static void test_cache_null_block_not_usable(void **state)
{
    (void)state;
    enum { NB = 9, NT = 4 };
    struct kv_cache_config cfg;
    kv_cache *c = NULL;
    kv_cache_config_init(&cfg);
    cfg.layout.num_layers = 1;
    cfg.layout.num_blocks = NB;
    cfg.layout.block_tokens = NT;
    cfg.layout.num_heads = 1;
    cfg.layout.head_dim = 4;
    cfg.layout.dtype = KV_F16;
    cfg.max_seqs = 2;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(kv_cache_pool(c), &ps);
    assert_int_equal(ps.capacity, NB - 1);
    assert_int_equal(ps.free_blocks, NB - 1);
    kv_page_table *pt = kv_cache_page_table(c);
    uint32_t s1, s2;
    assert_int_equal(kv_page_table_seq_create(pt, &s1), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &s2), KV_OK);
    /* (B - 1) * N tokens fit, in blocks 1..B-1 */
    assert_int_equal(kv_page_table_seq_append(pt, s1, NULL, (NB - 1) * NT), KV_OK);
    const uint32_t *blocks;
    uint32_t nb;
    assert_int_equal(kv_page_table_seq_blocks(pt, s1, &blocks, &nb), KV_OK);
    assert_int_equal(nb, NB - 1);
    bool seen[NB] = {false};
    for (uint32_t i = 0; i < nb; i++) {
        assert_true(blocks[i] >= 1 && blocks[i] < NB);
        assert_false(seen[blocks[i]]);
        seen[blocks[i]] = true;
    }
    /* one token more needs a B-th block: there is none */
    assert_int_equal(kv_page_table_seq_append(pt, s2, NULL, 1), KV_ERR_NO_BLOCKS);
    kv_block_pool_stats_get(kv_cache_pool(c), &ps);
    assert_int_equal(ps.used_blocks, NB - 1);
    assert_int_equal(ps.free_blocks, 0);
    kv_cache_destroy(c);
}

/* The parts a cache hands out (arena, pool, page table) are refused by
 * their own destroys, by name, and nothing is freed: the cache works on
 * (under ASan, a part freed there is a use after free below, and freed
 * twice by kv_cache_destroy). */
static void test_cache_parts_refuse_their_own_destroy(void **state)
{
    (void)state;
    struct kv_cache_config cfg;
    kv_cache *c = NULL;
    kv_cache_config_init(&cfg);
    cfg.layout.num_layers = 2;
    cfg.layout.num_blocks = 9;
    cfg.layout.block_tokens = 4;
    cfg.layout.num_heads = 2;
    cfg.layout.head_dim = 8;
    cfg.layout.dtype = KV_F16;
    cfg.max_seqs = 2;
    cfg.zero_fill = true;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    kv_arena_destroy(kv_cache_arena(c));
    assert_non_null(strstr(kv_last_error(), "kv_arena_destroy: the arena of a kv_cache"));
    kv_block_pool_destroy(kv_cache_pool(c));
    assert_non_null(strstr(kv_last_error(), "kv_block_pool_destroy: the pool of a kv_cache"));
    kv_page_table_destroy(kv_cache_page_table(c));
    assert_non_null(strstr(kv_last_error(), "kv_page_table_destroy: the page table of a kv_cache"));
    kv_page_table *pt = kv_cache_page_table(c);
    uint32_t s;
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, NULL, 4 * 8), KV_OK);
    struct kv_block_pool_stats ps;
    kv_block_pool_stats_get(kv_cache_pool(c), &ps);
    assert_int_equal(ps.used_blocks, 8);
    unsigned char *base = kv_arena_base(kv_cache_arena(c));
    const size_t bytes = kv_arena_size(kv_cache_arena(c));
    memset(base, 0x5a, bytes); /* the whole arena still the cache's */
    assert_int_equal(base[bytes - 1], 0x5a);
    /* a reference of a user's own is counted: the arena outlives the cache */
    kv_arena *ar = kv_arena_retain(kv_cache_arena(c));
    kv_cache_destroy(c);
    assert_int_equal(base[0], 0x5a);
    assert_int_equal(base[bytes - 1], 0x5a);
    kv_arena_release(ar);
}

static void test_cache_bad_config(void **state)
{
    struct kv_cache_config cfg;
    kv_cache *c = (kv_cache *)0x1;
    (void)state;
    kv_cache_config_init(&cfg);
    cfg.layout = (struct kv_layout_config){.struct_size = sizeof(struct kv_layout_config),
                                           .num_layers = 2,
                                           .num_blocks = 1,
                                           .block_tokens = 16,
                                           .num_heads = 2,
                                           .head_dim = 64,
                                           .dtype = KV_F16};
    cfg.max_seqs = 1;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_INVALID_ARG); /* 1 block: only null */
    assert_non_null(strstr(kv_last_error(), "num_blocks 1"));
    cfg.layout.num_blocks = 8;
    cfg.layout.head_dim = 0;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_BAD_SHAPE);
    assert_true(c == (kv_cache *)0x1); /* *out untouched on failure */
    cfg.layout.head_dim = 64;
    cfg.mem_kind = KV_MEM_DEVICE;
    cfg.zero_fill = true; /* refused for device memory, GPU or not */
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_UNSUPPORTED);
    assert_non_null(strstr(kv_last_error(), "zero_fill"));
    cfg.zero_fill = false;
    {
        /* the runner says whether a GPU exists (scripts/gpu-check.sh sets
         * KV_EXPECT_GPU=1); the test never infers it from the result */
        const char *e = getenv("KV_EXPECT_GPU");
        kv_status st = kv_cache_create(&cfg, &c);
        if (e && e[0] == '1') {
            assert_int_equal(st, KV_OK);
            kv_cache_destroy(c);
            c = (kv_cache *)0x1; /* the sentinel the refusals below check */
        } else {
            assert_int_equal(st, KV_ERR_UNSUPPORTED);
            assert_non_null(strstr(kv_last_error(), "device memory"));
        }
    }
    /* A 2 TiB arena is refused at once, before the pool or table is built
     * and without mapping it; a bad table setting on a cache that fits is
     * refused with its own name, and nothing is left behind. */
    cfg.mem_kind = KV_MEM_HOST;
    cfg.layout.num_blocks = 1 << 20;
    cfg.layout.num_heads = 64;
    cfg.layout.head_dim = 256;
    cfg.max_seqs = 1;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_NO_MEMORY);
    assert_non_null(strstr(kv_last_error(), "physical memory"));
    cfg.layout.num_blocks = 8;
    cfg.max_seqs = 0;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "max_seqs"));
    assert_true(c == (kv_cache *)0x1);
    assert_int_equal(kv_cache_create(NULL, &c), KV_ERR_NULL);
    kv_cache_destroy(NULL);
}

/* Bounds and error detail across modules: a config that can never work is
 * refused before anything large is touched, naming the bound; a failed
 * append keeps the pool's own words; a small layout alignment never lowers
 * the arena's. */
static void test_cache_limits_and_error_detail(void **state)
{
    struct kv_cache_config cfg;
    kv_cache *c = NULL;
    (void)state;
    kv_cache_config_init(&cfg);
    cfg.layout = (struct kv_layout_config){.struct_size = sizeof(struct kv_layout_config),
                                           .num_layers = 2,
                                           .num_blocks = 64,
                                           .block_tokens = 16,
                                           .num_heads = 8,
                                           .head_dim = 128,
                                           .dtype = KV_BF16,
                                           .align_bytes = 128};
    cfg.max_seqs = KV_PAGE_TABLE_MAX_SEQS + 1;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "KV_PAGE_TABLE_MAX_SEQS"));
    assert_null(c);
    /* the largest table is cheap to create: nothing per sequence until used */
    cfg.max_seqs = KV_PAGE_TABLE_MAX_SEQS;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_OK);
    /* 64 blocks x 2 layers x K,V x 32 KiB = 8 MiB: 2 MiB aligned despite the
     * layout's 128 (huge pages stay possible) */
    assert_int_equal(kv_arena_align(kv_cache_arena(c)) % ((size_t)2 << 20), 0);
    kv_page_table *pt = kv_cache_page_table(c);
    uint32_t s, t;
    assert_int_equal(kv_page_table_seq_create(pt, &s), KV_OK);
    assert_int_equal(kv_page_table_seq_create(pt, &t), KV_OK);
    assert_int_equal(kv_page_table_seq_append(pt, s, NULL, 40 * 16), KV_OK);
    /* 63 usable blocks of 16 tokens, 40 held: 30 more are refused with the
     * page table's context AND the pool's numbers */
    assert_int_equal(kv_page_table_seq_append(pt, t, NULL, 30 * 16), KV_ERR_NO_BLOCKS);
    assert_non_null(strstr(kv_last_error(), "kv_page_table_seq_append: seq"));
    assert_non_null(
        strstr(kv_last_error(), "kv_block_pool_alloc: requested 30 blocks, 23 available"));
    kv_cache_destroy(c);
    /* a pool of 2^31 blocks of 32 KiB: the arena (64 TiB) exceeds any machine
     * here and is refused at once, without building 2^31 block records */
    cfg.max_seqs = 4;
    cfg.layout.num_blocks = (int64_t)KV_BLOCK_POOL_MAX_BLOCKS;
    c = NULL;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_NO_MEMORY);
    assert_non_null(strstr(kv_last_error(), "physical memory"));
    assert_null(c);
    cfg.layout.num_blocks = (int64_t)KV_BLOCK_POOL_MAX_BLOCKS + 1;
    assert_int_equal(kv_cache_create(&cfg, &c), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "num_blocks 2147483649"));
}

/* ---- every config checked whole before anything is allocated ------------ */

#if defined(__SANITIZE_ADDRESS__)
/* The probes' controls allocate past the limit on purpose: the allocator
 * must answer NULL, as the library expects, not end the process (visible:
 * the build hides symbols by default, and the runtime looks this one up). */
const char *__asan_default_options(void);
__attribute__((visibility("default"))) const char *__asan_default_options(void)
{
    return "allocator_may_return_null=1";
}
#endif
#if defined(__SANITIZE_THREAD__)
const char *__tsan_default_options(void);
__attribute__((visibility("default"))) const char *__tsan_default_options(void)
{
    return "allocator_may_return_null=1";
}
#endif

struct probe {
    kv_status st;
    char msg[512];
};

/* Create, and on success destroy, one object of the config at arg. */
typedef kv_status (*probe_fn)(const void *arg);

static kv_status probe_cache(const void *arg)
{
    kv_cache *c = NULL;
    const kv_status st = kv_cache_create(arg, &c);
    kv_cache_destroy(c);
    return st;
}

static kv_status probe_arena(const void *arg)
{
    kv_arena *a = NULL;
    const kv_status st = kv_arena_create(arg, &a);
    kv_arena_destroy(a);
    return st;
}

static kv_status probe_pool(const void *arg)
{
    kv_block_pool *p = NULL;
    const kv_status st = kv_block_pool_create(arg, &p);
    kv_block_pool_destroy(p);
    return st;
}

static kv_status probe_offload(const void *arg)
{
    kv_offload *o = NULL;
    const kv_status st = kv_offload_create(arg, &o);
    kv_offload_destroy(o);
    return st;
}

#define PROBE_HEADROOM_BYTES ((uint64_t)256 << 20)

/* fn(arg) in a forked child whose address space may grow by 256 MiB over
 * what it has mapped at the fork (RLIMIT_AS), the status and last error
 * coming back through a pipe; the test process itself is not limited. */
static struct probe run_limited(probe_fn fn, const void *arg)
{
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    fflush(NULL);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) { /* the child: no cmocka calls, only the pipe */
        struct probe p = {KV_ERR_INTERNAL, "probe child: could not set RLIMIT_AS"};
        unsigned long long pages = 0;
        FILE *f = fopen("/proc/self/statm", "r");
        const bool got = f && fscanf(f, "%llu", &pages) == 1;
        if (f)
            fclose(f);
        const uint64_t vm = (uint64_t)pages * (uint64_t)sysconf(_SC_PAGESIZE);
        struct rlimit rl = {(rlim_t)(vm + PROBE_HEADROOM_BYTES),
                            (rlim_t)(vm + PROBE_HEADROOM_BYTES)};
        if (got && setrlimit(RLIMIT_AS, &rl) == 0) {
            p.st = fn(arg);
            snprintf(p.msg, sizeof(p.msg), "%s", p.st == KV_OK ? "" : kv_last_error());
        }
        const ssize_t w = write(fd[1], &p, sizeof(p));
        _exit(w == (ssize_t)sizeof(p) ? 0 : 1);
    }
    close(fd[1]);
    struct probe p;
    size_t got = 0;
    while (got < sizeof(p)) {
        const ssize_t r = read(fd[0], (char *)&p + got, sizeof(p) - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd[0]);
    int wst = 0;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    assert_int_equal(got, sizeof(p));
    return p;
}

/* fn(arg) under the limit answers want, and its message holds each of the
 * NULL-terminated words. */
static void expect_limited(probe_fn fn, const void *arg, kv_status want, ...)
{
    const struct probe p = run_limited(fn, arg);
    if (p.st != want)
        print_error("probe: %s (want %s): %s\n", kv_status_name(p.st), kv_status_name(want), p.msg);
    assert_int_equal(p.st, want);
    va_list ap;
    va_start(ap, want);
    for (const char *w = va_arg(ap, const char *); w; w = va_arg(ap, const char *)) {
        if (!strstr(p.msg, w))
            print_error("probe: \"%s\" not in: %s\n", w, p.msg);
        assert_non_null(strstr(p.msg, w));
    }
    va_end(ap);
}

/* A cache of 16 GiB (L 1, K and V, B 2, N 2^32 - 128, H 1, D 1, u8): past
 * the headroom but (on most machines) not past physical memory, so the
 * arena is mapped, and only a config refused before that comes back
 * naming its field. */
static void big_cache(struct kv_cache_config *cfg)
{
    kv_cache_config_init(cfg);
    cfg->layout.num_layers = 1;
    cfg->layout.num_blocks = 2;
    cfg->layout.block_tokens = ((int64_t)1 << 32) - 128;
    cfg->layout.num_heads = 1;
    cfg->layout.head_dim = 1;
    cfg->layout.dtype = KV_U8;
    cfg->max_seqs = 1;
}

static void test_cache_configs_checked_before_allocating(void **state)
{
    (void)state;
    struct kv_cache_config cc;
    /* the controls: the limit bites (a valid 16 GiB cache cannot be made),
     * and leaves room for a small one */
    big_cache(&cc);
    expect_limited(probe_cache, &cc, KV_ERR_NO_MEMORY, (const char *)NULL);
    big_cache(&cc);
    cc.layout.block_tokens = 16;
    cc.layout.num_blocks = 64;
    expect_limited(probe_cache, &cc, KV_OK, (const char *)NULL);
    /* block_tokens 2^32 + 1 (the page table counts tokens in uint32): an
     * arena of 16 GiB + 4 bytes */
    big_cache(&cc);
    cc.layout.block_tokens = ((int64_t)1 << 32) + 1;
    expect_limited(probe_cache, &cc, KV_ERR_INVALID_ARG, "block_tokens 4294967297",
                   (const char *)NULL);
    /* the page table's fields, checked by the cache before its arena */
    big_cache(&cc);
    cc.max_seqs = KV_PAGE_TABLE_MAX_SEQS + 1;
    expect_limited(probe_cache, &cc, KV_ERR_INVALID_ARG, "max_seqs 1048577",
                   "KV_PAGE_TABLE_MAX_SEQS", (const char *)NULL);
    big_cache(&cc);
    cc.max_seqs = 0;
    expect_limited(probe_cache, &cc, KV_ERR_INVALID_ARG, "max_seqs 0", (const char *)NULL);
    big_cache(&cc);
    cc.max_blocks_per_seq = KV_PAGE_TABLE_MAX_BLOCKS_PER_SEQ + 1u;
    expect_limited(probe_cache, &cc, KV_ERR_INVALID_ARG, "max_blocks_per_seq 2147483649",
                   (const char *)NULL);
    big_cache(&cc);
    cc.page_ratio = 3;
    expect_limited(probe_cache, &cc, KV_ERR_INVALID_ARG, "page_ratio 3", (const char *)NULL);
    big_cache(&cc);
    cc.mem_kind = (enum kv_mem_kind)7;
    expect_limited(probe_cache, &cc, KV_ERR_INVALID_ARG, "mem_kind 7", (const char *)NULL);
    big_cache(&cc);
    cc.mem_kind = KV_MEM_DEVICE;
    cc.zero_fill = true;
    expect_limited(probe_cache, &cc, KV_ERR_UNSUPPORTED, "zero_fill", (const char *)NULL);
    big_cache(&cc);
    cc.layout.num_blocks = (int64_t)KV_BLOCK_POOL_MAX_BLOCKS + 1;
    cc.layout.block_tokens = 16;
    expect_limited(probe_cache, &cc, KV_ERR_INVALID_ARG, "num_blocks 2147483649",
                   (const char *)NULL);

    /* the arena: 16 GiB with a bad field; the control maps nothing either */
    struct kv_arena_config ac;
    kv_arena_config_init(&ac, (size_t)16 << 30);
    expect_limited(probe_arena, &ac, KV_ERR_NO_MEMORY, (const char *)NULL);
    ac.flags = 0x80;
    expect_limited(probe_arena, &ac, KV_ERR_INVALID_ARG, "flags 0x80", (const char *)NULL);
    ac.flags = KV_ARENA_ZERO;
    ac.kind = KV_MEM_DEVICE;
    expect_limited(probe_arena, &ac, KV_ERR_UNSUPPORTED, "KV_ARENA_ZERO", (const char *)NULL);
    ac.flags = 0;
    ac.kind = KV_MEM_HOST;
    ac.align_bytes = 3;
    expect_limited(probe_arena, &ac, KV_ERR_INVALID_ARG, "align_bytes 3", (const char *)NULL);
    ac.align_bytes = 0;
    ac.size_bytes = SIZE_MAX - 100; /* rounded up to 2 MiB: past size_t */
    expect_limited(probe_arena, &ac, KV_ERR_OVERFLOW, "overflows", (const char *)NULL);

    /* the pool: 2^31 block records (GiBs of them) with a bad field */
    struct kv_block_pool_config pc;
    kv_block_pool_config_init(&pc);
    pc.num_blocks = KV_BLOCK_POOL_MAX_BLOCKS;
    expect_limited(probe_pool, &pc, KV_ERR_NO_MEMORY, (const char *)NULL);
    pc.flags = 0x80;
    expect_limited(probe_pool, &pc, KV_ERR_INVALID_ARG, "flags 0x80", (const char *)NULL);

    /* the offload tier: a 16 GiB region with a bad field */
    struct kv_offload_config oc = KV_OFFLOAD_CONFIG_INIT;
    oc.capacity_bytes = (size_t)16 << 30;
    oc.mem = KV_OFFLOAD_MEM_HOST;
    expect_limited(probe_offload, &oc, KV_ERR_NO_MEMORY, (const char *)NULL);
    oc.threads = -1;
    expect_limited(probe_offload, &oc, KV_ERR_INVALID_ARG, "threads -1", (const char *)NULL);
    oc.threads = 0;
    oc.mem = (kv_offload_mem)7;
    expect_limited(probe_offload, &oc, KV_ERR_INVALID_ARG, "mem 7", (const char *)NULL);
    oc.mem = KV_OFFLOAD_MEM_HOST;
    oc.staging_bytes = SIZE_MAX - ((size_t)8 << 30);
    expect_limited(probe_offload, &oc, KV_ERR_OVERFLOW, "overflows", (const char *)NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_layer_major_nhd),
        cmocka_unit_test(test_cache_layer_major_hnd_padded),
        cmocka_unit_test(test_cache_block_major_nhd_padded),
        cmocka_unit_test(test_cache_block_major_hnd),
        cmocka_unit_test(test_cache_prefix_reuse),
        cmocka_unit_test(test_cache_prefix_survives_pressure),
        cmocka_unit_test(test_cache_null_block_not_usable),
        cmocka_unit_test(test_cache_parts_refuse_their_own_destroy),
        cmocka_unit_test(test_cache_bad_config),
        cmocka_unit_test(test_cache_limits_and_error_detail),
        cmocka_unit_test(test_cache_configs_checked_before_allocating),
    };
    return cmocka_run_group_tests_name("cache", tests, NULL, NULL);
}
