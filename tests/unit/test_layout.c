/*
 * test_layout.c - the KV cache layout descriptor (kvcache/kv_layout.h).
 *
 * The reference is a hand-written position formula (ref_offset_elems), built
 * from the picture in docs/kv-layout.md and not from the library's strides.
 * Every arrangement x order x padding x packing x element size writes a
 * pattern through the per-layer K/V views and reads it back through the raw
 * block byte runs (and the reverse), for block 1 and block B-1 (B = 1000),
 * and compares the whole arena, sentinel bytes included.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include <kvcache/kv.h>
#include "kv_layout.h"
#include "kvtest.h"

#define SENTINEL 0xA5

/* ---- reference ------------------------------------------------------------- */

/* Position of one element, by hand:
 *   planes  = packed ? 1 : 2,  row = packed ? 2D : D
 *   inblock = NHD: (n*H + h)*row + (packed ? kv*D : 0) + d
 *             HND: (h*N + n)*row + (packed ? kv*D : 0) + d
 *   storage block index = layer-major: (l*planes + plane)*B + b
 *                         block-major: (b*L + l)*planes + plane
 *   offset = storage block index * block_stride + inblock   (plane = packed ? 0 : kv)
 */
static int64_t ref_offset_elems(const struct kv_layout_config *c, int64_t bstride, int64_t l,
                                int64_t kv, int64_t b, int64_t n, int64_t h, int64_t d)
{
    int64_t planes = c->kv_packed || c->k_only ? 1 : 2;
    int64_t row = c->kv_packed ? 2 * c->head_dim : c->head_dim;
    int64_t plane = c->kv_packed ? 0 : kv;
    int64_t in =
        (c->order == KV_ORDER_NHD ? (n * c->num_heads + h) : (h * c->block_tokens + n)) * row +
        (c->kv_packed ? kv * c->head_dim : 0) + d;
    int64_t idx = c->arrange == KV_ARRANGE_LAYER_MAJOR ? (l * planes + plane) * c->num_blocks + b
                                                       : (b * c->num_layers + l) * planes + plane;
    return idx * bstride + in;
}

/* Byte position inside the concatenation of one block's runs (runs hold the
 * storage blocks of the block id in (layer, plane) order, data only). */
static int64_t ref_stream_pos(const struct kv_layout_config *c, int64_t l, int64_t kv, int64_t n,
                              int64_t h, int64_t d, int64_t es)
{
    int64_t planes = c->kv_packed || c->k_only ? 1 : 2;
    int64_t row = c->kv_packed ? 2 * c->head_dim : c->head_dim;
    int64_t nat = c->block_tokens * c->num_heads * row;
    int64_t in =
        (c->order == KV_ORDER_NHD ? (n * c->num_heads + h) : (h * c->block_tokens + n)) * row +
        (c->kv_packed ? kv * c->head_dim : 0) + d;
    int64_t unit = l * planes + (c->kv_packed ? 0 : kv);
    return (unit * nat + in) * es;
}

static uint8_t pattern(uint64_t seed, int64_t a, int64_t b, int64_t c2, int64_t d, int64_t e,
                       int64_t k)
{
    uint64_t key[7] = {seed,        (uint64_t)a, (uint64_t)b, (uint64_t)c2,
                       (uint64_t)d, (uint64_t)e, (uint64_t)k};
    return (uint8_t)XXH3_64bits(key, sizeof(key));
}

static void expect_msg(kv_status got, kv_status want, const char *needle)
{
    if (got != want)
        fail_msg("status %s, expected %s (%s)", kv_status_name(got), kv_status_name(want),
                 kv_last_error());
    if (!strstr(kv_last_error(), needle))
        fail_msg("message \"%s\" does not contain \"%s\"", kv_last_error(), needle);
}

static void assert_arena_equal(const uint8_t *got, const uint8_t *want, size_t n, const char *what)
{
    if (memcmp(got, want, n) == 0)
        return;
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("%s: arena byte %zu is 0x%02x, expected 0x%02x", what, i, got[i], want[i]);
}

/* ---- one combination ------------------------------------------------------------- */

static const kv_dtype k_dtypes[] = {KV_U8, KV_F16, KV_F32, KV_F64};

static void run_combo(kv_arrange arr, kv_order ord, int padded, int packed, kv_dtype dt)
{
    struct kv_layout_config c = {.struct_size = sizeof(struct kv_layout_config),
                                 .num_layers = 3,
                                 .num_blocks = 1000,
                                 .block_tokens = 3,
                                 .num_heads = 2,
                                 .head_dim = 4,
                                 .dtype = dt,
                                 .order = ord,
                                 .arrange = arr,
                                 .kv_packed = packed != 0};
    const int64_t es = (int64_t)kv_dtype_size(dt);
    const int64_t nat = c.block_tokens * c.num_heads * c.head_dim * (packed ? 2 : 1);
    int64_t bstride = nat;
    if (padded == 1) { /* padding in elements */
        c.block_pad_elems = 5;
        bstride = nat + 5;
    } else if (padded == 2) { /* explicit stride in bytes, 16-byte aligned */
        int64_t bytes = ((nat + 3) * es + 15) / 16 * 16;
        c.block_stride_bytes = bytes;
        c.align_bytes = 16;
        bstride = bytes / es;
    }
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    const int64_t planes = packed ? 1 : 2;
    const size_t arena_bytes = (size_t)(c.num_layers * planes * c.num_blocks * bstride * es);
    assert_int_equal(lo.total_bytes, (int64_t)arena_bytes);
    assert_int_equal(lo.block_stride_bytes, bstride * es);
    assert_int_equal(lo.block_bytes, nat * es);

    uint8_t *arena = malloc(arena_bytes), *want = malloc(arena_bytes);
    assert_non_null(arena);
    assert_non_null(want);

    struct kv_view views[3][2];
    for (uint32_t l = 0; l < 3; l++)
        for (int kv = 0; kv < 2; kv++) {
            assert_int_equal(kv_layout_kv_view(&lo, arena, arena_bytes, l, kv, &views[l][kv]),
                             KV_OK);
            assert_int_equal(kv_view_check(&views[l][kv]), KV_OK);
            bool contig =
                arr == KV_ARRANGE_LAYER_MAJOR && ord == KV_ORDER_NHD && !padded && !packed;
            assert_int_equal(kv_view_is_contiguous(&views[l][kv]), contig);
        }

    const uint32_t blocks[2] = {1, (uint32_t)c.num_blocks - 1};
    for (int bi = 0; bi < 2; bi++) {
        const int64_t b = blocks[bi];
        uint64_t seed = (uint64_t)b * 7919 + (uint64_t)dt;

        /* 1. views -> arena -> runs */
        memset(arena, SENTINEL, arena_bytes);
        memset(want, SENTINEL, arena_bytes);
        for (int64_t l = 0; l < 3; l++)
            for (int64_t kv = 0; kv < 2; kv++)
                for (int64_t n = 0; n < c.block_tokens; n++)
                    for (int64_t h = 0; h < c.num_heads; h++)
                        for (int64_t d = 0; d < c.head_dim; d++) {
                            int64_t idx[4] = {b, n, h, d};
                            uint8_t *p = kv_view_ptr(&views[l][kv], idx);
                            int64_t ref = ref_offset_elems(&c, bstride, l, kv, b, n, h, d) * es;
                            assert_ptr_equal(p, arena + ref);
                            int64_t off;
                            assert_int_equal(kv_layout_offset(&lo, (uint32_t)l, (int)kv,
                                                              (uint32_t)b, (uint32_t)n, (uint32_t)h,
                                                              (uint32_t)d, &off),
                                             KV_OK);
                            assert_int_equal(off * es, ref);
                            for (int64_t k = 0; k < es; k++) {
                                p[k] = pattern(seed, l, kv, n, h, d, k);
                                want[ref + k] = p[k];
                            }
                        }
        assert_arena_equal(arena, want, arena_bytes, "views->arena");

        struct kv_byte_runs runs;
        assert_int_equal(kv_layout_block_runs(&lo, (uint32_t)b, &runs), KV_OK);
        assert_true(runs.run_stride_bytes >= runs.run_bytes);
        const int64_t stream_bytes = 3 * planes * nat * es;
        assert_int_equal(runs.run_bytes * runs.run_count, stream_bytes);
        /* expected run geometry, by arrangement */
        if (arr == KV_ARRANGE_LAYER_MAJOR) {
            assert_int_equal(runs.run_count, 3 * planes);
            assert_int_equal(runs.run_stride_bytes, c.num_blocks * bstride * es);
        } else if (!padded) {
            assert_int_equal(runs.run_count, 1);
        } else {
            assert_int_equal(runs.run_count, 3 * planes);
            assert_int_equal(runs.run_stride_bytes, bstride * es);
        }
        uint8_t *stream = malloc((size_t)stream_bytes);
        assert_non_null(stream);
        for (int64_t i = 0; i < runs.run_count; i++)
            memcpy(stream + i * runs.run_bytes,
                   arena + runs.first_offset_bytes + i * runs.run_stride_bytes,
                   (size_t)runs.run_bytes);
        for (int64_t l = 0; l < 3; l++)
            for (int64_t kv = 0; kv < 2; kv++)
                for (int64_t n = 0; n < c.block_tokens; n++)
                    for (int64_t h = 0; h < c.num_heads; h++)
                        for (int64_t d = 0; d < c.head_dim; d++)
                            for (int64_t k = 0; k < es; k++)
                                if (stream[ref_stream_pos(&c, l, kv, n, h, d, es) + k] !=
                                    pattern(seed, l, kv, n, h, d, k))
                                    fail_msg("runs: l%lld kv%lld n%lld h%lld d%lld byte %lld",
                                             (long long)l, (long long)kv, (long long)n,
                                             (long long)h, (long long)d, (long long)k);

        /* 2. runs -> arena -> views */
        memset(arena, SENTINEL, arena_bytes);
        memset(want, SENTINEL, arena_bytes);
        for (int64_t i = 0; i < stream_bytes; i++)
            stream[i] = pattern(seed + 1, i, 0, 0, 0, 0, 0);
        for (int64_t i = 0; i < runs.run_count; i++) {
            memcpy(arena + runs.first_offset_bytes + i * runs.run_stride_bytes,
                   stream + i * runs.run_bytes, (size_t)runs.run_bytes);
        }
        for (int64_t l = 0; l < 3; l++)
            for (int64_t kv = 0; kv < 2; kv++)
                for (int64_t n = 0; n < c.block_tokens; n++)
                    for (int64_t h = 0; h < c.num_heads; h++)
                        for (int64_t d = 0; d < c.head_dim; d++) {
                            int64_t idx[4] = {b, n, h, d};
                            const uint8_t *p = kv_view_ptr(&views[l][kv], idx);
                            int64_t pos = ref_stream_pos(&c, l, kv, n, h, d, es);
                            int64_t ref = ref_offset_elems(&c, bstride, l, kv, b, n, h, d) * es;
                            for (int64_t k = 0; k < es; k++) {
                                assert_int_equal(p[k], stream[pos + k]);
                                want[ref + k] = stream[pos + k];
                            }
                        }
        /* the runs wrote exactly the block's data bytes: nothing else moved */
        assert_arena_equal(arena, want, arena_bytes, "runs->arena");
        free(stream);
    }
    free(want);
    free(arena);
}

static void test_layout_views_and_runs_every_combination(void **state)
{
    (void)state;
    int combos = 0;
    for (int arr = 0; arr < 2; arr++)
        for (int ord = 0; ord < 2; ord++)
            for (int padded = 0; padded < 3; padded++)
                for (int packed = 0; packed < 2; packed++)
                    for (size_t t = 0; t < sizeof(k_dtypes) / sizeof(k_dtypes[0]); t++) {
                        run_combo((kv_arrange)arr, (kv_order)ord, padded, packed, k_dtypes[t]);
                        combos++;
                    }
    assert_int_equal(combos, 2 * 2 * 3 * 2 * 4);
}

/* ---- strides by hand ---------------------------------------------------------- */

static void test_layout_strides_by_hand(void **state)
{
    (void)state;
    /* L=4 B=10 N=16 H=8 D=128 f16 */
    struct kv_layout_config c = {.struct_size = sizeof(struct kv_layout_config),
                                 .num_layers = 4,
                                 .num_blocks = 10,
                                 .block_tokens = 16,
                                 .num_heads = 8,
                                 .head_dim = 128,
                                 .dtype = KV_F16};
    struct kv_layout lo;
    const int64_t blk = 16 * 8 * 128;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    assert_int_equal(lo.stride_dim_elems, 1);
    assert_int_equal(lo.stride_head_elems, 128);
    assert_int_equal(lo.stride_token_elems, 8 * 128);
    assert_int_equal(lo.stride_block_elems, blk);
    assert_int_equal(lo.stride_kv_elems, 10 * blk);
    assert_int_equal(lo.stride_layer_elems, 2 * 10 * blk);
    assert_int_equal(lo.stride_layer_bytes, 2 * 10 * blk * 2);
    assert_int_equal(lo.total_bytes, 4 * 2 * 10 * blk * 2);

    c.order = KV_ORDER_HND;
    c.arrange = KV_ARRANGE_BLOCK_MAJOR;
    c.block_pad_elems = 64;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    assert_int_equal(lo.stride_token_elems, 128);
    assert_int_equal(lo.stride_head_elems, 16 * 128);
    assert_int_equal(lo.block_stride_elems, blk + 64);
    assert_int_equal(lo.stride_kv_elems, blk + 64);
    assert_int_equal(lo.stride_layer_elems, 2 * (blk + 64));
    assert_int_equal(lo.stride_block_elems, 4 * 2 * (blk + 64));
    assert_int_equal(lo.stride_block_bytes, 4 * 2 * (blk + 64) * 2);

    c.order = KV_ORDER_NHD;
    c.arrange = KV_ARRANGE_LAYER_MAJOR;
    c.block_pad_elems = 0;
    c.kv_packed = true;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    assert_int_equal(lo.kv_planes, 1);
    assert_int_equal(lo.stride_dim_elems, 1);
    assert_int_equal(lo.stride_kv_elems, 128);       /* V follows K in the row */
    assert_int_equal(lo.stride_head_elems, 2 * 128); /* row = 2D */
    assert_int_equal(lo.stride_token_elems, 8 * 256);
    assert_int_equal(lo.stride_block_elems, 2 * blk);
    assert_int_equal(lo.stride_layer_elems, 10 * 2 * blk);
    struct kv_byte_runs r;
    assert_int_equal(kv_layout_block_runs(&lo, 9, &r), KV_OK);
    assert_int_equal(r.run_count, 4);
    assert_int_equal(r.run_bytes, 2 * blk * 2);
    assert_int_equal(r.first_offset_bytes, 9 * 2 * blk * 2);
    assert_int_equal(r.run_stride_bytes, 10 * 2 * blk * 2);
    char buf[512];
    assert_true(kv_layout_describe(&lo, buf, sizeof(buf)) > 0);
    assert_non_null(strstr(buf, "packed"));
}

/* ---- > 2^31 elements per layer ------------------------------------------------- */

static void test_layout_large_offsets_64bit(void **state)
{
    (void)state;
    const int64_t B = (int64_t)1 << 20, N = 16, H = 8, D = 128, L = 4, blk = N * H * D;
    for (int arr = 0; arr < 2; arr++) {
        struct kv_layout_config c = {.struct_size = sizeof(struct kv_layout_config),
                                     .num_layers = L,
                                     .num_blocks = B,
                                     .block_tokens = N,
                                     .num_heads = H,
                                     .head_dim = D,
                                     .dtype = KV_BF16,
                                     .arrange = (kv_arrange)arr};
        struct kv_layout lo;
        assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
        assert_true(B * blk > ((int64_t)1 << 31)); /* elements per layer and plane */
        assert_int_equal(lo.total_bytes, L * 2 * B * blk * 2);
        int64_t off;
        assert_int_equal(kv_layout_offset(&lo, 3, 1, (uint32_t)(B - 1), 15, 7, 127, &off), KV_OK);
        int64_t in = (15 * H + 7) * D + 127;
        int64_t want = arr == 0 ? ((3 * 2 + 1) * B + (B - 1)) * blk + in
                                : ((B - 1) * L * 2 + 3 * 2 + 1) * blk + in;
        assert_int_equal(off, want);
        assert_int_equal(off, lo.total_elems - 1); /* the very last element either way */

        /* a view over storage never allocated: metadata only */
        struct kv_view v;
        void *fake_base = (void *)(uintptr_t)4096;
        assert_int_equal(kv_layout_kv_view(&lo, fake_base, (size_t)lo.total_bytes, 3, 1, &v),
                         KV_OK);
        assert_int_equal(kv_view_check(&v), KV_OK);
        int64_t idx[4] = {B - 1, 15, 7, 127}, voff;
        assert_int_equal(kv_view_offset_of(&v, idx, &voff), KV_OK);
        assert_int_equal(voff, want);

        struct kv_byte_runs r;
        assert_int_equal(kv_layout_block_runs(&lo, (uint32_t)(B - 1), &r), KV_OK);
        if (arr == 0) {
            assert_int_equal(r.first_offset_bytes, (B - 1) * blk * 2);
            assert_int_equal(r.run_count, 2 * L);
            assert_int_equal(r.run_stride_bytes, B * blk * 2);
        } else {
            assert_int_equal(r.first_offset_bytes, (B - 1) * L * 2 * blk * 2);
            assert_int_equal(r.run_count, 1);
            assert_int_equal(r.run_bytes, L * 2 * blk * 2);
        }
        assert_int_equal(r.first_offset_bytes + (r.run_count - 1) * r.run_stride_bytes +
                             r.run_bytes,
                         lo.total_bytes); /* block B-1 ends the arena either way */
    }
}

/* ---- fingerprint -------------------------------------------------------------- */

static const struct kv_layout_config k_base = {.struct_size = sizeof(struct kv_layout_config),
                                               .num_layers = 2,
                                               .num_blocks = 64,
                                               .block_tokens = 16,
                                               .num_heads = 4,
                                               .head_dim = 64,
                                               .dtype = KV_F16};

static uint64_t fp_of(const struct kv_layout_config *c)
{
    struct kv_layout lo;
    kv_status st = kv_layout_init(c, &lo);
    if (st != KV_OK)
        fail_msg("init: %s", kv_last_error());
    return lo.fingerprint;
}

/* The fingerprints are a wire contract (peers compare them across builds and
 * versions): three layouts pinned to their values, and the full fingerprint
 * recomputed here from docs/kv-layout.md's serialization with strides derived
 * by hand, not from the library's struct. */
struct pinned_fp {
    const char *what;
    struct kv_layout_config cfg;
    uint64_t fingerprint, block_format;
    /* expected byte strides: layer, kv, block, token, head, dim; total */
    int64_t strides[6], block_stride, total;
};

static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void test_layout_fingerprints_pinned(void **state)
{
    (void)state;
    const int64_t B = 1024, L = 32, N = 16, H = 8, D = 128;
    const int64_t blk = N * H * D * 2; /* bf16 / f16 block bytes: 32 KiB */
    const int64_t pblk = (N * H * D + 64) * 2;
    struct pinned_fp pins[3] = {
        {"32x1024 NHD layer-major bf16",
         {.struct_size = sizeof(struct kv_layout_config),
          .num_layers = L,
          .num_blocks = B,
          .block_tokens = N,
          .num_heads = H,
          .head_dim = D,
          .dtype = KV_BF16},
         0x4bed694c033fffa4ull,
         0xcca09c41333f03b3ull,
         {2 * B * blk, B * blk, blk, H * D * 2, D * 2, 2},
         blk,
         L * 2 * B * blk},
        {"32x1024 HND block-major f16 pad 64",
         {.struct_size = sizeof(struct kv_layout_config),
          .num_layers = L,
          .num_blocks = B,
          .block_tokens = N,
          .num_heads = H,
          .head_dim = D,
          .dtype = KV_F16,
          .order = KV_ORDER_HND,
          .arrange = KV_ARRANGE_BLOCK_MAJOR,
          .block_pad_elems = 64},
         0xdf84ccbdb11e93b8ull,
         0x5c663522f9da1309ull,
         {2 * pblk, pblk, L * 2 * pblk, D * 2, N * D * 2, 2},
         pblk,
         B * L * 2 * pblk},
        {"2x10000 NHD packed fp8 stride 36864 align 4096",
         {.struct_size = sizeof(struct kv_layout_config),
          .num_layers = 2,
          .num_blocks = 10000,
          .block_tokens = N,
          .num_heads = H,
          .head_dim = D,
          .dtype = KV_FP8_E4M3,
          .kv_packed = true,
          .align_bytes = 4096,
          .block_stride_bytes = 36864},
         0xe04602f8c9a21098ull,
         0xef4411b9a458287dull,
         {10000 * 36864, D, 36864, H * 2 * D, 2 * D, 1},
         36864,
         2 * 10000 * 36864},
    };
    for (int i = 0; i < 3; i++) {
        struct kv_layout lo;
        const struct pinned_fp *pf = &pins[i];
        assert_int_equal(kv_layout_init(&pf->cfg, &lo), KV_OK);
        if (lo.fingerprint != pf->fingerprint || lo.block_format_fingerprint != pf->block_format)
            fail_msg("%s: fingerprints 0x%016llx / 0x%016llx, pinned 0x%016llx / 0x%016llx: the "
                     "wire contract changed",
                     pf->what, (unsigned long long)lo.fingerprint,
                     (unsigned long long)lo.block_format_fingerprint,
                     (unsigned long long)pf->fingerprint, (unsigned long long)pf->block_format);
        /* the documented serialization, built here: tag, 18 u64 LE, dtype name */
        const struct kv_layout_config *c = &pf->cfg;
        const int64_t es = (int64_t)kv_dtype_size(c->dtype);
        const int64_t align = c->align_bytes ? c->align_bytes : es;
        const int64_t f[18] = {c->num_layers,  c->num_blocks,    c->block_tokens,
                               c->num_heads,   c->head_dim,      es,
                               c->order,       c->arrange,       c->kv_packed,
                               align,          pf->block_stride, pf->strides[0],
                               pf->strides[1], pf->strides[2],   pf->strides[3],
                               pf->strides[4], pf->strides[5],   pf->total};
        unsigned char buf[8 + 18 * 8 + 16] = {'k', 'v', 'l', 'a', 'y', 'o', 'u', '1'};
        for (int k = 0; k < 18; k++)
            put64(buf + 8 + 8 * k, (uint64_t)f[k]);
        snprintf((char *)buf + 8 + 18 * 8, 16, "%s", kv_dtype_name(c->dtype));
        if (XXH3_64bits(buf, sizeof(buf)) != lo.fingerprint)
            fail_msg("%s: fingerprint 0x%016llx is not XXH3-64 of the documented serialization "
                     "(0x%016llx)",
                     pf->what, (unsigned long long)lo.fingerprint,
                     (unsigned long long)XXH3_64bits(buf, sizeof(buf)));
        /* and the block-format one: tag, L N H D es order packed, dtype name */
        const int64_t g[7] = {c->num_layers, c->block_tokens, c->num_heads, c->head_dim, es,
                              c->order,      c->kv_packed};
        unsigned char gb[8 + 7 * 8 + 16] = {'k', 'v', 'b', 'l', 'o', 'c', 'k', '1'};
        for (int k = 0; k < 7; k++)
            put64(gb + 8 + 8 * k, (uint64_t)g[k]);
        snprintf((char *)gb + 8 + 7 * 8, 16, "%s", kv_dtype_name(c->dtype));
        assert_true(XXH3_64bits(gb, sizeof(gb)) == lo.block_format_fingerprint);
    }
}

static void test_layout_fingerprint_stable_and_sensitive(void **state)
{
    (void)state;
    uint64_t base = fp_of(&k_base);
    struct kv_layout_config again = k_base;
    assert_true(fp_of(&again) == base);

    struct kv_layout_config v[13];
    for (int i = 0; i < 13; i++)
        v[i] = k_base;
    v[0].num_layers = 3;
    v[1].num_blocks = 65;
    v[2].block_tokens = 32;
    v[3].num_heads = 8;
    v[4].head_dim = 128;
    v[5].dtype = KV_BF16; /* same size, different type */
    v[6].order = KV_ORDER_HND;
    v[7].arrange = KV_ARRANGE_BLOCK_MAJOR;
    v[8].kv_packed = true;
    v[9].block_pad_elems = 8;
    v[10].block_stride_bytes = 16 * 4 * 64 * 2 + 64;
    v[11].align_bytes = 64;
    v[12].dtype = KV_F32;
    uint64_t fps[14];
    fps[13] = base;
    for (int i = 0; i < 13; i++)
        fps[i] = fp_of(&v[i]);
    for (int i = 0; i < 14; i++)
        for (int j = i + 1; j < 14; j++)
            if (fps[i] == fps[j])
                fail_msg("variants %d and %d share fingerprint 0x%llx", i, j,
                         (unsigned long long)fps[i]);

    /* a canonical serialization, not the raw struct bytes */
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&k_base, &lo), KV_OK);
    struct kv_layout raw = lo;
    raw.fingerprint = 0;
    assert_true(XXH3_64bits(&raw, sizeof(raw)) != lo.fingerprint);
    assert_true(XXH3_64bits(&lo, sizeof(lo)) != lo.fingerprint);
}

/* ---- refusals ------------------------------------------------------------------ */

struct refusal {
    const char *what;
    struct kv_layout_config cfg;
    kv_status status;
    const char *needle;
};

/* The block-format fingerprint ignores placement (B, padding, arrangement)
 * and catches every change of what a block holds. */
static void test_layout_block_format_fingerprint(void **state)
{
    struct kv_layout_config base = {.struct_size = sizeof(struct kv_layout_config),
                                    .num_layers = 4,
                                    .num_blocks = 100,
                                    .block_tokens = 16,
                                    .num_heads = 8,
                                    .head_dim = 128,
                                    .dtype = KV_BF16};
    struct kv_layout a, b;
    struct kv_layout_config c;
    (void)state;
    assert_int_equal(kv_layout_init(&base, &a), KV_OK);
    c = base;
    c.num_blocks = 5000;
    c.block_pad_elems = 64;
    c.arrange = KV_ARRANGE_BLOCK_MAJOR;
    assert_int_equal(kv_layout_init(&c, &b), KV_OK);
    assert_true(a.block_format_fingerprint == b.block_format_fingerprint);
    assert_true(a.fingerprint != b.fingerprint);
    for (int i = 0; i < 6; i++) {
        c = base;
        switch (i) {
        case 0:
            c.num_layers = 5;
            break;
        case 1:
            c.block_tokens = 32;
            break;
        case 2:
            c.num_heads = 4;
            break;
        case 3:
            c.dtype = KV_F16;
            break;
        case 4:
            c.order = KV_ORDER_HND;
            break;
        default:
            c.kv_packed = true;
            break;
        }
        assert_int_equal(kv_layout_init(&c, &b), KV_OK);
        if (a.block_format_fingerprint == b.block_format_fingerprint)
            fail_msg("block format fingerprint blind to variant %d", i);
    }
}

static void test_layout_refuses_bad_configs(void **state)
{
    (void)state;
    const int64_t nat_bytes = 16 * 4 * 64 * 2;
    struct refusal cases[] = {
        {"zero heads", k_base, KV_ERR_BAD_SHAPE, "num_heads = 0"},
        {"negative head_dim", k_base, KV_ERR_BAD_SHAPE, "head_dim = -3"},
        {"zero layers", k_base, KV_ERR_BAD_SHAPE, "num_layers = 0"},
        {"zero tokens", k_base, KV_ERR_BAD_SHAPE, "block_tokens = 0"},
        {"negative blocks", k_base, KV_ERR_BAD_SHAPE, "num_blocks = -5"},
        {"blocks > 2^32", k_base, KV_ERR_BAD_SHAPE, "8589934592"},
        {"block product overflow", k_base, KV_ERR_OVERFLOW, "1099511627776"},
        {"total overflow", k_base, KV_ERR_OVERFLOW, "4294967296"},
        {"overlapping stride", k_base, KV_ERR_OVERLAP, "8000"},
        {"stride not element multiple", k_base, KV_ERR_INVALID_ARG, "8193"},
        {"stride not aligned", k_base, KV_ERR_INVALID_ARG, "align_bytes 256"},
        {"align not power of two", k_base, KV_ERR_INVALID_ARG, "align_bytes = 24"},
        {"negative pad", k_base, KV_ERR_BAD_SHAPE, "block_pad_elems = -7"},
        {"pad and stride", k_base, KV_ERR_INVALID_ARG, "both set"},
        {"unknown dtype", k_base, KV_ERR_INVALID_ARG, "unknown dtype 99"},
        {"unknown order", k_base, KV_ERR_INVALID_ARG, "unknown order 7"},
        {"unknown arrangement", k_base, KV_ERR_INVALID_ARG, "unknown arrangement 5"},
        {"negative stride", k_base, KV_ERR_BAD_SHAPE, "block_stride_bytes = -2"},
    };
    cases[0].cfg.num_heads = 0;
    cases[1].cfg.head_dim = -3;
    cases[2].cfg.num_layers = 0;
    cases[3].cfg.block_tokens = 0;
    cases[4].cfg.num_blocks = -5;
    cases[5].cfg.num_blocks = (int64_t)1 << 33;
    cases[6].cfg.block_tokens = (int64_t)1 << 40;
    cases[6].cfg.num_heads = (int64_t)1 << 30;
    cases[7].cfg.num_blocks = (int64_t)1 << 32;
    cases[7].cfg.block_tokens = (int64_t)1 << 20;
    cases[7].cfg.num_heads = (int64_t)1 << 20;
    cases[7].cfg.head_dim = 1;
    cases[8].cfg.block_stride_bytes = 8000; /* natural is 8192 */
    cases[9].cfg.block_stride_bytes = nat_bytes + 1;
    cases[10].cfg.block_stride_bytes = nat_bytes + 128;
    cases[10].cfg.align_bytes = 256;
    cases[11].cfg.align_bytes = 24;
    cases[12].cfg.block_pad_elems = -7;
    cases[13].cfg.block_pad_elems = 8;
    cases[13].cfg.block_stride_bytes = nat_bytes + 16;
    cases[14].cfg.dtype = (kv_dtype)99;
    cases[15].cfg.order = (kv_order)7;
    cases[16].cfg.arrange = (kv_arrange)5;
    cases[17].cfg.block_stride_bytes = -2;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kv_layout lo;
        memset(&lo, 0x5A, sizeof(lo));
        struct kv_layout before = lo;
        kv_status st = kv_layout_init(&cases[i].cfg, &lo);
        if (st != cases[i].status || !strstr(kv_last_error(), cases[i].needle))
            fail_msg("%s: got %s \"%s\", expected %s containing \"%s\"", cases[i].what,
                     kv_status_name(st), kv_last_error(), kv_status_name(cases[i].status),
                     cases[i].needle);
        assert_string_equal(kvt_layout_diff(&lo, &before), ""); /* out untouched */
    }
    struct kv_layout lo;
    expect_msg(kv_layout_init(NULL, &lo), KV_ERR_NULL, "cfg");
    expect_msg(kv_layout_init(&k_base, NULL), KV_ERR_NULL, "out");

    /* an aligned, padded stride is accepted and not overlapped */
    struct kv_layout_config ok = k_base;
    ok.block_stride_bytes = nat_bytes + 256;
    ok.align_bytes = 256;
    assert_int_equal(kv_layout_init(&ok, &lo), KV_OK);
    assert_int_equal(lo.block_stride_bytes, nat_bytes + 256);
}

static void test_layout_refuses_bad_queries(void **state)
{
    (void)state;
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&k_base, &lo), KV_OK);
    static uint8_t small[64];
    uint8_t *arena = malloc((size_t)lo.total_bytes);
    assert_non_null(arena);
    struct kv_view v, before;
    memset(&v, 0x33, sizeof(v));
    before = v;
    expect_msg(kv_layout_kv_view(&lo, arena, (size_t)lo.total_bytes, 2, 0, &v),
               KV_ERR_OUT_OF_BOUNDS, "layer 2 >= num_layers 2");
    expect_msg(kv_layout_kv_view(&lo, arena, (size_t)lo.total_bytes, 0, 2, &v), KV_ERR_INVALID_ARG,
               "kv = 2");
    expect_msg(kv_layout_kv_view(&lo, small, sizeof(small), 0, 0, &v), KV_ERR_OUT_OF_BOUNDS,
               "storage of 64 bytes");
    expect_msg(kv_layout_kv_view(&lo, NULL, (size_t)lo.total_bytes, 0, 0, &v), KV_ERR_NULL, "base");
    expect_msg(kv_layout_kv_view(NULL, arena, (size_t)lo.total_bytes, 0, 0, &v), KV_ERR_NULL,
               "layout");
    assert_string_equal(kvt_view_diff(&v, &before), "");

    int64_t off = -1;
    expect_msg(kv_layout_offset(&lo, 0, 0, 64, 0, 0, 0, &off), KV_ERR_OUT_OF_BOUNDS,
               "block 64 >= 64");
    expect_msg(kv_layout_offset(&lo, 0, 0, 0, 16, 0, 0, &off), KV_ERR_OUT_OF_BOUNDS,
               "token 16 >= 16");
    expect_msg(kv_layout_offset(&lo, 0, 0, 0, 0, 4, 0, &off), KV_ERR_OUT_OF_BOUNDS, "head 4 >= 4");
    expect_msg(kv_layout_offset(&lo, 0, 0, 0, 0, 0, 64, &off), KV_ERR_OUT_OF_BOUNDS, "d 64 >= 64");
    expect_msg(kv_layout_offset(&lo, 7, 0, 0, 0, 0, 0, &off), KV_ERR_OUT_OF_BOUNDS, "layer 7 >= 2");
    expect_msg(kv_layout_offset(&lo, 0, -1, 0, 0, 0, 0, &off), KV_ERR_INVALID_ARG, "kv = -1");
    assert_int_equal(off, -1);

    struct kv_byte_runs r;
    expect_msg(kv_layout_block_runs(&lo, 64, &r), KV_ERR_OUT_OF_BOUNDS,
               "block 64 >= num_blocks 64");
    expect_msg(kv_layout_block_runs(&lo, 0, NULL), KV_ERR_NULL, "out");
    free(arena);
}

/* ---- back to a config, and the config on the wire ------------------------------ */

static const kv_dtype k_all_dtypes[] = {KV_F32, KV_F16, KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2,
                                        KV_I8,  KV_I32, KV_I64,  KV_U8,       KV_F64};

/* A random config kv_layout_init accepts, over every option: dims from 1 to
 * large (B up to 2^32, never allocated), every dtype, order, arrangement,
 * packing, no padding / pad elements / an explicit stride, default or
 * explicit alignment. */
static void random_config(uint64_t *rng, struct kv_layout_config *c)
{
    for (;;) {
        kv_layout_config_init(c);
        const int big = kvt_range(rng, 0, 9) == 0;
        c->num_layers = kvt_range(rng, 1, big ? 4096 : 80);
        c->num_blocks = big ? ((int64_t)1 << 32) - kvt_range(rng, 0, 3) : kvt_range(rng, 1, 70000);
        c->block_tokens = kvt_range(rng, 1, big ? 4 : 64);
        c->num_heads = kvt_range(rng, 1, big ? 2 : 32);
        c->head_dim = kvt_range(rng, 1, big ? 8 : 256);
        c->dtype = k_all_dtypes[kvt_range(rng, 0, 9)];
        c->order = kvt_range(rng, 0, 1) ? KV_ORDER_HND : KV_ORDER_NHD;
        c->arrange = kvt_range(rng, 0, 1) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
        c->kv_packed = kvt_range(rng, 0, 1) != 0;
        c->k_only = !c->kv_packed && kvt_range(rng, 0, 2) == 0;
        const int64_t es = (int64_t)kv_dtype_size(c->dtype);
        const int64_t align = kvt_range(rng, 0, 2) == 0 ? 0 : (int64_t)1 << kvt_range(rng, 0, 12);
        c->align_bytes = align != 0 && align < es ? 0 : align;
        const int64_t nat = c->block_tokens * c->num_heads * c->head_dim * (c->kv_packed ? 2 : 1);
        const int64_t a = c->align_bytes ? c->align_bytes : es;
        switch (kvt_range(rng, 0, 2)) {
        case 1: /* pad elements up to the next alignment, plus whole alignments */
            c->block_pad_elems = ((nat * es + a - 1) / a * a + a * kvt_range(rng, 0, 3)) / es - nat;
            break;
        case 2: /* an explicit stride: the natural size rounded up, plus some */
            c->block_stride_bytes = (nat * es + a - 1) / a * a + a * kvt_range(rng, 0, 3);
            break;
        default:
            break;
        }
        struct kv_layout lo;
        if (kv_layout_init(c, &lo) == KV_OK)
            return;
    }
}

/* Every field of two layouts, one by one (never memcmp: padding bytes). */
static void assert_layout_fields_equal(const struct kv_layout *a, const struct kv_layout *b,
                                       const char *what)
{
#define SAME(f)                                                                                    \
    do {                                                                                           \
        if ((int64_t)a->f != (int64_t)b->f)                                                        \
            fail_msg("%s: field " #f " %lld != %lld", what, (long long)a->f, (long long)b->f);     \
    } while (0)
    SAME(num_layers);
    SAME(num_blocks);
    SAME(block_tokens);
    SAME(num_heads);
    SAME(head_dim);
    SAME(dtype);
    SAME(order);
    SAME(arrange);
    SAME(kv_packed);
    SAME(k_only);
    SAME(elem_bytes);
    SAME(align_bytes);
    SAME(kv_planes);
    SAME(block_elems);
    SAME(block_bytes);
    SAME(block_stride_elems);
    SAME(block_stride_bytes);
    SAME(stride_layer_elems);
    SAME(stride_kv_elems);
    SAME(stride_block_elems);
    SAME(stride_token_elems);
    SAME(stride_head_elems);
    SAME(stride_dim_elems);
    SAME(stride_layer_bytes);
    SAME(stride_kv_bytes);
    SAME(stride_block_bytes);
    SAME(stride_token_bytes);
    SAME(stride_head_bytes);
    SAME(stride_dim_bytes);
    SAME(total_elems);
    SAME(total_bytes);
#undef SAME
    if (a->fingerprint != b->fingerprint ||
        a->block_format_fingerprint != b->block_format_fingerprint)
        fail_msg("%s: fingerprints differ", what);
}

static void assert_config_fields_equal(const struct kv_layout_config *a,
                                       const struct kv_layout_config *b, const char *what)
{
#define SAME(f)                                                                                    \
    do {                                                                                           \
        if ((int64_t)a->f != (int64_t)b->f)                                                        \
            fail_msg("%s: config field " #f " %lld != %lld", what, (long long)a->f,                \
                     (long long)b->f);                                                             \
    } while (0)
    SAME(struct_size);
    SAME(num_layers);
    SAME(num_blocks);
    SAME(block_tokens);
    SAME(num_heads);
    SAME(head_dim);
    SAME(dtype);
    SAME(order);
    SAME(arrange);
    SAME(kv_packed);
    SAME(k_only);
    SAME(block_pad_elems);
    SAME(block_stride_bytes);
    SAME(align_bytes);
#undef SAME
}

static void test_layout_config_from_rebuilds_exactly(void **state)
{
    (void)state;
    uint64_t rng = 0x1a7c0f;
    for (int i = 0; i < 4000; i++) {
        struct kv_layout_config c, back, again_cfg;
        random_config(&rng, &c);
        struct kv_layout lo, again, third;
        assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
        memset(&back, 0x77, sizeof(back));
        if (kv_layout_config_from(&lo, &back) != KV_OK)
            fail_msg("case %d: config_from refused: %s", i, kv_last_error());
        assert_int_equal(back.struct_size, sizeof(back));
        assert_int_equal(back.block_pad_elems, 0);
        assert_true(back.align_bytes == lo.align_bytes);
        assert_int_equal(kv_layout_init(&back, &again), KV_OK);
        char what[64];
        snprintf(what, sizeof(what), "case %d", i);
        assert_layout_fields_equal(&lo, &again, what);
        /* and from the rebuilt layout: the same config again */
        assert_int_equal(kv_layout_config_from(&again, &again_cfg), KV_OK);
        assert_config_fields_equal(&back, &again_cfg, what);
        assert_int_equal(kv_layout_init(&again_cfg, &third), KV_OK);
        assert_layout_fields_equal(&lo, &third, what);
    }
}

static void test_layout_config_from_refuses_hand_built(void **state)
{
    (void)state;
    struct kv_layout_config c = k_base;
    c.block_pad_elems = 8;
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    struct kv_layout_config out, before;
    memset(&out, 0x3C, sizeof(out));
    before = out;
    /* a derived field off by one: refused naming it */
    static const struct {
        const char *name;
        size_t off;
    } derived[] = {
        {"block_bytes", offsetof(struct kv_layout, block_bytes)},
        {"block_stride_elems", offsetof(struct kv_layout, block_stride_elems)},
        {"stride_layer_elems", offsetof(struct kv_layout, stride_layer_elems)},
        {"stride_kv_elems", offsetof(struct kv_layout, stride_kv_elems)},
        {"stride_block_elems", offsetof(struct kv_layout, stride_block_elems)},
        {"stride_token_elems", offsetof(struct kv_layout, stride_token_elems)},
        {"stride_head_elems", offsetof(struct kv_layout, stride_head_elems)},
        {"stride_dim_elems", offsetof(struct kv_layout, stride_dim_elems)},
        {"stride_token_bytes", offsetof(struct kv_layout, stride_token_bytes)},
        {"stride_dim_bytes", offsetof(struct kv_layout, stride_dim_bytes)},
        {"total_elems", offsetof(struct kv_layout, total_elems)},
        {"total_bytes", offsetof(struct kv_layout, total_bytes)},
        {"kv_planes", offsetof(struct kv_layout, kv_planes)},
    };
    for (size_t i = 0; i < sizeof(derived) / sizeof(derived[0]); i++) {
        struct kv_layout h = lo;
        int64_t v;
        memcpy(&v, (unsigned char *)&h + derived[i].off, sizeof(v));
        v += 1;
        memcpy((unsigned char *)&h + derived[i].off, &v, sizeof(v));
        expect_msg(kv_layout_config_from(&h, &out), KV_ERR_INVALID_ARG, derived[i].name);
    }
    struct kv_layout h = lo;
    h.fingerprint ^= 1;
    expect_msg(kv_layout_config_from(&h, &out), KV_ERR_INVALID_ARG, "fingerprint");
    h = lo;
    h.block_format_fingerprint ^= 1;
    expect_msg(kv_layout_config_from(&h, &out), KV_ERR_INVALID_ARG, "block_format_fingerprint");
    h = lo;
    h.dtype = (kv_dtype)99;
    expect_msg(kv_layout_config_from(&h, &out), KV_ERR_INVALID_ARG, "unknown dtype 99");
    h = lo;
    h.num_heads = 0;
    expect_msg(kv_layout_config_from(&h, &out), KV_ERR_INVALID_ARG, "num_heads = 0");
    assert_string_equal(kvt_layout_config_diff(&out, &before), ""); /* untouched by every refusal */
    expect_msg(kv_layout_config_from(NULL, &out), KV_ERR_NULL, "layout");
    expect_msg(kv_layout_config_from(&lo, NULL), KV_ERR_NULL, "out");
}

static size_t encode_ok(const struct kv_layout_config *c, unsigned char *buf)
{
    size_t len = 0;
    if (kv_layout_config_encode(c, buf, KV_LAYOUT_CONFIG_WIRE_BYTES, &len) != KV_OK)
        fail_msg("encode refused: %s", kv_last_error());
    assert_int_equal(len, KV_LAYOUT_CONFIG_WIRE_BYTES);
    return len;
}

/* The checksum recomputed after an edit, so the checks behind it are reached. */
static void reseal(unsigned char *b)
{
    put64(b + 120, XXH3_64bits(b, 120));
}

static void test_layout_codec_round_trip(void **state)
{
    (void)state;
    uint64_t rng = 0xc0dec;
    for (int i = 0; i < 4000; i++) {
        struct kv_layout_config c, d;
        random_config(&rng, &c);
        unsigned char b[KV_LAYOUT_CONFIG_WIRE_BYTES + 8], b2[KV_LAYOUT_CONFIG_WIRE_BYTES];
        memset(b, 0xEE, sizeof(b));
        const size_t len = encode_ok(&c, b);
        assert_int_equal(b[len], 0xEE); /* nothing written past the encoding */
        if (kv_layout_config_decode(b, len, &d) != KV_OK)
            fail_msg("case %d: decode refused its own encoding: %s", i, kv_last_error());
        char what[64];
        snprintf(what, sizeof(what), "case %d", i);
        assert_config_fields_equal(&c, &d, what);
        struct kv_layout lc, ld;
        assert_int_equal(kv_layout_init(&c, &lc), KV_OK);
        assert_int_equal(kv_layout_init(&d, &ld), KV_OK);
        assert_layout_fields_equal(&lc, &ld, what);
        /* canonical: the decoded config encodes to the same bytes */
        encode_ok(&d, b2);
        assert_memory_equal(b, b2, len);
        /* and a layout's config_from travels the same way */
        struct kv_layout_config from, from_d;
        assert_int_equal(kv_layout_config_from(&lc, &from), KV_OK);
        encode_ok(&from, b2);
        assert_int_equal(kv_layout_config_decode(b2, len, &from_d), KV_OK);
        assert_int_equal(kv_layout_init(&from_d, &ld), KV_OK);
        assert_layout_fields_equal(&lc, &ld, what);
    }
}

/* The documented table, byte by byte, built here from the offsets. */
static void test_layout_codec_bytes_as_documented(void **state)
{
    (void)state;
    struct kv_layout_config c = k_base;
    c.dtype = KV_BF16;
    c.order = KV_ORDER_HND;
    c.arrange = KV_ARRANGE_BLOCK_MAJOR;
    c.kv_packed = true;
    c.block_stride_bytes = 16 * 4 * 128 * 2 + 256;
    c.align_bytes = 256;
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    unsigned char want[128] = {'K', 'V', 'L', 'A', 'Y', 'C', 'F', 'G', 1, 0, 0, 0, 128, 0, 0, 0};
    const int64_t f[8] = {c.num_layers, c.num_blocks,      c.block_tokens,       c.num_heads,
                          c.head_dim,   c.block_pad_elems, c.block_stride_bytes, c.align_bytes};
    for (int k = 0; k < 8; k++)
        put64(want + 16 + 8 * k, (uint64_t)f[k]);
    want[80] = 1; /* HND */
    want[84] = 1; /* block-major */
    want[88] = 1; /* packed */
    memcpy(want + 96, "bf16", 4);
    put64(want + 112, lo.fingerprint);
    put64(want + 120, XXH3_64bits(want, 120));
    unsigned char got[128];
    encode_ok(&c, got);
    for (int i = 0; i < 128; i++)
        if (got[i] != want[i])
            fail_msg("byte %d is 0x%02x, docs/kv-layout.md says 0x%02x", i, got[i], want[i]);
}

/* Every single-byte change of a valid encoding is refused: the version bytes
 * as another version (KV_ERR_MISMATCH), every other byte as corrupt (the
 * magic, the length, or the checksum that covers every field). With the
 * checksum resealed, the field checks and the fingerprint behind it still
 * refuse every change that alters the layout; what they let through decodes
 * to a config building the very same layout (an align_bytes of 0 and the
 * element size, say). */
static void test_layout_codec_every_byte_corruption_refused(void **state)
{
    (void)state;
    uint64_t rng = 0xbadb17e;
    int let_through = 0, resealed_refused = 0;
    for (int e = 0; e < 6; e++) {
        struct kv_layout_config c;
        random_config(&rng, &c);
        struct kv_layout lo;
        assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
        unsigned char b[KV_LAYOUT_CONFIG_WIRE_BYTES];
        const size_t len = encode_ok(&c, b);
        for (size_t i = 0; i < len; i++)
            for (int x = 1; x < 256; x++) {
                unsigned char m[KV_LAYOUT_CONFIG_WIRE_BYTES];
                memcpy(m, b, len);
                m[i] ^= (unsigned char)x;
                struct kv_layout_config out, before;
                memset(&out, 0x5A, sizeof(out));
                before = out;
                const kv_status st = kv_layout_config_decode(m, len, &out);
                const kv_status want = (i == 8 || i == 9) ? KV_ERR_MISMATCH : KV_ERR_CORRUPT;
                if (st != want)
                    fail_msg("encoding %d, byte %zu ^ 0x%02x: %s (%s), expected %s", e, i, x,
                             kv_status_name(st), kv_last_error(), kv_status_name(want));
                assert_true(kv_last_error()[0] != '\0');
                assert_string_equal(kvt_layout_config_diff(&out, &before), "");
                if (i >= 120)
                    continue; /* resealing a changed checksum restores it */
                reseal(m);
                const kv_status rs = kv_layout_config_decode(m, len, &out);
                if (rs == KV_OK) {
                    struct kv_layout lo2;
                    assert_int_equal(kv_layout_init(&out, &lo2), KV_OK);
                    assert_layout_fields_equal(&lo, &lo2, "a resealed change let through");
                    let_through++;
                } else {
                    if (rs != KV_ERR_CORRUPT && rs != KV_ERR_MISMATCH)
                        fail_msg("encoding %d, byte %zu ^ 0x%02x resealed: %s (%s)", e, i, x,
                                 kv_status_name(rs), kv_last_error());
                    assert_string_equal(kvt_layout_config_diff(&out, &before), "");
                    resealed_refused++;
                }
            }
    }
    /* most changes alter the layout or a checked field; a few cannot */
    assert_true(resealed_refused > 100 * let_through);
}

static void test_layout_codec_truncations_refused(void **state)
{
    (void)state;
    struct kv_layout_config c = k_base, out;
    unsigned char b[KV_LAYOUT_CONFIG_WIRE_BYTES + 1];
    const size_t len = encode_ok(&c, b);
    for (size_t n = 0; n < len; n++) {
        /* a copy of exactly n bytes: ASan would see any read past it */
        unsigned char *t = malloc(n ? n : 1);
        assert_non_null(t);
        memcpy(t, b, n);
        kv_status st = kv_layout_config_decode(t, n, &out);
        if (st != KV_ERR_CORRUPT || !strstr(kv_last_error(), "truncated"))
            fail_msg("%zu of %zu bytes: %s (%s)", n, len, kv_status_name(st), kv_last_error());
        free(t);
    }
    b[len] = 0;
    expect_msg(kv_layout_config_decode(b, len + 1, &out), KV_ERR_CORRUPT, "trailing");
    /* a length field that lies is named, longer or shorter */
    encode_ok(&c, b);
    b[12] = 127;
    reseal(b);
    expect_msg(kv_layout_config_decode(b, len, &out), KV_ERR_CORRUPT, "length field 127");
}

static void test_layout_codec_future_version_refused(void **state)
{
    (void)state;
    struct kv_layout_config c = k_base, out;
    unsigned char b[256];
    const size_t len = encode_ok(&c, b);
    /* version 2, resealed: refused as another version, both named */
    b[8] = 2;
    reseal(b);
    expect_msg(kv_layout_config_decode(b, len, &out), KV_ERR_MISMATCH,
               "encoding version 2; this library reads version 1");
    /* a later, longer version: the version is read before the length */
    memset(b + len, 0xAB, sizeof(b) - len);
    b[8] = 0x34;
    b[9] = 0x12;
    b[12] = 200;
    expect_msg(kv_layout_config_decode(b, 200, &out), KV_ERR_MISMATCH, "encoding version 4660");
    b[8] = 0;
    b[9] = 0;
    expect_msg(kv_layout_config_decode(b, 16, &out), KV_ERR_MISMATCH, "encoding version 0");
}

static void test_layout_codec_field_refusals(void **state)
{
    (void)state;
    struct kv_layout_config c = k_base, out, before;
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    unsigned char good[KV_LAYOUT_CONFIG_WIRE_BYTES], b[KV_LAYOUT_CONFIG_WIRE_BYTES];
    const size_t len = encode_ok(&c, good);
    memset(&out, 0x11, sizeof(out));
    before = out;
    struct {
        const char *what;
        size_t at;
        uint64_t value;
        int width;
        kv_status status;
        const char *needle;
    } cases[] = {
        {"magic", 3, 'X', 1, KV_ERR_CORRUPT, "expected \"KVLAYCFG\""},
        {"flags", 10, 1, 2, KV_ERR_CORRUPT, "flags 0x0001"},
        {"reserved", 92, 7, 4, KV_ERR_CORRUPT, "reserved field 0x00000007"},
        {"order", 80, 2, 4, KV_ERR_CORRUPT, "order 2"},
        {"arrange", 84, 9, 4, KV_ERR_CORRUPT, "arrange 9"},
        {"planes", 88, 3, 4, KV_ERR_CORRUPT, "planes 3 (0 K and V, 1 packed K|V, 2 K only)"},
        {"heads 0", 40, 0, 8, KV_ERR_CORRUPT, "num_heads = 0"},
        {"negative blocks", 24, (uint64_t)-5, 8, KV_ERR_CORRUPT, "num_blocks = -5"},
        {"blocks > 2^32", 24, (uint64_t)1 << 33, 8, KV_ERR_CORRUPT, "exceeds 2^32"},
        {"overflow", 48, (uint64_t)1 << 60, 8, KV_ERR_CORRUPT, "overflows"},
        {"negative pad", 56, (uint64_t)-1, 8, KV_ERR_CORRUPT, "block_pad_elems = -1"},
        {"align 24", 72, 24, 8, KV_ERR_CORRUPT, "align_bytes = 24"},
        {"stride overlap", 64, 8, 8, KV_ERR_CORRUPT, "blocks would overlap"},
        {"fingerprint", 112, 0x1234, 8, KV_ERR_MISMATCH, "the sender recorded 0x0000000000001234"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        memcpy(b, good, len);
        for (int k = 0; k < cases[i].width; k++)
            b[cases[i].at + (size_t)k] = (unsigned char)(cases[i].value >> (8 * k));
        reseal(b);
        kv_status st = kv_layout_config_decode(b, len, &out);
        if (st != cases[i].status || !strstr(kv_last_error(), cases[i].needle))
            fail_msg("%s: %s \"%s\", expected %s with \"%s\"", cases[i].what, kv_status_name(st),
                     kv_last_error(), kv_status_name(cases[i].status), cases[i].needle);
        assert_string_equal(kvt_layout_config_diff(&out, &before), "");
    }
    /* the dtype by name: unknown, an alias, unterminated, garbage after the NUL */
    static const char *names[] = {"bf17", "float16", "", "bf16\0x"};
    static const size_t name_len[] = {4, 7, 0, 6};
    for (int i = 0; i < 4; i++) {
        memcpy(b, good, len);
        memset(b + 96, 0, 16);
        memcpy(b + 96, names[i], name_len[i]);
        reseal(b);
        expect_msg(kv_layout_config_decode(b, len, &out), KV_ERR_CORRUPT, "dtype field");
    }
    memcpy(b, good, len);
    memset(b + 96, 'f', 16);
    reseal(b);
    expect_msg(kv_layout_config_decode(b, len, &out), KV_ERR_CORRUPT, "ffffffffffffffff");
    memcpy(b, good, len);
    b[96] = 0x1b; /* an escape byte is shown, not printed */
    reseal(b);
    expect_msg(kv_layout_config_decode(b, len, &out), KV_ERR_CORRUPT, "\\x1b");
    assert_string_equal(kvt_layout_config_diff(&out, &before), "");
    /* the checksum named with both values */
    memcpy(b, good, len);
    b[20] ^= 1;
    expect_msg(kv_layout_config_decode(b, len, &out), KV_ERR_CORRUPT, "checksum");
    expect_msg(kv_layout_config_decode(NULL, len, &out), KV_ERR_NULL, "buf");
    expect_msg(kv_layout_config_decode(good, len, NULL), KV_ERR_NULL, "out");
    assert_int_equal(kv_layout_config_decode(good, len, &out), KV_OK);
}

static void test_layout_codec_encode_refusals(void **state)
{
    (void)state;
    struct kv_layout_config c = k_base;
    unsigned char b[KV_LAYOUT_CONFIG_WIRE_BYTES], before[KV_LAYOUT_CONFIG_WIRE_BYTES];
    memset(b, 0x42, sizeof(b));
    memcpy(before, b, sizeof(b));
    size_t len = 7;
    expect_msg(kv_layout_config_encode(&c, b, KV_LAYOUT_CONFIG_WIRE_BYTES - 1, &len),
               KV_ERR_CAPACITY, "127 bytes of room, the encoding needs 128");
    assert_int_equal(len, KV_LAYOUT_CONFIG_WIRE_BYTES); /* the size it needs */
    len = 7;
    expect_msg(kv_layout_config_encode(&c, NULL, 0, &len), KV_ERR_CAPACITY, "needs 128");
    assert_int_equal(len, KV_LAYOUT_CONFIG_WIRE_BYTES);
    len = 7;
    struct kv_layout_config bad = c;
    bad.num_heads = 0;
    expect_msg(kv_layout_config_encode(&bad, b, sizeof(b), &len), KV_ERR_BAD_SHAPE,
               "num_heads = 0");
    bad = c;
    bad.struct_size = 8;
    expect_msg(kv_layout_config_encode(&bad, b, sizeof(b), &len), KV_ERR_INVALID_ARG,
               "kv_layout_config");
    bad = c;
    bad.dtype = (kv_dtype)99;
    expect_msg(kv_layout_config_encode(&bad, b, sizeof(b), &len), KV_ERR_INVALID_ARG,
               "unknown dtype 99");
    expect_msg(kv_layout_config_encode(NULL, b, sizeof(b), &len), KV_ERR_NULL, "cfg");
    expect_msg(kv_layout_config_encode(&c, b, sizeof(b), NULL), KV_ERR_NULL, "len");
    expect_msg(kv_layout_config_encode(&c, NULL, sizeof(b), &len), KV_ERR_NULL, "buf");
    assert_int_equal(len, 7);
    assert_memory_equal(b, before, sizeof(b)); /* nothing written by a refusal */
}

/* Audit (2026-12-05): kv_layout_kv_view handed out a view over a base not
 * aligned to its elements, which every view op then refused: now refused
 * itself, naming the base; an aligned base gives a view kv_view_check
 * accepts. */
static void test_layout_kv_view_refuses_misaligned_base(void **state)
{
    (void)state;
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = 2;
    c.num_blocks = 4;
    c.block_tokens = 4;
    c.num_heads = 2;
    c.head_dim = 8;
    c.dtype = KV_F32;
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    char *mem = aligned_alloc(64, (size_t)lo.total_bytes + 64);
    struct kv_view v;
    assert_int_equal(kv_layout_kv_view(&lo, mem + 1, (size_t)lo.total_bytes + 7, 1, 1, &v),
                     KV_ERR_INVALID_ARG);
    assert_non_null(strstr(kv_last_error(), "not aligned"));
    assert_int_equal(kv_layout_kv_view(&lo, mem + 4, (size_t)lo.total_bytes, 1, 1, &v), KV_OK);
    assert_int_equal(kv_view_check(&v), KV_OK);
    free(mem);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_views_and_runs_every_combination),
        cmocka_unit_test(test_layout_strides_by_hand),
        cmocka_unit_test(test_layout_large_offsets_64bit),
        cmocka_unit_test(test_layout_fingerprints_pinned),
        cmocka_unit_test(test_layout_fingerprint_stable_and_sensitive),
        cmocka_unit_test(test_layout_block_format_fingerprint),
        cmocka_unit_test(test_layout_refuses_bad_configs),
        cmocka_unit_test(test_layout_refuses_bad_queries),
        cmocka_unit_test(test_layout_config_from_rebuilds_exactly),
        cmocka_unit_test(test_layout_config_from_refuses_hand_built),
        cmocka_unit_test(test_layout_codec_round_trip),
        cmocka_unit_test(test_layout_codec_bytes_as_documented),
        cmocka_unit_test(test_layout_codec_every_byte_corruption_refused),
        cmocka_unit_test(test_layout_codec_truncations_refused),
        cmocka_unit_test(test_layout_codec_future_version_refused),
        cmocka_unit_test(test_layout_codec_field_refusals),
        cmocka_unit_test(test_layout_codec_encode_refusals),
        cmocka_unit_test(test_layout_kv_view_refuses_misaligned_base),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
