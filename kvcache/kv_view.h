/*
 * kv_view.h - strided views: the way kvcache describes every tensor.
 *
 * A view is dtype + ndim (<= 8) + shape + strides + offset over a storage
 * (base pointer, size in bytes). Strides and offset are in ELEMENTS and are
 * int64; every product is computed in 64 bits. The address of index i is
 *
 *     base + (offset + sum_k i_k * strides[k]) * elem_bytes
 *
 * Semantics follow PyTorch (tests/data/strided_views.txt is the
 * conformance suite). Invariants of every view this module hands out:
 *
 *     0 <= ndim <= KV_MAX_DIMS,  shape[k] >= 0,  strides[k] >= 0,  offset >= 0
 *     numel > 0  =>  (offset + sum_k (shape[k]-1)*strides[k] + 1) * elem_bytes
 *                      <= storage_bytes
 *
 * A view borrows its storage: it never allocates or frees. Metadata ops
 * (permute ... diagonal, view, as_strided) never copy. Ops that may have to
 * copy (reshape, flatten, contiguous) copy only when no view exists, into a
 * buffer the caller passes, and report it; every copy this library makes is
 * counted in kv_copy_stats. `out` may be the same object as `src` in every
 * call; on failure *out is left unchanged.
 *
 * Dims may be negative (Python style: -1 is the last dim).
 *
 * Statuses. Every op first checks its source against the invariants above
 * (O(ndim)), so a hand-built view with a bad ndim, size, stride, offset or a
 * base not aligned to its element size is refused, never indexed. Common to
 * all ops:
 *   KV_ERR_NULL          a required pointer is NULL
 *   KV_ERR_BAD_DIM       a dim outside -ndim..ndim-1, or ndim outside 0..8
 *   KV_ERR_BAD_SHAPE     a negative or incompatible size (expand, view, reshape)
 *   KV_ERR_OUT_OF_BOUNDS an index/start/length outside its dim, or a view
 *                        reaching past its storage (names the last byte)
 *   KV_ERR_INVALID_ARG   unknown dtype, negative stride, misaligned base,
 *                        repeated permute dim, step < 1, dim1 == dim2
 *   KV_ERR_OVERFLOW      an offset or stride product would exceed int64
 *                        (possible only through strides of empty views)
 *   KV_ERR_NEEDS_COPY    view / reshape-without-buffer cannot avoid a copy
 *   KV_ERR_OVERLAP       a copy destination overlaps itself or the source
 * Thread-safe: all functions (they touch only their arguments; the copy
 * counters are atomic).
 */
#ifndef KV_VIEW_H
#define KV_VIEW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_dtype.h"
#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most dims a view can have. */
#define KV_MAX_DIMS 8

/* A strided view: plain data, copied by value; see the top of this file for
 * the addressing formula and invariants. */
struct kv_view {
    kv_dtype dtype;
    int ndim;
    int64_t shape[KV_MAX_DIMS];   /* elements along each dim, >= 0 */
    int64_t strides[KV_MAX_DIMS]; /* elements between neighbours, >= 0 */
    int64_t offset;               /* elements from base to index 0 */
    void *base;                   /* storage start (borrowed) */
    size_t storage_bytes;         /* storage size in bytes */
};

/* ---- creation and checks ------------------------------------------------ */

/* A C-contiguous view of `shape` at offset 0 over (base, storage_bytes).
 * KV_ERR_NULL (base NULL with storage_bytes > 0, or out/shape NULL),
 * KV_ERR_BAD_DIM (ndim outside 0..8), KV_ERR_BAD_SHAPE (negative size),
 * KV_ERR_OVERFLOW, KV_ERR_OUT_OF_BOUNDS (does not fit in storage). */
KV_API KV_NODISCARD kv_status kv_view_init(void *base, size_t storage_bytes, kv_dtype dtype,
                                           int ndim, const int64_t *shape, struct kv_view *out);

/* A view of any shape and strides over (base, storage_bytes): the form a
 * framework hands out (torch: data_ptr() of the storage, dtype, size(),
 * stride(), storage_offset() * element_size(); DLPack: data, shape, strides,
 * byte_offset). strides are in ELEMENTS, >= 0 (stride 0 = broadcast);
 * offset_bytes is from base to index 0, a multiple of the element size.
 * The extent, one past the highest byte any element reaches, is
 *
 *     numel == 0:  0
 *     otherwise:   offset_bytes + (sum_k (shape[k]-1) * strides[k] + 1) * elem_bytes
 *
 * storage_bytes == 0 means "exactly the extent" (the view's storage_bytes is
 * then the extent); otherwise the extent must fit in it. Nothing is read or
 * written through base.
 * KV_ERR_NULL (out NULL; shape or strides NULL with ndim > 0; base NULL
 * with storage_bytes > 0 or with elements), KV_ERR_BAD_DIM (ndim outside
 * 0..8), KV_ERR_BAD_SHAPE (a negative size), KV_ERR_INVALID_ARG (unknown
 * dtype, a negative stride, offset_bytes not a multiple of the element size,
 * base not aligned to it), KV_ERR_OUT_OF_BOUNDS (negative offset_bytes; an
 * extent past storage_bytes, naming the last byte, the extent and
 * storage_bytes), KV_ERR_OVERFLOW (numel or the extent past int64). *out is
 * set only on success. */
KV_API KV_NODISCARD kv_status kv_view_from_strided(void *base, size_t storage_bytes,
                                                   kv_dtype dtype, int ndim, const int64_t *shape,
                                                   const int64_t *strides, int64_t offset_bytes,
                                                   struct kv_view *out);

/* Any shape/strides/offset over src's storage (torch.as_strided with an
 * absolute storage offset), refused with KV_ERR_OUT_OF_BOUNDS naming the
 * highest byte it would reach and the storage size. */
KV_API KV_NODISCARD kv_status kv_view_as_strided(const struct kv_view *src, int ndim,
                                                 const int64_t *shape, const int64_t *strides,
                                                 int64_t offset, struct kv_view *out);

/* Validate a hand-built view against the invariants above. */
KV_API KV_NODISCARD kv_status kv_view_check(const struct kv_view *v);

/* Number of elements (product of shape; 1 for 0-d); 0 for a view whose
 * ndim, dtype or sizes are invalid, or whose count overflows int64. */
KV_API int64_t kv_view_numel(const struct kv_view *v);

/* Bytes per element. */
KV_API size_t kv_view_elem_bytes(const struct kv_view *v);

/* Element offset (from base, including v->offset) of index idx[ndim];
 * KV_ERR_OUT_OF_BOUNDS naming the dim and index when outside the shape. */
KV_API KV_NODISCARD kv_status kv_view_offset_of(const struct kv_view *v, const int64_t *idx,
                                                int64_t *out_elems);

/* Pointer to element idx; NULL (with kv_last_error set) when out of range. */
KV_API void *kv_view_ptr(const struct kv_view *v, const int64_t *idx);

/* ---- metadata operations (never copy) ----------------------------------- */

/* x.permute(perm): perm[n] lists every dim once (negative allowed); n must
 * equal src->ndim (KV_ERR_BAD_DIM naming both otherwise). */
KV_API KV_NODISCARD kv_status kv_view_permute(const struct kv_view *src, const int *perm, int n,
                                              struct kv_view *out);
/* x.transpose(dim0, dim1): swap two dims (a 0-d view allows (0, 0)). */
KV_API KV_NODISCARD kv_status kv_view_transpose(const struct kv_view *src, int dim0, int dim1,
                                                struct kv_view *out);
/* x[..., start:stop:step, ...] on dim; start/stop clamp like Python (negative
 * values count from the end); step >= 1 (KV_ERR_INVALID_ARG otherwise). The
 * dim's new stride is stride * step; where that is past int64, a result of
 * two or more elements is KV_ERR_OVERFLOW, and one of at most one element
 * keeps the old stride (the step is never taken). */
KV_API KV_NODISCARD kv_status kv_view_slice(const struct kv_view *src, int dim, int64_t start,
                                            int64_t stop, int64_t step, struct kv_view *out);
/* x.narrow(dim, start, length): 0 <= start (or start >= -size), start+length <= size. */
KV_API KV_NODISCARD kv_status kv_view_narrow(const struct kv_view *src, int dim, int64_t start,
                                             int64_t length, struct kv_view *out);
/* x.select(dim, index): drops dim; index may be negative. */
KV_API KV_NODISCARD kv_status kv_view_select(const struct kv_view *src, int dim, int64_t index,
                                             struct kv_view *out);
/* Insert a size-1 dim at position dim (-ndim-1 <= dim <= ndim). */
KV_API KV_NODISCARD kv_status kv_view_unsqueeze(const struct kv_view *src, int dim,
                                                struct kv_view *out);
/* Remove dim if its size is 1, otherwise return the view unchanged. */
KV_API KV_NODISCARD kv_status kv_view_squeeze(const struct kv_view *src, int dim,
                                              struct kv_view *out);
/* Broadcast to shape[ndim] (ndim >= src->ndim; -1 keeps a size). Expanded
 * size-1 dims and new leading dims of size != 1 get stride 0; a new leading
 * dim of size 1 gets shape[i+1] * strides[i+1] (as PyTorch: [2,3] expanded
 * to [1,2,3] has strides [6,3,1]). */
KV_API KV_NODISCARD kv_status kv_view_expand(const struct kv_view *src, int ndim,
                                             const int64_t *shape, struct kv_view *out);
/* x.diagonal(offset, dim1, dim2): both dims removed, the diagonal appended last. */
KV_API KV_NODISCARD kv_status kv_view_diagonal(const struct kv_view *src, int64_t offset, int dim1,
                                               int dim2, struct kv_view *out);
/* x.view(shape): no copy, or KV_ERR_NEEDS_COPY naming the dims that could not
 * be merged/split. One -1 is inferred. */
KV_API KV_NODISCARD kv_status kv_view_view(const struct kv_view *src, int ndim,
                                           const int64_t *shape, struct kv_view *out);
/* numpy.lib.stride_tricks.sliding_window_view(x, window, axis=dim): dim's size
 * becomes size - window + 1 and a trailing dim of size `window` is appended.
 * Read-only by nature (overlapping); built on kv_view_as_strided. */
KV_API KV_NODISCARD kv_status kv_view_sliding_window(const struct kv_view *src, int dim,
                                                     int64_t window, struct kv_view *out);

/* ---- operations that may copy ------------------------------------------- */

/* x.reshape(shape): a view when strides allow it (*copied = false, dst
 * untouched); otherwise src is materialized into dst (C order,
 * dst_bytes >= numel * elem_bytes) and *out is a contiguous view over dst
 * (*copied = true, counted as KV_COPY_RESHAPE). With dst == NULL and a copy
 * needed: KV_ERR_NEEDS_COPY. `copied` may be NULL. */
KV_API KV_NODISCARD kv_status kv_view_reshape(const struct kv_view *src, int ndim,
                                              const int64_t *shape, void *dst, size_t dst_bytes,
                                              struct kv_view *out, bool *copied);
/* x.flatten(start_dim, end_dim) with reshape semantics (KV_COPY_FLATTEN). */
KV_API KV_NODISCARD kv_status kv_view_flatten(const struct kv_view *src, int start_dim, int end_dim,
                                              void *dst, size_t dst_bytes, struct kv_view *out,
                                              bool *copied);
/* x.contiguous(): src itself when already C-contiguous (*copied = false),
 * otherwise a copy into dst (KV_COPY_CONTIGUOUS). */
KV_API KV_NODISCARD kv_status kv_view_contiguous(const struct kv_view *src, void *dst,
                                                 size_t dst_bytes, struct kv_view *out,
                                                 bool *copied);

/* Copy every element of src, in logical C order, into the contiguous buffer
 * dst (dst_bytes >= numel * elem_bytes). KV_ERR_OVERLAP if the bytes written
 * intersect src's extent [kv_view_extent_bytes] (conservative: a dst that
 * only interleaves with a strided src is refused too; use kv_view_copy with
 * a dst view to copy into such gaps). Counted as KV_COPY_MATERIALIZE. */
KV_API KV_NODISCARD kv_status kv_view_materialize(const struct kv_view *src, void *dst,
                                                  size_t dst_bytes);

/* dst[i] = src[i] for every index i. Same shape and dtype (KV_ERR_BAD_SHAPE /
 * KV_ERR_INVALID_ARG otherwise). Refuses (KV_ERR_OVERLAP) a dst whose elements
 * overlap each other (stride 0, aliasing) or overlap src's elements. Fast
 * paths: memcpy of contiguous runs, tiled transposes; generic loop otherwise.
 * Counted as KV_COPY_VIEW_COPY. */
KV_API KV_NODISCARD kv_status kv_view_copy(const struct kv_view *src, const struct kv_view *dst);

/* Device-side kv_view_copy: src and dst describe device (or managed) memory;
 * validated on the host by the same validator as kv_view_copy (same
 * statuses, same messages with this function's name), reduced to the same
 * plan (kv_view_hd.h), then launched on `stream` (NULL = the default
 * stream) without synchronizing. Rows contiguous on both sides move as
 * aligned 16/8/4/2-byte vectors; others element by element.
 * KV_ERR_UNSUPPORTED in a build without CUDA or on a host without a usable
 * device; KV_ERR_DEVICE when the launch fails (the message carries the CUDA
 * error). */
KV_API KV_NODISCARD kv_status kv_view_copy_cuda(const struct kv_view *src,
                                                const struct kv_view *dst, kv_cuda_stream stream);

/* Launches of kv_view_copy_cuda by device path, since the process started. */
struct kv_view_cuda_stats {
    uint64_t vec16, vec8, vec4, vec2, vec1; /* contiguous rows, by vector bytes */
    uint64_t strided;                       /* element by element */
};
/* Snapshot of the device path counters (zeros without CUDA). Thread-safe. */
KV_API void kv_view_cuda_stats_get(struct kv_view_cuda_stats *out);

/* ---- predicates --------------------------------------------------------- */

/* PyTorch is_contiguous: numel == 0, or C order ignoring size-1 dims. */
KV_API bool kv_view_is_contiguous(const struct kv_view *v);
/* Fortran (column-major) order, same size-0/1 rules. */
KV_API bool kv_view_is_f_contiguous(const struct kv_view *v);

/* Lowest and one-past-highest byte (relative to base) any element touches;
 * both 0 when numel == 0. */
KV_API void kv_view_extent_bytes(const struct kv_view *v, int64_t *lo_bytes, int64_t *hi_bytes);

/* Whether two distinct indices of v reach overlapping bytes. *out is set on
 * KV_OK; KV_ERR_TOO_COSTLY when deciding needs more than max_work steps
 * (max_work <= 0: a default of 1<<20). */
KV_API KV_NODISCARD kv_status kv_view_has_internal_overlap(const struct kv_view *v,
                                                           int64_t max_work, bool *out);

/* Fast conservative test: same storage and byte extents intersect. */
KV_API bool kv_view_may_share(const struct kv_view *a, const struct kv_view *b);

/* Exact: does any element of a overlap any element of b? KV_ERR_TOO_COSTLY
 * (and *out untouched) when deciding needs more than max_work steps. */
KV_API KV_NODISCARD kv_status kv_view_shares(const struct kv_view *a, const struct kv_view *b,
                                             int64_t max_work, bool *out);

/* One line: shape, strides (elements and bytes), offset, dtype, contiguity,
 * storage pointer and size, first-element pointer. snprintf semantics:
 * returns the length it needed. */
KV_API int kv_view_describe(const struct kv_view *v, char *buf, size_t cap);

/* ---- copy accounting ---------------------------------------------------- */

#define KV_COPY_REASON_MAP(X)                                                                      \
    X(KV_COPY_MATERIALIZE, "materialize")                                                          \
    X(KV_COPY_VIEW_COPY, "view_copy")                                                              \
    X(KV_COPY_RESHAPE, "reshape")                                                                  \
    X(KV_COPY_FLATTEN, "flatten")                                                                  \
    X(KV_COPY_CONTIGUOUS, "contiguous")                                                            \
    X(KV_COPY_BLOCK_COPY, "block_copy")                                                            \
    X(KV_COPY_PACK, "pack")                                                                        \
    X(KV_COPY_UNPACK, "unpack")                                                                    \
    X(KV_COPY_OFFLOAD, "offload")

/* Why a copy was made: every copy the library makes is counted under one. */
typedef enum kv_copy_reason {
#define KV__COPY_REASON_ENUM(e, name) e,
    KV_COPY_REASON_MAP(KV__COPY_REASON_ENUM)
#undef KV__COPY_REASON_ENUM
        KV_COPY_REASON_COUNT
} kv_copy_reason;

/* Process-wide copy counters, per reason (kv_copy_stats_get). */
struct kv_copy_stats {
    uint64_t calls[KV_COPY_REASON_COUNT];
    uint64_t bytes[KV_COPY_REASON_COUNT];
};

/* Snapshot of process-wide copy counters. Thread-safe. */
KV_API void kv_copy_stats_get(struct kv_copy_stats *out);
/* Zero all counters. Thread-safe. */
KV_API void kv_copy_stats_reset(void);
/* "reshape" for KV_COPY_RESHAPE; "?" otherwise. */
KV_API const char *kv_copy_reason_name(kv_copy_reason r);

#ifdef __cplusplus
}
#endif

#endif /* KV_VIEW_H */
