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
 * (as expf underflows there), a NaN gives NaN (as expf: a NaN score, from a
 * NaN in K, makes its row NaN instead of vanishing). */
KV__AVX2 static inline __m256 exp8_nonpos(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q); /* a NaN score stays NaN */
    const __m256 x0 = x;
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
    return _mm256_blendv_ps(_mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e))), x0,
                            nan);
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

/* ---- fp8 rows to bf16 (AVX512_VBMI) ----------------------------------------------
 *
 * Every e4m3 and e5m2 value is exact in bf16 (3 and 2 mantissa bits; the
 * exponents, subnormals included, inside bf16's normal range), so an fp8
 * row converted to bf16 serves the bf16 dot products and the bf16 values
 * as it is. The conversion is two 128-entry byte tables, the bf16's high
 * and low byte of each magnitude (the byte's low 7 bits), looked up 64 at a
 * time (VPERMI2B takes exactly those 7 bits), the sign ORed into the high
 * byte, and the two halves interleaved into 16-bit lanes (two more
 * permutes): 4 permutes and 1 logic op for 64 elements, where the f16 route
 * (widen, shift, mask; f16 to f32 to bf16 for K) takes about 3 times the
 * instructions. NaN (e4m3 S.1111.111, e5m2 S.11111.xx with xx != 0) becomes
 * the quiet bf16 NaN of its sign, e5m2 infinity the bf16 infinity. */
#define KV__FP8BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi")))

/* bf16 bits of the e4m3 magnitude m (0..127): normals (e = m >> 3 > 0)
 * rebias 7 -> 127; subnormals f * 2^-9 (f = m & 7) normalized */
#define KV__E4M3_SUB(f)                                                                            \
    ((f) == 0   ? 0                                                                                \
     : (f) == 1 ? 118 << 7                                                                         \
     : (f) < 4  ? (119 << 7 | ((f)-2) << 6)                                                        \
                : (120 << 7 | ((f)-4) << 5))
#define KV__E4M3_BF16(m)                                                                           \
    ((m) == 0x7f ? 0x7fc0 : (m) >= 8 ? (((m) >> 3) + 120) << 7 | ((m)&7) << 4 : KV__E4M3_SUB(m))
/* bf16 bits of the e5m2 magnitude m: normals rebias 15 -> 127, e = 31
 * infinity (f = 0) or NaN; subnormals f * 2^-16 (f = m & 3) normalized */
#define KV__E5M2_SUB(f)                                                                            \
    ((f) == 0 ? 0 : (f) == 1 ? 111 << 7 : (f) == 2 ? 112 << 7 : (112 << 7 | 1 << 6))
#define KV__E5M2_BF16(m)                                                                           \
    ((m) >= 0x7c ? ((m) == 0x7c ? 0x7f80 : 0x7fc0)                                                 \
     : (m) >= 4  ? (((m) >> 2) + 112) << 7 | ((m)&3) << 5                                          \
                 : KV__E5M2_SUB(m))
#define KV__HI8(x) (uint8_t)((x) >> 8)
#define KV__LO8(x) (uint8_t)((x)&0xff)
#define KV__T8(F, B, m)                                                                            \
    B(F(m)), B(F((m) + 1)), B(F((m) + 2)), B(F((m) + 3)), B(F((m) + 4)), B(F((m) + 5)),            \
        B(F((m) + 6)), B(F((m) + 7))
#define KV__T128(F, B)                                                                             \
    KV__T8(F, B, 0), KV__T8(F, B, 8), KV__T8(F, B, 16), KV__T8(F, B, 24), KV__T8(F, B, 32),        \
        KV__T8(F, B, 40), KV__T8(F, B, 48), KV__T8(F, B, 56), KV__T8(F, B, 64), KV__T8(F, B, 72),  \
        KV__T8(F, B, 80), KV__T8(F, B, 88), KV__T8(F, B, 96), KV__T8(F, B, 104),                   \
        KV__T8(F, B, 112), KV__T8(F, B, 120)

/* The tables of e4m3 (e5m2 false) or e5m2: [0] the high bytes, [1] the low. */
static inline const uint8_t (*kv__fp8_bf16_tables(bool e5m2))[128]
{
    static const uint8_t t[2][2][128] __attribute__((aligned(64))) = {
        {{KV__T128(KV__E4M3_BF16, KV__HI8)}, {KV__T128(KV__E4M3_BF16, KV__LO8)}},
        {{KV__T128(KV__E5M2_BF16, KV__HI8)}, {KV__T128(KV__E5M2_BF16, KV__LO8)}}};
    return t[e5m2];
}

/* The tables in registers, and the sign bit of every byte. */
struct kv__fp8t {
    __m512i h0, h1, l0, l1, sign;
};
KV__FP8BF16 static inline void kv__fp8t_load(struct kv__fp8t *c, bool e5m2)
{
    const uint8_t(*t)[128] = kv__fp8_bf16_tables(e5m2);
    c->h0 = _mm512_load_si512((const void *)t[0]);
    c->h1 = _mm512_load_si512((const void *)(t[0] + 64));
    c->l0 = _mm512_load_si512((const void *)t[1]);
    c->l1 = _mm512_load_si512((const void *)(t[1] + 64));
    c->sign = _mm512_set1_epi8((char)0x80);
}
/* The bf16 high bytes (sign included) and low bytes of 64 fp8 bytes b. */
KV__FP8BF16 static inline void kv__fp8t_hilo(const struct kv__fp8t *c, __m512i b, __m512i *hi,
                                             __m512i *lo)
{
    *hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(c->h0, b, c->h1), b, c->sign, 0xf8);
    *lo = _mm512_permutex2var_epi8(c->l0, b, c->l1);
}

/* n rows of D fp8 values (D % 32 == 0): row i from src + i * sstep (bytes)
 * to dst + i * dstep (elements) as bf16, exactly; a row's last 32 elements
 * (D % 64 == 32) through a masked load and one store. */
KV__FP8BF16 static inline void kv__fp8_rows_to_bf16(bool e5m2, uint16_t *dst, int64_t dstep,
                                                    const uint8_t *src, int64_t sstep, int64_t n,
                                                    int64_t D)
{
    struct kv__fp8t c;
    kv__fp8t_load(&c, e5m2);
    /* output byte 2k: the low byte of element k (lo[k]), 2k + 1: its high
     * byte (hi[k], index 64 + k); the second half from element 32 */
    const __m512i w0 = _mm512_set_epi16(
        0x5f1f, 0x5e1e, 0x5d1d, 0x5c1c, 0x5b1b, 0x5a1a, 0x5919, 0x5818, 0x5717, 0x5616, 0x5515,
        0x5414, 0x5313, 0x5212, 0x5111, 0x5010, 0x4f0f, 0x4e0e, 0x4d0d, 0x4c0c, 0x4b0b, 0x4a0a,
        0x4909, 0x4808, 0x4707, 0x4606, 0x4505, 0x4404, 0x4303, 0x4202, 0x4101, 0x4000);
    const __m512i w1 = _mm512_add_epi8(w0, _mm512_set1_epi8(32));
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = src + i * sstep;
        uint16_t *o = dst + i * dstep;
        for (int64_t d = 0; d < D; d += 64) {
            const bool half = D - d == 32; /* 32 left */
            const __m512i b = half ? _mm512_maskz_loadu_epi8(0xffffffffull, s + d)
                                   : _mm512_loadu_si512((const void *)(s + d));
            __m512i hi, lo;
            kv__fp8t_hilo(&c, b, &hi, &lo);
            _mm512_storeu_si512((void *)(o + d), _mm512_permutex2var_epi8(lo, w0, hi));
            if (!half)
                _mm512_storeu_si512((void *)(o + d + 32), _mm512_permutex2var_epi8(lo, w1, hi));
        }
    }
}

/* 64 fp8 values to 4 x 16 f32 in registers, for loops that take fp8 rows
 * in place: the same tables, the bf16 in each 32-bit lane's high half
 * (zeros below, by the mask of a masked permute), element 16j + k in lane
 * k of vector j. */
struct kv__fp8f32 {
    struct kv__fp8t t;
    __m512i x0, x1, x2, x3;
};
KV__FP8BF16 static inline void kv__fp8f32_init(struct kv__fp8f32 *c, bool e5m2)
{
    kv__fp8t_load(&c->t, e5m2);
    /* lane k of vector j: byte 2 lo[16j + k], byte 3 hi[16j + k] (64 + 16j + k) */
    c->x0 = _mm512_set_epi32(0x4f0f0000, 0x4e0e0000, 0x4d0d0000, 0x4c0c0000, 0x4b0b0000, 0x4a0a0000,
                             0x49090000, 0x48080000, 0x47070000, 0x46060000, 0x45050000, 0x44040000,
                             0x43030000, 0x42020000, 0x41010000, 0x40000000);
    const __m512i q16 = _mm512_set1_epi32(0x10100000);
    c->x1 = _mm512_add_epi8(c->x0, q16);
    c->x2 = _mm512_add_epi8(c->x1, q16);
    c->x3 = _mm512_add_epi8(c->x2, q16);
}
#define KV__FP8F32_HI16 ((__mmask64)0xccccccccccccccccull)
#define KV__FP8F32_4(c, b, v0, v1, v2, v3)                                                         \
    do {                                                                                           \
        __m512i hi_, lo_;                                                                          \
        kv__fp8t_hilo(&(c)->t, b, &hi_, &lo_);                                                     \
        v0 = _mm512_castsi512_ps(                                                                  \
            _mm512_maskz_permutex2var_epi8(KV__FP8F32_HI16, lo_, (c)->x0, hi_));                   \
        v1 = _mm512_castsi512_ps(                                                                  \
            _mm512_maskz_permutex2var_epi8(KV__FP8F32_HI16, lo_, (c)->x1, hi_));                   \
        v2 = _mm512_castsi512_ps(                                                                  \
            _mm512_maskz_permutex2var_epi8(KV__FP8F32_HI16, lo_, (c)->x2, hi_));                   \
        v3 = _mm512_castsi512_ps(                                                                  \
            _mm512_maskz_permutex2var_epi8(KV__FP8F32_HI16, lo_, (c)->x3, hi_));                   \
    } while (0)

static inline bool kv__cpu_has_fp8bf16(void)
{
    static int has = -1; /* benign race: every thread computes the same value */
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
    }
    return has == 1;
}

#endif
#endif /* KV_ATTN_X86_INT_H */
