/*
 * kv_layout_codec.c - a layout config as bytes and back
 * (kv_layout_config_encode / kv_layout_config_decode; the format is in
 * kv_layout.h and docs/kv-layout.md). Decode trusts nothing it reads: the
 * length before the fields, the checksum before the values, each value
 * before kv_layout_init, and the recorded fingerprint after it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kv_layout.h"
#include "kv_lib.h"
#include "kv_wire.h"

static const unsigned char kv__lc_magic[8] = {'K', 'V', 'L', 'A', 'Y', 'C', 'F', 'G'};

enum {
    LC_MAGIC = 0,
    LC_VERSION = 8,
    LC_FLAGS = 10,
    LC_LENGTH = 12,
    LC_PREAMBLE = 16, /* magic, version, flags, length: what every version shares */
    LC_L = 16,
    LC_B = 24,
    LC_N = 32,
    LC_H = 40,
    LC_D = 48,
    LC_PAD = 56,
    LC_STRIDE = 64,
    LC_ALIGN = 72,
    LC_ORDER = 80,
    LC_ARRANGE = 84,
    LC_PLANES = 88, /* 0 K and V, 1 kv_packed, 2 k_only */
    LC_RESERVED = 92,
    LC_DTYPE = 96,
    LC_DTYPE_BYTES = 16,
    LC_FP = 112,
    LC_SUM = 120,
    LC_BYTES = 128,
};
_Static_assert(LC_BYTES == KV_LAYOUT_CONFIG_WIRE_BYTES, "kv_layout.h documents another length");
_Static_assert(LC_SUM + 8 == LC_BYTES && LC_DTYPE + LC_DTYPE_BYTES == LC_FP, "field overlap");

kv_status kv_layout_config_encode(const struct kv_layout_config *cfg, void *buf, size_t cap,
                                  size_t *len)
{
    static const char fn[] = "kv_layout_config_encode";
    if (!cfg || !len)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !cfg ? "cfg" : "len");
    struct kv_layout lo;
    kv_status st = kv_layout_init(cfg, &lo);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: a config kv_layout_init refuses", fn);
    if (cap < LC_BYTES) {
        *len = LC_BYTES;
        return kv__error(KV_ERR_CAPACITY, "%s: %zu bytes of room, the encoding needs %u", fn, cap,
                         (unsigned)LC_BYTES);
    }
    if (!buf)
        return kv__error(KV_ERR_NULL, "%s: buf is NULL", fn);
    unsigned char b[LC_BYTES];
    memset(b, 0, sizeof(b));
    memcpy(b + LC_MAGIC, kv__lc_magic, sizeof(kv__lc_magic));
    kv__le_put16(b + LC_VERSION, KV_LAYOUT_CONFIG_WIRE_VERSION);
    kv__le_put16(b + LC_FLAGS, 0);
    kv__le_put32(b + LC_LENGTH, LC_BYTES);
    kv__le_put64(b + LC_L, (uint64_t)cfg->num_layers);
    kv__le_put64(b + LC_B, (uint64_t)cfg->num_blocks);
    kv__le_put64(b + LC_N, (uint64_t)cfg->block_tokens);
    kv__le_put64(b + LC_H, (uint64_t)cfg->num_heads);
    kv__le_put64(b + LC_D, (uint64_t)cfg->head_dim);
    kv__le_put64(b + LC_PAD, (uint64_t)cfg->block_pad_elems);
    kv__le_put64(b + LC_STRIDE, (uint64_t)cfg->block_stride_bytes);
    kv__le_put64(b + LC_ALIGN, (uint64_t)cfg->align_bytes);
    kv__le_put32(b + LC_ORDER, (uint32_t)cfg->order);
    kv__le_put32(b + LC_ARRANGE, (uint32_t)cfg->arrange);
    kv__le_put32(b + LC_PLANES, cfg->kv_packed ? 1u : cfg->k_only ? 2u : 0u);
    const char *name = kv_dtype_name(cfg->dtype); /* known: init accepted it */
    memcpy(b + LC_DTYPE, name, strnlen(name, LC_DTYPE_BYTES - 1));
    kv__le_put64(b + LC_FP, lo.fingerprint);
    kv__le_put64(b + LC_SUM, kv__xxh3_64(b, LC_SUM));
    memcpy(buf, b, sizeof(b));
    *len = LC_BYTES;
    return kv__ok();
}

/* The dtype whose kv_dtype_name is the NUL-padded name at p: the name must
 * end inside the field, every byte after it must be zero, and it must be a
 * name exactly (no aliases). Returns false when it is none. */
static bool dtype_of_name(const unsigned char *p, kv_dtype *out)
{
    const size_t n = strnlen((const char *)p, LC_DTYPE_BYTES);
    if (n == 0 || n == LC_DTYPE_BYTES)
        return false;
    for (size_t i = n; i < LC_DTYPE_BYTES; i++)
        if (p[i] != 0)
            return false;
    for (int d = 0; d < KV_DTYPE_COUNT; d++) {
        const char *name = kv_dtype_name((kv_dtype)d);
        if (strlen(name) == n && memcmp(name, p, n) == 0) {
            *out = (kv_dtype)d;
            return true;
        }
    }
    return false;
}

/* The dtype field as printable text for a message (hostile bytes: anything
 * outside printable ASCII shown as \xNN, at most the 16 bytes). */
static const char *dtype_field_text(const unsigned char *p, char *buf, size_t cap)
{
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < LC_DTYPE_BYTES && o + 5 < cap; i++) {
        if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '"' && p[i] != '\\')
            buf[o++] = (char)p[i];
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", p[i]);
    }
    buf[o < cap ? o : cap - 1] = '\0';
    return buf;
}

kv_status kv_layout_config_decode(const void *buf, size_t len, struct kv_layout_config *out)
{
    static const char fn[] = "kv_layout_config_decode";
    if (!buf || !out)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !buf ? "buf" : "out");
    const unsigned char *b = buf;
    if (len < sizeof(kv__lc_magic))
        return kv__error(KV_ERR_CORRUPT, "%s: truncated: %zu bytes, shorter than the 8-byte magic",
                         fn, len);
    if (memcmp(b, kv__lc_magic, sizeof(kv__lc_magic)) != 0)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: not a layout config: magic %02x %02x %02x %02x %02x %02x %02x %02x, "
                         "expected \"KVLAYCFG\"",
                         fn, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]);
    if (len < LC_PREAMBLE)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: truncated: %zu bytes, shorter than the %d-byte preamble (magic, "
                         "version, flags, length)",
                         fn, len, LC_PREAMBLE);
    /* the version before anything whose place a later version may move */
    const unsigned version = kv__le_get16(b + LC_VERSION);
    if (version != KV_LAYOUT_CONFIG_WIRE_VERSION)
        return kv__error(KV_ERR_MISMATCH,
                         "%s: encoding version %u; this library reads version %u only", fn, version,
                         KV_LAYOUT_CONFIG_WIRE_VERSION);
    const uint32_t length = kv__le_get32(b + LC_LENGTH);
    if (length != LC_BYTES)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: length field %" PRIu32 "; version %u encodings are %d bytes", fn,
                         length, version, LC_BYTES);
    if (len < LC_BYTES)
        return kv__error(KV_ERR_CORRUPT, "%s: truncated: %zu of the %d bytes of the encoding", fn,
                         len, LC_BYTES);
    if (len > LC_BYTES)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: %zu bytes, %zu more than the %d-byte encoding (trailing bytes)", fn,
                         len, len - LC_BYTES, LC_BYTES);
    const uint64_t sum = kv__le_get64(b + LC_SUM), want_sum = kv__xxh3_64(b, LC_SUM);
    if (sum != want_sum)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: checksum 0x%016" PRIx64 " recorded, the bytes hash to 0x%016" PRIx64,
                         fn, sum, want_sum);
    /* every field, checksum or not: the bytes may have been forged whole */
    const unsigned flags = kv__le_get16(b + LC_FLAGS);
    if (flags != 0)
        return kv__error(KV_ERR_CORRUPT, "%s: flags 0x%04x (version %u defines none)", fn, flags,
                         version);
    const uint32_t reserved = kv__le_get32(b + LC_RESERVED);
    if (reserved != 0)
        return kv__error(KV_ERR_CORRUPT, "%s: reserved field 0x%08" PRIx32 ", not zero", fn,
                         reserved);
    const uint32_t order = kv__le_get32(b + LC_ORDER), arrange = kv__le_get32(b + LC_ARRANGE),
                   planes = kv__le_get32(b + LC_PLANES);
    if (order > KV_ORDER_HND)
        return kv__error(KV_ERR_CORRUPT, "%s: order %" PRIu32 " (NHD = 0, HND = 1)", fn, order);
    if (arrange > KV_ARRANGE_BLOCK_MAJOR)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: arrange %" PRIu32 " (layer-major = 0, block-major = 1)", fn, arrange);
    if (planes > 2)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: planes %" PRIu32 " (0 K and V, 1 packed K|V, 2 K only)", fn, planes);
    kv_dtype dtype = KV_F32;
    if (!dtype_of_name(b + LC_DTYPE, &dtype)) {
        char text[LC_DTYPE_BYTES * 4 + 1];
        return kv__error(KV_ERR_CORRUPT,
                         "%s: dtype field \"%s\" is not a NUL-padded dtype name (\"bf16\")", fn,
                         dtype_field_text(b + LC_DTYPE, text, sizeof(text)));
    }
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = (int64_t)kv__le_get64(b + LC_L);
    c.num_blocks = (int64_t)kv__le_get64(b + LC_B);
    c.block_tokens = (int64_t)kv__le_get64(b + LC_N);
    c.num_heads = (int64_t)kv__le_get64(b + LC_H);
    c.head_dim = (int64_t)kv__le_get64(b + LC_D);
    c.block_pad_elems = (int64_t)kv__le_get64(b + LC_PAD);
    c.block_stride_bytes = (int64_t)kv__le_get64(b + LC_STRIDE);
    c.align_bytes = (int64_t)kv__le_get64(b + LC_ALIGN);
    c.order = (kv_order)order;
    c.arrange = (kv_arrange)arrange;
    c.kv_packed = planes == 1;
    c.k_only = planes == 2;
    c.dtype = dtype;
    struct kv_layout lo;
    kv_status st = kv_layout_init(&c, &lo);
    if (st != KV_OK)
        return kv__error_wrap(KV_ERR_CORRUPT, "%s: the encoded config is refused (%s)", fn,
                              kv_status_name(st));
    const uint64_t fp = kv__le_get64(b + LC_FP);
    if (fp != lo.fingerprint)
        return kv__error(KV_ERR_MISMATCH,
                         "%s: the config builds a layout of fingerprint 0x%016" PRIx64
                         " here, the sender recorded 0x%016" PRIx64
                         " (another fingerprint scheme, or a forged encoding)",
                         fn, lo.fingerprint, fp);
    *out = c;
    return kv__ok();
}
