/*
 * kv_attn_x86_int.h - AVX2/FMA helpers shared by the CPU attention kernels
 * (module-private; x86-64 with GCC or clang only, chosen at run time by the
 * caller: every function here carries its own target attribute).
 */
#ifndef KV_ATTN_X86_INT_H
#define KV_ATTN_X86_INT_H

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
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

#endif
#endif /* KV_ATTN_X86_INT_H */
