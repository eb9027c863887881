/*
 * fuzz_attn_args.c - libFuzzer target for the arrays an engine hands the CPU
 * attention kernels (attention/kv_attn.h) as its own page tables and slot
 * mappings: struct kv_pages (CSR indptr / indices / last_page_len, or
 * block_table + seq_lens, page_ratio) for kv_attn_decode, kv_attn_decode_ex
 * and kv_attn_prefill (with qo_indptr), and int64 / int32 slot mappings for
 * kv_attn_write / kv_attn_write_i32, with the q / out / K / V tensors,
 * scales, softmax scale and options around them.
 *
 * Input: byte 0 the call ((b & 7) % 5: decode, decode_ex, prefill, write, write_i32)
 * and the CPU paths (bit 3 portable, bit 4 AVX2 only, bit 5 fp8 via F16C,
 * bit 6 streaming stores from 64 bytes); byte 1 one of 8 cache shapes (NHD /
 * HND, layer- / block-major, padded by elements or by block stride, K|V
 * packed, 1,200 blocks whose page ids sit far from 0); byte 2 the cache
 * dtype (f32, f16, bf16, fp8 e4m3, fp8 e5m2; fp8 takes scales); byte 3 the
 * data seed; the rest decodes, call by call, into the arguments. A zero byte
 * always means the usual valid choice (a short input is a valid call);
 * bytes from 0xE0 / 0xF0 pick the hostile values: page ids negative or past
 * B x r, indptr not starting at 0, decreasing or INT32_MAX, last_page_len 0
 * or past N/r, seq_lens negative or near 2^63, block_table_cols 0, NULL
 * arrays, a page ratio that does not divide N; q / out of other heads,
 * dims, rows or dtypes, out over q, over the cache or with a stride 0;
 * non-finite softmax scales and soft caps, windows below -1, lse strides
 * below Hq or misaligned; slots below -1, past B x N, at INT64_MIN or
 * written twice, n_slots past T; scales 0, NaN, past the fp8 limit, of
 * another count or layer rows (a bad value in a row the call does not read
 * is valid).
 *
 * The harness decides from the same arrays, by the rules of kv_attn.h,
 * whether the call is valid, and collects every status a violation it finds
 * may be reported as. After each call:
 *   refused:  the status is one of those collected (a valid call must not be
 *             refused, an invalid one must be), kv_last_error() is non-empty,
 *             and out, lse and the WHOLE cache are byte-identical to before
 *             (the header: nothing is written when a call is refused);
 *   decode / prefill KV_OK: every element of out (and lse) within the unit
 *             tests' tolerance of a float64 reference computed here: the K/V
 *             rows gathered through the pages as the harness itself reads
 *             them, addressed from the layout config (not the library's
 *             strides), softmax(scale q.k (soft-capped)) . v per query head
 *             with GQA (head i reads KV head i / (Hq / H)), causal, windowed;
 *             1e-5 relative (floor 0.1) as test_attn.c, widened by a bound
 *             of the f32 rounding of the logits; every other byte of out's
 *             and lse's buffers, q and the whole cache unchanged;
 *   write KV_OK: the WHOLE cache equals a reference scatter computed here
 *             (bytes moved exactly for equal dtypes without scales,
 *             otherwise x / scale rounded to nearest even by an encoder
 *             written here, fp8 saturating), untouched slots byte-identical;
 *             K and V unchanged.
 * Every page, slot and tensor array is a malloc of its exact size (ASan
 * sees a read past it). kv_set_threads(1): one thread, thousands of calls a
 * second. Any mismatch prints the decoded call and aborts.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_attn.h"
#include "kv_attn_int.h" /* the CPU path knobs of the unit tests */

#define FUZZ_NAME "fuzz_attn_args"
#define FUZZ_TRACE_LABEL "call"
#include "fuzz_check.h"
#include "fuzz_cache.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define MAX_SEQS 4
#define MAX_NP 4    /* pages per sequence */
#define MAX_COLS 4  /* block-table columns */
#define MAX_WTOK 24 /* tokens of a write */
#define N_TMPL 8

/* The harness's reference code runs without coverage instrumentation (most
 * of an execution's time otherwise, and no feedback worth having). */

/* ---- input reader -------------------------------------------------------- */

/* ---- trace for failure reports -------------------------------------------- */

static void *dup_bytes(const void *p, size_t n)
{
    void *d = xmalloc(n);
    if (n)
        memcpy(d, p, n);
    return d;
}

/* ---- element formats, written here (not attention/kv_convert_hd.h) -------- */

static const kv_dtype k_dt5[5] = {KV_F32, KV_F16, KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2};

struct fmt {
    int eb, mb, bias;
    bool fn; /* e4m3fn: no inf, NaN = all ones */
    double max_finite;
};

NOCOV static struct fmt fmt_of(kv_dtype dt)
{
    switch (dt) {
    case KV_F16:
        return (struct fmt){5, 10, 15, false, 65504.0};
    case KV_BF16:
        return (struct fmt){8, 7, 127, false, 3.3895313892515355e38};
    case KV_FP8_E4M3:
        return (struct fmt){4, 3, 7, true, 448.0};
    case KV_FP8_E5M2:
        return (struct fmt){5, 2, 15, false, 57344.0};
    default:
        return (struct fmt){8, 23, 127, false, FLT_MAX};
    }
}

NOCOV static double dec_gen(uint32_t u, struct fmt f)
{
    const uint32_t emax = (1u << f.eb) - 1, mmax = (1u << f.mb) - 1;
    const uint32_t sign = (u >> (f.eb + f.mb)) & 1, e = (u >> f.mb) & emax, m = u & mmax;
    double v;
    if (e == emax && (!f.fn || m == mmax))
        v = f.fn || m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, 1 - f.bias - f.mb);
    else
        v = ldexp(1.0 + (double)m / (double)(1u << f.mb), (int)e - f.bias);
    return sign ? -v : v;
}

/* The element at p as a double (exact: every format is a subset of f32). */
NOCOV static double dec(kv_dtype dt, const unsigned char *p)
{
    if (dt == KV_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    if (dt == KV_F16 || dt == KV_BF16) {
        uint16_t h;
        memcpy(&h, p, 2);
        return dec_gen(h, fmt_of(dt));
    }
    return dec_gen(p[0], fmt_of(dt));
}

/* x (a float value, not NaN) rounded to nearest even in format f: overflow
 * to inf (IEEE) or to the largest finite value (fp8: saturating). */
static uint32_t enc_gen(double x, struct fmt f, bool sat)
{
    const uint32_t sign = signbit(x) ? 1u << (f.eb + f.mb) : 0;
    const double a = fabs(x), min_normal = ldexp(1.0, 1 - f.bias);
    double v;
    int k;
    CHECK(!isnan(x));
    if (a == 0)
        return sign;
    if (isinf(a)) {
        v = INFINITY;
    } else {
        frexp(a, &k);
        int e = k - 1 < 1 - f.bias ? 1 - f.bias : k - 1;
        const double q = ldexp(1.0, e - f.mb);
        v = rint(a / q) * q; /* a / q exact; rint: ties to even (the mantissa's parity) */
    }
    if (v > f.max_finite)
        v = sat ? f.max_finite : INFINITY;
    if (isinf(v))
        return sign | ((1u << f.eb) - 1) << f.mb;
    if (v < min_normal)
        return sign | (uint32_t)(v / ldexp(1.0, 1 - f.bias - f.mb));
    frexp(v, &k);
    const uint32_t m = (uint32_t)((v / ldexp(1.0, k - 1) - 1.0) * ldexp(1.0, f.mb));
    return sign | (uint32_t)(k - 1 + f.bias) << f.mb | m;
}

/* Store float x in dtype dt at p (the kernels' from_f32 rules). */
static void enc(kv_dtype dt, float x, unsigned char *p)
{
    if (dt == KV_F32) {
        memcpy(p, &x, 4);
        return;
    }
    const uint32_t u = enc_gen(x, fmt_of(dt), dt == KV_FP8_E4M3 || dt == KV_FP8_E5M2);
    if (dt == KV_F16 || dt == KV_BF16) {
        const uint16_t h = (uint16_t)u;
        memcpy(p, &h, 2);
    } else {
        p[0] = (uint8_t)u;
    }
}

/* A finite element of magnitude in [1/8, 4) (or 0) of dtype dt. */
static void rand_elem(kv_dtype dt, uint64_t *s, unsigned char *out)
{
    const uint64_t x = mix64(s);
    const uint32_t sign = x & 1, e = (uint32_t)((x >> 1) % 5);
    if ((x >> 60) == 0) { /* a zero now and then */
        memset(out, 0, kv_dtype_size(dt));
        return;
    }
    switch (dt) {
    case KV_F32: {
        const uint32_t u = sign << 31 | (124 + e) << 23 | (uint32_t)((x >> 8) & 0x7FFFFF);
        memcpy(out, &u, 4);
        break;
    }
    case KV_F16: {
        const uint16_t u = (uint16_t)(sign << 15 | (12 + e) << 10 | (uint32_t)((x >> 8) & 0x3FF));
        memcpy(out, &u, 2);
        break;
    }
    case KV_BF16: {
        const uint16_t u = (uint16_t)(sign << 15 | (124 + e) << 7 | (uint32_t)((x >> 8) & 0x7F));
        memcpy(out, &u, 2);
        break;
    }
    case KV_FP8_E4M3:
        out[0] = (uint8_t)(sign << 7 | (4 + e) << 3 | (uint32_t)((x >> 8) & 7));
        break;
    default: /* e5m2 */
        out[0] = (uint8_t)(sign << 7 | (12 + e) << 2 | (uint32_t)((x >> 8) & 3));
        break;
    }
}

/* ---- the caches: 8 shapes x 5 dtypes, built once, kept as a golden copy ---- */

static const struct tmpl k_tmpl[N_TMPL] = {
    {2, 12, 4, 2, 8, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, false, 0, 0},
    {1, 10, 8, 2, 16, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, false, 0, 0},
    {2, 9, 4, 4, 32, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, false, 0, 0},
    {2, 7, 2, 1, 8, KV_ORDER_HND, KV_ARRANGE_BLOCK_MAJOR, false, 5, 0},
    {2, 8, 8, 2, 64, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, false, 0, 0},
    {1, 1200, 2, 1, 4, KV_ORDER_NHD, KV_ARRANGE_LAYER_MAJOR, false, 0, 0},
    {1, 6, 16, 2, 64, KV_ORDER_HND, KV_ARRANGE_LAYER_MAJOR, false, 0, 64},
    {2, 8, 4, 2, 16, KV_ORDER_NHD, KV_ARRANGE_BLOCK_MAJOR, true, 0, 0},
};

static struct cc g_cc[N_TMPL][5];

static struct cc *get_cache(int ti, int di)
{
    struct cc *c = &g_cc[ti][di];
    if (c->built)
        return c;
    cache_make(c, &k_tmpl[ti], k_dt5[di], KV_MEM_HOST);
    uint64_t s = 0x5EED0000u + (uint64_t)ti * 8 + (uint64_t)di;
    for (size_t i = 0; i < c->bytes; i += (size_t)c->es)
        rand_elem(c->dt, &s, (unsigned char *)c->pc.base + i);
    c->gold = dup_bytes(c->pc.base, c->bytes);
    c->built = true;
    return c;
}

NOCOV static double cache_val(const struct cc *c, int64_t l, int kv, int64_t b, int64_t n,
                              int64_t h, int64_t d)
{
    return dec(c->dt, c->gold + ref_off(c, l, kv, b, n, h, d) * c->es);
}

/* ---- statuses a call may return ------------------------------------------- */

struct allow {
    kv_status s[32];
    int n;
};

static void allow(struct allow *a, kv_status s, const char *why)
{
    trace(" [%s: %s]", why, kv_status_name(s));
    if (a->n < 32)
        a->s[a->n++] = s;
}

static void check_status(const struct allow *a, kv_status st)
{
    trace(" -> %s", kv_status_name(st));
    if (a->n == 0) {
        CHECK(st == KV_OK);
        return;
    }
    bool hit = false;
    for (int i = 0; i < a->n; i++)
        hit |= st == a->s[i];
    CHECK(st != KV_OK && hit);
    CHECK(kv_last_error()[0] != '\0');
}

/* ---- tensors over exact-size buffers ------------------------------------------ */

struct tens {
    struct kv_view v;
    unsigned char *buf; /* owned unless borrowed */
    size_t bytes;
    bool borrowed;
};

/* A view of shape sh (nd 2..4) over a fresh buffer of exactly its extent, in
 * one of 5 stride variants: C-contiguous, padded rows, heads outermost, dim
 * stride 2 (generic path), an element offset. */
static void mk_tens(struct tens *t, kv_dtype dt, int nd, const int64_t *sh, int variant)
{
    int64_t st[4], c = 1, off = 0;
    const int64_t es = (int64_t)kv_dtype_size(dt);
    bool empty = false;
    for (int i = nd - 1; i >= 0; i--) {
        st[i] = c;
        c *= sh[i] > 0 ? sh[i] : 1;
        empty |= sh[i] == 0;
    }
    switch (variant) {
    case 1: /* padded token rows */
        if (nd >= 3) {
            st[nd - 3] = sh[nd - 2] * sh[nd - 1] + 3;
            if (nd == 4)
                st[0] = st[1] * (sh[1] > 0 ? sh[1] : 1);
        }
        break;
    case 2: /* heads outermost of the three */
        if (nd >= 3) {
            st[nd - 3] = sh[nd - 1];
            st[nd - 2] = (sh[nd - 3] > 0 ? sh[nd - 3] : 1) * sh[nd - 1];
        }
        break;
    case 3: /* every stride doubled: the dim not contiguous */
        for (int i = 0; i < nd; i++)
            st[i] *= 2;
        break;
    case 4:
        off = 5;
        break;
    default:
        break;
    }
    int64_t ext = 0;
    if (!empty) {
        ext = off;
        for (int i = 0; i < nd; i++)
            ext += (sh[i] - 1) * st[i];
        ext = (ext + 1) * es;
    }
    memset(t, 0, sizeof(*t));
    t->bytes = (size_t)ext;
    t->buf = xmalloc(t->bytes);
    CHECK(kv_view_from_strided(t->buf, t->bytes, dt, nd, sh, st, off * es, &t->v) == KV_OK);
}

static void free_tens(struct tens *t)
{
    if (!t->borrowed)
        free(t->buf);
    t->buf = NULL;
}

NOCOV static unsigned char *at3(const struct kv_view *v, int64_t i, int64_t j, int64_t k)
{
    const int64_t e = v->offset + i * v->strides[0] + j * v->strides[1] + k * v->strides[2];
    return (unsigned char *)v->base + e * (int64_t)kv_dtype_size(v->dtype);
}

NOCOV static unsigned char *at4(const struct kv_view *v, int64_t a, int64_t i, int64_t j, int64_t k)
{
    const int64_t e =
        v->offset + a * v->strides[0] + i * v->strides[1] + j * v->strides[2] + k * v->strides[3];
    return (unsigned char *)v->base + e * (int64_t)kv_dtype_size(v->dtype);
}

/* Fill every element slot of t's buffer: finite values, or raw bytes. */
static void fill_tens(struct tens *t, uint64_t *s, bool raw)
{
    const size_t es = kv_dtype_size(t->v.dtype);
    if (t->borrowed)
        return;
    for (size_t i = 0; i + es <= t->bytes; i += es) {
        if (raw) {
            const uint64_t x = mix64(s);
            memcpy(t->buf + i, &x, es);
        } else {
            rand_elem(t->v.dtype, s, t->buf + i);
        }
    }
}

static bool numel_zero(const struct kv_view *v)
{
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] == 0)
            return true;
    return false;
}

/* ---- the CPU path knobs ---------------------------------------------------------- */

static void set_paths(uint8_t b)
{
    kv__attn_test_tune((b >> 6) & 1 ? 64 : -1, (b >> 3) & 1);
    kv__attn_avx2_only = (b >> 4) & 1;
    kv__attn_fp8_via_f16 = (b >> 5) & 1;
    trace(" paths{portable=%d avx2_only=%d fp8_via_f16=%d nt64=%d}", (b >> 3) & 1, (b >> 4) & 1,
          (b >> 5) & 1, (b >> 6) & 1);
}

/* ---- scales -------------------------------------------------------------------------- */

struct scl {
    struct kv_scales s;
    const struct kv_scales *arg;
    float *k, *v;
    size_t n_floats;
};

/* Scales for a call reading layer rows [l0, l1) (l1 - l0 == L for every
 * layer). Byte 0: fp8 caches a valid per-tensor scale, others none. */
static void rd_scales(struct rd *r, const struct cc *c, int64_t l0, int64_t l1, uint64_t *rng,
                      struct scl *sc, struct allow *al, bool attn)
{
    const uint8_t b = rd_u8(r), vb = rd_u8(r);
    const bool fp8 = c->dt == KV_FP8_E4M3 || c->dt == KV_FP8_E5M2;
    const int64_t L = c->t.L, H = c->t.H;
    static const float vals[5] = {1.0f, 0.5f, 2.0f, 0.25f, 1.5f};
    int kind = b == 0 ? (fp8 ? 1 : 0) : b % 8;
    uint32_t n = 1, layers = 0;
    memset(sc, 0, sizeof(*sc));
    switch (kind) {
    case 0:
        trace(" scales=NULL");
        return;
    case 1:
        break;
    case 2:
        n = (uint32_t)H, layers = 1;
        break;
    case 3:
        n = (uint32_t)H, layers = (uint32_t)L;
        break;
    case 4:
        layers = (uint32_t)L;
        break;
    case 5:
        n = (uint32_t)H + 1;
        break;
    case 6:
        layers = (uint32_t)L + 1;
        break;
    default:
        break;
    }
    const uint32_t rows = layers ? layers : 1;
    sc->n_floats = (size_t)rows * n;
    sc->k = xmalloc(sc->n_floats * sizeof(float));
    sc->v = xmalloc(sc->n_floats * sizeof(float));
    for (size_t i = 0; i < sc->n_floats; i++) {
        sc->k[i] = vals[mix64(rng) % 5];
        sc->v[i] = vals[mix64(rng) % 5];
    }
    sc->s = (struct kv_scales){sc->k, sc->v, n, layers};
    if (kind == 7)
        (b & 0x80 ? &sc->s.v : &sc->s.k)[0] = NULL;
    sc->arg = &sc->s;
    trace(" scales{n=%u layers=%u%s}", n, layers,
          kind == 7 ? (b & 0x80 ? " v=NULL" : " k=NULL") : "");
    if (rows != 1 && (int64_t)rows != L)
        allow(al, KV_ERR_INVALID_ARG, "scale rows");
    if (!sc->s.k || !sc->s.v)
        allow(al, KV_ERR_NULL, "scales NULL");
    if (n != 1 && (int64_t)n != H)
        allow(al, KV_ERR_INVALID_ARG, "scale count");
    if (vb >= 0xF0) { /* one bad value, in a row read or (bit 3) maybe not */
        /* 1e36: past the fp8 attention limit; elsewhere its logits would overflow f32 */
        const float bad[6] = {0.0f, -1.0f, NAN, INFINITY, attn && !fp8 ? -0.0f : 1e36f, -0.0f};
        const float x = bad[(vb & 7) % 6];
        const int64_t row = rows == 1 ? 0 : (vb & 8) ? (l1 < L ? l1 : l0 > 0 ? l0 - 1 : l0) : l0;
        const size_t at = (size_t)row * n + (size_t)(mix64(rng) % n);
        float *arr = (vb & 4) ? sc->v : sc->k;
        arr[at] = x;
        const bool read = rows == 1 || (row >= l0 && row < l1);
        trace(" scale[%s %zu]=%g%s", (vb & 4) ? "v" : "k", at, (double)x, read ? "" : " (unread)");
        if (read && (rows == 1 || (int64_t)rows == L) && sc->s.k && sc->s.v &&
            (n == 1 || (int64_t)n == H)) {
            if (!(isfinite(x) && x > 0))
                allow(al, KV_ERR_INVALID_ARG, "scale value");
            else if (attn && fp8 && x > 0x1p119f)
                allow(al, KV_ERR_INVALID_ARG, "fp8 attention scale limit");
        }
    }
}

/* The scale of (layer l, kv, head h) as the call applies it. */
NOCOV static float scale_of(const struct scl *sc, int64_t l, int kv, int64_t h)
{
    if (!sc->arg)
        return 1.0f;
    const uint32_t rows = sc->s.layers ? sc->s.layers : 1;
    const size_t i = (size_t)(rows == 1 ? 0 : l) * sc->s.n + (sc->s.n == 1 ? 0 : (size_t)h);
    return (kv ? sc->s.v : sc->s.k)[i];
}

/* ---- pages ---------------------------------------------------------------------------- */

struct pgs {
    struct kv_pages kp;
    const struct kv_pages *arg;
    int32_t *indptr, *indices, *last, *table;
    int64_t *lens;
    size_t n_indices, n_table;
    bool ok;    /* the harness reads them as valid */
    uint32_t S; /* n_seqs */
    int64_t pt; /* tokens per page (1 when the ratio does not divide N) */
    int64_t tokens[MAX_SEQS];
    const int32_t *ids[MAX_SEQS]; /* sequence s's page ids (ok only) */
};

static int32_t rd_pid(struct rd *r, int64_t n_ids)
{
    const uint8_t b = rd_u8(r);
    const int64_t m = n_ids > 0 ? n_ids : 1;
    if (b < 0xE0)
        return (int32_t)((b & 1) ? m - 1 - (b >> 1) % m : (b >> 1) % m);
    switch (b & 7) {
    case 0:
        return -1;
    case 1:
        return n_ids > INT32_MAX ? INT32_MAX : (int32_t)n_ids;
    case 2:
        return INT32_MAX;
    case 3:
        return INT32_MIN;
    case 4:
        return n_ids + 1000 > INT32_MAX ? INT32_MAX : (int32_t)(n_ids + 1000);
    case 5:
        return (int32_t)-m;
    default:
        return (int32_t)(m - 1);
    }
}

static void rd_pages(struct rd *r, const struct cc *c, struct pgs *P, struct allow *al)
{
    const int64_t N = c->t.N, B = c->t.B;
    const uint8_t fb = rd_u8(r), sb = rd_u8(r), rb = rd_u8(r);
    memset(P, 0, sizeof(*P));
    P->S = sb % (MAX_SEQS + 1);
    P->kp.n_seqs = P->S;
    P->kp.format = fb >= 0xF8 ? (enum kv_pages_format)((fb & 1) ? 0 : 3)
                   : (fb & 1) ? KV_PAGES_BLOCK_TABLE
                              : KV_PAGES_CSR;
    P->arg = fb == 0xF7 ? NULL : &P->kp;
    uint32_t ratio;
    if (rb < 0xF0) {
        const uint32_t v[4] = {0, 1, N % 2 == 0 ? 2 : 1, (uint32_t)N};
        ratio = v[rb % 4];
    } else {
        const uint32_t v[4] = {3, UINT32_MAX, (uint32_t)N + 1, 0x80000000u};
        ratio = v[rb % 4];
    }
    P->kp.page_ratio = ratio;
    const int64_t rr = ratio ? ratio : 1;
    P->ok = true;
    if (!P->arg) {
        allow(al, KV_ERR_NULL, "pages NULL");
        P->ok = false;
    }
    if (N % rr != 0) {
        allow(al, KV_ERR_INVALID_ARG, "ratio");
        P->ok = false;
    }
    P->pt = N % rr == 0 ? N / rr : 1;
    const int64_t pt = P->pt, n_ids = B * rr;
    trace(" pages{%s S=%u r=%u pt=%lld%s",
          P->kp.format == KV_PAGES_CSR           ? "csr"
          : P->kp.format == KV_PAGES_BLOCK_TABLE ? "bt"
                                                 : "bad-format",
          P->S, ratio, (long long)pt, P->arg ? "" : " NULL");

    if (P->kp.format == KV_PAGES_CSR || (P->kp.format != KV_PAGES_BLOCK_TABLE && !(fb & 2))) {
        int32_t np[MAX_SEQS] = {0}, pos = 0;
        int32_t ids[MAX_SEQS * MAX_NP];
        P->indptr = xmalloc(((size_t)P->S + 1) * sizeof(int32_t));
        P->last = xmalloc((size_t)(P->S ? P->S : 1) * sizeof(int32_t));
        for (uint32_t s = 0; s < P->S; s++) {
            np[s] = (int32_t)(rd_u8(r) % (MAX_NP + 1));
            for (int32_t j = 0; j < np[s]; j++)
                ids[pos + j] = rd_pid(r, n_ids);
            P->indptr[s] = pos;
            pos += np[s];
            const uint8_t lb = rd_u8(r);
            if (lb < 0xF0) {
                P->last[s] = np[s] ? (int32_t)(pt - lb % pt) : 0;
            } else {
                const int32_t v[8] = {0, (int32_t)pt + 1, -1, INT32_MAX, INT32_MIN, 1, 1, 1};
                P->last[s] = v[lb & 7];
            }
        }
        P->indptr[P->S] = pos;
        P->n_indices = (size_t)pos;
        P->indices = xmalloc(P->n_indices * sizeof(int32_t));
        if (pos)
            memcpy(P->indices, ids, (size_t)pos * sizeof(int32_t));
        const uint8_t mb = rd_u8(r), kb = rd_u8(r);
        if (mb >= 0xF0 && mb < 0xF4)
            P->indptr[0] = 1;
        else if (mb >= 0xF4 && mb < 0xF8)
            P->indptr[0] = -1;
        else if (mb >= 0xF8 && mb < 0xFC && P->S > 0) {
            const uint32_t k = 1 + kb % P->S;
            P->indptr[k] = P->indptr[k - 1] - 1;
        } else if ((mb == 0xFC || mb == 0xFD) && P->S > 1)
            P->indptr[1 + kb % (P->S - 1)] = INT32_MAX;
        else if (mb == 0xFE)
            P->indptr[P->S] = INT32_MIN;
        P->kp.indptr = P->indptr;
        P->kp.indices = P->indices;
        P->kp.last_page_len = P->last;
        if (mb == 0xFF && kb % 3 == 0)
            P->kp.indptr = NULL;
        else if (mb == 0xFF && kb % 3 == 1)
            P->kp.indices = NULL;
        else if (mb == 0xFF)
            P->kp.last_page_len = NULL;
        trace(" indptr=[");
        for (uint32_t s = 0; s <= P->S; s++)
            trace(s ? ",%d" : "%d", P->indptr[s]);
        trace("] indices=[");
        for (size_t j = 0; j < P->n_indices; j++)
            trace(j ? ",%d" : "%d", P->indices[j]);
        trace("] last=[");
        for (uint32_t s = 0; s < P->S; s++)
            trace(s ? ",%d" : "%d", P->last[s]);
        trace("]%s", mb == 0xFF ? " (an array NULL)" : "");
        if (P->kp.format != KV_PAGES_CSR)
            goto bad_format;
        if (P->S && (!P->kp.indptr || !P->kp.indices || !P->kp.last_page_len)) {
            allow(al, KV_ERR_NULL, "csr NULL");
            P->ok = false;
            goto done;
        }
        bool mono = P->S == 0 || P->indptr[0] == 0;
        if (!mono)
            allow(al, KV_ERR_CORRUPT, "indptr[0]");
        for (uint32_t s = 0; s < P->S; s++)
            if (P->indptr[s + 1] < P->indptr[s]) {
                if (mono)
                    allow(al, KV_ERR_CORRUPT, "indptr decreasing");
                mono = false;
            }
        if (!mono) {
            P->ok = false;
            goto done;
        }
        /* monotonic from 0: indptr[S] == pos, the ids are the harness's */
        CHECK(P->S == 0 || P->indptr[P->S] == pos);
        for (uint32_t s = 0; s < P->S; s++) {
            const int32_t n = P->indptr[s + 1] - P->indptr[s], l = P->last[s];
            if ((n == 0 && l != 0) || (n > 0 && (l < 1 || l > pt))) {
                allow(al, KV_ERR_CORRUPT, "last_page_len");
                P->ok = false;
            }
            for (int32_t j = 0; j < n; j++)
                if (P->indices[P->indptr[s] + j] < 0 || P->indices[P->indptr[s] + j] >= n_ids) {
                    allow(al, KV_ERR_OUT_OF_BOUNDS, "page id");
                    P->ok = false;
                }
            P->tokens[s] = n ? (int64_t)(n - 1) * pt + l : 0;
            P->ids[s] = P->indices + P->indptr[s];
        }
    } else {
        const uint8_t cb = rd_u8(r);
        const uint32_t cols = cb < 0xF0 ? MAX_COLS - cb % MAX_COLS : 0;
        P->kp.block_table_cols = cols;
        P->n_table = (size_t)P->S * cols;
        P->table = xmalloc(P->n_table * sizeof(int32_t));
        P->lens = xmalloc((size_t)(P->S ? P->S : 1) * sizeof(int64_t));
        const int64_t lmax = (int64_t)cols * pt;
        for (uint32_t s = 0; s < P->S; s++) {
            const uint8_t lb = rd_u8(r);
            if (lb < 0xF0) {
                P->lens[s] = lmax - lb % (lmax + 1);
            } else {
                const int64_t v[8] = {
                    -1, INT64_MIN, INT64_MAX, lmax + 1, (int64_t)1 << 40, INT64_MAX - 1, 0, 0};
                P->lens[s] = v[lb & 7];
            }
            for (uint32_t j = 0; j < cols; j++)
                P->table[s * cols + j] = rd_pid(r, n_ids);
        }
        const uint8_t nb = rd_u8(r);
        P->kp.block_table = P->table;
        P->kp.seq_lens = P->lens;
        if (nb == 0xFF)
            P->kp.block_table = NULL;
        else if (nb == 0xFE)
            P->kp.seq_lens = NULL;
        trace(" cols=%u lens=[", cols);
        for (uint32_t s = 0; s < P->S; s++)
            trace(s ? ",%lld" : "%lld", (long long)P->lens[s]);
        trace("] table=[");
        for (size_t j = 0; j < P->n_table; j++)
            trace(j ? ",%d" : "%d", P->table[j]);
        trace("]%s", nb >= 0xFE ? " (an array NULL)" : "");
        if (P->kp.format != KV_PAGES_BLOCK_TABLE)
            goto bad_format;
        if (P->S && (!P->kp.block_table || !P->kp.seq_lens)) {
            allow(al, KV_ERR_NULL, "block table NULL");
            P->ok = false;
            goto done;
        }
        for (uint32_t s = 0; s < P->S; s++) {
            const int64_t len = P->lens[s];
            if (len < 0) {
                allow(al, KV_ERR_CORRUPT, "seq_lens < 0");
                P->ok = false;
                continue;
            }
            const int64_t np = len / pt + (len % pt != 0);
            if (np > (int64_t)cols) {
                allow(al, KV_ERR_OUT_OF_BOUNDS, "seq_lens past the columns");
                P->ok = false;
                continue;
            }
            for (int64_t j = 0; j < np; j++)
                if (P->table[s * cols + j] < 0 || P->table[s * cols + j] >= n_ids) {
                    allow(al, KV_ERR_OUT_OF_BOUNDS, "page id");
                    P->ok = false;
                }
            P->tokens[s] = len;
            P->ids[s] = P->table + (size_t)s * cols;
        }
    }
    goto done;
bad_format:
    allow(al, KV_ERR_INVALID_ARG, "format");
    P->ok = false;
done:
    trace("}");
}

static void free_pages(struct pgs *P)
{
    free(P->indptr);
    free(P->indices);
    free(P->last);
    free(P->table);
    free(P->lens);
}

/* Block and token of sequence s's token t (P->ok). */
NOCOV static void page_slot(const struct pgs *P, const struct cc *c, uint32_t s, int64_t t,
                            int64_t *b, int64_t *n)
{
    const int64_t slot = (int64_t)P->ids[s][t / P->pt] * P->pt + t % P->pt;
    *b = slot / c->t.N;
    *n = slot % c->t.N;
}

/* ---- decode / decode_ex / prefill -------------------------------------------------------- */

static const float k_caps[8] = {0.0f, 5.0f, 30.0f, 0.5f, -1.0f, NAN, INFINITY, 1e-39f};
static const int32_t k_windows[8] = {-1, 0, 1, 2, 5, 100, -2, INT32_MIN};

NOCOV static double ulp_rel(kv_dtype dt)
{
    return dt == KV_F16        ? 0x1p-10
           : dt == KV_BF16     ? 0x1p-7
           : dt == KV_FP8_E4M3 ? 0x1p-3
           : dt == KV_FP8_E5M2 ? 0x1p-2
                               : 0.0;
}

NOCOV static double min_sub(kv_dtype dt)
{
    return dt == KV_F16 ? 0x1p-24 : dt == KV_FP8_E4M3 ? 0x1p-9 : dt == KV_FP8_E5M2 ? 0x1p-16 : 0.0;
}

/* Sequence s's K and V rows of layer, read through the pages as the harness
 * reads them and dequantized as the kernels do (to_f32(stored) * scale, in
 * f32): kd, vd [len][H][D]. */
NOCOV static void gather_seq(const struct pgs *P, const struct cc *c, const struct scl *sc,
                             uint32_t layer, uint32_t s, double *kd, double *vd)
{
    const int64_t H = c->t.H, D = c->t.D;
    for (int64_t t = 0; t < P->tokens[s]; t++) {
        int64_t b, n;
        page_slot(P, c, s, t, &b, &n);
        for (int64_t h = 0; h < H; h++) {
            const float ks = scale_of(sc, layer, 0, h), vs = scale_of(sc, layer, 1, h);
            for (int64_t d = 0; d < D; d++) {
                kd[(t * H + h) * D + d] = (float)cache_val(c, layer, 0, b, n, h, d) * ks;
                vd[(t * H + h) * D + d] = (float)cache_val(c, layer, 1, b, n, h, d) * vs;
            }
        }
    }
}

/* One query row qv [D] at position pos of its sequence (visible tokens
 * lo..pos) on KV head h: ref [D] = softmax(scale q.k, soft-capped) . v in
 * float64, *lse its log-sum-exp (-inf when nothing is visible), *tol_abs
 * the absolute error the kernels' f32 arithmetic may add to an output
 * element and *eb to a logit (bounds of the rounding of each dot product,
 * D + 4 roundings of at most 2^-23 relative each, carried through the
 * softmax). p: scratch of pos - lo + 1 doubles. */
NOCOV static void ref_head(const double *qv, const double *kd, const double *vd, int64_t H,
                           int64_t D, int64_t h, int64_t lo, int64_t pos, float smscale, float cap,
                           double *p, double *ref, double *lse, double *tol_abs, double *eb)
{
    double mx = -INFINITY, sum = 0, emax = 0, vmax = 0;
    for (int64_t t = lo; t <= pos; t++) {
        const double *kr = kd + (t * H + h) * D, *vr = vd + (t * H + h) * D;
        double x = 0, ax = 0;
        for (int64_t d = 0; d < D; d++) {
            x += qv[d] * kr[d];
            ax += fabs(qv[d] * kr[d]);
            vmax = fmax(vmax, fabs(vr[d]));
        }
        x *= smscale;
        double e = (double)(D + 4) * 0x1p-22 * fabs((double)smscale) * ax;
        if (cap > 0) {
            x = cap * tanh(x / cap);
            e += 8 * 0x1p-24 * cap;
        }
        p[t - lo] = x;
        mx = x > mx ? x : mx;
        emax = fmax(emax, e);
    }
    for (int64_t t = lo; t <= pos; t++)
        sum += (p[t - lo] = exp(p[t - lo] - mx));
    for (int64_t d = 0; d < D; d++) {
        double r = 0;
        for (int64_t t = lo; t <= pos; t++)
            r += p[t - lo] / sum * vd[(t * H + h) * D + d];
        ref[d] = r;
    }
    *lse = pos < lo ? -INFINITY : mx + log(sum);
    *tol_abs = 2.5 * emax * vmax + (double)(pos - lo + D + 16) * 0x1p-22 * vmax;
    *eb = 2 * emax;
}

/* out[row][qh][0..D) against ref within the unit tests' tolerance (1e-5
 * relative, floor 0.1, as test_attn.c) plus tol_abs, and one rounding of
 * out's dtype; each element restored from out0 (buf's bytes before the
 * call) once checked. The first d out of tolerance, or -1. */
NOCOV static int64_t cmp_row(const struct kv_view *out, const unsigned char *out0,
                             const unsigned char *buf, int64_t row, int64_t qh, const double *ref,
                             double tol_abs)
{
    const kv_dtype odt = out->dtype;
    for (int64_t d = 0; d < out->shape[2]; d++) {
        unsigned char *op = at3(out, row, qh, d);
        const double got = dec(odt, op);
        const double tol =
            1e-5 * fmax(fabs(ref[d]), 0.1) + tol_abs + ulp_rel(odt) * fabs(ref[d]) + min_sub(odt);
        if (!(fabs(got - ref[d]) <= tol))
            return d;
        memcpy(op, out0 + (op - buf), kv_dtype_size(odt));
    }
    return -1;
}

static void op_attn(struct rd *r, struct cc *c, int kind, uint64_t *rng)
{
    static const char *const names[3] = {"kv_attn_decode", "kv_attn_decode_ex", "kv_attn_prefill"};
    const int64_t L = c->t.L, H = c->t.H, D = c->t.D;
    struct allow al = {{0}, 0};
    struct pgs P;
    struct scl sc;
    struct tens q, out;
    kv_status st;
    trace(" %s", names[kind]);

    /* layer */
    const uint8_t lb = rd_u8(r);
    const uint32_t layer = lb < 0xF0 ? (uint32_t)(lb % L) : lb < 0xF8 ? (uint32_t)L : UINT32_MAX;
    trace(" layer=%u", layer);
    if ((int64_t)layer >= L)
        allow(&al, KV_ERR_INVALID_ARG, "layer");

    rd_pages(r, c, &P, &al);

    /* prefill: qo_indptr */
    int32_t *qo = NULL;
    const int32_t *qo_arg = NULL;
    int64_t rows = P.S, qlen[MAX_SEQS] = {0};
    if (kind == 2) {
        qo = xmalloc(((size_t)P.S + 1) * sizeof(int32_t));
        qo[0] = 0;
        for (uint32_t s = 0; s < P.S; s++) {
            const uint8_t b = rd_u8(r);
            const int64_t len = P.ok ? P.tokens[s] : 3;
            qlen[s] = len - b % (len + 1); /* 0: the whole sequence (a prefill) */
            qo[s + 1] = (int32_t)(qo[s] + qlen[s]);
        }
        rows = qo[P.S];
        const uint8_t mb = rd_u8(r), kb = rd_u8(r);
        qo_arg = qo;
        if (mb >= 0xF0 && mb < 0xF4)
            qo[0] = 1;
        else if (mb >= 0xF4 && mb < 0xF8 && P.S > 0) {
            const uint32_t k = 1 + kb % P.S;
            qo[k] = qo[k - 1] - 1;
        } else if (mb >= 0xF8 && mb < 0xFC && P.S > 0) {
            const uint32_t s = kb % P.S; /* one more query than the sequence's tokens */
            for (uint32_t k = s + 1; k <= P.S; k++)
                qo[k] += (int32_t)(P.ok ? P.tokens[s] - qlen[s] + 1 : 1);
            rows = qo[P.S];
        } else if (mb == 0xFE) {
            rows += 1; /* qo_indptr[S] != T */
        } else if (mb == 0xFF) {
            qo_arg = NULL;
        }
        trace(" qo_indptr=[");
        for (uint32_t s = 0; s <= P.S; s++)
            trace(s ? ",%d" : "%d", qo[s]);
        trace("]%s", qo_arg ? "" : " NULL");
        if (!qo_arg) {
            allow(&al, KV_ERR_NULL, "qo_indptr NULL");
        } else {
            if (qo[0] != 0)
                allow(&al, KV_ERR_CORRUPT, "qo_indptr[0]");
            for (uint32_t s = 0; s < P.S; s++) {
                if (qo[s + 1] < qo[s])
                    allow(&al, KV_ERR_CORRUPT, "qo_indptr decreasing");
                else if (P.ok && qo[s + 1] - qo[s] > P.tokens[s])
                    allow(&al, KV_ERR_BAD_SHAPE, "q_len past len");
            }
            if ((int64_t)qo[P.S] != rows)
                allow(&al, KV_ERR_BAD_SHAPE, "qo_indptr[S] != T");
        }
    } else {
        const uint8_t b = rd_u8(r);
        if (b >= 0xF0) {
            rows = (b & 1) || P.S == 0 ? P.S + 1 : P.S - 1;
            allow(&al, KV_ERR_BAD_SHAPE, "rows != n_seqs");
        }
    }

    /* q */
    const uint8_t qdb = rd_u8(r), qvb = rd_u8(r), hb = rd_u8(r);
    const kv_dtype qdt = qdb < 0xF0 ? k_dt5[qdb % 5] : KV_I8;
    int64_t hq = hb < 0xF0 ? H * (1 + hb % (4 / H)) : (hb & 1) ? H - 1 : H + 1;
    const int q_nd = (qvb >> 4) == 0xF ? 2 : 3;
    const int64_t qD = (qvb >> 4) == 0xE ? D + 1 : D;
    {
        const int64_t sh[3] = {rows, hq, qD}, sh2[2] = {rows, hq * qD};
        mk_tens(&q, qdt, q_nd, q_nd == 3 ? sh : sh2, (qvb & 7) % 5);
        fill_tens(&q, rng, false);
    }
    trace(" q{%s [%lld][%lld][%lld] nd=%d var=%d}", kv_dtype_name(qdt), (long long)rows,
          (long long)hq, (long long)qD, q_nd, (qvb & 7) % 5);
    if (qdt == KV_I8)
        allow(&al, KV_ERR_INVALID_ARG, "q dtype");
    if (q_nd != 3)
        allow(&al, KV_ERR_BAD_SHAPE, "q ndim");
    if (hq < H || hq % H != 0)
        allow(&al, KV_ERR_BAD_SHAPE, "Hq");
    if (qD != D)
        allow(&al, KV_ERR_BAD_SHAPE, "q D");

    /* out */
    const uint8_t odb = rd_u8(r), ovb = rd_u8(r);
    const kv_dtype odt = odb < 0xF0 ? k_dt5[odb % 5] : KV_F64;
    const int ohost = ovb >> 4;
    if (ohost == 0xF) { /* out = q */
        out = q;
        out.borrowed = true;
        trace(" out=q");
        if (!numel_zero(&q.v) && q_nd == 3)
            allow(&al, KV_ERR_OVERLAP, "out over q");
        if (q_nd != 3)
            allow(&al, KV_ERR_BAD_SHAPE, "out ndim");
        if (qdt == KV_I8)
            allow(&al, KV_ERR_INVALID_ARG, "out dtype");
    } else {
        int64_t sh[4] = {rows, hq, D, 1};
        int nd = 3;
        if (ohost == 0xC)
            sh[1] = hq + 1;
        else if (ohost == 0xB)
            sh[2] = D - 1;
        else if (ohost == 0xA)
            sh[0] = rows + 1;
        else if (ohost == 0x9)
            nd = 4;
        if (ohost == 0xE && !numel_zero(&q.v)) { /* over the cache's storage */
            int64_t ext = kv_dtype_size(odt) * sh[0] * sh[1] * sh[2];
            memset(&out, 0, sizeof(out));
            out.borrowed = true;
            out.buf = c->pc.base;
            out.bytes = c->bytes;
            if (ext > 0 && (size_t)ext <= c->bytes)
                CHECK(kv_view_init(c->pc.base, c->bytes, odt, 3, sh, &out.v) == KV_OK);
            else
                mk_tens(&out, odt, nd, sh, 0); /* too large for the pool: a plain one */
        } else {
            mk_tens(&out, odt, nd, sh, (ovb & 7) % 5);
        }
        if (ohost == 0xD && sh[1] >= 1 && out.borrowed == false) /* heads at stride 0 */
            out.v.strides[1] = 0;
        if (!out.borrowed)
            memset(out.buf, 0xA5, out.bytes);
        trace(" out{%s [%lld][%lld][%lld] nd=%d var=%d%s%s}", kv_dtype_name(odt), (long long)sh[0],
              (long long)sh[1], (long long)sh[2], nd, (ovb & 7) % 5,
              out.borrowed ? " in the cache" : "", ohost == 0xD ? " head stride 0" : "");
        if (odt == KV_F64)
            allow(&al, KV_ERR_INVALID_ARG, "out dtype");
        if (nd != 3 || sh[0] != rows || sh[1] != hq || sh[2] != D)
            allow(&al, KV_ERR_BAD_SHAPE, "out shape");
        if (!numel_zero(&out.v)) {
            if (out.borrowed)
                allow(&al, KV_ERR_OVERLAP, "out in the cache");
            if (ohost == 0xD && sh[1] >= 2)
                allow(&al, KV_ERR_OVERLAP, "out head stride 0");
        }
    }

    /* softmax scale */
    const uint8_t smb = rd_u8(r);
    const float isd = 1.0f / sqrtf((float)D);
    const float smv[10] = {isd,    0.5f * isd, 2.0f * isd, 0.0f,      -isd,
                           1e-30f, NAN,        INFINITY,   -INFINITY, 0.125f};
    const float smscale = smv[smb % 10];
    trace(" softmax_scale=%g", (double)smscale);
    if (!isfinite(smscale))
        allow(&al, KV_ERR_INVALID_ARG, "softmax_scale");

    /* options */
    struct kv_attn_opts o;
    const struct kv_attn_opts *oarg = NULL;
    float *lse = NULL, *lse_buf = NULL;
    size_t lse_bytes = 0;
    int64_t ls = hq;
    if (kind != 0) {
        const uint8_t ob = rd_u8(r), lb2 = rd_u8(r);
        if (ob != 0xFF) {
            kv_attn_opts_init(&o);
            o.window_left = k_windows[ob & 7];
            o.logit_soft_cap = k_caps[(ob >> 3) & 7];
            oarg = &o;
            trace(" opts{window=%d cap=%g", o.window_left, (double)o.logit_soft_cap);
            if (o.window_left < -1)
                allow(&al, KV_ERR_INVALID_ARG, "window");
            if (!(o.logit_soft_cap >= 0) || !isfinite(o.logit_soft_cap) ||
                (o.logit_soft_cap > 0 && !isfinite(1.0f / o.logit_soft_cap)))
                allow(&al, KV_ERR_INVALID_ARG, "soft cap");
            if (ob >= 0xC0 && ob < 0xC8) {
                o.struct_size -= 8;
                trace(" struct_size=%zu", o.struct_size);
                allow(&al, KV_ERR_INVALID_ARG, "struct_size");
            }
            if (lb2 != 0) {
                const int64_t lsv[6] = {0, hq, hq + 3, hq - 1, -1, 0};
                o.lse_stride = lsv[lb2 % 6];
                const int64_t eff = o.lse_stride ? o.lse_stride : hq;
                ls = o.lse_stride < 0 || eff < hq ? hq : eff;
                const size_t nf = rows > 0 ? (size_t)((rows - 1) * ls + hq) : 1;
                lse_bytes = nf * sizeof(float) + ((lb2 & 0x80) ? 1 : 0);
                lse_buf = xmalloc(lse_bytes);
                memset(lse_buf, 0x5C, lse_bytes);
                lse = (lb2 & 0x80) ? (float *)(void *)((char *)lse_buf + 1) : lse_buf;
                o.lse = lse;
                trace(" lse_stride=%lld%s", (long long)o.lse_stride,
                      (lb2 & 0x80) ? " misaligned" : "");
                if (o.lse_stride < 0 || eff < hq)
                    allow(&al, KV_ERR_INVALID_ARG, "lse_stride");
                if (lb2 & 0x80)
                    allow(&al, KV_ERR_INVALID_ARG, "lse misaligned");
            }
            trace("}");
        } else {
            trace(" opts=NULL");
        }
    }

    /* scales: the rows of this layer */
    const int64_t l0 = (int64_t)layer < L ? layer : 0;
    rd_scales(r, c, l0, l0 + 1, rng, &sc, &al, true);

    /* call */
    unsigned char *out0 = out.borrowed ? NULL : dup_bytes(out.buf, out.bytes);
    unsigned char *q0 = dup_bytes(q.buf, q.bytes);
    unsigned char *lse0 = lse_buf ? dup_bytes(lse_buf, lse_bytes) : NULL;
    const struct kv_view *qa = &q.v, *oa = &out.v;
    if (kind == 0)
        st = kv_attn_decode(c->pc, layer, qa, P.arg, smscale, sc.arg, oa);
    else if (kind == 1)
        st = kv_attn_decode_ex(c->pc, layer, qa, P.arg, smscale, sc.arg, oa, oarg);
    else
        st = kv_attn_prefill(c->pc, layer, qa, qo_arg, P.arg, smscale, sc.arg, oa, oarg);
    check_status(&al, st);
    CHECK(memcmp(c->pc.base, c->gold, c->bytes) == 0); /* attention never writes the cache */
    CHECK(memcmp(q.buf, q0, q.bytes) == 0);
    if (st != KV_OK) {
        if (out0)
            CHECK(memcmp(out.buf, out0, out.bytes) == 0);
        if (lse0)
            CHECK(memcmp(lse_buf, lse0, lse_bytes) == 0);
        goto free_all;
    }

    /* KV_OK: every row against the float64 reference */
    CHECK(P.ok);
    if (out.borrowed) { /* out over q or the cache: only an empty one passes */
        CHECK(numel_zero(&out.v));
        goto free_all;
    }
    {
        const int64_t g = hq / H, maxt = MAX_NP * 64;
        const int32_t win = oarg ? oarg->window_left : -1;
        const float cap = oarg ? oarg->logit_soft_cap : 0.0f;
        double *kd = xmalloc((size_t)(maxt * H * D) * sizeof(double));
        double *vd = xmalloc((size_t)(maxt * H * D) * sizeof(double));
        double *qv = xmalloc((size_t)D * sizeof(double)),
               *ref = xmalloc((size_t)D * sizeof(double));
        double *p = xmalloc((size_t)maxt * sizeof(double));
        for (uint32_t s = 0; s < P.S; s++) {
            const int64_t len = P.tokens[s];
            CHECK(len <= maxt);
            gather_seq(&P, c, &sc, layer, s, kd, vd);
            const int64_t nrow = kind == 2 ? qo[s + 1] - qo[s] : 1;
            const int64_t r0 = kind == 2 ? qo[s] : s;
            for (int64_t qi = 0; qi < nrow; qi++) {
                const int64_t row = r0 + qi, pos = len - nrow + qi;
                const int64_t lo = win < 0 || pos - win < 0 ? 0 : pos - win;
                for (int64_t qh = 0; qh < hq; qh++) {
                    double lref, tol_abs, eb;
                    for (int64_t d = 0; d < D; d++)
                        qv[d] = dec(qdt, at3(&q.v, row, qh, d));
                    ref_head(qv, kd, vd, H, D, qh / g, lo, pos, smscale, cap, p, ref, &lref,
                             &tol_abs, &eb);
                    const int64_t bad = cmp_row(&out.v, out0, out.buf, row, qh, ref, tol_abs);
                    if (bad >= 0) {
                        const int64_t d = bad;
                        unsigned char *op = at3(&out.v, row, qh, d);
                        const double got = dec(odt, op);
                        const double tol = 1e-5 * fmax(fabs(ref[d]), 0.1) + tol_abs +
                                           ulp_rel(odt) * fabs(ref[d]) + min_sub(odt);
                        {
                            trace("\n  out[%lld][%lld][%lld] (seq %u pos %lld, visible %lld..%lld)"
                                  " = %.9g, reference %.9g (tol %.3g)",
                                  (long long)row, (long long)qh, (long long)d, s, (long long)pos,
                                  (long long)lo, (long long)pos, got, ref[d], tol);
                            CHECK(fabs(got - ref[d]) <= tol);
                        }
                    }
                    if (lse) {
                        float lv;
                        unsigned char *lp = (unsigned char *)(lse + row * ls + qh);
                        memcpy(&lv, lp, sizeof(lv));
                        const bool ok = len == 0
                                            ? lv == -INFINITY
                                            : fabs(lv - lref) <= 2e-5 * fmax(1, fabs(lref)) + eb;
                        if (!ok) {
                            trace("\n  lse[%lld][%lld] = %.9g, reference %.9g", (long long)row,
                                  (long long)qh, (double)lv, lref);
                            CHECK(ok);
                        }
                        memcpy(lp, lse0 + (lp - (unsigned char *)lse_buf), sizeof(float));
                    }
                }
            }
        }
        free(kd);
        free(vd);
        free(qv);
        free(ref);
        free(p);
        /* nothing else of out's or lse's buffers written */
        CHECK(memcmp(out.buf, out0, out.bytes) == 0);
        if (lse0)
            CHECK(memcmp(lse_buf, lse0, lse_bytes) == 0);
    }

free_all:
    free(out0);
    free(q0);
    free(lse0);
    free(lse_buf);
    free_tens(&out);
    free_tens(&q);
    free(qo);
    free(sc.k);
    free(sc.v);
    free_pages(&P);
}

/* ---- write / write_i32 ------------------------------------------------------------- */

static void op_write(struct rd *r, struct cc *c, bool i32, uint64_t *rng)
{
    const int64_t L = c->t.L, H = c->t.H, D = c->t.D, N = c->t.N;
    const int64_t limit = c->t.B * N;
    struct allow al = {{0}, 0};
    struct scl sc;
    struct tens k, v;
    kv_status st;
    trace(" %s", i32 ? "kv_attn_write_i32" : "kv_attn_write");

    const uint8_t lb = rd_u8(r);
    int32_t layer;
    if (lb < 0xF0) {
        layer = (int32_t)(lb % (L + 1));
        if (layer == L)
            layer = KV_ATTN_ALL_LAYERS;
    } else {
        const int32_t v4[4] = {(int32_t)L, -2, INT32_MIN, (int32_t)L + 5};
        layer = v4[lb & 3];
    }
    const bool all = layer == KV_ATTN_ALL_LAYERS;
    trace(" layer=%d", layer);
    if (!all && (layer < 0 || layer >= L))
        allow(&al, KV_ERR_INVALID_ARG, "layer");

    const int64_t tmax = limit < MAX_WTOK ? limit : MAX_WTOK;
    const int64_t T = tmax - rd_u8(r) % (tmax + 1);
    const uint8_t nb = rd_u8(r);
    int64_t n_slots;
    if (nb < 0xF0) {
        n_slots = T - nb % (T + 1);
    } else {
        const int64_t v4[4] = {T + 1, -1, INT64_MAX, INT64_MIN};
        n_slots = v4[nb & 3];
    }
    const int64_t n_arr = n_slots > 0 && n_slots <= MAX_WTOK + 1 ? n_slots : 0;

    /* slots: a run, scattered, descending or every other slot; -1 now and then */
    int64_t sl[MAX_WTOK + 1];
    const uint8_t mb = rd_u8(r), sb = rd_u8(r), skb = rd_u8(r);
    {
        const int64_t n = n_arr;
        int mode = mb % 4;
        if (mode == 3 && 2 * n > limit)
            mode = 1;
        if (mode == 1) { /* distinct random slots: partial Fisher-Yates */
            int64_t *perm = xmalloc((size_t)limit * sizeof(int64_t));
            for (int64_t i = 0; i < limit; i++)
                perm[i] = i;
            for (int64_t i = 0; i < n && i < limit; i++) {
                const int64_t j = i + (int64_t)(mix64(rng) % (uint64_t)(limit - i));
                const int64_t x = perm[i];
                perm[i] = perm[j], perm[j] = x;
                sl[i] = perm[i];
            }
            for (int64_t i = limit; i < n; i++)
                sl[i] = -1;
            free(perm);
        } else {
            const int64_t span = mode == 3 ? 2 * n : n;
            const int64_t room = limit - span > 0 ? limit - span : 0;
            const int64_t start = room - sb % (room + 1); /* 0: the last slots, far from 0 */
            for (int64_t i = 0; i < n; i++) {
                const int64_t x = mode == 0   ? start + i
                                  : mode == 2 ? start + n - 1 - i
                                              : start + 2 * i;
                sl[i] = x < limit ? x : -1;
            }
        }
        if (skb != 0 && skb < 0xF0)
            for (int64_t i = skb % 5; i < n; i += 2 + skb % 5)
                sl[i] = -1;
        if (skb >= 0xF0) { /* hostile edits */
            const int edits = 1 + (skb & 3);
            for (int e = 0; e < edits && n > 0; e++) {
                const uint8_t pb = rd_u8(r), kb = rd_u8(r);
                const int64_t at = pb % n;
                switch (kb % 8) {
                case 0:
                    sl[at] = -2;
                    break;
                case 1:
                    sl[at] = limit;
                    break;
                case 2:
                    sl[at] = i32 ? INT32_MAX : INT64_MAX;
                    break;
                case 3:
                    sl[at] = i32 ? INT32_MIN : INT64_MIN;
                    break;
                case 4: /* a duplicate */
                    sl[at] = sl[(at + 1 + kb / 8) % n];
                    break;
                case 5:
                    sl[at] = -1;
                    break;
                case 6:
                    sl[at] = limit + N;
                    break;
                default:
                    sl[at] =
                        i32 ? -limit
                            : ((int64_t)1 << 32) + (sl[at] >= 0 && sl[at] < limit ? sl[at] : 0);
                    break;
                }
            }
        }
    }
    int64_t *s64 = NULL;
    int32_t *s32 = NULL;
    const void *sarg;
    if (i32) {
        s32 = xmalloc((size_t)n_arr * sizeof(int32_t));
        for (int64_t i = 0; i < n_arr; i++)
            s32[i] = (int32_t)sl[i];
        sarg = s32;
    } else {
        s64 = xmalloc((size_t)n_arr * sizeof(int64_t));
        memcpy(s64, sl, (size_t)n_arr * sizeof(int64_t));
        sarg = s64;
    }
    if (skb == 0xFF)
        sarg = NULL;
    trace(" T=%lld n_slots=%lld slots%s=[", (long long)T, (long long)n_slots, sarg ? "" : "(NULL)");
    for (int64_t i = 0; i < n_arr; i++)
        trace(i ? ",%lld" : "%lld", (long long)sl[i]);
    trace("]");
    if (n_slots > 0 && !sarg)
        allow(&al, KV_ERR_NULL, "slots NULL");
    for (int64_t i = 0; i < n_arr; i++) {
        if (sl[i] == -1)
            continue;
        if (sl[i] < -1 || sl[i] >= limit) {
            allow(&al, KV_ERR_OUT_OF_BOUNDS, "slot");
            continue;
        }
        for (int64_t j = 0; j < i; j++)
            if (sl[j] == sl[i]) {
                allow(&al, KV_ERR_OVERLAP, "slot twice");
                break;
            }
    }

    /* scales, then K and V */
    const int64_t l0 = all ? 0 : layer >= 0 && layer < L ? layer : 0, l1 = all ? L : l0 + 1;
    rd_scales(r, c, l0, l1, rng, &sc, &al, false);
    struct tens *kvt[2] = {&k, &v};
    kv_dtype tdt[2];
    bool tnull[2] = {false, false};
    int64_t tT[2];
    for (int w = 0; w < 2; w++) {
        const uint8_t db = rd_u8(r), vb = rd_u8(r);
        const int host = vb >> 4;
        tdt[w] = db < 0xC0 ? c->dt : db < 0xF0 ? k_dt5[db % 5] : KV_I32;
        int64_t sh[4];
        int nd = all ? 4 : 3, o = all ? 1 : 0;
        if (host == 0xB)
            nd = all ? 3 : 4, o = nd == 4 ? 1 : 0;
        if (nd == 4)
            sh[0] = L;
        sh[o] = host == 0xD ? T + 1 : T;
        sh[o + 1] = host == 0xC ? H + 1 : H;
        sh[o + 2] = D;
        const char *nm = w ? "v" : "k";
        if (host == 0xE && T > 0 && nd == 3) { /* over the cache's storage */
            memset(kvt[w], 0, sizeof(struct tens));
            kvt[w]->borrowed = true;
            kvt[w]->buf = c->pc.base;
            kvt[w]->bytes = c->bytes;
            if (kv_view_init(c->pc.base, c->bytes, tdt[w], nd, sh, &kvt[w]->v) == KV_OK) {
                allow(&al, KV_ERR_OVERLAP, "tensor in the cache");
            } else {
                kvt[w]->borrowed = false;
                mk_tens(kvt[w], tdt[w], nd, sh, 0);
            }
        } else {
            mk_tens(kvt[w], tdt[w], nd, sh, (vb & 7) % 5);
        }
        tnull[w] = host == 0xF;
        trace(" %s{%s nd=%d T=%lld H=%lld var=%d%s%s}", nm, kv_dtype_name(tdt[w]), nd,
              (long long)sh[o], (long long)sh[o + 1], (vb & 7) % 5,
              kvt[w]->borrowed ? " in the cache" : "", tnull[w] ? " NULL" : "");
        if (tnull[w])
            allow(&al, KV_ERR_NULL, w ? "v NULL" : "k NULL");
        if (tdt[w] == KV_I32)
            allow(&al, KV_ERR_INVALID_ARG, "dtype");
        if (nd != (all ? 4 : 3) || sh[o + 1] != H)
            allow(&al, KV_ERR_BAD_SHAPE, "shape");
        tT[w] = sh[o];
    }
    if (tT[0] != tT[1])
        allow(&al, KV_ERR_BAD_SHAPE, "k, v tokens differ");
    if (n_slots < 0 || n_slots > tT[0]) /* k's T */
        allow(&al, KV_ERR_BAD_SHAPE, "n_slots");
    const bool raw = sc.arg == NULL && tdt[0] == c->dt && tdt[1] == c->dt;
    fill_tens(&k, rng, raw);
    fill_tens(&v, rng, raw);
    unsigned char *k0 = dup_bytes(k.buf, k.bytes), *v0 = dup_bytes(v.buf, v.bytes);

    if (i32)
        st = kv_attn_write_i32(c->pc, layer, tnull[0] ? NULL : &k.v, tnull[1] ? NULL : &v.v,
                               (const int32_t *)sarg, n_slots, sc.arg);
    else
        st = kv_attn_write(c->pc, layer, tnull[0] ? NULL : &k.v, tnull[1] ? NULL : &v.v,
                           (const int64_t *)sarg, n_slots, sc.arg);
    check_status(&al, st);
    CHECK(k.borrowed || memcmp(k.buf, k0, k.bytes) == 0);
    CHECK(v.borrowed || memcmp(v.buf, v0, v.bytes) == 0);
    if (st != KV_OK) {
        CHECK(memcmp(c->pc.base, c->gold, c->bytes) == 0);
    } else {
        /* the reference scatter over the golden pool, compared whole */
        unsigned char *ref = dup_bytes(c->gold, c->bytes);
        for (int64_t i = 0; i < n_slots; i++) {
            if (sl[i] == -1)
                continue;
            const int64_t b = sl[i] / N, n = sl[i] % N;
            for (int64_t l = l0; l < l1; l++)
                for (int w = 0; w < 2; w++)
                    for (int64_t h = 0; h < H; h++)
                        for (int64_t d = 0; d < D; d++) {
                            const unsigned char *src =
                                all ? at4(&kvt[w]->v, l, i, h, d) : at3(&kvt[w]->v, i, h, d);
                            unsigned char *dst = ref + ref_off(c, l, w, b, n, h, d) * c->es;
                            if (raw) {
                                memcpy(dst, src, (size_t)c->es);
                            } else {
                                float x = (float)dec(tdt[w], src);
                                if (sc.arg)
                                    x = x / scale_of(&sc, l, w, h);
                                enc(c->dt, x, dst);
                            }
                        }
        }
        if (memcmp(c->pc.base, ref, c->bytes) != 0) {
            size_t i = 0;
            while (((unsigned char *)c->pc.base)[i] == ref[i])
                i++;
            trace("\n  cache byte %zu (element %zu) is 0x%02x, reference 0x%02x", i,
                  i / (size_t)c->es, ((unsigned char *)c->pc.base)[i], ref[i]);
            CHECK(memcmp(c->pc.base, ref, c->bytes) == 0);
        }
        free(ref);
        memcpy(c->pc.base, c->gold, c->bytes); /* the next call starts from the golden pool */
    }
    free(k0);
    free(v0);
    free_tens(&k);
    free_tens(&v);
    free(s64);
    free(s32);
    free(sc.k);
    free(sc.v);
}

/* ---- entry points ----------------------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    if (kv_set_threads(1) != KV_OK)
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct rd r = {data, size, 0};
    trace_reset();
    const uint8_t b0 = rd_u8(&r), b1 = rd_u8(&r), b2 = rd_u8(&r), b3 = rd_u8(&r);
    const int ti = b1 % N_TMPL, di = b2 % 5;
    struct cc *c = get_cache(ti, di);
    uint64_t rng = 0xA77Au + b3;
    trace(" cache{L=%lld B=%lld N=%lld H=%lld D=%lld %s %s%s%s pad=%lld extra=%lld}",
          (long long)c->t.L, (long long)c->t.B, (long long)c->t.N, (long long)c->t.H,
          (long long)c->t.D, kv_dtype_name(c->dt), c->t.order == KV_ORDER_NHD ? "NHD" : "HND",
          c->t.arrange == KV_ARRANGE_LAYER_MAJOR ? " layer-major" : " block-major",
          c->t.packed ? " packed" : "", (long long)c->t.pad_elems, (long long)c->t.extra_elems);
    set_paths(b0);
    switch ((b0 & 7) % 5) {
    case 0:
    case 1:
    case 2:
        op_attn(&r, c, (b0 & 7) % 5, &rng);
        break;
    case 3:
        op_write(&r, c, false, &rng);
        break;
    default:
        op_write(&r, c, true, &rng);
        break;
    }
    if (getenv("KV_FUZZ_TRACE") != NULL)
        fprintf(stderr, "call:%s\n", g_trace);
    return 0;
}
