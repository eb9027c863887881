/*
 * fuzz_view.c - libFuzzer target for the strided-view API.
 *
 * Input bytes decode into a start view (any dtype, ndim 0..8, numel <= 4096,
 * over a malloc'd storage whose exact size lets ASan see any stray access,
 * optionally re-strided with kv_view_as_strided) followed by up to 12 ops
 * with arguments that are usually valid and sometimes not, including sizes
 * and strides at the edge of int64 (empty views, huge broadcasts, as_strided
 * with 2^62 strides: rd_big). Op bytes below 0xF0 pick a metadata or
 * may-copy op; 0xF0.. pick one of three checks on the current view (the
 * encoding of older seeds is kept: ndim 6..8 also hide behind bytes >= 0xF0):
 *
 *   copy:    kv_view_copy(src = the view, dst) with dst built by
 *            kv_view_from_strided (its status checked against a reference)
 *            over a second exact-size buffer or over src's own storage
 *            (another base pointer into it, overlapping or interleaved or
 *            disjoint), sometimes invalid, of another shape or dtype. The
 *            status is the reference's (invalid dst, shape, dtype, a
 *            brute-force overlap test). KV_OK: dst's element walk equals
 *            src's as it was before, no byte of either storage outside dst's
 *            elements changed, one copy counted. Refused: a message, neither
 *            storage changed at all, nothing counted;
 *   address: kv_view_offset_of / kv_view_ptr on every element of a small
 *            view (sampled otherwise) equal a naive stride sum; indices
 *            outside the shape, a NULL idx and a view past its storage are
 *            refused, the output untouched;
 *   layout:  a small kv_layout from input bytes (kv_layout_init may refuse)
 *            and kv_layout_kv_view of one (layer, kv) over a base that may be
 *            misaligned, NULL, or too small: its status against a
 *            reference; on KV_OK the view passes kv_view_check and the
 *            checks below, shape [B][N][H][D], element offsets equal to
 *            kv_layout_offset's at sampled coordinates, every element inside
 *            storage, elements disjoint from each other and from another
 *            (layer, kv) plane.
 *
 * The copy and layout results may become the view the chain continues on.
 * After each view op:
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

#include "kv_layout.h"
#include "kv_view.h"

#define FUZZ_NAME "fuzz_view"
#define FUZZ_TRACE_LABEL "chain"
#include "fuzz_check.h"

#define MAX_START_NUMEL 4096
#define MAX_WALK_NUMEL 65536 /* past this, stop the chain (materialize cost) */
#define MAX_BRUTE_NUMEL 1024 /* brute-force overlap checks up to this size */
#define MAX_OPS 12
#define MAX_COPY_NUMEL 4096    /* kv_view_copy op: sources up to this size */
#define MAX_ADDR_WALK 256      /* address op: every element up to this size */
#define ARENA_BYTES (4u << 20) /* copy destinations per input */
#define ARENA_BLOCKS 16

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ---- input reader ------------------------------------------------------- */

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

/* ndim of a start view: b % 6 as older seeds decode it, 6..8 from the bytes
 * >= 0xF0 (which older seeds rarely hold there). */
static int ndim_from_byte(uint8_t b)
{
    return b < 0xF0 ? b % 6 : 6 + (b - 0xF0) % 3;
}

/* ndim of an as_strided or view/reshape target: rd_range(r, 0, 5) as older
 * seeds decode it, 6..8 when the high byte is >= 0xF0. */
static int rd_ndim(struct rd *r)
{
    int64_t x = rd_range(r, 0, 0xFFFF);
    return x >> 8 >= 0xF0 ? 6 + (int)(x % 3) : (int)(x % 6);
}

/* Past 5 dims a size that would take numel over MAX_START_NUMEL becomes 1
 * (the first 5 dims decode as they always did). */
static int64_t clamp_high_dim(int i, int64_t *numel, int64_t size)
{
    if (i >= 5 && size > 1 && *numel * size > MAX_START_NUMEL)
        size = 1;
    *numel *= size > 0 ? size : 1;
    return size;
}

/* ---- trace for crash reports -------------------------------------------- */

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
    if (__builtin_add_overflow(hi, 1, &hi) || __builtin_mul_overflow(hi, eb, &bytes))
        return false; /* a hand-edited dst (copy op) may reach INT64_MAX */
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
    x->ndim = rd_ndim(r);
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

static void rd_args(struct rd *r, struct arena *ar, const struct kv_view *v, struct op_args *x,
                    uint8_t op_byte)
{
    int nd = v->ndim;
    memset(x, 0, sizeof(*x));
    x->op = (enum op)(op_byte % OP_COUNT);
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
        int64_t cap = (int64_t)(v->storage_bytes / kv_dtype_size(v->dtype)), numel = 1;
        x->ndim = rd_ndim(r);
        if (rd_u8(r) == 0xFF)
            x->ndim = KV_MAX_DIMS + 1;
        const bool big = rd_u8(r) % 4 == 0; /* an empty view with edge sizes and strides */
        for (int i = 0; i < x->ndim && i < KV_MAX_DIMS; i++) {
            x->shape[i] = big ? rd_big(r) : clamp_high_dim(i, &numel, rd_range(r, 0, 6));
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

/* ---- kv_view_copy, element addressing, kv_layout_kv_view ------------------ */

static bool known_error(kv_status st)
{
    return st < 0 && strcmp(kv_status_name(st), "KV_UNKNOWN_STATUS") != 0;
}

/* Every invariant of kv_view.h, as kv_view_check must judge it: in bounds
 * (ref_in_bounds), a numel that fits int64, a base aligned to the element. */
static bool ref_valid(const struct kv_view *v)
{
    int64_t n = 1;
    bool empty = false;
    if (!ref_in_bounds(v))
        return false;
    for (int k = 0; k < v->ndim; k++)
        empty |= v->shape[k] == 0;
    for (int k = 0; k < v->ndim && !empty; k++)
        if (__builtin_mul_overflow(n, v->shape[k], &n))
            return false;
    return (uintptr_t)v->base % kv_dtype_size(v->dtype) == 0;
}

/* Strides of a dst with src's shape: C order over a shuffled dim order with
 * 0..2 elements of padding per dim (elements disjoint), maybe one stride
 * then zeroed; or src's own strides (always for an empty src, whose sizes
 * may be huge); or small random ones (often overlapping). */
static void rd_copy_strides(struct rd *r, const struct kv_view *v, int64_t *strides)
{
    const int nd = v->ndim;
    const uint8_t mode = rd_u8(r) % 8;
    int perm[KV_MAX_DIMS];
    int64_t s = 1;

    if (mode == 6 || ref_numel(v) == 0) {
        memcpy(strides, v->strides, sizeof(v->strides));
        return;
    }
    if (mode == 7) {
        for (int k = 0; k < nd; k++)
            strides[k] = rd_range(r, 0, 4);
        return;
    }
    for (int k = 0; k < nd; k++)
        perm[k] = k;
    if (mode & 1)
        for (int k = nd - 1; k > 0; k--) {
            int j = (int)rd_range(r, 0, k), t = perm[k];
            perm[k] = perm[j];
            perm[j] = t;
        }
    for (int i = nd - 1; i >= 0; i--) { /* sizes are small: numel <= MAX_COPY_NUMEL */
        strides[perm[i]] = s;
        s *= v->shape[perm[i]] + (mode & 2 ? rd_range(r, 0, 2) : 0);
    }
    if (mode == 4 && nd > 0)
        strides[rd_range(r, 0, nd - 1)] = 0;
}

/* One storage a copy may touch: its bytes before, and which of them are
 * dst's elements (the only bytes a successful copy may change). */
struct region {
    const unsigned char *p;
    size_t n;
    unsigned char *before, *mask;
};

static void region_take(struct region *g, const void *p, size_t n)
{
    g->p = p;
    g->n = n;
    g->before = malloc(n + 1);
    g->mask = calloc(n + 1, 1);
    CHECK(g->before != NULL && g->mask != NULL);
    if (n > 0)
        memcpy(g->before, p, n);
}

/* Mark every byte of dst's elements in the region holding it. */
static void region_mark(struct region *g, int ng, const struct kv_view *dst)
{
    const int64_t n = ref_numel(dst);
    const uintptr_t eb = kv_dtype_size(dst->dtype);
    uintptr_t *addr = malloc((size_t)(n ? n : 1) * sizeof(*addr));
    CHECK(addr != NULL);
    ref_addrs(dst, addr);
    for (int64_t i = 0; i < n; i++) {
        int j = 0;
        while (j < ng &&
               !(addr[i] >= (uintptr_t)g[j].p && addr[i] + eb <= (uintptr_t)g[j].p + g[j].n))
            j++;
        CHECK(j < ng); /* every dst element lies in a storage under test */
        memset(g[j].mask + (addr[i] - (uintptr_t)g[j].p), 1, eb);
    }
    free(addr);
}

/* No byte changed but dst's elements (every byte when `all`). */
static void region_check(const struct region *g, bool all)
{
    for (size_t i = 0; i < g->n; i++)
        if (all || !g->mask[i])
            CHECK(g->p[i] == g->before[i]);
}

static void region_free(struct region *g)
{
    free(g->before);
    free(g->mask);
}

/* kv_view_copy(v, dst); dst from kv_view_from_strided over a second buffer or
 * over v's own storage, or hand-built when that refuses it. false: stop. */
static bool copy_step(struct rd *r, struct arena *ar, struct kv_view *v,
                      const struct kv_view *start)
{
    const int nd = v->ndim;
    const int64_t n = ref_numel(v);
    const int64_t eb = (int64_t)kv_dtype_size(v->dtype);
    const uint8_t kind = rd_u8(r), edit = rd_u8(r);
    int64_t strides[KV_MAX_DIMS] = {0}, ext = 0, off_e, off_bytes, extent_bytes;
    size_t storage_bytes, arg_bytes;
    unsigned char *base, *buf2 = NULL, *want_elems;
    struct kv_view dst, want, poison;
    struct kv_copy_stats s0, s1;
    struct region reg[2];
    int nreg = 0;
    bool neg = false, same_shape, keep = true;
    kv_status st, expect;

    if (n > MAX_COPY_NUMEL) {
        trace("\n  copy: src of %lld elements skipped", (long long)n);
        return true;
    }
    rd_copy_strides(r, v, strides);
    if (nd > 0 && rd_u8(r) == 0xFE)
        strides[0] = -1; /* refused by kv_view_from_strided */
    for (int k = 0; k < nd; k++) {
        neg |= strides[k] < 0;
        if (n > 0)
            ext += (v->shape[k] - 1) * strides[k];
    }
    ext = n > 0 ? (ext < 0 ? 1 : ext + 1) : 0; /* elements reached from offset 0 */

    if ((kind & 4) == 0) { /* a second buffer, exactly storage_bytes long */
        int64_t slack = rd_range(r, -2, 16);
        size_t need;
        off_e = rd_range(r, 0, 7);
        need = (size_t)(off_e + ext) * (size_t)eb;
        storage_bytes = slack < 0 && (size_t)-slack > need ? 0 : need + (size_t)slack;
        if (storage_bytes == 0 && need > 0)
            storage_bytes = 1; /* 0 would mean "exactly the extent" below */
        buf2 = arena_get(ar, storage_bytes);
        if (buf2 == NULL)
            return true;
        for (size_t i = 0; i < storage_bytes; i++)
            buf2[i] = (unsigned char)(0xC3 ^ (i * 7));
        base = buf2;
        /* 0: "exactly the extent", only when the buffer holds the extent */
        arg_bytes = (kind & 8) && slack >= 0 ? 0 : storage_bytes;
        trace("\n  copy to buffer[%zu]", storage_bytes);
    } else { /* v's own storage, maybe from another base pointer into it */
        int64_t shift = rd_range(r, 0, 3), cap;
        size_t mis = (kind & 8) && eb > 1 && (rd_u8(r) & 1) ? 1 : 0;
        if ((size_t)(shift * eb) + mis >= v->storage_bytes)
            shift = 0, mis = 0; /* storage_bytes 0 would mean "exactly the extent" */
        base = (unsigned char *)v->base + shift * eb + (int64_t)mis;
        storage_bytes = v->storage_bytes - (size_t)(shift * eb) - mis;
        arg_bytes = storage_bytes;
        cap = (int64_t)storage_bytes / eb - ext;
        switch (rd_u8(r) % 3) {
        case 0: /* anywhere it fits */
            off_e = rd_range(r, 0, cap > 0 ? cap : 0);
            break;
        case 1: /* near src: the same elements, or interleaved with them (an
                 * empty src's offset may be INT64_MAX: saturate, clamped below) */
            if (__builtin_add_overflow(v->offset, rd_range(r, -2, 2) - shift, &off_e))
                off_e = INT64_MAX;
            break;
        default: /* just past src's last element */
        {
            uintptr_t lo, hi;
            ref_extent(v, &lo, &hi);
            off_e = n > 0 && hi > (uintptr_t)base
                        ? (int64_t)((hi - (uintptr_t)base) / (uintptr_t)eb)
                        : 0;
            off_e += rd_range(r, 0, 2);
        } break;
        }
        if (off_e < 0)
            off_e = 0;
        if (off_e > INT64_MAX / 16) /* an empty src's offset may be near INT64_MAX */
            off_e = INT64_MAX / 16;
        trace("\n  copy to storage+%lld%s", (long long)shift, mis ? "+1 byte" : "");
    }
    off_bytes = off_e * eb + ((edit & 0x10) && eb > 1 ? 1 : 0);
    extent_bytes = n > 0 ? off_bytes + ext * eb : 0;

    /* the view kv_view_from_strided should make, and whether it should */
    memset(&want, 0, sizeof(want));
    want.dtype = v->dtype;
    want.ndim = nd;
    for (int k = 0; k < nd; k++) {
        want.shape[k] = v->shape[k];
        want.strides[k] = strides[k];
    }
    want.offset = off_bytes / eb;
    want.base = base;
    want.storage_bytes = arg_bytes ? arg_bytes : (size_t)extent_bytes;
    const bool want_ok = !neg && off_bytes % eb == 0 && (uintptr_t)base % (uintptr_t)eb == 0 &&
                         (arg_bytes == 0 || (uint64_t)extent_bytes <= (uint64_t)arg_bytes);
    memset(&poison, 0x3C, sizeof(poison));
    dst = poison;
    st = kv_view_from_strided(base, arg_bytes, v->dtype, nd, v->shape, strides, off_bytes, &dst);
    trace_list("strides", strides, nd);
    trace(" off_bytes=%lld arg_bytes=%zu from_strided -> %s", (long long)off_bytes, arg_bytes,
          kv_status_name(st));
    CHECK((st == KV_OK) == want_ok);
    if (st != KV_OK) {
        check_failed_op(st, &dst, &poison);
        if (neg || off_bytes % eb != 0 || !(edit & 0x20))
            return true;
        dst = want; /* the refused view, built by hand: kv_view_copy must refuse it too */
        dst.storage_bytes = storage_bytes;
    } else {
        CHECK(same_view(&dst, &want));
        CHECK(kv_view_check(&dst) == KV_OK && ref_in_bounds(&dst));
    }
    if ((edit & 0x40) && nd > 0) { /* another shape */
        int k = (int)rd_range(r, 0, nd - 1);
        dst.shape[k] = dst.shape[k] > 0 ? dst.shape[k] - 1 : 1;
    }
    if ((edit & 0x80) && KV_DTYPE_COUNT > 1) /* another dtype */
        dst.dtype =
            (kv_dtype)(((int)dst.dtype + 1 + rd_u8(r) % (KV_DTYPE_COUNT - 1)) % KV_DTYPE_COUNT);
    trace_view("dst", &dst);

    /* what kv_view_copy must answer (KV_ERR_INTERNAL here: any refusal) */
    same_shape = dst.ndim == nd;
    for (int k = 0; same_shape && k < nd; k++)
        same_shape = dst.shape[k] == v->shape[k];
    if (!ref_valid(&dst))
        expect = KV_ERR_INTERNAL;
    else if (!same_shape)
        expect = KV_ERR_BAD_SHAPE;
    else if (dst.dtype != v->dtype)
        expect = KV_ERR_INVALID_ARG;
    else if (n > 0 && (ref_internal_overlap(&dst) || ref_shares(&dst, v)))
        expect = KV_ERR_OVERLAP;
    else
        expect = KV_OK;

    region_take(&reg[nreg++], v->base, v->storage_bytes);
    if (buf2 != NULL)
        region_take(&reg[nreg++], buf2, storage_bytes);
    if (expect == KV_OK)
        region_mark(reg, nreg, &dst);
    want_elems = ref_walk(v);
    kv_copy_stats_get(&s0);
    st = kv_view_copy(v, &dst);
    kv_copy_stats_get(&s1);
    trace(" copy -> %s", kv_status_name(st));

    if (expect == KV_OK)
        /* conservative refusal allowed only when the overlap work bound was hit */
        CHECK(st == KV_OK ||
              (st == KV_ERR_OVERLAP && strstr(kv_last_error(), "could not prove") != NULL));
    else if (expect == KV_ERR_INTERNAL)
        CHECK(st != KV_OK);
    else
        CHECK(st == expect);
    if (st != KV_OK) {
        CHECK(known_error(st));
        CHECK(kv_last_error()[0] != '\0');
        CHECK(same_copy_stats(&s0, &s1));
        for (int i = 0; i < nreg; i++)
            region_check(&reg[i], true);
    } else {
        unsigned char *got = ref_walk(&dst);
        CHECK(memcmp(got, want_elems, (size_t)(n * eb)) == 0);
        free(got);
        for (int i = 0; i < nreg; i++)
            region_check(&reg[i], false);
        for (int k = 0; k < KV_COPY_REASON_COUNT; k++) {
            CHECK(s1.calls[k] - s0.calls[k] == (k == (int)KV_COPY_VIEW_COPY));
            CHECK(s1.bytes[k] - s0.bytes[k] ==
                  (k == (int)KV_COPY_VIEW_COPY ? (uint64_t)(n * eb) : 0));
        }
    }
    free(want_elems);
    for (int i = 0; i < nreg; i++)
        region_free(&reg[i]);

    if (st == KV_OK && (kind & 0x10)) { /* go on from dst */
        trace(" (continue on dst)");
        keep = check_view(&dst, v) && check_view(&dst, start);
        if (keep)
            *v = dst;
    }
    return keep;
}

/* One in-range index: kv_view_offset_of and kv_view_ptr equal a naive stride
 * sum (no overflow: the view's last element is inside its storage). */
static void check_addr(const struct kv_view *v, const int64_t *idx)
{
    int64_t want = v->offset, got = -1, t;
    for (int k = 0; k < v->ndim; k++) {
        CHECK(!__builtin_mul_overflow(idx[k], v->strides[k], &t));
        CHECK(!__builtin_add_overflow(want, t, &want));
    }
    CHECK(kv_view_offset_of(v, idx, &got) == KV_OK);
    CHECK(got == want);
    CHECK((uintptr_t)kv_view_ptr(v, idx) ==
          (uintptr_t)v->base + (uintptr_t)want * kv_dtype_size(v->dtype));
}

/* A refused index (or view): status, message, output untouched, ptr NULL. */
static void check_addr_refused(const struct kv_view *v, const int64_t *idx, kv_status want)
{
    const int64_t poison = INT64_MIN + 0x5A;
    int64_t got = poison;
    kv_status st = kv_view_offset_of(v, idx, &got);
    trace(" -> %s", kv_status_name(st));
    if (want != KV_OK)
        CHECK(st == want);
    CHECK(known_error(st));
    CHECK(kv_last_error()[0] != '\0');
    CHECK(got == poison);
    CHECK(kv_view_ptr(v, idx) == NULL);
    CHECK(kv_last_error()[0] != '\0');
}

static void address_step(struct rd *r, const struct kv_view *v)
{
    const int nd = v->ndim;
    const int64_t n = ref_numel(v);
    int64_t idx[KV_MAX_DIMS] = {0};

    trace("\n  address n=%lld", (long long)n);
    if (n > 0 && n <= MAX_ADDR_WALK) { /* every element, in C order */
        for (int64_t i = 0; i < n; i++) {
            check_addr(v, idx);
            for (int k = nd - 1; k >= 0; k--) {
                if (++idx[k] < v->shape[k])
                    break;
                idx[k] = 0;
            }
        }
    }
    if (nd == 0) /* a 0-d view takes no index */
        check_addr(v, NULL);
    for (int s = 0; s < 4 && n > 0; s++) { /* samples, last indices often */
        for (int k = 0; k < nd; k++)
            idx[k] = rd_u8(r) & 1 ? v->shape[k] - 1 : rd_range(r, 0, v->shape[k] - 1);
        check_addr(v, idx);
    }
    for (int s = 0; s < 3 && nd > 0; s++) { /* one index outside its dim */
        int k = (int)rd_range(r, 0, nd - 1);
        for (int j = 0; j < nd; j++)
            idx[j] = v->shape[j] > 0 ? rd_range(r, 0, v->shape[j] - 1) : 0;
        switch (rd_u8(r) % 6) {
        case 0:
            idx[k] = v->shape[k];
            break;
        case 1:
            idx[k] = v->shape[k] < INT64_MAX ? v->shape[k] + 1 : INT64_MAX;
            break;
        case 2:
            idx[k] = -1;
            break;
        case 3:
            idx[k] = INT64_MIN;
            break;
        case 4:
            idx[k] = INT64_MAX;
            break;
        default:
            idx[k] = -arg_size(v->shape[k]) - 1;
            break;
        }
        trace_list("idx", idx, nd);
        check_addr_refused(v, idx, KV_ERR_OUT_OF_BOUNDS);
    }
    if (nd > 0) { /* idx NULL */
        trace(" idx=NULL");
        check_addr_refused(v, NULL, KV_ERR_NULL);
    }
    if (n > 0) { /* the same view one byte short of its last element */
        struct kv_view w = *v;
        uintptr_t lo, hi;
        ref_extent(v, &lo, &hi);
        w.storage_bytes = (size_t)(hi - (uintptr_t)v->base) - 1;
        memset(idx, 0, sizeof(idx));
        trace(" storage_bytes=%zu", w.storage_bytes);
        check_addr_refused(&w, idx, KV_ERR_OUT_OF_BOUNDS);
    }
}

/* A small layout from input bytes, one (layer, kv) of it as a view over a
 * base that may be misaligned, NULL or too small. false: stop the chain. */
static bool layout_step(struct rd *r, struct arena *ar, struct kv_view *v,
                        const struct kv_view *start)
{
    struct kv_layout_config cfg;
    struct kv_layout lo;
    unsigned char lo_poison[sizeof(lo)]; /* its bytes: a refusal must not write any */
    struct kv_view out, poison, other;
    kv_status st, allow[6];
    int nallow = 0;
    const uint8_t f = rd_u8(r), g = rd_u8(r), h = rd_u8(r), m = rd_u8(r);
    int64_t *dims[5], eb, natural, sb;
    size_t mis;
    unsigned char *buf, *base;
    uint32_t layer;
    int kv;

    kv_layout_config_init(&cfg);
    cfg.num_layers = rd_range(r, 1, 3);
    cfg.num_blocks = rd_range(r, 1, 4);
    cfg.block_tokens = rd_range(r, 1, 6);
    cfg.num_heads = rd_range(r, 1, 3);
    cfg.head_dim = rd_range(r, 1, 8);
    dims[0] = &cfg.num_layers, dims[1] = &cfg.num_blocks, dims[2] = &cfg.block_tokens;
    dims[3] = &cfg.num_heads, dims[4] = &cfg.head_dim;
    if ((f & 0xF0) == 0xF0) /* a dim <= 0 */
        *dims[rd_range(r, 0, 4)] = rd_range(r, -1, 0);
    cfg.dtype = (kv_dtype)(rd_u8(r) % (KV_DTYPE_COUNT + 1)); /* KV_DTYPE_COUNT: unknown */
    cfg.order = (f & 0x0E) == 0x0E ? (kv_order)2 : f & 1 ? KV_ORDER_HND : KV_ORDER_NHD;
    cfg.arrange = (g & 0x0E) == 0x0E ? (kv_arrange)2
                  : g & 1            ? KV_ARRANGE_BLOCK_MAJOR
                                     : KV_ARRANGE_LAYER_MAJOR;
    cfg.kv_packed = g >> 4 >= 8 && g >> 4 != 12 && g >> 4 != 13 && g >> 4 != 14; /* 8..11, 15 */
    cfg.k_only = g >> 4 >= 12;                                                   /* 12..15 */
    eb = (int64_t)kv_dtype_size(cfg.dtype);
    natural = cfg.block_tokens * cfg.num_heads * cfg.head_dim * (cfg.kv_packed ? 2 : 1) * eb;
    switch (h % 8) {
    case 4:
        cfg.block_pad_elems = rd_range(r, -1, 5);
        break;
    case 5:
        cfg.block_stride_bytes = natural + rd_range(r, 0, 8) * eb;
        break;
    case 6: /* maybe under the natural block, maybe not a multiple of the element */
        cfg.block_stride_bytes = natural + rd_range(r, -1, 8) * eb + ((h >> 3) & 1);
        break;
    case 7: /* both paddings: refused */
        cfg.block_pad_elems = rd_range(r, 0, 2);
        cfg.block_stride_bytes = natural + 2 * eb;
        break;
    default:
        break;
    }
    switch ((h >> 4) % 4) {
    case 2:
        cfg.align_bytes = (int64_t)1 << rd_range(r, 0, 8);
        break;
    case 3: /* maybe not a power of two */
        cfg.align_bytes = rd_range(r, 3, 100);
        break;
    default:
        break;
    }
    memset(&lo, 0x6B, sizeof(lo));
    memcpy(lo_poison, &lo, sizeof(lo));
    st = kv_layout_init(&cfg, &lo);
    trace("\n  layout L=%lld B=%lld N=%lld H=%lld D=%lld %s order=%d arrange=%d packed=%d "
          "k_only=%d pad=%lld stride=%lld align=%lld -> %s",
          (long long)cfg.num_layers, (long long)cfg.num_blocks, (long long)cfg.block_tokens,
          (long long)cfg.num_heads, (long long)cfg.head_dim, kv_dtype_name(cfg.dtype),
          (int)cfg.order, (int)cfg.arrange, (int)cfg.kv_packed, (int)cfg.k_only,
          (long long)cfg.block_pad_elems, (long long)cfg.block_stride_bytes,
          (long long)cfg.align_bytes, kv_status_name(st));
    if (st != KV_OK) {
        CHECK(known_error(st));
        CHECK(kv_last_error()[0] != '\0');
        CHECK(memcmp(&lo, lo_poison, sizeof(lo)) == 0); /* check-test-compares: bytes (unwritten) */
        return true;
    }
    CHECK(lo.total_bytes > 0 && lo.total_bytes <= ((int64_t)1 << 22));
    CHECK(lo.elem_bytes == eb);

    /* storage: maybe shifted by an element or by one byte, maybe too small */
    mis = m % 4 == 1 ? (size_t)eb : m % 4 == 2 ? 1 : 0;
    sb = lo.total_bytes;
    switch ((m >> 2) % 4) {
    case 0:
        sb -= rd_range(r, 1, eb);
        break;
    case 1:
        sb += rd_range(r, 1, 64);
        break;
    default:
        break;
    }
    buf = arena_get(ar, mis + (size_t)sb);
    if (buf == NULL)
        return true;
    fill_storage(buf, mis + (size_t)sb, (size_t)eb);
    base = (m >> 4) == 0xF ? NULL : buf + mis;
    layer = (m >> 4) == 0xE ? UINT32_MAX : (uint32_t)rd_range(r, 0, lo.num_layers);
    {
        uint8_t b = rd_u8(r);
        kv = b < 0xF0 ? b & 1 : (b & 1 ? -1 : 2);
    }
    if (base == NULL)
        allow[nallow++] = KV_ERR_NULL;
    if ((int64_t)layer >= lo.num_layers)
        allow[nallow++] = KV_ERR_OUT_OF_BOUNDS;
    if (kv != 0 && kv != 1)
        allow[nallow++] = KV_ERR_INVALID_ARG;
    if (kv == 1 && lo.k_only)
        allow[nallow++] = KV_ERR_INVALID_ARG;
    if (sb < lo.total_bytes)
        allow[nallow++] = KV_ERR_OUT_OF_BOUNDS;
    if (base != NULL && (uintptr_t)base % (uintptr_t)eb != 0)
        allow[nallow++] = KV_ERR_INVALID_ARG;

    memset(&poison, 0x4D, sizeof(poison));
    out = poison;
    st = kv_layout_kv_view(&lo, base, (size_t)sb, layer, kv, &out);
    trace(" kv_view(base%s+%zu, %lld bytes of %lld, layer %u, kv %d) -> %s", base ? "" : "=NULL",
          mis, (long long)sb, (long long)lo.total_bytes, layer, kv, kv_status_name(st));
    if (nallow > 0) {
        bool hit = false;
        for (int i = 0; i < nallow; i++)
            hit |= st == allow[i];
        CHECK(hit);
        check_failed_op(st, &out, &poison);
        return true;
    }
    CHECK(st == KV_OK);
    CHECK(kv_view_check(&out) == KV_OK && ref_in_bounds(&out));
    CHECK(out.dtype == lo.dtype && out.ndim == 4 && out.base == base &&
          out.storage_bytes == (size_t)sb);
    CHECK(out.shape[0] == lo.num_blocks && out.shape[1] == lo.block_tokens &&
          out.shape[2] == lo.num_heads && out.shape[3] == lo.head_dim);
    {
        /* every element inside storage, no two overlapping */
        const int64_t n = ref_numel(&out);
        uintptr_t *addr = malloc((size_t)n * sizeof(*addr));
        CHECK(addr != NULL);
        ref_addrs(&out, addr);
        for (int64_t i = 0; i < n; i++)
            CHECK(addr[i] >= (uintptr_t)base &&
                  addr[i] + (uintptr_t)eb <= (uintptr_t)base + (uintptr_t)sb);
        free(addr);
        CHECK(!ref_internal_overlap(&out));
    }
    for (int s = 0; s < 8; s++) { /* corners, then sampled coordinates */
        int64_t c[4], want = -1, got = -1;
        for (int k = 0; k < 4; k++)
            c[k] = s == 0 ? 0 : s == 1 ? out.shape[k] - 1 : rd_range(r, 0, out.shape[k] - 1);
        CHECK(kv_layout_offset(&lo, layer, kv, (uint32_t)c[0], (uint32_t)c[1], (uint32_t)c[2],
                               (uint32_t)c[3], &want) == KV_OK);
        CHECK(want == kv_layout_elem_offset(&lo, layer, kv, (uint32_t)c[0], (uint32_t)c[1],
                                            (uint32_t)c[2], (uint32_t)c[3]));
        CHECK(kv_view_offset_of(&out, c, &got) == KV_OK && got == want);
        CHECK((uintptr_t)kv_view_ptr(&out, c) == (uintptr_t)base + (uintptr_t)(want * eb));
    }
    {
        /* one coordinate past its limit: both refuse */
        int64_t c[4] = {0, 0, 0, 0}, got = -7;
        int k = (int)rd_range(r, 0, 3);
        c[k] = out.shape[k];
        CHECK(kv_layout_offset(&lo, layer, kv, (uint32_t)c[0], (uint32_t)c[1], (uint32_t)c[2],
                               (uint32_t)c[3], &got) == KV_ERR_OUT_OF_BOUNDS);
        CHECK(got == -7 && kv_last_error()[0] != '\0');
        CHECK(kv_view_offset_of(&out, c, &got) == KV_ERR_OUT_OF_BOUNDS && got == -7);
    }
    {
        /* another (layer, kv) plane of the layout: disjoint from this one */
        uint32_t l2 = (uint32_t)rd_range(r, 0, lo.num_layers - 1);
        int kv2 = lo.k_only ? 0 : rd_u8(r) & 1;
        other = out;
        if (l2 != layer || kv2 != kv) {
            CHECK(kv_layout_kv_view(&lo, base, (size_t)sb, l2, kv2, &other) == KV_OK);
            CHECK(!ref_shares(&out, &other));
        }
    }
    trace_view("=", &out);
    if (!check_view(&out, &other))
        return false;
    if (f & 0x40) { /* go on from the layout's view */
        trace(" (continue on it)");
        if (!check_view(&out, start))
            return false;
        *v = out;
    }
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

    const uint8_t ob = rd_u8(r);
    if (ob >= 0xF0) /* the checks that bytes below 0xF0 never picked (older seeds) */
        return ob < 0xF8   ? copy_step(r, ar, v, start)
               : ob < 0xFC ? (address_step(r, v), true)
                           : layout_step(r, ar, v, start);
    rd_args(r, ar, v, &x, ob);
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct rd r = {data, size, 0};
    struct arena ar = {{0}, 0, 0};
    struct kv_view v, start;
    int64_t shape[KV_MAX_DIMS], numel = 1;
    kv_dtype dt = (kv_dtype)(rd_u8(&r) % KV_DTYPE_COUNT);
    size_t eb = kv_dtype_size(dt), storage_bytes;
    int ndim = ndim_from_byte(rd_u8(&r)), nops;
    unsigned char *storage;
    kv_status st;

    trace_reset();
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
        int64_t n_re = 1;
        x.ndim = rd_ndim(&r);
        for (int i = 0; i < x.ndim; i++) {
            x.shape[i] = clamp_high_dim(i, &n_re, rd_range(&r, 0, 6));
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
