/*
 * kv_attn_cpu_mla.c - MLA decode on the CPU (kv_attn_decode_mla, kv_attn.h):
 * FlashMLA's convention over a K-only latent cache of one KV head. Each
 * query head i of sequence s:
 *
 *     out[s][i] = sum_t softmax_t(scale * q[s][i] . K[t][0..D)) K[t][0..dv)
 *
 * Work: tasks of (sequence, group of up to KV__MLA_GROUP query heads) over
 * OpenMP threads, as many heads a group as still leave two tasks a thread.
 * A task walks its sequence's tokens in chunks of KV__MLA_CHUNK: each latent
 * row is read once from the cache and converted to f32 into a chunk buffer
 * [CHUNK][D] (dequantized, the scale folded in later), then serves every
 * query head of the group twice: the scores (all D dims) and the values (the
 * first dv dims). That one pass over K for all Hq heads is the point of MLA:
 * with Hq = 128 a row costs 128 x (D + dv) x 2 flops against D x elem bytes
 * read, so the kernel is bound by the FMA units, not by memory (docs/kernels.md).
 *
 * AVX2/FMA (chosen at run time, no AVX-512 needed; Intel Xeon and AMD EPYC
 * alike) where D and dv are multiples of 8: the scores 4 heads x 2 tokens
 * at a time (8 accumulators, one q and one K load per 4 and 2 FMAs), the
 * values 4 heads x 16 dims with the accumulators in registers across the
 * chunk's tokens. Elsewhere (or with kv__attn_portable) the same order in
 * plain loops.
 *
 * The chunk code (kv__mla_rows, kv__mla_chunk; kv_attn_mla_int.h) is also
 * what the prefill (kv_attn_cpu_mla_prefill.c) runs, so the two sum in the
 * same order.
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
#include "kv_attn_mla_int.h"
#include "kv_convert_hd.h"
#include "kv_mem.h"

/* One chunk's K rows as f32 (unscaled): kf[t][0..D). */
static void rows_to_f32(const struct kv_layout *lo, const char *const *rows, int n, float *kf,
                        const float *lut)
{
    const int64_t D = lo->head_dim;
    for (int t = 0; t < n; t++) {
        float *o = kf + (int64_t)t * D;
        const char *p = rows[t];
        switch (lo->dtype) {
        case KV_F32:
            memcpy(o, p, (size_t)D * sizeof(float));
            break;
        case KV_F16:
            for (int64_t d = 0; d < D; d++)
                o[d] = kv_f16_to_f32(((const uint16_t *)(const void *)p)[d]);
            break;
        case KV_BF16:
            for (int64_t d = 0; d < D; d++)
                o[d] = kv_bf16_to_f32(((const uint16_t *)(const void *)p)[d]);
            break;
        default: /* fp8: the 256 values of the dtype */
            for (int64_t d = 0; d < D; d++)
                o[d] = lut[((const uint8_t *)p)[d]];
            break;
        }
    }
}

/* The online softmax of one chunk: scores sc[h][t] (already scaled) ->
 * weights, m, l updated, acc [h][dv] rescaled. */
static void chunk_softmax(int n, int nh, int64_t dv, float *m, float *l, float *acc, float *sc)
{
    for (int h = 0; h < nh; h++) {
        float *sq = sc + h * KV__MLA_CHUNK, mx = m[h];
        for (int t = 0; t < n; t++)
            mx = sq[t] > mx ? sq[t] : mx;
        if (mx == -INFINITY) { /* every score -inf (an overflow of q.k): weights 0 */
            memset(sq, 0, (size_t)n * sizeof(float));
            continue;
        }
        const float corr = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
        float sum = 0.0f;
        for (int t = 0; t < n; t++) {
            sq[t] = expf(sq[t] - mx);
            sum += sq[t];
        }
        l[h] = l[h] * corr + sum;
        m[h] = mx;
        if (corr != 1.0f) {
            float *a = acc + (int64_t)h * dv;
            for (int64_t d = 0; d < dv; d++)
                a[d] *= corr;
        }
    }
}

/* Portable scores of nh heads over n rows. */
static void scores_portable(const float *kf, int n, int nh, int64_t D, const float *q, float kmul,
                            float *sc)
{
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < n; t++) {
            const float *qq = q + (int64_t)h * D, *kr = kf + (int64_t)t * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++)
                s += qq[d] * kr[d];
            sc[h * KV__MLA_CHUNK + t] = s * kmul;
        }
}

/* Portable values: acc[h][0..dv) += sum_t w[h][t] kf[t][0..dv). */
static void values_portable(const float *kf, int n, int nh, int64_t D, int64_t dv, float *acc,
                            const float *sc)
{
    for (int h = 0; h < nh; h++) {
        float *a = acc + (int64_t)h * dv;
        for (int t = 0; t < n; t++) {
            const float w = sc[h * KV__MLA_CHUNK + t];
            const float *kr = kf + (int64_t)t * D;
#pragma omp simd
            for (int64_t d = 0; d < dv; d++)
                a[d] += w * kr[d];
        }
    }
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define KV__MLA_AVX2 1
#define KV__AVX2 __attribute__((target("avx2,fma,f16c")))

KV__AVX2 static inline float hsum8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* the four sums of a, b, c, d */
KV__AVX2 static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d)
{
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

/* 8 fp8 bytes as the f16 of their values: each byte to the high byte of a
 * 16-bit lane, where e5m2 is an f16 already (inf and NaN included). For e4m3
 * an arithmetic shift right by one and the mask 0xbf80 leave the f16 of the
 * value times 2^-8 (subnormals included, exact), its NaN (S.1111.111) given
 * the f16 exponent 31: the caller folds the 2^8 into its scale. */
KV__AVX2 static inline __m256 ld8_fp8(kv_dtype dt, const char *p)
{
    const __m128i x =
        _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)(const void *)p));
    if (dt == KV_FP8_E5M2)
        return _mm256_cvtph_ps(x);
    const __m128i nan =
        _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f00)), _mm_set1_epi16(0x7f00));
    const __m128i h = _mm_and_si128(_mm_srai_epi16(x, 1), _mm_set1_epi16((short)0xbf80));
    return _mm256_cvtph_ps(_mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7c00))));
}

/* Rows to f32, 8 at a time (D % 8 == 0): f32, f16 and bf16 exactly; e4m3
 * as the value times 2^-8 (ld8_fp8: the caller's scale is 256 times
 * larger), e5m2 exactly. */
KV__AVX2 static void rows_to_f32_avx2(const struct kv_layout *lo, const char *const *rows, int n,
                                      float *kf)
{
    const int64_t D = lo->head_dim;
    for (int t = 0; t < n; t++) {
        float *o = kf + (int64_t)t * D;
        const char *p = rows[t];
        if (lo->dtype == KV_F32) {
            memcpy(o, p, (size_t)D * sizeof(float));
        } else if (lo->elem_bytes == 1) {
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(o + d, ld8_fp8(lo->dtype, p + d));
        } else if (lo->dtype == KV_F16) {
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_cvtph_ps(_mm_loadu_si128(
                                            (const __m128i *)(const void *)(p + 2 * d))));
        } else {
            for (int64_t d = 0; d < D; d += 8) {
                const __m256i w = _mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)(const void *)(p + 2 * d)));
                _mm256_storeu_ps(o + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
        }
    }
}

KV__AVX2 static void scores_avx2(const float *kf, int n, int nh, int64_t D, const float *q,
                                 float kmul, float *sc)
{
    const __m128 km = _mm_set1_ps(kmul);
    float r[4];
    int h0 = 0;
    for (; h0 + 4 <= nh; h0 += 4) {
        const float *qa = q + (int64_t)h0 * D;
        int t = 0;
        for (; t + 2 <= n; t += 2) {
            const float *k0 = kf + (int64_t)t * D, *k1 = k0 + D;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
                   a30 = a00, a31 = a00;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
                __m256 y = _mm256_loadu_ps(qa + d);
                a00 = _mm256_fmadd_ps(y, x0, a00);
                a01 = _mm256_fmadd_ps(y, x1, a01);
                y = _mm256_loadu_ps(qa + D + d);
                a10 = _mm256_fmadd_ps(y, x0, a10);
                a11 = _mm256_fmadd_ps(y, x1, a11);
                y = _mm256_loadu_ps(qa + 2 * D + d);
                a20 = _mm256_fmadd_ps(y, x0, a20);
                a21 = _mm256_fmadd_ps(y, x1, a21);
                y = _mm256_loadu_ps(qa + 3 * D + d);
                a30 = _mm256_fmadd_ps(y, x0, a30);
                a31 = _mm256_fmadd_ps(y, x1, a31);
            }
            _mm_storeu_ps(r, _mm_mul_ps(hsum4x8(a00, a10, a20, a30), km));
            for (int i = 0; i < 4; i++)
                sc[(h0 + i) * KV__MLA_CHUNK + t] = r[i];
            _mm_storeu_ps(r, _mm_mul_ps(hsum4x8(a01, a11, a21, a31), km));
            for (int i = 0; i < 4; i++)
                sc[(h0 + i) * KV__MLA_CHUNK + t + 1] = r[i];
        }
        for (; t < n; t++) {
            const float *k0 = kf + (int64_t)t * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 x0 = _mm256_loadu_ps(k0 + d);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), x0, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + D + d), x0, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 2 * D + d), x0, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 3 * D + d), x0, a3);
            }
            _mm_storeu_ps(r, _mm_mul_ps(hsum4x8(a0, a1, a2, a3), km));
            for (int i = 0; i < 4; i++)
                sc[(h0 + i) * KV__MLA_CHUNK + t] = r[i];
        }
    }
    for (; h0 < nh; h0++) { /* one head: 4 tokens at a time (4 independent sums) */
        const float *qa = q + (int64_t)h0 * D;
        int t = 0;
        for (; t + 4 <= n; t += 4) {
            const float *k0 = kf + (int64_t)t * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 y = _mm256_loadu_ps(qa + d);
                a0 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k0 + D + d), a1);
                a2 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k0 + 2 * D + d), a2);
                a3 = _mm256_fmadd_ps(y, _mm256_loadu_ps(k0 + 3 * D + d), a3);
            }
            _mm_storeu_ps(r, _mm_mul_ps(hsum4x8(a0, a1, a2, a3), km));
            for (int i = 0; i < 4; i++)
                sc[h0 * KV__MLA_CHUNK + t + i] = r[i];
        }
        for (; t < n; t++) {
            const float *k0 = kf + (int64_t)t * D;
            __m256 a0 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), _mm256_loadu_ps(k0 + d), a0);
            sc[h0 * KV__MLA_CHUNK + t] = hsum8(a0) * kmul;
        }
    }
}

/* acc[h][0..dv) += sum_t w[h][t] kf[t][0..dv) (dv % 8 == 0) */
KV__AVX2 static void values_avx2(const float *kf, int n, int nh, int64_t D, int64_t dv, float *acc,
                                 const float *sc)
{
    int h0 = 0;
    for (; h0 + 4 <= nh; h0 += 4) {
        float *ac = acc + (int64_t)h0 * dv;
        const float *w = sc + h0 * KV__MLA_CHUNK;
        int64_t d = 0;
        for (; d + 16 <= dv; d += 16) {
            __m256 a00 = _mm256_loadu_ps(ac + d), a01 = _mm256_loadu_ps(ac + d + 8);
            __m256 a10 = _mm256_loadu_ps(ac + dv + d), a11 = _mm256_loadu_ps(ac + dv + d + 8);
            __m256 a20 = _mm256_loadu_ps(ac + 2 * dv + d),
                   a21 = _mm256_loadu_ps(ac + 2 * dv + d + 8);
            __m256 a30 = _mm256_loadu_ps(ac + 3 * dv + d),
                   a31 = _mm256_loadu_ps(ac + 3 * dv + d + 8);
            for (int t = 0; t < n; t++) {
                const float *vr = kf + (int64_t)t * D + d;
                const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
                __m256 b = _mm256_broadcast_ss(w + t);
                a00 = _mm256_fmadd_ps(b, v0, a00);
                a01 = _mm256_fmadd_ps(b, v1, a01);
                b = _mm256_broadcast_ss(w + KV__MLA_CHUNK + t);
                a10 = _mm256_fmadd_ps(b, v0, a10);
                a11 = _mm256_fmadd_ps(b, v1, a11);
                b = _mm256_broadcast_ss(w + 2 * KV__MLA_CHUNK + t);
                a20 = _mm256_fmadd_ps(b, v0, a20);
                a21 = _mm256_fmadd_ps(b, v1, a21);
                b = _mm256_broadcast_ss(w + 3 * KV__MLA_CHUNK + t);
                a30 = _mm256_fmadd_ps(b, v0, a30);
                a31 = _mm256_fmadd_ps(b, v1, a31);
            }
            _mm256_storeu_ps(ac + d, a00);
            _mm256_storeu_ps(ac + d + 8, a01);
            _mm256_storeu_ps(ac + dv + d, a10);
            _mm256_storeu_ps(ac + dv + d + 8, a11);
            _mm256_storeu_ps(ac + 2 * dv + d, a20);
            _mm256_storeu_ps(ac + 2 * dv + d + 8, a21);
            _mm256_storeu_ps(ac + 3 * dv + d, a30);
            _mm256_storeu_ps(ac + 3 * dv + d + 8, a31);
        }
        for (; d < dv; d += 8) {
            __m256 a0 = _mm256_loadu_ps(ac + d), a1 = _mm256_loadu_ps(ac + dv + d);
            __m256 a2 = _mm256_loadu_ps(ac + 2 * dv + d), a3 = _mm256_loadu_ps(ac + 3 * dv + d);
            for (int t = 0; t < n; t++) {
                const __m256 v0 = _mm256_loadu_ps(kf + (int64_t)t * D + d);
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + t), v0, a0);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + KV__MLA_CHUNK + t), v0, a1);
                a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 2 * KV__MLA_CHUNK + t), v0, a2);
                a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + 3 * KV__MLA_CHUNK + t), v0, a3);
            }
            _mm256_storeu_ps(ac + d, a0);
            _mm256_storeu_ps(ac + dv + d, a1);
            _mm256_storeu_ps(ac + 2 * dv + d, a2);
            _mm256_storeu_ps(ac + 3 * dv + d, a3);
        }
    }
    for (; h0 < nh; h0++) { /* one head: 32 dims at a time (4 independent sums) */
        float *ac = acc + (int64_t)h0 * dv;
        const float *w = sc + h0 * KV__MLA_CHUNK;
        int64_t d = 0;
        for (; d + 32 <= dv; d += 32) {
            __m256 a0 = _mm256_loadu_ps(ac + d), a1 = _mm256_loadu_ps(ac + d + 8);
            __m256 a2 = _mm256_loadu_ps(ac + d + 16), a3 = _mm256_loadu_ps(ac + d + 24);
            for (int t = 0; t < n; t++) {
                const float *vr = kf + (int64_t)t * D + d;
                const __m256 b = _mm256_broadcast_ss(w + t);
                a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vr), a0);
                a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vr + 8), a1);
                a2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vr + 16), a2);
                a3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vr + 24), a3);
            }
            _mm256_storeu_ps(ac + d, a0);
            _mm256_storeu_ps(ac + d + 8, a1);
            _mm256_storeu_ps(ac + d + 16, a2);
            _mm256_storeu_ps(ac + d + 24, a3);
        }
        for (; d < dv; d += 8) {
            __m256 a0 = _mm256_loadu_ps(ac + d);
            for (int t = 0; t < n; t++)
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + t),
                                     _mm256_loadu_ps(kf + (int64_t)t * D + d), a0);
            _mm256_storeu_ps(ac + d, a0);
        }
    }
}

static bool mla_cpu_has_avx2(void)
{
    static int has = -1; /* benign race: every thread computes the same value */
    if (has < 0) {
        __builtin_cpu_init();
        unsigned a, b, c, d; /* F16C: CPUID leaf 1, ECX bit 29 */
        const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }
    return has == 1;
}
#else
#define KV__MLA_AVX2 0
#endif

bool kv__mla_simd(int64_t D, int64_t dv)
{
#if KV__MLA_AVX2
    return !kv__attn_portable && D % 8 == 0 && dv % 8 == 0 && mla_cpu_has_avx2();
#else
    (void)D, (void)dv;
    return false;
#endif
}

float kv__mla_prepare(const struct kv__attn_job *j, bool simd, float *lut)
{
    const struct kv_layout *lo = &j->cache.layout;
    if (lo->elem_bytes == 1 && !simd)
        for (int i = 0; i < 256; i++)
            lut[i] =
                lo->dtype == KV_FP8_E4M3 ? kv_e4m3_to_f32((uint8_t)i) : kv_e5m2_to_f32((uint8_t)i);
    /* the dequantization scale, in the scores and the values; e4m3 rows
     * converted by rows_to_f32_avx2 hold the values times 2^-8 */
    return (j->k_scale ? j->k_scale[0] : 1.0f) * (simd && lo->dtype == KV_FP8_E4M3 ? 256.0f : 1.0f);
}

void kv__mla_rows(const struct kv_layout *lo, bool simd, const char *const *rows, int n, float *kf,
                  const float *lut)
{
#if KV__MLA_AVX2
    if (simd) {
        rows_to_f32_avx2(lo, rows, n, kf);
        return;
    }
#endif
    (void)simd;
    rows_to_f32(lo, rows, n, kf, lut);
}

void kv__mla_chunk(bool simd, const float *kf, int n, int nh, int64_t D, int64_t dv, const float *q,
                   float kmul, float cap, float *m, float *l, float *acc, float *sc)
{
#if KV__MLA_AVX2
    if (simd)
        scores_avx2(kf, n, nh, D, q, kmul, sc);
    else
#endif
        scores_portable(kf, n, nh, D, q, kmul, sc);
    if (cap > 0.0f)
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < n; t++) {
                float *x = sc + h * KV__MLA_CHUNK + t;
                *x = cap * tanhf(*x / cap);
            }
    chunk_softmax(n, nh, dv, m, l, acc, sc);
#if KV__MLA_AVX2
    if (simd) {
        values_avx2(kf, n, nh, D, dv, acc, sc);
        return;
    }
#endif
    values_portable(kf, n, nh, D, dv, acc, sc);
}

static kv_status exec_mla(const struct kv__attn_job *j)
{
    const struct kv_layout *lo = &j->cache.layout;
    const int64_t D = lo->head_dim, dv = j->mla_dv, S = j->n_seqs, hq = j->q_heads;
    const int64_t pt = j->page_tokens;
    const bool simd = kv__mla_simd(D, dv);
    float lut[256];
    const float ks = kv__mla_prepare(j, simd, lut);
    int64_t total_tokens = 0;
    for (int64_t s = 0; s < S; s++)
        total_tokens += j->seq_tokens[s];
    /* work: the flops of every head over every token, counted as bytes */
    const int nt = kv__attn_threads_for(total_tokens * hq * (D + dv) * 2);
    /* the largest group (a multiple of 4 where it can be) that still leaves
     * two tasks a thread */
    int64_t hg = hq < KV__MLA_GROUP ? hq : KV__MLA_GROUP;
    while (hg > 4 && S * ((hq + hg - 1) / hg) < 2 * (int64_t)nt)
        hg = (hg / 2 + 3) / 4 * 4;
    const int64_t ng = (hq + hg - 1) / hg, tasks = S * ng;
    /* per thread: q [hg][D], acc [hg][dv], m, l [hg], sc [hg][CHUNK], kf [CHUNK][D] */
    const size_t per =
        ((size_t)(hg * D + hg * dv + 2 * hg + hg * KV__MLA_CHUNK + KV__MLA_CHUNK * D) *
             sizeof(float) +
         63) /
        64 * 64;
    float *scratch = kv__mem_alloc_aligned(64, per * (size_t)nt);
    if (!scratch)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %zu bytes of scratch", j->fn, per * (size_t)nt);
#pragma omp parallel num_threads(nt)
    {
        float *q = (float *)(void *)((char *)scratch + (size_t)omp_get_thread_num() * per);
        float *acc = q + hg * D, *m = acc + hg * dv, *l = m + hg, *sc = l + hg;
        float *kf = sc + hg * KV__MLA_CHUNK;
        const char *rows[KV__MLA_CHUNK];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / ng, h0 = task % ng * hg;
            const int nh = (int)(hq - h0 < hg ? hq - h0 : hg);
            for (int h = 0; h < nh; h++) {
                const char *qp = j->q.base + s * j->q.token_stride + (h0 + h) * j->q.head_stride;
                float *qq = q + (int64_t)h * D;
                for (int64_t d = 0; d < D; d++)
                    qq[d] = kv_to_f32(j->q.dtype, qp + d * j->q.dim_stride) * j->softmax_scale;
                m[h] = -INFINITY;
                l[h] = 0.0f;
            }
            memset(acc, 0, (size_t)(nh * dv) * sizeof(float));
            const int64_t len = j->seq_tokens[s];
            const int32_t *pages = j->page_ids + j->page_start[s];
            for (int64_t t0 = 0; t0 < len; t0 += KV__MLA_CHUNK) {
                const int n = (int)(len - t0 < KV__MLA_CHUNK ? len - t0 : KV__MLA_CHUNK);
                for (int t = 0; t < n; t++) {
                    const int64_t tok = t0 + t;
                    const int64_t slot = kv_attn_page_slot(pages[tok / pt], pt, tok % pt);
                    rows[t] = (const char *)j->cache.base +
                              kv_layout_slot_offset_bytes(lo, j->layer0, 0, slot);
                }
                kv__mla_rows(lo, simd, rows, n, kf, lut);
                kv__mla_chunk(simd, kf, n, nh, D, dv, q, ks, 0.0f, m, l, acc, sc);
            }
            for (int h = 0; h < nh; h++) {
                char *op = j->out.base + s * j->out.token_stride + (h0 + h) * j->out.head_stride;
                const float inv = l[h] > 0.0f ? ks / l[h] : 0.0f; /* no tokens: zeros */
                const float *a = acc + (int64_t)h * dv;
                for (int64_t d = 0; d < dv; d++)
                    kv_from_f32(j->out.dtype, a[d] * inv, op + d * j->out.dim_stride);
            }
        }
    }
    kv__mem_free(scratch);
    return KV_OK;
}

kv_status kv_attn_decode_mla(struct kv_paged_cache cache, uint32_t layer, const struct kv_view *q,
                             const struct kv_pages *pages, int64_t dv, float softmax_scale,
                             const struct kv_scales *scales, const struct kv_view *out)
{
    struct kv__attn_job j;
    kv_status st = kv__attn_decode_mla_check("kv_attn_decode_mla", &cache, layer, q, pages, dv,
                                             softmax_scale, scales, out, &j);
    if (st != KV_OK)
        return st;
    st = exec_mla(&j);
    if (st == KV_OK)
        kv__attn_count(&j, false);
    kv__attn_job_free(&j);
    return st == KV_OK ? kv__ok() : st;
}
