/*
 * kv_view_ops.c - the metadata operations on strided views, PyTorch
 * semantics (kv_view.h): permute, transpose, slice, narrow, select,
 * unsqueeze, squeeze, expand, diagonal. None copies a byte; each works on a
 * local copy of its source and assigns *out only on success.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kv_view_int.h"

#define KV__LIST_BUF 160

/* ---- metadata operations ------------------------------------------------ */

kv_status kv__bad_dim(const char *fn, int dim, int ndim)
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
    /* one element or none: the step is never taken, so a stride * step past
     * int64 (a huge step) keeps the source's stride instead of refusing */
    if (!kv__mul_i64(src->strides[d], step, &t.strides[d])) {
        if (len > 1)
            return kv__error(KV_ERR_OVERFLOW,
                             "kv_view_slice: stride %" PRId64 " * step %" PRId64 " overflows int64",
                             src->strides[d], step);
        t.strides[d] = src->strides[d];
    }
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
