/*
 * bench_view.c - view benchmarks (see docs/bench-method.md).
 *
 *   view.materialize     kv_view_materialize of transposes and of the KV
 *                        [blocks][N][H][D] -> [blocks][H][N][D] permute, against
 *                        one memcpy of the same bytes and against the naive
 *                        element loop over the view formula (separate lines).
 *                        Every copy's output must equal the naive loop's
 *                        (kvb_mismatch otherwise).
 *
 * Candidate and baselines run interleaved (A B C A B C ...) after a warm-up;
 * medians are reported.
 */
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "kv_view.h"

#define KVB_MIB ((size_t)1 << 20)

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
    const int runs = kvb_runs() < 256 ? kvb_runs() : 256;
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
            kvb_failed(bench, case_name, "view of copy %d: %s (%s)", i, kv_status_name(st),
                       kv_last_error());
            for (int j = 0; j < i; j++)
                kvb_free(dst[j]);
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
            kvb_failed(bench, case_name, "kv_view_materialize: %s (%s)", kv_status_name(st),
                       kv_last_error());
            goto out;
        }
        if (r >= 0) {
            tc[r] = t1 - t0;
            tm[r] = t2 - t1;
            tn[r] = t3 - t2;
        }
    }
    /* The last writer was the naive loop; the candidate must agree with it
     * on every copy. */
    {
        char *check = kvb_alloc(out_bytes);
        int bad = 0;
        for (int i = 0; i < copies && !bad; i++) {
            if ((st = kv_view_materialize(&v[i], check, out_bytes)) != KV_OK) {
                kvb_failed(bench, case_name, "kv_view_materialize of copy %d: %s (%s)", i,
                           kv_status_name(st), kv_last_error());
                bad = 1;
            } else if (memcmp(check, dst[i], out_bytes) != 0) {
                size_t at = 0;
                while (check[at] == dst[i][at])
                    at++;
                kvb_mismatch(bench, case_name,
                             "copy %d byte %zu of %zu: materialize 0x%02x, naive loop 0x%02x", i,
                             at, out_bytes, (unsigned char)check[at], (unsigned char)dst[i][at]);
                bad = 1;
            }
        }
        kvb_free(check);
        if (bad)
            goto out;
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

KVB_REGISTER("view", kvb__materialize)
