/*
 * test_attn_edges.c - the kernel entry points (attention/kv_attn.h) against
 * arguments an audit (2026-12-05) found reaching past the validator. Each
 * case reproduces the bug and checks the fix; every refusal names its
 * values and leaves the whole cache and every output as they were:
 *
 *   - an lse_stride so large that the lse extent wrapped 64 bits: the
 *     overlap tests passed and an lse row landed in the cache;
 *   - pages of 2^32 tokens or more (block_tokens / page_ratio): the kernels
 *     keep a page's tokens in 32 bits (2^32 + 1 read past the page list,
 *     2^32 divided by zero);
 *   - a size-1 dim with a stride near 2^62, an empty view with an offset
 *     near 2^62: both valid views whose byte strides overflowed int64;
 *   - out (or k_out, or the cache written) over the scale arrays: the
 *     kernel read scales it had overwritten;
 *   - a batch of block copies with ids of 2^31 or more: valid batches
 *     refused as overlapping (the id's top bit was lost in a packed key);
 *   - a layer of 2^32 - 1 named as such (was "layer -2");
 *   - index and scale arrays misaligned for their element: read as words
 *     (undefined behaviour), now refused naming the array.
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <math.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_attn_int.h" /* kv__attn_test_tune, kv__attn_avx2_only: every CPU path */
#include "kvtest.h"

/* A cache of L layers x B blocks of N tokens, H heads of D f32, filled with
 * a pattern; the caller frees base. */
static struct kv_paged_cache mk_cache(int64_t L, int64_t B, int64_t N, int64_t H, int64_t D)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = L, cfg.num_blocks = B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = KV_F32;
    struct kv_paged_cache c;
    memset(&c, 0, sizeof(c));
    assert_int_equal(kv_layout_init(&cfg, &c.layout), KV_OK);
    c.storage_bytes = (size_t)c.layout.total_bytes;
    c.base = aligned_alloc(64, (c.storage_bytes + 63) / 64 * 64);
    assert_non_null(c.base);
    for (size_t i = 0; i < c.storage_bytes; i++)
        ((unsigned char *)c.base)[i] = (unsigned char)(i * 7 + 1);
    c.mem = KV_MEM_HOST;
    return c;
}

/* A copy of c's whole storage, to compare the cache against after a
 * refusal; the caller frees it. */
static unsigned char *snapshot(const struct kv_paged_cache *c)
{
    unsigned char *p = malloc(c->storage_bytes);
    assert_non_null(p);
    memcpy(p, c->base, c->storage_bytes);
    return p;
}

static void expect_refused(kv_status got, kv_status want, const char *needle)
{
    if (got != want)
        fail_msg("status %s, expected %s: %s", kv_status_name(got), kv_status_name(want),
                 kv_last_error());
    kvt_assert_msg_has(needle);
}

static void test_attn_edges_lse_extent_does_not_wrap(void **state)
{
    (void)state;
    struct kv_paged_cache c = mk_cache(1, 4, 4, 1, 4);
    unsigned char *snap = snapshot(&c);
    float qb[8], ob[8], lse[2] = {5.0f, 5.0f};
    for (int i = 0; i < 8; i++)
        qb[i] = 0.1f * (float)(i + 1), ob[i] = 9.0f;
    const int64_t sh[3] = {2, 1, 4};
    struct kv_view q, out;
    assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, sh, &out), KV_OK);
    int32_t indptr[3] = {0, 1, 2}, ind[2] = {1, 2}, last[2] = {4, 4};
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = 2,
                                .indptr = indptr,
                                .indices = ind,
                                .last_page_len = last};
    /* row 1 of lse at the cache's first byte, modulo 2^64 */
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.lse = lse;
    o.lse_stride =
        (int64_t)(((uint64_t)1 << 62) + ((uintptr_t)c.base - (uintptr_t)lse) / sizeof(float));
    expect_refused(kv_attn_decode_ex(c, 0, &q, &pg, 1.0f, NULL, &out, &o), KV_ERR_OVERFLOW,
                   "lse of 2 rows at lse_stride");
    assert_int_equal(memcmp(snap, c.base, c.storage_bytes), 0);
    for (int i = 0; i < 8; i++)
        assert_true(ob[i] == 9.0f);
    assert_true(lse[0] == 5.0f && lse[1] == 5.0f);
    free(snap);
    free(c.base);
}

static void test_attn_edges_pages_of_2_32_tokens(void **state)
{
    (void)state;
    for (int mode = 0; mode < 2; mode++) {
        const int64_t N = ((int64_t)1 << 32) + (mode == 0 ? 1 : 0);
        struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
        cfg.num_layers = 1, cfg.num_blocks = 1, cfg.block_tokens = N, cfg.num_heads = 1;
        cfg.head_dim = 1, cfg.dtype = KV_F32;
        struct kv_paged_cache c;
        memset(&c, 0, sizeof(c));
        assert_int_equal(kv_layout_init(&cfg, &c.layout), KV_OK);
        c.storage_bytes = (size_t)c.layout.total_bytes;
        c.base = mmap(NULL, c.storage_bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (c.base == MAP_FAILED)
            skip(); /* no address space for a 16 GiB lazy mapping here */
        c.mem = KV_MEM_HOST;
        float qb[1] = {1.0f}, ob[1] = {7.0f};
        const int64_t sh[3] = {1, 1, 1};
        struct kv_view q, out;
        assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, sh, &q), KV_OK);
        assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, sh, &out), KV_OK);
        int32_t indptr[2] = {0, 1}, ind[1] = {0}, last[1] = {5};
        const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                    .n_seqs = 1,
                                    .indptr = indptr,
                                    .indices = ind,
                                    .last_page_len = last};
        char want[96];
        snprintf(want, sizeof(want), "pages of %" PRId64 " tokens", N);
        expect_refused(kv_attn_decode(c, 0, &q, &pg, 1.0f, NULL, &out), KV_ERR_INVALID_ARG, want);
        assert_true(ob[0] == 7.0f);
        munmap(c.base, c.storage_bytes);
    }
}

static void test_attn_edges_strides_of_size_one_and_empty_views(void **state)
{
    (void)state;
    struct kv_paged_cache c = mk_cache(1, 4, 4, 2, 4);
    unsigned char *snap = snapshot(&c);
    float kb[8], vb[8];
    for (int i = 0; i < 8; i++)
        kb[i] = (float)i, vb[i] = (float)(100 + i);
    /* [T = 1][2][4] with a token stride near 2^62: a valid view (its one
     * token steps nowhere); the write lands at its slot, exactly */
    const int64_t shape[3] = {1, 2, 4}, strides[3] = {INT64_MAX / 2, 4, 1};
    struct kv_view k, v;
    assert_int_equal(kv_view_from_strided(kb, sizeof(kb), KV_F32, 3, shape, strides, 0, &k), KV_OK);
    assert_int_equal(kv_view_from_strided(vb, sizeof(vb), KV_F32, 3, shape, strides, 0, &v), KV_OK);
    const int64_t slot = 13;
    assert_int_equal(kv_attn_write(c, 0, &k, &v, &slot, 1, NULL), KV_OK);
    const struct kv_layout *lo = &c.layout;
    for (int h = 0; h < 2; h++)
        for (int d = 0; d < 4; d++) {
            const float *f = c.base;
            const uint32_t b = (uint32_t)(slot / 4), t = (uint32_t)(slot % 4);
            assert_true(f[kv_layout_elem_offset(lo, 0, 0, b, t, (uint32_t)h, (uint32_t)d)] ==
                        kb[h * 4 + d]);
            assert_true(f[kv_layout_elem_offset(lo, 0, 1, b, t, (uint32_t)h, (uint32_t)d)] ==
                        vb[h * 4 + d]);
        }
    /* an empty view with an offset near 2^62: nothing to write, KV_OK, the
     * cache as it was */
    memcpy(c.base, snap, c.storage_bytes);
    const int64_t eshape[3] = {0, 2, 4}, estr[3] = {8, 4, 1};
    assert_int_equal(kv_view_from_strided(kb, sizeof(kb), KV_F32, 3, eshape, estr, 0, &k), KV_OK);
    assert_int_equal(kv_view_from_strided(vb, sizeof(vb), KV_F32, 3, eshape, estr, 0, &v), KV_OK);
    k.offset = v.offset = INT64_MAX / 2;
    assert_int_equal(kv_view_check(&k), KV_OK);
    assert_int_equal(kv_attn_write(c, 0, &k, &v, &slot, 0, NULL), KV_OK);
    assert_int_equal(memcmp(snap, c.base, c.storage_bytes), 0);
    free(snap);
    free(c.base);
}

static void test_attn_edges_outputs_over_the_scales(void **state)
{
    (void)state;
    struct kv_paged_cache c = mk_cache(1, 4, 4, 1, 4);
    float qb[8], ob[8];
    for (int i = 0; i < 8; i++)
        qb[i] = 0.1f * (float)(i + 1), ob[i] = 0.0f;
    ob[0] = 2.0f, ob[1] = 0.5f; /* the scales, inside out's row 0 */
    const int64_t sh[3] = {2, 1, 4};
    struct kv_view q, out;
    assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, sh, &out), KV_OK);
    int32_t indptr[3] = {0, 1, 2}, ind[2] = {1, 2}, last[2] = {4, 4};
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = 2,
                                .indptr = indptr,
                                .indices = ind,
                                .last_page_len = last};
    const struct kv_scales sc = {&ob[0], &ob[1], 1, 0};
    expect_refused(kv_attn_decode(c, 0, &q, &pg, 1.0f, &sc, &out), KV_ERR_OVERLAP,
                   "out (bytes");
    kvt_assert_msg_has("overlaps the K scales");
    assert_true(ob[0] == 2.0f && ob[1] == 0.5f && ob[2] == 0.0f);
    /* a read whose k_out holds the V scales */
    float kout[16] = {0}, vout[16] = {0};
    const int64_t rsh[3] = {4, 1, 4};
    struct kv_view ko, vo;
    assert_int_equal(kv_view_init(kout, sizeof(kout), KV_F32, 3, rsh, &ko), KV_OK);
    assert_int_equal(kv_view_init(vout, sizeof(vout), KV_F32, 3, rsh, &vo), KV_OK);
    kout[5] = 1.0f;
    const float one = 1.0f;
    const struct kv_scales rs = {&one, &kout[5], 1, 0};
    int32_t rptr[2] = {0, 1}, rind[1] = {3}, rlast[1] = {4};
    const struct kv_pages rpg = {.format = KV_PAGES_CSR,
                                 .n_seqs = 1,
                                 .indptr = rptr,
                                 .indices = rind,
                                 .last_page_len = rlast};
    expect_refused(kv_attn_read(c, 0, &rpg, &ko, &vo, &rs), KV_ERR_OVERLAP,
                   "k_out (bytes");
    kvt_assert_msg_has("overlaps the V scales");
    /* a write whose scales live in the cache it writes */
    float kb[4] = {1, 2, 3, 4};
    const int64_t wsh[3] = {1, 1, 4};
    struct kv_view k;
    assert_int_equal(kv_view_init(kb, sizeof(kb), KV_F32, 3, wsh, &k), KV_OK);
    float *in_cache = (float *)c.base + 3;
    *in_cache = 1.0f;
    const struct kv_scales ws = {in_cache, &one, 1, 0};
    const int64_t slot = 9;
    expect_refused(kv_attn_write(c, 0, &k, &k, &slot, 1, &ws), KV_ERR_OVERLAP,
                   "the cache storage (bytes");
    free(c.base);
}

static void test_attn_edges_copy_ids_past_2_31(void **state)
{
    (void)state;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 1, cfg.num_blocks = ((int64_t)1 << 31) + 4, cfg.block_tokens = 1;
    cfg.num_heads = 1, cfg.head_dim = 1, cfg.dtype = KV_F32;
    struct kv_paged_cache c;
    memset(&c, 0, sizeof(c));
    assert_int_equal(kv_layout_init(&cfg, &c.layout), KV_OK);
    c.storage_bytes = (size_t)c.layout.total_bytes;
    c.base = mmap(NULL, c.storage_bytes, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (c.base == MAP_FAILED)
        skip();
    c.mem = KV_MEM_HOST;
    const uint32_t hi = (1u << 31) + 1;
    float *p = c.base;
    /* K and V planes of block b at kv_layout_block_offset... written through
     * the layout formula: K of block b is element b, V is stride_kv away */
    const int64_t kv = c.layout.stride_kv_bytes / 4, bs = c.layout.stride_block_bytes / 4;
    p[(int64_t)hi * bs] = 11.0f, p[(int64_t)hi * bs + kv] = 12.0f;
    p[5 * bs] = 21.0f, p[5 * bs + kv] = 22.0f;
    /* {2^31 + 1 -> 3}, {5 -> 1}: no block read and written; was refused as
     * "block 1 is read by copy 0 and written by copy 1" */
    const struct kv_block_copy ok[2] = {{hi, 3, 0}, {5, 1, 0}};
    assert_int_equal(kv_attn_copy_blocks(c, ok, 2), KV_OK);
    assert_true(p[3 * bs] == 11.0f && p[3 * bs + kv] == 12.0f);
    assert_true(p[1 * bs] == 21.0f && p[1 * bs + kv] == 22.0f);
    /* and a real conflict past 2^31 is still named by its id */
    const struct kv_block_copy bad[2] = {{5, hi, 0}, {hi, 7, 0}};
    char want[80];
    snprintf(want, sizeof(want), "block %" PRIu32 " is", hi);
    expect_refused(kv_attn_copy_blocks(c, bad, 2), KV_ERR_OVERLAP, want);
    munmap(c.base, c.storage_bytes);
}

/* Index and scale arrays misaligned for their element (an audit,
 * 2026-12-05: Python handed such buffers through, and the checks read
 * them as int64 / int32 words, undefined behaviour in C): each entry
 * refuses them naming the array, before anything is written; the whole
 * cache and the outputs are as they were. raw is 8-byte aligned; raw + 4
 * is 4-byte aligned (not 8), raw + 2 not 4. */
static void test_attn_edges_misaligned_index_arrays(void **state)
{
    (void)state;
    struct kv_paged_cache c = mk_cache(1, 4, 4, 1, 4);
    unsigned char *before = snapshot(&c);
    uint64_t raw[16];
    unsigned char *rb = (unsigned char *)raw;
    memset(raw, 0, sizeof(raw));
    float kb[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const int64_t wsh[3] = {2, 1, 4};
    struct kv_view k;
    assert_int_equal(kv_view_init(kb, sizeof(kb), KV_F32, 3, wsh, &k), KV_OK);
    /* write: int64 slots at +4, int32 slots at +2 */
    const int64_t slots[2] = {9, 10};
    memcpy(rb + 4, slots, sizeof(slots));
    expect_refused(kv_attn_write(c, 0, &k, &k, (const int64_t *)(void *)(rb + 4), 2, NULL),
                   KV_ERR_INVALID_ARG, "kv_attn_write: slots=");
    kvt_assert_msg_has("is not 8-byte aligned");
    const int32_t slots32[2] = {9, 10};
    memcpy(rb + 2, slots32, sizeof(slots32));
    expect_refused(kv_attn_write_i32(c, 0, &k, &k, (const int32_t *)(void *)(rb + 2), 2, NULL),
                   KV_ERR_INVALID_ARG, "slots=");
    kvt_assert_msg_has("is not 4-byte aligned");
    /* scales (float) at +2 */
    const float one = 1.0f;
    memcpy(rb + 2, &one, sizeof(one));
    const struct kv_scales bad_sc = {(const float *)(void *)(rb + 2), &one, 1, 0};
    expect_refused(kv_attn_write(c, 0, &k, &k, slots, 2, &bad_sc), KV_ERR_INVALID_ARG,
                   "scales k=");
    /* decode: each CSR array, then the block table and lengths */
    float qb[4] = {0.1f, 0.2f, 0.3f, 0.4f}, ob[4] = {7, 7, 7, 7};
    const int64_t qsh[3] = {1, 1, 4};
    struct kv_view q, out;
    assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, qsh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, qsh, &out), KV_OK);
    int32_t indptr[2] = {0, 1}, ind[1] = {2}, last[1] = {3};
    memcpy(rb + 2, indptr, sizeof(indptr));
    memcpy(rb + 22, ind, sizeof(ind));
    memcpy(rb + 42, last, sizeof(last));
    const int32_t *mis[3] = {(const int32_t *)(void *)(rb + 2), (const int32_t *)(void *)(rb + 22),
                             (const int32_t *)(void *)(rb + 42)};
    static const char *const names[3] = {"indptr=", "indices=", "last_page_len="};
    for (int a = 0; a < 3; a++) {
        struct kv_pages pg = {.format = KV_PAGES_CSR,
                              .n_seqs = 1,
                              .indptr = a == 0 ? mis[0] : indptr,
                              .indices = a == 1 ? mis[1] : ind,
                              .last_page_len = a == 2 ? mis[2] : last};
        expect_refused(kv_attn_decode(c, 0, &q, &pg, 1.0f, NULL, &out), KV_ERR_INVALID_ARG,
                       names[a]);
    }
    int32_t bt[1] = {2};
    int64_t lens[1] = {3};
    memcpy(rb + 2, bt, sizeof(bt));
    memcpy(rb + 68, lens, sizeof(lens));
    struct kv_pages bpg = {.format = KV_PAGES_BLOCK_TABLE,
                           .n_seqs = 1,
                           .block_table = (const int32_t *)(void *)(rb + 2),
                           .block_table_cols = 1,
                           .seq_lens = lens};
    expect_refused(kv_attn_decode(c, 0, &q, &bpg, 1.0f, NULL, &out), KV_ERR_INVALID_ARG,
                   "block_table=");
    bpg.block_table = bt;
    bpg.seq_lens = (const int64_t *)(void *)(rb + 68);
    expect_refused(kv_attn_decode(c, 0, &q, &bpg, 1.0f, NULL, &out), KV_ERR_INVALID_ARG,
                   "seq_lens=");
    /* prefill: qo_indptr at +2 */
    const int32_t qo[2] = {0, 1};
    memcpy(rb + 2, qo, sizeof(qo));
    const struct kv_pages cpg = {.format = KV_PAGES_CSR,
                                 .n_seqs = 1,
                                 .indptr = indptr,
                                 .indices = ind,
                                 .last_page_len = last};
    const struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    expect_refused(kv_attn_prefill(c, 0, &q, (const int32_t *)(void *)(rb + 2), &cpg, 1.0f, NULL,
                                   &out, &o),
                   KV_ERR_INVALID_ARG, "qo_indptr=");
    /* block copies: the pairs (uint32 fields) at +2 */
    const struct kv_block_copy cp[1] = {{1, 3, 0}};
    memcpy(rb + 2, cp, sizeof(cp));
    expect_refused(kv_attn_copy_blocks(c, (const struct kv_block_copy *)(void *)(rb + 2), 1),
                   KV_ERR_INVALID_ARG, "copies=");
    /* nothing written anywhere; the aligned arrays pass */
    assert_memory_equal(c.base, before, c.storage_bytes);
    for (int i = 0; i < 4; i++)
        assert_true(ob[i] == 7.0f);
    assert_int_equal(kv_attn_decode(c, 0, &q, &cpg, 1.0f, NULL, &out), KV_OK);
    assert_int_equal(kv_attn_write(c, 0, &k, &k, slots, 2, NULL), KV_OK);
    free(before);
    free(c.base);
}

static void test_attn_edges_layer_named_as_passed(void **state)
{
    (void)state;
    struct kv_paged_cache c = mk_cache(2, 4, 4, 1, 4);
    float qb[4] = {1, 2, 3, 4}, ob[4] = {0};
    const int64_t sh[3] = {1, 1, 4};
    struct kv_view q, out;
    assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, sh, &out), KV_OK);
    int32_t indptr[2] = {0, 1}, ind[1] = {1}, last[1] = {4};
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = 1,
                                .indptr = indptr,
                                .indices = ind,
                                .last_page_len = last};
    expect_refused(kv_attn_decode(c, UINT32_MAX - 1, &q, &pg, 1.0f, NULL, &out),
                   KV_ERR_INVALID_ARG, "layer 4294967294 outside [0, 2)");
    free(c.base);
}

/* Audit (2026-12-05, the kernels at their edges): an empty batch (no
 * sequences; every q_len 0) divided by zero choosing its split; a soft cap
 * below 1 / FLT_MAX made 0 x inf = NaN of a zero score; a NaN in K vanished
 * on the SIMD paths (the max and exp clamps dropped it) instead of making
 * its query heads' rows NaN, as softmax of a NaN logit is (a NaN in V
 * always did). */
/* 1 layer x 4 blocks of 32 tokens, 2 KV heads of 16: f32 filled with small
 * values, another dtype with zeros (scale checks only). Free base. */
static struct kv_paged_cache small_cache(kv_dtype dt)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 1, cfg.num_blocks = 4, cfg.block_tokens = 32, cfg.num_heads = 2;
    cfg.head_dim = 16, cfg.dtype = dt;
    struct kv_paged_cache c;
    memset(&c, 0, sizeof(c));
    assert_int_equal(kv_layout_init(&cfg, &c.layout), KV_OK);
    c.storage_bytes = (size_t)c.layout.total_bytes;
    c.base = aligned_alloc(64, (c.storage_bytes + 63) / 64 * 64);
    assert_non_null(c.base);
    memset(c.base, 0, c.storage_bytes);
    float *f = c.base;
    for (size_t i = 0; dt == KV_F32 && i < c.storage_bytes / 4; i++)
        f[i] = 0.01f * (float)(i % 97) - 0.4f;
    c.mem = KV_MEM_HOST;
    return c;
}

/* One decode row over small_cache: a sequence of 7 tokens in block 2, q and
 * out [1][Hq 4][16] f32 (q zero). Its pages point into it: do not copy. */
struct one_seq {
    float qb[64], ob[64];
    struct kv_view q, out;
    int32_t indptr[2], ind[1], last[1];
    struct kv_pages pg;
};

static void one_seq_init(struct one_seq *o)
{
    memset(o, 0, sizeof(*o));
    const int64_t sh[3] = {1, 4, 16};
    assert_int_equal(kv_view_init(o->qb, sizeof(o->qb), KV_F32, 3, sh, &o->q), KV_OK);
    assert_int_equal(kv_view_init(o->ob, sizeof(o->ob), KV_F32, 3, sh, &o->out), KV_OK);
    o->indptr[1] = 1;
    o->ind[0] = 2;
    o->last[0] = 7;
    o->pg = (struct kv_pages){.format = KV_PAGES_CSR,
                              .n_seqs = 1,
                              .indptr = o->indptr,
                              .indices = o->ind,
                              .last_page_len = o->last};
}

static void test_attn_edges_empty_batch(void **state)
{
    (void)state;
    struct kv_paged_cache c = small_cache(KV_F32);
    struct one_seq r;
    one_seq_init(&r);
    const int64_t sh0[3] = {0, 4, 16}; /* no rows */
    struct kv_view q, out;
    assert_int_equal(kv_view_init(r.qb, sizeof(r.qb), KV_F32, 3, sh0, &q), KV_OK);
    assert_int_equal(kv_view_init(r.ob, sizeof(r.ob), KV_F32, 3, sh0, &out), KV_OK);
    for (int i = 0; i < 64; i++)
        r.ob[i] = 3.0f;
    struct kv_pages pg = r.pg;
    pg.n_seqs = 0;
    assert_int_equal(kv_attn_decode(c, 0, &q, &pg, 1.0f, NULL, &out), KV_OK);
    const struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    assert_int_equal(kv_attn_decode_ex(c, 0, &q, &pg, 1.0f, NULL, &out, &o), KV_OK);
    pg.n_seqs = 1; /* one sequence of 7 tokens, no query of it */
    const int32_t qo[2] = {0, 0};
    assert_int_equal(kv_attn_prefill(c, 0, &q, qo, &pg, 1.0f, NULL, &out, &o), KV_OK);
    for (int i = 0; i < 64; i++)
        assert_true(r.ob[i] == 3.0f); /* nothing written */
    free(c.base);
}

static void test_attn_edges_soft_cap_below_its_reciprocal(void **state)
{
    (void)state;
    struct kv_paged_cache c = small_cache(KV_F32);
    struct one_seq r;
    one_seq_init(&r);
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.logit_soft_cap = 1e-40f;
    for (int i = 0; i < 64; i++)
        r.ob[i] = 3.0f;
    expect_refused(kv_attn_decode_ex(c, 0, &r.q, &r.pg, 1.0f, NULL, &r.out, &o), KV_ERR_INVALID_ARG,
                   "reciprocal is finite");
    for (int i = 0; i < 64; i++)
        assert_true(r.ob[i] == 3.0f); /* nothing written */
    /* tiny, valid: q is zero, so every score is c tanh(0 / c) = 0 and the
     * output is the plain mean of the 7 V rows of its KV head */
    o.logit_soft_cap = 1e-30f;
    assert_int_equal(kv_attn_decode_ex(c, 0, &r.q, &r.pg, 1.0f, NULL, &r.out, &o), KV_OK);
    for (int h = 0; h < 4; h++)
        for (int d = 0; d < 16; d++) {
            double want = 0.0;
            for (uint32_t t = 0; t < 7; t++) {
                int64_t off = 0;
                assert_int_equal(
                    kv_layout_offset(&c.layout, 0, 1, 2, t, (uint32_t)h / 2, (uint32_t)d, &off),
                    KV_OK);
                want += ((const float *)c.base)[off] / 7.0;
            }
            const float got = r.ob[h * 16 + d];
            if (!(fabs(got - want) <= 1e-6 * (1.0 + fabs(want))))
                fail_msg("head %d d %d: %g, the mean of V is %g", h, d, (double)got, want);
        }
    free(c.base);
}

static void test_attn_edges_nan_in_k(void **state)
{
    (void)state;
    struct kv_paged_cache c = small_cache(KV_F32);
    int64_t off = 0; /* token 5 of block 2, KV head 0, dim 3 */
    assert_int_equal(kv_layout_offset(&c.layout, 0, 0, 2, 5, 0, 3, &off), KV_OK);
    ((float *)c.base)[off] = NAN;
    float qb[2 * 4 * 16], ob[2 * 4 * 16], lse[2 * 4];
    for (int i = 0; i < 2 * 4 * 16; i++)
        qb[i] = 0.05f * (float)(i % 13) - 0.3f;
    const int64_t sh[3] = {2, 4, 16};  /* 2 rows x Hq 4 (q heads 0, 1 read KV head 0) */
    const int64_t sh1[3] = {1, 4, 16}; /* decode: one row, the sequence's */
    struct kv_view q, out, q1, out1;
    assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, sh, &out), KV_OK);
    assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, sh1, &q1), KV_OK);
    assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, sh1, &out1), KV_OK);
    int32_t indptr[2] = {0, 2}, ind[2] = {2, 3}, last[1] = {8}; /* 40 tokens: 32 + 8 */
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = 1,
                                .indptr = indptr,
                                .indices = ind,
                                .last_page_len = last};
    const int32_t qo[2] = {0, 2};
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.lse = lse;
    for (int path = 0; path < 3; path++) { /* auto (AVX-512 / AVX2), AVX2 only, portable */
        kv__attn_avx2_only = path == 1;
        kv__attn_test_tune(-1, path == 2);
        for (int prefill = 0; prefill < 2; prefill++) {
            for (int i = 0; i < 2 * 4 * 16; i++)
                ob[i] = 0.0f;
            if (prefill)
                assert_int_equal(kv_attn_prefill(c, 0, &q, qo, &pg, 0.25f, NULL, &out, &o), KV_OK);
            else
                assert_int_equal(kv_attn_decode_ex(c, 0, &q1, &pg, 0.25f, NULL, &out1, &o), KV_OK);
            for (int r = 0; r < (prefill ? 2 : 1); r++)
                for (int h = 0; h < 4; h++) {
                    for (int d = 0; d < 16; d++) {
                        const float v = ob[(r * 4 + h) * 16 + d];
                        if (h < 2 ? !isnan(v) : !isfinite(v))
                            fail_msg("path %d %s row %d head %d d %d: %g (want %s)", path,
                                     prefill ? "prefill" : "decode", r, h, d, (double)v,
                                     h < 2 ? "NaN: its K holds a NaN" : "finite");
                    }
                    const float l = lse[r * 4 + h];
                    if (h < 2 ? !isnan(l) : !isfinite(l))
                        fail_msg("path %d lse row %d head %d: %g", path, r, h, (double)l);
                }
        }
    }
    kv__attn_avx2_only = false;
    kv__attn_test_tune(-1, false);
    free(c.base);
}

/* Audit (2026-12-05): an fp8 cache's K/V scale above 2^119 overflowed to
 * inf on the fp8 fast paths (2^8 folded into it) and made rows NaN: refused
 * by name; 2^100 runs. */
static void test_attn_edges_fp8_scale_limit(void **state)
{
    (void)state;
    struct kv_paged_cache c = small_cache(KV_FP8_E4M3);
    struct one_seq r;
    one_seq_init(&r);
    for (int i = 0; i < 64; i++)
        r.ob[i] = 3.0f;
    float ks[2] = {1.0f, 1e37f}, vs[2] = {1.0f, 1.0f};
    struct kv_scales sc = {ks, vs, 2, 0};
    expect_refused(kv_attn_decode(c, 0, &r.q, &r.pg, 1.0f, &sc, &r.out), KV_ERR_INVALID_ARG,
                   "K scale 1 is 1e+37");
    kvt_assert_msg_has("2^119");
    for (int i = 0; i < 64; i++)
        assert_true(r.ob[i] == 3.0f); /* nothing written */
    /* 2^100 runs: the cache is all zeros (fp8 0x00), so every output is 0 */
    ks[1] = 0x1p100f;
    assert_int_equal(kv_attn_decode(c, 0, &r.q, &r.pg, 1.0f, &sc, &r.out), KV_OK);
    for (int i = 0; i < 64; i++)
        assert_true(r.ob[i] == 0.0f);
    free(c.base);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attn_edges_empty_batch),
        cmocka_unit_test(test_attn_edges_soft_cap_below_its_reciprocal),
        cmocka_unit_test(test_attn_edges_nan_in_k),
        cmocka_unit_test(test_attn_edges_fp8_scale_limit),
        cmocka_unit_test(test_attn_edges_lse_extent_does_not_wrap),
        cmocka_unit_test(test_attn_edges_pages_of_2_32_tokens),
        cmocka_unit_test(test_attn_edges_strides_of_size_one_and_empty_views),
        cmocka_unit_test(test_attn_edges_outputs_over_the_scales),
        cmocka_unit_test(test_attn_edges_copy_ids_past_2_31),
        cmocka_unit_test(test_attn_edges_layer_named_as_passed),
        cmocka_unit_test(test_attn_edges_misaligned_index_arrays),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
