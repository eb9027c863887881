/*
 * bench_kernel.c - the CPU attention kernels (attention/kv_attn.h) against
 * the copies they must approach (docs/bench-method.md, docs/benchmarks.md).
 *
 * Shape: bf16, N 16, H 8, D 128, one layer of a pool over 2 GiB (quick:
 * 64 MiB), NHD and HND, blocks in a random order over the whole pool.
 *
 *   kernel.write_prefill  whole sequences (consecutive slots) into their
 *                         blocks; vs one memcpy of the same bytes, and vs
 *                         memcpy_runs (the same contiguous pieces, addresses
 *                         precomputed, no layout logic)
 *   kernel.write_decode   one token for each of 4,096 sequences, scattered
 *                         (16 such steps per run, each on other blocks); vs
 *                         memcpy_runs and memcpy
 *   kernel.read           256 sequences x 512 tokens (CSR pages) into a
 *                         contiguous output; vs memcpy and memcpy_runs
 *   (write_prefill and read also print a line against a memcpy of the same
 *   bytes on kv_threads() threads, memcpy_threads: the kernels run on
 *   those threads)
 *   kernel.decode_attn    Hq 32 over H 8, 256 sequences x 2,048 tokens (CSR);
 *                         tokens/s vs reading the same K/V once at memcpy
 *                         speed (a memcpy of its bytes), and a second line
 *                         against a memcpy on kv_threads() threads
 *                         (memcpy_threads, as prefill)
 *   kernel.decode_attn_fp8  the same decode over an fp8 (e4m3) cache of the
 *                         same shape vs the bf16 decode, alternated in each
 *                         run (the goal: >= 1.5x its tokens/s)
 *   kernel.prefill_attn   the multi-token kernel (kv_attn_prefill), 64
 *                         sequences x 2,048 cached tokens whose last 4 or 16
 *                         are queries (causal), Hq 32 over H 8: tokens/s vs
 *                         reading the same K/V once at memcpy speed (the
 *                         goal: >= 0.5x), and a second line against a
 *                         memcpy on kv_threads() threads (memcpy_threads:
 *                         thread scaling on many-core hosts). Every cached
 *                         token counts: the
 *                         causal mask hides at most q_len - 1 of them from
 *                         the first query and none from the last, so all
 *                         S x len tokens' K/V are read. Compute-bound from
 *                         q_len ~4 (q_len x 1,024 vector FMAs a token:
 *                         docs/benchmarks.md has the arithmetic)
 *
 * Every case checks its result before it reports: written rows at addresses
 * computed from the layout's strides, read output against the source it was
 * written from, decode and prefill against a float64 reference for a sample
 * of (sequence, query, head). A wrong result is a kvb_mismatch (kvbench fails).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kv_attn.h"
#include "kv_convert_hd.h"

#define KVB_MIB ((size_t)1 << 20)

static const int64_t N = 16, H = 8, D = 128;

struct kvb__kc {
    kv_order order;
    kv_dtype dtype; /* KV_BF16, or fp8 for the fp8 decode case */
    int64_t want_blocks;
    int ready; /* 1 built, -1 failed (built on first use: --list builds nothing) */
    struct kv_paged_cache c;
    char *pool;
    int64_t blocks;
    int32_t *perm; /* a random order of every block id */
};

static void kvb__fail(const char *bench, const char *case_name, const char *what, kv_status st)
{
    kvb_mismatch(bench, case_name, "%s: %s (%s)", what, kv_status_name(st), kv_last_error());
}

/* Random finite bf16 values, |x| < 2: random bits with exponent bit 14 clear. */
static void kvb__fill_bf16(void *p, size_t bytes, uint64_t seed)
{
    kvb_fill_random(p, bytes, seed);
    uint64_t *w = p;
    for (size_t i = 0; i < bytes / 8; i++)
        w[i] &= 0xBFFFBFFFBFFFBFFFull;
}

/* Random finite e4m3 values, |x| < 2: random bytes with exponent bit 6 clear
 * (which also excludes the NaN pattern). */
static void kvb__fill_e4m3(void *p, size_t bytes, uint64_t seed)
{
    kvb_fill_random(p, bytes, seed);
    uint64_t *w = p;
    for (size_t i = 0; i < bytes / 8; i++)
        w[i] &= 0xBFBFBFBFBFBFBFBFull;
}

static int kvb__kc_build(struct kvb__kc *k, kv_order order, kv_dtype dt, int64_t blocks)
{
    struct kv_layout_config cfg = KV_LAYOUT_CONFIG_INIT;
    cfg.num_layers = 1, cfg.num_blocks = blocks, cfg.block_tokens = N, cfg.num_heads = H;
    cfg.head_dim = D, cfg.dtype = dt, cfg.order = order;
    memset(k, 0, sizeof(*k));
    kv_status st = kv_layout_init(&cfg, &k->c.layout);
    if (st != KV_OK) {
        fprintf(stderr, "kvbench: kernel layout: %s (%s)\n", kv_status_name(st), kv_last_error());
        return -1;
    }
    k->blocks = blocks;
    k->c.storage_bytes = (size_t)k->c.layout.total_bytes;
    k->c.mem = KV_MEM_HOST;
    k->pool = kvb_alloc(k->c.storage_bytes);
    k->c.base = k->pool;
    if (dt == KV_FP8_E4M3) /* faults every page in */
        kvb__fill_e4m3(k->pool, k->c.storage_bytes, 7);
    else
        kvb__fill_bf16(k->pool, k->c.storage_bytes, 7);
    k->perm = malloc((size_t)blocks * sizeof(int32_t));
    if (!k->perm)
        return -1;
    uint64_t x = 12345;
    for (int64_t i = 0; i < blocks; i++)
        k->perm[i] = (int32_t)i;
    for (int64_t i = blocks - 1; i > 0; i--) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t j = (int64_t)((x >> 33) % (uint64_t)(i + 1));
        const int32_t t = k->perm[i];
        k->perm[i] = k->perm[j], k->perm[j] = t;
    }
    return 0;
}

/* The cache, built the first time a selected case needs it. */
static int kvb__kc_need(struct kvb__kc *k)
{
    if (!k->ready) {
        const kv_order o = k->order;
        const kv_dtype dt = k->dtype;
        const int64_t b = k->want_blocks;
        k->ready = kvb__kc_build(k, o, dt, b) == 0 ? 1 : -1;
        k->order = o, k->dtype = dt, k->want_blocks = b;
    }
    return k->ready == 1 ? 0 : -1;
}

static void kvb__kc_fini(struct kvb__kc *k)
{
    if (k->ready == 1) {
        kvb_free(k->pool);
        free(k->perm);
    }
}

/* Byte offset of (kv, slot, head) from the layout's strides, written out. */
static int64_t kvb__row_off(const struct kv_layout *lo, int kv, int64_t slot, int64_t h)
{
    return kv * lo->stride_kv_bytes + (slot / N) * lo->stride_block_bytes +
           (slot % N) * lo->stride_token_bytes + h * lo->stride_head_bytes;
}

/* The contiguous pieces a copy of tokens [0, T) <-> slots moves, K then V:
 * (cache offset, tensor offset, bytes), adjacent pieces merged. */
struct kvb__piece {
    int64_t cache, tensor, bytes;
    int kv;
};

static struct kvb__piece *kvb__pieces(const struct kv_layout *lo, const int64_t *slots, int64_t T,
                                      int64_t *count)
{
    const int64_t row = D * 2;
    struct kvb__piece *p = malloc((size_t)(2 * T * H) * sizeof(*p));
    int64_t n = 0;
    if (!p)
        return NULL;
    for (int kv = 0; kv < 2; kv++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t co = kvb__row_off(lo, kv, slots[t], h), to = (t * H + h) * row;
                if (n && p[n - 1].kv == kv && p[n - 1].cache + p[n - 1].bytes == co &&
                    p[n - 1].tensor + p[n - 1].bytes == to) {
                    p[n - 1].bytes += row;
                    continue;
                }
                p[n++] = (struct kvb__piece){co, to, row, kv};
            }
    *count = n;
    return p;
}

/* Rows of tokens [0, T) in the cache equal the source rows (K at k, V at v). */
static int kvb__rows_equal(const struct kv_layout *lo, const char *pool, const int64_t *slots,
                           int64_t T, const char *k, const char *v, int64_t *bad_t)
{
    const int64_t row = D * 2;
    for (int64_t t = 0; t < T; t++)
        for (int kv = 0; kv < 2; kv++)
            for (int64_t h = 0; h < H; h++)
                if (memcmp(pool + kvb__row_off(lo, kv, slots[t], h),
                           (kv ? v : k) + (t * H + h) * row, (size_t)row) != 0) {
                    *bad_t = t;
                    return 0;
                }
    return 1;
}

static const char *kvb__order_name(kv_order o)
{
    return o == KV_ORDER_NHD ? "nhd" : "hnd";
}

/* write_prefill and read: T tokens on the first T/N blocks of perm. */
static void kvb__prefill_and_read(struct kvb__kc *kc, int64_t S, int64_t len)
{
    const int64_t T = S * len, per = len / N;
    const size_t tb = (size_t)(T * H * D) * 2;
    const int runs = kvb_runs();
    char wname[160], rname[160];
    snprintf(wname, sizeof(wname), "%s/bf16/N16/H8/D128/%lldx%lld/t%d", kvb__order_name(kc->order),
             (long long)S, (long long)len, kv_threads());
    snprintf(rname, sizeof(rname), "%s", wname);
    const int do_w = kvb_selected("kernel.write_prefill", wname);
    const int do_r = kvb_selected("kernel.read", rname);
    if (!do_w && !do_r)
        return;
    if (kvb__kc_need(kc) != 0) {
        kvb_mismatch("kernel.write_prefill", wname, "cannot build the cache");
        return;
    }
    const struct kv_layout *lo = &kc->c.layout;
    char *k = kvb_alloc(tb), *v = kvb_alloc(tb), *ko = kvb_alloc(tb), *vo = kvb_alloc(tb);
    char *scratch = kvb_alloc(2 * tb);
    int64_t *slots = malloc((size_t)T * sizeof(int64_t));
    int32_t *indptr = malloc((size_t)(S + 1) * sizeof(int32_t));
    int32_t *last = malloc((size_t)S * sizeof(int32_t));
    double tc[256], tm[256], tr[256], tt[256];
    int64_t np = 0, bad = 0;
    struct kvb__piece *pc = NULL;
    if (!slots || !indptr || !last)
        goto out;
    kvb__fill_bf16(k, tb, 1);
    kvb__fill_bf16(v, tb, 2);
    memset(ko, 0, tb);
    memset(vo, 0, tb);
    memset(scratch, 0, 2 * tb);
    for (int64_t t = 0; t < T; t++)
        slots[t] = (int64_t)kc->perm[t / N] * N + t % N;
    for (int64_t s = 0; s <= S; s++)
        indptr[s] = (int32_t)(s * per);
    for (int64_t s = 0; s < S; s++)
        last[s] = (int32_t)N;
    pc = kvb__pieces(lo, slots, T, &np);
    if (!pc)
        goto out;
    struct kv_view kv_k, kv_v, kv_ko, kv_vo;
    const int64_t shape[3] = {T, H, D};
    kv_status st;
    if ((st = kv_view_init(k, tb, KV_BF16, 3, shape, &kv_k)) != KV_OK ||
        (st = kv_view_init(v, tb, KV_BF16, 3, shape, &kv_v)) != KV_OK ||
        (st = kv_view_init(ko, tb, KV_BF16, 3, shape, &kv_ko)) != KV_OK ||
        (st = kv_view_init(vo, tb, KV_BF16, 3, shape, &kv_vo)) != KV_OK) {
        kvb__fail("kernel.write_prefill", wname, "views", st);
        goto out;
    }
    /* the prefill, interleaved with memcpy and memcpy_runs */
    kvb_progress("kernel.write_prefill", wname);
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now();
        st = kv_attn_write(kc->c, 0, &kv_k, &kv_v, slots, T, NULL);
        double t1 = kvb_now();
        memcpy(scratch, k, tb);
        memcpy(scratch + tb, v, tb);
        double t2 = kvb_now();
        for (int64_t i = 0; i < np; i++)
            memcpy(kc->pool + pc[i].cache, (pc[i].kv ? v : k) + pc[i].tensor, (size_t)pc[i].bytes);
        double t3 = kvb_now();
        kvb_settle();
        const double t3b = kvb_now();
        kvb_memcpy_threads(scratch, k, tb, kv_threads());
        kvb_memcpy_threads(scratch + tb, v, tb, kv_threads());
        const double t4 = kvb_now();
        if (st != KV_OK) {
            kvb__fail("kernel.write_prefill", wname, "kv_attn_write", st);
            goto out;
        }
        if (r >= 0)
            tc[r] = t1 - t0, tm[r] = t2 - t1, tr[r] = t3 - t2, tt[r] = t4 - t3b;
    }
    /* the kernel's own result: the rows cleared, written again, compared */
    for (int64_t i = 0; i < np; i++)
        memset(kc->pool + pc[i].cache, 0, (size_t)pc[i].bytes);
    st = kv_attn_write(kc->c, 0, &kv_k, &kv_v, slots, T, NULL);
    if (st != KV_OK || !kvb__rows_equal(lo, kc->pool, slots, T, k, v, &bad)) {
        if (st != KV_OK)
            kvb__fail("kernel.write_prefill", wname, "kv_attn_write", st);
        else
            kvb_mismatch("kernel.write_prefill", wname, "token %lld is not where the layout says",
                         (long long)bad);
        goto out;
    }
    if (do_w) {
        kvb_emit_gbps("kernel.write_prefill", wname, 2 * tb, kvb_median(tc, runs), "memcpy",
                      kvb_median(tm, runs), runs);
        kvb_emit_gbps("kernel.write_prefill", wname, 2 * tb, kvb_median(tc, runs), "memcpy_runs",
                      kvb_median(tr, runs), runs);
        kvb_emit_gbps("kernel.write_prefill", wname, 2 * tb, kvb_median(tc, runs), "memcpy_threads",
                      kvb_median(tt, runs), runs);
    }
    if (!do_r)
        goto out;
    /* read the same tokens back: 256 sequences of whole pages */
    struct kv_pages pg = {.format = KV_PAGES_CSR,
                          .n_seqs = (uint32_t)S,
                          .page_ratio = 1,
                          .indptr = indptr,
                          .indices = kc->perm,
                          .last_page_len = last};
    kvb_progress("kernel.read", rname);
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now();
        st = kv_attn_read(kc->c, 0, &pg, &kv_ko, &kv_vo, NULL);
        double t1 = kvb_now();
        memcpy(scratch, kc->pool, 2 * tb); /* as many bytes, sequentially */
        double t2 = kvb_now();
        for (int64_t i = 0; i < np; i++)
            memcpy(scratch + (pc[i].kv ? tb : 0) + pc[i].tensor, kc->pool + pc[i].cache,
                   (size_t)pc[i].bytes);
        double t3 = kvb_now();
        kvb_settle();
        const double t3b = kvb_now();
        kvb_memcpy_threads(scratch, kc->pool, 2 * tb, kv_threads());
        const double t4 = kvb_now();
        if (st != KV_OK) {
            kvb__fail("kernel.read", rname, "kv_attn_read", st);
            goto out;
        }
        if (r >= 0)
            tc[r] = t1 - t0, tm[r] = t2 - t1, tr[r] = t3 - t2, tt[r] = t4 - t3b;
    }
    if (memcmp(ko, k, tb) != 0 || memcmp(vo, v, tb) != 0) {
        kvb_mismatch("kernel.read", rname, "the output differs from the tokens written");
        goto out;
    }
    kvb_emit_gbps("kernel.read", rname, 2 * tb, kvb_median(tc, runs), "memcpy",
                  kvb_median(tm, runs), runs);
    kvb_emit_gbps("kernel.read", rname, 2 * tb, kvb_median(tc, runs), "memcpy_runs",
                  kvb_median(tr, runs), runs);
    kvb_emit_gbps("kernel.read", rname, 2 * tb, kvb_median(tc, runs), "memcpy_threads",
                  kvb_median(tt, runs), runs);
out:
    free(pc);
    free(slots);
    free(indptr);
    free(last);
    kvb_free(k);
    kvb_free(v);
    kvb_free(ko);
    kvb_free(vo);
    kvb_free(scratch);
}

/* write_decode: `steps` decode steps of one token for each of S sequences,
 * each step on other blocks (spread over the pool). */
static void kvb__write_decode(struct kvb__kc *kc, int64_t S, int steps)
{
    static const char bench[] = "kernel.write_decode";
    const size_t tb = (size_t)(S * H * D) * 2;
    const int runs = kvb_runs();
    char name[160];
    snprintf(name, sizeof(name), "%s/bf16/N16/H8/D128/%lldx1/steps%d/t%d",
             kvb__order_name(kc->order), (long long)S, steps, kv_threads());
    if (!kvb_selected(bench, name))
        return;
    if (kvb__kc_need(kc) != 0) {
        kvb_mismatch(bench, name, "cannot build the cache");
        return;
    }
    const struct kv_layout *lo = &kc->c.layout;
    kvb_progress(bench, name);
    char *k = kvb_alloc(tb), *v = kvb_alloc(tb), *scratch = kvb_alloc(2 * tb * (size_t)steps);
    int64_t *slots = malloc((size_t)(S * steps) * sizeof(int64_t));
    struct kvb__piece **pc = calloc((size_t)steps, sizeof(*pc));
    int64_t *np = calloc((size_t)steps, sizeof(int64_t));
    double tc[256], tm[256], tr[256];
    int64_t bad = 0;
    if (!slots || !pc || !np)
        goto out;
    kvb__fill_bf16(k, tb, 3);
    kvb__fill_bf16(v, tb, 4);
    memset(scratch, 0, 2 * tb * (size_t)steps);
    const int64_t stride = kc->blocks / (S * steps) > 0 ? kc->blocks / (S * steps) : 1;
    for (int st_i = 0; st_i < steps; st_i++) {
        for (int64_t s = 0; s < S; s++) {
            const int64_t b = ((int64_t)st_i * S + s) * stride % kc->blocks;
            slots[st_i * S + s] = (int64_t)kc->perm[b] * N + (s * 7 + st_i) % N;
        }
        pc[st_i] = kvb__pieces(lo, slots + st_i * S, S, &np[st_i]);
        if (!pc[st_i])
            goto out;
    }
    struct kv_view kv_k, kv_v;
    const int64_t shape[3] = {S, H, D};
    kv_status st;
    if ((st = kv_view_init(k, tb, KV_BF16, 3, shape, &kv_k)) != KV_OK ||
        (st = kv_view_init(v, tb, KV_BF16, 3, shape, &kv_v)) != KV_OK) {
        kvb__fail(bench, name, "views", st);
        goto out;
    }
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now();
        for (int i = 0; i < steps && st == KV_OK; i++)
            st = kv_attn_write(kc->c, 0, &kv_k, &kv_v, slots + i * S, S, NULL);
        double t1 = kvb_now();
        for (int i = 0; i < steps; i++)
            for (int64_t p = 0; p < np[i]; p++)
                memcpy(kc->pool + pc[i][p].cache, (pc[i][p].kv ? v : k) + pc[i][p].tensor,
                       (size_t)pc[i][p].bytes);
        double t2 = kvb_now();
        for (int i = 0; i < steps; i++) {
            memcpy(scratch + 2 * tb * (size_t)i, k, tb);
            memcpy(scratch + 2 * tb * (size_t)i + tb, v, tb);
        }
        double t3 = kvb_now();
        if (st != KV_OK) {
            kvb__fail(bench, name, "kv_attn_write", st);
            goto out;
        }
        if (r >= 0)
            tc[r] = t1 - t0, tr[r] = t2 - t1, tm[r] = t3 - t2;
    }
    /* the kernel's result: clear the rows, write, compare */
    for (int i = 0; i < steps; i++)
        for (int64_t p = 0; p < np[i]; p++)
            memset(kc->pool + pc[i][p].cache, 0, (size_t)pc[i][p].bytes);
    for (int i = 0; i < steps; i++) {
        st = kv_attn_write(kc->c, 0, &kv_k, &kv_v, slots + i * S, S, NULL);
        if (st != KV_OK) {
            kvb__fail(bench, name, "kv_attn_write", st);
            goto out;
        }
        if (!kvb__rows_equal(lo, kc->pool, slots + i * S, S, k, v, &bad)) {
            kvb_mismatch(bench, name, "step %d token %lld is not where the layout says", i,
                         (long long)bad);
            goto out;
        }
    }
    const uint64_t bytes = 2 * (uint64_t)tb * (uint64_t)steps;
    kvb_emit_gbps(bench, name, bytes, kvb_median(tc, runs), "memcpy_runs", kvb_median(tr, runs),
                  runs);
    kvb_emit_gbps(bench, name, bytes, kvb_median(tc, runs), "memcpy", kvb_median(tm, runs), runs);
out:
    for (int i = 0; pc && i < steps; i++)
        free(pc[i]);
    free(pc);
    free(np);
    free(slots);
    kvb_free(k);
    kvb_free(v);
    kvb_free(scratch);
}

/* Checks decode output o (bf16 [S][Hq][D]) of q over kc's cache against a
 * float64 reference for a sample of (sequence, query head) pairs; 0 or -1
 * after reporting the mismatch. */
static int kvb__decode_check(const char *bench, const char *name, const struct kvb__kc *kc,
                             int64_t S, int64_t len, const char *q, const char *o, float scale)
{
    const struct kv_layout *lo = &kc->c.layout;
    const kv_dtype dt = lo->dtype;
    const int64_t Hq = 32, per = len / N, g = Hq / H, es = lo->elem_bytes;
    double *w = malloc((size_t)len * sizeof(double));
    const int64_t ss[3] = {0, S / 2, S - 1}, qs[3] = {0, 13, Hq - 1};
    if (!w)
        return -1;
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            const int64_t s = ss[a], qi = qs[b], h = qi / g;
            const char *qr = q + (s * Hq + qi) * D * 2;
            double mx = -INFINITY, sum = 0.0;
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = (int64_t)kc->perm[s * per + t / N] * N + t % N;
                const char *kr = kc->pool + kvb__row_off(lo, 0, slot, h);
                double dot = 0.0;
                for (int64_t d = 0; d < D; d++)
                    dot +=
                        (double)kv_to_f32(KV_BF16, qr + d * 2) * (double)kv_to_f32(dt, kr + d * es);
                w[t] = dot * scale;
                mx = w[t] > mx ? w[t] : mx;
            }
            for (int64_t t = 0; t < len; t++)
                sum += (w[t] = exp(w[t] - mx));
            for (int64_t d = 0; d < D; d++) {
                double acc = 0.0;
                for (int64_t t = 0; t < len; t++) {
                    const int64_t slot = (int64_t)kc->perm[s * per + t / N] * N + t % N;
                    acc += w[t] *
                           (double)kv_to_f32(dt, kc->pool + kvb__row_off(lo, 1, slot, h) + d * es);
                }
                const double want = acc / sum;
                const double got = kv_to_f32(KV_BF16, o + ((s * Hq + qi) * D + d) * 2);
                /* bf16 output: 2^-8 relative, plus f32 accumulation */
                if (fabs(got - want) > 1e-2 * fabs(want) + 1e-3) {
                    kvb_mismatch(
                        bench, name, "%s cache: s %lld q %lld d %lld: %.6g, reference %.6g",
                        kv_dtype_name(dt), (long long)s, (long long)qi, (long long)d, got, want);
                    free(w);
                    return -1;
                }
            }
        }
    free(w);
    return 0;
}

/* Decode attention over S sequences of len tokens (Hq = 32 over H = 8) on
 * kc's cache. Without cmp the baseline is reading the same K/V once at
 * memcpy speed; with cmp (kernel.decode_attn_fp8: kc holds e4m3, cmp the
 * bf16 cache of the same shape) it is the same decode over cmp, alternated
 * with the candidate in every run. Both outputs are checked. */
static void kvb__decode_attn(struct kvb__kc *kc, struct kvb__kc *cmp, int64_t S, int64_t len)
{
    const char *bench = cmp ? "kernel.decode_attn_fp8" : "kernel.decode_attn";
    const int64_t Hq = 32, per = len / N;
    const int runs = kvb_runs() < 5 ? kvb_runs() : 5; /* each run reads over 2 GiB */
    const size_t qb = (size_t)(S * Hq * D) * 2;
    char name[160];
    snprintf(name, sizeof(name), "%s/%s/N16/Hq32/H8/D128/%lldx%lld/t%d", kvb__order_name(kc->order),
             kv_dtype_name(kc->dtype), (long long)S, (long long)len, kv_threads());
    if (!kvb_selected(bench, name))
        return;
    if (kvb__kc_need(kc) != 0 || (cmp && kvb__kc_need(cmp) != 0)) {
        kvb_mismatch(bench, name, "cannot build the cache");
        return;
    }
    if (S * per > kc->blocks) {
        kvb_mismatch(bench, name, "the pool has %lld blocks, the case needs %lld",
                     (long long)kc->blocks, (long long)(S * per));
        return;
    }
    kvb_progress(bench, name);
    const size_t kvb = cmp ? 0 : (size_t)(S * len * H * D) * kc->c.layout.elem_bytes * 2;
    char *q = kvb_alloc(qb), *o = kvb_alloc(qb), *o2 = kvb_alloc(qb);
    char *scratch = cmp ? NULL : kvb_alloc(kvb);
    int32_t *indptr = malloc((size_t)(S + 1) * sizeof(int32_t));
    int32_t *last = malloc((size_t)S * sizeof(int32_t));
    double tc[256], tm[256], tt[256];
    if (!indptr || !last)
        goto out;
    kvb__fill_bf16(q, qb, 5);
    memset(o, 0, qb);
    memset(o2, 0, qb);
    if (scratch)
        memset(scratch, 0, kvb);
    for (int64_t s = 0; s <= S; s++)
        indptr[s] = (int32_t)(s * per);
    for (int64_t s = 0; s < S; s++)
        last[s] = (int32_t)N;
    struct kv_pages pg = {.format = KV_PAGES_CSR,
                          .n_seqs = (uint32_t)S,
                          .page_ratio = 1,
                          .indptr = indptr,
                          .indices = kc->perm,
                          .last_page_len = last};
    struct kv_pages pg2 = pg;
    if (cmp)
        pg2.indices = cmp->perm;
    struct kv_view vq, vo, vo2;
    const int64_t shape[3] = {S, Hq, D};
    kv_status st;
    if ((st = kv_view_init(q, qb, KV_BF16, 3, shape, &vq)) != KV_OK ||
        (st = kv_view_init(o, qb, KV_BF16, 3, shape, &vo)) != KV_OK ||
        (st = kv_view_init(o2, qb, KV_BF16, 3, shape, &vo2)) != KV_OK) {
        kvb__fail(bench, name, "views", st);
        goto out;
    }
    const float scale = 1.0f / sqrtf((float)D);
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now(), t2b = 0;
        st = kv_attn_decode(kc->c, 0, &vq, &pg, scale, NULL, &vo);
        double t1 = kvb_now();
        kv_status st2 = KV_OK;
        if (cmp)
            st2 = kv_attn_decode(cmp->c, 0, &vq, &pg2, scale, NULL, &vo2);
        else
            memcpy(scratch, kc->pool, kvb);
        double t2 = kvb_now();
        if (!cmp) {
            kvb_settle();
            t2b = kvb_now();
            kvb_memcpy_threads(scratch, kc->pool, kvb, kv_threads());
        }
        const double t3 = kvb_now();
        if (st != KV_OK || st2 != KV_OK) {
            kvb__fail(bench, name, "kv_attn_decode", st != KV_OK ? st : st2);
            goto out;
        }
        if (r >= 0)
            tc[r] = t1 - t0, tm[r] = t2 - t1, tt[r] = t3 - t2b;
    }
    if (kvb__decode_check(bench, name, kc, S, len, q, o, scale) != 0 ||
        (cmp && kvb__decode_check(bench, name, cmp, S, len, q, o2, scale) != 0))
        goto out;
    kvb_emit_ops(bench, name, (uint64_t)(S * len), kvb_median(tc, runs),
                 cmp ? "bf16_decode" : "memcpy", kvb_median(tm, runs), runs);
    if (!cmp) /* and against a memcpy on the kernel's threads, as prefill */
        kvb_emit_ops(bench, name, (uint64_t)(S * len), kvb_median(tc, runs), "memcpy_threads",
                     kvb_median(tt, runs), runs);
out:
    free(indptr);
    free(last);
    kvb_free(q);
    kvb_free(o);
    kvb_free(o2);
    if (scratch)
        kvb_free(scratch);
}

/* Checks prefill output o (bf16 [S * ql][Hq][D]) of q against a float64
 * reference for a sample of (sequence, query, query head): query i of
 * sequence s sits at position len - ql + i and sees tokens 0 .. it. */
static int kvb__prefill_check(const char *bench, const char *name, const struct kvb__kc *kc,
                              int64_t S, int64_t len, int64_t ql, const char *q, const char *o,
                              float scale)
{
    const struct kv_layout *lo = &kc->c.layout;
    const kv_dtype dt = lo->dtype;
    const int64_t Hq = 32, per = len / N, g = Hq / H, es = lo->elem_bytes;
    double *w = malloc((size_t)len * sizeof(double));
    const int64_t ss[2] = {0, S - 1}, is[2] = {0, ql - 1}, qs[2] = {5, Hq - 1};
    if (!w)
        return -1;
    for (int a = 0; a < 8; a++) {
        const int64_t s = ss[a & 1], i = is[(a >> 1) & 1], qi = qs[a >> 2], h = qi / g;
        const int64_t row = s * ql + i, pos = len - ql + i;
        const char *qr = q + (row * Hq + qi) * D * 2;
        double mx = -INFINITY, sum = 0.0;
        for (int64_t t = 0; t <= pos; t++) {
            const int64_t slot = (int64_t)kc->perm[s * per + t / N] * N + t % N;
            const char *kr = kc->pool + kvb__row_off(lo, 0, slot, h);
            double dot = 0.0;
            for (int64_t d = 0; d < D; d++)
                dot += (double)kv_to_f32(KV_BF16, qr + d * 2) * (double)kv_to_f32(dt, kr + d * es);
            w[t] = dot * scale;
            mx = w[t] > mx ? w[t] : mx;
        }
        for (int64_t t = 0; t <= pos; t++)
            sum += (w[t] = exp(w[t] - mx));
        for (int64_t d = 0; d < D; d++) {
            double acc = 0.0;
            for (int64_t t = 0; t <= pos; t++) {
                const int64_t slot = (int64_t)kc->perm[s * per + t / N] * N + t % N;
                acc +=
                    w[t] * (double)kv_to_f32(dt, kc->pool + kvb__row_off(lo, 1, slot, h) + d * es);
            }
            const double want = acc / sum;
            const double got = kv_to_f32(KV_BF16, o + ((row * Hq + qi) * D + d) * 2);
            if (fabs(got - want) > 1e-2 * fabs(want) + 1e-3) {
                kvb_mismatch(bench, name,
                             "s %lld query %lld head %lld d %lld: %.6g, reference %.6g",
                             (long long)s, (long long)i, (long long)qi, (long long)d, got, want);
                free(w);
                return -1;
            }
        }
    }
    free(w);
    return 0;
}

/* kernel.prefill_attn: the multi-token kernel (kv_attn_prefill) over S
 * sequences of len cached tokens whose last ql are the queries (chunked
 * prefill's tail, speculative verification), Hq 32 over H 8; tokens of K/V
 * per second vs reading the same K/V once at memcpy speed (one thread's,
 * the goal's baseline, and kv_threads() threads' memcpy), alternated. */
static void kvb__prefill_attn(struct kvb__kc *kc, int64_t S, int64_t len, int64_t ql)
{
    const char *bench = "kernel.prefill_attn";
    const int64_t Hq = 32, per = len / N, T = S * ql;
    const int runs = kvb_runs() < 5 ? kvb_runs() : 5;
    const size_t qb = (size_t)(T * Hq * D) * 2;
    char name[160];
    snprintf(name, sizeof(name), "%s/%s/N16/Hq32/H8/D128/%lldx%lld/q%lld/t%d",
             kvb__order_name(kc->order), kv_dtype_name(kc->dtype), (long long)S, (long long)len,
             (long long)ql, kv_threads());
    if (!kvb_selected(bench, name))
        return;
    if (kvb__kc_need(kc) != 0) {
        kvb_mismatch(bench, name, "cannot build the cache");
        return;
    }
    if (S * per > kc->blocks) {
        kvb_mismatch(bench, name, "the pool has %lld blocks, the case needs %lld",
                     (long long)kc->blocks, (long long)(S * per));
        return;
    }
    kvb_progress(bench, name);
    const size_t kvb = (size_t)(S * len * H * D) * kc->c.layout.elem_bytes * 2;
    char *q = kvb_alloc(qb), *o = kvb_alloc(qb), *scratch = kvb_alloc(kvb);
    int32_t *indptr = malloc((size_t)(S + 1) * sizeof(int32_t));
    int32_t *qo = malloc((size_t)(S + 1) * sizeof(int32_t));
    int32_t *last = malloc((size_t)S * sizeof(int32_t));
    double tc[256], tm[256], tt[256];
    if (!indptr || !last || !qo)
        goto out;
    kvb__fill_bf16(q, qb, 7);
    memset(o, 0, qb);
    memset(scratch, 0, kvb);
    for (int64_t s = 0; s <= S; s++) {
        indptr[s] = (int32_t)(s * per);
        qo[s] = (int32_t)(s * ql);
    }
    for (int64_t s = 0; s < S; s++)
        last[s] = (int32_t)N;
    struct kv_pages pg = {.format = KV_PAGES_CSR,
                          .n_seqs = (uint32_t)S,
                          .page_ratio = 1,
                          .indptr = indptr,
                          .indices = kc->perm,
                          .last_page_len = last};
    struct kv_view vq, vo;
    const int64_t shape[3] = {T, Hq, D};
    kv_status st;
    if ((st = kv_view_init(q, qb, KV_BF16, 3, shape, &vq)) != KV_OK ||
        (st = kv_view_init(o, qb, KV_BF16, 3, shape, &vo)) != KV_OK) {
        kvb__fail(bench, name, "views", st);
        goto out;
    }
    const float scale = 1.0f / sqrtf((float)D);
    for (int r = -1; r < runs; r++) {
        double t0 = kvb_now();
        st = kv_attn_prefill(kc->c, 0, &vq, qo, &pg, scale, NULL, &vo, NULL);
        double t1 = kvb_now();
        kvb_settle();
        const double t1b = kvb_now();
        memcpy(scratch, kc->pool, kvb);
        double t2 = kvb_now();
        kvb_memcpy_threads(scratch, kc->pool, kvb, kv_threads());
        double t3 = kvb_now();
        if (st != KV_OK) {
            kvb__fail(bench, name, "kv_attn_prefill", st);
            goto out;
        }
        if (r >= 0)
            tc[r] = t1 - t0, tm[r] = t2 - t1b, tt[r] = t3 - t2;
    }
    if (kvb__prefill_check(bench, name, kc, S, len, ql, q, o, scale) != 0)
        goto out;
    kvb_emit_ops(bench, name, (uint64_t)(S * len), kvb_median(tc, runs), "memcpy",
                 kvb_median(tm, runs), runs);
    /* and against a memcpy on as many threads as the kernel (the goal's
     * baseline is the one-thread memcpy above; this line shows how the
     * kernel scales against memory on a many-core host) */
    kvb_emit_ops(bench, name, (uint64_t)(S * len), kvb_median(tc, runs), "memcpy_threads",
                 kvb_median(tt, runs), runs);
out:
    free(indptr);
    free(qo);
    free(last);
    kvb_free(q);
    kvb_free(o);
    kvb_free(scratch);
}

static void kvb__kernels(void)
{
    const int quick = kvb_quick();
    /* the kernels' thread count (default kv_threads()) */
    const long te = kvb_env_long("KVB_THREADS", 0, 1, 4096);
    if (te > 0 && kv_set_threads((int)te) != KV_OK)
        kvb_mismatch("kernel.*", "KVB_THREADS", "kv_set_threads(%ld) failed", te);
    static const kv_order orders[2] = {KV_ORDER_NHD, KV_ORDER_HND};
    for (int oi = 0; oi < 2; oi++) {
        /* 2 GiB + 64 MiB of K and V: the decode case reads 2 GiB of it */
        const int64_t blocks = quick ? 1024 : 32768 + 1024;
        struct kvb__kc kc, k8;
        memset(&kc, 0, sizeof(kc));
        kc.order = orders[oi];
        kc.dtype = KV_BF16;
        kc.want_blocks = blocks;
        k8 = kc;
        k8.dtype = KV_FP8_E4M3;
        kvb__prefill_and_read(&kc, quick ? 16 : 256, quick ? 64 : 512);
        kvb__write_decode(&kc, quick ? 256 : 4096, quick ? 2 : 16);
        kvb__decode_attn(&kc, NULL, quick ? 16 : 256, quick ? 256 : 2048);
        kvb__decode_attn(&k8, &kc, quick ? 16 : 256, quick ? 256 : 2048);
        kvb__prefill_attn(&kc, quick ? 16 : 64, quick ? 256 : 2048, 4);
        kvb__prefill_attn(&kc, quick ? 16 : 64, quick ? 256 : 2048, 16);
        kvb__kc_fini(&k8);
        kvb__kc_fini(&kc);
    }
}

KVB_REGISTER("kernel", kvb__kernels)
