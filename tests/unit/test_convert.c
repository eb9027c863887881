/*
 * test_convert.c - attention/kv_convert_hd.h against references written here:
 * every fp8 code each way, round to nearest even at every midpoint, the
 * saturation and NaN rules, all 65536 f16 and bf16 codes, and random floats
 * against a brute-force nearest-code search (and the CPU's own F16C where it
 * has one).
 */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kv_convert_hd.h" /* the conversions under test: not installed */

#include "kvtest.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float fbits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- independent references: value of a code from its fields ------------------ */

/* A minifloat with `eb` exponent bits, `mb` mantissa bits and bias `bias`;
 * `ieee` says whether the all-ones exponent is inf/NaN (e5m2, f16) or, for
 * e4m3fn, only S.1111.111 is NaN. */
struct fmt {
    int eb, mb, bias;
    bool ieee;
};
static const struct fmt E4M3 = {4, 3, 7, false}, E5M2 = {5, 2, 15, true}, F16 = {5, 10, 15, true};

static double ref_decode(struct fmt f, uint32_t code)
{
    const uint32_t s = code >> (f.eb + f.mb), e = (code >> f.mb) & ((1u << f.eb) - 1u),
                   m = code & ((1u << f.mb) - 1u);
    const uint32_t emax = (1u << f.eb) - 1u;
    double v;
    if (f.ieee && e == emax)
        v = m ? NAN : INFINITY;
    else if (!f.ieee && e == emax && m == (1u << f.mb) - 1u)
        v = NAN;
    else if (e == 0)
        v = ldexp((double)m, 1 - f.bias - f.mb);
    else
        v = ldexp((double)((1u << f.mb) | m), (int)e - f.bias - f.mb);
    return s ? -v : v;
}

/* The finite codes of a format with their values, sorted by value (for the
 * brute-force nearest search). */
struct entry {
    double v;
    uint32_t code;
};

static int cmp_entry(const void *a, const void *b)
{
    const struct entry *x = a, *y = b;
    return x->v < y->v ? -1 : x->v > y->v ? 1 : (x->code > y->code) - (x->code < y->code);
}

static struct entry *finite_table(struct fmt f, int *n_out)
{
    const uint32_t ncodes = 1u << (1 + f.eb + f.mb);
    struct entry *t = malloc(ncodes * sizeof(*t));
    int n = 0;
    assert_non_null(t);
    for (uint32_t c = 0; c < ncodes; c++) {
        const double v = ref_decode(f, c);
        if (isfinite(v) && !(v == 0 && (c >> (f.eb + f.mb)))) /* one zero: +0 */
            t[n++] = (struct entry){v, c};
    }
    qsort(t, (size_t)n, sizeof(*t), cmp_entry);
    *n_out = n;
    return t;
}

/* Nearest finite code to x with ties to the even mantissa; magnitudes past
 * the largest finite value saturate (fp8) or overflow to inf (f16 when
 * `to_inf`, using the IEEE rule: x >= max + half an ulp -> inf). */
static uint32_t ref_nearest(struct fmt f, const struct entry *t, int n, double x, bool to_inf,
                            uint32_t inf_code)
{
    const double max = t[n - 1].v;
    const uint32_t sign = x < 0 || (x == 0 && signbit(x)) ? 1u << (f.eb + f.mb) : 0;
    const double a = fabs(x);
    if (to_inf) {
        const double ulp = max - t[n - 2].v;
        if (a >= max + ulp / 2)
            return sign | inf_code;
    } else if (a >= max) {
        return sign | t[n - 1].code;
    }
    /* binary search among the non-negative entries */
    int lo = 0, hi = n - 1;
    {
        int a0 = 0, b0 = n - 1; /* first entry >= 0 */
        while (a0 < b0) {
            const int mid = (a0 + b0) / 2;
            if (t[mid].v < 0)
                a0 = mid + 1;
            else
                b0 = mid;
        }
        lo = a0;
    }
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (t[mid].v <= a)
            lo = mid;
        else
            hi = mid;
    }
    const double dl = a - t[lo].v, dh = t[hi].v - a;
    uint32_t c;
    if (a <= t[lo].v)
        c = t[lo].code;
    else if (dl < dh)
        c = t[lo].code;
    else if (dh < dl)
        c = t[hi].code;
    else
        c = (t[lo].code & 1u) ? t[hi].code : t[lo].code; /* tie: even mantissa */
    return sign | c;
}

/* ---- fp8 -------------------------------------------------------------------------- */

typedef float (*dec_fn)(uint8_t);
typedef uint8_t (*enc_fn)(float);

static void check_fp8(struct fmt f, dec_fn dec, enc_fn enc, uint8_t max_code, uint8_t nan_code,
                      float first_big)
{
    int n, nan_codes = 0;
    struct entry *t = finite_table(f, &n);
    /* decode: all 256 codes */
    for (uint32_t c = 0; c < 256; c++) {
        const double want = ref_decode(f, c);
        const float got = dec((uint8_t)c);
        if (isnan(want)) {
            assert_true(isnan(got));
            nan_codes++;
            continue;
        }
        if ((double)got != want || !signbit(got) != !signbit(want))
            fail_msg("decode 0x%02x: %.10g, want %.10g", c, (double)got, want);
        /* encode of every finite (and inf) value returns its code */
        if (isfinite(want) && enc(got) != (uint8_t)c)
            fail_msg("encode(decode(0x%02x) = %g) = 0x%02x", c, (double)got, enc(got));
    }
    assert_int_equal(nan_codes, f.ieee ? 6 : 2);
    /* every midpoint between consecutive finite values (both signs), and one
     * float either side of it */
    for (int i = 0; i + 1 < n; i++) {
        const double mid = (t[i].v + t[i + 1].v) / 2;
        const float m = (float)mid; /* exact: a few more bits than fp8 */
        assert_true((double)m == mid);
        const float cand[3] = {m, nextafterf(m, -INFINITY), nextafterf(m, INFINITY)};
        for (int k = 0; k < 3; k++) {
            const uint32_t want = ref_nearest(f, t, n, cand[k], false, 0);
            const uint8_t got = enc(cand[k]);
            if (got != want)
                fail_msg("encode(%.9g) = 0x%02x, nearest-even is 0x%02x", (double)cand[k], got,
                         want);
        }
    }
    /* random floats over the whole range, and beyond it */
    uint64_t rng = 0xf8f8;
    for (int i = 0; i < 200000; i++) {
        const uint32_t r = (uint32_t)kvt_rand(&rng);
        const int ex = (int)kvt_range(&rng, -30, 20);
        const float x = (r & 1 ? -1.0f : 1.0f) * ldexpf(1.0f + (float)(r >> 9) / 8388608.0f, ex);
        const uint32_t want = ref_nearest(f, t, n, x, false, 0);
        if (enc(x) != want)
            fail_msg("encode(%.9g) = 0x%02x, want 0x%02x", (double)x, enc(x), want);
    }
    /* saturation, inf, NaN, -0 */
    const float big[] = {first_big, 1e9f, FLT_MAX, INFINITY};
    for (int k = 0; k < 4; k++) {
        assert_int_equal(enc(big[k]), max_code);
        assert_int_equal(enc(-big[k]), max_code | 0x80);
    }
    const float nans[] = {NAN, fbits(0x7f800001u), fbits(0x7fffffffu), fbits(0x7fc12345u)};
    for (int k = 0; k < 4; k++) {
        assert_int_equal(enc(nans[k]), nan_code);
        assert_int_equal(enc(-nans[k]), nan_code | 0x80);
    }
    assert_int_equal(enc(-0.0f), 0x80);
    assert_int_equal(enc(0.0f), 0x00);
    free(t);
}

static void test_convert_e4m3_all_codes_rne_saturation(void **state)
{
    (void)state;
    check_fp8(E4M3, kv_e4m3_to_f32, kv_f32_to_e4m3, 0x7e, 0x7f, 512.0f);
    assert_true(kv_e4m3_to_f32(0x7e) == 448.0f);
    assert_int_equal(kv_f32_to_e4m3(464.0f), 0x7e); /* the tie above 448 rounds down */
    assert_int_equal(kv_f32_to_e4m3(465.0f), 0x7e); /* and past it saturates */
    assert_true(kv_e4m3_to_f32(0x01) == ldexpf(1, -9));
}

static void test_convert_e5m2_all_codes_rne_saturation(void **state)
{
    (void)state;
    check_fp8(E5M2, kv_e5m2_to_f32, kv_f32_to_e5m2, 0x7b, 0x7f, 65536.0f);
    assert_true(kv_e5m2_to_f32(0x7b) == 57344.0f);
    assert_true(isinf(kv_e5m2_to_f32(0x7c)) && kv_e5m2_to_f32(0x7c) > 0);
    assert_int_equal(kv_f32_to_e5m2(61440.0f), 0x7b); /* would round to inf: saturates */
    assert_true(kv_e5m2_to_f32(0x01) == ldexpf(1, -16));
}

/* ---- f16 --------------------------------------------------------------------------- */

#if HAVE_X86
__attribute__((target("f16c"))) static uint16_t f16c_encode(float f)
{
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
#endif

static void test_convert_f16(void **state)
{
    (void)state;
    int n;
    struct entry *t = finite_table(F16, &n);
    for (uint32_t c = 0; c < 65536; c++) {
        const double want = ref_decode(F16, c);
        const float got = kv_f16_to_f32((uint16_t)c);
        if (isnan(want)) {
            assert_true(isnan(got));
            assert_true(isnan(kv_f16_to_f32(kv_f32_to_f16(got))));
            continue;
        }
        if ((double)got != want || !signbit(got) != !signbit(want))
            fail_msg("f16 0x%04x -> %.10g, want %.10g", c, (double)got, want);
        if (kv_f32_to_f16(got) != c)
            fail_msg("f16 round trip of 0x%04x gives 0x%04x", c, kv_f32_to_f16(got));
    }
    const bool f16c = HAVE_X86 && __builtin_cpu_supports("f16c");
    uint64_t rng = 0x16;
    for (int i = 0; i < 1000000; i++) {
        float x;
        const uint32_t r = (uint32_t)kvt_rand(&rng);
        if (i % 4 == 0) /* anywhere, NaN and inf included */
            x = fbits(r);
        else /* the half range, subnormals to overflow */
            x = (r & 1 ? -1.0f : 1.0f) *
                ldexpf(1.0f + (float)(r >> 9) / 8388608.0f, (int)kvt_range(&rng, -27, 17));
        const uint16_t got = kv_f32_to_f16(x);
        if (isnan(x)) {
            assert_true((got & 0x7c00) == 0x7c00 && (got & 0x3ff));
            continue;
        }
        const uint32_t want = ref_nearest(F16, t, n, x, true, 0x7c00);
        if (got != want)
            fail_msg("f16(%.9g = 0x%08x) = 0x%04x, want 0x%04x", (double)x, bits(x), got, want);
#if HAVE_X86
        if (f16c && got != f16c_encode(x))
            fail_msg("f16(%.9g) = 0x%04x, F16C says 0x%04x", (double)x, got, f16c_encode(x));
#endif
    }
    assert_int_equal(kv_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(kv_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(kv_f32_to_f16(ldexpf(1, -25)), 0x0000); /* tie: even */
    assert_int_equal(kv_f32_to_f16(nextafterf(ldexpf(1, -25), 1.0f)), 0x0001);
    print_message("f16: checked against F16C too: %s\n", f16c ? "yes" : "no (not available)");
    free(t);
}

/* ---- bf16 ---------------------------------------------------------------------------- */

/* RNE of f32 to its top 16 bits, by comparing with the two neighbours in
 * double precision. */
static uint16_t ref_bf16(float x)
{
    const uint32_t u = bits(x), lo = u & 0xffff0000u, hi = lo + 0x10000u;
    const double dl = fabs((double)x - (double)fbits(lo));
    const double dh = (hi & 0x7f800000u) == 0x7f800000u && (hi & 0x7fffffu) == 0
                          ? ldexp(1.0, 128) - fabs((double)x) /* inf stands for 2^128 */
                          : fabs((double)fbits(hi) - (double)x);
    if (dl < dh)
        return (uint16_t)(lo >> 16);
    if (dh < dl)
        return (uint16_t)(hi >> 16);
    return (uint16_t)(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);
}

static void test_convert_bf16(void **state)
{
    (void)state;
    for (uint32_t c = 0; c < 65536; c++) {
        const float f = kv_bf16_to_f32((uint16_t)c);
        assert_true(bits(f) == c << 16); /* exact: the top half of an f32 */
        if (!isnan(f))
            assert_int_equal(kv_f32_to_bf16(f), c);
        else
            assert_true(isnan(kv_bf16_to_f32(kv_f32_to_bf16(f))));
    }
    uint64_t rng = 0xbf16;
    for (int i = 0; i < 1000000; i++) {
        const float x = fbits((uint32_t)kvt_rand(&rng));
        const uint16_t got = kv_f32_to_bf16(x);
        if (isnan(x)) {
            assert_true((got & 0x7f80) == 0x7f80 && (got & 0x7f));
            assert_int_equal(got & 0x8000, (bits(x) >> 16) & 0x8000);
            continue;
        }
        if (got != ref_bf16(x))
            fail_msg("bf16(0x%08x) = 0x%04x, want 0x%04x", bits(x), got, ref_bf16(x));
    }
    /* the largest finite bf16 plus half an ulp ties to even: inf */
    assert_int_equal(kv_f32_to_bf16(fbits(0x7f7f8000u)), 0x7f80);
    assert_int_equal(kv_f32_to_bf16(fbits(0x7f7f7fffu)), 0x7f7f);
    assert_int_equal(kv_f32_to_bf16(fbits(0x7fc00001u)), 0x7fc0); /* NaN stays NaN */
    assert_int_equal(kv_f32_to_bf16(fbits(0x7f800001u)) & 0x7f80, 0x7f80);
    assert_true(kv_f32_to_bf16(fbits(0x7f800001u)) & 0x7f); /* never inf */
}

/* ---- by dtype and rows ------------------------------------------------------------------ */

static void test_convert_rows_every_pair(void **state)
{
    (void)state;
    const kv_dtype dts[5] = {KV_F32, KV_F16, KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2};
    uint64_t rng = 5;
    float src_f[97];
    for (int i = 0; i < 97; i++)
        src_f[i] = (float)kvt_range(&rng, -4000, 4000) / 37.0f;
    src_f[2] = INFINITY, src_f[3] = -INFINITY, src_f[4] = NAN, src_f[5] = 1e6f; /* saturate */
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 5; b++)
            for (int mi = 0; mi < 6; mi++) {
                /* scale 1 (equal dtypes too: still converted), a power of
                 * two, and 3 (1/3 inexact: x / 3 and x * (1/3) differ),
                 * each to quantize (x / scale) and dequantize (x * scale) */
                const float scale = mi / 2 == 0 ? 1.0f : mi / 2 == 1 ? 0.25f : 3.0f;
                const bool quantize = mi % 2 == 0;
                unsigned char src[97 * 4], dst[97 * 4], want[97 * 4];
                const size_t sa = kv_dtype_size(dts[a]);
                for (int i = 0; i < 97; i++)
                    kv_from_f32(dts[a], src_f[i], src + i * sa);
                if (dts[a] == KV_FP8_E5M2)
                    src[0] = 0x7C, src[1] = 0xFD; /* inf, a NaN: to 0x7B, 0xFF even to e5m2 */
                memset(dst, 0x5a, sizeof(dst));
                memset(want, 0x5a, sizeof(want));
                for (int i = 0; i < 97; i++) {
                    float x;
                    /* the element functions composed here, by dtype */
                    switch (dts[a]) {
                    case KV_F32:
                        memcpy(&x, src + i * 4, 4);
                        break;
                    case KV_F16: {
                        uint16_t h;
                        memcpy(&h, src + i * 2, 2);
                        x = kv_f16_to_f32(h);
                        break;
                    }
                    case KV_BF16: {
                        uint16_t h;
                        memcpy(&h, src + i * 2, 2);
                        x = kv_bf16_to_f32(h);
                        break;
                    }
                    case KV_FP8_E4M3:
                        x = kv_e4m3_to_f32(src[i]);
                        break;
                    default:
                        x = kv_e5m2_to_f32(src[i]);
                        break;
                    }
                    x = quantize ? x / scale : x * scale;
                    switch (dts[b]) {
                    case KV_F32:
                        memcpy(want + i * 4, &x, 4);
                        break;
                    case KV_F16: {
                        const uint16_t h = kv_f32_to_f16(x);
                        memcpy(want + i * 2, &h, 2);
                        break;
                    }
                    case KV_BF16: {
                        const uint16_t h = kv_f32_to_bf16(x);
                        memcpy(want + i * 2, &h, 2);
                        break;
                    }
                    case KV_FP8_E4M3:
                        want[i] = kv_f32_to_e4m3(x);
                        break;
                    default:
                        want[i] = kv_f32_to_e5m2(x);
                        break;
                    }
                }
                kv_convert_row(dts[b], dst, dts[a], src, 97, scale, quantize);
                assert_memory_equal(dst, want, sizeof(dst)); /* nothing past the row either */
            }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_convert_e4m3_all_codes_rne_saturation),
        cmocka_unit_test(test_convert_e5m2_all_codes_rne_saturation),
        cmocka_unit_test(test_convert_f16),
        cmocka_unit_test(test_convert_bf16),
        cmocka_unit_test(test_convert_rows_every_pair),
    };
    return cmocka_run_group_tests_name("convert", tests, NULL, NULL);
}
