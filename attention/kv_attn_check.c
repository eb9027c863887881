/*
 * kv_attn_check.c - the one validator of each kernel, shared by the CPU and
 * the CUDA entry points (kv_attn_int.h): everything is checked, and the
 * tokens are grouped into runs, before anything is written.
 */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_attn_int.h"
#include "kv_mem.h"

#define KV__LIST 160

/* ---- the cache ---------------------------------------------------------------- */

static bool dtype_supported(kv_dtype dt)
{
    return dt == KV_F32 || dt == KV_F16 || dt == KV_BF16 || dt == KV_FP8_E4M3 || dt == KV_FP8_E5M2;
}

/* The entry points are named kv_attn_<kernel> (CPU) and kv_attn_<kernel>_cuda. */
/* a CUDA entry: kv_*_cuda, or kv_*_cuda_dev (device-resident indices) */
static bool fn_is_cuda(const char *fn)
{
    const size_t n = strlen(fn);
    return (n > 5 && strcmp(fn + n - 5, "_cuda") == 0) ||
           (n > 9 && strcmp(fn + n - 9, "_cuda_dev") == 0);
}

/* The cache, as every executor checks it (kv_paged_check), for the CPU
 * or the CUDA kernel named fn. */
static kv_status check_cache(const char *fn, const struct kv_paged_cache *c)
{
    const kv_status st = kv_paged_check(c, fn_is_cuda(fn));
    return st == KV_OK ? KV_OK : kv__error_wrap(st, "%s", fn);
}

/* ---- tensors ------------------------------------------------------------------- */

/* A tensor [T][H][D] (or [L][T][H][D] when layers > 0) of the cache's H and
 * D: valid, a supported dtype, resolved to byte strides. */
static kv_status check_tensor(const char *fn, const char *name, const struct kv_view *v,
                              int64_t layers, int64_t heads, int64_t dim, const char *heads_name,
                              struct kv__attn_tensor *t)
{
    char b1[KV__LIST];
    const int want_nd = layers > 0 ? 4 : 3;
    kv_status st = kv_view_check(v);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: %s", fn, name);
    if (!dtype_supported(v->dtype))
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: %s dtype %s is not one the kernels handle (f32, f16, bf16, "
                         "fp8_e4m3, fp8_e5m2)",
                         fn, name, kv_dtype_name(v->dtype));
    if (v->ndim != want_nd)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: %s has %d dims %s, expected %s", fn, name, v->ndim,
                         kv__fmt_list(b1, sizeof(b1), v->shape, v->ndim),
                         want_nd == 4 ? "[L][T][H][D] (every layer)" : "[T][H][D]");
    const int o = want_nd - 3;
    if ((layers > 0 && v->shape[0] != layers) || v->shape[o + 1] != heads || v->shape[o + 2] != dim)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: %s shape %s does not match the cache: expected %s%s = %" PRId64
                         " and D = %" PRId64 "%s",
                         fn, name, kv__fmt_list(b1, sizeof(b1), v->shape, v->ndim),
                         layers > 0 ? "L, " : "", heads_name, heads, dim,
                         layers > 0 ? " in [L][T][H][D]" : " in [T][H][D]");
    const int64_t es = (int64_t)kv_dtype_size(v->dtype);
    t->dtype = v->dtype;
    /* A stride of a dim of size <= 1 steps nowhere, and an empty view
     * addresses nothing: the view check bounds neither (a stride or an
     * offset near 2^63 overflowed the byte multiplies below), so both are
     * taken as 0 here; every other stride and the offset are within the
     * storage in bytes already (kv_view_check). */
    bool empty = false;
    for (int i = 0; i < v->ndim; i++)
        empty |= v->shape[i] == 0;
    const int64_t *sh = v->shape, *sd = v->strides;
    t->base = (char *)v->base + (empty ? 0 : v->offset * es);
    t->layer_stride = layers > 0 && sh[0] > 1 ? sd[0] * es : 0;
    t->token_stride = sh[o] > 1 ? sd[o] * es : 0;
    t->head_stride = sh[o + 1] > 1 ? sd[o + 1] * es : 0;
    t->dim_stride = sh[o + 2] > 1 ? sd[o + 2] * es : 0;
    t->n_tokens = v->shape[o];
    return KV_OK;
}

/* canonical / outer stride / generic (kv_attn.h) for a tensor side. */
static enum kv_attn_path path_of(const struct kv_view *v)
{
    if (kv_view_is_contiguous(v))
        return KV_ATTN_PATH_CANONICAL;
    if (v->shape[v->ndim - 1] <= 1 || v->strides[v->ndim - 1] == 1)
        return KV_ATTN_PATH_OUTER_STRIDE;
    return KV_ATTN_PATH_GENERIC;
}

static enum kv_attn_path worse(enum kv_attn_path a, enum kv_attn_path b)
{
    return a > b ? a : b;
}

/* A tensor must not reach into the cache's storage (a source read while the
 * cache is written, or an output written over the cache). */
static kv_status check_outside_cache(const char *fn, const char *name, const struct kv_view *v,
                                     const struct kv_paged_cache *c)
{
    int64_t lo, hi;
    kv_view_extent_bytes(v, &lo, &hi);
    if (hi <= lo)
        return KV_OK; /* empty */
    const uintptr_t a = (uintptr_t)v->base + (uintptr_t)lo, b = (uintptr_t)v->base + (uintptr_t)hi;
    const uintptr_t ca = (uintptr_t)c->base, cb = ca + c->storage_bytes;
    if (a < cb && ca < b)
        return kv__error(KV_ERR_OVERLAP,
                         "%s: %s (bytes [%p, %p)) overlaps the cache storage [%p, %p)", fn, name,
                         (void *)a, (void *)b, (void *)ca, (void *)cb);
    return KV_OK;
}

/* An output's elements must be distinct (no stride 0, no aliasing). */
static kv_status check_output(const char *fn, const char *name, const struct kv_view *v)
{
    char b1[KV__LIST], b2[KV__LIST];
    bool overlap = true;
    kv_status st = kv_view_has_internal_overlap(v, 0, &overlap);
    if (st == KV_OK && !overlap)
        return KV_OK;
    return kv__error(KV_ERR_OVERLAP,
                     "%s: %s elements %s (shape %s strides %s): an output must not write an "
                     "element twice",
                     fn, name, st == KV_OK ? "overlap each other" : "could not be proven distinct",
                     kv__fmt_list(b1, sizeof(b1), v->shape, v->ndim),
                     kv__fmt_list(b2, sizeof(b2), v->strides, v->ndim));
}

static kv_status check_disjoint(const char *fn, const char *an, const struct kv_view *a,
                                const char *bn, const struct kv_view *b)
{
    if (!kv_view_may_share(a, b))
        return KV_OK;
    bool shares = true;
    kv_status st = kv_view_shares(a, b, 0, &shares);
    if (st == KV_OK && !shares)
        return KV_OK;
    return kv__error(KV_ERR_OVERLAP, "%s: %s and %s %s memory", fn, an, bn,
                     st == KV_OK ? "share" : "could not be proven not to share");
}

/* After check_layer: the call's layers are job->layer0 .. + n_layers. */
kv_status kv__attn_scales_shape(const char *fn, const char *what, const float *k, const float *v,
                                uint32_t n, uint32_t layers, int64_t L, int64_t H, bool k_only)
{
    const uint32_t rows = layers ? layers : 1;
    if (rows != 1 && (int64_t)rows != L)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: %sscales for %" PRIu32 " layers: expected 0 or 1 (shared by every "
                         "layer) or %" PRId64 " (one row per layer)",
                         fn, what, layers, L);
    if (k_only && v)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: V scales given (v=%p) for a K-only (MLA) layout: it has no V plane; "
                         "pass v = NULL",
                         fn, (const void *)v);
    if (!k || (!v && !k_only))
        return kv__error(KV_ERR_NULL,
                         "%s: %sscales given with their %s NULL (k=%p v=%p): a K+V layout takes "
                         "both, a K-only one K alone",
                         fn, what, !k ? "K scales" : "V scales", (const void *)k, (const void *)v);
    if (n != 1 && (int64_t)n != H)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: %" PRIu32 " scales: expected 1 (per tensor) or %" PRId64
                         " (per KV head)",
                         fn, n, H);
    return KV_OK;
}

static kv_status check_scales(const char *fn, const struct kv_scales *s, int64_t heads,
                              int64_t layers, bool k_only, struct kv__attn_job *job)
{
    job->k_scale = job->v_scale = NULL;
    job->n_scales = 0;
    job->scale_layer_stride = 0;
    if (!s)
        return KV_OK;
    const uint32_t rows = s->layers ? s->layers : 1;
    kv_status st =
        kv__attn_scales_shape(fn, "", s->k, s->v, s->n, s->layers, layers, heads, k_only);
    if (st != KV_OK)
        return st;
    if ((st = kv__check_aligned(fn, "scales k", s->k, sizeof(float))) != KV_OK ||
        (st = kv__check_aligned(fn, "scales v", s->v, sizeof(float))) != KV_OK)
        return st;
    if (s->n > 1024)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: per-head scales for %" PRIu32 " heads (at most 1024)", fn, s->n);
    /* The rows this call reads, each value checked. */
    const uint32_t r0 = rows == 1 ? 0 : job->layer0, r1 = rows == 1 ? 1 : r0 + job->n_layers;
    for (uint32_t r = r0; r < r1; r++)
        for (uint32_t i = 0; i < s->n; i++)
            for (int kv = 0; kv < (k_only ? 1 : 2); kv++) {
                const float x = (kv ? s->v : s->k)[(size_t)r * s->n + i];
                if (isfinite(x) && x > 0.0f)
                    continue;
                return rows == 1 ? kv__error(KV_ERR_INVALID_ARG,
                                             "%s: %s scale %" PRIu32
                                             " is %g; scales must be finite and > 0",
                                             fn, kv ? "V" : "K", i, (double)x)
                                 : kv__error(KV_ERR_INVALID_ARG,
                                             "%s: %s scale %" PRIu32 " of layer %" PRIu32
                                             " is %g; scales must be finite and > 0",
                                             fn, kv ? "V" : "K", i, r, (double)x);
            }
    job->k_scale = s->k + (size_t)r0 * s->n;
    job->v_scale = s->v ? s->v + (size_t)r0 * s->n : NULL;
    job->n_scales = s->n;
    job->scale_layer_stride = rows == 1 ? 0 : (int64_t)s->n;
    return KV_OK;
}

/* Attention over an fp8 cache folds 2^8 into its K/V scales on its fast
 * paths (the e4m3 -> f16 route): a scale above 2^119 (about 6.6e35) would
 * overflow there to inf and make its rows NaN. Refused by name, whatever
 * path runs (the checked rows of check_scales, host scales only). */
static kv_status check_fp8_attn_scales(const char *fn, const struct kv_layout *lo,
                                       const struct kv__attn_job *job)
{
    if (!job->k_scale || (lo->dtype != KV_FP8_E4M3 && lo->dtype != KV_FP8_E5M2))
        return KV_OK;
    const float lim = 0x1p119f;
    const uint32_t rows = job->scale_layer_stride ? job->n_layers : 1;
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t i = 0; i < job->n_scales; i++)
            for (int kv = 0; kv < (job->v_scale ? 2 : 1); kv++) {
                const float x = (kv ? job->v_scale : job->k_scale)[r * job->n_scales + i];
                if (x > lim)
                    return kv__error(KV_ERR_INVALID_ARG,
                                     "%s: %s scale %" PRIu32 " is %g: attention over an fp8 "
                                     "cache takes scales up to 2^119 (%g)",
                                     fn, kv ? "V" : "K", i, (double)x, (double)lim);
            }
    return KV_OK;
}

/* The scale rows job reads (check_scales: host memory) against bytes
 * [a, b) a kernel writes: a scale the kernel overwrote mid-call would be
 * read back as another value, past the check that every scale is finite
 * and > 0. */
static kv_status check_scales_apart(const char *fn, const struct kv__attn_job *job,
                                    const char *name, uintptr_t a, uintptr_t b)
{
    if (!job->k_scale || a >= b)
        return KV_OK;
    const int64_t rows = job->scale_layer_stride ? (int64_t)job->n_layers : 1;
    const uintptr_t n = (uintptr_t)(rows * (int64_t)job->n_scales) * sizeof(float);
    for (int kv = 0; kv < 2; kv++) {
        const float *p = kv ? job->v_scale : job->k_scale;
        if (!p)
            continue;
        const uintptr_t sa = (uintptr_t)p, sb = sa + n;
        if (sa < b && a < sb)
            return kv__error(KV_ERR_OVERLAP,
                             "%s: %s (bytes [%p, %p)) overlaps the %s scales (bytes [%p, %p))", fn,
                             name, (void *)a, (void *)b, kv ? "V" : "K", (void *)sa, (void *)sb);
    }
    return KV_OK;
}

/* check_scales_apart for the bytes view v reaches. */
static kv_status check_scales_apart_view(const char *fn, const struct kv__attn_job *job,
                                         const char *name, const struct kv_view *v)
{
    if (!v)
        return KV_OK;
    int64_t lo = 0, hi = 0;
    kv_view_extent_bytes(v, &lo, &hi);
    return check_scales_apart(fn, job, name, (uintptr_t)v->base + (uintptr_t)lo,
                              (uintptr_t)v->base + (uintptr_t)hi);
}

/* The scales of an attention call (decode, prefill, MLA: k_only for the
 * latent plane): checked as any call's, within the fp8 limit, and apart
 * from out and lse (rows of q->shape[0] x hq). */
static kv_status check_attn_scales(const char *fn, const struct kv_scales *scales,
                                   const struct kv_layout *lo, bool k_only, const struct kv_view *q,
                                   const struct kv_view *out, int64_t hq, struct kv__attn_job *job)
{
    kv_status st;
    if ((st = check_scales(fn, scales, lo->num_heads, lo->num_layers, k_only, job)) != KV_OK ||
        (st = check_fp8_attn_scales(fn, lo, job)) != KV_OK ||
        (st = check_scales_apart_view(fn, job, "out", out)) != KV_OK)
        return st;
    if (!job->lse)
        return KV_OK;
    return check_scales_apart(fn, job, "lse", (uintptr_t)job->lse,
                              (uintptr_t)(job->lse + (q->shape[0] - 1) * job->lse_stride + hq));
}

static kv_status check_layer(const char *fn, int64_t layer, int64_t L, bool all_ok,
                             struct kv__attn_job *job)
{
    if (all_ok && layer == KV_ATTN_ALL_LAYERS) {
        job->layer0 = 0;
        job->n_layers = (uint32_t)L;
        return KV_OK;
    }
    if (layer < 0 || layer >= L)
        return kv__error(KV_ERR_INVALID_ARG, "%s: layer %" PRId64 " outside [0, %" PRId64 ")%s", fn,
                         layer, L, all_ok ? " (or KV_ATTN_ALL_LAYERS)" : "");
    job->layer0 = (uint32_t)layer;
    job->n_layers = 1;
    return KV_OK;
}

void kv__attn_job_layer(const struct kv__attn_job *j, uint32_t lrel, struct kv__attn_job *out)
{
    *out = *j;
    out->layer0 = j->layer0 + lrel;
    out->n_layers = 1;
    out->k.base = j->k.base ? j->k.base + (int64_t)lrel * j->k.layer_stride : NULL;
    out->v.base = j->v.base ? j->v.base + (int64_t)lrel * j->v.layer_stride : NULL;
    if (j->k_scale) {
        out->k_scale = j->k_scale + (int64_t)lrel * j->scale_layer_stride;
        out->v_scale = j->v_scale ? j->v_scale + (int64_t)lrel * j->scale_layer_stride : NULL;
    }
    out->scale_layer_stride = 0;
}

/* ---- runs ------------------------------------------------------------------------ */

static int cmp_run_slot(const void *a, const void *b)
{
    const struct kv__attn_run *x = a, *y = b;
    return (x->slot > y->slot) - (x->slot < y->slot);
}

/* Slot i of a mapping, int64 or int32, widened. */
static inline int64_t slot_at(struct kv__attn_slots slots, int64_t i)
{
    return slots.i32 ? (int64_t)((const int32_t *)slots.p)[i] : ((const int64_t *)slots.p)[i];
}

/* Group tokens 0..n_slots-1 into runs of consecutive slots within a block. */
static kv_status make_runs(const char *fn, const struct kv_layout *lo, struct kv__attn_slots slots,
                           int64_t n_slots, struct kv__attn_job *job)
{
    const int64_t N = lo->block_tokens, limit = lo->num_blocks * lo->block_tokens;
    struct kv__attn_run *runs = n_slots ? kv__mem_alloc((size_t)n_slots * sizeof(*runs)) : NULL;
    int64_t n = 0, max_run = 0;
    if (n_slots && !runs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRId64 " runs", fn, n_slots);
    for (int64_t i = 0; i < n_slots; i++) {
        const int64_t s = slot_at(slots, i);
        if (s == -1)
            continue;
        if (s < -1 || s >= limit) {
            kv__mem_free(runs);
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: slots[%" PRId64 "] = %" PRId64 " outside [-1, %" PRId64
                             ") (B %" PRId64 " x N %" PRId64 ")",
                             fn, i, s, limit, lo->num_blocks, N);
        }
        struct kv__attn_run *r = n ? &runs[n - 1] : NULL;
        if (r && r->token + r->n == i && r->slot + r->n == s && s / N == r->slot / N) {
            r->n++;
        } else {
            runs[n] = (struct kv__attn_run){.token = i, .slot = s, .n = 1};
            n++;
        }
        if (runs[n - 1].n > max_run)
            max_run = runs[n - 1].n;
    }
    /* a slot written twice would race (and its value depend on the order):
     * runs sorted by slot must not overlap */
    if (n > 1) {
        struct kv__attn_run *sorted = kv__mem_alloc((size_t)n * sizeof(*sorted));
        if (!sorted) {
            kv__mem_free(runs);
            return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRId64 " runs", fn, n);
        }
        memcpy(sorted, runs, (size_t)n * sizeof(*sorted));
        qsort(sorted, (size_t)n, sizeof(*sorted), cmp_run_slot);
        for (int64_t i = 1; i < n; i++) {
            const struct kv__attn_run *p = &sorted[i - 1], *q = &sorted[i];
            if (p->slot + p->n > q->slot) {
                const int64_t slot = q->slot, t1 = p->token + (slot - p->slot), t2 = q->token;
                kv__mem_free(sorted);
                kv__mem_free(runs);
                return kv__error(KV_ERR_OVERLAP,
                                 "%s: slot %" PRId64 " is written twice (tokens %" PRId64
                                 " and %" PRId64 ")",
                                 fn, slot, t1 < t2 ? t1 : t2, t1 < t2 ? t2 : t1);
            }
        }
        kv__mem_free(sorted);
    }
    job->runs = runs;
    job->n_runs = n;
    job->max_run = max_run;
    return KV_OK;
}

/* ---- pages -------------------------------------------------------------------------- */

static kv_status check_pages(const char *fn, const struct kv_layout *lo, const struct kv_pages *pg,
                             struct kv__attn_job *job)
{
    if (!pg)
        return kv__error(KV_ERR_NULL, "%s: pages is NULL", fn);
    const uint32_t r = pg->page_ratio ? pg->page_ratio : 1;
    if (lo->block_tokens % r != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: page_ratio %" PRIu32 " does not divide the block's %" PRId64
                         " tokens",
                         fn, r, lo->block_tokens);
    const int64_t pt = lo->block_tokens / r, n_ids = lo->num_blocks * r;
    const uint32_t S = pg->n_seqs;
    int64_t total_pages = 0;
    if (pt > (int64_t)UINT32_MAX) /* the kernels keep a page's tokens in 32 bits */
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: pages of %" PRId64 " tokens (block_tokens %" PRId64
                         " / page_ratio %" PRIu32 "): at most 2^32 - 1 (raise page_ratio)",
                         fn, pt, lo->block_tokens, r);

    if (pg->format == KV__PAGES_DEVICE) {
        /* device-resident CSR (kv_attn_decode_cuda_dev): the kernel reads
         * and checks the arrays; here only the scalars */
        job->n_seqs = S;
        job->page_tokens = (uint32_t)pt;
        job->page_ratio = r;
        return KV_OK;
    }

    if (pg->format == KV_PAGES_CSR) {
        if (S && (!pg->indptr || !pg->indices || !pg->last_page_len))
            return kv__error(KV_ERR_NULL,
                             "%s: CSR pages need indptr=%p indices=%p "
                             "last_page_len=%p",
                             fn, (const void *)pg->indptr, (const void *)pg->indices,
                             (const void *)pg->last_page_len);
        kv_status st;
        if ((st = kv__check_aligned(fn, "indptr", pg->indptr, sizeof(int32_t))) != KV_OK ||
            (st = kv__check_aligned(fn, "indices", pg->indices, sizeof(int32_t))) != KV_OK ||
            (st = kv__check_aligned(fn, "last_page_len", pg->last_page_len, sizeof(int32_t))) !=
                KV_OK)
            return st;
        if (S && pg->indptr[0] != 0)
            return kv__error(KV_ERR_CORRUPT, "%s: indptr[0] = %" PRId32 ", must be 0", fn,
                             pg->indptr[0]);
        for (uint32_t s = 0; s < S; s++)
            if (pg->indptr[s + 1] < pg->indptr[s])
                return kv__error(KV_ERR_CORRUPT,
                                 "%s: indptr decreases at sequence %" PRIu32 " (%" PRId32
                                 " -> %" PRId32 ")",
                                 fn, s, pg->indptr[s], pg->indptr[s + 1]);
        total_pages = S ? pg->indptr[S] : 0;
    } else if (pg->format == KV_PAGES_BLOCK_TABLE) {
        if (S && (!pg->block_table || !pg->seq_lens))
            return kv__error(KV_ERR_NULL, "%s: block-table pages need block_table=%p seq_lens=%p",
                             fn, (const void *)pg->block_table, (const void *)pg->seq_lens);
        kv_status st;
        if ((st = kv__check_aligned(fn, "block_table", pg->block_table, sizeof(int32_t))) !=
                KV_OK ||
            (st = kv__check_aligned(fn, "seq_lens", pg->seq_lens, sizeof(int64_t))) != KV_OK)
            return st;
        for (uint32_t s = 0; s < S; s++) {
            if (pg->seq_lens[s] < 0)
                return kv__error(KV_ERR_CORRUPT, "%s: seq_lens[%" PRIu32 "] = %" PRId64 " < 0", fn,
                                 s, pg->seq_lens[s]);
            /* no overflow for lengths near 2^63 (was (len + pt - 1) / pt) */
            const int64_t np = pg->seq_lens[s] / pt + (pg->seq_lens[s] % pt != 0);
            if (np > (int64_t)pg->block_table_cols)
                return kv__error(KV_ERR_OUT_OF_BOUNDS,
                                 "%s: sequence %" PRIu32 " has %" PRId64 " tokens = %" PRId64
                                 " pages of %" PRId64 ", but the block table has %" PRIu32
                                 " columns",
                                 fn, s, pg->seq_lens[s], np, pt, pg->block_table_cols);
            total_pages += np;
        }
    } else {
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: pages format %d is neither KV_PAGES_CSR (1) nor "
                         "KV_PAGES_BLOCK_TABLE (2)",
                         fn, (int)pg->format);
    }

    job->page_ids = kv__mem_alloc((size_t)(total_pages ? total_pages : 1) * sizeof(int32_t));
    job->page_start = kv__mem_alloc(((size_t)S + 1) * sizeof(int64_t));
    job->seq_tokens = kv__mem_alloc(((size_t)S + 1) * sizeof(int64_t));
    if (!job->page_ids || !job->page_start || !job->seq_tokens)
        return kv__error(KV_ERR_NO_MEMORY, "%s: page index of %" PRId64 " pages", fn, total_pages);
    int64_t k = 0;
    job->page_start[0] = 0;
    for (uint32_t s = 0; s < S; s++) {
        int64_t np, tokens;
        const int32_t *ids;
        if (pg->format == KV_PAGES_CSR) {
            np = pg->indptr[s + 1] - pg->indptr[s];
            ids = pg->indices + pg->indptr[s];
            const int32_t last = pg->last_page_len[s];
            /* FlashInfer's rule: 1..N/r tokens in the last page of a sequence
             * with pages; an empty sequence (no pages) has last_page_len 0 */
            if (np == 0 && last != 0)
                return kv__error(KV_ERR_CORRUPT,
                                 "%s: last_page_len[%" PRIu32 "] = %" PRId32
                                 " but sequence %" PRIu32 " has no pages (indptr[%" PRIu32
                                 "] = indptr[%" PRIu32 "] = %" PRId32
                                 "): an empty sequence needs last_page_len 0",
                                 fn, s, last, s, s, s + 1, pg->indptr[s]);
            if (np > 0 && (last < 1 || last > pt))
                return kv__error(
                    KV_ERR_CORRUPT,
                    "%s: last_page_len[%" PRIu32 "] = %" PRId32 " outside 1..%" PRId64
                    " (N/r) for sequence %" PRIu32 " of %" PRId64 " pages (indptr[%" PRIu32
                    "] = %" PRId32 ", indptr[%" PRIu32 "] = %" PRId32 ")",
                    fn, s, last, pt, s, np, s, pg->indptr[s], s + 1, pg->indptr[s + 1]);
            tokens = np ? (np - 1) * pt + last : 0;
        } else {
            tokens = pg->seq_lens[s];
            np = tokens / pt + (tokens % pt != 0);
            ids = pg->block_table + (size_t)s * pg->block_table_cols;
        }
        for (int64_t j = 0; j < np; j++) {
            if (ids[j] < 0 || ids[j] >= n_ids)
                return kv__error(KV_ERR_OUT_OF_BOUNDS,
                                 "%s: sequence %" PRIu32 " page %" PRId64 " is %" PRId32
                                 ", outside [0, %" PRId64 ") (B %" PRId64 " x r %" PRIu32 ")",
                                 fn, s, j, ids[j], n_ids, lo->num_blocks, r);
            job->page_ids[k++] = ids[j];
        }
        job->page_start[s + 1] = k;
        job->seq_tokens[s] = tokens;
    }
    job->n_seqs = S;
    job->page_tokens = (uint32_t)pt;
    job->page_ratio = r;
    return KV_OK;
}

/* Runs of a read: each page of each sequence, tokens numbered sequence after
 * sequence. *total receives the token count. */
static kv_status runs_from_pages(const char *fn, struct kv__attn_job *job, int64_t *total)
{
    const int64_t n_pages = job->page_start[job->n_seqs], pt = job->page_tokens;
    job->runs = kv__mem_alloc((size_t)(n_pages ? n_pages : 1) * sizeof(*job->runs));
    if (!job->runs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRId64 " runs", fn, n_pages);
    int64_t t = 0, n = 0;
    job->max_run = 0;
    for (uint32_t s = 0; s < job->n_seqs; s++) {
        int64_t left = job->seq_tokens[s];
        for (int64_t j = job->page_start[s]; j < job->page_start[s + 1]; j++) {
            const int64_t m = left < pt ? left : pt;
            job->runs[n] = (struct kv__attn_run){
                .token = t, .slot = kv_attn_page_slot(job->page_ids[j], pt, 0), .n = m};
            n++;
            if (m > job->max_run)
                job->max_run = m;
            t += m;
            left -= m;
        }
    }
    job->n_runs = n;
    *total = t;
    return KV_OK;
}

/* ---- the validators ------------------------------------------------------------------ */

void kv__attn_job_free(struct kv__attn_job *job)
{
    if (!job)
        return;
    kv__mem_free(job->runs);
    kv__mem_free(job->page_ids);
    kv__mem_free(job->page_start);
    kv__mem_free(job->seq_tokens);
    kv__mem_free(job->q_start);
    job->q_start = NULL;
    job->runs = NULL;
    job->page_ids = NULL;
    job->page_start = NULL;
    job->seq_tokens = NULL;
}

kv_status kv__attn_write_check(const char *fn, const struct kv_paged_cache *cache, int32_t layer,
                               const struct kv_view *k, const struct kv_view *v,
                               struct kv__attn_slots slots, int64_t n_slots,
                               const struct kv_scales *scales, struct kv__attn_job *job)
{
    kv_status st;
    memset(job, 0, sizeof(*job));
    job->fn = fn;
    job->kernel = KV_ATTN_WRITE;
    if (!k || (!v && !(cache && cache->layout.k_only)))
        return kv__error(KV_ERR_NULL, "%s: k=%p v=%p", fn, (const void *)k, (const void *)v);
    if ((st = check_cache(fn, cache)) != KV_OK)
        return st;
    const struct kv_layout *lo = &cache->layout;
    if (lo->k_only && v)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: v given (%p) for a K-only (MLA) layout: it has no V plane; pass "
                         "v = NULL",
                         fn, (const void *)v);
    job->cache = *cache;
    if ((st = check_layer(fn, layer, lo->num_layers, true, job)) != KV_OK)
        return st;
    const int64_t L = layer == KV_ATTN_ALL_LAYERS ? lo->num_layers : 0;
    if ((st = check_tensor(fn, "k", k, L, lo->num_heads, lo->head_dim, "H", &job->k)) != KV_OK ||
        (v &&
         (st = check_tensor(fn, "v", v, L, lo->num_heads, lo->head_dim, "H", &job->v)) != KV_OK))
        return st;
    if (v && job->k.n_tokens != job->v.n_tokens)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: k has %" PRId64 " tokens, v %" PRId64, fn,
                         job->k.n_tokens, job->v.n_tokens);
    if (n_slots < 0 || n_slots > job->k.n_tokens)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: n_slots %" PRId64 " outside [0, T = %" PRId64 "]",
                         fn, n_slots, job->k.n_tokens);
    if (n_slots > 0 && !slots.p)
        return kv__error(KV_ERR_NULL, "%s: slots is NULL with n_slots %" PRId64, fn, n_slots);
    if (n_slots > 0 &&
        (st = kv__check_aligned(fn, "slots", slots.p,
                                slots.i32 ? sizeof(int32_t) : sizeof(int64_t))) != KV_OK)
        return st;
    if ((st = check_outside_cache(fn, "k", k, cache)) != KV_OK ||
        (v && (st = check_outside_cache(fn, "v", v, cache)) != KV_OK))
        return st;
    if ((st = check_scales(fn, scales, lo->num_heads, lo->num_layers, lo->k_only, job)) != KV_OK ||
        (st = check_scales_apart(fn, job, "the cache storage", (uintptr_t)cache->base,
                                 (uintptr_t)cache->base + cache->storage_bytes)) != KV_OK)
        return st;
    if ((st = make_runs(fn, lo, slots, n_slots, job)) != KV_OK)
        return st;
    job->has_k = true;
    job->has_v = v != NULL;
    job->path = v ? worse(path_of(k), path_of(v)) : path_of(k);
    return KV_OK;
}

kv_status kv__attn_read_check(const char *fn, const struct kv_paged_cache *cache, int32_t layer,
                              const struct kv_pages *pages, const struct kv_view *k_out,
                              const struct kv_view *v_out, const struct kv_scales *scales,
                              struct kv__attn_job *job)
{
    kv_status st;
    int64_t total = 0;
    memset(job, 0, sizeof(*job));
    job->fn = fn;
    job->kernel = KV_ATTN_READ;
    if (!k_out && !v_out)
        return kv__error(KV_ERR_NULL, "%s: k_out and v_out are both NULL", fn);
    if ((st = check_cache(fn, cache)) != KV_OK)
        return st;
    const struct kv_layout *lo = &cache->layout;
    job->cache = *cache;
    if (lo->k_only && v_out)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: v_out given (%p) for a K-only (MLA) layout: it has no V plane; pass "
                         "v_out = NULL",
                         fn, (const void *)v_out);
    if ((st = check_layer(fn, layer, lo->num_layers, true, job)) != KV_OK)
        return st;
    const int64_t L = layer == KV_ATTN_ALL_LAYERS ? lo->num_layers : 0;
    job->path = KV_ATTN_PATH_CANONICAL;
    if (k_out) {
        if ((st = check_tensor(fn, "k_out", k_out, L, lo->num_heads, lo->head_dim, "H", &job->k)) !=
                KV_OK ||
            (st = check_output(fn, "k_out", k_out)) != KV_OK ||
            (st = check_outside_cache(fn, "k_out", k_out, cache)) != KV_OK)
            return st;
        job->has_k = true;
        job->path = worse(job->path, path_of(k_out));
    }
    if (v_out) {
        if ((st = check_tensor(fn, "v_out", v_out, L, lo->num_heads, lo->head_dim, "H", &job->v)) !=
                KV_OK ||
            (st = check_output(fn, "v_out", v_out)) != KV_OK ||
            (st = check_outside_cache(fn, "v_out", v_out, cache)) != KV_OK)
            return st;
        job->has_v = true;
        job->path = worse(job->path, path_of(v_out));
    }
    if (k_out && v_out && (st = check_disjoint(fn, "k_out", k_out, "v_out", v_out)) != KV_OK)
        return st;
    if ((st = check_scales(fn, scales, lo->num_heads, lo->num_layers, lo->k_only, job)) != KV_OK ||
        (st = check_scales_apart_view(fn, job, "k_out", k_out)) != KV_OK ||
        (st = check_scales_apart_view(fn, job, "v_out", v_out)) != KV_OK)
        return st;
    if (pages && pages->format == KV__PAGES_DEVICE) /* kv_attn_read_cuda_dev: no runs, no T */
        return check_pages(fn, lo, pages, job);
    if ((st = check_pages(fn, lo, pages, job)) != KV_OK ||
        (st = runs_from_pages(fn, job, &total)) != KV_OK) {
        kv__attn_job_free(job);
        return st;
    }
    for (int kv = 0; kv < 2; kv++) {
        const struct kv__attn_tensor *t = kv ? &job->v : &job->k;
        if ((kv ? job->has_v : job->has_k) && t->n_tokens != total) {
            kv__attn_job_free(job);
            return kv__error(KV_ERR_BAD_SHAPE,
                             "%s: %s has %" PRId64 " tokens but the pages hold %" PRId64, fn,
                             kv ? "v_out" : "k_out", t->n_tokens, total);
        }
    }
    return KV_OK;
}

/* A block a copy of a batch touches: its id, the copy's index, read (0) or
 * written (1). (Packed into one uint64 as id << 33 | index << 1 | w, an id
 * of 2^31 or more lost its top bit: valid batches refused as overlapping.) */
struct copy_key {
    uint32_t id, i, w;
};

static int cmp_key(const void *a, const void *b)
{
    const struct copy_key *x = a, *y = b;
    if (x->id != y->id)
        return x->id < y->id ? -1 : 1;
    if (x->i != y->i)
        return x->i < y->i ? -1 : 1;
    return (x->w > y->w) - (x->w < y->w);
}

/* The block format two caches of a copy must share (what
 * block_format_fingerprint covers): the first field that differs, or NULL. */
static const char *block_format_diff(const struct kv_layout *a, const struct kv_layout *b,
                                     int64_t *va, int64_t *vb)
{
    static const char *const names[] = {"L",     "N",     "H",         "D",
                                        "dtype", "order", "kv_packed", "k_only"};
    const int64_t x[] = {a->num_layers, a->block_tokens, a->num_heads, a->head_dim,
                         a->dtype,      a->order,        a->kv_packed, a->k_only};
    const int64_t y[] = {b->num_layers, b->block_tokens, b->num_heads, b->head_dim,
                         b->dtype,      b->order,        b->kv_packed, b->k_only};
    for (size_t i = 0; i < sizeof(x) / sizeof(x[0]); i++)
        if (x[i] != y[i]) {
            *va = x[i], *vb = y[i];
            return names[i];
        }
    return NULL;
}

/* The layers and planes of a copy (opts NULL: every layer, K and V). */
static kv_status check_copy_opts(const char *fn, const struct kv_copy_blocks_opts *opts, int64_t L,
                                 bool k_only, struct kv__attn_job *job)
{
    const uint32_t all = k_only ? KV_ATTN_PLANE_K : KV_ATTN_PLANES_KV; /* planes 0 */
    job->layer0 = 0;
    job->n_layers = (uint32_t)L;
    job->planes = all;
    if (!opts)
        return KV_OK;
    kv_status st =
        kv__check_struct_size(fn, "kv_copy_blocks_opts", opts->struct_size, sizeof(*opts));
    if (st != KV_OK)
        return st;
    const int64_t l0 = opts->layer0, n = opts->n_layers ? (int64_t)opts->n_layers : L - l0;
    if (l0 >= L || n < 1 || l0 + n > L)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: layers [%" PRIu32 ", %" PRId64 ") (layer0 %" PRIu32
                         ", n_layers %" PRIu32 ") outside [0, L = %" PRId64 ")",
                         fn, opts->layer0, l0 + n, opts->layer0, opts->n_layers, L);
    if (opts->planes > KV_ATTN_PLANES_KV)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: planes %" PRIu32 " is not KV_ATTN_PLANE_K (1), KV_ATTN_PLANE_V (2) "
                         "or both (3, or 0)",
                         fn, opts->planes);
    if (k_only && (opts->planes & KV_ATTN_PLANE_V))
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: planes %" PRIu32 " names V, but the caches are K-only (MLA): they "
                         "have no V plane (KV_ATTN_PLANE_K, or 0)",
                         fn, opts->planes);
    job->layer0 = opts->layer0;
    job->n_layers = (uint32_t)n;
    job->planes = opts->planes ? opts->planes : all;
    return KV_OK;
}

/* Sorted keys (id << 33 | index << 1 | is_dst) of n copies: a dst next to
 * the same id is a conflict (two_caches: only two dsts, src and dst ids
 * naming different caches). */
static kv_status check_copy_conflicts(const char *fn, const struct kv_block_copy *copies,
                                      uint32_t n_copies, bool two_caches)
{
    if (n_copies < 2)
        return KV_OK;
    struct copy_key *keys = kv__mem_alloc((size_t)n_copies * 2 * sizeof(*keys));
    if (!keys)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRIu32 " copies", fn, n_copies);
    size_t n = 0;
    for (uint32_t i = 0; i < n_copies; i++) {
        if (!two_caches)
            keys[n++] = (struct copy_key){copies[i].src, i, 0};
        keys[n++] = (struct copy_key){copies[i].dst, i, 1};
    }
    qsort(keys, n, sizeof(*keys), cmp_key);
    for (size_t j = 1; j < n; j++) {
        const struct copy_key a = keys[j - 1], b = keys[j];
        if (a.id != b.id || !(a.w | b.w))
            continue; /* different blocks, or two reads of one block */
        const uint32_t id = a.id, ia = a.i, ib = b.i;
        kv__mem_free(keys);
        return two_caches
                   ? kv__error(KV_ERR_OVERLAP,
                               "%s: dst block %" PRIu32 " is written by copy %" PRIu32
                               " and by copy %" PRIu32 " of the same batch",
                               fn, id, ia, ib)
                   : kv__error(KV_ERR_OVERLAP,
                               "%s: block %" PRIu32 " is %s by copy %" PRIu32
                               " and %s by copy %" PRIu32 " of the same batch",
                               fn, id, a.w ? "written" : "read", ia, b.w ? "written" : "read", ib);
    }
    kv__mem_free(keys);
    return KV_OK;
}

kv_status kv__attn_copy_check(const char *fn, const struct kv_paged_cache *dst,
                              const struct kv_paged_cache *src, const struct kv_block_copy *copies,
                              uint32_t n_copies, const struct kv_copy_blocks_opts *opts,
                              struct kv__attn_job *job)
{
    kv_status st;
    memset(job, 0, sizeof(*job));
    job->fn = fn;
    job->kernel = KV_ATTN_COPY;
    job->path = KV_ATTN_PATH_CANONICAL;
    if (n_copies && !copies)
        return kv__error(KV_ERR_NULL, "%s: copies is NULL with n_copies %" PRIu32, fn, n_copies);
    if ((st = kv__check_aligned(fn, "copies", copies, _Alignof(struct kv_block_copy))) != KV_OK)
        return st;
    const bool one = src == NULL;
    if (one) {
        if ((st = check_cache(fn, dst)) != KV_OK)
            return st;
        src = dst;
    } else {
        const bool cuda = fn_is_cuda(fn);
        if ((st = kv_paged_check(dst, cuda)) != KV_OK)
            return kv__error_wrap(st, "%s: dst", fn);
        if ((st = kv_paged_check(src, cuda)) != KV_OK)
            return kv__error_wrap(st, "%s: src", fn);
    }
    const struct kv_layout *dl = &dst->layout, *sl = &src->layout;
    int64_t va = 0, vb = 0;
    const char *field = block_format_diff(sl, dl, &va, &vb);
    if (field) {
        char a[24], b[24];
        const bool dt = strcmp(field, "dtype") == 0, order = strcmp(field, "order") == 0;
        snprintf(a, sizeof(a), "%s",
                 dt      ? kv_dtype_name(sl->dtype)
                 : order ? kv_order_name(sl->order)
                         : "");
        snprintf(b, sizeof(b), "%s",
                 dt      ? kv_dtype_name(dl->dtype)
                 : order ? kv_order_name(dl->order)
                         : "");
        if (!dt && !order) {
            snprintf(a, sizeof(a), "%" PRId64, va);
            snprintf(b, sizeof(b), "%" PRId64, vb);
        }
        return kv__error(KV_ERR_MISMATCH,
                         "%s: src and dst hold different block formats: %s %s (src) vs %s (dst) "
                         "(src fingerprint 0x%016" PRIx64 ", dst 0x%016" PRIx64
                         "); a block copy moves bytes, it does not convert",
                         fn, field, a, b, sl->fingerprint, dl->fingerprint);
    }
    /* one cache: the same base and layout (whatever the caller's two
     * structs); otherwise two storages that must not overlap */
    const bool same = one || (src->base == dst->base && sl->fingerprint == dl->fingerprint);
    if (!same) {
        const uintptr_t sa = (uintptr_t)src->base, sb = sa + src->storage_bytes;
        const uintptr_t da = (uintptr_t)dst->base, db = da + dst->storage_bytes;
        if (sa < db && da < sb)
            return kv__error(KV_ERR_OVERLAP,
                             "%s: src storage [%p, %p) and dst storage [%p, %p) overlap "
                             "(not one cache: their bases or layouts differ)",
                             fn, (void *)sa, (void *)sb, (void *)da, (void *)db);
    }
    if ((st = check_copy_opts(fn, opts, dl->num_layers, dl->k_only, job)) != KV_OK)
        return st;
    for (uint32_t i = 0; i < n_copies; i++) {
        if (same) {
            if ((int64_t)copies[i].src >= dl->num_blocks ||
                (int64_t)copies[i].dst >= dl->num_blocks)
                return kv__error(KV_ERR_OUT_OF_BOUNDS,
                                 "%s: copy %" PRIu32 " {src %" PRIu32 ", dst %" PRIu32
                                 "} names a block >= B = %" PRId64,
                                 fn, i, copies[i].src, copies[i].dst, dl->num_blocks);
            if (copies[i].src == copies[i].dst)
                return kv__error(KV_ERR_OVERLAP,
                                 "%s: copy %" PRIu32 " copies block %" PRIu32 " onto itself", fn, i,
                                 copies[i].src);
        } else if ((int64_t)copies[i].src >= sl->num_blocks ||
                   (int64_t)copies[i].dst >= dl->num_blocks) {
            const bool s_bad = (int64_t)copies[i].src >= sl->num_blocks;
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "%s: copy %" PRIu32 " {src %" PRIu32 ", dst %" PRIu32
                             "}: %s block %" PRIu32 " >= the %s cache's B = %" PRId64,
                             fn, i, copies[i].src, copies[i].dst, s_bad ? "src" : "dst",
                             s_bad ? copies[i].src : copies[i].dst, s_bad ? "src" : "dst",
                             s_bad ? sl->num_blocks : dl->num_blocks);
        }
    }
    /* the copies run at once: no block may be written by two copies, nor
     * (one cache) written by one and read by another */
    if ((st = check_copy_conflicts(fn, copies, n_copies, !same)) != KV_OK)
        return st;
    job->cache = *dst;
    job->src = *src;
    job->copies = copies;
    job->n_copies = n_copies;
    return KV_OK;
}

bool kv__attn_copy_is_whole(const struct kv__attn_job *job)
{
    return job->cache.base == job->src.base &&
           job->cache.layout.fingerprint == job->src.layout.fingerprint && job->layer0 == 0 &&
           (int64_t)job->n_layers == job->cache.layout.num_layers &&
           job->planes == (job->cache.layout.k_only ? KV_ATTN_PLANE_K : KV_ATTN_PLANES_KV);
}

uint64_t kv__attn_copy_bytes(const struct kv__attn_job *job)
{
    const struct kv_layout *lo = &job->cache.layout;
    const uint64_t per_plane =
        lo->kv_packed ? (uint64_t)lo->block_bytes / 2 : (uint64_t)lo->block_bytes;
    const uint64_t planes = job->planes == KV_ATTN_PLANES_KV ? 2 : 1;
    return (uint64_t)job->n_copies * job->n_layers * planes * per_plane;
}

/* The fields of kv_attn_opts (NULL: all off) into job; lse checked
 * against q, out (rows x Hq floats at lse_stride) and the cache. */
static kv_status check_attn_opts(const char *fn, const struct kv_attn_opts *o, int64_t rows,
                                 int64_t hq, const struct kv_view *q, const struct kv_view *out,
                                 const struct kv_paged_cache *cache, struct kv__attn_job *job)
{
    job->window_left = KV_ATTN_WINDOW_OFF;
    if (!o)
        return KV_OK;
    kv_status st = kv__check_struct_size(fn, "kv_attn_opts", o->struct_size, sizeof(*o));
    if (st != KV_OK)
        return st;
    if (o->window_left < KV_ATTN_WINDOW_OFF)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: window_left %" PRId32 " is negative and not KV_ATTN_WINDOW_OFF (-1)",
                         fn, o->window_left);
    /* the kernels divide by it (x / cap, or x * (1 / cap)): a cap whose
     * reciprocal is not a finite float (below about 2.9e-39) is refused, not
     * turned into 0 x inf = NaN for a zero score */
    if (!(o->logit_soft_cap >= 0.0f) || !isfinite(o->logit_soft_cap) ||
        (o->logit_soft_cap > 0.0f && !isfinite(1.0f / o->logit_soft_cap)))
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: logit_soft_cap %g is not 0 (off) or a finite value > 0 whose "
                         "reciprocal is finite (>= %g)",
                         fn, (double)o->logit_soft_cap, (double)(1.0f / FLT_MAX));
    job->window_left = o->window_left;
    job->soft_cap = o->logit_soft_cap;
    if (!o->lse)
        return KV_OK;
    const int64_t ls = o->lse_stride ? o->lse_stride : hq;
    if (o->lse_stride < 0 || ls < hq)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: lse_stride %" PRId64 " is below the %" PRId64
                         " query heads of an lse row (0 means Hq)",
                         fn, o->lse_stride, hq);
    const kv_status al = kv__check_aligned(fn, "lse", o->lse, sizeof(float));
    if (al != KV_OK)
        return al;
    if (rows > 0) {
        /* its bytes, checked not to wrap (a huge lse_stride wrapped past the
         * overlap tests below, and a row landed in the cache) */
        int64_t span = 0;
        if (!kv__mul_i64(rows - 1, ls, &span) || !kv__add_i64(span, hq, &span) ||
            !kv__mul_i64(span, (int64_t)sizeof(float), &span) ||
            (uint64_t)span > UINTPTR_MAX - (uintptr_t)o->lse)
            return kv__error(KV_ERR_OVERFLOW,
                             "%s: lse of %" PRId64 " rows at lse_stride %" PRId64
                             " floats exceeds the address space from %p",
                             fn, rows, ls, (void *)o->lse);
        const uintptr_t a = (uintptr_t)o->lse, b = a + (uintptr_t)span;
        const struct kv_view *vs[2] = {out, q};
        static const char *const names[2] = {"out", "q"};
        for (int i = 0; i < 2; i++) {
            int64_t lo, hi;
            kv_view_extent_bytes(vs[i], &lo, &hi);
            const uintptr_t va = (uintptr_t)vs[i]->base + (uintptr_t)lo,
                            vb = (uintptr_t)vs[i]->base + (uintptr_t)hi;
            if (hi > lo && a < vb && va < b)
                return kv__error(KV_ERR_OVERLAP,
                                 "%s: lse (bytes [%p, %p)) overlaps %s (bytes [%p, %p))", fn,
                                 (void *)a, (void *)b, names[i], (void *)va, (void *)vb);
        }
        const uintptr_t ca = (uintptr_t)cache->base, cb = ca + cache->storage_bytes;
        if (a < cb && ca < b)
            return kv__error(KV_ERR_OVERLAP,
                             "%s: lse (bytes [%p, %p)) overlaps the cache storage [%p, %p)", fn,
                             (void *)a, (void *)b, (void *)ca, (void *)cb);
    }
    job->lse = o->lse;
    job->lse_stride = ls;
    return KV_OK;
}

/* qo_indptr of a prefill against the pages' sequences (job->seq_tokens)
 * and q's T rows -> job->q_start. */
static kv_status check_qo_indptr(const char *fn, const int32_t *qo, int64_t T,
                                 struct kv__attn_job *job)
{
    const uint32_t S = job->n_seqs;
    const kv_status st = kv__check_aligned(fn, "qo_indptr", qo, sizeof(int32_t));
    if (st != KV_OK)
        return st;
    if (qo[0] != 0)
        return kv__error(KV_ERR_CORRUPT, "%s: qo_indptr[0] is %" PRId32 ", not 0", fn, qo[0]);
    for (uint32_t s = 0; s < S; s++) {
        if (qo[s + 1] < qo[s])
            return kv__error(KV_ERR_CORRUPT,
                             "%s: qo_indptr decreases at sequence %" PRIu32 ": qo_indptr[%" PRIu32
                             "] = %" PRId32 " > qo_indptr[%" PRIu32 "] = %" PRId32,
                             fn, s, s, qo[s], s + 1, qo[s + 1]);
        const int64_t ql = (int64_t)qo[s + 1] - qo[s];
        if (ql > job->seq_tokens[s])
            return kv__error(KV_ERR_BAD_SHAPE,
                             "%s: sequence %" PRIu32 " has q_len %" PRId64 " (qo_indptr[%" PRIu32
                             "] = %" PRId32 ", qo_indptr[%" PRIu32 "] = %" PRId32
                             ") above its %" PRId64 " tokens in pages (write its K/V first)",
                             fn, s, ql, s, qo[s], s + 1, qo[s + 1], job->seq_tokens[s]);
    }
    if ((int64_t)qo[S] != T)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: qo_indptr[%" PRIu32 "] = %" PRId32 " but q and out have %" PRId64
                         " rows",
                         fn, S, qo[S], T);
    job->q_start = kv__mem_alloc(((size_t)S + 1) * sizeof(int64_t));
    if (!job->q_start)
        return kv__error(KV_ERR_NO_MEMORY, "%s: qo_indptr of %" PRIu32 " sequences", fn, S);
    for (uint32_t s = 0; s <= S; s++)
        job->q_start[s] = qo[s];
    return KV_OK;
}

/* q of a decode: a valid view of 3 dims (shape: what they are, in words). */
static kv_status check_q_dims(const char *fn, const struct kv_view *q, const char *shape)
{
    char b[KV__LIST];
    const kv_status st = kv_view_check(q);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: q", fn);
    if (q->ndim != 3)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: q has %d dims %s, expected %s", fn, q->ndim,
                         kv__fmt_list(b, sizeof(b), q->shape, q->ndim), shape);
    return KV_OK;
}

/* q [rows][hq][D] and out [rows][hq][out_dim] of a decode (mla: its words
 * for a row mismatch), out written only where it may be (its own elements
 * apart, not over q, outside the cache), and the softmax scale finite. */
static kv_status check_q_out(const char *fn, const struct kv_paged_cache *cache,
                             const struct kv_view *q, const struct kv_view *out, int64_t hq,
                             int64_t out_dim, bool mla, float softmax_scale,
                             struct kv__attn_job *job)
{
    char b1[KV__LIST], b2[KV__LIST];
    kv_status st;
    if ((st = check_tensor(fn, "q", q, 0, hq, cache->layout.head_dim, "Hq", &job->q)) != KV_OK ||
        (st = check_tensor(fn, "out", out, 0, hq, out_dim, "Hq", &job->out)) != KV_OK)
        return st;
    if (out->shape[0] != q->shape[0])
        return kv__error(KV_ERR_BAD_SHAPE, "%s: out shape %s != q%s %s%s", fn,
                         kv__fmt_list(b1, sizeof(b1), out->shape, out->ndim), mla ? "'s" : " shape",
                         kv__fmt_list(b2, sizeof(b2), q->shape, q->ndim),
                         mla ? " in S and Hq" : "");
    if ((st = check_output(fn, "out", out)) != KV_OK ||
        (st = check_disjoint(fn, "out", out, "q", q)) != KV_OK ||
        (st = check_outside_cache(fn, "out", out, cache)) != KV_OK)
        return st;
    if (!isfinite(softmax_scale))
        return kv__error(KV_ERR_INVALID_ARG, "%s: softmax_scale %g is not finite", fn,
                         (double)softmax_scale);
    return KV_OK;
}

/* The start of a decode / prefill check (MLA or not): job zeroed and named,
 * q, out (and qo_indptr for a prefill) not NULL, the cache checked and
 * copied into job. */
static kv_status check_job_start(const char *fn, const struct kv_paged_cache *cache,
                                 const struct kv_view *q, const int32_t *qo_indptr, bool prefill,
                                 const struct kv_view *out, struct kv__attn_job *job)
{
    memset(job, 0, sizeof(*job));
    job->fn = fn;
    job->kernel = prefill ? KV_ATTN_PREFILL : KV_ATTN_DECODE;
    if (!q || !out || (prefill && !qo_indptr))
        return prefill ? kv__error(KV_ERR_NULL, "%s: q=%p qo_indptr=%p out=%p", fn, (const void *)q,
                                   (const void *)qo_indptr, (const void *)out)
                       : kv__error(KV_ERR_NULL, "%s: q=%p out=%p", fn, (const void *)q,
                                   (const void *)out);
    kv_status st = check_cache(fn, cache);
    if (st != KV_OK)
        return st;
    job->cache = *cache;
    return KV_OK;
}

/* The rest of a decode / prefill check once q's Hq heads are known: q and
 * out ([.][Hq][out_dim]), opts, scales (one K plane for MLA), the pages, then
 * qo_indptr (a prefill) or one page row per sequence of q (a decode); job
 * completed (mla_dv = out_dim for MLA). On an error after the pages the job's
 * page arrays are freed. */
static kv_status check_job_finish(const char *fn, const struct kv_paged_cache *cache,
                                  const struct kv_view *q, const int32_t *qo_indptr, bool prefill,
                                  const struct kv_pages *pages, int64_t hq, int64_t out_dim,
                                  bool mla, float softmax_scale, const struct kv_scales *scales,
                                  const struct kv_view *out, const struct kv_attn_opts *opts,
                                  struct kv__attn_job *job)
{
    const struct kv_layout *lo = &cache->layout;
    kv_status st;
    if ((st = check_q_out(fn, cache, q, out, hq, out_dim, mla, softmax_scale, job)) != KV_OK)
        return st;
    if ((st = check_attn_opts(fn, opts, q->shape[0], hq, q, out, cache, job)) != KV_OK)
        return st;
    if ((st = check_attn_scales(fn, scales, lo, mla, q, out, hq, job)) != KV_OK)
        return st;
    if ((st = check_pages(fn, lo, pages, job)) != KV_OK) {
        kv__attn_job_free(job);
        return st;
    }
    if (prefill)
        st = check_qo_indptr(fn, qo_indptr, q->shape[0], job);
    else if ((int64_t)job->n_seqs != q->shape[0])
        st = kv__error(KV_ERR_BAD_SHAPE, "%s: q has %" PRId64 " sequences, pages %" PRIu32, fn,
                       q->shape[0], job->n_seqs);
    if (st != KV_OK) {
        kv__attn_job_free(job);
        return st;
    }
    job->q_heads = (uint32_t)hq;
    job->softmax_scale = softmax_scale;
    if (mla)
        job->mla_dv = out_dim;
    job->path = worse(path_of(q), path_of(out));
    return KV_OK;
}

kv_status kv__attn_decode_check(const char *fn, const struct kv_paged_cache *cache, uint32_t layer,
                                const struct kv_view *q, const int32_t *qo_indptr,
                                const struct kv_pages *pages, float softmax_scale,
                                const struct kv_scales *scales, const struct kv_view *out,
                                const struct kv_attn_opts *opts, struct kv__attn_job *job)
{
    const bool prefill = strstr(fn, "prefill") != NULL;
    kv_status st = check_job_start(fn, cache, q, qo_indptr, prefill, out, job);
    if (st != KV_OK)
        return st;
    const struct kv_layout *lo = &cache->layout;
    if (lo->k_only)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: a K-only (MLA) layout has no V plane: its decode is "
                         "kv_attn_decode_mla (values = the first Dv dims of the K rows)",
                         fn);
    if ((st = check_layer(fn, (int64_t)layer, lo->num_layers, false, job)) != KV_OK)
        return st;
    if ((st = check_q_dims(fn, q, prefill ? "[T][Hq][D]" : "[S][Hq][D]")) != KV_OK)
        return st;
    const int64_t hq = q->shape[1];
    if (hq < lo->num_heads || hq % lo->num_heads != 0)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: q has %" PRId64 " heads, not a multiple of the cache's %" PRId64
                         " KV heads",
                         fn, hq, lo->num_heads);
    return check_job_finish(fn, cache, q, qo_indptr, prefill, pages, hq, lo->head_dim, false,
                            softmax_scale, scales, out, opts, job);
}

/* MLA decode (qo_indptr NULL, no options) and prefill. */
static kv_status mla_check(const char *fn, const struct kv_paged_cache *cache, uint32_t layer,
                           const struct kv_view *q, const int32_t *qo_indptr, bool prefill,
                           const struct kv_pages *pages, int64_t dv, float softmax_scale,
                           const struct kv_scales *scales, const struct kv_view *out,
                           const struct kv_attn_opts *opts, struct kv__attn_job *job)
{
    kv_status st = check_job_start(fn, cache, q, qo_indptr, prefill, out, job);
    job->window_left = KV_ATTN_WINDOW_OFF;
    if (st != KV_OK)
        return st;
    const struct kv_layout *lo = &cache->layout;
    if (!lo->k_only || lo->num_heads != 1)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: the layout has %s and H = %" PRId64
                         " KV heads: MLA %s reads one latent plane (k_only) of one KV head",
                         fn, lo->k_only ? "one plane (K only)" : "K and V planes", lo->num_heads,
                         prefill ? "prefill" : "decode");
    if ((st = check_layer(fn, (int64_t)layer, lo->num_layers, false, job)) != KV_OK)
        return st;
    if (dv < 1 || dv > lo->head_dim)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: dv = %" PRId64 " outside [1, D = %" PRId64
                         "]: the values are the first dv dims of the latent rows",
                         fn, dv, lo->head_dim);
    if ((st = check_q_dims(fn, q, prefill ? "[T][Hq][D]" : "[S][Hq][D]")) != KV_OK)
        return st;
    const int64_t hq = q->shape[1];
    if (hq < 1 || hq > INT32_MAX)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: q has %" PRId64 " heads", fn, hq);
    return check_job_finish(fn, cache, q, qo_indptr, prefill, pages, hq, dv, true, softmax_scale,
                            scales, out, opts, job);
}

kv_status kv__attn_decode_mla_check(const char *fn, const struct kv_paged_cache *cache,
                                    uint32_t layer, const struct kv_view *q,
                                    const struct kv_pages *pages, int64_t dv, float softmax_scale,
                                    const struct kv_scales *scales, const struct kv_view *out,
                                    struct kv__attn_job *job)
{
    return mla_check(fn, cache, layer, q, NULL, false, pages, dv, softmax_scale, scales, out, NULL,
                     job);
}

kv_status kv__attn_prefill_mla_check(const char *fn, const struct kv_paged_cache *cache,
                                     uint32_t layer, const struct kv_view *q,
                                     const int32_t *qo_indptr, const struct kv_pages *pages,
                                     int64_t dv, float softmax_scale,
                                     const struct kv_scales *scales, const struct kv_view *out,
                                     const struct kv_attn_opts *opts, struct kv__attn_job *job)
{
    return mla_check(fn, cache, layer, q, qo_indptr, true, pages, dv, softmax_scale, scales, out,
                     opts, job);
}
