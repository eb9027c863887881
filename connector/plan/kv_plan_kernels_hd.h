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

/* The vector width of a schedule's narrow part (narrow_align). */
static inline int kv__plan_narrow_width(uint64_t a)
{
    return (a & 15) == 0 ? 16 : (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : 1;
}

/* The grid of n_items narrow items (> 0). */
static inline int kv__plan_narrow_grid(int64_t n_items)
{
    return (int)(n_items < KV__PLAN_MAX_GRID ? n_items : KV__PLAN_MAX_GRID);
}

#endif /* KV_PLAN_KERNELS_HD_H */
