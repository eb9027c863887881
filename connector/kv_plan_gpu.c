/*
 * kv_plan_gpu.c - the CUDA executor's public entry (kv_plan_copy_cuda) and
 * its schedule: the CPU executor's validator (kv__plan_check_request with
 * cuda = true), then the request expanded into 2-D copies at absolute
 * addresses (kv__plan_cuda_schedule, built in every build and tested on the
 * CPU), then the launch through the CUDA boundary (kv_plan_cuda_int.h).
 * Block id lists are host memory, read here before anything is issued.
 */
#include <inttypes.h>
#include <string.h>

#include "kv_mem.h"
#include "kv_plan_cuda_int.h"

void kv__plan_sched_free(struct kv__plan_sched *s)
{
    if (!s)
        return;
    kv__mem_free(s->wide);
    kv__mem_free(s->narrow);
    s->wide = s->narrow = NULL;
    s->n_wide = s->n_narrow = 0;
}

kv_status kv__plan_cuda_schedule(const char *fn, const kv_plan *plan,
                                 const struct kv_paged_cache *src, const uint32_t *src_blocks,
                                 uint32_t n_src, const struct kv_paged_cache *dst,
                                 const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                                 int64_t wide_bytes, struct kv__plan_sched *out)
{
    memset(out, 0, sizeof(*out));
    out->wide_bytes = wide_bytes > 0 ? wide_bytes : KV_PLAN_CUDA_WIDE_BYTES;
    const int64_t items = kv__plan_items(plan, n_tokens);
    if (items == 0)
        return KV_OK;
    /* how many of each first: the plan's copies are a handful per window */
    int64_t nw = 0, nn = 0;
    for (int64_t w = 0; w < items; w++) {
        int64_t si, di;
        const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
        if (cp)
            *(cp->width >= out->wide_bytes ? &nw : &nn) += 1;
    }
    out->wide = nw ? kv__mem_alloc((size_t)nw * sizeof(*out->wide)) : NULL;
    out->narrow = nn ? kv__mem_alloc((size_t)nn * sizeof(*out->narrow)) : NULL;
    if ((nw && !out->wide) || (nn && !out->narrow)) {
        kv__plan_sched_free(out);
        return kv__error(KV_ERR_NO_MEMORY,
                         "%s: a schedule of %" PRId64 " wide and %" PRId64 " narrow copies", fn, nw,
                         nn);
    }
    for (int64_t w = 0; w < items; w++) {
        int64_t si, di;
        const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
        if (!cp)
            continue; /* past the request's last block on one side */
        const struct kv__plan_frag f = {
            kv__plan_block_addr(src, &plan->src, src_blocks[si]) + cp->src_rel,
            kv__plan_block_addr(dst, &plan->dst, dst_blocks[di]) + cp->dst_rel,
            cp->width,
            cp->height,
            cp->src_pitch,
            cp->dst_pitch};
        const int64_t bytes = cp->width * cp->height;
        if (cp->width >= out->wide_bytes) {
            out->wide[out->n_wide++] = f;
            out->wide_total += bytes;
        } else {
            out->narrow[out->n_narrow++] = f;
            out->narrow_total += bytes;
            out->narrow_align |= (uint64_t)(uintptr_t)f.src | (uint64_t)(uintptr_t)f.dst |
                                 (uint64_t)f.width | (uint64_t)f.src_pitch | (uint64_t)f.dst_pitch;
        }
    }
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
