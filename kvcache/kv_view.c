/*
 * kv_view.c - strided views: creation and checks (the geometry every view
 * must satisfy), the element addressing, the predicates and describe. The
 * metadata operations (PyTorch semantics) are in kv_view_ops.c; view,
 * reshape and the ops that copy only when no view exists in
 * kv_view_reshape.c.
 *
 * Every op works on a local copy `t` of the source and assigns *out = t only
 * on success, so `out` may alias `src` and a failure changes nothing.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kv_view_int.h"

#define KV__LIST_BUF 160

/* ---- helpers ------------------------------------------------------------ */

kv_status kv__view_null(const char *fn, const void *a, const char *an, const void *b,
                        const char *bn)
{
    return kv__error(KV_ERR_NULL, "%s: %s=%p %s=%p", fn, an, a, bn, b);
}

/* Product of shape[0..n) into *out; false when it overflows int64. */
bool kv__shape_numel(const int64_t *shape, int n, int64_t *out)
{
    int64_t p = 1;
    bool zero = false;
    for (int i = 0; i < n; i++)
        if (shape[i] == 0)
            zero = true;
    if (zero) {
        *out = 0;
        return true;
    }
    for (int i = 0; i < n; i++)
        if (!kv__mul_i64(p, shape[i], &p))
            return false;
    *out = p;
    return true;
}

/* C-order strides of shape; false when one overflows int64 (possible even
 * for an empty view: [0, 2^40, 2^40] still needs stride 2^40 for dim 1). */
static bool kv__contig_strides(const int64_t *shape, int ndim, int64_t *strides)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        strides[i] = s;
        if (i > 0 && !kv__mul_i64(s, shape[i] > 1 ? shape[i] : 1, &s))
            return false;
    }
    return true;
}

/*
 * Highest element index reached (offset + sum (shape-1)*stride) into *max_elem.
 * Returns false on overflow. Only meaningful when numel > 0.
 */
static bool kv__max_elem(const int64_t *shape, const int64_t *strides, int ndim, int64_t offset,
                         int64_t *max_elem)
{
    int64_t m = offset;
    for (int i = 0; i < ndim; i++) {
        int64_t t;
        if (shape[i] <= 1)
            continue;
        if (!kv__mul_i64(shape[i] - 1, strides[i], &t) || !kv__add_i64(m, t, &m))
            return false;
    }
    *max_elem = m;
    return true;
}

/* The dtype is one, ndim in range, no size or stride negative; *es the
 * element size. */
static kv_status kv__check_dims(const char *fn, kv_dtype dtype, int ndim, const int64_t *shape,
                                const int64_t *strides, size_t *es)
{
    char b1[KV__LIST_BUF];
    *es = kv_dtype_size(dtype);
    if (*es == 0)
        return kv__error(KV_ERR_INVALID_ARG, "%s: unknown dtype %d", fn, (int)dtype);
    if (ndim < 0 || ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "%s: ndim %d outside 0..%d", fn, ndim, KV_MAX_DIMS);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return kv__error(KV_ERR_BAD_SHAPE, "%s: negative size %" PRId64 " at dim %d of %s", fn,
                             shape[i], i, kv__fmt_list(b1, sizeof(b1), shape, ndim));
        if (strides[i] < 0)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: negative stride %" PRId64 " at dim %d of %s (negative strides "
                             "are refused, as in PyTorch)",
                             fn, strides[i], i, kv__fmt_list(b1, sizeof(b1), strides, ndim));
    }
    return KV_OK;
}

/* One past the last byte a view with elements reaches, from offset
 * (elements): (offset + sum (shape-1)*stride + 1) * es; *max_elem the last
 * element. false on int64 overflow. */
static bool kv__extent_bytes(const int64_t *shape, const int64_t *strides, int ndim, int64_t offset,
                             size_t es, int64_t *max_elem, int64_t *out)
{
    int64_t past_last;
    return kv__max_elem(shape, strides, ndim, offset, max_elem) &&
           kv__add_i64(*max_elem, 1, &past_last) && kv__mul_i64(past_last, (int64_t)es, out);
}

/*
 * Check shape/strides/offset against a storage. fn names the caller for the
 * message. Returns KV_OK (without touching the last error) or an error.
 */
static kv_status kv__check_geometry(const char *fn, kv_dtype dtype, int ndim, const int64_t *shape,
                                    const int64_t *strides, int64_t offset, const void *base,
                                    size_t storage_bytes)
{
    char b1[KV__LIST_BUF], b2[KV__LIST_BUF];
    size_t es;
    int64_t numel, max_elem = 0, hi_bytes = 0;
    kv_status st = kv__check_dims(fn, dtype, ndim, shape, strides, &es);
    if (st != KV_OK)
        return st;
    if (offset < 0)
        return kv__error(KV_ERR_OUT_OF_BOUNDS, "%s: negative offset %" PRId64, fn, offset);
    if (!kv__shape_numel(shape, ndim, &numel))
        return kv__error(KV_ERR_OVERFLOW, "%s: element count of shape %s overflows int64", fn,
                         kv__fmt_list(b1, sizeof(b1), shape, ndim));
    if (base && (uintptr_t)base % es != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: storage base %p is not aligned to the %zu-byte element size of %s",
                         fn, base, es, kv_dtype_name(dtype));
    if (numel == 0)
        return KV_OK;
    if (!base)
        return kv__error(KV_ERR_NULL, "%s: storage base is NULL for a view of %" PRId64 " elements",
                         fn, numel);
    if (!kv__extent_bytes(shape, strides, ndim, offset, es, &max_elem, &hi_bytes))
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: shape %s strides %s offset %" PRId64 " reach past int64 bytes", fn,
                         kv__fmt_list(b1, sizeof(b1), shape, ndim),
                         kv__fmt_list(b2, sizeof(b2), strides, ndim), offset);
    if ((uint64_t)hi_bytes > (uint64_t)storage_bytes)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "%s: shape %s strides %s offset %" PRId64 " reaches element %" PRId64
                         " (last byte %" PRId64 ") but the storage holds %zu bytes",
                         fn, kv__fmt_list(b1, sizeof(b1), shape, ndim),
                         kv__fmt_list(b2, sizeof(b2), strides, ndim), offset, max_elem,
                         hi_bytes - 1, storage_bytes);
    /* every element address base + k fits: a base near the top of the
     * address space (a forged DLPack data pointer) wraps */
    if ((uintptr_t)base + (uint64_t)hi_bytes < (uintptr_t)base)
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: storage base %p + %" PRId64 " bytes wraps past the top of the "
                         "address space",
                         fn, base, hi_bytes);
    return KV_OK;
}

/* Entry check of every op: src must satisfy the view invariants (O(ndim)),
 * so a hand-built view with a bad ndim, size, stride or offset is refused
 * before any of its arrays is indexed. */
kv_status kv__check_src(const char *fn, const struct kv_view *src)
{
    return kv__check_geometry(fn, src->dtype, src->ndim, src->shape, src->strides, src->offset,
                              src->base, src->storage_bytes);
}

/* ---- creation and checks ------------------------------------------------ */

kv_status kv_view_init(void *base, size_t storage_bytes, kv_dtype dtype, int ndim,
                       const int64_t *shape, struct kv_view *out)
{
    struct kv_view t;
    kv_status st;

    if (!out || (!shape && ndim > 0))
        return kv__view_null("kv_view_init", out, "out", shape, "shape");
    if (ndim < 0 || ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "kv_view_init: ndim %d outside 0..%d", ndim, KV_MAX_DIMS);
    if (!base && storage_bytes > 0) /* the geometry check lets an empty view pass */
        return kv__error(KV_ERR_NULL, "kv_view_init: base is NULL with storage_bytes %zu",
                         storage_bytes);
    memset(&t, 0, sizeof(t));
    t.dtype = dtype;
    t.ndim = ndim;
    t.base = base;
    t.storage_bytes = storage_bytes;
    for (int i = 0; i < ndim; i++)
        t.shape[i] = shape[i];
    for (int i = 0; i < ndim; i++)
        if (t.shape[i] < 0)
            return kv__error(KV_ERR_BAD_SHAPE, "kv_view_init: negative size %" PRId64 " at dim %d",
                             t.shape[i], i);
    if (!kv__contig_strides(t.shape, ndim, t.strides)) {
        char b1[KV__LIST_BUF];
        return kv__error(KV_ERR_OVERFLOW, "kv_view_init: strides of shape %s overflow int64",
                         kv__fmt_list(b1, sizeof(b1), t.shape, ndim));
    }
    st =
        kv__check_geometry("kv_view_init", dtype, ndim, t.shape, t.strides, 0, base, storage_bytes);
    if (st != KV_OK)
        return st;
    *out = t;
    return kv__ok();
}

kv_status kv_view_as_strided(const struct kv_view *src, int ndim, const int64_t *shape,
                             const int64_t *strides, int64_t offset, struct kv_view *out)
{
    struct kv_view t;
    kv_status st;

    if (!src || !out)
        return kv__view_null("kv_view_as_strided", src, "src", out, "out");
    if (ndim > 0 && (!shape || !strides))
        return kv__view_null("kv_view_as_strided", shape, "shape", strides, "strides");
    if (ndim < 0 || ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "kv_view_as_strided: ndim %d outside 0..%d", ndim,
                         KV_MAX_DIMS);
    st = kv__check_geometry("kv_view_as_strided", src->dtype, ndim, shape, strides, offset,
                            src->base, src->storage_bytes);
    if (st != KV_OK)
        return st;
    t = *src;
    t.ndim = ndim;
    for (int i = 0; i < KV_MAX_DIMS; i++) {
        t.shape[i] = i < ndim ? shape[i] : 0;
        t.strides[i] = i < ndim ? strides[i] : 0;
    }
    t.offset = offset;
    *out = t;
    return kv__ok();
}

kv_status kv_view_from_strided(void *base, size_t storage_bytes, kv_dtype dtype, int ndim,
                               const int64_t *shape, const int64_t *strides, int64_t offset_bytes,
                               struct kv_view *out)
{
    static const char fn[] = "kv_view_from_strided";
    char b1[KV__LIST_BUF], b2[KV__LIST_BUF];
    struct kv_view t;
    int64_t numel, extent = 0;

    if (!out)
        return kv__error(KV_ERR_NULL, "%s: out is NULL", fn);
    if (ndim > 0 && (!shape || !strides))
        return kv__view_null(fn, shape, "shape", strides, "strides");
    if (!base && storage_bytes > 0)
        return kv__error(KV_ERR_NULL, "%s: base is NULL with storage_bytes %zu", fn, storage_bytes);
    size_t es;
    kv_status st = kv__check_dims(fn, dtype, ndim, shape, strides, &es);
    if (st != KV_OK)
        return st;
    if (offset_bytes < 0)
        return kv__error(KV_ERR_OUT_OF_BOUNDS, "%s: negative offset_bytes %" PRId64, fn,
                         offset_bytes);
    if (offset_bytes % (int64_t)es != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: offset_bytes %" PRId64 " is not a multiple of the %zu-byte element "
                         "size of %s",
                         fn, offset_bytes, es, kv_dtype_name(dtype));
    const int64_t offset = offset_bytes / (int64_t)es;
    if (!kv__shape_numel(shape, ndim, &numel))
        return kv__error(KV_ERR_OVERFLOW, "%s: element count of shape %s overflows int64", fn,
                         kv__fmt_list(b1, sizeof(b1), shape, ndim));
    if (numel > 0) {
        int64_t max_elem;
        if (!kv__extent_bytes(shape, strides, ndim, offset, es, &max_elem, &extent)
#if SIZE_MAX < INT64_MAX
            || (uint64_t)extent > (uint64_t)SIZE_MAX /* a 32-bit size_t */
#endif
        )
            return kv__error(KV_ERR_OVERFLOW,
                             "%s: shape %s strides %s from offset_bytes %" PRId64
                             " reach past int64 bytes",
                             fn, kv__fmt_list(b1, sizeof(b1), shape, ndim),
                             kv__fmt_list(b2, sizeof(b2), strides, ndim), offset_bytes);
    }
    if (storage_bytes == 0)
        storage_bytes = (size_t)extent;
    else if ((uint64_t)extent > (uint64_t)storage_bytes)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "%s: shape %s strides %s from offset_bytes %" PRId64 " reach byte %" PRId64
                         " (extent %" PRId64 " bytes) but storage_bytes is %zu",
                         fn, kv__fmt_list(b1, sizeof(b1), shape, ndim),
                         kv__fmt_list(b2, sizeof(b2), strides, ndim), offset_bytes, extent - 1,
                         extent, storage_bytes);
    /* what is left: the base (NULL with elements, misaligned) */
    st = kv__check_geometry(fn, dtype, ndim, shape, strides, offset, base, storage_bytes);
    if (st != KV_OK)
        return st;
    memset(&t, 0, sizeof(t));
    t.dtype = dtype;
    t.ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        t.shape[i] = shape[i];
        t.strides[i] = strides[i];
    }
    t.offset = offset;
    t.base = base;
    t.storage_bytes = storage_bytes;
    *out = t;
    return kv__ok();
}

kv_status kv_view_check(const struct kv_view *v)
{
    kv_status st;
    if (!v)
        return kv__error(KV_ERR_NULL, "kv_view_check: view is NULL");
    st = kv__check_geometry("kv_view_check", v->dtype, v->ndim, v->shape, v->strides, v->offset,
                            v->base, v->storage_bytes);
    return st == KV_OK ? kv__ok() : st;
}

/* Cheap shape sanity of an untrusted view (no error recorded): ndim in
 * range, a known dtype, no negative size. */
static bool kv__meta_ok(const struct kv_view *v)
{
    if (!v || v->ndim < 0 || v->ndim > KV_MAX_DIMS || kv_dtype_size(v->dtype) == 0)
        return false;
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] < 0)
            return false;
    return true;
}

int64_t kv_view_numel(const struct kv_view *v)
{
    int64_t n = 0;
    if (!kv__meta_ok(v) || !kv__shape_numel(v->shape, v->ndim, &n))
        return 0;
    return n;
}

size_t kv_view_elem_bytes(const struct kv_view *v)
{
    return v ? kv_dtype_size(v->dtype) : 0;
}

kv_status kv_view_offset_of(const struct kv_view *v, const int64_t *idx, int64_t *out_elems)
{
    int64_t off;
    if (!v || !out_elems || (!idx && v->ndim > 0))
        return kv__view_null("kv_view_offset_of", v, "view", idx, "idx");
    {
        /* an offset is only trustworthy for a view that fits its storage */
        kv_status st = kv__check_src("kv_view_offset_of", v);
        if (st != KV_OK)
            return st;
    }
    /* Every index first: an empty view (a size-0 dim) may carry any strides
     * on its other dims, so the sum is bounded by the validated extent only
     * once every index is known to be in range (there is then no element
     * at all to address, and the loop below never runs for it). */
    for (int i = 0; i < v->ndim; i++)
        if (idx[i] < 0 || idx[i] >= v->shape[i])
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "kv_view_offset_of: index %" PRId64 " out of range for dim %d of "
                             "size %" PRId64,
                             idx[i], i, v->shape[i]);
    off = v->offset;
    for (int i = 0; i < v->ndim; i++)
        off += idx[i] * v->strides[i]; /* bounded by the validated extent */
    *out_elems = off;
    return kv__ok();
}

void *kv_view_ptr(const struct kv_view *v, const int64_t *idx)
{
    int64_t off;
    if (kv_view_offset_of(v, idx, &off) != KV_OK)
        return NULL;
    return (char *)v->base + off * (int64_t)kv_dtype_size(v->dtype);
}

/* ---- predicates and describe -------------------------------------------- */

/* Whether v satisfies the view invariants, without touching kv_last_error():
 * predicates answer false for a view kv_view_check rejects. */
static bool kv__view_valid_quiet(const struct kv_view *v)
{
    kv__error_mute();
    bool ok = v && kv__check_src("kv_view_check", v) == KV_OK;
    kv__error_unmute();
    return ok;
}

bool kv_view_is_contiguous(const struct kv_view *v)
{
    int64_t expected = 1;
    if (!kv__view_valid_quiet(v))
        return false;
    if (kv_view_numel(v) == 0)
        return true;
    for (int d = v->ndim - 1; d >= 0; d--) {
        if (v->shape[d] == 1)
            continue;
        if (v->strides[d] != expected)
            return false;
        expected *= v->shape[d];
    }
    return true;
}

bool kv_view_is_f_contiguous(const struct kv_view *v)
{
    int64_t expected = 1;
    if (!kv__view_valid_quiet(v))
        return false;
    if (kv_view_numel(v) == 0)
        return true;
    for (int d = 0; d < v->ndim; d++) {
        if (v->shape[d] == 1)
            continue;
        if (v->strides[d] != expected)
            return false;
        expected *= v->shape[d];
    }
    return true;
}

/* "x * es" in decimal, or "(>int64)" when the byte value does not fit (a
 * size-1 dim may carry any stride: slice(..., step = 2^63 - 1)). */
static const char *kv__fmt_bytes_list(char *buf, size_t cap, const int64_t *v, int n, int64_t es)
{
    size_t used = 0;
    if (cap == 0)
        return buf;
    buf[0] = '\0';
    used += (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < n && used < cap; i++) {
        int64_t b;
        if (kv__mul_i64(v[i], es, &b))
            used += (size_t)snprintf(buf + used, cap - used, i ? ",%" PRId64 : "%" PRId64, b);
        else
            used += (size_t)snprintf(buf + used, cap - used, i ? ",(>int64)" : "(>int64)");
    }
    if (used < cap)
        snprintf(buf + used, cap - used, "]");
    return buf;
}

int kv_view_describe(const struct kv_view *v, char *buf, size_t cap)
{
    char sh[KV__LIST_BUF], st[KV__LIST_BUF], sb[KV__LIST_BUF * 2], ob[32];
    int64_t es, off_bytes = 0;
    bool off_ok;
    const char *contig;

    if (!v)
        return snprintf(buf, cap, "(null view)");
    /* never index or multiply the fields of a view the validator rejects:
     * print why instead (the same text kv_last_error() then holds) */
    if (kv__check_src("kv_view_describe", v) != KV_OK)
        return snprintf(buf, cap, "(invalid view: %s)", kv_last_error());
    es = (int64_t)kv_dtype_size(v->dtype);
    off_ok = kv__mul_i64(v->offset, es, &off_bytes); /* fails only for an empty view */
    if (off_ok)
        snprintf(ob, sizeof(ob), "%" PRId64, off_bytes);
    else
        snprintf(ob, sizeof(ob), "(>int64)");
    contig = kv_view_is_contiguous(v)
                 ? (kv_view_is_f_contiguous(v) && v->ndim > 1 && kv_view_numel(v) > 1 ? "C+F" : "C")
                 : (kv_view_is_f_contiguous(v) ? "F" : "no");
    return snprintf(buf, cap,
                    "shape=%s strides=%s elems (%s bytes) offset=%" PRId64 " (%s"
                    " bytes) dtype=%s numel=%" PRId64 " contiguous=%s storage=%p (%zu bytes) "
                    "first=%p",
                    kv__fmt_list(sh, sizeof(sh), v->shape, v->ndim),
                    kv__fmt_list(st, sizeof(st), v->strides, v->ndim),
                    kv__fmt_bytes_list(sb, sizeof(sb), v->strides, v->ndim, es), v->offset, ob,
                    kv_dtype_name(v->dtype), kv_view_numel(v), contig, v->base, v->storage_bytes,
                    v->base && off_ok ? (void *)((uintptr_t)v->base + (uintptr_t)off_bytes) : NULL);
}
