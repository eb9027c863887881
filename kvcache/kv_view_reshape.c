/*
 * kv_view_reshape.c - view (no copy, or a clear KV_ERR_NEEDS_COPY), the
 * sliding window, and the ops that copy only when no view exists:
 * reshape, flatten, contiguous (kv_view.h). The stride computation is
 * PyTorch's (computeStride): a view exists exactly when it does there.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kv_view_int.h"

#define KV__LIST_BUF 160

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
