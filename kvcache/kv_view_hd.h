/*
 * kv_view_hd.h - the addressing math every kernel shares, CPU and CUDA.
 *
 * Compiled as C by the host compiler and as CUDA C++ by nvcc
 * (__host__ __device__), so the index math a GPU runs is exactly the math the
 * CPU runs and the CPU tests exercise (tests/unit/test_view_index.c). Two
 * pieces:
 *
 *   struct kv_view_geom   a view's geometry without storage, and the offset
 *                         of its lin-th element (one division per dim)
 *   struct kv_copy_plan   a (src, dst) pair of same-shaped views reduced to
 *                         the fewest dims: size-1 dims dropped, dims ordered
 *                         by dst stride, and dims that both views step over
 *                         contiguously merged. Its innermost dim is the
 *                         "row" an executor loops over with fixed strides;
 *                         the outer dims are decoded once per row, not once
 *                         per element. The CPU copy engine (kv_view_copy.c)
 *                         and the CUDA kernel (kv_view_cuda.cu) both run it.
 *
 * Everything here is pure integer arithmetic on validated views: callers
 * check views first (kv_view_check and the copy validator), so no product
 * here can overflow (every offset lies inside a storage that exists).
 */
#ifndef KV_VIEW_HD_H
#define KV_VIEW_HD_H

#include <stdint.h>

/* KV_HD: __host__ __device__ inline under nvcc, static inline in C. */
#if defined(__CUDACC__)
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD static inline
#endif

/* A view's geometry without storage: what a kernel takes by value. */
struct kv_view_geom {
    int32_t ndim;
    int64_t shape[8];   /* elements */
    int64_t strides[8]; /* elements */
    int64_t offset;     /* elements */
};

/*
 * Element offset of the lin-th element in logical C order:
 *   offset + sum_k ((lin / prod_{j>k} shape[j]) % shape[k]) * strides[k]
 * Precondition: 0 <= lin < numel (so no shape is 0).
 */
KV_HD int64_t kv_geom_offset_of_linear(const struct kv_view_geom *g, int64_t lin)
{
    int64_t off = g->offset;
    for (int32_t k = g->ndim - 1; k >= 0; k--) {
        int64_t n = g->shape[k];
        int64_t i = lin % n;
        lin /= n;
        off += i * g->strides[k];
    }
    return off;
}

/* A copy of src into dst reduced to its fewest dims (see the top of file).
 * Strides and offsets are in BYTES (so executors of any element size share
 * it). Invariants after kv_copy_plan_build returns 1:
 *
 *     0 <= ndim <= 8;  shape[k] >= 2 for every k < ndim
 *     numel == prod shape (1 when ndim == 0)
 *     rows == numel / row_elems, row_elems == (ndim ? shape[ndim-1] : 1)
 *     element i of row r sits at src_offset_bytes + row_src(r) + i*src_step
 *     (and likewise for dst), row_src/row_dst from kv_copy_plan_row()
 */
struct kv_copy_plan {
    int32_t ndim;
    int32_t elem_bytes; /* 1, 2, 4 or 8 */
    int64_t shape[8];   /* elements, each >= 2 */
    int64_t src_strides_bytes[8];
    int64_t dst_strides_bytes[8];
    int64_t src_offset_bytes; /* of element [0,...,0], from the src base */
    int64_t dst_offset_bytes; /* from the dst base */
    int64_t rows;             /* product of every dim but the innermost */
    int64_t row_elems;        /* elements per row (the innermost dim) */
};

/* Build the plan of copying src into dst (same shape; the caller has
 * validated both). Returns 0 when there is nothing to copy (numel == 0). */
KV_HD int kv_copy_plan_build(struct kv_copy_plan *p, const struct kv_view_geom *src,
                             const struct kv_view_geom *dst, int32_t elem_bytes)
{
    const int64_t e = elem_bytes;
    int32_t n = 0;

    p->elem_bytes = elem_bytes;
    p->src_offset_bytes = src->offset * e;
    p->dst_offset_bytes = dst->offset * e;
    for (int32_t k = 0; k < src->ndim; k++) {
        if (src->shape[k] == 0)
            return 0;
        if (src->shape[k] == 1)
            continue;
        p->shape[n] = src->shape[k];
        p->dst_strides_bytes[n] = dst->strides[k] * e;
        p->src_strides_bytes[n] = src->strides[k] * e;
        n++;
    }
    /* Stable insertion sort by dst stride, largest first: writes go in dst
     * memory order, which is what caches (and coalesced stores) want. A dst
     * without internal overlap makes any order valid. */
    for (int32_t i = 1; i < n; i++) {
        int64_t sh = p->shape[i], ds = p->dst_strides_bytes[i], ss = p->src_strides_bytes[i];
        int32_t j = i - 1;
        while (j >= 0 && p->dst_strides_bytes[j] < ds) {
            p->shape[j + 1] = p->shape[j];
            p->dst_strides_bytes[j + 1] = p->dst_strides_bytes[j];
            p->src_strides_bytes[j + 1] = p->src_strides_bytes[j];
            j--;
        }
        p->shape[j + 1] = sh;
        p->dst_strides_bytes[j + 1] = ds;
        p->src_strides_bytes[j + 1] = ss;
    }
    /* Merge dim k into the one before it when BOTH views step over k
     * exactly: stride[k-1] == stride[k] * shape[k]. */
    int32_t m = 0;
    for (int32_t k = 0; k < n; k++) {
        if (m > 0 && p->dst_strides_bytes[m - 1] == p->dst_strides_bytes[k] * p->shape[k] &&
            p->src_strides_bytes[m - 1] == p->src_strides_bytes[k] * p->shape[k]) {
            p->shape[m - 1] *= p->shape[k];
            p->dst_strides_bytes[m - 1] = p->dst_strides_bytes[k];
            p->src_strides_bytes[m - 1] = p->src_strides_bytes[k];
            continue;
        }
        p->shape[m] = p->shape[k];
        p->dst_strides_bytes[m] = p->dst_strides_bytes[k];
        p->src_strides_bytes[m] = p->src_strides_bytes[k];
        m++;
    }
    p->ndim = m;
    p->row_elems = m ? p->shape[m - 1] : 1;
    p->rows = 1;
    for (int32_t k = 0; k + 1 < m; k++)
        p->rows *= p->shape[k];
    return 1;
}

/* Byte offsets (from each base) of element 0 of row r, 0 <= r < rows: one
 * division per outer dim, once per row. */
KV_HD void kv_copy_plan_row(const struct kv_copy_plan *p, int64_t r, int64_t *src_off,
                            int64_t *dst_off)
{
    int64_t so = p->src_offset_bytes, d = p->dst_offset_bytes;
    for (int32_t k = p->ndim - 2; k >= 0; k--) {
        int64_t n = p->shape[k];
        int64_t i = r % n;
        r /= n;
        so += i * p->src_strides_bytes[k];
        d += i * p->dst_strides_bytes[k];
    }
    *src_off = so;
    *dst_off = d;
}

/* Byte step between consecutive elements of a row. */
KV_HD int64_t kv_copy_plan_src_step(const struct kv_copy_plan *p)
{
    return p->ndim ? p->src_strides_bytes[p->ndim - 1] : p->elem_bytes;
}
KV_HD int64_t kv_copy_plan_dst_step(const struct kv_copy_plan *p)
{
    return p->ndim ? p->dst_strides_bytes[p->ndim - 1] : p->elem_bytes;
}

/* Whether rows are contiguous runs on both sides (the memcpy-of-runs and the
 * vectorized device path). */
KV_HD int kv_copy_plan_rows_contiguous(const struct kv_copy_plan *p)
{
    return kv_copy_plan_src_step(p) == p->elem_bytes && kv_copy_plan_dst_step(p) == p->elem_bytes;
}

/* Widest vector, 16, 8, 4, 2 or 1 bytes, that copies every row of a plan
 * whose rows are contiguous on both sides: it divides the row length, every
 * outer stride, both element-0 offsets and both base addresses, so every
 * vector access is aligned. 0 when the rows are not contiguous (the strided
 * path copies element by element). */
KV_HD int32_t kv_copy_plan_vector_bytes(const struct kv_copy_plan *p, uint64_t src_base,
                                        uint64_t dst_base)
{
    uint64_t bits;
    if (!kv_copy_plan_rows_contiguous(p))
        return 0;
    bits = (uint64_t)(p->row_elems * p->elem_bytes) | src_base | dst_base |
           (uint64_t)p->src_offset_bytes | (uint64_t)p->dst_offset_bytes;
    for (int32_t k = 0; k + 1 < p->ndim; k++)
        bits |= (uint64_t)p->src_strides_bytes[k] | (uint64_t)p->dst_strides_bytes[k];
    for (int32_t w = 16; w > 1; w /= 2)
        if ((bits & (uint64_t)(w - 1)) == 0)
            return w;
    return 1;
}

#endif /* KV_VIEW_HD_H */
