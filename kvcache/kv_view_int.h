/*
 * kv_view_int.h - private helpers shared by the kv_view*.c files.
 */
#ifndef KV_VIEW_INT_H
#define KV_VIEW_INT_H

#include "kv_view.h"
#include "kv_lib.h"

/* Count one copy of `bytes` for `reason` (atomic). */
void kv__copy_count(kv_copy_reason reason, uint64_t bytes);

/* The copy engine behind materialize/copy/reshape/contiguous: dst and src
 * have the same shape and dtype, dst has no internal overlap and does not
 * overlap src (callers check). Does not count. */
void kv__view_copy_unchecked(const struct kv_view *src, const struct kv_view *dst);

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

#endif /* KV_VIEW_INT_H */
