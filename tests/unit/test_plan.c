/*
 * test_plan.c - transfer plans (connector/kv_plan.h): every pair of layouts
 * (NHD/HND x layer-/block-major x padded x packed, page sizes 8/16/32, head
 * slices), block ids spread over pools of hundreds of blocks, checked
 * element by element against offsets computed from the configs alone
 * (kvt_ref_offset_elems), the whole destination pool compared (no stray
 * bytes) and the source unchanged; the run counts of simple plans; every
 * refusal leaves the destination bit-identical.
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

#include "kvt_side.h"
#include "kvtest.h"

static void run_pair(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                     int64_t sh0, int64_t dh0, int64_t nh, kv_dtype dt, uint64_t seed)
{
    const int64_t L = 3, D = 16;
    struct kvt_side s, d;
    kvt_side_make(&s, L, 300, Ns, Hs, D, dt, sbits, seed);
    kvt_side_make(&d, L, 260, Nd, Hd, D, dt, dbits, seed + 1);
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = sh0;
    pc.dst_head0 = dh0;
    pc.n_heads = nh;
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, &pc, &plan), KV_OK);
    uint64_t rng = seed * 7 + 3;
    const uint64_t T = (uint64_t)kvt_range(&rng, 1, 700);
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
    kvt_ref_move(&s, sid, ns, &d, did, nd, sh0, dh0, nh ? nh : Hs, ref);
    kv_status st = kv_plan_copy(plan, s.pc, sid, ns, d.pc, did, nd, T);
    if (st != KV_OK)
        fail_msg("kv_plan_copy: %s: %s", kv_status_name(st), kv_last_error());
    if (memcmp(ref, d.mem, (size_t)d.lo.total_bytes) != 0) {
        int64_t i = 0;
        while (ref[i] == d.mem[i])
            i++;
        fail_msg("bits %d->%d N %lld->%lld heads [%lld+%lld) -> [%lld): destination byte %lld "
                 "differs (of %lld)",
                 sbits, dbits, (long long)Ns, (long long)Nd, (long long)sh0,
                 (long long)(nh ? nh : Hs), (long long)dh0, (long long)i,
                 (long long)d.lo.total_bytes);
    }
    assert_memory_equal(src0, s.mem, (size_t)s.lo.total_bytes);
    free(ref);
    free(src0);
    kv_plan_destroy(plan);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

static void test_plan_every_layout_pair(void **state)
{
    (void)state;
    static const int64_t Ns[3] = {8, 16, 32};
    uint64_t seed = 1;
    for (int sb = 0; sb < 16; sb++)
        for (int db = 0; db < 16; db++) {
            const int64_t a = Ns[(sb + db) % 3], b = Ns[(sb * 3 + db) % 3];
            run_pair(sb, db, a, b, 4, 4, 0, 0, 0, KV_BF16, seed++);
        }
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_every_layout_pair),
        cmocka_unit_test(test_plan_head_slices_and_dtypes),
        cmocka_unit_test(test_plan_run_counts),
        cmocka_unit_test(test_plan_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
