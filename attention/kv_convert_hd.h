/*
 * kv_convert_hd.h - element conversions the attention kernels share, CPU and
 * CUDA (KV_HD: __host__ __device__ under nvcc, static inline in C): the CPU
 * executors, the CUDA kernels and the tests run this exact code.
 *
 * The rules (docs/kernels.md repeats them):
 *   - every narrowing conversion rounds to nearest, ties to even (RNE);
 *   - f16, bf16: IEEE behaviour: subnormals kept, overflow rounds to +-inf,
 *     a NaN stays a NaN (quiet, sign and top payload bits kept), never inf;
 *   - fp8 e4m3fn (OCP FP8 E4M3, "fn": no infinities): bias 7, 3 mantissa bits,
 *     max finite +-448 (0x7E / 0xFE), NaN = S.1111.111 (0x7F / 0xFF),
 *     subnormals down to 2^-9;
 *   - fp8 e5m2: bias 15, 2 mantissa bits, +-inf = 0x7C / 0xFC, NaN = exponent
 *     31 with a non-zero mantissa, max finite +-57344 (0x7B / 0xFB),
 *     subnormals down to 2^-16;
 *   - f32 -> fp8 SATURATES (NVIDIA's __NV_SATFINITE): any magnitude that
 *     rounds past the largest finite value, and +-inf, become +-max finite;
 *     NaN becomes 0x7F with the input's sign bit (0x7F / 0xFF); -0.0 stays
 *     -0 (0x80);
 *   - fp8 -> f32 and f16/bf16 -> f32 are exact.
 * Scales (attention/kv_attn.h, vLLM's convention): a write stores
 * convert(x / scale), a true division (x * (1 / scale) rounds differently
 * for some x, e.g. scale 3); a read gives to_f32(stored) * scale
 * (kv_apply_scale). A scaled conversion follows the rules above whatever the
 * scale, 1.0 included: only an unscaled move of equal dtypes copies bytes,
 * and that is the kernels' choice, never kv_convert_row's.
 */
#ifndef KV_CONVERT_HD_H
#define KV_CONVERT_HD_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kv_dtype.h"
#include "kv_view_hd.h"

/* ---- bit casts ------------------------------------------------------------------ */

KV_HD uint32_t kv__f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

KV_HD float kv__f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* mant >> s rounded to nearest even, for 1 <= s <= 31. */
KV_HD uint32_t kv__shift_rne(uint32_t mant, int s)
{
    const uint32_t q = mant >> s, rem = mant & ((1u << s) - 1u), half = 1u << (s - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}

/* ---- bf16 ------------------------------------------------------------------------ */

KV_HD float kv_bf16_to_f32(uint16_t b)
{
    return kv__f32_from_bits((uint32_t)b << 16);
}

KV_HD uint16_t kv_f32_to_bf16(float f)
{
    const uint32_t u = kv__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: quiet, sign and top payload kept */
        return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- f16 ------------------------------------------------------------------------- */

KV_HD float kv_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) /* inf or NaN, payload kept */
        return kv__f32_from_bits(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0)
            return kv__f32_from_bits(sign);
        /* subnormal: m * 2^-24, normalized */
        int32_t ex = -14;
        while (!(m & 0x400u)) {
            m <<= 1;
            ex--;
        }
        return kv__f32_from_bits(sign | ((uint32_t)(ex + 127) << 23) | ((m & 0x3ffu) << 13));
    }
    return kv__f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

KV_HD uint16_t kv_f32_to_f16(float f)
{
    const uint32_t u = kv__f32_bits(f), a = u & 0x7fffffffu;
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (a > 0x7f800000u) /* NaN: quiet, top payload bits kept */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 rounds to inf (and inf stays inf) */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* a normal half (>= 2^-14): rebias, round 23 -> 10 bits */
        uint32_t m = a - (112u << 23);
        m += 0xfffu + ((m >> 13) & 1u);
        return (uint16_t)(sign | (m >> 13));
    }
    const uint32_t e = a >> 23;
    if (e < 102) /* below 2^-25: rounds to 0 (2^-25 itself ties to even 0) */
        return sign;
    /* subnormal: value / 2^-24 = mant * 2^(e - 126) */
    return (uint16_t)(sign | kv__shift_rne((a & 0x7fffffu) | 0x800000u, (int)(126 - e)));
}

/* ---- fp8 e4m3fn --------------------------------------------------------------------- */

KV_HD float kv_e4m3_to_f32(uint8_t x)
{
    const uint32_t sign = (uint32_t)(x & 0x80u) << 24, e = (x >> 3) & 0xfu, m = x & 7u;
    if (e == 15 && m == 7)
        return kv__f32_from_bits(sign | 0x7fc00000u);
    if (e == 0) /* subnormal: m * 2^-9 (exact in f32) */
        return kv__f32_from_bits(sign | kv__f32_bits((float)m * 0.001953125f));
    return kv__f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

KV_HD uint8_t kv_f32_to_e4m3(float f)
{
    const uint32_t u = kv__f32_bits(f), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7f800000u)
        return (uint8_t)(sign | 0x7fu);
    if (a >= 0x43e00000u) /* >= 448 (inf included): saturate (464 ties down to 448) */
        return (uint8_t)(sign | 0x7eu);
    if (a >= 0x3c800000u) { /* normal (>= 2^-6): rebias by 127 - 7, round 23 -> 3 bits */
        uint32_t m = a - (120u << 23);
        m += 0x7ffffu + ((m >> 20) & 1u);
        return (uint8_t)(sign | (m >> 20));
    }
    const uint32_t e = a >> 23;
    if (e < 117) /* below 2^-10: 0 (2^-10 ties to even 0) */
        return sign;
    /* subnormal: value / 2^-9 = mant * 2^(e - 141) */
    return (uint8_t)(sign | kv__shift_rne((a & 0x7fffffu) | 0x800000u, (int)(141 - e)));
}

/* ---- fp8 e5m2 -------------------------------------------------------------------------- */

KV_HD float kv_e5m2_to_f32(uint8_t x)
{
    const uint32_t sign = (uint32_t)(x & 0x80u) << 24, e = (x >> 2) & 0x1fu, m = x & 3u;
    if (e == 31)
        return kv__f32_from_bits(sign | (m ? 0x7fc00000u : 0x7f800000u));
    if (e == 0) /* subnormal: m * 2^-16 */
        return kv__f32_from_bits(sign | kv__f32_bits((float)m * 0.0000152587890625f));
    return kv__f32_from_bits(sign | ((e + 112u) << 23) | (m << 21));
}

KV_HD uint8_t kv_f32_to_e5m2(float f)
{
    const uint32_t u = kv__f32_bits(f), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7f800000u)
        return (uint8_t)(sign | 0x7fu);
    if (a >= 0x47600000u) /* >= 57344 (inf included): saturate */
        return (uint8_t)(sign | 0x7bu);
    if (a >= 0x38800000u) { /* normal (>= 2^-14): rebias by 127 - 15, round 23 -> 2 bits */
        uint32_t m = a - (112u << 23);
        m += 0xfffffu + ((m >> 21) & 1u);
        return (uint8_t)(sign | (m >> 21));
    }
    const uint32_t e = a >> 23;
    if (e < 110) /* below 2^-17: 0 */
        return sign;
    /* subnormal: value / 2^-16 = mant * 2^(e - 134) */
    return (uint8_t)(sign | kv__shift_rne((a & 0x7fffffu) | 0x800000u, (int)(134 - e)));
}

/* ---- by dtype ------------------------------------------------------------------------ */

/* The element at p as f32: f32, f16, bf16, fp8 e4m3, fp8 e5m2 (any other
 * dtype: 0; the kernels' validators refuse them). */
KV_HD float kv_to_f32(kv_dtype dt, const void *p)
{
    switch (dt) {
    case KV_F32: {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    case KV_F16: {
        uint16_t h;
        memcpy(&h, p, 2);
        return kv_f16_to_f32(h);
    }
    case KV_BF16: {
        uint16_t b;
        memcpy(&b, p, 2);
        return kv_bf16_to_f32(b);
    }
    case KV_FP8_E4M3:
        return kv_e4m3_to_f32(*(const uint8_t *)p);
    case KV_FP8_E5M2:
        return kv_e5m2_to_f32(*(const uint8_t *)p);
    default:
        return 0.0f;
    }
}

/* Store v at p as dt (same dtypes as kv_to_f32; any other: nothing written). */
KV_HD void kv_from_f32(kv_dtype dt, float v, void *p)
{
    switch (dt) {
    case KV_F32:
        memcpy(p, &v, 4);
        break;
    case KV_F16: {
        const uint16_t h = kv_f32_to_f16(v);
        memcpy(p, &h, 2);
        break;
    }
    case KV_BF16: {
        const uint16_t b = kv_f32_to_bf16(v);
        memcpy(p, &b, 2);
        break;
    }
    case KV_FP8_E4M3:
        *(uint8_t *)p = kv_f32_to_e4m3(v);
        break;
    case KV_FP8_E5M2:
        *(uint8_t *)p = kv_f32_to_e5m2(v);
        break;
    default:
        break;
    }
}

/* Bytes per element of the five kernel dtypes (device-callable; 0 else). */
KV_HD int64_t kv__convert_elem_bytes(kv_dtype dt)
{
    return dt == KV_F32                             ? 4
           : dt == KV_F16 || dt == KV_BF16          ? 2
           : dt == KV_FP8_E4M3 || dt == KV_FP8_E5M2 ? 1
                                                    : 0;
}

/* The scale rule of every kernel: quantize (a write into the cache) gives
 * x / scale, dequantize (a read, decode) x * scale. scale 1 leaves x as it
 * is. A NaN x comes back quieted with its sign and payload, on every
 * executor: x86 arithmetic propagates them, but a GPU's gives the canonical
 * 0x7FFFFFFF (an H200 stored e5m2 0x7F where the CPU stored 0xFF). */
KV_HD float kv_apply_scale(float x, float scale, bool quantize)
{
    const uint32_t u = kv__f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return kv__f32_from_bits(u | 0x00400000u);
    return quantize ? x / scale : x * scale;
}

/* dst[i] = from_f32(kv_apply_scale(to_f32(src[i]), scale, quantize)) for
 * i < n, both rows contiguous. Always element by element through f32, equal
 * dtypes and scale 1 included (fp8 saturation, canonical NaNs): a caller
 * that means to copy bytes copies them itself. */
KV_HD void kv_convert_row(kv_dtype dst_dt, void *dst, kv_dtype src_dt, const void *src, int64_t n,
                          float scale, bool quantize)
{
    const int64_t ds = kv__convert_elem_bytes(dst_dt), ss = kv__convert_elem_bytes(src_dt);
    char *d = (char *)dst;
    const char *s = (const char *)src;
    for (int64_t i = 0; i < n; i++)
        kv_from_f32(dst_dt, kv_apply_scale(kv_to_f32(src_dt, s + i * ss), scale, quantize),
                    d + i * ds);
}

#endif /* KV_CONVERT_HD_H */
