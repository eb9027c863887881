/*
 * kv_xport_plan.c - prefill -> decode: a transfer plan's byte runs for one
 * request as the entries of one transport write (kv_xport_write_plan).
 */
#include <inttypes.h>

#include "kv_mem.h"
#include "kv_wire.h"
#include "kv_plan_int.h"
#include "kv_xport_int.h"

kv_status kv_xport_write_plan(kv_xport_peer *peer, const kv_plan *plan, kv_xport_mem *local,
                              uint64_t local_base_off, const uint32_t *src_blocks, uint32_t n_src,
                              kv_xport_rmem *remote, uint64_t remote_base_off,
                              const uint32_t *dst_blocks, uint32_t n_dst, uint64_t n_tokens,
                              const struct kv_xport_notify *notify, kv_xport_xfer **xfer)
{
    static const char fn[] = "xport_write_plan";
    if (!peer || !plan || !local || !remote || !xfer || (n_src && !src_blocks) ||
        (n_dst && !dst_blocks))
        return kv__error(KV_ERR_NULL,
                         "%s: a NULL argument (peer, plan, local, remote, xfer, "
                         "block lists)",
                         fn);
    const struct kv_layout *sl = &plan->src, *dl = &plan->dst;
    if (n_tokens == 0 || n_src != kv__plan_blocks(sl, n_tokens) ||
        n_dst != kv__plan_blocks(dl, n_tokens))
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: %" PRIu64 " tokens need %" PRIu64 " source and %" PRIu64
                         " destination blocks, got %u and %u",
                         fn, n_tokens, kv__plan_blocks(sl, n_tokens), kv__plan_blocks(dl, n_tokens),
                         n_src, n_dst);
    kv_status st = kv__plan_check_ids(fn, "source", src_blocks, n_src, sl->num_blocks);
    if (st == KV_OK)
        st = kv__plan_check_ids(fn, "destination", dst_blocks, n_dst, dl->num_blocks);
    if (st == KV_OK)
        st = kv__plan_check_unique(fn, dst_blocks, n_dst, NULL, 0);
    if (st != KV_OK)
        return st;
    /* Both caches whole inside their regions: then every run is. */
    if (!kv__range_ok(local->bytes, local_base_off, (uint64_t)sl->total_bytes) ||
        !kv__range_ok(remote->bytes, remote_base_off, (uint64_t)dl->total_bytes))
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "%s: a cache outside its region: source [%" PRIu64 ", +%" PRIu64
                         ") in %" PRIu64 " bytes, destination [%" PRIu64 ", +%" PRIu64
                         ") in %" PRIu64,
                         fn, local_base_off, (uint64_t)sl->total_bytes, local->bytes,
                         remote_base_off, (uint64_t)dl->total_bytes, remote->bytes);
    const int64_t items = kv__plan_items(plan, n_tokens);
    uint64_t cap = 0;
    for (int64_t w = 0; w < items; w++) {
        int64_t si, di;
        const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
        if (cp)
            cap += (uint64_t)cp->height;
    }
    if (cap > UINT32_MAX)
        return kv__error(KV_ERR_TOO_COSTLY, "%s: %" PRIu64 " runs (more than 2^32)", fn, cap);
    struct kv_xport_io *ios = kv__mem_alloc((cap ? cap : 1) * sizeof(*ios));
    if (!ios)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRIu64 " entries", fn, cap);
    uint32_t n = 0;
    for (int64_t w = 0; w < items; w++) {
        int64_t si, di;
        const struct kv__plan_copy *cp = kv__plan_item(plan, w, n_src, n_dst, &si, &di);
        if (!cp)
            continue;
        const uint64_t sb = local_base_off +
                            (uint64_t)src_blocks[si] * (uint64_t)sl->stride_block_bytes +
                            (uint64_t)cp->src_rel;
        const uint64_t db = remote_base_off +
                            (uint64_t)dst_blocks[di] * (uint64_t)dl->stride_block_bytes +
                            (uint64_t)cp->dst_rel;
        for (int64_t r = 0; r < cp->height; r++) {
            const uint64_t lo = sb + (uint64_t)(r * cp->src_pitch);
            const uint64_t ro = db + (uint64_t)(r * cp->dst_pitch);
            struct kv_xport_io *prev = n ? &ios[n - 1] : NULL;
            if (prev && prev->local_off + prev->bytes == lo &&
                prev->remote_off + prev->bytes == ro) {
                prev->bytes += (uint64_t)cp->width;
                continue;
            }
            ios[n++] = (struct kv_xport_io){.local = local,
                                            .local_off = lo,
                                            .remote = remote,
                                            .remote_off = ro,
                                            .bytes = (uint64_t)cp->width};
        }
    }
    st = kv_xport_write(peer, ios, n, notify, xfer);
    kv__mem_free(ios);
    return st;
}
