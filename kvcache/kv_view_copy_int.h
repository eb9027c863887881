/*
 * kv_view_copy_int.h - what the CPU copy engine's two files share
 * (kv_view_copy.c: plan, runs, generic loop, entry points;
 * kv_view_transpose.c: the tiled transpose): the plan as pointers, the
 * odometer over its outer dims, typed element moves and streaming stores.
 * Library-private (kvcache/ only): not installed.
 */
#ifndef KV_VIEW_COPY_INT_H
#define KV_VIEW_COPY_INT_H

#include <string.h>

#include "kv_view_int.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV__COPY_X86 1
#else
#define KV__COPY_X86 0
#endif

/* ---- typed element access ----------------------------------------------- */

/* Element-sized integers that may alias any stored type (f16, bf16, float,
 * double...) and need no alignment beyond a byte: views may start anywhere. */
#if defined(__GNUC__)
typedef uint16_t __attribute__((may_alias, aligned(1))) kv__u16;
typedef uint32_t __attribute__((may_alias, aligned(1))) kv__u32;
typedef uint64_t __attribute__((may_alias, aligned(1))) kv__u64;
#define KV__ALWAYS_INLINE inline __attribute__((always_inline))
#else
typedef uint16_t kv__u16;
typedef uint32_t kv__u32;
typedef uint64_t kv__u64;
#define KV__ALWAYS_INLINE inline
#endif

static KV__ALWAYS_INLINE void kv__copy_elem(char *d, const char *s, size_t esz)
{
    switch (esz) {
    case 1:
        *d = *s;
        break;
    case 2:
        *(kv__u16 *)d = *(const kv__u16 *)s;
        break;
    case 4:
        *(kv__u32 *)d = *(const kv__u32 *)s;
        break;
    default:
        *(kv__u64 *)d = *(const kv__u64 *)s;
        break;
    }
}

/* n elements, dst stride ds bytes, src stride ss bytes. */
static KV__ALWAYS_INLINE void kv__strided_line(char *d, int64_t ds, const char *s, int64_t ss,
                                               int64_t n, size_t esz)
{
    for (int64_t i = 0; i < n; i++)
        kv__copy_elem(d + i * ds, s + i * ss, esz);
}

/* ---- the plan ----------------------------------------------------------- */

struct kv__copy_plan {
    int ndim;                   /* after coalescing; 0 = one element */
    size_t esz;                 /* bytes per element: 1, 2, 4 or 8 */
    int64_t shape[KV_MAX_DIMS]; /* every entry >= 2 */
    int64_t ds[KV_MAX_DIMS];    /* dst stride, bytes */
    int64_t ss[KV_MAX_DIMS];    /* src stride, bytes */
    char *dst;                  /* dst element [0,...,0] */
    const char *src;            /* src element [0,...,0] */
};

/* Odometer over the dims listed in dims[0..nd) (outermost first); returns
 * false after the last index. d/s are moved to the next index. */
static KV__ALWAYS_INLINE bool kv__odometer_next(const struct kv__copy_plan *p, const int *dims,
                                                int nd, int64_t *idx, char **d, const char **s)
{
    for (int t = nd - 1; t >= 0; t--) {
        int k = dims[t];
        if (++idx[t] < p->shape[k]) {
            *d += p->ds[k];
            *s += p->ss[k];
            return true;
        }
        idx[t] = 0;
        *d -= p->ds[k] * (p->shape[k] - 1);
        *s -= p->ss[k] * (p->shape[k] - 1);
    }
    return false;
}

/* ---- streaming stores --------------------------------------------------- */

/* Copies moving at least this much write dst with streaming (non-temporal)
 * stores: dst lines are not read for ownership first (a plain store pays a
 * read, then a write-back, per line), and the copy does not evict the
 * caller's working set. Used by the runs and the transpose paths. */
#define KV__STREAM_MIN_BYTES ((int64_t)32 << 20)

/* Copies n bytes with streaming stores where d is 16-byte aligned (the
 * unaligned head and the tail go through memcpy). x86 only; memcpy elsewhere. */
static KV__ALWAYS_INLINE void kv__stream_bytes(char *d, const char *s, size_t n)
{
#if KV__COPY_X86
    size_t head = (size_t)(-(uintptr_t)d & 15);
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t b = 0;
    for (; b + 64 <= n; b += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(s + b));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(s + b + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + b + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(s + b + 48));
        _mm_stream_si128((__m128i *)(d + b), x0);
        _mm_stream_si128((__m128i *)(d + b + 16), x1);
        _mm_stream_si128((__m128i *)(d + b + 32), x2);
        _mm_stream_si128((__m128i *)(d + b + 48), x3);
    }
    for (; b + 16 <= n; b += 16)
        _mm_stream_si128((__m128i *)(d + b), _mm_loadu_si128((const __m128i *)(s + b)));
    memcpy(d + b, s + b, n - b);
#else
    memcpy(d, s, n);
#endif
}

/* ---- the tiled transpose (kv_view_transpose.c) --------------------------- */

/* Dims r (src row dim) and c (src stride-1 dim, dst row dim) of p are
 * transposed (src rows srs bytes apart, dst rows drs bytes apart); every
 * other dim is walked by the odometer. */
void kv__copy_transpose(const struct kv__copy_plan *p, int r, int c, int64_t srs, int64_t drs);

#endif /* KV_VIEW_COPY_INT_H */
