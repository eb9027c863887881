/*
 * fuzz_dlpack.c - libFuzzer target for kv_view_from_dlpack (kvcache/kv_dlpack.h):
 * a caller's DLManagedTensor, every field of it hostile.
 *
 * Input bytes decode into one DLManagedTensor and the call's other
 * arguments (tests/fuzz/gen_corpus_dlpack.py writes seeds in this format):
 *
 *   api      t or out NULL (rarely), dev NULL or not, shape NULL
 *   device   kDLCPU / kDLCUDA / kDLCUDAHost, another known type, or any int32;
 *            id 0..3 or any int32
 *   dtype    one of kvcache's eight (code, bits), a near miss (fp8 codes of
 *            later DLPack versions, bool, i16, bits 0 / 12 / 1), or any
 *            (code, bits); lanes 1, 0..7 or any uint16
 *   ndim     0..8, or -1, 9, INT_MIN, INT_MAX, any int32
 *   shape    0..16 per dim, or a hostile int64 (rd_wild: +-2^k, 2^k +- 1,
 *            INT64_MIN/MAX, raw); the array holds exactly ndim entries (8
 *            for an ndim past 8, 1 for a negative one) so ASan sees any read
 *            past what the library may read
 *   strides  NULL, compact row-major given explicitly, a permutation of it
 *            (HND-like), padded, per dim small or hostile, or compact with
 *            one dim made hostile
 *   offset   byte_offset: whole elements, any small byte count (unaligned),
 *            0, or a hostile uint64
 *   data     a malloc'd buffer of exactly the size the input picks (the
 *            tensor's extent, less, more, or any size up to 8 KiB), data at
 *            its start or 1, 2, 4, 8 bytes in (misaligned); NULL; or an
 *            address no buffer is behind, never dereferenced (a low one;
 *            a data + extent past the top of the address space is refused,
 *            KV_ERR_OVERFLOW, tested in test_dlpack)
 *
 * Oracles. A reference model (ref_tensor) decides, from the fields alone,
 * whether the tensor is acceptable and, if not, which statuses its faults
 * allow (each fault has its status in kv_dlpack.h / kv_view.h):
 *
 *   refused:  the status is one that a fault of the tensor allows (none
 *             without a fault), kv_last_error() is fresh and names
 *             kv_view_from_dlpack (and, when the tensor has one fault, the
 *             offending value), *out and *dev are untouched;
 *   accepted: exactly when the model finds no fault; the view passes
 *             kv_view_check, dtype / ndim / shape equal the tensor's, strides
 *             equal the tensor's (elements) or compact row-major when NULL,
 *             offset = byte_offset / elem bytes, base = data (so the first
 *             element is data + byte_offset), storage_bytes = the extent
 *             (byte_offset + the last element's end; 0 when empty),
 *             kv_view_numel and kv_view_extent_bytes equal the model's
 *             (computed in 128 bits), *dev = the tensor's device;
 *   memory:   when data is inside the harness's buffer and the model's
 *             [lowest, highest) byte lies inside it, every element (all of a
 *             small view, corners and sampled indices of a large one) has
 *             kv_view_offset_of / kv_view_ptr equal to the naive stride sum,
 *             inside the buffer, and is read there (ASan checks the read);
 *             an index one past a dim is refused, its output untouched;
 *   export:   kv_view_to_dlpack of the view on the tensor's device: refused
 *             for a negative device id (release not called), otherwise the
 *             exported tensor has the same ndim, shape, strides (never NULL),
 *             dtype (lanes 1), device, byte_offset 0 and data = the first
 *             element (data + byte_offset; the base for an empty view); it
 *             imports back to the same view rebased at its first element;
 *             its deleter calls release exactly once with the owner given;
 *   borrowed: the tensor's fields and its shape / strides arrays are
 *             unchanged, its deleter is never called, and no byte of the
 *             buffer changes.
 *
 * Any mismatch prints the decoded tensor and aborts. Everything allocated
 * for an input is freed before returning (LeakSanitizer is on).
 */
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlpack/dlpack.h>

#include "kv_dlpack.h"
#include "kv_view.h"

#define FUZZ_NAME "fuzz_dlpack"
#define FUZZ_TRACE_LABEL "input"
#include "fuzz_check.h"

#define MAX_BUF_BYTES (1u << 20) /* an exact-fit buffer up to this size */
#define RAW_BUF_BYTES 8192       /* a buffer of any size up to this */
#define MAX_WALK_NUMEL 4096      /* every element up to this many */
#define WALK_SAMPLES 48          /* otherwise corners and this many indices */

/* products of int64 sizes and strides, exact (saturated past int64) */
__extension__ typedef __int128 i128;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ---- input reader ------------------------------------------------------- */

static uint64_t rd_le(struct rd *r, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)rd_u8(r) << (8 * i);
    return v;
}

/* A hostile int64: 2^k, 2^k + 1, 2^k - 1, -2^k, near INT64_MAX, near
 * INT64_MIN, a small negative, or 8 raw bytes. */
static int64_t rd_wild(struct rd *r)
{
    uint8_t b = rd_u8(r);
    int k = rd_u8(r) % 63, small = b & 0x1F;
    int64_t p = (int64_t)1 << k;
    switch (b >> 5) {
    case 0:
        return p;
    case 1:
        return p + 1;
    case 2:
        return p - 1;
    case 3:
        return -p;
    case 4:
        return INT64_MAX - small;
    case 5:
        return INT64_MIN + small;
    case 6:
        return -small - 1;
    default:
        return (int64_t)rd_le(r, 8);
    }
}

/* ---- the tensor under test ---------------------------------------------- */

enum data_mode { DATA_BUF, DATA_NULL, DATA_FAKE };

struct input {
    bool t_null, out_null, dev_null, shape_null;
    DLManagedTensor mt;
    int64_t *shape, *strides; /* malloc'd, exactly nshape entries; NULL or not */
    int nshape;
    int64_t shape_copy[KV_MAX_DIMS], strides_copy[KV_MAX_DIMS];
    enum data_mode data_mode;
    unsigned char *buf; /* DATA_BUF: data = buf + mis */
    size_t buf_bytes, mis;
    unsigned char *buf_copy;
};

/* ---- trace for crash reports -------------------------------------------- */

static void trace_list(const char *name, const int64_t *v, int n)
{
    if (!v) {
        trace(" %s=NULL", name);
        return;
    }
    trace(" %s=[", name);
    for (int i = 0; i < n; i++)
        trace(i ? ",%" PRId64 : "%" PRId64, v[i]);
    trace("]");
}

/* ---- decoding ----------------------------------------------------------- */

/* kvcache's dtypes as DLPack 0.6 spells them (kv_dlpack.h). */
static const struct {
    uint8_t code, bits;
    kv_dtype dt;
} g_types[] = {
    {kDLFloat, 32, KV_F32}, {kDLFloat, 16, KV_F16}, {kDLBfloat, 16, KV_BF16},
    {kDLFloat, 64, KV_F64}, {kDLInt, 8, KV_I8},     {kDLInt, 32, KV_I32},
    {kDLInt, 64, KV_I64},   {kDLUInt, 8, KV_U8},
};
#define NTYPES ((int)(sizeof(g_types) / sizeof(g_types[0])))

/* Near misses: later DLPack's bool (6) and fp8 codes (8: e4m3, 10: e4m3fn,
 * 12: e5m2), fp8 as kDLFloat bits 8, i16, u16, bf32, complex, handles,
 * bits 0, 1, 4, 12. */
static const uint8_t g_near[][2] = {
    {6, 8},         {8, 8},        {10, 8},         {12, 8},          {kDLFloat, 8},
    {kDLInt, 16},   {kDLUInt, 16}, {kDLBfloat, 32}, {kDLComplex, 64}, {kDLOpaqueHandle, 64},
    {kDLFloat, 0},  {kDLUInt, 1},  {kDLUInt, 4},    {kDLFloat, 12},   {kDLInt, 0},
    {kDLBfloat, 8},
};

static const int g_devices[] = {0,           kDLOpenCL, kDLVulkan,      kDLMetal, kDLVPI, kDLROCM,
                                kDLROCMHost, kDLExtDev, kDLCUDAManaged, 14,       5,      -1};

/* The element size of (code, bits) in kvcache; 0 when it has none. */
static size_t type_bytes(uint8_t code, uint8_t bits, kv_dtype *dt)
{
    for (int i = 0; i < NTYPES; i++)
        if (g_types[i].code == code && g_types[i].bits == bits) {
            if (dt)
                *dt = g_types[i].dt;
            return kv_dtype_size(g_types[i].dt);
        }
    return 0;
}

static int64_t rd_size(struct rd *r)
{
    uint8_t s = rd_u8(r);
    return s < 0xE0 ? s % 17 : rd_wild(r);
}

/* Compact row-major strides of shape[0..n), a size below 1 counting as 1
 * (what NULL strides mean); false when one does not fit in int64 (those
 * that do are still written). */
static bool compact_strides(const int64_t *shape, int n, int64_t *strides)
{
    i128 s = 1;
    bool ok = true;
    for (int i = n - 1; i >= 0; i--) {
        if (s > INT64_MAX) {
            ok = false;
            strides[i] = INT64_MAX;
        } else {
            strides[i] = (int64_t)s;
        }
        if (shape[i] > 1)
            s = s * shape[i] > (i128)INT64_MAX ? (i128)INT64_MAX + 1 : s * shape[i];
    }
    return ok;
}

static void decode(struct rd *r, struct input *in)
{
    DLTensor *t = &in->mt.dl_tensor;
    uint8_t b;

    memset(in, 0, sizeof(*in));
    b = rd_u8(r);
    if (b >= 0xF0) {
        in->t_null = (b & 3) == 0 || (b & 3) == 2;
        in->out_null = (b & 3) == 1 || (b & 3) == 2;
        in->shape_null = (b & 3) == 3;
    }
    in->dev_null = b & 1;

    b = rd_u8(r);
    t->device.device_type =
        (DLDeviceType)(b < 0xE0   ? (int[]){kDLCPU, kDLCUDA, kDLCUDAHost}[b % 3]
                       : b < 0xF0 ? g_devices[b % (sizeof(g_devices) / sizeof(g_devices[0]))]
                                  : (int)(int32_t)rd_le(r, 4));
    b = rd_u8(r);
    t->device.device_id = b < 0xF0 ? b % 4 : (int)(int32_t)rd_le(r, 4);

    b = rd_u8(r);
    if (b < 0xC0) {
        t->dtype.code = g_types[b % NTYPES].code;
        t->dtype.bits = g_types[b % NTYPES].bits;
    } else if (b < 0xE0) {
        const int nn = (int)(sizeof(g_near) / sizeof(g_near[0]));
        t->dtype.code = g_near[b % nn][0];
        t->dtype.bits = g_near[b % nn][1];
    } else {
        t->dtype.code = rd_u8(r);
        t->dtype.bits = rd_u8(r);
    }
    b = rd_u8(r);
    t->dtype.lanes = b < 0xF0 ? 1 : b < 0xF8 ? (uint16_t)(b - 0xF0) : (uint16_t)rd_le(r, 2);

    b = rd_u8(r);
    if (b < 0xF0) {
        t->ndim = b % 9;
    } else {
        static const int wild_ndim[] = {-1, 9, INT_MIN, INT_MAX, 16, -8, 255};
        t->ndim = (b & 7) < 7 ? wild_ndim[b & 7] : (int)(int32_t)rd_le(r, 4);
    }
    in->nshape = t->ndim < 0 ? 1 : t->ndim > KV_MAX_DIMS ? KV_MAX_DIMS : t->ndim;
    const int n = in->nshape;
    in->shape = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    CHECK(in->shape != NULL);
    for (int i = 0; i < n; i++)
        in->shape[i] = rd_size(r);

    /* strides */
    int64_t compact[KV_MAX_DIMS];
    compact_strides(in->shape, n, compact);
    b = rd_u8(r);
    const int smode = b % 8;
    if (smode >= 2) {
        in->strides = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
        CHECK(in->strides != NULL);
    }
    switch (smode) {
    case 2: /* compact, given */
        for (int i = 0; i < n; i++)
            in->strides[i] = compact[i];
        break;
    case 3: { /* compact strides of a permutation of the shape (HND over NHD) */
        int perm[KV_MAX_DIMS];
        int64_t pshape[KV_MAX_DIMS], pstr[KV_MAX_DIMS];
        for (int i = 0; i < n; i++)
            perm[i] = i;
        for (int i = n - 1; i > 0; i--) {
            int j = rd_u8(r) % (i + 1), x = perm[i];
            perm[i] = perm[j];
            perm[j] = x;
        }
        for (int i = 0; i < n; i++)
            pshape[i] = in->shape[perm[i]];
        compact_strides(pshape, n, pstr);
        for (int i = 0; i < n; i++)
            in->strides[perm[i]] = pstr[i];
        break;
    }
    case 4: { /* padded rows: each stride is the inner extent plus a pad */
        i128 s = 1;
        for (int i = n - 1; i >= 0; i--) {
            int pad = rd_u8(r) % 5;
            s += i == n - 1 ? 0 : pad;
            in->strides[i] = s > INT64_MAX ? INT64_MAX : (int64_t)s;
            if (in->shape[i] > 1)
                s = s * in->shape[i] > (i128)INT64_MAX ? (i128)INT64_MAX : s * in->shape[i];
        }
        break;
    }
    case 5:
    case 6: /* per dim: small (0 = broadcast) or hostile */
        for (int i = 0; i < n; i++) {
            uint8_t x = rd_u8(r);
            in->strides[i] = x < 0xC0 ? x % 32 : rd_wild(r);
        }
        break;
    case 7: /* compact with one dim hostile */
        for (int i = 0; i < n; i++)
            in->strides[i] = compact[i];
        if (n > 0) {
            const int d = rd_u8(r) % n; /* read before the value */
            in->strides[d] = rd_wild(r);
        }
        break;
    default: /* NULL: compact row-major */
        break;
    }

    /* byte_offset */
    size_t es = type_bytes(t->dtype.code, t->dtype.bits, NULL);
    b = rd_u8(r);
    t->byte_offset = b < 0x80   ? (uint64_t)(b % 8) * (es ? es : 1)
                     : b < 0xC0 ? (uint64_t)(b % 32)
                     : b < 0xE0 ? 0
                                : (uint64_t)rd_wild(r);

    t->shape = in->shape_null ? NULL : in->shape;
    t->strides = in->strides;
    for (int i = 0; i < n; i++) {
        in->shape_copy[i] = in->shape[i];
        in->strides_copy[i] = in->strides ? in->strides[i] : 0;
    }
}

/* ---- reference model ---------------------------------------------------- */

#define MAX_FAULTS 40

struct ref {
    kv_status fault[MAX_FAULTS]; /* the statuses the tensor's faults allow */
    int nfault;
    const char *word; /* with one fault: what its message must contain */
    char word_buf[64];
    /* the expected view when nfault == 0 */
    kv_dtype dt;
    size_t es;
    int64_t strides[KV_MAX_DIMS];
    int64_t numel;
    int64_t lo, hi; /* bytes from data: first and one past the last reached */
};

static void add_fault(struct ref *f, kv_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void add_fault(struct ref *f, kv_status st, const char *fmt, ...)
{
    va_list ap;
    CHECK(f->nfault < MAX_FAULTS);
    f->fault[f->nfault++] = st;
    va_start(ap, fmt);
    vsnprintf(f->word_buf, sizeof(f->word_buf), fmt, ap);
    va_end(ap);
    f->word = f->nfault == 1 ? f->word_buf : NULL;
    trace(" [fault %s: %s]", kv_status_name(st), f->word_buf);
}

/* Everything kv_dlpack.h and kv_view_from_strided promise about t, from its
 * fields alone: the faults (each with its status) and, without one, the
 * view. data is the tensor's data as an address. */
static void ref_tensor(const struct input *in, struct ref *f)
{
    const DLTensor *t = &in->mt.dl_tensor;
    const int64_t *shape = t->shape;
    memset(f, 0, sizeof(*f));
    if (in->t_null || in->out_null) {
        add_fault(f, KV_ERR_NULL, "NULL");
        return;
    }
    const int dev = (int)t->device.device_type;
    if (dev != kDLCPU && dev != kDLCUDA && dev != kDLCUDAHost)
        add_fault(f, KV_ERR_UNSUPPORTED, "(%d)", dev);
    if (t->dtype.lanes != 1)
        add_fault(f, KV_ERR_UNSUPPORTED, "lanes %u", (unsigned)t->dtype.lanes);
    f->es = type_bytes(t->dtype.code, t->dtype.bits, &f->dt);
    if (f->es == 0)
        add_fault(f, KV_ERR_UNSUPPORTED, "code %u bits %u", (unsigned)t->dtype.code,
                  (unsigned)t->dtype.bits);
    if (t->ndim < 0 || t->ndim > KV_MAX_DIMS) {
        add_fault(f, KV_ERR_BAD_DIM, "ndim %d", t->ndim);
        return; /* shape and strides cannot be read */
    }
    const int n = t->ndim;
    if (n > 0 && !shape) {
        add_fault(f, KV_ERR_NULL, "shape is NULL");
        return;
    }
    if (t->byte_offset > (uint64_t)INT64_MAX)
        add_fault(f, KV_ERR_OVERFLOW, "byte_offset %" PRIu64, t->byte_offset);
    if (t->strides) {
        for (int i = 0; i < n; i++)
            f->strides[i] = t->strides[i];
    } else if (!compact_strides(shape, n, f->strides)) {
        add_fault(f, KV_ERR_OVERFLOW, "int64");
    }
    bool neg = false, empty = false;
    for (int i = 0; i < n; i++) {
        if (shape[i] < 0) {
            add_fault(f, KV_ERR_BAD_SHAPE, "size %" PRId64, shape[i]);
            neg = true;
        }
        if (t->strides && t->strides[i] < 0) {
            add_fault(f, KV_ERR_INVALID_ARG, "stride %" PRId64, t->strides[i]);
            neg = true;
        }
        empty |= shape[i] == 0;
    }
    if (f->es == 0 || neg)
        return; /* the rest needs the element size and a valid geometry */
    if (t->byte_offset % f->es != 0)
        add_fault(f, KV_ERR_INVALID_ARG, "offset_bytes %" PRIu64, t->byte_offset);
    const uintptr_t data = (uintptr_t)t->data;
    if (data % f->es != 0)
        add_fault(f, KV_ERR_INVALID_ARG, "not aligned");
    /* numel, then the extent: byte_offset + (sum (shape-1)*stride + 1) * es,
     * saturated past int64 */
    const i128 big = (i128)INT64_MAX + 1;
    i128 numel = 1, last = 0;
    for (int i = 0; i < n && !empty; i++)
        numel = numel * shape[i] >= big ? big : numel * shape[i];
    if (empty)
        numel = 0;
    if (numel >= big) {
        add_fault(f, KV_ERR_OVERFLOW, "int64");
        return;
    }
    f->numel = (int64_t)numel;
    if (numel == 0)
        return;
    if (!t->data)
        add_fault(f, KV_ERR_NULL, "NULL");
    for (int i = 0; i < n; i++) {
        i128 term = (i128)(shape[i] - 1) * f->strides[i];
        last = last + term >= big ? big : last + term;
    }
    i128 hi = (last + 1) * (i128)f->es + (i128)t->byte_offset;
    if (hi >= big) {
        if (t->byte_offset <= (uint64_t)INT64_MAX)
            add_fault(f, KV_ERR_OVERFLOW, "int64");
        return;
    }
    f->lo = (int64_t)t->byte_offset;
    f->hi = (int64_t)hi;
}

static bool fault_allows(const struct ref *f, kv_status st)
{
    for (int i = 0; i < f->nfault; i++)
        if (f->fault[i] == st)
            return true;
    return false;
}

/* ---- checks ------------------------------------------------------------- */

/* The tensor, its arrays and its buffer as they were decoded. */
static void check_borrowed(const struct input *in, const DLTensor *t0)
{
    const DLTensor *t = &in->mt.dl_tensor;
    CHECK(t->data == t0->data && t->device.device_type == t0->device.device_type &&
          t->device.device_id == t0->device.device_id && t->ndim == t0->ndim &&
          t->dtype.code == t0->dtype.code && t->dtype.bits == t0->dtype.bits &&
          t->dtype.lanes == t0->dtype.lanes && t->shape == t0->shape && t->strides == t0->strides &&
          t->byte_offset == t0->byte_offset);
    for (int i = 0; i < in->nshape; i++) {
        CHECK(in->shape[i] == in->shape_copy[i]);
        CHECK(!in->strides || in->strides[i] == in->strides_copy[i]);
    }
    if (in->buf)
        CHECK(memcmp(in->buf, in->buf_copy, in->buf_bytes) == 0);
}

static void never_deleter(DLManagedTensor *self)
{
    (void)self;
    fail(__FILE__, __LINE__, "the borrowed tensor's deleter was called");
}

static int g_released;
static void *g_released_owner;

static void count_release(void *owner)
{
    g_released++;
    g_released_owner = owner;
}

/* A fresh, recognisable last error, so a refusal must write its own. */
static void stale_error(void)
{
    CHECK(kv_view_check(NULL) == KV_ERR_NULL);
    CHECK(strstr(kv_last_error(), "kv_view_from_dlpack") == NULL);
}

/* Element offset of idx by the naive stride sum. */
static int64_t ref_offset(const struct kv_view *v, const int64_t *idx)
{
    int64_t e = v->offset;
    for (int k = 0; k < v->ndim; k++)
        e += idx[k] * v->strides[k];
    return e;
}

static uint64_t g_lcg;

static uint64_t lcg(void)
{
    g_lcg = g_lcg * 6364136223846793005ull + 1442695040888963407ull;
    return g_lcg >> 11;
}

/* The harness's fill of buffer byte i. */
static unsigned char fill_byte(size_t i)
{
    return (unsigned char)(i * 0x9D + 0x3B);
}

/* One element: offset_of / ptr equal the naive sum, inside [lo, hi) of the
 * buffer that starts at buf, and read there (ASan) as the fill put it. */
static void check_element(const struct kv_view *v, const int64_t *idx, const unsigned char *buf,
                          const unsigned char *lo, const unsigned char *hi)
{
    int64_t got = -7;
    const int64_t want = ref_offset(v, idx);
    const size_t es = kv_dtype_size(v->dtype);
    CHECK(kv_view_offset_of(v, idx, &got) == KV_OK);
    CHECK(got == want);
    const unsigned char *p = kv_view_ptr(v, idx);
    CHECK(p != NULL);
    CHECK((uintptr_t)p == (uintptr_t)v->base + (uintptr_t)want * es);
    CHECK(p >= lo && p + es <= hi);
    for (size_t k = 0; k < es; k++)
        CHECK(p[k] == fill_byte((size_t)(p - buf) + k));
}

/* Every element of a view over the harness's buffer (sampled when large). */
static void check_memory(const struct input *in, const struct kv_view *v, const struct ref *f)
{
    int64_t idx[KV_MAX_DIMS] = {0};

    if (in->data_mode != DATA_BUF || f->numel == 0)
        return;
    const unsigned char *data = in->mt.dl_tensor.data;
    const unsigned char *b0 = in->buf, *b1 = in->buf + in->buf_bytes;
    /* [data + lo, data + hi) inside the buffer? (addresses as integers) */
    if ((uintptr_t)f->hi > (uintptr_t)(b1 - data) || (uintptr_t)f->lo > (uintptr_t)(b1 - data))
        return;
    trace(" [walk %" PRId64 " elements]", f->numel);
    const unsigned char *lo = data + f->lo, *hi = data + f->hi;
    CHECK(lo >= b0 && hi <= b1);
    if (f->numel <= MAX_WALK_NUMEL) {
        for (int64_t e = 0; e < f->numel; e++) {
            check_element(v, idx, b0, lo, hi);
            for (int d = v->ndim - 1; d >= 0; d--) {
                if (++idx[d] < v->shape[d])
                    break;
                idx[d] = 0;
            }
        }
    } else {
        for (int s = 0; s < WALK_SAMPLES; s++) {
            for (int d = 0; d < v->ndim; d++)
                idx[d] = s == 0   ? 0
                         : s == 1 ? v->shape[d] - 1
                                  : (int64_t)(lcg() % (uint64_t)v->shape[d]);
            check_element(v, idx, b0, lo, hi);
        }
    }
    /* the first element is at data + byte_offset, the last ends at hi */
    for (int d = 0; d < v->ndim; d++)
        idx[d] = 0;
    CHECK((const unsigned char *)kv_view_ptr(v, idx) == lo);
    for (int d = 0; d < v->ndim; d++)
        idx[d] = v->shape[d] - 1;
    CHECK((const unsigned char *)kv_view_ptr(v, idx) + kv_dtype_size(v->dtype) == hi);
    /* one past a dim: refused, output untouched */
    if (v->ndim > 0) {
        int d = (int)(lcg() % (uint64_t)v->ndim);
        int64_t got = -7;
        idx[d] = v->shape[d];
        stale_error();
        CHECK(kv_view_offset_of(v, idx, &got) == KV_ERR_OUT_OF_BOUNDS && got == -7);
        CHECK(kv_view_ptr(v, idx) == NULL);
    }
}

/* kv_view_to_dlpack of the imported view, the exported tensor against the
 * input, its import back, its deleter. */
static void check_export(const struct input *in, const struct kv_view *v, const struct ref *f)
{
    const DLTensor *t = &in->mt.dl_tensor;
    DLManagedTensor *x = (DLManagedTensor *)(uintptr_t)0x5A5A5A5A5A5A5A58u, *x0 = x;
    int owner;
    kv_status st;

    g_released = 0;
    g_released_owner = NULL;
    stale_error();
    st = kv_view_to_dlpack(v, t->device, count_release, &owner, &x);
    trace(" export -> %s", kv_status_name(st));
    if (t->device.device_id < 0) {
        CHECK(st == KV_ERR_INVALID_ARG);
        CHECK(strstr(kv_last_error(), "kv_view_to_dlpack") != NULL);
        CHECK(x == x0 && g_released == 0);
        return;
    }
    CHECK(st == KV_OK);
    CHECK(x != NULL && x != x0 && g_released == 0);
    const DLTensor *e = &x->dl_tensor;
    CHECK(e->ndim == t->ndim);
    CHECK(e->strides != NULL && (e->ndim == 0 || e->shape != NULL));
    for (int i = 0; i < t->ndim; i++)
        CHECK(e->shape[i] == t->shape[i] && e->strides[i] == f->strides[i]);
    CHECK(e->dtype.code == t->dtype.code && e->dtype.bits == t->dtype.bits && e->dtype.lanes == 1);
    CHECK(e->device.device_type == t->device.device_type &&
          e->device.device_id == t->device.device_id);
    CHECK(e->byte_offset == 0);
    if (f->numel > 0)
        CHECK((uintptr_t)e->data == (uintptr_t)t->data + (uintptr_t)t->byte_offset);
    else
        CHECK(e->data == t->data);
    CHECK(x->deleter != NULL);

    /* back again: the same view, rebased at its first element */
    struct kv_view w;
    DLDevice dev = {kDLOpenCL, -3};
    CHECK(kv_view_from_dlpack(x, &w, &dev) == KV_OK);
    CHECK(kv_view_check(&w) == KV_OK);
    CHECK(dev.device_type == t->device.device_type && dev.device_id == t->device.device_id);
    CHECK(w.dtype == v->dtype && w.ndim == v->ndim && w.offset == 0 && w.base == e->data);
    for (int i = 0; i < v->ndim; i++)
        CHECK(w.shape[i] == v->shape[i] && w.strides[i] == v->strides[i]);
    CHECK(w.storage_bytes == (f->numel > 0 ? (size_t)(f->hi - f->lo) : 0));

    x->deleter(x);
    CHECK(g_released == 1 && g_released_owner == &owner);
}

/* ---- the target --------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct rd r = {data, size, 0};
    struct input in;
    struct ref f;
    DLTensor *t = &in.mt.dl_tensor;

    trace_reset();
    g_lcg = size;
    for (size_t i = 0; i < size; i++)
        g_lcg = g_lcg * 31 + data[i];
    decode(&r, &in);

    /* data: a buffer of the input's size (from the model's extent), NULL or
     * an address without memory; decided last, the extent known */
    uint8_t b = rd_u8(&r);
    const uint8_t b2 = rd_u8(&r);
    const int dmode = b % 8;
    if (dmode == 5) {
        in.data_mode = DATA_NULL;
    } else if (dmode >= 6) {
        in.data_mode = DATA_FAKE; /* low and never dereferenced */
        t->data = (void *)(uintptr_t)((uintptr_t)(b2 + 1) * 4096 + (dmode == 7 ? b >> 5 : 0));
    } else {
        static const size_t mis[8] = {0, 0, 0, 0, 1, 2, 4, 8};
        in.data_mode = DATA_BUF;
        in.mis = mis[b >> 5];
        /* the extent of this tensor with an aligned data pointer */
        t->data = (void *)(uintptr_t)64;
        ref_tensor(&in, &f);
        trace_reset();
        size_t want = f.nfault == 0 ? (size_t)f.hi : RAW_BUF_BYTES + 1;
        switch ((b >> 3) & 3) {
        case 0: /* exactly the extent */
            in.buf_bytes = want;
            break;
        case 1: /* short of it */
            in.buf_bytes = want - (want > 0 ? 1 + b2 % (want < 8 ? want : 8) : 0);
            break;
        case 2: /* more */
            in.buf_bytes = want + b2 % 64;
            break;
        default:
            in.buf_bytes = (size_t)b2 * 32;
            break;
        }
        if (in.buf_bytes > MAX_BUF_BYTES)
            in.buf_bytes = (size_t)b2 * 32;
        in.buf = malloc(in.mis + in.buf_bytes + 1);
        in.buf_copy = malloc(in.mis + in.buf_bytes + 1);
        CHECK(in.buf != NULL && in.buf_copy != NULL);
        for (size_t i = 0; i < in.mis + in.buf_bytes; i++)
            in.buf[i] = fill_byte(i);
        in.buf_bytes += in.mis; /* the whole allocation, data inside it */
        memcpy(in.buf_copy, in.buf, in.buf_bytes);
        t->data = in.buf + in.mis;
    }
    in.mt.manager_ctx = &in;
    in.mt.deleter = never_deleter;

    trace(" %s%s%s%s", in.t_null ? "t=NULL " : "", in.out_null ? "out=NULL " : "",
          in.dev_null ? "dev=NULL " : "", in.shape_null ? "shape=NULL " : "");
    trace("device=(%d,%d) dtype=(%u,%u,%u) ndim=%d", (int)t->device.device_type,
          t->device.device_id, (unsigned)t->dtype.code, (unsigned)t->dtype.bits,
          (unsigned)t->dtype.lanes, t->ndim);
    trace_list("shape", t->shape, in.nshape);
    trace_list("strides", t->strides, in.nshape);
    trace(" byte_offset=%" PRIu64 " data=%p (%s, buffer %zu bytes, mis %zu)", t->byte_offset,
          t->data,
          in.data_mode == DATA_BUF    ? "buffer"
          : in.data_mode == DATA_NULL ? "NULL"
                                      : "fake",
          in.buf_bytes, in.mis);
    ref_tensor(&in, &f);

    const DLTensor t0 = *t;
    struct kv_view out, poison;
    DLDevice dev, dev_poison;
    /* poisoned byte by byte (an assignment need not copy padding) */
    memset(&out, 0xA5, sizeof(out));
    memset(&poison, 0xA5, sizeof(poison));
    memset(&dev, 0x5A, sizeof(dev));
    memset(&dev_poison, 0x5A, sizeof(dev_poison));
    stale_error();
    kv_status st = kv_view_from_dlpack(in.t_null ? NULL : &in.mt, in.out_null ? NULL : &out,
                                       in.dev_null ? NULL : &dev);
    trace(" -> %s", kv_status_name(st));
    check_borrowed(&in, &t0);

    if (f.nfault > 0) {
        CHECK(st != KV_OK);
        CHECK(fault_allows(&f, st));
        CHECK(strstr(kv_last_error(), "kv_view_from_dlpack") != NULL);
        CHECK(!f.word || strstr(kv_last_error(), f.word) != NULL);
        CHECK(memcmp(&out, &poison, sizeof(out)) == 0); /* check-test-compares: bytes (unwritten) */
        CHECK(memcmp(&dev, &dev_poison, sizeof(dev)) == 0); /* check-test-compares: bytes */
        goto free_all;
    }
    CHECK(st == KV_OK);
    CHECK(kv_view_check(&out) == KV_OK);
    CHECK(out.dtype == f.dt && out.ndim == t->ndim);
    for (int i = 0; i < t->ndim; i++)
        CHECK(out.shape[i] == t->shape[i] && out.strides[i] == f.strides[i]);
    CHECK(out.offset == (int64_t)(t->byte_offset / f.es));
    CHECK(out.base == t->data);
    CHECK((uintptr_t)out.base + (uintptr_t)out.offset * f.es ==
          (uintptr_t)t->data + (uintptr_t)t->byte_offset);
    CHECK(out.storage_bytes == (f.numel > 0 ? (size_t)f.hi : 0));
    CHECK(kv_view_numel(&out) == f.numel);
    {
        int64_t lo = -1, hi = -1;
        kv_view_extent_bytes(&out, &lo, &hi);
        CHECK(f.numel > 0 ? lo == f.lo && hi == f.hi : lo == 0 && hi == 0);
    }
    if (!in.dev_null)
        CHECK(dev.device_type == t->device.device_type && dev.device_id == t->device.device_id);
    check_memory(&in, &out, &f);
    check_export(&in, &out, &f);
    check_borrowed(&in, &t0);

free_all:
    if (getenv("KV_FUZZ_TRACE") != NULL) /* replaying a seed: show what it did */
        fprintf(stderr, "input:%s\n", g_trace);
    free(in.shape);
    free(in.strides);
    free(in.buf);
    free(in.buf_copy);
    return 0;
}
