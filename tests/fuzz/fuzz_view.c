/*
 * fuzz_view.c - libFuzzer target for the strided-view API.
 *
 * Input bytes decode into a start view (any dtype, ndim 0..5, numel <= 4096,
 * over a malloc'd storage whose exact size lets ASan see any stray access,
 * optionally re-strided with kv_view_as_strided) followed by up to 12 ops
 * with arguments that are usually valid and sometimes not, including sizes
 * and strides at the edge of int64 (empty views, huge broadcasts, as_strided
 * with 2^62 strides: rd_big). After each op:
 *
 *   failure: the status is a known error code, kv_last_error() is non-empty,
 *            *out is untouched (also when out aliases src), no copy counted;
 *   success: the view passes kv_view_check and an independent bounds check,
 *            kv_view_materialize equals a naive element walk, metadata ops
 *            kept the storage, view/reshape/flatten/contiguous kept the
 *            C-order element sequence, a copy happened (and was counted)
 *            exactly when kv_view_view could not do it, and extent_bytes /
 *            may_share / has_internal_overlap / shares agree with brute force.
 *
 * Any mismatch prints the op chain and aborts. Everything allocated for an
 * input is freed before returning (LeakSanitizer is on).
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_view.h"

#define MAX_START_NUMEL 4096
#define MAX_WALK_NUMEL 65536 /* past this, stop the chain (materialize cost) */
#define MAX_BRUTE_NUMEL 1024 /* brute-force overlap checks up to this size */
#define MAX_OPS 12
#define ARENA_BYTES (4u << 20) /* copy destinations per input */
#define ARENA_BLOCKS 16

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ---- input reader ------------------------------------------------------- */

struct rd {
    const uint8_t *p;
    size_t n, i;
};

static uint8_t rd_u8(struct rd *r)
{
    return r->i < r->n ? r->p[r->i++] : 0;
}

/* Uniform-ish in [lo, hi]. */
static int64_t rd_range(struct rd *r, int64_t lo, int64_t hi)
{
    uint16_t x = (uint16_t)(rd_u8(r) | (uint16_t)rd_u8(r) << 8);
    return lo + (int64_t)(x % (uint64_t)(hi - lo + 1));
}

/* A size or stride at the edge of int64: 2^k (k up to 62), 2^k + 1, or
 * INT64_MAX. Empty views may carry such sizes and strides (no element is
 * ever addressed), so every product over them must be checked. */
static int64_t rd_big(struct rd *r)
{
    uint8_t b = rd_u8(r);
    if (b >= 0xF8)
        return INT64_MAX;
    int64_t v = (int64_t)1 << (b % 63);
    return b & 0x40 ? v + 1 : v;
}

/* A dim's size as the base of index arguments: clamped so that s + 2 and
 * -s - 2 stay in int64 (sizes may be up to INT64_MAX, see rd_big). */
static int64_t arg_size(int64_t s)
{
    return s > ((int64_t)1 << 40) ? (int64_t)1 << 40 : s;
}

/* A dim argument: usually valid for ndim (either sign), sometimes wild. */
static int rd_dim(struct rd *r, int ndim)
{
    uint8_t b = rd_u8(r);
    if (b >= 0xF0)
        return (int)(b & 0x0F) - 8 + (b & 1 ? 8 : -8); /* -16..15 */
    if (ndim == 0)
        return (b & 1) ? -1 : 0;
    return (int)(b % (2 * ndim)) - ndim;
}

/* ---- trace for crash reports -------------------------------------------- */

static char g_trace[4096];
static size_t g_trace_len;

static void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void trace(const char *fmt, ...)
{
    va_list ap;
    if (g_trace_len >= sizeof(g_trace) - 1)
        return;
    va_start(ap, fmt);
    int n = vsnprintf(g_trace + g_trace_len, sizeof(g_trace) - g_trace_len, fmt, ap);
    va_end(ap);
    if (n > 0)
        g_trace_len += (size_t)n;
    if (g_trace_len > sizeof(g_trace) - 1)
        g_trace_len = sizeof(g_trace) - 1;
}

static void trace_list(const char *name, const int64_t *v, int n)
{
    trace(" %s=[", name);
    for (int i = 0; i < n; i++)
        trace(i ? ",%lld" : "%lld", (long long)v[i]);
    trace("]");
}

static void trace_view(const char *tag, const struct kv_view *v)
{
    trace(" %s{%s", tag, kv_dtype_name(v->dtype));
    trace_list("shape", v->shape, v->ndim);
    trace_list("strides", v->strides, v->ndim);
    trace(" off=%lld bytes=%zu}", (long long)v->offset, v->storage_bytes);
}

static void fail(const char *file, int line, const char *cond)
{
    fprintf(stderr, "fuzz_view: check failed at %s:%d: %s\n  last_error: %s\n  chain:%s\n", file,
            line, cond, kv_last_error(), g_trace);
    abort();
}

/* Not a control-flow macro: it aborts the process on failure. */
#define CHECK(c) ((c) ? (void)0 : fail(__FILE__, __LINE__, #c))

/* ---- per-input memory: every block freed at the end ---------------------- */

struct arena {
    void *blk[ARENA_BLOCKS];
    int nblk;
    size_t used;
};

/* Exact-size block (so ASan catches writes past it); NULL when exhausted. */
static void *arena_get(struct arena *a, size_t bytes)
{
    void *p;
    if (a->nblk == ARENA_BLOCKS || bytes > ARENA_BYTES - a->used)
        return NULL;
    p = malloc(bytes ? bytes : 1);
    CHECK(p != NULL);
    a->blk[a->nblk++] = p;
    a->used += bytes;
    return p;
}

static void arena_free(struct arena *a)
{
    for (int i = 0; i < a->nblk; i++)
        free(a->blk[i]);
    a->nblk = 0;
    a->used = 0;
}

/* ---- reference model ---------------------------------------------------- */

static int64_t ref_numel(const struct kv_view *v)
{
    int64_t n = 1;
    for (int k = 0; k < v->ndim; k++)
        if (v->shape[k] == 0)
            return 0; /* before any product: [2^23, 2^56, 0] is empty */
    for (int k = 0; k < v->ndim; k++)
        if (__builtin_mul_overflow(n, v->shape[k], &n))
            return INT64_MAX;
    return n;
}

/* Independent bounds check: all invariants of kv_view.h. */
static bool ref_in_bounds(const struct kv_view *v)
{
    int64_t eb = (int64_t)kv_dtype_size(v->dtype), hi = v->offset, bytes;
    if (eb == 0 || v->ndim < 0 || v->ndim > KV_MAX_DIMS || v->offset < 0)
        return false;
    for (int k = 0; k < v->ndim; k++)
        if (v->shape[k] < 0 || v->strides[k] < 0)
            return false;
    if (ref_numel(v) == 0)
        return true;
    for (int k = 0; k < v->ndim; k++) {
        int64_t t;
        if (__builtin_mul_overflow(v->shape[k] - 1, v->strides[k], &t) ||
            __builtin_add_overflow(hi, t, &hi))
            return false;
    }
    if (__builtin_mul_overflow(hi + 1, eb, &bytes))
        return false;
    return v->base != NULL && (uint64_t)bytes <= (uint64_t)v->storage_bytes;
}

/* Absolute address of every element, in C order, into addr[numel]. */
static void ref_addrs(const struct kv_view *v, uintptr_t *addr)
{
    int64_t idx[KV_MAX_DIMS] = {0}, n = ref_numel(v), eb = (int64_t)kv_dtype_size(v->dtype);
    for (int64_t i = 0; i < n; i++) {
        int64_t e = v->offset;
        for (int k = 0; k < v->ndim; k++)
            e += idx[k] * v->strides[k];
        addr[i] = (uintptr_t)v->base + (uintptr_t)(e * eb);
        for (int k = v->ndim - 1; k >= 0; k--) {
            if (++idx[k] < v->shape[k])
                break;
            idx[k] = 0;
        }
    }
}

/* Naive C-order walk of v's bytes into a fresh buffer (caller frees). */
static unsigned char *ref_walk(const struct kv_view *v)
{
    int64_t n = ref_numel(v);
    size_t eb = kv_dtype_size(v->dtype);
    uintptr_t *addr = malloc((size_t)(n ? n : 1) * sizeof(*addr));
    unsigned char *out = malloc((size_t)n * eb + 1);
    CHECK(addr != NULL && out != NULL);
    ref_addrs(v, addr);
    for (int64_t i = 0; i < n; i++)
        memcpy(out + (size_t)i * eb, (const void *)addr[i], eb);
    free(addr);
    return out;
}

static int cmp_uptr(const void *a, const void *b)
{
    uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
    return x < y ? -1 : x > y;
}

static uintptr_t *ref_sorted_addrs(const struct kv_view *v, int64_t n)
{
    uintptr_t *addr = malloc((size_t)(n ? n : 1) * sizeof(*addr));
    CHECK(addr != NULL);
    ref_addrs(v, addr);
    qsort(addr, (size_t)n, sizeof(*addr), cmp_uptr);
    return addr;
}

static bool ref_internal_overlap(const struct kv_view *v)
{
    int64_t n = ref_numel(v);
    uintptr_t eb = kv_dtype_size(v->dtype);
    uintptr_t *a = ref_sorted_addrs(v, n);
    bool hit = false;
    for (int64_t i = 1; i < n && !hit; i++)
        hit = a[i] - a[i - 1] < eb;
    free(a);
    return hit;
}

static bool ref_shares(const struct kv_view *a, const struct kv_view *b)
{
    int64_t na = ref_numel(a), nb = ref_numel(b);
    uintptr_t ea = kv_dtype_size(a->dtype), eb = kv_dtype_size(b->dtype);
    uintptr_t *xa = ref_sorted_addrs(a, na), *xb = ref_sorted_addrs(b, nb);
    bool hit = false;
    /* for each x in a: the first y in b with y + eb > x must have y < x + ea */
    for (int64_t i = 0, j = 0; i < na && !hit; i++) {
        while (j < nb && xb[j] + eb <= xa[i])
            j++;
        hit = j < nb && xb[j] < xa[i] + ea;
    }
    free(xa);
    free(xb);
    return hit;
}

static void ref_extent(const struct kv_view *v, uintptr_t *lo, uintptr_t *hi)
{
    int64_t n = ref_numel(v);
    uintptr_t *a = ref_sorted_addrs(v, n);
    *lo = n ? a[0] : 0;
    *hi = n ? a[n - 1] + kv_dtype_size(v->dtype) : 0;
    free(a);
}

/* ---- checks on every produced view -------------------------------------- */

/* Field by field, never memcmp: a struct's padding is indeterminate. */
static bool same_view(const struct kv_view *x, const struct kv_view *y)
{
    if (x->dtype != y->dtype || x->ndim != y->ndim || x->offset != y->offset ||
        x->base != y->base || x->storage_bytes != y->storage_bytes)
        return false;
    for (int d = 0; d < KV_MAX_DIMS; d++)
        if (x->shape[d] != y->shape[d] || x->strides[d] != y->strides[d])
            return false;
    return true;
}

static void check_failed_op(kv_status st, const struct kv_view *out_after,
                            const struct kv_view *out_before)
{
    CHECK(st < 0);
    CHECK(strcmp(kv_status_name(st), "KV_UNKNOWN_STATUS") != 0);
    CHECK(kv_last_error()[0] != '\0');
    CHECK(same_view(out_after, out_before));
}

static void check_overlap_fns(const struct kv_view *v, const struct kv_view *other)
{
    int64_t n = ref_numel(v), no = ref_numel(other), lo, hi;
    uintptr_t rlo, rhi;
    bool got = false;
    kv_status st;

    if (n > MAX_BRUTE_NUMEL || no > MAX_BRUTE_NUMEL)
        return;
    kv_view_extent_bytes(v, &lo, &hi);
    ref_extent(v, &rlo, &rhi);
    if (n == 0)
        CHECK(lo == 0 && hi == 0);
    else
        CHECK((uintptr_t)v->base + (uintptr_t)lo == rlo &&
              (uintptr_t)v->base + (uintptr_t)hi == rhi);

    st = kv_view_has_internal_overlap(v, 0, &got);
    CHECK(st == KV_OK || st == KV_ERR_TOO_COSTLY);
    if (st == KV_OK)
        CHECK(got == ref_internal_overlap(v));
    else
        CHECK(kv_last_error()[0] != '\0');

    {
        bool want = ref_shares(v, other), may = kv_view_may_share(v, other);
        uintptr_t olo, ohi;
        ref_extent(other, &olo, &ohi);
        CHECK(may == (n > 0 && no > 0 && rlo < ohi && olo < rhi));
        st = kv_view_shares(v, other, 0, &got);
        CHECK(st == KV_OK || st == KV_ERR_TOO_COSTLY);
        if (st == KV_OK) {
            CHECK(got == want);
            CHECK(!got || may);
        }
        st = kv_view_shares(v, v, 0, &got);
        CHECK(st == KV_OK || st == KV_ERR_TOO_COSTLY);
        if (st == KV_OK)
            CHECK(got == (n > 0));
    }
}

/* Checks on a successful result; false when the chain should stop (too big). */
static bool check_view(const struct kv_view *v, const struct kv_view *other)
{
    int64_t n = ref_numel(v);
    size_t eb = kv_dtype_size(v->dtype);
    unsigned char *got, *want;

    CHECK(kv_view_check(v) == KV_OK);
    CHECK(ref_in_bounds(v));
    CHECK(kv_view_numel(v) == n);
    if (n > MAX_WALK_NUMEL)
        return false;
    got = malloc((size_t)n * eb + 1);
    CHECK(got != NULL);
    CHECK(kv_view_materialize(v, got, (size_t)n * eb) == KV_OK);
    want = ref_walk(v);
    CHECK(memcmp(got, want, (size_t)n * eb) == 0);
    free(got);
    free(want);
    check_overlap_fns(v, other);
    return true;
}

/* ---- ops ---------------------------------------------------------------- */

enum op {
    OP_PERMUTE,
    OP_TRANSPOSE,
    OP_SLICE,
    OP_NARROW,
    OP_SELECT,
    OP_UNSQUEEZE,
    OP_SQUEEZE,
    OP_EXPAND,
    OP_DIAGONAL,
    OP_VIEW,
    OP_RESHAPE,
    OP_FLATTEN,
    OP_CONTIGUOUS,
    OP_SLIDING_WINDOW,
    OP_AS_STRIDED,
    OP_COUNT
};

static const char *const op_names[OP_COUNT] = {
    "permute",   "transpose", "slice",      "narrow",         "select",
    "unsqueeze", "squeeze",   "expand",     "diagonal",       "view",
    "reshape",   "flatten",   "contiguous", "sliding_window", "as_strided",
};

struct op_args {
    enum op op;
    int dim0, dim1;
    int64_t a, b, c;
    int ndim;
    int perm[KV_MAX_DIMS];
    int64_t shape[KV_MAX_DIMS + 2];
    int64_t strides[KV_MAX_DIMS + 2];
    void *dst;
    size_t dst_bytes;
};

/* A target shape for view/reshape: usually numel-preserving, with one -1
 * sometimes; occasionally wrong. */
static void rd_target_shape(struct rd *r, int64_t numel, struct op_args *x)
{
    int64_t rem = numel;
    x->ndim = (int)rd_range(r, 0, 5);
    if (rd_u8(r) == 0xFF)
        x->ndim = KV_MAX_DIMS + 1; /* invalid ndim */
    if (x->ndim > KV_MAX_DIMS) {
        for (int i = 0; i < KV_MAX_DIMS; i++)
            x->shape[i] = 1;
        return;
    }
    if (x->ndim == 0) {
        return;
    }
    for (int i = 0; i < x->ndim - 1; i++) {
        int64_t divs[16], nd = 0;
        if (rem == 0) {
            /* an empty target may have any sizes: also large ones ([0] as
             * [0, 2^22, 2^22, 2^22] has C strides past int64) */
            x->shape[i] = rd_u8(r) % 4 == 0 ? rd_big(r) : rd_range(r, 0, 3);
            continue;
        }
        for (int64_t d = 1; d <= 16 && d <= rem; d++)
            if (rem % d == 0)
                divs[nd++] = d;
        x->shape[i] = divs[rd_range(r, 0, nd - 1)];
        rem /= x->shape[i];
    }
    x->shape[x->ndim - 1] = rem;
    switch (rd_u8(r) % 8) {
    case 0:
    case 1: /* infer one dim */
        x->shape[rd_range(r, 0, x->ndim - 1)] = -1;
        break;
    case 2: /* wrong sizes */
    {
        int64_t *sz = &x->shape[rd_range(r, 0, x->ndim - 1)];
        if (*sz < ((int64_t)1 << 62))
            *sz += rd_range(r, -2, 2);
    } break;
    case 3: /* two -1 */
        x->shape[0] = -1;
        x->shape[x->ndim - 1] = -1;
        break;
    default:
        break;
    }
}

/* Destination for an op that may copy: NULL, too small, exact, or the
 * source's own storage (copy allowed only if no element is shared). */
static void rd_dst(struct rd *r, struct arena *ar, const struct kv_view *src, struct op_args *x)
{
    int64_t n = ref_numel(src);
    size_t need = n > MAX_WALK_NUMEL ? 0 : (size_t)n * kv_dtype_size(src->dtype);
    uint8_t mode = rd_u8(r) % 8;

    x->dst = NULL;
    x->dst_bytes = 0;
    if (n > MAX_WALK_NUMEL || mode == 0)
        return;
    if (mode == 1 && need > 0) {
        x->dst = arena_get(ar, need - 1);
        x->dst_bytes = x->dst ? need - 1 : 0;
        return;
    }
    if (mode == 2 && need <= src->storage_bytes && src->base != NULL) {
        x->dst = src->base;
        x->dst_bytes = need;
        return;
    }
    x->dst = arena_get(ar, need + (mode == 3 ? 8 : 0));
    x->dst_bytes = x->dst ? need + (mode == 3 ? 8 : 0) : 0;
}

static void rd_args(struct rd *r, struct arena *ar, const struct kv_view *v, struct op_args *x)
{
    int nd = v->ndim;
    memset(x, 0, sizeof(*x));
    x->op = (enum op)(rd_u8(r) % OP_COUNT);
    x->dim0 = rd_dim(r, nd);
    x->dim1 = rd_dim(r, nd);
    switch (x->op) {
    case OP_PERMUTE:
        for (int i = 0; i < nd; i++)
            x->perm[i] = i;
        for (int i = nd - 1; i > 0; i--) {
            int j = (int)rd_range(r, 0, i), t = x->perm[i];
            x->perm[i] = x->perm[j];
            x->perm[j] = t;
        }
        for (int i = 0; i < nd; i++)
            if (rd_u8(r) & 1)
                x->perm[i] -= nd; /* negative spelling */
        if (nd > 0 && rd_u8(r) % 8 == 0)
            x->perm[rd_range(r, 0, nd - 1)] = rd_dim(r, nd); /* maybe a duplicate */
        x->ndim = nd;
        if (rd_u8(r) % 16 == 0)
            x->ndim = (int)rd_range(r, 0, KV_MAX_DIMS); /* maybe the wrong length */
        for (int i = nd; i < x->ndim; i++)
            x->perm[i] = i;
        break;
    case OP_SLICE: {
        int64_t s = arg_size(nd ? v->shape[(x->dim0 % nd + nd) % nd] : 0);
        x->a = rd_range(r, -s - 2, s + 2);
        x->b = rd_range(r, -s - 2, s + 2);
        x->c = rd_range(r, -1, 4); /* step; <= 0 refused */
        break;
    }
    case OP_NARROW: {
        int64_t s = arg_size(nd ? v->shape[(x->dim0 % nd + nd) % nd] : 0);
        x->a = rd_range(r, -s - 1, s + 1);
        x->b = rd_range(r, -1, s + 1);
        break;
    }
    case OP_SELECT: {
        int64_t s = arg_size(nd ? v->shape[(x->dim0 % nd + nd) % nd] : 0);
        x->a = rd_range(r, -s - 1, s);
        break;
    }
    case OP_UNSQUEEZE:
        x->dim0 = (int)rd_range(r, -nd - 2, nd + 1);
        break;
    case OP_EXPAND: {
        int lead = (int)rd_range(r, 0, 2) - (rd_u8(r) == 0xFF);
        x->ndim = nd + lead;
        if (x->ndim < 0 || x->ndim > KV_MAX_DIMS) {
            x->ndim = x->ndim < 0 ? 0 : KV_MAX_DIMS + 1;
            break;
        }
        for (int i = 0; i < x->ndim; i++) {
            int j = i - lead;
            int64_t have = j >= 0 ? v->shape[j] : 1;
            switch (rd_u8(r) % 6) {
            case 0:
                x->shape[i] = -1;
                break;
            case 1:
            case 2:
                x->shape[i] = have;
                break;
            case 3:
                x->shape[i] = have == 1 ? rd_big(r) : have; /* huge broadcast */
                break;
            case 4:
                x->shape[i] = have == 1 ? rd_range(r, 0, 5) : have;
                break;
            default:
                x->shape[i] = rd_range(r, -2, 6);
                break;
            }
        }
        break;
    }
    case OP_DIAGONAL:
        x->a = rd_range(r, -5, 5);
        break;
    case OP_VIEW:
    case OP_RESHAPE:
        rd_target_shape(r, ref_numel(v), x);
        if (x->op == OP_RESHAPE)
            rd_dst(r, ar, v, x);
        break;
    case OP_FLATTEN:
    case OP_CONTIGUOUS:
        rd_dst(r, ar, v, x);
        break;
    case OP_SLIDING_WINDOW: {
        int64_t s = arg_size(nd ? v->shape[(x->dim0 % nd + nd) % nd] : 0);
        x->a = rd_range(r, -1, s + 1);
        break;
    }
    case OP_AS_STRIDED: {
        int64_t cap = (int64_t)(v->storage_bytes / kv_dtype_size(v->dtype));
        x->ndim = (int)rd_range(r, 0, 5);
        if (rd_u8(r) == 0xFF)
            x->ndim = KV_MAX_DIMS + 1;
        const bool big = rd_u8(r) % 4 == 0; /* an empty view with edge sizes and strides */
        for (int i = 0; i < x->ndim && i < KV_MAX_DIMS; i++) {
            x->shape[i] = big ? rd_big(r) : rd_range(r, 0, 6);
            x->strides[i] = rd_u8(r) == 0xFE ? -1 : big ? rd_big(r) : rd_range(r, 0, 9);
        }
        if (big && x->ndim > 0 && x->ndim <= KV_MAX_DIMS)
            x->shape[rd_range(r, 0, x->ndim - 1)] = 0;
        x->a = rd_u8(r) == 0xFF ? -1 : big && rd_u8(r) & 1 ? rd_big(r) : rd_range(r, 0, cap + 2);
        break;
    }
    default:
        break;
    }
}

static void trace_args(const struct op_args *x)
{
    trace("\n  %s d0=%d d1=%d a=%lld b=%lld c=%lld", op_names[x->op], x->dim0, x->dim1,
          (long long)x->a, (long long)x->b, (long long)x->c);
    if (x->op == OP_PERMUTE)
        for (int i = 0; i < x->ndim; i++)
            trace(i ? ",%d" : " perm=%d", x->perm[i]);
    if (x->op == OP_EXPAND || x->op == OP_VIEW || x->op == OP_RESHAPE || x->op == OP_AS_STRIDED)
        trace_list("shape", x->shape, x->ndim <= KV_MAX_DIMS ? x->ndim : KV_MAX_DIMS);
    if (x->op == OP_AS_STRIDED)
        trace_list("strides", x->strides, x->ndim <= KV_MAX_DIMS ? x->ndim : KV_MAX_DIMS);
    if (x->op == OP_RESHAPE || x->op == OP_FLATTEN || x->op == OP_CONTIGUOUS)
        trace(" dst=%s dst_bytes=%zu", x->dst ? "buf" : "NULL", x->dst_bytes);
}

static kv_status apply(const struct op_args *x, const struct kv_view *src, struct kv_view *out,
                       bool *copied)
{
    *copied = false;
    switch (x->op) {
    case OP_PERMUTE:
        return kv_view_permute(src, x->perm, x->ndim, out);
    case OP_TRANSPOSE:
        return kv_view_transpose(src, x->dim0, x->dim1, out);
    case OP_SLICE:
        return kv_view_slice(src, x->dim0, x->a, x->b, x->c, out);
    case OP_NARROW:
        return kv_view_narrow(src, x->dim0, x->a, x->b, out);
    case OP_SELECT:
        return kv_view_select(src, x->dim0, x->a, out);
    case OP_UNSQUEEZE:
        return kv_view_unsqueeze(src, x->dim0, out);
    case OP_SQUEEZE:
        return kv_view_squeeze(src, x->dim0, out);
    case OP_EXPAND:
        return kv_view_expand(src, x->ndim, x->shape, out);
    case OP_DIAGONAL:
        return kv_view_diagonal(src, x->a, x->dim0, x->dim1, out);
    case OP_VIEW:
        return kv_view_view(src, x->ndim, x->shape, out);
    case OP_RESHAPE:
        *copied = true; /* must be overwritten */
        return kv_view_reshape(src, x->ndim, x->shape, x->dst, x->dst_bytes, out, copied);
    case OP_FLATTEN:
        *copied = true;
        return kv_view_flatten(src, x->dim0, x->dim1, x->dst, x->dst_bytes, out, copied);
    case OP_CONTIGUOUS:
        *copied = true;
        return kv_view_contiguous(src, x->dst, x->dst_bytes, out, copied);
    case OP_SLIDING_WINDOW:
        return kv_view_sliding_window(src, x->dim0, x->a, out);
    case OP_AS_STRIDED:
        return kv_view_as_strided(src, x->ndim, x->shape, x->strides, x->a, out);
    default:
        return KV_ERR_INTERNAL;
    }
}

static bool may_copy(enum op op)
{
    return op == OP_RESHAPE || op == OP_FLATTEN || op == OP_CONTIGUOUS;
}

/* Could the copy op have been a view? (kv_view_view on the same target.) */
static kv_status view_equivalent(const struct op_args *x, const struct kv_view *src)
{
    struct kv_view t;
    int64_t shape[KV_MAX_DIMS];
    int n = 0, a, b;

    if (x->op == OP_RESHAPE)
        return kv_view_view(src, x->ndim, x->shape, &t);
    if (x->op == OP_CONTIGUOUS)
        return kv_view_is_contiguous(src) ? KV_OK : KV_ERR_NEEDS_COPY;
    /* flatten(start, end) == view(shape[:a] + [prod] + shape[b+1:]) */
    if (src->ndim == 0) {
        shape[0] = 1;
        return kv_view_view(src, 1, shape, &t);
    }
    a = x->dim0 < 0 ? x->dim0 + src->ndim : x->dim0;
    b = x->dim1 < 0 ? x->dim1 + src->ndim : x->dim1;
    for (int i = 0; i < a; i++)
        shape[n++] = src->shape[i];
    shape[n] = 1;
    for (int i = a; i <= b; i++)
        if (__builtin_mul_overflow(shape[n], src->shape[i], &shape[n]))
            return KV_ERR_OVERFLOW;
    n++;
    for (int i = b + 1; i < src->ndim; i++)
        shape[n++] = src->shape[i];
    return kv_view_view(src, n, shape, &t);
}

static bool same_copy_stats(const struct kv_copy_stats *x, const struct kv_copy_stats *y)
{
    for (int k = 0; k < KV_COPY_REASON_COUNT; k++)
        if (x->calls[k] != y->calls[k] || x->bytes[k] != y->bytes[k])
            return false;
    return true;
}

/* Run one op, check it, and advance *v on success. false: stop the chain. */
static bool step(struct rd *r, struct arena *ar, struct kv_view *v, const struct kv_view *start)
{
    struct op_args x;
    struct kv_view out, poison, alias;
    struct kv_copy_stats s0, s1;
    unsigned char *before = NULL;
    int64_t n_src = ref_numel(v);
    bool copied = false, copied2 = false;
    kv_status st, st2;

    rd_args(r, ar, v, &x);
    trace_args(&x);
    memset(&poison, 0xA5, sizeof(poison));
    out = poison;
    if (may_copy(x.op) || x.op == OP_VIEW)
        before = ref_walk(v); /* the element sequence the result must keep */
    kv_copy_stats_get(&s0);
    st = apply(&x, v, &out, &copied);
    kv_copy_stats_get(&s1);
    trace(" -> %s", kv_status_name(st));

    if (st != KV_OK) {
        check_failed_op(st, &out, &poison);
        CHECK(same_copy_stats(&s0, &s1));
        if (may_copy(x.op) && st != KV_ERR_BAD_DIM && st != KV_ERR_BAD_SHAPE &&
            st != KV_ERR_OVERFLOW && st != KV_ERR_NULL)
            /* refused for want of a (good) buffer: a view must be impossible */
            CHECK(view_equivalent(&x, v) == KV_ERR_NEEDS_COPY);
        /* the same call with out aliasing src changes nothing either */
        alias = *v;
        st2 = apply(&x, &alias, &alias, &copied2);
        CHECK(st2 == st);
        CHECK(same_view(&alias, v));
        free(before);
        return true;
    }

    /* success */
    CHECK(out.dtype == v->dtype);
    if (may_copy(x.op) && copied) {
        kv_copy_reason why = x.op == OP_RESHAPE   ? KV_COPY_RESHAPE
                             : x.op == OP_FLATTEN ? KV_COPY_FLATTEN
                                                  : KV_COPY_CONTIGUOUS;
        uint64_t bytes = (uint64_t)n_src * kv_dtype_size(v->dtype);
        CHECK(x.dst != NULL);
        CHECK(out.base == x.dst && out.storage_bytes == x.dst_bytes);
        CHECK(kv_view_is_contiguous(&out) && out.offset == 0);
        CHECK(view_equivalent(&x, v) == KV_ERR_NEEDS_COPY);
        for (int k = 0; k < KV_COPY_REASON_COUNT; k++) {
            CHECK(s1.calls[k] - s0.calls[k] == (k == (int)why));
            CHECK(s1.bytes[k] - s0.bytes[k] == (k == (int)why ? bytes : 0));
        }
    } else {
        CHECK(same_copy_stats(&s0, &s1));
        CHECK(out.base == v->base && out.storage_bytes == v->storage_bytes);
        if (may_copy(x.op))
            CHECK(view_equivalent(&x, v) == KV_OK);
        /* the same call with out aliasing src gives the same view */
        alias = *v;
        st2 = apply(&x, &alias, &alias, &copied2);
        CHECK(st2 == KV_OK && !copied2);
        CHECK(same_view(&alias, &out));
    }
    if (x.op == OP_CONTIGUOUS)
        CHECK(kv_view_is_contiguous(&out));
    if (before != NULL) {
        /* view / reshape / flatten / contiguous keep the C-order elements */
        unsigned char *after;
        CHECK(ref_numel(&out) == n_src);
        after = ref_walk(&out);
        CHECK(memcmp(before, after, (size_t)n_src * kv_dtype_size(v->dtype)) == 0);
        free(after);
        free(before);
    }
    trace_view("=", &out);
    if (!check_view(&out, v) || !check_view(&out, start))
        return false;
    *v = out;
    return true;
}

/* Bytes of each element distinct from its neighbours': element k of the
 * storage holds k (little endian) mixed with a per-byte pattern. */
static void fill_storage(unsigned char *p, size_t bytes, size_t eb)
{
    for (size_t i = 0; i < bytes; i++) {
        size_t k = i / eb, j = i % eb;
        p[i] = (unsigned char)(j < sizeof(size_t) ? (k >> (8 * j)) : 0) ^
               (unsigned char)(0x5B * (j + 1)) ^ (unsigned char)(eb == 1 ? (k >> 8) * 0x3D : 0);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct rd r = {data, size, 0};
    struct arena ar = {{0}, 0, 0};
    struct kv_view v, start;
    int64_t shape[KV_MAX_DIMS], numel = 1;
    kv_dtype dt = (kv_dtype)(rd_u8(&r) % KV_DTYPE_COUNT);
    size_t eb = kv_dtype_size(dt), storage_bytes;
    int ndim = rd_u8(&r) % 6, nops;
    unsigned char *storage;
    kv_status st;

    g_trace_len = 0;
    g_trace[0] = '\0';
    for (int k = 0; k < ndim; k++) {
        int64_t n = rd_u8(&r) % 7;
        if (numel * (n ? n : 1) > MAX_START_NUMEL)
            n = 1;
        shape[k] = n;
        numel *= n ? n : 1;
    }
    storage_bytes = ((size_t)numel + rd_u8(&r) % 16) * eb;
    storage = malloc(storage_bytes ? storage_bytes : 1);
    CHECK(storage != NULL);
    fill_storage(storage, storage_bytes, eb);

    st = kv_view_init(storage, storage_bytes, dt, ndim, shape, &v);
    CHECK(st == KV_OK);
    trace_view("start", &v);
    CHECK(kv_view_is_contiguous(&v));

    if (rd_u8(&r) & 1) { /* re-stride the start, maybe refused */
        struct op_args x;
        struct kv_view out, poison;
        memset(&x, 0, sizeof(x));
        x.op = OP_AS_STRIDED;
        x.ndim = (int)rd_range(&r, 0, 5);
        for (int i = 0; i < x.ndim; i++) {
            x.shape[i] = rd_range(&r, 0, 6);
            x.strides[i] = rd_range(&r, 0, 12);
        }
        x.a = rd_range(&r, 0, 24);
        trace_args(&x);
        memset(&poison, 0x5A, sizeof(poison));
        out = poison;
        st = kv_view_as_strided(&v, x.ndim, x.shape, x.strides, x.a, &out);
        trace(" -> %s", kv_status_name(st));
        if (st == KV_OK)
            v = out;
        else
            check_failed_op(st, &out, &poison);
    }
    start = v;
    if (!check_view(&v, &start))
        goto free_all;

    nops = rd_u8(&r) % (MAX_OPS + 1);
    for (int i = 0; i < nops && r.i < r.n; i++)
        if (!step(&r, &ar, &v, &start))
            break;

free_all:
    if (getenv("KV_FUZZ_TRACE") != NULL) /* replaying a seed: show what it did */
        fprintf(stderr, "chain:%s\n", g_trace);
    arena_free(&ar);
    free(storage);
    return 0;
}
