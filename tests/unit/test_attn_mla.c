/*
 * test_attn_mla.c - MLA latent caches: the K-only layout (kv_layout.h
 * k_only), the kernels, plans and pack over it, and kv_attn_decode_mla.
 *
 *   - the layout: one plane, its strides and byte runs against the config
 *     formula (kvt_ref_offset_elems), V refused, refused with kv_packed,
 *     fingerprints apart from the two-plane layout of the same dims, the
 *     config wire (planes field 2) round trip;
 *   - write / read / copy-blocks (one cache and two, a layer range) over
 *     K-only layouts: padded, both arrangements, block ids far from 0,
 *     strided tensors; the WHOLE pool compared with a reference built from
 *     the config alone; every V (tensor, output, scales, plane) refused with
 *     the pools unchanged;
 *   - plans: K-only -> K-only with a layer range (whole destination
 *     compared), K-only <-> two planes refused, heterogeneous TP for MLA
 *     (two decode ranks of other layouts each receive the whole latent),
 *     pack / unpack of a K-only layer range;
 *   - kv_attn_decode_mla against a float64 reference: D = 576 / dv = 512 and
 *     small D, Hq in {1, 3, 5, 16, 128}, bf16 / f16 / f32 / fp8 e4m3 with a
 *     per-tensor scale, CSR and block-table pages, empty sequences, padded
 *     layouts, strided q and out (gaps checked untouched), the AVX2 and the
 *     portable paths, q bf16 (the bf16 dot-product scores where the CPU has
 *     AVX512_BF16, which jobs take them checked, and the same with them
 *     turned off); its refusals;
 *   - kv_attn_prefill_mla against a float64 reference: sequences of q_len 0,
 *     1, several and the whole sequence, D = 576 / dv = 512 and small odd
 *     shapes, every dtype, window, soft cap and lse, the whole out and lse
 *     (gaps untouched); the last query of each sequence equal to
 *     kv_attn_decode_mla's output bit for bit; the CUDA body's MLA form
 *     (kv_attn_prefill_hd.h) on the grid emulator against the same
 *     reference; its refusals, nothing written.
 */
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>

#include "kv_attn_grid_int.h"
#include "kv_attn_int.h"
#include "kv_attn_mla_int.h"
#include "kv_mem.h"
#include "kvtest.h"

/* ---- pools -------------------------------------------------------------------- */

struct pool {
    struct kv_layout_config cfg;
    struct kv_paged_cache c;
    unsigned char *mem;
    size_t bytes;
    int64_t es;
};

static struct kv_layout_config mla_cfg(int64_t L, int64_t B, int64_t N, int64_t H, int64_t D,
                                       kv_dtype dt, kv_order o, kv_arrange a, int64_t pad)
{
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = L, c.num_blocks = B, c.block_tokens = N, c.num_heads = H, c.head_dim = D;
    c.dtype = dt, c.order = o, c.arrange = a, c.block_pad_elems = pad, c.k_only = true;
    return c;
}

static void fill_random(void *p, size_t n, uint64_t seed)
{
    unsigned char *b = p;
    uint64_t r = seed;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint64_t x = kvt_rand(&r);
        memcpy(b + i, &x, 8);
    }
    for (; i < n; i++)
        b[i] = (unsigned char)(kvt_rand(&r) >> 24);
}

static void pool_make(struct pool *p, const struct kv_layout_config *cfg, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->cfg = *cfg;
    assert_int_equal(kv_layout_init(cfg, &p->c.layout), KV_OK);
    p->bytes = (size_t)p->c.layout.total_bytes;
    p->mem = kv__mem_alloc_aligned(4096, p->bytes);
    assert_non_null(p->mem);
    fill_random(p->mem, p->bytes, seed);
    p->c.base = p->mem;
    p->c.storage_bytes = p->bytes;
    p->es = (int64_t)kv_dtype_size(cfg->dtype);
}

static void pool_free(struct pool *p)
{
    kv__mem_free(p->mem);
    p->mem = NULL;
}

/* byte offset of (l, b, n, h, d) of the K plane, from the config alone */
static size_t at(const struct pool *p, int64_t l, int64_t b, int64_t n, int64_t h, int64_t d)
{
    return (size_t)(kvt_ref_offset_elems(&p->cfg, l, 0, b, n, h, d) * p->es);
}

static unsigned char *snapshot(const struct pool *p)
{
    unsigned char *s = malloc(p->bytes);
    assert_non_null(s);
    memcpy(s, p->mem, p->bytes);
    return s;
}

/* ---- the layout ------------------------------------------------------------------ */

static void test_mla_layout(void **state)
{
    (void)state;
    for (int bits = 0; bits < 8; bits++) {
        struct kv_layout_config c =
            mla_cfg(3, 7, 4, bits & 4 ? 2 : 1, 24, KV_BF16, bits & 1 ? KV_ORDER_HND : KV_ORDER_NHD,
                    bits & 2 ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR, bits & 4 ? 8 : 0);
        struct kv_layout lo;
        assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
        assert_int_equal(lo.kv_planes, 1);
        assert_true(lo.k_only);
        assert_int_equal(lo.stride_kv_elems, 0);
        assert_int_equal(lo.block_elems, 4 * c.num_heads * 24);
        assert_int_equal(lo.total_elems, 3 * 7 * (lo.block_elems + c.block_pad_elems));
        for (int64_t l = 0; l < 3; l++)
            for (int64_t b = 0; b < 7; b++)
                for (int64_t n = 0; n < 4; n++)
                    for (int64_t h = 0; h < c.num_heads; h++)
                        for (int64_t d = 0; d < 24; d += 5) {
                            int64_t off = -1;
                            assert_int_equal(kv_layout_offset(&lo, (uint32_t)l, 0, (uint32_t)b,
                                                              (uint32_t)n, (uint32_t)h,
                                                              (uint32_t)d, &off),
                                             KV_OK);
                            assert_int_equal(off, kvt_ref_offset_elems(&c, l, 0, b, n, h, d));
                        }
        /* runs of a block: L storage blocks in layer order */
        struct kv_byte_runs r;
        assert_int_equal(kv_layout_block_runs(&lo, 5, &r), KV_OK);
        const int64_t bb = lo.block_bytes;
        assert_int_equal(r.first_offset_bytes, kvt_ref_offset_elems(&c, 0, 0, 5, 0, 0, 0) * 2);
        if (r.run_count == 1) {
            assert_int_equal(r.run_bytes, 3 * bb);
        } else {
            assert_int_equal(r.run_count, 3);
            assert_int_equal(r.run_bytes, bb);
            assert_int_equal(r.run_stride_bytes, (kvt_ref_offset_elems(&c, 1, 0, 5, 0, 0, 0) -
                                                  kvt_ref_offset_elems(&c, 0, 0, 5, 0, 0, 0)) *
                                                     2);
        }
        /* no V */
        int64_t off = 0;
        assert_int_equal(kv_layout_offset(&lo, 0, 1, 0, 0, 0, 0, &off), KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("K-only");
        struct kv_view v;
        static char base[1];
        assert_int_equal(kv_layout_kv_view(&lo, base, (size_t)lo.total_bytes, 1, 1, &v),
                         KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("kv = 1 (V) of a K-only");
        /* fingerprints: apart from the two-plane layout of the same dims */
        struct kv_layout_config two = c;
        two.k_only = false;
        struct kv_layout lt;
        assert_int_equal(kv_layout_init(&two, &lt), KV_OK);
        assert_true(lt.fingerprint != lo.fingerprint);
        assert_true(lt.block_format_fingerprint != lo.block_format_fingerprint);
        /* back to a config, and over the wire */
        struct kv_layout_config back, dec;
        assert_int_equal(kv_layout_config_from(&lo, &back), KV_OK);
        assert_true(back.k_only);
        unsigned char wire[KV_LAYOUT_CONFIG_WIRE_BYTES];
        size_t len = 0;
        assert_int_equal(kv_layout_config_encode(&c, wire, sizeof(wire), &len), KV_OK);
        assert_int_equal(wire[88], 2);
        assert_int_equal(kv_layout_config_decode(wire, len, &dec), KV_OK);
        assert_string_equal(kvt_layout_config_diff(&dec, &c), "");
    }
    struct kv_layout_config c = mla_cfg(1, 2, 4, 1, 8, KV_F32, 0, 0, 0);
    c.kv_packed = true;
    struct kv_layout lo;
    assert_int_equal(kv_layout_init(&c, &lo), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("k_only and kv_packed");
}

/* ---- write / read / copy ---------------------------------------------------------- */

/* A strided [T][H][D] tensor (or [L][T][H][D]): D contiguous, rows padded. */
struct tensor {
    struct kv_view v;
    unsigned char *mem;
    size_t bytes;
};

static void tensor_make(struct tensor *t, kv_dtype dt, int64_t T, int64_t H, int64_t D,
                        uint64_t seed)
{
    const int64_t es = (int64_t)kv_dtype_size(dt);
    const int64_t hs = D + 8, ts = H * hs + 3;
    t->bytes = (size_t)(T * ts * es + 64);
    t->mem = kv__mem_alloc_aligned(64, t->bytes);
    assert_non_null(t->mem);
    fill_random(t->mem, t->bytes, seed);
    int64_t shape[3] = {T, H, D}, strides[3] = {ts, hs, 1};
    assert_int_equal(kv_view_from_strided(t->mem, t->bytes, dt, 3, shape, strides, 0, &t->v),
                     KV_OK);
}

static size_t tat(const struct tensor *t, int64_t tok, int64_t h, int64_t d)
{
    const int64_t es = (int64_t)kv_dtype_size(t->v.dtype);
    return (size_t)((t->v.offset + tok * t->v.strides[0] + h * t->v.strides[1] +
                     d * t->v.strides[2]) *
                    es);
}

static void test_mla_write_read_copy(void **state)
{
    (void)state;
    static const kv_dtype dts[3] = {KV_BF16, KV_FP8_E4M3, KV_F32};
    for (int bits = 0; bits < 6; bits++) {
        const int64_t H = bits & 1 ? 2 : 1, D = bits & 1 ? 24 : 576, N = 8, B = 300, L = 3;
        const kv_dtype dt = dts[bits % 3];
        struct kv_layout_config cfg =
            mla_cfg(L, B, N, H, D, dt, bits & 2 ? KV_ORDER_HND : KV_ORDER_NHD,
                    bits & 4 ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR, 16);
        struct pool p;
        pool_make(&p, &cfg, 0x100 + (uint64_t)bits);
        unsigned char *ref = snapshot(&p);
        /* write 19 tokens of layer 1 into blocks 290.. (one slot -1) */
        const int64_t T = 19;
        int64_t slots[19];
        for (int64_t i = 0; i < T; i++)
            slots[i] = (299 - i / N * 4) * N + i % N;
        slots[7] = -1;
        struct tensor k;
        tensor_make(&k, dt, T, H, D, 0x200 + (uint64_t)bits);
        assert_int_equal(kv_attn_write(p.c, 1, &k.v, NULL, slots, T, NULL), KV_OK);
        for (int64_t i = 0; i < T; i++)
            for (int64_t h = 0; h < H && slots[i] >= 0; h++)
                for (int64_t d = 0; d < D; d++)
                    memcpy(ref + at(&p, 1, slots[i] / N, slots[i] % N, h, d),
                           k.mem + tat(&k, i, h, d), (size_t)p.es);
        assert_memory_equal(p.mem, ref, p.bytes);
        /* a V tensor is refused, nothing written */
        struct tensor v;
        tensor_make(&v, dt, T, H, D, 0x300);
        assert_int_equal(kv_attn_write(p.c, 1, &k.v, &v.v, slots, T, NULL), KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("v given");
        const float ks[1] = {0.5f}, vs[1] = {0.25f};
        const struct kv_scales sc = {ks, vs, 1, 0};
        assert_int_equal(kv_attn_write(p.c, 1, &k.v, NULL, slots, T, &sc), KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("V scales given");
        assert_memory_equal(p.mem, ref, p.bytes);

        /* read two sequences (pages of blocks far from 0) into a strided k_out */
        const int32_t indptr[3] = {0, 2, 3}, indices[3] = {299, 295, 291}, last[2] = {3, 8};
        const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                    .n_seqs = 2,
                                    .indptr = indptr,
                                    .indices = indices,
                                    .last_page_len = last};
        const int64_t TR = N + 3 + 8;
        struct tensor out;
        tensor_make(&out, dt, TR, H, D, 0x400);
        unsigned char *want = malloc(out.bytes);
        assert_non_null(want);
        memcpy(want, out.mem, out.bytes);
        const int64_t seq_page[19] = {299, 299, 299, 299, 299, 299, 299, 299, 295, 295, 295,
                                      291, 291, 291, 291, 291, 291, 291, 291};
        for (int64_t i = 0; i < TR; i++) {
            const int64_t tok = i < 8 ? i : i < 11 ? i - 8 : i - 11;
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++)
                    memcpy(want + tat(&out, i, h, d), ref + at(&p, 2, seq_page[i], tok, h, d),
                           (size_t)p.es);
        }
        assert_int_equal(kv_attn_read(p.c, 2, &pg, &out.v, NULL, NULL), KV_OK);
        assert_memory_equal(out.mem, want, out.bytes);
        memcpy(out.mem, want, out.bytes);
        assert_int_equal(kv_attn_read(p.c, 2, &pg, &out.v, &v.v, NULL), KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("v_out given");
        assert_memory_equal(out.mem, want, out.bytes);

        /* copy blocks within the cache: every layer of 250 -> 298, 260 -> 12 */
        const struct kv_block_copy cp[2] = {{250, 298, 0}, {260, 12, 0}};
        assert_int_equal(kv_attn_copy_blocks(p.c, cp, 2), KV_OK);
        for (int i = 0; i < 2; i++)
            for (int64_t l = 0; l < L; l++)
                for (int64_t n = 0; n < N; n++)
                    for (int64_t h = 0; h < H; h++)
                        for (int64_t d = 0; d < D; d++)
                            memcpy(ref + at(&p, l, cp[i].dst, n, h, d),
                                   ref + at(&p, l, cp[i].src, n, h, d), (size_t)p.es);
        assert_memory_equal(p.mem, ref, p.bytes);

        /* copy_ex between two caches of one block format (other B, arrangement,
         * padding): layer 1 only; V and both planes refused */
        struct kv_layout_config c2 = cfg;
        c2.num_blocks = 280;
        c2.arrange = cfg.arrange == KV_ARRANGE_LAYER_MAJOR ? KV_ARRANGE_BLOCK_MAJOR
                                                           : KV_ARRANGE_LAYER_MAJOR;
        c2.block_pad_elems = 0;
        c2.block_stride_bytes = (N * H * D * p.es + 255) / 256 * 256 + 256;
        struct pool q;
        pool_make(&q, &c2, 0x500 + (uint64_t)bits);
        unsigned char *qref = snapshot(&q);
        const struct kv_block_copy cq[2] = {{299, 277, 0}, {291, 200, 0}};
        struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
        o.layer0 = 1, o.n_layers = 1;
        for (uint32_t planes = 2; planes <= 3; planes++) {
            o.planes = planes;
            assert_int_equal(kv_attn_copy_blocks_ex(q.c, p.c, cq, 2, &o), KV_ERR_INVALID_ARG);
            kvt_assert_msg_has("names V");
        }
        assert_memory_equal(q.mem, qref, q.bytes);
        o.planes = bits & 1 ? KV_ATTN_PLANE_K : 0;
        assert_int_equal(kv_attn_copy_blocks_ex(q.c, p.c, cq, 2, &o), KV_OK);
        for (int i = 0; i < 2; i++)
            for (int64_t n = 0; n < N; n++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++)
                        memcpy(qref + at(&q, 1, cq[i].dst, n, h, d),
                               ref + at(&p, 1, cq[i].src, n, h, d), (size_t)p.es);
        assert_memory_equal(q.mem, qref, q.bytes);
        assert_memory_equal(p.mem, ref, p.bytes);
        /* a two-plane cache of the same dims is another block format */
        struct kv_layout_config c3 = cfg;
        c3.k_only = false;
        struct pool r;
        pool_make(&r, &c3, 0x600);
        assert_int_equal(kv_attn_copy_blocks_ex(r.c, p.c, cq, 1, NULL), KV_ERR_MISMATCH);
        kvt_assert_msg_has("k_only 1 (src) vs 0 (dst)");
        pool_free(&r);

        /* decode entries of two-plane caches refuse the K-only layout */
        struct tensor qt, ot;
        tensor_make(&qt, KV_F32, 2, H, D, 0x700);
        tensor_make(&ot, KV_F32, 2, H, D, 0x800);
        assert_int_equal(kv_attn_decode(p.c, 0, &qt.v, &pg, 1.0f, NULL, &ot.v),
                         KV_ERR_INVALID_ARG);
        kvt_assert_msg_has("kv_attn_decode_mla");
        kv__mem_free(qt.mem);
        kv__mem_free(ot.mem);

        free(qref);
        pool_free(&q);
        free(want);
        kv__mem_free(out.mem);
        kv__mem_free(v.mem);
        kv__mem_free(k.mem);
        free(ref);
        pool_free(&p);
    }
}

/* ---- plans, TP, pack ------------------------------------------------------------- */

/* dst_ref gets layers [sl0, sl0 + nl) of src's blocks onto [dl0, ...) of
 * dst's, token by token for n_tokens (every head). */
static void ref_move(const struct pool *src, const unsigned char *sm, const uint32_t *sb,
                     const struct pool *dst, unsigned char *dm, const uint32_t *db,
                     int64_t n_tokens, int64_t sl0, int64_t dl0, int64_t nl)
{
    const int64_t Ns = src->cfg.block_tokens, Nd = dst->cfg.block_tokens;
    for (int64_t t = 0; t < n_tokens; t++)
        for (int64_t l = 0; l < nl; l++)
            for (int64_t h = 0; h < src->cfg.num_heads; h++)
                for (int64_t d = 0; d < src->cfg.head_dim; d++)
                    memcpy(dm + at(dst, dl0 + l, db[t / Nd], t % Nd, h, d),
                           sm + at(src, sl0 + l, sb[t / Ns], t % Ns, h, d), (size_t)src->es);
}

static void test_mla_plans(void **state)
{
    (void)state;
    const int64_t D = 576;
    struct kv_layout_config pc =
        mla_cfg(4, 64, 16, 1, D, KV_BF16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0);
    struct pool pre;
    pool_make(&pre, &pc, 0x1000);
    unsigned char *pre_ref = snapshot(&pre);
    const uint32_t sb[4] = {63, 40, 51, 33};

    /* a layer range: source layers 1..2 onto layers 3..4 of a decoder of 6
     * layers, block-major, padded, pages of 8 */
    struct kv_layout_config dc =
        mla_cfg(6, 90, 8, 1, D, KV_BF16, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, 96);
    struct pool dec;
    pool_make(&dec, &dc, 0x1100);
    unsigned char *dec_ref = snapshot(&dec);
    struct kv_plan_config pcfg = KV_PLAN_CONFIG_INIT;
    pcfg.src_layer0 = 1, pcfg.dst_layer0 = 3, pcfg.n_layers = 2;
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&pre.c.layout, &dec.c.layout, &pcfg, &plan), KV_OK);
    struct kv_plan_stats ps;
    assert_int_equal(kv_plan_stats_get(plan, &ps), KV_OK);
    assert_int_equal(ps.rows, 2 * 1 * 16 * 1); /* n_layers x one plane x window x heads */
    const uint32_t db[8] = {89, 70, 81, 60, 77, 88, 64, 71};
    assert_int_equal(kv_plan_copy(plan, pre.c, sb, 4, dec.c, db, 8, 64), KV_OK);
    ref_move(&pre, pre_ref, sb, &dec, dec_ref, db, 64, 1, 3, 2);
    assert_memory_equal(dec.mem, dec_ref, dec.bytes);
    assert_memory_equal(pre.mem, pre_ref, pre.bytes);
    kv_plan_destroy(plan);

    /* pack the same layer range, unpack it into the decoder elsewhere */
    struct kv_plan_config pk = KV_PLAN_CONFIG_INIT;
    pk.src_layer0 = 1, pk.n_layers = 2;
    uint64_t need = 0;
    assert_int_equal(kv_pack_size(&pre.c.layout, &pk, 64, &need), KV_OK);
    unsigned char *buf = kv__mem_alloc_aligned(64, (size_t)need);
    assert_non_null(buf);
    size_t got = 0;
    assert_int_equal(kv_pack(NULL, pre.c, sb, 4, 64, buf, (size_t)need, &got, &pk), KV_OK);
    assert_int_equal(buf[108], 2); /* planes: K only */
    struct kv_pack_info info;
    assert_int_equal(kv_pack_inspect(buf, got, &info), KV_OK);
    assert_true(info.source.k_only && info.wire.k_only);
    assert_int_equal(info.wire.kv_planes, 1);
    const uint32_t db2[8] = {10, 11, 30, 31, 50, 52, 54, 56};
    assert_int_equal(kv_unpack(NULL, buf, got, dec.c, db2, 8, &pcfg), KV_OK);
    ref_move(&pre, pre_ref, sb, &dec, dec_ref, db2, 64, 1, 3, 2);
    assert_memory_equal(dec.mem, dec_ref, dec.bytes);
    kv__mem_free(buf);

    /* heterogeneous TP for MLA: two decode ranks of other layouts (TP 2: in
     * MLA every rank holds the whole latent, there is no KV head to slice)
     * each receive every layer of the whole latent row */
    struct kv_layout_config r0 =
        mla_cfg(4, 70, 16, 1, D, KV_BF16, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, 0);
    r0.block_stride_bytes = 16 * D * 2 + 512;
    r0.align_bytes = 512;
    struct kv_layout_config r1 =
        mla_cfg(4, 40, 32, 1, D, KV_BF16, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 64);
    const struct kv_layout_config *ranks[2] = {&r0, &r1};
    const uint32_t rb[2][4] = {{69, 5, 60, 33}, {39, 21, 0, 0}};
    for (int r = 0; r < 2; r++) {
        struct pool d;
        pool_make(&d, ranks[r], 0x1200 + (uint64_t)r);
        unsigned char *d_ref = snapshot(&d);
        assert_int_equal(kv_plan_create(&pre.c.layout, &d.c.layout, NULL, &plan), KV_OK);
        const uint32_t nd = (uint32_t)(64 / ranks[r]->block_tokens);
        assert_int_equal(kv_plan_copy(plan, pre.c, sb, 4, d.c, rb[r], nd, 64), KV_OK);
        ref_move(&pre, pre_ref, sb, &d, d_ref, rb[r], 64, 0, 0, 4);
        assert_memory_equal(d.mem, d_ref, d.bytes);
        kv_plan_destroy(plan);
        /* a head slice of the latent does not exist */
        struct kv_plan_config hs = KV_PLAN_CONFIG_INIT;
        hs.src_head0 = 1, hs.n_heads = 1;
        assert_int_equal(kv_plan_create(&pre.c.layout, &d.c.layout, &hs, &plan), KV_ERR_BAD_SHAPE);
        free(d_ref);
        pool_free(&d);
    }

    /* K-only <-> two planes refused, both ways */
    struct kv_layout_config two = pc;
    two.k_only = false;
    struct kv_layout lt;
    assert_int_equal(kv_layout_init(&two, &lt), KV_OK);
    plan = NULL;
    assert_int_equal(kv_plan_create(&pre.c.layout, &lt, NULL, &plan), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("source K-only, destination K and V planes");
    assert_int_equal(kv_plan_create(&lt, &pre.c.layout, NULL, &plan), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("source K and V planes, destination K-only");
    assert_null(plan);

    free(dec_ref);
    pool_free(&dec);
    free(pre_ref);
    pool_free(&pre);
}

/* ---- decode ------------------------------------------------------------------------ */

/* Independent decoders of the cache's elements. */
static double ref_bf16(const unsigned char *p)
{
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static double ref_f16(const unsigned char *p) /* normals only (how the test fills it) */
{
    const unsigned u = p[0] | p[1] << 8, e = (u >> 10) & 31, m = u & 1023;
    return (u & 0x8000 ? -1.0 : 1.0) * ldexp(1.0 + m / 1024.0, (int)e - 15);
}
static double ref_e4m3(const unsigned char *p)
{
    const unsigned e = (p[0] >> 3) & 15, m = p[0] & 7;
    const double v = e ? ldexp(1.0 + m / 8.0, (int)e - 7) : ldexp(m / 8.0, -6);
    return p[0] & 0x80 ? -v : v;
}
static double ref_e5m2(const unsigned char *p)
{
    const unsigned e = (p[0] >> 2) & 31, m = p[0] & 3;
    const double v = e ? ldexp(1.0 + m / 4.0, (int)e - 15) : ldexp(m / 4.0, -14);
    return p[0] & 0x80 ? -v : v;
}
static double ref_elem(kv_dtype dt, const unsigned char *p)
{
    float f;
    switch (dt) {
    case KV_BF16:
        return ref_bf16(p);
    case KV_F16:
        return ref_f16(p);
    case KV_FP8_E4M3:
        return ref_e4m3(p);
    case KV_FP8_E5M2:
        return ref_e5m2(p);
    default:
        memcpy(&f, p, 4);
        return f;
    }
}

/* a random finite element of dt of magnitude < 2 */
static void rand_elem(kv_dtype dt, unsigned char *p, uint64_t *rng)
{
    const uint64_t r = kvt_rand(rng);
    float f = (float)((int64_t)(r % 2001) - 1000) / 1000.0f;
    uint32_t u;
    switch (dt) {
    case KV_BF16:
        memcpy(&u, &f, 4);
        p[0] = (unsigned char)(u >> 16), p[1] = (unsigned char)(u >> 24);
        break;
    case KV_F16: { /* exponent 10..15: [2^-5, 2) */
        const unsigned v = (unsigned)((r >> 20) & 0x8000) | (unsigned)(10 + (r >> 8) % 6) << 10 |
                           (unsigned)(r >> 32) % 1024;
        p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8);
        break;
    }
    case KV_FP8_E4M3: /* exponents 0..7: |x| < 2 */
        p[0] = (unsigned char)((r >> 40) & 0x80) | (unsigned char)((r >> 8) % 8) << 3 |
               (unsigned char)(r % 8);
        break;
    case KV_FP8_E5M2: /* exponents 0..15: |x| < 2 */
        p[0] = (unsigned char)((r >> 40) & 0x80) | (unsigned char)((r >> 8) % 16) << 2 |
               (unsigned char)(r % 4);
        break;
    default:
        memcpy(p, &f, 4);
        break;
    }
}

/* ---- the attention fixtures --------------------------------------------------------- */

enum { AF_N = 16, AF_B = 200, AF_MAX_SEQS = 6, AF_COLS = 9, AF_IDS = 60 };

/* The float64-reference cases' cache and pages: a latent cache of 2 layers
 * x 200 blocks of 16 tokens (NHD, blocks padded by 40 elements, arrangement
 * arr), layer 1 finite random values of dt (rand_elem), the rest garbage;
 * S sequences of lens[s] tokens on pages far from 0 (ids 199 down to 140,
 * shuffled) as CSR (indptr, indices, last) and as a block table of 9
 * columns (table: -1 past each sequence's pages, never read; seq_lens); pg
 * the one asked for. pg points into the struct: an afix is never copied. */
struct afix {
    struct pool p;
    unsigned char *before; /* the pool as filled: every call leaves it so */
    double *kref;          /* [B][N][D]: layer 1's elements by ref_elem, once */
    uint64_t rng;          /* past the cache and the pages: for q */
    int32_t indptr[AF_MAX_SEQS + 1], indices[AF_IDS], last[AF_MAX_SEQS];
    int32_t table[AF_MAX_SEQS * AF_COLS];
    int64_t seq_lens[AF_MAX_SEQS];
    struct kv_pages pg;
};

static void afix_init(struct afix *f, kv_dtype dt, int64_t D, kv_arrange arr, bool block_table,
                      int S, const int64_t *lens, uint64_t seed)
{
    const int64_t N = AF_N, B = AF_B;
    struct kv_layout_config cfg = mla_cfg(2, B, N, 1, D, dt, KV_ORDER_NHD, arr, 40);
    assert_true(S <= AF_MAX_SEQS);
    memset(f, 0, sizeof(*f));
    pool_make(&f->p, &cfg, seed);
    f->rng = seed * 31 + 7;
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < N; n++)
            for (int64_t d = 0; d < D; d++)
                rand_elem(dt, f->p.mem + at(&f->p, 1, b, n, 0, d), &f->rng);
    f->before = snapshot(&f->p);
    int32_t pool_ids[AF_IDS];
    for (int i = 0; i < AF_IDS; i++)
        pool_ids[i] = (int32_t)(B - 1 - i);
    for (int i = AF_IDS - 1; i > 0; i--) {
        const int j = (int)kvt_range(&f->rng, 0, i);
        const int32_t x = pool_ids[i];
        pool_ids[i] = pool_ids[j], pool_ids[j] = x;
    }
    for (int i = 0; i < AF_MAX_SEQS * AF_COLS; i++)
        f->table[i] = -1;
    int np = 0;
    for (int s = 0; s < S; s++) {
        const int64_t pages = (lens[s] + N - 1) / N;
        assert_true(pages <= AF_COLS && np + pages <= AF_IDS);
        for (int64_t i = 0; i < pages; i++) {
            f->indices[np] = pool_ids[np];
            f->table[s * AF_COLS + i] = pool_ids[np];
            np++;
        }
        f->indptr[s + 1] = np;
        f->last[s] = lens[s] ? (int32_t)((lens[s] - 1) % N + 1) : 0;
        f->seq_lens[s] = lens[s];
    }
    /* the reference reads each element of the pages many times (every
     * query row and head): converted once here, by the same ref_elem and at
     * (only the pages' blocks: the reference reads no other) */
    f->kref = malloc(sizeof(double) * (size_t)(B * N * D));
    assert_non_null(f->kref);
    for (int i = 0; i < np; i++)
        for (int64_t n = 0, b = f->indices[i]; n < N; n++)
            for (int64_t d = 0; d < D; d++)
                f->kref[(b * N + n) * D + d] = ref_elem(dt, f->p.mem + at(&f->p, 1, b, n, 0, d));
    if (block_table)
        f->pg = (struct kv_pages){.format = KV_PAGES_BLOCK_TABLE,
                                  .n_seqs = (uint32_t)S,
                                  .block_table = f->table,
                                  .block_table_cols = AF_COLS,
                                  .seq_lens = f->seq_lens};
    else
        f->pg = (struct kv_pages){.format = KV_PAGES_CSR,
                                  .n_seqs = (uint32_t)S,
                                  .indptr = f->indptr,
                                  .indices = f->indices,
                                  .last_page_len = f->last};
}

static void afix_free(struct afix *f)
{
    free(f->before);
    free(f->kref);
    pool_free(&f->p);
}

/* q [rows][Hq][D] of q_dt (f32 or bf16), heads padded by 4 elements and
 * rows by qpad, values in [-1, 1] from rng (q: as floats, exactly q_dt's
 * values; qmem: the view's memory, qes bytes an element); out [rows][Hq][dv]
 * of out_dt, heads padded by 3 elements and rows by opad, garbage from seed;
 * out0 out's first bytes. */
struct qout {
    int64_t qhs, qts, ohs, ots, oes, qes;
    float *q;
    unsigned char *qmem, *out, *out0;
    size_t qn, obytes;
    struct kv_view qv, ov;
};

static void qout_make(struct qout *b, int64_t rows, int64_t hq, int64_t D, int64_t dv, int64_t qpad,
                      int64_t opad, kv_dtype q_dt, kv_dtype out_dt, uint64_t *rng, uint64_t seed)
{
    b->qhs = D + 4, b->qts = hq * b->qhs + qpad;
    b->ohs = dv + 3, b->ots = hq * b->ohs + opad;
    b->oes = (int64_t)kv_dtype_size(out_dt);
    b->qn = (size_t)(rows * b->qts);
    b->obytes = (size_t)(rows * b->ots * b->oes);
    b->q = malloc(b->qn * sizeof(float));
    b->out = malloc(b->obytes), b->out0 = malloc(b->obytes);
    assert_true(b->q && b->out && b->out0);
    assert_true(q_dt == KV_F32 || q_dt == KV_BF16);
    b->qes = (int64_t)kv_dtype_size(q_dt);
    b->qmem = q_dt == KV_F32 ? (unsigned char *)b->q : malloc(b->qn * (size_t)b->qes);
    assert_true(b->qmem);
    for (size_t i = 0; i < b->qn; i++) {
        b->q[i] = (float)((int64_t)kvt_range(rng, 0, 2000) - 1000) / 1000.0f;
        if (q_dt == KV_BF16) { /* truncated to bf16; the reference gets that value */
            uint32_t u;
            memcpy(&u, &b->q[i], 4);
            unsigned char *e = b->qmem + i * 2;
            e[0] = (unsigned char)(u >> 16), e[1] = (unsigned char)(u >> 24);
            b->q[i] = (float)ref_bf16(e);
        }
    }
    fill_random(b->out, b->obytes, seed);
    memcpy(b->out0, b->out, b->obytes);
    int64_t qs[3] = {rows, hq, D}, qst[3] = {b->qts, b->qhs, 1};
    int64_t os[3] = {rows, hq, dv}, ost[3] = {b->ots, b->ohs, 1};
    assert_int_equal(
        kv_view_from_strided(b->qmem, b->qn * (size_t)b->qes, q_dt, 3, qs, qst, 0, &b->qv), KV_OK);
    assert_int_equal(kv_view_from_strided(b->out, b->obytes, out_dt, 3, os, ost, 0, &b->ov),
                     KV_OK);
}

static void qout_free(struct qout *b)
{
    if (b->qmem != (unsigned char *)b->q)
        free(b->qmem);
    free(b->q);
    free(b->out);
    free(b->out0);
}

/* The float64 attention of qq [D] over tokens [t0, t1) of sequence s of f
 * (layer 1; keys all D dims of the latent, values its first dv): scores
 * dot x ks x scale, cap x tanh(score / cap) when cap > 0; o [dv] the
 * softmax-weighted sum of the values (0 over no token). Returns the
 * scores' log-sum-exp. sco: room for t1 scores. */
static double ref_attend(const struct afix *f, int64_t s, const float *qq, int64_t D, int64_t dv,
                         int64_t t0, int64_t t1, double ks, float scale, float cap, double *sco,
                         double *o)
{
    const int64_t N = AF_N;
    double mx = -INFINITY, sum = 0.0;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t blk = f->indices[f->indptr[s] + t / N];
        const double *kr = f->kref + (blk * N + t % N) * D;
        double dot = 0.0;
        for (int64_t d = 0; d < D; d++)
            dot += (double)qq[d] * kr[d];
        double x = dot * ks * scale;
        if (cap > 0.0f)
            x = cap * tanh(x / cap);
        sco[t] = x;
        mx = x > mx ? x : mx;
    }
    for (int64_t j = 0; j < dv; j++)
        o[j] = 0.0;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t blk = f->indices[f->indptr[s] + t / N];
        const double *kr = f->kref + (blk * N + t % N) * D;
        const double w = exp(sco[t] - mx);
        sum += w;
        for (int64_t j = 0; j < dv; j++)
            o[j] += w * ks * kr[j];
    }
    for (int64_t j = 0; j < dv; j++)
        o[j] = t1 > t0 ? o[j] / sum : 0.0;
    return mx + log(sum);
}

/* Element e of out (bf16 or f32) against want: within 1e-2 relative + 1e-3
 * for bf16, 1e-4 relative + 2e-5 for f32; *got the element. */
static bool out_close(const unsigned char *out, kv_dtype out_dt, int64_t e, double want,
                      double *got)
{
    if (out_dt == KV_BF16) {
        *got = ref_bf16(out + e * 2);
    } else {
        float f;
        memcpy(&f, out + e * 4, 4);
        *got = f;
    }
    const double tol = out_dt == KV_BF16 ? 1e-2 * fabs(want) + 1e-3 : 2e-5 + 1e-4 * fabs(want);
    return fabs(*got - want) <= tol;
}

/* Every one of n elements of es bytes of got not marked in written equal
 * to was's. */
static void check_untouched(const void *got, const void *was, const bool *written, int64_t n,
                            int64_t es, const char *what)
{
    const unsigned char *g = got, *w = was;
    for (int64_t e = 0; e < n; e++)
        if (!written[e] && memcmp(g + e * es, w + e * es, (size_t)es) != 0)
            fail_msg("%s element %" PRId64 " was written", what, e);
}

/* The refusal tests' fixture: a bf16 latent of D 64 (2 layers, 16 blocks,
 * random bytes); S (1 or 2) sequences of 5 tokens on block 9 and 20 on
 * blocks 14, 3 (CSR); q [rows][8][64] f32 zeros; out [rows][8][48] (o)
 * and [rows][8][64] (o_big) over one buffer of 0x5a bytes. */
struct rfix {
    struct kv_layout_config cfg;
    struct pool p;
    struct kv_pages pg;
    float *qb, *ob;
    size_t qbytes, obytes;
    struct kv_view q, o, o_big;
};

static const int32_t rfix_indptr[3] = {0, 1, 3}, rfix_indices[3] = {9, 14, 3},
                     rfix_last[2] = {5, 4};

static void rfix_init(struct rfix *r, uint32_t S, int64_t rows, uint64_t seed)
{
    memset(r, 0, sizeof(*r));
    r->cfg = mla_cfg(2, 16, 16, 1, 64, KV_BF16, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0);
    pool_make(&r->p, &r->cfg, seed);
    r->pg = (struct kv_pages){.format = KV_PAGES_CSR,
                              .n_seqs = S,
                              .indptr = rfix_indptr,
                              .indices = rfix_indices,
                              .last_page_len = rfix_last};
    r->qbytes = r->obytes = (size_t)(rows * 8 * 64) * sizeof(float);
    r->qb = calloc(1, r->qbytes), r->ob = malloc(r->obytes);
    assert_true(r->qb && r->ob);
    memset(r->ob, 0x5a, r->obytes);
    int64_t qs[3] = {rows, 8, 64}, os[3] = {rows, 8, 48}, ob_s[3] = {rows, 8, 64};
    assert_int_equal(kv_view_init(r->qb, r->qbytes, KV_F32, 3, qs, &r->q), KV_OK);
    assert_int_equal(kv_view_init(r->ob, r->obytes, KV_F32, 3, os, &r->o), KV_OK);
    assert_int_equal(kv_view_init(r->ob, r->obytes, KV_F32, 3, ob_s, &r->o_big), KV_OK);
}

static void rfix_free(struct rfix *r)
{
    free(r->qb);
    free(r->ob);
    pool_free(&r->p);
}

/* The arguments of one call over a refusal fixture's pages, in the call's
 * order: kv_attn_prefill_mla when prefill, else kv_attn_decode_mla (qo
 * and opts unused). */
struct mla_args {
    bool prefill;
    uint32_t layer;
    const struct kv_view *q;
    const int32_t *qo;
    int64_t dv;
    float scale;
    const struct kv_scales *sc;
    const struct kv_view *out;
    const struct kv_attn_opts *opts;
};

static kv_status mla_call(const struct rfix *r, const struct mla_args *a, struct kv_paged_cache c)
{
    return a->prefill ? kv_attn_prefill_mla(c, a->layer, a->q, a->qo, &r->pg, a->dv, a->scale,
                                            a->sc, a->out, a->opts)
                      : kv_attn_decode_mla(c, a->layer, a->q, &r->pg, a->dv, a->scale, a->sc,
                                           a->out);
}

/* A refused call: its arguments, its status, and (NULL: not checked) two
 * parts of the last-error message. */
struct refusal {
    struct mla_args a;
    kv_status st;
    const char *msg, *msg2;
};

static void check_refusals(const struct rfix *r, const struct refusal *t, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const kv_status st = mla_call(r, &t[i].a, r->p.c);
        if (st != t[i].st)
            fail_msg("refusal %zu: %s (%s), expected %s", i, kv_status_name(st), kv_last_error(),
                     kv_status_name(t[i].st));
        if (t[i].msg)
            kvt_assert_msg_has(t[i].msg);
        if (t[i].msg2)
            kvt_assert_msg_has(t[i].msg2);
    }
}

/* The call ok refuses a two-plane cache and a K-only one of two KV heads
 * (r's dims otherwise), the message naming the layout and what (MLA decode
 * or MLA prefill). */
static void check_refuses_layouts(const struct rfix *r, const struct mla_args *ok, uint64_t seed,
                                  const char *what)
{
    struct kv_layout_config two = r->cfg;
    two.k_only = false;
    struct pool t;
    pool_make(&t, &two, seed);
    assert_int_equal(mla_call(r, ok, t.c), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("K and V planes and H = 1");
    kvt_assert_msg_has(what);
    pool_free(&t);
    struct kv_layout_config h2 = r->cfg;
    h2.num_heads = 2;
    pool_make(&t, &h2, seed + 1);
    assert_int_equal(mla_call(r, ok, t.c), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("H = 2 KV heads");
    pool_free(&t);
}

/* The call ok over r's cache succeeds and counts once as kernel on the
 * canonical path. */
static void check_counted(const struct rfix *r, const struct mla_args *ok,
                          enum kv_attn_kernel kernel)
{
    struct kv_attn_stats st0, st1;
    kv_attn_stats_get(&st0);
    assert_int_equal(mla_call(r, ok, r->p.c), KV_OK);
    kv_attn_stats_get(&st1);
    assert_int_equal(st1.cpu[kernel][KV_ATTN_PATH_CANONICAL],
                     st0.cpu[kernel][KV_ATTN_PATH_CANONICAL] + 1);
}

/* KVT_NO_GRID=1 (scripts/cpu-variants.sh): the cases of the CUDA bodies on
 * the CPU grid emulator are left out. They are scalar code the CPU model
 * does not change, run in every native run, and the emulator's fiber
 * switches are the slowest thing under QEMU. */
static bool no_grid_cases(void)
{
    const char *v = getenv("KVT_NO_GRID");
    return v && strcmp(v, "1") == 0;
}

/* KVT_EMULATED_QUICK=1 (scripts/cpu-variants.sh --quick, in .ci/run):
 * the prefill comparison keeps one case per dtype and per option (the
 * ones marked `emu`), under QEMU's slow AVX2 emulation; every case runs
 * natively in every other stage, and without --quick under QEMU too. */
static bool emulated_quick(void)
{
    const char *v = getenv("KVT_EMULATED_QUICK");
    return v && strcmp(v, "1") == 0;
}

struct dcase {
    kv_dtype dt;
    int64_t D, dv, hq;
    kv_arrange arr;
    bool block_table, portable, scaled;
    kv_dtype out_dt;
    bool grid; /* the CUDA body on the CPU grid emulator (kv__grid_attn_decode_mla) */
};

/* The SIMD path is taken exactly when it should (not portable, D and dv
 * multiples of 8, a CPU with AVX2, FMA and F16C: scripts/cpu-variants.sh
 * runs this on CPUs without them), and a job of q's dtype over f's cache
 * takes the dot products exactly when it should: q bf16, the cache bf16 or
 * fp8, D % 32 == 0, the SIMD path, not kv__attn_avx2_only, a CPU with
 * AVX512_BF16. */
static void check_bdot_choice(const struct kv__attn_job *j, bool portable, bool avx2_only)
{
    const struct kv_layout *lo = &j->cache.layout;
    const bool simd = kv__mla_simd(lo->head_dim, j->mla_dv);
    assert_true(simd ==
                (!portable && lo->head_dim % 8 == 0 && j->mla_dv % 8 == 0 && kvt_cpu_has_avx2()));
    const bool want = simd && !avx2_only && j->q.dtype == KV_BF16 &&
                      (lo->dtype == KV_BF16 || lo->elem_bytes == 1) && lo->head_dim % 32 == 0 &&
                      kvt_cpu_has_bf16dot();
    assert_true(kv__mla_bdot_ok(j, simd) == want);
}

/* kv_attn_decode_mla over four sequences of 0, 1, 45 and 130 tokens (the
 * afix cache and pages), q and out with padded heads (out's gaps checked
 * untouched), against a float64 reference. */
static void run_decode_case(const struct dcase *k, bool qbf16, bool avx2_only, uint64_t seed)
{
    enum { S = 4 };
    const int64_t D = k->D, dv = k->dv, hq = k->hq;
    const int64_t lens[S] = {0, 1, 45, 130};
    struct afix f;
    afix_init(&f, k->dt, D, k->arr, k->block_table, S, lens, seed);
    struct qout b;
    qout_make(&b, S, hq, D, dv, 0, 0, qbf16 ? KV_BF16 : KV_F32, k->out_dt, &f.rng, seed + 1);
    const float scale = 1.0f / sqrtf((float)D), kscale[2] = {0.37f, 0.37f};
    const struct kv_scales sc = {kscale, NULL, 1, 0};
    if (k->grid) {
        struct kv__attn_job j;
        struct kv_paged_cache dev = f.p.c;
        dev.mem = KV_MEM_PINNED; /* what a CUDA entry takes; host memory here */
        assert_int_equal(kv__attn_decode_mla_check("kv_attn_decode_mla_cuda", &dev, 1, &b.qv,
                                                   &f.pg, dv, scale, k->scaled ? &sc : NULL,
                                                   &b.ov, &j),
                         KV_OK);
        const kv_status st = kv__grid_attn_decode_mla(&j);
        kv__attn_job_free(&j);
        if (st != KV_OK)
            fail_msg("kv__grid_attn_decode_mla: %s: %s", kv_status_name(st), kv_last_error());
    } else {
        kv__attn_test_tune(-1, k->portable);
        kv__attn_avx2_only = avx2_only;
        struct kv__attn_job j;
        assert_int_equal(kv__attn_decode_mla_check("kv_attn_decode_mla", &f.p.c, 1, &b.qv, &f.pg,
                                                   dv, scale, k->scaled ? &sc : NULL, &b.ov, &j),
                         KV_OK);
        check_bdot_choice(&j, k->portable, avx2_only);
        kv__attn_job_free(&j);
        assert_int_equal(kv_attn_decode_mla(f.p.c, 1, &b.qv, &f.pg, dv, scale,
                                            k->scaled ? &sc : NULL, &b.ov),
                         KV_OK);
        kv__attn_avx2_only = false;
        kv__attn_test_tune(-1, false);
    }
    assert_memory_equal(f.p.mem, f.before, f.p.bytes);
    /* float64 reference, every sequence, head and dim; the gaps untouched */
    const double ks = k->scaled ? 0.37 : 1.0;
    double *sco = malloc(sizeof(double) * 130), *o = malloc(sizeof(double) * (size_t)dv);
    bool *is_out = calloc((size_t)(S * b.ots), 1);
    assert_true(sco && o && is_out);
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < hq; h++) {
            ref_attend(&f, s, b.q + s * b.qts + h * b.qhs, D, dv, 0, lens[s], ks, scale, 0.0f, sco,
                       o);
            for (int64_t j = 0; j < dv; j++) {
                const int64_t e = s * b.ots + h * b.ohs + j;
                double got;
                is_out[e] = true;
                if (!out_close(b.out, k->out_dt, e, o[j], &got))
                    fail_msg("dt %s D %" PRId64 " dv %" PRId64 " Hq %" PRId64 " seq %" PRId64
                             " head %" PRId64 " dim %" PRId64
                             ": got %.7g, float64 reference %.7g",
                             kv_dtype_name(k->dt), D, dv, hq, s, h, j, got, o[j]);
            }
        }
    check_untouched(b.out, b.out0, is_out, S * b.ots, b.oes, "out (a gap between heads)");
    free(is_out);
    free(sco);
    free(o);
    qout_free(&b);
    afix_free(&f);
}

static void test_mla_decode_vs_float64(void **state)
{
    (void)state;
    const struct dcase cases[] = {
        {KV_BF16, 576, 512, 128, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, false},
        {KV_BF16, 576, 512, 16, KV_ARRANGE_BLOCK_MAJOR, true, false, false, KV_F32, false},
        {KV_BF16, 576, 512, 1, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_BF16, false},
        {KV_FP8_E4M3, 576, 512, 16, KV_ARRANGE_BLOCK_MAJOR, false, false, true, KV_F32, false},
        {KV_FP8_E4M3, 576, 512, 3, KV_ARRANGE_LAYER_MAJOR, false, true, true, KV_F32, false},
        {KV_FP8_E5M2, 64, 48, 6, KV_ARRANGE_LAYER_MAJOR, true, false, true, KV_F32, false},
        {KV_FP8_E5M2, 64, 48, 6, KV_ARRANGE_BLOCK_MAJOR, false, true, false, KV_F32, false},
        {KV_BF16, 576, 512, 16, KV_ARRANGE_LAYER_MAJOR, false, true, false, KV_F32, false},
        {KV_F32, 24, 16, 16, KV_ARRANGE_BLOCK_MAJOR, false, false, true, KV_F32, false},
        {KV_F16, 40, 32, 5, KV_ARRANGE_LAYER_MAJOR, true, false, false, KV_F32, false},
        {KV_F32, 20, 12, 3, KV_ARRANGE_BLOCK_MAJOR, false, false, false, KV_F32, false},
        /* the CUDA body (kv__decode_mla_body) on the emulated grid */
        {KV_BF16, 576, 512, 16, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, true},
        {KV_FP8_E4M3, 576, 512, 5, KV_ARRANGE_BLOCK_MAJOR, true, false, true, KV_BF16, true},
        {KV_F16, 40, 32, 11, KV_ARRANGE_BLOCK_MAJOR, false, false, false, KV_F32, true},
        {KV_F32, 20, 12, 1, KV_ARRANGE_LAYER_MAJOR, false, false, true, KV_F32, true},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        if (!cases[i].grid || !no_grid_cases())
            run_decode_case(&cases[i], false, false, 0x5000 + i);
    /* q bf16: the bf16 dot-product scores where the CPU has them (Hq a
     * multiple of 4 and not, bf16 and both fp8 caches), the same with them
     * turned off (mode 1), fp8 rows through F16C where the CPU has the
     * byte tables' AVX512_VBMI (mode 2: kv__attn_fp8_via_f16), and where
     * they do not apply (f16 cache, D % 32 != 0) */
    const struct {
        struct dcase c;
        int mode;
    } qcases[] = {
        {{KV_BF16, 576, 512, 16, KV_ARRANGE_BLOCK_MAJOR, true, false, false, KV_F32, false}, false},
        {{KV_BF16, 576, 512, 7, KV_ARRANGE_LAYER_MAJOR, false, false, true, KV_BF16, false}, false},
        {{KV_FP8_E4M3, 576, 512, 16, KV_ARRANGE_LAYER_MAJOR, false, false, true, KV_F32, false},
         false},
        {{KV_FP8_E5M2, 64, 48, 6, KV_ARRANGE_BLOCK_MAJOR, true, false, true, KV_F32, false}, false},
        {{KV_BF16, 576, 512, 16, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, false}, true},
        {{KV_F16, 64, 64, 4, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, false}, false},
        {{KV_BF16, 40, 32, 4, KV_ARRANGE_BLOCK_MAJOR, false, false, false, KV_F32, false}, false},
        {{KV_FP8_E4M3, 576, 512, 16, KV_ARRANGE_BLOCK_MAJOR, true, false, true, KV_F32, false}, 2},
        {{KV_FP8_E5M2, 64, 48, 5, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_BF16, false}, 2},
    };
    for (size_t i = 0; i < sizeof(qcases) / sizeof(qcases[0]); i++) {
        kv__attn_fp8_via_f16 = qcases[i].mode == 2;
        run_decode_case(&qcases[i].c, true, qcases[i].mode == 1, 0x5100 + i);
        kv__attn_fp8_via_f16 = false;
    }
}

static void test_mla_decode_refusals(void **state)
{
    (void)state;
    struct rfix r; /* one sequence of 5 tokens on block 9 */
    rfix_init(&r, 1, 1, 0x77);
    const struct kv_paged_cache c = r.p.c;
    const struct kv_view *q = &r.q, *o = &r.o;
    const struct mla_args ok = {false, 1, q, NULL, 48, 0.1f, NULL, o, NULL};
    assert_int_equal(mla_call(&r, &ok, c), KV_OK);
    /* dv outside [1, D], out not [S][Hq][dv], V scales, layer, q's D */
    const float s1[1] = {1.0f};
    const struct kv_scales vs = {s1, s1, 1, 0};
    const struct refusal bad[] = {
        {{false, 1, q, NULL, 0, 0.1f, NULL, o, NULL}, KV_ERR_INVALID_ARG,
         "dv = 0 outside [1, D = 64]", NULL},
        {{false, 1, q, NULL, 65, 0.1f, NULL, o, NULL}, KV_ERR_INVALID_ARG, NULL, NULL},
        {{false, 1, q, NULL, 48, 0.1f, NULL, &r.o_big, NULL}, KV_ERR_BAD_SHAPE, "out shape", NULL},
        {{false, 1, q, NULL, 48, 0.1f, &vs, o, NULL}, KV_ERR_INVALID_ARG, "V scales given", NULL},
        {{false, 2, q, NULL, 48, 0.1f, NULL, o, NULL}, KV_ERR_INVALID_ARG, NULL, NULL},
        {{false, 1, o, NULL, 48, 0.1f, NULL, o, NULL}, KV_ERR_BAD_SHAPE, NULL, NULL},
        {{false, 1, NULL, NULL, 48, 0.1f, NULL, o, NULL}, KV_ERR_NULL, NULL, NULL},
        {{false, 1, q, NULL, 48, NAN, NULL, o, NULL}, KV_ERR_INVALID_ARG, NULL, NULL},
    };
    check_refusals(&r, bad, sizeof(bad) / sizeof(bad[0]));
    /* not K-only; K-only of two KV heads */
    check_refuses_layouts(&r, &ok, 0x78, "MLA decode");
    /* the CUDA entry runs the same validator (here: host memory, a bad dv) */
    assert_int_equal(kv_attn_decode_mla_cuda(c, 1, q, &r.pg, 48, 0.1f, NULL, o, NULL),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_attn_decode_mla_cuda");
    struct kv_paged_cache pinned = c;
    pinned.mem = KV_MEM_PINNED;
    assert_int_equal(kv_attn_decode_mla_cuda(pinned, 1, q, &r.pg, 0, 0.1f, NULL, o, NULL),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_attn_decode_mla_cuda: dv = 0");
    /* stats: counted as a decode */
    check_counted(&r, &ok, KV_ATTN_DECODE);
    rfix_free(&r);
}

/* ---- prefill ------------------------------------------------------------------------ */

struct pcase {
    kv_dtype dt;
    int64_t D, dv, hq;
    kv_arrange arr;
    bool block_table, portable, scaled;
    kv_dtype out_dt;
    int32_t window; /* KV_ATTN_WINDOW_OFF or >= 0 */
    float cap;      /* 0: off */
    bool lse;
    bool grid; /* the CUDA body (kv__prefill_body, MLA form) on the CPU grid emulator */
};

/* kv_attn_prefill_mla over six sequences of lens {0, 45, 130, 70, 20, 90}
 * tokens with q_len {0, 1, 7, 70 (the whole sequence), 0, 33} (the afix
 * cache and pages), q with padded heads and rows, out and lse padded (the
 * gaps checked untouched), against a float64 reference; without options,
 * the last query row of every sequence against kv_attn_decode_mla's output
 * bit for bit (same sums, same order). */
static void run_prefill_case(const struct pcase *k, bool qbf16, bool avx2_only, uint64_t seed)
{
    enum { S = 6 };
    const int64_t D = k->D, dv = k->dv, hq = k->hq;
    const int64_t lens[S] = {0, 45, 130, 70, 20, 90}, qlens[S] = {0, 1, 7, 70, 0, 33};
    struct afix f;
    afix_init(&f, k->dt, D, k->arr, k->block_table, S, lens, seed);
    int32_t qo[S + 1] = {0};
    for (int s = 0; s < S; s++)
        qo[s + 1] = qo[s] + (int32_t)qlens[s];
    const int64_t T = qo[S];
    /* q [T][Hq][D] f32, heads and rows padded; out [T][Hq][dv], lse [T][Hq + 2] */
    struct qout b;
    qout_make(&b, T, hq, D, dv, 5, 2, qbf16 ? KV_BF16 : KV_F32, k->out_dt, &f.rng, seed + 1);
    const int64_t lst = hq + 2;
    const size_t lbytes = (size_t)(T * lst) * sizeof(float);
    float *lse = malloc(lbytes), *lse0 = malloc(lbytes);
    assert_true(lse && lse0);
    fill_random(lse, lbytes, seed + 2);
    memcpy(lse0, lse, lbytes);
    const float scale = 1.0f / sqrtf((float)D), kscale[2] = {0.37f, 0.37f};
    const struct kv_scales sc = {kscale, NULL, 1, 0};
    struct kv_attn_opts opts = KV_ATTN_OPTS_INIT;
    opts.window_left = k->window;
    opts.logit_soft_cap = k->cap;
    opts.lse = k->lse ? lse : NULL;
    opts.lse_stride = lst;
    const bool plain = k->window < 0 && k->cap == 0.0f && !k->lse && !k->grid;
    if (k->grid) {
        struct kv__attn_job j;
        struct kv_paged_cache dev = f.p.c;
        dev.mem = KV_MEM_PINNED; /* what a CUDA entry takes; host memory here */
        assert_int_equal(kv__attn_prefill_mla_check("kv_attn_prefill_mla_cuda", &dev, 1, &b.qv,
                                                    qo, &f.pg, dv, scale, k->scaled ? &sc : NULL,
                                                    &b.ov, &opts, &j),
                         KV_OK);
        const kv_status st = kv__grid_attn_prefill(&j);
        kv__attn_job_free(&j);
        if (st != KV_OK)
            fail_msg("kv__grid_attn_prefill (MLA): %s: %s", kv_status_name(st), kv_last_error());
    } else {
        kv__attn_test_tune(-1, k->portable);
        kv__attn_avx2_only = avx2_only;
        struct kv__attn_job j;
        assert_int_equal(kv__attn_prefill_mla_check("kv_attn_prefill_mla", &f.p.c, 1, &b.qv, qo,
                                                    &f.pg, dv, scale, k->scaled ? &sc : NULL, &b.ov,
                                                    &opts, &j),
                         KV_OK);
        check_bdot_choice(&j, k->portable, avx2_only);
        kv__attn_job_free(&j);
        assert_int_equal(kv_attn_prefill_mla(f.p.c, 1, &b.qv, qo, &f.pg, dv, scale,
                                             k->scaled ? &sc : NULL, &b.ov, plain ? NULL : &opts),
                         KV_OK);
        kv__attn_avx2_only = false;
        kv__attn_test_tune(-1, false);
    }
    assert_memory_equal(f.p.mem, f.before, f.p.bytes);
    /* float64 reference, every row, head and dim; the gaps untouched */
    const double ks = k->scaled ? 0.37 : 1.0;
    double *sco = malloc(sizeof(double) * 130), *o = malloc(sizeof(double) * (size_t)dv);
    bool *is_out = calloc((size_t)(T * b.ots), 1), *is_lse = calloc((size_t)(T * lst), 1);
    assert_true(sco && o && is_out && is_lse);
    for (int64_t s = 0; s < S; s++)
        for (int64_t i = 0; i < qlens[s]; i++)
            for (int64_t h = 0; h < hq; h++) {
                const int64_t row = qo[s] + i, pos = lens[s] - qlens[s] + i;
                const int64_t t_lo = k->window >= 0 && pos > k->window ? pos - k->window : 0;
                const double want_lse = ref_attend(&f, s, b.q + row * b.qts + h * b.qhs, D, dv,
                                                   t_lo, pos + 1, ks, scale, k->cap, sco, o);
                for (int64_t j = 0; j < dv; j++) {
                    const int64_t e = row * b.ots + h * b.ohs + j;
                    double got;
                    is_out[e] = true;
                    if (!out_close(b.out, k->out_dt, e, o[j], &got))
                        fail_msg("prefill dt %s D %" PRId64 " dv %" PRId64 " Hq %" PRId64
                                 " win %d cap %g seq %" PRId64 " query %" PRId64 " head %" PRId64
                                 " dim %" PRId64 ": got %.7g, float64 reference %.7g",
                                 kv_dtype_name(k->dt), D, dv, hq, (int)k->window, (double)k->cap,
                                 s, i, h, j, got, o[j]);
                }
                if (k->lse) {
                    const double got = lse[row * lst + h];
                    is_lse[row * lst + h] = true;
                    if (!(fabs(got - want_lse) <= 1e-4 + 1e-5 * fabs(want_lse)))
                        fail_msg("prefill lse seq %" PRId64 " query %" PRId64 " head %" PRId64
                                 ": got %.7g, float64 reference %.7g",
                                 s, i, h, got, want_lse);
                }
            }
    check_untouched(b.out, b.out0, is_out, T * b.ots, b.oes, "out (a gap)");
    check_untouched(lse, lse0, is_lse, T * lst, 4, "lse (a gap, or no lse asked)");
    if (plain) {
        /* the last query of each sequence (position len - 1) against the
         * decode of that row, bit for bit */
        const int64_t oes = b.oes, qes = b.qes;
        unsigned char *qd = malloc((size_t)(S * hq * D * qes));
        unsigned char *od = malloc((size_t)(S * hq * dv * oes));
        assert_true(qd && od);
        for (int64_t s = 0; s < S; s++)
            for (int64_t h = 0; h < hq; h++)
                memcpy(qd + (s * hq + h) * D * qes,
                       b.qmem + ((qo[s + 1] > 0 ? qo[s + 1] - 1 : 0) * b.qts + h * b.qhs) * qes,
                       (size_t)(D * qes));
        struct kv_view qdv, odv;
        int64_t ds[3] = {S, hq, D}, dos[3] = {S, hq, dv};
        assert_int_equal(kv_view_init(qd, (size_t)(S * hq * D * qes), b.qv.dtype, 3, ds, &qdv),
                         KV_OK);
        assert_int_equal(
            kv_view_init(od, (size_t)(S * hq * dv * oes), k->out_dt, 3, dos, &odv), KV_OK);
        kv__attn_test_tune(-1, k->portable);
        kv__attn_avx2_only = avx2_only;
        assert_int_equal(kv_attn_decode_mla(f.p.c, 1, &qdv, &f.pg, dv, scale,
                                            k->scaled ? &sc : NULL, &odv),
                         KV_OK);
        kv__attn_avx2_only = false;
        kv__attn_test_tune(-1, false);
        int compared = 0;
        for (int64_t s = 0; s < S; s++) {
            if (qlens[s] == 0)
                continue;
            for (int64_t h = 0; h < hq; h++) {
                const unsigned char *x = b.out + ((qo[s + 1] - 1) * b.ots + h * b.ohs) * oes;
                const unsigned char *y = od + (s * hq + h) * dv * oes;
                if (memcmp(x, y, (size_t)(dv * oes)) != 0)
                    fail_msg("prefill's last query of seq %" PRId64 " head %" PRId64
                             " differs from kv_attn_decode_mla's (dt %s D %" PRId64 " Hq %" PRId64
                             ")",
                             s, h, kv_dtype_name(k->dt), D, hq);
                compared++;
            }
        }
        assert_int_equal(compared, 4 * hq);
        free(qd);
        free(od);
    }
    free(is_out);
    free(is_lse);
    free(sco);
    free(o);
    free(lse);
    free(lse0);
    qout_free(&b);
    afix_free(&f);
}

static void test_mla_prefill_vs_float64(void **state)
{
    (void)state;
    const int32_t W = KV_ATTN_WINDOW_OFF;
    const struct pcase cases[] = {
        {KV_BF16, 576, 512, 16, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, W,
         0, false, false},
        {KV_BF16, 576, 512, 16, KV_ARRANGE_BLOCK_MAJOR, true, true, false, KV_BF16, W,
         0, false, false},
        {KV_BF16, 576, 512, 5, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, 40,
         0, true, false},
        {KV_F16, 576, 512, 3, KV_ARRANGE_BLOCK_MAJOR, false, false, false, KV_F32, W,
         30.0f, true, false},
        {KV_F32, 576, 512, 4, KV_ARRANGE_LAYER_MAJOR, true, false, false, KV_F32, W,
         0, false, false},
        {KV_FP8_E4M3, 576, 512, 6, KV_ARRANGE_BLOCK_MAJOR, false, false, true, KV_F32, W,
         0, false, false},
        {KV_FP8_E4M3, 576, 512, 6, KV_ARRANGE_LAYER_MAJOR, true, true, true, KV_F32, 9, 5.0f,
         true, false},
        {KV_FP8_E5M2, 64, 48, 6, KV_ARRANGE_LAYER_MAJOR, false, false, true, KV_F32, W,
         0, false, false},
        /* small odd shapes (the portable loops whatever the CPU) */
        {KV_BF16, 20, 13, 3, KV_ARRANGE_BLOCK_MAJOR, true, false, false, KV_F32, W,
         0, false, false},
        {KV_F16, 37, 37, 7, KV_ARRANGE_LAYER_MAJOR, false, false, true, KV_F32, 0,
         2.0f, true, false},
        {KV_F32, 24, 16, 128, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, W,
         0, false, false},
        {KV_F32, 24, 16, 128, KV_ARRANGE_BLOCK_MAJOR, false, false, false, KV_F32, 17,
         0, true, false},
        /* the CUDA body (kv__prefill_body's MLA form) on the emulated grid */
        {KV_BF16, 576, 512, 16, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, W, 0, false,
         true},
        {KV_FP8_E4M3, 576, 512, 5, KV_ARRANGE_BLOCK_MAJOR, true, false, true, KV_BF16, 40, 10.0f,
         true, true},
        {KV_F16, 37, 29, 11, KV_ARRANGE_BLOCK_MAJOR, false, false, false, KV_F32, W, 0, true,
         true},
        {KV_F32, 20, 12, 1, KV_ARRANGE_LAYER_MAJOR, true, false, true, KV_F32, 3, 0, false, true},
    };
    /* under emulated_quick: each dtype, arrangement and option once
     * (bf16 window+lse, f16 cap+lse, f32 block table, fp8 e4m3 scaled
     * with all three, e5m2, the odd shapes, Hq 128 with window+lse) */
    static const bool emu[] = {false, false, true,  true, true,  false, true,  true,
                               true,  true,  false, true, false, false, false, false};
    _Static_assert(sizeof(emu) / sizeof(emu[0]) == sizeof(cases) / sizeof(cases[0]),
                   "one flag per case");
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        if ((!cases[i].grid || !no_grid_cases()) && (emu[i] || !emulated_quick()))
            run_prefill_case(&cases[i], false, false, 0x6000 + i);
    /* q bf16: the bf16 dot-product scores where the CPU has them (plain:
     * the last rows against the decode bit for bit; Hq a multiple of 4 and
     * not; the options), and the same with them turned off */
    const struct {
        struct pcase c;
        int mode; /* as the decode's */
    } qcases[] = {
        {{KV_BF16, 576, 512, 8, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, W, 0, false,
          false},
         false},
        {{KV_FP8_E4M3, 576, 512, 6, KV_ARRANGE_BLOCK_MAJOR, true, false, true, KV_BF16, W, 0, false,
          false},
         false},
        {{KV_BF16, 576, 512, 5, KV_ARRANGE_BLOCK_MAJOR, false, false, true, KV_F32, 40, 20.0f, true,
          false},
         false},
        {{KV_FP8_E5M2, 64, 48, 8, KV_ARRANGE_LAYER_MAJOR, false, false, true, KV_F32, W, 0, false,
          false},
         false},
        {{KV_BF16, 576, 512, 4, KV_ARRANGE_LAYER_MAJOR, true, false, false, KV_F32, W, 0, false,
          false},
         true},
        {{KV_FP8_E4M3, 576, 512, 6, KV_ARRANGE_LAYER_MAJOR, false, false, false, KV_F32, W, 0,
          false, false},
         2},
    };
    for (size_t i = 0; i < sizeof(qcases) / sizeof(qcases[0]); i++) {
        /* emulated_quick: q bf16 plain is qcase 4 too; the via-f16 knob runs natively */
        if (emulated_quick() && (i == 0 || i == 5))
            continue;
        kv__attn_fp8_via_f16 = qcases[i].mode == 2;
        run_prefill_case(&qcases[i].c, true, qcases[i].mode == 1, 0x6100 + i);
        kv__attn_fp8_via_f16 = false;
    }
}

static void test_mla_prefill_refusals(void **state)
{
    (void)state;
    struct rfix r; /* two sequences of 5 and 20 tokens; q_len 2 and 3 */
    rfix_init(&r, 2, 5, 0x97);
    const struct kv_paged_cache c = r.p.c;
    const struct kv_view *q = &r.q, *o = &r.o;
    const struct kv_pages *pg = &r.pg;
    for (size_t i = 0; i < r.qbytes / sizeof(float); i++)
        r.qb[i] = (float)(i % 17) * 0.01f;
    const int32_t qo[3] = {0, 2, 5};
    assert_int_equal(kv_attn_prefill_mla(c, 1, q, qo, pg, 48, 0.1f, NULL, o, NULL), KV_OK);
    unsigned char *before = snapshot(&r.p);
    static float lb[5 * 8], lb0[5 * 8];
    memset(r.ob, 0x5a, r.obytes);
    memset(lb, 0x5a, sizeof(lb));
    float *ob0 = malloc(r.obytes);
    assert_non_null(ob0);
    memcpy(ob0, r.ob, r.obytes);
    memcpy(lb0, lb, sizeof(lb));
    struct kv_attn_opts opts = KV_ATTN_OPTS_INIT;
    opts.lse = lb;
    const struct mla_args ok = {true, 1, q, qo, 48, 0.1f, NULL, o, &opts};
    /* qo_indptr; dv, out's shape, V scales, layer, NaN scale; options */
    const int32_t qo_0[3] = {1, 2, 5}, qo_dec[3] = {0, 3, 2}, qo_t[3] = {0, 2, 4},
                  qo_long[3] = {0, 6, 5};
    const float s1[1] = {1.0f};
    const struct kv_scales vs = {s1, s1, 1, 0};
    struct kv_attn_opts win = opts, cap = opts, lst = opts, size = opts;
    win.window_left = -2;
    cap.logit_soft_cap = -1.0f;
    lst.lse_stride = 7;
    size.struct_size = 8;
    const struct refusal bad[] = {
        {{true, 1, q, NULL, 48, 0.1f, NULL, o, &opts}, KV_ERR_NULL, "qo_indptr=(nil)", NULL},
        {{true, 1, q, qo_0, 48, 0.1f, NULL, o, &opts}, KV_ERR_CORRUPT,
         "kv_attn_prefill_mla: qo_indptr[0] is 1, not 0", NULL},
        {{true, 1, q, qo_dec, 48, 0.1f, NULL, o, &opts}, KV_ERR_CORRUPT,
         "qo_indptr[1] = 3 > qo_indptr[2] = 2", NULL},
        {{true, 1, q, qo_t, 48, 0.1f, NULL, o, &opts}, KV_ERR_BAD_SHAPE,
         "qo_indptr[2] = 4 but q and out have 5 rows", NULL},
        {{true, 1, q, qo_long, 48, 0.1f, NULL, o, &opts}, KV_ERR_BAD_SHAPE,
         "sequence 0 has q_len 6", "above its 5 tokens"},
        {{true, 1, q, qo, 0, 0.1f, NULL, o, &opts}, KV_ERR_INVALID_ARG,
         "kv_attn_prefill_mla: dv = 0 outside [1, D = 64]", NULL},
        {{true, 1, q, qo, 65, 0.1f, NULL, o, &opts}, KV_ERR_INVALID_ARG, "dv = 65 outside", NULL},
        {{true, 1, q, qo, 48, 0.1f, NULL, &r.o_big, &opts}, KV_ERR_BAD_SHAPE, "out shape", NULL},
        {{true, 1, q, qo, 48, 0.1f, &vs, o, &opts}, KV_ERR_INVALID_ARG, "V scales given", NULL},
        {{true, 2, q, qo, 48, 0.1f, NULL, o, &opts}, KV_ERR_INVALID_ARG, NULL, NULL},
        {{true, 1, q, qo, 48, NAN, NULL, o, &opts}, KV_ERR_INVALID_ARG, "softmax_scale nan", NULL},
        {{true, 1, q, qo, 48, 0.1f, NULL, o, &win}, KV_ERR_INVALID_ARG, "window_left -2", NULL},
        {{true, 1, q, qo, 48, 0.1f, NULL, o, &cap}, KV_ERR_INVALID_ARG, "logit_soft_cap -1",
         NULL},
        {{true, 1, q, qo, 48, 0.1f, NULL, o, &lst}, KV_ERR_INVALID_ARG,
         "lse_stride 7 is below the 8 query heads", NULL},
        {{true, 1, q, qo, 48, 0.1f, NULL, o, &size}, KV_ERR_INVALID_ARG, NULL, NULL},
    };
    check_refusals(&r, bad, sizeof(bad) / sizeof(bad[0]));
    /* not K-only; K-only of two KV heads */
    check_refuses_layouts(&r, &ok, 0x98, "MLA prefill");
    /* the CUDA entry runs the same validator (host memory here: refused) */
    assert_int_equal(kv_attn_prefill_mla_cuda(c, 1, q, qo, pg, 48, 0.1f, NULL, o, &opts, NULL),
                     KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("kv_attn_prefill_mla_cuda");
    struct kv_paged_cache pinned = c;
    pinned.mem = KV_MEM_PINNED;
    assert_int_equal(
        kv_attn_prefill_mla_cuda(pinned, 1, q, qo_long, pg, 48, 0.1f, NULL, o, &opts, NULL),
        KV_ERR_BAD_SHAPE);
    kvt_assert_msg_has("kv_attn_prefill_mla_cuda: sequence 0 has q_len 6");
    /* nothing written by any refusal */
    assert_memory_equal(r.ob, ob0, r.obytes);
    assert_memory_equal(lb, lb0, sizeof(lb));
    assert_memory_equal(r.p.mem, before, r.p.bytes);
    /* stats: counted as a prefill */
    check_counted(&r, &ok, KV_ATTN_PREFILL);
    /* an empty batch (every q_len 0) writes nothing */
    const int32_t qo_none[3] = {0, 0, 0};
    int64_t zs[3] = {0, 8, 64}, zo[3] = {0, 8, 48};
    struct kv_view qz, oz;
    assert_int_equal(kv_view_init(r.qb, r.qbytes, KV_F32, 3, zs, &qz), KV_OK);
    assert_int_equal(kv_view_init(r.ob, r.obytes, KV_F32, 3, zo, &oz), KV_OK);
    memcpy(ob0, r.ob, r.obytes);
    assert_int_equal(kv_attn_prefill_mla(c, 1, &qz, qo_none, pg, 48, 0.1f, NULL, &oz, NULL),
                     KV_OK);
    assert_memory_equal(r.ob, ob0, r.obytes);
    free(ob0);
    free(before);
    rfix_free(&r);
}

/* An fp8 latent cache with a per-tensor K scale (DeepSeek's): f32 rows
 * written through the scale (stored = e4m3(x / s)), read back through it;
 * every stored byte decoded here times s is what read returns, and within
 * half an e4m3 step of x; the V side has no scale to give. */
static void test_mla_fp8_scaled_write_read(void **state)
{
    (void)state;
    struct kv_layout_config cfg =
        mla_cfg(2, 40, 16, 1, 576, KV_FP8_E4M3, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, 64);
    struct pool p;
    pool_make(&p, &cfg, 0x8800);
    unsigned char *before = snapshot(&p);
    const int64_t T = 20, D = 576;
    float *x = malloc((size_t)(T * D) * sizeof(float)), *back = malloc((size_t)(T * D) * 4);
    assert_true(x && back);
    uint64_t rng = 0x8801;
    for (int64_t i = 0; i < T * D; i++) /* magnitudes in [2^-4, 2): e4m3 normals after / s */
        x[i] = (float)((kvt_rand(&rng) & 1) ? 1 : -1) *
               (float)ldexp(1.0 + (double)(kvt_rand(&rng) % 1000) / 1000.0,
                            (int)(kvt_rand(&rng) % 5) - 4);
    int64_t slots[20];
    for (int64_t t = 0; t < T; t++)
        slots[t] = (39 - t / 16) * 16 + t % 16; /* blocks 39, 38 */
    struct kv_view kv_x, kv_b;
    int64_t shape[3] = {T, 1, D};
    assert_int_equal(kv_view_init(x, (size_t)(T * D) * 4, KV_F32, 3, shape, &kv_x), KV_OK);
    assert_int_equal(kv_view_init(back, (size_t)(T * D) * 4, KV_F32, 3, shape, &kv_b), KV_OK);
    const float ks[1] = {0.5f};
    const struct kv_scales sc = {ks, NULL, 1, 0};
    assert_int_equal(kv_attn_write(p.c, 1, &kv_x, NULL, slots, T, &sc), KV_OK);
    /* only layer 1 of blocks 39 and 38, token by token, changed */
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < D; d++) {
            const size_t o = at(&p, 1, slots[t] / 16, slots[t] % 16, 0, d);
            const double got = ref_e4m3(p.mem + o) * 0.5, want = x[t * D + d];
            if (!(fabs(got - want) <= fabs(want) / 16.0))
                fail_msg("token %lld dim %lld: stored %.6g (x %.6g)", (long long)t, (long long)d,
                         got, want);
            before[o] = p.mem[o];
        }
    assert_memory_equal(p.mem, before, p.bytes);
    const int32_t indptr[2] = {0, 2}, indices[2] = {39, 38}, last[1] = {4};
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = 1,
                                .indptr = indptr,
                                .indices = indices,
                                .last_page_len = last};
    assert_int_equal(kv_attn_read(p.c, 1, &pg, &kv_b, NULL, &sc), KV_OK);
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < D; d++) {
            const double want = ref_e4m3(p.mem + at(&p, 1, slots[t] / 16, slots[t] % 16, 0, d)) * 0.5;
            if (back[t * D + d] != (float)want)
                fail_msg("read token %lld dim %lld: %.9g, stored x scale %.9g", (long long)t,
                         (long long)d, (double)back[t * D + d], want);
        }
    free(x);
    free(back);
    free(before);
    pool_free(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mla_layout),
        cmocka_unit_test(test_mla_write_read_copy),
        cmocka_unit_test(test_mla_plans),
        cmocka_unit_test(test_mla_decode_vs_float64),
        cmocka_unit_test(test_mla_decode_refusals),
        cmocka_unit_test(test_mla_prefill_vs_float64),
        cmocka_unit_test(test_mla_prefill_refusals),
        cmocka_unit_test(test_mla_fp8_scaled_write_read),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
