/*
 * kv_view_index.h - the addressing math every kernel shares, CPU and CUDA.
 *
 * Compiled as C by the host compiler and as CUDA C++ by nvcc
 * (__host__ __device__), so the index math a GPU runs is exactly the math the
 * CPU tests exercise (tests/unit/test_view_index.c).
 */
#ifndef KV_VIEW_INDEX_H
#define KV_VIEW_INDEX_H

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

#endif /* KV_VIEW_INDEX_H */
