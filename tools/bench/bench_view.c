/*
 * bench_view.c - strided-view benchmarks (see docs/bench-method.md).
 *
 *   view.transpose_meta  transpose as metadata vs a materialized copy
 *                        (2048x2048 f32, latency; ratio = copy_us / meta_us)
 *   view.strided_sum     sum over every other column of a 4000x2000 f64 via a
 *                        strided view vs the same sum over a packed 4000x1000
 *                        (ratio = packed_us / strided_us; 1.0 = no penalty)
 *   view.materialize     kv_view_materialize of transposes and of the KV
 *                        [blocks][N][H][D] -> [blocks][H][N][D] permute, against
 *                        one memcpy of the same bytes and against the naive
 *                        element loop over the view formula (separate lines)
 *
 * Candidate and baselines run interleaved (A B C A B C ...) after a warm-up;
 * medians are reported.
 */
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "kv_view.h"

#define KVB_MIB ((size_t)1 << 20)

static void kvb__die_status(const char *what, kv_status st)
{
    fprintf(stderr, "kvbench: %s failed: %s (%s)\n", what, kv_status_name(st), kv_last_error());
    kvb_sink((uint64_t)st);
}

/* ---- the naive baseline ------------------------------------------------- */

/* The obvious loop: for every index in C order, evaluate the view formula
 * offset + sum_k i_k * strides[k] and copy one element. */
static void kvb__naive_materialize(const struct kv_view *v, void *dst)
{
    const size_t esz = kv_view_elem_bytes(v);
    const int64_t numel = kv_view_numel(v);
    const char *base = v->base;
    char *d = dst;
    int64_t idx[KV_MAX_DIMS] = {0};

    for (int64_t n = 0; n < numel; n++) {
        int64_t off = v->offset;
        for (int k = 0; k < v->ndim; k++)
            off += idx[k] * v->strides[k];
        const char *s = base + off * (int64_t)esz;
        switch (esz) {
        case 1:
            d[n] = *s;
            break;
        case 2:
            memcpy(d + n * 2, s, 2);
            break;
        case 4:
            memcpy(d + n * 4, s, 4);
            break;
        default:
            memcpy(d + n * 8, s, 8);
            break;
        }
        for (int k = v->ndim - 1; k >= 0; k--) {
            if (++idx[k] < v->shape[k])
                break;
            idx[k] = 0;
        }
    }
}

/* ---- view.transpose_meta ------------------------------------------------ */

static void kvb__transpose_meta(void)
{
    static const char bench[] = "view.transpose_meta";
    const int64_t n = 2048;
    char case_name[128];
    snprintf(case_name, sizeof(case_name), "f32/%lldx%lld/transpose", (long long)n, (long long)n);
    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);

    const size_t bytes = (size_t)(n * n) * 4;
    const int runs = kvb_runs();
    const int meta_iters = kvb_quick() ? 10000 : 100000;
    void *src = kvb_alloc(bytes), *dst = kvb_alloc(bytes);
    int64_t shape[2] = {n, n};
    struct kv_view v, t;
    double meta[256], copy[256];
    kv_status st;

    kvb_fill_random(src, bytes, 1);
    if ((st = kv_view_init(src, bytes, KV_F32, 2, shape, &v)) != KV_OK) {
        kvb__die_status("kv_view_init", st);
        goto out;
    }
    for (int r = -1; r < runs; r++) { /* r == -1: warm-up */
        uint64_t acc = 0;
        double t0 = kvb_now();
        for (int i = 0; i < meta_iters; i++) {
            acc += (uint64_t)kv_view_transpose(&v, 0, 1, &t);
            acc += (uint64_t)t.strides[0];
        }
        double t1 = kvb_now();
        kvb_sink(acc);
        st = kv_view_transpose(&v, 0, 1, &t);
        double t2 = kvb_now();
        st = kv_view_materialize(&t, dst, bytes);
        double t3 = kvb_now();
        if (st != KV_OK) {
            kvb__die_status("kv_view_materialize", st);
            goto out;
        }
        if (r >= 0) {
            meta[r] = (t1 - t0) / meta_iters * 1e6;
            copy[r] = (t3 - t2) * 1e6;
        }
    }
    kvb_emit_us(bench, case_name, kvb_median(meta, runs), "materialize", kvb_median(copy, runs),
                runs);
out:
    kvb_free(src);
    kvb_free(dst);
}

/* ---- view.strided_sum --------------------------------------------------- */

/* Sum of a 2-D f64 view, eight accumulators (like NumPy's pairwise sum) so
 * the loop is limited by memory, not by the add latency. */
static double kvb__sum2d(const struct kv_view *v)
{
    const double *b = (const double *)v->base + v->offset;
    const int64_t s0 = v->strides[0], s1 = v->strides[1], n1 = v->shape[1];
    double acc = 0.0;

    for (int64_t i = 0; i < v->shape[0]; i++) {
        const double *row = b + i * s0;
        double a[8] = {0};
        int64_t j = 0;
        for (; j + 8 <= n1; j += 8)
            for (int u = 0; u < 8; u++)
                a[u] += row[(j + u) * s1];
        for (; j < n1; j++)
            a[0] += row[j * s1];
        acc += ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
    return acc;
}

static void kvb__fill_doubles(double *p, size_t n, uint64_t seed)
{
    kvb_fill_random(p, n * sizeof(double), seed);
    for (size_t i = 0; i < n; i++) { /* random bits -> finite values in [1, 2) */
        uint64_t u;
        memcpy(&u, &p[i], 8);
        u = (u & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
        memcpy(&p[i], &u, 8);
    }
}

static void kvb__strided_sum(void)
{
    static const char bench[] = "view.strided_sum";
    const int64_t rows = kvb_quick() ? 1000 : 4000, cols = kvb_quick() ? 500 : 2000;
    char case_name[160];
    snprintf(case_name, sizeof(case_name),
             "f64/%lldx%lld/every-other-col/strided-view-vs-packed-%lldx%lld", (long long)rows,
             (long long)cols, (long long)rows, (long long)(cols / 2));
    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);

    const int runs = kvb_runs();
    const size_t full = (size_t)(rows * cols), half = (size_t)(rows * (cols / 2));
    double *a = kvb_alloc(full * sizeof(double)), *p = kvb_alloc(half * sizeof(double));
    int64_t shape[2] = {rows, cols}, pshape[2] = {rows, cols / 2};
    struct kv_view va, vs, vp;
    double ts[256], tp[256], s1 = 0, s2 = 0;
    kv_status st;

    kvb__fill_doubles(a, full, 2);
    if ((st = kv_view_init(a, full * sizeof(double), KV_F64, 2, shape, &va)) != KV_OK ||
        (st = kv_view_slice(&va, 1, 0, cols, 2, &vs)) != KV_OK ||
        (st = kv_view_materialize(&vs, p, half * sizeof(double))) != KV_OK ||
        (st = kv_view_init(p, half * sizeof(double), KV_F64, 2, pshape, &vp)) != KV_OK) {
        kvb__die_status("view setup", st);
        goto out;
    }
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now();
        s1 = kvb__sum2d(&vs);
        double t1 = kvb_now();
        s2 = kvb__sum2d(&vp);
        double t2 = kvb_now();
        if (r >= 0) {
            ts[r] = (t1 - t0) * 1e6;
            tp[r] = (t2 - t1) * 1e6;
        }
    }
    if (s1 != s2)
        fprintf(stderr, "kvbench: %s: strided sum %.17g != packed sum %.17g\n", bench, s1, s2);
    kvb_sink((uint64_t)(s1 + s2));
    kvb_emit_us(bench, case_name, kvb_median(ts, runs), "packed", kvb_median(tp, runs), runs);
out:
    kvb_free(a);
    kvb_free(p);
}

/* ---- view.materialize --------------------------------------------------- */

/*
 * One materialize case: `copies` independent source buffers of `src_bytes`,
 * each viewed through `make_view`, are materialized into `copies` dst
 * buffers of `out_bytes` (the candidate); baselines are one memcpy of the
 * same bytes per copy, and the naive element loop.
 */
typedef kv_status (*kvb_make_view_fn)(void *src, size_t src_bytes, const int64_t *dims,
                                      struct kv_view *out);

static void kvb__materialize_case(const char *case_name, kv_dtype dtype, size_t src_bytes,
                                  int copies, const int64_t *dims, kvb_make_view_fn make_view)
{
    static const char bench[] = "view.materialize";
    char *src[16], *dst[16];
    struct kv_view v[16];
    double tc[256], tm[256], tn[256];
    const int runs = kvb_runs();
    kv_status st = KV_OK;
    size_t out_bytes = 0;

    if (!kvb_selected(bench, case_name))
        return;
    kvb_progress(bench, case_name);
    for (int i = 0; i < copies; i++) {
        src[i] = kvb_alloc(src_bytes);
        kvb_fill_random(src[i], src_bytes, 100 + (uint64_t)i);
        st = make_view(src[i], src_bytes, dims, &v[i]);
        if (st != KV_OK) {
            kvb__die_status(case_name, st);
            for (int j = 0; j <= i; j++)
                kvb_free(src[j]);
            return;
        }
        out_bytes = (size_t)kv_view_numel(&v[i]) * kv_view_elem_bytes(&v[i]);
        dst[i] = kvb_alloc(out_bytes);
        memset(dst[i], 0, out_bytes); /* fault the pages in before timing */
    }
    (void)dtype;
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now();
        for (int i = 0; i < copies && st == KV_OK; i++)
            st = kv_view_materialize(&v[i], dst[i], out_bytes);
        double t1 = kvb_now();
        for (int i = 0; i < copies; i++)
            memcpy(dst[i], src[i], out_bytes);
        double t2 = kvb_now();
        for (int i = 0; i < copies; i++)
            kvb__naive_materialize(&v[i], dst[i]);
        double t3 = kvb_now();
        if (st != KV_OK) {
            kvb__die_status("kv_view_materialize", st);
            goto out;
        }
        if (r >= 0) {
            tc[r] = t1 - t0;
            tm[r] = t2 - t1;
            tn[r] = t3 - t2;
        }
    }
    /* The last writer was the naive loop; the candidate must agree with it. */
    {
        char *check = kvb_alloc(out_bytes);
        if (kv_view_materialize(&v[0], check, out_bytes) != KV_OK ||
            memcmp(check, dst[0], out_bytes) != 0)
            fprintf(stderr, "kvbench: %s: materialize disagrees with the naive loop\n", case_name);
        kvb_free(check);
    }
    const uint64_t total = (uint64_t)out_bytes * (uint64_t)copies;
    const double cand = kvb_median(tc, runs);
    kvb_emit_gbps(bench, case_name, total, cand, "memcpy", kvb_median(tm, runs), runs);
    kvb_emit_gbps(bench, case_name, total, cand, "naive", kvb_median(tn, runs), runs);
out:
    for (int i = 0; i < copies; i++) {
        kvb_free(src[i]);
        kvb_free(dst[i]);
    }
}

/* dims = {rows, cols, dtype}: the transpose of a rows x cols matrix. */
static kv_status kvb__make_transposed(void *src, size_t src_bytes, const int64_t *dims,
                                      struct kv_view *out)
{
    struct kv_view v;
    kv_status st = kv_view_init(src, src_bytes, (kv_dtype)dims[2], 2, dims, &v);
    if (st != KV_OK)
        return st;
    return kv_view_transpose(&v, 0, 1, out);
}

/* dims = {blocks, N, H, D, dtype}: [blocks][N][H][D] seen as [blocks][H][N][D]. */
static kv_status kvb__make_nhd_to_hnd(void *src, size_t src_bytes, const int64_t *dims,
                                      struct kv_view *out)
{
    static const int perm[4] = {0, 2, 1, 3};
    struct kv_view v;
    kv_status st = kv_view_init(src, src_bytes, (kv_dtype)dims[4], 4, dims, &v);
    if (st != KV_OK)
        return st;
    return kv_view_permute(&v, perm, 4, out);
}

static void kvb__materialize(void)
{
    const int quick = kvb_quick();
    char name[160];

    /* Transposes: 4096x4096 per matrix, enough matrices for >= 256 MiB moved. */
    static const kv_dtype tdt[2] = {KV_F32, KV_F16};
    for (int t = 0; t < 2; t++) {
        const int64_t n = quick ? 1024 : 4096;
        const size_t esz = kv_dtype_size(tdt[t]);
        const size_t one = (size_t)(n * n) * esz;
        const int copies = quick ? 1 : (int)((256 * KVB_MIB) / one);
        const int64_t dims[3] = {n, n, tdt[t]};
        snprintf(name, sizeof(name), "%s/%lldx%lld/transpose/x%d", kv_dtype_name(tdt[t]),
                 (long long)n, (long long)n, copies);
        kvb__materialize_case(name, tdt[t], one, copies, dims, kvb__make_transposed);
    }

    /* KV cache re-layout: [blocks][N=16][H=8][D=128] bf16 -> [blocks][H][N][D]. */
    {
        const int64_t N = 16, H = 8, D = 128;
        const int64_t blocks = quick ? 256 : (int64_t)((256 * KVB_MIB) / (size_t)(N * H * D * 2));
        const int64_t dims[5] = {blocks, N, H, D, KV_BF16};
        const size_t bytes = (size_t)(blocks * N * H * D) * 2;
        snprintf(name, sizeof(name), "bf16/blocks%lld/N%lld/H%lld/D%lld/nhd->hnd",
                 (long long)blocks, (long long)N, (long long)H, (long long)D);
        kvb__materialize_case(name, KV_BF16, bytes, 1, dims, kvb__make_nhd_to_hnd);
    }
}

KVB_REGISTER("view", kvb__transpose_meta)
KVB_REGISTER("view", kvb__strided_sum)
KVB_REGISTER("view", kvb__materialize)
