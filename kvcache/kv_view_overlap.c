/*
 * kv_view_overlap.c - byte extents and aliasing questions about views.
 *
 * Element i of a view covers the bytes [addr(i), addr(i) + elem_bytes) with
 *
 *     addr(i) = (uintptr_t)base + (offset + sum_k i_k * strides[k]) * elem_bytes
 *
 * Both exact questions reduce to one bounded integer problem: is there an
 * integer vector x, xlo_m <= x_m <= xhi_m, with
 *
 *     lo <= c0 + sum_m coef_m * x_m <= hi                                  (*)
 *
 *   has_internal_overlap(v): x = d = i - j over v's dims, x in [-(n-1), n-1],
 *       coef = |stride| * elem, c0 = 0, target (-elem, elem), d != 0 (taken
 *       with its first nonzero entry positive: d and -d are the same pair).
 *   shares(a, b): x = (i over a's dims, j over b's dims), coef = +a's byte
 *       strides and -b's byte strides, c0 = first address of a minus first
 *       address of b, target (-elem_a, elem_b).
 *
 * (*) is NP-hard in general (bounded knapsack), so it is decided by a
 * depth-first search, largest |coef| first, that cuts every branch whose
 * remaining dims cannot reach the target interval any more; each visited node
 * is one unit of work and max_work bounds it (KV_ERR_TOO_COSTLY past it).
 * Cheap exact shortcuts run first: empty views, extents that do not meet,
 * stride-0 dims, merging dims that walk one arithmetic progression, the
 * classic "each stride clears the span of the smaller dims" condition, two
 * dims with one stride (internal overlap), a gcd test, and merging terms of
 * equal |coef| into one (shares: a[::2] vs a[1::2] and interleaved layouts
 * answer without a search).
 *
 * Arithmetic: every byte quantity is int64. The search only runs after the
 * total reachable range (|c0| + sum |coef| * (xhi - xlo) + both element
 * sizes) is shown to be below INT64_MAX / 4, so every partial sum and bound
 * computed inside it fits.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_view_int.h"

#define KV__OVL_DEFAULT_WORK ((int64_t)1 << 20)
#define KV__OVL_MAX_TERMS (2 * KV_MAX_DIMS)
#define KV__OVL_RANGE_LIMIT (INT64_MAX / 4)

/* One dim of the address sum: an index in [0, n-1] times a byte stride. */
struct ovl_dim {
    int64_t step_bytes; /* |stride| * elem_bytes, > 0 */
    int64_t n;          /* size, > 1 */
};

/* A view reduced to what its set of addresses depends on. Invariant:
 * { addr(i) } == { start + sum_k x_k * dims[k].step_bytes : 0 <= x_k < dims[k].n } */
struct ovl_form {
    int64_t elem_bytes;
    int64_t rel_start_bytes; /* lowest address minus (uintptr_t)base */
    uintptr_t start;         /* lowest address any element has */
    int64_t span_bytes;      /* sum (n-1)*step + elem: bytes from start to one past the end */
    bool empty;              /* numel == 0 */
    bool stride0;            /* some dim with n > 1 and stride 0 */
    int ndims;               /* dims with n > 1 and stride != 0 */
    struct ovl_dim dims[KV_MAX_DIMS];
};

/* The search problem (*) above, terms sorted by |coef| descending. */
struct ovl_search {
    int nt;
    int64_t coef[KV__OVL_MAX_TERMS];
    int64_t xlo[KV__OVL_MAX_TERMS];
    int64_t xhi[KV__OVL_MAX_TERMS];
    int64_t rmin[KV__OVL_MAX_TERMS + 1]; /* min of sum_{m>=k} coef_m x_m */
    int64_t rmax[KV__OVL_MAX_TERMS + 1]; /* max of the same */
    int64_t lo, hi;                      /* target interval for the whole sum */
    bool need_nonzero;                   /* x != 0, first nonzero entry > 0 */
    int64_t work, max_work;
};

enum ovl_result { OVL_NO = 0, OVL_YES = 1, OVL_COSTLY = -1 };

static int64_t floor_div(int64_t a, int64_t b) /* b > 0 */
{
    if (b <= 0) /* unreachable: terms never have a zero coefficient */
        return a;
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

static int64_t ceil_div(int64_t a, int64_t b) /* b > 0 */
{
    if (b <= 0) /* unreachable: terms never have a zero coefficient */
        return a;
    int64_t q = a / b;
    return (a % b != 0 && a > 0) ? q + 1 : q;
}

static int64_t gcd_i64(int64_t a, int64_t b) /* a, b >= 0 */
{
    while (b != 0) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static void swap_i64(int64_t *a, int64_t *b)
{
    int64_t t = *a;
    *a = *b;
    *b = t;
}

static int cmp_dim_step_asc(const void *pa, const void *pb)
{
    const struct ovl_dim *a = pa, *b = pb;
    if (a->step_bytes != b->step_bytes)
        return a->step_bytes < b->step_bytes ? -1 : 1;
    return a->n < b->n ? -1 : a->n > b->n;
}

/* Metadata checks every entry point needs before doing arithmetic. */
static kv_status ovl_check_meta(const char *fn, const char *arg, const struct kv_view *v)
{
    if (v == NULL)
        return kv__error(KV_ERR_NULL, "%s: view %s is NULL", fn, arg);
    if (kv_dtype_size(v->dtype) == 0)
        return kv__error(KV_ERR_INVALID_ARG, "%s: view %s has unknown dtype %d", fn, arg,
                         (int)v->dtype);
    if (v->ndim < 0 || v->ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "%s: view %s has ndim %d outside 0..%d", fn, arg, v->ndim,
                         KV_MAX_DIMS);
    for (int k = 0; k < v->ndim; k++)
        if (v->shape[k] < 0)
            return kv__error(KV_ERR_BAD_SHAPE,
                             "%s: view %s has negative size %" PRId64 " in dim %d", fn, arg,
                             v->shape[k], k);
    return KV_OK;
}

/* Build the reduced form of v (metadata already checked). false on int64
 * overflow, which no view that fits in its storage can cause. */
static bool ovl_form_build(const struct kv_view *v, struct ovl_form *f)
{
    int64_t eb = (int64_t)kv_dtype_size(v->dtype);
    int64_t start, span = 0;

    memset(f, 0, sizeof(*f));
    f->elem_bytes = eb;
    for (int k = 0; k < v->ndim; k++)
        if (v->shape[k] == 0) {
            f->empty = true;
            return true;
        }
    if (!kv__mul_i64(v->offset, eb, &start))
        return false;
    for (int k = 0; k < v->ndim; k++) {
        int64_t n = v->shape[k], st = v->strides[k], step, reach;
        if (n == 1)
            continue;
        if (st == 0) {
            f->stride0 = true;
            continue;
        }
        if (st == INT64_MIN || !kv__mul_i64(st < 0 ? -st : st, eb, &step) ||
            !kv__mul_i64(step, n - 1, &reach) || !kv__add_i64(span, reach, &span))
            return false;
        /* A negative stride walks the same addresses downwards from
         * (n-1)*stride: shift the start and keep the step positive. */
        if (st < 0 && !kv__add_i64(start, -reach, &start))
            return false;
        f->dims[f->ndims].step_bytes = step;
        f->dims[f->ndims].n = n;
        f->ndims++;
    }
    if (!kv__add_i64(span, eb, &span))
        return false;
    f->rel_start_bytes = start;
    f->span_bytes = span;
    f->start = (uintptr_t)v->base + (uintptr_t)start; /* modular: a real address */
    return true;
}

/* Sort dims by step and merge neighbours that walk one progression
 * (step_{k+1} == step_k * n_k): the address multiset does not change. */
static void ovl_form_coalesce(struct ovl_form *f)
{
    int w = 0;
    qsort(f->dims, (size_t)f->ndims, sizeof(f->dims[0]), cmp_dim_step_asc);
    for (int k = 0; k < f->ndims; k++) {
        int64_t next_step, merged_n;
        if (w > 0 && kv__mul_i64(f->dims[w - 1].step_bytes, f->dims[w - 1].n, &next_step) &&
            next_step == f->dims[k].step_bytes &&
            kv__mul_i64(f->dims[w - 1].n, f->dims[k].n, &merged_n)) {
            f->dims[w - 1].n = merged_n;
            continue;
        }
        f->dims[w++] = f->dims[k];
    }
    f->ndims = w;
}

static int ovl_term_cmp_desc(const struct ovl_search *s, int a, int b)
{
    int64_t ca = s->coef[a] < 0 ? -s->coef[a] : s->coef[a];
    int64_t cb = s->coef[b] < 0 ? -s->coef[b] : s->coef[b];
    return ca > cb ? -1 : ca < cb;
}

/* Sort terms by |coef| descending (at most 16: insertion sort) and fill the
 * suffix ranges. Caller has bounded sum |coef|*(xhi-xlo). */
static void ovl_search_prepare(struct ovl_search *s)
{
    for (int i = 1; i < s->nt; i++)
        for (int j = i; j > 0 && ovl_term_cmp_desc(s, j - 1, j) > 0; j--) {
            swap_i64(&s->coef[j], &s->coef[j - 1]);
            swap_i64(&s->xlo[j], &s->xlo[j - 1]);
            swap_i64(&s->xhi[j], &s->xhi[j - 1]);
        }
    /* Terms of equal |coef| walk one lattice: c*x1 + c*x2 = c*(x1+x2) and
     * c*x1 - c*x2 = c*(x1-x2), and the sum or difference of two integer
     * intervals is every integer of one interval. Merging them is exact for
     * the existence question (not under need_nonzero, whose callers never
     * pass equal steps). */
    if (!s->need_nonzero) {
        int w = 0;
        for (int k = 0; k < s->nt; k++) {
            if (w > 0 && ovl_term_cmp_desc(s, w - 1, k) == 0) {
                bool same = (s->coef[w - 1] < 0) == (s->coef[k] < 0);
                s->xlo[w - 1] += same ? s->xlo[k] : -s->xhi[k];
                s->xhi[w - 1] += same ? s->xhi[k] : -s->xlo[k];
                continue;
            }
            s->coef[w] = s->coef[k];
            s->xlo[w] = s->xlo[k];
            s->xhi[w] = s->xhi[k];
            w++;
        }
        s->nt = w;
    }
    s->rmin[s->nt] = 0;
    s->rmax[s->nt] = 0;
    for (int k = s->nt - 1; k >= 0; k--) {
        int64_t a = s->coef[k] * s->xlo[k], b = s->coef[k] * s->xhi[k];
        s->rmin[k] = s->rmin[k + 1] + (a < b ? a : b);
        s->rmax[k] = s->rmax[k + 1] + (a < b ? b : a);
    }
}

/* Is there x[k..] solving (*) given partial sum p of the terms before k?
 * `nonzero`: some earlier x was nonzero. */
static enum ovl_result ovl_search_dfs(struct ovl_search *s, int k, int64_t p, bool nonzero)
{
    int64_t c = s->coef[k];
    /* need lo <= p + c*x + rest <= hi with rest in [rmin[k+1], rmax[k+1]] */
    int64_t lo = s->lo - p - s->rmax[k + 1];
    int64_t hi = s->hi - p - s->rmin[k + 1];
    int64_t xlo, xhi;

    /* c != 0: stride-0 dims never become terms (ovl_flatten folds them). */
    if (c > 0) {
        xlo = ceil_div(lo, c);
        xhi = floor_div(hi, c);
    } else {
        xlo = ceil_div(-hi, -c);
        xhi = floor_div(-lo, -c);
    }
    if (xlo < s->xlo[k])
        xlo = s->xlo[k];
    if (xhi > s->xhi[k])
        xhi = s->xhi[k];
    if (s->need_nonzero && !nonzero && xlo < (k == s->nt - 1 ? 1 : 0))
        xlo = k == s->nt - 1 ? 1 : 0;
    if (xlo > xhi)
        return OVL_NO;
    if (k == s->nt - 1)
        return OVL_YES; /* the last term alone: any x in range closes the sum */
    for (int64_t x = xlo; x <= xhi; x++) {
        enum ovl_result r;
        if (++s->work > s->max_work)
            return OVL_COSTLY;
        r = ovl_search_dfs(s, k + 1, p + c * x, nonzero || x != 0);
        if (r != OVL_NO)
            return r;
    }
    return OVL_NO;
}

static enum ovl_result ovl_search_run(struct ovl_search *s)
{
    s->work = 0;
    if (s->nt == 0)
        return (!s->need_nonzero && s->lo <= 0 && 0 <= s->hi) ? OVL_YES : OVL_NO;
    ovl_search_prepare(s);
    return ovl_search_dfs(s, 0, 0, false);
}

static void ovl_fmt_view(char *buf, size_t cap, const struct kv_view *v)
{
    char sh[160], st[160];
    snprintf(buf, cap, "shape %s strides %s offset %" PRId64 " %s",
             kv__fmt_list(sh, sizeof(sh), v->shape, v->ndim),
             kv__fmt_list(st, sizeof(st), v->strides, v->ndim), v->offset, kv_dtype_name(v->dtype));
}

/* ---- public ------------------------------------------------------------- */

void kv_view_extent_bytes(const struct kv_view *v, int64_t *lo_bytes, int64_t *hi_bytes)
{
    struct ovl_form f;
    int64_t lo = 0, hi = 0;

    kv__error_mute(); /* a void query: never changes kv_last_error() */
    if (v != NULL && ovl_check_meta("kv_view_extent_bytes", "v", v) == KV_OK &&
        ovl_form_build(v, &f) && !f.empty && kv__add_i64(f.rel_start_bytes, f.span_bytes, &hi))
        lo = f.rel_start_bytes;
    else
        hi = 0;
    kv__error_unmute();
    if (lo_bytes != NULL)
        *lo_bytes = lo;
    if (hi_bytes != NULL)
        *hi_bytes = hi;
}

kv_status kv_view_has_internal_overlap(const struct kv_view *v, int64_t max_work, bool *out)
{
    static const char fn[] = "kv_view_has_internal_overlap";
    struct ovl_form f;
    struct ovl_search s;
    kv_status st;
    int64_t reach = 0;
    bool fast_no = true;
    enum ovl_result r;

    if (out == NULL)
        return kv__error(KV_ERR_NULL, "%s: out is NULL", fn);
    st = ovl_check_meta(fn, "v", v);
    if (st != KV_OK)
        return st;
    if (!ovl_form_build(v, &f)) {
        char d[400];
        ovl_fmt_view(d, sizeof(d), v);
        return kv__error(KV_ERR_OVERFLOW, "%s: byte extent of view (%s) overflows int64", fn, d);
    }
    if (f.empty || (f.ndims == 0 && !f.stride0)) { /* numel <= 1 */
        *out = false;
        return kv__ok();
    }
    if (f.stride0) {
        *out = true;
        return kv__ok();
    }
    ovl_form_coalesce(&f);
    /* Ascending steps, each clearing everything the smaller dims reach plus
     * one element: all addresses distinct and elem_bytes apart. */
    for (int k = 0; k < f.ndims && fast_no; k++) {
        if (f.dims[k].step_bytes < reach + f.elem_bytes)
            fast_no = false;
        reach += f.dims[k].step_bytes * (f.dims[k].n - 1); /* <= span: fits */
    }
    if (fast_no) {
        *out = false;
        return kv__ok();
    }
    /* Two dims with one step: indices (..1..0..) and (..0..1..) meet. */
    for (int k = 1; k < f.ndims; k++)
        if (f.dims[k].step_bytes == f.dims[k - 1].step_bytes) {
            *out = true;
            return kv__ok();
        }
    /* 2 * span must stay far from overflow for the search bounds. */
    if (f.span_bytes > KV__OVL_RANGE_LIMIT / 2) {
        char d[400];
        ovl_fmt_view(d, sizeof(d), v);
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: span %" PRId64 " bytes of view (%s) too large "
                         "for the exact test",
                         fn, f.span_bytes, d);
    }
    memset(&s, 0, sizeof(s));
    for (int k = 0; k < f.ndims; k++) {
        s.coef[k] = f.dims[k].step_bytes;
        s.xlo[k] = -(f.dims[k].n - 1);
        s.xhi[k] = f.dims[k].n - 1;
    }
    s.nt = f.ndims;
    s.lo = -(f.elem_bytes - 1);
    s.hi = f.elem_bytes - 1;
    s.need_nonzero = true;
    s.max_work = max_work > 0 ? max_work : KV__OVL_DEFAULT_WORK;
    r = ovl_search_run(&s);
    if (r == OVL_COSTLY) {
        char d[400];
        ovl_fmt_view(d, sizeof(d), v);
        return kv__error(KV_ERR_TOO_COSTLY,
                         "%s: exact answer needs more than max_work %" PRId64
                         " search steps for view (%s)",
                         fn, s.max_work, d);
    }
    *out = r == OVL_YES;
    return kv__ok();
}

bool kv_view_may_share(const struct kv_view *a, const struct kv_view *b)
{
    struct ovl_form fa, fb;

    kv__error_mute(); /* a bool query: never changes kv_last_error() */
    bool meta_ok = a != NULL && b != NULL && ovl_check_meta("kv_view_may_share", "a", a) == KV_OK &&
                   ovl_check_meta("kv_view_may_share", "b", b) == KV_OK;
    kv__error_unmute();
    if (!meta_ok)
        return false;
    if (!ovl_form_build(a, &fa) || !ovl_form_build(b, &fb))
        return true; /* cannot bound it: conservatively "may" */
    if (fa.empty || fb.empty)
        return false;
    /* [sa, sa+span_a) and [sb, sb+span_b) meet; compare as unsigned distances. */
    if (fa.start >= fb.start)
        return fa.start - fb.start < (uintptr_t)fb.span_bytes;
    return fb.start - fa.start < (uintptr_t)fa.span_bytes;
}

kv_status kv_view_shares(const struct kv_view *a, const struct kv_view *b, int64_t max_work,
                         bool *out)
{
    static const char fn[] = "kv_view_shares";
    struct ovl_form fa, fb;
    struct ovl_search s;
    kv_status st;
    int64_t c0, total, g = 0;
    enum ovl_result r;

    if (out == NULL)
        return kv__error(KV_ERR_NULL, "%s: out is NULL", fn);
    st = ovl_check_meta(fn, "a", a);
    if (st == KV_OK)
        st = ovl_check_meta(fn, "b", b);
    if (st != KV_OK)
        return st;
    if (!ovl_form_build(a, &fa) || !ovl_form_build(b, &fb)) {
        char d[400];
        ovl_fmt_view(d, sizeof(d), ovl_form_build(a, &fa) ? b : a); /* the one that overflows */
        return kv__error(KV_ERR_OVERFLOW, "%s: byte extent of view (%s) overflows int64", fn, d);
    }
    if (fa.empty || fb.empty || !kv_view_may_share(a, b)) {
        *out = false;
        return kv__ok();
    }
    /* The extents meet, so |start_a - start_b| < max(span_a, span_b). */
    c0 = (int64_t)(fa.start - fb.start);
    total = c0 < 0 ? -c0 : c0;
    if (fa.span_bytes > KV__OVL_RANGE_LIMIT / 4 || fb.span_bytes > KV__OVL_RANGE_LIMIT / 4 ||
        total > KV__OVL_RANGE_LIMIT / 4) {
        char d[400];
        ovl_fmt_view(d, sizeof(d), fa.span_bytes >= fb.span_bytes ? a : b);
        return kv__error(KV_ERR_OVERFLOW, "%s: span of view (%s) too large for the exact test", fn,
                         d);
    }
    /* The forms already leave out stride-0 and size-1 dims: they add no address. */
    ovl_form_coalesce(&fa);
    ovl_form_coalesce(&fb);
    memset(&s, 0, sizeof(s));
    for (int k = 0; k < fa.ndims; k++, s.nt++) {
        s.coef[s.nt] = fa.dims[k].step_bytes;
        s.xhi[s.nt] = fa.dims[k].n - 1;
    }
    for (int k = 0; k < fb.ndims; k++, s.nt++) {
        s.coef[s.nt] = -fb.dims[k].step_bytes;
        s.xhi[s.nt] = fb.dims[k].n - 1;
    }
    /* [addr_a, +elem_a) meets [addr_b, +elem_b)  <=>  -elem_a < addr_a - addr_b < elem_b,
     * with addr_a - addr_b = c0 + sum coef*x. */
    s.lo = -(fa.elem_bytes - 1) - c0;
    s.hi = fb.elem_bytes - 1 - c0;
    /* gcd test: the sum moves in multiples of g; none may land in [lo, hi]. */
    for (int k = 0; k < s.nt; k++)
        g = gcd_i64(g, s.coef[k] < 0 ? -s.coef[k] : s.coef[k]);
    if (g > 0 && floor_div(s.hi, g) < ceil_div(s.lo, g)) {
        *out = false;
        return kv__ok();
    }
    s.max_work = max_work > 0 ? max_work : KV__OVL_DEFAULT_WORK;
    r = ovl_search_run(&s);
    if (r == OVL_COSTLY) {
        char da[400], db[400];
        ovl_fmt_view(da, sizeof(da), a);
        ovl_fmt_view(db, sizeof(db), b);
        return kv__error(KV_ERR_TOO_COSTLY,
                         "%s: exact answer needs more than max_work %" PRId64
                         " search steps for a (%s) and b (%s)",
                         fn, s.max_work, da, db);
    }
    *out = r == OVL_YES;
    return kv__ok();
}
