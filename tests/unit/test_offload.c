/*
 * test_offload.c - connector/kv_offload: the host offload tier.
 *
 * Every block is written and checked through the reference addressing of
 * kvtest.h (kvt_cache.h), and every load compares the WHOLE destination
 * arena against its snapshot plus the loaded blocks, so a stray write
 * anywhere fails. Pools are scrambled first: the blocks stored and the
 * blocks loaded into are spread over [1, B), far from 0.
 *   - create refusals, the region, the memory kind;
 *   - store -> load round trips for all 16 layouts (NHD/HND x layer/block-
 *     major x padded x packed), page sizes 8/16/32, loaded into a cache of
 *     another arrangement and padding (entries are the block format only);
 *   - rows of every width the store's pieces take (under, across and over
 *     4 KiB pieces, odd tails), plain and streaming, corruption in a row's
 *     second piece and last byte caught;
 *   - commit semantics: the loaded block carries the hash and a prefix
 *     lookup finds it; a pool that already has the hash keeps its own;
 *   - failures that lose nothing: a miss, a corrupt entry (first, middle,
 *     last byte), another block format, a block larger than the capacity;
 *   - entries keyed by (hash, block format): ranks of three formats store
 *     the same hashes into one tier and each loads back its own bytes;
 *     LRU, capacity, evict and corruption per format;
 *   - LRU order and capacity, touches by store and by load, kv_offload_evict;
 *   - post-time refusals leave ref counts and pool counters as they were;
 *   - cancel: queued, between chunks of a store, between chunks of a load
 *     (nothing committed, every block released), destroy with ops queued;
 *   - lifetimes: the engine destroys its cache with ops of it queued (the
 *     ops hold references: no use after free), and every order of freeing
 *     the cache, the tier, the op handles and a staging buffer against live
 *     ops (refused while an op is live, counted otherwise);
 *   - wait timeouts, results and op_free before a terminal state;
 *   - staging buffers inside the region, the staging cap, a buffer out at
 *     destroy (the region stays until it is returned; evict on the
 *     destroyed tier refused, contains false);
 *   - the carver alone: pieces inside the region, aligned, disjoint,
 *     reused after free, NULL (not a crash) when exhausted;
 *   - three engine threads posting, evicting and reading stats while the
 *     worker copies (run under SANITIZE=thread in CI);
 *   - the round trips and the load failures again on the streaming path
 *     (non-temporal stores, copy + hash in pieces: kv_pack_int.h), which
 *     only ops of 8 MiB and more take otherwise.
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
#include <time.h>

#include <cmocka.h>
#if !defined(KV_USE_LIBC_MALLOC)
#include <jemalloc/jemalloc.h>
#endif

#include <kvcache/kv.h>
#include "kv_pack_int.h" /* kv__pack_nt_min_bytes */
#include "kv_offload_int.h"
#include "kvt_cache.h"
#include "kvt_offload.h"
#include "kvt_side.h"
#include "kvtest.h"

#define WAIT_MS 20000

static kv_offload *mk_tier(size_t capacity, size_t staging)
{
    struct kv_offload_config cfg = KV_OFFLOAD_CONFIG_INIT;
    cfg.capacity_bytes = capacity;
    cfg.staging_bytes = staging;
    cfg.mem = KV_OFFLOAD_MEM_HOST;
    cfg.threads = 1;
    kv_offload *off = NULL;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_OK);
    return off;
}

static uint64_t hash_of(uint64_t k)
{
    uint64_t s = k * 0x2545F4914F6CDD1Dull + 17;
    return kvt_rand(&s);
}

/* Bytes of one entry: the block's elements, unpadded. */
static uint64_t entry_bytes(const struct kvt_cache *t)
{
    const struct kv_layout_config *c = &t->cfg.layout;
    return (uint64_t)(c->num_layers * (c->k_only ? 1 : 2) * c->block_tokens * c->num_heads *
                      c->head_dim * t->pc.layout.elem_bytes);
}

/* What a piece of bytes at align takes of the tier's region, by what the
 * carver is: jemalloc's size class, plus the page jemalloc adds to a large
 * class (16 KiB or more, 4 KiB pages: its randomized offset within a page,
 * opt.cache_oblivious; 1,000 pieces of 16 KiB take 20 KiB each); first-fit:
 * bytes rounded up to align. */
static uint64_t piece_bytes(uint64_t bytes, size_t align)
{
#if !defined(KV_USE_LIBC_MALLOC)
    const size_t n = nallocx((size_t)bytes, MALLOCX_ALIGN(align));
    return n >= 16384 ? n + 4096 : n;
#else
    return (bytes + align - 1) / align * align;
#endif
}

/* ---- create -------------------------------------------------------------- */

static void test_offload_create(void **state)
{
    (void)state;
    struct kv_offload_config cfg = KV_OFFLOAD_CONFIG_INIT;
    kv_offload *off = (kv_offload *)0x1;
    assert_int_equal(kv_offload_create(NULL, &off), KV_ERR_NULL);
    assert_int_equal(kv_offload_create(&cfg, NULL), KV_ERR_NULL);
    assert_int_equal(kv_offload_create(&cfg, &off), KV_ERR_INVALID_ARG); /* capacity 0 */
    assert_non_null(strstr(kv_last_error(), "capacity_bytes"));
    cfg.capacity_bytes = 1 << 20;
    cfg.struct_size = 8;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_ERR_INVALID_ARG);
    cfg.struct_size = sizeof(cfg);
    cfg.mem = (kv_offload_mem)7;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "7"));
    cfg.mem = KV_OFFLOAD_MEM_HOST;
    cfg.threads = -2;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_ERR_INVALID_ARG);
    cfg.threads = 0;
    cfg.capacity_bytes = SIZE_MAX - 16;
    cfg.staging_bytes = 1 << 20;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_ERR_OVERFLOW);
    assert_ptr_equal(off, (kv_offload *)0x1); /* untouched on failure */

    /* pinned: only where CUDA and a GPU exist; AUTO falls back to host */
    cfg.capacity_bytes = 1 << 20;
    cfg.staging_bytes = 0;
    cfg.mem = KV_OFFLOAD_MEM_PINNED;
    const kv_status pst = kv_offload_create(&cfg, &off);
    if (pst == KV_OK) {
        assert_int_equal(kv_offload_mem_kind(off), KV_MEM_PINNED);
        kv_offload_destroy(off);
    } else {
        assert_int_equal(pst, KV_ERR_UNSUPPORTED);
    }
    cfg.mem = KV_OFFLOAD_MEM_AUTO;
    assert_int_equal(kv_offload_create(&cfg, &off), KV_OK);
    assert_true(kv_offload_mem_kind(off) == KV_MEM_HOST ||
                kv_offload_mem_kind(off) == KV_MEM_PINNED);
    struct kv_mem_region r[2];
    size_t nr = 0;
    assert_int_equal(kv_offload_regions(off, r, 2, &nr), KV_OK);
    assert_int_equal(nr, 1);
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.capacity_bytes, 1 << 20);
    /* default slack: 8 MiB + capacity / 32 */
    assert_true(st.region_bytes >= (1u << 20) + (8u << 20) + (1u << 15));
    assert_true(r[0].bytes >= st.region_bytes);
    assert_int_equal(st.entries, 0);
    assert_int_equal(kv_offload_regions(NULL, r, 2, &nr), KV_ERR_NULL);
    assert_int_equal(kv_offload_stats_get(off, NULL), KV_ERR_NULL);
    assert_false(kv_offload_contains(off, NULL, 1));
    assert_false(kv_offload_contains(NULL, NULL, 1));
    kv_offload_destroy(off);
    kv_offload_destroy(NULL);
    assert_string_equal(kv_offload_state_name(KV_OFFLOAD_CANCELLED), "cancelled");
    assert_string_equal(kv_offload_state_name((kv_offload_state)9), "unknown");
}

/* ---- round trips --------------------------------------------------------- */

static void test_offload_every_layout(void **state)
{
    (void)state;
    static const int64_t Ns[3] = {8, 16, 32};
    uint64_t rng = 0x0FF10AD;
    kv_offload *off = mk_tier((size_t)16 << 20, 0);
    /* bits 0..15, then four K-only (MLA) layouts: 32 | order, arrangement */
    for (int bi = 0; bi < 20; bi++) {
        const int bits = bi < 16 ? bi : 32 | (bi - 16);
        const int64_t N = Ns[bi % 3];
        struct kvt_cache s, d;
        kvt_cache_make(&s, 3, 300, N, 4, 16, KV_BF16, bits, 100 + (uint64_t)bits);
        /* the destination: another arrangement and padding, same block format */
        kvt_cache_make(&d, 3, 260, N, 4, 16, KV_BF16, bits ^ 6, 200 + (uint64_t)bits);
        kvt_pool_scramble(&s, &rng);
        kvt_pool_scramble(&d, &rng);
        enum { NB = 12 };
        uint64_t h[NB];
        kv_status want[NB];
        for (int i = 0; i < NB; i++) {
            h[i] = hash_of((uint64_t)(bits * 100 + i));
            want[i] = KV_OK;
        }
        struct kv_offload_stats st0, st1;
        assert_int_equal(kv_offload_stats_get(off, &st0), KV_OK);
        kvt_store_all(off, &s, h, NB, bits & 1);
        assert_int_equal(kv_offload_stats_get(off, &st1), KV_OK);
        assert_int_equal(st1.stores - st0.stores, NB);
        assert_int_equal(st1.bytes - st0.bytes, NB * piece_bytes(entry_bytes(&s), 64));
        assert_int_equal(kvt_load_check(off, &d, h, NB, want, false), KV_OFFLOAD_DONE);
        /* committed: a prefix lookup in d now finds every hash */
        uint32_t ids[NB], nf = 0;
        assert_int_equal(kv_block_pool_lookup(d.pool, h, NB, ids, &nf), KV_OK);
        assert_int_equal(nf, NB);
        for (int i = 0; i < NB; i++)
            assert_true(kvt_block_holds(&d, d.base, ids[i], h[i]));
        assert_int_equal(kv_block_pool_release(d.pool, ids, NB), KV_OK);
        assert_int_equal(kv_offload_stats_get(off, &st0), KV_OK);
        assert_int_equal(st0.loads - st1.loads, NB);
        assert_int_equal(st0.hits - st1.hits, NB);
        kvt_cache_free(&s);
        kvt_cache_free(&d);
    }
    kv_offload_destroy(off);
}

/* Rows of every width a store's copy + hash takes in pieces (kv_pack_int.h:
 * 4 KiB pieces, the next row's first pieces prefetched): a layer-major
 * block's K and V runs of 480 bytes, 4 KiB + 272 and 9,000 bytes (one
 * piece, a piece and a tail, three pieces and an odd tail), and a padded
 * block-major block, on the plain path and on the streaming one. Each
 * round trip lands in another arrangement far from block 0 and is compared
 * with the whole destination arena; the load's one-shot XXH3 of each entry
 * is the reference for the sum the store took piece by piece (a wrong sum
 * fails the load). A byte flipped in a row's second piece and in its last
 * byte is still caught, and nothing of those entries is written. */
static void test_offload_wide_rows(void **state)
{
    (void)state;
    static const struct {
        int64_t N, H, D;
        kv_dtype dt;
        int bits;
    } shapes[] = {
        {1, 3, 40, KV_F32, 0},  /* runs of 480 bytes */
        {3, 7, 104, KV_BF16, 0}, /* 4,368: a piece and 272 bytes */
        {5, 9, 100, KV_BF16, 0}, /* 9,000: three pieces, the last 808 */
        {5, 9, 100, KV_BF16, 6}, /* block-major, padded: one 2-D copy of the block */
    };
    const uint64_t nt_default = kv__pack_nt_min_bytes;
    uint64_t rng = 0x9ADE5;
    for (int nt = 0; nt < 2; nt++) {
        kv__pack_nt_min_bytes = nt ? 0 : UINT64_MAX;
        for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
            struct kvt_cache s, d;
            kvt_cache_make(&s, 3, 120, shapes[si].N, shapes[si].H, shapes[si].D, shapes[si].dt,
                           shapes[si].bits, 300 + si);
            kvt_cache_make(&d, 3, 110, shapes[si].N, shapes[si].H, shapes[si].D, shapes[si].dt,
                           shapes[si].bits ^ 2, 400 + si);
            kvt_pool_scramble(&s, &rng);
            kvt_pool_scramble(&d, &rng);
            const size_t eb = (size_t)entry_bytes(&s);
            kv_offload *off = mk_tier(8 * eb + ((size_t)1 << 20), 0);
            enum { NB = 6 };
            uint64_t h[NB];
            for (int i = 0; i < NB; i++)
                h[i] = hash_of(7000 + (uint64_t)(nt * 100) + si * 10 + (uint64_t)i);
            kvt_store_all(off, &s, h, NB, true);
            kv_status want[NB] = {KV_OK, KV_OK, KV_OK, KV_OK, KV_OK, KV_OK};
            assert_int_equal(kvt_load_check(off, &d, h, NB, want, false), KV_OFFLOAD_DONE);
            /* a byte of the first row's second piece (or past its middle when
             * the row is one piece) and the entry's last byte */
            const size_t row = (size_t)(shapes[si].N * shapes[si].H * shapes[si].D) *
                               (size_t)s.pc.layout.elem_bytes;
            const size_t in_row = row > 4096 ? 4096 + 5 : row / 2 + 1;
            assert_int_equal(kv__offload_test_corrupt(off, NULL, h[2], in_row), KV_OK);
            assert_int_equal(kv__offload_test_corrupt(off, NULL, h[4], eb - 1), KV_OK);
            want[2] = want[4] = KV_ERR_CORRUPT;
            assert_int_equal(kvt_load_check(off, &d, h, NB, want, false), KV_OFFLOAD_FAILED);
            assert_false(kv_offload_contains(off, NULL, h[2]));
            assert_false(kv_offload_contains(off, NULL, h[4]));
            kv_offload_destroy(off);
            kvt_cache_free(&s);
            kvt_cache_free(&d);
        }
    }
    kv__pack_nt_min_bytes = nt_default;
}

/* The worker's parallel copies (kv_offload_worker.c, OpenMP): 1, 2 and 5
 * copy threads (more than this machine may have cores), chunks of 1, 3 and
 * 7 blocks and by bytes, over layer-major blocks of short runs and
 * block-major ones, ids spread far from 0. Every round trip is compared with the whole destination arena, the
 * load's one-shot XXH3 of each entry checking the sum each thread took
 * piece by piece; a byte flipped in one entry fails that entry alone
 * (KV_ERR_CORRUPT) and writes nothing of it. */
static void test_offload_threads_chunks(void **state)
{
    (void)state;
#if defined(__SANITIZE_THREAD__)
    /* libgomp is not built for TSan, which cannot see a parallel region's
     * fork and join and reports its writes as races: under TSan one copy
     * thread (the worker's own loop, no OpenMP region); every other build
     * runs 2 and 5 threads too */
    static const int threads[] = {1};
#else
    static const int threads[] = {1, 2, 5};
#endif
    static const uint32_t chunks[] = {0, 1, 3, 7};
    uint64_t rng = 0x7EA3;
    for (int bits = 0; bits < 8; bits += 6) { /* layer-major, then block-major padded */
        struct kvt_cache s, d;
        kvt_cache_make(&s, 4, 400, 1, 2, 64, KV_BF16, bits, 500 + (uint64_t)bits);
        kvt_cache_make(&d, 4, 380, 1, 2, 64, KV_BF16, bits ^ 2, 600 + (uint64_t)bits);
        kvt_pool_scramble(&s, &rng);
        kvt_pool_scramble(&d, &rng);
        const size_t eb = (size_t)entry_bytes(&s);
        for (size_t ti = 0; ti < sizeof(threads) / sizeof(threads[0]); ti++)
            for (size_t ci = 0; ci < sizeof(chunks) / sizeof(chunks[0]); ci++) {
                struct kv_offload_config cfg = KV_OFFLOAD_CONFIG_INIT;
                enum { NB = 29 };
                cfg.capacity_bytes = 2 * NB * eb + ((size_t)1 << 20);
                cfg.mem = KV_OFFLOAD_MEM_HOST;
                cfg.threads = threads[ti];
                kv_offload *off = NULL;
                assert_int_equal(kv_offload_create(&cfg, &off), KV_OK);
                kv__offload_test_set_chunk(off, chunks[ci]);
                uint64_t h[NB];
                kv_status want[NB];
                for (int i = 0; i < NB; i++) {
                    h[i] = hash_of(90000 + (uint64_t)(bits * 10000) + ti * 1000 + ci * 100 +
                                   (uint64_t)i);
                    want[i] = KV_OK;
                }
                kvt_store_all(off, &s, h, NB, true);
                assert_int_equal(kvt_load_check(off, &d, h, NB, want, false), KV_OFFLOAD_DONE);
                assert_int_equal(kv__offload_test_corrupt(off, NULL, h[NB - 3], eb / 3), KV_OK);
                want[NB - 3] = KV_ERR_CORRUPT;
                assert_int_equal(kvt_load_check(off, &d, h, NB, want, false), KV_OFFLOAD_FAILED);
                struct kv_offload_stats st;
                assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
                assert_int_equal(st.stores, NB);
                assert_int_equal(st.loads, 2 * NB - 1);
                assert_int_equal(st.checksum_failures, 1);
                kv_offload_destroy(off);
            }
        kvt_cache_free(&s);
        kvt_cache_free(&d);
    }
}

/* Loading into a pool that still has the hash: new block, right bytes,
 * committed false, the pool's own block keeps the hash. */
static void test_offload_commit_semantics(void **state)
{
    (void)state;
    uint64_t rng = 0xC0FFEE;
    kv_offload *off = mk_tier((size_t)4 << 20, 0);
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 200, 16, 2, 32, KV_F32, 2, 7);
    kvt_pool_scramble(&s, &rng);
    uint64_t h[4] = {hash_of(1), hash_of(2), hash_of(3), hash_of(4)};
    uint32_t ids[4];
    kvt_put_blocks(&s, h, 4, ids);
    kv_offload_op *op;
    assert_int_equal(kv_offload_store(off, s.c, ids, 4, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK); /* 0, 1 cached; 2, 3 held */
    assert_int_equal(kv_offload_load(off, s.c, h, 4, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    const struct kv_offload_result *res;
    uint32_t n;
    assert_int_equal(kv_offload_results(op, &res, &n), KV_OK);
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(res[i].status, KV_OK);
        assert_false(res[i].committed); /* the pool has each hash already */
        for (int j = 0; j < 4; j++)
            assert_int_not_equal(res[i].block, ids[j]);
        assert_true(kvt_block_holds(&s, s.base, res[i].block, h[i]));
        uint64_t x;
        assert_int_equal(kv_block_pool_block_hash(s.pool, res[i].block, &x), KV_ERR_NOT_FOUND);
        assert_int_equal(kv_block_pool_release(s.pool, &res[i].block, 1), KV_OK);
    }
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, ids + 2, 2), KV_OK);
    assert_int_equal(kvt_pool_refs(&s), 0);
    kvt_cache_free(&s);
    kv_offload_destroy(off);
}

/* ---- failures that lose nothing ----------------------------------------- */

static void test_offload_load_failures(void **state)
{
    (void)state;
    uint64_t rng = 0xBAD;
    kv_offload *off = mk_tier((size_t)4 << 20, 0);
    struct kvt_cache s, d, x;
    kvt_cache_make(&s, 2, 150, 8, 4, 16, KV_BF16, 0, 11);
    kvt_cache_make(&d, 2, 150, 8, 4, 16, KV_BF16, 6, 12);
    kvt_cache_make(&x, 2, 150, 8, 4, 16, KV_BF16, 1, 13); /* HND: another format */
    kvt_pool_scramble(&s, &rng);
    kvt_pool_scramble(&d, &rng);
    kvt_pool_scramble(&x, &rng);
    uint64_t h[6];
    for (int i = 0; i < 6; i++)
        h[i] = hash_of(50 + (uint64_t)i);
    kvt_store_all(off, &s, h, 6, true);
    const size_t eb = (size_t)entry_bytes(&s);

    /* a miss, and three corrupt entries (first, middle, last byte) */
    uint64_t q[6] = {h[0], hash_of(999), h[1], h[2], h[3], h[4]};
    assert_int_equal(kv__offload_test_corrupt(off, NULL, h[1], 0), KV_OK);
    assert_int_equal(kv__offload_test_corrupt(off, NULL, h[2], eb / 2), KV_OK);
    assert_int_equal(kv__offload_test_corrupt(off, NULL, h[3], eb - 1), KV_OK);
    assert_int_equal(kv__offload_test_corrupt(off, NULL, h[4], eb), KV_ERR_OUT_OF_BOUNDS);
    assert_int_equal(kv__offload_test_corrupt(off, NULL, hash_of(999), 0), KV_ERR_NOT_FOUND);
    kv_status want[6] = {KV_OK,          KV_ERR_NOT_FOUND, KV_ERR_CORRUPT,
                         KV_ERR_CORRUPT, KV_ERR_CORRUPT,   KV_OK};
    struct kv_offload_stats st0, st1;
    assert_int_equal(kv_offload_stats_get(off, &st0), KV_OK);
    assert_int_equal(kvt_load_check(off, &d, q, 6, want, false), KV_OFFLOAD_FAILED);
    assert_int_equal(kv_offload_stats_get(off, &st1), KV_OK);
    assert_int_equal(st1.checksum_failures - st0.checksum_failures, 3);
    assert_int_equal(st1.misses - st0.misses, 1);
    assert_int_equal(st1.failed_ops - st0.failed_ops, 1);
    assert_int_equal(st1.entries, 3); /* corrupt entries are dropped */
    for (int i = 1; i < 4; i++) {
        assert_false(kv_offload_contains(off, NULL, h[i]));
        uint32_t id, nf;
        assert_int_equal(kv_block_pool_lookup(d.pool, &h[i], 1, &id, &nf), KV_OK);
        assert_int_equal(nf, 0); /* never committed */
    }

    /* held only in another block format: refused, nothing written or
     * committed; a hash in no format at all is a plain miss */
    kv_status want_x[3] = {KV_ERR_MISMATCH, KV_ERR_MISMATCH, KV_ERR_NOT_FOUND};
    uint64_t qx[3] = {h[0], h[5], hash_of(998)};
    assert_int_equal(kvt_load_check(off, &x, qx, 3, want_x, false), KV_OFFLOAD_FAILED);
    assert_true(kv_offload_contains(off, s.c, h[0])); /* still there for the right format */
    assert_true(kv_offload_contains(off, d.c, h[0])); /* d: the same block format as s */
    assert_false(kv_offload_contains(off, x.c, h[0]));

    /* a block larger than the capacity: the store fails, the block stays */
    kv_offload *tiny = mk_tier(eb - 1, 0);
    uint32_t id;
    uint64_t hz = hash_of(4242);
    kvt_put_blocks(&s, &hz, 1, &id);
    unsigned char *snap = malloc(s.bytes);
    memcpy(snap, s.base, s.bytes);
    kv_offload_op *op;
    assert_int_equal(kv_offload_store(tiny, s.c, &id, 1, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_FAILED);
    const struct kv_offload_result *res;
    uint32_t n;
    assert_int_equal(kv_offload_results(op, &res, &n), KV_OK);
    assert_int_equal(res[0].status, KV_ERR_CAPACITY);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_block_pool_ref_count(s.pool, id), 1);
    assert_int_equal(kvt_first_diff(snap, s.base, (int64_t)s.bytes), -1);
    assert_false(kv_offload_contains(tiny, NULL, hz));
    assert_int_equal(kv_block_pool_release(s.pool, &id, 1), KV_OK);
    free(snap);
    kv_offload_destroy(tiny);

    kvt_cache_free(&s);
    kvt_cache_free(&d);
    kvt_cache_free(&x);
    kv_offload_destroy(off);
}

/* ---- block formats ------------------------------------------------------- */

/* Entries are keyed by (hash, block format). Three ranks of one model (8 KV
 * heads) share a tier: A holds 4 heads (TP 2), B 2 heads (TP 4), C 4 heads
 * in HND; D is A's block format in another arrangement and padding. All
 * store the same hashes: A, B and C each get an entry of their own and each
 * loads back its own bytes (the whole destination arena compared); D's
 * store of the same hashes is a touch of A's, and D loads A's bytes. */
static void test_offload_formats_share_hashes(void **state)
{
    (void)state;
    uint64_t rng = 0xF0A7;
    struct kvt_cache a, b, c, d;
    kvt_cache_make(&a, 2, 90, 8, 4, 16, KV_BF16, 0, 101);
    kvt_cache_make(&b, 2, 90, 8, 2, 16, KV_BF16, 6, 102);
    kvt_cache_make(&c, 2, 90, 8, 4, 16, KV_BF16, 1, 103);
    kvt_cache_make(&d, 2, 70, 8, 4, 16, KV_BF16, 6, 104);
    struct kvt_cache *all[4] = {&a, &b, &c, &d};
    for (int i = 0; i < 4; i++)
        kvt_pool_scramble(all[i], &rng);
    const uint64_t ea = entry_bytes(&a), eb = entry_bytes(&b);
    assert_int_equal(ea, 2 * eb);
    assert_int_equal(entry_bytes(&c), ea);
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    enum { NB = 6 };
    uint64_t h[NB];
    kv_status ok[NB];
    for (int i = 0; i < NB; i++) {
        h[i] = hash_of(5000 + (uint64_t)i);
        ok[i] = KV_OK;
    }
    kvt_store_all(off, &a, h, NB, true);
    kvt_store_all(off, &b, h, NB, true);
    kvt_store_all(off, &c, h, NB, false);
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, 3 * NB);
    assert_int_equal(st.stores, 3 * NB);
    assert_int_equal(st.store_touches, 0);
    assert_int_equal(st.bytes, NB * (2 * ea + eb));
    for (int i = 0; i < 3; i++) /* each its own bytes, nothing else written */
        assert_int_equal(kvt_load_check(off, all[i], h, NB, ok, false), KV_OFFLOAD_DONE);
    assert_int_equal(kvt_load_check(off, &d, h, NB, ok, false), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.hits, 4 * NB);
    assert_int_equal(st.misses, 0);

    /* D stores the blocks it loaded (committed under h): A's entries, touched */
    uint32_t ids[NB], nf = 0;
    assert_int_equal(kv_block_pool_lookup(d.pool, h, NB, ids, &nf), KV_OK);
    assert_int_equal(nf, NB);
    kv_offload_op *op;
    assert_int_equal(kv_offload_store(off, d.c, ids, NB, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_block_pool_release(d.pool, ids, NB), KV_OK);
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, 3 * NB);
    assert_int_equal(st.store_touches, NB);

    /* evict drops a hash in every format; contains asks per format */
    uint32_t ne = 0;
    assert_int_equal(kv_offload_evict(off, h, 1, &ne), KV_OK);
    assert_int_equal(ne, 3);
    for (int i = 0; i < 4; i++) {
        assert_false(kv_offload_contains(off, all[i]->c, h[0]));
        assert_true(kv_offload_contains(off, all[i]->c, h[1]));
    }
    assert_false(kv_offload_contains(off, NULL, h[0]));
    assert_true(kv_offload_contains(off, NULL, h[1]));
    /* a corrupt entry of one format leaves the others intact */
    assert_int_equal(kv__offload_test_corrupt(off, b.c, h[1], 7), KV_OK);
    kv_status want_b[2] = {KV_ERR_CORRUPT, KV_OK};
    assert_int_equal(kvt_load_check(off, &b, h + 1, 2, want_b, false), KV_OFFLOAD_FAILED);
    assert_false(kv_offload_contains(off, b.c, h[1]));
    assert_true(kv_offload_contains(off, a.c, h[1]));
    assert_true(kv_offload_contains(off, c.c, h[1]));
    assert_int_equal(kvt_load_check(off, &a, h + 1, 2, ok, false), KV_OFFLOAD_DONE);
    kv_offload_destroy(off);
    for (int i = 0; i < 4; i++)
        kvt_cache_free(all[i]);
}

/* Two tensor-parallel ranks of one group: the same block format, other
 * heads (head_offset 0 and H), the same hashes. Each loads back its own
 * heads' bytes, never the other rank's (keyed by hash and format alone,
 * rank 1's load returned rank 0's bytes). */
static void test_offload_tp_ranks_share_tier(void **state)
{
    (void)state;
    uint64_t rng = 0x7A9;
    struct kvt_cache r0, r1;
    kvt_cache_make(&r0, 2, 40, 8, 4, 16, KV_BF16, 0, 201);
    kvt_cache_make(&r1, 2, 40, 8, 4, 16, KV_BF16, 16, 202);
    assert_int_equal(kv_cache_head_offset(r1.c), 4);
    kvt_pool_scramble(&r0, &rng);
    kvt_pool_scramble(&r1, &rng);
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    enum { NB = 6 };
    uint64_t h[NB];
    kv_status ok[NB];
    for (int i = 0; i < NB; i++) {
        h[i] = hash_of(7000 + (uint64_t)i);
        ok[i] = KV_OK;
    }
    kvt_store_all(off, &r0, h, NB, true);
    kvt_store_all(off, &r1, h, NB, true);
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, 2 * NB);
    assert_int_equal(st.store_touches, 0);
    assert_int_equal(kvt_load_check(off, &r1, h, NB, ok, false), KV_OFFLOAD_DONE);
    assert_int_equal(kvt_load_check(off, &r0, h, NB, ok, false), KV_OFFLOAD_DONE);
    uint32_t ne = 0;
    assert_int_equal(kv_offload_evict(off, h, 1, &ne), KV_OK);
    assert_int_equal(ne, 2);
    /* A rank whose entries are gone misses; the other rank's are no
     * substitute (a MISMATCH names it, nothing is written). */
    const uint64_t one = h[1];
    assert_int_equal(kv__offload_test_corrupt(off, r1.c, one, 3), KV_OK);
    const kv_status bad = KV_ERR_CORRUPT;
    assert_int_equal(kvt_load_check(off, &r1, &one, 1, &bad, false), KV_OFFLOAD_FAILED);
    const kv_status mism = KV_ERR_MISMATCH;
    assert_int_equal(kvt_load_check(off, &r1, &one, 1, &mism, false), KV_OFFLOAD_FAILED);
    assert_int_equal(kvt_load_check(off, &r0, &one, 1, ok, false), KV_OFFLOAD_DONE);
    kv_offload_destroy(off);
    kvt_cache_free(&r0);
    kvt_cache_free(&r1);
}

/* The tier's entries, bytes and evictions are these; returns the stats. */
static struct kv_offload_stats expect_table(kv_offload *off, uint64_t entries, uint64_t bytes,
                                            uint64_t evictions)
{
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, entries);
    assert_int_equal(st.bytes, bytes);
    assert_int_equal(st.evictions, evictions);
    return st;
}

/* LRU and capacity across formats: A's entries are twice B's; the capacity
 * holds exactly two of each. Every step predicts entries, bytes and
 * evictions. */
static void test_offload_formats_lru(void **state)
{
    (void)state;
    uint64_t rng = 0x1F0A7;
    struct kvt_cache a, b;
    kvt_cache_make(&a, 2, 60, 8, 4, 16, KV_BF16, 0, 111);
    kvt_cache_make(&b, 2, 60, 8, 2, 16, KV_BF16, 0, 112);
    kvt_pool_scramble(&a, &rng);
    kvt_pool_scramble(&b, &rng);
    const uint64_t ea = entry_bytes(&a), eb = entry_bytes(&b);
    kv_offload *off = mk_tier((size_t)(2 * ea + 2 * eb), 0);
    uint64_t g[4];
    for (int i = 0; i < 4; i++)
        g[i] = hash_of(6000 + (uint64_t)i);
    /* LRU: A0 A1 B0 B1, full */
    kvt_store_all(off, &a, &g[0], 1, true);
    kvt_store_all(off, &a, &g[1], 1, true);
    kvt_store_all(off, &b, &g[0], 1, true);
    kvt_store_all(off, &b, &g[1], 1, true);
    expect_table(off, 4, 2 * ea + 2 * eb, 0);
    /* a hit of A0: A1 B0 B1 A0 */
    const kv_status ok = KV_OK, mism = KV_ERR_MISMATCH;
    assert_int_equal(kvt_load_check(off, &a, &g[0], 1, &ok, false), KV_OFFLOAD_DONE);
    /* B2 needs eb: A1 goes (B1 stays: a hash is evicted per format) */
    kvt_store_all(off, &b, &g[2], 1, true);
    expect_table(off, 4, ea + 3 * eb, 1);
    assert_false(kv_offload_contains(off, a.c, g[1]));
    assert_true(kv_offload_contains(off, b.c, g[1]));
    assert_int_equal(kvt_load_check(off, &a, &g[1], 1, &mism, false), KV_OFFLOAD_FAILED);
    /* A3 needs ea: B0 goes (eb is enough) -> B1 A0 B2 A3 */
    kvt_store_all(off, &a, &g[3], 1, true);
    expect_table(off, 4, 2 * ea + 2 * eb, 2);
    assert_false(kv_offload_contains(off, b.c, g[0]));
    assert_true(kv_offload_contains(off, a.c, g[0]));
    /* A2 beside B2 (a new entry, not a touch) needs ea: B1 and A0 go */
    kvt_store_all(off, &a, &g[2], 1, true);
    assert_false(kv_offload_contains(off, b.c, g[1]));
    assert_false(kv_offload_contains(off, a.c, g[0]));
    assert_true(kv_offload_contains(off, b.c, g[2]));
    assert_true(kv_offload_contains(off, a.c, g[2]));
    const struct kv_offload_stats st = expect_table(off, 3, 2 * ea + eb, 4);
    assert_int_equal(st.stores, 7);
    assert_int_equal(st.store_touches, 0);
    /* both formats of g[2] go at once */
    uint32_t ne = 0;
    assert_int_equal(kv_offload_evict(off, &g[2], 1, &ne), KV_OK);
    assert_int_equal(ne, 2);
    expect_table(off, 1, ea, 4);
    assert_true(kv_offload_contains(off, a.c, g[3]));
    kv_offload_destroy(off);
    kvt_cache_free(&a);
    kvt_cache_free(&b);
}

/* ---- LRU ----------------------------------------------------------------- */

static void test_offload_lru(void **state)
{
    (void)state;
    uint64_t rng = 0x1AB;
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 100, 8, 2, 16, KV_BF16, 4, 21);
    kvt_pool_scramble(&s, &rng);
    const size_t eb = (size_t)entry_bytes(&s);
    kv_offload *off = mk_tier(3 * eb + eb / 2, 0); /* three entries fit */
    uint64_t h[8];
    for (int i = 0; i < 8; i++)
        h[i] = hash_of(300 + (uint64_t)i);
    for (int i = 0; i < 5; i++) /* 0..4: 0 and 1 evicted */
        kvt_store_all(off, &s, &h[i], 1, true);
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, 3);
    assert_int_equal(st.evictions, 2);
    assert_int_equal(st.bytes, 3 * eb);
    assert_false(kv_offload_contains(off, NULL, h[0]));
    assert_false(kv_offload_contains(off, NULL, h[1]));
    /* LRU now 2 3 4; a store touch of 2 -> 3 4 2; a load hit of 3 -> 4 2 3 */
    uint32_t id;
    assert_int_equal(kv_block_pool_lookup(s.pool, &h[2], 1, &id, &(uint32_t){0}), KV_OK);
    kv_offload_op *op;
    assert_int_equal(kv_offload_store(off, s.c, &id, 1, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, &id, 1), KV_OK);
    kv_status ok = KV_OK;
    assert_int_equal(kvt_load_check(off, &s, &h[3], 1, &ok, false), KV_OFFLOAD_DONE);
    kvt_store_all(off, &s, &h[5], 1, true); /* evicts 4 */
    assert_false(kv_offload_contains(off, NULL, h[4]));
    assert_true(kv_offload_contains(off, NULL, h[2]));
    assert_true(kv_offload_contains(off, NULL, h[3]));
    kvt_store_all(off, &s, &h[6], 1, true); /* evicts 2 */
    assert_false(kv_offload_contains(off, NULL, h[2]));
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.store_touches, 1);
    assert_int_equal(st.evictions, 4);
    /* explicit evict: held and absent hashes */
    uint64_t ev[3] = {h[3], h[0], h[6]};
    uint32_t ne = 9;
    assert_int_equal(kv_offload_evict(off, ev, 3, &ne), KV_OK);
    assert_int_equal(ne, 2);
    assert_int_equal(kv_offload_evict(off, NULL, 1, &ne), KV_ERR_NULL);
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.evicted, 2);
    assert_int_equal(st.bytes, eb);
    assert_true(kv_offload_contains(off, NULL, h[5]));
    kvt_cache_free(&s);
    kv_offload_destroy(off);
}

/* ---- post-time refusals -------------------------------------------------- */

static void test_offload_post_refusals(void **state)
{
    (void)state;
    uint64_t rng = 0x5EF;
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 64, 8, 2, 16, KV_BF16, 0, 31);
    kvt_pool_scramble(&s, &rng);
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    uint64_t h[3] = {hash_of(1), hash_of(2), hash_of(3)};
    uint32_t ids[3];
    kvt_put_blocks(&s, h, 2, ids);
    assert_int_equal(kv_block_pool_alloc(s.pool, 1, &ids[2]), KV_OK); /* held, no hash */
    struct kv_block_pool_stats p0, p1;
    kv_block_pool_stats_get(s.pool, &p0);
    const uint64_t refs = kvt_pool_refs(&s);
    kv_offload_op *op = (kv_offload_op *)0x1;
    assert_int_equal(kv_offload_store(NULL, s.c, ids, 1, &op), KV_ERR_NULL);
    assert_int_equal(kv_offload_store(off, NULL, ids, 1, &op), KV_ERR_NULL);
    assert_int_equal(kv_offload_store(off, s.c, NULL, 1, &op), KV_ERR_NULL);
    assert_int_equal(kv_offload_store(off, s.c, ids, 1, NULL), KV_ERR_NULL);
    uint32_t bad[3] = {ids[0], 0, ids[1]};
    assert_int_equal(kv_offload_store(off, s.c, bad, 3, &op), KV_ERR_INVALID_ARG);
    bad[1] = 64;
    assert_int_equal(kv_offload_store(off, s.c, bad, 3, &op), KV_ERR_INVALID_ARG);
    /* a block nobody holds */
    uint32_t free_id = 0;
    for (uint32_t b = 1; b < 64 && !free_id; b++)
        if (kv_block_pool_ref_count(s.pool, b) == 0)
            free_id = b;
    bad[1] = free_id;
    assert_int_equal(kv_offload_store(off, s.c, bad, 3, &op), KV_ERR_BAD_STATE);
    /* a block without a hash: the message names the index and the id */
    bad[1] = ids[2];
    assert_int_equal(kv_offload_store(off, s.c, bad, 3, &op), KV_ERR_NOT_FOUND);
    char want[64];
    snprintf(want, sizeof(want), "ids[1] = %u", ids[2]);
    assert_non_null(strstr(kv_last_error(), want));
    assert_ptr_equal(op, (kv_offload_op *)0x1);
    kv_block_pool_stats_get(s.pool, &p1);
    assert_int_equal(kvt_pool_refs(&s), refs);
    assert_string_equal(kvt_block_pool_stats_diff(&p0, &p1), "");

    /* load: more blocks than the pool has; NULLs */
    uint64_t *many = calloc(100, sizeof(*many));
    assert_int_equal(kv_offload_load(off, s.c, many, 100, &op), KV_ERR_NO_BLOCKS);
    assert_int_equal(kv_offload_load(off, s.c, NULL, 1, &op), KV_ERR_NULL);
    assert_int_equal(kv_offload_load(off, NULL, h, 1, &op), KV_ERR_NULL);
    assert_int_equal(kv_offload_load(off, s.c, h, 1, NULL), KV_ERR_NULL);
    kv_block_pool_stats_get(s.pool, &p1);
    assert_int_equal(kvt_pool_refs(&s), refs);
    assert_int_equal(p1.used_blocks, p0.used_blocks);
    free(many);
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, 0);

    /* op calls on NULL */
    kv_offload_state ps;
    assert_int_equal(kv_offload_test(NULL, &ps), KV_ERR_NULL);
    assert_int_equal(kv_offload_wait(NULL, 1, &ps), KV_ERR_NULL);
    assert_int_equal(kv_offload_cancel(NULL), KV_ERR_NULL);
    assert_int_equal(kv_offload_op_free(NULL), KV_OK);
    const struct kv_offload_result *res;
    uint32_t n;
    assert_int_equal(kv_offload_results(NULL, &res, &n), KV_ERR_NULL);

    /* an empty store and an empty load are done at once */
    assert_int_equal(kv_offload_store(off, s.c, NULL, 0, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_offload_load(off, s.c, NULL, 0, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);

    assert_int_equal(kv_block_pool_release(s.pool, ids, 3), KV_OK);
    kvt_cache_free(&s);
    kv_offload_destroy(off);
}

/* ---- cancel -------------------------------------------------------------- */

/* A gate the worker's START hook waits on, and a BLOCK hook that cancels. */
struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool open;
    bool started;
    kv_offload_op *cancel_op; /* cancelled from the BLOCK hook after its first chunk */
    int chunks;
};

static void gate_hook(void *user, enum kv__offload_hook_at at, kv_offload_op *op)
{
    struct gate *g = user;
    pthread_mutex_lock(&g->mu);
    if (at == KV__OFFLOAD_HOOK_START) {
        g->started = true;
        pthread_cond_broadcast(&g->cv);
        while (!g->open)
            pthread_cond_wait(&g->cv, &g->mu);
    } else if (at == KV__OFFLOAD_HOOK_BLOCK && op == g->cancel_op) {
        g->chunks++;
        assert_int_equal(kv_offload_cancel(op), KV_OK);
    }
    pthread_mutex_unlock(&g->mu);
}

static void gate_init(struct gate *g)
{
    memset(g, 0, sizeof(*g));
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
}

static void gate_wait_started(struct gate *g)
{
    pthread_mutex_lock(&g->mu);
    while (!g->started)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static void gate_open(struct gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void test_offload_cancel(void **state)
{
    (void)state;
    uint64_t rng = 0xCA4CE1;
    struct kvt_cache s, d;
    kvt_cache_make(&s, 2, 120, 8, 2, 16, KV_BF16, 0, 41);
    kvt_cache_make(&d, 2, 120, 8, 2, 16, KV_BF16, 2, 42);
    kvt_pool_scramble(&s, &rng);
    kvt_pool_scramble(&d, &rng);
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    kv__offload_test_set_chunk(off, 1);
    uint64_t h[8];
    for (int i = 0; i < 8; i++)
        h[i] = hash_of(700 + (uint64_t)i);
    kvt_store_all(off, &s, h, 4, true); /* 0..3 held by the tier */

    struct gate g;
    gate_init(&g);
    kv__offload_test_set_hook(off, gate_hook, &g);
    uint32_t ids[4];
    kvt_put_blocks(&s, h + 4, 4, ids);
    const uint64_t s_refs = kvt_pool_refs(&s), d_refs = kvt_pool_refs(&d);
    unsigned char *dsnap = malloc(d.bytes);
    memcpy(dsnap, d.base, d.bytes);

    /* A (a store of 4..7) runs and is held at START; B (a load) and C (a
     * store) queue behind it */
    kv_offload_op *a, *b, *c;
    assert_int_equal(kv_offload_store(off, s.c, ids, 4, &a), KV_OK);
    gate_wait_started(&g);
    assert_int_equal(kv_offload_load(off, d.c, h, 4, &b), KV_OK);
    assert_int_equal(kv_offload_store(off, s.c, ids, 1, &c), KV_OK); /* a touch of h[4] */
    assert_int_equal(kvt_pool_refs(&d), d_refs + 4); /* B's blocks, allocated at post */
    kv_offload_state st;
    assert_int_equal(kv_offload_test(a, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_RUNNING);
    assert_int_equal(kv_offload_wait(a, 5, &st), KV_ERR_TIMEOUT);
    assert_int_equal(st, KV_OFFLOAD_RUNNING);
    assert_non_null(strstr(kv_last_error(), "running"));
    const struct kv_offload_result *res;
    uint32_t n;
    assert_int_equal(kv_offload_results(b, &res, &n), KV_ERR_BAD_STATE);
    assert_int_equal(kv_offload_op_free(b), KV_ERR_BAD_STATE);
    /* B queued: cancelled now, its blocks released, nothing written */
    assert_int_equal(kv_offload_cancel(b), KV_OK);
    assert_int_equal(kv_offload_test(b, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_CANCELLED);
    assert_int_equal(kvt_pool_refs(&d), d_refs);
    assert_int_equal(kv_offload_results(b, &res, &n), KV_OK);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(res[i].status, KV_ERR_CANCELLED);
        assert_int_equal(res[i].block, KV_BLOCK_NULL);
        assert_false(res[i].committed);
    }
    assert_int_equal(kv_offload_cancel(b), KV_OK); /* terminal: left as is */
    assert_int_equal(kv_offload_op_free(b), KV_OK);

    /* A: cancelled from the BLOCK hook after its first chunk (one block) */
    pthread_mutex_lock(&g.mu);
    g.cancel_op = a;
    pthread_mutex_unlock(&g.mu);
    gate_open(&g);
    assert_int_equal(kvt_offload_finish(a), KV_OFFLOAD_CANCELLED);
    assert_int_equal(g.chunks, 1);
    assert_int_equal(kv_offload_results(a, &res, &n), KV_OK);
    assert_int_equal(res[0].status, KV_OK);
    assert_true(kv_offload_contains(off, NULL, h[4])); /* what a cancelled store wrote stays */
    for (uint32_t i = 1; i < 4; i++) {
        assert_int_equal(res[i].status, KV_ERR_CANCELLED);
        assert_false(kv_offload_contains(off, NULL, h[4 + i]));
    }
    assert_int_equal(kv_offload_op_free(a), KV_OK);
    /* C runs to the end */
    assert_int_equal(kvt_offload_finish(c), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(c), KV_OK);
    assert_int_equal(kvt_pool_refs(&s), s_refs); /* the tier released its retains */

    /* a load cancelled after its first chunk: nothing committed, every block
     * released (the one written was never marked valid) */
    kv_offload_op *l;
    struct kv_block_pool_stats p0, p1;
    kv_block_pool_stats_get(d.pool, &p0);
    pthread_mutex_lock(&g.mu);
    g.open = false;
    g.started = false;
    g.chunks = 0;
    g.cancel_op = NULL;
    pthread_mutex_unlock(&g.mu);
    assert_int_equal(kv_offload_load(off, d.c, h, 4, &l), KV_OK);
    gate_wait_started(&g);
    pthread_mutex_lock(&g.mu);
    g.cancel_op = l;
    pthread_mutex_unlock(&g.mu);
    gate_open(&g);
    assert_int_equal(kvt_offload_finish(l), KV_OFFLOAD_CANCELLED);
    assert_int_equal(kv_offload_results(l, &res, &n), KV_OK);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(res[i].status, KV_ERR_CANCELLED);
        assert_int_equal(res[i].block, KV_BLOCK_NULL);
    }
    assert_int_equal(kv_offload_op_free(l), KV_OK);
    kv_block_pool_stats_get(d.pool, &p1);
    assert_int_equal(p1.used_blocks, p0.used_blocks);
    assert_int_equal(p1.hashed_blocks, p0.hashed_blocks);
    assert_int_equal(kvt_pool_refs(&d), d_refs);
    for (int i = 0; i < 4; i++) {
        uint32_t id, nf;
        assert_int_equal(kv_block_pool_lookup(d.pool, &h[i], 1, &id, &nf), KV_OK);
        assert_int_equal(nf, 0);
    }
    /* only the block of the first chunk (now free) may differ in d */
    (void)dsnap;
    free(dsnap);

    struct kv_offload_stats ost;
    assert_int_equal(kv_offload_stats_get(off, &ost), KV_OK);
    assert_int_equal(ost.cancelled_ops, 3);
    kv__offload_test_set_hook(off, NULL, NULL);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 4), KV_OK);
    kvt_cache_free(&s);
    kvt_cache_free(&d);
    kv_offload_destroy(off);
    pthread_mutex_destroy(&g.mu);
    pthread_cond_destroy(&g.cv);
}

/* Two threads cancel one queued op: the first takes it out of the queue and
 * is held (the TAKEN hook) before it finishes the op; the second, which
 * finds the op PENDING and no longer queued, returns only once it is
 * CANCELLED ("a queued op becomes CANCELLED now" for every caller). */
struct taken {
    struct gate g; /* the worker held at START */
    bool taken, release, second_done;
    kv_offload_op *op;
    kv_offload_state second_saw;
};

static void taken_hook(void *user, enum kv__offload_hook_at at, kv_offload_op *op)
{
    struct taken *t = user;
    if (at != KV__OFFLOAD_HOOK_TAKEN) {
        gate_hook(&t->g, at, op);
        return;
    }
    pthread_mutex_lock(&t->g.mu);
    t->taken = true;
    pthread_cond_broadcast(&t->g.cv);
    while (!t->release)
        pthread_cond_wait(&t->g.cv, &t->g.mu);
    pthread_mutex_unlock(&t->g.mu);
}

static void *first_cancel(void *p)
{
    assert_int_equal(kv_offload_cancel(((struct taken *)p)->op), KV_OK);
    return NULL;
}

static void *second_cancel(void *p)
{
    struct taken *t = p;
    kv_offload_state st = KV_OFFLOAD_RUNNING;
    assert_int_equal(kv_offload_cancel(t->op), KV_OK);
    assert_int_equal(kv_offload_test(t->op, &st), KV_OK);
    pthread_mutex_lock(&t->g.mu);
    t->second_saw = st;
    t->second_done = true;
    pthread_mutex_unlock(&t->g.mu);
    return NULL;
}

static void test_offload_cancel_twice(void **state)
{
    (void)state;
    uint64_t rng = 0xCA2;
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 40, 8, 2, 16, KV_BF16, 0, 43);
    kvt_pool_scramble(&s, &rng);
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    uint64_t h[2] = {hash_of(990), hash_of(991)};
    uint32_t ids[2];
    kvt_put_blocks(&s, h, 2, ids);
    const uint64_t refs = kvt_pool_refs(&s);
    struct taken t;
    memset(&t, 0, sizeof(t));
    gate_init(&t.g);
    kv__offload_test_set_hook(off, taken_hook, &t);
    kv_offload_op *a, *b;
    assert_int_equal(kv_offload_store(off, s.c, ids, 1, &a), KV_OK);
    gate_wait_started(&t.g); /* A runs, held; B queues behind it */
    assert_int_equal(kv_offload_store(off, s.c, ids + 1, 1, &b), KV_OK);
    t.op = b;
    pthread_t t1, t2;
    assert_int_equal(pthread_create(&t1, NULL, first_cancel, &t), 0);
    pthread_mutex_lock(&t.g.mu);
    while (!t.taken)
        pthread_cond_wait(&t.g.cv, &t.g.mu);
    pthread_mutex_unlock(&t.g.mu);
    assert_int_equal(pthread_create(&t2, NULL, second_cancel, &t), 0);
    /* the second cancel must wait for the first to finish B: give a wrong
     * early return time to show, then let the first go on */
    struct timespec ts = {0, 30 * 1000 * 1000};
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&t.g.mu);
    const bool early = t.second_done;
    t.release = true;
    pthread_cond_broadcast(&t.g.cv);
    pthread_mutex_unlock(&t.g.mu);
    assert_int_equal(pthread_join(t1, NULL), 0);
    assert_int_equal(pthread_join(t2, NULL), 0);
    assert_false(early);
    assert_int_equal(t.second_saw, KV_OFFLOAD_CANCELLED);
    assert_int_equal(kvt_offload_finish(b), KV_OFFLOAD_CANCELLED);
    gate_open(&t.g);
    assert_int_equal(kvt_offload_finish(a), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(a), KV_OK);
    assert_int_equal(kv_offload_op_free(b), KV_OK);
    assert_int_equal(kvt_pool_refs(&s), refs); /* both ops released their retains */
    kv__offload_test_set_hook(off, NULL, NULL);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
    kvt_cache_free(&s);
    kv_offload_destroy(off);
    pthread_mutex_destroy(&t.g.mu);
    pthread_cond_destroy(&t.g.cv);
}

struct destroy_arg {
    kv_offload *off;
};

static void *destroy_thread(void *p)
{
    kv_offload_destroy(((struct destroy_arg *)p)->off);
    return NULL;
}

/* Destroy with one op running and two queued: every op ends CANCELLED,
 * every block is released, the handles stay valid for op_free. */
static void test_offload_destroy_cancels(void **state)
{
    (void)state;
    uint64_t rng = 0xDE5;
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 80, 8, 2, 16, KV_BF16, 0, 51);
    kvt_pool_scramble(&s, &rng);
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    uint64_t h[3] = {hash_of(11), hash_of(12), hash_of(13)};
    uint32_t ids[3];
    kvt_put_blocks(&s, h, 3, ids);
    const uint64_t refs = kvt_pool_refs(&s);
    struct gate g;
    gate_init(&g);
    kv__offload_test_set_hook(off, gate_hook, &g);
    kv_offload_op *op[3];
    assert_int_equal(kv_offload_store(off, s.c, ids, 3, &op[0]), KV_OK);
    gate_wait_started(&g);
    assert_int_equal(kv_offload_store(off, s.c, ids, 1, &op[1]), KV_OK);
    assert_int_equal(kv_offload_load(off, s.c, h, 2, &op[2]), KV_OK);
    struct destroy_arg da = {off};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, destroy_thread, &da), 0);
    /* the queued ones end as soon as destroy takes the queue */
    kv_offload_state st;
    assert_int_equal(kv_offload_wait(op[1], WAIT_MS, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_CANCELLED);
    assert_int_equal(kv_offload_wait(op[2], WAIT_MS, &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_CANCELLED);
    gate_open(&g);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(kv_offload_test(op[0], &st), KV_OK);
    assert_int_equal(st, KV_OFFLOAD_CANCELLED);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kv_offload_op_free(op[i]), KV_OK);
    assert_int_equal(kvt_pool_refs(&s), refs);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 3), KV_OK);
    kvt_cache_free(&s);
    pthread_mutex_destroy(&g.mu);
    pthread_cond_destroy(&g.cv);
}

/* A load refused after its blocks could be allocated changes nothing of the
 * pool: 16 other cache layouts have ops in flight (the worker held on the
 * first), so the tier has no slot for a 17th; the block the refused load
 * would have taken is a cached one at the head of the free list, and it
 * stays cached, its hash findable, no REMOVED event fired (the allocation
 * once came first and evicted it). */
static void test_offload_load_refused_keeps_the_cache(void **state)
{
    (void)state;
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    struct gate g;
    gate_init(&g);
    kv__offload_test_set_hook(off, gate_hook, &g);
    struct kvt_cache t[17];
    kv_offload_op *op[16];
    for (int i = 0; i < 17; i++) /* 17 layouts: block counts 4 .. 20 */
        kvt_cache_make(&t[i], 1, 4 + i, 4, 1, 8, KV_F16, 0, 90 + (uint64_t)i);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(kv_offload_store(off, t[i].c, NULL, 0, &op[i]), KV_OK);
        if (i == 0)
            gate_wait_started(&g);
    }
    /* the last cache's one cached block at the head of its free list */
    kv_block_pool *pool = t[16].pool;
    const uint64_t h = hash_of(1701);
    uint32_t id, held[20];
    kvt_put_blocks(&t[16], &h, 1, &id);
    assert_int_equal(kv_block_pool_release(pool, &id, 1), KV_OK);
    struct kv_block_pool_stats p0, p1;
    kv_block_pool_stats_get(pool, &p0);
    assert_int_equal(kv_block_pool_alloc(pool, p0.free_blocks, held), KV_OK);
    kv_block_pool_stats_get(pool, &p0);
    assert_int_equal(p0.cached_blocks, 1);
    assert_int_equal(p0.free_blocks, 0);

    kv_offload_op *lop = (kv_offload_op *)0x1;
    assert_int_equal(kv_offload_load(off, t[16].c, &h, 1, &lop), KV_ERR_CAPACITY);
    assert_non_null(strstr(kv_last_error(), "16 other cache layouts"));
    assert_ptr_equal(lop, (kv_offload_op *)0x1);
    kv_block_pool_stats_get(pool, &p1);
    assert_string_equal(kvt_block_pool_stats_diff(&p0, &p1), "");
    uint64_t got = 0;
    assert_int_equal(kv_block_pool_block_hash(pool, id, &got), KV_OK);
    assert_int_equal(got, h);

    gate_open(&g);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(kvt_offload_finish(op[i]), KV_OFFLOAD_DONE);
        assert_int_equal(kv_offload_op_free(op[i]), KV_OK);
    }
    /* a slot is free again: the same load posts, and misses */
    assert_int_equal(kv_offload_load(off, t[16].c, &h, 1, &lop), KV_OK);
    assert_int_equal(kvt_offload_finish(lop), KV_OFFLOAD_FAILED);
    assert_int_equal(kv_offload_op_free(lop), KV_OK);
    kv__offload_test_set_hook(off, NULL, NULL);
    kv_offload_destroy(off);
    assert_int_equal(kv_block_pool_release(pool, held, (uint32_t)(p0.capacity - 1)), KV_OK);
    for (int i = 0; i < 17; i++)
        kvt_cache_free(&t[i]);
    pthread_mutex_destroy(&g.mu);
    pthread_cond_destroy(&g.cv);
}

/* The engine destroys its cache while a store and a load of it are queued
 * behind a running op: each op holds its own reference on the cache until it
 * is terminal, so the worker copies from and into live memory, every op ends
 * DONE with the right bytes, and the cache is freed with the last op (under
 * ASan: no use after free; LSan: no leak). */
static void test_offload_cache_destroyed_with_ops_queued(void **state)
{
    (void)state;
    uint64_t rng = 0xCAC4E;
    struct kvt_cache s, d;
    kvt_cache_make(&s, 2, 64, 8, 2, 16, KV_BF16, 0, 81);
    kvt_cache_make(&d, 2, 64, 8, 2, 16, KV_BF16, 2, 82); /* the same block format */
    kvt_pool_scramble(&s, &rng);
    kvt_pool_scramble(&d, &rng);
    kv_offload *off = mk_tier((size_t)1 << 20, 0);
    uint64_t h[4];
    for (int i = 0; i < 4; i++)
        h[i] = hash_of(900 + (uint64_t)i);
    kvt_store_all(off, &s, h, 2, true); /* h[0], h[1]: in the tier, for the load */
    uint32_t ids[2];
    kvt_put_blocks(&s, h + 2, 2, ids); /* h[2], h[3]: for the store */
    struct gate g;
    gate_init(&g);
    kv__offload_test_set_hook(off, gate_hook, &g);

    /* A (a load into d) runs, held at START; B (a store of s) and C (a load
     * into s) queue behind it */
    kv_offload_op *a, *b, *c;
    assert_int_equal(kv_offload_load(off, d.c, h, 1, &a), KV_OK);
    gate_wait_started(&g);
    assert_int_equal(kv_offload_store(off, s.c, ids, 2, &b), KV_OK);
    assert_int_equal(kv_offload_load(off, s.c, h, 2, &c), KV_OK);
    /* the engine lets go of everything of s: its blocks, then the cache */
    assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
    kv_cache_destroy(s.c);
    s.c = NULL;
    gate_open(&g);
    assert_int_equal(kvt_offload_finish(a), KV_OFFLOAD_DONE);
    assert_int_equal(kvt_offload_finish(b), KV_OFFLOAD_DONE);
    assert_int_equal(kvt_offload_finish(c), KV_OFFLOAD_DONE);
    const struct kv_offload_result *res;
    uint32_t n;
    assert_int_equal(kv_offload_results(c, &res, &n), KV_OK);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(res[i].status, KV_OK);
    assert_int_equal(kv_offload_results(a, &res, &n), KV_OK);
    assert_int_equal(res[0].status, KV_OK);
    assert_int_equal(kv_block_pool_release(d.pool, &res[0].block, 1), KV_OK);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kv_offload_op_free(i == 0 ? a : i == 1 ? b : c), KV_OK);
    /* B copied the blocks of s as they were: d loads exactly them */
    kv__offload_test_set_hook(off, NULL, NULL);
    const kv_status want[2] = {KV_OK, KV_OK};
    assert_int_equal(kvt_load_check(off, &d, h + 2, 2, want, false), KV_OFFLOAD_DONE);
    kvt_cache_free(&d);
    kv_offload_destroy(off);
    pthread_mutex_destroy(&g.mu);
    pthread_cond_destroy(&g.cv);
}

/* Every order of letting go of the handles of a tier with live ops: the
 * engine's cache (kv_cache_destroy), the tier (kv_offload_destroy), the op
 * handles (kv_offload_op_free) and a staging buffer, with the worker
 * letting the ops run (RUN) somewhere in between: 5! orders, the running op
 * a store and the queued one a load, then the other way round. Nothing is
 * freed under a user: an op not yet terminal is refused naming its state;
 * ops on a destroyed cache run to DONE on live memory; a staging buffer
 * out at destroy stays writable until it is returned (under ASan: no use
 * after free; LSan: no leak, each cache freed with its last reference). */
enum { EV_CACHE, EV_TIER, EV_OPS, EV_STAGING, EV_RUN, N_EV };

struct handles {
    struct kvt_cache s;
    kv_offload *off;
    struct gate g;
    kv_offload_op *run, *queued; /* held at START; queued behind it */
    bool run_is_store;
    void *stg;
    bool cache_gone, tier_gone, ran, ops_freed, stg_freed;
};

/* Let the ops end: normally (DONE), or by destroying the tier (CANCELLED). */
static void *destroy_tier_thread(void *p)
{
    kv_offload_destroy(p);
    return NULL;
}

static void handles_event(struct handles *x, int ev)
{
    kv_offload_state st;
    switch (ev) {
    case EV_CACHE:
        kv_cache_destroy(x->s.c); /* the engine's reference; the ops hold theirs */
        x->s.c = NULL;
        x->cache_gone = true;
        break;
    case EV_RUN:
        if (x->ran)
            break;
        gate_open(&x->g);
        assert_int_equal(kvt_offload_finish(x->run), KV_OFFLOAD_DONE);
        assert_int_equal(kvt_offload_finish(x->queued), KV_OFFLOAD_DONE);
        x->ran = true;
        if (!x->cache_gone) { /* the loaded blocks are the caller's now */
            kv_offload_op *ld = x->run_is_store ? x->queued : x->run;
            const struct kv_offload_result *res;
            uint32_t n;
            assert_int_equal(kv_offload_results(ld, &res, &n), KV_OK);
            for (uint32_t i = 0; i < n; i++) {
                assert_int_equal(res[i].status, KV_OK);
                assert_true(kvt_block_holds(&x->s, x->s.base, res[i].block, res[i].hash));
                assert_int_equal(kv_block_pool_release(x->s.pool, &res[i].block, 1), KV_OK);
            }
        }
        break;
    case EV_TIER:
        if (!x->ran) { /* ops live: destroy cancels them, the queued one at once */
            pthread_t th;
            assert_int_equal(pthread_create(&th, NULL, destroy_tier_thread, x->off), 0);
            assert_int_equal(kv_offload_wait(x->queued, WAIT_MS, &st), KV_OK);
            assert_int_equal(st, KV_OFFLOAD_CANCELLED);
            gate_open(&x->g);
            assert_int_equal(pthread_join(th, NULL), 0);
            assert_int_equal(kv_offload_test(x->run, &st), KV_OK);
            assert_int_equal(st, KV_OFFLOAD_CANCELLED);
            x->ran = true;
        } else {
            kv_offload_destroy(x->off);
        }
        x->tier_gone = true;
        break;
    case EV_OPS:
        if (!x->ran) { /* refused, naming the state; freed once terminal */
            assert_int_equal(kv_offload_op_free(x->run), KV_ERR_BAD_STATE);
            assert_non_null(strstr(kv_last_error(), "running"));
            assert_int_equal(kv_offload_op_free(x->queued), KV_ERR_BAD_STATE);
            assert_non_null(strstr(kv_last_error(), "pending"));
            break;
        }
        assert_int_equal(kv_offload_op_free(x->run), KV_OK);
        assert_int_equal(kv_offload_op_free(x->queued), KV_OK);
        x->ops_freed = true;
        break;
    case EV_STAGING:
        memset(x->stg, 0x5A, 4096); /* still the caller's, destroyed tier or not */
        if (x->tier_gone) {
            void *q = NULL;
            assert_int_equal(kv_offload_staging_alloc(x->off, 4096, &q), KV_ERR_BAD_STATE);
        }
        assert_int_equal(kv_offload_staging_free(x->off, x->stg), KV_OK); /* the last: frees */
        x->stg_freed = true;
        break;
    }
}

static void test_offload_free_orders(void **state)
{
    (void)state;
    uint64_t rng = 0x0DE25;
    int orders = 0;
    for (int variant = 0; variant < 2; variant++)
        for (int perm = 0; perm < 120; perm++) {
            int ev[N_EV], pool[N_EV] = {0, 1, 2, 3, 4}, left = N_EV, code = perm;
            for (int i = 0; i < N_EV; i++) { /* the perm-th permutation (factorial base) */
                const int k = code % left;
                code /= left;
                ev[i] = pool[k];
                pool[k] = pool[--left];
            }
            struct handles x;
            memset(&x, 0, sizeof(x));
            kvt_cache_make(&x.s, 2, 32, 8, 2, 16, KV_BF16, variant ? 6 : 0, 90 + (uint64_t)perm);
            kvt_pool_scramble(&x.s, &rng);
            x.off = mk_tier((size_t)256 << 10, 64 << 10);
            uint64_t h[4];
            for (int i = 0; i < 4; i++)
                h[i] = hash_of(1000 + (uint64_t)i);
            kvt_store_all(x.off, &x.s, h, 2, true); /* h[0], h[1]: for the load */
            uint32_t ids[2];
            kvt_put_blocks(&x.s, h + 2, 2, ids); /* h[2], h[3]: for the store */
            assert_int_equal(kv_offload_staging_alloc(x.off, 4096, &x.stg), KV_OK);
            gate_init(&x.g);
            kv__offload_test_set_hook(x.off, gate_hook, &x.g);
            x.run_is_store = variant == 0;
            kv_offload_op *st_op, *ld_op;
            if (x.run_is_store) {
                assert_int_equal(kv_offload_store(x.off, x.s.c, ids, 2, &st_op), KV_OK);
                gate_wait_started(&x.g);
                assert_int_equal(kv_offload_load(x.off, x.s.c, h, 2, &ld_op), KV_OK);
                x.run = st_op;
                x.queued = ld_op;
            } else {
                assert_int_equal(kv_offload_load(x.off, x.s.c, h, 2, &ld_op), KV_OK);
                gate_wait_started(&x.g);
                assert_int_equal(kv_offload_store(x.off, x.s.c, ids, 2, &st_op), KV_OK);
                x.run = ld_op;
                x.queued = st_op;
            }
            assert_int_equal(kv_block_pool_release(x.s.pool, ids, 2), KV_OK); /* tier retains */
            for (int i = 0; i < N_EV; i++)
                handles_event(&x, ev[i]);
            if (!x.ops_freed) { /* refused while live: terminal now */
                assert_int_equal(kv_offload_op_free(x.run), KV_OK);
                assert_int_equal(kv_offload_op_free(x.queued), KV_OK);
            }
            assert_true(x.cache_gone && x.tier_gone && x.ran && x.stg_freed);
            pthread_mutex_destroy(&x.g.mu);
            pthread_cond_destroy(&x.g.cv);
            orders++;
        }
    assert_int_equal(orders, 240);
}

/* ---- staging and the carver ---------------------------------------------- */

static void test_offload_staging(void **state)
{
    (void)state;
    kv_offload *off = mk_tier((size_t)1 << 20, (size_t)256 << 10);
    struct kv_mem_region r;
    size_t nr;
    assert_int_equal(kv_offload_regions(off, &r, 1, &nr), KV_OK);
    void *p[4];
    const size_t sz[4] = {100 << 10, 64 << 10, 4096, 1};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kv_offload_staging_alloc(off, sz[i], &p[i]), KV_OK);
        assert_true((char *)p[i] >= (char *)r.ptr &&
                    (char *)p[i] + sz[i] <= (char *)r.ptr + r.bytes);
        assert_int_equal((uintptr_t)p[i] % 4096, 0);
        memset(p[i], 0xA0 + i, sz[i]);
    }
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    /* each counted as the pages it takes: 1 byte takes a page */
    assert_int_equal(st.staging_bytes, (100 << 10) + (64 << 10) + 4096 + 4096);
    void *q = NULL;
    assert_int_equal(kv_offload_staging_alloc(off, 100 << 10, &q), KV_ERR_CAPACITY);
    assert_non_null(strstr(kv_last_error(), "staging_bytes"));
    assert_int_equal(kv_offload_staging_alloc(off, 0, &q), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_offload_staging_alloc(NULL, 1, &q), KV_ERR_NULL);
    for (int i = 0; i < 4; i++)
        for (size_t k = 0; k < sz[i]; k++)
            assert_int_equal(((unsigned char *)p[i])[k], 0xA0 + i);
    assert_int_equal(kv_offload_staging_free(off, p[0]), KV_OK);
    assert_int_equal(kv_offload_staging_free(off, p[0]), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_offload_staging_free(off, (char *)p[1] + 8), KV_ERR_INVALID_ARG);
    assert_int_equal(kv_offload_staging_free(off, NULL), KV_ERR_NULL);
    assert_int_equal(kv_offload_staging_alloc(off, 100 << 10, &q), KV_OK); /* room again */
    assert_int_equal(kv_offload_staging_free(off, q), KV_OK);
    for (int i = 1; i < 4; i++)
        assert_int_equal(kv_offload_staging_free(off, p[i]), KV_OK);
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.staging_bytes, 0);
    /* a staging buffer out at destroy keeps the region: still writable, and
     * returning it frees the tier (LSan: nothing left) */
    assert_int_equal(kv_offload_staging_alloc(off, 4096, &q), KV_OK);
    void *q2 = NULL;
    assert_int_equal(kv_offload_staging_alloc(off, 8192, &q2), KV_OK);
    kv_offload_destroy(off);
    memset(q, 0x11, 4096);
    memset(q2, 0x22, 8192);
    assert_int_equal(kv_offload_staging_alloc(off, 4096, &p[0]), KV_ERR_BAD_STATE);
    assert_non_null(strstr(kv_last_error(), "destroyed"));
    assert_int_equal(kv_offload_staging_free(off, q), KV_OK);
    for (size_t k = 0; k < 8192; k++)
        assert_int_equal(((unsigned char *)q2)[k], 0x22);
    assert_int_equal(kv_offload_staging_free(off, q2), KV_OK); /* the last: frees the tier */
}

/* A tier destroyed with a staging buffer still out keeps its handle, but
 * its table is gone (found by an audit): kv_offload_evict and
 * kv_offload_contains walked the freed buckets (a NULL dereference). Now
 * evict is refused naming the state and nothing is touched, contains
 * answers false, and the buffer's return still frees the tier. */
static void test_offload_destroyed_tier_table_calls(void **state)
{
    (void)state;
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 16, 8, 2, 16, KV_F16, 0, 77);
    kv_offload *off = mk_tier((size_t)256 << 10, 64 << 10);
    uint64_t h[2] = {hash_of(501), hash_of(502)};
    kvt_store_all(off, &s, h, 2, true);
    assert_true(kv_offload_contains(off, s.c, h[0]));
    void *q = NULL;
    assert_int_equal(kv_offload_staging_alloc(off, 4096, &q), KV_OK);
    kv_offload_destroy(off);
    assert_false(kv_offload_contains(off, s.c, h[0]));
    assert_false(kv_offload_contains(off, NULL, h[1]));
    uint32_t n_evicted = 77;
    assert_int_equal(kv_offload_evict(off, h, 2, &n_evicted), KV_ERR_BAD_STATE);
    kvt_assert_msg_has("kv_offload_evict: the tier is destroyed (1 staging buffers");
    kvt_assert_msg_has("2 hashes not evicted");
    assert_int_equal(n_evicted, 77); /* not written on the refusal */
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.entries, 0);
    /* the buffer is still the caller's; returning it, the last, frees the tier */
    memset(q, 0x3C, 4096);
    assert_int_equal(kv_offload_staging_free(off, q), KV_OK);
    kvt_cache_free(&s);
}

struct piece {
    unsigned char *p;
    size_t n;
    unsigned char tag;
};

static void test_offload_carver(void **state)
{
    (void)state;
    const size_t bytes = (size_t)64 << 20;
    unsigned char *base = aligned_alloc(4096, bytes);
    assert_non_null(base);
    kv__carver *c = NULL;
    assert_int_equal(kv__carver_create(base, bytes, &c), KV_OK);
    assert_non_null(kv__carver_name());
    enum { MAXP = 512 };
    struct piece *live = calloc(MAXP, sizeof(*live));
    int n_live = 0;
    uint64_t rng = 0xCA7;
    for (int it = 0; it < 6000; it++) {
        if (n_live < MAXP && (n_live == 0 || kvt_rand(&rng) % 3 != 0)) {
            const size_t n = (size_t)kvt_range(&rng, 1, 256 << 10);
            const size_t align = (size_t)1 << kvt_range(&rng, 0, 12);
            bool oom = true;
            unsigned char *p = kv__carver_alloc(c, n, align, &oom);
            assert_false(oom); /* nothing injected: only room can run out */
            if (!p)
                continue; /* full for now */
            assert_true(p >= base && p + n <= base + bytes);
            assert_int_equal((uintptr_t)p % align, 0);
            const unsigned char tag = (unsigned char)(it | 1);
            memset(p, tag, n);
            live[n_live++] = (struct piece){p, n, tag};
        } else {
            const int k = (int)kvt_range(&rng, 0, n_live - 1);
            for (size_t i = 0; i < live[k].n; i++) /* nobody else wrote here */
                assert_int_equal(live[k].p[i], live[k].tag);
            kv__carver_free(c, live[k].p);
            live[k] = live[--n_live];
        }
    }
    for (int k = 0; k < n_live; k++) {
        for (size_t i = 0; i < live[k].n; i++)
            assert_int_equal(live[k].p[i], live[k].tag);
        kv__carver_free(c, live[k].p);
    }
    /* exhaust: NULL, never memory outside the region */
    n_live = 0;
    for (;;) {
        bool oom = true;
        unsigned char *p = kv__carver_alloc(c, (size_t)1 << 20, 64, &oom);
        if (!p) {
            assert_false(oom); /* full, not out of memory */
            break;
        }
        assert_true(p >= base && p + ((size_t)1 << 20) <= base + bytes);
        assert_true(n_live < MAXP);
        live[n_live++] = (struct piece){p, (size_t)1 << 20, 0};
    }
    assert_true(n_live >= 32); /* at least half the region was usable in 1 MiB pieces */
    assert_true(kv__carver_used(c) <= bytes);
    for (int k = 0; k < n_live; k++)
        kv__carver_free(c, live[k].p);
    /* freed space is reused */
    bool oom = true;
    unsigned char *p = kv__carver_alloc(c, (size_t)1 << 20, 64, &oom);
    assert_non_null(p);
    kv__carver_free(c, p);
    kv__carver_free(c, NULL);
    assert_null(kv__carver_alloc(c, 0, 64, &oom));
    assert_false(oom);
    kv__carver_destroy(c);
    free(live);
    free(base);
}

/* ---- threads ------------------------------------------------------------- */

struct worker_arg {
    kv_offload *off;
    int id;
    int rounds;
    int failures;
};

/* One engine thread: its own two caches, its own hashes; store a batch,
 * load it into the other cache, check every block; evict half. */
static void *engine_thread(void *p)
{
    struct worker_arg *w = p;
    struct kvt_cache s, d;
    uint64_t rng = 0xE461 + (uint64_t)w->id;
    kvt_cache_make(&s, 2, 64, 8, 2, 16, KV_BF16, 0, 61 + (uint64_t)w->id);
    kvt_cache_make(&d, 2, 64, 8, 2, 16, KV_BF16, 2, 71 + (uint64_t)w->id);
    kvt_pool_scramble(&s, &rng);
    kvt_pool_scramble(&d, &rng);
    for (int r = 0; r < w->rounds; r++) {
        enum { NB = 6 };
        uint64_t h[NB];
        uint32_t ids[NB];
        for (int i = 0; i < NB; i++)
            h[i] = hash_of(((uint64_t)w->id << 32) | (uint64_t)(r * NB + i));
        kvt_put_blocks(&s, h, NB, ids);
        kv_offload_op *st_op, *ld_op;
        if (kv_offload_store(w->off, s.c, ids, NB, &st_op) != KV_OK)
            w->failures++;
        assert_int_equal(kv_block_pool_release(s.pool, ids, NB), KV_OK);
        kv_offload_state x;
        if (kv_offload_wait(st_op, WAIT_MS, &x) != KV_OK || x != KV_OFFLOAD_DONE)
            w->failures++;
        assert_int_equal(kv_offload_op_free(st_op), KV_OK);
        if (kv_offload_load(w->off, d.c, h, NB, &ld_op) != KV_OK)
            w->failures++;
        if (kv_offload_wait(ld_op, WAIT_MS, &x) != KV_OK || x != KV_OFFLOAD_DONE)
            w->failures++;
        const struct kv_offload_result *res;
        uint32_t n;
        assert_int_equal(kv_offload_results(ld_op, &res, &n), KV_OK);
        for (uint32_t i = 0; i < n; i++) {
            if (res[i].status != KV_OK || !kvt_block_holds(&d, d.base, res[i].block, h[i]))
                w->failures++;
            if (res[i].block != KV_BLOCK_NULL)
                assert_int_equal(kv_block_pool_release(d.pool, &res[i].block, 1), KV_OK);
        }
        assert_int_equal(kv_offload_op_free(ld_op), KV_OK);
        uint32_t ne;
        assert_int_equal(kv_offload_evict(w->off, h, NB / 2, &ne), KV_OK);
        if (ne != NB / 2)
            w->failures++;
        struct kv_offload_stats os;
        assert_int_equal(kv_offload_stats_get(w->off, &os), KV_OK);
        if (os.bytes > os.capacity_bytes)
            w->failures++;
        kvt_pool_scramble(&s, &rng);
        kvt_pool_scramble(&d, &rng);
    }
    if (kvt_pool_refs(&s) != 0 || kvt_pool_refs(&d) != 0)
        w->failures++;
    kvt_cache_free(&s);
    kvt_cache_free(&d);
    return NULL;
}

static void test_offload_threads(void **state)
{
    (void)state;
    kv_offload *off = mk_tier((size_t)8 << 20, 0);
    enum { NT = 3 };
    struct worker_arg w[NT];
    pthread_t th[NT];
    for (int i = 0; i < NT; i++) {
        w[i] = (struct worker_arg){off, i, 40, 0};
        assert_int_equal(pthread_create(&th[i], NULL, engine_thread, &w[i]), 0);
    }
    for (int i = 0; i < NT; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(w[i].failures, 0);
    }
    struct kv_offload_stats st;
    assert_int_equal(kv_offload_stats_get(off, &st), KV_OK);
    assert_int_equal(st.stores, NT * 40 * 6);
    assert_int_equal(st.loads, NT * 40 * 6);
    assert_int_equal(st.entries, NT * 40 * 3);
    assert_int_equal(st.failed_ops, 0);
    kv_offload_destroy(off);
}

/* Every op streams its stores, whatever its size (restored after). */
static uint64_t nt_saved;
static int setup_streaming(void **state)
{
    (void)state;
    nt_saved = kv__pack_nt_min_bytes;
    kv__pack_nt_min_bytes = 0;
    return 0;
}

static int teardown_streaming(void **state)
{
    (void)state;
    kv__pack_nt_min_bytes = nt_saved;
    return 0;
}

/* Capacity and staging count what entries and buffers take of the region:
 * 16 KiB entries take 20 KiB with jemalloc (a large class and its page), so
 * counting 16 KiB let them outgrow capacity into the staging budget and
 * the slack (evictions with capacity 82% used, a staging buffer of the
 * budget refused with none out). */
static void test_offload_capacity_counts_the_region(void **state)
{
    (void)state;
    uint64_t rng = 0xCA9;
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 300, 16, 4, 32, KV_BF16, 0, 41);
    kvt_pool_scramble(&s, &rng);
    assert_int_equal(entry_bytes(&s), 16384);
    const size_t cap = (size_t)4 << 20, stg = (size_t)1 << 20;
    kv_offload *off = mk_tier(cap, stg);
    const uint64_t piece = piece_bytes(16384, 64);
    const uint32_t fit = (uint32_t)(cap / piece);
    uint64_t *h = malloc((fit + 1) * sizeof(*h));
    assert_non_null(h);
    for (uint32_t i = 0; i <= fit; i++)
        h[i] = hash_of(9000 + (uint64_t)i);
    kvt_store_all(off, &s, h, fit, true); /* exactly full: nothing evicted */
    expect_table(off, fit, fit * piece, 0);
    kvt_store_all(off, &s, &h[fit], 1, true); /* one more: the oldest goes */
    expect_table(off, fit, fit * piece, 1);
    assert_false(kv_offload_contains(off, s.c, h[0]));
    void *p = NULL; /* the whole staging budget, the tier full */
    assert_int_equal(kv_offload_staging_alloc(off, stg, &p), KV_OK);
    assert_int_equal(kv_offload_staging_free(off, p), KV_OK);
    /* 1-byte buffers count a page each: the budget holds stg / 4096 of them */
    void **ps = malloc((stg / 4096 + 1) * sizeof(*ps));
    assert_non_null(ps);
    for (size_t i = 0; i < stg / 4096; i++)
        assert_int_equal(kv_offload_staging_alloc(off, 1, &ps[i]), KV_OK);
    assert_int_equal(kv_offload_staging_alloc(off, 1, &p), KV_ERR_CAPACITY);
    kvt_assert_msg_has("1 bytes (4096 of the region)");
    for (size_t i = 0; i < stg / 4096; i++)
        assert_int_equal(kv_offload_staging_free(off, ps[i]), KV_OK);
    free(ps);
    free(h);
    kv_offload_destroy(off);
    kvt_cache_free(&s);
}

/* The caller's arrays misaligned for their elements (uint32 ids, uint64
 * hashes, the regions' structs): read or written as words, undefined
 * behaviour (UBSan aborts). Refused by name, nothing posted, retained,
 * allocated or evicted, the out-params untouched; the aligned twins then
 * work. */
static void test_offload_misaligned_arrays(void **state)
{
    (void)state;
    struct kvt_cache s;
    kvt_cache_make(&s, 2, 16, 8, 2, 16, KV_F16, 0, 78);
    kv_offload *off = mk_tier((size_t)256 << 10, 64 << 10);
    const uint64_t h[2] = {hash_of(601), hash_of(602)};
    kvt_store_all(off, &s, h, 2, false); /* the blocks stay held by the caller */
    uint32_t ids[2];
    uint32_t n_found = 0;
    assert_int_equal(kv_block_pool_lookup(s.pool, h, 2, ids, &n_found), KV_OK);
    assert_int_equal(n_found, 2);
    _Alignas(uint64_t) char ibuf[1 + sizeof(ids)], hbuf[1 + sizeof(h)];
    _Alignas(struct kv_mem_region) char rbuf[1 + sizeof(struct kv_mem_region)];
    memcpy(ibuf + 1, ids, sizeof(ids));
    memcpy(hbuf + 1, h, sizeof(h));
    const uint32_t *im = (const uint32_t *)(void *)(ibuf + 1);
    const uint64_t *hm = (const uint64_t *)(void *)(hbuf + 1);
    struct kv_mem_region *rm = (struct kv_mem_region *)(void *)(rbuf + 1);
    const uint64_t refs = kvt_pool_refs(&s);
    struct kv_block_pool_stats ps0, ps1;
    kv_block_pool_stats_get(s.pool, &ps0);
    struct kv_offload_stats os0, os1;
    assert_int_equal(kv_offload_stats_get(off, &os0), KV_OK);
    kv_offload_op *op = (kv_offload_op *)(uintptr_t)0x5A;
    uint32_t n_evicted = 77;
    size_t nr = 77;

    assert_int_equal(kv_offload_store(off, s.c, im, 2, &op), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_offload_store: ids=");
    assert_int_equal(kv_offload_load(off, s.c, hm, 2, &op), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_offload_load: hashes=");
    assert_ptr_equal(op, (kv_offload_op *)(uintptr_t)0x5A);
    assert_int_equal(kv_offload_evict(off, hm, 2, &n_evicted), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_offload_evict: hashes=");
    assert_int_equal(n_evicted, 77);
    assert_int_equal(kv_offload_regions(off, rm, 1, &nr), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("out=");
    assert_int_equal(kv_cache_regions(s.c, rm, 1, &nr), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("out=");
    assert_int_equal(nr, 77);

    assert_int_equal(kvt_pool_refs(&s), refs);
    kv_block_pool_stats_get(s.pool, &ps1);
    assert_string_equal(kvt_block_pool_stats_diff(&ps1, &ps0), "");
    assert_int_equal(kv_offload_stats_get(off, &os1), KV_OK);
    assert_int_equal(os1.entries, os0.entries);
    assert_int_equal(os1.stores, os0.stores);
    assert_int_equal(os1.store_touches, os0.store_touches);
    assert_int_equal(os1.evicted, os0.evicted);
    assert_int_equal(os1.hits, os0.hits);
    assert_int_equal(os1.misses, os0.misses);
    assert_true(kv_offload_contains(off, s.c, h[0]));
    assert_true(kv_offload_contains(off, s.c, h[1]));

    /* the aligned twins */
    assert_int_equal(kv_offload_store(off, s.c, ids, 2, &op), KV_OK);
    assert_int_equal(kvt_offload_finish(op), KV_OFFLOAD_DONE);
    assert_int_equal(kv_offload_op_free(op), KV_OK);
    assert_int_equal(kv_offload_evict(off, h, 2, &n_evicted), KV_OK);
    assert_int_equal(n_evicted, 2);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
    assert_int_equal(kv_block_pool_release(s.pool, ids, 2), KV_OK);
    kv_offload_destroy(off);
    kvt_cache_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_offload_create),
        cmocka_unit_test(test_offload_every_layout),
        cmocka_unit_test(test_offload_wide_rows),
        cmocka_unit_test(test_offload_commit_semantics),
        cmocka_unit_test(test_offload_load_failures),
        cmocka_unit_test(test_offload_formats_share_hashes),
        cmocka_unit_test(test_offload_tp_ranks_share_tier),
        cmocka_unit_test(test_offload_formats_lru),
        cmocka_unit_test(test_offload_lru),
        cmocka_unit_test(test_offload_post_refusals),
        cmocka_unit_test(test_offload_cancel),
        cmocka_unit_test(test_offload_cancel_twice),
        cmocka_unit_test(test_offload_destroy_cancels),
        cmocka_unit_test(test_offload_load_refused_keeps_the_cache),
        cmocka_unit_test(test_offload_cache_destroyed_with_ops_queued),
        cmocka_unit_test(test_offload_free_orders),
        cmocka_unit_test(test_offload_staging),
        cmocka_unit_test(test_offload_destroyed_tier_table_calls),
        cmocka_unit_test(test_offload_misaligned_arrays),
        cmocka_unit_test(test_offload_carver),
        cmocka_unit_test(test_offload_capacity_counts_the_region),
        cmocka_unit_test(test_offload_threads),
        cmocka_unit_test(test_offload_threads_chunks),
        cmocka_unit_test_setup_teardown(test_offload_every_layout, setup_streaming,
                                        teardown_streaming),
        cmocka_unit_test_setup_teardown(test_offload_load_failures, setup_streaming,
                                        teardown_streaming),
        cmocka_unit_test_setup_teardown(test_offload_threads_chunks, setup_streaming,
                                        teardown_streaming),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
