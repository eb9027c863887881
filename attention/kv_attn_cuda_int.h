/*
 * kv_attn_cuda_int.h - the CUDA boundary of the attention module
 * (module-private; the template of docs/design.md "Backends").
 *
 * With KV_HAVE_CUDA the launchers below are implemented in kv_attn_cuda.cu;
 * without it they are inline stubs returning KV_ERR_UNSUPPORTED. `#if
 * KV_HAVE_CUDA` appears here and nowhere else in attention/. The caller
 * (kv_attn_gpu.c) has validated the job with the CPU kernels' validator; a
 * launcher uploads the job's host index arrays on the stream (stream-ordered
 * allocations, freed on the stream; copied from pageable host memory, which
 * CUDA may stage by synchronizing with the stream), launches, and checks the
 * launch.
 */
#ifndef KV_ATTN_CUDA_INT_H
#define KV_ATTN_CUDA_INT_H

#include "kv_attn_int.h"

#if KV_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif
kv_status kv__cuda_attn_move(const struct kv__attn_job *job, bool to_cache, kv_cuda_stream stream);
kv_status kv__cuda_attn_copy(const struct kv__attn_job *job, kv_cuda_stream stream);
kv_status kv__cuda_attn_copy_ex(const struct kv__attn_job *job, kv_cuda_stream stream);
kv_status kv__cuda_attn_decode(const struct kv__attn_job *job, kv_cuda_stream stream);
#ifdef __cplusplus
}
#endif
#else
static inline kv_status kv__cuda_attn_unsupported(const struct kv__attn_job *job)
{
    static const char *const names[] = {"kv_attn_write_cuda", "kv_attn_read_cuda",
                                        "kv_attn_copy_blocks_cuda", "kv_attn_decode_cuda"};
    return kv__error(KV_ERR_UNSUPPORTED,
                     "%s: this build has no CUDA (built with CUDA=0 or nvcc was not found)",
                     job->fn ? job->fn : names[(unsigned)job->kernel < 4 ? job->kernel : 0]);
}
static inline kv_status kv__cuda_attn_move(const struct kv__attn_job *job, bool to_cache,
                                           kv_cuda_stream stream)
{
    (void)to_cache, (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_copy(const struct kv__attn_job *job, kv_cuda_stream stream)
{
    (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_copy_ex(const struct kv__attn_job *job, kv_cuda_stream stream)
{
    (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_decode(const struct kv__attn_job *job, kv_cuda_stream stream)
{
    (void)stream;
    return kv__cuda_attn_unsupported(job);
}
#endif

#endif /* KV_ATTN_CUDA_INT_H */
