/*
 * kv_view_gpu.c - public entry of device-side view copies: the CPU path's
 * validator (kv__view_copy_check), the shared plan (kv_view_hd.h), then
 * the launch through the CUDA boundary (kv_view_cuda_int.h). The template
 * every CUDA kernel of the library follows (docs/design.md, "Backends").
 */
#include <stdatomic.h>

#include "kv_view_cuda_int.h"
#include "kv_view_int.h"

static _Atomic uint64_t kv__cuda_copy_paths[KV__CUDA_COPY_PATHS];

kv_status kv_view_copy_cuda(const struct kv_view *src, const struct kv_view *dst,
                            kv_cuda_stream stream)
{
    struct kv_copy_plan plan;
    int path = -1;
    kv_status st = kv__view_copy_check("kv_view_copy_cuda", src, dst);
    if (st != KV_OK)
        return st;
    const struct kv_view_geom sg = kv__view_geom(src), dg = kv__view_geom(dst);
    if (kv_copy_plan_build(&plan, &sg, &dg, (int32_t)kv_dtype_size(src->dtype))) {
        st = kv__cuda_view_copy(&plan, src->base, dst->base, stream, &path);
        if (st != KV_OK)
            return st;
        if (path >= 0 && path < KV__CUDA_COPY_PATHS)
            atomic_fetch_add_explicit(&kv__cuda_copy_paths[path], 1, memory_order_relaxed);
    }
    kv__copy_count(KV_COPY_VIEW_COPY, (uint64_t)kv_view_numel(src) * kv_dtype_size(src->dtype));
    return kv__ok();
}

void kv_view_cuda_stats_get(struct kv_view_cuda_stats *out)
{
    uint64_t v[KV__CUDA_COPY_PATHS];
    if (!out)
        return;
    for (int i = 0; i < KV__CUDA_COPY_PATHS; i++)
        v[i] = atomic_load_explicit(&kv__cuda_copy_paths[i], memory_order_relaxed);
    out->vec16 = v[KV__CUDA_COPY_VEC16];
    out->vec8 = v[KV__CUDA_COPY_VEC8];
    out->vec4 = v[KV__CUDA_COPY_VEC4];
    out->vec2 = v[KV__CUDA_COPY_VEC2];
    out->vec1 = v[KV__CUDA_COPY_VEC1];
    out->strided = v[KV__CUDA_COPY_STRIDED];
}
