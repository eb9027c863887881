/*
 * kv_attn_grid_int.h - the attention kernels' CUDA bodies run on the CPU
 * grid emulator (kvcache/kv_grid_hd.h), for the tests (module-private).
 *
 * Each call takes a job from the kernels' validator, exactly as the CUDA
 * launcher of the same name in kv_attn_cuda_int.h does (and, for moves, the
 * per-layer split of kv_attn_gpu.c), builds the same launch parameters
 * (kv_attn_kernels_hd.h), and runs the same kernel body over every (block,
 * thread) of that launch, on host memory: the cache, tensors and index
 * arrays of the job are read and written in place. Returns KV_OK, the
 * launcher's own refusals (decode: KV_ERR_UNSUPPORTED past the shared
 * memory limit), or the emulator's (KV_ERR_INVALID_ARG for a launch CUDA
 * refuses, KV_ERR_DEVICE for a kernel fault: misaligned vector, divergent
 * barrier, a write past shared memory).
 */
#ifndef KV_ATTN_GRID_INT_H
#define KV_ATTN_GRID_INT_H

#include "kv_attn_int.h"
#include "kv_grid_hd.h"

kv_status kv__grid_attn_move(const struct kv__attn_job *job, bool to_cache);
kv_status kv__grid_attn_copy(const struct kv__attn_job *job);
kv_status kv__grid_attn_copy_ex(const struct kv__attn_job *job);
kv_status kv__grid_attn_decode(const struct kv__attn_job *job);
/* Test hooks: kv__cdec_body forces a decode body (emulated or CUDA):
 * KV__CDEC_AUTO 0, _GENERAL 1, _VEC 2, _PIPE 3 (pipelined vector), _SPLIT 4
 * (split-KV); kv__cdec_chunks: split-KV's chunk count (0 auto)
 * (kv_attn_kernels_hd.h, kv__cdec_build). */
extern int kv__cdec_body;
extern int kv__cdec_chunks;
/* kv__cuda_attn_prefill: job from kv__attn_decode_check (a prefill; a
 * decode job runs too) (kv_attn_prefill_hd.h); KV_ERR_UNSUPPORTED as the
 * launcher (shared memory, grid). */
kv_status kv__grid_attn_prefill(const struct kv__attn_job *job);
/* kv__cuda_attn_decode_mla: job from kv__attn_decode_mla_check. */
kv_status kv__grid_attn_decode_mla(const struct kv__attn_job *job);
/* kv__cuda_attn_decode_mla_dev on the emulator (arrays host memory): job
 * from kv__attn_decode_mla_dev_check. */
kv_status kv__grid_attn_decode_mla_dev(const struct kv__attn_job *job,
                                       const struct kv_attn_dev_pages *pages, const float *ksc,
                                       struct kv_attn_cuda_errors *err);
/* kv__cuda_attn_write_dev: job from kv__attn_write_dev_check, slots [n_slots]
 * read by the body (host memory standing for device memory), err the
 * record (host memory; NULL: none), finished as the CUDA launcher does. */
kv_status kv__grid_attn_write_dev(const struct kv__attn_job *job, const int64_t *slots,
                                  int64_t n_slots, bool by_value, struct kv_attn_cuda_errors *err);

/* The launch of the last successful call on this thread (for tests: which
 * width and grid ran). */
struct kv__grid_attn_last {
    struct kv_grid_launch launch;
    int vbytes; /* 0: a converting move or decode */
};
/* kv__cuda_attn_decode_dev on the emulator: job from
 * kv__attn_decode_dev_check, pages' arrays host memory read by the body. */
kv_status kv__grid_attn_decode_dev(const struct kv__attn_job *job,
                                   const struct kv_attn_dev_pages *pages, bool by_value,
                                   struct kv_attn_cuda_errors *err);

/* kv__cuda_attn_copy_dev on the emulator (pairs host memory). */
kv_status kv__grid_attn_copy_dev(const struct kv__attn_job *job, const struct kv_block_copy *pairs,
                                 uint32_t n, struct kv_attn_cuda_errors *err);

/* kv__cuda_attn_read_dev on the emulator (arrays host memory). */
kv_status kv__grid_attn_read_dev(const struct kv__attn_job *job,
                                 const struct kv_attn_dev_pages *pages, const int32_t *out_indptr,
                                 bool by_value, struct kv_attn_cuda_errors *err);

/* kv__cuda_attn_copy_ex_dev on the emulator (pairs host memory). */
kv_status kv__grid_attn_copy_ex_dev(const struct kv__attn_job *job,
                                    const struct kv_block_copy *pairs, uint32_t n,
                                    struct kv_attn_cuda_errors *err);

void kv__grid_attn_last(struct kv__grid_attn_last *out);

#endif /* KV_ATTN_GRID_INT_H */
