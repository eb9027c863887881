/*
 * test_attn_opts.c - the attention options (kv_attn_decode_ex: sliding
 * window, logit soft cap, log-sum-exp) and the multi-token kernel
 * (kv_attn_prefill: qo_indptr, causal mask over the cached tokens) against
 * a float64 reference written here from docs/kernels.md's formulas: K and V
 * are written into the cache at addresses computed from the layout CONFIG
 * (kvt_ref_offset_elems, never the library's strides), on pages far from
 * 0; q, out and lse have padded rows; every byte of out's and lse's buffers
 * outside the results, and the whole cache, is checked unchanged.
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
#include "kv_attn_int.h"   /* kv__attn_test_tune: the portable path */
#include "kv_convert_hd.h" /* the reference conversions: not installed */

#include "kvt_cache.h"
#include "kvtest.h"

#define MAX_S 4
#define TCOLS 320 /* block table columns: pages a sequence may have */

struct oc {
    int bits; /* kvt_cache_make: 1 HND, 2 block-major, 4 padded */
    kv_dtype dt, out_dt;
    int64_t N, H, D, g;
    uint32_t r;
    bool csr, scales;
    int32_t window; /* window_left */
    float cap;
    bool lse;
};

/* One cache filled with K/V for S sequences of lens[] tokens, q with
 * qlens[] rows per sequence (multi) or one row each (decode). */
struct run {
    struct kvt_cache t;
    const struct oc *c;
    uint32_t S;
    int64_t lens[MAX_S], qlens[MAX_S], T, Hq, pt;
    int32_t indptr[MAX_S + 1], last[MAX_S], qo[MAX_S + 1];
    int32_t *indices, *table;
    int64_t lens64[MAX_S];
    double *kd, *vd; /* [sequence][t][H][D], dequantized */
    int64_t kd_at[MAX_S];
    float *qb, *ob; /* q, out [T][Hq][D + 8] */
    float *lb;      /* lse [T][Hq + 3] */
    unsigned char *ob0, *lb0, *cache0;
    struct kv_view q, out;
    struct kv_pages pages;
    float ks, vs;
    struct kv_scales scl;
};

static const int64_t QPAD = 8, LPAD = 3;

static void run_make(struct run *R, const struct oc *c, const int64_t *lens, const int64_t *qlens,
                     uint32_t S, uint64_t seed)
{
    memset(R, 0, sizeof(*R));
    R->c = c;
    R->S = S;
    const int64_t N = c->N, H = c->H, D = c->D, pt = N / c->r;
    R->pt = pt;
    R->Hq = H * c->g;
    int64_t pages = 0, tot = 0;
    for (uint32_t s = 0; s < S; s++) {
        R->lens[s] = lens[s];
        R->qlens[s] = qlens ? qlens[s] : 1;
        pages += (lens[s] + pt - 1) / pt;
        tot += lens[s];
    }
    const int64_t B = 2 * (pages / c->r + 2) + 6;
    kvt_cache_make(&R->t, 2, B, N, H, D, c->dt, c->bits, seed);
    const int64_t P = B * c->r;
    uint64_t rng = seed * 7 + 1;
    R->indices = malloc((size_t)(pages + 1) * sizeof(int32_t));
    R->table = calloc((size_t)S * TCOLS, sizeof(int32_t));
    uint8_t *used = calloc((size_t)P, 1);
    assert_true(R->indices && R->table && used);
    int32_t k = 0;
    for (uint32_t s = 0; s < S; s++) {
        const int64_t np = (lens[s] + pt - 1) / pt;
        assert_true(np <= TCOLS);
        R->indptr[s] = k;
        for (int64_t j = 0; j < np; j++) {
            int64_t pg;
            do
                pg = kvt_range(&rng, P / 2, P - 1); /* far from 0 */
            while (used[pg]);
            used[pg] = 1;
            R->table[s * TCOLS + j] = (int32_t)pg;
            R->indices[k++] = (int32_t)pg;
        }
        R->last[s] = np ? (int32_t)(lens[s] - (np - 1) * pt) : 0;
        R->lens64[s] = lens[s];
    }
    R->indptr[S] = k;
    free(used);
    R->pages.n_seqs = S;
    R->pages.page_ratio = c->r;
    if (c->csr) {
        R->pages.format = KV_PAGES_CSR;
        R->pages.indptr = R->indptr;
        R->pages.indices = R->indices;
        R->pages.last_page_len = R->last;
    } else {
        R->pages.format = KV_PAGES_BLOCK_TABLE;
        R->pages.block_table = R->table;
        R->pages.block_table_cols = TCOLS;
        R->pages.seq_lens = R->lens64;
    }
    /* K, V of layer 1 at the reference addresses; layer 0 keeps its noise */
    R->ks = c->scales ? 0.5f : 1.0f;
    R->vs = c->scales ? 2.0f : 1.0f;
    R->scl = (struct kv_scales){&R->ks, &R->vs, 1, 0};
    R->kd = malloc((size_t)(tot * H * D + 1) * sizeof(double));
    R->vd = malloc((size_t)(tot * H * D + 1) * sizeof(double));
    assert_true(R->kd && R->vd);
    const int64_t es = (int64_t)kv_dtype_size(c->dt);
    int64_t at = 0;
    for (uint32_t s = 0; s < S; s++) {
        R->kd_at[s] = at;
        for (int64_t t = 0; t < lens[s]; t++, at++) {
            const int64_t slot = (int64_t)R->table[s * TCOLS + t / pt] * pt + t % pt;
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++) {
                    unsigned char *pk =
                        R->t.base +
                        es * kvt_ref_offset_elems(&R->t.cfg.layout, 1, 0, slot / N, slot % N, h, d);
                    unsigned char *pv =
                        R->t.base +
                        es * kvt_ref_offset_elems(&R->t.cfg.layout, 1, 1, slot / N, slot % N, h, d);
                    kv_from_f32(c->dt, (float)kvt_range(&rng, -1000, 1000) / 1000.0f / R->ks, pk);
                    kv_from_f32(c->dt, (float)kvt_range(&rng, -500, 1250) / 1000.0f / R->vs, pv);
                    R->kd[(at * H + h) * D + d] = (double)kv_to_f32(c->dt, pk) * R->ks;
                    R->vd[(at * H + h) * D + d] = (double)kv_to_f32(c->dt, pv) * R->vs;
                }
        }
    }
    R->cache0 = malloc(R->t.bytes);
    assert_non_null(R->cache0);
    memcpy(R->cache0, R->t.base, R->t.bytes);
    /* q rows: qo_indptr over the sequences */
    R->qo[0] = 0;
    for (uint32_t s = 0; s < S; s++)
        R->qo[s + 1] = R->qo[s] + (int32_t)R->qlens[s];
    R->T = R->qo[S];
    const int64_t Hq = R->Hq, T = R->T, row = D + QPAD, n = (T ? T : 1) * Hq * row;
    R->qb = malloc((size_t)n * sizeof(float));
    R->ob = malloc((size_t)n * sizeof(float));
    R->lb = malloc((size_t)((T ? T : 1) * (Hq + LPAD)) * sizeof(float));
    assert_true(R->qb && R->ob && R->lb);
    for (int64_t i = 0; i < n; i++) {
        R->qb[i] = (float)kvt_range(&rng, -3000, 3000) / 1000.0f;
        R->ob[i] = (float)kvt_range(&rng, -9, 9) + 0.125f; /* sentinel values */
    }
    for (int64_t i = 0; i < (T ? T : 1) * (Hq + LPAD); i++)
        R->lb[i] = 1234.5f + (float)i;
    R->ob0 = malloc((size_t)n * sizeof(float));
    R->lb0 = malloc((size_t)((T ? T : 1) * (Hq + LPAD)) * sizeof(float));
    assert_true(R->ob0 && R->lb0);
    memcpy(R->ob0, R->ob, (size_t)n * sizeof(float));
    memcpy(R->lb0, R->lb, (size_t)((T ? T : 1) * (Hq + LPAD)) * sizeof(float));
    struct kv_view flat;
    int64_t sh[3] = {T, Hq, D}, st[3] = {Hq * row, row, 1};
    assert_int_equal(kv_view_init(R->qb, (size_t)n * sizeof(float), KV_F32, 1, &n, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st, 0, &R->q), KV_OK);
    /* out: f32, or a narrower dtype in the same bytes (rows at the same
     * byte pitch would differ: keep element strides, fewer bytes used) */
    const kv_dtype odt = c->out_dt ? c->out_dt : KV_F32;
    const int64_t oes = (int64_t)kv_dtype_size(odt), on = n * 4 / oes;
    assert_int_equal(kv_view_init(R->ob, (size_t)n * sizeof(float), odt, 1, &on, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st, 0, &R->out), KV_OK);
}

static void run_free(struct run *R)
{
    free(R->indices);
    free(R->table);
    free(R->kd);
    free(R->vd);
    free(R->qb);
    free(R->ob);
    free(R->lb);
    free(R->ob0);
    free(R->lb0);
    free(R->cache0);
    kvt_cache_free(&R->t);
}

static struct kv_attn_opts run_opts(const struct run *R)
{
    struct kv_attn_opts o = KV_ATTN_OPTS_INIT;
    o.window_left = R->c->window;
    o.logit_soft_cap = R->c->cap;
    if (R->c->lse) {
        o.lse = R->lb;
        o.lse_stride = R->Hq + LPAD;
    }
    return o;
}

/* out and lse against the float64 reference, then every other byte of
 * their buffers and of the cache against the snapshot. */
static void run_check(struct run *R, const char *what)
{
    const struct oc *c = R->c;
    const int64_t H = c->H, D = c->D, Hq = R->Hq, row = D + QPAD;
    const kv_dtype odt = c->out_dt ? c->out_dt : KV_F32;
    const double scale = 1.0 / sqrt((double)D);
    double *p =
        malloc((size_t)(R->lens[0] + R->lens[1] + R->lens[2] + R->lens[3] + 1) * sizeof(double));
    assert_non_null(p);
    for (uint32_t s = 0; s < R->S; s++)
        for (int64_t i = 0; i < R->qlens[s]; i++) {
            const int64_t rowi = R->qo[s] + i, pos = R->lens[s] - R->qlens[s] + i;
            const int64_t lo = c->window < 0 || pos - c->window < 0 ? 0 : pos - c->window;
            for (int64_t qh = 0; qh < Hq; qh++) {
                const int64_t h = qh / c->g;
                const float *qv = R->qb + (rowi * Hq + qh) * row;
                double mx = -INFINITY, sum = 0;
                for (int64_t t = lo; t <= pos; t++) {
                    const double *kr = R->kd + ((R->kd_at[s] + t) * H + h) * D;
                    double x = 0;
                    for (int64_t d = 0; d < D; d++)
                        x += (double)qv[d] * kr[d];
                    x *= scale;
                    if (c->cap > 0)
                        x = c->cap * tanh(x / c->cap);
                    p[t] = x;
                    mx = x > mx ? x : mx;
                }
                for (int64_t t = lo; t <= pos; t++)
                    sum += (p[t] = exp(p[t] - mx));
                for (int64_t d = 0; d < D; d++) {
                    double ref = 0;
                    for (int64_t t = lo; t <= pos; t++)
                        ref += p[t] / sum * R->vd[((R->kd_at[s] + t) * H + h) * D + d];
                    float *o = R->ob + (rowi * Hq + qh) * row + d; /* f32 element index */
                    const int64_t oes = (int64_t)kv_dtype_size(odt);
                    unsigned char *ob = (unsigned char *)R->ob + ((rowi * Hq + qh) * row + d) * oes;
                    const double got = kv_to_f32(odt, ob);
                    if (odt == KV_F32) {
                        const double err = fabs(got - ref) / (fabs(ref) > 0.1 ? fabs(ref) : 0.1);
                        if (!(err <= 2e-5))
                            fail_msg("%s: row %lld (seq %u, q %lld at %lld) head %lld d %lld: "
                                     "%.9g vs %.9g (rel %.2g)",
                                     what, (long long)rowi, s, (long long)i, (long long)pos,
                                     (long long)qh, (long long)d, got, ref, err);
                    } else {
                        unsigned char w[8];
                        kv_from_f32(odt, (float)ref, w);
                        const double wv = kv_to_f32(odt, w);
                        if (!(fabs(got - wv) <= fabs(wv) * 0.008 + 1e-6)) /* one bf16 step */
                            fail_msg("%s: %s out row %lld head %lld d %lld: %g vs %g", what,
                                     kv_dtype_name(odt), (long long)rowi, (long long)qh,
                                     (long long)d, got, wv);
                    }
                    memcpy(ob, (unsigned char *)R->ob0 + (ob - (unsigned char *)R->ob),
                           (size_t)oes);
                    (void)o;
                }
                if (c->lse) {
                    float *lp = R->lb + rowi * (Hq + LPAD) + qh;
                    const double lref = mx + log(sum);
                    if (!(*lp == lref || /* -inf: no token visible */
                          fabs(*lp - lref) <= 2e-5 * (fabs(lref) > 1 ? fabs(lref) : 1)))
                        fail_msg("%s: lse row %lld head %lld: %.9g vs %.9g", what, (long long)rowi,
                                 (long long)qh, (double)*lp, lref);
                    memcpy(lp,
                           (unsigned char *)R->lb0 + ((unsigned char *)lp - (unsigned char *)R->lb),
                           sizeof(float));
                }
            }
        }
    free(p);
    const int64_t T = R->T ? R->T : 1;
    assert_memory_equal(R->ob, R->ob0, (size_t)(T * Hq * row) * sizeof(float));
    assert_memory_equal(R->lb, R->lb0, (size_t)(T * (Hq + LPAD)) * sizeof(float));
    assert_memory_equal(R->t.base, R->cache0, R->t.bytes);
}

static void expect_ok(kv_status st, const char *what)
{
    if (st != KV_OK)
        fail_msg("%s: %s: %s", what, kv_status_name(st), kv_last_error());
}

/* decode_ex of one case on sequences of lens[] */
static void one_decode(const struct oc *c, const int64_t *lens, uint32_t S, uint64_t seed)
{
    struct run R;
    char what[160];
    run_make(&R, c, lens, NULL, S, seed);
    const struct kv_attn_opts o = run_opts(&R);
    snprintf(what, sizeof(what), "decode_ex %s %s N%lld H%lld D%lld g%lld r%u win %d cap %g",
             kv_dtype_name(c->dt), c->bits & 1 ? "HND" : "NHD", (long long)c->N, (long long)c->H,
             (long long)c->D, (long long)c->g, c->r, c->window, (double)c->cap);
    expect_ok(kv_attn_decode_ex(R.t.pc, 1, &R.q, &R.pages, 1.0f / sqrtf((float)c->D),
                                c->scales ? &R.scl : NULL, &R.out, &o),
              what);
    run_check(&R, what);
    run_free(&R);
}

/* prefill of one case: qlens[s] queries over lens[s] tokens */
static void one_prefill(const struct oc *c, const int64_t *lens, const int64_t *qlens, uint32_t S,
                        uint64_t seed)
{
    struct run R;
    char what[160];
    run_make(&R, c, lens, qlens, S, seed);
    const struct kv_attn_opts o = run_opts(&R);
    snprintf(what, sizeof(what), "prefill %s %s N%lld H%lld D%lld g%lld r%u win %d cap %g",
             kv_dtype_name(c->dt), c->bits & 1 ? "HND" : "NHD", (long long)c->N, (long long)c->H,
             (long long)c->D, (long long)c->g, c->r, c->window, (double)c->cap);
    expect_ok(kv_attn_prefill(R.t.pc, 1, &R.q, R.qo, &R.pages, 1.0f / sqrtf((float)c->D),
                              c->scales ? &R.scl : NULL, &R.out, &o),
              what);
    run_check(&R, what);
    run_free(&R);
}

static const kv_dtype dts[4] = {KV_F16, KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2};

/* Window (off, inside, wider than every sequence, 0), soft cap on and
 * off, lse, over NHD and HND, padded and block-major layouts, f16, bf16
 * and both fp8 caches, GQA groups 1 to 6, head dims on the AVX2 path and
 * off it (36), a page ratio 2, CSR and block table. */
static void test_attn_opts_decode(void **state)
{
    (void)state;
    const int64_t lens[4] = {70, 1, 0, 45};
    static const int32_t wins[4] = {-1, 9, 500, 0};
    static const int64_t gs[4] = {1, 4, 6, 2};
    for (int i = 0; i < 12; i++) {
        struct oc c = {0};
        c.bits = (i & 1) | (i % 3 == 1 ? 4 : 0) | (i % 4 == 2 ? 2 : 0);
        c.dt = dts[i % 4];
        c.N = i % 3 ? 16 : 8;
        c.H = (i & 1) ? 2 : 4;
        c.D = i % 5 == 4 ? 36 : (i % 2 ? 64 : 32);
        c.g = gs[i % 4];
        c.r = i % 3 == 2 ? 2 : 1;
        c.csr = i % 2 == 0;
        c.scales = i % 5 == 1;
        c.window = wins[(i / 2) % 4];
        c.cap = i % 3 == 0 ? 0.0f : 1.5f;
        c.lse = i % 4 != 3;
        c.out_dt = i == 7 ? KV_BF16 : KV_F32;
        one_decode(&c, lens, 4, 100 + (uint64_t)i);
    }
}

/* The multi-token kernel: q_len = seq_len (a whole causal prefill), in
 * between (a chunk over a cached prefix, speculative verification), 0,
 * and 1, with and without the options, every dtype and order; each case
 * on the AVX-512F tile (where the CPU has it: D % 16 == 0, f16 and bf16)
 * and again with AVX2 only (kv__attn_avx2_only). */
static void test_attn_opts_prefill(void **state)
{
    (void)state;
    const int64_t lens[4] = {40, 77, 5, 33};
    const int64_t qlens[3][4] = {{40, 77, 5, 33}, {7, 20, 1, 0}, {1, 33, 5, 17}};
    static const int32_t wins[3] = {-1, 12, 0};
    for (int k = 0; k < 24; k++) {
        const int i = k % 12;
        kv__attn_avx2_only = k >= 12;
        struct oc c = {0};
        c.bits = (i & 1) | (i % 3 == 2 ? 4 : 0);
        c.dt = dts[i % 4];
        c.N = i % 2 ? 16 : 8;
        c.H = (i & 1) ? 2 : 3;
        c.D = i % 6 == 5 ? 36 : (i % 6 == 2 ? 40 : 32); /* 40: the tile's 8-wide tail */
        c.g = i % 3 == 0 ? 4 : (i % 3 == 1 ? 1 : 5);
        c.r = i % 4 == 3 ? 2 : 1;
        c.csr = i % 3 != 1;
        c.scales = i == 4;
        c.window = i < 6 ? -1 : wins[i % 3];
        c.cap = i % 4 == 1 ? 2.0f : 0.0f;
        c.lse = i % 2 == 0;
        one_prefill(&c, lens, qlens[i % 3], 4, 200 + (uint64_t)i);
    }
    kv__attn_avx2_only = false;
}

/* q_len 1 for every sequence is a decode step: the same bytes as
 * kv_attn_decode_ex (and kv_attn_decode when the options are off). */
static void test_attn_opts_prefill_q1_is_decode(void **state)
{
    (void)state;
    const int64_t lens[3] = {100, 3, 64}, q1[3] = {1, 1, 1};
    for (int i = 0; i < 4; i++) {
        struct oc c = {0};
        c.bits = i & 1;
        c.dt = dts[i];
        c.N = 16, c.H = 4, c.D = 64, c.g = 4, c.r = 1, c.csr = true;
        c.window = i < 2 ? -1 : 20;
        c.cap = i == 3 ? 3.0f : 0.0f;
        c.lse = i >= 2;
        struct run R;
        run_make(&R, &c, lens, q1, 3, 300 + (uint64_t)i);
        const struct kv_attn_opts o = run_opts(&R);
        const float sc = 0.125f;
        const size_t ob = (size_t)(3 * R.Hq * (c.D + QPAD)) * sizeof(float),
                     lb = (size_t)(3 * (R.Hq + LPAD)) * sizeof(float);
        expect_ok(kv_attn_prefill(R.t.pc, 1, &R.q, R.qo, &R.pages, sc, NULL, &R.out, &o),
                  "prefill q_len 1");
        unsigned char *o1 = malloc(ob), *l1 = malloc(lb);
        assert_true(o1 && l1);
        memcpy(o1, R.ob, ob);
        memcpy(l1, R.lb, lb);
        memcpy(R.ob, R.ob0, ob);
        memcpy(R.lb, R.lb0, lb);
        if (i < 2)
            expect_ok(kv_attn_decode(R.t.pc, 1, &R.q, &R.pages, sc, NULL, &R.out), "decode");
        else
            expect_ok(kv_attn_decode_ex(R.t.pc, 1, &R.q, &R.pages, sc, NULL, &R.out, &o),
                      "decode_ex");
        assert_memory_equal(R.ob, o1, ob);
        assert_memory_equal(R.lb, l1, lb);
        free(o1);
        free(l1);
        run_free(&R);
    }
}

/* Every option checked by name, with nothing written: out, lse and the
 * cache byte-identical after each refusal. */
static void test_attn_opts_refusals(void **state)
{
    (void)state;
    struct oc c = {0};
    c.bits = 0, c.dt = KV_BF16, c.N = 8, c.H = 2, c.D = 16, c.g = 2, c.r = 1, c.csr = true;
    c.window = -1, c.lse = true;
    const int64_t lens[2] = {5, 3}, ql[2] = {2, 3};
    struct run R;
    run_make(&R, &c, lens, ql, 2, 400);
    const size_t ob = (size_t)(R.T * R.Hq * (c.D + QPAD)) * sizeof(float),
                 lb = (size_t)(R.T * (R.Hq + LPAD)) * sizeof(float);
    struct kv_attn_opts o;
    kv_status st;
#define REFUSED(call, want, needle)                                                                \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != (want))                                                                          \
            fail_msg("%s: got %s (%s), want %s", #call, kv_status_name(st), kv_last_error(),       \
                     kv_status_name(want));                                                        \
        kvt_assert_msg_has(needle);                                                                \
        assert_memory_equal(R.ob, R.ob0, ob);                                                      \
        assert_memory_equal(R.lb, R.lb0, lb);                                                      \
        assert_memory_equal(R.t.base, R.cache0, R.t.bytes);                                        \
    } while (0)
#define PF(opts) kv_attn_prefill(R.t.pc, 1, &R.q, R.qo, &R.pages, 0.25f, NULL, &R.out, opts)
    o = run_opts(&R);
    o.window_left = -2;
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "window_left -2");
    o = run_opts(&R);
    o.logit_soft_cap = -1.0f;
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "logit_soft_cap -1");
    o.logit_soft_cap = NAN;
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "logit_soft_cap nan");
    o.logit_soft_cap = INFINITY;
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "logit_soft_cap inf");
    o = run_opts(&R);
    o.struct_size = sizeof(o) - 8;
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "kv_attn_opts");
    o = run_opts(&R);
    o.lse_stride = R.Hq - 1;
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "lse_stride 3");
    o.lse_stride = -5;
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "lse_stride -5");
    o = run_opts(&R);
    o.lse = (float *)((char *)R.lb + 2);
    REFUSED(PF(&o), KV_ERR_INVALID_ARG, "not 4-byte aligned");
    o = run_opts(&R);
    o.lse = R.ob + 3; /* inside out's buffer, between its elements' extent */
    REFUSED(PF(&o), KV_ERR_OVERLAP, "lse (bytes");
    o.lse = R.qb;
    REFUSED(PF(&o), KV_ERR_OVERLAP, "overlaps q");
    o.lse = (float *)(R.t.base + 64);
    REFUSED(PF(&o), KV_ERR_OVERLAP, "cache storage");
    o = run_opts(&R);
    REFUSED(kv_attn_prefill(R.t.pc, 1, &R.q, NULL, &R.pages, 0.25f, NULL, &R.out, &o), KV_ERR_NULL,
            "qo_indptr=");
    int32_t qo[3] = {1, 2, 5};
    REFUSED(kv_attn_prefill(R.t.pc, 1, &R.q, qo, &R.pages, 0.25f, NULL, &R.out, &o), KV_ERR_CORRUPT,
            "qo_indptr[0] is 1");
    qo[0] = 0, qo[1] = 4, qo[2] = 3;
    REFUSED(kv_attn_prefill(R.t.pc, 1, &R.q, qo, &R.pages, 0.25f, NULL, &R.out, &o), KV_ERR_CORRUPT,
            "qo_indptr decreases at sequence 1");
    qo[1] = 1, qo[2] = 5; /* sequence 1: q_len 4 over 3 tokens */
    REFUSED(kv_attn_prefill(R.t.pc, 1, &R.q, qo, &R.pages, 0.25f, NULL, &R.out, &o),
            KV_ERR_BAD_SHAPE, "sequence 1 has q_len 4");
    qo[1] = 2, qo[2] = 4; /* 4 rows, q has 5 */
    REFUSED(kv_attn_prefill(R.t.pc, 1, &R.q, qo, &R.pages, 0.25f, NULL, &R.out, &o),
            KV_ERR_BAD_SHAPE, "qo_indptr[2] = 4 but q and out have 5 rows");
    /* decode_ex: the same option checks */
    struct kv_view q2, o2;
    assert_int_equal(kv_view_narrow(&R.q, 0, 0, 2, &q2), KV_OK);
    assert_int_equal(kv_view_narrow(&R.out, 0, 0, 2, &o2), KV_OK);
    o = run_opts(&R);
    o.window_left = -7;
    REFUSED(kv_attn_decode_ex(R.t.pc, 1, &q2, &R.pages, 0.25f, NULL, &o2, &o), KV_ERR_INVALID_ARG,
            "kv_attn_decode_ex: window_left -7");
    /* CUDA entries: the same validator, then the CUDA kernels (options:
     * the multi-token body, tests/unit/test_grid_prefill.c). Unless a GPU
     * is expected (host pointers would reach it), valid calls get
     * KV_ERR_UNSUPPORTED naming the entry here (no device, or no CUDA). */
    const char *e = getenv("KV_EXPECT_GPU");
    if (!(e && e[0] == '1')) {
        struct kv_paged_cache dev = R.t.pc;
        dev.mem = KV_MEM_DEVICE; /* nothing is launched: every call is refused */
        /* window, soft cap and lse are the CUDA decode's too (tests/unit/
         * test_grid.c runs them on the emulated bodies): valid options reach
         * the launcher, which finds no device here */
        o = run_opts(&R);
        o.lse = NULL;
        o.window_left = 4;
        REFUSED(kv_attn_decode_ex_cuda(dev, 1, &q2, &R.pages, 0.25f, NULL, &o2, &o, NULL),
                KV_ERR_UNSUPPORTED, "_cuda");
        o.window_left = -1, o.logit_soft_cap = 5.0f;
        REFUSED(kv_attn_decode_ex_cuda(dev, 1, &q2, &R.pages, 0.25f, NULL, &o2, &o, NULL),
                KV_ERR_UNSUPPORTED, "_cuda");
        o = run_opts(&R);
        REFUSED(kv_attn_decode_ex_cuda(dev, 1, &q2, &R.pages, 0.25f, NULL, &o2, &o, NULL),
                KV_ERR_UNSUPPORTED, "_cuda");
        o.window_left = -3; /* validation first */
        REFUSED(kv_attn_decode_ex_cuda(dev, 1, &q2, &R.pages, 0.25f, NULL, &o2, &o, NULL),
                KV_ERR_INVALID_ARG, "window_left -3");
        REFUSED(kv_attn_prefill_cuda(dev, 1, &R.q, R.qo, &R.pages, 0.25f, NULL, &R.out, NULL, NULL),
                KV_ERR_UNSUPPORTED, "kv_attn_prefill_cuda: ");
        o = run_opts(&R);
        o.logit_soft_cap = -2.0f;
        REFUSED(kv_attn_prefill_cuda(dev, 1, &R.q, R.qo, &R.pages, 0.25f, NULL, &R.out, &o, NULL),
                KV_ERR_INVALID_ARG, "logit_soft_cap -2");
        /* options off reach the CUDA decode kernel's launcher: no device here
         * (its message names kv_attn_decode_cuda in a CUDA build) */
        REFUSED(kv_attn_decode_ex_cuda(dev, 1, &q2, &R.pages, 0.25f, NULL, &o2, NULL, NULL),
                KV_ERR_UNSUPPORTED, "_cuda");
    }
    /* and the valid call after all that, against the reference */
    o = run_opts(&R);
    expect_ok(kv_attn_prefill(R.t.pc, 1, &R.q, R.qo, &R.pages, 1.0f / sqrtf((float)c.D), NULL,
                              &R.out, &o),
              "valid after refusals");
    run_check(&R, "valid after refusals");
#undef PF
#undef REFUSED
    run_free(&R);
}

/* Sequences long enough for several threads (more than 256 KiB of K/V),
 * then the portable (non-AVX2) chunk on the same cases. */
static void test_attn_opts_threads_and_portable(void **state)
{
    (void)state;
    const int64_t lens[2] = {1500, 700}, qlens[2] = {20, 9};
    struct oc c = {0};
    c.bits = 4, c.dt = KV_BF16, c.N = 16, c.H = 4, c.D = 64, c.g = 2, c.r = 1, c.csr = true;
    c.window = 600, c.cap = 4.0f, c.lse = true;
    assert_int_equal(kv_set_threads(4), KV_OK);
    for (int portable = 0; portable < 2; portable++) {
        kv__attn_test_tune(-1, portable == 1);
        one_prefill(&c, lens, qlens, 2, 500 + (uint64_t)portable);
        c.bits ^= 1;
        c.dt = KV_FP8_E4M3;
        one_decode(&c, lens, 2, 510 + (uint64_t)portable);
        c.dt = KV_BF16;
    }
    kv__attn_test_tune(-1, false);
    assert_int_equal(kv_set_threads(0), KV_OK); /* the default */
}

/* The same call at 1, 3, 7 and 16 threads gives the same bytes (out and
 * lse): a batch large enough to run whole (no KV split), small batches of
 * long sequences whose tokens split into parts (docs/kernels.md), NHD and
 * HND, bf16 and e4m3, decode and prefill, with and without a window. */
static void test_attn_opts_threads_same_bytes(void **state)
{
    (void)state;
    static const int nts[4] = {1, 3, 7, 16};
    const int64_t lens[3][4] = {{700, 2048, 64, 1000}, {2048, 2048, 1800, 2100}, {3000, 9, 1, 0}};
    const int64_t qlens[3][4] = {{64, 64, 64, 64}, {4, 4, 4, 4}, {16, 9, 1, 0}};
    for (int i = 0; i < 8; i++) {
        struct oc c = {0};
        c.bits = (i & 1) | (i == 4 ? 4 : 0);
        c.dt = i % 4 < 2 ? KV_BF16 : KV_FP8_E4M3;
        c.N = 16, c.H = i < 4 ? 8 : 2, c.D = i == 6 ? 128 : 64, c.g = 4, c.r = 1;
        c.csr = i % 3 != 2;
        c.window = i == 5 ? 700 : -1;
        c.lse = true;
        const int kind = i % 3; /* lens and qlens */
        const bool decode = i == 7;
        struct run R;
        run_make(&R, &c, lens[kind], decode ? NULL : qlens[kind], 4, 700 + (uint64_t)i);
        const struct kv_attn_opts o = run_opts(&R);
        const size_t ob = (size_t)((R.T ? R.T : 1) * R.Hq * (c.D + QPAD)) * sizeof(float);
        const size_t lb = (size_t)((R.T ? R.T : 1) * (R.Hq + LPAD)) * sizeof(float);
        unsigned char *o1 = malloc(ob), *l1 = malloc(lb);
        assert_true(o1 && l1);
        for (int k = 0; k < 4; k++) {
            char what[160];
            snprintf(what, sizeof(what), "case %d (%s %s %s) at %d threads", i,
                     decode ? "decode" : "prefill", c.bits & 1 ? "HND" : "NHD", kv_dtype_name(c.dt),
                     nts[k]);
            assert_int_equal(kv_set_threads(nts[k]), KV_OK);
            memcpy(R.ob, R.ob0, ob);
            memcpy(R.lb, R.lb0, lb);
            const float sc = 1.0f / sqrtf((float)c.D);
            if (decode)
                expect_ok(kv_attn_decode_ex(R.t.pc, 1, &R.q, &R.pages, sc, NULL, &R.out, &o), what);
            else
                expect_ok(kv_attn_prefill(R.t.pc, 1, &R.q, R.qo, &R.pages, sc, NULL, &R.out, &o),
                          what);
            if (k == 0) {
                memcpy(o1, R.ob, ob);
                memcpy(l1, R.lb, lb);
            } else if (memcmp(R.ob, o1, ob) != 0 || memcmp(R.lb, l1, lb) != 0) {
                fail_msg("%s: out or lse differs from 1 thread's", what);
            }
        }
        /* and the bytes are right (the 16-thread call's) */
        if (i == 1 || i == 7)
            run_check(&R, "same bytes, 16 threads");
        free(o1);
        free(l1);
        run_free(&R);
    }
    assert_int_equal(kv_set_threads(0), KV_OK); /* the default */
}

/* Small batches of long sequences, their tokens split into parts merged
 * by their online-softmax state, against the float64 reference: a few
 * queries over 4,100 and 2,600 tokens (5 and 3 parts), a whole causal
 * prefill of 1,100 tokens (2 parts: a tile's second part is empty or sees
 * none of some queries' tokens), a window, the soft cap, lse, NHD and HND, bf16, e4m3,
 * f16, 4 threads and the portable chunk. */
static void test_attn_opts_split_long(void **state)
{
    (void)state;
    const int64_t lens[2][4] = {{4100, 2600, 0, 0}, {1100, 0, 0, 0}};
    const int64_t qlens[2][4] = {{5, 33, 0, 0}, {1100, 0, 0, 0}};
    assert_int_equal(kv_set_threads(4), KV_OK);
    for (int i = 0; i < 6; i++) {
        struct oc c = {0};
        const int kind = i >= 4;
        c.bits = (i & 1) | (i == 2 ? 4 : 0);
        c.dt = i % 3 == 0 ? KV_BF16 : (i % 3 == 1 ? KV_FP8_E4M3 : KV_F16);
        c.N = 16, c.H = 2, c.D = kind ? 32 : 64, c.g = kind ? 1 : 4, c.r = 1;
        c.csr = i % 2 == 0;
        c.window = i == 3 ? 1500 : -1;
        c.cap = i == 2 ? 3.0f : 0.0f;
        c.lse = true;
        kv__attn_test_tune(-1, i == 5);
        one_prefill(&c, lens[kind], qlens[kind], kind ? 1 : 2, 800 + (uint64_t)i);
        if (i < 2)
            one_decode(&c, lens[kind], kind ? 1 : 2, 820 + (uint64_t)i);
    }
    kv__attn_test_tune(-1, false);
    assert_int_equal(kv_set_threads(0), KV_OK); /* the default */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attn_opts_decode),
        cmocka_unit_test(test_attn_opts_prefill),
        cmocka_unit_test(test_attn_opts_prefill_q1_is_decode),
        cmocka_unit_test(test_attn_opts_refusals),
        cmocka_unit_test(test_attn_opts_threads_and_portable),
        cmocka_unit_test(test_attn_opts_threads_same_bytes),
        cmocka_unit_test(test_attn_opts_split_long),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
