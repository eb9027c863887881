/*
 * kv_view_cuda_int.h - the one place kvcache/ core code meets CUDA.
 *
 * With KV_HAVE_CUDA the symbols below are implemented in kv_view_cuda.cu;
 * without it they are stubs returning KV_ERR_UNSUPPORTED with a message.
 * `#if KV_HAVE_CUDA` appears here and nowhere else in kvcache/.
 */
#ifndef KV_VIEW_CUDA_INT_H
#define KV_VIEW_CUDA_INT_H

#include "kv_view_index.h"
#include "kv_lib.h"

#if KV_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif
/* Launch dst[i] = src[i] over numel elements of elem_bytes on `stream`
 * (a cudaStream_t); does not synchronize. Geometry already validated. */
kv_status kv__cuda_view_copy(void *dst_base, struct kv_view_geom dst, const void *src_base,
                             struct kv_view_geom src, int64_t numel, int elem_bytes, void *stream);
#ifdef __cplusplus
}
#endif
#else
static inline kv_status kv__cuda_view_copy(void *dst_base, struct kv_view_geom dst,
                                           const void *src_base, struct kv_view_geom src,
                                           int64_t numel, int elem_bytes, void *stream)
{
    (void)dst_base, (void)dst, (void)src_base, (void)src, (void)numel, (void)elem_bytes,
        (void)stream;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "kv_view_copy_cuda: this build has no CUDA (built with CUDA=0 or nvcc was "
                     "not found)");
}
#endif

#endif /* KV_VIEW_CUDA_INT_H */
