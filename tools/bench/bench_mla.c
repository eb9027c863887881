/*
 * bench_mla.c - MLA latent caches (a K-only layout of one KV head, D = 576 =
 * 512 latent + 64 rope dims, pages of 64 tokens; docs/kernels.md "MLA"):
 *
 *   kernel.decode_mla   kv_attn_decode_mla, Hq query heads (1, 16, 128), dv
 *                       512, S sequences x len tokens (CSR, pages spread
 *                       over the pool), bf16 and fp8 e4m3 with a per-tensor
 *                       scale: tokens/s vs reading the same latent bytes once
 *                       at memcpy speed (the goal: >= 0.5x). With Hq = 128
 *                       a row is 128 x (576 + 512) x 2 flops for 1,152 bytes
 *                       (bf16): the kernel is bound by the FMA units, and the
 *                       line also reports those GFLOP/s ("gflops").
 *   kernel.prefill_mla  kv_attn_prefill_mla, the same caches with q_len = 4
 *                       queries per sequence (the last 4 tokens: a chunk of
 *                       speculative verification or of a chunked prefill),
 *                       Hq 16, bf16 only: tokens/s (tokens: the latent rows
 *                       of the sequences) vs the same memcpy of the latent
 *                       bytes; each row serves 4 x 16 (query, head) pairs,
 *                       so this is the compute-bound end ("gflops").
 *   kernel.write_mla    kv_attn_write of S x len latent rows (a prefill)
 *                       into their pages vs one memcpy of the same bytes.
 *
 * Each case checks its result before it reports (decode: a sample of
 * (sequence, query head) against a float64 reference; write: every row at
 * the address the config says). A wrong result is a kvb_mismatch.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kv_attn.h"
#include "kv_convert_hd.h"

#define KVB_MLA_D 576
#define KVB_MLA_DV 512
#define KVB_MLA_N 64

struct kvb__mla {
    struct kv_paged_cache c;
    char *pool;
    uint32_t *ids; /* S * len / N pages, shuffled over the pool */
    int64_t S, len, pages;
};

/* finite values of magnitude < 2 (bf16: random f32 in [-1, 1) truncated;
 * e4m3: exponents 0..7) */
static void kvb__mla_fill(char *p, size_t bytes, kv_dtype dt, uint64_t seed)
{
    kvb_fill_random(p, bytes, seed);
    if (dt == KV_BF16) {
        for (size_t i = 0; i + 1 < bytes; i += 2)
            p[i + 1] =
                (char)(((unsigned char)p[i + 1] & 0x80) | 0x3c | ((unsigned char)p[i + 1] & 3));
    } else {
        for (size_t i = 0; i < bytes; i++)
            p[i] = (char)((unsigned char)p[i] & 0xbf);
    }
}

static int kvb__mla_build(struct kvb__mla *m, kv_dtype dt, int64_t S, int64_t len)
{
    memset(m, 0, sizeof(*m));
    m->S = S, m->len = len, m->pages = S * len / KVB_MLA_N;
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 1;
    cfg.num_blocks = m->pages + 64;
    cfg.block_tokens = KVB_MLA_N;
    cfg.num_heads = 1;
    cfg.head_dim = KVB_MLA_D;
    cfg.dtype = dt;
    cfg.k_only = true;
    if (kv_layout_init(&cfg, &m->c.layout) != KV_OK)
        return -1;
    m->pool = kvb_alloc((size_t)m->c.layout.total_bytes);
    m->ids = malloc((size_t)m->pages * sizeof(uint32_t));
    if (!m->ids)
        return -1;
    kvb__mla_fill(m->pool, (size_t)m->c.layout.total_bytes, dt, 11);
    kvb_shuffle_ids(m->ids, (uint32_t)m->pages, (uint32_t)cfg.num_blocks, 12);
    m->c.base = m->pool;
    m->c.storage_bytes = (size_t)m->c.layout.total_bytes;
    return 0;
}

static void kvb__mla_fini(struct kvb__mla *m)
{
    if (m->pool)
        kvb_free(m->pool);
    free(m->ids);
    m->pool = NULL;
    m->ids = NULL;
}

static const char *kvb__mla_row(const struct kvb__mla *m, int64_t s, int64_t t)
{
    const int64_t page = m->ids[s * (m->len / KVB_MLA_N) + t / KVB_MLA_N];
    return m->pool + (page * KVB_MLA_N + t % KVB_MLA_N) * m->c.layout.stride_token_bytes;
}

/* decode output o (bf16 [S * ql][Hq][dv]) against float64 for 4 (seq, head):
 * the last query row of each sequence (ql rows a sequence; decode: 1), the
 * one that sees all len tokens */
static int kvb__mla_check(const char *bench, const char *name, const struct kvb__mla *m, int64_t hq,
                          int64_t ql, const char *q, const char *o, float scale, float ks)
{
    const kv_dtype dt = m->c.layout.dtype;
    const int64_t es = m->c.layout.elem_bytes, D = KVB_MLA_D, dv = KVB_MLA_DV;
    double *w = malloc((size_t)m->len * sizeof(double));
    if (!w)
        return -1;
    for (int a = 0; a < 4; a++) {
        const int64_t s = a & 1 ? m->S - 1 : 0, h = a & 2 ? hq - 1 : 0, row = s * ql + ql - 1;
        const char *qr = q + (row * hq + h) * D * 2;
        double mx = -INFINITY, sum = 0.0;
        for (int64_t t = 0; t < m->len; t++) {
            const char *kr = kvb__mla_row(m, s, t);
            double dot = 0.0;
            for (int64_t d = 0; d < D; d++)
                dot += (double)kv_to_f32(KV_BF16, qr + d * 2) * kv_to_f32(dt, kr + d * es) * ks;
            w[t] = dot * scale;
            mx = w[t] > mx ? w[t] : mx;
        }
        for (int64_t t = 0; t < m->len; t++)
            sum += (w[t] = exp(w[t] - mx));
        for (int64_t d = 0; d < dv; d += 37) {
            double acc = 0.0;
            for (int64_t t = 0; t < m->len; t++)
                acc += w[t] * kv_to_f32(dt, kvb__mla_row(m, s, t) + d * es) * ks;
            const double want = acc / sum,
                         got = kv_to_f32(KV_BF16, o + ((row * hq + h) * dv + d) * 2);
            if (!(fabs(got - want) <= 1e-2 * fabs(want) + 2e-3)) {
                kvb_mismatch(bench, name, "seq %lld head %lld dim %lld: %.6g, float64 %.6g",
                             (long long)s, (long long)h, (long long)d, got, want);
                free(w);
                return -1;
            }
        }
    }
    free(w);
    return 0;
}

/* decode (ql 0) or prefill of ql queries a sequence */
static void kvb__attn_mla(struct kvb__mla *m, int64_t hq, int64_t ql)
{
    const char *bench = ql ? "kernel.prefill_mla" : "kernel.decode_mla";
    const kv_dtype dt = m->c.layout.dtype;
    const int64_t S = m->S, len = m->len, D = KVB_MLA_D, dv = KVB_MLA_DV, rps = ql ? ql : 1;
    char name[160], qn[24] = "";
    if (ql)
        snprintf(qn, sizeof(qn), "/q%lld", (long long)ql);
    snprintf(name, sizeof(name), "%s/N64/Hq%lld/D576/dv512%s/%lldx%lld/t%d", kv_dtype_name(dt),
             (long long)hq, qn, (long long)S, (long long)len, kv_threads());
    if (!kvb_selected(bench, name))
        return;
    kvb_progress(bench, name);
    const int runs = kvb_runs() < 5 ? kvb_runs() : 5;
    const size_t qb = (size_t)(S * rps * hq * D) * 2, ob = (size_t)(S * rps * hq * dv) * 2;
    const size_t lat = (size_t)(S * len * D * m->c.layout.elem_bytes);
    char *q = malloc(qb), *o = malloc(ob), *scratch = kvb_alloc(lat);
    int32_t *indptr = malloc((size_t)(S + 1) * sizeof(int32_t));
    int32_t *last = malloc((size_t)S * sizeof(int32_t));
    int32_t *qo = malloc((size_t)(S + 1) * sizeof(int32_t));
    double tc[16], tm[16];
    if (!q || !o || !indptr || !last || !qo) {
        kvb_failed(bench, name, "out of memory");
        goto out;
    }
    kvb__mla_fill(q, qb, KV_BF16, 5);
    memset(o, 0, ob);
    memset(scratch, 0, lat);
    for (int64_t s = 0; s <= S; s++) {
        indptr[s] = (int32_t)(s * (len / KVB_MLA_N));
        qo[s] = (int32_t)(s * rps);
    }
    for (int64_t s = 0; s < S; s++)
        last[s] = KVB_MLA_N;
    const struct kv_pages pg = {.format = KV_PAGES_CSR,
                                .n_seqs = (uint32_t)S,
                                .page_ratio = 1,
                                .indptr = indptr,
                                .indices = (const int32_t *)m->ids,
                                .last_page_len = last};
    struct kv_view vq, vo;
    const int64_t qs[3] = {S * rps, hq, D}, os[3] = {S * rps, hq, dv};
    kv_status st;
    if ((st = kv_view_init(q, qb, KV_BF16, 3, qs, &vq)) != KV_OK ||
        (st = kv_view_init(o, ob, KV_BF16, 3, os, &vo)) != KV_OK) {
        kvb_failed(bench, name, "views: %s", kv_last_error());
        goto out;
    }
    const float scale = 1.0f / sqrtf((float)D), kscale[1] = {0.75f};
    const struct kv_scales sc = {kscale, NULL, 1, 0};
    const struct kv_scales *scp = dt == KV_FP8_E4M3 ? &sc : NULL;
    for (int r = -1; r < runs; r++) {
        const double t0 = kvb_now();
        st = ql ? kv_attn_prefill_mla(m->c, 0, &vq, qo, &pg, dv, scale, scp, &vo, NULL)
                : kv_attn_decode_mla(m->c, 0, &vq, &pg, dv, scale, scp, &vo);
        const double t1 = kvb_now();
        memcpy(scratch, m->pool, lat);
        const double t2 = kvb_now();
        if (st != KV_OK) {
            kvb_failed(bench, name, "%s: %s", ql ? "kv_attn_prefill_mla" : "kv_attn_decode_mla",
                       kv_last_error());
            goto out;
        }
        if (r >= 0)
            tc[r] = t1 - t0, tm[r] = t2 - t1;
    }
    if (kvb__mla_check(bench, name, m, hq, rps, q, o, scale, scp ? kscale[0] : 1.0f) != 0)
        goto out;
    const double med = kvb_median(tc, runs);
    /* flops: query i of ql sees len - ql + 1 + i tokens */
    const double seen = (double)S * (double)(rps * len - rps * (rps - 1) / 2);
    fprintf(stderr, "%s %s: %.1f GFLOP/s\n", bench, name,
            seen * (double)hq * (double)(D + dv) * 2.0 / med / 1e9);
    kvb_emit_ops(bench, name, (uint64_t)(S * len), med, "memcpy", kvb_median(tm, runs), runs);
out:
    free(q);
    free(o);
    kvb_free(scratch);
    free(indptr);
    free(last);
    free(qo);
}

static void kvb__write_mla(struct kvb__mla *m)
{
    static const char bench[] = "kernel.write_mla";
    const kv_dtype dt = m->c.layout.dtype;
    const int64_t T = m->S * m->len, D = KVB_MLA_D, es = m->c.layout.elem_bytes;
    char name[160];
    snprintf(name, sizeof(name), "%s/N64/D576/%lldx%lld/t%d", kv_dtype_name(dt), (long long)m->S,
             (long long)m->len, kv_threads());
    if (!kvb_selected(bench, name))
        return;
    kvb_progress(bench, name);
    const int runs = kvb_runs();
    const size_t tb = (size_t)(T * D * es);
    char *k = kvb_alloc(tb), *scratch = kvb_alloc(tb);
    int64_t *slots = malloc((size_t)T * sizeof(int64_t));
    double tc[16], tm[16];
    if (!slots) {
        kvb_failed(bench, name, "out of memory");
        goto out;
    }
    kvb__mla_fill(k, tb, dt, 21);
    memset(scratch, 0, tb);
    for (int64_t s = 0; s < m->S; s++)
        for (int64_t t = 0; t < m->len; t++)
            slots[s * m->len + t] =
                (int64_t)m->ids[s * (m->len / KVB_MLA_N) + t / KVB_MLA_N] * KVB_MLA_N +
                t % KVB_MLA_N;
    struct kv_view vk;
    const int64_t ks[3] = {T, 1, D};
    kv_status st = kv_view_init(k, tb, dt, 3, ks, &vk);
    if (st != KV_OK) {
        kvb_failed(bench, name, "views: %s", kv_last_error());
        goto out;
    }
    for (int r = -1; r < runs; r++) {
        const double t0 = kvb_now();
        st = kv_attn_write(m->c, 0, &vk, NULL, slots, T, NULL);
        const double t1 = kvb_now();
        memcpy(scratch, k, tb);
        const double t2 = kvb_now();
        if (st != KV_OK) {
            kvb_failed(bench, name, "kv_attn_write: %s", kv_last_error());
            goto out;
        }
        if (r >= 0)
            tc[r] = t1 - t0, tm[r] = t2 - t1;
    }
    for (int64_t s = 0; s < m->S; s++)
        for (int64_t t = 0; t < m->len; t++)
            if (memcmp(kvb__mla_row(m, s, t), k + (s * m->len + t) * D * es, (size_t)(D * es))) {
                kvb_mismatch(bench, name, "seq %lld token %lld is not where the layout says",
                             (long long)s, (long long)t);
                goto out;
            }
    kvb_emit_gbps(bench, name, tb, kvb_median(tc, runs), "memcpy", kvb_median(tm, runs), runs);
out:
    kvb_free(k);
    kvb_free(scratch);
    free(slots);
}

static void kvb__mla(void)
{
    const int quick = kvb_quick();
    static const kv_dtype dts[2] = {KV_BF16, KV_FP8_E4M3};
    for (int i = 0; i < 2; i++) {
        /* bf16: 64 x 4,096 tokens = 288 MiB of latent (fp8: 144 MiB) */
        struct kvb__mla m;
        if (kvb__mla_build(&m, dts[i], quick ? 8 : 64, quick ? 512 : 4096) != 0) {
            kvb_failed("kernel.decode_mla", kv_dtype_name(dts[i]), "cannot build the cache");
            kvb__mla_fini(&m);
            continue;
        }
        kvb__write_mla(&m); /* writes the rows the decode then reads */
        kvb__attn_mla(&m, 1, 0);
        kvb__attn_mla(&m, 16, 0);
        kvb__attn_mla(&m, 128, 0);
        if (dts[i] == KV_BF16)
            kvb__attn_mla(&m, 16, 4);
        kvb__mla_fini(&m);
    }
}

KVB_REGISTER("kernel", kvb__mla)
