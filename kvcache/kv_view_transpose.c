/*
 * kv_view_transpose.c - loop 3 of the CPU copy engine (kv_view_copy.c): a
 * cache-tiled 2-D transpose between the two dims where src and dst are each
 * contiguous, register-blocked, with staged and streaming variants for large
 * copies. Measured choices are in docs/benchmarks.md.
 */
#include <string.h>

#include "kv_mem.h"
#include "kv_view_copy_int.h"

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

/* True on AMD CPUs (kv__cpu_vendor). Selects KV__TR_STREAM_PF over
 * KV__TR_STREAM. */
static bool kv__cpu_is_amd(void)
{
    return kv__cpu_vendor() == KV__CPU_AMD;
}

/* Transposes moving less than this stay in cache: no staging buffer. */
#define KV__STAGE_MIN_BYTES ((int64_t)1 << 20)

/* Dims r (src row dim) and c (src stride-1 dim, dst row dim) are transposed;
 * every other dim is walked by the odometer. */
void kv__copy_transpose(const struct kv__copy_plan *p, int r, int c, int64_t srs, int64_t drs)
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
