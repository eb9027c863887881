/*
 * test_grid.c - the CUDA kernel bodies (attention/kv_attn_kernels_hd.h) run
 * on the CPU grid emulator (kvcache/kv_grid_hd.h), and the emulator's own
 * strictness. Jobs come from the kernels' validator with the *_cuda names
 * (pinned host storage: what the CUDA entries accept and the CPU can read),
 * then kv__grid_attn_* runs the launch kv_attn_cuda.cu would make: the same
 * parameters, grid, block size, vector width and shared memory, and the
 * same body code over every (block, thread).
 *
 * References are written here, element by element, and address the cache
 * through kvt_ref_offset_elems (the layout's config alone):
 *   - write: every layout kind (NHD/HND, layer/block-major, padded, packed
 *     K|V), bytes moves of every vector width (16, 8, 4, 2, 1: the width
 *     that ran is checked) and converting moves (f32/f16/bf16/fp8, per
 *     tensor and per head scales), one layer and all layers, tensors with
 *     padded rows or a strided head dim, runs of several tokens, slot -1,
 *     block ids far from 0; the WHOLE pool compared, the source unchanged;
 *   - read: back into garbage-filled padded outputs, each element against
 *     the reference, every other output byte untouched, the pool unchanged;
 *   - decode: within 1e-5 of a float64 softmax, sequences of 0 to 70 tokens
 *     (partial pages, page ratio 2), grouped query heads, f32 and fp8 caches
 *     with scales, one warp where four do not fit in shared memory (the
 *     launch's block and shared bytes checked); the output's padding
 *     untouched, the pool unchanged; past 48 KiB a refusal naming the values;
 *   - copy blocks and copy_ex (two caches, a layer range, one plane of a
 *     packed block): the whole destination pool, the source pool unchanged;
 *   - the view copy (kv_view_cuda.cu's body): permuted, padded, offset and
 *     overlapping-free strided views of 1-, 2-, 4- and 8-byte elements,
 *     every path (vectors 16..1, strided) against the view formula, the
 *     whole destination buffer compared;
 *   - the plan's narrow copies (kv_plan_cuda.cu's body) with the wide ones
 *     as cudaMemcpy2D does them: NHD <-> HND, head slices, a layer range,
 *     a misaligned source, against the config-only reference, whole pools;
 *   - the emulator refuses what CUDA refuses (block > 1024, grid 0, shared
 *     memory > 48 KiB) and faults on what is undefined on a GPU (a skipped
 *     barrier, threads at different barriers, a divergent or partial warp
 *     op, misaligned vectors and 64-bit atomics, writes past either end of
 *     shared memory); a launch without shared memory sees NULL.
 * scripts/check-mutations.sh shows these tests fail for mutated bodies.
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
#include "kv_attn_kernels_hd.h" /* KV__CDEC_*: the decode bodies */
#include "kv_grid_hd.h"
#include "kv_mem.h"
#include "kv_plan_grid_int.h"
#include "kv_view_cuda_int.h"
#include "kv_view_grid_int.h"
#include "kv_view_int.h"
#include "kvt_grid.h"
#include "kvt_side.h"
#include "kvtest.h"

/* ---- write and read ------------------------------------------------------------------- */

struct mv_case {
    kv_order order;
    kv_arrange arrange;
    int64_t pad;
    bool packed;
    int64_t N, H, D;
    kv_dtype cache_dt, src_dt;
    bool strided, all_layers;
    int64_t shift;
    int scales;     /* 0 none, 1 per tensor, 2 per head */
    int want_width; /* the bytes move's vector width; 0: a converting move */
};

static void run_move(const struct mv_case *mc, uint64_t seed)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    struct kvt_gfix f;
    uint64_t rng = seed;
    const int64_t L = 2, N = mc->N, H = mc->H, D = mc->D, B = 300;
    cfg.num_layers = L, cfg.num_blocks = B, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = mc->cache_dt, cfg.order = mc->order;
    cfg.arrange = mc->arrange, cfg.kv_packed = mc->packed, cfg.block_pad_elems = mc->pad;
    kvt_gfix_init(&f, &cfg, seed);
    /* 4 runs in distinct blocks 200..299 (the last one partial), then a -1 */
    int64_t slots[32], T = 0;
    uint32_t used[4];
    for (int r = 0; r < 4; r++) {
        uint32_t b;
        bool dup;
        do {
            b = (uint32_t)kvt_range(&rng, 200, B - 1);
            dup = false;
            for (int k = 0; k < r; k++)
                dup |= used[k] == b;
        } while (dup);
        used[r] = b;
        const int64_t n = r == 3 ? N - 1 : N, first = r == 3 ? 1 : 0;
        for (int64_t i = 0; i < n && i < 6; i++)
            slots[T++] = (int64_t)b * N + first + i;
    }
    slots[T++] = -1;
    const int64_t nl = mc->all_layers ? L : 1;
    const int32_t layer = mc->all_layers ? KV_ATTN_ALL_LAYERS : 1;
    struct kvt_tens k, v;
    kvt_tens_make(&k, mc->src_dt, mc->all_layers ? L : 0, T, H, D, mc->strided, mc->shift,
                  seed + 7);
    kvt_tens_make(&v, mc->src_dt, mc->all_layers ? L : 0, T, H, D, mc->strided, mc->shift,
                  seed + 9);
    unsigned char *k0 = malloc(k.bytes + 64), *v0 = malloc(v.bytes + 64);
    assert_true(k0 && v0);
    memcpy(k0, k.mem, k.bytes + 64);
    memcpy(v0, v.mem, v.bytes + 64);
    float ks[8], vs[8];
    for (int h = 0; h < 8; h++)
        ks[h] = 0.25f * (float)(h + 1), vs[h] = 1.5f / (float)(h + 1);
    struct kv_scales sc = {ks, vs, mc->scales == 2 ? (uint32_t)H : 1, 0};
    const struct kv_scales *scp = mc->scales ? &sc : NULL;
    const bool raw = mc->cache_dt == mc->src_dt && !mc->scales;

    /* reference write */
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0)
            continue;
        for (int64_t lr = 0; lr < nl; lr++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++) {
                        unsigned char *dst =
                            kvt_gat(&f, f.ref, mc->all_layers ? lr : layer, kv, slots[t], h, d);
                        const unsigned char *src = kvt_tens_at(kv ? &v : &k, lr, t, h, d);
                        if (raw) {
                            memcpy(dst, src, (size_t)f.es);
                        } else {
                            const float s = (kv ? vs : ks)[mc->scales == 2 ? h : 0];
                            const float x = kv_to_f32(mc->src_dt, src);
                            kv_from_f32(mc->cache_dt, mc->scales ? x / s : x, dst);
                        }
                    }
    }
    struct kv__attn_job j;
    kv_status st = kv__attn_write_check("kv_attn_write_cuda", &f.c, layer, &k.v, &v.v,
                                        (struct kv__attn_slots){slots, false}, T, scp, &j);
    if (st != KV_OK)
        fail_msg("write check: %s: %s", kv_status_name(st), kv_last_error());
    st = kv__grid_attn_move(&j, true);
    const int64_t max_run = j.max_run;
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated write: %s: %s", kv_status_name(st), kv_last_error());
    struct kv__grid_attn_last last;
    kv__grid_attn_last(&last);
    assert_int_equal(last.vbytes, mc->want_width);
    /* blocks of the power of two (32 .. 256) covering the longest run's
     * vectors (elements when converting) */
    const int64_t per_row = last.vbytes ? D * f.c.layout.elem_bytes / last.vbytes : D,
                  need = max_run * H * per_row;
    uint64_t want_block = 32;
    while (want_block < 256 && (int64_t)want_block < need)
        want_block *= 2;
    assert_int_equal(last.launch.block, want_block);
    kvt_gfix_check(&f, "pool after the emulated write");
    kvt_check_bytes(k.mem, k0, k.bytes + 64, "K source after the write");
    kvt_check_bytes(v.mem, v0, v.bytes + 64, "V source after the write");

    /* read the written tokens back, as one sequence per run (CSR pages) */
    struct kvt_tens ko, vo;
    const int64_t Tr = T - 1;
    kvt_tens_make(&ko, mc->src_dt, mc->all_layers ? L : 0, Tr, H, D, !mc->strided, mc->shift,
                  seed + 11);
    kvt_tens_make(&vo, mc->src_dt, mc->all_layers ? L : 0, Tr, H, D, !mc->strided, mc->shift,
                  seed + 13);
    unsigned char *ko0 = malloc(ko.bytes + 64), *vo0 = malloc(vo.bytes + 64);
    assert_true(ko0 && vo0);
    memcpy(ko0, ko.mem, ko.bytes + 64);
    memcpy(vo0, vo.mem, vo.bytes + 64);
    /* sequence r: the tokens of run r; page = its block; token 0 of the
     * partial run is at offset 1, so that sequence starts at slot b*N and its
     * first token is slot b*N: read it from there */
    int32_t indptr[5], indices[4], lastlen[4];
    int64_t rslot[32];
    int64_t t = 0;
    for (int r = 0; r < 4; r++) {
        const int64_t n = r == 3 ? N - 1 : N;
        const int64_t cnt = n < 6 ? n : 6;
        indptr[r] = r;
        indices[r] = (int32_t)used[r];
        lastlen[r] = (int32_t)cnt;
        for (int64_t i = 0; i < cnt; i++)
            rslot[t++] = (int64_t)used[r] * N + i;
    }
    indptr[4] = 4;
    assert_int_equal(t, Tr);
    struct kv_pages pages;
    memset(&pages, 0, sizeof(pages));
    pages.format = KV_PAGES_CSR;
    pages.n_seqs = 4;
    pages.page_ratio = 1;
    pages.indptr = indptr;
    pages.indices = indices;
    pages.last_page_len = lastlen;
    st = kv__attn_read_check("kv_attn_read_cuda", &f.c, layer, &pages, &ko.v, &vo.v, scp, &j);
    if (st != KV_OK)
        fail_msg("read check: %s: %s", kv_status_name(st), kv_last_error());
    st = kv__grid_attn_move(&j, false);
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated read: %s: %s", kv_status_name(st), kv_last_error());
    kvt_gfix_check(&f, "pool after the emulated read");
    for (int64_t tk = 0; tk < Tr; tk++)
        for (int64_t lr = 0; lr < nl; lr++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++) {
                        const struct kvt_tens *o = kv ? &vo : &ko;
                        unsigned char *got = kvt_tens_at(o, lr, tk, h, d), want[8];
                        const unsigned char *cached =
                            kvt_gat(&f, f.ref, mc->all_layers ? lr : layer, kv, rslot[tk], h, d);
                        if (raw) {
                            memcpy(want, cached, (size_t)f.es);
                        } else {
                            const float s = (kv ? vs : ks)[mc->scales == 2 ? h : 0];
                            const float x = kv_to_f32(mc->cache_dt, cached);
                            kv_from_f32(mc->src_dt, mc->scales ? x * s : x, want);
                        }
                        if (memcmp(got, want, kv_dtype_size(mc->src_dt)) != 0)
                            fail_msg("read %c l%lld t%lld h%lld d%lld: %g, expected %g",
                                     kv ? 'V' : 'K', (long long)lr, (long long)tk, (long long)h,
                                     (long long)d, (double)kv_to_f32(mc->src_dt, got),
                                     (double)kv_to_f32(mc->src_dt, want));
                        const unsigned char *before = (kv ? vo0 : ko0) + (got - o->mem);
                        memcpy(got, before, kv_dtype_size(mc->src_dt)); /* for the guard */
                    }
    kvt_check_bytes(ko.mem, ko0, ko.bytes + 64, "K output outside its view");
    kvt_check_bytes(vo.mem, vo0, vo.bytes + 64, "V output outside its view");
    free(ko0), free(vo0), free(k0), free(v0);
    kv__mem_free(ko.mem), kv__mem_free(vo.mem), kv__mem_free(k.mem), kv__mem_free(v.mem);
    kvt_gfix_free(&f);
}

static void test_grid_write_read(void **state)
{
    (void)state;
    static const struct mv_case cases[] = {
        /* order, arrange, pad, packed, N, H, D, cache, src, strided, all, shift, scales, width */
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, false, 8, 4, 64, KV_F16, KV_F16, false, false, 0,
         0, 16},
        {KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, 8, true, 8, 3, 64, KV_BF16, KV_BF16, false, true, 0,
         0, 16},
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 4, false, 4, 2, 36, KV_F16, KV_F16, false, false, 0,
         0, 8},
        {KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 2, true, 4, 2, 34, KV_F16, KV_F16, false, true, 0, 0,
         4},
        {KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, 1, false, 4, 3, 33, KV_F16, KV_F16, false, false, 0,
         0, 2},
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, false, 8, 2, 64, KV_FP8_E4M3, KV_FP8_E4M3, false,
         false, 1, 0, 1},
        {KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 0, false, 8, 2, 32, KV_F32, KV_F32, true, false, 0,
         0, 4},
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 8, false, 8, 4, 64, KV_FP8_E4M3, KV_F32, false,
         false, 0, 1, 0},
        {KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, 0, true, 4, 3, 40, KV_FP8_E5M2, KV_BF16, true, true,
         0, 2, 0},
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, false, 8, 2, 48, KV_BF16, KV_F16, false, true, 0,
         0, 0},
        {KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 4, false, 8, 2, 64, KV_F16, KV_F16, false, false, 0,
         2, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_move(&cases[i], 100 + i);
}

/* ---- decode ------------------------------------------------------------------------------ */

struct dec_case {
    kv_order order;
    kv_arrange arrange;
    int64_t pad;
    bool packed;
    int64_t N, H, g, D;
    uint32_t r;
    kv_dtype cache_dt;
    int scales;   /* 0 none, 1 per tensor, 2 per head */
    int32_t win1; /* window_left + 1 (0: no window) */
    float cap;    /* logit soft cap (0: off) */
    bool lse;     /* the lse output, in a padded [S][Hq + 3] buffer */
};

/* Decode case dc on the emulated CUDA body `body` (kv__cdec_body: auto,
 * general, vector, pipelined vector or split-KV with `chunks` chunks a
 * sequence, 0: its plan); vec: the rows allow the vector bodies (else every
 * body runs the general one). */
static void run_decode(const struct dec_case *dc, uint64_t seed, int body, int chunks, bool vec)
{
    static const int64_t lens[4] = {0, 1, 23, 70};
    const uint32_t S = 4;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    struct kvt_gfix f;
    uint64_t rng = seed;
    const int64_t N = dc->N, D = dc->D, H = dc->H, Hq = H * dc->g, pt = N / dc->r;
    cfg.num_layers = 2, cfg.block_tokens = N, cfg.num_heads = H, cfg.head_dim = D;
    cfg.dtype = dc->cache_dt, cfg.order = dc->order, cfg.arrange = dc->arrange;
    cfg.kv_packed = dc->packed, cfg.block_pad_elems = dc->pad;
    cfg.num_blocks = 200;
    kvt_gfix_init(&f, &cfg, seed);
    const int64_t P = cfg.num_blocks * dc->r;
    int32_t indptr[5], indices[64], last[4];
    uint8_t used[800] = {0};
    int32_t k = 0;
    for (uint32_t s = 0; s < S; s++) {
        const int64_t np = (lens[s] + pt - 1) / pt;
        indptr[s] = k;
        for (int64_t p = 0; p < np; p++) {
            int64_t pg;
            do
                pg = kvt_range(&rng, P / 2, P - 1);
            while (used[pg]);
            used[pg] = 1;
            indices[k++] = (int32_t)pg;
        }
        last[s] = np ? (int32_t)(lens[s] - (np - 1) * pt) : 0;
    }
    indptr[S] = k;
    const uint32_t layer = 1;
    float ksc[8], vsc[8];
    for (int h = 0; h < 8; h++)
        ksc[h] = dc->scales ? 0.5f + 0.25f * (float)h : 1.0f,
        vsc[h] = dc->scales ? 2.0f - 0.125f * (float)h : 1.0f;
    const int per_head = dc->scales == 2;
    double *kd = calloc((size_t)(S * 70 * H * D), sizeof(double));
    double *vd = calloc((size_t)(S * 70 * H * D), sizeof(double));
    assert_true(kd && vd);
    for (uint32_t s = 0; s < S; s++)
        for (int64_t t = 0; t < lens[s]; t++) {
            const int64_t slot = (int64_t)indices[indptr[s] + t / pt] * pt + t % pt;
            for (int64_t h = 0; h < H; h++) {
                const float ks = ksc[per_head ? h : 0], vs = vsc[per_head ? h : 0];
                for (int64_t d = 0; d < D; d++) {
                    const float x = (float)kvt_range(&rng, -1000, 1000) / 1000.0f;
                    const float y = (float)kvt_range(&rng, 250, 1250) / 1000.0f;
                    unsigned char *pk = kvt_gat(&f, f.pool, layer, 0, slot, h, d);
                    unsigned char *pv = kvt_gat(&f, f.pool, layer, 1, slot, h, d);
                    kv_from_f32(dc->cache_dt, x / ks, pk);
                    kv_from_f32(dc->cache_dt, y / vs, pv);
                    const int64_t i = ((s * 70 + t) * H + h) * D + d;
                    kd[i] = (double)kv_to_f32(dc->cache_dt, pk) * ks;
                    vd[i] = (double)kv_to_f32(dc->cache_dt, pv) * vs;
                }
            }
        }
    memcpy(f.ref, f.pool, f.bytes);
    /* q and out [S][Hq][D] with padded rows */
    const int64_t row = D + 8, n1 = S * Hq * row;
    float *qb = kv__mem_alloc_aligned(64, (size_t)n1 * 4),
          *ob = kv__mem_alloc_aligned(64, (size_t)n1 * 4);
    assert_true(qb && ob);
    for (int64_t i = 0; i < n1; i++)
        qb[i] = (float)kvt_range(&rng, -1000, 1000) / 1000.0f;
    kvt_fill(ob, (size_t)n1 * 4, seed + 5);
    float *ob0 = malloc((size_t)n1 * 4);
    memcpy(ob0, ob, (size_t)n1 * 4);
    struct kv_view q, out, flat;
    int64_t sh[3] = {S, Hq, D}, st3[3] = {Hq * row, row, 1}, nn = n1;
    assert_int_equal(kv_view_init(qb, (size_t)n1 * 4, KV_F32, 1, &nn, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st3, 0, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)n1 * 4, KV_F32, 1, &nn, &flat), KV_OK);
    assert_int_equal(kv_view_as_strided(&flat, 3, sh, st3, 0, &out), KV_OK);
    struct kv_pages pages;
    memset(&pages, 0, sizeof(pages));
    pages.format = KV_PAGES_CSR;
    pages.n_seqs = S;
    pages.page_ratio = dc->r;
    pages.indptr = indptr;
    pages.indices = indices;
    pages.last_page_len = last;
    struct kv_scales scl = {ksc, vsc, per_head ? (uint32_t)H : 1, 0};
    const float smscale = 1.0f / sqrtf((float)D);
    const int64_t lstride = Hq + 3;
    float lse[4 * (16 * 4 + 3)], lse0[4 * (16 * 4 + 3)];
    assert_true(S * lstride <= (int64_t)(sizeof(lse) / sizeof(lse[0])));
    for (size_t i = 0; i < sizeof(lse) / sizeof(lse[0]); i++)
        lse[i] = lse0[i] = -12345.0f;
    struct kv_attn_opts ao = KV_ATTN_OPTS_INIT;
    ao.window_left = dc->win1 - 1;
    ao.logit_soft_cap = dc->cap;
    ao.lse = dc->lse ? lse : NULL;
    ao.lse_stride = dc->lse ? lstride : 0;
    const bool any_opt = dc->win1 || dc->cap > 0.0f || dc->lse;
    struct kv__attn_job j;
    kv_status st =
        kv__attn_decode_check("kv_attn_decode_cuda", &f.c, layer, &q, NULL, &pages, smscale,
                              dc->scales ? &scl : NULL, &out, any_opt ? &ao : NULL, &j);
    if (st != KV_OK)
        fail_msg("decode check: %s: %s", kv_status_name(st), kv_last_error());
    kv__cdec_body = body;
    kv__cdec_chunks = chunks;
    st = kv__grid_attn_decode(&j);
    kv__cdec_body = KV__CDEC_AUTO;
    kv__cdec_chunks = 0;
    kv__attn_job_free(&j);
    if (st != KV_OK)
        fail_msg("emulated decode: %s: %s", kv_status_name(st), kv_last_error());
    struct kv__grid_attn_last lst;
    kv__grid_attn_last(&lst);
    const bool v = vec && body != KV__CDEC_GENERAL;
    /* the vector bodies: a block per (sequence, KV head, group of <= 4
     * query heads), split-KV's chunks the innermost (its plan: 1 chunk for
     * sequences of <= 256 tokens) */
    const uint64_t n_split = body == KV__CDEC_SPLIT ? (chunks ? (uint64_t)chunks : 1) : 1;
    assert_int_equal(lst.launch.grid, S * H * (v ? (dc->g + 3) / 4 * n_split : 1));
    assert_true(lst.launch.barriers);
    if (v) {
        assert_int_equal(lst.launch.block, 128);
        assert_int_equal(lst.launch.shared_bytes, 4 * 4 * (D + 2) * 4);
    }
    kvt_gfix_check(&f, "pool after the emulated decode");
    for (uint32_t s = 0; s < S; s++)
        for (int64_t qi = 0; qi < Hq; qi++) {
            const int64_t h = qi / dc->g;
            double sc[70], mx = -INFINITY, sum = 0;
            /* visible: the last win1 tokens (all without a window) */
            const int64_t t0 = dc->win1 && lens[s] - dc->win1 > 0 ? lens[s] - dc->win1 : 0;
            for (int64_t t = t0; t < lens[s]; t++) {
                double dot = 0;
                for (int64_t d = 0; d < D; d++)
                    dot += (double)qb[(s * Hq + qi) * row + d] * kd[((s * 70 + t) * H + h) * D + d];
                sc[t] = dot * smscale;
                if (dc->cap > 0.0f)
                    sc[t] = dc->cap * tanh(sc[t] / dc->cap);
                mx = sc[t] > mx ? sc[t] : mx;
            }
            for (int64_t t = t0; t < lens[s]; t++)
                sum += (sc[t] = exp(sc[t] - mx));
            if (dc->lse) {
                const double ref = lens[s] > t0 ? mx + log(sum) : -INFINITY;
                float *x = &lse[s * lstride + qi];
                if (!(ref == -INFINITY ? *x == -INFINITY
                                       : fabs(*x - ref) <= 1e-5 * fmax(1, fabs(ref))))
                    fail_msg("lse s%u q%lld (len %lld): %.9g vs %.9g", s, (long long)qi,
                             (long long)lens[s], (double)*x, ref);
                *x = lse0[x - lse];
            }
            for (int64_t d = 0; d < D; d++) {
                double ref = 0;
                for (int64_t t = t0; t < lens[s]; t++)
                    ref += sc[t] / sum * vd[((s * 70 + t) * H + h) * D + d];
                float *o = &ob[(s * Hq + qi) * row + d];
                const double err = fabs((double)*o - ref) / (fabs(ref) > 0.1 ? fabs(ref) : 0.1);
                if (!(err <= 1e-5))
                    fail_msg("decode s%u q%lld d%lld (len %lld): %.9g vs %.9g (rel %.2g)", s,
                             (long long)qi, (long long)d, (long long)lens[s], (double)*o, ref, err);
                *o = ob0[o - ob]; /* restore, for the guard compare */
            }
        }
    kvt_check_bytes((unsigned char *)ob, (unsigned char *)ob0, (size_t)n1 * 4,
                    "decode output padding");
    kvt_check_bytes((unsigned char *)lse, (unsigned char *)lse0, sizeof(lse),
                    "lse padding and rows of other calls");
    free(ob0), free(kd), free(vd);
    kv__mem_free(qb), kv__mem_free(ob);
    kvt_gfix_free(&f);
}

static void test_grid_decode(void **state)
{
    (void)state;
    static const struct dec_case cases[] = {
        /* order, arrange, pad, packed, N, H, g, D, r, dtype, scales, win1, cap, lse */
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, false, 16, 2, 1, 64, 1, KV_F32, 0, 0, 0, 0},
        {KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, 8, true, 8, 3, 2, 40, 2, KV_F32, 1, 0, 0, 0},
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 4, false, 8, 2, 3, 36, 1, KV_F16, 2, 0, 0, 0},
        {KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 0, false, 16, 2, 4, 96, 2, KV_FP8_E4M3, 2, 0, 0, 0},
        /* 16 query heads x D 256: the general body fits one warp's shared
         * memory only (32 threads); the vector one takes 4 blocks of 4 */
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, false, 8, 1, 16, 256, 1, KV_BF16, 0, 0, 0, 0},
        /* options: a window (shorter and longer than sequences), a soft cap, lse */
        {KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, 0, false, 16, 2, 6, 64, 2, KV_BF16, 2, 20, 0, 1},
        {KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 8, false, 8, 2, 2, 128, 1, KV_FP8_E5M2, 1, 0, 3.0f,
         1},
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, false, 16, 1, 5, 48, 4, KV_F16, 0, 1, 2.5f, 1},
        /* rows the vector body cannot take: 40 16-byte vectors (f32 D 160),
         * 33 2-byte ones (f16 D 33) */
        {KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, 0, false, 8, 2, 2, 160, 1, KV_F32, 1, 9, 0, 1},
        {KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, 0, false, 8, 2, 1, 33, 1, KV_F16, 0, 0, 0, 0},
    };
    /* every body on every case: auto, pipelined, split-KV in 3 and 7
     * chunks (neither divides 23 or 70; 7 leaves 23's last chunk empty)
     * and by its plan, the vector body, then the general one last */
    static const int runs[][2] = {{KV__CDEC_AUTO, 0},   {KV__CDEC_PIPE, 0},  {KV__CDEC_SPLIT, 3},
                                  {KV__CDEC_SPLIT, 7},  {KV__CDEC_SPLIT, 0}, {KV__CDEC_VEC, 0},
                                  {KV__CDEC_GENERAL, 0}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const bool vec = i < 8;
        for (size_t r = 0; r < sizeof(runs) / sizeof(runs[0]); r++)
            run_decode(&cases[i], 700 + i, runs[r][0], runs[r][1], vec);
        struct kv__grid_attn_last lst;
        kv__grid_attn_last(&lst);
        const int64_t gd = cases[i].g * cases[i].D;
        const uint64_t warps = i == 4 ? 1 : 4;
        assert_int_equal(lst.launch.block, 32 * warps);
        assert_int_equal(lst.launch.shared_bytes, (gd + warps * (gd + 2 * cases[i].g)) * 4);
    }
}

/* 32 query heads x D 256 of f32 (rows of 64 16-byte vectors: the general
 * body) need 65,792 bytes of shared memory even with one warp: refused
 * before any launch, naming the values; the output untouched. */
static void test_grid_decode_shared_limit(void **state)
{
    (void)state;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    struct kvt_gfix f;
    cfg.num_layers = 1, cfg.num_blocks = 8, cfg.block_tokens = 4, cfg.num_heads = 1;
    cfg.head_dim = 256, cfg.dtype = KV_F32;
    kvt_gfix_init(&f, &cfg, 5);
    const int64_t n = 32 * 256;
    float *qb = calloc((size_t)n, 4), *ob = malloc((size_t)n * 4), *ob0 = malloc((size_t)n * 4);
    assert_true(qb && ob && ob0);
    kvt_fill(ob, (size_t)n * 4, 6);
    memcpy(ob0, ob, (size_t)n * 4);
    struct kv_view q, out;
    int64_t sh[3] = {1, 32, 256};
    assert_int_equal(kv_view_init(qb, (size_t)n * 4, KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, (size_t)n * 4, KV_F32, 3, sh, &out), KV_OK);
    int32_t indptr[2] = {0, 1}, indices[1] = {6}, last[1] = {3};
    struct kv_pages pages;
    memset(&pages, 0, sizeof(pages));
    pages.format = KV_PAGES_CSR, pages.n_seqs = 1, pages.page_ratio = 1;
    pages.indptr = indptr, pages.indices = indices, pages.last_page_len = last;
    struct kv__attn_job j;
    assert_int_equal(kv__attn_decode_check("kv_attn_decode_cuda", &f.c, 0, &q, NULL, &pages,
                                           0.0625f, NULL, &out, NULL, &j),
                     KV_OK);
    assert_int_equal(kv__grid_attn_decode(&j), KV_ERR_UNSUPPORTED);
    kv__attn_job_free(&j);
    kvt_assert_msg_has("32 query heads per KV head x D 256 need 65792 bytes");
    kvt_check_bytes((unsigned char *)ob, (unsigned char *)ob0, (size_t)n * 4,
                    "refused decode output");
    kvt_gfix_check(&f, "pool after a refused decode");
    free(qb), free(ob), free(ob0);
    kvt_gfix_free(&f);
}

/* ---- block copies ------------------------------------------------------------------------ */

static void copy_pairs(struct kv_block_copy *cp, int n, uint32_t lo, uint32_t hi, uint64_t *rng)
{
    static uint8_t role[1024];
    memset(role, 0, sizeof(role));
    for (int c = 0; c < n; c++) {
        uint32_t s, d;
        do
            s = (uint32_t)kvt_range(rng, lo, hi);
        while (role[s] == 2);
        role[s] = 1;
        do
            d = (uint32_t)kvt_range(rng, lo, hi);
        while (role[d]);
        role[d] = 2;
        cp[c] = (struct kv_block_copy){.src = s, .dst = d, .tokens = 1};
    }
}

static void test_grid_copy_blocks(void **state)
{
    (void)state;
    for (int i = 0; i < 4; i++) {
        struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
        struct kvt_gfix f;
        uint64_t rng = 31 + (uint64_t)i;
        static const kv_dtype dts[4] = {KV_F16, KV_FP8_E4M3, KV_F32, KV_BF16};
        cfg.num_layers = 3, cfg.num_blocks = 300, cfg.block_tokens = 4, cfg.num_heads = 2;
        cfg.head_dim = i == 1 ? 33 : 32, cfg.dtype = dts[i];
        cfg.order = i & 1 ? KV_ORDER_HND : KV_ORDER_NHD;
        cfg.arrange = i & 2 ? KV_ARRANGE_BLOCK_MAJOR : KV_ARRANGE_LAYER_MAJOR;
        cfg.kv_packed = i == 3;
        cfg.block_pad_elems = i == 0 ? 8 : 0;
        kvt_gfix_init(&f, &cfg, 40 + (uint64_t)i);
        struct kv_block_copy cp[12];
        copy_pairs(cp, 12, 200, 299, &rng);
        for (int c = 0; c < 12; c++)
            for (int64_t l = 0; l < 3; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (int64_t n = 0; n < 4; n++)
                        for (int64_t h = 0; h < 2; h++)
                            for (int64_t d = 0; d < cfg.head_dim; d++)
                                memcpy(kvt_gat(&f, f.ref, l, kv, cp[c].dst * 4 + n, h, d),
                                       kvt_gat(&f, f.ref, l, kv, cp[c].src * 4 + n, h, d),
                                       (size_t)f.es);
        struct kv__attn_job j;
        assert_int_equal(
            kv__attn_copy_check("kv_attn_copy_blocks_cuda", &f.c, NULL, cp, 12, NULL, &j), KV_OK);
        const kv_status st = kv__grid_attn_copy(&j);
        kv__attn_job_free(&j);
        if (st != KV_OK)
            fail_msg("emulated copy: %s: %s", kv_status_name(st), kv_last_error());
        kvt_gfix_check(&f, "pool after the emulated copy");
        kvt_gfix_free(&f);
    }
}

/* Two caches of one block format, layers 1..2 of 3, one plane or both:
 * copy_ex; the source pool unchanged. */
static void test_grid_copy_blocks_ex(void **state)
{
    (void)state;
    for (int i = 0; i < 6; i++) {
        struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
        struct kvt_gfix d, s;
        uint64_t rng = 77 + (uint64_t)i;
        cfg.num_layers = 3, cfg.num_blocks = 300, cfg.block_tokens = 4, cfg.num_heads = 3;
        cfg.head_dim = i % 3 == 2 ? 31 : 32, cfg.dtype = i % 2 ? KV_F16 : KV_F32;
        cfg.order = i & 1 ? KV_ORDER_HND : KV_ORDER_NHD;
        cfg.kv_packed = i >= 3;
        cfg.block_pad_elems = i == 1 ? 4 : 0;
        kvt_gfix_init(&d, &cfg, 90 + (uint64_t)i);
        cfg.arrange = KV_ARRANGE_BLOCK_MAJOR; /* the other cache: another arrangement */
        kvt_gfix_init(&s, &cfg, 95 + (uint64_t)i);
        struct kv_block_copy cp[10];
        copy_pairs(cp, 10, 200, 299, &rng);
        const uint32_t planes = (uint32_t)(i % 3) + 1; /* K, V, both */
        for (int c = 0; c < 10; c++)
            for (int64_t l = 1; l < 3; l++)
                for (int kv = 0; kv < 2; kv++) {
                    if (!(planes & (1u << kv)))
                        continue;
                    for (int64_t n = 0; n < 4; n++)
                        for (int64_t h = 0; h < 3; h++)
                            for (int64_t e = 0; e < cfg.head_dim; e++)
                                memcpy(kvt_gat(&d, d.ref, l, kv, cp[c].dst * 4 + n, h, e),
                                       kvt_gat(&s, s.ref, l, kv, cp[c].src * 4 + n, h, e),
                                       (size_t)d.es);
                }
        struct kv_copy_blocks_opts o = KV_COPY_BLOCKS_OPTS_INIT;
        o.layer0 = 1, o.n_layers = 2, o.planes = planes;
        struct kv__attn_job j;
        kv_status st =
            kv__attn_copy_check("kv_attn_copy_blocks_ex_cuda", &d.c, &s.c, cp, 10, &o, &j);
        if (st != KV_OK)
            fail_msg("copy_ex check: %s: %s", kv_status_name(st), kv_last_error());
        st = kv__grid_attn_copy_ex(&j);
        kv__attn_job_free(&j);
        if (st != KV_OK)
            fail_msg("emulated copy_ex: %s: %s", kv_status_name(st), kv_last_error());
        kvt_gfix_check(&d, "destination pool after the emulated copy_ex");
        kvt_gfix_check(&s, "source pool after the emulated copy_ex");
        kvt_gfix_free(&d);
        kvt_gfix_free(&s);
    }
}

/* ---- view copy --------------------------------------------------------------------------- */

struct vc_case {
    kv_dtype dt;
    int ndim;
    int64_t shape[4];
    int64_t sst[4], soff; /* source strides and offset, elements */
    int64_t dst_[4], doff;
    int want_path;
};

static void run_view_copy(const struct vc_case *vc, uint64_t seed)
{
    const int64_t es = (int64_t)kv_dtype_size(vc->dt);
    int64_t sspan = vc->soff + 1, dspan = vc->doff + 1, numel = 1;
    for (int k = 0; k < vc->ndim; k++) {
        sspan += (vc->shape[k] - 1) * vc->sst[k];
        dspan += (vc->shape[k] - 1) * vc->dst_[k];
        numel *= vc->shape[k];
    }
    unsigned char *sb = kv__mem_alloc_aligned(64, (size_t)(sspan * es));
    unsigned char *db = kv__mem_alloc_aligned(64, (size_t)(dspan * es));
    unsigned char *want = malloc((size_t)(dspan * es)), *s0 = malloc((size_t)(sspan * es));
    assert_true(sb && db && want && s0);
    kvt_fill(sb, (size_t)(sspan * es), seed);
    kvt_fill(db, (size_t)(dspan * es), seed + 1);
    memcpy(want, db, (size_t)(dspan * es));
    memcpy(s0, sb, (size_t)(sspan * es));
    struct kv_view fs, fd, src, dst;
    int64_t ns = sspan, nd = dspan;
    assert_int_equal(kv_view_init(sb, (size_t)(sspan * es), vc->dt, 1, &ns, &fs), KV_OK);
    assert_int_equal(kv_view_init(db, (size_t)(dspan * es), vc->dt, 1, &nd, &fd), KV_OK);
    assert_int_equal(kv_view_as_strided(&fs, vc->ndim, vc->shape, vc->sst, vc->soff, &src), KV_OK);
    assert_int_equal(kv_view_as_strided(&fd, vc->ndim, vc->shape, vc->dst_, vc->doff, &dst), KV_OK);
    /* the reference: element i of C order, by the view formula */
    for (int64_t i = 0; i < numel; i++) {
        int64_t r = i, so = vc->soff, dof = vc->doff;
        for (int k = vc->ndim - 1; k >= 0; k--) {
            const int64_t ix = r % vc->shape[k];
            r /= vc->shape[k];
            so += ix * vc->sst[k];
            dof += ix * vc->dst_[k];
        }
        memcpy(want + dof * es, sb + so * es, (size_t)es);
    }
    assert_int_equal(kv__view_copy_check("kv_view_copy_cuda", &src, &dst), KV_OK);
    const struct kv_view_geom sg = kv__view_geom(&src), dg = kv__view_geom(&dst);
    struct kv_copy_plan plan;
    assert_int_equal(kv_copy_plan_build(&plan, &sg, &dg, (int32_t)es), 1);
    int path = -1;
    const kv_status st = kv__grid_view_copy(&plan, sb, db, &path);
    if (st != KV_OK)
        fail_msg("emulated view copy: %s: %s", kv_status_name(st), kv_last_error());
    assert_int_equal(path, vc->want_path);
    kvt_check_bytes(db, want, (size_t)(dspan * es), "view copy destination");
    kvt_check_bytes(sb, s0, (size_t)(sspan * es), "view copy source");
    kv__mem_free(sb), kv__mem_free(db);
    free(want), free(s0);
}

static void test_grid_view_copy(void **state)
{
    (void)state;
    static const struct vc_case cases[] = {
        /* rows of 40 f32 padded to 48, into rows at offset 4: 16-byte vectors */
        {KV_F32,
         3,
         {7, 3, 40, 0},
         {3 * 48, 48, 1, 0},
         0,
         {3 * 44, 44, 1, 0},
         4,
         KV__CUDA_COPY_VEC16},
        /* f16 rows of 36 (72 bytes): 8 */
        {KV_F16, 2, {9, 36, 0, 0}, {40, 1, 0, 0}, 4, {36, 1, 0, 0}, 0, KV__CUDA_COPY_VEC8},
        /* f16 rows of 34 at an odd offset pair: 4 */
        {KV_F16, 2, {5, 34, 0, 0}, {36, 1, 0, 0}, 2, {34, 1, 0, 0}, 0, KV__CUDA_COPY_VEC4},
        /* bf16 rows of 33: 2 */
        {KV_BF16, 2, {6, 33, 0, 0}, {35, 1, 0, 0}, 1, {33, 1, 0, 0}, 0, KV__CUDA_COPY_VEC2},
        /* u8 rows at offset 3: 1 */
        {KV_U8, 2, {4, 19, 0, 0}, {23, 1, 0, 0}, 3, {19, 1, 0, 0}, 0, KV__CUDA_COPY_VEC1},
        /* a transpose of f16 [4][5][6] (strided, 2-byte elements) */
        {KV_F16, 3, {4, 5, 6, 0}, {30, 6, 1, 0}, 0, {1, 24, 4, 0}, 0, KV__CUDA_COPY_STRIDED},
        /* f64 and i32 with a strided innermost dim (8- and 4-byte elements) */
        {KV_F64, 3, {3, 4, 5, 0}, {40, 10, 2, 0}, 1, {20, 5, 1, 0}, 2, KV__CUDA_COPY_STRIDED},
        {KV_I32, 2, {300, 3, 0, 0}, {3, 900, 0, 0}, 0, {3, 1, 0, 0}, 5, KV__CUDA_COPY_STRIDED},
        /* many short rows (several rows per block) and 4-D */
        {KV_FP8_E4M3,
         4,
         {
             3,
             4,
             5,
             6,
         },
         {200, 50, 10, 1},
         0,
         {120, 30, 6, 1},
         0,
         KV__CUDA_COPY_VEC2},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_view_copy(&cases[i], 300 + i);
}

/* ---- plan narrow copies ------------------------------------------------------------------ */

static void run_plan(int sbits, int dbits, int64_t Ns, int64_t Nd, int64_t Hs, int64_t Hd,
                     int64_t sh0, int64_t dh0, int64_t nh, int64_t D, kv_dtype dt, int64_t thr,
                     int64_t src_shift, int64_t want_width, uint64_t seed)
{
    struct kvt_side s, d;
    kvt_side_make(&s, 3, 60, Ns, Hs, D, dt, sbits, seed);
    kvt_side_make(&d, 3, 60, Nd, Hd, D, dt, dbits, seed + 1);
    struct kv_plan_config pc = KV_PLAN_CONFIG_INIT;
    pc.src_head0 = sh0, pc.dst_head0 = dh0, pc.n_heads = nh;
    pc.src_layer0 = 1, pc.dst_layer0 = 0, pc.n_layers = 2;
    kv_plan *plan = NULL;
    assert_int_equal(kv_plan_create(&s.lo, &d.lo, &pc, &plan), KV_OK);
    uint64_t rng = seed * 3 + 1;
    const uint64_t T = (uint64_t)(Ns > Nd ? Ns : Nd) * 4;
    const uint32_t ns = (uint32_t)(T / (uint64_t)Ns), nd = (uint32_t)(T / (uint64_t)Nd);
    uint32_t sid[64], did[64];
    kvt_pick_ids(&rng, 60, ns, sid);
    kvt_pick_ids(&rng, 60, nd, did);
    /* the source moved src_shift bytes off its alignment */
    const size_t sbytes = (size_t)s.lo.total_bytes, dbytes = (size_t)d.lo.total_bytes;
    unsigned char *shifted = kv__mem_alloc_aligned(64, sbytes + 64);
    assert_non_null(shifted);
    memcpy(shifted + src_shift, s.mem, sbytes);
    free(s.mem);
    s.mem = shifted + src_shift;
    s.pc.base = s.mem;
    unsigned char *ref = malloc(dbytes), *s0 = malloc(sbytes);
    assert_true(ref && s0);
    memcpy(ref, d.mem, dbytes);
    memcpy(s0, s.mem, sbytes);
    kvt_ref_move_layers(&s, sid, ns, &d, did, nd, 1, 0, 2, sh0, dh0, nh ? nh : Hs, ref);
    struct kv__plan_sched sc;
    assert_int_equal(
        kv__plan_cuda_schedule("test", plan, &s.pc, sid, ns, &d.pc, did, nd, T, thr, &sc), KV_OK);
    assert_true(sc.narrow.n_items > 0);
    const int64_t w = (sc.narrow_align & 15) == 0  ? 16
                      : (sc.narrow_align & 7) == 0 ? 8
                      : (sc.narrow_align & 3) == 0 ? 4
                                                   : 1;
    assert_int_equal(w, want_width);
    const kv_status st = kv__grid_plan_copy(&sc);
    if (st != KV_OK)
        fail_msg("emulated plan copy: %s: %s", kv_status_name(st), kv_last_error());
    kvt_check_bytes(d.mem, ref, dbytes, "destination pool after the emulated plan copy");
    kvt_check_bytes(s.mem, s0, sbytes, "source pool after the emulated plan copy");
    kv__plan_sched_free(&sc);
    kv_plan_destroy(plan);
    kv__mem_free(shifted);
    free(ref), free(s0);
    kvt_side_free(&d);
}

static void test_grid_plan_narrow(void **state)
{
    (void)state;
    /* NHD -> HND f16 head rows of 128 bytes: all narrow, 16-byte vectors */
    run_plan(0, 1, 8, 8, 4, 4, 0, 0, 0, 64, KV_F16, 0, 0, 16, 11);
    /* block sizes 8 -> 4, heads 1..2 of 4 into 0..1 of 2, padded, block-major */
    run_plan(4, 2 | 1, 8, 4, 4, 2, 1, 0, 2, 32, KV_F32, 0, 0, 16, 12);
    /* a source 2 bytes off: 2-byte alignment, byte vectors */
    run_plan(1, 8, 4, 4, 2, 2, 0, 0, 0, 40, KV_BF16, 0, 2, 1, 13);
    /* a source 4 bytes off, f32 D 36, blocks 4 -> 8: 4-byte vectors */
    run_plan(0, 1, 4, 8, 3, 3, 0, 0, 0, 36, KV_F32, 0, 4, 4, 14);
    /* fp8 D 24 (24-byte rows): 8-byte vectors */
    run_plan(1, 0, 8, 8, 2, 2, 0, 0, 0, 24, KV_FP8_E4M3, 0, 0, 8, 15);
}

/* ---- the emulator's strictness ----------------------------------------------------------- */

struct probe {
    int kind;
    unsigned char *buf;
    float *out;
};

static void probe_body(const struct kv_grid_ctx *c, const void *arg)
{
    const struct probe *p = arg;
    switch (p->kind) {
    case 0: /* a warp sum of the lane numbers, then a block barrier */
        p->out[c->block * c->block_dim + c->thread] = kv_grid_warp_sum(c, (float)(c->thread % 32));
        kv_grid_sync(c);
        break;
    case 1: /* a misaligned 8-byte move */
        kv_grid_move(c, p->buf + 1, p->buf + 16, 8);
        break;
    case 2: /* a barrier only thread 0 skips */
        if (c->thread != 0)
            kv_grid_sync(c);
        break;
    case 3: /* a write one float past the shared memory */
        ((float *)c->shared)[c->thread + 1] = 1.0f;
        break;
    case 4: /* a warp sum only the even lanes reach */
        if (c->thread % 2 == 0)
            (void)kv_grid_warp_sum(c, 1.0f);
        break;
    case 6: /* every thread at a barrier, but the even ones at another */
        if (c->thread % 2 == 0)
            kv_grid_sync(c);
        else
            kv_grid_sync(c);
        break;
    case 7: /* a write one float before the shared memory */
        if (c->thread == 0)
            ((float *)c->shared)[-1] = 1.0f;
        break;
    case 8: /* a 64-bit atomic on a 4-byte aligned address */
        if (c->thread == 0)
            kv_grid_error_record((uint64_t *)(void *)(p->buf + 4),
                                 (uint64_t *)(void *)(p->buf + 16), 1, 2);
        break;
    case 9: /* the shared pointer of a launch without shared memory */
        p->out[c->thread] = c->shared == NULL ? 1.0f : 0.0f;
        break;
    default: /* a barrier in a launch declared barrier-free */
        kv_grid_sync(c);
        break;
    }
}

static void test_grid_emulator_is_strict(void **state)
{
    (void)state;
    float out[2 * 64];
    unsigned char buf[64] __attribute__((aligned(16)));
    memset(buf, 0, sizeof(buf));
    struct probe p = {0, buf, out};
    struct kv_grid_launch l = {2, 64, 0, true};
    assert_int_equal(kv__grid_run("probe", &l, probe_body, &p), KV_OK);
    for (int i = 0; i < 128; i++)
        assert_true(out[i] == 496.0f); /* 0 + 1 + ... + 31 in every lane */
    /* launches CUDA refuses */
    const struct kv_grid_launch bad[5] = {{1, 1025, 0, false},
                                          {0, 32, 0, false},
                                          {1, 32, (48 << 10) + 1, false},
                                          {1, 0, 0, false},
                                          {(uint64_t)1 << 31, 32, 0, false}};
    static const char *const bad_msg[5] = {"1025 threads", "0 blocks", "49153 bytes", "0 threads",
                                           "2147483648 blocks"};
    for (int i = 0; i < 5; i++) {
        assert_int_equal(kv__grid_run("probe", &bad[i], probe_body, &p), KV_ERR_INVALID_ARG);
        kvt_assert_msg_has(bad_msg[i]);
    }
    /* faults: undefined on a GPU, refused here */
    static const char *const fault_msg[8] = {"misaligned",
                                             "__syncthreads not reached",
                                             "past the block's dynamic shared memory",
                                             "divergent warp operation",
                                             "barrier-free",
                                             "threads at different barriers",
                                             "before the block's dynamic shared memory",
                                             "misaligned 64-bit atomic"};
    const struct kv_grid_launch fl[8] = {
        {1, 32, 0, false}, {1, 64, 0, true}, {1, 32, 32 * 4, false}, {1, 32, 0, true},
        {1, 32, 0, false}, {1, 64, 0, true}, {1, 32, 32 * 4, false}, {1, 32, 0, false}};
    for (int i = 0; i < 8; i++) {
        p.kind = i + 1;
        assert_int_equal(kv__grid_run("probe", &fl[i], probe_body, &p), KV_ERR_DEVICE);
        kvt_assert_msg_has(fault_msg[i]);
    }
    /* no shared memory: NULL, as the CUDA wrappers pass it */
    p.kind = 9;
    const struct kv_grid_launch none = {1, 32, 0, false};
    assert_int_equal(kv__grid_run("probe", &none, probe_body, &p), KV_OK);
    for (int i = 0; i < 32; i++)
        assert_true(out[i] == 1.0f);
    /* a warp sum in a partial warp (48 threads: lanes 32..47) */
    p.kind = 0;
    const struct kv_grid_launch part = {1, 48, 0, true};
    assert_int_equal(kv__grid_run("probe", &part, probe_body, &p), KV_ERR_DEVICE);
    kvt_assert_msg_has("partial warp");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grid_emulator_is_strict),
        cmocka_unit_test(test_grid_write_read),
        cmocka_unit_test(test_grid_decode),
        cmocka_unit_test(test_grid_decode_shared_limit),
        cmocka_unit_test(test_grid_copy_blocks),
        cmocka_unit_test(test_grid_copy_blocks_ex),
        cmocka_unit_test(test_grid_view_copy),
        cmocka_unit_test(test_grid_plan_narrow),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
