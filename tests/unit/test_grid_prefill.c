/*
 * test_grid_prefill.c - the CUDA body of the multi-token paged attention
 * (attention/kv_attn_prefill_hd.h: kv_attn_prefill_cuda, and
 * kv_attn_decode_ex_cuda with options) run on the CPU grid emulator
 * (kvcache/kv_grid_hd.h), against a float64 reference written here from
 * docs/kernels.md's formulas.
 *
 * Jobs come from the kernels' one validator with the *_cuda names (pinned
 * host storage), then kv__grid_attn_prefill makes the launch
 * kv_attn_cuda.cu makes (grid, block, shared memory, vector width: checked)
 * over the same body. K and V are written at addresses computed from the
 * layout CONFIG alone (kvt_ref_offset_elems), on pages far from 0; q, out
 * and lse have padded rows, and out has a row before and after the call's
 * rows; every byte of out's and lse's buffers outside the results, q, and
 * the whole pool with its guards are checked unchanged. Cases: NHD / HND,
 * padded, block-major, packed K|V; q_len 0, 1 and > 1 (a whole causal
 * prefill and a chunk over a cached prefix); window, soft cap, lse; f32,
 * f16, bf16, fp8 e4m3 / e5m2 with per-tensor and per-head scales; g 1, 4
 * and 5; D 64, 128, 80, 33 (vector widths 16 to 2) and 256 (tiles of 4
 * rows, fewer than g, and 16 tokens, fewer than the lanes); a decode job with
 * options (one query a sequence, a sequence of 0 tokens: out 0, lse -inf);
 * the shared-memory refusal; the emulator's warp max and its strictness.
 */
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
#include "kv_convert_hd.h"

#include "kv_attn_grid_int.h"
#include "kv_attn_prefill_hd.h"
#include "kv_grid_hd.h"
#include "kv_mem.h"
#include "kvt_grid.h"
#include "kvtest.h"

#define S_MAX 4
#define QPAD 8 /* q and out: elements after each row */
#define LPAD 3 /* lse: floats after each row */

struct pcase {
    kv_order order;
    kv_arrange arrange;
    int64_t pad;
    bool packed;
    int64_t N, H, g, D;
    uint32_t r;
    kv_dtype dt, out_dt;
    int scales; /* 0 none, 1 per tensor, 2 per head */
    int32_t window;
    float cap;
    bool lse;
    bool decode; /* a decode job: qo_indptr NULL, one query a sequence */
    int want_width;
};

static void expect_ok(kv_status st, const char *what)
{
    if (st != KV_OK)
        fail_msg("%s: %s: %s", what, kv_status_name(st), kv_last_error());
}

static void run_case(const struct pcase *pc, const int64_t *lens, const int64_t *qlens,
                     uint64_t seed)
{
    const uint32_t S = S_MAX;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    struct kvt_gfix f;
    uint64_t rng = seed;
    const int64_t N = pc->N, D = pc->D, H = pc->H, Hq = H * pc->g, pt = N / pc->r;
    cfg.num_layers = 2, cfg.block_tokens = N, cfg.num_heads = H, cfg.head_dim = D;
    cfg.dtype = pc->dt, cfg.order = pc->order, cfg.arrange = pc->arrange;
    cfg.kv_packed = pc->packed, cfg.block_pad_elems = pc->pad;
    int64_t tot = 0, maxlen = 0, np_all = 0;
    for (uint32_t s = 0; s < S; s++) {
        tot += lens[s];
        maxlen = lens[s] > maxlen ? lens[s] : maxlen;
        np_all += (lens[s] + pt - 1) / pt;
    }
    cfg.num_blocks = 2 * (np_all / pc->r + 2) + 40;
    kvt_gfix_init(&f, &cfg, seed);
    const int64_t P = cfg.num_blocks * pc->r;
    int32_t indptr[S_MAX + 1], last[S_MAX], *indices = malloc((size_t)(np_all + 1) * 4);
    uint8_t *used = calloc((size_t)P, 1);
    assert_true(indices && used);
    int32_t k = 0;
    for (uint32_t s = 0; s < S; s++) {
        const int64_t np = (lens[s] + pt - 1) / pt;
        indptr[s] = k;
        for (int64_t p = 0; p < np; p++) {
            int64_t pg;
            do
                pg = kvt_range(&rng, P / 2, P - 1); /* far from 0 */
            while (used[pg]);
            used[pg] = 1;
            indices[k++] = (int32_t)pg;
        }
        last[s] = np ? (int32_t)(lens[s] - (np - 1) * pt) : 0;
    }
    indptr[S] = k;
    free(used);
    const uint32_t layer = 1;
    float ksc[8], vsc[8];
    for (int h = 0; h < 8; h++)
        ksc[h] = pc->scales ? 0.5f + 0.25f * (float)h : 1.0f,
        vsc[h] = pc->scales ? 2.0f - 0.125f * (float)h : 1.0f;
    const int per_head = pc->scales == 2;
    double *kd = calloc((size_t)(tot * H * D + 1), sizeof(double));
    double *vd = calloc((size_t)(tot * H * D + 1), sizeof(double));
    int64_t at[S_MAX];
    assert_true(kd && vd);
    for (uint32_t s = 0, a = 0; s < S; s++) {
        at[s] = a;
        for (int64_t t = 0; t < lens[s]; t++, a++) {
            const int64_t slot = (int64_t)indices[indptr[s] + t / pt] * pt + t % pt;
            for (int64_t h = 0; h < H; h++) {
                const float ks = ksc[per_head ? h : 0], vs = vsc[per_head ? h : 0];
                for (int64_t d = 0; d < D; d++) {
                    const float x = (float)kvt_range(&rng, -1000, 1000) / 1000.0f;
                    const float y = (float)kvt_range(&rng, -500, 1250) / 1000.0f;
                    unsigned char *pk = kvt_gat(&f, f.pool, layer, 0, slot, h, d);
                    unsigned char *pv = kvt_gat(&f, f.pool, layer, 1, slot, h, d);
                    kv_from_f32(pc->dt, x / ks, pk);
                    kv_from_f32(pc->dt, y / vs, pv);
                    const int64_t i = (a * H + h) * D + d;
                    kd[i] = (double)kv_to_f32(pc->dt, pk) * ks;
                    vd[i] = (double)kv_to_f32(pc->dt, pv) * vs;
                }
            }
        }
    }
    memcpy(f.refmem, f.mem, f.bytes + 2 * KVT_GUARD);
    /* rows: qo_indptr over the sequences (a decode: one row each) */
    int32_t qo[S_MAX + 1];
    int64_t ql[S_MAX];
    qo[0] = 0;
    for (uint32_t s = 0; s < S; s++) {
        ql[s] = pc->decode ? 1 : qlens[s];
        qo[s + 1] = qo[s] + (int32_t)ql[s];
    }
    const int64_t T = qo[S];
    /* q [T][Hq][D] f32, out [T][Hq][D] of out_dt one row into a buffer of
     * T + 2 rows, rows padded; lse [T][Hq + LPAD] */
    const int64_t row = D + QPAD, nq = T * Hq * row, no = (T + 2) * Hq * row;
    const kv_dtype odt = pc->out_dt ? pc->out_dt : KV_F32;
    const int64_t oes = (int64_t)kv_dtype_size(odt);
    float *qb = kv__mem_alloc_aligned(64, (size_t)nq * 4);
    unsigned char *ob = kv__mem_alloc_aligned(64, (size_t)(no * oes));
    float *lb = malloc((size_t)(T * (Hq + LPAD)) * 4);
    float *qb0 = malloc((size_t)nq * 4);
    unsigned char *ob0 = malloc((size_t)(no * oes));
    float *lb0 = malloc((size_t)(T * (Hq + LPAD)) * 4);
    assert_true(qb && ob && lb && qb0 && ob0 && lb0);
    for (int64_t i = 0; i < nq; i++)
        qb[i] = (float)kvt_range(&rng, -3000, 3000) / 1000.0f;
    kvt_fill(ob, (size_t)(no * oes), seed + 5);
    for (int64_t i = 0; i < T * (Hq + LPAD); i++)
        lb[i] = 1234.5f + (float)i;
    memcpy(qb0, qb, (size_t)nq * 4);
    memcpy(ob0, ob, (size_t)(no * oes));
    memcpy(lb0, lb, (size_t)(T * (Hq + LPAD)) * 4);
    struct kv_view q, out, flat;
    int64_t sh[3] = {T, Hq, D}, st3[3] = {Hq * row, row, 1}, n1 = nq, n2 = no;
    assert_int_equal(kv_view_init(qb, (size_t)nq * 4, KV_F32, 1, &n1, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st3, 0, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)(no * oes), odt, 1, &n2, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st3, Hq * row, &out), KV_OK);
    struct kv_pages pages;
    memset(&pages, 0, sizeof(pages));
    pages.format = KV_PAGES_CSR;
    pages.n_seqs = S;
    pages.page_ratio = pc->r;
    pages.indptr = indptr;
    pages.indices = indices;
    pages.last_page_len = last;
    struct kv_scales scl = {ksc, vsc, per_head ? (uint32_t)H : 1, 0};
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.window_left = pc->window;
    o.logit_soft_cap = pc->cap;
    if (pc->lse) {
        o.lse = lb;
        o.lse_stride = Hq + LPAD;
    }
    const float smscale = 1.0f / sqrtf((float)D);
    char what[200];
    snprintf(what, sizeof(what), "%s %s %s pad %lld%s N%lld H%lld g%lld D%lld r%u win %d cap %g%s",
             pc->decode ? "decode_ex" : "prefill", kv_dtype_name(pc->dt),
             pc->order == KV_ORDER_HND ? "HND" : "NHD", (long long)pc->pad,
             pc->packed ? " packed" : "", (long long)N, (long long)H, (long long)pc->g,
             (long long)D, pc->r, pc->window, (double)pc->cap, pc->lse ? " lse" : "");
    struct kv__attn_job j;
    kv_status st = kv__attn_decode_check(
        pc->decode ? "kv_attn_decode_ex_cuda" : "kv_attn_prefill_cuda", &f.c, layer, &q,
        pc->decode ? NULL : qo, &pages, smscale, pc->scales ? &scl : NULL, &out, &o, &j);
    expect_ok(st, what);
    st = kv__grid_attn_prefill(&j);
    kv__attn_job_free(&j);
    expect_ok(st, what);
    /* the launch kv_attn_cuda.cu makes */
    struct kv__grid_attn_last lst;
    kv__grid_attn_last(&lst);
    int64_t maxrows = 0, tiles = 0;
    for (uint32_t s = 0; s < S; s++)
        maxrows = ql[s] * pc->g > maxrows ? ql[s] * pc->g : maxrows;
    int64_t rows, tk;
    kv__cpre_tile(D, maxrows, &rows, &tk);
    /* up to D 80, full tiles of 32 rows x 32 tokens (docs/kernels.md) */
    const bool full = D > 80 || maxrows < 32 || (rows == 32 && tk == 32);
    if (!(lst.launch.shared_bytes == kv__cpre_shared(rows, tk, D) && rows >= 1 && tk >= 1 && full))
        fail_msg("%s: %lld rows, %lld tokens a tile (shared %zu)", what, (long long)rows,
                 (long long)tk, lst.launch.shared_bytes);
    for (uint32_t s = 0; s < S; s++)
        tiles += (ql[s] * pc->g + rows - 1) / rows;
    if (!(lst.launch.grid == (uint64_t)(tiles * H) && lst.launch.block == 32 * KV__PF_WARPS &&
          lst.launch.barriers && lst.launch.shared_bytes <= KV__SHARED_MAX))
        fail_msg("%s: launch grid %llu block %llu shared %zu (want grid %lld, rows %lld)", what,
                 (unsigned long long)lst.launch.grid, (unsigned long long)lst.launch.block,
                 lst.launch.shared_bytes, (long long)(tiles * H), (long long)rows);
    if (pc->want_width && lst.vbytes != pc->want_width)
        fail_msg("%s: vector width %d, want %d", what, lst.vbytes, pc->want_width);
    kvt_gfix_check(&f, "pool after the emulated prefill");
    kvt_check_bytes((unsigned char *)qb, (unsigned char *)qb0, (size_t)nq * 4, "q");
    /* every result against float64, then restored for the whole compare */
    double *p = malloc((size_t)(maxlen + 1) * sizeof(double));
    assert_non_null(p);
    for (uint32_t s = 0; s < S; s++)
        for (int64_t i = 0; i < ql[s]; i++) {
            const int64_t rowi = qo[s] + i, pos = lens[s] - ql[s] + i;
            const int64_t lo = pc->window < 0 || pos - pc->window < 0 ? 0 : pos - pc->window;
            for (int64_t qh = 0; qh < Hq; qh++) {
                const int64_t h = qh / pc->g;
                const float *qv = qb + (rowi * Hq + qh) * row;
                double mx = -INFINITY, sum = 0;
                for (int64_t t = lo; t <= pos; t++) {
                    const double *kr = kd + ((at[s] + t) * H + h) * D;
                    double x = 0;
                    for (int64_t d = 0; d < D; d++)
                        x += (double)qv[d] * kr[d];
                    x *= (double)smscale;
                    if (pc->cap > 0)
                        x = pc->cap * tanh(x / pc->cap);
                    p[t] = x;
                    mx = x > mx ? x : mx;
                }
                for (int64_t t = lo; t <= pos; t++)
                    sum += (p[t] = exp(p[t] - mx));
                for (int64_t d = 0; d < D; d++) {
                    double ref = 0;
                    for (int64_t t = lo; t <= pos; t++)
                        ref += p[t] / sum * vd[((at[s] + t) * H + h) * D + d];
                    unsigned char *e = ob + ((rowi + 1) * Hq * row + qh * row + d) * oes;
                    const double got = kv_to_f32(odt, e);
                    bool ok;
                    if (odt == KV_F32) {
                        ok = fabs(got - ref) / (fabs(ref) > 0.1 ? fabs(ref) : 0.1) <= 2e-5;
                    } else {
                        unsigned char w[8];
                        kv_from_f32(odt, (float)ref, w);
                        const double wv = kv_to_f32(odt, w);
                        ok = fabs(got - wv) <= fabs(wv) * 0.008 + 1e-6; /* one bf16 step */
                    }
                    if (!ok)
                        fail_msg("%s: row %lld (seq %u, query %lld at %lld of %lld) head %lld d "
                                 "%lld: %.9g vs %.9g",
                                 what, (long long)rowi, s, (long long)i, (long long)pos,
                                 (long long)lens[s], (long long)qh, (long long)d, got, ref);
                    memcpy(e, ob0 + (e - ob), (size_t)oes);
                }
                if (pc->lse) {
                    float *lp = lb + rowi * (Hq + LPAD) + qh;
                    const double lref = mx + log(sum);
                    if (!(*lp == lref ||
                          fabs(*lp - lref) <= 2e-5 * (fabs(lref) > 1 ? fabs(lref) : 1)))
                        fail_msg("%s: lse row %lld head %lld: %.9g vs %.9g", what, (long long)rowi,
                                 (long long)qh, (double)*lp, lref);
                    *lp = lb0[lp - lb];
                }
            }
        }
    kvt_check_bytes(ob, ob0, (size_t)(no * oes), "out buffer outside the results");
    kvt_check_bytes((unsigned char *)lb, (unsigned char *)lb0, (size_t)(T * (Hq + LPAD)) * 4,
                    "lse buffer outside the results");
    free(p), free(kd), free(vd), free(indices), free(lb), free(qb0), free(ob0), free(lb0);
    kv__mem_free(qb), kv__mem_free(ob);
    kvt_gfix_free(&f);
}

#define NHD KV_ORDER_NHD
#define HND KV_ORDER_HND
#define LM KV_ARRANGE_LAYER_MAJOR
#define BM KV_ARRANGE_BLOCK_MAJOR

/* Whole causal prefills and chunks over a cached prefix (q_len 0, 1 and >
 * 1 in one batch), every dtype, both orders, padded / block-major / packed
 * layouts, the options, g 1, 4 and 5, D 64, 128, 80 and 33. */
static void test_grid_prefill_body(void **state)
{
    (void)state;
    static const int64_t lens[S_MAX] = {45, 1, 70, 9};
    static const int64_t qfull[S_MAX] = {45, 1, 70, 9}, qpart[S_MAX] = {7, 1, 33, 0};
    static const struct pcase cases[] = {
        /* order, arrange, pad, packed, N, H, g, D, r, dt, out_dt, scales, window, cap, lse,
         * decode, want_width */
        {NHD, LM, 0, false, 16, 2, 4, 64, 1, KV_BF16, 0, 0, -1, 0.0f, true, false, 16},
        {HND, BM, 8, false, 8, 2, 1, 128, 2, KV_F16, 0, 0, 12, 0.0f, false, false, 16},
        {NHD, LM, 4, true, 16, 1, 5, 80, 1, KV_FP8_E4M3, 0, 1, -1, 3.0f, true, false, 4},
        {HND, LM, 0, false, 8, 2, 4, 80, 1, KV_FP8_E5M2, KV_BF16, 2, 0, 0.0f, true, false, 16},
        {NHD, BM, 0, false, 16, 3, 1, 33, 1, KV_F16, 0, 0, 20, 1.5f, true, false, 2},
        {HND, LM, 0, true, 16, 2, 4, 64, 2, KV_F32, 0, 2, 5, 2.0f, false, false, 16},
        /* D 256: 4 rows (fewer than g: a tile cuts a query's heads) x 16 tokens
         * (lanes 16..31 idle in the scores) */
        {NHD, BM, 0, false, 8, 1, 5, 256, 1, KV_BF16, 0, 0, 30, 1.0f, true, false, 16},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_case(&cases[i], lens, i % 2 ? qpart : qfull, 900 + i);
}

/* kv_attn_decode_ex_cuda with options runs the same body, one query a
 * sequence at its last token; a sequence of 0 tokens gets out 0 and lse
 * -inf. */
static void test_grid_prefill_decode_opts(void **state)
{
    (void)state;
    static const int64_t lens[S_MAX] = {0, 1, 37, 70};
    static const struct pcase cases[] = {
        {NHD, LM, 0, false, 16, 2, 4, 64, 1, KV_FP8_E4M3, 0, 2, 9, 0.0f, true, true, 16},
        {HND, BM, 4, false, 8, 2, 1, 128, 1, KV_BF16, 0, 0, -1, 2.5f, true, true, 8},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_case(&cases[i], lens, NULL, 950 + i);
}

/* A head dim whose one query row and one token exceed 48 KiB: refused
 * before any launch, naming the values; the output untouched. */
static void test_grid_prefill_shared_limit(void **state)
{
    (void)state;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    struct kvt_gfix f;
    const int64_t D = 4096;
    cfg.num_layers = 1, cfg.num_blocks = 4, cfg.block_tokens = 2, cfg.num_heads = 1;
    cfg.head_dim = D, cfg.dtype = KV_FP8_E4M3;
    kvt_gfix_init(&f, &cfg, 5);
    float *qb = calloc((size_t)(2 * D), 4), *ob = malloc((size_t)(2 * D) * 4),
          *ob0 = malloc((size_t)(2 * D) * 4);
    assert_true(qb && ob && ob0);
    kvt_fill(ob, (size_t)(2 * D) * 4, 6);
    memcpy(ob0, ob, (size_t)(2 * D) * 4);
    struct kv_view q, out;
    int64_t sh[3] = {2, 1, D};
    assert_int_equal(kv_view_init(qb, (size_t)(2 * D) * 4, KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)(2 * D) * 4, KV_F32, 3, sh, &out), KV_OK);
    int32_t indptr[2] = {0, 1}, indices[1] = {3}, last[1] = {2}, qo[2] = {0, 2};
    struct kv_pages pages;
    memset(&pages, 0, sizeof(pages));
    pages.format = KV_PAGES_CSR, pages.n_seqs = 1, pages.page_ratio = 1;
    pages.indptr = indptr, pages.indices = indices, pages.last_page_len = last;
    struct kv__attn_job j;
    assert_int_equal(kv__attn_decode_check("kv_attn_prefill_cuda", &f.c, 0, &q, qo, &pages, 0.0625f,
                                           NULL, &out, NULL, &j),
                     KV_OK);
    assert_int_equal(kv__grid_attn_prefill(&j), KV_ERR_UNSUPPORTED);
    kv__attn_job_free(&j);
    kvt_assert_msg_has("kv_attn_prefill_cuda: head dim 4096 needs 65548 bytes");
    kvt_check_bytes((unsigned char *)ob, (unsigned char *)ob0, (size_t)(2 * D) * 4,
                    "refused prefill output");
    kvt_gfix_check(&f, "pool after a refused prefill");
    free(qb), free(ob), free(ob0);
    kvt_gfix_free(&f);
}

struct wprobe {
    int kind;
    float *out;
};

static void wmax_body(const struct kv_grid_ctx *c, const void *arg)
{
    const struct wprobe *p = arg;
    const float x = (float)((c->thread * 7) % 32) - (c->thread % 32 == 9 ? 100.0f : 0.0f);
    switch (p->kind) {
    case 0: /* every lane gets the warp's max */
        p->out[c->thread] = kv_grid_warp_max(c, c->thread % 32 == 5 ? -INFINITY : x);
        break;
    case 1: /* odd lanes at a max, even lanes at a sum */
        p->out[c->thread] = c->thread % 2 ? kv_grid_warp_max(c, x) : kv_grid_warp_sum(c, x);
        break;
    default: /* only lane 0 */
        if (c->thread % 32 == 0)
            p->out[c->thread] = kv_grid_warp_max(c, x);
        break;
    }
}

/* kv_grid_warp_max: the max in every lane; refused like the warp sum where
 * a GPU's would be undefined (divergent lanes, a partial warp, a launch
 * without barriers). */
static void test_grid_prefill_warp_max(void **state)
{
    (void)state;
    float out[64];
    struct wprobe p = {0, out};
    struct kv_grid_launch l = {1, 64, 0, true};
    assert_int_equal(kv__grid_run("wmax", &l, wmax_body, &p), KV_OK);
    for (int i = 0; i < 64; i++)
        assert_true(out[i] == 30.0f); /* lane 9 (31) lowered, lane 5 -inf */
    p.kind = 1;
    assert_int_equal(kv__grid_run("wmax", &l, wmax_body, &p), KV_ERR_DEVICE);
    kvt_assert_msg_has("divergent warp operation");
    p.kind = 2;
    assert_int_equal(kv__grid_run("wmax", &l, wmax_body, &p), KV_ERR_DEVICE);
    kvt_assert_msg_has("divergent warp operation");
    p.kind = 0;
    const struct kv_grid_launch part = {1, 48, 0, true};
    assert_int_equal(kv__grid_run("wmax", &part, wmax_body, &p), KV_ERR_DEVICE);
    kvt_assert_msg_has("partial warp");
    const struct kv_grid_launch nob = {1, 32, 0, false};
    assert_int_equal(kv__grid_run("wmax", &nob, wmax_body, &p), KV_ERR_DEVICE);
    kvt_assert_msg_has("warp max in a kernel launched as barrier-free");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grid_prefill_warp_max),
        cmocka_unit_test(test_grid_prefill_body),
        cmocka_unit_test(test_grid_prefill_decode_opts),
        cmocka_unit_test(test_grid_prefill_shared_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
