/*
 * kv_view_copy.c - the copy engine behind every view copy, and the process-wide
 * copy counters. The tiled transpose (loop 3) is kv_view_transpose.c; what
 * the two share is kv_view_copy_int.h.
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
#include "kv_view_copy_int.h"

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
