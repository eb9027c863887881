/*
 * kv_view_cuda_int.h - the CUDA boundary of the view copy (module-private).
 *
 * With KV_HAVE_CUDA the launcher below is implemented in kv_view_cuda.cu;
 * without it, it is an inline stub returning KV_ERR_UNSUPPORTED with a
 * message. `#if KV_HAVE_CUDA` appears here and nowhere else in kvcache/
 * (scripts/check-walls.py). The caller (kv_view_gpu.c) has already validated
 * the copy with the CPU path's validator and reduced it to a plan with the
 * shared addressing header: the launcher only launches.
 */
#ifndef KV_VIEW_CUDA_INT_H
#define KV_VIEW_CUDA_INT_H

#include "kv_lib.h"
#include "kv_view_hd.h"

#if KV_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif
/* Launch the copy described by plan (p->rows > 0) on `stream` without
 * synchronizing: KV_ERR_UNSUPPORTED without a usable device, KV_ERR_DEVICE
 * when the launch fails (the message carries the CUDA error). *path_out
 * receives the path taken (KV__CUDA_COPY_*). */
kv_status kv__cuda_view_copy(const struct kv_copy_plan *p, const void *src_base, void *dst_base,
                             kv_cuda_stream stream, int *path_out);
#ifdef __cplusplus
}
#endif
#else
static inline kv_status kv__cuda_view_copy(const struct kv_copy_plan *p, const void *src_base,
                                           void *dst_base, kv_cuda_stream stream, int *path_out)
{
    (void)p, (void)src_base, (void)dst_base, (void)stream, (void)path_out;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "kv_view_copy_cuda: this build has no CUDA (built with CUDA=0 or nvcc was "
                     "not found)");
}
#endif

/* Device paths: rows copied as 16/8/4/2/1-byte vectors (both sides
 * contiguous along the row, aligned to the vector), or element by element
 * with the row's strides. */
enum {
    KV__CUDA_COPY_VEC16,
    KV__CUDA_COPY_VEC8,
    KV__CUDA_COPY_VEC4,
    KV__CUDA_COPY_VEC2,
    KV__CUDA_COPY_VEC1,
    KV__CUDA_COPY_STRIDED,
    KV__CUDA_COPY_PATHS
};

#endif /* KV_VIEW_CUDA_INT_H */
