/*
 * kv_view.c - strided views: creation, checks and the metadata operations
 * (PyTorch semantics), plus the ops that copy only when no view exists.
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

static kv_status kv__view_null(const char *fn, const void *a, const char *an, const void *b,
                               const char *bn)
{
    return kv__error(KV_ERR_NULL, "%s: %s=%p %s=%p", fn, an, a, bn, b);
}

/* Product of shape[0..n) into *out; false when it overflows int64. */
static bool kv__shape_numel(const int64_t *shape, int n, int64_t *out)
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

/*
 * Check shape/strides/offset against a storage. fn names the caller for the
 * message. Returns KV_OK (without touching the last error) or an error.
 */
static kv_status kv__check_geometry(const char *fn, kv_dtype dtype, int ndim, const int64_t *shape,
                                    const int64_t *strides, int64_t offset, const void *base,
                                    size_t storage_bytes)
{
    char b1[KV__LIST_BUF], b2[KV__LIST_BUF];
    size_t es = kv_dtype_size(dtype);
    int64_t numel, max_elem = 0, hi_bytes = 0;

    if (es == 0)
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
    int64_t past_last;
    if (!kv__max_elem(shape, strides, ndim, offset, &max_elem) ||
        !kv__add_i64(max_elem, 1, &past_last) || !kv__mul_i64(past_last, (int64_t)es, &hi_bytes))
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
    return KV_OK;
}

/* Entry check of every op: src must satisfy the view invariants (O(ndim)),
 * so a hand-built view with a bad ndim, size, stride or offset is refused
 * before any of its arrays is indexed. */
static kv_status kv__check_src(const char *fn, const struct kv_view *src)
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
    if (ndim < 0 || ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "%s: ndim %d outside 0..%d", fn, ndim, KV_MAX_DIMS);
    const size_t es = kv_dtype_size(dtype);
    if (es == 0)
        return kv__error(KV_ERR_INVALID_ARG, "%s: unknown dtype %d", fn, (int)dtype);
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
        /* extent = (offset + sum (shape-1)*stride + 1) * elem_bytes: one past the last byte */
        int64_t max_elem;
        if (!kv__max_elem(shape, strides, ndim, offset, &max_elem) ||
            !kv__add_i64(max_elem, 1, &extent) || !kv__mul_i64(extent, (int64_t)es, &extent)
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
    kv_status st = kv__check_geometry(fn, dtype, ndim, shape, strides, offset, base, storage_bytes);
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
    off = v->offset;
    for (int i = 0; i < v->ndim; i++) {
        if (idx[i] < 0 || idx[i] >= v->shape[i])
            return kv__error(KV_ERR_OUT_OF_BOUNDS,
                             "kv_view_offset_of: index %" PRId64 " out of range for dim %d of "
                             "size %" PRId64,
                             idx[i], i, v->shape[i]);
        off += idx[i] * v->strides[i]; /* bounded by the validated extent */
    }
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

/* ---- metadata operations ------------------------------------------------ */

static kv_status kv__bad_dim(const char *fn, int dim, int ndim)
{
    return kv__error(KV_ERR_BAD_DIM, "%s: dim %d out of range for a %d-d view (valid %d..%d)", fn,
                     dim, ndim, ndim ? -ndim : -1, ndim ? ndim - 1 : 0);
}

/* *off += idx * stride with overflow detection (empty views may carry
 * strides no element ever uses, so these products are not bounded by the
 * storage). */
static kv_status kv__offset_add(const char *fn, int64_t *off, int64_t idx, int64_t stride)
{
    int64_t t;
    if (!kv__mul_i64(idx, stride, &t) || !kv__add_i64(*off, t, &t))
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: offset %" PRId64 " + %" PRId64 " * stride %" PRId64
                         " overflows int64",
                         fn, *off, idx, stride);
    *off = t;
    return KV_OK;
}

kv_status kv_view_permute(const struct kv_view *src, const int *perm, int n, struct kv_view *out)
{
    struct kv_view t;
    bool seen[KV_MAX_DIMS] = {false};

    if (!src || !out || (!perm && n > 0))
        return kv__view_null("kv_view_permute", src, "src", perm, "perm");
    {
        kv_status st0 = kv__check_src("kv_view_permute", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (n != src->ndim)
        return kv__error(KV_ERR_BAD_DIM,
                         "kv_view_permute: the permutation has %d entries for a %d-d view (it "
                         "must list each of the %d dims once)",
                         n, src->ndim, src->ndim);
    t = *src;
    for (int i = 0; i < src->ndim; i++) {
        int d;
        if (!kv__wrap_dim(perm[i], src->ndim, &d))
            return kv__error(KV_ERR_BAD_DIM,
                             "kv_view_permute: entry %d of the permutation is %d, outside %d..%d",
                             i, perm[i], -src->ndim, src->ndim - 1);
        if (seen[d])
            return kv__error(KV_ERR_INVALID_ARG,
                             "kv_view_permute: dim %d appears twice in the permutation (entry %d)",
                             d, i);
        seen[d] = true;
        t.shape[i] = src->shape[d];
        t.strides[i] = src->strides[d];
    }
    *out = t;
    return kv__ok();
}

kv_status kv_view_transpose(const struct kv_view *src, int dim0, int dim1, struct kv_view *out)
{
    struct kv_view t;
    int a, b;
    int64_t x;

    if (!src || !out)
        return kv__view_null("kv_view_transpose", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_transpose", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (src->ndim == 0 && (dim0 == 0 || dim0 == -1) && (dim1 == 0 || dim1 == -1)) {
        *out = *src; /* PyTorch allows transpose(0, 0) of a 0-d tensor */
        return kv__ok();
    }
    if (!kv__wrap_dim(dim0, src->ndim, &a))
        return kv__bad_dim("kv_view_transpose", dim0, src->ndim);
    if (!kv__wrap_dim(dim1, src->ndim, &b))
        return kv__bad_dim("kv_view_transpose", dim1, src->ndim);
    t = *src;
    x = t.shape[a], t.shape[a] = t.shape[b], t.shape[b] = x;
    x = t.strides[a], t.strides[a] = t.strides[b], t.strides[b] = x;
    *out = t;
    return kv__ok();
}

kv_status kv_view_slice(const struct kv_view *src, int dim, int64_t start, int64_t stop,
                        int64_t step, struct kv_view *out)
{
    struct kv_view t;
    int d;
    int64_t size, len;

    if (!src || !out)
        return kv__view_null("kv_view_slice", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_slice", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (!kv__wrap_dim(dim, src->ndim, &d))
        return kv__bad_dim("kv_view_slice", dim, src->ndim);
    if (step <= 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_view_slice: step %" PRId64 " must be >= 1", step);
    size = src->shape[d];
    if (start < 0)
        start = start < -size ? 0 : start + size;
    if (stop < 0)
        stop = stop < -size ? 0 : stop + size;
    if (start > size)
        start = size;
    if (stop > size)
        stop = size;
    len = start < stop ? (stop - start - 1) / step + 1 : 0;
    if (stop < start)
        stop = start;
    t = *src;
    if (kv__offset_add("kv_view_slice", &t.offset, start, src->strides[d]) != KV_OK)
        return KV_ERR_OVERFLOW;
    t.shape[d] = len;
    if (!kv__mul_i64(src->strides[d], step, &t.strides[d]))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_view_slice: stride %" PRId64 " * step %" PRId64 " overflows int64",
                         src->strides[d], step);
    *out = t;
    return kv__ok();
}

kv_status kv_view_narrow(const struct kv_view *src, int dim, int64_t start, int64_t length,
                         struct kv_view *out)
{
    struct kv_view t;
    int d;
    int64_t size;

    if (!src || !out)
        return kv__view_null("kv_view_narrow", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_narrow", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (!kv__wrap_dim(dim, src->ndim, &d))
        return kv__bad_dim("kv_view_narrow", dim, src->ndim);
    size = src->shape[d];
    if (start < -size || start > size)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_view_narrow: start %" PRId64
                         " out of range for dim %d of size %" PRId64,
                         start, d, size);
    if (start < 0)
        start += size;
    if (length < 0 || length > size - start)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_view_narrow: start %" PRId64 " + length %" PRId64
                         " exceeds dim %d of size %" PRId64,
                         start, length, d, size);
    t = *src;
    if (kv__offset_add("kv_view_narrow", &t.offset, start, src->strides[d]) != KV_OK)
        return KV_ERR_OVERFLOW;
    t.shape[d] = length;
    *out = t;
    return kv__ok();
}

kv_status kv_view_select(const struct kv_view *src, int dim, int64_t index, struct kv_view *out)
{
    struct kv_view t;
    int d;
    int64_t size;

    if (!src || !out)
        return kv__view_null("kv_view_select", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_select", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (!kv__wrap_dim(dim, src->ndim, &d))
        return kv__bad_dim("kv_view_select", dim, src->ndim);
    size = src->shape[d];
    if (index < -size || index >= size)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_view_select: index %" PRId64
                         " out of range for dim %d of size %" PRId64,
                         index, d, size);
    if (index < 0)
        index += size;
    t = *src;
    if (kv__offset_add("kv_view_select", &t.offset, index, src->strides[d]) != KV_OK)
        return KV_ERR_OVERFLOW;
    for (int i = d; i < src->ndim - 1; i++) {
        t.shape[i] = src->shape[i + 1];
        t.strides[i] = src->strides[i + 1];
    }
    t.ndim--;
    t.shape[t.ndim] = 0;
    t.strides[t.ndim] = 0;
    *out = t;
    return kv__ok();
}

kv_status kv_view_unsqueeze(const struct kv_view *src, int dim, struct kv_view *out)
{
    struct kv_view t;
    int d;

    if (!src || !out)
        return kv__view_null("kv_view_unsqueeze", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_unsqueeze", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (src->ndim >= KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "kv_view_unsqueeze: view already has %d dims (max %d)",
                         src->ndim, KV_MAX_DIMS);
    if (!kv__wrap_dim(dim, src->ndim + 1, &d))
        return kv__bad_dim("kv_view_unsqueeze", dim, src->ndim + 1);
    t = *src;
    for (int i = src->ndim; i > d; i--) {
        t.shape[i] = src->shape[i - 1];
        t.strides[i] = src->strides[i - 1];
    }
    t.shape[d] = 1;
    t.strides[d] = 1;
    if (d < src->ndim && !kv__mul_i64(src->shape[d], src->strides[d], &t.strides[d]))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_view_unsqueeze: size %" PRId64 " * stride %" PRId64
                         " of dim %d overflows int64",
                         src->shape[d], src->strides[d], d);
    t.ndim++;
    *out = t;
    return kv__ok();
}

kv_status kv_view_squeeze(const struct kv_view *src, int dim, struct kv_view *out)
{
    int d;

    if (!src || !out)
        return kv__view_null("kv_view_squeeze", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_squeeze", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (src->ndim == 0 && (dim == 0 || dim == -1)) {
        *out = *src;
        return kv__ok();
    }
    if (!kv__wrap_dim(dim, src->ndim, &d))
        return kv__bad_dim("kv_view_squeeze", dim, src->ndim);
    if (src->shape[d] != 1) {
        *out = *src;
        return kv__ok();
    }
    return kv_view_select(src, d, 0, out);
}

kv_status kv_view_expand(const struct kv_view *src, int ndim, const int64_t *shape,
                         struct kv_view *out)
{
    struct kv_view t;
    char b1[KV__LIST_BUF], b2[KV__LIST_BUF];
    int lead;
    int64_t numel;

    if (!src || !out || (!shape && ndim > 0))
        return kv__view_null("kv_view_expand", src, "src", shape, "shape");
    {
        kv_status st0 = kv__check_src("kv_view_expand", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (ndim < src->ndim || ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM,
                         "kv_view_expand: target has %d dims; it needs %d..%d for a %d-d view",
                         ndim, src->ndim, KV_MAX_DIMS, src->ndim);
    lead = ndim - src->ndim;
    t = *src;
    t.ndim = ndim;
    for (int i = ndim - 1; i >= 0; i--) {
        int j = i - lead;
        int64_t want = shape[i];
        if (j < 0) {
            if (want < 0)
                return kv__error(KV_ERR_BAD_SHAPE,
                                 "kv_view_expand: size %" PRId64 " for new leading dim %d of %s "
                                 "(-1 is not allowed there)",
                                 want, i, kv__fmt_list(b1, sizeof(b1), shape, ndim));
            t.shape[i] = want;
            /* PyTorch: a new size-1 dim gets the stride that would make it
             * contiguous with the dim to its right; a broadcast one gets 0. */
            t.strides[i] = want != 1 ? 0 : 1;
            if (want == 1 && i + 1 < ndim &&
                !kv__mul_i64(t.shape[i + 1], t.strides[i + 1], &t.strides[i]))
                return kv__error(KV_ERR_OVERFLOW,
                                 "kv_view_expand: stride of new dim %d (%" PRId64 " * %" PRId64
                                 ") overflows int64",
                                 i, t.shape[i + 1], t.strides[i + 1]);
        } else if (want == -1 || want == src->shape[j]) {
            t.shape[i] = src->shape[j];
            t.strides[i] = src->strides[j];
        } else if (src->shape[j] == 1 && want >= 0) {
            t.shape[i] = want;
            t.strides[i] = 0;
        } else {
            return kv__error(KV_ERR_BAD_SHAPE,
                             "kv_view_expand: dim %d of size %" PRId64 " (shape %s) cannot expand "
                             "to %" PRId64 " (target %s); only size-1 dims expand",
                             j, src->shape[j], kv__fmt_list(b1, sizeof(b1), src->shape, src->ndim),
                             want, kv__fmt_list(b2, sizeof(b2), shape, ndim));
        }
    }
    if (!kv__shape_numel(t.shape, ndim, &numel))
        return kv__error(KV_ERR_OVERFLOW, "kv_view_expand: element count of %s overflows int64",
                         kv__fmt_list(b1, sizeof(b1), shape, ndim));
    *out = t;
    return kv__ok();
}

kv_status kv_view_diagonal(const struct kv_view *src, int64_t offset, int dim1, int dim2,
                           struct kv_view *out)
{
    struct kv_view t;
    int a, b, k = 0;
    int64_t sa, sb, size, diag_stride;

    if (!src || !out)
        return kv__view_null("kv_view_diagonal", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_diagonal", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (!kv__wrap_dim(dim1, src->ndim, &a))
        return kv__bad_dim("kv_view_diagonal", dim1, src->ndim);
    if (!kv__wrap_dim(dim2, src->ndim, &b))
        return kv__bad_dim("kv_view_diagonal", dim2, src->ndim);
    if (a == b)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_view_diagonal: dim1 and dim2 are both dim %d; they must differ", a);
    sa = src->shape[a];
    sb = src->shape[b];
    if (offset >= 0)
        size = offset >= sb ? 0 : (sa < sb - offset ? sa : sb - offset);
    else
        size = offset <= -sa ? 0 : (sa + offset < sb ? sa + offset : sb);
    t = *src;
    /* size > 0 bounds |offset| by a dim size, so the negation is safe */
    if (size > 0 && kv__offset_add("kv_view_diagonal", &t.offset, offset >= 0 ? offset : -offset,
                                   offset >= 0 ? src->strides[b] : src->strides[a]) != KV_OK)
        return KV_ERR_OVERFLOW;
    if (!kv__add_i64(src->strides[a], src->strides[b], &diag_stride))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_view_diagonal: strides %" PRId64 " + %" PRId64 " overflow int64",
                         src->strides[a], src->strides[b]);
    for (int i = 0; i < src->ndim; i++) {
        if (i == a || i == b)
            continue;
        t.shape[k] = src->shape[i];
        t.strides[k] = src->strides[i];
        k++;
    }
    t.shape[k] = size;
    t.strides[k] = diag_stride;
    t.ndim = k + 1;
    for (int i = t.ndim; i < KV_MAX_DIMS; i++)
        t.shape[i] = t.strides[i] = 0;
    *out = t;
    return kv__ok();
}

/*
 * Resolve one -1 in shape[ndim] against numel (PyTorch infer_size) into
 * resolved[]. fn names the caller for the message.
 */
static kv_status kv__infer_shape(const char *fn, const int64_t *shape, int ndim, int64_t numel,
                                 int64_t *resolved)
{
    char b1[KV__LIST_BUF];
    int64_t newsize = 1;
    int infer = -1;

    if (ndim < 0 || ndim > KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM, "%s: target ndim %d outside 0..%d", fn, ndim, KV_MAX_DIMS);
    /* a 0 anywhere makes the count 0 whatever the other sizes: [2^62, 0, 2^62]
     * holds no element and its product must not be taken */
    bool has_zero = false;
    for (int i = 0; i < ndim; i++)
        has_zero |= shape[i] == 0;
    for (int i = 0; i < ndim; i++) {
        resolved[i] = shape[i];
        if (shape[i] == -1) {
            if (infer >= 0)
                return kv__error(KV_ERR_BAD_SHAPE,
                                 "%s: only one dimension can be inferred, %s has -1 at dims %d "
                                 "and %d",
                                 fn, kv__fmt_list(b1, sizeof(b1), shape, ndim), infer, i);
            infer = i;
        } else if (shape[i] < 0) {
            return kv__error(KV_ERR_BAD_SHAPE, "%s: invalid size %" PRId64 " at dim %d of %s", fn,
                             shape[i], i, kv__fmt_list(b1, sizeof(b1), shape, ndim));
        } else if (has_zero) {
            newsize = 0;
        } else if (!kv__mul_i64(newsize, shape[i], &newsize)) {
            return kv__error(KV_ERR_OVERFLOW, "%s: element count of %s overflows int64", fn,
                             kv__fmt_list(b1, sizeof(b1), shape, ndim));
        }
    }
    if (numel == newsize && infer < 0)
        return KV_OK;
    if (infer >= 0 && newsize > 0 && numel % newsize == 0) {
        resolved[infer] = numel / newsize;
        return KV_OK;
    }
    if (infer >= 0 && newsize == 0)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: cannot reshape %" PRId64 " elements into %s: the -1 could be any "
                         "value",
                         fn, numel, kv__fmt_list(b1, sizeof(b1), shape, ndim));
    return kv__error(KV_ERR_BAD_SHAPE, "%s: shape %s is invalid for a view of %" PRId64 " elements",
                     fn, kv__fmt_list(b1, sizeof(b1), shape, ndim), numel);
}

/*
 * PyTorch computeStride: strides for viewing (oshape, ostride) as nshape
 * without a copy. Returns false when impossible and names the first chunk of
 * old dims [*bad_lo, *bad_hi] that could not be split/merged; *overflow is
 * set (and false returned) when a stride would not fit int64 (possible for
 * empty views and size-1 dims, whose strides no element uses).
 */
static bool kv__compute_strides(const int64_t *oshape, const int64_t *ostride, int ondim,
                                const int64_t *nshape, int nndim, int64_t numel, int64_t *nstride,
                                int *bad_lo, int *bad_hi, bool *overflow)
{
    int view_d = nndim - 1, chunk_hi = ondim - 1;
    int64_t chunk_base, tensor_numel = 1, view_numel = 1, prod;

    *overflow = false;
    if (ondim == 0) {
        for (int i = 0; i < nndim; i++)
            nstride[i] = 1;
        return true;
    }
    if (numel == 0) {
        bool same = ondim == nndim;
        for (int i = 0; same && i < ondim; i++)
            same = oshape[i] == nshape[i];
        if (same) {
            for (int i = 0; i < nndim; i++)
                nstride[i] = ostride[i];
            return true;
        }
        /* [0] as [0, 2^22, 2^22, 2^22]: the C-order strides of an empty
         * shape can still exceed int64 */
        for (int d = nndim - 1; d >= 0; d--) {
            if (d == nndim - 1) {
                nstride[d] = 1;
            } else if (!kv__mul_i64(nshape[d + 1] > 1 ? nshape[d + 1] : 1, nstride[d + 1],
                                    &nstride[d])) {
                *overflow = true;
                return false;
            }
        }
        return true;
    }
    chunk_base = ostride[ondim - 1];
    for (int td = ondim - 1; td >= 0; td--) {
        tensor_numel *= oshape[td]; /* <= numel > 0: fits */
        if (td == 0 || (oshape[td - 1] != 1 && (!kv__mul_i64(tensor_numel, chunk_base, &prod) ||
                                                ostride[td - 1] != prod))) {
            while (view_d >= 0 && (view_numel < tensor_numel || nshape[view_d] == 1)) {
                /* chunk_base may be the stride of a size-1 dim, which no
                 * element uses and so is not bounded by the storage */
                if (!kv__mul_i64(view_numel, chunk_base, &nstride[view_d])) {
                    *overflow = true;
                    return false;
                }
                view_numel *= nshape[view_d];
                view_d--;
            }
            if (view_numel != tensor_numel) {
                *bad_lo = td;
                *bad_hi = chunk_hi;
                return false;
            }
            if (td > 0) {
                chunk_base = ostride[td - 1];
                tensor_numel = 1;
                view_numel = 1;
                chunk_hi = td - 1;
            }
        }
    }
    if (view_d != -1) {
        *bad_lo = 0;
        *bad_hi = ondim - 1;
        return false;
    }
    return true;
}

/*
 * Try the no-copy view; on failure lo..hi name the offending old dims and
 * `resolved` holds the inferred target shape.
 */
static kv_status kv__try_view(const char *fn, const struct kv_view *src, int ndim,
                              const int64_t *shape, struct kv_view *t, int64_t *resolved, int *lo,
                              int *hi)
{
    kv_status st;
    int64_t numel = kv_view_numel(src);

    st = kv__infer_shape(fn, shape, ndim, numel, resolved);
    if (st != KV_OK)
        return st;
    *t = *src;
    bool overflow = false;
    if (!kv__compute_strides(src->shape, src->strides, src->ndim, resolved, ndim, numel, t->strides,
                             lo, hi, &overflow)) {
        char b1[KV__LIST_BUF], b2[KV__LIST_BUF];
        if (overflow)
            return kv__error(KV_ERR_OVERFLOW,
                             "%s: the strides of shape %s (viewing shape %s) overflow int64", fn,
                             kv__fmt_list(b1, sizeof(b1), resolved, ndim),
                             kv__fmt_list(b2, sizeof(b2), src->shape, src->ndim));
        return KV_ERR_NEEDS_COPY;
    }
    t->ndim = ndim;
    for (int i = 0; i < KV_MAX_DIMS; i++) {
        t->shape[i] = i < ndim ? resolved[i] : 0;
        if (i >= ndim)
            t->strides[i] = 0;
    }
    return KV_OK;
}

static kv_status kv__needs_copy_error(const char *fn, const struct kv_view *src, const int64_t *rs,
                                      int ndim, int lo, int hi)
{
    char b1[KV__LIST_BUF], b2[KV__LIST_BUF], b3[KV__LIST_BUF];
    (void)hi;
    if (lo < 1) /* not reached for valid input: computeStride fails only at a chunk edge */
        return kv__error(KV_ERR_NEEDS_COPY, "%s: shape %s with strides %s cannot be viewed as %s",
                         fn, kv__fmt_list(b1, sizeof(b1), src->shape, src->ndim),
                         kv__fmt_list(b2, sizeof(b2), src->strides, src->ndim),
                         kv__fmt_list(b3, sizeof(b3), rs, ndim));
    return kv__error(KV_ERR_NEEDS_COPY,
                     "%s: shape %s with strides %s cannot be viewed as %s without a copy: dims "
                     "%d and %d cannot be merged (stride %" PRId64 " != %" PRId64 " * %" PRId64
                     ") and the target shape does not split between them (use reshape)",
                     fn, kv__fmt_list(b1, sizeof(b1), src->shape, src->ndim),
                     kv__fmt_list(b2, sizeof(b2), src->strides, src->ndim),
                     kv__fmt_list(b3, sizeof(b3), rs, ndim), lo - 1, lo, src->strides[lo - 1],
                     src->shape[lo], src->strides[lo]);
}

kv_status kv_view_view(const struct kv_view *src, int ndim, const int64_t *shape,
                       struct kv_view *out)
{
    struct kv_view t;
    int64_t rs[KV_MAX_DIMS];
    int lo = 0, hi = 0;
    kv_status st;

    if (!src || !out || (!shape && ndim > 0))
        return kv__view_null("kv_view_view", src, "src", shape, "shape");
    {
        kv_status st0 = kv__check_src("kv_view_view", src);
        if (st0 != KV_OK)
            return st0;
    }
    st = kv__try_view("kv_view_view", src, ndim, shape, &t, rs, &lo, &hi);
    if (st == KV_ERR_NEEDS_COPY)
        return kv__needs_copy_error("kv_view_view", src, rs, ndim, lo, hi);
    if (st != KV_OK)
        return st;
    *out = t;
    return kv__ok();
}

kv_status kv_view_sliding_window(const struct kv_view *src, int dim, int64_t window,
                                 struct kv_view *out)
{
    int64_t shape[KV_MAX_DIMS], strides[KV_MAX_DIMS];
    int d;

    if (!src || !out)
        return kv__view_null("kv_view_sliding_window", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_sliding_window", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (!kv__wrap_dim(dim, src->ndim, &d))
        return kv__bad_dim("kv_view_sliding_window", dim, src->ndim);
    if (src->ndim >= KV_MAX_DIMS)
        return kv__error(KV_ERR_BAD_DIM,
                         "kv_view_sliding_window: view already has %d dims (max %d)", src->ndim,
                         KV_MAX_DIMS);
    if (window < 0 || window > src->shape[d])
        return kv__error(KV_ERR_BAD_SHAPE,
                         "kv_view_sliding_window: window %" PRId64 " must be in 0..%" PRId64
                         " (size of dim %d)",
                         window, src->shape[d], d);
    for (int i = 0; i < src->ndim; i++) {
        shape[i] = src->shape[i];
        strides[i] = src->strides[i];
    }
    if (!kv__add_i64(src->shape[d] - window, 1, &shape[d])) /* window 0 of an INT64_MAX dim */
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_view_sliding_window: %" PRId64 " windows of %" PRId64
                         " along dim %d overflow int64",
                         src->shape[d], window, d);
    shape[src->ndim] = window;
    strides[src->ndim] = src->strides[d];
    return kv_view_as_strided(src, src->ndim + 1, shape, strides, src->offset, out);
}

/* ---- operations that may copy ------------------------------------------- */

/* Materialize src into dst as a contiguous view of shape rs[ndim]. */
static kv_status kv__copy_into(const char *fn, kv_copy_reason why, const struct kv_view *src,
                               const int64_t *rs, int ndim, void *dst, size_t dst_bytes,
                               struct kv_view *out)
{
    struct kv_view d;
    kv_status st;
    int64_t numel = kv_view_numel(src);
    size_t need = (size_t)numel * kv_dtype_size(src->dtype);

    if (!dst)
        return KV_ERR_NEEDS_COPY;
    if (dst_bytes < need)
        return kv__error(KV_ERR_OUT_OF_BOUNDS, "%s: copy needs %zu bytes but dst has %zu", fn, need,
                         dst_bytes);
    st = kv_view_init(dst, dst_bytes, src->dtype, src->ndim, src->shape, &d);
    if (st != KV_OK)
        return st;
    if (kv_view_may_share(&d, src)) {
        bool shares = true;
        st = kv_view_shares(&d, src, 0, &shares);
        if (st == KV_ERR_TOO_COSTLY)
            return kv__error(KV_ERR_OVERLAP,
                             "%s: dst buffer %p (%zu bytes) lies within the source's extent and "
                             "could not be proven disjoint from its elements within the work bound",
                             fn, dst, dst_bytes);
        if (st != KV_OK || shares)
            return kv__error(KV_ERR_OVERLAP, "%s: dst buffer %p (%zu bytes) overlaps the source",
                             fn, dst, dst_bytes);
    }
    kv__view_copy_unchecked(src, &d);
    kv__copy_count(why, need);
    st = kv_view_init(dst, dst_bytes, src->dtype, ndim, rs, out);
    return st;
}

static kv_status kv__reshape(const char *fn, kv_copy_reason why, const struct kv_view *src,
                             int ndim, const int64_t *shape, void *dst, size_t dst_bytes,
                             struct kv_view *out, bool *copied)
{
    struct kv_view t;
    int64_t rs[KV_MAX_DIMS];
    int lo = 0, hi = 0;
    kv_status st;

    if (!src || !out || (!shape && ndim > 0))
        return kv__view_null(fn, src, "src", shape, "shape");
    st = kv_view_check(src);
    if (st != KV_OK)
        return st;
    st = kv__try_view(fn, src, ndim, shape, &t, rs, &lo, &hi);
    if (st == KV_OK) {
        *out = t;
        if (copied)
            *copied = false;
        return kv__ok();
    }
    if (st != KV_ERR_NEEDS_COPY)
        return st;
    st = kv__copy_into(fn, why, src, rs, ndim, dst, dst_bytes, &t);
    if (st == KV_ERR_NEEDS_COPY)
        return kv__needs_copy_error(fn, src, rs, ndim, lo, hi);
    if (st != KV_OK)
        return st;
    *out = t;
    if (copied)
        *copied = true;
    return kv__ok();
}

kv_status kv_view_reshape(const struct kv_view *src, int ndim, const int64_t *shape, void *dst,
                          size_t dst_bytes, struct kv_view *out, bool *copied)
{
    return kv__reshape("kv_view_reshape", KV_COPY_RESHAPE, src, ndim, shape, dst, dst_bytes, out,
                       copied);
}

kv_status kv_view_flatten(const struct kv_view *src, int start_dim, int end_dim, void *dst,
                          size_t dst_bytes, struct kv_view *out, bool *copied)
{
    int64_t shape[KV_MAX_DIMS];
    int a, b, n = 0;
    int64_t merged = 1;

    if (!src || !out)
        return kv__view_null("kv_view_flatten", src, "src", out, "out");
    {
        kv_status st0 = kv__check_src("kv_view_flatten", src);
        if (st0 != KV_OK)
            return st0;
    }
    if (src->ndim == 0) {
        int64_t one = 1;
        if (!(start_dim == 0 || start_dim == -1) || !(end_dim == 0 || end_dim == -1))
            return kv__bad_dim("kv_view_flatten", start_dim, 0);
        return kv__reshape("kv_view_flatten", KV_COPY_FLATTEN, src, 1, &one, dst, dst_bytes, out,
                           copied);
    }
    if (!kv__wrap_dim(start_dim, src->ndim, &a))
        return kv__bad_dim("kv_view_flatten", start_dim, src->ndim);
    if (!kv__wrap_dim(end_dim, src->ndim, &b))
        return kv__bad_dim("kv_view_flatten", end_dim, src->ndim);
    if (a > b)
        return kv__error(KV_ERR_BAD_DIM, "kv_view_flatten: start_dim %d comes after end_dim %d", a,
                         b);
    if (a == b) {
        kv_status st = kv_view_check(src);
        if (st != KV_OK)
            return st;
        *out = *src;
        if (copied)
            *copied = false;
        return kv__ok();
    }
    for (int i = 0; i < a; i++)
        shape[n++] = src->shape[i];
    for (int i = a; i <= b; i++) {
        /* not bounded by numel when another dim is 0: [0, 2^40, 2^40] */
        if (!kv__mul_i64(merged, src->shape[i], &merged)) {
            char b1[KV__LIST_BUF];
            return kv__error(KV_ERR_OVERFLOW,
                             "kv_view_flatten: merging dims %d..%d of shape %s overflows int64", a,
                             b, kv__fmt_list(b1, sizeof(b1), src->shape, src->ndim));
        }
    }
    shape[n++] = merged;
    for (int i = b + 1; i < src->ndim; i++)
        shape[n++] = src->shape[i];
    return kv__reshape("kv_view_flatten", KV_COPY_FLATTEN, src, n, shape, dst, dst_bytes, out,
                       copied);
}

kv_status kv_view_contiguous(const struct kv_view *src, void *dst, size_t dst_bytes,
                             struct kv_view *out, bool *copied)
{
    struct kv_view t;
    kv_status st;

    if (!src || !out)
        return kv__view_null("kv_view_contiguous", src, "src", out, "out");
    st = kv_view_check(src);
    if (st != KV_OK)
        return st;
    if (kv_view_is_contiguous(src)) {
        *out = *src;
        if (copied)
            *copied = false;
        return kv__ok();
    }
    st = kv__copy_into("kv_view_contiguous", KV_COPY_CONTIGUOUS, src, src->shape, src->ndim, dst,
                       dst_bytes, &t);
    if (st == KV_ERR_NEEDS_COPY)
        return kv__error(KV_ERR_NEEDS_COPY,
                         "kv_view_contiguous: the view is not contiguous and no dst buffer was "
                         "given (%zu bytes needed)",
                         (size_t)kv_view_numel(src) * kv_dtype_size(src->dtype));
    if (st != KV_OK)
        return st;
    *out = t;
    if (copied)
        *copied = true;
    return kv__ok();
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
