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

#include "kv_mem.h"
#include "kvtest.h"

struct side {
    struct kv_layout_config cfg;
    struct kv_layout lo;
    unsigned char *mem;
    struct kv_paged_cache pc;
};

static void side_make(struct side *s, int64_t L, int64_t B, int64_t N, int64_t H, int64_t D,
                      kv_dtype dt, int bits, uint64_t seed)
{
    kv_layout_config_init(&s->cfg);
    s->cfg.num_layers = L;
    s->cfg.num_blocks = B;
    s->cfg.block_tokens = N;
    s->cfg.num_heads = H;
    s->cfg.head_dim = D;
    s->cfg.dtype = dt;
    s->cfg.order = (bits & 1) ? KV_ORDER_HND : KV_ORDER_NHD;
    s->cfg.arrange = (bits & 2) ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
    s->cfg.block_pad_elems = (bits & 4) ? 24 : 0;
    s->cfg.kv_packed = (bits & 8) != 0;
    assert_int_equal(kv_layout_init(&s->cfg, &s->lo), KV_OK);
    s->mem = kv__mem_alloc_aligned(64, (size_t)s->lo.total_bytes);
    assert_non_null(s->mem);
    uint64_t st = seed;
    for (int64_t i = 0; i < s->lo.total_bytes; i++)
        s->mem[i] = (unsigned char)kvt_rand(&st);
    s->pc = (struct kv_paged_cache){s->lo, s->mem, (size_t)s->lo.total_bytes, KV_MEM_HOST};
}

static void side_free(struct side *s)
{
    kv__mem_free(s->mem);
}

/* n distinct ids of [0, B), shuffled (far from 0 as often as not) */
static void pick_ids(uint64_t *rng, int64_t B, uint32_t n, uint32_t *ids)
{
    uint32_t *all = malloc((size_t)B * sizeof(*all));
    assert_non_null(all);
    for (int64_t i = 0; i < B; i++)
        all[i] = (uint32_t)i;
    for (uint32_t i = 0; i < n; i++) {
        const int64_t j = kvt_range(rng, i, B - 1);
        const uint32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        ids[i] = all[i];
    }
    free(all);
}

static void run_pair(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                     int64_t sh0, int64_t dh0, int64_t nh, kv_dtype dt, uint64_t seed)
{
    const int64_t L = 3, D = 16;
    struct side s, d;
    side_make(&s, L, 300, Ns, Hs, D, dt, sbits, seed);
    side_make(&d, L, 260, Nd, Hd, D, dt, dbits, seed + 1);
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
    pick_ids(&rng, s.lo.num_blocks, ns, sid);
    pick_ids(&rng, d.lo.num_blocks, nd, did);

    unsigned char *ref = malloc((size_t)d.lo.total_bytes);
    unsigned char *src0 = malloc((size_t)s.lo.total_bytes);
    assert_true(ref && src0);
    memcpy(ref, d.mem, (size_t)d.lo.total_bytes);
    memcpy(src0, s.mem, (size_t)s.lo.total_bytes);
    /* the tokens both lists cover move, element by element */
    const int64_t es = s.lo.elem_bytes, heads = nh ? nh : Hs;
    const uint64_t covered = (uint64_t)ns * (uint64_t)Ns < (uint64_t)nd * (uint64_t)Nd
                                 ? (uint64_t)ns * (uint64_t)Ns
                                 : (uint64_t)nd * (uint64_t)Nd;
    for (uint64_t t = 0; t < covered; t++)
        for (int64_t l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < heads; h++) {
                    const int64_t so =
                        kvt_ref_offset_elems(&s.cfg, l, kv, sid[t / (uint64_t)Ns],
                                             (int64_t)(t % (uint64_t)Ns), sh0 + h, 0);
                    const int64_t dof =
                        kvt_ref_offset_elems(&d.cfg, l, kv, did[t / (uint64_t)Nd],
                                             (int64_t)(t % (uint64_t)Nd), dh0 + h, 0);
                    memcpy(ref + dof * es, s.mem + so * es, (size_t)(D * es));
                }
    kv_status st = kv_plan_copy(plan, s.pc, sid, ns, d.pc, did, nd, T);
    if (st != KV_OK)
        fail_msg("kv_plan_copy: %s: %s", kv_status_name(st), kv_last_error());
    if (memcmp(ref, d.mem, (size_t)d.lo.total_bytes) != 0) {
        int64_t i = 0;
        while (ref[i] == d.mem[i])
            i++;
        fail_msg("bits %d->%d N %lld->%lld heads [%lld+%lld) -> [%lld): destination byte %lld "
                 "differs (of %lld)",
                 sbits, dbits, (long long)Ns, (long long)Nd, (long long)sh0, (long long)heads,
                 (long long)dh0, (long long)i, (long long)d.lo.total_bytes);
    }
    assert_memory_equal(src0, s.mem, (size_t)s.lo.total_bytes);
    free(ref);
    free(src0);
    kv_plan_destroy(plan);
    side_free(&s);
    side_free(&d);
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
    struct side s, b;
    side_make(&s, 4, 64, 16, 8, 128, KV_BF16, 0, 1); /* NHD layer-major */
    side_make(&b, 4, 64, 16, 8, 128, KV_BF16, 2, 2); /* NHD block-major */
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
    struct side w;
    side_make(&w, 4, 64, 32, 8, 128, KV_BF16, 0, 3);
    assert_int_equal(kv_plan_create(&s.lo, &w.lo, NULL, &p), KV_OK);
    assert_int_equal(kv_plan_stats_get(p, &st), KV_OK);
    assert_int_equal(st.window_tokens, 32);
    assert_int_equal(st.window_src_blocks, 2);
    assert_int_equal(st.window_dst_blocks, 1);
    assert_int_equal(st.runs, 16);
    kv_plan_destroy(p);
    side_free(&s);
    side_free(&b);
    side_free(&w);
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
    struct side s, d, o;
    side_make(&s, 2, 40, 16, 4, 16, KV_BF16, 0, 5);
    side_make(&d, 2, 40, 16, 4, 16, KV_BF16, 1, 6);
    side_make(&o, 3, 40, 16, 4, 16, KV_F16, 0, 7);
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
    side_free(&s);
    side_free(&d);
    side_free(&o);
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
