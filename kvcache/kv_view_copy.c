/*
 * kv_view_copy.c - the copy engine behind every view copy, and the process-wide
 * copy counters.
 *
 * kv__view_copy_unchecked() turns a (src, dst) pair of same-shaped views into a
 * plan and runs the cheapest of three loops:
 *
 *   1. plan: kv_copy_plan_build (kv_view_hd.h, shared with the CUDA
 *      kernel): drop size-1 dims, order dims by dst stride (largest first;
 *      dst has no internal overlap, so this only changes the visiting order),
 *      merge dims that BOTH views step over contiguously.
 *   2. runs:      both innermost strides are 1 element -> memcpy of each run
 *                 over the outer index space (one memcpy when fully contiguous);
 *                 short runs prefetch the next outer slab. Copies >= 32 MiB
 *                 (x86) instead walk in src order, several src streams at
 *                 once, and write dst with streaming stores.
 *   3. transpose: one side has stride 1 innermost, the other side has its
 *                 stride-1 dim elsewhere -> cache-tiled 2-D transpose between
 *                 those two dims, register-blocked (SSE2 on x86-64, a plain C
 *                 block elsewhere), for each index of the other dims; large
 *                 ones go through a padded staging tile, and copies >= 32 MiB
 *                 (x86) also build whole dst row segments in an L1 buffer and
 *                 write them with streaming stores (see below).
 *   4. generic:   N-d odometer over the outer dims, typed strided inner loop.
 *
 * Measured choices (tile sizes, staging, streaming) are in docs/benchmarks.md.
 *
 * All offsets are int64 products computed in bytes. Element sizes 1, 2, 4, 8.
 */
#include <stdatomic.h>
#include <string.h>

#include "kv_mem.h"
#include "kv_view_int.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV__COPY_X86 1
#else
#define KV__COPY_X86 0
#endif

/* ---- copy accounting ---------------------------------------------------- */

static _Atomic uint64_t kv__copy_calls[KV_COPY_REASON_COUNT];
static _Atomic uint64_t kv__copy_bytes[KV_COPY_REASON_COUNT];

void kv__copy_count(kv_copy_reason reason, uint64_t bytes)
{
    if ((unsigned)reason >= (unsigned)KV_COPY_REASON_COUNT)
        return;
    atomic_fetch_add_explicit(&kv__copy_calls[reason], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&kv__copy_bytes[reason], bytes, memory_order_relaxed);
}

void kv_copy_stats_get(struct kv_copy_stats *out)
{
    if (!out)
        return;
    for (int r = 0; r < KV_COPY_REASON_COUNT; r++) {
        out->calls[r] = atomic_load_explicit(&kv__copy_calls[r], memory_order_relaxed);
        out->bytes[r] = atomic_load_explicit(&kv__copy_bytes[r], memory_order_relaxed);
    }
}

void kv_copy_stats_reset(void)
{
    for (int r = 0; r < KV_COPY_REASON_COUNT; r++) {
        atomic_store_explicit(&kv__copy_calls[r], 0, memory_order_relaxed);
        atomic_store_explicit(&kv__copy_bytes[r], 0, memory_order_relaxed);
    }
}

const char *kv_copy_reason_name(kv_copy_reason r)
{
    switch (r) {
#define KV__COPY_REASON_NAME(e, name)                                                              \
    case e:                                                                                        \
        return name;
        KV_COPY_REASON_MAP(KV__COPY_REASON_NAME)
#undef KV__COPY_REASON_NAME
    case KV_COPY_REASON_COUNT:
        break;
    }
    return "?";
}

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

static void kv__strided_line_any(char *d, int64_t ds, const char *s, int64_t ss, int64_t n,
                                 size_t esz)
{
    switch (esz) {
    case 1:
        kv__strided_line(d, ds, s, ss, n, 1);
        break;
    case 2:
        kv__strided_line(d, ds, s, ss, n, 2);
        break;
    case 4:
        kv__strided_line(d, ds, s, ss, n, 4);
        break;
    default:
        kv__strided_line(d, ds, s, ss, n, 8);
        break;
    }
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

/* The shared plan (kv_view_hd.h: the same reduction the CUDA kernel
 * runs) as pointers for the CPU loops. Returns false when there is nothing
 * to copy (numel == 0). */
static bool kv__copy_plan_build(struct kv__copy_plan *p, const struct kv_view *src,
                                const struct kv_view *dst)
{
    const struct kv_view_geom sg = kv__view_geom(src), dg = kv__view_geom(dst);
    struct kv_copy_plan cp;

    if (!kv_copy_plan_build(&cp, &sg, &dg, (int32_t)kv_dtype_size(src->dtype)))
        return false;
    p->ndim = cp.ndim;
    p->esz = (size_t)cp.elem_bytes;
    for (int k = 0; k < cp.ndim; k++) {
        p->shape[k] = cp.shape[k];
        p->ds[k] = cp.dst_strides_bytes[k];
        p->ss[k] = cp.src_strides_bytes[k];
    }
    p->dst = (char *)dst->base + cp.dst_offset_bytes;
    p->src = (const char *)src->base + cp.src_offset_bytes;
    return true;
}

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

/* ---- 1: contiguous runs ------------------------------------------------- */

#if defined(__GNUC__)
#define KV__PREFETCH(ptr) __builtin_prefetch((ptr), 0, 3)
#else
#define KV__PREFETCH(ptr) ((void)(ptr))
#endif

/* Runs shorter than this get a software prefetch of the next outer slab; the
 * hardware prefetchers follow longer runs on their own. */
#define KV__PF_RUN_MAX 2048
/* Slabs (src bytes under one index of dim 0) up to this size are prefetched. */
#define KV__PF_SLAB_MAX ((int64_t)256 << 10)

/* Copies moving at least this much write dst with streaming (non-temporal)
 * stores: dst lines are not read for ownership first (a plain store pays a
 * read, then a write-back, per line), and the copy does not evict the
 * caller's working set. Used by the runs and the transpose paths. */
#define KV__STREAM_MIN_BYTES ((int64_t)32 << 20)

static bool kv__stream_ok(const struct kv__copy_plan *p, size_t run)
{
#if KV__COPY_X86
    int64_t total = (int64_t)run;
    if (run % 64 != 0 || ((uintptr_t)p->dst & 15) != 0)
        return false;
    for (int k = 0; k < p->ndim - 1; k++) {
        if (p->ds[k] % 64 != 0)
            return false;
        total *= p->shape[k];
    }
    return total >= KV__STREAM_MIN_BYTES;
#else
    (void)p;
    (void)run;
    return false;
#endif
}

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

/*
 * Streamed runs: read source memory in several concurrent sequential streams.
 *
 * One core reading one sequential stream is limited by how far the hardware
 * prefetcher runs ahead in that stream; a large glibc memcpy reads 2-4 pages
 * at once for that reason. So the streaming walk
 *   - visits the outer dims in SRC order (largest src stride first), so each
 *     stream reads its source bytes front to back, and
 *   - keeps KV__LANES consecutive indices of the src-outermost dim ("lanes",
 *     one src stride apart) in flight, copying KV__LANE_CHUNK bytes of each in
 *     turn.
 * dst runs land scattered, but each is whole 64-byte lines written with
 * streaming stores, which the write-combining buffers absorb in any order.
 * Measured on [8192][16][8][128] bf16 -> [8192][8][16][128] (256 B runs):
 * dst order 0.73x memcpy, src order 0.79x, src order + 4 lanes 1.1x.
 */
#define KV__LANES 4
#define KV__LANE_CHUNK 256 /* bytes; a multiple of 64 */

static void kv__copy_runs_stream(const struct kv__copy_plan *dp, size_t run)
{
    struct kv__copy_plan p = *dp;
    const int in = p.ndim - 1;
    int dims[KV_MAX_DIMS];
    int64_t idx[KV_MAX_DIMS] = {0};

    /* Stable insertion sort of the outer dims by src stride, largest first
     * (any visiting order is valid: dst elements are distinct and disjoint
     * from src). */
    for (int i = 1; i < in; i++) {
        int64_t sh = p.shape[i], ds = p.ds[i], ss = p.ss[i];
        int j = i - 1;
        while (j >= 0 && p.ss[j] < ss) {
            p.shape[j + 1] = p.shape[j];
            p.ds[j + 1] = p.ds[j];
            p.ss[j + 1] = p.ss[j];
            j--;
        }
        p.shape[j + 1] = sh;
        p.ds[j + 1] = ds;
        p.ss[j + 1] = ss;
    }
    for (int k = 1; k < in; k++)
        dims[k - 1] = k;
    const int nodo = in - 1;
    const int64_t ds0 = p.ds[0], ss0 = p.ss[0];

    for (int64_t i0 = 0; i0 < p.shape[0]; i0 += KV__LANES) {
        const int lanes = p.shape[0] - i0 < KV__LANES ? (int)(p.shape[0] - i0) : KV__LANES;
        char *d = p.dst + i0 * ds0;
        const char *s = p.src + i0 * ss0;
        do {
            for (size_t b = 0; b < run; b += KV__LANE_CHUNK) {
                const size_t n = run - b < KV__LANE_CHUNK ? run - b : KV__LANE_CHUNK;
                for (int l = 0; l < lanes; l++)
                    kv__stream_bytes(d + l * ds0 + b, s + l * ss0 + b, n);
            }
        } while (kv__odometer_next(&p, dims, nodo, idx, &d, &s));
    }
#if KV__COPY_X86
    _mm_sfence(); /* order the streaming stores before later loads/stores */
#endif
}

static void kv__copy_runs(const struct kv__copy_plan *p)
{
    const int in = p->ndim - 1;
    const size_t run = (size_t)p->shape[in] * p->esz;
    int dims[KV_MAX_DIMS];
    int64_t idx[KV_MAX_DIMS] = {0};

    if (in == 0) {
        memcpy(p->dst, p->src, run);
        return;
    }
    if (kv__stream_ok(p, run)) {
        kv__copy_runs_stream(p, run);
        return;
    }
    /* Dim 0 walks slabs; dims 1..in-1 are walked by an odometer whose last
     * dim is a tight loop (for in == 1 the slab is a single run). While one
     * slab is copied, the next slab's src bytes are prefetched, a slice per
     * run: small scattered runs otherwise stall on every first touch. */
    int64_t slab_bytes = (int64_t)run, runs_per_slab = 1;
    for (int k = 1; k < in; k++) {
        slab_bytes += (p->shape[k] - 1) * p->ss[k];
        runs_per_slab *= p->shape[k];
    }
    int64_t pf_step = 0;
    if (run < KV__PF_RUN_MAX && slab_bytes <= KV__PF_SLAB_MAX && p->ss[0] != 0)
        pf_step = ((slab_bytes + runs_per_slab - 1) / runs_per_slab + 63) & ~(int64_t)63;
    for (int k = 1; k < in - 1; k++)
        dims[k - 1] = k;
    const int nodo = in > 1 ? in - 2 : 0;
    const int64_t n1 = in > 1 ? p->shape[in - 1] : 1;
    const int64_t d1 = in > 1 ? p->ds[in - 1] : 0, s1 = in > 1 ? p->ss[in - 1] : 0;

    for (int64_t i0 = 0; i0 < p->shape[0]; i0++) {
        char *d = p->dst + i0 * p->ds[0];
        const char *s = p->src + i0 * p->ss[0];
        const char *pf = s + p->ss[0];
        const char *pf_end = i0 + 1 < p->shape[0] ? pf + slab_bytes : pf;
        do {
            char *dd = d;
            const char *sp = s;
            for (int64_t i = 0; i < n1; i++, dd += d1, sp += s1) {
                memcpy(dd, sp, run);
                if (pf_step && pf < pf_end) {
                    for (int64_t b = 0; b < pf_step; b += 64)
                        KV__PREFETCH(pf + b);
                    pf += pf_step;
                }
            }
        } while (kv__odometer_next(p, dims, nodo, idx, &d, &s));
    }
}

/* ---- 2: tiled transpose ------------------------------------------------- */

/*
 * kv__transpose: dst[c][r] = src[r][c] for r < rows, c < cols, where src rows
 * are `srs` bytes apart and dst rows `drs` bytes apart, elements contiguous:
 *
 *     src  r0: c0 c1 c2 ...        dst  c0: r0 r1 r2 ...
 *          r1: c0 c1 c2 ...             c1: r0 r1 r2 ...
 *
 * Work goes in TILE x TILE element tiles (one tile of each side stays in L1/L2)
 * made of B x B register blocks; B is 8 for 1/2/4-byte elements and 4 for
 * 8-byte ones. The ragged edge is copied element by element.
 */
#define KV__TILE 64

/* Portable B x B block: the compiler keeps it in registers where it can. */
static KV__ALWAYS_INLINE void kv__block_c(char *d, int64_t drs, const char *s, int64_t srs, int B,
                                          size_t esz)
{
    for (int c = 0; c < B; c++)
        for (int r = 0; r < B; r++)
            kv__copy_elem(d + c * drs + (int64_t)r * (int64_t)esz,
                          s + r * srs + (int64_t)c * (int64_t)esz, esz);
}

#if KV__COPY_X86
/* 8x8 bytes: 8-byte rows in, 8-byte rows out. */
static KV__ALWAYS_INLINE void kv__block8_u8_sse2(char *d, int64_t drs, const char *s, int64_t srs)
{
    __m128i r0 = _mm_loadl_epi64((const __m128i *)(s + 0 * srs));
    __m128i r1 = _mm_loadl_epi64((const __m128i *)(s + 1 * srs));
    __m128i r2 = _mm_loadl_epi64((const __m128i *)(s + 2 * srs));
    __m128i r3 = _mm_loadl_epi64((const __m128i *)(s + 3 * srs));
    __m128i r4 = _mm_loadl_epi64((const __m128i *)(s + 4 * srs));
    __m128i r5 = _mm_loadl_epi64((const __m128i *)(s + 5 * srs));
    __m128i r6 = _mm_loadl_epi64((const __m128i *)(s + 6 * srs));
    __m128i r7 = _mm_loadl_epi64((const __m128i *)(s + 7 * srs));
    __m128i a0 = _mm_unpacklo_epi8(r0, r1), a1 = _mm_unpacklo_epi8(r2, r3);
    __m128i a2 = _mm_unpacklo_epi8(r4, r5), a3 = _mm_unpacklo_epi8(r6, r7);
    __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
    __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
    __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
    __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
    _mm_storel_epi64((__m128i *)(d + 0 * drs), c0);
    _mm_storel_epi64((__m128i *)(d + 1 * drs), _mm_unpackhi_epi64(c0, c0));
    _mm_storel_epi64((__m128i *)(d + 2 * drs), c1);
    _mm_storel_epi64((__m128i *)(d + 3 * drs), _mm_unpackhi_epi64(c1, c1));
    _mm_storel_epi64((__m128i *)(d + 4 * drs), c2);
    _mm_storel_epi64((__m128i *)(d + 5 * drs), _mm_unpackhi_epi64(c2, c2));
    _mm_storel_epi64((__m128i *)(d + 6 * drs), c3);
    _mm_storel_epi64((__m128i *)(d + 7 * drs), _mm_unpackhi_epi64(c3, c3));
}

/* 8x8 two-byte elements: 16-byte rows in and out. */
static KV__ALWAYS_INLINE void kv__block8_u16_sse2(char *d, int64_t drs, const char *s, int64_t srs)
{
    __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0 * srs));
    __m128i r1 = _mm_loadu_si128((const __m128i *)(s + 1 * srs));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * srs));
    __m128i r3 = _mm_loadu_si128((const __m128i *)(s + 3 * srs));
    __m128i r4 = _mm_loadu_si128((const __m128i *)(s + 4 * srs));
    __m128i r5 = _mm_loadu_si128((const __m128i *)(s + 5 * srs));
    __m128i r6 = _mm_loadu_si128((const __m128i *)(s + 6 * srs));
    __m128i r7 = _mm_loadu_si128((const __m128i *)(s + 7 * srs));
    __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
    __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
    __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
    __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    _mm_storeu_si128((__m128i *)(d + 0 * drs), _mm_unpacklo_epi64(b0, b4));
    _mm_storeu_si128((__m128i *)(d + 1 * drs), _mm_unpackhi_epi64(b0, b4));
    _mm_storeu_si128((__m128i *)(d + 2 * drs), _mm_unpacklo_epi64(b1, b5));
    _mm_storeu_si128((__m128i *)(d + 3 * drs), _mm_unpackhi_epi64(b1, b5));
    _mm_storeu_si128((__m128i *)(d + 4 * drs), _mm_unpacklo_epi64(b2, b6));
    _mm_storeu_si128((__m128i *)(d + 5 * drs), _mm_unpackhi_epi64(b2, b6));
    _mm_storeu_si128((__m128i *)(d + 6 * drs), _mm_unpacklo_epi64(b3, b7));
    _mm_storeu_si128((__m128i *)(d + 7 * drs), _mm_unpackhi_epi64(b3, b7));
}

/* 4x4 four-byte elements. */
static KV__ALWAYS_INLINE void kv__block4_u32_sse2(char *d, int64_t drs, const char *s, int64_t srs)
{
    __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0 * srs));
    __m128i r1 = _mm_loadu_si128((const __m128i *)(s + 1 * srs));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * srs));
    __m128i r3 = _mm_loadu_si128((const __m128i *)(s + 3 * srs));
    __m128i a0 = _mm_unpacklo_epi32(r0, r1), a1 = _mm_unpacklo_epi32(r2, r3);
    __m128i a2 = _mm_unpackhi_epi32(r0, r1), a3 = _mm_unpackhi_epi32(r2, r3);
    _mm_storeu_si128((__m128i *)(d + 0 * drs), _mm_unpacklo_epi64(a0, a1));
    _mm_storeu_si128((__m128i *)(d + 1 * drs), _mm_unpackhi_epi64(a0, a1));
    _mm_storeu_si128((__m128i *)(d + 2 * drs), _mm_unpacklo_epi64(a2, a3));
    _mm_storeu_si128((__m128i *)(d + 3 * drs), _mm_unpackhi_epi64(a2, a3));
}

static KV__ALWAYS_INLINE void kv__block8_u32_sse2(char *d, int64_t drs, const char *s, int64_t srs)
{
    kv__block4_u32_sse2(d, drs, s, srs);
    kv__block4_u32_sse2(d + 16, drs, s + 4 * srs, srs);
    kv__block4_u32_sse2(d + 4 * drs, drs, s + 16, srs);
    kv__block4_u32_sse2(d + 4 * drs + 16, drs, s + 4 * srs + 16, srs);
}

/* 2x2 eight-byte elements. */
static KV__ALWAYS_INLINE void kv__block2_u64_sse2(char *d, int64_t drs, const char *s, int64_t srs)
{
    __m128i r0 = _mm_loadu_si128((const __m128i *)s);
    __m128i r1 = _mm_loadu_si128((const __m128i *)(s + srs));
    _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi64(r0, r1));
    _mm_storeu_si128((__m128i *)(d + drs), _mm_unpackhi_epi64(r0, r1));
}
#endif /* KV__COPY_X86 */

/* One B x B block, B = kv__block_elems(esz). */
static KV__ALWAYS_INLINE int kv__block_elems(size_t esz)
{
    return esz == 8 ? 4 : 8;
}

static KV__ALWAYS_INLINE void kv__block(char *d, int64_t drs, const char *s, int64_t srs,
                                        size_t esz)
{
#if KV__COPY_X86
    switch (esz) {
    case 1:
        kv__block8_u8_sse2(d, drs, s, srs);
        return;
    case 2:
        kv__block8_u16_sse2(d, drs, s, srs);
        return;
    case 4:
        kv__block8_u32_sse2(d, drs, s, srs);
        return;
    default:
        kv__block2_u64_sse2(d, drs, s, srs);
        kv__block2_u64_sse2(d + 16, drs, s + 2 * srs, srs);
        kv__block2_u64_sse2(d + 2 * drs, drs, s + 16, srs);
        kv__block2_u64_sse2(d + 2 * drs + 16, drs, s + 2 * srs + 16, srs);
        return;
    }
#else
    kv__block_c(d, drs, s, srs, kv__block_elems(esz), esz);
#endif
}

static KV__ALWAYS_INLINE void kv__transpose(char *d, int64_t drs, const char *s, int64_t srs,
                                            int64_t rows, int64_t cols, size_t esz, int64_t tile)
{
    const int64_t B = kv__block_elems(esz);
    const int64_t e = (int64_t)esz;

    for (int64_t c0 = 0; c0 < cols; c0 += tile) {
        const int64_t c1 = c0 + tile < cols ? c0 + tile : cols;
        const int64_t cf = c0 + (c1 - c0) / B * B;
        for (int64_t r0 = 0; r0 < rows; r0 += tile) {
            const int64_t r1 = r0 + tile < rows ? r0 + tile : rows;
            const int64_t rf = r0 + (r1 - r0) / B * B;
            for (int64_t c = c0; c < cf; c += B)
                for (int64_t r = r0; r < rf; r += B)
                    kv__block(d + c * drs + r * e, drs, s + r * srs + c * e, srs, esz);
            /* ragged right edge of src (bottom rows of dst) */
            for (int64_t c = cf; c < c1; c++)
                kv__strided_line(d + c * drs + r0 * e, e, s + r0 * srs + c * e, srs, r1 - r0, esz);
            /* ragged bottom edge of src (right columns of dst) */
            for (int64_t c = c0; c < cf; c++)
                kv__strided_line(d + c * drs + rf * e, e, s + rf * srs + c * e, srs, r1 - rf, esz);
        }
    }
}

/*
 * Large transposes are staged: a tile of src is first copied row by row (long
 * sequential segments, the way memory likes to be read) into a small buffer
 * whose rows are padded off the power-of-two stride, then transposed from
 * there. Without the buffer, src rows 2^k bytes apart fall into the same cache
 * sets and every tile is fetched from memory twice.
 *
 * What happens next depends on the size of the whole copy:
 *
 *   KV__TR_STAGED  (>= KV__STAGE_MIN_BYTES): the staged tile is transposed
 *                  straight into dst (ST x ST tile, ST = kv__stage_elems()).
 *   KV__TR_STREAM  (>= KV__STREAM_MIN_BYTES, x86): the staged tile (T x T,
 *                  T = kv__stream_tile_elems()) is transposed KV__STREAM_SUB
 *                  dst rows at a time into a second, L1-resident buffer, and
 *                  each of those dst row segments is written out whole with
 *                  streaming stores:
 *
 *        src tile          staging A (padded)    B: SUB dst rows    dst
 *     T rows, T*e B  --memcpy-->  [T][T*e+pad]  --8x8 blocks-->  [SUB][T*e]  --NT-->  rows
 *
 *                  Plain stores of dst segments 16 KiB apart pay a read for
 *                  ownership and an out-of-order write-back per line; streaming
 *                  stores of whole lines, written consecutively so that every
 *                  write-combining buffer fills completely, pay neither.
 *                  Measured on 4096x4096 (vs memcpy, Intel Xeon): f32 0.455 ->
 *                  0.88, f16 0.39 -> 0.84. Streaming the 8x8 blocks straight to
 *                  dst (each line then filled by several blocks, out of order)
 *                  was 0.33.
 *   KV__TR_STREAM_PF  the same on AMD CPUs, plus a software prefetch into L2
 *                  (prefetcht1) of the src tile KV__STREAM_PF_AHEAD tiles
 *                  ahead, issued while the current tile is staged. On AMD EPYC
 *                  (Zen 4, family 25) KV__TR_STREAM alone measured only 0.37-0.50
 *                  of memcpy (f32 and f16): the hardware prefetchers do not run
 *                  ahead in 64-128 src rows that each advance by 256 bytes per
 *                  tile, so every staged row waits on DRAM. With the L2
 *                  prefetch: f32 0.76-0.84, f16 0.69-0.86 (standalone harness;
 *                  library numbers in docs/benchmarks.md). Intel keeps
 *                  KV__TR_STREAM: there a T0 prefetch of the next tile gained
 *                  nothing for f32 and cost f16 0.84 -> 0.70-0.77, and T1 was
 *                  never measured there, so the measured-best Intel path is
 *                  left as it was.
 */
enum kv__tr_mode { KV__TR_DIRECT, KV__TR_STAGED, KV__TR_STREAM, KV__TR_STREAM_PF };

static KV__ALWAYS_INLINE int64_t kv__stage_elems(size_t esz)
{
    return esz >= 8 ? 128 : esz == 4 ? 256 : 512;
}
#define KV__STAGE_PAD 64 /* bytes added to each staged row */

static KV__ALWAYS_INLINE size_t kv__stage_bytes(size_t esz)
{
    const int64_t t = kv__stage_elems(esz);
    return (size_t)(t * (t * (int64_t)esz + KV__STAGE_PAD));
}

/* Streamed tiles are 256 bytes wide (T = 256 / esz elements): measured
 * 4096x4096 vs memcpy, f32 T=64 0.88, T=128 0.85, T=256 0.80-0.9 (noisy),
 * T=512 0.67; f16 T=64 0.72, T=128 0.84, T=256 0.82-0.88. */
static KV__ALWAYS_INLINE int64_t kv__stream_tile_elems(size_t esz)
{
    return 256 / (int64_t)esz;
}
#define KV__STREAM_SUB 8 /* dst rows per pass through B; 8/16/32 measured, 8 best */

/* A: T x (T*e + pad), then B: SUB x (T*e + pad). */
static KV__ALWAYS_INLINE size_t kv__stream_bytes_needed(size_t esz)
{
    const int64_t t = kv__stream_tile_elems(esz);
    return (size_t)((t + KV__STREAM_SUB) * (t * (int64_t)esz + KV__STAGE_PAD));
}

static KV__ALWAYS_INLINE void kv__transpose_staged(char *d, int64_t drs, const char *s, int64_t srs,
                                                   int64_t rows, int64_t cols, size_t esz,
                                                   char *buf)
{
    const int64_t T = kv__stage_elems(esz);
    const int64_t e = (int64_t)esz;
    const int64_t bs = T * e + KV__STAGE_PAD; /* staged row stride, bytes */

    for (int64_t r0 = 0; r0 < rows; r0 += T) {
        const int64_t tr = r0 + T < rows ? T : rows - r0;
        for (int64_t c0 = 0; c0 < cols; c0 += T) {
            const int64_t tc = c0 + T < cols ? T : cols - c0;
            for (int64_t r = 0; r < tr; r++)
                memcpy(buf + r * bs, s + (r0 + r) * srs + c0 * e, (size_t)(tc * e));
            kv__transpose(d + c0 * drs + r0 * e, drs, buf, bs, tr, tc, esz, T);
        }
    }
}

/* Tiles ahead whose src rows KV__TR_STREAM_PF prefetches: on AMD EPYC 1, 2
 * and 3 measured the same within noise (f32 0.76-0.84, f16 0.69-0.84); 2
 * leaves the most slack for DRAM latency under load. */
#define KV__STREAM_PF_AHEAD 2

/* Prefetch into L2 the src bytes [p, p + n): every 64-byte line they touch. */
static KV__ALWAYS_INLINE void kv__prefetch_l2(const char *p, int64_t n)
{
#if KV__COPY_X86
    const char *q = (const char *)((uintptr_t)p & ~(uintptr_t)63);
    for (; q < p + n; q += 64)
        _mm_prefetch(q, _MM_HINT_T1);
#else
    (void)p;
    (void)n;
#endif
}

static KV__ALWAYS_INLINE void kv__transpose_stream(char *d, int64_t drs, const char *s, int64_t srs,
                                                   int64_t rows, int64_t cols, size_t esz,
                                                   char *buf, bool prefetch)
{
    const int64_t T = kv__stream_tile_elems(esz);
    const int64_t e = (int64_t)esz;
    const int64_t bs = T * e + KV__STAGE_PAD; /* row stride of A and of B, bytes */
    char *a = buf;                            /* [T][bs]: staged src tile */
    char *b = buf + T * bs;                   /* [SUB][bs]: dst rows being built */
    const int64_t col_tiles = (cols + T - 1) / T;
    int64_t tile = 0; /* index of the tile (r0, c0) in visiting order */

    for (int64_t r0 = 0; r0 < rows; r0 += T) {
        const int64_t tr = r0 + T < rows ? T : rows - r0;
        for (int64_t c0 = 0; c0 < cols; c0 += T, tile++) {
            const int64_t tc = c0 + T < cols ? T : cols - c0;
            /* The tile KV__STREAM_PF_AHEAD ahead in the same order (pr = rows:
             * none left), prefetched a row per staged row. */
            int64_t pr0 = rows, pc0 = 0, ptr = 0, ptc = 0;
            if (prefetch) {
                const int64_t ahead = tile + KV__STREAM_PF_AHEAD;
                pr0 = ahead / col_tiles * T;
                pc0 = ahead % col_tiles * T;
                ptr = pr0 + T < rows ? T : rows - pr0;
                ptc = pc0 + T < cols ? T : cols - pc0;
            }
            for (int64_t r = 0; r < tr; r++) {
                memcpy(a + r * bs, s + (r0 + r) * srs + c0 * e, (size_t)(tc * e));
                if (prefetch && pr0 < rows && r < ptr)
                    kv__prefetch_l2(s + (pr0 + r) * srs + pc0 * e, ptc * e);
            }
            for (int64_t c = 0; c < tc; c += KV__STREAM_SUB) {
                const int64_t sc = c + KV__STREAM_SUB < tc ? KV__STREAM_SUB : tc - c;
                /* b[k][r] = a[r][c + k] */
                kv__transpose(b, bs, a + c * e, bs, tr, sc, esz, T);
                for (int64_t k = 0; k < sc; k++)
                    kv__stream_bytes(d + (c0 + c + k) * drs + r0 * e, b + k * bs, (size_t)(tr * e));
            }
        }
    }
}

static KV__ALWAYS_INLINE void kv__transpose_mode(char *d, int64_t drs, const char *s, int64_t srs,
                                                 int64_t rows, int64_t cols, size_t esz,
                                                 enum kv__tr_mode mode, char *buf)
{
    switch (mode) {
    case KV__TR_STREAM:
        kv__transpose_stream(d, drs, s, srs, rows, cols, esz, buf, false);
        break;
    case KV__TR_STREAM_PF:
        kv__transpose_stream(d, drs, s, srs, rows, cols, esz, buf, true);
        break;
    case KV__TR_STAGED:
        kv__transpose_staged(d, drs, s, srs, rows, cols, esz, buf);
        break;
    case KV__TR_DIRECT:
        kv__transpose(d, drs, s, srs, rows, cols, esz, KV__TILE);
        break;
    }
}

/* Dispatch on the element size so that each copy of the loops is compiled
 * for a constant esz. */
static void kv__transpose_any(char *d, int64_t drs, const char *s, int64_t srs, int64_t rows,
                              int64_t cols, size_t esz, enum kv__tr_mode mode, char *buf)
{
    switch (esz) {
    case 1:
        kv__transpose_mode(d, drs, s, srs, rows, cols, 1, mode, buf);
        break;
    case 2:
        kv__transpose_mode(d, drs, s, srs, rows, cols, 2, mode, buf);
        break;
    case 4:
        kv__transpose_mode(d, drs, s, srs, rows, cols, 4, mode, buf);
        break;
    default:
        kv__transpose_mode(d, drs, s, srs, rows, cols, 8, mode, buf);
        break;
    }
}

/* True on AMD CPUs (x86 only; cached after the first call). Selects
 * KV__TR_STREAM_PF over KV__TR_STREAM. __builtin_cpu_init() is idempotent and
 * is needed here because this may run before libgcc's constructor in a
 * shared library. Racing first calls store the same value. */
static bool kv__cpu_is_amd(void)
{
#if KV__COPY_X86
    static _Atomic int cached; /* 0 unknown, 1 no, 2 yes */
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v == 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_is("amd") ? 2 : 1;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v == 2;
#else
    return false;
#endif
}

/* Transposes moving less than this stay in cache: no staging buffer. */
#define KV__STAGE_MIN_BYTES ((int64_t)1 << 20)

/* Dims r (src row dim) and c (src stride-1 dim, dst row dim) are transposed;
 * every other dim is walked by the odometer. */
static void kv__copy_transpose(const struct kv__copy_plan *p, int r, int c, int64_t srs,
                               int64_t drs)
{
    int dims[KV_MAX_DIMS];
    int64_t idx[KV_MAX_DIMS] = {0};
    int nd = 0;
    char *d = p->dst;
    const char *s = p->src;
    int64_t total = (int64_t)p->esz;

    for (int k = 0; k < p->ndim; k++) {
        total *= p->shape[k];
        if (k != r && k != c)
            dims[nd++] = k;
    }
    /* Stage only a transpose that is both large and at least half a tile
     * wide each way; the buffer is best effort (without it: direct tiles). */
    enum kv__tr_mode mode = KV__TR_DIRECT;
    char *buf = NULL;
    const int64_t t = KV__COPY_X86 && total >= KV__STREAM_MIN_BYTES ? kv__stream_tile_elems(p->esz)
                                                                    : kv__stage_elems(p->esz);
    if (p->shape[r] >= t / 2 && p->shape[c] >= t / 2 &&
        p->shape[r] * p->shape[c] * (int64_t)p->esz >= KV__STAGE_MIN_BYTES) {
        if (KV__COPY_X86 && total >= KV__STREAM_MIN_BYTES) {
            buf = kv__mem_alloc_aligned(64, kv__stream_bytes_needed(p->esz));
            mode = kv__cpu_is_amd() ? KV__TR_STREAM_PF : KV__TR_STREAM;
        } else {
            buf = kv__mem_alloc_aligned(64, kv__stage_bytes(p->esz));
            mode = KV__TR_STAGED;
        }
        if (!buf)
            mode = KV__TR_DIRECT;
    }
    do {
        kv__transpose_any(d, drs, s, srs, p->shape[r], p->shape[c], p->esz, mode, buf);
    } while (kv__odometer_next(p, dims, nd, idx, &d, &s));
#if KV__COPY_X86
    if (mode == KV__TR_STREAM || mode == KV__TR_STREAM_PF)
        _mm_sfence(); /* order the streaming stores before later loads/stores */
#endif
    kv__mem_free(buf);
}

/* ---- 3: generic --------------------------------------------------------- */

static void kv__copy_generic(const struct kv__copy_plan *p)
{
    const int in = p->ndim - 1;
    int dims[KV_MAX_DIMS];
    int64_t idx[KV_MAX_DIMS] = {0};
    char *d = p->dst;
    const char *s = p->src;

    for (int k = 0; k < in; k++)
        dims[k] = k;
    do {
        kv__strided_line_any(d, p->ds[in], s, p->ss[in], p->shape[in], p->esz);
    } while (kv__odometer_next(p, dims, in, idx, &d, &s));
}

/* ---- engine ------------------------------------------------------------- */

/* Below this many elements on either side a transpose is not worth its tiles. */
#define KV__TRANSPOSE_MIN 4

void kv__view_copy_unchecked(const struct kv_view *src, const struct kv_view *dst)
{
    struct kv__copy_plan p;

    if (!kv__copy_plan_build(&p, src, dst))
        return;
    if (p.ndim == 0) {
        memcpy(p.dst, p.src, p.esz);
        return;
    }
    const int in = p.ndim - 1;
    const int64_t e = (int64_t)p.esz;
    if (p.ds[in] == e && p.ss[in] == e) {
        kv__copy_runs(&p);
        return;
    }
    if (p.shape[in] >= KV__TRANSPOSE_MIN) {
        /* dst contiguous along `in`, src contiguous along some j: src rows are
         * dim `in`, src columns (= dst rows) are dim j. */
        if (p.ds[in] == e) {
            for (int j = in - 1; j >= 0; j--) {
                if (p.ss[j] == e && p.shape[j] >= KV__TRANSPOSE_MIN) {
                    kv__copy_transpose(&p, in, j, p.ss[in], p.ds[j]);
                    return;
                }
            }
        }
        /* src contiguous along `in`, dst contiguous along some j: src rows are
         * dim j, src columns (= dst rows) are dim `in`. */
        if (p.ss[in] == e) {
            for (int j = in - 1; j >= 0; j--) {
                if (p.ds[j] == e && p.shape[j] >= KV__TRANSPOSE_MIN) {
                    kv__copy_transpose(&p, j, in, p.ss[j], p.ds[in]);
                    return;
                }
            }
        }
    }
    kv__copy_generic(&p);
}

/* ---- public entry points ------------------------------------------------ */

/* Work bound for the exact dst/src sharing test. */
#define KV__COPY_OVERLAP_WORK ((int64_t)1 << 22)

kv_status kv_view_materialize(const struct kv_view *src, void *dst, size_t dst_bytes)
{
    kv_status st;
    int64_t numel, need, lo, hi;
    size_t esz;

    if (!src)
        return kv__error(KV_ERR_NULL, "kv_view_materialize: src is NULL");
    st = kv_view_check(src);
    if (st != KV_OK)
        return st;
    numel = kv_view_numel(src);
    esz = kv_view_elem_bytes(src);
    if (!kv__mul_i64(numel, (int64_t)esz, &need))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_view_materialize: %lld elements * %zu bytes overflows",
                         (long long)numel, esz);
    if (!dst && need > 0)
        return kv__error(KV_ERR_NULL, "kv_view_materialize: dst is NULL (need %lld bytes)",
                         (long long)need);
    if ((uint64_t)need > (uint64_t)dst_bytes)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_view_materialize: dst_bytes %zu < %lld needed (%lld elements of "
                         "%zu bytes)",
                         dst_bytes, (long long)need, (long long)numel, esz);
    if (need > 0) {
        kv_view_extent_bytes(src, &lo, &hi);
        const uintptr_t s_lo = (uintptr_t)src->base + (uintptr_t)lo;
        const uintptr_t s_hi = (uintptr_t)src->base + (uintptr_t)hi;
        const uintptr_t d_lo = (uintptr_t)dst, d_hi = (uintptr_t)dst + (uintptr_t)need;
        if (d_lo < s_hi && s_lo < d_hi)
            return kv__error(KV_ERR_OVERLAP,
                             "kv_view_materialize: dst [%p, +%lld) overlaps src elements "
                             "[%p, +%lld)",
                             dst, (long long)need, (void *)s_lo, (long long)(hi - lo));

        struct kv_view d = {
            .dtype = src->dtype, .ndim = src->ndim, .base = dst, .storage_bytes = dst_bytes};
        int64_t stride = 1;
        for (int k = src->ndim - 1; k >= 0; k--) {
            d.shape[k] = src->shape[k];
            d.strides[k] = stride;
            stride *= src->shape[k];
        }
        kv__view_copy_unchecked(src, &d);
    }
    kv__copy_count(KV_COPY_MATERIALIZE, (uint64_t)need);
    return kv__ok();
}

kv_status kv__view_copy_check(const char *fn, const struct kv_view *src, const struct kv_view *dst)
{
    char a[256], b[256];
    kv_status st;
    bool overlap = false;

    if (!dst || !src)
        return kv__error(KV_ERR_NULL, "%s: src=%p dst=%p", fn, (const void *)src,
                         (const void *)dst);
    st = kv_view_check(src);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: src", fn);
    st = kv_view_check(dst);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: dst", fn);
    bool same = dst->ndim == src->ndim;
    for (int k = 0; same && k < dst->ndim; k++)
        same = dst->shape[k] == src->shape[k];
    if (!same)
        return kv__error(KV_ERR_BAD_SHAPE, "%s: src shape %s != dst shape %s", fn,
                         kv__fmt_list(a, sizeof(a), src->shape, src->ndim),
                         kv__fmt_list(b, sizeof(b), dst->shape, dst->ndim));
    if (dst->dtype != src->dtype)
        return kv__error(KV_ERR_INVALID_ARG, "%s: src dtype %s (%d) != dst dtype %s (%d)", fn,
                         kv_dtype_name(src->dtype), (int)src->dtype, kv_dtype_name(dst->dtype),
                         (int)dst->dtype);
    if (kv_view_numel(src) == 0)
        return KV_OK;
    st = kv_view_has_internal_overlap(dst, 0, &overlap);
    if (st == KV_ERR_TOO_COSTLY)
        return kv__error(KV_ERR_OVERLAP,
                         "%s: could not prove dst elements disjoint within the work bound (shape "
                         "%s strides %s)",
                         fn, kv__fmt_list(a, sizeof(a), dst->shape, dst->ndim),
                         kv__fmt_list(b, sizeof(b), dst->strides, dst->ndim));
    if (st != KV_OK)
        return st;
    if (overlap)
        return kv__error(KV_ERR_OVERLAP,
                         "%s: dst elements overlap each other (shape %s strides %s)", fn,
                         kv__fmt_list(a, sizeof(a), dst->shape, dst->ndim),
                         kv__fmt_list(b, sizeof(b), dst->strides, dst->ndim));

    /* may_share compares absolute byte extents, so views over different
     * base pointers into the same memory are caught as well. */
    if (kv_view_may_share(dst, src)) {
        bool shares = true;
        int64_t dlo, dhi, slo, shi;
        kv_view_extent_bytes(dst, &dlo, &dhi);
        kv_view_extent_bytes(src, &slo, &shi);
        st = kv_view_shares(dst, src, KV__COPY_OVERLAP_WORK, &shares);
        if (st == KV_ERR_TOO_COSTLY)
            return kv__error(KV_ERR_OVERLAP,
                             "%s: could not prove dst and src disjoint within %lld steps (dst "
                             "bytes [%lld,%lld) of %p, src bytes [%lld,%lld) of %p)",
                             fn, (long long)KV__COPY_OVERLAP_WORK, (long long)dlo, (long long)dhi,
                             dst->base, (long long)slo, (long long)shi, src->base);
        if (st != KV_OK)
            return st;
        if (shares)
            return kv__error(KV_ERR_OVERLAP,
                             "%s: dst and src share elements (dst bytes [%lld,%lld) of %p, src "
                             "bytes [%lld,%lld) of %p)",
                             fn, (long long)dlo, (long long)dhi, dst->base, (long long)slo,
                             (long long)shi, src->base);
    }
    return KV_OK;
}

kv_status kv_view_copy(const struct kv_view *src, const struct kv_view *dst)
{
    kv_status st = kv__view_copy_check("kv_view_copy", src, dst);
    if (st != KV_OK)
        return st;
    const int64_t numel = kv_view_numel(src);
    if (numel > 0)
        kv__view_copy_unchecked(src, dst);
    kv__copy_count(KV_COPY_VIEW_COPY, (uint64_t)numel * kv_view_elem_bytes(src));
    return kv__ok();
}
