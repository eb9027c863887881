/*
 * kv_view_kernels_hd.h - the strided view copy's CUDA kernel body and its
 * launch, one source for the GPU (kv_view_cuda.cu) and the CPU grid
 * emulator (kv_view_grid.c, kv_grid_hd.h).
 *
 * The body runs a copy plan (kv_view_hd.h) row by row: a row's outer dims
 * decoded once (kv_copy_plan_row), then 2^tpr_log2 threads walk the row with
 * fixed steps, vbytes per access (a vector of a contiguous row, or one
 * element of a strided one). KV__VIEW_THREADS >> tpr_log2 rows per block,
 * grid-stride over the rows.
 */
#ifndef KV_VIEW_KERNELS_HD_H
#define KV_VIEW_KERNELS_HD_H

#include <stdint.h>

#include "kv_grid_hd.h"
#include "kv_view_cuda_int.h"
#include "kv_view_hd.h"

#define KV__VIEW_THREADS 256
#define KV__VIEW_MAX_BLOCKS (1 << 20)

/* The kernel's arguments: n accesses of vbytes per row at the row's steps. */
struct kv__view_rows {
    const char *src;
    char *dst;
    struct kv_copy_plan p;
    int64_t n, src_step, dst_step;
    int tpr_log2;
    int vbytes;
};

/* vbytes: a->vbytes (a template constant in the CUDA wrapper) */
KV_HD void kv__view_rows_body(const struct kv_grid_ctx *c, const struct kv__view_rows *a,
                              int vbytes)
{
    const int64_t tpr = (int64_t)1 << a->tpr_log2;       /* threads per row */
    const int64_t rpb = KV__VIEW_THREADS >> a->tpr_log2; /* rows per block */
    const int64_t lane = c->thread & (tpr - 1);
    for (int64_t r = (int64_t)c->block * rpb + (c->thread >> a->tpr_log2); r < a->p.rows;
         r += (int64_t)c->grid_dim * rpb) {
        int64_t so, d;
        kv_copy_plan_row(&a->p, r, &so, &d);
        const char *s = a->src + so;
        char *t = a->dst + d;
        for (int64_t i = lane; i < a->n; i += tpr)
            kv_grid_move(c, t + i * a->dst_step, s + i * a->src_step, vbytes);
    }
}

/* The launch of plan p (rows > 0) between the bases: *a, the blocks, and
 * the path (KV__CUDA_COPY_*). */
static inline void kv__view_rows_build(const struct kv_copy_plan *p, const void *src_base,
                                       void *dst_base, struct kv__view_rows *a, int64_t *blocks,
                                       int *path)
{
    const int32_t w =
        kv_copy_plan_vector_bytes(p, (uint64_t)(uintptr_t)src_base, (uint64_t)(uintptr_t)dst_base);
    a->src = (const char *)src_base;
    a->dst = (char *)dst_base;
    a->p = *p;
    if (w > 0) {
        a->vbytes = w;
        a->n = p->row_elems * p->elem_bytes / w;
        a->src_step = a->dst_step = w;
        *path = w == 16  ? KV__CUDA_COPY_VEC16
                : w == 8 ? KV__CUDA_COPY_VEC8
                : w == 4 ? KV__CUDA_COPY_VEC4
                : w == 2 ? KV__CUDA_COPY_VEC2
                         : KV__CUDA_COPY_VEC1;
    } else {
        a->vbytes = p->elem_bytes;
        a->n = p->row_elems;
        a->src_step = kv_copy_plan_src_step(p);
        a->dst_step = kv_copy_plan_dst_step(p);
        *path = KV__CUDA_COPY_STRIDED;
    }
    a->tpr_log2 = 0;
    while (a->tpr_log2 < 8 && ((int64_t)1 << a->tpr_log2) < a->n)
        a->tpr_log2++;
    const int64_t rpb = KV__VIEW_THREADS >> a->tpr_log2;
    *blocks = (p->rows + rpb - 1) / rpb;
    if (*blocks > KV__VIEW_MAX_BLOCKS)
        *blocks = KV__VIEW_MAX_BLOCKS;
}

#endif /* KV_VIEW_KERNELS_HD_H */
