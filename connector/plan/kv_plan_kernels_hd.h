/*
 * kv_plan_kernels_hd.h - the plan executor's CUDA kernel body (the narrow
 * copies) and its launch, one source for the GPU (kv_plan_cuda.cu) and the
 * CPU grid emulator (kv_plan_grid.c, kvcache/kv_grid_hd.h).
 *
 * One CUDA block per narrow item (grid-stride), made absolute by
 * kv__plan_narrow_frag; its threads over the item's rows x vectors of
 * vbytes (16 when every address, width and pitch allows, else 8, 4 or 1:
 * kv__plan_narrow_width of the schedule's narrow_align).
 */
#ifndef KV_PLAN_KERNELS_HD_H
#define KV_PLAN_KERNELS_HD_H

#include <stdint.h>
#include <string.h>

#include "kv_grid_hd.h"
#include "kv_plan_cuda_int.h"

#define KV__PLAN_THREADS 256
#define KV__PLAN_MAX_GRID (1 << 20)

KV_HD void kv__plan_narrow_body(const struct kv_grid_ctx *c, const struct kv__plan_narrow *n,
                                int vbytes)
{
    for (int64_t w = c->block; w < n->n_items; w += c->grid_dim) {
        struct kv__plan_frag f;
        if (!kv__plan_narrow_frag(n, w, &f))
            continue; /* past the request's last block on one side */
        const int64_t vecs = f.width / vbytes, total = vecs * f.height;
        for (int64_t k = c->thread; k < total; k += c->block_dim) {
            const int64_t y = k / vecs, x = k - y * vecs;
            kv_grid_move(c, f.dst + y * f.dst_pitch + x * vbytes,
                         f.src + y * f.src_pitch + x * vbytes, vbytes);
        }
    }
}

/* ---- device-resident block lists (kv_plan_copy_cuda_dev) ---------------------- */

/* A request with its block lists in device memory: items w < n_items are
 * the (window, copy) items of every copy (wide ones too), made absolute
 * from the ids read here; items n_items .. n_items + n_src + n_dst - 1 each
 * check one list entry (source entries first) and record an invalid id. */
struct kv__plan_dev {
    const struct kv__plan_copy *copies; /* [n_copies], device (kv_plan_dev_create) */
    int64_t n_copies, n_items, window_src_blocks, window_dst_blocks;
    const uint32_t *sid, *did; /* [n_src], [n_dst], device */
    uint32_t n_src, n_dst;
    const char *sbase;
    char *dbase;
    int64_t sstride, dstride; /* block strides, bytes */
    int64_t s_blocks, d_blocks;
    struct kv_plan_cuda_errors *err;
};

/* Record an invalid id at (side, index) (NULL e: not recorded):
 * kv_grid_error_record. */
KV_HD void kv__plan_dev_error(struct kv_plan_cuda_errors *e, int side, int64_t index)
{
    if (e)
        kv_grid_error_record(&e->count, &e->first_key, side, index);
}

KV_HD void kv__plan_dev_body(const struct kv_grid_ctx *c, const struct kv__plan_dev *p, int vbytes)
{
    const int64_t all = p->n_items + (int64_t)p->n_src + p->n_dst;
    for (int64_t w = c->block; w < all; w += c->grid_dim) {
        if (w >= p->n_items) {
            const int64_t k = w - p->n_items;
            const int side = k >= (int64_t)p->n_src;
            const int64_t i = side ? k - p->n_src : k;
            const int64_t id = side ? p->did[i] : p->sid[i];
            if (c->thread == 0 && id >= (side ? p->d_blocks : p->s_blocks))
                kv__plan_dev_error(p->err, side, i);
            continue;
        }
        int64_t si, di;
        const struct kv__plan_copy *cp =
            kv__plan_item_at(p->copies, p->n_copies, p->window_src_blocks, p->window_dst_blocks, w,
                             p->n_src, p->n_dst, &si, &di);
        if (!cp)
            continue; /* past the request's last block on one side */
        const int64_t s_id = p->sid[si], d_id = p->did[di];
        if (s_id >= p->s_blocks || d_id >= p->d_blocks)
            continue; /* recorded by the entry's check item */
        const char *src = p->sbase + s_id * p->sstride + cp->src_rel;
        char *dst = p->dbase + d_id * p->dstride + cp->dst_rel;
        const int64_t vecs = cp->width / vbytes, total = vecs * cp->height;
        for (int64_t k = c->thread; k < total; k += c->block_dim) {
            const int64_t y = k / vecs, x = k - y * vecs;
            kv_grid_move(c, dst + y * cp->dst_pitch + x * vbytes,
                         src + y * cp->src_pitch + x * vbytes, vbytes);
        }
    }
}

/* After the launch (one thread, the same stream): the id at the first
 * index, when this launch changed the first. */
KV_HD void kv__plan_dev_finish(struct kv_plan_cuda_errors *e, const uint32_t *sid,
                               const uint32_t *did, uint32_t n_src, uint32_t n_dst)
{
    if (!e || e->first_key == 0 || e->first_key == e->value_key)
        return;
    int side;
    const int64_t index = kv_grid_error_first(e->first_key, &side);
    if (index >= (int64_t)(side ? n_dst : n_src))
        return; /* an earlier launch's first, with longer lists: its value stays unset */
    e->first_value = side ? did[index] : sid[index];
    e->value_key = e->first_key;
}

/* The vector width of a schedule's narrow part (narrow_align). */
static inline int kv__plan_narrow_width(uint64_t a)
{
    return (a & 15) == 0 ? 16 : (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : 1;
}

/* OR of every copy's offsets, width and pitches (kv_plan_dev_create). */
static inline uint64_t kv__plan_copies_align(const kv_plan *plan)
{
    uint64_t a = 0;
    for (int64_t i = 0; i < plan->n_copies; i++) {
        const struct kv__plan_copy *cp = &plan->copies[i];
        a |= (uint64_t)cp->src_rel | (uint64_t)cp->dst_rel | (uint64_t)cp->width |
             (uint64_t)cp->src_pitch | (uint64_t)cp->dst_pitch;
    }
    return a;
}

/* The launch parameters of a device-list request checked by
 * kv__plan_check_request_dev: copies (device memory; host memory on the
 * emulator) is plan's table, align its kv__plan_copies_align. Returns the
 * vector width (every block start, offset, width and pitch allows it). */
static inline int kv__plan_dev_build(const kv_plan *plan, const struct kv__plan_copy *copies,
                                     uint64_t align, const struct kv_paged_cache *src,
                                     const uint32_t *sid, uint32_t n_src,
                                     const struct kv_paged_cache *dst, const uint32_t *did,
                                     uint32_t n_dst, uint64_t n_tokens,
                                     struct kv_plan_cuda_errors *err, struct kv__plan_dev *p)
{
    memset(p, 0, sizeof(*p));
    p->copies = copies;
    p->n_copies = plan->n_copies;
    p->n_items = kv__plan_items(plan, n_tokens);
    p->window_src_blocks = plan->stats.window_src_blocks;
    p->window_dst_blocks = plan->stats.window_dst_blocks;
    p->sid = sid;
    p->did = did;
    p->n_src = n_src;
    p->n_dst = n_dst;
    p->sbase = (const char *)src->base;
    p->dbase = (char *)dst->base;
    p->sstride = plan->src.stride_block_bytes;
    p->dstride = plan->dst.stride_block_bytes;
    p->s_blocks = plan->src.num_blocks;
    p->d_blocks = plan->dst.num_blocks;
    p->err = err;
    return kv__plan_narrow_width(align | (uint64_t)(uintptr_t)src->base |
                                 (uint64_t)(uintptr_t)dst->base | (uint64_t)p->sstride |
                                 (uint64_t)p->dstride);
}

/* The grid of n_items narrow items (> 0). */
static inline int kv__plan_narrow_grid(int64_t n_items)
{
    return (int)(n_items < KV__PLAN_MAX_GRID ? n_items : KV__PLAN_MAX_GRID);
}

#endif /* KV_PLAN_KERNELS_HD_H */
