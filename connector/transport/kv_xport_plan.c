/*
 * kv_xport_plan.c - prefill -> decode: a transfer plan's byte runs for one
 * request as the entries of one transport write (kv_xport_write_plan).
 *
 * Two ways, chosen by the plan's mean run (kv_plan_stats: window_bytes /
 * runs) against the config's plan_gather_below_bytes:
 *   direct    one entry per run, merged where consecutive runs are
 *             contiguous on both sides (large runs: the same-layout case);
 *   gathered  (a backend with ops->gather) one entry per run of the
 *             destination, merged wherever consecutive runs are contiguous
 *             there; its payload is the list of source runs it covers
 *             (struct kv__xport_seg), read by the backend as it sends. An
 *             NHD -> HND plan's 256-byte head rows become whole [N][D]
 *             planes (or whole blocks) on the wire, with no staging copy.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kv_mem.h"
#include "kv_wire.h"
#include "kv_plan_int.h"
#include "kv_xport_int.h"

/* Runs of a plan's window (blocks of the window, offsets in them) in
 * destination order, grouped: count runs of width bytes, contiguous in the
 * destination, their sources pitch bytes apart (pitch >= width). */
struct wrun {
    int64_t ks, kd, src_rel, dst_rel, width, count, pitch;
};

/* Destination order: by destination block, then offset in it. */
static int wrun_cmp(const void *a, const void *b)
{
    const struct wrun *x = a, *y = b;
    if (x->kd != y->kd)
        return x->kd < y->kd ? -1 : 1;
    return x->dst_rel < y->dst_rel ? -1 : x->dst_rel > y->dst_rel;
}

/* The plan's runs of one window, destination order, grouped (struct
 * wrun); *out (free with kv__mem_free) and its length. */
static kv_status window_runs(const char *fn, const kv_plan *plan, struct wrun **out, int64_t *n)
{
    const int64_t R = plan->stats.runs;
    struct wrun *wr = kv__mem_alloc((size_t)(R ? R : 1) * sizeof(*wr));
    if (!wr)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRId64 " runs", fn, R);
    int64_t k = 0;
    for (int64_t c = 0; c < plan->n_copies; c++) {
        const struct kv__plan_copy *cp = &plan->copies[c];
        for (int64_t r = 0; r < cp->height && k < R; r++)
            wr[k++] = (struct wrun){.ks = cp->ks,
                                    .kd = cp->kd,
                                    .src_rel = cp->src_rel + r * cp->src_pitch,
                                    .dst_rel = cp->dst_rel + r * cp->dst_pitch,
                                    .width = cp->width,
                                    .count = 1,
                                    .pitch = cp->width};
    }
    qsort(wr, (size_t)k, sizeof(*wr), wrun_cmp);
    int64_t g = 0;
    for (int64_t i = 0; i < k; i++) {
        struct wrun *q = g ? &wr[g - 1] : NULL;
        const struct wrun *r = &wr[i];
        if (q && q->kd == r->kd && q->ks == r->ks && q->width == r->width &&
            r->dst_rel == q->dst_rel + q->count * q->width) {
            const int64_t step = r->src_rel - q->src_rel;
            if (q->count == 1 && step >= q->width) {
                q->pitch = step;
                q->count = 2;
                continue;
            }
            if (q->count > 1 && step == q->count * q->pitch) {
                q->count++;
                continue;
            }
        }
        wr[g++] = *r;
    }
    for (int64_t i = 0; i < g; i++)
        if (wr[i].pitch == wr[i].width) { /* contiguous: one range */
            wr[i].width *= wr[i].count;
            wr[i].pitch = wr[i].width;
            wr[i].count = 1;
        }
    *out = wr;
    *n = g;
    return KV_OK;
}

/* The entries being built: ios[n] and, gathered, seg[ns] / seg_at[n]. */
struct runs_out {
    struct kv_xport_io *ios;
    struct kv__xport_seg *seg;
    uint32_t *seg_at;
    kv_xport_mem *local;
    kv_xport_rmem *remote;
    uint32_t n, ns;
};

/* Direct: the run [lo, +w) -> [ro, +w), merged into the last entry where
 * it continues it on both sides. */
static void run_add(struct runs_out *o, uint64_t lo, uint64_t ro, uint64_t w)
{
    struct kv_xport_io *prev = o->n ? &o->ios[o->n - 1] : NULL;
    if (prev && prev->local_off + prev->bytes == lo && prev->remote_off + prev->bytes == ro) {
        prev->bytes += w;
        return;
    }
    o->ios[o->n++] = (struct kv_xport_io){
        .local = o->local, .local_off = lo, .remote = o->remote, .remote_off = ro, .bytes = w};
}

/* Gathered: count runs of w bytes from lo, pitch apart, to [ro, +count w):
 * merged into the last entry where they continue it in the destination,
 * and into its last segment where they continue that too. */
static void gather_add(struct runs_out *o, uint64_t lo, uint64_t ro, uint64_t w, uint64_t count,
                       uint64_t pitch)
{
    struct kv_xport_io *prev = o->n ? &o->ios[o->n - 1] : NULL;
    if (prev && prev->remote_off + prev->bytes == ro) {
        struct kv__xport_seg *sg = &o->seg[o->ns - 1];
        prev->bytes += w * count;
        if (sg->count == 1 && count == 1 && sg->off + sg->bytes == lo) {
            sg->bytes += w;
            sg->pitch = sg->bytes;
        } else if (sg->bytes == w && sg->pitch == pitch && sg->off + sg->count * pitch == lo) {
            sg->count += count;
        } else {
            o->seg[o->ns++] =
                (struct kv__xport_seg){.off = lo, .bytes = w, .count = count, .pitch = pitch};
        }
        return;
    }
    o->seg_at[o->n] = o->ns;
    o->seg[o->ns++] = (struct kv__xport_seg){.off = lo, .bytes = w, .count = count, .pitch = pitch};
    o->ios[o->n++] = (struct kv_xport_io){.local = o->local,
                                          .local_off = lo,
                                          .remote = o->remote,
                                          .remote_off = ro,
                                          .bytes = w * count};
}

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
    kv_xport *x = peer->x;
    const bool gather = peer->ops->gather && plan->stats.runs > 0 &&
                        (uint64_t)plan->stats.window_bytes <
                            (uint64_t)x->cfg.plan_gather_below_bytes * (uint64_t)plan->stats.runs;
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
    struct kv__xport_seg *seg = gather ? kv__mem_alloc((cap ? cap : 1) * sizeof(*seg)) : NULL;
    uint32_t *seg_at = gather ? kv__mem_alloc((cap + 1) * sizeof(*seg_at)) : NULL;
    if (!ios || (gather && (!seg || !seg_at))) {
        kv__mem_free(ios);
        kv__mem_free(seg);
        kv__mem_free(seg_at);
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRIu64 " entries", fn, cap);
    }
    struct runs_out o = {
        .ios = ios, .seg = seg, .seg_at = seg_at, .local = local, .remote = remote};
    if (gather) {
        /* the plan's runs of one window in destination order, once; then
         * every window of the request through them */
        struct wrun *wr = NULL;
        int64_t k = 0;
        st = window_runs(fn, plan, &wr, &k);
        if (st != KV_OK) {
            kv__mem_free(ios);
            kv__mem_free(seg);
            kv__mem_free(seg_at);
            return st;
        }
        const int64_t wins = items / plan->n_copies;
        const int64_t wsb = plan->stats.window_src_blocks, wdb = plan->stats.window_dst_blocks;
        for (int64_t win = 0; win < wins; win++)
            for (int64_t i = 0; i < k; i++) {
                const int64_t si = win * wsb + wr[i].ks, di = win * wdb + wr[i].kd;
                if (si >= (int64_t)n_src || di >= (int64_t)n_dst)
                    continue;
                gather_add(
                    &o,
                    local_base_off + (uint64_t)src_blocks[si] * (uint64_t)sl->stride_block_bytes +
                        (uint64_t)wr[i].src_rel,
                    remote_base_off + (uint64_t)dst_blocks[di] * (uint64_t)dl->stride_block_bytes +
                        (uint64_t)wr[i].dst_rel,
                    (uint64_t)wr[i].width, (uint64_t)wr[i].count, (uint64_t)wr[i].pitch);
            }
        kv__mem_free(wr);
    } else {
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
            for (int64_t r = 0; r < cp->height; r++)
                run_add(&o, sb + (uint64_t)(r * cp->src_pitch), db + (uint64_t)(r * cp->dst_pitch),
                        (uint64_t)cp->width);
        }
    }
    const uint32_t n = o.n, ns = o.ns;
    if (gather) {
        seg_at[n] = ns;
        /* what the transfer keeps: its records and entries only (the
         * tables were sized for one record per run) */
        struct kv__xport_seg *s2 = kv__mem_alloc((size_t)(ns ? ns : 1) * sizeof(*s2));
        uint32_t *a2 = kv__mem_alloc(((size_t)n + 1) * sizeof(*a2));
        if (s2 && a2) {
            memcpy(s2, seg, (size_t)ns * sizeof(*s2));
            memcpy(a2, seg_at, ((size_t)n + 1) * sizeof(*a2));
            kv__mem_free(seg);
            kv__mem_free(seg_at);
            seg = s2;
            seg_at = a2;
        } else { /* keep the large ones */
            kv__mem_free(s2);
            kv__mem_free(a2);
        }
        /* seg and seg_at belong to the transfer from here (freed on an
         * error too) */
        st = kv__xport_write_gather(peer, ios, n, seg, seg_at, ns, notify, xfer);
    } else {
        st = kv_xport_write(peer, ios, n, notify, xfer);
    }
    kv__mem_free(ios);
    if (st == KV_OK) {
        pthread_mutex_lock(&x->mu);
        if (gather) {
            x->stats.plans_gathered++;
            x->stats.plan_segments += ns;
            x->stats.plan_entries += n;
        } else {
            x->stats.plans_direct++;
        }
        pthread_mutex_unlock(&x->mu);
    }
    return st;
}
