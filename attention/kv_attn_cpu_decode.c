/*
 * kv_attn_cpu_decode.c - paged decode attention on the CPU (kv_attn.h),
 * validated by kv_attn_check.c like every kernel:
 *
 *   decode         (sequence, group of KV heads) tasks over threads (a group
 *                  of several heads where a token's head rows are adjacent,
 *                  NHD, so its whole row is read at once); per head the
 *                  g = Hq/H queries sharing it, chunks of 32 tokens: scores,
 *                  one rescale of the online softmax per chunk, then V.
 *                  Cache rows are read in place, converted in registers, the
 *                  scales folded into the score and the weight.
 */
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "kv_attn_int.h"
#include "kv_attn_x86_int.h"
#include "kv_convert_hd.h"
#include "kv_mem.h"

/* ---- decode attention ------------------------------------------------------------ */

bool kv__attn_avx2_only; /* kv_attn_int.h */
bool kv__attn_fp8_via_f16; /* kv_attn_int.h */

#define KV__CHUNK 32

/* Per-dtype row loads, inlined into the dot product and the V accumulation
 * (switches hoisted out of the inner loops by instantiating each). */
#define KV__LOAD_F32(p, i) (((const float *)(p))[i])
#define KV__LOAD_F16(p, i) kv_f16_to_f32(((const uint16_t *)(p))[i])
#define KV__LOAD_BF16(p, i) kv_bf16_to_f32(((const uint16_t *)(p))[i])
#define KV__LOAD_E4M3(p, i) kv_e4m3_to_f32(((const uint8_t *)(p))[i])
#define KV__LOAD_E5M2(p, i) kv_e5m2_to_f32(((const uint8_t *)(p))[i])

struct kv__dec_tok {
    const void *k, *v; /* rows of the KV head: D elements each */
};

/* What a chunk applies to its scores before the softmax (NULL: nothing):
 * the soft cap, then the mask of queries whose visible tokens [lo, hi]
 * (positions) do not cover the chunk's (kv_attn_opts). */
struct kv__dec_mod {
    float cap;              /* > 0: x -> cap * tanh(x / cap) */
    const int64_t *lo, *hi; /* [g]: query qi sees positions lo[qi] .. hi[qi]; NULL: all */
    int64_t pos0;           /* the position of the chunk's first token */
};

__attribute__((noinline, cold)) static void chunk_mod(const struct kv__dec_mod *mod, int n, int g,
                                                      float *sc)
{
    for (int qi = 0; qi < g; qi++) {
        float *sq = sc + qi * KV__CHUNK;
        if (mod->cap > 0.0f) {
            const float c = mod->cap, ic = 1.0f / mod->cap;
            for (int t = 0; t < n; t++)
                sq[t] = c * tanhf(sq[t] * ic);
        }
        if (mod->lo)
            for (int t = 0; t < n; t++)
                if (mod->pos0 + t < mod->lo[qi] || mod->pos0 + t > mod->hi[qi])
                    sq[t] = -INFINITY;
    }
}

#define KV__DEFINE_CHUNK(NAME, LOAD)                                                               \
    static void NAME(const struct kv__dec_tok *tok, int n, int g, int64_t D, const float *q,       \
                     float kmul, float vmul, float *m, float *l, float *acc, float *sc,            \
                     const struct kv__dec_mod *mod)                                                \
    {                                                                                              \
        for (int t = 0; t < n; t++) {                                                              \
            const void *kp = tok[t].k;                                                             \
            for (int qi = 0; qi < g; qi++) {                                                       \
                const float *qq = q + (int64_t)qi * D;                                             \
                float s = 0.0f;                                                                    \
                _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s +=          \
                    qq[d] * LOAD(kp, d);                                                           \
                sc[qi * KV__CHUNK + t] = s * kmul;                                                 \
            }                                                                                      \
        }                                                                                          \
        if (mod)                                                                                   \
            chunk_mod(mod, n, g, sc);                                                              \
        for (int qi = 0; qi < g; qi++) {                                                           \
            float *sq = sc + qi * KV__CHUNK, mx = m[qi];                                           \
            for (int t = 0; t < n; t++)                                                            \
                mx = sq[t] > mx ? sq[t] : mx;                                                      \
            if (mx == -INFINITY) { /* nothing visible yet: weights 0 */                            \
                for (int t = 0; t < n; t++)                                                        \
                    sq[t] = 0.0f;                                                                  \
                continue;                                                                          \
            }                                                                                      \
            const float corr = m[qi] == -INFINITY ? 0.0f : expf(m[qi] - mx);                       \
            float sum = 0.0f;                                                                      \
            for (int t = 0; t < n; t++) {                                                          \
                sq[t] = expf(sq[t] - mx);                                                          \
                sum += sq[t];                                                                      \
            }                                                                                      \
            l[qi] = l[qi] * corr + sum;                                                            \
            m[qi] = mx;                                                                            \
            float *a = acc + (int64_t)qi * D;                                                      \
            if (corr != 1.0f) {                                                                    \
                _Pragma("omp simd") for (int64_t d = 0; d < D; d++) a[d] *= corr;                  \
            }                                                                                      \
        }                                                                                          \
        for (int t = 0; t < n; t++) {                                                              \
            const void *vp = tok[t].v;                                                             \
            for (int qi = 0; qi < g; qi++) {                                                       \
                const float w = sc[qi * KV__CHUNK + t] * vmul;                                     \
                float *a = acc + (int64_t)qi * D;                                                  \
                _Pragma("omp simd") for (int64_t d = 0; d < D; d++) a[d] += w * LOAD(vp, d);       \
            }                                                                                      \
        }                                                                                          \
    }

KV__DEFINE_CHUNK(chunk_f32, KV__LOAD_F32)
KV__DEFINE_CHUNK(chunk_f16, KV__LOAD_F16)
KV__DEFINE_CHUNK(chunk_bf16, KV__LOAD_BF16)
KV__DEFINE_CHUNK(chunk_e4m3, KV__LOAD_E4M3)
KV__DEFINE_CHUNK(chunk_e5m2, KV__LOAD_E5M2)

typedef void (*kv__chunk_fn)(const struct kv__dec_tok *, int, int, int64_t, const float *, float,
                             float, float *, float *, float *, float *, const struct kv__dec_mod *);

/* ---- the AVX2/FMA chunk (x86-64, chosen at run time) ------------------------------
 * The same computation as KV__DEFINE_CHUNK for every cache dtype and D a
 * multiple of 8, written for 8-lane registers (KV__DEFINE_CHUNK_AVX2 below).
 * The online softmax is the portable one. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define KV__HAVE_AVX2 1

KV__AVX2 static inline __m256 ld8_f32(const void *p)
{
    return _mm256_loadu_ps((const float *)p);
}
KV__AVX2 static inline __m256 ld8_f16(const void *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
KV__AVX2 static inline __m256 ld8_bf16(const void *p)
{
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
/* fp8 rows to f16, 16 elements per step: each byte goes to the high byte
 * of a 16-bit lane (x = b << 8), where e5m2 already is an f16 (inf and NaN
 * included): exactly kv_e5m2_to_f32. For e4m3 an arithmetic shift right by
 * one and the mask 0xbf80 leave the sign at bit 15 and the magnitude bits at
 * 7..13: the f16 of the value times 2^-8 (bias 7 against 15, subnormals
 * included, exact); its one NaN pattern (S.1111.111, OCP e4m3fn has no inf)
 * gets the f16 exponent 31. An e4m3 row is therefore stored as its values
 * times 2^-8: the decode folds the 2^8 into its K and V multipliers (a power
 * of two, so the products are the same). Decode converts each head's rows of
 * a chunk once (fp8_rows_to_f16) and runs the f16 chunk over them: half the
 * bytes read from memory, one cvtph per 8 elements in the inner loops. */
KV__AVX2 static inline __m256i fp8_to_f16_16(kv_dtype dt, __m256i x)
{
    if (dt == KV_FP8_E5M2)
        return x;
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f00)),
                                           _mm256_set1_epi16(0x7f00));
    const __m256i h = _mm256_and_si256(_mm256_srai_epi16(x, 1), _mm256_set1_epi16((short)0xbf80));
    return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
}
KV__AVX2 static void fp8_row_to_f16(kv_dtype dt, uint16_t *dst, const uint8_t *src, int64_t D)
{
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        const __m256i x =
            _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + d))), 8);
        _mm256_storeu_si256((__m256i *)(dst + d), fp8_to_f16_16(dt, x));
    }
    if (d < D) { /* D % 8 == 0: one group of 8 left */
        const __m256i x =
            _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + d))), 8);
        _mm_storeu_si128((__m128i *)(dst + d), _mm256_castsi256_si128(fp8_to_f16_16(dt, x)));
    }
}
/* fp8_row_to_f16 without the e4m3 NaN fix, 16 elements a step from a sign
 * extension (x << 7 puts the magnitude bits at 7..13 and the sign at 14-15;
 * the mask 0xbf80 clears bit 14): true when the row holds an e4m3 NaN
 * pattern (|b| == 0x7f, which this gives as the finite 480 * 2^-8), and the
 * caller converts that row again with fp8_row_to_f16. e5m2 is exact here. */
KV__AVX2 static bool fp8_row_to_f16_fast(kv_dtype dt, uint16_t *dst, const uint8_t *src, int64_t D)
{
    const __m128i sign = _mm_set1_epi8((char)0x80);
    __m128i mx = _mm_setzero_si128();
    int64_t d = 0;
    if (dt == KV_FP8_E5M2) {
        for (; d + 16 <= D; d += 16) {
            const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + d)));
            _mm256_storeu_si256((__m256i *)(dst + d), _mm256_slli_epi16(x, 8));
        }
        if (d < D) {
            const __m256i x = _mm256_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(src + d)));
            _mm_storeu_si128((__m128i *)(dst + d), _mm256_castsi256_si128(_mm256_slli_epi16(x, 8)));
        }
        return false;
    }
    const __m256i keep = _mm256_set1_epi16((short)0xbf80);
    for (; d + 16 <= D; d += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + d));
        mx = _mm_max_epu8(mx, _mm_or_si128(b, sign));
        const __m256i x = _mm256_cvtepi8_epi16(b);
        _mm256_storeu_si256((__m256i *)(dst + d), _mm256_and_si256(_mm256_slli_epi16(x, 7), keep));
    }
    if (d < D) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(src + d));
        mx = _mm_max_epu8(mx, _mm_or_si128(b, sign));
        const __m256i x = _mm256_cvtepi8_epi16(b);
        _mm_storeu_si128((__m128i *)(dst + d),
                         _mm256_castsi256_si128(_mm256_and_si256(_mm256_slli_epi16(x, 7), keep)));
    }
    return _mm_movemask_epi8(_mm_cmpeq_epi8(mx, _mm_set1_epi8((char)0xff))) != 0;
}
/* fp8_row_to_f16_fast over n rows: row i from src + i * sstep (bytes) to
 * dst + i * dstep (elements); true when a row holds an e4m3 NaN pattern. */
KV__AVX2 static bool fp8_rows_to_f16_avx2(kv_dtype dt, uint16_t *dst, int64_t dstep,
                                          const uint8_t *src, int64_t sstep, int64_t n, int64_t D)
{
    bool nan = false;
    for (int64_t i = 0; i < n; i++)
        nan |= fp8_row_to_f16_fast(dt, dst + i * dstep, src + i * sstep, D);
    return nan;
}

/* The same with AVX-512BW, 32 elements a step (a sign extension to 16-bit
 * lanes, a shift and a mask: half the instructions of the 16-element step),
 * a row's last D % 32 elements through masked loads and stores. The NaN
 * test is the byte-wise max of b | 0x80 over every row, as above. */
#define KV__AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
KV__AVX512 static bool fp8_rows_to_f16_avx512(kv_dtype dt, uint16_t *dst, int64_t dstep,
                                              const uint8_t *src, int64_t sstep, int64_t n,
                                              int64_t D)
{
    const int64_t D32 = D - D % 32;
    const __mmask32 tail = (__mmask32)((1ull << (D % 32)) - 1);
    if (dt == KV_FP8_E5M2) { /* the byte is the f16's high byte: exact, no NaN fix */
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *s = src + i * sstep;
            uint16_t *o = dst + i * dstep;
            for (int64_t d = 0; d < D32; d += 32) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(s + d));
                _mm512_storeu_si512(o + d, _mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 8));
            }
            if (tail) {
                const __m256i b = _mm256_maskz_loadu_epi8(tail, s + D32);
                _mm512_mask_storeu_epi16(o + D32, tail,
                                         _mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 8));
            }
        }
        return false;
    }
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    const __m512i keep = _mm512_set1_epi16((short)0xbf80);
    __m256i mx = _mm256_setzero_si256(); /* masked-out bytes load as 0: 0x80 here */
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = src + i * sstep;
        uint16_t *o = dst + i * dstep;
        for (int64_t d = 0; d < D32; d += 32) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(s + d));
            mx = _mm256_max_epu8(mx, _mm256_or_si256(b, sign));
            const __m512i x = _mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7);
            _mm512_storeu_si512(o + d, _mm512_and_si512(x, keep));
        }
        if (tail) {
            const __m256i b = _mm256_maskz_loadu_epi8(tail, s + D32);
            mx = _mm256_max_epu8(mx, _mm256_or_si256(b, sign));
            const __m512i x = _mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7);
            _mm512_mask_storeu_epi16(o + D32, tail, _mm512_and_si512(x, keep));
        }
    }
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(mx, _mm256_set1_epi8((char)0xff))) != 0;
}

static bool cpu_has_avx512bw(void)
{
    static int has = -1; /* benign race: every thread computes the same value */
    if (has < 0) {
        __builtin_cpu_init(); /* libgcc checks the OS saves the AVX-512 state (XCR0) */
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl");
    }
    return has == 1;
}

/* The decode's fp8 row conversion (the AVX2 path's callers only): n rows in
 * one call, AVX-512BW where the CPU has it (and kv__attn_avx2_only is not
 * set), else AVX2. Measured (docs/benchmarks.md, 2026-12-04 17:50-18:45,
 * CPU time on one AMD EPYC core): fp8 decode HND +15%, NHD +5%; with two
 * threads on a loaded machine no change beyond the noise. */
static bool fp8_rows_to_f16_fast(kv_dtype dt, uint16_t *dst, int64_t dstep, const uint8_t *src,
                                 int64_t sstep, int64_t n, int64_t D)
{
    if (!kv__attn_avx2_only && cpu_has_avx512bw())
        return fp8_rows_to_f16_avx512(dt, dst, dstep, src, sstep, n, D);
    return fp8_rows_to_f16_avx2(dt, dst, dstep, src, sstep, n, D);
}

/* fp8_rows_to_f16_fast (dstep in bytes), or for the bf16 dot-product
 * chunks on a CPU with AVX512_VBMI (cbf) to bf16: exact, NaN included, so
 * never true (kv__fp8_rows_to_bf16) */
static bool fp8_rows_convert(bool cbf, kv_dtype dt, char *dst, int64_t dstep, const uint8_t *src,
                             int64_t sstep, int64_t n, int64_t D)
{
    if (!cbf)
        return fp8_rows_to_f16_fast(dt, (uint16_t *)(void *)dst, dstep / 2, src, sstep, n, D);
    kv__fp8_rows_to_bf16(dt == KV_FP8_E5M2, (uint16_t *)(void *)dst, dstep / 2, src, sstep, n, D);
    return false;
}

/* The same conversion 8 elements at a time inside the chunk's loops, for
 * rows read in place (NHD, where a head group's q and acc already fill L1
 * and converted rows would not fit beside them): ld8_e4m3_raw is the value
 * times 2^-8 like a converted row. */
KV__AVX2 static inline __m128i ld8_fp8_hi(const void *p)
{
    return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
}
KV__AVX2 static inline __m256 ld8_e5m2(const void *p)
{
    return _mm256_cvtph_ps(ld8_fp8_hi(p));
}
KV__AVX2 static inline __m256 ld8_e4m3_raw(const void *p)
{
    const __m128i x = ld8_fp8_hi(p);
    const __m128i nan =
        _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f00)), _mm_set1_epi16(0x7f00));
    const __m128i h = _mm_and_si128(_mm_srai_epi16(x, 1), _mm_set1_epi16((short)0xbf80));
    return _mm256_cvtph_ps(_mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7c00))));
}
/* softmax bookkeeping of one chunk (scores sc[qi][t] in place -> weights
 * times vmul; acc rescaled), shared by the AVX2 chunks */
KV__AVX2 static void chunk_softmax(int n, int g, int64_t D, float vmul, float *m, float *l,
                                   float *acc, float *sc)
{
    for (int qi = 0; qi < g; qi++) {
        float *sq = sc + qi * KV__CHUNK, mx = m[qi];
        if (n == KV__CHUNK) { /* a whole chunk: the max 8 lanes at a time */
            __m256 x =
                _mm256_max_ps(_mm256_max_ps(_mm256_loadu_ps(sq), _mm256_loadu_ps(sq + 8)),
                              _mm256_max_ps(_mm256_loadu_ps(sq + 16), _mm256_loadu_ps(sq + 24)));
            const float cm = hmax8(x);
            mx = cm > mx ? cm : mx;
        } else {
            for (int t = 0; t < n; t++)
                mx = sq[t] > mx ? sq[t] : mx;
        }
        if (mx == -INFINITY) { /* nothing visible yet (a mask): weights 0 */
            memset(sq, 0, (size_t)n * sizeof(float));
            continue;
        }
        const float corr = m[qi] == -INFINITY ? 0.0f : expf(m[qi] - mx);
        float sum = 0.0f;
        int t = 0;
        if (n == KV__CHUNK) {
            const __m256 mx8 = _mm256_set1_ps(mx), vm8 = _mm256_set1_ps(vmul);
            __m256 s8 = _mm256_setzero_ps();
            for (; t < KV__CHUNK; t += 8) {
                const __m256 e8 = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sq + t), mx8));
                s8 = _mm256_add_ps(s8, e8);
                _mm256_storeu_ps(sq + t, _mm256_mul_ps(e8, vm8));
            }
            sum = hsum8(s8);
        }
        for (; t < n; t++) {
            sq[t] = expf(sq[t] - mx);
            sum += sq[t];
            sq[t] *= vmul;
        }
        l[qi] = l[qi] * corr + sum;
        m[qi] = mx;
        if (corr != 1.0f)
            scale8(acc + (int64_t)qi * D, D, corr);
    }
}

/* The AVX2 chunk: scores 4 queries x 2 tokens at a time (8 accumulators: per
 * 8 elements two row loads and four query loads feed 8 FMAs, the 8 sums
 * reduced by hadd), V 4 queries x 16 elements at a time with the
 * accumulators in registers across the chunk's tokens (two row loads and
 * four weight broadcasts feed 8 FMAs; before 2026-12-04 4 x 8, one load per
 * FMA). The rows come from tok: the cache in place, a per-thread copy, or
 * f16 rows converted from fp8. */
/* The values half of the AVX2 chunk: acc[q] += the chunk's weights sc[q]
 * times its V rows (after the softmax). */
#define KV__DEFINE_VALUES_AVX2(NAME, LD8, ES)                                                      \
    KV__AVX2 static inline void NAME##_values(const struct kv__dec_tok *tok, int n, int g,         \
                                              int64_t D, float *acc, const float *sc)              \
    {                                                                                              \
        int q0;                                                                                    \
        for (q0 = 0; q0 + 4 <= g; q0 += 4) {                                                       \
            float *ac = acc + (int64_t)q0 * D;                                                     \
            const float *w = sc + q0 * KV__CHUNK;                                                  \
            int64_t d = 0;                                                                         \
            for (; d + 16 <= D; d += 16) {                                                         \
                __m256 a00 = _mm256_loadu_ps(ac + d), a01 = _mm256_loadu_ps(ac + d + 8);           \
                __m256 a10 = _mm256_loadu_ps(ac + D + d), a11 = _mm256_loadu_ps(ac + D + d + 8);   \
                __m256 a20 = _mm256_loadu_ps(ac + 2 * D + d);                                      \
                __m256 a21 = _mm256_loadu_ps(ac + 2 * D + d + 8);                                  \
                __m256 a30 = _mm256_loadu_ps(ac + 3 * D + d);                                      \
                __m256 a31 = _mm256_loadu_ps(ac + 3 * D + d + 8);                                  \
                for (int t = 0; t < n; t++) {                                                      \
                    const char *vr = (const char *)tok[t].v + d * (ES);                            \
                    const __m256 v0 = LD8(vr), v1 = LD8(vr + 8 * (ES));                            \
                    __m256 b = _mm256_broadcast_ss(w + t);                                         \
                    a00 = _mm256_fmadd_ps(b, v0, a00);                                             \
                    a01 = _mm256_fmadd_ps(b, v1, a01);                                             \
                    b = _mm256_broadcast_ss(w + KV__CHUNK + t);                                    \
                    a10 = _mm256_fmadd_ps(b, v0, a10);                                             \
                    a11 = _mm256_fmadd_ps(b, v1, a11);                                             \
                    b = _mm256_broadcast_ss(w + 2 * KV__CHUNK + t);                                \
                    a20 = _mm256_fmadd_ps(b, v0, a20);                                             \
                    a21 = _mm256_fmadd_ps(b, v1, a21);                                             \
                    b = _mm256_broadcast_ss(w + 3 * KV__CHUNK + t);                                \
                    a30 = _mm256_fmadd_ps(b, v0, a30);                                             \
                    a31 = _mm256_fmadd_ps(b, v1, a31);                                             \
                }                                                                                  \
                _mm256_storeu_ps(ac + d, a00);                                                     \
                _mm256_storeu_ps(ac + d + 8, a01);                                                 \
                _mm256_storeu_ps(ac + D + d, a10);                                                 \
                _mm256_storeu_ps(ac + D + d + 8, a11);                                             \
                _mm256_storeu_ps(ac + 2 * D + d, a20);                                             \
                _mm256_storeu_ps(ac + 2 * D + d + 8, a21);                                         \
                _mm256_storeu_ps(ac + 3 * D + d, a30);                                             \
                _mm256_storeu_ps(ac + 3 * D + d + 8, a31);                                         \
            }                                                                                      \
            for (; d < D; d += 8) {                                                                \
                __m256 a0 = _mm256_loadu_ps(ac + d), a1 = _mm256_loadu_ps(ac + D + d);             \
                __m256 a2 = _mm256_loadu_ps(ac + 2 * D + d);                                       \
                __m256 a3 = _mm256_loadu_ps(ac + 3 * D + d);                                       \
                for (int t = 0; t < n; t++) {                                                      \
                    const __m256 v0 = LD8((const char *)tok[t].v + d * (ES));                      \
                    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + t), v0, a0);                      \
                    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + KV__CHUNK + t), v0, a1);          \
                    a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 2 * KV__CHUNK + t), v0, a2);      \
                    a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 3 * KV__CHUNK + t), v0, a3);      \
                }                                                                                  \
                _mm256_storeu_ps(ac + d, a0);                                                      \
                _mm256_storeu_ps(ac + D + d, a1);                                                  \
                _mm256_storeu_ps(ac + 2 * D + d, a2);                                              \
                _mm256_storeu_ps(ac + 3 * D + d, a3);                                              \
            }                                                                                      \
        }                                                                                          \
        for (; q0 < g; q0++) {                                                                     \
            float *ac = acc + (int64_t)q0 * D;                                                     \
            const float *w = sc + q0 * KV__CHUNK;                                                  \
            for (int64_t d = 0; d < D; d += 8) {                                                   \
                __m256 a0 = _mm256_loadu_ps(ac + d);                                               \
                for (int t = 0; t < n; t++)                                                        \
                    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + t),                               \
                                         LD8((const char *)tok[t].v + d * (ES)), a0);              \
                _mm256_storeu_ps(ac + d, a0);                                                      \
            }                                                                                      \
        }                                                                                          \
    }

#define KV__DEFINE_CHUNK_AVX2(NAME, LD8, ES)                                                       \
    KV__AVX2 static void NAME(const struct kv__dec_tok *tok, int n, int g, int64_t D,              \
                              const float *q, float kmul, float vmul, float *m, float *l,          \
                              float *acc, float *sc, const struct kv__dec_mod *mod)                \
    {                                                                                              \
        const __m128 km = _mm_set1_ps(kmul);                                                       \
        float r[4];                                                                                \
        int q0 = 0;                                                                                \
        for (; q0 + 4 <= g; q0 += 4) {                                                             \
            const float *qa = q + (int64_t)q0 * D;                                                 \
            int t = 0;                                                                             \
            for (; t + 2 <= n; t += 2) {                                                           \
                const char *k0 = (const char *)tok[t].k, *k1 = (const char *)tok[t + 1].k;         \
                __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00,      \
                       a21 = a00, a30 = a00, a31 = a00;                                            \
                for (int64_t d = 0; d < D; d += 8) {                                               \
                    const __m256 x0 = LD8(k0 + d * (ES)), x1 = LD8(k1 + d * (ES));                 \
                    __m256 y = _mm256_loadu_ps(qa + d);                                            \
                    a00 = _mm256_fmadd_ps(y, x0, a00);                                             \
                    a01 = _mm256_fmadd_ps(y, x1, a01);                                             \
                    y = _mm256_loadu_ps(qa + D + d);                                               \
                    a10 = _mm256_fmadd_ps(y, x0, a10);                                             \
                    a11 = _mm256_fmadd_ps(y, x1, a11);                                             \
                    y = _mm256_loadu_ps(qa + 2 * D + d);                                           \
                    a20 = _mm256_fmadd_ps(y, x0, a20);                                             \
                    a21 = _mm256_fmadd_ps(y, x1, a21);                                             \
                    y = _mm256_loadu_ps(qa + 3 * D + d);                                           \
                    a30 = _mm256_fmadd_ps(y, x0, a30);                                             \
                    a31 = _mm256_fmadd_ps(y, x1, a31);                                             \
                }                                                                                  \
                _mm_storeu_ps(r, _mm_mul_ps(hsum4x8(a00, a10, a20, a30), km));                     \
                for (int i = 0; i < 4; i++)                                                        \
                    sc[(q0 + i) * KV__CHUNK + t] = r[i];                                           \
                _mm_storeu_ps(r, _mm_mul_ps(hsum4x8(a01, a11, a21, a31), km));                     \
                for (int i = 0; i < 4; i++)                                                        \
                    sc[(q0 + i) * KV__CHUNK + t + 1] = r[i];                                       \
            }                                                                                      \
            for (; t < n; t++) {                                                                   \
                const char *k0 = (const char *)tok[t].k;                                           \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                        \
                for (int64_t d = 0; d < D; d += 8) {                                               \
                    const __m256 x0 = LD8(k0 + d * (ES));                                          \
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), x0, a0);                         \
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + D + d), x0, a1);                     \
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 2 * D + d), x0, a2);                 \
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 3 * D + d), x0, a3);                 \
                }                                                                                  \
                _mm_storeu_ps(r, _mm_mul_ps(hsum4x8(a0, a1, a2, a3), km));                         \
                for (int i = 0; i < 4; i++)                                                        \
                    sc[(q0 + i) * KV__CHUNK + t] = r[i];                                           \
            }                                                                                      \
        }                                                                                          \
        for (; q0 < g; q0++) {                                                                     \
            const float *qa = q + (int64_t)q0 * D;                                                 \
            for (int t = 0; t < n; t++) {                                                          \
                const char *k0 = (const char *)tok[t].k;                                           \
                __m256 a0 = _mm256_setzero_ps();                                                   \
                for (int64_t d = 0; d < D; d += 8)                                                 \
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), LD8(k0 + d * (ES)), a0);         \
                sc[q0 * KV__CHUNK + t] = hsum8(a0) * kmul;                                         \
            }                                                                                      \
        }                                                                                          \
        if (mod)                                                                                   \
            chunk_mod(mod, n, g, sc);                                                              \
        chunk_softmax(n, g, D, vmul, m, l, acc, sc);                                               \
        NAME##_values(tok, n, g, D, acc, sc);                                                      \
    }

KV__DEFINE_VALUES_AVX2(chunk_avx2_f32, ld8_f32, 4)
KV__DEFINE_VALUES_AVX2(chunk_avx2_f16, ld8_f16, 2)
KV__DEFINE_VALUES_AVX2(chunk_avx2_bf16, ld8_bf16, 2)
KV__DEFINE_VALUES_AVX2(chunk_avx2_e4m3_raw, ld8_e4m3_raw, 1)
KV__DEFINE_VALUES_AVX2(chunk_avx2_e5m2, ld8_e5m2, 1)
KV__DEFINE_CHUNK_AVX2(chunk_avx2_f32, ld8_f32, 4)
KV__DEFINE_CHUNK_AVX2(chunk_avx2_f16, ld8_f16, 2)
KV__DEFINE_CHUNK_AVX2(chunk_avx2_bf16, ld8_bf16, 2)
KV__DEFINE_CHUNK_AVX2(chunk_avx2_e4m3_raw, ld8_e4m3_raw, 1)
KV__DEFINE_CHUNK_AVX2(chunk_avx2_e5m2, ld8_e5m2, 1)

/* chunk_avx2_bf16_values 16 lanes wide (D % 32 == 0), for the dot-product
 * chunk: the same sums in the same order (lane by lane, token after
 * token), so the same bits, in half the instructions; 4 queries x 64 dims
 * a block (16 accumulators: a row's 4 vectors widened once for 16 FMAs,
 * one broadcast a query; fp8 HND +5% against 4 x 32), then 32 dims. */
KV__BF16DOT static inline __m512 ld16_bf16_z(const char *p)
{
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#define KV__ZV_FMA2(R)                                                                             \
    b = _mm512_set1_ps(w[(R)*KV__CHUNK + t]);                                                      \
    a##R##0 = _mm512_fmadd_ps(b, v0, a##R##0);                                                     \
    a##R##1 = _mm512_fmadd_ps(b, v1, a##R##1)
#define KV__ZF_FMA4(R)                                                                             \
    b = _mm512_set1_ps(w[(R)*KV__CHUNK + t]);                                                      \
    a##R##0 = _mm512_fmadd_ps(b, v0, a##R##0);                                                     \
    a##R##1 = _mm512_fmadd_ps(b, v1, a##R##1);                                                     \
    a##R##2 = _mm512_fmadd_ps(b, v2, a##R##2);                                                     \
    a##R##3 = _mm512_fmadd_ps(b, v3, a##R##3)
#define KV__ZF_LD4(R, c)                                                                           \
    __m512 a##R##0 = _mm512_loadu_ps(c), a##R##1 = _mm512_loadu_ps((c) + 16),                      \
           a##R##2 = _mm512_loadu_ps((c) + 32), a##R##3 = _mm512_loadu_ps((c) + 48)
#define KV__ZF_ST4(R, c)                                                                           \
    _mm512_storeu_ps(c, a##R##0), _mm512_storeu_ps((c) + 16, a##R##1),                             \
        _mm512_storeu_ps((c) + 32, a##R##2), _mm512_storeu_ps((c) + 48, a##R##3)
/* One block of queries q0..q0 + 3 x dims d..d + 63 over the chunk's n rows
 * (acc, q0, d, w, n, tok in scope): the statement given sets v0..v3, row
 * t's 64 dims as f32. */
#define KV__ZF_BLOCK4(...)                                                                         \
    do {                                                                                           \
        float *c0 = acc + (int64_t)q0 * D + d, *c1 = c0 + D, *c2 = c1 + D, *c3 = c2 + D;           \
        KV__ZF_LD4(0, c0);                                                                         \
        KV__ZF_LD4(1, c1);                                                                         \
        KV__ZF_LD4(2, c2);                                                                         \
        KV__ZF_LD4(3, c3);                                                                         \
        for (int t = 0; t < n; t++) {                                                              \
            __m512 v0, v1, v2, v3, b;                                                              \
            __VA_ARGS__                                                                            \
            KV__ZF_FMA4(0);                                                                        \
            KV__ZF_FMA4(1);                                                                        \
            KV__ZF_FMA4(2);                                                                        \
            KV__ZF_FMA4(3);                                                                        \
        }                                                                                          \
        KV__ZF_ST4(0, c0);                                                                         \
        KV__ZF_ST4(1, c1);                                                                         \
        KV__ZF_ST4(2, c2);                                                                         \
        KV__ZF_ST4(3, c3);                                                                         \
    } while (0)
KV__BF16DOT static void values_bf16_z(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                      float *acc, const float *sc)
{
    int q0 = 0;
    for (; q0 + 4 <= g; q0 += 4) {
        const float *w = sc + q0 * KV__CHUNK;
        int64_t d = 0;
        for (; d + 64 <= D; d += 64) /* 4 queries x 64 dims: 16 FMAs a row's 4 vectors */
            KV__ZF_BLOCK4({
                const char *vr = (const char *)tok[t].v + d * 2;
                v0 = ld16_bf16_z(vr), v1 = ld16_bf16_z(vr + 32);
                v2 = ld16_bf16_z(vr + 64), v3 = ld16_bf16_z(vr + 96);
            });
        for (; d < D; d += 32) {
            float *c0 = acc + (int64_t)q0 * D + d, *c1 = c0 + D, *c2 = c1 + D, *c3 = c2 + D;
            __m512 a00 = _mm512_loadu_ps(c0), a01 = _mm512_loadu_ps(c0 + 16);
            __m512 a10 = _mm512_loadu_ps(c1), a11 = _mm512_loadu_ps(c1 + 16);
            __m512 a20 = _mm512_loadu_ps(c2), a21 = _mm512_loadu_ps(c2 + 16);
            __m512 a30 = _mm512_loadu_ps(c3), a31 = _mm512_loadu_ps(c3 + 16);
            for (int t = 0; t < n; t++) {
                const char *vr = (const char *)tok[t].v + d * 2;
                const __m512 v0 = ld16_bf16_z(vr), v1 = ld16_bf16_z(vr + 32);
                __m512 b;
                KV__ZV_FMA2(0);
                KV__ZV_FMA2(1);
                KV__ZV_FMA2(2);
                KV__ZV_FMA2(3);
            }
            _mm512_storeu_ps(c0, a00), _mm512_storeu_ps(c0 + 16, a01);
            _mm512_storeu_ps(c1, a10), _mm512_storeu_ps(c1 + 16, a11);
            _mm512_storeu_ps(c2, a20), _mm512_storeu_ps(c2 + 16, a21);
            _mm512_storeu_ps(c3, a30), _mm512_storeu_ps(c3 + 16, a31);
        }
    }
    for (; q0 < g; q0++) { /* one query: 32 dims a step */
        const float *w = sc + q0 * KV__CHUNK;
        for (int64_t d = 0; d < D; d += 32) {
            float *c0 = acc + (int64_t)q0 * D + d;
            __m512 a00 = _mm512_loadu_ps(c0), a01 = _mm512_loadu_ps(c0 + 16);
            for (int t = 0; t < n; t++) {
                const char *vr = (const char *)tok[t].v + d * 2;
                const __m512 v0 = ld16_bf16_z(vr), v1 = ld16_bf16_z(vr + 32);
                __m512 b;
                KV__ZV_FMA2(0);
            }
            _mm512_storeu_ps(c0, a00), _mm512_storeu_ps(c0 + 16, a01);
        }
    }
}

/* A dot-product chunk's scores (tok's K rows bf16), the mask and cap, and
 * the online softmax: what every such chunk does before its values. */
KV__BF16DOT static inline void bdot_softmax(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                            const uint16_t *qb, float kmul, float vmul, float *m,
                                            float *l, float *acc, float *sc,
                                            const struct kv__dec_mod *mod)
{
    const uint16_t *kb[KV__CHUNK];
    for (int t = 0; t < n; t++)
        kb[t] = (const uint16_t *)tok[t].k;
    kv__scores_bf16dot(kb, n, g, D, qb, kmul, sc, KV__CHUNK);
    if (mod)
        chunk_mod(mod, n, g, sc);
    chunk_softmax(n, g, D, vmul, m, l, acc, sc);
}

/* The one-query chunk over bf16 rows (the cache's in place, or the head
 * group's copy) with the scores as bf16 dot products (kv__scores_bf16dot,
 * kv_attn_x86_int.h): qb [g][D] is q's bf16, unscaled; kmul carries
 * softmax_scale. The softmax is chunk_avx2_bf16's, the values are its
 * values 16 lanes wide (values_bf16_z: same bits). Measured
 * (docs/benchmarks.md, q bf16, AMD Zen 4): bf16 HND decode 3.98-4.06 ->
 * 4.36-4.49 M tokens/s (the scores), -> 4.82-5.03 M (the values); NHD
 * 2.75-2.77 -> 2.88-2.98 M. */
KV__BF16DOT static void chunk_bf16_bdot(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                        const uint16_t *qb, float kmul, float vmul, float *m,
                                        float *l, float *acc, float *sc,
                                        const struct kv__dec_mod *mod)
{
    bdot_softmax(tok, n, g, D, qb, kmul, vmul, m, l, acc, sc, mod);
    values_bf16_z(tok, n, g, D, acc, sc);
}

/* The same over fp8 rows converted to f16 (decode_group's buffer: e4m3 as
 * its value times 2^-8), the K rows rounded to bf16 in place first (exact:
 * fp8 values fit in bf16 whatever the fold); the softmax and the values
 * are chunk_avx2_f16's. fp8 HND decode 5.1-5.4 -> 5.65-5.74 M tokens/s,
 * NHD +2-5%. Where the CPU has AVX512_VBMI the fp8 rows are converted to
 * bf16 directly instead (fp8_rows_convert) and chunk_bf16_bdot runs over
 * them: fp8 HND 5.6-5.7 -> 6.1-6.3 M, NHD 4.7-4.9 -> 5.1 M. */
KV__BF16DOT static void chunk_f16_bdot(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                       const uint16_t *qb, float kmul, float vmul, float *m,
                                       float *l, float *acc, float *sc,
                                       const struct kv__dec_mod *mod)
{
    for (int t = 0; t < n; t++) {
        /* decode_group's own buffer (the const is the chunks' interface) */
        uint16_t *r = (uint16_t *)(uintptr_t)tok[t].k;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + d)));
            const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + d + 16)));
            _mm512_storeu_si512((void *)(r + d), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
    bdot_softmax(tok, n, g, D, qb, kmul, vmul, m, l, acc, sc, mod);
    chunk_avx2_f16_values(tok, n, g, D, acc, sc);
}

/* The values over fp8 V rows read in place (one head a task, HND: each row
 * converted to f32 in registers where it is used, kv__fp8f32, instead of a
 * conversion pass into the buffer): 4 queries x 64 dims a block as
 * values_bf16_z, a row's 64 bytes converted once for 16 FMAs; other
 * blocks (one query, a 32-dim tail) convert a row for each query. The same
 * f32 values and sums in the same order as values_bf16_z over the rows'
 * bf16: the same bits. */
#define KV__FP8DOT                                                                                 \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))
KV__FP8DOT static void values_fp8_z(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                    float *acc, const float *sc, bool e5m2)
{
    struct kv__fp8f32 c;
    kv__fp8f32_init(&c, e5m2);
    for (int q0 = 0; q0 < g;) {
        const int nq = g - q0 >= 4 ? 4 : 1;
        const float *w = sc + q0 * KV__CHUNK;
        int64_t d = 0;
        for (; nq == 4 && d + 64 <= D; d += 64)
            KV__ZF_BLOCK4({
                const __m512i x = _mm512_loadu_si512((const char *)tok[t].v + d);
                KV__FP8F32_4(&c, x, v0, v1, v2, v3);
            });
        for (int qi = 0; qi < nq; qi++) /* what is left: 32 or 64 dims of one query */
            for (int64_t e = d; e < D; e += 64) {
                const bool half = D - e == 32;
                const __mmask64 lm = half ? 0xffffffffull : ~0ull;
                float *c0 = acc + (int64_t)(q0 + qi) * D + e;
                const float *wq = w + qi * KV__CHUNK;
                __m512 a0 = _mm512_loadu_ps(c0), a1 = _mm512_loadu_ps(c0 + 16);
                __m512 a2 = half ? _mm512_setzero_ps() : _mm512_loadu_ps(c0 + 32);
                __m512 a3 = half ? _mm512_setzero_ps() : _mm512_loadu_ps(c0 + 48);
                for (int t = 0; t < n; t++) {
                    const __m512i x = _mm512_maskz_loadu_epi8(lm, (const char *)tok[t].v + e);
                    __m512 v0, v1, v2, v3;
                    KV__FP8F32_4(&c, x, v0, v1, v2, v3);
                    const __m512 b = _mm512_set1_ps(wq[t]);
                    a0 = _mm512_fmadd_ps(b, v0, a0);
                    a1 = _mm512_fmadd_ps(b, v1, a1);
                    a2 = _mm512_fmadd_ps(b, v2, a2);
                    a3 = _mm512_fmadd_ps(b, v3, a3);
                }
                _mm512_storeu_ps(c0, a0), _mm512_storeu_ps(c0 + 16, a1);
                if (!half)
                    _mm512_storeu_ps(c0 + 32, a2), _mm512_storeu_ps(c0 + 48, a3);
            }
        q0 += nq;
    }
}

/* chunk_bf16_bdot with the V rows fp8 in place (values_fp8_z); K rows bf16
 * (converted into the buffer). */
KV__FP8DOT static void chunk_fp8v_bdot(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                       const uint16_t *qb, float kmul, float vmul, float *m,
                                       float *l, float *acc, float *sc,
                                       const struct kv__dec_mod *mod, bool e5m2)
{
    bdot_softmax(tok, n, g, D, qb, kmul, vmul, m, l, acc, sc, mod);
    values_fp8_z(tok, n, g, D, acc, sc, e5m2);
}

/* e4m3 rows loaded as the value times 2^-8: the 2^8 goes into the score's
 * and the weight's multipliers */
KV__AVX2 static void chunk_avx2_e4m3(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                     const float *q, float kmul, float vmul, float *m, float *l,
                                     float *acc, float *sc, const struct kv__dec_mod *mod)
{
    chunk_avx2_e4m3_raw(tok, n, g, D, q, kmul * 256.0f, vmul * 256.0f, m, l, acc, sc, mod);
}

/* ---- the multi-token tile (AVX2): many score rows per K/V head ----------------
 * A prefill task's gq = nq * g rows per KV head share each K and V row: the
 * chunk's rows, read in place from the cache, are converted to f32 once (kf,
 * vf [CHUNK][D]) and the f32 chunk runs over them. */
typedef void (*kv__tile_fn)(const struct kv__dec_tok *, int, int, int64_t, const float *, float,
                            float, float *, float *, float *, float *, const struct kv__dec_mod *,
                            float *);

#define KV__DEFINE_TILE_AVX2(NAME, LD8, ES)                                                        \
    KV__AVX2 static void NAME(const struct kv__dec_tok *tok, int n, int g, int64_t D,              \
                              const float *q, float kmul, float vmul, float *m, float *l,          \
                              float *acc, float *sc, const struct kv__dec_mod *mod, float *kf)     \
    {                                                                                              \
        float *vf = kf + (int64_t)KV__CHUNK * D;                                                   \
        struct kv__dec_tok ft[KV__CHUNK];                                                          \
        for (int t = 0; t < n; t++) {                                                              \
            const char *kp = (const char *)tok[t].k, *vp = (const char *)tok[t].v;                 \
            float *kr = kf + (int64_t)t * D, *vr = vf + (int64_t)t * D;                            \
            for (int64_t d = 0; d < D; d += 8) {                                                   \
                _mm256_storeu_ps(kr + d, LD8(kp + d * (ES)));                                      \
                _mm256_storeu_ps(vr + d, LD8(vp + d * (ES)));                                      \
            }                                                                                      \
            ft[t].k = kr, ft[t].v = vr;                                                            \
        }                                                                                          \
        chunk_avx2_f32(ft, n, g, D, q, kmul, vmul, m, l, acc, sc, mod);                            \
    }

KV__DEFINE_TILE_AVX2(tile_avx2_f32, ld8_f32, 4)
KV__DEFINE_TILE_AVX2(tile_avx2_f16, ld8_f16, 2)
KV__DEFINE_TILE_AVX2(tile_avx2_bf16, ld8_bf16, 2)
KV__DEFINE_TILE_AVX2(tile_avx2_e4m3_raw, ld8_e4m3_raw, 1)
KV__DEFINE_TILE_AVX2(tile_avx2_e5m2, ld8_e5m2, 1)

KV__AVX2 static void tile_avx2_e4m3(const struct kv__dec_tok *tok, int n, int g, int64_t D,
                                    const float *q, float kmul, float vmul, float *m, float *l,
                                    float *acc, float *sc, const struct kv__dec_mod *mod, float *kf)
{
    tile_avx2_e4m3_raw(tok, n, g, D, q, kmul * 256.0f, vmul * 256.0f, m, l, acc, sc, mod, kf);
}

/* ---- the multi-token tile with AVX-512F: a task's rows in the lanes --------
 * For a tile of up to 16 rows per KV head (gq = nq * g), one zmm holds a
 * value of every row: the scores of a token are 16 lanes, computed over d
 * as qT[d] (the rows' q transposed, [D][16]) times the token's K element
 * broadcast (K rows converted to f32 once, [CHUNK][D]), 8 tokens at a time:
 * no horizontal sums; the online softmax runs lane-wise; V accumulates
 * into acc [16][D] by 16-element slices of each row, the V slice loaded and
 * converted once and multiplied by each row's weight broadcast (16
 * accumulators). Where the CPU has two 512-bit FMA units (Intel server
 * cores) it issues twice the FMAs of the AVX2 tile; on AMD Zen 4 (one zmm
 * FMA a cycle) it saves the sums, the loads and the V conversion pass. */
struct kv__zt {
    float *qT;    /* [D][16] the rows' q (scaled), lanes >= gq zero */
    float *acc;   /* [16][D] */
    float *m, *l; /* [16] */
    float *kf;    /* [CHUNK][D] the chunk's K rows as f32 */
    float *sT;    /* [CHUNK][16] scores, then weights */
    /* the next chunk's rows (nnext, rowb bytes each from each pointer):
     * the tile prefetches them into L2, 8 tokens' worth per 8 tokens of its
     * scores (the gather's burst of a whole chunk's lines left the tile
     * waiting on the conversion's loads; measured: NHD +10%, HND +2-4%) */
    const struct kv__dec_tok *next;
    int nnext;
    int64_t rowb;
};

typedef void (*kv__ztile_fn)(const struct kv__dec_tok *, int, int, int64_t, float, float,
                             const struct kv__dec_mod *, const struct kv__zt *);

/* chunk_mod for scores stored [token][16] */
__attribute__((noinline, cold)) static void chunk_mod_t(const struct kv__dec_mod *mod, int n, int g,
                                                        float *sT)
{
    for (int t = 0; t < n; t++)
        for (int qi = 0; qi < g; qi++) {
            float *x = sT + t * 16 + qi;
            if (mod->cap > 0.0f)
                *x = mod->cap * tanhf(*x / mod->cap);
            if (mod->lo && (mod->pos0 + t < mod->lo[qi] || mod->pos0 + t > mod->hi[qi]))
                *x = -INFINITY;
        }
}

/* exp8_nonpos on 16 lanes */
KV__AVX512 static inline __m512 exp16_nonpos(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); /* NaN stays NaN */
    const __m512 x0 = x;
    x = _mm512_max_ps(x, lo);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mask_mov_ps(_mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e)), nan, x0);
}

KV__AVX512 static inline __m512 ld16_f32(const void *p)
{
    return _mm512_loadu_ps(p);
}
KV__AVX512 static inline __m512 ld16_f16(const void *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
KV__AVX512 static inline __m512 ld16_bf16(const void *p)
{
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

#define KV__ZT_FMA8(I) a##I = _mm512_fmadd_ps(qv, _mm512_set1_ps(k0[(I)*D + d]), a##I)
#define KV__ZT_ST8(I) _mm512_storeu_ps(sT + (t + (I)) * 16, _mm512_mul_ps(a##I, km))
#define KV__ZT_PV4(R)                                                                              \
    a##R = _mm512_fmadd_ps(_mm512_set1_ps(w[R]), v, a##R);                                         \
    b##R = _mm512_fmadd_ps(_mm512_set1_ps(w[(R) + 4]), v, b##R);                                   \
    c##R = _mm512_fmadd_ps(_mm512_set1_ps(w[(R) + 8]), v, c##R);                                   \
    e##R = _mm512_fmadd_ps(_mm512_set1_ps(w[(R) + 12]), v, e##R)

#define KV__DEFINE_ZTILE(NAME, LD16, ES)                                                           \
    KV__AVX512 static void NAME(const struct kv__dec_tok *tok, int n, int gq, int64_t D,           \
                                float kmul, float vmul, const struct kv__dec_mod *mod,             \
                                const struct kv__zt *z)                                            \
    {                                                                                              \
        float *kf = z->kf, *sT = z->sT, *acc = z->acc;                                             \
        const float *qT = z->qT;                                                                   \
        for (int t = 0; t < n; t++) {                                                              \
            const char *kp = (const char *)tok[t].k;                                               \
            for (int64_t d = 0; d < D; d += 16)                                                    \
                _mm512_storeu_ps(kf + t * D + d, LD16(kp + d * (ES)));                             \
        }                                                                                          \
        const __m512 km = _mm512_set1_ps(kmul);                                                    \
        int t = 0;                                                                                 \
        for (; t + 8 <= n; t += 8) {                                                               \
            const float *k0 = kf + t * D;                                                          \
            for (int u = t; u < t + 8 && u < z->nnext; u++)                                        \
                for (int64_t b = 0; b < z->rowb; b += 64) {                                        \
                    __builtin_prefetch((const char *)z->next[u].k + b, 0, 2);                      \
                    __builtin_prefetch((const char *)z->next[u].v + b, 0, 2);                      \
                }                                                                                  \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, \
                   a7 = a0;                                                                        \
            for (int64_t d = 0; d < D; d++) {                                                      \
                const __m512 qv = _mm512_loadu_ps(qT + d * 16);                                    \
                KV__ZT_FMA8(0);                                                                    \
                KV__ZT_FMA8(1);                                                                    \
                KV__ZT_FMA8(2);                                                                    \
                KV__ZT_FMA8(3);                                                                    \
                KV__ZT_FMA8(4);                                                                    \
                KV__ZT_FMA8(5);                                                                    \
                KV__ZT_FMA8(6);                                                                    \
                KV__ZT_FMA8(7);                                                                    \
            }                                                                                      \
            KV__ZT_ST8(0);                                                                         \
            KV__ZT_ST8(1);                                                                         \
            KV__ZT_ST8(2);                                                                         \
            KV__ZT_ST8(3);                                                                         \
            KV__ZT_ST8(4);                                                                         \
            KV__ZT_ST8(5);                                                                         \
            KV__ZT_ST8(6);                                                                         \
            KV__ZT_ST8(7);                                                                         \
        }                                                                                          \
        for (; t < n; t++) {                                                                       \
            const float *k0 = kf + t * D;                                                          \
            __m512 a0 = _mm512_setzero_ps();                                                       \
            for (int64_t d = 0; d < D; d++) {                                                      \
                const __m512 qv = _mm512_loadu_ps(qT + d * 16);                                    \
                KV__ZT_FMA8(0);                                                                    \
            }                                                                                      \
            _mm512_storeu_ps(sT + t * 16, _mm512_mul_ps(a0, km));                                  \
        }                                                                                          \
        if (mod)                                                                                   \
            chunk_mod_t(mod, n, gq, sT);                                                           \
        /* the online softmax, lane-wise: rows with nothing visible yet                            \
         * (max -inf) keep m -inf, l 0 and get weights 0 */                                        \
        const __m512 mo = _mm512_loadu_ps(z->m);                                                   \
        __m512 mx = mo;                                                                            \
        for (int i = 0; i < n; i++)                                                                \
            mx = _mm512_max_ps(_mm512_loadu_ps(sT + i * 16), mx); /* a NaN score: mx kept */       \
        const __mmask16 live = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);     \
        const __m512 mxs = _mm512_maskz_mov_ps(live, mx);                                          \
        const __m512 corr = exp16_nonpos(_mm512_sub_ps(mo, mxs));                                  \
        const __m512 vm = _mm512_set1_ps(vmul);                                                    \
        __m512 sum = _mm512_setzero_ps();                                                          \
        for (int i = 0; i < n; i++) {                                                              \
            const __m512 p = _mm512_maskz_mov_ps(                                                  \
                live, exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sT + i * 16), mxs)));             \
            sum = _mm512_add_ps(sum, p);                                                           \
            _mm512_storeu_ps(sT + i * 16, _mm512_mul_ps(p, vm));                                   \
        }                                                                                          \
        _mm512_storeu_ps(z->l, _mm512_fmadd_ps(_mm512_loadu_ps(z->l), corr, sum));                 \
        _mm512_storeu_ps(z->m, _mm512_mask_mov_ps(mo, live, mx));                                  \
        float cr[16];                                                                              \
        _mm512_storeu_ps(cr, corr);                                                                \
        for (int r = 0; r < gq; r++)                                                               \
            if (cr[r] != 1.0f) {                                                                   \
                const __m512 c8 = _mm512_set1_ps(cr[r]);                                           \
                for (int64_t d = 0; d < D; d += 16)                                                \
                    _mm512_storeu_ps(acc + r * D + d,                                              \
                                     _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), c8));         \
            }                                                                                      \
        /* V: 16 rows x 16 elements in registers across the chunk's tokens */                      \
        for (int64_t d = 0; d < D; d += 16) {                                                      \
            float *ac = acc + d;                                                                   \
            __m512 a0 = _mm512_loadu_ps(ac), a1 = _mm512_loadu_ps(ac + D),                         \
                   a2 = _mm512_loadu_ps(ac + 2 * D), a3 = _mm512_loadu_ps(ac + 3 * D);             \
            __m512 b0 = _mm512_loadu_ps(ac + 4 * D), b1 = _mm512_loadu_ps(ac + 5 * D),             \
                   b2 = _mm512_loadu_ps(ac + 6 * D), b3 = _mm512_loadu_ps(ac + 7 * D);             \
            __m512 c0 = _mm512_loadu_ps(ac + 8 * D), c1 = _mm512_loadu_ps(ac + 9 * D),             \
                   c2 = _mm512_loadu_ps(ac + 10 * D), c3 = _mm512_loadu_ps(ac + 11 * D);           \
            __m512 e0 = _mm512_loadu_ps(ac + 12 * D), e1 = _mm512_loadu_ps(ac + 13 * D),           \
                   e2 = _mm512_loadu_ps(ac + 14 * D), e3 = _mm512_loadu_ps(ac + 15 * D);           \
            for (int i = 0; i < n; i++) {                                                          \
                const __m512 v = LD16((const char *)tok[i].v + d * (ES));                          \
                const float *w = sT + i * 16;                                                      \
                KV__ZT_PV4(0);                                                                     \
                KV__ZT_PV4(1);                                                                     \
                KV__ZT_PV4(2);                                                                     \
                KV__ZT_PV4(3);                                                                     \
            }                                                                                      \
            _mm512_storeu_ps(ac, a0), _mm512_storeu_ps(ac + D, a1);                                \
            _mm512_storeu_ps(ac + 2 * D, a2), _mm512_storeu_ps(ac + 3 * D, a3);                    \
            _mm512_storeu_ps(ac + 4 * D, b0), _mm512_storeu_ps(ac + 5 * D, b1);                    \
            _mm512_storeu_ps(ac + 6 * D, b2), _mm512_storeu_ps(ac + 7 * D, b3);                    \
            _mm512_storeu_ps(ac + 8 * D, c0), _mm512_storeu_ps(ac + 9 * D, c1);                    \
            _mm512_storeu_ps(ac + 10 * D, c2), _mm512_storeu_ps(ac + 11 * D, c3);                  \
            _mm512_storeu_ps(ac + 12 * D, e0), _mm512_storeu_ps(ac + 13 * D, e1);                  \
            _mm512_storeu_ps(ac + 14 * D, e2), _mm512_storeu_ps(ac + 15 * D, e3);                  \
        }                                                                                          \
    }

KV__DEFINE_ZTILE(ztile_f32, ld16_f32, 4)
KV__DEFINE_ZTILE(ztile_f16, ld16_f16, 2)
KV__DEFINE_ZTILE(ztile_bf16, ld16_bf16, 2)

static bool cpu_has_avx2(void)
{
    static int has = -1; /* benign race: every thread computes the same value */
    if (has < 0) {
        __builtin_cpu_init();
        /* F16C from CPUID leaf 1 (ECX bit 29): clang before 15 has no "f16c"
         * feature string for __builtin_cpu_supports */
        unsigned a, b, c, d;
        const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }
    return has == 1;
}
#else
#define KV__HAVE_AVX2 0
#endif

bool kv__attn_decode_simd(kv_dtype dt, int64_t D)
{
#if KV__HAVE_AVX2
    return !kv__attn_portable && D % 8 == 0 &&
           (dt == KV_F32 || dt == KV_F16 || dt == KV_BF16 || dt == KV_FP8_E4M3 ||
            dt == KV_FP8_E5M2) &&
           cpu_has_avx2();
#else
    (void)dt, (void)D;
    return false;
#endif
}

#if KV__HAVE_AVX2
KV__AVX2 static void row_avx2(kv_dtype dt, const void *p, int64_t n, float *out)
{
    uint16_t h[64];
    for (int64_t d = 0; d < n; d += 8) {
        __m256 v;
        switch (dt) {
        case KV_F16:
            v = ld8_f16((const char *)p + 2 * d);
            break;
        case KV_BF16:
            v = ld8_bf16((const char *)p + 2 * d);
            break;
        case KV_FP8_E4M3:
        case KV_FP8_E5M2:
            if (d % 64 == 0 && /* as decode_group: exact again where a NaN was seen */
                fp8_rows_to_f16_fast(dt, h, 0, (const uint8_t *)p + d, 0, 1,
                                     n - d < 64 ? n - d : 64))
                fp8_row_to_f16(dt, h, (const uint8_t *)p + d, n - d < 64 ? n - d : 64);
            v = ld8_f16(h + d % 64);
            if (dt == KV_FP8_E4M3)
                v = _mm256_mul_ps(v, _mm256_set1_ps(256.0f));
            break;
        default:
            v = ld8_f32((const char *)p + 4 * d);
            break;
        }
        _mm256_storeu_ps(out + d, v);
    }
}
#endif

bool kv__attn_decode_row_f32(kv_dtype dt, const void *p, int64_t n, float *out)
{
#if KV__HAVE_AVX2
    if (n % 8 != 0 || !kv__attn_decode_simd(dt, n))
        return false;
    row_avx2(dt, p, n, out);
    return true;
#else
    (void)dt, (void)p, (void)n, (void)out;
    return false;
#endif
}

bool kv__attn_decode_row_bf16(kv_dtype dt, const void *p, int64_t n, uint16_t *out)
{
#if KV__HAVE_AVX2
    if (n % 32 != 0 || !(dt == KV_FP8_E4M3 || dt == KV_FP8_E5M2) ||
        !kv__attn_decode_bdot(dt, KV_BF16, n) || kv__attn_fp8_via_f16 || !kv__cpu_has_fp8bf16())
        return false;
    fp8_rows_convert(true, dt, (char *)out, n * 2, (const uint8_t *)p, n, 1, n);
    return true;
#else
    (void)dt, (void)p, (void)n, (void)out;
    return false;
#endif
}

static kv__chunk_fn chunk_for(kv_dtype dt, int64_t D)
{
#if KV__HAVE_AVX2
    if (kv__attn_decode_simd(dt, D)) {
        switch (dt) {
        case KV_F16:
            return chunk_avx2_f16;
        case KV_BF16:
            return chunk_avx2_bf16;
        case KV_FP8_E4M3:
            return chunk_avx2_e4m3;
        case KV_FP8_E5M2:
            return chunk_avx2_e5m2;
        default:
            return chunk_avx2_f32;
        }
    }
#endif
    (void)D;
    switch (dt) {
    case KV_F16:
        return chunk_f16;
    case KV_BF16:
        return chunk_bf16;
    case KV_FP8_E4M3:
        return chunk_e4m3;
    case KV_FP8_E5M2:
        return chunk_e5m2;
    default:
        return chunk_f32;
    }
}

/* Whether decode of dt converts each head's fp8 rows of a chunk to f16 first
 * (decode_group: fp8_rows_to_f16_fast, 32 elements a step with AVX-512BW,
 * else 16; a run of consecutive rows a call), then runs the f16
 * chunk: on the AVX2 path, with one head a task (HND) and with head groups
 * (NHD, where the conversion replaces the copy of the rows). Measured,
 * docs/benchmarks.md: HND 1.45-1.54x the bf16 decode against 1.33-1.45x
 * converting in the loops; NHD 10% faster than the copy and converting in
 * the loops. The portable path converts element by element. */
static bool fp8_rows_converted(kv_dtype dt, int64_t D)
{
    return KV__HAVE_AVX2 && (dt == KV_FP8_E4M3 || dt == KV_FP8_E5M2) && kv__attn_decode_simd(dt, D);
}

bool kv__attn_decode_bdot(kv_dtype cache_dt, kv_dtype q_dt, int64_t D)
{
#if KV__HAVE_AVX2
    /* fp8 rows must be the converted ones (fp8_rows_converted) */
    return (cache_dt == KV_BF16 || fp8_rows_converted(cache_dt, D)) && q_dt == KV_BF16 &&
           D % 32 == 0 && !kv__attn_avx2_only && kv__attn_decode_simd(cache_dt, D) &&
           kv__cpu_has_bf16dot();
#else
    (void)cache_dt, (void)q_dt, (void)D;
    return false;
#endif
}

static kv__chunk_fn chunk_for_rows(kv_dtype dt, int64_t D, bool converted)
{
#if KV__HAVE_AVX2
    if (converted)
        return chunk_avx2_f16;
#endif
    (void)converted;
    return chunk_for(dt, D);
}

/* The multi-token tile for cache rows of dt (read in place, converted to f32
 * by the tile), or NULL where the AVX2 path is not taken (the chunks then
 * serve every row). */
#if KV__HAVE_AVX2
static kv__tile_fn tile_for(kv_dtype dt, int64_t D)
{
    if (!kv__attn_decode_simd(dt, D))
        return NULL;
    switch (dt) {
    case KV_F16:
        return tile_avx2_f16;
    case KV_BF16:
        return tile_avx2_bf16;
    case KV_FP8_E4M3:
        return tile_avx2_e4m3;
    case KV_FP8_E5M2:
        return tile_avx2_e5m2;
    default:
        return tile_avx2_f32;
    }
}

/* The AVX-512F multi-token tile for cache rows of dt, or NULL (no AVX-512
 * or kv__attn_avx2_only set, fp8, D % 16 != 0: the AVX2 tile then). */
static kv__ztile_fn ztile_for(kv_dtype dt, int64_t D)
{
    if (kv__attn_avx2_only || D % 16 != 0 || !kv__attn_decode_simd(dt, D) || !cpu_has_avx512bw())
        return NULL;
    switch (dt) {
    case KV_F16:
        return ztile_f16;
    case KV_BF16:
        return ztile_bf16;
    case KV_F32:
        return ztile_f32;
    default:
        return NULL;
    }
}
#else
typedef void (*kv__tile_fn)(void);
#endif

/* How many pages ahead a one-head (HND) task prefetches a page's rows. */
#define KV__PAGE_AHEAD 4

/* Most KV heads a decode task groups (docs/kernels.md). */
#define KV__HEAD_GROUP_MAX 16

/* One chunk of n tokens for each of the hb heads h0.. of a task: tok holds
 * head h0's rows; head h0 + hi's are hi head strides further. With rows
 * (hb > 1, NHD: a token's head rows are adjacent, so one head's rows are a
 * whole token row apart, 1-2 KiB), each head's K and V rows of the chunk are
 * first copied into rows[2][KV__CHUNK][D] (contiguous, from L1/L2: the
 * chunk was prefetched): the AVX2 chunk walks V by 8-element slices across
 * the chunk's tokens, and at a token-row stride those lines fall into a few
 * L1 sets and evict each other between slices (measured, docs/benchmarks.md:
 * NHD bf16 1.57 -> 2.4-2.7 M tokens/s, fp8 0.94 -> 2.65 M). */
__attribute__((noinline)) static void
decode_group(const struct kv__attn_job *j, kv__chunk_fn chunk, const struct kv__dec_tok *tok,
             struct kv__dec_tok *th, int n, int64_t hb, int64_t h0, int g, const float *q,
             const uint16_t *qb, float *m, float *l, float *acc, float *sc, char *rows, bool conv,
             bool cbf, const struct kv__dec_mod *mod, kv__tile_fn tile, float *tbuf)
{
    const kv_dtype dt = j->cache.layout.dtype;
    const int64_t D = j->cache.layout.head_dim, hs = j->cache.layout.stride_head_bytes;
    /* a tile reads the cache's rows in place and converts them itself */
    if (tile)
        rows = NULL, conv = cbf = false;
    const size_t rowb = (size_t)(D * (conv ? 2 : j->cache.layout.elem_bytes));
    /* e4m3 rows converted to f16 hold the values times 2^-8 (fp8_row_to_f16);
     * to bf16 (cbf) the values */
    const float fold = conv && !cbf && dt == KV_FP8_E4M3 ? 256.0f : 1.0f;
    bool whole = false; /* every head's rows converted already, into rows[hi][2][CHUNK][D] */
#if KV__HAVE_AVX2
    if (rows && conv && hb > 1) {
        /* NHD fp8: token by token, the head rows in memory order (a token's
         * hb x D bytes are adjacent), so the cache is read sequentially */
        bool nan = false;
        const int64_t hstep = (int64_t)(2 * KV__CHUNK * rowb); /* head to head */
        for (int t = 0; t < n; t++) /* head hi's row t at rows[hi][0][t] */
            nan |= fp8_rows_convert(cbf, dt, rows + (size_t)t * rowb, hstep,
                                    (const uint8_t *)tok[t].k, hs, hb, D);
        for (int t = 0; t < n; t++) /* and at rows[hi][1][t] */
            nan |= fp8_rows_convert(cbf, dt, rows + (size_t)(KV__CHUNK + t) * rowb, hstep,
                                    (const uint8_t *)tok[t].v, hs, hb, D);
        whole = !nan; /* else head by head below, exactly */
    }
#endif
    for (int64_t hi = 0; hi < hb; hi++) {
        const int64_t h = h0 + hi;
        const float ks = (j->k_scale ? j->k_scale[j->n_scales == 1 ? 0 : h] : 1.0f) * fold;
        const float vs = (j->v_scale ? j->v_scale[j->n_scales == 1 ? 0 : h] : 1.0f) * fold;
        const struct kv__dec_tok *use = tok;
        if (whole) {
            for (int t = 0; t < n; t++) {
                th[t].k = rows + (size_t)(hi * 2 * KV__CHUNK + t) * rowb;
                th[t].v = rows + (size_t)((hi * 2 + 1) * KV__CHUNK + t) * rowb;
            }
            use = th;
        } else if (rows) {
            char *kr = rows, *vr = rows + KV__CHUNK * rowb;
#if KV__HAVE_AVX2
            if (conv) { /* exact unless a row holds an e4m3 NaN: then again below */
                /* one call per run of consecutive tokens (a page's rows of
                 * the head, one token stride apart: HND's contiguous rows) */
                const int64_t ts = j->cache.layout.stride_token_bytes;
                bool nan = false;
                for (int t = 0, e; t < n; t = e) {
                    for (e = t + 1; e < n; e++)
                        if ((const char *)tok[e].k != (const char *)tok[e - 1].k + ts)
                            break;
                    nan |= fp8_rows_convert(cbf, dt, kr + (size_t)t * rowb, (int64_t)rowb,
                                            (const uint8_t *)tok[t].k + hi * hs, ts, e - t, D);
                    if (!cbf) /* cbf: V rows read in place (chunk_fp8v_bdot) */
                        nan |= fp8_rows_convert(cbf, dt, vr + (size_t)t * rowb, (int64_t)rowb,
                                                (const uint8_t *)tok[t].v + hi * hs, ts, e - t, D);
                }
                for (int t = 0; t < n; t++) {
                    th[t].k = kr + (size_t)t * rowb;
                    th[t].v = cbf ? (const char *)tok[t].v + hi * hs : vr + (size_t)t * rowb;
                }
                use = th;
                if (!nan)
                    goto run;
            }
#endif
            for (int t = 0; t < n; t++) {
                const char *ks_row = (const char *)tok[t].k + hi * hs;
                const char *vs_row = (const char *)tok[t].v + hi * hs;
#if KV__HAVE_AVX2
                if (conv) {
                    fp8_row_to_f16(dt, (uint16_t *)(kr + (size_t)t * rowb), (const uint8_t *)ks_row,
                                   D);
                    fp8_row_to_f16(dt, (uint16_t *)(vr + (size_t)t * rowb), (const uint8_t *)vs_row,
                                   D);
                } else
#endif
                {
                    memcpy(kr + (size_t)t * rowb, ks_row, rowb);
                    memcpy(vr + (size_t)t * rowb, vs_row, rowb);
                }
                th[t].k = kr + (size_t)t * rowb;
                th[t].v = vr + (size_t)t * rowb;
            }
            use = th;
        } else if (hi > 0) {
            for (int t = 0; t < n; t++) {
                th[t].k = (const char *)tok[t].k + hi * hs;
                th[t].v = (const char *)tok[t].v + hi * hs;
            }
            use = th;
        }
#if KV__HAVE_AVX2
    run:
        if (tile) {
            tile(use, n, g, D, q + hi * g * D, ks, vs, m + hi * g, l + hi * g, acc + hi * g * D, sc,
                 mod, tbuf);
            continue;
        }
        if (qb) { /* bf16 dot products: bf16 rows (in place, copied, or fp8 rows
                   * converted to bf16: cbf), or fp8 rows converted to f16 */
            const float km = ks * j->softmax_scale;
            if (!conv) /* bf16 rows */
                chunk_bf16_bdot(use, n, g, D, qb + hi * g * D, km, vs, m + hi * g, l + hi * g,
                                acc + hi * g * D, sc, mod);
            else if (cbf && !whole) /* fp8: K in the buffer as bf16, V in place */
                chunk_fp8v_bdot(use, n, g, D, qb + hi * g * D, km, vs, m + hi * g, l + hi * g,
                                acc + hi * g * D, sc, mod, dt == KV_FP8_E5M2);
            else if (cbf) /* fp8: every head's rows in the buffer as bf16 */
                chunk_bf16_bdot(use, n, g, D, qb + hi * g * D, km, vs, m + hi * g, l + hi * g,
                                acc + hi * g * D, sc, mod);
            else /* fp8 rows as f16 */
                chunk_f16_bdot(use, n, g, D, qb + hi * g * D, km, vs, m + hi * g, l + hi * g,
                               acc + hi * g * D, sc, mod);
            continue;
        }
#else
        (void)tile, (void)tbuf, (void)qb;
#endif
        chunk(use, n, g, D, q + hi * g * D, ks, vs, m + hi * g, l + hi * g, acc + hi * g * D, sc,
              mod);
    }
}

/* Rows of queries a task of a multi-token call takes per KV head (a tile of
 * KV__TILE_ROWS / g queries, each with its g heads): each K and V row loaded
 * then serves that many score and accumulation rows. */
#define KV__TILE_ROWS 16

/* One task's queries: gq = nq * g per KV head, query row iq * g + qi seeing
 * the positions qlo[] .. qhi[]; the chunk of n tokens from position pos0. */
struct kv__dec_task {
    const struct kv__attn_job *j;
    kv__chunk_fn chunk;
    struct kv__dec_tok *th;
    int64_t hb, h0;
    int gq;
    float *q, *m, *l, *acc, *sc;
    uint16_t *qb; /* q's bf16 [hb][G][D] where the chunks take bf16 dot products; else NULL */
    char *rows;
    bool conv;
    bool cbf;                 /* conv, to bf16 (fp8_rows_convert) */
    const int64_t *qlo, *qhi; /* [gq] */
    int64_t lo_max, hi_min;   /* the last query's lo, the first query's hi */
    kv__tile_fn tile;         /* several queries per head (nq > 1) on AVX2; else NULL */
    float *tbuf;              /* the tile's f32 rows, [2][CHUNK][D] */
    bool zpf; /* the AVX-512F tile prefetches the next chunk itself (not the gather) */
#if KV__HAVE_AVX2
    kv__ztile_fn ztile; /* instead of tile: up to 16 rows of one head, AVX-512F */
    struct kv__zt z;    /* its state (the task's m, l, acc until the task ends) */
#endif
};

/* Chunk tok of n tokens from position pos0; next: the nnext rows gathered
 * after it (the AVX-512F tile prefetches them). */
static void run_chunk(struct kv__dec_task *k, const struct kv__dec_tok *tok, int n, int64_t pos0,
                      const struct kv__dec_tok *next, int nnext)
{
    struct kv__dec_mod mod = {k->j->soft_cap, NULL, NULL, pos0};
    if (pos0 < k->lo_max || pos0 + n - 1 > k->hi_min) /* a query does not see all of it */
        mod.lo = k->qlo, mod.hi = k->qhi;
#if KV__HAVE_AVX2
    if (k->ztile) {
        const struct kv__attn_job *j = k->j;
        const int64_t h = k->h0; /* one head */
        const float ks = j->k_scale ? j->k_scale[j->n_scales == 1 ? 0 : h] : 1.0f;
        const float vs = j->v_scale ? j->v_scale[j->n_scales == 1 ? 0 : h] : 1.0f;
        k->z.next = next, k->z.nnext = nnext;
        k->ztile(tok, n, k->gq, j->cache.layout.head_dim, ks, vs,
                 mod.cap > 0.0f || mod.lo ? &mod : NULL, &k->z);
        return;
    }
#endif
    decode_group(k->j, k->chunk, tok, k->th, n, k->hb, k->h0, k->gq, k->q, k->qb, k->m, k->l,
                 k->acc, k->sc, k->rows, k->conv, k->cbf, mod.cap > 0.0f || mod.lo ? &mod : NULL,
                 k->tile, k->tbuf);
}

/* The call's tasks split each (unit, head group)'s tokens into parts when
 * it has fewer than KV__SPLIT_TASKS (unit, KV head) pairs (a small batch of
 * long sequences: a few sequences would leave most threads idle), parts of
 * at least KV__SPLIT_MIN_TOKENS tokens; each part keeps its own online
 * softmax state (m, l, acc) and a second pass merges a unit's parts in part
 * order. The split depends on the shape only, never on the thread count, so
 * every thread count gives the same bytes (tested). */
#define KV__SPLIT_TASKS 256
#define KV__SPLIT_MIN_TOKENS 1024

/* The sequence of task index u: task0[s] = tasks before sequence s, [S + 1]. */
static int64_t seq_of_task(const int64_t *task0, int64_t S, int64_t u)
{
    int64_t a = 0, b = S; /* task0[a] <= u < task0[b] */
    while (b - a > 1) {
        const int64_t c = (a + b) / 2;
        if (task0[c] <= u)
            a = c;
        else
            b = c;
    }
    return a;
}

/* Sequence s's query tiles (qt queries each) and KV parts (want: the most
 * parts a sequence takes, 1 when the call is large enough). */
static int64_t tiles_of(const struct kv__attn_job *j, int64_t s, int64_t qt)
{
    return j->q_start ? (j->q_start[s + 1] - j->q_start[s] + qt - 1) / qt : 1;
}

static int64_t parts_of(const struct kv__attn_job *j, int64_t s, int64_t want)
{
    if (want <= 1)
        return 1;
    /* the tokens the sequence's first query sees onwards */
    const int64_t len = j->seq_tokens[s];
    const int64_t q_len = j->q_start ? j->q_start[s + 1] - j->q_start[s] : 1;
    const int64_t pos = len - q_len;
    const int64_t lo = j->window_left < 0 || pos - j->window_left < 0 ? 0 : pos - j->window_left;
    const int64_t p = (len - lo + KV__SPLIT_MIN_TOKENS - 1) / KV__SPLIT_MIN_TOKENS;
    return p < 1 ? 1 : (p < want ? p : want);
}

/* Out (and lse) of the nq queries of rows row0.. over heads h0 .. h0 + hb -
 * 1 (g query heads each) from a task's state: row r = hi * gq + iq * g + qi
 * of m, l [hb * gq] and acc [hb * gq][D]. */
static void store_rows(const struct kv__attn_job *j, int64_t row0, int64_t nq, int g, int64_t h0,
                       int64_t hb, const float *m, const float *l, const float *acc)
{
    const int64_t D = j->cache.layout.head_dim, gq = nq * g;
    for (int64_t hi = 0; hi < hb; hi++)
        for (int64_t iq = 0; iq < nq; iq++)
            for (int qi = 0; qi < g; qi++) {
                const int64_t row = row0 + iq, head = (h0 + hi) * g + qi;
                const int64_t r = hi * gq + iq * g + qi;
                char *op = j->out.base + row * j->out.token_stride + head * j->out.head_stride;
                const float lq = l[r];
                const float inv = lq != 0.0f ? 1.0f / lq : 0.0f; /* no tokens: zeros */
                const float *aq = acc + r * D;
                for (int64_t d = 0; d < D; d++)
                    kv_from_f32(j->out.dtype, aq[d] * inv, op + d * j->out.dim_stride);
                if (j->lse)
                    j->lse[row * j->lse_stride + head] = lq != 0.0f ? m[r] + logf(lq) : -INFINITY;
            }
}

/* Decode (q_start NULL: one query a sequence, row s) and the multi-token
 * kernel (rows q_start[s] .. q_start[s+1] of sequence s, the causal mask)
 * with the options of the job: each task is a sequence (or a tile of its
 * queries), a group of KV heads and a part of the tokens its queries see
 * (the whole range unless the call is small: KV__SPLIT_TASKS); it walks
 * them from the first query's lo to the last query's position. */
static kv_status exec_decode(const struct kv__attn_job *j)
{
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t H = lo->num_heads, D = lo->head_dim, S = j->n_seqs;
    const int g = (int)(j->q_heads / (uint32_t)H);
    const int64_t pt = j->page_tokens, rowb = D * lo->elem_bytes;
    const bool multi = j->q_start != NULL;
    const int64_t qt = multi ? (g >= KV__TILE_ROWS ? 1 : KV__TILE_ROWS / g) : 1;
    int64_t units = 0, total_tokens = 0, unit_parts = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t tiles = tiles_of(j, s, qt);
        units += tiles;
        total_tokens += tiles * j->seq_tokens[s];
    }
    if (units == 0) /* no query rows (no sequences, or every q_len 0): nothing to write */
        return KV_OK;
    /* a shape-only choice (not the thread count): the same bytes on any */
    const int64_t want =
        units * H >= KV__SPLIT_TASKS ? 1 : (KV__SPLIT_TASKS + units * H - 1) / (units * H);
    for (int64_t s = 0; s < S; s++)
        unit_parts += tiles_of(j, s, qt) * parts_of(j, s, want);
    const int nt = kv__attn_threads_for(total_tokens * H * D * lo->elem_bytes * 2);
    /* A task is a unit, a group of hb KV heads and a part. Where a token's
     * head rows are adjacent (NHD), the group is as many heads as still
     * leave 4 tasks a thread, so a token's whole row (H x D elements) is
     * read at once instead of D elements every token stride; otherwise
     * (HND: a head's rows of a block are adjacent already) one head. A task
     * of the multi-token kernel whose tiles fill 16 rows a head is
     * compute-bound and takes one head (its tile reads the rows in place,
     * converted once): measured 6-16% faster than 4 heads at q_len 4 (NHD
     * bf16, one thread). The results do not depend on hb. */
    int64_t hb = 1;
    if (lo->stride_head_bytes == rowb)
        for (hb = H < KV__HEAD_GROUP_MAX ? H : KV__HEAD_GROUP_MAX; hb > 1; hb--)
            if (H % hb == 0 && unit_parts * (H / hb) >= 4 * (int64_t)nt &&
                (!multi || hb * qt * g <= 16))
                break;
    const int64_t G = qt * g;
    /* task0[s] = tasks before sequence s: its tasks are (head group, part,
     * tile), the tile fastest (a sequence's tiles of one head group and
     * part read the same K/V: adjacent tasks, often one thread's, from
     * cache) */
    int64_t *task0 = kv__mem_alloc(((size_t)S + 1) * sizeof(int64_t));
    if (!task0)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %" PRId64 " sequences", j->fn, S);
    task0[0] = 0;
    for (int64_t s = 0; s < S; s++)
        task0[s + 1] = task0[s] + (H / hb) * tiles_of(j, s, qt) * parts_of(j, s, want);
    const int64_t tasks = task0[S];
    /* per thread: q [hb][G][D], acc [hb][G][D], m [hb][G], l [hb][G],
     * scores [G][CHUNK]; qlo, qhi [G]; NHD (hb > 1): each head's rows of a
     * chunk copied contiguous; fp8 on the AVX2 path: converted to f16
     * instead (decode_group); a tile: its rows as f32 [2][CHUNK][D] */
    const bool conv = fp8_rows_converted(lo->dtype, D);
    const kv__chunk_fn chunk = chunk_for_rows(lo->dtype, D, conv);
    const bool bdot = kv__attn_decode_bdot(lo->dtype, j->q.dtype, D);
    /* fp8 rows to bf16 for the bf16 dot products (decode_group) */
#if KV__HAVE_AVX2
    const bool cbf = conv && bdot && !kv__attn_fp8_via_f16 && kv__cpu_has_fp8bf16();
#else
    const bool cbf = false;
#endif
    const size_t bbytes = bdot ? ((size_t)(hb * G * D) * sizeof(uint16_t) + 63) / 64 * 64 : 0;
    const int64_t crow = conv ? D * 2 : rowb; /* f16 or bf16 */
    const size_t rbytes =
        hb > 1 || conv ? (size_t)((conv ? hb : 1) * 2 * KV__CHUNK * crow + 63) / 64 * 64 : 0;
    const size_t fbytes =
        ((size_t)(2 * hb * G * D + 2 * hb * G + G * KV__CHUNK) * sizeof(float) + 63) / 64 * 64;
    const size_t ibytes = ((size_t)(2 * G) * sizeof(int64_t) + 63) / 64 * 64;
#if KV__HAVE_AVX2
    const kv__tile_fn tile_fn = multi ? tile_for(lo->dtype, D) : NULL;
#else
    const kv__tile_fn tile_fn = NULL;
#endif
#if KV__HAVE_AVX2
    const kv__ztile_fn ztile_fn = multi ? ztile_for(lo->dtype, D) : NULL;
    /* the AVX-512F tile's qT, acc [16][D], m, l [16], kf [CHUNK][D], sT [CHUNK][16] */
    const size_t zbytes =
        ztile_fn ? ((size_t)(32 * D + 32 + KV__CHUNK * D + KV__CHUNK * 16) * sizeof(float) + 63) /
                       64 * 64
                 : 0;
#else
    const size_t zbytes = 0;
#endif
    size_t tbytes = tile_fn ? (size_t)(2 * KV__CHUNK * D) * sizeof(float) : 0;
    tbytes = zbytes > tbytes ? zbytes : tbytes;
    const size_t per = fbytes + ibytes + tbytes + rbytes + bbytes;
    /* a split call: each task's state, acc [hb][G][D], m [hb][G], l
     * [hb][G], in its own 64-byte lines, for the merge */
    const size_t pslot =
        want > 1 ? ((size_t)(hb * G * D + 2 * hb * G) * sizeof(float) + 63) / 64 * 64 : 0;
    float *scratch = kv__mem_alloc_aligned(64, per * (size_t)nt + pslot * (size_t)tasks + 64);
    if (!scratch) {
        kv__mem_free(task0);
        return kv__error(KV_ERR_NO_MEMORY, "%s: %zu bytes of scratch", j->fn,
                         per * (size_t)nt + pslot * (size_t)tasks);
    }
    char *slots = (char *)scratch + per * (size_t)nt;
    /* the chunk of tasks a thread takes at once: 4 (adjacent tiles from
     * cache) where that still leaves 16 a thread, else 1 */
    const int cs = tasks >= 16 * (int64_t)nt ? 4 : 1;
#pragma omp parallel num_threads(nt)
    {
        char *mine = (char *)scratch + (size_t)omp_get_thread_num() * per;
        int64_t *qlo = (int64_t *)(mine + fbytes + rbytes), *qhi = qlo + G;
        struct kv__dec_tok tok[2][KV__CHUNK]; /* the chunk computed, the next one fetched */
        struct kv__dec_tok th[KV__CHUNK];     /* the chunk's rows of one head of the group */
        struct kv__dec_task k;
        memset(&k, 0, sizeof(k));
        k.j = j, k.chunk = chunk, k.th = th, k.hb = hb, k.conv = conv;
        k.cbf = cbf;
        k.rows = rbytes ? mine + fbytes : NULL; /* where decode always had them */
        k.qlo = qlo, k.qhi = qhi;
        k.tbuf = tbytes ? (float *)(void *)(mine + fbytes + rbytes + ibytes) : NULL;
        k.qb = bbytes ? (uint16_t *)(void *)(mine + fbytes + rbytes + ibytes + tbytes) : NULL;
#if KV__HAVE_AVX2
        if (zbytes) {
            k.z.qT = k.tbuf;
            k.z.acc = k.z.qT + 16 * D;
            k.z.m = k.z.acc + 16 * D;
            k.z.l = k.z.m + 16;
            k.z.kf = k.z.l + 16;
            k.z.sT = k.z.kf + KV__CHUNK * D;
            k.z.rowb = rowb;
        }
#endif
#pragma omp for schedule(dynamic, cs)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = seq_of_task(task0, S, task);
            const int64_t tiles = tiles_of(j, s, qt), np = parts_of(j, s, want);
            const int64_t r = task - task0[s], h0 = r / (np * tiles) * hb;
            const int64_t part = r % (np * tiles) / tiles, qa = r % tiles * qt;
            const int64_t len = j->seq_tokens[s];
            const int64_t row0 = multi ? j->q_start[s] : s;
            const int64_t q_len = multi ? j->q_start[s + 1] - j->q_start[s] : 1;
            const int64_t nq = q_len - qa < qt ? q_len - qa : qt;
            const int gq = (int)(nq * g);
            /* query iq sits at position len - q_len + qa + iq */
            for (int64_t iq = 0; iq < nq; iq++) {
                const int64_t pos = len - q_len + qa + iq;
                const int64_t l0 =
                    j->window_left < 0 || pos - j->window_left < 0 ? 0 : pos - j->window_left;
                for (int qi = 0; qi < g; qi++) {
                    qlo[iq * g + qi] = l0;
                    qhi[iq * g + qi] = pos;
                }
            }
            int64_t t_begin = qlo[0], t_end = qhi[gq - 1] + 1;
            if (np > 1) { /* part `part` of np: whole chunks from t_begin */
                const int64_t step =
                    ((t_end - t_begin + np - 1) / np + KV__CHUNK - 1) / KV__CHUNK * KV__CHUNK;
                const int64_t pb = t_begin + part * step;
                t_begin = pb < t_end ? pb : t_end;
                t_end = pb + step < t_end ? pb + step : t_end;
            }
            k.h0 = h0;
            k.gq = gq;
            k.q = (float *)(void *)mine;
            k.acc = k.q + hb * gq * D;
            k.m = k.acc + hb * gq * D;
            k.l = k.m + hb * gq;
            k.sc = k.l + hb * gq;
            if (np > 1) { /* the state stays in the task's slot for the merge */
                k.acc = (float *)(void *)(slots + (size_t)task * pslot);
                k.m = k.acc + hb * G * D;
                k.l = k.m + hb * G;
            }
            k.lo_max = qlo[gq - 1];
            k.hi_min = qhi[0];
            k.tile = nq > 1 ? tile_fn : NULL; /* one query: the decode chunk, as decode */
            for (int64_t hi = 0; hi < hb; hi++)
                for (int64_t iq = 0; iq < nq; iq++)
                    for (int qi = 0; qi < g; qi++) {
                        const char *qp = j->q.base + (row0 + qa + iq) * j->q.token_stride +
                                         ((h0 + hi) * g + qi) * j->q.head_stride;
                        const int64_t ri = hi * gq + iq * g + qi;
                        float *qq = k.q + ri * D;
                        for (int64_t d = 0; d < D; d++)
                            qq[d] =
                                kv_to_f32(j->q.dtype, qp + d * j->q.dim_stride) * j->softmax_scale;
                        if (k.qb) /* bf16 as it is: the scale goes into the chunk's kmul */
                            for (int64_t d = 0; d < D; d++)
                                memcpy(k.qb + ri * D + d, qp + d * j->q.dim_stride, 2);
                        k.m[ri] = -INFINITY;
                        k.l[ri] = 0.0f;
                    }
            memset(k.acc, 0, (size_t)(hb * gq * D) * sizeof(float));
#if KV__HAVE_AVX2
            /* up to 16 rows of one head: the AVX-512F tile, its state in k.z */
            k.ztile = nq > 1 && hb == 1 && gq <= 16 ? ztile_fn : NULL;
            k.zpf = k.ztile != NULL;
            if (k.ztile) {
                k.tile = NULL;
                for (int64_t d = 0; d < D; d++)
                    for (int ri = 0; ri < 16; ri++)
                        k.z.qT[d * 16 + ri] = ri < gq ? k.q[ri * D + d] : 0.0f;
                memset(k.z.acc, 0, (size_t)(16 * D) * sizeof(float));
                for (int ri = 0; ri < 16; ri++)
                    k.z.m[ri] = -INFINITY, k.z.l[ri] = 0.0f;
            }
#endif
            /* tokens t_begin .. t_end - 1 in chunks of KV__CHUNK: chunk c+1's
             * rows (every head of the group) are gathered and prefetched
             * before chunk c is computed, head after head */
            int n = 0, cur = 0, ready = 0;
            int64_t t = t_begin, pos_fill = t_begin, pos_ready = 0;
            const int64_t pj_end = j->page_start[s] + (t_end + pt - 1) / pt;
            for (int64_t pj = j->page_start[s] + t_begin / pt; t < t_end; pj++) {
                /* a page's tokens are consecutive slots of one block (pt
                 * divides N): its first token's address, then token steps */
                const char *pg = (const char *)j->cache.base +
                                 kv_layout_slot_offset_bytes(
                                     lo, j->layer0, 0, kv_attn_page_slot(j->page_ids[pj], pt, 0)) +
                                 h0 * lo->stride_head_bytes;
                const char *pf = NULL;
                if (hb == 1 && lo->order == KV_ORDER_HND && pj + KV__PAGE_AHEAD < pj_end)
                    /* one head (HND): its rows of the page KV__PAGE_AHEAD
                     * pages on, to L2 as well (the chunk-ahead prefetch
                     * below alone left the bf16 HND decode waiting on
                     * memory), token by token below */
                    pf = (const char *)j->cache.base +
                         kv_layout_slot_offset_bytes(
                             lo, j->layer0, 0,
                             kv_attn_page_slot(j->page_ids[pj + KV__PAGE_AHEAD], pt, 0)) +
                         h0 * lo->stride_head_bytes;
                for (int64_t i = t % pt; i < pt && t < t_end; i++, t++) {
                    const char *kb = pg + i * lo->stride_token_bytes;
                    struct kv__dec_tok *tt = &tok[cur ^ 1][n];
                    tt->k = kb;
                    tt->v = kb + lo->stride_kv_bytes;
                    if (pf) {
                        const char *p = pf + i * lo->stride_token_bytes;
                        for (int64_t b = 0; b < rowb; b += 64) {
                            __builtin_prefetch(p + b, 0, 2);
                            __builtin_prefetch(p + lo->stride_kv_bytes + b, 0, 2);
                        }
                    }
                    /* to L2 (prefetcht1): a chunk's rows are 32-128 KiB in
                     * NHD, more than L1 holds; prefetched into L1 they
                     * evicted the chunk being computed (measured: fp8 NHD
                     * 1.6x, bf16 HND 1.36x faster on one thread) */
                    for (int64_t b = 0; !k.zpf && b < hb * rowb; b += 64) { /* hb > 1: adjacent */
                        __builtin_prefetch(kb + b, 0, 2);
                        __builtin_prefetch(kb + lo->stride_kv_bytes + b, 0, 2);
                    }
                    if (++n == KV__CHUNK) {
                        if (ready)
                            run_chunk(&k, tok[cur], ready, pos_ready, tok[cur ^ 1], KV__CHUNK);
                        cur ^= 1;
                        ready = n;
                        pos_ready = pos_fill;
                        pos_fill += n;
                        n = 0;
                    }
                }
            }
            if (ready)
                run_chunk(&k, tok[cur], ready, pos_ready, tok[cur ^ 1], n);
            if (n)
                run_chunk(&k, tok[cur ^ 1], n, pos_fill, NULL, 0);
#if KV__HAVE_AVX2
            if (k.ztile) { /* the tile's state to the task's */
                memcpy(k.acc, k.z.acc, (size_t)(gq * D) * sizeof(float));
                memcpy(k.m, k.z.m, (size_t)gq * sizeof(float));
                memcpy(k.l, k.z.l, (size_t)gq * sizeof(float));
            }
#endif
            if (np == 1)
                store_rows(j, row0 + qa, nq, g, h0, hb, k.m, k.l, k.acc);
        }
        /* a split call: each unit's parts merged in part order (the rows'
         * largest m, then every part's l and acc rescaled to it), into the
         * thread's own acc, m, l */
        if (want > 1) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < tasks; task++) {
                const int64_t s = seq_of_task(task0, S, task);
                const int64_t tiles = tiles_of(j, s, qt), np = parts_of(j, s, want);
                const int64_t r = task - task0[s];
                if (np == 1 || r % (np * tiles) >= tiles) /* a part 0 task merges its unit */
                    continue;
                const int64_t h0 = r / (np * tiles) * hb, qa = r % tiles * qt;
                const int64_t row0 = multi ? j->q_start[s] : s;
                const int64_t q_len = multi ? j->q_start[s + 1] - j->q_start[s] : 1;
                const int64_t nq = q_len - qa < qt ? q_len - qa : qt;
                const int64_t rows = hb * nq * g;
                float *acc = (float *)(void *)mine, *m = acc + rows * D, *l = m + rows;
                for (int64_t ri = 0; ri < rows; ri++) {
                    float mx = -INFINITY, sum = 0.0f;
                    for (int64_t p = 0; p < np; p++) {
                        const float *pm =
                            (const float *)(const void *)(slots +
                                                          (size_t)(task + p * tiles) * pslot) +
                            hb * G * D;
                        mx = pm[ri] > mx ? pm[ri] : mx;
                    }
                    float *a = acc + ri * D;
                    memset(a, 0, (size_t)D * sizeof(float));
                    for (int64_t p = 0; mx > -INFINITY && p < np; p++) {
                        const float *pa =
                            (const float *)(const void *)(slots +
                                                          (size_t)(task + p * tiles) * pslot);
                        const float *pm = pa + hb * G * D, *pl = pm + hb * G;
                        if (pm[ri] == -INFINITY) /* the part saw none of the row's tokens */
                            continue;
                        const float w = expf(pm[ri] - mx);
                        sum += pl[ri] * w;
                        const float *src = pa + ri * D;
                        for (int64_t d = 0; d < D; d++)
                            a[d] += src[d] * w;
                    }
                    m[ri] = mx;
                    l[ri] = sum;
                }
                store_rows(j, row0 + qa, nq, g, h0, hb, m, l, acc);
            }
        }
    }
    kv__mem_free(scratch);
    kv__mem_free(task0);
    return KV_OK;
}

static kv_status run_decode(const char *fn, struct kv_paged_cache cache, uint32_t layer,
                            const struct kv_view *q, const int32_t *qo_indptr,
                            const struct kv_pages *pages, float softmax_scale,
                            const struct kv_scales *scales, const struct kv_view *out,
                            const struct kv_attn_opts *opts)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_decode_check(fn, &cache, layer, q, qo_indptr, pages, softmax_scale,
                                         scales, out, opts, &j);
    if (st != KV_OK)
        return st;
    st = exec_decode(&j);
    if (st == KV_OK)
        kv__attn_count(&j, false);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_attn_decode(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                         const struct kv_pages *pages, float softmax_scale,
                         const struct kv_scales *scales, const struct kv_view *out)
{
    return run_decode("kv_attn_decode", cache, layer, q, NULL, pages, softmax_scale, scales, out,
                      NULL);
}

kv_status kv_attn_decode_ex(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                            const struct kv_pages *pages, float softmax_scale,
                            const struct kv_scales *scales, const struct kv_view *out,
                            const struct kv_attn_opts *opts)
{
    return run_decode("kv_attn_decode_ex", cache, layer, q, NULL, pages, softmax_scale, scales, out,
                      opts);
}

kv_status kv_attn_prefill(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                          const int32_t *qo_indptr, const struct kv_pages *pages,
                          float softmax_scale, const struct kv_scales *scales,
                          const struct kv_view *out, const struct kv_attn_opts *opts)
{
    return run_decode("kv_attn_prefill", cache, layer, q, qo_indptr, pages, softmax_scale, scales,
                      out, opts);
}
