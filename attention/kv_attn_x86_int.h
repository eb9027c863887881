/*
 * kv_attn_x86_int.h - AVX2/FMA helpers shared by the CPU attention kernels
 * (module-private; x86-64 with GCC or clang only, chosen at run time by the
 * caller: every function here carries its own target attribute).
 */
#ifndef KV_ATTN_X86_INT_H
#define KV_ATTN_X86_INT_H

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#define KV__AVX2 __attribute__((target("avx2,fma,f16c")))

KV__AVX2 static inline float hsum8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* the largest of v's 8 lanes */
KV__AVX2 static inline float hmax8(__m256 v)
{
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    y = _mm_max_ss(y, _mm_movehdup_ps(y));
    return _mm_cvtss_f32(y);
}

/* a[0..n) *= c (n % 8 == 0): an online softmax's rescale of a row */
KV__AVX2 static inline void scale8(float *a, int64_t n, float c)
{
    const __m256 c8 = _mm256_set1_ps(c);
    for (int64_t d = 0; d < n; d += 8)
        _mm256_storeu_ps(a + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), c8));
}

/* the four sums of a, b, c, d */
KV__AVX2 static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d)
{
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

/* e^x for x <= 0 (a score minus the running max), 8 lanes: x = k ln2 + r,
 * |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative error below 2e-7,
 * a few float ulps), times 2^k through the exponent bits; x < -87 gives 0
 * (as expf underflows there). */
KV__AVX2 static inline __m256 exp8_nonpos(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* ---- scores by bf16 dot products (AVX512_BF16) -----------------------------------
 *
 * Where q is bf16 and the cache's rows are exact in bf16 (bf16, e4m3, e5m2),
 * VDPBF16PS takes 32 bf16 pairs an instruction into 16 f32 sums: twice the
 * multiply-adds of an f32 FMA at the same issue rate (measured on AMD EPYC
 * Zen 4: 3.65 G instructions/s each, one core). Each product of two bf16 is
 * exact in f32 and the sums are f32, so the scores lose nothing against
 * converting q and K to f32 first (q is left unscaled: the caller's kmul
 * carries softmax_scale). The values stay f32 FMAs: their weights are not
 * bf16. The sum of one (head, token) is its 16 lanes over D / 32 steps,
 * then the lanes in one fixed tree (i + 8, i + 4, i + 2, i + 1) whether it
 * was computed in a 4 x 4 block or alone, so a score does not depend on
 * the blocking (the prefill's rows and the decode's agree bit for bit). */
#define KV__BF16DOT __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))

KV__BF16DOT static inline __m512bh ld32_bf16(const uint16_t *p)
{
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* the lane sum of x in the fixed tree */
KV__BF16DOT static inline float hsum16_tree(__m512 x)
{
    const __m256 y8 =
        _mm256_add_ps(_mm512_castps512_ps256(x),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    const __m128 y4 = _mm_add_ps(_mm256_castps256_ps128(y8), _mm256_extractf128_ps(y8, 1));
    const __m128 y2 = _mm_add_ps(y4, _mm_movehl_ps(y4, y4));
    return _mm_cvtss_f32(_mm_add_ss(y2, _mm_movehdup_ps(y2)));
}

/* the lane sums of a0..a15 in the same tree, as one vector: lane 4c + b
 * holds a(4b + c)'s sum (a 4 x 4 transpose of the inputs' order) */
#define KV__BD_R1(a, b)                                                                            \
    _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee))
#define KV__BD_R2(a, b)                                                                            \
    _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd))
#define KV__BD_R3(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee))
#define KV__BD_R4(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xdd))

/* One (head, token) score alone. */
KV__BF16DOT static inline float dot1_bf16(const uint16_t *q, const uint16_t *k, int64_t D)
{
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32)
        a = _mm512_dpbf16_ps(a, ld32_bf16(q + d), ld32_bf16(k + d));
    return hsum16_tree(a);
}

#define KV__BD_DP4(H, y)                                                                           \
    a##H##0 = _mm512_dpbf16_ps(a##H##0, y, x0);                                                    \
    a##H##1 = _mm512_dpbf16_ps(a##H##1, y, x1);                                                    \
    a##H##2 = _mm512_dpbf16_ps(a##H##2, y, x2);                                                    \
    a##H##3 = _mm512_dpbf16_ps(a##H##3, y, x3)

/* sc[h][t] = kmul * qb[h] . kb[t] for nh heads over n rows (D % 32 == 0):
 * 4 heads x 4 rows a block (16 accumulators, 4 K and 4 q loads per 16
 * instructions), the rest one at a time. */
KV__BF16DOT static inline void kv__scores_bf16dot(const uint16_t *const *kb, int n, int nh,
                                                  int64_t D, const uint16_t *qb, float kmul,
                                                  float *sc, int ldc)
{
    const __m512 km = _mm512_set1_ps(kmul);
    /* lane 4t + h of the reduced block -> lane 4h + t */
    const __m512i tr = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    int h0 = 0;
    for (; h0 + 4 <= nh; h0 += 4) {
        const uint16_t *q0 = qb + (int64_t)h0 * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
        int t = 0;
        for (; t + 4 <= n; t += 4) {
            const uint16_t *k0 = kb[t], *k1 = kb[t + 1], *k2 = kb[t + 2], *k3 = kb[t + 3];
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00,
                   a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00,
                   a31 = a00, a32 = a00, a33 = a00;
            for (int64_t d = 0; d < D; d += 32) {
                const __m512bh x0 = ld32_bf16(k0 + d), x1 = ld32_bf16(k1 + d),
                               x2 = ld32_bf16(k2 + d), x3 = ld32_bf16(k3 + d);
                KV__BD_DP4(0, ld32_bf16(q0 + d));
                KV__BD_DP4(1, ld32_bf16(q1 + d));
                KV__BD_DP4(2, ld32_bf16(q2 + d));
                KV__BD_DP4(3, ld32_bf16(q3 + d));
            }
            /* accumulator 4h + t is a<h><t>: the reduced lane 4t + h */
            const __m512 v0 = KV__BD_R1(a00, a01), v1 = KV__BD_R1(a02, a03),
                         v2 = KV__BD_R1(a10, a11), v3 = KV__BD_R1(a12, a13),
                         v4 = KV__BD_R1(a20, a21), v5 = KV__BD_R1(a22, a23),
                         v6 = KV__BD_R1(a30, a31), v7 = KV__BD_R1(a32, a33);
            const __m512 u0 = KV__BD_R2(v0, v1), u1 = KV__BD_R2(v2, v3), u2 = KV__BD_R2(v4, v5),
                         u3 = KV__BD_R2(v6, v7);
            const __m512 z0 = KV__BD_R3(u0, u1), z1 = KV__BD_R3(u2, u3);
            const __m512 f = _mm512_permutexvar_ps(tr, _mm512_mul_ps(KV__BD_R4(z0, z1), km));
            _mm_storeu_ps(sc + (h0 + 0) * ldc + t, _mm512_castps512_ps128(f));
            _mm_storeu_ps(sc + (h0 + 1) * ldc + t, _mm512_extractf32x4_ps(f, 1));
            _mm_storeu_ps(sc + (h0 + 2) * ldc + t, _mm512_extractf32x4_ps(f, 2));
            _mm_storeu_ps(sc + (h0 + 3) * ldc + t, _mm512_extractf32x4_ps(f, 3));
        }
        for (; t < n; t++)
            for (int h = 0; h < 4; h++)
                sc[(h0 + h) * ldc + t] = dot1_bf16(q0 + h * D, kb[t], D) * kmul;
    }
    for (; h0 < nh; h0++)
        for (int t = 0; t < n; t++)
            sc[h0 * ldc + t] = dot1_bf16(qb + (int64_t)h0 * D, kb[t], D) * kmul;
}

static inline bool kv__cpu_has_bf16dot(void)
{
    static int has = -1; /* benign race: every thread computes the same value */
    if (has < 0) {
        __builtin_cpu_init(); /* libgcc checks the OS saves the AVX-512 state (XCR0) */
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    }
    return has == 1;
}

#endif
#endif /* KV_ATTN_X86_INT_H */
