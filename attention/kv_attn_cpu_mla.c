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
 * plain loops. Where q is bf16 and the CPU has AVX512_BF16, the scores are
 * bf16 dot products (kv__scores_bf16dot, kv_attn_x86_int.h) and the values 16 lanes wide
 * (values_avx512); the softmax's exponentials are 8 lanes wide on every
 * SIMD path (docs/kernels.md).
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
#include "kv_attn_x86_int.h"
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

/* Whether fp8 rows go through the byte tables (kv_attn_x86_int.h: exact,
 * 64 elements a step, e4m3 unfolded) rather than F16C: a CPU with
 * AVX512_VBMI, kv__attn_avx2_only and kv__attn_fp8_via_f16 not set. The
 * first call comes from kv__mla_prepare, before any parallel region. */
static bool mla_fp8_tables(const struct kv_layout *lo)
{
    return lo->elem_bytes == 1 && !kv__attn_avx2_only && !kv__attn_fp8_via_f16 &&
           kv__cpu_has_fp8bf16();
}

/* fp8 rows to f32 through the tables, 64 elements a step (a row's last D %
 * 64 through a masked load and masked stores). */
KV__FP8BF16 static void fp8_rows_to_f32_tables(const struct kv_layout *lo, const char *const *rows,
                                               int n, float *kf)
{
    struct kv__fp8f32 c;
    kv__fp8f32_init(&c, lo->dtype == KV_FP8_E5M2);
    const int64_t D = lo->head_dim;
    for (int t = 0; t < n; t++) {
        float *o = kf + (int64_t)t * D;
        const char *p = rows[t];
        for (int64_t d = 0; d < D; d += 64) {
            const int64_t r = D - d < 64 ? D - d : 64;
            const __mmask64 lm = r == 64 ? ~0ull : (1ull << r) - 1;
            const __m512i x = _mm512_maskz_loadu_epi8(lm, p + d);
            __m512 v[4];
            KV__FP8F32_4(&c, x, v[0], v[1], v[2], v[3]);
            for (int k = 0; k < 4 && 16 * k < r; k++) {
                const int64_t rk = r - 16 * k < 16 ? r - 16 * k : 16;
                _mm512_mask_storeu_ps(o + d + 16 * k, (__mmask16)((1u << rk) - 1), v[k]);
            }
        }
    }
}

/* Rows to f32, 8 at a time (D % 8 == 0): f32, f16 and bf16 exactly; e4m3
 * as the value times 2^-8 (ld8_fp8: the caller's scale is 256 times
 * larger), e5m2 exactly; fp8 through the tables (exact) where
 * mla_fp8_tables. */
KV__AVX2 static void rows_to_f32_avx2(const struct kv_layout *lo, const char *const *rows, int n,
                                      float *kf)
{
    const int64_t D = lo->head_dim;
    if (mla_fp8_tables(lo)) {
        fp8_rows_to_f32_tables(lo, rows, n, kf);
        return;
    }
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

/* acc[h][d0..dv) += sum_t w[h][t] kf[t][d0..dv) (dv % 8 == 0, d0 % 16 == 0) */
KV__AVX2 static void values_avx2_part(const float *kf, int n, int nh, int64_t D, int64_t dv,
                                      int64_t d0, float *acc, const float *sc)
{
    int h0 = 0;
    for (; h0 + 4 <= nh; h0 += 4) {
        float *ac = acc + (int64_t)h0 * dv;
        const float *w = sc + h0 * KV__MLA_CHUNK;
        int64_t d = d0;
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
        int64_t d = d0;
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

KV__AVX2 static void values_avx2(const float *kf, int n, int nh, int64_t D, int64_t dv, float *acc,
                                 const float *sc)
{
    values_avx2_part(kf, n, nh, D, dv, 0, acc, sc);
}

/* chunk_softmax with the exponentials 8 lanes at a time (exp8_nonpos, a
 * few float ulps; a tail of fewer than 8 through the same function, padded
 * with -inf), so a weight does not depend on where its chunk ends. One
 * expf a head a chunk (the rescale) stays scalar. Measured: the scalar expf
 * of every (head, token) cost as much as its bf16 scores. */
KV__AVX2 static void chunk_softmax_avx2(int n, int nh, int64_t dv, float *m, float *l, float *acc,
                                        float *sc)
{
    for (int h = 0; h < nh; h++) {
        float *sq = sc + h * KV__MLA_CHUNK, mx = m[h];
        int t = 0;
        if (n >= 8) { /* the max 8 lanes at a time (exact in any order) */
            __m256 x = _mm256_loadu_ps(sq);
            for (t = 8; t + 8 <= n; t += 8)
                x = _mm256_max_ps(x, _mm256_loadu_ps(sq + t));
            const float cm = hmax8(x);
            mx = cm > mx ? cm : mx;
        }
        for (; t < n; t++)
            mx = sq[t] > mx ? sq[t] : mx;
        if (mx == -INFINITY) { /* every score -inf (an overflow of q.k): weights 0 */
            memset(sq, 0, (size_t)n * sizeof(float));
            continue;
        }
        const float corr = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
        const __m256 mx8 = _mm256_set1_ps(mx);
        __m256 s8 = _mm256_setzero_ps();
        for (t = 0; t + 8 <= n; t += 8) {
            const __m256 e8 = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sq + t), mx8));
            s8 = _mm256_add_ps(s8, e8);
            _mm256_storeu_ps(sq + t, e8);
        }
        if (t < n) {
            float x[8];
            for (int i = 0; i < 8; i++)
                x[i] = t + i < n ? sq[t + i] : -INFINITY;
            const __m256 e8 = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(x), mx8));
            s8 = _mm256_add_ps(s8, e8);
            _mm256_storeu_ps(x, e8);
            memcpy(sq + t, x, (size_t)(n - t) * sizeof(float));
        }
        l[h] = l[h] * corr + hsum8(s8);
        m[h] = mx;
        if (corr != 1.0f)
            scale8(acc + (int64_t)h * dv, dv, corr);
    }
}

#define KV__MLA_PV2(R)                                                                             \
    b = _mm512_set1_ps(w[(R)*KV__MLA_CHUNK + t]);                                                  \
    a##R##0 = _mm512_fmadd_ps(b, v0, a##R##0);                                                     \
    a##R##1 = _mm512_fmadd_ps(b, v1, a##R##1)

/* values_avx2 for 16 lanes: 4 heads x 32 dims a block, every sum in the same
 * order (lane by lane, token after token), so the results are the same
 * bits; half the instructions (one FMA per 16 multiply-adds). */
KV__BF16DOT static void values_avx512(const float *kf, int n, int nh, int64_t D, int64_t dv,
                                      float *acc, const float *sc)
{
    int h0 = 0;
    const int64_t dz = dv / 32 * 32;
    for (; h0 + 4 <= nh; h0 += 4) {
        float *ac = acc + (int64_t)h0 * dv;
        const float *w = sc + h0 * KV__MLA_CHUNK;
        for (int64_t d = 0; d < dz; d += 32) {
            float *c0 = ac + d, *c1 = c0 + dv, *c2 = c1 + dv, *c3 = c2 + dv;
            __m512 a00 = _mm512_loadu_ps(c0), a01 = _mm512_loadu_ps(c0 + 16);
            __m512 a10 = _mm512_loadu_ps(c1), a11 = _mm512_loadu_ps(c1 + 16);
            __m512 a20 = _mm512_loadu_ps(c2), a21 = _mm512_loadu_ps(c2 + 16);
            __m512 a30 = _mm512_loadu_ps(c3), a31 = _mm512_loadu_ps(c3 + 16);
            for (int t = 0; t < n; t++) {
                const float *vr = kf + (int64_t)t * D + d;
                const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
                __m512 b;
                KV__MLA_PV2(0);
                KV__MLA_PV2(1);
                KV__MLA_PV2(2);
                KV__MLA_PV2(3);
            }
            _mm512_storeu_ps(c0, a00), _mm512_storeu_ps(c0 + 16, a01);
            _mm512_storeu_ps(c1, a10), _mm512_storeu_ps(c1 + 16, a11);
            _mm512_storeu_ps(c2, a20), _mm512_storeu_ps(c2 + 16, a21);
            _mm512_storeu_ps(c3, a30), _mm512_storeu_ps(c3 + 16, a31);
        }
    }
    /* the dims past dz, and the heads past the last 4: values_avx2's loops */
    if (dz < dv)
        for (int h = 0; h < h0; h += 4)
            values_avx2_part(kf, n, 4, D, dv, dz, acc + (int64_t)h * dv, sc + h * KV__MLA_CHUNK);
    if (h0 < nh)
        values_avx2_part(kf, n, nh - h0, D, dv, 0, acc + (int64_t)h0 * dv, sc + h0 * KV__MLA_CHUNK);
}

/* kf's rows (f32, exact in bf16) to bf16 rows kbuf [n][D] (D % 16 == 0) */
KV__BF16DOT static void f32_rows_to_bf16(const float *kf, int n, int64_t D, uint16_t *kbuf)
{
    for (int64_t i = 0; i < (int64_t)n * D; i += 16)
        _mm256_storeu_si256((__m256i *)(void *)(kbuf + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(kf + i)));
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
     * converted by rows_to_f32_avx2 through F16C hold the values times 2^-8 */
    bool fold = simd && lo->dtype == KV_FP8_E4M3;
#if KV__MLA_AVX2
    fold = fold && !mla_fp8_tables(lo);
#endif
    return (j->k_scale ? j->k_scale[0] : 1.0f) * (fold ? 256.0f : 1.0f);
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

bool kv__mla_bdot_ok(const struct kv__attn_job *j, bool simd)
{
#if KV__MLA_AVX2
    const struct kv_layout *lo = &j->cache.layout;
    return simd && !kv__attn_avx2_only && j->q.dtype == KV_BF16 &&
           (lo->dtype == KV_BF16 || lo->elem_bytes == 1) && lo->head_dim % 32 == 0 &&
           kv__cpu_has_bf16dot();
#else
    (void)j, (void)simd;
    return false;
#endif
}

void kv__mla_rows_bf16(const struct kv_layout *lo, const char *const *rows, int n, const float *kf,
                       uint16_t *kbuf, const uint16_t **kb)
{
    if (lo->dtype == KV_BF16) {
        for (int t = 0; t < n; t++)
            kb[t] = (const uint16_t *)(const void *)rows[t];
        return;
    }
#if KV__MLA_AVX2
    if (mla_fp8_tables(lo)) /* the same bf16, from the bytes */
        for (int t = 0; t < n; t++)
            kv__fp8_rows_to_bf16(lo->dtype == KV_FP8_E5M2, kbuf + (int64_t)t * lo->head_dim, 0,
                                 (const uint8_t *)rows[t], 0, 1, lo->head_dim);
    else
        f32_rows_to_bf16(kf, n, lo->head_dim, kbuf);
#else
    (void)kf; /* not reached: kv__mla_bdot_ok is false */
#endif
    for (int t = 0; t < n; t++)
        kb[t] = kbuf + (int64_t)t * lo->head_dim;
}

void kv__mla_chunk(bool simd, const float *kf, int n, int nh, int64_t D, int64_t dv, const float *q,
                   float kmul, const struct kv__mla_bdot *bd, float cap, float *m, float *l,
                   float *acc, float *sc)
{
#if KV__MLA_AVX2
    if (bd)
        kv__scores_bf16dot(bd->kb, n, nh, D, bd->qb, bd->kmul, sc, KV__MLA_CHUNK);
    else if (simd)
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
#if KV__MLA_AVX2
    if (simd)
        chunk_softmax_avx2(n, nh, dv, m, l, acc, sc);
    else
#endif
        chunk_softmax(n, nh, dv, m, l, acc, sc);
#if KV__MLA_AVX2
    if (bd) {
        values_avx512(kf, n, nh, D, dv, acc, sc);
        return;
    }
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
    const bool simd = kv__mla_simd(D, dv), bdot = kv__mla_bdot_ok(j, simd);
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
    /* per thread: q [hg][D], acc [hg][dv], m, l [hg], sc [hg][CHUNK], kf [CHUNK][D];
     * with bdot also qb [hg][D] and kbuf [CHUNK][D] bf16 */
    const size_t per =
        ((size_t)(hg * D + hg * dv + 2 * hg + hg * KV__MLA_CHUNK + KV__MLA_CHUNK * D) *
             sizeof(float) +
         (bdot ? (size_t)(hg * D + KV__MLA_CHUNK * D) * sizeof(uint16_t) : 0) + 63) /
        64 * 64;
    float *scratch = kv__mem_alloc_aligned(64, per * (size_t)nt);
    if (!scratch)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %zu bytes of scratch", j->fn, per * (size_t)nt);
#pragma omp parallel num_threads(nt)
    {
        float *q = (float *)(void *)((char *)scratch + (size_t)omp_get_thread_num() * per);
        float *acc = q + hg * D, *m = acc + hg * dv, *l = m + hg, *sc = l + hg;
        float *kf = sc + hg * KV__MLA_CHUNK;
        uint16_t *qb = (uint16_t *)(void *)(kf + KV__MLA_CHUNK * D), *kbuf = qb + hg * D;
        const char *rows[KV__MLA_CHUNK];
        const uint16_t *kb[KV__MLA_CHUNK];
        const struct kv__mla_bdot bd = {qb, kb, j->softmax_scale * ks};
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / ng, h0 = task % ng * hg;
            const int nh = (int)(hq - h0 < hg ? hq - h0 : hg);
            for (int h = 0; h < nh; h++) {
                const char *qp = j->q.base + s * j->q.token_stride + (h0 + h) * j->q.head_stride;
                float *qq = q + (int64_t)h * D;
                if (bdot) /* q's bf16 as it is: the scale goes into bd.kmul */
                    for (int64_t d = 0; d < D; d++)
                        memcpy(qb + (int64_t)h * D + d, qp + d * j->q.dim_stride, 2);
                else
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
                if (bdot)
                    kv__mla_rows_bf16(lo, rows, n, kf, kbuf, kb);
                kv__mla_chunk(simd, kf, n, nh, D, dv, q, ks, bdot ? &bd : NULL, 0.0f, m, l, acc,
                              sc);
            }
            for (int h = 0; h < nh; h++) {
                char *op = j->out.base + s * j->out.token_stride + (h0 + h) * j->out.head_stride;
                const float inv = l[h] != 0.0f ? ks / l[h] : 0.0f; /* no tokens: zeros */
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
