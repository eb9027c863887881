/*
 * test_pack.c - pack/unpack in the wire format (connector/pack/kv_pack.h):
 * round trips through every pair of layouts (NHD/HND x layer-/block-major x
 * padded x packed, page sizes 8/16/32, head slices, three dtypes) with block
 * ids spread over pools of hundreds of blocks, checked against a reference
 * move computed from the configs alone and over the whole destination pool;
 * layer ranges (every layout pair with a random range between caches of
 * different layer counts, a pipeline's stages, one layer; the layers
 * outside the range untouched); the bytes of the format at their
 * documented offsets, the payload against an independent gather and XXH3;
 * and corruption: every header byte flipped, truncation at every length, a
 * forged fingerprint, version, magic or layer range, a version 1 buffer, a
 * buffer of other layers than the config or plan unpacks - each refused
 * with the destination bit-identical; payload bytes flipped (first, middle,
 * last block; on each of unpack's three paths, with layer and head ranges)
 * - refused naming the block, the whole pool as before but for the listed
 * blocks' unpacked bytes, zero; the streaming path (non-temporal stores,
 * copy + hash in pieces) against the plain one, bit for bit, with the first
 * and the last payload byte corrupted.
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

#include "kv_pack_int.h" /* kv__pack_nt_min_bytes: the streaming path */
#include "kvt_side.h"
#include "kvtest.h"

#define REFUSED(call, want, frag)                                                                  \
    do {                                                                                           \
        kv_status st_ = (call);                                                                    \
        if (st_ != (want) || !strstr(kv_last_error(), (frag)))                                     \
            fail_msg("%s: got %s (%s), want %s with '%s'", #call, kv_status_name(st_),             \
                     kv_last_error(), kv_status_name(want), frag);                                 \
    } while (0)

static uint64_t rd64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void wr32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void wr64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

#define FIXED 152 /* the fixed header of version 2 */

/* Recompute the header checksum after a deliberate edit (a forged header). */
static void reseal(unsigned char *buf)
{
    const uint64_t at = FIXED + 8 * (uint64_t)rd32(buf + 40);
    wr64(buf + at, XXH3_64bits(buf, at));
}

/* Pack a request of the layers cfg names (NULL: every layer) with plan (or
 * NULL: cfg). */
static unsigned char *pack_range(const kv_plan *plan, const struct kvt_side *s, const uint32_t *ids,
                                 uint32_t n, uint64_t T, const struct kv_plan_config *cfg,
                                 size_t *len)
{
    uint64_t size = 0;
    assert_int_equal(kv_pack_size(&s->lo, cfg, T, &size), KV_OK);
    unsigned char *buf = aligned_alloc(64, (size + 63) / 64 * 64);
    assert_non_null(buf);
    kv_status st = kv_pack(plan, s->pc, ids, n, T, buf, (size_t)size, len, plan ? NULL : cfg);
    if (st != KV_OK)
        fail_msg("kv_pack: %s: %s", kv_status_name(st), kv_last_error());
    assert_int_equal(*len, size);
    return buf;
}

static unsigned char *pack_request(const kv_plan *plan, const struct kvt_side *s,
                                   const uint32_t *ids, uint32_t n, uint64_t T, size_t *len)
{
    return pack_range(plan, s, ids, n, T, NULL, len);
}

/* Pack a request from a source of Ls layers (Bs blocks) and unpack it into
 * a destination of Ld layers (Bd blocks), both with the config pc of the
 * whole transfer (heads and layers), through plans built once or per call;
 * the whole destination pool against the config-only reference, the layers
 * outside the range byte-identical, the source unchanged, the header's
 * layer range and sizes as the range says. */
static void round_trip_cfg(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Ls, int64_t Ld,
                           int64_t Bs, int64_t Bd, int64_t Hs, int64_t Hd,
                           const struct kv_plan_config *cfg, kv_dtype dt, bool plans, int64_t Tmax,
                           uint64_t seed)
{
    const int64_t D = 16;
    struct kvt_side s, d;
    kvt_side_make(&s, Ls, Bs, Ns, Hs, D, dt, sbits, seed);
    kvt_side_make(&d, Ld, Bd, Nd, Hd, D, dt, dbits, seed + 1);
    const struct kv_plan_config pc = *cfg;
    const int64_t sh0 = pc.src_head0, dh0 = pc.dst_head0, nh = pc.n_heads;
    const int64_t sl0 = pc.src_layer0, dl0 = pc.dst_layer0, nl = pc.n_layers ? pc.n_layers : Ls;
    kv_plan *pp = NULL, *up = NULL;
    if (plans) {
        assert_int_equal(kv_pack_plan_create(&s.lo, &pc, &pp), KV_OK);
        assert_int_equal(kv_unpack_plan_create(&s.lo, &d.lo, &pc, &up), KV_OK);
    }
    uint64_t rng = seed * 11 + 5;
    const uint64_t T = (uint64_t)kvt_range(&rng, 1, Tmax);
    const uint32_t ns = (uint32_t)((T + (uint64_t)Ns - 1) / (uint64_t)Ns);
    const uint32_t nd = (uint32_t)((T + (uint64_t)Nd - 1) / (uint64_t)Nd);
    uint32_t sid[128], did[128];
    kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
    kvt_pick_ids(&rng, d.lo.num_blocks, nd, did);
    unsigned char *ref = malloc((size_t)d.lo.total_bytes);
    unsigned char *dst0 = malloc((size_t)d.lo.total_bytes);
    unsigned char *src0 = malloc((size_t)s.lo.total_bytes);
    assert_true(ref && dst0 && src0);
    memcpy(ref, d.mem, (size_t)d.lo.total_bytes);
    memcpy(dst0, d.mem, (size_t)d.lo.total_bytes);
    memcpy(src0, s.mem, (size_t)s.lo.total_bytes);
    kvt_ref_move_layers(&s, sid, ns, &d, did, nd, sl0, dl0, nl, sh0, dh0, nh ? nh : Hs, ref);

    size_t len = 0;
    unsigned char *buf = pack_range(pp, &s, sid, ns, T, &pc, &len);
    struct kv_pack_info info;
    assert_int_equal(kv_pack_inspect(buf, len, &info), KV_OK);
    assert_int_equal(info.n_tokens, T);
    assert_int_equal(info.n_blocks, ns);
    assert_int_equal(info.source.fingerprint, s.lo.fingerprint);
    assert_int_equal(info.total_bytes, len);
    assert_int_equal(info.src_layer0, sl0);
    assert_int_equal(info.n_layers, nl);
    assert_int_equal(info.wire.num_layers, nl);
    /* a block of the payload: the packed layers, K and V, no padding */
    assert_int_equal(info.block_bytes, (uint64_t)(nl * 2 * Ns * Hs * D * s.lo.elem_bytes));
    kv_status st = kv_unpack(up, buf, len, d.pc, did, nd, plans ? NULL : &pc);
    if (st != KV_OK)
        fail_msg("kv_unpack: %s: %s", kv_status_name(st), kv_last_error());
    const int64_t at = kvt_first_diff(ref, d.mem, d.lo.total_bytes);
    if (at >= 0)
        fail_msg("bits %d->%d N %lld->%lld heads [%lld+%lld) -> [%lld) layers [%lld+%lld) of "
                 "%lld -> [%lld) of %lld: destination byte %lld of %lld differs",
                 sbits, dbits, (long long)Ns, (long long)Nd, (long long)sh0,
                 (long long)(nh ? nh : Hs), (long long)dh0, (long long)sl0, (long long)nl,
                 (long long)Ls, (long long)dl0, (long long)Ld, (long long)at,
                 (long long)d.lo.total_bytes);
    /* the destination's other layers, row by row from the config: as before */
    assert_int_equal(kvt_other_layers_changed(&d, did, nd, dl0, nl, d.mem, dst0), 0);
    assert_memory_equal(src0, s.mem, (size_t)s.lo.total_bytes);
    free(buf);
    free(ref);
    free(dst0);
    free(src0);
    kv_plan_destroy(pp);
    kv_plan_destroy(up);
    kvt_side_free(&s);
    kvt_side_free(&d);
}

static void round_trip(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                       int64_t sh0, int64_t dh0, int64_t nh, kv_dtype dt, bool plans, uint64_t seed)
{
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = sh0;
    pc.dst_head0 = dh0;
    pc.n_heads = nh;
    round_trip_cfg(sbits, dbits, Ns, Nd, 3, 3, 300, 260, Hs, Hd, &pc, dt, plans, 700, seed);
}

static void test_pack_every_layout_pair(void **state)
{
    (void)state;
    static const int64_t Ns[3] = {8, 16, 32};
    uint64_t seed = 1;
    for (int sb = 0; sb < 16; sb++)
        for (int db = 0; db < 16; db++) {
            const int64_t a = Ns[(sb + 2 * db) % 3], b = Ns[(sb * 5 + db) % 3];
            round_trip(sb, db, a, b, 4, 4, 0, 0, 0, KV_BF16, (sb + db) % 2 == 0, seed++);
        }
}

static void test_pack_head_slices_and_dtypes(void **state)
{
    (void)state;
    uint64_t seed = 5000;
    for (int i = 0; i < 16; i++) {
        /* TP 1 -> TP 2: heads 2..3 of 4 to a 2-head receiver, and the reverse */
        round_trip(i, 15 - i, 16, i % 2 ? 32 : 8, 4, 2, 2, 0, 2, KV_BF16, i % 2, seed++);
        round_trip(15 - i, i, 16, 16, 2, 4, 0, 2, 2, KV_F32, i % 3 == 0, seed++);
        round_trip(i, i, 8, 16, 6, 5, 1, 2, 3, KV_FP8_E4M3, i % 2 == 0, seed++);
    }
}

/* Every layout pair with a random layer range between a source of 1-5
 * layers and a destination of 1-6 (every 8th: every layer between equal
 * L), plans built once for half of them; every 4th pair also a head
 * slice. */
static void test_pack_layer_ranges_every_layout_pair(void **state)
{
    (void)state;
    static const int64_t Ns[3] = {8, 16, 32};
    uint64_t seed = 9000, rng = 41;
    for (int sb = 0; sb < 16; sb++)
        for (int db = 0; db < 16; db++) {
            const int64_t a = Ns[(sb + db) % 3], b = Ns[(2 * sb + db) % 3];
            struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
            int64_t Ls = kvt_range(&rng, 1, 5), Ld = kvt_range(&rng, 1, 6), Hd = 4;
            if (kvt_range(&rng, 0, 7) == 0) {
                Ld = Ls;
            } else {
                pc.n_layers = kvt_range(&rng, 1, Ls < Ld ? Ls : Ld);
                pc.src_layer0 = kvt_range(&rng, 0, Ls - pc.n_layers);
                pc.dst_layer0 = kvt_range(&rng, 0, Ld - pc.n_layers);
            }
            if ((sb + db) % 4 == 1) { /* heads 2..3 of 4 onto 0..1 of 2 */
                Hd = 2;
                pc.src_head0 = 2;
                pc.n_heads = 2;
            }
            round_trip_cfg(sb, db, a, b, Ls, Ld, 110, 100, 4, Hd, &pc, KV_BF16, (sb + db) % 2 == 0,
                           250, seed++);
        }
}

/* A decoder of 6 layers filled by 3 prefill stages of 2 layers (stage k ->
 * layers [2k, 2k + 2)), and one layer per pack, in three dtypes. */
static void test_pack_layer_ranges_pipeline_and_one_layer(void **state)
{
    (void)state;
    uint64_t seed = 12000;
    for (int k = 0; k < 3; k++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.dst_layer0 = 2 * k;
        pc.n_layers = 2;
        round_trip_cfg(k, 15 - k, 16, 32, 2, 6, 90, 70, 4, 4, &pc, KV_BF16, k % 2, 400, seed++);
    }
    for (int l = 0; l < 4; l++) {
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = l;
        pc.dst_layer0 = 3 - l;
        pc.n_layers = 1;
        round_trip_cfg(4 * l, l, 8, 16, 4, 4, 80, 80, 2, 2, &pc, KV_F32, l % 2, 200, seed++);
        round_trip_cfg(l, 8 + l, 16, 8, 4, 4, 80, 80, 2, 2, &pc, KV_FP8_E4M3, l % 2 == 0, 200,
                       seed++);
    }
}

/* The documented bytes: fields at their offsets, little-endian; the payload
 * equals a gather of each block's data runs in (layer, plane) order from
 * config-only offsets; each checksum is XXH3-64 of its payload block. */
static void test_pack_format_bytes(void **state)
{
    (void)state;
    for (int bits = 0; bits < 32; bits++) {
        /* bits 16..31: layers [1, 3) of 4 packed, else every layer of 2 */
        const bool range = bits >= 16;
        const int64_t L = range ? 4 : 2, l0 = range ? 1 : 0, nl = 2;
        struct kvt_side s;
        kvt_side_make(&s, L, 200, 8, 3, 8, KV_F16, bits % 16, 77 + (uint64_t)bits);
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = l0;
        pc.n_layers = range ? nl : 0;
        pc.dst_layer0 = 3; /* not read by kv_pack */
        pc.n_heads = 1;    /* nor this: a pack carries every head */
        const uint32_t ids[5] = {199, 3, 150, 77, 120};
        const uint64_t T = 37; /* 5 blocks of 8, the last partly used */
        size_t len;
        unsigned char *b = pack_range(NULL, &s, ids, 5, T, &pc, &len);
        assert_memory_equal(b, "KVPACK\r\n", 8);
        assert_int_equal(rd32(b + 8), 2);
        assert_int_equal(rd32(b + 12), FIXED);
        const uint64_t hdr = rd64(b + 16);
        assert_int_equal(hdr, (FIXED + 5 * 8 + 8 + 63) / 64 * 64);
        const int64_t planes = s.cfg.kv_packed ? 1 : 2;
        const uint64_t run = (uint64_t)(8 * 3 * 8 * (s.cfg.kv_packed ? 2 : 1)) * 2;
        const uint64_t bb = (uint64_t)(nl * planes) * run;
        assert_int_equal(rd64(b + 24), 5 * bb);
        assert_int_equal(rd64(b + 32), T);
        assert_int_equal(rd32(b + 40), 5);
        assert_int_equal(rd32(b + 44), 0);
        assert_int_equal(rd64(b + 48), s.lo.fingerprint);
        assert_int_equal(rd64(b + 56), (uint64_t)L);
        assert_int_equal(rd64(b + 64), 200);
        assert_int_equal(rd64(b + 72), 8);
        assert_int_equal(rd64(b + 80), 3);
        assert_int_equal(rd64(b + 88), 8);
        assert_int_equal(rd32(b + 96), (uint32_t)KV_F16);
        assert_int_equal(rd32(b + 100), (uint32_t)s.cfg.order);
        assert_int_equal(rd32(b + 104), (uint32_t)s.cfg.arrange);
        assert_int_equal(rd32(b + 108), s.cfg.kv_packed ? 1 : 0);
        assert_int_equal(rd64(b + 112), (uint64_t)s.lo.block_stride_bytes);
        assert_int_equal(rd64(b + 120), (uint64_t)s.lo.align_bytes);
        assert_int_equal(rd64(b + 128), bb);
        assert_int_equal(rd64(b + 136), (uint64_t)l0);
        assert_int_equal(rd64(b + 144), (uint64_t)nl);
        unsigned char *want = malloc(5 * bb);
        assert_non_null(want);
        for (int i = 0; i < 5; i++) {
            for (int64_t l = 0; l < nl; l++)
                for (int64_t p = 0; p < planes; p++) {
                    const int64_t o = kvt_ref_offset_elems(&s.cfg, l0 + l, p, ids[i], 0, 0, 0) * 2;
                    memcpy(want + (uint64_t)i * bb + (uint64_t)(l * planes + p) * run, s.mem + o,
                           run);
                }
            assert_int_equal(rd64(b + FIXED + 8 * i), XXH3_64bits(want + (uint64_t)i * bb, bb));
        }
        assert_memory_equal(b + hdr, want, 5 * bb);
        assert_int_equal(rd64(b + FIXED + 40), XXH3_64bits(b, FIXED + 40));
        for (uint64_t i = FIXED + 48; i < hdr; i++)
            assert_int_equal(b[i], 0);
        free(want);
        free(b);
        kvt_side_free(&s);
    }
}

/* The pool a failed checksum leaves: a copy of before (d's storage) with
 * what the request would write - layers [sl0, +nl) of s onto [dl0, +nl) of
 * d, heads [sh0, +nh) onto [dh0, ...) - zero, computed from the configs
 * alone: the reference move from a source of zeros. */
static unsigned char *zeroed_ref(const struct kvt_side *s, const uint32_t *sid, uint32_t ns,
                                 const struct kvt_side *d, const uint32_t *did, uint32_t nd,
                                 int64_t sl0, int64_t dl0, int64_t nl, int64_t sh0, int64_t dh0,
                                 int64_t nh, const unsigned char *before)
{
    struct kvt_side z = *s;
    z.mem = calloc(1, (size_t)s->lo.total_bytes);
    unsigned char *ref = malloc((size_t)d->lo.total_bytes);
    assert_true(z.mem && ref);
    memcpy(ref, before, (size_t)d->lo.total_bytes);
    kvt_ref_move_layers(&z, sid, ns, d, did, nd, sl0, dl0, nl, sh0, dh0, nh, ref);
    free(z.mem);
    return ref;
}

/* Each refusal before the payload: the destination pool bit-identical
 * afterwards; a payload block failing its checksum: the pool as `zeroed`,
 * before with the listed blocks' unpacked bytes zero. */
struct corrupt_fixture {
    struct kvt_side s, d;
    uint32_t sid[5], did[3];
    uint64_t T;
    unsigned char *buf, *work, *before, *zeroed;
    size_t len;
    struct kv_pack_info info;
};

static void fixture_make(struct corrupt_fixture *f)
{
    kvt_side_make(&f->s, 2, 120, 8, 2, 8, KV_BF16, 4, 31); /* NHD layer-major padded */
    kvt_side_make(&f->d, 2, 90, 16, 2, 8, KV_BF16, 3, 32); /* HND block-major, N 16 */
    const uint32_t sid[5] = {119, 40, 7, 88, 61}, did[3] = {89, 12, 45};
    memcpy(f->sid, sid, sizeof(sid));
    memcpy(f->did, did, sizeof(did));
    f->T = 40;
    f->buf = pack_request(NULL, &f->s, f->sid, 5, f->T, &f->len);
    f->work = malloc(f->len);
    f->before = malloc((size_t)f->d.lo.total_bytes);
    assert_true(f->work && f->before);
    memcpy(f->before, f->d.mem, (size_t)f->d.lo.total_bytes);
    assert_int_equal(kv_pack_inspect(f->buf, f->len, &f->info), KV_OK);
    f->zeroed = zeroed_ref(&f->s, f->sid, 5, &f->d, f->did, 3, 0, 0, 2, 0, 0, 2, f->before);
}

static void fixture_free(struct corrupt_fixture *f)
{
    free(f->buf);
    free(f->work);
    free(f->before);
    free(f->zeroed);
    kvt_side_free(&f->s);
    kvt_side_free(&f->d);
}

static kv_status unpack_work(struct corrupt_fixture *f, size_t len)
{
    return kv_unpack(NULL, f->work, len, f->d.pc, f->did, 3, NULL);
}

static void assert_untouched(const struct corrupt_fixture *f, const char *what, uint64_t at)
{
    if (memcmp(f->before, f->d.mem, (size_t)f->d.lo.total_bytes) != 0)
        fail_msg("%s at %llu: the destination changed", what, (unsigned long long)at);
}

static void test_pack_corruption(void **state)
{
    (void)state;
    struct corrupt_fixture f;
    fixture_make(&f);
    const uint64_t hdr = f.info.header_bytes, bb = f.info.block_bytes;
    assert_int_equal(f.info.n_blocks, 5);
    /* every header byte, two different flips */
    for (uint64_t i = 0; i < hdr; i++)
        for (int m = 0; m < 2; m++) {
            memcpy(f.work, f.buf, f.len);
            f.work[i] ^= m ? 0x80 : 0x01;
            kv_status st = unpack_work(&f, f.len);
            if (st == KV_OK)
                fail_msg("header byte %llu ^ 0x%02x accepted", (unsigned long long)i,
                         m ? 0x80 : 0x01);
            if (st != KV_ERR_CORRUPT && st != KV_ERR_MISMATCH && st != KV_ERR_UNSUPPORTED)
                fail_msg("header byte %llu: %s (%s)", (unsigned long long)i, kv_status_name(st),
                         kv_last_error());
            assert_untouched(&f, "header flip", i);
        }
    /* payload: the first, a middle and the last byte of every block */
    for (uint64_t k = 0; k < 5; k++) {
        const uint64_t at[3] = {hdr + k * bb, hdr + k * bb + bb / 2 + 1, hdr + (k + 1) * bb - 1};
        for (int j = 0; j < 3; j++) {
            memcpy(f.work, f.buf, f.len);
            f.work[at[j]] ^= 0x10;
            char frag[32];
            snprintf(frag, sizeof(frag), "block %llu of 5", (unsigned long long)k);
            REFUSED(unpack_work(&f, f.len), KV_ERR_CORRUPT, frag);
            const int64_t diff = kvt_first_diff(f.zeroed, f.d.mem, f.d.lo.total_bytes);
            if (diff >= 0)
                fail_msg("payload byte %llu flipped: pool byte %lld is not as the zeroed "
                         "reference",
                         (unsigned long long)at[j], (long long)diff);
            memcpy(f.d.mem, f.before, (size_t)f.d.lo.total_bytes);
        }
    }
    /* truncated at every length (every region boundary among them) */
    memcpy(f.work, f.buf, f.len);
    for (size_t n = 0; n < f.len; n++) {
        kv_status st = unpack_work(&f, n);
        if (st != KV_ERR_CORRUPT)
            fail_msg("truncated to %zu of %zu bytes: %s (%s)", n, f.len, kv_status_name(st),
                     kv_last_error());
        assert_untouched(&f, "truncated", n);
    }
    REFUSED(kv_pack_inspect(f.work, 100, &f.info), KV_ERR_CORRUPT, "152-byte fixed header");
    REFUSED(unpack_work(&f, f.len - 1), KV_ERR_CORRUPT, "truncated payload");
    /* a longer buffer is fine: trailing bytes are not read */
    assert_int_equal(kv_pack_inspect(f.work, f.len + 1000, &f.info), KV_OK);
    /* foreign magic, another version, a forged fingerprint or field */
    memcpy(f.work, f.buf, f.len);
    memcpy(f.work, "PK\3\4\24\0\0\0", 8); /* a zip file */
    REFUSED(unpack_work(&f, f.len), KV_ERR_MISMATCH, "not a kvcache pack");
    memcpy(f.work, f.buf, f.len);
    f.work[8] = 3;
    REFUSED(unpack_work(&f, f.len), KV_ERR_UNSUPPORTED, "version 3");
    /* version 1 (every layer, no range): refused by name, resealed or not */
    memcpy(f.work, f.buf, f.len);
    f.work[8] = 1;
    REFUSED(unpack_work(&f, f.len), KV_ERR_UNSUPPORTED, "version 1 carried every layer");
    reseal(f.work);
    REFUSED(unpack_work(&f, f.len), KV_ERR_UNSUPPORTED, "this library reads version 2");
    /* a forged layer range behind a valid header checksum: none, more than
     * L, past L, wrapping */
    const uint64_t forged[][2] = {{0, 0}, {0, 3}, {1, 2}, {2, 1}, {UINT64_MAX, 1}, {1, UINT64_MAX}};
    for (size_t i = 0; i < sizeof(forged) / sizeof(forged[0]); i++) {
        memcpy(f.work, f.buf, f.len);
        wr64(f.work + 136, forged[i][0]);
        wr64(f.work + 144, forged[i][1]);
        reseal(f.work);
        REFUSED(unpack_work(&f, f.len), KV_ERR_CORRUPT, "packed layers [");
        assert_untouched(&f, "forged layer range", i);
    }
    /* a range inside L but not the one packed: the block bytes disagree */
    memcpy(f.work, f.buf, f.len);
    wr64(f.work + 144, 1);
    reseal(f.work);
    REFUSED(unpack_work(&f, f.len), KV_ERR_CORRUPT, "payload blocks of");
    memcpy(f.work, f.buf, f.len);
    wr64(f.work + 48, rd64(f.buf + 48) ^ 1);
    REFUSED(unpack_work(&f, f.len), KV_ERR_CORRUPT, "header checksum");
    reseal(f.work);
    REFUSED(unpack_work(&f, f.len), KV_ERR_MISMATCH, "fingerprint");
    memcpy(f.work, f.buf, f.len);
    f.work[100] ^= 1; /* NHD -> HND with a valid checksum: the fingerprint disagrees */
    reseal(f.work);
    REFUSED(unpack_work(&f, f.len), KV_ERR_MISMATCH, "fingerprint");
    memcpy(f.work, f.buf, f.len);
    wr64(f.work + 32, 41); /* 41 tokens need 6 blocks of 8 */
    reseal(f.work);
    REFUSED(unpack_work(&f, f.len), KV_ERR_CORRUPT, "6 expected");
    memcpy(f.work, f.buf, f.len);
    f.work[hdr - 1] = 1; /* padding */
    REFUSED(unpack_work(&f, f.len), KV_ERR_CORRUPT, "padding byte");
    assert_untouched(&f, "forged", 0);
    /* and the untouched buffer goes through */
    memcpy(f.work, f.buf, f.len);
    assert_int_equal(unpack_work(&f, f.len), KV_OK);
    fixture_free(&f);
}

static void test_pack_refusals(void **state)
{
    (void)state;
    struct corrupt_fixture f;
    fixture_make(&f);
    size_t out = 0;
    uint64_t size = 0;
    assert_int_equal(kv_pack_size(&f.s.lo, NULL, f.T, &size), KV_OK);
    unsigned char *b = aligned_alloc(64, (size + 64 + 63) / 64 * 64);
    assert_non_null(b);
    memset(b, 0xAB, size + 64);
    REFUSED(kv_pack(NULL, f.s.pc, f.sid, 5, f.T, b, (size_t)size - 1, &out, NULL), KV_ERR_CAPACITY,
            "packs into");
    assert_int_equal(out, size);
    REFUSED(kv_pack(NULL, f.s.pc, f.sid, 4, f.T, b, (size_t)size, &out, NULL), KV_ERR_BAD_SHAPE,
            "needs 5");
    uint32_t far[5] = {1, 2, 120, 3, 4};
    REFUSED(kv_pack(NULL, f.s.pc, far, 5, f.T, b, (size_t)size, &out, NULL), KV_ERR_OUT_OF_BOUNDS,
            "src_blocks[2] = 120");
    REFUSED(kv_pack(NULL, f.s.pc, f.sid, 5, f.T, b + 1, (size_t)size, &out, NULL),
            KV_ERR_INVALID_ARG, "aligned");
    REFUSED(kv_pack(NULL, f.s.pc, f.sid, 5, f.T, f.s.mem + 64, (size_t)size, &out, NULL),
            KV_ERR_OVERLAP, "overlaps");
    kv_plan *wrong = NULL;
    assert_int_equal(kv_pack_plan_create(&f.d.lo, NULL, &wrong), KV_OK);
    REFUSED(kv_pack(wrong, f.s.pc, f.sid, 5, f.T, b, (size_t)size, &out, NULL), KV_ERR_INVALID_ARG,
            "kv_pack_plan_create");
    for (uint64_t i = 0; i < size + 64; i++)
        assert_int_equal(b[i], 0xAB);
    /* unpack: destination list, plan, dtype, overlap */
    uint32_t two[2] = {1, 2}, dup[3] = {5, 6, 5}, oob[3] = {1, 90, 2};
    REFUSED(kv_unpack(NULL, f.buf, f.len, f.d.pc, two, 2, NULL), KV_ERR_BAD_SHAPE, "need 3");
    REFUSED(kv_unpack(NULL, f.buf, f.len, f.d.pc, dup, 3, NULL), KV_ERR_OVERLAP, "listed twice");
    REFUSED(kv_unpack(NULL, f.buf, f.len, f.d.pc, oob, 3, NULL), KV_ERR_OUT_OF_BOUNDS,
            "dst_blocks[1] = 90");
    REFUSED(kv_unpack(wrong, f.buf, f.len, f.d.pc, f.did, 3, NULL), KV_ERR_INVALID_ARG,
            "kv_unpack_plan_create");
    struct kvt_side o;
    kvt_side_make(&o, 2, 90, 16, 2, 8, KV_F16, 0, 33);
    REFUSED(kv_unpack(NULL, f.buf, f.len, o.pc, f.did, 3, NULL), KV_ERR_INVALID_ARG, "dtype");
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.n_heads = 2;
    pc.src_head0 = 1;
    REFUSED(kv_unpack(NULL, f.buf, f.len, f.d.pc, f.did, 3, &pc), KV_ERR_BAD_SHAPE, "outside");
    /* a buffer that lives inside the destination's storage */
    unsigned char *inside = f.d.mem + f.d.lo.total_bytes - f.len - 64;
    memcpy(f.before, f.d.mem, (size_t)f.d.lo.total_bytes);
    memcpy(inside, f.buf, f.len);
    memcpy(f.before, f.d.mem, (size_t)f.d.lo.total_bytes);
    REFUSED(kv_unpack(NULL, inside, f.len, f.d.pc, f.did, 3, NULL), KV_ERR_OVERLAP, "overlaps");
    assert_untouched(&f, "refusal", 0);
    REFUSED(kv_unpack(NULL, NULL, 0, f.d.pc, f.did, 3, NULL), KV_ERR_NULL, "buf");
    REFUSED(kv_pack_inspect(f.buf, f.len, NULL), KV_ERR_NULL, "out");
    /* an empty request packs and unpacks */
    assert_int_equal(kv_pack(NULL, f.s.pc, NULL, 0, 0, b, (size_t)size, &out, NULL), KV_OK);
    assert_int_equal(out, 192);
    assert_int_equal(kv_unpack(NULL, b, out, f.d.pc, NULL, 0, NULL), KV_OK);
    assert_untouched(&f, "empty", 0);
    kv_plan_destroy(wrong);
    kvt_side_free(&o);
    free(b);
    fixture_free(&f);
}

/* Layer ranges refused: a pack range outside the source (kv_pack_size,
 * kv_pack_plan_create and kv_pack alike, nothing written); an unpack whose
 * config or plan names other layers than the buffer carries (both ranges
 * named), or a destination range outside the destination - each with the
 * destination pool bit-identical; then the right config lands the layers
 * and leaves the others as they were. */
static void test_pack_layer_range_refusals(void **state)
{
    (void)state;
    struct kvt_side s, d, d4;
    kvt_side_make(&s, 4, 60, 8, 2, 8, KV_BF16, 4, 51);  /* L 4, NHD layer-major padded */
    kvt_side_make(&d, 3, 50, 16, 2, 8, KV_BF16, 3, 52); /* L 3, HND block-major */
    kvt_side_make(&d4, 4, 50, 16, 2, 8, KV_BF16, 1, 53);
    const uint32_t sid[3] = {59, 7, 33}, did[2] = {49, 20};
    const uint64_t T = 20;
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    uint64_t size = 0;
    size_t out = 0;
    /* packing: ranges outside L 4, n_layers 0 with an offset, negatives */
    struct {
        int64_t l0, n;
        const char *frag;
    } bad[] = {
        {3, 2, "layers [3, 3+2) of a source with L 4: outside the layout"},
        {0, 5, "layers [0, 0+5) of a source with L 4"},
        {-1, 1, "layers [-1, -1+1)"},
        {0, -2, "+-2)"},
        {INT64_MAX, 1, "outside the layout"},
        {1, INT64_MAX, "outside the layout"},
        {2, 0, "n_layers 0 (every layer) needs src_layer0 0, got 2"},
    };
    unsigned char *b = aligned_alloc(64, 1 << 16);
    assert_non_null(b);
    memset(b, 0xAB, 1 << 16);
    kv_plan *p = (kv_plan *)&bad; /* a sentinel: a refusal leaves it or sets NULL */
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        pc.src_layer0 = bad[i].l0;
        pc.n_layers = bad[i].n;
        REFUSED(kv_pack_size(&s.lo, &pc, T, &size), KV_ERR_BAD_SHAPE, bad[i].frag);
        REFUSED(kv_pack_plan_create(&s.lo, &pc, &p), KV_ERR_BAD_SHAPE, bad[i].frag);
        REFUSED(kv_pack(NULL, s.pc, sid, 3, T, b, 1 << 16, &out, &pc), KV_ERR_BAD_SHAPE,
                bad[i].frag);
    }
    pc = (struct kv_plan_config)KV_PLAN_CONFIG_INIT;
    pc.struct_size = offsetof(struct kv_plan_config, src_layer0); /* before layer ranges */
    REFUSED(kv_pack(NULL, s.pc, sid, 3, T, b, 1 << 16, &out, &pc), KV_ERR_INVALID_ARG,
            "kv_plan_config");
    for (size_t i = 0; i < (1 << 16); i++)
        if (b[i] != 0xAB)
            fail_msg("a refused pack wrote byte %zu", i);
    /* layers [1, 3) of 4: the size of 2 layers */
    pc = (struct kv_plan_config)KV_PLAN_CONFIG_INIT;
    pc.src_layer0 = 1;
    pc.n_layers = 2;
    uint64_t all = 0;
    assert_int_equal(kv_pack_size(&s.lo, NULL, T, &all), KV_OK);
    assert_int_equal(kv_pack_size(&s.lo, &pc, T, &size), KV_OK);
    const uint64_t hdr = (FIXED + 3 * 8 + 8 + 63) / 64 * 64;
    assert_int_equal(size - hdr, (all - hdr) / 2);
    /* with a plan, the plan's layers (cfg is not read) */
    kv_plan *pp = NULL;
    assert_int_equal(kv_pack_plan_create(&s.lo, &pc, &pp), KV_OK);
    struct kv_plan_config other = KV_PLAN_CONFIG_INIT;
    other.src_layer0 = 3;
    other.n_layers = 1;
    size_t len = 0;
    assert_int_equal(kv_pack(pp, s.pc, sid, 3, T, b, 1 << 16, &len, &other), KV_OK);
    assert_int_equal(len, size);
    struct kv_pack_info info;
    assert_int_equal(kv_pack_inspect(b, len, &info), KV_OK);
    assert_int_equal(info.src_layer0, 1);
    assert_int_equal(info.n_layers, 2);

    /* unpacking it: every refusal before a write */
    unsigned char *before = malloc((size_t)d4.lo.total_bytes);
    assert_non_null(before);
    memcpy(before, d4.mem, (size_t)d4.lo.total_bytes);
    REFUSED(kv_unpack(NULL, b, len, d4.pc, did, 2, NULL), KV_ERR_MISMATCH,
            "the buffer carries layers [1, 1+2) of a source with L 4; the config unpacks "
            "[0, 0+4)");
    struct kv_plan_config u = KV_PLAN_CONFIG_INIT;
    u.n_layers = 2;
    u.dst_layer0 = 1;
    REFUSED(kv_unpack(NULL, b, len, d4.pc, did, 2, &u), KV_ERR_MISMATCH,
            "the config unpacks [0, 0+2)");
    u.src_layer0 = 2;
    REFUSED(kv_unpack(NULL, b, len, d4.pc, did, 2, &u), KV_ERR_MISMATCH, "[2, 2+2)");
    u.src_layer0 = 1;
    u.n_layers = 1;
    REFUSED(kv_unpack(NULL, b, len, d4.pc, did, 2, &u), KV_ERR_MISMATCH, "[1, 1+1)");
    u.n_layers = 2;
    u.dst_layer0 = 3; /* [3, 5) of a destination with L 4 */
    REFUSED(kv_unpack(NULL, b, len, d4.pc, did, 2, &u), KV_ERR_BAD_SHAPE,
            "onto [3, 3+2) of a destination with L 4: outside a layout");
    kv_plan *up = NULL;
    struct kv_plan_config w = KV_PLAN_CONFIG_INIT;
    w.n_layers = 2;
    assert_int_equal(kv_unpack_plan_create(&s.lo, &d4.lo, &w, &up), KV_OK);
    REFUSED(kv_unpack(up, b, len, d4.pc, did, 2, NULL), KV_ERR_MISMATCH,
            "the plan unpacks [0, 0+2)");
    kv_plan_destroy(up);
    assert_int_equal(kv_unpack_plan_create(&s.lo, &d4.lo, NULL, &up), KV_OK);
    REFUSED(kv_unpack(up, b, len, d4.pc, did, 2, NULL), KV_ERR_MISMATCH,
            "the plan unpacks [0, 0+4)");
    kv_plan_destroy(up);
    assert_memory_equal(before, d4.mem, (size_t)d4.lo.total_bytes);
    /* the right config: layers 1..2 of the source onto 0..1 of the L-3
     * destination; its layer 2 as it was */
    unsigned char *before3 = malloc((size_t)d.lo.total_bytes);
    assert_non_null(before3);
    memcpy(before3, d.mem, (size_t)d.lo.total_bytes);
    u = (struct kv_plan_config)KV_PLAN_CONFIG_INIT;
    u.src_layer0 = 1;
    u.n_layers = 2;
    assert_int_equal(kv_unpack_plan_create(&s.lo, &d.lo, &u, &up), KV_OK);
    assert_int_equal(kv_unpack(up, b, len, d.pc, did, 2, NULL), KV_OK);
    assert_int_equal(kvt_other_layers_changed(&d, did, 2, 0, 2, d.mem, before3), 0);
    unsigned char *ref = malloc((size_t)d.lo.total_bytes);
    assert_non_null(ref);
    memcpy(ref, before3, (size_t)d.lo.total_bytes);
    kvt_ref_move_layers(&s, sid, 3, &d, did, 2, 1, 0, 2, 0, 0, 2, ref);
    assert_int_equal(kvt_first_diff(ref, d.mem, d.lo.total_bytes), -1);
    kv_plan_destroy(up);
    kv_plan_destroy(pp);
    free(ref);
    free(before3);
    free(before);
    free(b);
    kvt_side_free(&s);
    kvt_side_free(&d);
    kvt_side_free(&d4);
}

/* The streaming path (kv_pack_int.h: non-temporal stores, copy + hash in
 * pieces of an L1 buffer), which only moves of 8 MiB and more take, forced
 * on small caches: rows of 8,448 bytes (two pieces and a tail) from a padded
 * source, into the same layout and into HND block-major (264-byte head
 * rows, every other one off 16-byte alignment: the streamed middle and the
 * plain edges), 2 threads. The
 * buffer is byte-identical to the plain path's, both destinations equal
 * the config-only reference over the whole pool, and a payload corrupted in
 * its first byte (first block, first piece) or its last (last block, last
 * piece) is refused naming the block, the whole pool as before but for the
 * listed blocks' unpacked bytes, zero. */
static void test_pack_streaming_stores(void **state)
{
    (void)state;
    const uint64_t nt_default = kv__pack_nt_min_bytes;
    struct kvt_side s, d[2];
    kvt_side_make(&s, 2, 90, 16, 2, 132, KV_BF16, 4, 71);    /* NHD layer-major, padded */
    kvt_side_make(&d[0], 2, 80, 16, 2, 132, KV_BF16, 0, 72); /* the same, unpadded */
    kvt_side_make(&d[1], 2, 70, 16, 2, 132, KV_BF16, 3, 73); /* HND block-major */
    const uint64_t T = 200;                                  /* 13 blocks, the last one partial */
    const uint32_t nb = 13;
    uint32_t sid[13], did[13];
    uint64_t rng = 0x57AEA4;
    kvt_pick_ids(&rng, s.lo.num_blocks, nb, sid);
    size_t len = 0, len_nt = 0;
    kv__pack_nt_min_bytes = UINT64_MAX;
    unsigned char *plain = pack_request(NULL, &s, sid, nb, T, &len);
    kv__pack_nt_min_bytes = 0;
    /* streamed both ways (kv__pack_fused_nt): staged through the L1 piece,
     * and written and kept in one pass; the same buffer, checksums included */
    const int fused_default = kv__pack_fused_nt;
    kv__pack_fused_nt = 0;
    unsigned char *staged = pack_request(NULL, &s, sid, nb, T, &len_nt);
    assert_int_equal(len, len_nt);
    assert_int_equal(kvt_first_diff(plain, staged, (int64_t)len), -1);
    free(staged);
    kv__pack_fused_nt = 1;
    unsigned char *buf = pack_request(NULL, &s, sid, nb, T, &len_nt);
    kv__pack_fused_nt = fused_default;
    assert_int_equal(len, len_nt);
    assert_int_equal(kvt_first_diff(plain, buf, (int64_t)len), -1);
    struct kv_pack_info info;
    assert_int_equal(kv_pack_inspect(buf, len, &info), KV_OK);
    assert_int_equal(info.n_blocks, nb);
    unsigned char *work = malloc(len);
    assert_non_null(work);
    for (int k = 0; k < 2; k++) {
        const int64_t bytes = d[k].lo.total_bytes;
        kvt_pick_ids(&rng, d[k].lo.num_blocks, nb, did);
        unsigned char *before = malloc((size_t)bytes), *ref = malloc((size_t)bytes);
        assert_true(before && ref);
        memcpy(before, d[k].mem, (size_t)bytes);
        memcpy(ref, d[k].mem, (size_t)bytes);
        kvt_ref_move(&s, sid, nb, &d[k], did, nb, 0, 0, 2, ref);
        unsigned char *zeroed = zeroed_ref(&s, sid, nb, &d[k], did, nb, 0, 0, 2, 0, 0, 2, before);
        /* corrupted in the first byte of the payload, then in its last */
        const uint64_t at[2] = {info.header_bytes, info.total_bytes - 1};
        const char *frag[2] = {"block 0 of 13", "block 12 of 13"};
        for (int j = 0; j < 2; j++) {
            memcpy(work, buf, len);
            work[at[j]] ^= 0x01;
            REFUSED(kv_unpack(NULL, work, len, d[k].pc, did, nb, NULL), KV_ERR_CORRUPT, frag[j]);
            if (kvt_first_diff(zeroed, d[k].mem, bytes) != -1)
                fail_msg("destination %d, payload byte %llu corrupted: the pool is not before "
                         "with the listed blocks zeroed",
                         k, (unsigned long long)at[j]);
            memcpy(d[k].mem, before, (size_t)bytes);
        }
        free(zeroed);
        assert_int_equal(kv_unpack(NULL, buf, len, d[k].pc, did, nb, NULL), KV_OK);
        const int64_t diff = kvt_first_diff(ref, d[k].mem, bytes);
        if (diff >= 0)
            fail_msg("destination %d: byte %lld of %lld differs from the reference", k,
                     (long long)diff, (long long)bytes);
        free(before);
        free(ref);
    }
    kv__pack_nt_min_bytes = nt_default;
    free(work);
    free(plain);
    free(buf);
    kvt_side_free(&s);
    kvt_side_free(&d[0]);
    kvt_side_free(&d[1]);
}

/* kv__pack_copy_keep_nt (the fused streaming copy) against memcpy: every
 * destination offset from 0 to 63 (the plain head to 16-byte alignment),
 * lengths across the edges (0, under and over head + 64, multiples of 64
 * and not, a 4 KiB piece and one past it), a source offset that is odd: dst
 * and keep both equal the source, and the bytes around them untouched. */
static void test_copy_keep_nt(void **state)
{
    (void)state;
    enum { CAP = 4096 + 256 };
    static const size_t lens[] = {0, 1, 15, 63, 64, 65, 79, 127, 128, 129, 200, 1000, 4096, 4097};
    unsigned char *src = malloc(CAP + 64), *dst = malloc(CAP + 128), *keep = malloc(CAP + 128);
    assert_true(src && dst && keep);
    for (size_t i = 0; i < CAP + 64; i++)
        src[i] = (unsigned char)(i * 131 + 7);
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++)
        for (size_t off = 0; off < 64; off++) {
            const size_t n = lens[li];
            memset(dst, 0xA5, CAP + 128);
            memset(keep, 0x5A, CAP + 128);
            kv__pack_copy_keep_nt((char *)dst + off, (char *)keep + 1, (const char *)src + 3, n);
            kv__pack_nt_fence();
            if (memcmp(dst + off, src + 3, n) != 0 || memcmp(keep + 1, src + 3, n) != 0)
                fail_msg("n %zu, dst offset %zu: a copy differs from the source", n, off);
            for (size_t i = 0; i < CAP + 128; i++) {
                if ((i < off || i >= off + n) && dst[i] != 0xA5)
                    fail_msg("n %zu, dst offset %zu: byte %zu outside the copy written", n, off, i);
                if ((i < 1 || i >= 1 + n) && keep[i] != 0x5A)
                    fail_msg("n %zu, dst offset %zu: keep byte %zu outside the copy written", n,
                             off, i);
            }
        }
    free(src);
    free(dst);
    free(keep);
}

/* Unpack with a conversion to HND, which kv__pack_copy_hash_src writes a
 * chunk's head rows of several copies row by row across the copies
 * (destination order) and streams them when they are 64-byte multiples:
 * NHD layer-major (D 64 bf16: 128-byte rows, 16-byte aligned) into HND
 * block-major, unpadded and padded, blocks far from 0, a partial last block;
 * streamed and plain stores; the default chunk, one that ends mid-copy
 * (4,480 bytes: 4 KiB + 3 rows) and one that ends mid-row (100 bytes). Every
 * time the whole destination pool equals the config-only reference. */
static void test_unpack_convert_chunks(void **state)
{
    (void)state;
    const uint64_t nt_default = kv__pack_nt_min_bytes;
    const int64_t chunk_default = kv__pack_src_chunk_bytes;
    struct kvt_side s, d[2];
    kvt_side_make(&s, 2, 300, 16, 4, 64, KV_BF16, 0, 81);    /* NHD layer-major */
    kvt_side_make(&d[0], 2, 280, 16, 4, 64, KV_BF16, 3, 82); /* HND block-major */
    kvt_side_make(&d[1], 2, 260, 16, 4, 64, KV_BF16, 7, 83); /* the same, padded */
    const uint64_t T = 150;                                  /* 10 blocks, the last partial */
    const uint32_t nb = 10;
    uint32_t sid[10], did[10];
    for (uint32_t i = 0; i < nb; i++)
        sid[i] = (uint32_t)s.lo.num_blocks - 1 - 3 * i; /* far from 0 */
    size_t len = 0;
    unsigned char *buf = pack_request(NULL, &s, sid, nb, T, &len);
    static const int64_t chunks[3] = {0, 4480, 100};
    for (int k = 0; k < 2; k++) {
        const int64_t bytes = d[k].lo.total_bytes;
        for (uint32_t i = 0; i < nb; i++)
            did[i] = (uint32_t)d[k].lo.num_blocks - 2 - 5 * i;
        unsigned char *before = malloc((size_t)bytes), *ref = malloc((size_t)bytes);
        assert_true(before && ref);
        memcpy(before, d[k].mem, (size_t)bytes);
        memcpy(ref, d[k].mem, (size_t)bytes);
        kvt_ref_move(&s, sid, nb, &d[k], did, nb, 0, 0, 4, ref);
        for (int c = 0; c < 3; c++)
            for (int nt = 0; nt < 2; nt++) {
                kv__pack_src_chunk_bytes = chunks[c] ? chunks[c] : chunk_default;
                kv__pack_nt_min_bytes = nt ? 0 : UINT64_MAX;
                memcpy(d[k].mem, before, (size_t)bytes);
                const kv_status st = kv_unpack(NULL, buf, len, d[k].pc, did, nb, NULL);
                kv__pack_src_chunk_bytes = chunk_default;
                kv__pack_nt_min_bytes = nt_default;
                assert_int_equal(st, KV_OK);
                const int64_t diff = kvt_first_diff(ref, d[k].mem, bytes);
                if (diff >= 0)
                    fail_msg("destination %d, chunk %lld, %s stores: byte %lld of %lld differs "
                             "from the reference",
                             k, (long long)chunks[c], nt ? "streamed" : "plain", (long long)diff,
                             (long long)bytes);
            }
        free(before);
        free(ref);
    }
    free(buf);
    kvt_side_free(&s);
    kvt_side_free(&d[0]);
    kvt_side_free(&d[1]);
}

/* A payload block failing its checksum, on each of unpack's three paths
 * (one read of a payload block into the same in-block format, N 16 -> 16;
 * one block hashed then converted, NHD -> HND, 16 -> 16, a head range;
 * the whole payload verified then copied, N 16 -> 32): layers [1, +2) of a
 * 3-layer source onto [2, +2) of a 4-layer padded destination, 9 blocks
 * (the last partial) far from 0; corrupted in the first payload byte, a
 * middle byte of a middle block, the last byte. KV_ERR_CORRUPT names the
 * block; the whole pool equals before with the request's bytes (the listed
 * blocks' unpacked layers and heads) zero: the other layers of those
 * blocks, the other heads and every other block unchanged. Then the intact
 * buffer unpacks over the zeroes to the reference. */
static void test_pack_corrupt_zeroes_listed_blocks(void **state)
{
    (void)state;
    struct {
        int dbits;
        int64_t Nd, Hd, sh0, dh0, nh;
    } cases[3] = {{4, 16, 2, 0, 0, 2}, {5, 16, 3, 1, 2, 1}, {6, 32, 2, 0, 0, 2}};
    const uint64_t T = 140; /* 9 source blocks of 16, the last one partial */
    const uint32_t ns = 9;
    for (int c = 0; c < 3; c++) {
        struct kvt_side s, d;
        kvt_side_make(&s, 3, 200, 16, 2, 24, KV_BF16, 0, 91 + (uint64_t)c);
        kvt_side_make(&d, 4, 150, cases[c].Nd, cases[c].Hd, 24, KV_BF16, cases[c].dbits,
                      95 + (uint64_t)c);
        struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
        pc.src_layer0 = 1;
        pc.dst_layer0 = 2;
        pc.n_layers = 2;
        pc.src_head0 = cases[c].sh0;
        pc.dst_head0 = cases[c].dh0;
        pc.n_heads = cases[c].nh;
        const uint32_t nd = (uint32_t)((T + (uint64_t)cases[c].Nd - 1) / (uint64_t)cases[c].Nd);
        uint32_t sid[9], did[9];
        uint64_t rng = 0xC0FFEE + (uint64_t)c;
        kvt_pick_ids(&rng, s.lo.num_blocks, ns, sid);
        kvt_pick_ids(&rng, d.lo.num_blocks, nd, did);
        for (uint32_t k = 0; k + 1 < nd; k++) /* the pool's last block, last */
            if (did[k] == (uint32_t)d.lo.num_blocks - 1)
                did[k] = did[nd - 1];
        did[nd - 1] = (uint32_t)d.lo.num_blocks - 1;
        size_t len = 0;
        unsigned char *buf = pack_range(NULL, &s, sid, ns, T, &pc, &len);
        struct kv_pack_info info;
        assert_int_equal(kv_pack_inspect(buf, len, &info), KV_OK);
        const int64_t bytes = d.lo.total_bytes;
        unsigned char *before = malloc((size_t)bytes), *ref = malloc((size_t)bytes);
        unsigned char *work = malloc(len);
        assert_true(before && ref && work);
        memcpy(before, d.mem, (size_t)bytes);
        memcpy(ref, d.mem, (size_t)bytes);
        kvt_ref_move_layers(&s, sid, ns, &d, did, nd, 1, 2, 2, pc.src_head0, pc.dst_head0,
                            pc.n_heads, ref);
        unsigned char *zeroed = zeroed_ref(&s, sid, ns, &d, did, nd, 1, 2, 2, pc.src_head0,
                                           pc.dst_head0, pc.n_heads, before);
        const uint64_t bb = info.block_bytes, hdr = info.header_bytes;
        const uint64_t at[3] = {hdr, hdr + 4 * bb + bb / 2 + 3, len - 1};
        const char *frag[3] = {"block 0 of 9", "block 4 of 9", "block 8 of 9"};
        for (int j = 0; j < 3; j++) {
            memcpy(work, buf, len);
            work[at[j]] ^= 0x40;
            REFUSED(kv_unpack(NULL, work, len, d.pc, did, nd, &pc), KV_ERR_CORRUPT, frag[j]);
            const int64_t diff = kvt_first_diff(zeroed, d.mem, bytes);
            if (diff >= 0)
                fail_msg("case %d, payload byte %llu flipped: pool byte %lld of %lld is not as "
                         "the zeroed reference",
                         c, (unsigned long long)at[j], (long long)diff, (long long)bytes);
            assert_int_equal(kvt_other_layers_changed(&d, did, nd, 2, 2, d.mem, before), 0);
        }
        /* the intact buffer over the zeroes */
        assert_int_equal(kv_unpack(NULL, buf, len, d.pc, did, nd, &pc), KV_OK);
        const int64_t diff = kvt_first_diff(ref, d.mem, bytes);
        if (diff >= 0)
            fail_msg("case %d: byte %lld of %lld differs from the reference", c, (long long)diff,
                     (long long)bytes);
        free(before);
        free(ref);
        free(zeroed);
        free(work);
        free(buf);
        kvt_side_free(&s);
        kvt_side_free(&d);
    }
}

/* A forged header whose payload size wraps: a K-only source of 2^51 heads
 * (2^62-byte blocks) times 4 blocks is 0 in 64 bits, and a 192-byte buffer
 * passed as a whole pack (kv_unpack then read 2^62-byte blocks from it).
 * Its fingerprint is the forged layout's own: anyone can compute it. */
static void test_pack_payload_size_does_not_wrap(void **state)
{
    (void)state;
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = 1, c.num_blocks = 1, c.block_tokens = 16, c.head_dim = 64;
    c.num_heads = (int64_t)1 << 51;
    c.dtype = KV_BF16, c.order = KV_ORDER_HND, c.arrange = KV_ARRANGE_BLOCK_MAJOR;
    c.k_only = true;
    struct kv_layout src, wire;
    assert_int_equal(kv_layout_init(&c, &src), KV_OK);
    assert_int_equal(kv_pack_wire_layout(&src, &wire), KV_OK);
    const uint32_t nb = 4;
    const uint64_t bb = (uint64_t)wire.stride_block_bytes;
    assert_true(bb == (uint64_t)1 << 62 && (uint64_t)nb * bb == 0);
    const uint64_t hdr = (FIXED + 8 * nb + 8 + 63) / 64 * 64;
    unsigned char *buf = calloc(1, hdr);
    assert_non_null(buf);
    memcpy(buf, "KVPACK\r\n", 8);
    wr32(buf + 8, 2), wr32(buf + 12, FIXED), wr64(buf + 16, hdr), wr64(buf + 24, 0);
    wr64(buf + 32, 64), wr32(buf + 40, nb), wr32(buf + 44, 0), wr64(buf + 48, src.fingerprint);
    wr64(buf + 56, 1), wr64(buf + 64, 1), wr64(buf + 72, 16), wr64(buf + 80, (uint64_t)1 << 51);
    wr64(buf + 88, 64), wr32(buf + 96, (uint32_t)KV_BF16), wr32(buf + 100, KV_ORDER_HND);
    wr32(buf + 104, KV_ARRANGE_BLOCK_MAJOR), wr32(buf + 108, 2);
    wr64(buf + 112, (uint64_t)src.block_stride_bytes), wr64(buf + 120, (uint64_t)src.align_bytes);
    wr64(buf + 128, bb), wr64(buf + 136, 0), wr64(buf + 144, 1);
    reseal(buf);
    struct kv_pack_info info;
    assert_int_equal(kv_pack_inspect(buf, hdr, &info), KV_ERR_CORRUPT);
    kvt_assert_msg_has("payload of 0 bytes for 4 blocks of 4611686018427387904");
    /* and kv_unpack, with a head range (as a tensor-parallel decoder takes) */
    struct kv_layout_config d = KV_LAYOUT_CONFIG_INIT;
    d.num_layers = 1, d.num_blocks = 8, d.block_tokens = 16, d.num_heads = 1, d.head_dim = 64;
    d.dtype = KV_BF16, d.k_only = true;
    struct kv_layout dlo;
    assert_int_equal(kv_layout_init(&d, &dlo), KV_OK);
    unsigned char *dmem = calloc(1, (size_t)dlo.total_bytes);
    assert_non_null(dmem);
    const struct kv_paged_cache dst = {dlo, dmem, (size_t)dlo.total_bytes, KV_MEM_HOST};
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = 0, pc.n_heads = 1;
    const uint32_t ids[4] = {0, 1, 2, 3};
    assert_int_equal(kv_unpack(NULL, buf, hdr, dst, ids, 4, &pc), KV_ERR_CORRUPT);
    for (int64_t i = 0; i < dlo.total_bytes; i++)
        assert_int_equal(dmem[i], 0);
    free(dmem);
    free(buf);
}

/* Audit (2026-12-05): a pack buffer inside the source's arena, the source
 * claiming storage_bytes SIZE_MAX (its end wrapped past the top, so the
 * overlap check saw none): refused, the arena unchanged. */
static void test_pack_buffer_in_wrapping_storage(void **state)
{
    (void)state;
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = 2;
    c.num_blocks = 8;
    c.block_tokens = 4;
    c.num_heads = 2;
    c.head_dim = 64;
    c.dtype = KV_F16;
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    char *arena = aligned_alloc(64, (size_t)lo.total_bytes);
    memset(arena, 7, (size_t)lo.total_bytes);
    const uint32_t blocks[2] = {0, 1};
    size_t need = 0, out = 0;
    struct kv_paged_cache s = {
        .layout = lo, .base = arena, .storage_bytes = (size_t)lo.total_bytes};
    assert_int_equal(kv_pack(NULL, s, blocks, 2, 8, NULL, 0, &need, NULL), KV_ERR_CAPACITY);
    assert_int_equal(kv_pack(NULL, s, blocks, 2, 8, arena + 64, need, &out, NULL), KV_ERR_OVERLAP);
    s.storage_bytes = SIZE_MAX;
    assert_int_equal(kv_pack(NULL, s, blocks, 2, 8, arena + 64, need, &out, NULL),
                     KV_ERR_OUT_OF_BOUNDS);
    for (int64_t i = 0; i < lo.total_bytes; i++)
        if (arena[i] != 7)
            fail_msg("arena byte %lld changed", (long long)i);
    free(arena);
}

/* The caller's block lists: misaligned for their uint32 elements (reading
 * them is undefined behaviour; UBSan aborts), refused by name with nothing
 * written; and a source list that lies inside the pack buffer, which the
 * packed bytes would overwrite before the later ids are read (they were
 * checked first: an id read after is unchecked), refused. */
static void test_pack_caller_block_lists(void **state)
{
    (void)state;
    struct corrupt_fixture f;
    fixture_make(&f);
    size_t out = 0;
    uint64_t size = 0;
    assert_int_equal(kv_pack_size(&f.s.lo, NULL, f.T, &size), KV_OK);
    unsigned char *b = aligned_alloc(64, (size + 64 + 63) / 64 * 64);
    assert_non_null(b);
    memset(b, 0xAB, size + 64);
    _Alignas(uint32_t) char sbuf[1 + sizeof(f.sid)], dbuf[1 + sizeof(f.did)];
    const uint32_t *sm = kvt_misaligned_u32(sbuf, f.sid, sizeof(f.sid) / sizeof(f.sid[0]));
    const uint32_t *dm = kvt_misaligned_u32(dbuf, f.did, sizeof(f.did) / sizeof(f.did[0]));
    REFUSED(kv_pack(NULL, f.s.pc, sm, 5, f.T, b, (size_t)size, &out, NULL), KV_ERR_INVALID_ARG,
            "kv_pack: src_blocks=");
    assert_int_equal(out, 0);
    for (uint64_t i = 0; i < size + 64; i++)
        assert_int_equal(b[i], 0xAB);
    REFUSED(kv_unpack(NULL, f.buf, f.len, f.d.pc, dm, 3, NULL), KV_ERR_INVALID_ARG,
            "kv_unpack: dst_blocks=");
    assert_untouched(&f, "misaligned dst_blocks", 0);
    /* the source list in the buffer: in block 0's payload slot, which the
     * first block's copy fills with source bytes */
    uint32_t *in = (uint32_t *)(void *)(b + f.info.header_bytes);
    memcpy(in, f.sid, sizeof(f.sid));
    REFUSED(kv_pack(NULL, f.s.pc, in, 5, f.T, b, (size_t)size, &out, NULL), KV_ERR_OVERLAP,
            "src_blocks");
    assert_int_equal(out, 0);
    assert_memory_equal(in, f.sid, sizeof(f.sid));
    for (uint64_t i = 0; i < f.info.header_bytes; i++)
        assert_int_equal(b[i], 0xAB);
    /* just past the packed bytes it is read-only to the call: packs as the
     * reference */
    uint32_t *past = (uint32_t *)(void *)(b + size + (4 - size % 4) % 4);
    memcpy(past, f.sid, sizeof(f.sid));
    assert_int_equal(kv_pack(NULL, f.s.pc, past, 5, f.T, b, (size_t)size, &out, NULL), KV_OK);
    assert_int_equal(out, f.len);
    assert_memory_equal(b, f.buf, f.len);
    free(b);
    fixture_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pack_every_layout_pair),
        cmocka_unit_test(test_pack_head_slices_and_dtypes),
        cmocka_unit_test(test_pack_layer_ranges_every_layout_pair),
        cmocka_unit_test(test_pack_layer_ranges_pipeline_and_one_layer),
        cmocka_unit_test(test_pack_format_bytes),
        cmocka_unit_test(test_pack_corruption),
        cmocka_unit_test(test_pack_refusals),
        cmocka_unit_test(test_pack_layer_range_refusals),
        cmocka_unit_test(test_pack_streaming_stores),
        cmocka_unit_test(test_copy_keep_nt),
        cmocka_unit_test(test_unpack_convert_chunks),
        cmocka_unit_test(test_pack_corrupt_zeroes_listed_blocks),
        cmocka_unit_test(test_pack_payload_size_does_not_wrap),
        cmocka_unit_test(test_pack_buffer_in_wrapping_storage),
        cmocka_unit_test(test_pack_caller_block_lists),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
