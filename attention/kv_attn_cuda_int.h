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
/* Multi-token attention (kv_attn_prefill_cuda; job from
 * kv__attn_decode_check; kv_attn_prefill_hd.h). */
kv_status kv__cuda_attn_prefill(const struct kv__attn_job *job, kv_cuda_stream stream);
/* MLA decode (job from kv__attn_decode_mla_check). */
kv_status kv__cuda_attn_decode_mla(const struct kv__attn_job *job, kv_cuda_stream stream);
/* Device-index write: slots [n_slots] device memory, checked by the kernel;
 * the job's scales (if any) host values copied into the launch (by_value)
 * or device pointers; no allocation, no copy, no synchronization
 * (capture-safe). */
kv_status kv__cuda_attn_write_dev(const struct kv__attn_job *job, const int64_t *slots,
                                  int64_t n_slots, bool by_value, struct kv_attn_cuda_errors *err,
                                  kv_cuda_stream stream);
/* Device-index decode: pages' arrays device memory, checked by the kernel;
 * scales as for the write; capture-safe as kv__cuda_attn_write_dev. */
kv_status kv__cuda_attn_decode_dev(const struct kv__attn_job *job,
                                   const struct kv_attn_dev_pages *pages, bool by_value,
                                   struct kv_attn_cuda_errors *err, kv_cuda_stream stream);
/* kv__cuda_attn_decode_dev with a caller workspace (device memory, ws_bytes;
 * NULL / 0: none) for split-KV when kv__cdec_body selects it: as many
 * chunks as its plan asks (max_tokens: the longest sequence's tokens if
 * the caller knows it, as vLLM's max_seq_len; -1 not) and ws_bytes hold
 * (kv__cdec_ws_bytes per chunk count), the vector body when none fits;
 * capture-safe. */
kv_status kv__cuda_attn_decode_dev_ws(const struct kv__attn_job *job,
                                      const struct kv_attn_dev_pages *pages, bool by_value,
                                      struct kv_attn_cuda_errors *err, void *ws, size_t ws_bytes,
                                      int64_t max_tokens, kv_cuda_stream stream);
/* Device-index MLA decode: pages' arrays device memory, checked by the
 * kernel; ksc the K scale in device memory (NULL: the job's, by value);
 * capture-safe. */
kv_status kv__cuda_attn_decode_mla_dev(const struct kv__attn_job *job,
                                       const struct kv_attn_dev_pages *pages, const float *ksc,
                                       struct kv_attn_cuda_errors *err, kv_cuda_stream stream);
/* Device-index read: pages' arrays and out_indptr device memory, checked by
 * the kernel; scales as for the write; capture-safe. */
kv_status kv__cuda_attn_read_dev(const struct kv__attn_job *job,
                                 const struct kv_attn_dev_pages *pages, const int32_t *out_indptr,
                                 bool by_value, struct kv_attn_cuda_errors *err,
                                 kv_cuda_stream stream);
/* Device-index copy_blocks: pairs [n] device memory, checked by the kernel. */
kv_status kv__cuda_attn_copy_dev(const struct kv__attn_job *job, const struct kv_block_copy *pairs,
                                 uint32_t n, struct kv_attn_cuda_errors *err,
                                 kv_cuda_stream stream);
/* Device-index copy_ex: job from kv__attn_copy_ex_dev_check, pairs [n]
 * device memory, checked by the kernel. */
kv_status kv__cuda_attn_copy_ex_dev(const struct kv__attn_job *job,
                                    const struct kv_block_copy *pairs, uint32_t n,
                                    struct kv_attn_cuda_errors *err, kv_cuda_stream stream);
/* The error record's device memory: cudaMalloc + zero, cudaFree,
 * cudaMemsetAsync, cudaMemcpyAsync + cudaStreamSynchronize. */
kv_status kv__cuda_attn_errors_alloc(struct kv_attn_cuda_errors **out);
void kv__cuda_attn_errors_free(struct kv_attn_cuda_errors *e);
kv_status kv__cuda_attn_errors_zero(struct kv_attn_cuda_errors *e, kv_cuda_stream stream);
kv_status kv__cuda_attn_errors_read(const struct kv_attn_cuda_errors *e,
                                    struct kv_attn_cuda_errors *host, kv_cuda_stream stream);
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
static inline kv_status kv__cuda_attn_prefill(const struct kv__attn_job *job, kv_cuda_stream stream)
{
    (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_decode_mla(const struct kv__attn_job *job,
                                                 kv_cuda_stream stream)
{
    (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_write_dev(const struct kv__attn_job *job,
                                                const int64_t *slots, int64_t n_slots,
                                                bool by_value, struct kv_attn_cuda_errors *err,
                                                kv_cuda_stream stream)
{
    (void)slots, (void)n_slots, (void)by_value, (void)err, (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_decode_dev(const struct kv__attn_job *job,
                                                 const struct kv_attn_dev_pages *pages,
                                                 bool by_value, struct kv_attn_cuda_errors *err,
                                                 kv_cuda_stream stream)
{
    (void)pages, (void)by_value, (void)err, (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_decode_dev_ws(const struct kv__attn_job *job,
                                                    const struct kv_attn_dev_pages *pages,
                                                    bool by_value, struct kv_attn_cuda_errors *err,
                                                    void *ws, size_t ws_bytes, int64_t max_tokens,
                                                    kv_cuda_stream stream)
{
    (void)pages, (void)by_value, (void)err, (void)ws, (void)ws_bytes, (void)max_tokens,
        (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_decode_mla_dev(const struct kv__attn_job *job,
                                                     const struct kv_attn_dev_pages *pages,
                                                     const float *ksc,
                                                     struct kv_attn_cuda_errors *err,
                                                     kv_cuda_stream stream)
{
    (void)pages, (void)ksc, (void)err, (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_copy_dev(const struct kv__attn_job *job,
                                               const struct kv_block_copy *pairs, uint32_t n,
                                               struct kv_attn_cuda_errors *err,
                                               kv_cuda_stream stream)
{
    (void)pairs, (void)n, (void)err, (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_read_dev(const struct kv__attn_job *job,
                                               const struct kv_attn_dev_pages *pages,
                                               const int32_t *out_indptr, bool by_value,
                                               struct kv_attn_cuda_errors *err,
                                               kv_cuda_stream stream)
{
    (void)pages, (void)out_indptr, (void)by_value, (void)err, (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_copy_ex_dev(const struct kv__attn_job *job,
                                                  const struct kv_block_copy *pairs, uint32_t n,
                                                  struct kv_attn_cuda_errors *err,
                                                  kv_cuda_stream stream)
{
    (void)pairs, (void)n, (void)err, (void)stream;
    return kv__cuda_attn_unsupported(job);
}
static inline kv_status kv__cuda_attn_errors_unsupported(const char *fn)
{
    return kv__error(KV_ERR_UNSUPPORTED,
                     "%s: this build has no CUDA (built with CUDA=0 or nvcc was not found)", fn);
}
static inline kv_status kv__cuda_attn_errors_alloc(struct kv_attn_cuda_errors **out)
{
    (void)out;
    return kv__cuda_attn_errors_unsupported("kv_attn_cuda_errors_create");
}
static inline void kv__cuda_attn_errors_free(struct kv_attn_cuda_errors *e)
{
    (void)e;
}
static inline kv_status kv__cuda_attn_errors_zero(struct kv_attn_cuda_errors *e,
                                                  kv_cuda_stream stream)
{
    (void)e, (void)stream;
    return kv__cuda_attn_errors_unsupported("kv_attn_cuda_errors_reset");
}
static inline kv_status kv__cuda_attn_errors_read(const struct kv_attn_cuda_errors *e,
                                                  struct kv_attn_cuda_errors *host,
                                                  kv_cuda_stream stream)
{
    (void)e, (void)host, (void)stream;
    return kv__cuda_attn_errors_unsupported("kv_attn_cuda_errors_get");
}
#endif

#endif /* KV_ATTN_CUDA_INT_H */
