/*
 * test_attn_copy.c - the engine-shaped copies of attention/kv_attn.h on the
 * CPU: kv_attn_copy_blocks_ex (a layer range, K, V or both, within one
 * cache or between two caches of one block format: vLLM's copy_blocks and
 * swap_blocks) and kv_attn_write_i32 (an int32 slot mapping read in place).
 *
 *   - every layout: NHD/HND x layer-/block-major x padded x packed K|V, the
 *     five dtypes, two caches of different block counts whose arrangement
 *     and padding differ too, and one cache;
 *   - block ids far from 0, random layer ranges and plane selections (and
 *     opts NULL: every layer, K and V);
 *   - the WHOLE destination pool (padding included) compared with a
 *     reference built element by element through kvt_ref_offset_elems (the
 *     config alone, never the library's strides or addressing), so layers
 *     and planes not selected are checked byte-identical; the source pool
 *     checked unchanged;
 *   - every refusal (block formats that differ, layer ranges, planes,
 *     struct_size, overlapping storages, block ids, a dst written twice)
 *     names the values and leaves both pools bit-identical;
 *   - int32 slots give the pool int64 slots give, in every layout, one layer
 *     and every layer; a negative or out-of-range int32 slot and a slot
 *     twice are refused by index and value;
 *   - the CUDA entries run the same validators (without a device: the
 *     refusal, then KV_ERR_UNSUPPORTED naming the entry).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>

#include "kv_mem.h"
#include "kvtest.h"

static const kv_dtype k_dtypes[5] = {KV_F32, KV_F16, KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2};

/* ---- a pool and what it must hold ---------------------------------------------- */

struct pool {
    struct kv_layout_config cfg;
    struct kv_paged_cache c;
    unsigned char *mem, *ref;
    size_t bytes;
    int64_t es;
};

static void fill_random(void *p, size_t n, uint64_t seed)
{
    unsigned char *b = p;
    uint64_t r = seed;
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(kvt_rand(&r) >> 24);
}

static void pool_init(struct pool *p, const struct kv_layout_config *cfg, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->cfg = *cfg;
    assert_int_equal(kv_layout_init(cfg, &p->c.layout), KV_OK);
    p->bytes = (size_t)p->c.layout.total_bytes;
    p->es = p->c.layout.elem_bytes;
    p->mem = kv__mem_alloc_aligned(64, p->bytes);
    p->ref = kv__mem_alloc_aligned(64, p->bytes);
    assert_non_null(p->mem);
    assert_non_null(p->ref);
    fill_random(p->mem, p->bytes, seed); /* garbage everywhere, padding included */
    memcpy(p->ref, p->mem, p->bytes);
    p->c.base = p->mem;
    p->c.storage_bytes = p->bytes;
}

static void pool_free(struct pool *p)
{
    kv__mem_free(p->mem);
    kv__mem_free(p->ref);
}

static void pool_check(const struct pool *p, const char *what)
{
    if (memcmp(p->mem, p->ref, p->bytes) == 0)
        return;
    size_t i = 0;
    while (p->mem[i] == p->ref[i])
        i++;
    fail_msg("%s: pool byte %zu is 0x%02x, expected 0x%02x (%zu bytes in all)", what, i, p->mem[i],
             p->ref[i], p->bytes);
}

/* Byte offset of element (l, kv, b, n, h, d), from the config alone. */
static size_t ref_off(const struct pool *p, int64_t l, int kv, int64_t b, int64_t n, int64_t h,
                      int64_t d)
{
    return (size_t)(kvt_ref_offset_elems(&p->cfg, l, kv, b, n, h, d) * p->es);
}

/* What copying cp[0..n) of layers [l0, l0 + nl) and planes (1 K, 2 V, 3
 * both) from src into dst leaves in dst->ref, element by element. */
static void ref_copy(struct pool *dst, const struct pool *src, const struct kv_block_copy *cp,
                     uint32_t n, int64_t l0, int64_t nl, uint32_t planes)
{
    const struct kv_layout_config *c = &dst->cfg;
    for (uint32_t i = 0; i < n; i++)
        for (int64_t l = l0; l < l0 + nl; l++)
            for (int kv = 0; kv < 2; kv++) {
                if (!(planes & (1u << kv)))
                    continue;
                for (int64_t t = 0; t < c->block_tokens; t++)
                    for (int64_t h = 0; h < c->num_heads; h++)
                        for (int64_t d = 0; d < c->head_dim; d++)
                            memcpy(dst->ref + ref_off(dst, l, kv, cp[i].dst, t, h, d),
                                   src->ref + ref_off(src, l, kv, cp[i].src, t, h, d),
                                   (size_t)dst->es);
            }
}

/* n copies, src ids in [slo, shi] of the source, dst ids in [dlo, dhi] of
 * the destination, dsts distinct; one cache (one true): no dst is a src. */
static void make_copies(struct kv_block_copy *cp, uint32_t n, uint64_t *rng, int64_t slo,
                        int64_t shi, int64_t dlo, int64_t dhi, bool one)
{
    for (uint32_t i = 0; i < n; i++) {
        bool ok;
        do {
            cp[i].src = (uint32_t)kvt_range(rng, slo, shi);
            cp[i].dst = (uint32_t)kvt_range(rng, dlo, dhi);
            cp[i].tokens = 0;
            ok = !one || cp[i].src != cp[i].dst;
            for (uint32_t j = 0; j < i && ok; j++)
                ok = cp[j].dst != cp[i].dst &&
                     (!one || (cp[j].src != cp[i].dst && cp[j].dst != cp[i].src));
        } while (!ok);
    }
}

static struct kv_layout_config layout_case(int i, int64_t B)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 4, cfg.num_blocks = B, cfg.block_tokens = i % 3 == 0 ? 8 : 4;
    cfg.num_heads = 2, cfg.head_dim = i % 2 ? 16 : 24, cfg.dtype = k_dtypes[i % 5];
    cfg.order = i & 1 ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.arrange = i & 2 ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    cfg.kv_packed = (i & 4) != 0;
    cfg.block_pad_elems = i & 8 ? 8 : 0;
    return cfg;
}

/* ---- kv_attn_copy_blocks_ex ------------------------------------------------------------ */

/* Two caches of one block format, a "device" cache of 700 blocks and a
 * "host" cache of 500 whose arrangement and padding differ: swap out
 * (device -> host) and swap in (host -> device), ids far from 0, random
 * layer ranges and planes. */
static void test_attn_copy_ex_two_caches_every_layout(void **state)
{
    (void)state;
    uint64_t rng = 77;
    for (int i = 0; i < 16; i++) {
        struct kv_layout_config dc = layout_case(i, 700), hc = layout_case(i, 500);
        hc.arrange =
            dc.arrange == KV_ARRANGE_LAYER_MAJOR ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
        hc.block_pad_elems = dc.block_pad_elems ? 0 : 4;
        struct pool dev, host;
        pool_init(&dev, &dc, 100 + (uint64_t)i);
        pool_init(&host, &hc, 200 + (uint64_t)i);
        for (int round = 0; round < 6; round++) {
            const bool out = round % 2 == 0; /* swap out: device -> host */
            struct pool *dst = out ? &host : &dev, *src = out ? &dev : &host;
            struct kv_copy_blocks_opts o;
            kv_copy_blocks_opts_init(&o);
            o.layer0 = (uint32_t)kvt_range(&rng, 0, 3);
            o.n_layers = (uint32_t)kvt_range(&rng, 0, 4 - o.layer0); /* 0: through L - 1 */
            o.planes = (uint32_t)kvt_range(&rng, 0, 3);
            const bool null_opts = round == 5;
            const int64_t nl = null_opts ? 4 : (o.n_layers ? o.n_layers : 4 - o.layer0);
            const int64_t l0 = null_opts ? 0 : o.layer0;
            const uint32_t planes = null_opts || o.planes == 0 ? 3 : o.planes;
            struct kv_block_copy cp[40];
            const int64_t sB = src->cfg.num_blocks, dB = dst->cfg.num_blocks;
            make_copies(cp, 40, &rng, sB - 300, sB - 1, dB - 300, dB - 1, false);
            cp[0].src = (uint32_t)(sB - 1); /* the last block of each side */
            bool last = false;
            for (int c = 0; c < 40; c++)
                last = last || cp[c].dst == (uint32_t)(dB - 1);
            if (!last)
                cp[1].dst = (uint32_t)(dB - 1);
            ref_copy(dst, src, cp, 40, l0, nl, planes);
            struct kv_copy_stats s0, s1;
            kv_copy_stats_get(&s0);
            kv_status st = kv_attn_copy_blocks_ex(dst->c, src->c, cp, 40, null_opts ? NULL : &o);
            if (st != KV_OK)
                fail_msg("case %d round %d: %s (%s)", i, round, kv_status_name(st),
                         kv_last_error());
            kv_copy_stats_get(&s1);
            char what[96];
            snprintf(what, sizeof(what),
                     "case %d round %d layers [%" PRId64 ", +%" PRId64 ") planes %u", i, round, l0,
                     nl, planes);
            pool_check(dst, what); /* every other layer, plane, block and pad byte */
            pool_check(src, what); /* the source unchanged */
            const uint64_t elems = (uint64_t)dc.block_tokens * (uint64_t)dc.num_heads *
                                   (uint64_t)dc.head_dim * (planes == 3 ? 2u : 1u);
            assert_int_equal(s1.bytes[KV_COPY_BLOCK_COPY] - s0.bytes[KV_COPY_BLOCK_COPY],
                             40ull * (uint64_t)nl * elems * (uint64_t)dev.es);
        }
        pool_free(&dev);
        pool_free(&host);
    }
}

/* One cache: src and dst the same (vLLM's copy_blocks), a layer range and
 * a plane, ids far from 0; the same cache named by two equal structs. */
static void test_attn_copy_ex_one_cache_every_layout(void **state)
{
    (void)state;
    uint64_t rng = 91;
    for (int i = 0; i < 16; i++) {
        struct kv_layout_config cfg = layout_case(i, 900);
        struct pool p;
        pool_init(&p, &cfg, 300 + (uint64_t)i);
        for (int round = 0; round < 5; round++) {
            struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
            o.layer0 = (uint32_t)kvt_range(&rng, 0, 3);
            o.n_layers = (uint32_t)kvt_range(&rng, 1, 4 - o.layer0);
            o.planes = (uint32_t)kvt_range(&rng, 1, 3);
            if (round == 4)
                o.layer0 = 0, o.n_layers = 0, o.planes = 0; /* every layer and plane */
            const int64_t nl = o.n_layers ? o.n_layers : 4;
            const uint32_t planes = o.planes ? o.planes : 3;
            struct kv_block_copy cp[30];
            make_copies(cp, 30, &rng, 500, 899, 500, 899, true);
            ref_copy(&p, &p, cp, 30, o.layer0, nl, planes);
            assert_int_equal(kv_attn_copy_blocks_ex(p.c, p.c, cp, 30, &o), KV_OK);
            char what[64];
            snprintf(what, sizeof(what), "case %d round %d", i, round);
            pool_check(&p, what);
        }
        pool_free(&p);
    }
}

static void test_attn_copy_ex_refusals(void **state)
{
    (void)state;
    struct kv_layout_config dc = layout_case(0, 64), hc = layout_case(0, 32);
    hc.arrange = KV_ARRANGE_BLOCK_MAJOR;
    struct pool dev, host;
    pool_init(&dev, &dc, 5);
    pool_init(&host, &hc, 6);
    struct kv_block_copy ok[2] = {{60, 31, 0}, {3, 2, 0}};
    struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
    kv_status st;
#define REFUSED(call, want, needle)                                                                \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != (want))                                                                          \
            fail_msg("%s: got %s (%s), want %s", #call, kv_status_name(st), kv_last_error(),       \
                     kv_status_name(want));                                                        \
        kvt_assert_msg_has(needle);                                                                \
        pool_check(&dev, #call);                                                                   \
        pool_check(&host, #call);                                                                  \
    } while (0)

    /* block formats that differ: each field named with both values */
    static const struct {
        const char *field;
        int what;
    } fmt[] = {{"H 2 (src) vs 4 (dst)", 0},         {"L 4 (src) vs 3 (dst)", 1},
               {"dtype f32 (src) vs f16 (dst)", 2}, {"order NHD (src) vs HND (dst)", 3},
               {"kv_packed 0 (src) vs 1 (dst)", 4}, {"N 8 (src) vs 16 (dst)", 5},
               {"D 24 (src) vs 32 (dst)", 6}};
    for (size_t i = 0; i < sizeof(fmt) / sizeof(fmt[0]); i++) {
        struct kv_layout_config oc = hc;
        switch (fmt[i].what) {
        case 0:
            oc.num_heads = 4;
            break;
        case 1:
            oc.num_layers = 3;
            break;
        case 2:
            oc.dtype = KV_F16;
            break;
        case 3:
            oc.order = KV_ORDER_HND;
            break;
        case 4:
            oc.kv_packed = true;
            break;
        case 5:
            oc.block_tokens = 16;
            break;
        default:
            oc.head_dim = 32;
            break;
        }
        struct pool other;
        pool_init(&other, &oc, 7);
        st = kv_attn_copy_blocks_ex(other.c, dev.c, ok, 2, NULL);
        if (st != KV_ERR_MISMATCH)
            fail_msg("%s: got %s (%s)", fmt[i].field, kv_status_name(st), kv_last_error());
        kvt_assert_msg_has(fmt[i].field);
        kvt_assert_msg_has("different block formats");
        pool_check(&other, fmt[i].field);
        pool_check(&dev, fmt[i].field);
        pool_free(&other);
    }

    /* layer ranges, planes, struct_size */
    o.layer0 = 4;
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, ok, 2, &o), KV_ERR_INVALID_ARG,
            "layers [4, 4) (layer0 4, n_layers 0) outside [0, L = 4)");
    o.layer0 = 2, o.n_layers = 3;
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, ok, 2, &o), KV_ERR_INVALID_ARG,
            "layers [2, 5) (layer0 2, n_layers 3) outside [0, L = 4)");
    o.layer0 = 0, o.n_layers = 0xFFFFFFFFu;
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, ok, 2, &o), KV_ERR_INVALID_ARG,
            "n_layers 4294967295");
    o.n_layers = 1, o.planes = 4;
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, ok, 2, &o), KV_ERR_INVALID_ARG, "planes 4");
    o.planes = 1, o.struct_size = sizeof(o) - 4;
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, ok, 2, &o), KV_ERR_INVALID_ARG,
            "kv_copy_blocks_opts");
    o.struct_size = sizeof(o);

    /* block ids, each side against its own B */
    struct kv_block_copy bad_src[2] = {{3, 2, 0}, {64, 5, 0}};
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, bad_src, 2, &o), KV_ERR_OUT_OF_BOUNDS,
            "copy 1 {src 64, dst 5}: src block 64 >= the src cache's B = 64");
    struct kv_block_copy bad_dst[2] = {{3, 2, 0}, {40, 32, 0}};
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, bad_dst, 2, &o), KV_ERR_OUT_OF_BOUNDS,
            "dst block 32 >= the dst cache's B = 32");
    struct kv_block_copy twice[3] = {{3, 9, 0}, {4, 2, 0}, {5, 9, 0}};
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, twice, 3, &o), KV_ERR_OVERLAP,
            "dst block 9 is written by copy 0 and by copy 2");
    /* between two caches a block id may be both a src and a dst */
    struct kv_block_copy cross[2] = {{9, 3, 0}, {3, 9, 0}};
    ref_copy(&host, &dev, cross, 2, 0, 1, 1);
    assert_int_equal(kv_attn_copy_blocks_ex(host.c, dev.c, cross, 2, &o), KV_OK);
    pool_check(&host, "cross");
    pool_check(&dev, "cross");
    REFUSED(kv_attn_copy_blocks_ex(host.c, dev.c, NULL, 2, &o), KV_ERR_NULL, "copies is NULL");

    /* one cache keeps kv_attn_copy_blocks' rules */
    struct kv_block_copy self[1] = {{7, 7, 0}}, chain[2] = {{3, 7, 0}, {7, 9, 0}};
    REFUSED(kv_attn_copy_blocks_ex(dev.c, dev.c, self, 1, &o), KV_ERR_OVERLAP,
            "copies block 7 onto itself");
    REFUSED(kv_attn_copy_blocks_ex(dev.c, dev.c, chain, 2, &o), KV_ERR_OVERLAP, "block 7 is");
    struct kv_block_copy far[1] = {{3, 64, 0}};
    REFUSED(kv_attn_copy_blocks_ex(dev.c, dev.c, far, 1, &o), KV_ERR_OUT_OF_BOUNDS,
            "names a block >= B = 64");

    /* storages that overlap but are not one cache: the host layout over
     * the device pool's memory, and a small cache inside its end */
    struct kv_paged_cache alias = host.c;
    alias.base = dev.mem;
    REFUSED(kv_attn_copy_blocks_ex(alias, dev.c, ok, 2, &o), KV_ERR_OVERLAP, "src storage [");
    kvt_assert_msg_has("overlap");
    alias.layout.num_blocks = 0; /* a broken layout: refused before the overlap check */
    REFUSED(kv_attn_copy_blocks_ex(dev.c, alias, ok, 2, &o), KV_ERR_INVALID_ARG, "src");
    struct kv_layout_config small = hc;
    small.num_blocks = 8;
    struct kv_paged_cache half = {.mem = KV_MEM_HOST};
    assert_int_equal(kv_layout_init(&small, &half.layout), KV_OK);
    half.base = dev.mem + (dev.bytes - (size_t)half.layout.total_bytes);
    half.storage_bytes = (size_t)half.layout.total_bytes;
    struct kv_block_copy in_small[1] = {{1, 2, 0}};
    REFUSED(kv_attn_copy_blocks_ex(half, dev.c, in_small, 1, NULL), KV_ERR_OVERLAP,
            "dst storage [");

    /* the caches are checked as every kernel checks them, each named */
    struct kv_paged_cache devmem = dev.c;
    devmem.mem = KV_MEM_DEVICE;
    REFUSED(kv_attn_copy_blocks_ex(host.c, devmem, ok, 2, &o), KV_ERR_INVALID_ARG,
            "kv_attn_copy_blocks_ex: src");
    REFUSED(kv_attn_copy_blocks_ex(devmem, host.c, ok, 2, &o), KV_ERR_INVALID_ARG,
            "kv_attn_copy_blocks_ex: dst");
#undef REFUSED
    pool_free(&dev);
    pool_free(&host);
}

/* The CUDA entries run the same validators: without a device, the refusal
 * first, then KV_ERR_UNSUPPORTED naming the entry. */
static void test_attn_copy_ex_cuda_entries_validate_first(void **state)
{
    (void)state;
    const char *e = getenv("KV_EXPECT_GPU");
    if (e && e[0] == '1')
        skip(); /* host pointers would be handed to a real device */
    struct kv_layout_config dc = layout_case(1, 64), hc = layout_case(1, 32);
    struct pool dev, host;
    pool_init(&dev, &dc, 15);
    pool_init(&host, &hc, 16);
    dev.c.mem = KV_MEM_DEVICE;
    host.c.mem = KV_MEM_PINNED;
    struct kv_block_copy ok[2] = {{60, 31, 0}, {3, 2, 0}}, bad[1] = {{64, 1, 0}};
    struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
    o.planes = KV_ATTN_PLANE_V;
    kv_status st = kv_attn_copy_blocks_ex_cuda(host.c, dev.c, bad, 1, &o, NULL);
    assert_int_equal(st, KV_ERR_OUT_OF_BOUNDS);
    kvt_assert_msg_has("kv_attn_copy_blocks_ex_cuda: copy 0 {src 64, dst 1}");
    st = kv_attn_copy_blocks_ex_cuda(host.c, dev.c, ok, 2, &o, NULL);
    assert_int_equal(st, KV_ERR_UNSUPPORTED);
    kvt_assert_msg_has("kv_attn_copy_blocks_ex_cuda");
    st = kv_attn_copy_blocks_ex(host.c, dev.c, ok, 2, &o); /* the CPU cannot address it */
    assert_int_equal(st, KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("device memory");
    pool_check(&dev, "cuda");
    pool_check(&host, "cuda");

    /* int32 slots on CUDA: validated first, then no device */
    const int64_t H = dc.num_heads, D = dc.head_dim, T = 3;
    const size_t tb = (size_t)(T * H * D) * kv_dtype_size(dc.dtype);
    void *kb = calloc(1, tb), *vb = calloc(1, tb);
    int64_t shape[3] = {T, H, D};
    struct kv_view k, v;
    assert_int_equal(kv_view_init(kb, tb, dc.dtype, 3, shape, &k), KV_OK);
    assert_int_equal(kv_view_init(vb, tb, dc.dtype, 3, shape, &v), KV_OK);
    int32_t slots[3] = {8, 9, 64 * 4}, good[3] = {8, 9, 10};
    st = kv_attn_write_i32_cuda(dev.c, 0, &k, &v, slots, 3, NULL, NULL);
    assert_int_equal(st, KV_ERR_OUT_OF_BOUNDS);
    kvt_assert_msg_has("kv_attn_write_i32_cuda: slots[2] = 256 outside [-1, 256)");
    st = kv_attn_write_i32_cuda(dev.c, 0, &k, &v, good, 3, NULL, NULL);
    assert_int_equal(st, KV_ERR_UNSUPPORTED);
    kvt_assert_msg_has("kv_attn_write_i32_cuda");
    pool_check(&dev, "write_i32_cuda");
    free(kb);
    free(vb);
    pool_free(&dev);
    pool_free(&host);
}

/* ---- int32 slots ----------------------------------------------------------------------- */

/* The same K/V written with int64 slots into one pool and int32 slots into
 * its twin: the pools agree byte for byte, and hold what the reference
 * says for the tokens written (one layer, then every layer). */
static void test_attn_write_i32_matches_i64(void **state)
{
    (void)state;
    uint64_t rng = 123;
    for (int i = 0; i < 16; i++) {
        struct kv_layout_config cfg = layout_case(i, 3000);
        struct pool a, b;
        pool_init(&a, &cfg, 400 + (uint64_t)i);
        pool_init(&b, &cfg, 400 + (uint64_t)i);
        const int64_t L = cfg.num_layers, N = cfg.block_tokens, H = cfg.num_heads, D = cfg.head_dim,
                      T = 37;
        const kv_dtype sdt = k_dtypes[(i + 2) % 5]; /* converting or not */
        const size_t es = kv_dtype_size(sdt), tb = (size_t)(L * T * H * D) * es;
        unsigned char *kb = malloc(tb), *vb = malloc(tb);
        assert_non_null(kb);
        assert_non_null(vb);
        fill_random(kb, tb, 500 + (uint64_t)i);
        fill_random(vb, tb, 600 + (uint64_t)i);
        for (size_t x = 0; x < tb; x += es) { /* no NaN payloads: conversions canonicalize */
            kb[x + es - 1] &= 0x3F;
            vb[x + es - 1] &= 0x3F;
        }
        int64_t s64[37];
        int32_t s32[37];
        const int64_t limit = cfg.num_blocks * N;
        for (int64_t t = 0; t < T; t++) {
            bool dup;
            int tries = 0;
            do {
                /* runs of consecutive slots and scattered ones, far from 0 */
                s64[t] = t && t % 5 && tries == 0 && s64[t - 1] >= 0 && s64[t - 1] + 1 < limit
                             ? s64[t - 1] + 1
                             : kvt_range(&rng, limit - 2000, limit - 1);
                tries++;
                dup = false;
                for (int64_t u = 0; u < t; u++)
                    dup = dup || s64[u] == s64[t];
            } while (dup);
            if (t == 11)
                s64[t] = -1; /* skipped */
            s32[t] = (int32_t)s64[t];
        }
        for (int all = 0; all < 2; all++) {
            const int64_t nd = all ? 4 : 3;
            int64_t shape[4] = {L, T, H, D};
            struct kv_view k, v;
            assert_int_equal(kv_view_init(kb, tb, sdt, (int)nd, all ? shape : shape + 1, &k),
                             KV_OK);
            assert_int_equal(kv_view_init(vb, tb, sdt, (int)nd, all ? shape : shape + 1, &v),
                             KV_OK);
            const int32_t layer = all ? KV_ATTN_ALL_LAYERS : (int32_t)(i % 4);
            assert_int_equal(kv_attn_write(a.c, layer, &k, &v, s64, T - 2, NULL), KV_OK);
            assert_int_equal(kv_attn_write_i32(b.c, layer, &k, &v, s32, T - 2, NULL), KV_OK);
            if (memcmp(a.mem, b.mem, a.bytes) != 0)
                fail_msg("case %d all %d: int32 slots wrote another pool than int64", i, all);
            /* and it is the write: token 0's first element of layer `layer`
             * (or 0) converted as the reference does, its bytes when equal */
            if (sdt == cfg.dtype) {
                const int64_t s = s64[0];
                assert_memory_equal(a.mem + ref_off(&a, all ? 0 : layer, 1, s / N, s % N, 1, 3),
                                    vb + (size_t)((1 * D + 3)) * es, es);
            }
            /* the untouched part: a slot not in the mapping keeps its garbage */
            const int64_t s = s64[T - 1]; /* beyond n_slots: not written */
            assert_memory_equal(a.mem + ref_off(&a, 0, 0, s / N, s % N, 0, 0),
                                a.ref + ref_off(&a, 0, 0, s / N, s % N, 0, 0), es);
        }
        free(kb);
        free(vb);
        pool_free(&a);
        pool_free(&b);
    }
}

static void test_attn_write_i32_refusals(void **state)
{
    (void)state;
    struct kv_layout_config cfg = layout_case(2, 64);
    struct pool p;
    pool_init(&p, &cfg, 9);
    const int64_t H = cfg.num_heads, D = cfg.head_dim, T = 4;
    const size_t tb = (size_t)(T * H * D) * kv_dtype_size(cfg.dtype);
    void *kb = calloc(1, tb), *vb = calloc(1, tb);
    int64_t shape[3] = {T, H, D};
    struct kv_view k, v;
    assert_int_equal(kv_view_init(kb, tb, cfg.dtype, 3, shape, &k), KV_OK);
    assert_int_equal(kv_view_init(vb, tb, cfg.dtype, 3, shape, &v), KV_OK);
    kv_status st;
#define REFUSED(call, want, needle)                                                                \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != (want))                                                                          \
            fail_msg("%s: got %s (%s), want %s", #call, kv_status_name(st), kv_last_error(),       \
                     kv_status_name(want));                                                        \
        kvt_assert_msg_has(needle);                                                                \
        pool_check(&p, #call);                                                                     \
    } while (0)
    const int64_t limit = 64 * cfg.block_tokens;
    int32_t over[4] = {8, 9, (int32_t)limit, 1}, neg[4] = {8, -2, 3, 1},
            min[4] = {INT32_MIN, 1, 2, 3}, dup[4] = {8, 9, 10, 9};
    char want[96];
    snprintf(want, sizeof(want),
             "kv_attn_write_i32: slots[2] = %" PRId64 " outside [-1, %" PRId64 ")", limit, limit);
    REFUSED(kv_attn_write_i32(p.c, 0, &k, &v, over, 4, NULL), KV_ERR_OUT_OF_BOUNDS, want);
    REFUSED(kv_attn_write_i32(p.c, 0, &k, &v, neg, 4, NULL), KV_ERR_OUT_OF_BOUNDS,
            "slots[1] = -2 outside");
    REFUSED(kv_attn_write_i32(p.c, 0, &k, &v, min, 4, NULL), KV_ERR_OUT_OF_BOUNDS,
            "slots[0] = -2147483648 outside");
    REFUSED(kv_attn_write_i32(p.c, 0, &k, &v, dup, 4, NULL), KV_ERR_OVERLAP,
            "slot 9 is written twice (tokens 1 and 3)");
    REFUSED(kv_attn_write_i32(p.c, 0, &k, &v, NULL, 4, NULL), KV_ERR_NULL, "slots is NULL");
    REFUSED(kv_attn_write_i32(p.c, 0, &k, &v, dup, 5, NULL), KV_ERR_BAD_SHAPE, "n_slots 5");
#undef REFUSED
    free(kb);
    free(vb);
    pool_free(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attn_copy_ex_two_caches_every_layout),
        cmocka_unit_test(test_attn_copy_ex_one_cache_every_layout),
        cmocka_unit_test(test_attn_copy_ex_refusals),
        cmocka_unit_test(test_attn_copy_ex_cuda_entries_validate_first),
        cmocka_unit_test(test_attn_write_i32_matches_i64),
        cmocka_unit_test(test_attn_write_i32_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
