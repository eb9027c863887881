/* kv_layout.c - KV cache layout descriptor: checks, strides, fingerprint. */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <xxhash.h>

#include "kv_layout.h"
#include "kv_lib.h"
#include "kv_wire.h"

const char *kv_order_name(kv_order o)
{
    switch (o) {
    case KV_ORDER_NHD:
        return "NHD";
    case KV_ORDER_HND:
        return "HND";
    }
    return "?";
}

const char *kv_arrange_name(kv_arrange a)
{
    switch (a) {
    case KV_ARRANGE_LAYER_MAJOR:
        return "layer-major";
    case KV_ARRANGE_BLOCK_MAJOR:
        return "block-major";
    }
    return "?";
}

/* ---- fingerprint --------------------------------------------------------- */

/* Canonical serialization: a tag, then fixed-width little-endian integers in
 * a fixed order, then the dtype name. Independent of struct padding, host
 * endianness and enum numbering of dtypes. */
struct kv__ser {
    unsigned char buf[256];
    size_t len;
};

static void ser_u64(struct kv__ser *s, uint64_t v)
{
    kv__le_put64(s->buf + s->len, v);
    s->len += 8;
}

/* XXH3-64 of: an 8-byte version tag, the fields as 64-bit little-endian
 * integers, then the dtype name NUL-padded to 16 bytes (stable across
 * reorderings of the dtype enum). */
static uint64_t fingerprint_of(const char tag[8], const int64_t *fields, size_t n, kv_dtype dt)
{
    struct kv__ser s = {.len = 0};
    char name[16] = {0};
    memcpy(s.buf, tag, 8);
    s.len = 8;
    for (size_t i = 0; i < n; i++)
        ser_u64(&s, (uint64_t)fields[i]);
    snprintf(name, sizeof(name), "%s", kv_dtype_name(dt));
    memcpy(s.buf + s.len, name, sizeof(name));
    s.len += sizeof(name);
    return XXH3_64bits(s.buf, s.len);
}

/* The planes field of both fingerprints and the wire: 0 K and V, 1 packed
 * K|V, 2 K only (so layouts without k_only keep their fingerprints). */
static int64_t planes_mode(const struct kv_layout *lo)
{
    return lo->kv_packed ? 1 : lo->k_only ? 2 : 0;
}

/* Everything: two layouts with equal fingerprints place every byte alike. */
static uint64_t layout_fingerprint(const struct kv_layout *lo)
{
    static const char tag[8] = {'k', 'v', 'l', 'a', 'y', 'o', 'u', '1'};
    const int64_t fields[] = {
        lo->num_layers,        lo->num_blocks,         lo->block_tokens,
        lo->num_heads,         lo->head_dim,           lo->elem_bytes,
        (int64_t)lo->order,    (int64_t)lo->arrange,   planes_mode(lo),
        lo->align_bytes,       lo->block_stride_bytes, lo->stride_layer_bytes,
        lo->stride_kv_bytes,   lo->stride_block_bytes, lo->stride_token_bytes,
        lo->stride_head_bytes, lo->stride_dim_bytes,   lo->total_bytes,
    };
    _Static_assert(8 + sizeof(fields) + 16 <= sizeof(((struct kv__ser *)0)->buf),
                   "fingerprint buffer too small");
    return fingerprint_of(tag, fields, sizeof(fields) / sizeof(fields[0]), lo->dtype);
}

/* What one block holds, independent of where blocks sit: layers, tokens per
 * block, heads, head dim, dtype, in-block order, K|V packing. Excludes the
 * block count, padding, alignment and arrangement (placement only). */
static uint64_t layout_block_format_fingerprint(const struct kv_layout *lo)
{
    static const char tag[8] = {'k', 'v', 'b', 'l', 'o', 'c', 'k', '1'};
    const int64_t fields[] = {
        lo->num_layers, lo->block_tokens,   lo->num_heads,          lo->head_dim,
        lo->elem_bytes, (int64_t)lo->order, planes_mode(lo),
    };
    return fingerprint_of(tag, fields, sizeof(fields) / sizeof(fields[0]), lo->dtype);
}

/* ---- init ------------------------------------------------------------------ */

static kv_status check_dim(const char *name, int64_t v)
{
    if (v < 1)
        return kv__error(KV_ERR_BAD_SHAPE, "kv_layout_init: %s = %" PRId64 " must be >= 1", name,
                         v);
    return KV_OK;
}

kv_status kv_layout_init(const struct kv_layout_config *cfg, struct kv_layout *out)
{
    if (!cfg || !out)
        return kv__error(KV_ERR_NULL, "kv_layout_init: %s is NULL", !cfg ? "cfg" : "out");
    kv_status abi =
        kv__check_struct_size("kv_layout_init", "kv_layout_config", cfg->struct_size, sizeof(*cfg));
    if (abi != KV_OK)
        return abi;

    const int64_t es = (int64_t)kv_dtype_size(cfg->dtype);
    if (es == 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_layout_init: unknown dtype %d", (int)cfg->dtype);
    if (cfg->order != KV_ORDER_NHD && cfg->order != KV_ORDER_HND)
        return kv__error(KV_ERR_INVALID_ARG, "kv_layout_init: unknown order %d (NHD=0, HND=1)",
                         (int)cfg->order);
    if (cfg->arrange != KV_ARRANGE_LAYER_MAJOR && cfg->arrange != KV_ARRANGE_BLOCK_MAJOR)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_layout_init: unknown arrangement %d (layer-major=0, block-major=1)",
                         (int)cfg->arrange);

    kv_status st;
    if ((st = check_dim("num_layers", cfg->num_layers)) != KV_OK ||
        (st = check_dim("num_blocks", cfg->num_blocks)) != KV_OK ||
        (st = check_dim("block_tokens", cfg->block_tokens)) != KV_OK ||
        (st = check_dim("num_heads", cfg->num_heads)) != KV_OK ||
        (st = check_dim("head_dim", cfg->head_dim)) != KV_OK)
        return st;
    if (cfg->num_blocks > ((int64_t)1 << 32))
        return kv__error(KV_ERR_BAD_SHAPE,
                         "kv_layout_init: num_blocks = %" PRId64 " exceeds 2^32 (ids are uint32)",
                         cfg->num_blocks);
    if (cfg->num_layers > ((int64_t)1 << 32))
        return kv__error(KV_ERR_BAD_SHAPE, "kv_layout_init: num_layers = %" PRId64 " exceeds 2^32",
                         cfg->num_layers);
    if (cfg->block_pad_elems < 0)
        return kv__error(KV_ERR_BAD_SHAPE, "kv_layout_init: block_pad_elems = %" PRId64 " < 0",
                         cfg->block_pad_elems);
    if (cfg->block_stride_bytes < 0)
        return kv__error(KV_ERR_BAD_SHAPE, "kv_layout_init: block_stride_bytes = %" PRId64 " < 0",
                         cfg->block_stride_bytes);
    if (cfg->block_pad_elems != 0 && cfg->block_stride_bytes != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_layout_init: block_pad_elems = %" PRId64
                         " and block_stride_bytes = %" PRId64 " both set; set one",
                         cfg->block_pad_elems, cfg->block_stride_bytes);
    if (cfg->k_only && cfg->kv_packed)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_layout_init: k_only and kv_packed both set: a K-only (MLA) layout "
                         "has no V to pack");
    int64_t align = cfg->align_bytes == 0 ? es : cfg->align_bytes;
    if (align < 0 || (align & (align - 1)) != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_layout_init: align_bytes = %" PRId64 " is not a power of two",
                         cfg->align_bytes);

    struct kv_layout lo;
    memset(&lo, 0, sizeof(lo));
    lo.num_layers = cfg->num_layers;
    lo.num_blocks = cfg->num_blocks;
    lo.block_tokens = cfg->block_tokens;
    lo.num_heads = cfg->num_heads;
    lo.head_dim = cfg->head_dim;
    lo.dtype = cfg->dtype;
    lo.order = cfg->order;
    lo.arrange = cfg->arrange;
    lo.kv_packed = cfg->kv_packed;
    lo.elem_bytes = es;
    lo.align_bytes = align;
    lo.k_only = cfg->k_only;
    lo.kv_planes = cfg->kv_packed || cfg->k_only ? 1 : 2;

    const int64_t N = lo.block_tokens, H = lo.num_heads, D = lo.head_dim;
    const int64_t L = lo.num_layers, B = lo.num_blocks, P = lo.kv_planes;
    int64_t row = 0, nh = 0, blk = 0, blk_bytes = 0;
    const int64_t row_dims = cfg->kv_packed ? 2 : 1; /* D per head row, 2D packed */
    if (!kv__mul_i64(D, row_dims, &row) || !kv__mul_i64(N, H, &nh) || !kv__mul_i64(nh, row, &blk) ||
        !kv__mul_i64(blk, es, &blk_bytes))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_layout_init: block of N=%" PRId64 " x H=%" PRId64 " x D=%" PRId64
                         " x %" PRId64 " planes x %" PRId64 " bytes overflows int64",
                         N, H, D, row_dims, es);
    lo.block_elems = blk;
    lo.block_bytes = blk_bytes;

    if (cfg->block_stride_bytes != 0) {
        if (cfg->block_stride_bytes % es != 0)
            return kv__error(KV_ERR_INVALID_ARG,
                             "kv_layout_init: block_stride_bytes = %" PRId64
                             " is not a multiple of the element size %" PRId64
                             " (head-dim rows would be misaligned)",
                             cfg->block_stride_bytes, es);
        if (cfg->block_stride_bytes < blk_bytes)
            return kv__error(KV_ERR_OVERLAP,
                             "kv_layout_init: block_stride_bytes = %" PRId64
                             " < natural block size %" PRId64 " bytes: blocks would overlap",
                             cfg->block_stride_bytes, blk_bytes);
        lo.block_stride_elems = cfg->block_stride_bytes / es;
    } else if (!kv__add_i64(blk, cfg->block_pad_elems, &lo.block_stride_elems)) {
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_layout_init: block %" PRId64 " + pad %" PRId64 " elems overflows", blk,
                         cfg->block_pad_elems);
    }
    const int64_t bs = lo.block_stride_elems;
    if (!kv__mul_i64(bs, es, &lo.block_stride_bytes))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_layout_init: block stride %" PRId64 " elems x %" PRId64
                         " bytes overflows int64",
                         bs, es);
    if (lo.block_stride_bytes % align != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_layout_init: block stride %" PRId64
                         " bytes is not a multiple of align_bytes %" PRId64,
                         lo.block_stride_bytes, align);

    /* total = L * P * B * bs elements, and in bytes; every stride below is a
     * factor of a term <= total, so checking the total covers them. */
    int64_t t1 = 0, t2 = 0, total = 0, total_bytes = 0;
    if (!kv__mul_i64(L, P, &t1) || !kv__mul_i64(t1, B, &t2) || !kv__mul_i64(t2, bs, &total) ||
        !kv__mul_i64(total, es, &total_bytes))
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_layout_init: L=%" PRId64 " x planes=%" PRId64 " x B=%" PRId64
                         " x block stride %" PRId64 " elems x %" PRId64 " bytes overflows int64",
                         L, P, B, bs, es);
    if ((uint64_t)total_bytes > (uint64_t)SIZE_MAX)
        return kv__error(KV_ERR_OVERFLOW,
                         "kv_layout_init: total %" PRId64 " bytes exceeds SIZE_MAX", total_bytes);
    lo.total_elems = total;
    lo.total_bytes = total_bytes;

    /* in-block strides */
    lo.stride_dim_elems = 1;
    if (lo.order == KV_ORDER_NHD) {
        lo.stride_head_elems = row;
        lo.stride_token_elems = H * row;
    } else {
        lo.stride_token_elems = row;
        lo.stride_head_elems = N * row;
    }
    /* arrangement strides */
    if (lo.arrange == KV_ARRANGE_LAYER_MAJOR) {
        lo.stride_block_elems = bs;
        lo.stride_kv_elems = cfg->kv_packed ? D : cfg->k_only ? 0 : B * bs;
        lo.stride_layer_elems = P * B * bs;
    } else {
        lo.stride_kv_elems = cfg->kv_packed ? D : cfg->k_only ? 0 : bs;
        lo.stride_layer_elems = P * bs;
        lo.stride_block_elems = L * P * bs;
    }
    lo.stride_layer_bytes = lo.stride_layer_elems * es;
    lo.stride_kv_bytes = lo.stride_kv_elems * es;
    lo.stride_block_bytes = lo.stride_block_elems * es;
    lo.stride_token_bytes = lo.stride_token_elems * es;
    lo.stride_head_bytes = lo.stride_head_elems * es;
    lo.stride_dim_bytes = lo.stride_dim_elems * es;

    lo.fingerprint = layout_fingerprint(&lo);
    lo.block_format_fingerprint = layout_block_format_fingerprint(&lo);
    *out = lo;
    return kv__ok();
}

/* ---- back to a config ------------------------------------------------------ */

/* The derived int64 fields of a layout, in struct order: what
 * kv_layout_config_from compares after rebuilding. */
static const struct {
    const char *name;
    size_t off;
} kv__layout_i64[] = {
#define KV__F(f)                                                                                   \
    {                                                                                              \
#f, offsetof(struct kv_layout, f)                                                          \
    }
    KV__F(num_layers),         KV__F(num_blocks),         KV__F(block_tokens),
    KV__F(num_heads),          KV__F(head_dim),           KV__F(elem_bytes),
    KV__F(align_bytes),        KV__F(kv_planes),          KV__F(block_elems),
    KV__F(block_bytes),        KV__F(block_stride_elems), KV__F(block_stride_bytes),
    KV__F(stride_layer_elems), KV__F(stride_kv_elems),    KV__F(stride_block_elems),
    KV__F(stride_token_elems), KV__F(stride_head_elems),  KV__F(stride_dim_elems),
    KV__F(stride_layer_bytes), KV__F(stride_kv_bytes),    KV__F(stride_block_bytes),
    KV__F(stride_token_bytes), KV__F(stride_head_bytes),  KV__F(stride_dim_bytes),
    KV__F(total_elems),        KV__F(total_bytes),
#undef KV__F
};

static int64_t layout_i64(const struct kv_layout *lo, size_t off)
{
    int64_t v;
    memcpy(&v, (const unsigned char *)lo + off, sizeof(v));
    return v;
}

kv_status kv_layout_config_from(const struct kv_layout *lo, struct kv_layout_config *out)
{
    static const char fn[] = "kv_layout_config_from";
    if (!lo || !out)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !lo ? "layout" : "out");
    struct kv_layout_config c;
    kv_layout_config_init(&c);
    c.num_layers = lo->num_layers;
    c.num_blocks = lo->num_blocks;
    c.block_tokens = lo->block_tokens;
    c.num_heads = lo->num_heads;
    c.head_dim = lo->head_dim;
    c.dtype = lo->dtype;
    c.order = lo->order;
    c.arrange = lo->arrange;
    c.kv_packed = lo->kv_packed;
    c.k_only = lo->k_only;
    c.align_bytes = lo->align_bytes;
    /* padding in bytes: exact whatever the config said (pad elems or stride) */
    c.block_stride_bytes = lo->block_stride_elems == lo->block_elems ? 0 : lo->block_stride_bytes;
    struct kv_layout again;
    kv_status st = kv_layout_init(&c, &again);
    if (st != KV_OK)
        return kv__error_wrap(KV_ERR_INVALID_ARG, "%s: not a layout kv_layout_init computed", fn);
    for (size_t i = 0; i < sizeof(kv__layout_i64) / sizeof(kv__layout_i64[0]); i++) {
        const int64_t got = layout_i64(lo, kv__layout_i64[i].off);
        const int64_t want = layout_i64(&again, kv__layout_i64[i].off);
        if (got != want)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: layout field %s is %" PRId64 ", kv_layout_init computes %" PRId64
                             " for the same dims (a hand-built or corrupted layout)",
                             fn, kv__layout_i64[i].name, got, want);
    }
    if (lo->fingerprint != again.fingerprint ||
        lo->block_format_fingerprint != again.block_format_fingerprint)
        return kv__error(
            KV_ERR_INVALID_ARG,
            "%s: layout field %s is 0x%016" PRIx64 ", kv_layout_init computes 0x%016" PRIx64
            " for the same fields (a hand-built or corrupted layout)",
            fn, lo->fingerprint != again.fingerprint ? "fingerprint" : "block_format_fingerprint",
            lo->fingerprint != again.fingerprint ? lo->fingerprint : lo->block_format_fingerprint,
            lo->fingerprint != again.fingerprint ? again.fingerprint
                                                 : again.block_format_fingerprint);
    *out = c;
    return kv__ok();
}

/* ---- queries ------------------------------------------------------------- */

kv_status kv_layout_kv_view(const struct kv_layout *lo, void *base, size_t storage_bytes,
                            uint32_t layer, int kv, struct kv_view *out)
{
    if (!lo || !base || !out)
        return kv__error(KV_ERR_NULL, "kv_layout_kv_view: %s is NULL",
                         !lo     ? "layout"
                         : !base ? "base"
                                 : "out");
    if ((int64_t)layer >= lo->num_layers)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_layout_kv_view: layer %" PRIu32 " >= num_layers %" PRId64, layer,
                         lo->num_layers);
    if (kv != 0 && kv != 1)
        return kv__error(KV_ERR_INVALID_ARG, "kv_layout_kv_view: kv = %d (0 = K, 1 = V)", kv);
    if (kv == 1 && lo->k_only)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_layout_kv_view: kv = 1 (V) of a K-only (MLA) layout: it has no V");
    if ((uint64_t)storage_bytes < (uint64_t)lo->total_bytes)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_layout_kv_view: storage of %zu bytes < layout total %" PRId64 " bytes",
                         storage_bytes, lo->total_bytes);
    struct kv_view v;
    memset(&v, 0, sizeof(v));
    v.dtype = lo->dtype;
    v.ndim = 4;
    v.shape[0] = lo->num_blocks;
    v.shape[1] = lo->block_tokens;
    v.shape[2] = lo->num_heads;
    v.shape[3] = lo->head_dim;
    v.strides[0] = lo->stride_block_elems;
    v.strides[1] = lo->stride_token_elems;
    v.strides[2] = lo->stride_head_elems;
    v.strides[3] = lo->stride_dim_elems;
    v.offset = (int64_t)layer * lo->stride_layer_elems + (int64_t)kv * lo->stride_kv_elems;
    v.base = base;
    v.storage_bytes = storage_bytes;
    /* A view handed out satisfies the view invariants (an aligned base,
     * extents inside storage): a forged layout or a misaligned base is
     * refused here, not by the first op on the result. */
    const kv_status st = kv_view_check(&v);
    if (st != KV_OK)
        return kv__error_wrap(st, "kv_layout_kv_view: layer %" PRIu32 ", kv %d", layer, kv);
    *out = v;
    return kv__ok();
}

kv_status kv_layout_offset(const struct kv_layout *lo, uint32_t layer, int kv, uint32_t block,
                           uint32_t token, uint32_t head, uint32_t d, int64_t *out_elems)
{
    if (!lo || !out_elems)
        return kv__error(KV_ERR_NULL, "kv_layout_offset: %s is NULL", !lo ? "layout" : "out");
    if (kv != 0 && kv != 1)
        return kv__error(KV_ERR_INVALID_ARG, "kv_layout_offset: kv = %d (0 = K, 1 = V)", kv);
    if (kv == 1 && lo->k_only)
        return kv__error(KV_ERR_INVALID_ARG,
                         "kv_layout_offset: kv = 1 (V) of a K-only (MLA) layout: it has no V");
    const struct {
        const char *name;
        uint32_t v;
        int64_t lim;
    } c[] = {{"layer", layer, lo->num_layers},
             {"block", block, lo->num_blocks},
             {"token", token, lo->block_tokens},
             {"head", head, lo->num_heads},
             {"d", d, lo->head_dim}};
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++)
        if ((int64_t)c[i].v >= c[i].lim)
            return kv__error(KV_ERR_OUT_OF_BOUNDS, "kv_layout_offset: %s %" PRIu32 " >= %" PRId64,
                             c[i].name, c[i].v, c[i].lim);
    *out_elems = kv_layout_elem_offset(lo, layer, kv, block, token, head, d);
    return kv__ok();
}

kv_status kv_layout_block_runs(const struct kv_layout *lo, uint32_t block, struct kv_byte_runs *out)
{
    if (!lo || !out)
        return kv__error(KV_ERR_NULL, "kv_layout_block_runs: %s is NULL", !lo ? "layout" : "out");
    if ((int64_t)block >= lo->num_blocks)
        return kv__error(KV_ERR_OUT_OF_BOUNDS,
                         "kv_layout_block_runs: block %" PRIu32 " >= num_blocks %" PRId64, block,
                         lo->num_blocks);
    struct kv_byte_runs r;
    r.first_offset_bytes = (int64_t)block * lo->stride_block_bytes;
    r.run_bytes = lo->block_bytes;
    r.run_count = lo->num_layers * lo->kv_planes;
    /* consecutive (layer, plane) storage blocks of one block id are
     * block_stride apart in block-major, B * block_stride in layer-major */
    r.run_stride_bytes = lo->arrange == KV_ARRANGE_BLOCK_MAJOR
                             ? lo->block_stride_bytes
                             : lo->num_blocks * lo->block_stride_bytes;
    if (r.run_count == 1 || r.run_stride_bytes == r.run_bytes) {
        r.run_bytes *= r.run_count;
        r.run_count = 1;
        r.run_stride_bytes = r.run_bytes;
    }
    *out = r;
    return kv__ok();
}

int kv_layout_describe(const struct kv_layout *lo, char *buf, size_t cap)
{
    if (!lo)
        return snprintf(buf, cap, "(null layout)");
    return snprintf(buf, cap,
                    "L=%" PRId64 " B=%" PRId64 " N=%" PRId64 " H=%" PRId64 " D=%" PRId64
                    " %s %s %s%s block=%" PRId64 "B stride=%" PRId64 "B align=%" PRId64
                    " strides(l,kv,b,n,h,d)=[%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64
                    ",%" PRId64 ",%" PRId64 "]elems total=%" PRId64 "B fp=0x%016" PRIx64,
                    lo->num_layers, lo->num_blocks, lo->block_tokens, lo->num_heads, lo->head_dim,
                    kv_dtype_name(lo->dtype), kv_order_name(lo->order),
                    kv_arrange_name(lo->arrange),
                    lo->kv_packed ? " packed-K|V"
                    : lo->k_only  ? " K-only"
                                  : "",
                    lo->block_bytes, lo->block_stride_bytes, lo->align_bytes,
                    lo->stride_layer_elems, lo->stride_kv_elems, lo->stride_block_elems,
                    lo->stride_token_elems, lo->stride_head_elems, lo->stride_dim_elems,
                    lo->total_bytes, lo->fingerprint);
}
