/*
 * kv_pack.c - pack/unpack in the self-describing wire format (kv_pack.h;
 * the byte-by-byte format is in docs/connector.md).
 *
 * Fixed header, version 2 (little-endian; offsets in bytes):
 *
 *     0  u8[8] magic "KVPACK\r\n"      64  i64 B (source blocks)
 *     8  u32   version (2)             72  i64 N
 *    12  u32   fixed bytes (152)       80  i64 H
 *    16  u64   header bytes            88  i64 D
 *    24  u64   payload bytes           96  u32 dtype (kv_dtype value)
 *    32  u64   n_tokens               100  u32 order (kv_order value)
 *    40  u32   n_blocks               104  u32 arrangement (kv_arrange value)
 *    44  u32   flags (0)              108  u32 planes (0 K and V, 1 packed, 2 K only)
 *    48  u64   source fingerprint     112  i64 block stride bytes
 *    56  i64   L                      120  i64 align bytes
 *                                     128  u64 payload block bytes
 *                                     136  u64 first packed layer
 *                                     144  u64 packed layers
 *   152  u64[n_blocks] XXH3-64 of each payload block
 *   152 + 8 n_blocks   u64 XXH3-64 of bytes [0, 152 + 8 n_blocks)
 *   then zeros up to header bytes = round_up(160 + 8 n_blocks, 64).
 *
 * Version 1 (136 fixed bytes, every layer, no range) is refused by name.
 */
#include <inttypes.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kv_lib.h"
#include "kv_mem.h"
#include "kv_pack.h"
#include "kv_pack_int.h"
#include "kv_plan_int.h"
#include "kv_wire.h"

#define KV__PACK_FIXED 152u
static const unsigned char kv__pack_magic[8] = {'K', 'V', 'P', 'A', 'C', 'K', '\r', '\n'};

enum {
    OFF_VERSION = 8,
    OFF_FIXED = 12,
    OFF_HEADER = 16,
    OFF_PAYLOAD = 24,
    OFF_TOKENS = 32,
    OFF_BLOCKS = 40,
    OFF_FLAGS = 44,
    OFF_FP = 48,
    OFF_L = 56,
    OFF_B = 64,
    OFF_N = 72,
    OFF_H = 80,
    OFF_D = 88,
    OFF_DTYPE = 96,
    OFF_ORDER = 100,
    OFF_ARRANGE = 104,
    OFF_PACKED = 108,
    OFF_STRIDE = 112,
    OFF_ALIGN = 120,
    OFF_BLOCK_BYTES = 128,
    OFF_LAYER0 = 136,
    OFF_NLAYERS = 144,
};

/* The header size for n blocks: fixed part, checksums, header checksum,
 * zero padding to KV_PACK_ALIGN. */
static uint64_t header_bytes(uint64_t n_blocks)
{
    const uint64_t raw = KV__PACK_FIXED + 8 * n_blocks + 8;
    return (raw + KV_PACK_ALIGN - 1) / KV_PACK_ALIGN * KV_PACK_ALIGN;
}

/* The payload's layout for n_layers packed layers of src: src's blocks as
 * they are (dims, dtype, order, K|V packing), one block, block-major,
 * unpadded, element-aligned, L = n_layers. */
static kv_status wire_layout(const char *fn, const struct kv_layout *src, int64_t n_layers,
                             struct kv_layout *out)
{
    struct kv_layout_config c;
    kv_status st = kv_layout_config_from(src, &c);
    if (st == KV_OK) {
        c.num_layers = n_layers;
        c.num_blocks = 1;
        c.arrange = KV_ARRANGE_BLOCK_MAJOR;
        c.block_pad_elems = 0;
        c.block_stride_bytes = 0;
        c.align_bytes = 0;
        st = kv_layout_init(&c, out);
    }
    return st == KV_OK ? KV_OK : kv__error_wrap(st, "%s: the wire layout", fn);
}

kv_status kv_pack_wire_layout(const struct kv_layout *src, struct kv_layout *out)
{
    static const char fn[] = "kv_pack_wire_layout";
    if (!src || !out)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !src ? "src" : "out");
    kv_status st = kv__plan_check_layout(fn, "source layout", src);
    if (st == KV_OK)
        st = wire_layout(fn, src, src->num_layers, out);
    return st == KV_OK ? kv__ok() : st;
}

/* The layers a pack config packs: [*l0, *l0 + *nl) of src (cfg NULL or
 * n_layers 0: every layer). Only src_layer0 and n_layers are read, so the
 * config of the whole transfer serves both ends. src is a checked layout. */
static kv_status pack_range(const char *fn, const struct kv_layout *src,
                            const struct kv_plan_config *cfg, int64_t *l0, int64_t *nl)
{
    struct kv_plan_config c = KV_PLAN_CONFIG_INIT;
    if (cfg) {
        kv_status st = kv__check_struct_size(fn, "kv_plan_config", cfg->struct_size, sizeof(c));
        if (st != KV_OK)
            return st;
        c = *cfg;
    }
    const int64_t L = src->num_layers;
    if (c.n_layers == 0 && c.src_layer0 != 0)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: n_layers 0 (every layer) needs src_layer0 0, got %" PRId64, fn,
                         c.src_layer0);
    const int64_t n = c.n_layers ? c.n_layers : L;
    if (n < 0 || c.src_layer0 < 0 || c.src_layer0 > L - n)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: layers [%" PRId64 ", %" PRId64 "+%" PRId64
                         ") of a source with L %" PRId64 ": outside the layout",
                         fn, c.src_layer0, c.src_layer0, n, L);
    *l0 = c.src_layer0;
    *nl = n;
    return KV_OK;
}

static kv_status pack_size(const char *fn, const struct kv_layout *src, int64_t n_layers,
                           uint64_t n_tokens, uint64_t *n_blocks, uint64_t *out)
{
    const uint64_t N = (uint64_t)src->block_tokens;
    const uint64_t nb = n_tokens / N + (n_tokens % N != 0);
    /* one payload block: the packed layers, both planes, no padding */
    const uint64_t bb = (uint64_t)n_layers * (uint64_t)src->kv_planes * (uint64_t)src->block_bytes;
    if (nb > UINT32_MAX || (bb != 0 && nb > (UINT64_MAX - header_bytes(nb)) / bb))
        return kv__error(KV_ERR_OVERFLOW,
                         "%s: %" PRIu64 " tokens in %" PRIu64 "-token blocks of %" PRIu64
                         " bytes do not fit one buffer",
                         fn, n_tokens, N, bb);
    *n_blocks = nb;
    *out = header_bytes(nb) + nb * bb;
    return KV_OK;
}

kv_status kv_pack_size(const struct kv_layout *src, const struct kv_plan_config *cfg,
                       uint64_t n_tokens, uint64_t *out_bytes)
{
    static const char fn[] = "kv_pack_size";
    if (!src || !out_bytes)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !src ? "src" : "out_bytes");
    uint64_t nb;
    int64_t l0, nl;
    kv_status st = kv__plan_check_layout(fn, "source layout", src);
    if (st == KV_OK)
        st = pack_range(fn, src, cfg, &l0, &nl);
    if (st == KV_OK)
        st = pack_size(fn, src, nl, n_tokens, &nb, out_bytes);
    return st == KV_OK ? kv__ok() : st;
}

/* The pack plan of layers [l0, l0 + nl) of src into their wire layout. */
static kv_status pack_plan(const char *fn, const struct kv_layout *src, int64_t l0, int64_t nl,
                           kv_plan **out)
{
    struct kv_layout wire;
    kv_status st = wire_layout(fn, src, nl, &wire);
    struct kv_plan_config c = KV_PLAN_CONFIG_INIT;
    c.src_layer0 = l0;
    c.n_layers = nl;
    if (st == KV_OK && (st = kv_plan_create(src, &wire, &c, out)) != KV_OK)
        st = kv__error_wrap(st, "%s", fn);
    return st;
}

kv_status kv_pack_plan_create(const struct kv_layout *src, const struct kv_plan_config *cfg,
                              kv_plan **out)
{
    static const char fn[] = "kv_pack_plan_create";
    if (!src || !out)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !src ? "src" : "out");
    int64_t l0, nl;
    kv_status st = kv__plan_check_layout(fn, "source layout", src);
    if (st == KV_OK)
        st = pack_range(fn, src, cfg, &l0, &nl);
    if (st == KV_OK)
        st = pack_plan(fn, src, l0, nl, out);
    return st == KV_OK ? kv__ok() : st;
}

/* The unpack plan for buffers packed from layout src into caches of layout
 * dst as cfg says (the config between the two caches): cfg resolved by
 * kv_plan_create's validator, then a plan from the wire layout of the
 * packed layers (L = n_layers) onto [dst_layer0, +n_layers) of dst. With
 * info (a buffer's header), the buffer must carry exactly cfg's source
 * layers (KV_ERR_MISMATCH naming both ranges). */
static kv_status unpack_plan(const char *fn, const struct kv_layout *src,
                             const struct kv_layout *dst, const struct kv_plan_config *cfg,
                             const struct kv_pack_info *info, kv_plan **out)
{
    struct kv_plan_config r;
    kv_status st = kv__plan_resolve(fn, src, dst, cfg, &r);
    if (st != KV_OK)
        return st;
    if (info && (r.src_layer0 != info->src_layer0 || r.n_layers != info->n_layers))
        return kv__error(KV_ERR_MISMATCH,
                         "%s: the buffer carries layers [%" PRId64 ", %" PRId64 "+%" PRId64
                         ") of a source with L %" PRId64 "; the config unpacks [%" PRId64
                         ", %" PRId64 "+%" PRId64 ")",
                         fn, info->src_layer0, info->src_layer0, info->n_layers, src->num_layers,
                         r.src_layer0, r.src_layer0, r.n_layers);
    struct kv_layout wire;
    if ((st = wire_layout(fn, src, r.n_layers, &wire)) != KV_OK)
        return st;
    struct kv_plan_config w = r;
    w.src_layer0 = 0;
    if ((st = kv_plan_create(&wire, dst, &w, out)) != KV_OK)
        return kv__error_wrap(st, "%s", fn);
    (*out)->wire_layer0 = r.src_layer0;
    return KV_OK;
}

kv_status kv_unpack_plan_create(const struct kv_layout *src, const struct kv_layout *dst,
                                const struct kv_plan_config *cfg, kv_plan **out)
{
    static const char fn[] = "kv_unpack_plan_create";
    if (!src || !dst || !out)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !src ? "src" : !dst ? "dst" : "out");
    *out = NULL;
    kv_status st = unpack_plan(fn, src, dst, cfg, NULL, out);
    return st == KV_OK ? kv__ok() : st;
}

/* Threads for a CPU pass over `bytes`: one below 256 KiB (a team costs
 * more than it saves), the kernels' count above. */
static int pass_threads(uint64_t bytes)
{
    return bytes < ((uint64_t)256 << 10) ? 1 : kv_threads();
}

static kv_status check_buffer_overlap(const char *fn, const void *buf, uint64_t bytes,
                                      const struct kv_paged_cache *c, const char *side)
{
    const uintptr_t a = (uintptr_t)buf, b = a + bytes;
    const uintptr_t ca = (uintptr_t)c->base, cb = ca + c->storage_bytes;
    if (bytes > 0 && a < cb && ca < b)
        return kv__error(KV_ERR_OVERLAP,
                         "%s: the buffer [%p, %p) overlaps the %s cache's storage [%p, %p)", fn,
                         (void *)a, (void *)b, side, (void *)ca, (void *)cb);
    return KV_OK;
}

kv_status kv_pack(const kv_plan *plan, struct kv_paged_cache src, const uint32_t *blocks,
                  uint32_t n_blocks, uint64_t n_tokens, void *buf, size_t cap, size_t *out_bytes,
                  const struct kv_plan_config *cfg)
{
    static const char fn[] = "kv_pack";
    if (!out_bytes)
        return kv__error(KV_ERR_NULL, "%s: out_bytes is NULL", fn);
    kv_status st = kv_paged_check(&src, false);
    if (st != KV_OK)
        return kv__error_wrap(st, "%s: source cache", fn);
    const struct kv_layout *lo = &src.layout;
    /* the packed layers: the plan's (checked against this cache and its
     * wire layout), else cfg's */
    int64_t l0, nl;
    struct kv_layout wire;
    if (plan) {
        l0 = plan->cfg.src_layer0;
        nl = plan->cfg.n_layers;
        const bool mine = plan->src.fingerprint == lo->fingerprint && nl <= lo->num_layers &&
                          wire_layout(fn, lo, nl, &wire) == KV_OK &&
                          plan->dst.fingerprint == wire.fingerprint && plan->cfg.dst_layer0 == 0 &&
                          plan->cfg.n_heads == lo->num_heads;
        if (!mine)
            return kv__error(
                KV_ERR_INVALID_ARG,
                "%s: the plan moves 0x%016" PRIx64 " -> 0x%016" PRIx64 " (layers [%" PRId64
                ", %" PRId64 "+%" PRId64 ")), not this cache's layout 0x%016" PRIx64
                " into the wire layout of those layers"
                " (build it with kv_pack_plan_create)",
                fn, plan->src.fingerprint, plan->dst.fingerprint, l0, l0, nl, lo->fingerprint);
    } else if ((st = pack_range(fn, lo, cfg, &l0, &nl)) != KV_OK ||
               (st = wire_layout(fn, lo, nl, &wire)) != KV_OK) {
        return st;
    }
    uint64_t need_blocks, size;
    if ((st = pack_size(fn, lo, nl, n_tokens, &need_blocks, &size)) != KV_OK)
        return st;
    if (n_blocks != need_blocks)
        return kv__error(KV_ERR_BAD_SHAPE,
                         "%s: %u blocks for a request of %" PRIu64 " tokens in %" PRId64
                         "-token blocks, which needs %" PRIu64,
                         fn, n_blocks, n_tokens, lo->block_tokens, need_blocks);
    if ((st = kv__plan_check_ids(fn, "src", blocks, n_blocks, lo->num_blocks)) != KV_OK)
        return st;
    if (cap < size) {
        *out_bytes = (size_t)size;
        return kv__error(KV_ERR_CAPACITY,
                         "%s: a buffer of %zu bytes; this request packs into %" PRIu64, fn, cap,
                         size);
    }
    if (!buf)
        return kv__error(KV_ERR_NULL, "%s: buf is NULL", fn);
    if ((uintptr_t)buf % (uintptr_t)lo->elem_bytes != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: buf %p is not aligned to the %" PRId64 "-byte elements", fn, buf,
                         lo->elem_bytes);
    if ((st = check_buffer_overlap(fn, buf, size, &src, "source")) != KV_OK)
        return st;
    /* the ids are read while the packed bytes are written: one overwritten
     * before it is read would be an id nobody checked */
    const uintptr_t ia = (uintptr_t)blocks, ib = ia + (uintptr_t)n_blocks * sizeof(*blocks);
    if (n_blocks > 0 && ia < (uintptr_t)buf + size && (uintptr_t)buf < ib)
        return kv__error(KV_ERR_OVERLAP,
                         "%s: src_blocks [%p, %p) lies in the buffer [%p, +%" PRIu64
                         ") the pack writes",
                         fn, (void *)ia, (void *)ib, buf, size);
    kv_plan *own = NULL;
    if (!plan && (st = pack_plan(fn, lo, l0, nl, &own)) != KV_OK)
        return st;
    const kv_plan *p = plan ? plan : own;
    const uint64_t hdr = header_bytes(n_blocks), bb = (uint64_t)wire.stride_block_bytes;
    unsigned char *h = buf;
    char *payload = (char *)buf + hdr;
    const int64_t nb = n_blocks, N = lo->block_tokens, sbs = lo->stride_block_bytes;

    /* each block copied into its payload slot and hashed in one read of the
     * source when the payload block is written front to back (always, for
     * the wire layout; kept general), else hashed after the block's copy;
     * a large pack streams its stores (kv_pack_int.h) */
    const bool seq = kv__plan_is_sequential(p, (int64_t)bb);
    const bool nt = kv__pack_use_nt(size);
#pragma omp parallel for num_threads(pass_threads(size)) schedule(static)
    for (int64_t i = 0; i < nb; i++) {
        const char *sp = (const char *)src.base + (int64_t)blocks[i] * sbs;
        char *dp = payload + (uint64_t)i * bb;
        uint64_t sum;
        if (seq) {
            sum = kv__pack_copy_hash(p, sp, dp, nt);
        } else {
            kv__pack_exec(p, &sp, 1, &dp, 1, (uint64_t)N, 1, false, false);
            sum = kv__xxh3_64(dp, bb);
        }
        kv__le_put64(h + KV__PACK_FIXED + 8 * (uint64_t)i, sum);
    }
    memcpy(h, kv__pack_magic, 8);
    kv__le_put32(h + OFF_VERSION, KV_PACK_VERSION);
    kv__le_put32(h + OFF_FIXED, KV__PACK_FIXED);
    kv__le_put64(h + OFF_HEADER, hdr);
    kv__le_put64(h + OFF_PAYLOAD, (uint64_t)n_blocks * bb);
    kv__le_put64(h + OFF_TOKENS, n_tokens);
    kv__le_put32(h + OFF_BLOCKS, n_blocks);
    kv__le_put32(h + OFF_FLAGS, 0);
    kv__le_put64(h + OFF_FP, lo->fingerprint);
    kv__le_put64(h + OFF_L, (uint64_t)lo->num_layers);
    kv__le_put64(h + OFF_B, (uint64_t)lo->num_blocks);
    kv__le_put64(h + OFF_N, (uint64_t)lo->block_tokens);
    kv__le_put64(h + OFF_H, (uint64_t)lo->num_heads);
    kv__le_put64(h + OFF_D, (uint64_t)lo->head_dim);
    kv__le_put32(h + OFF_DTYPE, (uint32_t)lo->dtype);
    kv__le_put32(h + OFF_ORDER, (uint32_t)lo->order);
    kv__le_put32(h + OFF_ARRANGE, (uint32_t)lo->arrange);
    kv__le_put32(h + OFF_PACKED, lo->kv_packed ? 1u : lo->k_only ? 2u : 0u);
    kv__le_put64(h + OFF_STRIDE, (uint64_t)lo->block_stride_bytes);
    kv__le_put64(h + OFF_ALIGN, (uint64_t)lo->align_bytes);
    kv__le_put64(h + OFF_BLOCK_BYTES, bb);
    kv__le_put64(h + OFF_LAYER0, (uint64_t)l0);
    kv__le_put64(h + OFF_NLAYERS, (uint64_t)nl);
    const uint64_t sum_at = KV__PACK_FIXED + 8 * (uint64_t)n_blocks;
    kv__le_put64(h + sum_at, kv__xxh3_64(h, sum_at));
    memset(h + sum_at + 8, 0, hdr - sum_at - 8);
    kv_plan_destroy(own);
    *out_bytes = (size_t)size;
    return kv__ok();
}

/* kv_pack_inspect without touching the last error on success. */
static kv_status inspect(const char *fn, const unsigned char *b, size_t len,
                         struct kv_pack_info *out)
{
    if (len < 8)
        return kv__error(KV_ERR_CORRUPT, "%s: truncated: %zu bytes, shorter than the 8-byte magic",
                         fn, len);
    if (memcmp(b, kv__pack_magic, 8) != 0)
        return kv__error(KV_ERR_MISMATCH,
                         "%s: not a kvcache pack buffer: magic %02x %02x %02x %02x %02x %02x "
                         "%02x %02x, expected \"KVPACK\\r\\n\"",
                         fn, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]);
    if (len < 16)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: truncated: %zu bytes, shorter than the 16-byte preamble", fn, len);
    const uint32_t version = kv__le_get32(b + OFF_VERSION);
    if (version != KV_PACK_VERSION)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: format version %u; this library reads version %u only%s", fn, version,
                         KV_PACK_VERSION,
                         version == 1 ? " (version 1 carried every layer and no layer range: "
                                        "pack it again with this library)"
                                      : "");
    const uint32_t fixed = kv__le_get32(b + OFF_FIXED);
    if (fixed != KV__PACK_FIXED)
        return kv__error(KV_ERR_CORRUPT, "%s: fixed header of %u bytes; version %u has %u", fn,
                         fixed, version, KV__PACK_FIXED);
    if (len < KV__PACK_FIXED)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: truncated: %zu bytes, shorter than the %u-byte fixed header", fn, len,
                         KV__PACK_FIXED);
    const uint32_t nb = kv__le_get32(b + OFF_BLOCKS);
    const uint64_t hdr = kv__le_get64(b + OFF_HEADER), want_hdr = header_bytes(nb);
    if (hdr != want_hdr)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: header bytes %" PRIu64 ", but %u blocks make a header of %" PRIu64,
                         fn, hdr, nb, want_hdr);
    if (len < hdr)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: truncated: %zu bytes, shorter than the %" PRIu64 "-byte header", fn,
                         len, hdr);
    const uint64_t sum_at = KV__PACK_FIXED + 8 * (uint64_t)nb;
    const uint64_t sum = kv__le_get64(b + sum_at), want_sum = kv__xxh3_64(b, sum_at);
    if (sum != want_sum)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: header checksum 0x%016" PRIx64 ", the header hashes to 0x%016" PRIx64,
                         fn, sum, want_sum);
    for (uint64_t i = sum_at + 8; i < hdr; i++)
        if (b[i] != 0)
            return kv__error(KV_ERR_CORRUPT,
                             "%s: header padding byte %" PRIu64 " is 0x%02x, not zero", fn, i,
                             b[i]);
    const uint32_t flags = kv__le_get32(b + OFF_FLAGS), packed = kv__le_get32(b + OFF_PACKED);
    if (flags != 0 || packed > 2)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: flags 0x%x (version 2 defines none), planes %u (0 K and V, 1 "
                         "packed K|V, 2 K only)",
                         fn, flags, packed);
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    c.num_layers = (int64_t)kv__le_get64(b + OFF_L);
    c.num_blocks = (int64_t)kv__le_get64(b + OFF_B);
    c.block_tokens = (int64_t)kv__le_get64(b + OFF_N);
    c.num_heads = (int64_t)kv__le_get64(b + OFF_H);
    c.head_dim = (int64_t)kv__le_get64(b + OFF_D);
    c.dtype = (kv_dtype)kv__le_get32(b + OFF_DTYPE);
    c.order = (kv_order)kv__le_get32(b + OFF_ORDER);
    c.arrange = (kv_arrange)kv__le_get32(b + OFF_ARRANGE);
    c.kv_packed = packed == 1;
    c.k_only = packed == 2;
    c.block_stride_bytes = (int64_t)kv__le_get64(b + OFF_STRIDE);
    c.align_bytes = (int64_t)kv__le_get64(b + OFF_ALIGN);
    struct kv_pack_info info = {.version = version, .n_blocks = nb, .header_bytes = hdr};
    kv_status st = kv_layout_init(&c, &info.source);
    if (st != KV_OK)
        return kv__error_wrap(KV_ERR_CORRUPT, "%s: the source layout in the header", fn);
    const uint64_t fp = kv__le_get64(b + OFF_FP);
    if (fp != info.source.fingerprint)
        return kv__error(KV_ERR_MISMATCH,
                         "%s: the header's layout has fingerprint 0x%016" PRIx64
                         ", the header records 0x%016" PRIx64
                         " (another fingerprint scheme, or a forged header)",
                         fn, info.source.fingerprint, fp);
    if ((st = kv__plan_check_layout(fn, "the source layout in the header", &info.source)) != KV_OK)
        return st;
    /* the packed layers, inside the source (u64 compares: any value) */
    const uint64_t l0 = kv__le_get64(b + OFF_LAYER0), nl = kv__le_get64(b + OFF_NLAYERS);
    const uint64_t L = (uint64_t)info.source.num_layers;
    if (nl == 0 || nl > L || l0 > L - nl)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: packed layers [%" PRIu64 ", %" PRIu64 "+%" PRIu64
                         ") of a source with L %" PRIu64 ": outside the layout",
                         fn, l0, l0, nl, L);
    info.src_layer0 = (int64_t)l0;
    info.n_layers = (int64_t)nl;
    if ((st = wire_layout(fn, &info.source, info.n_layers, &info.wire)) != KV_OK)
        return st;
    info.n_tokens = kv__le_get64(b + OFF_TOKENS);
    const uint64_t N = (uint64_t)info.source.block_tokens;
    const uint64_t need = info.n_tokens / N + (info.n_tokens % N != 0);
    if (need != nb)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: %u blocks for %" PRIu64 " tokens in %" PRIu64
                         "-token blocks (%" PRIu64 " expected)",
                         fn, nb, info.n_tokens, N, need);
    info.block_bytes = kv__le_get64(b + OFF_BLOCK_BYTES);
    if (info.block_bytes != (uint64_t)info.wire.stride_block_bytes)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: payload blocks of %" PRIu64
                         " bytes; the layout's blocks are %" PRId64,
                         fn, info.block_bytes, info.wire.stride_block_bytes);
    info.payload_bytes = kv__le_get64(b + OFF_PAYLOAD);
    /* the product first checked not to wrap: a forged layout of 2^62-byte
     * blocks times 4 is 0 in 64 bits, and a 0-byte payload passed */
    if ((info.block_bytes && nb > (UINT64_MAX - hdr) / info.block_bytes) ||
        info.payload_bytes != (uint64_t)nb * info.block_bytes ||
        info.payload_bytes > UINT64_MAX - hdr)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: payload of %" PRIu64 " bytes for %u blocks of %" PRIu64, fn,
                         info.payload_bytes, nb, info.block_bytes);
    info.total_bytes = hdr + info.payload_bytes;
    *out = info;
    return KV_OK;
}

kv_status kv_pack_inspect(const void *buf, size_t len, struct kv_pack_info *out)
{
    static const char fn[] = "kv_pack_inspect";
    if (!buf || !out)
        return kv__error(KV_ERR_NULL, "%s: %s is NULL", fn, !buf ? "buf" : "out");
    kv_status st = inspect(fn, buf, len, out);
    return st == KV_OK ? kv__ok() : st;
}

kv_status kv_unpack(const kv_plan *plan, const void *buf, size_t len, struct kv_paged_cache dst,
                    const uint32_t *dst_blocks, uint32_t n_dst, const struct kv_plan_config *cfg)
{
    static const char fn[] = "kv_unpack";
    if (!buf)
        return kv__error(KV_ERR_NULL, "%s: buf is NULL", fn);
    struct kv_pack_info info;
    kv_status st = inspect(fn, buf, len, &info);
    if (st != KV_OK)
        return st;
    if (len < info.total_bytes)
        return kv__error(KV_ERR_CORRUPT,
                         "%s: truncated payload: %zu bytes of a %" PRIu64 "-byte buffer (%" PRIu64
                         " header + %u blocks of %" PRIu64 ")",
                         fn, len, info.total_bytes, info.header_bytes, info.n_blocks,
                         info.block_bytes);
    const char *payload = (const char *)buf + info.header_bytes;
    if ((uintptr_t)payload % (uintptr_t)info.source.elem_bytes != 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: the payload at %p is not aligned to the %" PRId64 "-byte elements",
                         fn, (const void *)payload, info.source.elem_bytes);
    if ((st = kv_paged_check(&dst, false)) != KV_OK)
        return kv__error_wrap(st, "%s: destination cache", fn);
    kv_plan *own = NULL;
    if (plan) {
        if (plan->wire_layer0 != info.src_layer0 || plan->src.num_layers != info.n_layers)
            return kv__error(KV_ERR_MISMATCH,
                             "%s: the buffer carries layers [%" PRId64 ", %" PRId64 "+%" PRId64
                             ") of its source; the plan unpacks [%" PRId64 ", %" PRId64 "+%" PRId64
                             ") (build it with kv_unpack_plan_create for the "
                             "packed range)",
                             fn, info.src_layer0, info.src_layer0, info.n_layers, plan->wire_layer0,
                             plan->wire_layer0, plan->src.num_layers);
        if (plan->src.fingerprint != info.wire.fingerprint ||
            plan->dst.fingerprint != dst.layout.fingerprint)
            return kv__error(KV_ERR_INVALID_ARG,
                             "%s: the plan moves 0x%016" PRIx64 " -> 0x%016" PRIx64
                             ", not this buffer's wire layout 0x%016" PRIx64
                             " into the destination's 0x%016" PRIx64
                             " (build it with kv_unpack_plan_create)",
                             fn, plan->src.fingerprint, plan->dst.fingerprint,
                             info.wire.fingerprint, dst.layout.fingerprint);
    } else if ((st = unpack_plan(fn, &info.source, &dst.layout, cfg, &info, &own)) != KV_OK) {
        return st;
    }
    const kv_plan *p = plan ? plan : own;
    const uint64_t need = kv__plan_blocks(&dst.layout, info.n_tokens);
    const char **sp = NULL;
    if (n_dst != need)
        st = kv__error(KV_ERR_BAD_SHAPE,
                       "%s: %u destination blocks for %" PRIu64 " tokens in %" PRId64
                       "-token blocks, which need %" PRIu64,
                       fn, n_dst, info.n_tokens, dst.layout.block_tokens, need);
    if (st == KV_OK)
        st = kv__plan_check_ids(fn, "dst", dst_blocks, n_dst, dst.layout.num_blocks);
    if (st == KV_OK)
        st = kv__plan_check_unique(fn, dst_blocks, n_dst, NULL, 0);
    if (st == KV_OK)
        st = check_buffer_overlap(fn, buf, info.total_bytes, &dst, "destination");
    if (st == KV_OK && info.n_blocks + (uint64_t)n_dst > 0 &&
        !(sp = kv__mem_alloc(((size_t)info.n_blocks + n_dst) * sizeof(*sp))))
        st = kv__error(KV_ERR_NO_MEMORY, "%s: %u + %u block addresses", fn, info.n_blocks, n_dst);
    /* Every refusal above came before any write. Now the payload: hashed
     * and copied in one read where a plan moves one payload block to one
     * destination block (the same page size), else verified whole and then
     * copied. A failed checksum zeroes what the request writes, in every
     * listed block (kv_pack.h), and names the lowest failing block. */
    const int64_t nb = info.n_blocks;
    const uint64_t bb = info.block_bytes;
    const unsigned char *sums = (const unsigned char *)buf + KV__PACK_FIXED;
    char **dp = sp ? (char **)(sp + nb) : NULL;
    int64_t bad = nb;
    if (st == KV_OK && sp) {
        for (int64_t i = 0; i < nb; i++)
            sp[i] = payload + (uint64_t)i * bb;
        for (uint32_t j = 0; j < n_dst; j++)
            dp[j] = (char *)dst.base + (int64_t)dst_blocks[j] * dst.layout.stride_block_bytes;
        const bool nt = kv__pack_use_nt(info.payload_bytes);
        if (p->stats.window_src_blocks == 1 && p->stats.window_dst_blocks == 1) {
            /* payload block i -> destination block i: one read of the
             * payload from memory when the plan reads it front to back
             * (64 KiB chunks hashed, then their rows written from cache),
             * else the block hashed, then copied while it is still in
             * cache */
            const bool seq = kv__pack_reads_sequential(p, (int64_t)bb);
            const uint64_t W = (uint64_t)p->stats.window_tokens;
#pragma omp parallel for num_threads(pass_threads(info.payload_bytes)) schedule(static)            \
    reduction(min                                                                                  \
              : bad)
            for (int64_t i = 0; i < nb; i++) {
                uint64_t sum;
                if (seq) {
                    sum = kv__pack_copy_hash_src(p, sp[i], dp[i], (int64_t)bb, nt);
                } else {
                    sum = kv__xxh3_64(sp[i], bb);
                    kv__pack_exec(p, &sp[i], 1, &dp[i], 1, W, 1, nt, false);
                }
                if (i < bad && sum != kv__le_get64(sums + 8 * (uint64_t)i))
                    bad = i;
            }
        } else {
#pragma omp parallel for num_threads(pass_threads(info.payload_bytes)) schedule(static)            \
    reduction(min                                                                                  \
              : bad)
            for (int64_t i = 0; i < nb; i++)
                if (i < bad && kv__xxh3_64(sp[i], bb) != kv__le_get64(sums + 8 * (uint64_t)i))
                    bad = i;
            /* last verified, first copied: the payload's tail is still in cache */
            if (bad == nb)
                kv__pack_exec(p, sp, (uint32_t)nb, dp, n_dst, info.n_tokens, 0, nt, true);
        }
        if (bad < nb) {
            kv__pack_zero(p, dp, (uint32_t)nb, n_dst, info.n_tokens);
            st = kv__error(KV_ERR_CORRUPT,
                           "%s: block %" PRId64 " of %" PRId64 " fails its checksum: 0x%016" PRIx64
                           " recorded, 0x%016" PRIx64 " computed; the %u destination blocks' "
                           "unpacked layers are zeroed",
                           fn, bad, nb, kv__le_get64(sums + 8 * (uint64_t)bad),
                           (uint64_t)kv__xxh3_64(sp[bad], bb), n_dst);
        }
    }
    kv__mem_free(sp);
    kv_plan_destroy(own);
    return st == KV_OK ? kv__ok() : st;
}
