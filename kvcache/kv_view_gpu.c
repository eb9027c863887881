/*
 * kv_view_gpu.c - public entry of device-side view copies: validates on the
 * host, then launches through the CUDA boundary (kv_view_cuda_int.h).
 */
#include <stdio.h>

#include "kv_view_cuda_int.h"
#include "kv_view_int.h"

static struct kv_view_geom kv__geom(const struct kv_view *v)
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

kv_status kv_view_copy_cuda(const struct kv_view *src, const struct kv_view *dst,
                            kv_cuda_stream stream)
{
    kv_status st;
    bool overlap = true;

    if (!dst || !src)
        return kv__error(KV_ERR_NULL, "kv_view_copy_cuda: dst=%p src=%p", (const void *)dst,
                         (const void *)src);
    if ((st = kv_view_check(dst)) != KV_OK || (st = kv_view_check(src)) != KV_OK)
        return st;
    if (dst->dtype != src->dtype)
        return kv__error(KV_ERR_INVALID_ARG, "kv_view_copy_cuda: dtypes differ (dst %s, src %s)",
                         kv_dtype_name(dst->dtype), kv_dtype_name(src->dtype));
    if (dst->ndim != src->ndim)
        return kv__error(KV_ERR_BAD_SHAPE, "kv_view_copy_cuda: ndim differs (dst %d, src %d)",
                         dst->ndim, src->ndim);
    for (int i = 0; i < dst->ndim; i++)
        if (dst->shape[i] != src->shape[i])
            return kv__error(KV_ERR_BAD_SHAPE,
                             "kv_view_copy_cuda: dim %d differs (dst %lld, src %lld)", i,
                             (long long)dst->shape[i], (long long)src->shape[i]);
    st = kv_view_has_internal_overlap(dst, 0, &overlap);
    if (st != KV_OK || overlap)
        return kv__error(KV_ERR_OVERLAP,
                         "kv_view_copy_cuda: destination elements overlap each other (or could "
                         "not be proven disjoint)");
    if (kv_view_may_share(dst, src)) {
        bool shares = true;
        if (kv_view_shares(dst, src, 0, &shares) != KV_OK || shares)
            return kv__error(KV_ERR_OVERLAP, "kv_view_copy_cuda: dst and src overlap");
    }
    st = kv__cuda_view_copy(dst->base, kv__geom(dst), src->base, kv__geom(src), kv_view_numel(src),
                            (int)kv_dtype_size(src->dtype), stream);
    if (st != KV_OK)
        return st;
    kv__copy_count(KV_COPY_VIEW_COPY, (uint64_t)kv_view_numel(src) * kv_dtype_size(src->dtype));
    return kv__ok();
}
