/*
 * kv_view_int.h - private helpers shared by the kv_view*.c files.
 */
#ifndef KV_VIEW_INT_H
#define KV_VIEW_INT_H

#include "kv_lib.h"
#include "kv_view.h"
#include "kv_view_hd.h"

/* The copy engine behind materialize/copy/reshape/contiguous: dst and src
 * have the same shape and dtype, dst has no internal overlap and does not
 * overlap src (callers check). Does not count. */
void kv__view_copy_unchecked(const struct kv_view *src, const struct kv_view *dst);

/* The geometry of a (validated) view, for the shared addressing header. */
static inline struct kv_view_geom kv__view_geom(const struct kv_view *v)
{
    struct kv_view_geom g;
    g.ndim = v->ndim;
    for (int i = 0; i < 8; i++) {
        g.shape[i] = i < v->ndim ? v->shape[i] : 1;
        g.strides[i] = i < v->ndim ? v->strides[i] : 0;
    }
    g.offset = v->offset;
    return g;
}

/* The one validator of a view copy, CPU and CUDA alike (kv_view_copy,
 * kv_view_copy_cuda; the kernels in attention/ follow the same pattern):
 * both views valid, same shape and dtype, dst without internal overlap, dst
 * and src disjoint (exactly, within a work bound). fn names the public entry
 * in every message. KV_OK or the error, with nothing written. */
kv_status kv__view_copy_check(const char *fn, const struct kv_view *src, const struct kv_view *dst);

/* Normalize a possibly negative dim against ndim (dims valid: 0..ndim-1);
 * returns false when out of range. */
static inline bool kv__wrap_dim(int dim, int ndim, int *out)
{
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= ndim)
        return false;
    *out = d;
    return true;
}

/* Shared by kv_view.c, kv_view_ops.c and kv_view_reshape.c. */
/* KV_ERR_NULL naming a or b when NULL (b may be absent: bn NULL). */
kv_status kv__view_null(const char *fn, const void *a, const char *an, const void *b,
                        const char *bn);
/* The element count of shape[n] (false on overflow). */
bool kv__shape_numel(const int64_t *shape, int n, int64_t *out);
/* src valid, as kv_view_check says, with fn's name on the message. */
kv_status kv__check_src(const char *fn, const struct kv_view *src);
/* KV_ERR_BAD_DIM naming dim and the valid range for ndim. */
kv_status kv__bad_dim(const char *fn, int dim, int ndim);

#endif /* KV_VIEW_INT_H */
