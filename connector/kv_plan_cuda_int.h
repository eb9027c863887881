/*
 * kv_plan_cuda_int.h - the CUDA boundary of the plan executor
 * (module-private; the template of attention/kv_attn_cuda_int.h).
 *
 * The schedule (first part, built in every build and tested on the CPU):
 * kv__plan_cuda_schedule expands a validated request into 2-D copies at
 * absolute addresses, with the same item mapping as the CPU executor
 * (kv__plan_item in kv_plan_int.h), split by width:
 *
 *   wide    width >= KV_PLAN_CUDA_WIDE_BYTES: one cudaMemcpy2DAsync each
 *           (cudaMemcpyDefault: device, pinned, managed on either side)
 *   narrow  everything else: one descriptor array, uploaded on the stream,
 *           one kernel launch for all of them
 *
 * The launcher (second part): with KV_HAVE_CUDA it is implemented in
 * kv_plan_cuda.cu; without it, an inline stub returning KV_ERR_UNSUPPORTED.
 * `#if KV_HAVE_CUDA` appears here and nowhere else in connector/. The caller
 * (kv_plan_gpu.c) has validated the request with the CPU executor's
 * validator (kv__plan_check_request) and built the schedule.
 */
#ifndef KV_PLAN_CUDA_INT_H
#define KV_PLAN_CUDA_INT_H

#include <stdint.h>

#include "kv_lib.h"
#include "kv_plan_int.h"

/* A 2-D copy at or above this width (bytes per row) goes to the copy
 * engines as one cudaMemcpy2DAsync; a narrower one is a descriptor of the
 * gather kernel. A cudaMemcpy2DAsync costs a few microseconds to issue and
 * its rows run at DMA speed only when they are long: at 4 KiB a row is
 * already at the engine's rate, while the NHD <-> HND head rows of 64-512
 * bytes (thousands per request) would each cost a call; the kernel takes
 * all of those in one launch. */
#define KV_PLAN_CUDA_WIDE_BYTES 4096

/* One 2-D copy at absolute addresses: height rows of width bytes, row y
 * from src + y * src_pitch to dst + y * dst_pitch (pitches >= width when
 * height > 1). Shared with the kernel: plain C, 48 bytes. */
struct kv__plan_frag {
    const char *src;
    char *dst;
    int64_t width;
    int64_t height;
    int64_t src_pitch, dst_pitch;
};

/* A request expanded (kv__plan_cuda_schedule). Invariants:
 * n_wide + n_narrow = the request's items that kv__plan_item does not skip;
 * every wide[i].width >= wide_bytes > every narrow[i].width;
 * narrow_align = OR of every narrow address, width and pitch (the widest
 * vector the kernel may use is its lowest set bit, 16 at most). */
struct kv__plan_sched {
    int64_t wide_bytes;               /* the threshold it was built with */
    int64_t n_wide, n_narrow;         /* entries of wide[], narrow[] */
    struct kv__plan_frag *wide;       /* [n_wide], kv__mem_alloc */
    struct kv__plan_frag *narrow;     /* [n_narrow], kv__mem_alloc */
    uint64_t narrow_align;            /* OR of the narrow addresses, widths, pitches */
    int64_t wide_total, narrow_total; /* bytes moved by each part */
};

#ifdef __cplusplus
extern "C" {
#endif

/* Expand a request that kv__plan_check_request accepted into *out (wide
 * entries width >= wide_bytes; wide_bytes <= 0 means
 * KV_PLAN_CUDA_WIDE_BYTES). Nothing is dereferenced: the block addresses
 * are computed from the caches' bases. KV_ERR_NO_MEMORY (fn names the
 * caller); on failure *out is empty. Free with kv__plan_sched_free. */
kv_status kv__plan_cuda_schedule(const char *fn, const kv_plan *plan,
                                 const struct kv_paged_cache *src, const uint32_t *src_blocks,
                                 uint32_t n_src, const struct kv_paged_cache *dst,
                                 const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                                 int64_t wide_bytes, struct kv__plan_sched *out);
void kv__plan_sched_free(struct kv__plan_sched *s);

#ifdef __cplusplus
}
#endif

#if KV_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif
/* Issue the schedule on stream without synchronizing: kv__cuda_ready first
 * (KV_ERR_UNSUPPORTED without a usable device, even for an empty schedule),
 * the wide copies, then the narrow descriptors uploaded with stream-ordered
 * allocation and one kernel launch, the descriptors freed on the stream.
 * CUDA errors through kv__cuda_status (KV_ERR_DEVICE for a failed launch).
 * The schedule's host arrays may be freed when this returns. */
kv_status kv__cuda_plan_copy(const struct kv__plan_sched *s, kv_cuda_stream stream);
#ifdef __cplusplus
}
#endif
#else
static inline kv_status kv__cuda_plan_copy(const struct kv__plan_sched *s, kv_cuda_stream stream)
{
    (void)s, (void)stream;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "kv_plan_copy_cuda: this build has no CUDA (built with CUDA=0 or nvcc was "
                     "not found)");
}
#endif

#endif /* KV_PLAN_CUDA_INT_H */
