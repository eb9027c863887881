/*
 * kv_plan_cuda_int.h - the CUDA boundary of the plan executor
 * (module-private; the template of attention/kv_attn_cuda_int.h).
 *
 * The schedule (first part, built in every build and tested on the CPU):
 * kv__plan_cuda_schedule splits a validated request by the width of the
 * plan's 2-D copies, with the item mapping the CPU executor uses
 * (kv__plan_item_at in kv_plan_int.h):
 *
 *   wide    width >= KV_PLAN_CUDA_WIDE_BYTES: expanded to absolute
 *           addresses, one cudaMemcpy2DAsync each (cudaMemcpyDefault:
 *           device, pinned, managed on either side)
 *   narrow  everything else: the plan's narrow copies (window-relative)
 *           and the request's block addresses, uploaded on the stream; one
 *           kernel launch over (window, narrow copy) items, each item made
 *           absolute by kv__plan_narrow_frag, the same function the CPU
 *           tests execute
 *
 * The narrow part is not expanded on the host: a 128k-token NHD -> HND
 * request (L 32, H 8, D 128, N 16) is 8.4 M head-row copies, which as
 * absolute descriptors would be 384 MiB to build and upload; as a table it
 * is 1,024 copies (64 KiB) plus 2 x 8,192 block addresses (128 KiB).
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
 * engines as one cudaMemcpy2DAsync; a narrower one is an item of the
 * gather kernel. A cudaMemcpy2DAsync costs microseconds to issue and its
 * rows run at DMA speed only when they are long, while the NHD <-> HND head
 * rows of 64-512 bytes (thousands per request) would each cost a call; the
 * kernel takes all of those in one launch. 4 KiB is a judgment from that,
 * not yet measured on a GPU (docs/connector.md, "CUDA executor"). */
#define KV_PLAN_CUDA_WIDE_BYTES 4096

/* One 2-D copy at absolute addresses: height rows of width bytes, row y
 * from src + y * src_pitch to dst + y * dst_pitch (pitches >= width when
 * height > 1). */
struct kv__plan_frag {
    const char *src;
    char *dst;
    int64_t width;
    int64_t height;
    int64_t src_pitch, dst_pitch;
};

/* The narrow part of a request, as the kernel takes it (by value; the
 * pointers are host memory in the schedule, device memory in a launch).
 * Item w < n_items is (window w / n_copies, copy w % n_copies). */
struct kv__plan_narrow {
    const struct kv__plan_copy *copies; /* [n_copies] the plan's copies narrower than the line */
    const char *const *src_blk;         /* [n_src] start of each source block of the request */
    char *const *dst_blk;               /* [n_dst] start of each destination block */
    int64_t n_copies, n_items;
    int64_t window_src_blocks, window_dst_blocks;
    uint32_t n_src, n_dst;
};

/* Narrow item w as an absolute 2-D copy in *f; 0 (f untouched) when the
 * item is past the request's last block on one side. */
KV_HD int kv__plan_narrow_frag(const struct kv__plan_narrow *n, int64_t w, struct kv__plan_frag *f)
{
    int64_t si, di;
    const struct kv__plan_copy *cp =
        kv__plan_item_at(n->copies, n->n_copies, n->window_src_blocks, n->window_dst_blocks, w,
                         n->n_src, n->n_dst, &si, &di);
    if (!cp)
        return 0;
    f->src = n->src_blk[si] + cp->src_rel;
    f->dst = n->dst_blk[di] + cp->dst_rel;
    f->width = cp->width;
    f->height = cp->height;
    f->src_pitch = cp->src_pitch;
    f->dst_pitch = cp->dst_pitch;
    return 1;
}

/* A request split (kv__plan_cuda_schedule). Invariants:
 * n_wide + n_narrow = the request's items kv__plan_item does not skip;
 * every wide[i].width >= wide_bytes > every narrow.copies[i].width;
 * narrow_align = OR of every block address in narrow.src_blk / dst_blk and
 * every src_rel, dst_rel, width and pitch of narrow.copies, so a vector of
 * its lowest set bit (16 at most) divides every narrow address and width. */
struct kv__plan_sched {
    int64_t wide_bytes;            /* the threshold it was built with */
    int64_t n_wide;                /* entries of wide[] */
    struct kv__plan_frag *wide;    /* [n_wide] absolute, kv__mem_alloc */
    struct kv__plan_narrow narrow; /* host arrays, kv__mem_alloc; n_items 0: no kernel */
    int64_t n_narrow;              /* narrow items not skipped */
    uint64_t narrow_align;
    int64_t wide_total, narrow_total; /* bytes moved by each part */
};

#ifdef __cplusplus
extern "C" {
#endif

/* Split a request that kv__plan_check_request accepted into *out (wide
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

struct kv__plan_dev; /* kv_plan_kernels_hd.h: the launch of kv_plan_copy_cuda_dev */

/* A plan's copy table in device memory (kv_plan_dev_create). */
struct kv_plan_dev {
    const kv_plan *plan; /* own (kv_plan_dev_create), or a test's */
    kv_plan *own;        /* kv_plan_dev_create's copy of the plan: the caller may destroy
                            the plan first */
    struct kv__plan_copy *copies; /* [plan->n_copies], device */
    uint64_t align;               /* kv__plan_copies_align */
};

#if KV_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif
/* cudaMalloc + cudaMemcpy of the plan's table into pd->copies. */
kv_status kv__cuda_plan_dev_upload(struct kv_plan_dev *pd);
void kv__cuda_plan_dev_free(struct kv_plan_dev *pd);
/* One launch of kv__plan_dev_body over p (kv__plan_dev_build) at width
 * vbytes, then the record's value (one thread), on stream: no allocation,
 * no copy, no synchronization. */
kv_status kv__cuda_plan_copy_dev(const struct kv__plan_dev *p, int vbytes, kv_cuda_stream stream);
/* Issue the schedule on stream, with no explicit synchronize: kv__cuda_ready
 * first (KV_ERR_UNSUPPORTED without a usable device, even for an empty
 * schedule), the wide copies, then the narrow table and block addresses
 * uploaded with stream-ordered allocation from pageable host memory (CUDA
 * may synchronize with the stream to stage it), one kernel launch, the
 * upload freed on the stream.
 * CUDA errors through kv__cuda_status (KV_ERR_DEVICE for a failed launch).
 * The schedule's host arrays may be freed when this returns. */
kv_status kv__cuda_plan_copy(const struct kv__plan_sched *s, kv_cuda_stream stream);
#ifdef __cplusplus
}
#endif
#else
static inline kv_status kv__cuda_plan_dev_upload(struct kv_plan_dev *pd)
{
    (void)pd;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "kv_plan_dev_create: this build has no CUDA (built with CUDA=0 or nvcc was "
                     "not found)");
}
static inline void kv__cuda_plan_dev_free(struct kv_plan_dev *pd)
{
    (void)pd;
}
static inline kv_status kv__cuda_plan_copy_dev(const struct kv__plan_dev *p, int vbytes,
                                               kv_cuda_stream stream)
{
    (void)p, (void)vbytes, (void)stream;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "kv_plan_copy_cuda_dev: this build has no CUDA (built with CUDA=0 or nvcc "
                     "was not found)");
}
static inline kv_status kv__cuda_plan_copy(const struct kv__plan_sched *s, kv_cuda_stream stream)
{
    (void)s, (void)stream;
    return kv__error(KV_ERR_UNSUPPORTED,
                     "kv_plan_copy_cuda: this build has no CUDA (built with CUDA=0 or nvcc was "
                     "not found)");
}
#endif

#endif /* KV_PLAN_CUDA_INT_H */
