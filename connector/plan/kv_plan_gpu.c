/*
 * kv_plan_gpu.c - the CUDA executor's public entry (kv_plan_copy_cuda) and
 * its schedule: the CPU executor's validator (kv__plan_check_request with
 * cuda = true), then the request expanded into 2-D copies at absolute
 * addresses (kv__plan_cuda_schedule, built in every build and tested on the
 * CPU), then the launch through the CUDA boundary (kv_plan_cuda_int.h).
 * Block id lists are host memory, read here before anything is issued.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "kv_mem.h"
#include "kv_plan_cuda_int.h"
#include "kv_plan_kernels_hd.h"

void kv__plan_sched_free(struct kv__plan_sched *s)
{
    if (!s)
        return;
    kv__mem_free(s->wide);
    kv__mem_free((void *)s->narrow.copies);
    kv__mem_free((void *)s->narrow.src_blk);
    memset(s, 0, sizeof(*s));
}

kv_status kv__plan_cuda_schedule(const char *fn, const kv_plan *plan,
                                 const struct kv_paged_cache *src, const uint32_t *src_blocks,
                                 uint32_t n_src, const struct kv_paged_cache *dst,
                                 const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                                 int64_t wide_bytes, struct kv__plan_sched *out)
{
    memset(out, 0, sizeof(*out));
    out->wide_bytes = wide_bytes > 0 ? wide_bytes : KV_PLAN_CUDA_WIDE_BYTES;
    const int64_t items = kv__plan_items(plan, n_tokens), thr = out->wide_bytes;
    if (items == 0)
        return KV_OK;
    /* the plan's copies split by width: the wide ones expanded per window,
     * the narrow ones are the kernel's table; only the last window can
     * have items past a list (every earlier one is full) */
    const int64_t nwin = items / plan->n_copies;
    int64_t nnc = 0;
    for (int64_t c = 0; c < plan->n_copies; c++)
        nnc += plan->copies[c].width < thr;
    const int64_t nwc = plan->n_copies - nnc;
    struct kv__plan_copy *nc = NULL;
    char **blk = NULL; /* [n_src] source then [n_dst] destination block starts */
    if (nwc)
        out->wide = kv__mem_alloc((size_t)(nwin * nwc) * sizeof(*out->wide));
    if (nnc) {
        nc = kv__mem_alloc((size_t)nnc * sizeof(*nc));
        blk = kv__mem_alloc(((size_t)n_src + n_dst) * sizeof(*blk));
    }
    if ((nwc && !out->wide) || (nnc && (!nc || !blk))) {
        kv__mem_free(nc);
        kv__mem_free(blk);
        kv__plan_sched_free(out);
        return kv__error(KV_ERR_NO_MEMORY,
                         "%s: a schedule of %" PRId64 " wide copies and %" PRId64
                         " narrow ones per window, %" PRId64 " windows",
                         fn, nwc, nnc, nwin);
    }
    /* without wide copies only the last window needs a look */
    for (int64_t win = nwc ? 0 : nwin - 1; win < nwin; win++) {
        const bool last = win == nwin - 1;
        for (int64_t c = 0; c < plan->n_copies; c++) {
            int64_t si, di;
            if (plan->copies[c].width < thr && !last)
                continue; /* narrow, in a full window: counted below */
            const struct kv__plan_copy *cp =
                kv__plan_item(plan, win * plan->n_copies + c, n_src, n_dst, &si, &di);
            if (!cp)
                continue; /* past the request's last block on one side */
            if (cp->width < thr) {
                out->n_narrow++;
                out->narrow_total += cp->width * cp->height;
                continue;
            }
            out->wide[out->n_wide++] = (struct kv__plan_frag){
                kv__plan_block_addr(src, &plan->src, src_blocks[si]) + cp->src_rel,
                kv__plan_block_addr(dst, &plan->dst, dst_blocks[di]) + cp->dst_rel,
                cp->width,
                cp->height,
                cp->src_pitch,
                cp->dst_pitch};
            out->wide_total += cp->width * cp->height;
        }
    }
    if (nnc == 0)
        return KV_OK;
    uint64_t align = 0;
    int64_t k = 0, window_narrow = 0;
    for (int64_t c = 0; c < plan->n_copies; c++) {
        const struct kv__plan_copy *cp = &plan->copies[c];
        if (cp->width >= thr)
            continue;
        nc[k++] = *cp;
        window_narrow += cp->width * cp->height;
        align |= (uint64_t)cp->src_rel | (uint64_t)cp->dst_rel | (uint64_t)cp->width |
                 (uint64_t)cp->src_pitch | (uint64_t)cp->dst_pitch;
    }
    for (uint32_t i = 0; i < n_src; i++) {
        blk[i] = kv__plan_block_addr(src, &plan->src, src_blocks[i]);
        align |= (uint64_t)(uintptr_t)blk[i];
    }
    for (uint32_t i = 0; i < n_dst; i++) {
        blk[n_src + i] = kv__plan_block_addr(dst, &plan->dst, dst_blocks[i]);
        align |= (uint64_t)(uintptr_t)blk[n_src + i];
    }
    out->n_narrow += (nwin - 1) * nnc; /* the full windows */
    out->narrow_total += (nwin - 1) * window_narrow;
    const struct kv_plan_stats *ps = &plan->stats;
    out->narrow = (struct kv__plan_narrow){.copies = nc,
                                           .src_blk = (const char *const *)blk,
                                           .dst_blk = blk + n_src,
                                           .n_copies = nnc,
                                           .n_items = nwin * nnc,
                                           .window_src_blocks = ps->window_src_blocks,
                                           .window_dst_blocks = ps->window_dst_blocks,
                                           .n_src = n_src,
                                           .n_dst = n_dst};
    out->narrow_align = align;
    return KV_OK;
}

kv_status kv_plan_copy_cuda(const kv_plan *plan, struct kv_paged_cache src,
                            const uint32_t *src_blocks, uint32_t n_src, struct kv_paged_cache dst,
                            const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                            kv_cuda_stream stream)
{
    static const char fn[] = "kv_plan_copy_cuda";
    kv_status st = kv__plan_check_request(fn, plan, &src, src_blocks, n_src, &dst, dst_blocks,
                                          n_dst, n_tokens, true);
    if (st != KV_OK)
        return st;
    struct kv__plan_sched s;
    st = kv__plan_cuda_schedule(fn, plan, &src, src_blocks, n_src, &dst, dst_blocks, n_dst,
                                n_tokens, 0, &s);
    if (st != KV_OK)
        return st;
    st = kv__cuda_plan_copy(&s, stream);
    kv__plan_sched_free(&s);
    return st == KV_OK ? kv__ok() : st;
}

/* ---- device-resident block lists ------------------------------------------------ */

kv_status kv_plan_dev_create(const kv_plan *plan, kv_plan_dev **out)
{
    if (!plan || !out)
        return kv__error(KV_ERR_NULL, "kv_plan_dev_create: plan=%p out=%p", (const void *)plan,
                         (void *)out);
    struct kv_plan_dev *pd = kv__mem_calloc(1, sizeof(*pd));
    kv_plan *own = kv__mem_alloc(sizeof(*own));
    struct kv__plan_copy *copies =
        kv__mem_alloc((size_t)(plan->n_copies ? plan->n_copies : 1) * sizeof(*copies));
    if (!pd || !own || !copies) {
        kv__mem_free(pd);
        kv__mem_free(own);
        kv__mem_free(copies);
        return kv__error(KV_ERR_NO_MEMORY,
                         "kv_plan_dev_create: a copy of a plan of %" PRId64 " copies",
                         plan->n_copies);
    }
    /* A copy of its own (the host table too): the plan may be destroyed
     * before the device plan, as a caller frees handles in any order. */
    *own = *plan;
    memcpy(copies, plan->copies, (size_t)plan->n_copies * sizeof(*copies));
    own->copies = copies;
    pd->own = own;
    pd->plan = own;
    pd->align = kv__plan_copies_align(own);
    const kv_status st = kv__cuda_plan_dev_upload(pd);
    if (st != KV_OK) {
        kv_plan_destroy(own);
        kv__mem_free(pd);
        return st;
    }
    *out = pd;
    return kv__ok();
}

void kv_plan_dev_destroy(kv_plan_dev *pd)
{
    if (!pd)
        return;
    kv__cuda_plan_dev_free(pd);
    kv_plan_destroy(pd->own);
    kv__mem_free(pd);
}

kv_status kv_plan_copy_cuda_dev(const kv_plan_dev *pd, struct kv_paged_cache src,
                                const uint32_t *src_blocks_dev, uint32_t n_src,
                                struct kv_paged_cache dst, const uint32_t *dst_blocks_dev,
                                uint32_t n_dst, uint64_t n_tokens,
                                struct kv_plan_cuda_errors *errors, kv_cuda_stream stream)
{
    static const char fn[] = "kv_plan_copy_cuda_dev";
    if (!pd)
        return kv__error(KV_ERR_NULL, "%s: pd is NULL", fn);
    kv_status st = kv__plan_check_request_dev(fn, pd->plan, &src, src_blocks_dev, n_src, &dst,
                                              dst_blocks_dev, n_dst, n_tokens);
    if (st != KV_OK)
        return st;
    /* uint32 loads by the kernel: a misaligned list would fault on the GPU
     * (cudaErrorMisalignedAddress, sticky: the context is lost) */
    const uint32_t *lists[2] = {src_blocks_dev, dst_blocks_dev};
    static const char *const names[2] = {"src_blocks_dev", "dst_blocks_dev"};
    for (int i = 0; i < 2; i++)
        if ((st = kv__check_dev_aligned(fn, names[i], lists[i], sizeof(uint32_t))) != KV_OK)
            return st;
    /* and the record's 64-bit atomics (NULL: not recorded, aligned) */
    if ((st = kv__check_dev_aligned(fn, "errors", errors, _Alignof(struct kv_plan_cuda_errors))) !=
        KV_OK)
        return st;
    struct kv__plan_dev p;
    const int w = kv__plan_dev_build(pd->plan, pd->copies, pd->align, &src, src_blocks_dev, n_src,
                                     &dst, dst_blocks_dev, n_dst, n_tokens, errors, &p);
    st = kv__cuda_plan_copy_dev(&p, w, stream);
    return st == KV_OK ? kv__ok() : st;
}
