/*
 * test_plan.c - transfer plans (connector/plan/kv_plan.h): every pair of layouts
 * (NHD/HND x layer-/block-major x padded x packed, page sizes 8/16/32, head
 * slices, layer ranges between caches of different layer counts: random
 * ranges, pipeline stages, one layer), block ids spread over pools of
 * hundreds of blocks, checked
 * element by element against offsets computed from the configs alone
 * (kvt_ref_offset_elems), the whole destination pool compared (no stray
 * bytes) and the source unchanged; the run counts of simple plans; every
 * refusal leaves the destination bit-identical, layer ranges outside a
 * layout are refused naming the values. The CUDA executor: its
 * entry refuses what kv_plan_copy refuses, with the same statuses, before
 * any device work; its schedule (kv__plan_cuda_schedule), executed on the
 * CPU, writes exactly what kv_plan_copy writes over the whole pool (and
 * the reference, layer ranges included), split by width at the threshold.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>

#include "kv_pack_int.h" /* kv__pack_nt_min_bytes: kv_plan_copy's streaming path */
#include "kv_plan_cuda_int.h"
#include "kvt_side.h"
#include "kvtest.h"

/* One request from a source of Ls layers (pool of Bs blocks) into a
 * destination of Ld layers (Bd blocks) with the plan config pc (heads and
 * layers), T tokens at most Tmax; the whole destination pool against the
 * config-only reference, the layers outside the range byte-identical, the
 * source unchanged, the stats counting the moved layers and heads only. */
static void run_pair_cfg(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Ls, int64_t Ld,
                         int64_t Bs, int64_t Bd, int64_t Hs, int64_t Hd,
                         const struct kv_plan_config *pc, kv_dtype dt, int64_t Tmax, uint64_t seed)
{
    const int64_t D = 16;
    struct kvt_side s, d;
    kvt_side_make(&s, Ls, Bs, Ns, Hs, D, dt, sbits, seed);
    kvt_side_make(&d, Ld, Bd, Nd, Hd, D, dt, dbits, seed + 1);
    const int64_t sh0 = pc->src_head0, dh0 = pc->dst_head0, nh = pc->n_heads ? pc->n_heads : Hs;
    const int64_t sl0 = pc->src_layer0, dl0 = pc->dst_layer0, nl = pc->n_layers ? pc->n_layers : Ls;
    kv_plan *plan = NULL;
    kv_status cst = kv_plan_create(&s.lo, &d.lo, pc, &plan);
    if (cst != KV_OK)
        fail_msg("kv_plan_create: %s: %s", kv_status_name(cst), kv_last_error());
    struct kv_plan_stats ps;
    assert_int_equal(kv_plan_stats_get(plan, &ps), KV_OK);
    assert_int_equal(ps.rows, nl * 2 * ps.window_tokens * nh);
    assert_int_equal(ps.window_bytes, ps.rows * D * s.lo.elem_bytes);
    uint64_t rng = seed * 7 + 3;
    const uint64_t T = (uint64_t)kvt_range(&rng, 1, Tmax);
    const uint32_t ns = (uint32_t)((T + (uint64_t)Ns - 1) / (uint64_t)Ns);
    const uint32_t nd = (uint32_t)((T + (uint64_t)Nd - 1) / (uint64_t)Nd);
    uint32_t sid[128], did[128];
    kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, nd, did);

    unsigned char *ref = malloc((size_t)d.lo.total_bytes);
    unsigned char *src0 = malloc((size_t)s.lo.total_bytes);
    assert_true(ref && src0);
    memcpy(ref, d.mem, (size_t)d.lo.total_bytes);
    memcpy(src0, s.mem, (size_t)s.lo.total_bytes);
    /* the tokens both lists cover move, element by element */
    kvt_ref_move_layers(&s, sid, ns, &d, did, nd, sl0, dl0, nl, sh0, dh0, nh, ref);
    kv_status st = kv_plan_copy(plan, s.pc, sid, ns, d.pc, did, nd, T);
    if (st != KV_OK)
        fail_msg("kv_plan_copy: %s: %s", kv_status_name(st), kv_last_error());
    if (memcmp(ref, d.mem, (size_t)d.lo.total_bytes) != 0) {
        int64_t i = 0;
        while (ref[i] == d.mem[i])
            i++;
        fail_msg("bits %d->%d N %lld->%lld heads [%lld+%lld) -> [%lld) layers [%lld+%lld) of "
                 "%lld -> [%lld) of %lld: destination byte %lld differs (of %lld)",
                 sbits, dbits, (long long)Ns, (long long)Nd, (long long)sh0, (long long)nh,
                 (long long)dh0, (long long)sl0, (long long)nl, (long long)Ls, (long long)dl0,
                 (long long)Ld, (long long)i, (long long)d.lo.total_bytes);
    }
    /* the destination's other layers, row by row from the config: as before */
    assert_int_equal(kvt_other_layers_changed(&d, did, nd, dl0, nl, d.mem, ref), 0);
    assert_memory_equal(src0, s.mem, (size_t)s.lo.total_bytes);
    free(ref);
    free(src0);
    kv_plan_destroy(plan);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

static void run_pair(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                     int64_t sh0, int64_t dh0, int64_t nh, kv_dtype dt, uint64_t seed)
{
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = sh0;
    pc.dst_head0 = dh0;
    pc.n_heads = nh;
    run_pair_cfg(sbits, dbits, Ns, Nd, 3, 3, 300, 260, Hs, Hd, &pc, dt, 700, seed);
}

/* Every layout pair, with the stores kv_plan_copy makes for small moves
 * (plain); then, forced, those of a move of 8 MiB and more (streamed rows
 * of 256 bytes and more: the coalesced runs of the pairs that have them)
 * for every fourth pair, each layout onto itself among them. */
static void test_plan_every_layout_pair(void **state)
{
    (void)state;
    static const int64_t Ns[3] = {8, 16, 32};
    const uint64_t nt_default = kv__pack_nt_min_bytes;
    uint64_t seed = 1;
    for (int nt = 0; nt < 2; nt++) {
        kv__pack_nt_min_bytes = nt ? 0 : UINT64_MAX;
        for (int sb = 0; sb < 16; sb++)
            for (int db = 0; db < 16; db++) {
                const int64_t a = Ns[(sb + db) % 3], b = Ns[(sb * 3 + db) % 3];
                if (!nt || (sb - db) % 4 == 0)
                    run_pair(sb, db, a, b, 4, 4, 0, 0, 0, KV_BF16, seed++);
            }
    }
    kv__pack_nt_min_bytes = nt_default;
}

static void test_plan_head_slices_and_dtypes(void **state)
{
    (void)state;
    uint64_t seed = 1000;
    /* TP 1 -> TP 2 (heads 2..3 of 4 to a 2-head receiver), the reverse, odd slices */
    for (int i = 0; i < 16; i++) {
        run_pair(i, 15 - i, 16, i % 2 ? 32 : 8, 4, 2, 2, 0, 2, KV_BF16, seed++);
        run_pair(15 - i, i, 16, 16, 2, 4, 0, 2, 2, KV_F32, seed++);
        run_pair(i, i, 8, 16, 6, 5, 1, 2, 3, KV_FP8_E4M3, seed++);
    }
}

/* A random layer range of a source of Ls layers onto a destination of Ld
 * (every 8th draw: n_layers 0 between equal L), with the draw in *pc. */
static void draw_layers(uint64_t *rng, int64_t *Ls, int64_t *Ld, struct kv_plan_config *pc)
{
    *Ls = kvt_range(rng, 1, 5);
    *Ld = kvt_range(rng, 1, 6);
    if (kvt_range(rng, 0, 7) == 0) {
        *Ld = *Ls;
        pc->src_layer0 = pc->dst_layer0 = pc->n_layers = 0;
        return;
    }
    const int64_t n = kvt_range(rng, 1, *Ls < *Ld ? *Ls : *Ld);
    pc->n_layers = n;
    pc->src_layer0 = kvt_range(rng, 0, *Ls - n);
    pc->dst_layer0 = kvt_range(rng, 0, *Ld - n);
}

/* Every layout pair (NHD/HND x layer-/block-major x padded x packed, page
 * sizes 8/16/32) with a random layer range between caches of different
 * layer counts: the whole destination pool against the reference, the
 * layers outside the range untouched; every 4th pair also a head slice. */
static void test_plan_layer_ranges_every_layout_pair(void **state)
{
    (void)state;
    static const int64_t Ns[3] = {8, 16, 32};
    uint64_t seed = 20000, rng = 99;
    for (int sb = 0; sb < 16; sb++)
        for (int db = 0; db < 16; db++) {
            const int64_t a = Ns[(sb + 2 * db) % 3], b = Ns[(sb * 5 + db) % 3];
            struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
            int64_t Ls, Ld, Hs = 4, Hd = 4;
            draw_layers(&rng, &Ls, &Ld, &pc);
            if ((sb + db) % 4 == 0) { /* heads 1..2 of 4 onto 0..1 of 3 */
                Hd = 3;
                pc.src_head0 = 1;
                pc.n_heads = 2;
            }
            run_pair_cfg(sb, db, a, b, Ls, Ld, 120, 100, Hs, Hd, &pc, KV_BF16, 300, seed++);
        }
}

/* A pipeline: a decoder of 8 layers filled by 4 prefill stages of 2 layers
 * each (stage k -> layers [2k, 2k + 2)), and one layer at a time; dtypes
 * of 1, 2 and 4 bytes. */
static void test_plan_layer_ranges_pipeline_and_one_layer(void **state)
{
    (void)state;
    uint64_t seed = 30000;
    for (int k = 0; k < 4; k++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.dst_layer0 = 2 * k;
        pc.n_layers = 2;
        run_pair_cfg(k, 15 - k, 16, 8, 2, 8, 90, 200, 4, 4, &pc, KV_BF16, 400, seed++);
        run_pair_cfg(k * 4, k, 8, 32, 2, 8, 90, 60, 4, 4, &pc, KV_FP8_E4M3, 400, seed++);
    }
    for (int l = 0; l < 5; l++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = l;
        pc.dst_layer0 = 4 - l;
        pc.n_layers = 1;
        run_pair_cfg(l, 3 * l % 16, 16, 16, 5, 5, 80, 80, 2, 2, &pc, KV_F32, 200, seed++);
        run_pair_cfg(8 + l, l, 32, 16, 5, 5, 80, 80, 2, 2, &pc, KV_BF16, 200, seed++);
    }
}

static void test_plan_run_counts(void **state)
{
    (void)state;
    struct kvt_side s, b;
    kvt_side_make(&s, 4, 64, 16, 8, 128, KV_BF16, 0, 1); /* NHD layer-major */
    kvt_side_make(&b, 4, 64, 16, 8, 128, KV_BF16, 2, 2); /* NHD block-major */
    kv_plan *p = NULL;
    struct kv_plan_stats st;
    assert_int_equal(kv_plan_create(&s.lo, &s.lo, NULL, &p), KV_OK);
    assert_int_equal(kv_plan_stats_get(p, &st), KV_OK);
    /* one block across 4 layers, K and V: 8 runs of a whole block at one pitch */
    assert_int_equal(st.window_tokens, 16);
    assert_int_equal(st.rows, 4 * 2 * 16 * 8);
    assert_int_equal(st.runs, 8);
    assert_int_equal(st.copies, 1);
    assert_int_equal(st.window_bytes, 4 * 2 * 16 * 8 * 128 * 2);
    kv_plan_destroy(p);
    assert_int_equal(kv_plan_create(&b.lo, &b.lo, NULL, &p), KV_OK);
    assert_int_equal(kv_plan_stats_get(p, &st), KV_OK);
    assert_int_equal(st.runs, 1); /* block-major: the block is contiguous across layers */
    assert_int_equal(st.copies, 1);
    kv_plan_destroy(p);
    /* 16-token pages into 32-token pages: a window of 2 source blocks, 1 destination */
    struct kvt_side w;
    kvt_side_make(&w, 4, 64, 32, 8, 128, KV_BF16, 0, 3);
    assert_int_equal(kv_plan_create(&s.lo, &w.lo, NULL, &p), KV_OK);
    assert_int_equal(kv_plan_stats_get(p, &st), KV_OK);
    assert_int_equal(st.window_tokens, 32);
    assert_int_equal(st.window_src_blocks, 2);
    assert_int_equal(st.window_dst_blocks, 1);
    assert_int_equal(st.runs, 16);
    kv_plan_destroy(p);
    /* one layer of the 4, layer-major to itself: K and V of that layer, a
     * 2-D copy of 2 rows; rows and bytes a quarter of the whole plan's */
    struct kv_plan_config one = KV_PLAN_CONFIG_INIT;
    one.src_layer0 = 3;
    one.dst_layer0 = 1;
    one.n_layers = 1;
    assert_int_equal(kv_plan_create(&s.lo, &s.lo, &one, &p), KV_OK);
    assert_int_equal(kv_plan_stats_get(p, &st), KV_OK);
    assert_int_equal(st.rows, 2 * 16 * 8);
    assert_int_equal(st.runs, 2);
    assert_int_equal(st.copies, 1);
    assert_int_equal(st.window_bytes, 2 * 16 * 8 * 128 * 2);
    kv_plan_destroy(p);
    /* block-major, layers 1..2 of 4: one contiguous run of 2 layers */
    one.src_layer0 = one.dst_layer0 = 1;
    one.n_layers = 2;
    assert_int_equal(kv_plan_create(&b.lo, &b.lo, &one, &p), KV_OK);
    assert_int_equal(kv_plan_stats_get(p, &st), KV_OK);
    assert_int_equal(st.runs, 1);
    assert_int_equal(st.window_bytes, 2 * 2 * 16 * 8 * 128 * 2);
    kv_plan_destroy(p);
    kvt_side_free(&s);
    kvt_side_free(&b);
    kvt_side_free(&w);
}

#define REFUSED(call, want, frag)                                                                  \
    do {                                                                                           \
        kv_status st_ = (call);                                                                    \
        if (st_ != (want) || !strstr(kv_last_error(), (frag)))                                     \
            fail_msg("%s: got %s (%s), want %s with '%s'", #call, kv_status_name(st_),             \
                     kv_last_error(), kv_status_name(want), frag);                                 \
    } while (0)

static void test_plan_refusals(void **state)
{
    (void)state;
    struct kvt_side s, d, o;
    kvt_side_make(&s, 2, 40, 16, 4, 16, KV_BF16, 0, 5);
    kvt_side_make(&d, 2, 40, 16, 4, 16, KV_BF16, 1, 6);
    kvt_side_make(&o, 3, 40, 16, 4, 16, KV_F16, 0, 7);
    kv_plan *p = NULL;
    REFUSED(kv_plan_create(NULL, &d.lo, NULL, &p), KV_ERR_NULL, "src");
    REFUSED(kv_plan_create(&s.lo, &o.lo, NULL, &p), KV_ERR_INVALID_ARG, "dtype");
    struct kv_layout bad = s.lo;
    bad.stride_token_bytes += 2;
    REFUSED(kv_plan_create(&bad, &d.lo, NULL, &p), KV_ERR_INVALID_ARG, "stride_token_bytes");
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = 3;
    pc.n_heads = 2;
    REFUSED(kv_plan_create(&s.lo, &d.lo, &pc, &p), KV_ERR_BAD_SHAPE, "outside");
    pc.struct_size = 8;
    REFUSED(kv_plan_create(&s.lo, &d.lo, &pc, &p), KV_ERR_INVALID_ARG, "struct_size");
    /* the config before layer ranges (4 fields): built against older headers */
    pc.struct_size = offsetof(struct kv_plan_config, src_layer0);
    REFUSED(kv_plan_create(&s.lo, &d.lo, &pc, &p), KV_ERR_INVALID_ARG, "other kvcache headers");
    assert_null(p);

    assert_int_equal(kv_plan_create(&s.lo, &d.lo, NULL, &p), KV_OK);
    unsigned char *before = malloc((size_t)d.lo.total_bytes);
    assert_non_null(before);
    memcpy(before, d.mem, (size_t)d.lo.total_bytes);
    uint32_t a[3] = {39, 17, 2}, b3[3] = {30, 31, 32}, dup[3] = {5, 9, 5}, far[3] = {1, 40, 2};
    REFUSED(kv_plan_copy(p, s.pc, a, 2, d.pc, b3, 3, 40), KV_ERR_BAD_SHAPE, "needs 3");
    REFUSED(kv_plan_copy(p, s.pc, a, 3, d.pc, far, 3, 40), KV_ERR_OUT_OF_BOUNDS,
            "dst_blocks[1] = 40");
    REFUSED(kv_plan_copy(p, s.pc, a, 3, d.pc, dup, 3, 40), KV_ERR_OVERLAP, "listed twice");
    REFUSED(kv_plan_copy(p, d.pc, a, 3, d.pc, b3, 3, 40), KV_ERR_INVALID_ARG, "fingerprint");
    struct kv_paged_cache dev = d.pc;
    dev.mem = KV_MEM_DEVICE;
    REFUSED(kv_plan_copy(p, s.pc, a, 3, dev, b3, 3, 40), KV_ERR_INVALID_ARG, "device");
    struct kv_paged_cache part = d.pc;
    part.base = s.mem + 64; /* inside the source storage, not the same cache */
    part.storage_bytes = (size_t)d.lo.total_bytes;
    REFUSED(kv_plan_copy(p, s.pc, a, 3, part, b3, 3, 40), KV_ERR_OVERLAP, "overlap");
    assert_memory_equal(before, d.mem, (size_t)d.lo.total_bytes);
    kv_plan_destroy(p);
    /* one cache on both sides (compaction): a block in both lists is refused */
    assert_int_equal(kv_plan_create(&s.lo, &s.lo, NULL, &p), KV_OK);
    uint32_t x[2] = {3, 4}, y[2] = {4, 8};
    memcpy(before, s.mem, (size_t)s.lo.total_bytes);
    REFUSED(kv_plan_copy(p, s.pc, x, 2, s.pc, y, 2, 20), KV_ERR_OVERLAP, "both a source");
    assert_memory_equal(before, s.mem, (size_t)s.lo.total_bytes);
    uint32_t z[2] = {10, 11};
    assert_int_equal(kv_plan_copy(p, s.pc, x, 2, s.pc, z, 2, 32), KV_OK);
    assert_memory_equal(s.mem + s.lo.stride_block_bytes * 10, s.mem + s.lo.stride_block_bytes * 3,
                        (size_t)s.lo.block_bytes);
    kv_plan_destroy(p);
    free(before);
    kvt_side_free(&s);
    kvt_side_free(&d);
    kvt_side_free(&o);
}

/* Layer ranges outside a layout, negative or overflowing, n_layers 0
 * between different layer counts or with an offset: refused at create with
 * the values named, *out untouched; a copy with a layer-range plan on a
 * cache of another layer count is refused with the destination untouched. */
static void test_plan_layer_range_refusals(void **state)
{
    (void)state;
    struct kvt_side s, d;
    kvt_side_make(&s, 3, 40, 16, 4, 16, KV_BF16, 0, 5); /* L 3 */
    kvt_side_make(&d, 5, 40, 8, 4, 16, KV_BF16, 3, 6);  /* L 5 */
    struct {
        int64_t sl0, dl0, nl;
        const char *frag;
    } bad[] = {
        {2, 0, 2, "layers [2, 2+2) of a source with L 3 onto [0, 0+2) of a destination with L 5"},
        {0, 4, 2, "layers [0, 0+2) of a source with L 3 onto [4, 4+2) of a destination with L 5"},
        {0, 0, 4, "layers [0, 0+4) of a source with L 3"},
        {-1, 0, 1, "layers [-1, -1+1)"},
        {0, -2, 1, "onto [-2, -2+1)"},
        {0, 0, -1, "+-1)"},
        {INT64_MAX, 0, 1, "outside a layout"},
        {0, 0, INT64_MAX, "outside a layout"},
        {1, 1, INT64_MAX, "outside a layout"},
        {0, 0, 0,
         "n_layers 0 (every layer) needs equal layer counts and layer offsets 0: "
         "source L 3 destination L 5, src_layer0 0 dst_layer0 0"},
    };
    kv_plan *p = (kv_plan *)&bad; /* a sentinel: a refusal sets *out NULL */
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = bad[i].sl0;
        pc.dst_layer0 = bad[i].dl0;
        pc.n_layers = bad[i].nl;
        REFUSED(kv_plan_create(&s.lo, &d.lo, &pc, &p), KV_ERR_BAD_SHAPE, bad[i].frag);
        assert_null(p);
    }
    /* n_layers 0 with equal L but an offset */
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.dst_layer0 = 1;
    REFUSED(kv_plan_create(&s.lo, &s.lo, &pc, &p), KV_ERR_BAD_SHAPE,
            "source L 3 destination L 3, src_layer0 0 dst_layer0 1");
    /* a valid range, then a request on a cache of the other layer count */
    pc.src_layer0 = 1;
    pc.dst_layer0 = 3;
    pc.n_layers = 2;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, &pc, &p), KV_OK);
    struct kvt_side d3;
    kvt_side_make(&d3, 3, 40, 8, 4, 16, KV_BF16, 3, 7); /* d's layout with L 3 */
    unsigned char *before = malloc((size_t)d3.lo.total_bytes);
    assert_non_null(before);
    memcpy(before, d3.mem, (size_t)d3.lo.total_bytes);
    uint32_t a[2] = {39, 20}, b4[4] = {30, 1, 17, 5};
    REFUSED(kv_plan_copy(p, s.pc, a, 2, d3.pc, b4, 4, 32), KV_ERR_INVALID_ARG, "fingerprint");
    assert_memory_equal(before, d3.mem, (size_t)d3.lo.total_bytes);
    free(before);
    /* ... and the right cache takes it */
    assert_int_equal(kv_plan_copy(p, s.pc, a, 2, d.pc, b4, 4, 32), KV_OK);
    kv_plan_destroy(p);
    kvt_side_free(&s);
    kvt_side_free(&d);
    kvt_side_free(&d3);
}

/* The CUDA entry shares the CPU executor's validator: every bad request of
 * test_plan_refusals gets the status kv_plan_copy gives it, on caches that
 * say they are device memory (host pointers: nothing may be launched), and
 * the destination stays bit-identical. A valid request on a host without a
 * GPU (or a build without CUDA) is KV_ERR_UNSUPPORTED naming the entry;
 * where a GPU is expected (KV_EXPECT_GPU=1) valid requests are left to
 * tests/gpu/test_gpu_plan.c. */
static void test_plan_cuda_entry_validates_first(void **state)
{
    (void)state;
    const char *e = getenv("KV_EXPECT_GPU");
    const bool gpu = e && e[0] == '1';
    struct kvt_side s, d;
    kvt_side_make(&s, 2, 40, 16, 4, 16, KV_BF16, 0, 5);
    kvt_side_make(&d, 2, 40, 16, 4, 16, KV_BF16, 1, 6);
    kv_plan *p = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, NULL, &p), KV_OK);
    unsigned char *before = malloc((size_t)d.lo.total_bytes);
    assert_non_null(before);
    memcpy(before, d.mem, (size_t)d.lo.total_bytes);
    struct kv_paged_cache sd = s.pc, dd = d.pc, part = d.pc;
    sd.mem = dd.mem = part.mem = KV_MEM_DEVICE;
    part.base = s.mem + 64; /* inside the source storage, not the same cache */
    uint32_t a[3] = {39, 17, 2}, b3[3] = {30, 31, 32}, dup[3] = {5, 9, 5}, far[3] = {1, 40, 2};
    struct {
        struct kv_paged_cache cs, cd, hs, hd; /* CUDA-side caches, their host twins */
        const uint32_t *sid, *did;
        uint32_t ns, nd;
        uint64_t T;
        kv_status want;
        const char *frag;
    } bad[] = {
        {sd, dd, s.pc, d.pc, a, b3, 2, 3, 40, KV_ERR_BAD_SHAPE, "needs 3"},
        {sd, dd, s.pc, d.pc, a, far, 3, 3, 40, KV_ERR_OUT_OF_BOUNDS, "dst_blocks[1] = 40"},
        {sd, dd, s.pc, d.pc, a, dup, 3, 3, 40, KV_ERR_OVERLAP, "listed twice"},
        {dd, dd, d.pc, d.pc, a, b3, 3, 3, 40, KV_ERR_INVALID_ARG, "fingerprint"},
        {sd, part, s.pc, d.pc, a, b3, 3, 3, 40, KV_ERR_OVERLAP, "overlap"},
        {sd, dd, s.pc, d.pc, NULL, b3, 3, 3, 40, KV_ERR_NULL, "src_blocks is NULL"},
    };
    bad[4].hd = part, bad[4].hd.mem = KV_MEM_HOST;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const kv_status cpu = kv_plan_copy(p, bad[i].hs, bad[i].sid, bad[i].ns, bad[i].hd,
                                           bad[i].did, bad[i].nd, bad[i].T);
        assert_int_equal(cpu, bad[i].want);
        REFUSED(kv_plan_copy_cuda(p, bad[i].cs, bad[i].sid, bad[i].ns, bad[i].cd, bad[i].did,
                                  bad[i].nd, bad[i].T, NULL),
                bad[i].want, bad[i].frag);
        assert_true(strstr(kv_last_error(), "kv_plan_copy_cuda") != NULL);
    }
    REFUSED(kv_plan_copy_cuda(NULL, sd, a, 3, dd, b3, 3, 40, NULL), KV_ERR_NULL, "plan is NULL");
    /* the memory kind: the CUDA entry takes device or pinned, not host */
    REFUSED(kv_plan_copy_cuda(p, s.pc, a, 3, dd, b3, 3, 40, NULL), KV_ERR_INVALID_ARG,
            "host memory");
    REFUSED(kv_plan_copy(p, sd, a, 3, d.pc, b3, 3, 40), KV_ERR_INVALID_ARG, "device memory");
    if (!gpu) {
        REFUSED(kv_plan_copy_cuda(p, sd, a, 3, dd, b3, 3, 40, NULL), KV_ERR_UNSUPPORTED,
                "kv_plan_copy_cuda");
        REFUSED(kv_plan_copy_cuda(p, sd, a, 0, dd, b3, 0, 0, NULL), KV_ERR_UNSUPPORTED,
                "kv_plan_copy_cuda"); /* no work still says there is no device */
        struct kv_paged_cache sp = sd, dp = dd;
        sp.mem = dp.mem = KV_MEM_PINNED;
        REFUSED(kv_plan_copy_cuda(p, sp, a, 3, dp, b3, 3, 40, NULL), KV_ERR_UNSUPPORTED,
                "kv_plan_copy_cuda");
    }
    assert_memory_equal(before, d.mem, (size_t)d.lo.total_bytes);
    kv_plan_destroy(p);
    free(before);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

/* One 2-D copy on the CPU, row by row. */
static void exec_frag(const struct kv__plan_frag *f)
{
    for (int64_t y = 0; y < f->height; y++)
        memcpy(f->dst + y * f->dst_pitch, f->src + y * f->src_pitch, (size_t)f->width);
}

/* The schedule executed on the CPU: the wide copies, then every narrow item
 * through kv__plan_narrow_frag (what each CUDA block of the kernel does).
 * Checks the split on the way: widths on the right side of the threshold,
 * the alignment summary (the kernel's vector divides every narrow address,
 * width and pitch), the item and byte counts; returns the bytes moved. */
static int64_t exec_sched(const struct kv__plan_sched *sc, int64_t thr)
{
    assert_int_equal(sc->wide_bytes, thr);
    int64_t wb = 0, nb = 0, nn = 0;
    uint64_t align = 0;
    for (int64_t i = 0; i < sc->n_wide; i++) {
        const struct kv__plan_frag *f = &sc->wide[i];
        if (f->width < thr)
            fail_msg("wide entry %lld has width %lld < %lld", (long long)i, (long long)f->width,
                     (long long)thr);
        assert_true(f->height == 1 || (f->src_pitch >= f->width && f->dst_pitch >= f->width));
        wb += f->width * f->height;
        exec_frag(f);
    }
    for (int64_t c = 0; c < sc->narrow.n_copies; c++)
        if (sc->narrow.copies[c].width >= thr)
            fail_msg("narrow copy %lld has width %lld >= %lld", (long long)c,
                     (long long)sc->narrow.copies[c].width, (long long)thr);
    for (int64_t w = 0; w < sc->narrow.n_items; w++) {
        struct kv__plan_frag f;
        if (!kv__plan_narrow_frag(&sc->narrow, w, &f))
            continue;
        nn++;
        nb += f.width * f.height;
        align |= (uint64_t)(uintptr_t)f.src | (uint64_t)(uintptr_t)f.dst | (uint64_t)f.width |
                 (uint64_t)f.src_pitch | (uint64_t)f.dst_pitch;
        exec_frag(&f);
    }
    for (uint64_t v = 16; v > 1; v /= 2)
        if ((sc->narrow_align & (v - 1)) == 0 && (align & (v - 1)) != 0)
            fail_msg("narrow_align 0x%llx allows %llu-byte vectors, an item's bits 0x%llx do not",
                     (unsigned long long)sc->narrow_align, (unsigned long long)v,
                     (unsigned long long)align);
    assert_int_equal(nn, sc->n_narrow);
    assert_int_equal(wb, sc->wide_total);
    assert_int_equal(nb, sc->narrow_total);
    return wb + nb;
}

/* One layout pair: kv_plan_copy into d, the schedule (threshold thr, 0 for
 * the default) executed on the CPU into a twin of d; whole pools equal. */
/* Layers of a schedule test: source and destination L, the layer range. */
struct sched_layers {
    int64_t Ls, Ld, sl0, dl0, nl;
};

static void sched_pair_lay(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                           int64_t sh0, int64_t dh0, int64_t nh, int64_t D, kv_dtype dt, uint64_t T,
                           int64_t thr, uint64_t seed, int64_t src_shift, struct sched_layers ly,
                           int64_t *n_wide, int64_t *n_narrow)
{
    struct kvt_side s, d;
    /* pools of hundreds of blocks, tens where the blocks are large */
    kvt_side_make(&s, ly.Ls, Hs * D > 256 ? 40 : 300, Ns, Hs, D, dt, sbits, seed);
    kvt_side_make(&d, ly.Ld, Hd * D > 256 ? 36 : 260, Nd, Hd, D, dt, dbits, seed + 1);
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = sh0;
    pc.dst_head0 = dh0;
    pc.n_heads = nh;
    pc.src_layer0 = ly.sl0;
    pc.dst_layer0 = ly.dl0;
    pc.n_layers = ly.nl;
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, &pc, &plan), KV_OK);
    uint64_t rng = seed * 11 + 5;
    const uint32_t ns = (uint32_t)((T + (uint64_t)Ns - 1) / (uint64_t)Ns);
    const uint32_t nd = (uint32_t)((T + (uint64_t)Nd - 1) / (uint64_t)Nd);
    uint32_t sid[128], did[128];
    assert_true(ns <= 128 && nd <= 128);
    kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, nd, did);
    const size_t dbytes = (size_t)d.lo.total_bytes;
    unsigned char *twin = aligned_alloc(64, (dbytes + 63) / 64 * 64);
    assert_non_null(twin);
    memcpy(twin, d.mem, dbytes);
    unsigned char *ref = malloc(dbytes);
    assert_non_null(ref);
    memcpy(ref, d.mem, dbytes);
    struct kv_paged_cache tc = d.pc;
    tc.base = twin;
    /* the source pool moved src_shift bytes off its 64-byte alignment */
    unsigned char *shifted = malloc((size_t)s.lo.total_bytes + 64 + (size_t)src_shift);
    assert_non_null(shifted);
    unsigned char *s0 = shifted + (64 - (uintptr_t)shifted % 64) + src_shift;
    memcpy(s0, s.mem, (size_t)s.lo.total_bytes);
    free(s.mem);
    s.mem = s0;
    s.pc.base = s0;

    struct kv__plan_sched sc;
    assert_int_equal(
        kv__plan_cuda_schedule("test", plan, &s.pc, sid, ns, &tc, did, nd, T, thr, &sc), KV_OK);
    const int64_t moved = exec_sched(&sc, thr > 0 ? thr : KV_PLAN_CUDA_WIDE_BYTES);
    assert_int_equal(kv_plan_copy(plan, s.pc, sid, ns, d.pc, did, nd, T), KV_OK);
    const int64_t i = kvt_first_diff(d.mem, twin, (int64_t)dbytes);
    if (i >= 0)
        fail_msg("bits %d->%d N %lld->%lld T %llu thr %lld: the schedule's destination byte %lld "
                 "differs from kv_plan_copy's (of %zu)",
                 sbits, dbits, (long long)Ns, (long long)Nd, (unsigned long long)T, (long long)thr,
                 (long long)i, dbytes);
    /* a request of whole windows moves window_bytes per window */
    struct kv_plan_stats ps;
    assert_int_equal(kv_plan_stats_get(plan, &ps), KV_OK);
    if (T % (uint64_t)ps.window_tokens == 0)
        assert_int_equal(moved, (int64_t)(T / (uint64_t)ps.window_tokens) * ps.window_bytes);
    /* and both equal the config-only reference (the layers and heads
     * outside the ranges as they were) */
    kvt_ref_move_layers(&s, sid, ns, &d, did, nd, ly.sl0, ly.dl0, ly.nl ? ly.nl : ly.Ls, sh0, dh0,
                        nh ? nh : Hs, ref);
    assert_int_equal(kvt_first_diff(ref, twin, (int64_t)dbytes), -1);
    free(ref);
    *n_wide = sc.n_wide;
    *n_narrow = sc.n_narrow;
    kv__plan_sched_free(&sc);
    free(twin);
    kv_plan_destroy(plan);
    free(shifted);
    kvt_side_free(&d);
}

static void sched_pair_at(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                          int64_t sh0, int64_t dh0, int64_t nh, int64_t D, kv_dtype dt, uint64_t T,
                          int64_t thr, uint64_t seed, int64_t src_shift, int64_t *n_wide,
                          int64_t *n_narrow)
{
    sched_pair_lay(sbits, dbits, Ns, Nd, Hs, Hd, sh0, dh0, nh, D, dt, T, thr, seed, src_shift,
                   (struct sched_layers){3, 3, 0, 0, 0}, n_wide, n_narrow);
}

static void sched_pair(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                       int64_t sh0, int64_t dh0, int64_t nh, int64_t D, kv_dtype dt, uint64_t T,
                       int64_t thr, uint64_t seed, int64_t *n_wide, int64_t *n_narrow)
{
    sched_pair_at(sbits, dbits, Ns, Nd, Hs, Hd, sh0, dh0, nh, D, dt, T, thr, seed, 0, n_wide,
                  n_narrow);
}

static void test_plan_cuda_schedule_matches_cpu(void **state)
{
    (void)state;
    int64_t nw, nn;
    uint64_t seed = 5000;
    static const int64_t thr[4] = {0, 1, 64, INT64_MAX};
    /* every layout pair, page sizes 8/16/32, partial last windows, at four
     * thresholds: all wide, the default, a middle one, all narrow */
    for (int sb = 0; sb < 16; sb++)
        for (int db = 0; db < 16; db += 3) {
            static const int64_t Ns[3] = {8, 16, 32};
            const int64_t a = Ns[(sb + db) % 3], b = Ns[(sb * 3 + db) % 3];
            const uint64_t T = 1 + (uint64_t)((sb * 37 + db * 11) % 400);
            sched_pair(sb, db, a, b, 4, 4, 0, 0, 0, 16, KV_BF16, T, thr[(sb + db) % 4], seed++, &nw,
                       &nn);
        }
    /* head slices (TP 1 -> TP 2 and back), odd element counts (byte path) */
    for (int i = 0; i < 16; i += 5) {
        sched_pair(i, 15 - i, 16, 32, 4, 2, 2, 0, 2, 16, KV_BF16, 16 * 7, 0, seed++, &nw, &nn);
        sched_pair(15 - i, i, 16, 16, 2, 4, 0, 2, 2, 16, KV_F32, 33, 64, seed++, &nw, &nn);
        sched_pair(i, i, 8, 16, 6, 5, 1, 2, 3, 13, KV_FP8_E4M3, 100, 0, seed++, &nw, &nn);
    }
}

/* The CUDA schedule of layer-range plans (the same table, so the same
 * ranges): every layout pair at the four thresholds, a random range between
 * different layer counts, executed on the CPU, equal to kv_plan_copy and to
 * the config-only reference; one layer of a layer-major cache to itself is
 * one wide 2-D copy of 2 rows per block. */
static void test_plan_cuda_schedule_layer_ranges(void **state)
{
    (void)state;
    int64_t nw, nn;
    uint64_t seed = 7000, rng = 17;
    static const int64_t thr[4] = {0, 1, 64, INT64_MAX};
    static const int64_t Ns[3] = {8, 16, 32};
    for (int sb = 0; sb < 16; sb++)
        for (int db = (sb % 3); db < 16; db += 3) {
            struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
            struct sched_layers ly;
            draw_layers(&rng, &ly.Ls, &ly.Ld, &pc);
            ly.sl0 = pc.src_layer0;
            ly.dl0 = pc.dst_layer0;
            ly.nl = pc.n_layers;
            const uint64_t T = 1 + (uint64_t)((sb * 31 + db * 7) % 300);
            sched_pair_lay(sb, db, Ns[(sb + db) % 3], Ns[(2 * sb + db) % 3], 4, 4, 0, 0, 0, 16,
                           KV_BF16, T, thr[(sb + 2 * db) % 4], seed++, 0, ly, &nw, &nn);
        }
    /* layer 2 of 4 onto layer 0 of 1 (a transfer of one layer), layer-major
     * NHD, 32 KiB per plane and block: 5 blocks, 5 wide copies */
    sched_pair_lay(0, 0, 16, 16, 8, 8, 0, 0, 0, 128, KV_BF16, 80, 0, 11, 0,
                   (struct sched_layers){4, 1, 2, 0, 1}, &nw, &nn);
    assert_int_equal(nw, 5);
    assert_int_equal(nn, 0);
}

/* What the threshold says, on plans whose copies are known: a layer-major
 * NHD cache to itself is one 2-D copy per block of 2L rows of a whole
 * layer's block (16 x 8 x 128 x 2 = 32 KiB: wide); NHD -> HND is head rows
 * of D x 2 = 256 bytes (narrow); a request over 3.5 windows of 16 -> 32
 * pages (partial last window) skips the half-window's missing block. */
static void test_plan_cuda_schedule_split(void **state)
{
    (void)state;
    int64_t nw, nn;
    /* same layout, layer-major: 5 blocks, 5 wide copies, nothing for the kernel */
    sched_pair(0, 0, 16, 16, 8, 8, 0, 0, 0, 128, KV_BF16, 80, 0, 1, &nw, &nn);
    assert_int_equal(nw, 5);
    assert_int_equal(nn, 0);
    /* ... and with a threshold above a block's 32 KiB, all of it is the kernel's */
    sched_pair(0, 0, 16, 16, 8, 8, 0, 0, 0, 128, KV_BF16, 80, (32 << 10) + 1, 1, &nw, &nn);
    assert_int_equal(nw, 0);
    assert_int_equal(nn, 5);
    /* NHD -> HND: 256-byte head rows only, all narrow at the default threshold */
    sched_pair(0, 1, 16, 16, 8, 8, 0, 0, 0, 128, KV_BF16, 80, 0, 2, &nw, &nn);
    assert_int_equal(nw, 0);
    assert_true(nn > 0);
    /* block-major to itself: a whole block (3 layers x 2 x 32 KiB) per copy */
    sched_pair(2, 2, 16, 16, 8, 8, 0, 0, 0, 128, KV_BF16, 50, 0, 3, &nw, &nn);
    assert_int_equal(nw, 4);
    assert_int_equal(nn, 0);
    /* 16 -> 32 pages, layer-major NHD: per window 2 source blocks x (3 layers x
     * K/V) runs of 16 tokens at constant pitches, one 2-D copy each; 3.5 windows = 7 source blocks,
     * 4 destination */
    sched_pair(0, 0, 16, 32, 8, 8, 0, 0, 0, 128, KV_BF16, 112, 0, 4, &nw, &nn);
    assert_int_equal(nn, 0);
    assert_int_equal(nw, 7); /* 4 windows x 2 source blocks, less the missing 8th */
    /* HND layer-major (packed) into NHD block-major: whole-head token runs
     * (wide at 512) beside head rows (narrow) in one request, both parts */
    sched_pair(3, 2, 32, 32, 8, 8, 0, 0, 0, 128, KV_BF16, 32 * 4 + 9, 512, 8, &nw, &nn);
    assert_true(nw > 0 && nn > 0);
    sched_pair(3, 10, 16, 16, 8, 8, 0, 0, 0, 128, KV_BF16, 16 * 3 + 1, 512, 9, &nw, &nn);
    assert_true(nw > 0 && nn > 0);
    /* a source pool 4 and 2 bytes off alignment: the kernel's vectors follow
     * (exec_sched checks narrow_align against every item's addresses) */
    sched_pair_at(0, 1, 16, 16, 8, 8, 0, 0, 0, 128, KV_BF16, 40, 0, 6, 4, &nw, &nn);
    sched_pair_at(1, 0, 16, 8, 8, 8, 0, 0, 0, 128, KV_BF16, 40, 0, 7, 2, &nw, &nn);
    assert_true(nn > 0);
    /* a head slice of NHD: 2 heads x 128 x 2 = 512-byte runs, narrow */
    sched_pair(0, 0, 16, 16, 8, 2, 4, 0, 2, 128, KV_BF16, 40, 0, 5, &nw, &nn);
    assert_int_equal(nw, 0);
    assert_true(nn > 0);
}

/* Audit (2026-12-05): two layouts kv_layout_init accepts (no memory needed)
 * whose plan has more rows than 64 bits of bytes hold: refused by name, not
 * a wrapped allocation written past (K-only fp8, 3 layers of (2^59 + 1) / 3
 * heads; the pack plan of it) nor a signed overflow (2^26 layers and heads
 * over a 65280-token window). */
static void mk_huge(struct kv_layout *lo, int64_t L, int64_t H, int64_t N)
{
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = L;
    c.num_blocks = 1;
    c.block_tokens = N;
    c.num_heads = H;
    c.head_dim = 1;
    c.dtype = KV_FP8_E4M3;
    c.k_only = true;
    assert_int_equal(kv_layout_init(&c, lo), KV_OK);
}

static void test_plan_rows_do_not_wrap(void **state)
{
    (void)state;
    struct kv_layout a, s, d;
    mk_huge(&a, 3, (((int64_t)1 << 59) + 1) / 3, 1);
    kv_plan *p = NULL;
    assert_int_equal(kv_plan_create(&a, &a, NULL, &p), KV_ERR_OVERFLOW);
    assert_null(p);
    assert_non_null(strstr(kv_last_error(), "192153584101141163 heads"));
    assert_int_equal(kv_pack_plan_create(&a, NULL, &p), KV_ERR_OVERFLOW);
    assert_null(p);
    mk_huge(&s, (int64_t)1 << 26, (int64_t)1 << 26, 256);
    mk_huge(&d, (int64_t)1 << 26, (int64_t)1 << 26, 255);
    assert_int_equal(kv_plan_create(&s, &d, NULL, &p), KV_ERR_OVERFLOW);
    assert_non_null(strstr(kv_last_error(), "65280 window tokens"));
    assert_null(p);
}

/* Audit (2026-12-05): a source whose storage_bytes wraps the address space
 * (SIZE_MAX) hid a destination inside its arena from the overlap check, and
 * the copy ran on overlapping memory: now refused where the cache is
 * checked, and the same source with its true size is KV_ERR_OVERLAP. */
static void test_plan_storage_wrapping_refused(void **state)
{
    (void)state;
    struct kv_layout a, b;
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = 1;
    c.num_blocks = 4;
    c.block_tokens = 4;
    c.num_heads = 2;
    c.head_dim = 64;
    c.dtype = KV_F16;
    c.arrange = KV_ARRANGE_BLOCK_MAJOR;
    assert_int_equal(kv_layout_init(&c, &a), KV_OK);
    c.num_blocks = 3;
    assert_int_equal(kv_layout_init(&c, &b), KV_OK);
    char *buf = aligned_alloc(64, (size_t)a.total_bytes);
    memset(buf, 1, (size_t)a.total_bytes);
    char *want = malloc((size_t)a.total_bytes);
    memcpy(want, buf, (size_t)a.total_bytes);
    kv_plan *p = NULL;
    assert_int_equal(kv_plan_create(&a, &b, NULL, &p), KV_OK);
    const uint32_t sb[2] = {0, 1}, db[2] = {0, 1};
    struct kv_paged_cache s = {.layout = a, .base = buf, .storage_bytes = (size_t)a.total_bytes};
    const struct kv_paged_cache d = {.layout = b,
                                     .base = buf + a.stride_block_bytes / 2,
                                     .storage_bytes = (size_t)b.total_bytes};
    assert_int_equal(kv_plan_copy(p, s, sb, 2, d, db, 2, 8), KV_ERR_OVERLAP);
    s.storage_bytes = SIZE_MAX;
    assert_int_equal(kv_plan_copy(p, s, sb, 2, d, db, 2, 8), KV_ERR_OUT_OF_BOUNDS);
    assert_non_null(strstr(kv_last_error(), "wraps the address space"));
    assert_memory_equal(buf, want, (size_t)a.total_bytes); /* nothing written */
    kv_plan_destroy(p);
    free(want);
    free(buf);
}

/* A block list misaligned for its uint32 elements (reading it is undefined
 * behaviour; UBSan aborts) is refused by name before anything is written,
 * by the CPU and the CUDA entry (host lists) alike; the aligned twin of each
 * list copies, so the misalignment is all the refusal is about. */
static void test_plan_misaligned_block_lists(void **state)
{
    (void)state;
    struct kvt_side s, d;
    kvt_side_make(&s, 2, 40, 16, 4, 16, KV_BF16, 0, 5);
    kvt_side_make(&d, 2, 40, 16, 4, 16, KV_BF16, 1, 6);
    kv_plan *p = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, NULL, &p), KV_OK);
    unsigned char *before = malloc((size_t)d.lo.total_bytes);
    assert_non_null(before);
    memcpy(before, d.mem, (size_t)d.lo.total_bytes);
    const uint32_t a[3] = {39, 17, 2}, b[3] = {30, 31, 32};
    _Alignas(uint32_t) char sbuf[1 + sizeof(a)], dbuf[1 + sizeof(b)];
    const uint32_t *sm = kvt_misaligned_u32(sbuf, a, sizeof(a) / sizeof(a[0]));
    const uint32_t *dm = kvt_misaligned_u32(dbuf, b, sizeof(b) / sizeof(b[0]));
    struct kv_paged_cache sd = s.pc, dd = d.pc;
    sd.mem = dd.mem = KV_MEM_DEVICE;
    REFUSED(kv_plan_copy(p, s.pc, sm, 3, d.pc, b, 3, 40), KV_ERR_INVALID_ARG,
            "kv_plan_copy: src_blocks=");
    REFUSED(kv_plan_copy(p, s.pc, a, 3, d.pc, dm, 3, 40), KV_ERR_INVALID_ARG,
            "kv_plan_copy: dst_blocks=");
    REFUSED(kv_plan_copy_cuda(p, sd, sm, 3, dd, b, 3, 40, NULL), KV_ERR_INVALID_ARG,
            "kv_plan_copy_cuda: src_blocks=");
    REFUSED(kv_plan_copy_cuda(p, sd, a, 3, dd, dm, 3, 40, NULL), KV_ERR_INVALID_ARG,
            "kv_plan_copy_cuda: dst_blocks=");
    assert_non_null(strstr(kv_last_error(), "not 4-byte aligned"));
    assert_memory_equal(before, d.mem, (size_t)d.lo.total_bytes); /* nothing written */
    /* a misaligned list of no blocks is never read: accepted */
    assert_int_equal(kv_plan_copy(p, s.pc, sm, 0, d.pc, dm, 0, 0), KV_OK);
    assert_int_equal(kv_plan_copy(p, s.pc, a, 3, d.pc, b, 3, 40), KV_OK);
    kv_plan_destroy(p);
    free(before);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_every_layout_pair),
        cmocka_unit_test(test_plan_head_slices_and_dtypes),
        cmocka_unit_test(test_plan_layer_ranges_every_layout_pair),
        cmocka_unit_test(test_plan_layer_ranges_pipeline_and_one_layer),
        cmocka_unit_test(test_plan_run_counts),
        cmocka_unit_test(test_plan_refusals),
        cmocka_unit_test(test_plan_layer_range_refusals),
        cmocka_unit_test(test_plan_cuda_entry_validates_first),
        cmocka_unit_test(test_plan_cuda_schedule_matches_cpu),
        cmocka_unit_test(test_plan_cuda_schedule_layer_ranges),
        cmocka_unit_test(test_plan_cuda_schedule_split),
        cmocka_unit_test(test_plan_rows_do_not_wrap),
        cmocka_unit_test(test_plan_storage_wrapping_refused),
        cmocka_unit_test(test_plan_misaligned_block_lists),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
